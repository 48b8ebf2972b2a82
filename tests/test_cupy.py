"""CuPy: FISMO and ``fismo_core.linalg`` on the GPU, state on the device, no host round trips.

Two kinds of test live here.

* **On CuPy** (``cupy_target``, from :func:`fismo_core.testing.targets`):
  they run when CuPy finds a CUDA device and are skipped with the registry's
  reason otherwise. Every step and matrix function runs under
  ``cupyx.allow_synchronize(False)``, which raises ``DeviceSynchronized`` on
  any device-to-host copy or synchronisation CuPy performs.
* **Without a GPU**: the claim "apart from the non-finite-gradient check, a
  step never needs a value on the host" is checked on backends this machine
  has, each in a way that cannot be passed by accident:

  - PyTorch's ``meta`` device: tensors with shapes and dtypes but no data.
    Anything that needs a value on the host (``.item()``, ``float()``,
    ``bool()``, ``.tolist()``, ``.numpy()``, an output shape that depends on
    data such as boolean masking or ``nonzero``) raises there.
  - JAX tracing (``jax.make_jaxpr``): arrays are abstract; converting one to
    a Python scalar or branching on it raises a concretisation error.
  - array-api-strict with every array-to-Python conversion patched to raise
    and data-dependent shapes switched off.
  - An audit of the namespace functions a step calls, against those known to
    be free of host synchronisation in array-api-compat's CuPy namespace.

One host read is deliberate: the non-finite-gradient check of the default
``FISMO(nonfinite="raise")`` (one boolean per step). The configurations here
use ``nonfinite="propagate"``, which has no host read at all, and a test pins
the check down as the only read of the default. The core avoids ``xp.clip``,
which array-api-compat implements for CuPy with boolean-mask indexing (a host
read); a test keeps it out.
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace
import traceback
from typing import Any

import numpy as np
import pytest

import fismo_core.kronecker as fk
import fismo_core.linalg as fl
import fismo_core.optimizer as fo
from fismo_core import FISMO, FISMOState, InverseRootConfig, PolarConfig, linalg
from fismo_core.kronecker import to_dense
from fismo_core.testing import max_relative_error, reference_gradients, targets, to_numpy

CUPY_TARGETS = [t for t in targets() if t.backend == "cupy"]
STATE_FIELDS = ("P", "Q", "M", "P_inv_sqrt", "Q_inv_sqrt")


def _arrays(field: Any) -> tuple:
    """A state field's arrays: itself, or the parts of a blocked factor."""
    return tuple(a for a in field if a is not None) if isinstance(field, tuple) else (field,)

#: Configurations whose steps must not touch the host: every method of the
#: two matrix functions and every branch of the step.
CONFIGS = {
    "default": FISMO(nonfinite="propagate"),
    "svd": FISMO(polar="svd", nonfinite="propagate"),
    "matmul-only": FISMO(
        polar=PolarConfig(coefficients="polar_express", steps=8), inv_root=InverseRootConfig(method="newton_schulz"),
        nonfinite="propagate",
    ),
    "gamma=1": FISMO(gamma=1.0, nonfinite="propagate"),
    "nesterov+weight_decay": FISMO(nesterov=True, weight_decay=0.1, nonfinite="propagate"),
    "blocks": FISMO(block_size=4, nonfinite="propagate"),
}


def _target_params(selected):
    return [
        pytest.param(t, id=t.id, marks=[pytest.mark.skip(reason=t.reason)] if not t.available else [])
        for t in selected
    ]


@pytest.fixture(params=_target_params(CUPY_TARGETS))
def cupy_target(request: pytest.FixtureRequest):
    """Each CuPy (device, dtype) target; skipped with the registry's reason without CUDA."""
    return request.param


# ------------------------------------------------------------- on CuPy (GPU)
@contextlib.contextmanager
def _no_host_sync():
    """Raise ``cupyx.DeviceSynchronized`` on any CuPy device synchronisation inside the block."""
    cupyx = pytest.importorskip("cupyx")
    if not hasattr(cupyx, "allow_synchronize"):
        pytest.skip("this CuPy has no cupyx.allow_synchronize")
    with cupyx.allow_synchronize(False):
        yield


