"""JAX: ``jax.jit`` of the core step, and the optax adapter ``fismo_core.backends.optax``.

The JAX targets come from :func:`fismo_core.testing.targets` (which switches
on x64 process-wide, so the float64 target really is float64). Reference
trajectories use the seeded, anisotropic gradients of
:func:`fismo_core.testing.reference_gradients`, so ``P`` and ``Q`` move well
away from the identity and every line of Algorithm 1 matters.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import numpy as np
import pytest

from fismo_core import FISMO, FISMOState
from fismo_core.testing import max_relative_error, reference_gradients, targets

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")

JAX_TARGETS = {t.dtype: t for t in targets() if t.backend == "jax"}
STATE_FIELDS = ("P", "Q", "M", "P_inv_sqrt", "Q_inv_sqrt")
STEPS = 20
#: One matrix shape for (nearly) every trajectory: eager JAX compiles each
#: primitive once per shape and dtype, so sharing the shape keeps the file fast.
SHAPE = (8, 12)

#: jit against eager JAX, worst relative Frobenius error over 20 steps of
#: every array of the step. jit compiles the same operations into one XLA
#: program, and fusion may reorder sums and use FMAs: a rounding-level
#: difference. Measured worst cases over shapes (8, 12), (3, 8, 12), (16, 8), (6, 10),
#: two seeds and the configurations below: 1.5e-14 in float64 and 8.7e-6 in float32
#: (float32 rounding, 6e-8, amplified by eigh and Newton–Schulz along the
#: trajectory). float64: 1e-12 leaves a factor of 70. float32: 1e-4 (the
#: project's float32 bar in fismo_core.testing.TOLERANCES) leaves a factor of
#: 11. A wrong formula, a dropped state update or a stale cached root is an
#: error of order 1e-2 or more and fails either bar.
JIT_TOLERANCE = {"float64": 1e-12, "float32": 1e-4}


def _jax_target(dtype: str):
    target = JAX_TARGETS[dtype]
    if not target.available:
        pytest.skip(target.reason)
    return target


def _optax():
    return pytest.importorskip("optax", reason="optax is not installed (pip install optax)")


def _trajectory(shape, dtype, seed=1):
    grads = [jnp.asarray(g, dtype=dtype) for g in reference_gradients(shape, STEPS, seed=seed)]
    W0 = jnp.asarray(np.random.default_rng(seed + 100).standard_normal(shape), dtype=dtype)
    return W0, grads


# ------------------------------------------------------------- core + jax.jit
JIT_CASES = [
    pytest.param("float64", FISMO(), id="float64-default"),
    pytest.param("float32", FISMO(), id="float32-default"),
    pytest.param("float64", FISMO(polar="svd", nesterov=True, weight_decay=0.1), id="float64-svd-nesterov-wd"),
    pytest.param("float64", FISMO(inv_root="newton_schulz"), id="float64-matmul-only"),
]
# (gamma = 0.5 is left out on purpose: with these strongly anisotropic
# gradients it drives P and Q to condition numbers where the trajectory
# itself amplifies rounding, and jit-vs-eager then measured 3e-11 to 4e-10 in
# float64 and up to 1e-1 in float32: a property of the algorithm at that
# setting, not of jit.)


@pytest.mark.parametrize("dtype, opt", JIT_CASES)
def test_jit_step_matches_eager_and_traces_once(dtype: str, opt: FISMO) -> None:
    """``jax.jit(opt.step)`` equals the eager step over 20 steps, and is traced exactly once."""
    _jax_target(dtype)
    W0, grads = _trajectory(SHAPE, dtype)
    traces = []

    def step(W, G, state):
        traces.append(1)  # Python runs only while JAX traces
        return opt.step(W, G, state)

    jitted = jax.jit(step)
    W_e = W_j = W0
    s_e = s_j = opt.init(W0)
    for t, G in enumerate(grads, 1):
        W_e, s_e = opt.step(W_e, G, s_e)
        W_j, s_j = jitted(W_j, G, s_j)
        assert W_j.dtype == jnp.dtype(dtype) and s_j.P.dtype == jnp.dtype(dtype)
        assert int(s_j.step) == t
        errors = [max_relative_error(W_j - W0, W_e - W0)]
        errors += [max_relative_error(getattr(s_j, f), getattr(s_e, f)) for f in STATE_FIELDS]
        assert max(errors) <= JIT_TOLERANCE[dtype], (t, errors)
    # One trace for 20 steps. The first call passes the Python int 0 as the
    # step count, later calls the weakly typed integer array the jitted step
    # returned: both abstract to the same weak int scalar, so JAX reuses the
    # trace. A step count or hyperparameter that became static (or a Python
    # branch on a value) would retrace every step.
    assert len(traces) == 1


def test_an_uncommitted_parameter_gets_an_uncommitted_state_and_one_compilation() -> None:
    """``init`` created the state committed to the parameter's device; beside uncommitted parameters
    (what ``jnp.asarray`` gives) that made a jitted step's outputs committed, and its second call
    compiled again (same trace, another executable). The step count is given as an array here: a
    Python int at the first call is another argument kind, compiled once more under x64."""
    _jax_target("float64")
    opt = FISMO()
    W0, grads = _trajectory(SHAPE, "float64")
    state = opt.init(W0)
    assert not W0.committed and not any(x.committed for x in jax.tree.leaves(state) if isinstance(x, jax.Array))
    jitted = jax.jit(opt.step)
    W, state = W0, state._replace(step=jnp.asarray(0))
    for G in grads[:4]:
        W, state = jitted(W, G, state)
    assert jitted._cache_size() == 1  # private API of jax.jit's functions: the compiled executables


@pytest.mark.parametrize("transformation", ["fismo", "scale_by_fismo"])
def test_optax_params_committed_to_a_device_compile_once(transformation: str) -> None:
    """Params committed to a device (``jax.device_put``): the state's int32 step counts (FISMO's, line 9's
    and AdamW's) were made uncommitted on the default device, the first jitted step's outputs came back
    committed, and the second step compiled again. They are now committed beside the params."""
    optax = _optax()
    from fismo_core.backends.optax import fismo, scale_by_fismo

    _jax_target("float32")
    device = jax.devices()[-1]
    params = jax.device_put({"w": jnp.ones(SHAPE, jnp.float32) + jnp.eye(*SHAPE), "b": jnp.zeros(3)}, device)
    tx = fismo(0.02) if transformation == "fismo" else scale_by_fismo()
    if transformation == "scale_by_fismo":
        params = {"w": params["w"]}
    state = tx.init(params)
    assert all(x.committed for x in jax.tree.leaves(state) if isinstance(x, jax.Array))

    @jax.jit
    def step(p, s, g):
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    p = params
    for i in range(3):
        p, state = step(p, state, jax.tree.map(lambda x: 0.01 * x + i, p))
    assert step._cache_size() == 1  # private API of jax.jit's functions: the compiled executables


def test_grad_through_steps_with_newton_schulz_roots() -> None:
    """What backends.md says of differentiating through a step: with Newton–Schulz roots ``jax.grad`` of
    a loss after two steps (the gradients depend on ``W``) is finite and matches central differences
    (float64, step 1e-5: truncation ~1e-10, measured agreement 1e-9 relative; bound 1e-6)."""
    _jax_target("float64")
    rng = np.random.default_rng(0)
    W0 = jnp.asarray(rng.standard_normal(SHAPE))
    shift = jnp.asarray(rng.standard_normal(SHAPE) * np.linspace(0.1, 3, SHAPE[1]))
    opt = FISMO(inv_root="newton_schulz")

    def loss_after_two_steps(W):
        s = opt.init(W)
        for _ in range(2):
            W, s = opt.step(W, jnp.tanh(W) + shift, s)
        return jnp.sum(W ** 2)

    grad = jax.jit(jax.grad(loss_after_two_steps))(W0)
    assert bool(jnp.all(jnp.isfinite(grad)))
    loss = jax.jit(loss_after_two_steps)
    for i, j in [(1, 2), (7, 11), (0, 0)]:
        e = jnp.zeros(SHAPE).at[i, j].set(1e-5)
        central = (loss(W0 + e) - loss(W0 - e)) / 2e-5
        assert abs(float(grad[i, j]) - float(central)) <= 1e-6 * max(1.0, abs(float(central))), (i, j)


def test_a_traced_gradient_meets_a_concrete_state() -> None:
    """Under ``jax.jit`` with the state closed over (concrete) and the gradient traced, and under an
    eager ``jax.vmap`` with a shared state, the device check compared a tracer's device (None) with
    the state's and raised "all arrays of one call must live on one device"."""
    _jax_target("float64")
    opt = FISMO()
    W = jnp.asarray(np.random.default_rng(0).standard_normal((4, 3)))
    G = jnp.asarray(np.random.default_rng(1).standard_normal((4, 3)))
    state = opt.init(W)
    expected = opt.step(W, G, state)[0]
    got = jax.jit(lambda G: opt.step(W, G, state)[0])(G)
    assert max_relative_error(got, expected) <= JIT_TOLERANCE["float64"]
    batched = jax.vmap(lambda G: opt.direction(G, state)[0])(jnp.stack([G, 2 * G]))
    assert max_relative_error(batched[0], opt.direction(G, state)[0]) <= JIT_TOLERANCE["float64"]


