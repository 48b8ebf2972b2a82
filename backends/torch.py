"""FISMO as a ``torch.optim.Optimizer``: param groups, state_dict, schedulers, distributed.

This module is an adapter. Algorithm 1 (lines 4–8: preconditioners, whitening,
momentum, polar factor, un-whitening) is computed by the array-API core,
[`FISMO.direction`][fismo_core.FISMO.direction], on torch tensors; this class only

- keeps the core's state (``P``, ``Q``, ``M``, ``P_inv_sqrt``, ``Q_inv_sqrt``)
  as tensors in ``self.state[p]`` and copies the core's results into them in
  place,
- stacks same-shape matrices into one batched core call,
- applies line 9 (``W <- (1 - lr * weight_decay) W - lr' * dW``) in place,
  with the learning rate read from the param group at every step,
- runs AdamW, through ``torch.optim.adamw.adamw``, on groups marked
  ``"algorithm": "adamw"`` (biases, norms, embeddings, output heads),
- partitions the matrix work across ranks under DDP and FSDP2.

See ``docs/torch.md``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any, Optional, Union

import torch
from torch.optim.adamw import adamw as _adamw
from torch.optim.optimizer import Optimizer

from fismo_core.optimizer import FISMO as _CoreFISMO
from fismo_core.optimizer import state_dtype
from fismo_core.optimizer import FISMOState, InverseRootConfig, InverseRootError, PolarConfig

__all__ = ["FISMO", "param_groups"]

_CORE_DEFAULTS = _CoreFISMO()
_POLAR_FIELDS = {f.name for f in dataclasses.fields(PolarConfig)}
_INV_ROOT_FIELDS = {f.name for f in dataclasses.fields(InverseRootConfig)}

#: The tensors FISMO keeps per matrix parameter, in ``FISMOState`` order.
STATE_KEYS = ("P", "Q", "M", "P_inv_sqrt", "Q_inv_sqrt")
#: The per-parameter int32 counters (``FISMOState.skipped``, ``.root_failures``), 0-d tensors.
COUNTER_KEYS = ("skipped", "root_failures")

_ALGORITHMS = ("fismo", "adamw")
_ADJUST_LR_FNS = (None, "original", "match_rms_adamw")

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
_FISMO_ONLY_KEYS = ("beta", "gamma", "mu", "polar", "inv_root", "nesterov", "adjust_lr_fn", "statistics", "nonfinite")
_ADAMW_ONLY_KEYS = ("betas", "eps", "amsgrad", "maximize", "foreach")


def _dtensor_type() -> Optional[type]:
    if not torch.distributed.is_available():
        return None
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without DTensor
        return None
    return DTensor


_DTensor = _dtensor_type()


def _is_dtensor(t: Any) -> bool:
    return _DTensor is not None and isinstance(t, _DTensor)


def _state_dtype(dtype: torch.dtype) -> torch.dtype:
    """The core's precision policy (``fismo_core.state_dtype``) for a torch dtype."""
    return state_dtype(torch, dtype)


def _matrix_shape(shape: torch.Size) -> tuple[int, int]:
    """A weight of shape ``(out, *rest)`` is optimised as the matrix ``(out, prod(rest))``."""
    return int(shape[0]), int(math.prod(shape[1:]))


def _adjusted_lr(lr: float, adjust_lr_fn: Optional[str], m: int, n: int) -> float:
    """``torch.optim.Muon``'s shape-dependent learning rate, on the (flattened) matrix shape ``(m, n)``."""
    if adjust_lr_fn is None:
        return lr
    if adjust_lr_fn == "original":
        return lr * math.sqrt(max(1, m / n))
    return lr * 0.2 * math.sqrt(max(m, n))  # "match_rms_adamw"


def _scalar(x: Union[float, torch.Tensor]) -> float:
    return x.item() if isinstance(x, torch.Tensor) else x


def _core_key(group: dict) -> tuple:
    polar, inv_root = group["polar"], group["inv_root"]
    if not (isinstance(polar, dict) and set(polar) == _POLAR_FIELDS and isinstance(inv_root, dict) and set(inv_root) == _INV_ROOT_FIELDS):
        # A config object, a method name or a partial dict set after construction: completed here,
        # so that a state_dict records every field (a checkpoint then resumes with the same schedule).
        _validate_fismo_hparams(group, "a param group")
    return (
        group["beta"],
        group["gamma"],
        group["mu"],
        tuple(sorted(group["polar"].items())),
        tuple(sorted(group["inv_root"].items())),
        group["nesterov"],
        group.get("statistics", _CORE_DEFAULTS.statistics),  # absent from checkpoints saved before it existed
        group.get("nonfinite", "raise"),  # likewise
    )


