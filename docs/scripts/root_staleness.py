"""Why FISMO-T with the printed damping loses on the digits CNN: its roots are stale for up to 9 steps out of 10.

The training configuration (``FISMO.training``) recomputes ``P^{-1/2}`` and ``Q^{-1/2}`` on every
10th step only (``inv_root={"every": 10}``). With the printed damping ``mu = 1e-3`` (its default until
the documentation page "Results" measured this) that configuration ends far behind
``torch.optim.Muon`` on the demo's digits CNN; its default ``mu = 0.1`` trains. This script runs the
demo's digits task (``fismo_core.demo``'s default plan: 400 steps, its schedule, AdamW on the rest)
with FISMO-T and settings changed by the demo's modifiers, at one learning rate, for each seed, and
prints the final held-out losses: the damping (1e-3, 1e-2, and the default 0.1) and, at ``mu = 1e-3``,
the refresh interval (1, 2, 5, 10). ``torch.optim.Muon`` at its defaults (the demo's Muon-torch) is
the reference.

    python docs/scripts/root_staleness.py                    # digits, lr 0.01, seeds 0-2 (about 5 CPU-minutes)
    python docs/scripts/root_staleness.py --task text --lr 0.02 --only FISMO-T FISMO-T-mu1e-3   # the text task
"""

from __future__ import annotations

import argparse
import math
import statistics

import torch

from fismo_core.demo import optimizers
from fismo_core.demo.config import default_config
from fismo_core.demo.run import _spec
from fismo_core.demo.train import train

#: The variants of FISMO-T: modifiers of the demo's naming rule (``FISMO-T-<modifier>``; joined by ``-``).
VARIANTS: tuple[str, ...] = ("mu1e-3", "mu1e-3-every1", "mu1e-3-every2", "mu1e-3-every5", "mu1e-2")


def main() -> None:
    from _arguments import positive_float, positive_int  # docs/scripts/, on sys.path when the script runs

    runs = {"Muon-torch": "torch.optim.Muon, defaults", "FISMO-T": "the training configuration (mu=0.1, roots every 10)"}
    for name in VARIANTS:
        change = optimizers.control_change(f"FISMO-T-{name}")
        runs[f"FISMO-T-{name}"] = ", ".join(f"{k}={v}" for k, v in change.items())
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lr", type=positive_float, default=0.01, help="learning rate of every run (default: %(default)s)")
    parser.add_argument("--seeds", type=positive_int, default=3, help="seeds 0 .. N-1 (default: %(default)s)")
    parser.add_argument("--task", choices=["digits", "text"], default="digits", help="the demo's task (default: %(default)s)")
    parser.add_argument("--only", nargs="+", choices=list(runs), metavar="NAME",
                        help=f"run only these rows (names as printed: {', '.join(runs)})")
    args = parser.parse_args()
    torch.set_num_threads(1)
    plan = next(p for p in default_config().plans if p.task.name == args.task)
    if args.only:
        runs = {name: what for name, what in runs.items() if name in args.only}
    seeds = list(range(args.seeds))
    print(f"Task {args.task}, {plan.steps} steps, lr {args.lr:g} (the matrices'; AdamW {plan.adamw_lr:g} on the rest), "
          f"final held-out loss\n")
    print("| optimizer | what changes | " + " | ".join(f"seed {s}" for s in seeds) + " | median |")
    print("|---|---|" + "---:|" * (len(seeds) + 1))
    for name, what in runs.items():
        losses = [train(_spec(plan, name, args.lr, seed)).final_val_loss for seed in seeds]
        cells = " | ".join(map(_loss, losses))
        print(f"| {name} | {what} | {cells} | {_loss(statistics.median(losses))} |", flush=True)


def _loss(x: float) -> str:
    """A final held-out loss, or "diverged" (a non-finite loss, or the roots failed: the demo's ``train``)."""
    return f"{x:.4f}" if math.isfinite(x) else "diverged"


if __name__ == "__main__":
    main()
