"""The optimizers compared by ``fismo demo``, each built the way its users run it.

- **FISMO** and **FISMO-SI** (the opt-in ``statistics="scale_invariant"``
  variant): [`fismo_core.backends.torch.FISMO`][fismo_core.backends.torch.FISMO]
  on the hidden matrices, AdamW (its ``"adamw"`` groups) on biases, norm
  scales, embeddings and the output head; the split is
  [`param_groups`][fismo_core.backends.torch.param_groups].
- **Muon**: ``torch.optim.Muon`` on the same matrices, ``torch.optim.AdamW``
  on the same rest, configured as FISMO (below): with FISMO it is the printed
  algorithm's Muon-equivalence check. Two variants are run only for the
  condition-number figure: ``Muon-NS7``, Muon with 7 Newton–Schulz steps
  instead of 5, and ``Muon-fp32``, FISMO with ``gamma = 1`` (``P = Q = I``
  for ever), which is Muon with its Newton–Schulz iteration in float32
  instead of ``torch.optim.Muon``'s bfloat16.
- **FISMO-T** and **Muon-torch**, the comparison a torch user makes:
  ``FISMO.training(groups, lr=lr)`` (the training configuration: scale-invariant
  statistics, Nesterov, weight decay 0.1, damping 0.1, roots every 10 steps,
  Muon's learning-rate adjustment, Newton–Schulz and the preconditioners'
  products in bfloat16 where the CPU has bfloat16 instructions, float32
  elsewhere) against
  ``torch.optim.Muon(matrices, lr=lr)``, both at ``torch.optim.Muon``'s
  defaults for everything but the learning rate, with the same AdamW on the
  rest as above.
- **FISMO controls**, run at the selected learning rate of the FISMO
  variant they modify, with every seed, each differing from it in one
  setting: ``FISMO-B<B>``, ``FISMO-SI-B<B>`` and ``FISMO-T-B<B>``
  (block-diagonal factors, ``block_size=B``; the question "does blocking
  cost anything?"), ``FISMO-bf16`` (the Newton–Schulz iteration of line 8
  in bfloat16, ``polar={"dtype": "bfloat16"}``, as ``torch.optim.Muon`` runs
  it), and the ablations of FISMO-T: ``FISMO-T-printed`` (the printed
  statistics), ``FISMO-T-no-nesterov``, ``FISMO-T-no-wd`` (weight decay 0),
  ``FISMO-T-every1`` (the inverse roots recomputed at every step),
  ``FISMO-T-mu1e-3`` (the printed damping) and ``FISMO-T-fp32mm`` (the
  preconditioners' products in float32).
- **AdamW**, **SGD** (momentum 0.9) and **SOAP** (``pytorch_optimizer.SOAP``,
  a Shampoo-family method, if the package is installed) on every parameter.

The one naming rule of FISMO runs: ``<base>[-B<B>][-<modifier>]``, where the
base is ``FISMO``, ``FISMO-SI`` or ``FISMO-T``, ``-B<B>`` sets
``block_size=B``, and the modifier is one of the table ``_MODIFIERS``
(``bf16`` for the printed bases; ``printed``, ``no-nesterov``, ``no-wd``,
``every1``, ``mu1e-3``, ``fp32mm`` for FISMO-T, and ``every2``, ``every5``,
``mu1e-2`` for ``docs/scripts/root_staleness.py``), each one setting
changed. Modifiers that change different settings join with ``-``:
``FISMO-T-mu1e-3-fp32mm`` is FISMO-T with both (the configuration before
its damping and products changed, the scaling study's ``--candidate``).

FISMO and Muon are configured identically apart from the preconditioner:
EMA momentum 0.95 without Nesterov (Algorithm 1 has none, so Muon's
``nesterov`` is switched off to match), the same Newton–Schulz quintic and
step count, the same shape-dependent learning rate (``adjust_lr_fn="original"``,
``lr * sqrt(max(1, m/n))``), and the same AdamW settings for the rest. Only
FISMO-T and Muon-torch (and FISMO-T's controls) use weight decay, 0.1 on the
hidden matrices, as ``torch.optim.Muon``'s default; the AdamW part never does.
"""

