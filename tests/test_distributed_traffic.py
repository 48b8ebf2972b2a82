"""The Distributed training page's traffic table: ``docs/scripts/distributed_traffic.py`` on 2 gloo ranks."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

SCRIPT = Path(__file__).resolve().parents[1] / "docs" / "scripts" / "distributed_traffic.py"


def test_two_ranks_send_what_the_page_says():
    """Per rank and step: 8 all-to-alls (4 shape buckets, there and back) and one all-reduce of the flags;
    2 (W-1)/W^2 of the 324 MiB of matrices, i.e. 162.0 MiB at W = 2; AdamW sends nothing."""
    done = subprocess.run([sys.executable, str(SCRIPT), "--worlds", "2"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = {line.split("|")[2].strip(): [c.strip() for c in line.split("|")[1:-1]]
            for line in done.stdout.splitlines() if line.startswith("| 2 |")}
    assert rows["FISMO"][2] == "1 all_reduce, 8 all_to_all_single" and rows["FISMO"][3] == "162.0"
    assert rows["FISMO block_size=256"][3] == "162.0"
    assert rows["AdamW"][2] == "none" and rows["AdamW"][3] == "0.0"
    assert rows["FISMO"][4] == "1.00"  # the cost model splits GPT-2 small's matrices evenly over 2 ranks
