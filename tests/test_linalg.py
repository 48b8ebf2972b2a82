"""Tests for :mod:`fismo_core.linalg`: every matmul-only method against its exact twin.

Inputs are built in NumPy float64 from a seeded generator, converted to each
backend with ``target.asarray`` and compared back in NumPy float64 through
``to_numpy``. Reference values are computed here, independently of the code
under test: exact polar factors and inverse square roots from the matrices'
construction or NumPy float64 LAPACK, the scalar Newton–Schulz maps from the
coefficients as published (typed in from the sources below, not imported).

Tolerances are written as multiples of the unit roundoff ``eps`` of the
dtype where the error scales with it; every one states what was measured
(worst case over numpy, array-api-strict, torch CPU and JAX CPU) and the
headroom chosen. ``docs/scripts/linalg_accuracy.py`` reproduces the
accuracy tables of ``docs/linalg.md``.
"""

from __future__ import annotations

import functools
import math
import re
from decimal import Decimal, localcontext
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from fismo_core.linalg import (
    CUBIC_COEFFICIENTS,
    INVERSE_SQRT_STEPS,
    MUON_COEFFICIENTS,
    POLAR_EXPRESS_COEFFICIENTS,
    inverse_sqrt,
    inverse_sqrt_steps,
    newton_schulz_schedule,
    polar,
    sym,
    trace_normalize,
    whiten,
)
from fismo_core.testing import Target, targets, to_numpy

ROOT = Path(__file__).resolve().parents[1]

EPS = {"float64": float(np.finfo(np.float64).eps), "float32": float(np.finfo(np.float32).eps)}

# --- Published coefficients, typed in from the sources (not read from linalg.py) ---------------

#: Keller Jordan's Muon quintic (blog post "Muon", 2024; torch.optim.Muon's defaults).
JORDAN_MUON = (3.4445, -4.7750, 2.0315)

#: Amsel, Persson, Musco, Gower, "The Polar Express" (2025, arXiv:2505.16932), Algorithm 1,
#: degree 5: the eight triples as printed, then divided by (1.01, 1.01^3, 1.01^5) except the
#: last, and the input divided by 1.01 ||X||_F.
PAPER_POLAR_EXPRESS_RAW = (
    (8.28721201814563, -23.595886519098837, 17.300387312530933),
    (4.107059111542203, -2.9478499167379106, 0.5448431082926601),
    (3.9486908534822946, -2.908902115962949, 0.5518191394370137),
    (3.3184196573706015, -2.488488024314874, 0.51004894012372),
    (2.300652019954817, -1.6689039845747493, 0.4188073119525673),
    (1.891301407787398, -1.2679958271945868, 0.37680408948524835),
    (1.8750014808534479, -1.2500016453999487, 0.3750001645474248),
    (1.875, -1.25, 0.375),
)
PAPER_SAFETY = 1.01
PAPER_POLAR_EXPRESS = tuple(
    (a / PAPER_SAFETY, b / PAPER_SAFETY**3, c / PAPER_SAFETY**5) for a, b, c in PAPER_POLAR_EXPRESS_RAW[:-1]
) + (PAPER_POLAR_EXPRESS_RAW[-1],)

#: The classical Newton–Schulz step p(x) = (3x - x^3)/2 (Higham, "Functions of Matrices", 2008,
#: eq. 5.22 for the sign, eq. 6.35 for the coupled square root).
CLASSICAL_CUBIC = (1.5, -0.5, 0.0)

#: (schedule, normaliser safety) by name, from the sources above.
PAPER_SCHEDULES = {
    "muon": ((JORDAN_MUON,), 1.0),
    "polar_express": (PAPER_POLAR_EXPRESS, PAPER_SAFETY),
    "cubic": ((CLASSICAL_CUBIC,), 1.0),
}


# --- Helpers ------------------------------------------------------------------------------------


def triple_at(triples, k: int):
    """The k-th (0-based) triple of a schedule whose last triple repeats."""
    return triples[min(k, len(triples) - 1)]


def scalar_newton_schulz(x, triples, steps: int):
    """The scalar map p_steps o ... o p_1 applied elementwise (NumPy float64)."""
    x = np.asarray(x, dtype=np.float64)
    for k in range(steps):
        a, b, c = triple_at(triples, k)
        x = a * x + b * x**3 + c * x**5
    return x


def numpy_newton_schulz(X: np.ndarray, triples, steps: int, safety: float = 1.0, eps: float = 1e-7) -> np.ndarray:
    """The matrix iteration written out in NumPy float64, on the short side of X."""
    X = np.asarray(X, dtype=np.float64)
    tall = X.shape[-2] > X.shape[-1]
    Y = np.swapaxes(X, -1, -2) if tall else X
    norm = np.linalg.norm(Y, axis=(-2, -1), keepdims=True)
    Y = Y / np.maximum(safety * norm, eps)
    for k in range(steps):
        a, b, c = triple_at(triples, k)
        G = Y @ np.swapaxes(Y, -1, -2)
        Y = a * Y + b * (G @ Y) + c * (G @ (G @ Y))
    return np.swapaxes(Y, -1, -2) if tall else Y


def haar(rng: np.random.Generator, n: int) -> np.ndarray:
    """A Haar-distributed n x n orthogonal matrix."""
    q, r = np.linalg.qr(rng.standard_normal((n, n)))
    return q * np.sign(np.diag(r))


def with_singular_values(rng: np.random.Generator, s: np.ndarray, m: int, n: int):
    """Matrices U diag(s) V^T of shape (..., m, n) for each row of s (..., r), r = min(m, n).

    Returns X, U (..., m, r) and V (..., n, r), all NumPy float64.
    """
    s = np.asarray(s, dtype=np.float64)
    r = min(m, n)
    assert s.shape[-1] == r
    batch = s.shape[:-1]
    count = int(np.prod(batch, dtype=int))
    U = np.stack([haar(rng, m)[:, :r] for _ in range(count)]).reshape(*batch, m, r)
    V = np.stack([haar(rng, n)[:, :r] for _ in range(count)]).reshape(*batch, n, r)
    X = (U * s[..., None, :]) @ np.swapaxes(V, -1, -2)
    return X, U, V


def spd_with_eigenvalues(rng: np.random.Generator, w: np.ndarray):
    """Symmetric positive definite V diag(w) V^T for each row of w (..., d), and V."""
    w = np.asarray(w, dtype=np.float64)
    d = w.shape[-1]
    batch = w.shape[:-1]
    count = int(np.prod(batch, dtype=int))
    V = np.stack([haar(rng, d) for _ in range(count)]).reshape(*batch, d, d)
    A = (V * w[..., None, :]) @ np.swapaxes(V, -1, -2)
    return (A + np.swapaxes(A, -1, -2)) / 2, V


def rounded(a: np.ndarray, target: Target) -> np.ndarray:
    """``a`` as the target stores it (rounded to its dtype), back in float64."""
    return to_numpy(target.asarray(a))


def rel_err(got: np.ndarray, ref: np.ndarray) -> np.ndarray:
    """||got - ref||_F / ||ref||_F over the last two axes (an array over the batch)."""
    return np.linalg.norm(got - ref, axis=(-2, -1)) / np.linalg.norm(ref, axis=(-2, -1))


def orthonormality_error(Y: np.ndarray) -> float:
    """max |Y Y^T - I| (wide or square) or |Y^T Y - I| (tall), worst over the batch."""
    m, n = Y.shape[-2:]
    G = Y @ np.swapaxes(Y, -1, -2) if m <= n else np.swapaxes(Y, -1, -2) @ Y
    return float(np.max(np.abs(G - np.eye(min(m, n)))))


def inverse_sqrt_reference(A: np.ndarray) -> np.ndarray:
    """A^{-1/2} by NumPy float64 eigh."""
    w, V = np.linalg.eigh(np.asarray(A, dtype=np.float64))
    return (V / np.sqrt(w)[..., None, :]) @ np.swapaxes(V, -1, -2)


