"""Matrix functions FISMO needs, written once against the Python array API.

Every function here takes arrays of shape ``(..., m, n)``: leading dimensions
are a batch, so many same-shape matrices run as one call. The namespace,
dtype and device follow the input (``array_api_compat.array_namespace``);
only functions from the array API standard and its ``linalg`` extension are
used, so the same code runs on NumPy, CuPy, PyTorch, JAX and array-api-strict.

Each matrix function has an *exact* method (``eigh`` / ``svd``, the reference)
and a *matmul-only* method (Newton–Schulz, the fast path on accelerators).
Their accuracy against each other is documented in the docstrings and tested
in ``tests/test_linalg.py``.

`polar` and `inverse_sqrt` refuse input on which they would be wrong (NaN or
infinity; for ``inverse_sqrt`` also non-symmetric, indefinite or singular to
working precision) with `LinalgInputError`; ``check=False`` turns the checks
and their host reads off. ``docs/linalg.md`` opens with the SciPy equivalents.
"""

from __future__ import annotations

import contextlib
import math
import numbers
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Literal, Optional, Union, overload

from array_api_compat import array_namespace, device, is_array_api_strict_namespace, is_numpy_namespace

from fismo_core import _autodiff

__all__ = [
    "CUBIC_COEFFICIENTS",
    "LinalgInputError",
    "MUON_COEFFICIENTS",
    "POLAR_DTYPE_NAMES",
    "POLAR_EXPRESS_COEFFICIENTS",
    "default_polar_rtol",
    "inverse_sqrt",
    "inverse_sqrt_tolerance",
    "inverse_sqrt_steps",
    "newton_schulz_schedule",
    "polar",
    "sym",
    "trace_normalize",
    "whiten",
]

Array = Any
"""Any array of an array-API-compatible library."""

Coefficients = Union[Literal["muon", "polar_express", "cubic"], Sequence[Sequence[float]]]

#: Keller Jordan's quintic for Muon, (a, b, c) of p(x) = a x + b x^3 + c x^5,
#: used unchanged at every step (as in ``torch.optim.Muon``).
MUON_COEFFICIENTS: tuple[tuple[float, float, float], ...] = ((3.4445, -4.7750, 2.0315),)

_POLAR_EXPRESS_RAW = (
    (8.28721201814563, -23.595886519098837, 17.300387312530933),
    (4.107059111542203, -2.9478499167379106, 0.5448431082926601),
    (3.9486908534822946, -2.908902115962949, 0.5518191394370137),
    (3.3184196573706015, -2.488488024314874, 0.51004894012372),
    (2.300652019954817, -1.6689039845747493, 0.4188073119525673),
    (1.891301407787398, -1.2679958271945868, 0.37680408948524835),
    (1.8750014808534479, -1.2500016453999487, 0.3750001645474248),
    (1.875, -1.25, 0.375),
)
_POLAR_EXPRESS_SAFETY = 1.01

#: The degree-5 Polar Express schedule of Amsel, Persson, Musco and Gower,
#: "The Polar Express: Optimal Matrix Sign Methods and Their Application to the
#: Muon Algorithm" (2025, arXiv:2505.16932), Algorithm 1: eight (a, b, c)
#: triples, optimal in the sup norm for singular values in [1e-3, 1], each but
#: the last divided by (1.01, 1.01^3, 1.01^5) for round-off safety. Steps past
#: the eighth repeat the last triple, which is the classical degree-5
#: Newton–Schulz polynomial (15x - 10x^3 + 3x^5)/8.
POLAR_EXPRESS_COEFFICIENTS: tuple[tuple[float, float, float], ...] = tuple(
    (a / _POLAR_EXPRESS_SAFETY, b / _POLAR_EXPRESS_SAFETY**3, c / _POLAR_EXPRESS_SAFETY**5)
    for a, b, c in _POLAR_EXPRESS_RAW[:-1]
) + (_POLAR_EXPRESS_RAW[-1],)

#: The classical cubic Newton–Schulz step ``p(x) = (3x - x^3) / 2`` as an (a, b, c)
#: triple: it converges quadratically to 1 on ``(0, sqrt(3))``. As a schedule of
#: ``inverse_sqrt`` it is the coupled iteration of Higham (2008), eq. 6.35.
CUBIC_COEFFICIENTS: tuple[tuple[float, float, float], ...] = ((1.5, -0.5, 0.0),)

# Frobenius-norm divisor safety factor of each named schedule: Polar Express
# divides by 1.01 * ||X||_F so that round-off cannot push a singular value
# above 1, where its first polynomials blow up; Muon and the cubic divide by ||X||_F.
_NORMALIZATION_SAFETY = {"muon": 1.0, "polar_express": _POLAR_EXPRESS_SAFETY, "cubic": 1.0}
_NAMED_SCHEDULES = {"muon": MUON_COEFFICIENTS, "polar_express": POLAR_EXPRESS_COEFFICIENTS, "cubic": CUBIC_COEFFICIENTS}

#: Default ``inverse_sqrt`` step count of each convergent schedule: enough to reach
#: float64 precision for ``kappa' = ||A||_F / lambda_min`` up to 1e6 (the design
#: interval of Polar Express) in exact arithmetic; see ``inverse_sqrt``.
INVERSE_SQRT_STEPS = {"polar_express": 9, "cubic": 22}


def sym(X: Array) -> Array:
    """Symmetric part ``sym(X) = (X + X^T) / 2`` of square matrices ``(..., d, d)``.

    A ``ValueError`` for a non-square ``X`` (``X + X^T`` broadcast a ``(1, 3)`` to ``(3, 3)``), a ``TypeError``
    for a non-floating one: checks of the shape and dtype only, no array operation.
    """
    xp = _check_float_matrices(X, "sym: X", square=True)
    return (X + xp.matrix_transpose(X)) / 2


def trace_normalize(A: Array) -> Array:
    """Rescale square matrices ``(..., d, d)`` to trace ``d``: ``(d / tr A) A``.

    This is the normalisation of Algorithm 1 (``P_t = sym(m / tr(P~_t) P~_t)``);
    it removes the scale ambiguity ``(P, Q) ~ (cP, Q/c)`` of the Kronecker metric.
    A non-square or non-floating ``A`` is refused as by `sym`.
    """
    xp = _check_float_matrices(A, "trace_normalize: A", square=True)
    d = A.shape[-1]
    return (d / xp.linalg.trace(A))[..., None, None] * A


def whiten(X: Array, left: Array, right: Array) -> Array:
    """Two-sided product ``left @ X @ right`` on stacks of matrices.

    With ``left = P^{-1/2}`` and ``right = Q^{-1/2}`` this is the whitening of
    Algorithm 1 line 6 (``G~ = P^{-1/2} G Q^{-1/2}``) and the un-whitening of
    line 8 (``P^{-1/2} Polar(M) Q^{-1/2}``). The association is fixed as
    ``(left @ X) @ right`` so every backend rounds the same way. All three
    must come from one array library, live on one device and share one dtype
    (the result's: NumPy and JAX promoted a float32 ``X`` to float64 where
    torch raised).
    """
    for array, name in ((X, "X"), (left, "left"), (right, "right")):
        _check_float_matrices(array, name)
    _check_same_namespace_and_device(X, left, right)
    if not X.dtype == left.dtype == right.dtype:
        raise TypeError(
            "whiten: X, left and right must share one dtype, got "
            f"{_dtype_name(X.dtype)}, {_dtype_name(left.dtype)} and {_dtype_name(right.dtype)}"
        )
    _check_product_shapes(X, left, right)
    return (left @ X) @ right


def _check_product_shapes(X: Array, left: Array, right: Array) -> None:
    """A ``ValueError`` naming the three shapes unless ``left @ X @ right`` is defined: ``left``'s columns
    are ``X``'s rows, ``right``'s rows ``X``'s columns, and the batch dimensions broadcast. Each library's
    own error differs (NumPy a ValueError, torch a RuntimeError, JAX a TypeError) and names no argument;
    a factor of the wrong side (``Q^{-1/2}`` for ``P^{-1/2}``) is the usual cause."""
    batches = [tuple(a.shape[:-2]) for a in (X, left, right)]
    batch_ok = all(
        len({b[-k] for b in batches if len(b) >= k} - {1}) <= 1 for k in range(1, max(map(len, batches)) + 1)
    )
    if left.shape[-1] != X.shape[-2] or right.shape[-2] != X.shape[-1] or not batch_ok:
        raise ValueError(
            "whiten: left @ X @ right needs left's columns to be X's rows, right's rows X's columns and "
            "broadcastable batch dimensions, got shapes "
            f"X {tuple(X.shape)}, left {tuple(left.shape)}, right {tuple(right.shape)}"
        )


