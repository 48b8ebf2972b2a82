"""Errors speak the user's language, and come before any state changes.

Every misuse raises a clear exception naming the parameter and the problem
(checked with ``match=``), and the state passed in is untouched afterwards.
NumPy inputs are made read-only where possible, so an in-place write before
the check would surface as a different error.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import math
import re
import warnings
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest

import fismo_core
from fismo_core import FISMO, FactorSizeWarning, FISMOState, InverseRootConfig, PolarConfig, guards, linalg

SHAPE = (6, 9)
FIELDS = ("P", "Q", "M", "P_inv_sqrt", "Q_inv_sqrt")


def _frozen(a: np.ndarray) -> np.ndarray:
    a = np.array(a)
    a.flags.writeable = False
    return a


def _numpy_setup(shape: tuple[int, ...] = SHAPE) -> tuple[FISMO, np.ndarray, np.ndarray, FISMOState]:
    """An optimizer, W, G and a state one step away from the identity; all arrays read-only."""
    rng = np.random.default_rng(0)
    opt = FISMO()
    W, G = rng.standard_normal(shape), rng.standard_normal(shape)
    W, state = opt.step(W, G, opt.init(W))
    state = FISMOState(*(_frozen(getattr(state, f)) for f in FIELDS), step=state.step)
    return opt, _frozen(W), _frozen(rng.standard_normal(shape)), state


def _snapshot(state: FISMOState) -> dict[str, Any]:
    from fismo_core.testing import to_numpy

    return {**{f: to_numpy(getattr(state, f)).copy() for f in FIELDS}, "step": state.step}


def _assert_untouched(state: FISMOState, snapshot: dict[str, Any]) -> None:
    from fismo_core.testing import to_numpy

    assert state.step == snapshot["step"]
    for f in FIELDS:
        assert np.array_equal(to_numpy(getattr(state, f)), snapshot[f]), f


def _raises_and_untouched(call: Callable[[], Any], state: FISMOState, exc: type, match: str) -> None:
    snapshot = _snapshot(state)
    with pytest.raises(exc, match=match):
        call()
    _assert_untouched(state, snapshot)


# ------------------------------------------------------------------ dtypes
BAD_DTYPES = ["int32", "int64", "uint8", "bool", "complex64", "complex128"]


@pytest.mark.parametrize("shape", [(0, 3), (3, 0), (2, 0, 3), (0, 4, 3)])
def test_init_rejects_an_empty_W_naming_it(shape: tuple) -> None:
    """An empty matrix has no statistics (lines 4-5 would reduce over nothing, a NumPy ValueError or a
    torch IndexError deep in the step): ``init`` refuses it, by the name the adapters pass."""
    with pytest.raises(ValueError, match=rf"layer\.weight has shape \({shape[0]}, .*with no entries"):
        FISMO().init(np.ones(shape), name="layer.weight")


@pytest.mark.parametrize("dtype", BAD_DTYPES)
def test_init_rejects_non_real_floating_W(dtype: str) -> None:
    W = np.ones(SHAPE, dtype=dtype)
    with pytest.raises(TypeError, match=rf"W must have a real floating dtype, got {dtype}"):
        FISMO().init(W)


@pytest.mark.parametrize("dtype", BAD_DTYPES)
def test_step_rejects_non_real_floating_W(dtype: str) -> None:
    opt, W, G, state = _numpy_setup()
    bad = np.ones(SHAPE, dtype=dtype)
    _raises_and_untouched(lambda: opt.step(bad, G, state), state, TypeError, rf"W must have a real floating dtype, got {dtype}")


@pytest.mark.parametrize("dtype", BAD_DTYPES)
def test_step_rejects_non_real_floating_G(dtype: str) -> None:
    opt, W, G, state = _numpy_setup()
    bad = np.ones(SHAPE, dtype=dtype)
    _raises_and_untouched(lambda: opt.step(W, bad, state), state, TypeError, rf"G must have a real floating dtype, got {dtype}")
    _raises_and_untouched(lambda: opt.direction(bad, state), state, TypeError, rf"G must have a real floating dtype, got {dtype}")


@pytest.mark.parametrize("dtype", ["int64", "bool", "complex64"])
@pytest.mark.parametrize("which", ["W", "G"])
def test_torch_rejects_non_real_floating(which: str, dtype: str) -> None:
    torch = pytest.importorskip("torch")
    opt = FISMO()
    W = torch.ones(SHAPE, dtype=torch.float32)
    state = opt.init(W)
    bad = torch.ones(SHAPE, dtype=getattr(torch, dtype))
    args = (bad, W) if which == "W" else (W, bad)
    _raises_and_untouched(lambda: opt.step(*args, state), state, TypeError, rf"{which} must have a real floating dtype")


# ------------------------------------------------------------------ shapes
@pytest.mark.parametrize("shape", [(9,), ()], ids=["vector", "scalar"])
def test_vectors_and_scalars_point_to_adamw(shape: tuple[int, ...]) -> None:
    W = np.ones(shape)
    with pytest.raises(ValueError, match=r"W must be a matrix or a stack of matrices.*AdamW"):
        FISMO().init(W)
    opt, _, _, state = _numpy_setup()
    _raises_and_untouched(lambda: opt.step(W, W, state), state, ValueError, r"W must be a matrix.*AdamW")
    _raises_and_untouched(lambda: opt.direction(W, state), state, ValueError, r"G must be a matrix.*AdamW")


@pytest.mark.parametrize("g_shape", [(9, 6), (6, 8), (2, 6, 9)], ids=["transposed", "narrower", "batched"])
def test_W_and_G_shapes_must_match(g_shape: tuple[int, ...]) -> None:
    opt, W, _, state = _numpy_setup()
    G = np.ones(g_shape)
    _raises_and_untouched(
        lambda: opt.step(W, G, state), state, ValueError,
        rf"W and G must have the same shape, got W \(6, 9\) and G {re.escape(str(g_shape))}",
    )


@pytest.mark.parametrize(
    "other_shape", [(9, 6), (6, 8), (7, 9), (2, 6, 9)], ids=["transposed", "other n", "other m", "batched"]
)
def test_state_for_another_shape_is_rejected(other_shape: tuple[int, ...]) -> None:
    opt, _, _, state = _numpy_setup()  # a state for (6, 9)
    W, G = np.ones(other_shape), np.ones(other_shape)
    match = r"state does not match the gradient: G has shape .*was the state built for another parameter\?"
    _raises_and_untouched(lambda: opt.step(W, G, state), state, ValueError, match)
    _raises_and_untouched(lambda: opt.direction(G, state), state, ValueError, match)


def test_state_must_be_a_fismo_state() -> None:
    opt, W, G, state = _numpy_setup()
    with pytest.raises(TypeError, match=r"state must be a FISMOState from FISMO.init, got tuple"):
        opt.step(W, G, tuple(state))
    with pytest.raises(TypeError, match=r"state must be a FISMOState.*got dict"):
        opt.step(W, G, state._asdict())


def test_non_array_W_is_rejected() -> None:
    opt, W, G, state = _numpy_setup()
    _raises_and_untouched(lambda: opt.step(W.tolist(), G, state), state, TypeError, r"W must be an array of an array-API-compatible library, got list")
    for other, kind in ((1.0, "float"), (None, "NoneType")):  # docs/guarantees.md: lists, floats, None
        _raises_and_untouched(lambda: opt.step(other, G, state), state, TypeError, rf"W must be an array.*got {kind}")
    with pytest.raises(TypeError, match=r"W must be an array.*got list"):
        opt.init(W.tolist())


@pytest.mark.parametrize("G", [[[1.0] * 9] * 6, 1.0, None], ids=["list", "float", "None"])
def test_non_array_G_is_rejected(G: Any) -> None:
    """G is checked to be an array before its shape is read (regression: it gave AttributeError)."""
    opt, W, _, state = _numpy_setup()
    _raises_and_untouched(lambda: opt.step(W, G, state), state, TypeError, r"G must be an array of an array-API-compatible library")


def test_a_numpy_matrix_is_refused_by_name_in_the_core_and_the_matrix_functions() -> None:
    """``numpy.matrix`` (what SciPy's sparse ``.todense()`` returns) multiplies with ``*`` and keeps two
    dimensions in its reductions: the core and ``polar`` / ``inverse_sqrt`` raised ``matrix.max() got an
    unexpected keyword argument 'keepdims'``, ``trace_normalize`` a shape error. Refused by name now, saying
    what to pass, before anything changes."""
    from fismo_core import linalg

    opt, W, G, state = _numpy_setup()
    match = r"is a numpy.matrix \(scipy.sparse's .todense\(\) returns one\), whose \* is a matrix product: pass np.asarray"
    _raises_and_untouched(lambda: opt.step(W, np.asmatrix(G), state), state, TypeError, "G " + match)
    _raises_and_untouched(lambda: opt.step(np.asmatrix(W), G, state), state, TypeError, "W " + match)
    with pytest.raises(TypeError, match="W " + match):
        opt.init(np.asmatrix(W))
    S = np.asmatrix(G.T @ G + np.eye(G.shape[1]))
    with pytest.raises(TypeError, match="A " + match):
        linalg.inverse_sqrt(S)
    for method in ("newton_schulz", "svd"):
        with pytest.raises(TypeError, match="X " + match):
            linalg.polar(np.asmatrix(G), method=method)
    with pytest.raises(TypeError, match="X " + match):
        linalg.whiten(np.asmatrix(G), np.eye(G.shape[0]), np.eye(G.shape[1]))


def test_a_numpy_masked_array_is_refused_by_name_in_the_core_and_the_matrix_functions() -> None:
    """A masked array's reductions skip its mask and its products do not: a masked NaN passed the input checks
    of ``polar`` and reached LAPACK ("SVD did not converge"), a masked asymmetry passed ``inverse_sqrt``'s
    symmetry check (a user's hunt, 2026-12-04). Refused by name, saying what to pass, before anything changes."""
    from fismo_core import linalg

    opt, W, G, state = _numpy_setup()
    match = r"is a numpy masked array, whose reductions skip the masked entries while its products use them"
    masked = np.ma.masked_array(G, mask=np.zeros(G.shape, bool))
    _raises_and_untouched(lambda: opt.step(W, masked, state), state, TypeError, "G " + match)
    hidden_nan = G.copy()
    hidden_nan[0, 0] = np.nan
    hidden_nan = np.ma.masked_invalid(hidden_nan)
    for method in ("newton_schulz", "svd"):
        with pytest.raises(TypeError, match="X " + match):
            linalg.polar(hidden_nan, method=method)
    with pytest.raises(TypeError, match="A " + match):
        linalg.inverse_sqrt(np.ma.masked_array(np.eye(3), mask=np.eye(3, k=1, dtype=bool)))


# ---------------------------------------------------- namespaces, devices
def test_two_namespaces_in_one_call() -> None:
    torch = pytest.importorskip("torch")
    opt, W, G, state = _numpy_setup()
    match = r"all arrays of one call must come from one array library"
    # numpy W with torch G, torch W with numpy G, torch W and G with a NumPy state
    _raises_and_untouched(lambda: opt.step(W, torch.asarray(np.array(G)), state), state, TypeError, match)
    _raises_and_untouched(lambda: opt.step(torch.asarray(np.array(W)), G, state), state, TypeError, match)
    _raises_and_untouched(
        lambda: opt.step(torch.asarray(np.array(W)), torch.asarray(np.array(G)), state), state, TypeError, match
    )
    _raises_and_untouched(lambda: opt.direction(torch.asarray(np.array(G)), state), state, TypeError, match)


@pytest.mark.parametrize(
    "states, beta",
    [("numpy", "torch"), ("torch", "numpy"), ("array_api_strict", "numpy"), ("jax.numpy", "numpy"), ("numpy", "jax.numpy")],
)
def test_an_array_beta_of_another_library_is_refused(states: str, beta: str) -> None:
    """An array ``beta`` comes from the gradient's library, as the state does. Mixed, the step failed inside
    line 7 with the other library's error (a dtype it cannot read), or, NumPy states with a JAX ``beta``,
    returned JAX arrays without a word."""
    xp, xb = pytest.importorskip(states), pytest.importorskip(beta)
    rng = np.random.default_rng(2)
    W, G = (xp.asarray(rng.standard_normal(SHAPE)) for _ in range(2))
    opt = FISMO(beta=xb.asarray(0.9))
    state = opt.init(W)
    match = (rf"beta is a {re.escape(type(xb.asarray(0.9)).__module__)}\..* but the gradient and the state are "
             r".*: an array beta must come from their library")
    _raises_and_untouched(lambda: opt.step(W, G, state), state, TypeError, match)
    _raises_and_untouched(lambda: opt.direction(G, state), state, TypeError, match)
    _raises_and_untouched(lambda: opt.direction_with_faults(G, state), state, TypeError, match)


def test_two_devices_in_one_call() -> None:
    xs = pytest.importorskip("array_api_strict")
    cpu, dev1 = xs.Device("CPU_DEVICE"), xs.Device("device1")
    rng = np.random.default_rng(1)
    opt = FISMO()
    W_np, G_np = rng.standard_normal(SHAPE), rng.standard_normal(SHAPE)
    W_cpu, G_cpu = xs.asarray(W_np, device=cpu), xs.asarray(G_np, device=cpu)
    W_dev, G_dev = xs.asarray(W_np, device=dev1), xs.asarray(G_np, device=dev1)
    state = opt.init(W_cpu)
    match = r"all arrays of one call must live on one device, got .*CPU_DEVICE.*device1"
    _raises_and_untouched(lambda: opt.step(W_cpu, G_dev, state), state, ValueError, match)
    _raises_and_untouched(lambda: opt.step(W_dev, G_cpu, state), state, ValueError, match)
    # W and G agree, but the state lives elsewhere
    _raises_and_untouched(lambda: opt.step(W_dev, G_dev, state), state, ValueError, match)
    _raises_and_untouched(lambda: opt.direction(G_dev, state), state, ValueError, match)


# ---------------------------------------------------------- non-finite input
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf], ids=["nan", "inf", "-inf"])
def test_non_finite_gradient_is_rejected(value: float) -> None:
    """A NaN or infinity in G raises before any state changes (DESIGN.md: errors speak the user's language)."""
    opt, W, G, state = _numpy_setup()
    G = np.array(G)
    G[2, 3] = value
    _raises_and_untouched(lambda: opt.step(W, G, state), state, ValueError, r"G .*(finite|NaN|nan|inf)")



