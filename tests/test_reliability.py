"""Reliability (issue #6): bad input gets a clear error, faults lose nothing, long runs stay sane.

Sections (the page "Guarantees and failure modes", ``docs/guarantees.md``,
maps every case to its test):

1. Non-finite gradients: ``nonfinite="skip"`` per matrix (also under
   ``jax.jit``), the ``"raise"`` message, what ``"propagate"`` does; the torch
   adapter names the parameter and changes nothing (bitwise) or skips it.
2. Degenerate but legal input: zero, rank-deficient, tiny (1e-30) and huge
   (1e30) gradients, 1x1 / 1xn / mx1 / very wide / very tall matrices,
   non-contiguous and transposed views.
3. Faults in the matrix functions, injected: ``eigh`` raising or returning
   NaN, Newton–Schulz roots that do not converge; retry in float64,
   fallback to the previous root, ``InverseRootError`` after
   ``max_failures`` consecutive failures.
4. Long runs: 10,000 float32 steps keep P and Q symmetric positive definite
   with traces m and n; beyond the algorithm's stable range the run stops
   with a clear error rather than NaN.
5. Property tests (hypothesis) of ``fismo_core.linalg`` on every float64
   backend, and determinism on every backend.

Tolerances carry the value measured on this machine (x86-64, NumPy 2.4 /
OpenBLAS, torch 2.13 CPU, JAX 0.10, array-api-strict 2.6) and why the bar
sits where it does. Checkpointing is in ``tests/test_checkpoint.py``.
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
from array_api_compat import device

import fismo_core.linalg as fl
from fismo_core import FISMO, FISMOState, InverseRootConfig, linalg
from fismo_core.optimizer import InverseRootError, InverseRootWarning
from fismo_core.testing import Target, max_relative_error, reference_gradients, targets, to_numpy

ARRAY_FIELDS = ("P", "Q", "M", "P_inv_sqrt", "Q_inv_sqrt")

def NO_NUMPY_NAN_WARNING(test):  # noqa: N802 - a marker, named as one
    """NumPy's RuntimeWarnings of a NaN, a division by zero or an overflow are errors in ``test``: the NaN root
    of a singular factor is the check's to flag (InverseRootWarning), not NumPy's to warn of
    (`guards.nan_is_the_answer`)."""
    for what in ("invalid value encountered", "divide by zero encountered", "overflow encountered"):
        test = pytest.mark.filterwarnings(f"error:{what}:RuntimeWarning")(test)
    return test


def _np(x) -> np.ndarray:
    """A float64 NumPy copy of any backend's array."""
    return np.array(to_numpy(x), dtype=np.float64, copy=True)


def _equal(a, b) -> bool:
    return np.array_equal(_np(a), _np(b))


def _ints(x) -> list:
    return [int(v) for v in np.ravel(_np(x))]


def _run(opt: FISMO, target: Target, W0: np.ndarray, grads: list) -> tuple:
    """``opt`` from ``W0`` over ``grads`` on ``target``: final W, state, and each step's direction (NumPy)."""
    W = target.asarray(W0)
    state = opt.init(W)
    directions = []
    for G in grads:
        G = target.asarray(G)
        directions.append(_np(opt.direction(G, state)[0]))
        W, state = opt.step(W, G, state)
    return _np(W), state, directions


# ========================================================== 1. non-finite gradients
def test_skip_policy_skips_only_the_bad_matrices_of_a_batch(target: Target) -> None:
    """``nonfinite="skip"``: in a batch of 3, the matrices with a NaN and an inf keep W, P, Q, M and
    roots bit for bit, get direction 0 and no weight decay, and are counted; the good one steps
    exactly as it does alone."""
    rng = np.random.default_rng(0)
    shape = (3, 4, 6)
    opt = FISMO(nonfinite="skip", weight_decay=0.1)
    W0, G1, G2 = (rng.standard_normal(shape) for _ in range(3))
    G2[1, 2, 3] = math.nan
    G2[2, 0, 0] = -math.inf
    W1, state1 = opt.step(target.asarray(W0), target.asarray(G1), opt.init(target.asarray(W0)))
    direction, _ = opt.direction(target.asarray(G2), state1)
    W2, state2 = opt.step(W1, target.asarray(G2), state1)

    assert _ints(state2.skipped) == [0, 1, 1] and _ints(state1.skipped) == [0, 0, 0]
    assert state2.step == 2  # step counts calls; matrix i took step - skipped[i] steps
    assert np.all(np.isfinite(_np(W2))) and np.all(np.isfinite(_np(direction)))
    assert np.array_equal(_np(direction)[1:], np.zeros((2, 4, 6)))
    assert np.array_equal(_np(W2)[1:], _np(W1)[1:])  # bitwise, and without weight decay
    for f in ARRAY_FIELDS:
        assert np.array_equal(_np(getattr(state2, f))[1:], _np(getattr(state1, f))[1:]), f
    # Matrix 0 steps as if it were alone. Tolerance: a batched call against a single one
    # (measured: identical bits on NumPy and array-api-strict, <= 3e-16 (float64) and
    # 1.2e-7 (float32) on torch and JAX, whose batched kernels may sum in another order);
    # 10 unit roundoffs of the dtype, while a skipped or a repeated step moves W by ~lr = 2e-2.
    single = FISMO(weight_decay=0.1)
    W_single, state_single = single.step(target.asarray(W0[0]), target.asarray(G1[0]), single.init(target.asarray(W0[0])))
    W_single, state_single = single.step(W_single, target.asarray(G2[0]), state_single)
    tol = 10 * float(np.finfo(target.dtype).eps)
    assert max_relative_error(_np(W2)[0], _np(W_single)) <= tol
    for f in ("P", "Q", "M"):
        assert max_relative_error(_np(getattr(state2, f))[0], _np(getattr(state_single, f))) <= tol, f


def test_skip_policy_is_sync_free_under_jax_jit() -> None:
    """The skip is made with ``where``: it traces once under ``jax.jit`` and skips there too."""
    jax = pytest.importorskip("jax")
    jnp = pytest.importorskip("jax.numpy")
    rng = np.random.default_rng(1)
    opt = FISMO(nonfinite="skip")
    traces = []

    def step(W, G, state):
        traces.append(1)
        return opt.step(W, G, state)

    jitted = jax.jit(step)
    W = jnp.asarray(rng.standard_normal((2, 4, 6)), dtype=jnp.float32)
    state = opt.init(W)
    for t in range(4):
        G = rng.standard_normal((2, 4, 6))
        if t == 2:
            G[0, 1, 1] = math.nan
        W_prev, state_prev = W, state
        W, state = jitted(W, jnp.asarray(G, dtype=jnp.float32), state)
        if t == 2:
            assert np.array_equal(np.asarray(W[0]), np.asarray(W_prev[0]))
            assert np.array_equal(np.asarray(state.P[0]), np.asarray(state_prev.P[0]))
            assert not np.array_equal(np.asarray(W[1]), np.asarray(W_prev[1]))
    assert len(traces) == 1
    assert _ints(state.skipped) == [1, 0] and np.all(np.isfinite(np.asarray(W)))


def test_raise_policy_says_what_and_how_many() -> None:
    """The default error counts NaN and infinite entries and points to ``nonfinite="skip"``
    (that it raises before any change is tests/test_errors.py::test_non_finite_gradient_is_rejected)."""
    opt = FISMO()
    W = np.zeros((3, 4))
    G = np.ones((3, 4))
    G[0, 0], G[1, 1], G[2, 2] = math.nan, math.nan, math.inf
    with pytest.raises(ValueError, match=r"2 NaN, 1 infinite of 12 entries.*nonfinite='skip'"):
        opt.step(W, G, opt.init(W))


@pytest.mark.parametrize("namespace", ["numpy", "array_api_strict"])
def test_the_finiteness_check_raises_or_skips_without_numpy_warnings(namespace: str) -> None:
    """NumPy (and array-api-strict, on NumPy) warned ``invalid value encountered in multiply`` (the
    check's ``inf * 0``) before the ValueError: noise before the one message that says what happened.
    Under ``"skip"`` the warning came with every skipped step."""
    mod = pytest.importorskip(namespace)
    W = mod.asarray(np.zeros((3, 4)))
    G_host = np.ones((3, 4))
    G_host[0, 0] = math.inf
    G = mod.asarray(G_host)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(ValueError, match=r"0 NaN, 1 infinite of 12 entries"):
            FISMO().step(W, G, FISMO().init(W))
        skipper = FISMO(nonfinite="skip")
        _, state = skipper.step(W, G, skipper.init(W))
    assert int(state.skipped) == 1


