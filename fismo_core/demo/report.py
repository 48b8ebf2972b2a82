"""Tables (markdown, CSV, JSON) and figures (PNG, matplotlib's Agg backend) of a demo's runs."""

from __future__ import annotations

import csv
import errno
import hashlib
import json
import math
import os
import platform
import statistics
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Optional

import torch

from .._paths import StagedFiles, staged_files, writable_target
from .optimizers import CONDITION_OPTIMIZERS, control_base, control_change
from .run import DemoResults
from .train import RunResult

__all__ = [
    "Summary",
    "ablation_table",
    "digest",
    "digest_key",
    "environment",
    "extension_note",
    "summarise",
    "timing_table",
    "training_table",
    "write_report",
]

_COLOURS = {
    "FISMO": "tab:red",
    "FISMO-SI": "tab:purple",
    "Muon": "tab:blue",
    "Muon-NS7": "tab:cyan",
    "Muon-fp32": "tab:brown",
    "AdamW": "tab:orange",
    "SGD": "tab:gray",
    "SOAP": "tab:green",
    "FISMO-bf16": "tab:pink",
    "FISMO-T": "tab:olive",
    "Muon-torch": "midnightblue",
}
#: The per-step times a run records (`RunResult`'s fields), in seconds.
_STEP_TIMES = ("step_seconds", "step_cpu_seconds", "opt_step_seconds", "opt_step_cpu_seconds")
#: The training configuration and the optimizer it is compared with, at its defaults.
TRAINING, MUON_TORCH = "FISMO-T", "Muon-torch"
#: Line styles of the blocked controls in the blocking figure, by block size rank (smallest first).
_BLOCK_STYLES = ("--", ":", "-.")


class Summary(dict):
    """One table row: a task's optimizer at its selected learning rate, over seeds."""


def _fmt(x: float, digits: int = 3) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    if math.isinf(x):
        return "diverged"
    return f"{x:.{digits}f}" if abs(x) >= 10 ** (-digits + 1) or x == 0 else f"{x:.2e}"


def _sci(x: float) -> str:
    if x is None or math.isnan(x):
        return "–"
    if math.isinf(x):
        return "inf"
    return f"{x:.3g}"


def _mean_std(values: Sequence[float]) -> tuple[float, float]:
    if not values:
        return math.nan, math.nan
    if any(math.isinf(v) for v in values):
        return math.inf, math.nan
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def _pm(values: Sequence[float], digits: int = 3) -> str:
    mean, std = _mean_std(values)
    if math.isnan(mean):
        return "–"
    if math.isinf(mean):
        return f"diverged ({sum(math.isinf(v) for v in values)}/{len(values)})"
    return f"{mean:.{digits}f} ± {std:.{digits}f}"


def _selected(results: DemoResults, task: str, optimizer: str) -> list[RunResult]:
    lr = results.best_lr.get((task, optimizer))
    return sorted(
        (r for r in results.runs if r.task == task and r.optimizer == optimizer and r.lr == lr), key=lambda r: r.seed
    )


def _tasks(results: DemoResults) -> list[tuple[str, str]]:
    return [(plan.task.name, plan.task.title) for plan in results.config.plans]


def _optimizers(results: DemoResults) -> list[str]:
    return [o for o in results.config.optimizers if o not in results.skipped]


def _controls(results: DemoResults, task: Optional[str] = None) -> list[str]:
    """The controls that were run (on ``task``, or on any task), in the order of the config."""
    names: list[str] = []
    for t, controls in results.controls.items():
        if task is None or t == task:
            names += [c for c in controls if c not in names and any(r.optimizer == c for r in results.runs)]
    return names


def _grid_text(results: DemoResults, task: str, optimizer: str) -> str:
    """The swept learning rates, ascending; values added by a grid extension marked ``+``."""
    added = results.extended.get((task, optimizer), ())
    return " ".join(f"+{lr:g}" if lr in added else f"{lr:g}" for lr in results.grid(task, optimizer))


def summarise(results: DemoResults) -> list[Summary]:
    """One row per task and optimizer or control (selected lr, all seeds): final losses, accuracy, mean ± std."""
    rows = []
    for plan in results.config.plans:
        task = plan.task.name
        for opt in _optimizers(results) + _controls(results, task):
            runs = _selected(results, task, opt)
            val = [r.final_val_loss for r in runs]
            mean, std = _mean_std(val)
            acc = [r.final_val_acc for r in runs if not math.isnan(r.final_val_acc)]
            acc_mean, acc_std = _mean_std(acc)
            swept = opt in plan.lrs
            times = {k: statistics.fmean(getattr(r, k) for r in runs) if runs else math.nan for k in _STEP_TIMES}
            rows.append(
                Summary(
                    task=task,
                    optimizer=opt,
                    lr_grid=_grid_text(results, task, opt) if swept else f"{control_base(opt)}'s",
                    lr=results.best_lr[(task, opt)],
                    seeds=len(runs),
                    val_loss_mean=mean,
                    val_loss_std=std,
                    val_acc_mean=acc_mean,
                    val_acc_std=acc_std,
                    train_loss=_pm([r.final_train_loss for r in runs]),
                    val_loss=_pm(val),
                    val_acc=_pm(acc) if acc else "–",
                    seconds_per_run=statistics.fmean(r.seconds for r in runs) if runs else math.nan,
                    cpu_seconds_per_run=statistics.fmean(r.cpu_seconds for r in runs) if runs else math.nan,
                    **times,
                )
            )
    return rows


