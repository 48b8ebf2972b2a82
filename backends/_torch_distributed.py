"""Distributed partitioning of the torch adapter: where each matrix lives, who owns it, and the collectives.

Part of [`fismo_core.backends.torch`][fismo_core.backends.torch]. Every FISMO
matrix has one owner rank, which keeps its state and computes its direction;
how the matrix is laid out is one `Placement` object with the same phases
for every layout (gather the gradient, compute on the owner, apply line 9 and
synchronise; export and import its state for checkpoints):

- `LocalPlacement`: one process;
- `ReplicatedPlacement`: DDP (replicated parameters, an explicit ``process_group``);
- `ShardedPlacement`: ``DTensor`` parameters sharded on one dimension over one
  mesh dimension and replicated over the others: FSDP2 (``Shard(0)``,
  ``Shard(1)``), HSDP, 1-D tensor parallelism.

`placements` builds them (owners greedy, least loaded, the same table on every
rank); a bucket's collectives are started asynchronously and return
``(work, finish)``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Iterable
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


def local_tensor(t: Any) -> torch.Tensor:
    """This rank's data of ``t``: its shard for a ``DTensor``, else ``t`` itself."""
    return t.to_local() if is_dtensor(t) else t


def local_device(p: torch.Tensor) -> torch.device:
    """The device of ``p``'s local data (its shard for a ``DTensor``)."""
    return local_tensor(p).device


def shard_mesh_dim(p: Any) -> Optional[int]:
    """The mesh dimension over which a ``DTensor`` is sharded (`validate_dtensor` allows one), or ``None``."""
    from torch.distributed.tensor import Shard

    sharded = [i for i, q in enumerate(p.placements) if isinstance(q, Shard)]
    return sharded[0] if sharded else None


def mesh_groups(p: Any) -> Optional[tuple]:
    """The process groups of every dimension of a sharded ``DTensor``'s mesh (``None`` if it is replicated
    everywhere): the shard group (FSDP2, TP) and, for HSDP, the replicate group too. A flag all-reduced over
    each in turn is agreed by every rank of the mesh."""
    if shard_mesh_dim(p) is None:
        return None
    return tuple(p.device_mesh.get_group(d) for d in range(p.device_mesh.ndim))


def validate_dtensor(p: Any, name: str) -> None:
    """A ``DTensor`` FISMO parameter: at most one ``Shard`` placement, every other mesh dimension ``Replicate``.

    That covers FSDP2 (``Shard(0)`` on a 1-D mesh, or ``Shard(1)`` with
    ``fully_shard(..., shard_placement_fn=...)``), HSDP (``(Replicate(), Shard(0))``
    on a 2-D mesh) and 1-D tensor parallelism (``ColwiseParallel``: ``Shard(0)``,
    ``RowwiseParallel``: ``Shard(1)``). A matrix sharded on two mesh dimensions
    (FSDP2 combined with tensor parallelism) or held as a ``Partial`` sum is refused.
    """
    from torch.distributed.tensor import Replicate, Shard

    shards = [q for q in p.placements if isinstance(q, Shard)]
    others = [q for q in p.placements if not isinstance(q, (Shard, Replicate))]
    if len(shards) > 1 or others:
        raise NotImplementedError(
            f"{name} is a DTensor with placements {p.placements} on a {p.device_mesh.ndim}-D mesh; the FISMO "
            "adapter supports matrices sharded on at most one mesh dimension and replicated on the others: "
            "FSDP2 (Shard(0) or Shard(1)), HSDP ((Replicate(), Shard(0)) on a 2-D mesh) and 1-D tensor "
            "parallelism (ColwiseParallel, RowwiseParallel). Shard such a module with one of these, or keep "
            "it out of FISMO's groups (an 'adamw' group takes any DTensor layout)"
        )



# ---------------------------------------------------------------- placements
#: A started collective: its work handle (``None`` when nothing was sent) and the function to call after ``wait()``.
Pending = tuple[Any, Callable[[], Any]]
#: Line 9 on one tensor: ``update(data, direction)``, ``data`` the parameter or this rank's shard of it.
Update = Callable[[torch.Tensor, torch.Tensor], None]


