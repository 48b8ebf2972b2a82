"""Param-group routing of the torch adapter: which tensors FISMO takes, which AdamW takes, and their hyperparameters.

Part of [`fismo_core.backends.torch`][fismo_core.backends.torch]; import the
public names from there. This module holds

- the two algorithms' group keys and defaults (`ADAMW_DEFAULTS`, the core's
  defaults for FISMO groups) and their validation,
- `route_group`, which fills and checks a group before
  ``Optimizer.add_param_group`` stores it,
- `param_groups`, the helper that splits a module into a FISMO and an AdamW group
  (the output head rule included),
- the AdamW route (`adamw_group_step`, ``torch.optim.adamw.adamw`` bit for bit),
- the core instance for a group's hyperparameters (`core_key`, `make_core`).
"""

from __future__ import annotations

import copy
import dataclasses
import math
import numbers
import sys
import warnings
from collections.abc import Callable
from typing import Any, Optional, Union

import torch
from torch._dynamo.eval_frame import OptimizedModule as _OptimizedModule  # what torch.compile(model) returns
from torch.fx.experimental.symbolic_shapes import guard_scalar
from torch.nn.utils.weight_norm import WeightNorm as _WeightNorm  # the deprecated weight_norm's hook
from torch.optim.adamw import adamw as _adamw

from fismo_core.guards import MUON_KEYWORDS, MUON_POLAR_KEYWORDS, foreign_keyword_error
from fismo_core import guards as _guards  # the rules every adapter shares, looked up at each call
from fismo_core.optimizer import FISMO as _CoreFISMO
from fismo_core.optimizer import InverseRootConfig, PolarConfig, matrix_shape

from ._torch_distributed import is_dtensor, validate_dtensor

CORE_DEFAULTS = _CoreFISMO()
_POLAR_FIELDS = {f.name for f in dataclasses.fields(PolarConfig)}
_INV_ROOT_FIELDS = {f.name for f in dataclasses.fields(InverseRootConfig)}
_POLAR_ORDER = tuple(sorted(_POLAR_FIELDS))
_INV_ROOT_ORDER = tuple(sorted(_INV_ROOT_FIELDS))

ALGORITHMS = ("fismo", "adamw")
ADJUST_LR_FNS = (None, "original", "match_rms_adamw")

#: Defaults of an ``"adamw"`` group: those of ``torch.optim.AdamW``.
ADAMW_DEFAULTS: dict[str, Any] = {
    "lr": 1e-3,
    "betas": (0.9, 0.999),
    "eps": 1e-8,
    "weight_decay": 1e-2,
    "amsgrad": False,
    "maximize": False,
    "foreach": None,
}
FISMO_ONLY_KEYS = ("beta", "gamma", "mu", "polar", "inv_root", "nesterov", "adjust_lr_fn", "statistics", "block_size")
ADAMW_ONLY_KEYS = ("betas", "eps", "amsgrad", "maximize", "foreach")


# ---------------------------------------------------------------- small helpers
def adjusted_lr(lr: float, adjust_lr_fn: Optional[str], m: int, n: int) -> float:
    """``torch.optim.Muon``'s shape-dependent learning rate, on the (flattened) matrix shape ``(m, n)``."""
    if adjust_lr_fn is None:
        return lr
    if adjust_lr_fn == "original":
        return lr * math.sqrt(max(1, m / n))
    return lr * 0.2 * math.sqrt(max(m, n))  # "match_rms_adamw"


def scalar(x: Union[float, torch.Tensor]) -> float:
    """A Python number from a number or a one-element tensor (a tensor ``lr``)."""
    return x.item() if isinstance(x, torch.Tensor) else x


def _is_number(x: Any) -> bool:
    """A Python int or float, as a group stores its numbers (not a bool, not a NumPy scalar)."""
    return type(x) in (int, float)


#: How far below 0 a scheduled lr may round and still count as 0: 4 float64 roundings of the scheduler's
#: base lr (``initial_lr``). ``LinearLR(end_factor=0)`` ends at -0.47 of one at most (measured over 1440 of
#: its schedules that end below 0: start factors 0.001 to 1, 1 to 10**4 steps, base lrs 3e-4 to 1; 2026-12-03).
_SCHEDULED_LR_ROUNDING = 4 * sys.float_info.epsilon


def lr_is_negative(lr: float, group: dict) -> bool:
    """Whether ``lr`` is below 0 by more than a scheduler's rounding of 0: ``-lr`` beyond
    ``_SCHEDULED_LR_ROUNDING`` times the group's ``initial_lr`` (set by every ``LRScheduler``; none, no
    allowance). torch.optim checks ``lr`` in its constructor only, and its optimizers take the tiny
    negative lr ``LinearLR(end_factor=0.0)`` rounds to at its last step; FISMO refused it, and training
    stopped there (a user's hunt, 2026-12-03)."""
    initial = group.get("initial_lr")
    allowance = (_SCHEDULED_LR_ROUNDING * abs(float(initial))
                 if isinstance(initial, (numbers.Real, torch.Tensor)) and not isinstance(initial, bool) else 0.0)
    return lr < -allowance


def scalar_dtype() -> torch.dtype:
    """The dtype of AdamW's step counter, as ``torch.optim.AdamW`` chooses it."""
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


def param_name(group: dict, index: int, group_index: int, *, located: bool = False, shape: bool = True) -> str:
    """How error messages name parameter ``index`` of ``group``: its name when known, else index, group and shape.

    ``located``: a name is followed by the index, group and shape too (where a message must find the tensor).
    ``shape=False``: no shape after an index (for messages that state the shape themselves).
    """
    size = tuple(group["params"][index].shape)
    names = group.get("param_names")
    if names and index < len(names):
        name = f"parameter {names[index]!r}"
        return f"{name} (index {index} in param group {group_index}, shape {size})" if located else name
    return f"parameter {index} of param group {group_index}" + (f" (shape {size})" if shape else "")


