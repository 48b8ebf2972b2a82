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
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple, Union

from array_api_compat import array_namespace, device

from . import linalg
from .linalg import Array, Coefficients, _check_same_namespace_and_device

__all__ = ["FISMO", "FISMOState", "InverseRootConfig", "PolarConfig", "state_dtype"]


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
    """

    method: Literal["eigh", "newton_schulz"] = "eigh"
    steps: int = 30

    def __post_init__(self) -> None:
        if self.method not in ("eigh", "newton_schulz"):
            raise ValueError(f"unknown inverse-root method {self.method!r}: use 'eigh' or 'newton_schulz'")
        if isinstance(self.steps, bool) or not isinstance(self.steps, numbers.Integral) or self.steps < 1:
            raise ValueError(f"inverse-root steps must be a positive integer, got {self.steps!r}")

    def __call__(self, A: Array) -> Array:
        return linalg.inverse_sqrt(A, method=self.method, steps=self.steps)


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
        user: Algorithm 1 itself never reads it (no bias correction).
    """

    P: Array
    Q: Array
    M: Array
    P_inv_sqrt: Array
    Q_inv_sqrt: Array
    step: int


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
        the check is left out). ``"propagate"``: no check and no host
        synchronisation; non-finite values flow into the state, for GPU
        pipelines that check the loss themselves.
    """

    lr: float = 0.02
    beta: float = 0.95
    gamma: float = 0.95
    mu: float = 1e-3
    polar: Union[PolarConfig, str, dict] = field(default_factory=PolarConfig)
    inv_root: Union[InverseRootConfig, str, dict] = field(default_factory=InverseRootConfig)
    weight_decay: float = 0.0
    nesterov: bool = False
    nonfinite: Literal["raise", "propagate"] = "raise"

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        set_(self, "lr", _check_real("lr", self.lr, 0.0, low_open=True))
        set_(self, "beta", _check_real("beta", self.beta, 0.0, 1.0))
        set_(self, "gamma", _check_real("gamma", self.gamma, 0.0, 1.0))
        set_(self, "mu", _check_real("mu", self.mu, 0.0))
        set_(self, "weight_decay", _check_real("weight_decay", self.weight_decay, 0.0))
        if not isinstance(self.nesterov, bool):
            raise TypeError(f"nesterov must be True or False, got {self.nesterov!r}")
        if self.nonfinite not in ("raise", "propagate"):
            raise ValueError(f"nonfinite must be 'raise' or 'propagate', got {self.nonfinite!r}")
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
        return FISMOState(P=P, Q=Q, M=M, P_inv_sqrt=xp.asarray(P, copy=True), Q_inv_sqrt=xp.asarray(Q, copy=True), step=0)

    # ------------------------------------------------------------- direction
    def direction(self, G: Array, state: FISMOState) -> tuple[Array, FISMOState]:
        """Lines 4–8: the update direction ``dW_t`` and the new state, from gradient ``G_t``.

        ``dW_t = P_t^{-1/2} Polar(M_t) Q_t^{-1/2}``; the parameters move by
        ``-lr * dW_t`` (line 9, [`step`][fismo_core.FISMO.step]). ``dW_t`` has the state's dtype.
        Preconditioners are updated Gauss–Seidel: ``P_t`` from ``Q_{t-1}``,
        then ``Q_t`` from the new ``P_t``.
        """
        xp = _check_call(G, state)
        if self.nonfinite == "raise":
            _check_finite(xp, G)
        G = xp.astype(G, state.M.dtype, copy=False)
        m, n = G.shape[-2], G.shape[-1]
        P, Q, P_is, Q_is = state.P, state.Q, state.P_inv_sqrt, state.Q_inv_sqrt
        if self.gamma == 1.0:
            # P~_t = P_{t-1}, whose trace is m: lines 4-5 return P_{t-1} and
            # Q_{t-1} unchanged, and so do their cached roots.
            P_is_G = P_is @ G
        else:
            eye_m = xp.eye(m, dtype=G.dtype, device=device(G))
            eye_n = xp.eye(n, dtype=G.dtype, device=device(G))
            # Line 4: L_t = G Q_{t-1}^{-1} G^T / n + mu tr(P_{t-1})/m I_m.
            G_Q_is = G @ Q_is
            L = (G_Q_is @ xp.matrix_transpose(G_Q_is)) / n + (self.mu * xp.linalg.trace(P) / m)[..., None, None] * eye_m
            P_new = linalg.sym(linalg.trace_normalize(self.gamma * P + (1 - self.gamma) * L))
            P_is = self.inv_root(P_new)
            # Line 5: R_t = G^T P_t^{-1} G / m + mu tr(Q_{t-1})/n I_n.
            P_is_G = P_is @ G
            R = (xp.matrix_transpose(P_is_G) @ P_is_G) / m + (self.mu * xp.linalg.trace(Q) / n)[..., None, None] * eye_n
            Q_new = linalg.sym(linalg.trace_normalize(self.gamma * Q + (1 - self.gamma) * R))
            Q_is = self.inv_root(Q_new)
            P, Q = P_new, Q_new
        # Line 6: G~_t = P_t^{-1/2} G_t Q_t^{-1/2}, reusing P_t^{-1/2} G_t from line 5.
        G_white = P_is_G @ Q_is
        # Line 7: M_t = beta M_{t-1} + (1 - beta) G~_t.
        M = self.beta * state.M + (1 - self.beta) * G_white
        # Line 8: dW_t = P_t^{-1/2} Polar(M_t) Q_t^{-1/2}.
        momentum = self.beta * M + (1 - self.beta) * G_white if self.nesterov else M
        direction = linalg.whiten(self.polar(momentum), P_is, Q_is)
        new_state = FISMOState(P=P, Q=Q, M=M, P_inv_sqrt=P_is, Q_inv_sqrt=Q_is, step=state.step + 1)
        return direction, new_state

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
        return W_decayed - self.lr * xp.astype(direction, W.dtype, copy=False), new_state


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
        raise ValueError(
            "G contains NaN or infinite values; the step was not taken and the state is unchanged "
            "(check the loss and the gradient computation)"
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
    return xp
