"""What ``fismo demo`` runs: tasks, step counts, learning-rate grids, seeds.

The learning-rate grids are three values per optimizer and task, a factor 2
to 3 apart, placed around the best value of short pilot runs (the results
page lists them and the sweep's outcome). FISMO and Muon share a grid: their
steps have the same size where ``P`` and ``Q`` are close to the identity.
The scale-invariant variant takes larger steps at the same learning rate
(its ``P^{-1/2}`` and ``Q^{-1/2}`` exceed 1 along the directions where the
preconditioners are small), so its grid is lower. The text grids of FISMO,
Muon and the variant were moved by a factor 2 after a first full run
selected an edge of the grid (``docs/results.md`` gives both).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

from .optimizers import ALL_OPTIMIZERS
from .tasks import DigitsTask, Task, TextTask

__all__ = ["DemoConfig", "TaskPlan", "default_config"]

@dataclass(frozen=True)
class TaskPlan:
    """How one task is trained: steps, schedule, measurement cadence and the lr grid of each optimizer."""

    task: Task
    steps: int
    eval_every: int
    measure_every: int
    warmup: int
    adamw_lr: float  # the AdamW part of FISMO and Muon (biases, norms, embeddings, head)
    lrs: dict[str, tuple[float, ...]]


@dataclass(frozen=True)
class DemoConfig:
    """The whole demo: the tasks, the optimizers compared, the number of seeds and parallel jobs."""

    plans: tuple[TaskPlan, ...]
    optimizers: tuple[str, ...]
    seeds: int
    jobs: int
    quick: bool


def _digits_plan(steps: int) -> TaskPlan:
    every = max(1, steps // 20)
    return TaskPlan(
        task=DigitsTask(),
        steps=steps,
        eval_every=every,
        measure_every=every,
        warmup=every,
        adamw_lr=3e-3,
        lrs={
            "FISMO": (0.01, 0.02, 0.04),
            "FISMO-SI": (0.005, 0.01, 0.02),
            "Muon": (0.01, 0.02, 0.04),
            "AdamW": (0.01, 0.02, 0.04),
            "SGD": (0.03, 0.06, 0.12),
            "SOAP": (3e-3, 1e-2, 3e-2),
        },
    )


def _text_plan(steps: int, task: TextTask) -> TaskPlan:
    every = max(1, steps // 20)
    return TaskPlan(
        task=task,
        steps=steps,
        eval_every=every,
        measure_every=every,
        warmup=every,
        adamw_lr=3e-3,
        lrs={
            "FISMO": (0.02, 0.04, 0.08),
            "FISMO-SI": (0.005, 0.01, 0.02),
            "Muon": (0.02, 0.04, 0.08),
            "AdamW": (1e-3, 3e-3, 1e-2),
            "SGD": (0.1, 0.3, 0.6),
            "SOAP": (3e-3, 1e-2, 3e-2),
        },
    )


def default_config(
    quick: bool = False,
    *,
    tasks: tuple[str, ...] = ("digits", "text"),
    optimizers: Optional[tuple[str, ...]] = None,
    seeds: Optional[int] = None,
    steps: Optional[int] = None,
    jobs: int = 2,
) -> DemoConfig:
    """The default demo, or the ``--quick`` one, with optional overrides.

    Default: 3 seeds; digits 400 steps, text 600 steps on 2 MB of text.
    Quick: 2 seeds; digits 100 steps, text 60 steps on 0.5 MB, a smaller
    evaluation set.
    """
    if quick:
        text = TextTask(max_train_bytes=500_000, max_val_bytes=100_000, val_windows=64)
        plans = {"digits": _digits_plan(100), "text": _text_plan(60, text)}
        n_seeds = 2
    else:
        plans = {"digits": _digits_plan(400), "text": _text_plan(600, TextTask())}
        n_seeds = 3
    chosen = []
    for name in tasks:
        if name not in plans:
            raise ValueError(f"unknown task {name!r}; use 'digits' or 'text'")
        plan = plans[name]
        if steps is not None:
            every = max(1, steps // 20)
            plan = replace(plan, steps=steps, eval_every=every, measure_every=every, warmup=every)
        chosen.append(plan)
    selected = ALL_OPTIMIZERS if optimizers is None else optimizers
    for name in selected:
        if name not in ALL_OPTIMIZERS:
            raise ValueError(f"unknown optimizer {name!r}; choose from {', '.join(ALL_OPTIMIZERS)}")
    return DemoConfig(tuple(chosen), tuple(selected), n_seeds if seeds is None else seeds, jobs, quick)
