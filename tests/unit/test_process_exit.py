"""exit_process ends a process as sys.exit does (status, atexit handlers, buffered output),
only without the final collections' walk over the heap."""

from __future__ import annotations

import subprocess
import sys

from helpers import cli_env

PROBE = """
import atexit, gc, sys
atexit.register(lambda: print("atexit ran, frozen", gc.get_freeze_count() > 0))
sys.stdout.write("buffered, not flushed")
from trainwise.process_exit import exit_process
exit_process(int(sys.argv[1]))
"""


def test_the_status_the_atexit_handlers_and_the_buffered_output_survive():
    for status in (0, 3):
        done = subprocess.run([sys.executable, "-c", PROBE, str(status)], capture_output=True,
                              text=True, env=cli_env(), timeout=60)
        assert done.returncode == status, done.stderr
        assert done.stdout == "buffered, not flushedatexit ran, frozen True\n", done.stdout
