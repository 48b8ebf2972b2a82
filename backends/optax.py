"""FISMO as an optax ``GradientTransformation``.

``fismo(learning_rate, ...)`` returns a real :class:`optax.GradientTransformation`
(``init``, ``update``): updates are the *negative*, learning-rate-scaled FISMO
directions, so ``optax.apply_updates(params, updates)`` performs line 9 of
Algorithm 1. The algorithm itself is the core's
(:meth:`fismo_core.FISMO.direction`); this module only routes pytree leaves
and reshapes them.

Which leaves FISMO optimizes
----------------------------
* Leaves with ``ndim >= 2`` ("matrix leaves") use FISMO. A leaf of more than
  two dimensions is optimized as the matrix ``matrix_shape(leaf.shape)``,
  by default ``(shape[0], prod(shape[1:]))``: the leading axis is the output
  axis, as in Muon's handling of PyTorch ``(out, in, kh, kw)`` convolution
  kernels. Flax kernels put the output axis last (``Dense``: ``(in, out)``,
  ``Conv``: ``(kh, kw, in, out)``); pass
  ``matrix_shape=lambda s: (math.prod(s[:-1]), s[-1])`` for those.
* Other leaves (biases, norm scales, scalars) go to ``non_matrix``: by default
  ``optax.adamw`` with the same ``learning_rate`` (schedule included),
  ``b1=0.9``, ``b2=0.999``, ``eps=1e-8`` and no weight decay, which is the rule
  of ``optax.contrib.muon``; ``"error"`` refuses them; any other
  ``GradientTransformation`` is used as given on those leaves only.
* ``matrix_mask`` (a pytree of booleans like the params, or a function of the
  params returning one) overrides the ``ndim >= 2`` rule: ``False`` sends a
  matrix (an embedding, an output head) to ``non_matrix``.

Each matrix leaf keeps its own :class:`fismo_core.FISMOState`. Everything is
traceable: ``jax.jit(tx.update)`` compiles once and does not retrace.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple, Optional, Union

try:
    import jax
    import jax.numpy as jnp
    import optax
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(f"fismo_core.backends.optax needs JAX and optax: pip install jax optax ({exc})") from exc

from fismo_core import optimizer as _fismo  # the rules every adapter shares, looked up at each call
from fismo_core.guards import foreign_keywords
from fismo_core.optimizer import FISMO, InverseRootConfig, InverseRootError, PolarConfig

__all__ = ["ScaleByFismoState", "default_matrix_shape", "fismo", "scale_by_fismo"]

MatrixShape = Callable[[tuple[int, ...]], tuple[int, int]]


default_matrix_shape: MatrixShape = _fismo.matrix_shape
"""The core's rule, [`matrix_shape`][fismo_core.optimizer.matrix_shape]: ``(shape[0], prod(shape[1:]))``.