def _markdown_table(header: Sequence[str], rows: Iterable[Sequence[str]], align: Optional[str] = None) -> str:
    align = align or ("l" + "r" * (len(header) - 1))
    sep = ["---:" if a == "r" else "---" for a in align]
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join(sep) + " |"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _has_rows(table: str) -> bool:
    """Whether a `_markdown_table` has a row under its header and rule."""
    return table.count("\n") > 1


def summary_table(results: DemoResults, task: str) -> str:
    """The headline table of a task: every optimizer at its selected lr, over seeds."""
    rows = [s for s in summarise(results) if s["task"] == task]
    with_acc = any(s["val_acc"] != "–" for s in rows)
    ranked = sorted(rows, key=lambda s: s["val_loss_mean"])
    header = ["optimizer", "lr grid", "selected lr", "held-out loss", *(["held-out accuracy"] if with_acc else []),
              "training loss (last window)", "seeds", "CPU s / run"]
    body = [
        [s["optimizer"], s["lr_grid"], f"{s['lr']:g}", s["val_loss"], *([s["val_acc"]] if with_acc else []),
         s["train_loss"], s["seeds"], f"{s['cpu_seconds_per_run']:.1f}"]
        for s in ranked
    ]
    return _markdown_table(header, body)


def sweep_table(results: DemoResults, task: str) -> str:
    """Final held-out loss of every sweep run (seed 0); the selected lr in bold."""
    width = max(len(results.grid(task, o)) for o in _optimizers(results))
    body = []
    for opt in _optimizers(results):
        cells = []
        for lr in results.grid(task, opt):
            run = next(r for r in results.runs if r.task == task and r.optimizer == opt and r.lr == lr and r.seed == 0)
            added = "+" if lr in results.extended.get((task, opt), ()) else ""
            cell = f"{added}{lr:g}: {_fmt(run.final_val_loss)}"
            cells.append(f"**{cell}**" if lr == results.best_lr[(task, opt)] else cell)
        body.append([opt, *cells, *[""] * (width - len(cells))])
    return _markdown_table(["optimizer", *[f"lr {i + 1}: held-out loss" for i in range(width)]], body)


def extension_note(results: DemoResults, task: str) -> str:
    """Which grids of ``task`` were extended beyond an edge that the selection landed on, with what."""
    grids = [(opt, lrs) for (t, opt), lrs in results.extended.items() if t == task]
    cap = results.config.grid_extensions
    if not grids:
        return f"No grid was extended: every selected learning rate lies inside its grid (up to {cap} extensions)."
    parts = []
    for opt, lrs in grids:
        selected = results.best_lr[(task, opt)]
        grid = results.grid(task, opt)
        where = "inside" if grid[0] < selected < grid[-1] else f"still at an edge after {len(lrs)} extension(s)"
        parts.append(f"{opt} by {', '.join(f'{lr:g}' for lr in lrs)} (selected {selected:g}, {where})")
    return (f"Grids extended beyond the edge the selection landed on (marked + above; at most {cap} values "
            f"per grid): {'; '.join(parts)}.")


def condition_table(results: DemoResults, task: str) -> str:
    """Mean condition number of the update matrices (seed 0, selected lr): first, median, last measurement."""
    body = []
    for opt in CONDITION_OPTIMIZERS:
        runs = [r for r in _selected(results, task, opt) if r.seed == 0]
        if not runs or not runs[0].history.kappa:
            continue
        h = runs[0].history
        body.append([opt, f"{runs[0].lr:g}", _sci(h.kappa[0]), _sci(statistics.median(h.kappa)), _sci(h.kappa[-1])])
    return _markdown_table(["optimizer", "lr", "κ at step 1", "median κ", "κ at the last step"], body)


def _block_size(name: str) -> Optional[int]:
    """The block size of a blocked control's name (``FISMO-SI-B32`` -> 32), None for anything else."""
    tail = name.rsplit("-B", 1)
    return int(tail[1]) if len(tail) == 2 and tail[1].isdigit() else None


def _matrix_shapes(results: DemoResults, task: str) -> list[tuple[int, ...]]:
    """Shapes of the hidden matrices of ``task``'s model (the parameters FISMO and Muon optimise)."""
    from .optimizers import build_optimizer

    plan = next(p for p in results.config.plans if p.task.name == task)
    return [tuple(p.shape) for p in build_optimizer("AdamW", plan.task.model(), 0.01, 0.01).matrices]