# --- Schedules ----------------------------------------------------------------------------------


def test_schedule_constants_match_the_papers() -> None:
    assert MUON_COEFFICIENTS == (JORDAN_MUON,)
    assert CUBIC_COEFFICIENTS == (CLASSICAL_CUBIC,)
    assert len(POLAR_EXPRESS_COEFFICIENTS) == 8
    # The module divides by the same float powers of 1.01: agreement to 1 ulp is expected.
    np.testing.assert_allclose(np.array(POLAR_EXPRESS_COEFFICIENTS), np.array(PAPER_POLAR_EXPRESS), rtol=2 * EPS["float64"], atol=0)
    # The last triple is the classical quintic (15x - 10x^3 + 3x^5)/8, exactly.
    assert POLAR_EXPRESS_COEFFICIENTS[-1] == (15 / 8, -10 / 8, 3 / 8)


@pytest.mark.parametrize("name", ["muon", "polar_express", "cubic"])
def test_newton_schulz_schedule_repeats_last_triple(name: str) -> None:
    triples, safety = PAPER_SCHEDULES[name]
    schedule, got_safety = newton_schulz_schedule(name, 11)
    assert got_safety == safety
    assert len(schedule) == 11
    np.testing.assert_allclose(np.array(schedule), np.array([triple_at(triples, k) for k in range(11)]), rtol=2 * EPS["float64"], atol=0)
    short, _ = newton_schulz_schedule(name, 1)
    np.testing.assert_allclose(np.array(short), np.array(triples[:1]), rtol=2 * EPS["float64"], atol=0)


def test_newton_schulz_schedule_explicit_sequence() -> None:
    triples = [(3, -3.2, 1.2), [1.5, -0.5, 0]]
    schedule, safety = newton_schulz_schedule(triples, 4)
    assert safety == 1.0
    assert schedule == ((3.0, -3.2, 1.2), (1.5, -0.5, 0.0), (1.5, -0.5, 0.0), (1.5, -0.5, 0.0))
    assert all(isinstance(v, float) for t in schedule for v in t)


# --- polar: Newton–Schulz against the exact polar factor ---------------------------------------

POLAR_KAPPAS = (1.0, 1e1, 1e2, 1e3)
POLAR_SHAPES = ((16, 16), (8, 24), (24, 8))

# Rounding part of ||NS - U V^T||_F / ||U V^T||_F for Polar Express, 8 steps, on top of the
# truncation predicted by the scalar iteration. Measured worst excess (this test over 4 seeds,
# plus batched variants over 5): float64 2.6e-15, 3.3e-15, 4.7e-15, 1.9e-14 and float32 1.4e-6,
# 1.1e-6, 1.7e-6, 1.2e-5 at kappa = 1, 10, 100, 1e3, i.e. about eps * (15 + kappa / 10) in both dtypes (the polar
# factor's sensitivity grows like kappa); ten times that is eps * (150 + kappa).
def polar_rounding_tolerance(dtype: str, kappa: float) -> float:
    return EPS[dtype] * (150 + kappa)


@pytest.mark.parametrize("kappa", POLAR_KAPPAS)
def test_polar_newton_schulz_matches_svd(target: Target, kappa: float) -> None:
    """Polar Express, 8 steps, equals U V^T up to the scalar truncation plus rounding."""
    rng = np.random.default_rng(int(kappa))
    for m, n in POLAR_SHAPES:
        r = min(m, n)
        s = np.tile(np.geomspace(1.0, 1.0 / kappa, r), (2, 1)) * np.array([[3.0], [0.02]])  # two scales
        X, U, V = with_singular_values(rng, s, m, n)
        exact = U @ np.swapaxes(V, -1, -2)
        svd_ref = to_numpy(polar(X, method="svd"))  # the exact twin, NumPy float64
        # NumPy LAPACK SVD: measured max |error| 3.0e-14 at kappa = 1e3 (7.8e-16 at kappa = 1); 3e-13.
        np.testing.assert_allclose(svd_ref, exact, rtol=0, atol=3e-13)

        got = to_numpy(polar(target.asarray(X), coefficients="polar_express", steps=8))
        assert got.shape == X.shape
        error = rel_err(got, svd_ref)
        # Exact arithmetic: singular values s/(1.01 ||X||_F) map to p(s); the relative Frobenius
        # error of U p(S) V^T is ||p(s) - 1|| / sqrt(r). Non-zero only at kappa = 1e3, where
        # s_min/||X||_F falls just below the schedule's design interval [1e-3, 1] (about 2e-10).
        shat = s / np.linalg.norm(s, axis=-1, keepdims=True) / PAPER_SAFETY
        truncation = np.linalg.norm(scalar_newton_schulz(shat, PAPER_POLAR_EXPRESS, 8) - 1, axis=-1) / math.sqrt(r)
        tolerance = polar_rounding_tolerance(target.dtype, kappa)
        assert np.all(np.abs(error - truncation) <= tolerance), (
            f"shape {(m, n)}: error {error} vs predicted truncation {truncation} (tolerance {tolerance:.1e})"
        )


# --- polar: the singular-value band table of the docstring --------------------------------------

BAND_ROWS = (("muon", 5), ("muon", 7), ("polar_express", 5), ("polar_express", 6), ("polar_express", 8))


def _parse_bound(text: str) -> float:
    text = text.strip()
    match = re.fullmatch(r"1\s*([-+])\s*([0-9.]+e-?[0-9]+)", text)
    if match:
        return 1.0 + (1 if match.group(1) == "+" else -1) * float(match.group(2))
    return float(text)


@functools.lru_cache(maxsize=None)
def _band_probes(name: str, steps: int) -> np.ndarray:
    """Normalised singular values probing [1e-3, 1): a geometric grid plus where the map is extreme."""
    triples, safety = PAPER_SCHEDULES[name]
    grid = np.concatenate([np.geomspace(1e-3, 0.9999, 200_001), np.linspace(1e-3, 0.9999, 200_001)])
    image = scalar_newton_schulz(grid / safety, triples, steps)
    return np.concatenate([np.geomspace(1e-3, 0.9999, 48), grid[[np.argmin(image), np.argmax(image)]]])


def _band_table(text: str, row_pattern: str) -> dict[tuple[str, int], tuple[float, float]]:
    table = {}
    for name, steps, lo, hi in re.findall(row_pattern, text):
        table[(name, int(steps))] = (_parse_bound(lo), _parse_bound(hi))
    return table


def docstring_band_table() -> dict[tuple[str, int], tuple[float, float]]:
    return _band_table(polar.__doc__ or "", r'``"(muon|polar_express)"``\s+(\d+)\s+\[([^,\]]+),\s*([^\]]+)\]')


def docs_band_table() -> dict[tuple[str, int], tuple[float, float]]:
    text = (ROOT / "docs" / "linalg.md").read_text(encoding="utf-8")
    return _band_table(text, r'\|\s*`"(muon|polar_express)"`\s*\|\s*(\d+)\s*\|\s*\[([^,\]]+),\s*([^\]]+)\]\s*\|')


def _image_of_interval(lo, hi, triple, sqrt):
    """Exact image of [lo, hi] (lo > 0) under p(x) = a x + b x^3 + c x^5: endpoints and critical points."""
    a, b, c = triple
    points = [lo, hi]
    # p'(x) = a + 3 b x^2 + 5 c x^4 = 0 is a quadratic in y = x^2.
    disc = 9 * b * b - 20 * a * c
    if c != 0 and disc >= 0:
        for y in ((-3 * b + sqrt(disc)) / (10 * c), (-3 * b - sqrt(disc)) / (10 * c)):
            if y > 0 and lo <= sqrt(y) <= hi:
                points.append(sqrt(y))
    values = [a * x + b * x**3 + c * x**5 for x in points]
    return min(values), max(values)


