"""What the worker processes of ``fismo verify`` (its JAX worker) and ``fismo demo`` (its runs) share."""

from __future__ import annotations

import signal


def end_quietly_on_interrupt() -> None:
    """Let Ctrl-C end this worker process as the operating system does, without Python's traceback.

    A terminal's Ctrl-C interrupts every process of the command: each idle
    worker printed a ``KeyboardInterrupt`` traceback (8 of them for one
    ``fismo demo``), under the one line the command itself prints. The
    command stops its workers anyway; their partial results are not used.
    Where Ctrl-C is ignored (a command started in the background, ``&``,
    by a shell script: the parent ignores it too), it stays ignored.
    """
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