def test_jit_traces_once_per_shape() -> None:
    """A new shape traces again (the counter really counts); the same one does not."""
    _jax_target("float32")
    opt = FISMO(gamma=1.0)  # the cheapest step to compile; tracing does not depend on it
    traces = []

    def step(W, G, state):
        traces.append((W.shape, W.dtype))
        return opt.step(W, G, state)

    jitted = jax.jit(step)
    for shape in [(4, 6), (4, 6), (5, 6)]:
        W = jnp.ones(shape, dtype="float32")
        state = opt.init(W)
        for _ in range(2):
            W, state = jitted(W, W, state)
    assert len(traces) == 2, traces


def test_jit_direction_and_linalg() -> None:
    """``direction`` and the matrix functions jit as well (no value-dependent Python control flow)."""
    _jax_target("float64")
    from fismo_core import linalg

    W0, grads = _trajectory(SHAPE, "float64")
    opt = FISMO()
    state = opt.init(W0)
    d_e, s_e = opt.direction(grads[0], state)
    d_j, s_j = jax.jit(opt.direction)(grads[0], state)
    # Same bar as above: one step of the same computation, jit vs eager.
    assert max_relative_error(d_j, d_e) <= JIT_TOLERANCE["float64"]

    def matrix_functions(X, P_is, Q_is):
        S = X @ jnp.swapaxes(X, -1, -2) + jnp.eye(X.shape[-2])
        return (
            linalg.polar(X),
            linalg.polar(X, method="svd"),
            linalg.inverse_sqrt(S),
            linalg.inverse_sqrt(S, method="newton_schulz"),
            linalg.whiten(X, P_is, Q_is),
        )

    args = (grads[1], s_e.P_inv_sqrt, s_e.Q_inv_sqrt)
    for got, want in zip(jax.jit(matrix_functions)(*args), matrix_functions(*args)):
        assert max_relative_error(got, want) <= JIT_TOLERANCE["float64"]


# ----------------------------------------------------------------- optax
def test_optax_adapter_is_a_gradient_transformation() -> None:
    optax = _optax()
    from fismo_core.backends.optax import fismo

    tx = fismo(0.02)
    assert isinstance(tx, optax.GradientTransformation)
    params = {"w": jnp.ones((4, 3)), "b": jnp.zeros(4)}
    state = tx.init(params)
    updates, state = tx.update(jax.tree.map(jnp.ones_like, params), state, params)
    assert jax.tree.structure(updates) == jax.tree.structure(params)
    assert all(u.shape == p.shape and u.dtype == p.dtype for u, p in zip(jax.tree.leaves(updates), jax.tree.leaves(params)))


#: optax against the core on the same gradients. Without weight decay and
#: without jit the two compute exactly the same floating-point operations
#: (the core's W - lr*dW; optax's W + (-lr)*dW, and negation is exact), so
#: they agree bit for bit: measured 0 in float64 and float32. With weight
#: decay optax computes W + (-lr)*(dW + wd W) where the core computes
#: (1 - lr wd) W - lr dW: the same number rounded differently; with jit,
#: XLA fusion. Measured worst case over 20 steps: 5.9e-15 (float64) and
#: 2.9e-6 (float32) for the relative error of W_t - W_0; the JIT_TOLERANCE
#: bars leave factors of 170 and 34.
OPTAX_CASES = [
    pytest.param("float64", 0.0, False, id="float64-eager"),
    pytest.param("float32", 0.0, False, id="float32-eager"),
    pytest.param("float64", 0.1, True, id="float64-jit-weight_decay"),
    pytest.param("float32", 0.1, True, id="float32-jit-weight_decay"),
]


@pytest.mark.parametrize("dtype, weight_decay, use_jit", OPTAX_CASES)
def test_optax_matches_core_trajectory(dtype: str, weight_decay: float, use_jit: bool) -> None:
    """Same gradients, same parameters: ``optax.apply_updates`` of the adapter's updates is the core's step."""
    optax = _optax()
    from fismo_core.backends.optax import fismo

    _jax_target(dtype)
    lr = 0.05
    opt = FISMO(lr=lr, weight_decay=weight_decay)
    tx = fismo(lr, weight_decay=weight_decay)
    W0, grads = _trajectory(SHAPE, dtype, seed=3)
    traces = []

    def update(g, s, p):
        traces.append(1)
        return tx.update(g, s, p)

    update = jax.jit(update) if use_jit else update
    W_core = W_tx = W0
    s_core, s_tx = opt.init(W0), tx.init(W0)
    for G in grads:
        W_core, s_core = opt.step(W_core, G, s_core)
        u, s_tx = update(G, s_tx, W_tx)
        assert u.dtype == W_tx.dtype
        W_tx = optax.apply_updates(W_tx, u)
        if weight_decay == 0.0 and not use_jit:
            assert bool(jnp.array_equal(W_tx, W_core))
        else:
            assert max_relative_error(W_tx - W0, W_core - W0) <= JIT_TOLERANCE[dtype]
    if use_jit:
        assert len(traces) == 1  # as for the core: the FISMOState step count does not retrace


def test_optax_takes_numpy_params_and_gradients() -> None:
    """NumPy params gave a state mixing NumPy and JAX arrays (and a Python int step count), and the next
    eager update with JAX gradients (or NumPy ones on a JAX state) raised "one array library". Now the
    state is all JAX arrays and the updates equal those of JAX inputs."""
    optax = _optax()
    from fismo_core.backends.optax import fismo

    _jax_target("float64")
    rng = np.random.default_rng(5)
    params = {"w": rng.standard_normal((5, 3)), "b": rng.standard_normal(3)}
    grads = {"w": rng.standard_normal((5, 3)), "b": rng.standard_normal(3)}
    tx = fismo(0.02)
    state = tx.init(params)
    assert all(isinstance(x, jax.Array) for x in jax.tree.leaves(state))
    from_numpy, _ = tx.update(grads, state, params)
    jax_params, jax_grads = jax.tree.map(jnp.asarray, params), jax.tree.map(jnp.asarray, grads)
    from_jax, _ = tx.update(jax_grads, tx.init(jax_params), jax_params)
    assert all(bool(jnp.array_equal(a, b)) for a, b in zip(jax.tree.leaves(from_numpy), jax.tree.leaves(from_jax)))
    optax.apply_updates(jax_params, from_numpy)


