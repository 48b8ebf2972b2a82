"""``docs/scripts/gpu_checks.py``, the GPU checks in one command (issue 19, point 7).

On a machine without a GPU the command must run, say which stages it skipped and why, and
exit 0; a stage that fails must not stop the next ones and must make the exit status 1. The
compiled-step check (stage 3) is run here on the CPU with dynamo's ``eager`` backend, the same
code the GPU runs with ``mode="reduce-overhead"``.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "docs" / "scripts"))
import gpu_checks  # noqa: E402
from gpu_checks import (  # noqa: E402
    CUPY,
    TORCH_CUDA,
    Options,
    Stage,
    StageResult,
    exit_status,
    performance_tables,
    pick_stages,
    pytest_counts,
    run_stages,
    summary_table,
    verify_rows,
)


#: dynamo warns, once per call site, that it traces array-api-compat's lru_cache-wrapped helpers.
_LRU_CACHE_WARNING = "ignore:Dynamo detected a call to a `functools.lru_cache`-wrapped function:UserWarning"


def _devices_here() -> dict:
    return gpu_checks.device_reasons()


def test_without_a_gpu_every_stage_is_skipped_with_the_reason_and_the_exit_status_is_0(tmp_path):
    devices = _devices_here()
    if devices[TORCH_CUDA] is None or devices[CUPY] is None:
        pytest.skip("a GPU is present: the script would run its GPU stages (minutes); run it directly")
    done = subprocess.run(
        [sys.executable, str(ROOT / "docs" / "scripts" / "gpu_checks.py"), "--quick", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    summary = json.loads((tmp_path / "summary.json").read_text())
    stages = {s["stage"]: s for s in summary["stages"]}
    assert list(stages) == ["tests", "verify", "compile", "performance"]
    assert all(s["status"] == "skipped" for s in stages.values()), stages
    # The reasons say what is missing, in fismo verify's words.
    no_cuda = "torch.cuda.is_available() is False"
    for name in ("compile", "performance"):
        assert no_cuda in stages[name]["reason"]
    for name in ("tests", "verify"):  # these run with either torch on CUDA or CuPy
        assert no_cuda in stages[name]["reason"] and devices[CUPY] in stages[name]["reason"]
    # The closing table (printed and in summary.txt): one row per stage, its status and reason.
    table = (tmp_path / "summary.txt").read_text()
    assert table in done.stdout
    rows = [line for line in table.splitlines() if re.match(r"\d \w+ +(passed|failed|skipped) ", line)]
    assert [row.split()[1] for row in rows] == ["tests", "verify", "compile", "performance"]
    assert all(row.split()[2] == "skipped" for row in rows)
    assert table.rstrip().endswith("0 passed, 0 failed, 4 skipped")


def _stage(name: str, outcome, needs=()) -> Stage:
    def run(options: Options, log) -> StageResult:
        log.say(f"{name} ran")
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    return Stage(name, f"the {name} stage", run, needs)


def test_a_failing_stage_does_not_stop_the_next_and_makes_the_exit_status_1(tmp_path):
    stages = [
        _stage("first", StageResult("passed", figures={"count": "3"})),
        _stage("raises", RuntimeError("boom\nsecond line")),
        _stage("fails", StageResult("failed", "2 graph breaks")),
        _stage("needs_gpu", StageResult("passed"), needs=(TORCH_CUDA,)),
        _stage("last", StageResult("passed")),
    ]
    devices = {TORCH_CUDA: "no CUDA here", CUPY: "no CuPy here"}
    results = run_stages(stages, Options(out=tmp_path), devices)
    got = {stage.name: (result.status, result.reason) for stage, result in results}
    assert got == {
        "first": ("passed", ""),
        "raises": ("failed", "RuntimeError: boom"),
        "fails": ("failed", "2 graph breaks"),
        "needs_gpu": ("skipped", "no CUDA here"),
        "last": ("passed", ""),
    }
    assert all(result.seconds >= 0 for _, result in results)
    assert exit_status(results) == 1
    # Each stage that ran has its log; the one that raised has its traceback there.
    assert (tmp_path / "5-last.log").read_text() == "last ran\n"
    assert "RuntimeError: boom" in (tmp_path / "2-raises.log").read_text()
    assert not (tmp_path / "4-needs_gpu.log").exists()
    # Without the failures, passed and skipped stages make exit status 0.
    assert exit_status([r for r in results if r[1].status != "failed"]) == 0


def test_a_stage_runs_when_any_one_of_the_devices_it_needs_is_there(tmp_path):
    stage = _stage("either", StageResult("passed"), needs=(TORCH_CUDA, CUPY))
    [(_, only_cupy)] = run_stages([stage], Options(out=tmp_path), {TORCH_CUDA: "no CUDA here", CUPY: None})
    [(_, neither)] = run_stages([stage], Options(out=tmp_path), {TORCH_CUDA: "no CUDA here", CUPY: "no CuPy here"})
    assert only_cupy.status == "passed"
    assert (neither.status, neither.reason) == ("skipped", "no CUDA here; no CuPy here")


def test_summary_table_has_a_row_per_stage_with_status_wall_time_reason_and_figures():
    long = "x" * 150
    results = [
        (_stage("compile", None), StageResult("failed", "2 graph breaks", {"tiny-gpt": long}, seconds=12.34)),
        (_stage("tests", None), StageResult("passed", figures={"tests": "5 passed"}, seconds=1.0)),
        (_stage("verify", None), StageResult("skipped", "no CUDA here", seconds=0.0)),
    ]
    table = summary_table(results, width=100)
    lines = table.splitlines()
    assert lines[2].split()[:5] == ["1", "compile", "failed", "12.3", "s"]
    assert lines[2].endswith("2 graph breaks")
    assert all(len(line) <= 100 for line in lines[:-1])  # the long figure is wrapped, not cut
    wrapped = lines[3:lines.index(next(line for line in lines if line.startswith("2 ")))]
    assert "".join(line.strip() for line in wrapped) == "tiny-gpt: " + long
    assert [line.split() for line in lines if line[:2] in ("2 ", "3 ")] == [
        ["2", "tests", "passed", "1.0", "s", "tests:", "5", "passed"],
        ["3", "verify", "skipped", "0.0", "s", "no", "CUDA", "here"],
    ]
    assert lines[-1] == "1 passed, 1 failed, 1 skipped"


def test_pick_stages_by_name_or_number_in_the_commands_order():
    assert [s.name for s in pick_stages(None)] == ["tests", "verify", "compile", "performance"]
    assert [s.name for s in pick_stages("compile,1")] == ["tests", "compile"]
    assert [s.name for s in pick_stages(" verify , 4 ")] == ["verify", "performance"]
    with pytest.raises(ValueError, match=r"unknown stage 'gpu'.*1 tests, 2 verify, 3 compile, 4 performance"):
        pick_stages("tests,gpu")
    with pytest.raises(ValueError, match="none given"):
        pick_stages(",")
    with pytest.raises(SystemExit) as exit_info:
        gpu_checks.main(["--stages", "5"])
    assert exit_info.value.code == 2


def test_pytest_counts_reads_the_closing_line():
    output = "...s.F\nSKIPPED [2] tests/x.py:3: no CUDA\n3 passed, 2 skipped, 1 failed, 1 error, 40 deselected in 2.50s\n"
    assert pytest_counts(output) == {"passed": 3, "skipped": 2, "failed": 1, "error": 1, "deselected": 40}
    assert pytest_counts("1 passed in 0.1s") == {"passed": 1}
    assert pytest_counts("ERROR: file not found") == {}


def test_verify_rows_are_the_gpu_targets_of_the_table():
    output = "\n".join([
        "backend           device      dtype    steps  max rel. error  tolerance  result",
        "torch             cpu         float32  50     2.97e-05        1e-04      pass",
        "torch             cuda        float32  50     3.10e-05        1e-04      pass",
        "torch             cuda        float64  -      -               1e-10      skipped: torch reports no CUDA device",
        "cupy              cuda        float32  50     2.00e-05        1e-04      FAIL at line 8 direction",
        "8 passed, 0 failed, 4 skipped",
    ])
    rows = verify_rows(output)
    assert [(r[0], r[1], r[2], r[4], r[6]) for r in rows] == [
        ("torch", "cuda", "float32", "3.10e-05", "pass"),
        ("torch", "cuda", "float64", "-", "skipped: torch reports no CUDA device"),
        ("cupy", "cuda", "float32", "2.00e-05", "FAIL at line 8 direction"),
    ]


def test_performance_tables_reads_the_tables_performance_py_prints(capsys):
    """Parsed from ``performance.py``'s own ``print_model_tables`` (its stored CPU rows), so the
    format the parser expects is the one the script writes."""
    pytest.importorskip("torch")
    import performance

    stored = performance.load_model_results()
    if not any(key.endswith("/cpu") for key in stored):
        pytest.skip("no stored CPU rows in docs/performance/model_steps.json")
    performance.print_model_tables("cpu")
    figures = performance_tables(capsys.readouterr().out)
    for model in performance.PAGE_MODELS:
        rows = stored.get(f"{model}/cpu", {})
        if not rows:
            continue
        assert figures[model].startswith(f"{len(rows)} rows")
        fismo = {performance.LABELS.get(n, n): r["seconds"] / r["torch_muon_seconds"]
                 for n, r in rows.items() if performance.LABELS.get(n, n).startswith("FISMO") and r["torch_muon_seconds"]}
        shown = {label: f"{ratio:.2f}" for label, ratio in fismo.items()}  # as the table prints them
        best = min(float(v) for v in shown.values())
        assert f"{best:.2f}× torch.optim.Muon" in figures[model]
        assert any(f"fastest FISMO row {label!r}" in figures[model] for label, v in shown.items() if float(v) == best)


@pytest.mark.filterwarnings(_LRU_CACHE_WARNING)
def test_compiled_step_check_on_cpu():
    """Stage 3's check, with dynamo's ``eager`` backend on the CPU (the GPU runs inductor with CUDA
    graphs): one graph, no break, no recompile after the first step, no host read
    under ``nonfinite="propagate"``, and the compiled parameters equal to the eager ones bit for bit
    (the eager backend runs the traced ops as they are)."""
    pytest.importorskip("torch._dynamo")
    params = gpu_checks.MODELS["tiny-gpt"]()
    check = gpu_checks.check_compiled_step(
        params, model="tiny-gpt", dtype="float32", config="propagate", device="cpu",
        compile_options={"backend": "eager", "fullgraph": True}, repeats=1,
    )
    assert check.problems == [] and check.errors == {}
    assert check.graphs_first_step == 1  # the state is created while dynamo traces (FISMO._init_group)
    assert (check.graph_breaks, check.recompiles_after_first_step, check.host_reads_eager_step) == (0, 0, 0)
    assert check.max_rel_diff == 0.0
    assert check.aten_ops_eager_step > 0
    assert set(check.medians_ms) == {"FISMO eager", "FISMO compiled", "Muon eager", "Muon compiled"}
    assert all(ms > 0 for ms in check.medians_ms.values())
    assert "0 breaks, 0 recompiles after the first compiled step" in check.summary()


@pytest.mark.filterwarnings(_LRU_CACHE_WARNING)
def test_compiled_step_check_in_float64_with_inductor_on_cpu():
    """Stage 3's float64 case (`FLOAT64_CONFIGS`), here with inductor's default mode on the CPU: the
    compiled step equals the eager one bit for bit (the adapter's ``EagerKernels``), which stage 3 then
    reports on CUDA, not judged (``tolerance`` None)."""
    pytest.importorskip("torch._dynamo")
    params = gpu_checks.MODELS["tiny-gpt"]()
    check = gpu_checks.check_compiled_step(
        params, model="tiny-gpt", dtype="float64", config=gpu_checks.FLOAT64_CONFIGS[0], device="cpu",
        compile_options={"fullgraph": True}, repeats=1,
    )
    assert check.problems == [] and check.errors == {} and check.tolerance is None
    assert check.max_rel_diff == 0.0 and check.graph_breaks == 0


@pytest.mark.filterwarnings(_LRU_CACHE_WARNING)
@pytest.mark.parametrize("config", ["training, propagate", "propagate, compiled after 2 eager steps",
                                    "propagate, AdamW biases"])
def test_compiled_step_check_of_the_training_configuration_and_after_eager_steps(config):
    """Stage 3's other configurations, as above on the CPU: ``FISMO.training`` (its roots recomputed at
    step 11, inside the one graph), and a compile that finds the states of two eager steps (one graph,
    and every step count still on the CPU), and AdamW groups beside the matrices. The training
    configuration's eager step reads its 8 step counts to decide whether roots are due, in one read
    (one per matrix until 2026-12-03), and AdamW the 8 of its biases (``torch.optim.adamw``): CPU
    tensors, which on a GPU the check does not count (they do not wait for the device); on the CPU they
    are the one problem reported."""
    pytest.importorskip("torch._dynamo")
    params = gpu_checks.MODELS["tiny-gpt"]()
    check = gpu_checks.check_compiled_step(
        params, model="tiny-gpt", dtype="float32", config=config, device="cpu",
        compile_options={"backend": "eager", "fullgraph": True}, repeats=1,
    )
    reads, site = {"training, propagate": (1, "_roots_due_read_on_the_host"),
                   "propagate, AdamW biases": (8, "adamw_group_step")}.get(config, (0, None))
    step_count_reads = [p for p in check.problems if site and p.startswith(f"{reads} host reads") and f"{site})" in p]
    expected = 1 if site else 0
    assert len(step_count_reads) == expected and check.problems == step_count_reads and check.errors == {}
    assert (check.graphs_first_step, check.graph_breaks, check.recompiles_after_first_step) == (1, 0, 0)
    assert check.step_count_devices == ["cpu"] and check.max_rel_diff == 0.0
    training = gpu_checks.build_fismo(gpu_checks.MODELS["tiny-gpt"](), "training, propagate")
    assert training.param_groups[0]["inv_root"]["every"] == 10 < gpu_checks.CONFIGS["training, propagate"]["steps"]


@pytest.mark.filterwarnings(_LRU_CACHE_WARNING)
def test_compiled_step_check_with_inductor_lite_on_cpu():
    """The lite configuration as the stage builds it (inductor's lite mode, CUDA graphs asked for, which a
    CPU graph skips without it being a problem there): one graph, and on the tiny GPT the compiled
    parameters equal the eager ones bit for bit, as ATen's kernels run on both sides."""
    pytest.importorskip("torch._dynamo")
    params = gpu_checks.MODELS["tiny-gpt"]()
    check = gpu_checks.check_compiled_step(
        params, model="tiny-gpt", dtype="float32", config="propagate, inductor lite with CUDA graphs",
        device="cpu", repeats=1,
    )
    assert check.problems == [] and check.errors == {}
    assert (check.graphs_first_step, check.graph_breaks, check.recompiles_after_first_step) == (1, 0, 0)
    assert check.max_rel_diff == 0.0


