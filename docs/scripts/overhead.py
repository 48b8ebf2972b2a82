"""The fixed overhead of a FISMO step against torch.optim.Muon's (the documentation page
"Performance", section "Fixed overhead: operations per step"; issue 19, point 2).

1. Aten operations, non-view operations (a GPU's kernel launches) and host reads per
   ``opt.step()``, counted with a ``TorchDispatchMode`` (``OpCounter`` of
   ``asv_benchmarks/benchmarks/bench_overhead.py``) on the 48 weight matrices of GPT-2 small
   (12 layers of 768x2304, 768x768, 768x3072, 3072x768), each side divided by ``--scale``
   (default 16: the count does not depend on the size; ``--scale 1`` counts the full size).
   The first step (which creates the state) is counted apart from the second (the steady step).
2. Where FISMO's operations come from: each op is attributed to the innermost function of the
   core or the adapter that called it, grouped by phase of the step (``PHASES``), and the
   busiest call sites (file:line) are listed.
3. ``opt.step`` on the demo's byte-level GPT (2 layers, d = 64, 8 matrices of 64 to 256), eager and
   ``torch.compile(opt.step)`` (inductor, CPU), against torch.optim.Muon's, medians of interleaved
   repeats in one run; with the graphs, graph breaks and recompiles of each compiled step. A
   compiled step that fails is reported, not raised. Then torch's profiler says where the eager
   step's time goes.

    python docs/scripts/overhead.py                       # everything (about 2 minutes, most of it compiling)
    python docs/scripts/overhead.py --no-gpt              # the counts only (seconds)
    python docs/scripts/overhead.py --no-gpt --verify-scale 1   # and again at GPT-2's full size, compared (long)
    python docs/scripts/overhead.py --no-compile          # the small GPT eager only
    python docs/scripts/overhead.py --training-step --threads 1   # 4. only (about 5 minutes)

4. (``--training-step``) The whole training step (forward, backward and ``opt.step``) of the demo's
   text GPT (``TextTask``: d = 64, 2 layers) and of the scaling study's sizes (d = 32 with 2
   layers, 64 with 4, 128 with 5), the training configuration ``FISMO.training`` against
   ``torch.optim.Muon``, both at their defaults with ``torch.optim.AdamW`` on the rest, and their
   float32 twins (the polar and the products in float32; Muon as ``FISMO.training(gamma=1)``); the whole
   step and ``opt.step`` alone, medians of interleaved 10-step cycles in one process
   (``training_step_times`` of ``asv_benchmarks/benchmarks/bench_overhead.py``).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import Counter, defaultdict
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "asv_benchmarks"))

import torch  # noqa: E402

from benchmarks.bench_overhead import (  # noqa: E402
    CONFIG_LABELS,
    COUNT_SCALE,
    GPT2_LAYER,
    GPT2_LAYERS,
    GPT_CONFIGS,
    OVERHEAD_CONFIGS,
    OpCounter,
    count_steps,
    small_gpt_optimizer,
    small_gpt_times,
    TRAINING_STEP_SIZES,
    training_step_times,
)

#: Phases of a step by the function of the core or the adapter that dispatched the op: the
#: innermost such function named here decides (``(file, function)``; helpers not named here, such
#: as kronecker's ``_combine``, count for the named function that called them).
PHASES: dict[tuple[str, str], str] = {
    ("linalg.py", "polar"): "polar factor, line 8",
    ("linalg.py", "inverse_sqrt"): "inverse roots, lines 4–5",
    ("linalg.py", "_eigh_inverse_sqrt"): "inverse roots, lines 4–5",
    ("guards.py", "guarded_inverse_sqrt"): "root checks: residuals, fallback",
    ("guards.py", "_checked_root"): "root checks: residuals, fallback",
    ("guards.py", "_matrix_ok"): "root checks: residuals, fallback",
    ("guards.py", "root_failure_counts"): "root-failure counters",
    ("guards.py", "read_faults"): "the step's read of the fault flags",
    ("guards.py", "statistics_scale"): "statistics scale (power of two)",
    ("guards.py", "check_finite"): "core's non-finite checks",
    ("guards.py", "skip_mask"): "core's non-finite checks",
    ("guards.py", "restore_skipped"): "core's non-finite checks",
    ("kronecker.py", "update"): "statistics: Gram, EMA, damping, trace, lines 4–5",
    ("kronecker.py", "left"): "products with the roots, lines 4–6 and 8",
    ("kronecker.py", "right"): "products with the roots, lines 4–6 and 8",
    ("optimizer.py", "_algorithm_1"): "momentum (line 7) and the rest of _algorithm_1",
    ("optimizer.py", "_guarded_step"): "gradient copy into the state (core entry)",
    ("optimizer.py", "direction"): "core's argument checks",
    ("optimizer.py", "_check_call"): "core's argument checks",
    ("_torch_state.py", "check_grads"): "adapter's gradient checks (nonfinite)",
    ("_torch_state.py", "_check_finite_grads"): "adapter's gradient checks (nonfinite)",
    ("_torch_state.py", "_finiteness_flags"): "adapter's gradient checks (nonfinite)",
    ("_torch_state.py", "_decide"): "adapter's gradient checks (nonfinite)",
    ("_torch_state.py", "raise_nonfinite"): "adapter's gradient checks (nonfinite)",
    ("_torch_state.py", "faults"): "adapter's gradient checks (nonfinite)",
    ("_torch_state.py", "pack"): "packing the states (torch.stack)",
    ("_torch_state.py", "unpack"): "unpacking (copy_ into each parameter's state)",
    ("_torch_state.py", "init_matrix_state"): "state creation",
    ("torch.py", "_apply"): "line 9 (parameter update)",
    ("torch.py", "_apply_shard"): "line 9 (parameter update)",
    ("torch.py", "_directions"): "adapter glue: gradient stack, D[i], step counters",
    ("torch.py", "_fismo_compute"): "adapter glue: gradient stack, D[i], step counters",
    ("torch.py", "_roots_due_read_on_the_host"): "adapter glue: gradient stack, D[i], step counters",
    ("torch.py", "_fismo_apply"): "adapter glue: gradient stack, D[i], step counters",
    ("torch.py", "_settle"): "the step's read of the fault flags",
}
NO_PROJECT_FRAME = "torch.optim's step wrapper (profiler markers)"


def project_frames(stack: tuple[str, ...]) -> list[tuple[str, str, str]]:
    """``(file, line, function)`` of the frames of ``stack`` in fismo's core or adapter, innermost first."""
    frames = []
    for entry in reversed(stack):
        location, function = entry.rsplit(" ", 1)
        path, line = location.rsplit(":", 1)
        parts = Path(path).parts
        if len(parts) >= 2 and parts[-2] in ("fismo_core", "backends"):
            frames.append((f"{parts[-2]}/{parts[-1]}", line, function))
    return frames


