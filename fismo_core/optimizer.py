"""Algorithm 1 of the FISMO paper as a pure, functional optimizer.

``FISMO`` holds hyperparameters only; ``FISMOState`` holds arrays. A step
takes ``(W, G, state)`` and returns new arrays: inputs are never mutated, so
the same code serves JAX (immutable arrays) and keeps CuPy/PyTorch users'
gradients intact. Every array may carry leading batch dimensions
``(..., m, n)``: a stack of same-shape matrices runs as one batched call.

Line numbers below are those of Algorithm 1 in ``fismo-paper.tex``. The
algorithm itself is `FISMO._algorithm_1`, lines 4–8 in the paper's order
and symbols, as phases that hand each other their data: lines 4–5 return
the `Preconditioners` (``P_t``, ``Q_t``, their roots and the roots' fault
flags), then line 6 whitens, line 7 updates the momentum and line 8 takes
the polar factor. The Kronecker factors are objects of `fismo_core.kronecker`
(full, or block-diagonal with ``block_size``), and everything that guards the
step (argument checks, non-finite policies, overflow-safe scaling, root fault
handling) is in `fismo_core.guards`, called around the algorithm by
`FISMO._guarded_step`. Fault flags stay arrays until one host read
(`FISMO.direction_with_faults`, `FISMO.settle`).
"""

from __future__ import annotations

import math
import numbers
import types
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from dataclasses import fields as dataclass_fields
from typing import TYPE_CHECKING, Any, Literal, NamedTuple, Optional, Union

from array_api_compat import array_namespace, is_array_api_obj, to_device

from . import guards, linalg
from .guards import InverseRootError, InverseRootWarning
from .kronecker import BlockDiagonalFactor, Blocks, Factor, Structure, factor_structure
from .linalg import Array, Coefficients, _check_same_namespace_and_device, _device, _dtype_name

__all__ = [
    "FISMO",
    "FISMOState",
    "InverseRootConfig",
    "InverseRootError",
    "InverseRootWarning",
    "PolarConfig",
    "Preconditioners",
    "RootSchedule",
    "StepLines",
    "StepResult",
    "TRAINING",
    "state_dtype",
    "training_options",
]


@dataclass(frozen=True)
class PolarConfig:
    """How ``Polar(M_t)`` (Algorithm 1 line 8) is computed: see [`polar`][fismo_core.linalg.polar].

    The default (Newton–Schulz, 5 steps, Muon's quintic, Frobenius
    normalisation) is the iteration of ``torch.optim.Muon``, so FISMO with
    ``gamma = 1`` is Muon with EMA momentum, with two differences from torch's
    class: torch runs the iteration in bfloat16 (here it runs in the state's
    dtype), and torch multiplies the learning rate by ``sqrt(max(1, m/n))``
    even when ``adjust_lr_fn=None``.

    ``dtype`` runs the Newton–Schulz iteration in another dtype (by name:
    ``"bfloat16"`` as ``torch.optim.Muon`` does, ``"float16"``,
    ``"float32"``, ``"float64"``; ``None``, the default, is the state's dtype);
    the result comes back in the state's dtype. ``rtol`` is the relative cut
    of the exact ``"svd"`` method below which singular values count as zero
    (``None``: the default of [`polar`][fismo_core.linalg.polar]).
    """

    method: Literal["newton_schulz", "svd"] = "newton_schulz"
    steps: int = 5
    coefficients: Coefficients = "muon"
    eps: float = 1e-7
    dtype: Optional[str] = None
    rtol: Optional[float] = None

    def __post_init__(self) -> None:
        if self.method not in ("newton_schulz", "svd"):
            raise ValueError(f"unknown polar method {self.method!r}: use 'newton_schulz' or 'svd'")
        object.__setattr__(self, "steps", linalg._check_integer("polar steps", self.steps))  # a Python int
        # read twice: validated, then stored
        object.__setattr__(self, "coefficients", linalg._materialised_coefficients(self.coefficients))
        linalg.newton_schulz_schedule(self.coefficients, self.steps)  # validates the coefficients
        if not (isinstance(self.coefficients, str)):
            object.__setattr__(self, "coefficients", tuple(tuple(map(float, t)) for t in self.coefficients))
        object.__setattr__(self, "eps", _check_real("polar eps", self.eps, 0.0, low_open=True))
        if self.dtype is not None and self.dtype not in linalg.POLAR_DTYPE_NAMES:
            raise ValueError(
                f"polar dtype must be None (the state's dtype) or one of {list(linalg.POLAR_DTYPE_NAMES)}, "
                f"got {self.dtype!r}"
            )
        if self.rtol is not None:
            try:
                object.__setattr__(self, "rtol", linalg._check_rtol(self.rtol))
            except ValueError as exc:
                raise ValueError(f"polar {exc}") from None
        if self.method == "svd" and self.dtype is not None:
            raise ValueError(
                f"polar dtype={self.dtype!r} applies to the Newton–Schulz iteration only; the exact 'svd' method "
                "is the reference and runs in the state's dtype: leave dtype=None"
            )

    def __call__(self, X: Array) -> Array:
        return linalg.polar(
            X, method=self.method, steps=self.steps, coefficients=self.coefficients, eps=self.eps,
            rtol=self.rtol, dtype=self.dtype, check=False,  # the optimizer's own checks: fismo_core.guards
        )


@dataclass(frozen=True)
class InverseRootConfig:
    """How ``P_t^{-1/2}`` and ``Q_t^{-1/2}`` are computed: see [`inverse_sqrt`][fismo_core.linalg.inverse_sqrt].

    The default is the exact ``eigh`` method: the reference implementation
    computes Algorithm 1 to rounding error. ``"newton_schulz"`` is matmul-only.

    Fault handling (in [`FISMO.direction`][fismo_core.FISMO.direction]; calling
    the config itself computes the root only). With ``fallback`` on, every root
    ``Z`` of ``A = P_t`` (or ``Q_t``) is checked: it fails if computing it
    raised (``LinAlgError``), if the residual ``||Z A Z - I||_F`` exceeds
    ``tolerance`` or is not finite (a NaN, a non-converged Newton–Schulz
    iteration, an eigenvalue that came out negative), or, with ``eigh``, if
    ``lambda_min <= u lambda_max`` for its eigenvalues (``u = eps / 2`` of
    the state's dtype: ``A`` singular at the precision it is stored in,
    which the residual cannot see). A failed root is
    computed again with ``eigh`` in float64 and checked again (in float64,
    the eigenvalue test still at the state's ``u``). If
    that fails too, the matrix keeps ``P_{t-1}`` and its cached root for
    this step (the other side, ``Q``, then uses ``P_{t-1}``), an
    [`InverseRootWarning`][fismo_core.optimizer.InverseRootWarning] is issued
    and the matrix's ``state.root_failures`` counts up; a step without failure
    resets it to 0. When a matrix fails on more than ``max_failures``
    consecutive steps, the step raises
    [`InverseRootError`][fismo_core.optimizer.InverseRootError] instead.
    The flags of all the roots of a step are read back from the device in
    one host read, after lines 4–8 ([`FISMO.settle`][fismo_core.FISMO.settle]);
    the repair, when a flag is set, takes the step again.
    [`FISMO.direction_with_faults`][fismo_core.FISMO.direction_with_faults]
    leaves the read to the caller. Under ``jax.jit`` nothing can be read and
    the checks are left out.

    Parameters
    ----------
    method, steps, coefficients:
        ``"eigh"`` (exact) or ``"newton_schulz"`` (matmul-only), and for the
        latter the step count and the schedule, as in
        [`inverse_sqrt`][fismo_core.linalg.inverse_sqrt]: by default Polar
        Express, 9 steps. ``steps=None`` means the schedule's default.
    fallback:
        ``None`` (default): on, unless the optimizer runs with
        ``nonfinite="propagate"``, its mode without host synchronisation.
        ``True`` / ``False``: on / off regardless.
    max_failures:
        Consecutive fallbacks of one matrix tolerated before raising (an
        integer >= 0; 0 raises at the first root that cannot be repaired).
    tolerance:
        Bound on ``||Z A Z - I||_F``, in ``(0, 1)``. The default 0.1 accepts
        every root that whitens to 10%: a correct root of a matrix with
        condition number ``kappa`` has a residual of about ``d eps kappa``
        (``eps`` the dtype's unit roundoff, an estimate); measured, float32
        roots pass up to ``kappa ~ 1e6``-``1e7`` and are repaired in float64
        beyond, up to ``1 / u ~ 1.7e7``, past which the eigenvalue test
        fails them (docs/guarantees.md, "The tolerance").
    every:
        Amortisation, as Shampoo's precondition frequency: the roots are
        recomputed on every ``every``-th step only (the steps with
        ``state.step % every == 0``, so the first step always computes
        them: [`is_refresh_step`][fismo_core.InverseRootConfig.is_refresh_step]).
        ``P_t`` and ``Q_t`` are updated at every step regardless; on the
        steps in between, lines 4–8 use the roots of the last
        recomputation, ``P_s^{-1/2}`` and ``Q_s^{-1/2}`` (``s`` that step)
        in place of ``P_t^{-1/2}``, ``Q_t^{-1/2}`` (and their squares in
        place of ``Q_{t-1}^{-1}``, ``P_t^{-1}``), and no root is checked. A
        root that fails on a recomputation step keeps ``P_{t-1}`` with the
        root cached at the previous recomputation (with ``every = 1``: its own).
        That is *not* Algorithm 1: default 1, every step, which is. At most
        ``2**31 - 1``, as the int32 step counts it is compared with.
        The measured effect on the direction is on the documentation page
        "Performance". Deciding needs a concrete step count; under
        ``jax.jit`` pass ``refresh_roots`` to
        [`FISMO.direction`][fismo_core.FISMO.direction] (the optax
        adapter does this with ``jax.lax.cond``).
    matmul_dtype:
        Opt-in, for cost: the dtype (by name, as the polar's ``dtype``:
        ``"bfloat16"``, ``"float16"``, ``"float32"``, ``"float64"``) of the
        matrix products of the preconditioners: the Gram blocks of lines 4–5
        and every product with a root, ``G Q^{-1/2}``, ``P^{-1/2} G``
        (lines 4–6) and the un-whitening of line 8. The operands are cast to
        it and the result back to the state's dtype; ``eigh``, the traces,
        the EMA and the polar factor are untouched. ``None`` (default): the
        state's dtype, Algorithm 1 to rounding error. ``"bfloat16"`` makes
        these products about 4x cheaper on CPUs with bf16 instructions (and
        GPUs), at the direction's deviation measured on the documentation
        page "Performance".
    """

    method: Literal["eigh", "newton_schulz"] = "eigh"
    steps: Optional[int] = None
    fallback: Optional[bool] = None
    max_failures: int = 10
    tolerance: float = 0.1
    coefficients: Coefficients = "polar_express"
    every: int = 1
    matmul_dtype: Optional[str] = None

    def __post_init__(self) -> None:
        if self.method not in ("eigh", "newton_schulz"):
            raise ValueError(f"unknown inverse-root method {self.method!r}: use 'eigh' or 'newton_schulz'")
        if self.steps is not None:  # None: the schedule's default
            object.__setattr__(self, "steps", linalg._check_integer("inverse-root steps", self.steps))
        # read twice: validated, then stored
        object.__setattr__(self, "coefficients", linalg._materialised_coefficients(self.coefficients))
        try:
            linalg.inverse_sqrt_steps(self.coefficients, self.steps)  # validates both
        except ValueError as exc:
            raise ValueError(f"inverse-root {exc}") from exc
        if not isinstance(self.coefficients, str):
            object.__setattr__(self, "coefficients", tuple(tuple(map(float, t)) for t in self.coefficients))
        object.__setattr__(self, "every", linalg._check_integer("inverse-root every", self.every))
        if self.every > _INT32_MAX:  # compared with int32 step counts: jitted updates raised OverflowError
            raise ValueError(f"inverse-root every must be at most {_INT32_MAX} (the step counts are int32), "
                             f"got {self.every}")
        if self.matmul_dtype is not None and self.matmul_dtype not in linalg.POLAR_DTYPE_NAMES:
            raise ValueError(
                f"inverse-root matmul_dtype must be None (the state's dtype) or one of {list(linalg.POLAR_DTYPE_NAMES)}, "
                f"got {self.matmul_dtype!r}"
            )
        if self.fallback is not None and not isinstance(self.fallback, bool):
            raise TypeError(f"inverse-root fallback must be None, True or False, got {self.fallback!r}")
        max_failures = linalg._check_integer("inverse-root max_failures", self.max_failures, minimum=0)
        tolerance = _check_real("inverse-root tolerance", self.tolerance, 0.0, 1.0, low_open=True, high_open=True)
        object.__setattr__(self, "max_failures", max_failures)
        object.__setattr__(self, "tolerance", tolerance)

    def __call__(self, A: Array) -> Array:
        return linalg.inverse_sqrt(  # check=False: the optimizer's own checks are the fault handling above
            A, method=self.method, steps=self.steps, coefficients=self.coefficients, check=False
        )

    def root_and_eigenvalues(self, A: Array) -> tuple[Array, Optional[Array]]:
        """``(A^{-1/2}, w)``: the root as calling the config gives it, bit for bit, and with ``"eigh"`` the
        eigenvalues ``w`` (ascending) it was made of, for the check's eigenvalue test. ``w`` is ``None``
        for Newton–Schulz, which has none, and for a subclass that computes its own root (overrides
        ``__call__``, as a fault injection does): its root is checked by the residual alone."""
        if self.method != "eigh" or type(self).__call__ is not InverseRootConfig.__call__:
            return self(A), None
        return linalg._eigh_inverse_sqrt(A)

    def _is_library_eigh(self) -> bool:
        """Whether the root is this library's ``eigh`` (not a subclass's own ``__call__`` or
        ``root_and_eigenvalues``): then a float64 root was already what the fault handling's retry computes."""
        cls = type(self)
        return (self.method == "eigh" and cls.__call__ is InverseRootConfig.__call__
                and cls.root_and_eigenvalues is InverseRootConfig.root_and_eigenvalues)

    def is_refresh_step(self, step: Any) -> Any:
        """Whether the step taken from a state with ``state.step == step`` recomputes the roots (``every``).

        ``step % every == 0``: the first step (``step = 0``) always does, and
        with ``every = 1`` every step does. ``step`` is an int or a 0-d
        integer array, traced too (the result then goes to ``jax.lax.cond``).
        The one home of this rule: the core and every adapter ask it.
        """
        if self.every == 1:
            return True
        return step % self.every == 0


