"""The public harness: ``fismo_core.testing.check_backends``, ``targets`` filters,
``full_float32_matmuls``, the pytest plugin's fixtures, and the errata claims
of ``docs/verification.md`` (the paper's Theorem 1 against Algorithm 1)."""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy as np
import pytest
from array_api_compat import array_namespace, is_numpy_namespace

from fismo_core import FISMO
from fismo_core.testing import (
    TOLERANCES,
    Report,
    Target,
    check_backends,
    full_float32_matmuls,
    targets,
    to_numpy,
)
from fismo_core.verify import gaussian_streams, run_stream

pytestmark = pytest.mark.usefixtures("single_threaded_torch")

AVAILABLE = [t for t in targets() if t.available]
RNG = np.random.default_rng(0)
X = RNG.standard_normal((3, 8, 5))
Y = RNG.standard_normal((3, 5, 4))


def gram(x: Any) -> Any:
    """An array-API function: the scaled Gram matrix of each matrix in a batch."""
    xp = array_namespace(x)
    return x @ xp.matrix_transpose(x) / x.shape[-1]


def test_a_correct_function_passes_everywhere() -> None:
    report = check_backends(gram, X)
    assert isinstance(report, Report) and report.ok
    assert [r.target.id for r in report] == [t.id for t in targets()]
    for r in report:
        if not r.target.available:
            assert r.error is None and r.passed is None
            continue
        assert r.passed and r.where is None and r.tolerance == TOLERANCES[r.target.dtype]
        assert list(r.details) == ["output"]
        if r.target.dtype == "float32":
            assert 1e-9 < r.error < 1e-6  # float32 rounding of one product, not a copy of the reference
        elif r.target.backend in ("numpy", "array_api_strict"):
            assert r.error == 0.0  # the same LAPACK/BLAS as the reference
    table = report.table().splitlines()
    assert table[0].split()[:3] == ["backend", "device", "dtype"] and "steps" not in table[0]
    assert len(table) == 2 + len(report)
    assert report.summary() == f"{len(AVAILABLE)} passed, 0 failed, {len(report) - len(AVAILABLE)} skipped"
    assert str(report).endswith(report.summary())


def _off_on_torch(x: Any) -> Any:
    """Correct on every backend but torch, where it forgets to divide one output."""
    xp = array_namespace(x)
    g = x @ xp.matrix_transpose(x)
    scale = 1.0 if type(x).__module__.startswith("torch") else 1.0 / x.shape[-1]
    return {"gram": g / x.shape[-1], "scaled": g * scale, "trace": xp.sum(g, axis=(-2, -1))}


def test_a_backend_dependent_bug_fails_and_names_the_output() -> None:
    report = check_backends(_off_on_torch, X)
    assert not report.ok
    failed = {r.target.id for r in report.failed}
    assert failed == {t.id for t in AVAILABLE if t.backend == "torch"}
    for r in report.failed:
        assert r.where == "output['scaled']"
        assert r.details["output['gram']"] <= r.tolerance < r.details["output['scaled']"]
        assert f"FAIL at output['scaled']" in report.table()
    explained = report.explain()
    for r in report.failed:
        assert f"{r.target.id}: FAIL at output['scaled']" in explained
    assert explained.count("> tolerance") == len(report.failed)


class Pair(NamedTuple):
    left: Any
    right: Any


def test_nested_outputs_are_named_in_order() -> None:
    def f(x: Any, y: Any) -> Any:
        return Pair(x @ y, [x, {"sum": x + 1.0}])

    report = check_backends(f, X, Y, targets=[t for t in AVAILABLE if t.backend == "numpy"])
    assert report.ok
    assert list(report[0].details) == ["output.left", "output.right[0]", "output.right[1]['sum']"]


def test_non_array_arguments_pass_unchanged() -> None:
    seen = []

    def f(x: Any, axis: int, *, scale: float) -> Any:
        seen.append((axis, scale))
        xp = array_namespace(x)
        return xp.sum(x, axis=axis) * scale

    report = check_backends(f, X, 1, scale=2.0, targets=[t for t in AVAILABLE if t.dtype == "float64"])
    assert report.ok and set(seen) == {(1, 2.0)}