def _on_cupy(x: Any, dev_id: int) -> bool:
    import cupy

    return isinstance(x, cupy.ndarray) and x.device.id == dev_id


@pytest.mark.parametrize("name", list(CONFIGS))
def test_cupy_steps_stay_on_device_without_host_sync(cupy_target, name: str) -> None:
    """20 steps on CuPy: every array stays a CuPy array on the input's GPU, no step
    synchronises with the host, and the trajectory matches NumPy float64."""
    import cupy

    opt = CONFIGS[name]
    shape = (3, 8, 12)
    grads = reference_gradients(shape, 20, seed=21)
    W0 = np.random.default_rng(22).standard_normal(shape)
    for dev_id in range(min(cupy.cuda.runtime.getDeviceCount(), 2)):  # a second GPU, if there is one
        # CuPy runs kernels on its current device, so the data's device is
        # made current (CuPy's rule for any code, see docs/backends.md).
        with cupy.cuda.Device(dev_id):
            W = cupy.asarray(W0, dtype=cupy_target.dtype)
            G_dev = [cupy.asarray(g, dtype=cupy_target.dtype) for g in grads]  # uploaded before the loop
            state = opt.init(W)
            W_ref, s_ref = W0, opt.init(W0)
            for G, G_ref in zip(G_dev, grads):
                with _no_host_sync():
                    W, state = opt.step(W, G, state)
                    direction, _ = opt.direction(G, state)
                W_ref, s_ref = opt.step(W_ref, G_ref, s_ref)
                assert _on_cupy(W, dev_id) and _on_cupy(direction, dev_id)
                assert all(_on_cupy(a, dev_id) for f in STATE_FIELDS for a in _arrays(getattr(state, f)))
        # Tolerance: the project's cross-backend bar against NumPy float64
        # (fismo_core.testing.TOLERANCES, measured on the 50-step verification
        # trajectory); 20 steps of the same kind of trajectory stay below it.
        assert max_relative_error(to_numpy(W) - W0, W_ref - W0) <= cupy_target.tolerance
        for f in ("P", "Q", "M"):
            assert max_relative_error(to_dense(getattr(state, f)), to_dense(getattr(s_ref, f))) <= cupy_target.tolerance


def test_cupy_linalg_on_device_without_host_sync(cupy_target) -> None:
    """polar, inverse_sqrt and whiten on CuPy: results on the input's GPU, no host sync, NumPy's answers.
    ``check=False``: the input checks of ``check=True`` (the default) read values on the host, as
    docs/backends.md says (they synchronised here on an H200, 2026-12-04)."""
    import cupy

    rng = np.random.default_rng(23)
    X = rng.standard_normal((4, 10, 6))
    B = rng.standard_normal((4, 6, 6))
    A = B @ np.swapaxes(B, -1, -2) + 6 * np.eye(6)  # SPD, condition number about 10
    L, R = rng.standard_normal((4, 10, 10)), rng.standard_normal((4, 6, 6))
    calls = {
        "polar newton_schulz": lambda xp_X, xp_A, xp_L, xp_R: linalg.polar(xp_X, check=False),
        "polar svd": lambda xp_X, xp_A, xp_L, xp_R: linalg.polar(xp_X, method="svd", check=False),
        "inverse_sqrt eigh": lambda xp_X, xp_A, xp_L, xp_R: linalg.inverse_sqrt(xp_A, check=False),
        "inverse_sqrt newton_schulz": lambda xp_X, xp_A, xp_L, xp_R: linalg.inverse_sqrt(
            xp_A, method="newton_schulz", check=False),
        "whiten": lambda xp_X, xp_A, xp_L, xp_R: linalg.whiten(xp_X, xp_L, xp_R),
    }
    args = [cupy.asarray(a, dtype=cupy_target.dtype) for a in (X, A, L, R)]
    dev_id = args[0].device.id
    for name, call in calls.items():
        with _no_host_sync():
            got = call(*args)
        assert _on_cupy(got, dev_id), name
        assert got.dtype == cupy.dtype(cupy_target.dtype), name
        # Tolerance: the project's cross-backend bar (TOLERANCES), far above
        # one call's rounding (at most about 1e-14 in float64, 1e-6 in float32).
        assert max_relative_error(got, call(X, A, L, R)) <= cupy_target.tolerance, name