class Placement:
    """How one FISMO matrix is laid out across processes, with the phases of a step and of a checkpoint.

    Every rank builds the same placements (`placements`). Matrices with the
    same `exchange_key` travel together: a step runs `start_gather` on each
    such bucket (the full gradients reach their owners), the owners compute
    the directions, then `start_apply` (line 9 on the data each rank holds,
    and whatever synchronisation the layout needs). ``state_dict`` calls
    `export` on each state tensor: the owner's tensor in a layout that does
    not depend on who owns it, so ``torch.distributed.checkpoint`` can
    reshard it. A new layout is a new subclass.
    """

    owner: int = 0
    rank: int = 0
    distributed: bool = False
    """Whether the matrix's state lives on one rank of several (it then needs `export` in checkpoints)."""

    @property
    def owns(self) -> bool:
        """Whether this rank keeps the matrix's state and computes its direction."""
        return self.owner == self.rank

    def exchange_key(self, p: torch.Tensor) -> Hashable:
        """Matrices with equal keys share their collectives (one bucket); unique per matrix by default."""
        return id(p)

    def start_gather(self, bucket: list[tuple[torch.Tensor, "Placement"]]) -> Pending:
        """Start bringing each matrix's full gradient to its owner; ``finish()`` gives ``{p: gradient}`` of those owned here."""
        return None, lambda: {p: p.grad for p, placement in bucket if placement.owns}

    def start_apply(self, bucket: list[tuple[torch.Tensor, "Placement"]], directions: dict, updates: dict) -> Pending:
        """Line 9 (``updates[p]``) on this rank's data of each matrix, with the owners' ``directions``; then synchronise."""
        for p, _ in bucket:
            updates[p](p, directions[p])
        return None, lambda: None

    def export(
        self, value: Optional[torch.Tensor], shape: tuple, dtype: torch.dtype, device: Any
    ) -> Optional[torch.Tensor]:
        """A state tensor for ``state_dict``: the owner's ``value`` (``None`` elsewhere) in the checkpoint layout."""
        return value


class LocalPlacement(Placement):
    """A matrix of one process (no data parallelism): it owns it."""


class ReplicatedPlacement(Placement):
    """DDP: every rank holds the whole matrix and the averaged gradient; its owner steps it and sends it to the others.

    A bucket of same-shape matrices is synchronised with one broadcast per
    owning rank (its matrices of the bucket, flattened together).
    """

    distributed = True

    def __init__(self, group: Any, owner: int) -> None:
        self.group, self.owner, self.rank = group, owner, torch.distributed.get_rank(group)

    def exchange_key(self, p: torch.Tensor) -> Hashable:
        return ("replicated", self.group, tuple(p.shape), p.dtype, p.device)

    def start_apply(self, bucket: list[tuple[torch.Tensor, "Placement"]], directions: dict, updates: dict) -> Pending:
        by_owner: dict[int, list[torch.Tensor]] = {}
        for p, placement in bucket:
            if placement.owns:
                updates[p](p, directions[p])
            by_owner.setdefault(placement.owner, []).append(p)
        works, finishes = [], []
        for owner, params in sorted(by_owner.items()):
            flat = torch.cat([p.detach().reshape(-1) for p in params]) if owner == self.rank else torch.empty(
                sum(p.numel() for p in params), dtype=params[0].dtype, device=params[0].device
            )
            works.append(torch.distributed.broadcast(flat, group=self.group, group_src=owner, async_op=True))
            if owner != self.rank:
                finishes.append((params, flat))

        def finish() -> None:
            for work in works:
                work.wait()
            for params, flat in finishes:
                for p, value in zip(params, flat.split([p.numel() for p in params])):
                    p.copy_(value.view(p.shape))

        return None, finish

    def export(
        self, value: Optional[torch.Tensor], shape: tuple, dtype: torch.dtype, device: Any
    ) -> Optional[torch.Tensor]:
        # Every rank saves the whole tensor, so the checkpoint is a replicated one (DCP keeps one copy).
        return _broadcast_value(value if self.owns else None, shape, dtype, device, self.group, self.owner)


