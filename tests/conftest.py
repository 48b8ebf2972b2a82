"""Shared fixtures: one ``target`` (backend, device, dtype) fixture over every backend.

Targets come from :func:`fismo_core.testing.targets`, the same list ``fismo
verify`` uses; a target whose library or device is missing is skipped with
the reason (CuPy and torch CUDA skip here unless a CUDA device is present).
The project's own pytest plugin (``fismo_core.pytest_plugin``, also usable by
anyone) is loaded too: it provides the public ``array_target`` fixtures,
exercised by ``tests/test_harness.py``. For the whole session this file pins
true float32 matrix products (TF32 off) and turns JAX's x64 mode on, as
``fismo verify`` does: the tolerances were measured so, and the ``target``
fixtures (unlike the plugin's) do not scope those settings per test.
"""

from __future__ import annotations

import getpass
import os
import tempfile

import pytest

# Inductor's FX graph cache (torch 2.13) reuses a graph compiled under another ATEN_CPU_CAPABILITY:
# a blocked FISMO step compiled under the default capability, then under avx2, gave NaN, and the reverse
# order silently wrong parameters (docs/torch.md, "torch.compile"). One cache per capability, so that
# running the suite under several kernel sets on one machine (as .ci/run does) cannot mix them.
os.environ.setdefault(
    "TORCHINDUCTOR_CACHE_DIR",
    os.path.join(tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}_{os.environ.get('ATEN_CPU_CAPABILITY', 'native')}"),
)

pytest.register_assert_rewrite("fismo_core.pytest_plugin")  # imported below, before pytest loads it as a plugin

from fismo_core.pytest_plugin import target_params  # noqa: E402
from fismo_core.testing import Target, pin_full_float32_matmuls, targets  # noqa: E402

pytest_plugins = ["fismo_core.pytest_plugin", "pytester"]  # pytester: tests/test_harness.py runs the plugin

ALL_TARGETS = targets()
pin_full_float32_matmuls()  # after targets(), which imported torch and JAX (the pin imports neither)
if any(t.backend == "jax" and t.available for t in ALL_TARGETS):
    import jax

    jax.config.update("jax_enable_x64", True)  # the float64 targets need it; many tests build JAX arrays directly


@pytest.fixture(params=target_params(ALL_TARGETS))
def target(request: pytest.FixtureRequest) -> Target:
    """Every (backend, device, dtype); skipped with the reason where unavailable."""
    return request.param


@pytest.fixture(params=target_params([t for t in ALL_TARGETS if t.dtype == "float64"]))
def target64(request: pytest.FixtureRequest) -> Target:
    """Every float64 (backend, device): for checks at float64 precision."""
    return request.param


@pytest.fixture
def xp(target: Target):
    """The array namespace of ``target``."""
    return target.xp


@pytest.fixture(scope="session", autouse=True)
def one_thread_per_test_process():
    """torch's and NumPy's BLAS/OpenMP pools on one thread in every test process.

    The README runs the suite with one pytest-xdist worker per core: each
    worker's own pools made as many threads again, and on a busy 2-core
    machine (XLA's thread pool is alive once JAX has run) torch's spinning
    OpenMP workers made single tests 10-100x slower, as OpenBLAS's did to
    NumPy's 48- and 64-wide ``eigh``. The tests' matrices are small: their
    arithmetic does not depend on the thread count. Subprocesses (the
    distributed ranks, the CLI) choose their own. NumPy's BLAS is reached
    through ``threadpoolctl`` when it is installed.
    """
    from fismo_core.verify import _one_thread

    with _one_thread():
        yield


@pytest.fixture
def unwritable_directory(tmp_path):
    """An existing directory where no file can be created: a read-only one for an ordinary user; for root,
    whom permission bits do not stop, ``/sys`` (sysfs creates no files)."""
    from fismo_core._paths import cannot_write_in

    if hasattr(os, "geteuid") and os.geteuid() == 0:
        if not os.path.isdir("/sys") or cannot_write_in("/sys") is None:
            pytest.skip("running as root, and no directory here refuses root a file")
        yield "/sys"
        return
    locked = tmp_path / "read-only"
    locked.mkdir()
    locked.chmod(0o555)
    yield str(locked)
    locked.chmod(0o755)