@pytest.mark.parametrize("namespace", ["numpy", "array_api_strict"])
@pytest.mark.parametrize("dtype, scale", [("float32", 1e6), ("float64", 1e20)])
def test_a_singular_factor_brings_the_inverse_root_warning_alone(namespace: str, dtype: str, scale: float) -> None:
    """A constant gradient (rank 1) of a large scale makes ``P_t`` and ``Q_t`` singular at their precision:
    eigh gives exact zero eigenvalues, whose ``1 / sqrt`` divided by zero and whose residual's products met
    infinities. NumPy warned "divide by zero" and "invalid value encountered in matmul" beside the two
    InverseRootWarnings (found by a user's hunt, 2026-12-02; guarantees.md promises the one warning)."""
    mod = pytest.importorskip(namespace)
    W = mod.asarray(np.ones((3, 2), dtype=dtype))
    G = mod.asarray(np.full((3, 2), scale, dtype=dtype))
    opt = FISMO()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.step(W, G, opt.init(W))
    kinds = [w.category.__name__ for w in caught]
    assert kinds and set(kinds) == {"InverseRootWarning"}, [(k, str(w.message)[:60]) for k, w in zip(kinds, caught)]


class _NaNRoot(InverseRootConfig):
    """A user's root (the subclass hook of `InverseRootConfig.root_and_eigenvalues`) that always fails."""

    def __call__(self, A):
        return A * math.nan


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_a_subclass_root_that_fails_is_retried_with_eigh_in_float64(dtype: str) -> None:
    """A subclass computing its own root: a failure is retried with eigh in float64, in a float64 state too.
    Before 2026-12-02 a float64 state skipped the retry (as if its root had been the library's float64 eigh
    already), fell back to ``P_{t-1}`` and warned "also with eigh in float64" (found by a user's hunt).
    The retried step is the plain eigh step to the dtype's rounding (float32: the retry's float64 root is
    rounded; 1e-5 is about 100 float32 ulps), float64 bit for bit up to 1e-12."""
    rng = np.random.default_rng(0)
    W, G = (rng.standard_normal((4, 3)).astype(dtype) for _ in range(2))
    flaky, plain = FISMO(inv_root=_NaNRoot()), FISMO()
    with warnings.catch_warnings():
        warnings.simplefilter("error", InverseRootWarning)
        W1, state = flaky.step(W, G, flaky.init(W))
    assert int(state.root_failures) == 0
    W_plain, _ = plain.step(W, G, plain.init(W))
    assert max_relative_error(W1 - W, W_plain - W) <= (1e-5 if dtype == "float32" else 1e-12)


def test_raise_policy_checks_the_gradient_as_cast_to_the_state_dtype() -> None:
    """A float64 gradient beyond float32's range is finite but infinite once cast to a float32 state:
    every entry point refused it under ``"raise"`` before (the check read the float64 ``G``) and took a
    NaN step with no error; under ``"skip"`` it is skipped."""
    rng = np.random.default_rng(0)
    W = rng.standard_normal((4, 3)).astype(np.float32)
    G = rng.standard_normal((4, 3))
    G[0, 0] = 1e39  # float32's largest is 3.4e38
    opt = FISMO()
    state = opt.init(W)
    match = r"0 NaN, 1 infinite of 12 entries once cast from float64 to the state's dtype float32"
    with np.errstate(over="ignore", invalid="ignore"):  # NumPy warns of the overflowing cast (and skip's inf * 0)
        with pytest.raises(ValueError, match=match):
            opt.step(W, G, state)
        with pytest.raises(ValueError, match=match):
            opt.direction(G, state)
        result = opt.direction_with_faults(G, state)
        assert bool(result.faults.nonfinite)
        with pytest.raises(ValueError, match=match):
            opt.settle(G, state, result)
        W_skip, state_skip = FISMO(nonfinite="skip").step(W, G, state)
    assert np.array_equal(W_skip, W) and int(state_skip.skipped) == 1


def test_propagate_policy_does_not_check() -> None:
    """``nonfinite="propagate"`` reads nothing back: NaN reaches the matrix functions. NumPy's and
    torch's eigh then raise their LinAlgError (before any state changes: the core is functional);
    JAX's eigh and the matmul-only methods return NaN, which flows into the state."""
    G = np.ones((3, 4))
    G[1, 2] = math.nan
    opt = FISMO(nonfinite="propagate")
    W = np.zeros((3, 4))
    with pytest.raises(np.linalg.LinAlgError):
        opt.step(W, G, opt.init(W))
    matmul_only = FISMO(nonfinite="propagate", inv_root="newton_schulz")
    W_new, state = matmul_only.step(W, G, matmul_only.init(W))
    assert np.isnan(W_new).any() and np.isnan(state.P).any()


def test_propagate_with_amortised_roots_lets_a_nan_through_between_refreshes() -> None:
    """With roots every ``k`` steps, a NaN at a step that reuses the roots reaches no ``eigh``: it flows into
    ``W``, ``P``, ``Q`` and ``M`` without an error (``"propagate"`` checks nothing, as ``torch.optim.AdamW``), and
    the next step that recomputes the roots raises, as does every later one. The docs said a NaN always met
    ``eigh`` and nothing changed (a user's hunt, 2026-12-04: true with roots at every step only)."""
    torch = pytest.importorskip("torch")
    from fismo_core.backends.torch import FISMO as TorchFISMO

    W = torch.nn.Parameter(torch.randn(8, 6, generator=torch.Generator().manual_seed(0)))
    opt = TorchFISMO([W], nonfinite="propagate", inv_root={"every": 3})
    outcomes = []
    for t in range(7):
        W.grad = torch.randn(8, 6, generator=torch.Generator().manual_seed(t + 1))
        if t == 1:  # the second step: the roots of the first are reused
            W.grad[0, 0] = math.nan
        try:
            opt.step()
            outcomes.append(bool(W.isfinite().all()))
        except torch.linalg.LinAlgError:
            outcomes.append("LinAlgError")
    assert outcomes == [True, False, False, "LinAlgError", "LinAlgError", "LinAlgError", "LinAlgError"]
    assert opt.state[W]["P"].isnan().any()


# --------------------------------------------------------------- torch adapter
def _torch_model(torch):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 3), torch.nn.Linear(3, 6))


def _torch_opt(torch, model, **kwargs):
    from fismo_core.backends.torch import FISMO as TorchFISMO

    named = [(n, p) for n, p in model.named_parameters() if p.ndim == 2]
    vectors = [(n, p) for n, p in model.named_parameters() if p.ndim < 2]
    return TorchFISMO(
        [{"params": named}, {"params": vectors, "algorithm": "adamw"}], lr=0.05, weight_decay=0.1, **kwargs
    )


def _torch_snapshot(torch, model, opt) -> dict:
    snap = {f"param:{n}": p.detach().clone() for n, p in model.named_parameters()}
    for i, (p, state) in enumerate(opt.state.items()):
        for key, value in state.items():
            snap[f"state{i}:{key}"] = value.clone()
    return snap


def _fill_grads(torch, model, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen)


def test_torch_raise_names_the_parameter_and_changes_nothing() -> None:
    """Default ``nonfinite="raise"``: the error names the parameter (by name, index, group and shape);
    every parameter, every state tensor (P, Q, M, roots, counters, AdamW's) and every step count is
    bit for bit what it was, and the next clean step runs as if nothing had happened."""
    torch = pytest.importorskip("torch")
    model, twin = _torch_model(torch), _torch_model(torch)
    opt, opt_twin = _torch_opt(torch, model), _torch_opt(torch, twin)
    for m, o in ((model, opt), (twin, opt_twin)):
        _fill_grads(torch, m, 1)
        o.step()
    _fill_grads(torch, model, 2)
    model[2].weight.grad[1, 2] = math.nan
    before = _torch_snapshot(torch, model, opt)
    with pytest.raises(ValueError, match=r"gradient of parameter '2\.weight' \(index 1 in param group 0, shape \(3, 4\)\) "
                                         r"contains 1 NaN and 0 infinite values.*took no step"):
        opt.step()
    after = _torch_snapshot(torch, model, opt)
    assert before.keys() == after.keys()
    for key in before:
        assert torch.equal(before[key], after[key]), key
    # Unnamed parameters are named by index, group and shape.
    from fismo_core.backends.torch import FISMO as TorchFISMO

    W = torch.nn.Parameter(torch.zeros(2, 3))
    W.grad = torch.full((2, 3), math.inf)
    with pytest.raises(ValueError, match=r"parameter 0 of param group 0 \(shape \(2, 3\)\) contains 0 NaN and 6 infinite"):
        TorchFISMO([W]).step()
    # The next clean step is the twin's step.
    for m, o in ((model, opt), (twin, opt_twin)):
        _fill_grads(torch, m, 3)
        o.step()
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p, q)


def test_torch_raise_names_a_damaged_parameter_and_changes_nothing() -> None:
    """A NaN in a FISMO parameter itself (its gradient finite) is refused in the same host read, naming it."""
    torch = pytest.importorskip("torch")
    model = _torch_model(torch)
    opt = _torch_opt(torch, model)
    _fill_grads(torch, model, 1)
    opt.step()
    _fill_grads(torch, model, 2)
    with torch.no_grad():
        model[2].weight[0, 0] = math.nan
    before = _torch_snapshot(torch, model, opt)
    with pytest.raises(ValueError, match=r"parameter '2\.weight' .* contains 1 NaN and 0 infinite values: it was damaged"):
        opt.step()
    after = _torch_snapshot(torch, model, opt)
    assert before.keys() == after.keys()
    for key in before:  # bit for bit, the damaged entry (NaN) included
        torch.testing.assert_close(after[key], before[key], rtol=0, atol=0, equal_nan=True, msg=key)


