"""``fismo demo``: the pieces (data, models, optimizers, schedule, measurements) and small end-to-end runs.

The end-to-end checks share one run of the ``tiny`` preset (every optimizer
and control of the main job, both tasks, 2 seeds, 40 digits steps and 16
steps of a narrower GPT, grids extended where their winner is on an edge;
about 20 CPU-seconds in one process), instead of ``--quick --steps 40`` (the
whole file took 154 CPU-seconds then). A second run of the same preset in
two worker processes checks that the results are identical to the last bit;
the command line is exercised by a 4-step run of one optimizer. The grid
extension rule is also checked on fake runs whose loss is known.
"""

from __future__ import annotations

import builtins
import contextlib
import csv
import io
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("sklearn")
pytest.importorskip("matplotlib")
pytest.importorskip("tqdm")

import fismo_core.demo as demo  # noqa: E402
from fismo_core.cli import main as cli_main  # noqa: E402
from fismo_core.demo import default_config  # noqa: E402
from fismo_core.demo.data import load_stdlib_corpus  # noqa: E402
from fismo_core.demo.models import DigitsCNN, MatrixConv2d, TinyGPT  # noqa: E402
from fismo_core.demo.optimizers import (  # noqa: E402
    ALL_OPTIMIZERS,
    MUON_CONTROLS,
    TRAINING_ABLATIONS,
    build_optimizer,
    control_base,
    control_change,
    soap_available,
)
from fismo_core.demo.report import (  # noqa: E402
    digest,
    digest_key,
    extension_note,
    summarise,
    summary_table,
    sweep_table,
    write_report,
)
from fismo_core.demo.run import _blocks_supported, beyond_edge, run_demo, run_many  # noqa: E402
from fismo_core.demo.tasks import DigitsTask  # noqa: E402
from fismo_core.demo.train import (  # noqa: E402
    History,
    RunResult,
    RunSpec,
    _diagonal_blocks,
    _identity_distance,
    _sym_condition,
    lr_factor,
    train,
)

ROOT = Path(__file__).resolve().parents[1]
BLOCKS = _blocks_supported()
KINDS = ("loss", "condition", "preconditioner", *(("blocks",) if BLOCKS else ()))
PNGS = [f"{task}_{kind}.png" for task in ("digits", "text") for kind in KINDS]


# ------------------------------------------------------------------ pieces
def test_schedule_warms_up_then_decays_to_ten_percent() -> None:
    steps, warmup = 100, 5
    factors = [lr_factor(s, steps, warmup) for s in range(steps)]
    assert factors[:warmup] == [0.2, 0.4, 0.6, 0.8, 1.0]
    assert factors[warmup] == 1.0
    assert all(a >= b for a, b in zip(factors[warmup:], factors[warmup + 1 :]))
    assert factors[-1] == pytest.approx(0.1, abs=1e-12)  # cosine ends at exactly 10 %; 1e-12: rounding


def test_stdlib_corpus_is_split_by_file() -> None:
    corpus = load_stdlib_corpus(200_000, 50_000)
    assert not set(corpus.train_files) & set(corpus.val_files)
    assert len(corpus.train) == 200_000 and len(corpus.val) == 50_000  # the stdlib has megabytes
    again = load_stdlib_corpus(200_000, 50_000)
    assert torch.equal(corpus.train, again.train) and corpus.val_files == again.val_files


def test_matrix_conv_is_a_conv2d() -> None:
    torch.manual_seed(0)
    conv = MatrixConv2d(3, 5, 3)
    reference = torch.nn.Conv2d(3, 5, 3, padding=1)
    with torch.no_grad():
        reference.weight.copy_(conv.weight.view(5, 3, 3, 3))
        reference.bias.copy_(conv.bias)
    x = torch.randn(2, 3, 8, 8)
    # Same float32 convolution by two call paths; measured 0, bound 1e-6 (float32 rounding of 27-term sums).
    assert torch.allclose(conv(x), reference(x), atol=1e-6, rtol=0)
    assert conv.weight.ndim == 2


