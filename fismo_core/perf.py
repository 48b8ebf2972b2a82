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

Block-diagonal factors (``FISMO(block_size=B)``) split a side of size ``d > B``
into blocks of sizes ``b_1, ..., b_k`` (``block_sizes``): a product with a
block-diagonal ``d x d`` factor then costs ``sum b_i^2`` instead of ``d^2`` per
column, an inverse root ``sum b_i^3`` instead of ``d^3``, and the factor holds
``sum b_i^2 <= d B`` elements.

The page "Performance" of the documentation uses these counts for the
achieved FLOP/s of a step.
"""

from __future__ import annotations

from typing import Optional

from . import linalg
from .guards import checks_roots as _checks_roots
from .kronecker import BlockDiagonalFactor, factor_structure, state_size
from .optimizer import FISMO

__all__ = [
    "EIGH_FLOPS_PER_CUBE",
    "block_sizes",
    "inverse_sqrt_flops",
    "muon_flops",
    "muon_state_elements",
    "polar_flops",
    "state_elements",
    "step_flops",
]

#: Conventional operation count of a symmetric eigendecomposition with vectors, per ``d^3``.
EIGH_FLOPS_PER_CUBE = 9


def _sides(**sides: object) -> None:
    """A ``ValueError`` naming the first of ``sides`` (a matrix side or a step count) that is not a positive
    integer: the counts took ``-3``, ``2.5`` and ``True`` and returned negative or fractional numbers
    (a user's hunt, 2026-12-03)."""
    for name, value in sides.items():
        linalg._check_integer(name, value)


def _block_size(block_size: object) -> Optional[int]:
    """``block_size`` checked as ``FISMO(block_size=...)`` checks it (``True`` was taken as 1)."""
    return linalg._check_integer("block_size", block_size, none_means="full factors")


def _mm(p: int, q: int, r: int) -> int:
    return 2 * p * q * r


def block_sizes(d: int, block_size: Optional[int] = None) -> list[int]:
    """The diagonal block sizes of a ``d x d`` factor: ``[d]`` when ``block_size`` is None or
    ``d <= block_size``, else ``d // B`` blocks of ``B`` and, if ``B`` does not divide ``d``, a last
    block of ``d mod B`` (the convention of Distributed Shampoo and ``FISMO(block_size=B)``)."""
    _sides(d=d)
    structure = factor_structure(d, _block_size(block_size))
    if not isinstance(structure, BlockDiagonalFactor):
        return [d]
    return [structure.B] * structure.k + ([structure.r] if structure.r else [])


def _squares(d: int, block_size: Optional[int]) -> int:
    """``sum b_i^2``: the elements of a block-diagonal ``d x d`` factor, and the cost of applying it
    to one vector is twice that."""
    return sum(b * b for b in block_sizes(d, block_size))


def polar_flops(m: int, n: int, steps: int = 5) -> int:
    """Products of ``linalg.polar`` (Newton–Schulz) on an ``m x n`` matrix: per step ``4 a^2 b + 2 a^3``,
    ``a = min(m, n)``, ``b = max(m, n)`` (the Gram matrix is formed on the short side)."""
    _sides(m=m, n=n, steps=steps)
    a, b = min(m, n), max(m, n)
    return steps * (_mm(a, b, a) + _mm(a, a, a) + _mm(a, a, b))


def inverse_sqrt_flops(
    d: int, method: str = "eigh", steps: Optional[int] = None, coefficients: linalg.Coefficients = "polar_express"
) -> dict:
    """Operations of ``linalg.inverse_sqrt`` on a ``d x d`` matrix: ``{"matmul": ..., "eigh": ...}``.

    ``"eigh"``: the eigendecomposition (``9 d^3``, kept apart) and ``V diag(w^{-1/2}) V^T`` (one product).
    ``"newton_schulz"``: ``k`` steps of ``T = a I + b X + c X^2``, ``Y <- Y T``, ``Z <- T Z`` with
    ``X = Z Y``; the first step has ``Z = I`` (no ``Z Y``, no ``T Z``), the last skips ``Y T``, and a
    triple with ``c = 0`` (the cubic) skips ``X^2``.
    """
    _sides(d=d)
    if method not in ("eigh", "newton_schulz"):  # any other name was counted as Newton–Schulz
        raise ValueError(f"method must be 'eigh' or 'newton_schulz', got {method!r}")
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
    ``eigh`` included; with ``polar="svd"`` line 8 has the product ``U V^T`` and not the SVD itself,
    which no product count describes and torch's counter does not see). ``refresh_roots=False`` is a step of ``InverseRootConfig(every=k)`` that
    reuses the cached roots (for ``m < n`` its line 6 is then ``P^{-1/2} (G Q^{-1/2})``, reusing
    line 4's product). For a batch of ``B`` matrices multiply by ``B``.

    With ``optimizer.block_size = B`` every product with a factor or a root costs
    ``2 x sum b_i^2`` per column instead of ``2 x d^2`` (``block_sizes``), lines 4 and 5 form only
    the diagonal blocks of their Gram matrices, and the roots are taken block by block
    (``sum b_i^3`` instead of ``d^3``). The polar factor is that of the whole ``M``: unchanged.
    """
    _sides(m=m, n=n)
    if optimizer is not None and not all(hasattr(optimizer, a) for a in ("gamma", "polar", "inv_root", "nonfinite")):
        # "muon" raised AttributeError: 'str' object has no attribute 'gamma'
        raise TypeError(f"optimizer must be a fismo_core.FISMO (or None: its defaults), got {optimizer!r}; "
                        "for Muon's step see muon_flops")
    opt = FISMO() if optimizer is None else optimizer
    block = getattr(opt, "block_size", None)
    # 2 x (sum of squared block sizes) x (the other side): one product with a (block-)diagonal factor.
    left, right = 2 * n * _squares(m, block), 2 * m * _squares(n, block)  # P-side and Q-side products
    flops = {"line 4": 0, "line 5": 0, "roots": 0, "eigh": 0, "line 6": 0, "line 8": 0}
    if opt.gamma != 1.0:
        flops["line 4"] = right + left  # G Q^{-1/2}, then the diagonal blocks of its Gram matrix
        flops["line 5"] = left + right  # P^{-1/2} G, then the diagonal blocks of its Gram matrix
        if refresh_roots:
            config = opt.inv_root
            checks = _checks_roots(config.fallback, opt.nonfinite)
            for d in (m, n):
                for b in block_sizes(d, block):
                    root = inverse_sqrt_flops(b, config.method, config.steps, config.coefficients)
                    flops["roots"] += root["matmul"] + (2 * _mm(b, b, b) if checks else 0)  # ||Z A Z - I||
                    flops["eigh"] += root["eigh"]
    else:
        flops["line 5"] = left  # P^{-1/2} G only
    cached_wide = opt.gamma != 1.0 and not refresh_roots and m < n
    flops["line 6"] = left if cached_wide else right  # P^{-1/2} (G Q^{-1/2}) : (P^{-1/2} G) Q^{-1/2}
    polar = opt.polar
    # The SVD's polar factor is (U keep) V^T, one m x min(m, n) x n product (until 2026-12-03 not counted).
    polar_products = polar_flops(m, n, polar.steps) if polar.method == "newton_schulz" else _mm(m, min(m, n), n)
    flops["line 8"] = polar_products + left + right
    flops["total"] = sum(flops.values())
    return flops


def muon_flops(m: int, n: int, steps: int = 5) -> int:
    """Products of one Muon step (``torch.optim.Muon``): its Newton–Schulz polar factor only."""
    return polar_flops(m, n, steps)


def state_elements(m: int, n: int, block_size: Optional[int] = None) -> int:
    """Array elements of a FISMO state for one ``m x n`` matrix: ``P``, ``Q``, their roots and ``M``.

    Full factors (``block_size=None``, or ``block_size >= max(m, n)``): ``2 m^2 + 2 n^2 + m n``
    (plus two int32 counters); per parameter that is ``1 + 2 (m^2 + n^2) / (m n)`` elements, 5 for
    a square matrix. Block-diagonal factors keep only their diagonal blocks:
    ``m n + 2 (sum_i a_i^2 + sum_j b_j^2)`` for the block sizes ``a_i`` of ``m`` and ``b_j`` of
    ``n`` (``block_sizes``), which is at most ``m n + 2 (m + n) B``, with equality when ``B``
    divides both sides (or a side is one block of size exactly ``B``).
    """
    _sides(m=m, n=n)
    return state_size(m, n, _block_size(block_size))


def muon_state_elements(m: int, n: int) -> int:
    """Array elements of a Muon state for one ``m x n`` matrix: its momentum buffer, ``m n``."""
    _sides(m=m, n=n)
    return m * n