def _make_core(key: tuple) -> _CoreFISMO:
    """The core optimizer for one set of hyperparameters.

    Only `direction` is called, which does not use the
    learning rate or the weight decay (line 9 is applied by the adapter with
    the group's current lr, which schedulers may set to 0, a value the core's
    constructor rejects); they stay at the core's defaults.

    Non-finite gradients are handled by the adapter before the core is
    called (so that errors name the parameter), so the core runs with
    ``nonfinite="propagate"``; its inverse-root checks follow the group's
    ``nonfinite`` policy, as they would in the core, unless ``inv_root``
    sets ``fallback``.
    """
    beta, gamma, mu, polar, inv_root, nesterov, statistics, nonfinite = key
    inv_root = dict(inv_root)
    if inv_root.get("fallback") is None:
        inv_root["fallback"] = nonfinite != "propagate"
    return _CoreFISMO(
        beta=beta,
        gamma=gamma,
        mu=mu,
        polar=dict(polar),
        inv_root=inv_root,
        nesterov=nesterov,
        statistics=statistics,
        nonfinite="propagate",
    )


class FISMO(Optimizer):
    r"""FISMO (Algorithm 1 of the FISMO paper) for matrix parameters, AdamW for the rest.

    Parameters
    ----------
    params:
        Parameters or param groups, as for every ``torch.optim`` optimizer.
        A group with ``"algorithm": "adamw"`` is optimised by AdamW
        (``torch.optim.adamw.adamw``, bit for bit ``torch.optim.AdamW``) and
        takes AdamW's keys ``lr``, ``betas``, ``eps``, ``weight_decay``,
        ``amsgrad``, ``maximize``, ``foreach``; missing keys get
        ``torch.optim.AdamW``'s defaults (`ADAMW_DEFAULTS`), not this
        optimizer's. Every other group (``"algorithm": "fismo"``, the default)
        must hold tensors with at least 2 dimensions: 2-D weights are the
        matrices of Algorithm 1; a weight ``(out, *rest)`` of 3 or more
        dimensions (convolutions) is optimised as the matrix
        ``(out, prod(rest))``. 1-D tensors (biases, norm scales) raise a
        ``ValueError``: put them in an ``"adamw"`` group.
    lr, beta, gamma, mu, polar, inv_root, weight_decay, nesterov, statistics:
        As in [`fismo_core.FISMO`][fismo_core.FISMO], with the same defaults. ``lr`` may be
        0 (schedulers reach it); ``weight_decay`` is decoupled,
        ``W <- (1 - lr * weight_decay) W`` with the group's unadjusted lr,
        as ``torch.optim.Muon`` does.
    adjust_lr_fn:
        ``None`` (default), ``"original"`` (``lr * sqrt(max(1, m/n))``) or
        ``"match_rms_adamw"`` (``lr * 0.2 * sqrt(max(m, n))``), as in
        ``torch.optim.Muon``; ``(m, n)`` is the (flattened) matrix shape.
        Scales the step ``- lr * dW`` only, not the weight decay (as Muon).
    nonfinite:
        What a NaN or infinity in the gradient of a FISMO parameter does
        (checked for every FISMO parameter before anything changes; one
        host read per step). ``"raise"`` (default): a ``ValueError`` naming
        the parameter; no parameter, state or step count changes.
        ``"skip"``: that parameter is left alone for this step (parameter,
        ``P``, ``Q``, ``M``, roots and ``step`` unchanged, no weight decay)
        and its ``state["skipped"]`` counts up; the others step.
        ``"propagate"``: no check, as ``torch.optim`` optimizers. AdamW
        groups are never checked (as ``torch.optim.AdamW``).
    process_group:
        For data parallelism with replicated parameters (DDP): the group
        across which the matrix work is partitioned. Each matrix has one
        owner rank, which keeps its state and computes its direction; the
        updated parameter is then broadcast from the owner. Leave ``None``
        without DDP. FSDP2 parameters (``DTensor`` sharded on dim 0 of a 1-D
        mesh) are recognised by themselves and need no process group.
    """

    def __init__(
        self,
        params: Any,
        *,
        lr: Union[float, torch.Tensor] = _CORE_DEFAULTS.lr,
        beta: float = _CORE_DEFAULTS.beta,
        gamma: float = _CORE_DEFAULTS.gamma,
        mu: float = _CORE_DEFAULTS.mu,
        polar: Union[PolarConfig, str, dict, None] = None,
        inv_root: Union[InverseRootConfig, str, dict, None] = None,
        weight_decay: float = _CORE_DEFAULTS.weight_decay,
        nesterov: bool = _CORE_DEFAULTS.nesterov,
        adjust_lr_fn: Optional[str] = None,
        process_group: Any = None,
        statistics: str = _CORE_DEFAULTS.statistics,
        nonfinite: str = "raise",
    ) -> None:
        if process_group is not None and not (torch.distributed.is_available() and torch.distributed.is_initialized()):
            raise RuntimeError("process_group was given but torch.distributed is not initialised")
        self.process_group = process_group
        defaults = {
            "algorithm": "fismo",
            "lr": lr,
            "beta": beta,
            "gamma": gamma,
            "mu": mu,
            "polar": _CORE_DEFAULTS.polar if polar is None else polar,
            "inv_root": _CORE_DEFAULTS.inv_root if inv_root is None else inv_root,
            "weight_decay": weight_decay,
            "nesterov": nesterov,
            "adjust_lr_fn": adjust_lr_fn,
            "statistics": statistics,
            "nonfinite": nonfinite,
        }
        _validate_fismo_hparams(defaults, "the optimizer's defaults")
        super().__init__(params, defaults)

    # ------------------------------------------------------------ param groups
    def add_param_group(self, param_group: dict) -> None:
        """Add a param group; an ``"adamw"`` group is filled with AdamW's defaults, not FISMO's."""
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
        where = f"param group {len(self.param_groups)}"
        algorithm = group.setdefault("algorithm", "fismo")
        if algorithm not in _ALGORITHMS:
            raise ValueError(f"{where}: unknown algorithm {algorithm!r}; use 'fismo' (matrices) or 'adamw'")
        named = [(p if isinstance(p, tuple) else (None, p)) for p in params]
        if algorithm == "adamw":
            wrong = [k for k in _FISMO_ONLY_KEYS if k in group]
            if wrong:
                raise ValueError(
                    f"{where} is an 'adamw' group but sets FISMO's {wrong}; AdamW takes {list(ADAMW_DEFAULTS)}"
                )
            for key, value in ADAMW_DEFAULTS.items():
                group.setdefault(key, value)
            _validate_adamw_hparams(group, where)
        else:
            wrong = [k for k in _ADAMW_ONLY_KEYS if k in group]
            if wrong:
                raise ValueError(
                    f"{where} is a FISMO group but sets AdamW's {wrong}; "
                    "mark the group with \"algorithm\": \"adamw\" if it is meant for AdamW"
                )
            merged = {**self.defaults, **{k: v for k, v in group.items() if k in self.defaults}}
            _validate_fismo_hparams(merged, where)
            for key in ("polar", "inv_root"):
                if key in group:
                    group[key] = merged[key]
            for i, (name, p) in enumerate(named):
                label = f"parameter {name!r}" if name is not None else f"parameter {i} of {where}"
                _validate_matrix_param(p, label)
                if _is_dtensor(p):
                    _validate_dtensor(p, label)
        super().add_param_group(group)
        if algorithm == "adamw":
            # Optimizer.add_param_group filled in FISMO's defaults; an AdamW group has none of them.
            added = self.param_groups[-1]
            for key in _FISMO_ONLY_KEYS:
                added.pop(key, None)

    # --------------------------------------------------------------- protocol
    def load_state_dict(self, state_dict: dict) -> None:
        """As ``Optimizer.load_state_dict``, but FISMO's statistics keep their own precision.

        The base class casts every floating state tensor to its parameter's
        dtype; for bf16/fp16 matrices that would round ``P``, ``Q``, ``M`` and
        the roots to 8 or 11 bits. They are restored in float32 (float64 for
        float64 parameters) from the saved tensors instead, and the int32
        counters ``skipped`` and ``root_failures`` as int32 (0 when a
        checkpoint predates them).

        Before anything is loaded, the state of every FISMO parameter is
        checked against the parameter: a missing key (``KeyError``), a shape
        that does not fit the parameter's matrix ``(m, n)`` (``ValueError``)
        or a non-floating ``P``, ``Q``, ``M`` or root (``TypeError``) raises
        and leaves the optimizer as it was. (Floating dtypes are converted,
        as ``torch.optim`` does.) The FISMO state is copied, never shared
        with ``state_dict``'s tensors.
        """
        saved_state = state_dict["state"]
        saved_groups = state_dict["param_groups"]
        self._check_saved_state(saved_state, saved_groups)
        super().load_state_dict(state_dict)
        for saved_group, group in zip(saved_groups, self.param_groups):
            if group.get("algorithm", "fismo") != "fismo":
                continue
            if isinstance(group["inv_root"], dict) and "coefficients" not in group["inv_root"]:
                # Saved before InverseRootConfig had coefficients: its Newton–Schulz roots were cubic.
                group["inv_root"] = {**group["inv_root"], "coefficients": "cubic"}
            for index, p in zip(saved_group["params"], group["params"]):
                saved = saved_state.get(index)
                if not saved or p not in self.state:
                    continue
                state = self.state[p]
                dtype = _state_dtype(p.dtype)
                device = p.to_local().device if _is_dtensor(p) else p.device
                # Copies (copy=True): FISMO updates its state in place, so a state_dict taken from
                # another live optimizer must not share tensors with it.
                for key in STATE_KEYS:
                    if key in saved:
                        state[key] = saved[key].to(device=device, dtype=dtype, copy=True)
                for key in COUNTER_KEYS:
                    if key in saved:
                        state[key] = saved[key].to(device=device, dtype=torch.int32, copy=True)
                    else:
                        state[key] = torch.zeros((), dtype=torch.int32, device=device)
                if isinstance(state.get("step"), torch.Tensor) and state["step"] is saved.get("step"):
                    state["step"] = state["step"].clone()

    def _check_saved_state(self, saved_state: dict, saved_groups: list) -> None:
        """`load_state_dict`'s checks of the FISMO states against the parameters, before anything changes."""
        if len(saved_groups) != len(self.param_groups) or any(
            len(a["params"]) != len(b["params"]) for a, b in zip(saved_groups, self.param_groups)
        ):
            return  # Optimizer.load_state_dict raises its own error for these
        for gi, (saved_group, group) in enumerate(zip(saved_groups, self.param_groups)):
            if group.get("algorithm", "fismo") != "fismo":
                continue
            if saved_group.get("algorithm", "fismo") != "fismo":
                raise ValueError(
                    f"param group {gi} is a FISMO group, but the checkpoint's group {gi} is an "
                    f"{saved_group['algorithm']!r} group (were the groups saved in another order?)"
                )
            for i, (index, p) in enumerate(zip(saved_group["params"], group["params"])):
                saved = saved_state.get(index)
                if not saved:
                    continue
                name = _param_name(group, i, gi)
                missing = [key for key in ("step", *STATE_KEYS) if key not in saved]
                if missing:
                    raise KeyError(
                        f"the checkpoint's state for {name} lacks {missing} (it has {sorted(saved)}): "
                        "not a FISMO state, or saved for another parameter order"
                    )
                m, n = _matrix_shape(p.shape)
                expected = {"P": (m, m), "Q": (n, n), "M": (m, n), "P_inv_sqrt": (m, m), "Q_inv_sqrt": (n, n)}
                for key, shape in expected.items():
                    value = saved[key]
                    if not isinstance(value, torch.Tensor) or tuple(value.shape) != shape:
                        got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
                        raise ValueError(
                            f"{name} has shape {tuple(p.shape)} (optimised as the matrix {m}x{n}), so its state "
                            f"{key!r} must have shape {shape}; the checkpoint has {got} (was it saved for another "
                            "model, or with the parameters in another order?)"
                        )
                    if not value.is_floating_point():
                        raise TypeError(f"the checkpoint's state {key!r} of {name} has dtype {value.dtype}, not a float")
                for key in COUNTER_KEYS:
                    value = saved.get(key)
                    if value is not None and (
                        not isinstance(value, torch.Tensor) or value.numel() != 1 or value.is_floating_point()
                    ):
                        raise ValueError(f"the checkpoint's counter {key!r} of {name} must be one integer, got {value!r}")

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        """One optimisation step; with ``closure``, re-evaluates the model first and returns its loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        skip = self._check_grads()
        owners = self._owners()
        for group in self.param_groups:
            if group["algorithm"] == "adamw":
                self._adamw_group_step(group)
            else:
                self._fismo_group_step(group, owners, skip)
        return loss

    # ------------------------------------------------------------------ checks
    def _check_grads(self) -> set:
        """Every gradient is checked before any parameter or state changes.

        Returns the ids of the FISMO parameters to skip this step (``nonfinite="skip"``).
        """
        for gi, group in enumerate(self.param_groups):
            for i, p in enumerate(group["params"]):
                g = p.grad
                if g is None:
                    continue
                name = _param_name(group, i, gi)
                if g.is_sparse or g.layout != torch.strided:
                    raise RuntimeError(
                        f"{name} has a sparse gradient ({g.layout}); FISMO and its AdamW groups need dense "
                        "gradients (use torch.optim.SparseAdam, or nn.Embedding(sparse=False))"
                    )
                if group["algorithm"] == "fismo":
                    if torch.is_complex(g):
                        raise TypeError(f"{name} has a complex gradient ({g.dtype}); FISMO supports real matrices only")
                    if not g.is_floating_point():
                        raise TypeError(f"{name} has a non-floating gradient ({g.dtype})")
                    if tuple(g.shape) != tuple(p.shape):
                        raise ValueError(f"{name} has shape {tuple(p.shape)} but its gradient {tuple(g.shape)}")
        return self._check_finite_grads()

    def _check_finite_grads(self) -> set:
        """NaN and infinity in FISMO gradients, per the groups' ``nonfinite`` policy: raise, or the set to skip.

        One host read per step (the flags of all parameters stacked); a
        sharded (FSDP2) gradient's flag is reduced over its mesh first, so
        every rank takes the same decision.
        """
        checks = []  # (group index, param index, p, flag)
        for gi, group in enumerate(self.param_groups):
            if group["algorithm"] != "fismo" or group.get("nonfinite", "raise") == "propagate":
                continue
            for i, p in enumerate(group["params"]):
                if p.grad is None:
                    continue
                local = p.grad.to_local() if _is_dtensor(p.grad) else p.grad
                flag = torch.isfinite(local).all().to(torch.int32)
                if _is_dtensor(p):
                    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN, group=p.device_mesh.get_group())
                checks.append((gi, i, p, flag))
        if not checks:
            return set()
        by_device: dict[torch.device, list[int]] = {}
        for k, (*_, flag) in enumerate(checks):
            by_device.setdefault(flag.device, []).append(k)
        finite = [True] * len(checks)
        for ks in by_device.values():
            for k, ok in zip(ks, torch.stack([checks[k][3] for k in ks]).tolist()):
                finite[k] = bool(ok)
        skip = set()
        for (gi, i, p, _), ok in zip(checks, finite):
            if ok:
                continue
            group = self.param_groups[gi]
            if group.get("nonfinite", "raise") == "skip":
                skip.add(id(p))
                continue
            g = p.grad.to_local() if _is_dtensor(p.grad) else p.grad
            nan, inf = int(torch.isnan(g).sum()), int(torch.isinf(g).sum())
            names = group.get("param_names")
            if names and i < len(names):
                label = f"parameter {names[i]!r} (index {i} in param group {gi}, shape {tuple(p.shape)})"
            else:
                label = f"parameter {i} of param group {gi} (shape {tuple(p.shape)})"
            raise ValueError(
                f"the gradient of {label} contains {nan} NaN and {inf} infinite values (of {g.numel()} entries"
                f"{' on this rank' if _is_dtensor(p) else ''}); FISMO took no step: every parameter, every FISMO "
                "state (P, Q, M, roots) and every step count is as it was. Check the loss and the gradient "
                "computation, or pass nonfinite='skip' to skip such parameters"
            )
        return skip

    # -------------------------------------------------------------- partition
    def _comm(self, p: torch.Tensor) -> tuple[str, Any]:
        """``("local", None)``, ``("replicated", process_group)`` or ``("sharded", mesh_group)``."""
        if _is_dtensor(p):
            return "sharded", p.device_mesh.get_group()
        if self.process_group is not None:
            return "replicated", self.process_group
        return "local", None

    def _owners(self) -> dict[torch.Tensor, int]:
        """Owner rank (within its process group) of every distributed FISMO matrix.

        Greedy least-loaded assignment in parameter order, with the cost of a
        direction ``m^3 + n^3 + m n min(m, n)`` (two inverse roots, polar
        factor). It depends only on the param groups, so every rank computes
        the same table, and it is stable across steps (a matrix's state lives
        on its owner).
        """
        owners: dict[torch.Tensor, int] = {}
        loads: dict[Any, list[float]] = {}
        for group in self.param_groups:
            if group["algorithm"] != "fismo":
                continue
            for p in group["params"]:
                kind, pg = self._comm(p)
                if kind == "local":
                    continue
                if pg not in loads:
                    loads[pg] = [0.0] * torch.distributed.get_world_size(pg)
                load = loads[pg]
                m, n = _matrix_shape(p.shape)
                owner = min(range(len(load)), key=load.__getitem__)
                load[owner] += float(m) ** 3 + float(n) ** 3 + float(m) * n * min(m, n)
                owners[p] = owner
        return owners

    # ------------------------------------------------------------------ FISMO
    def _core_for(self, group: dict) -> _CoreFISMO:
        """Core instances cached per hyperparameter set (a plain dict, which torch.compile traces)."""
        cores = self.__dict__.setdefault("_cores", {})
        key = _core_key(group)
        if key not in cores:
            cores[key] = _make_core(key)
        return cores[key]

    def _fismo_group_step(self, group: dict, owners: dict[torch.Tensor, int], skip: set = frozenset()) -> None:
        core = self._core_for(group)
        lr = _scalar(group["lr"])
        weight_decay = group["weight_decay"]
        dist = torch.distributed

        items = []  # (p, kind, pg, owner, me)
        for p in group["params"]:
            if p.grad is None:
                continue
            kind, pg = self._comm(p)
            owner, me = (0, 0) if kind == "local" else (owners[p], dist.get_rank(pg))
            if id(p) in skip:  # nonfinite="skip": p does not step; the rank keeping its state counts it
                if me == owner:
                    dev = p.to_local().device if _is_dtensor(p) else p.device
                    self._matrix_state(core, p, torch.empty(_matrix_shape(p.shape), device=dev))["skipped"] += 1
                continue
            items.append((p, kind, pg, owner, me))

        # 1. Full gradients of sharded matrices are gathered to their owners.
        full_grads: dict[torch.Tensor, torch.Tensor] = {}
        pending = []
        for p, kind, pg, owner, me in items:
            if kind == "sharded":
                pending.append((p, _gather_rows(p.grad.to_local(), p.shape, pg, owner, me)))
        for p, (work, finish) in pending:
            work.wait()
            full = finish()
            if full is not None:
                full_grads[p] = full

        # 2. The owner of each matrix (every rank for local ones) computes its direction,
        #    same-shape matrices in one batched core call.
        mine = []
        for p, kind, _pg, owner, me in items:
            if kind == "local" or me == owner:
                mine.append((p, full_grads.get(p, p.grad)))
        directions = self._directions(core, mine)

        # 3. Line 9: W <- (1 - lr * weight_decay) W - lr' * dW, then replicas are synchronised.
        works = []
        for p, kind, pg, owner, me in items:
            m, n = _matrix_shape(p.shape)
            step_lr = _adjusted_lr(lr, group["adjust_lr_fn"], m, n)
            if kind == "local":
                _apply(p, directions[p], lr, step_lr, weight_decay)
            elif kind == "replicated":
                if me == owner:
                    _apply(p, directions[p], lr, step_lr, weight_decay)
                works.append(_broadcast(p, pg, owner))
            else:
                local = p.to_local()
                work, finish = _scatter_rows(
                    directions.get(p), p.shape, _state_dtype(p.dtype), local.device, pg, owner, me
                )
                works.append((work, functools.partial(_apply_shard, local, finish, lr, step_lr, weight_decay)))
        for work, finish in works:
            work.wait()
            finish()

    def _directions(self, core: _CoreFISMO, mine: list[tuple[torch.Tensor, torch.Tensor]]) -> dict:
        """``dW`` (shape ``(m, n)``, state dtype) of every owned matrix: one core call per bucket."""
        buckets: dict[tuple, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        every = core.inv_root.every
        for p, grad in mine:
            m, n = _matrix_shape(p.shape)
            G = grad.reshape(m, n)
            # InverseRootConfig.every: whether this parameter's roots are due, from its own step count.
            refresh = every == 1 or int(self.state[p].get("step", 0)) % every == 0
            buckets.setdefault((m, n, p.dtype, G.device, refresh), []).append((p, G))
        directions = {}
        results = []
        for (*_, refresh), bucket in buckets.items():
            states = [self._matrix_state(core, p, G) for p, G in bucket]
            if len(bucket) == 1:
                G_stack = bucket[0][1][None]
                stacked = FISMOState(
                    *(states[0][k][None] for k in STATE_KEYS), step=0, **{k: states[0][k][None] for k in COUNTER_KEYS}
                )
            else:
                G_stack = torch.stack([G for _, G in bucket])
                stacked = FISMOState(
                    *(torch.stack([s[k] for s in states]) for k in STATE_KEYS),
                    step=0,
                    **{k: torch.stack([s[k] for s in states]) for k in COUNTER_KEYS},
                )
            # Algorithm 1, lines 4-8, for the whole bucket. The core's step count is
            # not used by the algorithm; each parameter keeps its own in state["step"].
            try:
                D, new = core.direction(G_stack, stacked, refresh_roots=refresh)
            except InverseRootError as exc:
                names = ", ".join(self._label(bucket[i][0]) for i in exc.indices)
                raise InverseRootError(f"{exc}. The failing parameters: {names}", exc.indices) from exc
            results.append((bucket, states, stacked, D, new))
        # Every core call has succeeded before any state is written: an error above changes nothing.
        for bucket, states, stacked, D, new in results:
            for key in STATE_KEYS + COUNTER_KEYS:
                new_value = getattr(new, key)
                if new_value is getattr(stacked, key):  # unchanged (gamma = 1 keeps P, Q and their roots)
                    continue
                for i, state in enumerate(states):
                    state[key].copy_(new_value[i])
            for i, ((p, _), state) in enumerate(zip(bucket, states)):
                state["step"] += 1
                directions[p] = D[i]
        return directions

    def _label(self, p: torch.Tensor) -> str:
        """How error messages name parameter ``p``."""
        for gi, group in enumerate(self.param_groups):
            for i, q in enumerate(group["params"]):
                if q is p:
                    return _param_name(group, i, gi)
        return f"a parameter of shape {tuple(p.shape)}"

    def _matrix_state(self, core: _CoreFISMO, p: torch.Tensor, G: torch.Tensor) -> dict:
        state = self.state[p]
        if not state:
            init = core.init(torch.empty(G.shape, dtype=p.dtype, device=G.device))
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            state["P"], state["Q"], state["M"] = init.P, init.Q, init.M
            # The core returns the roots as arrays of their own, so in-place updates never alias P.
            state["P_inv_sqrt"], state["Q_inv_sqrt"] = init.P_inv_sqrt, init.Q_inv_sqrt
        for key in COUNTER_KEYS:  # also for states from before the counters existed
            if key not in state:
                state[key] = torch.zeros((), dtype=torch.int32, device=state["P"].device)
        return state

    # ------------------------------------------------------------------ AdamW
    def _adamw_group_step(self, group: dict) -> None:
        params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps = [], [], [], [], [], []
        has_complex = False
        for p in group["params"]:
            if p.grad is None:
                continue
            has_complex |= torch.is_complex(p)
            state = self.state[p]
            if not state:  # as torch.optim.AdamW (capturable=False, fused=False)
                state["step"] = torch.tensor(0.0, dtype=_scalar_dtype())
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                if group["amsgrad"]:
                    state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            params.append(p)
            grads.append(p.grad)
            exp_avgs.append(state["exp_avg"])
            exp_avg_sqs.append(state["exp_avg_sq"])
            if group["amsgrad"]:
                max_exp_avg_sqs.append(state["max_exp_avg_sq"])
            steps.append(state["step"])
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


# ---------------------------------------------------------------- line 9
def _apply(p: torch.Tensor, direction: torch.Tensor, lr: float, step_lr: float, weight_decay: float) -> None:
    """``p <- (1 - lr * weight_decay) p - step_lr * dW``, in place, in ``p``'s dtype.

    ``dW`` stays in the state's precision until this one rounding to ``p``'s dtype.
    """
    if weight_decay:
        p.mul_(1 - lr * weight_decay)
    p.add_(direction.reshape(p.shape), alpha=-step_lr)


def _apply_shard(local: torch.Tensor, finish: Callable, lr: float, step_lr: float, weight_decay: float) -> None:
    _apply(local, finish(), lr, step_lr, weight_decay)


# ---------------------------------------------------------------- communication
def _row_chunks(rows: int, world: int) -> tuple[int, list[int]]:
    """Rows per rank of a dim-0 shard (``torch.chunk`` semantics, as DTensor's ``Shard(0)``)."""
    chunk = -(-rows // world) if rows else 0
    return chunk, [max(0, min(chunk, rows - r * chunk)) for r in range(world)]


def _gather_rows(local: torch.Tensor, shape: torch.Size, pg: Any, owner: int, me: int) -> tuple[Any, Callable]:
    """Start gathering the dim-0 shards of a ``(rows, *rest)`` tensor to ``owner``.

    Shards are padded to equal size (``torch.distributed.gather`` needs that).
    Returns the work handle and a function giving the full ``(rows, *rest)``
    tensor on the owner and ``None`` elsewhere.
    """
    world = torch.distributed.get_world_size(pg)
    chunk, counts = _row_chunks(shape[0], world)
    if local.shape[0] != counts[me]:
        raise RuntimeError(
            f"unexpected dim-0 shard of a {tuple(shape)} DTensor on rank {me}: {tuple(local.shape)} rows, "
            f"expected {counts[me]} (torch.chunk layout)"
        )
    padded = local.new_zeros((chunk, *shape[1:]))
    padded[: counts[me]] = local
    gathered = [torch.empty_like(padded) for _ in range(world)] if me == owner else None
    work = torch.distributed.gather(padded, gathered, group=pg, group_dst=owner, async_op=True)

    def finish() -> Optional[torch.Tensor]:
        return None if gathered is None else torch.cat(gathered)[: shape[0]]

    return work, finish


def _scatter_rows(
    full: Optional[torch.Tensor],
    shape: torch.Size,
    dtype: torch.dtype,
    device: torch.device,
    pg: Any,
    owner: int,
    me: int,
) -> tuple[Any, Callable]:
    """Start scattering the owner's ``full`` (any shape with ``prod(shape)`` elements) as dim-0 shards of ``shape``."""
    world = torch.distributed.get_world_size(pg)
    chunk, counts = _row_chunks(shape[0], world)
    received = torch.empty((chunk, *shape[1:]), dtype=dtype, device=device)
    pieces = None
    if me == owner:
        full = full.reshape(shape)
        padded = full.new_zeros((chunk * world, *shape[1:]))
        padded[: shape[0]] = full
        pieces = list(padded.split(chunk)) if chunk else [padded[:0] for _ in range(world)]
        pieces = [piece.contiguous() for piece in pieces]
    work = torch.distributed.scatter(received, pieces, group=pg, group_src=owner, async_op=True)
    return work, lambda: received[: counts[me]]


def _broadcast(p: torch.Tensor, pg: Any, owner: int) -> tuple[Any, Callable]:
    buffer = p if p.is_contiguous() else p.contiguous()
    work = torch.distributed.broadcast(buffer, group=pg, group_src=owner, async_op=True)
    return work, (lambda: None) if buffer is p else (lambda: p.copy_(buffer))


# ---------------------------------------------------------------- validation
def _scalar_dtype() -> torch.dtype:
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


def _param_name(group: dict, index: int, group_index: int) -> str:
    names = group.get("param_names")
    if names and index < len(names):
        return f"parameter {names[index]!r}"
    p = group["params"][index]
    return f"parameter {index} of param group {group_index} (shape {tuple(p.shape)})"


def _validate_fismo_hparams(hp: dict, where: str) -> None:
    lr = hp["lr"]
    if isinstance(lr, torch.Tensor):
        if lr.numel() != 1:
            raise ValueError(f"{where}: a tensor lr must have one element")
        lr = lr.item()
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not math.isfinite(lr) or lr < 0:
        raise ValueError(f"{where}: lr must be a finite number >= 0, got {hp['lr']!r}")
    if hp["adjust_lr_fn"] not in _ADJUST_LR_FNS:
        raise ValueError(
            f"{where}: adjust_lr_fn must be None, 'original' or 'match_rms_adamw', got {hp['adjust_lr_fn']!r}"
        )
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
            statistics=hp.get("statistics", _CORE_DEFAULTS.statistics),
            nonfinite=hp.get("nonfinite", "raise"),
        )
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"{where}: {exc}") from exc
    # Plain dicts, so that a state_dict loads with torch.load(weights_only=True).
    hp["polar"] = dataclasses.asdict(core.polar)
    hp["inv_root"] = dataclasses.asdict(core.inv_root)


