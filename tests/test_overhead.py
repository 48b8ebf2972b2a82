"""The operation counter behind the "Fixed overhead" figures (docs/performance.md,
``docs/scripts/overhead.py``, the asv benchmarks ``bench_overhead.OpCounts``).

``OpCounter`` is checked against operations whose count is known without it: aten ops called
one by one, and the graph ``make_fx`` (torch's own tracer) records for the same step of
``torch.optim.Muon``. Every way Python reads a tensor's value back must count as one host read,
and device-side work as none. The page's method rests on two claims checked here too: the
second step is the steady one, and a step's count does not depend on the matrices' size.
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from torch.fx.experimental.proxy_tensor import make_fx  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "asv_benchmarks"))
from benchmarks.bench_overhead import (  # noqa: E402
    OVERHEAD_CONFIGS,
    TRAINING_OPTIMIZERS,
    OpCounter,
    count_steps,
    matrices_with_grads,
    text_gpt_training,
)

aten = torch.ops.aten


def test_counts_each_dispatched_op_once_and_tells_views_from_kernels():
    a, b = torch.randn(3, 4), torch.randn(4, 5)
    with OpCounter() as counter:
        x = aten.mm.default(a, b)
        y = aten.view.default(x, [15])
        aten.add.Tensor(y, y)
        aten.mm.default(a, b)
        aten.transpose.int(a, 0, 1)
    assert counter.ops == Counter(
        {"aten.mm.default": 2, "aten.view.default": 1, "aten.add.Tensor": 1, "aten.transpose.int": 1}
    )
    assert (counter.total, counter.views, counter.kernels) == (5, 2, 3)
    assert counter.host_reads == []


def test_counts_what_make_fx_traces_for_a_muon_step():
    """torch's tracer records the same aten ops, op by op, for a step of torch.optim.Muon."""
    opt = torch.optim.Muon(matrices_with_grads([(8, 4), (4, 4), (4, 8)]))
    opt.step()  # the state exists: the two steps below are alike
    with OpCounter() as counter:
        opt.step()
    graph = make_fx(lambda: opt.step())().graph
    traced = Counter(str(node.target) for node in graph.nodes if node.op == "call_function")
    assert counter.total > 0
    assert counter.ops == traced


#: Every way of reading a CPU tensor's value into Python, and ops that wait for the data.
HOST_READS = {
    "item": lambda t: t.sum().item(),
    "bool": lambda t: bool(t.sum() > 0),
    "int": lambda t: int(t[0, 0]),
    "float": lambda t: float(t[0, 0]),
    "tolist": lambda t: t.tolist(),
    "numpy": lambda t: t.numpy(),
    "np.asarray": lambda t: np.asarray(t),
    "nonzero": lambda t: t.nonzero(),
    "boolean mask": lambda t: t[t > 0],
    "torch.equal": lambda t: torch.equal(t, t),
}


@pytest.mark.parametrize("how", list(HOST_READS))
def test_a_host_read_counts_once_where_it_is_made(how):
    read = HOST_READS[how]
    t = torch.randn(3, 3)
    with OpCounter() as counter:
        read(t)
    assert len(counter.host_reads) == 1, counter.host_reads
    site = counter.host_reads[0].site
    # the call site is the caller's line (the lambda above), not torch's or the counter's
    assert site.split(" ")[0].endswith(f"test_overhead.py:{read.__code__.co_firstlineno}"), site


def test_device_side_work_is_no_host_read():
    t = torch.randn(4, 4)
    with OpCounter() as counter:
        t @ t
        t[torch.tensor([0, 2])]  # integer indexing: the output size is known without the data
        t.to(torch.float64)
        torch.where(t > 0, t, torch.zeros_like(t))
        torch.isfinite(t).all()
        torch.linalg.eigh(t @ t.mT)
    assert counter.total >= 6
    assert counter.host_reads == []
    assert counter.syncing_linalg == 1  # eigh: counted apart (it synchronises a CUDA device)


