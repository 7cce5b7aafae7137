#!/bin/bash
# Runs inside the soft-RoCE VM (via ci.sh): the whole verbs suite in one boot.
#   verbs-suite.sh BIN_DIR TEST_BINARY...
# 1. every TEST_BINARY (ferroccl-verbs' tests, then ferroccl's conformance suite filtered
#    to its verbs instantiation, `verbs::`), --test-threads=1; a binary that runs no test
#    (a filter that no longer matches) fails;
# 2. multi-process collectives over verbs (ferroccl-run + ferroccl-selftest coll from
#    BIN_DIR), 2, 3 and 4 ranks, checked against the reference by every rank;
#    then the progress engine (non-blocking collectives, plans, groups; ferroccl-selftest
#    engine), the M->N weight sync (ferroccl-selftest weights, 2 and 3 ranks) and abort
#    over verbs;
# 3. a rank SIGKILLed mid-barrier and mid-transfer: every survivor must report an error
#    naming it, and the launcher must exit with the victim's status;
# 4. two "hosts" in the VM (rxe0 and rxe1, two-hosts.sh): collectives over a mixed mesh
#    (FERROCCL_TRANSPORT=auto: shm inside a host, verbs across), and a rank killed on the
#    other host, which only verbs itself can notice (no process watch across hosts).
# Exits 1 if anything failed, after running everything.
set -u
bin_dir=$1
shift
rc=0
fail() { echo "=== FAILED: $*"; rc=1; }
secs() { echo "$(( $(date +%s%N) / 1000000 - $1 ))"; }

tests_out=$(mktemp)
for t in "$@"; do
    filter=()
    case "$(basename "$t")" in conformance-*) filter=(verbs::) ;; esac
    echo "=== $t ${filter[*]}"
    "$t" "${filter[@]}" --test-threads=1 2>&1 | tee "$tests_out"
    [ "${PIPESTATUS[0]}" -eq 0 ] || fail "$t"
    grep -qE '^test result: .* [1-9][0-9]* passed' "$tests_out" || fail "$t ${filter[*]}: no test ran"
done
rm -f "$tests_out"

run=("$bin_dir/ferroccl-run" --transport verbs --timeout 120)
selftest="$bin_dir/ferroccl-selftest"

wrap=()   # two-hosts-rank.sh in part 4
coll() { # coll N COUNTS
    local n=$1 counts=$2 t0 out
    t0=$(( $(date +%s%N) / 1000000 ))
    out=$("${run[@]}" -n "$n" -- "${wrap[@]}" "$selftest" coll --counts "$counts" 2>&1)
    local st=$?
    echo "=== collectives over ${run[2]}${wrap:+ (two hosts)}, $n ranks, counts $counts: exit $st in $(secs "$t0") ms"
    [ "$st" -eq 0 ] || { echo "$out" | tail -20; fail "collectives, $n ranks"; return; }
    [ "$(grep -c 'collectives ok' <<< "$out")" -eq "$n" ] || { echo "$out" | tail -20; fail "collectives, $n ranks: not every rank checked"; }
}
coll 2 0,1,7,1000,65537,300000
coll 3 0,1,7,1000,65537
coll 4 0,1,7,1000,65537,300000
coll 2 524288   # 2 MiB of f32 per rank (allgather: 4 MiB out)

# The progress engine over verbs: non-blocking collectives in flight together, persistent
# plans run many times, a fused group; and abort telling the peer.
engine() { # engine N
    local n=$1 t0 out
    t0=$(( $(date +%s%N) / 1000000 ))
    out=$("${run[@]}" -n "$n" -- "$selftest" engine --runs 50 2>&1)
    local st=$?
    echo "=== engine (non-blocking, plans, groups) over ${run[2]}, $n ranks: exit $st in $(secs "$t0") ms"
    [ "$st" -eq 0 ] && [ "$(grep -c 'engine ok' <<< "$out")" -eq "$n" ] || { echo "$out" | tail -20; fail "engine, $n ranks"; }
}
engine 2
engine 3
# M->N weight sync over verbs (ferroccl-selftest weights): the first half of the ranks
# train, the others pull and check every byte of every version.
weights() { # weights N
    local n=$1 t0 out
    t0=$(( $(date +%s%N) / 1000000 ))
    out=$("${run[@]}" -n "$n" -- "$selftest" weights --versions 5 2>&1)
    local st=$?
    echo "=== weight sync over ${run[2]}, $n ranks: exit $st in $(secs "$t0") ms"
    [ "$st" -eq 0 ] && [ "$(grep -c 'weights ok' <<< "$out")" -eq "$n" ] || { echo "$out" | tail -20; fail "weights, $n ranks"; }
}
weights 2
weights 3
out=$("${run[@]}" -n 2 -- "$selftest" abort 2>&1)
st=$?
echo "=== abort over ${run[2]}: exit $st; $(grep -c 'aborted after' <<< "$out") ranks aborted"
[ "$st" -eq 0 ] && grep -q 'rank 1 aborted after .*by rank 0' <<< "$out" || { echo "$out" | tail -20; fail "abort over verbs"; }

killed() { # killed DURING [N VICTIM]
    local n=${2:-3} victim=${3:-1} t0 out
    t0=$(( $(date +%s%N) / 1000000 ))
    # --grace 30: a dead peer on another host is seen only when the transport gives up
    # retrying (FERROCCL_IB_TIMEOUT), seconds; the launcher must not kill the survivors first.
    out=$("${run[@]}" --grace 30 -n "$n" -- "${wrap[@]}" "$selftest" kill --victim "$victim" --during "$1" 2>&1)
    local st=$?
    echo "=== rank $victim of $n killed during $1 over ${run[2]}${wrap:+ (two hosts)}: launcher exit $st in $(secs "$t0") ms"
    echo "$out" | grep -E 'saw the failure|killed by signal'
    [ "$st" -eq 137 ] || fail "kill during $1: launcher exit $st, expected 137 (the victim's SIGKILL)"
    for r in $(seq 0 $((n - 1))); do
        [ "$r" -eq "$victim" ] && continue
        grep -E "^\[$r\] selftest: rank $r saw the failure after .*rank $victim" <<< "$out" >/dev/null \
            || { echo "$out" | tail -20; fail "kill during $1: rank $r did not report an error naming rank $victim"; }
    done
}
killed barrier
killed transfer

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=two-hosts.sh
. "$here/two-hosts.sh"
if two_hosts_setup; then
    echo "=== two hosts: rxe0 (GID $FERROCCL_TWO_HOSTS_GID_A) and rxe1 (GID $FERROCCL_TWO_HOSTS_GID_B)"
    run=("$bin_dir/ferroccl-run" --transport auto --timeout 120)
    wrap=("$here/two-hosts-rank.sh")
    # auto must pick shm inside a host and verbs across: rank 0 (host A) lists its peers.
    out=$("${run[@]}" -n 4 -- "${wrap[@]}" "$selftest" exchange --sizes 0,1,70000,1M 2>&1)
    st=$?
    echo "=== exchange over auto (two hosts), 4 ranks: exit $st; $(grep '^\[0\] .*exchanged' <<< "$out")"
    [ "$st" -eq 0 ] && grep -q '^\[0\] .*exchanged.*(1:shm 2:verbs 3:verbs)' <<< "$out" \
        || { echo "$out" | tail -20; fail "two hosts: exchange, or the transports auto chose"; }
    coll 4 0,1,7,1000,65537
    killed barrier 2 1
    killed transfer 4 3
else
    fail "setting up the second rxe device (two-hosts.sh)"
fi
exit $rc
