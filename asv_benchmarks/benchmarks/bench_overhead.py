"""The fixed overhead of an optimizer step: aten operations and host reads per step, and the step
time of a small GPT, eager and compiled, against ``torch.optim.Muon`` (issue 19, "Overhead like
Muon's"; the documentation page "Performance", section "Fixed overhead").

On a GPU every aten operation that is not a view is a kernel launch, and every host read (a
value copied back to Python: ``.item()``, ``bool(t)``, ``.tolist()``, ``nonzero``...) stops the
host until the device has caught up. Both are counted here with a
``torch.utils._python_dispatch.TorchDispatchMode`` (`OpCounter`), on the CPU: which operations
a step dispatches does not depend on the device, nor on the matrices' size, only on their
shapes' structure (which sides are split into blocks, which are equal). So the 48 weight
matrices of GPT-2 small (12 layers of 768x2304, 768x768, 768x3072, 3072x768) are counted with
every side divided by 16 (48x144, 48x48, 48x192, 192x48; block sizes divided likewise):
``docs/scripts/overhead.py --verify-scale 1`` counts again at full size and compares.

This module is also the counting tool of ``docs/scripts/overhead.py`` and of
``tests/test_overhead.py``.
"""

from __future__ import annotations

import functools
import math
import os
import statistics
import sys
import sysconfig
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Optional

from .common import GPT2_LAYER, SMOKE, interleaved_medians, torch_device

try:
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
except ImportError:  # the benchmarks then skip, saying so (torch_device)
    torch = None
    TorchDispatchMode = object

#: GPT-2 small: 12 layers of the four matrices of ``GPT2_LAYER``.
GPT2_LAYERS = 12
#: The counts use every side divided by this (the count does not depend on the size).
COUNT_SCALE = 16

#: The configurations counted, by id: ``None`` is ``torch.optim.Muon`` with torch's defaults,
#: a dict is ``fismo_core.backends.torch.FISMO(**kwargs)``, block sizes at GPT-2's full size.
OVERHEAD_CONFIGS: dict[str, Optional[dict]] = {
    "muon": None,
    "default": {},
    "propagate": {"nonfinite": "propagate"},
    "propagate-B768": {"nonfinite": "propagate", "block_size": 768},
    "propagate-B256": {"nonfinite": "propagate", "block_size": 256},
    "newton_schulz": {"nonfinite": "propagate", "inv_root": "newton_schulz"},
}

#: What each id is, in words (the tables of ``docs/scripts/overhead.py``).
CONFIG_LABELS = {
    "muon": "torch.optim.Muon (defaults)",
    "default": "FISMO()",
    "propagate": 'FISMO(nonfinite="propagate")',
    "propagate-B768": 'FISMO(nonfinite="propagate", block_size=768)',
    "propagate-B256": 'FISMO(nonfinite="propagate", block_size=256)',
    "newton_schulz": 'FISMO(nonfinite="propagate", inv_root="newton_schulz")',
    "propagate-B32": 'FISMO(nonfinite="propagate", block_size=32)',
    "training": 'FISMO.training(nonfinite="propagate")',
}

#: Ops that only relabel a tensor's memory (no kernel on a GPU) that torch's schemas do not mark
#: as views: ``_unsafe_view`` (the reshape after a matmul) and the profiler's markers.
METADATA_OPS = frozenset({"aten._unsafe_view", "profiler._record_function_enter_new", "profiler._record_function_exit"})
#: Ops that copy between devices: a copy from an accelerator to the CPU is a host read.
COPY_OPS = frozenset({"aten._to_copy", "aten.copy_", "aten._copy_from", "aten._copy_from_and_resize"})
#: Decompositions whose call synchronises a CUDA device with the CPU (torch's documentation of
#: ``torch.linalg.eigh``: "When inputs are on a CUDA device, this function synchronizes that
#: device with the CPU"), counted apart from the host reads.
SYNCING_LINALG_OPS = frozenset({"aten._linalg_eigh"})


@dataclass(frozen=True)
class HostRead:
    """One read of a device value by the host: the op (or Python method), where it was called, the device."""

    op: str
    site: str
    device: str
    #: every caller outside the libraries, outermost first (`call_stack`), when the counter records stacks
    stack: tuple[str, ...] = ()


