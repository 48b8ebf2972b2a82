"""Per-parameter state of the torch adapter, and the checks made before anything changes.

Part of [`fismo_core.backends.torch`][fismo_core.backends.torch]. This module holds

- the layout of a FISMO parameter's state in ``optimizer.state[p]``
  (`STATE_KEYS`, `COUNTER_KEYS`, `state_layout`, `init_matrix_state`) and
  its stacking into one batched core state per bucket (`pack`, `unpack`),
- the checkpoint checks and the precision-preserving restore of
  ``load_state_dict`` (`check_saved_state`, `restore_saved_state`),
- the gradient checks of a step (`check_grads`: layout, dtype, shape, and
  NaN/infinity under the groups' ``nonfinite`` policy).

Every check raises before any parameter or state is touched.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from fismo_core.kronecker import factor_structure
from fismo_core.optimizer import FISMO as _CoreFISMO
from fismo_core.optimizer import FISMOState
from fismo_core.optimizer import state_dtype as _core_state_dtype

from ._torch_distributed import is_dtensor, local_device
from ._torch_groups import matrix_shape, param_name

#: The tensors FISMO keeps per matrix parameter, in ``FISMOState`` order. A side split into
#: blocks (``block_size``) keeps its full blocks ``(k, B, B)`` under these names and its
#: remainder block ``(r, r)`` under ``"<name>_rest"`` (the keys of ``FISMOState.to_dict``).
STATE_KEYS = ("P", "Q", "M", "P_inv_sqrt", "Q_inv_sqrt")
#: The per-parameter int32 counters (``FISMOState.skipped``, ``.root_failures``), 0-d tensors.
COUNTER_KEYS = ("skipped", "root_failures")
_SIDE = {"P": 0, "P_inv_sqrt": 0, "Q": 1, "Q_inv_sqrt": 1}  # which side (m or n) a factor belongs to


def state_dtype(dtype: torch.dtype) -> torch.dtype:
    """The core's precision policy (``fismo_core.state_dtype``) for a torch dtype."""
    return _core_state_dtype(torch, dtype)


def _part_keys(name: str, parts: int) -> tuple[str, ...]:
    return (name,) if parts == 1 else (name, f"{name}_rest")


def state_layout(m: int, n: int, block_size: Optional[int]) -> dict[str, tuple[int, ...]]:
    """Every floating tensor of the state of an ``m x n`` matrix, by key, with its shape.

    Full factors: ``P``, ``P_inv_sqrt`` ``(m, m)``, ``Q``, ``Q_inv_sqrt``
    ``(n, n)``, ``M`` ``(m, n)``. A side split into blocks keeps ``(k, B, B)``
    under its names and, when ``B`` does not divide it, ``(r, r)`` under
    ``"<name>_rest"``.
    """
    structures = (factor_structure(m, block_size), factor_structure(n, block_size))
    layout: dict[str, tuple[int, ...]] = {}
    for name in STATE_KEYS:
        if name == "M":
            layout["M"] = (m, n)
            continue
        shapes = structures[_SIDE[name]].part_shapes()
        layout.update(zip(_part_keys(name, len(shapes)), (tuple(shape) for shape in shapes)))
    return layout


def init_matrix_state(core: _CoreFISMO, state: dict, G: torch.Tensor, dtype: torch.dtype) -> dict:
    """Fill an empty ``state`` from ``core.init`` for a matrix of ``G``'s shape and parameter dtype ``dtype``.

    Also adds the counters to a state from before they existed. Returns ``state``.
    """
    if not state:
        init = core.init(torch.empty(G.shape, dtype=dtype, device=G.device))
        state["step"] = torch.tensor(0.0, dtype=torch.float32)
        left, right = core.structures(*G.shape[-2:])
        # The core returns the roots as arrays of their own, so in-place updates never alias P.
        for name in STATE_KEYS:
            value = getattr(init, name)
            if name == "M":
                state["M"] = value
                continue
            parts = (left, right)[_SIDE[name]].parts(value)
            for key, part in zip(_part_keys(name, len(parts)), parts):
                state[key] = part
    for key in COUNTER_KEYS:  # also for states from before the counters existed
        if key not in state:
            state[key] = torch.zeros((), dtype=torch.int32, device=state["M"].device)
    return state


