"""Cross-backend checking: the backends, devices and dtypes installed, and a harness to compare them.

Used by ``fismo verify``, by the test suite's fixtures and by anyone who
writes array-API code and wants it checked the same way:

- `targets()` lists every (backend, device, dtype) this package knows, each
  either available or with the reason it is not (library missing, no CUDA
  device, ...). A `Target` converts NumPy data to its arrays.
- `check_backends(fn, *args)` runs any array-API function on every available
  target and on NumPy float64, checks each output's namespace, device, dtype
  and shape against what the inputs imply and its values against NumPy
  float64, and returns a `Report`: one `Result` per target (worst relative
  error, the per-dtype tolerance, the first output that failed and which
  property) that prints as the table of ``fismo verify``. Its own errors
  raise `HarnessError`, never a row.
- `full_float32_matmuls()` pins true float32 matrix products (TF32 off) for
  the duration of a check; ``fismo_core.pytest_plugin`` exposes the targets
  as a pytest fixture.

NumPy is imported lazily: it is the reference backend, needed to check, not
to run the optimizer.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import math
import numbers
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional, Union

from .guards import library_name
from .linalg import _dtype_name
from .optimizer import FISMO, FISMOState

__all__ = [
    "DTYPE_NAMES",
    "TOLERANCES",
    "VERIFY_SHAPES",
    "HarnessError",
    "Report",
    "Result",
    "Target",
    "check_backends",
    "full_float32_matmuls",
    "max_relative_error",
    "pin_full_float32_matmuls",
    "reference_gradients",
    "run_trajectory",
    "targets",
    "to_numpy",
]

TOLERANCES: dict[str, float] = {"float64": 1e-10, "float32": 1e-4}
"""Relative tolerance of a backend against the NumPy float64 reference, per
dtype, on the verification trajectory (`VERIFY_SHAPES`, 50 steps,
default hyperparameters; condition numbers of P and Q reach about 200).
float64: worst case measured 1.0e-13 to 1.4e-13 on torch and JAX over the
CPU kernel sets (NumPy and array-api-strict share LAPACK and agree
exactly); 1e-10 is the issue's bar and leaves three orders of headroom.
float32: worst case measured 3.0e-5 to 4.5e-5 (float32 rounding, 6e-8,
amplified by eigh and Newton–Schulz along 50 steps); 1e-4 is two to three
times that, while a formula error, which shows up at 1e-3 or more, still
fails. Measured with ``fismo verify``; the table, the command and the
kernel sets are in ``docs/verification.md`` ("Tolerances")."""

VERIFY_SHAPES: tuple[tuple[int, ...], ...] = ((2, 16, 16), (10, 32), (2, 48, 16), (2, 16, 64))
"""Shapes of the seeded Gaussian streams: square (a batch of two), wide, tall (a batch) and wide (a batch).

They are the shapes of four of the recorded real-gradient streams of ``fismo
verify`` (``gpt.proj``, ``digits.head``, ``gpt.attn``, ``gpt.fc_out``), so a
backend that compiles per shape (JAX) compiles each step once for both."""


@dataclass(frozen=True)
class Target:
    """One backend, device and dtype to run FISMO on.

    ``reason`` is ``None`` when the target is available, otherwise why not.
    """

    backend: str
    device: str
    dtype: str
    reason: Optional[str] = None
    _namespace: Callable[[], Any] = field(default=lambda: _not_listed(), repr=False, compare=False)
    _asarray: Callable[[Any, str], Any] = field(default=lambda a, d: _not_listed(), repr=False, compare=False)
    _settings: Callable[[], contextlib.AbstractContextManager[Any]] = field(
        default=contextlib.nullcontext, repr=False, compare=False)

    @property
    def available(self) -> bool:
        return self.reason is None

    @property
    def id(self) -> str:
        return f"{self.backend}-{self.device}-{self.dtype}"

    @property
    def xp(self) -> Any:
        """The array namespace (through array-api-compat where the library needs it).

        An unavailable target raises a ``RuntimeError`` with its `reason` (it returned ``None``, or
        failed on an attribute of ``None``)."""
        self._check_available()
        return self._namespace()

    @property
    def tolerance(self) -> float:
        return TOLERANCES[self.dtype]

    def asarray(self, a: Any) -> Any:
        """A NumPy array as a new array of this target (backend, device and dtype).

        Always a copy: NumPy, array-api-strict and torch on the CPU could otherwise share the caller's
        memory, and a routine that writes into its input would change the caller's data (and the next
        test's). An unavailable target raises a ``RuntimeError`` with its `reason`."""
        self._check_available()
        return self._asarray(a, self.dtype)

    def _check_available(self) -> None:
        if self.reason is not None:
            raise RuntimeError(f"target {self.id} is not available: {self.reason} (check Target.available, "
                               "or skip with pytest.skip(target.reason))")

    @contextlib.contextmanager
    def configured(self) -> Iterator[None]:
        """Within the block, the settings this target's `tolerance` was measured under; restored after.

        True float32 matrix products (`full_float32_matmuls`) and, for JAX,
        64-bit types (``jax.enable_x64``) in the calling thread: JAX's float64
        target needs them, and they are on in ``fismo verify``, where the
        tolerances were measured. The ``array_target`` fixtures and
        `check_backends` run each target inside this, so neither leaves JAX's
        x64 mode on for the rest of the process. Outside it, the first use of
        a JAX target (``xp`` or ``asarray``) turns x64 on process-wide.
        """
        with full_float32_matmuls(), self._settings():
            yield


def _not_listed() -> Any:
    """What a `Target` built by hand, not by `targets`, does when asked for arrays: it has no library."""
    raise RuntimeError("a Target built by hand has no library to make arrays with: take it from "
                       "fismo_core.testing.targets()")


def to_numpy(x: Any) -> Any:
    """Any supported backend's array, a NumPy scalar or a Python number as a NumPy float64 array.

    Copies from a device if needed. 0-d arrays and scalars (``xp.mean(x)`` is a
    ``numpy.float64`` on NumPy) come back as 0-d arrays. Integer and boolean
    arrays are widened exactly (integers up to 2**53); complex arrays come
    back as complex128 (their imaginary part kept).
    """
    import numpy as np

    host = _host_array(x)
    return np.asarray(host, dtype=np.complex128 if np.iscomplexobj(host) else np.float64)