from __future__ import annotations

import copy
import importlib.util
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Final, Optional

import torch
from torch import nn

from fismo_core.backends.torch import FISMO, param_groups

__all__ = [
    "ALL_OPTIMIZERS",
    "CONDITION_OPTIMIZERS",
    "MUON_CONTROLS",
    "TRAINING_ABLATIONS",
    "BuiltOptimizer",
    "build_optimizer",
    "control_base",
    "control_change",
    "fismo_controls",
    "fismo_settings",
    "soap_available",
]

#: Every optimizer the demo can compare, in table order.
ALL_OPTIMIZERS: tuple[str, ...] = ("FISMO", "FISMO-SI", "FISMO-T", "Muon", "Muon-torch", "AdamW", "SGD", "SOAP")

#: Muon variants run once, at Muon's selected learning rate, for the condition-number figure.
MUON_CONTROLS: tuple[str, ...] = ("Muon-NS7", "Muon-fp32")

#: A FISMO run's name: ``<base>[-B<B>][-<modifier>]`` (the module's docstring).
_FISMO_NAME = re.compile(r"^(?P<base>FISMO(?:-SI|-T)?)(?:-B(?P<block>[1-9][0-9]*))?(?:-(?P<modifier>[a-z0-9-]+))?$")

#: The modifiers of a FISMO name: the bases each applies to, and the one setting it changes.
_MODIFIERS: dict[str, tuple[tuple[str, ...], dict]] = {
    "bf16": (("FISMO", "FISMO-SI"), {"polar": {"dtype": "bfloat16"}}),
    "printed": (("FISMO-T",), {"statistics": "printed"}),
    "no-nesterov": (("FISMO-T",), {"nesterov": False}),
    "no-wd": (("FISMO-T",), {"weight_decay": 0.0}),
    "every1": (("FISMO-T",), {"inv_root": {"every": 1}}),
    "mu1e-3": (("FISMO-T",), {"mu": 1e-3}),
    "fp32mm": (("FISMO-T",), {"inv_root": {"matmul_dtype": "float32"}}),
    # The staleness study's controls (docs/scripts/root_staleness.py), not run by the demo.
    "every2": (("FISMO-T",), {"inv_root": {"every": 2}}),
    "every5": (("FISMO-T",), {"inv_root": {"every": 5}}),
    "mu1e-2": (("FISMO-T",), {"mu": 1e-2}),
}

#: The ablations of FISMO-T run on the text task, each one setting of the training configuration undone.
TRAINING_ABLATIONS: tuple[str, ...] = ("FISMO-T-printed", "FISMO-T-no-nesterov", "FISMO-T-no-wd", "FISMO-T-every1",
                                       "FISMO-T-mu1e-3", "FISMO-T-fp32mm")


def _parse_fismo(name: str) -> Optional[tuple[str, dict]]:
    """``(base, options)`` of a FISMO run's name (options on top of its base's), or None if it is not one."""
    match = _FISMO_NAME.match(name)
    if match is None:
        return None
    base, options = match["base"], {}
    if match["block"]:
        options["block_size"] = int(match["block"])
    if match["modifier"] is not None:
        settings = _modifier_chain(match["modifier"], base)
        if settings is None:
            return None
        for setting in settings:
            for key, value in setting.items():
                old = options.get(key)
                if isinstance(old, dict) and isinstance(value, dict) and not old.keys() & value.keys():
                    options[key] = {**old, **copy.deepcopy(value)}  # two fields of one config
                elif key in options:
                    return None  # two modifiers that change the same setting
                else:
                    options[key] = copy.deepcopy(value)  # the table's dicts stay as they are
    return base, options


def _modifier_chain(text: str, base: str) -> Optional[list[dict]]:
    """The settings of ``text``, one modifier of ``base`` or several joined by ``-``; None if it is neither.

    ``every1-fp32mm`` is ``every1`` then ``fp32mm``; modifiers hold hyphens themselves (``no-wd``,
    ``mu1e-3``), so each split is tried.
    """
    for modifier, (bases, setting) in _MODIFIERS.items():
        if base not in bases:
            continue
        if text == modifier:
            return [setting]
        if text.startswith(modifier + "-"):
            rest = _modifier_chain(text[len(modifier) + 1:], base)
            if rest is not None:
                return [setting, *rest]
    return None


