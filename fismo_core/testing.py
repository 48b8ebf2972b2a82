"""Cross-backend checking: the backends, devices and dtypes installed, and a harness to compare them.

Used by ``fismo verify``, by the test suite's fixtures and by anyone who
writes array-API code and wants it checked the same way:

- `targets()` lists every (backend, device, dtype) this package knows, each
  either available or with the reason it is not (library missing, no CUDA
  device, ...). A `Target` converts NumPy data to its arrays.
- `check_backends(fn, *args)` runs any array-API function on every available
  target and on NumPy float64, and returns a `Report`: one `Result` per
  target (worst relative error, the per-dtype tolerance, the first output
  that left it) that prints as the table of ``fismo verify``.
- `full_float32_matmuls()` pins true float32 matrix products (TF32 off) for
  the duration of a check; ``fismo_core.pytest_plugin`` exposes the targets
  as a pytest fixture.

NumPy is imported lazily: it is the reference backend, needed to check, not
to run the optimizer.
"""

from __future__ import annotations

import contextlib
import importlib
import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

from .optimizer import FISMO, FISMOState

__all__ = [
    "TOLERANCES",
    "VERIFY_SHAPES",
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
float64: measured worst case 1.8e-14 on torch and JAX (NumPy and
array-api-strict share LAPACK and agree exactly); 1e-10 is the issue's bar
and leaves four orders of headroom. float32: measured worst case 8.9e-6 on
every backend (float32 rounding, 6e-8, amplified by eigh and Newton–Schulz
along 50 steps); 1e-4 leaves a factor of 11 for other BLAS/LAPACK builds
and GPUs while any formula error, which shows up at order 1e-1 or more,
still fails. Measured with ``fismo verify``; see ``docs/verification.md``."""

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
    settings) would fail it without any bug. Called by the test suite's
    ``conftest.py`` and the pytest plugin; it changes process-wide settings of
    torch and JAX and leaves them so (`full_float32_matmuls` restores them).
    """
    _set_matmul_settings(_FULL_FLOAT32)


_FULL_FLOAT32 = {"torch": (False, False, "highest"), "jax": "highest"}


def _matmul_settings() -> dict[str, Any]:
    out: dict[str, Any] = {}
    torch = _loaded("torch")
    if torch is not None:
        out["torch"] = (
            torch.backends.cuda.matmul.allow_tf32,
            torch.backends.cudnn.allow_tf32,
            torch.get_float32_matmul_precision(),
        )
    jax = _loaded("jax")
    if jax is not None:
        out["jax"] = jax.config.jax_default_matmul_precision
    return out


def _set_matmul_settings(settings: Mapping[str, Any]) -> None:
    torch = _loaded("torch")
    if torch is not None and "torch" in settings:
        cuda_tf32, cudnn_tf32, precision = settings["torch"]
        torch.backends.cuda.matmul.allow_tf32 = cuda_tf32
        torch.backends.cudnn.allow_tf32 = cudnn_tf32
        torch.set_float32_matmul_precision(precision)
    jax = _loaded("jax")
    if jax is not None and "jax" in settings:
        jax.config.update("jax_default_matmul_precision", settings["jax"])


def _loaded(name: str) -> Any:
    try:
        return _import(name)
    except ImportError:
        return None


@contextlib.contextmanager
def full_float32_matmuls() -> Iterator[None]:
    """Within the block, float32 matrix products are true float32 in torch and JAX; the settings are restored after.

    torch: ``torch.backends.cuda.matmul.allow_tf32`` and
    ``torch.backends.cudnn.allow_tf32`` off, ``set_float32_matmul_precision
    ("highest")``; JAX: ``jax_default_matmul_precision = "highest"``. CuPy
    reads its TF32 switch (``CUPY_TF32``) from the environment at import:
    leave it unset. `check_backends` and ``fismo verify`` run inside this.
    """
    before = _matmul_settings()
    _set_matmul_settings(_FULL_FLOAT32)
    try:
        yield
    finally:
        _set_matmul_settings(before)


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


def targets(*, backends: Optional[Iterable[str]] = None, dtypes: Optional[Iterable[str]] = None) -> list[Target]:
    """Every (backend, device, dtype) this package checks, available or not (with the reason).

    ``backends`` (names: ``"numpy"``, ``"array_api_strict"``, ``"torch"``,
    ``"jax"``, ``"cupy"``) and ``dtypes`` (``"float64"``, ``"float32"``)
    select a subset; an unknown name is a ``ValueError``.
    """
    makers = {
        "numpy": _numpy_targets,
        "array_api_strict": _strict_targets,
        "torch": _torch_targets,
        "jax": _jax_targets,
        "cupy": _cupy_targets,
    }
    chosen = list(makers) if backends is None else list(backends)
    wanted = None if dtypes is None else set(dtypes)
    for name in chosen:
        if name not in makers:
            raise ValueError(f"unknown backend {name!r}: use one of {list(makers)}")
    if wanted is not None and not wanted <= set(TOLERANCES):
        raise ValueError(f"unknown dtypes {sorted(wanted - set(TOLERANCES))}: use {list(TOLERANCES)}")
    out: list[Target] = []
    for name in chosen:
        out.extend(t for t in makers[name]() if wanted is None or t.dtype in wanted)
    return out


_all_targets = targets  # for check_backends, whose ``targets`` argument shadows the function


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
    """``||got - reference||_F / ||reference||_F``, per matrix over the last two axes and worst over a batch.

    Arrays of fewer than two dimensions are compared as one vector. A zero
    reference makes the error absolute; a non-finite ``got`` is ``inf``; a
    shape mismatch is a ``ValueError``.
    """
    import numpy as np

    got, reference = to_numpy(got), np.asarray(reference, dtype=np.float64)
    if got.shape != reference.shape:
        raise ValueError(f"shape {got.shape} does not match the reference's {reference.shape}")
    return float(np.max(relative_errors(got, reference), initial=0.0))


def relative_errors(got: Any, reference: Any) -> Any:
    """The relative Frobenius error of each matrix (last two axes) as a NumPy array of the batch shape.

    For arrays of fewer than two dimensions, one error (a 0-d array). NaN or
    infinity in ``got`` gives ``inf``.
    """
    import numpy as np

    got = np.asarray(got, dtype=np.float64)
    reference = np.asarray(reference, dtype=np.float64)
    axes = (-2, -1) if reference.ndim >= 2 else None
    diff = np.sqrt(np.sum(np.square(got - reference), axis=axes))
    scale = np.sqrt(np.sum(np.square(reference), axis=axes))
    err = diff / np.where(scale > 0, scale, 1.0)
    return np.where(np.isfinite(err), err, np.inf)


# ------------------------------------------------------------- the harness
@dataclass(frozen=True)
class Result:
    """The outcome of one target in a `Report`.

    ``error`` is the worst relative error against NumPy float64 (``None``:
    skipped, see ``target.reason``; ``inf``: the target raised, see
    ``exception``). ``where`` names the first quantity whose error left
    ``tolerance`` (or where the exception was raised); ``details`` holds the
    errors at that point (for `check_backends`: every output's error; for
    ``fismo verify``: every line of Algorithm 1 at the failing step).
    """

    target: Target
    error: Optional[float] = None
    tolerance: float = math.nan
    exception: Optional[str] = None
    where: Optional[str] = None
    steps: Optional[int] = None
    details: Mapping[str, float] = field(default_factory=dict)

    @property
    def passed(self) -> Optional[bool]:
        """``None`` when skipped, else whether it ran without error within the tolerance."""
        if self.error is None:
            return None
        return self.exception is None and self.error <= self.tolerance

    @property
    def verdict(self) -> str:
        """The table's last column: ``pass``, ``FAIL at ...``, ``FAIL (exception) ...`` or ``skipped: reason``."""
        if self.error is None:
            return f"skipped: {self.target.reason}"
        if self.passed:
            return "pass"
        where = f" at {self.where}" if self.where else ""
        if self.exception is not None:
            return f"FAIL{where} ({self.exception})"
        return f"FAIL{where}"


class Report(list):
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
            rows.append((t.backend, t.device, t.dtype, *steps, error, f"{r.tolerance:.0e}", r.verdict))
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
        """For every failed target, the errors at its first failure (``details``), marked where above tolerance."""
        blocks = []
        for r in self.failed:
            lines = [f"{r.target.id}: {r.verdict} (tolerance {r.tolerance:.0e})"]
            for name, err in r.details.items():
                mark = "  > tolerance" if not err <= r.tolerance else ""
                lines.append(f"    {name:<24s} {err:.2e}{mark}")
            blocks.append("\n".join(lines))
        return "\n\n".join(blocks)

    def __str__(self) -> str:
        return self.table() + "\n\n" + self.summary()


def _flatten(out: Any, prefix: str = "output") -> dict[str, Any]:
    """Name every array of a (nested) output: tuples by index, NamedTuples by field, dicts by key."""
    if isinstance(out, tuple) and hasattr(out, "_fields"):
        items: Iterable[tuple[str, Any]] = ((f"{prefix}.{k}", v) for k, v in zip(out._fields, out))
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


def _as_numpy64(value: Any) -> Any:
    import numpy as np

    if isinstance(value, (bool, int, float)):
        return np.float64(value)
    if value is None:
        return None
    return to_numpy(value)


def check_backends(
    fn: Callable[..., Any],
    *args: Any,
    targets: Optional[Sequence[Target]] = None,
    tolerances: Optional[Mapping[str, float]] = None,
    **kwargs: Any,
) -> Report:
    """Run ``fn`` on every installed backend, device and dtype, and compare with NumPy float64.

    ``fn`` is any array-API function (it finds its namespace with
    ``array_api_compat.array_namespace`` from its inputs). Every floating
    NumPy array among ``args`` and ``kwargs`` is converted to each target's
    backend, device and dtype (other arguments are passed unchanged); the
    reference call gets them as NumPy float64. The outputs (an array, or
    tuples, lists, dicts and NamedTuples of arrays, nested) are compared
    one by one with `max_relative_error`. A target passes when no output's
    error exceeds ``tolerances[dtype]`` (default `TOLERANCES`, measured on
    FISMO: pass your own for your function); a target that raises fails.

    ``targets`` defaults to `targets()` (unavailable ones are reported as
    skipped). Matrix products run in true float32 (`full_float32_matmuls`).
    An exception of the NumPy float64 reference call propagates.

    Example::

        from fismo_core.testing import check_backends
        import numpy as np

        def gram(x):
            return x @ x.mT / x.shape[-1]

        report = check_backends(gram, np.random.default_rng(0).standard_normal((8, 5)))
        print(report)          # the table of ``fismo verify``
        assert report.ok
    """
    import numpy as np

    tolerances = TOLERANCES if tolerances is None else tolerances
    chosen = _all_targets() if targets is None else list(targets)

    def convert(value: Any, asarray: Callable[[Any], Any]) -> Any:
        if isinstance(value, np.ndarray) and np.issubdtype(value.dtype, np.floating):
            return asarray(value)
        return value

    def call(asarray: Callable[[Any], Any]) -> dict[str, Any]:
        a = [convert(v, asarray) for v in args]
        k = {name: convert(v, asarray) for name, v in kwargs.items()}
        return _flatten(fn(*a, **k))

    report = Report()
    with full_float32_matmuls():
        reference = {k: _as_numpy64(v) for k, v in call(lambda a: np.asarray(a, dtype=np.float64)).items()}
        for t in chosen:
            if t.dtype not in tolerances:
                raise ValueError(f"no tolerance for dtype {t.dtype!r} in {dict(tolerances)}")
            tolerance = float(tolerances[t.dtype])
            if not t.available:
                report.append(Result(t, None, tolerance))
                continue
            try:
                out = call(t.asarray)
                if set(out) != set(reference):
                    raise ValueError(f"outputs {sorted(out)} differ from the reference's {sorted(reference)}")
                errors = {}
                for name, ref in reference.items():
                    if ref is None:
                        if out[name] is not None:
                            raise ValueError(f"{name} is {out[name]!r} where the reference gives None")
                        continue
                    errors[name] = max_relative_error(_as_numpy64(out[name]), ref)
            except Exception as exc:  # a target that crashes fails its row, not the check
                report.append(Result(t, math.inf, tolerance, exception=f"{type(exc).__name__}: {exc}"))
                continue
            where = next((name for name, err in errors.items() if not err <= tolerance), None)
            report.append(Result(t, max(errors.values(), default=0.0), tolerance, where=where, details=errors))
    return report