def _host_array(x: Any) -> Any:
    """Any supported backend's array, a NumPy scalar or a Python number as a NumPy array of its own dtype.

    The one copy to the host of the harness. Floating dtypes NumPy lacks are widened exactly first
    (bfloat16 and torch's float8 to float32, complex32 to complex64); integers and booleans keep their
    dtype (a Python ``int`` beyond int64 becomes an object array), so they can be compared exactly.
    """
    import numpy as np

    if isinstance(x, (np.ndarray, np.generic)) or type(x) in _PYTHON_NUMBERS:
        return np.asarray(x)
    module = library_name(x)
    if module == "cupy":
        return x.get()
    if module == "torch":
        import torch

        x = x.detach().cpu().resolve_conj().resolve_neg()  # .numpy() refuses torch's lazy conj and neg views
        if x.dtype == torch.complex32:
            x = x.to(torch.complex64)
        elif x.is_floating_point() and x.dtype not in (torch.float16, torch.float32, torch.float64):
            x = x.to(torch.float32)
        return x.numpy()
    # NumPy has no bfloat16: narrow floats go as float32 (exact). JAX copies to the host itself, from
    # any device (NumPy's DLPack import takes CPU buffers only: a GPU array raised BufferError) and
    # gathering a sharded or replicated array; array-api-strict (any of its virtual devices) exports
    # through DLPack, which keeps integer, boolean and complex dtypes.
    from array_api_compat import array_namespace, is_jax_array

    xp = array_namespace(x)
    if xp.isdtype(x.dtype, "real floating") and x.dtype not in (xp.float32, xp.float64):
        x = xp.astype(x, xp.float32)
    if is_jax_array(x):
        return np.asarray(x)
    return np.from_dlpack(x)


_PYTHON_NUMBERS = (bool, int, float, complex)
"""Python scalars an output may be (compared by value only). Exact types: ``numpy.float64`` subclasses ``float``."""


def pin_full_float32_matmuls() -> None:
    """Make float32 matmuls full float32 in torch and JAX, where they are imported: TF32 off, highest precision.

    Verification compares float32 against a tolerance measured with full
    float32 products; TF32 (10-bit mantissa, on by default for some GPU
    settings) would fail it without any bug. Called by this project's
    ``tests/conftest.py``; it changes process-wide settings of torch and JAX
    and leaves them so (`full_float32_matmuls` restores them). It imports
    neither: a library imported afterwards keeps its own defaults.
    """
    torch, jax = _imported("torch"), _imported("jax")
    if torch is not None:
        _pin_torch(torch)
    if jax is not None:
        jax.config.update("jax_default_matmul_precision", "highest")


_TORCH_FP32_LEAVES = ("cuda.matmul", "cudnn.conv", "cudnn.rnn", "mkldnn.matmul", "mkldnn.conv", "mkldnn.rnn")
"""The operations of torch's ``fp32_precision`` settings (torch >= 2.9), as ``torch.backends`` paths."""


def _torch_fp32_leaves(torch: Any) -> dict[str, Any]:
    """The ``torch.backends`` objects that hold an ``fp32_precision`` (none before torch 2.9)."""
    leaves = {}
    for path in _TORCH_FP32_LEAVES:
        holder = torch.backends
        for part in path.split("."):
            holder = getattr(holder, part, None)
        if holder is not None and hasattr(holder, "fp32_precision"):
            leaves[path] = holder
    return leaves


def _torch_settings(torch: Any) -> dict[str, Any]:
    """torch's float32 matmul settings, read without mixing its two APIs.

    Since torch 2.9 the per-operation ``fp32_precision`` settings are what
    its kernels read; the older ``allow_tf32`` flags and
    ``get_float32_matmul_precision()`` raise ``RuntimeError`` once a program
    has set the newer ones (torch's own advice: use only the new API).
    """
    leaves = _torch_fp32_leaves(torch)
    if not leaves:  # torch < 2.9: the older API only
        return {"cuda": torch.backends.cuda.matmul.allow_tf32, "cudnn": torch.backends.cudnn.allow_tf32,
                "precision": torch.get_float32_matmul_precision()}
    settings: dict[str, Any] = {path: holder.fp32_precision for path, holder in leaves.items()}
    try:
        settings["precision"] = torch.get_float32_matmul_precision()
    except RuntimeError:  # the program set the new API: the older reading refuses, and is not restored
        pass
    try:
        settings["cudnn"] = torch.backends.cudnn.allow_tf32
    except RuntimeError:  # likewise
        pass
    return settings


def _pin_torch(torch: Any) -> None:
    """TF32 (and bfloat16) off for float32 in every torch operation that has the switch."""
    torch.set_float32_matmul_precision("highest")  # in both APIs: keeps torch's older reading consistent
    leaves = _torch_fp32_leaves(torch)
    # Also through the older API, first: torch keeps its cuDNN flag beside the newer settings, and reading
    # torch.backends.cudnn.allow_tf32 raised inside the block where the two disagreed (a user's routine that
    # read it failed even on a NumPy-only check; a user's hunt, 2026-12-04).
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    for holder in leaves.values():
        holder.fp32_precision = "ieee"


def _restore_torch(torch: Any, settings: Mapping[str, Any]) -> None:
    """Undo `_pin_torch`: the settings `_torch_settings` read, written back through the same API."""
    if "precision" in settings:
        torch.set_float32_matmul_precision(settings["precision"])
    leaves = _torch_fp32_leaves(torch)
    if not leaves:
        torch.backends.cuda.matmul.allow_tf32 = settings["cuda"]
    if "cudnn" in settings:  # before the newer settings, which the older setter overwrites
        torch.backends.cudnn.allow_tf32 = settings["cudnn"]
    for path, holder in leaves.items():
        holder.fp32_precision = settings[path]


def _imported(name: str) -> Any:
    """The module ``name`` if this process has imported it, else ``None`` (never imports it)."""
    import sys

    return sys.modules.get(name)


def _loaded(name: str) -> Any:
    try:
        return _import(name)
    except ImportError:
        return None


@contextlib.contextmanager
def full_float32_matmuls() -> Iterator[None]:
    """Within the block, float32 matrix products are true float32 in torch and JAX; the settings are restored after.

    torch (process-wide): TF32 off, through the API the program uses
    (``torch.backends.cuda.matmul.fp32_precision = "ieee"`` and its cuDNN
    and oneDNN twins since torch 2.9; ``allow_tf32`` off before) and
    ``set_float32_matmul_precision("highest")``. JAX:
    ``jax.default_matmul_precision("highest")`` in the calling thread, which
    also overrides a precision the caller set with that context manager.
    Only libraries already imported when the block starts are changed; none
    is imported. CuPy reads its TF32 switch (``CUPY_TF32``) from the
    environment at import: leave it unset. `check_backends` and ``fismo
    verify`` run inside this.
    """
    torch, jax = _imported("torch"), _imported("jax")
    with contextlib.ExitStack() as stack:
        if torch is not None:
            saved = _torch_settings(torch)
            stack.callback(_restore_torch, torch, saved)
            _pin_torch(torch)
        if jax is not None:
            stack.enter_context(jax.default_matmul_precision("highest"))
        yield


class _BrokenInstall(ImportError):
    """A backend that is installed but fails to import (e.g. ``OSError``: a CUDA library it links is missing)."""