# ---------------------------------------------------------------- the core of a group
def core_key(group: dict) -> tuple:
    """The hyperparameters of ``group`` that define its core instance, as a hashable key.

    Values set in the group since it was added are checked first; the errors do not name the group (its
    index is the caller's, `FISMO._core_for`).
    """
    polar, inv_root = group["polar"], group["inv_root"]
    if not (isinstance(polar, dict) and set(polar) == _POLAR_FIELDS and isinstance(inv_root, dict) and set(inv_root) == _INV_ROOT_FIELDS):
        # A config object, a method name or a partial dict set after construction: completed here,
        # so that a state_dict records every field (a checkpoint then resumes with the same schedule).
        validate_fismo_hparams(group, "")
    elif not _stored_as_checked(group):
        # A value set in the group since (a NumPy scalar from a schedule, a NumPy array beta, a negative
        # weight_decay or lr, a misspelt adjust_lr_fn): checked and stored as at construction, before it is
        # hashed into the key. Compiled, the check runs while dynamo traces (its eager run of _init_group),
        # and its comparisons guard a symbolic weight_decay or lr, so a value out of range retraces the step
        # and is refused there.
        validate_fismo_hparams(group, "")
    key = (
        group["beta"],
        group["gamma"],
        group["mu"],
        # In the fields' fixed order (not sorted(items()): dynamo cannot always trace a sort, and
        # torch.compile traces this at every step).
        tuple((name, group["polar"][name]) for name in _POLAR_ORDER),
        tuple((name, group["inv_root"][name]) for name in _INV_ROOT_ORDER),
        group["nesterov"],
        group.get("statistics", CORE_DEFAULTS.statistics),  # absent from checkpoints saved before it existed
        group.get("nonfinite", CORE_DEFAULTS.nonfinite),  # likewise
        group.get("block_size", CORE_DEFAULTS.block_size),  # likewise (None: full factors)
    )
    return _specialised(key) if torch.compiler.is_compiling() else key


def _stored_as_checked(group: dict) -> bool:
    """Whether ``beta``, ``gamma``, ``mu``, ``weight_decay`` and ``lr`` are as `validate_fismo_hparams` stores
    them: Python floats (``beta`` and ``lr`` may be tensors, ``lr`` an int), with ``weight_decay`` and a number
    ``lr`` in their ranges, and ``adjust_lr_fn`` one of its values. (``beta``, ``gamma`` and ``mu`` are in the
    core key, whose new values make a checked core; line 9 is the adapter's. A tensor lr's value is not read:
    no host read.)"""
    lr = group["lr"]
    return (all(type(group[name]) is float for name in ("gamma", "mu", "weight_decay"))
            # The settings an equal value of another type would pass unchecked (True == 1, 10.0 == 10 hash alike
            # in the core key): every=10.0 set after a step with 10 reused that core, and the state_dict saved
            # after it was refused at load (a user's hunt, 2026-12-04).
            and all(type(group[setting][name]) in types for (setting, name), types in _STORED_TYPES.items())
            and type(group["nesterov"]) is bool
            and type(group.get("block_size")) in (int, type(None))
            # Coefficients written as lists ([[a, b, c]]) are stored as tuples, as the constructor stores them:
            # the key is hashed (the step raised "unhashable type: 'list'", and compiled, an AssertionError).
            and all(_stored_coefficients(group[name]["coefficients"]) for name in ("polar", "inv_root"))
            and (type(group["beta"]) is float or isinstance(group["beta"], torch.Tensor))
            and 0.0 <= group["weight_decay"] < math.inf
            and (_one_real_number(lr) if isinstance(lr, torch.Tensor) else _is_number(lr) and 0.0 <= lr < math.inf)
            and group["adjust_lr_fn"] in ADJUST_LR_FNS)


_STORED_TYPES = {
    ("polar", "steps"): (int,), ("polar", "eps"): (float,), ("polar", "rtol"): (float, type(None)),
    ("inv_root", "steps"): (int, type(None)), ("inv_root", "fallback"): (bool, type(None)),
    ("inv_root", "max_failures"): (int,), ("inv_root", "tolerance"): (float,), ("inv_root", "every"): (int,),
}
"""The types the constructor stores for the numeric settings of ``polar`` and ``inv_root`` (`_stored_as_checked`)."""


def _one_real_number(t: torch.Tensor) -> bool:
    """Whether tensor ``t`` may hold a learning rate, read from its size and dtype alone (no host read): one
    element, neither complex nor boolean (the constructor refuses those; written into a group later, a complex
    lr stepped with torch's "discards the imaginary part" warning only, a user's hunt, 2026-12-03)."""
    return t.numel() == 1 and not t.is_complex() and t.dtype != torch.bool


def _stored_coefficients(coefficients: Any) -> bool:
    """Whether Newton–Schulz ``coefficients`` are as the constructor stores them: a name, ``None`` or a tuple
    of tuples."""
    return coefficients is None or type(coefficients) is str or (
        type(coefficients) is tuple and all(type(triple) is tuple for triple in coefficients))


def _specialised(value: Any) -> Any:
    """``value`` (a core key) with every number concrete, one graph per value as in eager mode.

    Once two compiled optimizers have read different floats at the same place (a sweep over
    ``mu``), dynamo traces that float symbolically ("automatic dynamic"); a core built from it
    would carry the symbol into its checks (a graph break) and its ``torch.cond`` branches (an
    error). ``guard_scalar`` makes it concrete and guards on its value instead.
    """
    if isinstance(value, tuple):
        return tuple(_specialised(v) for v in value)
    if value is None or isinstance(value, (bool, str, torch.Tensor)):  # a tensor beta: a graph input
        return value
    return guard_scalar(value)


def make_core(key: tuple) -> _CoreFISMO:
    """The core optimizer for one set of hyperparameters.

    Only `direction` is called, which does not use the
    learning rate or the weight decay (line 9 is applied by the adapter with
    the group's current lr, which schedulers may set to 0, a value the core's
    constructor rejects); they stay at the core's defaults.

    Non-finite gradients are checked by the adapter (so that errors name the
    parameter); under ``"raise"`` the core flags them too (and computes such a
    matrix with ``G = 0``, so nothing non-finite reaches the roots), its flags
    read with the adapter's in the step's one host read
    (`FISMO.direction_with_faults`); otherwise it runs with
    ``nonfinite="propagate"``. Its inverse-root checks follow the group's
    ``nonfinite`` policy by the core's rule (`fismo_core.guards.checks_roots`),
    unless ``inv_root`` sets ``fallback``.
    """
    beta, gamma, mu, polar, inv_root, nesterov, statistics, nonfinite, block_size = key
    # Given, not left to the constructor's defaults, and concrete: under dynamic=True torch 2.11's dynamo reads
    # those float defaults symbolically, and the core's checks of them (math.isfinite) broke the graph.
    lr, weight_decay = _specialised((CORE_DEFAULTS.lr, CORE_DEFAULTS.weight_decay))
    inv_root = InverseRootConfig(**dict(inv_root))
    inv_root = dataclasses.replace(inv_root, fallback=_guards.checks_roots(inv_root.fallback, nonfinite))
    return _CoreFISMO(
        beta=beta,
        gamma=gamma,
        mu=mu,
        polar=dict(polar),
        inv_root=inv_root,
        nesterov=nesterov,
        statistics=statistics,
        # "raise": a non-finite G is flagged (and computed as 0) for the step's one read; the adapter raises.
        nonfinite="raise" if nonfinite == "raise" else "propagate",
        block_size=block_size,
        lr=lr,
        weight_decay=weight_decay,
    )


