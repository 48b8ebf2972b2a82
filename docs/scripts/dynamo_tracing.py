"""What dynamo's tracing of ``opt.step`` costs, with and without the torch adapter's substitutes for
array-api-compat's ``array_namespace`` and ``device`` (docs/torch.md, "torch.compile", "Tracing").

On the demo's byte-level GPT (2 layers, d = 64, 8 matrices; ``small_gpt_optimizer`` of
``asv_benchmarks/benchmarks/bench_overhead.py``), for each configuration and in a fresh process per mode
("substitutes", as the adapter registers them at its import, and "original", where the script removes
``torch.compiler.substitute_in_graph`` before that import so that nothing is registered):

- the bytecode instructions dynamo steps through while it traces a first ``torch.compile(opt.step,
  fullgraph=True)`` (counted by wrapping ``InstructionTranslatorBase.step``, a private method of
  dynamo, torch 2.13), and the nodes of the FX graphs it hands on (the same graphs either way); the
  default configuration (``nonfinite="raise"``, host reads) without ``fullgraph``, as it compiles;
- the warnings of that first compile that say dynamo traced an ``lru_cache``-wrapped function;
- the seconds of the first compiled call (backend ``"eager"``: dynamo's tracing, which the substitutes
  change, and the step; AOT autograd and inductor would then work on the same graphs), medians of
  ``--repeats`` compiles after ``torch._dynamo.reset()``, one torch thread.

    python docs/scripts/dynamo_tracing.py              # 4 to 11 minutes, the default configuration's half of it
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ("propagate", "propagate-B32", "training", "default")  # ids of GPT_FISMO


def measure(mode: str, config: str, repeats: int) -> dict:
    """In this process: the counts and times of one configuration under ``mode``."""
    import torch

    torch.set_num_threads(1)
    if mode == "original":
        torch.compiler.substitute_in_graph = None  # the adapter then registers nothing
    sys.path.insert(0, str(ROOT / "asv_benchmarks"))
    from benchmarks.bench_overhead import small_gpt_optimizer
    import torch._dynamo.symbolic_convert as symbolic_convert

    from fismo_core.backends import _torch_compile

    assert _torch_compile.SUBSTITUTED == (mode == "substitutes")
    stepped = [0]
    original_step = symbolic_convert.InstructionTranslatorBase.step

    def counted_step(self):
        stepped[0] += 1
        return original_step(self)

    nodes: list[int] = []

    def backend(gm, example_inputs):
        nodes.append(len(gm.graph.nodes))
        return gm.forward

    def compile_once() -> float:
        torch._dynamo.reset()
        opt = small_gpt_optimizer(config)
        opt.step()  # the states exist, as after a first eager step
        step = torch.compile(opt.step, backend=backend, fullgraph=config != "default")
        start = time.perf_counter()
        step()
        return time.perf_counter() - start

    symbolic_convert.InstructionTranslatorBase.step = counted_step
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compile_once()
    symbolic_convert.InstructionTranslatorBase.step = original_step
    graph_nodes = sum(nodes)
    seconds = [compile_once() for _ in range(repeats)]
    return {
        "instructions": stepped[0],
        "graph nodes": graph_nodes,
        "lru_cache warnings": sum("lru_cache" in str(w.message) for w in caught),
        "seconds": statistics.median(seconds),
    }


def main() -> None:
    from _arguments import positive_int  # docs/scripts/, on sys.path when the script runs

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=positive_int, default=3, help="compiles timed per configuration and mode")
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=CONFIGS)
    parser.add_argument("--measure", nargs=2, metavar=("MODE", "CONFIG"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(*args.measure, args.repeats)))
        return
    import torch

    print(f"## dynamo's tracing of opt.step on the small GPT (torch {torch.__version__}, one thread, "
          f"medians of {args.repeats} compiles)\n")
    print("| configuration | mode | instructions traced | graph nodes | lru_cache warnings | first call (s) |")
    print("|---|---|---|---|---|---|")
    for config in args.configs:
        for mode in ("original", "substitutes"):
            out = subprocess.run([sys.executable, __file__, "--repeats", str(args.repeats), "--measure", mode, config],
                                 capture_output=True, text=True, check=True).stdout
            r = json.loads(out.strip().splitlines()[-1])
            print(f"| {config} | {mode} | {r['instructions']:,} | {r['graph nodes']} | {r['lru_cache warnings']} "
                  f"| {r['seconds']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
