"""Checkpoints (issue #6): a saved state resumes bit for bit; a state that does not fit is a clear error.

* The core: ``FISMOState.to_dict()`` / ``FISMOState.from_dict(d, like=W)``,
  through ``np.savez`` / ``np.load`` on every backend and through
  ``torch.save`` / ``torch.load(weights_only=True)`` on torch.
* The torch adapter: ``optimizer.state_dict()`` round trips are tested in
  ``tests/test_torch_optimizer.py::test_state_dict_round_trip_resumes_bit_identically``
  (model, optimizer and scheduler, bit for bit) and
  ``::test_low_precision_parameters_keep_their_dtype_and_float32_statistics``
  (bf16/fp16 statistics stay float32). Here: the new counters survive, a
  checkpoint that does not fit the parameters is refused before anything
  changes, and checkpoints from before the counters still load.
"""

from __future__ import annotations

import copy

import io
import math

import numpy as np
import pytest

from fismo_core import FISMO, FISMOState
from fismo_core.optimizer import state_block_size
from fismo_core.testing import Target, _host_array, reference_gradients, to_numpy

FIELDS = ("P", "Q", "M", "P_inv_sqrt", "Q_inv_sqrt", "skipped", "root_failures")
SHAPE = (2, 4, 6)


def _exact_numpy(x):
    """A backend array as a NumPy array of the same dtype, copied from any device (the harness's one copy
    to the host: no rounding, no widening of float32 and float64; NumPy's DLPack import refused GPU arrays)."""
    return np.array(_host_array(x), copy=True)


def _grads(steps: int) -> list:
    """Seeded gradients; step 2 has a NaN in matrix 1, so that the skip counter is not all zero."""
    grads = reference_gradients(SHAPE, steps, seed=40)
    grads[2][1, 0, 0] = math.nan
    return grads


def _assert_same(state_a: FISMOState, state_b: FISMOState) -> None:
    assert state_a.step == state_b.step
    for f in FIELDS:
        a, b = _exact_numpy(getattr(state_a, f)), _exact_numpy(getattr(state_b, f))
        assert a.dtype == b.dtype and np.array_equal(a, b), f


# ====================================================================== the core
def test_npz_round_trip_resumes_bit_identically(target: Target) -> None:
    """Save W and the state after 3 of 6 steps with ``np.savez``, load them back onto the backend
    (``from_dict(..., like=W)``), finish the run: every bit equals the uninterrupted run's."""
    opt = FISMO(nonfinite="skip", weight_decay=0.1)
    grads = _grads(6)
    W0 = np.random.default_rng(41).standard_normal(SHAPE)

    W = target.asarray(W0)
    state = opt.init(W)
    for G in grads:
        W, state = opt.step(W, target.asarray(G), state)

    W_r = target.asarray(W0)
    state_r = opt.init(W_r)
    for G in grads[:3]:
        W_r, state_r = opt.step(W_r, target.asarray(G), state_r)
    buffer = io.BytesIO()
    np.savez(buffer, W=_exact_numpy(W_r), **{k: (_exact_numpy(v) if k in FIELDS else v) for k, v in state_r.to_dict().items()})
    buffer.seek(0)
    with np.load(buffer) as saved:
        W_r = target.asarray(saved["W"])
        state_r = FISMOState.from_dict({k: saved[k] for k in saved.files if k != "W"}, like=W_r)
    assert _exact_numpy(state_r.skipped).tolist() == [0, 1]
    for G in grads[3:]:
        W_r, state_r = opt.step(W_r, target.asarray(G), state_r)
    assert np.array_equal(_exact_numpy(W), _exact_numpy(W_r))
    _assert_same(state, state_r)


def test_to_dict_and_from_dict_in_memory_and_through_torch_save() -> None:
    """``from_dict(to_dict())`` is the same state; a torch state goes through ``torch.save`` and
    ``torch.load(weights_only=True)`` (plain tensors and ints) and resumes bit for bit."""
    opt = FISMO(nonfinite="skip")
    grads = _grads(4)
    W = np.random.default_rng(42).standard_normal(SHAPE)
    state = opt.init(W)
    for G in grads[:3]:
        W, state = opt.step(W, G, state)
    d = state.to_dict()
    assert set(d) == {*FISMOState._fields, "block_size", "fismo_state_format"} and d["step"] == 3
    _assert_same(FISMOState.from_dict(d, like=W), state)

    torch = pytest.importorskip("torch")
    W_t = torch.asarray(np.random.default_rng(43).standard_normal(SHAPE), dtype=torch.float32)
    state_t = opt.init(W_t)
    W_t, state_t = opt.step(W_t, torch.asarray(grads[0], dtype=torch.float32), state_t)
    buffer = io.BytesIO()
    torch.save(state_t.to_dict(), buffer)
    buffer.seek(0)
    loaded = FISMOState.from_dict(torch.load(buffer, weights_only=True), like=W_t)
    _assert_same(loaded, state_t)
    G = torch.asarray(grads[1], dtype=torch.float32)
    _assert_same(opt.step(W_t, G, loaded)[1], opt.step(W_t, G, state_t)[1])


