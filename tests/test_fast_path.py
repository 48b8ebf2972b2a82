"""The matmul-only fast path against the exact path, along whole trajectories (issue #5).

Each shortcut is a named option; here each runs next to its exact twin on the same gradients
(``fismo_core.testing.reference_gradients``: anisotropic, so ``P`` and ``Q`` reach condition
numbers of about 100), and the difference is held to a tolerance per dtype:

* ``inv_root="newton_schulz"`` (Polar Express, 9 steps) against ``"eigh"``, 1,000 steps: the
  per-step error of the roots against ``eigh`` of the same ``P_t``, ``Q_t``; the difference of the
  two runs' ``P_t``, ``Q_t`` and directions; and no drift (the last 100 steps are no worse than
  steps 100-199);
* ``polar={"coefficients": "polar_express", "steps": 8}`` against ``polar="svd"``.

``docs/scripts/fast_path_accuracy.py`` measures the same quantities at 64 x 96 for the
documentation page "Performance". The amortisation ``InverseRootConfig(every=k)`` is not a
faithful shortcut; its semantics are tested in ``tests/test_amortisation.py`` and its effect on
the direction is measured on that page.
"""

from __future__ import annotations

import numpy as np
import pytest

from fismo_core import FISMO
from fismo_core.testing import reference_gradients, targets, to_numpy

STEPS = 1000

#: numpy and torch, float64 and float32: the backends whose fast path this checks at length.
FAST_PATH_TARGETS = [
    pytest.param(t, id=t.id, marks=[] if t.available else [pytest.mark.skip(reason=t.reason)])
    for t in targets()
    if t.backend in ("numpy", "torch") and t.device == "cpu"
]

# Measured over 1,000 steps at 16 x 24, 24 x 16 and 3 x 8 x 12 (condition numbers of P and Q
# 90 to 145), numpy and torch:
#   per-step root error against float64 eigh of the same P_t: at most 2.3e-14 (float64),
#   4.5e-7 (float32);
#   difference of the two runs' P_t and Q_t: 1.0e-14 and 2.7e-6; of the directions: 7.0e-14
#   and 2.6e-5 (torch float32, whose float32 eigh is itself that far from float64).
# Tolerances: ten times the worst (root: ~1100 eps_64, ~40 eps_32).
ROOT_TOLERANCE = {"float64": 2.5e-13, "float32": 5e-6}
STATE_TOLERANCE = {"float64": 1e-13, "float32": 3e-5}
DIRECTION_TOLERANCE = {"float64": 1e-12, "float32": 3e-4}


def rel(a: np.ndarray, b: np.ndarray) -> float:
    """max over the batch of ||a - b||_F / ||b||_F."""
    return float(np.max(np.linalg.norm(a - b, axis=(-2, -1)) / np.linalg.norm(b, axis=(-2, -1))))


def inverse_sqrt64(A: np.ndarray) -> np.ndarray:
    w, V = np.linalg.eigh(np.asarray(A, dtype=np.float64))
    return (V / np.sqrt(w)[..., None, :]) @ np.swapaxes(V, -1, -2)


def run_side_by_side(target, shape, steps: int, fast: FISMO, exact: FISMO):
    """Yield ``(fast_direction, fast_state, exact_direction, exact_state)`` per step, same gradients."""
    W0 = target.asarray(np.zeros(shape))
    s_fast, s_exact = fast.init(W0), exact.init(W0)
    for G64 in reference_gradients(shape, steps):
        G = target.asarray(G64)
        d_fast, s_fast = fast.direction(G, s_fast)
        d_exact, s_exact = exact.direction(G, s_exact)
        yield to_numpy(d_fast), s_fast, to_numpy(d_exact), s_exact


@pytest.mark.parametrize("shape", [(16, 24), (3, 8, 12)], ids=str)
@pytest.mark.parametrize("target", FAST_PATH_TARGETS)
def test_newton_schulz_roots_track_eigh_for_1000_steps(target, shape) -> None:
    fast = FISMO(inv_root="newton_schulz", nonfinite="propagate")
    exact = FISMO(nonfinite="propagate")
    roots, states, directions = [], [], []
    for d_fast, s_fast, d_exact, s_exact in run_side_by_side(target, shape, STEPS, fast, exact):
        P, Q = to_numpy(s_fast.P), to_numpy(s_fast.Q)
        roots.append(max(rel(to_numpy(s_fast.P_inv_sqrt), inverse_sqrt64(P)), rel(to_numpy(s_fast.Q_inv_sqrt), inverse_sqrt64(Q))))
        states.append(max(rel(P, to_numpy(s_exact.P)), rel(Q, to_numpy(s_exact.Q))))
        directions.append(rel(d_fast, d_exact))
    roots, states, directions = np.array(roots), np.array(states), np.array(directions)
    dtype = target.dtype
    assert roots.max() <= ROOT_TOLERANCE[dtype], f"root error {roots.max():.1e} at step {roots.argmax()}"
    assert states.max() <= STATE_TOLERANCE[dtype], f"P/Q difference {states.max():.1e} at step {states.argmax()}"
    assert directions.max() <= DIRECTION_TOLERANCE[dtype], f"direction difference {directions.max():.1e}"
    # No drift: no error measure grows between steps 100-199 (P and Q have left the identity)
    # and the last 100. Medians, so that one unlucky rounding does not decide; the measured
    # ratio of medians is at most 1.17 (roots, states and directions alike).
    for name, series in (("root", roots), ("P/Q", states), ("direction", directions)):
        early, late = np.median(series[100:200]), np.median(series[-100:])
        assert late <= 2 * early, f"{name} error grows: median {early:.1e} at steps 100-199, {late:.1e} at the end"


@pytest.mark.parametrize("shape", [(16, 24), (24, 16)], ids=str)
@pytest.mark.parametrize("target", FAST_PATH_TARGETS)
def test_polar_express_polar_tracks_svd(target, shape) -> None:
    """Polar Express (8 steps) in line 8 against the exact polar factor, 300 steps. Measured: at
    most 4.2e-15 to 4.4e-15 (float64) and 1.5e-6 to 1.9e-6 (float32; ranges over the CPU kernel sets)
    relative difference of the directions (the
    momentum's condition number stays below 30, inside the schedule's design range of 1e3);
    tolerances 100 times that."""
    fast = FISMO(polar={"coefficients": "polar_express", "steps": 8}, nonfinite="propagate")
    exact = FISMO(polar="svd", nonfinite="propagate")
    worst = max(rel(d_fast, d_exact) for d_fast, _, d_exact, _ in run_side_by_side(target, shape, 300, fast, exact))
    assert worst <= {"float64": 5e-13, "float32": 2e-4}[target.dtype]
