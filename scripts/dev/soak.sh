#!/usr/bin/env bash
# Run the multi-process tests N times and list every failure, to catch flakes.
#
#   scripts/dev/soak.sh [N] [pytest selection...]     # default: N=10, all multi-process tests
#   scripts/dev/soak.sh 20 tests/test_scaling.py -k fsdp
#
# Each round's full pytest output is kept in $SOAK_DIR (default: a temp folder); a
# summary line per round and the failed test ids of every round are printed at the end.
set -uo pipefail
cd "$(dirname "$0")/../.."
N=${1:-10}
shift || true
# Every test that launches the trainer, torchrun or SLURM is marked slow (tests/support/assertions.py's
# assert_clean_exit checks each completed 2-process job for a clean exit). Three files side
# by side, as CI runs them: a flake that only a loaded machine shows counts too.
DEFAULT_TESTS=(-n 3 -m slow tests)
if [ $# -gt 0 ]; then TESTS=("$@"); else TESTS=("${DEFAULT_TESTS[@]}"); fi
PYTHON=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python )}
SOAK_DIR=${SOAK_DIR:-$(mktemp -d -t soak.XXXXXX)}
mkdir -p "$SOAK_DIR"

failed_rounds=0
for round in $(seq "$N"); do
    log="$SOAK_DIR/round$round.log"
    start=$(date +%s)
    "$PYTHON" -m pytest -q -p no:cacheprovider -rf "${TESTS[@]}" >"$log" 2>&1
    rc=$?
    summary=$(tail -n 1 "$log")
    echo "round $round/$N: rc $rc in $(( $(date +%s) - start ))s: $summary"
    if [ "$rc" -ne 0 ]; then
        failed_rounds=$((failed_rounds + 1))
    fi
done

echo
echo "failures ($failed_rounds of $N rounds failed; logs in $SOAK_DIR):"
grep -h "^FAILED\|^ERROR" "$SOAK_DIR"/round*.log | sort | uniq -c | sort -rn || echo "  none"
# A rank killed by a signal (SIGABRT in gloo, SIGSEGV) leaves its mark in the log.
grep -l "Signal 6\|SIGABRT\|Signal 11\|SIGSEGV\|terminate called" "$SOAK_DIR"/round*.log 2>/dev/null \
    | sed 's/^/  signal in: /'
[ "$failed_rounds" -eq 0 ]
