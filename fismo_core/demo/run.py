"""The fair fight: a learning-rate sweep per optimizer, then the best of each over several seeds.

1. **Sweep** (seed 0): every optimizer at every learning rate of its grid.
2. **Selection**: per task and optimizer, the learning rate with the lowest
   final held-out loss (a diverged run counts as infinite loss). Where that
   is the smallest or the largest value of the grid, the grid is extended
   by the next value beyond that edge (`beyond_edge`), run with seed 0, and
   the selection made again, up to ``config.grid_extensions`` times per
   grid, so that the winner lies inside its grid.
3. **Seeds**: the selected learning rate again with seeds ``1 .. seeds-1``
   (seed 0 is the sweep's run), plus the controls at the selected learning
   rate of the optimizer they modify, with every seed: the two Muon controls
   (7 Newton–Schulz steps; Newton–Schulz in float32) at Muon's, the blocked
   FISMO controls at their base's (FISMO, FISMO-SI, FISMO-T), ``FISMO-bf16``
   at FISMO's, FISMO-T's ablations at FISMO-T's.

Runs are independent, so they go to ``jobs`` worker processes, each with one
torch thread: the numbers do not depend on ``jobs``. With a journal file,
every finished run is appended to it as one JSON line, and a later call with
the same journal reuses the runs it holds (same spec, same library and torch
versions) instead of training them again.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import math
import multiprocessing
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch

from .._workers import quiet_worker_init
from .config import DemoConfig, TaskPlan
from .optimizers import MUON_CONTROLS, control_base, soap_available
from .train import History, RunResult, RunSpec, train

__all__ = ["DemoResults", "beyond_edge", "cpu_seconds", "run_demo", "run_many", "worker_pool"]


@dataclass
class DemoResults:
    """Every run of the demo, the selected learning rates, and the wall time."""

    config: DemoConfig
    runs: list[RunResult]
    best_lr: dict[tuple[str, str], float]  # (task, optimizer) -> lr
    skipped: dict[str, str]  # optimizer -> reason
    seconds: float
    cpu_seconds: float = math.nan  # CPU time (user + system) of this process and its workers during the demo
    reused: int = 0  # runs taken from the journal instead of trained
    controls: dict[str, list[str]] = field(default_factory=dict)  # task -> the controls run
    grids: dict[tuple[str, str], tuple[float, ...]] = field(default_factory=dict)  # (task, optimizer) -> lrs run
    extended: dict[tuple[str, str], tuple[float, ...]] = field(default_factory=dict)  # -> the lrs added, in order

    def grid(self, task: str, optimizer: str) -> tuple[float, ...]:
        """The learning rates swept for ``optimizer`` on ``task``, ascending: its plan's grid and any extension."""
        if (task, optimizer) in self.grids:
            return self.grids[(task, optimizer)]
        plan = next(p for p in self.config.plans if p.task.name == task)
        return tuple(sorted(plan.lrs[optimizer]))


def cpu_seconds() -> float:
    """User + system CPU time of this process and of its finished child processes (NaN where unknown)."""
    try:
        import resource
    except ImportError:  # Windows
        return math.nan
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def _spec(plan: TaskPlan, optimizer: str, lr: float, seed: int) -> RunSpec:
    return RunSpec(
        task=plan.task,
        optimizer=optimizer,
        lr=lr,
        seed=seed,
        steps=plan.steps,
        adamw_lr=plan.adamw_lr,
        eval_every=plan.eval_every,
        measure_every=plan.measure_every,
        warmup=plan.warmup,
    )


def _worker_init() -> None:
    torch.set_num_threads(1)


def _train_one_thread(spec: RunSpec) -> RunResult:
    _worker_init()
    return train(spec)


def _cost(spec: RunSpec) -> float:
    """Rough relative cost, to start the longest runs first."""
    per_step = 4.0 if spec.task.name == "text" else 1.0
    return per_step * spec.steps * (1.7 if spec.optimizer.startswith("FISMO") else 1.0)


def _key(spec: RunSpec) -> str:
    """What identifies a run in the journal: its whole spec and the report's `digest_key` (the code's
    versions, the CPU and torch's kernels), so a journal carried to another CPU or another torch is not
    reused there."""
    from .report import digest_key  # report imports this module

    return f"{spec!r} {digest_key()}"


