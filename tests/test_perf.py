"""The cost model of ``fismo_core.perf``: FLOP counts against torch's own counter, state sizes
against the arrays a state really holds (FISMO's and those of the optimizers it is compared with
on the documentation page "Performance")."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest

from fismo_core import FISMO, perf
from fismo_core.perf import (
    block_sizes,
    inverse_sqrt_flops,
    muon_flops,
    muon_state_elements,
    state_elements,
    step_flops,
)

torch = pytest.importorskip("torch")
from torch.utils.flop_counter import FlopCounterMode  # noqa: E402

from fismo_core.backends.torch import FISMO as TorchFISMO  # noqa: E402

CONFIGS = {
    "default": {},
    "propagate": {"nonfinite": "propagate"},
    "newton_schulz": {"inv_root": "newton_schulz", "nonfinite": "propagate"},
    "newton_schulz-checked": {"inv_root": "newton_schulz"},
    "cubic": {"inv_root": {"method": "newton_schulz", "coefficients": "cubic"}},
    "cubic-7": {"inv_root": {"method": "newton_schulz", "coefficients": "cubic", "steps": 7}},
    "polar_express-polar": {"polar": {"coefficients": "polar_express", "steps": 8}},
    "svd-polar": {"polar": "svd"},  # U V^T was left out of line 8 until 2026-12-03 (a user's hunt)
    "gamma1": {"gamma": 1.0},
    "nesterov-scale-invariant": {"nesterov": True, "statistics": "scale_invariant"},
    # Blocks of 16: 24 = 16 + 8 (a remainder), 40 = 16 + 16 + 8, 16 = one block (the full factor).
    "blocks": {"block_size": 16},
    "blocks-propagate": {"block_size": 16, "nonfinite": "propagate"},
    "blocks-newton_schulz": {"block_size": 16, "inv_root": "newton_schulz", "nonfinite": "propagate"},
    "blocks-divides": {"block_size": 8, "nonfinite": "propagate"},
    "blocks-gamma1": {"block_size": 16, "gamma": 1.0},
    # The products in bfloat16 are the same products: the same count.
    "blocks-bf16-products": {"block_size": 16, "statistics": "scale_invariant", "inv_root": {"matmul_dtype": "bfloat16"}},
}


def counted_flops(opt: FISMO, shape: tuple[int, ...], refresh_roots: bool) -> int:
    """Matrix-product FLOPs of one step as torch's FlopCounterMode sees them (eigh is not counted)."""
    gen = torch.Generator().manual_seed(0)
    W = torch.randn(shape, generator=gen, dtype=torch.float64)
    G = torch.randn(shape, generator=gen, dtype=torch.float64)
    state = opt.init(W)
    with FlopCounterMode(display=False) as counter:
        direction, _ = opt.direction(G, state, refresh_roots=refresh_roots)
        _ = W - opt.lr * direction  # line 9: elementwise, no products
    return counter.get_total_flops()


@pytest.mark.parametrize("refresh_roots", [True, False], ids=["refresh", "cached-roots"])
@pytest.mark.parametrize("shape", [(24, 40), (40, 24), (3, 16, 16)], ids=str)
@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
def test_step_flops_match_torch_flop_counter(config: dict, shape: tuple[int, ...], refresh_roots: bool) -> None:
    """Every product the step forms is in the model, by count and size: exact equality."""
    opt = FISMO(**config)
    *batch, m, n = shape
    model = step_flops(m, n, opt, refresh_roots=refresh_roots)
    assert model["total"] == sum(v for k, v in model.items() if k != "total")
    assert counted_flops(opt, shape, refresh_roots) == math.prod(batch) * (model["total"] - model["eigh"])


