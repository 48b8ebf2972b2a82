"""The GPU checks in one command: GPU tests, fismo verify, the compiled step, the performance script.

Issue 19, point 7; the documentation page "Verification", section "On a GPU machine".

    python docs/scripts/gpu_checks.py                          # every stage
    python docs/scripts/gpu_checks.py --quick                  # shorter runs of every stage
    python docs/scripts/gpu_checks.py --stages tests,compile   # some stages (names or numbers 1-4)
    python docs/scripts/gpu_checks.py --out DIR                # logs and summary.json (default fismo-results/gpu-checks)

The stages run in order, each timed; a stage that fails does not stop the next ones.

1. ``tests``: pytest on every test whose id names CUDA, CuPy or JAX's GPU (``pytest tests -q -rs -k
   "cuda or cupy or jax-gpu"``: the ``torch-cuda-*``, ``cupy-cuda-*`` and ``jax-gpu-*`` cases of the
   shared target fixtures, ``tests/test_cupy.py``, the CUDA tests of ``tests/test_devices.py``), in
   parallel (``-n`` up to 8 workers) where pytest-xdist is installed, with the counts of passed,
   skipped and failed tests.
2. ``verify``: ``fismo verify`` (``--steps 5`` with ``--quick``), which adds the ``torch-cuda``
   and ``cupy-cuda`` targets by itself; the GPU rows are reported.
3. ``compile``: ``torch.compile(opt.step, mode="reduce-overhead", fullgraph=True)`` (CUDA graphs)
   of ``fismo_core.backends.torch.FISMO(nonfinite="propagate")`` and
   ``FISMO.training(nonfinite="propagate")`` on CUDA, float32 and bfloat16 parameters, on the demo's
   byte-level GPT (8 matrices, 64 to 256); without ``--quick`` also with Newton–Schulz roots, compiled
   after eager steps and with AdamW biases (`CONFIGS`), and on GPT-2 small's 48 matrices
   (`LARGE_MODEL_CONFIGS`). Reported: graphs and graph breaks
   (dynamo's counters), graphs compiled after the first step (recompiles), CUDA-graph skips,
   host reads and aten ops of an eager step (a ``TorchDispatchMode``), the compiled parameters
   against the eager ones after the same steps, and median step times, eager and compiled,
   against ``torch.optim.Muon``'s (eager and compiled), interleaved in one run.
4. ``performance``: ``docs/scripts/performance.py --only models --device cuda`` (one step over
   the weight matrices of real models), its output kept. That script times float32 parameters
   (its ``-bf16`` rows run the polar iteration in bfloat16) and has no CuPy section. It stores its
   medians in ``docs/performance/model_steps.json`` under ``<model>/cuda``; with ``--quick`` the
   file is restored afterwards (one-repeat medians are not worth keeping).

A stage that needs a device this machine lacks is skipped, with the reason (that of
``fismo_core.testing.targets``, as ``fismo verify`` reports it). Exit status: 0 when no stage
failed (skipped ones included), 1 when one failed, 2 for a usage error.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import math
import os
import platform
import re
import shlex
import subprocess
import sys
import textwrap
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional, TextIO

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_OUT = ROOT / "fismo-results" / "gpu-checks"
#: The devices a stage can need: torch on CUDA, CuPy on CUDA.
TORCH_CUDA, CUPY = "torch-cuda", "cupy"
#: pytest's ``-k`` expression of stage 1: every test id naming CUDA, CuPy or JAX's GPU (JAX labels its
#: targets by platform: ``jax-gpu-float64`` where a CUDA jaxlib is installed).
GPU_TEST_SELECTION = "cuda or cupy or jax-gpu"
#: Stage 1's pytest-xdist workers at most (one per core below that): 1136 tests took 223 s with 8 on an
#: H200 machine of 16 cores (2026-12-04); one process would take many times that.
MAX_TEST_WORKERS = 8
#: Medians of stage 3 are over this many interleaved calls (``--quick``: the second number).
STEP_REPEATS, QUICK_STEP_REPEATS = 30, 10
#: Steps the compiled and the eager optimizer take before their parameters are compared: the
#: first step compiles the one graph (the adapter's ``_init_group`` creates the state while dynamo
#: traces); CUDA graph trees warm up on a graph's first call, record on its second and replay from
#: its third, so five steps include three replays.
COMPARED_STEPS = 5


# ----------------------------------------------------------------------------- the runner
@dataclass
class StageResult:
    """What a stage found: ``status`` is "passed", "failed" or "skipped"; ``reason`` says why it
    failed or was skipped; ``figures`` are the key figures (name -> text) of the summary table."""

    status: str
    reason: str = ""
    figures: dict[str, str] = field(default_factory=dict)
    details: Any = None  # anything JSON-serialisable, kept in summary.json
    seconds: float = math.nan

    def __post_init__(self) -> None:
        if self.status not in ("passed", "failed", "skipped"):
            raise ValueError(f"status must be 'passed', 'failed' or 'skipped', not {self.status!r}")


@dataclass(frozen=True)
class Options:
    quick: bool = False
    out: Path = DEFAULT_OUT


@dataclass(frozen=True)
class Stage:
    """One stage: ``run(options, log)`` returns its `StageResult`; ``needs`` lists devices any one
    of which lets it run (`TORCH_CUDA`, `CUPY`); without any it is skipped with their reasons."""

    name: str
    title: str
    run: Callable[[Options, "Log"], StageResult]
    needs: tuple[str, ...] = ()


class Log:
    """Prints progress as it goes and keeps a copy in a file (``None``: print only)."""

    def __init__(self, path: Optional[Path] = None) -> None:
        self.path = path
        self._file: Optional[TextIO] = None
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._file = path.open("w")

    def say(self, text: str = "", indent: str = "  ") -> None:
        for line in text.splitlines() or [""]:
            print(indent + line, flush=True)
            if self._file is not None:
                self._file.write(line + "\n")
                self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


def device_reasons() -> dict[str, Optional[str]]:
    """For `TORCH_CUDA` and `CUPY`: ``None`` where the device can be used, else why not (the
    reasons of ``fismo_core.testing.targets``, those of ``fismo verify``'s table)."""
    from fismo_core.testing import targets

    found = {t.backend: t for t in targets(backends=["torch", "cupy"], dtypes=["float32"]) if t.device == "cuda"}
    return {TORCH_CUDA: found["torch"].reason, CUPY: found["cupy"].reason}


def skip_reason(stage: Stage, devices: Mapping[str, Optional[str]]) -> Optional[str]:
    """Why ``stage`` cannot run here (``None`` if it can): none of the devices it needs is usable."""
    if not stage.needs or any(devices[need] is None for need in stage.needs):
        return None
    return "; ".join(str(devices[need]) for need in stage.needs)


def run_stages(
    stages: Sequence[Stage], options: Options, devices: Mapping[str, Optional[str]]
) -> list[tuple[Stage, StageResult]]:
    """Run ``stages`` in order, each timed and logged to ``options.out / "<n>-<name>.log"``; one
    that raises is failed (the traceback in its log) and the next ones still run."""
    results = []
    for number, stage in enumerate(stages, 1):
        print(f"\n== {number}/{len(stages)} {stage.name}: {stage.title}", flush=True)
        reason = skip_reason(stage, devices)
        started = time.perf_counter()
        if reason is not None:
            result = StageResult("skipped", reason)
        else:
            log = Log(options.out / f"{number}-{stage.name}.log")
            try:
                result = stage.run(options, log)
            except Exception as exc:  # reported, and the next stage runs
                log.say(traceback.format_exc())
                result = StageResult("failed", f"{type(exc).__name__}: {first_line(exc)}")
            finally:
                log.close()
        result.seconds = time.perf_counter() - started
        print(f"  -> {result.status}{': ' + result.reason if result.reason else ''} ({result.seconds:.1f} s)", flush=True)
        results.append((stage, result))
    return results


def first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0][:300] if lines else ""


