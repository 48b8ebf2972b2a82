"""What the worker processes of ``fismo verify`` (its JAX worker) and ``fismo demo`` (its runs) share."""

from __future__ import annotations

import importlib
import os
import signal
import threading
import time

#: Seconds between a worker's checks that the process that started it is alive (`end_with_parent`).
PARENT_CHECK_SECONDS = 1.0


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


def end_with_parent() -> None:
    """End this worker process within `PARENT_CHECK_SECONDS` of the process that started it ending.

    A process pool's workers wait on a queue whose other end they hold themselves, so they never see
    their parent go: after a ``kill -TERM`` of ``fismo demo`` or the scaling study alone (not its
    process group, as Ctrl-C and ``timeout`` signal), each worker finished its run and then waited
    forever (a user's hunt, 2026-12-04). A daemon thread compares ``os.getppid()`` with the parent's
    process id, which changes when the parent ends (POSIX: the worker is adopted by another process).
    """
    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(PARENT_CHECK_SECONDS)
            if os.getppid() != parent:
                os._exit(1)  # the parent is gone: nobody will read this worker's results

    threading.Thread(target=watch, name="end_with_parent", daemon=True).start()


def quiet_worker_init(module: str, name: str) -> None:
    """A process pool's initializer: `end_quietly_on_interrupt` and `end_with_parent`, then ``module.name()``.

    Named by strings, so that a spawned worker unpickles this light module only (no torch) before its
    Ctrl-C is quiet: with the demo's own initializer, whose module imports torch, each worker spent
    its first seconds importing torch with Python's handler, and a Ctrl-C then printed a traceback
    from each (a user's hunt, 2026-12-04).
    """
    end_quietly_on_interrupt()
    end_with_parent()
    getattr(importlib.import_module(module), name)()
