"""``torch.compile(FISMO.direction, fullgraph=True)`` traces the core's step as one graph.

Under ``nonfinite="propagate"`` a step reads nothing on the host, so dynamo
captures ``direction`` (and ``direction_with_faults``) whole: one frame, no
graph break, for full and blocked sides, every polar and inverse-root
method, Nesterov, both ``statistics``, ``gamma = 1``, and roots recomputed
or kept (``refresh_roots`` given, as the adapters give it). The compiled
direction equals the eager one bit for bit in float64 where the graph runs
the same kernels (dynamo's captured graph, ``aot_eager``); inductor
generates its own reductions, and is held to a measured tolerance.

Most cases use `CompileCounter` as the backend (dynamo's capture, run as
captured): the graph count is the point, and it is fast.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from fismo_core import FISMO, FISMOState, PolarConfig
from fismo_core.kronecker import Blocks
from fismo_core.testing import reference_gradients

torch = pytest.importorskip("torch")
from torch._dynamo.testing import CompileCounter, CompileCounterWithBackend  # noqa: E402
from torch._dynamo.utils import counters  # noqa: E402

# array-api-compat's namespace lookup is lru_cache'd; dynamo traces through the cache and says so once.
pytestmark = pytest.mark.filterwarnings("ignore:Dynamo detected a call to a `functools.lru_cache`:UserWarning")

SHAPE = (2, 5, 7)  # two wide matrices: with block_size=3, P has blocks 3 + 2 and Q 3 + 3 + 1
ARRAY_FIELDS = ("P", "Q", "M", "P_inv_sqrt", "Q_inv_sqrt", "skipped", "root_failures")

#: (options, refresh_roots): every option a compiled step must cover, roots recomputed (True) or kept (False).
#: float64 unless the name says otherwise.
CASES = {
    "full": ({}, True),
    "full-cached-roots": ({}, False),
    "blocked": ({"block_size": 3}, True),
    "blocked-cached-roots": ({"block_size": 3}, False),
    "polar-svd": ({"polar": "svd"}, True),
    "polar-express-bf16": ({"polar": PolarConfig(coefficients="polar_express", steps=8, dtype="bfloat16")}, True),
    "roots-newton-schulz": ({"inv_root": "newton_schulz"}, True),
    "roots-cubic-blocked": ({"inv_root": {"method": "newton_schulz", "coefficients": "cubic"}, "block_size": 3}, True),
    "nesterov": ({"nesterov": True}, True),
    "scale-invariant": ({"statistics": "scale_invariant"}, True),
    "gamma=1": ({"gamma": 1.0}, True),
    "float32-blocked": ({"block_size": 3}, True),
}


def _arrays(x: Any) -> list:
    return [a for a in x if a is not None] if isinstance(x, Blocks) else [x]


def _inputs(opt: FISMO, dtype: Any = torch.float64, seed: int = 0) -> tuple[Any, FISMOState]:
    """A gradient and the state after one eager step (factors and roots far from the identity)."""
    G0, G = (torch.asarray(g, dtype=dtype) for g in reference_gradients(SHAPE, 2, seed=seed))
    _, state = opt.direction(G0, opt.init(torch.ones(SHAPE, dtype=dtype)), refresh_roots=True)
    return G, state


def _max_relative_difference(got: tuple, want: tuple) -> float:
    """Over the direction and every state array, ``max |got - want| / max |want|``."""
    pairs = [(got[0], want[0])] + [
        (a, b) for f in ARRAY_FIELDS for a, b in zip(_arrays(getattr(got[1], f)), _arrays(getattr(want[1], f)))
    ]
    worst = 0.0
    for a, b in pairs:
        scale = float(b.abs().max()) if b.is_floating_point() else 1.0
        worst = max(worst, float((a.double() - b.double()).abs().max()) / (scale or 1.0))
    return worst


def _bit_equal(got: tuple, want: tuple) -> bool:
    """Direction and state equal bit for bit, dtypes included; ``step`` equal."""
    pairs = [(got[0], want[0])] + [
        (a, b) for f in ARRAY_FIELDS for a, b in zip(_arrays(getattr(got[1], f)), _arrays(getattr(want[1], f)))
    ]
    return got[1].step == want[1].step and all(a.dtype == b.dtype and torch.equal(a, b) for a, b in pairs)


def _compile(fn: Any, backend: Any) -> Any:
    torch._dynamo.reset()
    counters.clear()
    return torch.compile(fn, backend=backend, fullgraph=True)


@pytest.mark.parametrize("case", list(CASES))
def test_direction_is_one_graph(case: str) -> None:
    """One frame, no graph break, and the captured graph computes the eager step bit for bit."""
    options, refresh = CASES[case]
    opt = FISMO(nonfinite="propagate", **options)
    G, state = _inputs(opt, torch.float32 if case.startswith("float32") else torch.float64)
    backend = CompileCounter()
    got = _compile(opt.direction, backend)(G, state, refresh_roots=refresh)
    assert backend.frame_count == 1 and backend.op_count > 10
    assert not counters["graph_break"]
    assert _bit_equal(got, opt.direction(G, state, refresh_roots=refresh))


@pytest.mark.parametrize("nonfinite", ["propagate", "raise"])
def test_direction_with_faults_is_one_graph(nonfinite: str) -> None:
    """The no-host-read entry point is one graph too, also with the default policy's checks on (its
    flags come out as tensors, for the caller's one read); its result is the eager one bit for bit."""
    opt = FISMO(nonfinite=nonfinite, block_size=3)
    G, state = _inputs(opt)
    backend = CompileCounter()
    got = _compile(opt.direction_with_faults, backend)(G, state, refresh_roots=True)
    want = opt.direction_with_faults(G, state, refresh_roots=True)
    assert backend.frame_count == 1 and not counters["graph_break"]
    assert _bit_equal(got[:2], want[:2])
    if nonfinite == "propagate":
        assert got.faults == (None, None)
    else:
        for flag, expected in zip(got.faults, want.faults):
            assert flag.dtype == torch.bool and torch.equal(flag, expected)


