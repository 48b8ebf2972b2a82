"""Where inductor's compiled float64 step departs from the eager one (docs/torch.md, "The eager numbers").

    python docs/scripts/inductor_float64_sources.py        # about 30 s (an AMD EPYC with AVX2, 2026-11-29)

Takes the case of ``tests/test_compile_core.py::test_inductor_compiles_the_step``: the core's
``FISMO(nonfinite="propagate").direction`` on two 5 x 7 float64 matrices after one eager step, roots
recomputed, for three seeds. Captures dynamo's graph of it, compiles that graph with inductor with every
floating-point intermediate made an output as well, runs both, and prints the *sources* of the difference:
the nodes whose compiled value differs from the eager one although every tensor they read is equal in
both. Later nodes that differ only because an input did are not counted. (Making the intermediates
outputs changes what inductor fuses, not how it computes each node.)

Then the one elementwise source found on the machine where this was written, torch's eager float64
``sqrt``, against the correctly rounded square root (NumPy's) on 10^5 uniform numbers in [0, 4).
"""

from __future__ import annotations

import argparse
import operator
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch
import torch._functorch.config as functorch_config
import torch._inductor.config as inductor_config
import torch.fx as fx
from torch._inductor.compile_fx import compile_fx

from fismo_core import FISMO

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from test_compile_core import _inputs  # noqa: E402  (the test's inputs, so the script measures its case)

SEEDS = (0, 1, 2)
REDUCTIONS = ("sum", "amax", "matrix_norm", "vector_norm", "mean")


def _graph_and_inputs(opt: FISMO, G: torch.Tensor, state) -> tuple[fx.GraphModule, list]:
    """Dynamo's graph of ``opt.direction(G, state, refresh_roots=True)`` and its example inputs."""
    captured = {}

    def backend(gm: fx.GraphModule, example_inputs: list):
        captured.update(gm=gm, inputs=example_inputs)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(opt.direction, backend=backend, fullgraph=True)(G, state, refresh_roots=True)
    return captured["gm"], captured["inputs"]


def _eager_values(gm: fx.GraphModule, inputs: list) -> dict:
    """Every node's eager value (the graph run op by op, as the eager step runs)."""
    values = {}

    class Recorder(fx.Interpreter):
        def run_node(self, n):
            values[n] = super().run_node(n)
            return values[n]

    Recorder(gm).run(*inputs)
    return values


def sources(seed: int) -> list[tuple[str, float]]:
    """``(op, largest absolute difference)`` of each node where compiled and eager part, for one seed."""
    opt = FISMO(nonfinite="propagate")
    G, state = _inputs(opt, torch.float64, seed=seed)
    gm, inputs = _graph_and_inputs(opt, G, state)
    eager = _eager_values(gm, inputs)
    graph = gm.graph
    floats = [n for n in graph.nodes if n.op in ("call_function", "call_method")
              and isinstance(eager[n], torch.Tensor) and eager[n].is_floating_point()]
    output = next(n for n in graph.nodes if n.op == "output")
    results = output.args[0] if isinstance(output.args[0], (tuple, list)) else (output.args[0],)
    output.args = ((*results, *floats),)
    widened = fx.GraphModule(gm, graph)
    with inductor_config.patch(fx_graph_cache=False), functorch_config.patch(enable_autograd_cache=False):
        compiled = dict(zip(floats, compile_fx(widened, inputs)(*inputs)[-len(floats):]))
    def tensors_read(n: fx.Node) -> list:
        # Through nodes that are no tensor (the tuple of eigh, read by getitem) to the tensors they read.
        return [t for a in n.all_input_nodes for t in ([a] if a in compiled else tensors_read(a))]

    def op_name(n: fx.Node) -> str:
        if n.target is operator.getitem and n.args[0] not in compiled:
            return f"{op_name(n.args[0])}[{n.args[1]}]"
        name = getattr(n.target, "__name__", str(n.target))
        first = n.all_input_nodes[0] if n.all_input_nodes else None
        # A reduction is named with what it reduces: sum(diagonal) is a trace.
        return f"{name}({op_name(first)})" if name in REDUCTIONS and first is not None else name

    found = []
    for n in floats:
        if not torch.equal(compiled[n], eager[n]) and all(torch.equal(compiled[a], eager[a]) for a in tensors_read(n)):
            found.append((op_name(n), float((compiled[n] - eager[n]).abs().max())))
    return found


def main() -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()  # --help; anything else refused
    torch.set_num_threads(1)
    by_op = defaultdict(lambda: [0, 0.0])
    for seed in SEEDS:
        for op, difference in sources(seed):
            by_op[op][0] += 1
            by_op[op][1] = max(by_op[op][1], difference)
    print(f"torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}, "
          f"seeds {SEEDS}")
    print("| op (dynamo's graph) | nodes where compiled and eager part, over the seeds | largest difference |")
    print("|---|---|---|")
    for op, (count, difference) in sorted(by_op.items()):
        print(f"| `{op}` | {count} | {difference:.1e} |")
    x = torch.rand(100_000, dtype=torch.float64, generator=torch.Generator().manual_seed(0)) * 4
    wrong = int((torch.sqrt(x).numpy() != np.sqrt(x.numpy())).sum())
    print(f"torch.sqrt (eager, float64) differs from the correctly rounded square root on {wrong} of "
          f"{x.numel()} numbers ({100 * wrong / x.numel():.2f} %)")


if __name__ == "__main__":
    main()