def test_optax_pytree_with_jit() -> None:
    """A dict of a matrix, a 3-D tensor and a bias: FISMO on the first two (the 3-D one as
    ``(shape[0], -1)``), AdamW with the same learning rate on the bias; one trace for all steps."""
    optax = _optax()
    from fismo_core.backends.optax import fismo

    _jax_target("float64")
    lr, steps = 0.03, 8
    shapes = {"dense": SHAPE, "conv": (SHAPE[0], 3, SHAPE[1] // 3), "bias": (SHAPE[0],)}
    rng = np.random.default_rng(7)
    params0 = {k: jnp.asarray(rng.standard_normal(shape)) for k, shape in shapes.items()}
    dense_g = reference_gradients(SHAPE, steps, seed=10)
    conv_g = reference_gradients(SHAPE, steps, seed=11)
    grads = [
        {"dense": jnp.asarray(d), "conv": jnp.asarray(c.reshape(shapes["conv"])), "bias": jnp.asarray(rng.standard_normal(SHAPE[0]))}
        for d, c in zip(dense_g, conv_g)
    ]
    tx = fismo(lr)
    traces = []

    @jax.jit
    def train_step(params, state, g):
        traces.append(1)
        updates, state = tx.update(g, state, params)
        return optax.apply_updates(params, updates), state

    params, state = params0, tx.init(params0)
    for g in grads:
        params, state = train_step(params, state, g)
    assert len(traces) == 1
    assert train_step._cache_size() == 1  # one compilation too (it compiled twice: a committed state)
    assert {k: v.shape for k, v in params.items()} == shapes

    # The references, eager: the core on each matrix (the 3-D tensor
    # flattened to (shape[0], -1)), optax.adamw(lr, weight_decay=0) on the bias.
    core = FISMO(lr=lr)
    for name in ("dense", "conv"):
        W0 = jnp.reshape(params0[name], SHAPE)
        W, s = W0, core.init(W0)
        for g in grads:
            W, s = core.step(W, jnp.reshape(g[name], SHAPE), s)
        # Tolerance: JIT_TOLERANCE (jit of the whole train step against the eager core).
        assert max_relative_error(jnp.reshape(params[name], SHAPE) - W0, W - W0) <= JIT_TOLERANCE["float64"], name
    adamw = optax.adamw(lr, weight_decay=0.0)
    b, s = params0["bias"], adamw.init(params0["bias"])
    for g in grads:
        u, s = adamw.update(g["bias"], s, b)
        b = optax.apply_updates(b, u)
    # The same AdamW arithmetic, jit against eager: rounding only (measured
    # 0); 1e-12 on entries of size about lr * steps = 0.24.
    assert float(jnp.max(jnp.abs(params["bias"] - b))) <= 1e-12


def test_optax_learning_rate_schedule() -> None:
    """A schedule ``lr(count)`` scales the t-th update (count 0 first), as in every optax optimizer."""
    optax = _optax()
    from fismo_core.backends.optax import fismo

    _jax_target("float64")
    # Piecewise constant with exact values, so that jit and eager evaluate
    # the same learning rate (optax's linear_schedule computes in float32 from
    # its int32 count, and XLA may round that differently inside jit). A count
    # off by one would apply 0.02 at step 6 or 0.1 at step 7 and fail.
    schedule = lambda count: jnp.where(count < 7, 0.1, 0.02)  # noqa: E731
    tx = fismo(schedule)
    core = FISMO()  # only its direction is used
    W0, grads = _trajectory(SHAPE, "float64", seed=5)
    W_ref = W_tx = W_const = W0
    s_core, s_tx = core.init(W0), tx.init(W0)
    update = jax.jit(tx.update)
    for t, G in enumerate(grads):
        d, s_core = core.direction(G, s_core)
        W_ref = W_ref - (0.1 if t < 7 else 0.02) * d
        W_const = W_const - 0.1 * d
        u, s_tx = update(G, s_tx, W_tx)
        W_tx = optax.apply_updates(W_tx, u)
        # Tolerance: JIT_TOLERANCE (jit against eager; same arithmetic).
        assert max_relative_error(W_tx - W0, W_ref - W0) <= JIT_TOLERANCE["float64"], t
    # The schedule mattered: the constant learning rate 0.1 ends far away.
    assert max_relative_error(W_tx - W0, W_const - W0) > 0.1


def test_optax_non_matrix_rules() -> None:
    optax = _optax()
    from fismo_core.backends.optax import fismo

    _jax_target("float32")
    params = {"w": jnp.ones(SHAPE, jnp.float32), "emb": jnp.ones((7, 3), jnp.float32), "bias": jnp.zeros(4, jnp.float32)}
    g = {k: jnp.full(v.shape, 0.5, v.dtype) for k, v in params.items()}
    g["w"] = jnp.asarray(reference_gradients(SHAPE, 1, seed=13)[0], jnp.float32)

    # "error": refused at init, naming the leaf.
    with pytest.raises(ValueError, match=r"\['bias'\].*shape \(4,\)"):
        fismo(0.02, non_matrix="error").init(params)
    # ... and accepted when every leaf is a matrix.
    matrices = {k: v for k, v in params.items() if v.ndim >= 2}
    fismo(0.02, non_matrix="error").init(matrices)

    # A given transformation runs on the non-matrix leaves only.
    updates, _ = fismo(0.02, non_matrix=optax.sgd(0.1)).update(g, fismo(0.02, non_matrix=optax.sgd(0.1)).init(params), params)
    assert bool(jnp.array_equal(updates["bias"], -0.1 * g["bias"]))

    # matrix_mask=False sends a matrix (an embedding) to non_matrix.
    mask = {"w": True, "emb": False, "bias": False}
    tx = fismo(0.02, non_matrix=optax.sgd(0.1), matrix_mask=mask)
    state = tx.init(params)
    updates, _ = tx.update(g, state, params)
    assert bool(jnp.array_equal(updates["emb"], -0.1 * g["emb"]))
    direction, _ = FISMO().direction(g["w"], FISMO().init(params["w"]))
    assert bool(jnp.array_equal(updates["w"], -0.02 * direction))
    # A callable mask works the same way.
    tx = fismo(0.02, non_matrix=optax.sgd(0.1), matrix_mask=lambda p: {k: k == "w" for k in p})
    updates, _ = tx.update(g, tx.init(params), params)
    assert bool(jnp.array_equal(updates["emb"], -0.1 * g["emb"]))

    with pytest.raises(ValueError, match="fewer than 2 dimensions.*bias"):
        fismo(0.02, matrix_mask={"w": True, "emb": True, "bias": True}).init(params)
    with pytest.raises(ValueError, match="non_matrix must be"):
        fismo(0.02, non_matrix="sgd")
    with pytest.raises(TypeError, match="non_matrix must be"):
        fismo(0.02, non_matrix=0.1)


def test_optax_empty_leaves_go_to_non_matrix_and_the_no_params_error_names_the_factory() -> None:
    """An empty 2-D leaf (a LoRA adapter of rank 0) went to FISMO by default and ``init`` refused it; and
    ``fismo_training``'s update without params said ``fismo(weight_decay=...)``, a function and keyword the
    user had not called (its weight decay is 0.1 by default) (a user's hunt, 2026-12-02)."""
    optax = _optax()
    from fismo_core.backends.optax import fismo, fismo_training

    params = {"w": jnp.ones((4, 3), jnp.float32), "lora": jnp.ones((0, 3), jnp.float32)}
    grads = {k: jnp.full(v.shape, 0.5, v.dtype) for k, v in params.items()}
    tx = fismo(0.02, non_matrix=optax.sgd(0.1))
    updates, _ = tx.update(grads, tx.init(params), params)
    assert updates["lora"].shape == (0, 3) and bool(jnp.all(jnp.isfinite(updates["w"])))
    with pytest.raises(ValueError, match=r"with no entries"):  # sent to FISMO by the mask: refused, as before
        fismo(0.02, matrix_mask={"w": True, "lora": True}).init(params)
    dense = {"w": params["w"]}
    for factory, decay in ((fismo_training(0.02), 0.1),
                           (fismo(0.02, weight_decay=0.01), 0.01)):
        name = "fismo_training" if decay == 0.1 else "fismo"
        with pytest.raises(ValueError, match=rf"^{name} with weight_decay={decay} needs the params"):
            factory.update({"w": grads["w"]}, factory.init(dense))


def test_optax_pytree_matrix_mask_inside_optax_masked() -> None:
    """Inside ``optax.masked`` the leaves it masks out are ``optax.MaskedNode``s (no leaves) where a pytree
    ``matrix_mask`` still holds a boolean: ``fismo`` raised a pytree structure error at init. The mask now
    leads, as in ``optax.masked``; the leaves left in get what they get without the outer mask, and the
    checks of the leaves still name them (``'layers'][1]`` through a tuple container)."""
    optax = _optax()
    from fismo_core.backends.optax import fismo

    _jax_target("float64")
    rng = np.random.default_rng(21)
    params = {"layers": (jnp.asarray(rng.standard_normal(SHAPE)), jnp.asarray(rng.standard_normal(4))),
              "head": jnp.asarray(rng.standard_normal((3, 5)))}
    g = jax.tree.map(lambda x: jnp.asarray(rng.standard_normal(x.shape)), params)
    matrix_mask = {"layers": (True, False), "head": True}

    def inner():
        return fismo(0.02, matrix_mask=matrix_mask, non_matrix=optax.sgd(0.1))

    outer = optax.masked(inner(), {"layers": (True, True), "head": False})
    got, _ = jax.jit(outer.update)(g, outer.init(params), params)
    alone = inner()
    want, _ = jax.jit(alone.update)(g, alone.init(params), params)
    assert bool(jnp.array_equal(got["layers"][0], want["layers"][0]))
    assert bool(jnp.array_equal(got["layers"][1], -0.1 * g["layers"][1]))
    assert bool(jnp.array_equal(got["head"], g["head"]))  # masked out: passed through
    with pytest.raises(ValueError, match=r"fewer than 2 dimensions for FISMO: \['layers'\]\[1\] \(shape \(4,\)\)"):
        optax.masked(fismo(0.02, matrix_mask={"layers": (True, True), "head": True}),
                     {"layers": (True, True), "head": False}).init(params)
    with pytest.raises(ValueError, match=r"non_matrix='error', but these leaves .*: \['layers'\]\[1\] \(shape"):
        optax.masked(fismo(0.02, matrix_mask=matrix_mask, non_matrix="error"),
                     {"layers": (True, True), "head": False}).init(params)


def test_optax_bad_matrix_shape_is_refused_when_built_or_named_at_init() -> None:
    """``matrix_shape=5`` (or a tuple) was accepted and raised ``'int' object is not callable`` at ``init``; a
    function returning floats, negative sizes or ``None`` raised JAX's or Python's own errors, and no error
    named the leaf (a user's hunt, 2026-12-02). Refused when built, and at init naming the leaf."""
    from fismo_core.backends.optax import fismo, fismo_training, scale_by_fismo

    _jax_target("float64")
    params = {"enc": {"conv": jnp.ones((2, 3, 4, 5))}, "w": jnp.ones((3, 4))}
    for build in (lambda: fismo(0.02, matrix_shape=5), lambda: fismo_training(0.02, matrix_shape=5),
                  lambda: scale_by_fismo(matrix_shape=(6, 20))):
        with pytest.raises(TypeError, match=r"matrix_shape must be None or a function of a leaf's shape"):
            build()
    for returned in [(2, 3), (6.0, 20.0), (-6, -20), (0, 120), None, (6, 20, 1)]:
        tx = fismo(0.02, matrix_shape=lambda shape, r=returned: r)
        with pytest.raises(ValueError, match=r"^leaf \['enc'\]\['conv'\] \(shape \(2, 3, 4, 5\)\): matrix_shape"):
            tx.init(params)


def test_optax_matrix_mask_that_is_a_prefix_of_the_params() -> None:
    """A mask with one boolean over a subtree (a prefix of the params, as ``optax.masked`` takes): ``True``
    over a subtree of matrices was refused as "a leaf of shape ()" naming the subtree (``False`` worked; a
    user's hunt, 2026-12-02). Each leaf under it is labelled; the updates equal the full mask's bit for bit,
    and a vector under a ``True`` subtree is refused by its own path."""
    optax = _optax()
    from fismo_core.backends.optax import fismo

    _jax_target("float64")
    rng = np.random.default_rng(22)
    params = {"enc": {"w": jnp.asarray(rng.standard_normal((4, 3))), "b": jnp.asarray(rng.standard_normal(3))},
              "dec": {"w": jnp.asarray(rng.standard_normal((3, 4))), "v": jnp.asarray(rng.standard_normal((5, 4)))}}
    g = jax.tree.map(lambda x: jnp.asarray(rng.standard_normal(x.shape)), params)
    prefix = {"enc": {"w": True, "b": False}, "dec": True}
    full = {"enc": {"w": True, "b": False}, "dec": {"w": True, "v": True}}
    got, want = (jax.jit(tx.update)(g, tx.init(params), params)[0]
                 for tx in (fismo(0.02, matrix_mask=mask, non_matrix=optax.sgd(0.1)) for mask in (prefix, full)))
    assert all(bool(jnp.array_equal(a, b)) for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)))
    assert not bool(jnp.array_equal(got["dec"]["v"], -0.1 * g["dec"]["v"]))  # FISMO's, not non_matrix's
    with pytest.raises(ValueError, match=r"fewer than 2 dimensions for FISMO: \['enc'\]\['b'\] \(shape \(3,\)\)"):
        fismo(0.02, matrix_mask={"enc": True, "dec": False}).init(params)


