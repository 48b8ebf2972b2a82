"""Algorithm 1, Theorem 1 and Theorem 2 of the FISMO paper, checked from first principles.

Every expected value here is computed by the test itself, with plain NumPy
formulas written out from ``paper/fismo-paper.tex``, by a *different* numerical
route than ``fismo_core`` (explicit inverses and ``eigh`` square roots instead
of squares of cached inverse roots, polar factors from Gram matrices instead of
the SVD). Nothing is copied from the code under test.

1. ``test_two_steps_match_algorithm_1``: a 3x2 and a 2x3 case, two steps,
   every line of Algorithm 1, every float64 backend.
2. ``test_direction_solves_the_trust_region_problem``: Theorem 2.
3. ``test_alternating_minimisation_of_J`` and friends: Theorem 1, NumPy only,
   plus the printed algorithm's damping (not Theorem 1's) in FISMO's line 4.
4. ``test_gamma_one_is_muon`` / ``test_gamma_one_matches_torch_muon``.
5. ``test_inputs_are_never_mutated``.
6. ``test_decoupled_weight_decay``.

Each tolerance carries the value measured on this machine (x86-64 CPU, NumPy
2.4 / OpenBLAS, torch 2.13, JAX 0.10, array-api-strict 2.6) and the headroom.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from fismo_core import FISMO, FISMOState
from fismo_core.testing import Target, to_numpy

# --------------------------------------------------------------------------- helpers


def _rel(got: np.ndarray, ref: np.ndarray) -> float:
    """Relative Frobenius error ``||got - ref|| / ||ref||``."""
    got, ref = np.asarray(got, dtype=np.float64), np.asarray(ref, dtype=np.float64)
    return float(np.linalg.norm(got - ref) / np.linalg.norm(ref))


def _check_close(got, ref, tol: float, what: str) -> None:
    err = _rel(got, ref)
    assert err <= tol, f"{what}: relative error {err:.3e} > {tol:.1e}"


def _snapshot(x) -> np.ndarray:
    """A NumPy float64 *copy* (``to_numpy`` may share memory with NumPy and CPU torch)."""
    return np.array(to_numpy(x), dtype=np.float64, copy=True)


def _sym(A: np.ndarray) -> np.ndarray:
    return (A + A.T) / 2


def _sqrtm_spd(A: np.ndarray) -> np.ndarray:
    """Principal square root of an SPD matrix from ``eigh`` (no SciPy)."""
    w, V = np.linalg.eigh(_sym(A))
    assert w.min() > 0, "matrix is not positive definite"
    return (V * np.sqrt(w)) @ V.T


def _inv_sqrtm(A: np.ndarray) -> np.ndarray:
    """``A^{-1/2}`` as the explicit inverse of the ``eigh`` square root."""
    return np.linalg.inv(_sqrtm_spd(A))


def _polar_gram(X: np.ndarray) -> np.ndarray:
    """``Polar(X) = U V^T`` of a full-rank ``X`` through its Gram matrix, not the SVD.

    ``X (X^T X)^{-1/2}`` if ``X`` is tall or square, ``(X X^T)^{-1/2} X`` if wide.
    """
    m, n = X.shape
    if m >= n:
        return X @ _inv_sqrtm(X.T @ X)
    return _inv_sqrtm(X @ X.T) @ X


def _random_spd(rng: np.random.Generator, d: int, cond: float) -> np.ndarray:
    """A random SPD matrix with condition number ``cond`` and trace ``d``."""
    Qm, _ = np.linalg.qr(rng.standard_normal((d, d)))
    w = np.geomspace(1.0, cond, d)
    A = _sym((Qm * w) @ Qm.T)
    return d / np.trace(A) * A


def _state(target: Target, P: np.ndarray, Q: np.ndarray, M: np.ndarray, step: int = 0) -> FISMOState:
    """A FISMO state holding ``P``, ``Q``, ``M`` and inverse roots computed here."""
    a = target.asarray
    return FISMOState(
        P=a(P), Q=a(Q), M=a(M), P_inv_sqrt=a(_inv_sqrtm(P)), Q_inv_sqrt=a(_inv_sqrtm(Q)), step=step
    )


# ------------------------------------------------------ 1. Algorithm 1, line by line


def _algorithm_1(W0, grads, *, lr, beta, gamma, mu, mutant=None):
    """Algorithm 1 of the paper in plain NumPy, one line per printed line.

    ``mutant`` names a deliberate deviation, used to show that the comparison
    would catch it: ``"jacobi"`` (R_t from P_{t-1}), ``"theorem1_damping"``
    (mu tr(Q^{-1})/n and mu tr(P^{-1})/m), ``"Q_not_inverse"`` (L_t with
    Q_{t-1} for Q_{t-1}^{-1}), ``"no_trace_normalisation"``,
    ``"momentum_no_dampening"`` (M_t = beta M + G~).
    """
    m, n = W0.shape
    I_m, I_n = np.eye(m), np.eye(n)
    P, Q, M, W = I_m, I_n, np.zeros((m, n)), np.array(W0, dtype=np.float64)
    history = []
    for G in grads:
        # Line 4: L_t = 1/n G Q_{t-1}^{-1} G^T + mu tr(P_{t-1})/m I_m
        Q_factor = Q if mutant == "Q_not_inverse" else np.linalg.inv(Q)
        damp_L = mu * np.trace(np.linalg.inv(Q)) / n if mutant == "theorem1_damping" else mu * np.trace(P) / m
        L = G @ Q_factor @ G.T / n + damp_L * I_m
        P_tilde = gamma * P + (1 - gamma) * L
        P_new = _sym(P_tilde) if mutant == "no_trace_normalisation" else _sym(m / np.trace(P_tilde) * P_tilde)
        # Line 5: R_t = 1/m G^T P_t^{-1} G + mu tr(Q_{t-1})/n I_n  (Gauss-Seidel: the new P_t)
        P_for_R = P if mutant == "jacobi" else P_new
        damp_R = mu * np.trace(np.linalg.inv(P_new)) / m if mutant == "theorem1_damping" else mu * np.trace(Q) / n
        R = G.T @ np.linalg.inv(P_for_R) @ G / m + damp_R * I_n
        Q_tilde = gamma * Q + (1 - gamma) * R
        Q_new = _sym(Q_tilde) if mutant == "no_trace_normalisation" else _sym(n / np.trace(Q_tilde) * Q_tilde)
        P, Q = P_new, Q_new
        # Line 6: G~_t = P_t^{-1/2} G_t Q_t^{-1/2}
        P_is, Q_is = _inv_sqrtm(P), _inv_sqrtm(Q)
        G_white = P_is @ G @ Q_is
        # Line 7: M_t = beta M_{t-1} + (1 - beta) G~_t
        M = beta * M + (G_white if mutant == "momentum_no_dampening" else (1 - beta) * G_white)
        # Line 8: dW_t = P_t^{-1/2} Polar(M_t) Q_t^{-1/2}
        dW = P_is @ _polar_gram(M) @ Q_is
        # Line 9: W_t = W_{t-1} - eta dW_t
        W = W - lr * dW
        history.append({"P": P, "Q": Q, "P_inv_sqrt": P_is, "Q_inv_sqrt": Q_is, "M": M, "dW": dW, "W": W})
    return history


_SMALL_HYPER = dict(lr=0.1, beta=0.7, gamma=0.5, mu=0.1)


def _small_case(shape):
    rng = np.random.default_rng(20240611 + shape[0])
    W0 = rng.standard_normal(shape)
    # Entries of order 1 with distinct row and column scales, so that the data
    # part of L_t and R_t is comparable to P_{t-1}, Q_{t-1} and to the damping.
    scale = np.array([0.5, 1.0, 2.0])[: shape[0], None] * np.array([1.5, 0.7, 1.1])[None, : shape[1]]
    grads = [scale * rng.standard_normal(shape) for _ in range(2)]
    return W0, grads


# float64, two steps of a 3x2 / 2x3 problem (P_t, Q_t reach condition numbers
# 11 and 10): the backends and the NumPy reference (explicit inverses, eigh
# square roots, Gram-matrix polar factor) agree to at most 1.5e-15 relative on
# every compared array (measured on NumPy, array-api-strict, torch and JAX;
# worst is P_inv_sqrt). 1e-12 is the project's bar for this check (~650x
# headroom, kept for other LAPACK builds) and still ~10^10 below the smallest
# change any mutant of the reference produces (4.9e-2, see the next test).
TOL_ALG1_F64 = 1e-12


@pytest.mark.parametrize("shape", [(3, 2), (2, 3)], ids=["3x2", "2x3"])
def test_two_steps_match_algorithm_1(target64: Target, shape) -> None:
    W0, grads = _small_case(shape)
    expected = _algorithm_1(W0, grads, **_SMALL_HYPER)
    opt = FISMO(**_SMALL_HYPER, polar="svd", inv_root="eigh")
    W = target64.asarray(W0)
    state = opt.init(W)
    for t, (G, exp) in enumerate(zip(grads, expected), start=1):
        W, state = opt.step(W, target64.asarray(G), state)
        assert state.step == t
        for name in ("P", "Q", "P_inv_sqrt", "Q_inv_sqrt", "M", "W"):
            got = getattr(state, name) if name != "W" else W
            _check_close(to_numpy(got), exp[name], TOL_ALG1_F64, f"{name}_{t}")


@pytest.mark.parametrize("shape", [(3, 2), (2, 3)], ids=["3x2", "2x3"])
def test_small_case_is_sensitive_to_every_line(shape) -> None:
    """The reference of the test above is not vacuous: each plausible slip in
    Algorithm 1 moves some compared array by far more than its tolerance.
    In particular the Jacobi order (R_t from P_{t-1}) changes Q_1 itself."""
    W0, grads = _small_case(shape)
    good = _algorithm_1(W0, grads, **_SMALL_HYPER)
    jacobi = _algorithm_1(W0, grads, **_SMALL_HYPER, mutant="jacobi")
    # Measured: 0.25 (3x2) and 0.35 (2x3) relative change of Q_1.
    assert _rel(jacobi[0]["Q"], good[0]["Q"]) > 1e-2
    # Q_not_inverse: invisible at t = 1 (Q_0 = I), so the second step is needed.
    assert _rel(_algorithm_1(W0, grads, **_SMALL_HYPER, mutant="Q_not_inverse")[0]["P"], good[0]["P"]) < 1e-15
    for mutant in ("theorem1_damping", "Q_not_inverse", "no_trace_normalisation", "momentum_no_dampening"):
        bad = _algorithm_1(W0, grads, **_SMALL_HYPER, mutant=mutant)
        worst = max(_rel(bad[-1][k], good[-1][k]) for k in ("P", "Q", "M", "W"))
        # Measured: every mutant moves some array by 4.9e-2 or more (2.3 for
        # the undamped momentum, which only rescales M and so leaves W alone).
        assert worst > 1e-3, f"mutant {mutant} is not detected ({worst:.1e})"


# ------------------------------------------------------------------ 2. Theorem 2

# <G, D> against -||G~||_* and ||P^{1/2} D Q^{1/2}||_2 against 1: measured at
# most 4.3e-16 and 1.1e-15 (all float64 backends; P, Q have condition 30 and
# 10, and P^{1/2}, Q^{1/2} are recomputed here from eigh); 1e-14 leaves ~10x.
# The same relative slack guards the comparisons with feasible points, whose
# genuine gaps are >= 3e-7 * ||G~||_* (local perturbations of size 1e-6; the
# random samples stay >= 0.12 * ||G~||_* above the optimum).
TOL_THM2 = 1e-14


@pytest.mark.parametrize("shape", [(5, 3), (3, 5), (4, 4)], ids=["5x3", "3x5", "4x4"])
def test_direction_solves_the_trust_region_problem(target64: Target, shape) -> None:
    m, n = shape
    rng = np.random.default_rng(7 + 10 * m + n)
    G = rng.standard_normal(shape)
    P, Q = _random_spd(rng, m, 30.0), _random_spd(rng, n, 10.0)
    P_h, Q_h = _sqrtm_spd(P), _sqrtm_spd(Q)
    P_ih, Q_ih = np.linalg.inv(P_h), np.linalg.inv(Q_h)
    # gamma = 1: P, Q and their cached roots are used as given; beta = 0: M_t = G~_t.
    opt = FISMO(gamma=1.0, beta=0.0, polar="svd")
    state = _state(target64, P, Q, np.zeros(shape))
    D, new_state = opt.direction(target64.asarray(G), state)
    D = to_numpy(D)
    # P_t = sym(m / tr(P_{t-1}) P_{t-1}) = P_{t-1} at gamma = 1 (tr P = m): to rounding (measured 0).
    _check_close(to_numpy(new_state.P), P, TOL_THM2, "P_t")
    _check_close(to_numpy(new_state.Q), Q, TOL_THM2, "Q_t")

    G_white = P_ih @ G @ Q_ih
    nuclear = np.linalg.svd(G_white, compute_uv=False).sum()
    # Optimal value: <G, Delta*> = -||G~||_* with Delta* = -D (eta = 1).
    value_star = float(np.sum(G * -D))
    assert abs(value_star + nuclear) <= TOL_THM2 * nuclear, (value_star, -nuclear)
    # On the boundary of the trust region ||P^{1/2} Delta Q^{1/2}||_2 <= 1.
    assert abs(np.linalg.norm(P_h @ D @ Q_h, 2) - 1.0) <= TOL_THM2

    def to_delta(Phi):  # feasible Delta = P^{-1/2} Phi Q^{-1/2} for ||Phi||_2 <= 1
        return P_ih @ Phi @ Q_ih

    slack = TOL_THM2 * nuclear
    # (a) 4000 random feasible points: interior and boundary (Z / ||Z||_2 times
    #     a radius in [0, 1], half of them exactly on the boundary) and random
    #     extreme points U V^T (all singular values one).
    K = 2000
    Z = rng.standard_normal((K, m, n))
    Z /= np.linalg.norm(Z, ord=2, axis=(1, 2))[:, None, None]
    radius = np.where(np.arange(K) % 2 == 0, 1.0, rng.uniform(0, 1, K))
    U, _, Vh = np.linalg.svd(rng.standard_normal((K, m, n)), full_matrices=False)
    Phis = np.concatenate([Z * radius[:, None, None], U @ Vh])
    assert np.all(np.linalg.norm(Phis, ord=2, axis=(1, 2)) <= 1 + 1e-12)
    values = np.einsum("ij,kij->k", G, P_ih @ Phis @ Q_ih)
    assert values.min() >= value_star - slack, (values.min(), value_star)
    # (b) local perturbations of the optimum, renormalised onto the boundary.
    Phi_star = P_h @ -D @ Q_h
    for eps in (1e-1, 1e-3, 1e-6):
        for _ in range(200):
            Phi = Phi_star + eps * rng.standard_normal(shape)
            Phi /= np.linalg.norm(Phi, 2)
            assert float(np.sum(G * to_delta(Phi))) >= value_star - slack
    # (c) the geometry matters: Muon's direction Polar(G), scaled onto the
    #     boundary, is feasible and clearly worse (measured by 0.64 ||G~||_* or more).
    Phi_muon = P_h @ -_polar_gram(G) @ Q_h
    value_muon = float(np.sum(G * to_delta(Phi_muon / np.linalg.norm(Phi_muon, 2))))
    assert value_muon > value_star + 0.1 * nuclear


# ------------------------------------------------------------------ 3. Theorem 1


def _fisher_samples(N: int = 400, m: int = 4, n: int = 3, seed: int = 3) -> np.ndarray:
    """N gradients G_i (m x n): a Kronecker-structured part with anisotropic row
    and column covariances plus a smaller non-separable part, so the Fisher is
    not exactly a Kronecker product."""
    rng = np.random.default_rng(seed)
    A = np.linalg.cholesky(_random_spd(rng, m, 20.0))
    B = np.linalg.cholesky(_random_spd(rng, n, 8.0))
    entry_scale = rng.uniform(0.2, 1.0, (m, n))  # not of rank one: breaks the Kronecker structure
    return A @ rng.standard_normal((N, m, n)) @ B.T + 0.4 * entry_scale * rng.standard_normal((N, m, n))


def _J(P, Q, Gs, mu) -> float:
    """eq. best_kron_obj_matrix: E tr(P^-1 G Q^-1 G^T) + mu tr(P^-1) tr(Q^-1) + n logdet P + m logdet Q."""
    m, n = P.shape[0], Q.shape[0]
    Pi, Qi = np.linalg.inv(P), np.linalg.inv(Q)
    data = np.mean(np.einsum("ij,kjl,lr,kir->k", Pi, Gs, Qi, Gs))
    sP, ldP = np.linalg.slogdet(P)
    sQ, ldQ = np.linalg.slogdet(Q)
    assert sP > 0 and sQ > 0
    return float(data + mu * np.trace(Pi) * np.trace(Qi) + n * ldP + m * ldQ)


def _P_star(Q, Gs, mu):
    """Theorem 1: P*(Q) = 1/n E[G Q^-1 G^T] + mu tr(Q^-1)/n I_m."""
    n, m = Q.shape[0], Gs.shape[1]
    Qi = np.linalg.inv(Q)
    return _sym(np.mean(Gs @ Qi @ Gs.transpose(0, 2, 1), axis=0) / n + mu * np.trace(Qi) / n * np.eye(m))


def _Q_star(P, Gs, mu):
    """Theorem 1: Q*(P) = 1/m E[G^T P^-1 G] + mu tr(P^-1)/m I_n."""
    m, n = P.shape[0], Gs.shape[2]
    Pi = np.linalg.inv(P)
    return _sym(np.mean(Gs.transpose(0, 2, 1) @ Pi @ Gs, axis=0) / m + mu * np.trace(Pi) / m * np.eye(n))


def _random_sym(rng, d):
    S = _sym(rng.standard_normal((d, d)))
    return S / np.linalg.norm(S)


MU_THM1 = 0.05
# Rounding slack for comparisons of J (J* = 6.76): the largest increase of J
# seen along the alternating iteration (pure rounding, once it has converged)
# is 9.2e-16 relative, and J(3P, Q/3) - J(P, Q) is 5.3e-16; 1e-14 relative
# leaves ~10x. Genuine gaps are far larger: >= 2.2e-9 relative for the
# smallest perturbations (h = 1e-4) of the fixed point below.
SLACK_J = 1e-14


def test_alternating_minimisation_of_J() -> None:
    Gs = _fisher_samples()
    m, n = Gs.shape[1:]
    P, Q = np.eye(m), np.eye(n)
    J_prev = _J(P, Q, Gs, MU_THM1)
    history = [J_prev]
    for _ in range(100):
        P_new = _P_star(Q, Gs, MU_THM1)
        J_half = _J(P_new, Q, Gs, MU_THM1)
        Q_new = _Q_star(P_new, Gs, MU_THM1)
        J_new = _J(P_new, Q_new, Gs, MU_THM1)
        # Each half-step minimises J exactly in one block: J never increases.
        assert J_half <= J_prev + SLACK_J * abs(J_prev)
        assert J_new <= J_half + SLACK_J * abs(J_half)
        history += [J_half, J_new]
        moved = max(_rel(P_new, P), _rel(Q_new, Q))
        P, Q, J_prev = P_new, Q_new, J_new
        if moved < 1e-14:
            break
    else:
        pytest.fail("alternating minimisation did not converge in 100 sweeps")
    # The iteration really moved: J dropped from 13.95 at (I, I) to 6.76.
    assert history[0] - history[-1] > 1.0
    # A fixed point of both maps. Measured: the relative change shrinks ~25x
    # per sweep (1.0, 0.11, 5e-3, 2e-4, ...) and is below 1e-14 after 12
    # sweeps; the residual is then 1.2e-15 (P) and 0 (Q); 1e-14 leaves ~8x.
    assert _rel(_P_star(Q, Gs, MU_THM1), P) < 1e-14
    assert _rel(_Q_star(P, Gs, MU_THM1), Q) < 1e-14
    J_star = history[-1]
    # No nearby SPD point lowers J: random symmetric directions in P and Q
    # jointly, and in each alone, at several step sizes.
    rng = np.random.default_rng(11)
    for h in (1e-1, 1e-2, 1e-4):
        for _ in range(100):
            dP, dQ = _random_sym(rng, m), _random_sym(rng, n)
            for a, b in ((1, 1), (1, 0), (0, 1)):
                Pp, Qp = P + a * h * dP * np.trace(P) / m, Q + b * h * dQ * np.trace(Q) / n
                if np.linalg.eigvalsh(Pp).min() <= 0 or np.linalg.eigvalsh(Qp).min() <= 0:
                    continue
                assert _J(Pp, Qp, Gs, MU_THM1) >= J_star - SLACK_J * abs(J_star)
    # The flat direction of J: (cP, Q/c) leaves J unchanged (why the algorithm
    # may normalise traces).
    assert abs(_J(3 * P, Q / 3, Gs, MU_THM1) - J_star) <= SLACK_J * abs(J_star)


def test_theorem_1_block_minimisers() -> None:
    """For a fixed random Q (P), P*(Q) (Q*(P)) beats every nearby SPD P (Q).

    The smallest genuine gap (h = 1e-3) is measured at 6.5e-8 relative, far
    above SLACK_J."""
    Gs = _fisher_samples(seed=5)
    m, n = Gs.shape[1:]
    rng = np.random.default_rng(12)
    for _ in range(3):
        Q = _random_spd(rng, n, 5.0)
        P_opt = _P_star(Q, Gs, MU_THM1)
        J_opt = _J(P_opt, Q, Gs, MU_THM1)
        P = _random_spd(rng, m, 5.0)
        Q_opt = _Q_star(P, Gs, MU_THM1)
        JQ_opt = _J(P, Q_opt, Gs, MU_THM1)
        for h in (1e-1, 1e-3):
            for _ in range(100):
                dP = h * _random_sym(rng, m) * np.trace(P_opt) / m
                if np.linalg.eigvalsh(P_opt + dP).min() > 0:
                    assert _J(P_opt + dP, Q, Gs, MU_THM1) >= J_opt - SLACK_J * abs(J_opt)
                dQ = h * _random_sym(rng, n) * np.trace(Q_opt) / n
                if np.linalg.eigvalsh(Q_opt + dQ).min() > 0:
                    assert _J(P, Q_opt + dQ, Gs, MU_THM1) >= JQ_opt - SLACK_J * abs(JQ_opt)


def _vec(G: np.ndarray) -> np.ndarray:
    """Column-stacking vec(G), the convention of vec(P X Q) = (Q^T kron P) vec(X)."""
    return np.swapaxes(G, -1, -2).reshape(*G.shape[:-2], -1)


def _logdet_divergence(A: np.ndarray, B: np.ndarray) -> float:
    """D_ld(A || B) = tr(B^-1 A) - logdet(B^-1 A) - d (paper, eq. logdet_div)."""
    X = np.linalg.solve(B, A)
    sign, logdet = np.linalg.slogdet(X)
    assert sign > 0
    return float(np.trace(X) - logdet - A.shape[0])


def test_J_is_the_logdet_divergence_up_to_a_constant() -> None:
    """J(P, Q) = D_ld(F + mu I || Q kron P) + logdet(F + mu I) + mn for every SPD P, Q."""
    Gs = _fisher_samples()
    N, m, n = Gs.shape
    g = _vec(Gs)
    assert np.array_equal(g[0], Gs[0].flatten(order="F"))
    F = g.T @ g / N  # E[vec(G) vec(G)^T], mn x mn
    A = F + MU_THM1 * np.eye(m * n)
    constant = np.linalg.slogdet(A)[1] + m * n
    # the fixed point of Theorem 1 and some random SPD pairs
    P, Q = np.eye(m), np.eye(n)
    for _ in range(200):
        P = _P_star(Q, Gs, MU_THM1)
        Q = _Q_star(P, Gs, MU_THM1)
    rng = np.random.default_rng(13)
    pairs = [(P, Q)] + [(_random_spd(rng, m, 10.0), _random_spd(rng, n, 10.0)) for _ in range(5)]
    divergences = []
    for Pk, Qk in pairs:
        D = _logdet_divergence(A, np.kron(Qk, Pk))
        J = _J(Pk, Qk, Gs, MU_THM1)
        # measured agreement at most 9.2e-16 relative; 1e-14 leaves ~10x.
        assert abs(D + constant - J) <= 1e-14 * abs(J), (D + constant, J)
        divergences.append(D)
        # The other Kronecker order does not fit the vec convention (measured
        # mismatch >= 9.5 in J): the check above really pins Q kron P.
        assert abs(_logdet_divergence(A, np.kron(Pk, Qk)) + constant - J) > 1.0
    # and the fixed point is the best of them in the paper's own measure
    assert divergences[0] < min(divergences[1:])


def test_line_4_and_5_damp_as_printed_not_as_theorem_1() -> None:
    """With gamma = 0, P_t is the trace-normalised L_t: Theorem 1's P*(Q_{t-1})
    for this one gradient except for the damping. Algorithm 1 damps with
    mu tr(P_{t-1})/m, Theorem 1 with mu tr(Q_{t-1}^{-1})/n; the implementation
    must follow the printed algorithm (DESIGN.md), and the two differ here."""
    m, n, mu = 4, 3, 0.5
    rng = np.random.default_rng(17)
    G = rng.standard_normal((m, n))
    P_prev, Q_prev = _random_spd(rng, m, 10.0), _random_spd(rng, n, 20.0)
    opt = FISMO(gamma=0.0, beta=0.0, mu=mu, polar="svd")
    state = FISMOState(P=P_prev, Q=Q_prev, M=np.zeros((m, n)), P_inv_sqrt=_inv_sqrtm(P_prev),
                       Q_inv_sqrt=_inv_sqrtm(Q_prev), step=7)
    _, state = opt.direction(G, state)  # NumPy float64 arrays straight in
    P_t, Q_t = state.P, state.Q

    def normalise(A):
        return A * A.shape[0] / np.trace(A)

    Gs = G[None]  # E over this single gradient
    Qi = np.linalg.inv(Q_prev)
    L_printed = G @ Qi @ G.T / n + mu * np.trace(P_prev) / m * np.eye(m)
    P_theorem = _P_star(Q_prev, Gs, mu)
    # same data term as Theorem 1 ...
    assert np.allclose(L_printed - mu * np.trace(P_prev) / m * np.eye(m),
                       P_theorem - mu * np.trace(Qi) / n * np.eye(m), rtol=1e-13, atol=1e-13)
    # ... and the two dampings really differ here (tr(Q^-1)/n = 2.3 vs tr(P)/m = 1)
    assert abs(np.trace(Qi) / n - np.trace(P_prev) / m) > 0.5
    # measured 7.3e-16 (P_t) and 3.2e-16 (Q_t); 1e-14 leaves ~14x. The
    # theorem's damping is off by far more (asserted > 1e-2 and > 1e-3 below).
    _check_close(P_t, normalise(L_printed), 1e-14, "P_t vs printed line 4")
    assert _rel(P_t, normalise(P_theorem)) > 1e-2

    Pi = np.linalg.inv(P_t)
    R_printed = G.T @ Pi @ G / m + mu * np.trace(Q_prev) / n * np.eye(n)
    Q_theorem = _Q_star(P_t, Gs, mu)
    _check_close(Q_t, normalise(R_printed), 1e-14, "Q_t vs printed line 5")
    assert _rel(Q_t, normalise(Q_theorem)) > 1e-3

    # The printed damping is mu tr(P_{t-1})/m, not mu: equal on every state FISMO reaches (trace m), so a
    # state of another trace tells them apart (an independent audit found the check above passing either way).
    P3, Q3 = 3.0 * P_prev, 0.5 * Q_prev
    state3 = FISMOState(P=P3, Q=Q3, M=np.zeros((m, n)), P_inv_sqrt=_inv_sqrtm(P3), Q_inv_sqrt=_inv_sqrtm(Q3), step=7)
    _, state3 = opt.direction(G, state3)
    L3 = G @ np.linalg.inv(Q3) @ G.T / n
    _check_close(state3.P, normalise(L3 + mu * np.trace(P3) / m * np.eye(m)), 1e-14, "P_t, tr(P_{t-1}) = 3m")
    assert _rel(state3.P, normalise(L3 + mu * np.eye(m))) > 1e-2
    R3 = G.T @ np.linalg.inv(state3.P) @ G / m
    _check_close(state3.Q, normalise(R3 + mu * np.trace(Q3) / n * np.eye(n)), 1e-14, "Q_t, tr(Q_{t-1}) = n/2")
    assert _rel(state3.Q, normalise(R3 + mu * np.eye(n))) > 1e-2


# -------------------------------------------------------------- 4. gamma = 1 is Muon

_NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)


def _newton_schulz_muon(X: np.ndarray, steps: int = 5, eps: float = 1e-7) -> np.ndarray:
    """Muon's quintic Newton-Schulz in float64, as in Keller Jordan's post."""
    a, b, c = _NS_COEFFICIENTS
    transposed = X.shape[0] > X.shape[1]
    Y = X.T if transposed else X
    Y = Y / max(np.linalg.norm(Y), eps)
    for _ in range(steps):
        A = Y @ Y.T
        Y = a * Y + (b * A + c * A @ A) @ Y
    return Y.T if transposed else Y


def _muon_reference(W0, grads, *, lr, beta, nesterov=False):
    M, W, out = np.zeros_like(W0), np.array(W0, dtype=np.float64), []
    for G in grads:
        M = beta * M + (1 - beta) * G
        update = beta * M + (1 - beta) * G if nesterov else M
        W = W - lr * _newton_schulz_muon(update)
        out.append(W)
    return out


def _muon_case(shape, steps=20, seed=0):
    rng = np.random.default_rng(seed)
    W0 = rng.standard_normal(shape)
    row = np.geomspace(0.3, 3.0, shape[0])[:, None]
    grads = [row * rng.standard_normal(shape) for _ in range(steps)]
    return W0, grads


# Trajectory of FISMO(gamma=1) against the float64 Muon written above, 20
# steps, relative error of every W_t: measured at most 3.9e-16 on float64
# (JAX; NumPy and array-api-strict 3.0e-16, torch 3.6e-16) and 1.8e-7 on
# float32 (float32 rounding of inputs and of 20 steps of arithmetic);
# 4e-15 and 2e-6 leave ~10x.
TOL_MUON = {"float64": 4e-15, "float32": 2e-6}


@pytest.mark.parametrize("nesterov", [False, True], ids=["ema", "nesterov"])
@pytest.mark.parametrize("shape", [(6, 4), (4, 6)], ids=["tall", "wide"])
def test_gamma_one_is_muon(target: Target, shape, nesterov) -> None:
    lr, beta = 0.05, 0.9
    W0, grads = _muon_case(shape)
    expected = _muon_reference(W0, grads, lr=lr, beta=beta, nesterov=nesterov)
    opt = FISMO(lr=lr, beta=beta, gamma=1.0, mu=0.3, nesterov=nesterov)  # mu is irrelevant at gamma = 1
    W = target.asarray(W0)
    state = opt.init(W)
    I_m, I_n = np.eye(shape[0]), np.eye(shape[1])
    for t, G in enumerate(grads, start=1):
        W, state = opt.step(W, target.asarray(G), state)
        # exactly the identity, not approximately
        assert np.array_equal(to_numpy(state.P), I_m) and np.array_equal(to_numpy(state.P_inv_sqrt), I_m)
        assert np.array_equal(to_numpy(state.Q), I_n) and np.array_equal(to_numpy(state.Q_inv_sqrt), I_n)
        _check_close(to_numpy(W), expected[t - 1], TOL_MUON[target.dtype], f"W_{t}")


_WARMUP = (0.85, 0.9, 0.95, 0.95)  # a momentum warmup, as Muon recipes schedule beta


@pytest.mark.numbers
@pytest.mark.parametrize("nesterov", [False, True], ids=["ema", "nesterov"])
def test_a_float64_array_beta_steps_as_the_number_bit_for_bit(target: Target, nesterov) -> None:
    """Line 7 with ``beta`` a 0-d float64 array (what a traced schedule passes) is line 7 with the number,
    bit for bit, in float64 and float32 states: both factors are rounded to the state's dtype as a number
    is (unrounded, the float64 array promoted a float32 ``M_t`` to float64 on NumPy, array-api-strict and
    JAX). Scale-invariant statistics make ``scale`` an array too."""
    xp = target.xp
    W0, grads = _muon_case((6, 4), steps=len(_WARMUP))
    runs = []
    for as_array in (False, True):
        W = target.asarray(W0)
        state = FISMO(nesterov=nesterov).init(W)
        for beta, G in zip(_WARMUP, grads):
            value = xp.asarray(beta, dtype=xp.float64) if as_array else beta
            W, state = FISMO(beta=value, nesterov=nesterov, statistics="scale_invariant").step(W, target.asarray(G), state)
        runs.append((to_numpy(W), to_numpy(state.M), W.dtype))
    (W_number, M_number, dtype_number), (W_array, M_array, dtype_array) = runs
    assert dtype_array == dtype_number
    assert np.array_equal(W_array, W_number) and np.array_equal(M_array, M_number)


@pytest.mark.numbers
@pytest.mark.parametrize("beta_dtype", ["float16", "float32"])
def test_a_narrow_array_beta_steps_as_its_number_bit_for_bit(target: Target, beta_dtype: str) -> None:
    """A float16 or float32 0-d ``beta`` (below 0.5, where ``1 - beta`` rounds) is line 7 with the number it
    holds, bit for bit: ``1 - beta`` was taken in ``beta``'s own dtype, and a float16 0.1235 on a float32 state
    moved ``M_t`` by 1.3e-4 against ``FISMO(beta=float(beta))`` (a user's hunt, 2026-12-04)."""
    xp = target.xp
    if beta_dtype == "float16" and not hasattr(xp, "float16"):
        pytest.skip(f"{target.id} has no float16")
    W0, grads = _muon_case((6, 4), steps=3)
    held = float(np.asarray(0.1235, dtype=beta_dtype))
    runs = []
    for beta in (held, xp.asarray(held, dtype=getattr(xp, beta_dtype))):
        W = target.asarray(W0)
        opt = FISMO(beta=beta)
        state = opt.init(W)
        for G in grads:
            W, state = opt.step(W, target.asarray(G), state)
        runs.append(to_numpy(state.M))
    assert np.array_equal(runs[0], runs[1])


@pytest.mark.numbers
@pytest.mark.parametrize("scalar", [np.float64, np.float32])
def test_a_numpy_scalar_beta_is_the_python_float(target: Target, scalar) -> None:
    """A NumPy scalar ``beta`` (which array-api-compat counts as an array) is taken as ``float(beta)``, bit
    for bit, and keeps the state's dtype: kept as a NumPy scalar (as between ece7281 and this test), an
    ``np.float64`` promoted a float32 ``M_t`` to float64 on NumPy (NumPy 2's scalars are not weak)."""
    W0, grads = _muon_case((6, 4), steps=len(_WARMUP))
    runs = []
    for as_scalar in (False, True):
        W = target.asarray(W0)
        state = FISMO().init(W)
        for beta, G in zip(_WARMUP, grads):
            opt = FISMO(beta=scalar(beta) if as_scalar else float(scalar(beta)))
            assert type(opt.beta) is float
            W, state = opt.step(W, target.asarray(G), state)
        runs.append((to_numpy(W), to_numpy(state.M), W.dtype, state.M.dtype))
    (W_float, M_float, *dtypes_float), (W_scalar, M_scalar, *dtypes_scalar) = runs
    assert dtypes_scalar == dtypes_float
    assert np.array_equal(W_scalar, W_float) and np.array_equal(M_scalar, M_float)


def test_a_traced_beta_schedule_compiles_once_under_jax_jit() -> None:
    """Under ``jax.jit`` a ``beta`` argument is traced (its value cannot be checked there, nor need be: the
    caller checks it where it is concrete): one compilation for the whole warmup, and the steps of the
    number, bit for bit (both compiled)."""
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    jax.config.update("jax_enable_x64", True)  # as fismo_core.testing does for the float64 target
    W0, grads = _muon_case((6, 4), steps=len(_WARMUP))
    step = jax.jit(lambda W, G, state, beta: FISMO(beta=beta, nonfinite="propagate").step(W, G, state))
    W = W_ref = jnp.asarray(W0)
    # The step count an int32 array from the start (a Python 0 at the first step is another argument kind).
    state = state_ref = FISMO().init(W)._replace(step=jnp.asarray(0, dtype=jnp.int32))
    for beta, G in zip(_WARMUP, grads):
        W, state = step(W, jnp.asarray(G), state, jnp.asarray(beta, dtype=jnp.float64))
        W_ref, state_ref = jax.jit(FISMO(beta=beta, nonfinite="propagate").step)(W_ref, jnp.asarray(G), state_ref)
    assert step._cache_size() == 1
    assert np.array_equal(np.asarray(W), np.asarray(W_ref)) and np.array_equal(np.asarray(state.M), np.asarray(state_ref.M))


# torch.optim.Muon (torch/optim/_muon.py) keeps its momentum buffer in the
# parameter's dtype, buf.lerp_(grad, 1 - momentum), i.e. the EMA
# M = beta M + (1 - beta) G, and with nesterov=True orthogonalises
# grad.lerp(buf, momentum) = beta M + (1 - beta) G, FISMO's Nesterov. With
# adjust_lr_fn=None it scales the step by sqrt(max(1, A / B)) for a parameter
# of shape (A, B) ("original", Keller Jordan's factor), which FISMO does not.
# Its Newton-Schulz runs in bfloat16: the input, its Frobenius norm and every
# product are rounded to bf16 (8 significant bits, unit roundoff 2^-8 = 3.9e-3)
# and the update it adds is bf16. Five quintic steps (slope up to 3.4 at small
# singular values) amplify that to per-step differences from FISMO's float32
# update of typically 1.5e-2 and at worst 6.7e-2 (measured over 30 seeds).
#
# So two checks. The momentum buffers agree to float32 rounding: measured at
# most 3.4e-7 relative over 20 steps, tolerance 3e-6 (~10x). The updates are
# compared as whole 20-step trajectories (Frobenius norm of the stacked
# per-step differences over that of the stacked torch updates), which averages
# the bf16 noise: measured at most 2.4e-2 over 30 seeds x 2 shapes x both
# momentum flavours. A 10x margin is impossible here if the check is to stay
# able to fail:
# the slips this check exists for, a missing sqrt(8 / 4) lr factor and the
# other momentum flavour, differ by at least 0.29 and 0.41. 8e-2 sits ~3.3x
# above the bf16 noise and ~3.6x below the smallest slip.
TOL_TORCH_MUON_BUFFER = 3e-6
TOL_TORCH_MUON_TRAJECTORY = 8e-2


@pytest.mark.parametrize("nesterov", [False, True], ids=["ema", "nesterov"])
@pytest.mark.parametrize("shape", [(8, 4), (4, 8)], ids=["tall", "wide"])
def test_gamma_one_matches_torch_muon(shape, nesterov) -> None:
    torch = pytest.importorskip("torch")
    if not hasattr(torch.optim, "Muon"):
        pytest.skip("torch.optim.Muon needs torch >= 2.9")
    lr, beta = 0.05, 0.9
    W0, grads = _muon_case(shape, seed=1)
    torch_lr_factor = math.sqrt(max(1.0, shape[0] / shape[1]))  # see above
    param = torch.nn.Parameter(torch.tensor(W0, dtype=torch.float32))
    muon = torch.optim.Muon([param], lr=lr, momentum=beta, nesterov=nesterov, weight_decay=0.0, adjust_lr_fn=None)
    opt = FISMO(lr=lr * torch_lr_factor, beta=beta, gamma=1.0, nesterov=nesterov)
    W = torch.tensor(W0, dtype=torch.float32)
    state = opt.init(W)
    # the other momentum flavour, to show the trajectory check can fail
    other = FISMO(lr=lr * torch_lr_factor, beta=beta, gamma=1.0, nesterov=not nesterov)
    other_state = other.init(W)
    steps_muon, steps_fismo, steps_other = [], [], []
    for t, G in enumerate(grads, start=1):
        G_t = torch.tensor(G, dtype=torch.float32)
        before = param.detach().clone()
        param.grad = G_t.clone()
        muon.step()
        steps_muon.append((param.detach() - before).double().numpy())
        W_before = W
        W, state = opt.step(W, G_t, state)
        steps_fismo.append((W - W_before).double().numpy())
        _check_close(to_numpy(state.M), to_numpy(muon.state[param]["momentum_buffer"]),
                     TOL_TORCH_MUON_BUFFER, f"momentum buffer {t}")
        dW_other, other_state = other.direction(G_t, other_state)
        steps_other.append(-lr * torch_lr_factor * to_numpy(dW_other))
    steps_muon, steps_fismo, steps_other = map(np.stack, (steps_muon, steps_fismo, steps_other))
    _check_close(steps_fismo, steps_muon, TOL_TORCH_MUON_TRAJECTORY, "20 updates")
    # Both flavours coincide at t = 1 (M_0 = 0 makes beta M_1 + (1 - beta) G_1 a multiple of G_1).
    assert _rel(steps_other[1:], steps_muon[1:]) > 2 * TOL_TORCH_MUON_TRAJECTORY
    if shape[0] > shape[1]:
        assert _rel(steps_fismo / torch_lr_factor, steps_muon) > 2 * TOL_TORCH_MUON_TRAJECTORY


# -------------------------------------------------------------- 5. immutability

_IMMUTABILITY_CONFIGS = {
    "alg1-svd-eigh-wd": dict(lr=0.1, beta=0.7, gamma=0.5, mu=0.1, polar="svd", inv_root="eigh", weight_decay=0.1),
    "ns-ns-nesterov": dict(lr=0.1, beta=0.7, gamma=0.5, mu=0.1, polar="newton_schulz",
                           inv_root="newton_schulz", nesterov=True),
    "gamma1": dict(lr=0.1, beta=0.7, gamma=1.0, weight_decay=0.1),
    "blocks": dict(lr=0.1, beta=0.7, gamma=0.5, mu=0.1, block_size=2),  # 5 = 2+2+1 rows, 3 = 2+1 columns
}


def _torch_fingerprint(x):
    return (x.data_ptr(), x._version)


@pytest.mark.parametrize("config", list(_IMMUTABILITY_CONFIGS), ids=list(_IMMUTABILITY_CONFIGS))
def test_inputs_are_never_mutated(target: Target, config) -> None:
    opt = FISMO(**_IMMUTABILITY_CONFIGS[config])
    rng = np.random.default_rng(21)
    shape = (2, 5, 3)  # a batch, so the batched code path runs too
    W = target.asarray(rng.standard_normal(shape))
    G1, G2 = (target.asarray(rng.standard_normal(shape)) for _ in range(2))
    is_torch = target.backend == "torch"

    def arrays(W, G, state):
        out = {"W": W, "G": G}
        for k, v in state._asdict().items():
            if isinstance(v, tuple):  # a blocked factor: each of its arrays
                out.update({f"{k}.{i}": part for i, part in enumerate(v) if part is not None})
            elif k != "step":
                out[k] = v
        return out

    def check_unchanged(call, W, G, state):
        inputs = arrays(W, G, state)
        copies = {k: _snapshot(v) for k, v in inputs.items()}
        prints = {k: _torch_fingerprint(v) for k, v in inputs.items()} if is_torch else {}
        result = call()
        for k, v in inputs.items():
            assert np.array_equal(to_numpy(v), copies[k]), f"{call.__name__} changed {k}"
            if is_torch:
                assert _torch_fingerprint(v) == prints[k], f"{call.__name__} wrote into {k} in place"
        return result

    W_copy = _snapshot(W)
    state0 = opt.init(W)
    assert np.array_equal(to_numpy(W), W_copy)
    if is_torch:
        # init's arrays are fresh: writing into them must not be able to reach W
        assert all(v.data_ptr() != W.data_ptr() for v in arrays(W, G1, state0).values() if v is not W and v is not G1)

    def direction_1():
        return opt.direction(G1, state0)

    def step_1():
        return opt.step(W, G1, state0)

    check_unchanged(direction_1, W, G1, state0)
    W1, state1 = check_unchanged(step_1, W, G1, state0)
    assert state1.step == 1 and state0.step == 0

    def direction_2():
        return opt.direction(G2, state1)

    def step_2():
        return opt.step(W1, G2, state1)

    check_unchanged(direction_2, W1, G2, state1)
    W2, state2 = check_unchanged(step_2, W1, G2, state1)
    assert state2.step == 2
    # and the optimizer did something
    assert not np.array_equal(to_numpy(W2), to_numpy(W1))


# ------------------------------------------------------------- 6. weight decay

# W_t against (1 - lr wd) W_{t-1} - lr D_t assembled here in float64 from the
# backend's own W_{t-1} and the wd = 0 run's D_t: measured exactly 0 on float64
# (the same two float64 operations) and at most 5.9e-8 on float32 (JAX; the
# result rounded to float32 once or twice); 1e-15 (a few ulps) and 5e-7
# (~8x) while a missing lr factor (W (1 - wd)) is off by ~1e-1.
TOL_WD = {"float64": 1e-15, "float32": 5e-7}


def test_decoupled_weight_decay(target: Target) -> None:
    lr, wd = 0.1, 0.3
    hyper = dict(lr=lr, beta=0.7, gamma=0.5, mu=0.1)
    opt_wd, opt_0 = FISMO(**hyper, weight_decay=wd), FISMO(**hyper)
    rng = np.random.default_rng(31)
    shape = (4, 3)
    W0 = rng.standard_normal(shape)
    grads = [rng.standard_normal(shape) for _ in range(3)]
    W_wd = W_0 = target.asarray(W0)
    state_wd = state_0 = opt_wd.init(W_wd)
    for t, G in enumerate(grads, start=1):
        G_t = target.asarray(G)
        D, _ = opt_0.direction(G_t, state_0)
        W_prev = to_numpy(W_wd)
        W_wd, state_wd = opt_wd.step(W_wd, G_t, state_wd)
        W_0, state_0 = opt_0.step(W_0, G_t, state_0)
        # decoupled: the decay never reaches the gradient statistics
        for name in ("P", "Q", "M", "P_inv_sqrt", "Q_inv_sqrt"):
            assert np.array_equal(to_numpy(getattr(state_wd, name)), to_numpy(getattr(state_0, name))), name
        expected = (1 - lr * wd) * W_prev - lr * to_numpy(D)
        _check_close(to_numpy(W_wd), expected, TOL_WD[target.dtype], f"W_{t}")
    # the decay actually acted
    assert _rel(to_numpy(W_wd), to_numpy(W_0)) > 1e-2