def test_the_compile_stage_plan_fits_a_short_loan():
    """``--quick``: the tiny GPT under ``propagate`` and the training configuration; in full every
    configuration on the tiny GPT and only the size-dependent ones on GPT-2 small (each check
    compiles anew)."""
    assert gpu_checks.compile_plan(True) == [("tiny-gpt", "propagate"), ("tiny-gpt", "training, propagate")]
    full = gpu_checks.compile_plan(False)
    assert [c for m, c in full if m == "tiny-gpt"] == list(gpu_checks.CONFIGS)
    assert [c for m, c in full if m == "gpt2-small"] == list(gpu_checks.LARGE_MODEL_CONFIGS)
    assert len(full) == len(gpu_checks.CONFIGS) + len(gpu_checks.LARGE_MODEL_CONFIGS)


@pytest.mark.filterwarnings(_LRU_CACHE_WARNING)
def test_compiled_step_check_reports_host_reads_and_a_compile_that_fails(monkeypatch):
    """The default configuration reads the device (its finiteness and root checks): under
    ``fullgraph=True`` that cannot trace, and the eager step's host reads are counted."""
    pytest.importorskip("torch._dynamo")
    monkeypatch.setitem(gpu_checks.CONFIGS, "default", {})
    params = gpu_checks.MODELS["tiny-gpt"]()
    check = gpu_checks.check_compiled_step(
        params, model="tiny-gpt", dtype="float32", config="default", device="cpu",
        compile_options={"backend": "eager", "fullgraph": True}, repeats=1,
    )
    assert check.host_reads_eager_step >= 1
    assert any("host reads in an eager step" in p for p in check.problems)
    if "FISMO compiled" in check.errors:  # a graph break under fullgraph=True raises
        assert any("raised" in p for p in check.problems)
        assert "FISMO compiled" not in check.medians_ms and check.max_rel_diff is None


