"""Why FISMO-T loses on the digits CNN: its roots are stale for up to 9 steps out of 10.

The training configuration (``FISMO.training``) recomputes ``P^{-1/2}`` and ``Q^{-1/2}`` on every
10th step only (``inv_root={"every": 10}``). On the demo's digits CNN that configuration ends far
behind ``torch.optim.Muon`` (the documentation page "Results"). This script runs the demo's digits
task (``fismo_core.demo``'s default plan: 400 steps, its schedule, AdamW on the rest) with FISMO-T
and one setting changed at a time, at one learning rate, for each seed, and prints the final
held-out losses: the refresh interval (1, 2, 5, 10) and the damping ``mu`` with the roots every
10 steps. ``torch.optim.Muon`` at its defaults (the demo's Muon-torch) is the reference.

    python docs/scripts/root_staleness.py                    # digits, lr 0.01, seeds 0-2 (about 4 CPU-minutes)
    python docs/scripts/root_staleness.py --task text --lr 0.02 --only FISMO-T FISMO-T-mu1e-1   # the text task
"""

from __future__ import annotations

import argparse
import statistics

import torch

from fismo_core.demo import optimizers
from fismo_core.demo.config import default_config
from fismo_core.demo.run import _spec
from fismo_core.demo.train import train

#: The variants of FISMO-T: modifiers of the demo's naming rule (``FISMO-T-<modifier>``, each one setting changed).
VARIANTS: tuple[str, ...] = ("every1", "every2", "every5", "mu1e-2", "mu1e-1")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lr", type=float, default=0.01, help="learning rate of every run (default: %(default)s)")
    parser.add_argument("--seeds", type=int, default=3, help="seeds 0 .. N-1 (default: %(default)s)")
    parser.add_argument("--task", choices=["digits", "text"], default="digits", help="the demo's task (default: %(default)s)")
    parser.add_argument("--only", nargs="+", help="run only these rows (names as printed)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    plan = next(p for p in default_config().plans if p.task.name == args.task)
    runs = {"Muon-torch": "torch.optim.Muon, defaults", "FISMO-T": "the training configuration (roots every 10)"}
    for name in VARIANTS:
        _, change = optimizers._MODIFIERS[name]
        runs[f"FISMO-T-{name}"] = ", ".join(f"{k}={v}" for k, v in change.items())
    if args.only:
        runs = {name: what for name, what in runs.items() if name in args.only}
    seeds = list(range(args.seeds))
    print(f"Task {args.task}, {plan.steps} steps, lr {args.lr:g} (the matrices'; AdamW {plan.adamw_lr:g} on the rest), "
          f"final held-out loss\n")
    print("| optimizer | what changes | " + " | ".join(f"seed {s}" for s in seeds) + " | median |")
    print("|---|---|" + "---:|" * (len(seeds) + 1))
    for name, what in runs.items():
        losses = [train(_spec(plan, name, args.lr, seed)).final_val_loss for seed in seeds]
        cells = " | ".join(f"{x:.4f}" for x in losses)
        print(f"| {name} | {what} | {cells} | {statistics.median(losses):.4f} |", flush=True)


if __name__ == "__main__":
    main()
