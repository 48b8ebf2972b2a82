"""The phases of a step as explicit data, and fault flags that stay on the device until one host read.

``FISMO._algorithm_1`` is lines 4–8 as phases handing each other their data
(`Preconditioners`, then lines 6, 7 and 8); the root fault flags are
returned, not stored. `FISMO.direction_with_faults` returns them as arrays
without any host read, `guards.read_faults` reads any number of them at
once, and `FISMO.settle` gives `direction`'s answer from them. Host reads
are counted exactly on torch: every read of a value (``bool``, ``int``,
``float``, ``.item()``) dispatches ``aten._local_scalar_dense``.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import numpy as np
import pytest

from fismo_core import FISMO, FISMOState, StepResult, guards
from fismo_core.guards import StepFaults
from fismo_core.kronecker import Blocks
from fismo_core.optimizer import InverseRootError, InverseRootWarning, Preconditioners
from fismo_core.testing import reference_gradients

ARRAY_FIELDS = ("P", "Q", "M", "P_inv_sqrt", "Q_inv_sqrt", "skipped", "root_failures")
SHAPE = (2, 5, 7)  # a batch of two wide matrices: blocked sides with remainders at block_size=3


def _arrays(x: Any) -> list:
    return [a for a in x if a is not None] if isinstance(x, Blocks) else [x]


def _bits_equal(a: Any, b: Any) -> bool:
    """Equal bit for bit (NaN equal to NaN), for arrays, `Blocks`, Python numbers and torch tensors."""
    if isinstance(a, Blocks) or isinstance(b, Blocks):
        return len(_arrays(a)) == len(_arrays(b)) and all(map(_bits_equal, _arrays(a), _arrays(b)))
    a, b = (x.detach().cpu().numpy() if hasattr(x, "detach") else np.asarray(x) for x in (a, b))
    return a.shape == b.shape and a.dtype == b.dtype and np.array_equal(a, b, equal_nan=True)


def _same_step(one: tuple, other: tuple) -> bool:
    (d1, s1), (d2, s2) = one, other
    return _bits_equal(d1, d2) and s1.step == s2.step and all(
        _bits_equal(getattr(s1, f), getattr(s2, f)) for f in ARRAY_FIELDS
    )


def _warm_state(opt: FISMO, G0: Any, W: Any) -> FISMOState:
    """The state after one step, so that ``P``, ``Q`` and their roots are far from the identity."""
    return opt.direction(G0, opt.init(W), refresh_roots=True)[1]


# ------------------------------------------------------------------ the phases
PHASE_CONFIGS = {
    "full": {},
    "blocked": {"block_size": 3},
    "gamma=1": {"gamma": 1.0},
    "scale_invariant+nesterov": {"statistics": "scale_invariant", "nesterov": True},
}


@pytest.mark.parametrize("refresh", [True, False], ids=["refresh", "cached-roots"])
@pytest.mark.parametrize("name", list(PHASE_CONFIGS))
def test_phase_data_are_the_lines_of_step_lines(name: str, refresh: bool) -> None:
    """Each phase's output is the quantity `step_lines` reports for its line, bit for bit, and the
    products lines 4–5 hand to line 6 are the products they name (``G Q_{t-1}^{-1/2}``, ``P_t^{-1/2} G``).
    NumPy float64; ``refresh=False`` keeps the cached roots, where a wide matrix's line 6 takes line 4's product."""
    import array_api_compat.numpy as xp

    opt = FISMO(**PHASE_CONFIGS[name], inv_root={"every": 1 if refresh else 2})
    G0, G = (np.asarray(g) for g in reference_gradients(SHAPE, 2, seed=3))
    W = np.ones(SHAPE)
    state = _warm_state(opt, G0, W)._replace(step=0 if refresh else 1)  # every=2: step 1 keeps the roots
    step = opt._guarded_step(xp, G, state, refresh, repair=False)
    pre, lines = step.lines.preconditioners, step.lines
    _, new_state, printed = opt.step_lines(W, G, state)
    assert isinstance(pre, Preconditioners)
    for field in ("P", "Q", "P_inv_sqrt", "Q_inv_sqrt"):
        assert _bits_equal(getattr(pre, field), getattr(printed, field)), field
    assert _bits_equal(step.scale * lines.G_white, printed.G_white)
    assert _bits_equal(lines.M, printed.M) and _bits_equal(lines.direction, printed.direction)
    left, right = opt.structures(*SHAPE[-2:])
    G_s = G if name == "gamma=1" else guards.statistics_scale(xp, G, opt.statistics)[0]
    assert _bits_equal(pre.P_inv_sqrt_G, left.left(pre.P_inv_sqrt, G_s))
    if name == "gamma=1":  # lines 4-5 are skipped: P_{t-1}, Q_{t-1} and their roots, nothing checked
        assert pre.G_Q_inv_sqrt is None and pre.P_failed is None and pre.Q_failed is None
        assert all(_bits_equal(getattr(pre, f), getattr(state, f)) for f in ("P", "Q", "P_inv_sqrt", "Q_inv_sqrt"))
    else:
        assert _bits_equal(pre.G_Q_inv_sqrt, right.right(G_s, state.Q_inv_sqrt))
    if not refresh:  # the cached roots are kept and nothing is checked
        assert pre.P_failed is None and pre.Q_failed is None
        assert _bits_equal(pre.P_inv_sqrt, state.P_inv_sqrt) and _bits_equal(pre.Q_inv_sqrt, state.Q_inv_sqrt)
    elif name != "gamma=1":  # checked (nonfinite="raise" checks roots by default): a flag per matrix
        for flag in (pre.P_failed, pre.Q_failed):
            assert flag.shape == SHAPE[:-2] and flag.dtype == xp.bool and not np.any(flag)


@pytest.mark.parametrize("name", list(PHASE_CONFIGS))
def test_repairing_phases_equal_the_flagging_ones_when_no_root_fails(name: str) -> None:
    """The fault handling of `InverseRootConfig` (``repair=True``, with host reads) changes no bit of a
    step whose roots pass: it is the flagging path (``repair=False``) plus the reads."""
    import array_api_compat.numpy as xp

    opt = FISMO(**PHASE_CONFIGS[name])
    G0, G = (np.asarray(g) for g in reference_gradients(SHAPE, 2, seed=4))
    state = _warm_state(opt, G0, np.ones(SHAPE))
    flagged = opt._guarded_step(xp, G, state, True, repair=False)
    repaired = opt._guarded_step(xp, G, state, True, repair=True)
    assert _same_step(flagged.result[:2], repaired.result[:2])
    assert repaired.result.faults == StepFaults()  # the repair reads and handles its faults itself
    checked = name != "gamma=1"
    assert (flagged.result.faults.roots is not None) == checked
    assert flagged.result.faults.nonfinite is None  # only direction_with_faults defers the finiteness check


# ------------------------------------------------------------------ direction = settle(direction_with_faults)
SETTLE_CONFIGS = {
    "default": {},
    "blocked": {"block_size": 3},
    "skip": {"nonfinite": "skip"},
    "propagate": {"nonfinite": "propagate"},
    "propagate+checks": {"nonfinite": "propagate", "inv_root": {"fallback": True}},
    "every=2": {"inv_root": {"every": 2}},
    "gamma=1": {"gamma": 1.0},
    "newton_schulz_roots": {"inv_root": "newton_schulz"},
}


@pytest.mark.parametrize("name", list(SETTLE_CONFIGS))
def test_settle_of_direction_with_faults_is_direction(name: str) -> None:
    """On finite input `settle(G, state, direction_with_faults(G, state))` is `direction(G, state)` bit for
    bit, over three steps (with ``every=2`` one of them keeps the cached roots); under ``"skip"`` one
    matrix of the second gradient has a NaN and is skipped alike."""
    opt = FISMO(**SETTLE_CONFIGS[name])
    grads = [np.asarray(g) for g in reference_gradients(SHAPE, 3, seed=5)]
    if name == "skip":
        grads[1][0, 0, 0] = math.nan
    state = settled = opt.init(np.ones(SHAPE))
    for G in grads:
        result = opt.direction_with_faults(G, settled)
        assert isinstance(result, StepResult)
        expected = opt.direction(G, state)
        got = opt.settle(G, settled, result)
        assert _same_step(got, expected)
        assert _same_step((result.direction, result.state), expected)  # nothing to settle on good input
        state, settled = expected[1], got[1]
    if name == "skip":
        assert [int(x) for x in state.skipped] == [1, 0]


# ------------------------------------------------------------------ host reads, counted on torch
def _host_reads():
    """A dispatch mode counting host reads of torch tensors (``aten._local_scalar_dense``)."""
    torch = pytest.importorskip("torch")
    from torch.utils._python_dispatch import TorchDispatchMode

    class HostReads(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._local_scalar_dense.default:
                self.count += 1
            return func(*args, **(kwargs or {}))

    return HostReads()


def test_the_host_read_counter_can_fail() -> None:
    """Each way of reading a tensor's value on the host is counted, and a device-side reduction is not."""
    torch = pytest.importorskip("torch")
    x = torch.ones(3)
    with _host_reads() as reads:
        torch.all(x > 0)
    assert reads.count == 0
    for read in (lambda: bool(x.any()), lambda: float(x.sum()), lambda: int(x[0]), lambda: x.sum().item()):
        with _host_reads() as reads:
            read()
        assert reads.count == 1