@functools.lru_cache(maxsize=None)
def project_dirs() -> tuple[str, ...]:
    """The directories of fismo's own code (the core and the adapters), wherever it is installed."""
    import fismo_core
    import fismo_core.backends

    return tuple(os.path.dirname(m.__file__) + os.sep for m in (fismo_core, fismo_core.backends))


@functools.lru_cache(maxsize=None)
def _library_dirs() -> tuple[str, ...]:
    """torch's, the standard library's and the installed packages' directories, and this module."""
    paths = sysconfig.get_paths()
    dirs = {os.path.dirname(torch.__file__)} | {paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    return (*(d + os.sep for d in dirs), __file__)


def _site_frames() -> Iterator[Any]:
    """The Python frames of the caller, innermost first: fismo's and the user's, not the libraries' (`_library_dirs`)."""
    keep, skip = project_dirs(), _library_dirs()
    frame = sys._getframe(1)
    while frame is not None:
        path = frame.f_code.co_filename
        if path.startswith(keep) or not path.startswith(skip):
            yield frame
        frame = frame.f_back


def _describe(frame: Any) -> str:
    """``path:line function`` of a frame, the path relative to the working directory where it lies below it."""
    path = frame.f_code.co_filename
    rel = os.path.relpath(path)
    return f"{path if rel.startswith('..') else rel}:{frame.f_lineno} {frame.f_code.co_name}"


def call_site() -> str:
    """The innermost caller outside torch, the standard library and this module (where an op came from)."""
    for frame in _site_frames():
        return _describe(frame)
    return "?"


def call_stack() -> tuple[str, ...]:
    """Every caller outside torch, the standard library and this module, outermost first."""
    return tuple(reversed([_describe(frame) for frame in _site_frames()]))


def _device(x: Any) -> Optional[Any]:
    return x.device if torch is not None and isinstance(x, torch.Tensor) else None


class OpCounter(TorchDispatchMode):
    """Counts the aten operations dispatched while it is active, and the host reads among them.

    ``with OpCounter() as c: opt.step()``, then ``c.total`` (every dispatched op, as
    ``TorchDispatchMode`` sees them), ``c.kernels`` (those that are not views: the kernel launches
    of a GPU), ``c.host_reads`` and ``c.syncing_linalg``. A host read is

    - an op torch tags as reading data back (``Tag.data_dependent_output``: ``_local_scalar_dense``,
      behind ``.item()``, ``bool(t)``, ``int(t)``, ``float(t)``; ``equal``, ``allclose``),
    - an op whose output size depends on the data (``Tag.dynamic_output_shape``: ``nonzero``,
      ``masked_select``, ``unique``, boolean-mask indexing; not integer indexing),
    - a copy from another device to the CPU,
    - ``Tensor.tolist()`` and ``Tensor.numpy()`` (they read memory without dispatching an op on
      a CPU tensor, so they are counted at the Python level while the counter is active).

    ``stacks=True`` also records, for every op, its name and the callers outside torch
    (`call_stack`), in ``c.stacks`` (a ``Counter``): where the operations come from.
    """

    _active: list["OpCounter"] = []
    _patched: dict[str, Any] = {}

    def __init__(self, *, stacks: bool = False) -> None:
        super().__init__()
        self.ops: Counter = Counter()
        self.host_reads: list[HostRead] = []
        self.stacks: Counter = Counter()
        self._record_stacks = stacks
        self._views: set[str] = set()
        self._python_read_depth = 0

    # -------------------------------------------------------------- results
    @property
    def total(self) -> int:
        """Every aten (and profiler) op dispatched."""
        return sum(self.ops.values())

    @property
    def views(self) -> int:
        """The ops among them that only relabel memory (views, ``_unsafe_view``, profiler markers)."""
        return sum(count for name, count in self.ops.items() if name in self._views)

    @property
    def kernels(self) -> int:
        """The ops that are not views: on a GPU, each one is a kernel launch (or a library call)."""
        return self.total - self.views

    @property
    def syncing_linalg(self) -> int:
        """Calls of decompositions that synchronise a CUDA device (``eigh``), counted apart from host reads."""
        return sum(count for name, count in self.ops.items() if name.rsplit(".", 1)[0] in SYNCING_LINALG_OPS)

    def is_view(self, name: str) -> bool:
        """Whether the op ``name`` (as in ``ops``) only relabels memory."""
        return name in self._views

    # ------------------------------------------------------------- counting
    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        name = str(func)
        packet = name.rsplit(".", 1)[0]
        self.ops[name] += 1
        if func.is_view or packet in METADATA_OPS:
            self._views.add(name)
        if self._reads_host(func, packet, args, kwargs):
            self._read(name, args)
        if self._record_stacks:
            self.stacks[(name, call_stack())] += 1
        return func(*args, **kwargs)

    def _reads_host(self, func: Any, packet: str, args: tuple, kwargs: dict) -> bool:
        tags = func.tags
        if torch.Tag.data_dependent_output in tags:
            return True
        if torch.Tag.dynamic_output_shape in tags:
            if packet == "aten.index":  # only a boolean mask makes indexing wait for the data
                indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
                return any(i is not None and i.dtype in (torch.bool, torch.uint8) for i in indices)
            return True
        if packet in COPY_OPS and self._python_read_depth == 0:
            if packet == "aten._to_copy":
                source, target = _device(args[0]), kwargs.get("device")
            else:  # copy_(dst, src) and _copy_from(src, dst)
                dst, src = (args[0], args[1]) if packet == "aten.copy_" else (args[1], args[0])
                source, target = _device(src), _device(dst)
            return source is not None and target is not None and source.type != "cpu" and torch.device(target).type == "cpu"
        return False

    def _read(self, op: str, args: tuple) -> None:
        first = next((a for a in args if _device(a) is not None), None)
        self._add_read(op, str(_device(first)) if first is not None else "?")

    def _add_read(self, op: str, device: str) -> None:
        stack = call_stack() if self._record_stacks else ()
        self.host_reads.append(HostRead(op, call_site(), device, stack))

    # ----------------------------------------- Python-level reads (tolist, numpy)
    def __enter__(self) -> "OpCounter":
        if not OpCounter._active:
            for method in ("tolist", "numpy"):
                OpCounter._patched[method] = torch.Tensor.__dict__.get(method)
                setattr(torch.Tensor, method, _python_read(method, getattr(torch.Tensor, method)))
        OpCounter._active.append(self)
        return super().__enter__()

    def __exit__(self, *exc: Any) -> Any:
        try:
            return super().__exit__(*exc)
        finally:
            OpCounter._active.remove(self)
            if not OpCounter._active:
                for method, original in OpCounter._patched.items():
                    if original is None:
                        delattr(torch.Tensor, method)
                    else:
                        setattr(torch.Tensor, method, original)
                OpCounter._patched.clear()


def _python_read(method: str, original: Callable) -> Callable:
    """``Tensor.<method>`` that records a host read in every active `OpCounter` (and not the copy it makes)."""

    def read(self: Any, *args: Any, **kwargs: Any) -> Any:
        for counter in OpCounter._active:
            counter._add_read(f"Tensor.{method}", str(self.device))
            counter._python_read_depth += 1
        try:
            return original(self, *args, **kwargs)
        finally:
            for counter in OpCounter._active:
                counter._python_read_depth -= 1

    read.__name__ = method
    return read


# ------------------------------------------------------------------ workloads
def gpt2_shapes(scale: int = COUNT_SCALE, layers: int = GPT2_LAYERS) -> list[tuple[int, int]]:
    """The weight matrices of GPT-2 small (``layers`` x the four of ``GPT2_LAYER``), every side divided by ``scale``."""
    for m, n in GPT2_LAYER:
        if m % scale or n % scale:
            raise ValueError(f"scale {scale} does not divide GPT-2's {m}x{n}")
    return [(m // scale, n // scale) for m, n in GPT2_LAYER] * layers


def matrices_with_grads(shapes: list[tuple[int, int]], seed: int = 0) -> list:
    """float32 parameters of ``shapes`` (entries of RMS 0.02) with fixed Gaussian gradients (RMS ``1/sqrt(n)``)."""
    gen = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(0.02 * torch.randn(m, n, generator=gen)) for m, n in shapes]
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1])
    return params