def _state_elements(shapes: Sequence[tuple[int, ...]], optimizer: str) -> int:
    """Optimizer-state elements of the hidden matrices: FISMO's ``P``, ``Q``, roots and ``M``; Muon's momentum."""
    if optimizer.startswith("Muon"):
        return sum(m * n for m, n in shapes)
    from fismo_core.kronecker import state_size

    return sum(state_size(m, n, _block_size(optimizer)) for m, n in shapes)


def _paired(results: DemoResults, task: str, name: str, base: str) -> tuple[list[float], list[float]]:
    """Final held-out losses of ``name`` and ``base`` on the seeds both have (same seed: same init and batches)."""
    a = {r.seed: r.final_val_loss for r in _selected(results, task, name)}
    b = {r.seed: r.final_val_loss for r in _selected(results, task, base)}
    seeds = sorted(set(a) & set(b))
    return [a[s] for s in seeds], [b[s] for s in seeds]


def _difference(results: DemoResults, task: str, name: str, base: str) -> str:
    ours, theirs = _paired(results, task, name, base)
    if not ours:
        return "–"
    return _pm([x - y for x, y in zip(ours, theirs)], 4) if all(map(math.isfinite, ours + theirs)) else "diverged"


def blocking_table(results: DemoResults, task: str) -> str:
    """Full FISMO, FISMO-SI and FISMO-T against their blocked controls (same lr, same seeds) and Muon.

    The difference column is paired by seed: each seed's blocked loss minus
    the same seed's full-factor loss, mean ± std over seeds.
    """
    controls = _controls(results, task)
    shapes = _matrix_shapes(results, task)
    rows = {s["optimizer"]: s for s in summarise(results) if s["task"] == task}
    body = []
    for base in ("FISMO", "FISMO-SI", TRAINING):
        blocked = sorted((c for c in controls if control_base(c) == base and _block_size(c)),
                         key=lambda c: _block_size(c) or 0, reverse=True)
        if base not in rows or not blocked:
            continue
        for name in (base, *blocked):
            s = rows[name]
            body.append([name, str(_block_size(name) or "full"), f"{s['lr']:g}", s["val_loss"],
                         "0" if name == base else _difference(results, task, name, base),
                         f"{_state_elements(shapes, name):,}", f"{s['cpu_seconds_per_run']:.1f}"])
    if not body:
        return ""
    for name in ("Muon", "Muon-fp32"):
        if name in rows:
            s = rows[name]
            body.append([name, "–", f"{s['lr']:g}", s["val_loss"], _difference(results, task, name, "FISMO"),
                         f"{_state_elements(shapes, name):,}", f"{s['cpu_seconds_per_run']:.1f}"])
    header = ["optimizer", "block size", "lr", "held-out loss", "minus full (same seed)", "state elements",
              "CPU s / run"]
    return _markdown_table(header, body)


def bf16_table(results: DemoResults, task: str) -> str:
    """FISMO with the Newton–Schulz iteration in bfloat16 against FISMO (float32) and the Muon pair."""
    rows = {s["optimizer"]: s for s in summarise(results) if s["task"] == task}
    if "FISMO-bf16" not in rows or "FISMO" not in rows:
        return ""
    kappa = {}
    for name in ("FISMO", "FISMO-bf16", "Muon-fp32", "Muon"):
        runs = [r for r in _selected(results, task, name) if r.seed == 0 and r.history.kappa]
        kappa[name] = _sci(statistics.median(runs[0].history.kappa)) if runs else "–"
    body = []
    for name, precision, base in (("FISMO", "float32", None), ("FISMO-bf16", "bfloat16", "FISMO"),
                                  ("Muon-fp32", "float32", None), ("Muon", "bfloat16", "Muon-fp32")):
        if name not in rows:
            continue
        s = rows[name]
        diff = "0" if base is None else (_difference(results, task, name, base) if base in rows else "–")
        body.append([name, precision, f"{s['lr']:g}", s["val_loss"], diff, kappa[name],
                     f"{s['cpu_seconds_per_run']:.1f}"])
    header = ["optimizer", "Newton–Schulz in", "lr", "held-out loss", "minus the float32 row above (same seed)",
              "median κ (seed 0)", "CPU s / run"]
    return _markdown_table(header, body)


def _by_seed(results: DemoResults, task: str, name: str) -> dict[int, float]:
    """Final held-out loss of each seed of ``name`` at its selected lr (a diverged run: infinity)."""
    return {r.seed: r.final_val_loss for r in _selected(results, task, name)}


def _signed(x: float) -> str:
    return "diverged" if not math.isfinite(x) else f"{x:+.4f}"


