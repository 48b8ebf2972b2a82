"""Sharded JAX: the optax adapter on parameters laid out by ``NamedSharding`` over 8 XLA host devices.

XLA fixes the number of host devices when JAX's CPU backend starts, and the
rest of the suite starts it with one. So the multi-device checks run in one
subprocess, started with ``XLA_FLAGS=--xla_force_host_platform_device_count=8``
(and x64 on): it runs `_worker` (this file's own code) and prints its
measurements as JSON, on which the tests below assert.

Each case trains the same pytree (matrices split every way over the mesh,
a convolution kernel, and a bias for AdamW) for `STEPS` jitted steps,
gradients taken by ``jax.grad`` inside the step, once on the mesh and once
on one device, with the same transformation.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("jax")
pytest.importorskip("optax", reason="optax is not installed (pip install optax)")

DEVICES = 8
STEPS = 4  # roots every second step: steps 0 and 2 recompute them, 1 and 3 reuse them
MESHES = {"4x2": (4, 2), "8x1": (8, 1)}

#: name: (shape, PartitionSpec entries). Every shape divides evenly over its split axes on both meshes
#: (JAX refuses an uneven NamedSharding of an array); what does not divide evenly is the blocks: see
#: EXPECTED_BLOCKS.
LEAVES = {
    "w": ((32, 16), ("x", "y")),
    "rows": ((16, 24), ("x", None)),
    "cols": ((24, 8), (None, "y")),
    "replicated": ((12, 10), ()),
    "tall": ((64, 16), ("x", None)),
    "conv": ((8, 4, 2, 2), ("x", "y")),  # optimized as the 8 x 16 matrix (default_matrix_shape)
    "bias": ((16,), ("y",)),  # AdamW
}
MATRICES = [name for name, (shape, _) in LEAVES.items() if len(shape) >= 2]

#: fismo(...) keywords of the block-diagonal cases, with "schedule": an optax learning-rate schedule
#: (a step count in the state) instead of a constant. The three layouts share one single-device reference.
BLOCKS = dict(
    block_size=8, nesterov=True, weight_decay=0.1, statistics="scale_invariant", inv_root={"every": 2}, schedule=True
)
#: name: mesh, axis types, fismo(...) keywords. Between them: both axis types, both meshes, full and
#: block-diagonal factors, a schedule, Nesterov, weight decay, both statistics, both polar methods, roots
#: every step and every second step.
CASES = {
    "auto-4x2-full": ("4x2", "Auto", dict(polar="svd", weight_decay=0.1)),
    "auto-4x2-blocks": ("4x2", "Auto", BLOCKS),
    "explicit-4x2-blocks": ("4x2", "Explicit", BLOCKS),
    "explicit-8x1-blocks": ("8x1", "Explicit", BLOCKS),
}
EAGER_CASE = "auto-4x2-full"  # also runs a step without jax.jit, on these leaves:
EAGER_LEAVES = ("w", "bias")
BARE_LEAVES = ("w", "rows", "conv")  # and scale_by_fismo's jitted update alone, on these

#: The layout the page "Backends" (section "Sharding") promises, written out by hand from its rule.
#: M: the parameter's layout in its matrix form (the kernel (8@x, 4@y, 2, 2) as (8@x, 16@y)).
EXPECTED_M = {
    "w": ["x", "y"], "rows": ["x", None], "cols": [None, "y"], "replicated": [None, None],
    "tall": ["x", None], "conv": ["x", "y"],
}
#: P and Q (their roots alike) with block_size=8 on Explicit axes. One entry per stored part of a
#: block-diagonal factor: the mesh axis the block axis of the stack (k, B, B) is split over, None for
#: replicated, "rest" for the remainder block (r, r), replicated; "full" for a full factor (8 x 8 or
#: smaller), replicated. The rule: a stack is split as the parameter splits that side (rows for P,
#: columns for Q) when that split divides k and the blocks tile the side (k B = d).
#: On Auto axes every factor is replicated.
EXPECTED_BLOCKS = {
    "4x2": {
        "w": (["x"], ["y"]),  # 32 = 4 x 8 rows over x (4 | 4), 16 = 2 x 8 columns over y (2 | 2)
        "rows": ([None], [None]),  # k = 2 blocks of rows split 4 ways: 4 does not divide 2
        "cols": ([None], "full"),  # rows not split; 8 columns are one block
        "replicated": ([None, "rest"], [None, "rest"]),  # 12 = 8 + 4, 10 = 8 + 2
        "tall": (["x"], [None]),  # k = 8 over x (4 | 8); columns not split
        "conv": ("full", ["y"]),
    },
    "8x1": {
        "w": ([None], ["y"]),  # k = 4 blocks of rows, x has 8: replicated; columns over y (size 1)
        "rows": ([None], [None]),
        "cols": ([None], "full"),
        "replicated": ([None, "rest"], [None, "rest"]),
        "tall": (["x"], [None]),  # k = 8 over x (8 | 8)
        "conv": ("full", ["y"]),
    },
}

#: Worst relative error of W_t - W_0 between the mesh and the single-device run, float64. On the mesh
#: XLA splits the matrix products and sums their partial results in another order, a rounding-level
#: difference that the trajectory carries on. Measured worst case over the cases and steps: 3.8e-14
#: under the default and Haswell kernels, 6.9e-14 under SkylakeX (JAX's CPU eigh and SVD call LAPACK
#: through SciPy's OpenBLAS, so the kernel set moves the rounding). 1e-10, the issue's bar, leaves a
#: factor of 1400; a layout that changed the arithmetic (a block multiplied by the wrong rows, a stale
#: root) is an error of order 1e-2 or more.
TRAJECTORY_TOLERANCE = 1e-10
#: The worker takes about 50 s on two busy cores; a run far beyond that is stuck, not slow.
WORKER_TIMEOUT_S = 420


# ------------------------------------------------------------------ the subprocess
def _layout(x: Any) -> Any:
    """``x``'s ``PartitionSpec`` as a JSON list, one entry per dimension (a list for several axes)."""
    from jax.sharding import NamedSharding

    if not isinstance(x.sharding, NamedSharding):
        return f"not a NamedSharding: {x.sharding}"
    entries = tuple(x.sharding.spec) + (None,) * (x.ndim - len(x.sharding.spec))
    return [list(e) if isinstance(e, tuple) else e for e in entries]


