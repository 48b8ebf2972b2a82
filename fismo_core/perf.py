"""Cost model of a FISMO step: floating-point operations by line of Algorithm 1, and state size.

The counts follow the products the code forms (``fismo_core.optimizer``,
``fismo_core.linalg``), a product ``(p, q) @ (q, r)`` counting ``2 p q r``
operations. Elementwise work (``O(m n + m^2 + n^2)``) is left out: it is a
vanishing fraction for large matrices. ``eigh`` is not a matrix product;
its count is kept apart (``"eigh"``) under the usual convention of
``9 d^3`` for eigenvalues and eigenvectors of a symmetric ``d x d`` matrix
(Golub and Van Loan, *Matrix Computations*, 4th ed., section 8.3), so it can
be included or not. ``tests/test_perf.py`` checks the product counts
against torch's own FLOP counter on a real step.

The page "Performance" of the documentation uses these counts for the
achieved FLOP/s of a step.
"""

from __future__ import annotations

from typing import Optional

from . import linalg
from .optimizer import FISMO, _checks_roots

__all__ = ["EIGH_FLOPS_PER_CUBE", "muon_flops", "polar_flops", "inverse_sqrt_flops", "state_elements", "step_flops"]

#: Conventional operation count of a symmetric eigendecomposition with vectors, per ``d^3``.
EIGH_FLOPS_PER_CUBE = 9


def _mm(p: int, q: int, r: int) -> int:
    return 2 * p * q * r


def polar_flops(m: int, n: int, steps: int = 5) -> int:
    """Products of ``linalg.polar`` (Newton–Schulz) on an ``m x n`` matrix: per step ``4 a^2 b + 2 a^3``,
    ``a = min(m, n)``, ``b = max(m, n)`` (the Gram matrix is formed on the short side)."""
    a, b = min(m, n), max(m, n)
    return steps * (_mm(a, b, a) + _mm(a, a, a) + _mm(a, a, b))


def inverse_sqrt_flops(d: int, method: str = "eigh", steps: Optional[int] = None, coefficients="polar_express") -> dict:
    """Operations of ``linalg.inverse_sqrt`` on a ``d x d`` matrix: ``{"matmul": ..., "eigh": ...}``.

    ``"eigh"``: the eigendecomposition (``9 d^3``, kept apart) and ``V diag(w^{-1/2}) V^T`` (one product).
    ``"newton_schulz"``: ``k`` steps of ``T = a I + b X + c X^2``, ``Y <- Y T``, ``Z <- T Z`` with
    ``X = Z Y``; the first step has ``Z = I`` (no ``Z Y``, no ``T Z``), the last skips ``Y T``, and a
    triple with ``c = 0`` (the cubic) skips ``X^2``.
    """
    cube = _mm(d, d, d)
    if method == "eigh":
        return {"matmul": cube, "eigh": EIGH_FLOPS_PER_CUBE * d**3}
    steps = linalg.inverse_sqrt_steps(coefficients, steps)
    schedule, _ = linalg.newton_schulz_schedule(coefficients, steps)
    products = 0
    for k, (_, _, c) in enumerate(schedule):
        first, last = k == 0, k == steps - 1
        products += (0 if first else 1) + (1 if c else 0) + (0 if last else 1) + (0 if first else 1)
    return {"matmul": products * cube, "eigh": 0}


def step_flops(m: int, n: int, optimizer: Optional[FISMO] = None, *, refresh_roots: bool = True) -> dict:
    """Operations of one ``FISMO.direction`` + line 9 on an ``m x n`` matrix, by line of Algorithm 1.

    Returns a dict with the keys ``"line 4"``, ``"line 5"`` (Gram products and preconditioner
    update, without the roots), ``"roots"`` (matrix products of both inverse roots, with their
    fault checks when on), ``"eigh"`` (the eigendecompositions, if any, ``9 d^3`` each),
    ``"line 6"``, ``"line 8"`` (polar factor and un-whitening) and ``"total"`` (everything,
    ``eigh`` included). ``refresh_roots=False`` is a step of ``InverseRootConfig(every=k)`` that
    reuses the cached roots (for ``m < n`` its line 6 is then ``P^{-1/2} (G Q^{-1/2})``, reusing
    line 4's product). For a batch of ``B`` matrices multiply by ``B``.
    """
    opt = FISMO() if optimizer is None else optimizer
    flops = {"line 4": 0, "line 5": 0, "roots": 0, "eigh": 0, "line 6": 0, "line 8": 0}
    if opt.gamma != 1.0:
        flops["line 4"] = _mm(m, n, n) + _mm(m, n, m)  # G Q^{-1/2}, then its Gram matrix
        flops["line 5"] = _mm(m, m, n) + _mm(n, m, n)  # P^{-1/2} G, then its Gram matrix
        if refresh_roots:
            config = opt.inv_root
            checks = _checks_roots(config, opt.nonfinite)
            for d in (m, n):
                root = inverse_sqrt_flops(d, config.method, config.steps, config.coefficients)
                flops["roots"] += root["matmul"] + (2 * _mm(d, d, d) if checks else 0)  # ||Z A Z - I||
                flops["eigh"] += root["eigh"]
    else:
        flops["line 5"] = _mm(m, m, n)  # P^{-1/2} G only
    cached_wide = opt.gamma != 1.0 and not refresh_roots and m < n
    flops["line 6"] = _mm(m, m, n) if cached_wide else _mm(m, n, n)  # P^{-1/2} (G Q^{-1/2}) : (P^{-1/2} G) Q^{-1/2}
    polar = opt.polar
    polar_products = polar_flops(m, n, polar.steps) if polar.method == "newton_schulz" else 0
    flops["line 8"] = polar_products + _mm(m, m, n) + _mm(m, n, n)
    flops["total"] = sum(flops.values())
    return flops


def muon_flops(m: int, n: int, steps: int = 5) -> int:
    """Products of one Muon step (``torch.optim.Muon``): its Newton–Schulz polar factor only."""
    return polar_flops(m, n, steps)


def state_elements(m: int, n: int) -> int:
    """Array elements of a FISMO state for one ``m x n`` matrix: ``P``, ``Q``, their roots and ``M``.

    ``2 m^2 + 2 n^2 + m n`` (plus two int32 counters). Per parameter that is
    ``1 + 2 (m^2 + n^2) / (m n)`` elements: 5 for a square matrix.
    """
    return 2 * m * m + 2 * n * n + m * n
