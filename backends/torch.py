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

The optimizer protocol (this class) is here; the rest lives in private modules:
``_torch_groups`` (param-group routing, validation, the `param_groups` helper,
the AdamW route), ``_torch_state`` (the per-parameter state, its checkpoint
layout, checkpoint and gradient checks), ``_torch_distributed`` (matrix owners,
gather, scatter, broadcast), ``_torch_compile`` (what only the traced step runs)
and ``_torch_precision`` (where bfloat16 is native). See ``docs/torch.md``.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import inspect
import math
import numbers
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any, Literal, NamedTuple, Optional, Union

import torch
from torch.optim.optimizer import Optimizer, ParamsT

from fismo_core import guards as _guards
from fismo_core.guards import foreign_keywords
from fismo_core.optimizer import FISMO as _CoreFISMO
from fismo_core import optimizer as _fismo  # the rules every adapter shares, looked up at each call
from fismo_core.kronecker import factor_structure
from fismo_core.linalg import MUON_COEFFICIENTS
from fismo_core.optimizer import (
    TRAINING, InverseRootConfig, InverseRootError, PolarConfig, check_muon_polar, training_options,
)

from . import _torch_distributed as _dist
from ._torch_groups import (
    ADAMW_DEFAULTS,
    CORE_DEFAULTS,
    STEP_COUNT_DEVICE,
    adamw_group_step,
    adjusted_lr,
    check_each_param_once,
    check_states_fit,
    check_group_settings,
    core_key,
    drop_fismo_keys,
    init_adamw_state,
    make_core,
    own_nested_options,
    plain_numbers,
    param_groups,
    param_name,
    route_group,
    validate_fismo_hparams,
    validate_matrix_param,
)
from ._torch_compile import TracedRootSchedule, through_dynamo, warn_of_numpy_scalars
from ._torch_eager_kernels import EagerKernels, wants_eager_kernels
from ._torch_precision import bfloat16_is_native, onednn_isa_limit, training_precision
from ._torch_state import (
    COUNTER_KEYS,
    REFUSED,
    REFUSED_BY_A_ROOT,
    STATE_KEYS,
    WENT_ON,
    agreed_refusal,
    check_grads,
    check_loaded_settings,
    check_saved_keys,
    check_saved_meshes,
    check_saved_state,
    complete_loaded_state,
    exported_state,
    full_saved_state,
    gradient_digest,
    init_matrix_state,
    keep_elsewhere,
    pack,
    raise_nonfinite,
    read_step_faults,
    restore_saved_state,
    state_dtype,
    unpack,
)

__all__ = [
    "ADAMW_DEFAULTS", "COUNTER_KEYS", "FISMO", "STATE_KEYS", "bfloat16_is_native", "onednn_isa_limit", "param_groups",
    "training_precision",
]

_CORE_DEFAULTS = CORE_DEFAULTS
#: Core instances kept per optimizer (a schedule of beta, gamma or mu makes one per value; the oldest go).
_MAX_CORES = 64
#: Keywords of torch's other optimizers that belong to the AdamW groups here.
_ADAMW_KEYWORD = (
    "a key of the AdamW groups (biases, norms, embeddings, the head): "
    "param_groups(model, adamw_options={{'{0}': ...}}), or {{'params': [...], 'algorithm': 'adamw', '{0}': ...}}"
)


def _listed_with_devices(params: Any) -> tuple[Any, set]:
    """``params`` with every iterable read into a list (a generator can be read once only) and the
    devices of its tensors; what is not a tensor, a ``(name, tensor)`` pair or a group is left for
    the constructor to refuse, as is a group's ``params`` given as a ``set``, which torch.optim refuses
    (unordered: a checkpoint's states are matched by position); read into a list, it was accepted in an
    order that changes between runs (a user's hunt, 2026-12-03)."""
    if isinstance(params, (torch.Tensor, dict)):
        return params, set()

    def tensor_of(item: Any) -> Any:
        return item[1] if isinstance(item, tuple) and len(item) == 2 else item

    listed: list[Any] = []
    devices: set[torch.device] = set()
    for item in params:
        if isinstance(item, dict) and "params" in item and not isinstance(
                item["params"], (torch.Tensor, set, frozenset)):
            item = {**item, "params": list(item["params"])}
        members = item.get("params", []) if isinstance(item, dict) else [item]
        members = [members] if isinstance(members, torch.Tensor) else members
        devices.update(t.device for t in map(tensor_of, members) if isinstance(t, torch.Tensor))
        listed.append(item)
    return listed, devices


def _outside_inference_mode() -> contextlib.AbstractContextManager:
    """A step called inside ``torch.inference_mode()`` (an evaluation loop wrapped whole) runs as outside it.

    The states it made there were inference tensors, which the next step outside cannot update in place:
    it raised after writing ``P`` (``torch.optim.AdamW`` fails so too). ``inference_mode(False)`` turns
    grad mode back on, hence ``no_grad`` inside it. Dynamo cannot trace the question (torch 2.13); a
    compiled step is left as it is.
    """
    if torch.compiler.is_compiling() or not torch.is_inference_mode_enabled():
        return contextlib.nullcontext()
    return _normal_tensors()


@contextlib.contextmanager
def _normal_tensors() -> Iterator[None]:
    with torch.inference_mode(False), torch.no_grad():
        yield