def test_cupy_state_round_trip_and_streams(cupy_target) -> None:
    """state_to_host / state_to_device round trip a checkpoint exactly; a step on a
    non-default stream gives the same bits as on the default stream, without a host sync
    (``nonfinite="propagate"``: the default's finiteness check reads the host, docs/backends.md)."""
    import cupy

    from fismo_core.backends.cupy import state_to_device, state_to_host

    opt = FISMO(nonfinite="propagate")
    grads = [cupy.asarray(g, dtype=cupy_target.dtype) for g in reference_gradients((8, 12), 3, seed=24)]
    W = cupy.asarray(np.random.default_rng(25).standard_normal((8, 12)), dtype=cupy_target.dtype)
    state = opt.init(W)
    for G in grads[:2]:
        W, state = opt.step(W, G, state)
    host = state_to_host(state)
    assert all(isinstance(getattr(host, f), np.ndarray) for f in STATE_FIELDS)
    assert host.step == state.step and host.P.dtype == np.dtype(cupy_target.dtype)
    restored = state_to_device(host, W.device.id)
    for f in STATE_FIELDS:
        assert _on_cupy(getattr(restored, f), W.device.id)
        assert bool(cupy.array_equal(getattr(restored, f), getattr(state, f))), f
    W_a, s_a = opt.step(W, grads[2], state)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        with _no_host_sync():
            W_b, s_b = opt.step(W, grads[2], restored)
    stream.synchronize()
    assert bool(cupy.array_equal(W_a, W_b))
    assert all(bool(cupy.array_equal(getattr(s_a, f), getattr(s_b, f))) for f in STATE_FIELDS)


def test_cupy_batched_matrices_larger_than_32(cupy_target) -> None:
    """A stack of matrices with sides above 32: CuPy's batched cuSOLVER paths (syevjBatched,
    gesvdjBatched) are limited to 32, so larger stacks take another route; check it works."""
    import cupy

    shape = (2, 40, 48)
    grads = reference_gradients(shape, 3, seed=29)
    W0 = np.random.default_rng(30).standard_normal(shape)
    for opt in (FISMO(), FISMO(polar="svd")):
        W = cupy.asarray(W0, dtype=cupy_target.dtype)
        state = opt.init(W)
        W_ref, s_ref = W0, opt.init(W0)
        for g in grads:
            W, state = opt.step(W, cupy.asarray(g, dtype=cupy_target.dtype), state)
            W_ref, s_ref = opt.step(W_ref, g, s_ref)
        # Tolerance: the project's cross-backend bar (TOLERANCES).
        assert max_relative_error(to_numpy(W) - W0, W_ref - W0) <= cupy_target.tolerance


def test_cupy_mixing_devices_is_an_error(cupy_target) -> None:
    import cupy

    if cupy.cuda.runtime.getDeviceCount() < 2:
        pytest.skip("needs two CUDA devices")
    with cupy.cuda.Device(0):
        W = cupy.ones((4, 6), dtype=cupy_target.dtype)
    with cupy.cuda.Device(1):
        G = cupy.ones((4, 6), dtype=cupy_target.dtype)
    with pytest.raises(ValueError, match="one device"):
        FISMO().step(W, G, FISMO().init(W))


