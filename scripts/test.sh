#!/usr/bin/env bash
# FerroCCL's test command (the README's, and what CI runs): format and lint checks, then
# every test: unit, property, and the multi-process suite that launches real ranks over
# real shared memory and TCP through ferroccl-run.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v cargo >/dev/null 2>&1; then
    echo "scripts/test.sh: cargo not found; install Rust (rustup) first" >&2
    exit 1
fi
for tool in clippy fmt; do
    if ! cargo "$tool" --version >/dev/null 2>&1; then
        echo "scripts/test.sh: cargo $tool missing, adding it with rustup" >&2
        rustup component add "$( [ "$tool" = fmt ] && echo rustfmt || echo clippy )"
    fi
done

echo "== cargo fmt --check"
cargo fmt --all -- --check
echo "== cargo clippy (warnings are errors)"
cargo clippy --workspace --all-targets --locked -- -D warnings
echo "== cargo test"
cargo test --workspace --locked