@pytest.mark.parametrize("block_size", [None, 2])
def test_a_jax_state_moves_to_torch_and_back_bit_for_bit(block_size) -> None:
    """``from_dict(jax_state.to_dict(), like=torch_W)``: ``torch.asarray`` read each JAX array's buffer as
    raw bytes (a 6 x 6 float64 ``P`` became 72 float32 values), refused as "saved for another parameter?"
    (a user's hunt, 2026-12-02). Arrays of a third library go through DLPack: the same bits both ways."""
    torch = pytest.importorskip("torch")
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    jax.config.update("jax_enable_x64", True)
    opt = FISMO(nonfinite="skip", block_size=block_size)
    grads = _grads(3)
    W = np.random.default_rng(44).standard_normal(SHAPE)
    for dtype in ("float64", "float32"):
        W_j, state = jnp.asarray(W, dtype=dtype), opt.init(jnp.asarray(W, dtype=dtype))
        for G in grads:
            W_j, state = opt.step(W_j, jnp.asarray(G, dtype=dtype), state)
        W_t = torch.asarray(np.asarray(W_j))
        on_torch = FISMOState.from_dict(state.to_dict(), like=W_t, block_size=block_size)
        back = FISMOState.from_dict(on_torch.to_dict(), like=W_j, block_size=block_size)
        saved, moved, returned = state.to_dict(), on_torch.to_dict(), back.to_dict()
        assert isinstance(moved["M"], torch.Tensor) and set(moved) == set(saved) == set(returned)
        for key, value in saved.items():
            if isinstance(value, (int, type(None))):
                assert moved[key] == value == returned[key], key
                continue
            a, b, c = (_exact_numpy(d[key]) for d in (saved, moved, returned))
            assert a.dtype == b.dtype == c.dtype and np.array_equal(a, b) and np.array_equal(a, c), key


def _saved(shape=SHAPE, dtype=np.float64) -> dict:
    W = np.zeros(shape, dtype)
    opt = FISMO()
    return dict(opt.step(W, np.ones(shape, dtype), opt.init(W))[1].to_dict())