class FISMOState(NamedTuple):
    """Optimizer state of one matrix or a stack of same-shape matrices ``(..., m, n)``.

    Attributes
    ----------
    P, Q:
        Left and right Kronecker factors ``P_t`` ``(..., m, m)`` and ``Q_t``
        ``(..., n, n)``; symmetric positive definite with traces ``m`` and ``n``.
        With ``FISMO(block_size=B)`` a side longer than ``B`` is a
        [`Blocks`][fismo_core.kronecker.Blocks] of its diagonal blocks instead.
    M:
        Momentum in the whitened space, ``M_t`` ``(..., m, n)``.
    P_inv_sqrt, Q_inv_sqrt:
        Cached ``P_t^{-1/2}`` and ``Q_t^{-1/2}`` (same structure as ``P``,
        ``Q``). The next step needs ``Q_t^{-1}`` in ``L_{t+1}``; it uses
        ``(G Q_t^{-1/2})(G Q_t^{-1/2})^T`` so no inverse is ever formed.
    step:
        Number of steps taken, ``t`` (an int; a 0-d integer array once the
        step has been traced, e.g. under ``jax.jit``). A counter for the
        user: Algorithm 1 itself never reads it (no bias correction). It
        counts calls: with ``nonfinite="skip"`` the steps a matrix actually
        took are ``step - skipped``.
    skipped:
        Per matrix (shape ``(...)``, the batch shape; int32), how many steps
        were skipped because its gradient had a NaN or an infinity
        (``FISMO(nonfinite="skip")``); unchanged by the other policies.
    root_failures:
        Per matrix (int32), how many consecutive steps fell back to the
        previous ``P`` or ``Q`` because an inverse root failed (see
        [`InverseRootConfig`][fismo_core.InverseRootConfig]); 0 after a step
        without failure.

    The two counters default to ``0`` so that a state can be built from the
    first six fields alone; [`FISMO.init`][fismo_core.FISMO.init] makes them
    arrays. For checkpoints use [`to_dict`][fismo_core.FISMOState.to_dict]
    and [`from_dict`][fismo_core.FISMOState.from_dict].
    """

    P: Factor
    Q: Factor
    M: Array
    P_inv_sqrt: Factor
    Q_inv_sqrt: Factor
    step: Union[int, Array]
    skipped: Any = 0
    root_failures: Any = 0

    def to_dict(self) -> dict[str, Any]:
        """The state as a flat dict of arrays for a checkpoint: every field by name, plus a format number.

        Arrays are returned as they are (same library, device and dtype, no
        copy), ``step`` as it is (an int). A blocked factor is stored as its
        full blocks under its name and its remainder block under
        ``"<name>_rest"``; ``"block_size"`` records the block size of the
        split sides (0 when no side is split). ``np.savez(f, **state.to_dict())``
        writes a NumPy state; for other libraries convert the arrays first
        (``torch.save`` takes the dict of a torch state directly).
        [`from_dict`][fismo_core.FISMOState.from_dict] reads it back.
        """
        out: dict[str, Any] = {}
        block_size = 0
        for name, value in self._asdict().items():
            if isinstance(value, Blocks):
                block_size = value.full.shape[-1]
                parts = _parts(value)
                out.update(zip(factor_keys(name, len(parts)), parts))
            else:
                out[name] = value
        return {**out, "block_size": block_size, _FORMAT_KEY: _FORMAT}

    @classmethod
    def from_dict(cls, d: Any, like: Array, *, block_size: Optional[int] = None) -> "FISMOState":
        """Rebuild a state from [`to_dict`][fismo_core.FISMOState.to_dict]'s output for parameters like ``like``.

        The arrays are moved to ``like``'s library and device
        (``xp.asarray(x, device=...)``; an array of another library than
        NumPy through DLPack) but never cast: a state whose dtype
        is not ``state_dtype(like.dtype)`` is an error, so that a resumed run
        is bit-identical to an uninterrupted one.

        Parameters
        ----------
        d:
            A mapping (a dict, or what ``np.load`` returns for an ``.npz``
            file) with the keys ``to_dict`` writes. The counters ``skipped``
            and ``root_failures`` may be missing (they are then 0) or one
            count for the whole batch (0-d, as a state built by hand holds),
            and ``block_size`` may be missing (a state of format 1, before
            blocks existed).
        like:
            The parameters ``W`` ``(..., m, n)`` the state belongs to (or any
            array of that shape and dtype, on the wanted library and device).
        block_size:
            The ``block_size`` of the optimizer that will use the state
            (``None`` or a positive integer, as ``FISMO(block_size=...)``).

        Raises
        ------
        KeyError
            A key is missing, or there are keys a FISMO state does not have.
        ValueError
            The state was saved with another ``block_size`` (the message
            names both); a shape does not fit ``like``; a NaN or an infinity
            in ``P``, ``Q``, ``M`` or a root (`guards.check_saved_finite`:
            the next step would make the parameters NaN); malformed counters
            or step; an unknown format.
        TypeError
            A dtype that is not the state dtype of ``like``; ``d`` not a
            mapping; ``like`` not a real floating array.
        """
        xp = guards.check_matrix(like, "like")
        try:
            keys = set(d.keys())
        except AttributeError:
            raise TypeError(f"d must be a mapping such as FISMOState.to_dict() returns, got {type(d).__name__}") from None
        block_size = linalg._check_integer("block_size", block_size, none_means="full factors")
        if _FORMAT_KEY in keys and _saved_integer(d[_FORMAT_KEY], _FORMAT_KEY) not in (1, _FORMAT):
            raise ValueError(f"unknown FISMO state format {d[_FORMAT_KEY]!r}; this version reads formats 1 and 2")
        *batch, m, n = like.shape
        structures = {"P": factor_structure(m, block_size), "Q": factor_structure(n, block_size)}
        structures["P_inv_sqrt"], structures["Q_inv_sqrt"] = structures["P"], structures["Q"]
        _check_block_size(d, keys, state_block_size(m, n, block_size), block_size, tuple(like.shape))
        layout = state_layout(m, n, block_size)
        required = set(layout) | {"step"}
        missing = sorted(required - keys)
        if missing:
            raise KeyError(f"not a complete FISMO state: missing {missing} (keys present: {sorted(keys)})")
        unknown = sorted(keys - required - {"skipped", "root_failures", "block_size", _FORMAT_KEY})
        if unknown:
            raise KeyError(f"not a FISMO state: unexpected keys {unknown} (a FISMO state has {list(cls._fields)})")
        dev = _creation_device(like)
        dtype = state_dtype(xp, like.dtype)

        def read(key: str, tail: tuple[int, ...]) -> Array:
            x = _saved_array(xp, d[key], like, dev, key)
            if tuple(x.shape) != (*batch, *tail):
                raise ValueError(
                    f"state.{key} has shape {tuple(x.shape)}, but parameters of shape {tuple(like.shape)} "
                    f"need {(*batch, *tail)} (was the state saved for another parameter?)"
                )
            if x.dtype != dtype:
                raise TypeError(
                    f"state.{key} has dtype {x.dtype}, but parameters of dtype {like.dtype} keep their state in "
                    f"{getattr(dtype, '__name__', dtype)}; states are not converted, so that a resumed run is "
                    "bit-identical"
                )
            guards.check_saved_finite(xp, x, key)
            return x

        fields: dict[str, Any] = {}
        for name in _ARRAY_FIELDS:
            if name == "M":
                fields[name] = read("M", layout["M"])
                continue
            structure = structures[name]
            part_keys = factor_keys(name, len(structure.part_shapes()))
            fields[name] = structure.from_parts(tuple(read(key, layout[key]) for key in part_keys))
        for name in ("skipped", "root_failures"):
            if name not in keys:
                fields[name] = xp.zeros(tuple(batch), dtype=xp.int32, device=dev)
                continue
            x = _saved_array(xp, d[name], like, dev, name)
            # One count for the whole batch (0-d) is what a state built by hand holds (the field's default 0).
            if tuple(x.shape) not in ((), tuple(batch)) or not xp.isdtype(x.dtype, "integral"):
                raise ValueError(
                    f"state.{name} must be an integer array of shape {tuple(batch)} (the batch shape of "
                    f"{tuple(like.shape)}) or (), got {x.dtype} of shape {tuple(x.shape)}"
                )
            # Counts, kept as int32 (a narrower dtype is not compared with a bound it cannot hold).
            readable = guards.has_values(x)
            too_big = readable and xp.iinfo(x.dtype).max > _INT32_MAX and not bool(xp.all(x <= _INT32_MAX))
            if too_big or (readable and not bool(xp.all(x >= 0))):
                raise ValueError(f"state.{name} counts must lie in 0..{_INT32_MAX}, got {x!r}")
            fields[name] = xp.astype(xp.broadcast_to(x, tuple(batch)), xp.int32)
        return cls(step=_saved_integer(d["step"], "step"), **fields)


