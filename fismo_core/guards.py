"""Robustness machinery around Algorithm 1, kept out of the algorithm itself.

Everything here guards the step without changing what it computes on good
input: argument checks, the non-finite gradient policies (``raise``,
``skip``, ``propagate``), the overflow-safe scaling of the statistics (and
the ``scale_invariant`` variant), and the fault handling of the inverse
roots (check, float64 retry, fallback to the previous factor, counters).
The roots' fault flags stay arrays (`StepFaults`) until one host read
(`read_faults`). See the documentation page "Guarantees".
"""

from __future__ import annotations

import functools
import inspect
import math
import numbers
import os
import sys
import types
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple, Optional, TypeVar

from array_api_compat import array_namespace, is_array_api_obj

from . import _autodiff, linalg
from .kronecker import BlockDiagonalFactor, Structure, factor_structure, state_size
from .linalg import Array, _device, _host_bool, nan_is_the_answer

__all__ = ["FactorSizeWarning", "InverseRootError", "InverseRootWarning", "StepFaults", "read_faults"]


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


# ------------------------------------------------------------------ arguments
def check_matrix(X: Array, name: str) -> Any:
    """The namespace of ``X``; a clear error unless it is a real floating stack of matrices ``(..., m, n)``."""
    linalg._refuse_numpy_matrix(X, name)
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


def type_name(x: Any) -> str:
    """``x``'s type as ``module.name`` (``numpy.ndarray``), for errors about another library's objects."""
    return f"{type(x).__module__}.{type(x).__qualname__}"


def library_name(x: Any) -> str:
    """The top-level module of ``x``'s type: ``"numpy"``, ``"torch"``, ``"jaxlib"`` (JAX arrays), ``"cupy"``..."""
    return type(x).__module__.split(".")[0]


def check_beta_library(beta: Any, array_type: type, where: str, wanted: str) -> None:
    """An adapter's refusal of an array ``beta`` not of its library (``array_type``), where its settings
    are taken: the core can refuse it only at the first call, when it meets the gradient. The error begins
    with ``where`` (nothing when it is empty)."""
    if not isinstance(beta, (numbers.Real, array_type)) and is_array_api_obj(beta):
        prefix = f"{where}: " if where else ""
        raise TypeError(f"{prefix}beta must be a number or {wanted}, got a {type_name(beta)}")


NONFINITE_POLICIES: tuple[str, ...] = ("raise", "skip", "propagate")
"""The values of ``nonfinite``: what a step does with a NaN or infinite gradient (page "Guarantees")."""


def check_nonfinite_policy(policy: Any, where: str = "") -> str:
    """``policy`` if it is one of `NONFINITE_POLICIES`, else a ValueError (prefixed with ``where``)."""
    if policy not in NONFINITE_POLICIES:
        prefix = f"{where}: " if where else ""
        raise ValueError(f"{prefix}nonfinite must be 'raise', 'skip' or 'propagate', got {policy!r}")
    return policy


def all_finite(xp: Any, X: Array, axis: Any = None) -> Array:
    """Whether every entry of ``X`` (over ``axis``; ``None``: all of it) is finite, as a boolean array.

    ``max|X|`` is finite exactly when every entry is: the maximum of NumPy,
    torch, JAX and CuPy propagates a NaN, and ``|inf|`` is infinite. One
    elementwise pass and one reduction, where ``all(isfinite(X))`` takes
    four passes and a reduction in eager torch (3–10x the time on a CPU).
    No host read. An ``X`` without entries (an empty FSDP2 shard) is finite.
    Not ``isfinite(sum(X * 0))``, the rule until 2026-12-02: inductor folds
    ``X * 0`` to zeros, and every NaN and infinity passed a compiled step's
    checks (``"raise"`` and ``"skip"``; a user's hunt).
    """
    if math.prod(X.shape) == 0:  # a maximum over nothing has no value
        return xp.all(xp.isfinite(X), axis=axis)
    return xp.isfinite(xp.max(xp.abs(X), axis=axis))


def check_finite(xp: Any, G: Array, W: Optional[Array] = None, *, dtype: Any = None) -> None:
    """Raise before any state changes if ``G`` (or ``W``, when given) has a NaN or an infinity.

    ``dtype``: the state's, to which the step casts ``G``; ``G`` is checked
    as cast (a float64 gradient beyond float32's range is infinite in a
    float32 state). This reads one boolean back from the device (one
    synchronisation per call, for both arrays). Inside a traced function
    (``jax.jit``) no value can be read; the check is then left out, and
    non-finite values propagate.
    """
    given_dtype = G.dtype
    if dtype is not None:
        G = xp.astype(G, dtype, copy=False)
    finite = all_finite(xp, G)
    if W is not None:
        finite = finite & all_finite(xp, W)
    ok = _host_bool(finite)
    if ok is None or ok:  # traced (jax.jit): nothing can be read, no check
        return
    for X, name in ((G, "G"), (W, "W")):
        if X is None or bool(xp.all(xp.isfinite(X))):
            continue
        counts = _nonfinite_counts(xp, X)
        if name == "G":
            if G.dtype != given_dtype:
                counts += f" once cast from {given_dtype} to the state's dtype {G.dtype}, whose range it exceeds"
            raise ValueError(
                f"G contains NaN or infinite values ({counts}); the step was not taken and the state is unchanged "
                "(check the loss and the gradient computation, or use FISMO(nonfinite='skip') to skip such steps)"
            )
        raise ValueError(
            f"W contains NaN or infinite values ({counts}): the parameters are already damaged (an earlier "
            "step diverged, or they were loaded so); the step was not taken and the state is unchanged. "
            "Restore W from a checkpoint"
        )


