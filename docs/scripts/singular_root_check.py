"""The inverse-root check against a numerically singular factor (docs/guarantees.md, "Known gap").

A 6x5 gradient scaled to 1e30 (1e20) makes P_t numerically singular: no float
format resolves its smallest eigenvalue. The documented behaviour is that the
root fails its check and the previous factor is kept with a warning. This
prints, per backend and dtype, whether that happened (warnings, root_failures),
P's extreme eigenvalues, and the direction's distance from Algorithm 1 computed
in 120-digit arithmetic (mpmath) on the same float32-rounded gradient.

    python docs/scripts/singular_root_check.py     # a few seconds
"""

from __future__ import annotations

import warnings

import mpmath as mp
import numpy as np
import torch

from fismo_core import FISMO

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


if __name__ == "__main__":
    main()