def test_presets() -> None:
    default, quick, tiny = (default_config(preset=p) for p in ("default", "quick", "tiny"))
    assert default_config(True) == quick and default_config() == default
    assert [p.steps for p in default.plans] == [400, 300] and default.seeds == 3
    assert (default.preset, quick.preset, tiny.preset) == ("default", "quick", "tiny") and quick.quick
    for config in (default, quick, tiny):
        for plan in config.plans:
            assert plan.warmup == max(1, plan.steps // 20)  # 5 % of the steps in every preset
            assert set(plan.lrs) == set(ALL_OPTIMIZERS)
            # every block size splits the task's longest matrix side (digits 144, text 4 * dim)
            longest = 144 if plan.task.name == "digits" else 4 * plan.task.dim
            assert plan.block_sizes and all(b < longest for b in plan.block_sizes)
            assert "FISMO-bf16" in plan.fismo_controls
            assert f"FISMO-T-B{plan.block_sizes[0]}" in plan.fismo_controls  # blocked FISMO-T on both tasks
            # FISMO-T's one-setting ablations on the text task only
            assert set(TRAINING_ABLATIONS) <= set(plan.fismo_controls) if plan.task.name == "text" else \
                not set(TRAINING_ABLATIONS) & set(plan.fismo_controls)
        assert config.grid_extensions == 2
    for plan in default.plans:  # three values per grid before any extension
        assert all(len(grid) == 3 for grid in plan.lrs.values())
    assert all(len(grid) == 2 for plan in tiny.plans for grid in plan.lrs.values())
    assert default_config(preset="tiny", steps=10).plans[0].steps == 10
    with pytest.raises(ValueError, match="unknown preset"):
        default_config(preset="huge")
    with pytest.raises(ValueError, match="contradicts"):
        default_config(True, preset="tiny")


@pytest.mark.parametrize("model", [DigitsCNN(), TinyGPT(layers=1)], ids=["cnn", "gpt"])
def test_matrix_optimizers_share_one_split(model: torch.nn.Module) -> None:
    """FISMO, Muon and every control optimise the same hidden matrices; embeddings, head and 1-D go to AdamW."""
    names = {id(p): n for n, p in model.named_parameters()}
    sets = {}
    controls = ["FISMO-bf16", *TRAINING_ABLATIONS, *(["FISMO-B32", "FISMO-SI-B16", "FISMO-T-B16"] if BLOCKS else [])]
    for name in ("FISMO", "FISMO-SI", "FISMO-T", "Muon", "Muon-torch", "Muon-NS7", "Muon-fp32", "AdamW", *controls):
        built = build_optimizer(name, model, 0.01, 1e-3)
        sets[name] = sorted(names[id(p)] for p in built.matrices)
    assert len({tuple(s) for s in sets.values()}) == 1
    matrices = sets["FISMO"]
    assert matrices and all(not n.startswith(("head", "tok", "pos")) for n in matrices)
    assert all(dict(model.named_parameters())[n].ndim == 2 for n in matrices)
    group = build_optimizer("Muon-fp32", model, 0.01, 1e-3).optimizers[0].param_groups[0]
    assert group["gamma"] == 1.0
    assert build_optimizer("FISMO-SI", model, 0.01, 1e-3).fismo.param_groups[0]["statistics"] == "scale_invariant"
    bf16 = build_optimizer("FISMO-bf16", model, 0.01, 1e-3).fismo.param_groups[0]
    assert getattr(bf16["polar"], "dtype", None) == "bfloat16" or bf16["polar"].get("dtype") == "bfloat16"
    if BLOCKS:
        si = build_optimizer("FISMO-SI-B16", model, 0.01, 1e-3).fismo.param_groups[0]
        assert si["block_size"] == 16 and si["statistics"] == "scale_invariant"
    for bad in ("Adam", "FISMO-B0", "FISMO-B", "Muon-B32", "FISMO-fp16", "FISMO-bf16-B32", "FISMO-T-bf16",
                "FISMO-printed", "FISMO-SI-no-wd", "FISMO-T-no-WD", "FISMO-T-every3", "FISMO-T-no-wd-B32",
                "Muon-torch-B32", "FISMO-TB32"):
        with pytest.raises(ValueError, match="unknown optimizer"):
            build_optimizer(bad, model, 0.01, 1e-3)


def test_control_base() -> None:
    assert [control_base(c) for c in MUON_CONTROLS] == ["Muon", "Muon"]
    assert control_base("FISMO-B32") == control_base("FISMO-bf16") == control_base("FISMO-B8-bf16") == "FISMO"
    assert control_base("FISMO-SI-B64") == "FISMO-SI"
    assert {control_base(c) for c in (*TRAINING_ABLATIONS, "FISMO-T-B32", "FISMO-T-B16-no-wd")} == {"FISMO-T"}
    for name in ("FISMO", "FISMO-T", "Muon", "Muon-torch", "AdamW", "SOAP-B32", "FISMO-T-bf16"):
        with pytest.raises(ValueError, match="not a control"):
            control_base(name)
    assert control_change("FISMO-T-B16-no-wd") == {"block_size": 16, "weight_decay": 0.0}


def _group_settings(optimizer: torch.optim.Optimizer) -> list[dict]:
    """Every param group of ``optimizer`` without its parameters."""
    return [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]


def _field(config: object, name: str) -> object:
    """A field of a ``polar``/``inv_root`` setting, stored as a dict or as a config object."""
    return config[name] if isinstance(config, dict) else getattr(config, name)


def test_training_configuration_and_torch_muon_are_built_at_torch_defaults() -> None:
    """FISMO-T is ``FISMO.training(groups, lr=lr)``, Muon-torch ``torch.optim.Muon(matrices, lr=lr)``.

    Both at torch.optim.Muon's defaults but the lr (Nesterov, weight decay 0.1, momentum 0.95, lr adjustment
    "original"), FISMO-T with the training settings (scale-invariant statistics, roots every 10 steps,
    Newton-Schulz and the products in bfloat16 where bfloat16 is native), both with the AdamW part of FISMO
    and Muon (same parameters, same settings).
    """
    from fismo_core.backends.torch import bfloat16_is_native

    model = TinyGPT(layers=1)
    fismo_t = build_optimizer("FISMO-T", model, 0.02, 3e-3)
    matrices, adamw = _group_settings(fismo_t.fismo)
    assert matrices["lr"] == 0.02 and matrices["statistics"] == "scale_invariant" and matrices["beta"] == 0.95
    assert matrices["nesterov"] is True and matrices["weight_decay"] == 0.1 and matrices["adjust_lr_fn"] == "original"
    low = "bfloat16" if bfloat16_is_native("cpu") else None  # the adapter's rule, tested in test_training_config
    assert _field(matrices["polar"], "dtype") == _field(matrices["inv_root"], "matmul_dtype") == low
    assert _field(matrices["inv_root"], "every") == 10
    assert adamw == _group_settings(build_optimizer("FISMO", model, 0.02, 3e-3).fismo)[1]
    assert adamw["lr"] == 3e-3 and adamw["weight_decay"] == 0.0

    muon_torch = build_optimizer("Muon-torch", model, 0.02, 3e-3)
    reference = torch.optim.Muon([torch.nn.Parameter(torch.zeros(4, 4))], lr=0.02).defaults
    muon_group = _group_settings(muon_torch.optimizers[0])[0]
    assert {k: muon_group[k] for k in reference} == reference
    assert muon_group["nesterov"] is True and muon_group["weight_decay"] == 0.1 and muon_group["adjust_lr_fn"] is None
    muon_adamw = build_optimizer("Muon", model, 0.02, 3e-3).optimizers[1]
    assert _group_settings(muon_torch.optimizers[1]) == _group_settings(muon_adamw)
    assert [id(p) for p in muon_torch.optimizers[1].param_groups[0]["params"]] == \
        [id(p) for p in fismo_t.fismo.param_groups[1]["params"]]


@pytest.mark.parametrize(
    ("control", "key", "value"),
    [("FISMO-T-printed", "statistics", "printed"), ("FISMO-T-no-nesterov", "nesterov", False),
     ("FISMO-T-no-wd", "weight_decay", 0.0), ("FISMO-T-every1", "inv_root", 1), ("FISMO-T-B16", "block_size", 16),
     ("FISMO-T-mu1e-3", "mu", 1e-3), ("FISMO-T-fp32mm", "inv_root", "float32"),
     # docs/scripts/root_staleness.py's controls
     ("FISMO-T-every2", "inv_root", 2), ("FISMO-T-every5", "inv_root", 5), ("FISMO-T-mu1e-2", "mu", 1e-2)],
)
def test_training_controls_change_one_setting(control: str, key: str, value: object) -> None:
    """Each control of FISMO-T differs from FISMO-T in the one setting its name says, and in nothing else."""
    model = TinyGPT(layers=1)
    if key == "block_size" and not BLOCKS:
        pytest.skip("the torch adapter has no block_size option yet")
    base = _group_settings(build_optimizer("FISMO-T", model, 0.02, 3e-3).fismo)
    changed = _group_settings(build_optimizer(control, model, 0.02, 3e-3).fismo)
    assert base[1] == changed[1]  # the AdamW group
    differing = {k for k in base[0] if base[0][k] != changed[0][k]}
    assert differing == {key}
    if key == "inv_root":  # the one field of the config that changes
        field = "matmul_dtype" if isinstance(value, str) else "every"
        assert _field(changed[0][key], field) == value
        fields = ("every", "matmul_dtype")
        assert {**{name: _field(base[0][key], name) for name in fields}, field: value} == {
            name: _field(changed[0][key], name) for name in fields}
    else:
        assert changed[0][key] == value


def test_blocked_measurements_match_the_dense_matrix() -> None:
    """cond and distance from I computed from diagonal blocks equal those of the dense block-diagonal matrix."""
    g = torch.Generator().manual_seed(0)

    def spd(d: int) -> torch.Tensor:
        X = torch.randn(d, 2 * d, generator=g, dtype=torch.float64)
        return X @ X.T / (2 * d) + 0.1 * torch.eye(d, dtype=torch.float64)

    full, rest = torch.stack([spd(4) for _ in range(3)]), spd(2)
    blocks = _diagonal_blocks({"P": full, "P_rest": rest}, "P")
    assert [b.shape for b in blocks] == [(4, 4)] * 3 + [(2, 2)]
    dense = torch.block_diag(*blocks)
    e = torch.linalg.eigvalsh(dense)
    # Same eigenvalues, from four small eigh calls instead of one: 1e-12 relative (float64 rounding).
    assert _sym_condition(blocks) == pytest.approx((e[-1] / e[0]).item(), rel=1e-12)
    distance = (torch.linalg.matrix_norm(dense - torch.eye(14, dtype=torch.float64)) / math.sqrt(14)).item()
    assert _identity_distance(blocks) == pytest.approx(distance, rel=1e-12)
    # a full factor is its own single block
    assert _sym_condition(_diagonal_blocks({"Q": dense}, "Q")) == pytest.approx(_sym_condition(blocks), rel=1e-12)


@pytest.mark.skipif(not BLOCKS, reason="the torch adapter has no block_size option yet")
def test_blocked_control_keeps_blocks_in_its_state() -> None:
    """FISMO-B32 on the CNN: the 144 side in 4 blocks of 32 and a remainder of 16, the 16 side one block."""
    torch.manual_seed(0)
    model = DigitsCNN()
    built = build_optimizer("FISMO-B32", model, 0.01, 1e-3)
    model(torch.randn(4, 1, 8, 8)).sum().backward()
    built.step()
    sizes = {tuple(p.shape): [b.shape[-1] for b in _diagonal_blocks(built.fismo.state[p], "Q")]
             for p in built.matrices}
    assert sizes[(16, 9)] == [9] and sizes[(32, 144)] == [32, 32, 32, 32, 16] and sizes[(64, 128)] == [32] * 4


def test_fismo_run_records_preconditioners() -> None:
    task = DigitsTask()
    spec = RunSpec(task, "FISMO-SI", 0.01, seed=0, steps=12, adamw_lr=3e-3, eval_every=4, measure_every=4, warmup=2)
    result = train(spec)
    h = result.history
    assert h.eval_step == [0, 4, 8, 12] and h.measure_step == [1, 4, 8, 12]
    assert len(h.cond_P) == len(h.kappa) == len(h.grad_rms) == 4
    assert all(c >= 1 for c in h.cond_P + h.cond_Q)  # condition numbers of SPD matrices
    assert h.P_dev[-1] > 0.1  # the scale-invariant statistics move P at once (the printed ones do not)
    assert 0 < result.cpu_seconds and 0 < result.seconds


def test_a_run_whose_roots_fail_stops_and_is_marked_diverged(monkeypatch: pytest.MonkeyPatch) -> None:
    """``InverseRootError`` (the roots failed ``max_failures`` steps in a row; the step not taken) ends the run as
    diverged, as a non-finite loss does, instead of ending the whole demo."""
    import fismo_core.demo.train as train_module
    from fismo_core.guards import InverseRootError

    calls = []

    def failing(name, model, lr, adamw_lr):
        built = build_optimizer(name, model, lr, adamw_lr)

        def step() -> None:
            calls.append(1)
            if len(calls) == 3:
                raise InverseRootError("the roots failed")
            type(built).step(built)

        built.step = step
        return built

    monkeypatch.setattr(train_module, "build_optimizer", failing)
    spec = RunSpec(DigitsTask(), "FISMO-T", 0.01, seed=0, steps=6, adamw_lr=3e-3, eval_every=2, measure_every=2,
                   warmup=1)
    result = train(spec)
    assert result.diverged and result.final_val_loss == math.inf and len(calls) == 3
    assert result.history.eval_step == [0, 2]  # the evaluations before the failure, none after


def test_journal_reuses_finished_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import fismo_core.demo.run as run_module

    task = DigitsTask()
    specs = [RunSpec(task, name, 0.02, seed=0, steps=3, adamw_lr=3e-3, eval_every=3, measure_every=3, warmup=1)
             for name in ("AdamW", "SGD")]
    journal = tmp_path / "journal.jsonl"
    first = run_many(specs, jobs=1, journal=journal)
    assert len(journal.read_text().splitlines()) == 2
    with journal.open("a") as f:
        f.write('{"key": "cut off')  # an interrupted write is skipped
    monkeypatch.setattr(run_module, "_train_one_thread", lambda spec: pytest.fail(f"{spec.optimizer} retrained"))
    again = run_many(specs, jobs=1, journal=journal)
    assert [r.to_dict() for r in again] == [r.to_dict() for r in first]
    other = [RunSpec(task, "AdamW", 0.02, seed=1, steps=3, adamw_lr=3e-3, eval_every=3, measure_every=3, warmup=1)]
    with pytest.raises(pytest.fail.Exception, match="AdamW retrained"):  # another seed is another run
        run_many(other, jobs=1, journal=journal)


def test_a_journal_from_another_cpu_is_not_reused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The journal's key held the spec and the fismo and torch versions only, so an interrupted demo's folder
    resumed on another CPU mixed two CPUs' runs under this one's digest key. Its key is `digest_key` now."""
    import fismo_core.demo.report as report_module
    import fismo_core.demo.run as run_module

    specs = [RunSpec(DigitsTask(), "SGD", 0.02, seed=0, steps=3, adamw_lr=3e-3, eval_every=3, measure_every=3,
                     warmup=1)]
    journal = tmp_path / "journal.jsonl"
    run_many(specs, jobs=1, journal=journal)
    monkeypatch.setattr(report_module, "_cpu_model", lambda: "Another CPU 9000")
    monkeypatch.setattr(run_module, "_train_one_thread", lambda spec: pytest.fail(f"{spec.optimizer} retrained"))
    with pytest.raises(pytest.fail.Exception, match="SGD retrained"):
        run_many(specs, jobs=1, journal=journal)


def test_digest_key_names_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """An AMD EPYC and an Intel Xeon, both AVX512 with bfloat16 native, printed one key and two digests
    (2026-12-05): the key names the CPU's model now."""
    import fismo_core.demo.report as report_module

    here = digest_key()
    monkeypatch.setattr(report_module, "_cpu_model", lambda: "Another CPU 9000")
    assert ", Another CPU 9000)" in digest_key() and digest_key() != here


def test_beyond_edge_continues_the_grid_at_its_ratio() -> None:
    assert beyond_edge((0.01, 0.02, 0.04), 0.04) == 0.08
    assert beyond_edge((0.04, 0.01, 0.02), 0.01) == 0.005  # any order: the edges are the extremes
    assert beyond_edge((0.01, 0.02, 0.04), 0.02) is None  # inside: nothing to add
    assert beyond_edge((1e-3, 3e-3, 1e-2), 1e-2) == 0.0333  # ratio 10/3, 3 significant digits
    assert beyond_edge((1e-3, 3e-3, 1e-2), 1e-3) == 0.000333
    assert beyond_edge((0.02,), 0.02) is None  # one value: no ratio


def _fake_loss(optimizer: str, lr: float) -> float:
    """A held-out loss with a known best lr per optimizer (see the test below)."""
    best = {"AdamW": math.inf, "SGD": 0.5, "Muon": 2.0}.get(optimizer, 2.0)
    return -lr if math.isinf(best) else 1.0 + math.log2(lr / best) ** 2


@pytest.mark.parametrize("extensions", [2, 0])
def test_grid_extends_until_the_winner_is_inside(monkeypatch: pytest.MonkeyPatch, extensions: int) -> None:
    """Fake runs with a known loss: a winner on an edge extends its grid, at most ``grid_extensions`` times.

    Grid (1, 2, 4) for each: AdamW's loss falls with lr (the largest value always wins: extended by 8 and 16,
    then the cap stops it at the edge); SGD's best is 0.5 (extended by 0.5, which wins, then by 0.25, which
    does not: 0.5 inside); Muon's best is 2, inside at once. The seeds and controls run at the final choice.
    """
    import dataclasses

    import fismo_core.demo.run as run_module

    def fake(spec: RunSpec) -> RunResult:
        loss = _fake_loss(spec.optimizer, spec.lr)
        history = History(eval_step=[0, spec.steps], train_loss=[9.0, loss], val_loss=[9.0, loss],
                          val_acc=[0.1, 0.9])
        return RunResult(spec.task.name, spec.optimizer, spec.lr, spec.seed, spec.steps, history, loss, 0.9, loss,
                         False, 0.01, 0.01)

    monkeypatch.setattr(run_module, "_train_one_thread", fake)
    config = default_config(preset="tiny", tasks=("digits",), optimizers=("AdamW", "SGD", "Muon"), seeds=2, jobs=1)
    plan = dataclasses.replace(config.plans[0], lrs={name: (1.0, 2.0, 4.0) for name in config.optimizers})
    config = dataclasses.replace(config, plans=(plan,), grid_extensions=extensions)
    results = run_demo(config, progress=False)
    if extensions == 0:
        assert results.extended == {}
        assert {o: results.best_lr[("digits", o)] for o in config.optimizers} == {"AdamW": 4.0, "SGD": 1.0,
                                                                                  "Muon": 2.0}
        assert extension_note(results, "digits").startswith("No grid was extended")
        return
    assert results.extended == {("digits", "AdamW"): (8.0, 16.0), ("digits", "SGD"): (0.5, 0.25)}
    assert results.grid("digits", "AdamW") == (1.0, 2.0, 4.0, 8.0, 16.0)
    assert results.grid("digits", "SGD") == (0.25, 0.5, 1.0, 2.0, 4.0)
    assert results.grid("digits", "Muon") == (1.0, 2.0, 4.0)
    best = {o: results.best_lr[("digits", o)] for o in config.optimizers}
    assert best == {"AdamW": 16.0, "SGD": 0.5, "Muon": 2.0}
    for opt in config.optimizers:  # seed 0 at every lr of the grid, seed 1 at the selected lr only
        runs = [r for r in results.runs if r.optimizer == opt]
        assert sorted(r.lr for r in runs if r.seed == 0) == list(results.grid("digits", opt))
        assert [r.lr for r in runs if r.seed == 1] == [best[opt]]
    assert {r.lr for r in results.runs if r.optimizer in MUON_CONTROLS} == {2.0}
    note = extension_note(results, "digits")
    assert "AdamW by 8, 16 (selected 16, still at an edge after 2 extension(s))" in note
    assert "SGD by 0.5, 0.25 (selected 0.5, inside)" in note and "Muon by" not in note
    table = sweep_table(results, "digits")
    assert "| AdamW | 1: " in table and "| **+16: -16.000** |" in table and "| +0.25: 2.000 |" in table
    grids = {s["optimizer"]: s["lr_grid"] for s in summarise(results)}
    assert grids["SGD"] == "+0.25 +0.5 1 2 4" and grids["Muon"] == "1 2 4" and grids["Muon-NS7"] == "Muon's"


def test_last_line_names_only_the_files_written() -> None:
    tables = ["report.md", "summary.csv", "runs.csv", "curves.csv", "results.json"]
    line = demo.wrote_line("out", tables + ["a.png", "b.png"], 61.2, 100.4)
    assert "2 PNG figures" in line and "61 s" in line and "100 CPU-seconds" in line
    line = demo.wrote_line("out", tables, 61.2, 100.4)
    assert "PNG" not in line and "matplotlib is not installed" in line
    assert demo.wrote_line("out/", tables, 1, 1).startswith("Wrote out/report.md, ")  # not out//report.md
    from fismo_core.demo.report import _minutes

    assert [_minutes(s) for s in (61.2, 119.6, 299.6, 3600)] == ["61 s", "2 min 00 s", "5 min 00 s", "60 min 00 s"]


# ------------------------------------------------------------------ end to end
@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory):
    """The tiny preset in this process (one torch thread), its report and files."""
    out = tmp_path_factory.mktemp("demo")
    results = run_demo(default_config(preset="tiny", jobs=1), progress=False)
    report, files = write_report(results, out, "fismo demo (tiny preset)")
    return out, report, files, results


