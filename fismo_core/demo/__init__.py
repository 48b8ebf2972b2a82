"""``fismo demo``: FISMO against Muon, AdamW, SGD and SOAP on two small real tasks, on the CPU.

- a small CNN on scikit-learn's 8x8 digits (held-out images), and
- a small GPT-style byte-level model on the Python standard library's source
  (held-out files),

each with a learning-rate sweep per optimizer and the selected learning rate
repeated over seeds; the condition number of the updates (the paper's
condition-number figure) and FISMO's preconditioners ``P``, ``Q`` (printed
statistics and the opt-in scale-invariant variant) are measured along the way.
Everything is offline: both data sets are on the machine already.

Needs torch, scikit-learn, matplotlib and tqdm; SOAP needs pytorch-optimizer
(left out, with a note, when it is missing). See the documentation page
"Results".
"""

from __future__ import annotations

from .config import DemoConfig, TaskPlan, default_config
from .run import DemoResults, run_demo

__all__ = ["DemoConfig", "DemoResults", "TaskPlan", "default_config", "main", "run_demo"]


def main(config: DemoConfig, out: str = "fismo-results", *, progress: bool = True, command: str = "fismo demo") -> int:
    """Run the demo ``config`` and write its report to ``out``; prints the tables. Returns the exit code (0)."""
    from pathlib import Path

    from .report import write_report

    results = run_demo(config, progress=progress)
    report = write_report(results, Path(out), command)
    print(report)
    print(f"Wrote {out}/report.md, summary.csv, runs.csv, curves.csv, results.json and the PNG figures "
          f"in {results.seconds:.0f} s.")
    return 0