def test_flop_model_parts() -> None:
    """The parts the documentation quotes: eigh's 9 d^3 kept apart, the root products per schedule,
    and Muon as FISMO's polar alone."""
    assert inverse_sqrt_flops(100) == {"matmul": 2 * 100**3, "eigh": 9 * 100**3}
    assert inverse_sqrt_flops(100, "newton_schulz")["matmul"] == 33 * 2 * 100**3  # 9 steps: 2 + 7 * 4 + 3
    assert inverse_sqrt_flops(100, "newton_schulz", coefficients="cubic")["matmul"] == 63 * 2 * 100**3  # 22 steps
    square = step_flops(64, 64, FISMO(nonfinite="propagate"))
    # Lines 4-6 and the un-whitening: 7 products of 2 d^3; the roots: one product each; the polar: 5 steps of 6 d^3.
    assert square["total"] - square["eigh"] == (7 + 2) * 2 * 64**3 + muon_flops(64, 64)
    assert muon_flops(64, 64) == 5 * 6 * 64**3


# --- Blocks ---------------------------------------------------------------------------------------


def block_mask(d: int, B: int) -> np.ndarray:
    """The d x d pattern of a block-diagonal factor with blocks of B (the last one the remainder),
    built from indices, independently of ``block_sizes``: entry (i, j) is kept iff i // B == j // B."""
    idx = np.arange(d)
    return idx[:, None] // B == idx[None, :] // B


@pytest.mark.parametrize("d,B", [(768, 256), (768, 768), (768, 1024), (2304, 1024), (5504, 1024), (11008, 512), (7, 3)])
def test_block_sizes_follow_the_distributed_shampoo_convention(d: int, B: int) -> None:
    """Contiguous blocks of B, the last holding the remainder; a side of size <= B is one block;
    the block sizes are those of the index pattern (the run lengths of its diagonal blocks)."""
    sizes = block_sizes(d, B)
    assert sum(sizes) == d
    assert all(b == B for b in sizes[:-1]) and 0 < sizes[-1] <= B
    assert sizes == ([d] if d <= B else sizes)
    mask = block_mask(d, B)
    assert sum(b * b for b in sizes) == int(mask.sum())
    assert block_sizes(d, None) == [d]


@pytest.mark.parametrize("m,n", [(768, 2304), (768, 768), (768, 3072), (3072, 768), (2048, 5504), (4096, 11008), (5, 13)])
@pytest.mark.parametrize("B", [1, 2, 256, 512, 768, 1024, 4096])
def test_blocked_state_is_within_the_bound(m: int, n: int, B: int) -> None:
    """A blocked state holds M (mn) and P, Q and their roots block by block (each the kept entries of
    the block-diagonal pattern): at most mn + 2(m+n)B elements, exactly that when B divides both
    sides, and the full FISMO state 2(m^2+n^2)+mn when B >= max(m, n). Muon keeps mn."""
    kept = m * n + 2 * (int(block_mask(m, B).sum()) + int(block_mask(n, B).sum()))
    assert state_elements(m, n, B) == kept
    assert kept <= m * n + 2 * (m + n) * B
    if m % B == 0 and n % B == 0:
        assert kept == m * n + 2 * (m + n) * B
    if B >= max(m, n):
        assert kept == state_elements(m, n) == 2 * (m * m + n * n) + m * n
    assert muon_state_elements(m, n) == m * n < kept


def test_blocked_flop_model_by_hand() -> None:
    """768 x 3072 with B = 768: P is one 768 block, Q four; every product with a factor costs
    2 * 768 * (768 * 768) per block column, the roots are 5 eighs of 768 (9 d^3 each), and the
    polar factor of the whole M is Muon's."""

    class Blocked:  # the attributes step_flops reads, for a block size the core is asked for
        gamma, block_size, nonfinite = 0.95, 768, "propagate"
        inv_root, polar = FISMO().inv_root, FISMO().polar

    m, n, B = 768, 3072, 768
    model = step_flops(m, n, Blocked())
    product = 2 * m * n * B  # a factor applied to G, block by block (equal on both sides here)
    assert model["line 4"] == model["line 5"] == 2 * product
    assert model["line 6"] == product
    assert model["eigh"] == 5 * 9 * B**3
    assert model["roots"] == 5 * 2 * B**3
    assert model["line 8"] == muon_flops(m, n) + 2 * product
    full = step_flops(m, n, FISMO(nonfinite="propagate"))
    assert full["line 8"] == muon_flops(m, n) + 2 * m * m * n + 2 * m * n * n


