"""``fismo_core.backends.torch.FISMO`` on torch.distributed: DDP and FSDP2, gloo, CPU, 2 processes.

One spawn runs every scenario (starting two Python processes with torch is
most of the cost); each rank saves what it saw and the tests compare it with a
single-process run here. The rendezvous is a file (no port to race for), the
process group has a timeout, and a hung run is killed.
"""

from __future__ import annotations

import io
import copy
import math
import os
import time
from datetime import timedelta

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

import torch.multiprocessing as mp  # noqa: E402

WORLD = 2
STEPS = 8
RESUME_AT = 4
LR = 0.05
BLOCK_SIZE = 8
TIMEOUT = 120  # seconds for the whole spawn; a healthy run takes 10-25 s on 2 busy cores


def _model() -> torch.nn.Module:
    """Matrices (16, 12), 2 x (16, 16) (one bucket), (3, 16) (uneven shards 2 + 1), (1, 3) (one empty shard).

    ``_optimizer`` gives (16, 12) and (3, 16) block-diagonal factors (``block_size=8``: ``P`` of
    (16, 12) is 2 blocks, its ``Q`` 8 + 4; ``P`` of (3, 16) is full, its ``Q`` 2 blocks)."""
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(12, 16),
        torch.nn.Tanh(),
        torch.nn.Linear(16, 16),
        torch.nn.Tanh(),
        torch.nn.Linear(16, 16),
        torch.nn.Tanh(),
        torch.nn.Linear(16, 3),
        torch.nn.Tanh(),
        torch.nn.Linear(3, 1),
    ).double()


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    X = torch.randn(64, 12, generator=gen, dtype=torch.float64)
    return X, torch.randn(64, 1, generator=gen, dtype=torch.float64)


def _optimizer(model: torch.nn.Module, **kwargs):
    from fismo_core.backends.torch import FISMO, param_groups

    # head=None: the last layer (1, 3) stays on FISMO, as the empty-shard case of FSDP2.
    matrices, vectors = param_groups(model, head=None, adamw_options={"lr": 1e-2})
    blocked = [p for i, p in enumerate(matrices["params"]) if i in (0, 3)]  # (16, 12) and (3, 16)
    full = [p for i, p in enumerate(matrices["params"]) if i not in (0, 3)]
    groups = [{"params": full}, {"params": blocked, "block_size": BLOCK_SIZE}, vectors]
    return FISMO(groups, lr=LR, nesterov=True, weight_decay=0.01, **kwargs)


def _beta(step: int) -> float:
    """A momentum warmup: the FSDP2 runs take it as a tensor changed in place, the others as floats."""
    return 0.85 + 0.1 * step / STEPS


def _train(net, opt, X, Y, steps, weight: float = 1.0) -> None:
    """``steps`` steps on the batch ``(X, Y)``. ``weight`` scales the loss: a rank holding an uneven slice of
    the batch weighs its mean by its share, so that the ranks' averaged gradient is the whole batch's mean."""
    for step in steps:
        for group in opt.param_groups:
            if group["algorithm"] == "fismo" and isinstance(group["beta"], torch.Tensor):
                group["beta"].fill_(_beta(step))
            elif group["algorithm"] == "fismo":
                group["beta"] = _beta(step)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(net(X), Y)
        (loss if weight == 1.0 else loss * weight).backward()
        opt.step()


def _checkpoint(obj) -> dict:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


def _full(p: torch.Tensor) -> torch.Tensor:
    return (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()


def _owns(opt, p) -> bool:
    """Whether this rank holds ``p``'s FISMO statistics (another rank's matrix has placeholders on ``meta``)."""
    return "P" in opt.state.get(p, {}) and not opt.state[p]["P"].is_meta


def _matrix_state_owners(model, opt) -> list[int]:
    return [i for i, p in enumerate(model.parameters()) if _owns(opt, p)]


def _state_shapes(model, opt) -> dict[int, dict[str, tuple]]:
    """The shapes of the FISMO state tensors this rank keeps, by parameter index."""
    return {
        i: {k: tuple(v.shape) for k, v in opt.state[p].items() if k.startswith(("P", "Q"))}
        for i, p in enumerate(model.parameters())
        if _owns(opt, p)
    }


# ----------------------------------------------------------------- workers
def _run_ddp(rank: int, X, Y) -> dict:
    def build():
        model = _model()
        return model, torch.nn.parallel.DistributedDataParallel(model)

    model, net = build()
    opt = _optimizer(model, process_group=dist.group.WORLD)
    _train(net, opt, X, Y, range(RESUME_AT))
    saved = _checkpoint({"model": model.state_dict(), "opt": opt.state_dict()})  # one file per rank
    _train(net, opt, X, Y, range(RESUME_AT, STEPS))

    resumed, resumed_net = build()
    resumed.load_state_dict(saved["model"])
    resumed_opt = _optimizer(resumed, process_group=dist.group.WORLD)
    resumed_opt.load_state_dict(saved["opt"])
    _train(resumed_net, resumed_opt, X, Y, range(RESUME_AT, STEPS))
    return {
        "params": [_full(p) for p in model.parameters()],
        "resumed": [_full(p) for p in resumed.parameters()],
        "owned": _matrix_state_owners(model, opt),
        "state_shapes": _state_shapes(model, opt),
    }


def _fsdp2_model() -> torch.nn.Module:
    """`_model` under FSDP2 on every rank (each Linear and the whole), on a 1-D mesh."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (WORLD,))
    model = _model()
    for module in model:
        if isinstance(module, torch.nn.Linear):
            fully_shard(module, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _run_fsdp2(rank: int, X, Y) -> dict:
    build = _fsdp2_model
    model = build()
    opt = _optimizer(model, beta=torch.tensor(_beta(0), dtype=torch.float64))
    _train(model, opt, X, Y, range(RESUME_AT))
    saved = _checkpoint({"model": model.state_dict(), "opt": opt.state_dict()})
    _train(model, opt, X, Y, range(RESUME_AT, STEPS))

    resumed = build()
    resumed.load_state_dict(saved["model"])
    resumed_opt = _optimizer(resumed, beta=torch.tensor(_beta(0), dtype=torch.float64))
    resumed_opt.load_state_dict(saved["opt"])
    _train(resumed, resumed_opt, X, Y, range(RESUME_AT, STEPS))
    return {
        "params": [_full(p) for p in model.parameters()],
        "resumed": [_full(p) for p in resumed.parameters()],
        "owned": _matrix_state_owners(model, opt),
        "state_shapes": _state_shapes(model, opt),
        "local_shapes": [tuple(p.to_local().shape) for p in model.parameters()],
    }


class _Branch(torch.nn.Module):
    """A model whose middle matrix some ranks leave out of their forward pass."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.trunk, self.extra, self.head = (torch.nn.Linear(*s).double() for s in ((12, 8), (8, 8), (8, 1)))

    def forward(self, x: torch.Tensor, use_extra: bool) -> torch.Tensor:
        h = torch.tanh(self.trunk(x))
        return self.head(torch.tanh(self.extra(h)) if use_extra else h)


def _branch_optimizer(model: torch.nn.Module, **kwargs):
    """FISMO on the three matrices, AdamW on the biases."""
    from fismo_core.backends.torch import FISMO, param_groups

    return FISMO(param_groups(model, head=None), lr=LR, **kwargs)


def _branch_loss(net, X, Y, use_extra: bool) -> torch.Tensor:
    return torch.nn.functional.mse_loss(net(X, use_extra), Y)


def _run_ddp_unused_on_one_rank(rank: int, X, Y) -> dict:
    """DDP with ``find_unused_parameters=True``: rank 1 leaves ``extra`` out of its forward pass. DDP gives
    it the all-reduced gradient on rank 1 too, so both ranks step the same matrices (the broadcasts are
    collectives: a matrix with a gradient on some ranks only would mismatch them)."""
    model = _Branch()
    net = torch.nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)
    opt = _branch_optimizer(model, process_group=dist.group.WORLD)
    grads_present = []
    for _ in range(3):
        opt.zero_grad()
        _branch_loss(net, X, Y, use_extra=rank == 0).backward()
        grads_present.append(model.extra.weight.grad is not None)
        opt.step()
    return {"params": [_full(p) for p in model.parameters()], "extra grad present": grads_present}