def scalar_band(name: str, steps: int, *, exact: bool = False):
    """Image of normalised singular values in [1e-3, 1] after ``steps`` steps of schedule ``name``.

    The iteration sees s / (safety ||X||_F), so the domain is [1e-3, 1] / safety. NumPy float64,
    or with ``exact=True`` 50-digit decimals (the coefficients converted exactly).
    """
    triples, safety = PAPER_SCHEDULES[name]
    if exact:
        with localcontext() as ctx:
            ctx.prec = 50
            lo, hi = Decimal("0.001") / Decimal(safety), Decimal(1) / Decimal(safety)
            for k in range(steps):
                triple = tuple(Decimal(v) for v in triple_at(triples, k))
                lo, hi = _image_of_interval(lo, hi, triple, lambda v: v.sqrt())
            return lo, hi
    lo, hi = 1e-3 / safety, 1.0 / safety
    for k in range(steps):
        lo, hi = _image_of_interval(lo, hi, triple_at(triples, k), math.sqrt)
    return lo, hi


@pytest.mark.numbers
@pytest.mark.parametrize("table", ["docstring", "docs/linalg.md"])
def test_band_table_matches_scalar_iteration(table: str) -> None:
    """The documented bands are the 3-decimal outward rounding of the scalar image of [1e-3, 1]."""
    documented = docstring_band_table() if table == "docstring" else docs_band_table()
    assert set(documented) == set(BAND_ROWS), f"{table} band table has rows {sorted(documented)}"
    for row, (doc_lo, doc_hi) in documented.items():
        lo, hi = scalar_band(*row)
        if row == ("polar_express", 8):
            # Converged row, documented to 1e-15: check it in 50-digit arithmetic.
            lo_x, hi_x = (float(v) for v in scalar_band(*row, exact=True))
            assert doc_lo <= lo_x <= hi_x <= doc_hi, (row, lo_x, hi_x)
            assert 1 - doc_lo < 2 * (1 - lo_x), (row, "lower bound loose", lo_x)  # measured 1 - lo = 3.1e-15
            assert doc_hi - 1 <= 1e-15, (row, "upper bound loose")
            assert round(lo, 3) == round(doc_lo, 3) == 1.0 and round(hi, 3) == round(doc_hi, 3) == 1.0
            continue
        # Documented numbers are floor(lo) and ceil(hi) to 3 decimals (a band that contains the image).
        assert math.floor(lo * 1000) / 1000 == pytest.approx(doc_lo, abs=1e-12), (row, lo, doc_lo)
        assert math.ceil(hi * 1000) / 1000 == pytest.approx(doc_hi, abs=1e-12), (row, hi, doc_hi)


# Rounding slack on the band, per dtype. Measured worst deviation of an output singular value
# from the scalar image of its input: float64 7.6e-14, float32 2.3e-5 (relative); ten times.
BAND_SLACK = {"float64": 1e-12, "float32": 2.5e-4}


def band_probe_matrices(rng: np.random.Generator, name: str, steps: int, m: int = 8, n: int = 12):
    """Matrices whose normalised singular values lie in [1e-3, 1) and probe the whole interval.

    Each matrix has one probe value t, one filler value making ||s||_2 = 1, and the rest at 1e-3;
    the probes are a geometric grid plus the points where the scalar map attains its extremes.
    """
    probes = _band_probes(name, steps)
    r = min(m, n)
    s = np.full((probes.size, r), 1e-3)
    s[:, 0] = probes
    s[:, 1] = np.sqrt(1 - probes**2 - (r - 2) * 1e-6)
    assert np.all((s >= 1e-3) & (s <= 1)) and np.allclose(np.linalg.norm(s, axis=-1), 1)
    scale = 10.0 ** rng.uniform(-2, 3, size=(probes.size, 1))  # ||X||_F anywhere in [1e-2, 1e3]
    X, _, _ = with_singular_values(rng, s * scale, m, n)
    return X


@pytest.mark.parametrize("name,steps", BAND_ROWS)
def test_newton_schulz_band(target: Target, name: str, steps: int) -> None:
    """Output singular values lie in the docstring's band, and reach its edges."""
    doc_lo, doc_hi = docstring_band_table()[(name, steps)]
    X = band_probe_matrices(np.random.default_rng(steps), name, steps)
    Y = to_numpy(polar(target.asarray(X), coefficients=name, steps=steps))
    sv = np.linalg.svd(Y, compute_uv=False)
    slack = BAND_SLACK[target.dtype]
    assert sv.min() >= doc_lo - slack, f"smallest singular value {sv.min()!r} below the band [{doc_lo}, {doc_hi}]"
    assert sv.max() <= doc_hi + slack, f"largest singular value {sv.max()!r} above the band [{doc_lo}, {doc_hi}]"
    # The band is tight: documented to 3 decimals, so the probes reach within 1e-3 of each edge.
    assert sv.min() <= doc_lo + 1e-3 + slack and sv.max() >= doc_hi - 1e-3 - slack


# --- polar: shapes, batching, zero, explicit coefficients, svd ---------------------------------

# Batched vs one matrix at a time: batched kernels may block the sums differently. Measured max
# |difference| relative to the largest entry: 5.8 eps (float64) and 7.3 eps (float32) for
# Newton–Schulz polar and inverse_sqrt, at most 1 eps for svd/eigh; 80 eps is ten times the worst.
def batch_tolerance(dtype: str) -> float:
    return 80 * EPS[dtype]


@pytest.mark.parametrize("shape", [(12, 12), (6, 10), (10, 6), (2, 3, 6, 10), (2, 3, 10, 6)], ids=str)
@pytest.mark.parametrize("method", ["newton_schulz", "svd"])
def test_polar_shapes_and_batching(target: Target, shape: tuple[int, ...], method: str) -> None:
    rng = np.random.default_rng(sum(shape))
    *batch, m, n = shape
    s = np.geomspace(1.0, 0.1, min(m, n)) * np.ones((*batch, 1))
    X, U, V = with_singular_values(rng, s, m, n)
    exact = U @ np.swapaxes(V, -1, -2)
    kwargs = {"coefficients": "polar_express", "steps": 8} if method == "newton_schulz" else {}
    got = polar(target.asarray(X), method=method, **kwargs)
    assert tuple(got.shape) == shape
    # kappa = 10, no truncation: measured 5.5 eps (NS) and 4.0 eps (svd); the tolerance is 160 eps.
    assert np.max(rel_err(to_numpy(got), exact)) <= polar_rounding_tolerance(target.dtype, 10.0)
    if batch:
        got_np = to_numpy(got)
        for index in np.ndindex(*batch):
            single = to_numpy(polar(target.asarray(X[index]), method=method, **kwargs))
            np.testing.assert_allclose(got_np[index], single, rtol=0, atol=batch_tolerance(target.dtype))


def test_polar_tall_is_transpose_of_wide(target: Target) -> None:
    """The tall path runs on X^T: polar(X^T) = polar(X)^T, with Muon's non-converged map too."""
    rng = np.random.default_rng(7)
    X = rng.standard_normal((5, 9))
    wide = to_numpy(polar(target.asarray(X), coefficients="muon", steps=5))
    tall = to_numpy(polar(target.asarray(X.T), coefficients="muon", steps=5))
    np.testing.assert_allclose(tall, wide.T, rtol=0, atol=batch_tolerance(target.dtype))
    # ... and both equal the iteration written out in NumPy.
    reference = numpy_newton_schulz(rounded(X, target), (JORDAN_MUON,), 5)
    np.testing.assert_allclose(wide, reference, rtol=0, atol=EXPLICIT_TOLERANCE[target.dtype])


