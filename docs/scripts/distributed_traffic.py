"""What FISMO's optimizer step sends between ranks under FSDP2, for GPT-2 small's 48 matrices, on 2, 4 and 8 ranks.

Run: ``python docs/scripts/distributed_traffic.py`` (gloo on CPU; about a minute on 2 cores).

Each world size is one spawn of gloo ranks holding GPT-2 small's 48 matrices
(12 layers of ``c_attn`` 2304x768, ``attn.c_proj`` 768x768, ``c_fc`` 3072x768,
``mlp.c_proj`` 768x3072, as ``nn.Linear`` weights) as ``DTensor`` s sharded
``Shard(0)`` over a 1-D mesh, as FSDP2 leaves them. Every ``torch.distributed``
call of one optimizer step (after the first, which creates the state) is
counted with the bytes this rank sends to other ranks. To keep it fast the
matrices are GPT-2's divided by 16 in each dimension (144x48, ...): every
message of the step is a set of whole shards of a gradient or a direction, so
its size is exactly 16^2 = 256 times smaller than at full size (the shapes
divide evenly by 2, 4 and 8 at both sizes, so no padding differs), and the
script prints the full-size figures. ``--worlds`` refuses a world size that
does not divide the small matrices' rows (``EXACT_WORLDS``: the divisors of
48): their uneven shards would not scale to the full size's exactly.
``torch.optim.AdamW`` on the same ``DTensor`` s is counted the same way. The
owners' load balance is the adapter's cost model (``m^3 + n^3 + m n min(m, n)``
per matrix) at full size, from the owner table of the run.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SCALE = 16
GPT2_SMALL = [(2304, 768), (768, 768), (3072, 768), (768, 3072)] * 12
#: The world sizes whose figures are exact: the divisors of every row count of the matrices run (144, 48, 192).
_ROWS = math.gcd(*(m // SCALE for m, _ in GPT2_SMALL))
EXACT_WORLDS = [w for w in range(1, _ROWS + 1) if _ROWS % w == 0]


def _count_collectives(counts: dict) -> None:
    """Wrap the collectives the step may use so each call adds to ``counts``: calls, and bytes sent to others."""
    rank, world = dist.get_rank(), dist.get_world_size()

    def wrap(name, sent_bytes):
        original = getattr(dist, name)

        def counted(*args, **kwargs):
            counts.setdefault(name, [0, 0])
            counts[name][0] += 1
            counts[name][1] += sent_bytes(*args, **kwargs)
            return original(*args, **kwargs)

        setattr(dist, name, counted)

    def all_to_all_bytes(output, input, output_split_sizes=None, input_split_sizes=None, group=None, **_):
        sizes = input_split_sizes or [input.numel() // world] * world
        me = dist.get_rank(group) if group is not None else rank
        return (sum(sizes) - sizes[me]) * input.element_size()

    def broadcast_bytes(tensor, src=None, group=None, group_src=None, **_):
        me = dist.get_rank(group) if group is not None else rank
        source = group_src if group_src is not None else src
        return tensor.numel() * tensor.element_size() * (world - 1) if me == source else 0

    def all_reduce_bytes(tensor, *args, **kwargs):
        return tensor.numel() * tensor.element_size()  # the tensor's size (a ring sends about 2 (W-1)/W of it)

    wrap("all_to_all_single", all_to_all_bytes)
    wrap("broadcast", broadcast_bytes)
    wrap("all_reduce", all_reduce_bytes)


def _worker(rank: int, world: int, store: str, out: str) -> None:
    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard, distribute_tensor

        from fismo_core.backends.torch import FISMO
        from fismo_core.backends.torch import _direction_cost  # the adapter's cost model of owners

        mesh = init_device_mesh("cpu", (world,))
        gen = torch.Generator().manual_seed(0)

        def dtensors():
            params = []
            for m, n in GPT2_SMALL:
                p = torch.nn.Parameter(distribute_tensor(torch.randn(m // SCALE, n // SCALE, generator=gen), mesh, [Shard(0)]))
                p.grad = distribute_tensor(torch.randn(m // SCALE, n // SCALE, generator=gen) * 1e-3, mesh, [Shard(0)])
                params.append(p)
            return params

        result = {}
        for name, make in [
            ("FISMO", lambda ps: FISMO(ps, lr=0.02)),
            ("FISMO block_size=256", lambda ps: FISMO(ps, lr=0.02, block_size=256 // SCALE)),
            ("AdamW", lambda ps: torch.optim.AdamW(ps, lr=1e-3)),
        ]:
            params = dtensors()
            opt = make(params)
            opt.step()  # creates the state
            counts: dict = {}
            originals = {k: getattr(dist, k) for k in ("all_to_all_single", "broadcast", "all_reduce")}
            _count_collectives(counts)
            try:
                opt.step()
            finally:
                for k, v in originals.items():
                    setattr(dist, k, v)
            result[name] = counts
            if name.startswith("FISMO"):
                table = opt._placements()
                owners = [table[p].owner for p in params]
                block = 256 if "256" in name else None
                load = [0.0] * world
                for owner, (m, n) in zip(owners, GPT2_SMALL):
                    load[owner] += _direction_cost(torch.empty(m, n, device="meta"), block)
                result[name + " load"] = load
        torch.save(result, f"{out}.{rank}")
        dist.barrier()  # no rank tears the group down while another still saves (gloo aborted one: SIGABRT)
    finally:
        dist.destroy_process_group()


def measure(world: int) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_worker, args=(world, f"{tmp}/store", f"{tmp}/out"), nprocs=world, start_method="spawn")
        return [torch.load(f"{tmp}/out.{rank}", weights_only=False) for rank in range(world)]


def main(argv: list[str] | None = None) -> int:
    from _arguments import positive_int  # docs/scripts/, on sys.path when the script runs

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=positive_int, nargs="+", default=[2, 4, 8],
                        help=f"world sizes, each one of {', '.join(map(str, EXACT_WORLDS))} (default: 2 4 8)")
    args = parser.parse_args(argv)
    inexact = [w for w in args.worlds if w not in EXACT_WORLDS]
    if inexact:
        parser.error(f"--worlds {' '.join(map(str, inexact))}: the full-size figures are exact only for world sizes "
                     f"that divide the matrices' rows evenly: {', '.join(map(str, EXACT_WORLDS))}")
    params_bytes = sum(m * n for m, n in GPT2_SMALL) * 4
    print(f"GPT-2 small's 48 matrices: {sum(m * n for m, n in GPT2_SMALL) / 1e6:.1f} M parameters, "
          f"{params_bytes / 2**20:.0f} MiB in float32; FSDP2's own gradient reduce-scatter sends about "
          "(W-1)/W of that per rank per step")
    print("| ranks | optimizer | collective calls per rank | MiB sent per rank (mean) | owner load max/mean |")
    print("|---|---|---|---|---|")
    for world in args.worlds:
        start = time.perf_counter()
        runs = measure(world)
        for name in ("FISMO", "FISMO block_size=256", "AdamW"):
            calls = {k: v[0] for k, v in runs[0][name].items()}
            # Shards scale with SCALE^2; the all-reduce of the gradients' finiteness flags does not.
            sent = sum(
                sum(v[1] * (1 if k == "all_reduce" else SCALE**2) for k, v in run[name].items()) for run in runs
            ) / world
            described = ", ".join(f"{v} {k}" for k, v in sorted(calls.items())) or "none"
            balance = ""
            if name + " load" in runs[0]:
                load = runs[0][name + " load"]
                balance = f"{max(load) / (sum(load) / world):.2f}"
            print(f"| {world} | {name} | {described} | {sent / 2**20:.1f} | {balance} |")
        print(f"(measured in {time.perf_counter() - start:.0f} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