def _run_nan_in_one_shard(rank: int, X, Y) -> dict:
    """FSDP2, ``nonfinite="raise"``: a NaN in rank 1's shard of a gradient. Every rank refuses the step;
    what each rank's error says, and whether anything changed."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (WORLD,))
    model = _model()
    for module in model:
        if isinstance(module, torch.nn.Linear):
            fully_shard(module, mesh=mesh)
    model = fully_shard(model, mesh=mesh)
    opt = _optimizer(model)
    _train(model, opt, X, Y, range(1))
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(X), Y).backward()
    if rank == 1:
        list(model.parameters())[2].grad.to_local()[0, 0] = float("nan")
    before = [_full(p) for p in model.parameters()]
    try:
        opt.step()
        error = None
    except ValueError as exc:
        error = str(exc)
    changed = any(not torch.equal(a, _full(b)) for a, b in zip(before, model.parameters()))
    return {"error": error, "changed": changed}


def _run_nan_on_one_replica(rank: int, X, Y) -> dict:
    """DDP: a NaN written into rank 1's gradient after DDP's all-reduce (a hook that runs on one rank).
    Under ``nonfinite="raise"``, what each rank's error says and whether anything changed; under ``"skip"``,
    the parameters after the step and two more (the replicas must stay equal). ``", roots unchecked"``:
    the same with ``InverseRootConfig(fallback=False)``, where no root's check is agreed over the ranks."""
    from fismo_core.backends.torch import InverseRootConfig

    out = {}
    for case in ("raise", "skip", "raise, roots unchecked", "skip, roots unchecked"):
        policy, unchecked = case.split(",")[0], case.endswith("unchecked")
        model = _model()
        net = torch.nn.parallel.DistributedDataParallel(model)
        opt = _optimizer(model, process_group=dist.group.WORLD, nonfinite=policy,
                         **({"inv_root": InverseRootConfig(fallback=False)} if unchecked else {}))
        _train(net, opt, X, Y, range(1))
        opt.zero_grad()
        torch.nn.functional.mse_loss(net(X), Y).backward()
        if rank == 1:
            list(model.parameters())[2].grad[0, 0] = float("nan")
        before = [p.detach().clone() for p in model.parameters()]
        try:
            opt.step()
            error = None
        except ValueError as exc:
            error = str(exc)
        changed = [not torch.equal(a, b) for a, b in zip(before, model.parameters())]
        if policy == "skip":
            _train(net, opt, X, Y, range(1, 3))
        out[case] = {"error": error, "changed": changed, "states": sum(1 for s in opt.state.values() if s),
                       "params": [p.detach().clone() for p in model.parameters()]}
    return out


def _run_root_failure(rank: int, X, Y, mode: str) -> dict:
    """``gamma = 0``, ``mu = 1e-30``, ``max_failures = 0`` on the first matrix (16, 12): its ``P_t`` (16 x 16, rank
    12) fails its check in float64 too, on its owner alone. Every rank must raise ``InverseRootError``
    (the others waited in line 9's collectives for the owner, which had raised). What each rank raised,
    whether it owns the matrix, how long its step took, and whether anything changed."""
    from fismo_core.backends.torch import FISMO, InverseRootError

    model = _model()
    kwargs = {}
    if mode == "ddp":
        net = torch.nn.parallel.DistributedDataParallel(model)
        kwargs["process_group"] = dist.group.WORLD
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (WORLD,))
        for module in model:
            if isinstance(module, torch.nn.Linear):
                fully_shard(module, mesh=mesh)
        net = model = fully_shard(model, mesh=mesh)
    weights = [p for p in model.parameters() if p.ndim == 2]
    biases = [p for p in model.parameters() if p.ndim == 1]
    opt = FISMO([{"params": weights[:1], "gamma": 0.0, "mu": 1e-30, "inv_root": {"max_failures": 0}},
                 {"params": weights[1:]}, {"params": biases, "algorithm": "adamw"}], lr=LR, **kwargs)
    torch.nn.functional.mse_loss(net(X), Y).backward()
    before = [_full(p) for p in model.parameters()]
    start = time.monotonic()
    try:
        opt.step()
        error = None
    except InverseRootError as exc:
        error = str(exc)
    return {"error": error, "seconds": time.monotonic() - start, "owns": _owns(opt, weights[0]),
            "changed": any(not torch.equal(a, _full(b)) for a, b in zip(before, model.parameters())),
            "states": len(opt.state)}


def _run_warnings_made_errors(rank: int, X, Y) -> dict:
    """DDP, with warnings turned into errors (``-W error``, or pytest's ``filterwarnings = error``): the
    `FactorSizeWarning` of a thin (1, 1100) matrix at its first step, and the `InverseRootWarning` of a
    repaired root (the first matrix of `_run_root_failure`, with ``max_failures = 1``). Both were issued on
    the matrix's owner alone, which raised while the other rank went on into the collectives. What each
    rank raised (its type and message), whether anything changed, and how many states it kept."""
    import warnings

    from fismo_core.backends.torch import FISMO
    from fismo_core.guards import FactorSizeWarning, InverseRootWarning

    out = {}
    for case in ("factor size", "repaired root"):
        model = _model()
        net = torch.nn.parallel.DistributedDataParallel(model)
        weights = [p for p in model.parameters() if p.ndim == 2]
        biases = [p for p in model.parameters() if p.ndim == 1]
        thin = torch.nn.Parameter(torch.ones(1, 1100, dtype=torch.float64))
        groups = ([{"params": weights + [thin]}] if case == "factor size" else
                  [{"params": weights[:1], "gamma": 0.0, "mu": 1e-30, "inv_root": {"max_failures": 1}},
                   {"params": weights[1:]}])
        opt = FISMO(groups + [{"params": biases, "algorithm": "adamw"}], lr=LR, process_group=dist.group.WORLD)
        torch.nn.functional.mse_loss(net(X), Y).backward()
        thin.grad = torch.ones_like(thin)
        before = [p.detach().clone() for p in model.parameters()]
        with warnings.catch_warnings():
            warnings.simplefilter("error", FactorSizeWarning if case == "factor size" else InverseRootWarning)
            try:
                opt.step()
                error = None
            except Exception as exc:
                error = f"{type(exc).__name__}: {exc}"
        out[case] = {"error": error, "owns": _owns(opt, weights[0]), "states": len(opt.state),
                     "changed": any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))}
    return out