@pytest.mark.parametrize("value", [math.nan, math.inf], ids=["nan", "inf"])
def test_non_finite_parameters_are_rejected(value: float) -> None:
    """A NaN or infinity in W (damaged parameters) raises before any state changes, naming W."""
    opt, W, G, state = _numpy_setup()
    W = np.array(W)
    W[1, 1] = value
    _raises_and_untouched(lambda: opt.step(W, G, state), state, ValueError, r"W contains NaN or infinite values \(")


def test_non_finite_parameters_pass_through_the_other_policies() -> None:
    """``nonfinite="skip"`` and ``"propagate"`` read nothing back: a NaN in W stays where it is, no error, and
    the other entries step (as the same W without the NaN does)."""
    for policy in ("skip", "propagate"):
        opt = FISMO(nonfinite=policy)
        W = np.ones((4, 6))
        W[0, 0] = math.nan
        G = np.random.default_rng(0).standard_normal((4, 6))
        W_new, _ = opt.step(W, G, opt.init(W))
        clean, _ = opt.step(np.ones((4, 6)), G, opt.init(W))
        assert math.isnan(W_new[0, 0]) and np.all(np.isfinite(W_new.ravel()[1:]))
        assert np.array_equal(W_new.ravel()[1:], clean.ravel()[1:]) and not np.array_equal(clean, np.ones((4, 6)))


