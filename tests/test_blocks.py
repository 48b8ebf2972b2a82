"""Block-diagonal Kronecker factors, ``FISMO(block_size=B)`` (issue 13).

The reference here is written from the definition in the issue, on dense
NumPy float64 matrices: the data terms of lines 4 and 5 are masked to their
diagonal blocks, everything else is Algorithm 1 as printed (one trace over
the whole factor, the polar factor of the whole ``M``). The core never forms
those dense matrices; these tests check that it computes the same numbers,
on every backend, with every option, and keeps only what the issue allows.
"""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

from fismo_core import FISMO, FISMOState, InverseRootWarning
from fismo_core import linalg as fl
from fismo_core.kronecker import BlockDiagonalFactor, Blocks, FullFactor, factor_structure, state_size, to_dense
from fismo_core.testing import Target, reference_gradients, targets, to_numpy

# Shapes with a remainder on both sides, an exact division, a batch, and one side that is a single block.
CASES = [((10, 7), 3), ((8, 12), 4), ((2, 9, 5), 4), ((3, 11), 4)]


def block_sizes(d: int, B: int) -> list[int]:
    """The issue's convention: blocks of ``B``, the last one the remainder; a side ``<= B`` is one block."""
    return [d] if d <= B else [B] * (d // B) + ([d % B] if d % B else [])


def block_mask(d: int, B: int) -> np.ndarray:
    mask, start = np.zeros((d, d)), 0
    for size in block_sizes(d, B):
        mask[start : start + size, start : start + size] = 1
        start += size
    return mask


def inv_sqrt(A: np.ndarray) -> np.ndarray:
    w, V = np.linalg.eigh(A)
    return (V / np.sqrt(w)[..., None, :]) @ np.swapaxes(V, -1, -2)


def polar_svd(X: np.ndarray) -> np.ndarray:
    U, _, Vh = np.linalg.svd(X, full_matrices=False)
    return U @ Vh


def sym(X: np.ndarray) -> np.ndarray:
    return (X + np.swapaxes(X, -1, -2)) / 2


def dense_reference(W, grads, B, *, lr=0.02, beta=0.95, gamma=0.9, mu=1e-3, nesterov=False,
                    statistics="printed", polar=polar_svd, every=1):
    """Blocked FISMO on dense float64 matrices: lines 4-5 mask their data terms to the diagonal blocks."""
    *batch, m, n = W.shape
    mask_m, mask_n = block_mask(m, B), block_mask(n, B)
    P = np.broadcast_to(np.eye(m), (*batch, m, m)).copy()
    Q = np.broadcast_to(np.eye(n), (*batch, n, n)).copy()
    M = np.zeros_like(W)
    P_is, Q_is = P.copy(), Q.copy()
    T = lambda X: np.swapaxes(X, -1, -2)  # noqa: E731
    tr = lambda A: np.trace(A, axis1=-2, axis2=-1)[..., None, None]  # noqa: E731
    for t, G in enumerate(grads):
        G_stat = G
        if statistics == "scale_invariant":
            G_stat = G / np.sqrt(np.mean(G**2, axis=(-2, -1), keepdims=True))
        refresh = t % every == 0
        # Line 4 with the block mask on the data term; Q_{t-1}^{-1} as the square of the cached root.
        L = mask_m * (G_stat @ Q_is @ Q_is @ T(G_stat)) / n + mu * tr(P) / m * np.eye(m)
        P_tilde = gamma * P + (1 - gamma) * L
        P = sym(m / tr(P_tilde) * P_tilde)
        if refresh:
            P_is = inv_sqrt(P)
        R = mask_n * (T(G_stat) @ P_is @ P_is @ G_stat) / m + mu * tr(Q) / n * np.eye(n)
        Q_tilde = gamma * Q + (1 - gamma) * R
        Q = sym(n / tr(Q_tilde) * Q_tilde)
        if refresh:
            Q_is = inv_sqrt(Q)
        G_white = P_is @ G @ Q_is
        M = beta * M + (1 - beta) * G_white
        momentum = beta * M + (1 - beta) * G_white if nesterov else M
        W = W - lr * (P_is @ polar(momentum) @ Q_is)
    return W, P, Q, M


def run(opt: FISMO, target: Target, W0: np.ndarray, grads: list) -> tuple:
    W = target.asarray(W0)
    state = opt.init(W)
    for G in grads:
        W, state = opt.step(W, target.asarray(G), state)
    return W, state


def rel(got, ref) -> float:
    got = to_numpy(got)
    return float(np.max(np.linalg.norm(got - ref, axis=(-2, -1)) / np.linalg.norm(ref, axis=(-2, -1))))


# ------------------------------------------------------------------- the definition
@pytest.mark.parametrize("shape,B", CASES, ids=[f"{s}-B{b}" for s, b in CASES])
def test_blocked_step_matches_the_dense_definition(target: Target, shape, B) -> None:
    """On every backend, five blocked steps equal the dense masked reference (W, P, Q, M)."""
    grads = reference_gradients(shape, 5, seed=len(shape) + B)
    W0 = np.full(shape, 0.1)
    W_ref, P_ref, Q_ref, M_ref = dense_reference(W0, grads, B)
    W, state = run(FISMO(block_size=B, gamma=0.9, polar="svd"), target, W0, grads)
    # Per-dtype tolerance of the verification (fismo_core.testing.TOLERANCES): float64 rounding
    # amplified by five eighs and SVDs stays far below 1e-10; float32 below 1e-4.
    tol = target.tolerance
    assert rel(W, W_ref) < tol
    assert rel(state.M, M_ref) < tol
    assert rel(to_dense(state.P), P_ref) < tol
    assert rel(to_dense(state.Q), Q_ref) < tol


def test_blocked_factors_keep_trace_over_all_blocks() -> None:
    """``tr P_t = m`` summed over all blocks (not per block), and every block is symmetric."""
    W0 = np.zeros((10, 7))
    _, state = run(FISMO(block_size=3), _NUMPY64, W0, reference_gradients((10, 7), 4, seed=1))
    P = to_dense(state.P)
    assert abs(np.trace(P) - 10) < 1e-12
    block_traces = [np.trace(P[i : i + 3, i : i + 3]) for i in (0, 3, 6)]
    assert max(abs(t - 3) for t in block_traces) > 1e-3  # the blocks are not normalised one by one
    assert np.array_equal(state.P.full, np.swapaxes(state.P.full, -1, -2))
    assert np.array_equal(state.P.rest, state.P.rest.T)


class _Numpy64:
    tolerance = 1e-10

    @staticmethod
    def asarray(a):
        return np.asarray(a, dtype=np.float64)


_NUMPY64 = _Numpy64()


@pytest.mark.parametrize(
    "config",
    [
        {"nesterov": True},
        {"statistics": "scale_invariant"},
        {"polar": "newton_schulz"},
        {"inv_root": {"every": 3}},
    ],
    ids=["nesterov", "scale_invariant", "newton_schulz_polar", "every3"],
)
def test_blocked_options_match_the_dense_definition(config: dict) -> None:
    """Blocks with Nesterov, scale-invariant statistics, the Newton–Schulz polar and amortised roots."""
    shape, B = (9, 14), 4
    grads = reference_gradients(shape, 7, seed=5)  # unit scale: P and Q move far from I (3e-2 barely moved them)
    W0 = np.full(shape, 0.1)
    kwargs = {
        "nesterov": config.get("nesterov", False),
        "statistics": config.get("statistics", "printed"),
        "every": config.get("inv_root", {}).get("every", 1),
    }
    if config.get("polar") == "newton_schulz":
        kwargs["polar"] = fl.polar  # the whole M's polar factor, by the same iteration
    W_ref, _, _, _ = dense_reference(W0, grads, B, **kwargs)
    W, _ = run(FISMO(block_size=B, gamma=0.9, polar=config.get("polar", "svd"), **{
        k: v for k, v in config.items() if k != "polar"}), _NUMPY64, W0, grads)
    assert rel(W, W_ref) < 1e-10


def test_newton_schulz_roots_on_blocks_agree_with_eigh() -> None:
    """The matmul-only roots, batched over blocks, agree with eigh to their documented accuracy."""
    shape, B = (12, 20), 5
    grads = reference_gradients(shape, 6, seed=2)
    W0 = np.full(shape, 0.1)
    W_eigh, _ = run(FISMO(block_size=B), _NUMPY64, W0, grads)
    W_ns, s = run(FISMO(block_size=B, inv_root="newton_schulz"), _NUMPY64, W0, grads)
    # Polar Express, 9 steps, converges to float64 rounding for kappa' <= 1e6 (docs/linalg.md).
    assert rel(W_ns, to_numpy(W_eigh)) < 1e-8
    assert isinstance(s.P_inv_sqrt, Blocks)


# ------------------------------------------------------------- B >= max(m, n) is the printed algorithm
CONFIGS = [{}, {"nesterov": True, "weight_decay": 0.1}, {"statistics": "scale_invariant"},
           {"inv_root": {"every": 2}}, {"nonfinite": "skip"}, {"gamma": 1.0}]


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "-".join(map(str, c)) or "default")
def test_one_block_is_the_printed_algorithm_bit_for_bit(target: Target, config: dict) -> None:
    for shape in ((6, 9), (2, 7, 4)):
        grads = reference_gradients(shape, 4, seed=7)
        W0 = np.full(shape, 0.1)
        W_full, s_full = run(FISMO(**config), target, W0, grads)
        for B in (max(shape[-2:]), 64):
            W_blk, s_blk = run(FISMO(block_size=B, **config), target, W0, grads)
            assert np.array_equal(to_numpy(W_blk), to_numpy(W_full))
            for name in ("P", "Q", "M", "P_inv_sqrt", "Q_inv_sqrt"):
                assert not isinstance(getattr(s_blk, name), Blocks)
                assert np.array_equal(to_numpy(getattr(s_blk, name)), to_numpy(getattr(s_full, name)))