def check_saved_finite(xp: Any, X: Array, key: str) -> None:
    """Refuse a saved state array ``X`` (``state.<key>``) that holds a NaN or an infinity, with a ``ValueError``.

    ``P``, ``Q`` and ``M`` are averages of every gradient since the first
    step: one NaN stays in them for good, and a step with them turns the
    parameters into NaN without an error under any policy (the gradient's
    and the parameters' checks pass). Such a state comes from a run that
    diverged under ``nonfinite="propagate"``, or from a damaged file; it is
    refused where it is loaded (`FISMOState.from_dict`, the torch
    ``load_state_dict``), one host read per array. Where nothing can be read
    (a tracer; torch's ``meta`` device: another rank's state, checked where
    its values are), no check.
    """
    if not has_values(X) or _host_bool(all_finite(xp, X)) in (None, True):
        return
    raise ValueError(
        f"state.{key} contains NaN or infinite values ({_nonfinite_counts(xp, X)}): the state is damaged (saved "
        "by a run that diverged, or edited), and a step would turn the parameters into NaN. Resume from an "
        "earlier checkpoint, or start a new state"
    )


def has_values(X: Array) -> bool:
    """Whether ``X``'s values can be read: not on torch's ``meta`` device, where a distributed checkpoint's
    checks hold another rank's matrices by their shapes and dtypes alone (their owner reads the values)."""
    return getattr(_device(X), "type", None) != "meta"


def _nonfinite_counts(xp: Any, X: Array) -> str:
    """How many entries of ``X`` are NaN and infinite, in words (two host reads: for an error message only)."""
    nan = linalg._count_set(xp, xp.isnan(X))
    inf = linalg._count_set(xp, xp.isinf(X))
    return f"{nan} NaN, {inf} infinite of {math.prod(X.shape)} entries"


# ------------------------------------------------------- other optimizers' keywords
#: Keywords of ``torch.optim.Muon`` and ``optax.contrib.muon`` that are fields of
#: [`PolarConfig`][fismo_core.PolarConfig] here: Muon's Newton–Schulz iteration is line 8's polar factor.
MUON_POLAR_KEYWORDS: dict[str, tuple[str, str]] = {
    "ns_steps": ("torch.optim.Muon, optax.contrib.muon", "steps"),
    "ns_coefficients": ("torch.optim.Muon", "coefficients"),
    "ns_coeffs": ("optax.contrib.muon", "coefficients"),
    "eps": ("torch.optim.Muon, optax.contrib.muon", "eps"),
}
_ADJUST_LR = "'original': lr * sqrt(max(1, m / n)), 'match_rms_adamw': lr * 0.2 * sqrt(max(m, n))"
#: Their other keywords: who uses the name, and FISMO's spelling (a function of the value given).
MUON_KEYWORDS: dict[str, tuple[str, Callable[[Any], str]]] = {
    "momentum": (
        "torch.optim.Muon",
        lambda v: f"beta={v!r} (the momentum of line 7, M <- beta M + (1 - beta) G~, an average of the same form)",
    ),
    "adjust_lr_fn": (
        "torch.optim.Muon",
        lambda v: "only fismo_core.backends.torch.FISMO takes adjust_lr_fn; here scale the learning rate "
        f"by the shape yourself ({_ADJUST_LR})",
    ),
    "adaptive": ("optax.contrib.muon", lambda v: "no equivalent: FISMO has no adaptive scaling of the update"),
    "preconditioning": (
        "optax.contrib.muon",
        lambda v: "no option: FISMO's Newton–Schulz normalises by the Frobenius norm (optax's 'frobenius'); "
        "polar='svd' is the exact polar factor",
    ),
    "mu_dtype": (
        "optax.contrib.muon",
        lambda v: "no option: the momentum and factors are float32 for bfloat16/float16 parameters and in the "
        "parameters' dtype otherwise (fismo_core.state_dtype)",
    ),
    "consistent_rms": (
        "optax.contrib.muon",
        lambda v: "fismo_core.backends.optax.fismo_training takes consistent_rms (optax's scaling, "
        "c * sqrt(max(m, n))); with fismo, scale the learning rate (fismo_core.backends.torch.FISMO's "
        "adjust_lr_fn='match_rms_adamw' is lr * 0.2 * sqrt(max(m, n)))",
    ),
}