@pytest.mark.parametrize("coefficients", ["muon", "polar_express"])
def test_polar_of_zero_is_zero(target: Target, coefficients: str) -> None:
    X = np.zeros((2, 4, 6))
    X[1] = np.random.default_rng(0).standard_normal((4, 6))  # a non-zero neighbour in the batch
    got = to_numpy(polar(target.asarray(X), coefficients=coefficients, steps=5))
    assert np.all(np.isfinite(got))
    assert np.all(got[0] == 0)
    assert np.linalg.norm(got[1]) > 1  # the neighbour is still orthogonalised (||UV^T||_F = 2)
    tall = to_numpy(polar(target.asarray(np.zeros((6, 3))), coefficients=coefficients))
    assert tall.shape == (6, 3) and np.all(tall == 0)
    # An eps below the dtype's smallest normal number (float32: it rounds to 0) gave 0 / 0 = NaN.
    tiny_eps = to_numpy(polar(target.asarray(np.zeros((4, 6))), coefficients=coefficients, eps=1e-320))
    assert np.all(tiny_eps == 0)


# Newton–Schulz vs the NumPy float64 loop on the same (rounded) input, max |difference| (entries
# are O(1)): measured float64 1.8e-15, float32 1.0e-6 (Muon, 5 steps; explicit triples 4.4e-16
# and 1.2e-7); about ten times.
EXPLICIT_TOLERANCE = {"float64": 2e-14, "float32": 1e-5}


def test_explicit_coefficients_repeat_the_last_triple(target: Target) -> None:
    rng = np.random.default_rng(3)
    X = rng.standard_normal((2, 5, 7))
    triples = [(3.4445, -4.7750, 2.0315), (1.5, -0.5, 0.0)]  # Muon's quintic, then the cubic 3/2 x - 1/2 x^3
    got = to_numpy(polar(target.asarray(X), coefficients=triples, steps=6))
    reference = numpy_newton_schulz(rounded(X, target), triples, 6)
    np.testing.assert_allclose(got, reference, rtol=0, atol=EXPLICIT_TOLERANCE[target.dtype])
    # The test can tell "repeat the last" from "cycle" and from "ignore the extra steps".
    cycled = numpy_newton_schulz(rounded(X, target), [triples[k % 2] for k in range(6)], 6)
    truncated = numpy_newton_schulz(rounded(X, target), triples, 2)
    assert np.max(np.abs(reference - cycled)) > 100 * EXPLICIT_TOLERANCE[target.dtype]
    assert np.max(np.abs(reference - truncated)) > 100 * EXPLICIT_TOLERANCE[target.dtype]
    # Fewer steps than triples uses the first ones only.
    first = to_numpy(polar(target.asarray(X), coefficients=triples, steps=1))
    np.testing.assert_allclose(first, numpy_newton_schulz(rounded(X, target), triples[:1], 1), rtol=0, atol=EXPLICIT_TOLERANCE[target.dtype])


# polar(method="svd"), max |Y Y^T - I|: measured 7.5 eps (float64) and 8.2 eps (float32); 80 eps.
# Its distance to the constructed U V^T at kappa 100 (39 eps and 27 eps measured) is held to the
# Newton–Schulz rounding tolerance eps * (150 + kappa) = 250 eps, six to nine times the worst.
SVD_ORTHONORMALITY = {dtype: 80 * eps for dtype, eps in EPS.items()}


@pytest.mark.parametrize("m,n", [(7, 7), (4, 9), (9, 4)])
def test_polar_svd_is_the_orthogonal_factor(target: Target, m: int, n: int) -> None:
    rng = np.random.default_rng(m * n)
    X, U, V = with_singular_values(rng, np.geomspace(5.0, 0.05, min(m, n)) * np.ones((3, 1)), m, n)
    Y = to_numpy(polar(target.asarray(X), method="svd"))
    assert Y.shape == (3, m, n)
    assert orthonormality_error(Y) <= SVD_ORTHONORMALITY[target.dtype]
    assert np.max(rel_err(Y, U @ np.swapaxes(V, -1, -2))) <= polar_rounding_tolerance(target.dtype, 100.0)


# --- Iteration dtype: bfloat16 as torch.optim.Muon -------------------------------------------------

#: Unit roundoff of bfloat16 (8 significand bits).
BF16_U = 2.0**-8


def _kappa10_batch(rng: np.random.Generator) -> list[np.ndarray]:
    """Wide, tall and a batch of square matrices with singular values geometric from 1 to 0.1."""
    return [with_singular_values(rng, np.geomspace(1.0, 0.1, min(m, n)) * np.ones((b, 1)), m, n)[0]
            for m, n, b in ((32, 96, 1), (96, 32, 1), (48, 48, 2))]


# bfloat16 iteration against the same iteration in X's dtype, relative Frobenius per matrix. Each
# step rounds Y, the Gram matrix and two products to bfloat16 (unit roundoff u = 2^-8) and the
# map's slope amplifies what the earlier steps rounded. Measured over 20 seeds of these matrices
# (kappa = 10): torch 8.8 u (Muon) and 8.7 u (Polar Express), JAX 15.2 u and 9.8 u, at least 4.5 u.
# 32 u = 0.125 is twice the worst; the floor 0.25 u = 1e-3 shows the iteration did run in
# bfloat16 (in float32 the difference is 0).
@pytest.mark.parametrize("coefficients,steps", [("muon", 5), ("polar_express", 8)])
def test_polar_bfloat16_iteration(target: Target, coefficients: str, steps: int) -> None:
    xp = target.xp
    for X in _kappa10_batch(np.random.default_rng(steps)):
        x = target.asarray(X)
        if not hasattr(xp, "bfloat16"):  # NumPy, array-api-strict: a clear error naming the library
            with pytest.raises(ValueError, match=r"has no bfloat16 dtype") as excinfo:
                polar(x, coefficients=coefficients, steps=steps, dtype="bfloat16")
            assert target.backend in str(excinfo.value)
            continue
        got = polar(x, coefficients=coefficients, steps=steps, dtype="bfloat16")
        assert got.dtype == x.dtype and type(got) is type(x) and tuple(got.shape) == X.shape
        reference = to_numpy(polar(x, coefficients=coefficients, steps=steps))
        deviation = rel_err(to_numpy(got), reference)
        assert np.all(deviation <= 32 * BF16_U), deviation
        assert np.all(deviation >= BF16_U / 4), deviation


def test_polar_dtype_of_the_input_is_bit_for_bit_the_default(target: Target) -> None:
    """dtype=None, the input's dtype by name and as a dtype object: one computation (no cast)."""
    x = target.asarray(np.random.default_rng(4).standard_normal((2, 6, 9)))
    default = to_numpy(polar(x))
    assert np.array_equal(to_numpy(polar(x, dtype=target.dtype)), default)
    assert np.array_equal(to_numpy(polar(x, dtype=x.dtype)), default)


def test_polar_wider_iteration_dtype(target: Target) -> None:
    """A float32 input iterated in float64: the float64 iteration of the rounded input, rounded to float32."""
    xp = target.xp
    X = np.random.default_rng(8).standard_normal((5, 7))
    x32 = xp.astype(target.asarray(X), xp.float32)  # on the float64 targets too: their library's float32
    got = polar(x32, coefficients="polar_express", steps=8, dtype="float64")
    assert got.dtype == xp.float32
    reference = numpy_newton_schulz(to_numpy(x32), PAPER_POLAR_EXPRESS, 8, safety=PAPER_SAFETY)
    # float32 rounding of the normalised input and of the result, about 1 eps_32 each: measured
    # at most 0.59 eps_32 (max |difference|, entries below 1, 20 seeds, every backend).
    np.testing.assert_allclose(to_numpy(got), reference, rtol=0, atol=4 * EPS["float32"])


