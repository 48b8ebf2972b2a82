"""Algorithm 1 of the FISMO paper as a pure, functional optimizer.

``FISMO`` holds hyperparameters only; ``FISMOState`` holds arrays. A step
takes ``(W, G, state)`` and returns new arrays: inputs are never mutated, so
the same code serves JAX (immutable arrays) and keeps CuPy/PyTorch users'
gradients intact. Every array may carry leading batch dimensions
``(..., m, n)``: a stack of same-shape matrices runs as one batched call.

Line numbers below are those of Algorithm 1 in ``fismo-paper.tex``.
"""

from __future__ import annotations

import math
import numbers
import warnings
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple, Optional, Union

from array_api_compat import array_namespace, device

from . import linalg
from .linalg import Array, Coefficients, _check_same_namespace_and_device

__all__ = [
    "FISMO",
    "FISMOState",
    "InverseRootConfig",
    "InverseRootError",
    "InverseRootWarning",
    "PolarConfig",
    "state_dtype",
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
    """

    method: Literal["newton_schulz", "svd"] = "newton_schulz"
    steps: int = 5
    coefficients: Coefficients = "muon"
    eps: float = 1e-7

    def __post_init__(self) -> None:
        if self.method not in ("newton_schulz", "svd"):
            raise ValueError(f"unknown polar method {self.method!r}: use 'newton_schulz' or 'svd'")
        linalg.newton_schulz_schedule(self.coefficients, self.steps)  # validates both
        if not (isinstance(self.coefficients, str)):
            object.__setattr__(self, "coefficients", tuple(tuple(map(float, t)) for t in self.coefficients))
        object.__setattr__(self, "eps", _check_real("polar eps", self.eps, 0.0, low_open=True))

    def __call__(self, X: Array) -> Array:
        return linalg.polar(X, method=self.method, steps=self.steps, coefficients=self.coefficients, eps=self.eps)


@dataclass(frozen=True)
class InverseRootConfig:
    """How ``P_t^{-1/2}`` and ``Q_t^{-1/2}`` are computed: see [`inverse_sqrt`][fismo_core.linalg.inverse_sqrt].

    The default is the exact ``eigh`` method: the reference implementation
    computes Algorithm 1 to rounding error. ``"newton_schulz"`` is matmul-only.

    Fault handling (in [`FISMO.direction`][fismo_core.FISMO.direction]; calling
    the config itself computes the root only). With ``fallback`` on, every root
    ``Z`` of ``A = P_t`` (or ``Q_t``) is checked: it fails if computing it
    raised (``LinAlgError``), or if the residual ``||Z A Z - I||_F`` exceeds
    ``tolerance`` or is not finite (a NaN, a non-converged Newton–Schulz
    iteration, an eigenvalue that came out negative). A failed root is
    computed again with ``eigh`` in float64 and checked again (in float64). If
    that fails too, the matrix keeps ``P_{t-1}`` and its cached root for
    this step (the other side, ``Q``, then uses ``P_{t-1}``), an
    [`InverseRootWarning`][fismo_core.optimizer.InverseRootWarning] is issued
    and the matrix's ``state.root_failures`` counts up; a step without failure
    resets it to 0. When a matrix fails on more than ``max_failures``
    consecutive steps, the step raises
    [`InverseRootError`][fismo_core.optimizer.InverseRootError] instead.
    The checks read a few booleans back from the device per step; under
    ``jax.jit`` nothing can be read and they are left out.

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
        (``eps`` the dtype's unit roundoff), so a float32 root is repaired in
        float64 only beyond ``kappa ~ 1e5``.
    every:
        Amortisation, as Shampoo's precondition frequency: the roots are
        recomputed on every ``every``-th step only (the steps with
        ``state.step % every == 0``, so the first step always computes
        them). ``P_t`` and ``Q_t`` are updated at every step regardless; on
        the steps in between, lines 4–8 use the roots of the last
        recomputation, ``P_s^{-1/2}`` and ``Q_s^{-1/2}`` (``s`` that step)
        in place of ``P_t^{-1/2}``, ``Q_t^{-1/2}`` (and their squares in
        place of ``Q_{t-1}^{-1}``, ``P_t^{-1}``), and no root is checked. A
        root that fails on a recomputation step keeps ``P_{t-1}`` with the
        root cached at the previous recomputation (with ``every = 1``: its own).
        That is *not* Algorithm 1: default 1, every step, which is.
        The measured effect on the direction is on the documentation page
        "Performance". Deciding needs a concrete step count; under
        ``jax.jit`` pass ``refresh_roots`` to
        [`FISMO.direction`][fismo_core.FISMO.direction] (the optax
        adapter does this with ``jax.lax.cond``).
    """

    method: Literal["eigh", "newton_schulz"] = "eigh"
    steps: Optional[int] = None
    fallback: Optional[bool] = None
    max_failures: int = 10
    tolerance: float = 0.1
    coefficients: Coefficients = "polar_express"
    every: int = 1

    def __post_init__(self) -> None:
        if self.method not in ("eigh", "newton_schulz"):
            raise ValueError(f"unknown inverse-root method {self.method!r}: use 'eigh' or 'newton_schulz'")
        if self.steps is not None and (
            isinstance(self.steps, bool) or not isinstance(self.steps, numbers.Integral) or self.steps < 1
        ):
            raise ValueError(
                f"inverse-root steps must be a positive integer, got {self.steps!r} (or None: the schedule's default)"
            )
        try:
            linalg.inverse_sqrt_steps(self.coefficients, self.steps)  # validates both
        except ValueError as exc:
            raise ValueError(f"inverse-root {exc}") from exc
        if not isinstance(self.coefficients, str):
            object.__setattr__(self, "coefficients", tuple(tuple(map(float, t)) for t in self.coefficients))
        if isinstance(self.every, bool) or not isinstance(self.every, numbers.Integral) or self.every < 1:
            raise ValueError(f"inverse-root every must be a positive integer, got {self.every!r}")
        object.__setattr__(self, "every", int(self.every))
        if self.fallback is not None and not isinstance(self.fallback, bool):
            raise TypeError(f"inverse-root fallback must be None, True or False, got {self.fallback!r}")
        if (
            isinstance(self.max_failures, bool)
            or not isinstance(self.max_failures, numbers.Integral)
            or self.max_failures < 0
        ):
            raise ValueError(f"inverse-root max_failures must be an integer >= 0, got {self.max_failures!r}")
        tolerance = _check_real("inverse-root tolerance", self.tolerance, 0.0, 1.0, low_open=True)
        if tolerance == 1.0:
            raise ValueError("inverse-root tolerance must lie in (0, 1), got 1.0")
        object.__setattr__(self, "max_failures", int(self.max_failures))
        object.__setattr__(self, "tolerance", tolerance)

    def __call__(self, A: Array) -> Array:
        return linalg.inverse_sqrt(A, method=self.method, steps=self.steps, coefficients=self.coefficients)


class FISMOState(NamedTuple):
    """Optimizer state of one matrix or a stack of same-shape matrices ``(..., m, n)``.

    Attributes
    ----------
    P, Q:
        Left and right Kronecker factors ``P_t`` ``(..., m, m)`` and ``Q_t``
        ``(..., n, n)``; symmetric positive definite with traces ``m`` and ``n``.
    M:
        Momentum in the whitened space, ``M_t`` ``(..., m, n)``.
    P_inv_sqrt, Q_inv_sqrt:
        Cached ``P_t^{-1/2}`` and ``Q_t^{-1/2}``. The next step needs
        ``Q_t^{-1}`` in ``L_{t+1}``; it uses ``(G Q_t^{-1/2})(G Q_t^{-1/2})^T``
        so no inverse is ever formed.
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

    P: Array
    Q: Array
    M: Array
    P_inv_sqrt: Array
    Q_inv_sqrt: Array
    step: int
    skipped: Any = 0
    root_failures: Any = 0

    def to_dict(self) -> dict[str, Any]:
        """The state as a flat dict for a checkpoint: every field by name, plus a format number.

        Arrays are returned as they are (same library, device and dtype, no
        copy), ``step`` as it is (an int). ``np.savez(f, **state.to_dict())``
        writes a NumPy state; for other libraries convert the arrays first
        (``torch.save`` takes the dict of a torch state directly).
        [`from_dict`][fismo_core.FISMOState.from_dict] reads it back.
        """
        return {**self._asdict(), _FORMAT_KEY: _FORMAT}

    @classmethod
    def from_dict(cls, d: Any, like: Array) -> "FISMOState":
        """Rebuild a state from [`to_dict`][fismo_core.FISMOState.to_dict]'s output for parameters like ``like``.

        The arrays are moved to ``like``'s library and device
        (``xp.asarray(x, device=...)``) but never cast: a state whose dtype
        is not ``state_dtype(like.dtype)`` is an error, so that a resumed run
        is bit-identical to an uninterrupted one.

        Parameters
        ----------
        d:
            A mapping (a dict, or what ``np.load`` returns for an ``.npz``
            file) with the keys ``to_dict`` writes. The counters ``skipped``
            and ``root_failures`` may be missing (they are then 0).
        like:
            The parameters ``W`` ``(..., m, n)`` the state belongs to (or any
            array of that shape and dtype, on the wanted library and device).

        Raises
        ------
        KeyError
            A key is missing, or there are keys a FISMO state does not have.
        ValueError
            A shape does not fit ``like``; malformed counters or step; an
            unknown format.
        TypeError
            A dtype that is not the state dtype of ``like``; ``d`` not a
            mapping; ``like`` not a real floating array.
        """
        xp = _check_matrix(like, "like")
        try:
            keys = set(d.keys())
        except AttributeError:
            raise TypeError(f"d must be a mapping such as FISMOState.to_dict() returns, got {type(d).__name__}") from None
        required = set(_ARRAY_FIELDS) | {"step"}
        missing = sorted(required - keys)
        if missing:
            raise KeyError(f"not a complete FISMO state: missing {missing} (keys present: {sorted(keys)})")
        unknown = sorted(keys - set(cls._fields) - {_FORMAT_KEY})
        if unknown:
            raise KeyError(f"not a FISMO state: unexpected keys {unknown} (a FISMO state has {list(cls._fields)})")
        if _FORMAT_KEY in keys and int(d[_FORMAT_KEY]) != _FORMAT:
            raise ValueError(f"unknown FISMO state format {int(d[_FORMAT_KEY])}; this version reads format {_FORMAT}")
        dev = device(like)
        dtype = state_dtype(xp, like.dtype)
        *batch, m, n = like.shape
        shapes = {"P": (m, m), "Q": (n, n), "M": (m, n), "P_inv_sqrt": (m, m), "Q_inv_sqrt": (n, n)}
        fields: dict[str, Any] = {}
        for name, tail in shapes.items():
            x = xp.asarray(d[name], device=dev)
            if tuple(x.shape) != (*batch, *tail):
                raise ValueError(
                    f"state.{name} has shape {tuple(x.shape)}, but parameters of shape {tuple(like.shape)} "
                    f"need {(*batch, *tail)} (was the state saved for another parameter?)"
                )
            if x.dtype != dtype:
                raise TypeError(
                    f"state.{name} has dtype {x.dtype}, but parameters of dtype {like.dtype} keep their state in "
                    f"{getattr(dtype, '__name__', dtype)}; states are not converted, so that a resumed run is "
                    "bit-identical"
                )
            fields[name] = x
        for name in ("skipped", "root_failures"):
            if name not in keys:
                fields[name] = xp.zeros(tuple(batch), dtype=xp.int32, device=dev)
                continue
            x = xp.asarray(d[name], device=dev)
            if tuple(x.shape) != tuple(batch) or not xp.isdtype(x.dtype, "integral"):
                raise ValueError(
                    f"state.{name} must be an integer array of shape {tuple(batch)} (the batch shape of "
                    f"{tuple(like.shape)}), got {x.dtype} of shape {tuple(x.shape)}"
                )
            fields[name] = xp.astype(x, xp.int32)
        step = d["step"]
        if getattr(step, "shape", ()) != () or not float(step) == int(step) or int(step) < 0:
            raise ValueError(f"state step must be an integer >= 0, got {step!r}")
        return cls(step=int(step), **fields)


_ARRAY_FIELDS = ("P", "Q", "M", "P_inv_sqrt", "Q_inv_sqrt")
_FORMAT_KEY = "fismo_state_format"
_FORMAT = 1


class InverseRootWarning(RuntimeWarning):
    """An inverse root failed and the previous ``P`` or ``Q`` (and its root) was kept for this step."""


class InverseRootError(FloatingPointError):
    """An inverse root failed on more than ``max_failures`` consecutive steps.

    ``indices`` lists the failing matrices as flat indices into the batch
    (``[0]`` for a single matrix). Raised before the state changes.
    """

    def __init__(self, message: str, indices: tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.indices = tuple(indices)


def _as_config(value: Any, config_type: type, name: str) -> Any:
    if isinstance(value, config_type):
        return value
    if isinstance(value, str):
        return config_type(method=value)
    if isinstance(value, dict):
        return config_type(**value)
    raise TypeError(f"{name} must be a {config_type.__name__}, a method name or a dict of its fields, got {value!r}")


def _check_real(name: str, value: Any, low: float, high: float = math.inf, *, low_open: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite real number, got {value!r}")
    if value < low or value > high or (low_open and value == low):
        bracket = "(" if low_open else "["
        upper = "inf)" if high == math.inf else f"{high}]"
        raise ValueError(f"{name} must lie in {bracket}{low}, {upper}, got {value!r}")
    return float(value)


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
        Momentum ``beta`` in ``[0, 1]`` (line 7). Default 0.95, as Muon.
    gamma:
        Preconditioner EMA ``gamma`` in ``[0, 1]`` (lines 4 and 5). Default
        0.95, the preconditioner EMA of SOAP. ``gamma = 1`` freezes ``P`` and
        ``Q`` at the identity, and FISMO is Muon with EMA momentum.
    mu:
        Damping ``mu >= 0`` (lines 4 and 5): ``L_t`` and ``R_t`` get
        ``mu tr(P_{t-1})/m I`` and ``mu tr(Q_{t-1})/n I``, a floor under the
        preconditioners' eigenvalues. Default 1e-3.
    polar:
        How ``Polar(M_t)`` is computed: a [`PolarConfig`][fismo_core.PolarConfig], a method name
        (``"newton_schulz"``, ``"svd"``) or a dict of its fields.
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
    """

    lr: float = 0.02
    beta: float = 0.95
    gamma: float = 0.95
    mu: float = 1e-3
    polar: Union[PolarConfig, str, dict] = field(default_factory=PolarConfig)
    inv_root: Union[InverseRootConfig, str, dict] = field(default_factory=InverseRootConfig)
    weight_decay: float = 0.0
    nesterov: bool = False
    nonfinite: Literal["raise", "skip", "propagate"] = "raise"
    statistics: Literal["printed", "scale_invariant"] = "printed"

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        set_(self, "lr", _check_real("lr", self.lr, 0.0, low_open=True))
        set_(self, "beta", _check_real("beta", self.beta, 0.0, 1.0))
        set_(self, "gamma", _check_real("gamma", self.gamma, 0.0, 1.0))
        set_(self, "mu", _check_real("mu", self.mu, 0.0))
        set_(self, "weight_decay", _check_real("weight_decay", self.weight_decay, 0.0))
        if not isinstance(self.nesterov, bool):
            raise TypeError(f"nesterov must be True or False, got {self.nesterov!r}")
        if self.nonfinite not in ("raise", "skip", "propagate"):
            raise ValueError(f"nonfinite must be 'raise', 'skip' or 'propagate', got {self.nonfinite!r}")
        if self.statistics not in ("printed", "scale_invariant"):
            raise ValueError(f"statistics must be 'printed' or 'scale_invariant', got {self.statistics!r}")
        set_(self, "polar", _as_config(self.polar, PolarConfig, "polar"))
        set_(self, "inv_root", _as_config(self.inv_root, InverseRootConfig, "inv_root"))

    # ------------------------------------------------------------------ init
    def init(self, W: Array) -> FISMOState:
        """Initial state for parameters ``W`` ``(..., m, n)``: ``P_0 = I``, ``Q_0 = I``, ``M_0 = 0``.

        The state's dtype is ``W``'s if it is float32 or wider, float32 otherwise
        (statistics of bf16/fp16 parameters are kept in float32); its device
        and namespace are ``W``'s.
        """
        xp = _check_matrix(W, "W")
        dtype = state_dtype(xp, W.dtype)
        *batch, m, n = W.shape
        dev = device(W)
        P = xp.zeros((*batch, m, m), dtype=dtype, device=dev) + xp.eye(m, dtype=dtype, device=dev)
        Q = xp.zeros((*batch, n, n), dtype=dtype, device=dev) + xp.eye(n, dtype=dtype, device=dev)
        M = xp.zeros((*batch, m, n), dtype=dtype, device=dev)
        # The roots are separate arrays (equal to P and Q), so in-place adapters never alias them.
        return FISMOState(
            P=P, Q=Q, M=M, P_inv_sqrt=xp.asarray(P, copy=True), Q_inv_sqrt=xp.asarray(Q, copy=True), step=0,
            skipped=xp.zeros(tuple(batch), dtype=xp.int32, device=dev),
            root_failures=xp.zeros(tuple(batch), dtype=xp.int32, device=dev),
        )

    # ------------------------------------------------------------- direction
    def direction(
        self, G: Array, state: FISMOState, *, refresh_roots: Optional[bool] = None
    ) -> tuple[Array, FISMOState]:
        """Lines 4–8: the update direction ``dW_t`` and the new state, from gradient ``G_t``.

        ``dW_t = P_t^{-1/2} Polar(M_t) Q_t^{-1/2}``; the parameters move by
        ``-lr * dW_t`` (line 9, [`step`][fismo_core.FISMO.step]). ``dW_t`` has the state's dtype.
        Preconditioners are updated Gauss–Seidel: ``P_t`` from ``Q_{t-1}``,
        then ``Q_t`` from the new ``P_t``.

        ``refresh_roots`` overrides the schedule of
        [`InverseRootConfig.every`][fismo_core.InverseRootConfig]: ``True``
        recomputes the roots at this step, ``False`` keeps the cached ones.
        ``None`` (default) decides from ``state.step``, which must then be
        concrete unless ``every == 1``.
        """
        xp = _check_call(G, state)
        refresh = self._refresh_roots(state, refresh_roots)
        if self.nonfinite == "raise":
            _check_finite(xp, G)
        # A copy in the standard layout: BLAS may round a product with a transposed or strided
        # operand differently, and the result must not depend on how G is laid out in memory.
        G = xp.reshape(xp.astype(G, state.M.dtype, copy=False), G.shape, copy=True)
        if self.nonfinite == "skip":
            # Per matrix and sync-free: a matrix whose G_t is not finite is computed with
            # G_t = 0 (so no NaN reaches eigh) and restored to its old state at the end.
            skip = ~xp.all(xp.isfinite(G), axis=(-2, -1))
            G = xp.where(skip[..., None, None], xp.zeros_like(G), G)
        m, n = G.shape[-2], G.shape[-1]
        P, Q, P_is, Q_is = state.P, state.Q, state.P_inv_sqrt, state.Q_inv_sqrt
        P_failed = Q_failed = None
        G_white_s = None
        if self.gamma == 1.0:
            # P~_t = P_{t-1}, whose trace is m: lines 4-5 return P_{t-1} and
            # Q_{t-1} unchanged, and so do their cached roots.
            scale, P_is_G_s = 1.0, P_is @ G
        else:
            # Lines 4-5 work on G_s = G / scale, one positive scale per matrix (..., 1, 1):
            # scale = s for the printed statistics, rms(G) s for "scale_invariant", where s is a
            # power of two (1 unless max|G / rms| >= 2). The Gram products of G_s cannot overflow,
            # and the EMA takes P_{t-1} / s^2 (Q_{t-1} / s^2), which trace normalisation maps to
            # the same P_t; bit for bit the unscaled result unless that overflows
            # (docs/guarantees.md). Lines 6-7 multiply the scale back into a coefficient.
            if self.statistics == "scale_invariant":  # G / rms(G), per matrix; a zero G stays zero
                # rms on G / 2^k so the sum of squares cannot overflow; the power of two cancels exactly.
                pow2 = linalg._pow2_scale(G)
                rms = xp.sqrt(xp.sum((G / pow2) ** 2, axis=(-2, -1), keepdims=True) / (m * n))
                stat_scale = pow2 * xp.where(rms > 0, rms, xp.ones_like(rms))
                G_stat = G / stat_scale
            else:
                stat_scale, G_stat = 1.0, G
            s = linalg._pow2_scale(G_stat)
            G_s, scale, inv_s2 = G_stat / s, stat_scale * s, 1 / s / s
            # Line 4: L_t = G Q_{t-1}^{-1} G^T / n + mu tr(P_{t-1})/m I_m, P_t from L_t.
            G_Q_is = G_s @ Q_is
            P_new = self._updated_preconditioner(xp, P, G_Q_is @ xp.matrix_transpose(G_Q_is), n, inv_s2)
            if refresh:
                P_new, P_is, P_failed = self._inverse_root(xp, P_new, P, P_is, "P")
            # Line 5: R_t = G^T P_t^{-1} G / m + mu tr(Q_{t-1})/n I_n, Q_t from R_t.
            P_is_G_s = P_is @ G_s
            Q_new = self._updated_preconditioner(xp, Q, xp.matrix_transpose(P_is_G_s) @ P_is_G_s, m, inv_s2)
            if refresh:
                Q_new, Q_is, Q_failed = self._inverse_root(xp, Q_new, Q, Q_is, "Q")
            elif m < n:
                # Cached roots: line 4's G_s Q^{-1/2} has the root line 6 needs, and
                # P^{-1/2} (G_s Q^{-1/2}) costs m^2 n where (P^{-1/2} G_s) Q^{-1/2} costs m n^2.
                G_white_s = P_is @ G_Q_is
            P, Q = P_new, Q_new
        # Line 6: G~_t = P_t^{-1/2} G_t Q_t^{-1/2} = scale (P_t^{-1/2} G_s) Q_t^{-1/2}, reusing line 5's product.
        if G_white_s is None:
            G_white_s = P_is_G_s @ Q_is
        # Line 7: M_t = beta M_{t-1} + (1 - beta) G~_t.
        G_white_coef = (1 - self.beta) * scale
        M = self.beta * state.M + G_white_coef * G_white_s
        # Line 8: dW_t = P_t^{-1/2} Polar(M_t) Q_t^{-1/2}.
        momentum = self.beta * M + G_white_coef * G_white_s if self.nesterov else M
        direction = linalg.whiten(self.polar(momentum), P_is, Q_is)
        new_state = FISMOState(
            P=P, Q=Q, M=M, P_inv_sqrt=P_is, Q_inv_sqrt=Q_is, step=state.step + 1,
            skipped=state.skipped, root_failures=self._root_failures(xp, state, P_failed, Q_failed),
        )
        if self.nonfinite == "skip":
            direction, new_state = _restore_skipped(xp, skip, direction, state, new_state)
        return direction, new_state

    def _updated_preconditioner(self, xp: Any, A: Array, gram: Array, divisor: int, inv_s2: Array) -> Array:
        """``P_t`` from ``P_{t-1}`` (lines 4, and 5 for ``Q_t``), in one linear combination.

        ``gram`` is the data part of ``L_t`` times ``divisor / s^2``
        (``G_s Q_{t-1}^{-1} G_s^T``, ``G_s = G_t / s``), so with
        ``a = gamma / s^2``, ``b = (1 - gamma) / divisor`` and
        ``c = (1 - gamma) mu tr(P_{t-1}) / (d s^2)``, ``P~_t / s^2 = a P_{t-1} +
        b gram + c I``. Its trace is ``a tr(P_{t-1}) + b tr(gram) + c d``, and
        with ``k = d / tr``, ``P_t = sym(k P~_t / s^2) = k a P_{t-1} +
        (k b / 2) (gram + gram^T) + k c I``: ``P_{t-1}`` is exactly symmetric,
        and so is the result.
        """
        d = A.shape[-1]
        trace_prev = xp.linalg.trace(A)[..., None, None]
        a = self.gamma * inv_s2
        b = (1 - self.gamma) / divisor
        c = (1 - self.gamma) * self.mu * trace_prev / d * inv_s2
        k = d / (a * trace_prev + b * xp.linalg.trace(gram)[..., None, None] + c * d)
        eye = xp.eye(d, dtype=A.dtype, device=device(A))
        return (k * a) * A + (k * (b / 2)) * (gram + xp.matrix_transpose(gram)) + (k * c) * eye

    def _refresh_roots(self, state: FISMOState, refresh_roots: Optional[bool]) -> bool:
        """Whether this step recomputes ``P_t^{-1/2}``, ``Q_t^{-1/2}`` (`InverseRootConfig.every`)."""
        if refresh_roots is not None:
            if not isinstance(refresh_roots, bool):
                raise TypeError(f"refresh_roots must be None, True or False, got {refresh_roots!r}")
            return refresh_roots
        every = self.inv_root.every
        if every == 1:
            return True
        try:
            return int(state.step) % every == 0
        except TypeError:  # traced (jax.errors.ConcretizationTypeError): no value to decide on
            raise ValueError(
                f"InverseRootConfig(every={every}) recomputes the roots when state.step % {every} == 0, and "
                "state.step is traced here (jax.jit): pass refresh_roots=True/False to FISMO.direction, "
                "e.g. under jax.lax.cond (fismo_core.backends.optax does this)"
            ) from None

    # ------------------------------------------------------- fault handling
    def _inverse_root(self, xp: Any, A: Array, A_prev: Array, root_prev: Array, name: str) -> tuple[Array, Array, Any]:
        """``A^{-1/2}`` of ``A = P_t`` (or ``Q_t``) with the fault handling of `InverseRootConfig`.

        Returns ``(A_t, A_t^{-1/2}, failed)``. ``failed`` is ``None`` when
        nothing was checked (checks off, or traced), ``False`` when every
        root passed, and otherwise a boolean array of the batch shape: those
        matrices keep ``A_prev`` and ``root_prev``.
        """
        config = self.inv_root
        if not _checks_roots(config, self.nonfinite):
            return A, config(A), None
        root, ok = _checked_root(xp, config, A)
        try:
            if bool(xp.all(ok)):
                return A, root, False
        except TypeError:  # traced (jax.errors.ConcretizationTypeError): nothing can be read, no check
            return A, root, None
        if not (A.dtype == xp.float64 and config.method == "eigh"):
            A64 = _as_float64(xp, A)
            if A64 is not None:  # the retry: eigh in float64, checked in float64
                root64, ok64 = _checked_root(xp, _EIGH, A64, config.tolerance)
                root = xp.where((ok64 & ~ok)[..., None, None], xp.astype(root64, A.dtype), root)
                ok = ok | ok64
        failed = ~ok
        count = int(xp.sum(xp.astype(failed, xp.int32)))
        if count == 0:
            return A, root, False
        total = math.prod(failed.shape)
        warnings.warn(
            f"FISMO: the inverse square root of {name}_t failed for {count} of {total} matrices (a LinAlgError, "
            f"a non-finite result or ||Z {name}_t Z - I||_F > {config.tolerance}, also with eigh in float64); "
            f"they keep {name}_(t-1) and its cached root for this step. state.root_failures counts consecutive "
            f"failures; more than InverseRootConfig.max_failures = {config.max_failures} raise InverseRootError",
            InverseRootWarning,
            stacklevel=4,
        )
        keep = failed[..., None, None]
        return xp.where(keep, A_prev, A), xp.where(keep, root_prev, root), failed

    def _root_failures(self, xp: Any, state: FISMOState, P_failed: Any, Q_failed: Any) -> Any:
        """The new ``root_failures`` counters; `InverseRootError` when one exceeds ``max_failures``."""
        if P_failed is None and Q_failed is None:
            return state.root_failures  # unchecked: passed through
        batch = tuple(state.M.shape[:-2])
        failed = [(name, f) for name, f in (("P", P_failed), ("Q", Q_failed)) if f is not None and f is not False]
        if not failed:
            return xp.zeros(batch, dtype=xp.int32, device=device(state.M))
        any_failed = failed[0][1] if len(failed) == 1 else failed[0][1] | failed[1][1]
        previous = _counter(xp, state.root_failures, batch, device(state.M))
        counts = xp.where(any_failed, previous + 1, xp.zeros_like(previous))
        over = xp.reshape(counts > self.inv_root.max_failures, (-1,))
        if bool(xp.any(over)):
            indices = tuple(i for i in range(over.shape[0]) if bool(over[i]))
            which = " and ".join(name for name, _ in failed)
            raise InverseRootError(
                f"FISMO: the inverse square root of {which}_t failed on more than max_failures = "
                f"{self.inv_root.max_failures} consecutive steps (matrices {list(indices)} of the batch, flat "
                f"indices), also with eigh in float64; the step was not taken and the state passed in is "
                f"unchanged. The preconditioner is too ill-conditioned for {state.M.dtype}: Algorithm 1 is not "
                f"scale invariant, and for gradient entries of size sigma P and Q can reach condition numbers "
                f"of about m sigma^2 / mu. Remedies: a larger mu, a smaller gradient scale, float64, or "
                f"statistics='scale_invariant' (see docs/guarantees.md)",
                indices,
            )
        return counts

    # ------------------------------------------------------------------ step
    def step(self, W: Array, G: Array, state: FISMOState) -> tuple[Array, FISMOState]:
        """One full iteration: line 9, ``W_t = W_{t-1} - lr dW_t`` (after decoupled weight decay).

        Returns the new parameters (``W``'s dtype) and the new state.
        """
        xp = _check_matrix(W, "W")
        _check_matrix(G, "G")
        if tuple(W.shape) != tuple(G.shape):
            raise ValueError(f"W and G must have the same shape, got W {tuple(W.shape)} and G {tuple(G.shape)}")
        _check_same_namespace_and_device(W, G)
        _check_call(G, state)
        if state.M.dtype != state_dtype(xp, W.dtype):
            raise TypeError(
                f"state dtype {state.M.dtype} does not match W of dtype {W.dtype}: FISMO.init(W) "
                f"would give {state_dtype(xp, W.dtype)} (was the state built for another parameter?)"
            )
        direction, new_state = self.direction(G, state)
        W_decayed = W * (1 - self.lr * self.weight_decay) if self.weight_decay else W
        W_new = W_decayed - self.lr * xp.astype(direction, W.dtype, copy=False)
        if self.nonfinite == "skip":  # a skipped matrix keeps W_{t-1} exactly: no weight decay either
            skipped_now = (new_state.skipped - state.skipped) > 0
            W_new = xp.where(skipped_now[..., None, None], W, W_new)
        return W_new, new_state


# ------------------------------------------------------------------ checks
def state_dtype(xp: Any, dtype: Any) -> Any:
    """The dtype of FISMO's state for parameters of ``dtype`` in namespace ``xp``.

    float64 stays float64; float32 and anything narrower (bfloat16, float16)
    get float32 statistics, so P, Q and their roots never lose precision to
    the parameters' format.
    """
    return xp.float64 if dtype == xp.float64 else xp.float32


def _check_matrix(X: Array, name: str) -> Any:
    try:
        xp = array_namespace(X)
    except TypeError as exc:
        raise TypeError(f"{name} must be an array of an array-API-compatible library, got {type(X).__name__}") from exc
    if X.ndim < 2:
        raise ValueError(
            f"{name} must be a matrix or a stack of matrices (..., m, n), got shape {tuple(X.shape)}; "
            "vectors and scalars (biases, norms) need another optimizer such as AdamW"
        )
    if not xp.isdtype(X.dtype, "real floating"):
        raise TypeError(f"{name} must have a real floating dtype, got {X.dtype}")
    return xp


def _check_finite(xp: Any, G: Array) -> None:
    """Raise before any state changes if ``G`` has a NaN or an infinity.

    This reads one boolean back from the device (one synchronisation per
    step). Inside a traced function (``jax.jit``) no value can be read; the
    check is then left out, and non-finite values propagate.
    """
    all_finite = xp.all(xp.isfinite(G))
    try:
        ok = bool(all_finite)
    except TypeError:  # a traced value (jax.errors.ConcretizationTypeError is a TypeError)
        return
    if not ok:
        nan = int(xp.sum(xp.astype(xp.isnan(G), xp.int32)))
        inf = int(xp.sum(xp.astype(xp.isinf(G), xp.int32)))
        raise ValueError(
            f"G contains NaN or infinite values ({nan} NaN, {inf} infinite of {math.prod(G.shape)} entries); "
            "the step was not taken and the state is unchanged (check the loss and the gradient computation, "
            "or use FISMO(nonfinite='skip') to skip such steps)"
        )


# ----------------------------------------------------------- fault handling
_EIGH = InverseRootConfig(method="eigh")


def _checks_roots(config: InverseRootConfig, nonfinite: str) -> bool:
    """Whether inverse roots are checked: ``config.fallback``, or by default unless ``nonfinite="propagate"``."""
    return config.fallback if config.fallback is not None else nonfinite != "propagate"


def _is_linalg_error(exc: BaseException) -> bool:
    """A library's "the factorisation failed" error: NumPy/CuPy ``LinAlgError``, torch ``_LinAlgError``."""
    return any(cls.__name__.endswith("LinAlgError") for cls in type(exc).__mro__)


def _checked_root(xp: Any, config: InverseRootConfig, A: Array, tolerance: Optional[float] = None) -> tuple[Array, Array]:
    """``Z = A^{-1/2}`` by ``config`` and, per matrix, whether ``||Z A Z - I||_F <= tolerance``.

    A ``LinAlgError`` of the batched call is retried matrix by matrix, so only
    the matrices that fail are marked (their ``Z`` is NaN). NaN residuals fail.
    """
    tolerance = config.tolerance if tolerance is None else tolerance
    try:
        Z = config(A)
    except Exception as exc:
        if not _is_linalg_error(exc):
            raise
        d = A.shape[-1]
        flat = xp.reshape(A, (-1, d, d))
        roots = []
        for i in range(flat.shape[0]):
            try:
                roots.append(config(flat[i, ...]))
            except Exception as exc_i:
                if not _is_linalg_error(exc_i):
                    raise
                roots.append(xp.full((d, d), math.nan, dtype=A.dtype, device=device(A)))
        Z = xp.reshape(xp.stack(roots), A.shape)
    eye = xp.eye(A.shape[-1], dtype=A.dtype, device=device(A))
    residual = xp.linalg.matrix_norm(Z @ A @ Z - eye)
    return Z, residual <= tolerance


def _as_float64(xp: Any, A: Array) -> Optional[Array]:
    """``A`` in float64, or ``None`` where the device has no float64 (array-api-strict's ``no_float64``, MPS)."""
    try:
        A64 = xp.astype(A, xp.float64)
    except (TypeError, ValueError, RuntimeError):
        return None
    return A64 if A64.dtype == xp.float64 else None


def _counter(xp: Any, value: Any, shape: tuple[int, ...], dev: Any) -> Array:
    """A counter field as an int32 array of the batch ``shape`` (states built by hand may hold a Python int)."""
    if isinstance(value, numbers.Integral):
        return xp.full(shape, int(value), dtype=xp.int32, device=dev)
    return value


def _restore_skipped(
    xp: Any, skip: Array, direction: Array, state: FISMOState, new: FISMOState
) -> tuple[Array, FISMOState]:
    """``nonfinite="skip"``: matrices flagged in ``skip`` get direction 0 and their old state, and are counted."""
    keep = skip[..., None, None]
    batch, dev = tuple(skip.shape), device(direction)
    arrays = {name: xp.where(keep, getattr(state, name), getattr(new, name)) for name in _ARRAY_FIELDS}
    failures = _counter(xp, new.root_failures, batch, dev)
    return xp.where(keep, xp.zeros_like(direction), direction), new._replace(
        **arrays,
        # asarray: NumPy returns a scalar, not a 0-d array, for the sum of two 0-d arrays.
        skipped=xp.asarray(_counter(xp, state.skipped, batch, dev) + xp.astype(skip, xp.int32)),
        root_failures=xp.where(skip, _counter(xp, state.root_failures, batch, dev), failures),
    )


def _check_call(G: Array, state: FISMOState) -> Any:
    _check_matrix(G, "G")
    if not isinstance(state, FISMOState):
        raise TypeError(f"state must be a FISMOState from FISMO.init, got {type(state).__name__}")
    xp = _check_same_namespace_and_device(G, state.P, state.Q, state.M, state.P_inv_sqrt, state.Q_inv_sqrt)
    *batch, m, n = G.shape
    expected = {
        "P": (*batch, m, m),
        "Q": (*batch, n, n),
        "M": (*batch, m, n),
        "P_inv_sqrt": (*batch, m, m),
        "Q_inv_sqrt": (*batch, n, n),
    }
    for name, shape in expected.items():
        got = tuple(getattr(state, name).shape)
        if got != shape:
            raise ValueError(
                f"state does not match the gradient: G has shape {tuple(G.shape)}, so state.{name} "
                f"should have shape {shape}, got {got} (was the state built for another parameter?)"
            )
    for name in ("skipped", "root_failures"):
        counter = getattr(state, name)
        if not isinstance(counter, numbers.Integral) and tuple(counter.shape) not in ((), tuple(batch)):
            raise ValueError(
                f"state.{name} must have the batch shape {tuple(batch)} of G {tuple(G.shape)}, "
                f"got {tuple(counter.shape)} (was the state built for another parameter?)"
            )
    return xp