# ------------------------------------------------------------------- structure and state size
def test_structure_follows_the_convention() -> None:
    assert isinstance(factor_structure(8, None), FullFactor)
    assert isinstance(factor_structure(8, 8), FullFactor)
    s = factor_structure(5504, 1024)
    assert isinstance(s, BlockDiagonalFactor) and s.part_shapes() == ((5, 1024, 1024), (384, 384))
    assert factor_structure(3072, 768).part_shapes() == ((4, 768, 768),)


@pytest.mark.parametrize("m,n,B", [(768, 2304, 768), (2048, 5504, 1024), (10, 7, 3), (3, 11, 4), (64, 32, None)])
def test_state_holds_what_the_issue_allows(m: int, n: int, B) -> None:
    """Count every element the state keeps: mn + 2(m+n)B at most with blocks, 2(m^2+n^2) + mn without."""
    opt = FISMO(block_size=B)
    state = opt.init(np.zeros((m, n), dtype=np.float32))
    arrays = [a for name in ("P", "Q", "M", "P_inv_sqrt", "Q_inv_sqrt")
              for a in (getattr(state, name) if isinstance(getattr(state, name), Blocks) else (getattr(state, name),))
              if a is not None]
    kept = sum(a.size for a in arrays)
    assert kept == state_size(m, n, B)
    if B is None:
        assert kept == 2 * (m * m + n * n) + m * n
    else:
        assert kept <= m * n + 2 * (m + n) * B
    assert max(a.shape[-1] for a in arrays if a.shape != (m, n)) <= (B or max(m, n))


