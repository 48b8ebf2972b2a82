"""The inverse-root check against a numerically singular factor (docs/guarantees.md, its section on them).

A 6x5 gradient scaled to 1e30 (1e20) makes P_t numerically singular: no float
format resolves its smallest eigenvalue. The documented behaviour is that the
root fails its check (since 2026-11-28 its eigenvalue test, lambda_min <= u
lambda_max) and the previous factor is kept with a warning. This
prints, per backend and dtype, whether that happened (warnings, root_failures),
P's extreme eigenvalues, and the direction's distance from Algorithm 1 computed
in 120-digit arithmetic (mpmath) on the same float32-rounded gradient.

``--trajectories`` runs float32 FISMO (NumPy) for 30 steps of Gaussian gradients
on shapes and scales where a factor's condition number passes 1 / u (u the
float32 unit roundoff), with the roots' eigenvalue test (lambda_min <= u
lambda_max fails) and without it (the residual alone, the check before
2026-11-28), and prints each run's direction error against float64 FISMO on
the same gradients (median, max over the steps) and its InverseRootWarnings, and
the step at which the default run (max_failures=10) stops with InverseRootError.

    python docs/scripts/singular_root_check.py                  # a few seconds
    python docs/scripts/singular_root_check.py --trajectories   # about 3 minutes
"""

from __future__ import annotations

import argparse
import warnings

import mpmath as mp
import numpy as np
import torch

from fismo_core import FISMO, InverseRootConfig
from fismo_core.guards import FactorSizeWarning
from fismo_core.optimizer import InverseRootError, InverseRootWarning

mp.mp.dps = 120


def exact_direction(G64: np.ndarray, gamma=mp.mpf("0.95"), mu=mp.mpf("0.001"), beta=mp.mpf("0.95")) -> np.ndarray:
    """Algorithm 1's first step (P_0 = I, Q_0 = I, M_0 = 0, polar by SVD) in 120 digits."""
    def inv_sqrt(A):
        E, V = mp.eigsy(A)
        return V * mp.diag([1 / mp.sqrt(e) for e in E]) * V.T

    G = mp.matrix(G64.tolist())
    m, n = G.rows, G.cols
    P_tilde = gamma * mp.eye(m) + (1 - gamma) * (G * G.T / n + mu * mp.eye(m))
    P_root = inv_sqrt(P_tilde * (m / sum(P_tilde[i, i] for i in range(m))))
    Q_tilde = gamma * mp.eye(n) + (1 - gamma) * (G.T * P_root * P_root * G / m + mu * mp.eye(n))
    Q_root = inv_sqrt(Q_tilde * (n / sum(Q_tilde[i, i] for i in range(n))))
    U, _, V = mp.svd_r((1 - beta) * P_root * G * Q_root)
    return np.array((P_root * (U[:, :n] * V[:n, :]) * Q_root).tolist(), dtype=float)


def main() -> None:
    torch.set_num_threads(1)
    X = np.random.default_rng(0).standard_normal((6, 5))
    X /= np.abs(X).max()
    cases = (
        (1e30, "torch float32", lambda a: torch.tensor(a, dtype=torch.float32), lambda r: r.double().numpy()),
        (1e20, "numpy float32", lambda a: np.asarray(a, np.float32), lambda r: np.asarray(r, np.float64)),
        (1e30, "numpy float64", lambda a: np.asarray(a, np.float64), lambda r: np.asarray(r, np.float64)),
    )
    for scale, name, to_backend, to_numpy in cases:
        G = np.asarray(X * scale, np.float32).astype(np.float64)
        exact = exact_direction(G)
        opt = FISMO(polar="svd")
        state = opt.init(to_backend(np.zeros((6, 5))))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            direction, state = opt.direction(to_backend(G), state)
        eigenvalues = np.linalg.eigvalsh(to_numpy(state.P))
        print(f"{name}, G ~ {scale:g}: InverseRootWarnings="
              f"{sum(type(w.message).__name__ == 'InverseRootWarning' for w in caught)}, "
              f"root_failures={int(np.asarray(state.root_failures))}, "
              f"eig(P) min/max={eigenvalues[0]:.2g}/{eigenvalues[-1]:.2g}, "
              f"||d - exact|| / ||exact|| = {np.linalg.norm(to_numpy(direction) - exact) / np.linalg.norm(exact):.3g}")