# -------------------------------------------------------- hyperparameters
HYPERPARAMETER_ERRORS = [
    # lr > 0
    ({"lr": 0.0}, ValueError, r"lr must lie in \(0\.0, inf\), got 0\.0"),
    ({"lr": -0.01}, ValueError, r"lr must lie in \(0\.0, inf\)"),
    ({"lr": math.nan}, ValueError, r"lr must be a finite real number, got nan"),
    ({"lr": math.inf}, ValueError, r"lr must be a finite real number, got inf"),
    ({"lr": True}, ValueError, r"lr must be a finite real number, got True"),
    ({"lr": "0.02"}, ValueError, r"lr must be a finite real number, got '0\.02'"),
    ({"lr": None}, ValueError, r"lr must be a finite real number, got None"),
    ({"lr": 10**400}, ValueError, r"lr must be a finite real number, got 1000"),  # was an OverflowError
    # beta, gamma in [0, 1]
    ({"beta": -0.1}, ValueError, r"beta must lie in \[0\.0, 1\.0\], got -0\.1"),
    ({"beta": 1.5}, ValueError, r"beta must lie in \[0\.0, 1\.0\], got 1\.5"),
    ({"beta": math.nan}, ValueError, r"beta must be a finite real number"),
    ({"beta": False}, ValueError, r"beta must be a finite real number, got False"),
    # an array beta: 0-d, real floating, its value in [0, 1] when it can be read
    ({"beta": np.asarray(1.5)}, ValueError, r"beta must lie in \[0\.0, 1\.0\], got 1\.5"),
    ({"beta": np.asarray(np.nan)}, ValueError, r"beta must be a finite real number, got nan"),
    ({"beta": np.asarray([0.9])}, ValueError, r"beta must be a number or a 0-d real floating array, got an array of shape \(1,\)"),
    ({"beta": np.asarray(1)}, ValueError, r"0-d real floating array, got an array of shape \(\) and dtype int64"),
    ({"beta": np.asarray(0.5j)}, ValueError, r"0-d real floating array, got an array of shape \(\) and dtype complex128"),
    ({"gamma": -1e-9}, ValueError, r"gamma must lie in \[0\.0, 1\.0\]"),
    ({"gamma": 0.0, "mu": 0.0}, ValueError, r"gamma=0 with mu=0 makes P_t and Q_t .* singular"),
    ({"gamma": 1.01}, ValueError, r"gamma must lie in \[0\.0, 1\.0\]"),
    ({"gamma": -math.inf}, ValueError, r"gamma must be a finite real number"),
    ({"gamma": True}, ValueError, r"gamma must be a finite real number, got True"),
    # mu >= 0, weight_decay >= 0
    ({"mu": -1e-3}, ValueError, r"mu must lie in \[0\.0, inf\), got -0\.001"),
    ({"mu": math.inf}, ValueError, r"mu must be a finite real number, got inf"),
    ({"mu": True}, ValueError, r"mu must be a finite real number, got True"),
    ({"mu": 1.0000001e30}, ValueError, r"mu must be at most 1e\+30, got 1\.0000001e\+30: a larger damping overflows float32"),
    ({"weight_decay": -0.1}, ValueError, r"weight_decay must lie in \[0\.0, inf\)"),
    ({"weight_decay": math.nan}, ValueError, r"weight_decay must be a finite real number"),
    ({"weight_decay": True}, ValueError, r"weight_decay must be a finite real number, got True"),
    # inf and str for the others too, as docs/guarantees.md's row says (an audit, 2026-12-04)
    ({"weight_decay": math.inf}, ValueError, r"weight_decay must be a finite real number, got inf"),
    ({"beta": math.inf}, ValueError, r"beta must be a finite real number, got inf"),
    ({"beta": "0.9"}, ValueError, r"beta must be a finite real number, got '0\.9'"),
    ({"gamma": "x"}, ValueError, r"gamma must be a finite real number, got 'x'"),
    ({"mu": True}, ValueError, r"mu must be a finite real number, got True"),
    # an array where a number is wanted: the message says the type is the problem, not the value
    ({"weight_decay": np.asarray(0.1)}, ValueError,
     r"weight_decay must be a finite real number \(a Python number, not an array of shape \(\)\), got array\(0\.1\)"),
    ({"mu": np.asarray([1e-3])}, ValueError, r"mu must be a finite real number \(a Python number, not an array of shape \(1,\)\)"),
    ({"mu": np.float64(math.nan)}, ValueError, r"mu must be a finite real number, got np\.float64\(nan\)"),
    # nesterov is a bool
    ({"nesterov": 1}, TypeError, r"nesterov must be True or False, got 1"),
    ({"nesterov": "yes"}, TypeError, r"nesterov must be True or False, got 'yes'"),
    ({"nesterov": None}, TypeError, r"nesterov must be True or False, got None"),
    # polar: steps, method, coefficients, eps; as a dict and as a string
    ({"polar": {"steps": 0}}, ValueError, r"steps must be a positive integer, got 0"),
    ({"polar": {"steps": -2}}, ValueError, r"steps must be a positive integer, got -2"),
    ({"polar": {"steps": True}}, ValueError, r"steps must be a positive integer, got True"),
    ({"polar": {"steps": 5.0}}, ValueError, r"steps must be a positive integer, got 5\.0"),
    ({"polar": {"method": "svd", "steps": 0}}, ValueError, r"steps must be a positive integer"),
    ({"polar": {"steps": 2.5}}, ValueError, r"polar steps must be a positive integer, got 2\.5"),
    ({"polar": "qr"}, ValueError, r"unknown polar method 'qr': use 'newton_schulz' or 'svd'"),
    ({"polar": "muon"}, ValueError, r"unknown polar method 'muon'"),  # a coefficient name is not a method
    ({"polar": {"method": "qr"}}, ValueError, r"unknown polar method 'qr'"),
    ({"polar": {"coefficients": "adam"}}, ValueError, r"unknown Newton–Schulz coefficients 'adam'"),
    ({"polar": {"coefficients": "Muon"}}, ValueError, r"unknown Newton–Schulz coefficients 'Muon'"),
    ({"polar": {"coefficients": [(3.0, -4.0)]}}, ValueError, r"sequence of \(a, b, c\) triples"),
    ({"polar": {"coefficients": []}}, ValueError, r"sequence of \(a, b, c\) triples"),
    ({"polar": {"coefficients": [(math.nan, 0.0, 0.0)]}}, ValueError, r"coefficients must be finite"),
    ({"polar": {"coefficients": [(10**400, 0.0, 0.0)]}}, ValueError, r"coefficients must be finite"),  # was an OverflowError
    # Text was read by float(): ["123"] was the triple (1, 2, 3) (a user's hunt, 2026-12-03).
    ({"polar": {"coefficients": ["123"]}}, ValueError, r"sequence of \(a, b, c\) triples, got \('123',\)"),
    ({"polar": {"coefficients": [("1.5", "-0.5", "0")]}}, ValueError, r"sequence of \(a, b, c\) triples"),
    ({"polar": {"coefficients": [{"a": 1, "b": 2, "c": 3}]}}, ValueError, r"sequence of \(a, b, c\) triples"),
    ({"polar": {"method": "svd", "rtol": 10**400}}, ValueError, r"polar rtol must be None or a real number in \[0, 1\)"),
    ({"polar": {"eps": 0.0}}, ValueError, r"polar eps must lie in \(0\.0, inf\), got 0\.0"),
    ({"polar": {"eps": math.inf}}, ValueError, r"polar eps must be a finite real number, got inf"),
    # Python said "PolarConfig.__init__() got an unexpected keyword argument", naming neither the option nor
    # its fields, and Muon's names got no FISMO spelling inside the dict (a newcomer's hunt, 2026-12-02).
    ({"polar": {"stepz": 5}}, TypeError, r"polar has unknown keys \['stepz'\]: PolarConfig has the fields "
                                         r"\['method', 'steps', "),
    ({"polar": {"ns_steps": 5}}, TypeError, r"polar=\{\.\.\.\} has keys of other optimizers.*polar=PolarConfig\(steps=5\)"),
    # The suggestion keeps FISMO's own fields given beside Muon's (it dropped them until 2026-12-02), in the
    # dict and as keywords beside it.
    ({"polar": {"method": "newton_schulz", "ns_steps": 5, "eps": 1e-6}}, TypeError,
     r"polar=PolarConfig\(method='newton_schulz', steps=5, eps=1e-06\) \("),
    ({"inv_root": {"eps": 0}}, TypeError, r"inv_root has unknown keys \['eps'\]: InverseRootConfig has the fields"),
    ({"polar": 5}, TypeError, r"polar must be a PolarConfig, a method name or a dict of its fields, got 5"),
    ({"polar": None}, TypeError, r"polar must be a PolarConfig.*got None"),
    ({"polar": InverseRootConfig()}, TypeError, r"polar must be a PolarConfig"),
    # inv_root: steps, method; as a dict and as a string
    ({"inv_root": {"steps": 0}}, ValueError, r"inverse-root steps must be a positive integer, got 0"),
    ({"inv_root": {"steps": -1}}, ValueError, r"inverse-root steps must be a positive integer"),
    ({"inv_root": {"steps": True}}, ValueError, r"inverse-root steps must be a positive integer, got True"),
    ({"inv_root": {"method": "eigh", "steps": 0}}, ValueError, r"inverse-root steps must be a positive integer"),
    ({"inv_root": "cholesky"}, ValueError, r"unknown inverse-root method 'cholesky': use 'eigh' or 'newton_schulz'"),
    ({"inv_root": "svd"}, ValueError, r"unknown inverse-root method 'svd'"),  # a polar method is not a root method
    ({"inv_root": {"method": "cholesky"}}, ValueError, r"unknown inverse-root method 'cholesky'"),
    ({"inv_root": {"coefficients": "muon"}}, ValueError, r"inverse-root coefficients='muon' does not converge"),
    ({"inv_root": {"every": 0}}, ValueError, r"inverse-root every must be a positive integer, got 0"),
    ({"inv_root": {"every": 2.0}}, ValueError, r"inverse-root every must be a positive integer, got 2\.0"),
    ({"inv_root": PolarConfig()}, TypeError, r"inv_root must be a InverseRootConfig"),
    ({"inv_root": 30}, TypeError, r"inv_root must be a InverseRootConfig.*got 30"),
]