def _run_block_size_changed(rank: int, X, Y) -> dict:
    """DDP: a group of one matrix (16, 12), owned by one rank, whose ``block_size`` is set to 8 after a step.
    What each rank's next step raised (the owner refused it; the other rank went on into line 9's broadcast)."""
    from fismo_core.backends.torch import FISMO

    model = _model()
    net = torch.nn.parallel.DistributedDataParallel(model)
    weights = [p for p in model.parameters() if p.ndim == 2]
    biases = [p for p in model.parameters() if p.ndim == 1]
    opt = FISMO([{"params": weights[:1]}, {"params": weights[1:]}, {"params": biases, "algorithm": "adamw"}],
                lr=LR, process_group=dist.group.WORLD)
    _train(net, opt, X, Y, range(1))
    opt.param_groups[0]["block_size"] = 8
    try:
        _train(net, opt, X, Y, range(1, 2))
        error = None
    except ValueError as exc:
        error = str(exc)
    return {"error": error, "owns": _owns(opt, weights[0])}


def _run_mismatched_grads(rank: int, X, Y, **kwargs) -> dict:
    """DDP-style FISMO on two 4 x 4 matrices (one per owner): a normal step, then one where only rank 0 has
    the second matrix's gradient (set by hand). What each rank's second step raised, and whether its
    parameters and states are those after the first step. ``kwargs``: more options of `FISMO`."""
    from fismo_core.backends.torch import FISMO

    torch.manual_seed(0)
    weights = [torch.nn.Parameter(torch.randn(4, 4, dtype=torch.float64)) for _ in range(2)]
    opt = FISMO(weights, lr=LR, process_group=dist.group.WORLD, **kwargs)
    grads = [torch.randn(4, 4, dtype=torch.float64) for _ in range(2)]
    for w, g in zip(weights, grads):
        w.grad = g.clone()
    opt.step()
    before = ([w.detach().clone() for w in weights],
              [{k: v.clone() for k, v in opt.state[w].items()} for w in weights])
    weights[0].grad = grads[0].clone()
    weights[1].grad = grads[1].clone() if rank == 0 else None
    try:
        opt.step()
        error = None
    except RuntimeError as exc:
        error = str(exc)
    unchanged = all(torch.equal(a, w) for a, w in zip(before[0], weights)) and all(
        saved.keys() == opt.state[w].keys()
        and all(torch.equal(v, opt.state[w][k]) if not v.is_meta else opt.state[w][k].is_meta for k, v in saved.items())
        for saved, w in zip(before[1], weights)
    )
    return {"error": error, "unchanged": unchanged}


def _run_compiled(rank: int, X, Y, mode: str) -> dict:
    """``torch.compile(opt.step)`` under DDP or FSDP2: its parameters after 3 steps and the eager run's, the
    graphs dynamo compiled (its ``CompileCounter``), and what ``fullgraph=True`` raised."""
    from torch._dynamo.testing import CompileCounter

    def build():
        if mode == "ddp":
            model = _model()
            return model, torch.nn.parallel.DistributedDataParallel(model), {"process_group": dist.group.WORLD}
        model = _fsdp2_model()
        return model, model, {}

    out: dict = {}
    for compiled in (False, True):
        model, net, kwargs = build()
        opt = _optimizer(model, **kwargs)
        counter = CompileCounter()
        step = torch.compile(opt.step, backend=counter) if compiled else opt.step
        graphs = []
        for _ in range(3):
            opt.zero_grad()
            torch.nn.functional.mse_loss(net(X), Y).backward()
            step()
            graphs.append(counter.frame_count)
        out["compiled" if compiled else "eager"] = [_full(p) for p in model.parameters()]
        out["graphs"] = graphs
    before = [_full(p) for p in model.parameters()]
    try:
        torch.compile(opt.step, backend="eager", fullgraph=True)()
        out["fullgraph"] = None
    except Exception as exc:
        out["fullgraph"] = f"{type(exc).__name__}: {exc}"
    out["unchanged by fullgraph"] = all(torch.equal(a, _full(p)) for a, p in zip(before, model.parameters()))
    return out


def _run_resized(rank: int, X, Y) -> dict:
    """Replicated matrices (DDP's layout, gradients set by hand: DDP's reducer cannot follow a resize), one
    owned per rank, then the second widened in place on every rank. What each rank's next step raised."""
    from fismo_core.backends.torch import FISMO

    torch.manual_seed(0)
    weights = [torch.nn.Parameter(torch.randn(4, 3, dtype=torch.float64)) for _ in range(2)]
    opt = FISMO(weights, lr=LR, process_group=dist.group.WORLD)
    for _ in range(2):
        for p in weights:
            p.grad = torch.ones_like(p)
        try:
            opt.step()
            error = None
        except ValueError as exc:
            error = str(exc)
        owns = _owns(opt, weights[1])
        weights[1].data = torch.randn(5, 3, dtype=torch.float64)
    return {"error": error, "owns": owns}


