"""A float learning rate that a scheduler changes between compiled optimizer steps (docs/torch.md, "Schedulers").

Trains a two-layer float64 MLP for 6 steps with ``torch.compile`` (inductor) around ``opt.step(); sched.step()``
and an eager twin, with weight decay 0.1, for FISMO and ``torch.optim.Muon``, under a ``LambdaLR`` schedule
``1 / (1 + s)`` and under a constant one, and prints the largest parameter difference from the eager twin after
each step. Muon's bfloat16 Newton-Schulz iteration makes its compiled and eager runs differ a little anyway; the
constant schedule shows that noise. With torch 2.13 the scheduled Muon drifts well beyond it (inductor keeps a
stale value of the float lr); FISMO's line 9 takes a compiled float lr as a tensor and stays at rounding level.

    python docs/scripts/compiled_lr_schedule.py     # about 30 seconds on 2 CPU cores
"""
from __future__ import annotations

import argparse
import copy

import torch

from fismo_core.backends.torch import FISMO


def drift(make_optimizer, scheduled: bool, steps: int = 6) -> list[float]:
    """Max |compiled - eager| over the parameters after each step."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 24, bias=False), torch.nn.Tanh(), torch.nn.Linear(24, 5, bias=False)
    ).double()
    twin = copy.deepcopy(model)
    factor = (lambda s: 1.0 / (1 + s)) if scheduled else (lambda s: 1.0)
    opt, eager_opt = make_optimizer(model), make_optimizer(twin)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
    eager_sched = torch.optim.lr_scheduler.LambdaLR(eager_opt, factor)

    @torch.compile
    def step() -> None:
        opt.step()
        sched.step()

    gen = torch.Generator().manual_seed(1)
    out = []
    for _ in range(steps):
        x = torch.randn(32, 16, generator=gen, dtype=torch.float64)
        for m, o, s in ((model, opt, step), (twin, eager_opt, None)):
            o.zero_grad()
            m(x).pow(2).mean().backward()
            if s is None:
                o.step()
                eager_sched.step()
            else:
                s()
        out.append(max(float((a - b).abs().max()) for a, b in zip(model.parameters(), twin.parameters())))
    return out


def main() -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()  # --help; anything else refused
    optimizers = {
        "FISMO": lambda m: FISMO(m.parameters(), lr=0.05, weight_decay=0.1, nonfinite="propagate"),
        "torch.optim.Muon": lambda m: torch.optim.Muon(m.parameters(), lr=0.05, weight_decay=0.1),
    }
    print(f"torch {torch.__version__}; max |compiled - eager| of the parameters after each step (inductor, float64)")
    print("| optimizer | lr schedule | " + " | ".join(f"step {t}" for t in range(1, 7)) + " |")
    print("|---|---|" + "---|" * 6)
    for name, make in optimizers.items():
        for scheduled in (False, True):
            row = drift(make, scheduled)
            label = "LambdaLR 1 / (1 + s)" if scheduled else "constant"
            print(f"| {name} | {label} | " + " | ".join(f"{v:.2g}" for v in row) + " |")


if __name__ == "__main__":
    main()
