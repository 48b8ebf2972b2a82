"""The Kronecker factors ``P`` and ``Q`` of Algorithm 1 as small objects, one per structure.

A *structure* says how one side's factor is stored and how lines 4–8 act on
it; the arrays themselves live in [`FISMOState`][fismo_core.FISMOState].
Every structure satisfies one contract, the protocol `KroneckerFactor`, so
the step reads as Algorithm 1 whatever the structure:

- ``identity``: ``P_0 = I``;
- ``update``: lines 4 and 5, ``P_t = sym(m P~_t / tr P~_t)`` with
  ``P~_t = gamma P_{t-1} + (1 - gamma) L_t`` and the damping of ``L_t``;
- ``inverse_sqrt``: ``P_t^{-1/2}`` (fault handling: [`fismo_core.guards`][]);
- ``left`` and ``right``: ``P^{-1/2} X`` and ``X Q^{-1/2}``;
- ``parts``, ``from_parts``, ``part_shapes``: the arrays a factor is stored
  as (the state's fields and a checkpoint's keys).

Two structures exist. `FullFactor` is the paper's: one dense ``d x d``
matrix. `BlockDiagonalFactor` keeps only the diagonal blocks (size ``B``,
the last block holding the remainder, as Distributed Shampoo's
``max_preconditioner_dim``): nothing of size ``d x d`` is formed, the
statistics cost ``O(m n B)`` and the roots one batched call per block size.
Theorem 2 holds for any symmetric positive definite ``P`` and ``Q``, so the
step stays the exact steepest descent for the block-diagonal metric.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Callable, NamedTuple, Optional, Protocol, Union, runtime_checkable

from array_api_compat import array_namespace

from .linalg import Array, _check_integer, _device

__all__ = [
    "BlockDiagonalFactor",
    "Blocks",
    "FullFactor",
    "KroneckerFactor",
    "factor_structure",
    "state_size",
    "to_dense",
]


class Blocks(NamedTuple):
    """A block-diagonal factor (or its root): ``full`` ``(..., k, B, B)``, the ``k`` blocks of size ``B``,
    and ``rest`` ``(..., r, r)``, the last block of size ``r = d - k B`` (``None`` when ``B`` divides ``d``)."""

    full: Array
    rest: Optional[Array] = None


Factor = Union[Array, Blocks]
"""One side's factor as stored in the state: an array (`FullFactor`) or `Blocks`."""


@runtime_checkable
class KroneckerFactor(Protocol):
    """The contract of a structure of one Kronecker factor, ``P`` (``d = m``) or ``Q`` (``d = n``).

    [`FISMO`][fismo_core.FISMO] reaches a factor only through these members,
    so a new structure (say, another sparsity pattern) that satisfies them
    runs lines 4–8 and every guard unchanged. Symbols are Algorithm 1's,
    written for ``P``; every array may carry leading batch dimensions.
    `FullFactor` (the paper's) and `BlockDiagonalFactor` satisfy it
    (``tests/test_one_home.py`` checks members and signatures).
    """

    d: int
    """The side's size: ``P`` and its root are ``d x d`` (as a whole)."""

    def parts(self, factor: Factor) -> tuple[Array, ...]:
        """The arrays ``factor`` is stored as, each a stack of square blocks; ``from_parts`` inverts it."""
        ...

    def from_parts(self, parts: tuple[Array, ...]) -> Factor:
        """The factor (as kept in `FISMOState`) from its arrays, in the order of ``parts``."""
        ...

    def part_shapes(self) -> tuple[tuple[int, ...], ...]:
        """The trailing shape of each part after the batch: ``(d, d)``, or ``(k, B, B)`` and ``(r, r)`` for blocks."""
        ...

    def identity(self, xp: Any, batch: tuple[int, ...], dtype: Any, dev: Any) -> Factor:
        """``P_0 = I_d`` for every matrix of the batch, in namespace ``xp`` with ``dtype`` on ``dev``."""
        ...

    def update(self, A: Factor, X: Array, divisor: int, gamma: float, mu: float, inv_s2: Any) -> Factor:
        """Line 4 (``P``) or 5 (``Q``): ``P_t = sym(d P~_t / tr P~_t)``, ``P~_t = gamma P_{t-1} + (1 - gamma) L_t``.

        ``L_t = X X^T / divisor + mu tr(P_{t-1})/d I`` with
        ``X = G Q_{t-1}^{-1/2}`` and ``divisor = n`` for ``P``
        (``X = (P_t^{-1/2} G)^T``, ``divisor = m`` for ``Q``); ``X`` may be
        scaled by ``1/s`` with ``inv_s2 = 1/s^2``, which the result does not
        depend on (see `FullFactor.update`).
        """
        ...

    def inverse_sqrt(self, A: Factor, root: Callable[[Array], Array]) -> Factor:
        """``P_t^{-1/2}``, applying ``root`` (an inverse square root of a stack of matrices) to each part."""
        ...

    def left(self, Z: Factor, X: Array) -> Array:
        """``Z X`` for ``Z = P^{-1/2}`` of this structure and ``X`` ``(..., d, c)``: lines 6 and 8's left factor."""
        ...

    def right(self, X: Array, Z: Factor) -> Array:
        """``X Z`` for ``X`` ``(..., c, d)`` and ``Z = Q^{-1/2}`` of this structure: lines 6 and 8's right factor."""
        ...