@pytest.mark.parametrize(("users", "seen"), [(None, "false"), ("true", "true")])
def test_the_tests_stage_runs_pytest_on_the_gpu_cases_and_counts_them(tmp_path, monkeypatch, users, seen):
    """Stage 1 against a stand-in repository: pytest selects the tests whose ids name CUDA, CuPy or JAX's GPU
    (the jax-gpu cases were not selected until a GPU run, 2026-12-04), in parallel where pytest-xdist is installed,
    with JAX's preallocation of GPU memory off unless the user set it."""
    if users is None:
        monkeypatch.delenv("XLA_PYTHON_CLIENT_PREALLOCATE", raising=False)
    else:
        monkeypatch.setenv("XLA_PYTHON_CLIENT_PREALLOCATE", users)
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_stand_in.py").write_text(
        "import os, pytest\n"
        f"def test_on_cuda(): assert os.environ['XLA_PYTHON_CLIENT_PREALLOCATE'] == {seen!r}  # JAX's, per worker\n"
        "def test_on_the_cpu(): raise AssertionError('not selected')\n"
        "@pytest.mark.parametrize('t', ['torch-cpu-float32', 'torch-cuda-float32', 'cupy-cuda-float32', 'jax-gpu-float32'])\n"
        "def test_target(t):\n"
        "    if t.startswith('cupy'): pytest.skip('cupy is not installed')\n"
        "    assert t != 'torch-cuda-float32', 'fails on CUDA'\n"
    )
    monkeypatch.setattr(gpu_checks, "ROOT", tmp_path)
    result = gpu_checks.stage_tests(Options(out=tmp_path), gpu_checks.Log(tmp_path / "tests.log"))
    assert (result.status, result.reason) == ("failed", "pytest exit status 1")
    # test_on_the_cpu and torch-cpu-float32 not selected (they would fail or pass: 2 failed or 3 passed);
    # pytest-xdist's workers do not report the deselected count.
    assert {k: result.details.get(k) for k in ("passed", "failed", "skipped")} == {"passed": 2, "failed": 1, "skipped": 1}
    assert result.figures == {"tests": "2 passed, 1 skipped, 1 failed, 0 error"}
    log = (tmp_path / "tests.log").read_text()
    assert "-k 'cuda or cupy or jax-gpu'" in log and "SKIPPED" in log and "cupy is not installed" in log  # -rs: the reasons


