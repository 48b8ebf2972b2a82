"""Each rule the core and the adapters share has one definition, in the core, and the adapters call it.

The rules: the weight-to-matrix flattening, the root-refresh schedule
(``InverseRootConfig.every``), line 9 with decoupled weight decay, the
default of the inverse-root checks (``fallback``), the checkpoint layout and
its validation, the hyperparameter defaults, the integer check, and the
contract of the Kronecker factor structures. For a rule that is called at
run time, the test replaces the core's definition (``monkeypatch``) and
checks that the core, the torch adapter and the optax adapter all follow
the replacement, so that no adapter can keep a copy of its own; for a rule
bound at import (defaults), it checks equality with the core's.
"""

from __future__ import annotations

import dataclasses
import inspect
import typing

import numpy as np
import pytest

import fismo_core.guards
import fismo_core.linalg
import fismo_core.optimizer
import fismo_core.verify
from fismo_core import FISMO, FISMOState, InverseRootConfig
from fismo_core.kronecker import BlockDiagonalFactor, FullFactor, KroneckerFactor, Structure, factor_structure

SHAPE = (4, 3)


def _gradient(shape: tuple[int, ...] = SHAPE, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape)


def _torch():
    return pytest.importorskip("torch")


def _optax():
    pytest.importorskip("jax")
    return pytest.importorskip("optax")


def _torch_step(W0: np.ndarray, G: np.ndarray, **options):
    """One step of the torch adapter on the parameter ``W0`` (float64): the parameter and its state."""
    torch = _torch()
    from fismo_core.backends.torch import FISMO as TorchFISMO

    p = torch.nn.Parameter(torch.asarray(W0.copy()))
    opt = TorchFISMO([p], **options)
    p.grad = torch.asarray(G)
    opt.step()
    return p.detach().numpy(), opt.state[p]


# ------------------------------------------------------------------ weight-to-matrix flattening
def test_matrix_shape_keeps_the_output_axis() -> None:
    """``(out, *rest)`` is the matrix ``(out, prod(rest))`` (Muon's rule for conv kernels); a matrix is itself."""
    shape = fismo_core.optimizer.matrix_shape
    assert shape((5, 3)) == (5, 3)
    assert shape((4, 2, 3, 3)) == (4, 2 * 3 * 3)
    assert all(type(x) is int for x in shape(np.array([4, 2, 3]).tolist()))
    with pytest.raises(ValueError, match=r"at least 2 dimensions, got shape \(7,\)"):
        shape((7,))


@pytest.mark.parametrize("patched", [False, True], ids=["core-rule", "patched-rule"])
def test_torch_flattens_weights_by_the_core_rule(monkeypatch: pytest.MonkeyPatch, patched: bool) -> None:
    """Replacing the core's ``matrix_shape`` (here by Flax's output-last rule) changes the torch adapter's matrices."""
    if patched:
        monkeypatch.setattr(fismo_core.optimizer, "matrix_shape", lambda s: (int(np.prod(s[:-1])), int(s[-1])))
    conv = (4, 2, 3, 3)
    m, n = fismo_core.optimizer.matrix_shape(conv)
    _, state = _torch_step(np.ones(conv), _gradient(conv))
    assert (tuple(state["P"].shape), tuple(state["Q"].shape), tuple(state["M"].shape)) == ((m, m), (n, n), (m, n))
    assert (m, n) == ((24, 3) if patched else (4, 18))


def test_optax_flattens_weights_by_the_core_rule() -> None:
    """The optax adapter's default ``matrix_shape`` is the core's function itself (bound when it is defined);
    the factories' ``matrix_shape=None`` (their default, which ``optax.inject_hyperparams`` does not take for
    a schedule) is that function."""
    _optax()
    import jax.numpy as jnp
    from fismo_core.backends import optax as adapter

    assert adapter.default_matrix_shape is fismo_core.optimizer.matrix_shape
    conv = (4, 2, 3, 3)
    m, n = fismo_core.optimizer.matrix_shape(conv)
    for function in (adapter.fismo, adapter.fismo_training, adapter.scale_by_fismo):
        assert inspect.signature(function).parameters["matrix_shape"].default is None
    state = adapter.scale_by_fismo().init({"conv": jnp.ones(conv)})
    assert (state.states["conv"].P.shape, state.states["conv"].Q.shape) == ((m, m), (n, n))


