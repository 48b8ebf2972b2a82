"""Does FISMO's gain over Muon hold as models grow? The scaling study of issue 20, point 3.

The demo's byte-level GPT (``fismo_core.demo.models.TinyGPT`` on the Python standard library's
source, ``fismo_core.demo.tasks.TextTask``) at three sizes, each trained with a token budget that
grows with its size:

- ``FISMO-T``, the training configuration (``FISMO.training``),
- ``Muon-torch``, ``torch.optim.Muon`` at torch's defaults but the learning rate,
- ``AdamW`` on every parameter,
- and at the largest size only the blocked training configuration ``FISMO-T-B<B>``.

Every optimizer is tuned per size on seed 0 over a learning-rate grid of three values a factor 2
apart. Where the lowest held-out loss lands on an edge of the grid, the next value beyond that
edge is run and the selection made again, at most twice (``--preset``'s ``max_extensions``), so
that the selected rate lies inside the values tried; the report says where it does not. Seeds 1
and 2 are then run at the selected rate (seed 0 is the sweep's run). A seed fixes the initial
weights and the order of the batches, the same for every optimizer, so the gain over Muon
(``Muon-torch - FISMO-T`` held-out loss, nats/byte; positive means FISMO-T is better) is paired
per seed. The schedule is the demo's (linear warm-up over 5 % of the steps, then cosine to 10 %).

Each run records its final held-out loss, its parameter counts, and the mean wall and CPU
(process) time per step of ``opt.step()`` and of the whole training step (batch, forward,
backward, ``opt.step()``, without the held-out evaluation), over every step but the first (which
creates the optimizer's state). Runs go to ``--jobs`` worker processes (spawned, one torch thread
each, as in ``fismo demo``), the longest first, so the largest size's runs start early; a line on
stderr reports each finished run with the elapsed time and an ETA.

    python docs/scripts/scaling_study.py                    # the full study (the estimate is printed first)
    python docs/scripts/scaling_study.py --preset reduced --out scaling-reduced   # tiny sizes: seconds (the tests')
    python docs/scripts/scaling_study.py --preset gpu --out scaling-gpu   # on a CUDA GPU: L and a GPT-2-small shape
    python docs/scripts/scaling_study.py --estimate-only    # time a few steps of every size and optimizer, then stop
    python docs/scripts/scaling_study.py --candidate FISMO-T-mu1e-3 --out DIR   # FISMO-T with settings changed
    python docs/scripts/scaling_study.py --report-only --out DIR   # the report and plot again from DIR/results.json

Outputs under ``--out`` (default ``scaling-results``): ``results.json`` (every run, the lr
selection, the tables' numbers), ``report.md`` (tables ready for the Results page) and
``scaling_gain.png`` (the gain against the parameter count; needs matplotlib, as the demo's
figures). ``results.json`` is rewritten after every run; a later call with the same ``--out``
reuses every run recorded there whose settings, library versions and CPU kernels match
(``StudyRun.key``), so an interrupted study resumes where it stopped, and keeps the recorded runs it
has not used (``unused_runs``: not reached yet, or another candidate's). A folder holding another
preset's study, runs recorded under another environment, or a ``results.json`` that is not a study's
is refused before any work (``--fresh`` replaces it). ``--report-only`` and ``--estimate-only``
refuse the options they do not use.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Optional

import torch

from fismo_core.demo.optimizers import build_optimizer, control_base, control_change, fismo_settings
from fismo_core.demo.report import _markdown_table, _minutes, _save, digest_key, environment
from fismo_core.demo.run import cpu_seconds, worker_pool
from fismo_core.demo.tasks import TextTask
from fismo_core.demo.train import lr_factor

#: The optimizers run at every size, in table order: the training configuration, the baseline, AdamW.
CANDIDATE, BASELINE = "FISMO-T", "Muon-torch"
OPTIMIZERS: tuple[str, ...] = (CANDIDATE, BASELINE, "AdamW")
#: Factor between neighbouring values of a learning-rate grid (and of its extensions).
GRID_FACTOR = 2.0
#: The step times each run records (seconds per step, as ``<name>_s``), in table order.
TIMES = ("opt_step_wall", "opt_step_cpu", "train_step_wall", "train_step_cpu")


@dataclass(frozen=True)
class Size:
    """One model size: the GPT's width, depth and heads, and its number of training steps."""

    name: str
    dim: int
    layers: int
    heads: int
    steps: int


@dataclass(frozen=True)
class Preset:
    """A whole study: the sizes (ascending), the data, the lr grids, the seeds."""

    name: str
    sizes: tuple[Size, ...]
    grids: Mapping[str, tuple[float, ...]]  # per optimizer of OPTIMIZERS; the candidates use CANDIDATE's
    block_size: int  # of the blocked training configuration, run at the largest size only
    batch_size: int
    context: int
    max_train_bytes: int
    max_val_bytes: int
    val_windows: int
    pilot_steps: int  # timed steps per size and optimizer for the estimate at the start
    adamw_lr: float = 3e-3  # the AdamW part of FISMO-T and Muon-torch (embeddings, head, norms), as the demo's text
    seeds: int = 3
    max_extensions: int = 2
    device: str = "cpu"  # where the model and the optimizers' state live ("cuda": the "gpu" preset)
    # Per size name, grids that replace ``grids``' for some optimizers (the blocked one included by name).
    size_grids: Mapping[str, Mapping[str, tuple[float, ...]]] = field(default_factory=dict)
    # The training configuration studied: FISMO-T, or FISMO-T with settings changed (a name of the demo's
    # naming rule, e.g. FISMO-T-mu1e-3: damping 1e-3), with CANDIDATE's grids; --candidate on the command line.
    candidate: str = CANDIDATE

    @property
    def blocked(self) -> str:
        """The blocked candidate's name: ``FISMO-T-B<B>``, or ``FISMO-T-B<B>-<modifier>`` for a changed one."""
        return f"{CANDIDATE}-B{self.block_size}{self.candidate[len(CANDIDATE):]}"

    def optimizers(self, size: Size) -> tuple[str, ...]:
        """The optimizers run at ``size``: the candidate and the rest of ``OPTIMIZERS``, the blocked one at the largest."""
        blocked = (self.blocked,) if size == self.sizes[-1] else ()
        return (self.candidate, *blocked, *OPTIMIZERS[1:])

    def grid(self, size: Size, optimizer: str) -> tuple[float, ...]:
        """The initial learning-rate grid of ``optimizer`` at ``size``: ``size_grids``' if it has one, else ``grids``'.

        ``size_grids`` name the candidates as FISMO-T and FISMO-T-B<B> (whatever ``candidate`` is); the blocked
        one falls back on the candidate's grids (of its size, then ``grids``').
        """
        own = self.size_grids.get(size.name, {})
        names = [optimizer]
        if optimizer == self.blocked:
            names += [self.default_blocked, CANDIDATE]
        elif optimizer == self.candidate:
            names.append(CANDIDATE)
        for name in names:
            if name in own:
                return own[name]
        return self.grids[names[-1]]

    @property
    def default_blocked(self) -> str:
        """The blocked candidate's name in ``size_grids``: ``FISMO-T-B<B>``."""
        return f"{CANDIDATE}-B{self.block_size}"

    def task(self, size: Size) -> TextTask:
        return TextTask(batch_size=self.batch_size, context=self.context, dim=size.dim, layers=size.layers,
                        heads=size.heads, max_train_bytes=self.max_train_bytes, max_val_bytes=self.max_val_bytes,
                        val_windows=self.val_windows)