_Decorated = TypeVar("_Decorated")


def _polar_value(field: str, value: Any) -> Any:
    """A Muon value as the `PolarConfig` field takes it: Muon's one ``(a, b, c)`` triple is a schedule of one."""
    if field == "coefficients" and not isinstance(value, str):
        try:
            if len(value) == 3 and all(isinstance(v, numbers.Real) for v in value):
                return (tuple(value),)
        except TypeError:
            pass
    return value


def _polar_fields(polar: Any) -> dict[str, Any]:
    """The `PolarConfig` fields a ``polar`` option given as a method name or a dict sets, Muon's names spelt
    as FISMO's (a config object or anything else: none)."""
    if isinstance(polar, str):
        return {"method": polar}
    if not isinstance(polar, dict):
        return {}
    fields = {}
    for name, value in polar.items():
        field = MUON_POLAR_KEYWORDS[name][1] if name in MUON_POLAR_KEYWORDS else name
        fields[field] = _polar_value(field, value)
    return fields


def foreign_keyword_error(
    subject: str, given: dict[str, Any], notes: Optional[dict[str, tuple[str, str]]] = None, *,
    polar: Any = None,
) -> TypeError:
    """The ``TypeError`` for keywords of other optimizers (`MUON_POLAR_KEYWORDS`, `MUON_KEYWORDS`, ``notes``).

    ``subject`` starts the message (``"FISMO() got keyword arguments"``). It
    names each keyword with the optimizers that use it and FISMO's spelling
    of it, the Newton–Schulz ones gathered into one ``polar=PolarConfig(...)``
    that keeps what the ``polar`` option given with them sets (a method name
    or a dict). ``notes`` adds an adapter's own keywords: name to ``(origin, hint)``.
    """
    notes = notes or {}
    origins: list[str] = []
    spellings: list[str] = []
    suggested: dict[str, Any] = {}
    for name, value in given.items():
        origin = []
        if name in MUON_POLAR_KEYWORDS:
            origin.append(MUON_POLAR_KEYWORDS[name][0])
            field = MUON_POLAR_KEYWORDS[name][1]
            suggested[field] = _polar_value(field, value)
        if name in MUON_KEYWORDS:
            origin.append(MUON_KEYWORDS[name][0])
            spellings.append(f"{name} -> {MUON_KEYWORDS[name][1](value)}")
        if name in notes:
            origin.append(notes[name][0])
            spellings.append(f"{name} -> {notes[name][1]}")
        origins.append(f"{name}={value!r} ({'; '.join(origin)})")
    if suggested:
        fields = ", ".join(f"{k}={v!r}" for k, v in {**_polar_fields(polar), **suggested}.items())
        spellings.insert(0, f"polar=PolarConfig({fields}) (line 8's polar factor; a dict of the same fields works too)")
    return TypeError(
        f"{subject} of other optimizers, which FISMO spells differently: "
        f"{', '.join(origins)}. In FISMO: {'; '.join(spellings)}"
    )


def foreign_keywords(
    where: str, notes: Optional[dict[str, tuple[str, str]]] = None
) -> Callable[[_Decorated], _Decorated]:
    """Decorate a function or a class (its ``__init__``) so that other optimizers' keywords get FISMO's spelling.

    A keyword the function does not take that is one of ``torch.optim.Muon``'s
    or ``optax.contrib.muon``'s (`MUON_POLAR_KEYWORDS`, `MUON_KEYWORDS`) or
    in ``notes`` (an adapter's: name to ``(origin, hint)``) raises
    `foreign_keyword_error` before the function runs;
    any other unexpected keyword gets Python's own ``TypeError``. The
    signature seen by ``inspect`` is the function's own.
    """
    known = set(MUON_POLAR_KEYWORDS) | set(MUON_KEYWORDS) | set(notes or ())

    def decorate(target: Any) -> Any:
        function = target.__init__ if isinstance(target, type) else target  # type: ignore[misc]  # the class's own
        foreign = known - set(inspect.signature(function).parameters)

        @functools.wraps(function)
        def checked(*args: Any, **kwargs: Any) -> Any:
            given = {k: v for k, v in kwargs.items() if k in foreign}
            if given:
                raise foreign_keyword_error(f"{where}() got keyword arguments", given, notes,
                                            polar=kwargs.get("polar"))
            return function(*args, **kwargs)

        if isinstance(target, type):
            target.__init__ = checked  # type: ignore[misc]  # replaced on the class, for every instance
            return target
        return checked

    return decorate


# ------------------------------------------------------------------ factor size
class FactorSizeWarning(UserWarning):
    """A matrix's Kronecker factors would hold far more entries than the matrix (`check_factor_size`)."""


#: `check_factor_size` warns when ``P`` and ``Q`` hold more than this many times the matrix's entries ...
FACTOR_SIZE_RATIO = 16
#: ... and more than this many entries (a 1024 x 1024 factor, 4 MiB in float32).
FACTOR_SIZE_FLOOR = 1024 * 1024