# ------------------------------------------------------------------ root refresh (InverseRootConfig.every)
def test_refresh_rule_is_step_modulo_every() -> None:
    assert [InverseRootConfig(every=3).is_refresh_step(t) for t in range(7)] == [t % 3 == 0 for t in range(7)]
    assert all(InverseRootConfig().is_refresh_step(t) is True for t in range(4))


def _roots_after_one_step(path: str) -> np.ndarray:
    """``P_1^{-1/2}`` after one step with ``InverseRootConfig(every=2)``, by the core, torch or optax (eager or jit)."""
    W0, G = np.ones(SHAPE), _gradient()
    inv_root = {"every": 2}
    if path == "core":
        opt = FISMO(inv_root=inv_root)
        _, state = opt.step(W0, G, opt.init(W0))
        return state.P_inv_sqrt
    if path == "torch":
        return _torch_step(W0, G, inv_root=inv_root)[1]["P_inv_sqrt"].numpy()
    _optax()
    import jax
    import jax.numpy as jnp

    from fismo_core.backends.optax import scale_by_fismo

    tx = scale_by_fismo(inv_root=inv_root)
    params = {"w": jnp.asarray(W0, dtype=jnp.float32)}
    update = jax.jit(tx.update) if path == "optax-jit" else tx.update
    _, state = update({"w": jnp.asarray(G, dtype=jnp.float32)}, tx.init(params))
    return np.asarray(state.states["w"].P_inv_sqrt)


@pytest.mark.parametrize("path", ["core", "torch", "optax-eager", "optax-jit"])
@pytest.mark.parametrize("patched", [False, True], ids=["core-rule", "patched-rule"])
def test_every_path_asks_the_core_when_roots_are_due(monkeypatch: pytest.MonkeyPatch, path: str, patched: bool) -> None:
    """With the core's rule the first step recomputes the roots (``0 % 2 == 0``); with a rule that
    skips step 0, every path keeps the cached root of ``P_0 = I`` at the first step."""
    if patched:
        monkeypatch.setattr(InverseRootConfig, "is_refresh_step", lambda self, step: step % self.every == 1)
    root = _roots_after_one_step(path)
    assert bool(np.array_equal(root, np.eye(SHAPE[0]))) is patched


# ------------------------------------------------------------------ line 9 with decoupled weight decay
def test_line_9_factors() -> None:
    """``decay = lr * weight_decay`` with the unadjusted lr, ``rate`` the step's lr; no decay without weight decay."""
    factors = fismo_core.optimizer.line_9_factors
    assert factors(0.1, 0.5) == (0.1 * 0.5, 0.1)
    assert factors(0.1, 0.0) == (0.0, 0.1)
    assert factors(0.1, 0.5, 0.3) == (0.1 * 0.5, 0.3)
    W, dW = _gradient(seed=1), _gradient(seed=2)
    # W_t = (1 - lr wd) W_{t-1} - lr dW_t, the decoupled weight decay of AdamW and torch.optim.Muon.
    assert np.array_equal(fismo_core.optimizer.line_9(W, dW, 0.1, 0.5), (1 - 0.1 * 0.5) * W - 0.1 * dW)
    assert np.array_equal(fismo_core.optimizer.line_9(W, dW, 0.1), W - 0.1 * dW)


def _after_one_step(path: str, W0: np.ndarray, G: np.ndarray) -> np.ndarray:
    """``W_1`` by the core, the torch adapter or the optax adapter, with ``lr = 0.02`` and ``weight_decay = 0.1``."""
    lr, wd = 0.02, 0.1
    if path == "core":
        opt = FISMO(lr=lr, weight_decay=wd)
        return opt.step(W0, G, opt.init(W0))[0]
    if path == "torch":
        return _torch_step(W0, G, lr=lr, weight_decay=wd)[0]
    optax = _optax()
    import jax
    import jax.numpy as jnp

    from fismo_core.backends.optax import fismo

    tx = fismo(lr, weight_decay=wd, non_matrix="error")
    params = {"w": jnp.asarray(W0, dtype=jnp.float32)}
    update = jax.jit(tx.update) if path == "optax-jit" else tx.update
    updates, _ = update({"w": jnp.asarray(G, dtype=jnp.float32)}, tx.init(params), params)
    return np.asarray(optax.apply_updates(params, updates)["w"], dtype=np.float64)