def test_cupy_takes_a_cupy_beta_and_refuses_a_numpy_one(cupy_target) -> None:
    """An array ``beta`` comes from the gradient's library: a CuPy one steps as the number (line 7 rounds
    both to the state's dtype), a NumPy one is refused before it meets CuPy's own mixing error."""
    import cupy

    rng = np.random.default_rng(4)
    W, G = (cupy.asarray(rng.standard_normal((4, 6)), dtype=cupy_target.dtype) for _ in range(2))
    state = FISMO().init(W)
    steps = [FISMO(beta=beta).step(W, G, state)[0] for beta in (0.9, cupy.asarray(0.9))]
    assert cupy.array_equal(steps[0], steps[1])
    with pytest.raises(TypeError, match=r"beta is a numpy\.ndarray but the gradient and the state are cupy"):
        FISMO(beta=np.asarray(0.9)).step(W, G, state)


# ------------------------------------------------ the registry (no GPU needed)
def test_cupy_targets_are_registered_with_reasons() -> None:
    """Both CuPy targets are in the registry (so the GPU tests are collected); a missing one says why."""
    assert sorted(t.id for t in CUPY_TARGETS) == ["cupy-cuda-float32", "cupy-cuda-float64"]
    for t in CUPY_TARGETS:
        if not t.available:
            assert "cupy" in t.reason.lower() or "cuda" in t.reason.lower(), t.reason


def test_state_helpers_on_the_host() -> None:
    from fismo_core.backends import cupy as fc

    state = FISMO().init(np.ones((4, 3)))
    host = fc.state_to_host(state)
    assert all(getattr(host, f) is getattr(state, f) for f in STATE_FIELDS)  # NumPy passes through
    with pytest.raises(TypeError, match="FISMOState"):
        fc.state_to_host((1, 2))
    torch = pytest.importorskip("torch")
    with pytest.raises(TypeError, match=r"state\.P is a torch\.Tensor"):
        fc.state_to_host(FISMO().init(torch.ones(4, 3)))
    try:
        import cupy  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match="pip install cupy-cuda12x"):
            fc.state_to_device(state)


def test_state_to_device_keeps_a_hand_built_states_int_counters(monkeypatch: pytest.MonkeyPatch) -> None:
    """A state built by hand has plain-int counters (`FISMOState`'s defaults); ``state_to_device`` made them
    0-d int64 device arrays, which ``state_to_host`` then returned as int64 (the init's are int32), where
    ``state_to_host`` keeps a plain int (a user's hunt, 2026-12-04). A stand-in for CuPy's few names the
    helper uses shows it without a GPU: arrays move, ints stay."""
    from fismo_core.backends import cupy as fc

    class ndarray:  # noqa: N801  (CuPy's name)
        def __init__(self, a: Any) -> None:
            self.host, self.device = np.asarray(a), SimpleNamespace(id=0)

    class Device:
        def __init__(self, id: int) -> None:
            self.id = id

        def __enter__(self) -> "Device":
            return self

        def __exit__(self, *exc: Any) -> None:
            return None

    stand_in = SimpleNamespace(ndarray=ndarray, asarray=ndarray, cuda=SimpleNamespace(Device=Device))
    monkeypatch.setattr(fc, "_cupy", lambda: stand_in)
    state = FISMOState(*FISMO().init(np.ones((4, 3)))[:6])
    assert type(state.skipped) is int and type(state.root_failures) is int
    moved = fc.state_to_device(state, 0)
    assert all(isinstance(getattr(moved, f), ndarray) for f in STATE_FIELDS)
    assert type(moved.skipped) is int and type(moved.root_failures) is int


# ------------------------------------------- no host sync, shown without a GPU
def _meta_state_step(opt: FISMO, shape=(3, 6, 4), dtype=None):
    torch = pytest.importorskip("torch")
    W = torch.empty(shape, device="meta", dtype=dtype)
    G = torch.empty(shape, device="meta", dtype=dtype)
    state = opt.init(W)
    W, state = opt.step(W, G, state)
    W, state = opt.step(W, G, state)
    direction, _ = opt.direction(G, state)
    return W, state, direction