def _import(name: str) -> Any:
    """``importlib.import_module``; any other error than ``ImportError`` is raised as `_BrokenInstall`, so that
    every caller that treats a missing backend as unavailable treats a broken one so too."""
    try:
        return importlib.import_module(name)
    except ImportError:
        raise
    except Exception as exc:
        raise _BrokenInstall(f"{name} is installed but failed to import ({type(exc).__name__}: {exc})") from exc


def _unavailable(exc: ImportError, missing: str) -> str:
    """Why a backend's targets are skipped: ``missing`` (how to install it), or how its import failed."""
    return str(exc) if isinstance(exc, _BrokenInstall) else missing


def _numpy_targets() -> Iterator[Target]:
    try:
        np = _import("numpy")
    except ImportError as exc:
        yield Target("numpy", "cpu", "float64", reason=_unavailable(exc, "numpy is not installed (pip install numpy)"))
        return
    from array_api_compat import array_namespace

    for dtype in ("float64", "float32"):
        yield Target(
            "numpy", "cpu", dtype,
            _namespace=lambda: array_namespace(np.empty(0)),
            _asarray=lambda a, d: np.array(a, dtype=d, copy=True),
        )


def _strict_targets() -> Iterator[Target]:
    try:
        xs = _import("array_api_strict")
    except ImportError as exc:
        reason = _unavailable(exc, "array-api-strict is not installed (pip install array-api-strict)")
        for dtype in ("float64", "float32"):
            yield Target("array_api_strict", "CPU_DEVICE", dtype, reason=reason)
        return
    for dtype in ("float64", "float32"):
        yield Target(
            "array_api_strict", "CPU_DEVICE", dtype,
            _namespace=lambda: xs,
            _asarray=lambda a, d: xs.asarray(a, dtype=getattr(xs, d), copy=True),
        )


def _torch_targets() -> Iterator[Target]:
    try:
        torch = _import("torch")
    except ImportError as exc:
        reason = _unavailable(exc, "torch is not installed (pip install torch)")
        for dev in ("cpu", "cuda"):
            for dtype in ("float64", "float32"):
                yield Target("torch", dev, dtype, reason=reason)
        return
    from array_api_compat import array_namespace

    devices: list[tuple[str, Optional[str]]] = [("cpu", None)]
    devices.append(("cuda", None if torch.cuda.is_available() else "torch reports no CUDA device (torch.cuda.is_available() is False)"))
    for dev, missing in devices:
        for dtype in ("float64", "float32"):
            yield Target(
                "torch", dev, dtype, reason=missing,
                _namespace=lambda: array_namespace(torch.empty(0)),
                _asarray=functools.partial(_torch_asarray, torch, device=dev),
            )


def _torch_asarray(torch: Any, a: Any, dtype: str, *, device: str) -> Any:
    import numpy as np

    # Cast and copied by NumPy first, into a C-ordered array: torch takes neither a big-endian array (FITS
    # data, a '>f8' file) nor a longdouble one, nor negative strides (np.flip(x), x[::-1]), and each aborted
    # the whole check; NumPy's cast rounds as torch's would. The copy is fresh, so torch may share it.
    return torch.asarray(np.array(a, dtype=dtype, order="C"), device=device)


def _jax_targets() -> Iterator[Target]:
    try:
        jax = _import("jax")
        jnp = _import("jax.numpy")
    except ImportError as exc:
        reason = _unavailable(exc, "jax is not installed (pip install jax)")
        for dtype in ("float64", "float32"):
            yield Target("jax", "cpu", dtype, reason=reason)
        return
    # Arrays go to JAX's default device: label the target with its platform ("cpu", "gpu", ...).
    platform = jax.default_backend()

    def namespace() -> Any:
        _x64_in_effect(jax)
        return jnp

    def asarray(a: Any, d: str) -> Any:
        _x64_in_effect(jax)
        return jnp.array(a, dtype=getattr(jnp, d), copy=True)

    for dtype in ("float64", "float32"):
        yield Target("jax", platform, dtype, _namespace=namespace, _asarray=asarray,
                     _settings=functools.partial(_jax_x64, jax))


def _jax_x64(jax: Any) -> contextlib.AbstractContextManager[Any]:
    """JAX's 64-bit types in the calling thread, for the duration of a ``with`` (older JAX: its experimental twin)."""
    if hasattr(jax, "enable_x64"):
        return jax.enable_x64(True)
    experimental = importlib.import_module("jax.experimental")  # jax < 0.7
    return experimental.enable_x64(True)


def _x64_in_effect(jax: Any) -> None:
    """Turn JAX's x64 mode on process-wide unless it is on here already (inside `Target.configured`, say):
    JAX's float64 target needs it, and without it a float64 array is silently float32."""
    if not jax.config.jax_enable_x64:
        jax.config.update("jax_enable_x64", True)


def _cupy_targets() -> Iterator[Target]:
    reason = None
    try:
        cupy = _import("cupy")
        try:
            if cupy.cuda.runtime.getDeviceCount() < 1:
                reason = "CuPy found no CUDA device"
        except Exception as exc:  # CUDA driver/runtime missing or broken
            reason = f"CuPy cannot reach a CUDA device ({type(exc).__name__}: {exc})"
    except ImportError as exc:
        cupy = None
        reason = _unavailable(exc, "cupy is not installed (needs a CUDA GPU: pip install cupy-cuda12x)")
    from array_api_compat import array_namespace

    for dtype in ("float64", "float32"):
        yield Target(
            "cupy", "cuda", dtype, reason=reason,
            _namespace=lambda: array_namespace(cupy.empty(0)),
            _asarray=lambda a, d: cupy.asarray(a, dtype=d),
        )


def targets(*, backends: Optional[Iterable[str]] = None, dtypes: Optional[Iterable[str]] = None) -> list[Target]:
    """Every (backend, device, dtype) this package checks, available or not (with the reason).

    ``backends`` (names: ``"numpy"``, ``"array_api_strict"``, ``"torch"``,
    ``"jax"``, ``"cupy"``) and ``dtypes`` (``"float64"``, ``"float32"``)
    select a subset; an unknown name is a ``ValueError``, a single string (not
    a list of names) a ``TypeError``. Listing changes no setting; using a
    JAX target (its ``xp`` or ``asarray``) outside `Target.configured`
    turns on JAX's process-wide ``jax_enable_x64`` (its float64 arrays need
    it), so that JAX's default dtype is float64 afterwards in the whole
    process.
    """
    for name, value in (("backends", backends), ("dtypes", dtypes)):
        if isinstance(value, str):
            raise TypeError(f"{name} must be a list of names, not the string {value!r}: {name}=[{value!r}]")
    makers = _TARGET_MAKERS
    asked = list(makers) if backends is None else list(backends)
    wanted = None if dtypes is None else set(dtypes)
    for name in asked:
        if name not in makers:
            raise ValueError(f"unknown backend {name!r}: use one of {list(makers)}")
    # In the library's fixed order, whatever the order given (a set's depends on string hashing, and
    # pytest-xdist's workers must collect the same tests); a name given twice counts once.
    chosen = [name for name in makers if name in asked]
    if wanted is not None and not wanted <= set(TOLERANCES):
        raise ValueError(f"unknown dtypes {sorted(wanted - set(TOLERANCES))}: use {list(TOLERANCES)}")
    out: list[Target] = []
    for name in chosen:
        out.extend(t for t in makers[name]() if wanted is None or t.dtype in wanted)
    return out