_FACTOR_FIELDS = ("P", "Q", "P_inv_sqrt", "Q_inv_sqrt")
_ARRAY_FIELDS = ("P", "Q", "M", "P_inv_sqrt", "Q_inv_sqrt")
_FORMAT_KEY = "fismo_state_format"
_FORMAT = 2
_INT32_MAX = 2**31 - 1


def _saved_integer(value: Any, key: str) -> int:
    """A saved count (``step``, ``block_size``, the format) as an ``int``: a number or a 0-d array of an
    integer value >= 0 (``torch.optim`` keeps step counts as float tensors), else a ``ValueError`` naming it."""
    try:
        integral = not isinstance(value, (bool, str, bytes)) and getattr(value, "shape", ()) == ()
        integral = integral and "bool" not in str(getattr(value, "dtype", ""))  # a 0-d bool array (any library)
        integral = integral and float(value) == int(value) and int(value) >= 0
    except (TypeError, ValueError, OverflowError):  # None, NaN, infinity, an object
        integral = False
    if not integral:
        raise ValueError(f"state {key} must be an integer >= 0, got {value!r}")
    return int(value)


def _check_block_size(d: Any, keys: set, expected: int, block_size: Optional[int], shape: tuple) -> None:
    """A state saved with another ``block_size`` is refused, naming both values (``expected``: `state_block_size`)."""
    saved = _saved_integer(d["block_size"], "block_size") if "block_size" in keys else 0
    if saved != expected:
        def say(b: int) -> str:
            return f"block_size={b}" if b else "no side split into blocks (block_size=None, or >= both sides)"
        raise ValueError(
            f"the state was saved with {say(saved)}, but this optimizer has block_size={block_size!r}, which for "
            f"parameters of shape {shape} means {say(expected)}: a state cannot change its blocks; load it with "
            f"block_size={saved if saved else None}, or start a new state"
        )


class StepLines(NamedTuple):
    """Every quantity of Algorithm 1 at one step, in the paper's order (`FISMO.step_lines`).

    Factors are as stored in the state (arrays, or
    [`Blocks`][fismo_core.kronecker.Blocks] for a blocked side).
    """

    P: Factor
    """Line 4: ``P_t``."""
    Q: Factor
    """Line 5: ``Q_t``."""
    P_inv_sqrt: Factor
    """``P_t^{-1/2}``."""
    Q_inv_sqrt: Factor
    """``Q_t^{-1/2}``."""
    G_white: Array
    """Line 6: ``G~_t = P_t^{-1/2} G_t Q_t^{-1/2}``."""
    M: Array
    """Line 7: ``M_t``."""
    direction: Array
    """Line 8: ``dW_t = P_t^{-1/2} Polar(M_t) Q_t^{-1/2}``."""
    W: Array
    """Line 9: ``W_t``."""


_CONFIG_FIELDS: dict[type, list[str]] = {
    config: [f.name for f in dataclass_fields(config)] for config in (PolarConfig, InverseRootConfig)
}


def _as_config(value: Any, config_type: type, name: str) -> Any:
    if isinstance(value, config_type):
        return value
    if isinstance(value, str):
        return config_type(method=value)
    if isinstance(value, dict):
        names = _CONFIG_FIELDS[config_type]  # read once: dynamo cannot trace dataclasses.fields
        unknown = {k: v for k, v in value.items() if k not in names}
        if unknown:  # Python's "unexpected keyword argument", which named neither the option nor its fields
            if config_type is PolarConfig and set(unknown) <= set(guards.MUON_POLAR_KEYWORDS):
                raise guards.foreign_keyword_error(f"{name}={{...}} has keys", unknown, polar=value)
            raise TypeError(f"{name} has unknown keys {sorted(map(str, unknown))}: "
                            f"{config_type.__name__} has the fields {names}")
        return config_type(**value)
    raise TypeError(f"{name} must be a {config_type.__name__}, a method name or a dict of its fields, got {value!r}")


_MU_MAX = 1e30
"""The largest damping ``mu``: ``(1 - gamma) mu tr(P_{t-1})`` stays finite in float32 statistics
(float32's largest is 3.4e38) for every side up to 2^24. The damping outweighs the EMA term by
``(1 - gamma) mu / gamma``, so at 1e30 ``P_t = Q_t = I`` to float64's precision for every
``gamma <= 1 - 1e-12`` (``gamma = 1`` keeps them at ``I`` anyway): no larger value would change the step."""


def _check_momentum(beta: Any) -> Any:
    """``beta`` checked: a number in ``[0, 1]`` (returned as a float), or a 0-d real floating array.

    An array ``beta`` is a value that changes between steps without a new
    core (a ``beta`` schedule under ``torch.compile`` or ``jax.jit`` traces
    it as an input instead of a constant). Its value is checked when it can
    be read without a trace (`linalg._readable`); a traced one is the
    caller's to check where it is concrete. A NumPy scalar (``np.float64``,
    which array-api-compat counts as an array) is a number: kept as it is,
    its dtype would promote a float32 ``M_t`` (NumPy 2's scalars are not weak).
    """
    if isinstance(beta, numbers.Real) or not is_array_api_obj(beta):
        return _check_real("beta", beta, 0.0, 1.0)
    xp = array_namespace(beta)
    if beta.ndim != 0 or not xp.isdtype(beta.dtype, "real floating"):
        raise ValueError(
            f"beta must be a number or a 0-d real floating array, got an array of shape {tuple(beta.shape)} "
            f"and dtype {_dtype_name(beta.dtype)}"
        )
    if linalg._readable(beta):
        _check_real("beta", float(beta), 0.0, 1.0)
    return beta


def _check_real(
    name: str, value: Any, low: float, high: float = math.inf, *, low_open: bool = False, high_open: bool = False
) -> float:
    try:  # an int beyond float's range (10**400) raises OverflowError in isfinite
        finite = not isinstance(value, bool) and isinstance(value, numbers.Real) and math.isfinite(value)
    except OverflowError:
        finite = False
    if not finite:
        # An array (a torch tensor, a 0-d NumPy or JAX array) may hold a fine value: say the type is the problem.
        array = hasattr(value, "shape") and not isinstance(value, numbers.Real)
        kind = f" (a Python number, not an array of shape {tuple(value.shape)})" if array else ""
        raise ValueError(f"{name} must be a finite real number{kind}, got {value!r}")
    if value < low or value > high or (low_open and value == low) or (high_open and value == high):
        bracket = "(" if low_open else "["
        upper = "inf)" if high == math.inf else f"{high}{')' if high_open else ']'}"
        raise ValueError(f"{name} must lie in {bracket}{low}, {upper}, got {value!r}")
    return float(value)


TRAINING: Mapping[str, Any] = types.MappingProxyType({
    "statistics": "scale_invariant",
    "nesterov": True,
    "weight_decay": 0.1,
    "mu": 0.1,
    "inv_root": types.MappingProxyType({"every": 10}),
    "block_size": 512,
})
"""The training configuration ("FISMO-T"): what [`FISMO.training`][fismo_core.FISMO.training] sets on top of
the printed Algorithm 1, as a read-only mapping (``inv_root`` is one too). Each setting, and why:

- ``statistics="scale_invariant"``: lines 4–5 take ``G_t / rms(G_t)``, so ``P`` and ``Q`` leave the
  identity at realistic gradient scales (as printed they hardly move, and FISMO is then Muon); the
  documentation page "Results" measures its gain over Muon.
- ``nesterov=True``, ``weight_decay=0.1``: Muon's conventions (``torch.optim.Muon``'s defaults), so
  that Muon's learning rate and tuning carry over.
- ``mu=0.1``: the damping of lines 4–5, a hundred times the printed 1e-3. With the roots amortised,
  1e-3 lets them go stale: on the documentation page "Results" it diverges on the demo's CNN and loses
  the gain over ``torch.optim.Muon`` at 1 M parameters in the scaling study; 0.1 trains the CNN and
  keeps the gain at every size measured.
- ``inv_root={"every": 10}``: the inverse roots recomputed on every 10th step only, as Shampoo's and
  SOAP's precondition frequency, for cost (``every`` of [`InverseRootConfig`][fismo_core.InverseRootConfig]).
- ``block_size=512``: a side longer than 512 gets a block-diagonal factor of ``512 x 512`` blocks (and a
  shorter last one), as Distributed Shampoo's ``max_preconditioner_dim``, so that the cost and the state
  of a step stay bounded at model shapes (GPT-2's 3072, LLaMA's 5504); a side of at most 512 keeps the
  paper's full factor. The documentation page "Performance" measures the cost, "Results" what blocking
  costs in training.

This is *not* Algorithm 1: the printed algorithm stays the default, ``FISMO()``.
"""

#: The options whose value is a config (`PolarConfig`, `InverseRootConfig`): `training_options` merges them.
_CONFIG_OPTIONS = ("polar", "inv_root")