@pytest.mark.parametrize(
    "kwargs, exc, match", HYPERPARAMETER_ERRORS,
    ids=[",".join(f"{k}={v!r}" for k, v in d.items()) for (d, _, _) in HYPERPARAMETER_ERRORS]
)
def test_hyperparameters_are_validated(kwargs: dict, exc: type, match: str) -> None:
    with pytest.raises(exc, match=match):
        FISMO(**kwargs)


@pytest.mark.parametrize(
    "make, exc, match",
    [
        (lambda: PolarConfig(steps=0), ValueError, r"steps must be a positive integer, got 0"),
        (lambda: PolarConfig(method="eig"), ValueError, r"unknown polar method 'eig'"),
        (lambda: PolarConfig(coefficients="polar-express"), ValueError, r"unknown Newton–Schulz coefficients 'polar-express'"),
        (lambda: PolarConfig(eps=-1e-7), ValueError, r"polar eps must lie in \(0\.0, inf\), got -1e-07"),
        (lambda: PolarConfig(eps=math.nan), ValueError, r"polar eps must be a finite real number, got nan"),
        (lambda: InverseRootConfig(steps=0), ValueError, r"inverse-root steps must be a positive integer"),
        (lambda: InverseRootConfig(steps=2.5), ValueError, r"inverse-root steps must be a positive integer, got 2\.5"),
        (lambda: InverseRootConfig(method="newton"), ValueError, r"unknown inverse-root method 'newton'"),
    ],
    ids=["polar-steps", "polar-method", "polar-coefficients", "polar-eps", "polar-eps-nan",
         "root-steps", "root-steps-float", "root-method"],
)
def test_configs_are_validated(make: Callable[[], Any], exc: type, match: str) -> None:
    with pytest.raises(exc, match=match):
        make()


