"""``torch.distributed.checkpoint`` at any world size, and every sharded layout: gloo, CPU, float64.

This process first trains to ``RESUME_AT`` and saves with ``dcp.save`` without torch.distributed.
Three spawns share one checkpoint directory:

1. 2 ranks: FSDP2 and DDP resume that checkpoint (1 -> 2) and finish; both
   train to ``RESUME_AT`` and save with ``get_state_dict`` + ``dcp.save``;
2. 4 ranks: both resume from the 2-rank checkpoints (2 -> 4) and finish; both
   also train to ``RESUME_AT`` and save (for 4 -> 2); HSDP on a 2 x 2 mesh,
   FSDP2 with ``Shard(1)`` and tensor parallelism run uninterrupted;
3. 3 ranks, a world size that divides neither the batch nor the matrices evenly: both resume from
   the 2-rank checkpoints (2 -> 3) and finish; both also train to ``RESUME_AT`` and save;
4. 2 ranks: FSDP2 and DDP resume from the 4-rank checkpoints (4 -> 2) and the 3-rank ones (3 -> 2)
   and finish.

This process then resumes the 2-rank checkpoints (and the 4- and 3-rank ones) on a plain, undistributed
model (2 -> 1, 4 -> 1, 3 -> 1). Every finished run must equal one uninterrupted process on
the whole batch (`_single_process`).
"""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

from test_torch_distributed import STEPS, _data, _model, _optimizer, _train, spawn  # noqa: E402
from test_torch_distributed import single_process  # noqa: E402,F401  (the uninterrupted run, a fixture)

# DCP in a process without torch.distributed warns that it assumes one process: here that is the point.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

RESUME_AT = 4
TIMEOUT = 180  # seconds per spawn; a healthy one takes 10-30 s on 2 busy cores
MATRICES = [0, 2, 4, 6, 8]  # the weights' indices in model.parameters()


# ----------------------------------------------------------------- layouts
def _fsdp2(mesh, shard_dim: int = 0):
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard

    def placement(p):  # FSDP2 shards dims other than 0 only evenly: (1, 3) stays Shard(0) on 4 ranks
        even = p.ndim == 2 and p.shape[shard_dim] % mesh.size() == 0
        return Shard(shard_dim) if even else Shard(0)

    model = _model()
    for module in model:
        if isinstance(module, torch.nn.Linear):
            fully_shard(module, mesh=mesh, shard_placement_fn=placement if shard_dim else None)
    return fully_shard(model, mesh=mesh, shard_placement_fn=placement if shard_dim else None)


def _ddp():
    model = _model()
    return model, torch.nn.parallel.DistributedDataParallel(model)


def _tensor_parallel(mesh):
    """Colwise / rowwise pairs as in a transformer's MLP; the last layer stays a plain replicated tensor."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    model = _model()
    plan = {"0": ColwiseParallel(), "2": RowwiseParallel(), "4": ColwiseParallel(), "6": RowwiseParallel()}
    return parallelize_module(model, mesh, plan)


def _full(p: torch.Tensor) -> torch.Tensor:
    return (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()


def _params(model) -> list[torch.Tensor]:
    return [_full(p) for p in model.parameters()]


# ----------------------------------------------------------------- checkpoints
def _options(flatten: bool):
    """``get_state_dict``'s defaults, or torchtitan's ``flatten_optimizer_state_dict=True``."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(flatten_optimizer_state_dict=True) if flatten else None


def _save(model, opt, path: Path, flatten: bool = False) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, opt, options=_options(flatten))
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(path))


def _load(model, opt, path: Path, flatten: bool = False) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_sd, optim_sd = get_state_dict(model, opt, options=_options(flatten))
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"],
                   options=_options(flatten))


def _full_options():
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, cpu_offload=True)


