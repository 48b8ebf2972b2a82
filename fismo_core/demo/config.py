"""What ``fismo demo`` runs: tasks, step counts, learning-rate grids, seeds.

The learning-rate grids are three values per optimizer and task, a factor 2
to 3 apart, placed around the best value of short pilot runs (the results
page lists them and the sweep's outcome). FISMO and Muon share a grid: their
steps have the same size where ``P`` and ``Q`` are close to the identity.
The scale-invariant variant takes larger steps at the same learning rate
(its ``P^{-1/2}`` and ``Q^{-1/2}`` exceed 1 along the directions where the
preconditioners are small), so its grid is lower; so is the grid of the
training configuration FISMO-T (scale-invariant too), at 0.5x Muon-torch's,
which is Muon's (``torch.optim.Muon`` at its defaults). The text grids of
FISMO, Muon and the variant were moved by a factor 2 after a first full run
selected an edge of the grid (``docs/results.md`` gives both). When the
text run was cut from 600 to 300 steps, the first run selected an edge again
for FISMO-SI and SOAP (their largest value) and SGD (its smallest): one more
value beyond that edge was run for each, it did not win, and those grids were
shifted by one value so that the selected rate is inside.

That step is now automatic (``DemoConfig.grid_extensions``): where a
sweep's selected learning rate is the smallest or largest of its grid, the
next value beyond that edge (at the ratio of the edge to its neighbour) is
run and the selection made again, at most ``grid_extensions`` times per
grid; the report names the grids that were extended.

Controls are not swept: each runs at the selected learning rate of the
optimizer it modifies, with every seed (the Muon controls at Muon's, the
blocked FISMO controls at FISMO's, FISMO-SI's and FISMO-T's, ``FISMO-bf16``
at FISMO's, FISMO-T's ablations at FISMO-T's), so that it differs from its
base in one thing only.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

from .optimizers import ALL_OPTIMIZERS, fismo_controls
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
    block_sizes: tuple[int, ...] = ()  # FISMO-B<B> and FISMO-SI-B<B> controls
    bf16: bool = True  # the FISMO-bf16 control
    ablations: bool = False  # FISMO-T's ablations (TRAINING_ABLATIONS)
    training_blocks: tuple[int, ...] = ()  # FISMO-T-B<B> controls

    @property
    def fismo_controls(self) -> tuple[str, ...]:
        """The FISMO controls of this task (run when their base optimizer is)."""
        return fismo_controls(self.block_sizes, self.bf16, self.ablations, self.training_blocks)


@dataclass(frozen=True)
class DemoConfig:
    """The whole demo: the tasks, the optimizers compared, the number of seeds and parallel jobs."""

    plans: tuple[TaskPlan, ...]
    optimizers: tuple[str, ...]
    seeds: int
    jobs: int
    quick: bool
    preset: str = "default"
    grid_extensions: int = 2  # values run beyond an edge of a grid that the selection lands on, at most, per grid


#: Block sizes of the blocked controls. Digits' hidden matrices are 16x9, 32x144 and 64x128: B = 32 splits
#: the 144 side in 4 blocks and a remainder of 16, 128 in 4 and 64 in 2; B = 64 splits 144 and 128 only.
DIGITS_BLOCKS = (32, 64)
#: The GPT's are 192x64, 64x64, 256x64 and 64x256 per layer: B = 32 splits every side (64 in 2, 256 in 8),
#: B = 64 the long sides only (192 in 3, 256 in 4).
TEXT_BLOCKS = (32, 64)


def _every(steps: int, points: int = 20) -> int:
    """Steps between ``points`` evaluations over a run; also the warm-up length (5 % of the steps)."""
    return max(1, steps // points)


def _digits_plan(steps: int, task: DigitsTask = DigitsTask(), points: int = 20,
                 block_sizes: tuple[int, ...] = DIGITS_BLOCKS) -> TaskPlan:
    every = _every(steps, points)
    return TaskPlan(
        task=task,
        steps=steps,
        eval_every=every,
        measure_every=every,
        warmup=_every(steps),
        adamw_lr=3e-3,
        lrs={
            "FISMO": (0.01, 0.02, 0.04),
            "FISMO-SI": (0.005, 0.01, 0.02),
            "FISMO-T": (0.005, 0.01, 0.02),
            "Muon": (0.01, 0.02, 0.04),
            "Muon-torch": (0.01, 0.02, 0.04),
            "AdamW": (0.01, 0.02, 0.04),
            "SGD": (0.03, 0.06, 0.12),
            "SOAP": (3e-3, 1e-2, 3e-2),
        },
        block_sizes=block_sizes,
        training_blocks=block_sizes[:1],
    )


def _text_plan(steps: int, task: TextTask, points: int = 20, block_sizes: tuple[int, ...] = TEXT_BLOCKS) -> TaskPlan:
    every = _every(steps, points)
    return TaskPlan(
        task=task,
        steps=steps,
        eval_every=every,
        measure_every=every,
        warmup=_every(steps),
        adamw_lr=3e-3,
        lrs={
            "FISMO": (0.02, 0.04, 0.08),
            "FISMO-SI": (0.01, 0.02, 0.04),
            "FISMO-T": (0.01, 0.02, 0.04),
            "Muon": (0.02, 0.04, 0.08),
            "Muon-torch": (0.02, 0.04, 0.08),
            "AdamW": (1e-3, 3e-3, 1e-2),
            "SGD": (0.03, 0.1, 0.3),
            "SOAP": (1e-2, 3e-2, 1e-1),
        },
        block_sizes=block_sizes,
        ablations=True,
        training_blocks=block_sizes[:1],
    )


def _middle(plan: TaskPlan) -> TaskPlan:
    """The plan with each grid cut to its two upper values (the tiny preset's sweep)."""
    return replace(plan, lrs={name: grid[1:] for name, grid in plan.lrs.items()})


#: The presets: the main job, ``--quick`` (a smoke test of the whole pipeline) and ``tiny`` (the tests').
PRESETS = ("default", "quick", "tiny")


def default_config(
    quick: bool = False,
    *,
    preset: Optional[str] = None,
    tasks: tuple[str, ...] = ("digits", "text"),
    optimizers: Optional[tuple[str, ...]] = None,
    seeds: Optional[int] = None,
    steps: Optional[int] = None,
    jobs: int = 2,
) -> DemoConfig:
    """The default demo, or the ``--quick`` one (``quick=True`` is ``preset="quick"``), with optional overrides.

    - ``"default"``: 3 seeds; digits 400 steps, text 300 steps on 2 MB of
      text; blocked controls with ``B`` = 32 and 64 on both tasks (FISMO-T's
      with ``B = 32`` only), FISMO-T's ablations on the text task. (Text had
      600 steps before the controls were added; 300 kept the main job's CPU
      time about where it was then.)
    - ``"quick"``: 2 seeds; digits 100 steps, text 40 steps on 0.5 MB, a
      smaller evaluation set, 10 measurements per run, the blocked controls
      with ``B = 32`` only.
    - ``"tiny"``: the tests' preset, every code path in seconds: 2 seeds,
      two learning rates per optimizer, digits 40 and text 16 steps of a
      narrower, shorter-context GPT on 200 KB, 4 measurements per run,
      ``B = 32`` (digits) and 16 (text).

    Every preset extends a grid whose selected value is at an edge by up to
    2 values (``DemoConfig.grid_extensions``; in ``tiny``, whose grids have
    two values, most grids are extended).
    """
    chosen_preset = preset if preset is not None else ("quick" if quick else "default")
    if chosen_preset not in PRESETS:
        raise ValueError(f"unknown preset {chosen_preset!r}; use one of {', '.join(PRESETS)}")
    if quick and chosen_preset != "quick":
        raise ValueError(f"quick=True contradicts preset={preset!r}")
    if chosen_preset == "quick":
        text = TextTask(max_train_bytes=500_000, max_val_bytes=100_000, val_windows=64)
        plans = {"digits": _digits_plan(100, points=10, block_sizes=(32,)),
                 "text": _text_plan(40, text, points=10, block_sizes=(32,))}
        n_seeds = 2
    elif chosen_preset == "tiny":
        text = TextTask(batch_size=16, context=32, dim=32, heads=2, max_train_bytes=200_000,
                        max_val_bytes=20_000, val_windows=32)
        plans = {"digits": _middle(_digits_plan(40, points=4, block_sizes=(32,))),
                 "text": _middle(_text_plan(16, text, points=4, block_sizes=(16,)))}
        n_seeds = 2
    else:
        plans = {"digits": _digits_plan(400), "text": _text_plan(300, TextTask())}
        n_seeds = 3
    for kind, names in (("task", tasks), ("optimizer", optimizers or ())):
        repeated = sorted({name for name in names if list(names).count(name) > 1})
        if repeated:  # each would run (and be reported) twice
            raise ValueError(f"{kind} {repeated[0]!r} is given more than once")
    chosen = []
    for name in tasks:
        if name not in plans:
            raise ValueError(f"unknown task {name!r}; use 'digits' or 'text'")
        plan = plans[name]
        if steps is not None:
            every = _every(steps, max(1, plan.steps // plan.eval_every))
            plan = replace(plan, steps=steps, eval_every=every, measure_every=every, warmup=_every(steps))
        chosen.append(plan)
    selected = ALL_OPTIMIZERS if optimizers is None else optimizers
    for name in selected:
        if name not in ALL_OPTIMIZERS:
            raise ValueError(f"unknown optimizer {name!r}; choose from {', '.join(ALL_OPTIMIZERS)}")
    return DemoConfig(tuple(chosen), tuple(selected), n_seeds if seeds is None else seeds, jobs,
                      chosen_preset == "quick", chosen_preset)