def _materialised_coefficients(coefficients: Any) -> Any:
    """``coefficients`` with an iterator, and each triple given as one, read into tuples: a config validates
    them and then stores them, two reads. Names and anything else are returned as they are."""
    if isinstance(coefficients, str):
        return coefficients
    if isinstance(coefficients, Iterator):
        coefficients = tuple(coefficients)
    if isinstance(coefficients, (tuple, list)):
        return tuple(tuple(t) if isinstance(t, Iterator) else t for t in coefficients)
    return coefficients


def newton_schulz_schedule(
    coefficients: Coefficients, steps: int
) -> tuple[tuple[tuple[float, float, float], ...], float]:
    """The ``steps`` (a, b, c) triples a schedule uses, and its norm safety factor.

    A schedule shorter than ``steps`` repeats its last triple (Muon's single
    triple at every step; Polar Express past its eighth step).
    """
    _check_integer("steps", steps)
    triples: tuple[tuple[float, ...], ...]  # (a, b, c) triples once checked below
    if isinstance(coefficients, str):
        if coefficients not in _NAMED_SCHEDULES:
            raise ValueError(
                f"unknown Newton–Schulz coefficients {coefficients!r}: use 'muon', "
                "'polar_express', 'cubic' or a sequence of (a, b, c) triples"
            )
        triples = _NAMED_SCHEDULES[coefficients]
        safety = _NORMALIZATION_SAFETY[coefficients]
    else:
        try:
            triples = tuple(tuple(_coefficient(v) for v in t) for t in coefficients)
        except TypeError:  # None, a number, or one flat (a, b, c): Python's "'float' object is not iterable"
            raise ValueError(
                "explicit Newton–Schulz coefficients must be a non-empty sequence of (a, b, c) triples, got "
                f"{coefficients!r} (one triple is written ((a, b, c),))"
            ) from None
        if not triples or any(len(t) != 3 for t in triples):
            raise ValueError(
                "explicit Newton–Schulz coefficients must be a non-empty sequence "
                f"of (a, b, c) triples, got {coefficients!r}"
            )
        if not all(math.isfinite(v) for t in triples for v in t):
            raise ValueError(f"Newton–Schulz coefficients must be finite, got {coefficients!r}")
        safety = 1.0
    schedule = tuple(triples[min(k, len(triples) - 1)] for k in range(steps))
    return schedule, safety  # type: ignore[return-value]


def _coefficient(v: Any) -> float:
    """One Newton–Schulz coefficient as a float; a ``TypeError`` for text, which ``float`` read as a number
    (``["123"]`` was the triple (1, 2, 3), ``("1.5", "-0.5", "0")`` numbers; a user's hunt, 2026-12-03)."""
    if isinstance(v, (str, bytes)) or not hasattr(v, "__float__"):
        raise TypeError(f"not a number: {v!r}")
    return _float_or_inf(v)


def _float_or_inf(v: Any) -> float:
    """``float(v)``, with an int past float's range (10**400) as infinity, which the caller refuses by name."""
    try:
        return float(v)
    except OverflowError:
        return math.inf


def _pow2_of(amax: Array, floor: float = 1.0) -> Array:
    """Per matrix, from ``amax = max|X|`` (``(..., 1, 1)``), the power of two ``s = 2^floor(log2 max(amax, floor))``,
    at most ``2^-log2(smallest normal)`` (`_capped`).

    With the default ``floor`` 1, ``s`` is 1 unless ``max|X| >= 2``; a ``floor`` below 1 (> 0) scales
    small matrices up too (the polar factor's normalisation, down to its ``eps``). Dividing by ``s``
    (and multiplying back) is exact in binary floating point, barring subnormals, so a computation on
    ``X / s`` rescaled afterwards rounds exactly as the computation on ``X`` wherever the latter does
    not overflow or underflow; ``X / s`` has entries below 2 (below 4 where the cap holds: ``max|X|`` in
    the dtype's top binade), so its squares cannot overflow.
    Elementwise operations only: no host synchronisation. ``floor`` must be at least the dtype's
    smallest normal number: a smaller one rounds to zero (or is flushed, as XLA does), and a zero
    matrix then gives ``s = 0`` and ``0 / 0``.
    """
    xp = array_namespace(amax)
    # full_like, not the Python scalar: array-api-compat's torch maximum promotes a scalar through
    # torch.result_type, which torch.compile cannot trace (a graph break); the values are the same.
    return 2.0 ** _capped(xp, xp.floor(xp.log2(xp.maximum(amax, xp.full_like(amax, floor)))))


def _capped(xp: Any, exponent: Array) -> Array:
    """``exponent`` at most ``-log2`` of its dtype's smallest normal number (float64 1022, float32 and
    bfloat16 126, float16 14).

    XLA divides by multiplying with the reciprocal and flushes subnormal numbers to zero: ``X / 2^k``
    was zero on JAX for ``k`` = 1023 (float64; float32 127), whose reciprocal is subnormal. And at the
    dtype's largest number ``log2`` rounds up (float64 to 1024): ``2^k`` was infinite on every backend.
    With the cap the reciprocal of ``2^k`` is a normal number; ``k`` changes only for a ``max|X|`` in
    the dtype's top binade (float64 from ``2^1023``).
    """
    info = xp.finfo(exponent.dtype)
    # NumPy's (and JAX's) finfo states the exponent; NumPy's long double's smallest normal, 2^-16382,
    # underflows to 0 as a Python float (log2 raised a math domain error).
    top = -info.minexp if hasattr(info, "minexp") else -math.log2(float(info.smallest_normal))
    return xp.minimum(exponent, xp.full_like(exponent, top))


def nan_is_the_answer(xp: Any) -> Any:
    """A context in which NumPy (and array-api-strict, which wraps it) does not warn of the NaN it makes.

    Where a NaN is a result the caller reads as a flag (the NaN root of a
    singular factor that its check fails, with the ``1 / sqrt(0)`` and the residual's products on the
    way), NumPy's ``RuntimeWarning`` (invalid value, divide by zero, overflow) would only precede the
    library's own message; so would NumPy's eigh's "overflow encountered in cast" of a float32 ``A``
    whose eigenvalue lies beyond float32's range (decomposed in float64), which `inverse_sqrt` refuses.
    Other namespaces do not warn; for them it does nothing.
    """
    if is_numpy_namespace(xp) or is_array_api_strict_namespace(xp):
        import numpy

        return numpy.errstate(invalid="ignore", divide="ignore", over="ignore")
    return contextlib.nullcontext()


def _exact_dtype(xp: Any, A: Array) -> Array:
    """``A`` as the exact decompositions take it: half precision (``eigh``, ``svd`` and ``eigvalsh`` exist
    for float32 and float64 only, in LAPACK and cuSOLVER) cast to float32; other dtypes unchanged."""
    return xp.astype(A, xp.float32) if xp.finfo(A.dtype).bits < 32 else A


def _frobenius_norm(xp: Any, Y: Array) -> Array:
    """``||Y||_F`` per matrix, shape ``(..., 1, 1)`` in ``Y``'s dtype, as the Newton–Schulz normalisations take it.

    The sum of squares runs in at least float32: float16's overflowed past
    about 16k entries of size 2 (a zero `polar`, a non-finite
    `inverse_sqrt`, on NumPy and JAX). Where a derivative may be asked for,
    a zero matrix's norm is taken of ones and replaced by 0: the norm's
    derivative at 0 is 0/0, NaN in JAX even where the caller multiplies it
    by 0 (`polar` at ``X = 0`` had a NaN derivative where the map is
    ``X / eps`` through a polynomial). The values are the same either way.
    """
    def norm_of(Y: Array) -> Array:
        return xp.astype(xp.linalg.matrix_norm(_exact_dtype(xp, Y), keepdims=True), Y.dtype, copy=False)

    if not _autodiff.needs_derivative(Y):
        return norm_of(Y)
    nonzero = xp.any(Y != 0, axis=(-2, -1), keepdims=True)
    norm = norm_of(xp.where(nonzero, Y, xp.ones_like(Y)))
    return xp.where(nonzero, norm, xp.zeros_like(norm))


