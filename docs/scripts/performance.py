"""The measurements of the documentation page "Performance" (torch CPU float32 unless stated).

Every time is a median over interleaved repeats (A B C A B C ...), so that the functions of one
table see the same machine state and their ratios are fair on a noisy machine; ratios are taken
within one run. The step callables are those of the asv suite (``asv_benchmarks/benchmarks/
common.py``), so the page and the suite time the same code.

    python docs/scripts/performance.py                    # all tables and plots (the models section takes an hour or more on 2 busy cores)
    python docs/scripts/performance.py --only flops       # one section: memory, functions, flops, batched, steps, plot
    python docs/scripts/performance.py --repeats 3        # fewer repeats (noisier)
    python docs/scripts/performance.py --only models --model gpt2-2layers --repeats 3   # real model shapes
    python docs/scripts/performance.py --only models --names eigh-B768 muon-float32     # some rows only
    python docs/scripts/performance.py --only threads     # eigh and matmul with 1 and 2 threads
    python docs/scripts/performance.py --only bf16 --threads 1   # a bfloat16 product against float32, here

The "models" section times one step over all the weight matrices of a real model (two GPT-2-small
layers; a LLaMA-like 2048 x 5504 matrix) for FISMO full and blocked and every anchor. Each run
stores its medians, with the float32 Muon step of the same run, in
``docs/performance/model_steps.json`` (rows measured in an earlier run are kept, each with its
own Muon time, so every ratio is still taken within one run), then prints the table from that
file and draws ``docs/performance/model_step_time.png``. On a CUDA machine ``--device cuda``
times the same steps there (stored under their own key).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "asv_benchmarks"))

from benchmarks.common import (  # noqa: E402
    MODEL_ANCHORS,
    MODEL_SETS,
    MODEL_VARIANTS,
    VARIANTS,
    anchor_step,
    fismo_step,
    flops_per_step,
    interleaved_medians,
    model_fismo_step,
    steps_per_call,
)

from fismo_core import FISMO  # noqa: E402
from fismo_core.perf import muon_flops, muon_state_elements, state_elements, step_flops  # noqa: E402

SHAPES = [(256, 256), (1024, 1024), (768, 3072), (3072, 768), (16, 512, 512)]
FISMO_VARIANTS = ["default", "eigh", "newton_schulz", "eigh-every10"]
ANCHORS = ["muon", "muon-float32", "adamw", "shampoo", "soap"]
LABELS = {
    "default": "FISMO default",
    "eigh": "FISMO exact, no host reads",
    "newton_schulz": "FISMO Newton–Schulz roots",
    "eigh-every10": "FISMO roots every 10 steps",
    "muon": "Muon (torch, bf16 iteration)",
    "muon-float32": "Muon, float32 iteration",
    "adamw": "AdamW (torch)",
    "shampoo": "Shampoo (roots every step)",
    "soap": "SOAP (basis every 10 steps)",
}
for _B in (256, 512, 768, 1024):
    LABELS[f"eigh-B{_B}"] = f"FISMO blocked, B = {_B}"
    LABELS[f"eigh-B{_B}-bf16"] = f"FISMO blocked, B = {_B}, bf16 polar"
    LABELS[f"newton_schulz-B{_B}"] = f"FISMO blocked, B = {_B}, Newton–Schulz roots"
LABELS.update({
    "eigh-bf16": "FISMO exact, bf16 polar",
    "training-B512": "FISMO-T (training configuration), B = 512, bf16 polar and products (where bfloat16 is native)",
    "training-B768": "FISMO-T (training configuration), B = 768, bf16 polar and products (where bfloat16 is native)",
    "training-B1024": "FISMO-T (training configuration), B = 1024, bf16 polar and products (where bfloat16 is native)",
    "training-B512-fp32mm": "FISMO-T, B = 512, bf16 polar, float32 products",
    "training-B768-fp32mm": "FISMO-T, B = 768, bf16 polar, float32 products",
    "training-B1024-fp32mm": "FISMO-T, B = 1024, bf16 polar, float32 products",
    "training-B512-fp32": "FISMO-T, B = 512, float32 polar and products (its precision where bfloat16 is emulated)",
    "training-B768-fp32": "FISMO-T, B = 768, float32 polar and products (its precision where bfloat16 is emulated)",
    "training-B1024-fp32": "FISMO-T, B = 1024, float32 polar and products (its precision where bfloat16 is emulated)",
    "scalable-shampoo": "ScalableShampoo (pytorch-optimizer, blocks of 512)",
    "heavyball-soap": "SOAP (heavyball)",
    "heavyball-klshampoo": "KL-Shampoo (heavyball)",
    "shampoo": "Shampoo (pytorch-optimizer, roots every step)",
    "soap": "SOAP (pytorch-optimizer, basis every 10 steps)",
})
PLOT = ROOT / "docs" / "performance" / "step_time.png"
MODEL_JSON = ROOT / "docs" / "performance" / "model_steps.json"
#: The model sets of the page (the asv suite also has llama-4096x11008).
PAGE_MODELS = ["gpt2-2layers", "llama-2048x5504"]


def shape_name(shape) -> str:
    return "×".join(str(v) for v in shape)


def step_functions(shape, names) -> dict:
    """name -> zero-argument callable doing one call (a cycle for the amortised ones)."""
    fns = {}
    for name in names:
        try:
            fns[name] = fismo_step(name, "torch-cpu-float32", shape) if name in VARIANTS else anchor_step(name, shape)
        except NotImplementedError as exc:
            print(f"<!-- {name} at {shape_name(shape)} skipped: {exc} -->")
    return fns


def per_step(medians: dict) -> dict:
    return {name: t / steps_per_call(name) for name, t in medians.items()}


def section_steps(repeats: int) -> None:
    print("### Step time (ms, median) and ratio to the float32 Muon step\n")
    names = FISMO_VARIANTS + ANCHORS
    print("| shape | " + " | ".join(LABELS[n] for n in names) + " |")
    print("|---|" + "---|" * len(names))
    for shape in SHAPES:
        times = per_step(interleaved_medians(step_functions(shape, names), repeats))
        muon = times.get("muon-float32")
        cells = []
        for n in names:
            if n not in times:
                cells.append("—")
            elif n in VARIANTS and muon:
                cells.append(f"{times[n] * 1e3:.0f} ({times[n] / muon:.2f}×)")
            else:
                cells.append(f"{times[n] * 1e3:.1f}")
        print(f"| {shape_name(shape)} | " + " | ".join(cells) + " |")
    print()


def matmul_rate(repeats: int) -> float:
    import torch

    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    seconds = interleaved_medians({"mm": lambda: a @ b}, 10 * repeats)["mm"]
    return 2 * 1024**3 / seconds


def section_flops(repeats: int) -> None:
    print("### Achieved FLOP/s (torch CPU float32; eigh counted as 9 d³)\n")
    print("| shape | step | GFLOP per step (of which eigh) | median time (ms) | GFLOP/s | % of matmul rate |")
    print("|---|---|---|---|---|---|")
    names = ["eigh", "newton_schulz", "eigh-every10", "muon-float32"]
    for shape in [(1024, 1024), (768, 3072)]:
        m, n = shape
        fns = step_functions(shape, names)
        rate_before = matmul_rate(repeats)
        times = per_step(interleaved_medians(fns, repeats))
        rate = (rate_before + matmul_rate(repeats)) / 2
        for name in names:
            if name == "muon-float32":
                flops, eigh = muon_flops(m, n), 0
            else:
                opt = FISMO(**VARIANTS[name])
                flops, eigh = flops_per_step(name, m, n), step_flops(m, n, opt)["eigh"] / opt.inv_root.every
            achieved = flops / times[name]
            split = f"{flops / 1e9:.1f} ({eigh / 1e9:.1f})" if eigh else f"{flops / 1e9:.1f}"
            print(f"| {shape_name(shape)} | {LABELS[name]} | {split} | {times[name] * 1e3:.0f} "
                  f"| {achieved / 1e9:.0f} | {100 * achieved / rate:.0f} % |")
        print(f"| | 1024×1024 matmul, measured before and after | | | {rate / 1e9:.0f} | 100 % |")
    print()


def section_batched(repeats: int) -> None:
    print("### One batched call against separate calls (16 × 512 × 512, roots by eigh)\n")
    print("| backend | batched (ms) | 16 separate (ms) | separate / batched |")
    print("|---|---|---|---|")
    for backend in ("torch-cpu-float32", "numpy-cpu-float32"):
        shape = (16, 512, 512)
        times = interleaved_medians(
            {"batched": fismo_step("eigh", backend, shape), "separate": fismo_step("eigh", backend, shape, separate=True)},
            repeats,
        )
        print(f"| {backend} | {times['batched'] * 1e3:.0f} | {times['separate'] * 1e3:.0f} "
              f"| {times['separate'] / times['batched']:.3f} |")
    print()


def section_memory() -> None:
    print("### Optimizer state per parameter (elements; bytes in float32 = 4 ×)\n")
    formulas = {
        "FISMO": ("2m² + 2n² + mn", state_elements),
        "Adam / AdamW": ("2mn", lambda m, n: 2 * m * n),
        "Muon": ("mn", lambda m, n: m * n),
        "Shampoo (pytorch-optimizer)": ("2m² + 2n² + mn", lambda m, n: 2 * m * m + 2 * n * n + m * n),
        "SOAP (pytorch-optimizer)": ("2mn + 2m² + 2n²", lambda m, n: 2 * m * n + 2 * m * m + 2 * n * n),
    }
    shapes = [(1024, 1024), (768, 3072), (512, 512)]
    print("| optimizer | elements per matrix | " + " | ".join(f"per parameter, {shape_name(s)}" for s in shapes) + " |")
    print("|---|---|" + "---|" * len(shapes))
    for name, (formula, count) in formulas.items():
        cells = " | ".join(f"{count(m, n) / (m * n):.2f} ({4 * count(m, n) / (m * n):.1f} B)" for m, n in shapes)
        print(f"| {name} | {formula} | {cells} |")
    print()


def section_flop_lines() -> None:
    print("### FLOPs of one step by line of Algorithm 1 (GFLOP)\n")
    configs = {"default": FISMO(), "eigh": FISMO(nonfinite="propagate"),
               "newton_schulz": FISMO(nonfinite="propagate", inv_root="newton_schulz")}
    keys = ["line 4", "line 5", "roots", "eigh", "line 6", "line 8", "total"]
    print("| shape | configuration | " + " | ".join(keys) + " | Muon |")
    print("|---|---|" + "---|" * (len(keys) + 1))
    for m, n in [(1024, 1024), (768, 3072)]:
        for name, opt in configs.items():
            counts = step_flops(m, n, opt)
            print(f"| {m}×{n} | {LABELS[name]} | " + " | ".join(f"{counts[k] / 1e9:.1f}" for k in keys)
                  + f" | {muon_flops(m, n) / 1e9:.1f} |")
    for (m, n), B in [((768, 2304), 768), ((768, 3072), 768), ((3072, 768), 768), ((2048, 5504), 1024),
                      ((4096, 11008), 1024)]:
        counts = step_flops(m, n, FISMO(nonfinite="propagate", block_size=B))
        print(f"| {m}×{n} | {LABELS[f'eigh-B{B}']} | " + " | ".join(f"{counts[k] / 1e9:.1f}" for k in keys)
              + f" | {muon_flops(m, n) / 1e9:.1f} |")
    print()


def section_plot(repeats: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = [128, 256, 512, 1024, 2048]
    names = ["default", "eigh", "newton_schulz", "muon", "muon-float32", "adamw", "shampoo"]
    curves = {name: [] for name in names}
    print("### Step time against matrix size, d × d (ms, median)\n")
    print("| d | " + " | ".join(LABELS[n] for n in names) + " |")
    print("|---|" + "---|" * len(names))
    for d in sizes:
        times = per_step(interleaved_medians(step_functions((d, d), names), repeats if d < 2048 else max(3, repeats // 2)))
        for name in names:
            curves[name].append(times.get(name, math.nan))
        print(f"| {d} | " + " | ".join(f"{times[n] * 1e3:.1f}" if n in times else "—" for n in names) + " |")
    print()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name in names:
        ax.plot(sizes, [t * 1e3 for t in curves[name]], marker="o", label=LABELS[name])
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("matrix size d (one d × d parameter)")
    ax.set_ylabel("time per step (ms, median)")
    ax.set_title(f"One optimizer step, torch CPU float32 ({platform.machine()}, 2 cores)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    PLOT.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(PLOT, dpi=110)
    print(f"<!-- plot written to {PLOT.relative_to(ROOT)} -->\n")


def section_matrix_functions(repeats: int) -> None:
    import torch

    from benchmarks.common import random_matrix, random_spd

    from fismo_core import linalg

    print("### Matrix functions (torch CPU float32; ms, median; in brackets, in 1024 × 1024 matmuls)\n")
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    methods = {
        "eigh": {"method": "eigh"},
        "Newton–Schulz, Polar Express, 9 steps": {"method": "newton_schulz"},
        "Newton–Schulz, cubic, 22 steps": {"method": "newton_schulz", "coefficients": "cubic"},
    }
    print("| d | 1024² matmul | " + " | ".join(f"inverse_sqrt, {name}" for name in methods) + " |")
    print("|---|---|" + "---|" * len(methods))
    for d in (256, 1024, 3072):
        A = torch.asarray(random_spd((d, d)), dtype=torch.float32)
        fns = {"mm": lambda: a @ b}
        # check=False: the method alone, as the optimizer calls it (no input check)
        fns.update({name: (lambda kw=kw: linalg.inverse_sqrt(A, check=False, **kw)) for name, kw in methods.items()})
        times = interleaved_medians(fns, repeats if d < 3072 else 3)
        mm = times.pop("mm")
        print(f"| {d} | {mm * 1e3:.1f} | " + " | ".join(f"{t * 1e3:.0f} ({t / mm:.1f})" for t in times.values()) + " |")
    polar_methods = {
        "Muon quintic, 5 steps": {"coefficients": "muon", "steps": 5},
        "Polar Express, 8 steps": {"coefficients": "polar_express", "steps": 8},
        "SVD": {"method": "svd"},
    }
    print("\n| shape | " + " | ".join(f"polar, {name}" for name in polar_methods) + " |")
    print("|---|" + "---|" * len(polar_methods))
    for shape in ((1024, 1024), (768, 3072)):
        X = torch.asarray(random_matrix(shape), dtype=torch.float32)
        fns = {"mm": lambda: a @ b}
        fns.update({name: (lambda kw=kw: linalg.polar(X, check=False, **kw)) for name, kw in polar_methods.items()})
        times = interleaved_medians(fns, repeats)
        mm = times.pop("mm")
        print(f"| {shape_name(shape)} | " + " | ".join(f"{t * 1e3:.0f} ({t / mm:.1f})" for t in times.values()) + " |")
    print()


def model_callable(name: str, model: str, device: str, shapes=None):
    shapes = MODEL_SETS[model] if shapes is None else shapes
    if name in VARIANTS:
        return model_fismo_step(name, model, f"torch-{device}-float32", shapes=shapes)
    return anchor_step(name, list(shapes), device)


def load_model_results(store: Path = MODEL_JSON) -> dict:
    """The stored rows of the models section (``--json``: another file, e.g. for another CPU)."""
    return json.loads(store.read_text()) if store.exists() else {}


def section_models(repeats: int, models: list, names: list, device: str, without_torch_muon: bool = False,
                   store: Path = MODEL_JSON) -> None:
    """Time ``names`` (always with the float32 Muon step and torch.optim.Muon) on each model set
    and store the medians, then print the tables from the stored results.

    A model's step is timed shape by shape: for each shape, the matrices of that shape (one
    batched core call for FISMO, one optimizer over those parameters for the others), all the
    optimizers interleaved; the model's step time is the sum over its shapes. Short interleaved
    calls sample a machine whose load changes by the minute more evenly than whole-model calls.
    ``without_torch_muon``: leave ``torch.optim.Muon`` out (on a CPU without bfloat16 instructions
    its bfloat16 iteration is emulated, many times slower than float32)."""
    import torch
    from fismo_core._paths import staged_files

    results = load_model_results(store)
    for model in models:
        wanted = list(dict.fromkeys(["muon-float32", *([] if without_torch_muon else ["muon"]), *names]))
        groups: dict[tuple, list] = {}
        for shape in MODEL_SETS[model]:
            groups.setdefault(shape, []).append(shape)
        started = time.time()
        by_shape: dict[str, dict[str, float]] = {}
        for shape, shapes in groups.items():
            fns = {}
            for name in wanted:
                try:
                    fns[name] = model_callable(name, model, device, shapes)
                except NotImplementedError as exc:
                    print(f"<!-- {name} on {model} skipped: {exc} -->")
            # The callables warmed up when they were made (FISMO one step, the anchors two).
            by_shape[shape_name(shape)] = per_step(interleaved_medians(fns, repeats, warmup=False))
            print(f"<!-- {model}, {len(shapes)} x {shape_name(shape)}: {time.time() - started:.0f} s -->", flush=True)
        names_done = set.intersection(*(set(t) for t in by_shape.values()))
        times = {name: sum(t[name] for t in by_shape.values()) for name in names_done}
        if "muon-float32" not in times:  # every row is a ratio to it: store none rather than an empty model
            print(f"<!-- {model} on {device}: nothing stored, the float32 Muon step was skipped -->")
            continue
        load = os.getloadavg()[0] if hasattr(os, "getloadavg") else math.nan
        key = f"{model}/{device}"
        run = {
            "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(started)),
            "repeats": repeats,
            "load_1min_at_end": round(load, 1),
            "threads": torch.get_num_threads(),
            "torch": torch.__version__,
        }
        results = load_model_results(store)  # again: another run may have stored rows meanwhile
        stored = results.setdefault(key, {})
        for name, t in times.items():
            stored[name] = {
                "seconds": t,
                "muon_float32_seconds": times["muon-float32"],
                "torch_muon_seconds": times.get("muon"),
                "by_shape": {shape: {"seconds": v[name], "muon_float32_seconds": v["muon-float32"]}
                             for shape, v in by_shape.items()},
                **run,
            }
        store.parent.mkdir(parents=True, exist_ok=True)
        with staged_files(store.parent) as staged:  # written whole or not at all
            staged(store.name).write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")
        print(f"<!-- {model} on {device}: {len(times)} rows in {time.time() - started:.0f} s -->")
    print_model_tables(device, store)
    plot_models(device, store)


def print_model_tables(device: str, store: Path = MODEL_JSON) -> None:
    results = load_model_results(store)
    print("### One step over the weight matrices of real models (torch float32; ms per step, median)\n")
    for model in PAGE_MODELS:
        stored = results.get(f"{model}/{device}")
        if not stored:
            continue
        shapes = MODEL_SETS[model]
        print(f"**{model}** ({len(shapes)} {'matrix' if len(shapes) == 1 else 'matrices'}: {', '.join(shape_name(s) for s in dict.fromkeys(shapes))})\n")
        order = [n for n in MODEL_VARIANTS + MODEL_ANCHORS if n in stored] + sorted(set(stored) - set(MODEL_VARIANTS + MODEL_ANCHORS))
        per_shape = [s for s in dict.fromkeys(shape_name(s) for s in shapes)] if len(set(shapes)) > 1 else []
        print("| optimizer | ms per step | / Muon float32 step | / torch.optim.Muon | "
              + "".join(f"/ Muon float32, {s} | " for s in per_shape) + "measured (UTC, load, repeats, threads) |")
        print("|---|---|---|---|" + "---|" * len(per_shape) + "---|")
        for name in order:
            r = stored[name]
            muon = r["torch_muon_seconds"]
            cells = [f"{r['seconds'] * 1e3:.0f}", f"{r['seconds'] / r['muon_float32_seconds']:.2f}×",
                     f"{r['seconds'] / muon:.2f}×" if muon else "—"]
            for s in per_shape:
                g = r.get("by_shape", {}).get(s)
                cells.append(f"{g['seconds'] / g['muon_float32_seconds']:.2f}×" if g else "—")
            cells.append(f"{r['when']}, {r['load_1min_at_end']}, {r['repeats']}, {r.get('threads', '?')}")
            print(f"| {LABELS.get(name, name)} | " + " | ".join(cells) + " |")
        print()


def section_model_memory() -> None:
    print("### Optimizer state of the model sets (elements; per parameter in brackets)\n")
    rows = {"FISMO full": lambda m, n: state_elements(m, n)}
    for B in (256, 512, 768, 1024):
        rows[f"FISMO blocked, B = {B}"] = lambda m, n, B=B: state_elements(m, n, B)
    rows["Muon"] = muon_state_elements
    rows["AdamW"] = lambda m, n: 2 * m * n
    models = list(MODEL_SETS)
    print("| optimizer | " + " | ".join(models) + " |")
    print("|---|" + "---|" * len(models))
    for name, count in rows.items():
        cells = []
        for model in models:
            total = sum(count(m, n) for m, n in MODEL_SETS[model])
            params = sum(m * n for m, n in MODEL_SETS[model])
            cells.append(f"{total / 1e6:.1f} M ({total / params:.2f})")
        print(f"| {name} | " + " | ".join(cells) + " |")
    print()


def plot_models(device: str, store: Path = MODEL_JSON) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = load_model_results(store)
    models = [m for m in PAGE_MODELS if results.get(f"{m}/{device}")]
    if not models:
        return
    fig, axes = plt.subplots(1, len(models), figsize=(6.5 * len(models), 6), squeeze=False)
    for ax, model in zip(axes[0], models):
        stored = results[f"{model}/{device}"]
        order = [n for n in MODEL_VARIANTS + MODEL_ANCHORS if n in stored] + sorted(set(stored) - set(MODEL_VARIANTS + MODEL_ANCHORS))[::-1]
        ratios = [stored[n]["seconds"] / stored[n]["muon_float32_seconds"] for n in order]
        colors = ["tab:blue" if n.startswith("eigh") else ("tab:green" if n.startswith("muon") else "tab:gray") for n in order]
        ax.barh(range(len(order)), ratios, color=colors)
        ax.set_yticks(range(len(order)), [LABELS.get(n, n) for n in order], fontsize=7)
        ax.set_xscale("log")
        ax.axvline(1.0, color="tab:green", lw=0.8)
        ax.axvline(2.5, color="tab:red", lw=0.8, ls="--", label="target 2.5×")
        for i, r in enumerate(ratios):
            ax.text(r, i, f" {r:.2f}×", va="center", fontsize=6)
        ax.set_xlabel("step time / float32 Muon step (same run)")
        ax.set_title(f"{model}, torch {device} float32", fontsize=9)
        ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    suffix = "" if device == "cpu" else f"_{device}"
    out = store.with_name(f"model_step_time{suffix}.png")
    fig.savefig(out, dpi=110)
    print(f"<!-- plot written to {out.relative_to(ROOT) if out.is_relative_to(ROOT) else out} -->\n")  # --json may point elsewhere


def section_threads(repeats: int) -> None:
    """eigh and matmul with 1 and with 2 torch threads, interleaved: on a loaded machine LAPACK's
    eigh with more threads than free cores spends its time waiting."""
    import torch

    from benchmarks.common import random_spd

    A = torch.asarray(random_spd((768, 768)), dtype=torch.float32)
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    before = torch.get_num_threads()

    def with_threads(k, fn):
        def run():
            torch.set_num_threads(k)
            fn()
        return run

    fns = {}
    for k in (1, 2):
        fns[f"eigh 768, {k} thread(s)"] = with_threads(k, lambda: torch.linalg.eigh(A))
        fns[f"1024² matmul, {k} thread(s)"] = with_threads(k, lambda: a @ b)
    times = interleaved_medians(fns, 3 * repeats)
    torch.set_num_threads(before)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else math.nan
    print(f"### Threads on a loaded machine (ms, median; load {load:.1f} at the end)\n")
    print("| operation | 1 thread | 2 threads |")
    print("|---|---|---|")
    for op in ("eigh 768", "1024² matmul"):
        print(f"| {op} | {times[f'{op}, 1 thread(s)'] * 1e3:.0f} | {times[f'{op}, 2 thread(s)'] * 1e3:.0f} |")
    print()


def section_bfloat16(repeats: int, sides: tuple = (64, 256, 768)) -> None:
    """A square product in bfloat16 (operands cast from float32, result cast back, as the training
    configuration's products are) against the float32 product, under this process's kernels (run it
    under ``ATEN_CPU_CAPABILITY`` / ``ONEDNN_MAX_CPU_ISA`` to stand in for other CPUs), also with
    oneDNN switched off (torch's own bfloat16 kernel: torch routes bfloat16 products to oneDNN only
    on CPUs with AVX-512, so an AVX2-only CPU runs that one), and what
    ``bfloat16_is_native`` says here: the rule ``FISMO.training`` picks its precision by."""
    import torch

    from fismo_core.backends.torch import bfloat16_is_native, onednn_isa_limit

    fns, gen = {}, torch.Generator().manual_seed(0)
    for n in sides:
        a, b = torch.randn(n, n, generator=gen), torch.randn(n, n, generator=gen)
        fns[f"{n} float32"] = lambda a=a, b=b: a @ b
        fns[f"{n} bfloat16"] = lambda a=a, b=b: (a.bfloat16() @ b.bfloat16()).float()

        def without_onednn(a=a, b=b):  # torch's own bfloat16 kernel, what an AVX2-only CPU gets
            before = torch.backends.mkldnn.enabled  # (its flags() context also sets TF32 and warns)
            torch.backends.mkldnn.enabled = False
            try:
                (a.bfloat16() @ b.bfloat16()).float()
            finally:
                torch.backends.mkldnn.enabled = before
        fns[f"{n} bfloat16, oneDNN off"] = without_onednn
    times = interleaved_medians(fns, 3 * repeats)
    limit = "=".join(onednn_isa_limit() or ("oneDNN's ISA not limited",))
    print(f"### A bfloat16 product against a float32 one (ms, median; torch kernels "
          f"{torch.backends.cpu.get_cpu_capability()}, {limit}; "
          f"bfloat16_is_native('cpu'): {bfloat16_is_native('cpu')})\n")
    print("| side | float32 | bfloat16 (with casts) | bfloat16 / float32 | oneDNN off: bfloat16 / float32 |")
    print("|---|---|---|---|---|")
    for n in sides:
        f32, bf16, own = times[f"{n} float32"], times[f"{n} bfloat16"], times[f"{n} bfloat16, oneDNN off"]
        print(f"| {n} | {f32 * 1e3:.3f} | {bf16 * 1e3:.3f} | {bf16 / f32:.2f} | {own / f32:.2f} |")
    print()


#: The training configuration's approximations whose effect on the direction the "deviation" section
#: measures, as overrides of ``FISMO.training`` (float32 on torch, as the torch optimizer runs it).
TRAINING_DEVIATIONS = {
    "roots every 10 (float32 polar and products)": {},
    "roots every 10, bf16 polar": {"polar": {"dtype": "bfloat16"}},
    "roots every 10, bf16 polar and products (FISMO-T)": {"polar": {"dtype": "bfloat16"},
                                                          "inv_root": {"matmul_dtype": "bfloat16"}},
    "roots every step, bf16 polar": {"polar": {"dtype": "bfloat16"}, "inv_root": {"every": 1}},
    "roots every step, bf16 polar and products": {"polar": {"dtype": "bfloat16"},
                                                  "inv_root": {"every": 1, "matmul_dtype": "bfloat16"}},
}


def training_directions(stream: list, dtype, **overrides) -> list:
    """``FISMO.training(**overrides)``'s direction ``dW_t`` along a gradient stream, in torch ``dtype``."""
    import torch

    opt = FISMO.training(**overrides)
    state = opt.init(torch.zeros(stream[0].shape, dtype=dtype))
    out = []
    for G in stream:
        d, state = opt.direction(torch.from_numpy(G).to(dtype), state)
        out.append(d.double().numpy())
    return out


def section_training_deviation(steps: int, block_size: int = 192) -> None:
    """The training configuration's direction against the exact one (roots every step, float64)
    along a recorded gradient stream: that of ``docs/scripts/block_deviation.py`` (TinyGPT with
    d = 192, GPT-2's matrices / 4, so ``block_size=192`` stands for GPT-2's 768)."""
    import numpy as np
    import torch

    sys.path.insert(0, str(ROOT / "docs" / "scripts"))
    from block_deviation import MATRICES, record_gradients, relative

    grads = record_gradients(steps)
    late = max(1, min(50, steps // 4))
    print(f"### The training configuration's direction against the exact one (B = {block_size}, {steps} steps)\n")
    print(f"| matrix (GPT-2 twin) | configuration | deviation: median | max | median, last {late} steps |")
    print("|---|---|---|---|---|")
    for name, (_, twin) in MATRICES.items():
        stream = grads[name]
        m, n = stream[0].shape
        exact = training_directions(stream, torch.float64, block_size=block_size, inv_root={"every": 1})
        for label, overrides in TRAINING_DEVIATIONS.items():
            dev = relative(training_directions(stream, torch.float32, block_size=block_size, **overrides), exact)
            print(f"| {m}×{n} ({twin}) | {label} | {np.median(dev):.2g} | {dev.max():.2g} "
                  f"| {np.median(dev[-late:]):.2g} |")
    print()


SECTION_OPTIONS = {"deviation": ("steps", "block"),
                   "models": ("model", "names", "device", "tables", "without_torch_muon", "json")}
"""The options that only one section reads (argparse destinations)."""


def main() -> None:
    from _arguments import options_given, output_file, positive_int  # docs/scripts/, on sys.path when the script runs

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=positive_int, default=5)
    parser.add_argument("--only", choices=["memory", "functions", "flops", "batched", "steps", "plot", "models", "threads",
                                           "deviation", "bf16"])
    parser.add_argument("--steps", type=positive_int, default=100, help="deviation section: steps of the gradient stream")
    parser.add_argument("--block", type=positive_int, nargs="+", default=[192, 128],
                        help="deviation section: block sizes (192 and 128 stand for GPT-2's 768 and 512)")
    parser.add_argument("--model", nargs="+", default=PAGE_MODELS, choices=PAGE_MODELS,
                        help="models section: which model sets (default: %(default)s; llama-4096x11008 is the asv "
                             "suite's only)")
    parser.add_argument("--names", nargs="+", default=MODEL_VARIANTS + MODEL_ANCHORS, metavar="NAME",
                        choices=list(dict.fromkeys([*MODEL_VARIANTS, *MODEL_ANCHORS, *VARIANTS])),
                        help="models section: which FISMO variants (benchmarks.common.VARIANTS) and anchors "
                             "(default: all of the page's)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="models section: torch device")
    parser.add_argument("--tables", action="store_true", help="models section: time nothing; print the stored tables and redraw their plot")
    parser.add_argument("--threads", type=positive_int, help="torch.set_num_threads (default: torch's choice)")
    parser.add_argument("--without-torch-muon", action="store_true",
                        help="models section: time torch.optim.Muon not at all (CPUs without bfloat16 instructions)")
    parser.add_argument("--json", type=output_file, help="models section: store the rows in this file (and its plot beside it) "
                        "instead of docs/performance/model_steps.json, e.g. for another CPU")
    args = parser.parse_args()
    if args.only is not None:  # an option of a section that does not run was silently ignored
        for section, dests in SECTION_OPTIONS.items():
            given = options_given(parser, args, dests)
            if given and section != args.only:
                parser.error(f"{', '.join(given)}: for the {section} section, which --only {args.only} does not run")
    store = MODEL_JSON if args.json is None else args.json
    models = args.only in (None, "models")
    if models:
        if args.tables and not store.exists():
            parser.error(f"--tables: {store} does not exist")
        try:
            load_model_results(store)
        except (OSError, ValueError) as error:  # a cut file, not text, unreadable
            parser.error(f"cannot read the stored rows in {store}: {error}")
    import torch

    if models and args.device == "cuda" and not args.tables and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device (torch.cuda.is_available() is False)")
    if args.threads is not None:
        torch.set_num_threads(args.threads)

    print(f"<!-- torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"CPU capability {torch.backends.cpu.get_cpu_capability()} -->\n")
    sections = {
        "memory": lambda: (section_memory(), section_flop_lines()),
        "functions": lambda: section_matrix_functions(args.repeats),
        "flops": lambda: section_flops(args.repeats),
        "batched": lambda: section_batched(args.repeats),
        "steps": lambda: section_steps(args.repeats),
        "plot": lambda: section_plot(args.repeats),
        "threads": lambda: section_threads(args.repeats),
        "deviation": lambda: [section_training_deviation(args.steps, B) for B in args.block],
        "bf16": lambda: section_bfloat16(args.repeats),
        "models": lambda: (section_model_memory(), print_model_tables(args.device, store), plot_models(args.device, store))
        if args.tables else (section_model_memory(), section_models(args.repeats, args.model, args.names, args.device,
                                                                    args.without_torch_muon, store)),
    }
    for name, run in sections.items():
        if args.only == name or (args.only is None and name != "models"):
            run()
    if args.only is None:
        sections["models"]()


if __name__ == "__main__":
    main()