def test_consecutive_steps_reuse_the_graph() -> None:
    """Three compiled steps in a row, with ``state.step`` a 0-d tensor (a Python int would be a new
    constant at every step, and dynamo would recompile once to make it dynamic): one frame in all."""
    opt = FISMO(nonfinite="propagate")
    G, state = _inputs(opt)
    backend = CompileCounter()
    compiled = _compile(opt.direction, backend)
    state = state._replace(step=torch.tensor(1))
    for t in range(3):
        _, state = compiled(G * (t + 1), state, refresh_roots=True)
    assert backend.frame_count == 1 and int(state.step) == 4


def test_aot_eager_is_bit_for_bit() -> None:
    """Through AOT autograd (``aot_eager``: functionalised, run by eager kernels) the compiled step is the
    eager one bit for bit in float64, here with most options at once."""
    opt = FISMO(
        nonfinite="propagate", block_size=3, inv_root="newton_schulz", nesterov=True, statistics="scale_invariant"
    )
    G, state = _inputs(opt)
    backend = CompileCounterWithBackend("aot_eager")
    got = _compile(opt.direction, backend)(G, state, refresh_roots=True)
    assert backend.frame_count == 1
    assert _bit_equal(got, opt.direction(G, state, refresh_roots=True))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
def test_inductor_compiles_the_step(dtype: Any) -> None:
    """Inductor compiles the step (one frame) and computes it to rounding. Not bit for bit: its C++ kernels
    sum reductions in another order (vectorised), e.g. the traces of lines 4–5 and, on an AVX-512 CPU, the
    Frobenius norm that normalises Newton–Schulz (measured 8.9e-16 apart on a norm of 6), and its float64
    sqrt is correctly rounded where torch's eager one is not (``docs/scripts/inductor_float64_sources.py``
    lists where the two steps part). Over the direction and every state array, on 9 cases (full,
    blocked, Nesterov with scale-invariant statistics; 3 seeds), the difference measured at most 6.4e-15
    relative in float64 (29 eps) and 2.6e-6 in float32 (22 eps), under the default, AVX2 and AVX-512
    kernel sets alike; the bounds, 1e-12 and 1e-4, leave a factor 150 and 40, far below any real error.

    Inductor's caches are off here: its FX graph cache does not key on the vector ISA that
    ``ATEN_CPU_CAPABILITY`` forces, and code generated for AVX-512 (16-double tiles), compiled for AVX2
    (8-double vectors), skips half of every reduction (a norm of 5.81 came out 3.84)."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    opt = FISMO(nonfinite="propagate")
    G, state = _inputs(opt, dtype)
    backend = CompileCounterWithBackend("inductor")
    with inductor_config.patch(fx_graph_cache=False), functorch_config.patch(enable_autograd_cache=False):
        got = _compile(opt.direction, backend)(G, state, refresh_roots=True)
    assert backend.frame_count == 1 and not counters["graph_break"]
    want = opt.direction(G, state, refresh_roots=True)
    tolerance = 1e-12 if dtype == torch.float64 else 1e-4
    assert _max_relative_difference(got, want) <= tolerance
    assert np.isfinite(_max_relative_difference(got, want))


@pytest.mark.parametrize("nonfinite", ["raise", "skip"])
def test_inductor_finds_a_nan_and_an_infinity(nonfinite: str) -> None:
    """Compiled by inductor, the finiteness checks let every NaN and infinity through until 2026-12-02 (a
    user's hunt): they summed ``X * 0``, which inductor folds to zeros, so ``"raise"`` raised ``eigh``'s
    ``LinAlgError`` instead of its ``ValueError`` and ``"skip"`` skipped nothing. `guards.all_finite`
    reads ``max|X|`` now; compiled, it answers as eagerly (an empty array is finite), and the step's
    flags mark the matrix with the NaN and the one with the infinity, as eagerly, with a finite direction."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    from array_api_compat import torch as _xp

    from fismo_core import guards

    X = torch.ones(4, 3, 5, dtype=torch.float64)
    X[1, 2, 3], X[2, 0, 0] = float("nan"), -float("inf")
    opt = FISMO(nonfinite=nonfinite)
    G, state = _inputs(opt)
    G = torch.cat([G, G])  # four matrices: NaN in the second, infinity in the third
    G[1, 2, 3], G[2, 0, 0] = float("nan"), float("inf")
    state = opt.init(torch.zeros_like(G))
    with inductor_config.patch(fx_graph_cache=False), functorch_config.patch(enable_autograd_cache=False):
        finite = torch.compile(lambda X: guards.all_finite(_xp, X, axis=(-2, -1)), backend="inductor")
        assert finite(X).tolist() == [True, False, False, True] == guards.all_finite(_xp, X, axis=(-2, -1)).tolist()
        assert torch.compile(lambda X: guards.all_finite(_xp, X), backend="inductor")(X[:, :0]).item() is True
        got = torch.compile(opt.direction_with_faults, backend="inductor")(G, state, refresh_roots=True)
    want = opt.direction_with_faults(G, state, refresh_roots=True)
    if nonfinite == "raise":
        assert got.faults.nonfinite.tolist() == want.faults.nonfinite.tolist() == [False, True, True, False]
    else:
        assert got.state.skipped.tolist() == want.state.skipped.tolist() == [0, 1, 1, 0]
    assert bool(torch.isfinite(got.direction).all())
    assert _max_relative_difference(got[:2], want[:2]) <= 1e-12  # inductor's rounding: see the test above


def test_inductor_parts_from_eager_only_at_reductions_and_sqrt() -> None:
    """docs/torch.md's account of the 29 eps: where inductor's float64 step first differs from the eager one
    (``docs/scripts/inductor_float64_sources.py``, seed 0), every such node is a reduction, summed in another
    order, or ``sqrt`` (torch's eager float64 ``sqrt`` is not correctly rounded; inductor's is). Any other
    source, e.g. an elementwise product fused into another rounding, fails here."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "docs" / "scripts" / "inductor_float64_sources.py"
    spec = importlib.util.spec_from_file_location("inductor_float64_sources", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    found = script.sources(0)
    assert found  # the docs say the two part (29 eps); a bit-for-bit inductor would make them wrong
    assert all(op == "sqrt" or op.startswith(script.REDUCTIONS) for op, _ in found), found
    # Each difference is a rounding of a value of order 1 (the factors have trace d): at most a few eps.
    assert all(0 < difference <= 1e-14 for _, difference in found), found
