"""Train a small GPT with FISMO under FSDP2 on 4 CPU ranks, checkpoint with DCP mid-run, resume on 2 ranks, finish.

Run: ``python docs/examples/fsdp2_resume.py`` (gloo on CPU, no GPU needed; about 100 s on 2 cores, as measured in docs/torch.md).

What it does, as a training job that is moved to a smaller allocation:

1. 4 processes (gloo) shard a byte-level GPT with ``fully_shard`` and train
   it with ``fismo_core.backends.torch.FISMO`` (matrices) and its AdamW groups
   (embeddings, norms, the head) for ``--steps // 2`` steps, then save model
   and optimizer with ``torch.distributed.checkpoint``
   (``get_state_dict`` + ``dcp.save``);
2. 2 processes build the same model and optimizer, load the checkpoint
   (``dcp.load`` + ``set_state_dict``: FSDP2 and FISMO reshard it to the new
   world) and train to ``--steps``;
3. with ``--check``, one process trains the same model for ``--steps`` steps
   without interruption on the whole batch, and the script compares the final
   parameters (float64): they agree to rounding (the ranks average their
   shards' mean gradients instead of taking the whole batch's mean).

The data is the Python standard library's source as bytes (the demo's
corpus); every step takes the same global batch in every run, and each rank
its slice of it.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

BATCH = 48  # global batch (sequences): each world size must divide it (1, 2, 3, 4, 6, 8, 12, 16, 24 or 48)
CONTEXT = 32
TOLERANCE = 1e-10  # float64: shard-averaged gradients differ from the whole batch's at rounding (~1e-15)


def build_model() -> torch.nn.Module:
    from fismo_core.demo.models import TinyGPT

    torch.manual_seed(0)
    return TinyGPT(context=CONTEXT, dim=32, layers=2, heads=2).double()


def build_optimizer(model: torch.nn.Module):
    from fismo_core.backends.torch import FISMO, param_groups

    return FISMO(param_groups(model, adamw_options={"lr": 3e-3}), lr=0.02, nesterov=True, weight_decay=0.01)


_TEXT: list[torch.Tensor] = []


def _corpus() -> torch.Tensor:
    """The demo's training text (200 KB of the standard library's source), read once per process."""
    from fismo_core.demo.data import load_stdlib_corpus

    if not _TEXT:
        _TEXT.append(load_stdlib_corpus(max_train_bytes=200_000, max_val_bytes=1).train)
    return _TEXT[0]


def batch(step: int, rank: int = 0, world: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step`` (the same in every run), and this rank's slice of it."""
    text = _corpus()
    starts = torch.randint(0, len(text) - CONTEXT - 1, (BATCH,), generator=torch.Generator().manual_seed(step))
    windows = torch.stack([text[s : s + CONTEXT + 1] for s in starts.tolist()]).long()
    rows = windows.chunk(world)[rank]
    return rows[:, :-1], rows[:, 1:]


def train(model, opt, steps: range, rank: int = 0, world: int = 1) -> float:
    loss = torch.tensor(float("nan"))
    for step in steps:
        x, y = batch(step, rank, world)
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
    return float(loss.detach())


def shard(model: torch.nn.Module, world: int) -> torch.nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _run(rank: int, world: int, phase: str, steps: int, workdir: str, saved_by: int) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"file://{workdir}/store-{phase}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    try:
        model = shard(build_model(), world)
        opt = build_optimizer(model)
        checkpoint = f"{workdir}/checkpoint"
        if phase == "before":
            loss = train(model, opt, range(steps // 2), rank, world)
            model_sd, optim_sd = get_state_dict(model, opt)
            dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=checkpoint)
            where = f"saved at step {steps // 2} to {checkpoint}"
        else:
            model_sd, optim_sd = get_state_dict(model, opt)
            state = {"model": model_sd, "optim": optim_sd}
            dcp.load(state, checkpoint_id=checkpoint)
            set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
            loss = train(model, opt, range(steps // 2, steps), rank, world)
            final = [p.full_tensor().detach() for p in model.parameters()]
            if rank == 0:
                torch.save(final, f"{workdir}/resumed.pt")
            where = f"resumed from the {saved_by}-rank checkpoint and finished step {steps}"
        if rank == 0:
            print(f"{world} ranks: loss on rank 0's slice {loss:.4f}; {where}", flush=True)
        # Every rank done before any tears the group down: a rank that destroyed it while rank 0 was still
        # saving was once aborted by gloo ("terminate called without an active exception", 2026-12-04).
        dist.barrier()
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="training steps in all (default 20)")
    parser.add_argument("--before", type=int, default=4, help="ranks before the checkpoint (default 4)")
    parser.add_argument("--after", type=int, default=2, help="ranks after it (default 2)")
    parser.add_argument("--check", action="store_true", help="compare with one uninterrupted process")
    args = parser.parse_args(argv)
    sizes = [w for w in range(1, BATCH + 1) if BATCH % w == 0]
    if args.before not in sizes or args.after not in sizes:
        parser.error(f"the world sizes must divide the global batch of {BATCH}: one of {sizes}")
    if args.steps < 2:  # a step-0 checkpoint would first take a step of lr 0 (torch's _init_optim_state)
        parser.error(f"--steps must be at least 2, got {args.steps}: the checkpoint is taken after steps // 2")
    with tempfile.TemporaryDirectory() as workdir:
        mp.start_processes(_run, args=(args.before, "before", args.steps, workdir, args.before),
                           nprocs=args.before, start_method="spawn")
        mp.start_processes(_run, args=(args.after, "after", args.steps, workdir, args.before),
                           nprocs=args.after, start_method="spawn")
        resumed = torch.load(f"{workdir}/resumed.pt")
    if not args.check:
        return 0
    model = build_model()
    train(model, build_optimizer(model), range(args.steps))
    worst = max(float((a - b).norm() / b.norm()) for a, b in zip(resumed, (p.detach() for p in model.parameters())))
    print(f"uninterrupted single process: largest relative difference of a parameter {worst:.1e} "
          f"({'within' if worst <= TOLERANCE else 'ABOVE'} {TOLERANCE:.0e})")
    return 0 if worst <= TOLERANCE else 1


if __name__ == "__main__":
    sys.exit(main())