def _torch_case(config: dict, seed: int = 6) -> tuple:
    torch = pytest.importorskip("torch")
    opt = FISMO(**config)
    G0, G = (torch.asarray(g) for g in reference_gradients(SHAPE, 2, seed=seed))
    return torch, opt, G, _warm_state(opt, G0, torch.ones(SHAPE, dtype=torch.float64))


@pytest.mark.parametrize(
    "config, direction_reads",
    [
        ({}, 2),  # nonfinite="raise": the finiteness of G, then every root's check in one read (before: 3)
        ({"nonfinite": "skip"}, 1),  # the roots' checks (before: 2, one per side)
        ({"nonfinite": "propagate"}, 0),
        ({"block_size": 3}, 2),
    ],
    ids=["raise", "skip", "propagate", "blocked"],
)
def test_host_reads_per_call(config: dict, direction_reads: int) -> None:
    """`direction_with_faults` reads nothing; `settle` reads once when something was checked;
    `direction` and `step` read as many times as the docstring of `direction` says."""
    torch, opt, G, state = _torch_case(config)
    W = torch.ones(SHAPE, dtype=torch.float64)
    with _host_reads() as reads:
        result = opt.direction_with_faults(G, state)
    assert reads.count == 0
    with _host_reads() as reads:
        opt.settle(G, state, result)
    assert reads.count == (0 if config.get("nonfinite") == "propagate" else 1)
    with _host_reads() as reads:
        opt.direction(G, state)
    assert reads.count == direction_reads
    with _host_reads() as reads:
        opt.step(W, G, state)
    assert reads.count == direction_reads  # the check of W shares G's read


