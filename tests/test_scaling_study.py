"""``docs/scripts/scaling_study.py``, the scaling study of issue 20 (point 3).

The full study takes most of an hour and is not run here. What is checked: the full preset's
sizes span what the issue asks (from the models' parameter counts, nothing trained), the
learning-rate search's rule on losses known in advance, and the reduced preset run end to end in
a subprocess: its outputs, the winner-inside-the-grid rule replayed from the runs it recorded,
the gain table against the recorded losses, the seeds, the plot, and a resumed run that trains
again exactly the runs removed from its ``results.json``, to the same losses, interrupted or not
without losing a recorded run; what a run's key and the report's environment line name; the
report in UTF-8. (The usage errors, a folder the study would replace among them, are
``tests/test_script_arguments.py``'s.)
"""

from __future__ import annotations

import json
import math
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "docs" / "scripts" / "scaling_study.py"
sys.path.insert(0, str(SCRIPT.parent))
import scaling_study as study  # noqa: E402

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


# ----------------------------------------------------------------------------- the presets
def test_full_preset_spans_16x_in_parameters_with_the_largest_above_1m_and_more_tokens_per_size():
    preset = study.PRESETS["full"]
    counts = [study.parameter_counts(preset.task(size))[0] for size in preset.sizes]
    assert len(counts) >= 3
    assert counts == sorted(counts) and len(set(counts)) == len(counts), counts
    assert counts[-1] / counts[0] >= 16, counts
    assert counts[-1] >= 1_000_000, counts
    steps = [size.steps for size in preset.sizes]  # same batch and context at every size: tokens grow with steps
    assert all(a < b for a, b in zip(steps, steps[1:])), steps


@pytest.mark.parametrize("name", sorted(study.PRESETS))
def test_the_blocked_configuration_splits_every_side_of_the_largest_sizes_matrices(name):
    preset = study.PRESETS[name]
    model = preset.task(preset.sizes[-1]).model()
    matrices = study.build_optimizer("AdamW", model, 1e-3, 1e-3).matrices
    sides = {side for p in matrices for side in p.shape}
    assert all(side % preset.block_size == 0 and side > preset.block_size for side in sides), (sides, preset.block_size)
    assert preset.optimizers(preset.sizes[-1]) == ("FISMO-T", f"FISMO-T-B{preset.block_size}", "Muon-torch", "AdamW")
    assert all(preset.optimizers(size) == ("FISMO-T", "Muon-torch", "AdamW") for size in preset.sizes[:-1])


def test_a_grid_that_is_not_a_factor_2_apart_is_rejected_naming_the_optimizer():
    bad = study.Preset(**{**vars(study.PRESETS["reduced"]), "grids": {**study.GRIDS, "AdamW": (1e-3, 3e-3, 1e-2)}})
    with pytest.raises(ValueError, match="lr grid of AdamW"):
        study.check_preset(bad)
    for preset in study.PRESETS.values():
        study.check_preset(preset)


def test_jobs_below_one_is_a_usage_error_naming_the_option(capsys):
    with pytest.raises(SystemExit) as exit_info:
        study.main(["--jobs", "0", "--out", "unused"])
    assert exit_info.value.code == 2
    assert "argument --jobs: must be a positive integer, got 0" in capsys.readouterr().err


# ----------------------------------------------------------------------------- the lr search
def test_a_size_grid_replaces_the_optimizers_grid_at_that_size_and_the_blocked_one_follows_the_candidate():
    preset = study.PRESETS["full"]
    small, large = preset.sizes[0], preset.sizes[-1]
    assert preset.grid(small, "Muon-torch") == study.GRIDS["Muon-torch"]  # no override at S
    assert preset.grid(large, "FISMO-T") == preset.size_grids["L"]["FISMO-T"] != study.GRIDS["FISMO-T"]
    assert preset.grid(large, preset.blocked) == preset.size_grids["L"][preset.blocked]
    follows = study.Preset(**{**vars(preset), "size_grids": {"L": {"FISMO-T": (0.02, 0.04, 0.08)}}})
    assert follows.grid(large, preset.blocked) == follows.grid(large, "FISMO-T") == (0.02, 0.04, 0.08)
    own = study.Preset(**{**vars(preset), "size_grids": {"L": {preset.blocked: (0.02, 0.04, 0.08)}}})
    assert own.grid(large, preset.blocked) == (0.02, 0.04, 0.08) and own.grid(large, "FISMO-T") == study.GRIDS["FISMO-T"]
    # Another candidate keeps the grids named by the default names.
    other = study.replace(preset, candidate="FISMO-T-mu1e-3")
    assert other.grid(large, other.blocked) == preset.grid(large, preset.blocked)
    assert other.grid(large, other.candidate) == preset.grid(large, "FISMO-T")


