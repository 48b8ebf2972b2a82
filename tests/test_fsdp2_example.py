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


def test_the_resumed_run_equals_the_uninterrupted_one():
    """The example's own ``--check`` (exit status 0 within 1e-10), on a short run: 2 steps on 4 ranks, 2 on 2."""
    done = subprocess.run(
        [sys.executable, str(EXAMPLE), "--steps", "4", "--check"], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("4 ranks:") and "saved at step 2" in lines[0]
    assert lines[1].startswith("2 ranks:") and "finished step 4" in lines[1]
    assert "within 1e-10" in lines[2]