#: Learning-rate grids: Muon-torch's is the demo's text grid for Muon, FISMO-T's half of it (the
#: scale-invariant statistics take larger steps at the same lr), AdamW's around the demo's centre.
GRIDS: dict[str, tuple[float, ...]] = {
    "FISMO-T": (0.01, 0.02, 0.04),
    "Muon-torch": (0.02, 0.04, 0.08),
    "AdamW": (1.5e-3, 3e-3, 6e-3),
}

PRESETS: dict[str, Preset] = {
    # About 43 K, 235 K and 1.06 M parameters (24x); tokens 0.41 M, 0.61 M and 0.82 M (batch 32 x context 64).
    # B = 64 splits every side of the largest size's matrices (128, 384 and 512). (A first version had L with
    # 6 layers and 800 steps: about 90 CPU-minutes for L alone, more than the 2-core budget allows.)
    # The grids of L's FISMO-T, FISMO-T-B64 and AdamW are centred where earlier runs of this preset selected
    # them after extending GRIDS (AdamW downwards; FISMO-T's damping 0.1 and bfloat16 products upwards, as
    # --candidate FISMO-T-mu1e-1-bf16mm before they were its defaults): fewer runs, the 90 minutes.
    "full": Preset(
        name="full",
        sizes=(Size("S", 32, 2, 2, 200), Size("M", 64, 4, 4, 300), Size("L", 128, 5, 4, 400)),
        grids=GRIDS, block_size=64, batch_size=32, context=64, max_train_bytes=2_000_000,
        max_val_bytes=200_000, val_windows=512, pilot_steps=10,
        size_grids={"L": {"FISMO-T": (0.005, 0.01, 0.02), "FISMO-T-B64": (0.01, 0.02, 0.04),
                          "AdamW": (7.5e-4, 1.5e-3, 3e-3)}},
    ),
    # Point 6 of issue 20, on a GPU (needs CUDA): the full preset's largest size again, and a GPT-2-small-shaped
    # model (12 layers, d = 768, 12 heads; about 86 M parameters) for a short fixed budget of 300 steps.
    # B = 384 splits every side of the larger model's matrices (768, 2304 and 3072).
    "gpu": Preset(
        name="gpu",
        sizes=(Size("L", 128, 5, 4, 400), Size("GPT2-small", 768, 12, 12, 300)),
        grids=GRIDS, block_size=384, batch_size=32, context=64, max_train_bytes=2_000_000,
        max_val_bytes=200_000, val_windows=512, pilot_steps=10, device="cuda",
    ),
    # Every code path in seconds: the tests' preset (B = 16 splits 32, 96 and 128).
    "reduced": Preset(
        name="reduced",
        sizes=(Size("XS", 8, 1, 2, 6), Size("S", 16, 1, 2, 8), Size("M", 32, 2, 2, 10)),
        grids=GRIDS, block_size=16, batch_size=8, context=16, max_train_bytes=100_000,
        max_val_bytes=20_000, val_windows=16, pilot_steps=2,
        size_grids={"M": {"FISMO-T": (0.005, 0.01, 0.02)}},  # as the full preset's, that the tests run the path
    ),
}


def check_preset(preset: Preset) -> None:
    """Raise ``ValueError`` naming the problem unless ``preset`` is a study this script can run."""
    if not preset.sizes:
        raise ValueError(f"preset {preset.name!r}: sizes is empty")
    for size in preset.sizes:
        if size.steps < 2 or size.dim % size.heads:
            raise ValueError(f"preset {preset.name!r}, size {size.name}: needs steps >= 2 and dim a multiple of heads")
    if preset.candidate != CANDIDATE:
        try:
            changed = control_change(preset.candidate) if control_base(preset.candidate) == CANDIDATE else None
        except ValueError:  # not a control's name
            changed = None
        if changed is None or "block_size" in changed:
            raise ValueError(f"preset {preset.name!r}: candidate {preset.candidate!r} is not {CANDIDATE} or "
                             f"{CANDIDATE}-<modifier> (settings changed by modifiers, no blocks; "
                             "fismo_core.demo.optimizers)")
    unknown = set(preset.size_grids) - {size.name for size in preset.sizes}
    if unknown:
        raise ValueError(f"preset {preset.name!r}: size_grids names sizes it does not have: {sorted(unknown)}")
    runs = {*OPTIMIZERS, preset.default_blocked}
    strays = sorted({opt for per in preset.size_grids.values() for opt in per} - runs)
    if strays:  # a misspelt name would leave its optimizer on the default grid without a word
        raise ValueError(f"preset {preset.name!r}: size_grids names optimizers it does not run: {strays} "
                         f"(grids are under {sorted(runs)})")
    grids = [(None, opt, preset.grids.get(opt)) for opt in OPTIMIZERS]
    grids += [(size.name, opt, grid) for size in preset.sizes for opt, grid in preset.size_grids.get(size.name, {}).items()]
    for size_name, optimizer, grid in grids:
        where = f"the lr grid of {optimizer}" + (f" at size {size_name}" if size_name else "")
        if grid is None or len(grid) < 3:
            raise ValueError(f"preset {preset.name!r}: {where} needs at least 3 values, got {grid}")
        if any(not math.isclose(b / a, GRID_FACTOR) for a, b in zip(grid, grid[1:])):
            raise ValueError(f"preset {preset.name!r}: {where} must be ascending, a factor {GRID_FACTOR:g} apart, "
                             f"got {grid}")
    if preset.seeds < 1 or preset.max_extensions < 0:
        raise ValueError(f"preset {preset.name!r}: needs seeds >= 1 and max_extensions >= 0")