def _is_traced(x: Any) -> bool:
    """Whether ``x`` is a traced JAX array (``jax.jit``, ``grad``, ``vmap``), found without asking it.

    Asking a tracer for its device or value costs JAX an error message that
    walks the whole trace built so far, discarded at once: the time to trace
    a step grew quadratically with its number of matrices. JAX is not
    imported for this (``sys.modules``).
    """
    jax = sys.modules.get("jax")
    return jax is not None and isinstance(x, jax.core.Tracer)


def _under_torch_vmap(x: Any) -> bool:
    """Whether ``x`` is a torch tensor inside ``torch.func.vmap`` (at any level of functorch's transforms),
    where a host read raises vmap's "data-dependent control flow" error: the checks then step aside, as
    under ``jax.vmap`` (until 2026-12-03 every checked call failed there; a user's hunt). torch is not
    imported for this."""
    torch = sys.modules.get("torch")
    # Not asked while dynamo traces: it cannot trace functorch's interpreter stack (a graph break).
    if torch is None or not isinstance(x, torch.Tensor) or torch.compiler.is_compiling():
        return False
    try:
        from torch._C._functorch import TransformType
        from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters
    except ImportError:  # a torch without functorch's interpreter stack
        return False
    return any(level.key() == TransformType.Vmap for level in retrieve_all_functorch_interpreters())


def _readable(x: Array) -> bool:
    """Whether ``x``'s value can be read on the host without breaking a trace.

    Not a traced JAX array (`_is_traced`), nor a torch tensor inside
    ``torch.compile`` (a read there breaks the graph). Neither library is
    imported for this (``sys.modules``).
    """
    if _is_traced(x):
        return False
    torch = sys.modules.get("torch")
    return not (torch is not None and isinstance(x, torch.Tensor) and torch.compiler.is_compiling())


def _device(x: Array) -> Any:
    """``array_api_compat.device(x)``, and ``None`` for a traced JAX array (jit places it): `_is_traced`.

    A JAX array spread over a mesh of several devices answers its sharding, whose partition fits its own
    shape only: arrays made beside it (``eye(d)``, a 0-d counter, the factors) raised ``IndexError`` or
    ``IndivisibleError``, and two layouts on one mesh were "different devices". Its mesh, replicated
    (``NamedSharding(mesh, P())``), is answered instead: it holds any shape, and JAX combines it with
    every layout on that mesh.
    """
    if _is_traced(x):
        return None
    placement = device(x)
    if len(getattr(placement, "device_set", ())) > 1 and hasattr(placement, "mesh"):
        from jax.sharding import NamedSharding, PartitionSpec

        return NamedSharding(placement.mesh, PartitionSpec())
    return placement


def _host_bool(x: Array) -> Optional[bool]:
    """``bool(x)`` of a 0-d boolean array (a host read), or ``None`` where it is traced (``jax.jit``).

    A tracer is recognised without being asked (`_is_traced`).
    """
    if _is_traced(x):
        return None
    try:
        return bool(x)
    except TypeError:  # another library's lazy array that cannot be read
        return None


def _check_same_namespace_and_device(*arrays: Array) -> Any:
    """The common namespace of ``arrays``; a clear error if they mix libraries or devices."""
    try:
        xp = array_namespace(*arrays)
    except TypeError as exc:
        raise TypeError(f"all arrays of one call must come from one array library: {exc}") from exc
    # A traced JAX array (jax.jit, grad, vmap) has no device (None): it may meet a concrete one. An
    # uncommitted one (jnp.asarray of host data) goes where the committed ones are, as JAX's own arithmetic
    # takes it there (refused as "on another device" until 2026-12-03).
    devices = {str(_device(a)) for a in arrays if _device(a) is not None and getattr(a, "committed", True) is not False}
    if len(devices) > 1:
        raise ValueError(f"all arrays of one call must live on one device, got {sorted(devices)}")
    return xp


def _refuse_numpy_matrix(X: Any, name: str) -> None:
    """A clear ``TypeError`` for NumPy's legacy ``numpy.matrix``, whose ``*`` is a matrix product and whose
    reductions keep two dimensions: the array API's expressions fail on it or compute something else.
    SciPy's sparse ``.todense()`` returns one. And for a masked array, whose reductions skip its mask."""
    numpy = sys.modules.get("numpy")
    if numpy is not None and isinstance(X, numpy.matrix):
        raise TypeError(
            f"{name} is a numpy.matrix (scipy.sparse's .todense() returns one), whose * is a matrix product: "
            f"pass np.asarray({name}) (or the sparse matrix's .toarray())"
        )
    if numpy is not None and isinstance(X, numpy.ma.MaskedArray):
        # Its reductions skip the masked entries: a masked NaN passed the input checks and reached LAPACK
        # ("SVD did not converge"), a masked entry was used in the products (a user's hunt, 2026-12-04).
        raise TypeError(
            f"{name} is a numpy masked array, whose reductions skip the masked entries while its products use "
            f"them: pass {name}.filled(value) (the value the masked entries should have)"
        )


def _check_float_matrices(X: Array, name: str, *, square: bool = False) -> Any:
    _refuse_numpy_matrix(X, name)
    xp = array_namespace(X)
    if X.ndim < 2:
        raise ValueError(f"{name} must have shape (..., m, n) with at least 2 dimensions, got shape {tuple(X.shape)}")
    if square and X.shape[-1] != X.shape[-2]:
        raise ValueError(f"{name} must be square in its last two dimensions, got shape {tuple(X.shape)}")
    if not xp.isdtype(X.dtype, "real floating"):
        raise TypeError(f"{name} must have a real floating dtype, got {X.dtype}")
    return xp


class LinalgInputError(ValueError):
    """Input on which a matrix function would return a wrong answer without saying so.

    Raised by [`polar`][fismo_core.linalg.polar] and
    [`inverse_sqrt`][fismo_core.linalg.inverse_sqrt] when their input checks
    (``check=True``, the default) find a NaN or an infinity, a matrix that is
    not symmetric, or one that is not positive definite to working precision.
    The message names the function, the argument (with the batch index of the
    first failing matrix), the measure that failed and its value. A subclass
    of ``ValueError``.
    """


def _check_bool(name: str, value: Any) -> bool:
    """``value`` as a Python ``bool``; a ``TypeError`` naming ``name`` unless it is ``True`` or ``False``.

    The one check of every flag in the package (``check``, ``nesterov``). A
    NumPy ``bool_`` (a flag read from a NumPy array or a config) counts, as
    ``torch.optim`` takes one; ``1`` or ``"yes"`` do not.
    """
    numpy = sys.modules.get("numpy")  # not imported for this: without NumPy no NumPy bool can exist
    if isinstance(value, bool) or (numpy is not None and isinstance(value, numpy.bool_)):
        return bool(value)
    raise TypeError(f"{name} must be True or False, got {value!r}")


def _dtype_name(dtype: Any) -> str:
    """``float64`` for NumPy's, torch's (``torch.float64``), JAX's and array-api-strict's float64.

    Also for a scalar type such as ``numpy.float64`` or ``jax.numpy.float64`` (what ``xp.float64`` is there)."""
    return dtype.__name__ if isinstance(dtype, type) else str(dtype).rsplit(".", 1)[-1]


def _count_set(xp: Any, flags: Array) -> int:
    """How many of the boolean ``flags`` are set (a host read), summed in the device's default integer dtype:
    the sum's own default, int64, is refused on a device without 64-bit types (array-api-strict's "no_x64"),
    and a refusal became that error (a user's hunt, 2026-12-04)."""
    info = getattr(xp, "__array_namespace_info__", None)  # the standard's inspection API (2023.12 on)
    integral = xp.int64 if info is None else info().default_dtypes(device=_device(flags))["integral"]
    return int(xp.sum(xp.astype(flags, integral), dtype=integral))


