"""Bad arguments of the measurement scripts of ``docs/scripts``: each is refused with one line from argparse
(exit status 2, no traceback, nothing printed on stdout) before the script does any work, so every case
takes about as long as the script's imports. The shared types are ``docs/scripts/_arguments.py``'s.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

if importlib.util.find_spec("torch") is None:
    pytest.skip("the measurement scripts need torch", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "docs" / "scripts"
#: The models section's tracked store, which no test here may change.
STORE = ROOT / "docs" / "performance" / "model_steps.json"
POSITIVE = "must be a positive integer, got"


def refused(script: str, *args: str) -> str:
    """Run ``docs/scripts/<script>.py args`` from the repository root; check that it is a usage error before any
    work (exit status 2, no traceback, empty stdout) and return its one error line."""
    done = subprocess.run([sys.executable, f"docs/scripts/{script}.py", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    assert done.stdout == "", done.stdout
    line = done.stderr.splitlines()[-1]
    assert line.startswith(f"{script}.py: error: "), done.stderr
    return line


CASES = [
    # scaling_study.py (the paths under tmp_path: below)
    ("scaling_study", ["--pilot-steps", "0", "--estimate-only"], f"argument --pilot-steps: {POSITIVE} 0"),
    # options a mode does not use were ignored silently, --report-only's --preset too (a user's hunt, 2026-12-04)
    ("scaling_study", ["--report-only", "--out", "/nonexistent/study", "--preset", "full", "--candidate",
                       "FISMO-T-mu1e-3", "--fresh", "--jobs", "7", "--pilot-steps", "3"],
     "--preset, --candidate, --jobs, --pilot-steps, --fresh: not used by --report-only, which reads the study's "
     "settings from DIR/results.json"),
    ("scaling_study", ["--report-only", "--preset", "reduced", "--out", "/nonexistent/study"],
     "--preset: not used by --report-only"),
    ("scaling_study", ["--report-only", "--estimate-only", "--out", "/nonexistent/study"],
     "--estimate-only: not used by --report-only"),
    ("scaling_study", ["--estimate-only", "--preset", "reduced", "--out", "/nonexistent/study", "--fresh"],
     "--out, --fresh: not used by --estimate-only, which writes nothing"),
    # gpu_checks.py: a file as --out failed after every stage (FileExistsError; a user's hunt, 2026-12-04)
    ("gpu_checks", ["--quick", "--out", "README.md"], "argument --out: README.md is not a directory"),
    # performance.py
    ("performance", ["--only", "threads", "--repeats", "0"], f"argument --repeats: {POSITIVE} 0"),
    ("performance", ["--only", "memory", "--threads", "-1"], f"argument --threads: {POSITIVE} -1"),
    ("performance", ["--only", "memory", "--threads", "0"], f"argument --threads: {POSITIVE} 0"),
    ("performance", ["--only", "deviation", "--steps", "0"], f"argument --steps: {POSITIVE} 0"),
    ("performance", ["--only", "deviation", "--block", "0"], f"argument --block: {POSITIVE} 0"),
    ("performance", ["--only", "models", "--names", "bogus"], "argument --names: invalid choice: 'bogus'"),
    # an option of a section that --only does not run was ignored silently (a user's hunt, 2026-12-03)
    ("performance", ["--only", "memory", "--steps", "50", "--block", "64"],
     "--steps, --block: for the deviation section, which --only memory does not run"),
    ("performance", ["--only", "deviation", "--device", "cuda", "--tables"],
     "--device, --tables: for the models section, which --only deviation does not run"),
    ("performance", ["--only", "models", "--tables", "--model", "llama-4096x11008"],
     "argument --model: invalid choice: 'llama-4096x11008' (choose from 'gpt2-2layers', 'llama-2048x5504')"),
    # overhead.py
    ("overhead", ["--no-gpt", "--configs", "muon", "--scale", "0"], f"argument --scale: {POSITIVE} 0"),
    ("overhead", ["--no-gpt", "--configs", "muon", "--scale", "-16"], f"argument --scale: {POSITIVE} -16"),
    ("overhead", ["--no-gpt", "--configs", "muon", "--scale", "5"],
     "--scale 5 must divide GPT-2's sides and the block sizes counted (768, 2304, 3072)"),
    ("overhead", ["--no-gpt", "--verify-scale", "512"],
     "--verify-scale 512 must divide GPT-2's sides and the block sizes counted (256, 768, 2304, 3072)"),
    ("overhead", ["--no-gpt", "--configs", "muon", "--layers", "0"], f"argument --layers: {POSITIVE} 0"),
    ("overhead", ["--no-gpt", "--configs", "muon", "--verify-scale", "0"], f"argument --verify-scale: {POSITIVE} 0"),
    ("overhead", ["--configs", "muon", "--no-compile", "--repeats", "0"], f"argument --repeats: {POSITIVE} 0"),
    ("overhead", ["--no-gpt", "--configs", "muon", "propagate", "--breakdown", "bogus"],
     "argument --breakdown: invalid choice: 'bogus'"),
    ("overhead", ["--no-gpt", "--configs", "muon", "propagate", "--breakdown", "default"],
     "--breakdown default: not counted; add it to --configs (muon propagate)"),
    # profile_step.py
    ("profile_step", ["--shape", "64x64", "--block", "32", "--steps", "0"], f"argument --steps: {POSITIVE} 0"),
    ("profile_step", ["--shape", "4x64x64", "--block", "32"],
     "argument --shape: must be MxN with positive integers, e.g. 768x3072, got '4x64x64'"),
    ("profile_step", ["--shape", "64"], "argument --shape: must be MxN with positive integers, e.g. 768x3072, got '64'"),
    ("profile_step", ["--block", "32"], "--block applies to --shape only"),
    ("profile_step", ["--threads", "0"], f"argument --threads: {POSITIVE} 0"),
    # root_staleness.py
    ("root_staleness", ["--seeds", "0", "--only", "Muon-torch"], f"argument --seeds: {POSITIVE} 0"),
    ("root_staleness", ["--only", "bogus"], "argument --only: invalid choice: 'bogus'"),
    # a learning rate of 0 or NaN trained every run for minutes and reported nothing measurable
    ("root_staleness", ["--lr", "0", "--only", "Muon-torch"], "argument --lr: must be a positive, finite number, got 0.0"),
    ("root_staleness", ["--lr", "nan", "--only", "Muon-torch"], "argument --lr: must be a positive, finite number, got nan"),
    ("root_staleness", ["--lr", "fast", "--only", "Muon-torch"], "argument --lr: must be a positive number, got 'fast'"),
    # distributed_traffic.py
    ("distributed_traffic", ["--worlds", "0"], f"argument --worlds: {POSITIVE} 0"),
    ("distributed_traffic", ["--worlds", "-1"], f"argument --worlds: {POSITIVE} -1"),
    ("distributed_traffic", ["--worlds", "2", "5"],
     "--worlds 5: the full-size figures are exact only for world sizes that divide the matrices' rows evenly: "
     "1, 2, 3, 4, 6, 8, 12, 16, 24, 48"),
    # polar_cut.py and warm_start.py take no options
    ("polar_cut", ["--bogus-option"], "unrecognized arguments: --bogus-option"),
    ("warm_start", ["--bogus-option"], "unrecognized arguments: --bogus-option"),
    # found by a user's hunt, 2026-12-04: tracebacks after the work, or arguments ignored and the whole run made
    ("block_deviation", ["--steps", "0", "--no-plot"], f"argument --steps: {POSITIVE} 0"),  # IndexError
    ("block_deviation", ["--threads", "0", "--no-plot"], f"argument --threads: {POSITIVE} 0"),  # torch's choice, silently
    ("fast_path_accuracy", ["--steps", "50"],
     "argument --steps: must be above 100 (the table compares steps 100-199 with the last 100), got 50"),
    ("dynamo_tracing", ["--repeats", "0"], f"argument --repeats: {POSITIVE} 0"),  # CalledProcessError after 11 s
    ("default_path_outputs", ["--check", "/nonexistent/before"],  # FileNotFoundError after 50 s of work
     "argument --check: /nonexistent/before.npz does not exist (write it with --save first)"),
    ("ddp_mismatched_grads", ["--propgate"], "unrecognized arguments: --propgate"),  # ran the "raise" case
    ("ddp_state_dict_on_one_rank", ["bogus"], "argument idiom: invalid choice: 'bogus'"),  # exit status 1
    ("ddp_state_dict_on_one_rank", ["every", "extra"], "unrecognized arguments: extra"),  # ignored
    ("lite_cpp_wrapper", ["--stage", "x"], "argument --stage: invalid int value: 'x'"),  # ValueError traceback
    *[(script, ["--bogus-option"], "unrecognized arguments: --bogus-option") for script in (
        "compile_precision", "inductor_cache_isa", "inductor_float64_sources", "cpu_kernels", "compiled_lr_schedule",
        "exact_derivatives", "notes_measurements", "lite_cpp_wrapper")],  # every argument ignored, --help too
]

#: The scripts without options: ``--help`` prints the usage and the docstring's first line, and runs nothing.
NO_OPTIONS = ["polar_cut", "scipy_equivalents", "warm_start", "compile_precision", "inductor_cache_isa", "inductor_float64_sources",
              "cpu_kernels", "compiled_lr_schedule", "exact_derivatives", "notes_measurements", "lite_cpp_wrapper",
              "inductor_float64", "inductor_float64_configs"]


@pytest.mark.parametrize(("script", "args", "message"), CASES, ids=[f"{s} {' '.join(a)}" for s, a, _ in CASES])
def test_a_bad_argument_is_one_usage_line_before_any_work(script, args, message):
    assert message in refused(script, *args)


@pytest.mark.parametrize("script", NO_OPTIONS)
def test_help_prints_the_usage_and_the_docstrings_first_line_without_running(script):
    done = subprocess.run([sys.executable, f"docs/scripts/{script}.py", "--help"], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0 and done.stderr == "", done.stderr
    first_line = ast.get_docstring(ast.parse((SCRIPTS / f"{script}.py").read_text())).splitlines()[0]
    assert done.stdout.startswith(f"usage: {script}.py [-h]\n"), done.stdout
    assert " ".join(first_line.split()) in " ".join(done.stdout.split()), done.stdout
    assert "|" not in done.stdout  # no table: the measurement did not run


def test_default_path_outputs_names_its_file_as_numpy_writes_it(tmp_path, monkeypatch):
    """``--save before`` printed "saved ... to before" while NumPy wrote ``before.npz``, and ``--check before``
    then failed after the work: both now take the name with ``.npz`` (a user's hunt, 2026-12-04)."""
    monkeypatch.syspath_prepend(str(SCRIPTS))
    import default_path_outputs

    assert default_path_outputs.npz_to_write(str(tmp_path / "before")) == tmp_path / "before.npz"
    assert default_path_outputs.npz_to_write(str(tmp_path / "before.npz")) == tmp_path / "before.npz"
    (tmp_path / "before.npz").write_bytes(b"")
    assert default_path_outputs.npz_to_read(str(tmp_path / "before")) == tmp_path / "before.npz"


# ------------------------------------------------------------------------------------- scaling_study.py's paths
def test_report_only_without_results_json_names_the_missing_file(tmp_path):
    line = refused("scaling_study", "--report-only", "--out", str(tmp_path / "missing"))
    assert f"--report-only: {tmp_path / 'missing' / 'results.json'} does not exist" in line


def test_report_only_on_a_cut_results_json_says_it_cannot_be_read(tmp_path):
    (tmp_path / "results.json").write_text('{"runs": [\n')
    line = refused("scaling_study", "--report-only", "--out", str(tmp_path))
    assert f"--report-only: cannot read {tmp_path / 'results.json'}: Expecting value" in line


def test_report_only_on_a_complete_results_json_without_its_fields_is_refused(tmp_path):
    """``{"complete": true}`` alone passed the check and the report raised ``KeyError`` (a traceback)."""
    (tmp_path / "results.json").write_text('{"complete": true}')
    line = refused("scaling_study", "--report-only", "--out", str(tmp_path))
    assert f"--report-only: {tmp_path / 'results.json'} says it is complete but lacks the study's fields (KeyError" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.json"]


@pytest.mark.parametrize(("mode", "below"), [(["--preset", "reduced", "--jobs", "1"], ""), (["--report-only"], "sub")])
def test_an_out_that_is_or_lies_in_a_file_is_refused(tmp_path, mode, below):
    (tmp_path / "afile").write_text("mine")
    line = refused("scaling_study", *mode, "--out", str(tmp_path / "afile" / below))
    assert f"argument --out: {tmp_path / 'afile'} is not a directory" in line
    assert (tmp_path / "afile").read_text() == "mine"


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs /proc")
@pytest.mark.parametrize("out", ["/proc/self", "/proc/self/study"])
def test_an_out_where_nothing_can_be_written_is_refused_before_the_pilot(out):
    """Accepted, it failed with a traceback after the pilot and a first run (minutes for the full preset; a
    user's hunt, 2026-12-04). ``/proc/self``: a folder in which nobody, root included, can create a file."""
    line = refused("scaling_study", "--preset", "reduced", "--jobs", "1", "--out", out)
    assert "argument --out: cannot write in /proc/self: " in line


RECORDED_RUN = {"key": json.dumps({"size": "XS", "environment": "fismo 0.0.1, Python 3.9.0, torch 1.0 (AVX2 kernels, "
                                   "bfloat16 emulated, x86_64)"})}


@pytest.mark.parametrize(("content", "holds"), [
    (json.dumps({"study": "scaling", "preset": "full", "runs": [RECORDED_RUN]}),
     "{out} holds a study of preset 'full' (1 run recorded)"),
    (json.dumps({"study": "scaling", "preset": "reduced", "runs": [RECORDED_RUN]}),
     "{out} holds 1 run recorded with fismo 0.0.1, Python 3.9.0, torch 1.0 (AVX2 kernels, bfloat16 emulated, "
     "x86_64), which this machine (fismo "),
    (json.dumps({"study": "scaling", "preset": "reduced", "runs": [{"key": '{"fismo": "0.1.0", "torch": "2.5"}'}]}),
     "{out} holds 1 run recorded with an environment their keys do not name (recorded before 2026-12-04)"),
    ('{"runs": [\n', "{out}/results.json: cannot read it: Expecting value"),
    ('{"losses": [1.5, 1.25]}', "{out}/results.json: it is not a scaling study's results.json"),
], ids=["another preset", "another environment", "keys before 2026-12-04", "a cut file", "another file"])
def test_a_folder_holding_what_the_study_would_replace_is_refused_before_any_work(tmp_path, content, holds):
    """The presets share the default ``--out``: the reduced preset run there replaced the full preset's
    runs, as any study replaced runs of another environment or a ``results.json`` it could not read, without a
    word (a user's hunt, 2026-12-04). Each is refused, saying what the folder holds and what to do."""
    (tmp_path / "results.json").write_text(content)
    line = refused("scaling_study", "--preset", "reduced", "--jobs", "1", "--out", str(tmp_path))
    assert holds.format(out=tmp_path) in line
    assert line.endswith("; choose another --out, or pass --fresh to replace it")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.json"]
    assert (tmp_path / "results.json").read_text() == content


# ------------------------------------------------------------------------------ performance.py's models store
def test_json_naming_a_directory_is_refused(tmp_path):
    line = refused("performance", "--only", "models", "--tables", "--json", str(tmp_path))
    assert f"argument --json: {tmp_path} is a directory, not a file" in line


def test_tables_of_a_missing_or_cut_store_are_refused(tmp_path):
    line = refused("performance", "--only", "models", "--tables", "--json", str(tmp_path / "none.json"))
    assert f"--tables: {tmp_path / 'none.json'} does not exist" in line
    (tmp_path / "cut.json").write_text('{"gpt2-2layers/cpu": {\n')
    line = refused("performance", "--only", "models", "--tables", "--json", str(tmp_path / "cut.json"))
    assert f"cannot read the stored rows in {tmp_path / 'cut.json'}" in line


def test_device_cuda_without_cuda_is_refused_and_no_store_changes(tmp_path):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("torch sees a CUDA device here")
    tracked = STORE.read_bytes()
    mine = tmp_path / "store.json"
    mine.write_text('{"gpt2-2layers/cpu": {}}\n')
    timing = ["--only", "models", "--device", "cuda", "--model", "gpt2-2layers", "--names", "eigh-B768", "--repeats", "1"]
    for args in (timing + ["--json", str(mine)], ["--device", "cuda"]):  # the second: every section, the tracked store
        assert "--device cuda: torch sees no CUDA device" in refused("performance", *args)
    assert mine.read_text() == '{"gpt2-2layers/cpu": {}}\n' and sorted(p.name for p in tmp_path.iterdir()) == ["store.json"]
    assert STORE.read_bytes() == tracked


def test_a_model_whose_every_step_was_skipped_stores_nothing(tmp_path, monkeypatch, capsys):
    """Every row is a ratio to the float32 Muon step: without it the models section once stored an empty
    model (the key with no rows), or would have raised ``KeyError`` on the ratio."""
    monkeypatch.syspath_prepend(str(SCRIPTS))
    import performance

    def missing(name, model, device, shapes=None):
        raise NotImplementedError(f"{name} is not installed here")

    monkeypatch.setattr(performance, "model_callable", missing)
    monkeypatch.setattr(performance, "plot_models", lambda device, store: None)
    store = tmp_path / "store.json"
    store.write_text('{"gpt2-2layers/cpu": {}}\n')
    performance.section_models(1, ["llama-2048x5504"], ["eigh-B768"], "cpu", store=store)
    out = capsys.readouterr().out
    assert "<!-- llama-2048x5504 on cpu: nothing stored, the float32 Muon step was skipped -->" in out
    assert store.read_text() == '{"gpt2-2layers/cpu": {}}\n'


def test_the_performance_pages_model_tables_are_the_stores(monkeypatch, capsys):
    """The page's tables between its ``models-tables`` markers are what ``--only models --tables`` prints from
    the tracked store: they had lost the FISMO-T rows and kept an older run's Muon rows, while the plot
    beside them had both (a user's hunt, 2026-12-04)."""
    monkeypatch.syspath_prepend(str(SCRIPTS))
    import performance

    page = (ROOT / "docs" / "performance.md").read_text()
    for device, marker in (("cpu", "models-tables"), ("cuda", "models-tables-cuda")):  # cuda: an H200, 2026-12-04
        performance.print_model_tables(device, STORE)
        printed = capsys.readouterr().out
        tables = printed[printed.index("**gpt2-2layers**"):].strip()
        start, end = f"<!-- {marker}:start -->", f"<!-- {marker}:end -->"
        assert page[page.index(start) + len(start):page.index(end)].strip() == tables, device