def summary_table(results: Sequence[tuple[Stage, StageResult]], width: int = 110) -> str:
    """The closing table: stage, status, wall time, then the reason and the key figures (wrapped)."""
    header = ("stage", "status", "wall", "reason and key figures")
    rows = []
    for number, (stage, result) in enumerate(results, 1):
        lines = [result.reason] if result.reason else []
        lines += [f"{name}: {value}" for name, value in result.figures.items()]
        rows.append((f"{number} {stage.name}", result.status, f"{result.seconds:.1f} s", lines or [""]))
    widths = [max(len(header[i]), *(len(row[i]) for row in rows)) for i in range(3)]
    indent = sum(widths) + 2 * 3
    wrap = max(30, width - indent)
    out = ["  ".join(h.ljust(w) for h, w in zip(header, widths)) + "  " + header[3],
           "  ".join("-" * w for w in widths) + "  " + "-" * len(header[3])]
    for row in rows:
        details = [piece for line in row[3] for piece in (textwrap.wrap(line, wrap, subsequent_indent="  ") or [""])]
        out.append("  ".join(c.ljust(w) for c, w in zip(row[:3], widths)) + "  " + details[0])
        out.extend(" " * indent + piece for piece in details[1:])
    counts = {s: sum(r.status == s for _, r in results) for s in ("passed", "failed", "skipped")}
    out.append("")
    out.append(f"{counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped")
    return "\n".join(line.rstrip() for line in out)


