"""What the worker processes of ``fismo verify`` (its JAX worker) and ``fismo demo`` (its runs) share."""

from __future__ import annotations

import importlib
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


def quiet_worker_init(module: str, name: str) -> None:
    """A process pool's initializer: `end_quietly_on_interrupt`, then ``module.name()``.

    Named by strings, so that a spawned worker unpickles this light module only (no torch) before its
    Ctrl-C is quiet: with the demo's own initializer, whose module imports torch, each worker spent
    its first seconds importing torch with Python's handler, and a Ctrl-C then printed a traceback
    from each (a user's hunt, 2026-12-04).
    """
    end_quietly_on_interrupt()
    getattr(importlib.import_module(module), name)()