_TARGET_MAKERS: dict[str, Callable[[], Iterator[Target]]] = {
    "numpy": _numpy_targets,
    "array_api_strict": _strict_targets,
    "torch": _torch_targets,
    "jax": _jax_targets,
    "cupy": _cupy_targets,
}
"""Each backend's name, as `targets` takes it, and what lists its targets."""

_all_targets = targets  # for check_backends, whose ``targets`` argument shadows the function


def reference_gradients(shape: Sequence[int], steps: int, *, seed: int = 0) -> list[Any]:
    """A seeded, NumPy float64 sequence of ``steps`` gradients of ``shape`` (``(..., m, n)``, two sizes at least).

    The gradients have anisotropic row and column scales (spread 0.3 to 3) and
    a slowly drifting low-rank signal plus noise, so that ``P`` and ``Q`` move
    well away from the identity and every line of Algorithm 1 matters.
    """
    import numpy as np

    from .linalg import _check_integer

    if isinstance(shape, numbers.Integral) or len(shape) < 2:
        raise ValueError(f"shape must have at least two dimensions, (..., m, n), got {shape!r}")
    for side in shape:
        _check_integer("each size of shape", side, minimum=0)
    _check_integer("steps", steps, minimum=0)
    rng = np.random.default_rng(seed)
    *batch, m, n = shape
    row_scale = np.geomspace(0.3, 3.0, m)[rng.permutation(m)][:, None]
    col_scale = np.geomspace(0.3, 3.0, n)[rng.permutation(n)][None, :]
    u = rng.standard_normal((*batch, m, 2))
    v = rng.standard_normal((*batch, 2, n))
    grads = []
    for _ in range(steps):
        u = 0.9 * u + 0.1 * rng.standard_normal(u.shape)
        signal = u @ v / np.sqrt(n)
        noise = rng.standard_normal((*batch, m, n))
        grads.append(row_scale * (signal + noise) * col_scale)
    return grads


def run_trajectory(
    optimizer: FISMO, W0: Any, gradients: Sequence[Any], asarray: Callable[[Any], Any]
) -> Iterator[tuple[Any, FISMOState]]:
    """Run ``optimizer`` from ``W0`` over ``gradients`` (NumPy arrays), yielding ``(W_t, state_t)``.

    ``asarray`` converts each NumPy array to the target backend; the
    gradients are fixed in advance so every backend sees the same sequence.
    """
    W = asarray(W0)
    state = optimizer.init(W)
    for G in gradients:
        W, state = optimizer.step(W, asarray(G), state)
        yield W, state


def max_relative_error(got: Any, reference: Any) -> float:
    """``||got - reference||_F / ||reference||_F``, per matrix over the last two axes and worst over a batch.

    Either may be an array of any supported backend (read through `to_numpy`), or nested lists
    of numbers; a list or tuple of arrays is a ``TypeError`` (stacked, several outputs were judged
    as one: a 50 % error of one vector hid behind a large other). Integer and boolean arrays are
    compared from their exact difference (through float64, ``2**53 + 1`` equalled ``2**53``).
    Arrays of fewer than two dimensions are compared as one vector. A zero
    reference makes the error absolute; a NaN or infinity of ``got`` is
    ``inf`` unless the reference has the same one in the same place (as
    ``numpy.testing.assert_allclose`` counts NaN equal to NaN): the error is
    then that of the other entries. A shape mismatch is a ``ValueError``.
    """
    import numpy as np

    # Nested lists pass through NumPy; an array of any backend through `to_numpy` (a torch reference that
    # requires grad, or is bfloat16, was refused by NumPy).
    for value in (got, reference):
        if isinstance(value, (list, tuple)) and any(_holds_an_array(v) for v in value):
            raise TypeError("max_relative_error compares one array, got a list or tuple of arrays: compare each "
                            "output on its own (check_backends does so for a function's outputs)")
    host = [_host_array(np.asarray(v) if isinstance(v, (list, tuple)) else v) for v in (got, reference)]
    if host[0].shape != host[1].shape:
        raise ValueError(f"shape {host[0].shape} does not match the reference's {host[1].shape}")
    if all(_is_exact(h) for h in host):
        return _integer_error(*host)
    got, reference = (to_numpy(h) for h in host)
    return float(np.max(relative_errors(got, reference), initial=0.0))


def _holds_an_array(value: Any) -> bool:
    """Whether ``value`` is, or (a list or tuple) holds, an array rather than numbers."""
    if isinstance(value, (list, tuple)):
        return any(_holds_an_array(v) for v in value)
    return hasattr(value, "shape") and hasattr(value, "dtype") and getattr(value, "ndim", 0) > 0


def relative_errors(got: Any, reference: Any) -> Any:
    """The relative Frobenius error of each matrix (last two axes) as a NumPy array of the batch shape.

    For arrays of fewer than two dimensions, one error (a 0-d array). A NaN
    or infinity in either array gives ``inf``, unless both arrays have it in
    the same place (NaN for NaN, the same signed infinity; for complex, each
    part): such entries agree and are left out of both norms. Complex arrays
    are compared by modulus. Both arrays are first divided by the power of
    two of their largest entry, per matrix (exact), so the sums of
    squares neither overflow nor underflow at any scale (1e-170 or 1e200 in
    float64).
    """
    import numpy as np

    got, reference = to_numpy(got), to_numpy(reference)
    got, reference = _without_agreeing_nonfinite(got, reference)
    axes = (-2, -1) if reference.ndim >= 2 else None
    with np.errstate(invalid="ignore", over="ignore"):  # a non-finite got: an inf error, below
        amax = np.maximum(np.max(np.abs(got), axis=axes, keepdims=True, initial=0.0),
                          np.max(np.abs(reference), axis=axes, keepdims=True, initial=0.0))
        exponent = np.frexp(np.where(np.isfinite(amax) & (amax > 0), amax, 1.0))[1]
        # Scaled by ldexp, exactly, and not by multiplying with 2**-exponent: that factor overflows for a
        # matrix whose largest entry is below 2**-1024 (float64's subnormal numbers).
        got, reference = _ldexp(got, -exponent), _ldexp(reference, -exponent)
        diff = np.sqrt(np.sum(np.square(np.abs(got - reference)), axis=axes))
        scale = np.sqrt(np.sum(np.square(np.abs(reference)), axis=axes))
        # A zero reference: the absolute error, in the arrays' own units.
        absolute = np.ldexp(diff, np.reshape(exponent, np.shape(diff)))
        err = np.where(scale > 0, diff / np.where(scale > 0, scale, 1.0), absolute)
    return np.where(np.isfinite(err), err, np.inf)