def exit_status(results: Sequence[tuple[Stage, StageResult]]) -> int:
    """1 if a stage failed, else 0 (a skipped stage is not a failure)."""
    return int(any(result.status == "failed" for _, result in results))


# ------------------------------------------------------------------ stages that run commands
def run_command(command: Sequence[str], log: Log, env: Optional[Mapping[str, str]] = None) -> tuple[int, str]:
    """Run ``command`` from the repository root (``env``: variables added to this process's), its output
    streamed to the console and the log; returns the exit status and the whole output."""
    log.say("$ " + shlex.join(command))
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    lines = []
    with subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          env=env) as process:
        assert process.stdout is not None
        for line in process.stdout:
            lines.append(line)
            log.say(line.rstrip("\n"), indent="    ")
    return process.returncode, "".join(lines)


def pytest_counts(output: str) -> dict[str, int]:
    """The counts of pytest's closing line ("3 passed, 2 skipped, 10 deselected in 1.2s")."""
    closing = [line for line in output.splitlines() if re.search(r"\d+ (passed|failed|skipped|deselected|errors?)\b", line)]
    if not closing:
        return {}
    counts = {}
    for number, word in re.findall(r"(\d+) (passed|failed|skipped|deselected|errors?|xfailed|xpassed)\b", closing[-1]):
        counts["error" if word.startswith("error") else word] = int(number)
    return counts


def stage_tests(options: Options, log: Log) -> StageResult:
    command = [sys.executable, "-m", "pytest", "tests", "-q", "-rs", "-p", "no:cacheprovider", "-k", GPU_TEST_SELECTION]
    if importlib.util.find_spec("xdist") is not None:
        command += ["-n", str(max(1, min(MAX_TEST_WORKERS, os.cpu_count() or 1)))]
    # JAX takes 75 % of a GPU's memory when it starts, in each worker: not with several workers on one GPU
    # (a value the user set is kept).
    preallocate = os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    status, output = run_command(command, log, env={"XLA_PYTHON_CLIENT_PREALLOCATE": preallocate})
    counts = pytest_counts(output)
    figures = {"tests": ", ".join(f"{counts.get(k, 0)} {k}" for k in ("passed", "skipped", "failed", "error"))}
    if status == 0:
        return StageResult("passed", figures=figures, details=counts)
    reason = "no test selected" if status == 5 else f"pytest exit status {status}"
    return StageResult("failed", reason, figures, details=counts)


def verify_rows(output: str) -> list[list[str]]:
    """The rows of ``fismo verify``'s table for GPU targets (device cuda or gpu, or CuPy), split on spaces."""
    rows = []
    for line in output.splitlines():
        cells = line.split(None, 6)
        if len(cells) == 7 and cells[2] in ("float64", "float32") and (cells[1] in ("cuda", "gpu") or cells[0] == "cupy"):
            rows.append(cells)
    return rows


def stage_verify(options: Options, log: Log) -> StageResult:
    command = [sys.executable, "-m", "fismo_core", "verify"] + (["--steps", "5"] if options.quick else [])
    status, output = run_command(command, log)
    summary = next((line.strip() for line in reversed(output.splitlines()) if re.match(r"\s*\d+ passed, \d+ failed", line)), "")
    figures = {"targets": summary or "no summary line"}
    for backend, device, dtype, _steps, error, _tolerance, verdict in verify_rows(output):
        figures[f"{backend}-{device}-{dtype}"] = f"max rel. error {error}, {verdict}"
    if status == 0:
        return StageResult("passed", figures=figures)
    return StageResult("failed", f"fismo verify exit status {status}", figures)