def test_polar_dtype_errors(target: Target) -> None:
    xp = target.xp
    x = target.asarray(np.eye(3))
    for bad in ("bf16", "int32", "float128"):
        with pytest.raises(ValueError, match=r"^unknown iteration dtype"):
            polar(x, dtype=bad)
    for bad in (xp.int32, xp.bool, 3):
        with pytest.raises(ValueError, match=r"^dtype must be None, one of 'bfloat16'"):
            polar(x, dtype=bad)
    with pytest.raises(ValueError, match=r"method='svd' is exact and computes in X's dtype"):
        polar(x, method="svd", dtype="float32")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_exact_methods_take_half_precision_through_float32(dtype: str) -> None:
    """No eigensolver or SVD takes float16 or bfloat16 (LAPACK, cuSOLVER: the backends raised their own
    errors); the exact methods compute the half-precision input in float32 and round the result to its
    dtype, which is the float32 result of the same (exactly representable) input rounded, bit for bit. The
    SVD's default cut is float32's too: bfloat16's (``max(m, n) eps`` = 1 at side 128) gave the zero matrix,
    and float16's dropped 20 of 128 directions (found 2026-11-28)."""
    rng = np.random.default_rng(0)
    X = rng.standard_normal((3, 5, 4))
    X_large = rng.standard_normal((128, 128))
    Q = np.linalg.qr(rng.standard_normal((3, 4, 4)))[0]
    A = Q @ (np.linspace(1, 4, 4)[:, None] * np.swapaxes(Q, -1, -2))
    A = (A + np.swapaxes(A, -1, -2)) / 2
    for target in targets(dtypes=["float32"]):
        if not target.available:
            continue
        half = getattr(target.xp, dtype, None)
        if half is None:  # NumPy and array-api-strict have no bfloat16; array-api-strict no float16
            continue
        x_half, a_half, x_large = (target.xp.astype(target.asarray(v), half) for v in (X, A, X_large))
        for got, exact in (
            (polar(x_half, method="svd"), polar(target.xp.astype(x_half, target.xp.float32), method="svd")),
            (polar(x_large, method="svd"), polar(target.xp.astype(x_large, target.xp.float32), method="svd")),
            (inverse_sqrt(a_half), inverse_sqrt(target.xp.astype(a_half, target.xp.float32))),
        ):
            assert got.dtype == half, target.id
            assert np.array_equal(to_numpy(got), to_numpy(target.xp.astype(exact, half))), target.id


def test_newton_schulz_polar_of_a_large_float16_matrix_is_not_zero() -> None:
    """``X / s`` has entries in [1, 2): their sum of squares passed float16's 65504 at about 16k entries,
    the norm became inf and the result 0 (NumPy, JAX; torch sums in float32). It is taken in float32 now."""
    X = np.sign(np.random.default_rng(0).standard_normal((256, 256)))
    for target in targets(dtypes=["float32"]):
        if not target.available or getattr(target.xp, "float16", None) is None:
            continue
        half = target.xp.float16
        got = to_numpy(polar(target.xp.astype(target.asarray(X), half)))
        want = to_numpy(polar(target.asarray(X)))
        # The iteration itself runs in float16 (unit roundoff 4.9e-4): measured 3e-3 to 5e-3 apart.
        assert np.linalg.norm(got - want) / np.linalg.norm(want) < 2e-2, target.id


def test_newton_schulz_inverse_sqrt_of_a_large_float16_matrix_is_finite() -> None:
    """The Newton–Schulz root's scale ``||A||_F`` was summed in float16: ``A = 1.5 J + 0.4 I`` (d = 256, entries
    of ``A / 4^j`` near 0.5, a sum of squares near 6e4 at float16's 65504) gave a non-finite root on NumPy and
    JAX (torch sums in float32), with ``check=False`` as linalg.md advises for a matrix float16's check calls
    singular. The scale is summed in float32 now, as `polar`'s norm is."""
    d = 256
    A = 1.5 * np.ones((d, d)) + 0.4 * np.eye(d)  # eigenvalues 0.4 and 384.4
    want = inverse_sqrt(A)
    for target in targets(dtypes=["float32"]):
        if not target.available or getattr(target.xp, "float16", None) is None:
            continue
        half = target.xp.astype(target.asarray(A), target.xp.float16)
        got = to_numpy(inverse_sqrt(half, method="newton_schulz", steps=12, check=False)).astype(np.float64)
        # Products and iteration in float16 (unit roundoff 4.9e-4), kappa ~ 1e3: measured 6.0e-4 (torch) and
        # 1.3e-3 (NumPy, JAX) from float64's root; the overflow gave 1.0 (a zero or non-finite root).
        assert np.all(np.isfinite(got)), target.id
        assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-2, target.id


def test_newton_schulz_polar_of_half_precision_matrices_up_to_the_largest_number() -> None:
    """float16 and bfloat16 matrices whose largest entry is the dtype's largest number: ``log2`` of it rounds
    up (float16 16, bfloat16 128), so the scale was that power of two, outside the range (infinite), and the
    polar factor not finite, on NumPy, torch and JAX alike (measured before the cap of 2026-12-01). The scale is at
    most 2^-log2(smallest normal) now (float16 2^14, bfloat16 2^126): the polar factor is that of the matrix
    divided by 2^8, bit for bit (the scaling is exact)."""
    X = np.random.default_rng(14).standard_normal((4, 6))
    X = X / np.abs(X).max()
    checked = 0
    for target in (t for t in targets(dtypes=["float32"]) if t.available):
        for name in ("float16", "bfloat16"):
            half = getattr(target.xp, name, None)
            if half is None:  # NumPy and array-api-strict have no bfloat16
                continue
            big = target.xp.astype(target.asarray(X), half) * float(target.xp.finfo(half).max)
            assert float(target.xp.max(target.xp.abs(big))) == float(target.xp.finfo(half).max), target.id
            got = to_numpy(target.xp.astype(polar(big), target.xp.float32))
            want = to_numpy(target.xp.astype(polar(big / 2.0**8), target.xp.float32))
            assert np.all(np.isfinite(got)) and np.array_equal(got, want), (target.id, name)
            checked += 1
    assert checked >= 3  # NumPy's float16 and torch's two at least (the test extra installs torch)


# --- inverse_sqrt ---------------------------------------------------------------------------------

INV_SQRT_KAPPAS = (1.0, 1e2, 1e4, 1e6, 1e8)
INV_SQRT_D = 16


def spd_batch(kappa: float, seed: int = 0) -> np.ndarray:
    """Four 16 x 16 SPD matrices, eigenvalues geometric from 1 to 1/kappa, random eigenvectors."""
    rng = np.random.default_rng(seed)
    w = np.geomspace(1.0, 1.0 / kappa, INV_SQRT_D) * np.ones((4, 1))
    A, _ = spd_with_eigenvalues(rng, w)
    return A


def kappa_frobenius(A: np.ndarray) -> np.ndarray:
    """kappa' = ||A||_F / lambda_min, the quantity the Newton–Schulz step count depends on."""
    return np.linalg.norm(A, axis=(-2, -1)) / np.linalg.eigvalsh(A)[..., 0]


def skip_unrepresentable(target: Target, kappa: float) -> None:
    if target.dtype == "float32" and kappa > 1e6:
        pytest.skip(
            "kappa = 1e8 is not representable in float32: eigenvalues below eps_32 * lambda_max = 1.2e-7 "
            "do not survive rounding A to float32 (both methods return errors of 10% or more; see docs/linalg.md)"
        )


# The inverse square root's relative condition number is about kappa/2, so every error below is
# a few eps plus C * eps * kappa' (kappa' = ||A||_F / lambda_min). Measured over six seeds on
# every backend (docs/scripts/linalg_accuracy.py has the per-kappa values):
#   at kappa = 1 (kappa' = 4), relative errors NS vs eigh, NS and eigh vs the NumPy float64
#   reference, and ||X A X - I||_F / sqrt(d): at most 8.6 eps (eigh XAX, torch float64);
#   at kappa >= 1e2, the same divided by eps * kappa': at most 0.27 (eigh XAX, torch float32;
#   NS vs eigh 0.25, NS vs reference 0.22 float64 / 0.07 float32).
# Tolerance eps * (100 + 3 kappa'): eleven times both. In float32 at kappa = 1e6 this is 0.39:
# eps_32 * kappa' = 0.13 there, and both methods keep only about two digits (docs/linalg.md).
def inv_sqrt_tolerance(dtype: str, kappa_f: float) -> float:
    return EPS[dtype] * (100 + 3 * kappa_f)