def phase_of(stack: tuple[str, ...]) -> str:
    frames = project_frames(stack)
    for path, _line, function in frames:
        phase = PHASES.get((Path(path).name, function))
        if phase is not None:
            return phase
    if not frames:
        return NO_PROJECT_FRAME
    path, _line, function = next((f for f in frames if not f[2].startswith("<")), frames[0])  # not <listcomp>
    return f"unmapped: {path} {function}"


def site_of(stack: tuple[str, ...]) -> str:
    frames = project_frames(stack)
    if not frames:
        return NO_PROJECT_FRAME
    path, line, function = frames[0]
    return f"{path}:{line} {function}"


def table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def short_op(name: str) -> str:
    """``aten.mm.default`` -> ``mm``."""
    parts = name.split(".")
    return parts[1] if len(parts) > 2 else name


def phase_counts(counter) -> dict[str, Counter]:
    """Per phase (`phase_of`): aten ops, non-view ops and host reads of a counter that recorded stacks."""
    phases: dict[str, Counter] = defaultdict(Counter)
    for (name, stack), count in counter.stacks.items():
        phases[phase_of(stack)]["ops"] += count
        phases[phase_of(stack)]["non-view"] += 0 if counter.is_view(name) else count
    for read in counter.host_reads:
        phases[phase_of(read.stack)]["host reads"] += 1
    return phases


def split(many: float, few: float, layers: int, few_layers: int) -> tuple[float, float]:
    """``(per bucket, per matrix)`` of a count that is ``4 f + 4 L g`` at ``L`` layers (4 shape buckets, 4 L matrices)."""
    g = (many - few) / (4 * (layers - few_layers))
    return (few - 4 * few_layers * g) / 4, g