def training_table(results: DemoResults, task: str) -> str:
    """FISMO-T against ``torch.optim.Muon`` at its defaults, seed by seed (same initial weights and batches).

    One row per seed: both held-out losses and FISMO-T's minus Muon-torch's
    (negative: FISMO-T is better); the last row, mean ± std over seeds.
    Empty when either was not run.
    """
    ours, theirs = _by_seed(results, task, TRAINING), _by_seed(results, task, MUON_TORCH)
    seeds = sorted(set(ours) & set(theirs))
    if not seeds:
        return ""
    body = [[str(seed), _fmt(ours[seed], 4), _fmt(theirs[seed], 4), _signed(ours[seed] - theirs[seed])]
            for seed in seeds]
    body.append([f"mean ± std ({len(seeds)} seeds)", _pm([ours[s] for s in seeds], 4),
                 _pm([theirs[s] for s in seeds], 4), _difference(results, task, TRAINING, MUON_TORCH)])
    lrs = f"(lr {results.best_lr[(task, TRAINING)]:g})", f"(lr {results.best_lr[(task, MUON_TORCH)]:g})"
    header = ["seed", f"{TRAINING} {lrs[0]}", f"{MUON_TORCH} {lrs[1]}", f"{TRAINING} minus {MUON_TORCH}"]
    return _markdown_table(header, body)


def ablation_table(results: DemoResults, task: str) -> str:
    """Each control of FISMO-T (one setting changed, same lr and seeds) against FISMO-T, seed by seed.

    A column per seed holds the control's held-out loss minus FISMO-T's
    (positive: FISMO-T's own setting helps); the last column is their
    mean ± std. Empty when FISMO-T has no control on ``task``.
    """
    controls = [c for c in _controls(results, task) if control_base(c) == TRAINING]
    base = _by_seed(results, task, TRAINING)
    if not controls or not base:
        return ""
    seeds = sorted(base)
    body = [[TRAINING, "–", f"{results.best_lr[(task, TRAINING)]:g}",
             _pm(list(base.values()), 4), *["0"] * len(seeds), "0"]]
    for name in controls:
        losses = _by_seed(results, task, name)
        change = ", ".join(f"{k}={v!r}" for k, v in control_change(name).items())
        cells = [_signed(losses[s] - base[s]) if s in losses else "–" for s in seeds]
        body.append([name, change, f"{results.best_lr[(task, name)]:g}", _pm(list(losses.values()), 4), *cells,
                     _difference(results, task, name, TRAINING)])
    header = ["optimizer", "changed setting", "lr", "held-out loss", *[f"minus {TRAINING}, seed {s}" for s in seeds],
              "mean ± std"]
    return _markdown_table(header, body, "ll" + "r" * (len(header) - 2))


def timing_table(results: DemoResults, task: str) -> str:
    """Time per training step of every optimizer and control, wall and CPU, and its ratio to Muon-torch's.

    Means over the seeds at the selected lr of each run's mean step (its
    measurements and evaluations left out, see `fismo_core.demo.train`):
    the whole step (forward, backward, optimizer step) and the optimizer step
    alone. Empty when Muon-torch was not run or no time was recorded.
    """
    rows = {s["optimizer"]: s for s in summarise(results) if s["task"] == task}
    reference = rows.get(MUON_TORCH)
    if reference is None or not all(math.isfinite(reference[k]) and reference[k] > 0 for k in _STEP_TIMES):
        return ""
    body = []
    for name, s in sorted(rows.items(), key=lambda item: item[1]["step_seconds"]):
        cells = []
        for key in ("step_seconds", "step_cpu_seconds", "opt_step_seconds", "opt_step_cpu_seconds"):
            cells += [f"{1e3 * s[key]:.2f}", f"{s[key] / reference[key]:.2f}×"]
        body.append([name, *cells])
    header = ["optimizer", "ms / step", f"vs {MUON_TORCH}", "CPU ms / step", f"vs {MUON_TORCH}",
              "opt.step ms", f"vs {MUON_TORCH}", "opt.step CPU ms", f"vs {MUON_TORCH}"]
    return _markdown_table(header, body)


def preconditioner_table(results: DemoResults, task: str) -> str:
    """FISMO's preconditioners as printed, scale-invariant and in FISMO-T (seed 0, selected lr), from ``state[p]``."""
    body = []
    for opt in ("FISMO", "FISMO-SI", TRAINING):
        runs = [r for r in _selected(results, task, opt) if r.seed == 0]
        if not runs or not runs[0].history.cond_P:
            continue
        h = runs[0].history
        body.append([
            opt, _sci(statistics.median(h.grad_rms)), _sci(h.cond_P[-1]), _sci(max(h.cond_P)), _sci(h.cond_Q[-1]),
            _sci(h.P_dev[-1]), _sci(max(h.P_dev)), _sci(h.Q_dev[-1]),
        ])
    header = ["statistics", "median gradient RMS σ", "cond(P) last", "cond(P) max", "cond(Q) last",
              "‖P−I‖/√m last", "‖P−I‖/√m max", "‖Q−I‖/√n last"]
    return _markdown_table(header, body)


# ---------------------------------------------------------------- figures
def _save(fig: Any, path: Path) -> None:
    """Save as a small PNG: 80 dpi, reduced to a 256-colour palette (Pillow comes with matplotlib)."""
    import io

    import matplotlib.pyplot as plt
    from PIL import Image

    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=80)
    plt.close(fig)
    buffer.seek(0)
    Image.open(buffer).convert("RGB").quantize(colors=256).save(path, format="PNG", optimize=True)


