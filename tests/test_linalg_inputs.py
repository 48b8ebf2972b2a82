"""Input checks of :mod:`fismo_core.linalg` and its SciPy equivalents (docs/linalg.md).

* ``polar`` and ``inverse_sqrt`` refuse, with ``LinalgInputError``, input on
  which they would be wrong: non-finite (both), not symmetric, indefinite or
  singular to working precision (``inverse_sqrt``); the message names the
  measure, its value and the batch index. ``check=False`` turns the checks off
  and changes no result; under ``jax.jit`` they are left out; the optimizer
  never runs them.
* Each SciPy equivalence in the table that opens docs/linalg.md holds, on
  every CPU backend, with a tolerance in units of the dtype's ``eps``.

References are computed here from the matrices' construction, SciPy or NumPy
float64, never from the code under test.
"""

from __future__ import annotations

import math
import re
import warnings
from pathlib import Path

import numpy as np
import pytest
import scipy.linalg

from fismo_core import FISMO, InverseRootConfig, PolarConfig
from fismo_core import linalg
from fismo_core.linalg import (
    LinalgInputError,
    inverse_sqrt,
    inverse_sqrt_tolerance,
    newton_schulz_schedule,
    polar,
    whiten,
)
from fismo_core.testing import Target, max_relative_error, to_numpy

#: A refusal comes with the library's message alone: NumPy's RuntimeWarnings of a NaN, an infinity or an overflow
#: (inverse_sqrt took the root of a singular A before refusing it, "invalid value encountered in sqrt") are errors.
pytestmark = [pytest.mark.filterwarnings(f"error:{what}:RuntimeWarning")
              for what in ("invalid value encountered", "divide by zero encountered", "overflow encountered")]

ROOT = Path(__file__).resolve().parents[1]
EPS = {"float64": float(np.finfo(np.float64).eps), "float32": float(np.finfo(np.float32).eps)}
METHODS = {"polar": ("svd", "newton_schulz"), "inverse_sqrt": ("eigh", "newton_schulz")}


def haar(rng: np.random.Generator, n: int) -> np.ndarray:
    """A Haar-distributed n x n orthogonal matrix."""
    q, r = np.linalg.qr(rng.standard_normal((n, n)))
    return q * np.sign(np.diag(r))


def spd(rng: np.random.Generator, w: np.ndarray) -> np.ndarray:
    """V diag(w) V^T, symmetrised (exactly symmetric in float64 and after rounding to float32)."""
    V = haar(rng, len(w))
    A = (V * w) @ V.T
    return (A + A.T) / 2


def refusal(function, *args, **kwargs) -> str:
    with pytest.raises(LinalgInputError) as info:
        function(*args, **kwargs)
    return str(info.value)


def reported(message: str, measure: str) -> float:
    """The value the message reports for ``measure`` (``measure = value``)."""
    match = re.search(re.escape(measure) + r" = (\S+?)[ ,)]", message)
    assert match, f"{measure!r} not in {message!r}"
    return float(match.group(1))


def two_digits(x: float) -> float:
    """``x`` as the messages print it (two significant digits)."""
    return float(f"{x:.2g}")


# --- Refusals ------------------------------------------------------------------------------------


@pytest.mark.parametrize("method", METHODS["inverse_sqrt"])
def test_inverse_sqrt_refuses_a_non_symmetric_matrix(target: Target, method: str) -> None:
    """Without the check, eigh returns a finite root that does not whiten A."""
    A_np = np.array([[2.0, 1.0], [0.0, 2.0]])
    message = refusal(inverse_sqrt, target.asarray(A_np), method=method)
    assert message.startswith("inverse_sqrt: A is not symmetric: ||A - A^T||_F / ||A||_F = ")
    assert reported(message, "||A - A^T||_F / ||A||_F") == two_digits(math.sqrt(2) / 3)  # 0.47
    assert reported(message, "d eps") == two_digits(2 * EPS[target.dtype])
    assert f"({target.dtype})" in message
    if method == "eigh":  # what the check prevents: a finite, wrong answer
        Z = to_numpy(inverse_sqrt(target.asarray(A_np), method=method, check=False))
        # measured 0.50 (NumPy, torch: eigh reads one triangle), 0.37 (JAX: its symmetric part)
        assert np.linalg.norm(Z @ A_np @ Z - np.eye(2)) > 0.3


@pytest.mark.parametrize("method", METHODS["inverse_sqrt"])
def test_symmetry_threshold_is_d_eps(target: Target, method: str) -> None:
    """I (8 x 8) with A[0, 1] = t: ||A - A^T||_F / ||A||_F = t / 2 (to rounding); the cut is 8 eps.

    t is a power of two, exact in both dtypes: 2x above the cut is refused, 8x below accepted.
    """
    d, eps = 8, EPS[target.dtype]
    assert inverse_sqrt_tolerance(target.asarray(np.eye(d))) == d * eps
    for t, refused in ((4 * d * eps, True), (d * eps / 4, False)):
        A_np = np.eye(d)
        A_np[0, 1] = t
        assert np.linalg.norm(A_np - A_np.T) / np.linalg.norm(A_np) == pytest.approx(t / 2, rel=1e-6)
        A = target.asarray(A_np)
        if refused:
            message = refusal(inverse_sqrt, A, method=method)
            assert reported(message, "||A - A^T||_F / ||A||_F") == two_digits(t / 2)
        else:
            inverse_sqrt(A, method=method)


@pytest.mark.numbers
def test_symmetric_constructions_pass(target: Target) -> None:
    """Matrices built symmetric in the backend's own arithmetic, unsymmetrised, are far below d eps.

    (V * w) @ V^T and G @ G^T, d = 2 to 256: measured at most 0.1 d eps on every CPU backend
    (docs/linalg.md, "Input checks"); 0.3 d eps here. Each is accepted by inverse_sqrt.
    """
    xp, eps = target.xp, EPS[target.dtype]
    rng = np.random.default_rng(0)
    for d in (2, 4, 16, 64, 256):
        V, w = target.asarray(haar(rng, d)), target.asarray(np.geomspace(1.0, 1e-3, d))
        G = target.asarray(rng.standard_normal((d, 3 * d + 5)))
        for name, A in (("(V * w) @ V.T", (V * w) @ xp.matrix_transpose(V)), ("G @ G.T", G @ xp.matrix_transpose(G))):
            A_np = to_numpy(A)
            asymmetry = np.linalg.norm(A_np - A_np.T) / np.linalg.norm(A_np)
            assert asymmetry <= 0.3 * d * eps, (name, d, asymmetry / (d * eps))
            inverse_sqrt(A)