def _fismo_states(state: Any) -> dict[str, Any]:
    """The FISMOState of each matrix leaf, by leaf name, from fismo()'s optax state."""
    import jax

    from fismo_core import FISMOState
    from fismo_core.backends.optax import ScaleByFismoState

    (inner,) = [s for s in jax.tree.leaves(state, is_leaf=lambda s: isinstance(s, ScaleByFismoState))
                if isinstance(s, ScaleByFismoState)]
    return {name: s for name, s in inner.states.items() if isinstance(s, FISMOState)}


def _state_layout(state: Any) -> dict[str, Any]:
    """Per matrix leaf: M's layout and, per factor field, the layout of each stored part."""
    from fismo_core.kronecker import Blocks

    out = {}
    for name, s in _fismo_states(state).items():
        parts = {"M": _layout(s.M)}
        for field in ("P", "Q", "P_inv_sqrt", "Q_inv_sqrt"):
            value = getattr(s, field)
            if isinstance(value, Blocks):
                arrays = [value.full] + ([value.rest] if value.rest is not None else [])
            else:
                arrays = [value]
            parts[field] = [_layout(a) for a in arrays]
        parts["counters"] = [_layout(s.step), _layout(s.skipped), _layout(s.root_failures)]
        out[name] = parts
    return out


def _run_case(name: str) -> dict[str, Any]:
    import jax
    import jax.numpy as jnp
    import optax
    from jax.sharding import AxisType, NamedSharding, PartitionSpec

    from fismo_core.backends.optax import fismo, scale_by_fismo
    from fismo_core.testing import max_relative_error, reference_gradients

    mesh_name, axis_type, options = CASES[name]
    mesh = jax.make_mesh(MESHES[mesh_name], ("x", "y"), axis_types=(getattr(AxisType, axis_type),) * 2)
    options = dict(options)
    learning_rate = optax.linear_schedule(0.02, 0.005, STEPS) if options.pop("schedule", False) else 0.02
    tx = fismo(learning_rate, **options)

    rng = np.random.default_rng(0)
    W0 = {leaf: rng.standard_normal(shape) for leaf, (shape, _) in LEAVES.items()}
    data = {leaf: reference_gradients((1, *shape) if len(shape) == 1 else shape, STEPS, seed=i)
            for i, (leaf, (shape, _)) in enumerate(LEAVES.items())}
    data = [{leaf: np.reshape(data[leaf][t], LEAVES[leaf][0]) for leaf in LEAVES} for t in range(STEPS)]

    def loss(params: Any, X: Any) -> Any:
        # The gradient is X + 0.05 W: taken inside the jitted step, where its layout is XLA's to choose.
        return sum(jnp.sum(params[k] * X[k]) + 0.025 * jnp.sum(params[k] ** 2) for k in params)

    def train_step(params: Any, state: Any, X: Any) -> Any:
        updates, state = tx.update(jax.grad(loss)(params, X), state, params)
        return optax.apply_updates(params, updates), state

    def on_mesh(tree: Any) -> Any:
        return {k: jax.device_put(v, NamedSharding(mesh, PartitionSpec(*LEAVES[k][1]))) for k, v in tree.items()}

    def on_one_device(tree: Any) -> Any:
        return {k: jax.device_put(v, jax.devices()[0]) for k, v in tree.items()}

    def trajectory(place: Any, state: Any) -> tuple[list[dict[str, Any]], Any, dict[str, Any]]:
        """STEPS jitted steps from W0; the params after each (host copies), the last state, and checks."""
        params = place(W0)
        step = jax.jit(train_step)
        path, kept, compiles_after_first = [], True, 0
        for t in range(STEPS):
            before = len(COMPILES)
            new_params, state = step(params, state, place(data[t]))
            if t > 0:
                compiles_after_first += len(COMPILES) - before
            kept &= all(new_params[k].sharding.is_equivalent_to(params[k].sharding, params[k].ndim) for k in params)
            params = new_params
            path.append({k: np.asarray(v) for k, v in params.items()})
        checks = dict(
            params_kept_sharding=kept,
            param_layouts={k: _layout(v) for k, v in params.items()},
            compiles_after_first_step=compiles_after_first,
        )
        return path, state, checks

    state = tx.init(on_mesh(W0))
    path, final, out = trajectory(on_mesh, state)
    out.update(
        init_layout=_state_layout(state),
        final_layout=_state_layout(final),
        # An array laid out anew by a step would make the next step compile again.
        state_shardings_kept=all(
            a.sharding.is_equivalent_to(b.sharding, a.ndim)
            for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(final))
        ),
    )
    key = json.dumps(CASES[name][2], sort_keys=True)
    if key not in _REFERENCES:  # jit-compiled and committed: eagerly JAX would compile each operation of init
        on_one = on_one_device(W0)
        _REFERENCES[key] = trajectory(on_one_device, jax.device_put(jax.jit(tx.init)(on_one), jax.devices()[0]))[0]
    reference = _REFERENCES[key]
    out["errors"] = [
        max(max_relative_error(got[k] - W0[k], ref[k] - W0[k]) for k in LEAVES)
        for got, ref in zip(path, reference)
    ]
    if name == EAGER_CASE:  # the first step without jax.jit around it, against the jitted one-device step
        params = on_mesh({k: W0[k] for k in EAGER_LEAVES})  # the leaves are independent: a part of the tree
        X = on_mesh({k: data[0][k] for k in EAGER_LEAVES})
        updates, _ = tx.update(jax.grad(loss)(params, X), tx.init(params), params)
        first = {k: np.asarray(v) for k, v in optax.apply_updates(params, updates).items()}
        out["eager_error"] = max(
            max_relative_error(first[k] - W0[k], reference[0][k] - W0[k]) for k in EAGER_LEAVES
        )
        out["eager_updates_kept_sharding"] = all(
            updates[k].sharding.is_equivalent_to(params[k].sharding, params[k].ndim) for k in params
        )
        # scale_by_fismo alone, its update jitted: nothing ties its directions to the params, which
        # XLA would otherwise be free to lay out as it likes (it replicates them).
        bare = scale_by_fismo()
        grads = on_mesh({k: data[0][k] for k in BARE_LEAVES})
        directions, _ = jax.jit(bare.update)(grads, bare.init(grads))
        out["bare_directions_like_gradients"] = {
            k: directions[k].sharding.is_equivalent_to(grads[k].sharding, grads[k].ndim) for k in grads
        }
    if name in ("auto-4x2-blocks", "explicit-4x2-blocks"):
        with jax.set_mesh(mesh):  # JAX's rule for a jitted init on Explicit axes (optax.adamw's too)
            out["jit_init_layout"] = _state_layout(jax.jit(tx.init)(on_mesh(W0)))
    return out


