"""FISMO as an optax ``GradientTransformation``.

``fismo(learning_rate, ...)`` returns a real :class:`optax.GradientTransformation`
(``init``, ``update``): updates are the *negative*, learning-rate-scaled FISMO
directions, so ``optax.apply_updates(params, updates)`` performs line 9 of
Algorithm 1. The algorithm itself is the core's
(:meth:`fismo_core.FISMO.direction`); this module only routes pytree leaves
and reshapes them.

Which leaves FISMO optimizes
----------------------------
* Leaves with ``ndim >= 2`` and at least one entry ("matrix leaves") use FISMO. A leaf of more than
  two dimensions is optimized as the matrix ``matrix_shape(leaf.shape)``,
  by default ``(shape[0], prod(shape[1:]))``: the leading axis is the output
  axis, as in Muon's handling of PyTorch ``(out, in, kh, kw)`` convolution
  kernels. Flax kernels put the output axis last (``Dense``: ``(in, out)``,
  ``Conv``: ``(kh, kw, in, out)``); pass
  ``matrix_shape=lambda s: (math.prod(s[:-1]), s[-1])`` for those (a kernel with several
  output axes, attention's ``(in, heads, head_dim)``, needs a rule that knows them).
* Other leaves (biases, norm scales, scalars) go to ``non_matrix``: by default
  ``optax.adamw`` with the same ``learning_rate`` (schedule included),
  ``b1=0.9``, ``b2=0.999``, ``eps=1e-8`` and no weight decay, which is the rule
  of ``optax.contrib.muon``; ``"error"`` refuses them; any other
  ``GradientTransformation`` is used as given on those leaves only.
* ``matrix_mask`` (a pytree of booleans like the params, or a function of the
  params returning one) overrides that rule: ``False`` sends a
  matrix (an embedding, an output head) to ``non_matrix``.

Each matrix leaf keeps its own :class:`fismo_core.FISMOState` (``flax.nnx.Optimizer``,
which hands it back as an ``nnx.State`` of its fields, works too). Everything is
traceable: ``jax.jit(tx.update)`` compiles once and does not retrace.

Sharded leaves
--------------
A leaf laid out by a ``NamedSharding`` over a mesh of several devices gets a
state laid out by one rule (``_state_specs``; page "Backends", section
"Sharding"): ``M`` like the parameter (in its matrix form), full factors and
their roots replicated, on Explicit mesh axes the blocks of a block-diagonal
factor split along the block axis as the parameter splits that side (where
that divides evenly), the counters replicated. ``update`` keeps that layout
and lays the directions out like the gradients, so a jitted step compiles
once and the params keep their sharding.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import math
import numbers
import warnings
from collections.abc import Callable, Mapping
from typing import Any, Literal, NamedTuple, Optional, Union

try:
    import jax
    import jax.numpy as jnp
    import optax
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(f"fismo_core.backends.optax needs JAX and optax: pip install jax optax ({exc})") from exc

import numpy as np
from jax.experimental.shard_alike import shard_alike
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from fismo_core import optimizer as _fismo  # the rules every adapter shares, looked up at each call
from fismo_core import guards as _guards
from fismo_core.guards import InverseRootWarning, check_beta_library, check_matrix, foreign_keywords, read_faults
from fismo_core.kronecker import Blocks
from fismo_core import linalg
from fismo_core.linalg import MUON_COEFFICIENTS
from fismo_core.optimizer import (
    FISMO, TRAINING, FISMOState, InverseRootConfig, InverseRootError, PolarConfig, check_muon_polar,
    training_options,
)

__all__ = ["ScaleByFismoState", "default_matrix_shape", "fismo", "fismo_training", "scale_by_fismo"]

MatrixShape = Callable[[tuple[int, ...]], tuple[int, int]]


default_matrix_shape: MatrixShape = _fismo.matrix_shape
"""The core's rule, [`matrix_shape`][fismo_core.optimizer.matrix_shape]: ``(shape[0], prod(shape[1:]))``.