def fismo_controls(
    block_sizes: tuple[int, ...], bf16: bool = True, ablations: bool = False, training_blocks: tuple[int, ...] = ()
) -> tuple[str, ...]:
    """The FISMO controls of a task, in table order.

    ``FISMO-B<B>`` and ``FISMO-SI-B<B>`` per block size of ``block_sizes``,
    ``FISMO-T-B<B>`` per block size of ``training_blocks``, then
    ``FISMO-bf16`` (if ``bf16``), then FISMO-T's ablations
    [`TRAINING_ABLATIONS`][fismo_core.demo.optimizers.TRAINING_ABLATIONS]
    (if ``ablations``).
    """
    names = [f"{base}-B{b}" for b in block_sizes for base in ("FISMO", "FISMO-SI")]
    names += [f"FISMO-T-B{b}" for b in training_blocks]
    return (*names, *(("FISMO-bf16",) if bf16 else ()), *(TRAINING_ABLATIONS if ablations else ()))


def control_change(name: str) -> dict:
    """The settings a FISMO control changes on its base (``FISMO-T-no-wd`` -> ``{"weight_decay": 0.0}``)."""
    parsed = _parse_fismo(name)
    if parsed is None or name in ALL_OPTIMIZERS:
        raise ValueError(f"{name!r} is not a FISMO control")
    return parsed[1]


def control_base(name: str) -> str:
    """The optimizer whose selected learning rate a control runs at (``"Muon"`` for Muon's controls)."""
    if name in MUON_CONTROLS:
        return "Muon"
    parsed = _parse_fismo(name)
    if parsed is None or name in ALL_OPTIMIZERS:
        raise ValueError(f"{name!r} is not a control")
    return parsed[0]


def fismo_settings(name: str) -> Optional[dict]:
    """The hyperparameters of FISMO run ``name`` (its matrix group as built, without params and lr), or None.

    None for a run that is not FISMO's. What a recorded run must match to stand for ``name`` again: a
    name keeps its meaning only while the defaults behind it (``TRAINING``, the adapter's) stay the same.
    """
    if _parse_fismo(name) is None and name != "Muon-fp32":
        return None
    stand_in = nn.Sequential(nn.Linear(2, 2, bias=False), nn.Linear(2, 2, bias=False))  # a matrix and a head
    group = build_optimizer(name, stand_in, 1.0, 1.0).optimizers[0].param_groups[0]
    return {key: value for key, value in group.items() if key not in ("params", "lr")}


#: The optimizers in the condition-number figure (the paper's Figure "con_num", the variants, the controls).
CONDITION_OPTIMIZERS: tuple[str, ...] = ("FISMO", "FISMO-SI", "FISMO-T", "FISMO-bf16", "AdamW", "Muon", "Muon-torch",
                                         *MUON_CONTROLS)

#: Shared by FISMO and Muon: EMA momentum without Nesterov, Muon's shape-dependent lr.
MOMENTUM = 0.95
ADJUST_LR_FN: Final = "original"


def soap_available() -> bool:
    """Whether ``pytorch_optimizer`` (which provides SOAP) is installed."""
    return importlib.util.find_spec("pytorch_optimizer") is not None


@dataclass
class BuiltOptimizer:
    """The torch optimizers of one run, stepped together, and what the demo measures.

    Attributes
    ----------
    optimizers:
        One optimizer, or a matrix optimizer and an AdamW for the rest.
    matrices:
        The hidden matrices (every 2-D weight but embeddings and the head):
        the parameters whose update's condition number is measured. The same
        set for every optimizer.
    fismo:
        The FISMO optimizer whose ``state[p]`` holds ``P`` and ``Q``, for FISMO runs.
    """

    optimizers: list[torch.optim.Optimizer]
    matrices: list[nn.Parameter]
    fismo: Optional[FISMO] = None

    def zero_grad(self) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)

    def step(self) -> None:
        for opt in self.optimizers:
            opt.step()

    def __iter__(self) -> Iterator[torch.optim.Optimizer]:
        return iter(self.optimizers)


