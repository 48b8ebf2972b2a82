"""A pytest plugin: every installed backend, device and dtype of `fismo_core.testing` as a fixture.

Enable it in a ``conftest.py``::

    pytest_plugins = ["fismo_core.pytest_plugin"]

or for one run with ``pytest -p fismo_core.pytest_plugin``. It provides

- ``array_target``: a `fismo_core.testing.Target`, parametrized over
  `fismo_core.testing.targets()` (ids like ``torch-cpu-float32``); a target
  whose library or device is missing is *skipped* with the reason, so the
  CUDA rows show up as skips on a machine without a GPU;
- ``array_target64``: the float64 targets only;
- ``array_xp``: the array namespace of ``array_target`` (a test uses
  ``array_target`` or ``array_target64``, not both: with ``array_target64``
  take ``array_target64.xp``; the pair is refused at collection);
- the marker ``@pytest.mark.array_targets(backends=[...], dtypes=[...])``,
  which narrows ``array_target`` (and ``array_target64``) for one test.

While a test that uses ``array_target`` (or ``array_target64``) runs,
its target's settings are in effect (`fismo_core.testing.Target.configured`):
true float32 matrix products (TF32 off in torch, ``"highest"`` precision
in JAX), so that ``target.tolerance`` holds, and on JAX 64-bit types; they
are restored after the test, so no other test sees them. Loading the plugin
imports neither torch nor JAX (collecting a test that uses the fixtures
does, to list the targets). A test converts NumPy data with
``array_target.asarray(a)`` (a copy), reads results back with
`fismo_core.testing.to_numpy`, and compares with ``array_target.tolerance``;
or calls `fismo_core.testing.check_backends` once for the whole matrix.

The fixtures are function-scoped (a fixture of wider scope cannot use
them: parametrize it over `fismo_core.testing.targets()` itself). Markers
stack: each ``array_targets`` marker that applies (on the function, its
class, its module) narrows the selection further.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Optional

import pytest

from .testing import _TARGET_MAKERS, TOLERANCES, Target, targets

_FIXTURES = {"array_target": None, "array_target64": ("float64",)}
_MARKER = "array_targets"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        f"{_MARKER}(backends=None, dtypes=None): run the array_target fixture on these backends and dtypes only",
    )


def target_params(selected: list[Target]) -> list[Any]:
    """``pytest.param`` per target, id ``target.id``, skipped with the reason when unavailable."""
    return [
        pytest.param(t, id=t.id, marks=[pytest.mark.skip(reason=str(t.reason))] if not t.available else [])
        for t in selected
    ]


def _names(marker: pytest.Mark, key: str, where: str) -> Optional[list[str]]:
    """The marker's ``backends`` or ``dtypes``: ``None`` (all), else a list of names without repeats."""
    value = marker.kwargs.get(key)
    if value is None:
        return None
    if isinstance(value, str):
        raise TypeError(f"{where}: {key} must be a list of names, not the string {value!r}: {key}=[{value!r}]")
    try:
        names = list(value)
    except TypeError:
        raise TypeError(f"{where}: {key} must be a list of names, got {value!r}") from None
    bad = [n for n in names if not isinstance(n, str)]
    if bad:
        raise TypeError(f"{where}: {key} must be a list of names (strings), got {bad!r} among them")
    return list(dict.fromkeys(names))  # a name given twice would run its targets twice