#: The worker's count of XLA compilations (JAX's monitoring events), read around each jitted step.
COMPILES: list[str] = []
#: The single-device trajectories, by fismo(...) keywords: cases that differ only in layout share one.
_REFERENCES: dict[str, Any] = {}


def _wrapper_executables() -> dict[str, int]:
    """backends.md's recipe for optax wrappers around fismo on a mesh (their counters placed after init):
    the executables of a jitted step over three steps, per wrapper."""
    import inspect

    import jax
    import jax.numpy as jnp
    import optax
    from jax.sharding import NamedSharding, PartitionSpec

    from fismo_core.backends.optax import fismo

    mesh = jax.make_mesh((4, 2), ("x", "y"))
    params = {"w": jax.device_put(jnp.ones((16, 8)) + jnp.arange(8.0), NamedSharding(mesh, PartitionSpec("x", "y")))}
    static = tuple(inspect.signature(fismo).parameters)[1:]
    replicated = NamedSharding(mesh, PartitionSpec())
    out = {}
    for name, tx in [("inject_hyperparams", optax.inject_hyperparams(fismo, static_args=static)(learning_rate=0.02)),
                     ("MultiSteps", optax.MultiSteps(fismo(0.02), 2)),
                     ("apply_if_finite", optax.apply_if_finite(fismo(0.02), 3))]:
        def step(p, s, g, tx=tx):
            u, s = tx.update(g, s, p)
            return optax.apply_updates(p, u), s

        step = jax.jit(step)
        p, opt_state = params, tx.init(params)
        opt_state = jax.tree.map(
            lambda x: jax.device_put(x, replicated) if x.ndim == 0 and not x.committed else x, opt_state)
        for i in range(3):
            p, opt_state = step(p, opt_state, jax.tree.map(lambda x: 0.1 * x + i, p))
        out[name] = step._cache_size()  # private API of jax.jit's functions: the compiled executables
    # Eager updates of inject_hyperparams(fismo), which builds the transformation again at every update:
    # the XLA compilations after the first step (each step compiled its mesh programs again before they
    # were cached per core).
    # The same with beta scheduled too (an array beta: its programs were built anew at every update).
    with_beta = tuple(n for n in static if n != "beta")
    for name, tx in (("eager inject_hyperparams", optax.inject_hyperparams(fismo, static_args=static)(
                         learning_rate=0.02)),
                     ("eager inject_hyperparams, beta scheduled", optax.inject_hyperparams(
                         fismo, static_args=with_beta)(learning_rate=0.02, beta=optax.linear_schedule(0.85, 0.95, 3)))):
        opt_state, p = tx.init(params), params
        before = None
        for i in range(3):
            before = len(COMPILES) if i == 1 else before
            updates, opt_state = tx.update(jax.tree.map(lambda x: 0.1 * x + i, p), opt_state, p)
            p = optax.apply_updates(p, updates)
        jax.block_until_ready(p)
        out[f"{name}, compilations after the first step"] = len(COMPILES) - before
    return out