def _is_head(name: str, _p: nn.Parameter) -> bool:
    return name.split(".")[0] == "head"


def build_optimizer(name: str, model: nn.Module, lr: float, adamw_lr: float) -> BuiltOptimizer:
    """Optimizers for ``model``: ``lr`` for the optimizer ``name``, ``adamw_lr`` for the AdamW part of FISMO and Muon.

    ``name`` is one of [`ALL_OPTIMIZERS`][fismo_core.demo.optimizers.ALL_OPTIMIZERS],
    [`MUON_CONTROLS`][fismo_core.demo.optimizers.MUON_CONTROLS] or a FISMO
    control (``FISMO-B32``, ``FISMO-SI-B32``, ``FISMO-T-B32``, ``FISMO-bf16``,
    ``FISMO-T-no-wd``, ...: the naming rule of the module's docstring, see
    [`fismo_controls`][fismo_core.demo.optimizers.fismo_controls]).
    """
    adamw_options = {"lr": adamw_lr, "weight_decay": 0.0}
    groups = param_groups(model, adamw=_is_head, adamw_options=adamw_options)
    matrices = list(groups[0]["params"])
    rest = list(groups[1]["params"]) if len(groups) > 1 else []
    everything = [p for p in model.parameters() if p.requires_grad]
    fismo_name = _parse_fismo(name)
    if fismo_name is not None and fismo_name[0] == "FISMO-T":
        # torch.optim.Muon's signature and defaults: only the learning rate (and the control's one setting) given
        opt = FISMO.training(groups, lr=lr, **fismo_name[1])
        return BuiltOptimizer([opt], matrices, fismo=opt)
    if fismo_name is not None or name == "Muon-fp32":
        options: dict = {"gamma": 1.0} if name == "Muon-fp32" else {}  # gamma = 1: P = Q = I, Muon in float32
        if fismo_name is not None:
            base, options = fismo_name
            if base == "FISMO-SI":
                options["statistics"] = "scale_invariant"
        opt = FISMO(groups, lr=lr, beta=MOMENTUM, nesterov=False, adjust_lr_fn=ADJUST_LR_FN, **options)
        return BuiltOptimizer([opt], matrices, fismo=None if name == "Muon-fp32" else opt)
    if name in ("Muon", "Muon-NS7"):
        muon = torch.optim.Muon(
            matrices,
            lr=lr,
            weight_decay=0.0,
            momentum=MOMENTUM,
            nesterov=False,
            ns_steps=7 if name == "Muon-NS7" else 5,
            adjust_lr_fn=ADJUST_LR_FN,
        )
        return BuiltOptimizer([muon, torch.optim.AdamW(rest, lr=adamw_lr, weight_decay=0.0)], matrices)
    if name == "Muon-torch":  # torch's own defaults (Nesterov, weight decay 0.1, adjust_lr_fn None) but the lr
        muon = torch.optim.Muon(matrices, lr=lr)
        return BuiltOptimizer([muon, torch.optim.AdamW(rest, lr=adamw_lr, weight_decay=0.0)], matrices)
    if name == "AdamW":
        return BuiltOptimizer([torch.optim.AdamW(everything, lr=lr, weight_decay=0.0)], matrices)
    if name == "SGD":
        return BuiltOptimizer([torch.optim.SGD(everything, lr=lr, momentum=0.9)], matrices)
    if name == "SOAP":
        if not soap_available():
            raise ModuleNotFoundError("SOAP needs the package pytorch-optimizer: pip install pytorch-optimizer")
        from pytorch_optimizer import SOAP

        return BuiltOptimizer([SOAP(everything, lr=lr, weight_decay=0.0)], matrices)
    raise ValueError(
        f"unknown optimizer {name!r}; choose from {ALL_OPTIMIZERS + MUON_CONTROLS} or a FISMO control "
        "(<FISMO, FISMO-SI or FISMO-T>[-B<block size>][-<modifier>...], modifiers: "
        + ", ".join(f"{m} (for {', '.join(bases)})" for m, (bases, _) in _MODIFIERS.items()) + ")"
    )