@pytest.mark.parametrize("path", ["core", "torch", "optax-eager", "optax-jit"])
@pytest.mark.parametrize("patched", [False, True], ids=["core-rule", "patched-rule"])
def test_every_path_applies_the_core_line_9(monkeypatch: pytest.MonkeyPatch, path: str, patched: bool) -> None:
    """A line 9 that halves ``W`` and ignores the direction is followed by every path, exactly (halving is exact)."""
    if patched:
        monkeypatch.setattr(fismo_core.optimizer, "line_9_factors", lambda lr, weight_decay, step_lr=None: (0.5, 0.0))
    W0 = np.arange(1.0, 13.0).reshape(SHAPE) / 8  # exact in float32 too (the optax path runs in float32)
    W1 = _after_one_step(path, W0, _gradient())
    assert bool(np.array_equal(W1, 0.5 * W0)) is patched


@pytest.mark.parametrize("schedule", [False, True], ids=["float-lr", "schedule"])
def test_optax_line_9_without_decay_is_optax_learning_rate_scaling(schedule: bool) -> None:
    """Without weight decay the optax adapter's line 9 is ``optax.scale_by_learning_rate``, state and bits,
    also in bfloat16 (a schedule's value is cast to the update's dtype there)."""
    optax = _optax()
    import jax.numpy as jnp

    from fismo_core.backends.optax import _line_9

    lr = optax.cosine_decay_schedule(0.02, 10) if schedule else 0.0213
    ours, theirs = _line_9(lr, 0.0), optax.scale_by_learning_rate(lr)
    for dtype in (jnp.float32, jnp.bfloat16):
        g = {"w": jnp.asarray(_gradient(), dtype=dtype)}
        s_ours, s_theirs = ours.init(g), theirs.init(g)
        assert type(s_ours) is type(s_theirs)
        for _ in range(3):
            (u_ours, s_ours), (u_theirs, s_theirs) = ours.update(g, s_ours), theirs.update(g, s_theirs)
            assert u_ours["w"].dtype == u_theirs["w"].dtype and bool(jnp.array_equal(u_ours["w"], u_theirs["w"]))


# ------------------------------------------------------------------ the default of the inverse-root checks
def test_checks_roots_rule() -> None:
    """``fallback=None``: checked unless ``nonfinite="propagate"``; ``True``/``False`` regardless."""
    checks = fismo_core.guards.checks_roots
    assert [checks(InverseRootConfig().fallback, p) for p in ("raise", "skip", "propagate")] == [True, True, False]
    assert checks(True, "propagate")
    assert not checks(False, "raise")


@pytest.mark.parametrize("verdict", [False, True])
def test_torch_decides_root_checks_by_the_core_rule(monkeypatch: pytest.MonkeyPatch, verdict: bool) -> None:
    """The torch adapter's core runs with ``nonfinite="propagate"``; the group's own policy decides its root
    checks through ``guards.checks_roots`` (asked with the group's ``nonfinite``), whatever that rule says."""
    torch = _torch()
    from fismo_core.backends._torch_groups import core_key, make_core
    from fismo_core.backends.torch import FISMO as TorchFISMO

    asked = []

    def rule(fallback, nonfinite):
        asked.append(nonfinite)
        return verdict

    monkeypatch.setattr(fismo_core.guards, "checks_roots", rule)
    opt = TorchFISMO([torch.nn.Parameter(torch.ones(SHAPE))], nonfinite="skip")
    core = make_core(core_key(opt.param_groups[0]))
    assert core.nonfinite == "propagate" and core.inv_root.fallback is verdict and asked == ["skip"]


# ------------------------------------------------------------------ checkpoint layout and validation
@pytest.mark.parametrize("block_size", [None, 3], ids=["full", "blocks"])
def test_checkpoint_layout_is_the_cores(block_size) -> None:
    """``state_layout`` is what ``to_dict`` writes and what the torch adapter keeps per parameter."""
    torch = _torch()
    m, n = 4, 5
    layout = fismo_core.optimizer.state_layout(m, n, block_size)
    opt = FISMO(block_size=block_size)
    W = np.ones((m, n))
    d = opt.step(W, _gradient((m, n)), opt.init(W))[1].to_dict()
    assert {k: tuple(v.shape) for k, v in d.items() if k in layout} == layout
    assert set(d) - set(layout) == {"step", "skipped", "root_failures", "block_size", "fismo_state_format"}
    _, state = _torch_step(W, _gradient((m, n)), block_size=block_size)
    assert {k: tuple(v.shape) for k, v in state.items() if isinstance(v, torch.Tensor) and v.ndim} == layout
    assert set(state) - set(layout) == {"step", "skipped", "root_failures"}