def make_optimizer(config: str, params: list, scale: int = 1, configs: Optional[dict] = None):
    """The optimizer ``config`` (an id of ``OVERHEAD_CONFIGS``, or of ``configs``) over ``params``, block sizes divided by ``scale``."""
    kwargs = (OVERHEAD_CONFIGS if configs is None else configs)[config]
    if kwargs is None:
        return torch.optim.Muon(params)
    from fismo_core.backends.torch import FISMO

    kwargs = dict(kwargs)
    build = FISMO.training if kwargs.pop("training", False) else FISMO
    if kwargs.get("block_size") is not None:
        if kwargs["block_size"] % scale:
            raise ValueError(f"scale {scale} does not divide block_size {kwargs['block_size']}")
        kwargs["block_size"] //= scale
    return build(params, **kwargs)


def count_steps(
    config: str, *, scale: int = COUNT_SCALE, layers: int = GPT2_LAYERS, steps: int = 2, stacks: bool = False
) -> list[OpCounter]:
    """One `OpCounter` per step of a fresh optimizer ``config`` on the GPT-2 matrices (``gpt2_shapes``).

    The first step also creates the state; the second is the steady step (the third counts the
    same, checked by ``tests/test_overhead.py``).
    """
    torch_device("cpu")
    params = matrices_with_grads(gpt2_shapes(scale, layers))
    opt = make_optimizer(config, params, scale)
    counters = []
    for _ in range(steps):
        with OpCounter(stacks=stacks) as counter:
            opt.step()
        counters.append(counter)
    return counters