def test_polar_eps_rejects_bool() -> None:
    """eps rejects bool like every other real hyperparameter (regression: True was taken as 1)."""
    with pytest.raises((TypeError, ValueError), match=r"eps"):
        PolarConfig(eps=True)


def test_valid_dict_and_string_configs_are_the_dataclasses() -> None:
    """The accepted forms (method name, dict of fields) give the same configs as the dataclasses."""
    assert FISMO(polar="svd").polar == PolarConfig(method="svd")
    assert FISMO(inv_root="newton_schulz").inv_root == InverseRootConfig(method="newton_schulz")
    opt = FISMO(polar={"coefficients": "polar_express", "steps": 8}, inv_root={"method": "newton_schulz", "steps": 12})
    assert opt.polar == PolarConfig(coefficients="polar_express", steps=8)
    assert opt.inv_root == InverseRootConfig(method="newton_schulz", steps=12)
    assert isinstance(FISMO(polar={"coefficients": [[3.0, -4.0, 2.0]]}).polar.coefficients, tuple)
    # A NumPy integer step count is stored as a Python int (as InverseRootConfig's): the config
    # then serialises (json.dumps of dataclasses.asdict raised TypeError on np.int64).
    numpy_steps = FISMO(polar={"steps": np.int64(3)}, inv_root={"method": "newton_schulz", "steps": np.int64(9)})
    assert type(numpy_steps.polar.steps) is int and type(numpy_steps.inv_root.steps) is int
    json.dumps(dataclasses.asdict(numpy_steps))