def _validate_adamw_hparams(group: dict, where: str) -> None:
    lr = _scalar(group["lr"])
    if not 0.0 <= lr:
        raise ValueError(f"{where}: invalid AdamW lr {group['lr']!r}")
    if not 0.0 <= group["eps"]:
        raise ValueError(f"{where}: invalid AdamW eps {group['eps']!r}")
    betas = group["betas"]
    if len(betas) != 2 or not all(0.0 <= _scalar(b) < 1.0 for b in betas):
        raise ValueError(f"{where}: AdamW betas must be two numbers in [0, 1), got {betas!r}")
    if not 0.0 <= group["weight_decay"]:
        raise ValueError(f"{where}: invalid AdamW weight_decay {group['weight_decay']!r}")


def _validate_matrix_param(p: Any, name: str) -> None:
    if not isinstance(p, torch.Tensor):
        raise TypeError(f"{name}: optimizer can only optimize Tensors, got {type(p).__name__}")
    if p.ndim < 2:
        raise ValueError(
            f"{name} has shape {tuple(p.shape)}: FISMO optimises matrices (2-D weights, or conv weights "
            "flattened to (out, in*kh*kw)). Put 1-D tensors (biases, norm scales) in an AdamW group: "
            "{'params': [...], 'algorithm': 'adamw'}"
        )
    if torch.is_complex(p):
        raise TypeError(f"{name} is complex ({p.dtype}); FISMO supports real matrices only (AdamW groups take complex)")
    if not p.is_floating_point():
        raise TypeError(f"{name} has dtype {p.dtype}; FISMO needs floating-point parameters")