The leading axis is the output axis (Muon's conv rule), as in the torch adapter.
"""

#: The core's hyperparameter defaults, which the signatures below repeat by reference.
_DEFAULTS = FISMO()


def _python_settings(factory: str, settings: dict[str, Any], beta: Any, *, takes_learning_rate: bool = True) -> None:
    """Refuse a JAX array among ``factory``'s numeric settings, naming the one way to use ``optax.inject_hyperparams``,
    and a ``beta`` that is an array of another library (the core would refuse it at the first update).

    FISMO's settings are Python values, checked once when the transformation is built (a
    traced value cannot be); ``beta`` alone may be an array (line 7 reads it at every step), so
    it is not among ``settings``. ``optax.inject_hyperparams`` passes every numeric argument not in
    its ``static_args`` as an array, and calls every callable one as a schedule (hence the
    ``None`` defaults of ``polar``, ``inv_root`` and ``matrix_shape``, which it passes through).
    """
    check_beta_library(beta, jax.Array, factory, "a 0-d JAX array")
    for name, value in settings.items():
        if isinstance(value, jax.Array):
            which, names = ("all but the learning rate", "[1:]") if takes_learning_rate else ("all", "")
            raise TypeError(
                f"{factory}: {name} must be a Python number, got a JAX array: FISMO's settings other than beta are "
                "checked once, when the transformation is built, and cannot be scheduled. optax.inject_hyperparams "
                f"passes every numeric argument not in static_args as an array; keep {which} static (beta may be "
                f"left out of them, to schedule it): optax.inject_hyperparams({factory}, "
                f"static_args=tuple(inspect.signature({factory}).parameters){names})"
            )


#: optax.contrib.muon's keywords for what is not FISMO's here: the AdamW of the other leaves, the leaves' layout.
_MUON = "optax.contrib.muon"
_OPTAX_MUON_NOTES = {
    **{
        f"adam_{name}": (
            _MUON, f"the other leaves' AdamW: fismo(..., non_matrix=optax.adamw(learning_rate, {name}=...))"
        )
        for name in ("b1", "b2", "eps_root", "weight_decay")
    },
    "adam_learning_rate": (_MUON, "the other leaves' AdamW: fismo(..., non_matrix=optax.adamw(...))"),
    "weight_decay_mask": (_MUON, "weight_decay applies to the FISMO (matrix) leaves only; matrix_mask= chooses them"),
    "muon_weight_dimension_numbers": (
        _MUON, "matrix_shape= (the matrix (m, n) a leaf is optimized as) and matrix_mask= (which leaves)"
    ),
    "weight_dimension_numbers": (_MUON, "matrix_shape= (the matrix (m, n) a leaf is optimized as)"),
}


class ScaleByFismoState(NamedTuple):
    """State of :func:`scale_by_fismo`: one :class:`fismo_core.FISMOState` per matrix leaf."""

    states: Any


def _matrix_dims(shape: tuple[int, ...], matrix_shape: MatrixShape) -> tuple[int, int]:
    """The matrix ``(m, n)`` a leaf of ``shape`` is optimized as: itself if 2-D, else ``matrix_shape(shape)``."""
    if len(shape) == 2:
        return shape[0], shape[1]
    returned = matrix_shape(shape)
    dims: tuple[Any, ...]
    try:
        dims = tuple(returned)
    except TypeError:
        dims = (returned,)
    if len(dims) != 2 or not all(isinstance(d, numbers.Integral) and not isinstance(d, bool) and int(d) > 0
                                 for d in dims):
        raise ValueError(f"matrix_shape{shape} returned {returned!r}; it must return two positive integers (m, n)")
    m, n = (int(d) for d in dims)
    if m * n != math.prod(shape):
        raise ValueError(f"matrix_shape{shape} returned ({m}, {n}), which does not have {math.prod(shape)} elements")
    return m, n


def _checked_matrix_shape(matrix_shape: Optional[MatrixShape]) -> MatrixShape:
    """``matrix_shape`` as given (`default_matrix_shape` for ``None``), refused when built unless it can be called:
    ``matrix_shape=5`` was accepted and raised ``'int' object is not callable`` at ``init``, naming no leaf."""
    if matrix_shape is None:
        return default_matrix_shape
    if not callable(matrix_shape):
        raise TypeError(
            f"matrix_shape must be None or a function of a leaf's shape returning (m, n), got {matrix_shape!r}"
        )
    return matrix_shape


def _as_matrix(x: Any, matrix_shape: MatrixShape) -> Any:
    if x.ndim == 2:
        return x
    return jnp.reshape(x, _matrix_dims(tuple(x.shape), matrix_shape))


# ------------------------------------------------------------------ sharding
# A leaf on a mesh of several devices (a NamedSharding) keeps its FISMO state laid out by one rule,
# `_state_specs`, documented on the page "Backends" (section "Sharding"). Placement happens inside a
# trace (the caller's jax.jit or the adapter's own): on Auto mesh axes by sharding constraints, on
# Explicit ones by jax.sharding.auto_axes around the core (whose matrix products and reshapes do not
# type-check on explicitly sharded operands) with the layout as its out_sharding.


def _mesh(x: Any) -> Optional[Any]:
    """The (abstract) mesh ``x`` is laid out on if it spans more than one device or has Explicit axes, else
    ``None``.

    Read from ``x``'s type, so it is known for a concrete array and under ``jax.jit`` alike. A one-device
    mesh with Explicit axes (``jax.make_mesh((1,), ...)``, mesh-ready code on one GPU) is a mesh: its
    axes are in the arrays' types, and the core's products raised ``ShardingTypeError`` outside
    ``auto_axes`` ("illegally sharded result").
    """
    mesh = jax.typeof(x).sharding.mesh
    return None if mesh.empty or (mesh.size == 1 and not _is_explicit(mesh)) else mesh


def _check_one_mesh(g: Any, s: FISMOState) -> None:
    """Refuse a gradient laid out on another mesh than its state's ``M`` (eagerly and under ``jax.jit``).

    A gradient on a 2 x 4 mesh beside a state on a 4 x 2 mesh of the same devices gave, with blocks on Auto
    axes, directions 0.89 off the one-device run, silently (a user's hunt, 2026-12-04); ``optax.adamw``
    refuses such inputs on Explicit axes ("Mesh for all inputs should be equal"). A gradient on one device
    (or a NumPy one) beside a state on a mesh is not refused: `_beside_state` lays it out like ``M``.
    """
    g_mesh, s_mesh = _mesh(g), _mesh(s.M)
    if g_mesh is not None and s_mesh is not None and g_mesh != s_mesh:
        def axes(mesh: Any) -> str:
            return " x ".join(f"{name}={size}" for name, size in zip(mesh.axis_names, mesh.axis_sizes))

        raise ValueError(
            f"the gradient is laid out on a mesh ({axes(g_mesh)}) other than its state's ({axes(s_mesh)}): put "
            "the gradients on the parameters' mesh (the mesh tx.init was given), e.g. jax.device_put(g, "
            "NamedSharding(param_mesh, spec))"
        )


def _is_explicit(mesh: Any) -> bool:
    """Whether ``mesh`` has Explicit axes (``jax.make_mesh``'s default in JAX 0.10), whose layout is in the types."""
    return AxisType.Explicit in tuple(mesh.axis_types)


def _is_spec(x: Any) -> bool:
    return isinstance(x, PartitionSpec)


def _factor_spec(structure: Any, mesh: Any, side_axes: Any) -> Union[PartitionSpec, Blocks]:
    """The layout of one side's factor (``P``, ``Q`` or a root), part by part (the structure's ``parts``).

    A single matrix (a full factor, or the remainder block ``(r, r)``):
    replicated, since an inverse root needs all of it on one device. A stack
    of blocks ``(k, B, B)`` that tiles the side exactly (``k B = d``): split
    along the block axis as the parameter splits that side (``side_axes``:
    the mesh axes of the rows for ``P``, of the columns for ``Q``) when that
    split divides ``k``; each device then holds the blocks of the rows (or
    columns) it holds, so the blocks' products with ``G`` and their roots stay
    on it. Otherwise replicated.
    """
    shapes = structure.part_shapes()
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))

    def part_spec(shape: tuple[int, ...]) -> PartitionSpec:
        if len(shape) == 3 and len(shapes) == 1 and side_axes is not None:
            names = (side_axes,) if isinstance(side_axes, str) else tuple(side_axes)
            if shape[0] % math.prod(sizes[name] for name in names) == 0:
                return PartitionSpec(side_axes)
        return PartitionSpec()

    return structure.from_parts(tuple(part_spec(shape) for shape in shapes))


def _merged_axes(entries: tuple[Any, ...], sizes: tuple[int, ...]) -> Any:
    """The mesh axes of one dimension made by merging ``sizes`` row-major (a reshape).

    The merged dimension is split like its leading dimension (of size > 1)
    if no later one is split, and not split otherwise (its shards would not
    be contiguous).
    """
    kept = [entry for entry, size in zip(entries, sizes) if size > 1]
    if not kept or any(entry is not None for entry in kept[1:]):
        return None
    return kept[0]


def _matrix_spec(spec: PartitionSpec, shape: tuple[int, ...], matrix_shape: MatrixShape) -> PartitionSpec:
    """The layout of a leaf's matrix form ``(m, n)`` given the leaf's ``spec``: that of ``M``.

    A matrix leaf: its own. A leaf of more dimensions whose rows are its
    leading dimensions (``m = prod(shape[:k])``, as `default_matrix_shape`
    and the Flax rule give): each side by `_merged_axes`. Any other
    ``matrix_shape``: replicated.
    """
    entries = tuple(spec) + (None,) * (len(shape) - len(spec))
    if len(shape) == 2:
        return PartitionSpec(*entries)
    m, _ = _matrix_dims(shape, matrix_shape)
    for k in range(1, len(shape)):
        if math.prod(shape[:k]) == m:
            return PartitionSpec(_merged_axes(entries[:k], shape[:k]), _merged_axes(entries[k:], shape[k:]))
    return PartitionSpec()


def _state_specs(core: FISMO, mesh: Any, m: int, n: int, M_spec: Optional[PartitionSpec]) -> FISMOState:
    """The layout of a FISMO state of an ``m x n`` matrix on ``mesh`` (page "Backends", "Sharding").

    ``M``: ``M_spec``, the parameter's layout in its matrix form
    (`_matrix_spec`). ``P``, ``Q`` and their roots: `_factor_spec`, with the
    mesh axes of ``M``'s rows and columns. ``step`` and the counters:
    replicated. ``M_spec=None`` (Auto axes: the parameter's layout is not in
    the types, so a traced step cannot read it): ``M`` is left to
    `_place_state` and the blocks are replicated like the rest.
    """
    rows, cols = (None, None) if M_spec is None else (*tuple(M_spec), None, None)[:2]
    left, right = core.structures(m, n)
    P_spec, Q_spec = _factor_spec(left, mesh, rows), _factor_spec(right, mesh, cols)
    replicated = PartitionSpec()
    return FISMOState(
        P=P_spec, Q=Q_spec, M=M_spec, P_inv_sqrt=P_spec, Q_inv_sqrt=Q_spec,
        step=replicated, skipped=replicated, root_failures=replicated,
    )


def _shardings(mesh: Any, specs: Any) -> Any:
    """``specs`` (a pytree of ``PartitionSpec``) as ``NamedSharding`` over ``mesh``."""
    return jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs, is_leaf=_is_spec)


def _place_state(
    state: FISMOState, mesh: Any, M_like: Any, M_spec: Optional[PartitionSpec] = None
) -> FISMOState:
    """``state`` laid out on ``mesh``'s Auto axes (traced), as `_state_specs` says for ``M_spec=None``.

    The factors and the counters are constrained to be replicated. ``M``:
    ``M_spec`` if given (an eager ``init`` reads the parameter's); otherwise
    XLA lays it out like ``M_like`` (the parameter in ``init``, the incoming
    ``M`` in ``update``), with ``shard_alike``.
    """
    replicated = NamedSharding(mesh, PartitionSpec())
    placed = jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, replicated), state._replace(M=None))
    if M_spec is not None:
        M = jax.lax.with_sharding_constraint(state.M, NamedSharding(mesh, M_spec))
    else:
        M, _ = shard_alike(state.M, M_like)
    return placed._replace(M=M)


