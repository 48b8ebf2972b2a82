"""What a DDP-style ``FISMO(..., process_group=...)`` step does when the ranks hold gradients for different
matrices (docs/torch.md, "DDP").

    python docs/scripts/ddp_mismatched_grads.py                # about 10 seconds
    python docs/scripts/ddp_mismatched_grads.py --propagate    # nonfinite="propagate": not detected

Two gloo ranks on the CPU, two 4 x 4 float64 matrices, one bucket. Both ranks set the first matrix's
gradient; only rank 0 sets the second's, as code that writes gradients by hand on some ranks could (DDP
itself never does: ``tests/test_torch_distributed.py`` checks that with ``find_unused_parameters=True``).
In the default configuration every rank refuses the step (the digest of which matrices have a gradient
rides in the step's all-reduce); under ``nonfinite="propagate"`` (``--propagate``) nothing is checked and the
ranks' broadcasts do not match. Each rank prints whether its step returned or raised, after how many
seconds and with what, and, where it returned, whether its first matrix equals a lone step of that matrix
and whether its second matrix changed.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _worker(rank: int, store: str, nonfinite: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=30))
    from fismo_core.backends.torch import FISMO

    torch.manual_seed(0)
    start = [torch.randn(4, 4, dtype=torch.float64) for _ in range(2)]
    first_grad = torch.randn(4, 4, dtype=torch.float64)
    weights = [torch.nn.Parameter(w.clone()) for w in start]
    opt = FISMO(weights, lr=0.05, process_group=dist.group.WORLD, nonfinite=nonfinite)
    weights[0].grad = first_grad.clone()
    if rank == 0:
        weights[1].grad = torch.randn(4, 4, dtype=torch.float64)
    began = time.perf_counter()
    try:
        opt.step()
    except Exception as exc:  # noqa: BLE001 - what the rank saw is the point
        print(f"rank {rank}: raised after {time.perf_counter() - began:.1f} s: {type(exc).__name__}: "
              f"{str(exc).splitlines()[0][:160]}", flush=True)
    else:
        lone = torch.nn.Parameter(start[0].clone())
        lone.grad = first_grad.clone()
        FISMO([lone], lr=0.05, nonfinite=nonfinite).step()
        print(f"rank {rank}: returned after {time.perf_counter() - began:.1f} s; first matrix equals a lone "
              f"step: {torch.equal(lone, weights[0])}; second matrix changed: "
              f"{not torch.equal(weights[1], start[1])}", flush=True)
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--propagate", action="store_true", help='nonfinite="propagate" (default: "raise")')
    nonfinite = "propagate" if parser.parse_args().propagate else "raise"  # a typo was the "raise" run, silently
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_worker, args=(str(Path(tmp) / "store"), nonfinite), nprocs=2, start_method="spawn")


if __name__ == "__main__":
    main()