def _mean_curve(
    runs: list[RunResult], attr: str, step_attr: str
) -> tuple[list[int], list[float], list[float], list[float]]:
    """Steps, and the mean, minimum and maximum over ``runs`` of the curve ``attr``."""
    steps = getattr(runs[0].history, step_attr)
    curves = [getattr(r.history, attr) for r in runs if len(getattr(r.history, attr)) == len(steps)]
    if not curves:
        return [], [], [], []
    mean = [statistics.fmean(c[i] for c in curves) for i in range(len(steps))]
    low = [min(c[i] for c in curves) for i in range(len(steps))]
    high = [max(c[i] for c in curves) for i in range(len(steps))]
    return steps, mean, low, high


def _lone(steps: Sequence[float]) -> Optional[str]:
    """A marker for a curve of one point (``--steps 1``), which a line alone does not draw."""
    return "." if len(steps) == 1 else None


def _plot_losses(results: DemoResults, task: str, title: str, path: Path) -> None:
    import matplotlib.pyplot as plt

    has_acc = any(r.task == task and not math.isnan(r.final_val_acc) for r in results.runs)
    panels = [("train_loss", "training loss"), ("val_loss", "held-out loss")]
    if has_acc:
        panels.append(("val_acc", "held-out accuracy"))
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.4), constrained_layout=True)
    for ax, (attr, label) in zip(axes, panels):
        for opt in _optimizers(results):
            runs = [r for r in _selected(results, task, opt) if not r.diverged]
            if not runs:
                continue
            steps, mean, low, high = _mean_curve(runs, attr, "eval_step")
            if attr == "train_loss":  # the first point is the held-out loss at initialisation
                steps, mean, low, high = steps[1:], mean[1:], low[1:], high[1:]
            colour = _COLOURS.get(opt)
            ax.plot(steps, mean, label=f"{opt} (lr {runs[0].lr:g})", color=colour, lw=1.4, marker=_lone(steps))
            if len(runs) > 1:
                ax.fill_between(steps, low, high, color=colour, alpha=0.15, lw=0)
        ax.set_xlabel("step")
        ax.set_title(label, fontsize=10)
        if attr != "val_acc":
            ax.set_yscale("log")
        else:  # from 0.8, or lower where a curve is (a short run's 0.1 left the panel empty)
            lowest = ax.dataLim.y0
            ax.set_ylim(min(0.8, lowest) if math.isfinite(lowest) else 0.8, 1.0)
        ax.grid(alpha=0.3, which="both")
    axes[0].legend(fontsize=7)
    n = max((len(_selected(results, task, o)) for o in _optimizers(results)), default=0)
    fig.suptitle(f"{title}: mean over {n} seeds (band: min–max), selected lr", fontsize=10)
    _save(fig, path)


def _plot_blocks(results: DemoResults, task: str, title: str, path: Path) -> None:
    """Held-out loss of full and blocked FISMO and FISMO-SI (and Muon): mean over seeds, selected lr."""
    import matplotlib.pyplot as plt

    controls = _controls(results, task)
    sizes = sorted({b for c in controls if (b := _block_size(c))})
    fig, ax = plt.subplots(figsize=(6.0, 3.8), constrained_layout=True)
    for base in ("FISMO", "FISMO-SI", TRAINING, "Muon"):
        names = [base] + ([f"{base}-B{b}" for b in sizes] if base != "Muon" else [])
        for name in names:
            runs = [r for r in _selected(results, task, name) if not r.diverged]
            if not runs:
                continue
            steps, mean, _, _ = _mean_curve(runs, "val_loss", "eval_step")
            b = _block_size(name)
            style = "-" if b is None else _BLOCK_STYLES[sizes.index(b) % len(_BLOCK_STYLES)]
            label = f"{name} (lr {runs[0].lr:g})" if b is None else f"{base}, B = {b}"
            ax.plot(steps[1:], mean[1:], ls=style, color=_COLOURS[base], lw=1.3, label=label, marker=_lone(steps[1:]))
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("held-out loss")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    n = max((len(_selected(results, task, c)) for c in controls), default=0)
    ax.set_title(f"{title}:\nfull vs block-diagonal factors, mean over {n} seeds", fontsize=9)
    _save(fig, path)


def _plot_condition(results: DemoResults, task: str, title: str, path: Path) -> None:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 3.6), constrained_layout=True)
    for opt in CONDITION_OPTIMIZERS:
        runs = [r for r in _selected(results, task, opt) if r.seed == 0]
        if not runs or not runs[0].history.kappa:
            continue
        h = runs[0].history
        ax.plot(h.measure_step, h.kappa, marker=".", label=f"{opt} (lr {runs[0].lr:g})", color=_COLOURS.get(opt))
    ax.axhline(1.0, color="k", lw=0.8, ls=":", label="exact polar factor (κ = 1)")
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("mean κ(ΔW / lr) over hidden matrices")
    ax.set_title(f"{title}: condition number of the updates (seed 0)", fontsize=9)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    _save(fig, path)