def _replicated(x: Any, like: Any) -> Any:
    """``x`` replicated over the mesh of ``like`` (a leaf on a mesh); concrete or traced.

    A concrete ``x`` beside a traced ``like`` (``jax.vmap(tx.init)``: optax's counts are constants there) is
    left as it is: the transformation lays out its outputs itself.
    """
    if isinstance(like, jax.core.Tracer) and not isinstance(x, jax.core.Tracer):
        return x
    if isinstance(x, jax.core.Tracer):
        mesh = jax.typeof(like).sharding.mesh
        sharding = NamedSharding(mesh, PartitionSpec())
        if _is_explicit(mesh):
            return jax.sharding.reshard(x, sharding)
        return jax.lax.with_sharding_constraint(x, sharding)
    return jax.device_put(x, NamedSharding(like.sharding.mesh, PartitionSpec()))


class _LeafPrograms(NamedTuple):
    """What `scale_by_fismo` runs per leaf, for one core and one ``matrix_shape`` (`_leaf_programs`)."""

    leaf_direction: Callable[..., tuple[Any, FISMOState]]
    init_on_mesh: Callable[..., FISMOState]
    update_on_mesh: Callable[..., tuple[Any, FISMOState]]
    checked_update_on_mesh: Callable[..., tuple[Any, FISMOState, Any]]


@functools.lru_cache(maxsize=64)
def _leaf_programs(core: FISMO, matrix_shape: MatrixShape) -> _LeafPrograms:
    """`scale_by_fismo`'s per-leaf functions, built once per (core, ``matrix_shape``).

    ``optax.inject_hyperparams`` builds the transformation again at every
    ``update``; new ``jax.jit`` objects would then compile the eager mesh
    programs again at every step. A core is a frozen dataclass: equal
    hyperparameters share them. Each function takes an array ``beta`` (a
    schedule) as its last argument, ``None`` for the core's own number:
    the programs of an array ``beta`` are built for a core with a number in
    its place (`scale_by_fismo`), so that they too are built once.
    """
    every = core.inv_root.every

    def _with_beta(beta: Any) -> FISMO:
        return core if beta is None else dataclasses.replace(core, beta=beta)

    def _direction(G: Any, s: Any, core: FISMO) -> tuple[Any, Any]:
        if every == 1:
            return core.direction(G, s)
        # InverseRootConfig.every > 1: eager, the step count decides in Python; under jit it is traced
        # (recognised without asking it, see linalg._host_bool) and lax.cond decides.
        if isinstance(s.step, jax.core.Tracer):
            # The branches' states must agree in type: the step becomes an int32 array in both.
            s = s._replace(step=jnp.asarray(s.step, dtype=jnp.int32))
            return jax.lax.cond(
                core.inv_root.is_refresh_step(s.step),
                lambda: core.direction(G, s, refresh_roots=True),
                lambda: core.direction(G, s, refresh_roots=False),
            )
        return core.direction(G, s, refresh_roots=core.inv_root.is_refresh_step(int(s.step)))

    def leaf_direction(g: Any, s: FISMOState, beta: Any = None) -> tuple[Any, FISMOState]:
        """One leaf's direction (shaped and typed like ``g``) and new state; ``beta``, if given, in place of
        the core's."""
        d, s = _direction(_as_matrix(g, matrix_shape), s, _with_beta(beta))
        return jnp.reshape(d, g.shape).astype(g.dtype), s

    def init_on_mesh(p: Any, name: str, spec: Optional[PartitionSpec]) -> FISMOState:
        """`FISMO.init` for a leaf on a mesh, laid out by `_state_specs`; ``spec`` is the leaf's if known."""
        mesh = _mesh(p)

        def build(p: Any) -> FISMOState:
            # On a mesh the step count is an int32 array from the start, placed with the rest: a
            # Python int would be placed by the first jitted step, and the second would compile again.
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", _guards.FactorSizeWarning)  # `warned_init_on_mesh` issues it
                return core.init(_as_matrix(p, matrix_shape), name=name)._replace(step=jnp.zeros((), jnp.int32))

        M_spec = None if spec is None else _matrix_spec(spec, tuple(p.shape), matrix_shape)
        if _is_explicit(mesh):
            m, n = _matrix_dims(tuple(p.shape), matrix_shape)
            out = _shardings(mesh, _state_specs(core, mesh, m, n, M_spec))
            return jax.sharding.auto_axes(build, out_sharding=out)(p)
        return _place_state(build(p), mesh, M_like=_as_matrix(p, matrix_shape), M_spec=M_spec)

    def laid_out(step: Callable[..., tuple], g: Any, s: FISMOState, beta: Any, flags: int = 0) -> tuple:
        """``step(g, s, beta)`` for a leaf on a mesh: the direction laid out like ``g``, the state as init lays
        it out, and the ``flags`` more arrays ``step`` returns (fault flags) replicated."""
        mesh = _mesh(g)
        assert mesh is not None  # called for the leaves on a mesh only
        if _is_explicit(mesh):
            # The state as init lays it out, from the gradient's layout (the leaf's, in the types): also a
            # state that comes from elsewhere (a host copy: replicated) leaves laid out as init's.
            spec = jax.typeof(g).sharding.spec
            m, n = _matrix_dims(tuple(g.shape), matrix_shape)
            specs = _state_specs(core, mesh, m, n, _matrix_spec(spec, tuple(g.shape), matrix_shape))
            out = (NamedSharding(mesh, spec), _shardings(mesh, specs), *[NamedSharding(mesh, PartitionSpec())] * flags)
            # An array beta (a schedule) is typed by its own layout, Explicit axes included: it enters the
            # Auto-axes computation as an argument (retyped there, as g and s are), not from a closure.
            return jax.sharding.auto_axes(step, out_sharding=out)(*((g, s) if beta is None else (g, s, beta)))
        d, s_new, *more = step(g, s, beta)
        return (shard_alike(d, g)[0], _place_state(s_new, mesh, M_like=s.M), *more)

    def update_on_mesh(g: Any, s: FISMOState, beta: Any = None) -> tuple[Any, FISMOState]:
        """`leaf_direction` for a leaf on a mesh, laid out (`laid_out`)."""
        return laid_out(leaf_direction, g, s, beta)

    def checked_update_on_mesh(g: Any, s: FISMOState, beta: Any = None) -> tuple[Any, FISMOState, Any]:
        """`update_on_mesh` at a step whose roots are recomputed and checked, eagerly: also the roots'
        fault flag (`FISMO.direction_with_faults`), for `scale_by_fismo` to read. Where it is not set,
        the direction and state are `update_on_mesh`'s, bit for bit."""

        def step(g: Any, s: FISMOState, beta: Any = None) -> tuple[Any, FISMOState, Any]:
            result = _with_beta(beta).direction_with_faults(_as_matrix(g, matrix_shape), s, refresh_roots=True)
            return jnp.reshape(result.direction, g.shape).astype(g.dtype), result.state, result.faults.roots

        return laid_out(step, g, s, beta, flags=1)

    # Compiled once per leaf shape and layout; inside the caller's jax.jit they are inlined. Eagerly the
    # core cannot run on a mesh op by op: its factors and M live on different shardings, which it
    # reads as different devices.
    compiled_init_on_mesh = jax.jit(init_on_mesh, static_argnames=("name", "spec"), keep_unused=True)

    def warned_init_on_mesh(p: Any, name: str, spec: Optional[PartitionSpec]) -> FISMOState:
        """`init_on_mesh`, with its `FactorSizeWarning` issued at every call, as `FISMO.init` issues it on one
        device (from inside the compiled program it came at its first trace only)."""
        _guards.check_factor_size(*_matrix_dims(tuple(p.shape), matrix_shape), core.block_size, name)
        return compiled_init_on_mesh(p, name=name, spec=spec)

    return _LeafPrograms(
        leaf_direction,
        warned_init_on_mesh,
        jax.jit(update_on_mesh),
        jax.jit(checked_update_on_mesh),
    )