def _first_failure(xp: Any, failed: Array, batch_shape: tuple[int, ...], name: str) -> tuple[str, int]:
    """``(label, flat index)`` of the first matrix flagged in the batch-shaped boolean ``failed``.

    The label is ``name`` for a single matrix and ``name[i, j]`` for a batch,
    followed by how many matrices of the batch fail; two host reads.
    """
    flat = xp.reshape(failed, (-1,))
    # The smallest flagged position, in int32: argmax makes an int64 index, which a device without 64-bit
    # types refuses (array-api-strict's "no_x64"), and the refusal became that error (a user's hunt, 2026-12-04).
    positions = xp.arange(flat.shape[0], dtype=xp.int32, device=_device(flat))
    first = int(xp.min(xp.where(flat, positions, xp.full_like(positions, flat.shape[0]))))
    if not batch_shape:
        return name, first
    count = _count_set(xp, flat)
    index, rest = [], first
    for size in reversed(batch_shape):
        rest, i = divmod(rest, size)
        index.append(i)
    label = f"{name}[{', '.join(map(str, reversed(index)))}] ({count} of {math.prod(batch_shape)} matrices of the batch fail)"
    return label, first


def _matrix(xp: Any, X: Array, flat_index: int) -> Array:
    """Matrix ``flat_index`` of the batch ``X`` ``(..., m, n)`` flattened to ``(-1, m, n)``."""
    return xp.reshape(X, (-1, *X.shape[-2:]))[flat_index, ...]


def _checks_can_run(xp: Any, X: Array, name: str, function: str) -> bool:
    """Raise `LinalgInputError` if ``X`` has a NaN or an infinity; ``False`` if ``X`` is traced.

    The first host read of a function's checks: under ``jax.jit`` it raises
    ``jax.errors.ConcretizationTypeError`` (a ``TypeError``), and the caller
    then leaves all its checks out (nothing can be read while tracing); so
    it does inside ``torch.func.vmap`` (`_under_torch_vmap`).
    """
    if _under_torch_vmap(X):
        return False
    try:
        if bool(xp.all(xp.isfinite(X))):
            return True
    except TypeError:
        return False
    failed = ~xp.all(xp.isfinite(X), axis=(-2, -1))
    label, first = _first_failure(xp, failed, tuple(X.shape[:-2]), name)
    bad = _matrix(xp, X, first)
    nan = _count_set(xp, xp.isnan(bad))
    inf = _count_set(xp, xp.isinf(bad))
    raise LinalgInputError(
        f"{function}: {label} is not finite: {nan} NaN and {inf} infinite of {math.prod(bad.shape)} entries"
    )


def _max_exponent(A: Array) -> Array:
    """``k = floor(log2 max|A|)`` per matrix, shape ``(..., 1, 1)`` (0 where ``A`` is zero), at most
    ``-log2(smallest normal)`` (`_capped`: float64 1022).

    ``A / 2^k`` has its largest entry in ``[1, 2)`` (in ``[1/2, 1)`` where ``log2`` rounds up, just below a
    power of two; in ``[2, 4)`` where the cap holds): exact in binary
    floating point (barring subnormals), so symmetry and the ratios of eigenvalues are unchanged, and its
    ``||.||_F`` can neither overflow nor underflow. The checks of `inverse_sqrt` run on ``A / 2^k``, its
    Newton–Schulz iteration on ``A / 4^floor(k/2)`` (whose root's factor is exact too).
    """
    xp = array_namespace(A)
    amax = xp.max(xp.abs(A), axis=(-2, -1), keepdims=True)
    return _capped(xp, xp.floor(xp.log2(xp.where(amax > 0, amax, xp.ones_like(amax)))))


def inverse_sqrt_tolerance(A: Array) -> float:
    """The cut of `inverse_sqrt`'s checks: ``d * eps``, relative to ``A``'s size.

    ``eps`` is that of the dtype the eigenvalues are computed in: ``A``'s,
    float32 for float16 and bfloat16 (whose own ``d eps`` reached 1 at
    ``d = 128`` in bfloat16 and refused ``2 I``; a user's hunt, 2026-12-03);
    and the cut is at least ``2 eps`` of ``A``'s own dtype, the asymmetry of
    a matrix built symmetric and rounded entry by entry to it. For float32
    and float64 it is ``d eps`` of the dtype (``d >= 2``).

    ``A`` is refused when ``||A - A^T||_F / ||A||_F > d eps`` (not symmetric)
    or ``lambda_min / max|lambda| <= d eps`` (indefinite, or singular to
    working precision). ``d eps ||A||`` is the backward error of a symmetric
    eigensolver, the rank tolerance of ``numpy.linalg.matrix_rank`` and the
    default cut of `polar` ([`default_polar_rtol`][fismo_core.linalg.default_polar_rtol]):
    an asymmetry or an eigenvalue within it cannot be told from rounding.
    The computed smallest eigenvalue of a singular matrix is such rounding,
    of either sign (measured up to ``5 eps lambda_max`` at ``d = 2048``),
    so every singular matrix is refused; matrices built symmetric in floating
    point stay far below the symmetry cut (``docs/linalg.md``).
    """
    xp = _check_float_matrices(A, "A", square=True)
    own = float(xp.finfo(A.dtype).eps)
    working = float(xp.finfo(xp.float32).eps) if xp.finfo(A.dtype).bits < 32 else own  # as `_exact_dtype`
    return max(A.shape[-1] * working, 2 * own)


def _cut_name(xp: Any, dtype: Any) -> str:
    """How the messages name `inverse_sqrt_tolerance` for ``dtype``."""
    return "d eps" if xp.finfo(dtype).bits >= 32 else f"max(d eps of float32, 2 eps of {_dtype_name(dtype)})"


def _check_symmetric(xp: Any, S: Array, function: str) -> None:
    """Raise `LinalgInputError` if ``||S - S^T||_F / ||S||_F > inverse_sqrt_tolerance`` for a matrix of ``S``.

    Measured in float32 at least (`_exact_dtype`): float16's sum of squares overflowed past a side of about
    200, the ratio was inf / inf = NaN, and every matrix passed (a user's hunt, 2026-12-03)."""
    exact = _exact_dtype(xp, S)
    norm = xp.linalg.matrix_norm(exact)
    asymmetry = xp.linalg.matrix_norm(exact - xp.matrix_transpose(exact)) / xp.where(norm > 0, norm, xp.ones_like(norm))
    tolerance = inverse_sqrt_tolerance(S)
    failed = asymmetry > tolerance  # an all-zero matrix passes here and is refused as singular
    if not bool(xp.any(failed)):
        return
    label, first = _first_failure(xp, failed, tuple(S.shape[:-2]), "A")
    value = float(xp.reshape(asymmetry, (-1,))[first])
    raise LinalgInputError(
        f"{function}: {label} is not symmetric: ||A - A^T||_F / ||A||_F = {value:.2g} > {_cut_name(xp, S.dtype)} = {tolerance:.2g} "
        f"({_dtype_name(S.dtype)})"
    )


def _check_positive_definite(xp: Any, A: Array, w: Array, function: str) -> None:
    """Raise `LinalgInputError` unless ``lambda_min / max|lambda| > d eps`` for the eigenvalues ``w`` ``(..., d)`` of ``A``."""
    tolerance = inverse_sqrt_tolerance(A)
    largest = xp.max(xp.abs(w), axis=-1)
    ratio = w[..., 0] / xp.where(largest > 0, largest, xp.ones_like(largest))  # w ascending; 0 for A = 0
    failed = ~(ratio > tolerance)  # NaN eigenvalues fail too
    if not bool(xp.any(failed)):
        return
    label, first = _first_failure(xp, failed, tuple(w.shape[:-1]), "A")
    value = float(xp.reshape(ratio, (-1,))[first])
    dtype = _dtype_name(A.dtype)
    largest_first = float(xp.reshape(largest, (-1,))[first])
    if largest_first == 0:
        problem = "is zero (singular)"
    elif not math.isfinite(largest_first):  # entries near the dtype's max: out of range (JAX's eigh gives NaN)
        problem = (
            f"has an eigenvalue beyond {dtype}'s range (max|A| = {float(xp.max(xp.abs(_matrix(xp, A, first)))):.3g}): "
            "scale it down: inverse_sqrt(A) = inverse_sqrt(A / c) / sqrt(c)"
        )
    elif value < -tolerance:  # beyond rounding: a negative eigenvalue
        problem = f"is not positive definite: lambda_min / max|lambda| = {value:.2g} (a negative eigenvalue, {dtype})"
    else:
        problem = (
            f"is singular to working precision: |lambda_min| / max|lambda| = {abs(value):.2g} <= "
            f"{_cut_name(xp, A.dtype)} = {tolerance:.2g} ({dtype})"
        )
    raise LinalgInputError(f"{function}: {label} {problem}")