def check_factor_size(m: int, n: int, block_size: Optional[int], name: str = "W") -> None:
    """Warn (`FactorSizeWarning`) when the factors of an ``m x n`` matrix would dwarf the matrix.

    The rule: ``P`` and ``Q`` as stored (``m^2 + n^2`` entries with full
    factors, at most ``(m + n) B`` with ``block_size=B``) hold more than
    ``FACTOR_SIZE_RATIO = 16`` times the ``m n`` entries of the matrix and
    more than ``FACTOR_SIZE_FLOOR = 2^20``. With full factors the ratio is
    ``m/n + n/m``: at most about 9 for the weights FISMO is meant for (4 for
    a transformer MLP, 8/3 for a gated one, 9 for a 3x3 convolution
    ``(c, 9c)``), 16 or more for a vector stored as a matrix (``(1, d)``),
    an embedding table or a vocabulary head, whose factor of side ``d`` costs
    a ``d x d`` eigendecomposition at every step. The floor spares small
    matrices whose factors are cheap whatever the ratio. Called when a
    state is created ([`FISMO.init`][fismo_core.FISMO.init], so once per
    parameter in the adapters); ``name`` says which parameter.
    """
    entries = (state_size(m, n, block_size) - m * n) // 2  # P and Q; their roots are the other half
    if entries <= max(FACTOR_SIZE_RATIO * m * n, FACTOR_SIZE_FLOOR):
        return

    def shape(d: int) -> str:
        s = factor_structure(d, block_size)
        if not isinstance(s, BlockDiagonalFactor):
            return f"{d}x{d}"
        return f"{s.k} block{'s' if s.k > 1 else ''} {s.B}x{s.B}" + (f" and one {s.r}x{s.r}" if s.r else "")

    largest = max(part[-1] for d in (m, n) for part in factor_structure(d, block_size).part_shapes())
    warnings.warn(
        f"FISMO: {name}, a {m}x{n} matrix, would keep Kronecker factors P ({shape(m)}) and Q ({shape(n)}) of "
        f"{entries:,} entries, {entries / (m * n):.0f} times the {m * n:,} entries of the matrix (and their "
        f"inverse roots as many again), and take the inverse root of a {largest}x{largest} matrix at every "
        f"step. {'Pass block_size=B' if block_size is None else f'Pass a block_size below {block_size}'} "
        "(block-diagonal factors of at most (m + n) B entries; see the page 'Scaling up'), or, for a vector "
        "stored as a matrix, an embedding or an output head, optimise it with AdamW",
        FactorSizeWarning,
        stacklevel=_caller_stacklevel(),
    )


# ------------------------------------------------------------- statistics scale
def statistics_scale(xp: Any, G: Array, statistics: str) -> tuple[Array, Any, Any]:
    """``(G_s, scale, 1/s^2)``: the gradient lines 4–5 use, ``G_s = G / scale``.

    ``scale = s`` for the printed statistics and ``rms(G) s`` for
    ``"scale_invariant"``, with ``s`` a power of two per matrix (1 unless
    ``max|G / rms| >= 2``): the Gram products of ``G_s`` cannot overflow, and
    lines 4–5 take ``P_{t-1} / s^2`` in the EMA (``inv_s2``), which trace
    normalisation maps to the same ``P_t`` (bit for bit the unscaled result
    unless that overflows; docs/guarantees.md). Lines 6–7 multiply ``scale``
    back into a coefficient.
    """
    m, n = G.shape[-2], G.shape[-1]
    amax = xp.max(xp.abs(G), axis=(-2, -1), keepdims=True)
    if statistics == "scale_invariant":  # G / rms(G), per matrix; a zero G stays zero
        # rms on G / 2^k, max|G / 2^k| in [1, 2), so the sum of squares can neither overflow nor
        # underflow (it did for max|G| below about 1e-19 in float32); the power of two cancels exactly.
        pow2 = linalg._pow2_of(amax, float(xp.finfo(G.dtype).smallest_normal))
        rms = xp.sqrt(xp.sum((G / pow2) ** 2, axis=(-2, -1), keepdims=True) / (m * n))
        stat_scale = pow2 * xp.where(rms > 0, rms, xp.ones_like(rms))
        G_stat = G / stat_scale
        # max|G / c| = max|G| / c, rounded alike (rounding is monotone): no second pass over G.
        amax = amax / stat_scale
    else:
        stat_scale, G_stat = 1.0, G
    s = linalg._pow2_of(amax)
    return G_stat / s, stat_scale * s, 1 / s / s


# ------------------------------------------------------------------ non-finite
def skip_mask(xp: Any, G: Array) -> tuple[Array, Array]:
    """``nonfinite="skip"``: per matrix, whether ``G`` has a NaN or infinity, and ``G`` with those matrices zeroed.

    Sync-free: a skipped matrix is computed with ``G = 0`` (so no NaN reaches
    ``eigh``) and restored afterwards by `restore_skipped`.
    """
    skip = ~all_finite(xp, G, axis=(-2, -1))
    return skip, xp.where(skip[..., None, None], xp.zeros_like(G), G)


