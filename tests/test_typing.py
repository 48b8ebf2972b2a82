"""The package's type hints, as a user's type checker reads them.

The package ships ``py.typed`` (PEP 561), so mypy reads its annotations in a
user's code instead of treating ``fismo_core`` as untyped. This runs mypy, with
the ``[tool.mypy]`` section of ``pyproject.toml``, on the package laid out as a
wheel installs it (``fismo_core.backends`` inside ``fismo_core``; the source tree
keeps it in ``backends/``, where an editable install maps it by an import hook
that mypy does not follow) and on user code: typed code that uses the public API
as the docs do checks clean, and misuses the annotations exist to catch are
reported, each on its line with its error code.
"""

from __future__ import annotations

import importlib.resources
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("mypy")
pytest.importorskip("torch")
pytest.importorskip("optax")

ROOT = Path(__file__).resolve().parents[1]

# Uses of the public API as the docs show them; every line must check clean.
GOOD = """
    import numpy as np
    import torch

    from fismo_core import FISMO, FISMOState, InverseRootConfig, PolarConfig
    from fismo_core.backends.optax import fismo, fismo_training
    from fismo_core.backends.torch import FISMO as TorchFISMO, param_groups

    core = FISMO(polar="svd", inv_root={"method": "eigh", "every": 10}, statistics="scale_invariant",
                 block_size=32, nonfinite="propagate")
    # After construction the options are their configs, whatever form they were given in.
    every: int = core.inv_root.every
    polar: PolarConfig = core.polar
    root: InverseRootConfig = FISMO.training().inv_root
    W = np.zeros((4, 3))
    state: FISMOState = core.init(W)
    W, state = core.step(W, np.ones((4, 3)), state)

    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    opt = TorchFISMO(param_groups(model), lr=0.02, nonfinite="propagate", adjust_lr_fn="match_rms_adamw")
    opt.step()
    opt.zero_grad()
    training: torch.optim.Optimizer = TorchFISMO.training(model.parameters(), lr=1e-3)

    tx = fismo(0.02, statistics="scale_invariant", inv_root="newton_schulz")
    tx_training = fismo_training(1e-3)
"""

# Misuses, each marked with the error code mypy must give on its line.
BAD = """
    import torch

    from fismo_core import FISMO
    from fismo_core.backends.optax import fismo
    from fismo_core.backends.torch import FISMO as TorchFISMO

    FISMO(statistics="scale-invariant")  # E: arg-type
    FISMO(nonfinite="ignore")  # E: arg-type
    FISMO(polar=5)  # E: arg-type
    FISMO(lr="0.02")  # E: arg-type
    FISMO(block_size=32.0)  # E: arg-type
    FISMO().inv_root.every = 2  # E: misc
    FISMO().polar.steps + "5"  # E: operator
    TorchFISMO(torch.nn.Linear(2, 2).parameters(), nonfinite="nan")  # E: arg-type
    TorchFISMO(torch.nn.Linear(2, 2).parameters(), adjust_lr_fn="rms")  # E: arg-type
    fismo(0.02, statistics="printed ")  # E: arg-type
"""

_ERROR = re.compile(r"^(?P<path>[^:]+):(?P<line>\d+): error: (?P<message>.*?)  \[(?P<code>[a-z-]+)\]$")


def _as_a_wheel_lays_it_out(site: Path) -> None:
    """``site/fismo_core``: links to the source tree's files, and ``backends`` as ``fismo_core/backends``."""
    package = site / "fismo_core"
    package.mkdir()
    for entry in (ROOT / "fismo_core").iterdir():
        if entry.name != "__pycache__":
            (package / entry.name).symlink_to(entry)
    (package / "backends").symlink_to(ROOT / "backends")