@pytest.mark.parametrize("method", METHODS["inverse_sqrt"])
def test_inverse_sqrt_refuses_an_indefinite_matrix(target: Target, method: str) -> None:
    """[[1, 2], [2, 1]] has eigenvalues -1 and 3; -I has -1 only."""
    message = refusal(inverse_sqrt, target.asarray(np.array([[1.0, 2.0], [2.0, 1.0]])), method=method)
    assert message.startswith("inverse_sqrt: A is not positive definite: lambda_min / max|lambda| = ")
    assert reported(message, "lambda_min / max|lambda|") == two_digits(-1 / 3)
    message = refusal(inverse_sqrt, target.asarray(-np.eye(3)), method=method)
    assert reported(message, "lambda_min / max|lambda|") == -1.0


@pytest.mark.parametrize("method", METHODS["inverse_sqrt"])
def test_inverse_sqrt_refuses_a_singular_matrix(target: Target, method: str) -> None:
    """[[1, 1], [1, 1]], a rank-3 Gram matrix G G^T (8 x 8) and zero: no answer is right."""
    eps = EPS[target.dtype]
    message = refusal(inverse_sqrt, target.asarray(np.ones((2, 2))), method=method)
    assert "A is singular to working precision: |lambda_min| / max|lambda| = " in message
    assert reported(message, "|lambda_min| / max|lambda|") <= 2 * eps
    assert reported(message, "d eps") == two_digits(2 * eps)
    # The computed lambda_min of a singular matrix is rounding of either sign, inside d eps
    # (test_singular_gram_matrices_are_refused_as_singular).
    G = np.random.default_rng(1).standard_normal((8, 3))
    message = refusal(inverse_sqrt, target.asarray(G @ G.T), method=method)
    assert "A is singular to working precision" in message
    assert refusal(inverse_sqrt, target.asarray(np.zeros((3, 3))), method=method) == "inverse_sqrt: A is zero (singular)"