def _numpy_gradients() -> dict[str, Any]:
    """Sharded params, an eager update with NumPy gradients (a matrix leaf and a conv kernel): the error
    against the same update on one device, and whether the updates are laid out like the params."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    from fismo_core.backends.optax import fismo
    from fismo_core.testing import max_relative_error

    mesh = jax.make_mesh((4, 2), ("x", "y"))
    rng = np.random.default_rng(5)
    host = {"w": rng.standard_normal((16, 8)), "conv": rng.standard_normal((8, 4, 2, 2))}
    grads = {k: rng.standard_normal(v.shape) for k, v in host.items()}  # NumPy
    specs = {"w": PartitionSpec("x", "y"), "conv": PartitionSpec("x")}
    params = {k: jax.device_put(jnp.asarray(v), NamedSharding(mesh, specs[k])) for k, v in host.items()}
    tx = fismo(0.02)
    updates, _ = tx.update(grads, tx.init(params), params)
    single = {k: jnp.asarray(v) for k, v in host.items()}
    reference, _ = tx.update(grads, tx.init(single), single)
    return {
        "error": max(max_relative_error(np.asarray(updates[k]), np.asarray(reference[k])) for k in host),
        "laid_out_like_params": {k: updates[k].sharding.is_equivalent_to(params[k].sharding, params[k].ndim)
                                 for k in host},
    }


def _user_hunt_cases() -> dict[str, Any]:
    """What a user's hunt found failing on a mesh (2026-12-02), each against its single-device run:
    a ``beta`` schedule (``inject_hyperparams``) and a replicated array ``beta`` on Explicit axes; a
    one-device gradient beside sharded ones, eagerly; an eager step whose inverse root fails its check;
    ``jax.vmap(tx.init)`` over an ensemble; a thin leaf's `FactorSizeWarning` at a second init."""
    import contextlib
    import inspect
    import warnings

    import jax
    import jax.numpy as jnp
    import optax
    from jax.sharding import AxisType, NamedSharding, PartitionSpec

    from fismo_core.backends.optax import fismo
    from fismo_core.guards import FactorSizeWarning, InverseRootError, InverseRootWarning
    from fismo_core.testing import max_relative_error

    mesh = jax.make_mesh((4, 2), ("x", "y"))  # Explicit axes, jax.make_mesh's default
    replicated = NamedSharding(mesh, PartitionSpec())
    rng = np.random.default_rng(7)
    host = {"w": rng.standard_normal((16, 8)), "b": rng.standard_normal(8)}
    specs = {"w": PartitionSpec("x", "y"), "b": PartitionSpec("y")}
    grads = [{k: rng.standard_normal(v.shape) for k, v in host.items()} for _ in range(3)]
    out: dict[str, Any] = {}

    def run(tx: Any, place: Any, jit: bool) -> dict[str, Any]:
        def step(p: Any, s: Any, g: Any) -> Any:
            u, s = tx.update(g, s, p)
            return optax.apply_updates(p, u), s

        step = jax.jit(step) if jit else step
        params = place(host)
        state = tx.init(params)
        state = jax.tree.map(lambda x: jax.device_put(x, replicated) if x.ndim == 0 and not x.committed else x,
                             state) if place is on_mesh else state
        for g in grads:
            params, state = step(params, state, place(g))
        return {k: np.asarray(v) for k, v in params.items()}

    def on_mesh(tree: Any) -> Any:
        return {k: jax.device_put(jnp.asarray(v), NamedSharding(mesh, specs[k])) for k, v in tree.items()}

    def on_one_device(tree: Any) -> Any:
        return {k: jax.device_put(jnp.asarray(v), jax.devices()[0]) for k, v in tree.items()}

    def error(got: dict[str, Any], ref: dict[str, Any]) -> float:
        return max(max_relative_error(got[k] - host[k], ref[k] - host[k]) for k in host)

    # A beta schedule, the docs' recipe (every argument but learning_rate and beta static).
    static = tuple(n for n in inspect.signature(fismo).parameters if n not in ("learning_rate", "beta"))
    scheduled = optax.inject_hyperparams(fismo, static_args=static)(
        learning_rate=0.02, beta=optax.linear_schedule(0.85, 0.95, 3))
    reference = run(scheduled, on_one_device, jit=True)
    out["beta_schedule"] = {how: error(run(scheduled, on_mesh, jit), reference)
                            for how, jit in (("jit", True), ("eager", False))}
    # An array beta laid out on the mesh, against the number.
    reference = run(fismo(0.02, beta=0.9), on_one_device, jit=True)
    out["beta_array"] = {}
    for where, beta in (("replicated", jax.device_put(jnp.asarray(0.9), replicated)),
                        ("on one device", jax.device_put(jnp.asarray(0.9), jax.devices()[0]))):
        tx = fismo(0.02, beta=beta)
        out["beta_array"].update({f"{where}, {how}": error(run(tx, on_mesh, jit), reference)
                                  for how, jit in (("jit", True), ("eager", False))})

    # Eagerly, matrix 'w' on the mesh and matrix 'c''s gradient committed to one device (the gradients'
    # finiteness check stacked their flags). optax.adamw itself takes no such mix: no bias here.
    matrices = {"w": host["w"], "c": rng.standard_normal((8, 8))}
    g = {k: rng.standard_normal(v.shape) for k, v in matrices.items()}
    tx = fismo(0.02)
    params = {"w": on_mesh({"w": matrices["w"]})["w"],
              "c": jax.device_put(jnp.asarray(matrices["c"]), NamedSharding(mesh, PartitionSpec(None, "y")))}
    mixed = {"w": on_mesh({"w": g["w"]})["w"], "c": jax.device_put(jnp.asarray(g["c"]), jax.devices()[0])}
    updates, _ = tx.update(mixed, tx.init(params), params)
    reference, _ = tx.update(on_one_device(g), tx.init(on_one_device(matrices)), on_one_device(matrices))
    out["one_device_gradient_beside_the_mesh"] = max(
        max_relative_error(np.asarray(updates[k]), np.asarray(reference[k])) for k in matrices)

    # gamma = 0, mu = 1e-30: Q_t = G^T G (rank 4 of 16) fails its check, in float64 too. Eagerly on the
    # mesh the step was jitted whole, its checks stepped aside: NaN updates, no warning, no error.
    leaf = {"w": rng.standard_normal((4, 16))}
    g = {"w": rng.standard_normal((4, 16))}
    faults = {}
    on_the_mesh = lambda t: {"w": jax.device_put(jnp.asarray(t["w"]), NamedSharding(mesh, specs["w"]))}  # noqa: E731
    # "inside set_mesh": the one-device retake's jit was refused there ("Received incompatible devices";
    # a user's hunt, 2026-12-02), though the docs tell users of Explicit axes to work inside it.
    for where, place in (("mesh", on_the_mesh), ("mesh inside set_mesh", on_the_mesh), ("one device", on_one_device)):
        for max_failures in (10, 0):
            tx = fismo(0.02, gamma=0.0, mu=1e-30, inv_root={"max_failures": max_failures})
            p = place(leaf)
            context = jax.set_mesh(mesh) if where.endswith("set_mesh") else contextlib.nullcontext()
            with warnings.catch_warnings(record=True) as caught, context:
                warnings.simplefilter("always")
                try:
                    u, s = tx.update(place(g), tx.init(p), p)
                    (inner,) = [x for x in jax.tree.leaves(s, is_leaf=lambda x: hasattr(x, "root_failures"))
                                if hasattr(x, "root_failures")]
                    result = {"update": np.asarray(u["w"]).tolist(), "root_failures": int(inner.root_failures),
                              "laid_out_like_param": u["w"].sharding.is_equivalent_to(p["w"].sharding, 2)}
                except InverseRootError as exc:
                    result = {"error": str(exc)[:40]}
                except ValueError as exc:  # what set_mesh gave until 2026-12-02
                    result = {"error": str(exc)[:80]}
            result["warnings"] = [str(w.message)[:50] for w in caught if issubclass(w.category, InverseRootWarning)]
            faults[f"{where}, max_failures={max_failures}"] = result
    out["failed_root_eagerly"] = faults

    # A state resumed from a host copy (jax.device_get, pickle) on Explicit axes: its M came back replicated.
    tx = fismo(0.02, block_size=4)
    params = on_mesh(host)
    state = tx.init(params)
    _, state = tx.update(on_mesh(grads[0]), state, params)
    resumed = {}
    for how, update in (("eager", tx.update), ("jit", jax.jit(tx.update))):
        _, after = update(on_mesh(grads[1]), jax.device_get(state), params)
        (inner,) = [x for x in jax.tree.leaves(after, is_leaf=lambda x: hasattr(x, "root_failures"))
                    if hasattr(x, "root_failures")]
        resumed[how] = _layout(inner.M)
    out["resumed_from_host_M"] = resumed

    # jax.vmap(tx.init) over an ensemble on the mesh (JAX's rule on Explicit axes: inside jax.set_mesh).
    ensemble = {"w": jnp.ones((3, 16, 8)) + jnp.arange(3.0)[:, None, None]}
    vmapped = {}
    for axis_type in ("Auto", "Explicit"):
        m = jax.make_mesh((4, 2), ("x", "y"), axis_types=(getattr(AxisType, axis_type),) * 2)
        sharded = {"w": jax.device_put(ensemble["w"], NamedSharding(m, PartitionSpec(None, "x", "y")))}
        with jax.set_mesh(m):
            state = jax.vmap(fismo(0.02).init)(sharded)
        vmapped[axis_type] = [tuple(x.shape) for x in jax.tree.leaves(state) if x.ndim == 3]
    out["vmap_init"] = vmapped

    # A thin leaf's FactorSizeWarning from every fresh transformation's init, as on one device: the second
    # init on the mesh hit the compiled program's cache, whose trace had issued it, and was silent.
    thin = {"cls": jax.device_put(jnp.zeros((1, 2000)), NamedSharding(mesh, PartitionSpec(None, "x")))}
    counts = []
    for _ in range(2):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fismo(0.02).init(thin)
        counts.append([str(w.message)[:60] for w in caught if issubclass(w.category, FactorSizeWarning)])
    out["factor_size_warnings"] = counts

    # A float64 gradient beyond float32's range for a float32 leaf on the mesh, eagerly: refused as on one
    # device, the state unchanged. It was zeroed without a word (every=1), as the core's check does not run
    # on a mesh and the adapter checked the gradient in its own dtype (a user's hunt, 2026-12-02).
    w32 = jax.device_put(jnp.ones((8, 4), jnp.float32), NamedSharding(mesh, PartitionSpec("x", None)))
    tx = fismo(0.02)
    state = tx.init({"a": w32})
    huge = {"a": jax.device_put(jnp.full((8, 4), 1e300), NamedSharding(mesh, PartitionSpec("x", None)))}
    try:
        tx.update(huge, state, {"a": w32})
        out["overflow_once_cast_on_the_mesh"] = None
    except ValueError as exc:
        out["overflow_once_cast_on_the_mesh"] = str(exc)

    # Gradients on a 2 x 4 mesh of the same devices beside a state on the 4 x 2 one, Auto axes, with blocks:
    # the directions were 0.89 off the one-device run, silently (a user's hunt, 2026-12-04). Refused now,
    # eagerly and under jax.jit, as optax.adamw refuses it on Explicit axes.
    auto = (AxisType.Auto,) * 2
    mesh_4x2, mesh_2x4 = jax.make_mesh((4, 2), ("x", "y"), axis_types=auto), jax.make_mesh((2, 4), ("x", "y"), axis_types=auto)
    tx = fismo(0.02, block_size=4)
    w = {"w": jax.device_put(jnp.asarray(host["w"]), NamedSharding(mesh_4x2, PartitionSpec("x", "y")))}
    state = tx.init(w)
    g_other = {"w": jax.device_put(jnp.asarray(grads[0]["w"]), NamedSharding(mesh_2x4, PartitionSpec("x", "y")))}
    for label, update in (("eager", tx.update), ("jit", jax.jit(tx.update))):
        try:
            update(g_other, state, w)
            out[f"gradient on another mesh, {label}"] = None
        except ValueError as exc:
            out[f"gradient on another mesh, {label}"] = str(exc)
    return out