def _save_consolidated(model, opt, rank: int, path: Path) -> None:
    """One whole checkpoint on rank 0: ``get_state_dict`` with ``full_state_dict=True`` gathers every
    state tensor, a collective per tensor in the order of ``opt.state_dict()["state"]``."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, opt, options=_full_options())
    if rank == 0:
        torch.save({"model": model_sd, "optim": optim_sd}, path)


def _batch(rank: int, world: int):
    """This rank's slice of the batch and its loss weight: its share of the batch times ``world``, so that the
    ranks' averaged gradients are the whole batch's mean also where ``world`` does not divide it (3 ranks)."""
    X, Y = _data()
    X, Y = X.chunk(world)[rank], Y.chunk(world)[rank]
    return X, Y, len(X) * world / len(_data()[0])


# ----------------------------------------------------------------- spawns
def _resumed(world: int, X, Y, fsdp2: Path, ddp: Path, flatten: bool = False,
             weight: float = 1.0) -> tuple[list, list]:
    """An FSDP2 model resumed from the checkpoint ``fsdp2`` and a DDP one from ``ddp``, each trained to
    ``STEPS``: their parameters."""
    from torch.distributed.device_mesh import init_device_mesh

    model = _fsdp2(init_device_mesh("cpu", (world,)))
    opt = _optimizer(model)
    _load(model, opt, fsdp2, flatten)
    _train(model, opt, X, Y, range(RESUME_AT, STEPS), weight)
    fsdp2_params = _params(model)
    model, net = _ddp()
    opt = _optimizer(model, process_group=dist.group.WORLD)
    _load(net, opt, ddp, flatten)
    _train(net, opt, X, Y, range(RESUME_AT, STEPS), weight)
    return fsdp2_params, _params(model)


def _first(rank: int, world: int, ckpt: Path) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    X, Y, _ = _batch(rank, world)
    out = {}
    # 1 -> 2: the checkpoint this process saved before the spawns, without torch.distributed (`runs`).
    out["fsdp2 1->2"], out["ddp 1->2"] = _resumed(world, X, Y, ckpt / "one-process", ckpt / "one-process")

    model = _fsdp2(init_device_mesh("cpu", (world,)))
    opt = _optimizer(model)
    _train(model, opt, X, Y, range(RESUME_AT))
    _save(model, opt, ckpt / "fsdp2-2")
    _save(model, opt, ckpt / "fsdp2-2-flat", flatten=True)
    _save_consolidated(model, opt, rank, ckpt / "fsdp2-2-full.pt")
    torch.save(opt.state_dict(), ckpt / f"fsdp2-2-rank{rank}.pt")  # per rank: resumes on 2 ranks only
    model, net = _ddp()
    opt = _optimizer(model, process_group=dist.group.WORLD)
    _train(net, opt, X, Y, range(RESUME_AT))
    _save(net, opt, ckpt / "ddp-2")
    _save(net, opt, ckpt / "ddp-2-flat", flatten=True)
    return out


def _second(rank: int, world: int, ckpt: Path) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    X, Y, _ = _batch(rank, world)
    mesh = init_device_mesh("cpu", (world,))
    out = {}
    out["fsdp2 2->4"], out["ddp 2->4"] = _resumed(world, X, Y, ckpt / "fsdp2-2", ckpt / "ddp-2")
    # torchtitan's flattened state dicts: torch rebuilds each parameter's state from the live one's keys.
    out["fsdp2 2->4, flattened"], out["ddp 2->4, flattened"] = _resumed(
        world, X, Y, ckpt / "fsdp2-2-flat", ckpt / "ddp-2-flat", flatten=True
    )

    model = _fsdp2(mesh)
    opt = _optimizer(model)
    _train(model, opt, X, Y, range(RESUME_AT))
    _save(model, opt, ckpt / "fsdp2-4")
    steps = [float(state["step"]) for state in opt.state.values()]
    try:  # a per-rank state_dict of 2 ranks (rank % 2's file) on 4
        opt.load_state_dict(torch.load(ckpt / f"fsdp2-2-rank{rank % 2}.pt", weights_only=False))
        out["per-rank 2->4"] = {"error": None}
    except ValueError as exc:
        out["per-rank 2->4"] = {"error": str(exc)}
    out["per-rank 2->4"]["unchanged"] = steps == [float(state["step"]) for state in opt.state.values()]
    model, net = _ddp()
    opt = _optimizer(model, process_group=dist.group.WORLD)
    _train(net, opt, X, Y, range(RESUME_AT))
    _save(net, opt, ckpt / "ddp-4")

    hsdp = _fsdp2(init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard")))
    opt = _optimizer(hsdp)
    _train(hsdp, opt, X, Y, range(STEPS))
    out["hsdp 2x2"] = _params(hsdp)
    out["hsdp placements"] = str(next(hsdp.parameters()).placements)
    for policy in ("skip", "raise"):
        out[f"hsdp nan, {policy}"] = _nan_in_one_replica(rank, X, Y, policy)

    model = _fsdp2(mesh, shard_dim=1)
    opt = _optimizer(model)
    _train(model, opt, X, Y, range(STEPS))
    out["fsdp2 Shard(1)"] = _params(model)
    out["Shard(1) placements"] = str(next(model.parameters()).placements)

    tp = _tensor_parallel(mesh)
    opt = _optimizer(tp)
    X_all, Y_all = _data()  # tensor parallelism: every rank sees the whole batch
    _train(tp, opt, X_all, Y_all, range(STEPS))
    out["tensor parallel"] = _params(tp)
    out["tp placements"] = [str(getattr(p, "placements", None)) for p in tp.parameters()]
    return out


def _nan_in_one_replica(rank: int, X, Y, policy: str) -> dict:
    """HSDP on 2 x 2: a NaN written into rank 1's gradient shard after FSDP2's reduction (a hook on one
    replica). What each rank says, whether its local shards changed, the step count of that matrix, and
    (``"skip"``) the parameters after one more step."""
    from torch.distributed.device_mesh import init_device_mesh

    hsdp = _fsdp2(init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard")))
    opt = _optimizer(hsdp, nonfinite=policy)
    _train(hsdp, opt, X, Y, range(1))
    opt.zero_grad()
    torch.nn.functional.mse_loss(hsdp(X), Y).backward()
    damaged = list(hsdp.parameters())[2]
    if rank == 1:
        damaged.grad.to_local()[0, 0] = float("nan")
    before = [p.to_local().clone() for p in hsdp.parameters()]
    try:
        opt.step()
        error = None
    except ValueError as exc:
        error = str(exc)
    out = {"error": error, "changed": [not torch.equal(a, p.to_local()) for a, p in zip(before, hsdp.parameters())],
           "step": float(opt.state[damaged]["step"])}
    if error is None:  # every rank stepped: the full tensors are a collective all of them reach
        _train(hsdp, opt, X, Y, range(1, 2))
        out["params"] = _params(hsdp)
    return out


def _odd(rank: int, world: int, ckpt: Path) -> dict:
    """3 ranks: (16, 12) shards into 6 + 6 + 4 rows, (1, 3) into 1 + 0 + 0, and the batch of 64 into 22 + 22 + 20."""
    from torch.distributed.device_mesh import init_device_mesh

    X, Y, weight = _batch(rank, world)
    out = {}
    out["fsdp2 2->3"], out["ddp 2->3"] = _resumed(world, X, Y, ckpt / "fsdp2-2", ckpt / "ddp-2", weight=weight)
    model = _fsdp2(init_device_mesh("cpu", (world,)))
    opt = _optimizer(model)
    _train(model, opt, X, Y, range(RESUME_AT), weight)
    _save(model, opt, ckpt / "fsdp2-3")
    model, net = _ddp()
    opt = _optimizer(model, process_group=dist.group.WORLD)
    _train(net, opt, X, Y, range(RESUME_AT), weight)
    _save(net, opt, ckpt / "ddp-3")
    return out


def _third(rank: int, world: int, ckpt: Path) -> dict:
    X, Y, _ = _batch(rank, world)
    out = {}
    out["fsdp2 4->2"], out["ddp 4->2"] = _resumed(world, X, Y, ckpt / "fsdp2-4", ckpt / "ddp-4")
    out["fsdp2 3->2"], out["ddp 3->2"] = _resumed(world, X, Y, ckpt / "fsdp2-3", ckpt / "ddp-3")
    return out


def _worker(rank: int, world: int, phase: str, store: str, ckpt: str, out: str) -> None:
    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=world, timeout=timedelta(seconds=90)
    )
    try:
        result = {"first": _first, "second": _second, "odd": _odd, "third": _third}[phase](rank, world, Path(ckpt))
        torch.save(result, f"{out}.{rank}")
        dist.barrier()  # no rank tears the group down while another still saves (see docs/examples/fsdp2_resume.py)
    finally:
        dist.destroy_process_group()


def _spawn(tmp: Path, world: int, phase: str) -> list[dict]:
    args = (world, phase, str(tmp / f"store-{phase}"), str(tmp / "ckpt"), str(tmp / phase))
    spawn(_worker, args, world, TIMEOUT, f"the {phase} spawn ({world} ranks)")
    return [torch.load(tmp / f"{phase}.{rank}", weights_only=False) for rank in range(world)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("dcp")
    (tmp / "ckpt").mkdir()
    model = _model()  # the 1 -> 2 checkpoint: dcp.save in a process without torch.distributed
    opt = _optimizer(model)
    X, Y = _data()
    _train(model, opt, X, Y, range(RESUME_AT))
    _save(model, opt, tmp / "ckpt" / "one-process")
    first = _spawn(tmp, 2, "first")
    second = _spawn(tmp, 4, "second")
    odd = _spawn(tmp, 3, "odd")
    third = _spawn(tmp, 2, "third")
    return {"tmp": tmp, "first": first, "second": second, "odd": odd, "third": third}


def _worst(params: list[torch.Tensor], reference: list[torch.Tensor]) -> float:
    return max(float((a - b).norm() / b.norm()) for a, b in zip(params, reference))


# Why 1e-10: the ranks average their shards' mean gradients, which differs from the whole batch's
# mean at float64 rounding (measured worst 1e-14 after 8 steps); a lost or repeated update of any
# matrix, or a state resumed on the wrong owner, is an O(lr) = 5e-2 error.
TOL = 1e-10


@pytest.mark.parametrize("run", ["fsdp2 2->4", "ddp 2->4", "fsdp2 2->4, flattened", "ddp 2->4, flattened",
                                 "hsdp 2x2", "fsdp2 Shard(1)", "tensor parallel"])
def test_four_ranks_equal_the_single_process_run(runs, single_process, run):
    results = [r[run] for r in runs["second"]]
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert torch.equal(a, b)
    assert _worst(results[0], single_process) <= TOL


@pytest.mark.parametrize("run", ["fsdp2 1->2", "ddp 1->2"])
def test_one_process_to_two_ranks(runs, single_process, run):
    """A checkpoint saved with ``dcp.save`` in a process without torch.distributed resumes on 2 ranks."""
    results = [r[run] for r in runs["first"]]
    assert all(torch.equal(a, b) for a, b in zip(*results))
    assert _worst(results[0], single_process) <= TOL


@pytest.mark.parametrize("run", ["fsdp2 2->3", "ddp 2->3"])
def test_two_to_three_ranks(runs, single_process, run):
    """An odd world size: uneven shards of every matrix, uneven slices of the batch (weighted by `_batch`)."""
    results = [r[run] for r in runs["odd"]]
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], other))
    assert _worst(results[0], single_process) <= TOL


@pytest.mark.parametrize("run", ["fsdp2 4->2", "ddp 4->2", "fsdp2 3->2", "ddp 3->2"])
def test_four_or_three_to_two_ranks(runs, single_process, run):
    results = [r[run] for r in runs["third"]]
    assert all(torch.equal(a, b) for a, b in zip(*results))
    assert _worst(results[0], single_process) <= TOL


@pytest.mark.parametrize("name", ["fsdp2-2", "ddp-2", "fsdp2-4", "fsdp2-3", "ddp-3"])
def test_resume_in_one_process(runs, single_process, name):
    """A distributed checkpoint resumed by a plain model in a process without torch.distributed."""
    model = _model()
    opt = _optimizer(model)
    _load(model, opt, runs["tmp"] / "ckpt" / name)
    X, Y = _data()
    _train(model, opt, X, Y, range(RESUME_AT, STEPS))
    assert _worst([p.detach() for p in model.parameters()], single_process) <= TOL


def test_a_consolidated_checkpoint_resumes_in_one_process(runs, single_process):
    """``get_state_dict(full_state_dict=True, cpu_offload=True)`` on 2 FSDP2 ranks aborted the processes
    (gloo: "Received data size doesn't match expected size"): ``opt.state_dict()`` listed the states in
    each rank's insertion order, so the ranks gathered different tensors at once. Now in parameter order."""
    from torch.distributed.checkpoint.state_dict import set_state_dict

    saved = torch.load(runs["tmp"] / "ckpt" / "fsdp2-2-full.pt", weights_only=True)
    model = _model()
    opt = _optimizer(model)
    set_state_dict(model, opt, model_state_dict=saved["model"], optim_state_dict=saved["optim"],
                   options=_full_options())
    X, Y = _data()
    _train(model, opt, X, Y, range(RESUME_AT, STEPS))
    assert _worst([p.detach() for p in model.parameters()], single_process) <= TOL


