"""The optimizers compared by ``fismo demo``, each built the way its users run it.

- **FISMO** and **FISMO-SI** (the opt-in ``statistics="scale_invariant"``
  variant): [`fismo_core.backends.torch.FISMO`][fismo_core.backends.torch.FISMO]
  on the hidden matrices, AdamW (its ``"adamw"`` groups) on biases, norm
  scales, embeddings and the output head; the split is
  [`param_groups`][fismo_core.backends.torch.param_groups].
- **Muon**: ``torch.optim.Muon`` on the same matrices, ``torch.optim.AdamW``
  on the same rest. Two variants are run only for the condition-number
  figure: ``Muon-NS7``, Muon with 7 Newton–Schulz steps instead of 5, and
  ``Muon-fp32``, FISMO with ``gamma = 1`` (``P = Q = I`` for ever), which is
  Muon with its Newton–Schulz iteration in float32 instead of
  ``torch.optim.Muon``'s bfloat16.
- **FISMO controls**, run at the selected learning rate of the FISMO
  variant they modify, with every seed: ``FISMO-B<B>`` and ``FISMO-SI-B<B>``
  (block-diagonal factors, ``block_size=B``; the question "does blocking
  cost anything?") and ``FISMO-bf16`` (the Newton–Schulz iteration of line 8
  in bfloat16, ``polar={"dtype": "bfloat16"}``, as ``torch.optim.Muon`` runs
  it).
- **AdamW**, **SGD** (momentum 0.9) and **SOAP** (``pytorch_optimizer.SOAP``,
  a Shampoo-family method, if the package is installed) on every parameter.

FISMO and Muon are configured identically apart from the preconditioner:
EMA momentum 0.95 without Nesterov (Algorithm 1 has none, so Muon's
``nesterov`` is switched off to match), the same Newton–Schulz quintic and
step count, the same shape-dependent learning rate (``adjust_lr_fn="original"``,
``lr * sqrt(max(1, m/n))``), and the same AdamW settings for the rest. No
optimizer uses weight decay: the runs are short and the comparison is about
the step direction.
"""

from __future__ import annotations

import importlib.util
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from fismo_core.backends.torch import FISMO, param_groups

__all__ = [
    "ALL_OPTIMIZERS",
    "CONDITION_OPTIMIZERS",
    "MUON_CONTROLS",
    "BuiltOptimizer",
    "build_optimizer",
    "control_base",
    "fismo_controls",
    "soap_available",
]

#: Every optimizer the demo can compare, in table order.
ALL_OPTIMIZERS: tuple[str, ...] = ("FISMO", "FISMO-SI", "Muon", "AdamW", "SGD", "SOAP")

#: Muon variants run once, at Muon's selected learning rate, for the condition-number figure.
MUON_CONTROLS: tuple[str, ...] = ("Muon-NS7", "Muon-fp32")

#: A FISMO control's name: the base variant, an optional block size, an optional polar dtype.
_FISMO_NAME = re.compile(r"^(?P<base>FISMO(?:-SI)?)(?:-B(?P<block>[1-9][0-9]*))?(?P<bf16>-bf16)?$")


def fismo_controls(block_sizes: tuple[int, ...], bf16: bool = True) -> tuple[str, ...]:
    """The FISMO controls of a task: ``FISMO-B<B>`` and ``FISMO-SI-B<B>`` per block size, then ``FISMO-bf16``."""
    names = [f"{base}-B{b}" for b in block_sizes for base in ("FISMO", "FISMO-SI")]
    return (*names, *(("FISMO-bf16",) if bf16 else ()))


def control_base(name: str) -> str:
    """The optimizer whose selected learning rate a control runs at (``"Muon"`` for Muon's controls)."""
    if name in MUON_CONTROLS:
        return "Muon"
    match = _FISMO_NAME.match(name)
    if match is None or name in ALL_OPTIMIZERS:
        raise ValueError(f"{name!r} is not a control")
    return match["base"]


#: The optimizers in the condition-number figure (the paper's Figure "con_num", the variant, the controls).
CONDITION_OPTIMIZERS: tuple[str, ...] = ("FISMO", "FISMO-SI", "FISMO-bf16", "AdamW", "Muon", *MUON_CONTROLS)

#: Shared by FISMO and Muon: EMA momentum without Nesterov, Muon's shape-dependent lr.
MOMENTUM = 0.95
ADJUST_LR_FN = "original"


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
    control (``FISMO-B32``, ``FISMO-SI-B32``, ``FISMO-bf16``, see
    [`fismo_controls`][fismo_core.demo.optimizers.fismo_controls]).
    """
    adamw_options = {"lr": adamw_lr, "weight_decay": 0.0}
    groups = param_groups(model, adamw=_is_head, adamw_options=adamw_options)
    matrices = list(groups[0]["params"])
    rest = list(groups[1]["params"]) if len(groups) > 1 else []
    everything = [p for p in model.parameters() if p.requires_grad]
    fismo_name = _FISMO_NAME.match(name)
    if fismo_name is not None or name == "Muon-fp32":
        options: dict = {}
        if name == "Muon-fp32":
            options["gamma"] = 1.0  # P = Q = I: Muon, Newton-Schulz in float32
        else:
            assert fismo_name is not None
            if fismo_name["base"] == "FISMO-SI":
                options["statistics"] = "scale_invariant"
            if fismo_name["block"]:
                options["block_size"] = int(fismo_name["block"])
            if fismo_name["bf16"]:
                options["polar"] = {"dtype": "bfloat16"}
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
        "(FISMO-B<block size>, FISMO-SI-B<block size>, FISMO-bf16)"
    )
