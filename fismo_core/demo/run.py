"""The fair fight: a learning-rate sweep per optimizer, then the best of each over several seeds.

1. **Sweep** (seed 0): every optimizer at every learning rate of its grid.
2. **Selection**: per task and optimizer, the learning rate with the lowest
   final held-out loss (a diverged run counts as infinite loss).
3. **Seeds**: the selected learning rate again with seeds ``1 .. seeds-1``
   (seed 0 is the sweep's run), plus the two Muon controls (7 Newton–Schulz
   steps; Newton–Schulz in float32) at Muon's selected learning rate, with
   every seed.

Runs are independent, so they go to ``jobs`` worker processes, each with one
torch thread: the numbers do not depend on ``jobs``.
"""

from __future__ import annotations

import math
import multiprocessing
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from typing import Any, Optional

import torch

from .config import DemoConfig, TaskPlan
from .optimizers import MUON_CONTROLS, soap_available
from .train import RunResult, RunSpec, train

__all__ = ["DemoResults", "run_demo", "run_many"]


@dataclass
class DemoResults:
    """Every run of the demo, the selected learning rates, and the wall time."""

    config: DemoConfig
    runs: list[RunResult]
    best_lr: dict[tuple[str, str], float]  # (task, optimizer) -> lr
    skipped: dict[str, str]  # optimizer -> reason
    seconds: float


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
    return per_step * spec.steps * (1.7 if spec.optimizer in ("FISMO", "FISMO-SI") else 1.0)


def run_many(
    specs: Sequence[RunSpec], jobs: int, on_done: Optional[Callable[[RunResult], None]] = None
) -> list[RunResult]:
    """Run ``specs`` (in ``jobs`` processes when ``jobs > 1``); results come back in ``specs``' order."""
    order = sorted(range(len(specs)), key=lambda i: -_cost(specs[i]))
    results: list[Optional[RunResult]] = [None] * len(specs)
    if jobs <= 1:
        threads = torch.get_num_threads()
        try:
            for i in order:
                results[i] = _train_one_thread(specs[i])
                if on_done:
                    on_done(results[i])
        finally:
            torch.set_num_threads(threads)
    else:
        context = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(max_workers=jobs, mp_context=context, initializer=_worker_init) as pool:
            futures = {pool.submit(train, specs[i]): i for i in order}
            for future in as_completed(futures):
                i = futures[future]
                results[i] = future.result()
                if on_done:
                    on_done(results[i])
    return [r for r in results if r is not None]


class _NoBar:
    """Stands in for a tqdm bar when tqdm is not installed or progress is off."""

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
    return _NoBar()


def _select(runs: list[RunResult]) -> dict[tuple[str, str], float]:
    best: dict[tuple[str, str], tuple[float, float]] = {}
    for r in runs:
        key = (r.task, r.optimizer)
        loss = r.final_val_loss if math.isfinite(r.final_val_loss) else math.inf
        if key not in best or loss < best[key][0]:
            best[key] = (loss, r.lr)
    return {key: lr for key, (_, lr) in best.items()}


def run_demo(config: DemoConfig, progress: bool = True) -> DemoResults:
    """Sweep, select, repeat over seeds; returns every run. The progress bar is tqdm's, if installed."""
    start = time.perf_counter()
    skipped: dict[str, str] = {}
    optimizers = list(config.optimizers)
    if "SOAP" in optimizers and not soap_available():
        optimizers.remove("SOAP")
        skipped["SOAP"] = "pytorch-optimizer is not installed (pip install pytorch-optimizer)"

    sweep = [_spec(plan, opt, lr, 0) for plan in config.plans for opt in optimizers for lr in plan.lrs[opt]]
    controls = MUON_CONTROLS if "Muon" in optimizers else ()
    n_seed_runs = len(config.plans) * (len(optimizers) * (config.seeds - 1) + len(controls) * config.seeds)
    bar = _progress_bar(len(sweep) + n_seed_runs, progress)

    def done(r: RunResult) -> None:
        status = "diverged" if r.diverged else f"val {r.final_val_loss:.3f}"
        bar.set_postfix_str(f"{r.task} {r.optimizer} lr={r.lr:g} seed {r.seed}: {status}", refresh=False)
        bar.update(1)

    runs = run_many(sweep, config.jobs, done)
    best_lr = _select(runs)
    repeats = []
    for plan in config.plans:
        for opt in optimizers:
            lr = best_lr[(plan.task.name, opt)]
            repeats += [_spec(plan, opt, lr, seed) for seed in range(1, config.seeds)]
        for control in controls:
            best_lr[(plan.task.name, control)] = best_lr[(plan.task.name, "Muon")]
            repeats += [_spec(plan, control, best_lr[(plan.task.name, control)], seed) for seed in range(config.seeds)]
    runs += run_many(repeats, config.jobs, done)
    bar.close()
    return DemoResults(config, runs, best_lr, skipped, time.perf_counter() - start)
