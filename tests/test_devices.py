"""Device and dtype rules, checked without a GPU.

* Every result lives on the input's device: shown on array-api-strict's
  virtual devices (``Device("device1")``, ``Device("device2")``, and
  ``Device("no_float64")``, which mimics an accelerator without float64),
  and on PyTorch's ``meta`` device, through ``init``, ``direction``, ``step``
  and ``linalg.polar`` / ``inverse_sqrt`` / ``whiten`` / ``sym`` /
  ``trace_normalize``. array-api-strict refuses to combine arrays of two
  devices, so an array created on the default device anywhere in the core
  would raise here.
* Mixing array libraries or devices in one call is a clear error.
* bf16/fp16 parameters are accepted (torch bf16/fp16, NumPy float16, JAX
  bf16/fp16): the state and the direction are float32, ``W`` keeps its dtype.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from array_api_compat import array_namespace, device

from fismo_core import FISMO, linalg
from fismo_core.testing import reference_gradients, targets, to_numpy

xs = pytest.importorskip("array_api_strict")

STATE_FIELDS = ("P", "Q", "M", "P_inv_sqrt", "Q_inv_sqrt")
SHAPE = (2, 6, 9)

STRICT_CASES = [
    pytest.param("device1", "float64", id="device1-float64"),
    pytest.param("device2", "float32", id="device2-float32"),
    pytest.param("no_float64", "float32", id="no_float64-float32"),
]

OPTIMIZERS = {
    "default": FISMO(),
    "matmul-only": FISMO(polar={"coefficients": "polar_express", "steps": 8}, inv_root="newton_schulz"),
    "svd+nesterov+weight_decay": FISMO(polar="svd", nesterov=True, weight_decay=0.1),
}


def _everything(opt: FISMO, W: Any, grads: list, *, check: bool = True) -> dict[str, Any]:
    """Every array the public API returns for W and a few gradients, by name.

    ``check`` is the matrix functions' input check (a host read of the input's values)."""
    out = {}
    state = opt.init(W)
    out.update({f"init.{f}": getattr(state, f) for f in STATE_FIELDS})
    for t, G in enumerate(grads):
        direction, _ = opt.direction(G, state)
        W, state = opt.step(W, G, state)
        out[f"direction{t}"], out[f"W{t}"] = direction, W
        out.update({f"state{t}.{f}": getattr(state, f) for f in STATE_FIELDS})
    P, Q = state.P, state.Q
    G = array_namespace(P).astype(grads[-1], P.dtype)  # the matrix functions take one dtype
    out["polar.newton_schulz"] = linalg.polar(G, check=check)
    out["polar.svd"] = linalg.polar(G, method="svd", check=check)
    out["inverse_sqrt.eigh"] = linalg.inverse_sqrt(P, check=check)
    out["inverse_sqrt.newton_schulz"] = linalg.inverse_sqrt(Q, method="newton_schulz", check=check)
    out["whiten"] = linalg.whiten(G, state.P_inv_sqrt, state.Q_inv_sqrt)
    out["sym"] = linalg.sym(P)
    out["trace_normalize"] = linalg.trace_normalize(P)
    return out


@pytest.mark.parametrize("name", list(OPTIMIZERS))
@pytest.mark.parametrize("device_name, dtype", STRICT_CASES)
def test_results_stay_on_strict_virtual_devices(device_name: str, dtype: str, name: str) -> None:
    dev = xs.Device(device_name)
    grads64 = reference_gradients(SHAPE, 3, seed=31)
    W64 = np.random.default_rng(32).standard_normal(SHAPE)

    def on(d):
        return lambda a: xs.asarray(np.asarray(a, dtype=dtype), device=d)

    opt = OPTIMIZERS[name]
    got = _everything(opt, on(dev)(W64), [on(dev)(g) for g in grads64])
    ref = _everything(opt, on(xs.Device("CPU_DEVICE"))(W64), [on(xs.Device("CPU_DEVICE"))(g) for g in grads64])
    for key, x in got.items():
        assert device(x) == dev, (key, device(x))
        assert x.dtype == getattr(xs, dtype), (key, x.dtype)
        # Virtual devices run the same NumPy arithmetic as CPU_DEVICE, so the
        # values are identical: exact equality, no tolerance.
        assert np.array_equal(to_numpy(x), to_numpy(ref[key])), key


def test_results_stay_on_torch_meta_device_with_low_precision(monkeypatch: pytest.MonkeyPatch) -> None:
    """PyTorch's meta device (shapes, no data): a bf16 W stays bf16 on meta, its state is float32 on meta."""
    torch = pytest.importorskip("torch")
    # Meta tensors have no values, so the non-finite-gradient check (the
    # step's one host read, see tests/test_cupy.py) and the matrix functions'
    # input checks cannot run: switch them off.
    W = torch.empty(SHAPE, device="meta", dtype=torch.bfloat16)
    opt = FISMO(nonfinite="propagate")
    out = _everything(opt, W, [torch.empty(SHAPE, device="meta", dtype=torch.bfloat16)] * 2, check=False)
    for key, x in out.items():
        assert x.device.type == "meta", key
    assert out["W1"].dtype == torch.bfloat16
    assert out["direction1"].dtype == torch.float32
    assert all(out[f"state1.{f}"].dtype == torch.float32 for f in STATE_FIELDS)