# ------------------------------------------------------------ the small GPT
#: Configurations of the small-GPT timings (block size 32 is the issue's second figure).
GPT_CONFIGS = ["default", "propagate", "propagate-B32", "training"]
GPT_FISMO = {
    "default": OVERHEAD_CONFIGS["default"],
    "propagate": OVERHEAD_CONFIGS["propagate"],
    "propagate-B32": {**OVERHEAD_CONFIGS["propagate"], "block_size": 32},
    # The training configuration (FISMO.training: roots every 10 steps, the bfloat16 polar as
    # torch.optim.Muon's), without host reads, as it is compiled.
    "training": {"training": True, "nonfinite": "propagate"},
}


def small_gpt_matrices(seed: int = 0) -> list:
    """The 8 hidden matrices of the demo's byte-level GPT (2 layers, d = 64: 192x64, 64x64, 256x64,
    64x256, twice), with the gradients of one cross-entropy step on random bytes."""
    torch_device("cpu")
    from fismo_core.demo.models import TinyGPT

    torch.manual_seed(seed)
    model = TinyGPT()
    idx = torch.randint(0, 256, (8, model.context + 1))
    logits = model(idx[:, :-1])
    torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), idx[:, 1:].reshape(-1)).backward()
    return [p for name, p in model.named_parameters() if name.startswith("blocks.") and p.ndim == 2]


def _dynamo_totals() -> dict[str, int]:
    """Dynamo's running totals: graphs compiled, graph breaks (per trace), recompile-limit hits."""
    from torch._dynamo.utils import counters

    return {
        "graphs": counters["stats"]["unique_graphs"],
        "graph_breaks": sum(counters["graph_break"].values()),
        "recompile_limit": sum(v for k, v in counters["unimplemented"].items() if "recompile limit" in k.lower()),
    }


@dataclass
class CompiledStep:
    """``torch.compile(opt.step)`` (inductor) after its warm-up, or why it could not be run."""

    step: Optional[Callable[[], Any]]
    #: seconds of the first call: compiling, and the step that creates the state
    compile_seconds: float = math.nan
    #: graphs compiled, graph breaks and recompile-limit hits in the first two calls (FISMO's state is
    #: created while the first is traced), and graphs compiled in the next eleven (recompiles at steady state; they
    #: include a step that recomputes the roots of ``InverseRootConfig(every=10)``)
    warmup: dict = field(default_factory=dict)
    steady_graphs: int = 0
    break_reasons: list = field(default_factory=list)
    error: str = ""