@pytest.mark.parametrize("size_grids, match", [
    ({"XL": {"AdamW": (1e-3, 2e-3, 4e-3)}}, "sizes it does not have: \\['XL'\\]"),
    ({"M": {"AdamW": (1e-3, 3e-3, 9e-3)}}, "lr grid of AdamW at size M must be ascending"),
    ({"M": {"AdamW": (1e-3, 2e-3)}}, "lr grid of AdamW at size M needs at least 3 values"),
    ({"M": {"Adamw": (1e-3, 2e-3, 4e-3)}}, "names optimizers it does not run: \\['Adamw'\\]"),
])
def test_a_bad_size_grid_is_rejected_naming_the_size(size_grids, match):
    bad = study.Preset(**{**vars(study.PRESETS["reduced"]), "size_grids": size_grids})
    with pytest.raises(ValueError, match=match):
        study.check_preset(bad)


def _search_with(loss, grid=(0.02, 0.04, 0.08), max_extensions=2) -> study.LrSearch:
    """Drive an ``LrSearch`` with ``loss(lr)`` until it stops proposing values."""
    search = study.LrSearch(grid, max_extensions)
    for lr in grid:
        search.record(lr, loss(lr))
    while (lr := search.extension()) is not None:
        search.record(lr, loss(lr))
    assert search.done
    return search


def _bowl(optimum: float):
    return lambda lr: math.log2(lr / optimum) ** 2


def test_a_winner_inside_the_grid_is_selected_without_extending_it():
    search = _search_with(_bowl(0.04))
    assert search.tried == [0.02, 0.04, 0.08] and search.best == 0.04 and search.inside


def test_a_winner_on_an_edge_extends_the_grid_beyond_that_edge_until_it_is_inside():
    up = _search_with(_bowl(0.16))  # 0.08 wins the grid, then 0.16 wins and 0.32 does not
    assert up.tried == [0.02, 0.04, 0.08, 0.16, 0.32] and up.best == 0.16 and up.inside
    down = _search_with(_bowl(0.02 / 2))
    assert down.tried == [0.02, 0.04, 0.08, 0.01, 0.005] and down.best == 0.01 and down.inside
    once = _search_with(_bowl(0.11))  # 0.08 wins, 0.16 loses to it: one extension is enough
    assert once.tried == [0.02, 0.04, 0.08, 0.16] and once.best == 0.08 and once.inside


def test_the_extensions_stop_at_the_cap_and_the_search_says_the_winner_is_on_an_edge():
    far = _search_with(_bowl(10.0))
    assert far.tried == [0.02, 0.04, 0.08, 0.16, 0.32] and far.best == 0.32 and not far.inside
    assert far.extensions == 2
    none = _search_with(_bowl(10.0), max_extensions=0)
    assert none.tried == [0.02, 0.04, 0.08] and not none.inside


def test_diverged_runs_count_as_infinite_loss_so_the_grid_extends_downwards():
    search = _search_with(lambda lr: None if lr > 0.015 else _bowl(0.01)(lr))
    assert search.tried == [0.02, 0.04, 0.08, 0.01, 0.005] and search.best == 0.01 and search.inside
    with pytest.raises(ValueError, match="lr 0.3 was not proposed"):
        search.record(0.3, 1.0)


