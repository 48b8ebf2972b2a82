"""``fismo verify`` (``fismo_core.verify`` and ``python -m fismo_core verify``).

The 50-step cross-backend equivalence itself is tested array by array in
``tests/test_backends.py``; here the runs are short (a few steps) and the
subject is the tool: results per target, the table, exit codes, and that a
real discrepancy between backends is reported as FAIL.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import re
import subprocess
import sys
from typing import Any

import pytest
from array_api_compat import array_namespace, is_numpy_namespace

import fismo_core.verify as verify_mod
from fismo_core import FISMO, PolarConfig
from fismo_core.cli import main as cli_main
from fismo_core.testing import TOLERANCES, targets
from fismo_core.verify import VerifyResult, format_table, verify

STEPS = 3  # short trajectories: every line of Algorithm 1 runs, P and Q move, cheap
COLUMNS = ("backend", "device", "dtype", "steps", "max rel. error", "tolerance", "result")
SUMMARY = re.compile(r"^(\d+) passed, (\d+) failed, (\d+) skipped$", re.MULTILINE)
AVAILABLE = [t for t in targets() if t.available]
UNAVAILABLE = [t for t in targets() if not t.available]


pytestmark = pytest.mark.usefixtures("single_threaded_torch")


@pytest.fixture(scope="module")
def results() -> list[VerifyResult]:
    return verify(steps=STEPS)


def test_verify_returns_one_result_per_target(results: list[VerifyResult]) -> None:
    assert [r.target.id for r in results] == [t.id for t in targets()]
    assert len({r.target.id for r in results}) == len(results)
    for r in results:
        assert r.steps == STEPS
        if r.target.available:
            assert r.error is not None and r.passed is True, (r.target.id, r.error)
            # Same bar as the documented per-dtype tolerance.
            assert r.target.tolerance == TOLERANCES[r.target.dtype]
            assert 0.0 <= r.error <= r.target.tolerance
        else:
            assert r.error is None and r.passed is None
            assert r.target.reason


def test_verify_really_compares(results: list[VerifyResult]) -> None:
    """Non-reference targets report a genuine, non-zero rounding difference.

    (An error of exactly 0 everywhere would mean the reference was compared
    with itself.) float32 targets cannot agree bit for bit with float64.
    """
    errors32 = [r.error for r in results if r.target.available and r.target.dtype == "float32"]
    assert errors32 and all(e > 1e-9 for e in errors32)
    numpy64 = next(r for r in results if r.target.id == "numpy-cpu-float64")
    assert numpy64.error == 0.0  # the reference against itself


def test_format_table_has_columns_and_one_row_per_target(results: list[VerifyResult]) -> None:
    table = format_table(results)
    lines = table.splitlines()
    header = lines[0]
    positions = [header.index(c) for c in COLUMNS]
    assert positions == sorted(positions)  # in this order
    assert set(lines[1]) <= {"-", " "}  # rule under the header
    body = lines[2:]
    assert len(body) == len(results)
    for line, r in zip(body, results):
        t = r.target
        assert line.split()[:3] == [t.backend, t.device, t.dtype]
        if r.error is None:
            assert "skipped: " + t.reason in line
        else:
            assert line.rstrip().endswith("pass")
            assert f"{r.error:.2e}" in line and f"{t.tolerance:.0e}" in line and str(STEPS) in line


def _run_cli(*args: str) -> subprocess.CompletedProcess:
    # One OpenMP thread in the child, for the reason given in _single_threaded_torch.
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "fismo_core", *args], capture_output=True, text=True, timeout=300, env=env
    )


def test_cli_verify_passes() -> None:
    proc = _run_cli("verify", "--steps", "5")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    for column in COLUMNS:
        assert column in out
    for t in AVAILABLE:
        assert re.search(rf"^{re.escape(t.backend)}\s+{re.escape(t.device)}\s+{t.dtype}\s+5\s+\S+\s+\S+\s+pass$", out, re.MULTILINE), t.id
    assert "FAIL" not in out
    summary = SUMMARY.findall(out)
    assert summary == [(str(len(AVAILABLE)), "0", str(len(UNAVAILABLE)))]
    assert out.rstrip().splitlines()[-1] == f"{len(AVAILABLE)} passed, 0 failed, {len(UNAVAILABLE)} skipped"


@pytest.mark.parametrize("steps", ["0", "-3"])
def test_cli_rejects_non_positive_steps(steps: str) -> None:
    proc = _run_cli("verify", "--steps", steps)
    assert proc.returncode == 2  # argparse usage error
    assert "--steps must be a positive integer" in proc.stderr
    assert "passed" not in proc.stdout  # nothing ran


def test_cli_rejects_non_integer_steps() -> None:
    with pytest.raises(SystemExit) as exc:
        cli_main(["verify", "--steps", "five"])
    assert exc.value.code == 2  # argparse usage error


def test_cli_main_rejects_zero_steps_in_process(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli_main(["verify", "--steps", "0"])
    assert exc.value.code == 2  # a usage error, not a verification failure (1)
    assert "--steps must be a positive integer" in capsys.readouterr().err


# --------------------------------------------------------------- failure path
@dataclasses.dataclass(frozen=True)
class _BackendDependentPolar(PolarConfig):
    """A polar factor that is off by 0.1% on every backend but the NumPy float64 reference.

    This is the kind of bug verify exists for: one code path behaving
    differently on some backend. 1e-3 is 10x the float32 tolerance and 1e7x
    the float64 one, so every perturbed target must FAIL.
    """

    def __call__(self, X: Any) -> Any:
        out = super().__call__(X)
        xp = array_namespace(X)
        if is_numpy_namespace(xp) and X.dtype == xp.float64:
            return out
        return out * 1.001


def _broken() -> FISMO:
    return FISMO(polar=_BackendDependentPolar())


def test_verify_reports_fail_for_a_backend_dependent_optimizer() -> None:
    results = verify(steps=2, optimizer=_broken())
    by_id = {r.target.id: r for r in results}
    assert by_id["numpy-cpu-float64"].passed is True
    failed = [r for r in results if r.passed is False]
    assert {r.target.id for r in failed} == {t.id for t in AVAILABLE} - {"numpy-cpu-float64"}
    for r in failed:
        assert r.error > r.target.tolerance
    table = format_table(results)
    assert table.count("FAIL") == len(failed)


def test_verify_main_returns_1_on_failure(monkeypatch: pytest.MonkeyPatch) -> None:
    # verify.main builds the default FISMO(); make that the broken optimizer.
    monkeypatch.setattr(verify_mod, "FISMO", _broken)
    out = io.StringIO()
    assert verify_mod.main(steps=2, out=out) == 1
    text = out.getvalue()
    assert "FAIL" in text
    assert SUMMARY.findall(text) == [("1", str(len(AVAILABLE) - 1), str(len(UNAVAILABLE)))]


def test_cli_returns_1_on_failure(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(verify_mod, "FISMO", _broken)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli_main(["verify", "--steps", "1"]) == 1
    assert "FAIL" in out.getvalue()


def test_cli_output_follows_redirected_stdout(monkeypatch: pytest.MonkeyPatch) -> None:
    """In-process CLI output follows redirected stdout (regression: the stream was bound at import)."""
    monkeypatch.setattr(verify_mod, "targets", lambda: [t for t in targets() if t.id == "numpy-cpu-float64"])
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        assert cli_main(["verify", "--steps", "1"]) == 0
    assert SUMMARY.findall(buffer.getvalue()) == [("1", "0", "0")]


def test_verify_main_returns_1_when_nothing_ran(monkeypatch: pytest.MonkeyPatch) -> None:
    """No available target at all is not a pass."""
    unavailable = [dataclasses.replace(t, reason="disabled by the test") for t in targets()]
    monkeypatch.setattr(verify_mod, "targets", lambda: unavailable)
    out = io.StringIO()
    assert verify_mod.main(steps=1, out=out) == 1
    assert SUMMARY.findall(out.getvalue()) == [("0", "0", str(len(unavailable)))]


def test_verify_api_rejects_zero_steps() -> None:
    """A zero-step verification compares nothing, so it must not pass (regression)."""
    with pytest.raises(ValueError, match="steps"):
        verify(steps=0)
