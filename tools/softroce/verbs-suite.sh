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
#    naming it, the launcher must exit with the victim's status and name it the culprit
#    (the flight records' verdict); a rank that skips a collective and finalizes (every
#    rank fails naming it; the verdict blames it); survivors of a kill shrink and carry on
#    (ferroccl-selftest shrink); a kill fails only the communicators with the victim
#    (ferroccl-selftest scope --case kill), and survivors shrink a split and the world
#    (scope --case shrink); a rank dying inside a shrink, and two shrinks in a row, with
#    the killed processes named by launch rank;
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
    grep -q "^ferroccl-run: culprit: rank $victim " <<< "$out" \
        || { echo "$out" | tail -20; fail "kill during $1: the launcher did not name rank $victim the culprit"; }
}
killed barrier
killed transfer

# A rank that skips a collective and finalizes: every rank fails, naming it; the launcher's
# verdict blames it.
out=$("${run[@]}" -n 2 -- "$selftest" fault --case skip --count 1000 2>&1)
st=$?
echo "=== skip over ${run[2]}: exit $st"
echo "$out" | grep -E 'culprit|parted'
[ "$st" -ne 0 ] && grep -q 'rank 1 finalized the communicator after call #1' <<< "$out" \
    && grep -q '^ferroccl-run: culprit: rank 1 ' <<< "$out" || { echo "$out" | tail -20; fail "skip over verbs"; }

# Survivors of a kill shrink and carry on (3 ranks, rank 1 killed).
out=$("${run[@]}" --grace 30 -n 3 -- "$selftest" shrink --victim 1 2>&1)
st=$?
echo "=== shrink over ${run[2]}: exit $st"
echo "$out" | grep -E 'shrank'
[ "$st" -eq 137 ] && [ "$(grep -c 'shrank to rank' <<< "$out")" -eq 2 ] || { echo "$out" | tail -20; fail "shrink over verbs"; }

# Faults during recovery (4 ranks): rank 2 dies inside the shrink after rank 1's kill
# (the survivors try again without it), then two shrinks in a row (ranks 1, then 3
# killed): the verdict names both killed processes by launch rank.
out=$(FERROCCL_INJECT_FAULT=shrink@2 "${run[@]}" --grace 30 -n 4 -- "$selftest" shrink --victim 1 --dies-in-shrink 2 2>&1)
st=$?
echo "=== death during shrink over ${run[2]}: exit $st"
echo "$out" | grep -E 'shrank'
[ "$st" -ne 0 ] && [ "$(grep -c 'shrank to rank . of 2 ' <<< "$out")" -eq 2 ] \
    && grep -q '^ferroccl-run: culprit: rank 1 (.*), rank 2 (' <<< "$out" || { echo "$out" | tail -20; fail "death during shrink over verbs"; }
out=$("${run[@]}" --grace 30 -n 4 -- "$selftest" shrink --victim 1,3 2>&1)
st=$?
echo "=== two shrinks over ${run[2]}: exit $st"
echo "$out" | grep -E 'shrank|culprit'
[ "$st" -eq 137 ] && [ "$(grep -c 'shrank to rank . of 2 ' <<< "$out")" -eq 2 ] \
    && grep -q '^ferroccl-run: culprit: rank 1 (.*), rank 3 (' <<< "$out" || { echo "$out" | tail -20; fail "two shrinks over verbs"; }

# A kill fails only the communicators with the victim (4 ranks, rank 3 killed): ranks 0
# and 1 carry on with their pair.
out=$("${run[@]}" --grace 30 -n 4 -- "$selftest" scope --case kill 2>&1)
st=$?
echo "=== scope over ${run[2]}: exit $st"
echo "$out" | grep -E 'scope kill' | cut -c1-160
[ "$st" -eq 137 ] && [ "$(grep -c 'pair and sub carried on: 400 calls checked' <<< "$out")" -eq 2 ] \
    && grep -q '^\[2\] selftest: rank 2 scope kill: .*; pair failed: ' <<< "$out" || { echo "$out" | tail -20; fail "scope over verbs"; }

# Survivors shrink a split that lost the victim ({1, 2, 3} -> {1, 2}) and the world (-> {0,
# 1, 2}), each then checked; the pair {0, 1}, which lost nobody, carries on unshrunk.
out=$("${run[@]}" --grace 30 -n 4 -- "$selftest" scope --case shrink 2>&1)
st=$?
echo "=== scope shrink over ${run[2]}: exit $st"
echo "$out" | grep -E 'scope shrink' | cut -c1-160
[ "$st" -eq 137 ] && [ "$(grep -c 'scope shrink: world failed: .*; shrunk and carried on$' <<< "$out")" -eq 3 ] \
    || { echo "$out" | tail -20; fail "scope shrink over verbs"; }

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
