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

from fismo_core.optimizer import FISMO, InverseRootConfig, PolarConfig

__all__ = ["ScaleByFismoState", "default_matrix_shape", "fismo", "scale_by_fismo"]

MatrixShape = Callable[[tuple[int, ...]], tuple[int, int]]


def default_matrix_shape(shape: tuple[int, ...]) -> tuple[int, int]:
    """``(shape[0], prod(shape[1:]))``: the leading axis is the output axis (Muon's conv rule)."""
    return shape[0], math.prod(shape[1:])


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


def scale_by_fismo(
    beta: float = 0.95,
    gamma: float = 0.95,
    mu: float = 1e-3,
    *,
    polar: Union[PolarConfig, str, dict] = PolarConfig(),
    inv_root: Union[InverseRootConfig, str, dict] = InverseRootConfig(),
    nesterov: bool = False,
    statistics: str = "printed",
    matrix_shape: MatrixShape = default_matrix_shape,
    block_size: Optional[int] = None,
) -> optax.GradientTransformation:
    """FISMO's direction ``dW_t`` (lines 4-8 of Algorithm 1) for every leaf: not negated, not scaled.

    Every leaf must have ``ndim >= 2``; use :func:`fismo` for a whole model.
    Directions have the gradient's dtype (the state is float32 for bf16/fp16
    leaves, as in the core). ``block_size`` is the core's: a side longer than
    it keeps only its diagonal blocks (a [`Blocks`][fismo_core.kronecker.Blocks]
    in the leaf's state, a pytree like the rest).
    """
    # The learning rate is applied by optax.scale_by_learning_rate; the core's
    # lr is unused by FISMO.direction.
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
            refresh = int(s.step) % every == 0
        except TypeError:  # ... under jit it is traced (ConcretizationTypeError), and lax.cond decides.
            # The branches' states must agree in type: the step becomes an int32 array in both.
            s = s._replace(step=jnp.asarray(s.step, dtype=jnp.int32))
            return jax.lax.cond(
                s.step % every == 0,
                lambda: core.direction(G, s, refresh_roots=True),
                lambda: core.direction(G, s, refresh_roots=False),
            )
        return core.direction(G, s, refresh_roots=refresh)

    def init_fn(params: Any) -> ScaleByFismoState:
        def init(p: Any) -> Any:
            state = core.init(_as_matrix(p, matrix_shape))
            # With every > 1 the step count is an int32 array from the start: lax.cond makes it
            # one, and a Python int at step 0 would make jit trace a second time.
            return state if every == 1 else state._replace(step=jnp.asarray(0, dtype=jnp.int32))

        return ScaleByFismoState(jax.tree.map(init, params))

    def update_fn(updates: Any, state: ScaleByFismoState, params: Any = None) -> tuple[Any, ScaleByFismoState]:
        del params
        leaves, treedef = jax.tree.flatten(updates)
        states = treedef.flatten_up_to(state.states)
        directions, new_states = [], []
        for g, s in zip(leaves, states):
            d, s = _direction(_as_matrix(g, matrix_shape), s)
            directions.append(jnp.reshape(d, g.shape).astype(g.dtype))
            new_states.append(s)
        return treedef.unflatten(directions), ScaleByFismoState(treedef.unflatten(new_states))

    return optax.GradientTransformation(init_fn, update_fn)


def _leaf_names(tree: Any) -> list[str]:
    return [jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def fismo(
    learning_rate: optax.ScalarOrSchedule,
    beta: float = 0.95,
    gamma: float = 0.95,
    mu: float = 1e-3,
    *,
    polar: Union[PolarConfig, str, dict] = PolarConfig(),
    inv_root: Union[InverseRootConfig, str, dict] = InverseRootConfig(),
    weight_decay: float = 0.0,
    nesterov: bool = False,
    statistics: str = "printed",
    non_matrix: Union[str, optax.GradientTransformation] = "adamw",
    matrix_mask: Optional[Any] = None,
    matrix_shape: MatrixShape = default_matrix_shape,
    block_size: Optional[int] = None,
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
        Decoupled weight decay of the matrix leaves:
        ``updates = -lr (dW + weight_decay W)``, which is the core's
        ``W <- (1 - lr wd) W - lr dW``. Needs ``params`` in ``update``.
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
    weight_decay = float(weight_decay)
    if not (weight_decay >= 0 and math.isfinite(weight_decay)):
        raise ValueError(f"weight_decay must be a finite number >= 0, got {weight_decay!r}")

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
    if weight_decay:
        matrix_tx.append(optax.add_decayed_weights(weight_decay))
    matrix_tx.append(optax.scale_by_learning_rate(learning_rate))
    transforms = {"fismo": optax.chain(*matrix_tx), "non_matrix": other if other is not None else optax.identity()}
    return optax.partition(transforms, labels)
