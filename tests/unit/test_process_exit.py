"""exit_process ends a process as sys.exit does (status, atexit handlers, buffered output),
only without the final collections' walk over the heap."""

from __future__ import annotations

import sys

from helpers import hang_limit, run_limited

PROBE = """
import atexit, gc, sys
atexit.register(lambda: print("atexit ran, frozen", gc.get_freeze_count() > 0))
sys.stdout.write("buffered, not flushed")
from trainwise.process_exit import exit_process
exit_process(int(sys.argv[1]))
"""


def test_the_status_the_atexit_handlers_and_the_buffered_output_survive():
    for status in (0, 3):
        done = run_limited([sys.executable, "-c", PROBE, str(status)],
                           what=f"a process that exits {status}", limit=hang_limit(procs=0))
        assert done.returncode == status, done.stderr
        assert done.stdout == "buffered, not flushedatexit ran, frozen True\n", done.stdout