# ---------------------------------------------------------------- validation
def check_group_settings(param_groups: list, source: str = "since it was added") -> None:
    """The settings of every group that a step reads and no core checks, as they may have been written since
    the group was added: its ``algorithm`` (fixed when the group is added: an AdamW group has AdamW's keys, a
    FISMO group FISMO's), its ``nonfinite`` policy, and an AdamW group's ``lr``, ``betas``, ``eps`` and
    ``weight_decay`` (AdamW groups make no core that would check them; a FISMO group's other values are
    checked by `core_key`). Before anything changes: torch's AdamW would raise some of them in its step, after
    the FISMO groups before it have stepped. ``source``: where the messages say a value came from (a
    checkpoint's groups, at ``load_state_dict``)."""
    for index, group in enumerate(param_groups):
        where = f"param group {index}"
        # A FISMO group holds FISMO's keys from the start (route_group; "beta", "gamma" and "mu" since the
        # first checkpoints, which lack the later ones), an AdamW group none of them.
        fismo_keys = [k for k in ("beta", "gamma", "mu") if k in group]
        if group["algorithm"] == "fismo" and 0 < len(fismo_keys) < 3:  # not an AdamW group: one was deleted
            missing = [k for k in ("beta", "gamma", "mu") if k not in group]
            raise ValueError(f"{where} is a FISMO group without {missing} (removed {source}); set "
                             f"{'it' if len(missing) == 1 else 'them'} again in the group")
        added_as = "fismo" if len(fismo_keys) == 3 else "adamw"
        if group["algorithm"] != added_as:
            raise ValueError(
                f"{where}: algorithm {group['algorithm']!r} set in a group added as {added_as!r}; "
                "a group keeps its algorithm (add another group with add_param_group)"
            )
        if added_as == "adamw":
            wrong = [k for k in FISMO_ONLY_KEYS if k in group]
            if wrong:
                raise ValueError(f"{where} is an 'adamw' group and FISMO's {wrong} was set in it {source}; "
                                 "AdamW groups have no such setting (set it in the FISMO groups only)")
            if not _adamw_stored_as_checked(group):
                validate_adamw_hparams(group, where)  # raises, or stores NumPy scalars as floats
            # As route_group refuses them: kept and not honoured. Not "capturable": dynamo's view of every
            # group of a traced torch.optim optimizer has capturable=True (OptimizerVariable._set_capturable).
            unsupported = {k: group[k] for k in ("fused", "differentiable") if group.get(k)}
            if unsupported:
                raise ValueError(f"{where} is an 'adamw' group and {unsupported} was set {source}; AdamW groups "
                                 "step as torch.optim.AdamW with fused=False, capturable=False, differentiable=False")
            refuse_coupled_decay(group, where, f" {source}")
        else:
            wrong = [k for k in ADAMW_ONLY_KEYS if k in group]
            if wrong:  # a schedule of AdamW's betas written into every group, say
                raise ValueError(f"{where} is a FISMO group and AdamW's {wrong} was set in it {source}; "
                                 "FISMO groups have no such setting (set it in the 'adamw' groups only)")
            foreign = {k: group[k] for k in (*MUON_POLAR_KEYWORDS, *MUON_KEYWORDS)
                       if k in group and k not in FISMO_ONLY_KEYS}
            if foreign:  # Muon's warm-up of group["momentum"], say: a key FISMO would keep and ignore
                raise ValueError(str(foreign_keyword_error(f"{where} has keys, set {source},", foreign)))
        _guards.check_nonfinite_policy(group.get("nonfinite", CORE_DEFAULTS.nonfinite), where)


def refuse_coupled_decay(group: dict, where: str, source: str) -> None:
    """A ``ValueError`` for an AdamW group with ``decoupled_weight_decay=False``: torch 2.13's Adam and AdamW
    groups carry the key, and with ``False`` ``torch.optim.AdamW`` is ``torch.optim.Adam`` (L2 decay), which
    these groups, always decoupled, kept and did not honour (1.5e-3 off in three steps; a user's hunt)."""
    if "decoupled_weight_decay" in group and not group["decoupled_weight_decay"]:
        raise ValueError(
            f"{where} is an 'adamw' group with decoupled_weight_decay=False{source}: AdamW groups decouple the "
            "weight decay, as torch.optim.AdamW does; for torch.optim.Adam's L2 decay give those parameters "
            "their own torch.optim.Adam"
        )


def check_each_param_once(param_groups: list) -> None:
    """Every parameter in one group, once: as `add_param_group` and ``torch.optim`` check when a group is added,
    again at the step, for tensors appended to a group's ``params`` list since. A matrix listed twice in its
    group had its update applied twice (its state advanced once); one listed in a FISMO and an AdamW group
    raised torch's ``KeyError`` in the AdamW step, after the FISMO groups had stepped."""
    if len({id(p) for group in param_groups for p in group["params"]}) == sum(len(g["params"]) for g in param_groups):
        return  # the usual case: one set, no Python loop over the names
    first: dict[int, tuple[int, int]] = {}
    for gi, group in enumerate(param_groups):
        for i, p in enumerate(group["params"]):
            if id(p) in first:
                gj, j = first[id(p)]
                raise ValueError(
                    f"{param_name(param_groups[gj], j, gj, located=True)} is listed again as "
                    f"{param_name(group, i, gi)} (appended to a group's 'params' since it was added); nothing "
                    "was stepped. List each parameter once, in one group"
                )
            first[id(p)] = (gi, i)