def _run_state_dict_before_the_next_step(rank: int, X, Y) -> dict:
    """A ``state_dict`` taken after a change the next step would act on: the parameters made float64
    (``model.double()``: the owner converts its state at its next step) or a group's ``block_size`` set (the
    next step refuses it). DDP's layout (replicated matrices, gradients set by hand) and FSDP2 (`_fsdp2_model`).
    Per case: the error, each exported matrix state made whole (float64), and the owner's live one."""
    from fismo_core.backends.torch import FISMO

    # By the state_dict's index: the position in the param groups.
    def exported(opt) -> tuple:
        try:
            saved = opt.state_dict()
        except Exception as exc:  # recorded, so that the test says what failed on which rank
            return f"{type(exc).__name__}: {exc}", {}
        return None, {i: {k: (_full(v).double(), v.dtype) for k, v in state.items() if k.startswith(("P", "Q", "M"))}
                      for i, state in saved["state"].items()}

    def live(opt) -> dict:
        params = [p for group in opt.param_groups for p in group["params"]]
        return {i: {k: v.double() for k, v in opt.state[p].items() if k.startswith(("P", "Q", "M"))}
                for i, p in enumerate(params) if _owns(opt, p)}

    out = {}
    for change in ("float64", "block_size"):
        torch.manual_seed(0)
        weights = [torch.nn.Parameter(torch.randn(6, 4)) for _ in range(2)]
        opt = FISMO([{"params": weights[:1]}, {"params": weights[1:]}], lr=LR, process_group=dist.group.WORLD)
        for p in weights:
            p.grad = torch.randn_like(p)
        opt.step()
        if change == "float64":
            for p in weights:
                p.data = p.data.double()
        else:
            opt.param_groups[0]["block_size"] = 2
        error, states = exported(opt)
        out[f"ddp, {change}"] = {"error": error, "exported": states, "live": live(opt)}
    model = _fsdp2_model()
    opt = _optimizer(model)
    _train(model, opt, X, Y, range(1))
    opt.param_groups[0]["block_size"] = 2
    error, states = exported(opt)
    out["fsdp2, block_size"] = {"error": error, "exported": states, "live": live(opt)}
    return out


def _run_damaged_state_loaded(rank: int, X, Y) -> dict:
    """A checkpoint whose ``M`` of one matrix holds a NaN, loaded under DDP (replicated matrices, gradients set
    by hand) and FSDP2 (`_fsdp2_model`). Per case: what each rank's ``load_state_dict`` raised, whether this
    rank owns the damaged matrix, and whether the states this rank holds stayed as they were."""
    from fismo_core.backends.torch import FISMO

    def load_damaged(opt, index) -> dict:  # index: in the state_dict, the position in the param groups
        params = [p for group in opt.param_groups for p in group["params"]]
        saved = opt.state_dict()
        M = saved["state"][index]["M"]
        saved["state"][index] = {**saved["state"][index], "M": torch.full_like(M, math.nan)}
        held = [{k: v.clone() for k, v in opt.state[p].items() if not v.is_meta} for p in params]
        try:
            opt.load_state_dict(saved)
            error = None
        except ValueError as exc:
            error = str(exc)
        unchanged = all(set(before) == {k for k, v in opt.state[p].items() if not v.is_meta}
                        and all(torch.equal(v, opt.state[p][k]) for k, v in before.items())
                        for p, before in zip(params, held))
        return {"error": error, "owns": _owns(opt, params[index]), "unchanged": unchanged}

    torch.manual_seed(0)
    weights = [torch.nn.Parameter(torch.randn(6, 4)) for _ in range(2)]
    opt = FISMO(weights, lr=LR, process_group=dist.group.WORLD)
    for p in weights:
        p.grad = torch.randn_like(p)
    opt.step()
    out = {"ddp": load_damaged(opt, 1)}
    model = _fsdp2_model()
    opt = _optimizer(model)
    _train(model, opt, X, Y, range(1))
    out["fsdp2"] = load_damaged(opt, 1)
    return out


def _run_owners_moved(rank: int, X, Y) -> dict:
    """Replicated matrices with states (gradients set by hand), then a change that moves owners: a matrix
    inserted before others (appended to the first group's params), or a block_size set on a stateless
    group before the others. What each rank's next step raised, and whether any parameter changed."""
    from fismo_core.backends.torch import FISMO

    out = {}
    for change in ("append", "block_size"):
        torch.manual_seed(0)
        A, B, C = (torch.nn.Parameter(torch.randn(shape, dtype=torch.float64)) for shape in ((8, 8), (8, 6), (5, 5)))
        groups = [{"params": [B]}, {"params": [C]}] if change == "append" else [{"params": [A]}, {"params": [B, C]}]
        opt = FISMO(groups, lr=LR, process_group=dist.group.WORLD)
        for p in (B, C):
            p.grad = torch.ones_like(p)
        opt.step()
        if change == "append":
            opt.param_groups[0]["params"].append(A)
            A.grad = torch.ones_like(A)
        else:
            opt.param_groups[0]["block_size"] = 2
        before = [p.detach().clone() for p in (A, B, C)]
        try:
            opt.step()
            error = None
        except ValueError as exc:
            error = str(exc)
        out[change] = {"error": error, "unchanged": all(torch.equal(p, q) for p, q in zip((A, B, C), before))}
    return out


