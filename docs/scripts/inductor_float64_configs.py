"""Every configuration of tests/test_torch_compile.py, compiled by inductor in float64, against eager (docs/torch.md).

    python docs/scripts/inductor_float64_configs.py     # about 3 minutes on 2 cores

For each of the test file's ``CONFIGS`` (full and blocked factors, every polar and root method, Nesterov,
weight decay, a tensor learning rate, roots every 3 steps), ``FISMO(nonfinite="propagate")`` on the test's
MLP of matrices in float64 (`_matrices_only`), 6 steps of ``torch.compile(opt.step, fullgraph=True)``
(inductor's default mode) beside 6 eager steps of a twin: prints the graph count, the graph breaks,
whether the parameters are equal bit for bit and their largest relative difference. The test file runs
three of these cases (``test_inductor_equals_eager_bit_for_bit_in_float64``); this runs them all.
"""

from __future__ import annotations

import argparse
import copy
import sys
import warnings
from pathlib import Path


def main() -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()  # --help; anything else refused
    warnings.filterwarnings("ignore")
    import torch
    from torch._dynamo.utils import counters

    from fismo_core.backends.torch import FISMO

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
    import test_torch_compile as cases  # the test's configurations, model and data

    print(f"torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}")
    print("| configuration | graphs | graph breaks | bit for bit | largest relative difference |")
    print("|---|---|---|---|---|")
    for name, config in cases.CONFIGS.items():
        torch._dynamo.reset()
        counters.clear()
        model = cases._matrices_only()
        twin = copy.deepcopy(model)
        batches = cases._batches(model, cases.STEPS + 2)
        opt, eager = (FISMO(m.parameters(), nonfinite="propagate", **copy.deepcopy({"lr": 0.02, **config}))
                      for m in (model, twin))
        cases._run(model, opt, batches, torch.compile(opt.step, fullgraph=True))
        cases._run(twin, eager, batches, eager.step)
        pairs = list(zip(model.parameters(), twin.parameters()))
        worst = max(float((a - b).abs().max() / b.abs().max()) for a, b in pairs)
        same = "yes" if all(torch.equal(a, b) for a, b in pairs) else "no"
        breaks = sum(counters["graph_break"].values())
        print(f"| {name} | {counters['stats']['unique_graphs']} | {breaks} | {same} | {worst:.1e} |", flush=True)


if __name__ == "__main__":
    main()
