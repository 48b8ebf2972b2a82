"""The cost model of ``fismo_core.perf``: FLOP counts against torch's own counter, state sizes
against the arrays a state really holds (FISMO's and those of the optimizers it is compared with
on the documentation page "Performance")."""

from __future__ import annotations

import math

import numpy as np
import pytest

from fismo_core import FISMO
from fismo_core.perf import inverse_sqrt_flops, muon_flops, state_elements, step_flops

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
    "gamma1": {"gamma": 1.0},
    "nesterov-scale-invariant": {"nesterov": True, "statistics": "scale_invariant"},
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


# --- Memory ---------------------------------------------------------------------------------------


def array_elements(state) -> int:
    return sum(math.prod(getattr(state, f).shape) for f in ("P", "Q", "M", "P_inv_sqrt", "Q_inv_sqrt"))


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