@pytest.mark.parametrize(
    "edit, like, exc, match",
    [
        (lambda d: d, np.zeros((2, 4, 7)), ValueError,
         r"state\.Q has shape \(2, 6, 6\), but parameters of shape \(2, 4, 7\) need \(2, 7, 7\)"),
        (lambda d: d, np.zeros((4, 6)), ValueError, r"state\.P has shape \(2, 4, 4\).*need \(4, 4\)"),
        (lambda d: d, np.zeros(SHAPE, np.float32), TypeError,
         r"state\.P has dtype float64, but parameters of dtype float32 keep their state in float32"),
        (lambda d: {k: v for k, v in d.items() if k != "M"}, np.zeros(SHAPE), KeyError, r"missing \['M'\]"),
        (lambda d: {k: v for k, v in d.items() if k != "step"}, np.zeros(SHAPE), KeyError, r"missing \['step'\]"),
        (lambda d: {**d, "exp_avg": np.zeros(SHAPE)}, np.zeros(SHAPE), KeyError, r"unexpected keys \['exp_avg'\]"),
        # Loaded until 2026-12-03: the next step made the parameters NaN, with no error under any policy.
        (lambda d: {**d, "M": np.where(np.arange(48).reshape(SHAPE) < 3, np.nan, d["M"])}, np.zeros(SHAPE),
         ValueError, r"state\.M contains NaN or infinite values \(3 NaN, 0 infinite of 48 entries\): the state is "
                     r"damaged"),
        (lambda d: {**d, "Q_inv_sqrt": np.where(np.eye(6) > 0, np.inf, d["Q_inv_sqrt"])}, np.zeros(SHAPE),
         ValueError, r"state\.Q_inv_sqrt contains NaN or infinite values \(0 NaN, 12 infinite of 72 entries\)"),
        (lambda d: {**d, "skipped": np.zeros(3, np.int32)}, np.zeros(SHAPE), ValueError,
         r"state\.skipped must be an integer array of shape \(2,\)"),
        (lambda d: {**d, "root_failures": np.zeros(2)}, np.zeros(SHAPE), ValueError,
         r"state\.root_failures must be an integer array"),
        # Loaded before 2026-11-28: a negative count, or one int32 wraps round (2**31 became -2**31).
        (lambda d: {**d, "skipped": np.asarray([0, -1], np.int32)}, np.zeros(SHAPE), ValueError,
         r"state\.skipped counts must lie in 0\.\.2147483647"),
        (lambda d: {**d, "root_failures": np.asarray([2**31, 0], np.int64)}, np.zeros(SHAPE), ValueError,
         r"state\.root_failures counts must lie in 0\.\.2147483647"),
        (lambda d: {**d, "step": 2.5}, np.zeros(SHAPE), ValueError, r"step must be an integer >= 0, got 2\.5"),
        (lambda d: {**d, "step": -1}, np.zeros(SHAPE), ValueError, r"step must be an integer >= 0"),
        (lambda d: {**d, "fismo_state_format": 99}, np.zeros(SHAPE), ValueError, r"unknown FISMO state format 99"),
        # Each of these was a raw TypeError / OverflowError, or loaded (True, '3', 2.5 as the format, 0.5 blocks).
        (lambda d: {**d, "step": math.inf}, np.zeros(SHAPE), ValueError, r"step must be an integer >= 0, got inf"),
        (lambda d: {**d, "step": math.nan}, np.zeros(SHAPE), ValueError, r"step must be an integer >= 0, got nan"),
        (lambda d: {**d, "step": None}, np.zeros(SHAPE), ValueError, r"step must be an integer >= 0, got None"),
        (lambda d: {**d, "step": True}, np.zeros(SHAPE), ValueError, r"step must be an integer >= 0, got True"),
        (lambda d: {**d, "step": np.asarray(True)}, np.zeros(SHAPE), ValueError, r"step must be an integer >= 0"),
        (lambda d: {**d, "step": "3"}, np.zeros(SHAPE), ValueError, r"step must be an integer >= 0, got '3'"),
        (lambda d: {**d, "fismo_state_format": 2.5}, np.zeros(SHAPE), ValueError,
         r"fismo_state_format must be an integer >= 0, got 2\.5"),
        (lambda d: {**d, "fismo_state_format": None}, np.zeros(SHAPE), ValueError,
         r"fismo_state_format must be an integer >= 0, got None"),
        (lambda d: {**d, "block_size": 0.5}, np.zeros(SHAPE), ValueError, r"block_size must be an integer >= 0, got 0\.5"),
        (lambda d: list(d.items()), np.zeros(SHAPE), TypeError, r"d must be a mapping"),
        (lambda d: d, [[0.0]], TypeError, r"like must be an array"),
        (lambda d: d, np.zeros(SHAPE, np.int64), TypeError, r"like must have a real floating dtype"),
    ],
    ids=["other-n", "unbatched", "dtype", "missing-M", "missing-step", "extra-key", "nan-M", "infinite-root", "counter-shape",
         "counter-dtype", "negative-counter", "int32-overflowing-counter", "fractional-step", "negative-step", "format", "inf-step", "nan-step", "none-step",
         "bool-step", "numpy-bool-step", "string-step", "fractional-format", "none-format", "fractional-block-size",
         "not-a-mapping", "like-list", "like-int"],
)
def test_state_that_does_not_fit_is_refused(edit, like, exc, match) -> None:
    with pytest.raises(exc, match=match):
        FISMOState.from_dict(edit(_saved()), like=like)


@pytest.mark.parametrize("block_size", [True, 0, "2", 2.0])
def test_the_block_size_argument_is_checked_as_fismo_checks_it(block_size) -> None:
    """``from_dict(..., block_size=...)`` said "block_size=True means block_size=True" or raised a raw
    TypeError; it takes the rule of ``FISMO(block_size=...)``."""
    with pytest.raises(ValueError, match=r"block_size must be None \(full factors\) or a positive integer"):
        FISMOState.from_dict(_saved(), like=np.zeros(SHAPE), block_size=block_size)


def test_a_hand_built_batched_state_round_trips() -> None:
    """A state built from its first six fields keeps the counter ``skipped`` a Python 0 for a whole batch
    (the default policy never writes it); ``from_dict(to_dict())`` refused that 0-d counter for a batch."""
    rng = np.random.default_rng(0)
    W, G = rng.standard_normal(SHAPE), rng.standard_normal(SHAPE)
    opt = FISMO()
    s0 = opt.init(W)
    hand = FISMOState(s0.P, s0.Q, s0.M, s0.P_inv_sqrt, s0.Q_inv_sqrt, 0)
    W1, s1 = opt.step(W, G, hand)
    back = FISMOState.from_dict(s1.to_dict(), like=W1)
    assert back.skipped.dtype == np.int32 and back.skipped.tolist() == [0, 0]
    G2 = rng.standard_normal(SHAPE)
    W2, _ = opt.step(W1, G2, s1)
    W2_back, _ = opt.step(W1, G2, back)
    assert np.array_equal(W2, W2_back)