@pytest.mark.parametrize("name", list(CONFIGS))
def test_no_host_sync_on_torch_meta_device(name: str) -> None:
    """The whole step runs on tensors without data: nothing in it reads a value on the host."""
    W, state, direction = _meta_state_step(CONFIGS[name])
    assert W.device.type == "meta" and direction.device.type == "meta"
    assert all(a.device.type == "meta" for f in STATE_FIELDS for a in _arrays(getattr(state, f)))
    assert state.step == 2


def test_no_host_sync_on_torch_meta_device_for_linalg() -> None:
    torch = pytest.importorskip("torch")
    X, A = torch.empty(2, 7, 5, device="meta"), torch.empty(2, 5, 5, device="meta")
    # check=False is the documented switch for sync-free pipelines (docs/linalg.md, "Input checks")
    for out in (
        linalg.polar(X, check=False), linalg.polar(X, method="svd", check=False),
        linalg.inverse_sqrt(A, check=False), linalg.inverse_sqrt(A, method="newton_schulz", check=False),
        linalg.whiten(X, torch.empty(2, 7, 7, device="meta"), A),
    ):
        assert out.device.type == "meta"
    # and it is needed: by default the input checks read the values on the host
    for checked in (lambda: linalg.polar(X), lambda: linalg.inverse_sqrt(A)):
        with pytest.raises((RuntimeError, NotImplementedError)):
            checked()


def test_meta_device_detects_host_reads() -> None:
    """The meta-device check can fail: each way of reading a value on the host raises there."""
    torch = pytest.importorskip("torch")
    x = torch.empty(3, 3, device="meta")
    for read in (
        lambda: float(torch.linalg.matrix_norm(x)),
        lambda: bool((x > 0).any()),
        lambda: torch.linalg.matrix_norm(x).item(),
        lambda: x.tolist(),
        lambda: x[x > 0],  # a data-dependent shape
        lambda: torch.clip(x, min=float(x.sum())),
    ):
        with pytest.raises((RuntimeError, NotImplementedError)):
            read()


def test_the_finiteness_check_is_the_only_host_read() -> None:
    """On the meta device the default step stops in the finiteness check and nowhere else;
    with ``nonfinite="propagate"`` it runs through."""
    torch = pytest.importorskip("torch")
    W = torch.empty(4, 6, device="meta")
    opt = FISMO()
    with pytest.raises((RuntimeError, NotImplementedError)) as exc:
        opt.step(W, W, opt.init(W))
    frames = [f.name for f in traceback.extract_tb(exc.value.__traceback__) if "fismo_core" in f.filename]
    assert frames[-2:] == ["check_finite", "_host_bool"], frames  # the read, in check_finite
    quiet = FISMO(nonfinite="propagate")
    W_new, _ = quiet.step(W, W, quiet.init(W))
    assert W_new.device.type == "meta"


@pytest.mark.parametrize("name", list(CONFIGS))
def test_no_host_sync_under_jax_tracing(name: str) -> None:
    """``jax.make_jaxpr`` traces a step with abstract arrays: no value is ever needed in Python."""
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    opt = CONFIGS[name]
    W = jnp.ones((3, 6, 4), dtype=jnp.float32)
    state = opt.init(W)
    jaxpr = jax.make_jaxpr(lambda W, G, s: opt.step(W, G, s))(W, W, state)
    assert len(jaxpr.eqns) > 10
    # The check can fail: a host read of a traced value raises.
    with pytest.raises(jax.errors.ConcretizationTypeError):
        jax.make_jaxpr(lambda G: G / float(jnp.linalg.norm(G)))(W)


#: Every way an array-api-strict array can hand its values to Python or NumPy.
_HOST_EXITS = ("__bool__", "__int__", "__float__", "__complex__", "__index__", "__array__", "__buffer__",
               "__dlpack__", "__iter__", "__repr__", "__str__", "tolist")