@pytest.mark.parametrize("field, value", [("lr", -1.0), ("beta", 2.0), ("gamma", -0.5), ("mu", -1.0), ("nesterov", 0)])
def test_hyperparameters_cannot_be_changed_past_the_checks(field: str, value: Any) -> None:
    opt = FISMO()
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(opt, field, value)
    with pytest.raises((ValueError, TypeError), match=field):
        dataclasses.replace(opt, **{field: value})


def test_boundary_values_are_accepted() -> None:
    """The closed ends of the documented ranges are valid (beta, gamma in [0, 1]; mu in [0, 1e30], weight_decay >= 0)."""
    for kwargs in ({"beta": 0.0}, {"beta": 1.0}, {"gamma": 0.0}, {"gamma": 1.0}, {"mu": 0.0}, {"mu": 1e30}, {"weight_decay": 0.0}, {"lr": 1}):
        opt = FISMO(**kwargs)
        for k, v in kwargs.items():
            assert getattr(opt, k) == v and isinstance(getattr(opt, k), float)


# ------------------------------------------- the state survives every failure
def test_state_is_untouched_after_every_failing_call() -> None:
    """One state through a series of failing calls, then a successful step from it: same result as fresh."""
    opt, W, G, state = _numpy_setup()
    expected_W, expected_state = opt.step(np.array(W), np.array(G), _numpy_setup()[3])
    snapshot = _snapshot(state)
    failing = [
        lambda: opt.step(W.astype(np.int64), G, state),
        lambda: opt.step(W, G.astype(np.complex128), state),
        lambda: opt.step(W, G.T, state),
        lambda: opt.step(W[:, :5], G[:, :5], state),
        lambda: opt.step(W[0], G[0], state),
        lambda: opt.direction(G[None], state),
    ]
    for call in failing:
        with pytest.raises((TypeError, ValueError)):
            call()
        _assert_untouched(state, snapshot)
    W_new, new_state = opt.step(W, G, state)
    assert np.array_equal(W_new, expected_W)
    for f in FIELDS:
        assert np.array_equal(getattr(new_state, f), getattr(expected_state, f)), f
    assert new_state.step == state.step + 1 == 2