@pytest.mark.parametrize("config", ["fismo", "newton_schulz roots", "blocks", "fismo_training"])
def test_tracing_never_asks_a_tracer_what_it_cannot_say(config: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A traced array asked for its device, or for its value (``bool``), raises an error whose message
    walks the whole trace built so far (``_origin_msg``); the core and the adapter asked about 20 times
    per matrix and discarded the answer, so tracing a step took time quadratic in its number of
    matrices (24 leaves of 32 x 32: 7.0 s, 6.4 s of them in 481 such messages; now 0.47 s and none).
    Counted through JAX's private ``DynamicJaxprTracer._origin_msg`` (there is no public counter)."""
    optax = _optax()
    from jax._src.interpreters import partial_eval
    from fismo_core.backends.optax import fismo, fismo_training

    _jax_target("float32")
    asked = []
    origin_msg = partial_eval.DynamicJaxprTracer._origin_msg
    monkeypatch.setattr(partial_eval.DynamicJaxprTracer, "_origin_msg",
                        lambda self, *a, **k: asked.append(1) or origin_msg(self, *a, **k))
    tx = {"fismo": lambda: fismo(0.02), "newton_schulz roots": lambda: fismo(0.02, inv_root="newton_schulz"),
          "blocks": lambda: fismo(0.02, block_size=8), "fismo_training": lambda: fismo_training(0.02)}[config]()
    params = {f"w{i}": jnp.ones((12, 16), jnp.float32) + i * jnp.eye(12, 16, dtype=jnp.float32) for i in range(3)}
    params["bias"] = jnp.zeros(4, jnp.float32)

    def step(p, s, g):
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    jax.make_jaxpr(step)(params, tx.init(params), params)
    assert asked == []


def test_without_x64_a_failed_root_says_it_was_not_retried_in_float64() -> None:
    """JAX's default (x64 off) has no float64: the retry's ``astype(float64)`` leaked JAX's "Explicitly
    requested dtype float64" warning, and the InverseRootWarning then said the root failed "also with eigh
    in float64", a retry that never ran. Run in a fresh process, since the test session turns x64 on."""
    import subprocess
    import sys

    code = (
        "import warnings, jax, jax.numpy as jnp\n"
        "from fismo_core.backends.optax import fismo\n"
        "params = {'w': jnp.ones((4, 3))}\n"
        "tx = fismo(0.02)\n"
        "state = jax.tree.map(jnp.zeros_like, tx.init(params))  # P = Q = 0: no root exists\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        "    tx.update({'w': jnp.ones((4, 3))}, state, params)\n"
        "for w in caught: print(type(w.message).__name__, '|', w.message)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120,
                         env={**__import__("os").environ, "JAX_ENABLE_X64": "0"}).stdout.splitlines()
    assert [line.split(" | ")[0] for line in out] == ["InverseRootWarning", "InverseRootWarning"], out
    assert all("not retried in float64, unavailable here" in line for line in out), out


def test_without_x64_a_float64_iteration_dtype_is_refused() -> None:
    """``polar(dtype="float64")``, ``PolarConfig(dtype="float64")`` and the roots' ``matmul_dtype="float64"``
    ran in float32 with JAX's x64 off, with JAX's "Explicitly requested dtype" warning at every cast (13 per
    step) and no word from FISMO (a user's hunt, 2026-12-03), where NumPy's missing bfloat16 is a clear
    ValueError. Refused now, saying how to turn x64 on. A fresh process: the test session turns x64 on."""
    import subprocess
    import sys

    code = (
        "import warnings, jax.numpy as jnp\n"
        "from fismo_core import FISMO, InverseRootConfig, PolarConfig, linalg\n"
        "X = jnp.ones((4, 3)) + jnp.eye(4, 3)\n"
        "calls = [lambda: linalg.polar(X, dtype='float64'), lambda: linalg.polar(X, dtype=jnp.float64),\n"
        "         lambda: FISMO(polar=PolarConfig(dtype='float64')).step(X, X, FISMO().init(X)),\n"
        "         lambda: FISMO(inv_root=InverseRootConfig(method='newton_schulz', matmul_dtype='float64'))\n"
        "             .step(X, X, FISMO().init(X))]\n"
        "for call in calls:\n"
        "    with warnings.catch_warnings(record=True) as caught:\n"
        "        warnings.simplefilter('always')\n"
        "        try:\n"
        "            call(); print('ran |', len(caught))\n"
        "        except ValueError as exc:\n"
        "            print('ValueError |', exc, '|', len(caught))\n"
        "print('float32 |', linalg.polar(X, dtype='float32').dtype)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120,
                         env={**__import__("os").environ, "JAX_ENABLE_X64": "0"}).stdout.splitlines()
    assert len(out) == 5, out
    for line in out[:4]:
        kind, message, warned = line.split(" | ")
        assert kind == "ValueError" and "JAX runs with 64-bit types off" in message, line
        assert "jax.config.update('jax_enable_x64', True)" in message and warned == "0", line
    assert out[4] == "float32 | float32"


def test_optax_resumes_from_numpy_states_and_takes_python_scalar_leaves() -> None:
    """Found by a user's hunt, each failed eagerly where ``optax.adamw`` works: a state restored as NumPy
    (``jax.device_get``, ``np.load``, pickle) mixed namespaces in the core; a Python float among the
    params (a temperature) had no ``ndim``. A state cast to bfloat16 (``optax.tree.cast``) ran the whole
    step in bfloat16, 5 to 7 % off, without a word: refused now, as ``FISMO.step`` refused it. And a
    gradient that does not fit its state is named by its leaf."""
    optax = _optax()
    from fismo_core.backends.optax import fismo

    _jax_target("float32")
    rng = np.random.default_rng(3)
    params = {"w": jnp.asarray(rng.standard_normal(SHAPE), jnp.float32), "temperature": 1.0}
    grads = {"w": jnp.asarray(rng.standard_normal(SHAPE), jnp.float32), "temperature": 0.5}
    tx = fismo(0.02)
    state = tx.init(params)
    want, _ = tx.update(grads, state, params)
    got, _ = tx.update(grads, jax.device_get(state), params)
    assert bool(jnp.array_equal(got["w"], want["w"])) and float(got["temperature"]) == float(want["temperature"])
    with pytest.raises(TypeError, match=r"leaf \['w'\].*got \['bfloat16'\]: was the state cast\?"):
        tx.update(grads, optax.tree.cast(state, jnp.bfloat16), params)
    with pytest.raises(ValueError, match=r"^leaf \['w'\] \(gradient of shape \(12, 8\)\): state does not match"):
        tx.update({**grads, "w": grads["w"].T}, state, params)
    with pytest.raises(TypeError, match=r"got int32; fismo\(\.\.\., matrix_mask=\.\.\.\) sends such a leaf"):
        tx.init({"w": jnp.zeros((4, 4), jnp.int32)})


def test_optax_refuses_a_float64_leafs_state_cast_to_float32_when_given_the_params() -> None:
    """A float64 parameter's state cast to float32 (``optax.tree.cast``, to save memory, or a float32 run's
    checkpoint) ran every step in float32 without a word (5.9e-7 from the float64 run after a few steps; a
    user's hunt, 2026-12-02): refused with the params, as ``FISMO.step`` refuses it. A float32 gradient of
    a float64 parameter stays the core's G: the gradient's dtype does not decide, and without the params
    the statistics cannot be checked (``scale_by_fismo`` alone); the cast counters are refused then."""
    optax = _optax()
    from fismo_core.backends.optax import fismo, scale_by_fismo

    _jax_target("float64")
    rng = np.random.default_rng(5)
    params = {"w": jnp.asarray(rng.standard_normal(SHAPE), jnp.float64), "b": jnp.zeros(SHAPE[1], jnp.float64)}
    for tx, leaves in ((fismo(0.02), ("w", "b")), (scale_by_fismo(), ("w",))):  # scale_by_fismo: matrices only
        mine = {k: params[k] for k in leaves}
        grads = jax.tree.map(lambda p: (p * 0.5 + 1.0).astype(jnp.float32), mine)
        state = tx.init(mine)
        tx.update(grads, state, mine)  # float32 gradients, float64 state: the core's G
        with pytest.raises(TypeError, match=r"^leaf \['w'\] \(gradient of shape \(8, 12\)\): state dtype float32 "
                                            r"does not match W of dtype float64: FISMO.init\(W\) would give float64"):
            tx.update(grads, optax.tree.cast(state, jnp.float32), mine)
    # No params: nothing to check the statistics against, but tree.cast casts the integer counters too, which
    # step refuses as from_dict does (a float count cannot be saved and loaded; since 2026-12-02).
    with pytest.raises(TypeError, match=r"state.skipped must be an integer count .* got float32: was the state cast"):
        tx.update(grads, optax.tree.cast(state, jnp.float32))


def test_optax_matrix_shape_for_flax_kernels() -> None:
    """``matrix_shape`` chooses the matrix of a >2-D leaf, e.g. Flax's HWIO conv kernels as (kh*kw*in, out)."""
    optax = _optax()
    from fismo_core.backends.optax import default_matrix_shape, fismo

    _jax_target("float64")
    assert default_matrix_shape((8, 3, 3, 2)) == (8, 18)
    hwio_shape = (2, 2, 2, 12)  # (kh, kw, in, out): the matrix is (8, 12) = SHAPE
    kernel = jnp.asarray(np.random.default_rng(8).standard_normal(hwio_shape))
    G = jnp.asarray(reference_gradients(SHAPE, 1, seed=9)[0]).reshape(hwio_shape)
    hwio = lambda s: (math.prod(s[:-1]), s[-1])  # noqa: E731
    tx = fismo(0.02, matrix_shape=hwio)
    state = tx.init(kernel)
    updates, state = tx.update(G, state, kernel)
    fismo_state = state.inner_states["fismo"].inner_state[0].states
    assert fismo_state.P.shape == (8, 8) and fismo_state.Q.shape == (12, 12)
    direction, _ = FISMO().direction(G.reshape(SHAPE), FISMO().init(kernel.reshape(SHAPE)))
    assert bool(jnp.array_equal(updates, -0.02 * direction.reshape(hwio_shape)))
    # The default would have used (2, 24): a different matrix, a different update.
    default_updates, _ = fismo(0.02).update(G, fismo(0.02).init(kernel), kernel)
    assert not bool(jnp.allclose(default_updates, updates))
    with pytest.raises(ValueError, match="does not have 96 elements"):
        fismo(0.02, matrix_shape=lambda s: (5, 5)).init(kernel)
    with pytest.raises(ValueError, match=r"matrix_shape\(2, 2, 2, 12\) returned \(2, 12, 4\); it must return two positive integers"):
        fismo(0.02, matrix_shape=lambda s: (2, 12, 4)).init(kernel)  # was "too many values to unpack"
    assert isinstance(tx, optax.GradientTransformation)


def _check_optax_step_against_the_core(optax, core, learning_rate, W, G, s_core, u, s_tx):
    """One optax step from ``W`` against the core's from the same ``W`` and state; returns the core's state.

    The FISMO state is the core's bit for bit. In float32 and wider the new
    params are the core's ``FISMO.step`` bit for bit. In bfloat16 and float16
    the updates follow optax's convention (``optax.adamw``'s): they have the
    params' dtype, bit for bit ``optax.scale_by_learning_rate`` applied to the
    core's direction rounded to that dtype, and ``optax.apply_updates`` adds
    them in that dtype: two roundings, where the core's line 9 computes
    ``W - lr dW`` in float32 and rounds once (as torch's ``add_``). The two
    then differ by at most the rounding of the update (half its spacing)
    plus one spacing of the result.
    """
    d_core, s_next = core.direction(G, s_core)
    W_core, _ = core.step(W, G, s_core)
    W_tx = optax.apply_updates(W, u)
    inner = s_tx.inner_states["fismo"].inner_state[0].states
    for f in STATE_FIELDS:
        assert getattr(inner, f).dtype == getattr(s_next, f).dtype
        assert bool(jnp.array_equal(getattr(inner, f), getattr(s_next, f))), f
    assert u.dtype == W.dtype and W_tx.dtype == W.dtype
    if jnp.finfo(W.dtype).bits >= 32:
        assert bool(jnp.array_equal(W_tx, W_core))
        return s_next
    scaled, _ = optax.scale_by_learning_rate(float(learning_rate)).update(d_core.astype(W.dtype), optax.EmptyState())
    assert bool(jnp.array_equal(u, scaled))
    # np.spacing in float32 units: bfloat16 and float16 have 8 and 11 significant bits, float32 24.
    bound = 0.5 * np.abs(np.spacing(np.asarray(u))).astype(np.float32) + np.abs(
        np.spacing(np.asarray(W_core))).astype(np.float32)
    gap = np.abs(np.asarray(W_tx, dtype=np.float32) - np.asarray(W_core, dtype=np.float32))
    assert (gap <= bound).all(), float((gap - bound).max())
    return s_next


@pytest.mark.parametrize("lr", ["float", "np.float64", "np.float32", "jnp float32"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_optax_low_precision_params(dtype: str, lr: str) -> None:
    """bf16/fp16 params: updates and params keep their dtype, FISMO's statistics are float32 and
    the core's bit for bit, and the step is the core's (`_check_optax_step_against_the_core`: bit for
    bit in float32; in half precision within the rounding of optax's update, which has the params'
    dtype, since the core's line 9 rounds once as torch's ``add_`` does, 2026-12-04). Also with a
    learning rate that is a NumPy scalar or a JAX array (what ``optax.inject_hyperparams`` passes):
    not weakly typed as a Python float, it made float64 (or float32) updates of float32 (or bfloat16)
    params and parted from the core's step by a rounding (a user's hunt, 2026-12-02)."""
    optax = _optax()
    from fismo_core.backends.optax import fismo

    _jax_target("float64" if lr == "np.float64" else "float32")
    W0 = jnp.asarray(np.random.default_rng(11).standard_normal(SHAPE), dtype=dtype)
    grads = [jnp.asarray(g, dtype=dtype) for g in reference_gradients(SHAPE, 3, seed=12)]
    learning_rate = {"float": 0.02, "np.float64": np.float64(0.02), "np.float32": np.float32(0.02),
                     "jnp float32": jnp.asarray(0.02, dtype=jnp.float32)}[lr]
    tx, core = fismo(learning_rate), FISMO(lr=float(learning_rate))
    W = W0
    s_tx, s_core = tx.init(W0), core.init(W0)
    for G in grads:
        u, s_tx = tx.update(G, s_tx, W)
        s_core = _check_optax_step_against_the_core(optax, core, learning_rate, W, G, s_core, u, s_tx)
        assert all(getattr(s_core, f).dtype == jnp.float32 for f in STATE_FIELDS)
        W = optax.apply_updates(W, u)
    assert not bool(jnp.array_equal(W, W0))


@pytest.mark.parametrize("param_dtype, grad_dtype", [("float32", "bfloat16"), ("float32", "float16"),
                                                      ("bfloat16", "float32")])
def test_optax_gradients_of_another_dtype_than_the_params(param_dtype: str, grad_dtype: str) -> None:
    """Gradients narrower or wider than the params (cast for communication, or from a float32 loss of
    bfloat16 params): the updates have the params' dtype, as ``optax.adamw``'s, and the steps are the
    core's on the same gradients (`_check_optax_step_against_the_core`). Until 2026-12-03 the
    directions were rounded to the gradient's dtype: float32 params with bfloat16 gradients parted
    from the core by 2e-3 of their change in three steps (a user's hunt). Without the params,
    ``scale_by_fismo``'s directions keep the gradient's dtype, as documented."""
    optax = _optax()
    from fismo_core.backends.optax import fismo, scale_by_fismo

    _jax_target("float32")
    W0 = jnp.asarray(np.random.default_rng(13).standard_normal(SHAPE), dtype=param_dtype)
    grads = [jnp.asarray(g, dtype=grad_dtype) for g in reference_gradients(SHAPE, 3, seed=14)]
    tx, core = fismo(0.02), FISMO(lr=0.02)
    W = W0
    s_tx, s_core = tx.init(W0), core.init(W0)
    for G in grads:
        u, s_tx = tx.update(G, s_tx, W)
        s_core = _check_optax_step_against_the_core(optax, core, 0.02, W, G, s_core, u, s_tx)
        W = optax.apply_updates(W, u)
    assert not bool(jnp.array_equal(W, W0))
    jitted, _ = jax.jit(tx.update)(grads[0], tx.init(W0), W0)
    assert jitted.dtype == jnp.dtype(param_dtype)
    bare = scale_by_fismo()
    assert bare.update(grads[0], bare.init(W0))[0].dtype == jnp.dtype(grad_dtype)


@pytest.mark.parametrize("wrapper", ["apply_if_finite", "MultiSteps", "vmap"])
def test_wrappers_that_trace_the_update_leave_out_the_eager_checks(wrapper: str) -> None:
    """``optax.apply_if_finite`` and ``optax.MultiSteps`` run the update inside ``lax.cond``, and ``jax.vmap``
    (an ensemble of two here) traces it too, even without ``jax.jit``: a root that fails its check (a finite
    gradient 1e30 times a usual one) is repaired by the plain eager ``fismo`` (two warnings, finite params)
    and not under them (NaN params under the wrappers, params far off under vmap; no warning), as under
    ``jax.jit``; the page "Backends" says so (a user's hunt, 2026-12-03; vmap, another, 2026-12-04)."""
    optax = _optax()
    from fismo_core.backends.optax import fismo

    _jax_target("float32")
    params = {"w": jnp.ones((4, 3)) + jnp.eye(4, 3)}
    good = {"w": jnp.arange(12.0).reshape(4, 3) / 12}
    huge = {"w": good["w"] * 1e30}  # finite in float32; P_t overflows

    def run(tx: Any, members: int = 0) -> tuple[bool, int, Any]:
        """``members`` > 0: the update of an ensemble of that many copies, under ``jax.vmap``."""
        stacked = (lambda t: jax.tree.map(lambda x: jnp.stack([x] * members), t)) if members else (lambda t: t)
        init, update = (jax.vmap(tx.init), jax.vmap(tx.update)) if members else (tx.init, tx.update)
        p = stacked(params)
        state = init(p)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for g in (good, huge, good):
                u, state = update(stacked(g), state, p)
                p = optax.apply_updates(p, u)
        return bool(jnp.all(jnp.isfinite(p["w"]))), len(caught), p["w"]

    finite, warned, repaired = run(fismo(0.02))
    assert (finite, warned) == (True, 2)
    if wrapper == "vmap":  # the roots' check is left out: no repair, no warning, another trajectory
        finite, warned, members = run(fismo(0.02), members=2)
        # Measured: the members' params reach 6.4e13 in absolute difference from the repaired run's (about 1)
        # on an AMD EPYC, and NaN on an Intel Xeon (AVX-512): unrepaired either way, so "not within 1" (NaN
        # included), not "differs by more than 1", which a NaN fails.
        assert warned == 0 and not bool(jnp.all(jnp.abs(members[0] - repaired) <= 1.0))
        return
    wrapped = optax.apply_if_finite(fismo(0.02), 3) if wrapper == "apply_if_finite" else optax.MultiSteps(fismo(0.02), 1)
    assert run(wrapped)[:2] == (False, 0)


# ----------------------------------------------------------------- optax: block-diagonal factors
#: Blocked optax under jax.jit against the NumPy float64 core with the same block_size on the
#: same gradients: the relative error of W_t - W_0 over 20 steps, worst over the steps. float64:
#: LAPACK/XLA rounding only (measured 8.1e-15); float32: float32 rounding amplified by eigh and
#: Newton–Schulz (measured 3.0e-6). The bars are the project's (fismo_core.testing.TOLERANCES):
#: factors of 1e4 and 34; a block of the wrong rows or a dropped remainder moves P and Q by O(1).
@pytest.mark.parametrize(
    "dtype, every",
    # Each case compiles a blocked step (every=2: both lax.cond branches), about 10 s here: two
    # cases cover both dtypes, both root schedules and the remainder blocks of both sides.
    [pytest.param("float64", 2, id="float64-every-2"), pytest.param("float32", 1, id="float32-roots-every-step")],
)
def test_optax_blocked_under_jit_matches_numpy_core(dtype: str, every: int) -> None:
    """``fismo(..., block_size=5)`` on a (8, 12) matrix (P: 5 + 3, Q: 2 x 5 + 2) and a bias, one
    jitted train step; with ``every=2`` the roots' schedule runs through ``lax.cond`` on the
    blocked state. The state holds ``Blocks``; jit traces once; a run resumed from a host copy of
    params and state taken halfway ends bit for bit where the uninterrupted run did."""
    optax = _optax()
    from fismo_core.backends.optax import fismo
    from fismo_core.kronecker import Blocks
    from fismo_core.testing import TOLERANCES

    _jax_target(dtype)
    lr, B = 0.05, 5
    inv_root = {"every": every}
    tx = fismo(lr, block_size=B, inv_root=inv_root, weight_decay=0.01)
    grads64 = reference_gradients(SHAPE, STEPS, seed=21)
    W0_64 = np.random.default_rng(22).standard_normal(SHAPE)
    params = {"w": jnp.asarray(W0_64, dtype=dtype), "b": jnp.zeros(SHAPE[0], dtype=dtype)}
    state = tx.init(params)
    traces = []

    @jax.jit
    def train_step(params, state, g):
        traces.append(1)
        updates, state = tx.update(g, state, params)
        return optax.apply_updates(params, updates), state

    core = FISMO(lr=lr, block_size=B, inv_root=inv_root, weight_decay=0.01)
    W, s = W0_64, core.init(W0_64)
    worst = 0.0
    saved = None
    for t, G in enumerate(grads64):
        if t == STEPS // 2:  # a checkpoint on the host, halfway (NumPy arrays, as a user would save them)
            saved = jax.tree.map(np.asarray, (params, state))
        g = {"w": jnp.asarray(G, dtype=dtype), "b": jnp.asarray(G[:, 0], dtype=dtype)}
        params, state = train_step(params, state, g)
        # The reference sees the gradient the jitted step saw (rounded to dtype), in float64.
        W, s = core.step(W, np.asarray(g["w"], dtype=np.float64), s)
        worst = max(worst, max_relative_error(np.asarray(params["w"], dtype=np.float64) - W0_64, W - W0_64))
    assert len(traces) == 1
    # Resume from the host checkpoint: the blocked state comes back and the run ends bit for bit
    # where the uninterrupted one did.
    resumed, resumed_state = jax.tree.map(jnp.asarray, saved)
    for G in grads64[STEPS // 2:]:
        g = {"w": jnp.asarray(G, dtype=dtype), "b": jnp.asarray(G[:, 0], dtype=dtype)}
        resumed, resumed_state = train_step(resumed, resumed_state, g)
    for a, b in zip(jax.tree.leaves((params, state)), jax.tree.leaves((resumed, resumed_state))):
        assert bool(jnp.array_equal(a, b))
    assert worst <= TOLERANCES[dtype], worst
    leaf_state = jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, FISMOState))
    fismo_state = next(x for x in leaf_state if isinstance(x, FISMOState))
    assert isinstance(fismo_state.P, Blocks) and fismo_state.P.full.shape == (1, 5, 5) and fismo_state.P.rest.shape == (3, 3)
    assert isinstance(fismo_state.Q, Blocks) and fismo_state.Q.full.shape == (2, 5, 5) and fismo_state.Q.rest.shape == (2, 2)
    assert max_relative_error(np.asarray(fismo_state.Q.rest, dtype=np.float64), np.asarray(s.Q.rest)) <= TOLERANCES[dtype]


def test_optax_bad_block_size_is_refused_before_any_state() -> None:
    _optax()
    from fismo_core.backends.optax import fismo, scale_by_fismo

    for bad in (0, -2, 2.5, True):
        with pytest.raises(ValueError, match="block_size must be None"):
            fismo(0.02, block_size=bad)
        with pytest.raises(ValueError, match="block_size must be None"):
            scale_by_fismo(block_size=bad)


# ------------------------------------------------------- what a new user hit (issue 18)
@pytest.mark.parametrize(
    "ours, muon",
    [("fismo", "muon"), ("scale_by_fismo", "scale_by_muon")],
)
def test_optax_no_keyword_of_optax_muon_is_ignored(ours: str, muon: str) -> None:
    """Every keyword of ``optax.contrib.muon`` (and ``scale_by_muon``) is the adapter's too or is refused
    naming FISMO's spelling, before anything is built."""
    import inspect

    optax = _optax()
    from fismo_core.backends import optax as adapter

    function = getattr(adapter, ours)
    accepted = set(inspect.signature(function).parameters)
    refused = []
    for name in inspect.signature(getattr(optax.contrib, muon)).parameters:
        if name in accepted:
            continue
        with pytest.raises(TypeError, match=rf"{ours}\(\) got keyword arguments of other optimizers.*In FISMO: "):
            function(**({"learning_rate": 0.02} if ours == "fismo" else {}), **{name: 1})
        refused.append(name)
    assert {"ns_coeffs", "ns_steps", "eps"} <= set(refused)


def test_optax_muon_keywords_name_fismos_spelling() -> None:
    _optax()
    from fismo_core.backends.optax import fismo

    with pytest.raises(TypeError) as info:
        fismo(0.02, ns_steps=5, ns_coeffs=(3.4445, -4.775, 2.0315), adam_b1=0.8)
    message = str(info.value)
    assert "polar=PolarConfig(steps=5, coefficients=((3.4445, -4.775, 2.0315),))" in message
    assert "adam_b1 -> the other leaves' AdamW: fismo(..., non_matrix=optax.adamw(learning_rate, b1=...))" in message


def test_optax_nan_error_names_the_leaf() -> None:
    """A NaN in a gradient raises naming the leaf by its pytree path, as the torch adapter names the parameter."""
    _optax()
    from fismo_core.backends.optax import fismo

    params = {"dense": {"kernel": jnp.ones((4, 3)), "bias": jnp.zeros(3)}, "out": [jnp.ones((3, 2))]}
    tx = fismo(0.02)
    state = tx.init(params)
    grads = jax.tree.map(jnp.ones_like, params)
    grads["out"][0] = grads["out"][0].at[1, 0].set(jnp.nan).at[0, 0].set(jnp.inf)
    with pytest.raises(ValueError, match=r"gradient of leaf \['out'\]\[0\] \(shape \(3, 2\)\) contains 1 NaN and 1 infinite"):
        tx.update(grads, state, params)


@pytest.mark.parametrize("factory", ["fismo", "fismo_training", "scale_by_fismo"])
def test_optax_beta_as_a_numpy_array_is_refused_when_built_and_as_a_numpy_scalar_is_the_float(factory: str) -> None:
    """An array ``beta`` must be a JAX array (one library per core call): a NumPy or torch one is refused
    when the transformation is built (the core refused it only at the first update); a NumPy scalar is a
    number, the float's updates bit for bit."""
    _optax()
    from fismo_core.backends import optax as fismo_optax

    make = getattr(fismo_optax, factory)
    build = (lambda beta: make(beta=beta)) if factory == "scale_by_fismo" else (lambda beta: make(0.02, beta=beta))
    for beta, kind in ((np.asarray(0.9), r"numpy\.ndarray"), (pytest.importorskip("torch").tensor(0.9), r"torch\.Tensor")):
        with pytest.raises(TypeError, match=rf"^{factory}: beta must be a number or a 0-d JAX array, got a {kind}$"):
            build(beta)
    params = {"w": jnp.asarray(np.random.default_rng(3).standard_normal((4, 3)), dtype=jnp.float32)}
    grads = jax.tree.map(lambda p: p * 0.5 + 1.0, params)
    txs = (build(np.float64(0.9)), build(0.9))
    updates = [tx.update(grads, tx.init(params), params)[0]["w"] for tx in txs]
    assert updates[0].dtype == jnp.float32 and np.array_equal(np.asarray(updates[0]), np.asarray(updates[1]))


def test_optax_thin_leaf_warns_once_at_init_naming_it() -> None:
    """A ``(1, 2000)`` leaf would keep a 2000 x 2000 ``Q``: one warning from ``init`` naming its path and
    ``block_size``; none with ``block_size``, none for the other leaves."""
    _optax()
    from fismo_core import FactorSizeWarning
    from fismo_core.backends.optax import fismo

    params = {"cls": jnp.zeros((1, 2000)), "w": jnp.ones((4, 3))}
    with pytest.warns(FactorSizeWarning) as record:
        fismo(0.02).init(params)
    (warning,) = [w for w in record if issubclass(w.category, FactorSizeWarning)]
    assert "leaf ['cls'] (shape (1, 2000)), a 1x2000 matrix" in str(warning.message)
    assert "block_size=B" in str(warning.message)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", FactorSizeWarning)
        fismo(0.02, block_size=256).init(params)


def test_optax_bad_learning_rate_is_refused_when_built() -> None:
    """``fismo`` and ``fismo_training`` refuse a negative, NaN, infinite, boolean or non-number learning rate
    at construction, as the torch adapter refuses such an ``lr``; numbers, 0-d arrays and schedules pass."""
    optax = _optax()
    from fismo_core.backends.optax import fismo, fismo_training

    for build in (fismo, fismo_training):
        for bad in (-0.02, math.nan, math.inf, True, "0.02", jnp.ones(2)):
            with pytest.raises(ValueError, match="learning_rate must be a finite number >= 0 or a schedule"):
                build(bad)
        for good in (0.0, 0.02, np.float32(0.02), jnp.asarray(0.02), optax.cosine_decay_schedule(0.02, 10)):
            build(good)


@pytest.mark.parametrize(
    "leaf, error, match",
    [
        (jnp.ones((4, 3), jnp.int32), TypeError, r"leaf \['enc'\]\['w'\] \(shape \(4, 3\)\) must have a real floating dtype"),
        (jnp.ones(3), ValueError, r"leaf \['enc'\]\['w'\] \(shape \(3,\)\) must be a matrix or a stack of matrices"),
        (jnp.ones((0, 3)), ValueError, r"leaf \['enc'\]\['w'\] \(shape \(0, 3\)\) has shape \(0, 3\), with no entries"),
    ],
    ids=["int32", "vector", "empty"],
)
def test_optax_init_errors_name_the_leaf(leaf, error, match) -> None:
    """``scale_by_fismo().init`` names a leaf it cannot take by its pytree path, as the NaN error does
    (an empty matrix included: its statistics would reduce over nothing)."""
    _optax()
    from fismo_core.backends.optax import scale_by_fismo

    with pytest.raises(error, match=match):
        scale_by_fismo().init({"enc": {"w": leaf}})


@pytest.mark.parametrize(
    "bad, match",
    [
        ({"adam_learning_rate": -1.0}, r"adam_learning_rate must be a finite number >= 0 or a schedule, got -1.0"),
        ({"adam_learning_rate": math.nan}, r"adam_learning_rate must be a finite number >= 0 or a schedule"),
        ({"adam_b1": 1.5}, r"adam_b1 must lie in \[0.0, 1.0\), got 1.5"),
        ({"adam_b1": 1.0}, r"adam_b1 must lie in \[0.0, 1.0\), got 1.0"),
        ({"adam_b2": -0.5}, r"adam_b2 must lie in \[0.0, 1.0\), got -0.5"),
        ({"adam_eps_root": -1.0}, r"adam_eps_root must lie in \[0.0, inf\), got -1.0"),
        ({"adam_weight_decay": math.nan}, r"adam_weight_decay must be a finite real number, got nan"),
        ({"adam_weight_decay": -5.0}, r"adam_weight_decay must lie in \[0.0, inf\), got -5.0"),
    ],
    ids=lambda v: next(iter(v.items())).__repr__() if isinstance(v, dict) else "",
)
def test_optax_training_refuses_bad_adamw_settings_when_built(bad: dict, match: str) -> None:
    """``fismo_training``'s ``adam_*`` arguments build the other leaves' ``optax.adamw``, which checks none
    of them: a negative or NaN rate, ``b1`` of 1 (AdamW's bias correction divides by ``1 - b1**t = 0``)
    trained on without a word (found by a user's hunt). Refused when built, naming the argument; the
    edges optax's AdamW takes (``b1 = 0``, zero rates and decay) pass."""
    _optax()
    from fismo_core.backends.optax import fismo_training

    with pytest.raises(ValueError, match=match):
        fismo_training(0.02, **bad)
    fismo_training(0.02, adam_learning_rate=0.0, adam_b1=0.0, adam_b2=0.0, adam_eps_root=0.0, adam_weight_decay=0.0)


def test_optax_inverse_root_warning_names_the_leaf() -> None:
    """backends.md: errors and warnings name the leaf by its pytree path. The core's InverseRootWarning
    counts a leaf's matrices and cannot name the leaf; the adapter issues it again prefixed with the path
    (found by a user's hunt: only the InverseRootError named it). ``gamma = 0``, ``mu = 1e-30``: ``Q_t`` is
    ``G^T G`` of rank 4 of 12 and a floor far below float64's rounding, so the float64 retry fails too."""
    _optax()
    import warnings

    from fismo_core.guards import InverseRootWarning
    from fismo_core.backends.optax import fismo

    rng = np.random.default_rng(0)
    params = {"encoder": {"kernel": jnp.asarray(rng.standard_normal((4, 12)), jnp.float32)}}
    grads = {"encoder": {"kernel": jnp.asarray(rng.standard_normal((4, 12)), jnp.float32)}}
    tx = fismo(0.02, gamma=0.0, mu=1e-30)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        updates, _ = tx.update(grads, tx.init(params), params)
    messages = [str(w.message) for w in caught if issubclass(w.category, InverseRootWarning)]
    assert messages and all(m.startswith("leaf ['encoder']['kernel']: FISMO: the inverse square root of")
                            for m in messages), messages
    assert bool(jnp.all(jnp.isfinite(updates["encoder"]["kernel"])))
    with warnings.catch_warnings():
        warnings.simplefilter("error", InverseRootWarning)  # a user's filter still turns it into an error
        with pytest.raises(InverseRootWarning, match=r"leaf \['encoder'\]\['kernel'\]"):
            tx.update(grads, tx.init(params), params)


def test_optax_inverse_root_warning_is_issued_when_the_leaf_then_raises() -> None:
    """With ``max_failures = 0`` one update warns of the failed root, then raises `InverseRootError`: the
    warning, named, is issued too (it was dropped with the leaf's raise). Same ill-conditioned leaf as above."""
    _optax()
    import warnings

    from fismo_core import InverseRootConfig
    from fismo_core.guards import InverseRootError, InverseRootWarning
    from fismo_core.backends.optax import fismo

    rng = np.random.default_rng(0)
    params = {"encoder": {"kernel": jnp.asarray(rng.standard_normal((4, 12)), jnp.float32)}}
    grads = {"encoder": {"kernel": jnp.asarray(rng.standard_normal((4, 12)), jnp.float32)}}
    tx = fismo(0.02, gamma=0.0, mu=1e-30, inv_root=InverseRootConfig(max_failures=0))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(InverseRootError, match=r"leaf \['encoder'\]\['kernel'\]"):
            tx.update(grads, tx.init(params), params)
    messages = [str(w.message) for w in caught if issubclass(w.category, InverseRootWarning)]
    assert messages and all(m.startswith("leaf ['encoder']['kernel']: FISMO: the inverse square root of")
                            for m in messages), messages


# ------------------------------------------------------------------ Flax
@pytest.mark.parametrize("name", ["fismo", "fismo_training, blocks"])
def test_flax_nnx_optimizer_steps_as_the_pure_pytree(name: str) -> None:
    """``flax.nnx.Optimizer`` stores each leaf's optax state as an ``nnx.State``: a `FISMOState` (and its
    `Blocks`) came back as mappings of their fields, and the second update raised "state must be a
    FISMOState from FISMO.init, got State" (a user's hunt, 2026-12-04; ``optax.adamw`` and
    ``optax.contrib.muon`` ran). Such a mapping is taken as the state now: an MLP trained through
    ``nnx.Optimizer`` equals, bit for bit, the same transformation on the pure parameter pytree."""
    optax = _optax()
    nnx = pytest.importorskip("flax.nnx", reason="flax is not installed (pip install flax)")
    from fismo_core.backends.optax import fismo, fismo_training

    class MLP(nnx.Module):
        def __init__(self, rngs: Any) -> None:
            self.hidden, self.out = nnx.Linear(6, 16, rngs=rngs), nnx.Linear(16, 5, rngs=rngs)

        def __call__(self, x: Any) -> Any:
            return self.out(jax.nn.relu(self.hidden(x)))

    tx = fismo(0.02) if name == "fismo" else fismo_training(0.02, block_size=5)  # 16 = 3 blocks of 5 + 1
    x = jnp.asarray(np.random.default_rng(0).standard_normal((8, 6)), dtype=jnp.float32)

    def loss(model: Any) -> Any:
        return (model(x) ** 2).mean()

    model = MLP(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    graphdef, params, rest = nnx.split(MLP(nnx.Rngs(0)), nnx.Param, ...)
    state = tx.init(params)
    for _ in range(3):
        optimizer.update(model, nnx.grad(loss)(model))
        grads = jax.grad(lambda p: loss(nnx.merge(graphdef, p, rest)))(params)
        updates, state = tx.update(grads, state, params)
        params = optax.apply_updates(params, updates)
    ours, pure = nnx.state(model, nnx.Param), params
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(pure)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# ------------------------------------------------------------------ non-finite gradients
def test_a_nan_under_jit_or_propagate_flows_into_the_state() -> None:
    """docs/guarantees.md: under ``jax.jit`` the default ``"raise"`` cannot read a flag (nothing can be read inside
    a trace), so its check is left out and a NaN propagates; under ``"propagate"`` eager JAX's ``eigh`` returns
    NaN rather than raising (NumPy's and torch's raise), and it flows into the state. Neither raises; both leave
    NaN in W, P and M."""
    W = jnp.asarray(np.full(SHAPE, 0.1))
    G = np.random.default_rng(0).standard_normal(SHAPE)
    G[0, 0] = np.nan
    G = jnp.asarray(G, dtype=W.dtype)
    for opt, jit in ((FISMO(), True), (FISMO(nonfinite="propagate"), False)):
        step = jax.jit(opt.step) if jit else opt.step
        W_new, state = step(W, G, opt.init(W))
        assert bool(jnp.isnan(W_new).any()) and bool(jnp.isnan(state.P).any()) and bool(jnp.isnan(state.M).any())