# --- Memory ---------------------------------------------------------------------------------------


def array_elements(state) -> int:
    """Elements of the arrays of a core state: M, and P, Q and both roots, each a plain array or the
    parts of a block-diagonal factor (``kronecker.Blocks``: the full blocks and the remainder)."""
    total = 0
    for f in ("P", "Q", "M", "P_inv_sqrt", "Q_inv_sqrt"):
        value = getattr(state, f)
        parts = value if isinstance(value, tuple) else (value,)
        total += sum(math.prod(part.shape) for part in parts if part is not None)
    return total


@pytest.mark.parametrize("shape", [(24, 40), (40, 24), (16, 16), (5, 24, 40)], ids=str)
def test_state_elements_counts_the_core_state(target, shape: tuple[int, ...]) -> None:
    """FISMO.init's arrays hold 2 m^2 + 2 n^2 + m n elements per matrix, and nothing else but the two
    per-matrix int32 counters; the state keeps the parameters' dtype (float32 or float64)."""
    *batch, m, n = shape
    W = target.asarray(np.zeros(shape))
    state = FISMO().init(W)
    assert array_elements(state) == math.prod(batch) * state_elements(m, n)
    for f in ("P", "Q", "M", "P_inv_sqrt", "Q_inv_sqrt"):
        assert getattr(state, f).dtype == W.dtype
    assert math.prod(state.skipped.shape) == math.prod(state.root_failures.shape) == math.prod(batch)


@pytest.mark.parametrize("block_size", [8, 16, 40], ids=lambda b: f"B{b}")
@pytest.mark.parametrize("shape", [(24, 40), (40, 24), (5, 24, 40)], ids=str)
def test_state_elements_counts_the_blocked_core_state(target, shape: tuple[int, ...], block_size: int) -> None:
    """A blocked state holds what the model says (at most mn + 2(m+n)B per matrix), the same count
    as ``kronecker.state_size``, and after a step still only that (the factors stay blocked)."""
    from fismo_core.kronecker import state_size

    *batch, m, n = shape
    opt = FISMO(block_size=block_size)
    W = target.asarray(np.zeros(shape))
    state = opt.init(W)
    expected = math.prod(batch) * state_elements(m, n, block_size)
    assert array_elements(state) == expected
    assert state_elements(m, n, block_size) == state_size(m, n, block_size) <= m * n + 2 * (m + n) * block_size
    G = target.asarray(np.random.default_rng(0).standard_normal(shape))
    _, state = opt.step(W, G, state)
    assert array_elements(state) == expected


def torch_state_elements(opt, p) -> int:
    """Elements of the tensors (or lists of tensors) an optimizer keeps for p, 0-d scalars left out."""
    total = 0
    for value in opt.state[p].values():
        tensors = value if isinstance(value, (list, tuple)) else [value]
        total += sum(t.numel() for t in tensors if isinstance(t, torch.Tensor) and t.ndim > 0)
    return total


def anchor_optimizers() -> dict:
    """The optimizers of the memory table, and their state size per m x n matrix by the formula the
    documentation states."""
    anchors = {
        "fismo": (lambda ps: TorchFISMO(ps), state_elements),
        "adam": (lambda ps: torch.optim.Adam(ps), lambda m, n: 2 * m * n),
        "adamw": (lambda ps: torch.optim.AdamW(ps), lambda m, n: 2 * m * n),
        "muon": (lambda ps: torch.optim.Muon(ps), lambda m, n: m * n),
    }
    try:
        import pytorch_optimizer as po
    except ImportError:
        return anchors
    # Shampoo: both Kronecker statistics, both inverse roots, momentum; SOAP: Adam's two moments in
    # the rotated basis, both statistics and both eigenbases.
    anchors["shampoo"] = (lambda ps: po.Shampoo(ps), lambda m, n: 2 * m * m + 2 * n * n + m * n)
    anchors["soap"] = (lambda ps: po.SOAP(ps, precondition_frequency=1), lambda m, n: 2 * m * n + 2 * m * m + 2 * n * n)
    return anchors