def test_nested_counters_both_count_and_tensor_methods_are_restored():
    originals = {name: torch.Tensor.__dict__.get(name) for name in ("tolist", "numpy")}
    t = torch.randn(2, 2)
    with OpCounter() as outer:
        with OpCounter() as inner:
            t.tolist()
            t.sum().item()
        t.numpy()
    assert [r.op for r in inner.host_reads] == ["Tensor.tolist", "aten._local_scalar_dense.default"]
    assert [r.op for r in outer.host_reads] == [
        "Tensor.tolist", "aten._local_scalar_dense.default", "Tensor.numpy"
    ]
    assert {name: torch.Tensor.__dict__.get(name) for name in originals} == originals
    with pytest.raises(ZeroDivisionError):
        with OpCounter():
            1 / 0
    assert {name: torch.Tensor.__dict__.get(name) for name in originals} == originals


def test_stacks_name_the_calling_function():
    def product(x):
        return x @ x

    t = torch.randn(3, 3)
    with OpCounter(stacks=True) as counter:
        product(t)
    [(name, stack)] = counter.stacks
    assert name == "aten.mm.default"
    location, function = stack[-1].rsplit(" ", 1)
    assert function == "product"
    assert location.endswith(f"test_overhead.py:{product.__code__.co_firstlineno + 1}")


@pytest.mark.parametrize("config", list(OVERHEAD_CONFIGS))
def test_a_steps_count_is_steady_from_the_second_step_and_does_not_depend_on_the_size(config):
    """The method of the page: count the second step, on the GPT-2 shapes with every side divided by 16.

    One layer's four shapes divided by 16 and by 8 (block sizes likewise): the same ops, op by op,
    and the same host reads, in the first step and in the steady one; the third step counts as the second.
    """
    by_scale = {scale: count_steps(config, scale=scale, layers=1, steps=3) for scale in (16, 8)}
    for first, second, third in by_scale.values():
        assert second.ops == third.ops
        assert len(second.host_reads) == len(third.host_reads)
    for step in range(3):
        small, large = by_scale[16][step], by_scale[8][step]
        assert small.ops == large.ops
        assert [r.op for r in small.host_reads] == [r.op for r in large.host_reads]


@pytest.mark.parametrize("config", ["propagate", "propagate-B768", "propagate-B256"])
def test_a_step_without_host_reads_dispatches_at_most_one_and_a_half_times_muons_ops(config):
    """Issue 19's target, on the page's method (GPT-2 small's 48 matrices, sides / 16, the steady
    step): under ``nonfinite="propagate"``, full and blocked, at most 1.5x ``torch.optim.Muon``'s
    aten ops, and no host read. Counts, not timings: the same on every CPU (1.00x, 1.06x, 1.14x
    on 2026-11-27); a regression that unbatches a bucket (about 300 ops per matrix) fails it."""
    muon = count_steps("muon")[1]
    fismo = count_steps(config)[1]
    assert fismo.total <= 1.5 * muon.total, (fismo.total, muon.total)
    assert fismo.host_reads == [] and muon.host_reads == []