TRAJECTORY_CASES = (  # (shape, rank of the gradient or None, gradient scales)
    ((1, 1000), None, (3, 10)),
    ((4, 400), None, (10, 100)),
    ((64, 256), 4, (1000,)),
    ((6, 5), None, (1000, 10000)),
)


def trajectory(shape: tuple, rank, scale: float, eigenvalue_test: bool, steps: int = 30) -> tuple:
    """Direction errors of float32 FISMO against float64 FISMO along one run (median, max), its
    InverseRootWarnings, the float64 factors' largest condition number and the float64 run's warnings
    (where it has some, it is not Algorithm 1 either). ``eigenvalue_test`` applies to the float32 run."""
    with_test = InverseRootConfig.root_and_eigenvalues

    def residual_only(self, A):  # the check before 2026-11-28: the eigenvalues are not handed to it
        return with_test(self, A)[0], None

    rng = np.random.default_rng(0)
    opt = FISMO(inv_root={"max_failures": 10**6})  # count the fallbacks rather than stop at the 11th
    s32, s64 = opt.init(np.zeros(shape, np.float32)), opt.init(np.zeros(shape))
    errors, warned, reference_warned, kappa = [], 0, 0, 0.0
    for _ in range(steps):
        if rank is None:
            G = rng.standard_normal(shape)
        else:
            G = rng.standard_normal((shape[0], rank)) @ rng.standard_normal((rank, shape[1]))
        G = (G * scale).astype(np.float32)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if not eigenvalue_test:
                InverseRootConfig.root_and_eigenvalues = residual_only
            try:
                d32, s32 = opt.direction(G, s32)
            finally:
                InverseRootConfig.root_and_eigenvalues = with_test
        warned += sum(isinstance(w.message, InverseRootWarning) for w in caught)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            d64, s64 = opt.direction(G.astype(np.float64), s64)
        reference_warned += sum(isinstance(w.message, InverseRootWarning) for w in caught)
        errors.append(np.linalg.norm(d32 - d64) / np.linalg.norm(d64))
        for factor in (s64.P, s64.Q):
            w = np.linalg.eigvalsh(factor)
            kappa = max(kappa, w[-1] / w[0])
    return float(np.median(errors)), float(np.max(errors)), warned, kappa, reference_warned


def stopping_step(shape: tuple, rank, scale: float, eigenvalue_test: bool, steps: int = 30):
    """The step at which the default float32 run (``max_failures=10``) raises ``InverseRootError``, or ``None``."""
    with_test = InverseRootConfig.root_and_eigenvalues
    if not eigenvalue_test:
        InverseRootConfig.root_and_eigenvalues = lambda self, A: (with_test(self, A)[0], None)
    try:
        rng = np.random.default_rng(0)
        opt = FISMO()
        state = opt.init(np.zeros(shape, np.float32))
        for t in range(steps):
            if rank is None:
                G = rng.standard_normal(shape)
            else:
                G = rng.standard_normal((shape[0], rank)) @ rng.standard_normal((rank, shape[1]))
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", InverseRootWarning)
                try:
                    _, state = opt.direction((G * scale).astype(np.float32), state)
                except InverseRootError:
                    return t + 1
        return None
    finally:
        InverseRootConfig.root_and_eigenvalues = with_test


def trajectories() -> None:
    print("| shape | gradient | scale | max kappa (float64) | float64 warnings "
          "| without the eigenvalue test: median, max error, warnings | with it: median, max error, warnings "
          "| the default run stops at step (without, with) |")
    print("|---|---|---|---|---|---|---|---|")
    for shape, rank, scales in TRAJECTORY_CASES:
        for scale in scales:
            old = trajectory(shape, rank, scale, False)
            new = trajectory(shape, rank, scale, True)
            print(f"| {shape[0]}x{shape[1]} | {'Gaussian' if rank is None else f'rank {rank}'} | {scale:g} "
                  f"| {old[3]:.2g} | {old[4]} | {old[0]:.2g}, {old[1]:.2g}, {old[2]} | {new[0]:.2g}, {new[1]:.2g}, {new[2]} "
                  f"| {stopping_step(shape, rank, scale, False)}, {stopping_step(shape, rank, scale, True)} |",
                  flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trajectories", action="store_true", help="the 30-step runs with and without the test")
    args = parser.parse_args()
    warnings.simplefilter("ignore", category=FactorSizeWarning)  # the 1x1000 case's 1000x1000 Q, on purpose
    np.seterr(invalid="ignore")  # the sqrt of a negative eigenvalue, which the check then fails
    trajectories() if args.trajectories else main()