def performance_tables(output: str) -> dict[str, str]:
    """Per model table of ``performance.py --only models``: how many rows, and the fastest FISMO
    row against ``torch.optim.Muon`` (the column "/ torch.optim.Muon")."""
    figures: dict[str, str] = {}
    model, column, rows = None, None, []

    def close() -> None:
        if model is not None and rows:
            fismo = [r for r in rows if r[0].startswith("FISMO") and column is not None and r[column].endswith("×")]
            text = f"{len(rows)} rows"
            if fismo:
                best = min(fismo, key=lambda r: float(r[column].rstrip("×")))
                text += f"; fastest FISMO row {best[0]!r}: {best[1]} ms, {best[column]} torch.optim.Muon"
            figures[model] = text

    for line in output.splitlines():
        heading = re.match(r"\*\*(.+?)\*\*", line)
        if heading:
            close()
            model, column, rows = heading.group(1), None, []
        elif line.startswith("|") and model is not None:
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if cells[0] == "optimizer":
                column = cells.index("/ torch.optim.Muon") if "/ torch.optim.Muon" in cells else None
            elif not set(cells[0]) <= set("-"):
                rows.append(cells)
    close()
    return figures


def stage_performance(options: Options, log: Log) -> StageResult:
    script = ROOT / "docs" / "scripts" / "performance.py"
    command = [sys.executable, str(script), "--only", "models", "--device", "cuda"]
    if options.quick:
        command += ["--model", "gpt2-2layers", "--names", "eigh", "eigh-bf16", "--repeats", "2"]
    stored = ROOT / "docs" / "performance" / "model_steps.json"
    plot = ROOT / "docs" / "performance" / "model_step_time_cuda.png"
    before = {path: path.read_bytes() if path.exists() else None for path in (stored, plot)}
    try:
        status, output = run_command(command, log)
    finally:
        if options.quick:  # one- or two-repeat medians are not the page's figures
            for path, content in before.items():
                if content is None:
                    path.unlink(missing_ok=True)
                else:
                    path.write_bytes(content)
            log.say(f"--quick: {stored.relative_to(ROOT)} and {plot.relative_to(ROOT)} restored")
    figures = performance_tables(output)
    figures["parameters"] = "float32 only (performance.py has no bf16-parameter option, nor a CuPy section)"
    if status == 0:
        return StageResult("passed", figures=figures)
    return StageResult("failed", f"performance.py exit status {status}", figures)


# --------------------------------------------------------------- stage 3: the compiled step
def _benchmarks() -> Any:
    """``asv_benchmarks/benchmarks`` (the counting tool and the models of the overhead benchmarks)."""
    if str(ROOT / "asv_benchmarks") not in sys.path:
        sys.path.insert(0, str(ROOT / "asv_benchmarks"))
    import benchmarks.bench_overhead
    import benchmarks.common

    return benchmarks


#: The models of stage 3: the hidden matrices, with fixed gradients, as CPU float32 parameters.
MODELS: dict[str, Callable[[], list]] = {
    "tiny-gpt": lambda: _benchmarks().bench_overhead.small_gpt_matrices(0),
    "gpt2-small": lambda: _benchmarks().bench_overhead.matrices_with_grads(_benchmarks().bench_overhead.gpt2_shapes(scale=1)),
}
#: The FISMO configurations of stage 3: keyword arguments of ``fismo_core.backends.torch.FISMO``, and
#: three of the check's own (`RUN_KEYS`): ``"training": True`` builds ``FISMO.training`` instead;
#: ``"eager_steps": k`` steps the compiled optimizer eagerly k times before its first compiled call
#: (as after a resumed checkpoint: dynamo then finds existing states, and moves their step counts to
#: the GPU before the adapter puts them back on the CPU); ``"steps": n`` compares after n steps
#: instead of `COMPARED_STEPS` (the training configuration recomputes its roots at step 11, a replay);
#: ``"adamw_biases": True`` adds a bias per matrix, in an ``"adamw"`` group (their step counts are
#: CPU tensors, as ``torch.optim.AdamW``'s with ``capturable=False``: do CUDA graphs still hold?);
#: ``"lite": True`` compiles with inductor's lite mode (ATen kernels, bit for bit eager on a CPU) and
#: CUDA graphs instead of ``mode="reduce-overhead"``.
CONFIGS: dict[str, dict] = {
    "propagate": {"nonfinite": "propagate"},
    "propagate, Newton–Schulz roots": {"nonfinite": "propagate", "inv_root": "newton_schulz"},
    "training, propagate": {"training": True, "nonfinite": "propagate", "steps": 12},
    "propagate, compiled after 2 eager steps": {"nonfinite": "propagate", "eager_steps": 2, "steps": 7},
    "propagate, AdamW biases": {"nonfinite": "propagate", "adamw_biases": True},
    "propagate, inductor lite with CUDA graphs": {"nonfinite": "propagate", "lite": True},
}
RUN_KEYS = ("training", "eager_steps", "steps", "adamw_biases", "lite")
#: The configurations stage 3 also compiles in float64 on the tiny GPT: on a CPU the compiled step equals
#: the eager one bit for bit there (the adapter's ``EagerKernels``, docs/torch.md "The eager numbers");
#: on CUDA the difference is reported, not judged, until measured.
FLOAT64_CONFIGS = ("propagate",)
#: Stage 3's configurations with ``--quick`` (on the tiny GPT only).
QUICK_CONFIGS = ("propagate", "training, propagate")
#: The configurations stage 3 also runs on GPT-2 small's matrices (the others ask questions the size
#: does not change, and each check compiles anew: the stage must fit a short GPU loan).
LARGE_MODEL_CONFIGS = ("propagate", "propagate, Newton–Schulz roots")