# ----------------------------------------------------------------------------- the reduced study
@pytest.fixture(scope="module")
def reduced(tmp_path_factory):
    """The reduced preset run once, as a user runs it (2 worker processes): its folder, JSON and stderr."""
    out = tmp_path_factory.mktemp("scaling") / "results"
    done = subprocess.run([sys.executable, str(SCRIPT), "--preset", "reduced", "--jobs", "2", "--out", str(out)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return out, json.loads((out / "results.json").read_text()), done.stderr, done.stdout


def _seed0_in_order(doc, size, opt):
    """The (lr, loss) of the sweep's runs, in the order they were recorded."""
    return [(r["lr"], math.inf if r["final_val_loss"] is None else r["final_val_loss"]) for r in doc["runs"]
            if r["size"] == size and r["optimizer"] == opt and r["seed"] == 0]


def _argmin(pairs):
    return min(pairs, key=lambda p: (p[1], p[0]))[0]


def test_reduced_study_writes_its_outputs_and_reports_every_run_on_stderr(reduced):
    out, doc, stderr, stdout = reduced
    preset = study.PRESETS["reduced"]
    assert sorted(p.name for p in out.iterdir()) == ["report.md", "results.json", "scaling_gain.png"]
    assert (out / "scaling_gain.png").read_bytes()[:8] == PNG_SIGNATURE
    assert doc["complete"] and doc["preset"] == "reduced" and doc["seconds"] > 0 and doc["trained"] == len(doc["runs"])
    assert [s["name"] for s in doc["config"]["sizes"]] == [s.name for s in preset.sizes]
    assert "estimated wall time of preset 'reduced':" in stderr
    progress = re.findall(r"^\[(\d+)/(\d+)\] .*elapsed \d+:\d\d:\d\d, ETA \d+:\d\d:\d\d$", stderr, re.M)
    assert len(progress) == len(doc["runs"]) and progress[-1][0] == progress[-1][1] == str(len(doc["runs"]))
    assert (out / "report.md").read_text() in stdout
    for size in preset.sizes:
        n_all, n_matrices = study.parameter_counts(preset.task(size))
        runs = [r for r in doc["runs"] if r["size"] == size.name]
        assert {r["optimizer"] for r in runs} == set(preset.optimizers(size))
        assert all(r["parameters"] == n_all and r["matrix_parameters"] == n_matrices for r in runs)
        assert all(r["steps"] == size.steps and r["timed_steps"] == size.steps - 1 for r in runs if not r["diverged"])
        assert all(r[f"{t}_s"] > 0 for r in runs for t in study.TIMES if not r["diverged"])
        ratios = [t[f"{name}_vs_muon"] for t in doc["timing"][size.name].values() for name in study.TIMES]
        assert len(ratios) == 4 * len(preset.optimizers(size)) and all(0 < r < math.inf for r in ratios)
        assert all(doc["timing"][size.name]["Muon-torch"][f"{t}_vs_muon"] == 1.0 for t in study.TIMES)


def test_report_only_writes_the_same_report_from_a_finished_study(reduced, tmp_path, capsys):
    """``--report-only`` refuses a complete file without the study's fields before writing anything
    (``tests/test_script_arguments.py``); a real study's file passes that check and gives its report again.
    Its last line said "Wrote DIR/results.json" too, which it only read (a user's hunt, 2026-12-04)."""
    out, _, _, _ = reduced
    again = tmp_path / "again"
    again.mkdir()
    shutil.copy(out / "results.json", again / "results.json")
    assert study.main(["--report-only", "--out", str(again)]) == 0
    assert (again / "report.md").read_text() == (out / "report.md").read_text()
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last == f"Wrote {again / 'report.md'}, {again / 'scaling_gain.png'} from {again / 'results.json'}."


def test_report_only_writes_utf8_under_an_ascii_locale_and_prints_what_the_console_can(reduced, tmp_path):
    """The report (with − and ×) was written in the locale's encoding: under ``LC_ALL=C`` without UTF-8 mode it
    raised ``UnicodeEncodeError`` after the work and left ``report.md`` empty (a user's hunt, 2026-12-04). It is
    UTF-8 now, and the console gets ``?`` for what its encoding lacks (as ``fismo demo``'s)."""
    out, _, _, _ = reduced
    ascii_console = tmp_path / "ascii"
    shutil.copytree(out, ascii_console)
    env = {**os.environ, "LC_ALL": "C", "PYTHONUTF8": "0"}
    env.pop("PYTHONIOENCODING", None)
    done = subprocess.run([sys.executable, str(SCRIPT), "--report-only", "--out", str(ascii_console)],
                          capture_output=True, env=env, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr.decode(errors="replace")[-3000:]
    assert (ascii_console / "report.md").read_bytes() == (out / "report.md").read_bytes()
    assert "−" in (ascii_console / "report.md").read_text(encoding="utf-8")
    assert b"## Gain over Muon-torch (Muon-torch ? FISMO-T" in done.stdout


def test_the_reports_environment_line_names_the_machines_that_trained_the_runs(reduced):
    """The line was read anew on every call: a study resumed on another machine named that one for runs trained
    on the first (a user's hunt, 2026-12-04). Each run records its machine; the line is theirs."""
    _, doc, _, _ = reduced
    machines = {r["environment"] for r in doc["runs"]}
    assert machines == {doc["environment"]} and "torch CPU capability" in doc["environment"]
    mixed = [*doc["runs"][:3], *({**r, "environment": "another machine"} for r in doc["runs"][3:5])]
    assert study.runs_environment(mixed) == f"Runs trained on {doc['environment']} (3 runs); another machine (2 runs)"


def test_the_report_states_the_load_the_study_stored_not_the_current_one(reduced, monkeypatch):
    """The report read the load average when it was written, so ``--report-only`` differed from the study's own
    report under another load (CI 127: 3.7 against 3.6); it states the stored ``load_at_end`` (none if absent)."""
    _, doc, _, _ = reduced
    monkeypatch.setattr(study.os, "getloadavg", lambda: (99.0, 99.0, 99.0), raising=False)
    report = study.markdown_report({**doc, "load_at_end": 1.25})
    assert "load average at the end 1.2;" in report and "99" not in report.split("\n")[3]
    assert "load average" not in study.markdown_report({k: v for k, v in doc.items() if k != "load_at_end"})


def test_reduced_study_selects_each_lr_by_the_winner_inside_the_grid_rule(reduced):
    _, doc, _, _ = reduced
    preset = study.PRESETS["reduced"]
    for size in preset.sizes:
        for opt in preset.optimizers(size):
            sweep = _seed0_in_order(doc, size.name, opt)
            grid = preset.grid(size, opt)
            lrs = [lr for lr, _ in sweep]
            assert len(set(lrs)) == len(lrs) and set(grid) <= set(lrs), (size.name, opt, lrs)
            extensions = [lr for lr in lrs if lr not in grid]  # in the order they were run
            assert len(extensions) <= preset.max_extensions
            losses = dict(sweep)
            tried = list(grid)
            for lr in extensions:  # each extension went one factor 2 beyond the edge that was winning
                winner = _argmin([(x, losses[x]) for x in tried])
                assert winner in (min(tried), max(tried)), (size.name, opt, tried, winner)
                expected = max(tried) * 2 if winner == max(tried) else min(tried) / 2
                assert math.isclose(lr, expected), (size.name, opt, tried, lr)
                tried.append(lr)
            best = _argmin(sweep)
            inside = min(lrs) < best < max(lrs)
            assert inside or len(extensions) == preset.max_extensions, (size.name, opt, sweep)
            tuning = doc["tuning"][size.name][opt]
            assert tuning["best_lr"] == best and tuning["inside"] == inside
            assert tuning["extensions"] == len(extensions)
            repeats = [r for r in doc["runs"] if r["size"] == size.name and r["optimizer"] == opt and r["seed"] > 0]
            assert sorted(r["seed"] for r in repeats) == list(range(1, preset.seeds))
            assert all(r["lr"] == best for r in repeats)


def _selected_losses(doc, size, opt):
    best = doc["tuning"][size][opt]["best_lr"]
    return {r["seed"]: r["final_val_loss"] for r in doc["runs"]
            if r["size"] == size and r["optimizer"] == opt and r["lr"] == best}


def test_reduced_study_gain_is_muon_minus_fismo_per_seed_in_the_json_and_the_report(reduced):
    out, doc, _, _ = reduced
    preset = study.PRESETS["reduced"]
    report = (out / "report.md").read_text()
    section = report.split("## Gain over Muon-torch", 1)[1].split("##", 1)[0]
    rows = {tuple(cells[:3]): cells[3:] for cells in
            ([c.strip() for c in line.strip("|").split("|")] for line in section.splitlines() if line.startswith("| "))}
    for size in preset.sizes:
        muon = _selected_losses(doc, size.name, "Muon-torch")
        assert sorted(muon) == list(range(preset.seeds))
        for opt in [o for o in preset.optimizers(size) if o.startswith("FISMO-T")]:
            mine = _selected_losses(doc, size.name, opt)
            expected = {s: muon[s] - mine[s] for s in range(preset.seeds)}  # no run of the reduced study diverges
            assert {int(s): g for s, g in doc["gain"][size.name][opt].items()} == expected
            n_params = f"{doc['config']['sizes'][[s.name for s in preset.sizes].index(size.name)]['parameters']:,}"
            cells = rows[(size.name, n_params, opt)]
            assert cells[:preset.seeds] == [f"{expected[s]:+.4f}" for s in range(preset.seeds)]
            assert cells[preset.seeds + 1] == f"{sum(g > 0 for g in expected.values())}/{preset.seeds} seeds"
        assert "FISMO-T-B" not in str(doc["gain"][size.name]) or size == preset.sizes[-1]


def test_a_resumed_study_trains_only_the_missing_runs_and_gets_the_same_losses(reduced, tmp_path):
    out, doc, _, _ = reduced
    largest = study.PRESETS["reduced"].sizes[-1].name
    best = doc["tuning"][largest]["FISMO-T"]["best_lr"]
    removed = [r for r in doc["runs"] if r["size"] == largest and r["optimizer"] == "FISMO-T"
               and r["lr"] == best and r["seed"] in (0, 1)]  # a sweep run (its selection is made again) and a seed
    assert len(removed) == 2
    resumed = tmp_path / "resumed"
    shutil.copytree(out, resumed)
    partial = dict(doc, runs=[r for r in doc["runs"] if r not in removed], complete=False)
    (resumed / "results.json").write_text(json.dumps(partial))
    done = subprocess.run([sys.executable, str(SCRIPT), "--preset", "reduced", "--jobs", "1", "--out", str(resumed)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    again = json.loads((resumed / "results.json").read_text())
    assert again["trained"] == 2 and again["reused"] == len(doc["runs"]) - 2
    assert len(again["runs"]) == len(doc["runs"])
    removed_keys = {r["key"] for r in removed}
    retrained = {r["key"]: r["final_val_loss"] for r in again["runs"] if r["key"] in removed_keys}
    # One torch thread in both runs, the same seed and data: the same arithmetic, to the last bit.
    assert retrained == {r["key"]: r["final_val_loss"] for r in removed}
    assert again["tuning"] == doc["tuning"] and again["gain"] == doc["gain"]


def test_an_interrupted_resume_keeps_every_recorded_run_and_the_next_one_finishes(reduced, tmp_path, monkeypatch):
    """A resume rewrote ``results.json`` after each run with the runs it had reached only: a Ctrl-C while it
    trained its first missing run dropped 65 recorded runs to 10 (a user's hunt, 2026-12-04). The runs not
    reached yet are kept beside (``unused_runs``): nothing recorded is lost, and the next resume trains the
    missing run only. (Also: the recorded command quotes an argument with a space.)"""
    out, doc, _, _ = reduced
    preset = study.PRESETS["reduced"]
    largest = preset.sizes[-1].name
    best = doc["tuning"][largest]["FISMO-T"]["best_lr"]
    missing = [r for r in doc["runs"]
               if (r["size"], r["optimizer"], r["lr"], r["seed"]) == (largest, "FISMO-T", best, 0)]
    resumed = tmp_path / "resumed here"
    shutil.copytree(out, resumed)
    recorded = [r for r in doc["runs"] if r not in missing]
    (resumed / "results.json").write_text(json.dumps(dict(doc, runs=recorded, complete=False)))
    train_run = study.train_run

    def ctrl_c_at_the_first_missing_run(run):
        if run.steps > preset.pilot_steps + 1:  # not the pilot's
            raise KeyboardInterrupt
        return train_run(run)

    argv = ["--preset", "reduced", "--jobs", "1", "--out", str(resumed)]  # jobs 1: the runs train in this process
    monkeypatch.setattr(study, "train_run", ctrl_c_at_the_first_missing_run)
    with pytest.raises(KeyboardInterrupt):
        study.main(argv)
    interrupted = json.loads((resumed / "results.json").read_text())
    kept = {r["key"] for r in interrupted["runs"]} | {r["key"] for r in interrupted.get("unused_runs", [])}
    assert kept == {r["key"] for r in recorded} and not interrupted["complete"]
    monkeypatch.setattr(study, "train_run", train_run)
    assert study.main(argv) == 0
    again = json.loads((resumed / "results.json").read_text())
    assert again["trained"] == 1 and again["reused"] == len(recorded) and again["unused_runs"] == []
    assert sorted(r["key"] for r in again["runs"]) == sorted(r["key"] for r in doc["runs"])
    assert shlex.split(again["command"]) == ["python", "docs/scripts/scaling_study.py", *argv]


# ----------------------------------------------------------------------------- the environment
def _keys_under(env: dict[str, str]) -> dict[str, dict]:
    """FISMO-T's and Muon-torch's keys of one run, computed in a process with ``env`` added."""
    code = ("import json, sys; sys.path.insert(0, 'docs/scripts'); import scaling_study as s; "
            "p = s.PRESETS['reduced']; run = s._study_run(p, p.sizes[0], 'FISMO-T', 0.01, 0); "
            "print(json.dumps({o: json.loads(s.replace(run, optimizer=o).key()) for o in ('FISMO-T', 'Muon-torch')}))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env={**os.environ, **env})
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def test_a_runs_key_names_torchs_cpu_kernels_and_whether_bfloat16_is_native():
    """The key held the settings and the fismo and torch versions only, so a folder studied on one CPU was
    resumed on another (other kernels: every loss differs a little) by reusing its runs (a user's hunt,
    2026-12-04). It holds ``digest_key``'s line now: torch's CPU capability and whether bfloat16 is native,
    which FISMO-T's recorded ``matmul_dtype`` follows."""
    here = _keys_under({})
    baseline = _keys_under({"ATEN_CPU_CAPABILITY": "default"})  # torch's unvectorised kernels
    emulated = _keys_under({"ONEDNN_MAX_CPU_ISA": "AVX2"})  # bfloat16 emulated on every CPU
    for optimizer in ("FISMO-T", "Muon-torch"):
        assert len({json.dumps(keys[optimizer], sort_keys=True) for keys in (here, baseline, emulated)}) == 3
        assert "(DEFAULT kernels, bfloat16 " in baseline[optimizer]["environment"]
        assert "bfloat16 emulated" in emulated[optimizer]["environment"]
    assert emulated["FISMO-T"]["hyperparameters"]["inv_root"]["matmul_dtype"] is None
    native = "bfloat16 native" in here["FISMO-T"]["environment"]
    assert here["FISMO-T"]["hyperparameters"]["inv_root"]["matmul_dtype"] == ("bfloat16" if native else None)


def test_a_folder_studied_with_other_cpu_kernels_is_refused_not_reused(reduced, tmp_path):
    """Resumed under other kernels (``ATEN_CPU_CAPABILITY``, as on another CPU), a study reused every run and
    its report named the new CPU (a user's hunt, 2026-12-04): none of its runs can be reused there, and the
    folder is refused before any work (another ``--out``, or ``--fresh``), as it is."""
    out, doc, _, _ = reduced
    other = tmp_path / "other"
    shutil.copytree(out, other)
    done = subprocess.run([sys.executable, str(SCRIPT), "--preset", "reduced", "--jobs", "1", "--out", str(other)],
                          capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env={**os.environ, "ATEN_CPU_CAPABILITY": "default"})
    assert done.returncode == 2 and done.stdout == "", done.stdout[-3000:] + done.stderr[-3000:]
    line = done.stderr.splitlines()[-1]
    assert line.startswith(f"scaling_study.py: error: {other} holds {len(doc['runs'])} runs recorded with fismo ")
    assert "which this machine (fismo " in line and "DEFAULT kernels" in line
    assert line.endswith("; choose another --out, or pass --fresh to replace it")
    assert (other / "results.json").read_bytes() == (out / "results.json").read_bytes()


# ----------------------------------------------------------------------------- another candidate
def test_a_candidate_with_one_setting_changed_is_named_blocked_and_gridded_as_fismo_t():
    preset = study.replace(study.PRESETS["full"], candidate="FISMO-T-mu1e-3")
    study.check_preset(preset)
    large = preset.sizes[-1]
    assert preset.blocked == "FISMO-T-B64-mu1e-3"
    assert preset.optimizers(large) == ("FISMO-T-mu1e-3", "FISMO-T-B64-mu1e-3", "Muon-torch", "AdamW")
    assert preset.optimizers(preset.sizes[0]) == ("FISMO-T-mu1e-3", "Muon-torch", "AdamW")
    assert preset.grid(large, "FISMO-T-mu1e-3") == preset.grid(large, "FISMO-T") == preset.size_grids["L"]["FISMO-T"]
    assert preset.grid(large, preset.blocked) == preset.size_grids["L"]["FISMO-T-B64"]  # named by the default name
    model = preset.task(preset.sizes[0]).model()
    for name in preset.optimizers(large)[:2]:  # the one setting reaches the optimizer, blocks only in the blocked one
        fismo = study.build_optimizer(name, model, 0.01, 3e-3).fismo
        assert fismo.defaults["mu"] == 1e-3 and fismo.defaults["block_size"] == (64 if "-B64" in name else 512)
    joined = study.replace(preset, candidate="FISMO-T-mu1e-3-fp32mm")  # modifiers of two settings
    study.check_preset(joined)
    assert joined.blocked == "FISMO-T-B64-mu1e-3-fp32mm"
    fismo = study.build_optimizer(joined.blocked, model, 0.01, 3e-3).fismo
    assert fismo.defaults["mu"] == 1e-3 and fismo.defaults["inv_root"]["matmul_dtype"] == "float32"


def test_a_runs_record_holds_its_hyperparameters_so_a_changed_default_is_not_reused():
    """A FISMO run's key holds what its name means (the built group's settings), the baselines' do not need to."""
    task = study.PRESETS["reduced"].task(study.PRESETS["reduced"].sizes[0])
    run = study.StudyRun("XS", task, "FISMO-T", 0.01, 0, 6, 1, 3e-3)
    key = json.loads(run.key())
    assert key["hyperparameters"]["mu"] == 0.1 and key["hyperparameters"]["inv_root"]["every"] == 10
    other = json.loads(study.replace(run, optimizer="FISMO-T-mu1e-3").key())
    assert other["hyperparameters"]["mu"] == 1e-3
    assert "hyperparameters" not in json.loads(study.replace(run, optimizer="Muon-torch").key())


@pytest.mark.parametrize("candidate", ["FISMO-T-B32", "FISMO-T-B32-mu1e-3", "FISMO-SI", "FISMO-T-nonsense", "Muon"])
def test_a_candidate_that_is_not_fismo_t_with_one_setting_changed_is_refused(candidate, capsys):
    with pytest.raises(ValueError, match=f"candidate '{candidate}' is not FISMO-T"):
        study.check_preset(study.replace(study.PRESETS["full"], candidate=candidate))
    with pytest.raises(SystemExit) as exit_info:
        study.main(["--candidate", candidate, "--estimate-only"])
    assert exit_info.value.code == 2 and f"candidate '{candidate}'" in capsys.readouterr().err


def test_a_study_of_another_candidate_reuses_the_baselines_runs_and_trains_only_the_candidates(reduced, tmp_path):
    out, doc, _, _ = reduced
    other = tmp_path / "other"
    shutil.copytree(out, other)
    done = subprocess.run([sys.executable, str(SCRIPT), "--preset", "reduced", "--jobs", "1", "--out", str(other),
                           "--candidate", "FISMO-T-mu1e-3"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    again = json.loads((other / "results.json").read_text())
    preset = study.replace(study.PRESETS["reduced"], candidate="FISMO-T-mu1e-3")
    assert again["config"]["candidate"] == "FISMO-T-mu1e-3"
    names = {r["optimizer"] for r in again["runs"]}
    assert names == {"FISMO-T-mu1e-3", preset.blocked, "Muon-torch", "AdamW"}
    baselines = [r for r in doc["runs"] if r["optimizer"] in ("Muon-torch", "AdamW")]
    assert again["reused"] == len(baselines) and again["trained"] == len(again["runs"]) - len(baselines)
    assert {r["key"] for r in baselines} <= {r["key"] for r in again["runs"]}
    # FISMO-T's runs are kept, not used (a later call of FISMO-T in this folder reuses them)
    assert {r["key"] for r in again["unused_runs"]} == {r["key"] for r in doc["runs"]} - {r["key"] for r in baselines}
    assert set(again["gain"][preset.sizes[-1].name]) == {"FISMO-T-mu1e-3", preset.blocked}
    assert "# Scaling study: FISMO-T-mu1e-3 against torch.optim.Muon" in (other / "report.md").read_text()