def select(xp: Any, keep: Array, old: Any, new: Any) -> Any:
    """Per matrix of the batch, ``old`` where ``keep`` else ``new``; for arrays and `Blocks` alike."""
    if isinstance(new, tuple):
        kind: Any = type(new)  # a NamedTuple of arrays or Blocks
        return kind(*(None if n is None else select(xp, keep, o, n) for o, n in zip(old, new)))
    mask = keep
    while mask.ndim < new.ndim:
        mask = mask[..., None]
    return xp.where(mask, old, new)


def counter(xp: Any, value: Any, shape: tuple[int, ...], dev: Any) -> Array:
    """A counter field as an int32 array of the batch ``shape`` (states built by hand may hold a Python int)."""
    if isinstance(value, numbers.Integral):
        return xp.full(shape, int(value), dtype=xp.int32, device=dev)
    return value


def restore_skipped(xp: Any, skip: Array, direction: Array, state: Any, new: Any, fields: tuple[str, ...]) -> tuple:
    """``nonfinite="skip"``: matrices flagged in ``skip`` get direction 0 and their old state, and are counted."""
    batch, dev = tuple(skip.shape), _device(direction)
    arrays = {name: select(xp, skip, getattr(state, name), getattr(new, name)) for name in fields}
    failures = counter(xp, new.root_failures, batch, dev)
    return xp.where(skip[..., None, None], xp.zeros_like(direction), direction), new._replace(
        **arrays,
        # asarray: NumPy returns a scalar, not a 0-d array, for the sum of two 0-d arrays.
        skipped=xp.asarray(counter(xp, state.skipped, batch, dev) + xp.astype(skip, xp.int32)),
        root_failures=xp.where(skip, counter(xp, state.root_failures, batch, dev), failures),
    )


# ------------------------------------------------------------------ deferred faults
class StepFaults(NamedTuple):
    """The fault flags of one step, kept on the device until the one host read of `read_faults`.

    Each field is ``None`` when nothing was checked, or a boolean array of
    the batch shape (``()`` for a single matrix), ``True`` for a matrix
    with a fault. Returned by
    [`FISMO.direction_with_faults`][fismo_core.FISMO.direction_with_faults]
    in its `StepResult`; [`FISMO.settle`][fismo_core.FISMO.settle] acts on them.
    """

    nonfinite: Optional[Array] = None
    """``nonfinite="raise"`` only: the matrix's ``G_t`` has a NaN or an infinity (it was computed with ``G_t = 0``)."""
    roots: Optional[Array] = None
    """The first attempt at ``P_t^{-1/2}`` or ``Q_t^{-1/2}`` failed its check (`checked_inverse_sqrt`):
    the step must be taken again with the fault handling of `InverseRootConfig`. ``None`` when the roots
    are not checked (`checks_roots`) or not recomputed at this step (``every``)."""


def read_faults(*flags: Any) -> Optional[bool]:
    """The one host read of a step: whether any of ``flags`` is set.

    ``flags`` are boolean arrays, `StepFaults` (their fields) or ``None``
    (skipped), from any number of core calls, so that an adapter reads its
    own flags (gradients, parameters) and every bucket's in one go. They
    are flattened and reduced on the device and one boolean is read back
    per device they live on (one in all for an optimizer on one device).
    Returns ``False`` without any read when no flag is given, and ``None``
    when the flags are traced (``jax.jit``), where nothing can be read.
    """
    arrays: list[Array] = []
    for flag in flags:
        if isinstance(flag, StepFaults):
            arrays.extend(f for f in flag if f is not None)
        elif flag is not None:
            arrays.append(flag)
    groups: dict[tuple[int, str], list[Array]] = {}
    for flag in arrays:
        xp = array_namespace(flag)
        groups.setdefault((id(xp), str(_device(flag))), []).append(xp.reshape(flag, (-1,)))
    found = False
    for group in groups.values():
        xp = array_namespace(*group)
        any_set = xp.any(group[0] if len(group) == 1 else xp.concat(group))
        read = _host_bool(any_set)
        if read is None:  # traced (jax.jit): nothing can be read
            return None
        found = read or found
    return found


# ------------------------------------------------------------------ inverse roots
def checks_roots(fallback: Optional[bool], nonfinite: str) -> bool:
    """Whether inverse roots are checked: ``fallback`` (`InverseRootConfig.fallback`), or by default
    (``None``) unless ``nonfinite="propagate"``. It takes the flag, not the config, so that a compiled torch
    step can ask it without building a config in the trace."""
    return fallback if fallback is not None else nonfinite != "propagate"