def build_fismo(params: list, config: str) -> Any:
    """``FISMO`` (or ``FISMO.training``) over ``params`` with ``CONFIGS[config]``'s keyword arguments,
    and with ``"adamw_biases"`` a bias of each matrix's rows (gradient: its gradient's row means, fixed)
    in an ``"adamw"`` group."""
    import torch

    from fismo_core.backends.torch import FISMO

    options = {k: v for k, v in CONFIGS[config].items() if k not in RUN_KEYS}
    groups: Any = params
    if CONFIGS[config].get("adamw_biases"):
        biases = [torch.nn.Parameter(torch.zeros(p.shape[0], device=p.device, dtype=p.dtype)) for p in params]
        for bias, p in zip(biases, params):
            bias.grad = p.grad.mean(dim=1)
        groups = [{"params": params}, {"params": biases, "algorithm": "adamw"}]
    return (FISMO.training if CONFIGS[config].get("training") else FISMO)(groups, **options)


def placed(params: list, device: Any, dtype: Any) -> list:
    """Fresh copies of ``params`` and their gradients on ``device`` in ``dtype``."""
    import torch

    out = []
    for p in params:
        q = torch.nn.Parameter(p.detach().to(device=device, dtype=dtype, copy=True))
        q.grad = p.grad.detach().to(device=device, dtype=dtype, copy=True)
        out.append(q)
    return out


def dynamo_totals() -> dict[str, int]:
    """Dynamo's and inductor's running totals: graphs compiled, graph breaks, CUDA-graph skips."""
    from torch._dynamo.utils import counters

    return {
        "graphs": counters["stats"]["unique_graphs"],
        "graph_breaks": sum(counters["graph_break"].values()),
        "cudagraph_skips": counters["inductor"]["cudagraph_skips"],
    }