@pytest.mark.parametrize(
    "edit, exc, match",
    [({"skipped": np.zeros(2)}, TypeError, r"state.skipped must be an integer count .* got float64"),
     ({"root_failures": np.zeros(2, np.float32)}, TypeError, r"state.root_failures must be an integer count"),
     ({"step": -3}, ValueError, r"state step must be an integer >= 0, got -3"),
     ({"step": 1.5}, ValueError, r"state step must be an integer >= 0, got 1\.5"),
     # Python int counters out of from_dict's range: stepped until 2026-12-04 (a user's hunt).
     ({"skipped": -5}, ValueError, r"state.skipped counts must lie in 0\.\.2147483647, got -5"),
     ({"root_failures": 2**40}, ValueError, r"state.root_failures counts must lie in 0\.\.2147483647")],
    ids=["float-skipped", "float-root-failures", "negative-step", "fractional-step", "negative-count", "huge-count"],
)
def test_step_refuses_a_hand_built_state_that_could_not_be_saved(edit, exc, match) -> None:
    """``step`` took float counters and a negative step count (a user's hunt, 2026-12-02), and returned a
    state with them that ``from_dict(to_dict())`` refused: the checks of ``from_dict`` are ``step``'s too."""
    rng = np.random.default_rng(1)
    W, G = rng.standard_normal(SHAPE), rng.standard_normal(SHAPE)
    opt = FISMO(nonfinite="skip")
    hand = opt.init(W)._replace(**edit)
    with pytest.raises(exc, match=match):
        opt.step(W, G, hand)
    with pytest.raises((TypeError, ValueError)):  # from_dict refuses the same state
        FISMOState.from_dict(hand.to_dict(), like=W)


def test_counters_may_be_missing() -> None:
    """A dict without the counters (written before they existed) loads with zero counters."""
    d = {k: v for k, v in _saved().items() if k not in ("skipped", "root_failures", "fismo_state_format")}
    state = FISMOState.from_dict(d, like=np.zeros(SHAPE))
    assert state.skipped.dtype == np.int32 and state.skipped.tolist() == [0, 0] and state.root_failures.tolist() == [0, 0]


# ================================================================ the torch adapter
def _torch_setup(torch, hidden=4, nonfinite="skip", block_size=None):
    from fismo_core.backends.torch import FISMO as TorchFISMO

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 3))
    groups = [
        {"params": [model[0].weight, model[2].weight]},
        {"params": [model[0].bias, model[2].bias], "algorithm": "adamw"},
    ]
    return model, TorchFISMO(groups, lr=0.05, nonfinite=nonfinite, block_size=block_size)


def _torch_train(torch, model, opt, seeds) -> None:
    for seed in seeds:
        gen = torch.Generator().manual_seed(seed)
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=gen)
        if seed == 2:
            model[2].weight.grad[0, 0] = math.nan
        opt.step()


def test_torch_counters_survive_a_checkpoint() -> None:
    """``skipped`` and ``root_failures`` are saved in ``state_dict()`` and come back as int32, and
    the resumed run is bit for bit the uninterrupted one."""
    torch = pytest.importorskip("torch")
    model, opt = _torch_setup(torch)
    _torch_train(torch, model, opt, range(6))

    resumed, opt_r = _torch_setup(torch)
    _torch_train(torch, resumed, opt_r, range(3))
    buffer = io.BytesIO()
    torch.save({"model": resumed.state_dict(), "opt": opt_r.state_dict()}, buffer)
    buffer.seek(0)
    checkpoint = torch.load(buffer, weights_only=True)
    fresh, opt_f = _torch_setup(torch)
    fresh.load_state_dict(checkpoint["model"])
    opt_f.load_state_dict(checkpoint["opt"])
    state = opt_f.state[fresh[2].weight]
    assert state["skipped"].dtype == torch.int32 and state["skipped"].item() == 1
    assert state["root_failures"].dtype == torch.int32 and state["root_failures"].item() == 0
    _torch_train(torch, fresh, opt_f, range(3, 6))
    for p, q in zip(model.parameters(), fresh.parameters()):
        assert torch.equal(p, q)
    for key, value in opt.state[model[2].weight].items():
        assert torch.equal(value, opt_f.state[fresh[2].weight][key]), key