def test_demo_writes_every_file(tiny_run) -> None:
    out, _, files, _ = tiny_run
    expected = ["report.md", "summary.csv", "runs.csv", "curves.csv", "results.json", *PNGS]
    assert sorted(files) == sorted(expected)
    for name in expected:
        assert (out / name).is_file(), name
    for name in PNGS:
        data = (out / name).read_bytes()
        assert data.startswith(b"\x89PNG\r\n\x1a\n")
        assert len(data) < 150_000, f"{name} is {len(data)} bytes: figures must stay small"
    def refuse(constant: str) -> None:  # NaN, Infinity: JavaScript's, which JSON parsers but Python's refuse
        raise ValueError(f"results.json holds {constant}, which is not JSON")

    payload = json.loads((out / "results.json").read_text(encoding="utf-8"), parse_constant=refuse)
    # The text task has no accuracy: null (it was a bare NaN until 2026-12-04, a user's hunt).
    assert {r["final_val_acc"] is None for r in payload["runs"] if r["task"] == "text"} == {True}
    assert payload["command"] == "fismo demo (tiny preset)" and payload["preset"] == "tiny"
    assert payload["cpu_seconds"] > 0 and len(payload["digest"]) == 16
    assert payload["digest_key"] == digest_key()


def test_demo_saves_the_tables(tiny_run) -> None:
    out, report, _, results = tiny_run
    controls = ["FISMO-bf16", *(["FISMO-B32", "FISMO-SI-B32", "FISMO-T-B32"] if BLOCKS else [])]
    expected = [o for o in ALL_OPTIMIZERS if o != "SOAP" or soap_available()] + list(MUON_CONTROLS) + controls
    with (out / "summary.csv").open() as f:
        rows = list(csv.DictReader(f))
    digits = {r["optimizer"] for r in rows if r["task"] == "digits"}
    assert digits == set(expected)
    text = {n.replace("B32", "B16") for n in expected} | set(TRAINING_ABLATIONS)  # the ablations: text only
    assert {r["optimizer"] for r in rows if r["task"] == "text"} == text
    assert all(int(r["seeds"]) == 2 for r in rows)  # 2 seeds, the controls too
    for r in rows:  # a control runs at the selected lr of its base
        if r["lr_grid"].endswith("'s"):
            base = r["lr_grid"][:-2]
            assert r["lr"] == next(b["lr"] for b in rows if b["task"] == r["task"] and b["optimizer"] == base)
    assert report == (out / "report.md").read_text()
    assert "| optimizer | lr grid | selected lr | held-out loss |" in report
    assert "FISMO's preconditioners" in report and "Muon-NS7" in report and "Newton–Schulz precision" in report
    assert f"Result digest: `{digest(results)}` for {digest_key()}" in report and "CPU time" in report
    if BLOCKS:
        assert "Block-diagonal factors" in report and "| FISMO-SI-B32 | 32 |" in report
    if not soap_available():
        assert "SOAP skipped" in report