@foreign_keywords("fismo_core.backends.optax.scale_by_fismo", notes=_OPTAX_MUON_NOTES)
def scale_by_fismo(
    beta: Union[float, jax.Array] = _DEFAULTS.beta,
    gamma: float = _DEFAULTS.gamma,
    mu: float = _DEFAULTS.mu,
    *,
    polar: Union[PolarConfig, str, dict, None] = None,
    inv_root: Union[InverseRootConfig, str, dict, None] = None,
    nesterov: bool = _DEFAULTS.nesterov,
    statistics: Literal["printed", "scale_invariant"] = _DEFAULTS.statistics,
    matrix_shape: Optional[MatrixShape] = None,
    block_size: Optional[int] = _DEFAULTS.block_size,
) -> optax.GradientTransformation:
    """FISMO's direction ``dW_t`` (lines 4-8 of Algorithm 1) for every leaf: not negated, not scaled.

    Every leaf must have ``ndim >= 2``; use :func:`fismo` for a whole model.
    The arguments are `fismo`'s (``None``: the core's ``polar`` and
    ``inv_root``, `default_matrix_shape`).
    Directions have the params' dtype when ``update`` is given the params (the
    core rounds ``dW`` once to ``W``'s dtype), else the gradient's; the state
    is float32 for bf16/fp16 leaves, as in the core. ``block_size`` is the core's: a side longer than
    it keeps only its diagonal blocks (a [`Blocks`][fismo_core.kronecker.Blocks]
    in the leaf's state, a pytree like the rest).

    Errors and warnings name the leaf by its pytree path
    (``jax.tree_util.keystr``, e.g. ``['dense']['kernel']``). A NaN or an
    infinity in a gradient raises a ``ValueError`` naming the leaf, before
    any leaf is computed; under ``jax.jit`` nothing can be read and it
    propagates (``optax.apply_if_finite`` skips such steps under ``jit``). A leaf whose factors
    would dwarf it gets a [`FactorSizeWarning`][fismo_core.guards.FactorSizeWarning]
    from ``init``.

    Leaves laid out by a ``NamedSharding`` over several devices keep their
    layout, and the state gets the one of the page "Backends" (section
    "Sharding"): ``M`` like the leaf, the factors replicated or, on Explicit
    mesh axes, their blocks split as the leaf splits that side.

    Examples
    --------
    The directions of a pytree of two matrix leaves, a ``4 x 3`` matrix and
    a convolution kernel ``(2, 3, 2, 2)``, optimized as the ``2 x 12``
    matrix (`default_matrix_shape`). Each leaf keeps its own
    [`FISMOState`][fismo_core.FISMOState]; [`fismo`][fismo_core.backends.optax.fismo]
    adds the learning rate and the other leaves:

    >>> import jax
    >>> import jax.numpy as jnp
    >>> from fismo_core.backends.optax import scale_by_fismo
    >>> params = {"w": jnp.ones((4, 3)), "conv": jnp.ones((2, 3, 2, 2))}
    >>> tx = scale_by_fismo(beta=0.95, gamma=0.95, mu=1e-3)
    >>> state = tx.init(params)
    >>> state.states["conv"].P.shape, state.states["conv"].Q.shape
    ((2, 2), (12, 12))
    >>> grads = {"w": jnp.arange(12.0).reshape(4, 3) / 12, "conv": jnp.full((2, 3, 2, 2), 0.5)}
    >>> directions, state = jax.jit(tx.update)(grads, state)
    >>> {name: d.shape for name, d in directions.items()}
    {'conv': (2, 3, 2, 2), 'w': (4, 3)}
    >>> bool(jnp.all(jnp.isfinite(directions["w"]))), int(state.states["w"].step)
    (True, 1)
    """
    _python_settings("scale_by_fismo", {"gamma": gamma, "mu": mu, "block_size": block_size}, beta,
                     takes_learning_rate=False)
    matrix_shape = _checked_matrix_shape(matrix_shape)
    # The learning rate is applied by fismo()'s line 9; the core's lr is unused by FISMO.direction.
    core = FISMO(
        lr=1.0,
        beta=beta,
        gamma=gamma,
        mu=mu,
        polar=_DEFAULTS.polar if polar is None else polar,
        inv_root=_DEFAULTS.inv_root if inv_root is None else inv_root,
        nesterov=nesterov,
        statistics=statistics,
        block_size=block_size,
    )

    # An array beta (inject_hyperparams' schedule; a tracer under jit) is not hashable and changes at
    # every update: it is passed to the programs of the same core with a number in its place.
    array_beta = None if isinstance(core.beta, numbers.Number) else core.beta
    programs_core = core if array_beta is None else dataclasses.replace(core, beta=_DEFAULTS.beta)
    leaf_direction, init_on_mesh, update_on_mesh, checked_update_on_mesh = _leaf_programs(programs_core, matrix_shape)
    checked = _guards.checks_roots(core.inv_root.fallback, core.nonfinite)

    def leaf_update(g: Any, s: FISMOState) -> tuple[Any, FISMOState]:
        """One leaf's direction and state, wherever it lives: on one device op by op (the core's fault
        handling included), on a mesh compiled, and there, eagerly, with the roots' fault handling too."""
        if _mesh(g) is None:
            return leaf_direction(g, s, array_beta)
        if isinstance(g, jax.core.Tracer):
            return update_on_mesh(g, s, array_beta)  # under jax.jit the checks step aside, as on one device
        # Eagerly, a concrete array beta goes into the programs beside the mesh's arrays: replicated there.
        beta = array_beta if array_beta is None or _mesh(array_beta) is not None else _replicated(array_beta, g)
        every = core.inv_root.every
        if not checked or not (every == 1 or core.inv_root.is_refresh_step(int(s.step))):  # no read when every = 1
            return update_on_mesh(g, s, beta)
        d, s_new, failed = checked_update_on_mesh(g, s, beta)
        if not read_faults(failed):
            return d, s_new
        # A root failed its check: the fault handling of InverseRootConfig (float64 retry, fallback to
        # the previous factor, warning, error) reads and branches on the host, which the core cannot
        # do on a mesh. The leaf's step is taken again on one device and laid out as the mesh's was.
        device = g.sharding.mesh.devices.flat[0]
        # Through the host: JAX places no array typed by Explicit mesh axes on one device.
        g1, s1, beta = jax.device_put(jax.device_get((g, s, array_beta)), device)
        # Under a mesh of one device: inside the caller's jax.set_mesh(mesh) the step's jit was refused
        # ("Received incompatible devices", arrays on one device and the context mesh on all).
        with jax.set_mesh(jax.sharding.Mesh(np.array([device]), ("device",))):
            d1, s1 = leaf_direction(g1, s1, beta)
        return jax.device_put(d1, d.sharding), jax.tree.map(lambda x, y: jax.device_put(x, y.sharding), s1, s_new)

    def init_fn(params: Any) -> ScaleByFismoState:
        treedef: Any  # a PyTreeDef, which jaxlib does not type
        leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
        states = []
        for path, p in leaves:
            name = f"leaf {jax.tree_util.keystr(path)} (shape {tuple(p.shape)})"
            try:
                check_matrix(p, name)  # before matrix_shape, whose errors could not name the leaf
            except (TypeError, ValueError) as exc:
                raise type(exc)(f"{exc}; fismo(..., matrix_mask=...) sends such a leaf to non_matrix") from None
            p = jnp.asarray(p)  # NumPy params (loaded from a file) get a JAX state, as optax's own do
            mesh = _mesh(p)
            if mesh is not None:
                # The leaf's layout: in the type on Explicit axes; on Auto axes only a concrete array has it.
                if _is_explicit(mesh):
                    spec = jax.typeof(p).sharding.spec
                else:  # a concrete array on a mesh: a NamedSharding, which Array.sharding's type does not say
                    spec = None if isinstance(p, jax.core.Tracer) else p.sharding.spec  # type: ignore[attr-defined]
                states.append(_naming(name, init_on_mesh, p, name=name, spec=spec))
                continue
            state = _naming(name, lambda p: core.init(_as_matrix(p, matrix_shape), name=name), p)
            # The step count is an int32 array from the start, as optax's counts are: every leaf of the
            # state is then an array (jax.tree.map, optax.tree.cast), and jit sees one argument kind
            # (a Python int at step 0 compiled a second executable; with every > 1, lax.cond makes it
            # an int32 array anyway).
            # On W's device, committed as W is (an uncommitted count beside a committed leaf made the
            # second step compile again).
            states.append(state._replace(step=jnp.asarray(0, dtype=jnp.int32, device=_fismo._creation_device(p))))
        return ScaleByFismoState(treedef.unflatten(states))

    def update_fn(updates: Any, state: ScaleByFismoState, params: Any = None) -> tuple[Any, ScaleByFismoState]:
        treedef: Any
        leaves, treedef = jax.tree_util.tree_flatten_with_path(updates)
        leaves = [(path, jnp.asarray(g)) for path, g in leaves]  # NumPy gradients too, as optax's own take
        # ... and NumPy states: a checkpoint restored by np.load, pickle or jax.device_get.
        states = [jax.tree.map(_as_jax, _as_fismo_state(s)) for s in treedef.flatten_up_to(state.states)]
        leaves = [(path, _beside_state(g, s)) for (path, g), s in zip(leaves, states)]
        _check_finite_leaves(leaves, states)
        # With the params, each state's dtype is checked against its parameter's (the gradient's may be
        # narrower: float32 gradients of float64 params are the core's G).
        weights = [None] * len(leaves) if params is None else treedef.flatten_up_to(params)
        directions, new_states = [], []
        for (path, g), s, W in zip(leaves, states, weights):
            try:
                # (A Python number has no dtype to check; a state of another kind than float32/float64,
                # bfloat16 say, the core refuses with its own reason.)
                if hasattr(W, "dtype") and s.M.dtype in (jnp.float32, jnp.float64):
                    # canonical: NumPy float64 params are float32 in JAX without x64, and so is their state
                    _fismo.check_state_dtype(jnp, s, jax.dtypes.canonicalize_dtype(W.dtype))
                _check_one_mesh(g, s)
                dtype = _direction_dtype(g, W)
                with _named_root_warnings(f"leaf {jax.tree_util.keystr(path)}"):
                    # A narrower gradient is widened first, exactly (the core casts G to the state's dtype
                    # anyway), so that the direction is rounded once, to W's dtype, as the core rounds dW.
                    d, s = leaf_update(g.astype(dtype) if _is_wider(dtype, g.dtype) else g, s)
                d = d.astype(dtype)
            except InverseRootError as exc:
                raise InverseRootError(f"leaf {jax.tree_util.keystr(path)}: {exc}", exc.indices) from exc
            except (ValueError, TypeError) as exc:
                if type(exc) not in (ValueError, TypeError):  # a subclass may take other arguments
                    raise
                raise type(exc)(f"leaf {jax.tree_util.keystr(path)} (gradient of shape {tuple(g.shape)}): "
                                f"{exc}") from exc
            directions.append(d)
            new_states.append(s)
        return treedef.unflatten(directions), ScaleByFismoState(treedef.unflatten(new_states))

    return optax.GradientTransformation(init_fn, update_fn)