# ----------------------------------------------------------------------------- the lr search
@dataclass
class LrSearch:
    """The learning-rate selection of one size and optimizer on seed 0.

    The initial ``grid`` first; when every value tried has a loss and the lowest is at the
    smallest or largest value tried, :meth:`extension` is the next value beyond that edge
    (``GRID_FACTOR`` away), at most ``max_extensions`` times. A diverged run counts as an
    infinite loss; ties go to the smaller learning rate.
    """

    grid: tuple[float, ...]
    max_extensions: int
    losses: dict[float, float] = field(default_factory=dict)
    tried: list[float] = field(default_factory=list)  # in the order proposed: the grid, then the extensions

    def __post_init__(self) -> None:
        self.tried = list(self.grid)

    def record(self, lr: float, loss: Optional[float]) -> None:
        if lr not in self.tried:
            raise ValueError(f"lr {lr!r} was not proposed by this search (tried: {self.tried})")
        self.losses[lr] = math.inf if loss is None or not math.isfinite(loss) else loss

    @property
    def complete(self) -> bool:
        """Whether every value tried so far has its loss."""
        return all(lr in self.losses for lr in self.tried)

    @property
    def best(self) -> float:
        return min(self.losses, key=lambda lr: (self.losses[lr], lr))

    @property
    def inside(self) -> bool:
        """Whether the selected lr lies strictly between the smallest and largest value tried."""
        return min(self.tried) < self.best < max(self.tried)

    @property
    def extensions(self) -> int:
        return len(self.tried) - len(self.grid)

    def extension(self) -> Optional[float]:
        """The next value to try, proposed once (``None`` while incomplete, or when the search is over)."""
        if not self.complete or self.inside or self.extensions >= self.max_extensions:
            return None
        lr = max(self.tried) * GRID_FACTOR if self.best == max(self.tried) else min(self.tried) / GRID_FACTOR
        self.tried.append(lr)
        return lr

    @property
    def done(self) -> bool:
        return self.complete and (self.inside or self.extensions >= self.max_extensions)

    def summary(self) -> dict[str, Any]:
        return {"grid": list(self.grid), "tried": list(self.tried),
                "losses": {repr(lr): _finite_or_none(self.losses[lr]) for lr in sorted(self.losses)},
                "best_lr": self.best, "inside": self.inside, "extensions": self.extensions}


def _finite_or_none(x: float) -> Optional[float]:
    return x if math.isfinite(x) else None


# ------------------------------------------------------------------------------ one run
@dataclass(frozen=True)
class StudyRun:
    """One training run: a size's task, an optimizer at one learning rate, one seed."""

    size: str
    task: TextTask
    optimizer: str
    lr: float
    seed: int
    steps: int
    warmup: int
    adamw_lr: float
    device: str = "cpu"

    def key(self) -> str:
        """What identifies the run in ``results.json``: every setting and what its numbers depend on besides
        them (`run_environment`).

        Until 2026-12-04 the key held the fismo and torch versions only: a folder studied on one CPU was
        resumed on another (other kernels, other rounding) by reusing its runs (a user's hunt).
        """
        settings = asdict(self)
        if settings["device"] == "cpu":  # the CPU runs' keys predate the device field
            del settings["device"]
        with torch.device(self.device):  # FISMO-T's precision is its device's (bfloat16 only where native)
            hyperparameters = fismo_settings(self.optimizer)
        if hyperparameters is not None:  # what the name means today: a changed default is another run
            settings["hyperparameters"] = hyperparameters
        return json.dumps({**settings, "environment": run_environment(self.device)}, sort_keys=True)

    def label(self) -> str:
        return f"{self.size} {self.optimizer} lr={self.lr:g} seed {self.seed}"


def run_environment(device: str) -> str:
    """What a run's numbers depend on besides its settings, as one line: `digest_key`'s (the fismo, Python
    and torch versions, torch's CPU kernels, whether bfloat16 is native), and on a GPU its name."""
    line = digest_key()
    if torch.device(device).type == "cuda":
        line += f", {torch.cuda.get_device_name(device)}"
    return line


def parameter_counts(task: TextTask) -> tuple[int, int]:
    """``(all parameters, hidden-matrix parameters)`` of ``task``'s model (the matrices FISMO and Muon step)."""
    model = task.model()
    matrices = build_optimizer("AdamW", model, 1e-3, 1e-3).matrices
    return sum(p.numel() for p in model.parameters()), sum(p.numel() for p in matrices)