# ---------------------------------------------------------------- buckets
def pack(core: _CoreFISMO, states: list[dict], m: int, n: int) -> FISMOState:
    """The states of a bucket of ``(m, n)`` matrices as one batched ``FISMOState`` (leading dimension: the bucket)."""
    structures = core.structures(m, n)

    def stack(key: str) -> torch.Tensor:
        return states[0][key][None] if len(states) == 1 else torch.stack([s[key] for s in states])

    fields: dict[str, Any] = {}
    for name in STATE_KEYS:
        if name == "M":
            fields["M"] = stack("M")
            continue
        structure = structures[_SIDE[name]]
        keys = _part_keys(name, len(structure.part_shapes()))
        fields[name] = structure.from_parts(tuple(stack(key) for key in keys))
    return FISMOState(**fields, step=0, **{k: stack(k) for k in COUNTER_KEYS})


def unpack(core: _CoreFISMO, states: list[dict], stacked: FISMOState, new: FISMOState, m: int, n: int) -> None:
    """Copy the core's new batched state into the bucket's per-parameter states, in place.

    Parts the core returned unchanged (``gamma = 1`` keeps ``P``, ``Q`` and
    their roots) are not copied.
    """
    structures = core.structures(m, n)
    for name in STATE_KEYS + COUNTER_KEYS:
        new_value, old_value = getattr(new, name), getattr(stacked, name)
        if name in _SIDE:
            structure = structures[_SIDE[name]]
            new_parts, old_parts = structure.parts(new_value), structure.parts(old_value)
            keys = _part_keys(name, len(new_parts))
        else:
            new_parts, old_parts, keys = (new_value,), (old_value,), (name,)
        for key, new_part, old_part in zip(keys, new_parts, old_parts):
            if new_part is old_part:
                continue
            for i, state in enumerate(states):
                state[key].copy_(new_part[i])