def training_options(preset: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """``preset`` updated by ``overrides``: the one rule of `FISMO.training` and the adapters' ``training``.

    An override replaces the preset's value, except for ``polar`` and
    ``inv_root`` given as a dict or a method name (short for
    ``{"method": name}``, as everywhere in FISMO): those are merged field by
    field into the preset's dict, so ``inv_root={"method": "newton_schulz"}``
    keeps ``every=10``; ``polar="svd"`` drops the preset's Newton–Schulz
    iteration ``dtype`` (the exact method takes none) unless it is given
    too. A `PolarConfig` or `InverseRootConfig` object is
    complete and replaces the preset's as it is. The result holds plain
    dicts (the preset's read-only mappings copied), ready for ``FISMO(**...)``.
    """
    options = {k: dict(v) if isinstance(v, Mapping) else v for k, v in preset.items()}
    for name, value in overrides.items():
        base = options.get(name)
        if name in _CONFIG_OPTIONS and isinstance(base, dict) and isinstance(value, (str, Mapping)):
            given = {"method": value} if isinstance(value, str) else dict(value)
            value = {**base, **given}
            if name == "polar" and value.get("method") == "svd" and "dtype" not in given:
                # The preset's iteration dtype is the Newton–Schulz iteration's; the exact method takes none.
                value["dtype"] = None
        options[name] = value
    return options


def _as_triples(value: Any) -> Optional[tuple[tuple[float, ...], ...]]:
    """Newton–Schulz coefficients as triples of floats; ``None`` for a preset name or what is not numbers."""
    if isinstance(value, str):
        return None
    try:
        items = list(value)
        if all(isinstance(c, numbers.Real) for c in items):
            return (tuple(float(c) for c in items),)
        return tuple(tuple(float(c) for c in t) for t in items)
    except (TypeError, ValueError):
        return None


def _schedule_length(value: Any) -> int:
    """How many (a, b, c) triples coefficients hold before their last repeats (0 for what is not coefficients)."""
    if isinstance(value, str):
        return len(linalg._NAMED_SCHEDULES.get(value, ()))
    return len(_as_triples(value) or ())


def _schedule(value: Any, steps: int) -> Optional[tuple[Any, float]]:
    """What coefficients run for ``steps`` steps, a preset name's included: `linalg.newton_schulz_schedule`'s
    triples and norm safety factor; ``None`` for what is not coefficients (the constructors refuse it)."""
    coefficients: Any = value if isinstance(value, str) else _as_triples(value)  # None: refused below
    try:
        return linalg.newton_schulz_schedule(coefficients, steps)
    except (TypeError, ValueError):
        return None


def check_muon_polar(where: str, given: Mapping[str, tuple[str, Any, Any]], polar: Any) -> None:
    """Refuse a ``polar`` that sets a Newton–Schulz field otherwise than a Muon argument given beside it.

    ``given`` maps each Muon argument of a ``training`` constructor to ``(field, value, default)``: its
    `PolarConfig` field, the value passed and the signature's default. An argument left at its default
    yields to ``polar`` (``polar={"steps": 4}`` alone is 4 steps); one passed with another value beside a
    ``polar`` that sets the field to a third (``ns_steps=3, polar={"steps": 4}``) is a conflict, refused
    with a ``TypeError`` naming both, where ``polar`` silently won. Coefficients are compared as the
    iteration they run, a preset name's included (a `PolarConfig` always holds one: ``"muon"`` unless
    given; until 2026-12-04 names were not compared and ``ns_coefficients`` lost to them without a word).
    """
    if isinstance(polar, PolarConfig):
        fields = {f.name: getattr(polar, f.name) for f in dataclass_fields(PolarConfig)}
    elif isinstance(polar, Mapping):
        fields = dict(polar)
    else:  # None, a method name: no Newton–Schulz field given
        return
    for argument, (name, value, default) in given.items():
        if name not in fields:
            continue
        if name == "coefficients":  # compared over the longest schedule: each repeats its last triple after it
            steps = max(1, *map(_schedule_length, (value, default, fields[name])))
            mine, default, theirs = (_schedule(c, steps) for c in (value, default, fields[name]))
            if mine is None or theirs is None or mine == default:
                continue
            agree = mine == theirs
        else:
            if value is None or fields[name] is None or value == default:
                continue
            agree = value == fields[name]
        if not agree:
            raise TypeError(
                f"{where}: {argument}={value!r} and polar's {name}={fields[name]!r} disagree: give the "
                f"Newton–Schulz {name} once, as {argument}= or in polar"
            )


@guards.foreign_keywords("fismo_core.FISMO")
@dataclass(frozen=True)
class FISMO:
    """FISMO (Algorithm 1) for matrix parameters, as pure functions of arrays.

    Hyperparameters carry the paper's symbols; the choice of defaults is
    explained on the documentation page "Algorithm 1, line by line".

    Parameters
    ----------
    lr:
        Learning rate ``eta`` (> 0). Default 0.02, Muon's reference value.
    beta:
        Momentum ``beta`` in ``[0, 1]`` (line 7). Default 0.95, as Muon. A
        0-d real floating array (of the parameters' library; torch takes a
        CPU tensor beside CUDA ones) is taken as it is and read at every step, so
        that a schedule of ``beta`` is an input to a traced step, not a
        constant of it (``torch.compile``, ``jax.jit``); line 7 rounds it, and
        ``1 - beta``, to the state's dtype, as it does a number. Its value is
        checked unless it is traced.
    gamma:
        Preconditioner EMA ``gamma`` in ``[0, 1]`` (lines 4 and 5). Default
        0.95, the preconditioner EMA of SOAP. ``gamma = 1`` freezes ``P`` and
        ``Q`` at the identity, and FISMO is Muon with EMA momentum.
    mu:
        Damping ``mu >= 0`` (lines 4 and 5): ``L_t`` and ``R_t`` get
        ``mu tr(P_{t-1})/m I`` and ``mu tr(Q_{t-1})/n I``, a floor under the
        preconditioners' eigenvalues. Default 1e-3. ``mu = 0`` needs
        ``gamma > 0`` (the EMA keeps ``P_{t-1}``'s positive definiteness).
        At most 1e30: a larger damping would overflow float32 statistics,
        and at 1e30 ``P_t = Q_t = I`` to float64's precision already.
    polar:
        How ``Polar(M_t)`` is computed: a [`PolarConfig`][fismo_core.PolarConfig], a method name
        (``"newton_schulz"``, ``"svd"``) or a dict of its fields. Muon's
        ``ns_steps``, ``ns_coefficients`` and ``eps`` are its fields; passed
        here under Muon's names (or ``momentum`` for ``beta``) they raise a
        ``TypeError`` that gives this spelling
        ([`foreign_keywords`][fismo_core.guards.foreign_keywords]).
    inv_root:
        How ``P_t^{-1/2}``, ``Q_t^{-1/2}`` are computed: an
        [`InverseRootConfig`][fismo_core.InverseRootConfig], a method name (``"eigh"``,
        ``"newton_schulz"``) or a dict of its fields.
    weight_decay:
        Decoupled weight decay ``lambda >= 0``: ``W <- (1 - eta lambda) W - eta dW``.
        Not in Algorithm 1; default 0.
    nesterov:
        Nesterov momentum, as ``torch.optim.Muon(nesterov=True)`` but in the
        whitened space: line 8 orthogonalises ``beta M_t + (1 - beta) G~_t``
        instead of ``M_t``. Not in Algorithm 1; default off.
    nonfinite:
        What a NaN or infinity in the gradient does. ``"raise"`` (default): a
        ``ValueError`` before anything changes; this reads one boolean back
        from the device per call (inside ``jax.jit`` nothing can be read and
        the check is left out). ``"skip"``: per matrix (also within a batch),
        a gradient with a NaN or an infinity skips that matrix's step: its
        ``W``, ``P``, ``Q``, ``M`` and roots stay as they were, its direction
        is 0 and its ``state.skipped`` counts up; sync-free (``where``), so it
        works under ``jax.jit``. ``"propagate"``: no check and no host
        synchronisation; non-finite values flow into the state, for GPU
        pipelines that check the loss themselves (this also turns off the
        inverse-root checks of [`InverseRootConfig`][fismo_core.InverseRootConfig]
        unless they are asked for).
    statistics:
        Which gradient enters the Gram products of lines 4 and 5.
        ``"printed"`` (default): ``G_t``, exactly Algorithm 1. Its EMA then
        depends on the gradient scale: for entries of root mean square
        ``sigma << 1``, ``P`` and ``Q`` hardly leave the identity (see the
        page "Notes on the algorithm"). ``"scale_invariant"``: a variant, not
        in the paper: ``G_t / rms(G_t)`` with ``rms(G) = ||G||_F / sqrt(mn)``
        (per matrix; a zero gradient is left as it is), so the data part of
        ``L_t`` has trace ``m`` when ``Q_{t-1} = I`` whatever ``sigma``, and
        ``P_t``, ``Q_t`` are exactly invariant to ``G_t -> c G_t``. Lines 6–9
        use ``G_t`` unchanged. Both coincide when ``rms(G_t) = 1``.
    block_size:
        ``None`` (default): full ``m x m`` and ``n x n`` factors, the printed
        algorithm. A positive integer ``B``: each side longer than ``B`` keeps
        only the diagonal blocks of ``P`` and ``Q``, contiguous blocks of size
        ``B`` with the last one holding the remainder; lines 4 and 5 keep
        only the diagonal blocks of their data terms, damping, EMA,
        symmetrisation and trace normalisation act on the whole
        block-diagonal factor (``tr P_t = m`` over all blocks), and lines
        6–8 use the block-diagonal roots with the polar factor of the whole
        ``M_t``. Nothing ``m x m`` or ``n x n`` is formed: the statistics cost
        ``O(m n B)`` and the state at most ``m n + 2 (m + n) B`` elements. A
        side of size ``<= B`` is one block, the full factor, so
        ``B >= max(m, n)`` is the printed algorithm bit for bit. Every other
        option works with blocks. See the page "Scaling up".

    Examples
    --------
    One step on a ``4 x 3`` matrix of array-api-strict, the array API
    standard and nothing more (NumPy, PyTorch, JAX and CuPy arrays work
    alike). ``init`` is ``P_0 = I``, ``Q_0 = I``, ``M_0 = 0``; ``step`` is
    lines 4–9 and returns new arrays of the input's library and dtype:

    >>> import array_api_strict as xp
    >>> from fismo_core import FISMO
    >>> opt = FISMO(lr=0.02, beta=0.95, gamma=0.95, mu=1e-3)
    >>> W = xp.ones((4, 3), dtype=xp.float64)
    >>> state = opt.init(W)
    >>> G = xp.reshape(xp.arange(12, dtype=xp.float64), (4, 3)) / 12
    >>> W_new, state = opt.step(W, G, state)
    >>> W_new.shape, W_new.dtype == xp.float64, state.step
    ((4, 3), True, 1)
    >>> state.P.shape, state.Q.shape, state.M.shape
    ((4, 4), (3, 3), (4, 3))

    ``P_t`` is symmetric with trace ``m`` (line 4's normalisation), and line
    9 moved ``W`` by ``lr * dW_t``:

    >>> bool(xp.all(state.P == xp.matrix_transpose(state.P))), round(float(xp.linalg.trace(state.P)), 9)
    (True, 4.0)
    >>> bool(xp.all(W_new == W))
    False

    With ``block_size=B`` a side longer than ``B`` keeps its diagonal blocks
    (a [`Blocks`][fismo_core.kronecker.Blocks]: ``k`` full blocks and the
    remainder):

    >>> blocked = FISMO(block_size=3).init(xp.ones((7, 2), dtype=xp.float64))
    >>> blocked.P.full.shape, blocked.P.rest.shape, blocked.Q.shape
    ((2, 3, 3), (1, 1), (2, 2))
    """

    lr: float = 0.02
    beta: Union[float, Array] = 0.95
    gamma: float = 0.95
    mu: float = 1e-3
    polar: PolarConfig = field(default_factory=PolarConfig)
    inv_root: InverseRootConfig = field(default_factory=InverseRootConfig)
    weight_decay: float = 0.0
    nesterov: bool = False
    nonfinite: Literal["raise", "skip", "propagate"] = "raise"
    statistics: Literal["printed", "scale_invariant"] = "printed"
    block_size: Optional[int] = None

    if TYPE_CHECKING:  # the constructor also takes a method name or a dict for polar and inv_root
        def __init__(
            self, lr: float = 0.02, beta: Union[float, Array] = 0.95, gamma: float = 0.95, mu: float = 1e-3,
            polar: Union[PolarConfig, str, dict[str, Any]] = PolarConfig(),
            inv_root: Union[InverseRootConfig, str, dict[str, Any]] = InverseRootConfig(),
            weight_decay: float = 0.0, nesterov: bool = False,
            nonfinite: Literal["raise", "skip", "propagate"] = "raise",
            statistics: Literal["printed", "scale_invariant"] = "printed", block_size: Optional[int] = None,
        ) -> None: ...

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        set_(self, "lr", _check_real("lr", self.lr, 0.0, low_open=True))
        set_(self, "beta", _check_momentum(self.beta))
        set_(self, "gamma", _check_real("gamma", self.gamma, 0.0, 1.0))
        set_(self, "mu", _check_real("mu", self.mu, 0.0))
        if self.mu > _MU_MAX:
            raise ValueError(
                f"mu must be at most {_MU_MAX:g}, got {self.mu!r}: a larger damping overflows float32 statistics, "
                "and at 1e30 it already makes P_t = Q_t = I to float64's precision (no larger value would change the step)"
            )
        if self.gamma == 0.0 and self.mu == 0.0:
            raise ValueError(
                "gamma=0 with mu=0 makes P_t and Q_t the current gradient's statistics alone, without a floor: "
                "one of them is singular for every non-square G (P for a tall one, Q for a wide one), both for a "
                "G of rank below min(m, n) (the paper's positivity "
                "argument needs gamma > 0 or mu > 0). Give mu > 0 or gamma > 0"
            )
        set_(self, "weight_decay", _check_real("weight_decay", self.weight_decay, 0.0))
        set_(self, "nesterov", linalg._check_bool("nesterov", self.nesterov))
        guards.check_nonfinite_policy(self.nonfinite)
        if self.statistics not in ("printed", "scale_invariant"):
            raise ValueError(f"statistics must be 'printed' or 'scale_invariant', got {self.statistics!r}")
        set_(
            self, "block_size",
            linalg._check_integer("block_size", self.block_size, none_means="full factors, the printed algorithm"),
        )
        set_(self, "polar", _as_config(self.polar, PolarConfig, "polar"))
        set_(self, "inv_root", _as_config(self.inv_root, InverseRootConfig, "inv_root"))

    @classmethod
    def training(cls, **overrides: Any) -> "FISMO":
        """The training configuration: ``FISMO(**TRAINING)`` updated by ``overrides``.

        [`TRAINING`][fismo_core.optimizer.TRAINING] is the printed algorithm
        plus the scale-invariant statistics, Nesterov momentum, decoupled
        weight decay 0.1, the damping ``mu=0.1``, the roots recomputed every
        10 steps and blocks of 512 on longer sides (``block_size=None`` for
        full factors); the other
        hyperparameters keep ``FISMO``'s defaults (``lr=0.02``). It is *not*
        Algorithm 1, which stays ``FISMO()``. ``overrides`` are any of
        ``FISMO``'s keywords, taking precedence over the preset; ``polar`` and
        ``inv_root`` given as a dict or a method name are merged field by
        field into the preset's (`training_options`), so
        ``FISMO.training(inv_root={"method": "newton_schulz"})`` still
        recomputes the roots every 10 steps, and
        ``FISMO.training(inv_root={"every": 1})`` every step. The core
        applies no learning-rate adjustment across shapes (the torch
        adapter's ``FISMO.training`` does, as ``torch.optim.Muon``). Bad
        overrides raise as ``FISMO(...)`` does, naming the keyword.

        >>> from fismo_core import FISMO
        >>> opt = FISMO.training(lr=0.01)
        >>> opt.statistics, opt.nesterov, opt.weight_decay, opt.mu, opt.inv_root.every, opt.block_size, opt.lr
        ('scale_invariant', True, 0.1, 0.1, 10, 512, 0.01)
        """
        return cls(**training_options(TRAINING, overrides))

    # ------------------------------------------------------------------ init
    def init(self, W: Array, *, name: str = "W", check_size: bool = True) -> FISMOState:
        """Initial state for parameters ``W`` ``(..., m, n)``: ``P_0 = I``, ``Q_0 = I``, ``M_0 = 0``.

        The state's dtype is ``W``'s if it is float32 or float64, float32 for
        narrower ``W`` (statistics of bf16/fp16 parameters are kept in
        float32) and float64 for wider (NumPy's long double, which no
        eigensolver takes): `state_dtype`. Its device
        and namespace are ``W``'s. With ``block_size``, a side longer than it
        keeps only its diagonal blocks (identity blocks here).

        A [`FactorSizeWarning`][fismo_core.guards.FactorSizeWarning] says so
        when the factors would hold far more entries than ``W`` (a thin
        ``(1, 2000)`` matrix keeps a ``2000 x 2000`` ``Q``; the rule is
        [`check_factor_size`][fismo_core.guards.check_factor_size]'s);
        ``name`` is how it names ``W`` in this warning and in the errors for a
        ``W`` that is not a real floating, non-empty stack of matrices (the
        adapters pass the parameter's name). ``check_size=False``: no such
        warning here, for an adapter that checks every new matrix itself
        (the torch adapter, on every rank of a distributed step: a warning
        turned into an error must stop every rank, not the owner alone).
        """
        xp = guards.check_matrix(W, name)
        dtype = state_dtype(xp, W.dtype)
        *batch, m, n = W.shape
        if math.prod(W.shape) == 0:  # lines 4-5 would reduce over nothing: no statistics, no step
            raise ValueError(f"{name} has shape {tuple(W.shape)}, with no entries: FISMO steps non-empty matrices only")
        if check_size:
            guards.check_factor_size(m, n, self.block_size, name)
        dev = _creation_device(W)
        left, right = self.structures(m, n)
        P = left.identity(xp, tuple(batch), dtype, dev)
        Q = right.identity(xp, tuple(batch), dtype, dev)
        # The roots are separate arrays (equal to P and Q), so in-place adapters never alias them.
        return FISMOState(
            P=P, Q=Q, M=xp.zeros((*batch, m, n), dtype=dtype, device=dev),
            P_inv_sqrt=left.identity(xp, tuple(batch), dtype, dev),
            Q_inv_sqrt=right.identity(xp, tuple(batch), dtype, dev), step=0,
            skipped=xp.zeros(tuple(batch), dtype=xp.int32, device=dev),
            root_failures=xp.zeros(tuple(batch), dtype=xp.int32, device=dev),
        )

    def structures(self, m: int, n: int) -> tuple[Structure, Structure]:
        """The structures of ``P`` (``m x m``) and ``Q`` (``n x n``): full, or block-diagonal (``block_size``)."""
        dtype = self.inv_root.matmul_dtype  # the products' dtype: None, the state's
        return factor_structure(m, self.block_size, dtype), factor_structure(n, self.block_size, dtype)

    # ------------------------------------------------------------- Algorithm 1
    def _algorithm_1(
        self, G: Array, scale: Any, inv_s2: Any, state: FISMOState, left: Structure, right: Structure,
        roots: "_InverseRoots",
    ) -> "_Lines":
        """Lines 4–8 of Algorithm 1 for ``G = G_t / scale``, in the paper's order and symbols.

        Four phases, each a function of the data the previous one returns:
        lines 4–5 give the `Preconditioners` (``P_t``, ``Q_t``, their roots
        and the roots' fault flags), line 6 whitens, line 7 updates the
        momentum, line 8 takes the polar factor and un-whitens. ``left`` and
        ``right`` are the structures of ``P`` and ``Q``; ``roots`` takes an
        inverse root (`_InverseRoots`). ``scale`` and ``inv_s2`` come from
        `fismo_core.guards.statistics_scale`: lines 4–5 are invariant to the
        scale of ``G``, lines 6–7 multiply it back.
        """
        beta, one_minus_beta = _momentum_weights(self.beta, state.M.dtype)
        pre = self._lines_4_5(G, inv_s2, state, left, right, roots)
        G_white = _line_6(pre, left, right, roots.refresh)  # G~_t / scale
        # Line 7: M_t = beta M_{t-1} + (1 - beta) G~_t.
        M = beta * state.M + one_minus_beta * scale * G_white
        # Line 8: dW_t = P_t^{-1/2} Polar(M_t) Q_t^{-1/2} (Nesterov: Polar(beta M_t + (1 - beta) G~_t)).
        momentum = beta * M + one_minus_beta * scale * G_white if self.nesterov else M
        direction = right.right(left.left(pre.P_inv_sqrt, self.polar(momentum)), pre.Q_inv_sqrt)
        return _Lines(pre, G_white, M, direction)

    def _lines_4_5(
        self, G: Array, inv_s2: Any, state: FISMOState, left: Structure, right: Structure, roots: "_InverseRoots"
    ) -> "Preconditioners":
        """Lines 4–5: ``P_t`` from ``Q_{t-1}``, then ``Q_t`` from the new ``P_t`` (Gauss–Seidel), and their roots."""
        gamma, mu = self.gamma, self.mu
        xp = array_namespace(G)
        m, n = G.shape[-2], G.shape[-1]
        P, Q, P_is, Q_is = state.P, state.Q, state.P_inv_sqrt, state.Q_inv_sqrt
        if gamma == 1.0:  # P~_t = P_{t-1}: lines 4-5 return P_{t-1}, Q_{t-1} and their roots unchanged
            return Preconditioners(P, Q, P_is, Q_is, None, None, None, left.left(P_is, G))
        # Line 4: L_t = G Q_{t-1}^{-1} G^T / n + mu tr(P_{t-1})/m I,  P~_t = gamma P_{t-1} + (1 - gamma) L_t,
        #         P_t = sym(m P~_t / tr P~_t); the data term is the Gram matrix of G Q_{t-1}^{-1/2}.
        G_Q_is = right.right(G, Q_is)
        P, P_is, P_failed = roots(left, left.update(P, G_Q_is, n, gamma, mu, inv_s2), P, P_is, "P")
        # Line 5: R_t = G^T P_t^{-1} G / m + mu tr(Q_{t-1})/n I, likewise with (P_t^{-1/2} G)^T.
        P_is_G = left.left(P_is, G)
        Q_new = right.update(Q, xp.matrix_transpose(P_is_G), m, gamma, mu, inv_s2)
        Q, Q_is, Q_failed = roots(right, Q_new, Q, Q_is, "Q")
        return Preconditioners(P, Q, P_is, Q_is, P_failed, Q_failed, G_Q_is, P_is_G)

    # ------------------------------------------------------------- direction
    def direction(
        self, G: Array, state: FISMOState, *, refresh_roots: Union[None, bool, "RootSchedule"] = None
    ) -> tuple[Array, FISMOState]:
        """Lines 4–8: the update direction ``dW_t`` and the new state, from gradient ``G_t``.

        ``dW_t = P_t^{-1/2} Polar(M_t) Q_t^{-1/2}``; the parameters move by
        ``-lr * dW_t`` (line 9, [`step`][fismo_core.FISMO.step]). ``dW_t`` has the state's dtype.
        Preconditioners are updated Gauss–Seidel: ``P_t`` from ``Q_{t-1}``,
        then ``Q_t`` from the new ``P_t``.

        ``refresh_roots`` overrides the schedule of
        [`InverseRootConfig.every`][fismo_core.InverseRootConfig]: ``True``
        recomputes the roots at this step, ``False`` keeps the cached ones, a
        [`RootSchedule`][fismo_core.RootSchedule] decides per matrix of a stack
        from an array (no host read; roots not checked). ``None`` (default)
        decides from ``state.step``, which must then be concrete unless ``every == 1``.

        Host reads: with ``nonfinite="raise"`` one for the finiteness of
        ``G``, and one for the checks of the roots when they are checked; none
        under ``nonfinite="propagate"``. To read once per step for many calls,
        use [`direction_with_faults`][fismo_core.FISMO.direction_with_faults].
        """
        xp = _check_call(G, state, self.block_size, self.beta)
        if self.nonfinite == "raise":
            guards.check_finite(xp, G, dtype=state.M.dtype)
        refresh = self._refresh_roots(state, refresh_roots)
        step = self._settle(xp, G, state, self._guarded_step(xp, G, state, refresh, repair=False), refresh)
        return step.result.direction, step.result.state

    def direction_with_faults(
        self, G: Array, state: FISMOState, *, refresh_roots: Union[None, bool, "RootSchedule"] = None
    ) -> "StepResult":
        """Lines 4–8 as [`direction`][fismo_core.FISMO.direction] without any host read: direction, state, fault flags.

        Returns a `StepResult` whose ``faults``
        ([`StepFaults`][fismo_core.guards.StepFaults]) stay arrays on the
        device: per matrix, whether an inverse root failed its check
        (``roots``; ``None`` when the roots are not checked, as under
        ``nonfinite="propagate"`` by default, or not recomputed at this
        step) and, under ``nonfinite="raise"``, whether ``G`` has a NaN or an
        infinity (``nonfinite``; such a matrix is computed with ``G = 0``
        rather than refused, so nothing non-finite reaches the roots). Where
        no flag is set, ``direction`` and ``state`` are those of `direction`,
        bit for bit. Otherwise [`settle`][fismo_core.FISMO.settle] gives
        `direction`'s answer: its ``ValueError``, or the step taken again
        with the fault handling of `InverseRootConfig`.

        This is the entry point for a caller that reads a whole step's flags
        at once: the torch adapter reads its own (gradients, parameters) and
        every bucket's in one [`read_faults`][fismo_core.guards.read_faults],
        and calls `settle` only when that says a flag is set. With
        ``nonfinite="propagate"`` there is nothing to read, and
        ``torch.compile(fullgraph=True)`` traces it (and `direction`) as one
        graph. ``refresh_roots`` is as in `direction`; pass it explicitly
        when ``state.step`` is not a Python int.
        """
        xp = _check_call(G, state, self.block_size, self.beta)
        refresh = self._refresh_roots(state, refresh_roots)
        return self._guarded_step(xp, G, state, refresh, repair=False, defer_nonfinite=True).result

    def settle(
        self, G: Array, state: FISMOState, result: "StepResult", *, refresh_roots: Union[None, bool, "RootSchedule"] = None
    ) -> tuple[Array, FISMOState]:
        """The host read [`direction_with_faults`][fismo_core.FISMO.direction_with_faults] leaves out, and what follows.

        ``G``, ``state`` and ``refresh_roots`` are those of the call that
        returned ``result``. Returns ``(dW_t, new state)`` exactly as
        [`direction`][fismo_core.FISMO.direction] does, after one host read of
        ``result.faults`` ([`read_faults`][fismo_core.guards.read_faults];
        none when nothing was checked). No flag set: ``result``'s direction
        and state as they are. A ``G`` with a NaN or an infinity under
        ``nonfinite="raise"``: `direction`'s ``ValueError``. An inverse root
        that failed its check: the step is taken again with the fault
        handling of `InverseRootConfig` (float64 retry, fallback to
        ``P_{t-1}``, [`InverseRootWarning`][fismo_core.optimizer.InverseRootWarning],
        and [`InverseRootError`][fismo_core.optimizer.InverseRootError] with
        its ``indices`` after ``max_failures``), whose reads and second
        computation only a faulty step pays. Under ``jax.jit`` nothing can
        be read: the answer is `direction`'s under ``jax.jit``, the step whose
        checks step aside (the compiler drops ``result``'s computation).
        """
        xp = _check_call(G, state, self.block_size, self.beta)
        if not isinstance(result, StepResult):
            raise TypeError(
                f"result must be the StepResult of FISMO.direction_with_faults, got {type(result).__name__}"
            )
        refresh = self._refresh_roots(state, refresh_roots)
        step = self._settle(xp, G, state, _Step(result, None, None), refresh)
        return step.result.direction, step.result.state

    def _guarded_step(
        self, xp: Any, G: Array, state: FISMOState, refresh: Union[bool, "RootSchedule"], *, repair: bool,
        defer_nonfinite: bool = False,
    ) -> "_Step":
        """`_algorithm_1` inside the guards: ``G``'s dtype and layout, non-finite policy, statistics scale, counters.

        ``repair=False``: no host read; a root that fails its check is only
        flagged (``faults.roots``, `guards.checked_inverse_sqrt`).
        ``repair=True``: the fault handling of `InverseRootConfig`
        (`guards.guarded_inverse_sqrt`, `guards.root_failure_counts`), with
        its host reads. ``defer_nonfinite``: under ``nonfinite="raise"`` a
        matrix whose ``G`` has a NaN or an infinity is computed with
        ``G = 0`` and flagged (``faults.nonfinite``), for the caller to read.
        """
        # A copy in the standard layout: BLAS may round a product with a transposed or strided
        # operand differently, and the result must not depend on how G is laid out in memory.
        G = xp.reshape(xp.astype(G, state.M.dtype, copy=False), G.shape, copy=True)
        skip = nonfinite = None
        if self.nonfinite == "skip":
            skip, G = guards.skip_mask(xp, G)
        elif self.nonfinite == "raise" and defer_nonfinite:  # the same mask, read later instead of skipped
            nonfinite, G = guards.skip_mask(xp, G)
        if self.gamma == 1.0:
            G_s, scale, inv_s2 = G, 1.0, 1.0
        else:
            G_s, scale, inv_s2 = guards.statistics_scale(xp, G, self.statistics)
        left, right = self.structures(G.shape[-2], G.shape[-1])
        roots = _InverseRoots(self, xp, refresh, G.ndim - 2, repair)
        try:
            lines = self._algorithm_1(G_s, scale, inv_s2, state, left, right, roots)
        except Exception as exc:
            # A root that failed its check is NaN here, flagged for later; an SVD polar factor raises on the
            # NaN it gives (NumPy, torch) before the flag is read. The repaired step decides instead.
            if repair or not (refresh is not False and guards.checks_roots(self.inv_root.fallback, self.nonfinite)) \
                    or not guards.is_linalg_error(exc):
                raise
            return self._guarded_step(xp, G, state, refresh, repair=True, defer_nonfinite=defer_nonfinite)
        pre = lines.preconditioners
        if repair:
            root_failures = guards.root_failure_counts(xp, self.inv_root, state, pre.P_failed, pre.Q_failed)
            faults = guards.StepFaults(nonfinite=nonfinite)  # a deferred non-finite G is still the caller's to read
        else:
            failed = guards.either_failed(pre.P_failed, pre.Q_failed)
            root_failures = guards.counted_root_failures(xp, state, failed)
            faults = guards.StepFaults(nonfinite=nonfinite, roots=failed)
        new_state = FISMOState(
            P=pre.P, Q=pre.Q, M=lines.M, P_inv_sqrt=pre.P_inv_sqrt, Q_inv_sqrt=pre.Q_inv_sqrt,
            step=state.step + 1, skipped=state.skipped, root_failures=root_failures,
        )
        direction = lines.direction
        if skip is not None:
            direction, new_state = guards.restore_skipped(xp, skip, direction, state, new_state, _ARRAY_FIELDS)
        return _Step(StepResult(direction, new_state, faults), lines, scale)

    def _settle(
        self, xp: Any, G: Array, state: FISMOState, step: "_Step", refresh: Union[bool, "RootSchedule"]
    ) -> "_Step":
        """`settle` for a step of `_guarded_step` (``repair=False``): the one host read, and what a fault calls for."""
        faults = step.result.faults
        found = guards.read_faults(faults)
        if found is None:  # traced (jax.jit): nothing can be read, and the fault handling's checks step aside;
            # its trace is the step to return (the first one, left unused, is dead code to the compiler).
            return self._guarded_step(xp, G, state, refresh, repair=True)
        if not found:
            return step
        if faults.nonfinite is not None:
            guards.check_finite(xp, G, dtype=state.M.dtype)  # raises, saying what and how many
        # A root failed its check: this step again, with the fault handling of InverseRootConfig.
        return self._guarded_step(xp, G, state, refresh, repair=True)

    def _refresh_roots(
        self, state: FISMOState, refresh_roots: Union[None, bool, RootSchedule]
    ) -> Union[bool, RootSchedule]:
        """Whether this step recomputes ``P_t^{-1/2}``, ``Q_t^{-1/2}`` (`InverseRootConfig.every`): a bool, or
        a `RootSchedule` checked against the state and the policy."""
        if isinstance(refresh_roots, RootSchedule) and type(refresh_roots.due) is bool:
            # What is_refresh_step gives for every = 1, whatever the step counts: the docstring's own recipe
            # raised for every = 1 (a user's hunt, 2026-12-04). The same for every matrix: the bool itself.
            refresh_roots = refresh_roots.due
        if isinstance(refresh_roots, RootSchedule):
            due, batch = refresh_roots.due, tuple(state.M.shape[:-2])
            if not is_array_api_obj(due) or due.dtype != array_namespace(due).bool:
                raise TypeError(f"a RootSchedule's due must be a boolean array, got {due!r}")
            linalg._check_same_namespace_and_device(due, state.M)  # the library and device of the state
            if tuple(due.shape) != batch:
                raise ValueError(
                    f"a RootSchedule needs one flag per matrix of the stack, shape {batch}, got due of shape "
                    f"{tuple(due.shape)}"
                )
            if guards.checks_roots(self.inv_root.fallback, self.nonfinite):
                raise ValueError(
                    "a RootSchedule needs roots that are not checked (nonfinite='propagate', or "
                    "InverseRootConfig(fallback=False)): it returns no fault flag per matrix"
                )
            return refresh_roots
        if refresh_roots is not None:
            if not isinstance(refresh_roots, bool):
                raise TypeError(f"refresh_roots must be None, True, False or a RootSchedule, got {refresh_roots!r}")
            return refresh_roots
        every = self.inv_root.every
        try:
            return bool(self.inv_root.is_refresh_step(state.step))
        except TypeError:  # traced (jax.errors.ConcretizationTypeError): no value to decide on
            raise ValueError(
                f"InverseRootConfig(every={every}) recomputes the roots when state.step % {every} == 0, and "
                "state.step is traced here (jax.jit): pass refresh_roots=True/False to FISMO.step or "
                "FISMO.direction, e.g. under jax.lax.cond (fismo_core.backends.optax does this)"
            ) from None

    # ------------------------------------------------------------------ step
    def step(
        self, W: Array, G: Array, state: FISMOState, *, refresh_roots: Union[None, bool, "RootSchedule"] = None
    ) -> tuple[Array, FISMOState]:
        """One full iteration: line 9, ``W_t = W_{t-1} - lr dW_t`` (after decoupled weight decay).

        Returns the new parameters (``W``'s dtype) and the new state. With
        ``nonfinite="raise"`` a NaN or infinity in ``W`` or ``G`` is a
        ``ValueError`` before anything changes. ``refresh_roots``: as for
        [`direction`][fismo_core.FISMO.direction]; under ``jax.jit`` with roots
        every ``k > 1`` steps (`FISMO.training`), decide it with ``jax.lax.cond``
        on ``state.step``, whose value a trace does not have.
        """
        W_new, new_state, _ = self._step(W, G, state, lines=False, refresh_roots=refresh_roots)
        return W_new, new_state

    def step_lines(
        self, W: Array, G: Array, state: FISMOState, *, refresh_roots: Union[None, bool, "RootSchedule"] = None
    ) -> tuple[Array, FISMOState, StepLines]:
        """`step`, also returning every quantity of Algorithm 1 at this step (a `StepLines`).

        The arithmetic is that of `step`; the extra output costs one scaling
        of ``G~_t``. Used by ``fismo verify`` to say at which line two
        backends part.
        """
        return self._step(W, G, state, lines=True, refresh_roots=refresh_roots)

    def _step(
        self, W: Array, G: Array, state: FISMOState, lines: bool, refresh_roots: Union[None, bool, "RootSchedule"]
    ) -> tuple[Array, FISMOState, Any]:
        xp = guards.check_matrix(W, "W")
        guards.check_matrix(G, "G")
        if tuple(W.shape) != tuple(G.shape):
            raise ValueError(f"W and G must have the same shape, got W {tuple(W.shape)} and G {tuple(G.shape)}")
        _check_same_namespace_and_device(W, G)
        _check_call(G, state, self.block_size, self.beta)
        check_state_dtype(xp, state, W.dtype)
        if self.nonfinite == "raise":
            guards.check_finite(xp, G, W=W, dtype=state.M.dtype)
        refresh = self._refresh_roots(state, refresh_roots)
        step = self._settle(xp, G, state, self._guarded_step(xp, G, state, refresh, repair=False), refresh)
        direction, new_state = step.result.direction, step.result.state
        W_new = line_9(W, direction, self.lr, self.weight_decay)  # line 9, with decoupled weight decay
        if self.nonfinite == "skip":  # a skipped matrix keeps W_{t-1} exactly: no weight decay either
            skipped_now = (new_state.skipped - state.skipped) > 0
            W_new = xp.where(skipped_now[..., None, None], W, W_new)
        if not lines:
            return W_new, new_state, None
        s = new_state
        assert step.lines is not None  # _guarded_step returns the lines of every step it takes
        return W_new, new_state, StepLines(
            s.P, s.Q, s.P_inv_sqrt, s.Q_inv_sqrt, step.scale * step.lines.G_white, s.M, direction, W_new
        )


# The constructor dataclass made from the fields says polar and inv_root take their configs alone; at run time
# (inspect.signature, typing.get_type_hints, validators such as pydantic's) it says what the constructor
# declared for type checkers above says: a config, a method name or a dict.
FISMO.__init__.__annotations__.update(
    polar="Union[PolarConfig, str, dict[str, Any]]", inv_root="Union[InverseRootConfig, str, dict[str, Any]]"
)


class Preconditioners(NamedTuple):
    """Lines 4–5 of one step, as `FISMO._algorithm_1` passes them on to lines 6–8.

    Factors are as stored in the state (arrays, or
    [`Blocks`][fismo_core.kronecker.Blocks] for a blocked side). A root
    that fails shows in its flag only; what happens then is the guards'
    business ([`FISMO.settle`][fismo_core.FISMO.settle]).
    """

    P: Factor
    """Line 4: ``P_t`` (``P_{t-1}`` when ``gamma = 1``, or for a matrix whose root fell back)."""
    Q: Factor
    """Line 5: ``Q_t``."""
    P_inv_sqrt: Factor
    """``P_t^{-1/2}`` (the cached root on a step that does not recompute it, ``InverseRootConfig.every``)."""
    Q_inv_sqrt: Factor
    """``Q_t^{-1/2}``."""
    P_failed: Optional[Array]
    """Per matrix, whether ``P_t^{-1/2}`` failed its check; ``None`` when nothing was checked (or, after the
    repair of `guards.guarded_inverse_sqrt`, ``False`` when every root passed)."""
    Q_failed: Optional[Array]
    """The same for ``Q_t^{-1/2}``."""
    G_Q_inv_sqrt: Optional[Array]
    """Line 4's data factor ``G Q_{t-1}^{-1/2}`` (``None`` when ``gamma = 1``); line 6 reuses it between refreshes."""
    P_inv_sqrt_G: Array
    """Line 5's data factor ``P_t^{-1/2} G``, which is also line 6's left half."""


def _momentum_weights(beta: Any, dtype: Any) -> tuple[Any, Any]:
    """``(beta, 1 - beta)`` for line 7: numbers as they are; an array's rounded to ``dtype`` as a number is.

    A number meets an array as a weak scalar (rounded to the array's dtype);
    an array ``beta`` of another dtype would promote ``M_t`` instead (NumPy,
    JAX; torch's 0-d tensors do not promote). ``1 - beta`` is taken in the
    wider of ``beta``'s dtype and ``dtype``, then rounded, as Python takes it
    for the number ``float(beta)``: bit for bit the number's ``M_t``. In
    ``beta``'s own precision a float16 ``beta`` of 0.1235 on a float32 state
    was off by 1.3e-4 (a user's hunt, 2026-12-04).
    """
    if isinstance(beta, numbers.Real):
        return beta, 1 - beta
    xp = array_namespace(beta)
    wide = beta.dtype if xp.finfo(beta.dtype).bits >= xp.finfo(dtype).bits else dtype
    beta = xp.astype(beta, wide, copy=False)
    return xp.astype(beta, dtype), xp.astype(1 - beta, dtype)


def _line_6(pre: Preconditioners, left: Structure, right: Structure, refresh: Union[bool, "RootSchedule"]) -> Array:
    """Line 6: ``G~_t = P_t^{-1/2} G_t Q_t^{-1/2}`` (over the scale of ``G``), from a product of lines 4–5.

    Normally ``(P_t^{-1/2} G) Q_t^{-1/2}``, reusing line 5's ``P_t^{-1/2} G``.
    Between refreshes of the roots a wide matrix (``m < n``) takes
    ``P^{-1/2} (G Q^{-1/2})`` instead, reusing line 4's ``G Q^{-1/2}``
    (``m^2 n`` operations, not ``m n^2``): the cached ``Q^{-1/2}`` is the one line 4 used.
    A `RootSchedule` takes each matrix's own.
    """
    if pre.G_Q_inv_sqrt is None or refresh is True or left.d >= right.d:
        return right.right(pre.P_inv_sqrt_G, pre.Q_inv_sqrt)
    if refresh is False:
        return left.left(pre.P_inv_sqrt, pre.G_Q_inv_sqrt)
    return refresh.choose(
        lambda: (right.right(pre.P_inv_sqrt_G, pre.Q_inv_sqrt),), lambda: (left.left(pre.P_inv_sqrt, pre.G_Q_inv_sqrt),)
    )[0]


class _Lines(NamedTuple):
    """What `FISMO._algorithm_1` returns: lines 4–5, then lines 6, 7 and 8."""

    preconditioners: Preconditioners
    G_white: Array  # line 6, G~_t / scale
    M: Array  # line 7, M_t
    direction: Array  # line 8, dW_t


class StepResult(NamedTuple):
    """Lines 4–8 of one step, its fault flags not yet read: what
    [`FISMO.direction_with_faults`][fismo_core.FISMO.direction_with_faults] returns."""

    direction: Array
    """``dW_t`` (line 8), in the state's dtype."""
    state: FISMOState
    """The new state: valid as it is when no flag in ``faults`` is set; otherwise
    [`FISMO.settle`][fismo_core.FISMO.settle] gives it."""
    faults: guards.StepFaults
    """Per matrix, boolean arrays on the device (no host read yet): [`StepFaults`][fismo_core.guards.StepFaults]."""


class _Step(NamedTuple):
    """A step of `FISMO._guarded_step`: its `StepResult`, and the phases' data with ``scale`` (`FISMO.step_lines`)."""

    result: StepResult
    lines: Optional[_Lines]
    scale: Any


@dataclass(frozen=True, eq=False)  # compared by identity: `due` is an array, whose == is not a bool
class RootSchedule:
    """Per matrix of a stack, whether this step recomputes its inverse roots: ``InverseRootConfig.every``
    decided on the device, for a ``refresh_roots`` that is an array, not a Python bool.

    ``due`` is a boolean array of the stack's batch shape (``state.M.shape[:-2]``), in its namespace and on its device, e.g.
    ``config.is_refresh_step(steps)`` of the matrices' step counts; a Python bool (what that gives for
    ``every = 1``) is the same for every matrix, as ``refresh_roots=due``. Passed as ``refresh_roots`` to
    [`FISMO.direction`][fismo_core.FISMO.direction] or
    [`direction_with_faults`][fismo_core.FISMO.direction_with_faults], a matrix that is due steps as with
    ``refresh_roots=True`` and the others as with ``False``, bit for bit, in one call and without a
    host read: what a compiled step needs, where reading each matrix's step count would break the
    graph (the torch adapter under ``torch.compile``). Only where roots are not checked
    (``nonfinite="propagate"``, [`checks_roots`][fismo_core.guards.checks_roots]): a fault
    flag per matrix of a schedule is not returned.

    The schedule reaches lines 4-6 at the only places ``every`` changes them: each inverse root, and
    line 6's choice of product. `choose` computes both answers and takes each matrix's own; an
    adapter may override it to compute the roots only when a matrix is due (the torch adapter's
    ``torch.cond``).
    """

    due: Any

    def choose(
        self, fresh: Callable[[], tuple[Array, ...]], kept: Callable[[], tuple[Array, ...]]
    ) -> tuple[Array, ...]:
        """Per matrix, the arrays of ``fresh()`` where its roots are due and those of ``kept()`` elsewhere.

        Both give arrays of the same shapes, the stack's batch axes first.
        """
        xp = array_namespace(self.due)
        return tuple(guards.select(xp, self.due, a, b) for a, b in zip(fresh(), kept(), strict=True))


class _InverseRoots(NamedTuple):
    """How lines 4–5 take ``A_t^{-1/2}`` at one step; called as ``(A_t, A_t^{-1/2}, failed) = roots(...)``.

    ``refresh=False`` keeps the cached root (``InverseRootConfig.every``), a
    `RootSchedule` decides per matrix (roots not checked). Otherwise, with ``repair=False``, `guards.checked_inverse_sqrt`: no host
    read, a root that fails its check is only flagged; with ``repair=True``,
    `guards.guarded_inverse_sqrt`: float64 retry, fallback to ``A_{t-1}`` and
    its root, warning (host reads). The flags are returned, never stored.
    """

    optimizer: FISMO
    xp: Any
    refresh: Union[bool, RootSchedule]
    batch_ndim: int
    repair: bool

    def __call__(
        self, structure: Structure, A: Factor, A_prev: Factor, root_prev: Factor, name: str
    ) -> tuple[Factor, Factor, Any]:
        if self.refresh is False:
            return A, root_prev, None
        config, nonfinite = self.optimizer.inv_root, self.optimizer.nonfinite
        if isinstance(self.refresh, RootSchedule):  # roots not checked (FISMO._refresh_roots): no flags
            def fresh() -> tuple[Array, ...]:
                return structure.parts(
                    guards.checked_inverse_sqrt(self.xp, structure, config, nonfinite, A, self.batch_ndim)[0]
                )

            return A, structure.from_parts(self.refresh.choose(fresh, lambda: structure.parts(root_prev))), None
        if self.repair:
            return guards.guarded_inverse_sqrt(
                self.xp, structure, config, nonfinite, A, A_prev, root_prev, name, self.batch_ndim, _EIGH
            )
        root, failed = guards.checked_inverse_sqrt(self.xp, structure, config, nonfinite, A, self.batch_ndim)
        return A, root, failed


_EIGH = InverseRootConfig(method="eigh")


def _creation_device(W: Array) -> Any:
    """The device to create ``W``'s state on: ``W``'s, or ``None`` (the library's default) for a JAX array
    that is not committed to its device.

    ``jax.jit`` places uncommitted arguments itself; a state committed beside
    uncommitted parameters makes a jitted step's outputs committed, and its
    second call, on committed parameters, compiles again.
    """
    dev = _device(W)  # None for a traced JAX array, which must not be asked (see _device)
    return None if dev is None or getattr(W, "committed", True) is False else dev


def _saved_array(xp: Any, x: Any, like: Array, device: Any, key: str) -> Array:
    """A saved state's ``x`` as an array of ``like``'s library ``xp`` on ``device``, not cast (`FISMOState.from_dict`).

    An array of a third library (neither NumPy, which every library reads, nor ``like``'s) goes through
    DLPack: ``torch.asarray`` read a JAX array's buffer as raw bytes (a 3 x 3 float64 became 18 float32,
    refused as "saved for another parameter"). One DLPack cannot carry (another device) is a ``TypeError``.
    """
    library, wanted = guards.library_name(x), guards.library_name(like)
    if library == "numpy" and not x.dtype.isnative:
        # Stored big-endian (np.save on such arrays, other tools): the byte order is not the dtype, and
        # swapping it loses nothing; it was refused as "dtype >f8" (a user's hunt, 2026-12-04).
        x = x.astype(x.dtype.newbyteorder("="))
    if hasattr(x, "__dlpack__") and library not in ("numpy", wanted):
        try:
            x = xp.from_dlpack(x)
        except (BufferError, RuntimeError, TypeError, ValueError) as exc:
            raise TypeError(
                f"state.{key} is an array of {library} that {wanted} cannot take through DLPack ({exc}); pass "
                "the state's arrays as NumPy arrays"
            ) from exc
    if guards.library_name(x) == wanted and _device(x) != _device(like):
        # xp.asarray(x, device=...) leaves a JAX array committed to another device where it is, and the
        # next operation raised "incompatible devices" (a user's hunt, 2026-12-03). Without a device (an
        # uncommitted JAX `like`), through the host: uncommitted on the default device, as `like`.
        if device is not None:
            x = to_device(x, device)
        else:
            import numpy

            x = xp.asarray(numpy.asarray(x))
    return xp.asarray(x, device=device)


def state_dtype(xp: Any, dtype: Any) -> Any:
    """The dtype of FISMO's state for parameters of ``dtype`` in namespace ``xp``.

    float64 stays float64; float32 and anything narrower (bfloat16, float16)
    get float32 statistics, so P, Q and their roots never lose precision to
    the parameters' format; anything wider (NumPy's long double) float64,
    the widest dtype the decompositions take.
    """
    return xp.float64 if xp.finfo(dtype).bits >= 64 else xp.float32  # also float64 of either byte order


def check_state_dtype(xp: Any, state: FISMOState, dtype: Any) -> None:
    """A ``TypeError`` unless ``state`` has the dtype ``FISMO.init(W)`` gives for a ``W`` of ``dtype`` in ``xp``
    (`state_dtype`): a float64 parameter's state cast to float32 (to save memory, or from a float32 run) ran
    the step in float32."""
    if state.M.dtype != state_dtype(xp, dtype):
        raise TypeError(
            f"state dtype {_dtype_name(state.M.dtype)} does not match W of dtype {_dtype_name(dtype)}: "
            f"FISMO.init(W) would give {_dtype_name(state_dtype(xp, dtype))} (was the state built for "
            "another parameter, or cast?)"
        )


# ------------------------------------------------------------ rules the adapters share
# Each rule below has this one definition; the torch and optax adapters call it (tests/test_one_home.py).


def matrix_shape(shape: Sequence[int]) -> tuple[int, int]:
    """The matrix ``(m, n) = (shape[0], prod(shape[1:]))`` a weight of ``shape`` is optimised as.

    The leading axis is the output axis, as in Muon's handling of PyTorch's
    ``(out, in, kh, kw)`` convolution kernels; a matrix is itself. The
    torch adapter flattens every weight so, and it is the optax adapter's
    default ``matrix_shape``.
    """
    if len(shape) < 2:
        raise ValueError(f"a weight optimised as a matrix needs at least 2 dimensions, got shape {tuple(shape)}")
    return int(shape[0]), int(math.prod(shape[1:]))


def line_9_factors(lr: Any, weight_decay: float, step_lr: Any = None) -> tuple[Any, Any]:
    """Line 9 with decoupled weight decay as two numbers ``(decay, rate)``: ``W_t = (1 - decay) W_{t-1} - rate dW_t``.

    ``decay = lr * weight_decay`` (0 without weight decay, and ``W_{t-1}``
    is then not multiplied at all) and ``rate = step_lr``, by default ``lr``
    (``eta``): the decay takes the unadjusted learning rate when the step
    takes a shape-adjusted one, as ``torch.optim.Muon`` does, and it acts on
    ``W_{t-1}``, not on ``dW_t`` (decoupled, as AdamW). Algorithm 1 is
    ``weight_decay = 0``. `line_9` applies it to arrays; the torch adapter
    applies it in place, the optax adapter as the update
    ``-(rate dW_t + decay W_{t-1})``. ``lr`` may be an array (an optax
    schedule's value, traced too).
    """
    return (lr * weight_decay if weight_decay else 0.0), (lr if step_lr is None else step_lr)


def line_9(W: Array, dW: Array, lr: float, weight_decay: float = 0.0, *, step_lr: Optional[float] = None) -> Array:
    """Line 9, ``W_t = W_{t-1} - eta dW_t``, after decoupled weight decay: ``W_t = (1 - decay) W_{t-1} - rate dW_t``.

    ``decay`` and ``rate`` are `line_9_factors`'s. ``dW`` is rounded once to
    ``W``'s dtype first; the result has ``W``'s dtype and a new array is
    returned (``W`` is not changed). Half precision computes
    ``W - rate dW`` in float32 and rounds once, as torch's ``add_`` with
    ``alpha``: NumPy and JAX rounded a Python ``rate`` to bfloat16 (0.0123
    became 0.012268) and the product and the difference each to ``W``'s dtype.
    """
    xp = array_namespace(W, dW)
    decay, rate = line_9_factors(lr, weight_decay, step_lr)
    W_decayed = _decayed(xp, W, decay) if decay else W
    dW = xp.astype(dW, W.dtype, copy=False)
    if xp.finfo(W.dtype).bits >= 32:
        return W_decayed - rate * dW
    return xp.astype(xp.astype(W_decayed, xp.float32) - rate * xp.astype(dW, xp.float32), W.dtype)


def _decayed(xp: Any, W: Array, decay: Any) -> Array:
    """``(1 - decay) W`` rounded once to ``W``'s dtype; half precision multiplies in float32, as torch's ``mul_``.

    NumPy and JAX round a Python float to the dtype of the array it multiplies: bfloat16's ``1 - 0.002`` was
    0.99609, 2.7 times the decay asked for (float16's off by up to 14 %), and the torch adapter's differed.
    """
    if xp.finfo(W.dtype).bits >= 32:
        return W * (1 - decay)
    return xp.astype(xp.astype(W, xp.float32) * (1 - decay), W.dtype)


def factor_keys(name: str, parts: int) -> tuple[str, ...]:
    """The keys under which a factor field ``name`` is stored (`FISMOState.to_dict`, the torch state).

    One part (a full factor, or blocks of one size): ``(name,)``; two (full
    blocks and a remainder block): ``(name, name + "_rest")``.
    """
    return (name,) if parts == 1 else (name, f"{name}_rest")


def state_layout(m: int, n: int, block_size: Optional[int]) -> dict[str, tuple[int, ...]]:
    """Every array of the state of an ``m x n`` matrix, by its key in a checkpoint, with its shape after the batch.

    Full factors: ``P``, ``P_inv_sqrt`` ``(m, m)``, ``Q``, ``Q_inv_sqrt``
    ``(n, n)``, ``M`` ``(m, n)``. A side split into blocks (``block_size``)
    keeps ``(k, B, B)`` under its names and, when ``B`` does not divide it,
    ``(r, r)`` under ``"<name>_rest"`` (`factor_keys`). The keys of
    `FISMOState.to_dict` and of the torch adapter's per-parameter state.
    """
    structures = {"P": factor_structure(m, block_size), "Q": factor_structure(n, block_size)}
    layout: dict[str, tuple[int, ...]] = {}
    for name in _ARRAY_FIELDS:
        if name == "M":
            layout["M"] = (m, n)
            continue
        shapes = structures[name[0]].part_shapes()
        layout.update(zip(factor_keys(name, len(shapes)), (tuple(shape) for shape in shapes)))
    return layout


def state_block_size(m: int, n: int, block_size: Optional[int]) -> int:
    """The ``"block_size"`` a checkpoint of an ``m x n`` matrix's state records: ``B`` if a side is split, else 0."""
    split = {s.B for s in (factor_structure(m, block_size), factor_structure(n, block_size))
             if isinstance(s, BlockDiagonalFactor)}
    return split.pop() if split else 0


def _check_call(G: Array, state: FISMOState, block_size: Optional[int], beta: Any) -> Any:
    """The namespace of ``G``; a clear error unless ``state`` is a FISMO state that fits ``G``, ``block_size``
    and an array ``beta`` (`_check_momentum`), which must come from ``G``'s library."""
    guards.check_matrix(G, "G")
    if not isinstance(state, FISMOState):
        raise TypeError(f"state must be a FISMOState from FISMO.init, got {type(state).__name__}")
    arrays = [state.M] + [p for name in _FACTOR_FIELDS for p in _parts(getattr(state, name))]
    xp = _check_same_namespace_and_device(G, *arrays)
    if not isinstance(beta, float):
        # One library and one device per call, as for G and the state: mixed, NumPy states with a JAX beta
        # became JAX arrays without a word; on another device JAX raised "incompatible devices" inside line 7
        # (a user's hunt, 2026-12-03). Any device for torch's 0-d CPU tensor, which torch takes beside any.
        any_device = guards.library_name(beta) == "torch" and beta.device.type == "cpu"
        try:
            array_namespace(G, beta) if any_device else _check_same_namespace_and_device(G, beta)
        except TypeError:
            raise TypeError(
                f"beta is a {guards.type_name(beta)} but the gradient and the state are {guards.type_name(G)}: "
                f"an array beta must come from their library (or pass a number)"
            ) from None
        except ValueError:
            raise ValueError(
                f"beta lives on {_device(beta)} but the gradient and the state on {_device(G)}: put beta "
                "on their device (or pass a number)"
            ) from None
    *batch, m, n = G.shape
    expected = {"P": m, "Q": n, "P_inv_sqrt": m, "Q_inv_sqrt": n}
    got_M = tuple(state.M.shape)
    if got_M != (*batch, m, n):
        raise ValueError(
            f"state does not match the gradient: G has shape {tuple(G.shape)}, so state.M should have shape "
            f"{(*batch, m, n)}, got {got_M} (was the state built for another parameter?)"
        )
    for name, d in expected.items():
        value = getattr(state, name)
        got = tuple(tuple(p.shape) for p in _parts(value))
        shapes = tuple((*batch, *s) for s in factor_structure(d, block_size).part_shapes())
        if got != shapes:
            want = shapes[0] if len(shapes) == 1 else shapes
            have = got[0] if len(got) == 1 else got
            raise ValueError(
                f"state does not match the gradient: G has shape {tuple(G.shape)}, so state.{name} "
                f"should have shape {want}, got {have} (was the state built for another parameter or "
                f"another block_size?)"
            )
    # The state's dtype is float32 or float64 (state_dtype), one for all its arrays: a state cast to
    # bfloat16 (optax.tree.cast, to save memory) would run the whole step in bfloat16 without a word.
    dtypes = {_dtype_name(a.dtype) for a in arrays}
    if len(dtypes) > 1 or not dtypes <= {"float32", "float64"}:
        raise TypeError(
            f"state arrays must all be float32 or all float64 (FISMO.init keeps the statistics of narrower "
            f"parameters in float32), got {sorted(dtypes)}: was the state cast?"
        )
    for name in ("skipped", "root_failures"):
        counter = getattr(state, name)
        if isinstance(counter, numbers.Integral):
            # As from_dict reads them (a hand-built state). An array's values are not read: a host read per step.
            if not 0 <= int(counter) <= _INT32_MAX:
                raise ValueError(f"state.{name} counts must lie in 0..{_INT32_MAX}, got {counter!r}")
            continue
        if tuple(counter.shape) not in ((), tuple(batch)):
            raise ValueError(
                f"state.{name} must have the batch shape {tuple(batch)} of G {tuple(G.shape)}, "
                f"got {tuple(counter.shape)} (was the state built for another parameter?)"
            )
        # As from_dict reads them: counts of a float dtype stepped, and the state could not be saved and loaded.
        if not xp.isdtype(counter.dtype, "integral"):
            raise TypeError(
                f"state.{name} must be an integer count (FISMO.init makes int32), got {counter.dtype}: was the state "
                "cast (optax.tree.cast casts it too)?"
            )
    if isinstance(state.step, numbers.Number):  # from_dict's rule (an array step may be traced: not read)
        _saved_integer(state.step, "step")
    return xp


def _parts(factor: Factor) -> tuple[Array, ...]:
    return tuple(p for p in factor if p is not None) if isinstance(factor, Blocks) else (factor,)