def _direction_dtype(g: Any, W: Any) -> Any:
    """The dtype of a leaf's direction: its parameter's, where ``update`` is given the params (the core
    rounds ``dW`` once to ``W``'s dtype: float32 params with bfloat16 gradients get float32 directions, as
    ``optax.adamw`` gives float32 updates), else the gradient's. (Until 2026-12-03 it was always the
    gradient's: such directions were rounded to bfloat16, 2e-3 of the change of W off the core's step.)"""
    if hasattr(W, "dtype") and jnp.issubdtype(W.dtype, jnp.floating) and jnp.issubdtype(g.dtype, jnp.floating):
        return jax.dtypes.canonicalize_dtype(W.dtype)  # NumPy float64 params are float32 without x64
    return g.dtype


def _is_wider(dtype: Any, than: Any) -> bool:
    """Whether floating ``dtype`` has more bits than ``than`` (another floating dtype, or the same one)."""
    return dtype != than and jnp.finfo(dtype).bits > jnp.finfo(than).bits


#: The fields of `FISMOState` that are Kronecker factors or their roots: an array, or `Blocks`.
_FACTOR_FIELDS = ("P", "Q", "P_inv_sqrt", "Q_inv_sqrt")


def _as_fismo_state(s: Any) -> Any:
    """A leaf's state given as a mapping of `FISMOState`'s fields, its blocks as mappings of `Blocks`' (how
    ``flax.nnx.Optimizer`` hands the state back: it stores each as an ``nnx.State``), as a `FISMOState`;
    anything else as it is (the core refuses what is not a state, with its reason)."""
    if isinstance(s, FISMOState) or not isinstance(s, Mapping) or set(s) != set(FISMOState._fields):
        return s

    def factor(value: Any) -> Any:
        return Blocks(value["full"], value.get("rest")) if isinstance(value, Mapping) else value
    return FISMOState(**{k: factor(v) if k in _FACTOR_FIELDS else v for k, v in s.items()})


def _as_jax(x: Any) -> Any:
    """A NumPy array or scalar of a state as a JAX array; anything else (JAX arrays, Python ints) as it is."""
    return jnp.asarray(x) if isinstance(x, (np.ndarray, np.generic)) else x


@contextlib.contextmanager
def _named_root_warnings(name: str) -> Any:
    """Each `InverseRootWarning` raised inside, issued again prefixed with ``name`` (the core's counts a
    leaf's matrices, not which leaf); other warnings issued again as they were. Also when the body raises
    (a root that fails beyond ``max_failures`` warns, then raises `InverseRootError`, in one call)."""
    caught: list = []
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield
    finally:
        for w in caught:
            message = f"{name}: {w.message}" if issubclass(w.category, InverseRootWarning) else w.message
            warnings.warn_explicit(message, w.category, w.filename, w.lineno, source=w.source)


def _beside_state(g: Any, s: FISMOState) -> Any:
    """A leaf's gradient where its state lives: a NumPy or one-device gradient of a leaf on a mesh (eagerly),
    which optax's own transformations take, laid out like ``M`` (the leaf's layout when it is a matrix), else
    replicated on ``M``'s mesh; any other gradient as it is."""
    if _mesh(g) is not None or _mesh(s.M) is None or isinstance(g, jax.core.Tracer):
        return g
    same = tuple(g.shape) == tuple(s.M.shape)
    return jax.device_put(g, s.M.sharding if same else NamedSharding(s.M.sharding.mesh, PartitionSpec()))


def _naming(leaf: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)``, its ``ValueError`` or ``TypeError`` prefixed with ``leaf`` (its name) unless it
    names it already (the core's errors take the name): ``matrix_shape``'s did not say which leaf."""
    try:
        return fn(*args, **kwargs)
    except (ValueError, TypeError) as exc:
        if type(exc) not in (ValueError, TypeError) or leaf in str(exc):
            raise
        raise type(exc)(f"{leaf}: {exc}") from exc


def _check_finite_leaves(leaves: list[tuple[Any, Any]], states: list[FISMOState]) -> None:
    """A ``ValueError`` naming the first leaf (by pytree path) whose gradient has a NaN or an infinity, as cast
    to its state's dtype (a float64 gradient beyond float32's range is infinite for a float32 state).

    One host read for all leaves on one device or mesh (`guards.read_faults`: one per device or mesh they
    live on), before any is computed; traced (``jax.jit``): nothing to read, no check. (Until 2026-12-02 the
    gradient was checked in its own dtype: on a mesh, where the core's own check does not run, such a
    gradient was zeroed without a word, or made the update NaN with roots kept.)
    """
    # Only a narrowing cast can overflow: a bfloat16 or same-dtype gradient is checked as it is, without a copy.
    cast = [g.astype(s.M.dtype) if jnp.issubdtype(g.dtype, jnp.floating)
            and jnp.finfo(g.dtype).max > jnp.finfo(s.M.dtype).max else g
            for (_, g), s in zip(leaves, states)]
    nonfinite = [~jnp.all(jnp.isfinite(g)) for g in cast]
    if not read_faults(*nonfinite):  # None when traced (jax.jit): nothing can be read, no check
        return
    for (path, g), g_cast, bad in zip(leaves, cast, nonfinite):
        if bool(bad):
            nan, inf = int(jnp.sum(jnp.isnan(g_cast))), int(jnp.sum(jnp.isinf(g_cast)))
            finite_as_given = g_cast.dtype != g.dtype and bool(jnp.all(jnp.isfinite(g)))
            widened = f" once cast from {g.dtype} to the state's dtype {g_cast.dtype}" if finite_as_given else ""
            raise ValueError(
                f"the gradient of leaf {jax.tree_util.keystr(path)} (shape {tuple(g.shape)}) contains {nan} NaN "
                f"and {inf} infinite values (of {g.size} entries){widened}; no update was computed and the state "
                "passed in is unchanged. Check the loss and the gradient computation; optax.apply_if_finite(tx, "
                "...) skips such steps"
            )


@dataclasses.dataclass(frozen=True)
class _Labelled:
    """A leaf of the params and its label in `fismo`'s partition (not a pytree node: a leaf of its own)."""

    label: str
    leaf: Any