#: The iteration dtypes ``polar(..., dtype=...)`` accepts by name, resolved in the input's namespace.
POLAR_DTYPE_NAMES: tuple[str, ...] = ("bfloat16", "float16", "float32", "float64")


def default_polar_rtol(X: Array) -> float:
    """The default relative cut of ``polar(X, method="svd")``: ``max(m, n) * eps`` of the dtype its SVD runs in.

    The rank tolerance of ``numpy.linalg.matrix_rank``: singular values at or
    below ``max(m, n) * eps * sigma_max`` of each matrix count as zero. A
    matrix of rank ``r`` that is exact up to rounding in its dtype has its
    other singular values at about ``eps * sigma_max``, below the cut. For
    float16 and bfloat16 ``X`` the SVD runs in float32 and ``eps`` is
    float32's (bfloat16's own cut whole matrices of side 128 to zero); until
    2026-12-03 this function gave the half dtype's, which ``polar`` did not use.
    """
    xp = _check_float_matrices(X, "X")
    m, n = X.shape[-2], X.shape[-1]
    return max(m, n) * float(xp.finfo(_exact_dtype(xp, X).dtype).eps)


@overload
def _check_integer(name: str, value: Any, *, minimum: int = 1, none_means: None = None) -> int: ...
@overload
def _check_integer(name: str, value: Any, *, minimum: int = 1, none_means: str) -> Optional[int]: ...
def _check_integer(name: str, value: Any, *, minimum: int = 1, none_means: Optional[str] = None) -> Optional[int]:
    """``value`` as an ``int``; a ``ValueError`` naming ``name`` unless it is an integer ``>= minimum``.

    The one check of every count and size in the package (Newton–Schulz
    ``steps``, ``InverseRootConfig.every`` and ``max_failures``,
    ``block_size``). ``bool`` is not an integer here, nor is ``2.0``.
    ``none_means`` (what ``None`` stands for) also accepts ``None``.
    """
    if value is None and none_means is not None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        kind = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        allowed = kind if none_means is None else f"None ({none_means}) or {kind}"
        raise ValueError(f"{name} must be {allowed}, got {value!r}")
    return int(value)


def _check_rtol(rtol: Any) -> Optional[float]:
    if rtol is None:
        return None
    if isinstance(rtol, bool) or not isinstance(rtol, numbers.Real):
        raise ValueError(f"rtol must be None or a real number in [0, 1), got {rtol!r}")
    value = _float_or_inf(rtol)
    if not (0.0 <= value < 1.0):  # also rejects NaN
        raise ValueError(f"rtol must be None or a real number in [0, 1), got {rtol!r}")
    return value


def _resolve_dtype(xp: Any, dtype: Any, option: str = "dtype") -> Any:
    """``dtype`` (a name in `POLAR_DTYPE_NAMES` or a real floating dtype of ``xp``) as a dtype of ``xp``.

    ``option`` names the setting in the errors (``"inverse-root matmul_dtype"``: its errors read as the
    polar's ``dtype``'s, naming neither; a user's hunt, 2026-12-04)."""
    if isinstance(dtype, str):
        if dtype not in POLAR_DTYPE_NAMES:
            raise ValueError(f"unknown iteration dtype {dtype!r}: use one of {', '.join(map(repr, POLAR_DTYPE_NAMES))} or None")
        resolved = getattr(xp, dtype, None)
        if resolved is None:
            library = getattr(xp, "__name__", str(xp)).replace("array_api_compat.", "")
            raise ValueError(
                f"{option}={dtype!r}: the array library of X ({library}) has no {dtype} dtype; "
                "use a dtype it has (NumPy and array-api-strict have no bfloat16), or run on torch or JAX"
            )
        return _refuse_truncated_by_jax(xp, resolved, dtype, option)
    try:
        ok = bool(xp.isdtype(dtype, "real floating"))
    except Exception:  # a dtype of another library, or not a dtype at all
        ok = False
    if not ok:
        raise ValueError(
            f"dtype must be None, one of {', '.join(map(repr, POLAR_DTYPE_NAMES))} or a real floating dtype "
            f"of X's array library, got {dtype!r}"
        )
    return _refuse_truncated_by_jax(xp, dtype, dtype, option)


def _refuse_truncated_by_jax(xp: Any, resolved: Any, asked: Any, option: str = "dtype") -> Any:
    """``resolved``, unless JAX would run it narrower: float64 with 64-bit types off (``jax_enable_x64``) ran
    in float32, with JAX's warning at every cast (13 per step) and no word from here (a user's hunt,
    2026-12-03)."""
    if getattr(xp, "__name__", "") != "jax.numpy":
        return resolved
    import jax

    if jax.dtypes.canonicalize_dtype(resolved) != xp.dtype(resolved):
        raise ValueError(
            f"{option}={asked!r}: JAX runs with 64-bit types off, so it would be float32; turn them on "
            "(jax.config.update('jax_enable_x64', True), or JAX_ENABLE_X64=1) or ask for 'float32'"
        )
    return resolved