def _run_partial_gradients(rank: int, X, Y) -> dict:
    """Data parallelism through DTensor: ``Replicate()`` parameters (``distribute_module``) whose gradients
    are ``Partial()`` sums, each rank's term its half of the batch weighed by its share. Set by hand from a
    plain copy of the model, so the gradient is the whole batch's mean whatever torch's loss rules."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, distribute_module

    mesh = init_device_mesh("cpu", (WORLD,))
    model, plain = distribute_module(_model(), mesh), _model()
    opt = _optimizer(model)
    placements = set()
    for step in range(STEPS):
        for group in opt.param_groups:
            if group["algorithm"] == "fismo":
                group["beta"] = _beta(step)
        with torch.no_grad():
            for q, p in zip(plain.parameters(), model.parameters()):
                q.copy_(p.full_tensor())
        plain.zero_grad()
        (torch.nn.functional.mse_loss(plain(X), Y) / WORLD).backward()
        for q, p in zip(plain.parameters(), model.parameters()):
            p.grad = DTensor.from_local(q.grad.clone(), mesh, [Partial()])
        opt.step()
        placements |= {str(p.grad.placements) for p in model.parameters()}
    return {"params": [_full(p) for p in model.parameters()], "grad placements": sorted(placements)}


def _worker(rank: int, store: str, out: str) -> None:
    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD, timeout=timedelta(seconds=60)
    )
    try:
        X, Y = _data()
        X, Y = X.chunk(WORLD)[rank], Y.chunk(WORLD)[rank]  # each rank its half of the batch
        results = {"ddp": _run_ddp(rank, X, Y), "fsdp2": _run_fsdp2(rank, X, Y),
                   "nan in one shard": _run_nan_in_one_shard(rank, X, Y),
                   "nan on one replica": _run_nan_on_one_replica(rank, X, Y),
                   "ddp, unused on one rank": _run_ddp_unused_on_one_rank(rank, X, Y),
                   **{f"{mode}, failed root": _run_root_failure(rank, X, Y, mode) for mode in ("ddp", "fsdp2")},
                   "block size changed": _run_block_size_changed(rank, X, Y),
                   "resized": _run_resized(rank, X, Y),
                   "owners moved": _run_owners_moved(rank, X, Y),
                   "state_dict before the next step": _run_state_dict_before_the_next_step(rank, X, Y),
                   "damaged state loaded": _run_damaged_state_loaded(rank, X, Y),
                   **{f"{mode}, compiled": _run_compiled(rank, X, Y, mode) for mode in ("ddp", "fsdp2")},
                   "ddp, mismatched gradients": _run_mismatched_grads(rank, X, Y),
                   "ddp, mismatched gradients, roots unchecked":
                       _run_mismatched_grads(rank, X, Y, inv_root={"fallback": False}),
                   "warnings made errors": _run_warnings_made_errors(rank, X, Y),
                   "partial gradients": _run_partial_gradients(rank, X, Y)}
        torch.save(results, f"{out}.{rank}")
        dist.barrier()  # no rank tears the group down while another still saves (gloo aborted one: SIGABRT)
    finally:
        dist.destroy_process_group()


def spawn(worker, args: tuple, nprocs: int, timeout: float, what: str) -> None:
    """Run ``worker(rank, *args)`` in ``nprocs`` fresh processes; fail the test if they take over ``timeout`` seconds."""
    context = mp.start_processes(worker, args=args, nprocs=nprocs, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout
    try:
        while not context.join(timeout=max(1.0, deadline - time.monotonic())):
            if time.monotonic() > deadline:
                pytest.fail(f"{what} did not finish in {timeout} s")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> list[dict]:
    tmp = tmp_path_factory.mktemp("dist")
    spawn(_worker, (str(tmp / "store"), str(tmp / "out")), WORLD, TIMEOUT, "the distributed run")
    return [torch.load(tmp / f"out.{rank}", weights_only=False) for rank in range(WORLD)]


@pytest.fixture(scope="module")
def single_process() -> list[torch.Tensor]:
    """The same model, optimizer and steps in one process on the whole batch (one torch thread, as each rank:
    ``conftest.one_thread_per_test_process``)."""
    model = _model()
    X, Y = _data()
    _train(model, _optimizer(model), X, Y, range(STEPS))
    return [p.detach().clone() for p in model.parameters()]


MATRICES = [0, 2, 4, 6, 8]  # indices of the weights in model.parameters()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("mode", ["ddp", "fsdp2"])
def test_ranks_agree_and_equal_the_single_process_run(runs, single_process, mode):
    """Both ranks hold the same parameters, equal to one process on the whole batch.

    The ranks see half the batch each; the gradient all-reduce (DDP) or
    reduce-scatter (FSDP2) averages the two halves' mean gradients, which
    differs from the whole batch's mean at float64 rounding. Measured worst
    relative difference after 8 steps: 7.7e-15 (with the blocked group and the warmup below); 1e-10 is the project's float64
    bar, while a lost or doubled update of any matrix is an O(lr) = 5e-2 error.

    Every run warms ``beta`` up (`_beta`): the single process and DDP as floats set in the groups,
    FSDP2 as one float64 tensor changed in place (the form ``torch.compile`` reads as a graph input).
    """
    first, second = runs[0][mode], runs[1][mode]
    for a, b in zip(first["params"], second["params"]):
        assert torch.equal(a, b)
    worst = max(_rel(a, b) for a, b in zip(first["params"], single_process))
    assert worst <= 1e-10, worst


def test_partial_gradients_of_replicated_matrices_are_summed_before_the_step(runs, single_process):
    """A ``Replicate()`` matrix whose gradient is a ``Partial()`` sum (data parallelism through DTensor): each
    rank stepped on its own term, the replicas parted and ended 0.2 to 0.5 off the single process (a user's
    hunt, 2026-12-04). FISMO groups now lay the gradient out as the parameter first (AdamW groups' DTensor
    arithmetic already did); the run equals the single process to the float64 bar (1e-10; measured 7.7e-15)."""
    first, second = runs[0]["partial gradients"], runs[1]["partial gradients"]
    for a, b in zip(first["params"], second["params"]):
        assert torch.equal(a, b)
    worst = max(_rel(a, b) for a, b in zip(first["params"], single_process))
    assert worst <= 1e-10, worst
    assert "(Replicate(),)" in first["grad placements"]  # the matrices' gradients, laid out as they are


def test_ddp_steps_a_matrix_one_rank_leaves_unused_on_every_rank(runs):
    """With ``find_unused_parameters=True`` DDP fills the gradient of ``extra`` on rank 1, which left it out
    of its forward pass, so both ranks step every matrix. The run equals one process whose loss is the mean
    of the two ranks' losses (the all-reduce's average): measured 0 (torch 2.13, gloo, 2026-12-01), with
    1e-10, the project's float64 bar, as the bound since the two sum the halves' gradients by different
    code; a matrix not stepped, or stepped with rank 0's gradient alone, is off by O(lr) = 5e-2 (0.25
    measured with ``extra`` used on both halves)."""
    first, second = (r["ddp, unused on one rank"] for r in runs)
    assert first["extra grad present"] == second["extra grad present"] == [True] * 3
    for a, b in zip(first["params"], second["params"]):
        assert torch.equal(a, b)
    model = _Branch()
    opt = _branch_optimizer(model)
    (X0, X1), (Y0, Y1) = (t.chunk(WORLD) for t in _data())
    for _ in range(3):
        opt.zero_grad()
        ((_branch_loss(model, X0, Y0, True) + _branch_loss(model, X1, Y1, False)) / WORLD).backward()
        opt.step()
    assert not torch.equal(model.extra.weight, _Branch().extra.weight)
    worst = max(_rel(a, b.detach()) for a, b in zip(first["params"], model.parameters()))
    assert worst <= 1e-10, worst


def test_a_nan_in_one_shard_is_refused_on_every_rank_with_what_each_rank_knows(runs):
    """The finiteness flags are reduced over the shard group, so every rank refuses the step; the rank
    whose shards are finite said its parameter "was damaged before this step" (false): it now says the
    NaN or infinity is in another rank's shard, and the rank holding it names the gradient."""
    first, second = (r["nan in one shard"] for r in runs)
    assert not first["changed"] and not second["changed"]
    assert "has a NaN or an infinity in another rank's shard" in first["error"]
    assert "damaged" not in first["error"]
    assert "contains 1 NaN and 0 infinite values (of 128 entries on this rank)" in second["error"]


@pytest.mark.parametrize("case", ["raise", "raise, roots unchecked"])
def test_a_nan_on_one_ddp_replica_is_refused_on_every_rank(runs, case):
    """Under DDP the finiteness flags were not reduced: the rank with the NaN raised alone and the other
    went into line 9's broadcasts ("Connection closed by peer"; a user's hunt, 2026-12-02). They ride in
    the step's all-reduce now: every rank refuses, nothing changed, each saying what it knows. With the
    roots unchecked (``fallback=False``) they rode only from 2026-12-02's afternoon: the all-reduce ran
    only where a root's check was agreed."""
    first, second = (r["nan on one replica"][case] for r in runs)
    assert not any(first["changed"]) and not any(second["changed"]) and first["states"] == second["states"]
    assert "has a NaN or an infinity in another rank's copy" in first["error"], first
    assert "contains 1 NaN and 0 infinite values (of 256 entries);" in second["error"], second


