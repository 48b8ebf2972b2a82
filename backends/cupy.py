"""CuPy helpers: moving a FISMO state between host memory and a GPU.

The core needs nothing else to run on CuPy: :class:`fismo_core.FISMO` and
:mod:`fismo_core.linalg` take ``cupy.ndarray`` directly, create every new array
on the input's device, and launch their kernels on CuPy's current stream (use
``with cupy.cuda.Stream(): ...`` to choose one, as for any CuPy code). What a
pipeline needs on top is getting a state onto the GPU (from a checkpoint in
NumPy arrays, or from another GPU) and back to the host; that is all this
module does. Importing it does not import CuPy; calling a helper does.

The step count ``state.step`` is a Python int and is left as it is. A
blocked factor (:class:`fismo_core.kronecker.Blocks`) moves block array by
block array and stays a ``Blocks``.
"""

from __future__ import annotations

import contextlib
from typing import Any, Optional

from fismo_core.guards import library_name
from fismo_core.kronecker import Blocks
from fismo_core.optimizer import FISMOState

__all__ = ["STATE_ARRAYS", "state_to_device", "state_to_host"]

#: The array fields of :class:`fismo_core.FISMOState` (all but ``step``; the int32
#: counters ``skipped`` and ``root_failures`` too, which may also be plain ints).
STATE_ARRAYS: tuple[str, ...] = ("P", "Q", "M", "P_inv_sqrt", "Q_inv_sqrt", "skipped", "root_failures")


def _cupy() -> Any:
    try:
        import cupy
    except ImportError as exc:
        raise ImportError(
            "fismo_core.backends.cupy needs CuPy and a CUDA GPU: pip install cupy-cuda12x "
            "(or cupy-cuda11x for CUDA 11)"
        ) from exc
    return cupy


def _check_state(state: Any) -> None:
    if not isinstance(state, FISMOState):
        raise TypeError(f"state must be a fismo_core.FISMOState, got {type(state).__name__}")


def state_to_device(state: FISMOState, device: Any = None, *, stream: Optional[Any] = None) -> FISMOState:
    """Copy every array of ``state`` to a GPU, as CuPy arrays.

    Dtypes are kept: a float32 state of bf16/fp16 parameters stays float32.

    Parameters
    ----------
    state:
        A state whose arrays are NumPy (e.g. a checkpoint, or
        :func:`state_to_host`'s output) or CuPy arrays on any GPU.
    device:
        A ``cupy.cuda.Device`` or a device id; ``None`` is CuPy's current device.
    stream:
        Optional ``cupy.cuda.Stream`` to enqueue the copies on (otherwise the
        current stream). A copy from pageable host memory returns once the
        data is staged; arrays already on ``device`` are returned as they are
        (the core never mutates them, so sharing is safe).
    """
    _check_state(state)
    cupy = _cupy()
    dev = device if isinstance(device, cupy.cuda.Device) else cupy.cuda.Device(device)
    moved = {}
    with dev:
        with stream if stream is not None else contextlib.nullcontext():
            for name in STATE_ARRAYS:
                moved[name] = _each_array(getattr(state, name), lambda x: _to_device(cupy, x, dev))
    return state._replace(**moved)


def _to_device(cupy: Any, x: Any, dev: Any) -> Any:
    if isinstance(x, int):  # a counter of a state built by hand: kept, as state_to_host keeps it (not int64)
        return x
    if isinstance(x, cupy.ndarray) and x.device.id != dev.id:
        return x.copy()  # ndarray.copy() copies to the current device, peer to peer
    return cupy.asarray(x)


def _each_array(x: Any, move: Any) -> Any:
    """``move`` applied to a field's array, or to each array of a `Blocks`."""
    if isinstance(x, Blocks):
        return Blocks(*(None if part is None else move(part) for part in x))
    return move(x)


def state_to_host(state: FISMOState, *, stream: Optional[Any] = None) -> FISMOState:
    """Copy every array of ``state`` to host memory, as NumPy arrays (for checkpoints).

    CuPy arrays are copied with ``ndarray.get`` (which waits for ``stream``, or
    the current stream, to finish the state's kernels: this is the one host
    synchronisation, and it is explicit). NumPy arrays pass through.
    """
    _check_state(state)
    import numpy as np

    def to_host(x: Any, name: str) -> Any:
        if isinstance(x, (np.ndarray, int)):
            return x
        if library_name(x) == "cupy":
            return x.get(stream=stream)
        raise TypeError(
            f"state.{name} is a {type(x).__module__}.{type(x).__name__}; state_to_host takes CuPy or NumPy "
            "arrays (for other libraries use array_api_compat.to_device)"
        )

    moved = {name: _each_array(getattr(state, name), lambda x, name=name: to_host(x, name)) for name in STATE_ARRAYS}
    return state._replace(**moved)