# ----------------------------------------------------------------- errors
def _strict_pair():
    d1, d2 = xs.Device("device1"), xs.Device("device2")
    rng = np.random.default_rng(33)
    return (
        xs.asarray(rng.standard_normal((4, 6)), device=d1),
        xs.asarray(rng.standard_normal((4, 6)), device=d2),
    )


def test_mixing_devices_is_a_clear_error() -> None:
    a1, a2 = _strict_pair()
    opt = FISMO()
    s1, s2 = opt.init(a1), opt.init(a2)
    for call in (
        lambda: opt.step(a1, a2, s1),  # W and G on two devices
        lambda: opt.step(a1, a1, s2),  # the state on another device
        lambda: opt.direction(a2, s1),
    ):
        with pytest.raises(ValueError, match=r"one device, got .*device1.*device2"):
            call()
    torch = pytest.importorskip("torch")
    W = torch.ones(4, 6)
    with pytest.raises(ValueError, match=r"one device, got \['cpu', 'meta'\]"):
        opt.step(W, torch.ones(4, 6, device="meta"), opt.init(W))
    # linalg.whiten on two strict devices: the core's own check names them.
    with pytest.raises(ValueError, match=r"one device, got .*device1.*device2"):
        linalg.whiten(a1, xs.asarray(np.eye(4), device=a2.device), xs.asarray(np.eye(6), device=a1.device))


def test_mixing_array_libraries_is_a_clear_error() -> None:
    torch = pytest.importorskip("torch")
    opt = FISMO()
    W_np = np.ones((4, 6))
    with pytest.raises(TypeError, match="one array library"):
        opt.step(W_np, torch.ones(4, 6, dtype=torch.float64), opt.init(W_np))
    with pytest.raises(TypeError, match="one array library"):
        opt.direction(xs.asarray(W_np), opt.init(W_np))
    with pytest.raises(TypeError, match="W must be an array"):
        opt.init([[1.0, 2.0], [3.0, 4.0]])


def test_whiten_mixing_array_libraries_is_an_error() -> None:
    torch = pytest.importorskip("torch")
    with pytest.raises(TypeError, match="one array library"):
        linalg.whiten(np.ones((3, 3)), torch.ones(3, 3, dtype=torch.float64), np.ones((3, 3)))


def test_whiten_mixing_devices_is_an_error() -> None:
    torch = pytest.importorskip("torch")
    with pytest.raises(ValueError, match="one device"):
        linalg.whiten(torch.ones(3, 3), torch.ones(3, 3, device="meta"), torch.ones(3, 3))


# ------------------------------------------------------------------ dtypes
def _low_precision_cases():
    cases = [pytest.param("numpy", "float16", id="numpy-float16")]
    cases += [pytest.param(lib, dt, id=f"{lib}-{dt}") for lib in ("torch", "jax") for dt in ("bfloat16", "float16")]
    return cases