def test_a_per_rank_state_dict_on_another_number_of_ranks_is_refused_with_the_way_to_do_it(runs):
    """An FSDP2 per-rank ``opt.state_dict()`` holds ``DTensor``s on the 2-rank mesh it was saved on; on 4
    ranks gathering them raised torch's ``narrow unexpectedly changed concrete size on dim 0: 32 -> 16``
    on every rank (a user's hunt, 2026-12-03). Every rank now refuses it at once, naming DCP."""
    results = [out["per-rank 2->4"] for out in runs["second"]]
    for r in results:
        assert r["error"] and "lies on a device mesh of the ranks [0, 1], the parameter on the ranks [0, 1, 2, 3]" \
            in r["error"] and "torch.distributed.checkpoint" in r["error"], r
        assert r["unchanged"], r


def test_the_layouts_are_what_they_say(runs):
    second = runs["second"][0]
    assert second["hsdp placements"] == "(Replicate(), Shard(dim=0))"
    assert second["Shard(1) placements"] == "(Shard(dim=1),)"
    assert second["tp placements"][0] == "(Shard(dim=0),)" and second["tp placements"][2] == "(Shard(dim=1),)"


@pytest.mark.parametrize("policy", ["skip", "raise"])
def test_hsdp_agrees_on_a_nan_in_one_replica(runs, policy):
    """HSDP's finiteness flags were agreed within each replica's shard group only (a user's hunt,
    2026-12-03): a NaN written into one replica's gradient after FSDP2's reduction made that replica alone
    skip the matrix (the replicas parted, step counts 1 and 2) or raise (the other replica stepped). Now
    every rank of the mesh decides alike."""
    ranks = [r[f"hsdp nan, {policy}"] for r in runs["second"]]
    if policy == "raise":
        assert all(r["error"] for r in ranks), [r["error"] for r in ranks]
        assert "contains 1 NaN and 0 infinite values" in ranks[1]["error"], ranks[1]["error"]
        assert all("in another rank's shard" in r["error"] for i, r in enumerate(ranks) if i != 1)
        assert not any(any(r["changed"]) for r in ranks)
        return
    assert [r["error"] for r in ranks] == [None] * 4
    assert [r["step"] for r in ranks] == [1.0] * 4  # skipped at step 2 on every rank
    for r in ranks[1:]:
        assert all(torch.equal(a, b) for a, b in zip(r["params"], ranks[0]["params"]))


