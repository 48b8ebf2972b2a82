"""What ``opt.state_dict()`` on one DDP rank does to a ``FISMO(..., process_group=...)`` run (docs/torch.md, "DDP").

    python docs/scripts/ddp_state_dict_on_one_rank.py rank0    # torch.optim's idiom: rank 0 alone
    python docs/scripts/ddp_state_dict_on_one_rank.py every    # every rank calls it, rank 0 writes

Two gloo ranks on the CPU, a DDP model of three linear layers (float32), one step, then the checkpoint,
then two more steps. Under ``process_group`` each rank holds the states of the matrices it owns and
``state_dict()`` gathers them all (a collective), so it must run on every rank. Each rank prints what it
finished and when; a rank that aborts in C++ (gloo) prints nothing more, and the parent reports its signal.
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


def _worker(rank: int, store: str, idiom: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=20))
    from fismo_core.backends.torch import FISMO, param_groups

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16), torch.nn.Tanh(),
                                torch.nn.Linear(16, 4))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = FISMO(param_groups(model), lr=0.02, process_group=dist.group.WORLD)
    x = torch.randn(32, 8)

    def step() -> None:
        opt.zero_grad()
        ddp(x).square().mean().backward()
        opt.step()

    step()
    began = time.perf_counter()
    try:
        if idiom == "rank0":  # torch.optim's idiom, wrong here
            if rank == 0:
                torch.save(opt.state_dict(), Path(store).parent / "opt.pt")
        else:
            state = opt.state_dict()  # every rank
            if rank == 0:
                torch.save(state, Path(store).parent / "opt.pt")
        print(f"rank {rank}: checkpoint done after {time.perf_counter() - began:.1f} s", flush=True)
        step()
        step()
        print(f"rank {rank}: two more steps done after {time.perf_counter() - began:.1f} s", flush=True)
    except Exception as exc:  # noqa: BLE001 - what the rank saw is the point
        print(f"rank {rank}: raised after {time.perf_counter() - began:.1f} s: {type(exc).__name__}: "
              f"{str(exc).splitlines()[0][:160]}", flush=True)
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("idiom", nargs="?", default="rank0", choices=["rank0", "every"],
                        help="rank0: rank 0 alone calls state_dict() (torch.optim's idiom); every: every rank does")
    idiom = parser.parse_args().idiom
    with tempfile.TemporaryDirectory() as tmp:
        try:
            mp.start_processes(_worker, args=(str(Path(tmp) / "store"), idiom), nprocs=2, start_method="spawn")
        except mp.ProcessExitedException as exc:
            print(f"parent: {exc}", flush=True)


if __name__ == "__main__":
    main()