def compile_step(opt: Any, mode: Optional[str] = None) -> CompiledStep:
    """Compile ``opt.step`` with inductor (``torch.compile``'s ``mode``) and run it 13 times; reports, never
    raises, on a failure."""
    from torch._dynamo.utils import counters

    before, reasons_before = _dynamo_totals(), Counter(counters["graph_break"])
    step = torch.compile(opt.step, mode=mode)
    try:
        start = time.perf_counter()
        step()
        compile_seconds = time.perf_counter() - start
        step()
        after_warmup = _dynamo_totals()
        for _ in range(11):
            step()
    except Exception as exc:  # reported (the fix may not have landed), so the script runs on
        message = str(exc).strip().splitlines()
        return CompiledStep(None, error=f"{type(exc).__name__}: {message[0] if message else ''}"[:300])
    warmup = {k: after_warmup[k] - before[k] for k in before}
    reasons = Counter(counters["graph_break"]) - reasons_before
    return CompiledStep(
        step,
        compile_seconds,
        warmup,
        _dynamo_totals()["graphs"] - after_warmup["graphs"],
        [(reason.splitlines()[0], count) for reason, count in reasons.most_common()],
    )


def small_gpt_optimizer(config: str, seed: int = 0):
    """A fresh optimizer ``config`` ("muon" or an id of ``GPT_FISMO``) over the small GPT's matrices."""
    configs = {"muon": None, **GPT_FISMO}
    return make_optimizer(config, small_gpt_matrices(seed), configs=configs)


def small_gpt_times(configs: list[str], *, compiled: bool, repeats: int, mode: Optional[str] = None) -> tuple[dict, dict]:
    """Median seconds of ``opt.step`` on the small GPT for Muon and ``configs``, eager (and compiled with
    ``torch.compile``'s ``mode``), interleaved.

    Returns the medians by name (``"<config>"``, ``"<config> compiled"``) and the `CompiledStep`
    of each compiled configuration. Each optimizer steps its own parameters, gradients fixed.
    """
    names = ["muon", *configs]
    fns: dict[str, Callable[[], Any]] = {}
    compiled_steps: dict[str, CompiledStep] = {}
    for name in names:
        opt = small_gpt_optimizer(name)
        opt.step()  # the state is created
        fns[name] = opt.step
    if compiled:
        for name in names:
            result = compile_step(small_gpt_optimizer(name), mode)
            compiled_steps[name] = result
            if result.step is not None:
                fns[f"{name} compiled"] = result.step
    return interleaved_medians(fns, repeats), compiled_steps


# ------------------------------------------- the training step of the demo's text GPT
#: ``(dim, layers)`` of the whole-step timings: the demo's text GPT (``TextTask``: d = 64, 2 layers)
#: and the sizes of the scaling study (issue 20, point 3).
TRAINING_STEP_SIZES = [(64, 2), (32, 2), (64, 4), (128, 5)]
#: The optimizers of the whole-step timings: ``torch.optim.Muon`` at its defaults and the training
#: configuration, ``fismo_core.backends.torch.FISMO.training`` at its (Muon's) defaults; both with
#: ``torch.optim.AdamW`` at its defaults on the rest (embeddings, norms, biases, the head). Both
#: iterate in bfloat16, which CPUs without bf16 instructions (AVX2) emulate many times slower than
#: float32, so the float32 twins are timed too: the training configuration with its polar and its
#: preconditioners' products in float32, and the same with ``gamma=1`` (``P = Q = I``: Muon with Nesterov, weight decay and its
#: learning-rate adjustment, iterating in float32, through FISMO's code).
TRAINING_OPTIMIZERS = {
    "muon": "torch.optim.Muon (defaults) + AdamW",
    "fismo-t": "FISMO.training (defaults) + AdamW",
    "muon-fp32": "FISMO.training(gamma=1, polar and products float32) + AdamW: Muon in float32",
    "fismo-t-fp32": "FISMO.training(polar and products float32) + AdamW",
}