# ----------------------------------------------------------------- checkpoints that do not fit
def _saved_in_one_process(path: Path, **group_options) -> tuple:
    from fismo_core.backends.torch import FISMO, param_groups

    model = _model()
    matrices, vectors = param_groups(model, head=None, adamw_options={"lr": 1e-2})
    opt = FISMO([{**matrices, **group_options}, vectors], lr=0.05)
    X, Y = _data()
    _train(model, opt, X, Y, range(2))
    _save(model, opt, path)
    return model, opt


def _fresh(**group_options):
    from fismo_core.backends.torch import FISMO, param_groups

    model = _model()
    matrices, vectors = param_groups(model, head=None, adamw_options={"lr": 1e-2})
    return model, FISMO([{**matrices, **group_options}, vectors], lr=0.05)


def test_a_checkpoint_with_other_block_shapes_is_refused_by_dcp(tmp_path):
    """block_size=8 splits the (16, 12) matrix's P into 2 blocks; a full-factor optimizer's P is (16, 16)."""
    from torch.distributed.checkpoint.api import CheckpointException

    _saved_in_one_process(tmp_path / "ckpt", block_size=8)
    model, opt = _fresh()
    with pytest.raises(CheckpointException, match=r"Size mismatch .*optim\.state\.0\.weight\.P"):
        _load(model, opt, tmp_path / "ckpt")


