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
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import Any, Literal, Optional, Union

from array_api_compat import array_namespace, device

__all__ = [
    "CUBIC_COEFFICIENTS",
    "MUON_COEFFICIENTS",
    "POLAR_DTYPE_NAMES",
    "POLAR_EXPRESS_COEFFICIENTS",
    "default_polar_rtol",
    "inverse_sqrt",
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
    """Symmetric part ``sym(X) = (X + X^T) / 2`` of square matrices ``(..., d, d)``."""
    xp = array_namespace(X)
    return (X + xp.matrix_transpose(X)) / 2


def trace_normalize(A: Array) -> Array:
    """Rescale square matrices ``(..., d, d)`` to trace ``d``: ``(d / tr A) A``.

    This is the normalisation of Algorithm 1 (``P_t = sym(m / tr(P~_t) P~_t)``);
    it removes the scale ambiguity ``(P, Q) ~ (cP, Q/c)`` of the Kronecker metric.
    """
    xp = array_namespace(A)
    d = A.shape[-1]
    return (d / xp.linalg.trace(A))[..., None, None] * A


def whiten(X: Array, left: Array, right: Array) -> Array:
    """Two-sided product ``left @ X @ right`` on stacks of matrices.

    With ``left = P^{-1/2}`` and ``right = Q^{-1/2}`` this is the whitening of
    Algorithm 1 line 6 (``G~ = P^{-1/2} G Q^{-1/2}``) and the un-whitening of
    line 8 (``P^{-1/2} Polar(M) Q^{-1/2}``). The association is fixed as
    ``(left @ X) @ right`` so every backend rounds the same way. All three
    must come from one array library and live on one device.
    """
    for array, name in ((X, "X"), (left, "left"), (right, "right")):
        _check_float_matrices(array, name)
    _check_same_namespace_and_device(X, left, right)
    return (left @ X) @ right


def newton_schulz_schedule(
    coefficients: Coefficients, steps: int
) -> tuple[tuple[tuple[float, float, float], ...], float]:
    """The ``steps`` (a, b, c) triples a schedule uses, and its norm safety factor.

    A schedule shorter than ``steps`` repeats its last triple (Muon's single
    triple at every step; Polar Express past its eighth step).
    """
    if isinstance(steps, bool) or not isinstance(steps, numbers.Integral) or steps < 1:
        raise ValueError(f"steps must be a positive integer, got {steps!r}")
    if isinstance(coefficients, str):
        if coefficients not in _NAMED_SCHEDULES:
            raise ValueError(
                f"unknown Newton–Schulz coefficients {coefficients!r}: use 'muon', "
                "'polar_express', 'cubic' or a sequence of (a, b, c) triples"
            )
        triples = _NAMED_SCHEDULES[coefficients]
        safety = _NORMALIZATION_SAFETY[coefficients]
    else:
        triples = tuple(tuple(float(v) for v in t) for t in coefficients)
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


def _pow2_scale(X: Array) -> Array:
    """Per matrix, the power of two ``s = 2^floor(log2 max|X|)`` if ``max|X| >= 2``, else ``1``; shape ``(..., 1, 1)``.

    Dividing by ``s`` (and multiplying back) is exact in binary floating point,
    barring underflow to subnormals, so a computation on ``X / s`` rescaled
    afterwards rounds exactly as the computation on ``X`` wherever the latter
    does not overflow; ``X / s`` has entries below 2, so its squares cannot.
    Elementwise operations and one reduction: no host synchronisation.
    """
    xp = array_namespace(X)
    amax = xp.max(xp.abs(X), axis=(-2, -1), keepdims=True)
    return 2.0 ** xp.floor(xp.log2(xp.maximum(amax, 1.0)))


def _check_same_namespace_and_device(*arrays: Array) -> Any:
    """The common namespace of ``arrays``; a clear error if they mix libraries or devices."""
    try:
        xp = array_namespace(*arrays)
    except TypeError as exc:
        raise TypeError(f"all arrays of one call must come from one array library: {exc}") from exc
    devices = {str(device(a)) for a in arrays}
    if len(devices) > 1:
        raise ValueError(f"all arrays of one call must live on one device, got {sorted(devices)}")
    return xp


def _check_float_matrices(X: Array, name: str, *, square: bool = False) -> Any:
    xp = array_namespace(X)
    if X.ndim < 2:
        raise ValueError(f"{name} must have shape (..., m, n) with at least 2 dimensions, got shape {tuple(X.shape)}")
    if square and X.shape[-1] != X.shape[-2]:
        raise ValueError(f"{name} must be square in its last two dimensions, got shape {tuple(X.shape)}")
    if not xp.isdtype(X.dtype, "real floating"):
        raise TypeError(f"{name} must have a real floating dtype, got {X.dtype}")
    return xp


#: The iteration dtypes ``polar(..., dtype=...)`` accepts by name, resolved in the input's namespace.
POLAR_DTYPE_NAMES: tuple[str, ...] = ("bfloat16", "float16", "float32", "float64")


def default_polar_rtol(X: Array) -> float:
    """The default relative cut of ``polar(X, method="svd")``: ``max(m, n) * eps`` of ``X``'s dtype.

    The rank tolerance of ``numpy.linalg.matrix_rank``: singular values at or
    below ``max(m, n) * eps * sigma_max`` of each matrix count as zero. A
    matrix of rank ``r`` that is exact up to rounding in its dtype has its
    other singular values at about ``eps * sigma_max``, below the cut.
    """
    xp = _check_float_matrices(X, "X")
    m, n = X.shape[-2], X.shape[-1]
    return max(m, n) * float(xp.finfo(X.dtype).eps)


def _check_rtol(rtol: Any) -> Optional[float]:
    if rtol is None:
        return None
    if isinstance(rtol, bool) or not isinstance(rtol, numbers.Real):
        raise ValueError(f"rtol must be None or a real number in [0, 1), got {rtol!r}")
    value = float(rtol)
    if not (0.0 <= value < 1.0):  # also rejects NaN
        raise ValueError(f"rtol must be None or a real number in [0, 1), got {rtol!r}")
    return value


def _resolve_dtype(xp: Any, dtype: Any) -> Any:
    """``dtype`` (a name in `POLAR_DTYPE_NAMES` or a real floating dtype of ``xp``) as a dtype of ``xp``."""
    if isinstance(dtype, str):
        if dtype not in POLAR_DTYPE_NAMES:
            raise ValueError(f"unknown iteration dtype {dtype!r}: use one of {', '.join(map(repr, POLAR_DTYPE_NAMES))} or None")
        resolved = getattr(xp, dtype, None)
        if resolved is None:
            library = getattr(xp, "__name__", str(xp)).replace("array_api_compat.", "")
            raise ValueError(
                f"dtype={dtype!r}: the array library of X ({library}) has no {dtype} dtype; "
                "use a dtype it has (NumPy and array-api-strict have no bfloat16), or run on torch or JAX"
            )
        return resolved
    try:
        ok = bool(xp.isdtype(dtype, "real floating"))
    except Exception:  # a dtype of another library, or not a dtype at all
        ok = False
    if not ok:
        raise ValueError(
            f"dtype must be None, one of {', '.join(map(repr, POLAR_DTYPE_NAMES))} or a real floating dtype "
            f"of X's array library, got {dtype!r}"
        )
    return dtype


def polar(
    X: Array,
    *,
    method: Literal["newton_schulz", "svd"] = "newton_schulz",
    steps: int = 5,
    coefficients: Coefficients = "muon",
    eps: float = 1e-7,
    rtol: Optional[float] = None,
    dtype: Any = None,
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
        Lower bound of the normaliser, so that ``X = 0`` maps to ``0``.
    rtol:
        ``"svd"`` only (ignored by ``"newton_schulz"``, but validated): the
        relative cut. Singular values ``s <= rtol * sigma_max`` of each matrix
        are dropped. ``None`` (default): ``max(m, n) * eps`` of ``X``'s dtype
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
        the reference and computes in ``X``'s dtype.

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
    """
    xp = _check_float_matrices(X, "X")
    rtol = _check_rtol(rtol)
    if method == "svd":
        if dtype is not None:
            raise ValueError(
                f"dtype={dtype!r} is the Newton–Schulz iteration dtype; method='svd' is exact and computes in "
                "X's dtype: pass dtype=None"
            )
        U, S, Vh = xp.linalg.svd(X, full_matrices=False)
        if S.shape[-1] == 0:  # m or n is 0: nothing to cut
            return U @ Vh
        cut = (default_polar_rtol(X) if rtol is None else rtol) * xp.max(S, axis=-1, keepdims=True)
        keep = xp.astype(S > cut, U.dtype)  # 1 for s > rtol * s_max, else 0: U * 1 is U bit for bit
        return (U * keep[..., None, :]) @ Vh
    if method != "newton_schulz":
        raise ValueError(f"unknown polar method {method!r}: use 'newton_schulz' or 'svd'")
    schedule, safety = newton_schulz_schedule(coefficients, steps)
    compute_dtype = X.dtype if dtype is None else _resolve_dtype(xp, dtype)
    transposed = X.shape[-2] > X.shape[-1]
    Y = xp.matrix_transpose(X) if transposed else X
    # ||Y||_F is taken of Y / s, s a power of two (_pow2_scale): the sum of squares cannot
    # overflow, and where ||Y||_F does not overflow the result is bit for bit that of
    # Y / max(safety ||Y||_F, eps) (scaling by a power of two is exact).
    s = _pow2_scale(Y)
    Y = Y / s
    norm = xp.linalg.matrix_norm(Y, keepdims=True)
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
) -> Array:
    """Inverse principal square root ``A^{-1/2}`` of symmetric positive definite ``A``.

    Parameters
    ----------
    A:
        Symmetric positive definite, shape ``(..., d, d)``, real floating.
    method:
        ``"eigh"``: exact, ``V diag(w^{-1/2}) V^T`` from ``A = V diag(w) V^T``.
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
        of an explicit sequence.
    coefficients:
        ``"polar_express"`` (default): the schedule of Amsel et al. (2025),
        see [`POLAR_EXPRESS_COEFFICIENTS`][fismo_core.linalg.POLAR_EXPRESS_COEFFICIENTS],
        with its 1.01 safety factor. ``"cubic"``: the classical step
        ``T = (3 I - Z Y) / 2`` at every step. Or an explicit sequence of
        ``(a, b, c)`` triples (the last repeats). ``"muon"`` is refused: it
        does not converge, and an inverse square root has to.

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
    """
    xp = _check_float_matrices(A, "A", square=True)
    if method == "eigh":
        w, V = xp.linalg.eigh(A)
        return (V * (1 / xp.sqrt(w))[..., None, :]) @ xp.matrix_transpose(V)
    if method != "newton_schulz":
        raise ValueError(f"unknown inverse_sqrt method {method!r}: use 'eigh' or 'newton_schulz'")
    schedule, safety = newton_schulz_schedule(coefficients, inverse_sqrt_steps(coefficients, steps))
    identity = xp.eye(A.shape[-1], dtype=A.dtype, device=device(A))
    scale = safety**2 * xp.linalg.matrix_norm(A, keepdims=True)
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
    return Z / xp.sqrt(scale)


def inverse_sqrt_steps(coefficients: Coefficients, steps: Optional[int] = None) -> int:
    """The Newton–Schulz step count ``inverse_sqrt`` uses: ``steps``, or the schedule's default.

    Raises ``ValueError`` for ``"muon"`` (not convergent) and for malformed
    coefficients or steps.
    """
    if isinstance(coefficients, str) and coefficients == "muon":
        raise ValueError(
            "coefficients='muon' does not converge (p(1) = 0.70), and an inverse square root must: "
            "use 'polar_express', 'cubic' or explicit (a, b, c) triples"
        )
    if steps is None:
        newton_schulz_schedule(coefficients, 1)  # an unknown name or a malformed sequence is an error here
        return INVERSE_SQRT_STEPS[coefficients] if isinstance(coefficients, str) else len(tuple(coefficients))
    newton_schulz_schedule(coefficients, steps)  # validates both
    return steps
