"""The compiled float64 step with inductor: bit for bit against eager, and its speed (docs/torch.md).

    python docs/scripts/inductor_float64.py     # about 2 minutes on 2 cores

On the small GPT's 8 matrices (192×64, 64×64, 256×64, 64×256, twice) in float64,
``FISMO(nonfinite="propagate")``, one torch thread, inductor's caches off, three steps side by side:

- eager ``opt.step``;
- ``torch.compile(opt.step, fullgraph=True)`` as the library runs it: in float64 the adapter enters
  ``_torch_eager_kernels.EagerKernels``, which leaves the reductions, square roots, logarithms, products
  and the update's ``addcmul`` to ATen's eager kernels (opaque graph nodes) and lets inductor fuse the
  rest;
- the same compiled step with ``EagerKernels`` turned off in this process (inductor's own kernels
  everywhere, as in float32), for comparison.

Prints each compiled step's first call, whether 5 of its steps equal 5 eager ones bit for bit, and the
medians of 21 interleaved steps with their ratios to eager.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path


def main() -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()  # --help; anything else refused
    warnings.filterwarnings("ignore")
    import torch
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    from fismo_core.backends import torch as adapter

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from lite_cpp_wrapper import small_gpt_matrices as make  # the same 8 matrices, gradients and optimizer

    torch.set_num_threads(1)
    (eager_params, eager), (kept_params, kept), (own_params, own) = make(), make(), make()
    compiled_own = torch.compile(own.step, fullgraph=True)

    def inductors_own_kernels() -> None:  # the adapter's switch off, around this compiled step only
        adapter.wants_eager_kernels = lambda groups: False
        try:
            compiled_own()
        finally:
            adapter.wants_eager_kernels = wants

    wants = adapter.wants_eager_kernels
    steps = {"eager": eager.step, "compiled (EagerKernels, the library's)": torch.compile(kept.step, fullgraph=True),
             "compiled (inductor's own kernels)": inductors_own_kernels}
    print(f"torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}, float64, "
          f"{len(eager_params)} matrices, one thread")
    with inductor_config.patch(fx_graph_cache=False), functorch_config.patch(enable_autograd_cache=False):
        first = {}
        for name, step in steps.items():
            start = time.perf_counter()
            step()
            first[name] = time.perf_counter() - start
        for _ in range(4):
            for step in steps.values():
                step()
    params = {"compiled (EagerKernels, the library's)": kept_params, "compiled (inductor's own kernels)": own_params}
    same = {name: "yes" if all(torch.equal(a, b) for a, b in zip(eager_params, p)) else "no"
            for name, p in params.items()}
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(21):
        for name, step in steps.items():
            start = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - start)
    medians = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    print("| step | first call (s) | 5 steps bit for bit with eager | median (ms) | / eager |")
    print("|---|---|---|---|---|")
    for name in steps:
        print(f"| {name} | {first[name]:.1f} | {same.get(name, '—')} | {medians[name]:.2f} | {medians[name] / medians['eager']:.2f} |")


if __name__ == "__main__":
    main()
