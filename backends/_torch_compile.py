"""What only the traced step of the torch adapter runs (``torch.compile``).

Part of [`fismo_core.backends.torch`][fismo_core.backends.torch]: `TracedRootSchedule`, the inverse
roots of a bucket due every ``k`` steps, with the decision kept in the graph;
`through_dynamo` and `warn_of_numpy_scalars`, for the settings ``_init_group`` checks at trace time;
`substitute_array_api_compat_lookups`, which dynamo traces in place of array-api-compat's. The
optimizer's ``_init_group`` and ``_static_shapes``, which dynamo's tracing of ``step`` calls, stay
methods of ``FISMO``. See "torch.compile" in ``docs/torch.md``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import types
import warnings
from collections.abc import Callable
from typing import Any

import array_api_compat
import torch
from array_api_compat import torch as _compat_torch

from fismo_core import linalg as _linalg
from fismo_core import optimizer as _fismo  # the rules every adapter shares, looked up at each call

from ._torch_eager_kernels import EagerKernels
from ._torch_groups import numpy_scalar_keys

_UserError: Any
_UserErrorType: Any
try:  # private classes of dynamo (torch 2.13), for `through_dynamo`
    from torch._dynamo.exc import UserError as _UserError, UserErrorType as _UserErrorType
except ImportError:  # pragma: no cover - another torch
    _UserError = _UserErrorType = None


@dataclasses.dataclass(frozen=True, eq=False)
class TracedRootSchedule(_fismo.RootSchedule):
    """The roots of a bucket due every ``k`` steps (``InverseRootConfig(every=k)``, ``k > 1``) under ``torch.compile``.

    Eagerly the adapter reads each step count and buckets by the answer; traced, that read would
    break the graph, and the graph would recompile whenever the answer changes. Passed to the core
    as ``refresh_roots`` ([`RootSchedule`][fismo_core.RootSchedule]), the decision stays in the graph
    at the only places it changes lines 4-6, each inverse root and line 6's product: a ``torch.cond``
    there computes the new ones when any matrix is due and takes each matrix's own, and otherwise
    copies the kept ones (``torch.cond``'s outputs may not alias its inputs). Lines 4-8 are traced
    once. ``due`` is on the data's device, ``any_due`` where the step counts live (the CPU: no
    device read).
    """

    any_due: torch.Tensor
    #: Whether the branches run under `EagerKernels` (float64: the step's mode does not reach them).
    eager_kernels: bool = False

    @classmethod
    def of(cls, due: torch.Tensor, device: torch.device, dtype: torch.dtype) -> "TracedRootSchedule":
        """The schedule of a bucket from its matrices' ``due`` flags (``is_refresh_step`` of their step counts)
        and its dtype (float64: the branches round as eager, `EagerKernels`)."""
        return cls(due.to(device), due.any(), dtype == torch.float64)

    def choose(self, fresh: Callable[[], tuple], kept: Callable[[], tuple]) -> tuple:
        # Both branches lay their outputs out alike, as contiguous copies. (x.contiguous() kept a tensor
        # with a dimension of size 1 as it was, whose stride there may differ: torch.cond then refused
        # the branches' strides, for a 1 x n matrix with a blocked side; a user's hunt, 2026-12-03.)
        def some_due() -> tuple:
            with EagerKernels() if self.eager_kernels else contextlib.nullcontext():
                return tuple(_contiguous_copy(x) for x in _fismo.RootSchedule.choose(self, fresh, kept))

        def none_due() -> tuple:
            with EagerKernels() if self.eager_kernels else contextlib.nullcontext():
                return tuple(_contiguous_copy(x) for x in kept())

        return tuple(torch.cond(self.any_due, some_due, none_due, ()))


def _contiguous_copy(x: torch.Tensor) -> torch.Tensor:
    """A copy of ``x`` with the strides of a new contiguous tensor (``torch.cond``'s outputs may not alias its inputs)."""
    return x.clone(memory_format=torch.contiguous_format)


def warn_of_numpy_scalars(param_groups: list[dict]) -> None:
    """Warn of each NumPy scalar found in a group while dynamo traces (``_init_group``).

    The settings' checks store it as a Python float, and the traced step's guards then hold a float: the
    next NumPy scalar written there (a schedule computed with NumPy) fails them, so each such write
    compiles the step again, until dynamo's recompile limit. ``float(x)`` does not.
    """
    for index, group in enumerate(param_groups):
        for name in numpy_scalar_keys(group):
            warnings.warn(
                f"param group {index}: {name} is a NumPy scalar ({group[name]!r}); it is stored as a Python float, "
                f"but each NumPy scalar written there compiles the step again: write float(x)",
                stacklevel=2,
            )


def through_dynamo(exc: Exception) -> Exception:
    """``exc`` (a `ValueError` or `TypeError` refusing a setting) in the form dynamo lets out of a trace.

    Dynamo rewraps an exception raised while it traces (here in ``_init_group``, which it runs
    eagerly) as its ``InternalTorchDynamoError``, unless it is one of its own user-facing kinds
    (torch 2.13, ``convert_frame.py``). The same message in a subclass of both ``type(exc)`` and
    dynamo's ``UserError`` reaches the caller as eagerly: ``except ValueError`` catches it compiled
    too. Where that private class is missing (another torch), ``exc`` as it is.
    """
    kind = _refusal_class(type(exc))  # type: ignore[arg-type]  # a class is hashable; mypy reads Exception.__hash__
    if kind is None:
        return exc
    return kind(_UserErrorType.INVALID_INPUT, str(exc))


@functools.cache
def _refusal_class(base: Any) -> type | None:
    """``base`` and dynamo's ``UserError`` in one class (named as ``base``); ``None`` without ``UserError``."""
    if _UserError is None:  # pragma: no cover - another torch
        return None
    return type(base.__name__, (base, _UserError), {"__init__": _UserError.__init__, "__module__": __name__})


def _copy_of(function: Any) -> types.FunctionType:
    """``function`` as another object (same code, globals and defaults): dynamo traces it as it is, where a
    substitute registered for ``function`` would be called again."""
    copy = types.FunctionType(function.__code__, function.__globals__, function.__name__, function.__defaults__,
                              function.__closure__)
    copy.__kwdefaults__ = function.__kwdefaults__
    return copy


def substitute_array_api_compat_lookups() -> bool:
    """Have dynamo trace the core's lookups of torch tensors' namespace and device as one ``isinstance``.

    The core asks array-api-compat for the namespace and the device of its arrays in every function
    (``array_namespace``, ``device``, ``is_array_api_obj``), and ``linalg.nan_is_the_answer`` asks it
    whether a namespace is NumPy's. Traced, each call ran array-api-compat's type lookups
    (``sys.modules``, ``getattr``, ``issubclass``, in ``lru_cache``-wrapped helpers): about half of the
    bytecode dynamo steps through in a FISMO step, for the same graph, and the 12 warnings "Dynamo detected
    a call to a `functools.lru_cache`-wrapped function" of a first compile (``docs/torch.md``,
    "Tracing"). The substitutes give what those functions give for torch tensors (``array_api_compat.torch``,
    ``x.device``, ``True``, no NumPy error state) and trace an unchanged copy of them for anything else
    (another library's arrays, a version or ``use_compat`` asked for). Eagerly nothing changes.
    Registered once per process, at the import of the torch adapter; ``False`` where this torch has no
    ``torch.compiler.substitute_in_graph`` (before 2.5) or where another library registered substitutes
    for these functions first.
    """
    substitute = getattr(torch.compiler, "substitute_in_graph", None)
    if substitute is None:  # pragma: no cover - torch < 2.5
        return False
    originals: tuple[Any, ...] = (array_api_compat.array_namespace, array_api_compat.device,
                                  array_api_compat.is_array_api_obj, _linalg.nan_is_the_answer)
    namespace_of, device_of, is_array_of, nan_context_of = (_copy_of(f) for f in originals)

    def array_namespace(*xs: Any, api_version: str | None = None, use_compat: bool | None = None) -> Any:
        if xs and api_version is None and use_compat is None:
            for x in xs:
                if not isinstance(x, torch.Tensor):
                    break
            else:
                return _compat_torch
        return namespace_of(*xs, api_version=api_version, use_compat=use_compat)

    def device(x: Any, /) -> Any:
        return x.device if isinstance(x, torch.Tensor) else device_of(x)

    def is_array_api_obj(x: Any) -> bool:
        return True if isinstance(x, torch.Tensor) else is_array_of(x)

    def nan_is_the_answer(xp: Any) -> Any:
        return contextlib.nullcontext() if xp is _compat_torch else nan_context_of(xp)

    try:
        for original, replacement in zip(originals, (array_namespace, device, is_array_api_obj,
                                                     nan_is_the_answer)):
            substitute(original)(replacement)
    except (ValueError, TypeError):  # pragma: no cover - registered already (another library)
        return False
    return True


SUBSTITUTED = substitute_array_api_compat_lookups()
