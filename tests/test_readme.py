"""The README's two set-up commands are the ones CI runs."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    return re.findall(r"```bash\n(.+?)\n```", text)


def test_readme_starts_with_main_job_and_test_commands() -> None:
    commands = _readme_commands()
    assert len(commands) >= 2, "README must open with the main-job and test commands"
    main_job, tests = commands[0], commands[1]
    assert main_job.endswith("fismo demo")
    assert re.search(r"python -m pytest( -n auto --dist loadfile)?$", tests)


def test_ci_runs_the_readme_test_command_verbatim() -> None:
    tests_command = _readme_commands()[1]
    ci_lines = (ROOT / ".ci" / "run").read_text().splitlines()
    assert tests_command in ci_lines, ".ci/run must run the README's test command as written"