@pytest.mark.parametrize("case", ["skip", "skip, roots unchecked"])
def test_a_nan_on_one_ddp_replica_is_skipped_on_every_rank(runs, case):
    """Under ``"skip"`` the rank with the NaN alone skipped the matrix: line 9's broadcasts then paired
    other matrices up and the replicas parted without a word (3.16 apart after one step; a user's hunt,
    2026-12-02). The skip flags are reduced over DDP's group now: every rank skips it (and only it), and
    the replicas stay equal bit for bit through the next steps."""
    first, second = (r["nan on one replica"][case] for r in runs)
    assert first["error"] is None and second["error"] is None
    assert first["changed"] == second["changed"] and first["changed"][2] is False and sum(first["changed"]) > 1
    assert all(torch.equal(a, b) for a, b in zip(first["params"], second["params"]))


@pytest.mark.parametrize("mode", ["ddp", "fsdp2"])
def test_matrix_work_is_partitioned(runs, mode):
    """Each matrix has exactly one owner, which alone keeps its FISMO state; both ranks own some."""
    owned = [set(run[mode]["owned"]) for run in runs]
    assert owned[0].isdisjoint(owned[1])
    assert owned[0] | owned[1] == set(MATRICES)
    assert owned[0] and owned[1]


@pytest.mark.parametrize("mode", ["ddp", "fsdp2"])
def test_per_rank_checkpoint_resumes_bit_identically(runs, mode):
    for run in runs:
        for a, b in zip(run[mode]["params"], run[mode]["resumed"]):
            assert torch.equal(a, b)


def test_fsdp2_shards_are_uneven_and_empty_where_expected(runs):
    """The model exercises FSDP2's uneven layouts: (3, 16) splits 2 + 1 rows, (1, 3) splits 1 + 0."""
    shapes = [run["fsdp2"]["local_shapes"] for run in runs]
    assert shapes[0][6] == (2, 16) and shapes[1][6] == (1, 16)
    assert shapes[0][8] == (1, 3) and shapes[1][8] == (0, 3)


@pytest.mark.parametrize("mode", ["ddp", "fsdp2"])
def test_blocked_states_live_on_their_owners(runs, mode):
    """The blocked group's states have the block layout on whichever rank owns them (the
    checkpoint test above resumes them bit for bit)."""
    shapes = {i: s for run in runs for i, s in run[mode]["state_shapes"].items()}
    assert shapes[0]["P"] == (2, 8, 8) and shapes[0]["Q"] == (1, 8, 8) and shapes[0]["Q_rest"] == (4, 4)
    assert "P_rest" not in shapes[0]
    assert shapes[6]["P"] == (3, 3) and shapes[6]["Q"] == (2, 8, 8) and "Q_rest" not in shapes[6]
    assert shapes[2]["P"] == (16, 16) and shapes[8]["Q"] == (3, 3)  # the full group


@pytest.fixture
def one_rank_group():
    """A one-rank gloo process group in this process (in-memory store), destroyed afterwards."""
    if dist.is_initialized():
        pytest.fail("a process group is already initialised in this test process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_a_process_group_that_is_not_one_is_refused_when_built(one_rank_group):
    """A ``DeviceMesh`` (what FSDP2 users hold), ``True`` or a list of ranks was accepted and the first step
    raised torch's errors of another thing ("Group DeviceMesh(...) is not registered", "'bool' object has
    no attribute 'size'", "unhashable type: 'list'") (a user's hunt, 2026-12-02)."""
    from torch.distributed.device_mesh import init_device_mesh

    from fismo_core.backends.torch import FISMO

    W = torch.nn.Parameter(torch.randn(4, 3))
    mesh = init_device_mesh("cpu", (1,))
    with pytest.raises(TypeError, match=r"process_group is a DeviceMesh .*process_group=mesh\.get_group\(\)"):
        FISMO([W], process_group=mesh)
    with pytest.raises(TypeError, match=r"NON_GROUP_MEMBER: this rank \(0\) is not in the group"):
        FISMO([W], process_group=dist.GroupMember.NON_GROUP_MEMBER)
    for wrong, kind in ((True, "bool"), ([0], "list")):
        with pytest.raises(TypeError, match=rf"process_group must be a torch\.distributed\.ProcessGroup .* got {kind}"):
            FISMO([W], process_group=wrong)
    opt = FISMO([W], process_group=mesh.get_group())
    W.grad = torch.randn_like(W)
    opt.step()


def test_param_groups_sees_through_ddp_to_the_models_own_head(one_rank_group):
    """``param_groups(ddp_model)`` missed a model's ``get_output_embeddings`` (the wrapper has none) and put
    the named head on FISMO and the last ``nn.Linear`` on AdamW, silently (a user's hunt, 2026-12-02); a
    head named as the model names it was refused. The wrapper's groups are the model's now."""
    from fismo_core.backends.torch import param_groups

    class HeadFirst(torch.nn.Module):  # defines its head first, and says which it is, as Hugging Face models do
        def __init__(self):
            super().__init__()
            self.lm_head = torch.nn.Linear(4, 7, bias=False)
            self.a, self.proj = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

        def get_output_embeddings(self):
            return self.lm_head

    model = HeadFirst()
    ddp = torch.nn.parallel.DistributedDataParallel(model)

    def ids(groups):
        return [[id(p) for p in g["params"]] for g in groups]

    assert ids(param_groups(ddp)) == ids(param_groups(model))
    assert ids(param_groups(model))[0] == [id(model.a.weight), id(model.proj.weight)]
    for head in ("lm_head", "module.lm_head", "lm_head.weight", "module.lm_head.weight"):
        assert ids(param_groups(ddp, head=head)) == ids(param_groups(model, head="lm_head")), head


def test_a_refused_step_leaves_a_partial_gradient_as_it_was(one_rank_group):
    """A ``Replicate()`` matrix's ``Partial()`` gradient is laid out as its parameter before the step (the
    test of partial gradients above). That happened while the gradients were still being checked, so a
    later matrix's bad gradient refused the step with the first one's gradient already changed (a
    collective run, p.grad replaced). It happens after every check now: a refused step changes no p.grad."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate

    from fismo_core.backends.torch import FISMO

    mesh = init_device_mesh("cpu", (1,))
    gen = torch.Generator().manual_seed(0)
    A, B = (torch.nn.Parameter(DTensor.from_local(torch.randn(4, 3, generator=gen), mesh, [Replicate()]))
            for _ in range(2))
    opt = FISMO([A, B], lr=0.02)
    partial = DTensor.from_local(torch.randn(4, 3, generator=gen), mesh, [Partial()])
    B.grad_dtype = None  # lets an integer gradient be assigned, the bad input here
    A.grad, B.grad = partial, DTensor.from_local(torch.randn(4, 3, generator=gen).to(torch.int64), mesh,
                                                 [Replicate()])
    with pytest.raises(TypeError, match="non-floating gradient"):
        opt.step()
    assert A.grad is partial and tuple(A.grad.placements) == (Partial(),)
    B.grad = DTensor.from_local(torch.randn(4, 3, generator=gen), mesh, [Replicate()])
    opt.step()
    assert tuple(A.grad.placements) == (Replicate(),)


@pytest.mark.parametrize("layout", ["shard-twice", "partial"])
def test_unsupported_dtensor_layouts_are_refused_with_what_is_supported(one_rank_group, layout):
    """A matrix sharded on two mesh dimensions (FSDP2 combined with tensor parallelism) or held as a
    ``Partial`` sum is refused when the optimizer is built, with the layouts that are supported and
    the way out; an ``"adamw"`` group takes it. A (1, 1) mesh has the placements of a real one."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Shard

    from fismo_core.backends.torch import FISMO

    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "tp"))
    placements = [Shard(0), Shard(1)] if layout == "shard-twice" else [Partial(), Shard(0)]
    w = torch.nn.Parameter(DTensor.from_local(torch.randn(6, 4), mesh, placements))
    with pytest.raises(NotImplementedError) as caught:
        FISMO([w], lr=0.02)
    message = str(caught.value)
    assert f"placements {w.placements} on a 2-D mesh" in message, message
    for supported in ("FSDP2", "HSDP", "ColwiseParallel", "RowwiseParallel", "'adamw' group"):
        assert supported in message, message
    FISMO([{"params": [w], "algorithm": "adamw"}], lr=0.02)  # AdamW takes any layout