def polar(
    X: Array,
    *,
    method: Literal["newton_schulz", "svd"] = "newton_schulz",
    steps: int = 5,
    coefficients: Coefficients = "muon",
    eps: float = 1e-7,
    rtol: Optional[float] = None,
    dtype: Any = None,
    check: bool = True,
) -> Array:
    """Polar factor ``Polar(X) = U_r V_r^T`` of ``X = U S V^T``, batched.

    ``U_r``, ``V_r`` are the singular vectors of the ``r`` non-zero singular
    values. For full-rank ``X`` this is the orthogonal polar factor ``U V^T``;
    for rank-deficient ``X`` it is the unique minimum-norm polar factor, a
    partial isometry (``Y Y^T Y = Y``, rank ``r``) that maps the null space
    of ``X`` to zero: every other polar factor adds an arbitrary isometry on
    the null spaces, which is what LAPACK drivers pick differently.

    Parameters
    ----------
    X:
        Real floating array of shape ``(..., m, n)``.
    method:
        ``"svd"``: exact, from the thin SVD: ``U_r @ Vh_r`` where the kept
        singular values are those above ``rtol * sigma_max`` (per matrix);
        ``X = 0`` maps to ``0``. ``"newton_schulz"``: matmul-only. ``X`` is
        divided by ``max(safety * ||X||_F, eps)`` so every singular value
        lies in ``[0, 1]``, transposed to its short side when ``m > n`` (the
        Gram matrix is then ``min(m, n)`` square), and each step applies the
        odd quintic ``X <- a X + b (X X^T) X + c (X X^T)^2 X`` to the
        singular values; a zero singular value stays zero (see
        ``docs/linalg.md`` for rank-deficient input and long schedules).
    steps:
        Newton–Schulz steps (ignored by ``"svd"``).
    coefficients:
        ``"muon"``: Keller Jordan's (3.4445, -4.7750, 2.0315) at every step,
        as in ``torch.optim.Muon``. It does not converge to ``U V^T``; it
        maps singular values quickly into a band around 1. ``"polar_express"``:
        the optimal schedule of Amsel et al. (2025), see
        :data:`POLAR_EXPRESS_COEFFICIENTS`; it converges to ``U V^T``.
        Or an explicit sequence of ``(a, b, c)`` triples (the last repeats).
    eps:
        Lower bound of the normaliser, so that ``X = 0`` maps to ``0``: a
        finite number > 0 (validated, also for ``"svd"``, which ignores it).
        ``X`` is normalised at any scale down to ``eps``: ``X`` and
        ``eps`` scaled by a power of two give the same polar factor. An
        ``eps`` below the smallest normal number of ``X``'s dtype is raised to
        it (a smaller one rounds to zero there; float16's is 6.1e-5).
    rtol:
        ``"svd"`` only (ignored by ``"newton_schulz"``, but validated): the
        relative cut. Singular values ``s <= rtol * sigma_max`` of each matrix
        are dropped. ``None`` (default): ``max(m, n) * eps`` of the dtype
        decomposed, ``X``'s (float32 for half precision, as the result is then
        the float32 one rounded; bfloat16's own eps cut whole matrices of
        side 128 to zero)
        ([`default_polar_rtol`][fismo_core.linalg.default_polar_rtol], the
        tolerance of ``numpy.linalg.matrix_rank``), which drops the
        rounding-level singular values of a matrix that is rank-deficient up
        to rounding and no others unless ``X`` is that ill conditioned. A
        real number in ``[0, 1)``; ``0`` drops exact zeros only. An ``X``
        that carries more rounding than its own (FISMO's momentum over long
        rank-deficient streams) needs a larger cut: see ``docs/linalg.md``.
    dtype:
        ``"newton_schulz"`` only: the dtype the iteration runs in. ``None``
        (default): ``X``'s. A name, ``"bfloat16"``, ``"float16"``,
        ``"float32"`` or ``"float64"``, resolved in ``X``'s array library (a
        library without it, such as NumPy for ``"bfloat16"``, is a
        ``ValueError`` naming the library), or a real floating dtype of that
        library. The normalisation runs in ``X``'s dtype, the steps in
        ``dtype``, and the result is returned in ``X``'s dtype. ``"bfloat16"``
        is how ``torch.optim.Muon`` runs its iteration. With ``"svd"`` a
        ``dtype`` other than ``None`` is a ``ValueError``: the exact path is
        the reference and computes in ``X``'s dtype (float32 for a
        half-precision ``X``, which no SVD takes; the result is rounded to
        ``X``'s dtype).
    check:
        ``True`` (default): raise [`LinalgInputError`][fismo_core.linalg.LinalgInputError]
        if a matrix of ``X`` has a NaN or an infinity, naming its batch index
        and the count of each (one host read; the library's own ``svd``
        would raise its own ``LinAlgError`` or return NaN). Rank-deficient
        ``X`` is not refused: ``"svd"`` returns the canonical ``U_r V_r^T``,
        and Newton–Schulz, an odd polynomial, keeps zero singular values at
        rounding level within its schedule (``docs/linalg.md``). Under
        ``jax.jit`` the check is left out (nothing can be read while
        tracing). ``False``: no check and no host read, for sync-free GPU
        pipelines and ``torch.compile(fullgraph=True)``.

    Accuracy
    --------
    For matrices whose normalised singular values ``s / ||X||_F`` lie in
    ``[1e-3, 1]`` (condition number up to about ``1e3 / sqrt(rank)``), the
    output's singular values land in the band below: the image under the
    scalar iteration, in exact arithmetic, of the values it actually sees,
    ``[1e-3, 1] / safety`` (``safety`` is 1.01 for ``"polar_express"``, 1 for
    ``"muon"``), rounded outward to 3 decimals. Checked on matrices by
    ``tests/test_linalg.py::test_newton_schulz_band``.

    ===================  =====  ==================
    coefficients         steps  singular values
    ===================  =====  ==================
    ``"muon"``           5      [0.470, 1.203]
    ``"muon"``           7      [0.681, 1.135]
    ``"polar_express"``  5      [0.840, 1.124]
    ``"polar_express"``  6      [0.993, 1.002]
    ``"polar_express"``  8      [1 - 4e-15, 1 + 4e-16]
    ===================  =====  ==================

    Singular values below ``1e-3 ||X||_F`` come out smaller; ``"svd"`` is exact
    to rounding.

    Examples
    --------
    >>> import array_api_strict as xp
    >>> from fismo_core.linalg import polar
    >>> X = xp.asarray([[3.0, 0.0], [4.0, 5.0]])
    >>> O = polar(X, method="svd")  # U V^T, as scipy.linalg.polar(X)[0]
    >>> bool(xp.all(xp.abs(O @ O.T - xp.eye(2)) < 1e-12))
    True

    Here ``X = O H`` with ``O = [[2, -1], [1, 2]] / sqrt(5)`` and
    ``H = [[2, 1], [1, 2]] * sqrt(5)`` symmetric positive definite:

    >>> O_exact = xp.asarray([[2.0, -1.0], [1.0, 2.0]]) / 5**0.5
    >>> bool(xp.all(xp.abs(O - O_exact) < 1e-12))
    True

    The default is Muon's five Newton–Schulz steps: singular values in the
    band ``[0.470, 1.203]``, not exactly 1.

    >>> s = xp.linalg.svdvals(polar(X))
    >>> bool(xp.all((s > 0.47) & (s < 1.203))), bool(xp.all(xp.abs(s - 1) < 1e-3))
    (True, False)

    A batch is one call; a NaN is refused, naming the matrix:

    >>> batch = xp.stack([X, xp.asarray([[1.0, float("nan")], [0.0, 1.0]])])
    >>> polar(batch, method="svd")
    Traceback (most recent call last):
    ...
    fismo_core.linalg.LinalgInputError: polar: X[1] (1 of 2 matrices of the batch fail) is not finite: 1 NaN and 0 infinite of 4 entries
    """
    xp = _check_float_matrices(X, "X")
    rtol = _check_rtol(rtol)
    checked = _check_bool("check", check)
    # Comparisons, not math.isfinite: torch.compile(dynamic=True) reads a cached core's eps as a symbolic
    # float, which comparisons guard on and math.isfinite breaks the graph at (NaN fails both).
    # An int past float's range (10**400) compares below inf and raised OverflowError at float() below.
    if (isinstance(eps, bool) or not isinstance(eps, numbers.Real) or not 0 < eps < math.inf
            or (isinstance(eps, numbers.Integral) and eps > sys.float_info.max)):
        raise ValueError(f"eps must be a finite number > 0 (the smallest norm normalised by), got {eps!r}")
    if method not in ("svd", "newton_schulz"):
        raise ValueError(f"unknown polar method {method!r}: use 'newton_schulz' or 'svd'")
    if method == "svd" and dtype is not None:
        raise ValueError(
            f"dtype={dtype!r} is the Newton–Schulz iteration dtype; method='svd' is exact and computes in "
            "X's dtype (float32 for half precision): pass dtype=None"
        )
    # The arguments are checked before any value is read; steps and coefficients for "svd" too,
    # which ignores them (as "newton_schulz" validates rtol), so that a typo never passes silently.
    schedule, safety = newton_schulz_schedule(coefficients, steps)
    if method == "newton_schulz":
        compute_dtype = X.dtype if dtype is None else _resolve_dtype(xp, dtype)
    if checked:
        _checks_can_run(xp, X, "X", "polar")
    if method == "svd":
        if _autodiff.needs_derivative(X):
            return _autodiff.rules(X).polar_by_svd(X, rtol)
        return _svd_polar_parts(X, rtol)[0]
    if X.shape[-1] == 0 or X.shape[-2] == 0:  # nothing to orthogonalise (and no max to take)
        return xp.zeros_like(X)
    transposed = X.shape[-2] > X.shape[-1]
    Y = xp.matrix_transpose(X) if transposed else X
    # ||Y||_F is taken of Y / s, s = 2^floor(log2 max(max|Y|, eps)) (_pow2_of): the sum of squares can
    # neither overflow nor, down to eps, underflow (a tiny X with a smaller eps, as guarantees.md
    # advises), and the result is bit for bit that of Y / max(safety ||Y||_F, eps) wherever that
    # norm is computed without overflow or underflow (scaling by a power of two is exact).
    # An eps below the dtype's smallest normal number rounds to zero there (or is flushed, as XLA does):
    # a zero X then gave 0 / 0. It is raised to that number, which changes nothing else.
    eps = max(float(eps), float(xp.finfo(X.dtype).smallest_normal))
    s = _pow2_of(xp.max(xp.abs(Y), axis=(-2, -1), keepdims=True), min(eps, 1.0))
    Y = Y / s
    norm = _frobenius_norm(xp, Y)
    # maximum, not clip: array-api-compat's CuPy clip indexes with a mask, a host sync.
    Y = Y / xp.maximum(safety * norm, eps / s)
    # The normalisation above runs in X's dtype (a bfloat16 norm would lose the scale);
    # the iteration in compute_dtype (a no-op cast when it is X's dtype).
    Y = xp.astype(Y, compute_dtype, copy=False)
    for a, b, c in schedule:
        gram = Y @ xp.matrix_transpose(Y)
        Y = a * Y + (b * gram + c * (gram @ gram)) @ Y
    Y = xp.astype(Y, X.dtype, copy=False)
    return xp.matrix_transpose(Y) if transposed else Y