def _plot_preconditioners(results: DemoResults, task: str, title: str, path: Path) -> None:
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(12.0, 3.3), constrained_layout=True)
    for opt in ("FISMO", "FISMO-SI", TRAINING):
        runs = [r for r in _selected(results, task, opt) if r.seed == 0]
        if not runs or not runs[0].history.cond_P:
            continue
        h, colour = runs[0].history, _COLOURS[opt]
        marker = _lone(h.measure_step)
        axes[0].plot(h.measure_step, h.cond_P, color=colour, label=f"{opt}: cond(P)", marker=marker)
        axes[0].plot(h.measure_step, h.cond_Q, color=colour, ls="--", label=f"{opt}: cond(Q)", marker=marker)
        axes[1].plot(h.measure_step, h.P_dev, color=colour, label=f"{opt}: ‖P−I‖/√m", marker=marker)
        axes[1].plot(h.measure_step, h.Q_dev, color=colour, ls="--", label=f"{opt}: ‖Q−I‖/√n", marker=marker)
        axes[2].plot(h.measure_step, h.grad_rms, color=colour, label=opt, marker=marker)
    titles = ("condition numbers (mean over matrices)", "distance from the identity", "gradient RMS σ")
    for ax, label in zip(axes, titles):
        ax.set_yscale("log")
        ax.set_xlabel("step")
        ax.set_title(label, fontsize=10)
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7)
    fig.suptitle(f"{title}: FISMO's preconditioners, printed vs scale-invariant statistics, and {TRAINING} (seed 0)",
                 fontsize=10)
    _save(fig, path)