@contextlib.contextmanager
def _strict_without_host_exits():
    xs = pytest.importorskip("array_api_strict")
    monkeypatch = pytest.MonkeyPatch()

    def refuse(name):
        def method(self, *args, **kwargs):
            raise AssertionError(f"host read: {name} called on an array_api_strict array")
        return method

    array_type = type(xs.asarray(0.0))  # array_api_strict._array_object.Array
    for name in _HOST_EXITS:
        monkeypatch.setattr(array_type, name, refuse(name), raising=False)
    try:
        with xs.ArrayAPIStrictFlags(data_dependent_shapes=False, boolean_indexing=False):
            yield xs
    finally:
        monkeypatch.undo()


@pytest.mark.parametrize("name", list(CONFIGS))
def test_no_host_sync_on_array_api_strict(name: str) -> None:
    """array-api-strict with every array-to-Python exit refusing, and neither boolean-mask
    indexing nor data-dependent shapes (both need the data's count on the host)."""
    xs = pytest.importorskip("array_api_strict")
    opt = CONFIGS[name]
    W = xs.asarray(np.random.default_rng(26).standard_normal((3, 6, 4)), dtype=xs.float32)
    G = xs.asarray(reference_gradients((3, 6, 4), 1, seed=27)[0], dtype=xs.float32)
    with _strict_without_host_exits():
        state = opt.init(W)
        for _ in range(2):
            W, state = opt.step(W, G, state)
        direction, _ = opt.direction(G, state)
        A = to_dense(state.P)
        outs = [linalg.polar(G, check=False), linalg.polar(G, method="svd", check=False),
                linalg.inverse_sqrt(A, check=False), linalg.inverse_sqrt(A, method="newton_schulz", check=False),
                linalg.whiten(G, A, to_dense(state.Q))]
        with pytest.raises(AssertionError, match="__bool__"):  # the default input check reads the values
            linalg.inverse_sqrt(A)
        # The check can fail: each kind of host read is refused.
        with pytest.raises(AssertionError, match="__float__"):
            float(xs.linalg.matrix_norm(G[0, ...]))
        with pytest.raises(AssertionError, match="__bool__"):
            bool(xs.all(G[0, 0, 0] > 0))
        with pytest.raises(RuntimeError, match="boolean_indexing"):
            G[G > 0]
        with pytest.raises(RuntimeError, match="data-dependent shapes"):
            xs.nonzero(G)
    assert state.step == 2 and direction.shape == G.shape and len(outs) == 5


# ------------------------------------------ audit of the CuPy namespace calls
#: Namespace functions a step may call, each checked in array-api-compat's
#: CuPy namespace (``array_api_compat/cupy/_aliases.py`` and ``linalg.py``)
#: and CuPy's sources to need no device-to-host transfer:
SYNC_FREE_ON_CUPY = {
    "float32": "a dtype",
    "float64": "a dtype",
    "isdtype": "compares dtypes on the host; no array data",
    "eye": "cupy.eye, on CuPy's current device (array-api-compat ignores device= for CuPy)",
    "zeros": "cupy.zeros, on CuPy's current device",
    "zeros_like": "cupy.zeros_like",
    "ones_like": "cupy.ones_like, an allocation kernel",
    "full_like": "cupy.full_like with a Python number: an allocation and a fill kernel",
    "where": "cupy.where(condition, x, y), three arguments: an elementwise kernel (one argument would sync)",
    "astype": "ndarray.astype, a device kernel",
    "matrix_transpose": "swapaxes, a view",
    "sqrt": "an elementwise kernel",
    "isfinite": "an elementwise kernel (the finiteness check's bool() of the result is its host read)",
    "all": "a reduction kernel; the result stays on the device",
    "maximum": "an elementwise kernel",
    "minimum": "cupy.minimum, an elementwise kernel (array-api-compat takes CuPy's own)",
    "asarray": "asarray(x, copy=True) of a device array in init: a device-to-device copy",
    "reshape": "reshape(G, G.shape, copy=True): ndarray.copy() (a device-to-device copy in C order), then cupy.reshape, a view",
    "linalg.trace": "cupy.trace, a reduction kernel",
    "linalg.matrix_norm": "cupy.linalg.norm(ord='fro'): elementwise kernel and reduction",
    "linalg.eigh": "cuSOLVER syevd / syevjBatched; the info code is read back only under cupyx.errstate(linalg='raise')",
    "linalg.svd": "cuSOLVER gesvd / gesvdjBatched; the info code is read back only under cupyx.errstate(linalg='raise')",
    # The overflow-safe power-of-two scale (linalg._pow2_of) and the state's int32 counters (issue #6):
    "int32": "a dtype",
    "abs": "cupy.abs, an elementwise kernel",
    "max": "cupy.max, a reduction kernel; the result stays on the device",
    "log2": "an elementwise kernel",
    "floor": "an elementwise kernel",
    "finfo": "dtype information on the host (polar's default rtol); no array data",
    "concat": "cupy.concatenate, a device copy (the rows of a block-diagonal product)",
    "sum": "cupy.sum, a reduction kernel; the result stays on the device (traces over blocks)",
}


