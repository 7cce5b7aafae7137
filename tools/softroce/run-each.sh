#!/bin/bash
# Runs each cargo test binary given as an argument with --test-threads=1 (in the VM, via
# ci.sh); exits 1 if any failed, after running them all.
rc=0
for t in "$@"; do
    echo "=== $t"
    "$t" --test-threads=1 || { echo "=== FAILED: $t"; rc=1; }
done
exit $rc
