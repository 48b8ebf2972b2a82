"""The end-to-end example ``docs/examples/fsdp2_resume.py``: FSDP2 on 4 gloo ranks, DCP, resumed on 2, as one process."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

EXAMPLE = Path(__file__).resolve().parents[1] / "docs" / "examples" / "fsdp2_resume.py"


@pytest.mark.parametrize("before, after", [(4, 2), (3, 2)])
def test_the_resumed_run_equals_the_uninterrupted_one(before, after):
    """The example's own ``--check`` (exit status 0 within 1e-10), on a short run: 2 steps on ``before`` ranks,
    2 on ``after``; 3 ranks shard every matrix of the GPT unevenly."""
    done = subprocess.run(
        [sys.executable, str(EXAMPLE), "--steps", "4", "--before", str(before), "--after", str(after), "--check"],
        capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith(f"{before} ranks:") and "saved at step 2" in lines[0]
    assert lines[1].startswith(f"{after} ranks:") and f"resumed from the {before}-rank checkpoint" in lines[1]
    assert "finished step 4" in lines[1]
    assert "within 1e-10" in lines[2]


@pytest.mark.parametrize("args, message", [
    (["--before", "5"], "the world sizes must divide the global batch of 48: one of [1, 2, 3, 4, 6, 8, 12, 16, 24, 48]"),
    (["--after", "0"], "the world sizes must divide the global batch of 48"),
    (["--steps", "1"], "--steps must be at least 2, got 1"),
])
def test_bad_arguments_are_usage_errors_before_any_rank_starts(args, message):
    done = subprocess.run([sys.executable, str(EXAMPLE), *args], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and message in done.stderr and "Traceback" not in done.stderr, done.stderr
