"""Inductor's lite mode with its C++ wrapper: bit for bit, but not faster than eager (docs/torch.md).

    python docs/scripts/lite_cpp_wrapper.py     # about 6 minutes on 2 cores

Inductor's ``mode="lite"`` runs every op by its ATen kernel, so the compiled
FISMO step equals the eager one bit for bit, but its Python wrapper calls
them one by one. ``cpp_wrapper=True`` writes that wrapper in C++, which is
the one way left for a bit-for-bit compiled step to beat eager on a CPU.
Each stage runs in a fresh process, on the small GPT's 8 matrices (192×64,
64×64, 256×64, 64×256, twice) in float64, ``FISMO(nonfinite="propagate")``,
one torch thread, inductor's caches off:

1. lite + ``cpp_wrapper`` as torch ships it;
2. the same with ``ones_like`` replaced by ``full_like`` (in this process
   only), the first failure of stage 1;
3. the same with the core's power of two ``2.0 ** floor(log2(...))`` also
   computed by ``exp2`` (in this process only), the failure of stage 2.

Each stage prints the first line of its error, or the first call's seconds,
whether 5 compiled steps equal 5 eager steps bit for bit, and the medians of
15 interleaved eager and compiled steps. The replacements give the same
values (``2^k`` is exact both ways) but are not in the library: they
only show what the C++ wrapper would buy once torch fixes the two bugs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

STAGES = {
    1: "lite + cpp_wrapper, as shipped",
    2: "+ ones_like as full_like",
    3: "+ the power of two by exp2",
}
SHAPES = [(192, 64), (64, 64), (256, 64), (64, 256)] * 2


def small_gpt_matrices() -> tuple[list, object]:
    """The small GPT's 8 matrices in float64 with a gradient each, and ``FISMO(nonfinite="propagate")``
    on them (also ``docs/scripts/inductor_float64.py``'s case)."""
    import torch

    from fismo_core.backends.torch import FISMO

    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(*s, generator=g, dtype=torch.float64)) for s in SHAPES]
    for p in params:
        p.grad = torch.randn(p.shape, generator=g, dtype=torch.float64)
    return params, FISMO(params, lr=0.02, nonfinite="propagate")


def _stage(stage: int) -> dict:
    """One stage, in this process: a dict of what it found."""
    import warnings

    warnings.filterwarnings("ignore")
    import array_api_compat.torch as compat_torch
    import torch
    from torch._inductor import list_mode_options

    import fismo_core.linalg as core_linalg

    if stage >= 2:
        compat_torch.ones_like = lambda x, **kwargs: torch.full_like(x, 1.0)
    if stage >= 3:
        core_linalg._pow2_of = lambda amax: torch.exp2(torch.floor(torch.log2(torch.clamp_min(amax, 1.0))))
    torch.set_num_threads(1)
    make = small_gpt_matrices

    eager_params, eager = make()
    compiled_params, compiled_opt = make()
    step = torch.compile(compiled_opt.step, options={**list_mode_options("lite"), "cpp_wrapper": True})
    start = time.perf_counter()
    try:
        step()
    except Exception as exc:  # the finding of stages 1 and 2
        lines = str(exc).splitlines()
        compiler = [line.split(" error: ", 1)[1] for line in lines if " error: " in line]  # the C++ compiler's
        first = compiler[0] if compiler else (lines[0] if lines else "")
        return {"error": f"{type(exc).__name__}: {first.strip()[:240]}"}
    first_call = time.perf_counter() - start
    eager.step()
    for _ in range(4):
        step()
        eager.step()
    bit_equal = all(torch.equal(a, b) for a, b in zip(eager_params, compiled_params))
    eager_times, compiled_times = [], []
    for _ in range(15):
        start = time.perf_counter()
        eager.step()
        eager_times.append(time.perf_counter() - start)
        start = time.perf_counter()
        step()
        compiled_times.append(time.perf_counter() - start)
    return {"first_call_s": first_call, "bit_equal": bit_equal,
            "eager_ms": 1e3 * statistics.median(eager_times), "compiled_ms": 1e3 * statistics.median(compiled_times)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stage", type=int, choices=STAGES, help=argparse.SUPPRESS)  # one stage, in a child process
    args = parser.parse_args()
    if args.stage is not None:
        print(json.dumps(_stage(args.stage)))
        return
    print(f"torch {__import__('torch').__version__}")
    print("| stage | result |")
    print("|---|---|")
    for stage, name in STAGES.items():
        with tempfile.TemporaryDirectory() as cache:
            env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "TORCHINDUCTOR_FX_GRAPH_CACHE": "0",
                   "TORCHINDUCTOR_AUTOGRAD_CACHE": "0", "OMP_NUM_THREADS": "1"}
            out = subprocess.run([sys.executable, __file__, "--stage", str(stage)], env=env,
                                 capture_output=True, text=True)
        lines = out.stdout.strip().splitlines()
        if out.returncode or not lines:
            print(f"| {stage}. {name} | the stage's process failed: {out.stderr.strip().splitlines()[-1:]} |")
            continue
        r = json.loads(lines[-1])
        if "error" in r:
            print(f"| {stage}. {name} | {r['error']} |")
        else:
            print(f"| {stage}. {name} | first call {r['first_call_s']:.0f} s; bit for bit: {r['bit_equal']}; "
                  f"eager {r['eager_ms']:.2f} ms, compiled {r['compiled_ms']:.2f} ms "
                  f"(compiled / eager {r['compiled_ms'] / r['eager_ms']:.2f}) |")


if __name__ == "__main__":
    main()