class ShardedPlacement(Placement):
    """A ``DTensor`` matrix sharded on one tensor dimension over one mesh dimension, replicated over any others.

    FSDP2 (``Shard(0)``, ``Shard(1)``), HSDP (``(Replicate(), Shard(0))``: each
    replica group runs the same computation on the same data, so replicas stay
    equal without communicating) and 1-D tensor parallelism. A bucket of
    same-shape matrices sharded alike exchanges its gradient shards in one
    all-to-all (each shard to its matrix's owner, as Dion does for Muon) and
    its direction shards in another. In a checkpoint, each state tensor is a
    ``DTensor`` on the parameter's mesh, ``Shard(0)`` over the same mesh
    dimension, whoever owns it: DCP reshards that to any world size.
    """

    def __init__(self, p: Any, owner: int) -> None:  # p: a DTensor
        self.mesh = p.device_mesh
        self.mesh_dim = shard_mesh_dim(p)
        sharded = self.mesh_dim is not None
        self.dim = p.placements[self.mesh_dim].dim if sharded else None
        self.group = self.mesh.get_group(self.mesh_dim) if sharded else None
        self.distributed = sharded
        self.owner = owner
        self.rank = self.mesh.get_local_rank(self.mesh_dim) if sharded else owner

    def exchange_key(self, p: torch.Tensor) -> Hashable:
        return ("sharded", self.group, self.dim, tuple(p.shape), p.dtype, local_tensor(p).device)

    def start_gather(self, bucket: list[tuple[torch.Tensor, "Placement"]]) -> Pending:
        if self.group is None or self.dim is None:
            # replicated on every mesh dimension: the local tensor is the whole gradient
            return None, lambda: {p: local_tensor(p.grad) for p, _ in bucket}
        p0 = bucket[0][0]
        exchange = _Exchange(p0.shape, self.dim, self.group, self.rank, [placement.owner for _, placement in bucket])
        shards = [exchange.padded(local_tensor(p.grad)) for p, _ in bucket]
        work, finish = exchange.start(shards, local_tensor(p0.grad).dtype, local_tensor(p0.grad).device)
        return work, lambda: dict(zip([p for p, placement in bucket if placement.owns], finish()))

    def start_apply(self, bucket: list[tuple[torch.Tensor, "Placement"]], directions: dict, updates: dict) -> Pending:
        if self.group is None or self.dim is None:
            for p, _ in bucket:
                updates[p](local_tensor(p), directions[p])
            return None, lambda: None
        p0 = bucket[0][0]
        exchange = _Exchange(p0.shape, self.dim, self.group, self.rank, [placement.owner for _, placement in bucket])
        dtype, device = direction_dtype(p0), local_tensor(p0).device
        mine = [exchange.split(directions[p]) for p, placement in bucket if placement.owns]
        work, finish = exchange.start_back(mine, dtype, device)

        def apply() -> None:
            for (p, _), shard in zip(bucket, finish()):
                updates[p](local_tensor(p), shard)

        return work, apply

    def export(
        self, value: Optional[torch.Tensor], shape: tuple, dtype: torch.dtype, device: Any
    ) -> Optional[torch.Tensor]:
        from torch.distributed.tensor import DTensor, Replicate, Shard

        if self.group is None or self.mesh_dim is None:
            return value
        if len(shape) == 0:  # a counter: the same plain tensor on every rank
            return _broadcast_value(value if self.owns else None, shape, dtype, device, self.group, self.owner)
        exchange = _Exchange(torch.Size(shape), 0, self.group, self.rank, [self.owner])
        mine = []
        if self.owns:
            assert value is not None  # the owner holds the state
            mine.append(exchange.split(value))
        work, finish = exchange.start_back(mine, dtype, device)
        work.wait()
        placements: list[Any] = [Replicate()] * self.mesh.ndim
        placements[self.mesh_dim] = Shard(0)
        return DTensor.from_local(
            finish()[0].contiguous(), self.mesh, placements, run_check=False, shape=torch.Size(shape),
            stride=torch.empty(shape, device="meta").stride(),
        )