@foreign_keywords("fismo_core.backends.optax.fismo", notes=_OPTAX_MUON_NOTES)
def fismo(
    learning_rate: optax.ScalarOrSchedule,
    beta: Union[float, jax.Array] = _DEFAULTS.beta,
    gamma: float = _DEFAULTS.gamma,
    mu: float = _DEFAULTS.mu,
    *,
    polar: Union[PolarConfig, str, dict, None] = None,
    inv_root: Union[InverseRootConfig, str, dict, None] = None,
    weight_decay: float = _DEFAULTS.weight_decay,
    nesterov: bool = _DEFAULTS.nesterov,
    statistics: Literal["printed", "scale_invariant"] = _DEFAULTS.statistics,
    non_matrix: Union[str, optax.GradientTransformation] = "adamw",
    matrix_mask: Optional[Any] = None,
    matrix_shape: Optional[MatrixShape] = None,
    block_size: Optional[int] = _DEFAULTS.block_size,
) -> optax.GradientTransformation:
    """FISMO (Algorithm 1) for the matrix leaves of a pytree, as an optax transformation.

    Call ``update(grads, state, params)`` with the params, as for ``optax.adamw``: the default
    ``non_matrix`` (AdamW) and ``weight_decay`` need them; only ``scale_by_fismo`` does without.

    Parameters
    ----------
    learning_rate:
        ``eta``: a float or an optax schedule (a function of the step count).
        FISMO's directions have singular values near 1, so Muon-like values
        (about 0.02) are the starting point.
    beta, gamma, mu, polar, inv_root, nesterov, statistics:
        As in [`fismo_core.FISMO`][fismo_core.FISMO]; ``polar=None`` and
        ``inv_root=None`` (the defaults) are the core's defaults. Python
        values, checked here: with ``optax.inject_hyperparams`` keep them in
        ``static_args`` (page "Backends"), except ``beta``, which may be
        injected (a momentum schedule; a 0-d JAX array, as in the core).
    weight_decay:
        Decoupled weight decay of the matrix leaves, by the core's rule
        ([`line_9_factors`][fismo_core.optimizer.line_9_factors]):
        ``updates = -(lr dW + lr weight_decay W)``, so that
        ``optax.apply_updates`` gives the core's ``W <- (1 - lr wd) W - lr dW``
        (up to rounding). Needs ``params`` in ``update``.
    non_matrix:
        What optimizes the other leaves: ``"adamw"`` (default;
        ``optax.adamw(learning_rate, weight_decay=0.0)``, as
        ``optax.contrib.muon`` does), ``"error"`` (raise, naming the
        leaves), or any ``optax.GradientTransformation``.
    matrix_mask:
        Optional pytree of booleans (or a function of the params returning
        one): ``True`` leaves use FISMO (they need ``ndim >= 2``), ``False``
        leaves go to ``non_matrix``. It may be a prefix of the params, as
        ``optax.masked``'s mask: one boolean for a whole subtree.
        Default: ``leaf.ndim >= 2 and leaf.size > 0`` (an empty leaf, a LoRA
        adapter of rank 0, has no matrix to step).
    matrix_shape:
        The matrix a leaf of more than two dimensions is optimized as;
        ``None`` (default): `default_matrix_shape`, ``(shape[0], prod(shape[1:]))``.
    block_size:
        ``None`` (default): full factors, the printed algorithm. An integer
        ``B``: block-diagonal factors, as [`fismo_core.FISMO`][fismo_core.FISMO]'s
        ``block_size`` (a side of size ``<= B`` is one block, the full factor).
        A bad value raises ``ValueError`` here, before any state exists.

    Returns
    -------
    An ``optax.GradientTransformation`` whose updates are added to the params
    (``optax.apply_updates``). On params laid out by a ``NamedSharding`` over
    several devices the updates keep the params' layout and ``init`` places
    the whole state (the AdamW leaves' and the schedule's counts too; page
    "Backends", section "Sharding").
    """
    _python_settings("fismo", {"gamma": gamma, "mu": mu, "weight_decay": weight_decay, "block_size": block_size},
                     beta)
    if isinstance(non_matrix, str):
        if non_matrix == "adamw":
            other = optax.adamw(learning_rate, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.0)
        elif non_matrix == "error":
            other = None
        else:
            raise ValueError(f"non_matrix must be 'adamw', 'error' or an optax.GradientTransformation, got {non_matrix!r}")
    elif isinstance(non_matrix, optax.GradientTransformation):
        other = non_matrix
    else:
        raise TypeError(f"non_matrix must be 'adamw', 'error' or an optax.GradientTransformation, got {type(non_matrix).__name__}")
    return _fismo_transformation(
        learning_rate, other, matrix_mask, matrix_shape, None, beta=beta, gamma=gamma, mu=mu, polar=polar,
        inv_root=inv_root, weight_decay=weight_decay, nesterov=nesterov, statistics=statistics, block_size=block_size,
        name="fismo",
    )


class _Preset:
    """The default of `fismo_training`'s core options: the value of [`TRAINING`][fismo_core.optimizer.TRAINING]
    (or, where it sets none, the core's default)."""

    def __repr__(self) -> str:
        return "<the training preset's>"


_PRESET = _Preset()


