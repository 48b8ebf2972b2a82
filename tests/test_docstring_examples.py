"""The ``Examples`` in the docstrings of the public functions run, and print what they say, on every CPU.

Each object below must have at least one example, and every example must
pass. The examples run on array-api-strict (the optax adapter's on JAX,
which it needs) and print only what holds on any CPU: booleans, shapes and
values rounded far above rounding error, so ``.ci/run`` runs them under
every kernel set (``numbers`` marker). They run as ``doctest`` does, with
empty globals: an example imports what it uses, so a reader can paste it.
The objects are named here one by one rather than collected with
``--doctest-modules``, so that an object that loses its examples fails.
"""

from __future__ import annotations

import doctest
import importlib

import pytest

#: The public functions whose docstrings carry runnable examples: (module, name).
DOCUMENTED = [
    ("fismo_core", "FISMO"),
    ("fismo_core.linalg", "polar"),
    ("fismo_core.linalg", "inverse_sqrt"),
    ("fismo_core.backends.optax", "scale_by_fismo"),
    ("fismo_core.testing", "check_backends"),
]

#: What an example may rely on besides exact output: ``...`` for an elided part, any run of whitespace as one.
OPTIONS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE


def _docstring_tests(module: str, name: str) -> list[doctest.DocTest]:
    if module == "fismo_core.backends.optax":  # optax's example needs JAX arrays, and the module needs both
        pytest.importorskip("jax")
        pytest.importorskip("optax")
    obj = getattr(importlib.import_module(module), name)
    # recurse=False: the object's own docstring, not its methods'.
    return doctest.DocTestFinder(recurse=False).find(obj, f"{module}.{name}", globs={})


def _run(tests: list[doctest.DocTest]) -> tuple[doctest.TestResults, str]:
    """Run ``tests``: the results, and the report of each failing example (its source, expected and actual output)."""
    report: list[str] = []
    runner = doctest.DocTestRunner(optionflags=OPTIONS, verbose=False)
    for test in tests:
        runner.run(test, out=report.append, clear_globs=True)
    return runner.summarize(verbose=False), "".join(report)


@pytest.mark.numbers
@pytest.mark.parametrize(("module", "name"), DOCUMENTED, ids=[f"{m}.{n}" for m, n in DOCUMENTED])
def test_docstring_examples_run(module: str, name: str) -> None:
    tests = _docstring_tests(module, name)
    examples = sum(len(t.examples) for t in tests)
    assert examples > 0, f"{module}.{name} has no runnable example (>>> lines) in its docstring"
    result, report = _run(tests)
    assert result.attempted == examples
    assert result.failed == 0, f"{result.failed} of {examples} examples of {module}.{name} failed:\n{report}"


def test_a_wrong_example_fails_with_its_text() -> None:
    """`_run` counts a wrong output as a failure and reports the example: the test above can fail."""
    test = doctest.DocTestParser().get_doctest(">>> 1 + 1\n3\n", {}, "wrong", "wrong.py", 0)
    result, report = _run([test])
    assert (result.failed, result.attempted) == (1, 1)
    assert "1 + 1" in report and "Expected:\n    3\nGot:\n    2" in report