def check_states_fit(param_groups: list, state: Any) -> None:
    """Every existing state of a parameter with a gradient fits the parameter and its group, before anything
    changes. A FISMO matrix's momentum ``M`` has the matrix's shape (on every rank: another rank's matrix by its
    placeholder), where the core raised on the owner alone, naming no parameter. An AdamW parameter's
    moments have its shape, and ``max_exp_avg_sq`` exists where ``amsgrad`` is on: ``torch.optim.AdamW``'s
    step raises (a size mismatch, ``KeyError``) after the FISMO groups before it have stepped. A state of
    another shape comes from a resized parameter (a grown vocabulary, a widened layer). Every parameter with a
    gradient, and every AdamW moment, must have memory of its own (`self_overlaps`): an expanded tensor appended
    to a group's list or set as ``p.data`` since the group's checks made torch raise at the in-place update."""
    eager = not torch.compiler.is_compiling()  # dynamo cannot trace is_inference (torch 2.13)
    for index, group in enumerate(param_groups):
        for i, p in enumerate(group["params"]):
            if p.grad is None:
                continue
            if self_overlaps(p):  # appended to an AdamW group's list, or p.data replaced, since it was checked
                refuse_self_overlap(p, param_name(group, i, index, shape=False))
            if eager and p.is_inference():  # torch raised at its in-place update, after the states were written
                raise RuntimeError(
                    f"{param_name(group, i, index, shape=False)} is an inference tensor (made inside "
                    "torch.inference_mode()), which no step can update in place; nothing was stepped. Optimise a "
                    "normal tensor: make it outside inference mode, or clone it there (p.clone())"
                )
            s = state.get(p)
            if not s:
                continue
            made_by = "fismo" if "M" in s else "adamw" if "exp_avg" in s else group["algorithm"]
            if made_by != group["algorithm"]:  # the parameter moved between a FISMO and an AdamW group
                algorithm = {"fismo": "a FISMO", "adamw": "an AdamW"}
                raise ValueError(
                    f"{param_name(group, i, index)} is in {algorithm[group['algorithm']]} group but has the state "
                    f"of {algorithm[made_by]} group, where it was stepped (moved since); nothing was stepped. Start "
                    "its state anew (del opt.state[p])"
                )
            if group["algorithm"] == "fismo":
                M = s.get("M")
                if isinstance(M, torch.Tensor) and tuple(M.shape) != matrix_shape(p.shape):
                    raise ValueError(
                        f"{param_name(group, i, index)}: its FISMO state was made for a {M.shape[0]}x{M.shape[1]} "
                        "matrix, not for this parameter's (resized since the state was made or loaded); nothing "
                        "was stepped. Start this parameter's state anew (del opt.state[p]) or load a state of its shape"
                    )
                continue
            for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
                value = s.get(key)
                if isinstance(value, torch.Tensor) and value.shape != p.shape:
                    raise ValueError(
                        f"{param_name(group, i, index)}: its AdamW state {key!r} has shape {tuple(value.shape)}, "
                        "not the parameter's (resized since the state was made or loaded); nothing "
                        "was stepped. Start this parameter's state anew (del opt.state[p]) or load a state of its shape"
                    )
                if isinstance(value, torch.Tensor) and self_overlaps(value):  # torch.optim.AdamW updates it in place
                    raise ValueError(
                        f"{param_name(group, i, index)}: its AdamW state {key!r} has strides {tuple(value.stride())}: "
                        "elements along a stride of 0 share one memory location, which the in-place update cannot "
                        "write; nothing was stepped. Give it memory of its own (opt.state[p][key] = value.clone())"
                    )
            if group["amsgrad"] and "max_exp_avg_sq" not in s:
                raise ValueError(
                    f"{param_name(group, i, index)}: amsgrad was turned on in param group {index} after this "
                    "parameter's AdamW state was made without 'max_exp_avg_sq' (torch.optim.AdamW raises KeyError); "
                    "nothing was stepped. Set amsgrad when the group is added, or start the state anew"
                )


def validate_fismo_hparams(hp: dict, where: str) -> None:
    """Check a FISMO group's hyperparameters (the core checks its own) and store ``polar``/``inv_root`` as dicts.

    Errors begin with ``where`` (nothing when it is empty: the caller names the group).
    """
    prefix = f"{where}: " if where else ""
    lr = hp["lr"]
    if isinstance(lr, torch.Tensor):
        if lr.numel() != 1:
            raise ValueError(f"{prefix}a tensor lr must have one element")
        lr = lr.item()
    if isinstance(lr, bool) or not isinstance(lr, numbers.Real) or not math.isfinite(lr) or lr_is_negative(float(lr), hp):
        raise ValueError(f"{prefix}lr must be a finite number >= 0, got {hp['lr']!r}")
    if not isinstance(hp["lr"], torch.Tensor) and not _is_number(hp["lr"]):
        # A NumPy scalar (np.float32, np.float64, ...) is stored as a Python float: a state_dict holding it
        # would not load with torch.load(weights_only=True).
        hp["lr"] = float(lr)
    if hp["adjust_lr_fn"] not in ADJUST_LR_FNS:
        raise ValueError(
            f"{prefix}adjust_lr_fn must be None, 'original' or 'match_rms_adamw', got {hp['adjust_lr_fn']!r}"
        )
    _guards.check_beta_library(hp["beta"], torch.Tensor, where, "a 0-d floating torch tensor")
    try:
        # The core validates beta, gamma, mu, weight_decay, nesterov, polar and inv_root.
        core = _CoreFISMO(
            beta=hp["beta"],
            gamma=hp["gamma"],
            mu=hp["mu"],
            polar=hp["polar"],
            inv_root=hp["inv_root"],
            weight_decay=hp["weight_decay"],
            nesterov=hp["nesterov"],
            statistics=hp.get("statistics", CORE_DEFAULTS.statistics),
            nonfinite=hp.get("nonfinite", CORE_DEFAULTS.nonfinite),
            block_size=hp.get("block_size", CORE_DEFAULTS.block_size),
        )
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"{prefix}{exc}") from exc
    # Python floats and bools (a NumPy scalar as given, np.float64, np.True_) and plain dicts, so that a
    # state_dict loads with torch.load(weights_only=True); a tensor beta is kept, the object the caller may change in place.
    for name in ("beta", "gamma", "mu", "weight_decay", "nesterov"):
        hp[name] = getattr(core, name)
    hp["polar"] = dataclasses.asdict(core.polar)
    hp["inv_root"] = dataclasses.asdict(core.inv_root)
    if "block_size" in hp:
        hp["block_size"] = core.block_size  # a Python int (or None), whatever integer type was given


