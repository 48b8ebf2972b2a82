"""Distributed partitioning of the torch adapter: who owns each matrix, and the collectives that move it.

Part of [`fismo_core.backends.torch`][fismo_core.backends.torch]. Under DDP
(replicated parameters, an explicit ``process_group``) and FSDP2 (``DTensor``
parameters sharded on dim 0 of a 1-D mesh) every FISMO matrix has one owner
rank, which keeps its state and computes its direction:

- `comm` says how a parameter is distributed, `owners` assigns the owners
  (greedy, least loaded, the same table on every rank),
- `gather_rows` brings a sharded gradient to its owner, `scatter_rows` sends
  the owner's direction back as shards, `broadcast` sends a replicated
  parameter from its owner to the other replicas.

All collectives are started asynchronously and return ``(work, finish)``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Optional

import torch


def _dtensor_type() -> Optional[type]:
    if not torch.distributed.is_available():
        return None
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without DTensor
        return None
    return DTensor


_DTensor = _dtensor_type()


def is_dtensor(t: Any) -> bool:
    """Whether ``t`` is a ``torch.distributed.tensor.DTensor`` (FSDP2's parameters and gradients)."""
    return _DTensor is not None and isinstance(t, _DTensor)


def local_device(p: torch.Tensor) -> torch.device:
    """The device of ``p``'s local data (its shard for a ``DTensor``)."""
    return p.to_local().device if is_dtensor(p) else p.device


def validate_dtensor(p: Any, name: str) -> None:
    """Only FSDP2's default layout is supported: ``Shard(0)`` on a 1-D mesh."""
    from torch.distributed.tensor import Shard

    if p.device_mesh.ndim != 1 or len(p.placements) != 1 or p.placements[0] != Shard(0):
        raise NotImplementedError(
            f"{name} is a DTensor with placements {p.placements} on a {p.device_mesh.ndim}-D mesh; the FISMO "
            "adapter supports FSDP2's default layout only (Shard(0) on a 1-D mesh)"
        )


# ---------------------------------------------------------------- ownership
def comm(p: torch.Tensor, process_group: Any) -> tuple[str, Any]:
    """``("local", None)``, ``("replicated", process_group)`` or ``("sharded", mesh_group)``."""
    if is_dtensor(p):
        return "sharded", p.device_mesh.get_group()
    if process_group is not None:
        return "replicated", process_group
    return "local", None


def owners(
    matrices: Iterable[tuple[torch.Tensor, Any]], process_group: Any, cost: Callable[[torch.Tensor, Any], float]
) -> dict[torch.Tensor, int]:
    """Owner rank (within its process group) of every distributed FISMO matrix.

    ``matrices`` are the FISMO parameters in parameter order, each with its
    group's ``block_size``; ``cost(p, block_size)`` is the cost of its
    direction (``m^3 + n^3 + m n min(m, n)`` for full factors: two inverse
    roots and the polar factor). Greedy least-loaded assignment
    in parameter order. It depends only on the param groups, so every rank
    computes the same table, and it is stable across steps (a matrix's
    state lives on its owner).
    """
    table: dict[torch.Tensor, int] = {}
    loads: dict[Any, list[float]] = {}
    for p, block_size in matrices:
        kind, pg = comm(p, process_group)
        if kind == "local":
            continue
        if pg not in loads:
            loads[pg] = [0.0] * torch.distributed.get_world_size(pg)
        load = loads[pg]
        owner = min(range(len(load)), key=load.__getitem__)
        load[owner] += cost(p, block_size)
        table[p] = owner
    return table


# ---------------------------------------------------------------- communication
def row_chunks(rows: int, world: int) -> tuple[int, list[int]]:
    """Rows per rank of a dim-0 shard (``torch.chunk`` semantics, as DTensor's ``Shard(0)``)."""
    chunk = -(-rows // world) if rows else 0
    return chunk, [max(0, min(chunk, rows - r * chunk)) for r in range(world)]


def gather_rows(local: torch.Tensor, shape: torch.Size, pg: Any, owner: int, me: int) -> tuple[Any, Callable]:
    """Start gathering the dim-0 shards of a ``(rows, *rest)`` tensor to ``owner``.

    Shards are padded to equal size (``torch.distributed.gather`` needs that).
    Returns the work handle and a function giving the full ``(rows, *rest)``
    tensor on the owner and ``None`` elsewhere.
    """
    world = torch.distributed.get_world_size(pg)
    chunk, counts = row_chunks(shape[0], world)
    if local.shape[0] != counts[me]:
        raise RuntimeError(
            f"unexpected dim-0 shard of a {tuple(shape)} DTensor on rank {me}: {tuple(local.shape)} rows, "
            f"expected {counts[me]} (torch.chunk layout)"
        )
    padded = local.new_zeros((chunk, *shape[1:]))
    padded[: counts[me]] = local
    gathered = [torch.empty_like(padded) for _ in range(world)] if me == owner else None
    work = torch.distributed.gather(padded, gathered, group=pg, group_dst=owner, async_op=True)

    def finish() -> Optional[torch.Tensor]:
        return None if gathered is None else torch.cat(gathered)[: shape[0]]

    return work, finish


def scatter_rows(
    full: Optional[torch.Tensor],
    shape: torch.Size,
    dtype: torch.dtype,
    device: torch.device,
    pg: Any,
    owner: int,
    me: int,
) -> tuple[Any, Callable]:
    """Start scattering the owner's ``full`` (any shape with ``prod(shape)`` elements) as dim-0 shards of ``shape``."""
    world = torch.distributed.get_world_size(pg)
    chunk, counts = row_chunks(shape[0], world)
    received = torch.empty((chunk, *shape[1:]), dtype=dtype, device=device)
    pieces = None
    if me == owner:
        full = full.reshape(shape)
        padded = full.new_zeros((chunk * world, *shape[1:]))
        padded[: shape[0]] = full
        pieces = list(padded.split(chunk)) if chunk else [padded[:0] for _ in range(world)]
        pieces = [piece.contiguous() for piece in pieces]
    work = torch.distributed.scatter(received, pieces, group=pg, group_src=owner, async_op=True)
    return work, lambda: received[: counts[me]]


def broadcast(p: torch.Tensor, pg: Any, owner: int) -> tuple[Any, Callable]:
    """Start broadcasting the owner's replica of ``p`` to every rank of ``pg`` (in place)."""
    buffer = p if p.is_contiguous() else p.contiguous()
    work = torch.distributed.broadcast(buffer, group=pg, group_src=owner, async_op=True)
    return work, (lambda: None) if buffer is p else (lambda: p.copy_(buffer))