def _snapshot(torch, opt) -> list:
    return [
        [{k: v.clone() for k, v in opt.state[p].items()} for p in group["params"]] for group in opt.param_groups
    ] + [[{k: v for k, v in group.items() if k != "params"} for group in opt.param_groups]]


def _same(torch, a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(torch, a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(_same(torch, x, y) for x, y in zip(a, b))
    return a == b


def _edit(saved: dict, param: int, key: str, value) -> dict:
    state = {index: dict(s) for index, s in saved["state"].items()}
    if value is None:
        del state[param][key]
    else:
        state[param][key] = value
    return {"state": state, "param_groups": saved["param_groups"]}


@pytest.mark.parametrize(
    "make, exc, match",
    [
        # The core's messages (FISMOState.from_dict validates), prefixed with the parameter.
        (lambda torch, saved, other: other, ValueError,
         r"state for parameter 0 of param group 0 \(shape \(4, 5\)\), optimised as the 4x5 matrix: "
         r"state\.P has shape \(6, 6\), but parameters of shape \(4, 5\) need \(4, 4\)"),
        (lambda torch, saved, other: _edit(saved, 0, "P", None), KeyError, r"missing \['P'\]"),
        (lambda torch, saved, other: _edit(saved, 0, "M", torch.zeros(4, 5, dtype=torch.int64)), TypeError,
         r"state for parameter 0 of param group 0 .*: state\.M has dtype torch\.int64"),
        (lambda torch, saved, other: _edit(saved, 0, "Q", torch.full((5, 5), math.nan)), ValueError,
         r"state for parameter 0 of param group 0 .*: state\.Q contains NaN or infinite values \(25 NaN, 0 infinite "
         r"of 25 entries\)"),
        # Beyond float32's range, as the float32 state it would be loaded into.
        (lambda torch, saved, other: _edit(saved, 0, "M", torch.full((4, 5), 1e300, dtype=torch.float64)),
         ValueError, r"state\.M contains NaN or infinite values \(0 NaN, 20 infinite of 20 entries\)"),
        (lambda torch, saved, other: _edit(saved, 1, "skipped", torch.zeros(2)), ValueError,
         r"state\.skipped must be an integer array of shape \(\)"),
        # torch.optim's cast raised NotImplementedError: Cannot copy out of meta tensor (a user's hunt, 2026-12-03).
        (lambda torch, saved, other: _edit(saved, 0, "M", torch.empty(4, 5, device="meta")), ValueError,
         r"parameter 0 of param group 0 \(shape \(4, 5\)\): its saved state 'M' lies on the meta device .*"
         r"map_location='meta'"),
        # Loaded by the base class until 2026-12-03, its parameters starting afresh; state_dict then raised
        # a raw TypeError sorting the keys (a user's hunt). Through JSON the keys become strings.
        (lambda torch, saved, other: {"state": {str(k): v for k, v in saved["state"].items()},
                                      "param_groups": saved["param_groups"]}, ValueError,
         r"the checkpoint's state has keys that name no parameter of its param_groups: '0', '1', '2', '3' \(the "
         r"groups' params are 0, 1, 2, 3\)"),
        (lambda torch, saved, other: {"state": saved["state"], "param_groups": saved["param_groups"][::-1]},
         ValueError, r"param group 0 has algorithm .fismo., but the checkpoint.s group 0 has .adamw."),
        # The AdamW group (group 1) saved as a FISMO group: the base class would take the checkpoint's
        # algorithm and state, and the next step would run FISMO on the biases.
        (lambda torch, saved, other: {"state": saved["state"], "param_groups": [
            saved["param_groups"][0], {**saved["param_groups"][0], "params": saved["param_groups"][1]["params"]}]},
         ValueError, r"param group 1 has algorithm 'adamw', but the checkpoint's group 1 has 'fismo'"),
        # Another optimizer's group (torch.optim.AdamW's keys, no "algorithm").
        (lambda torch, saved, other: {"state": saved["state"], "param_groups": [
            saved["param_groups"][0], {k: v for k, v in saved["param_groups"][1].items() if k != "algorithm"}]},
         ValueError, r"param group 1 has algorithm 'adamw', but the checkpoint's group 1 has no algorithm "
                     r"\(not saved by FISMO\)"),
    ],
    ids=["other-model", "missing-P", "integer-M", "nan-Q", "M-beyond-float32", "counter", "meta-M", "string-keys", "groups-swapped", "adamw-saved-as-fismo", "not-fismos"],
)
def test_torch_checkpoint_that_does_not_fit_is_refused(make, exc, match) -> None:
    """A checkpoint for other shapes, with a missing or malformed tensor, or with the groups in
    another order raises before anything is loaded: the optimizer keeps its state and groups."""
    torch = pytest.importorskip("torch")
    model, opt = _torch_setup(torch)
    _torch_train(torch, model, opt, range(2))
    other_model, other_opt = _torch_setup(torch, hidden=6)  # same structure, other sizes
    _torch_train(torch, other_model, other_opt, range(2))
    saved = opt.state_dict()
    before = _snapshot(torch, opt)
    with pytest.raises(exc, match=match):
        opt.load_state_dict(make(torch, saved, other_opt.state_dict()))
    assert _same(torch, before, _snapshot(torch, opt))


def test_torch_checkpoint_with_numbers_for_step_counts_resumes_bit_for_bit() -> None:
    """Step counts saved as Python numbers (as ``FISMOState.to_dict`` and old checkpoints hold them), for
    FISMO and AdamW parameters, load as tensors (``__setstate__``, as ``torch.optim``'s optimizers) and
    the run goes on as the uninterrupted one, bit for bit: the step no longer fails after writing ``P``."""
    torch = pytest.importorskip("torch")
    model, opt = _torch_setup(torch)
    _torch_train(torch, model, opt, [0, 1])
    saved = copy.deepcopy(opt.state_dict())  # the AdamW states would be shared with opt's (torch.optim loads them so)
    numbers = {"state": {i: {**s, "step": int(s["step"])} for i, s in saved["state"].items()},
               "param_groups": saved["param_groups"]}
    fresh, opt_f = _torch_setup(torch)
    fresh.load_state_dict(model.state_dict())
    opt_f.load_state_dict(numbers)
    for p in fresh.parameters():
        step = opt_f.state[p]["step"]
        assert isinstance(step, torch.Tensor) and step.device.type == "cpu" and step.item() == 2
    _torch_train(torch, model, opt, [3, 4])
    _torch_train(torch, fresh, opt_f, [3, 4])
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), fresh.parameters()))


