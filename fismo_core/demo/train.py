"""One training run of ``fismo demo``, with its measurements.

At every ``eval_every`` steps a run records the mean training loss since the
last record, the held-out loss (and accuracy); at every ``measure_every``
steps (and at step 1) it also records

- the mean condition number ``kappa = sigma_max / sigma_min`` of the update
  matrices ``Delta W / lr`` of the hidden matrices (the quantity of the
  paper's condition-number figure): the parameter change of each 2-D weight
  in that step, taken in float64, its singular values from
  ``torch.linalg.svdvals``; ``kappa`` does not depend on the division by
  ``lr``, which is kept for the definition's sake;
- the root mean square ``sigma = ||G||_F / sqrt(mn)`` of the hidden
  matrices' gradients (the scale that decides whether FISMO's EMA moves);
- for FISMO runs, read from the optimizer's ``state[p]``: ``cond(P)``,
  ``cond(Q)`` and ``||P - I||_F / sqrt(m)``, ``||Q - I||_F / sqrt(n)``
  (of the whole block-diagonal factor for the blocked controls).

Every number is averaged over the hidden matrices. A run whose loss becomes
NaN or infinite stops and is marked diverged, as does a FISMO run whose
inverse roots fail on more than ``max_failures`` consecutive steps
(``InverseRootError``: the preconditioner has become too ill-conditioned).

A run also times its training steps, wall and CPU (``time.perf_counter``,
``time.process_time``): the whole step (batch, forward, backward, optimizer
step, scheduler) and the optimizer step alone, summed over every step and
divided by their number; the measurements above and the evaluations are
left out, so the times are the optimizer's cost as a user would see it.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

import torch

from ..guards import InverseRootError
from .optimizers import BuiltOptimizer, build_optimizer
from .tasks import Task

__all__ = ["History", "RunResult", "RunSpec", "lr_factor", "train"]


@dataclass(frozen=True)
class RunSpec:
    """One run: a task, an optimizer at one learning rate, one seed."""

    task: Task
    optimizer: str
    lr: float
    seed: int
    steps: int
    adamw_lr: float
    eval_every: int
    measure_every: int
    warmup: int


@dataclass
class History:
    """Curves of one run; each list is aligned with its ``*_step`` list."""

    eval_step: list[int] = field(default_factory=list)
    train_loss: list[float] = field(default_factory=list)
    val_loss: list[float] = field(default_factory=list)
    val_acc: list[float] = field(default_factory=list)
    measure_step: list[int] = field(default_factory=list)
    kappa: list[float] = field(default_factory=list)
    grad_rms: list[float] = field(default_factory=list)
    cond_P: list[float] = field(default_factory=list)
    cond_Q: list[float] = field(default_factory=list)
    P_dev: list[float] = field(default_factory=list)
    Q_dev: list[float] = field(default_factory=list)


@dataclass
class RunResult:
    """What a run returns: its spec's fields, its curves, final numbers and wall time."""

    task: str
    optimizer: str
    lr: float
    seed: int
    steps: int
    history: History
    final_val_loss: float
    final_val_acc: float
    final_train_loss: float
    diverged: bool
    seconds: float
    cpu_seconds: float = math.nan  # CPU time of the run's process during the run (one thread)
    step_seconds: float = math.nan  # wall time of one training step (measurements and evaluations left out)
    step_cpu_seconds: float = math.nan  # its CPU time
    opt_step_seconds: float = math.nan  # wall time of the optimizer step alone, per step
    opt_step_cpu_seconds: float = math.nan  # its CPU time

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def lr_factor(step: int, steps: int, warmup: int, final: float = 0.1) -> float:
    """The schedule of every run: linear warm-up over ``warmup`` steps, then cosine from 1 to ``final``.

    ``step`` counts from 0 (the factor of the first step). The schedule ends
    at ``final`` (10 % of the peak) rather than 0, so that no step is so small
    that its update is lost to float32 rounding in the condition-number
    measurement.
    """
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup - 1)
    return final + (1 - final) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def _clock() -> tuple[float, float]:
    """Wall and CPU time now (seconds)."""
    return time.perf_counter(), time.process_time()


def _since(start: tuple[float, float]) -> tuple[float, float]:
    """Wall and CPU seconds since ``start`` (from `_clock`)."""
    wall, cpu = _clock()
    return wall - start[0], cpu - start[1]


def _condition(X: torch.Tensor) -> float:
    s = torch.linalg.svdvals(X.double())
    return (s[0] / s[-1]).item() if s[-1] > 0 else math.inf


def _diagonal_blocks(state: dict, name: str) -> list[torch.Tensor]:
    """The diagonal blocks of the factor ``name`` ("P" or "Q") of a FISMO ``state[p]``, in float64.

    A full factor is one block ``(d, d)``; a blocked one is stored as
    ``(k, B, B)`` blocks, with a ``(r, r)`` remainder under ``"<name>_rest"``
    where the side is not a multiple of ``B``.
    """
    factor = state[name]
    full = getattr(factor, "full", factor)  # a fismo_core.kronecker.Blocks, or a tensor
    rest = getattr(factor, "rest", state.get(f"{name}_rest"))
    blocks = [full.double()] if full.ndim == 2 else list(full.double().unbind(0))
    return blocks + ([rest.double()] if rest is not None else [])