def _section(report: str, task_heading: str, title: str) -> list[list[str]]:
    """The rows (cells) of the table that follows the paragraph starting with ``title`` in a task's section."""
    part = report.split(task_heading, 1)[1].split("\n## ", 1)[0]
    table = part.split(title, 1)[1].split("\n\n", 2)[1]
    return [[c.strip() for c in line.strip("|").split("|")] for line in table.splitlines()[2:]]


TASK_HEADINGS = {"digits": "## CNN", "text": "## GPT"}


def test_training_table_pairs_the_seeds(tiny_run) -> None:
    """FISMO-T against Muon-torch: each seed's losses and difference, recomputed here from the runs."""
    _, report, _, results = tiny_run
    for task, heading in TASK_HEADINGS.items():
        rows = _section(report, heading, "The training configuration FISMO-T against `torch.optim.Muon`")
        loss = {(r.optimizer, r.seed): r.final_val_loss for r in results.runs
                if r.task == task and r.lr == results.best_lr[(task, r.optimizer)]}
        assert [row[0] for row in rows] == ["0", "1", "mean ± std (2 seeds)"]
        for row in rows[:2]:
            ours, theirs = loss[("FISMO-T", int(row[0]))], loss[("Muon-torch", int(row[0]))]
            assert row[1:] == [f"{ours:.4f}", f"{theirs:.4f}", f"{ours - theirs:+.4f}"]
        differences = [loss[("FISMO-T", s)] - loss[("Muon-torch", s)] for s in (0, 1)]
        mean = sum(differences) / 2
        assert rows[2][3].startswith(f"{mean:.4f} ± ")