def _product(a: Array, b: Array, matmul_dtype: Optional[str]) -> Array:
    """``a @ b``; with ``matmul_dtype`` (a dtype name such as ``"bfloat16"``) computed in that dtype and
    returned in ``a``'s (``InverseRootConfig.matmul_dtype``). ``None``: ``a @ b`` as it is, bit for bit."""
    xp = array_namespace(a, b)  # also refuses two libraries (torch's @ took a NumPy b and returned a tensor)
    if matmul_dtype is None:
        return a @ b
    from .linalg import _resolve_dtype  # the polar's dtype names, resolved in a's library

    dtype = _resolve_dtype(xp, matmul_dtype, "inverse-root matmul_dtype")
    return xp.astype(xp.astype(a, dtype, copy=False) @ xp.astype(b, dtype, copy=False), a.dtype, copy=False)


def _gram(X: Array, matmul_dtype: Optional[str]) -> Array:
    """``X X^T``, as `_product` (``X`` cast once)."""
    xp = array_namespace(X)
    if matmul_dtype is None:
        return X @ xp.matrix_transpose(X)
    from .linalg import _resolve_dtype

    low = xp.astype(X, _resolve_dtype(xp, matmul_dtype, "inverse-root matmul_dtype"), copy=False)
    return xp.astype(low @ xp.matrix_transpose(low), X.dtype, copy=False)


def _data_term(xp: Any, X: Array, A: Array, d: int, owner: object) -> Array:
    """``X`` of ``update`` checked against the factor of side ``d`` and taken in ``A``'s precision or wider.

    ``X`` must have ``d`` rows (a blocked factor dropped the others, or
    returned a factor of another shape) and a real floating dtype (an
    integer ``X`` made float64 on NumPy and float32 elsewhere); a narrower
    ``X`` is widened before its Gram product (float16 ``X X^T`` overflowed to
    NaN in a float32 factor). Shapes and dtypes only: nothing is read.
    """
    _check_rows(X, d, owner)
    if X.dtype != A.dtype:
        if not xp.isdtype(X.dtype, "real floating"):
            raise TypeError(f"{owner!r}: X must be a real floating array, got {X.dtype}")
        X = xp.astype(X, xp.result_type(X.dtype, A.dtype))
    return X


def _check_factor(A: Optional[Array], shape: tuple[int, ...], owner: object) -> None:
    """A ``ValueError`` unless ``A`` (one part of a factor) ends in ``shape`` (`KroneckerFactor.part_shapes`)."""
    if A is None or A.ndim < len(shape) or tuple(A.shape[A.ndim - len(shape):]) != shape:
        wanted = ", ".join(map(str, shape))
        got = "no such part" if A is None else tuple(A.shape)
        raise ValueError(f"{owner!r}: the factor must have shape (..., {wanted}), got {got}")


def _check_rows(X: Array, d: int, owner: object, *, from_the_right: bool = False) -> None:
    """A ``ValueError`` unless ``X`` is ``(..., d, c)`` (``(..., c, d)`` ``from_the_right``): what a side of
    size ``d`` multiplies (a blocked factor dropped the other rows; shapes only, nothing is read)."""
    axis, wanted = (-1, f"(..., c, {d})") if from_the_right else (-2, f"(..., {d}, c)")
    if X.ndim < 2 or X.shape[axis] != d:
        raise ValueError(f"{owner!r}: X must have shape {wanted} for a side of size d={d}, got {tuple(X.shape)}")