The leading axis is the output axis (Muon's conv rule), as in the torch adapter.
"""

#: The core's hyperparameter defaults, which the signatures below repeat by reference.
_DEFAULTS = FISMO()


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


def _as_matrix(x: Any, matrix_shape: MatrixShape) -> Any:
    if x.ndim == 2:
        return x
    m, n = matrix_shape(tuple(x.shape))
    if m * n != math.prod(x.shape):
        raise ValueError(f"matrix_shape{tuple(x.shape)} returned ({m}, {n}), which does not have {math.prod(x.shape)} elements")
    return jnp.reshape(x, (m, n))


@foreign_keywords("fismo_core.backends.optax.scale_by_fismo", notes=_OPTAX_MUON_NOTES)
def scale_by_fismo(
    beta: float = _DEFAULTS.beta,
    gamma: float = _DEFAULTS.gamma,
    mu: float = _DEFAULTS.mu,
    *,
    polar: Union[PolarConfig, str, dict] = _DEFAULTS.polar,
    inv_root: Union[InverseRootConfig, str, dict] = _DEFAULTS.inv_root,
    nesterov: bool = _DEFAULTS.nesterov,
    statistics: str = _DEFAULTS.statistics,
    matrix_shape: MatrixShape = default_matrix_shape,
    block_size: Optional[int] = _DEFAULTS.block_size,
) -> optax.GradientTransformation:
    """FISMO's direction ``dW_t`` (lines 4-8 of Algorithm 1) for every leaf: not negated, not scaled.

    Every leaf must have ``ndim >= 2``; use :func:`fismo` for a whole model.
    Directions have the gradient's dtype (the state is float32 for bf16/fp16
    leaves, as in the core). ``block_size`` is the core's: a side longer than
    it keeps only its diagonal blocks (a [`Blocks`][fismo_core.kronecker.Blocks]
    in the leaf's state, a pytree like the rest).

    Errors and warnings name the leaf by its pytree path
    (``jax.tree_util.keystr``, e.g. ``['dense']['kernel']``). A NaN or an
    infinity in a gradient raises a ``ValueError`` naming the leaf, before
    any leaf is computed; under ``jax.jit`` nothing can be read and it
    propagates (``optax.apply_if_finite`` skips such steps under ``jit``). A leaf whose factors
    would dwarf it gets a [`FactorSizeWarning`][fismo_core.guards.FactorSizeWarning]
    from ``init``.

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
    # The learning rate is applied by fismo()'s line 9; the core's lr is unused by FISMO.direction.
    core = FISMO(
        lr=1.0,
        beta=beta,
        gamma=gamma,
        mu=mu,
        polar=polar,
        inv_root=inv_root,
        nesterov=nesterov,
        statistics=statistics,
        block_size=block_size,
    )

    every = core.inv_root.every

    def _direction(G: Any, s: Any) -> tuple[Any, Any]:
        if every == 1:
            return core.direction(G, s)
        try:  # InverseRootConfig.every > 1: eager, the step count decides in Python ...
            refresh = core.inv_root.is_refresh_step(int(s.step))
        except TypeError:  # ... under jit it is traced (ConcretizationTypeError), and lax.cond decides.
            # The branches' states must agree in type: the step becomes an int32 array in both.
            s = s._replace(step=jnp.asarray(s.step, dtype=jnp.int32))
            return jax.lax.cond(
                core.inv_root.is_refresh_step(s.step),
                lambda: core.direction(G, s, refresh_roots=True),
                lambda: core.direction(G, s, refresh_roots=False),
            )
        return core.direction(G, s, refresh_roots=refresh)

    def init_fn(params: Any) -> ScaleByFismoState:
        leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
        states = []
        for path, p in leaves:
            name = f"leaf {jax.tree_util.keystr(path)} (shape {tuple(p.shape)})"
            state = core.init(_as_matrix(p, matrix_shape), name=name)
            # With every > 1 the step count is an int32 array from the start: lax.cond makes it
            # one, and a Python int at step 0 would make jit trace a second time.
            states.append(state if every == 1 else state._replace(step=jnp.asarray(0, dtype=jnp.int32)))
        return ScaleByFismoState(treedef.unflatten(states))

    def update_fn(updates: Any, state: ScaleByFismoState, params: Any = None) -> tuple[Any, ScaleByFismoState]:
        del params
        leaves, treedef = jax.tree_util.tree_flatten_with_path(updates)
        states = treedef.flatten_up_to(state.states)
        _check_finite_leaves(leaves)
        directions, new_states = [], []
        for (path, g), s in zip(leaves, states):
            try:
                d, s = _direction(_as_matrix(g, matrix_shape), s)
            except InverseRootError as exc:
                raise InverseRootError(f"leaf {jax.tree_util.keystr(path)}: {exc}", exc.indices) from exc
            directions.append(jnp.reshape(d, g.shape).astype(g.dtype))
            new_states.append(s)
        return treedef.unflatten(directions), ScaleByFismoState(treedef.unflatten(new_states))

    return optax.GradientTransformation(init_fn, update_fn)


def _check_finite_leaves(leaves: list[tuple[Any, Any]]) -> None:
    """A ``ValueError`` naming the first leaf (by pytree path) whose gradient has a NaN or an infinity.

    One host read for all leaves, before any is computed; traced (``jax.jit``): nothing to read, no check.
    """
    if not leaves:
        return
    finite = jnp.stack([jnp.all(jnp.isfinite(g)) for _, g in leaves])
    try:
        if bool(jnp.all(finite)):
            return
    except TypeError:  # traced (jax.errors.ConcretizationTypeError): nothing can be read
        return
    for (path, g), ok in zip(leaves, finite.tolist()):
        if not ok:
            nan, inf = int(jnp.sum(jnp.isnan(g))), int(jnp.sum(jnp.isinf(g)))
            raise ValueError(
                f"the gradient of leaf {jax.tree_util.keystr(path)} (shape {tuple(g.shape)}) contains {nan} NaN "
                f"and {inf} infinite values (of {g.size} entries); no update was computed and the state passed "
                "in is unchanged. Check the loss and the gradient computation; optax.apply_if_finite(tx, ...) "
                "skips such steps"
            )


def _leaf_names(tree: Any) -> list[str]:
    return [jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


@foreign_keywords("fismo_core.backends.optax.fismo", notes=_OPTAX_MUON_NOTES)
def fismo(
    learning_rate: optax.ScalarOrSchedule,
    beta: float = _DEFAULTS.beta,
    gamma: float = _DEFAULTS.gamma,
    mu: float = _DEFAULTS.mu,
    *,
    polar: Union[PolarConfig, str, dict] = _DEFAULTS.polar,
    inv_root: Union[InverseRootConfig, str, dict] = _DEFAULTS.inv_root,
    weight_decay: float = _DEFAULTS.weight_decay,
    nesterov: bool = _DEFAULTS.nesterov,
    statistics: str = _DEFAULTS.statistics,
    non_matrix: Union[str, optax.GradientTransformation] = "adamw",
    matrix_mask: Optional[Any] = None,
    matrix_shape: MatrixShape = default_matrix_shape,
    block_size: Optional[int] = _DEFAULTS.block_size,
) -> optax.GradientTransformation:
    """FISMO (Algorithm 1) for the matrix leaves of a pytree, as an optax transformation.

    Parameters
    ----------
    learning_rate:
        ``eta``: a float or an optax schedule (a function of the step count).
        FISMO's directions have singular values near 1, so Muon-like values
        (about 0.02) are the starting point.
    beta, gamma, mu, polar, inv_root, nesterov, statistics:
        As in [`fismo_core.FISMO`][fismo_core.FISMO].
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
        leaves go to ``non_matrix``. Default: ``leaf.ndim >= 2``.
    matrix_shape:
        The matrix a leaf of more than two dimensions is optimized as;
        default ``(shape[0], prod(shape[1:]))``.
    block_size:
        ``None`` (default): full factors, the printed algorithm. An integer
        ``B``: block-diagonal factors, as [`fismo_core.FISMO`][fismo_core.FISMO]'s
        ``block_size`` (a side of size ``<= B`` is one block, the full factor).
        A bad value raises ``ValueError`` here, before any state exists.

    Returns
    -------
    An ``optax.GradientTransformation`` whose updates are added to the params
    (``optax.apply_updates``).
    """
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
    weight_decay = FISMO(weight_decay=weight_decay).weight_decay  # the core's check (a finite number >= 0)

    def labels(tree: Any) -> Any:
        mask = matrix_mask(tree) if callable(matrix_mask) else matrix_mask
        if mask is None:
            out = jax.tree.map(lambda x: "fismo" if x.ndim >= 2 else "non_matrix", tree)
        else:
            out = jax.tree.map(lambda x, use: "fismo" if use else "non_matrix", tree, mask)
        names = _leaf_names(tree)
        flat = jax.tree.leaves(out)
        leaves = jax.tree.leaves(tree)
        small = [f"{n} (shape {tuple(x.shape)})" for n, x, lab in zip(names, leaves, flat) if lab == "fismo" and x.ndim < 2]
        if small:
            raise ValueError(f"matrix_mask selects leaves with fewer than 2 dimensions for FISMO: {', '.join(small)}")
        if other is None:
            rest = [f"{n} (shape {tuple(x.shape)})" for n, x, lab in zip(names, leaves, flat) if lab == "non_matrix"]
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
    matrix_tx.append(_line_9(learning_rate, weight_decay))
    transforms = {"fismo": optax.chain(*matrix_tx), "non_matrix": other if other is not None else optax.identity()}
    return optax.partition(transforms, labels)


def _line_9(learning_rate: optax.ScalarOrSchedule, weight_decay: float) -> optax.GradientTransformation:
    """Line 9 with decoupled weight decay as optax updates, by the core's rule ``line_9_factors``.

    ``updates = -(rate dW + decay W)`` with ``(decay, rate)`` the core's
    factors for this step's learning rate, so ``optax.apply_updates`` gives
    ``W_t = (1 - decay) W_{t-1} - rate dW_t``. State and arithmetic of the
    learning rate are ``optax.scale_by_learning_rate``'s (a schedule's value
    in the update's dtype, its step count): without weight decay the updates
    are bit for bit that transformation's.
    """
    scheduled = callable(learning_rate)

    def init_fn(params: Any) -> Any:
        del params
        return optax.ScaleByScheduleState(count=jnp.zeros([], jnp.int32)) if scheduled else optax.EmptyState()

    def update_fn(updates: Any, state: Any, params: Any = None) -> tuple[Any, Any]:
        if weight_decay and params is None:
            raise ValueError("fismo(weight_decay=...) needs the params: call tx.update(grads, state, params)")
        decay, rate = _fismo.line_9_factors(learning_rate(state.count) if scheduled else learning_rate, weight_decay)

        def coefficient(c: Any, x: Any) -> Any:
            return jnp.array(c, dtype=x.dtype) if scheduled else c

        def leaf(dW: Any, W: Any) -> Any:
            step = coefficient(-rate, dW) * dW
            return step - coefficient(decay, W) * W if weight_decay else step

        new_updates = jax.tree.map(leaf, updates, updates if params is None else params)
        new_state = optax.ScaleByScheduleState(count=optax.safe_increment(state.count)) if scheduled else state
        return new_updates, new_state

    return optax.GradientTransformation(init_fn, update_fn)