@pytest.mark.numbers
def test_singular_gram_matrices_are_refused_as_singular(target: Target) -> None:
    """G G^T of rank 1, 2, d/2 and d - 1, d = 4 to 256, computed in the backend: the computed
    |lambda_min| / max|lambda| is rounding, measured at most 2.5 eps (docs/linalg.md, "Input
    checks"; 5 eps at d = 2048), far inside d eps: each is refused as singular."""
    xp, eps = target.xp, EPS[target.dtype]
    rng = np.random.default_rng(10)
    for d in (4, 8, 64, 256):
        for r in sorted({1, 2, d // 2, d - 1}):
            G = target.asarray(rng.standard_normal((d, r)) * rng.uniform(0.1, 10.0, r))
            message = refusal(inverse_sqrt, G @ xp.matrix_transpose(G))
            assert "A is singular to working precision" in message, (d, r, message)
            assert reported(message, "|lambda_min| / max|lambda|") <= 5 * eps, (d, r, message)


@pytest.mark.parametrize("method", METHODS["inverse_sqrt"])
def test_definiteness_threshold_is_d_eps(target: Target, method: str) -> None:
    """diag(1, r), d = 2: accepted for r = 32 eps; refused as singular for r = +-eps / 8; -32 eps is
    a negative eigenvalue (diagonal: the eigenvalues are computed exactly)."""
    eps = EPS[target.dtype]
    inverse_sqrt(target.asarray(np.diag([1.0, 32 * eps])), method=method)
    for r in (eps / 8, -eps / 8):
        message = refusal(inverse_sqrt, target.asarray(np.diag([1.0, r])), method=method)
        assert "singular to working precision" in message
        assert reported(message, "|lambda_min| / max|lambda|") == two_digits(eps / 8)
    message = refusal(inverse_sqrt, target.asarray(np.diag([1.0, -32 * eps])), method=method)
    assert reported(message, "lambda_min / max|lambda|") == two_digits(-32 * eps)


@pytest.mark.numbers
@pytest.mark.parametrize("method", METHODS["inverse_sqrt"])
def test_float32_limit(target: Target, method: str) -> None:
    """16 x 16, kappa = 1e4, 1e6, 1e8: the cut d eps is 1.9e-6 in float32 (kappa = 1e4 passes,
    1e6, which keeps about two digits, and 1e8, whose small eigenvalues are lost in rounding A,
    are refused) and 3.6e-15 in float64 (all pass)."""
    rng = np.random.default_rng(2)
    for kappa in (1e4, 1e6, 1e8):
        A = target.asarray(np.stack([spd(rng, np.geomspace(1.0, 1 / kappa, 16)) for _ in range(4)]))
        if target.dtype == "float32" and kappa > 1e4:
            assert "singular to working precision" in refusal(inverse_sqrt, A, method=method)
        else:
            inverse_sqrt(A, method=method)


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("function,method", [(f, m) for f in METHODS for m in METHODS[f]])
def test_non_finite_input_is_refused(target: Target, function: str, method: str, value: float) -> None:
    X = np.eye(2)
    X[1, 0] = value
    message = refusal(getattr(linalg, function), target.asarray(X), method=method)
    name = "X" if function == "polar" else "A"
    nan, inf = (1, 0) if math.isnan(value) else (0, 1)
    assert message == f"{function}: {name} is not finite: {nan} NaN and {inf} infinite of 4 entries"


def test_a_nan_outside_the_triangle_eigh_reads_is_caught() -> None:
    """docs/linalg.md: NumPy's eigh reads the lower triangle, so a NaN above it gives the identity."""
    A = np.array([[1.0, math.nan], [0.0, 1.0]])
    assert np.array_equal(inverse_sqrt(A, check=False), np.eye(2))  # silently wrong without the check
    assert "not finite: 1 NaN" in refusal(inverse_sqrt, A)


@pytest.mark.parametrize("method", METHODS["polar"])
def test_polar_names_the_batch_index(target: Target, method: str) -> None:
    X = np.random.default_rng(3).standard_normal((2, 3, 4, 5))
    X[1, 2, 0, 0] = math.nan
    X[1, 0, 3, 4] = math.inf
    message = refusal(polar, target.asarray(X), method=method)
    assert message == "polar: X[1, 0] (2 of 6 matrices of the batch fail) is not finite: 0 NaN and 1 infinite of 20 entries"


@pytest.mark.parametrize("method", METHODS["inverse_sqrt"])
def test_inverse_sqrt_names_the_batch_index(target: Target, method: str) -> None:
    """Checks run in order (finite, symmetric, definite), each over the whole batch."""
    rng = np.random.default_rng(4)
    A = np.stack([spd(rng, np.geomspace(1.0, 0.1, 4)) for _ in range(6)]).reshape(2, 3, 4, 4)
    A[1, 1] = np.diag([1.0, 1.0, 1.0, -0.5])
    A[0, 2, 0, 3] += 0.25
    message = refusal(inverse_sqrt, target.asarray(A), method=method)
    assert message.startswith("inverse_sqrt: A[0, 2] (1 of 6 matrices of the batch fail) is not symmetric: ")
    A[0, 2, 0, 3] -= 0.25
    message = refusal(inverse_sqrt, target.asarray(A), method=method)
    assert message.startswith("inverse_sqrt: A[1, 1] (1 of 6 matrices of the batch fail) is not positive definite: ")
    assert reported(message, "lambda_min / max|lambda|") == -0.5


def test_checks_hold_at_any_scale() -> None:
    """||A||_F of 2^600 A overflows and of 2^-600 A underflows; the checks run on A / 2^k."""
    rng = np.random.default_rng(5)
    S = spd(rng, np.geomspace(1.0, 1e-2, 5))
    bad = np.array([[2.0, 1.0], [0.0, 2.0]])
    for scale in (2.0**600, 2.0**-600):
        Z = inverse_sqrt(scale * S)
        np.testing.assert_allclose(Z * math.sqrt(scale), inverse_sqrt(S), rtol=0, atol=1e-12 * np.abs(Z).max() * math.sqrt(scale))
        for method in METHODS["inverse_sqrt"]:
            message = refusal(inverse_sqrt, scale * bad, method=method)
            assert reported(message, "||A - A^T||_F / ||A||_F") == two_digits(math.sqrt(2) / 3)


def test_newton_schulz_root_at_the_ends_of_the_dtype(target: Target) -> None:
    """The iteration runs on A / 4^j; for max|A| the smallest subnormal (float32 2^-149), 4^j = 2^-150
    rounded to zero and the root was NaN with no error. Now c I gives c^(-1/2) I from the smallest
    subnormal to the largest value (twice the iteration's float32 / float64 accuracy on
    the identity, measured 0 and 1 ulp). At the other end, before the scales' cap at 2^1022 (float32 2^126), c at
    the largest value failed on every backend (log2 rounded up to 1024: an infinite scale), and on JAX a c in the
    top binade (float64 from 2^1023) was refused as zero (XLA flushed the subnormal reciprocal of 2^1023)."""
    finfo = np.finfo(target.dtype)
    smallest = float(finfo.smallest_normal) * float(finfo.eps)
    for c in (smallest, 2 * smallest, float(finfo.smallest_normal), float(finfo.max) / 4, float(finfo.max)):
        A = target.asarray(np.eye(3, dtype=target.dtype) * np.asarray(c, dtype=target.dtype))
        if c < float(finfo.smallest_normal) and to_numpy(A * 1)[0, 0] == 0:
            # XLA on CPU flushes subnormal results to zero: the check sees a zero matrix and says so
            with pytest.raises(LinalgInputError, match=r"inverse_sqrt: A is zero \(singular\)"):
                inverse_sqrt(A, method="newton_schulz")
            continue
        Z = to_numpy(inverse_sqrt(A, method="newton_schulz"))
        np.testing.assert_allclose(np.diag(Z), np.full(3, 1 / math.sqrt(c)), rtol=4 * float(finfo.eps))
        assert np.count_nonzero(Z - np.diag(np.diag(Z))) == 0


def test_polar_svd_of_a_matrix_whose_norm_overflows(target: Target) -> None:
    """Entries near the dtype's max: s_max was infinite, the cut rtol * s_max dropped every singular value
    and ``method="svd"`` returned zeros. Decomposed as X / 2^k it gives polar(X); an X below sqrt(max) is
    decomposed as it is, bit for bit (the check of the SVD's input makes no other change)."""
    finfo = np.finfo(target.dtype)
    base = np.array([[1.0, 0.6], [0.6, 1.0]])  # SPD, kappa = 4: its polar factor is the identity
    huge = target.asarray((base * (float(finfo.max) / 1.5)).astype(target.dtype))
    # The identity to the accuracy of a 2 x 2 SVD (a few eps; 8 eps leaves room for float32's LAPACK).
    np.testing.assert_allclose(to_numpy(polar(huge, method="svd")), np.eye(2), atol=8 * float(finfo.eps))
    X = target.asarray(np.random.default_rng(12).standard_normal((3, 5)).astype(target.dtype) * 1e3)
    xp = target.xp
    U, _, Vh = xp.linalg.svd(X, full_matrices=False)
    assert np.array_equal(to_numpy(polar(X, method="svd")), to_numpy(U @ Vh))


def test_inverse_sqrt_eigh_names_an_eigenvalue_beyond_the_range() -> None:
    """eigh of an SPD matrix of entries near float64's max has an infinite eigenvalue; the check refused it
    as "singular to working precision" (its kappa is 4) and now says what happened and what to do. JAX's
    eigh gives NaN eigenvalues there, not infinite ones: it was still "singular ... = nan" until
    2026-12-03 (a user's hunt)."""
    base = np.array([[1.0, 0.6], [0.6, 1.0]])
    A = base * 1.2e308
    message = refusal(inverse_sqrt, A)
    assert "has an eigenvalue beyond float64's range (max|A| = 1.2e+308)" in message, message
    for library in ("torch", "jax.numpy"):
        module = pytest.importorskip(library)
        if library == "jax.numpy":
            pytest.importorskip("jax").config.update("jax_enable_x64", True)
        assert "has an eigenvalue beyond float64's range" in refusal(inverse_sqrt, module.asarray(A)), library
    assert "inverse_sqrt(A) = inverse_sqrt(A / c) / sqrt(c)" in message
    # What the message says to do gives the root, base^(-1/2) / sqrt(1.2e308), to float64's rounding.
    np.testing.assert_allclose(inverse_sqrt(A / 1e300) / math.sqrt(1e300), inverse_sqrt(base) / math.sqrt(1.2e308),
                               rtol=1e-14)


def test_a_float32_eigenvalue_beyond_the_range_is_refused_without_numpys_warning() -> None:
    """NumPy decomposes a float32 ``A`` in float64 and casts the eigenvalues back: one beyond float32's range
    printed NumPy's "overflow encountered in cast" RuntimeWarning before the refusal (a user's hunt,
    2026-12-03). The refusal is the only word now."""
    A = (np.full((4, 4), 2e38) + np.eye(4) * 1e38).astype(np.float32)  # finite; largest eigenvalue 9e38
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        message = refusal(inverse_sqrt, A)
    assert "has an eigenvalue beyond float32's range" in message, message


@pytest.mark.parametrize("shape", [(0, 0), (2, 0, 0)], ids=str)
def test_inverse_sqrt_newton_schulz_of_empty_matrices(target: Target, shape: tuple[int, ...]) -> None:
    """A 0 x 0 matrix crashed the Newton-Schulz method (a max over no entries); it is empty, as with eigh."""
    A = target.asarray(np.zeros(shape, dtype=target.dtype))
    for check in (True, False):
        assert tuple(inverse_sqrt(A, method="newton_schulz", check=check).shape) == shape


def test_coefficients_given_as_an_iterator() -> None:
    """inverse_sqrt read its coefficients twice (the step count, then the schedule): an iterator was empty
    the second time and the error blamed ``steps``, which was not given."""
    schedule = [(1.5, -0.5, 0.0)] * 12
    A = np.diag([2.0, 0.5, 1.0])
    expected = inverse_sqrt(A, method="newton_schulz", coefficients=schedule)
    assert np.array_equal(inverse_sqrt(A, method="newton_schulz", coefficients=iter(schedule)), expected)


def test_newton_schulz_polar_takes_numpy_long_double() -> None:
    """NumPy's long double is a real floating dtype: the matmul-only polar takes it (the cap of the scaling
    exponent read ``float(finfo.smallest_normal)``, 0.0 for 2^-16382, and raised "math domain error";
    found by a user's hunt, 2026-12-02). The decompositions are NumPy's, which refuse long double
    ("array type float128 is unsupported in linalg"). Against float64's polar: the iteration's own
    error, 1e-12 (float64 rounding of a 5-step iteration is ~1e-15, its distance to the SVD's is larger)."""
    X = np.array([[3.0, 0.0], [4.0, 5.0]])
    got = polar(X.astype(np.longdouble))
    assert got.dtype == np.longdouble
    assert max_relative_error(got.astype(np.float64), polar(X)) <= 1e-12


def test_newton_schulz_inverse_sqrt_takes_numpy_long_double() -> None:
    """The same cap in the matmul-only inverse root: its floor of the scaling exponent read
    ``float(finfo.smallest_normal) * float(finfo.eps)``, 0.0 for long double, and raised "math domain error"
    (a user's hunt, 2026-12-04). ``check=False``: the check's eigvalsh is NumPy's, which refuses long double.
    Against the exact root of diag(4, 9): the iteration's own error (its default steps reach float64's)."""
    A = np.diag([4.0, 9.0]).astype(np.longdouble)
    got = linalg.inverse_sqrt(A, method="newton_schulz", check=False)
    assert got.dtype == np.longdouble
    assert max_relative_error(got.astype(np.float64), np.diag([0.5, 1 / 3])) <= 1e-12


@pytest.mark.parametrize("dtype, eps, default_rank", [("float16", 2**-10, 12), ("bfloat16", 2**-7, 15)])
def test_a_rank_deficient_half_precision_input_needs_its_own_rtol(dtype: str, eps: float, default_rank: int) -> None:
    """What docs/linalg.md says of half-precision input to the SVD polar: a rank-1 16 x 16 matrix rounded to
    float16 (bfloat16) keeps rounding-level singular values above the default cut (float32's), so the default
    factor has rank 12 (15); ``rtol=16 eps`` of its dtype gives the rank-1 answer, the float32 input's."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    X = np.outer(rng.standard_normal(16), rng.standard_normal(16))
    half = torch.as_tensor(X).to(getattr(torch, dtype))

    def rank(Q):
        return int(torch.linalg.matrix_rank(Q.float(), rtol=0.1))

    # Measured 12 and 15 (2026-12-04); which of the rounding-level values clear the cut may vary with the SVD.
    assert rank(linalg.polar(half, method="svd")) >= default_rank - 4
    cut = linalg.polar(half, method="svd", rtol=16 * eps)
    exact = linalg.polar(torch.as_tensor(X).float(), method="svd")
    assert rank(cut) == 1
    assert float(torch.linalg.norm(cut.float() - exact)) <= 0.05  # the half dtype's rounding of U_1 V_1^T


def test_one_triple_without_steps_is_refused_for_the_inverse_root() -> None:
    """``coefficients=CUBIC_COEFFICIENTS`` (the constant, not the name ``"cubic"``) ran its one triple once:
    93 % off the root, with ``check=True`` (a user's hunt, 2026-12-04). Refused, in ``InverseRootConfig`` too;
    with ``steps`` the triple repeats, as the name's 22 steps do."""
    A = np.diag([4.0, 9.0, 0.25])
    with pytest.raises(ValueError, match=r"is one \(a, b, c\) triple and steps=None would run it once"):
        linalg.inverse_sqrt(A, method="newton_schulz", coefficients=linalg.CUBIC_COEFFICIENTS)
    with pytest.raises(ValueError, match=r"inverse-root coefficients=.* is one \(a, b, c\) triple"):
        InverseRootConfig(method="newton_schulz", coefficients=linalg.CUBIC_COEFFICIENTS)
    repeated = linalg.inverse_sqrt(A, method="newton_schulz", coefficients=linalg.CUBIC_COEFFICIENTS, steps=22)
    assert np.array_equal(repeated, linalg.inverse_sqrt(A, method="newton_schulz", coefficients="cubic"))


def test_refusals_on_a_device_without_64_bit_types() -> None:
    """array-api-strict's "no_x64" device: the refusals counted and located the failures with int64 arrays
    (``argmax``, ``sum``), which that device refuses, so the caller got "does not support dtype=int64" in
    place of the ``LinalgInputError`` (a user's hunt, 2026-12-04). Counted in the device's default integer."""
    xs = pytest.importorskip("array_api_strict")
    device = xs.Device("no_x64")
    batch = xs.asarray([[[1.0, 0.0], [0.0, 1.0]], [[1.0, 2.0], [2.0, 1.0]]], dtype=xs.float32, device=device)
    with pytest.raises(linalg.LinalgInputError, match=r"A\[1\] \(1 of 2 matrices of the batch fail\) is not positive"):
        linalg.inverse_sqrt(batch)
    with pytest.raises(linalg.LinalgInputError, match=r"X is not finite: 1 NaN and 0 infinite of 4 entries"):
        linalg.polar(xs.asarray([[float("nan"), 0.0], [0.0, 1.0]], dtype=xs.float32, device=device))


@pytest.mark.parametrize("function", ["sym", "trace_normalize"])
@pytest.mark.parametrize("shape", [(1, 3), (2, 1, 3), (2, 3)])
def test_sym_and_trace_normalize_refuse_a_non_square_input(function: str, shape: tuple) -> None:
    """``sym`` of a (1, 3) returned a (3, 3) (``X + X^T`` broadcast) and ``trace_normalize`` of a (2, 3) rescaled
    by its leading diagonal's trace, on every backend, without a word (a user's hunt, 2026-12-04)."""
    X = np.ones(shape)
    with pytest.raises(ValueError, match=rf"{function}: \w must be square in its last two dimensions, got shape"):
        getattr(linalg, function)(X)


def test_configs_keep_coefficients_given_as_an_iterator() -> None:
    """``PolarConfig`` and ``InverseRootConfig`` validated an iterator (consuming it), then stored what was
    left: an empty schedule, refused at the first step with an error about ``()`` (found by a user's hunt,
    2026-12-02). They store the schedule, as a list gives it."""
    from fismo_core import InverseRootConfig, PolarConfig

    polar_schedule, root_schedule = [(3.4445, -4.7750, 2.0315)], [(1.5, -0.5, 0.0)]
    assert PolarConfig(coefficients=iter(polar_schedule)) == PolarConfig(coefficients=polar_schedule)
    given = InverseRootConfig(method="newton_schulz", steps=20, coefficients=(t for t in root_schedule))
    assert given == InverseRootConfig(method="newton_schulz", steps=20, coefficients=root_schedule)
    assert given.coefficients == ((1.5, -0.5, 0.0),)
    # Each triple an iterator too (a schedule parsed with map): validated, then stored as empty triples,
    # refused at the first step with an error about ((),) (a user's hunt, 2026-12-02, again).
    parsed = [map(float, "3.4445,-4.7750,2.0315".split(","))]
    assert PolarConfig(coefficients=parsed) == PolarConfig(coefficients=polar_schedule)
    assert InverseRootConfig(method="newton_schulz", steps=20, coefficients=[iter(root_schedule[0])]) == given


@pytest.mark.parametrize("coefficients", [(3.4445, -4.7750, 2.0315), None, 3.0], ids=["flat triple", "None", "float"])
def test_coefficients_that_are_no_sequence_of_triples_are_refused_by_name(coefficients) -> None:
    """One flat ``(a, b, c)`` (optax.contrib.muon's ``ns_coeffs`` form), ``None`` or a number raised Python's
    ``'float' object is not iterable``, naming no argument; the sequence-of-triples ValueError now, in the
    configs and in ``polar``."""
    from fismo_core import InverseRootConfig, PolarConfig

    match = r"coefficients must be a non-empty sequence of \(a, b, c\) triples, .*one triple is written \(\(a, b, c\),\)"
    for make in (lambda: PolarConfig(coefficients=coefficients),
                 lambda: InverseRootConfig(method="newton_schulz", coefficients=coefficients),
                 lambda: linalg.polar(np.eye(3), coefficients=coefficients)):
        with pytest.raises(ValueError, match=match):
            make()


def test_whiten_refuses_mixed_dtypes() -> None:
    """NumPy and JAX promoted a float32 X to float64 where torch raised its own error: one rule for all."""
    X, F = np.ones((3, 3), dtype=np.float32), np.eye(3)
    with pytest.raises(TypeError, match=r"whiten: X, left and right must share one dtype, got float32, float64 and float64"):
        whiten(X, F, F)
    assert whiten(X, F.astype(np.float32), F.astype(np.float32)).dtype == np.float32


# --- The switch ----------------------------------------------------------------------------------


def test_check_does_not_change_the_result(target: Target) -> None:
    """On good input, check=True and check=False return the same arrays bit for bit."""
    rng = np.random.default_rng(6)
    X = target.asarray(rng.standard_normal((2, 6, 9)))
    A = target.asarray(np.stack([spd(rng, np.geomspace(1.0, 1e-3, 6)) for _ in range(2)]))
    for function, arg in (("polar", X), ("inverse_sqrt", A)):
        for method in METHODS[function]:
            checked = to_numpy(getattr(linalg, function)(arg, method=method))
            unchecked = to_numpy(getattr(linalg, function)(arg, method=method, check=False))
            assert np.array_equal(checked, unchecked), (function, method)


def test_check_false_runs_no_check() -> None:
    """Bad input passes through: a finite, wrong root; NaN from polar."""
    Z = inverse_sqrt(np.array([[2.0, 1.0], [0.0, 2.0]]), method="newton_schulz", check=False)
    assert np.all(np.isfinite(Z))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # NumPy's own warning for the NaN
        assert np.all(np.isnan(polar(np.array([[1.0, math.nan]]), check=False)))


@pytest.mark.parametrize("check", [1, 0, None, "yes"])
def test_check_must_be_a_bool(check) -> None:
    for function in (polar, inverse_sqrt):
        with pytest.raises(TypeError, match="check must be True or False"):
            function(np.eye(2), check=check)


@pytest.mark.parametrize("check", [np.True_, np.False_])
def test_a_numpy_bool_check_is_the_python_bool(check) -> None:
    """A flag read from a NumPy array is a flag, as for ``nesterov`` (the package's one check of flags): a
    NumPy ``True`` checks (the NaN refused), a NumPy ``False`` does not."""
    for function in (polar, inverse_sqrt):
        assert np.array_equal(function(4.0 * np.eye(2), check=check), function(4.0 * np.eye(2), check=bool(check)))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # NumPy's own warning for the NaN, unchecked
            if check:
                with pytest.raises(LinalgInputError):
                    function(np.array([[1.0, math.nan], [math.nan, 1.0]]), check=check)
            else:
                function(np.array([[1.0, math.nan], [math.nan, 1.0]]), check=check)


def test_rank_deficient_polar_is_not_refused(target: Target) -> None:
    """Rank 2 of 6 x 8: "svd" gives U_r V_r^T, Newton–Schulz (an odd polynomial) the same to its accuracy."""
    rng = np.random.default_rng(7)
    U, V = haar(rng, 6)[:, :2], haar(rng, 8)[:, :2]
    X = (U * np.array([1.0, 0.5])) @ V.T
    exact = U @ V.T
    # max |error|, measured on every CPU backend: svd 3.9e-16 / 1.2e-7 (float64 / float32), rounding;
    # Newton–Schulz 8.9e-14 / 7.9e-5, the null space's rounding grown by the eight slopes at zero
    # (6.4e3 eps = 1.4e-12 / 7.6e-4 bounds it). Ten times the measured, or the bound.
    svd_tol, ns_tol = {"float64": (4e-15, 1.4e-12), "float32": (1.2e-6, 7.6e-4)}[target.dtype]
    assert np.abs(to_numpy(polar(target.asarray(X), method="svd")) - exact).max() <= svd_tol
    ns = to_numpy(polar(target.asarray(X), coefficients="polar_express", steps=8))
    assert np.abs(ns - exact).max() <= ns_tol


def test_jax_jit_leaves_the_checks_out() -> None:
    """Traced values cannot be read: under jax.jit no error, the result of check=False; eager raises."""
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    A = jnp.asarray(np.array([[2.0, 1.0], [0.0, 2.0]], dtype=np.float32))
    for method in METHODS["inverse_sqrt"]:
        traced = jax.jit(lambda a, m=method: inverse_sqrt(a, method=m))(A)
        # jit fuses and rounds differently from eager: measured 1.8e-6 relative (float32, nine
        # Newton–Schulz steps); 1e-4 is far below the 0.1 that separates the two methods' answers.
        unchecked = np.asarray(inverse_sqrt(A, method=method, check=False))
        np.testing.assert_allclose(np.asarray(traced), unchecked, rtol=0, atol=1e-4)
        refusal(inverse_sqrt, A, method=method)
    X = jnp.asarray(np.array([[1.0, math.nan]], dtype=np.float32))
    assert np.all(np.isnan(np.asarray(jax.jit(polar)(X))))
    refusal(polar, X)


def test_torch_compile() -> None:
    """docs/linalg.md: under torch.compile the checks run at a graph break; fullgraph=True needs check=False."""
    torch = pytest.importorskip("torch")
    torch._dynamo.reset()
    bad = torch.tensor([[2.0, 1.0], [0.0, 2.0]], dtype=torch.float64)
    good = torch.tensor([[2.0, 1.0], [1.0, 2.0]], dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # dynamo's graph-break notices
        compiled = torch.compile(inverse_sqrt, backend="eager")
        assert "not symmetric" in refusal(compiled, bad)
        torch.testing.assert_close(compiled(good), inverse_sqrt(good), rtol=0, atol=1e-15)
        torch._dynamo.reset()  # dynamo caches per code object: without this it reuses the graphs above
        with pytest.raises(Exception, match="data-dependent") as info:
            torch.compile(inverse_sqrt, backend="eager", fullgraph=True)(good)
        assert not isinstance(info.value, LinalgInputError)
        unchecked = torch.compile(lambda a: inverse_sqrt(a, check=False), backend="eager", fullgraph=True)
        torch.testing.assert_close(unchecked(good), inverse_sqrt(good), rtol=0, atol=1e-15)
    torch._dynamo.reset()


def test_half_precision_cuts_are_float32s_and_measured_without_overflow() -> None:
    """float16 and bfloat16 ``A``: the eigenvalues are computed in float32, and the cut is ``d eps`` of
    float32 (at least 2 eps of ``A``'s dtype). With the half dtype's own ``d eps`` the cut reached 1 at
    ``d = 128`` in bfloat16 and ``2 I`` was "singular"; and float16's ``||A||_F`` overflowed past a side of
    about 200, so that a matrix far from symmetric passed the check (NumPy's eigh then read one triangle;
    a user's hunt, 2026-12-03)."""
    torch = pytest.importorskip("torch")
    for dtype, d in ((torch.bfloat16, 128), (torch.float16, 1024)):  # where the dtype's own d eps reaches 1
        cut = linalg.inverse_sqrt_tolerance(torch.eye(d, dtype=dtype))
        assert cut == max(d * EPS["float32"], 2 * float(torch.finfo(dtype).eps)) < 0.02  # was 1.0
    A = 2 * torch.eye(128, dtype=torch.bfloat16)
    for method in METHODS["inverse_sqrt"]:
        Z = inverse_sqrt(A, method=method)
        assert Z.dtype == torch.bfloat16 and torch.allclose(Z.float(), torch.eye(128) / math.sqrt(2), atol=4e-3)
    upper = np.eye(256) + np.triu(np.full((256, 256), 1.5), 1)  # ||A - A^T||_F / ||A||_F = 1.41
    for A in (upper.astype(np.float16), torch.tensor(upper, dtype=torch.float16)):
        for method in METHODS["inverse_sqrt"]:
            assert "is not symmetric: ||A - A^T||_F / ||A||_F = 1.4 > max(d eps of float32, 2 eps of float16)" \
                in refusal(inverse_sqrt, A, method=method)


def test_polar_refuses_an_eps_past_floats_range_by_name() -> None:
    """``eps=10**400`` passed the range check (an int compares below inf) and raised a bare ``OverflowError``
    at ``float(eps)`` (a user's hunt, 2026-12-03)."""
    with pytest.raises(ValueError, match=r"eps must be a finite number > 0"):
        polar(np.eye(3), eps=10**400)


def test_the_checks_step_aside_under_torch_func_vmap() -> None:
    """Every checked call raised vmap's "data-dependent control flow" error under ``torch.func.vmap``, where
    ``jax.vmap`` leaves the checks out (a user's hunt, 2026-12-03): left out there too; the values are the
    unbatched calls'."""
    torch = pytest.importorskip("torch")
    B = torch.randn(3, 4, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    S = B @ B.mT + torch.eye(4, dtype=torch.float64)
    for function in (polar, lambda X: polar(X, method="svd"), inverse_sqrt):
        batched = torch.func.vmap(function)(S)
        torch.testing.assert_close(batched, torch.stack([function(X) for X in S]), rtol=1e-12, atol=1e-12)


def test_the_optimizer_runs_no_check(monkeypatch: pytest.MonkeyPatch) -> None:
    """FISMO has its own fault handling: its calls pass check=False and never reach the checks."""

    def fail(*args, **kwargs):
        raise AssertionError("the optimizer ran a linalg input check")

    monkeypatch.setattr(linalg, "_checks_can_run", fail)
    rng = np.random.default_rng(8)
    W = rng.standard_normal((5, 7))
    for config in ({}, {"inv_root": "newton_schulz"}, {"polar": "svd"}, {"nonfinite": "skip"}):
        opt = FISMO(**config)
        state = opt.init(W)
        for _ in range(2):
            W, state = opt.step(W, rng.standard_normal((5, 7)), state)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        assert np.all(np.isnan(PolarConfig()(np.array([[1.0, math.nan]]))))
        assert np.all(np.isfinite(InverseRootConfig(method="newton_schulz")(np.array([[2.0, 1.0], [0.0, 2.0]]))))


# --- SciPy equivalents (docs/linalg.md, "Coming from SciPy") --------------------------------------

# Both sides are accurate to about eps * kappa (the conditioning of the polar factor and of
# A^{-1/2}; kappa' = ||A||_F / lambda_min for the latter). Measured over these matrices on the
# NumPy, array-api-strict, torch and JAX CPU backends, under the default, Haswell/avx2 and
# SkylakeX/avx512 kernels: at most 6.1 eps at kappa = 1 (fractional_matrix_power; polar 4.3,
# inv(sqrtm) 5.8) and 0.19 eps * kappa above (polar; the others 0.19 and 0.13) on an AMD EPYC,
# 0.21 eps * kappa on an Intel Xeon (2026-12-05; python docs/scripts/scipy_equivalents.py).
# eps * (50 + 2 kappa) is eight and ten times these.
def scipy_tolerance(dtype: str, kappa: float) -> float:
    return EPS[dtype] * (50 + 2 * kappa)


SCIPY_KAPPAS = (1.0, 1e2, 1e4, 1e6, 1e8)


def skip_float32_beyond_1e4(target: Target, kappa: float) -> None:
    if target.dtype == "float32" and kappa > 1e4:
        pytest.skip("float32 beyond kappa = 1e4: eps_32 * kappa > 1e-3, both sides keep under three digits")


@pytest.mark.numbers
@pytest.mark.parametrize("kappa", SCIPY_KAPPAS)
@pytest.mark.parametrize("shape", [(16, 16), (8, 24), (24, 8)], ids=str)
def test_polar_svd_matches_scipy_polar(target: Target, kappa: float, shape: tuple[int, int]) -> None:
    """polar(X, method="svd") = scipy.linalg.polar(X)[0] on full-rank X."""
    skip_float32_beyond_1e4(target, kappa)
    m, n = shape
    r = min(m, n)
    for seed in range(3):
        rng = np.random.default_rng(seed)
        X = (haar(rng, m)[:, :r] * np.geomspace(1.0, 1 / kappa, r)) @ haar(rng, n)[:, :r].T
        X_r = to_numpy(target.asarray(X))  # the input as the backend stores it
        reference = scipy.linalg.polar(X_r)[0]
        got = to_numpy(polar(target.asarray(X), method="svd"))
        error = np.linalg.norm(got - reference) / np.linalg.norm(reference)
        assert error <= scipy_tolerance(target.dtype, np.linalg.cond(X_r)), (seed, error)


@pytest.mark.numbers
@pytest.mark.parametrize("kappa", SCIPY_KAPPAS)
def test_inverse_sqrt_matches_scipy(target: Target, kappa: float) -> None:
    """inverse_sqrt(A, method="eigh") = fractional_matrix_power(A, -0.5) = inv(sqrtm(A)) on SPD A."""
    skip_float32_beyond_1e4(target, kappa)
    for seed in range(3):
        rng = np.random.default_rng(seed)
        A = spd(rng, np.geomspace(1.0, 1 / kappa, 16))
        A_r = to_numpy(target.asarray(A))
        kappa_f = np.linalg.norm(A_r) / np.linalg.eigvalsh(A_r)[0]
        got = to_numpy(inverse_sqrt(target.asarray(A), method="eigh"))
        for name, reference in (
            ("fractional_matrix_power", scipy.linalg.fractional_matrix_power(A_r, -0.5)),
            ("inv(sqrtm)", scipy.linalg.inv(scipy.linalg.sqrtm(A_r))),
        ):
            if np.iscomplexobj(reference):
                # SciPy's Schur-based functions may return a complex array for a real SPD input, with
                # imaginary parts at rounding level, depending on the CPU's kernels (measured: under
                # OpenBLAS Sandybridge, fractional_matrix_power of the float32-rounded A at kappa = 1).
                # The real part is the root; anything above rounding in the imaginary part is a fault.
                assert np.abs(reference.imag).max() <= 1e3 * np.finfo(np.float64).eps, name
                reference = reference.real
            error = np.linalg.norm(got - reference) / np.linalg.norm(reference)
            assert error <= scipy_tolerance(target.dtype, kappa_f), (name, seed, error)


def test_polar_svd_on_rank_deficient_input_is_scipy_projected(target64: Target) -> None:
    """Rank 3 of 8 x 12: ours is SciPy's u times the row-space projector V_r V_r^T, and
    polar(X).T @ X is SciPy's symmetric factor p. Well conditioned on its rank (1 to 0.25):
    rounding only; 1e-13 is over 100 eps."""
    rng = np.random.default_rng(9)
    U, V = haar(rng, 8)[:, :3], haar(rng, 12)[:, :3]
    X = (U * np.array([1.0, 0.5, 0.25])) @ V.T
    u, p = scipy.linalg.polar(X)
    O = to_numpy(polar(target64.asarray(X), method="svd"))
    assert np.abs(O - u @ V @ V.T).max() <= 1e-13
    assert np.abs(O.T @ X - p).max() <= 1e-13
    assert np.linalg.matrix_rank(O) == 3 and np.linalg.matrix_rank(u) == 8  # SciPy's u: a full-rank isometry


def scalar_distance(kappa: float, coefficients: str, steps: int, r: int = 64) -> float:
    """||p(s / (safety ||s||)) - 1|| / sqrt(r): the distance of Newton–Schulz from U V^T for singular
    values s geometric from 1 to 1/kappa, from the scalar map (the schedule's constants are checked
    against the papers by tests/test_linalg.py::test_schedule_constants_match_the_papers)."""
    schedule, safety = newton_schulz_schedule(coefficients, steps)
    s = np.geomspace(1.0, 1 / kappa, r)
    x = s / (safety * np.linalg.norm(s))
    for a, b, c in schedule:
        x = a * x + b * x**3 + c * x**5
    return float(np.linalg.norm(x - 1) / math.sqrt(r))


def docs_distance_table() -> dict[str, list[str]]:
    text = (ROOT / "docs" / "linalg.md").read_text(encoding="utf-8")
    header = re.search(r"^\| κ \|((?: [^|]+ \|)+)$", text, re.M)
    assert header, "no κ row in docs/linalg.md"
    rows = {"κ": header.group(1).split("|")[:-1]}
    for label, key in (("`polar(X)` (Muon, 5 steps)", "muon"), ('`polar(X, coefficients="polar_express", steps=8)`', "polar_express")):
        row = re.search(r"^\| " + re.escape(label) + r" \|((?: [^|]+ \|)+)$", text, re.M)
        assert row, f"no row {label!r}"
        rows[key] = row.group(1).split("|")[:-1]
    return {k: [c.strip() for c in v] for k, v in rows.items()}


@pytest.mark.numbers
def test_muon_distance_from_scipy_table(target64: Target) -> None:
    """docs/linalg.md's table of polar(X) against scipy.linalg.polar(X)[0]: each cell is the scalar
    map rounded to two digits, and the matrices (the doc's own script) agree with the scalar map.

    Matrix vs scalar map: rounding of 64 x 128 products, amplified at most by the growth of the
    smallest singular values (measured below 1e-13); 1e-9. The "≤ 100 eps" cells: measured 4e-15."""
    table = docs_distance_table()
    kappas = [float(k) for k in table["κ"]]
    assert kappas == [1e1, 1e2, 1e3, 1e4, 1e5, 1e6]
    rng = np.random.default_rng(0)
    for i, kappa in enumerate(kappas):
        U, _ = np.linalg.qr(rng.standard_normal((64, 64)))
        V, _ = np.linalg.qr(rng.standard_normal((128, 64)))
        X = (U * np.geomspace(1, 1 / kappa, 64)) @ V.T
        O = scipy.linalg.polar(X)[0]
        for key, steps in (("muon", 5), ("polar_express", 8)):
            predicted = scalar_distance(kappa, key, steps)
            got = to_numpy(polar(target64.asarray(X), coefficients=key, steps=steps))
            distance = np.linalg.norm(got - O) / np.linalg.norm(O)
            cell = table[key][i]
            if cell == "≤ 100 eps":
                assert predicted <= EPS["float64"] and distance <= 100 * EPS["float64"], (key, kappa, distance)
            else:
                assert float(cell) == two_digits(predicted), (key, kappa, cell, predicted)
                assert abs(distance - predicted) <= 1e-9, (key, kappa, distance, predicted)


def test_docs_page_opens_with_the_scipy_equivalents() -> None:
    text = (ROOT / "docs" / "linalg.md").read_text(encoding="utf-8")
    headings = re.findall(r"^## (.+)$", text, re.M)
    assert headings[0] == "Coming from SciPy"
    opening = text.split("\n## ")[1]
    for scipy_call, ours in (
        ("scipy.linalg.polar(X)[0]", 'polar(X, method="svd")'),
        ("scipy.linalg.fractional_matrix_power(A, -0.5)", 'inverse_sqrt(A, method="eigh")'),
        ("scipy.linalg.inv(scipy.linalg.sqrtm(A))", 'inverse_sqrt(A, method="eigh")'),
    ):
        assert re.search(r"^\| `" + re.escape(scipy_call) + r"`.*\| `" + re.escape(ours) + "`", opening, re.M), scipy_call


def test_arguments_are_checked_before_values() -> None:
    """A bad argument is named even when the matrix is bad too: no host read before it."""
    bad = np.array([[math.nan, 1.0], [0.0, 1.0]])
    with pytest.raises(ValueError, match="unknown polar method") as info:
        polar(bad, method="qr")
    assert not isinstance(info.value, LinalgInputError)
    with pytest.raises(ValueError, match="steps must be a positive integer") as info:
        polar(bad, steps=0)
    assert not isinstance(info.value, LinalgInputError)
    with pytest.raises(ValueError, match="does not converge") as info:
        inverse_sqrt(bad, method="newton_schulz", coefficients="muon")
    assert not isinstance(info.value, LinalgInputError)
    with pytest.raises(ValueError, match="unknown inverse_sqrt method") as info:
        inverse_sqrt(bad, method="cholesky")
    assert not isinstance(info.value, LinalgInputError)