def test_torch_skip_leaves_the_parameter_alone_and_counts_it() -> None:
    """``nonfinite="skip"``: the parameter with a bad gradient keeps its value (no weight decay),
    P, Q, M, roots and step bit for bit and counts the skip; the others step exactly as an
    optimizer that never saw it."""
    torch = pytest.importorskip("torch")
    model, twin = _torch_model(torch), _torch_model(torch)
    opt, opt_twin = _torch_opt(torch, model, nonfinite="skip"), _torch_opt(torch, twin, nonfinite="skip")
    for m, o in ((model, opt), (twin, opt_twin)):
        _fill_grads(torch, m, 1)
        o.step()
    bad = model[2].weight
    before = {k: v.clone() for k, v in opt.state[bad].items()}
    value_before = bad.detach().clone()
    _fill_grads(torch, model, 2)
    _fill_grads(torch, twin, 2)
    bad.grad[0, 0] = math.inf
    twin[2].weight.grad = None  # the twin simply has no gradient for it
    opt.step()
    opt_twin.step()
    assert torch.equal(bad, value_before)
    for key in ("P", "Q", "M", "P_inv_sqrt", "Q_inv_sqrt", "step"):
        assert torch.equal(opt.state[bad][key], before[key]), key
    assert opt.state[bad]["skipped"].item() == 1 and opt.state[model[0].weight]["skipped"].item() == 0
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p, q)
    # A parameter whose very first gradient is bad gets a state holding only the count.
    fresh = torch.nn.Parameter(torch.ones(2, 3))
    fresh.grad = torch.full((2, 3), math.nan)
    from fismo_core.backends.torch import FISMO as TorchFISMO

    opt_fresh = TorchFISMO([fresh], nonfinite="skip")
    opt_fresh.step()
    assert torch.equal(fresh, torch.ones(2, 3)) and opt_fresh.state[fresh]["skipped"].item() == 1
    assert opt_fresh.state[fresh]["step"].item() == 0


# ==================================================== 2. degenerate but legal input
def test_zero_gradient_gives_a_zero_step(target: Target) -> None:
    """G = 0: direction exactly 0, W unchanged, M = 0; P and Q stay the identity to rounding (the EMA of
    P_{t-1} with mu I, trace-normalised)."""
    opt = FISMO()
    W0 = np.random.default_rng(2).standard_normal((4, 6))
    W, state, directions = _run(opt, target, W0, [np.zeros((4, 6))] * 3)
    assert all(np.array_equal(d, np.zeros((4, 6))) for d in directions)
    assert np.array_equal(W, _np(target.asarray(W0))) and np.array_equal(_np(state.M), np.zeros((4, 6)))
    # Tolerance: (gamma + (1 - gamma) mu) I rescaled to trace d rounds to I within a few
    # unit roundoffs per step (measured after 3 steps, 0 to 0.5 eps for P, 0 to 1.5 eps for Q on
    # the CPU targets: the trace normalisation rounds); 8 eps after 3 steps.
    eps = float(np.finfo(target.dtype).eps)
    assert np.abs(_np(state.P) - np.eye(4)).max() <= 8 * eps
    assert np.abs(_np(state.Q) - np.eye(6)).max() <= 8 * eps


# Float32 against NumPy float64 on degenerate input. Measured worst over the CPU kernel sets
# (docs/guarantees.md, `python docs/scripts/guarantees_measurements.py --only degenerate`): 0.8 to
# 1.2e-3 (rank-1 gradients: the zero singular values of a rank-1 M hold float32 rounding, ~2e-6 of
# the largest after the whitening products, and Muon's quintic multiplies small singular values
# by a = 3.4445 per step, 3.4445^5 = 490); 2e-5 for rank 2, 7e-5 for 2x500 and 500x2, 1e-5
# at 1e30. 5e-3 leaves 4.2x; a wrong formula is off by O(1). float64: the cross-backend bar
# 1e-10 (measured <= 1.4e-12, JAX on rank 1, 2026-12-04 with AVX-512 kernels).
DEGENERATE_TOLERANCE = {"float32": 5e-3, "float64": 1e-10}


def _degenerate_cases() -> dict:
    rng = np.random.default_rng(3)
    u, v = rng.standard_normal((4, 1)), rng.standard_normal((1, 6))
    cases = {
        "rank-1": [c * (u @ v) for c in (1.0, -0.5, 2.0)],
        "rank-2": [rng.standard_normal((4, 2)) @ rng.standard_normal((2, 6)) / 2 for _ in range(3)],
    }
    for shape in ((1, 1), (1, 7), (7, 1), (2, 500), (500, 2)):
        cases["x".join(map(str, shape))] = [rng.standard_normal(shape) for _ in range(3)]
    G0 = rng.standard_normal((6, 6))
    cases["1e-30"] = [1e-30 * G0, 1e-30 * rng.standard_normal((6, 6))]
    cases["1e+30"] = [1e30 * G0, 1e30 * rng.standard_normal((6, 6))]
    return cases


DEGENERATE = _degenerate_cases()


@pytest.mark.parametrize("case", list(DEGENERATE))
def test_degenerate_gradients_give_finite_sensible_steps(target: Target, case: str) -> None:
    """Rank-deficient, tiny, huge, 1x1, 1xn, mx1, 2x500 and 500x2 gradients: every step finite, the
    first a descent direction (<G, dW> > 0), P and Q symmetric positive definite, no fallback, and
    the same answer as NumPy float64 (which at 1e30 squares to 1e60 without overflow)."""
    grads = DEGENERATE[case]
    W0 = np.random.default_rng(4).standard_normal(grads[0].shape)
    with warnings.catch_warnings():
        warnings.simplefilter("error", InverseRootWarning)
        W, state, directions = _run(FISMO(), target, W0, grads)
    W_ref, state_ref, directions_ref = _run(FISMO(), targets()[0], W0, grads)  # NumPy float64
    assert all(np.all(np.isfinite(x)) for x in (W, *directions, *(_np(getattr(state, f)) for f in ARRAY_FIELDS)))
    assert np.sum(grads[0] * directions[0]) > 0
    for A in (_np(state.P), _np(state.Q)):
        assert np.array_equal(A, A.T) and np.linalg.eigvalsh(A).min() > 0
    tol = DEGENERATE_TOLERANCE[target.dtype]
    assert max_relative_error(W - W0, W_ref - W0) <= tol
    for d, d_ref in zip(directions, directions_ref):
        assert max_relative_error(d, d_ref) <= tol
    for f in ("P", "Q"):
        assert max_relative_error(getattr(state, f), getattr(state_ref, f)) <= tol, f
    if case == "1e-30":  # docs/guarantees.md: P and Q stay at I to rounding (the data term is 1e-60, far below
        # mu), and the step is small (Newton-Schulz's eps dominates the tiny norm: about 1e-22, not lr's 2e-2)
        eps = float(np.finfo(target.dtype).eps)
        for A in (_np(state.P), _np(state.Q)):
            assert np.abs(A - np.eye(A.shape[-1])).max() <= 10 * eps
        assert np.abs(W - W0.astype(target.dtype)).max() < 1e-15  # W0 as the target holds it


def test_huge_float64_gradients_whose_squares_overflow(target64: Target) -> None:
    """float64 entries ~4e180 square to ~1e361 (overflow); the statistics are formed from G / 2^k.
    At that scale P_{t-1} and mu are negligible against the data in the EMA (by ~1e-360 relative),
    so the exact result equals the one at 2^300 (no overflow), which it matches.
    Tolerance: measured 0 on NumPy and array-api-strict and <= 4e-14 on torch and JAX; the
    cross-backend bar 1e-10."""
    rng = np.random.default_rng(5)
    G0 = [rng.standard_normal((6, 6)) for _ in range(2)]
    W0 = rng.standard_normal((6, 6))
    W, state, directions = _run(FISMO(), target64, W0, [2.0**600 * g for g in G0])
    W_ref, state_ref, directions_ref = _run(FISMO(), targets()[0], W0, [2.0**300 * g for g in G0])
    assert max_relative_error(W - W0, W_ref - W0) <= 1e-10
    for f in ("P", "Q"):
        assert max_relative_error(getattr(state, f), getattr(state_ref, f)) <= 1e-10