# ---------------------------------------------------------------- files
def _write_csv(path: Path, header: Sequence[str], rows: Iterable[Sequence[object]]) -> None:
    with path.open("w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(header)
        writer.writerows(rows)


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment() -> str:
    """Python, torch, the CPU and the instruction set torch's kernels use: the line every results file starts with.

    The figures are bit-for-bit reproducible only with the same CPU
    instruction set and the same software: torch's CPU kernels take
    different code paths (and round differently) on AVX2, AVX-512 and other
    CPUs, which changes every trajectory a little, and the final losses by as
    much as the seed-to-seed spread.
    """
    capability = torch.backends.cpu.get_cpu_capability()
    return (
        f"Python {platform.python_version()}, torch {torch.__version__}, {platform.machine()} "
        f"({_cpu_model()}, torch CPU capability {capability}), {os.cpu_count()} CPUs, one torch thread per run"
    )


def digest_key() -> str:
    """What the result digest depends on besides the configuration, as one line.

    The code (fismo's version), the data (the text task reads the Python
    standard library's source; the digits come from scikit-learn), the CPU
    (its model name, as ``/proc/cpuinfo`` gives it) and torch's CPU kernels:
    torch picks them by CPU at run time (its CPU capability, e.g. AVX2 or
    AVX512; ``ATEN_CPU_CAPABILITY`` and ``ONEDNN_MAX_CPU_ISA`` or its older
    name ``DNNL_MAX_CPU_ISA`` force others), and kernels of another
    instruction set round differently; whether bfloat16 is native
    (``bfloat16_is_native``), which decides FISMO-T's precision; and
    pytorch-optimizer's version, whose SOAP is one of the runs (since
    2026-12-04: a run without it, or with another, printed the same key and
    another digest). The CPU's name is in the key since 2026-12-05: an AMD
    EPYC and an Intel Xeon, both AVX512 with bfloat16 native, printed the
    same key and two digests (torch's oneDNN and LAPACK choose kernels by
    CPU beyond its capability). The demo does no NumPy linear algebra, so
    OpenBLAS's kernels are not part of the key. Runs with the same key and
    configuration have given the same digest wherever we repeated one; a
    virtual machine's CPU name may hide its generation, so a key is the
    evidence a digest should match, not a proof. With another key the
    digest is expected to differ: compare digests only under equal keys.
    """
    from importlib import metadata

    from .. import __version__

    versions = {}
    for package in ("scikit-learn", "pytorch-optimizer"):  # the data's splits; SOAP's step
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            versions[package] = "not installed"
    from ..backends.torch import bfloat16_is_native, onednn_isa_limit

    # FISMO-T computes in bfloat16 only where it is native (FISMO.training's rule).
    bfloat16 = "native" if bfloat16_is_native("cpu") else "emulated"
    kernels = f"{torch.backends.cpu.get_cpu_capability()} kernels, bfloat16 {bfloat16}"
    forced = [f"ATEN_CPU_CAPABILITY={os.environ['ATEN_CPU_CAPABILITY']}"] if os.environ.get("ATEN_CPU_CAPABILITY") else []
    forced += ["=".join(limit) for limit in [onednn_isa_limit()] if limit is not None]
    if forced:
        kernels += f", forced by {' '.join(forced)}"
    return (f"fismo {__version__}, Python {platform.python_version()}, torch {torch.__version__} "
            f"({kernels}, {platform.machine()}, {_cpu_model()}), scikit-learn {versions['scikit-learn']}, "
            f"pytorch-optimizer {versions['pytorch-optimizer']}")


def digest(results: DemoResults) -> str:
    """SHA-256 of every run's numbers (curves, final values; not its timings), in a fixed order.

    Two runs of the same configuration with the same `digest_key` (software
    and CPU kernels) give the same digest; it is the quick way to compare a
    fresh run with a published one of the same key.
    """
    timing = {"seconds", "cpu_seconds", *_STEP_TIMES}
    runs = sorted(results.runs, key=lambda r: (r.task, r.optimizer, r.lr, r.seed))
    payload = [{k: v for k, v in r.to_dict().items() if k not in timing} for r in runs]
    text = json.dumps({"best_lr": sorted((t, o, lr) for (t, o), lr in results.best_lr.items()), "runs": payload},
                      sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _finite_or_null(value: Any) -> Any:
    """``value`` (nested dicts and lists) with every non-finite float made ``None``."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite_or_null(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite_or_null(v) for v in value]
    return value


def _minutes(seconds: float) -> str:
    """``95 s``, or ``5 min 00 s`` from two minutes on (rounded to the second first)."""
    whole = round(seconds)
    return f"{whole} s" if whole < 120 else f"{whole // 60} min {whole % 60:02d} s"


#: The tables every demo writes.
TABLES = ("report.md", "summary.csv", "runs.csv", "curves.csv", "results.json")
#: Every figure a demo can write: those of an earlier run that this one does not write are removed.
FIGURES = tuple(f"{task}_{kind}.png" for task in ("digits", "text")
                for kind in ("loss", "condition", "preconditioner", "blocks"))


def in_the_way(out: Path) -> None:
    """An `IsADirectoryError` if a folder in ``out`` has the name of a file of the report (`TABLES`, `FIGURES`):
    found after the runs, it left half of the report written (a user's hunt, 2026-12-03); a
    `NotARegularFileError` if another name cannot be a regular file (a device, a pipe, a link into a missing
    folder), which the write refused after the runs too (a user's hunt, 2026-12-04)."""
    for name in (*TABLES, *FIGURES):
        if (out / name).is_dir():
            raise IsADirectoryError(errno.EISDIR, "a folder has the name of a file of the report", str(out / name))
        writable_target(out / name)


def write_report(results: DemoResults, out: Path, command: str) -> tuple[str, list[str]]:
    """Write ``report.md``, ``summary.csv``, ``runs.csv``, ``curves.csv``, ``results.json`` and the PNGs to ``out``.

    The PNG figures need matplotlib; without it the report says so and no
    figure is written. All or nothing: an `OSError` leaves ``out`` as it
    was (`fismo_core._paths.staged_files`). Figures of an earlier run in ``out`` (`FIGURES`) that
    this run does not draw are removed, so that the folder is this run's.
    Returns the markdown report (also printed by the CLI) and the names of
    the files written, in order.
    """
    in_the_way(out)
    with staged_files(out) as staged:
        report, written = _write_report(results, out, command, staged)
    for stale in set(FIGURES) - set(written):
        (out / stale).unlink(missing_ok=True)
    return report, written


def _write_report(results: DemoResults, out: Path, command: str, staged: StagedFiles) -> tuple[str, list[str]]:
    """`write_report`, each file written to ``staged(name)``."""
    try:
        import matplotlib
    except ImportError:
        plots = False
    else:
        matplotlib.use("Agg")
        plots = True
    out.mkdir(parents=True, exist_ok=True)
    written: list[str] = []
    load = ""
    if hasattr(os, "getloadavg"):
        load = f"; load average at the end {os.getloadavg()[0]:.1f}"
    parts = [
        "# fismo demo results",
        "",
        f"Command: `{command}` (preset {results.config.preset!r})  ",
        f"Wall time: {_minutes(results.seconds)} ({results.config.jobs} parallel job{'s' * (results.config.jobs != 1)}{load}); "
        f"CPU time {results.cpu_seconds:.0f} s"
        + (f"; {results.reused} runs reused from the journal" if results.reused else "") + "  ",
        f"{len(results.runs)} runs; their own CPU time adds up to {sum(r.cpu_seconds for r in results.runs):.0f} s "
        "(training and measurements, without process start-up and reports).  ",
        f"{environment()}.  ",
        f"Result digest: `{digest(results)}` for {digest_key()} (every run's numbers, not its timings: "
        "with the same key, the same digest means the same figures to the last bit; another key, such as "
        "another CPU's kernels, gives other figures and another digest).",
    ]
    for name, reason in results.skipped.items():
        parts.append(f"\n**{name} skipped**: {reason}.")
    if not plots:
        parts.append("\n**Figures skipped**: matplotlib is not installed (pip install matplotlib).")
    for task, title in _tasks(results):
        plan = next(p for p in results.config.plans if p.task.name == task)
        figures = [("loss", _plot_losses)]
        if _has_rows(condition_table(results, task)):  # not --optimizers SGD alone: a plot with no curve
            figures.append(("condition", _plot_condition))
        if any(r.task == task and r.history.cond_P for r in results.runs):  # FISMO was run
            figures.append(("preconditioner", _plot_preconditioners))
        blocks = blocking_table(results, task)
        if blocks:
            figures.append(("blocks", _plot_blocks))
        for kind, plot in figures if plots else ():
            plot(results, task, title, staged(f"{task}_{kind}.png"))
            written.append(f"{task}_{kind}.png")
        parts += [
            "",
            f"## {title}",
            "",
            f"{plan.task.describe()}; {plan.steps} step{'s' * (plan.steps != 1)}, warm-up {plan.warmup} step{'s' * (plan.warmup != 1)} then cosine to 10 % of the lr; "
            f"AdamW lr {plan.adamw_lr:g} for the non-matrix parameters of FISMO and Muon.",
            "",
            "Selected learning rate of each optimizer, final numbers over seeds (mean ± std):",
            "",
            summary_table(results, task),
            "",
            "Sweep (seed 0), final held-out loss at each learning rate:",
            "",
            sweep_table(results, task),
            "",
            extension_note(results, task),
        ]
        # Each table only where an optimizer that measures it ran (--optimizers SGD: headers with no rows).
        for heading, table in (("Condition number of the updates of the hidden matrices:", condition_table),
                               ("FISMO's preconditioners:", preconditioner_table)):
            written_table = table(results, task)
            if _has_rows(written_table):
                parts += ["", heading, "", written_table]
        if blocks:
            parts += ["", "Block-diagonal factors (same lr and seeds as the full factors):", "", blocks]
        bf16 = bf16_table(results, task)
        if bf16:
            parts += ["", "Newton–Schulz precision (same lr and seeds):", "", bf16]
        training = training_table(results, task)
        if training:
            parts += ["", f"The training configuration {TRAINING} against `torch.optim.Muon` at its defaults "
                      f"({MUON_TORCH}), each at its selected lr, seed by seed (same initial weights and batches):",
                      "", training]
        ablations = ablation_table(results, task)
        if ablations:
            parts += ["", f"Ablations of {TRAINING}: each control changes one setting, at {TRAINING}'s lr and seeds "
                      "(positive: the control's loss is higher, so FISMO-T's own setting helps):", "", ablations]
        timing = timing_table(results, task)
        if timing:
            parts += ["", f"Time per training step (measurements and evaluations left out; mean over the seeds at "
                      f"the selected lr), against {MUON_TORCH}:", "", timing]
        if plots:
            parts += ["", *(f"![{task} {kind}]({task}_{kind}.png)" for kind, _ in figures)]
    report = "\n".join(parts) + "\n"
    staged("report.md").write_text(report, encoding="utf-8")  # not the locale's: it has ±, κ, σ

    rows = summarise(results)
    keys = ["task", "optimizer", "lr_grid", "lr", "seeds", "val_loss_mean", "val_loss_std", "val_acc_mean",
            "val_acc_std", "seconds_per_run", "cpu_seconds_per_run", *_STEP_TIMES]
    _write_csv(staged("summary.csv"), keys, ([s[k] for k in keys] for s in rows))
    run_keys = ["task", "optimizer", "lr", "seed", "steps", "final_val_loss", "final_val_acc", "final_train_loss",
                "diverged", "seconds", "cpu_seconds", *_STEP_TIMES]
    _write_csv(staged("runs.csv"), run_keys, ([getattr(r, k) for k in run_keys] for r in results.runs))
    curve_rows = []
    for r in results.runs:
        h = r.history
        for attr, step_attr in (("train_loss", "eval_step"), ("val_loss", "eval_step"), ("val_acc", "eval_step"),
                                ("kappa", "measure_step"), ("grad_rms", "measure_step"), ("cond_P", "measure_step"),
                                ("cond_Q", "measure_step"), ("P_dev", "measure_step"), ("Q_dev", "measure_step")):
            for step, value in zip(getattr(h, step_attr), getattr(h, attr)):
                curve_rows.append([r.task, r.optimizer, r.lr, r.seed, attr, step, value])
    _write_csv(staged("curves.csv"), ["task", "optimizer", "lr", "seed", "metric", "step", "value"], curve_rows)
    payload = {
        "command": command,
        "preset": results.config.preset,
        "seconds": results.seconds,
        "cpu_seconds": results.cpu_seconds,
        "environment": environment(),
        "digest": digest(results),
        "digest_key": digest_key(),
        "python": sys.version,
        "skipped": results.skipped,
        "best_lr": [{"task": t, "optimizer": o, "lr": lr} for (t, o), lr in results.best_lr.items()],
        "grids": [{"task": t, "optimizer": o, "lrs": list(lrs), "extended_by": list(results.extended.get((t, o), ()))}
                  for (t, o), lrs in results.grids.items()],
        "runs": [r.to_dict() for r in results.runs],
    }
    # Standard JSON: a NaN (the text task's accuracy) or an infinity (a diverged run) is null, not JavaScript's
    # NaN, which JSON parsers other than Python's refuse (a user's hunt, 2026-12-04).
    staged("results.json").write_text(json.dumps(_finite_or_null(payload), indent=1, default=str, allow_nan=False),
                                      encoding="utf-8")
    return report, [*TABLES, *written]