def _load_journal(path: Optional[Path]) -> dict[str, RunResult]:
    if path is None or not path.is_file():
        return {}
    done = {}
    for line in path.read_text().splitlines():
        try:
            entry = json.loads(line)
            result = dict(entry["result"])
            result["history"] = History(**result["history"])
            done[entry["key"]] = RunResult(**result)
        except (ValueError, KeyError, TypeError):  # a line cut by an interrupted run, or another format
            continue
    return done


def run_many(
    specs: Sequence[RunSpec],
    jobs: int,
    on_done: Optional[Callable[[RunResult], None]] = None,
    journal: Optional[Path] = None,
    pool: Optional[ProcessPoolExecutor] = None,
) -> list[RunResult]:
    """Run ``specs`` (in ``jobs`` processes when ``jobs > 1``); results come back in ``specs``' order.

    With ``journal``, runs found there are reused (``on_done`` is not called
    for them) and every newly finished run is appended to it. ``pool``: the
    worker processes to use when ``jobs > 1`` (from [`worker_pool`][fismo_core.demo.run.worker_pool];
    by default a new one for this call).
    """
    done = _load_journal(journal)
    results: list[Optional[RunResult]] = [done.get(_key(spec)) for spec in specs]
    order = sorted((i for i in range(len(specs)) if results[i] is None), key=lambda i: -_cost(specs[i]))

    def finished(i: int, result: RunResult) -> None:
        results[i] = result
        if journal is not None:
            with journal.open("a") as f:
                f.write(json.dumps({"key": _key(specs[i]), "result": result.to_dict()}) + "\n")
        if on_done:
            on_done(result)

    if jobs <= 1:
        threads = torch.get_num_threads()
        try:
            for i in order:
                finished(i, _train_one_thread(specs[i]))
        finally:
            torch.set_num_threads(threads)
    elif order:
        with contextlib.nullcontext(pool) if pool is not None else worker_pool(jobs) as workers:
            futures = {workers.submit(train, specs[i]): i for i in order}
            for future in as_completed(futures):
                finished(futures[future], future.result())
    return [r for r in results if r is not None]


def worker_pool(jobs: int) -> ProcessPoolExecutor:
    """``jobs`` fresh worker processes (spawned, so nothing leaks in from this one), one torch thread each."""
    return ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("spawn"),
                               initializer=quiet_worker_init, initargs=(__name__, "_worker_init"))


class _NoBar:
    """Stands in for a tqdm bar when tqdm is not installed or progress is off."""

    def __init__(self, total: int = 0) -> None:
        self.total = total

    def refresh(self) -> None:
        pass

    def set_postfix_str(self, *args: object, **kwargs: object) -> None:
        pass

    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass


def _progress_bar(total: int, enabled: bool) -> Any:
    if enabled:
        try:
            from tqdm.auto import tqdm
        except ImportError:
            print("fismo demo: no progress bar (pip install tqdm)", file=sys.stderr)
        else:
            return tqdm(total=total, unit="run", desc="fismo demo")
    return _NoBar(total)


def _select(runs: list[RunResult]) -> dict[tuple[str, str], float]:
    best: dict[tuple[str, str], tuple[float, float]] = {}
    for r in runs:
        key = (r.task, r.optimizer)
        loss = r.final_val_loss if math.isfinite(r.final_val_loss) else math.inf
        if key not in best or loss < best[key][0]:
            best[key] = (loss, r.lr)
    return {key: lr for key, (_, lr) in best.items()}


def beyond_edge(grid: Sequence[float], selected: float) -> Optional[float]:
    """The learning rate to run next when ``selected`` is an edge of ``grid``, else None.

    Beyond the largest value ``g[-1]`` it is ``g[-1] * (g[-1] / g[-2])``,
    beyond the smallest ``g[0] * (g[0] / g[1])``: the next value at the
    ratio of the edge to its neighbour, rounded to 3 significant digits
    (``0.01 * 0.01 / 0.003`` is run as 0.0333, ``0.04 * 0.04 / 0.02`` as
    0.08). A grid of fewer than two values has no ratio, so no extension.
    """
    values = sorted(grid)
    if len(values) < 2:
        return None
    if selected == values[-1]:
        return float(f"{values[-1] * values[-1] / values[-2]:.3g}")
    if selected == values[0]:
        return float(f"{values[0] * values[0] / values[1]:.3g}")
    return None


def _blocks_supported() -> bool:
    from fismo_core.backends.torch import FISMO

    return "block_size" in inspect.signature(FISMO).parameters


