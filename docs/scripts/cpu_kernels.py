"""How far the quick start's trajectory moves between CPU kernel sets (docs/index.md, docs/guarantees.md).

    python docs/scripts/cpu_kernels.py

Runs the quick start of ``docs/index.md`` (NumPy float64, 200 steps) in a
fresh process under every kernel set of ``fismo_core.kernels`` this CPU can
run, and prints, at a few steps, the relative error ``||W - A|| / ||A||``
under each set and the largest relative difference between sets. The
difference starts at the last bit and grows along the trajectory once ``W``
circles the target; the table in ``docs/guarantees.md`` is this script's
output.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

from fismo_core.kernels import KERNEL_SETS, runnable

STEPS = (1, 50, 100, 110, 120, 130, 140, 200)

QUICK_START = """
import json, numpy as np
from fismo_core import FISMO
rng = np.random.default_rng(0)
A = 0.1 * rng.standard_normal((32, 16))
opt = FISMO(lr=0.02, beta=0.95, gamma=0.95, mu=1e-3)
W = np.zeros((32, 16))
state = opt.init(W)
errors = {}
for t in range(1, 201):
    W, state = opt.step(W, W - A, state)
    errors[t] = float(np.linalg.norm(W - A) / np.linalg.norm(A))
print(json.dumps(errors))
"""


def main() -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()  # --help; anything else refused
    runs = {}
    for ks in KERNEL_SETS:
        if not runnable(ks):
            print(f"# {ks.name}: this CPU cannot run it, skipped")
            continue
        out = subprocess.run([sys.executable, "-c", QUICK_START], env=ks.environ(), capture_output=True,
                             text=True, check=True).stdout
        runs[ks.name] = {int(k): v for k, v in json.loads(out).items()}
    names = list(runs)
    print("| step | " + " | ".join(names) + " | largest relative difference |")
    print("|---|" + "---|" * (len(names) + 1))
    for t in STEPS:
        values = [runs[n][t] for n in names]
        spread = (max(values) - min(values)) / min(values)
        print(f"| {t} | " + " | ".join(f"{v:.12g}" for v in values) + f" | {spread:.1e} |")


if __name__ == "__main__":
    main()
