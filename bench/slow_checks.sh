#!/usr/bin/env bash
# The checks `make test` leaves out (pytest marker slow_check): slow ones that prove little
# beside the suite's others (bf16 under fsdp x tp against one bf16 process at 2e-2, the
# unsharded accumulation under tp, ...). Their modules' shared launches train the extra
# runs when TRAINWISE_SLOW_CHECKS=1. Run from the repository root: bench/slow_checks.sh
set -euo pipefail
cd "$(dirname "$0")/.."
TRAINWISE_SLOW_CHECKS=1 exec .venv/bin/python -m pytest -q -m slow_check "$@" tests