@pytest.mark.parametrize("rtol", [1.5, -0.1, math.nan, True, "1e-8"])
def test_polar_rtol_is_checked_at_construction(rtol) -> None:
    """The SVD cut must lie in [0, 1): refused when the optimizer is built, not at its first step."""
    with pytest.raises(ValueError, match=r"polar rtol must be None or a real number in \[0, 1\)"):
        FISMO(polar=PolarConfig(method="svd", rtol=rtol))


def test_polar_iteration_dtype_with_the_exact_method_is_refused() -> None:
    with pytest.raises(ValueError, match="Newton–Schulz iteration only"):
        PolarConfig(method="svd", dtype="bfloat16")
    with pytest.raises(ValueError, match="polar dtype must be None"):
        PolarConfig(dtype="int8")
    assert PolarConfig(dtype="bfloat16").dtype == "bfloat16"


# ------------------------------------------------------- other optimizers' keywords
#: torch.optim.Muon's iteration, as its signature states it (torch 2.13): the triple and the step count.
MUON_TRIPLE, MUON_STEPS = (3.4445, -4.775, 2.0315), 5


def _suggested_polar(message: str) -> PolarConfig:
    """The ``polar=PolarConfig(...)`` an error message suggests, evaluated."""
    found = re.search(r"polar=(PolarConfig\(.*?\)) \(line 8", message)
    assert found, message
    return eval(found.group(1), {"PolarConfig": PolarConfig})


def test_muon_keywords_name_fismos_spelling() -> None:
    """``momentum=`` and ``ns_steps=`` are refused with FISMO's names for them, not a bare TypeError."""
    with pytest.raises(TypeError) as info:
        FISMO(momentum=0.9, ns_steps=7)
    message = str(info.value)
    assert message.startswith("fismo_core.FISMO() got keyword arguments of other optimizers")
    assert "momentum=0.9 (torch.optim.Muon)" in message and "momentum -> beta=0.9" in message
    assert "polar=PolarConfig(steps=7)" in message


@pytest.mark.parametrize("polar, fields", [("svd", "method='svd', steps=5"),
                                           ({"method": "newton_schulz", "eps": 1e-6},
                                            "method='newton_schulz', eps=1e-06, steps=5"),
                                           # Muon's name inside the dict too: FISMO's spelling of it
                                           # (PolarConfig(ns_steps=...), until 2026-12-02)
                                           ({"ns_coefficients": (3.0, -3.2, 1.2)},
                                            "coefficients=((3.0, -3.2, 1.2),), steps=5")],
                         ids=["name", "dict", "dict-with-muons-name"])
def test_muon_keywords_beside_a_polar_keep_its_fields_in_the_suggestion(polar, fields) -> None:
    # FISMO(polar=..., ns_steps=5): the suggested PolarConfig dropped the polar given (until 2026-12-02).
    with pytest.raises(TypeError, match=re.escape(f"polar=PolarConfig({fields}) (")):
        FISMO(polar=polar, ns_steps=5)
    config = _suggested_polar(str(pytest.raises(TypeError, FISMO, polar=polar, ns_steps=5).value))
    assert FISMO(polar=config).polar == config


def test_the_suggested_polar_config_is_muons_iteration() -> None:
    """Muon's ``ns_steps``, ``ns_coefficients`` (one triple) and ``eps`` become one ``PolarConfig`` that,
    evaluated as printed, runs Muon's schedule: its triple at each of its steps."""
    with pytest.raises(TypeError) as info:
        FISMO(ns_steps=MUON_STEPS, ns_coefficients=MUON_TRIPLE, eps=1e-7)
    config = _suggested_polar(str(info.value))
    assert (config.steps, config.eps) == (MUON_STEPS, 1e-7)
    schedule, _ = linalg.newton_schulz_schedule(config.coefficients, config.steps)
    assert schedule == (MUON_TRIPLE,) * MUON_STEPS == linalg.newton_schulz_schedule("muon", MUON_STEPS)[0]
    assert FISMO(beta=0.9, polar=config).polar == config  # the spelling given is accepted as it stands


