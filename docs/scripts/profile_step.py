"""Where a blocked FISMO step spends its time, by line of Algorithm 1 (the documentation page
"Performance", section "Why the targets are missed or met").

cProfile of ``FISMO(nonfinite="propagate", block_size=B).step`` on torch CPU float32, its time
summed over the core's functions that carry each part of Algorithm 1:

- roots: ``linalg.inverse_sqrt`` (one batched ``eigh`` per block size), lines 4-5's inverse roots;
- statistics: ``kronecker.*.update``, the diagonal Gram blocks with EMA, damping, symmetrisation
  and trace normalisation of lines 4-5;
- products with the roots: ``kronecker.*.left``/``right``, ``G Q^{-1/2}`` (line 4),
  ``P^{-1/2} G`` (line 5), the whitening (line 6) and the un-whitening (line 8);
- polar: ``linalg.polar``, line 8's Newton-Schulz iteration of the whole ``M_t``;
- other: the rest of the step (line 7's momentum, line 9, guards, Python).

Each part is set against its operations in ``fismo_core.perf.step_flops`` (``eigh`` as ``9 d^3``)
and against the step's own polar factor: line 8's Newton-Schulz iteration is exactly a float32 Muon
step's work, so "in polar factors" is the ratio to Muon measured inside the same profiled steps,
immune to the load changing between two timings. The float32 Muon step of the same shape is also
timed, right after (a separate timing: on a loaded machine it can differ by tens of percent).

    python docs/scripts/profile_step.py --threads 1                # the page's shapes, B = 768 / 1024
    python docs/scripts/profile_step.py --shape 768x3072 --block 768 --polar-dtype bfloat16
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "asv_benchmarks"))

from benchmarks.common import anchor_step, interleaved_medians, random_matrix  # noqa: E402

from fismo_core import FISMO  # noqa: E402
from fismo_core.perf import block_sizes, polar_flops, step_flops  # noqa: E402

CASES = [((768, 2304), 768), ((768, 768), 768), ((768, 3072), 768), ((3072, 768), 768), ((2048, 5504), 1024)]

#: Part of Algorithm 1 -> (file name, function names) in the core.
PARTS = {
    "roots (eigh), lines 4–5": ("linalg.py", {"inverse_sqrt"}),
    "statistics, lines 4–5": ("kronecker.py", {"update"}),
    "products with the roots, lines 4, 5, 6, 8": ("kronecker.py", {"left", "right"}),
    "polar factor, line 8": ("linalg.py", {"polar"}),
}


def part_flops(shape, block_size) -> dict:
    """Operations of each part, from the same counts as ``fismo_core.perf.step_flops``: with
    ``left = 2 n sum a_i^2`` and ``right = 2 m sum b_j^2`` (a product with P's or Q's blocks), the
    Gram blocks cost ``left + right``, the products with the roots ``2 left + 3 right``."""
    m, n = shape
    left = 2 * n * sum(a * a for a in block_sizes(m, block_size))
    right = 2 * m * sum(b * b for b in block_sizes(n, block_size))
    model = step_flops(m, n, FISMO(nonfinite="propagate", block_size=block_size))
    return {
        "roots (eigh), lines 4–5": model["roots"] + model["eigh"],
        "statistics, lines 4–5": left + right,
        "products with the roots, lines 4, 5, 6, 8": 2 * left + 3 * right,
        "polar factor, line 8": polar_flops(m, n),
        "total": model["total"],
    }


def profile(shape, block_size, polar_dtype, steps: int) -> tuple[dict, float]:
    """Seconds per step of each part (cumulative time of its functions), and of the whole step."""
    import torch

    polar = {"dtype": polar_dtype} if polar_dtype else {}
    opt = FISMO(nonfinite="propagate", block_size=block_size, polar=polar)
    W = torch.asarray(random_matrix(shape, seed=0), dtype=torch.float32)
    G = torch.asarray(random_matrix(shape, seed=1), dtype=torch.float32)
    state = opt.init(W)
    W, state = opt.step(W, G, state)  # warm-up: P, Q off the identity
    prof = cProfile.Profile()
    start = time.perf_counter()
    prof.enable()
    for _ in range(steps):
        W, state = opt.step(W, G, state)
    prof.disable()
    total = (time.perf_counter() - start) / steps
    stats = pstats.Stats(prof).stats  # (file, line, function) -> (cc, nc, tt, ct, {caller: (cc, nc, tt, ct)})
    parts = {}
    for part, (file, names) in PARTS.items():
        keys = {k for k in stats if k[0].endswith(file) and k[2] in names}
        # Cumulative time from callers outside the part (a blocked right() calls left(): counted once).
        parts[part] = sum(ct for k in keys for caller, (_, _, _, ct) in stats[k][4].items() if caller not in keys) / steps
    return parts, total


def matrix_shape(text: str) -> tuple[int, int]:
    """An argparse type: ``MxN``, two positive integers (a matrix's shape)."""
    sides = text.split("x")
    if len(sides) != 2 or not all(side.isdigit() and int(side) > 0 for side in sides):
        raise argparse.ArgumentTypeError(f"must be MxN with positive integers, e.g. 768x3072, got {text!r}")
    return int(sides[0]), int(sides[1])


def main() -> None:
    from _arguments import positive_int  # docs/scripts/, on sys.path when the script runs

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", type=matrix_shape, help="one shape, e.g. 768x3072 (default: the page's shapes)")
    parser.add_argument("--block", type=positive_int, help="block size for --shape (default: full factors)")
    parser.add_argument("--polar-dtype", choices=["bfloat16", "float32"], help="PolarConfig(dtype=...)")
    parser.add_argument("--steps", type=positive_int, default=2, help="profiled steps per shape")
    parser.add_argument("--threads", type=positive_int, help="torch.set_num_threads (default: torch's choice)")
    args = parser.parse_args()
    if args.block is not None and args.shape is None:
        parser.error("--block applies to --shape only (the page's shapes have their own block sizes)")
    import torch

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    cases = CASES if args.shape is None else [(args.shape, args.block)]
    print(f"<!-- torch {torch.__version__}, {torch.get_num_threads()} threads; polar dtype "
          f"{args.polar_dtype or 'float32'} -->\n")
    print("| shape | B | part of the step | ms per step | share | GFLOP (model) | in polar factors (Muon steps) |")
    print("|---|---|---|---|---|---|---|")
    for shape, B in cases:
        parts, total = profile(shape, B, args.polar_dtype, args.steps)
        muon = interleaved_medians({"muon": anchor_step("muon-float32", shape)}, max(2, args.steps))["muon"]
        flops = part_flops(shape, B)
        other = total - sum(parts.values())
        polar = parts["polar factor, line 8"]
        B = "full" if B is None else B  # --shape without --block: the full factors (the B column said None)
        for part, seconds in [*parts.items(), ("other (line 7, line 9, guards, Python)", other)]:
            gflop = f"{flops[part] / 1e9:.1f}" if part in flops else ""
            print(f"| {shape[0]}×{shape[1]} | {B} | {part} | {seconds * 1e3:.0f} | {100 * seconds / total:.0f} % "
                  f"| {gflop} | {seconds / polar:.2f} |")
        print(f"| {shape[0]}×{shape[1]} | {B} | **whole step** | **{total * 1e3:.0f}** | 100 % "
              f"| {flops['total'] / 1e9:.1f} | **{total / polar:.2f}** |")
        print(f"| {shape[0]}×{shape[1]} | | float32 Muon step, timed after | {muon * 1e3:.0f} | | | "
              f"{muon / polar:.2f} |", flush=True)


if __name__ == "__main__":
    main()