def _core_state_on_another_device() -> dict[str, Any]:
    """A core state stepped on device 1, read back by ``FISMOState.from_dict`` for parameters on device 0
    (committed, and uncommitted on the default device): where its ``M`` lies, whether committed, and
    whether a step then runs (its error otherwise). Also from a torch CPU state (through DLPack)."""
    import jax
    import jax.numpy as jnp
    import torch

    from fismo_core import FISMO, FISMOState

    d0, d1 = jax.devices()[:2]
    opt = FISMO()
    rng = np.random.default_rng(3)
    W, G = rng.standard_normal((4, 3)), rng.standard_normal((4, 3))
    W1 = jax.device_put(jnp.asarray(W), d1)
    saved = opt.step(W1, jax.device_put(jnp.asarray(G), d1), opt.init(W1))[1].to_dict()
    from_torch = {k: torch.asarray(np.asarray(v)) if getattr(v, "ndim", 0) else v for k, v in saved.items()}
    out: dict[str, Any] = {}
    for name, d, like in [("committed", saved, jax.device_put(jnp.asarray(W), d0)),
                          ("uncommitted", saved, jnp.asarray(W)),
                          ("torch, committed to device 1", from_torch, jax.device_put(jnp.asarray(W), d1))]:
        try:
            state = FISMOState.from_dict(d, like=like)
            opt.step(like, jax.device_put(jnp.asarray(G), next(iter(like.devices()))) if like.committed
                     else jnp.asarray(G), state)
            out[name] = {"device": str(next(iter(state.M.devices()))), "committed": state.M.committed, "error": None}
        except Exception as exc:  # recorded: the test says which case failed and how
            out[name] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0]}"}
    return out