class _RecordingNamespace:
    def __init__(self, namespace: Any, log: set, prefix: str = "") -> None:
        self._namespace, self._log, self._prefix = namespace, log, prefix

    def __getattr__(self, name: str) -> Any:
        self._log.add(self._prefix + name)
        attr = getattr(self._namespace, name)
        if name == "linalg":
            return _RecordingNamespace(attr, self._log, "linalg.")
        return attr


def test_core_calls_only_namespace_functions_that_are_sync_free_on_cupy(monkeypatch) -> None:
    """Which ``xp.*`` functions a step and the matrix functions call (recorded on NumPy,
    whose array-api-compat namespace has the same functions as CuPy's): all must be
    audited sync-free on CuPy (``clip`` is not: see the next test)."""
    from array_api_compat import array_namespace

    used: set = set()

    def recording_namespace(*arrays, **kwargs):
        return _RecordingNamespace(array_namespace(*arrays, **kwargs), used)

    monkeypatch.setattr(fo, "array_namespace", recording_namespace)
    monkeypatch.setattr(fl, "array_namespace", recording_namespace)
    monkeypatch.setattr(fk, "array_namespace", recording_namespace)
    W = np.random.default_rng(28).standard_normal((2, 6, 4))
    for opt in CONFIGS.values():
        state = opt.init(W)
        for _ in range(2):
            W_new, state = opt.step(W, W, state)
    A = to_dense(state.P)
    # check=False: the sync-free path (the input checks read values on the host by design)
    linalg.polar(W, check=False), linalg.polar(W, method="svd", check=False), linalg.inverse_sqrt(A, check=False)
    linalg.inverse_sqrt(A, method="newton_schulz", check=False), linalg.whiten(W, A, to_dense(state.Q))
    monkeypatch.undo()
    used.discard("linalg")
    assert {"linalg.eigh", "linalg.svd", "eye"} <= used  # the recorder saw the calls
    unaudited = used - set(SYNC_FREE_ON_CUPY)
    assert not unaudited, f"audit these for host synchronisation on CuPy, then add them to SYNC_FREE_ON_CUPY: {unaudited}"


def test_array_api_compat_clip_for_cupy_uses_mask_indexing() -> None:
    """Why ``clip`` is kept out of the core, shown without CuPy: array-api-compat's generic
    ``clip`` (the one its CuPy namespace binds) indexes with a boolean mask, and CuPy reads
    the mask's count back to the host to size the result."""
    import inspect

    from array_api_compat.common import _aliases

    source = inspect.getsource(_aliases.clip)
    assert "out[ia] = a[ia]" in source
    cupy_aliases = inspect.getsourcefile(_aliases).replace("common", "cupy")
    with open(cupy_aliases) as f:
        assert "clip = get_xp(cp)(_aliases.clip)" in f.read()


def test_state_is_fismo_state() -> None:
    """The helpers' field list is the state's array fields (guards a renamed field)."""
    from fismo_core.backends.cupy import STATE_ARRAYS

    assert STATE_ARRAYS == tuple(f for f in FISMOState._fields if f != "step")