def _torch_checkpoint(block_size=None):
    torch = _torch()
    from fismo_core.backends.torch import FISMO as TorchFISMO

    p = torch.nn.Parameter(torch.ones(4, 5))
    opt = TorchFISMO([p], block_size=block_size)
    p.grad = torch.asarray(_gradient((4, 5)), dtype=torch.float32)
    opt.step()
    return p, opt, opt.state_dict()


FAULTS = {
    "shape": lambda torch, s: {**s, "P": torch.zeros(3, 3)},
    "missing": lambda torch, s: {k: v for k, v in s.items() if k != "M"},
    "unknown-key": lambda torch, s: {**s, "exp_avg": torch.zeros(4, 5)},
    "dtype": lambda torch, s: {**s, "M": torch.zeros(4, 5, dtype=torch.int64)},
    "counter": lambda torch, s: {**s, "skipped": torch.zeros(2)},
    "step": lambda torch, s: {**s, "step": torch.tensor(-1.0)},
    "missing-rest": lambda torch, s: {k: v for k, v in s.items() if k != "Q_rest"},
}


@pytest.mark.parametrize("fault", list(FAULTS))
def test_torch_checkpoint_errors_are_the_cores(fault: str) -> None:
    """The same bad state gives the same error from the core's ``from_dict`` and from ``load_state_dict``
    (which prefixes the parameter's name), and the optimizer keeps its state."""
    torch = _torch()
    block_size = 3 if fault == "missing-rest" else None
    p, opt, saved = _torch_checkpoint(block_size)
    bad = FAULTS[fault](torch, saved["state"][0])
    with pytest.raises((KeyError, ValueError, TypeError)) as core_error:
        core_dict = {**bad, "block_size": 3} if block_size else bad  # to_dict records the block size per state
        FISMOState.from_dict(core_dict, like=torch.empty(4, 5), block_size=block_size)
    before = {k: v.clone() for k, v in opt.state[p].items()}
    with pytest.raises(core_error.type) as torch_error:
        opt.load_state_dict({"state": {0: bad}, "param_groups": saved["param_groups"]})
    assert core_error.value.args[0] in torch_error.value.args[0]
    assert "parameter 0 of param group 0" in torch_error.value.args[0]
    assert all(torch.equal(v, opt.state[p][k]) for k, v in before.items())


def test_torch_loader_validates_through_from_dict(monkeypatch: pytest.MonkeyPatch) -> None:
    """Replacing ``FISMOState.from_dict`` changes what ``load_state_dict`` accepts: it has no checks of its own."""
    _, opt, saved = _torch_checkpoint()
    opt.load_state_dict(saved)  # the core accepts it

    def refuse(cls, d, like, *, block_size=None):
        raise ValueError("refused by the core's from_dict")

    monkeypatch.setattr(FISMOState, "from_dict", classmethod(refuse))
    with pytest.raises(ValueError, match=r"parameter 0 of param group 0 .*: refused by the core's from_dict"):
        opt.load_state_dict(saved)


# ------------------------------------------------------------------ hyperparameter defaults
def _core_default(name: str):
    field = {f.name: f for f in dataclasses.fields(FISMO)}[name]
    return field.default_factory() if field.default is dataclasses.MISSING else field.default


CORE_FIELDS = {f.name for f in dataclasses.fields(FISMO)}


def test_optax_defaults_are_the_cores() -> None:
    _optax()
    from fismo_core.backends.optax import fismo, scale_by_fismo

    expected = {
        fismo: {"beta", "gamma", "mu", "polar", "inv_root", "weight_decay", "nesterov", "statistics", "block_size"},
        scale_by_fismo: {"beta", "gamma", "mu", "polar", "inv_root", "nesterov", "statistics", "block_size"},
    }
    for function, names in expected.items():
        parameters = inspect.signature(function).parameters
        assert CORE_FIELDS & set(parameters) == names
        for name in names - {"polar", "inv_root"}:
            assert parameters[name].default == _core_default(name), (function.__name__, name)
        # None, as in the torch adapter (and not a config, which optax.inject_hyperparams would call as a
        # schedule): the core's default, bit for bit
        assert parameters["polar"].default is None and parameters["inv_root"].default is None
    import jax.numpy as jnp

    params = {"w": jnp.ones((4, 3))}
    grads = {"w": jnp.arange(12.0).reshape(4, 3) / 12}
    explicit = {"polar": _core_default("polar"), "inv_root": _core_default("inv_root")}
    for build in (lambda **kw: scale_by_fismo(**kw), lambda **kw: fismo(0.02, **kw)):
        given, default = build(**explicit), build()
        ups = [tx.update(grads, tx.init(params), params)[0]["w"] for tx in (given, default)]
        assert bool(jnp.array_equal(*ups)) and bool(jnp.any(ups[0] != 0))