def _core_on_the_mesh() -> dict[str, Any]:
    """The core (``FISMO``, `fismo_core.linalg`), not the optax adapter, on arrays spread over the mesh,
    eagerly on Auto axes, against the same calls on one device (relative error), and `to_numpy` of such
    arrays. Until 2026-12-03 the state's arrays were made with the parameter's own sharding: ``init``
    raised ``IndexError`` (a 0-d counter) or ``IndivisibleError`` (a factor), two layouts of one mesh were
    "different devices", and ``to_numpy`` raised ``BufferError`` (DLPack exports one device)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import AxisType, NamedSharding, PartitionSpec

    from fismo_core import FISMO, linalg
    from fismo_core.testing import max_relative_error, to_numpy

    mesh = jax.make_mesh((4, 2), ("x", "y"), axis_types=(AxisType.Auto,) * 2)
    stack_mesh = jax.make_mesh((8,), ("b",), axis_types=(AxisType.Auto,))
    rng = np.random.default_rng(11)
    out: dict[str, Any] = {}
    cases = {  # name: (shape, mesh, layout, FISMO keywords)
        "matrix": ((16, 8), mesh, ("x", "y"), dict(weight_decay=0.1, nesterov=True)),
        "stack": ((8, 6, 4), stack_mesh, ("b",), dict(block_size=4)),
    }
    for name, (shape, on, spec, options) in cases.items():
        opt = FISMO(**options)
        W0, grads = rng.standard_normal(shape), [rng.standard_normal(shape) for _ in range(3)]
        paths = {}
        for where, place in (("mesh", lambda a: jax.device_put(jnp.asarray(a), NamedSharding(on, PartitionSpec(*spec)))),
                             ("one device", lambda a: jax.device_put(jnp.asarray(a), jax.devices()[0]))):
            try:
                W = place(W0)
                state = opt.init(W)
                for G in grads:
                    W, state = opt.step(W, place(G), state)
                paths[where] = to_numpy(W)
            except Exception as exc:  # recorded: the test names the case that failed and how
                paths[where] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
        ok = all(isinstance(p, np.ndarray) for p in paths.values())
        out[name] = (max_relative_error(paths["mesh"] - W0, paths["one device"] - W0) if ok
                     else {k: v for k, v in paths.items() if not isinstance(v, np.ndarray)})
    # W committed to device 1 and its gradient uncommitted (jnp.asarray of host data, as a data loader gives):
    # JAX's arithmetic takes it to device 1; the core refused it as "on another device" until 2026-12-03.
    W0, G = rng.standard_normal((6, 4)), rng.standard_normal((6, 4))
    opt = FISMO()
    try:
        W1 = jax.device_put(jnp.asarray(W0), jax.devices()[1])
        stepped, _ = opt.step(W1, jnp.asarray(G), opt.init(W1))
        alone, _ = opt.step(jnp.asarray(W0), jnp.asarray(G), opt.init(jnp.asarray(W0)))
        out["uncommitted gradient"] = max_relative_error(to_numpy(stepped), to_numpy(alone))
        out["uncommitted gradient, result on"] = str(next(iter(stepped.devices())))
    except Exception as exc:
        out["uncommitted gradient"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    # An array beta committed to another device than W: JAX raised "incompatible devices" inside line 7,
    # after the checks; now refused by them, before anything changes.
    W0 = jax.device_put(jnp.asarray(rng.standard_normal((6, 4))), jax.devices()[0])  # committed to device 0
    try:
        far = FISMO(beta=jax.device_put(jnp.asarray(0.9), jax.devices()[1]))
        far.step(W0, W0, far.init(W0))
        out["beta on another device"] = "accepted"
    except Exception as exc:
        out["beta on another device"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    A = rng.standard_normal((4, 16, 16))
    A = A @ np.swapaxes(A, -1, -2) / 16 + np.eye(16)
    sharded = jax.device_put(jnp.asarray(A), NamedSharding(mesh, PartitionSpec("x", None, "y")))
    for method in ("newton_schulz", "eigh"):
        try:
            got = to_numpy(linalg.inverse_sqrt(sharded, method=method))
            out[f"inverse_sqrt {method}"] = max_relative_error(got, to_numpy(linalg.inverse_sqrt(jnp.asarray(A),
                                                                                                  method=method)))
        except Exception as exc:
            out[f"inverse_sqrt {method}"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    return out


def _worker() -> None:
    """Every case on 8 host devices; prints ``{case: measurements}`` as one JSON line."""
    import jax

    jax.config.update("jax_enable_x64", True)
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, duration, **kw: COMPILES.append(event) if event.endswith("backend_compile_duration") else None
    )
    assert jax.device_count() == DEVICES, jax.devices()
    print(json.dumps({**{name: _run_case(name) for name in CASES}, "wrappers": _wrapper_executables(),
                      "numpy_gradients": _numpy_gradients(), "user_hunt": _user_hunt_cases(),
                      "core_state_on_another_device": _core_state_on_another_device(),
                      "core_on_the_mesh": _core_on_the_mesh()}))


@pytest.fixture(scope="module")
def results() -> dict[str, Any]:
    env = {
        **os.environ,
        "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={DEVICES}".strip(),
        "JAX_PLATFORMS": "cpu",
    }
    here = Path(__file__).resolve().parent
    code = f"import sys; sys.path.insert(0, {str(here)!r}); import test_jax_sharding; test_jax_sharding._worker()"
    try:
        run = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=WORKER_TIMEOUT_S
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(
            f"the 8-device worker did not finish in {WORKER_TIMEOUT_S} s. If its threads wait in "
            "lapack_*_ffi / jax::ParallelBatchMap, that is jaxlib's CPU LAPACK deadlock (page Backends, "
            f"section Sharding). Its stderr:\n{(exc.stderr or b'')[-4000:]!r}"
        )
    assert run.returncode == 0, f"the 8-device worker failed:\n{run.stderr[-6000:]}"
    return json.loads(run.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------ the tests
@pytest.mark.parametrize("case", CASES)
def test_sharded_trajectory_equals_single_device(results: dict[str, Any], case: str) -> None:
    errors = results[case]["errors"]
    assert len(errors) == STEPS
    assert max(errors) <= TRAJECTORY_TOLERANCE, errors


@pytest.mark.parametrize("case", CASES)
def test_updated_params_keep_their_sharding(results: dict[str, Any], case: str) -> None:
    got = results[case]
    assert got["params_kept_sharding"]
    expected = {k: list(spec) + [None] * (len(shape) - len(spec)) for k, (shape, spec) in LEAVES.items()}
    assert got["param_layouts"] == expected


def _expected_layout(case: str) -> dict[str, Any]:
    """EXPECTED_M and EXPECTED_BLOCKS for ``case``, in the worker's format (`_state_layout`)."""
    mesh_name, axis_type, options = CASES[case]
    block_size = options.get("block_size")
    out = {}
    for name in MATRICES:
        shape = LEAVES[name][0]
        m, n = shape[0], int(np.prod(shape[1:]))
        parts = {"M": EXPECTED_M[name]}
        for field, d, expected in zip(("P", "Q"), (m, n), EXPECTED_BLOCKS[mesh_name][name]):
            if block_size is None or d <= block_size:
                layout = [[None, None]]  # a full factor
            elif axis_type == "Auto":
                layout = [[None, None, None]] + ([[None, None]] if d % block_size else [])
            else:
                layout = [[None, None] if axis == "rest" else [axis, None, None] for axis in expected]
            parts[field] = parts[f"{field}_inv_sqrt"] = layout
        parts["counters"] = [[], [], []]  # step and the two counters: 0-d, replicated
        out[name] = parts
    return out


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("when", ["init_layout", "final_layout"])
def test_state_layout_is_the_documented_one(results: dict[str, Any], case: str, when: str) -> None:
    """After init and after the last step: M like its parameter, P, Q and roots as the docs say."""
    assert results[case][when] == _expected_layout(case)


@pytest.mark.parametrize("case", CASES)
def test_jitted_step_compiles_once(results: dict[str, Any], case: str) -> None:
    """The state keeps its layout, so the second and later steps reuse the first step's executable."""
    assert results[case]["compiles_after_first_step"] == 0
    assert results[case]["state_shardings_kept"]