def _trace(xp: Any, A: Array) -> Array:
    """``tr A`` of matrices ``(..., d, d)`` as ``(..., 1, 1)``."""
    return xp.linalg.trace(A)[..., None, None]


class FullFactor:
    """The paper's Kronecker factor: one symmetric positive definite ``d x d`` matrix per parameter.

    ``matmul_dtype``: the dtype of the Gram product of ``update`` and of ``left`` and ``right``
    (``InverseRootConfig.matmul_dtype``); ``None``, the default, is the operands' own.
    """

    def __init__(self, d: int, matmul_dtype: Optional[str] = None) -> None:
        self.d = _check_integer("d", d)
        self.matmul_dtype = matmul_dtype

    def __repr__(self) -> str:
        dtype = "" if self.matmul_dtype is None else f", matmul_dtype={self.matmul_dtype!r}"
        return f"FullFactor({self.d}{dtype})"

    def parts(self, factor: Array) -> tuple[Array, ...]:
        """The arrays of ``factor``, each a stack of square blocks (here one block per matrix)."""
        return (factor,)

    def from_parts(self, parts: tuple[Array, ...]) -> Array:
        return parts[0]

    def part_shapes(self) -> tuple[tuple[int, int], ...]:
        """The trailing ``(d_i, d_i)`` shape of each part, after the batch and, for blocks, the block axis."""
        return ((self.d, self.d),)

    def identity(self, xp: Any, batch: tuple[int, ...], dtype: Any, dev: Any) -> Array:
        """``P_0 = I_d`` for every matrix of the batch."""
        return xp.zeros((*batch, self.d, self.d), dtype=dtype, device=dev) + xp.eye(self.d, dtype=dtype, device=dev)

    def update(self, A: Array, X: Array, divisor: int, gamma: float, mu: float, inv_s2: Any) -> Array:
        """Line 4 (``P``) or 5 (``Q``): ``A_t`` from ``A_{t-1}`` and the data term ``X X^T / divisor``.

        For ``P``, ``X = G Q_{t-1}^{-1/2}`` and ``divisor = n``; for ``Q``,
        ``X = (P_t^{-1/2} G)^T`` and ``divisor = m``. ``X`` may be scaled by
        ``1/s`` (``inv_s2 = 1/s^2``, see `fismo_core.guards.statistics_scale`):
        the EMA then takes ``A_{t-1} / s^2``, which trace normalisation maps
        to the same ``A_t``. In one linear combination, with
        ``a = gamma / s^2``, ``b = (1 - gamma) / divisor``,
        ``c = (1 - gamma) mu tr(A_{t-1}) / (d s^2)`` and
        ``k = d / (a tr A_{t-1} + b tr(X X^T) + c d)``:
        ``A_t = sym(k A~_t) = k a A_{t-1} + (k b / 2)(X X^T + (X X^T)^T) + k c I``.
        """
        xp = array_namespace(A, X)
        _check_factor(A, (self.d, self.d), self)
        gram = _gram(_data_term(xp, X, A, self.d, self), self.matmul_dtype)
        return _combine(xp, A, gram, _trace(xp, A), _trace(xp, gram), divisor, gamma, mu, inv_s2, self.d)

    def inverse_sqrt(self, A: Array, root: Callable[[Array], Array]) -> Array:
        """``A^{-1/2}`` by ``root`` (an [`InverseRootConfig`][fismo_core.InverseRootConfig])."""
        return root(A)

    def left(self, Z: Array, X: Array) -> Array:
        """``Z X``: a root applied from the left (``P^{-1/2} X``)."""
        _check_rows(X, self.d, self)
        return _product(Z, X, self.matmul_dtype)

    def right(self, X: Array, Z: Array) -> Array:
        """``X Z``: a root applied from the right (``X Q^{-1/2}``)."""
        _check_rows(X, self.d, self, from_the_right=True)
        return _product(X, Z, self.matmul_dtype)


