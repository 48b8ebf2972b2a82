"""Per-parameter state of the torch adapter, and the checks made before anything changes.

Part of [`fismo_core.backends.torch`][fismo_core.backends.torch]. This module holds

- the layout of a FISMO parameter's state in ``optimizer.state[p]``
  (`STATE_KEYS`, `COUNTER_KEYS`, `init_matrix_state`; the keys and shapes are the
  core's, `fismo_core.optimizer.state_layout`) and
  its stacking into one batched core state per bucket (`pack`, `unpack`),
- the checkpoint layout of a distributed matrix's state (`exported_state`, what
  ``state_dict`` saves; `full_saved_state`, the whole matrices ``load_state_dict``
  checks), the checkpoint checks and the precision-preserving restore of
  ``load_state_dict`` (`check_saved_state`, which validates through the core's
  ``FISMOState.from_dict``, and `restore_saved_state`),
- the gradient checks of a step (`check_grads`: layout, dtype, shape, and
  NaN/infinity under the groups' ``nonfinite`` policy).

Every check raises before any parameter or state is touched.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, Optional, overload

import torch
from array_api_compat import torch as _xp  # the core's namespace for torch tensors

from fismo_core import optimizer as _fismo  # the rules every adapter shares, looked up at each call
from fismo_core import guards as _guards
from fismo_core.optimizer import FISMO as _CoreFISMO
from fismo_core.optimizer import FISMOState
from fismo_core.optimizer import state_dtype as _core_state_dtype

from ._torch_distributed import (
    Placement,
    ReplicatedPlacement,
    full_tensor,
    is_dtensor,
    local_device,
    local_tensor,
    mesh_groups,
)
from ._torch_groups import (
    CORE_DEFAULTS,
    STEP_COUNT_DEVICE,
    check_group_settings,
    core_key,
    make_core,
    param_name,
    scalar_dtype,
    self_overlaps,
)

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


def new_step_count() -> torch.Tensor:
    """A FISMO matrix's step count at 0: a float32 0-d tensor on `STEP_COUNT_DEVICE`, as ``torch.optim``'s."""
    return torch.zeros((), dtype=torch.float32, device=STEP_COUNT_DEVICE)


def complete_loaded_state(state: dict, param_groups: list) -> None:
    """What ``__setstate__`` completes in a loaded optimizer, as ``torch.optim``'s optimizers do.

    A group saved before AdamW groups existed gets ``"algorithm": "fismo"``,
    a FISMO group saved before ``adjust_lr_fn`` existed gets ``None`` (no
    adjustment, what it did then), and a step count saved as a number
    (``FISMOState.to_dict``, an older checkpoint) becomes a 0-d tensor on
    `STEP_COUNT_DEVICE` (float32 for FISMO; AdamW's dtype for AdamW groups),
    which the step increments in place.
    """
    for group in param_groups:
        algorithm = group.setdefault("algorithm", "fismo")
        if algorithm == "fismo":
            group.setdefault("adjust_lr_fn", None)
        dtype = torch.float32 if algorithm == "fismo" else scalar_dtype()
        for p in group["params"]:
            step = state.get(p, {}).get("step")
            if step is not None and not isinstance(step, torch.Tensor):
                state[p]["step"] = torch.tensor(float(step), dtype=dtype, device=STEP_COUNT_DEVICE)


def keep_elsewhere(state: dict, p: torch.Tensor, block_size: Optional[int]) -> dict:
    """Fill ``state`` for a distributed matrix that another rank owns: its step count, and under each key
    the owner keeps a placeholder of the owner's shape and dtype on the ``meta`` device (no memory).
    Returns ``state``.

    Only the owner holds the matrix's statistics, but ``torch.distributed.checkpoint``'s flattened
    optimizer state dicts (``StateDictOptions(flatten_optimizer_state_dict=True)``, torchtitan's) rebuild
    each parameter's state on load from the keys of the live one: with its step count alone, a rank
    dropped the shards of the owner's tensors that DCP had loaded there (FSDP2: the owner's gather then
    failed, gloo's "Received data size doesn't match"; DDP: a KeyError). The placeholders carry the keys,
    and their shapes let every rank check a changed ``block_size`` as the owner does.
    """
    if "step" not in state:
        state["step"] = new_step_count()
    if "M" in state:  # made at an earlier step (every step of a non-owner comes here)
        return state
    dtype = state_dtype(p.dtype)
    for key, shape in _fismo.state_layout(*_fismo.matrix_shape(p.shape), block_size).items():
        state[key] = torch.empty(shape, dtype=dtype, device="meta")
    for key in COUNTER_KEYS:
        state[key] = torch.empty((), dtype=torch.int32, device="meta")
    return state


def init_matrix_state(core: _CoreFISMO, state: dict, G: torch.Tensor, dtype: torch.dtype, name: str = "W") -> dict:
    """Fill an empty ``state`` from ``core.init`` for a matrix of ``G``'s shape and parameter dtype ``dtype``.

    Also adds the counters to a state from before they existed, and converts an existing state to the
    state dtype of ``dtype`` when the parameter's dtype changed since it was made. Returns ``state``. ``name`` names the
    parameter in the core's errors; the factors' size was checked on every rank before (`FISMO._check_new_matrices`).
    """
    if not state:
        init = core.init(torch.empty(G.shape, dtype=dtype, device=G.device), name=name, check_size=False)
        state["step"] = new_step_count()
        left, right = core.structures(*G.shape[-2:])
        # The core returns the roots as arrays of their own, so in-place updates never alias P.
        for field in STATE_KEYS:
            value = getattr(init, field)
            if field == "M":
                state["M"] = value
                continue
            parts = (left, right)[_SIDE[field]].parts(value)
            for key, part in zip(_fismo.factor_keys(field, len(parts)), parts):
                state[key] = part
    elif state.get("M") is not None and state["M"].dtype != state_dtype(dtype):
        # The parameter changed dtype since (model.double()): the statistics follow it, as load_state_dict
        # converts a checkpoint's, so that the live run and one resumed from its checkpoint stay equal.
        for key, value in state.items():
            if key != "step" and key not in COUNTER_KEYS and isinstance(value, torch.Tensor):
                state[key] = value.to(state_dtype(dtype))
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
        keys = _fismo.factor_keys(name, len(structure.part_shapes()))
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
            keys = _fismo.factor_keys(name, len(new_parts))
        else:
            new_parts, old_parts, keys = (new_value,), (old_value,), (name,)
        for key, new_part, old_part in zip(keys, new_parts, old_parts):
            if new_part is old_part:
                continue
            # One foreach copy per key and bucket (on a GPU, one launch instead of one per parameter).
            torch._foreach_copy_([state[key] for state in states], list(new_part.unbind(0)))


# ---------------------------------------------------------------- checkpoints
def check_saved_keys(saved_state: dict, saved_groups: list) -> None:
    """Refuse a checkpoint whose ``state`` has a key that names none of its groups' parameters.

    ``Optimizer.load_state_dict`` keeps such a state under its key and starts the parameter afresh, without a
    word; then ``state_dict`` raised a raw ``TypeError`` sorting the keys (a user's hunt, 2026-12-03). A
    checkpoint that went through JSON has string keys ("0") in place of the parameters' indices.
    """
    indices = [index for group in saved_groups for index in group["params"]]
    known = set(indices)
    unknown = [key for key in saved_state if key not in known]
    if unknown:
        def listed(keys: list) -> str:
            return ", ".join(repr(key) for key in keys[:5]) + (f" and {len(keys) - 5} more" if len(keys) > 5 else "")

        raise ValueError(
            f"the checkpoint's state has keys that name no parameter of its param_groups: {listed(unknown)} (the "
            f"groups' params are {listed(indices)}). The keys of a "
            "state_dict's state are its parameters' indices, as in param_groups' params; a checkpoint through "
            "JSON makes them strings. Nothing was loaded"
        )


def check_saved_state(param_groups: list, saved_state: dict, saved_groups: list) -> None:
    """`load_state_dict`'s checks of the FISMO states against the parameters, before anything changes.

    The groups' algorithms and ``block_size`` are compared here. Each
    parameter's state is then validated by the core's
    [`FISMOState.from_dict`][fismo_core.FISMOState.from_dict] (keys, shapes,
    dtypes, counters, step), so a fault raises the core's error with the
    core's message, prefixed with the parameter's name. Floating tensors are
    first converted to the state dtype, as ``load_state_dict`` converts them.
    """
    if len(saved_groups) != len(param_groups) or any(
        len(a["params"]) != len(b["params"]) for a, b in zip(saved_groups, param_groups)
    ):
        return  # Optimizer.load_state_dict raises its own error for these
    for gi, (saved_group, group) in enumerate(zip(saved_groups, param_groups)):
        algorithm = group["algorithm"]
        # A group saved before AdamW groups existed has no "algorithm"; FISMO's groups always had "beta".
        saved_algorithm = saved_group.get("algorithm", "fismo" if "beta" in saved_group else None)
        if saved_algorithm != algorithm:  # the base class would take the checkpoint's, and its state
            said = "no algorithm (not saved by FISMO)" if saved_algorithm is None else repr(saved_algorithm)
            raise ValueError(
                f"param group {gi} has algorithm {algorithm!r}, but the checkpoint's group {gi} has {said}: "
                "were the groups saved in another order, or by another optimizer?"
            )
        if algorithm != "fismo":
            for i, (index, p) in enumerate(zip(saved_group["params"], group["params"])):
                _check_adamw_saved_state(saved_state.get(index) or {}, p, param_name(group, i, gi), saved_group)
            continue
        block_size, saved_block_size = group.get("block_size"), saved_group.get("block_size")
        # Another block_size that splits none of the group's matrices differently (block_size >= both sides
        # is the full factor) leaves every state as it is: the checkpoint loads (with its own block_size,
        # as load_state_dict takes every saved hyperparameter).
        if saved_block_size != block_size and any(
            _fismo.state_block_size(*_fismo.matrix_shape(p.shape), saved_block_size)
            != _fismo.state_block_size(*_fismo.matrix_shape(p.shape), block_size)
            for p in group["params"]
        ):
            if _states_fit(saved_state, saved_group, group, block_size):
                raise ValueError(
                    f"param group {gi} has block_size={block_size!r}, and the checkpoint's states of that group "
                    f"have its blocks, but its group {gi} says block_size={saved_block_size!r}: the block_size was "
                    "changed after the last step, before the checkpoint was saved (that run's next step refused "
                    f"it too). Set the checkpoint's param_groups[{gi}]['block_size'] = {block_size!r} before "
                    "loading (a load_state_dict pre-hook can), or start a new state"
                )
            if not _states_fit(saved_state, saved_group, group, saved_block_size, if_none=True):
                raise ValueError(
                    f"param group {gi} has block_size={block_size!r}, and the checkpoint's group {gi} says "
                    f"block_size={saved_block_size!r}, but its states have the blocks of neither: the block_size "
                    "was changed after the last step, before the checkpoint was saved. Set the checkpoint's "
                    f"param_groups[{gi}]['block_size'] to the one its states were made with before loading (a "
                    "load_state_dict pre-hook can), or start a new state"
                )
            raise ValueError(
                f"param group {gi} has block_size={block_size!r}, but the checkpoint's group {gi} was saved with "
                f"block_size={saved_block_size!r}, and the two split the group's matrices into different blocks: "
                f"a state cannot change its blocks. Resume with block_size={saved_block_size!r} in that group, or "
                "start a new state"
            )
        for i, (index, p) in enumerate(zip(saved_group["params"], group["params"])):
            saved = saved_state.get(index)
            if not saved:
                continue
            _check_through_core(saved, p, block_size, param_name(group, i, gi))


def check_loaded_settings(param_groups: list, saved_groups: list) -> None:
    """The hyperparameters ``load_state_dict`` takes from the checkpoint, checked as the next step checks them,
    before anything is loaded: a ``gamma`` of 2, a misspelt ``nonfinite`` or AdamW's ``betas`` in a FISMO
    group loaded, replacing the optimizer's, and only the next step refused them."""
    if len(saved_groups) != len(param_groups):
        return  # Optimizer.load_state_dict raises its own error
    loaded = [
        {**copy.deepcopy({k: v for k, v in saved.items() if k != "params"}), "params": group["params"]}
        for saved, group in zip(saved_groups, param_groups)
    ]
    complete_loaded_state({}, loaded)  # what a checkpoint of an older version gets on load
    try:
        check_group_settings(loaded, source="by the checkpoint")
        for index, group in enumerate(loaded):
            if group["algorithm"] == "fismo":
                try:
                    make_core(core_key(group))
                except (TypeError, ValueError) as exc:
                    raise type(exc)(f"param group {index}: {exc}") from exc
    except (TypeError, ValueError, KeyError) as exc:
        why = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc
        raise type(exc)(
            f"the checkpoint's settings would be refused by the next step; nothing was loaded: {why}. Fix them in "
            "the checkpoint's 'param_groups' before loading (a load_state_dict pre-hook can: post-hooks run after "
            "the load)"
        ) from exc


def _check_adamw_saved_state(saved: dict, p: torch.Tensor, name: str, saved_group: dict) -> None:
    """An AdamW state that is incomplete or saved in another layout (a plain tensor for a ``DTensor``
    parameter, or the reverse) loads, and ``torch.optim.AdamW``'s step then fails on it (a bare ``KeyError``
    for a missing moment) after the FISMO groups have stepped."""
    # torch.optim.AdamW starts an empty state itself; a started one needs all of these.
    needed = ("step", "exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if saved_group.get("amsgrad") else ())
    missing = [key for key in needed if key not in saved]
    if saved and missing:
        raise KeyError(
            f"the checkpoint's AdamW state for {name} is not a complete AdamW state: missing {missing} "
            f"(it has {sorted(saved)}); nothing was loaded. Drop the parameter's entry from the checkpoint's "
            "'state' to start its AdamW state anew"
        )
    for key, value in saved.items():
        if key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq") and isinstance(value, torch.Tensor) \
                and value.shape != p.shape:
            raise ValueError(
                f"the checkpoint's AdamW state {key!r} for {name} has shape {tuple(value.shape)}, not the "
                "parameter's: a checkpoint of another model (a resized embedding, say); nothing "
                "was loaded. Load the others and start this parameter's state anew (drop its entry from the "
                "checkpoint's 'state')"
            )
        if key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq") and isinstance(value, torch.Tensor) \
                and self_overlaps(value):  # torch.save keeps an expanded tensor's strides
            raise ValueError(
                f"the checkpoint's AdamW state {key!r} for {name} has strides {tuple(value.stride())}: elements "
                "along a stride of 0 share one memory location, which AdamW's in-place update cannot write; "
                "nothing was loaded. Store it with memory of its own (value.clone()) in the checkpoint"
            )
        if isinstance(value, torch.Tensor) and value.ndim and is_dtensor(value) != is_dtensor(p):
            kind = {True: "a DTensor", False: "a plain tensor"}
            raise ValueError(
                f"the checkpoint's AdamW state {key!r} for {name} is {kind[is_dtensor(value)]}, but the "
                f"parameter is {kind[is_dtensor(p)]}: a per-rank state_dict resumes in the layout it was saved "
                "in. To change layouts (one process, DDP, FSDP2, tensor parallelism) save and load with "
                "torch.distributed.checkpoint (get_state_dict / set_state_dict, see docs/torch.md)"
            )


def _states_fit(
    saved_state: dict, saved_group: dict, group: dict, block_size: Optional[int], if_none: bool = False
) -> bool:
    """Whether each saved state of the group has the blocks of ``block_size``: the shapes of its factors
    (`state_layout`; a missing key is `_check_through_core`'s to refuse); ``if_none`` where the group has
    no saved state."""
    states = [(saved, p) for index, p in zip(saved_group["params"], group["params"]) if (saved := saved_state.get(index))]
    return all(
        all(not isinstance(saved.get(key), torch.Tensor) or tuple(saved[key].shape) == shape for key, shape in
            _fismo.state_layout(*_fismo.matrix_shape(p.shape), block_size).items())
        for saved, p in states
    ) if states else if_none


def _check_through_core(saved: dict, p: torch.Tensor, block_size: Optional[int], name: str) -> None:
    """One parameter's saved state, validated by ``FISMOState.from_dict`` as the core would; its error names ``p``."""
    m, n = _fismo.matrix_shape(p.shape)
    dtype = state_dtype(p.dtype)
    floating = _fismo.state_layout(m, n, block_size)
    # The per-parameter state is to_dict's layout without the block size, which the group records.
    d = {key: (value.to(dtype) if key in floating and isinstance(value, torch.Tensor) and value.is_floating_point()
               else value) for key, value in saved.items()}
    if _fismo.state_block_size(m, n, block_size):  # 0 (no side split) is also what a missing key means
        d["block_size"] = _fismo.state_block_size(m, n, block_size)
    M = saved.get("M")
    like = torch.empty((m, n), dtype=p.dtype, device=M.device if isinstance(M, torch.Tensor) else "cpu")
    try:
        FISMOState.from_dict(d, like, block_size=block_size)
    except (KeyError, ValueError, TypeError) as exc:
        raise _naming_the_parameter(exc, p, block_size, name) from exc


def _naming_the_parameter(exc: Exception, p: torch.Tensor, block_size: Optional[int], name: str) -> Exception:
    """``exc``, an error of the core's checks of one parameter's saved state, with the parameter named."""
    m, n = _fismo.matrix_shape(p.shape)
    blocks = f" with block_size={block_size}" if block_size is not None else ""
    message = exc.args[0] if exc.args else str(exc)
    return type(exc)(f"the checkpoint's state for {name}, optimised as the {m}x{n} matrix{blocks}: {message}")


def restore_saved_state(
    state: dict, param_groups: list, saved_state: dict, saved_groups: list, owns: Callable[[Any], bool] = lambda p: True
) -> None:
    """After ``Optimizer.load_state_dict``: FISMO states again at their own precision, copied from the saved tensors.

    The base class casts every floating state tensor to its parameter's
    dtype; the statistics are restored in the state dtype, the counters as
    int32 (0 when the checkpoint predates them). A rank that does not own a
    distributed matrix (``owns(p)`` false) keeps its step count and placeholders (`keep_elsewhere`).
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
            if not owns(p):
                step = s.get("step")
                s.clear()
                s["step"] = step.clone() if isinstance(step, torch.Tensor) else torch.tensor(float(step or 0))
                keep_elsewhere(s, p, group.get("block_size"))
                continue
            dtype = state_dtype(p.dtype)
            device = local_device(p)
            layout = _fismo.state_layout(*_fismo.matrix_shape(p.shape), group.get("block_size"))
            for key in set(s) - {"step", *layout, *COUNTER_KEYS}:
                # FISMOState.to_dict's block_size and format, which from_dict checked (the group holds the
                # block_size): kept, they made every step refuse the state (a user's hunt, 2026-12-03).
                del s[key]
            # Copies (copy=True): FISMO updates its state in place, so a state_dict taken from
            # another live optimizer must not share tensors with it.
            # as_tensor: from_dict (check_saved_state) also accepts arrays and Python integers.
            for key in layout:
                if key in saved:
                    s[key] = torch.as_tensor(saved[key]).to(device=device, dtype=dtype, copy=True)
            for key in COUNTER_KEYS:
                if key in saved:
                    s[key] = torch.as_tensor(saved[key]).to(device=device, dtype=torch.int32, copy=True)
                else:
                    s[key] = torch.zeros((), dtype=torch.int32, device=device)
            if isinstance(s.get("step"), torch.Tensor) and s["step"] is saved.get("step"):
                s["step"] = s["step"].clone()


# ---------------------------------------------------------------- checkpoints of distributed matrices
def exported_state(p: torch.Tensor, placement: Placement, state: dict) -> dict:
    """One distributed matrix's state for ``state_dict``: its step count, and its owner's tensors in the checkpoint layout.

    Every rank exports the layout the owner holds, read elsewhere from the placeholders (`keep_elsewhere`,
    made with the owner's shapes), so a ``block_size`` set on the group since is not applied, as one
    process's ``state_dict`` saves its state as it is (the step and `load_state_dict` refuse it). The dtype
    is the state dtype of the parameter's dtype now, to which the owner converts, as its next step would:
    after ``model.double()`` the other ranks read the owner's float32 bytes as float64 (DDP, no error; a
    user's hunt, 2026-12-03), and a changed ``block_size`` split the owner's tensors into buffers of
    other sizes (gloo aborted every rank; FSDP2 raised on the owner and left the others waiting).
    """
    dtype, device = state_dtype(p.dtype), local_device(p)
    exported = {"step": state["step"]}
    for key in sorted(set(state) - {"step", *COUNTER_KEYS}):  # the same keys, in one order, on every rank
        value = state[key]
        exported[key] = placement.export(value.to(dtype) if placement.owns else None, tuple(value.shape), dtype,
                                         device)
    for key in COUNTER_KEYS:
        exported[key] = placement.export(state.get(key) if placement.owns else None, (), torch.int32, device)
    return exported


def check_saved_meshes(param_groups: list, saved_state: dict, saved_groups: list) -> None:
    """Every ``DTensor`` of a per-rank checkpoint lies on its parameter's device mesh (the same ranks), before
    any collective.

    A per-rank ``state_dict`` of FSDP2 or HSDP holds each state tensor as a ``DTensor`` on the mesh it was
    saved on; loaded on another number of ranks, gathering it raised torch's ``narrow unexpectedly changed
    concrete size`` on every rank (a user's hunt, 2026-12-03). Every rank reads the same meshes from its
    file, so all refuse together; DCP is the way to another world size.
    """
    for group_index, (saved_group, group) in enumerate(zip(saved_groups, param_groups)):
        for i, (key, p) in enumerate(zip(saved_group["params"], group["params"])):
            here = p.device_mesh.mesh.tolist() if is_dtensor(p) else None
            for name, value in (saved_state.get(key) or {}).items():
                if not is_dtensor(value):
                    continue
                saved = value.device_mesh.mesh.tolist()
                if saved != here:
                    where = f"the ranks {here} of its device mesh" if here is not None else "no device mesh"
                    raise ValueError(
                        f"{param_name(group, i, group_index)}: its saved state {name!r} lies on a device mesh of "
                        f"the ranks {saved}, the parameter on {where}: a per-rank state_dict resumes on the mesh "
                        "it was saved on. To resume on another number of ranks, save and load with "
                        "torch.distributed.checkpoint (get_state_dict, dcp.save, dcp.load, set_state_dict)"
                    )


def full_saved_state(param_groups: list, saved_state: dict, saved_groups: list, placements: dict) -> tuple[dict, dict]:
    """``saved_state`` with every distributed matrix's tensors made whole (``DTensor.full_tensor``), for the checks.

    A collective (in parameter order, the same on every rank), so that every
    rank then checks the same checkpoint and takes the same decision (a NaN
    or an infinity in a floating tensor, `guards.check_saved_finite`, is
    refused here, on every rank, while each holds the values). Only
    the owner keeps a matrix's tensors; the other ranks keep their shapes and
    dtypes (on the ``meta`` device), which is all the checks read, so no rank
    holds more than one other matrix's full state at a time. Returns the
    checked state and the one for ``Optimizer.load_state_dict``, where a
    matrix another rank owns keeps only its step count.
    """
    full, base = dict(saved_state), dict(saved_state)
    for gi, (saved_group, group) in enumerate(zip(saved_groups, param_groups)):
        if group.get("algorithm", "fismo") != "fismo":
            continue
        for i, (key, p) in enumerate(zip(saved_group["params"], group["params"])):
            saved = saved_state.get(key)
            placement = placements.get(p)
            if not (saved and placement is not None and placement.distributed):
                _refuse_placeholders(saved, p, param_name(group, i, gi))
                continue
            whole = {}
            for k, v in saved.items():
                if isinstance(v, torch.Tensor):
                    v = full_tensor(v)
                    if v.is_floating_point() and v.ndim:
                        try:  # on every rank while it holds the values (the owner's from_dict checks them again)
                            _guards.check_saved_finite(_xp, v, k)
                        except ValueError as exc:
                            raise _naming_the_parameter(
                                exc, p, group.get("block_size"), param_name(group, i, gi)) from exc
                        if not placement.owns:
                            v = v.to("meta")
                whole[k] = v
            full[key] = whole
            base[key] = whole if placement.owns else {k: v for k, v in whole.items() if k == "step"}
    return full, base


def _refuse_placeholders(saved: Optional[dict], p: torch.Tensor, name: str) -> None:
    """Refuse a saved state tensor on torch's ``meta`` device (a shape and dtype, no values) for a parameter
    that has values: torch.optim's cast raised ``NotImplementedError: Cannot copy out of meta tensor``,
    naming nothing (a user's hunt, 2026-12-03). Such a tensor comes from ``torch.load(...,
    map_location="meta")`` or a state built on ``meta``; a parameter on ``meta`` (deferred initialisation)
    takes it as torch.optim does."""
    if not saved or not _guards.has_values(p):
        return
    empty = [k for k, v in saved.items() if isinstance(v, torch.Tensor) and not _guards.has_values(v)]
    if empty:
        raise ValueError(
            f"{name}: its saved state {', '.join(map(repr, empty))} lies on the meta device (a shape and a dtype, "
            f"no values), and the parameter on {p.device}: a checkpoint loaded with map_location='meta' cannot "
            "resume a run. Load it onto a real device (map_location='cpu'); nothing was loaded"
        )


# ---------------------------------------------------------------- gradients
@overload
def _agree_across_shards(checks: list, extra: None = None) -> tuple[list, None]: ...
@overload
def _agree_across_shards(checks: list, extra: tuple[list, torch.Tensor]) -> tuple[list, torch.Tensor]: ...
def _agree_across_shards(
    checks: list, extra: Optional[tuple[list, torch.Tensor]] = None
) -> tuple[list, Optional[torch.Tensor]]:
    """A sharded (``DTensor``) parameter's flag, reduced (minimum) over its mesh: one all-reduce per mesh dimension.

    Over the shard group and (HSDP) the replicate group: a gradient changed on one replica alone (a hook)
    made that replica alone skip or raise, until 2026-12-03; every rank of the mesh now takes the same decision.
    ``extra``: more ``(group, device)`` pairs (the owner groups) and an int32 flag riding along in the same
    all-reduces (`read_step_faults`), ``(groups, flag)``; returned reduced over every group, else ``None``.
    """
    groups: list = []
    ok: Optional[torch.Tensor] = None
    if extra is not None:
        groups, ok = extra
    by_groups: dict[tuple, tuple[Any, list[int]]] = {(group,): (device, []) for group, device in groups}
    for k, (_, _, p, _) in enumerate(checks):
        reduce_over = mesh_groups(p) if is_dtensor(p) else None
        if reduce_over is not None:
            by_groups.setdefault(reduce_over, (local_device(p), []))[1].append(k)
    checks = list(checks)
    for reduce_over, (device, ks) in by_groups.items():
        # ``extra``'s flag: a 0-d int32, or a vector of them (`read_step_faults`' gradient digest).
        flags = torch.cat([checks[k][3].to(device).reshape(1) for k in ks]
                          + ([] if ok is None else [ok.to(device).reshape(-1)]))
        for group in reduce_over:
            torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MIN, group=group)
        for k, flag in zip(ks, flags):
            checks[k] = (*checks[k][:3], flag)
        ok = None if ok is None else flags[len(ks):].reshape(ok.shape)
    return checks, ok


def read_step_faults(
    checks: "GradientChecks", root_faults: list, owner_groups: list, digest: Optional[int] = None,
    param_groups: Sequence[dict] = (),
) -> tuple["GradientChecks", bool, Optional[torch.Tensor]]:
    """The step's one host read: whether a ``"raise"`` gradient or parameter is not finite, or a root failed.

    The pending finiteness flags of sharded parameters are reduced over their shard groups here, and a
    root's failure (checked on its owner alone) over ``owner_groups`` (``(group, device)`` pairs, empty
    where roots are not checked or no rank owns matrices of others), in one all-reduce per group:
    every rank then takes the same decision, else the ranks that did not raise would wait forever in
    line 9's collectives for the one that did. ``digest`` (`gradient_digest`) rides in the same
    all-reduces, as itself and negated: the ranks' digests differ where the minima of the two do not
    cancel (``None``: no replicated matrix, nothing rides). Returns the checks with their agreed flags,
    whether a fault was found (the ranks' digests differing is one), and that difference as a flag
    (``None`` where it was not reduced). The pending flags of the replicated (not ``DTensor``) parameters of
    ``param_groups`` ride too, one slot per such parameter whether or not it has a flag here, so that every
    rank sends a vector of one length (ranks may differ in which parameters have a gradient).
    """
    if not owner_groups:
        pending, _ = _agree_across_shards(checks.pending)
        checks = dataclasses.replace(checks, pending=pending)
        return checks, bool(_guards.read_faults(*checks.faults(), *root_faults)), None
    local = [flag.reshape(-1).any() for flag in root_faults if flag is not None]
    device = owner_groups[0][1]
    failed_here = torch.stack([f.to(device) for f in local]).any() if local else torch.zeros((), dtype=torch.bool,
                                                                                             device=device)
    riding = (~failed_here).to(torch.int32).reshape(1)
    if digest is not None:  # a host-to-device copy of two numbers, under DDP only
        riding = torch.cat([riding, torch.tensor([digest, -digest], dtype=torch.int32, device=device)])
    # The flags of replicated (not DTensor) parameters ride too: under DDP a gradient changed on one rank
    # after the all-reduce (a hook) made that rank alone raise, and the others failed in line 9's collectives.
    first_flag = len(riding)
    slots, flags = _replica_flags(param_groups, checks.pending, device)
    if flags is not None:  # some slots
        riding = torch.cat([riding, flags])
    pending, reduced = _agree_across_shards(checks.pending, (owner_groups, riding))
    checks = dataclasses.replace(checks, pending=_with_flags(pending, slots, reduced[first_flag:]))
    digests_differ = None if digest is None else reduced[1] + reduced[2] != 0  # min(d) != max(d) over the ranks
    faults = [reduced[0] == 0] + ([] if digests_differ is None else [digests_differ])
    return checks, bool(_guards.read_faults(*checks.faults(), *faults)), digests_differ


#: `gradient_digest` sums per-matrix weights modulo this prime (2^31 - 1), so that it and its negation are int32.
_DIGEST_MODULUS = 2**31 - 1


def gradient_digest(param_groups: list, placements: dict) -> Optional[int]:
    """A number that differs between DDP ranks whose replicated FISMO matrices with a gradient differ;
    ``None`` where no matrix is replicated (no DDP: FSDP2's gradients agree by construction).

    Each such matrix adds a fixed weight of its index in the groups (a multiple of the golden-ratio
    constant, modulo a prime, never 0): one matrix more or fewer always changes the sum; several
    differences cancel with a chance of about 1 in 2^31. Computed on the host from ``p.grad is None``.
    """
    digest, replicated, index = 0, False, 0
    for group in param_groups:
        if group["algorithm"] != "fismo":
            continue
        for p in group["params"]:
            index += 1
            if isinstance(placements.get(p), ReplicatedPlacement):
                replicated = True
                if p.grad is not None:
                    digest = (digest + index * 0x9E3779B1) % _DIGEST_MODULUS
    return digest if replicated else None


#: What a rank did with a step after `read_step_faults` found a fault, as `agreed_refusal` reduces it (minimum):
#: refused with an `InverseRootError`, refused with another error, or went on.
REFUSED_BY_A_ROOT, REFUSED, WENT_ON = 0, 1, 2


def agreed_refusal(owner_groups: list, here: int) -> int:
    """The minimum over the ranks of ``owner_groups`` of what each did with the step (``REFUSED_BY_A_ROOT``,
    ``REFUSED``, ``WENT_ON``), by the same all-reduces, over the same groups, as `read_step_faults`: the
    ranks that went on learn that another refused. The error path only."""
    _, reduced = _agree_across_shards([], (owner_groups, torch.tensor(here, dtype=torch.int32)))
    return int(reduced)


@dataclasses.dataclass(frozen=True)
class GradientChecks:
    """What `check_grads` found: the parameters to skip now, and the flags whose read is deferred.

    A dataclass, not a ``NamedTuple``: torch 2.11's dynamo, resuming the step after its host read, failed
    to rebuild the tuple (``InternalTorchDynamoError: IndexError``; every compiled step with a host read)."""

    skip: set
    """Ids of the parameters (of both algorithms) that do not step (``nonfinite="skip"``)."""
    pending: list
    """``(group index, param index, p, finite)`` of the ``nonfinite="raise"`` parameters, ``finite`` an int32
    0-d tensor not read yet: the step reads it with every core call's fault flags (`raise_nonfinite` after)."""

    def faults(self) -> list[torch.Tensor]:
        """The pending flags as booleans set where a gradient or a parameter is not finite."""
        return [finite == 0 for *_, finite in self.pending]


def check_grads(param_groups: list, process_group: Any = None) -> GradientChecks:
    """Every gradient is checked before any parameter or state changes.

    Layout, dtype and shape are checked here; NaN and infinity per the groups'
    ``nonfinite`` policy. ``"skip"`` groups' flags are read here (the
    parameters to skip must be known before the step); ``"raise"`` groups'
    flags are returned unread, so the step reads them together with the
    core's fault flags in one host read (`GradientChecks.pending`).
    """
    relayout = []  # DTensor gradients laid out otherwise than their parameters, changed once all checks pass
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
                if is_dtensor(p) and is_dtensor(g) and tuple(g.placements) != tuple(p.placements):
                    relayout.append(p)
            elif tuple(g.shape) != tuple(p.shape):  # torch.optim.AdamW raised (or broadcast), after the FISMO groups
                raise ValueError(f"{name} has shape {tuple(p.shape)} but its gradient {tuple(g.shape)}; nothing was "
                                 "stepped")
            elif g.dtype != p.dtype:  # torch.optim.AdamW raised in its step, after the FISMO groups had stepped
                raise TypeError(
                    f"{name} has dtype {p.dtype} and a gradient of dtype {g.dtype} (its grad_dtype); AdamW groups "
                    "step as torch.optim.AdamW, which needs the parameter's dtype: leave grad_dtype unset on "
                    "their parameters (FISMO groups take a gradient of any floating dtype); nothing was stepped"
                )
    for p in relayout:
        # A Replicate() matrix's Partial(sum) gradient (data parallelism through DTensor): each rank stepped on
        # its own partial sum and the replicas parted, 0.2-0.5 off the single process (a user's hunt,
        # 2026-12-04). The gradient is laid out as its parameter, one collective, as torch.optim's DTensor
        # arithmetic does implicitly; p.grad then holds it. After the checks above, so a refused step leaves
        # every p.grad as it was.
        p.grad = p.grad.redistribute(p.device_mesh, p.placements)
    checks = _finiteness_flags(param_groups)
    policy = [param_groups[gi].get("nonfinite", CORE_DEFAULTS.nonfinite) for gi, *_ in checks]
    skipping = [c for c, rule in zip(checks, policy) if rule == "skip"]
    raising = [c for c, rule in zip(checks, policy) if rule == "raise"]  # agreed at the read (read_step_faults)
    if skipping:
        skipping, _ = _agree_across_shards(skipping)
    if process_group is not None:
        skipping = _agree_across_replicas(param_groups, skipping, process_group)
    return GradientChecks(_decide(param_groups, skipping) if skipping else set(), raising)


def _agree_across_replicas(param_groups: list, checks: list, process_group: Any) -> list:
    """``"skip"`` flags of the replicated (not ``DTensor``) parameters, reduced (minimum) over DDP's
    ``process_group``: a gradient changed on one rank after DDP's all-reduce (a hook) made that rank alone
    skip the matrix, and line 9's broadcasts then paired other matrices up, parting the replicas without a
    word. One all-reduce, one int32 per such parameter of a ``"skip"`` group whether or not it has a flag
    here (every rank sends one length); none without such parameters."""
    skip_groups = [group if group.get("nonfinite", CORE_DEFAULTS.nonfinite) == "skip" else {"params": []}
                   for group in param_groups]  # placeholders keep the group indices
    first = next((p for group in skip_groups for p in group["params"] if not is_dtensor(p)), None)
    if first is None:
        return checks
    slots, flags = _replica_flags(skip_groups, checks, local_device(first))
    assert flags is not None  # first is a slot
    torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MIN, group=process_group)
    return _with_flags(checks, slots, flags)


def _replica_flags(param_groups: Sequence[dict], checks: list, device: Any) -> tuple[list, Optional[torch.Tensor]]:
    """One int32 slot per replicated (not ``DTensor``) parameter of ``param_groups``, in order: its flag among
    ``checks`` where it has one here, else 1 (finite), so every rank sends a vector of one length (ranks may
    differ in which parameters have a gradient). Returns the slots' ``checks`` indices (``None``: no flag
    here) and the vector (``None`` without slots)."""
    flagged = {(gi, i): k for k, (gi, i, *_) in enumerate(checks)}
    slots = [flagged.get((gi, i)) for gi, group in enumerate(param_groups)
             for i, p in enumerate(group["params"]) if not is_dtensor(p)]
    if not slots:
        return slots, None
    finite = torch.ones((), dtype=torch.int32, device=device)
    return slots, torch.stack([finite if k is None else checks[k][3].to(device) for k in slots])


def _with_flags(checks: list, slots: list, reduced: torch.Tensor) -> list:
    """``checks`` with the flags of `_replica_flags`' slots replaced by their reduced values."""
    checks = list(checks)
    for k, flag in zip(slots, reduced):
        if k is not None:
            checks[k] = (*checks[k][:3], flag)
    return checks


def raise_nonfinite(param_groups: list, checks: GradientChecks) -> None:
    """After a step's read found a fault: the ``ValueError`` of the first non-finite gradient or parameter, if any."""
    if checks.pending:
        _decide(param_groups, checks.pending)


def _finiteness_flags(param_groups: list) -> list:
    """``(group index, param index, p, finite)`` of every parameter under ``"raise"`` or ``"skip"``, not read
    and not yet reduced over a shard group (`check_grads`, `read_step_faults`)."""
    checks: list[tuple[int, int, Any, torch.Tensor]] = []  # (group index, param index, p, flag)
    for gi, group in enumerate(param_groups):
        if group.get("nonfinite", CORE_DEFAULTS.nonfinite) == "propagate":  # groups of old checkpoints: the default
            continue
        for i, p in enumerate(group["params"]):
            if p.grad is None:
                continue
            local = local_tensor(p.grad)
            finite = _guards.all_finite(_xp, local)
            if group.get("nonfinite", CORE_DEFAULTS.nonfinite) == "raise":  # damaged parameters too, same host read
                finite = finite & _guards.all_finite(_xp, local_tensor(p))
            checks.append((gi, i, p, finite.to(torch.int32)))
    return checks


def _decide(param_groups: list, checks: list) -> set:
    """Read ``checks``' flags (one host read per device): raise for a non-finite one under ``"raise"``, or the set to skip."""
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
        if group.get("nonfinite", CORE_DEFAULTS.nonfinite) == "skip":
            skip.add(id(p))
            continue
        g = local_tensor(p.grad)
        label = param_name(group, i, gi, located=True)
        if bool(torch.isfinite(g).all()):  # the gradient is fine: the parameter itself is damaged
            local = local_tensor(p.detach())
            nan, inf = int(torch.isnan(local).sum()), int(torch.isinf(local).sum())
            if nan == inf == 0:  # the flag was reduced over the ranks (the shard group, or DDP's replicas)
                where, both = ("shard", "shards") if is_dtensor(p) else ("copy", "copies")
                raise ValueError(
                    f"the gradient of {label}, or the parameter itself, has a NaN or an infinity in another "
                    f"rank's {where} (this rank's {both} of both are finite; that rank's error says which); FISMO "
                    "took no step: every parameter, every state and every step count is as it was"
                )
            raise ValueError(
                f"the {label} contains {nan} NaN and {inf} infinite values: it was damaged before this step "
                "(an earlier step diverged, or it was loaded so); FISMO took no step and every state is as it "
                "was. Restore the parameters from a checkpoint"
            )
        nan, inf = int(torch.isnan(g).sum()), int(torch.isinf(g).sum())
        raise ValueError(
            f"the gradient of {label} contains {nan} NaN and {inf} infinite values (of {g.numel()} entries"
            f"{' on this rank' if is_dtensor(p) else ''}); FISMO took no step: every parameter, every state "
            "(FISMO's P, Q, M, roots; AdamW's moments) and every step count is as it was. Check the loss and the "
            "gradient computation, or pass nonfinite='skip' to skip such parameters"
        )
    return skip