def _make(lib: str, dtype: str):
    if lib == "numpy":
        return (lambda a: np.asarray(a, dtype=dtype)), np.float32, np.dtype(dtype)
    if lib == "torch":
        torch = pytest.importorskip("torch")
        return (lambda a: torch.asarray(a, dtype=getattr(torch, dtype))), torch.float32, getattr(torch, dtype)
    pytest.importorskip("jax")
    import jax.numpy as jnp

    return (lambda a: jnp.asarray(a, dtype=getattr(jnp, dtype))), jnp.float32, jnp.dtype(dtype)


@pytest.mark.parametrize("lib, dtype", _low_precision_cases())
def test_low_precision_parameters(lib: str, dtype: str) -> None:
    """bf16/fp16 W: W keeps its dtype, the state and the direction are float32, the device is W's,
    and the step is the float32 step rounded once to W's dtype."""
    make, f32, low = _make(lib, dtype)
    W64 = np.random.default_rng(34).standard_normal((6, 10))
    grads = reference_gradients((6, 10), 3, seed=35)
    opt = FISMO()
    W = make(W64)
    xp = array_namespace(W)
    state = opt.init(W)
    s32 = opt.init(xp.astype(W, f32))  # the float32 reference run on the same (rounded) data
    for g in grads:
        G = make(g)
        direction, _ = opt.direction(G, state)
        W_prev = W
        W, state = opt.step(W, G, state)
        d32, s32 = opt.direction(xp.astype(G, f32), s32)
        assert W.dtype == low and direction.dtype == f32
        assert all(getattr(state, f).dtype == f32 for f in STATE_FIELDS)
        assert device(W) == device(W_prev) and device(direction) == device(W_prev)
        # The state is the float32 state of the same gradients, exactly: the
        # low-precision G is cast up losslessly and everything after is float32.
        for f in STATE_FIELDS:
            assert np.array_equal(to_numpy(getattr(state, f)), to_numpy(getattr(s32, f))), f
        # Line 9 with the float32 direction rounded once to W's dtype, then W - lr round(dW) in float32 (here in
        # NumPy's) rounded once to W's dtype, as torch's add_ with alpha (since 2026-12-04: the product and the
        # difference were each rounded to W's dtype, and NumPy and JAX rounded lr to it as well).
        as32 = lambda a: to_numpy(xp.astype(a, f32)).astype(np.float32)  # noqa: E731
        expected = make(as32(W_prev) - np.float32(opt.lr) * as32(xp.astype(d32, low)))
        assert np.array_equal(to_numpy(xp.astype(W, f32)), to_numpy(xp.astype(expected, f32)))
    assert not np.array_equal(to_numpy(xp.astype(W, f32)), to_numpy(xp.astype(make(W64), f32)))


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_float32_and_float64_stay_themselves(dtype: str) -> None:
    """float64 stays float64 end to end; float32 stays float32; G is cast to the state's dtype."""
    W = np.random.default_rng(36).standard_normal((4, 6)).astype(dtype)
    opt = FISMO()
    state = opt.init(W)
    W_new, state = opt.step(W, W.astype(np.float64), state)
    assert W_new.dtype == np.dtype(dtype)
    assert all(getattr(state, f).dtype == np.dtype(dtype) for f in STATE_FIELDS)


@pytest.mark.parametrize("lib", ["torch", "jax"])
def test_linalg_matmul_only_methods_keep_low_precision(lib: str) -> None:
    """The matrix functions return their input's dtype; the Newton–Schulz methods compute in bf16.
    (The exact ones, eigh and SVD, compute bf16 input in float32: the backends' LAPACK/cuSOLVER
    have no half-precision routines.)"""
    make, f32, low = _make(lib, "bfloat16")
    rng = np.random.default_rng(37)
    X = rng.standard_normal((5, 8))
    A = X @ X.T + 5 * np.eye(5)
    for out in (linalg.polar(make(X)), linalg.inverse_sqrt(make(A), method="newton_schulz"),
                linalg.whiten(make(X), make(np.eye(5)), make(np.eye(8)))):
        assert out.dtype == low
    assert linalg.inverse_sqrt(make(A)).dtype == low and linalg.polar(make(X), method="svd").dtype == low