# ||X - X^T||_F / ||X||_F: measured at most 0.42 eps at kappa = 1 and 0.051 eps * kappa' above
# (Newton–Schulz; eigh 0.004); the hypothesis spectra below reach 0.76 eps and 0.006 eps * kappa'.
# eps * (10 + 0.5 kappa') is about ten times the worst.
def symmetry_tolerance(dtype: str, kappa_f: float) -> float:
    return EPS[dtype] * (10 + 0.5 * kappa_f)


def scalar_inverse_sqrt_steps(kappa_f: float, name: str, tol: Decimal = Decimal(2) ** -52) -> int:
    """Steps until both ends of the spectrum of A / c reach 1 within ``tol`` (50-digit decimals).

    An eigenvalue x of A / c, c = safety^2 ||A||_F, maps as x <- x (a + b x + c x^2)^2 under the
    published triples; the ends are x = 1 / (safety^2 kappa') and at most 1 / safety^2.
    """
    triples, safety = PAPER_SCHEDULES[name]
    with localcontext() as ctx:
        ctx.prec = 50
        s2 = Decimal(safety) ** 2
        ends, k = [1 / (s2 * Decimal(kappa_f)), 1 / s2], 0
        while any(abs(1 - x) > tol for x in ends):
            a, b, c = (Decimal(v) for v in triple_at(triples, k))
            ends = [x * (a + b * x + c * x * x) ** 2 for x in ends]
            k += 1
        return k


INV_SQRT_SCHEDULES = ("polar_express", "cubic")


@pytest.mark.parametrize("coefficients", INV_SQRT_SCHEDULES)
@pytest.mark.parametrize("kappa", INV_SQRT_KAPPAS)
def test_inverse_sqrt_newton_schulz_matches_eigh(target: Target, kappa: float, coefficients: str) -> None:
    """Each schedule with its default step count (enough up to kappa' = 1e6; beyond, the count the
    scalar map asks for) is as accurate as eigh, against the float64 reference."""
    skip_unrepresentable(target, kappa)
    A64 = spd_batch(kappa)
    A_r = rounded(A64, target)  # the input as the backend stores it
    reference = inverse_sqrt_reference(A_r)
    kf = float(np.max(kappa_frobenius(A_r)))
    A = target.asarray(A64)
    steps = None if kf <= 1e6 else scalar_inverse_sqrt_steps(kf, coefficients)
    # check=False: float32 at kappa = 1e6 is below the input checks' cut d eps (docs/linalg.md,
    # "Input checks"); this test measures what both methods return there.
    ns = to_numpy(inverse_sqrt(A, method="newton_schulz", coefficients=coefficients, steps=steps, check=False))
    eig = to_numpy(inverse_sqrt(A, method="eigh", check=False))
    tol = inv_sqrt_tolerance(target.dtype, kf)
    assert np.max(rel_err(ns, eig)) <= tol, f"NS vs eigh {np.max(rel_err(ns, eig)):.2e} > {tol:.1e} (kappa' {kf:.1e})"
    assert np.max(rel_err(ns, reference)) <= tol
    assert np.max(rel_err(eig, reference)) <= tol
    identity = np.eye(INV_SQRT_D)
    for X in (ns, eig):
        xax = np.linalg.norm(X @ A_r @ X - identity, axis=(-2, -1)) / math.sqrt(INV_SQRT_D)
        assert np.max(xax) <= tol, f"||XAX - I|| = {np.max(xax):.2e} > {tol:.1e}"
        asym = np.linalg.norm(X - np.swapaxes(X, -1, -2), axis=(-2, -1)) / np.linalg.norm(X, axis=(-2, -1))
        assert np.max(asym) <= symmetry_tolerance(target.dtype, kf)


@pytest.mark.parametrize("coefficients", INV_SQRT_SCHEDULES)
@pytest.mark.parametrize("kappa", INV_SQRT_KAPPAS[1:])
def test_inverse_sqrt_newton_schulz_step_count_follows_the_scalar_map(
    target64: Target, kappa: float, coefficients: str
) -> None:
    """The scalar count suffices on matrices; two steps fewer do not."""
    A64 = spd_batch(kappa)
    A = target64.asarray(A64)
    reference = inverse_sqrt_reference(A64)
    kf = float(np.max(kappa_frobenius(A64)))
    # Cubic: 12, 17, 23, 28 steps for kappa' = 1.5e2, 1.2e4, 1.1e6, 1.05e8; Polar Express 9, 9, 10, 12.
    steps = scalar_inverse_sqrt_steps(kf, coefficients)
    tol = inv_sqrt_tolerance("float64", kf)

    def error(k: int) -> float:
        return float(np.max(rel_err(to_numpy(inverse_sqrt(A, method="newton_schulz", coefficients=coefficients, steps=k)), reference)))

    assert error(steps) <= tol, f"{steps} steps: error {error(steps):.1e} > {tol:.1e}"
    # Measured with two steps fewer: at least 73 times eps * (1 + kappa') (cubic; Polar Express 2e6).
    assert error(steps - 2) > tol, f"{steps - 2} steps already reach {error(steps - 2):.1e}"


def test_inverse_sqrt_default_steps_cover_kappa_1e6() -> None:
    """The defaults are the scalar counts for kappa' = 1e6, and surplus steps do not hurt."""
    for name in INV_SQRT_SCHEDULES:
        assert INVERSE_SQRT_STEPS[name] == scalar_inverse_sqrt_steps(1e6, name)
        assert inverse_sqrt_steps(name) == INVERSE_SQRT_STEPS[name]
    # Triples given as an iterator count as the same list (the count was 0: validating read them all).
    triples = [(1.5, -0.5, 0.0)] * 4
    assert inverse_sqrt_steps(iter(triples)) == inverse_sqrt_steps(map(tuple, triples)) == inverse_sqrt_steps(triples) == 4
    A = spd_batch(1e4)
    reference = inverse_sqrt_reference(A)
    kf = float(np.max(kappa_frobenius(A)))
    for steps in (12, 20):
        got = inverse_sqrt(A, method="newton_schulz", steps=steps)
        assert np.max(rel_err(got, reference)) <= inv_sqrt_tolerance("float64", kf)


def test_inverse_sqrt_steps_validation() -> None:
    assert inverse_sqrt_steps([CLASSICAL_CUBIC] * 3) == 3  # an explicit sequence: its length
    assert inverse_sqrt_steps("cubic", 5) == 5
    with pytest.raises(ValueError, match="does not converge"):
        inverse_sqrt_steps("muon")
    with pytest.raises(ValueError, match="does not converge"):
        inverse_sqrt(np.eye(3), method="newton_schulz", coefficients="muon")
    with pytest.raises(ValueError, match="unknown Newton–Schulz coefficients"):
        inverse_sqrt_steps("newton")


def test_inverse_sqrt_scalar_step_counts_in_docstring() -> None:
    """The docstring's table of steps to float64 precision, recomputed from the typed-in schedules."""
    doc = inverse_sqrt.__doc__ or ""
    header = re.search(r"kappa'\s+((?:1e\d\s+)+)", doc)
    assert header, "no kappa' row in the docstring table"
    kappas = header.group(1).split()
    rows = {name: re.search(rf"``\"{name}\"``\s+((?:\d+\s+)+)", doc) for name in INV_SQRT_SCHEDULES}
    for name, row in rows.items():
        assert row, f"no row for {name}"
        claimed = [int(v) for v in row.group(1).split()]
        assert claimed == [scalar_inverse_sqrt_steps(float(k), name) for k in kappas], name