def test_ablation_table_compares_each_control_with_fismo_t(tiny_run) -> None:
    """Text: every ablation and the blocked FISMO-T, seed by seed minus FISMO-T; digits: the blocked one only."""
    _, report, _, results = tiny_run
    for task, heading in TASK_HEADINGS.items():
        block = 16 if task == "text" else 32
        names = [*([f"FISMO-T-B{block}"] if BLOCKS else []), *(TRAINING_ABLATIONS if task == "text" else ())]
        rows = _section(report, heading, "Ablations of FISMO-T")
        assert [row[0] for row in rows] == ["FISMO-T", *names]
        loss = {(r.optimizer, r.seed): r.final_val_loss for r in results.runs
                if r.task == task and r.lr == results.best_lr[(task, "FISMO-T")]}
        for row in rows[1:]:
            assert row[1] == ", ".join(f"{k}={v!r}" for k, v in control_change(row[0]).items())
            assert row[2] == f"{results.best_lr[(task, 'FISMO-T')]:g}"  # the control runs at FISMO-T's lr
            assert row[4:6] == [f"{loss[(row[0], s)] - loss[('FISMO-T', s)]:+.4f}" for s in (0, 1)]


def test_step_times_are_recorded_and_compared_with_torch_muon(tiny_run) -> None:
    """Every run times its steps; the optimizer step is part of the whole step; the table's ratios are to Muon-torch."""
    _, report, _, results = tiny_run
    for r in results.runs:
        assert 0 < r.opt_step_seconds <= r.step_seconds < r.seconds, r
        assert 0 <= r.opt_step_cpu_seconds <= r.step_cpu_seconds < r.cpu_seconds, r  # CPU clocks may be coarse
    for task, heading in TASK_HEADINGS.items():
        rows = {row[0]: row for row in _section(report, heading, "Time per training step")}
        assert rows["Muon-torch"][2::2] == ["1.00×"] * 4
        summary = {s["optimizer"]: s for s in summarise(results) if s["task"] == task}
        assert set(rows) == set(summary)
        ratio = summary["FISMO-T"]["step_seconds"] / summary["Muon-torch"]["step_seconds"]
        assert rows["FISMO-T"][1:3] == [f"{1e3 * summary['FISMO-T']['step_seconds']:.2f}", f"{ratio:.2f}×"]


def test_tiny_grids_are_extended_until_the_winner_is_inside(tiny_run) -> None:
    """The rule on real runs: a grid is its plan's values and its extensions, and its winner is inside unless
    the cap was reached; tiny's two-value grids always have their winner on an edge at first."""
    _, report, _, results = tiny_run
    cap = results.config.grid_extensions
    assert results.extended  # two values per grid: every first selection is an edge
    for plan in results.config.plans:
        task = plan.task.name
        for opt in results.config.optimizers:
            if (task, opt) not in results.grids:  # skipped (SOAP without its package)
                continue
            added = results.extended.get((task, opt), ())
            grid = results.grid(task, opt)
            assert grid == tuple(sorted((*plan.lrs[opt], *added))) and len(added) <= cap
            best = results.best_lr[(task, opt)]
            assert grid[0] < best < grid[-1] or len(added) == cap, (task, opt, grid, best)
            assert sorted(r.lr for r in results.runs if r.task == task and r.optimizer == opt and r.seed == 0) == \
                list(grid)
        assert extension_note(results, task) in report