# ------------------------------------------- the training step of the text GPT (docs/scripts/overhead.py --training-step)
def test_the_training_step_compares_the_training_configuration_with_muon_on_the_same_split():
    """Both runs: the same model, the same matrices to the matrix optimizer, the rest to AdamW at its defaults."""
    from fismo_core.backends.torch import FISMO, bfloat16_is_native, training_precision

    runs = {name: text_gpt_training(name, dim=32, layers=2) for name in TRAINING_OPTIMIZERS}
    muon, adamw = runs["muon"][2]
    (fismo,) = runs["fismo-t"][2]
    assert isinstance(muon, torch.optim.Muon) and isinstance(adamw, torch.optim.AdamW)
    assert isinstance(fismo, FISMO)
    matrices, rest = fismo.param_groups
    assert [p.shape for p in matrices["params"]] == [p.shape for p in muon.param_groups[0]["params"]]
    assert [p.shape for p in rest["params"]] == [p.shape for p in adamw.param_groups[0]["params"]]
    # The training configuration (issue 20's decisions), and torch.optim.AdamW's defaults on the rest.
    assert (matrices["statistics"], matrices["nesterov"], matrices["weight_decay"]) == ("scale_invariant", True, 0.1)
    assert matrices["mu"] == 0.1 and matrices["inv_root"]["every"] == 10
    precision = training_precision(bfloat16_is_native("cpu"))  # FISMO.training's own choice on this CPU
    assert (matrices["polar"]["dtype"], matrices["inv_root"]["matmul_dtype"]) == (
        precision["polar"]["dtype"], precision["inv_root"]["matmul_dtype"])
    # The float32 twins: the same configuration with its polar and products in float32, and that at gamma = 1 (Muon).
    (twin,) = runs["fismo-t-fp32"][2]
    (muon_twin,) = runs["muon-fp32"][2]
    for group, gamma in ((twin.param_groups[0], matrices["gamma"]), (muon_twin.param_groups[0], 1.0)):
        assert group["polar"]["dtype"] is None and group["inv_root"]["matmul_dtype"] is None and group["gamma"] == gamma
        assert group["inv_root"] == {**matrices["inv_root"], "matmul_dtype": None}
        assert all(group[k] == matrices[k] for k in ("statistics", "nesterov", "weight_decay", "mu", "lr"))
    reference = torch.optim.AdamW([torch.zeros(1)]).defaults
    assert rest["algorithm"] == "adamw"
    assert all(rest[k] == reference[k] for k in ("lr", "betas", "eps", "weight_decay"))
    # One training step of each moves every parameter it owns.
    for forward_backward, step, optimizers in runs.values():
        params = [p for opt in optimizers for group in opt.param_groups for p in group["params"]]
        before = [p.detach().clone() for p in params]
        forward_backward()
        step()
        assert all(not torch.equal(b, p) for b, p in zip(before, params))


def test_the_finiteness_check_passes_over_the_tensor_twice():
    """``guards.all_finite`` reads the whole tensor in two ops, ``X * 0`` and its sum (``isfinite``
    then acts on the sum only), where ``all(isfinite(X))`` takes five (torch's ``isfinite`` is four
    elementwise passes); it is the adapter's check of every gradient and parameter under
    ``nonfinite="raise"``."""
    from array_api_compat import torch as xp
    from torch.utils._python_dispatch import TorchDispatchMode

    from fismo_core.guards import all_finite

    class WholeTensorOps(TorchDispatchMode):
        def __init__(self, size):
            super().__init__()
            self.size, self.count = size, 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.count += any(isinstance(a, torch.Tensor) and a.numel() == self.size for a in args)
            return func(*args, **(kwargs or {}))

    X = torch.randn(8, 16)
    with WholeTensorOps(X.numel()) as new:
        all_finite(xp, X)
    with WholeTensorOps(X.numel()) as old:
        torch.isfinite(X).all()
    assert new.count == 2 and old.count > new.count  # 5 in torch 2.13


@pytest.mark.parametrize("native", [True, False], ids=["bfloat16-native", "bfloat16-emulated"])
def test_the_model_benchmarks_time_the_precisions_the_torch_adapter_picks(native: bool) -> None:
    """asv's ``training-B{B}`` (bfloat16 polar and products) and ``training-B{B}-fp32`` (both in the
    parameters' dtype) are ``FISMO.training``'s precision where bfloat16 is native and where it is
    not (``training_precision``): if the adapter's rule changes, this fails rather than the
    benchmarks timing a configuration no one runs."""
    from benchmarks.common import TRAINING_BLOCK_SIZES, VARIANTS

    from fismo_core import FISMO as CoreFISMO
    from fismo_core.backends.torch import training_precision

    precision = training_precision(native)
    for B in TRAINING_BLOCK_SIZES:
        core = CoreFISMO(**VARIANTS[f"training-B{B}" if native else f"training-B{B}-fp32"])
        assert core.polar.dtype == precision["polar"]["dtype"]
        assert core.inv_root.matmul_dtype == precision["inv_root"]["matmul_dtype"]
        assert core.block_size == B and core.inv_root.every == 10 and core.statistics == "scale_invariant"