def _ldexp(x: Any, exponent: Any) -> Any:
    """``x * 2**exponent`` computed exactly by NumPy's ``ldexp``, for complex ``x`` too (part by part)."""
    import numpy as np

    if not np.iscomplexobj(x):
        return np.ldexp(x, exponent)
    real, imag = np.ldexp(np.real(x), exponent), np.ldexp(np.imag(x), exponent)
    out = np.empty(np.broadcast_shapes(real.shape, imag.shape), dtype=x.dtype)
    out.real, out.imag = real, imag
    return out


def _without_agreeing_nonfinite(got: Any, reference: Any) -> tuple[Any, Any]:
    """``got`` and ``reference`` with each non-finite value that both hold in the same place set to zero in both."""
    import numpy as np

    def agree(a: Any, b: Any) -> Any:  # real parts: the same NaN or the same signed infinity
        return (np.isnan(a) & np.isnan(b)) | (np.isinf(a) & (a == b))

    if np.iscomplexobj(got) or np.iscomplexobj(reference):
        # Each part agrees (a non-finite one as above, a finite one exactly), and one of them is not finite.
        parts = [(np.real(got), np.real(reference)), (np.imag(got), np.imag(reference))]
        both = np.logical_and.reduce([agree(a, b) | (np.isfinite(a) & (a == b)) for a, b in parts])
        same = both & ~(np.isfinite(got) & np.isfinite(reference))
    else:
        same = agree(got, reference)
    if not np.any(same):
        return got, reference
    return np.where(same, 0, got), np.where(same, 0, reference)


# ------------------------------------------------------------- the harness
@dataclass(frozen=True)
class Result:
    """The outcome of one target in a `Report`.

    ``error`` is the worst relative error against NumPy float64 (``None``:
    skipped, see ``target.reason``; ``inf``: the target raised, see
    ``exception``, or an output could not be compared by value). ``where``
    names the first quantity that failed (or where the exception was raised);
    ``details`` holds the errors at that point (for `check_backends`: every
    output's error; for ``fismo verify``: every line of Algorithm 1 at the
    failing step). ``mismatches`` (`check_backends` only) names each output
    whose namespace, device, dtype or shape is not what the inputs imply,
    with what it found and expected, e.g. ``{"output[0]": "namespace numpy,
    expected torch"}``.
    """

    target: Target
    error: Optional[float] = None
    tolerance: float = math.nan
    exception: Optional[str] = None
    where: Optional[str] = None
    steps: Optional[int] = None
    details: Mapping[str, float] = field(default_factory=dict)
    mismatches: Mapping[str, str] = field(default_factory=dict)

    @property
    def passed(self) -> Optional[bool]:
        """``None`` when skipped, else whether it ran without error, every output as expected, within the tolerance."""
        if self.error is None:
            return None
        return self.exception is None and not self.mismatches and self.error <= self.tolerance

    @property
    def verdict(self) -> str:
        """The table's last column.

        ``pass``; ``FAIL at W: what`` (output ``W``'s namespace, device,
        dtype or shape, found and expected, e.g. ``FAIL at output[0]: dtype
        float64, expected float32``); ``FAIL at W`` (its values left the
        tolerance); ``FAIL (Exc: message)`` (the function raised); or
        ``skipped: reason``.
        """
        if self.error is None:
            return f"skipped: {self.target.reason}"
        if self.passed:
            return "pass"
        where = f" at {self.where}" if self.where else ""
        if self.exception is not None:
            return f"FAIL{where} ({self.exception})"
        if self.where is not None and self.where in self.mismatches:
            return f"FAIL{where}: {self.mismatches[self.where]}"
        return f"FAIL{where}"


class Report(list[Result]):
    """A list of `Result`, one per target, with the table and summary of ``fismo verify``."""

    @property
    def ran(self) -> list[Result]:
        return [r for r in self if r.error is not None]

    @property
    def failed(self) -> list[Result]:
        return [r for r in self if r.passed is False]

    @property
    def ok(self) -> bool:
        """True when at least one target ran and none failed."""
        return bool(self.ran) and not self.failed

    def table(self) -> str:
        """A fixed-width table: backend, device, dtype, [steps,] max rel. error, tolerance, result."""
        with_steps = any(r.steps is not None for r in self)
        header = ("backend", "device", "dtype", *(("steps",) if with_steps else ()), "max rel. error", "tolerance", "result")
        rows = []
        for r in self:
            t = r.target
            steps = ((str(r.steps) if r.steps is not None and r.error is not None else "-"),) if with_steps else ()
            error = "-" if r.error is None else f"{r.error:.2e}"
            first, *more = r.verdict.splitlines() or [""]  # one row per target: a long message is in explain()
            verdict = f"{first} [...; the rest in Report.explain()]" if more else first
            rows.append((t.backend, t.device, t.dtype, *steps, error, _tolerance_text(r.tolerance), verdict))
        widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header) - 1)]
        lines = []
        for row in [header, *rows]:
            lines.append("  ".join(cell.ljust(w) for cell, w in zip(row, widths)) + "  " + row[-1])
            if row is header:
                lines.append("  ".join("-" * w for w in widths) + "  " + "-" * len(header[-1]))
        return "\n".join(lines)

    def summary(self) -> str:
        """``"N passed, M failed, K skipped"``."""
        ran, failed = self.ran, self.failed
        return f"{len(ran) - len(failed)} passed, {len(failed)} failed, {len(self) - len(ran)} skipped"

    def explain(self) -> str:
        """For every failed target, the errors at its first failure (``details``), marked where above
        tolerance, and each output's mismatch (``mismatches``) beside its error."""
        blocks = []
        for r in self.failed:
            lines = [f"{r.target.id}: {r.verdict} (tolerance {_tolerance_text(r.tolerance)})"]
            for name, err in r.details.items():
                mark = "  > tolerance" if not err <= r.tolerance else ""
                mismatch = f"  {r.mismatches[name]}" if name in r.mismatches else ""
                lines.append(f"    {name:<24s} {err:.2e}{mark}{mismatch}")
            blocks.append("\n".join(lines))
        return "\n\n".join(blocks)

    def __str__(self) -> str:
        return self.table() + "\n\n" + self.summary()


class HarnessError(RuntimeError):
    """`check_backends` itself failed on a target: converting its inputs, or reading or comparing an output.

    The check did not happen, so there is no verdict on the function for
    that target; the original exception is chained (``__cause__``).
    """


def _tolerance_text(tolerance: float) -> str:
    """The tolerance in the fewest digits that give it back (``1e-04``; ``1.4e-04``, which one digit showed as
    ``1e-04``)."""
    return next((text for digits in range(17) if float(text := f"{tolerance:.{digits}e}") == tolerance),
                repr(tolerance))