def test_a_blocked_step_never_forms_a_full_factor() -> None:
    """Peak memory of a step with m = 3000, B = 16: a dense 3000 x 3000 float64 matrix alone is 72 MB."""
    m, n, B = 3000, 16, 16
    opt = FISMO(block_size=B)
    rng = np.random.default_rng(0)
    W, G = rng.standard_normal((m, n)), rng.standard_normal((m, n))
    state = opt.init(W)
    W, state = opt.step(W, G, state)
    tracemalloc.start()
    W, state = opt.step(W, G, state)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    # The state is mn + 2(m+n)B = 1.6e5 elements (1.3 MB); the step's temporaries are a few m x n and
    # m x B arrays. 20 MB is generous for those and far below one m x m matrix (72 MB).
    assert peak < 20e6, f"peak {peak / 1e6:.1f} MB"


# ------------------------------------------------------------------- policies, faults, checkpoints
def test_skip_keeps_a_blocked_matrix_unchanged() -> None:
    opt = FISMO(block_size=3, nonfinite="skip")
    W = np.full((2, 7, 5), 0.1)
    state = opt.init(W)
    W, state = opt.step(W, reference_gradients((2, 7, 5), 1)[0], state)
    G = reference_gradients((2, 7, 5), 1, seed=3)[0]
    G[1, 0, 0] = np.nan
    W_new, new = opt.step(W, G, state)
    assert np.array_equal(W_new[1], W[1]) and not np.array_equal(W_new[0], W[0])
    for name in ("P", "Q", "P_inv_sqrt", "Q_inv_sqrt"):
        old, got = getattr(state, name), getattr(new, name)
        assert np.array_equal(got.full[1], old.full[1]) and np.array_equal(got.rest[1], old.rest[1])
    assert new.skipped.tolist() == [0, 1]