@pytest.mark.parametrize("block_size", [None, 2], ids=["full", "blocks"])
def test_torch_loads_states_with_to_dicts_own_keys_and_goes_on_bit_for_bit(block_size) -> None:
    """A FISMO state as ``FISMOState.to_dict`` writes it, with its ``block_size`` and format keys, loaded
    (from_dict checks them), but kept in the state they made every later step refuse it ("block_size=None
    splits ... into other blocks than its state has"; a user's hunt, 2026-12-03). Loaded now as the state
    without them: the same keys as the uninterrupted run's state, and its parameters bit for bit."""
    torch = pytest.importorskip("torch")
    model, opt = _torch_setup(torch, block_size=block_size)
    _torch_train(torch, model, opt, [0, 1])
    saved = copy.deepcopy(opt.state_dict())
    for (i, state), p in zip(sorted(saved["state"].items()), [p for g in opt.param_groups for p in g["params"]]):
        if "M" in state:  # the FISMO matrices: to_dict's whole dict, step count included
            core = FISMOState.from_dict({**state, "block_size": state_block_size(
                *p.shape, block_size)}, like=p.detach(), block_size=block_size).to_dict()
            assert set(core) - set(state) == {"block_size", "fismo_state_format"}
            saved["state"][i] = core
    fresh, opt_f = _torch_setup(torch, block_size=block_size)
    fresh.load_state_dict(model.state_dict())
    opt_f.load_state_dict(saved)
    _torch_train(torch, model, opt, [3, 4])
    _torch_train(torch, fresh, opt_f, [3, 4])
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), fresh.parameters()))
    assert [set(opt.state[p]) for p in model.parameters()] == [set(opt_f.state[p]) for p in fresh.parameters()]


def test_torch_checkpoint_from_before_adamw_groups_loads() -> None:
    """A FISMO group saved before groups had an ``"algorithm"`` (or ``adjust_lr_fn``) loads as a FISMO
    group without adjustment, and the run goes on as the uninterrupted one."""
    torch = pytest.importorskip("torch")
    from fismo_core.backends.torch import FISMO as TorchFISMO

    def setup():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(5, 4, bias=False), torch.nn.Linear(4, 3, bias=False))
        return model, TorchFISMO(model.parameters(), lr=0.05)

    model, opt = setup()
    _torch_train(torch, model, opt, [0, 1])
    saved = copy.deepcopy(opt.state_dict())
    old = {"state": saved["state"], "param_groups": [
        {k: v for k, v in g.items() if k not in ("algorithm", "adjust_lr_fn")} for g in saved["param_groups"]]}
    fresh, opt_f = setup()
    fresh.load_state_dict(model.state_dict())
    opt_f.load_state_dict(old)
    assert opt_f.param_groups[0]["algorithm"] == "fismo" and opt_f.param_groups[0]["adjust_lr_fn"] is None
    _torch_train(torch, model, opt, [3])
    _torch_train(torch, fresh, opt_f, [3])
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), fresh.parameters()))