def _sym_condition(blocks: list[torch.Tensor]) -> float:
    """Condition number of the block-diagonal SPD matrix with these diagonal blocks."""
    e = torch.cat([torch.linalg.eigvalsh(b) for b in blocks])
    return (e.max() / e.min()).item()


def _identity_distance(blocks: list[torch.Tensor]) -> float:
    """``||A - I||_F / sqrt(d)`` of the block-diagonal matrix ``A`` with these diagonal blocks (``d`` its size)."""
    d = sum(b.shape[-1] for b in blocks)
    squares = sum(torch.linalg.matrix_norm(b - torch.eye(b.shape[-1], dtype=b.dtype)) ** 2 for b in blocks)
    return math.sqrt(float(squares) / d)


def _record_preconditioners(built: BuiltOptimizer, history: History) -> None:
    assert built.fismo is not None
    cP, cQ, dP, dQ = [], [], [], []
    for p in built.matrices:
        state = built.fismo.state.get(p)
        if not state:
            continue
        P, Q = _diagonal_blocks(state, "P"), _diagonal_blocks(state, "Q")
        cP.append(_sym_condition(P))
        cQ.append(_sym_condition(Q))
        dP.append(_identity_distance(P))
        dQ.append(_identity_distance(Q))
    history.cond_P.append(_mean(cP))
    history.cond_Q.append(_mean(cQ))
    history.P_dev.append(_mean(dP))
    history.Q_dev.append(_mean(dQ))


def train(spec: RunSpec, progress: Optional[Any] = None) -> RunResult:
    """Train ``spec.task``'s model with ``spec.optimizer`` for ``spec.steps`` steps; return the curves.

    The seed fixes the initial weights and the order of the batches; the
    held-out data is the same for every seed. ``progress``, if given, is a
    tqdm bar advanced by one per step.
    """
    start, cpu_start = time.perf_counter(), time.process_time()
    task = spec.task
    torch.manual_seed(spec.seed)
    model = task.model()
    generator = torch.Generator().manual_seed(spec.seed)
    batches = task.batches(generator)
    built = build_optimizer(spec.optimizer, model, spec.lr, spec.adamw_lr)
    schedulers = [
        torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, spec.steps, spec.warmup)) for opt in built
    ]
    history = History()

    def evaluate(step: int, window: list[float]) -> None:
        model.eval()
        val_loss, val_acc = task.evaluate(model)
        model.train()
        history.eval_step.append(step)
        history.train_loss.append(_mean(window) if window else val_loss)
        history.val_loss.append(val_loss)
        history.val_acc.append(val_acc)

    evaluate(0, [])
    window: list[float] = []
    diverged = False
    step_time, opt_time, timed = [0.0, 0.0], [0.0, 0.0], 0  # wall, CPU; steps timed
    for step in range(1, spec.steps + 1):
        started = _clock()
        x, y = next(batches)
        loss = task.loss(model, x, y)
        if not torch.isfinite(loss):
            diverged = True
            break
        built.zero_grad()
        loss.backward()
        window.append(loss.item())
        forward_backward = _since(started)
        measure = step == 1 or step % spec.measure_every == 0
        if measure:
            before = [p.detach().double() for p in built.matrices]
            grads = [p.grad for p in built.matrices if p.grad is not None]
            history.grad_rms.append(_mean([(g.double().pow(2).mean().sqrt()).item() for g in grads]))
            lr_now = spec.lr * lr_factor(step - 1, spec.steps, spec.warmup)
        started = _clock()
        try:
            built.step()
        except InverseRootError:  # the step was not taken: the run cannot go on
            diverged = True
            break
        optimizer_step = _since(started)
        for scheduler in schedulers:
            scheduler.step()
        whole = _since(started)
        for i in (0, 1):
            step_time[i] += forward_backward[i] + whole[i]
            opt_time[i] += optimizer_step[i]
        timed += 1
        if measure:
            kappas = [_condition((p.detach().double() - w) / lr_now) for p, w in zip(built.matrices, before)]
            history.measure_step.append(step)
            history.kappa.append(_mean(kappas))
            if built.fismo is not None:
                _record_preconditioners(built, history)
        if step % spec.eval_every == 0 or step == spec.steps:
            evaluate(step, window)
            window = []
            if not math.isfinite(history.val_loss[-1]):
                diverged = True
                break
        if progress is not None:
            progress.update(1)
    final_val = history.val_loss[-1] if not diverged else math.inf
    return RunResult(
        task=task.name,
        optimizer=spec.optimizer,
        lr=spec.lr,
        seed=spec.seed,
        steps=spec.steps,
        history=history,
        final_val_loss=final_val,
        final_val_acc=history.val_acc[-1] if not diverged else float("nan"),
        final_train_loss=history.train_loss[-1] if not diverged else math.inf,
        diverged=diverged,
        seconds=time.perf_counter() - start,
        cpu_seconds=time.process_time() - cpu_start,
        step_seconds=step_time[0] / timed if timed else math.nan,
        step_cpu_seconds=step_time[1] / timed if timed else math.nan,
        opt_step_seconds=opt_time[0] / timed if timed else math.nan,
        opt_step_cpu_seconds=opt_time[1] / timed if timed else math.nan,
    )