def text_gpt_training(optimizer: str, dim: int = 64, layers: int = 2, seed: int = 0) -> tuple[Callable, Callable, list]:
    """``(forward_backward, step, optimizers)`` of one training step of the demo's byte-level GPT.

    The model is ``fismo_core.demo.tasks.TextTask(dim=dim, layers=layers).model()`` on a fixed batch
    of random bytes (32 windows of 64); ``forward_backward`` zeroes the gradients and computes them,
    ``step`` steps every optimizer. ``optimizer`` is an id of `TRAINING_OPTIMIZERS`; the matrices are
    split from the rest by ``param_groups``, the same split for both.
    """
    torch_device("cpu")
    from fismo_core.backends.torch import FISMO, param_groups
    from fismo_core.demo.tasks import TextTask

    torch.manual_seed(seed)
    task = TextTask(dim=dim, layers=layers)
    model = task.model()
    groups = param_groups(model)
    matrices, rest = groups[0]["params"], groups[1]["params"]
    if optimizer == "muon":
        optimizers = [torch.optim.Muon(matrices), torch.optim.AdamW(rest)]
    elif optimizer == "fismo-t":
        optimizers = [FISMO.training(groups)]  # its "adamw" group has torch.optim.AdamW's defaults
    elif optimizer == "fismo-t-fp32":
        optimizers = [FISMO.training(groups, polar={"dtype": None}, inv_root={"matmul_dtype": None})]
    elif optimizer == "muon-fp32":
        optimizers = [FISMO.training(groups, gamma=1.0, polar={"dtype": None}, inv_root={"matmul_dtype": None})]
    else:
        raise ValueError(f"unknown optimizer {optimizer!r}: one of {list(TRAINING_OPTIMIZERS)}")
    gen = torch.Generator().manual_seed(seed)
    x, y = (torch.randint(0, 256, (task.batch_size, task.context), generator=gen) for _ in range(2))

    def forward_backward() -> None:
        for opt in optimizers:
            opt.zero_grad(set_to_none=True)
        task.loss(model, x, y).backward()

    def step() -> None:
        for opt in optimizers:
            opt.step()

    return forward_backward, step, optimizers


def training_step_times(dim: int, layers: int, repeats: int, cycle: int = 10) -> dict[str, float]:
    """Median seconds per step of ``"<optimizer> whole"`` (forward, backward and ``opt.step``) and
    ``"<optimizer> step"`` (``opt.step`` alone) for every optimizer of `TRAINING_OPTIMIZERS`.

    One sample is a cycle of ``cycle`` training steps (the training configuration recomputes its
    roots on one step in 10), divided by its length; the optimizers take their cycles in turn
    (A B A B ...), ``repeats`` each, after two warm-up cycles; medians of the samples.
    """
    runs = {name: text_gpt_training(name, dim, layers)[:2] for name in TRAINING_OPTIMIZERS}
    for forward_backward, step in runs.values():
        for _ in range(2 * cycle):
            forward_backward()
            step()
    samples: dict[str, list[float]] = {f"{name} {part}": [] for name in runs for part in ("whole", "step")}
    for _ in range(repeats):
        for name, (forward_backward, step) in runs.items():
            whole = stepping = 0.0
            for _ in range(cycle):
                start = time.perf_counter()
                forward_backward()
                middle = time.perf_counter()
                step()
                end = time.perf_counter()
                whole += end - start
                stepping += end - middle
            samples[f"{name} whole"].append(whole / cycle)
            samples[f"{name} step"].append(stepping / cycle)
    return {key: statistics.median(values) for key, values in samples.items()}


# ------------------------------------------------------------------ benchmarks
class OpCounts:
    """Aten ops, kernels (non-view ops) and host reads per step of each configuration on GPT-2
    small's 48 matrices (sides / 16, which leaves the counts unchanged), a step after the first,
    and their ratio to ``torch.optim.Muon``'s."""

    params = (list(OVERHEAD_CONFIGS),)
    param_names = ["optimizer"]
    timeout = 600

    def setup_cache(self) -> dict:
        try:
            torch_device("cpu")
        except NotImplementedError as exc:
            return {"skip": str(exc)}  # a dict: asv passes no cache at all when setup_cache returns None
        counts = {}
        for config in OVERHEAD_CONFIGS:
            first, later = count_steps(config)
            counts[config] = {
                "ops": later.total, "kernels": later.kernels, "host_reads": len(later.host_reads),
                "first_ops": first.total, "eigh": later.syncing_linalg,
            }
        return counts

    def setup(self, counts: dict, optimizer: str) -> None:
        if "skip" in counts:
            raise NotImplementedError(counts["skip"])

    def track_aten_ops(self, counts: dict, optimizer: str) -> int:
        return counts[optimizer]["ops"]

    track_aten_ops.unit = "aten ops per step"

    def track_first_step_aten_ops(self, counts: dict, optimizer: str) -> int:
        return counts[optimizer]["first_ops"]

    track_first_step_aten_ops.unit = "aten ops in the first step"

    def track_kernels(self, counts: dict, optimizer: str) -> int:
        return counts[optimizer]["kernels"]

    track_kernels.unit = "non-view aten ops per step"

    def track_host_reads(self, counts: dict, optimizer: str) -> int:
        return counts[optimizer]["host_reads"]

    track_host_reads.unit = "host reads per step"

    def track_eigh_calls(self, counts: dict, optimizer: str) -> int:
        return counts[optimizer]["eigh"]

    track_eigh_calls.unit = "eigh calls per step (each syncs a CUDA device)"

    def track_ops_ratio_to_muon(self, counts: dict, optimizer: str) -> float:
        return counts[optimizer]["ops"] / counts["muon"]["ops"]

    track_ops_ratio_to_muon.unit = "aten ops / torch.optim.Muon's (target <= 1.5 under propagate)"