def _validate_dtensor(p: Any, name: str) -> None:
    from torch.distributed.tensor import Shard

    if p.device_mesh.ndim != 1 or len(p.placements) != 1 or p.placements[0] != Shard(0):
        raise NotImplementedError(
            f"{name} is a DTensor with placements {p.placements} on a {p.device_mesh.ndim}-D mesh; the FISMO "
            "adapter supports FSDP2's default layout only (Shard(0) on a 1-D mesh)"
        )


# ---------------------------------------------------------------- helpers
def param_groups(
    module: torch.nn.Module,
    *,
    adamw: Optional[Callable[[str, torch.nn.Parameter], bool]] = None,
    adamw_options: Optional[dict] = None,
) -> list[dict]:
    """Split a module's trainable parameters the way Muon users do.

    Tensors with fewer than 2 dimensions, ``nn.Embedding`` weights and every
    parameter for which ``adamw(name, p)`` is true (say, the output head)
    go to an ``"adamw"`` group with ``adamw_options``; the other matrices
    (linear and conv weights) go to a FISMO group. Empty groups are left out.
    """
    embedding_weights = {
        id(m.weight) for m in module.modules() if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag))
    }
    matrices: list[torch.nn.Parameter] = []
    others: list[torch.nn.Parameter] = []
    for name, p in module.named_parameters():
        if not p.requires_grad:
            continue
        to_adamw = p.ndim < 2 or id(p) in embedding_weights or (adamw is not None and adamw(name, p))
        (others if to_adamw else matrices).append(p)
    groups: list[dict] = []
    if matrices:
        groups.append({"params": matrices})
    if others:
        groups.append({"params": others, "algorithm": "adamw", **(adamw_options or {})})
    return groups