@pytest.mark.filterwarnings("error:invalid value encountered:RuntimeWarning")  # the check flags the NaN root
def test_a_failing_block_root_falls_back_for_its_matrix_only() -> None:
    """An indefinite block makes its matrix keep P_{t-1} and the cached root; the other matrix steps."""
    opt = FISMO(block_size=3)
    W = np.full((2, 7, 5), 0.1)
    state = opt.init(W)
    bad = state.P.full.copy()
    bad[1, 1] = -50 * np.eye(3)  # gamma P_{t-1} dominates: the new block is indefinite, eigh gives NaN roots
    state = state._replace(P=Blocks(bad, state.P.rest))
    G = reference_gradients((2, 7, 5), 1)[0]
    with pytest.warns(InverseRootWarning) as record:
        _, new = opt.step(W, G, state)
    # The warning points at the user's call, not into the library.
    assert [w.filename for w in record if w.category is InverseRootWarning] == [__file__]
    with pytest.warns(InverseRootWarning) as record:
        opt.direction(G, state)
    assert [w.filename for w in record if w.category is InverseRootWarning] == [__file__]
    assert new.root_failures.tolist() == [0, 1]
    assert np.array_equal(new.P.full[1], bad[1]) and not np.array_equal(new.P.full[0], state.P.full[0])
    # the whole P_{t-1} of that matrix, every block, and its cached root, as docs/guarantees.md promises
    assert np.array_equal(new.P.rest[1], state.P.rest[1]) and not np.array_equal(new.P.rest[0], state.P.rest[0])
    assert np.array_equal(new.P_inv_sqrt.full[1], state.P_inv_sqrt.full[1])
    assert np.array_equal(new.P_inv_sqrt.rest[1], state.P_inv_sqrt.rest[1])
    assert np.all(np.isfinite(new.P_inv_sqrt.full))


def test_blocked_checkpoint_round_trip_resumes_bit_for_bit(tmp_path) -> None:
    opt = FISMO(block_size=4)
    grads = reference_gradients((9, 6), 6, seed=4)
    W = np.full((9, 6), 0.1)
    state = opt.init(W)
    for G in grads[:3]:
        W, state = opt.step(W, G, state)
    np.savez(tmp_path / "s.npz", **state.to_dict())
    loaded = FISMOState.from_dict(np.load(tmp_path / "s.npz"), W, block_size=4)
    W2 = W
    for G in grads[3:]:
        W, state = opt.step(W, G, state)
        W2, loaded = opt.step(W2, G, loaded)
    assert np.array_equal(W, W2)
    assert np.array_equal(state.P.full, loaded.P.full) and np.array_equal(state.P.rest, loaded.P.rest)