def test_the_performance_stage_reads_the_tables_and_quick_restores_the_stored_medians(tmp_path, monkeypatch):
    """Stage 4 against a stand-in ``performance.py`` that, like the real one, rewrites the stored
    medians and prints the tables: ``--quick`` puts the file back as it was."""
    (tmp_path / "docs" / "scripts").mkdir(parents=True)
    (tmp_path / "docs" / "performance").mkdir()
    stored = tmp_path / "docs" / "performance" / "model_steps.json"
    stored.write_text('{"before": 1}\n')
    (tmp_path / "docs" / "scripts" / "performance.py").write_text(
        "import pathlib, sys\n"
        "here = pathlib.Path(__file__).resolve().parents[1] / 'performance'\n"
        "(here / 'model_steps.json').write_text('{\"after\": 2}')\n"
        "(here / 'model_step_time_cuda.png').write_bytes(b'png')\n"
        "print('args', sys.argv[1:])\n"
        "print('**gpt2-2layers** (8 matrices)')\n"
        "print('| optimizer | ms per step | / Muon float32 step | / torch.optim.Muon | measured |')\n"
        "print('|---|---|---|---|---|')\n"
        "print('| FISMO exact, no host reads | 12 | 3.00× | 2.50× | x |')\n"
        "print('| FISMO exact, bf16 polar | 9 | 2.00× | 1.75× | x |')\n"
        "print('| Muon, float32 iteration | 4 | 1.00× | 0.90× | x |')\n"
    )
    monkeypatch.setattr(gpu_checks, "ROOT", tmp_path)
    result = gpu_checks.stage_performance(Options(quick=True, out=tmp_path), gpu_checks.Log(tmp_path / "perf.log"))
    assert result.status == "passed"
    assert result.figures["gpt2-2layers"] == "3 rows; fastest FISMO row 'FISMO exact, bf16 polar': 9 ms, 1.75× torch.optim.Muon"
    assert stored.read_text() == '{"before": 1}\n'
    assert not (tmp_path / "docs" / "performance" / "model_step_time_cuda.png").exists()
    assert "args ['--only', 'models', '--device', 'cuda', '--model', 'gpt2-2layers'" in (tmp_path / "perf.log").read_text()
    # Without --quick the stored medians are the run's.
    result = gpu_checks.stage_performance(Options(quick=False, out=tmp_path), gpu_checks.Log(tmp_path / "perf.log"))
    assert result.status == "passed" and stored.read_text() == '{"after": 2}'