def validate_adamw_hparams(group: dict, where: str) -> None:
    """Check an AdamW group's hyperparameters as ``torch.optim.AdamW`` does."""
    if isinstance(group["lr"], torch.Tensor):  # torch.optim.AdamW's checks; its step would raise them too late
        if group["foreach"]:
            raise ValueError(
                f"{where}: a tensor AdamW lr needs foreach=False or None (AdamW groups step as "
                "torch.optim.AdamW with capturable=False, which refuses a tensor lr with foreach=True)"
            )
        if group["lr"].numel() != 1:
            raise ValueError(f"{where}: a tensor AdamW lr must have one element, got shape {tuple(group['lr'].shape)}")
        if not _one_real_number(group["lr"]):
            raise ValueError(f"{where}: a tensor AdamW lr must be real, not {group['lr'].dtype}, got {group['lr']!r}")
    # A string, None or a bool: torch.optim.AdamW raised a bare TypeError naming no group, or took True as 1.
    for name, value in [("lr", group["lr"]), ("eps", group["eps"]), ("weight_decay", group["weight_decay"]),
                        *(("betas", b) for b in group["betas"])]:
        if not isinstance(value, torch.Tensor) and (isinstance(value, bool) or not isinstance(value, numbers.Real)):
            raise ValueError(f"{where}: AdamW {name} must be {'two real numbers' if name == 'betas' else 'a real number'}, "
                             f"got {group[name]!r}")
    lr = scalar(group["lr"])
    if math.isnan(lr) or lr_is_negative(lr, group):
        raise ValueError(f"{where}: invalid AdamW lr {group['lr']!r}")
    if not 0.0 <= group["eps"]:
        raise ValueError(f"{where}: invalid AdamW eps {group['eps']!r}")
    betas = group["betas"]
    tensor_betas = [isinstance(b, torch.Tensor) for b in betas]
    if any(tensor_betas):  # torch.optim.AdamW's checks; its step raised them after FISMO's groups had stepped
        if not all(tensor_betas) or len(betas) != 2:
            raise ValueError(f"{where}: AdamW betas must be two numbers or two one-element tensors, got {betas!r}")
        if group["foreach"]:
            raise ValueError(
                f"{where}: tensor AdamW betas need foreach=False or None (AdamW groups step as "
                "torch.optim.AdamW with capturable=False, which refuses tensor betas with foreach=True)"
            )
        if any(b.numel() != 1 for b in betas):
            raise ValueError(f"{where}: tensor AdamW betas must have one element each, got {betas!r}")
    if len(betas) != 2 or not all(0.0 <= scalar(b) < 1.0 for b in betas):
        raise ValueError(f"{where}: AdamW betas must be two numbers in [0, 1), got {betas!r}")
    if not 0.0 <= group["weight_decay"]:
        raise ValueError(f"{where}: invalid AdamW weight_decay {group['weight_decay']!r}")
    _guards.check_nonfinite_policy(group.get("nonfinite", CORE_DEFAULTS.nonfinite), where)  # older checkpoints: none
    # Python floats (a NumPy scalar as given, np.float64), so that a state_dict loads with
    # torch.load(weights_only=True), as in FISMO groups (torch.optim.AdamW keeps them as given).
    for name in ("lr", "eps", "weight_decay"):
        if not _is_number(group[name]) and not isinstance(group[name], torch.Tensor):
            group[name] = float(group[name])
    if not any(tensor_betas):
        group["betas"] = tuple(b if _is_number(b) else float(b) for b in betas)


def _adamw_stored_as_checked(group: dict) -> bool:
    """Whether an AdamW group's ``lr``, ``betas``, ``eps`` and ``weight_decay`` are as `validate_adamw_hparams`
    leaves them, without reading a tensor's value (no host read): numbers in their ranges, or one-element
    tensors without ``foreach``."""
    lr, betas = group["lr"], group["betas"]
    tensors_allowed = not group["foreach"]
    return ((_one_real_number(lr) and tensors_allowed if isinstance(lr, torch.Tensor) else _is_number(lr) and 0.0 <= lr)
            and all(_is_number(group[name]) and 0.0 <= group[name] for name in ("eps", "weight_decay"))
            and isinstance(betas, (tuple, list)) and len(betas) == 2
            and (all(_is_number(b) and 0.0 <= b < 1.0 for b in betas)
                 or tensors_allowed and all(isinstance(b, torch.Tensor) and b.numel() == 1 for b in betas)))


def validate_matrix_param(p: Any, name: str) -> None:
    """A tensor of a FISMO group: real floating, at least 2 dimensions, not empty."""
    if not isinstance(p, torch.Tensor):
        raise TypeError(f"{name}: optimizer can only optimize Tensors, got {type(p).__name__}")
    _refuse_uninitialised(p, name)
    refuse_self_overlap(p, name)
    if p.ndim < 2:
        raise ValueError(
            f"{name} has shape {tuple(p.shape)}: FISMO optimises matrices (2-D weights, or conv weights "
            "flattened to (out, in*kh*kw)). Put 1-D tensors (biases, norm scales) in an AdamW group: "
            "{'params': [...], 'algorithm': 'adamw'}; for a whole model, the helper "
            "fismo_core.backends.torch.param_groups does the split: FISMO(param_groups(model), lr=0.02) "
            "(matrices on FISMO; biases, norms, embeddings and the output head on AdamW). With a Hugging Face "
            "Trainer, pass the optimizer built so: Trainer(..., optimizers=(FISMO(param_groups(model)), scheduler)), "
            "not optimizer_cls_and_kwargs (its groups split by weight decay only)"
        )
    if torch.is_complex(p):
        raise TypeError(f"{name} is complex ({p.dtype}); FISMO supports real matrices only (AdamW groups take complex)")
    if not p.is_floating_point():
        raise TypeError(f"{name} has dtype {p.dtype}; FISMO needs floating-point parameters")
    if p.numel() == 0:
        raise ValueError(
            f"{name} has shape {tuple(p.shape)}, with no entries: FISMO steps non-empty matrices only "
            "(leave it out, or put it in an AdamW group)"
        )


def self_overlaps(t: torch.Tensor) -> bool:
    """Whether elements of ``t`` share memory (a stride of 0 along an axis of more than one element)."""
    return any(stride == 0 and size > 1 for size, stride in zip(t.shape, t.stride()))


def refuse_self_overlap(p: torch.Tensor, name: str) -> None:
    """A tensor whose elements share memory (``expand``: a stride of 0) cannot be updated in place.

    torch raises at the in-place update, in the middle of a step, after the
    parameters before it have stepped; refused here, before anything changes.
    """
    if self_overlaps(p):
        raise ValueError(
            f"{name} has shape {tuple(p.shape)} and strides {tuple(p.stride())}: elements along a stride of 0 "
            "share one memory location (an expanded tensor), which an in-place update cannot write; "
            "optimise a tensor with memory of its own (p.clone())"
        )


def _refuse_uninitialised(p: torch.Tensor, name: str) -> None:
    """A lazy module's parameter (``nn.LazyLinear`` before its first forward pass) has no shape yet."""
    if torch.nn.parameter.is_lazy(p):
        raise ValueError(
            f"{name} is an uninitialised parameter of a lazy module (nn.LazyLinear, nn.LazyConv2d, ...): its "
            "shape decides how FISMO optimises it. Run one forward pass first, then build the optimizer"
        )