class BlockDiagonalFactor:
    """A Kronecker factor kept block-diagonal: blocks of size ``block_size``, the last one the remainder.

    Stored as `Blocks`. ``d <= block_size`` is one block, which is
    `FullFactor` (see `factor_structure`); this class is for ``d > block_size``.
    """

    def __init__(self, d: int, block_size: int, matmul_dtype: Optional[str] = None) -> None:
        d, block_size = _check_integer("d", d), _check_integer("block_size", block_size)
        if not 0 < block_size < d:
            raise ValueError(f"a block-diagonal factor needs 0 < block_size < d, got block_size={block_size}, d={d}")
        self.d, self.B = d, block_size
        self.k, self.r = divmod(d, block_size)
        self.matmul_dtype = matmul_dtype

    def __repr__(self) -> str:
        dtype = "" if self.matmul_dtype is None else f", matmul_dtype={self.matmul_dtype!r}"
        return f"BlockDiagonalFactor({self.d}, block_size={self.B}{dtype})"

    def parts(self, factor: Blocks) -> tuple[Array, ...]:
        return (factor.full,) if self.r == 0 else (factor.full, factor.rest)

    def from_parts(self, parts: tuple[Array, ...]) -> Blocks:
        return Blocks(parts[0], parts[1] if self.r else None)

    def part_shapes(self) -> tuple[tuple[int, ...], ...]:
        full = (self.k, self.B, self.B)
        return (full,) if self.r == 0 else (full, (self.r, self.r))

    def identity(self, xp: Any, batch: tuple[int, ...], dtype: Any, dev: Any) -> Blocks:
        parts = [xp.zeros((*batch, *shape), dtype=dtype, device=dev) + xp.eye(shape[-1], dtype=dtype, device=dev)
                 for shape in self.part_shapes()]
        return self.from_parts(tuple(parts))

    def _split_rows(self, X: Array) -> tuple[Array, Optional[Array]]:
        """Rows of ``X`` ``(..., d, c)`` by block: ``(..., k, B, c)`` and the remainder ``(..., r, c)``."""
        xp = array_namespace(X)
        _check_rows(X, self.d, self)
        kB = self.k * self.B
        full = xp.reshape(X[..., :kB, :], (*X.shape[:-2], self.k, self.B, X.shape[-1]))
        return full, (X[..., kB:, :] if self.r else None)

    def _join_rows(self, full: Array, rest: Optional[Array]) -> Array:
        xp = array_namespace(full)
        joined = xp.reshape(full, (*full.shape[:-3], self.k * self.B, full.shape[-1]))
        return joined if rest is None else xp.concat((joined, rest), axis=-2)

    def update(self, A: Blocks, X: Array, divisor: int, gamma: float, mu: float, inv_s2: Any) -> Blocks:
        """Line 4 or 5 with only the diagonal blocks of the data term ``X X^T / divisor``.

        Damping, EMA, symmetrisation and trace normalisation act on the whole
        block-diagonal factor exactly as in `FullFactor.update`: one trace
        over all blocks, so ``tr A_t = d``.
        """
        xp = array_namespace(A.full, X)
        for part, shape in zip(self.parts(A), self.part_shapes()):
            _check_factor(part, shape, self)
        X_full, X_rest = self._split_rows(_data_term(xp, X, A.full, self.d, self))
        grams = [_gram(X_full, self.matmul_dtype)]
        if X_rest is not None:
            grams.append(_gram(X_rest, self.matmul_dtype))
        parts = self.parts(A)
        # One trace over all blocks, per matrix (..., 1, 1); the full part's blocks carry an extra axis.
        trace_prev, trace_gram = _total_trace(xp, parts), _total_trace(xp, grams)
        new_parts = []
        for i, (part, gram) in enumerate(zip(parts, grams)):
            over = _over_blocks if i == 0 else (lambda x: x)
            new_parts.append(
                _combine(xp, part, gram, over(trace_prev), over(trace_gram), divisor, gamma, mu, over(inv_s2), self.d)
            )
        return self.from_parts(tuple(new_parts))

    def inverse_sqrt(self, A: Blocks, root: Callable[[Array], Array]) -> Blocks:
        """One batched root per block size: all ``k`` full blocks in one call, the remainder in another."""
        return self.from_parts(tuple(root(p) for p in self.parts(A)))

    def left(self, Z: Blocks, X: Array) -> Array:
        """``Z X`` for block-diagonal ``Z``: each block of rows of ``X`` times its block (``O(d B c)``)."""
        X_full, X_rest = self._split_rows(X)
        dtype = self.matmul_dtype
        return self._join_rows(
            _product(Z.full, X_full, dtype), None if X_rest is None else _product(Z.rest, X_rest, dtype)
        )

    def right(self, X: Array, Z: Blocks) -> Array:
        """``X Z = (Z^T X^T)^T`` for block-diagonal ``Z``."""
        xp = array_namespace(X)
        _check_rows(X, self.d, self, from_the_right=True)
        Zt = Blocks(xp.matrix_transpose(Z.full), None if Z.rest is None else xp.matrix_transpose(Z.rest))
        return xp.matrix_transpose(self.left(Zt, xp.matrix_transpose(X)))