def _selection(metafunc: pytest.Metafunc) -> tuple[Optional[list[str]], Optional[list[str]]]:
    """``(backends, dtypes)`` that every ``array_targets`` marker of the test allows (``None``: any)."""
    where = f"the {_MARKER} marker of {metafunc.definition.nodeid}"
    backends: Optional[list[str]] = None
    dtypes: Optional[list[str]] = None
    for marker in metafunc.definition.iter_markers(_MARKER):
        if marker.args:  # would otherwise be ignored: every target would run
            raise TypeError(f"{_MARKER} takes keywords only (backends=[...], dtypes=[...]), got {marker.args!r}")
        unknown = sorted(set(marker.kwargs) - {"backends", "dtypes"})
        if unknown:  # a typo (backend=...) would otherwise be ignored: every target would run
            raise TypeError(f"{_MARKER} takes backends=[...] and dtypes=[...], got unknown keywords {unknown}")
        these_backends, these_dtypes = _names(marker, "backends", where), _names(marker, "dtypes", where)
        for key, names, known in (("backends", these_backends, _TARGET_MAKERS), ("dtypes", these_dtypes, TOLERANCES)):
            unknown_names = [n for n in names or () if n not in known]
            if unknown_names:
                raise ValueError(f"{where}: unknown {key} {unknown_names}: use names from {list(known)}")
        if these_backends is not None:
            backends = these_backends if backends is None else [b for b in backends if b in these_backends]
        if these_dtypes is not None:
            dtypes = these_dtypes if dtypes is None else [d for d in dtypes if d in these_dtypes]
    return backends, dtypes


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    used = [name for name in _FIXTURES if name in metafunc.fixturenames]
    if not used:
        if any(m.name == _MARKER for m in metafunc.definition.own_markers):  # else it would be ignored
            raise TypeError(f"the {_MARKER} marker of {metafunc.definition.nodeid} narrows the array_target "
                            "fixtures, and the test uses neither array_target nor array_target64")
        return
    if len(used) > 1:  # array_xp brings array_target in
        raise TypeError(f"{metafunc.definition.nodeid} uses both array_target (or array_xp, its namespace) and "
                        "array_target64: each is parametrized on its own, so the test would run on every pair, "
                        "most of them two different targets; use one, and array_target64.xp for its namespace")
    backends, dtypes = _selection(metafunc)
    for name in used:
        only = _FIXTURES[name]
        chosen = dtypes
        if only is not None:
            chosen = [d for d in (only if dtypes is None else dtypes) if d in only]  # dtypes=[] leaves nothing
            if not chosen:  # array_target64 with dtypes=["float32"]: an empty parametrisation, silently
                raise ValueError(f"the {name} fixture holds {only} targets only; the marker asks for {dtypes}")
        selected = targets(backends=backends, dtypes=chosen)
        if not selected:  # backends=[] or dtypes=[]: pytest would skip the test as an empty parameter set
            raise ValueError(f"the {_MARKER} marker of {metafunc.definition.nodeid} selects no targets "
                             f"(backends={backends}, dtypes={dtypes})")
        metafunc.parametrize(name, target_params(selected), indirect=True)


def _refuse_a_marker_on_a_param(request: pytest.FixtureRequest) -> None:
    """An ``array_targets`` marker on one ``pytest.param(..., marks=...)`` cannot narrow the targets: they are
    parametrized per test function, before pytest reads a case's marks. Until 2026-12-04 it was ignored and the
    case ran on every target; now the case errors, saying so."""
    callspec = getattr(request.node, "callspec", None)
    if any(mark.name == _MARKER for mark in getattr(callspec, "marks", ())):
        raise TypeError(f"{request.node.nodeid}: the {_MARKER} marker of a pytest.param (marks=...) cannot narrow "
                        "the targets, which are chosen per test function: put it on the function (or write "
                        "the case as a test of its own)")


@pytest.fixture
def array_target(request: pytest.FixtureRequest) -> Iterator[Target]:
    """One (backend, device, dtype) of `fismo_core.testing.targets()`, its settings in effect during the test."""
    _refuse_a_marker_on_a_param(request)
    target: Target = request.param
    with target.configured():
        yield target


@pytest.fixture
def array_target64(request: pytest.FixtureRequest) -> Iterator[Target]:
    """One float64 (backend, device), its settings in effect during the test."""
    _refuse_a_marker_on_a_param(request)
    target: Target = request.param
    with target.configured():
        yield target


@pytest.fixture
def array_xp(array_target: Target) -> Any:
    """The array namespace of ``array_target``."""
    return array_target.xp