def is_linalg_error(exc: BaseException) -> bool:
    """A library's "the factorisation failed" error: NumPy/CuPy ``LinAlgError``, torch ``_LinAlgError``."""
    return any(cls.__name__.endswith("LinAlgError") for cls in type(exc).__mro__)


def _checked_root(xp: Any, root: Any, A: Array, tolerance: float, unit_roundoff: float) -> tuple[Array, Array]:
    """``Z = A^{-1/2}`` of a stack of square matrices by ``root``, and each one's ``||Z A Z - I||_F``.

    The residual cannot tell a small eigenvalue of ``A`` from one made of
    rounding: a root whose eigenvalues ``w`` (``"eigh"``'s own) have
    ``lambda_min <= u lambda_max`` (``u = unit_roundoff`` of the statistics'
    dtype: ``A`` singular at the precision it is stored in) gets a NaN
    residual, so it fails. A ``LinAlgError``
    of the batched call is retried matrix by matrix, so only the matrices
    that fail are marked (their ``Z`` and residual are NaN); in a compiled
    torch step, which cannot catch it, the library's ``eigh`` is
    `fismo_core._torch_eigh`'s, which does the same without raising.
    """
    graph_eigh = _eigh_that_cannot_raise(root, A)
    try:
        with nan_is_the_answer(xp):  # a singular A's NaN root fails its check below
            if graph_eigh is None:
                Z, w = root.root_and_eigenvalues(A)
            else:  # root.root_and_eigenvalues(A) with that eigh: the same values where nothing fails
                Z, w, _ = linalg._eigh_root_parts(A, eigh=graph_eigh)
    except Exception as exc:
        if not is_linalg_error(exc):
            raise
        Z, w = _roots_one_by_one(xp, root, A)
    eye = xp.eye(A.shape[-1], dtype=A.dtype, device=_device(A))
    with nan_is_the_answer(xp):  # a NaN or infinite root: a NaN or infinite residual, which fails
        residual = xp.linalg.matrix_norm(Z @ A @ Z - eye)
    if w is None:  # Newton–Schulz: no eigenvalues; a singular A leaves it unconverged, a large residual
        return Z, residual
    resolved = w[..., 0] > unit_roundoff * w[..., -1]
    return Z, xp.where(resolved, residual, xp.full_like(residual, math.nan))


def _eigh_that_cannot_raise(root: Any, A: Array) -> Optional[Callable[[Array], Any]]:
    """The ``eigh`` of `_checked_root` inside ``torch.compile``, where its ``LinAlgError`` cannot be caught:
    ``torch.ops.fismo.eigh_nan_where_it_fails`` for ``root``'s own ``eigh`` method (not a subclass's root,
    not where a derivative is taken); ``None`` elsewhere: the root as ``root`` computes it."""
    torch = sys.modules.get("torch")
    if (torch is None or not isinstance(A, torch.Tensor) or not torch.compiler.is_compiling()
            or not root._is_library_eigh() or _autodiff.needs_derivative(A)):
        return None
    from . import _torch_eigh

    return _torch_eigh.eigh_nan_where_it_fails


def _roots_one_by_one(xp: Any, root: Any, A: Array) -> tuple[Array, Optional[Array]]:
    """`_checked_root`'s roots and eigenvalues, matrix by matrix: NaN for each one whose call raised a
    ``LinAlgError`` (its NaN root fails the residual whatever its eigenvalues); no eigenvalues (``None``)
    when the root that succeeded gave none."""
    d = A.shape[-1]
    flat = xp.reshape(A, (-1, d, d))
    roots, spectra = [], []
    for i in range(flat.shape[0]):
        try:
            with nan_is_the_answer(xp):
                Z, w = root.root_and_eigenvalues(flat[i, ...])
        except Exception as exc:
            if not is_linalg_error(exc):
                raise
            Z = xp.full((d, d), math.nan, dtype=A.dtype, device=_device(A))
            w = xp.full((d,), math.nan, dtype=A.dtype, device=_device(A))
        roots.append(Z)
        spectra.append(w)
    Z = xp.reshape(xp.stack(roots), A.shape)
    if any(w is None for w in spectra):
        return Z, None
    return Z, xp.reshape(xp.stack(spectra), A.shape[:-1])


def _as_float64(xp: Any, A: Array) -> Optional[Array]:
    """``A`` in float64, or ``None`` where the device has no float64 (array-api-strict's ``no_float64``, MPS,
    JAX without ``jax_enable_x64``, which warns and gives float32: the warning is this function's to drop)."""
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Explicitly requested dtype", category=UserWarning)
            A64 = xp.astype(A, xp.float64)
    except (TypeError, ValueError, RuntimeError):
        return None
    return A64 if A64.dtype == xp.float64 else None