def _flatten(out: Any, prefix: str = "output") -> dict[str, Any]:
    """Name every array of a (nested) output: tuples by index, named tuples by field, dicts by key.

    A named tuple is a ``NamedTuple`` or a struct sequence (torch's ``torch.return_types``, which have no
    ``_fields``): both list their fields in ``__match_args__``. torch's ``slogdet`` was named
    ``output[0]``, NumPy's ``output.sign``, and every torch row failed as "missing".
    """
    fields = getattr(type(out), "__match_args__", None) if isinstance(out, tuple) else None
    if isinstance(fields, tuple) and len(fields) == len(out) and all(isinstance(k, str) for k in fields):
        items: Iterable[tuple[str, Any]] = ((f"{prefix}.{k}", v) for k, v in zip(fields, out))
    elif isinstance(out, (tuple, list)):
        items = ((f"{prefix}[{i}]", v) for i, v in enumerate(out))
    elif isinstance(out, Mapping):
        items = ((f"{prefix}[{k!r}]", v) for k, v in out.items())
    else:
        return {prefix: out}
    flat: dict[str, Any] = {}
    for name, value in items:
        flat.update(_flatten(value, name))
    return flat


DTYPE_NAMES: tuple[str, ...] = (
    "bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
    "float32", "float64", "complex64", "complex128",
)
"""The array API's dtype names: what ``out_dtypes`` of `check_backends` may declare."""


@dataclass(frozen=True)
class _Expected:
    """What one target's converted inputs imply for the function's array outputs."""

    xp: Any  # array_api_compat.array_namespace of the converted floating inputs
    device: Any  # array_api_compat.device of the first of them
    dtype: Any  # their floating dtype, in that namespace


def _namespace_name(xp: Any) -> str:
    return str(getattr(xp, "__name__", xp)).removeprefix("array_api_compat.")


def _is_array(value: Any) -> bool:
    from array_api_compat import is_array_api_obj

    return type(value) not in _PYTHON_NUMBERS and is_array_api_obj(value)


def _mismatch(value: Any, reference: Any, expected: _Expected, declared: Optional[str]) -> Optional[str]:
    """How one output on a target differs from what its inputs imply, or ``None``.

    ``reference`` is the same output of the NumPy float64 call (a NumPy array
    or scalar, or a Python number), ``declared`` the dtype name the caller
    declared for it. A Python number is compared by type only (it has no
    namespace, device or dtype). Otherwise the namespace comes first: when it
    is wrong, device and dtype are not comparable; then device, dtype and
    shape, all those that differ.
    """
    from array_api_compat import array_namespace, device

    if type(reference) in _PYTHON_NUMBERS:
        if type(value) is type(reference):
            return None
        return f"type {type(value).__module__}.{type(value).__qualname__}, expected {type(reference).__name__}"
    if not _is_array(value):
        return f"namespace: {type(value).__qualname__} is not an array, expected {_namespace_name(expected.xp)}"
    xp = array_namespace(value)
    if xp is not expected.xp:
        return f"namespace {_namespace_name(xp)}, expected {_namespace_name(expected.xp)}"
    problems = []
    if device(value) != expected.device:
        problems.append(f"device {device(value)}, expected {expected.device}")
    if declared is not None:
        want, want_name = getattr(xp, declared), declared
    elif reference.dtype.kind == "f":  # the inputs' floating dtype on this target
        want, want_name = expected.dtype, _dtype_name(expected.dtype)
    elif reference.dtype.kind == "c" and _dtype_name(expected.dtype) in _COMPLEX_OF:  # rfft of float32: complex64
        want_name = _COMPLEX_OF[_dtype_name(expected.dtype)]
        want = getattr(xp, want_name)
    else:  # integer, boolean (and complex for half precision): the dtype NumPy float64 returns
        want, want_name = getattr(xp, reference.dtype.name), reference.dtype.name
    if value.dtype != want:
        problems.append(f"dtype {_dtype_name(value.dtype)}, expected {want_name}")
    if tuple(value.shape) != reference.shape:
        problems.append(f"shape {tuple(value.shape)}, expected {reference.shape}")
    return "; ".join(problems) or None


_COMPLEX_OF = {"float32": "complex64", "float64": "complex128"}
"""The complex dtype whose parts have a floating dtype: what a complex output of a target of that dtype has."""


def _value_error(value: Any, reference: Any) -> float:
    """`max_relative_error` of one output, or ``inf`` when it cannot be compared (not a number or array, another shape)."""
    import numpy as np

    comparable = type(value) in _PYTHON_NUMBERS or (_is_array(value) and tuple(value.shape) == np.shape(reference))
    return max_relative_error(value, reference) if comparable else math.inf


def _inexact_count(value: Any, reference: Any) -> Optional[str]:
    """Integers and booleans (indices, masks, counts) are equal or wrong: how many entries differ, or ``None``.

    ``reference`` is NumPy float64's output as returned (it says the kind).

    Compared by the relative error with the floating tolerance, an index off by one in a vector of
    300,000 entries passed a float32 row (error 5e-6; a user's hunt, 2026-12-02).
    """
    import numpy as np

    if not _is_exact(np.asarray(reference)):  # a Python bool or int too
        return None
    # Their own values, not `to_numpy`'s float64 (exact up to 2**53 only: int64 ids 2**53 + 1 and 2**53
    # compared equal). The dtypes agree here (`_mismatch` came first).
    differ = int(np.count_nonzero(_host_array(value) != _host_array(reference)))
    size = int(np.size(reference))
    if not differ:
        return None
    return f"{'it differs' if size == 1 else f'{differ} of {size} entries differ'} (integer and boolean outputs must be equal)"


def _is_exact(a: Any) -> bool:
    """Whether host array ``a`` holds integers or booleans, compared exactly: an integer or boolean dtype, or
    an object array of Python ints and bools (`_host_array` of an int beyond int64; until 2026-12-04 those
    were compared within the floating tolerance: ``2**70`` and ``2**70 + 1`` passed)."""
    if a.dtype.kind in "biu":
        return True
    return a.dtype.kind == "O" and a.size > 0 and all(type(v) in (int, bool) for v in a.flat)


def _is_ml_dtypes_float(dtype: Any) -> bool:
    """Whether a NumPy dtype is one of ml_dtypes' floats (bfloat16, float8_*: what ``np.asarray`` of a JAX
    bfloat16 array gives), which NumPy files under kind ``"V"``, not ``"f"``."""
    return dtype.kind == "V" and dtype.fields is None and type(dtype).__module__.startswith("ml_dtypes") \
        and "float" in dtype.name


