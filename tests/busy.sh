#!/usr/bin/env bash
# `make test` on a busy machine: two CPU-bound busy loops (what a laptop's other work or a
# shared CI runner adds) run beside the whole suite; they start here and stop on any exit,
# a failure or Ctrl-C included. Arguments go to make:  tests/busy.sh TEST_JOBS=3
set -u
loops=()
stop() {
    for pid in "${loops[@]}"; do kill "$pid" 2>/dev/null; done
    wait "${loops[@]}" 2>/dev/null
}
trap stop EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
for _ in 1 2; do
    (while :; do :; done) &
    loops+=("$!")
done
echo "busy loops: pids ${loops[*]}"
start=$(date +%s)
"${MAKE:-make}" test "$@"
status=$?
echo "make test beside 2 busy loops: exit status $status after $(($(date +%s) - start)) s"
exit "$status"