def inverse_sqrt(
    A: Array,
    *,
    method: Literal["eigh", "newton_schulz"] = "eigh",
    steps: Optional[int] = None,
    coefficients: Coefficients = "polar_express",
    check: bool = True,
) -> Array:
    """Inverse principal square root ``A^{-1/2}`` of symmetric positive definite ``A``.

    Parameters
    ----------
    A:
        Symmetric positive definite, shape ``(..., d, d)``, real floating.
    method:
        ``"eigh"``: exact, ``V diag(w^{-1/2}) V^T`` from ``A = V diag(w) V^T``
        (computed in float32 for a half-precision ``A``, which no eigensolver
        takes, and rounded to ``A``'s dtype).
        ``"newton_schulz"``: matmul-only, the coupled Newton–Schulz iteration
        (Higham, *Functions of Matrices*, 2008, eq. 6.35) with a polynomial
        schedule. With ``c = safety^2 ||A||_F`` (at least the largest
        eigenvalue, so the spectrum of ``A / c`` lies in ``(0, 1]``),
        ``Y_0 = A / c`` and ``Z_0 = I``, each step is
        ``T = a I + b Z Y + c (Z Y)^2``, ``Y <- Y T``, ``Z <- T Z``, and the
        result is ``Z / sqrt(c)``. An eigenvalue ``x`` of ``A / c`` evolves as
        ``x <- x (a + b x + c x^2)^2``: in ``s = sqrt(x)`` that is the polar
        iteration ``s <- a s + b s^3 + c s^5`` of [`polar`][fismo_core.linalg.polar],
        so the same schedules apply. Four matrix products per step (three
        for the cubic); the first step needs two fewer (``Z_0 = I``) and the
        last one fewer (its ``Y`` is not used).
    steps:
        Newton–Schulz steps (ignored by ``"eigh"``). Default: the schedule's
        own count, 9 for ``"polar_express"``, 22 for ``"cubic"`` (both reach
        float64 precision for ``kappa'`` up to 1e6, see below), or the length
        of an explicit sequence (a single triple needs ``steps``: it would run
        once, a ``ValueError``).
    coefficients:
        ``"polar_express"`` (default): the schedule of Amsel et al. (2025),
        see [`POLAR_EXPRESS_COEFFICIENTS`][fismo_core.linalg.POLAR_EXPRESS_COEFFICIENTS],
        with its 1.01 safety factor. ``"cubic"``: the classical step
        ``T = (3 I - Z Y) / 2`` at every step. Or an explicit sequence of
        ``(a, b, c)`` triples (the last repeats). ``"muon"`` is refused: it
        does not converge, and an inverse square root has to.
    check:
        ``True`` (default): raise [`LinalgInputError`][fismo_core.linalg.LinalgInputError],
        naming the batch index of the first failing matrix and the measure,
        where the result would be wrong: a NaN or an infinity; ``A`` not
        symmetric, ``||A - A^T||_F / ||A||_F > d eps``; ``A`` not positive
        definite to working precision, ``lambda_min / max|lambda| <= d eps``
        ([`inverse_sqrt_tolerance`][fismo_core.linalg.inverse_sqrt_tolerance];
        the eigenvalues are ``"eigh"``'s own, and cost ``"newton_schulz"`` one
        ``eigvalsh``). A few host reads; under ``jax.jit`` the checks are
        left out (nothing can be read while tracing). ``False``: no check
        and no host read, for sync-free GPU pipelines and
        ``torch.compile(fullgraph=True)``; the result on bad input is then
        whatever the method computes (NaN, or a wrong finite matrix).

    Accuracy of ``"newton_schulz"``
    -------------------------------
    The step count depends on ``kappa' = ||A||_F / lambda_min``, which is at
    least the condition number, not on the size of ``A``. In exact arithmetic
    every eigenvalue reaches 1 to float64 precision after these many steps:

    ===================  ===  ===  ===  ===  ===
    kappa'               1e2  1e4  1e6  1e7  1e8
    ===================  ===  ===  ===  ===  ===
    ``"polar_express"``  9    9    9    11   12
    ``"cubic"``          11   17   22   25   28
    ===================  ===  ===  ===  ===  ===

    (The cubic: a small eigenvalue grows by 9/4 per step, then converges
    quadratically, about ``log(kappa') / log(2.25) + 6`` steps. Polar Express
    is optimal for ``kappa'`` up to 1e6, its design interval, and needs one
    step fewer, 8, for float32 precision.) Beyond the table's range the
    default count leaves the result partly converged: at ``kappa' = 1e7``
    nine Polar Express steps leave an eigenvalue of ``Z A Z`` at 0.99999,
    so pass ``steps`` from the table for such matrices. Surplus steps cost
    time, not accuracy. Errors against ``"eigh"`` measured in floating point are in
    ``docs/linalg.md`` and tested in ``tests/test_linalg.py``.

    Examples
    --------
    >>> import array_api_strict as xp
    >>> from fismo_core.linalg import inverse_sqrt
    >>> A = xp.asarray([[2.0, 1.0], [1.0, 2.0]])  # eigenvalues 1 and 3
    >>> Z = inverse_sqrt(A)  # as scipy.linalg.fractional_matrix_power(A, -0.5)
    >>> bool(xp.all(xp.abs(Z @ A @ Z - xp.eye(2)) < 1e-12))
    True
    >>> Z_ns = inverse_sqrt(A, method="newton_schulz")  # matmul-only: Polar Express, 9 steps
    >>> bool(xp.all(xp.abs(Z_ns - Z) < 1e-12))
    True

    Input on which the result would be wrong is refused, with the measure:

    >>> inverse_sqrt(xp.asarray([[2.0, 1.0], [0.0, 2.0]]))
    Traceback (most recent call last):
    ...
    fismo_core.linalg.LinalgInputError: inverse_sqrt: A is not symmetric: ||A - A^T||_F / ||A||_F = 0.47 > d eps = 4.4e-16 (float64)
    >>> inverse_sqrt(xp.stack([A, xp.asarray([[1.0, 2.0], [2.0, 1.0]])]))
    Traceback (most recent call last):
    ...
    fismo_core.linalg.LinalgInputError: inverse_sqrt: A[1] (1 of 2 matrices of the batch fail) is not positive definite: lambda_min / max|lambda| = -0.33 (a negative eigenvalue, float64)
    """
    xp = _check_float_matrices(A, "A", square=True)
    if method not in ("eigh", "newton_schulz"):
        raise ValueError(f"unknown inverse_sqrt method {method!r}: use 'eigh' or 'newton_schulz'")
    # steps and coefficients are checked for "eigh" too, which ignores them: a typo never passes silently.
    if isinstance(coefficients, Iterator):  # read twice below: the step count, then the schedule
        coefficients = tuple(coefficients)
    schedule, safety = newton_schulz_schedule(coefficients, inverse_sqrt_steps(coefficients, steps))
    # The arguments are valid; now the values. A 0 x 0 matrix has nothing to check, nor to iterate on.
    checked = _check_bool("check", check) and A.shape[-1] > 0 and _checks_can_run(xp, A, "A", "inverse_sqrt")
    if method == "newton_schulz" and A.shape[-1] == 0:
        return xp.zeros_like(A)
    if checked or method == "newton_schulz":
        exponent = _max_exponent(A)
    if checked:
        scaled = A / 2.0**exponent  # the checks hold at any scale
        _check_symmetric(xp, scaled, "inverse_sqrt")
    if method == "eigh":
        with nan_is_the_answer(xp) if checked else contextlib.nullcontext():  # an infinite eigenvalue: refused
            return _eigh_inverse_sqrt(
                A, before_root=(lambda w: _check_positive_definite(xp, A, w, "inverse_sqrt")) if checked else None
            )[0]
    if checked:  # one eigvalsh, the cost of the check on the matmul-only path
        _check_positive_definite(xp, A, xp.linalg.eigvalsh(_exact_dtype(xp, scaled)), "inverse_sqrt")
    identity = xp.eye(A.shape[-1], dtype=A.dtype, device=_device(A))
    # The iteration runs on A / 4^j, 4^j <= max|A| < 4^(j+1) per matrix: its ||.||_F can neither
    # overflow nor underflow, and the root's factor 2^j is exact (bit for bit the unscaled iteration
    # wherever ||A||_F is computed without overflow or underflow). j is at least half the exponent of
    # the smallest subnormal, rounded up (float32: 4^-74), since 4^-75 = 2^-150 rounds to zero:
    # max|A| = 2^-149 then gives A / 4^-74 in [1/2, 1), as good.
    finfo = xp.finfo(A.dtype)
    # log2 of the smallest subnormal; from the stated exponents where the finfo has them (NumPy, JAX): NumPy's
    # long double's, 2^-16445, is 0.0 as a Python float ("math domain error", a user's hunt, 2026-12-04).
    if hasattr(finfo, "minexp") and hasattr(finfo, "nmant"):
        log2_smallest = finfo.minexp - finfo.nmant
    else:
        log2_smallest = math.log2(float(finfo.smallest_normal) * float(finfo.eps))
    smallest_half_log4 = math.ceil(log2_smallest / 2)
    half_log4 = xp.maximum(xp.floor(exponent / 2), xp.full_like(exponent, smallest_half_log4))
    A = A / 4.0**half_log4
    scale = safety**2 * _frobenius_norm(xp, A)
    Y = A / scale
    Z = None  # Z_0 = I, so the first step needs neither Z Y nor T Z
    for k, (a, b, c) in enumerate(schedule):
        X = Y if Z is None else Z @ Y
        T = a * identity + b * X
        if c:
            T = T + c * (X @ X)
        if k < len(schedule) - 1:  # the last step's Y is never used
            Y = Y @ T
        Z = T if Z is None else T @ Z
    return Z / xp.sqrt(scale) / 2.0**half_log4