def counts_section(
    configs: list[str], scale: int, layers: int, breakdown: list[str], top: int, verify_scale: Optional[int]
) -> None:
    shapes = f"{layers * 4} GPT-2-small matrices" + (f", every side / {scale}" if scale > 1 else ", full size")
    print(f"## Operations per step ({shapes}; torch {torch.__version__}, CPU)\n")
    results = {config: count_steps(config, scale=scale, layers=layers, stacks=config in breakdown) for config in configs}
    muon = results["muon"][1]
    rows = []
    for config, (first, later) in results.items():
        rows.append([
            CONFIG_LABELS[config], later.total, f"{later.total / muon.total:.2f}", later.kernels,
            f"{later.kernels / muon.kernels:.2f}", len(later.host_reads), later.syncing_linalg, first.total,
            len(first.host_reads),
        ])
    print(table(
        ["optimizer", "aten ops", "/ Muon", "non-view ops", "/ Muon", "host reads", "eigh calls",
         "first step: aten ops", "first step: host reads"],
        rows,
    ))
    print("\n(a step after the first; the first step also creates the state. eigh synchronises a CUDA device "
          "with the CPU, per torch's documentation; it is not counted among the host reads.)\n")

    if verify_scale is not None:
        print(f"Counted again with every side / {verify_scale} (aten ops by name and host reads, both steps):\n")
        rows = []
        for config, counters in results.items():
            again = count_steps(config, scale=verify_scale, layers=layers)
            same = all(a.ops == b.ops and len(a.host_reads) == len(b.host_reads) for a, b in zip(counters, again))
            rows.append([CONFIG_LABELS[config], again[0].total, again[1].total, len(again[1].host_reads),
                         "yes" if same else "NO"])
        print(table(["optimizer", "first step", "steady step", "host reads", f"same as / {scale}?"], rows))
        print()

    few = 2  # layers of the second count: from 2 matrices per bucket on, every count is affine in the layers
    if layers > few:
        print(f"Per shape bucket and per matrix: a step over L layers counts 4 f + 4 L g (4 shapes, 4 L matrices); "
              f"f and g from L = {few} and L = {layers}, then the matrices per shape at which the ratio to Muon "
              "is 1.5 (aten ops):\n")
        rows = []
        for config, (_, later) in results.items():
            small = count_steps(config, scale=scale, layers=few)[1]
            f_ops, g_ops = split(later.total, small.total, layers, few)
            f_kern, g_kern = split(later.kernels, small.kernels, layers, few)
            rows.append([CONFIG_LABELS[config], f"{f_ops:g}", f"{g_ops:g}", f"{f_kern:g}", f"{g_kern:g}"])
        m_f, m_g = split(muon.total, count_steps("muon", scale=scale, layers=few)[1].total, layers, few)
        for row in rows:
            f, g = float(row[1]), float(row[2])
            # 4 f + 4 L g <= 1.5 (4 m_f + 4 L m_g)  <=>  L >= (f - 1.5 m_f) / (1.5 m_g - g)
            need = (f - 1.5 * m_f) / (1.5 * m_g - g) if 1.5 * m_g > g else float("inf")
            row.append("—" if row[0] == CONFIG_LABELS["muon"] else f"{max(need, 0):.1f}")
        print(table(["optimizer", "aten ops per bucket", "per matrix", "non-view per bucket", "per matrix",
                     "matrices per shape for 1.5x Muon"], rows))
        print()

    for config, (_, later) in results.items():
        if not later.host_reads:
            continue
        print(f"Host reads of {CONFIG_LABELS[config]}, by call site:\n")
        by_site = Counter((r.site, r.op) for r in later.host_reads)
        print(table(["call site", "op", "reads"], [[s, op, c] for (s, op), c in by_site.most_common()]))
        print()

    for config in breakdown:
        later = results[config][1]
        phases = phase_counts(later)
        small = phase_counts(count_steps(config, scale=scale, layers=few, stacks=True)[1]) if layers > few else {}
        print(f"### Where the operations of {CONFIG_LABELS[config]} come from ({later.total} per step)\n")
        rows = []
        for phase, c in sorted(phases.items(), key=lambda kv: -kv[1]["ops"]):
            row = [phase, c["ops"], c["non-view"], c["host reads"]]
            if small:
                f, g = split(c["ops"], small.get(phase, Counter())["ops"], layers, few)
                row += [f"{f:g}", f"{g:g}"]
            rows.append(row)
        header = ["phase", "aten ops", "non-view", "host reads"] + (["per bucket", "per matrix"] if small else [])
        print(table(header, rows))
        sites: dict[str, Counter] = defaultdict(Counter)
        for (name, stack), count in later.stacks.items():
            sites[site_of(stack)][name] += count
        print(f"\nBusiest call sites (innermost frame in fismo_core/ or backends/; top {top}):\n")
        rows = []
        for site, ops in sorted(sites.items(), key=lambda kv: -sum(kv[1].values()))[:top]:
            kernels = sum(count for name, count in ops.items() if not later.is_view(name))
            main = ", ".join(f"{short_op(name)} {count}" for name, count in ops.most_common(4))
            rows.append([site, sum(ops.values()), kernels, main])
        print(table(["call site", "aten ops", "non-view", "ops"], rows))
        print()