@foreign_keywords(
    "fismo_core.backends.torch.FISMO",
    notes={
        "eps": ("torch.optim.AdamW", "AdamW's eps is " + _ADAMW_KEYWORD.format("eps")),
        "betas": ("torch.optim.AdamW", _ADAMW_KEYWORD.format("betas")),
    },
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
        ``ValueError``: put them in an ``"adamw"`` group, or build the
        groups of a whole model with [`param_groups`][fismo_core.backends.torch.param_groups].
    lr, beta, gamma, mu, polar, inv_root, weight_decay, nesterov, statistics, block_size:
        As in [`fismo_core.FISMO`][fismo_core.FISMO], with the same defaults. ``lr`` may be
        given positionally, ``FISMO(params, 0.02)``, as in ``torch.optim``;
        the others are keyword-only. ``lr`` may be
        0 (schedulers reach it), a one-element tensor, or a NumPy scalar (stored
        as a Python float); ``beta`` may be a 0-d floating tensor, changed in
        place (``fill_``) for a momentum schedule that ``torch.compile``
        reads without recompiling; ``weight_decay`` is decoupled,
        ``W <- (1 - lr * weight_decay) W`` with the group's unadjusted lr,
        as ``torch.optim.Muon`` does.
    adjust_lr_fn:
        ``None`` (default), ``"original"`` (``lr * sqrt(max(1, m/n))``) or
        ``"match_rms_adamw"`` (``lr * 0.2 * sqrt(max(m, n))``), as in
        ``torch.optim.Muon``; ``(m, n)`` is the (flattened) matrix shape.
        Scales the step ``- lr * dW`` only, not the weight decay (as Muon).
    nonfinite:
        What a NaN or infinity in a gradient (or, under ``"raise"``, in a
        parameter: ``"skip"`` checks gradients only) does, in every
        group, FISMO's and AdamW's: all are checked before anything changes,
        in one host read per step (``"skip"``: one more, for which parameters
        skip). ``"raise"`` (default): a ``ValueError``
        naming the parameter; no parameter, state or step count changes.
        ``"skip"``: that parameter is left alone for this step (a FISMO
        parameter keeps its ``P``, ``Q``, ``M``, roots and ``step``, and its
        ``state["skipped"]`` counts up; an AdamW parameter keeps
        ``exp_avg``, ``exp_avg_sq`` and ``step``; no weight decay either); the
        others step. ``"propagate"``: no check, as ``torch.optim``
        optimizers. A group may set its own (``"nonfinite"`` in the group
        dict, AdamW groups included); the others take this one.
    process_group:
        For data parallelism with replicated parameters (DDP): the group
        across which the matrix work is partitioned. Each matrix has one
        owner rank, which keeps its state and computes its direction; the
        updated parameter is then broadcast from the owner. Leave ``None``
        without DDP. ``DTensor`` parameters (FSDP2 on a 1-D mesh, HSDP on a
        2-D one, tensor parallelism; see docs/torch.md) are recognised by
        themselves and need no process group.
    """

    def __init__(
        self,
        params: ParamsT,
        lr: Union[float, torch.Tensor] = _CORE_DEFAULTS.lr,
        *args: Any,
        beta: Union[float, torch.Tensor] = _CORE_DEFAULTS.beta,
        gamma: float = _CORE_DEFAULTS.gamma,
        mu: float = _CORE_DEFAULTS.mu,
        polar: Union[PolarConfig, str, dict, None] = None,
        inv_root: Union[InverseRootConfig, str, dict, None] = None,
        weight_decay: float = _CORE_DEFAULTS.weight_decay,
        nesterov: bool = _CORE_DEFAULTS.nesterov,
        adjust_lr_fn: Optional[Literal["original", "match_rms_adamw"]] = None,
        process_group: Optional[torch.distributed.ProcessGroup] = None,
        statistics: Literal["printed", "scale_invariant"] = _CORE_DEFAULTS.statistics,
        nonfinite: Literal["raise", "skip", "propagate"] = _CORE_DEFAULTS.nonfinite,
        block_size: Optional[int] = _CORE_DEFAULTS.block_size,
    ) -> None:
        if args:
            raise TypeError(
                f"FISMO takes params and the learning rate positionally (FISMO(params, 0.02), as torch.optim "
                f"optimizers do), but got {len(args)} more positional argument(s) {args!r}; pass the other "
                "hyperparameters by keyword: beta=, gamma=, mu=, weight_decay=, nesterov=, ..."
            )
        if process_group is not None and not (torch.distributed.is_available() and torch.distributed.is_initialized()):
            raise RuntimeError("process_group was given but torch.distributed is not initialised")
        if process_group is not None and not isinstance(process_group, torch.distributed.ProcessGroup):
            # Refused here, not at the first step, where torch raised of another thing ("Group DeviceMesh(...)
            # is not registered", "'bool' object has no attribute 'size'").
            from torch.distributed.device_mesh import DeviceMesh

            if type(process_group) is int and process_group == torch.distributed.GroupMember.NON_GROUP_MEMBER:
                raise TypeError(
                    f"process_group is GroupMember.NON_GROUP_MEMBER: this rank ({torch.distributed.get_rank()}) is "
                    "not in the group (new_group returns it on the ranks it leaves out); give each rank the group "
                    "it belongs to"
                )
            if isinstance(process_group, DeviceMesh):
                raise TypeError(
                    f"process_group is a DeviceMesh ({process_group}); FISMO takes its process group: "
                    "process_group=mesh.get_group() (a 1-D mesh, for DDP). FSDP2, HSDP and tensor parallelism "
                    "need none: their DTensor parameters carry their mesh"
                )
            raise TypeError(
                "process_group must be a torch.distributed.ProcessGroup (torch.distributed.group.WORLD, or one "
                f"made by torch.distributed.new_group) or None, got {type(process_group).__name__}"
            )
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
            "block_size": block_size,
        }
        validate_fismo_hparams(defaults, "the optimizer's defaults")
        self._cores: dict = {}  # `_core_for`'s caches; attributes, not __dict__.setdefault (below)
        self._checked_block_sizes: dict = {}
        super().__init__(params, defaults)

    @classmethod
    def training(
        cls,
        params: ParamsT,
        lr: Union[float, torch.Tensor] = 1e-3,
        weight_decay: float = TRAINING["weight_decay"],
        momentum: Union[float, torch.Tensor] = 0.95,
        nesterov: bool = TRAINING["nesterov"],
        ns_coefficients: tuple[float, float, float] = MUON_COEFFICIENTS[0],
        eps: float = 1e-7,
        ns_steps: int = 5,
        adjust_lr_fn: Optional[Literal["original", "match_rms_adamw"]] = None,
        **fismo_options: Any,
    ) -> "FISMO":
        """The training configuration, with ``torch.optim.Muon``'s signature and defaults.

        Replacing ``torch.optim.Muon(`` by ``FISMO.training(`` is the switch:
        the arguments mean what they mean in ``torch.optim.Muon`` (``lr``
        1e-3, ``weight_decay`` 0.1 decoupled, ``momentum`` 0.95 is ``beta``,
        ``nesterov`` on, the Newton–Schulz ``ns_coefficients``, ``eps`` and
        ``ns_steps``; ``adjust_lr_fn=None`` means ``"original"``,
        ``lr * sqrt(max(1, m/n))``, as in ``torch.optim.Muon``). On top of
        them come the core's [`TRAINING`][fismo_core.optimizer.TRAINING]
        (scale-invariant statistics, damping ``mu`` 0.1, roots every 10 steps,
        blocks of 512) and the precision of
        [`training_precision`][fismo_core.backends.torch.training_precision]:
        where every parameter's device multiplies bfloat16 natively
        ([`bfloat16_is_native`][fismo_core.backends.torch.bfloat16_is_native]),
        Muon's bfloat16 for its iteration (``polar`` dtype ``"bfloat16"``) and
        for the products of lines 4–6 and 8 (``inv_root``
        ``matmul_dtype="bfloat16"``; the statistics stay in the parameters'
        dtype); elsewhere, where bfloat16 is emulated at several times
        float32's cost, both in the parameters' dtype. Pass ``polar`` or
        ``inv_root`` to choose yourself. This is *not* Algorithm 1, which
        stays ``FISMO(params)``.

        ``fismo_options`` are any other keyword of ``FISMO`` (``gamma``,
        ``mu``, ``block_size``, ``statistics``, ``inv_root``, ``polar``,
        ``nonfinite``, ``process_group``; ``polar=None`` and ``inv_root=None``
        mean the preset's, as not given) and override the preset by the
        core's rule ([`training_options`][fismo_core.optimizer.training_options]:
        ``polar``/``inv_root`` as a dict or method name are merged field by
        field; ``ns_steps``, ``ns_coefficients`` or ``eps`` given with
        another value than its default beside a ``polar`` that sets the same
        field otherwise is refused, naming both:
        [`check_muon_polar`][fismo_core.optimizer.check_muon_polar]).
        ``params`` are what ``FISMO`` takes: tensors, or param groups,
        ``"adamw"`` groups included (e.g. [`param_groups`][fismo_core.backends.torch.param_groups]).
        With ``gamma=1`` (``P = Q = I``) it is ``torch.optim.Muon`` at the same
        arguments, up to bfloat16 rounding. Bad input raises before anything
        is built, naming the argument. ``params`` may be a generator: it is
        read once, here.
        """
        if "beta" in fismo_options:
            raise TypeError(
                "FISMO.training takes torch.optim.Muon's arguments: the momentum is momentum= "
                f"(FISMO's beta), got beta={fismo_options['beta']!r}"
            )
        if (
            isinstance(ns_coefficients, (str, bytes))
            or not hasattr(ns_coefficients, "__len__")
            or len(ns_coefficients) != 3
        ):
            raise ValueError(
                f"ns_coefficients must be three numbers (a, b, c), as in torch.optim.Muon, got {ns_coefficients!r}"
            )
        if isinstance(momentum, torch.Tensor):  # FISMO's beta schedule; other tensors are refused as beta, below
            out_of_range = momentum.ndim == 0 and momentum.is_floating_point() and not 0.0 <= float(momentum) <= 1.0
        else:
            out_of_range = (isinstance(momentum, bool) or not isinstance(momentum, numbers.Real)
                            or not 0.0 <= momentum <= 1.0)
        if out_of_range:
            raise ValueError(f"momentum (FISMO's beta) must be a number in [0, 1] or a 0-d tensor, got {momentum!r}")
        for name in ("polar", "inv_root"):  # None is FISMO's "the default": here, the preset's
            if name in fismo_options and fismo_options[name] is None:
                del fismo_options[name]
        signature = inspect.signature(cls.training).parameters
        check_muon_polar("FISMO.training", {
            argument: (field, value, signature[argument].default)
            for argument, field, value in [("ns_coefficients", "coefficients", ns_coefficients),
                                           ("ns_steps", "steps", ns_steps), ("eps", "eps", eps)]
        }, fismo_options.get("polar"))
        params, devices = _listed_with_devices(params)
        precision = training_precision(bool(devices) and all(map(bfloat16_is_native, devices)))
        muon = {"ns_coefficients": ns_coefficients, "ns_steps": ns_steps, "eps": eps}
        try:
            polar = PolarConfig(coefficients=(tuple(ns_coefficients),), steps=ns_steps, eps=eps,
                                dtype=precision["polar"]["dtype"])
        except (TypeError, ValueError) as exc:
            given = ", ".join(f"{k}={v!r}" for k, v in muon.items())
            raise type(exc)(f"FISMO.training({given}): {exc}") from None
        preset = training_options(TRAINING, {**precision, "polar": dataclasses.asdict(polar)})
        muon_conventions = {"weight_decay": weight_decay, "nesterov": nesterov, "beta": momentum,
                            "adjust_lr_fn": "original" if adjust_lr_fn is None else adjust_lr_fn}
        # The constructor checks the other values before anything is built, naming them.
        return cls(params, lr, **training_options(preset, {**muon_conventions, **fismo_options}))

    # ------------------------------------------------------------ param groups
    def add_param_group(self, param_group: dict) -> None:
        """Add a param group; an ``"adamw"`` group is filled with AdamW's defaults, not FISMO's."""
        group = route_group(param_group, self.defaults, f"param group {len(self.param_groups)}")
        super().add_param_group(group)
        if group["algorithm"] == "adamw":
            drop_fismo_keys(self.param_groups[-1])

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
        checked against the parameter by the core's
        [`FISMOState.from_dict`][fismo_core.FISMOState.from_dict], with its
        messages: a missing or unknown key (``KeyError``), a shape that does
        not fit the parameter's matrix ``(m, n)``, a NaN or an infinity in
        ``P``, ``Q``, ``M`` or a root, or malformed counters
        (``ValueError``), or a non-floating ``P``, ``Q``, ``M`` or root
        (``TypeError``) raises and leaves the optimizer as it was. (Floating
        dtypes are converted, as ``torch.optim`` does.) The FISMO state is copied, never shared
        with ``state_dict``'s tensors.
        """
        # The hooks run as torch.optim runs them, around the whole load: the pre-hooks on what is checked
        # and restored here too, the post-hooks after FISMO's states are restored in their precision.
        state_dict = state_dict.copy()
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            hook_result = pre_hook(self, state_dict)
            if hook_result is not None:
                state_dict = hook_result
        saved_groups = state_dict["param_groups"]
        check_saved_keys(state_dict["state"], saved_groups)
        check_saved_meshes(self.param_groups, state_dict["state"], saved_groups)
        placements = self._placements(laid_out=False)
        saved_state, base_state = full_saved_state(self.param_groups, state_dict["state"], saved_groups, placements)
        check_saved_state(self.param_groups, saved_state, saved_groups)
        check_loaded_settings(self.param_groups, saved_groups)
        hooks = (self._optimizer_load_state_dict_pre_hooks, self._optimizer_load_state_dict_post_hooks)
        self._optimizer_load_state_dict_pre_hooks, self._optimizer_load_state_dict_post_hooks = OrderedDict(), OrderedDict()
        try:
            super().load_state_dict({**state_dict, "state": base_state})
        finally:
            self._optimizer_load_state_dict_pre_hooks, self._optimizer_load_state_dict_post_hooks = hooks
        # Normal tensors, also inside torch.inference_mode(): the copies made there were inference tensors,
        # and the next step outside it raised at its in-place update after writing P (a user's hunt, 2026-12-03;
        # torch.optim.AdamW keeps the saved tensors themselves where dtype and device agree).
        with torch.inference_mode(False):
            restore_saved_state(
                self.state, self.param_groups, saved_state, saved_groups, owns=lambda p: placements[p].owns
            )
            self._keep_owners(placements)
        for group in self.param_groups:  # torch.optim deep-copies the saved groups at once: shared dicts stay shared
            own_nested_options(group)
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    def __getstate__(self) -> dict:
        """As ``Optimizer.__getstate__``, with ``process_group`` (pickling lost it); pickling an optimizer with a
        process group is refused: a ``ProcessGroup`` lives in its process and cannot be pickled."""
        if self.process_group is not None:
            raise TypeError(
                "a FISMO optimizer with a process_group cannot be pickled (a torch.distributed ProcessGroup exists "
                "in its process only): pickle opt.state_dict() and load it into an optimizer built in the new "
                "process, or checkpoint with torch.distributed.checkpoint; copy.deepcopy(opt) shares the group"
            )
        return self._pickled_state()

    def _pickled_state(self) -> dict:
        return {**super().__getstate__(), "process_group": self.process_group}

    def __deepcopy__(self, memo: dict) -> "FISMO":
        """A copy of everything but ``process_group``, which the copy shares: a process group is the
        processes' communicator, not data, and cannot be copied."""
        if self.process_group is not None:
            memo.setdefault(id(self.process_group), self.process_group)
        twin = type(self).__new__(type(self))
        memo[id(self)] = twin
        twin.__setstate__(copy.deepcopy(self._pickled_state(), memo))
        return twin

    def __setstate__(self, state: dict) -> None:
        """As ``Optimizer.__setstate__`` (unpickling, and the end of ``load_state_dict``), then `complete_loaded_state`."""
        super().__setstate__(state)
        if not hasattr(self, "process_group"):  # pickled before it was kept (load_state_dict keeps the live one)
            self.process_group = None
        if not hasattr(self, "_cores"):  # caches, not pickled: an unpickled or deep-copied optimizer makes its own
            self._cores, self._checked_block_sizes = {}, {}
        complete_loaded_state(self.state, self.param_groups)

    def state_dict(self) -> dict:
        """As ``Optimizer.state_dict``; a distributed matrix's state is saved in a layout independent of its owner.

        In one process the state is that of the base class. Under DDP every
        rank's ``state_dict`` holds the whole state of every matrix (broadcast
        from its owner); under FSDP2, HSDP and tensor parallelism each state
        tensor is a ``DTensor`` on the parameter's mesh, sharded on its first
        dimension. So ``torch.distributed.checkpoint`` (``get_state_dict``,
        ``dcp.save``, ``dcp.load``, ``set_state_dict``) saves one logical state
        per matrix and resumes it on any number of ranks, where
        `load_state_dict` hands each matrix's state to its owner in the new
        world. Collective: every rank calls it, as it calls ``step``.
        """
        # The post-hooks run last, on the state_dict as returned (as torch.optim runs them): the export
        # and the sort below came after them, and the sort raised on keys a hook added.
        post_hooks = self._optimizer_state_dict_post_hooks
        self._optimizer_state_dict_post_hooks = OrderedDict()
        try:
            saved = super().state_dict()
        finally:
            self._optimizer_state_dict_post_hooks = post_hooks
        saved["param_groups"] = [plain_numbers(own_nested_options(group)) for group in saved["param_groups"]]  # copies
        placements = self._placements()
        index = 0
        for group in self.param_groups:
            for p in group["params"]:
                placement = placements.get(p)
                state = self.state.get(p)
                if placement is not None and placement.distributed and state:
                    saved["state"][index] = exported_state(p, placement, state)
                index += 1
        # In parameter order: the base class packs self.state in insertion order, which differs between
        # ranks (owners create a matrix's state when computing it, the others when applying), and
        # get_state_dict(full_state_dict=True) gathers each DTensor in this order, a collective per tensor.
        saved["state"] = dict(sorted(saved["state"].items()))
        for post_hook in post_hooks.values():
            hook_result = post_hook(self, saved)
            if hook_result is not None:
                saved = hook_result
        return saved

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        """One optimisation step; with ``closure``, re-evaluates the model first and returns its loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # A step called inside torch.autocast (a training step wrapped whole) would run FISMO's products in
        # bfloat16/float16 (test_a_step_inside_autocast_equals_one_outside).
        with (torch.autocast("cpu", enabled=False) if torch.is_autocast_enabled("cpu") else contextlib.nullcontext()), \
                (torch.autocast("cuda", enabled=False) if torch.is_autocast_enabled("cuda") else contextlib.nullcontext()), \
                _outside_inference_mode():
            self._step()
        return loss

    def _step(self, in_eager_kernels: bool = False) -> None:
        """`step` without its closure, outside autocast; ``in_eager_kernels``: called again by itself, compiled,
        under `EagerKernels` (the groups set up)."""
        if torch.compiler.is_compiling() and not in_eager_kernels:
            # _init_group checks the groups' settings first, eagerly (its refusals pass through dynamo).
            if self._init_group():
                self._distributed_step_eagerly()
                return
            self._static_shapes()
            # A compiled float64 step rounds as eager. Not where the step reads the host: dynamo cannot
            # resume that graph break inside the mode. (Otherwise the rest stays in this frame: run from
            # another, a refusal after a host read's graph break lost the class dynamo lets through.)
            if wants_eager_kernels(self.param_groups) and not self._step_reads_the_host():
                with EagerKernels():
                    self._step(in_eager_kernels=True)
                return
        check_group_settings(self.param_groups)
        check_each_param_once(self.param_groups)
        check_states_fit(self.param_groups, self.state)
        if not torch.compiler.is_compiling():  # compiled, a float lr is a graph input: line 9 makes inf
            self._check_step_sizes()
        checks = check_grads(self.param_groups, self.process_group)
        for group in self.param_groups:  # a block_size that splits a state otherwise: refused by that name first
            if group["algorithm"] == "fismo":
                self._core_for(group)
        placements = self._placements()
        created: list[torch.Tensor] = []  # the parameters whose state this step creates
        # Until line 9 nothing is written: whatever raises, the optimizer stays as it was, without the
        # new states. (Two try blocks, not one around the host read: dynamo cannot resume a graph break
        # inside a try block; it ran the whole step eagerly and compiled its parts, guarding on every
        # gradient's identity, so each step recompiled them.)
        roots_due = self._roots_due_read_on_the_host()
        try:
            # Lines 4-8 of every FISMO group: gather, and compute on the owners.
            # Keyed by the group's index: torch 2.11's dynamo cannot trace id() of a dict (found 2026-12-04).
            plans = {
                index: self._fismo_compute(group, placements, checks.skip, created, roots_due)
                for index, group in enumerate(self.param_groups)
                if group["algorithm"] == "fismo"
            }
        except Exception:
            self._forget(created)
            raise
        # The step's one host read: every gradient's finiteness ("raise") and every core call's root checks.
        calls = [call for plan in plans.values() for call in plan.calls]
        # A root is checked on its owner alone: where ranks own matrices, its failure is agreed over the
        # owner groups, in the all-reduces of the gradients' flags. They run wherever the step reads
        # anything (a root's check, a "raise" or "skip" group's flags), so that a flag set on one rank
        # alone is every rank's decision; a sync-free step (every group "propagate", roots unchecked)
        # runs none.
        agree = _dist.owner_groups(placements) if self._step_reads_the_host() else []
        # Under DDP a digest of which matrices have a gradient rides along: the owners' broadcasts pair up
        # only where every rank steps the same matrices.
        digest = gradient_digest(self.param_groups, placements) if agree else None
        checks, found, digests_differ = read_step_faults(
            checks, [f for call in calls for f in call.result.faults], agree, digest, self.param_groups
        )
        if found:
            if digests_differ is not None and bool(digests_differ):  # the same decision on every rank
                self._forget(created)
                raise RuntimeError(self._mismatched_gradients_message(placements))
            refused = None
            try:
                self._settle(checks, plans)
            except Exception as exc:  # on a root's owner alone: InverseRootError, or its warning made an error
                refused = exc
            if agree:
                here = (WENT_ON if refused is None else
                        REFUSED_BY_A_ROOT if isinstance(refused, InverseRootError) else REFUSED)
                anywhere = agreed_refusal(agree, here)
                if refused is None and anywhere == REFUSED_BY_A_ROOT:
                    refused = InverseRootError(
                        "FISMO: an inverse root failed beyond InverseRootConfig.max_failures on another rank, "
                        "which owns the matrix and names it in its own InverseRootError; no rank took the step", ()
                    )
                elif refused is None and anywhere == REFUSED:
                    refused = RuntimeError(
                        "FISMO: the step raised on another rank, which says why in its own error (an "
                        "InverseRootWarning turned into an error by a warnings filter, on the rank that owns "
                        "the matrix, is one way); no rank took the step"
                    )
            if refused is not None:
                self._forget(created)
                raise refused
        for index, group in enumerate(self.param_groups):
            if group["algorithm"] == "adamw":
                adamw_group_step(self.state, group, checks.skip)
            else:
                self._fismo_apply(plans[index])

    def _distributed(self) -> bool:
        """Whether a step runs collectives: a ``process_group`` (DDP) or a ``DTensor`` parameter (FSDP2, HSDP, TP)."""
        return self.process_group is not None or any(
            _dist.is_dtensor(p) for group in self.param_groups for p in group["params"]
        )

    @functools.partial(
        torch.compiler.disable,
        reason="FISMO: a distributed step (DDP, FSDP2, HSDP, TP) runs eagerly inside torch.compile: its "
        "collectives are asynchronous, one per bucket, which dynamo does not trace (torch 2.13)",
    )
    def _distributed_step_eagerly(self) -> None:
        """`_step` from a compiled `step` whose matrices live on several ranks: eagerly, eager's numbers.

        Traced, the buckets' asynchronous collectives broke the graph at each bucket, every
        `Placement` built in the trace recompiled its frame per parameter, and under FSDP2 dynamo
        failed (``AssertionError: sources must not be empty for symbol``, a ``DTensor`` shard's
        size made symbolic).
        """
        self._step()

    def _mismatched_gradients_message(self, placements: dict) -> str:
        """What every DDP rank raises when the ranks hold gradients for different FISMO matrices."""
        missing = [
            self._label(p)
            for group in self.param_groups
            if group["algorithm"] == "fismo"
            for p in group["params"]
            if p.grad is None and isinstance(placements.get(p), _dist.ReplicatedPlacement)
        ]
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        return (
            "FISMO: the ranks of the process_group hold gradients for different FISMO matrices, so their "
            "broadcasts of the stepped matrices would not pair up; no rank took the step. DDP gives every "
            "rank the same gradients (with find_unused_parameters=True too): a gradient set or cleared by "
            "hand on some ranks only does this. "
            + (f"Without a gradient on this rank: {shown}" if missing else "This rank has a gradient for every matrix")
        )

    def _forget(self, created: list) -> None:
        """Remove the states a step created before it raised (nothing else was written)."""
        for p in created:
            self.state.pop(p, None)

    def _init_group(self) -> bool:
        """Create the missing states of the local parameters that have a gradient, in every group; whether
        the step is `_distributed` instead (then it creates nothing: the step runs eagerly).

        Called only while ``torch.compile`` traces `step`: dynamo runs an optimizer's
        ``_init_group`` eagerly, at trace time, as for ``torch.optim``'s own optimizers. The
        traced step then starts from existing states (one graph for the first and the later
        steps, not two), and dynamo marks every state tensor a static address, so that CUDA
        graphs (``mode="reduce-overhead"``) may update them in place. One call for all groups:
        dynamo's view of ``self.state`` is taken once, after every state exists.

        Before this call dynamo moves every existing state's ``"step"`` to its parameter's
        device (``OptimizerVariable.move_step_if_cpu``, for ``torch.optim``'s capturable
        path): after eager steps or a resumed checkpoint, a GPU's. The step counts of
        both algorithms stay on the CPU here (`_step_counts_on_the_cpu`).
        """
        self._step_counts_on_the_cpu()
        if self._distributed():  # dynamo hands the answer to the trace as a constant, with its guards
            return True
        warn_of_numpy_scalars(self.param_groups)
        try:
            check_group_settings(self.param_groups)
            check_each_param_once(self.param_groups)
            check_states_fit(self.param_groups, self.state)
            # Keyed by the group's index (as `_step`'s plans): torch 2.11's dynamo cannot trace id() of a dict.
            groups = list(enumerate(self.param_groups))
            cores = {i: self._core_for(g) for i, g in groups if g["algorithm"] == "fismo"}
            for i, g in groups:  # _core_for checks this eagerly only; traced, the core raised, unnamed
                if g["algorithm"] == "fismo":
                    self._check_states_fit(g, cores[i])
            new = {i: self._stateless(g) for i, g in groups}
            for i, g in groups:
                if g["algorithm"] == "fismo":
                    self._check_new_matrices(new[i], cores[i].block_size)
        except (TypeError, ValueError) as exc:
            raise through_dynamo(exc) from exc
        for index, group in groups:
            if group["algorithm"] == "adamw":
                for p in new[index]:
                    init_adamw_state(self.state[p], p, group)
            else:
                core = cores[index]
                for p in new[index]:
                    self._matrix_state(core, p, torch.empty(_fismo.matrix_shape(p.shape), device=p.device))
        return False

    def _step_counts_on_the_cpu(self) -> None:
        """Every state's ``"step"`` back on the CPU, where it is created (no-op when it is there).

        Roots due every ``k`` steps are decided from the step counts without a device read
        (the predicates of `_torch_compile.TracedRootSchedule` stay on the CPU), an eager step
        reads them without waiting for the device, and the AdamW groups' are
        ``torch.optim.AdamW``'s with ``capturable=False``. Runs at trace time only.
        """
        for state in self.state.values():
            step = state.get("step")
            if isinstance(step, torch.Tensor) and step.device != STEP_COUNT_DEVICE:
                state["step"] = step.to(STEP_COUNT_DEVICE)

    def _static_shapes(self) -> None:
        """Trace with the shapes of the parameters, gradients and states as constants (``torch._dynamo.mark_static``).

        An optimizer's shapes never change, but once a second optimizer with other shapes is
        compiled in the same process, dynamo traces `step` with symbolic shapes (its automatic
        dynamic shapes), and inductor cannot compile the ``torch.cond`` of roots recomputed every
        ``k`` steps with them ("A subgraph argument other than striding has been modified",
        torch 2.13). Inside a trace ``mark_static`` specialises each size, with a guard.
        """
        for group in self.param_groups:
            for p in group["params"]:
                for t in (p, p.grad, *self.state.get(p, {}).values()):
                    if isinstance(t, torch.Tensor) and not _dist.is_dtensor(t):
                        torch._dynamo.mark_static(t)

    # ------------------------------------------------------------------ FISMO
    def _core_for(self, group: dict) -> _CoreFISMO:
        """Core instances cached per hyperparameter set (a plain dict, which torch.compile traces; torch 2.11's
        dynamo could not trace ``self.__dict__.setdefault``, the cache's lookup until 2026-12-04: found on an
        H200, where every ``torch.compile(opt.step, fullgraph=True)`` raised ``Unsupported method call``)."""
        cores = self._cores
        try:
            # A value set in the group after construction (a schedule of beta, a typo) is checked here,
            # where its key and its core are made, and the error names the group.
            key = core_key(group)
            if torch.compiler.is_compiling() and not self._step_reads_the_host():
                # Built in the trace from the concrete key: a core cached by an eager call is an object whose
                # float fields dynamo reads symbolically under dynamic=True, and the core's checks of them
                # (math.isfinite) break the one graph. Not where the step reads the host anywhere (another
                # group's policy included): their graph breaks would hand a new core to the next frame, which
                # dynamo cannot rebuild there ("Reconstruction failure": until 2026-12-03 a "propagate" group
                # beside a "raise" AdamW group ran the step eagerly and recompiled its parts at every step).
                return make_core(key)
            if key not in cores:
                core = make_core(key)
                if len(cores) >= _MAX_CORES:  # a schedule of beta, gamma or mu makes one core per value
                    cores.pop(next(iter(cores)))
                cores[key] = core
        except (TypeError, ValueError) as exc:
            # The message, not "{exc}": torch 2.11's dynamo cannot format an exception it traced.
            message = exc.args[0] if len(exc.args) == 1 else str(exc)
            raise type(exc)(f"param group {self._group_index(group)}: {message}") from exc
        if not torch.compiler.is_compiling():
            # The states must fit a block_size set since, and a matrix moved in from another FISMO group:
            # checked once per group, block_size and list of parameters (not at every step of a schedule of
            # beta, which changes the key only).
            checked = self._checked_block_sizes
            index = self._group_index(group)
            layout = (cores[key].block_size, tuple(map(id, group["params"])))
            if checked.get(index) != layout:
                self._check_states_fit(group, cores[key])
                checked[index] = layout
        return cores[key]

    def _step_reads_the_host(self) -> bool:
        """Whether the step reads the device: a group under ``"raise"`` or ``"skip"``, or a FISMO group that
        checks its roots (`guards.checks_roots`: ``fallback``, by default unless ``"propagate"``)."""
        for group in self.param_groups:
            nonfinite = group.get("nonfinite", CORE_DEFAULTS.nonfinite)
            if nonfinite != "propagate":
                return True
            if group["algorithm"] == "fismo":
                inv_root = group["inv_root"]  # a dict once checked (`validate_fismo_hparams`), else as written
                fallback = inv_root.get("fallback") if isinstance(inv_root, dict) else getattr(inv_root, "fallback", None)
                if _guards.checks_roots(fallback, nonfinite):
                    return True
        return False

    def _group_index(self, group: dict) -> int:
        """The position of ``group`` in ``param_groups``."""
        return next(i for i, g in enumerate(self.param_groups) if g is group)

    def _check_states_fit(self, group: dict, core: _CoreFISMO) -> None:
        """The group's existing states have the layout of ``core.block_size`` (a state cannot change its blocks):
        after a change of ``block_size``, or a matrix moved in from a group with another."""
        for p in group["params"]:
            state = self.state.get(p)
            if not state or "M" not in state:  # no state yet
                continue
            # Every rank checks (another rank's matrix by its placeholders' shapes), so all refuse together.
            layout = _fismo.state_layout(*_fismo.matrix_shape(p.shape), core.block_size)
            factors = set(state) - {"step", *COUNTER_KEYS}
            if factors != set(layout) or any(tuple(state[k].shape) != tuple(s) for k, s in layout.items()):
                raise ValueError(
                    f"block_size={core.block_size!r} splits {self._label(p)} into other blocks than its state "
                    "has (the group's block_size changed, or the matrix came from a group with another): a state "
                    "cannot change its blocks; nothing was stepped. Set the group's block_size back, move the "
                    "matrix back, or start its state anew (del opt.state[p])"
                )

    def _placements(self, *, laid_out: bool = True) -> dict[torch.Tensor, _dist.Placement]:
        """Where each FISMO matrix lives and which rank owns it (`_torch_distributed.placements`).

        With ``laid_out``, the states are laid out by the table of the last call: a matrix with a state
        must keep its owner (`_check_owners_kept`). ``load_state_dict`` lays them out anew (``False``).
        """
        fismo_params = (
            (p, group.get("block_size"))
            for group in self.param_groups
            if group["algorithm"] == "fismo"
            for p in group["params"]
        )
        table = _dist.placements(fismo_params, self.process_group, _direction_cost)
        if laid_out:
            self._check_owners_kept(table)
        return table

    def _keep_owners(self, table: dict) -> None:
        """Record the owners the states are now laid out by (no attribute at all in one process, where
        nothing is distributed: a compiled step then writes nothing here)."""
        owners = {p: placement.owner for p, placement in table.items() if placement.distributed}
        if owners or hasattr(self, "_owners"):
            self._owners = owners

    def _check_owners_kept(self, table: dict) -> None:
        """Refuse, on every rank, a table that moves a matrix with a state to another owner.

        Owners are assigned greedily in parameter order by cost, so a matrix inserted before others in
        the groups' ``params``, or a ``block_size`` set on a group, moves the owners after it; a moved
        matrix's state stays on its old owner, and the new one raised alone (the others failed in the
        collectives). Every rank holds the same previous table (``self._owners``), so all refuse together.
        """
        before = getattr(self, "_owners", None)
        if before is None:
            self._keep_owners(table)
            return
        owners = {p: placement.owner for p, placement in table.items() if placement.distributed}
        moved = [p for p, owner in owners.items()
                 if p in before and before[p] != owner and self.state.get(p, {}).get("M") is not None]
        if moved:
            more = f" and {len(moved) - 1} more" if len(moved) > 1 else ""
            raise ValueError(
                f"{self._label(moved[0])}{more} would move to another owner rank (from {before[moved[0]]} to "
                f"{owners[moved[0]]}), and its state lives on its owner: a matrix was inserted before it in the "
                "groups' params, or a group's block_size changed (owners follow parameter order and cost). "
                "Nothing was stepped. Add matrices after the existing ones (add_param_group, or the end of the "
                "last FISMO group) and set block_size before a group's first step"
            )
        self._owners = owners

    def _roots_due_read_on_the_host(self) -> dict[int, bool]:
        """Whether each matrix's roots are due this step (``InverseRootConfig(every=k)``, ``k > 1``), by ``id``,
        where the step count is read on the host: eagerly, and compiled where the roots are checked (a root's
        repair reads the device; compiled without checks, the graph decides: `_torch_compile.TracedRootSchedule`).

        One read of every such step count (CPU tensors), before `_step`'s try block: compiled, the read
        is a graph break, and dynamo resumes one only outside a try block; inside it (one read per
        matrix, until 2026-12-03) dynamo ran the whole step eagerly and compiled its parts, guarding on
        each gradient, so that with AdamW groups every step compiled again, up to dynamo's recompile
        limit (``FISMO.training``'s default configuration; a user's hunt).
        """
        counted: list[tuple[torch.Tensor, _CoreFISMO]] = []
        for group in self.param_groups:
            if group["algorithm"] != "fismo":
                continue
            core = self._core_for(group)
            if core.inv_root.every == 1 or (
                    torch.compiler.is_compiling() and not _guards.checks_roots(core.inv_root.fallback, core.nonfinite)):
                continue
            counted.extend((p, core) for p in group["params"] if p.grad is not None)
        if not counted:
            return {}
        steps = [self.state.get(p, {}).get("step", 0) for p, _ in counted]
        # CPU tensors (`as_tensor` copies none of them), 0 without a state.
        read = iter(torch.stack([torch.as_tensor(s, device=STEP_COUNT_DEVICE) for s in steps]).tolist())
        return {id(p): core.inv_root.is_refresh_step(int(next(read))) for p, core in counted}

    def _fismo_compute(
        self, group: dict, placements: dict, skip: Union[set, frozenset], created: list, roots_due: dict[int, bool]
    ) -> "_GroupStep":
        """Lines 4-8 for one group, nothing written: gather the gradients to their owners, and the owners' core calls.

        The initial states it creates are the only change; their parameters are appended to ``created``
        first, so that the step can remove them again if it raises. ``roots_due``: `_roots_due_read_on_the_host`."""
        core = self._core_for(group)
        plan = _GroupStep(group, core)
        if not torch.compiler.is_compiling():  # compiled, _init_group checked the local ones at trace time
            self._check_new_matrices(self._stateless(group), core.block_size)
        for p in group["params"]:
            if p.grad is None:
                continue
            if id(p) in skip:  # nonfinite="skip": p does not step (its skip is counted in _fismo_apply)
                plan.skipped.append((p, placements[p]))
                continue
            plan.stepping.append((p, placements[p]))
        for p, placement in plan.stepping:  # matrices whose collectives travel together
            plan.exchanges.setdefault(placement.exchange_key(p), []).append((p, placement))

        # 1. Gather: the full gradient of each matrix reaches its owner.
        gathers = [bucket[0][1].start_gather(bucket) for bucket in plan.exchanges.values()]
        mine = []
        for work, finish in gathers:
            if work is not None:
                work.wait()
            mine.extend(finish().items())

        # 2. Compute: the owners' directions, same-shape matrices in one batched core call, flags unread.
        buckets: dict[tuple, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        for p, grad in mine:
            m, n = _fismo.matrix_shape(p.shape)
            G = grad.reshape(m, n)
            # InverseRootConfig.every: whether this parameter's roots are due, from its own step count.
            # With every == 1 (the default) they always are: no read of the step count. Otherwise the
            # count was read on the host (`_roots_due_read_on_the_host`), or, compiled without root
            # checks, the decision stays on the device (None: _torch_compile.TracedRootSchedule).
            refresh: Union[bool, None, TracedRootSchedule]
            if core.inv_root.every == 1:
                refresh = True
            else:
                refresh = roots_due.get(id(p))
            buckets.setdefault((m, n, p.dtype, G.device, refresh), []).append((p, G))
        for (m, n, *_, refresh), bucket in buckets.items():
            created.extend(p for p, _ in bucket if not self.state.get(p))
            states = [self._matrix_state(core, p, G) for p, G in bucket]
            G_stack = bucket[0][1][None] if len(bucket) == 1 else torch.stack([G for _, G in bucket])
            stacked = pack(core, states, m, n)
            # Algorithm 1, lines 4-8, for the whole bucket. The core's step count is
            # not used by the algorithm; each parameter keeps its own in state["step"].
            if refresh is None:
                due = core.inv_root.is_refresh_step(torch.stack([s["step"] for s in states]))
                refresh = TracedRootSchedule.of(due, G_stack.device, G_stack.dtype)
            result = core.direction_with_faults(G_stack, stacked, refresh_roots=refresh)
            plan.calls.append(_CoreCall([p for p, _ in bucket], states, G_stack, stacked, refresh, result))
        return plan

    def _settle(self, checks: Any, plans: dict) -> None:
        """A flag was set: raise for a non-finite gradient, or repair (or refuse) failed inverse roots.

        Nothing has been written yet, so an error leaves every parameter and state as it was (`step`
        removes the states it created).
        """
        raise_nonfinite(self.param_groups, checks)
        for plan in plans.values():
            for k, call in enumerate(plan.calls):
                if call.result.faults.roots is None:
                    continue
                try:
                    D, new = plan.core.settle(call.G, call.stacked, call.result, refresh_roots=call.refresh)
                except InverseRootError as exc:
                    names = ", ".join(self._label(call.params[i]) for i in exc.indices)
                    raise InverseRootError(f"{exc}. The failing parameters: {names}", exc.indices) from exc
                plan.calls[k] = call._replace(result=call.result._replace(direction=D, state=new))

    def _fismo_apply(self, plan: "_GroupStep") -> None:
        """Write the group's new states, then line 9 on each rank's data and the placements' synchronisation."""
        core, group = plan.core, plan.group
        for p, placement in plan.skipped:  # the rank keeping the state counts the skip
            if placement.owns:
                dev = _dist.local_device(p)
                self._matrix_state(core, p, torch.empty(_fismo.matrix_shape(p.shape), device=dev))["skipped"] += 1
            else:
                keep_elsewhere(self.state[p], p, core.block_size)
        directions: dict[torch.Tensor, torch.Tensor] = {}
        for call in plan.calls:
            m, n = call.G.shape[-2:]
            unpack(core, call.states, call.stacked, call.result.state, m, n)
            torch._foreach_add_([state["step"] for state in call.states], 1)
            directions.update(zip(call.params, call.result.direction.unbind(0)))
        for p, placement in plan.stepping:  # every rank counts the steps of every matrix (checkpoints need it)
            if not placement.owns:
                keep_elsewhere(self.state[p], p, core.block_size)["step"] += 1

        # 3. Apply: line 9, W <- (1 - lr * weight_decay) W - lr' * dW, on each rank's data, then synchronise.
        lr = group["lr"]  # a float, or a one-element tensor (kept a tensor: schedulers may change it under torch.compile)
        if isinstance(lr, torch.Tensor):
            # 0-d: a (1,)-shaped float64 lr took part in type promotion, and a float32 parameter's weight decay
            # was computed in float64 (3.6e-7 from the float lr's parameters after 5 steps; a user's hunt).
            lr = lr.reshape(())
        updates = {}
        for p, _ in plan.stepping:
            step_lr = adjusted_lr(lr, group["adjust_lr_fn"], *_fismo.matrix_shape(p.shape))
            updates[p] = functools.partial(_apply, lr=lr, step_lr=step_lr, weight_decay=group["weight_decay"])
        applies = [bucket[0][1].start_apply(bucket, directions, updates) for bucket in plan.exchanges.values()]
        for work, finish in applies:
            if work is not None:
                work.wait()
            finish()

    def _stateless(self, group: dict) -> list:
        """The parameters of ``group`` that have a gradient and no state yet: this step creates theirs."""
        return [p for p in group["params"] if p.grad is not None and not self.state.get(p)]

    def _check_new_matrices(self, params: list, block_size: Optional[int]) -> None:
        """FISMO parameters about to get a state, checked as `add_param_group` checks them, and the size of
        their factors (`FactorSizeWarning`).

        A tensor appended to a group's ``params`` list skipped that check; unchecked, a
        vector or a self-overlapping tensor raised deep in the step without its name. The size
        is checked here, on every rank and before any collective, not by the core on the matrix's
        owner: a warning turned into an error (``-W error``) stopped the owner alone, and the other
        ranks failed in the collectives."""
        for p in params:
            validate_matrix_param(p, self._label(p, shape=False))  # its messages state the shape
            _guards.check_factor_size(*_fismo.matrix_shape(p.shape), block_size, self._label(p))

    def _check_step_sizes(self) -> None:
        """Refuse a float ``lr`` whose step size (`adjusted_lr`) is beyond the largest number of a matrix's
        state dtype, before anything changes: line 9's ``add_`` could not convert it and raised torch's
        "value cannot be converted to type float without overflow" after the groups before had stepped
        (a user's hunt). A tensor ``lr`` is not read (no host read): it makes the step infinite."""
        for gi, group in enumerate(self.param_groups):
            lr = group["lr"]  # a tensor is not read; a string or None is refused by name in _core_for
            if group["algorithm"] != "fismo" or isinstance(lr, (torch.Tensor, bool)) or not isinstance(lr, numbers.Real):
                continue
            # adjust_lr_fn multiplies by sqrt(m / n) or 0.2 sqrt(max(m, n)), below 2**32 for any tensor; the
            # smallest state dtype is float32: a usual lr needs no look at each matrix (48 of them took 82 us).
            if abs(group["lr"]) * 2.0 ** 32 <= torch.finfo(torch.float32).max:
                continue
            for i, p in enumerate(group["params"]):
                if p.grad is None or p.ndim < 2 or p.numel() == 0:  # not a matrix: refused by name later
                    continue
                rate = adjusted_lr(group["lr"], group["adjust_lr_fn"], *_fismo.matrix_shape(p.shape))
                largest = torch.finfo(state_dtype(p.dtype)).max
                if abs(rate) > largest:
                    raise ValueError(
                        f"{param_name(group, i, gi)}: lr={group['lr']!r} (adjust_lr_fn={group['adjust_lr_fn']!r}) "
                        f"makes its step size {rate:.3g}, beyond the largest {state_dtype(p.dtype)} "
                        f"({largest:.3g}) its update is computed in; nothing was stepped"
                    )

    def _label(self, p: torch.Tensor, *, shape: bool = True) -> str:
        """How error messages name parameter ``p`` (`param_name`)."""
        for gi, group in enumerate(self.param_groups):
            for i, q in enumerate(group["params"]):
                if q is p:
                    return param_name(group, i, gi, shape=shape)
        return f"a parameter of shape {tuple(p.shape)}"

    def _matrix_state(self, core: _CoreFISMO, p: torch.Tensor, G: torch.Tensor) -> dict:
        state = self.state[p]
        # The label (a scan of the groups) only when the state is created: the core's errors name the parameter.
        return init_matrix_state(core, state, G, p.dtype, name="W" if state else self._label(p))


class _CoreCall(NamedTuple):
    """One batched core call of a step: its matrices, their states (per parameter and stacked), ``G`` and result."""

    params: list
    states: list
    G: torch.Tensor
    stacked: Any
    refresh: Any  # bool, or the TracedRootSchedule of a compiled step
    result: Any  # fismo_core.StepResult: direction, new state, fault flags (unread)


@dataclasses.dataclass
class _GroupStep:
    """A FISMO group's step between computing and writing: what `FISMO._fismo_apply` writes."""

    group: dict
    core: _CoreFISMO
    stepping: list = dataclasses.field(default_factory=list)  # (p, placement) that step
    skipped: list = dataclasses.field(default_factory=list)  # (p, placement) skipped (nonfinite="skip")
    exchanges: dict = dataclasses.field(default_factory=dict)  # exchange key -> [(p, placement)]
    calls: list = dataclasses.field(default_factory=list)  # _CoreCall of the matrices this rank owns


def _direction_cost(p: torch.Tensor, block_size: Optional[int]) -> float:
    """The cost model of owner assignment: ``d^3`` per full side, ``k B^3 + r^3`` per blocked one, plus the polar factor."""
    m, n = _fismo.matrix_shape(p.shape)

    def side(d: int) -> float:
        return sum(float(math.prod(s[:-2])) * float(s[-1]) ** 3 for s in factor_structure(d, block_size).part_shapes())

    return side(m) + side(n) + float(m) * n * min(m, n)


# ---------------------------------------------------------------- line 9
def _apply(p: torch.Tensor, direction: torch.Tensor, lr: Union[float, torch.Tensor], step_lr: Union[float, torch.Tensor],
           weight_decay: float) -> None:
    """Line 9 in place by the core's rule, `line_9_factors`: ``p <- (1 - decay) p - rate dW``.

    ``decay = lr * weight_decay`` with the group's unadjusted lr, ``rate = step_lr``. ``dW`` stays in the
    state's precision until this one rounding to ``p``'s dtype (``add_`` with ``alpha``, as ``torch.optim.Muon``;
    compiled, and with a tensor lr, ``addcmul``, the same fused multiply-add).
    """
    decay, rate = _fismo.line_9_factors(lr, weight_decay, step_lr)
    if weight_decay:
        p.mul_(1 - decay)
    dW = direction.reshape(p.shape)
    if isinstance(rate, torch.Tensor) or torch.compiler.is_compiling():
        # A tensor lr stays on the device: no host read, no recompile when it changes. A float lr that changes
        # between compiled calls (a scheduler's) is made symbolic by dynamo, and inductor (torch 2.13) then kept a
        # stale value of it as add_'s alpha when the weight decay above used it too: silently wrong steps,
        # torch.optim.Muon's too (docs/torch.md); as a tensor it is an input of the graph. addcmul is add_'s one
        # fused multiply-add, so either gives the float lr's eager bits; out of place, since dynamo rewrites an
        # in-place addcmul_ into two roundings.
        rate = rate.to(dW.dtype) if isinstance(rate, torch.Tensor) else dW.new_ones(()) * rate
        p.copy_(torch.addcmul(p, dW, rate, value=-1))
    else:
        p.add_(dW, alpha=-rate)