@pytest.mark.parametrize("saved,loading", [(4, None), (None, 4), (4, 2)])
def test_a_checkpoint_of_another_block_size_is_refused_naming_both(saved, loading) -> None:
    W = np.zeros((9, 6))
    d = FISMO(block_size=saved).init(W).to_dict()
    with pytest.raises(ValueError) as exc:
        FISMOState.from_dict(d, W, block_size=loading)
    message = str(exc.value)
    assert f"block_size={saved}" in message or (saved is None and "no side split" in message)
    assert f"block_size={loading}" in message


@pytest.mark.parametrize("bad", [0, -3, 2.5, True, "8", 1e9 + 0.5])
def test_block_size_must_be_a_positive_integer(bad) -> None:
    with pytest.raises(ValueError, match="block_size must be None"):
        FISMO(block_size=bad)


@pytest.mark.parametrize("bad", [0, -3, 2.5, True, "8"])
def test_the_structures_and_state_size_check_their_sizes(bad) -> None:
    """``factor_structure``, the structures and ``state_size`` refuse what ``FISMO(block_size=...)`` refuses
    (until 2026-12-04 ``state_size(5, 5, 2.5)`` was 75.0 and ``factor_structure(8, True)`` failed later; a
    user's hunt)."""
    with pytest.raises(ValueError, match="block_size must be None"):
        factor_structure(8, bad)
    with pytest.raises(ValueError, match="block_size must be None"):
        state_size(5, 5, bad)
    with pytest.raises(ValueError, match="must be a positive integer"):
        BlockDiagonalFactor(8, bad)
    for make in (lambda: factor_structure(bad, 4), lambda: FullFactor(bad), lambda: state_size(bad, 4)):
        with pytest.raises(ValueError, match="must be a positive integer"):
            make()


@pytest.mark.parametrize("structure", [FullFactor(8), BlockDiagonalFactor(8, 4), BlockDiagonalFactor(9, 4)], ids=repr)
def test_a_data_term_or_factor_of_another_size_is_refused(target64: Target, structure) -> None:
    """``update``, ``left`` and ``right`` refuse an ``X`` whose rows are not the side ``d``, and ``update``
    a factor of another size: a blocked factor dropped the extra rows, or (with a remainder block)
    returned a factor of another shape, trace 9.57 for d = 9, and ``FullFactor(10)`` normalised an 8 x 8
    factor to trace 10 (a user's hunt, 2026-12-04)."""
    target, d = target64, structure.d
    rows = target.asarray(np.random.default_rng(0).standard_normal((d + 2, 3)))
    A = structure.identity(target.xp, (), rows.dtype, fl._device(rows))
    for call in (lambda: structure.update(A, rows, 3, 0.5, 1e-3, 1.0), lambda: structure.left(A, rows),
                 lambda: structure.right(target.xp.matrix_transpose(rows), A)):
        with pytest.raises(ValueError, match="shape"):
            call()
    wider = FullFactor(d + 2) if isinstance(structure, FullFactor) else BlockDiagonalFactor(d + 2, 4)
    with pytest.raises(ValueError, match="the factor must have shape"):
        wider.update(A, target.asarray(np.ones((d + 2, 3))), 3, 0.5, 1e-3, 1.0)