def test_an_adamw_state_of_another_layout_is_refused_at_load(one_rank_group):
    """A per-rank state_dict saved in one process, loaded into an optimizer of FSDP2-sharded
    (``DTensor``) parameters, loaded without a word, and the next step failed inside the AdamW group
    (``aten.lerp_`` of a ``DTensor`` and a tensor) after the FISMO groups had stepped. It is refused at
    ``load_state_dict``, before anything changes, with the way to change layouts."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from fismo_core.backends.torch import FISMO

    def build(sharded: bool):
        gen = torch.Generator().manual_seed(0)
        W, b = torch.randn(6, 4, generator=gen), torch.randn(6, generator=gen)
        if sharded:
            mesh = init_device_mesh("cpu", (1,))
            W, b = (DTensor.from_local(t, mesh, [Shard(0)]) for t in (W, b))
        W, b = torch.nn.Parameter(W), torch.nn.Parameter(b)
        return [W, b], FISMO([{"params": [W]}, {"params": [b], "algorithm": "adamw"}], lr=0.02)

    plain, plain_opt = build(sharded=False)
    for p in plain:
        p.grad = torch.ones_like(p)
    plain_opt.step()
    sharded, opt = build(sharded=True)
    before = copy.deepcopy(opt.state_dict())
    with pytest.raises(ValueError, match=r"AdamW state 'exp_avg' for .* is a plain tensor, but the parameter is "
                                         r"a DTensor.*get_state_dict / set_state_dict"):
        opt.load_state_dict(plain_opt.state_dict())
    assert opt.state_dict() == before


def test_a_deep_copy_shares_the_process_group_and_pickling_it_is_refused(one_rank_group):
    """docs/torch.md: ``copy.deepcopy(opt)`` keeps everything; with a real ``process_group`` it raised
    ``cannot pickle 'ProcessGroup' object`` (found by a user's hunt; the earlier test had none). The copy
    shares the group and steps as the original does, bit for bit; pickling says what to pickle instead."""
    import pickle

    model = _model()
    opt = _optimizer(model, process_group=dist.group.WORLD)
    X, Y = _data()
    _train(model, opt, X, Y, range(1))
    twin_model, twin_opt = copy.deepcopy((model, opt))
    assert twin_opt.process_group is opt.process_group
    _train(model, opt, X, Y, range(1, 2))
    _train(twin_model, twin_opt, X, Y, range(1, 2))
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin_model.parameters()))
    with pytest.raises(TypeError, match=r"with a process_group cannot be pickled .* pickle opt.state_dict\(\)"):
        pickle.dumps(opt)


@pytest.mark.parametrize("mode", ["ddp", "fsdp2"])
def test_a_root_failure_on_its_owner_is_refused_on_every_rank(runs, mode):
    """An inverse root beyond ``max_failures`` raised on its owner only; the other rank waited in line 9's
    collective for it (found by a user's hunt: gloo's "Connection closed by peer" once the owner's
    process ended, a hang until the group's timeout in a run that goes on). Its failure now rides in the
    step's all-reduce of the flags: every rank raises at once, nothing changed, no state created. The
    owner names the parameter; the other says that another rank owns it."""
    results = [run[f"{mode}, failed root"] for run in runs]
    owner = [r for r in results if r["owns"]]
    assert len(owner) == 0  # the step was refused: no rank kept the state it would have created
    assert all(r["error"] is not None and not r["changed"] and r["states"] == 0 for r in results), results
    # Well below the spawn's gloo timeout of 60 s: no rank waited for a collective the owner never joined.
    assert all(r["seconds"] < 45 for r in results), results
    errors = sorted(r["error"] for r in results)
    assert errors[0].startswith("FISMO: an inverse root failed beyond InverseRootConfig.max_failures on another rank")
    assert errors[1].endswith("The failing parameters: parameter 0 of param group 0 (shape (16, 12))"), errors[1]


def test_a_thin_matrix_warning_made_an_error_stops_every_rank_before_anything_changes(runs):
    """``FactorSizeWarning`` under a warnings filter that makes it an error: it was issued by the core on the
    matrix's owner alone, which raised, and the other rank failed in the collectives (a user's hunt,
    2026-12-02). Every rank checks every new matrix now, before any collective: all raise it, naming the
    matrix, with nothing changed and no state created."""
    results = [run["warnings made errors"]["factor size"] for run in runs]
    for r in results:
        assert r["error"] and r["error"].startswith("FactorSizeWarning: FISMO: parameter 5 of param group 0 "
                                                    "(shape (1, 1100)), a 1x1100 matrix"), r
        assert not r["changed"] and r["states"] == 0, r


def test_a_repaired_root_warning_made_an_error_stops_every_rank_before_anything_changes(runs):
    """``InverseRootWarning`` (a root repaired, ``max_failures = 1``) made an error: raised on the matrix's
    owner alone, after the step's agreed read, and the other rank waited in line 9's broadcasts (a user's
    hunt, 2026-12-02). The owner's refusal is agreed now as an ``InverseRootError`` is: the owner raises the
    warning, the other a ``RuntimeError`` saying that another rank raised; nothing changed, no state kept."""
    results = sorted((run["warnings made errors"]["repaired root"] for run in runs), key=lambda r: r["error"] or "")
    assert [r["error"].split(":")[0] if r["error"] else None for r in results] == [
        "InverseRootWarning", "RuntimeError"], results
    assert "the inverse square root of P_t failed for 1 of 1 matrices" in results[0]["error"], results[0]
    assert "the step raised on another rank" in results[1]["error"], results[1]
    assert all(not r["changed"] and r["states"] == 0 and not r["owns"] for r in results), results


def test_a_changed_block_size_is_refused_on_every_rank(runs):
    """A rank that owned no matrix of the group did not check it and went on into line 9's broadcast, to wait
    for the owner, which had refused the step. The other ranks' placeholders (``meta`` tensors of the owner's
    shapes, kept since DCP's flattened state dicts needed their keys) let every rank check it."""
    results = [run["block size changed"] for run in runs]
    assert sorted(r["owns"] for r in results) == [False, True]
    for r in results:
        assert r["error"] and "block_size=8 splits parameter 0 of param group 0 (shape (16, 12))" in r["error"], r


@pytest.mark.parametrize("case", ["ddp, float64", "ddp, block_size", "fsdp2, block_size"])
def test_a_state_dict_before_the_next_step_exports_the_owners_state(runs, case):
    """Before 2026-12-03 the ranks sized the owner's tensors by the parameter's dtype and the group's
    ``block_size`` now: after ``model.double()`` a DDP checkpoint held the owner's float32 bytes read as
    float64 on the other ranks (no error; a resumed run was 1.3e-1 off), and after a ``block_size`` change
    gloo aborted every rank (DDP) or the owner raised and the others waited (FSDP2). Every rank now exports
    the owner's stored state, in the state dtype of the parameter's dtype now, as one process does."""
    results = [run["state_dict before the next step"][case] for run in runs]
    assert all(r["error"] is None for r in results), [r["error"] for r in results]
    owners = {i: rank for rank, r in enumerate(results) for i in r["live"]}
    assert set(owners.values()) == set(range(WORLD)), owners  # each rank owns a matrix: both directions checked
    # The state dtype of the parameters' dtype now: DDP's weights were float32 (made float64 in one case),
    # the FSDP2 model is `_model`'s float64.
    want = torch.float32 if case == "ddp, block_size" else torch.float64
    for r in results:
        assert set(r["exported"]) >= set(owners)
        for i, rank in owners.items():
            live = results[rank]["live"][i]
            assert set(r["exported"][i]) == set(live), (i, sorted(r["exported"][i]), sorted(live))
            for key, (value, dtype) in r["exported"][i].items():
                assert dtype == want, (case, i, key, dtype)
                assert torch.equal(value, live[key]), (case, i, key)  # widening float32 to float64 is exact


@pytest.mark.parametrize("mode", ["ddp", "fsdp2"])
def test_a_nan_in_a_loaded_state_is_refused_on_every_rank(runs, mode):
    """Until 2026-12-03 a checkpoint whose ``M`` held a NaN loaded, and the next step made the parameters NaN
    with no error, under every policy. Every rank refuses it now, not only the owner (whose refusal alone
    would have left the others to wait in the next step's collectives), and keeps what it held."""
    results = [run["damaged state loaded"][mode] for run in runs]
    assert sorted(r["owns"] for r in results) == [False, True]
    for r in results:
        assert r["error"] and "state for parameter 1 of param group 0" in r["error"] and "state.M contains NaN or infinite values" in r["error"], r
        assert r["unchanged"], r


def test_a_resized_matrix_is_refused_on_every_rank(runs):
    """A matrix resized in place after its state was made: its owner's core raised (naming no parameter) and
    the other rank, which has only placeholders, went on into the collectives and failed there ("Connection
    closed by peer", or a hang until the timeout). Every rank checks the placeholders' shape now."""
    results = [run["resized"] for run in runs]
    assert sorted(r["owns"] for r in results) == [False, True]
    for r in results:
        assert r["error"] and r["error"].startswith("parameter 1 of param group 0 (shape (5, 3)): its FISMO state "
                                                    "was made for a 4x3 matrix"), r


@pytest.mark.parametrize("change", ["append", "block_size"])
def test_a_change_that_moves_a_matrix_to_another_owner_is_refused_on_every_rank(runs, change):
    """Owners follow parameter order and cost, so a matrix appended to the first group's params, or a
    block_size set on a group before the others (one without states, which no state forbids), moved the
    owners after it: the new owner held placeholders only and raised in the core, the other rank failed in
    the collectives (a user's hunt, 2026-12-02). Refused on every rank now, nothing changed."""
    for r in (run["owners moved"][change] for run in runs):
        assert r["unchanged"] and r["error"] and "would move to another owner rank" in r["error"], r


@pytest.mark.parametrize("mode", ["ddp", "fsdp2"])
def test_a_compiled_distributed_step_runs_eagerly_with_the_eager_numbers(runs, mode):
    """``torch.compile(opt.step)`` under DDP and FSDP2 runs the step eagerly (a ``torch.compiler.disable``d
    call): the eager run's parameters bit for bit, no graph compiled at any step, and ``fullgraph=True``
    refused at trace time, saying why, with nothing changed. Traced, FSDP2 failed in dynamo (``sources must
    not be empty for symbol``, found by a user's hunt, 2026-12-02) and DDP recompiled a frame per parameter."""
    for rank, run in enumerate(r[f"{mode}, compiled"] for r in runs):
        assert all(torch.equal(a, b) for a, b in zip(run["compiled"], run["eager"])), rank
        assert run["graphs"] == [0, 0, 0], (rank, run["graphs"])
        assert "FISMO: a distributed step (DDP, FSDP2, HSDP, TP) runs eagerly" in run["fullgraph"], run["fullgraph"]
        assert run["unchanged by fullgraph"], rank


@pytest.mark.parametrize("case", ["ddp, mismatched gradients", "ddp, mismatched gradients, roots unchecked"])
def test_ddp_gradients_on_some_ranks_only_are_refused_on_every_rank(runs, case):
    """Under DDP (``process_group``) a matrix with a gradient on rank 0 only (set by hand): every rank raises
    the same error before anything changes, naming on rank 1 the matrix it has no gradient for. The
    detection rides in the step's all-reduce of the roots' flags (default configuration). Before
    2026-12-02 rank 1 stepped its other matrix and returned, and rank 0 waited in the broadcast until gloo
    said "Connection closed by peer" (``docs/scripts/ddp_mismatched_grads.py``). With the roots unchecked
    (``fallback=False``) nothing rode until 2026-12-02 (afternoon): the same hang."""
    errors = [r[case]["error"] for r in runs]
    assert all(e is not None and e.startswith("FISMO: the ranks of the process_group hold gradients for "
                                               "different FISMO matrices") for e in errors), errors
    assert "This rank has a gradient for every matrix" in errors[0], errors[0]
    assert "Without a gradient on this rank: parameter 1 of param group 0 (shape (4, 4))" in errors[1], errors[1]
    assert all(r[case]["unchanged"] for r in runs)
