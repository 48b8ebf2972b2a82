"""Inductor's FX graph cache and ``ATEN_CPU_CAPABILITY``: a reproducer without FISMO (docs/torch.md).

    python docs/scripts/inductor_cache_isa.py

Compiles one small float64 reduction (``sqrt(sum(x * x)) + max|x|``) with
inductor in a fresh process under one ``ATEN_CPU_CAPABILITY``, then runs the
same code in a second fresh process under another, both with one new
``TORCHINDUCTOR_CACHE_DIR``: the second process takes the first one's graph
from the cache. Each process prints the compiled and the eager value. For
each pair of the CPU's vector kernel sets (both orders) the script prints
whether the second process's compiled value is right, then the same pair
with the FX graph cache off (``TORCHINDUCTOR_FX_GRAPH_CACHE=0``) as the
control. Needs a C++ compiler (inductor's) and an x86 CPU with AVX-512 for
the pairs to differ.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

CHILD = """
import json, torch
torch.manual_seed(0)
x = torch.randn(64, 40, dtype=torch.float64)
f = torch.compile(lambda x: (x * x).sum().sqrt() + x.abs().amax(), backend="inductor")
print(json.dumps({"capability": torch.backends.cpu.get_cpu_capability(), "compiled": float(f(x)),
                  "eager": float((x * x).sum().sqrt() + x.abs().amax())}))
"""

#: The ``ATEN_CPU_CAPABILITY`` values tried (``None``: torch's choice for this CPU).
CAPABILITIES = (None, "avx2")


def _run(capability: str | None, cache: str, graph_cache: bool) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "ATEN_CPU_CAPABILITY"}
    env["TORCHINDUCTOR_CACHE_DIR"] = cache
    env["TORCHINDUCTOR_FX_GRAPH_CACHE"] = "1" if graph_cache else "0"
    if capability is not None:
        env["ATEN_CPU_CAPABILITY"] = capability
    out = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()  # --help; anything else refused
    print("| first process | second process | FX graph cache | second: compiled | second: eager | right? |")
    print("|---|---|---|---|---|---|")
    for first in CAPABILITIES:
        for second in CAPABILITIES:
            if first == second:
                continue
            for graph_cache in (True, False):
                with tempfile.TemporaryDirectory() as cache:
                    a = _run(first, cache, graph_cache)
                    b = _run(second, cache, graph_cache)
                right = abs(b["compiled"] - b["eager"]) <= 1e-12 * abs(b["eager"])
                print(f"| {a['capability']} | {b['capability']} | {'on' if graph_cache else 'off'} | "
                      f"{b['compiled']:.15g} | {b['eager']:.15g} | {'yes' if right else '**no**'} |")


if __name__ == "__main__":
    main()