def train_run(run: StudyRun) -> dict[str, Any]:
    """Train one run on one torch thread; return its final held-out loss and its step times.

    The loop is ``fismo_core.demo.train.train``'s without its measurements (which would
    add to the step time): the same seeding, batches, optimizers and schedule.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _train(run)
    finally:
        torch.set_num_threads(threads)


def _train(run: StudyRun) -> dict[str, Any]:
    start, cpu_start = time.perf_counter(), time.process_time()
    task = run.task
    torch.manual_seed(run.seed)
    model = task.model().to(run.device)  # initialised on the CPU: the same weights on every device
    batches = task.batches(torch.Generator().manual_seed(run.seed))
    cuda = torch.device(run.device).type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)  # so that the step times include the GPU's work
    built = build_optimizer(run.optimizer, model, run.lr, run.adamw_lr)
    schedulers = [torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, run.steps, run.warmup))
                  for opt in built]
    totals = {"opt_step_wall": 0.0, "opt_step_cpu": 0.0, "train_step_wall": 0.0, "train_step_cpu": 0.0}
    losses: list[float] = []
    diverged = False
    for step in range(1, run.steps + 1):
        wall0, cpu0 = time.perf_counter(), time.process_time()
        x, y = next(batches)
        loss = task.loss(model, x, y)
        if not torch.isfinite(loss):
            diverged = True
            break
        built.zero_grad()
        loss.backward()
        sync()
        wall1, cpu1 = time.perf_counter(), time.process_time()
        built.step()
        sync()
        wall2, cpu2 = time.perf_counter(), time.process_time()
        for scheduler in schedulers:
            scheduler.step()
        losses.append(loss.item())
        if step > 1:  # the first step creates the optimizers' state
            totals["opt_step_wall"] += wall2 - wall1
            totals["opt_step_cpu"] += cpu2 - cpu1
            totals["train_step_wall"] += wall2 - wall0
            totals["train_step_cpu"] += cpu2 - cpu0
    val_loss = math.nan
    if not diverged:
        model.eval()
        val_loss = task.evaluate(model)[0]
        diverged = not math.isfinite(val_loss)
    timed = max(0, len(losses) - 1)
    n_all, n_matrices = sum(p.numel() for p in model.parameters()), sum(p.numel() for p in built.matrices)
    tail = losses[-max(1, len(losses) // 10):] if losses else []
    return {
        "key": run.key(), "size": run.size, "optimizer": run.optimizer, "lr": run.lr, "seed": run.seed,
        "steps": run.steps, "parameters": n_all, "matrix_parameters": n_matrices,
        "final_val_loss": None if diverged else val_loss,
        "final_train_loss": statistics.fmean(tail) if tail and not diverged else None,  # mean of the last 10 %
        "diverged": diverged,
        "timed_steps": timed, **{f"{name}_s": total / max(1, timed) for name, total in totals.items()},
        "seconds": time.perf_counter() - start, "cpu_seconds": time.process_time() - cpu_start,
        "environment": environment(),  # the machine that trained it: the report's line (`runs_environment`)
    }


# ------------------------------------------------------------------------------ the study
def _runs_of(preset: Preset) -> list[tuple[Size, str]]:
    return [(size, opt) for size in preset.sizes for opt in preset.optimizers(size)]


def _study_run(preset: Preset, size: Size, optimizer: str, lr: float, seed: int) -> StudyRun:
    return StudyRun(size=size.name, task=preset.task(size), optimizer=optimizer, lr=lr, seed=seed,
                    steps=size.steps, warmup=max(1, size.steps // 20), adamw_lr=preset.adamw_lr,
                    device=preset.device)


class _Executor:
    """``jobs`` spawned worker processes, or (``jobs <= 1``) this process, behind one ``submit``."""

    def __init__(self, jobs: int) -> None:
        self.jobs = max(1, jobs)
        self.pool = worker_pool(self.jobs) if self.jobs > 1 else None

    def submit(self, run: StudyRun) -> Future:
        if self.pool is not None:
            return self.pool.submit(train_run, run)
        future: Future = Future()
        future.set_result(train_run(run))
        return future

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(cancel_futures=True)


def _clock(seconds: float) -> str:
    whole = max(0, round(seconds))
    return f"{whole // 3600}:{whole // 60 % 60:02d}:{whole % 60:02d}"


def pilot(preset: Preset, executor: _Executor,
          log: Callable[[str], None]) -> tuple[dict[str, dict[str, float]], dict[str, dict[str, float]]]:
    """Seconds of a whole run per size and optimizer, from ``pilot_steps`` timed steps: by wall time and by CPU time.

    The CPU-time figure is what an otherwise idle machine would take (on a machine shared with
    other work the wall times are longer, the CPU times hardly change).
    """
    specs = [replace(_study_run(preset, size, opt, preset.grid(size, opt)[1], 0), steps=preset.pilot_steps + 1)
             for size, opt in reversed(_runs_of(preset))]
    futures = [executor.submit(run) for run in specs]
    by_wall: dict[str, dict[str, float]] = {}
    by_cpu: dict[str, dict[str, float]] = {}
    for (size, opt), future in zip(reversed(_runs_of(preset)), futures):
        r = future.result()
        for estimates, kind in ((by_wall, "wall"), (by_cpu, "cpu")):
            per_step = r[f"train_step_{kind}_s"]
            total = r["seconds"] if kind == "wall" else r["cpu_seconds"]
            overhead = total - preset.pilot_steps * per_step  # building, the first step, the evaluation
            estimates.setdefault(size.name, {})[opt] = overhead + size.steps * per_step
        log(f"pilot {size.name} {opt}: {1e3 * r['train_step_wall_s']:.1f} ms per training step "
            f"({1e3 * r['opt_step_wall_s']:.1f} ms opt.step), CPU {1e3 * r['train_step_cpu_s']:.1f} ms "
            f"({1e3 * r['opt_step_cpu_s']:.1f} ms), over {preset.pilot_steps} steps")
    return by_wall, by_cpu


def estimate_wall(preset: Preset, estimates: Mapping[str, Mapping[str, float]], jobs: int) -> float:
    """Wall seconds of the study without grid extensions: total work over ``jobs``, or its longest chain."""
    work = sum((len(preset.grid(size, opt)) + preset.seeds - 1) * estimates[size.name][opt] for size, opt in _runs_of(preset))
    chain = max((2 if preset.seeds > 1 else 1) * estimates[size.name][opt] for size, opt in _runs_of(preset))
    return max(work / max(1, jobs), chain)


def _estimate_line(preset: Preset, by_wall: Mapping[str, Mapping[str, float]],
                   by_cpu: Mapping[str, Mapping[str, float]], jobs: int) -> str:
    n_runs = sum(len(preset.grid(s, o)) + preset.seeds - 1 for s, o in _runs_of(preset))
    return (f"estimated wall time of preset {preset.name!r}: {_minutes(estimate_wall(preset, by_wall, jobs))} "
            f"({_minutes(estimate_wall(preset, by_cpu, jobs))} from the pilot's CPU times, on an otherwise idle "
            f"machine) for {n_runs} runs on {max(1, jobs)} jobs without grid extensions (one extension adds one "
            "run of its size and optimizer)")


def read_study(path: Path) -> dict[str, Any]:
    """The ``results.json`` document at ``path``; a ``ValueError`` saying why where it is not a scaling study's.

    Until 2026-12-04 an unreadable or unrelated file was read as no runs, and the study replaced it.
    """
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:  # unreadable, not text, a cut file
        raise ValueError(f"cannot read it: {error}") from None
    if not (isinstance(doc, dict) and doc.get("study") == "scaling" and isinstance(doc.get("preset"), str)
            and all(isinstance(doc.get(runs, []), list) for runs in ("runs", "unused_runs"))
            and all(isinstance(r, dict) and _key_fields(r.get("key")) is not None
                    for r in (*doc.get("runs", []), *doc.get("unused_runs", [])))):
        raise ValueError("it is not a scaling study's results.json")
    return doc


def _key_fields(key: Any) -> Optional[dict[str, Any]]:
    """A run's key (`StudyRun.key`) read back, or None where it is not one."""
    try:
        fields = json.loads(key)
    except (TypeError, ValueError):
        return None
    return fields if isinstance(fields, dict) else None