def test_fault_flags_are_tensors_of_the_batch_shape() -> None:
    """The default configuration's flags are boolean tensors, one entry per matrix, on the state's device."""
    torch, opt, G, state = _torch_case({})
    faults = opt.direction_with_faults(G, state).faults
    for flag in (faults.nonfinite, faults.roots):
        assert isinstance(flag, torch.Tensor) and flag.dtype == torch.bool and tuple(flag.shape) == SHAPE[:-2]
        assert not bool(flag.any())
    propagate = FISMO(nonfinite="propagate")
    assert propagate.direction_with_faults(G, state).faults == StepFaults(None, None)  # nothing checked


def test_direction_with_faults_runs_on_the_meta_device() -> None:
    """On tensors without data every host read raises: the default configuration (finiteness and root
    checks on) runs through `direction_with_faults`, and its flags are meta tensors; `settle` is the read."""
    torch = pytest.importorskip("torch")
    W = torch.empty(SHAPE, device="meta", dtype=torch.float32)
    opt = FISMO(block_size=3)
    state = opt.init(W)
    result = opt.direction_with_faults(W, state)
    assert result.direction.device.type == "meta" and result.faults.roots.device.type == "meta"
    assert tuple(result.faults.nonfinite.shape) == SHAPE[:-2]
    with pytest.raises((RuntimeError, NotImplementedError)):
        opt.settle(W, state, result)


def _patch_eigh(monkeypatch: pytest.MonkeyPatch, torch: Any, bad: int) -> None:
    """torch's eigh (as array-api-compat calls it) returns NaN eigenvalues for matrix ``bad`` of a batch
    of full factors, in every dtype: its roots fail and cannot be repaired."""
    import array_api_compat.torch as xp

    real = xp.linalg.eigh

    def eigh(A):
        w, V = real(A)
        if A.ndim == 3 and A.shape[0] == SHAPE[0]:
            w = w.clone()
            w[bad] = math.nan
        return w, V

    monkeypatch.setattr(xp.linalg, "eigh", eigh)


def test_a_failing_root_is_flagged_without_a_host_read_then_settled(monkeypatch: pytest.MonkeyPatch) -> None:
    """Matrix 1's roots fail in every precision: `direction_with_faults` flags it (and only it) without
    a host read; `settle` then gives what `direction` gives, bit for bit: matrix 1 falls back to its
    previous factors with an `InverseRootWarning` and counts the failure, matrix 0 steps."""
    torch, opt, G, state = _torch_case({})
    _patch_eigh(monkeypatch, torch, bad=1)
    with _host_reads() as reads:
        result = opt.direction_with_faults(G, state)
    assert reads.count == 0
    assert result.faults.roots.tolist() == [False, True] and result.faults.nonfinite.tolist() == [False, False]
    with pytest.warns(InverseRootWarning, match=r"failed for 1 of 2 matrices"):
        settled = opt.settle(G, state, result)
    with pytest.warns(InverseRootWarning):
        expected = opt.direction(G, state)
    assert _same_step(settled, expected)
    assert settled[1].root_failures.tolist() == [0, 1]
    assert _bits_equal(settled[1].P[1], state.P[1]) and not _bits_equal(settled[1].P[0], state.P[0])
    assert not bool(torch.isnan(settled[0]).any())