@pytest.mark.skipif(not BLOCKS, reason="the torch adapter has no block_size option yet")
def test_blocking_table_counts_the_state(tiny_run) -> None:
    """The state column: 2 (m^2 + n^2) + mn per matrix for full factors, sum of block squares when blocked."""
    _, report, _, _ = tiny_run
    shapes = [(16, 9), (32, 144), (64, 128)]  # DigitsCNN's hidden matrices

    def side(d: int, b: int) -> int:  # one factor of side d in blocks of b: k full blocks and a remainder
        return (d // b) * b * b + (d % b) ** 2 if d > b else d * d

    full = sum(2 * (m * m + n * n) + m * n for m, n in shapes)
    blocked = sum(2 * (side(m, 32) + side(n, 32)) + m * n for m, n in shapes)
    muon = sum(m * n for m, n in shapes)
    digits = report.split("## GPT")[0]
    assert "| FISMO | full |" in digits and f"| {full:,} |" in digits
    assert f"| {blocked:,} |" in digits and f"| {muon:,} |" in digits
    assert blocked < full


def test_demo_losses_fall(tiny_run) -> None:
    out, _, _, _ = tiny_run
    payload = json.loads((out / "results.json").read_text())
    best = {(b["task"], b["optimizer"]): b["lr"] for b in payload["best_lr"]}
    checked = 0
    best_ratio = {"digits": 1.0, "text": 1.0}
    for run in payload["runs"]:
        if run["lr"] != best[(run["task"], run["optimizer"])]:
            continue  # a sweep run at a poor lr may diverge; that is what the sweep is for
        h = run["history"]
        assert not run["diverged"], run
        # Every optimizer's held-out loss falls by more than 0.02 nats. The held-out set is fixed and the
        # evaluation deterministic, so only training moves it; measured falls: 0.05 (SGD on digits) to 1.9 (text).
        assert h["val_loss"][-1] < h["val_loss"][0] - 0.02, (run["task"], run["optimizer"], h["val_loss"])
        assert h["train_loss"][-1] < h["train_loss"][1]
        best_ratio[run["task"]] = min(best_ratio[run["task"]], h["val_loss"][-1] / h["val_loss"][0])
        checked += 1
    assert checked >= 2 * 2 * 8  # 2 tasks, 2 seeds, 5 optimizers, 2 Muon controls, FISMO-bf16 at least
    # The best optimizer of each task learns for real: measured final/initial held-out loss 0.11 (digits,
    # from ln 10) and 0.65 (text, from ln 256, in 16 steps); the bounds leave room for other CPUs and builds.
    assert best_ratio["digits"] < 0.4 and best_ratio["text"] < 0.8, best_ratio
    digits_acc = max(r["final_val_acc"] for r in payload["runs"] if r["task"] == "digits")
    assert digits_acc > 0.8  # 10 classes, chance 0.1; measured best 0.96 after 40 steps


def test_variant_moves_the_preconditioners_and_printed_does_not(tiny_run) -> None:
    _, _, _, results = tiny_run
    dev = {}
    for run in results.runs:
        if run.optimizer in ("FISMO", "FISMO-SI") or run.optimizer.startswith(("FISMO-B", "FISMO-SI-B")):
            base = "FISMO-SI" if run.optimizer.startswith("FISMO-SI") else "FISMO"
            dev.setdefault((run.task, base), []).append(max(run.history.P_dev))
        elif run.optimizer.startswith("FISMO-T"):  # FISMO-T's statistics are scale-invariant, but in -printed
            base = "FISMO" if run.optimizer == "FISMO-T-printed" else "FISMO-SI"
            dev.setdefault((run.task, base), []).append(max(run.history.P_dev))
    for task in ("digits", "text"):
        # Measured over every run (sweeps included): printed ||P - I||/sqrt(m) (FISMO, its controls,
        # FISMO-T-printed) at most 2e-3, scale-invariant (FISMO-SI, FISMO-T, their controls) at least 0.6.
        assert max(dev[(task, "FISMO")]) < 0.05
        assert min(dev[(task, "FISMO-SI")]) > 0.3


@pytest.mark.numbers
def test_two_runs_give_identical_results(tiny_run) -> None:
    """The same preset again, in two worker processes this time: the same numbers to the last bit."""
    _, _, _, first = tiny_run
    second = run_demo(default_config(preset="tiny", jobs=2), progress=False)
    assert digest(second) == digest(first)
    histories = [[json.dumps(r.history.__dict__) for r in results.runs] for results in (first, second)]
    assert histories[0] == histories[1]  # as text: NaN (the text task's accuracy) is not equal to itself
    assert all(summary_table(first, t).split("CPU s / run")[0] == summary_table(second, t).split("CPU s / run")[0]
               for t in ("digits", "text"))


@pytest.mark.numbers
def test_digest_key_names_the_kernels_that_made_the_numbers() -> None:
    """The digest's key changes with torch's CPU kernels, the one thing in it that differs between CPUs.

    Forced in a fresh process (torch reads ``ATEN_CPU_CAPABILITY`` at import):
    the key names the capability torch really uses and the variables that forced it.
    """
    key = subprocess.run(
        [sys.executable, "-c", "from fismo_core.demo.report import digest_key; print(digest_key())"],
        env={**os.environ, "ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "AVX"},
        capture_output=True, text=True, check=True,
    ).stdout.strip()
    # oneDNN limited to AVX has no bfloat16 dot products, so FISMO-T computes in float32 (bfloat16_is_native).
    assert ("torch " + torch.__version__ + " (DEFAULT kernels, bfloat16 emulated, forced by ATEN_CPU_CAPABILITY=default "
            "ONEDNN_MAX_CPU_ISA=AVX" in key), key
    assert key != digest_key() or os.environ.get("ATEN_CPU_CAPABILITY") == "default"
    for part in ("fismo ", "Python ", "scikit-learn "):
        assert part in key


@pytest.mark.parametrize("variable", ["ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA"])
def test_digest_key_names_a_onednn_limit_by_either_name(variable: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """oneDNN reads its ISA limit under today's name and the older one; either changes FISMO-T's precision."""
    for name in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(variable, "AVX2")
    key = digest_key()
    assert f"forced by {variable}=AVX2" in key or f" {variable}=AVX2" in key, key
    assert "bfloat16 emulated" in key, key  # no bfloat16 dot products below AVX512_CORE_BF16


def test_no_matplotlib_no_figures_claimed(tiny_run, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without matplotlib the demo writes no PNG, says so in the report, and its last line claims none."""
    _, _, _, results = tiny_run
    real_import = builtins.__import__

    def no_matplotlib(name: str, *args, **kwargs):
        if name == "matplotlib" or name.startswith("matplotlib."):
            raise ImportError("No module named 'matplotlib'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    monkeypatch.setattr(demo, "run_demo", lambda config, progress, journal: results)
    # An earlier run's figure is removed (the folder is this run's: a user's hunt, 2026-12-03, found a
    # figure of a FISMO run beside the report of an SGD-only one); the user's own files stay.
    (tmp_path / "digits_loss.png").write_bytes(b"an earlier run's figure")
    (tmp_path / "notes.txt").write_text("mine")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert demo.main(results.config, str(tmp_path), progress=False) == 0
    last = printed.getvalue().strip().splitlines()[-1]
    assert "PNG" not in last and "matplotlib is not installed" in last, last
    assert not list(tmp_path.glob("*.png")) and (tmp_path / "notes.txt").read_text() == "mine"
    assert "Figures skipped" in (tmp_path / "report.md").read_text()


def test_a_report_that_cannot_be_written_leaves_the_folder_as_it_was(tiny_run, tmp_path: Path, capsys,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A write that fails after the runs (a full disk: "File too large" under ``ulimit -f``) raised a
    traceback and left a truncated figure and half of the tables (a user's hunt, 2026-12-03): now one
    line, exit 2, and the files that were there are as they were, with no part file left."""
    import fismo_core.demo.report as report_mod

    _, _, _, results = tiny_run
    monkeypatch.setattr(demo, "run_demo", lambda config, progress, journal: results)
    (tmp_path / "report.md").write_text("the earlier report")
    (tmp_path / "digits_loss.png").write_bytes(b"the earlier figure")
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    real_write_csv = report_mod._write_csv

    def disk_full_at_the_runs_table(path: Path, header, rows) -> None:
        if "runs.csv" in path.name:
            path.write_text("task,optim")
            raise OSError(27, "File too large", str(path))
        real_write_csv(path, header, rows)

    monkeypatch.setattr(report_mod, "_write_csv", disk_full_at_the_runs_table)
    assert demo.main(results.config, str(tmp_path), progress=False) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"fismo demo: cannot write the report to {tmp_path}: File too large")
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


@pytest.mark.parametrize("make", ["a link to /dev/null", "a pipe", "a link into a missing folder"])
def test_a_name_that_cannot_be_a_file_is_refused_before_the_runs(tmp_path: Path, make: str) -> None:
    """A report name that is a device, a pipe or a link into a missing folder passed the check before the
    runs and was refused only after them (12 to 40 minutes of the default demo; a user's hunt, 2026-12-04)."""
    name = tmp_path / "report.md"
    if make == "a pipe":
        os.mkfifo(name)
    else:
        name.symlink_to("/dev/null" if make == "a link to /dev/null" else tmp_path / "missing" / "report.md")
    with pytest.raises(OSError, match=r"cannot write the report to .*report\.md: it (exists and is not a regular "
                                      r"file|is a symbolic link into .*missing, which is not a folder)"):
        demo.out_directory(str(tmp_path))


def test_a_console_without_the_reports_characters(tmp_path: Path) -> None:
    """On an ASCII (or Latin-1, cp1252) console the report's ``±`` and ``κ`` raised UnicodeEncodeError after
    every run: a traceback, exit 1, nothing written (report.md was written in the locale's encoding; a
    user's hunt, 2026-12-04). The files are UTF-8 now, and the console gets the report with ``?`` in place
    of what it cannot show."""
    env = {**os.environ, "LC_ALL": "C", "LANG": "C", "PYTHONUTF8": "0", "PYTHONCOERCECLOCALE": "0",
           "PYTHONIOENCODING": ""}
    result = subprocess.run([sys.executable, "-m", "fismo_core", "demo", "--tasks", "digits", "--optimizers", "SGD",
                             "--seeds", "1", "--steps", "2", "--jobs", "1", "--no-progress", "--out", str(tmp_path)],
                            capture_output=True, cwd=ROOT, env=env, timeout=300)
    assert result.returncode == 0 and b"Traceback" not in result.stderr, result.stderr.decode(errors="replace")
    assert "±" in (tmp_path / "report.md").read_text(encoding="utf-8")
    assert b"Result digest" in result.stdout


def test_digest_key_names_pytorch_optimizer(monkeypatch: pytest.MonkeyPatch) -> None:
    """SOAP is one of the default runs: without pytorch-optimizer, or with another version, the key was the
    same and the digest another (a user's hunt, 2026-12-04)."""
    from importlib import metadata

    installed = metadata.version

    def version(package: str) -> str:
        if package == "pytorch-optimizer":
            raise metadata.PackageNotFoundError(package)
        return installed(package)

    assert re.search(r", pytorch-optimizer \S+$", digest_key())
    monkeypatch.setattr(metadata, "version", version)
    assert digest_key().endswith(", pytorch-optimizer not installed")


def test_figures_of_short_runs_and_of_optimizers_without_measurements(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """``--optimizers SGD`` wrote an empty condition figure (the κ = 1 line alone) and linked it; one step drew
    no curve (a line of one point); the accuracy panel showed 0.8 to 1 only, so a short run's 0.1 was off
    it (a user's hunt, 2026-12-04)."""
    pytest.importorskip("matplotlib")
    import fismo_core.demo.report as report_module

    drawn, save = {}, report_module._save

    def keep(fig: Any, path: Path) -> None:  # the figure, by its name (the path is the staged ".NAME.png.part")
        drawn[path.name.lstrip(".").split(".png")[0]] = fig
        save(fig, path)

    monkeypatch.setattr(report_module, "_save", keep)
    results = run_demo(default_config(preset="tiny", tasks=("digits",), optimizers=("SGD", "FISMO"), seeds=1, steps=1,
                                      jobs=1), progress=False)
    sgd_only = run_demo(default_config(preset="tiny", tasks=("digits",), optimizers=("SGD",), seeds=1, steps=1, jobs=1),
                        progress=False)
    _, files = write_report(sgd_only, tmp_path / "sgd", "fismo demo")
    assert "digits_condition.png" not in files and "digits_loss.png" in files
    drawn.clear()
    write_report(results, tmp_path / "both", "fismo demo")
    loss = drawn["digits_loss"]
    for ax in loss.axes:
        lines = [line for line in ax.get_lines() if len(line.get_xdata()) == 1]
        assert all(line.get_marker() == "." for line in lines), ax.get_title()
    accuracy = next(ax for ax in loss.axes if ax.get_title() == "held-out accuracy")
    lowest = min(min(line.get_ydata()) for line in accuracy.get_lines())
    assert accuracy.get_ylim()[0] <= lowest
    for ax in drawn["digits_preconditioner"].axes:
        assert ax.get_lines() and all(line.get_marker() == "." for line in ax.get_lines()), ax.get_title()


def test_a_folder_with_the_name_of_a_report_file_is_refused_before_the_runs(tmp_path: Path) -> None:
    """``summary.csv`` a folder: the whole demo ran, then ``IsADirectoryError`` with report.md and the figures
    written and the other tables not (a user's hunt, 2026-12-03). Refused before any run now, exit 2."""
    (tmp_path / "summary.csv").mkdir()
    result = subprocess.run([sys.executable, "-m", "fismo_core", "demo", "--out", str(tmp_path)],
                            capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert f"{tmp_path / 'summary.csv'} is a folder; the report writes a file of that name" in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["summary.csv"]


# ------------------------------------------------------------------ command line
def test_command_line_runs_and_reports(tmp_path: Path) -> None:
    printed = io.StringIO()
    tmp_path = tmp_path / "my results"  # the command is recorded quoted, to paste back (it was not: a user's hunt)
    argv = ["demo", "--quick", "--tasks", "digits", "--optimizers", "AdamW", "--seeds", "1", "--steps", "4",
            "--jobs", "1", "--out", str(tmp_path), "--no-progress"]
    with contextlib.redirect_stdout(printed):
        assert cli_main(argv) == 0
    payload = json.loads((tmp_path / "results.json").read_text())
    assert payload["command"] == "fismo " + " ".join(argv[:-2]) + f" '{tmp_path}' --no-progress"
    assert payload["preset"] == "quick"
    [grid] = payload["grids"]  # the quick grid of 3 values, and its extensions if the winner was on an edge
    assert len(grid["lrs"]) == 3 + len(grid["extended_by"]) and set(grid["extended_by"]) <= set(grid["lrs"])
    assert {(r["optimizer"], r["steps"]) for r in payload["runs"]} == {("AdamW", 4)}
    assert sorted(r["lr"] for r in payload["runs"]) == grid["lrs"]
    last = printed.getvalue().strip().splitlines()[-1]
    assert last.startswith(f"Wrote {tmp_path}/report.md") and "2 PNG figures" in last, last
    # AdamW's updates have a condition number; no FISMO ran, so no preconditioner table, not an empty one.
    report = (tmp_path / "report.md").read_text()
    assert "Condition number of the updates" in report and "FISMO's preconditioners" not in report
    assert not re.search(r"^\|[^\n]*\|\n\|[ -:|]*\|\n(?!\|)", report, re.M), "a table with no rows"


def test_ctrl_c_ends_the_demo_with_one_line(tmp_path: Path, capsys, monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C during the runs printed Python's traceback in the command and one more in each worker (8 for
    ``--quick`` with 2 jobs; a user's hunt, 2026-12-03). The command prints one line and returns the
    shell's status for SIGINT, 130; the report, written after the runs, is not there."""
    def interrupted(config, progress, journal):
        raise KeyboardInterrupt

    monkeypatch.setattr(demo, "run_demo", interrupted)
    assert cli_main(["demo", "--quick", "--out", str(tmp_path), "--no-progress"]) == 130
    assert capsys.readouterr().err == f"\nfismo demo: interrupted; no report was written to {tmp_path}\n"
    assert not list(tmp_path.iterdir())


def test_ctrl_c_ends_a_demo_worker_without_a_traceback() -> None:
    """The demo's worker processes end on SIGINT as a process does, silently, not with a traceback each."""
    script = (
        "import os, signal, time\n"
        "signal.signal(signal.SIGINT, signal.default_int_handler)  # a command run from a terminal\n"
        "from fismo_core.demo.run import worker_pool\n"
        "with worker_pool(1) as pool:\n"
        "    assert pool.submit(int, 7).result() == 7\n"
        "    worker = next(iter(pool._processes.values()))\n"
        "    os.kill(worker.pid, signal.SIGINT)\n"
        "    deadline = time.monotonic() + 5  # polled: Process.join races the pool's own reaping thread\n"
        "    while worker.exitcode is None and time.monotonic() < deadline:\n"
        "        time.sleep(0.02)\n"
        "    print(worker.exitcode)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(-2)  # killed by SIGINT (2)
    assert "Traceback" not in done.stderr and "KeyboardInterrupt" not in done.stderr, done.stderr


def test_a_demo_worker_ends_with_its_parent(tmp_path: Path) -> None:
    """A ``kill -TERM`` of the command alone left its workers alive: each finished its run and then waited on
    the pool's queue forever (a user's hunt, 2026-12-04). A worker now ends within a second or two of its
    parent: here the parent is killed while its worker sleeps in a task, and the worker is gone 10 s later."""
    script = (
        "import os, time\n"
        "from fismo_core.demo.run import worker_pool\n"
        "pool = worker_pool(1)\n"
        "pool.submit(time.sleep, 600)\n"
        "time.sleep(1)\n"
        "print(next(iter(pool._processes)), flush=True)\n"
        "os._exit(0)  # the parent ends without shutting its pool down, as after SIGTERM or SIGKILL\n"
    )
    with open(tmp_path / "out", "w+") as out, open(tmp_path / "err", "w+") as err:  # files: the worker holds them
        done = subprocess.run([sys.executable, "-c", script], stdout=out, stderr=err, text=True, timeout=300)
        out.seek(0), err.seek(0)
        assert done.returncode == 0, err.read()
        worker = int(out.read().strip())
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(worker, 0)  # still there (or a zombie not yet reaped by its new parent)
        except ProcessLookupError:
            break
        if Path(f"/proc/{worker}/stat").exists() and Path(f"/proc/{worker}/stat").read_text().split()[2] == "Z":
            break  # it ended; its adoptive parent has not reaped it yet
        time.sleep(0.1)
    else:
        os.kill(worker, signal.SIGKILL)
        pytest.fail(f"worker {worker} outlived its parent by 10 s")


def test_a_demo_worker_is_quiet_on_ctrl_c_before_it_imports_torch() -> None:
    """A spawned worker unpickles its pool's initializer first: the demo's lived in a module that imports torch,
    so for its first seconds a worker had Python's handler and a terminal's Ctrl-C printed a traceback from
    each (a user's hunt, 2026-12-04). Unpickled in a fresh process, the initializer now imports no torch,
    and a worker made by it ends silently on SIGINT with one torch thread (the demo's own setting)."""
    script = (
        "import pickle, sys\n"
        "from fismo_core.demo.run import worker_pool\n"
        "pool = worker_pool(1)\n"
        "print(pickle.dumps((pool._initializer, pool._initargs)).hex())\n"
    )
    made = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert made.returncode == 0, made.stderr
    check = (
        "import pickle, signal, sys\n"
        "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
        f"init, args = pickle.loads(bytes.fromhex({made.stdout.strip()!r}))\n"
        "assert 'torch' not in sys.modules, 'unpickling the initializer imported torch'\n"
        "init(*args)\n"
        "import torch\n"
        "print(signal.getsignal(signal.SIGINT) is signal.SIG_DFL, torch.get_num_threads())\n"
    )
    done = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True", "1"]


@pytest.mark.parametrize("missing", ["torch", "sklearn"])
def test_demo_without_torch_or_scikit_learn_says_what_to_install(missing: str, capsys,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Without torch: ``ModuleNotFoundError``, a traceback; without scikit-learn: a traceback from the first
    run (a user's hunt, 2026-12-03). One line and exit 2 now, before anything runs, as ``fismo verify`` says
    it needs NumPy."""
    monkeypatch.setitem(sys.modules, missing, None)  # what an environment without it gives
    assert cli_main(["demo", "--out", "never-made"]) == 2
    captured = capsys.readouterr()
    name = {"torch": "torch", "sklearn": "scikit-learn"}[missing]
    assert captured.err.strip() == f"fismo demo: needs {name}: pip install 'fismo[demo]'" and captured.out == ""
    assert not os.path.exists("never-made")


def test_demo_of_soap_alone_without_pytorch_optimizer_is_a_usage_error(capsys, monkeypatch) -> None:
    """SOAP was dropped with a note and nothing else ran: ``max() arg is an empty sequence`` after the start,
    two empty figures left (a user's hunt, 2026-12-03)."""
    import fismo_core.demo.optimizers as optimizers_mod

    monkeypatch.setattr(optimizers_mod, "soap_available", lambda: False)
    with pytest.raises(SystemExit) as exc:
        cli_main(["demo", "--optimizers", "SOAP", "--out", "never-made"])
    assert exc.value.code == 2 and "--optimizers SOAP needs pytorch-optimizer" in capsys.readouterr().err
    assert not os.path.exists("never-made")


def test_demo_refuses_an_empty_out(capsys) -> None:
    """``--out ""`` wrote into the current folder and said "Wrote /report.md" (a user's hunt, 2026-12-03)."""
    with pytest.raises(SystemExit) as exc:
        cli_main(["demo", "--out", ""])
    assert exc.value.code == 2 and "--out must name a directory" in capsys.readouterr().err


def test_demo_rejects_unknown_names(capsys: pytest.CaptureFixture[str]) -> None:
    # An empty --optimizers (a script's empty variable) is an unknown name, not "every optimizer" (146 runs).
    for argv in (["demo", "--optimizers", "Adam"], ["demo", "--tasks", "cifar"], ["demo", "--seeds", "0"],
                 ["demo", "--optimizers", ""]):
        with pytest.raises(SystemExit) as exc:
            cli_main(argv)
        assert exc.value.code == 2
    assert "unknown" in capsys.readouterr().err


def test_python_m_fismo_core_demo_help() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "fismo_core", "demo", "--help"], capture_output=True, text=True, cwd=ROOT, check=True
    )
    assert "--quick" in result.stdout and "--out" in result.stdout


def test_modifiers_of_different_settings_join_and_of_the_same_setting_are_refused() -> None:
    """``FISMO-T-mu1e-3-fp32mm`` is FISMO-T with both settings; two changes of one setting are not a name."""
    model = TinyGPT(layers=1)
    base = _group_settings(build_optimizer("FISMO-T", model, 0.02, 3e-3).fismo)[0]
    both = _group_settings(build_optimizer("FISMO-T-mu1e-3-fp32mm", model, 0.02, 3e-3).fismo)[0]
    assert {k for k in base if base[k] != both[k]} == {"mu", "inv_root"}
    assert both["mu"] == 1e-3 and _field(both["inv_root"], "matmul_dtype") == "float32"
    assert _field(both["inv_root"], "every") == 10  # the preset's, kept
    joined = control_change("FISMO-T-B16-every1-fp32mm")  # two fields of one config, and blocks
    assert joined == {"block_size": 16, "inv_root": {"every": 1, "matmul_dtype": "float32"}}
    for name in ("FISMO-T-mu1e-3-mu1e-2", "FISMO-T-every1-every2", "FISMO-T-mu1e-3-", "FISMO-T-bf16-mu1e-3"):
        with pytest.raises(ValueError, match="not a FISMO control"):
            control_change(name)


def test_the_staleness_scripts_variants_are_names_of_the_naming_rule() -> None:
    """docs/scripts/root_staleness.py's rows: each a FISMO-T control; the refresh intervals at the printed damping."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("root_staleness", ROOT / "docs" / "scripts" / "root_staleness.py")
    staleness = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(staleness)
    changes = {name: control_change(f"FISMO-T-{name}") for name in staleness.VARIANTS}
    assert changes["mu1e-3"] == {"mu": 1e-3}
    assert {c["inv_root"]["every"] for c in changes.values() if "inv_root" in c} == {1, 2, 5}
    assert all(c.get("mu") in (1e-3, 1e-2) for c in changes.values())