def test_optax_wrappers_compile_once_with_their_counters_placed(results: dict[str, Any]) -> None:
    """backends.md: inject_hyperparams, MultiSteps and apply_if_finite make counters on the default device
    (two executables on a mesh, as optax.adamw alone); placed after init as the page shows, one. And eager
    updates of inject_hyperparams(fismo) compile nothing after the first step (they compiled at every step),
    with beta scheduled too (until 2026-12-02 an array beta's programs were built for each update, about
    2 s a step on 8 host devices: found by a user's hunt)."""
    assert results["wrappers"] == {"inject_hyperparams": 1, "MultiSteps": 1, "apply_if_finite": 1,
                                   "eager inject_hyperparams, compilations after the first step": 0,
                                   "eager inject_hyperparams, beta scheduled, compilations after the first step": 0}


def test_eager_update_on_a_mesh_with_numpy_gradients(results: dict[str, Any]) -> None:
    """NumPy (or one-device) gradients for sharded params, eagerly, as optax.adamw takes them: the mesh
    path was chosen from the gradient's placement, and the core saw the state's shardings beside a
    one-device gradient (ValueError "one device"). The same update as on one device (eager against eager
    on other layouts: float64 rounding, bound 1e-12), laid out like the params (the conv kernel's matrix
    form is not its shape: replicated there)."""
    out = results["numpy_gradients"]
    assert out["error"] <= 1e-12, out
    assert out["laid_out_like_params"]["w"], out


def test_eager_update_on_a_mesh(results: dict[str, Any]) -> None:
    """Without jax.jit around the step: the same updates as on one device, laid out like the params."""
    got = results[EAGER_CASE]
    assert got["eager_error"] <= TRAJECTORY_TOLERANCE
    assert got["eager_updates_kept_sharding"]


def test_bare_directions_are_laid_out_like_the_gradients(results: dict[str, Any]) -> None:
    """``jax.jit(scale_by_fismo().update)``: the directions come back laid out like the gradients."""
    assert results[EAGER_CASE]["bare_directions_like_gradients"] == {k: True for k in BARE_LEAVES}


def test_jitted_init_layout(results: dict[str, Any]) -> None:
    """``jax.jit(tx.init)`` lays the state out as an eager init does.

    On Auto axes the kernel's ``M`` is left out: there XLA lays it out as it reshapes the kernel.
    """
    assert results["explicit-4x2-blocks"]["jit_init_layout"] == _expected_layout("explicit-4x2-blocks")
    auto, expected = results["auto-4x2-blocks"]["jit_init_layout"], _expected_layout("auto-4x2-blocks")
    for name in MATRICES:
        if len(LEAVES[name][0]) > 2:
            auto[name].pop("M"), expected[name].pop("M")
    assert auto == expected


def test_a_beta_schedule_on_explicit_axes_equals_single_device(results: dict[str, Any]) -> None:
    """``inject_hyperparams(fismo, ...)(beta=schedule)`` (backends.md's momentum warm-up) and a replicated
    array ``beta``, jitted and eager, on Explicit axes: the core ran in the Auto-axes context of its
    layout with ``beta`` read from the closure, typed by the Explicit mesh, and JAX refused the mix."""
    got = results["user_hunt"]
    for case in ("beta_schedule", "beta_array"):
        assert max(got[case].values()) <= TRAJECTORY_TOLERANCE, got[case]


def test_an_eager_update_takes_one_device_gradients_beside_sharded_ones(results: dict[str, Any]) -> None:
    """One leaf's gradient committed to one device, the other's on the mesh: the finiteness check stacked
    flags of both ("incompatible devices"). Eager against eager on other layouts: float64 rounding, 1e-12."""
    assert results["user_hunt"]["one_device_gradient_beside_the_mesh"] <= 1e-12


def test_an_eager_update_on_a_mesh_handles_a_failed_root_as_on_one_device(results: dict[str, Any]) -> None:
    """A root that fails its check, eagerly, on the mesh: the warning, the fallback (finite updates, the
    counter), the error past ``max_failures``, as on one device (the step was jitted whole, NaN)."""
    faults = results["user_hunt"]["failed_root_eagerly"]
    mesh, one = faults["mesh, max_failures=10"], faults["one device, max_failures=10"]
    assert mesh["root_failures"] == one["root_failures"] == 1, faults
    assert mesh["warnings"] == one["warnings"] and mesh["warnings"], faults
    assert all(w.startswith("leaf ['w']: FISMO: the inverse") for w in mesh["warnings"]), faults
    assert np.all(np.isfinite(mesh["update"])) and mesh["laid_out_like_param"], faults
    # The direction is taken again on one device, eagerly, as there: line 9 on the mesh rounds otherwise.
    assert max_relative_error_of(mesh["update"], one["update"]) <= 1e-12, faults
    # Past max_failures: the error, and the warning before it (dropped until 2026-12-02, both layouts).
    raised = {where: faults[f"{where}, max_failures=0"] for where in ("mesh", "one device")}
    assert set(raised["mesh"]) == {"error", "warnings"} and raised["mesh"] == raised["one device"], faults
    assert raised["mesh"]["warnings"], faults
    assert faults["mesh, max_failures=0"]["error"].startswith("leaf ['w']: FISMO: the inverse"), faults
    for max_failures in (10, 0):  # inside the caller's jax.set_mesh(mesh), as outside
        key = f"mesh{{}}, max_failures={max_failures}"
        assert faults[key.format(" inside set_mesh")] == faults[key.format("")], faults


def test_vmap_of_init_over_an_ensemble_on_a_mesh(results: dict[str, Any]) -> None:
    """``jax.vmap(tx.init)`` on a mesh: optax's step counts are constants under vmap, and placing them beside
    the params read the sharding of a vmap tracer (AttributeError). Both axis types, inside jax.set_mesh."""
    for axis_type, shapes in results["user_hunt"]["vmap_init"].items():
        assert [3, 16, 8] in shapes, (axis_type, shapes)  # M, one per member of the ensemble (JSON: lists)