def checked_inverse_sqrt(
    xp: Any, structure: Structure, config: Any, nonfinite: str, A: Any, batch_ndim: int
) -> tuple[Any, Optional[Array]]:
    """``(A_t^{-1/2}, failed)`` for ``A_t = P_t`` (or ``Q_t``) without any host read: the root and its check.

    ``failed`` is ``None`` when roots are not checked (`checks_roots`), else
    a boolean array of the batch shape: the root of that matrix did not pass
    the check of `InverseRootConfig` (a ``LinAlgError``, a residual
    ``||Z A Z - I||_F`` above the tolerance or not finite, or ``eigh``'s
    eigenvalues with ``lambda_min <= u lambda_max``). Where nothing
    failed, the root is the one `guarded_inverse_sqrt` returns, bit for bit;
    where something did, that function's repair (float64 retry, fallback,
    warning) needs host reads and is left to the caller
    ([`FISMO.settle`][fismo_core.FISMO.settle]).
    """
    if not checks_roots(config.fallback, nonfinite):
        return structure.inverse_sqrt(A, config), None
    roots, ok = _first_attempt(xp, structure, config, structure.parts(A), batch_ndim)
    return structure.from_parts(tuple(roots)), ~ok


def _statistics_unit_roundoff(xp: Any, A: Array) -> float:
    """The unit roundoff ``u = eps / 2`` of the statistics ``A`` were stored in: the cut of `_checked_root`'s
    eigenvalue test. An eigenvalue ``lambda_min <= u lambda_max`` is within one rounding of the largest
    entries of zero, so not even its sign is determined by the stored factor."""
    return float(xp.finfo(A.dtype).eps) / 2


def _first_attempt(xp: Any, structure: Structure, config: Any, parts: Any, batch_ndim: int) -> tuple[list, Array]:
    """The roots of a factor's parts by ``config`` and, per matrix of the batch, whether they pass its check."""
    checked = [_checked_root(xp, config, part, config.tolerance, _statistics_unit_roundoff(xp, part)) for part in parts]
    return [Z for Z, _ in checked], _matrix_ok(xp, [r for _, r in checked], batch_ndim, config.tolerance)


def guarded_inverse_sqrt(
    xp: Any, structure: Structure, config: Any, nonfinite: str, A: Any, A_prev: Any, root_prev: Any, name: str,
    batch_ndim: int, exact: Any,
) -> tuple[Any, Any, Any]:
    """``A^{-1/2}`` of ``A = P_t`` (or ``Q_t``) with the fault handling of `InverseRootConfig`.

    Returns ``(A_t, A_t^{-1/2}, failed)``. ``failed`` is ``None`` when
    nothing was checked (checks off, or traced), ``False`` when every root
    passed, and otherwise a boolean array of the batch shape: those matrices
    keep ``A_prev`` and ``root_prev``. A matrix of a blocked factor fails
    when its residual over all blocks, ``sqrt(sum_i ||Z_i A_i Z_i - I||_F^2)``,
    exceeds the tolerance. ``exact`` is the float64 ``eigh`` root of the retry.
    """
    if not checks_roots(config.fallback, nonfinite):
        return A, structure.inverse_sqrt(A, config), None
    parts = structure.parts(A)
    roots, ok = _first_attempt(xp, structure, config, parts, batch_ndim)
    all_ok = _host_bool(xp.all(ok))
    if all_ok is None:  # traced (jax.jit): nothing can be read, no check
        return A, structure.from_parts(tuple(roots)), None
    if all_ok:
        return A, structure.from_parts(tuple(roots)), False
    retried = parts[0].dtype == xp.float64 and config._is_library_eigh()  # the first attempt was the retry's
    if not retried:
        parts64 = [_as_float64(xp, part) for part in parts]
        retried = all(p is not None for p in parts64)
        if retried:  # the retry: eigh in float64, checked in float64
            # the float32 statistics' u: the float64 root of a float32 factor cannot resolve more than they do
            checked64 = [_checked_root(xp, exact, p64, config.tolerance, _statistics_unit_roundoff(xp, part))
                         for p64, part in zip(parts64, parts)]
            ok64 = _matrix_ok(xp, [r for _, r in checked64], batch_ndim, config.tolerance)
            retry = ok64 & ~ok
            roots = [select(xp, retry, xp.astype(Z64, part.dtype), Z)
                     for (Z64, _), Z, part in zip(checked64, roots, parts)]
            ok = ok | ok64
    root = structure.from_parts(tuple(roots))
    failed = ~ok
    count = linalg._count_set(xp, failed)
    if count == 0:
        return A, root, False
    total = math.prod(failed.shape)
    retry = ("also with eigh in float64" if retried else
             "not retried in float64, unavailable here: a device without float64, or JAX without jax_enable_x64")
    warnings.warn(
        f"FISMO: the inverse square root of {name}_t failed for {count} of {total} matrices (a LinAlgError, "
        f"a non-finite result, ||Z {name}_t Z - I||_F > {config.tolerance} or lambda_min <= u lambda_max, "
        f"singular at the precision of the statistics; {retry}); "
        f"they keep {name}_(t-1) and its cached root for this step. state.root_failures counts consecutive "
        f"failures; more than InverseRootConfig.max_failures = {config.max_failures} raise InverseRootError",
        InverseRootWarning,
        stacklevel=_caller_stacklevel(),
    )
    return select(xp, failed, A_prev, A), select(xp, failed, root_prev, root), failed