def gpt_section(configs: list[str], compiled: bool, repeats: int, mode: Optional[str] = None) -> None:
    print(f"## opt.step on the small GPT (8 matrices, 64 to 256; CPU, {torch.get_num_threads()} threads, "
          f"medians of {repeats} interleaved repeats; torch.compile mode {mode or 'default'})\n")
    ops = {}
    for name in ["muon", *configs]:
        opt = small_gpt_optimizer(name)
        opt.step()
        with OpCounter() as counter:
            opt.step()
        ops[name] = counter
    medians, compiled_steps = small_gpt_times(configs, compiled=compiled, repeats=repeats, mode=mode)
    muon_eager, muon_compiled = medians["muon"], medians.get("muon compiled")
    rows = []
    for name in ["muon", *configs]:
        eager = medians[name]
        row = [CONFIG_LABELS.get(name, name), ops[name].total, f"{ops[name].total / ops['muon'].total:.2f}",
               len(ops[name].host_reads), f"{eager * 1e3:.2f}", f"{eager / muon_eager:.2f}"]
        if compiled:
            c = compiled_steps[name]
            if c.step is None:
                row += ["failed", "—", "—", "—", "—", "—", "—"]
            else:
                t = medians[f"{name} compiled"]
                ratio = f"{t / muon_compiled:.2f}" if muon_compiled else "—"
                row += [f"{t * 1e3:.2f}", ratio, f"{t / eager:.2f}", c.warmup["graphs"], c.warmup["graph_breaks"],
                        f"{c.warmup['recompile_limit']} / {c.steady_graphs}", f"{c.compile_seconds:.1f}"]
        rows.append(row)
    header = ["optimizer", "aten ops", "/ Muon", "host reads", "eager (ms)", "/ Muon eager"]
    if compiled:
        header += ["compiled (ms)", "/ Muon compiled", "compiled / eager", "graphs", "graph breaks",
                   "recompile-limit hits / steady recompiles", "first call (s)"]
    print(table(header, rows))
    if compiled:
        print("\n(graphs, graph breaks, recompile-limit hits: in the first two compiled steps (FISMO's states are "
              "created while the first is traced); steady recompiles: graphs compiled in steps 3 to 13, a refresh of roots every 10 steps among them.)")
        for name, c in compiled_steps.items():
            if c.error:
                print(f"\n{CONFIG_LABELS.get(name, name)}: torch.compile(opt.step) failed: {c.error}")
            elif c.break_reasons:
                print(f"\n{CONFIG_LABELS.get(name, name)}: graph breaks by reason (first line of dynamo's message):")
                for reason, count in c.break_reasons:
                    print(f"  {count:4d}  {reason}")
    print()


def profile_section(configs: list[str], steps: int = 20, top: int = 4) -> None:
    """Where the small GPT's eager step spends its time: torch's profiler, self CPU time per step."""
    from torch.profiler import ProfilerActivity, profile

    print(f"## Where the small GPT's eager step spends its time (torch.profiler, {steps} steps, "
          f"{torch.get_num_threads()} threads; ms per step)\n")
    rows = []
    for name in ["muon", *configs]:
        opt = small_gpt_optimizer(name)
        opt.step()
        opt.step()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(steps):
                opt.step()
        events = prof.key_averages()
        total = sum(e.self_cpu_time_total for e in events) / steps / 1e3
        # the step's own record_function: its self time is Python and dispatch outside every aten op
        own = sum(e.self_cpu_time_total for e in events if e.key.startswith("Optimizer.step#")) / steps / 1e3
        ops = sorted((e for e in events if e.key.startswith("aten::")), key=lambda e: -e.self_cpu_time_total)[:top]
        busiest = ", ".join(f"{e.key[6:]} {e.self_cpu_time_total / steps / 1e3:.2f} ({e.count / steps:g})" for e in ops)
        rows.append([CONFIG_LABELS.get(name, name), f"{total:.2f}", f"{own:.2f}", busiest])
    print(table(["optimizer", "step", "outside aten ops (Python)", f"busiest aten ops (calls per step), top {top}"],
                rows))
    print()