class SmallGPTStep:
    """Eager ``opt.step`` on the demo's small byte-level GPT (8 matrices, 64 to 256) against
    ``torch.optim.Muon``'s, medians of interleaved repeats (CPU)."""

    params = (GPT_CONFIGS,)
    param_names = ["optimizer"]
    timeout = 600

    def setup_cache(self) -> dict:
        try:
            torch_device("cpu")
        except NotImplementedError as exc:
            return {"skip": str(exc)}  # a dict: asv passes no cache at all when setup_cache returns None
        return small_gpt_times(GPT_CONFIGS, compiled=False, repeats=3 if SMOKE else 15)[0]

    def setup(self, medians: dict, optimizer: str) -> None:
        if "skip" in medians:
            raise NotImplementedError(medians["skip"])

    def track_eager_ratio_to_muon(self, medians: dict, optimizer: str) -> float:
        return medians[optimizer] / medians["muon"]

    track_eager_ratio_to_muon.unit = "FISMO step / torch.optim.Muon step, eager"


class SmallGPTCompiled:
    """``torch.compile(opt.step)`` (inductor, CPU) on the small GPT against ``torch.optim.Muon``'s
    compiled step, medians of interleaved repeats, with the graphs, graph breaks and recompiles of
    the compiled FISMO step. Not in the smoke run (compiling takes minutes)."""

    params = (GPT_CONFIGS,)
    param_names = ["optimizer"]
    timeout = 1800

    def setup_cache(self) -> dict:
        try:
            torch_device("cpu")
        except NotImplementedError as exc:
            return {"skip": str(exc)}  # a dict: asv passes no cache at all when setup_cache returns None
        if SMOKE:
            return {"skip": "the smoke run does not compile"}
        medians, compiled = small_gpt_times(GPT_CONFIGS, compiled=True, repeats=15)
        return {
            "medians": medians,
            "compiled": {name: (c.warmup, c.steady_graphs, c.error) for name, c in compiled.items()},
        }

    def setup(self, results: dict, optimizer: str) -> None:
        if "skip" in results:
            raise NotImplementedError(results["skip"])
        for name in (optimizer, "muon"):
            error = results["compiled"][name][2]
            if error:
                raise RuntimeError(f"torch.compile(opt.step) of {name} failed: {error}")

    def track_compiled_ratio_to_muon(self, results: dict, optimizer: str) -> float:
        return results["medians"][f"{optimizer} compiled"] / results["medians"]["muon compiled"]

    track_compiled_ratio_to_muon.unit = "compiled FISMO step / compiled torch.optim.Muon step (target <= 2)"

    def track_compiled_graphs(self, results: dict, optimizer: str) -> int:
        return results["compiled"][optimizer][0]["graphs"]

    track_compiled_graphs.unit = "graphs compiled in the first two steps (target 1)"

    def track_compiled_graph_breaks(self, results: dict, optimizer: str) -> int:
        return results["compiled"][optimizer][0]["graph_breaks"]

    track_compiled_graph_breaks.unit = "graph breaks in the first two steps (target 0)"

    def track_recompile_limit_hits(self, results: dict, optimizer: str) -> int:
        return results["compiled"][optimizer][0]["recompile_limit"]

    track_recompile_limit_hits.unit = "recompile-limit hits in the first two steps (target 0)"

    def track_steady_recompiles(self, results: dict, optimizer: str) -> int:
        return results["compiled"][optimizer][1]

    track_steady_recompiles.unit = "graphs compiled in steps 3 to 13 (target 0)"