# ---------------------------------------------------------------- routing
def route_group(param_group: dict, defaults: dict, where: str) -> dict:
    """The group ``Optimizer.add_param_group`` should store: algorithm set, keys checked, AdamW defaults filled.

    ``defaults`` are the optimizer's (FISMO's) defaults; ``where`` names the
    group in error messages. Nothing is stored here: an error leaves the
    optimizer as it was.
    """
    if not isinstance(param_group, dict):
        raise TypeError(f"param_group must be a dict, got {type(param_group).__name__}")
    group = dict(param_group)
    params = group.get("params")
    if isinstance(params, torch.Tensor):
        params = [params]
    elif isinstance(params, set) or params is None:
        raise TypeError("optimizer params need to be organized in ordered collections (a list of tensors)")
    params = list(params)
    group["params"] = params
    algorithm = group.setdefault("algorithm", "fismo")
    if algorithm not in ALGORITHMS:
        raise ValueError(f"{where}: unknown algorithm {algorithm!r}; use 'fismo' (matrices) or 'adamw'")
    named = [(p if isinstance(p, tuple) else (None, p)) for p in params]
    seen: set[int] = set()
    for _, p in named:
        if id(p) in seen:  # torch.optim only warns; FISMO stepped it twice and counted one step
            raise ValueError(
                f"{where} lists a parameter of shape {tuple(p.shape)} twice; list each parameter once"
            )
        seen.add(id(p))
    labels = [f"parameter {name!r}" if name is not None else f"parameter {i} of {where}"
              for i, (name, _) in enumerate(named)]
    if algorithm == "adamw":
        wrong = [k for k in FISMO_ONLY_KEYS if k in group]
        if wrong:
            raise ValueError(
                f"{where} is an 'adamw' group but sets FISMO's {wrong}; AdamW takes {list(ADAMW_DEFAULTS)}"
            )
        unsupported = {k: group[k] for k in ("fused", "capturable", "differentiable") if group.get(k)}
        if unsupported:  # torch.optim.AdamW's keys that these groups would keep and not honour
            raise ValueError(
                f"{where} is an 'adamw' group with {unsupported}: AdamW groups step as torch.optim.AdamW with "
                "fused=False, capturable=False, differentiable=False (foreach is honoured); for a fused or "
                "capturable AdamW, give those parameters their own torch.optim.AdamW"
            )
        refuse_coupled_decay(group, where, "")
        for label, (_, p) in zip(labels, named):
            if isinstance(p, torch.Tensor) and not torch.nn.parameter.is_lazy(p):
                refuse_self_overlap(p, label)
        for key, value in ADAMW_DEFAULTS.items():
            group.setdefault(key, value)
        group.setdefault("nonfinite", defaults["nonfinite"])  # the optimizer's policy covers AdamW groups too
        validate_adamw_hparams(group, where)
    else:
        wrong = [k for k in ADAMW_ONLY_KEYS if k in group]
        if wrong:
            raise ValueError(
                f"{where} is a FISMO group but sets AdamW's {wrong}; "
                "mark the group with \"algorithm\": \"adamw\" if it is meant for AdamW"
            )
        foreign = {k: group[k] for k in (*MUON_POLAR_KEYWORDS, *MUON_KEYWORDS) if k in group and k not in defaults}
        if foreign:  # a group key FISMO would otherwise keep and ignore
            raise ValueError(str(foreign_keyword_error(f"{where} sets keys", foreign)))
        # torch.optim's implementation switches, kept and not honoured (until 2026-12-03). Refused when the group
        # is added only: dynamo sets capturable=True in every group of an optimizer it traces.
        unsupported = {k: group[k] for k in ("fused", "capturable", "differentiable") if group.get(k)}
        if unsupported:
            raise ValueError(
                f"{where} is a FISMO group with {unsupported}: FISMO has no fused, capturable or differentiable "
                "variant to switch to; leave these keys out (torch.compile compiles its step as it is)"
            )
        merged = {**defaults, **{k: v for k, v in group.items() if k in defaults}}
        validate_fismo_hparams(merged, where)
        group["block_size"] = merged["block_size"]
        for key in NESTED_OPTIONS:  # the group's own copy, not the defaults' dict (see own_nested_options)
            group[key] = copy.deepcopy(merged[key])
        for label, (_, p) in zip(labels, named):
            validate_matrix_param(p, label)
            if is_dtensor(p):
                validate_dtensor(p, label)
    return group


NESTED_OPTIONS = ("polar", "inv_root")
"""A FISMO group's options stored as dicts: the only mutable values of a group besides its ``params``."""


def own_nested_options(group: dict) -> dict:
    """Give ``group`` its own copies of its `NESTED_OPTIONS` dicts, and return it.

    ``torch.optim`` copies a group's values by reference (from the defaults when
    a group is added, into ``state_dict``, and a loaded checkpoint's groups from
    one deep copy of them all), harmless for its floats and tuples; a dict
    shared so would let an in-place edit of one group's ``polar`` change the
    defaults, the other groups and a saved ``state_dict`` too.
    """
    for key in NESTED_OPTIONS:
        if isinstance(group.get(key), dict):
            group[key] = copy.deepcopy(group[key])
    return group


def numpy_scalar_keys(group: dict) -> list[str]:
    """The keys of ``group`` whose value is a NumPy scalar or a tuple holding one (``betas``)."""
    numpy = sys.modules.get("numpy")
    if numpy is None:  # no NumPy scalar can exist
        return []
    return [key for key, value in group.items()
            if isinstance(value, numpy.generic)
            or (isinstance(value, tuple) and any(isinstance(v, numpy.generic) for v in value))]


def plain_numbers(group: dict) -> dict:
    """A saved group's NumPy scalars as Python numbers, also inside a tuple (``betas``) or a dict (``polar``,
    ``inv_root``), and the group.

    The step stores top-level ones so (`check_group_settings`, `core_key`); one written after the last step (a
    schedule computed with NumPy) would reach a ``state_dict`` that ``torch.load(weights_only=True)``
    refuses. Only for ``state_dict``'s copies of the groups (nested dicts copied first, `own_nested_options`):
    the live group is the step's to check."""
    numpy: Any = sys.modules.get("numpy")
    if numpy is None:  # no NumPy scalar can exist
        return group

    def plain(value: Any) -> Any:
        if isinstance(value, numpy.generic):
            return value.item()
        if isinstance(value, tuple):
            return tuple(plain(v) for v in value)
        if isinstance(value, dict):
            return {k: plain(v) for k, v in value.items()}
        return value

    for key, value in group.items():
        if key != "params":
            group[key] = plain(value)
    return group


def drop_fismo_keys(group: dict) -> None:
    """``Optimizer.add_param_group`` fills in FISMO's defaults; an AdamW group has none of them."""
    for key in FISMO_ONLY_KEYS:
        group.pop(key, None)