def test_torch_checkpoint_from_before_the_counters_loads() -> None:
    """A state_dict without the counters and without the ``nonfinite`` group key (as saved before
    they existed) loads; the counters start at 0 and the run goes on. The state_dict comes from a
    live optimizer, not from disk: the loaded state must not share tensors with it (FISMO writes
    its state in place), so both then take the same step."""
    torch = pytest.importorskip("torch")
    model, opt = _torch_setup(torch, nonfinite="raise")
    _torch_train(torch, model, opt, [0, 1])
    saved = opt.state_dict()
    old = {
        "state": {i: {k: v for k, v in s.items() if k not in ("skipped", "root_failures")} for i, s in saved["state"].items()},
        "param_groups": [{k: v for k, v in g.items() if k != "nonfinite"} for g in saved["param_groups"]],
    }
    fresh, opt_f = _torch_setup(torch, nonfinite="raise")
    fresh.load_state_dict(model.state_dict())
    opt_f.load_state_dict(old)
    assert opt_f.state[fresh[0].weight]["skipped"].item() == 0
    for key, value in opt_f.state[fresh[0].weight].items():
        assert value.data_ptr() != opt.state[model[0].weight][key].data_ptr(), key
    _torch_train(torch, fresh, opt_f, [3])
    _torch_train(torch, model, opt, [3])
    # The FISMO matrices only: torch.optim.AdamW's load_state_dict shares the loaded tensors with
    # the source optimizer (torch's behaviour, kept bit for bit in "adamw" groups), so two live
    # optimizers that shared a state_dict then disturb each other's AdamW state.
    for layer in (0, 2):
        assert torch.equal(model[layer].weight, fresh[layer].weight)


@pytest.mark.parametrize(
    "saved_with, load_with",
    [(3, None), (None, 3), (3, 2)],
    ids=["blocks-into-full", "full-into-blocks", "other-blocks"],
)
def test_torch_checkpoint_with_another_block_size_is_refused(saved_with, load_with) -> None:
    """Loading a state_dict saved with another ``block_size`` raises a ``ValueError`` naming both
    values, before anything is loaded: the optimizer keeps its state and groups."""
    torch = pytest.importorskip("torch")
    model, opt = _torch_setup(torch, block_size=saved_with)
    _torch_train(torch, model, opt, range(2))
    saved = opt.state_dict()
    other_model, other = _torch_setup(torch, block_size=load_with)
    _torch_train(torch, other_model, other, range(2))
    before = _snapshot(torch, other)
    with pytest.raises(
        ValueError, match=rf"has block_size={load_with!r}, but the checkpoint's group 0 was saved with block_size={saved_with!r}"
    ):
        other.load_state_dict(saved)
    assert _same(torch, before, _snapshot(torch, other))


@pytest.mark.parametrize("load_with", [3, None], ids=["the-states-blocks", "neither"])
def test_torch_checkpoint_saved_after_a_block_size_change_says_so(load_with) -> None:
    """A state_dict taken after ``block_size`` was changed and before the next step (which refuses the change)
    names the new value in its group but holds states of the old blocks. Until 2026-12-03 loading it with the
    old value said "Resume with block_size=4", which then failed on the states' shapes (a user's hunt). Now
    the refusal says what happened and how to load it, and following its advice (a pre-hook setting the
    checkpoint's block_size back) loads the run, which goes on as the uninterrupted one."""
    torch = pytest.importorskip("torch")
    model, opt = _torch_setup(torch, block_size=3)  # (4, 5): P 3 + 1, Q 3 + 2; block_size=4 splits Q as 4 + 1
    _torch_train(torch, model, opt, range(2))
    opt.param_groups[0]["block_size"] = 4
    saved = opt.state_dict()
    other_model, other = _torch_setup(torch, block_size=load_with)
    before = _snapshot(torch, other)
    told = (r"has block_size=3, and the checkpoint's states of that group have its blocks, but its group 0 says "
            r"block_size=4: the block_size was changed after the last step.*param_groups\[0\]\['block_size'\] = 3"
            if load_with == 3 else
            r"has block_size=None, and the checkpoint's group 0 says block_size=4, but its states have the blocks "
            r"of neither")
    with pytest.raises(ValueError, match=told):
        other.load_state_dict(saved)
    assert _same(torch, before, _snapshot(torch, other))
    if load_with == 3:
        other_model.load_state_dict(model.state_dict())
        opt.param_groups[0]["block_size"] = 3
        other.register_load_state_dict_pre_hook(
            lambda optimizer, state_dict: {**state_dict, "param_groups": [
                {**state_dict["param_groups"][0], "block_size": 3}, *state_dict["param_groups"][1:]]})
        other.load_state_dict(copy.deepcopy(saved))
        _torch_train(torch, model, opt, [2, 3])
        _torch_train(torch, other_model, other, [2, 3])
        for a, b in zip(model.parameters(), other_model.parameters()):
            assert torch.equal(a, b)