def test_every_init_on_a_mesh_warns_of_a_thin_leaf(results: dict[str, Any]) -> None:
    """Two fresh transformations' ``init`` of a ``(1, 2000)`` leaf on the mesh: one `FactorSizeWarning` each,
    naming the leaf, as ``FISMO.init`` on one device (the second was silent: the compiled init's cache)."""
    counts = results["user_hunt"]["factor_size_warnings"]
    assert [len(c) for c in counts] == [1, 1], counts
    assert all(c[0].startswith("FISMO: leaf ['cls'] (shape (1, 2000))") for c in counts), counts


def max_relative_error_of(a: Any, b: Any) -> float:
    from fismo_core.testing import max_relative_error

    return max_relative_error(np.asarray(a), np.asarray(b))


def test_an_eager_update_on_a_mesh_refuses_a_gradient_that_overflows_the_states_dtype(results: dict[str, Any]) -> None:
    """A float64 gradient of 1e300 for a float32 leaf on a 4x2 mesh: the one-device ``ValueError``, naming the
    leaf and the cast, where it was zeroed without a word (a user's hunt, 2026-12-02)."""
    message = results["user_hunt"]["overflow_once_cast_on_the_mesh"]
    assert message is not None and message.startswith(
        "the gradient of leaf ['a'] (shape (8, 4)) contains 0 NaN and 32 infinite values (of 32 entries) once cast "
        "from float64 to the state's dtype float32"), message


@pytest.mark.parametrize("label", ["eager", "jit"])
def test_a_gradient_on_another_mesh_than_its_state_is_refused(results: dict[str, Any], label: str) -> None:
    """Gradients on a 2 x 4 mesh beside a state on a 4 x 2 mesh of the same 8 devices (Auto axes, blocks of 4):
    the directions were up to 0.89 off the one-device run, silently (a user's hunt, 2026-12-04)."""
    message = results["user_hunt"][f"gradient on another mesh, {label}"]
    assert message is not None and message.startswith(
        "leaf ['w'] (gradient of shape (16, 8)): the gradient is laid out on a mesh (x=2 x y=4) other than its "
        "state's (x=4 x y=2)"), message


def test_a_state_resumed_from_a_host_copy_is_laid_out_as_init_lays_it_out(results: dict[str, Any]) -> None:
    """On Explicit axes the step's outputs took the incoming state's layout: a state from ``jax.device_get``
    came back with ``M`` replicated (found by a user's hunt). They take init's layout, read from the
    gradient's type: ``M`` like the leaf."""
    assert results["user_hunt"]["resumed_from_host_M"] == {"eager": ["x", "y"], "jit": ["x", "y"]}


def test_from_dict_moves_a_state_to_the_parameters_device(results: dict[str, Any]) -> None:
    """``FISMOState.from_dict`` says it moves the arrays to ``like``'s device: a JAX state committed to device 1
    stayed there (``xp.asarray(x, device=...)`` does not move it), and raised JAX's "incompatible devices"
    (committed ``like``) or the step's "one device" error (uncommitted; a user's hunt, 2026-12-03). Now on
    ``like``'s device, uncommitted where ``like`` is."""
    got = results["core_state_on_another_device"]
    assert got == {
        "committed": {"device": "cpu:0", "committed": True, "error": None},
        "uncommitted": {"device": "cpu:0", "committed": False, "error": None},
        "torch, committed to device 1": {"device": "cpu:1", "committed": True, "error": None},
    }, got


#: The eager core on the mesh against one device, float64: XLA sums the split products in another order
#: (the trajectory tolerance's reasoning above); the inverse roots are one call, no trajectory.
@pytest.mark.parametrize("case", ["matrix", "stack", "inverse_sqrt newton_schulz", "inverse_sqrt eigh",
                                  "uncommitted gradient"])
def test_the_core_steps_eagerly_on_a_mesh(results: dict[str, Any], case: str) -> None:
    got = results["core_on_the_mesh"][case]
    assert isinstance(got, float), got
    assert got <= TRAJECTORY_TOLERANCE, got
    if case == "uncommitted gradient":
        assert results["core_on_the_mesh"]["uncommitted gradient, result on"] == "cpu:1"  # W's device


def test_an_array_beta_on_another_device_is_refused_by_the_checks(results: dict[str, Any]) -> None:
    assert results["core_on_the_mesh"]["beta on another device"] == (
        "ValueError: beta lives on cpu:1 but the gradient and the state on cpu:0: put beta on their device "
        "(or pass a number)")


@pytest.mark.parametrize("spec", [(), ("x", None), (None, "x")], ids=["replicated", "rows", "columns"])
@pytest.mark.parametrize("jitted", [False, True], ids=["eager", "jit"])
def test_a_one_device_mesh_with_explicit_axes(spec: tuple, jitted: bool) -> None:
    """``jax.make_mesh((1,), ("x",))`` (Explicit axes: mesh-ready code run on one device), in this process's
    one device: a leaf laid out along the axis made ``update`` raise ``ShardingTypeError`` ("illegally
    sharded result"), eagerly and under jit, where optax.adamw ran (a user's hunt, 2026-12-04: the
    adapter took a one-device mesh for no mesh). Equal to the same leaf as a plain array (float64; the
    compiled and the op-by-op step round differently: bound 1e-12; measured 6.8e-17 eagerly, 0 under jit),
    its layout kept."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import AxisType, NamedSharding, PartitionSpec

    from fismo_core.backends.optax import fismo

    mesh = jax.make_mesh((1,), ("x",), axis_types=(AxisType.Explicit,))
    W = jax.random.normal(jax.random.key(0), (16, 12), dtype=jnp.float64)
    tx = fismo(0.02, block_size=8, inv_root={"every": 2}, weight_decay=0.1)
    placed = {"w": jax.device_put(W, NamedSharding(mesh, PartitionSpec(*spec)))}
    plain = {"w": W}

    def run(params: dict) -> dict:
        state = tx.init(params)
        update = jax.jit(tx.update) if jitted else tx.update
        for step in range(3):
            grads = jax.tree.map(lambda w: jnp.sin(w * (step + 1)), params)
            updates, state = update(grads, state, params)
            params = jax.tree.map(lambda w, u: w + u, params, updates)
        return params

    with jax.set_mesh(mesh):
        on_mesh = run(placed)
    reference = run(plain)
    assert on_mesh["w"].sharding.is_equivalent_to(NamedSharding(mesh, PartitionSpec(*spec)), 2)
    error = float(jnp.linalg.norm(on_mesh["w"] - reference["w"]) / jnp.linalg.norm(reference["w"]))
    assert error <= 1e-12, error
