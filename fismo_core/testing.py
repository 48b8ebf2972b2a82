"""Cross-backend checking: which backends are installed, and a seeded reference trajectory.

Used by the test suite's ``xp`` fixture and by ``fismo verify``, so both see
the same backends, devices and dtypes. NumPy is imported lazily: it is the
reference backend, needed to check, not to run the optimizer.

A `Target` is one (backend, device, dtype) combination. `targets()`
lists every combination this package knows, each either available or with
the reason it is not (library missing, no CUDA device, ...).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

from .optimizer import FISMO, FISMOState

__all__ = [
    "TOLERANCES",
    "VERIFY_SHAPES",
    "Target",
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
float64: measured worst case 1.8e-14 on torch and JAX (NumPy and
array-api-strict share LAPACK and agree exactly); 1e-10 is the issue's bar
and leaves four orders of headroom. float32: measured worst case 8.9e-6 on
every backend (float32 rounding, 6e-8, amplified by eigh and Newton–Schulz
along 50 steps); 1e-4 leaves a factor of 11 for other BLAS/LAPACK builds
and GPUs while any formula error, which shows up at order 1e-1 or more,
still fails. Measured with ``fismo verify``; see ``docs/verification.md``."""

VERIFY_SHAPES: tuple[tuple[int, ...], ...] = ((16, 16), (8, 24), (24, 8), (3, 8, 12))
"""Shapes of the verification trajectory: square, wide, tall and a batch."""


@dataclass(frozen=True)
class Target:
    """One backend, device and dtype to run FISMO on.

    ``reason`` is ``None`` when the target is available, otherwise why not.
    """

    backend: str
    device: str
    dtype: str
    reason: Optional[str] = None
    _namespace: Callable[[], Any] = field(default=lambda: None, repr=False, compare=False)
    _asarray: Callable[[Any, str], Any] = field(default=lambda a, d: None, repr=False, compare=False)

    @property
    def available(self) -> bool:
        return self.reason is None

    @property
    def id(self) -> str:
        return f"{self.backend}-{self.device}-{self.dtype}"

    @property
    def xp(self) -> Any:
        """The array namespace (through array-api-compat where the library needs it)."""
        return self._namespace()

    @property
    def tolerance(self) -> float:
        return TOLERANCES[self.dtype]

    def asarray(self, a: Any) -> Any:
        """A NumPy array as an array of this target (backend, device and dtype)."""
        return self._asarray(a, self.dtype)


def to_numpy(x: Any) -> Any:
    """Any supported backend's array as a NumPy float64 array (copying from a device if needed)."""
    import numpy as np

    module = type(x).__module__.split(".")[0]
    if module == "cupy":
        return np.asarray(x.get(), dtype=np.float64)
    if module == "torch":
        import torch

        return x.detach().to(device="cpu", dtype=torch.float64).numpy()
    # NumPy, JAX (CPU) and array-api-strict (any of its virtual devices) export through
    # DLPack, which knows no bfloat16: widen narrow floats first.
    from array_api_compat import array_namespace

    xp = array_namespace(x)
    if x.dtype not in (xp.float32, xp.float64):
        x = xp.astype(x, xp.float32)
    return np.asarray(np.from_dlpack(x), dtype=np.float64)


def pin_full_float32_matmuls() -> None:
    """Make float32 matmuls full float32 in every installed library: TF32 off, highest precision.

    Verification compares float32 against a tolerance measured with full
    float32 products; TF32 (10-bit mantissa, on by default for some GPU
    settings) would fail it without any bug. Called by ``fismo verify`` and
    the test suite; it changes process-wide settings of torch and JAX.
    """
    try:
        torch = _import("torch")
    except ImportError:
        pass
    else:
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        torch.set_float32_matmul_precision("highest")
    try:
        jax = _import("jax")
    except ImportError:
        pass
    else:
        jax.config.update("jax_default_matmul_precision", "highest")


def _import(name: str) -> Any:
    return importlib.import_module(name)


def _numpy_targets() -> Iterator[Target]:
    try:
        np = _import("numpy")
    except ImportError:
        yield Target("numpy", "cpu", "float64", reason="numpy is not installed (pip install numpy)")
        return
    from array_api_compat import array_namespace

    for dtype in ("float64", "float32"):
        yield Target(
            "numpy", "cpu", dtype,
            _namespace=lambda: array_namespace(np.empty(0)),
            _asarray=lambda a, d: np.asarray(a, dtype=d),
        )


