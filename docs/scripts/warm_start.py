"""Why the Newton–Schulz inverse root is not warm-started from the previous step's root.

The coupled iteration converges to ``A^{-1/2}`` from starts that commute with ``A`` (``Z_0 = I``
or any function of ``A``). The previous root ``Z = P_{t-1}^{-1/2}`` does not commute with
``P_t``. This script tracks ``P_t`` along a FISMO trajectory (exact roots, NumPy float64,
``fismo_core.testing.reference_gradients`` at 64 x 96, the gradients of the page "Performance")
and measures two warm starts against ``eigh`` of ``P_t``:

* the coupled (cubic) iteration started at ``Z_0 = Z``, ``Y_0 = P_t Z / c``;
* the exact whitener ``X = Z (Z P_t Z)^{-1/2}`` (``X X^T = P_t^{-1}`` exactly, but
  ``X = P_t^{-1/2} U`` for a rotation ``U``), symmetrised.

Each is measured once from the exact previous root (one step's error) and fed back along the
trajectory (what a warm start would do).

    python docs/scripts/warm_start.py     # a few seconds
"""

from __future__ import annotations

import argparse

import numpy as np

from fismo_core import FISMO
from fismo_core.testing import reference_gradients


def rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def exact_root(A: np.ndarray) -> np.ndarray:
    w, V = np.linalg.eigh(A)
    return (V / np.sqrt(w)) @ V.T


def coupled_from(A: np.ndarray, Z0: np.ndarray, steps: int = 10) -> np.ndarray:
    """The coupled cubic iteration on A / c started at Z = Z0 sqrt(c), Y = A Z / c."""
    c = np.linalg.norm(A)
    Z = Z0 * np.sqrt(c)
    Y = A @ Z / c
    for _ in range(steps):
        T = (3 * np.eye(len(A)) - Z @ Y) / 2
        Y, Z = Y @ T, T @ Z
    return Z / np.sqrt(c)


def symmetric_whitener(A: np.ndarray, Z0: np.ndarray) -> np.ndarray:
    X = Z0 @ exact_root(Z0 @ A @ Z0)
    return (X + X.T) / 2


def main() -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()  # --help; no options
    shape, steps = (64, 96), 300
    opt = FISMO(nonfinite="propagate")
    state = opt.init(np.zeros(shape))
    Ps = []
    for G in reference_gradients(shape, steps):
        _, state = opt.direction(G, state)
        Ps.append(state.P.copy())
    print(f"P_t along {steps} steps at {shape[0]}x{shape[1]}: condition number {np.linalg.cond(Ps[0]):.1f} "
          f"at t = 1, {np.linalg.cond(Ps[-1]):.0f} at t = {steps}\n")
    print("| warm start | one step from the exact previous root: median, max | fed back: error at t = 2, 50, max |")
    print("|---|---|---|")
    for name, warm in (("coupled iteration from Z_{t-1} (10 cubic steps)", coupled_from),
                       ("sym(Z (Z P_t Z)^{-1/2})", symmetric_whitener)):
        one = np.array([rel(warm(Ps[i], exact_root(Ps[i - 1])), exact_root(Ps[i])) for i in range(1, steps)])
        Z, fed = exact_root(Ps[0]), []
        with np.errstate(all="ignore"):
            for P in Ps[1:]:
                Z = warm(P, Z)
                fed.append(rel(Z, exact_root(P)))
        fed = np.array(fed)
        worst = "diverges (inf/NaN)" if not np.all(np.isfinite(fed)) else f"{fed.max():.1e}"
        print(f"| {name} | {np.median(one):.1e}, {one.max():.1e} | {fed[0]:.1e}, {fed[48]:.1e}, {worst} |")


if __name__ == "__main__":
    main()