def _controls(config: DemoConfig, plan: TaskPlan, optimizers: list[str], skipped: dict[str, str]) -> list[str]:
    """The controls of ``plan`` whose base optimizer is run (blocked ones only where the adapter has blocks)."""
    names = [c for c in (*MUON_CONTROLS, *plan.fismo_controls) if control_base(c) in optimizers]
    if any("-B" in c for c in names) and not _blocks_supported():
        skipped["FISMO-B, FISMO-SI-B"] = "this version of the torch adapter has no block_size option"
        names = [c for c in names if "-B" not in c]
    return names


def _repeats(
    config: DemoConfig,
    optimizers: list[str],
    controls: dict[str, list[str]],
    best_lr: dict[tuple[str, str], float],
) -> list[RunSpec]:
    """The runs after the sweep: the other seeds at each selected lr, the controls at their base's (fills ``best_lr``)."""
    repeats = []
    for plan in config.plans:
        task = plan.task.name
        for opt in optimizers:
            repeats += [_spec(plan, opt, best_lr[(task, opt)], seed) for seed in range(1, config.seeds)]
        for control in controls[task]:
            best_lr[(task, control)] = best_lr[(task, control_base(control))]
            repeats += [_spec(plan, control, best_lr[(task, control)], seed) for seed in range(config.seeds)]
    return repeats


def run_demo(config: DemoConfig, progress: bool = True, journal: Optional[Path] = None) -> DemoResults:
    """Sweep, select, repeat over seeds; returns every run. The progress bar is tqdm's, if installed.

    ``journal``: a JSON-lines file that records every finished run and from
    which matching runs are reused (see the module's docstring).
    """
    start, cpu_start = time.perf_counter(), cpu_seconds()
    skipped: dict[str, str] = {}
    optimizers = list(config.optimizers)
    if "SOAP" in optimizers and not soap_available():
        optimizers.remove("SOAP")
        skipped["SOAP"] = "pytorch-optimizer is not installed (pip install pytorch-optimizer)"

    sweep = [_spec(plan, opt, lr, 0) for plan in config.plans for opt in optimizers for lr in plan.lrs[opt]]
    grids = {(plan.task.name, opt): tuple(sorted(plan.lrs[opt])) for plan in config.plans for opt in optimizers}
    extended: dict[tuple[str, str], tuple[float, ...]] = {}
    controls = {plan.task.name: _controls(config, plan, optimizers, skipped) for plan in config.plans}
    n_seed_runs = sum(len(optimizers) * (config.seeds - 1) + len(controls[p.task.name]) * config.seeds
                      for p in config.plans)
    bar = _progress_bar(len(sweep) + n_seed_runs, progress)
    known = _load_journal(journal)

    def done(r: RunResult) -> None:
        status = "diverged" if r.diverged else f"val {r.final_val_loss:.3f}"
        bar.set_postfix_str(f"{r.task} {r.optimizer} lr={r.lr:g} seed {r.seed}: {status}", refresh=False)
        bar.update(1)

    # One pool for both phases: workers are spawned (torch imported, data loaded) once.
    with contextlib.ExitStack() as stack:
        pool = stack.enter_context(worker_pool(config.jobs)) if config.jobs > 1 else None
        runs = run_many(sweep, config.jobs, done, journal, pool)
        best_lr = _select(runs)
        plans = {plan.task.name: plan for plan in config.plans}
        for _ in range(config.grid_extensions):  # each round extends every grid whose winner is on an edge
            beyond = {key: lr for key, grid in grids.items() if (lr := beyond_edge(grid, best_lr[key])) is not None}
            if not beyond:
                break
            extra = [_spec(plans[task], opt, lr, 0) for (task, opt), lr in beyond.items()]
            for key, lr in beyond.items():
                grids[key] = tuple(sorted((*grids[key], lr)))
                extended[key] = (*extended.get(key, ()), lr)
            bar.total += len(extra)
            bar.refresh()
            sweep += extra
            runs += run_many(extra, config.jobs, done, journal, pool)
            best_lr = _select(runs)
        repeats = _repeats(config, optimizers, controls, best_lr)
        runs += run_many(repeats, config.jobs, done, journal, pool)
    bar.close()
    reused = sum(_key(spec) in known for spec in sweep + repeats)
    return DemoResults(config, runs, best_lr, skipped, time.perf_counter() - start, cpu_seconds() - cpu_start,
                       reused, controls, grids, extended)
