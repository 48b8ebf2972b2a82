"""``fismo demo``: FISMO against Muon, AdamW, SGD and SOAP on two small real tasks, on the CPU.

- a small CNN on scikit-learn's 8x8 digits (held-out images), and
- a small GPT-style byte-level model on the Python standard library's source
  (held-out files),

each with a learning-rate sweep per optimizer and the selected learning rate
repeated over seeds, and controls that change one thing at their base
optimizer's learning rate (Muon with 7 Newton–Schulz steps or in float32;
FISMO with block-diagonal factors, ``block_size=B``, or with its polar
iteration in bfloat16); the condition number of the updates (the paper's
condition-number figure) and FISMO's preconditioners ``P``, ``Q`` (printed
statistics and the opt-in scale-invariant variant) are measured along the way.
Everything is offline: both data sets are on the machine already. Two runs
on the same CPU instruction set and software give the same numbers to the
last bit (the report's result digest says so in one line).

Needs torch, scikit-learn, matplotlib and tqdm; SOAP needs pytorch-optimizer
(left out, with a note, when it is missing). See the documentation page
"Results".
"""

from __future__ import annotations

import sys
from pathlib import Path

from .._paths import NotARegularFileError, cannot_write_in
from .config import DemoConfig, TaskPlan, default_config
from .run import DemoResults, run_demo

__all__ = ["DemoConfig", "DemoResults", "TaskPlan", "default_config", "main", "out_directory", "run_demo", "wrote_line"]


def main(
    config: DemoConfig,
    out: str = "fismo-results",
    *,
    progress: bool = True,
    command: str = "fismo demo",
    journal: bool = False,
) -> int:
    """Run the demo ``config`` and write its report to ``out``; prints the tables. Returns the exit code: 0,
    or 2 where the report could not be written (one line on standard error; ``out`` is left as it was).

    ``out`` is created and tried for writing first (`out_directory`): an `OSError` before any run.

    ``journal``: record every finished run in ``out/journal.jsonl`` and reuse
    the runs already recorded there (an interrupted demo resumes; see
    [`run_demo`][fismo_core.demo.run_demo]).
    """
    from .report import write_report

    path = out_directory(out)
    results = run_demo(config, progress=progress, journal=path / "journal.jsonl" if journal else None)
    try:
        report, files = write_report(results, path, command)
    except OSError as exc:  # a full disk, a folder where a file goes: after the runs, so one line, not a traceback
        where = f" ({exc.filename})" if exc.filename else ""
        print(f"fismo demo: cannot write the report to {out}: {exc.strerror or exc}{where}; nothing was written "
              "there", file=sys.stderr)
        return 2
    _print_in_any_encoding(report)
    print(wrote_line(out, files, results.seconds, results.cpu_seconds))
    return 0


def _print_in_any_encoding(text: str) -> None:
    """Print ``text``, its characters that the console's encoding lacks (``±``, ``κ`` on an ASCII or Latin-1
    console) replaced: the report is written, and a traceback here ended the demo with exit status 1."""
    try:
        print(text)
    except UnicodeEncodeError:
        encoding = sys.stdout.encoding or "ascii"
        print(text.encode(encoding, errors="replace").decode(encoding))


def out_directory(out: str) -> Path:
    """``out``, created if missing and tried for writing before any run (a report that cannot be written
    was found only after the whole demo, 12 minutes or more); an `OSError` that says why otherwise."""
    path = Path(out)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OSError(f"cannot write the report to {out}: {exc.strerror or exc}") from None
    reason = cannot_write_in(path)
    if reason is not None:
        raise OSError(f"cannot write the report to {out}: {reason}")
    from .report import in_the_way

    try:
        in_the_way(path)
    except IsADirectoryError as exc:
        raise OSError(f"cannot write the report to {out}: {exc.filename} is a folder; the report writes a file "
                      "of that name") from None
    except NotARegularFileError as exc:  # a device, a pipe, a link into a missing folder
        raise OSError(f"cannot write the report to {out}: {exc}") from None
    return path


def wrote_line(out: str, files: list[str], seconds: float, cpu_seconds: float) -> str:
    """The demo's last line: the files it wrote (no PNG claimed where none was written) and its times."""
    tables = [f for f in files if not f.endswith(".png")]
    figures = [f for f in files if f.endswith(".png")]
    what = f"{Path(out) / tables[0]}, " + ", ".join(tables[1:])
    what += f" and {len(figures)} PNG figure{'s' * (len(figures) != 1)}" if figures else " (no figures: matplotlib is not installed)"
    return f"Wrote {what} in {seconds:.0f} s ({cpu_seconds:.0f} CPU-seconds)."