def _caller_stacklevel() -> int:
    """The ``stacklevel`` that points a warning at the first frame outside this package (the user's call).

    The depth differs between ``FISMO.step``, ``FISMO.direction`` and the
    adapters, so it is counted rather than fixed. The frameworks' own
    frames between the user and an adapter (``torch.no_grad``'s wrapper of
    ``optimizer.step``, ``jax.tree`` and ``optax`` combinators) are passed over too. The demo
    (``fismo_core/demo/``) is a user of the optimizer: its training loop is where its warnings point
    (passed over, they pointed into ``concurrent/futures/process.py`` of its worker processes).
    """
    import fismo_core.backends

    roots = tuple(os.path.dirname(p) + os.sep for p in (__file__, fismo_core.backends.__file__))
    users = (os.path.join(os.path.dirname(__file__), "demo") + os.sep,)
    frame: Optional[types.FrameType] = sys._getframe(1)
    level = 1
    while frame is not None and (
        (frame.f_code.co_filename.startswith(roots) and not frame.f_code.co_filename.startswith(users))
        or frame.f_globals.get("__name__", "").startswith(_FRAMEWORK_MODULES)
    ):
        frame, level = frame.f_back, level + 1
    return level


_FRAMEWORK_MODULES = ("torch.", "jax.", "jaxlib.", "optax.")


def _matrix_ok(xp: Any, residuals: list[Array], batch_ndim: int, tolerance: float) -> Array:
    """Per matrix of the batch, whether the residual over all its blocks is within ``tolerance`` (NaN fails)."""
    if len(residuals) == 1 and residuals[0].ndim == batch_ndim:
        return residuals[0] <= tolerance  # a full factor: its own residual
    squares = [r**2 if r.ndim == batch_ndim else xp.sum(r**2, axis=-1) for r in residuals]
    total = squares[0]
    for s in squares[1:]:
        total = total + s
    return xp.sqrt(total) <= tolerance


def either_failed(P_failed: Optional[Array], Q_failed: Optional[Array]) -> Optional[Array]:
    """Per matrix, whether the root of ``P_t`` or ``Q_t`` failed (`checked_inverse_sqrt`'s flags); ``None``: unchecked."""
    if P_failed is None or Q_failed is None:
        return P_failed if Q_failed is None else Q_failed
    return P_failed | Q_failed


def counted_root_failures(xp: Any, state: Any, failed: Optional[Array]) -> Any:
    """The new ``root_failures`` counters from `either_failed`'s flags, without a host read.

    Unchecked (``None``): passed through. Otherwise 0 for a matrix whose
    roots passed, as `root_failure_counts` gives, and the previous count + 1
    for one that failed (whose step [`FISMO.settle`][fismo_core.FISMO.settle]
    then takes again with the fault handling, which counts it there).
    """
    if failed is None:
        return state.root_failures
    previous = counter(xp, state.root_failures, tuple(state.M.shape[:-2]), _device(state.M))
    return xp.where(failed, previous + 1, xp.zeros_like(previous))


def root_failure_counts(
    xp: Any, config: Any, state: Any, P_failed: Any, Q_failed: Any
) -> Any:
    """The new ``root_failures`` counters; `InverseRootError` when one exceeds ``max_failures``."""
    if P_failed is None and Q_failed is None:
        return state.root_failures  # unchecked: passed through
    batch = tuple(state.M.shape[:-2])
    failed = [(name, f) for name, f in (("P", P_failed), ("Q", Q_failed)) if f is not None and f is not False]
    if not failed:
        return xp.zeros(batch, dtype=xp.int32, device=_device(state.M))
    any_failed = failed[0][1] if len(failed) == 1 else failed[0][1] | failed[1][1]
    previous = counter(xp, state.root_failures, batch, _device(state.M))
    counts = xp.where(any_failed, previous + 1, xp.zeros_like(previous))
    over = xp.reshape(counts > config.max_failures, (-1,))
    if bool(xp.any(over)):
        indices = tuple(i for i in range(over.shape[0]) if bool(over[i]))
        which = " and ".join(name for name, _ in failed)
        raise InverseRootError(
            f"FISMO: the inverse square root of {which}_t failed on more than max_failures = "
            f"{config.max_failures} consecutive steps (matrices {list(indices)} of the batch, flat "
            f"indices), also with eigh in float64 where the device has float64; the step was not taken and "
            f"the state passed in is "
            f"unchanged. The preconditioner is too ill-conditioned for {state.M.dtype}: Algorithm 1 is not "
            f"scale invariant, and for gradient entries of size sigma P and Q can reach condition numbers "
            f"of about m sigma^2 / mu. Remedies: a larger mu, a smaller gradient scale, float64, or "
            f"statistics='scale_invariant' (see docs/guarantees.md)",
            indices,
        )
    return counts
