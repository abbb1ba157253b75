"""Ending a trainwise process (the CLI, a worker) without the interpreter's last garbage
collections walking every object torch made at import.

At exit CPython collects its whole heap, after torch hundreds of thousands of objects:
about a second per process on a busy CPU, paid by the launcher and by every worker of
every launch. The process is ending and its memory goes back to the OS anyway, so those
objects are moved out of the collector's sight first (gc.freeze). Everything else of an
exit is unchanged: atexit handlers (logging's flush among them) run, and modules are torn
down, closing what they hold."""

from __future__ import annotations

import gc
import sys
from typing import NoReturn


def exit_process(status: int | None) -> NoReturn:
    """sys.exit(status) minus the final collections' walk over the import-time heap."""
    gc.freeze()
    sys.exit(status)