# ---------------------------------------------------------------- the AdamW route
#: Where every parameter's step count lives, FISMO's and its AdamW groups' (as ``torch.optim.AdamW``'s with
#: ``capturable=False``), whatever the parameter's device: reading it never waits for a GPU.
STEP_COUNT_DEVICE = torch.device("cpu")


def init_adamw_state(s: dict, p: torch.Tensor, group: dict) -> None:
    """Fill the empty state ``s`` of parameter ``p`` of an ``"adamw"`` group as ``torch.optim.AdamW``
    (``capturable=False``, ``fused=False``) does."""
    s["step"] = torch.zeros((), dtype=scalar_dtype(), device=STEP_COUNT_DEVICE)
    s["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    s["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    if group["amsgrad"]:
        s["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


def adamw_group_step(state: dict, group: dict, skip: Union[set, frozenset] = frozenset()) -> None:
    """One ``torch.optim.AdamW`` step (``capturable=False``, ``fused=False``) of an ``"adamw"`` group.

    ``state`` is the optimizer's per-parameter state; keys and arithmetic are ``torch.optim.AdamW``'s.
    Parameters whose id is in ``skip`` (``nonfinite="skip"``) do not step: parameter and state unchanged.
    """
    params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps = [], [], [], [], [], []
    has_complex = False
    for p in group["params"]:
        if p.grad is None or id(p) in skip:
            continue
        has_complex |= torch.is_complex(p)
        s = state[p]
        if not s:
            init_adamw_state(s, p, group)
        elif s["exp_avg"].dtype != p.dtype:
            # The parameter changed dtype since (model.double()): converted as load_state_dict converts a
            # checkpoint's (torch.optim.AdamW raises in its step instead, after FISMO's groups have stepped).
            for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
                if key in s:
                    s[key] = s[key].to(p.dtype)
        params.append(p)
        grads.append(p.grad)
        exp_avgs.append(s["exp_avg"])
        exp_avg_sqs.append(s["exp_avg_sq"])
        if group["amsgrad"]:
            max_exp_avg_sqs.append(s["max_exp_avg_sq"])
        steps.append(s["step"])
    if not params:
        return
    beta1, beta2 = group["betas"]
    _adamw(
        params,
        grads,
        exp_avgs,
        exp_avg_sqs,
        max_exp_avg_sqs,
        steps,
        foreach=group["foreach"],
        has_complex=has_complex,
        amsgrad=group["amsgrad"],
        beta1=beta1,
        beta2=beta2,
        lr=group["lr"],
        weight_decay=group["weight_decay"],
        eps=group["eps"],
        maximize=group["maximize"],
    )


# ---------------------------------------------------------------- the helper
HeadSpec = Union[str, torch.nn.Module, torch.nn.Parameter, None]


def _a_vector(p: torch.Tensor) -> bool:
    """Fewer than two dimensions, or a matrix form (`matrix_shape`) with a side of 1: a row or a column."""
    return p.ndim < 2 or 1 in matrix_shape(p.shape)


def _weight_parameters(m: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters behind ``m.weight``, read without computing it.

    Under ``torch.nn.utils.parametrize`` reading ``m.weight`` runs the
    parametrisation (spectral norm's power iteration updates its buffers): the
    originals are read instead, those of the weight's own shape (weight norm's
    direction ``original1``, not its ``(out, 1)`` magnitude).
    """
    if torch.nn.utils.parametrize.is_parametrized(m, "weight"):
        parametrizations: Any = m.parametrizations  # a ModuleDict, typed as a tensor or a module by torch
        originals = dict(parametrizations.weight.named_parameters())
        if "original" in originals:
            return [originals["original"]]
        return [p for p in originals.values() if not _a_vector(p)]
    weight = m._parameters.get("weight")
    if weight is None and any(isinstance(hook, _WeightNorm) and hook.name == "weight"
                              for hook in m._forward_pre_hooks.values()):
        # The deprecated torch.nn.utils.weight_norm: the direction weight_v has the weight's shape (a conv
        # kernel's went to AdamW as "no conv weight" until 2026-12-04; a user's hunt), weight_g is the magnitude.
        direction = m._parameters.get("weight_v")
        return [direction] if direction is not None else []
    return [weight] if weight is not None else []


def _unwrapped(module: torch.nn.Module) -> torch.nn.Module:
    """The model inside ``torch.compile``'s, DDP's and ``DataParallel``'s wrappers (any, nested in any order)."""
    while True:
        if isinstance(module, _OptimizedModule):
            module = module._orig_mod
        elif isinstance(module, (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)):
            module = module.module
        else:
            return module


def _head_parameters(module: torch.nn.Module, head: HeadSpec) -> tuple[set[int], Optional[str]]:
    """The ids of the output head's parameters under ``param_groups``' ``head`` rule, and the head's name."""
    if head is None:
        return set(), None
    if isinstance(head, str) and head == "auto":
        # A Hugging Face model names its head; the last nn.Linear is not always it (VisionEncoderDecoderModel
        # defines enc_to_dec_proj after the decoder and its lm_head).
        named_head = getattr(_unwrapped(module), "get_output_embeddings", None)  # DDP's wrapper has none
        found = named_head() if callable(named_head) else None
        if isinstance(found, torch.nn.Linear):
            name = next((n for n, m in module.named_modules() if m is found), None)
            if name is not None:
                return {id(p) for p in found.parameters()}, repr(name) if name else "the module itself"
        last = None
        for name, m in module.named_modules():
            if isinstance(m, torch.nn.Linear):
                last = (name, m)
        if last is None:
            return set(), None
        return {id(p) for p in last[1].parameters()}, repr(last[0]) if last[0] else "the module itself"
    if isinstance(head, str):
        # A torch.compile'd model names everything "_orig_mod." first, a DDP one "module.": a name is the
        # model's own (the wrapper's, as named_parameters() gives it, is taken too).
        inner = _unwrapped(module)
        # Every name of a shared parameter: a head tied to the embedding is named after the embedding alone by
        # named_parameters(), and head="lm_head.weight" was refused on GPT-2 (a user's hunt, 2026-12-04).
        named = {**dict(module.named_parameters(remove_duplicate=False)),
                 **dict(inner.named_parameters(remove_duplicate=False))}
        if head in named:
            return {id(named[head])}, repr(head)
        for owner in (inner, module):
            try:
                return {id(p) for p in owner.get_submodule(head).parameters()}, repr(head)
            except AttributeError:
                pass
        linears = [n for n, m in inner.named_modules() if isinstance(m, torch.nn.Linear)]
        raise ValueError(
            f"head={head!r} is neither a submodule nor a parameter of the module; its nn.Linear "
            f"submodules are {linears}. Pass a name, the head module or parameter itself, "
            "'auto' (the last nn.Linear) or None (no head rule)"
        )
    if isinstance(head, torch.nn.Parameter):
        if not any(p is head for p in module.parameters()):
            raise ValueError(f"head is a parameter of shape {tuple(head.shape)} that is not in the module")
        return {id(head)}, "the given parameter"
    if isinstance(head, torch.nn.Module):
        if not any(m is head for m in module.modules()):
            raise ValueError(f"head is a {type(head).__name__} that is not a submodule of the module")
        return {id(p) for p in head.parameters()}, type(head).__name__
    raise TypeError(
        f"head must be 'auto', None, a submodule or parameter name, an nn.Module or an nn.Parameter, "
        f"got {type(head).__name__}"
    )


def param_groups(
    module: torch.nn.Module,
    *,
    head: HeadSpec = "auto",
    adamw: Optional[Callable[[str, torch.nn.Parameter], bool]] = None,
    adamw_options: Optional[dict] = None,
) -> list[dict]:
    """Split a module's trainable parameters the way Muon users do.

    Tensors with fewer than 2 dimensions, tensors that are no linear or conv
    layer's weight and whose matrix form has a side of 1 (learned tokens and
    position tables: ViT's ``cls_token`` ``(1, 1, d)`` and ``pos_embed``
    ``(1, T, d)``, which FISMO would optimise as one row with a ``T d x T d``
    factor; weight norm's ``(out, 1)`` magnitude), tensors of more than two
    dimensions that are no conv weight (a mixture of experts' stacked
    ``(experts, out, in)``, with a ``UserWarning``),
    ``nn.Embedding`` weights, complex tensors (FISMO is for real matrices),
    empty tensors (a layer of width 0), the output head and every
    parameter for which ``adamw(name, p)`` is true (``name`` as the model names
    it, also through DDP's and ``torch.compile``'s wrappers) go to an ``"adamw"`` group
    with ``adamw_options``; the other matrices (linear and conv weights) go to
    a FISMO group. Empty groups are left out.

    ``head`` picks the output head:

    - ``"auto"`` (default): a Hugging Face model's own head,
      ``module.get_output_embeddings()``, when that is an ``nn.Linear`` of the
      model; else the **last** ``nn.Linear`` in ``module.modules()``
      order, which is the order of definition: ``lm_head`` in GPT-2 and LLaMA
      models, ``fc`` in ResNets, the last layer of an ``nn.Sequential``. A
      model that defines its head before other linear layers needs an
      explicit ``head``. A model without ``nn.Linear`` has no head here.
    - a name: a submodule (``"lm_head"``) or a parameter (``"lm_head.weight"``),
      as the model names it (also when ``module`` is ``torch.compile(model)``
      or wrapped by DDP, whose prefixed names work too); an ``nn.Module`` or
      ``nn.Parameter`` of the model works too.
    - ``None``: no head rule; every matrix but embeddings goes to FISMO.

    A ``UserWarning`` says so when the head rule leaves no matrix for FISMO
    (a model that is one linear layer, say): pass ``head=None`` then.
    A lazy module's uninitialised weight (``nn.LazyLinear`` before its first
    forward pass) raises a ``ValueError``: its shape decides its group.
    """
    if not isinstance(module, torch.nn.Module):
        raise TypeError(
            f"param_groups takes the model (a torch.nn.Module), got {type(module).__name__}; for tensors "
            "of your own, give FISMO the groups: [{'params': matrices}, {'params': others, 'algorithm': 'adamw'}]"
        )
    embedding_weights = {
        id(w) for m in module.modules() if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag))
        for w in _weight_parameters(m)
    }
    layers = [m for m in module.modules() if isinstance(m, (torch.nn.Linear, torch.nn.modules.conv._ConvNd))]
    layer_weights = {id(w) for m in layers for w in _weight_parameters(m)}
    conv_weights = {id(w) for m in layers if isinstance(m, torch.nn.modules.conv._ConvNd) for w in _weight_parameters(m)}
    head_ids, head_name = _head_parameters(module, head)
    matrices: list[torch.nn.Parameter] = []
    others: list[torch.nn.Parameter] = []
    stacks: list[str] = []
    head_matrices = 0
    # The names the model gives (not DDP's "module." or torch.compile's "_orig_mod."), for adamw(name, p).
    for name, p in _unwrapped(module).named_parameters():
        if not p.requires_grad:
            continue
        _refuse_uninitialised(p, f"param_groups: {name!r}")
        # A side of 1 outside a layer's weight: a learned token or table (ViT's cls_token (1, 1, d) and
        # pos_embed (1, T, d), MultiheadAttention's bias_k), one row to FISMO with a (T d) x (T d) factor
        # Q; or a column (weight norm's magnitude (out, 1), a rank-1 adapter). A linear or conv layer with
        # one output keeps its weight on FISMO.
        vector = p.ndim >= 2 and _a_vector(p) and id(p) not in layer_weights
        # More than two dimensions outside a conv layer: a stack of matrices (a mixture of experts'
        # (experts, out, in)), which FISMO would optimise as one (experts, out * in) matrix.
        stack = p.ndim > 2 and not vector and id(p) not in conv_weights
        stacks += [f"{name} {tuple(p.shape)}"] if stack else []
        # An empty tensor (a layer of width 0, as a pruned or configurable model may have): no matrix to step.
        other_rule = (p.ndim < 2 or p.numel() == 0 or vector or stack or id(p) in embedding_weights
                      or torch.is_complex(p)
                      or (adamw is not None and adamw(name, p)))
        to_adamw = other_rule or id(p) in head_ids
        head_matrices += not other_rule and id(p) in head_ids  # on AdamW only because it is the head
        (others if to_adamw else matrices).append(p)
    if stacks:
        warnings.warn(
            f"param_groups: {', '.join(stacks)} went to AdamW: tensors of more than two dimensions that are no "
            "conv weight (a mixture of experts' stacked weights) would be one flattened matrix to FISMO, not a "
            "batch of matrices (torch.optim.Muon refuses them)",
            UserWarning,
            stacklevel=2,
        )
    if not matrices and head_matrices:
        warnings.warn(
            f"param_groups: the output head ({head_name}) was the only matrix for FISMO and went to AdamW, "
            "so FISMO optimises nothing; pass head=None to optimise it with FISMO",
            UserWarning,
            stacklevel=2,
        )
    groups: list[dict] = []
    if matrices:
        groups.append({"params": matrices})
    if others:
        groups.append({"params": others, "algorithm": "adamw", **(adamw_options or {})})
    return groups