@pytest.mark.parametrize("structure", [FullFactor(4), BlockDiagonalFactor(6, 4)], ids=repr)
def test_a_narrower_data_term_is_widened_and_an_integer_one_refused(structure) -> None:
    """A float16 ``X`` in a float32 factor: the Gram product is formed in float32, bit for bit the update
    of ``X`` cast first (``X X^T`` of entries near 100 overflowed float16's 65504 to NaN); an integer ``X``
    is a ``TypeError`` (NumPy made a float64 factor, torch and JAX float32; a user's hunt, 2026-12-04)."""
    checked = []
    for target in (t for t in targets(dtypes=["float32"]) if t.available and hasattr(t.xp, "float16")):
        xp, d = target.xp, structure.d
        X = target.asarray(np.random.default_rng(0).standard_normal((d, 16)) * 100)
        A = structure.identity(xp, (), xp.float32, fl._device(X))
        X16 = xp.astype(X, xp.float16)
        widened = structure.update(A, X16, 16, 0.5, 1e-3, 1.0)
        cast_first = structure.update(A, xp.astype(X16, xp.float32), 16, 0.5, 1e-3, 1.0)
        for got, want in zip(structure.parts(widened), structure.parts(cast_first)):
            assert got.dtype == xp.float32 and np.array_equal(to_numpy(got), to_numpy(want))
            assert np.isfinite(to_numpy(got)).all()
        with pytest.raises(TypeError, match="real floating"):
            structure.update(A, xp.astype(X, xp.int32), 16, 0.5, 1e-3, 1.0)
        checked.append(target.backend)
    assert "numpy" in checked and "torch" in checked


def test_the_products_refuse_two_libraries() -> None:
    """``left`` of a torch root and a NumPy ``X`` returned a torch tensor (torch's ``@`` takes NumPy)."""
    torch = pytest.importorskip("torch")
    with pytest.raises(TypeError, match="Multiple namespaces"):
        FullFactor(3).left(torch.eye(3, dtype=torch.float64), np.eye(3))


def test_a_blocked_state_fed_to_the_wrong_optimizer_is_refused() -> None:
    W = np.zeros((9, 6))
    state = FISMO(block_size=4).init(W)
    for block_size in (None, 2, 3, 5):  # none, or another one (docs/guarantees.md)
        with pytest.raises(ValueError, match="another block_size"):
            FISMO(block_size=block_size).step(W, np.ones_like(W), state)


def test_step_lines_are_the_quantities_of_the_step() -> None:
    """`step_lines` returns what `step` computes, and each line satisfies its formula."""
    opt = FISMO(block_size=4, gamma=0.9, polar="svd")
    W = np.full((9, 6), 0.1)
    state = opt.init(W)
    G = reference_gradients((9, 6), 1, seed=8)[0]
    W_step, s_step = opt.step(W, G, state)
    W_new, s_new, lines = opt.step_lines(W, G, state)
    assert np.array_equal(W_step, W_new) and np.array_equal(lines.W, W_new)
    assert np.array_equal(lines.M, s_step.M)
    P_is, Q_is = to_dense(lines.P_inv_sqrt), to_dense(lines.Q_inv_sqrt)
    np.testing.assert_allclose(lines.G_white, P_is @ G @ Q_is, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(lines.M, (1 - opt.beta) * lines.G_white, rtol=1e-12)
    np.testing.assert_allclose(lines.direction, P_is @ polar_svd(lines.M) @ Q_is, rtol=1e-10, atol=1e-13)
    np.testing.assert_allclose(lines.W, W - opt.lr * lines.direction, rtol=1e-14)


def test_blocks_under_jax_jit() -> None:
    """A jitted blocked step (float64, no host reads) equals the dense definition."""
    target = next(t for t in targets() if t.backend == "jax" and t.dtype == "float64")
    if not target.available:
        pytest.skip(target.reason)
    import jax

    opt = FISMO(block_size=4, nonfinite="propagate")
    grads = reference_gradients((9, 6), 3, seed=6)
    W0 = np.full((9, 6), 0.1)
    step = jax.jit(opt.step)
    W = target.asarray(W0)
    state = opt.init(W)
    for G in grads:
        W, state = step(W, target.asarray(G), state)
    W_ref, _, _, _ = dense_reference(W0, grads, 4, gamma=opt.gamma, polar=fl.polar)
    assert rel(W, W_ref) < 1e-10