def recorded_runs(doc: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """Every run recorded in a ``results.json`` document by key: the study's and those it kept unused."""
    return {r["key"]: r for r in (*doc.get("runs", []), *doc.get("unused_runs", []))}


def _runs(count: int) -> str:
    return f"{count} run{'s' * (count != 1)}"


def resume_conflict(out: Path, preset: Preset) -> Optional[str]:
    """Why resuming ``preset`` in ``out`` would replace what ``out/results.json`` holds, or None where it may.

    A file that is not a scaling study's, a study of another preset, or runs recorded where their numbers
    would differ (another `run_environment`: none of them could be reused here): until 2026-12-04 the study
    replaced them without a word (a user's hunt). Another candidate of the same preset is no conflict: its
    runs are kept (``unused_runs``) and the baselines' reused.
    """
    path = out / "results.json"
    if not path.exists():
        return None
    try:
        doc = read_study(path)
    except ValueError as error:
        return f"{path}: {error}"
    runs = list(recorded_runs(doc).values())
    if doc["preset"] != preset.name:
        return f"{out} holds a study of preset {doc['preset']!r} ({_runs(len(runs))} recorded)"
    here = run_environment(preset.device)
    elsewhere = [(_key_fields(r["key"]) or {}).get("environment") for r in runs]
    elsewhere = [where for where in elsewhere if where != here]
    if elsewhere:
        where = elsewhere[0] or "an environment their keys do not name (recorded before 2026-12-04)"
        return (f"{out} holds {_runs(len(elsewhere))} recorded with {where}, which this machine ({here}) would not "
                "reproduce")
    return None


def _write_json(path: Path, doc: Mapping[str, Any]) -> None:
    """Write atomically, so that an interrupted study never leaves a cut file behind."""
    from fismo_core._paths import staged_files

    with staged_files(path.parent) as staged:
        staged(path.name).write_text(json.dumps(doc, indent=1))


def run_study(preset: Preset, out: Path, jobs: int = 2, *, resume: bool = True, command: str = "",
              log: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True)) -> dict[str, Any]:
    """Run (or resume) the study ``preset`` into ``out/results.json``; returns the final document.

    ``results.json`` holds the study's runs (``runs``, those it has reached) and every other run recorded
    there before (``unused_runs``: not reached yet, or of another candidate), rewritten after every run, so
    that no resume loses a recorded run, interrupted or not; the summaries are of ``runs`` only. Until
    2026-12-04 the file held the runs reached only: an interrupted resume lost the others (a user's hunt).
    A file that cannot be read is a ``ValueError`` (``main`` refuses it first, `resume_conflict`).
    """
    check_preset(preset)
    start, cpu_start = time.perf_counter(), cpu_seconds()
    out.mkdir(parents=True, exist_ok=True)
    path = out / "results.json"
    cached = recorded_runs(read_study(path)) if resume and path.exists() else {}
    searches = {(size.name, opt): LrSearch(preset.grid(size, opt), preset.max_extensions) for size, opt in _runs_of(preset)}
    doc: dict[str, Any] = {
        "study": "scaling", "preset": preset.name, "command": command, "complete": False,
        "config": _config(preset), "environment": environment(), "jobs": max(1, jobs), "runs": [],
    }

    def save() -> None:
        reached = {r["key"] for r in doc["runs"]}
        doc["unused_runs"] = [r for key, r in cached.items() if key not in reached]
        _write_json(path, doc)

    executor = _Executor(jobs)
    try:
        estimates, by_cpu = pilot(preset, executor, log)
        doc["estimate_seconds"] = estimate_wall(preset, estimates, jobs)
        log(_estimate_line(preset, estimates, by_cpu, jobs)
            + (f"; {len(cached)} runs recorded in {path} are reused where they match" if cached else ""))
        _execute(preset, executor, searches, cached, estimates, doc, save, log, start)
    finally:
        executor.close()
    doc.update(summarise(preset, searches, doc["runs"]))
    doc.update({"complete": True, "seconds": time.perf_counter() - start, "cpu_seconds": cpu_seconds() - cpu_start,
                "environment": runs_environment(doc["runs"])})
    if hasattr(os, "getloadavg"):  # stored, so that --report-only writes the same report (it read the load anew)
        doc["load_at_end"] = round(os.getloadavg()[0], 1)
    save()
    return doc


def runs_environment(runs: Sequence[Mapping[str, Any]]) -> str:
    """The report's environment line: the machine that trained ``runs`` (`environment`), or each machine with
    its number of runs. Until 2026-12-04 it was the machine of the last call, whichever trained the runs."""
    machines = Counter(r.get("environment", "not recorded") for r in runs)
    if len(machines) == 1:
        return next(iter(machines))
    return "Runs trained on " + "; ".join(f"{machine} ({count} runs)" for machine, count in machines.most_common())