# ---------------------------------------------------------- torch on CUDA
def _target_params(selected):
    return [
        pytest.param(t, id=t.id, marks=[pytest.mark.skip(reason=t.reason)] if not t.available else [])
        for t in selected
    ]


@pytest.mark.parametrize("target", _target_params([t for t in targets() if t.backend == "torch" and t.device == "cuda"]))
def test_torch_cuda_matmul_only_step_does_not_sync(target, monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA, torch's sync debug mode raises on any host synchronisation: the matmul-only
    configuration (Newton–Schulz polar and inverse roots) steps without one. (torch.linalg.eigh
    and svd synchronise by design, as torch documents, so the exact methods are not checked.)"""
    import torch

    # The non-finite-gradient check reads one boolean per step by design (see
    # tests/test_cupy.py); switched off, nothing else may synchronise.
    opt = FISMO(polar={"coefficients": "polar_express", "steps": 8}, inv_root="newton_schulz", nonfinite="propagate")
    W = target.asarray(np.random.default_rng(38).standard_normal(SHAPE))
    grads = [target.asarray(g) for g in reference_gradients(SHAPE, 3, seed=39)]
    state = opt.init(W)
    torch.cuda.synchronize()
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for G in grads:
            W, state = opt.step(W, G, state)
            direction, _ = opt.direction(G, state)
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    assert W.device.type == "cuda" and direction.device == W.device
    assert all(getattr(state, f).device == W.device for f in STATE_FIELDS)


@pytest.mark.parametrize("target", _target_params([t for t in targets() if t.backend == "torch" and t.device == "cuda"]))
def test_a_cpu_tensor_beta_steps_cuda_parameters_as_the_float(target) -> None:
    """The torch optimizer with a 0-d float64 CPU tensor ``beta`` (the form a schedule changes in place)
    on CUDA parameters: torch lets a CPU 0-d tensor meet CUDA tensors, and line 7 rounds it to the
    statistics' dtype as a float, so the parameters equal the float ``beta``'s bit for bit."""
    import torch

    from fismo_core.backends.torch import FISMO as TorchFISMO

    shape = SHAPE[1:]  # one matrix, as a layer's weight
    W0 = target.asarray(np.random.default_rng(40).standard_normal(shape))
    grads = [target.asarray(g) for g in reference_gradients(shape, 3, seed=41)]
    runs = []
    for beta in (0.9, torch.tensor(0.9, dtype=torch.float64)):
        W = torch.nn.Parameter(W0.clone())
        opt = TorchFISMO([W], lr=0.05, beta=beta)
        for G in grads:
            W.grad = G.clone()
            opt.step()
        runs.append(W.detach())
    assert runs[1].device.type == "cuda" and torch.equal(runs[0], runs[1])


def test_torch_core_follows_autograd() -> None:
    """What backends.md says of the core and autograd: a ``W`` that requires grad links each step's graph
    to the next (the loss of the third step reaches the first ``W``), and under ``torch.no_grad()`` no
    graph is built at all."""
    torch = pytest.importorskip("torch")
    W0 = torch.nn.Parameter(torch.tensor(reference_gradients((5, 3), 1, seed=4)[0]))
    grads = [torch.tensor(G) for G in reference_gradients((5, 3), 3, seed=5)]
    core = FISMO()
    W, state = W0, core.init(W0.detach())
    for G in grads:
        W, state = core.step(W, G, state)
    assert W.grad_fn is not None
    (dW0,) = torch.autograd.grad(W.sum(), W0)
    # The step is W - lr * D(G) with D independent of W (the gradients are given), so dW_3/dW_0 = I.
    assert torch.equal(dW0, torch.ones_like(W0))
    with torch.no_grad():
        W, state = W0, core.init(W0)
        for G in grads:
            W, state = core.step(W, G, state)
    assert W.grad_fn is None and not W.requires_grad
    assert all(getattr(v, "grad_fn", None) is None for v in state.to_dict().values())
