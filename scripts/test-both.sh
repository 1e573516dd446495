#!/usr/bin/env bash
# make test's suite, once on each build and loop, side by side: the compiled build (build/compiled) on uvloop, serve's
# loop, in the foreground; the pure one on asyncio's loop beside it, its output printed when it ends. The suite mostly
# waits (on sockets, simulators, deadlines): on 2 cores the two take about 6 minutes together, 11 in turn.
# Usage: scripts/test-both.sh BIN COMPILED [pytest args...]
set -uo pipefail
bin=$1 compiled=$2
shift 2
# In CI a test that fails is run once more, and the summary lists it with its first failure (scripts/ci_summary.py):
# one that needs it more than rarely is a defect to fix, not to rerun.
if [[ ${CI:-} == true ]]; then
  set -- --reruns 1 "$@"
fi
pure_log=$(mktemp)
LIFEGUARD_TEST_LOOP=asyncio LIFEGUARD_TEST_BUILD=pure "$bin/pytest" -q -p no:cacheprovider "$@" >"$pure_log" 2>&1 &
pure=$!
trap 'kill "$pure" 2>/dev/null; rm -f "$pure_log"' EXIT
echo "== the compiled build on uvloop (the pure build on asyncio's loop runs beside it)"
PYTHONPATH=$compiled LIFEGUARD_TEST_BUILD=compiled "$bin/pytest" -q --import-mode=append -o pythonpath="$compiled ." "$@"
compiled_rc=$?
wait "$pure"
pure_rc=$?
echo "== the pure build on asyncio's loop"
cat "$pure_log"
echo "== compiled on uvloop: exit $compiled_rc; pure on asyncio: exit $pure_rc"
((compiled_rc == 0 && pure_rc == 0))