def test_a_raising_target_fails_its_row_and_a_raising_reference_propagates() -> None:
    def f(x: Any) -> Any:
        xp = array_namespace(x)
        if x.dtype == xp.float32:
            raise RuntimeError("no float32 here")
        return x * 2

    report = check_backends(f, X, targets=[t for t in AVAILABLE if t.backend == "numpy"])
    r32 = next(r for r in report if r.target.dtype == "float32")
    assert r32.passed is False and r32.error == math.inf and r32.exception == "RuntimeError: no float32 here"
    assert "FAIL (RuntimeError: no float32 here)" in report.table()

    def broken(x: Any) -> Any:
        raise ValueError("reference fails")

    with pytest.raises(ValueError, match="reference fails"):
        check_backends(broken, X)


def test_shape_mismatch_fails() -> None:
    def f(x: Any) -> Any:
        xp = array_namespace(x)
        return x if is_numpy_namespace(xp) else x[..., :-1]

    report = check_backends(f, X, targets=[t for t in AVAILABLE if t.backend in ("numpy", "torch")])
    assert all(r.passed for r in report if r.target.backend == "numpy")
    assert all(r.passed is False and "shape" in r.exception for r in report if r.target.backend == "torch")


def test_tolerances_are_per_dtype_and_overridable() -> None:
    def noisy(x: Any) -> Any:  # float32 rounding of x: relative error ~ 3e-8
        return x * 1.0

    numpy_targets = [t for t in AVAILABLE if t.backend == "numpy"]
    assert check_backends(noisy, X, targets=numpy_targets).ok
    strict = check_backends(noisy, X, targets=numpy_targets, tolerances={"float64": 0.0, "float32": 1e-9})
    assert [r.passed for r in strict] == [True, False]
    with pytest.raises(ValueError, match="no tolerance for dtype 'float32'"):
        check_backends(noisy, X, targets=numpy_targets, tolerances={"float64": 1e-10})


def test_targets_filters() -> None:
    assert {t.backend for t in targets(backends=["numpy"])} == {"numpy"}
    assert {t.dtype for t in targets(dtypes=["float64"])} == {"float64"}
    assert [t.id for t in targets(backends=["torch"], dtypes=["float32"])] == ["torch-cpu-float32", "torch-cuda-float32"]
    with pytest.raises(ValueError, match="unknown backend 'tensorflow'"):
        targets(backends=["tensorflow"])
    with pytest.raises(ValueError, match="unknown dtypes"):
        targets(dtypes=["float16"])


def test_full_float32_matmuls_pins_and_restores() -> None:
    torch = pytest.importorskip("torch")
    before = (torch.backends.cuda.matmul.allow_tf32, torch.get_float32_matmul_precision())
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.set_float32_matmul_precision("high")
    try:
        with full_float32_matmuls():
            assert torch.backends.cuda.matmul.allow_tf32 is False
            assert torch.get_float32_matmul_precision() == "highest"
        assert torch.backends.cuda.matmul.allow_tf32 is True
        assert torch.get_float32_matmul_precision() == "high"
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before[0]
        torch.set_float32_matmul_precision(before[1])


def test_check_backends_runs_with_tf32_off() -> None:
    torch = pytest.importorskip("torch")
    seen = []

    def f(x: Any) -> Any:
        seen.append(torch.get_float32_matmul_precision())
        return x

    torch.set_float32_matmul_precision("medium")
    try:
        check_backends(f, X, targets=[t for t in AVAILABLE if t.backend == "numpy"])
    finally:
        torch.set_float32_matmul_precision("highest")
    assert set(seen) == {"highest"}


# ------------------------------------------------------------- the plugin
def test_plugin_fixture_is_every_target(array_target: Target, request: pytest.FixtureRequest) -> None:
    assert request.node.callspec.id == array_target.id
    assert array_target.available  # unavailable ones were skipped with their reason
    x = array_target.asarray(X)
    assert to_numpy(gram(x)).shape == (3, 8, 8)


@pytest.mark.array_targets(backends=["numpy"], dtypes=["float32"])
def test_plugin_marker_narrows(array_target: Target, array_xp: Any) -> None:
    assert array_target.id == "numpy-cpu-float32"
    assert array_xp is array_target.xp


def test_plugin_float64_fixture(array_target64: Target) -> None:
    assert array_target64.dtype == "float64" and array_target64.tolerance == TOLERANCES["float64"]