@foreign_keywords(
    "fismo_core.backends.optax.fismo_training",
    notes={**_OPTAX_MUON_NOTES, "non_matrix": (
        "fismo_core.backends.optax.fismo",
        "fismo_training builds the other leaves' AdamW from adam_* as optax.contrib.muon does; for another "
        "transformation use fismo(..., non_matrix=...) with the settings of fismo_core.TRAINING",
    )},
)
def fismo_training(
    learning_rate: optax.ScalarOrSchedule,
    ns_coeffs: Any = MUON_COEFFICIENTS[0],
    ns_steps: int = 5,
    beta: Union[float, jax.Array] = 0.95,
    eps: float = 1e-8,
    weight_decay: float = TRAINING["weight_decay"],
    *,
    nesterov: bool = TRAINING["nesterov"],
    adam_b1: float = 0.9,
    adam_b2: float = 0.999,
    adam_eps_root: float = 0.0,
    adam_weight_decay: float = 0.0,
    adam_learning_rate: Optional[optax.ScalarOrSchedule] = None,
    consistent_rms: Optional[float] = None,
    gamma: Any = _PRESET,
    mu: Any = _PRESET,
    polar: Any = _PRESET,
    inv_root: Any = _PRESET,
    statistics: Any = _PRESET,
    block_size: Any = _PRESET,
    matrix_mask: Optional[Any] = None,
    matrix_shape: Optional[MatrixShape] = None,
) -> optax.GradientTransformation:
    """The training configuration with ``optax.contrib.muon``'s signature: ``muon(`` -> ``fismo_training(``.

    The arguments mean what they mean in ``optax.contrib.muon`` (its
    defaults, but ``weight_decay``): ``ns_coeffs`` (one ``(a, b, c)`` triple,
    or a sequence of at most ``ns_steps`` triples, run once each), ``ns_steps``
    and ``eps`` are line 8's Newton–Schulz iteration, in the state's dtype (the
    leaves', float32 for bfloat16 and float16 leaves; optax runs it in the
    gradient's); ``beta`` is FISMO's ``beta``; the matrix leaves' step is
    scaled by optax's ``sqrt(max(1, fan_out / fan_in))``
    (``consistent_rms=c``: ``c sqrt(max(fan_in, fan_out))``), the weight decay not,
    with ``(fan_in, fan_out)`` a 2-D leaf's shape, or for a leaf of more dimensions
    ``matrix_shape(shape)`` reversed under the default (whose leading axis is the output)
    and as given otherwise; the
    other leaves get optax's AdamW as ``optax.contrib.muon`` builds it
    (``adam_*``, the same ``eps`` and ``nesterov``). On top come the core's
    [`TRAINING`][fismo_core.optimizer.TRAINING]: scale-invariant statistics,
    Nesterov, decoupled weight decay 0.1, damping ``mu`` 0.1, roots every 10 steps, blocks of 512 on
    longer sides; the preconditioners' products in the state's dtype, as the iteration (the torch
    adapter's are in bfloat16, as ``torch.optim.Muon``'s iteration). It is *not*
    Algorithm 1, which stays [`fismo`][fismo_core.backends.optax.fismo].

    Where it differs from ``optax.contrib.muon``: ``weight_decay`` defaults to
    0.1 (optax: 0), Muon's convention as in ``torch.optim.Muon``; the
    momentum has no bias correction (optax divides by ``1 - beta^t``: a scale
    the polar factor removes without Nesterov, a different mix of momentum
    and gradient in the first steps with it); ``ns_coeffs`` takes no preset
    names; leaves of more than 2 dimensions are FISMO's (as
    ``matrix_shape(shape)``), not Adam's; ``weight_decay_mask``,
    ``mu_dtype``, ``adaptive``, ``preconditioning`` and the dimension numbers
    are refused, naming FISMO's spelling.

    ``gamma``, ``mu``, ``polar``, ``inv_root``, ``statistics`` and
    ``block_size`` are the core's (``polar=None`` and ``inv_root=None``
    mean the preset's, as not given); given, they override the preset by
    [`training_options`][fismo_core.optimizer.training_options] (``ns_coeffs``, ``ns_steps`` or ``eps``
    given with another value than its default beside a ``polar`` that sets the same field otherwise is
    refused, naming both: [`check_muon_polar`][fismo_core.optimizer.check_muon_polar]).
    ``matrix_mask`` and ``matrix_shape`` are as in [`fismo`][fismo_core.backends.optax.fismo].
    With ``optax.inject_hyperparams``, name every argument but
    ``learning_rate`` in ``static_args``,
    ``tuple(inspect.signature(fismo_training).parameters)[1:]`` (FISMO's
    settings are Python values, checked once; without it ``init`` raises a
    ``TypeError`` saying so), or every argument but ``learning_rate`` and
    ``beta`` to schedule the momentum too; the same holds for `fismo`.
    With ``gamma=1`` and ``nesterov=False`` it is ``optax.contrib.muon(..., nesterov=False)``
    up to rounding. Bad input raises here, before any state exists, naming the argument.
    """
    _python_settings("fismo_training", {
        "ns_steps": ns_steps, "eps": eps, "weight_decay": weight_decay, "adam_b1": adam_b1,
        "adam_b2": adam_b2, "adam_eps_root": adam_eps_root, "adam_weight_decay": adam_weight_decay,
        "consistent_rms": consistent_rms, "gamma": gamma, "mu": mu, "block_size": block_size,
    }, beta)
    # The other leaves' AdamW: optax.adamw takes any number (a NaN, a negative rate or b1 = 1 trains on).
    if adam_learning_rate is not None:
        _check_learning_rate(adam_learning_rate, "adam_learning_rate")
    for name, value in (("adam_b1", adam_b1), ("adam_b2", adam_b2)):
        _fismo._check_real(name, value, 0.0, 1.0, high_open=True)  # 1 - b**t = 0: AdamW's bias correction
    for name, value in (("adam_eps_root", adam_eps_root), ("adam_weight_decay", adam_weight_decay)):
        _fismo._check_real(name, value, 0.0)
    given = {"gamma": gamma, "mu": mu, "polar": polar, "inv_root": inv_root, "statistics": statistics,
             "block_size": block_size}
    # polar=None and inv_root=None mean the defaults, as in `fismo`; here, the preset's
    fismo_options = {k: v for k, v in given.items()
                     if v is not _PRESET and not (k in ("polar", "inv_root") and v is None)}
    muon_polar = _muon_polar(ns_coeffs, ns_steps, eps)
    signature = inspect.signature(fismo_training).parameters
    check_muon_polar("fismo_training", {
        argument: (field, value, signature[argument].default)
        for argument, field, value in [("ns_coeffs", "coefficients", ns_coeffs), ("ns_steps", "steps", ns_steps),
                                       ("eps", "eps", eps)]
    }, fismo_options.get("polar"))
    if consistent_rms is not None and (
        isinstance(consistent_rms, bool) or not isinstance(consistent_rms, numbers.Real)
        or not math.isfinite(consistent_rms) or consistent_rms <= 0
    ):
        raise ValueError(f"consistent_rms must be None or a finite number > 0, got {consistent_rms!r}")
    options = training_options(
        {**TRAINING, "polar": muon_polar},
        {"weight_decay": weight_decay, "nesterov": nesterov, "beta": beta, **fismo_options},
    )
    core = FISMO(**options)  # the core's checks, naming the argument, before anything is built
    other = optax.adamw(
        learning_rate if adam_learning_rate is None else adam_learning_rate, b1=adam_b1, b2=adam_b2, eps=eps,
        eps_root=adam_eps_root, weight_decay=adam_weight_decay, nesterov=nesterov,
    )

    def step_scale(m: int, n: int) -> float:  # optax.contrib.muon's scale_by_shape, (m, n) = (fan_in, fan_out)
        return math.sqrt(max(1.0, n / m)) if consistent_rms is None else consistent_rms * math.sqrt(max(m, n))

    return _fismo_transformation(
        learning_rate, other, matrix_mask, matrix_shape, step_scale,
        beta=core.beta, gamma=core.gamma, mu=core.mu, polar=core.polar, inv_root=core.inv_root,
        weight_decay=core.weight_decay, nesterov=core.nesterov, statistics=core.statistics, block_size=core.block_size,
        name="fismo_training",
    )


def _muon_polar(ns_coeffs: Any, ns_steps: int, eps: float) -> dict[str, Any]:
    """optax.contrib.muon's Newton–Schulz arguments as line 8's `PolarConfig` fields (checked, naming them).

    One ``(a, b, c)`` triple runs ``ns_steps`` times; ``k <= ns_steps`` triples run once each, as in optax.
    """
    given = f"fismo_training(ns_coeffs={ns_coeffs!r}, ns_steps={ns_steps!r}, eps={eps!r})"
    try:
        coefficients = None if isinstance(ns_coeffs, str) else np.asarray(ns_coeffs, dtype=np.float64)
    except (TypeError, ValueError):
        coefficients = None
    if coefficients is None or coefficients.ndim not in (1, 2) or coefficients.shape[-1] != 3:
        raise ValueError(f"{given}: ns_coeffs must be one (a, b, c) triple or a sequence of triples (no preset names)")
    triples = tuple(tuple(float(c) for c in t) for t in coefficients.reshape(-1, 3))
    try:
        steps = linalg._check_integer("ns_steps", ns_steps)
        if coefficients.ndim == 2 and len(triples) > steps:
            raise ValueError(f"{len(triples)} triples are more than ns_steps={steps} (optax's rule)")
        polar = PolarConfig(coefficients=triples, steps=steps if coefficients.ndim == 1 else len(triples), eps=eps)
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"{given}: {exc}") from None
    return {"method": polar.method, "coefficients": polar.coefficients, "steps": polar.steps, "eps": polar.eps}