@pytest.mark.parametrize("name", sorted({*guards.MUON_POLAR_KEYWORDS, *guards.MUON_KEYWORDS}))
def test_every_muon_keyword_is_refused_with_a_spelling(name: str) -> None:
    with pytest.raises(TypeError, match=rf"{name}=1 \(.*\)\. In FISMO: "):
        FISMO(**{name: 1})


def test_other_unknown_keywords_keep_pythons_error_and_the_signature() -> None:
    """The check adds nothing to the signature (no ``**kwargs``) and leaves typos to Python's own error."""
    with pytest.raises(TypeError, match="unexpected keyword argument 'betaa'"):
        FISMO(betaa=0.9)
    assert list(inspect.signature(FISMO).parameters) == [f.name for f in dataclasses.fields(FISMO)]
    assert dataclasses.replace(FISMO(), lr=0.1).lr == 0.1


# ------------------------------------------------------------------ factor size
def _factor_size_warnings(record: Any) -> list:
    return [w for w in record if issubclass(w.category, FactorSizeWarning)]


@pytest.mark.parametrize("shape", [(1, 2000), (2000, 1)])
def test_a_thin_matrix_warns_once_naming_block_size(shape: tuple[int, int]) -> None:
    """A ``(1, 2000)`` matrix would keep a 2000 x 2000 factor, 2000 times its own size: one warning at init."""
    W = np.zeros(shape, dtype=np.float32)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        FISMO().init(W)
    (warning,) = _factor_size_warnings(record)
    message = str(warning.message)
    assert f"W, a {shape[0]}x{shape[1]} matrix" in message and "(2000x2000)" in message
    assert "Pass block_size=B" in message
    assert warning.filename == __file__  # it points at the user's call


def test_init_leaves_the_size_to_an_adapter_that_checks_it_itself() -> None:
    """``check_size=False``: no warning from ``init`` (the torch adapter checks every new matrix on every rank
    before its collectives, so that a warning made an error stops every rank); the state is the same."""
    W = np.zeros((1, 2000), dtype=np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FactorSizeWarning)
        quiet = FISMO(gamma=1.0).init(W, check_size=False)
    with pytest.warns(FactorSizeWarning):
        checked = FISMO(gamma=1.0).init(W)
    assert all(np.array_equal(a, b) for a, b in zip(quiet, checked))


def test_a_warning_raised_under_the_demo_points_at_the_demo() -> None:
    """The demo (``fismo_core/demo/``) is the optimizer's user: its warnings point at its training loop.

    Passed over as library frames, they pointed past it, into ``concurrent/futures/process.py`` of the
    demo's worker processes. The call is compiled under the demo's file name: the rule is by file.
    """
    demo_file = str(Path(fismo_core.__file__).parent / "demo" / "train.py")
    call = compile("FISMO().init(W)", demo_file, "exec")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        exec(call, {"FISMO": FISMO, "W": np.zeros((1, 2000), dtype=np.float32)})
    (warning,) = _factor_size_warnings(record)
    assert warning.filename == demo_file


def test_blocks_bound_the_factors_and_silence_the_warning() -> None:
    """With ``block_size=256`` the thin matrix keeps at most 2000 x 256 entries per factor: no warning;
    blocks of 1024 still hold 2M entries, 1000 times the matrix: a warning that asks for smaller blocks."""
    W = np.zeros((1, 2000), dtype=np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FactorSizeWarning)
        FISMO(block_size=256).init(W)
    with pytest.warns(FactorSizeWarning, match=r"1 block 1024x1024 and one 976x976.*a block_size below 1024"):
        FISMO(block_size=1024).init(W)


@pytest.mark.parametrize(
    "m, n, block_size",
    [
        (768, 768, None), (768, 2304, None), (768, 3072, None), (3072, 768, None),  # GPT-2
        (4096, 11008, None), (2048, 5504, None),  # LLaMA MLPs
        (512, 4608, None),  # a 3x3 convolution (c, 9c): factors 9 times the matrix
        (128, 1920, None),  # factors 15.1 times the matrix, 3.7M entries: below the ratio
        (1, 1023, None), (3, 64, None), (1, 3, None),  # small factors, whatever the ratio: below the floor
        (768, 50257, 768),  # a vocabulary head with blocks
    ],
)
def test_usual_weights_do_not_warn(m: int, n: int, block_size: Any) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", FactorSizeWarning)
        guards.check_factor_size(m, n, block_size)


@pytest.mark.parametrize(
    "m, n",
    [(768, 50257), (50257, 768), (128, 2048), (1, 1024)],
    ids=["vocabulary-head", "embedding", "ratio-16.06", "floor-plus-one"],
)
def test_factors_far_larger_than_the_matrix_warn(m: int, n: int) -> None:
    """The rule: more than 16 m n entries in P and Q, and more than 2^20."""
    with pytest.warns(FactorSizeWarning, match=rf"a {m}x{n} matrix"):
        guards.check_factor_size(m, n, None, name="W")