class _LogLines(logging.Handler):
    """Collects the first lines of torch's log records that mention ``word`` (inductor's
    "skipping cudagraphs due to ..."), while active."""

    def __init__(self, word: str) -> None:
        super().__init__()
        self.word, self.messages = word, []
        self._logger = logging.getLogger("torch")

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if self.word in message:
            self.messages.append(message.splitlines()[0][:200])

    def __enter__(self) -> "_LogLines":
        self._logger.addHandler(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        self._logger.removeHandler(self)


@dataclass
class CompiledStepCheck:
    """Stage 3's findings for one model, parameter dtype and FISMO configuration."""

    model: str
    dtype: str
    config: str
    graphs_first_step: Optional[int] = None
    graph_breaks: Optional[int] = None
    recompiles_after_first_step: Optional[int] = None
    cudagraph_skips: Optional[int] = None
    cudagraph_skip_reasons: list[str] = field(default_factory=list)
    host_reads_eager_step: Optional[int] = None
    aten_ops_eager_step: Optional[int] = None
    eigh_calls_eager_step: Optional[int] = None
    #: the devices of the compiled optimizer's step counts after its steps (they belong on the CPU)
    step_count_devices: list[str] = field(default_factory=list)
    #: relative Frobenius difference of W_t - W_0, compiled against eager, worst matrix, after COMPARED_STEPS
    max_rel_diff: Optional[float] = None
    #: the bar of ``max_rel_diff``; ``None``: reported, not judged (bfloat16 parameters)
    tolerance: Optional[float] = None
    medians_ms: dict[str, float] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    def summary(self) -> str:
        parts = []
        if "FISMO compiled" in self.errors:
            parts.append(f"compile failed: {self.errors['FISMO compiled']}")
        else:
            parts.append(f"{self.graphs_first_step} graphs, {self.graph_breaks} breaks, "
                         f"{self.recompiles_after_first_step} recompiles after the first compiled step, "
                         f"{self.cudagraph_skips} CUDA-graph skips")
        parts.append(f"{self.host_reads_eager_step} host reads per eager step")
        if self.max_rel_diff is not None:
            judged = "" if self.tolerance is not None else ", not judged"
            parts.append(f"compiled vs eager {self.max_rel_diff:.1e}{judged}")
        times = self.medians_ms
        if times:
            parts.append("ms: " + ", ".join(f"{name} {ms:.3g}" for name, ms in times.items()))
        if times.get("FISMO compiled") and times.get("Muon compiled"):
            parts.append(f"compiled FISMO / compiled Muon {times['FISMO compiled'] / times['Muon compiled']:.2f}x")
        return "; ".join(parts)


def check_compiled_step(
    params: list,
    *,
    model: str,
    dtype: str,
    config: str,
    device: str = "cuda",
    compile_options: Optional[dict] = None,
    repeats: int = STEP_REPEATS,
    log: Optional[Log] = None,
) -> CompiledStepCheck:
    """Compile ``FISMO(**CONFIGS[config]).step`` (``compile_options``, default
    ``mode="reduce-overhead", fullgraph=True``) over copies of ``params`` (CPU parameters with
    gradients; the gradients stay fixed) on ``device`` in ``dtype`` ("float32", "bfloat16" or "float64"),
    and check it against the eager step and time both against ``torch.optim.Muon``'s.

    A problem (a graph break, a recompile after the first compiled step, a CUDA-graph skip under
    ``reduce-overhead`` on CUDA, a host read in the eager step, a step count off the CPU, a float32
    difference above ``fismo_core.testing.TOLERANCES["float32"]``) is listed in ``problems``; a
    compile that raises is in ``errors`` (a problem for FISMO, only reported for Muon).
    """
    import torch

    from fismo_core.testing import TOLERANCES, full_float32_matmuls, max_relative_error

    bench = _benchmarks()
    options = {"mode": "reduce-overhead", "fullgraph": True} if compile_options is None else compile_options
    if compile_options is None and CONFIGS[config].get("lite"):
        # Inductor's lite mode (every op its ATen kernel: bit for bit eager on a CPU) with CUDA graphs.
        options = {"fullgraph": True, "options": {**torch._inductor.list_mode_options("lite"), "triton.cudagraphs": True}}
    graphed = options.get("mode") == "reduce-overhead" or options.get("options", {}).get("triton.cudagraphs", False)
    say = log.say if log is not None else (lambda text: None)
    torch_dtype = getattr(torch, dtype)
    result = CompiledStepCheck(model, dtype, config, tolerance=TOLERANCES["float32"] if dtype == "float32" else None)
    cuda = torch.device(device).type == "cuda"

    def synced(fn: Callable[[], Any]) -> Callable[[], None]:
        def call() -> None:
            fn()
            if cuda:
                torch.cuda.synchronize()
        return call

    torch._dynamo.reset()
    with full_float32_matmuls(), _LogLines("cudagraph") as skips:
        # torch.optim.Muon first, compiled and warm (its graphs, CUDA-graph warm-up and
        # recording), so that every graph counted from here on is FISMO's.
        fns = {}
        if hasattr(torch.optim, "Muon"):
            muon_eager = torch.optim.Muon(placed(params, device, torch_dtype))
            muon = torch.optim.Muon(placed(params, device, torch_dtype))
            fns["Muon eager"] = synced(muon_eager.step)
            try:
                muon_compiled = torch.compile(muon.step, **options)
                for _ in range(3):
                    muon_compiled()
                fns["Muon compiled"] = synced(muon_compiled)
            except Exception as exc:  # torch's own optimizer: reported, not a problem of FISMO's
                result.errors["Muon compiled"] = f"{type(exc).__name__}: {first_line(exc)}"
        else:
            result.errors["Muon"] = f"torch {torch.__version__} has no torch.optim.Muon: not timed"
        muon_skips = len(skips.messages)

        eager_params, compiled_params = placed(params, device, torch_dtype), placed(params, device, torch_dtype)
        start = [p.detach().double() for p in eager_params]  # float64: W_t - W_0 without rounding
        eager, compiled_opt = build_fismo(eager_params, config), build_fismo(compiled_params, config)
        eager_steps, steps = CONFIGS[config].get("eager_steps", 0), CONFIGS[config].get("steps", COMPARED_STEPS)
        compiled = torch.compile(compiled_opt.step, **options)
        before = dynamo_totals()
        say(f"{model}, {dtype}, FISMO({config}): {eager_steps} eager steps, then compiling and stepping "
            f"{steps - eager_steps} times")
        for step in range(1, steps + 1):
            eager.step()
            if step <= eager_steps:
                compiled_opt.step()
                before = dynamo_totals()
                continue
            if compiled is None:
                continue
            try:
                compiled()
            except Exception as exc:  # reported: the eager step and Muon are still measured
                say("".join(traceback.format_exception(exc)))  # dynamo's message names the user code it stopped at
                result.errors["FISMO compiled"] = f"{type(exc).__name__}: {first_line(exc)}"
                result.problems.append(f"torch.compile(opt.step, {options}) raised {result.errors['FISMO compiled']}")
                compiled = None
            if step == eager_steps + 1:
                after_first = dynamo_totals()
        result.step_count_devices = sorted({str(s["step"].device) for s in compiled_opt.state.values() if "step" in s})
        if compiled is not None:
            result.graphs_first_step = after_first["graphs"] - before["graphs"]
            result.max_rel_diff = max(
                max_relative_error(c.detach().double() - s, e.detach().double() - s)
                for c, e, s in zip(compiled_params, eager_params, start)
            )
        with bench.bench_overhead.OpCounter() as counter:
            eager.step()
        # On a GPU, a read of a CPU tensor (the step counts the training configuration reads eagerly to
        # decide whether roots are due) does not wait for the device: only reads of the device's count.
        device_reads = [r for r in counter.host_reads if not cuda or not r.device.startswith("cpu")]
        result.host_reads_eager_step = len(device_reads)
        result.aten_ops_eager_step = counter.total
        result.eigh_calls_eager_step = counter.syncing_linalg

        fns = {"FISMO eager": synced(eager.step), **({"FISMO compiled": synced(compiled)} if compiled else {}), **fns}
        say(f"  timing {', '.join(fns)}: {repeats} interleaved calls each")
        medians = bench.common.interleaved_medians(fns, repeats)
        result.medians_ms = {name: seconds * 1e3 for name, seconds in medians.items()}
        if compiled is not None:
            after = dynamo_totals()
            result.graph_breaks = after["graph_breaks"] - before["graph_breaks"]
            result.recompiles_after_first_step = after["graphs"] - after_first["graphs"]
            result.cudagraph_skips = after["cudagraph_skips"] - before["cudagraph_skips"]
        result.cudagraph_skip_reasons = sorted(set(skips.messages[muon_skips:]))
        if muon_skips:
            say(f"  torch.optim.Muon's compiled step: {'; '.join(sorted(set(skips.messages[:muon_skips])))}")

    if result.graph_breaks:
        result.problems.append(f"{result.graph_breaks} graph breaks")
    if result.recompiles_after_first_step:
        result.problems.append(f"{result.recompiles_after_first_step} graphs compiled after the first step")
    if cuda and graphed and result.cudagraph_skips:
        reasons = "; ".join(result.cudagraph_skip_reasons) or "no reason logged"
        result.problems.append(f"CUDA graphs skipped {result.cudagraph_skips} times ({reasons})")
    if result.step_count_devices != ["cpu"]:
        result.problems.append(f"step counts on {', '.join(result.step_count_devices) or 'no device'}, not the CPU")
    if result.host_reads_eager_step:
        sites = sorted({read.site for read in device_reads})
        result.problems.append(f"{result.host_reads_eager_step} host reads in an eager step ({', '.join(sites)})")
    if result.max_rel_diff is not None and result.tolerance is not None and not result.max_rel_diff <= result.tolerance:
        result.problems.append(f"compiled differs from eager by {result.max_rel_diff:.2e} > {result.tolerance:.0e}")
    say(f"  {result.summary()}")
    for problem in result.problems:
        say(f"  PROBLEM: {problem}")
    return result


def compile_plan(quick: bool) -> list[tuple[str, str]]:
    """Stage 3's ``(model, configuration)`` pairs, each checked in float32 and bfloat16 (and in float64 on
    the tiny GPT for `FLOAT64_CONFIGS`)."""
    if quick:
        return [("tiny-gpt", config) for config in QUICK_CONFIGS]
    return [("tiny-gpt", config) for config in CONFIGS] + [
        (model, config) for model in MODELS if model != "tiny-gpt" for config in LARGE_MODEL_CONFIGS]


def stage_compile(options: Options, log: Log) -> StageResult:
    import torch

    log.say(f"torch {torch.__version__}, {torch.cuda.get_device_name(0)}")
    checks = []
    params = {}
    for model, config in compile_plan(options.quick):
        if model not in params:
            params[model] = MODELS[model]()
        for dtype in ("float32", "bfloat16") + (("float64",) if model == "tiny-gpt" and config in FLOAT64_CONFIGS else ()):
            checks.append(check_compiled_step(params[model], model=model, dtype=dtype, config=config,
                                              repeats=QUICK_STEP_REPEATS if options.quick else STEP_REPEATS, log=log))
    figures = {f"{c.model} {c.dtype} {c.config}": c.summary() for c in checks}
    failing = [c for c in checks if c.problems]
    details = [asdict(c) for c in checks]
    if failing:
        reason = "; ".join(f"{c.model} {c.dtype} {c.config}: {c.problems[0]}" for c in failing)
        return StageResult("failed", reason, figures, details)
    return StageResult("passed", figures=figures, details=details)


# ------------------------------------------------------------------------------ the command
STAGES = [
    Stage("tests", "pytest on the tests with CUDA or CuPy cases", stage_tests, (TORCH_CUDA, CUPY)),
    Stage("verify", "fismo verify (adds the torch-cuda and cupy-cuda targets by itself)", stage_verify, (TORCH_CUDA, CUPY)),
    Stage("compile", 'torch.compile(opt.step, mode="reduce-overhead", fullgraph=True) on CUDA', stage_compile, (TORCH_CUDA,)),
    Stage("performance", "docs/scripts/performance.py --only models --device cuda", stage_performance, (TORCH_CUDA,)),
]


def pick_stages(spec: Optional[str], stages: Sequence[Stage] = STAGES) -> list[Stage]:
    """The stages named in ``spec`` ("tests,compile" or "1,3"; ``None``: all), in their order."""
    if spec is None:
        return list(stages)
    by_key = {stage.name: stage for stage in stages} | {str(i): stage for i, stage in enumerate(stages, 1)}
    wanted = [key.strip() for key in spec.split(",") if key.strip()]
    unknown = [key for key in wanted if key not in by_key]
    if unknown or not wanted:
        names = ", ".join(f"{i} {s.name}" for i, s in enumerate(stages, 1))
        raise ValueError(f"--stages: unknown stage {', '.join(map(repr, unknown)) or '(none given)'}; choose from {names}")
    chosen = {by_key[key].name for key in wanted}
    return [stage for stage in stages if stage.name in chosen]


def environment(devices: Mapping[str, Optional[str]]) -> dict[str, str]:
    """What this machine is: Python, platform, torch (and its CUDA device), CuPy."""
    env = {"python": platform.python_version(), "platform": platform.platform()}
    try:
        import torch

        env["torch"] = torch.__version__
        if devices[TORCH_CUDA] is None:
            env["cuda device"] = f"{torch.cuda.get_device_name(0)} (CUDA {torch.version.cuda})"
    except ImportError:
        env["torch"] = "not installed"
    if devices[CUPY] is None:
        import cupy

        env["cupy"] = cupy.__version__
    return env


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n".join(__doc__.splitlines()[4:9]))
    parser.add_argument("--stages", help="comma-separated stage names or numbers: "
                        + ", ".join(f"{i} {s.name}" for i, s in enumerate(STAGES, 1)) + " (default: all)")
    parser.add_argument("--quick", action="store_true", help="shorter runs: fewer steps, repeats, models")
    sys.path.insert(0, str(ROOT / "docs" / "scripts"))
    from _arguments import output_dir  # a file in --out's place is a usage error before the stages, not after

    parser.add_argument("--out", type=output_dir, default=DEFAULT_OUT, help="logs and summary.json (default: %(default)s)")
    args = parser.parse_args(argv)
    try:
        stages = pick_stages(args.stages)
    except ValueError as exc:
        parser.error(str(exc))  # exit status 2
    options = Options(quick=args.quick, out=args.out.resolve())
    devices = device_reasons()
    env = environment(devices)
    print("GPU checks" + (" (--quick)" if args.quick else "") + ": " + ", ".join(f"{k} {v}" for k, v in env.items()))
    for key, reason in devices.items():
        print(f"  {key}: {'found' if reason is None else reason}")
    results = run_stages(stages, options, devices)
    table = summary_table(results)
    print("\n" + table)
    options.out.mkdir(parents=True, exist_ok=True)
    (options.out / "summary.txt").write_text(table + "\n")
    (options.out / "summary.json").write_text(json.dumps({
        "environment": env, "quick": args.quick,
        "stages": [{"stage": s.name, **asdict(r)} for s, r in results],
    }, indent=1, default=str) + "\n")
    print(f"logs and summary in {options.out}")
    return exit_status(results)


if __name__ == "__main__":
    sys.exit(main())