# ---------------------------------------------------------------- checkpoints
def check_saved_state(param_groups: list, saved_state: dict, saved_groups: list) -> None:
    """`load_state_dict`'s checks of the FISMO states against the parameters, before anything changes."""
    if len(saved_groups) != len(param_groups) or any(
        len(a["params"]) != len(b["params"]) for a, b in zip(saved_groups, param_groups)
    ):
        return  # Optimizer.load_state_dict raises its own error for these
    for gi, (saved_group, group) in enumerate(zip(saved_groups, param_groups)):
        if group.get("algorithm", "fismo") != "fismo":
            continue
        if saved_group.get("algorithm", "fismo") != "fismo":
            raise ValueError(
                f"param group {gi} is a FISMO group, but the checkpoint's group {gi} is an "
                f"{saved_group['algorithm']!r} group (were the groups saved in another order?)"
            )
        block_size, saved_block_size = group.get("block_size"), saved_group.get("block_size")
        if saved_block_size != block_size:
            raise ValueError(
                f"param group {gi} has block_size={block_size!r}, but the checkpoint's group {gi} was saved with "
                f"block_size={saved_block_size!r}: a state cannot change its blocks. Resume with "
                f"block_size={saved_block_size!r} in that group, or start a new state"
            )
        for i, (index, p) in enumerate(zip(saved_group["params"], group["params"])):
            saved = saved_state.get(index)
            if not saved:
                continue
            name = param_name(group, i, gi)
            m, n = matrix_shape(p.shape)
            expected = state_layout(m, n, block_size)
            missing = [key for key in ("step", *expected) if key not in saved]
            if missing:
                raise KeyError(
                    f"the checkpoint's state for {name} lacks {missing} (it has {sorted(saved)}): "
                    "not a FISMO state, or saved for another parameter order or block_size"
                )
            extra = [key for key in saved if key.endswith("_rest") and key not in expected]
            if extra:
                raise ValueError(
                    f"the checkpoint's state for {name} has remainder blocks {extra}, which a {m}x{n} matrix "
                    f"with block_size={block_size!r} does not have (saved with another block_size?)"
                )
            for key, shape in expected.items():
                value = saved[key]
                if not isinstance(value, torch.Tensor) or tuple(value.shape) != shape:
                    got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
                    raise ValueError(
                        f"{name} has shape {tuple(p.shape)} (optimised as the matrix {m}x{n}"
                        f"{f' with block_size={block_size}' if block_size is not None else ''}), so its state "
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


def restore_saved_state(state: dict, param_groups: list, saved_state: dict, saved_groups: list) -> None:
    """After ``Optimizer.load_state_dict``: FISMO states again at their own precision, copied from the saved tensors.

    The base class casts every floating state tensor to its parameter's
    dtype; the statistics are restored in the state dtype, the counters as
    int32 (0 when the checkpoint predates them).
    """
    for saved_group, group in zip(saved_groups, param_groups):
        if group.get("algorithm", "fismo") != "fismo":
            continue
        if isinstance(group["inv_root"], dict) and "coefficients" not in group["inv_root"]:
            # Saved before InverseRootConfig had coefficients: its Newton–Schulz roots were cubic.
            group["inv_root"] = {**group["inv_root"], "coefficients": "cubic"}
        for index, p in zip(saved_group["params"], group["params"]):
            saved = saved_state.get(index)
            if not saved or p not in state:
                continue
            s = state[p]
            dtype = state_dtype(p.dtype)
            device = local_device(p)
            # Copies (copy=True): FISMO updates its state in place, so a state_dict taken from
            # another live optimizer must not share tensors with it.
            for key in state_layout(*matrix_shape(p.shape), group.get("block_size")):
                if key in saved:
                    s[key] = saved[key].to(device=device, dtype=dtype, copy=True)
            for key in COUNTER_KEYS:
                if key in saved:
                    s[key] = saved[key].to(device=device, dtype=torch.int32, copy=True)
                else:
                    s[key] = torch.zeros((), dtype=torch.int32, device=device)
            if isinstance(s.get("step"), torch.Tensor) and s["step"] is saved.get("step"):
                s["step"] = s["step"].clone()


# ---------------------------------------------------------------- gradients
def check_grads(param_groups: list) -> set:
    """Every gradient is checked before any parameter or state changes.

    Returns the ids of the FISMO parameters to skip this step (``nonfinite="skip"``).
    """
    for gi, group in enumerate(param_groups):
        for i, p in enumerate(group["params"]):
            g = p.grad
            if g is None:
                continue
            name = param_name(group, i, gi)
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
    return _check_finite_grads(param_groups)


def _check_finite_grads(param_groups: list) -> set:
    """NaN and infinity in FISMO gradients, per the groups' ``nonfinite`` policy: raise, or the set to skip.

    One host read per step (the flags of all parameters stacked); a
    sharded (FSDP2) gradient's flag is reduced over its mesh first, so
    every rank takes the same decision.
    """
    checks: list[tuple[int, int, Any, torch.Tensor]] = []  # (group index, param index, p, flag)
    for gi, group in enumerate(param_groups):
        if group["algorithm"] != "fismo" or group.get("nonfinite", "raise") == "propagate":
            continue
        for i, p in enumerate(group["params"]):
            if p.grad is None:
                continue
            local = p.grad.to_local() if is_dtensor(p.grad) else p.grad
            finite = torch.isfinite(local).all()
            if group.get("nonfinite", "raise") == "raise":  # damaged parameters too, in the same host read
                finite = finite & torch.isfinite(p.to_local() if is_dtensor(p) else p).all()
            flag = finite.to(torch.int32)
            if is_dtensor(p):
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
        group = param_groups[gi]
        if group.get("nonfinite", "raise") == "skip":
            skip.add(id(p))
            continue
        g = p.grad.to_local() if is_dtensor(p.grad) else p.grad
        names = group.get("param_names")
        if names and i < len(names):
            label = f"parameter {names[i]!r} (index {i} in param group {gi}, shape {tuple(p.shape)})"
        else:
            label = f"parameter {i} of param group {gi} (shape {tuple(p.shape)})"
        if bool(torch.isfinite(g).all()):  # the gradient is fine: the parameter itself is damaged
            local = p.detach().to_local() if is_dtensor(p) else p.detach()
            nan, inf = int(torch.isnan(local).sum()), int(torch.isinf(local).sum())
            raise ValueError(
                f"the {label} contains {nan} NaN and {inf} infinite values: it was damaged before this step "
                "(an earlier step diverged, or it was loaded so); FISMO took no step and every state is as it "
                "was. Restore the parameters from a checkpoint"
            )
        nan, inf = int(torch.isnan(g).sum()), int(torch.isinf(g).sum())
        raise ValueError(
            f"the gradient of {label} contains {nan} NaN and {inf} infinite values (of {g.numel()} entries"
            f"{' on this rank' if is_dtensor(p) else ''}); FISMO took no step: every parameter, every FISMO "
            "state (P, Q, M, roots) and every step count is as it was. Check the loss and the gradient "
            "computation, or pass nonfinite='skip' to skip such parameters"
        )
    return skip