class _Exchange:
    """The all-to-alls of a bucket of same-shape tensors sharded on ``dim`` (``torch.chunk`` layout) over ``group``.

    ``owners[j]`` is the rank that holds tensor ``j`` whole. Shards are padded
    to the chunk size, so every message has the same size per tensor.
    """

    def __init__(self, shape: torch.Size, dim: int, group: Any, rank: int, owners: list[int]) -> None:
        self.shape, self.dim, self.group, self.rank, self.owners = shape, dim, group, rank, owners
        self.world = torch.distributed.get_world_size(group)
        self.chunk, self.counts = row_chunks(shape[dim], self.world)
        moved = list(shape)
        moved[0], moved[dim] = moved[dim], moved[0]
        self.moved = moved  # the shape with ``dim`` first
        self.numel = self.chunk * math.prod(moved[1:])
        self.mine = [j for j, owner in enumerate(owners) if owner == rank]

    def padded(self, local: torch.Tensor) -> torch.Tensor:
        """This rank's shard, ``dim`` first, padded to ``chunk`` rows."""
        if local.shape[self.dim] != self.counts[self.rank]:
            raise RuntimeError(
                f"unexpected shard of a {tuple(self.shape)} DTensor on rank {self.rank}: local shape "
                f"{tuple(local.shape)}, expected {self.counts[self.rank]} along dim {self.dim} (torch.chunk layout)"
            )
        padded = local.new_zeros((self.chunk, *self.moved[1:]))
        padded[: self.counts[self.rank]] = local.transpose(0, self.dim)
        return padded

    def split(self, full: torch.Tensor) -> list[torch.Tensor]:
        """An owned tensor (any shape with the right number of elements) as its ``world`` padded shards."""
        full = full.reshape(self.shape).transpose(0, self.dim)
        padded = full.new_zeros((self.chunk * self.world, *self.moved[1:]))
        padded[: self.shape[self.dim]] = full
        return list(padded.split(self.chunk)) if self.chunk else [padded[:0]] * self.world

    def start(self, shards: list[torch.Tensor], dtype: torch.dtype, device: Any) -> Pending:
        """Shards of every tensor to its owner; ``finish()`` gives the owned tensors whole, in bucket order."""
        send = [shards[j].reshape(-1) for r in range(self.world) for j, owner in enumerate(self.owners) if owner == r]
        send_sizes = [self.numel * self.owners.count(r) for r in range(self.world)]
        received = torch.empty(self.numel * len(self.mine) * self.world, dtype=dtype, device=device)
        work = _all_to_all(received, send, [self.numel * len(self.mine)] * self.world, send_sizes, self.group)

        def finish() -> list[torch.Tensor]:
            # received: from each rank s, its shard of each owned tensor, in bucket order
            pieces = received.view(self.world, len(self.mine), self.chunk, *self.moved[1:])
            whole = [pieces[:, k].reshape(self.chunk * self.world, *self.moved[1:])[: self.shape[self.dim]]
                     for k in range(len(self.mine))]
            return [w.transpose(0, self.dim) for w in whole]

        return work, finish

    def start_back(self, mine: list[list[torch.Tensor]], dtype: torch.dtype, device: Any) -> Pending:
        """Each owned tensor's shards (``mine``: `split` of each, in bucket order) to their ranks; ``finish()`` gives this rank's shard of every tensor."""
        send = [shards[r].reshape(-1) for r in range(self.world) for shards in mine]
        received = torch.empty(self.numel * len(self.owners), dtype=dtype, device=device)
        receive_sizes = [self.numel * self.owners.count(s) for s in range(self.world)]
        work = _all_to_all(received, send, receive_sizes, [self.numel * len(mine)] * self.world, self.group)

        def finish() -> list[torch.Tensor]:
            by_source = received.split(receive_sizes)
            taken = [0] * self.world
            shards = []
            for owner in self.owners:  # tensor j's shard came from its owner, in bucket order
                piece = by_source[owner][taken[owner] * self.numel:(taken[owner] + 1) * self.numel]
                taken[owner] += 1
                shards.append(piece.view(self.chunk, *self.moved[1:])[: self.counts[self.rank]].transpose(0, self.dim))
            return shards

        return work, finish