def _execute(preset: Preset, executor: _Executor, searches: dict[tuple[str, str], LrSearch],
             cached: Mapping[str, dict[str, Any]], estimates: Mapping[str, Mapping[str, float]],
             doc: dict[str, Any], save: Callable[[], None], log: Callable[[str], None], start: float) -> None:
    """Schedule the runs: the sweeps, their extensions, then the seeds; longest first, ``jobs`` at a time;
    ``save()`` after each."""
    sizes = {size.name: size for size in preset.sizes}
    ready = [_study_run(preset, size, opt, lr, 0) for size, opt in _runs_of(preset) for lr in preset.grid(size, opt)]
    running: dict[Future, tuple[StudyRun, float]] = {}
    seen: dict[str, int] = {}  # trained and reused runs, for the progress line
    ratio = {"actual": 0.0, "estimated": 0.0}  # measured over estimated seconds of the runs trained so far

    def estimate(run: StudyRun) -> float:
        return estimates[run.size][run.optimizer]

    def remaining() -> tuple[int, float]:
        """Runs still planned (without future extensions) and their estimated seconds of one job."""
        pending = [(run, 0.0) for run in ready] + [(run, time.perf_counter() - t) for run, t in running.values()]
        seconds = sum(max(0.0, estimate(run) - elapsed) for run, elapsed in pending)
        count = len(pending)
        for (size, opt), search in searches.items():
            if not search.done:
                count += preset.seeds - 1
                seconds += (preset.seeds - 1) * estimates[size][opt]
        return count, seconds

    def finished(run: StudyRun, result: dict[str, Any], reused: bool) -> None:
        doc["runs"].append(result)
        save()
        seen["reused" if reused else "trained"] = seen.get("reused" if reused else "trained", 0) + 1
        if not reused:
            ratio["actual"] += result["seconds"]
            ratio["estimated"] += estimate(run)
        if run.seed == 0:
            search = searches[(run.size, run.optimizer)]
            search.record(run.lr, result["final_val_loss"])
            if search.complete:
                extension = search.extension()
                if extension is not None:
                    ready.append(_study_run(preset, sizes[run.size], run.optimizer, extension, 0))
                elif search.done:
                    ready.extend(_study_run(preset, sizes[run.size], run.optimizer, search.best, seed)
                                 for seed in range(1, preset.seeds))
        count, seconds = remaining()
        scale = ratio["actual"] / ratio["estimated"] if ratio["estimated"] > 0 else 1.0
        done = sum(seen.values())
        loss = "diverged" if result["diverged"] else f"held-out {result['final_val_loss']:.4f}"
        how = "reused" if reused else f"{result['seconds']:.0f} s"
        log(f"[{done}/{done + count}] {run.label()}: {loss} ({how}); elapsed {_clock(time.perf_counter() - start)}, "
            f"ETA {_clock(scale * seconds / executor.jobs)}")

    while ready or running:
        while ready and len(running) < executor.jobs:
            ready.sort(key=estimate)
            run = ready.pop()  # the longest first
            if run.key() in cached:
                finished(run, cached[run.key()], reused=True)
                continue
            running[executor.submit(run)] = (run, time.perf_counter())
        if running:
            done, _ = wait(running, return_when=FIRST_COMPLETED)
            for future in done:
                run, _ = running.pop(future)
                finished(run, future.result(), reused=False)
    doc["trained"], doc["reused"] = seen.get("trained", 0), seen.get("reused", 0)


def _config(preset: Preset) -> dict[str, Any]:
    config = asdict(preset)
    config["grids"] = {size.name: {opt: list(preset.grid(size, opt)) for opt in preset.optimizers(size)}
                       for size in preset.sizes}
    del config["size_grids"]  # folded into "grids", per size
    config["sizes"] = []
    for size in preset.sizes:
        n_all, n_matrices = parameter_counts(preset.task(size))
        config["sizes"].append({**asdict(size), "parameters": n_all, "matrix_parameters": n_matrices,
                                "tokens": size.steps * preset.batch_size * preset.context,
                                "optimizers": list(preset.optimizers(size))})
    return config


