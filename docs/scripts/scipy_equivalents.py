"""The largest errors of the SciPy equivalents on the Matrix functions page, and the `polar` row's limit.

On the tests' matrices (16 x 16, 8 x 24, 24 x 8; 16 x 16 for the roots), on
every CPU backend: the largest relative error of ``polar(X, method="svd")``
against ``scipy.linalg.polar`` and of ``inverse_sqrt(A, method="eigh")``
against ``scipy.linalg.fractional_matrix_power(A, -0.5)`` and
``inv(sqrtm(A))``, in units of ``eps`` at ``kappa = 1`` and of ``eps * kappa``
(``kappa'`` for the roots) above. Then, past the default cut (float32,
``kappa >= 1 / (max(m, n) eps)``), each error over the row's bound
``eps (50 + 2 kappa)`` with the default ``rtol`` and with ``rtol=0``.

    python docs/scripts/scipy_equivalents.py    # most of it the 1000 x 1000 SVDs
"""

from __future__ import annotations

import argparse

import numpy as np
import scipy.linalg

from fismo_core.linalg import inverse_sqrt, polar
from fismo_core.testing import targets, to_numpy


def haar(rng: np.random.Generator, n: int) -> np.ndarray:
    """A Haar-random orthogonal ``n x n`` matrix."""
    q, r = np.linalg.qr(rng.standard_normal((n, n)))
    return q * np.sign(np.diag(r))


def relative_error(got: np.ndarray, ref: np.ndarray) -> float:
    return float(np.linalg.norm(got - ref) / np.linalg.norm(ref))


def with_singular_values(rng: np.random.Generator, m: int, n: int, kappa: float) -> np.ndarray:
    """An ``m x n`` matrix with singular values geometric from 1 down to ``1 / kappa``."""
    r = min(m, n)
    return (haar(rng, m)[:, :r] * np.geomspace(1, 1 / kappa, r)) @ haar(rng, n)[:, :r].T


def tested_shapes(cpu: list) -> dict[str, float]:
    """The largest error / eps at kappa = 1 and / (eps kappa) above, over the tests' matrices."""
    worst = {"at 1": 0.0, "above": 0.0}
    for t in cpu:
        eps = float(np.finfo(t.dtype).eps)
        for kappa in (1, 1e2, 1e4) + ((1e6, 1e8) if t.dtype == "float64" else ()):
            key = "at 1" if kappa == 1 else "above"
            for seed in range(3):
                for m, n in ((16, 16), (8, 24), (24, 8)):
                    X = t.asarray(with_singular_values(np.random.default_rng(seed), m, n, kappa))
                    X_r = to_numpy(X)
                    error = relative_error(to_numpy(polar(X, method="svd")), scipy.linalg.polar(X_r)[0])
                    worst[key] = max(worst[key], error / eps / (1 if kappa == 1 else np.linalg.cond(X_r)))
                V = haar(np.random.default_rng(seed), 16)
                A = (V * np.geomspace(1, 1 / kappa, 16)) @ V.T
                A = t.asarray((A + A.T) / 2)
                A_r = to_numpy(A)
                kappa_f = 1 if kappa == 1 else np.linalg.norm(A_r) / np.linalg.eigvalsh(A_r)[0]
                got = to_numpy(inverse_sqrt(A, method="eigh"))
                for ref in (scipy.linalg.fractional_matrix_power(A_r, -0.5), scipy.linalg.inv(scipy.linalg.sqrtm(A_r))):
                    worst[key] = max(worst[key], relative_error(got, np.real(ref)) / eps / kappa_f)
    return worst


def main() -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()  # --help; no options
    cpu = [t for t in targets() if t.available and t.device in ("cpu", "CPU_DEVICE")]
    worst = tested_shapes(cpu)
    print(f"tested shapes: {worst['at 1']:.2g} eps at kappa = 1, {worst['above']:.2g} eps kappa above", flush=True)
    for m, n in ((100, 1000), (1000, 100), (1000, 1000)):
        for kappa in (1e4, 1e5, 1e6):
            ratio = {None: 0.0, 0.0: 0.0}  # rtol: the default, and 0
            for seed in range(3):
                X64 = with_singular_values(np.random.default_rng(seed), m, n, kappa)
                for t in (t for t in cpu if t.dtype == "float32"):
                    X = t.asarray(X64)
                    u = scipy.linalg.polar(to_numpy(X))[0]
                    bound = np.finfo(np.float32).eps * (50 + 2 * np.linalg.cond(to_numpy(X)))
                    for rtol in ratio:
                        error = relative_error(to_numpy(polar(X, method="svd", rtol=rtol)), u)
                        ratio[rtol] = max(ratio[rtol], error / bound)
            print(f"{m} x {n}, kappa {kappa:.0e}: error / bound {ratio[None]:.2g} (default rtol), "
                  f"{ratio[0.0]:.2g} (rtol=0)", flush=True)


if __name__ == "__main__":
    main()