def test_settle_raises_inverse_root_error_with_the_indices(monkeypatch: pytest.MonkeyPatch) -> None:
    """With ``max_failures=0`` the first root that cannot be repaired raises `InverseRootError` from
    `settle`, naming the failing matrix by its flat index, as `direction` does."""
    torch, opt, G, state = _torch_case({"inv_root": {"max_failures": 0}})
    _patch_eigh(monkeypatch, torch, bad=1)
    result = opt.direction_with_faults(G, state)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", InverseRootWarning)
        with pytest.raises(InverseRootError, match=r"matrices \[1\] of the batch") as settled:
            opt.settle(G, state, result)
        with pytest.raises(InverseRootError) as direct:
            opt.direction(G, state)
    assert settled.value.indices == direct.value.indices == (1,)


def test_a_nonfinite_gradient_is_flagged_then_refused() -> None:
    """Under ``nonfinite="raise"`` a matrix whose gradient has a NaN is computed with ``G = 0`` and flagged,
    so nothing non-finite reaches the roots (no `LinAlgError`, no NaN anywhere); `settle` raises the
    `ValueError` of `direction`, message for message."""
    torch, opt, G, state = _torch_case({"inv_root": {"fallback": False}})  # no root check to catch a LinAlgError
    G = G.clone()
    G[0, 2, 3] = math.nan
    result = opt.direction_with_faults(G, state)
    assert result.faults.nonfinite.tolist() == [True, False] and result.faults.roots is None
    assert all(bool(torch.isfinite(a).all()) for f in ARRAY_FIELDS for a in _arrays(getattr(result.state, f)))
    with pytest.raises(ValueError, match=r"G contains NaN or infinite values \(1 NaN, 0 infinite") as settled:
        opt.settle(G, state, result)
    with pytest.raises(ValueError) as direct:
        opt.direction(G, state)
    assert str(settled.value) == str(direct.value)


def test_read_faults_reads_once_for_many_flags() -> None:
    """Flags of several calls and the caller's own, with `None` among them, cost one host read; no flag
    at all costs none. It says whether any flag is set."""
    torch, opt, G, state = _torch_case({})
    results = [opt.direction_with_faults(G, state) for _ in range(3)]
    own = torch.isfinite(G).all(dim=(-2, -1)).logical_not()
    with _host_reads() as reads:
        found = guards.read_faults(own, None, *(r.faults for r in results))
    assert (found, reads.count) == (False, 1)
    with _host_reads() as reads:
        found = guards.read_faults(*(r.faults for r in results), torch.tensor([False, True]))
    assert (found, reads.count) == (True, 1)
    with _host_reads() as reads:
        assert guards.read_faults(None, StepFaults()) is False
    assert reads.count == 0


# ------------------------------------------------------------------ under jax.jit nothing is read
@pytest.mark.parametrize("nonfinite", ["raise", "skip"])
def test_under_jit_the_checks_step_aside(nonfinite: str) -> None:
    """Traced, no flag can be read (`read_faults` says ``None``): `direction` is then the step without
    root checks (``fallback=False``), bit for bit in every field and counter, also for a state built by hand
    with integer counters, as before the flags were deferred."""
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    jax.config.update("jax_enable_x64", True)
    opt, unchecked = FISMO(nonfinite=nonfinite), FISMO(nonfinite=nonfinite, inv_root={"fallback": False})
    G0, G = (jnp.asarray(g) for g in reference_gradients(SHAPE, 2, seed=7))
    warm = _warm_state(opt, G0, jnp.ones(SHAPE))
    for state in (warm, warm._replace(root_failures=0)):  # from init, and with a hand-built counter
        got = jax.jit(lambda G, s: opt.direction(G, s, refresh_roots=True))(G, state)
        want = jax.jit(lambda G, s: unchecked.direction(G, s, refresh_roots=True))(G, state)
        assert _same_step(got, want)
        assert got[1].root_failures.shape == (SHAPE[:-2] if nonfinite == "skip" else jnp.shape(state.root_failures))
    seen = []
    jax.jit(lambda G, s: seen.append(guards.read_faults(opt.direction_with_faults(G, s).faults)) or 0)(G, state)
    assert seen == [None]