def test_a_checkpoint_with_a_block_size_that_splits_nothing_differently_loads(tmp_path):
    """block_size=16 leaves every side of this model whole: its states are block_size=None's, and the
    checkpoint loads (until 2026-11-28 it was refused for the value alone), taking its block_size as
    load_state_dict takes every saved hyperparameter; the run goes on as the uninterrupted one. A block_size
    that splits a matrix otherwise gives other shapes, which DCP refuses (the test above)."""
    saved_model, saved_opt = _saved_in_one_process(tmp_path / "ckpt", block_size=16)
    model, opt = _fresh()
    _load(model, opt, tmp_path / "ckpt")
    assert opt.param_groups[0]["block_size"] == 16
    X, Y = _data()
    _train(model, opt, X, Y, range(2, 4))
    _train(saved_model, saved_opt, X, Y, range(2, 4))
    for a, b in zip(model.parameters(), saved_model.parameters()):
        assert torch.equal(a, b)


def test_a_checkpoint_of_another_model_is_refused_by_dcp(tmp_path):
    from torch.distributed.checkpoint.api import CheckpointException

    _saved_in_one_process(tmp_path / "ckpt")
    from fismo_core.backends.torch import FISMO, param_groups

    other = torch.nn.Sequential(torch.nn.Linear(12, 20), torch.nn.Tanh(), torch.nn.Linear(20, 1)).double()
    opt = FISMO(param_groups(other, head=None), lr=0.05)
    with pytest.raises(CheckpointException, match="Size mismatch"):
        _load(other, opt, tmp_path / "ckpt")