@pytest.mark.parametrize("method", ["eigh", "newton_schulz"])
def test_inverse_sqrt_batched_equals_per_matrix(target: Target, method: str) -> None:
    rng = np.random.default_rng(11)
    w = np.geomspace(1.0, 1e-2, 6) * rng.uniform(0.5, 2.0, size=(2, 3, 1))
    A64, _ = spd_with_eigenvalues(rng, w)
    got = to_numpy(inverse_sqrt(target.asarray(A64), method=method))
    assert got.shape == (2, 3, 6, 6)
    reference = inverse_sqrt_reference(rounded(A64, target))
    kf = float(np.max(kappa_frobenius(A64)))
    assert np.max(rel_err(got, reference)) <= inv_sqrt_tolerance(target.dtype, kf)
    scale = np.max(np.abs(got))
    for index in np.ndindex(2, 3):
        single = to_numpy(inverse_sqrt(target.asarray(A64[index]), method=method))
        np.testing.assert_allclose(got[index], single, rtol=0, atol=batch_tolerance(target.dtype) * scale)


# --- sym, trace_normalize, whiten -----------------------------------------------------------------

# sym, trace_normalize, whiten against NumPy float64 on the same rounded inputs, max |error|
# relative to the scale of the result: measured at most 1.03 eps (trace_normalize, float64;
# sym 0.2 eps, whiten 0.66 eps over 20 seeds, trace = d to 1 eps); 10 eps.
def elementwise_tolerance(dtype: str) -> float:
    return 10 * EPS[dtype]


def test_sym(target: Target) -> None:
    rng = np.random.default_rng(5)
    X = rng.standard_normal((2, 3, 5, 5))
    got = to_numpy(sym(target.asarray(X)))
    X_r = rounded(X, target)
    np.testing.assert_allclose(got, (X_r + np.swapaxes(X_r, -1, -2)) / 2, rtol=0, atol=elementwise_tolerance(target.dtype) * np.abs(X).max())
    assert np.array_equal(got, np.swapaxes(got, -1, -2))  # (x + y) / 2 == (y + x) / 2 exactly
    assert np.array_equal(to_numpy(sym(target.asarray(got))), got)  # idempotent, exactly
    single = to_numpy(sym(target.asarray(X[1, 2])))
    assert single.shape == (5, 5) and np.array_equal(single, got[1, 2])


def test_trace_normalize(target: Target) -> None:
    rng = np.random.default_rng(6)
    d = 5
    w = rng.uniform(0.1, 10.0, size=(2, 3, d)) * 10.0 ** rng.uniform(-3, 3, size=(2, 3, 1))  # traces 1e-3 .. 1e4
    A64, _ = spd_with_eigenvalues(rng, w)
    got = to_numpy(trace_normalize(target.asarray(A64)))
    tol = elementwise_tolerance(target.dtype)
    np.testing.assert_allclose(np.trace(got, axis1=-2, axis2=-1), d, rtol=tol)
    A_r = rounded(A64, target)
    expected = (d / np.trace(A_r, axis1=-2, axis2=-1))[..., None, None] * A_r
    np.testing.assert_allclose(got, expected, rtol=0, atol=tol * np.abs(expected).max())
    # Unbatched input, and invariance to the scale of A (the (P, Q) ~ (cP, Q/c) ambiguity).
    single = to_numpy(trace_normalize(target.asarray(A64[0, 0])))
    assert single.shape == (d, d)
    np.testing.assert_allclose(single, got[0, 0], rtol=0, atol=tol * np.abs(single).max())
    scaled = to_numpy(trace_normalize(target.asarray(A64[0, 0] * 1234.5)))
    np.testing.assert_allclose(scaled, single, rtol=0, atol=tol * np.abs(single).max())


def test_whiten(target: Target) -> None:
    rng = np.random.default_rng(8)
    m, n = 4, 7
    X = rng.standard_normal((2, 3, m, n))
    # General (non-symmetric) factors, so a transposed or swapped factor cannot pass.
    left = rng.standard_normal((2, 3, m, m))
    right = rng.standard_normal((2, 3, n, n))
    got = to_numpy(whiten(target.asarray(X), target.asarray(left), target.asarray(right)))
    X_r, left_r, right_r = rounded(X, target), rounded(left, target), rounded(right, target)
    expected = left_r @ X_r @ right_r
    assert got.shape == (2, 3, m, n)
    # Rounding of a product chain scales with |left| |X| |right|; errors are relative to its largest entry.
    bound = np.max(np.abs(left_r) @ np.abs(X_r) @ np.abs(right_r))
    np.testing.assert_allclose(got, expected, rtol=0, atol=elementwise_tolerance(target.dtype) * bound)
    # Unbatched left and right broadcast over the batch of X (matmul broadcasting).
    shared = to_numpy(whiten(target.asarray(X), target.asarray(left[0, 0]), target.asarray(right[0, 0])))
    np.testing.assert_allclose(shared, left_r[0, 0] @ X_r @ right_r[0, 0], rtol=0, atol=elementwise_tolerance(target.dtype) * bound)
    # Whitening with inverse roots and un-whitening with roots is the identity (Algorithm 1 lines 6 and 8).
    P, _ = spd_with_eigenvalues(rng, rng.uniform(0.1, 3.0, size=m))
    P_is = inverse_sqrt_reference(P)
    P_s = np.linalg.inv(P_is)
    back = to_numpy(whiten(whiten(target.asarray(X[0, 0]), target.asarray(P_is), target.asarray(np.eye(n))), target.asarray(P_s), target.asarray(np.eye(n))))
    # Two products with float64-accurate factors: measured 2.1 eps relative to max |X| (20 seeds); 20 eps.
    np.testing.assert_allclose(back, X_r[0, 0], rtol=0, atol=20 * EPS[target.dtype] * np.abs(X).max())


# --- Functional core: no mutation, namespace and dtype follow the input -----------------------------


def test_inputs_unchanged_and_type_preserved(target: Target) -> None:
    rng = np.random.default_rng(9)
    X64 = rng.standard_normal((2, 4, 6))
    A64, _ = spd_with_eigenvalues(rng, rng.uniform(0.5, 2.0, size=(2, 4)))
    X, A = target.asarray(X64), target.asarray(A64)
    before_X, before_A = to_numpy(X).copy(), to_numpy(A).copy()
    calls = {
        "polar newton_schulz": lambda: polar(X),
        "polar svd": lambda: polar(X, method="svd"),
        "inverse_sqrt eigh": lambda: inverse_sqrt(A),
        "inverse_sqrt newton_schulz": lambda: inverse_sqrt(A, method="newton_schulz", steps=5),
        "sym": lambda: sym(A),
        "trace_normalize": lambda: trace_normalize(A),
        "whiten": lambda: whiten(X, A, target.asarray(np.eye(6))),
    }
    for name, call in calls.items():
        out = call()
        assert type(out) is type(X), name
        assert out.dtype == X.dtype, name
    assert np.array_equal(to_numpy(X), before_X) and np.array_equal(to_numpy(A), before_A)


# --- Errors ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["int32", "int64", "bool", "complex64"])
def test_non_real_floating_dtypes_raise_type_error(target: Target, kind: str) -> None:
    xp = target.xp
    values = [[True, False], [False, True]] if kind == "bool" else [[1, 0], [0, 1]]
    bad = xp.asarray(values, dtype=getattr(xp, kind))
    with pytest.raises(TypeError, match=r"^X must have a real floating dtype, got .*" + kind[:4]):
        polar(bad)
    with pytest.raises(TypeError, match=r"^X must have a real floating dtype"):
        polar(bad, method="svd")
    with pytest.raises(TypeError, match=r"^A must have a real floating dtype, got .*" + kind[:4]):
        inverse_sqrt(bad)
    with pytest.raises(TypeError, match=r"^A must have a real floating dtype"):
        inverse_sqrt(bad, method="newton_schulz")


def test_shape_errors(target: Target) -> None:
    vector = target.asarray(np.ones(3))
    with pytest.raises(ValueError, match=r"^X must have shape \(\.\.\., m, n\) with at least 2 dimensions, got shape \(3,\)"):
        polar(vector)
    with pytest.raises(ValueError, match=r"^A must have shape \(\.\.\., m, n\) with at least 2 dimensions, got shape \(3,\)"):
        inverse_sqrt(vector)
    with pytest.raises(ValueError, match=r"^A must be square in its last two dimensions, got shape \(2, 3, 4\)"):
        inverse_sqrt(target.asarray(np.ones((2, 3, 4))))
    with pytest.raises(ValueError, match=r"^A must be square"):
        inverse_sqrt(target.asarray(np.ones((3, 4))), method="newton_schulz")