def _all_to_all(received: torch.Tensor, send: list[torch.Tensor], receive_sizes: list[int], send_sizes: list[int],
                group: Any) -> Any:
    """One asynchronous ``all_to_all_single`` of the flattened ``send`` pieces."""
    flat = torch.cat(send) if send else received.new_empty(0)
    return torch.distributed.all_to_all_single(
        received, flat, output_split_sizes=receive_sizes, input_split_sizes=send_sizes, group=group, async_op=True
    )


def _broadcast_value(value: Optional[torch.Tensor], shape: tuple, dtype: torch.dtype, device: Any, group: Any,
                     owner: int) -> torch.Tensor:
    """The owner's ``value`` (``None`` on the other ranks) on every rank of ``group``, as a new tensor."""
    buffer = value.clone(memory_format=torch.contiguous_format) if value is not None else torch.empty(
        shape, dtype=dtype, device=device
    )
    torch.distributed.broadcast(buffer, group=group, group_src=owner)
    return buffer


def direction_dtype(p: torch.Tensor) -> torch.dtype:
    """The dtype of a matrix's direction: the state's (the core's precision policy)."""
    from fismo_core.optimizer import state_dtype

    return state_dtype(torch, p.dtype)


def owner_groups(placements: dict[torch.Tensor, "Placement"]) -> list[tuple[Any, torch.device]]:
    """The process groups among whose ranks matrices are owned, each once, in parameter order (the same
    on every rank), with the device their collectives run on."""
    groups: dict[Any, torch.device] = {}
    for p, placement in placements.items():
        group = getattr(placement, "group", None)
        if placement.distributed and group is not None:
            groups.setdefault(group, local_device(p))
    return list(groups.items())


def full_tensor(t: Any) -> torch.Tensor:
    """The whole tensor of a ``DTensor`` (a collective over its mesh), or ``t`` itself."""
    return t.full_tensor() if is_dtensor(t) else t


# ---------------------------------------------------------------- ownership
def placements(
    matrices: Iterable[tuple[torch.Tensor, Any]], process_group: Any, cost: Callable[[torch.Tensor, Any], float]
) -> dict[torch.Tensor, Placement]:
    """The placement of every FISMO matrix, with its owner rank (within its shard or process group).

    ``matrices`` are the FISMO parameters in parameter order, each with its
    group's ``block_size``; ``cost(p, block_size)`` is the cost of its
    direction (``m^3 + n^3 + m n min(m, n)`` for full factors: two inverse
    roots and the polar factor). Owners are assigned greedily, least loaded
    first, in parameter order, per process group. The table depends only on
    the param groups and the world, so every rank computes the same one, and
    it is stable across steps (a matrix's state lives on its owner); a
    checkpoint resumed on another world recomputes it.
    """
    table: dict[torch.Tensor, Placement] = {}
    loads: dict[Any, list[float]] = {}

    def least_loaded(group: Any, p: torch.Tensor, block_size: Any) -> int:
        if group not in loads:
            loads[group] = [0.0] * torch.distributed.get_world_size(group)
        load = loads[group]
        owner = min(range(len(load)), key=load.__getitem__)
        load[owner] += cost(p, block_size)
        return owner

    placement: Placement
    for p, block_size in matrices:
        if is_dtensor(p):
            placement = ShardedPlacement(p, 0)
            if placement.group is not None:
                placement.owner = least_loaded(placement.group, p, block_size)
        elif process_group is not None:
            placement = ReplicatedPlacement(process_group, least_loaded(process_group, p, block_size))
        else:
            placement = LocalPlacement()
        table[p] = placement
    return table


# ---------------------------------------------------------------- communication
def row_chunks(rows: int, world: int) -> tuple[int, list[int]]:
    """Sizes per rank of a dimension sharded ``world`` ways (``torch.chunk`` semantics, as DTensor's ``Shard``)."""
    chunk = -(-rows // world) if rows else 0
    return chunk, [max(0, min(chunk, rows - r * chunk)) for r in range(world)]
