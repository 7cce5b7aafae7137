#!/usr/bin/env bash
# FerroCCL's test command (the README's, and what CI runs): format and lint checks (also
# of the `verbs` feature, installing its build dependencies when missing), then every
# test: unit, property, and the multi-process suite that launches real ranks over real
# shared memory and TCP through ferroccl-run. The verbs tests need an RDMA device: CI runs
# them in a soft-RoCE VM (tools/softroce/ci.sh, after this script).
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

# The `verbs` feature builds rdma-sys, which needs these at build time. Installed when
# missing and this runs as root (CI); otherwise the verbs build check is skipped, saying so.
verbs_pkgs=(libibverbs-dev librdmacm-dev libclang-dev pkg-config)
missing=()
for p in "${verbs_pkgs[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
done
verbs=1
if [ ${#missing[@]} -gt 0 ]; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        echo "== apt-get install ${missing[*]} (build dependencies of the verbs feature)"
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null \
            || { echo "scripts/test.sh: apt-get install ${missing[*]} failed" >&2; exit 1; }
    else
        echo "== skipping the verbs build check: install ${missing[*]} (as root: apt-get install ${missing[*]})"
        verbs=0
    fi
fi

echo "== cargo fmt --check"
cargo fmt --all -- --check
echo "== cargo clippy (warnings are errors)"
cargo clippy --workspace --all-targets --locked -- -D warnings
if [ "$verbs" = 1 ]; then
    echo "== cargo clippy with the verbs feature (warnings are errors)"
    cargo clippy --workspace --all-targets --locked --features ferroccl/verbs,ferroccl-verbs/verbs -- -D warnings
fi
echo "== cargo doc (warnings are errors: broken or private links in public docs)"
RUSTDOCFLAGS="-D warnings" cargo doc --workspace --no-deps --locked
echo "== cargo test"
cargo test --workspace --locked