def test_torch_defaults_are_the_cores() -> None:
    """Same defaults; ``polar`` and ``inv_root`` default to ``None``, which the optimizer resolves to the core's."""
    torch = _torch()
    from fismo_core.backends.torch import FISMO as TorchFISMO

    parameters = inspect.signature(TorchFISMO).parameters
    shared = CORE_FIELDS & set(parameters)
    assert shared == CORE_FIELDS
    for name in shared - {"polar", "inv_root"}:
        assert parameters[name].default == _core_default(name), name
    defaults = TorchFISMO([torch.nn.Parameter(torch.ones(SHAPE))]).defaults
    for name in ("polar", "inv_root"):
        assert parameters[name].default is None and defaults[name] == dataclasses.asdict(_core_default(name))


# ------------------------------------------------------------------ the integer check
SITES = {
    "steps": lambda v: fismo_core.linalg.newton_schulz_schedule("muon", v),
    "polar steps": lambda v: FISMO(polar={"steps": v}),
    "inverse-root steps": lambda v: InverseRootConfig(method="newton_schulz", steps=v),
    "inverse-root every": lambda v: InverseRootConfig(every=v),
    "block_size": lambda v: FISMO(block_size=v),
    "verify steps": lambda v: fismo_core.verify.verify(steps=v),
}


@pytest.mark.parametrize("value", [0, -2, True, 2.5, "3"])
@pytest.mark.parametrize("site", list(SITES))
def test_every_count_is_refused_alike(site: str, value) -> None:
    """Each count or size refuses the same values with the same sentence, naming itself."""
    with pytest.raises(ValueError, match=r"must be (None \(.*\) or )?a positive integer, got " + repr(value)) as error:
        SITES[site](value)
    assert str(error.value).split(" must be ")[0].endswith(site.split()[-1])


def test_every_count_goes_through_one_check(monkeypatch: pytest.MonkeyPatch) -> None:
    checked = []
    original = fismo_core.linalg._check_integer

    def spy(name, value, **kwargs):
        checked.append(name)
        return original(name, value, **kwargs)

    monkeypatch.setattr(fismo_core.linalg, "_check_integer", spy)
    inv_root = {"method": "newton_schulz", "steps": 6, "every": 2, "max_failures": 1}
    FISMO(block_size=4, polar={"steps": 3}, inv_root=inv_root)
    names = {"block_size", "steps", "inverse-root steps", "inverse-root every", "inverse-root max_failures"}
    assert names <= set(checked)


# ------------------------------------------------------------------ the contract of the factor structures
def _protocol_members() -> dict[str, object]:
    return {
        name: value for name, value in vars(KroneckerFactor).items()
        if not name.startswith("_") and callable(value)
    }


@pytest.mark.parametrize("structure", [FullFactor(5), BlockDiagonalFactor(7, 3)], ids=repr)
def test_structures_satisfy_the_factor_protocol(structure) -> None:
    """Both structures are ``KroneckerFactor``s: every member exists, with the protocol's parameters."""
    assert isinstance(structure, KroneckerFactor)
    assert isinstance(structure.d, int)
    members = _protocol_members()
    assert {"identity", "update", "inverse_sqrt", "left", "right", "parts", "from_parts", "part_shapes"} <= set(members)
    for name, member in members.items():
        want = [(p.name, p.kind) for p in inspect.signature(member).parameters.values()]
        got = [(p.name, p.kind) for p in inspect.signature(getattr(type(structure), name)).parameters.values()]
        assert got == want, name


def test_protocol_is_the_structure_type() -> None:
    """The hints name the protocol, and an object missing a member is not a structure."""
    assert Structure is KroneckerFactor
    assert typing.get_type_hints(factor_structure)["return"] is KroneckerFactor
    assert all(isinstance(factor_structure(8, b), KroneckerFactor) for b in (3, None))

    class NoRight(FullFactor):
        right = None  # type: ignore[assignment]

    assert not isinstance(NoRight(3), KroneckerFactor)