def test_whiten_checks_each_argument(target: Target) -> None:
    X, left, right = target.asarray(np.ones((3, 4))), target.asarray(np.eye(3)), target.asarray(np.eye(4))
    xp = target.xp
    integer = xp.asarray([[1, 0], [0, 1]], dtype=xp.int32)
    for position, name in enumerate(("X", "left", "right")):
        args = [X, left, right]
        args[position] = integer
        with pytest.raises(TypeError, match=rf"^{name} must have a real floating dtype"):
            whiten(*args)
        args[position] = target.asarray(np.ones(3))
        with pytest.raises(ValueError, match=rf"^{name} must have shape \(\.\.\., m, n\) with at least 2 dimensions"):
            whiten(*args)


@pytest.mark.parametrize(
    "X_shape, left_shape, right_shape",
    [
        ((6, 3), (6, 6), (6, 6)),  # right is the other side's factor
        ((6, 3), (3, 3), (3, 3)),  # left is
        ((6, 3), (3, 3), (6, 6)),  # both swapped
        ((2, 6, 3), (4, 6, 6), (3, 3)),  # batches 2 and 4 do not broadcast
    ],
)
def test_whiten_refuses_factors_that_do_not_fit_before_any_product(target: Target, X_shape, left_shape, right_shape) -> None:
    """A factor of the wrong side reached ``@``: each library raised its own error (NumPy a ValueError, torch a
    RuntimeError, JAX a TypeError), none naming an argument (a user's hunt, 2026-12-05). One ValueError with
    the three shapes now, on every backend."""
    X, left, right = (target.asarray(np.ones(shape)) for shape in (X_shape, left_shape, right_shape))
    shapes = rf"X \({', '.join(map(str, X_shape))}\), left \({', '.join(map(str, left_shape))}\)"
    with pytest.raises(ValueError, match=rf"^whiten: left @ X @ right needs .* got shapes {shapes}"):
        whiten(X, left, right)
    # What fits still runs: non-square factors (a two-sided product, not only a whitening) and batch 1.
    fits = whiten(target.asarray(np.ones((1, 6, 3))), target.asarray(np.ones((2, 4, 6))), target.asarray(np.ones((3, 5))))
    assert tuple(fits.shape) == (2, 4, 5)


def test_unknown_names_raise_value_error(target: Target) -> None:
    X = target.asarray(np.eye(3))
    with pytest.raises(ValueError, match=r"unknown polar method 'qr': use 'newton_schulz' or 'svd'"):
        polar(X, method="qr")
    with pytest.raises(ValueError, match=r"unknown inverse_sqrt method 'cholesky': use 'eigh' or 'newton_schulz'"):
        inverse_sqrt(X, method="cholesky")
    with pytest.raises(ValueError, match=r"unknown Newton.Schulz coefficients 'jordan'"):
        polar(X, coefficients="jordan")


@pytest.mark.parametrize(
    "coefficients,message",
    [([], "non-empty sequence"), ([(1.0, 2.0)], "non-empty sequence"), ([(1.5, -0.5, 0.0, 1.0)], "non-empty sequence"),
     ([(1.5, float("nan"), 0.0)], "must be finite"), ([(float("inf"), 0.0, 0.0)], "must be finite")],
)
def test_malformed_explicit_coefficients_raise_value_error(coefficients, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        polar(np.eye(3), coefficients=coefficients)
    with pytest.raises(ValueError, match=message):
        newton_schulz_schedule(coefficients, 3)


@pytest.mark.parametrize("steps", [0, -1, 2.5, 5.0, True, "5", None])
def test_bad_steps_raise_value_error(target: Target, steps) -> None:
    X = target.asarray(np.eye(3))
    message = r"^steps must be a positive integer, got " + re.escape(repr(steps))
    with pytest.raises(ValueError, match=message):
        polar(X, steps=steps)
    if steps is None:  # inverse_sqrt's steps=None is the schedule's default count
        assert inverse_sqrt(X, method="newton_schulz", steps=None).shape == (3, 3)
    else:
        with pytest.raises(ValueError, match=message):
            inverse_sqrt(X, method="newton_schulz", steps=steps)
    with pytest.raises(ValueError, match=message):
        newton_schulz_schedule("muon", steps)


# --- Properties (NumPy float64) ---------------------------------------------------------------------


@settings(max_examples=30, deadline=None)
@given(
    log_w=st.lists(st.floats(-6.0, 0.0), min_size=1, max_size=8),
    log_scale=st.floats(-3.0, 3.0),
    seed=st.integers(0, 2**32 - 1),
)
def test_property_inverse_sqrt_eigh_whitens(log_w: list[float], log_scale: float, seed: int) -> None:
    """Random SPD A (condition up to 1e6, any scale): X = inverse_sqrt(A) gives X A X = I, X = X^T."""
    w = 10.0 ** (np.array(log_w) + log_scale)
    A, _ = spd_with_eigenvalues(np.random.default_rng(seed), w)
    X = inverse_sqrt(A)
    d = A.shape[-1]
    kf = float(kappa_frobenius(A))
    xax = np.linalg.norm(X @ A @ X - np.eye(d)) / math.sqrt(d)
    # Adversarial spectra (several eigenvalues at lambda_min) reach 1.03 eps * kappa' over 4000
    # examples, four times the geometric spectra above: ten times that slope, same constant.
    assert xax <= EPS["float64"] * (100 + 10 * kf), (xax, kf)
    assert np.linalg.norm(X - X.T) <= symmetry_tolerance("float64", kf) * np.linalg.norm(X)
    assert np.all(np.linalg.eigvalsh((X + X.T) / 2) > 0)


# Measured over 3000 examples: ||Y Y^T Y - Y||_F 4.2e-15, ||Y (Y^T X) - X||_F / ||X||_F 2.2e-15,
# ||H - H^T||_F / ||X||_F 9.0e-15 and -min eig(H) / ||X||_F 3.4e-16, rank of Y = rank of X in all;
# 1e-13 is 11 times the worst.
POLAR_PROPERTY_TOLERANCE = 1e-13


@settings(max_examples=30, deadline=None)
@given(
    X=st.tuples(st.integers(1, 8), st.integers(1, 8)).flatmap(
        lambda shape: hnp.arrays(np.float64, shape, elements=st.floats(-10.0, 10.0, allow_subnormal=False))
    )
)
def test_property_polar_svd_is_polar_decomposition(X: np.ndarray) -> None:
    """Y = polar(X, "svd") is a partial isometry of X's rank, and X = Y H with H = Y^T X symmetric PSD.

    Hypothesis finds rank-deficient X (zeros, repeated rows) at once: Y then has rank r, not min(m, n).
    """
    Y = polar(X, method="svd")
    assert Y.shape == X.shape
    assert np.linalg.norm(Y @ Y.T @ Y - Y) <= POLAR_PROPERTY_TOLERANCE
    # rank: NumPy's own rank rule (s > max(m, n) eps s_max), computed here from X, not from the code.
    assert np.linalg.matrix_rank(Y, tol=0.5) == np.linalg.matrix_rank(X)
    # Checks on X / max|X| (same polar factor): ||X||_F itself underflows for entries near 1e-160.
    biggest = float(np.max(np.abs(X)))
    Xs = X / biggest if biggest > 0 else X
    norm = max(float(np.linalg.norm(Xs)), 1.0)
    H = Y.T @ Xs
    assert np.linalg.norm(Y @ H - Xs) <= POLAR_PROPERTY_TOLERANCE * norm
    assert np.linalg.norm(H - H.T) <= POLAR_PROPERTY_TOLERANCE * norm
    assert np.min(np.linalg.eigvalsh((H + H.T) / 2)) >= -POLAR_PROPERTY_TOLERANCE * norm