def test_statistics_rescaling_is_bit_for_bit_neutral(target: Target, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where nothing overflows, the power-of-two rescaling changes no bit: gradients of size ~5
    (so that s > 1 on every step) give the same W, P, Q as with the rescaling switched off."""
    grads = [5.0 * g for g in reference_gradients((2, 4, 6), 4, seed=6)]
    W0 = np.random.default_rng(7).standard_normal((2, 4, 6))
    for opt in (FISMO(), FISMO(polar="svd", inv_root="newton_schulz")):
        W, state, _ = _run(opt, target, W0, grads)

        def no_scale(amax, floor=1.0):  # _pow2_of underlies every power-of-two scale
            return fl.array_namespace(amax).ones_like(amax)

        with monkeypatch.context() as patch:
            patch.setattr(fl, "_pow2_of", no_scale)
            W_unscaled, state_unscaled, _ = _run(opt, target, W0, grads)
        assert np.array_equal(W, W_unscaled)
        for f in ARRAY_FIELDS:
            assert _equal(getattr(state, f), getattr(state_unscaled, f)), f


@NO_NUMPY_NAN_WARNING
def test_without_rescaling_huge_float32_gradients_break(monkeypatch: pytest.MonkeyPatch) -> None:
    """Why the rescaling is there (and that the 1e30 test above can fail): without it, the Gram
    products of a float32 gradient of 1e30 overflow (1e60 > 3.4e38) and the step cannot be taken."""
    G = (1e30 * np.random.default_rng(8).standard_normal((6, 6))).astype(np.float32)
    opt = FISMO()
    W = np.zeros((6, 6), np.float32)
    monkeypatch.setattr(fl, "_pow2_of", lambda amax, floor=1.0: np.ones_like(amax))  # every power-of-two scale
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        with pytest.warns(InverseRootWarning):
            _, state = opt.step(W, G, opt.init(W))
    assert _ints(state.root_failures) == [1]  # P and Q fell back to the identity


def test_polar_of_huge_matrices(target: Target) -> None:
    """``linalg.polar``'s Frobenius normaliser is taken of X / 2^k: ||X||_F of 2^100 = 1.3e30
    (float32) or 2^660 = 1e199 (float64) entries would overflow to inf, and the polar factor
    collapse to 0. Newton–Schulz gives the bits of the unscaled matrix (the scaling is exact);
    the SVD is LAPACK's, which rescales by itself (measured: identical too). Tolerance for the
    SVD: 10 eps, in case a LAPACK build rescales by a factor that is not a power of two."""
    X = np.random.default_rng(9).standard_normal((4, 6))
    big = 2.0**100 if target.dtype == "float32" else 2.0**660
    got = _np(linalg.polar(target.asarray(big * X)))
    assert np.all(np.isfinite(got)) and np.array_equal(got, _np(linalg.polar(target.asarray(X))))
    got = _np(linalg.polar(target.asarray(big * X), method="svd"))
    ref = _np(linalg.polar(target.asarray(X), method="svd"))
    assert max_relative_error(got, ref) <= 10 * float(np.finfo(target.dtype).eps)


def test_polar_of_tiny_matrices_with_a_smaller_eps(target: Target) -> None:
    """With an ``eps`` as small as the matrix (what guarantees.md advises for gradients that tiny),
    the normaliser is taken of X scaled up by a power of two too: entries of 2^-100 (float32,
    squares below the smallest float) or 2^-600 (float64) gave all NaN (||X||_F underflowed to 0,
    X / eps overflowed in the quintic). Now X and eps scaled alike give the polar factor of X, bit
    for bit (the scaling is exact)."""
    X = np.random.default_rng(11).standard_normal((4, 6))
    tiny = 2.0**-100 if target.dtype == "float32" else 2.0**-600
    for options in ({}, {"coefficients": "polar_express", "steps": 8}):
        got = _np(linalg.polar(target.asarray(tiny * X), eps=1e-7 * tiny, **options))
        assert np.array_equal(got, _np(linalg.polar(target.asarray(X), **options)))


def test_matrices_in_the_dtypes_top_binade(target: Target) -> None:
    """Largest entries in the dtype's top binade (float64 from 2^1023, float32 from 2^127). Their power-of-two
    scale was 2^1023, whose reciprocal is subnormal: XLA, which divides by multiplying with the reciprocal and
    flushes subnormals to zero, made ``X / 2^1023`` zero, so that on JAX Newton–Schulz's ``polar`` was NaN, its
    ``inverse_sqrt`` refused the matrix as zero, and FISMO's step was zero (relative error 1 against the step
    at 2^-100 of the gradients). At the dtype's largest number ``log2`` rounds up to 1024 (float32 128) and the
    scale was infinite, on every backend: ``polar`` was not finite. The scale is capped at 2^1022 (float32
    2^126): now each gives what it gives for the matrix divided by 2^100 (every scaling exact), bit for bit
    for the functions and for FISMO (measured 0 on every CPU target: P and mu are negligible at both scales;
    asserted to the bar of the huge-gradient test above). On a GPU the functions agree to a few roundings, not
    bit for bit (torch CUDA and CuPy float64 on an H200, 2026-12-04: ``polar`` 8.9e-16, 4 eps, ``inverse_sqrt``
    1.9e-16 relative; float32 bit for bit): asserted within 16 eps, four times that."""
    finfo = np.finfo(target.dtype)
    rng = np.random.default_rng(13)
    bit_for_bit = target.device.lower().startswith("cpu")

    def largest_entry(X: np.ndarray, value: float) -> np.ndarray:
        return (X / np.abs(X).max() * value).astype(target.dtype)  # rounded first: / 2^100 is then exact

    def same(got: np.ndarray, want: np.ndarray) -> bool:
        if bit_for_bit:
            return np.array_equal(got, want)
        return float(np.max(np.abs(got - want)) / np.max(np.abs(want))) <= 16 * float(finfo.eps)

    X = largest_entry(rng.standard_normal((4, 6)), float(finfo.max))
    assert same(_np(linalg.polar(target.asarray(X))), _np(linalg.polar(target.asarray(X * 2.0**-100))))
    # Eigenvalues 1.25 and 0.75 of 1.5 * 2^1023 (float32 2^127): the largest is finite too.
    A = largest_entry(np.array([[1.0, 0.25], [0.25, 1.0]]), 1.5 * 2.0 ** (finfo.maxexp - 1))
    got = _np(linalg.inverse_sqrt(target.asarray(A), method="newton_schulz"))
    assert same(got, _np(linalg.inverse_sqrt(target.asarray(A * 2.0**-100), method="newton_schulz")) / 2.0**50)
    grads = [largest_entry(rng.standard_normal((5, 5)), float(finfo.max)) for _ in range(2)]  # P, Q nonsingular
    W0 = rng.standard_normal((5, 5))
    W, state, _ = _run(FISMO(), target, W0, grads)
    W_ref, state_ref, _ = _run(FISMO(), target, W0, [g * 2.0**-100 for g in grads])
    assert max_relative_error(W - W0, W_ref - W0) <= 1e-10
    for f in ("P", "Q"):
        assert max_relative_error(getattr(state, f), getattr(state_ref, f)) <= 1e-10, f


@pytest.mark.parametrize("k", [35, -42, 270, -330], ids=["4^35", "4^-42", "4^270", "4^-330"])
def test_newton_schulz_inverse_root_at_any_scale(target: Target, k: int) -> None:
    """``inverse_sqrt(method="newton_schulz")`` iterates on A / 4^j (4^j <= max|A|): its ||A||_F can
    neither overflow nor underflow, and (A 4^k)^{-1/2} is A^{-1/2} / 2^k bit for bit. Before, the
    input checks (on a scaled copy) passed and the iteration returned zeros (float32 at 1e21,
    float64 at 1e162) or NaN (float32 at 1e-25, float64 at 1e-199): a wrong answer under check=True."""
    if abs(k) > 60 and target.dtype == "float32":
        pytest.skip("4^±270 is outside float32's range")
    A = np.array([[2.0, 1.0, 0.0], [1.0, 3.0, 1.0], [0.0, 1.0, 4.0]])
    want = _np(linalg.inverse_sqrt(target.asarray(A), method="newton_schulz")) / 2.0**k
    got = _np(linalg.inverse_sqrt(target.asarray(A * 4.0**k), method="newton_schulz"))
    assert np.all(np.isfinite(got)) and np.array_equal(got, want)


@pytest.mark.parametrize("shape", [(0, 5), (3, 0), (0, 0), (2, 0, 3)])
def test_polar_of_an_empty_matrix_is_empty(shape: tuple) -> None:
    """A matrix with a side of 0 has an empty polar factor, by Newton–Schulz as by the SVD (which
    returned it already; Newton–Schulz failed in a reduction over nothing)."""
    X = np.zeros(shape)
    for method in ("newton_schulz", "svd"):
        got = linalg.polar(X, method=method)
        assert got.shape == shape and got.dtype == X.dtype


@pytest.mark.parametrize("eps", [0.0, -1.0, math.nan, math.inf, True, "1e-7"])
def test_polar_eps_must_be_a_finite_positive_number(eps: object) -> None:
    """``eps`` 0 made a zero matrix NaN, NaN made every output NaN, and a string failed in a ufunc."""
    with pytest.raises(ValueError, match="eps must be a finite number > 0"):
        linalg.polar(np.eye(3), eps=eps)


def test_iteration_arguments_are_validated_by_the_exact_methods_too() -> None:
    """``steps`` and ``coefficients`` are Newton–Schulz's, but a typo given with ``method="svd"`` or
    ``"eigh"`` (which ignore them) raises as it would with Newton–Schulz (docs/linalg.md, Errors)."""
    for call in (lambda: linalg.polar(np.eye(3), method="svd", steps=0),
                 lambda: linalg.polar(np.eye(3), method="svd", coefficients="nonsense"),
                 lambda: linalg.inverse_sqrt(np.eye(3), steps=0),
                 lambda: linalg.inverse_sqrt(np.eye(3), coefficients="muon")):
        with pytest.raises(ValueError):
            call()


@NO_NUMPY_NAN_WARNING
@pytest.mark.parametrize("shape", [(6, 9), (9, 6)], ids=["wide", "tall"])
def test_huge_non_square_gradients_fall_back(shape: tuple) -> None:
    """At 1e30 a non-square gradient makes one preconditioner numerically singular: on the m - n
    (or n - m) directions G leaves empty, its eigenvalues are ~1e-60 of the others, beyond what
    float32 or float64 resolve. That root fails, the previous one (here I) is kept with a
    warning, and the step is finite; NumPy float64 does exactly the same."""
    G = 1e30 * np.random.default_rng(10).standard_normal(shape)
    side = "Q" if shape[0] < shape[1] else "P"
    for dtype in (np.float32, np.float64):
        opt = FISMO()
        W = np.zeros(shape, dtype)
        with pytest.warns(InverseRootWarning, match=rf"inverse square root of {side}_t failed for 1 of 1"):
            W_new, state = opt.step(W, G.astype(dtype), opt.init(W))
        assert np.all(np.isfinite(W_new)) and _ints(state.root_failures) == [1]
        d = shape[1] if side == "Q" else shape[0]
        assert np.array_equal(getattr(state, side), np.eye(d, dtype=dtype))


def _power_of_two_below(x: float) -> float:
    """The largest ``2^e <= x`` with ``e`` even: its square root is a power of two too, so a root is exact."""
    e = math.floor(math.log2(x))
    return 2.0 ** (e - e % 2)


@NO_NUMPY_NAN_WARNING
def test_a_factor_singular_at_its_precision_fails_although_its_root_is_exact(target: Target) -> None:
    """The residual ||Z A Z - I|| cannot tell an eigenvalue from rounding: diag(1, lambda), powers of two,
    has an exact root (residual 0) at every lambda. With lambda <= u lambda_max (u = eps / 2, the unit
    roundoff of the factor's dtype) the stored factor does not even fix lambda's sign, so the root
    fails, also in the float64 retry of a float32 factor (a float64 root of float32 statistics resolves
    no more than they do): the matrix keeps its previous factor and root, with a warning. Four
    roundings above the cut the same factor passes."""
    from fismo_core import guards
    from fismo_core.kronecker import FullFactor
    from fismo_core.optimizer import _EIGH

    xp = target.xp
    u = float(np.finfo(target.dtype).eps) / 2
    structure, config = FullFactor(2), InverseRootConfig()
    previous = target.asarray(2.0 * np.eye(2)[None])
    for ratio, fails in ((_power_of_two_below(u / 2), True), (_power_of_two_below(16 * u), False)):
        A = target.asarray(np.diag([1.0, ratio])[None])
        Z = linalg.inverse_sqrt(A, check=False)
        assert np.array_equal(_np(Z @ A @ Z), np.eye(2)[None])  # the residual alone passes it
        _, failed = guards.checked_inverse_sqrt(xp, structure, config, "raise", A, 1)
        assert _np(failed).tolist() == [fails]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            A_t, root, failed = guards.guarded_inverse_sqrt(
                xp, structure, config, "raise", A, previous, previous, "P", 1, _EIGH)
        assert sum(isinstance(w.message, InverseRootWarning) for w in caught) == int(fails)
        assert np.array_equal(_np(A_t), _np(previous if fails else A))
        assert np.array_equal(_np(root), _np(previous if fails else Z))


@NO_NUMPY_NAN_WARNING
@pytest.mark.parametrize("scale", [1e20, 1e30])
def test_a_huge_gradient_whose_factor_rounding_makes_definite_falls_back(target: Target, scale: float) -> None:
    """A 6x5 gradient at 1e20 or 1e30: P_t's sixth eigenvalue is ~1e-40 or 1e-60 of the others in
    exact arithmetic, and rounding made it ~1e-8 or 1e-9 in float32, where eigh's root passed the
    residual check and the direction was 0.9 and 6.2 away from Algorithm 1 in 120 digits (torch,
    NumPy; docs/scripts/singular_root_check.py). The eigenvalue test fails that root on every
    backend: P keeps P_0 = I, with a warning."""
    X = np.random.default_rng(0).standard_normal((6, 5))
    G = np.asarray(X / np.abs(X).max() * scale, np.float32).astype(np.float64)
    opt = FISMO(polar="svd")
    state = opt.init(target.asarray(np.zeros((6, 5))))
    with pytest.warns(InverseRootWarning, match=r"inverse square root of P_t failed for 1 of 1"):
        direction, state = opt.direction(target.asarray(G), state)
    assert np.array_equal(_np(state.P), np.eye(6)) and _ints(state.root_failures) == [1]
    assert np.all(np.isfinite(_np(direction)))


@pytest.mark.parametrize("gamma", [0.0, 0.95, 1 - 1e-12])
def test_the_largest_damping_makes_the_factors_the_identity_without_overflow(target: Target, gamma: float) -> None:
    """``FISMO(mu=1e300)`` overflowed ``(1 - gamma) mu tr(P)`` in float32 statistics: every root failed,
    with NumPy's overflow warnings. ``mu`` above 1e30 is now refused (tests/test_errors.py); at 1e30 the
    step is finite and quiet on every backend, and the damping, ``(1 - gamma) mu / gamma`` times the EMA
    term (1e18 at the largest gamma here), makes ``P_t`` and ``Q_t`` the identity to float64's precision,
    as ``_MU_MAX`` says: off the diagonal below its unit roundoff 1.1e-16, on it 1 to a rounding or two
    of the dtype (``k c = 1 / (1 + 1e-18)`` and its product with ``I``)."""
    rng = np.random.default_rng(3)
    W, G = rng.standard_normal((40, 9)), rng.standard_normal((40, 9))
    opt = FISMO(mu=1e30, gamma=gamma)
    state = opt.init(target.asarray(W))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(2):
            direction, state = opt.direction(target.asarray(G), state)
    assert np.all(np.isfinite(_np(direction))) and _ints(state.root_failures) == [0]
    eps = float(np.finfo(target.dtype).eps)
    for factor in (_np(state.P), _np(state.Q)):
        off_diagonal = factor - np.diag(np.diag(factor))
        assert np.abs(off_diagonal).max() <= 2.0**-53 and np.abs(np.diag(factor) - 1).max() <= 2 * eps


def _views(module: str):
    """W and G as non-contiguous views (a strided slice, a transpose) and as contiguous copies."""
    rng = np.random.default_rng(11)
    W_big, G_big = rng.standard_normal((6, 18)), rng.standard_normal((9, 6))
    views = (W_big[:, ::2], G_big.T)  # (6, 9) each: every other column; a transpose
    if module == "torch":
        torch = pytest.importorskip("torch")
        W_t, G_t = torch.asarray(W_big), torch.asarray(G_big)
        views = (W_t[:, ::2], G_t.T)
        assert not views[0].is_contiguous() and not views[1].is_contiguous()
        return views, tuple(v.contiguous() for v in views)
    assert not views[0].flags.c_contiguous and not views[1].flags.c_contiguous
    return views, tuple(np.ascontiguousarray(v) for v in views)


@pytest.mark.parametrize("module", ["numpy", "torch"])
def test_non_contiguous_and_transposed_views(module: str) -> None:
    """Strided and transposed views give the same bits as contiguous copies, and are not written to."""
    (W_view, G_view), (W_copy, G_copy) = _views(module)
    before = (_np(W_view), _np(G_view))
    for opt in (FISMO(), FISMO(polar="svd", inv_root="newton_schulz")):
        W1, s1 = opt.step(W_view, G_view, opt.init(W_view))
        W2, s2 = opt.step(W_copy, G_copy, opt.init(W_copy))
        W1, s1 = opt.step(W1, G_view, s1)
        W2, s2 = opt.step(W2, G_copy, s2)
        assert _equal(W1, W2)
        for f in ARRAY_FIELDS:
            assert _equal(getattr(s1, f), getattr(s2, f)), f
    assert np.array_equal(_np(W_view), before[0]) and np.array_equal(_np(G_view), before[1])


# ============================================== 3. faults in the matrix functions
def _patch_eigh(monkeypatch: pytest.MonkeyPatch, xp, fault: str, when=None) -> list:
    """Replace ``xp.linalg.eigh`` (the namespace the core calls) by a faulty one.

    ``when(A)`` gives, per matrix of ``A`` (a boolean array of the batch shape), where the fault
    strikes (default: everywhere). ``fault="raise"`` raises a ``LinAlgError`` if it strikes
    anywhere in the call; ``"nan"`` returns NaN eigenvalues for the matrices it strikes. Returns
    the list of inputs it was called with (to see retries).
    """
    real = xp.linalg.eigh
    calls = []

    def eigh(A):
        calls.append(A)
        hit = xp.ones(A.shape[:-2], dtype=xp.bool, device=device(A)) if when is None else when(A)
        if not bool(xp.any(hit)):
            return real(A)
        if fault == "raise":
            raise np.linalg.LinAlgError("injected: eigenvalues did not converge")
        d = A.shape[-1]
        if bool(xp.all(hit)):  # no real eigh: A may hold NaN already, which eigh would refuse
            return xp.full(A.shape[:-1], math.nan, dtype=A.dtype, device=device(A)), xp.zeros_like(A) + xp.eye(d, dtype=A.dtype, device=device(A))
        w, V = real(A)
        return xp.where(hit[..., None], xp.full(w.shape, math.nan, dtype=w.dtype, device=device(w)), w), V

    monkeypatch.setattr(xp.linalg, "eigh", eigh)
    return calls


@pytest.mark.parametrize("fault", ["raise", "nan"])
def test_failed_float32_root_is_recomputed_in_float64(target: Target, fault: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A float32 eigh that raises or returns NaN is retried in float64, silently: the trajectory
    matches the fault-free one to float32 accuracy and nothing falls back.
    Tolerance: measured 1.4e-6 to 3.0e-6 across the CPU kernel sets (float64 roots rounded to float32
    against float32 eigh; docs/scripts/guarantees_measurements.py --only retry);
    the cross-backend bar 1e-4."""
    if target.dtype != "float32":
        pytest.skip("the float64 retry is for float32 states")
    xp = target.xp
    grads = reference_gradients((2, 4, 6), 3, seed=12)
    W0 = np.random.default_rng(13).standard_normal((2, 4, 6))
    W_ref, state_ref, _ = _run(FISMO(), target, W0, grads)
    float32 = lambda A: xp.full(A.shape[:-2], A.dtype == xp.float32, dtype=xp.bool, device=device(A))  # noqa: E731
    calls = _patch_eigh(monkeypatch, xp, fault, when=float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error", InverseRootWarning)
        W, state, _ = _run(FISMO(), target, W0, grads)
    assert any(A.dtype == xp.float64 for A in calls)  # the retry ran
    assert _ints(state.root_failures) == [0, 0] and state.P.dtype == xp.float32
    assert max_relative_error(W - W0, W_ref - W0) <= 1e-4
    for f in ("P", "Q"):
        assert max_relative_error(getattr(state, f), getattr(state_ref, f)) <= 1e-4


@NO_NUMPY_NAN_WARNING
@pytest.mark.parametrize("polar", ["newton_schulz", "svd"])
@pytest.mark.parametrize("fault", ["raise", "nan"])
def test_failed_root_falls_back_then_raises(
    target: Target, fault: str, polar: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """eigh failing in every precision: each step keeps P_{t-1}, Q_{t-1} and their roots (bitwise),
    warns and counts; the step is the one those preconditioners give (here from P = Q = I, the
    gamma = 1 step, bitwise); failure max_failures + 1 raises InverseRootError and changes
    nothing; the first good step resets the count. With ``polar="svd"`` the first pass's SVD of the
    NaN a failed root gives raised ``LinAlgError`` out of the step (NumPy, torch) before the fault
    flags were read."""
    xp = target.xp
    rng = np.random.default_rng(14)
    grads = [rng.standard_normal((4, 6)) for _ in range(4)]
    opt = FISMO(polar=polar, inv_root={"max_failures": 2})
    W = target.asarray(rng.standard_normal((4, 6)))
    state0 = state = opt.init(W)
    identity_step = FISMO(gamma=1.0, polar=polar)
    expected_W, _ = identity_step.step(W, target.asarray(grads[0]), identity_step.init(W))
    with monkeypatch.context() as patch:
        _patch_eigh(patch, xp, fault)
        for t in range(2):
            with pytest.warns(InverseRootWarning) as record:
                W, state = opt.step(W, target.asarray(grads[t]), state)
            messages = [str(w.message) for w in record]
            assert any("inverse square root of P_t failed for 1 of 1" in m for m in messages)
            assert any("inverse square root of Q_t failed for 1 of 1" in m for m in messages)
            assert _ints(state.root_failures) == [t + 1]
            for f in ("P", "Q", "P_inv_sqrt", "Q_inv_sqrt"):
                assert _equal(getattr(state, f), getattr(state0, f)), f
            if t == 0:
                assert _equal(W, expected_W)
        snapshot = {f: _np(getattr(state, f)) for f in ARRAY_FIELDS}
        with pytest.raises(InverseRootError, match=r"failed on more than max_failures = 2 consecutive steps"):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", InverseRootWarning)
                opt.step(W, target.asarray(grads[2]), state)
        assert all(np.array_equal(_np(getattr(state, f)), snapshot[f]) for f in ARRAY_FIELDS)
        assert _ints(state.root_failures) == [2] and state.step == 2
    W, state = opt.step(W, target.asarray(grads[3]), state)
    assert _ints(state.root_failures) == [0] and np.all(np.isfinite(_np(W)))


@NO_NUMPY_NAN_WARNING
@pytest.mark.parametrize("fault", ["raise", "nan"])
def test_only_the_failing_matrix_of_a_batch_falls_back(target: Target, fault: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """In a batch, a raising eigh is retried matrix by matrix, so only the matrix that fails keeps
    its old preconditioners; the others match the fault-free run.
    The fault hits diagonal matrices: matrix 1 has G = 0, so its P_t and Q_t are diagonal.
    Tolerance: the others go through a per-matrix eigh instead of a batched one (measured
    identical on NumPy, <= 2e-7 float32 / 4e-16 float64 on torch and JAX); 10 eps."""
    xp = target.xp
    rng = np.random.default_rng(15)
    G = np.stack([rng.standard_normal((4, 6)), np.zeros((4, 6))])
    W0 = rng.standard_normal((2, 4, 6))
    ref_state = FISMO().direction(target.asarray(G), FISMO().init(target.asarray(W0)))[1]

    def diagonal(A):
        off = A * (1 - xp.eye(A.shape[-1], dtype=A.dtype, device=device(A)))
        return xp.all(off == 0, axis=(-2, -1))

    _patch_eigh(monkeypatch, xp, fault, when=diagonal)
    opt = FISMO()
    state0 = opt.init(target.asarray(W0))
    with pytest.warns(InverseRootWarning, match=r"failed for 1 of 2 matrices"):
        _, state = opt.direction(target.asarray(G), state0)
    assert _ints(state.root_failures) == [0, 1]
    tol = 10 * float(np.finfo(target.dtype).eps)
    for f in ("P", "Q", "P_inv_sqrt", "Q_inv_sqrt"):
        assert max_relative_error(_np(getattr(state, f))[0], _np(getattr(ref_state, f))[0]) <= tol, f
        assert np.array_equal(_np(getattr(state, f))[1], _np(getattr(state0, f))[1]), f


def test_newton_schulz_that_does_not_converge_is_caught(target: Target) -> None:
    """Three Newton–Schulz steps do not converge on these preconditioners (residual ||Z P Z - I||_F
    0.99 with Polar Express, 0.80 with the cubic, measured): the check sees it and recomputes with eigh in float64, so the step equals
    the exact-method step. Tolerance: float64 measured 0 (the same eigh of the same P_t);
    float32 <= 1.3e-6 (float64 roots rounded to float32 against float32 eigh); 1e-4."""
    grads = [3 * g for g in reference_gradients((4, 6), 2, seed=16)]
    W0 = np.random.default_rng(17).standard_normal((4, 6))
    few = {"method": "newton_schulz", "steps": 3}
    with warnings.catch_warnings():
        warnings.simplefilter("error", InverseRootWarning)
        W, state, _ = _run(FISMO(inv_root=few), target, W0, grads)
    W_eigh, state_eigh, _ = _run(FISMO(), target, W0, grads)
    tol = 1e-4 if target.dtype == "float32" else 1e-12
    assert max_relative_error(W - W0, W_eigh - W0) <= tol
    assert max_relative_error(state.P_inv_sqrt, state_eigh.P_inv_sqrt) <= tol
    # The check had something to catch: the unchecked 3-step root is far off.
    P = state_eigh.P
    xp = target.xp
    Z = linalg.inverse_sqrt(P, method="newton_schulz", steps=3)
    residual = float(xp.linalg.matrix_norm(Z @ P @ Z - xp.eye(4, dtype=P.dtype, device=device(P))))
    assert residual > InverseRootConfig().tolerance
    W_unchecked, _, _ = _run(FISMO(inv_root={**few, "fallback": False}), target, W0, grads)
    assert max_relative_error(W_unchecked - W0, W_eigh - W0) > 1e-3


@NO_NUMPY_NAN_WARNING
def test_max_failures_zero_raises_at_once_and_fallback_off_does_not_check(monkeypatch: pytest.MonkeyPatch) -> None:
    """``max_failures=0`` raises at the first root that cannot be repaired; ``fallback=False`` (and
    ``nonfinite="propagate"``, which turns the checks off by default) lets the fault through."""
    import array_api_compat.numpy as xp

    _patch_eigh(monkeypatch, xp, "nan")
    W, G = np.zeros((3, 4)), np.ones((3, 4))
    strict = FISMO(inv_root={"max_failures": 0})
    with pytest.raises(InverseRootError) as info, warnings.catch_warnings():
        warnings.simplefilter("ignore", InverseRootWarning)
        strict.step(W, G, strict.init(W))
    assert info.value.indices == (0,)
    for opt in (FISMO(inv_root={"fallback": False}), FISMO(nonfinite="propagate")):
        W_new, state = opt.step(W, G, opt.init(W))
        assert np.isnan(W_new).all() and _ints(state.root_failures) == [0]
    checked = FISMO(nonfinite="propagate", inv_root={"fallback": True})
    with pytest.warns(InverseRootWarning):
        W_new, _ = checked.step(W, G, checked.init(W))
    assert np.all(np.isfinite(W_new))


def test_torch_inverse_root_error_names_the_parameter_and_changes_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the torch adapter: the error names the failing parameter, and the other bucket,
    whose core call had succeeded, is not written either (no parameter or state changes)."""
    torch = pytest.importorskip("torch")
    import array_api_compat.torch as xp

    model = _torch_model(torch)
    opt = _torch_opt(torch, model, inv_root={"max_failures": 0})
    _fill_grads(torch, model, 1)
    opt.step()
    before = _torch_snapshot(torch, model, opt)
    only_6x6 = lambda A: xp.full(A.shape[:-2], A.shape[-1] == 6, dtype=xp.bool, device=device(A))  # noqa: E731
    _patch_eigh(monkeypatch, xp, "nan", when=only_6x6)  # only 3.weight (6x3) has a 6x6 factor, its P
    _fill_grads(torch, model, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", InverseRootWarning)
        with pytest.raises(InverseRootError, match=r"The failing parameters: parameter '3\.weight'"):
            opt.step()
    after = _torch_snapshot(torch, model, opt)
    for key in before:
        assert torch.equal(before[key], after[key]), key


# ====================================================================== 4. long runs
def test_ten_thousand_float32_steps_stay_sane() -> None:
    """10,000 steps, NumPy float32, default FISMO, an 8x12 noisy quadratic ``G = c (W - W*) + c N``
    at a realistic scale (c = 1e-3: P and Q stay near I) and a large one (c = 3: condition
    numbers of P and Q reach ~20). Checked every 10 steps: P and Q exactly symmetric, positive
    definite (Cholesky in float32), traces m and n; everything finite at every step; no
    inverse root ever falls back.

    Trace tolerance: trace normalisation rescales by d / tr(P~) and rounds each diagonal entry
    once (relative u = 6e-8), after tr itself was summed with d - 1 roundings; so
    |tr P - d| / d <= d u roughly. Measured 2.2e-7 to 2.8e-7 across the CPU kernel sets; the bar d eps = 12 * 1.2e-7 = 1.4e-6.
    Symmetry is exact: sym() computes (X + X^T) / 2, and IEEE addition commutes.
    Time: ~3 s per scale on this project's machine (not asserted: a timing depends on the machine and its load)."""
    m, n = 8, 12
    for c in (1e-3, 3.0):
        rng = np.random.default_rng(18)
        W_star = rng.standard_normal((m, n)).astype(np.float32)
        opt = FISMO()
        W = np.zeros((m, n), np.float32)
        state = opt.init(W)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # an InverseRootWarning or a numpy RuntimeWarning fails the test
            for t in range(10_000):
                G = (c * ((W - W_star) + rng.standard_normal((m, n)))).astype(np.float32)
                W, state = opt.step(W, G, state)
                assert np.isfinite(W).all() and np.isfinite(state.M).all(), t
                if t % 10 == 9 or t == 0:
                    for A, d in ((state.P, m), (state.Q, n)):
                        assert A.dtype == np.float32 and np.isfinite(A).all()
                        assert np.array_equal(A, A.T), t
                        np.linalg.cholesky(A)  # raises unless positive definite (in float32)
                        assert abs(float(np.trace(A, dtype=np.float64)) - d) / d <= d * np.finfo(np.float32).eps, t
                    for A in (state.P_inv_sqrt, state.Q_inv_sqrt):
                        assert np.isfinite(A).all()
        assert _ints(state.root_failures) == [0] and _ints(state.skipped) == [0]
        # It did optimise: W is near W* (within the noise floor; measured 0.14 and 0.17).
        assert np.linalg.norm(W - W_star) / np.linalg.norm(W_star) < 0.3


@NO_NUMPY_NAN_WARNING
def test_beyond_the_stable_range_the_run_stops_with_a_clear_error() -> None:
    """Algorithm 1 is not scale invariant: on a wide 8x12 matrix with noise gradients of size
    sigma = 100 (sigma^2 / mu = 1e7), the Gauss–Seidel updates drive the condition numbers of
    P and Q past 1e16 within ~10 steps (also in exact arithmetic: Q's damping floor is
    mu / sigma^2 of its trace). The run does not produce NaN: the failing roots fall back with
    warnings, and after max_failures consecutive failures InverseRootError says what happened."""
    rng = np.random.default_rng(19)
    opt = FISMO()
    W = np.zeros((8, 12))
    state = opt.init(W)
    with pytest.raises(InverseRootError, match=r"statistics='scale_invariant'"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", InverseRootWarning)
            for t in range(200):
                W, state = opt.step(W, 100 * rng.standard_normal((8, 12)), state)
                assert np.isfinite(W).all() and np.isfinite(state.P).all() and np.isfinite(state.Q).all()
    assert t < 100
    # The scale-invariant variant is stable at the same scale.
    invariant = FISMO(statistics="scale_invariant")
    W = np.zeros((8, 12))
    state = invariant.init(W)
    with warnings.catch_warnings():
        warnings.simplefilter("error", InverseRootWarning)
        for _ in range(200):
            W, state = invariant.step(W, 100 * rng.standard_normal((8, 12)), state)
    assert np.isfinite(W).all()


# ============================================= 5. properties and determinism
hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

#: Matrix sides drawn by the property tests: 1, tiny, the sizes used elsewhere, and 8. A few
#: sizes only, because JAX compiles every operation once per shape (seconds per test otherwise).
SIDES = (1, 2, 4, 6, 8)
PROPERTY_SETTINGS = settings(
    max_examples=15, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


def _spd(d: int, log10_cond: float, seed: int) -> np.ndarray:
    """A random SPD matrix: random orthogonal eigenvectors, eigenvalues log-spaced over the condition number."""
    rng = np.random.default_rng(seed)
    V, _ = np.linalg.qr(rng.standard_normal((d, d)))
    w = np.geomspace(1.0, 10.0**-log10_cond, d) if d > 1 else np.ones(1)
    A = (V * rng.permutation(w)) @ V.T
    return (A + A.T) / 2


@PROPERTY_SETTINGS
@given(d=st.sampled_from(SIDES), log10_cond=st.floats(0, 8), seed=st.integers(0, 2**32 - 1))
def test_inverse_sqrt_property(target64: Target, d: int, log10_cond: float, seed: int) -> None:
    """eigh: ``Z = A^{-1/2}`` is symmetric and whitens A: ||Z A Z - I||_F <= 4 d eps kappa.
    Newton–Schulz (Polar Express; its default 9 steps where ``kappa' = ||A||_F / lambda_min
    <= 1e6``, the documented range of the default, and 12 steps up to 1e8, the count of the
    docstring's table): the same with 4 d eps kappa + 1e-6.
    Bounds: a root from an eigendecomposition with backward error ~eps ||A|| whitens to
    ~d eps kappa; measured worst 0.5 d eps kappa (eigh) over these examples; Newton–Schulz
    converges to double precision at those counts in exact arithmetic, so only rounding is left."""
    A_np = _spd(d, log10_cond, seed)
    A = target64.asarray(A_np)
    xp = target64.xp
    kappa = float(np.linalg.cond(A_np))
    eps = float(np.finfo(np.float64).eps)
    eye = xp.eye(d, dtype=xp.float64, device=device(A))
    Z = linalg.inverse_sqrt(A)
    assert np.allclose(_np(Z), _np(Z).T, rtol=0, atol=4 * d * eps * math.sqrt(kappa))
    assert float(xp.linalg.matrix_norm(Z @ A @ Z - eye)) <= 4 * d * eps * kappa
    kappa_prime = float(np.linalg.norm(A_np)) / float(np.linalg.eigvalsh(A_np)[0])
    if kappa_prime <= 1e8:
        Z_ns = linalg.inverse_sqrt(A, method="newton_schulz", steps=None if kappa_prime <= 1e6 else 12)
        assert float(xp.linalg.matrix_norm(Z_ns @ A @ Z_ns - eye)) <= 4 * d * eps * kappa + 1e-6


@PROPERTY_SETTINGS
@given(m=st.sampled_from(SIDES), n=st.sampled_from(SIDES), log10_cond=st.floats(0, 8), log10_scale=st.floats(-30, 30),
       seed=st.integers(0, 2**32 - 1))
def test_polar_property(target64: Target, m: int, n: int, log10_cond: float, log10_scale: float, seed: int) -> None:
    """SVD polar factor of random rectangular matrices of any scale (1e-30 to 1e30) and condition
    number up to 1e8: orthonormal (``U^T U = I`` on the short side) to 40 eps, and
    ``Polar(X)^T X`` symmetric (to 100 eps) positive semi-definite (to 20 eps; it is ``V S V^T``).
    Bounds: the SVD is backward stable, ``U S V^T = X + E`` with ``||E|| ~ p(m, n) eps ||X||``, so
    the polar factor of ``X + E`` leaves ``Polar^T X`` asymmetric by ``~2 ||E||``. Measured over
    1,500 random cases of these sides (numpy, torch, JAX; every OpenBLAS kernel this AMD CPU runs)
    and 3,000 of sides up to 16 (numpy):
    orthonormality <= 13.5 eps, asymmetry <= 42 eps, smallest eigenvalue >= -2.1 eps."""
    rng = np.random.default_rng(seed)
    k = min(m, n)
    U, _ = np.linalg.qr(rng.standard_normal((m, k)))
    V, _ = np.linalg.qr(rng.standard_normal((n, k)))
    s = np.geomspace(1.0, 10.0**-log10_cond, k) if k > 1 else np.ones(1)
    X_np = 10.0**log10_scale * (U * s) @ V.T
    O = linalg.polar(target64.asarray(X_np), method="svd")
    O_np = _np(O)
    eps = float(np.finfo(np.float64).eps)
    gram = O_np.T @ O_np if m >= n else O_np @ O_np.T
    assert np.abs(gram - np.eye(k)).max() <= 40 * eps
    H = O_np.T @ (X_np / 10.0**log10_scale)
    assert np.abs(H - H.T).max() <= 100 * eps * max(1.0, np.abs(H).max())
    assert np.linalg.eigvalsh((H + H.T) / 2).min() >= -20 * eps
    assert np.all(np.isfinite(_np(linalg.polar(target64.asarray(X_np)))))


@PROPERTY_SETTINGS
@given(d=st.sampled_from(SIDES), log10_cond=st.floats(0, 8), log10_scale=st.floats(-100, 100), seed=st.integers(0, 2**32 - 1))
def test_sym_and_trace_normalize_property(target64: Target, d: int, log10_cond: float, log10_scale: float, seed: int) -> None:
    """``sym`` is exactly symmetric; ``trace_normalize`` gives trace d to d eps whatever the scale."""
    A_np = 10.0**log10_scale * _spd(d, log10_cond, seed)
    A_np = A_np + np.triu(A_np, 1) * 1e-3  # not symmetric
    A = target64.asarray(A_np)
    S = _np(linalg.sym(A))
    assert np.array_equal(S, S.T)
    T = _np(linalg.trace_normalize(linalg.sym(A)))
    assert abs(np.trace(T) - d) <= d * d * float(np.finfo(np.float64).eps)


def test_same_seed_same_bits(target: Target) -> None:
    """Determinism: the same seeded run twice gives identical bits on every backend (CPU)."""
    grads = reference_gradients((2, 4, 6), 6, seed=20)
    W0 = np.random.default_rng(21).standard_normal((2, 4, 6))
    for opt in (FISMO(), FISMO(polar="svd", inv_root="newton_schulz", nesterov=True, weight_decay=0.1)):
        first = _run(opt, target, W0, grads)
        second = _run(opt, target, W0, grads)
        assert np.array_equal(first[0], second[0])
        for f in ARRAY_FIELDS:
            assert _equal(getattr(first[1], f), getattr(second[1], f)), f
        assert all(np.array_equal(a, b) for a, b in zip(first[2], second[2]))


# ============================================================ 6. configuration
@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        ({"fallback": "yes"}, TypeError, r"fallback must be None, True or False, got 'yes'"),
        ({"fallback": 1}, TypeError, r"fallback must be None, True or False"),
        ({"max_failures": -1}, ValueError, r"max_failures must be an integer >= 0, got -1"),
        ({"max_failures": 2.0}, ValueError, r"max_failures must be an integer >= 0"),
        ({"max_failures": True}, ValueError, r"max_failures must be an integer >= 0"),
        ({"tolerance": 0.0}, ValueError, r"tolerance must lie in \(0\.0, 1\.0\), got 0\.0"),
        ({"tolerance": 1.0}, ValueError, r"tolerance must lie in \(0\.0, 1\.0\), got 1\.0"),
        ({"tolerance": math.nan}, ValueError, r"tolerance must be a finite real number"),
    ],
)
def test_fault_handling_options_are_validated(kwargs: dict, exc: type, match: str) -> None:
    with pytest.raises(exc, match=match):
        InverseRootConfig(**kwargs)
    with pytest.raises(exc, match=match):
        FISMO(inv_root=kwargs)


def test_nonfinite_option_is_validated() -> None:
    with pytest.raises(ValueError, match=r"nonfinite must be 'raise', 'skip' or 'propagate', got 'ignore'"):
        FISMO(nonfinite="ignore")
    torch = pytest.importorskip("torch")
    from fismo_core.backends.torch import FISMO as TorchFISMO

    with pytest.raises(ValueError, match=r"nonfinite must be 'raise', 'skip' or 'propagate'"):
        TorchFISMO([torch.nn.Parameter(torch.zeros(2, 3))], nonfinite="zero")


def test_state_of_another_dtype_is_rejected() -> None:
    """A gap in tests/test_errors.py: a state built for float64 parameters, used with float32 ones
    (or the reverse), is refused before anything changes."""
    opt = FISMO()
    W64 = np.zeros((3, 4))
    state64 = opt.step(W64, np.ones((3, 4)), opt.init(W64))[1]
    snapshot = {f: np.array(getattr(state64, f), copy=True) for f in ARRAY_FIELDS}
    with pytest.raises(TypeError, match=r"state dtype float64 does not match W of dtype float32"):
        opt.step(W64.astype(np.float32), np.ones((3, 4), np.float32), state64)
    assert all(np.array_equal(getattr(state64, f), snapshot[f]) for f in ARRAY_FIELDS)
    W32 = np.zeros((3, 4), np.float32)
    with pytest.raises(TypeError, match=r"state dtype float32 does not match W of dtype float64"):
        opt.step(W64, np.ones((3, 4)), opt.init(W32))


@pytest.mark.skipif(np.finfo(np.longdouble).bits <= 64, reason="NumPy's long double is float64 on this platform")
def test_long_double_parameters_keep_float64_statistics() -> None:
    """``init``'s docstring promised ``W``'s dtype for float32 or wider, but NumPy's long double got
    float32 statistics; they are float64 (no eigensolver takes long double), and the direction is the
    float64 one."""
    rng = np.random.default_rng(0)
    W, G = rng.standard_normal((4, 3)), rng.standard_normal((4, 3))
    opt = FISMO()
    state = opt.init(W.astype(np.longdouble))
    assert state.M.dtype == np.float64
    W_ld, state_ld = opt.step(W.astype(np.longdouble), G.astype(np.longdouble), state)
    W_64, state_64 = opt.step(W, G, opt.init(W))
    assert W_ld.dtype == np.longdouble and np.array_equal(state_ld.M, state_64.M)
    # line 9 in long double, of the same float64 direction: within float64's rounding of W_64
    assert np.allclose(np.asarray(W_ld, dtype=np.float64), W_64, rtol=0, atol=4 * np.finfo(np.float64).eps)


def test_hand_built_states_still_work() -> None:
    """``FISMOState`` built from the first six fields (counters default to 0) steps and skips."""
    opt = FISMO(nonfinite="skip")
    init = opt.init(np.zeros((3, 4)))
    state = FISMOState(*(getattr(init, f) for f in ARRAY_FIELDS), step=0)
    G = np.ones((3, 4))
    G[0, 0] = math.nan
    W, state = opt.step(np.zeros((3, 4)), G, state)
    assert _ints(state.skipped) == [1] and np.array_equal(W, np.zeros((3, 4)))
    with pytest.raises(ValueError, match=r"state\.skipped must have the batch shape \(\) of G"):
        opt.step(np.zeros((3, 4)), np.ones((3, 4)), state._replace(skipped=np.zeros(2, np.int32)))