def _integer_error(value: Any, reference: Any) -> float:
    """`max_relative_error` of integer or boolean outputs, from their exact difference.

    Through float64, int64 ``2**53 + 1`` against ``2**53`` has error 0 (both round to ``2**53``): a row
    failed by `_inexact_count` showed "0.00e+00" as its error. The difference is taken in Python integers
    and rounded once; the norms are then `relative_errors`' (against a zero reference: absolute).
    """
    import numpy as np

    got, ref = _host_array(value).astype(object), _host_array(reference).astype(object)
    difference = np.asarray(got - ref, dtype=np.float64)
    size = np.asarray(ref, dtype=np.float64)
    zero = np.zeros_like(size)
    norm_of_difference, norm_of_reference = relative_errors(difference, zero), relative_errors(size, zero)
    errors = np.where(norm_of_reference > 0, norm_of_difference / np.where(norm_of_reference > 0, norm_of_reference, 1.0),
                      norm_of_difference)
    return float(np.max(errors, initial=0.0))


def _declared_dtypes(out_dtypes: Union[str, Mapping[str, str], None], reference: Mapping[str, Any]) -> dict[str, str]:
    """``out_dtypes`` as a dtype name per array output of the reference call (validated)."""
    if out_dtypes is None:
        return {}
    arrays = [name for name, value in reference.items() if value is not None and type(value) not in _PYTHON_NUMBERS]
    if isinstance(out_dtypes, str):
        return dict.fromkeys(arrays, out_dtypes)
    unknown = [name for name in out_dtypes if name not in arrays]
    if unknown:
        raise ValueError(f"out_dtypes names {unknown}, which are not array outputs of fn: those are {arrays}")
    return dict(out_dtypes)


def _check_out_dtypes(out_dtypes: Any) -> None:
    if out_dtypes is None:
        return
    if isinstance(out_dtypes, str):
        names = [out_dtypes]
    elif isinstance(out_dtypes, Mapping):
        names = list(out_dtypes.values())
    else:
        raise TypeError(f"out_dtypes must be a dtype name or a mapping from output name to dtype name, "
                        f"got {type(out_dtypes).__name__}")
    bad = [n for n in names if n not in DTYPE_NAMES]
    if bad:
        raise ValueError(f"out_dtypes: unknown dtype name(s) {bad}: use one of {list(DTYPE_NAMES)}")


def check_backends(
    fn: Callable[..., Any],
    *args: Any,
    targets: Optional[Sequence[Target]] = None,
    tolerances: Optional[Mapping[str, float]] = None,
    out_dtypes: Union[str, Mapping[str, str], None] = None,
    **kwargs: Any,
) -> Report:
    """Run ``fn`` on every installed backend, device and dtype, and compare with NumPy float64.

    ``fn`` is any array-API function (it finds its namespace with
    ``array_api_compat.array_namespace`` from its inputs). Every NumPy
    array among ``args`` and ``kwargs`` is converted to each target's
    backend and device: floating ones (at least one floating or complex
    array is needed) to its dtype, complex ones to its complex dtype,
    integer and boolean ones (indices, masks) keeping theirs; other
    arguments are passed unchanged; the reference call gets float64 and
    complex128. Every call gets its own copies, so a ``fn`` that writes into
    its input changes neither the caller's arrays nor the reference. Each
    target runs inside `Target.configured`. The outputs (an
    array, or tuples, lists, dicts and named tuples of arrays, nested) are
    checked one by one: each must be an array of the inputs' namespace
    (``array_api_compat.array_namespace`` of the converted inputs: a NumPy
    array returned for a torch input fails), on their device
    (``array_api_compat.device``), of their floating dtype, and of the
    reference's shape; then its values must be within ``tolerances[dtype]``
    of the reference by `max_relative_error` (default `TOLERANCES`,
    measured on FISMO: pass your own for your function). A target that
    raises fails with its exception. NumPy scalars (``xp.mean(x)`` on NumPy)
    are 0-d arrays; an output that is a Python number on NumPy float64 must
    be one of the same type everywhere, and is compared by value only.

    ``out_dtypes`` declares a dtype other than the inputs' floating one: a
    name from `DTYPE_NAMES` for every array output (``"float64"`` for a
    function that always returns float64), or a mapping from output names
    as the report writes them (``"output[1]"``) to dtype names. An
    undeclared complex output must have the complex dtype of the target's
    floating one (``complex64`` on float32, as ``rfft`` gives); an
    undeclared output that is neither floating nor complex on NumPy float64
    (indices, masks) must have the dtype it has there. Integer and boolean
    outputs (arrays, Python ints and bools) must equal the reference's
    exactly, whatever the tolerance.

    ``targets`` defaults to `targets()` (unavailable ones are reported as
    skipped). Matrix products run in true float32 (`full_float32_matmuls`).
    An exception of the NumPy float64 reference call propagates.

    An exception inside the harness (converting the inputs, reading or
    comparing an output) is raised as a `HarnessError` naming the target,
    never reported as the function's failure. Not as a row: the check did
    not happen, so there is no verdict to put in one; a FAIL row would blame
    ``fn`` for the harness's fault, and a third kind of row would have to be
    taught to every reader of a `Report` (``ok``, the summary, ``fismo
    verify``'s exit status, the assertions users write).

    Examples
    --------
    A function written against the array API passes every target; one
    that computes in NumPy whatever its input fails every other namespace,
    although its values are right:

    >>> import numpy as np
    >>> from array_api_compat import array_namespace
    >>> from fismo_core.testing import check_backends, targets
    >>> def gram(x):
    ...     xp = array_namespace(x)
    ...     return x @ xp.matrix_transpose(x) / x.shape[-1]
    >>> def leaky_tanh(x):
    ...     return np.tanh(np.asarray(x)) * 2
    >>> x = np.random.default_rng(0).standard_normal((8, 5))
    >>> cpu = targets(backends=["numpy", "array_api_strict"])
    >>> report = check_backends(gram, x, targets=cpu)
    >>> report.ok, report.summary()
    (True, '4 passed, 0 failed, 0 skipped')
    >>> for r in check_backends(leaky_tanh, x, targets=cpu):
    ...     print(f"{r.target.id:<36} {r.error <= r.tolerance!s:<5} {r.verdict}")
    numpy-cpu-float64                    True  pass
    numpy-cpu-float32                    True  pass
    array_api_strict-CPU_DEVICE-float64  True  FAIL at output: namespace numpy, expected array_api_strict
    array_api_strict-CPU_DEVICE-float32  True  FAIL at output: namespace numpy, expected array_api_strict

    A function that returns float64 whatever its input fails the float32
    rows, unless that dtype is declared:

    >>> def mean64(x):
    ...     xp = array_namespace(x)
    ...     return xp.mean(xp.astype(x, xp.float64))
    >>> [r.verdict for r in check_backends(mean64, x, targets=cpu) if not r.passed]
    ['FAIL at output: dtype float64, expected float32', 'FAIL at output: dtype float64, expected float32']
    >>> check_backends(mean64, x, targets=cpu, out_dtypes="float64").ok
    True
    """
    import numpy as np

    tolerances = TOLERANCES if tolerances is None else tolerances
    if isinstance(targets, Target):
        raise TypeError(f"targets must be a list of Target, got the Target {targets.id} alone: pass [target]")
    if isinstance(targets, str):
        raise TypeError(f"targets must be a list of Target, got the string {targets!r}: pass "
                        f"targets=targets(backends=[{targets!r}])")
    chosen = _all_targets() if targets is None else list(targets)
    for t in chosen:
        if not isinstance(t, Target):
            raise TypeError(f"targets must be a list of Target, got {t!r} among them: pass "
                            "targets=fismo_core.testing.targets(backends=[...]) to choose by name")
        if t.dtype not in tolerances:
            raise ValueError(f"no tolerance for dtype {t.dtype!r} in {dict(tolerances)}")
    for dtype, tolerance in dict(tolerances).items():
        if isinstance(tolerance, bool) or not isinstance(tolerance, numbers.Real) or not tolerance >= 0:
            raise ValueError(f"tolerances[{dtype!r}] must be a number >= 0, got {tolerance!r}")
    _check_out_dtypes(out_dtypes)

    def inexact(value: Any) -> bool:
        return isinstance(value, np.ndarray) and (value.dtype.kind in "fc" or _is_ml_dtypes_float(value.dtype))

    def exact(value: Any) -> bool:
        return isinstance(value, np.ndarray) and value.dtype.kind in "biu"

    if not any(inexact(v) for v in (*args, *kwargs.values())):
        raise ValueError("check_backends needs at least one floating (or complex) NumPy array among the "
                         "arguments of fn: those are what it converts to each target's dtype (arrays inside "
                         "lists, tuples or dicts are not converted: pass them as arguments of their own)")

    def convert(to: Callable[[Any, str], Any], dtype: str) -> tuple[list[Any], dict[str, Any], list[Any]]:
        """``fn``'s arguments as new arrays of one backend (``to(array, dtype name)``, a copy), and those arrays.

        Floating arrays get ``dtype``, complex ones the complex dtype of ``dtype``; integer and boolean
        ones (indices, masks) keep their own. Other arguments are passed unchanged. Each call gets its
        own copies, so that a ``fn`` that writes into its input changes neither the caller's arrays, nor
        the reference, nor the next target's input."""
        def one(v: Any) -> Any:
            if exact(v):
                return to(v, v.dtype.name)
            if inexact(v):
                return to(v, _COMPLEX_OF[dtype] if v.dtype.kind == "c" else dtype)
            return v

        a = [one(v) for v in args]
        k = {name: one(v) for name, v in kwargs.items()}
        converted = [c for c, v in zip((*a, *k.values()), (*args, *kwargs.values())) if inexact(v)]
        return a, k, converted

    report = Report()
    with full_float32_matmuls():
        a, k, _ = convert(lambda v, d: np.array(v, dtype=d, copy=True), "float64")
        reference = _flatten(fn(*a, **k))
        for name, value in reference.items():
            numeric = isinstance(value, (np.ndarray, np.generic)) and value.dtype.kind in "biufc"
            if not (value is None or type(value) in _PYTHON_NUMBERS or numeric):
                kind = (f"an array of dtype {value.dtype}" if isinstance(value, (np.ndarray, np.generic))
                        else f"a {type(value).__qualname__}")
                raise ValueError(f"fn returned {kind} at {name} on NumPy float64: check_backends compares "
                                 "numeric arrays, Python numbers and None")
        if all(value is None for value in reference.values()):
            raise ValueError("fn returned nothing to compare on NumPy float64 (None, or an empty tuple or dict): "
                             "a function that writes into its input must return it, so that its result is "
                             "compared")
        reference64 = {name: to_numpy(v) for name, v in reference.items() if v is not None}
        declared = _declared_dtypes(out_dtypes, reference)
        for t in chosen:
            tolerance = float(tolerances[t.dtype])
            if not t.available:
                report.append(Result(t, None, tolerance))
                continue
            with t.configured():
                report.append(_check_target(fn, t, tolerance, convert, reference, reference64, declared))
    return report