@pytest.mark.parametrize("name", list(anchor_optimizers()))
@pytest.mark.parametrize("m,n", [(24, 40), (40, 24)])
def test_state_size_of_each_optimizer_in_the_memory_table(name: str, m: int, n: int) -> None:
    """After two steps, the tensors each optimizer keeps for one m x n matrix have the documented size."""
    make, formula = anchor_optimizers()[name]
    p = torch.nn.Parameter(torch.randn(m, n))
    opt = make([p])
    for _ in range(2):
        p.grad = torch.randn(m, n)
        opt.step()
    assert torch_state_elements(opt, p) == formula(m, n)


# ------------------------------------------------- InverseRootConfig.matmul_dtype (bf16 products)
class _MatmulDtypes(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the matrix products (mm, bmm) dispatched, by the dtype they compute in."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: dict = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.bmm):
            self.counts[args[0].dtype] = self.counts.get(args[0].dtype, 0) + 1
        return func(*args, **(kwargs or {}))


def _one_direction(opt: FISMO, shape: tuple[int, int], steps: int = 3, dtype=torch.float32):
    grads = [torch.asarray(G, dtype=dtype) for G in _gradients(shape, steps)]
    state = opt.init(torch.zeros(shape, dtype=dtype))
    for G in grads[:-1]:
        _, state = opt.direction(G, state)
    with _MatmulDtypes() as counter:
        D, _ = opt.direction(grads[-1], state)
    return D, counter.counts


def _gradients(shape: tuple[int, int], steps: int) -> list[np.ndarray]:
    rng = np.random.default_rng(sum(shape))
    return [rng.standard_normal(shape) / math.sqrt(shape[-1]) for _ in range(steps)]


@pytest.mark.parametrize("refresh", [True, False], ids=["roots recomputed", "roots cached"])
def test_matmul_dtype_takes_exactly_the_preconditioners_products_in_bfloat16(refresh: bool) -> None:
    # Lines 4-6 and 8 with full factors: the Gram matrices of lines 4 and 5, G Q^{-1/2} (line 4),
    # P^{-1/2} G (line 5), the whitening's second factor (line 6) and the two factors of the
    # un-whitening (line 8): 7 products. The polar factor, eigh's reassembly V w^{-1/2} V^T and the
    # roots' residual checks stay in float32.
    # every=1: the third step recomputes the roots; every=2: the second step (state.step = 1) keeps them.
    every = 1 if refresh else 2
    options = {"statistics": "scale_invariant", "inv_root": {"every": every}}
    plain = FISMO(**options)
    bf16 = FISMO(**{**options, "inv_root": {"every": every, "matmul_dtype": "bfloat16"}})
    steps = 3 if refresh else 2
    _, counts_plain = _one_direction(plain, (12, 20), steps)
    _, counts_bf16 = _one_direction(bf16, (12, 20), steps)
    assert set(counts_plain) == {torch.float32}
    assert counts_bf16[torch.bfloat16] == 7
    assert counts_bf16[torch.bfloat16] + counts_bf16[torch.float32] == counts_plain[torch.float32]


@pytest.mark.parametrize("block_size", [None, 8], ids=["full", "blocks of 8"])
@pytest.mark.parametrize("shape", [(12, 20), (20, 12)], ids=str)
def test_matmul_dtype_bfloat16_direction_is_within_a_few_bf16_roundings(shape, block_size) -> None:
    options = {"statistics": "scale_invariant", "block_size": block_size}
    exact, _ = _one_direction(FISMO(**options), shape, steps=6)
    low, _ = _one_direction(FISMO(**options, inv_root={"matmul_dtype": "bfloat16"}), shape, steps=6)
    deviation = float(torch.linalg.norm(low - exact) / torch.linalg.norm(exact))
    u = 2.0**-8  # bfloat16's unit roundoff; about 2u measured here: 7 products, each rounded once
    assert 0 < deviation < 8 * u


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_matmul_dtype_of_the_state_is_the_default_bit_for_bit(dtype) -> None:
    name = {torch.float32: "float32", torch.float64: "float64"}[dtype]
    options = {"statistics": "scale_invariant", "block_size": 8}
    D, _ = _one_direction(FISMO(**options), (12, 20), steps=4, dtype=dtype)
    D_named, _ = _one_direction(FISMO(**options, inv_root={"matmul_dtype": name}), (12, 20), steps=4, dtype=dtype)
    assert torch.equal(D, D_named)


def test_matmul_dtype_is_validated_when_the_optimizer_is_built() -> None:
    with pytest.raises(ValueError, match="matmul_dtype must be None .* got 'bf16'"):
        FISMO(inv_root={"matmul_dtype": "bf16"})
    with pytest.raises(ValueError, match="matmul_dtype"):
        TorchFISMO([torch.nn.Parameter(torch.zeros(3, 4))], inv_root={"matmul_dtype": "int8"})


def test_a_library_without_bfloat16_is_named() -> None:
    opt = FISMO(inv_root={"matmul_dtype": "bfloat16"})
    W = np.zeros((4, 6))
    with pytest.raises(ValueError, match="NumPy.*no bfloat16|numpy.*no bfloat16"):
        opt.step(W, np.ones((4, 6)), opt.init(W))


# --------------------------------------------------------------------- guards.all_finite
@pytest.mark.parametrize("bad", [None, math.nan, math.inf, -math.inf])
def test_all_finite_agrees_with_isfinite(bad) -> None:
    from array_api_compat import torch as xp

    from fismo_core.guards import all_finite

    X = torch.full((3, 4, 5), 3e38)  # entries whose sum overflows float32: still finite
    if bad is not None:
        X[1, 2, 3] = bad
    assert torch.equal(all_finite(xp, X, axis=(-2, -1)), torch.isfinite(X).all(dim=(-2, -1)))
    assert bool(all_finite(xp, X)) == bool(torch.isfinite(X).all())


@pytest.mark.parametrize("call, message", [
    (lambda: perf.step_flops(-3, 5), "m must be a positive integer, got -3"),
    (lambda: perf.polar_flops(64, 64, steps=2.5), "steps must be a positive integer, got 2.5"),
    (lambda: perf.polar_flops(64, 64, steps=0), "steps must be a positive integer, got 0"),
    (lambda: perf.inverse_sqrt_flops(64, "svd"), "method must be 'eigh' or 'newton_schulz', got 'svd'"),
    (lambda: perf.state_elements(8, 8, block_size=True), "block_size must be None"),
    (lambda: perf.block_sizes(4, True), "block_size must be None"),
    (lambda: perf.muon_state_elements(-3, 2), "m must be a positive integer, got -3"),  # gave -6 (2026-12-03)
    (lambda: perf.muon_state_elements(4, 2.5), "n must be a positive integer, got 2.5"),
])
def test_counts_refuse_what_is_no_size(call, message) -> None:
    """Negative, fractional and boolean sizes gave negative or fractional counts, an unknown method the
    Newton–Schulz count, ``True`` a block of 1 (a user's hunt, 2026-12-03): refused, naming the argument."""
    with pytest.raises(ValueError, match=re.escape(message)):
        call()
    with pytest.raises(TypeError, match="optimizer must be a fismo_core.FISMO"):
        perf.step_flops(4, 4, "muon")