# ------------------------------------------------------------------------------ summaries
def summarise(preset: Preset, searches: Mapping[tuple[str, str], LrSearch],
              runs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The tables' numbers: lr selection, losses per seed, gains over Muon-torch, step times against it."""
    tuning: dict[str, dict[str, Any]] = {}
    losses: dict[str, dict[str, Any]] = {}
    gain: dict[str, dict[str, Any]] = {}
    timing: dict[str, dict[str, Any]] = {}
    for size in preset.sizes:
        tuning[size.name], losses[size.name], timing[size.name] = {}, {}, {}
        for opt in preset.optimizers(size):
            search = searches[(size.name, opt)]
            tuning[size.name][opt] = search.summary()
            selected = {r["seed"]: r for r in runs if r["size"] == size.name and r["optimizer"] == opt
                        and r["lr"] == search.best}
            losses[size.name][opt] = {"lr": search.best,
                                      "seeds": {str(s): selected[s]["final_val_loss"] for s in sorted(selected)}}
            own = [r for r in runs if r["size"] == size.name and r["optimizer"] == opt and r["timed_steps"] > 0]
            timing[size.name][opt] = {name: statistics.median(r[f"{name}_s"] for r in own) if own else math.nan
                                      for name in TIMES}
        base = losses[size.name][BASELINE]["seeds"]
        gain[size.name] = {}
        for opt in (preset.candidate, preset.blocked):
            if opt in losses[size.name]:
                mine = losses[size.name][opt]["seeds"]
                gain[size.name][opt] = {seed: (base[seed] - mine[seed]
                                               if base.get(seed) is not None and mine.get(seed) is not None else None)
                                        for seed in base}
        for opt, times in timing[size.name].items():
            times.update({f"{name}_vs_muon": times[name] / timing[size.name][BASELINE][name] for name in TIMES})
    return {"tuning": tuning, "losses": losses, "gain": gain, "timing": timing}


# ------------------------------------------------------------------------------ report and plot
def _loss(x: Optional[float]) -> str:
    return "diverged" if x is None else f"{x:.4f}"


def _signed(x: Optional[float]) -> str:
    return "–" if x is None else f"{x:+.4f}"


def markdown_report(doc: Mapping[str, Any]) -> str:
    """The study's tables, ready for the Results page, from a finished ``results.json`` document."""
    config = doc["config"]
    candidate = config.get("candidate", CANDIDATE)  # studies recorded before the field were FISMO-T's
    sizes = config["sizes"]
    seeds = [str(s) for s in range(config["seeds"])]
    trained = sum(r["seconds"] for r in doc["runs"])
    # The load the study recorded when it finished (a study recorded before the field: none). Read anew here, it
    # made --report-only's report differ from the study's own under another load (CI 127, 3.7 against 3.6).
    load = f"; load average at the end {doc['load_at_end']:.1f}" if "load_at_end" in doc else ""
    parts = [
        f"# Scaling study: {candidate} against torch.optim.Muon as the GPT grows (preset {doc['preset']!r})",
        "",
        f"Command: `{doc['command']}`  ",
        f"Wall time: {_minutes(doc['seconds'])} on {doc['jobs']} jobs{load}; CPU time {doc['cpu_seconds']:.0f} s; "
        f"{len(doc['runs'])} runs ({doc.get('reused', 0)} reused from an earlier call), their own wall time adds up "
        f"to {_minutes(trained)}.  ",
        f"{doc['environment']}.",
        "",
        "## Sizes",
        "",
        _markdown_table(
            ["size", "d", "layers", "heads", "parameters", "matrix parameters", "steps", "tokens", "optimizers"],
            [[s["name"], s["dim"], s["layers"], s["heads"], f"{s['parameters']:,}", f"{s['matrix_parameters']:,}",
              s["steps"], f"{s['tokens']:,}", ", ".join(s["optimizers"])] for s in sizes], "lrrrrrrrl"),
        "",
        f"Batch {config['batch_size']} windows of {config['context']} bytes; warm-up 5 % of the steps, then cosine "
        f"to 10 %; AdamW part of {candidate} and {BASELINE} at lr {config['adamw_lr']:g}; held-out loss over "
        f"{config['val_windows']} windows at the end.",
        "",
        "## Learning-rate selection (seed 0)",
        "",
        _markdown_table(
            ["size", "optimizer", "lrs tried: held-out loss", "selected", "inside"],
            [[size, opt, ", ".join(f"{float(lr):g}: {_loss(loss)}" for lr, loss in t["losses"].items()),
              f"{t['best_lr']:g}", "yes" if t["inside"] else f"no ({t['extensions']} extensions)"]
             for size, per in doc["tuning"].items() for opt, t in per.items()], "llllr"),
        "",
        "## Held-out loss at the end of training (nats/byte)",
        "",
        _markdown_table(
            ["size", "parameters", "optimizer", "lr", *(f"seed {s}" for s in seeds), "mean"],
            [[size["name"], f"{size['parameters']:,}", opt, f"{entry['lr']:g}",
              *(_loss(entry["seeds"].get(s)) for s in seeds), _loss(_mean(entry["seeds"].values()))]
             for size in sizes for opt, entry in doc["losses"][size["name"]].items()], "llll" + "r" * (len(seeds) + 1)),
        "",
        f"## Gain over {BASELINE} ({BASELINE} − {candidate} held-out loss, nats/byte; positive: {candidate} better)",
        "",
        _markdown_table(
            ["size", "parameters", "optimizer", *(f"seed {s}" for s in seeds), "mean", "better on"],
            [[size["name"], f"{size['parameters']:,}", opt, *(_signed(g.get(s)) for s in seeds),
              _signed(_mean(g.values())), f"{sum(1 for x in g.values() if x is not None and x > 0)}/{len(g)} seeds"]
             for size in sizes for opt, g in doc["gain"][size["name"]].items()], "lrl" + "r" * (len(seeds) + 2)),
        "",
        f"## Time per step against {BASELINE}",
        "",
        "Mean over each run's steps but its first, median over the runs of the size and optimizer (sweep and "
        f"seeds, run {doc['jobs']} at a time, one torch thread each). CPU is the run's process time.",
        "",
        _markdown_table(
            ["size", "optimizer", "opt.step wall ms", "× Muon", "opt.step CPU ms", "× Muon",
             "training step wall ms", "× Muon", "training step CPU ms", "× Muon"],
            [[size, opt, *_time_cells(t)] for size, per in doc["timing"].items() for opt, t in per.items()],
            "ll" + "r" * 8),
    ]
    return "\n".join(parts) + "\n"


def _time_cells(times: Mapping[str, float]) -> list[str]:
    """Milliseconds and the ratio to Muon-torch of each of ``TIMES``."""
    return [cell for name in TIMES for cell in (f"{1e3 * times[name]:.1f}", f"{times[f'{name}_vs_muon']:.2f}")]


def _mean(values: Any) -> Optional[float]:
    """The mean, or None when a value is missing (a diverged run)."""
    values = list(values)
    return statistics.fmean(values) if values and None not in values else None


def plot_gain(doc: Mapping[str, Any], path: Path) -> bool:
    """Plot the gain over Muon-torch against the parameter count (per seed, and the mean) to ``path``.

    Returns False, writing nothing, where matplotlib is not installed (as the demo's figures).
    """
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    parameters = {s["name"]: s["parameters"] for s in doc["config"]["sizes"]}
    fig, ax = plt.subplots(figsize=(5.6, 3.8), constrained_layout=True)
    ax.axhline(0.0, color="0.5", linewidth=0.8)
    candidate = doc["config"].get("candidate", CANDIDATE)
    styles = {candidate: ("C0", "o")}
    for opt in sorted({opt for per in doc["gain"].values() for opt in per}, key=lambda o: o != candidate):
        color, marker = styles.get(opt, ("C1", "s"))
        xs, means = [], []
        for size, per in doc["gain"].items():
            gains = [g for g in per.get(opt, {}).values() if g is not None]
            if not gains:
                continue
            ax.scatter([parameters[size]] * len(gains), gains, color=color, marker=marker, alpha=0.35, s=18)
            xs.append(parameters[size])
            means.append(statistics.fmean(gains))
        ax.plot(xs, means, color=color, marker=marker, markersize=8, label=f"{opt} (mean; small: seeds)")
    for size in doc["gain"]:
        ax.annotate(size, (parameters[size], 0.0), textcoords="offset points", xytext=(0, 4), ha="center",
                    fontsize=8, color="0.4")
    ax.set_xscale("log")
    ax.set_xlabel("parameters")
    ax.set_ylabel(f"{BASELINE} − optimizer held-out loss (nats/byte)")
    ax.set_title("Gain over torch.optim.Muon as the GPT grows")
    ax.legend(fontsize=8)
    _save(fig, path)
    return True


#: The files the study writes in ``--out``.
OUTPUTS = ("results.json", "report.md", "scaling_gain.png")


def cannot_write(out: Path) -> Optional[str]:
    """Why the study's files cannot be written in ``out``, or None: checked before any run (until 2026-12-04
    such a folder failed after the pilot, with a traceback; a user's hunt). ``out`` need not exist; a file on
    its way is ``output_dir``'s error."""
    from fismo_core._paths import NotARegularFileError, cannot_write_in, writable_target

    folder = next(p for p in (out, *out.parents) if p.exists())  # the folder made first, out or one above it
    reason = cannot_write_in(folder)
    if reason is not None:
        return f"cannot write in {folder}: {reason}"
    for name in OUTPUTS:
        try:
            writable_target(out / name)
        except NotARegularFileError as error:
            return str(error)
    return None


def write_outputs(doc: Mapping[str, Any], out: Path) -> tuple[str, list[str]]:
    """``report.md`` and ``scaling_gain.png`` from a finished document; returns the report and the files written.

    Both or neither (`staged_files`); the report in UTF-8, not the locale's encoding: it has − and ×, which
    until 2026-12-04 raised ``UnicodeEncodeError`` under an ASCII locale and left ``report.md`` empty.
    """
    from fismo_core._paths import staged_files

    report = markdown_report(doc)
    written = ["report.md"]
    with staged_files(out) as staged:
        if plot_gain(doc, staged("scaling_gain.png")):
            written.append("scaling_gain.png")
        else:
            report += "\n**Figure skipped**: matplotlib is not installed (pip install matplotlib).\n"
        staged("report.md").write_text(report, encoding="utf-8")
    return report, written


#: Per mode, the options it does not use (argparse destinations), and why: until 2026-12-04 they were ignored
#: without a word, and --report-only wrote the report of the file's preset whatever --preset said (a user's hunt).
UNUSED_BY = {
    "report_only": (("preset", "candidate", "jobs", "pilot_steps", "fresh", "estimate_only"),
                    "which reads the study's settings from DIR/results.json"),
    "estimate_only": (("out", "fresh"), "which writes nothing"),
}
DEFAULT_PRESET, DEFAULT_OUT = "full", Path("scaling-results")


def main(argv: Optional[Sequence[str]] = None) -> int:
    from _arguments import options_given, output_dir, positive_int  # docs/scripts/, on sys.path when the script runs

    from fismo_core.demo import _print_in_any_encoding

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), help=f"default: {DEFAULT_PRESET}")
    parser.add_argument("--out", type=output_dir, default=DEFAULT_OUT, help="output folder (default: %(default)s)")
    parser.add_argument("--jobs", type=positive_int, default=2, help="parallel worker processes (default: %(default)s)")
    parser.add_argument("--fresh", action="store_true",
                        help="train every run again, replacing DIR/results.json (whatever it holds)")
    parser.add_argument("--estimate-only", action="store_true",
                        help="time pilot steps (one run at a time), print the estimate for --jobs, stop")
    parser.add_argument("--pilot-steps", type=positive_int, help="timed steps per size and optimizer for the estimate")
    parser.add_argument("--candidate", default=CANDIDATE,
                        help=f"the training configuration studied: {CANDIDATE} (default) or {CANDIDATE}-<modifier>, "
                             "settings changed by modifiers, e.g. FISMO-T-mu1e-3 (damping 1e-3), FISMO-T-mu1e-3-fp32mm; "
                             "fismo_core.demo.optimizers")
    parser.add_argument("--report-only", action="store_true",
                        help="write report.md and the plot from DIR/results.json (its preset and candidate)")
    args = parser.parse_args(argv)
    for mode, (dests, why) in UNUSED_BY.items():
        given = options_given(parser, args, dests)
        if getattr(args, mode) and given:
            parser.error(f"{', '.join(given)}: not used by --{mode.replace('_', '-')}, {why}")
    preset = PRESETS[args.preset or DEFAULT_PRESET]
    if preset.device.startswith("cuda") and not args.report_only and not torch.cuda.is_available():
        parser.error(f"preset {preset.name!r} runs on {preset.device!r}, but torch sees no CUDA device")
    if args.pilot_steps is not None:
        preset = replace(preset, pilot_steps=args.pilot_steps)
    preset = replace(preset, candidate=args.candidate)
    try:
        check_preset(preset)
    except ValueError as error:
        parser.error(str(error))
    if not args.estimate_only and (problem := cannot_write(args.out)) is not None:
        parser.error(f"argument --out: {problem}")
    log: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    if args.report_only:
        path = args.out / "results.json"
        try:
            doc = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            parser.error(f"--report-only: {path} does not exist; run the study into {args.out} first")
        except (OSError, ValueError) as error:  # a cut file, not text, unreadable
            parser.error(f"--report-only: cannot read {path}: {error}")
        if not isinstance(doc, dict) or not doc.get("complete"):
            parser.error(f"{args.out / 'results.json'} is not a finished study; run it (it resumes) first")
        try:  # the report reads every field the outputs need: a file without them is refused before writing
            markdown_report(doc)
        except (KeyError, TypeError, ValueError, AttributeError) as error:
            parser.error(f"--report-only: {path} says it is complete but lacks the study's fields "
                         f"({type(error).__name__}: {error}); run the study again with --fresh")
        report, written = write_outputs(doc, args.out)
        _print_in_any_encoding(report)
        _print_in_any_encoding(f"Wrote {', '.join(str(args.out / name) for name in written)} from {path}.")
        return 0
    if args.estimate_only:  # the pilot one run at a time, so that its runs do not share the cores
        executor = _Executor(1)
        try:
            by_wall, by_cpu = pilot(preset, executor, log)
        finally:
            executor.close()
        print(_estimate_line(preset, by_wall, by_cpu, args.jobs))
        return 0
    if not args.fresh and (conflict := resume_conflict(args.out, preset)) is not None:
        parser.error(f"{conflict}; choose another --out, or pass --fresh to replace it")
    command = shlex.join(["python", "docs/scripts/scaling_study.py", *(argv if argv is not None else sys.argv[1:])])
    doc = run_study(preset, args.out, args.jobs, resume=not args.fresh, command=command, log=log)
    report, written = write_outputs(doc, args.out)
    _print_in_any_encoding(report)
    _print_in_any_encoding(f"Wrote {', '.join(str(args.out / name) for name in ['results.json', *written])} "
                           f"in {_minutes(doc['seconds'])}.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