def _over_blocks(x: Any) -> Any:
    """A per-matrix scalar ``(..., 1, 1)`` as ``(..., 1, 1, 1)``, to broadcast over the block axis."""
    return x[..., None] if hasattr(x, "ndim") else x


def _total_trace(xp: Any, parts: Sequence[Array]) -> Array:
    """The trace of a block-diagonal matrix given as its parts (the full blocks first), per matrix ``(..., 1, 1)``."""
    total = xp.sum(xp.linalg.trace(parts[0]), axis=-1)
    for part in parts[1:]:
        total = total + xp.linalg.trace(part)
    return total[..., None, None]


def _combine(
    xp: Any, A: Array, gram: Array, trace_prev: Any, trace_gram: Any, divisor: int, gamma: float, mu: float,
    inv_s2: Any, d: int,
) -> Array:
    """``k a A + (k b / 2)(gram + gram^T) + k c I``: lines 4–5's EMA, damping, ``sym`` and normalisation to trace ``d``."""
    a = gamma * inv_s2
    b = (1 - gamma) / divisor
    c = (1 - gamma) * mu * trace_prev / d * inv_s2
    k = d / (a * trace_prev + b * trace_gram + c * d)
    eye = xp.eye(A.shape[-1], dtype=A.dtype, device=_device(A))
    return (k * a) * A + (k * (b / 2)) * (gram + xp.matrix_transpose(gram)) + (k * c) * eye


Structure = KroneckerFactor
"""The type of a structure in hints: any `KroneckerFactor` (`FullFactor` or `BlockDiagonalFactor` here)."""


def factor_structure(d: int, block_size: Optional[int], matmul_dtype: Optional[str] = None) -> KroneckerFactor:
    """The structure of a side of size ``d``: full if ``block_size`` is ``None`` or ``d <= block_size``.

    ``matmul_dtype``: the dtype of its products (``InverseRootConfig.matmul_dtype``; ``None``: the operands').
    ``d`` and ``block_size`` are checked as ``FISMO(block_size=...)`` checks them (``2.5``, ``True`` and
    ``"4"`` were taken, and failed later or gave meaningless sizes)."""
    d = _check_integer("d", d)
    block_size = _check_integer("block_size", block_size, none_means="full factors")
    if block_size is None or d <= block_size:
        return FullFactor(d, matmul_dtype)
    return BlockDiagonalFactor(d, block_size, matmul_dtype)


def to_dense(factor: Factor) -> Array:
    """The factor as a dense ``(..., d, d)`` matrix (block-diagonal for `Blocks`); for tests and verification."""
    if not isinstance(factor, Blocks):
        return factor
    xp = array_namespace(factor.full)
    *batch, k, B, _ = factor.full.shape
    blocks = [factor.full[..., i, :, :] for i in range(k)]
    if factor.rest is not None:
        blocks.append(factor.rest)
    d = sum(b.shape[-1] for b in blocks)
    rows, start = [], 0
    for b in blocks:
        size = b.shape[-1]
        zeros = lambda w: xp.zeros((*batch, size, w), dtype=b.dtype, device=_device(b))  # noqa: E731
        row = [x for x in (zeros(start) if start else None, b, zeros(d - start - size) if d - start - size else None)
               if x is not None]
        rows.append(xp.concat(row, axis=-1))
        start += size
    return xp.concat(rows, axis=-2)


def state_size(m: int, n: int, block_size: Optional[int] = None) -> int:
    """Elements FISMO keeps per ``m x n`` matrix: ``P``, ``Q``, their two roots and ``M``.

    ``2 (m^2 + n^2) + m n`` for full factors; with blocks of size ``B`` each
    side of size ``d > B`` keeps ``k B^2 + r^2 <= d B`` per array, so the
    total is at most ``m n + 2 (m + n) B``.
    """
    total = _check_integer("m", m) * _check_integer("n", n)
    for d in (m, n):
        structure = factor_structure(d, block_size)
        total += 2 * sum(math.prod(shape) for shape in structure.part_shapes())
    return total