def training_step_section(repeats: int) -> None:
    """The whole training step of the text GPT at each size, the training configuration against Muon."""
    print(f"## The training step of the text GPT: FISMO.training against torch.optim.Muon (CPU, "
          f"{torch.get_num_threads()} thread(s), medians of {repeats} interleaved 10-step cycles; ms per step)\n")
    rows = []
    for dim, layers in TRAINING_STEP_SIZES:
        t = training_step_times(dim, layers, repeats)
        rows.append([
            f"d = {dim}, {layers} layers", f"{t['muon whole'] * 1e3:.1f}", f"{t['fismo-t whole'] * 1e3:.1f}",
            f"**{t['fismo-t whole'] / t['muon whole']:.2f}**", f"{t['muon step'] * 1e3:.2f}",
            f"{t['fismo-t step'] * 1e3:.2f}", f"{t['fismo-t step'] / t['muon step']:.2f}",
            f"{t['fismo-t-fp32 whole'] / t['muon-fp32 whole']:.2f}", f"{t['fismo-t-fp32 step'] / t['muon-fp32 step']:.2f}",
        ])
        print(f"<!-- d = {dim}, {layers} layers done, load {os.getloadavg()[0]:.1f} -->", flush=True)
    print(table(["model", "Muon: whole step", "FISMO-T: whole step", "whole step / Muon", "Muon: opt.step",
                 "FISMO-T: opt.step", "opt.step / Muon", "float32 twins: whole step", "float32 twins: opt.step"],
                rows))
    print()


def scale_error(option: str, scale: int, configs: list[str]) -> Optional[str]:
    """Why ``scale`` cannot divide GPT-2's sides and the block sizes of ``configs`` (``gpt2_shapes`` and
    ``make_optimizer`` of ``bench_overhead`` need both), or None."""
    sides = {side for shape in GPT2_LAYER for side in shape}
    sides |= {kwargs["block_size"] for kwargs in map(OVERHEAD_CONFIGS.get, configs) if kwargs and "block_size" in kwargs}
    if all(side % scale == 0 for side in sides):
        return None
    return f"{option} {scale} must divide GPT-2's sides and the block sizes counted ({', '.join(map(str, sorted(sides)))})"


def main() -> None:
    from _arguments import positive_int  # docs/scripts/, on sys.path when the script runs

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="+", default=list(OVERHEAD_CONFIGS), choices=list(OVERHEAD_CONFIGS),
                        help="configurations to count (default: all)")
    parser.add_argument("--scale", type=positive_int, default=COUNT_SCALE, help="divide every side by this (1: full size)")
    parser.add_argument("--layers", type=positive_int, default=GPT2_LAYERS, help="GPT-2 layers (4 matrices each)")
    parser.add_argument("--breakdown", nargs="*", choices=list(OVERHEAD_CONFIGS), metavar="CONFIG",
                        help="configurations among --configs whose operations are broken down by phase and call site "
                             "(default: propagate and default, where counted)")
    parser.add_argument("--top", type=positive_int, default=15, help="call sites listed per breakdown")
    parser.add_argument("--no-gpt", action="store_true", help="skip the small-GPT timings")
    parser.add_argument("--no-compile", action="store_true", help="time the small GPT eagerly only")
    parser.add_argument("--gpt-configs", nargs="+", default=GPT_CONFIGS, choices=GPT_CONFIGS)
    parser.add_argument("--repeats", type=positive_int, default=21, help="interleaved repeats of the small-GPT timings")
    parser.add_argument("--verify-scale", type=positive_int, default=None,
                        help="count again with sides divided by this (1: GPT-2's full size) and compare")
    parser.add_argument("--threads", type=positive_int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--compile-mode", default=None, choices=["default", "lite"],
                        help="torch.compile's mode for the small GPT ('lite': inductor calls ATen for every op)")
    parser.add_argument("--training-step", action="store_true",
                        help="only the whole training step of the text GPT, FISMO.training against Muon (4.)")
    args = parser.parse_args()
    configs = list(dict.fromkeys(["muon", *args.configs]))
    if args.breakdown is None:
        breakdown = [c for c in ("propagate", "default") if c in configs]
    else:
        breakdown = args.breakdown
        missing = [c for c in breakdown if c not in configs]
        if missing:
            parser.error(f"--breakdown {' '.join(missing)}: not counted; add it to --configs ({' '.join(configs)})")
    for option, scale in (("--scale", args.scale), ("--verify-scale", args.verify_scale)):
        error = scale_error(option, scale, configs) if scale is not None else None
        if error:
            parser.error(error)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.training_step:
        training_step_section(max(3, args.repeats // 2))
        return
    os.chdir(ROOT)  # call sites relative to the repository
    counts_section(configs, args.scale, args.layers, breakdown, args.top, args.verify_scale)
    if not args.no_gpt:
        gpt_section(args.gpt_configs, not args.no_compile, args.repeats, args.compile_mode)
        profile_section(args.gpt_configs)


if __name__ == "__main__":
    main()
