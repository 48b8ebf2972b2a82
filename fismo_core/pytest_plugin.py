"""A pytest plugin: every installed backend, device and dtype of `fismo_core.testing` as a fixture.

Enable it in a ``conftest.py``::

    pytest_plugins = ["fismo_core.pytest_plugin"]

or for one run with ``pytest -p fismo_core.pytest_plugin``. It provides

- ``array_target``: a `fismo_core.testing.Target`, parametrized over
  `fismo_core.testing.targets()` (ids like ``torch-cpu-float32``); a target
  whose library or device is missing is *skipped* with the reason, so the
  CUDA rows show up as skips on a machine without a GPU;
- ``array_target64``: the float64 targets only;
- ``array_xp``: the array namespace of ``array_target``;
- the marker ``@pytest.mark.array_targets(backends=[...], dtypes=[...])``,
  which narrows ``array_target`` (and ``array_target64``) for one test.

At start-up it pins true float32 matrix products (TF32 off in torch,
``"highest"`` precision in JAX: `fismo_core.testing.pin_full_float32_matmuls`),
so that ``target.tolerance`` holds. A test converts NumPy data with
``array_target.asarray(a)``, reads results back with
`fismo_core.testing.to_numpy`, and compares with ``array_target.tolerance``;
or calls `fismo_core.testing.check_backends` once for the whole matrix.
"""

from __future__ import annotations

from typing import Any

import pytest

from .testing import Target, pin_full_float32_matmuls, targets

_FIXTURES = {"array_target": None, "array_target64": ("float64",)}


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "array_targets(backends=None, dtypes=None): run the array_target fixture on these backends and dtypes only",
    )
    pin_full_float32_matmuls()


def target_params(selected: list[Target]) -> list[Any]:
    """``pytest.param`` per target, id ``target.id``, skipped with the reason when unavailable."""
    return [
        pytest.param(t, id=t.id, marks=[pytest.mark.skip(reason=str(t.reason))] if not t.available else [])
        for t in selected
    ]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    for name, only in _FIXTURES.items():
        if name not in metafunc.fixturenames:
            continue
        marker = metafunc.definition.get_closest_marker("array_targets")
        if marker is not None and marker.args:  # would otherwise be ignored: every target would run
            raise TypeError(f"array_targets takes keywords only (backends=[...], dtypes=[...]), got {marker.args!r}")
        options = dict(marker.kwargs) if marker is not None else {}
        unknown = sorted(set(options) - {"backends", "dtypes"})
        if unknown:  # a typo (backend=...) would otherwise be ignored: every target would run
            raise TypeError(f"array_targets takes backends=[...] and dtypes=[...], got unknown keywords {unknown}")
        dtypes = options.get("dtypes")
        if only is not None:
            dtypes = [d for d in (only if dtypes is None else dtypes) if d in only]  # dtypes=[] leaves nothing
            if not dtypes:  # array_target64 with dtypes=["float32"]: an empty parametrisation, silently
                raise ValueError(f"the {name} fixture holds {only} targets only; the marker asks for {options['dtypes']}")
        selected = targets(backends=options.get("backends"), dtypes=dtypes)
        if not selected:  # backends=[] or dtypes=[]: pytest would skip the test as an empty parameter set
            raise ValueError(f"the array_targets marker of {metafunc.definition.nodeid} selects no targets: {options}")
        metafunc.parametrize(name, target_params(selected), indirect=True)


@pytest.fixture
def array_target(request: pytest.FixtureRequest) -> Target:
    """One (backend, device, dtype) of `fismo_core.testing.targets()`."""
    return request.param


@pytest.fixture
def array_target64(request: pytest.FixtureRequest) -> Target:
    """One float64 (backend, device)."""
    return request.param


@pytest.fixture
def array_xp(array_target: Target) -> Any:
    """The array namespace of ``array_target``."""
    return array_target.xp