def _fismo_transformation(
    learning_rate: optax.ScalarOrSchedule,
    other: Optional[optax.GradientTransformation],
    matrix_mask: Optional[Any],
    matrix_shape: Optional[MatrixShape],
    step_scale: Optional[Callable[[int, int], float]],
    *,
    beta: Union[float, jax.Array],
    gamma: float,
    mu: float,
    polar: Union[PolarConfig, str, dict, None],
    inv_root: Union[InverseRootConfig, str, dict, None],
    weight_decay: float,
    nesterov: bool,
    statistics: Literal["printed", "scale_invariant"],
    block_size: Optional[int],
    name: str,
) -> optax.GradientTransformation:
    """`fismo` and `fismo_training` (``name``, for messages): FISMO on the matrix leaves, ``other`` on the rest
    (``None``: refuse them).

    ``step_scale(m, n)`` multiplies the step's learning rate of an ``m x n`` matrix (not its weight decay);
    ``None``: no scaling.
    """
    weight_decay = FISMO(weight_decay=weight_decay).weight_decay  # the core's check (a finite number >= 0)
    _check_learning_rate(learning_rate)
    matrix_shape = _checked_matrix_shape(matrix_shape)

    def labels(tree: Any) -> Any:
        mask = matrix_mask(tree) if callable(matrix_mask) else matrix_mask
        if mask is None:
            # A Python float too; an empty leaf (a LoRA adapter of rank 0) has no matrix to step.
            out = jax.tree.map(lambda x: "fismo" if np.ndim(x) >= 2 and np.size(x) > 0 else "non_matrix", tree)
        else:
            # The mask leads, as in optax.masked: inside an optax.masked, ``tree`` holds an optax.MaskedNode
            # (a node without leaves) where the mask still holds a boolean.
            out = jax.tree.map(lambda use, x: "fismo" if use else "non_matrix", mask, tree)
        # A _Labelled is one leaf; a label over a subtree (a mask that is a prefix of the params, as
        # optax.masked takes) labels each of its leaves.
        pairs = jax.tree.map(lambda label, x: jax.tree.map(lambda leaf: _Labelled(label, leaf), x), out, tree)
        labelled = [
            (jax.tree_util.keystr(path), pair.leaf, pair.label)
            for path, pair in jax.tree_util.tree_flatten_with_path(pairs)[0]
            if not isinstance(pair.leaf, optax.MaskedNode)
        ]
        small = [f"{n} (shape {np.shape(x)})" for n, x, lab in labelled if lab == "fismo" and np.ndim(x) < 2]
        if small:
            raise ValueError(f"matrix_mask selects leaves with fewer than 2 dimensions for FISMO: {', '.join(small)}")
        if other is None:
            rest = [f"{n} (shape {np.shape(x)})" for n, x, lab in labelled if lab == "non_matrix"]
            if rest:
                raise ValueError(
                    f"non_matrix='error', but these leaves are not FISMO matrices: {', '.join(rest)}; "
                    "pass non_matrix=optax.adamw(...) (or another transformation) for them"
                )
        return out

    matrix_tx = [
        scale_by_fismo(
            beta,
            gamma,
            mu,
            polar=polar,
            inv_root=inv_root,
            nesterov=nesterov,
            statistics=statistics,
            matrix_shape=matrix_shape,
            block_size=block_size,
        )
    ]
    matrix_tx.append(_line_9(learning_rate, weight_decay, matrix_shape, step_scale, name=name))
    transforms = {"fismo": optax.chain(*matrix_tx), "non_matrix": other if other is not None else optax.identity()}
    return _scalars_beside_the_params(optax.partition(transforms, labels))


def _check_learning_rate(learning_rate: Any, name: str = "learning_rate") -> None:
    """A schedule (any callable), or a finite number >= 0: a Python number or a 0-d array (unless traced)."""
    if callable(learning_rate) or isinstance(learning_rate, jax.core.Tracer):
        return
    value = None
    if not isinstance(learning_rate, (bool, str, bytes)) and np.ndim(learning_rate) == 0:
        try:
            value = float(learning_rate)
        except (TypeError, ValueError):
            pass
    if value is None or not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a finite number >= 0 or a schedule, got {learning_rate!r}")


def _scalars_beside_the_params(tx: Any) -> Any:
    """``tx`` whose ``init`` replicates every 0-d array of its state over the params' mesh, if they have one,
    or commits it to the params' one device if they are all committed to it.

    optax makes its step counts (line 9's schedule, AdamW's) on the default
    device, uncommitted; the first jitted step would move them beside the
    params, and the second, finding them there, would compile again.
    """

    def init_fn(params: Any) -> Any:
        state = tx.init(params)
        leaves = [x for x in jax.tree.leaves(params) if isinstance(x, jax.Array)]
        on_mesh = next((x for x in leaves if _mesh(x) is not None), None)
        if on_mesh is not None:
            return jax.tree.map(
                lambda x: _replicated(x, on_mesh) if isinstance(x, jax.Array) and x.ndim == 0 else x, state
            )
        if not leaves or any(isinstance(x, jax.core.Tracer) or not x.committed for x in leaves):
            return state
        devices = {d for x in leaves for d in x.devices()}
        if len(devices) != 1:
            return state
        (device,) = devices
        return jax.tree.map(
            lambda x: jax.device_put(x, device) if isinstance(x, jax.Array) and x.ndim == 0 else x, state
        )

    return tx._replace(init=init_fn)


def _fans(shape: tuple[int, ...], matrix_shape: MatrixShape) -> tuple[int, int]:
    """``(fan_in, fan_out)`` of a matrix leaf, for optax's shape-based learning rate.

    A 2-D leaf is ``(in, out)``, optax's and Flax's layout. A leaf of more
    dimensions is its ``matrix_shape`` form ``(m, n)``: ``(in, out)`` for a
    given ``matrix_shape`` (Flax's rule ``(prod(s[:-1]), s[-1])``), but
    ``(out, in)`` for `default_matrix_shape`, whose leading axis is the
    output (PyTorch's convolution kernels).
    """
    m, n = _matrix_dims(shape, matrix_shape)
    return (n, m) if len(shape) > 2 and matrix_shape is default_matrix_shape else (m, n)


def _line_9(
    learning_rate: optax.ScalarOrSchedule,
    weight_decay: float,
    matrix_shape: MatrixShape = default_matrix_shape,
    step_scale: Optional[Callable[[int, int], float]] = None,
    *,
    name: str = "fismo",
) -> optax.GradientTransformation:
    """Line 9 with decoupled weight decay as optax updates, by the core's rule ``line_9_factors``.

    ``updates = -(rate dW + decay W)`` with ``(decay, rate)`` the core's
    factors for this step's learning rate, so ``optax.apply_updates`` gives
    ``W_t = (1 - decay) W_{t-1} - rate dW_t``. State and arithmetic of the
    learning rate are ``optax.scale_by_learning_rate``'s (a schedule's value
    in the update's dtype, its step count): without weight decay the updates
    are bit for bit that transformation's. ``step_scale(m, n)``, if given,
    multiplies the rate of a leaf of ``(fan_in, fan_out) = (m, n)`` (`_fans`)
    (Muon's shape-based learning rate; the decay keeps the unscaled one).
    """
    scheduled = callable(learning_rate)

    def init_fn(params: Any) -> Any:
        del params
        return optax.ScaleByScheduleState(count=jnp.zeros([], jnp.int32)) if scheduled else optax.EmptyState()

    def update_fn(updates: Any, state: Any, params: Any = None) -> tuple[Any, Any]:
        if weight_decay and params is None:
            raise ValueError(
                f"{name} with weight_decay={weight_decay!r} needs the params, which the decay shrinks: call "
                "tx.update(grads, state, params), or build it with weight_decay=0"
            )
        lr = learning_rate(state.count) if scheduled else learning_rate

        def coefficient(c: Any, x: Any) -> Any:
            # In the update's dtype: a schedule's value, and also a NumPy scalar or a JAX array given as the
            # learning rate (inject_hyperparams passes arrays), which are not weakly typed as a Python float
            # is and widened float32 or bfloat16 updates to their own dtype.
            return c if type(c) in (int, float) else jnp.asarray(c, dtype=x.dtype)  # np.float64 is a float

        def leaf(dW: Any, W: Any) -> Any:
            step_lr = None if step_scale is None else lr * step_scale(*_fans(tuple(dW.shape), matrix_shape))
            decay, rate = _fismo.line_9_factors(lr, weight_decay, step_lr)
            step = coefficient(-rate, dW) * dW
            return step - coefficient(decay, W) * W if weight_decay else step

        new_updates = jax.tree.map(leaf, updates, updates if params is None else params)
        new_state = optax.ScaleByScheduleState(count=optax.safe_increment(state.count)) if scheduled else state
        return new_updates, new_state

    return optax.GradientTransformation(init_fn, update_fn)