def _strict_targets() -> Iterator[Target]:
    try:
        xs = _import("array_api_strict")
    except ImportError:
        for dtype in ("float64", "float32"):
            yield Target("array_api_strict", "CPU_DEVICE", dtype, reason="array-api-strict is not installed (pip install array-api-strict)")
        return
    for dtype in ("float64", "float32"):
        yield Target(
            "array_api_strict", "CPU_DEVICE", dtype,
            _namespace=lambda: xs,
            _asarray=lambda a, d: xs.asarray(a, dtype=getattr(xs, d)),
        )


def _torch_targets() -> Iterator[Target]:
    try:
        torch = _import("torch")
    except ImportError:
        for dev in ("cpu", "cuda"):
            for dtype in ("float64", "float32"):
                yield Target("torch", dev, dtype, reason="torch is not installed (pip install torch)")
        return
    from array_api_compat import array_namespace

    devices = [("cpu", None)]
    devices.append(("cuda", None if torch.cuda.is_available() else "torch reports no CUDA device (torch.cuda.is_available() is False)"))
    for dev, reason in devices:
        for dtype in ("float64", "float32"):
            yield Target(
                "torch", dev, dtype, reason=reason,
                _namespace=lambda: array_namespace(torch.empty(0)),
                _asarray=lambda a, d, dev=dev: torch.asarray(a, dtype=getattr(torch, d), device=dev),
            )


def _jax_targets() -> Iterator[Target]:
    try:
        jax = _import("jax")
        jnp = _import("jax.numpy")
    except ImportError:
        for dtype in ("float64", "float32"):
            yield Target("jax", "cpu", dtype, reason="jax is not installed (pip install jax)")
        return
    # float64 needs x64 mode; it is a process-wide switch of JAX's.
    jax.config.update("jax_enable_x64", True)
    # Arrays go to JAX's default device: label the target with its platform ("cpu", "gpu", ...).
    platform = jax.default_backend()
    for dtype in ("float64", "float32"):
        yield Target(
            "jax", platform, dtype,
            _namespace=lambda: jnp,
            _asarray=lambda a, d: jnp.asarray(a, dtype=getattr(jnp, d)),
        )


def _cupy_targets() -> Iterator[Target]:
    reason = None
    try:
        cupy = _import("cupy")
        try:
            if cupy.cuda.runtime.getDeviceCount() < 1:
                reason = "CuPy found no CUDA device"
        except Exception as exc:  # CUDA driver/runtime missing or broken
            reason = f"CuPy cannot reach a CUDA device ({type(exc).__name__}: {exc})"
    except ImportError:
        cupy = None
        reason = "cupy is not installed (needs a CUDA GPU: pip install cupy-cuda12x)"
    from array_api_compat import array_namespace

    for dtype in ("float64", "float32"):
        yield Target(
            "cupy", "cuda", dtype, reason=reason,
            _namespace=lambda: array_namespace(cupy.empty(0)),
            _asarray=lambda a, d: cupy.asarray(a, dtype=d),
        )


def targets() -> list[Target]:
    """Every (backend, device, dtype) this package checks, available or not (with the reason)."""
    out: list[Target] = []
    for make in (_numpy_targets, _strict_targets, _torch_targets, _jax_targets, _cupy_targets):
        out.extend(make())
    return out


def reference_gradients(shape: Sequence[int], steps: int, *, seed: int = 0) -> list[Any]:
    """A seeded, NumPy float64 sequence of ``steps`` gradients of ``shape``.

    The gradients have anisotropic row and column scales (spread 0.3 to 3) and
    a slowly drifting low-rank signal plus noise, so that ``P`` and ``Q`` move
    well away from the identity and every line of Algorithm 1 matters.
    """
    import numpy as np

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
    """``||got - reference||_F / ||reference||_F`` over the last two axes, worst over the batch."""
    import numpy as np

    got, reference = to_numpy(got), np.asarray(reference, dtype=np.float64)
    diff = np.linalg.norm(got - reference, axis=(-2, -1))
    scale = np.linalg.norm(reference, axis=(-2, -1))
    return float(np.max(diff / np.where(scale > 0, scale, 1.0)))