def _check_target(
    fn: Callable[..., Any],
    target: Target,
    tolerance: float,
    convert: Callable[[Callable[[Any, str], Any], str], tuple[list[Any], dict[str, Any], list[Any]]],
    reference: Mapping[str, Any],
    reference64: Mapping[str, Any],
    declared: Mapping[str, str],
) -> Result:
    """One row of `check_backends`: only ``fn``'s own exceptions become a FAIL; the harness's raise `HarnessError`."""
    from array_api_compat import array_namespace, device

    try:
        a, k, converted = convert(target._asarray, target.dtype)
        xp = array_namespace(*converted)
        expected = _Expected(xp, device(converted[0]), getattr(xp, target.dtype))
    except Exception as exc:
        raise HarnessError(f"check_backends could not convert the inputs to {target.id} "
                           f"({type(exc).__name__}: {exc})") from exc
    try:
        out = fn(*a, **k)
    except Exception as exc:  # the function raised: its failure on this target, not the check's
        return Result(target, math.inf, tolerance, exception=f"{type(exc).__name__}: {exc}")
    try:
        return _compare(target, tolerance, _flatten(out), reference, reference64, declared, expected)
    except Exception as exc:
        raise HarnessError(f"check_backends failed comparing the outputs of {target.id} with NumPy float64 "
                           f"({type(exc).__name__}: {exc})") from exc


def _compare(
    target: Target,
    tolerance: float,
    out: Mapping[str, Any],
    reference: Mapping[str, Any],
    reference64: Mapping[str, Any],
    declared: Mapping[str, str],
    expected: _Expected,
) -> Result:
    """The row of a target whose call returned ``out`` (flattened): every output's mismatch and error, the first failure."""
    errors: dict[str, float] = {}
    mismatches: dict[str, str] = {}
    for name, ref in reference.items():
        if name not in out:
            errors[name], mismatches[name] = math.inf, "missing (NumPy float64 returns it)"
        elif ref is None:
            if out[name] is not None:
                errors[name] = math.inf
                mismatches[name] = f"{type(out[name]).__qualname__} where NumPy float64 returns None"
        else:
            mismatch = _mismatch(out[name], ref, expected, declared.get(name))
            errors[name] = _value_error(out[name], reference64[name])
            if mismatch is None and math.isfinite(errors[name]):
                mismatch = _inexact_count(out[name], ref)
                if mismatch is not None:
                    errors[name] = _integer_error(out[name], ref)
            if mismatch is not None:
                mismatches[name] = mismatch
    for name in out:
        if name not in reference:
            errors[name], mismatches[name] = math.inf, "not among NumPy float64's outputs"
    where = next((name for name, err in errors.items() if name in mismatches or not err <= tolerance), None)
    return Result(target, max(errors.values(), default=0.0), tolerance, where=where, details=errors,
                  mismatches=mismatches)