@pytest.mark.parametrize("saved_with, load_with", [(None, 512), (512, 5), (5, None)])
def test_torch_checkpoint_with_a_block_size_that_splits_nothing_differently_loads(saved_with, load_with) -> None:
    """``block_size`` at or above both sides of every matrix is the full factor, bit for bit: a checkpoint
    saved with ``block_size=None`` was refused by a ``FISMO.training`` optimizer (``block_size=512``) on a
    small model, although no state would change (a user's hunt). It loads, and the run goes on as the
    uninterrupted one."""
    torch = pytest.importorskip("torch")
    model, opt = _torch_setup(torch, block_size=saved_with)  # matrices of sides 4 and 5 at most
    _torch_train(torch, model, opt, range(2))
    saved = opt.state_dict()
    twin, other = _torch_setup(torch, block_size=load_with)
    twin.load_state_dict(model.state_dict())
    other.load_state_dict(copy.deepcopy(saved))  # a copy: AdamW groups share loaded tensors (torch's behaviour)
    _torch_train(torch, model, opt, [2, 3])
    _torch_train(torch, twin, other, [2, 3])
    for a, b in zip(model.parameters(), twin.parameters()):
        assert torch.equal(a, b)


def test_torch_blocked_checkpoint_that_does_not_fit_is_refused() -> None:
    """A blocked state without its remainder block, or a full state with one, is refused naming the key."""
    torch = pytest.importorskip("torch")
    model, opt = _torch_setup(torch, block_size=3)  # (4, 5): P is 3 + 1, Q is 3 + 2
    _torch_train(torch, model, opt, range(2))
    saved = opt.state_dict()
    assert saved["state"][0]["P"].shape == (1, 3, 3) and saved["state"][0]["P_rest"].shape == (1, 1)
    before = _snapshot(torch, opt)
    with pytest.raises(KeyError, match=r"missing \['P_rest'\]"):
        opt.load_state_dict(_edit(saved, 0, "P_rest", None))
    with pytest.raises(ValueError, match=r"state\.Q_rest has shape \(3, 3\), but parameters of shape \(4, 5\) need \(2, 2\)"):
        opt.load_state_dict(_edit(saved, 0, "Q_rest", torch.zeros(3, 3)))
    assert _same(torch, before, _snapshot(torch, opt))
    full_model, full = _torch_setup(torch)
    _torch_train(torch, full_model, full, range(2))
    full_saved = full.state_dict()
    with pytest.raises(KeyError, match=r"unexpected keys \['P_rest'\]"):
        full.load_state_dict(_edit(full_saved, 0, "P_rest", torch.zeros(1, 1)))


def test_torch_checkpoint_from_before_block_size_loads_as_full() -> None:
    """A state_dict whose groups have no ``block_size`` key (saved before it existed) loads into an
    optimizer with full factors and goes on bit for bit."""
    torch = pytest.importorskip("torch")
    model, opt = _torch_setup(torch)
    _torch_train(torch, model, opt, range(2))
    saved = opt.state_dict()
    old = {"state": saved["state"], "param_groups": [{k: v for k, v in g.items() if k != "block_size"} for g in saved["param_groups"]]}
    buffer = io.BytesIO()
    torch.save(old, buffer)
    buffer.seek(0)
    fresh, opt_f = _torch_setup(torch)
    fresh.load_state_dict(model.state_dict())
    opt_f.load_state_dict(torch.load(buffer, weights_only=True))
    _torch_train(torch, fresh, opt_f, [3, 4])
    _torch_train(torch, model, opt, [3, 4])
    for layer in (0, 2):
        assert torch.equal(model[layer].weight, fresh[layer].weight)


def test_to_numpy_reads_counters() -> None:
    """The testing helper reads the int32 counters of every backend (it widens to float64)."""
    state = FISMO().init(np.zeros(SHAPE))
    assert to_numpy(state.skipped).tolist() == [0.0, 0.0]