# The plugin module is already imported by this session's conftest: pytest notes it cannot rewrite its asserts.
@pytest.mark.filterwarnings("ignore::pytest.PytestAssertRewriteWarning")
def test_plugin_collects_the_whole_matrix(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        import pytest

        def test_each(array_target):
            assert array_target.available

        @pytest.mark.array_targets(dtypes=["float64"])
        def test_some(array_target):
            assert array_target.dtype == "float64"
        """
    )
    result = pytester.runpytest_inprocess("-p", "fismo_core.pytest_plugin", "-q")
    n, n64 = len(targets()), len(targets(dtypes=["float64"]))
    avail, avail64 = len(AVAILABLE), len([t for t in AVAILABLE if t.dtype == "float64"])
    result.assert_outcomes(passed=avail + avail64, skipped=(n - avail) + (n64 - avail64))


# ------------------------------------------------------- errata (docs/verification.md)
def _objective(P: Any, Q: Any, grads: Any, mu: float) -> float:
    """The paper's J(P, Q) (eq. best_kron_obj_matrix), expectation as the mean over ``grads``."""
    m, n = P.shape[0], Q.shape[0]
    Pi, Qi = np.linalg.inv(P), np.linalg.inv(Q)
    data = np.mean([np.trace(Pi @ G @ Qi @ G.T) for G in grads])
    return float(data + mu * np.trace(Pi) * np.trace(Qi) + n * np.linalg.slogdet(P)[1] + m * np.linalg.slogdet(Q)[1])


def test_erratum_objective_is_not_convex_in_P_but_is_in_its_inverse() -> None:
    """Theorem 1's proof calls J strictly convex in P: the midpoint of P1 = 10 I and P2 = 100 I is a counterexample.
    In X = P^{-1} it is convex (a linear term plus -n log det X), so the minimiser is still unique."""
    m, n, mu = 4, 6, 1e-3
    grads = np.random.default_rng(0).standard_normal((8, m, n))
    Q = np.eye(n)
    P1, P2 = 10 * np.eye(m), 100 * np.eye(m)
    J = lambda P: _objective(P, Q, grads, mu)  # noqa: E731
    assert J((P1 + P2) / 2) > (J(P1) + J(P2)) / 2  # midpoint convexity fails in P
    rng = np.random.default_rng(1)
    for _ in range(20):  # ... and holds in P^{-1}, on random pairs of SPD matrices
        A, B = rng.standard_normal((2, m, m))
        X1, X2 = A @ A.T + 0.1 * np.eye(m), B @ B.T + 0.1 * np.eye(m)
        Jx = lambda X: J(np.linalg.inv(X))  # noqa: E731
        assert Jx((X1 + X2) / 2) <= (Jx(X1) + Jx(X2)) / 2 + 1e-9
    # The stationary point of Theorem 1 is the minimiser: random perturbations only increase J.
    P_star = np.mean([G @ G.T for G in grads], axis=0) / n + mu * np.trace(np.linalg.inv(Q)) / n * np.eye(m)
    for _ in range(20):
        E = rng.standard_normal((m, m)) * 1e-2
        assert J(P_star + E @ E.T) > J(P_star)


def test_erratum_algorithm_damping_is_mu_times_identity_not_theorem_1s() -> None:
    """Algorithm 1 damps L_t with mu tr(P_{t-1})/m I = mu I (tr P = m after every step); Theorem 1's
    minimiser has mu tr(Q^{-1})/n I, which is larger whenever Q != I (tr Q = n, AM-HM)."""
    stream = gaussian_streams(50)[0]
    out = run_stream(FISMO(), stream, lambda a: np.asarray(a, dtype=np.float64))
    m, n = stream.shape[-2:]
    trace_P = np.trace(out["P"], axis1=-2, axis2=-1) / m
    assert np.allclose(trace_P, 1.0, rtol=0, atol=1e-12)  # Algorithm 1's factor: exactly 1 (up to rounding)
    theorem = np.trace(np.linalg.inv(out["Q"]), axis1=-2, axis2=-1) / n
    assert np.all(theorem >= 1.0 - 1e-12)
    assert np.max(theorem[-1]) > 1.5  # at step 50 Theorem 1 would damp P more than 1.5x as strongly