def _eigh_inverse_sqrt(A: Array, before_root: Optional[Callable[[Array], None]] = None) -> tuple[Array, Array]:
    """``(A^{-1/2}, w)``: ``V diag(w^{-1/2}) V^T`` in ``A``'s dtype from ``A = V diag(w) V^T``, and the
    eigenvalues ``w`` (ascending, ``(..., d)``) it was made of, for a caller that checks them.

    `inverse_sqrt`'s ``"eigh"`` method without its checks (half precision is
    decomposed in float32, and ``w`` stays float32). ``before_root(w)``, a
    check that raises, runs before the root is formed where nothing can
    differentiate (a refused ``A``'s negative ``w`` would make NaN, and
    NumPy's warning of it), else after. Where JAX or torch autograd may
    differentiate, the derivative is the root's own, which holds at
    repeated eigenvalues (`fismo_core._autodiff`), not the one through
    ``eigh``'s eigenvectors, which divides by their gaps.
    """
    if not _autodiff.needs_derivative(A):
        return _eigh_root_parts(A, before_root)[:2]
    root, w = _autodiff.rules(A).inverse_sqrt_by_eigh(A)
    if before_root is not None:
        before_root(w)
    return root, w


def _eigh_root_parts(
    A: Array, before_root: Optional[Callable[[Array], None]] = None, eigh: Optional[Callable[[Array], Any]] = None
) -> tuple[Array, Array, Array]:
    """``(A^{-1/2}, w, V)`` from ``A = V diag(w) V^T``: `_eigh_inverse_sqrt`'s values, and ``V`` for the
    derivative; ``before_root(w)`` runs between the decomposition and the root. ``eigh``: the
    decomposition, ``xp.linalg.eigh`` unless given (`fismo_core._torch_eigh` in a compiled checked step)."""
    xp = array_namespace(A)
    w, V = (eigh or xp.linalg.eigh)(_exact_dtype(xp, A))
    if before_root is not None:
        before_root(w)
    return _root_from_eigh(A, w, V), w, V


def _root_from_eigh(A: Array, w: Array, V: Array) -> Array:
    """``V diag(w^{-1/2}) V^T`` in ``A``'s dtype, from ``A``'s eigendecomposition ``(w, V)``."""
    xp = array_namespace(A)
    return xp.astype((V * (1 / xp.sqrt(w))[..., None, :]) @ xp.matrix_transpose(V), A.dtype, copy=False)


def _svd_polar_parts(
    X: Array, rtol: Optional[float]
) -> tuple[Array, Array, Array, Array, Optional[Array], Optional[Array]]:
    """``polar(X, method="svd", rtol=rtol)`` and what it was made of, for its derivative: ``(Q, U, S, Vh,
    keep, s)``, ``Q = U diag(keep) Vh`` in ``X``'s dtype from the thin SVD of ``X / s / s`` (``s`` a power
    of two where ``X``'s entries would overflow the SVD, else 1; ``None`` for an empty ``X``), ``keep`` 1
    for a kept singular value and 0 for a cut one (``None`` where there is none)."""
    xp = array_namespace(X)
    X_exact = _exact_dtype(xp, X)
    s = None
    if X.shape[-1] and X.shape[-2]:
        # Entries past sqrt of the dtype's max may make s_max infinite, and the cut then dropped every
        # singular value (a zero result). Such X are decomposed divided by a power of two s^2 (exact, and
        # polar(X / s^2) = polar(X)); every other X as it is, bit for bit. Twice by s, not once by s^2:
        # XLA divides by multiplying with the reciprocal, and 2^-1023 is subnormal (flushed to zero).
        amax = xp.max(xp.abs(X_exact), axis=(-2, -1), keepdims=True)
        huge = amax >= math.sqrt(float(xp.finfo(X_exact.dtype).max))
        s = xp.where(huge, _pow2_of(xp.sqrt(amax)), xp.ones_like(amax))
        X_exact = X_exact / s / s
    U, S, Vh = xp.linalg.svd(X_exact, full_matrices=False)
    if S.shape[-1] == 0:  # m or n is 0: nothing to cut
        return xp.astype(U @ Vh, X.dtype, copy=False), U, S, Vh, None, s
    # The default cut is that of the dtype decomposed (float32 for half precision, whose own eps
    # cut a bfloat16 matrix of side 128 to zero).
    cut = (default_polar_rtol(X_exact) if rtol is None else rtol) * xp.max(S, axis=-1, keepdims=True)
    keep = xp.astype(S > cut, U.dtype)  # 1 for s > rtol * s_max, else 0: U * 1 is U bit for bit
    return xp.astype((U * keep[..., None, :]) @ Vh, X.dtype, copy=False), U, S, Vh, keep, s


def inverse_sqrt_steps(coefficients: Coefficients, steps: Optional[int] = None) -> int:
    """The Newton–Schulz step count ``inverse_sqrt`` uses: ``steps``, or the schedule's default.

    Raises ``ValueError`` for ``"muon"`` (not convergent) and for malformed
    coefficients or steps.
    """
    if isinstance(coefficients, Iterator):  # read twice below: validated, then counted
        coefficients = tuple(coefficients)
    if isinstance(coefficients, str) and coefficients == "muon":
        raise ValueError(
            "coefficients='muon' does not converge (p(1) = 0.70), and an inverse square root must: "
            "use 'polar_express', 'cubic' or explicit (a, b, c) triples"
        )
    if steps is None:
        newton_schulz_schedule(coefficients, 1)  # an unknown name or a malformed sequence is an error here
        if isinstance(coefficients, str):
            return INVERSE_SQRT_STEPS[coefficients]
        if len(tuple(coefficients)) == 1:
            # CUBIC_COEFFICIENTS given for "cubic" ran once, 93 % off with check=True (a user's hunt, 2026-12-04).
            raise ValueError(
                f"coefficients={tuple(coefficients)!r} is one (a, b, c) triple and steps=None would run it once; an "
                "inverse square root needs many steps: pass steps= (the triple repeats), or the name 'cubic' (22 steps)"
            )
        return len(tuple(coefficients))
    newton_schulz_schedule(coefficients, steps)  # validates both
    return steps