def test_the_package_and_typed_user_code_check_clean_and_misuses_are_caught(tmp_path: Path) -> None:
    site, user = tmp_path / "site", tmp_path / "user"
    site.mkdir()
    user.mkdir()
    _as_a_wheel_lays_it_out(site)
    (user / "good.py").write_text(textwrap.dedent(GOOD))
    (user / "bad.py").write_text(textwrap.dedent(BAD))
    result = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"),
         "--cache-dir", str(tmp_path / "cache"), "--no-error-summary", "--show-absolute-path",
         "--no-color-output",  # FORCE_COLOR / MYPY_FORCE_COLOR colour even a pipe
         str(site / "fismo_core"), str(user / "good.py"), str(user / "bad.py")],
        cwd=tmp_path, env={**os.environ, "MYPYPATH": str(site)}, capture_output=True, text=True, timeout=600,
    )
    errors = [m for m in map(_ERROR.match, result.stdout.splitlines()) if m]
    # mypy exits 1 for type errors (bad.py's), 2 for a crash or a bad invocation.
    assert result.returncode == 1 and errors, result.stdout + result.stderr
    elsewhere = [m.group(0) for m in errors if Path(m["path"]).name != "bad.py"]
    assert not elsewhere, "\n".join(elsewhere)  # the package (as installed) and good.py

    expected = {i: code for i, text in enumerate(textwrap.dedent(BAD).splitlines(), start=1)
                for code in re.findall(r"# E: ([a-z-]+)$", text)}
    found = {(int(m["line"]), m["code"]) for m in errors}
    missing = {line: code for line, code in expected.items() if (line, code) not in found}
    unexpected = sorted(f"{line}: {code}" for line, code in found if expected.get(line) != code)
    assert not missing and not unexpected, (missing, unexpected, result.stdout)


def test_the_package_says_it_is_typed() -> None:
    # PEP 561: without the marker a type checker treats every name of the package as Any. (The mypy run
    # above finds the package through MYPYPATH, where the marker plays no part.) The files exist, and the
    # wheel takes them: package data of both packages.
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    package_data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    for package in ("fismo_core", "fismo_core.backends"):
        assert importlib.resources.files(package).joinpath("py.typed").is_file(), package
        assert "py.typed" in package_data.get(package, []), package


def test_the_core_constructors_annotation_matches_its_fields() -> None:
    # FISMO's fields are typed as what they hold after construction (polar: PolarConfig); the constructor
    # type checkers see, declared under TYPE_CHECKING, also takes a method name or a dict, and so does the
    # run-time constructor's signature (inspect, typing.get_type_hints). The two list the same parameters in
    # the same order with the same annotations and defaults, or a new field or option would be a type error.
    import ast
    import dataclasses
    import inspect
    import typing

    from fismo_core import FISMO, InverseRootConfig, PolarConfig

    tree = ast.parse((ROOT / "fismo_core" / "optimizer.py").read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "FISMO")
    init = next(f for block in cls.body if isinstance(block, ast.If) and ast.unparse(block.test) == "TYPE_CHECKING"
                for f in block.body if isinstance(f, ast.FunctionDef) and f.name == "__init__")
    assert len(init.args.args) - 1 == len(init.args.defaults)  # every parameter has its default
    names = vars(sys.modules["fismo_core.optimizer"])
    declared = [(a.arg, ast.dump(a.annotation), eval(ast.unparse(d), names))
                for a, d in zip(init.args.args[1:], init.args.defaults)]
    factories = {f.name: f.default_factory for f in dataclasses.fields(FISMO)
                 if f.default_factory is not dataclasses.MISSING}
    at_run_time = [(p.name, ast.dump(ast.parse(p.annotation, mode="eval").body),
                    factories[p.name]() if p.name in factories else p.default)
                   for p in inspect.signature(FISMO).parameters.values()]
    assert declared == at_run_time
    hints = typing.get_type_hints(FISMO.__init__)
    assert hints["polar"] == typing.Union[PolarConfig, str, dict[str, typing.Any]]
    assert hints["inv_root"] == typing.Union[InverseRootConfig, str, dict[str, typing.Any]]
    # The attributes hold the configs.
    assert typing.get_type_hints(FISMO)["polar"] is PolarConfig
