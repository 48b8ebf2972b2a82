"""The derivative of the exact inverse square root, and of steps made with it (``fismo_core._autodiff``).

Left to JAX and torch, the derivative of ``V diag(w^{-1/2}) V^T`` goes
through that of ``eigh``, which divides by eigenvalue gaps: at the repeated
eigenvalues FISMO's factors have (``P_0 = I``; zero rows of a gradient) it
came out NaN, for the root and for a loss after a few steps. The root's own
(Daleckii–Krein) derivative is checked here against an exact method that
does not use it: SciPy's Schur–Padé ``fractional_matrix_power`` of the block
matrix ``[[A, E], [0, A]]``, whose upper right block is the Fréchet
derivative of ``A^{-1/2}`` along ``E`` (Higham, *Functions of Matrices*,
Theorem 3.6).
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import pytest

from fismo_core import FISMO
from fismo_core.linalg import _eigh_root_parts, _svd_polar_parts, inverse_sqrt, polar
from fismo_core.testing import Target, targets, to_numpy

scipy_linalg = pytest.importorskip("scipy.linalg")

#: float64 on every device of the libraries that differentiate (torch's CUDA where there is one).
TARGETS = {t.id: t for t in targets() if t.dtype == "float64" and t.backend in ("jax", "torch")}

#: Relative Frobenius error of the root's derivative against SciPy's block-matrix
#: Fréchet derivative, float64, at eigenvalues 0.5 to 9 (condition of the
#: derivative about 9^{3/2} / 0.5^{3/2} = 76): measured 1.4e-15 to 7.8e-15 (torch and JAX, the
#: four CPU kernel sets of .ci/run; docs/scripts/exact_derivatives.py), a few eigh roundings amplified
#: by that condition. 1e-12 leaves a factor of 128. The derivative through eigh at repeated
#: eigenvalues is NaN or off by 0.37 to 1.2, and a wrong divided difference (e.g. f'(w_i) throughout)
#: by order 1.
FRECHET_TOLERANCE = 1e-12


def _target(target_id: str) -> Target:
    target = TARGETS[target_id]
    if not target.available:
        pytest.skip(target.reason)
    return target


def _symmetric(rng: np.random.Generator, d: int) -> np.ndarray:
    E = rng.standard_normal((d, d))
    return E + E.T


def _with_eigenvalues(w: list[float], seed: int = 1) -> np.ndarray:
    Q, _ = np.linalg.qr(np.random.default_rng(seed).standard_normal((len(w), len(w))))
    A = (Q * np.asarray(w, dtype=float)) @ Q.T
    return (A + A.T) / 2


def _frechet_reference(A: np.ndarray, E: np.ndarray) -> np.ndarray:
    d = A.shape[0]
    block = np.block([[A, E], [np.zeros((d, d)), A]])
    return np.real(scipy_linalg.fractional_matrix_power(block, -0.5)[:d, d:])


def _polar_svd(X: Any, check: bool = True) -> Any:
    return polar(X, method="svd", check=check)


def _derivative(target: Target, A: np.ndarray, E: np.ndarray, mode: str, f: Callable = inverse_sqrt) -> np.ndarray:
    """The derivative of ``f`` (``inverse_sqrt``, `_polar_svd`) at ``A`` along ``E`` by the target's library:
    forward mode, or reverse mode as the gradient of ``<f(A), E>`` (the same: both derivatives are
    self-adjoint maps, the root's on symmetric ``E``)."""
    A_, E_ = target.asarray(A), target.asarray(E)
    if target.backend == "jax":
        import jax

        if mode == "forward":
            return to_numpy(jax.jvp(f, (A_,), (E_,))[1])
        return to_numpy(jax.grad(lambda A: (f(A) * E_).sum())(A_))
    import torch

    if mode == "forward":
        return to_numpy(torch.func.jvp(f, (A_,), (E_,))[1])
    A_.requires_grad_(True)
    (grad,) = torch.autograd.grad((f(A_) * E_).sum(), A_)
    return to_numpy(grad)


def _relative_error(got: np.ndarray, expected: np.ndarray) -> float:
    return float(np.linalg.norm(got - expected) / np.linalg.norm(expected))


@pytest.mark.numbers
@pytest.mark.parametrize("mode", ["reverse", "forward"])
@pytest.mark.parametrize("target_id", sorted(TARGETS))
@pytest.mark.parametrize("w", [[4.0] * 4, [1.0, 1.0, 1.0, 4.0, 9.0], [0.5, 2.0, 3.0, 4.0, 9.0]],
                         ids=["all-repeated", "three-repeated", "distinct"])
def test_root_derivative_is_the_frechet_derivative(target_id: str, mode: str, w: list[float]) -> None:
    """At ``4 I`` it is ``-E / 16`` (``d(c^{-1/2}) = -c^{-3/2} / 2``); everywhere, SciPy's block-matrix
    derivative. Through ``eigh``'s own derivative the repeated cases were NaN."""
    rng = np.random.default_rng(len(w))
    A = _with_eigenvalues(w)
    E = _symmetric(rng, len(w))
    got = _derivative(_target(target_id), A, E, mode)
    assert np.all(np.isfinite(got))
    assert _relative_error(got, _frechet_reference(A, E)) <= FRECHET_TOLERANCE
    if len(set(w)) == 1:
        assert _relative_error(got, -E / 16) <= FRECHET_TOLERANCE


@pytest.mark.parametrize("mode", ["reverse", "forward"])
@pytest.mark.parametrize("target_id", sorted(TARGETS))
def test_newton_schulz_polar_derivative_at_a_zero_matrix(target_id: str, mode: str) -> None:
    """Near ``X = 0`` the Newton–Schulz polar is ``X / eps`` through the iteration, whose linear term is ``a``
    per step: the derivative at 0 is ``a^5 E / eps`` (Muon's ``a = 3.4445``, 5 steps, ``eps = 1e-7``). JAX gave
    NaN there (the norm's derivative at 0, multiplied by 0), for a zero matrix inside a batch too; torch
    gave this value. The batch's other matrix is checked against central differences."""
    target = _target(target_id)
    rng = np.random.default_rng(3)
    X = np.stack([np.zeros((3, 5)), rng.standard_normal((3, 5))])
    E = rng.standard_normal((2, 3, 5))
    got = _derivative(target, X, E, mode, polar)
    assert np.all(np.isfinite(got))
    # Both sides are a product of float64 numbers and the derivative is linear in E: a few roundings.
    assert _relative_error(got[0], 3.4445**5 * E[0] / 1e-7) <= 1e-13
    h = 1e-6  # float64 central differences: truncation ~h^2 times third derivatives of order 1, rounding ~1e-10
    numpy_polar = lambda Y: polar(Y)  # noqa: E731  (NumPy float64, no derivative asked for)
    central = (numpy_polar(X[1] + h * E[1]) - numpy_polar(X[1] - h * E[1])) / (2 * h)
    if mode == "forward":
        assert _relative_error(got[1], central) <= 1e-7
    else:  # the gradient of <polar(X), E> is the adjoint applied to E; its pairing with E is the forward one's
        assert abs(float(np.sum(got[1] * E[1])) - float(np.sum(central * E[1]))) <= 1e-7 * float(np.sum(np.abs(central * E[1])))


def test_derivative_of_a_step_at_a_zero_gradient_is_finite_and_the_same_in_jax_and_torch() -> None:
    """d ||W_1||^2 / dG at ``G = 0`` (a matrix no sample touched) through the default step: NaN in JAX until
    the Newton–Schulz norm's derivative at 0 was mended, finite in torch. Both libraries now agree."""
    jax_target, torch = _target("jax-cpu-float64"), pytest.importorskip("torch")
    import jax

    opt = FISMO()
    W = np.random.default_rng(5).standard_normal((4, 3))

    def loss(W, G):
        return (opt.step(W, G, opt.init(W))[0] ** 2).sum()

    got_jax = to_numpy(jax.grad(loss, argnums=1)(jax_target.asarray(W), jax_target.asarray(np.zeros((4, 3)))))
    G = torch.zeros((4, 3), dtype=torch.float64, requires_grad=True)
    (got_torch,) = torch.autograd.grad(loss(torch.from_numpy(W), G), G)
    assert np.all(np.isfinite(got_jax)) and np.all(np.isfinite(got_torch.numpy()))
    # Of order a^5 / eps ~ 5e9: the two libraries' products round apart by a few units of float64.
    assert _relative_error(got_jax, got_torch.numpy()) <= 1e-12


@pytest.mark.parametrize("target_id", sorted(TARGETS))
def test_batched_derivatives_under_vmap(target_id: str) -> None:
    """``jax.vmap(jax.grad(...))`` and ``torch.func.vmap(torch.func.grad(...))`` over a batch holding ``4 I``
    and a matrix with three equal eigenvalues: each matrix's derivative is its own Fréchet derivative, for
    the root and for the SVD polar factor (at ``4 I``: ``(E - E^T) / 8``, ``Ω``'s ``s_i + s_j = 8``)."""
    target = _target(target_id)
    A = np.stack([4.0 * np.eye(5), _with_eigenvalues([1.0, 1.0, 1.0, 4.0, 9.0])])
    E = np.random.default_rng(7).standard_normal((5, 5))
    for f, E_k, expected in (
        (inverse_sqrt, E + E.T, [_frechet_reference(A[k], E + E.T) for k in range(2)]),
        (_polar_svd, E, [(E - E.T) / 8, _polar_frechet_reference(A[1], E)]),
    ):
        A_, E_ = target.asarray(A), target.asarray(E_k)
        if target.backend == "jax":
            import jax

            got = to_numpy(jax.vmap(jax.grad(lambda A: (f(A, check=False) * E_).sum()))(A_))
        else:
            import torch

            got = to_numpy(torch.func.vmap(torch.func.grad(lambda A: (f(A, check=False) * E_).sum()))(A_))
        for k in range(2):
            assert _relative_error(got[k], expected[k]) <= FRECHET_TOLERANCE


def test_torch_forward_ad_takes_the_rules() -> None:
    """``torch.autograd.forward_ad`` (dual tensors, outside ``torch.func``): at ``4 I`` the root's tangent
    along a symmetric ``E`` is ``-E / 16`` and the SVD polar factor's along any ``D`` is ``(D - D^T) / 8``;
    through ``eigh`` and the SVD they were NaN or wrong (float64, 1e-12)."""
    torch = pytest.importorskip("torch")
    import torch.autograd.forward_ad as forward_ad

    rng = np.random.default_rng(9)
    E, D = torch.tensor(_symmetric(rng, 4)), torch.tensor(rng.standard_normal((4, 4)))
    A = 4.0 * torch.eye(4, dtype=torch.float64)
    with forward_ad.dual_level():
        root = forward_ad.unpack_dual(inverse_sqrt(forward_ad.make_dual(A, E))).tangent
        Q = forward_ad.unpack_dual(_polar_svd(forward_ad.make_dual(A, D))).tangent
    assert _relative_error(root.numpy(), -E.numpy() / 16) <= 1e-12
    assert _relative_error(Q.numpy(), (D.numpy() - D.numpy().T) / 8) <= 1e-12


def test_torch_forward_mode_alone_decomposes_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The forward-mode rule decomposes again only where its result is differentiated in reverse
    (`test_second_derivative_is_the_librarys_own`'s ``jacrev(jacfwd(f))``): ``jacfwd``, ``torch.func.jvp``
    and ``hessian`` (forward over reverse, whose backward decomposes on its own) call ``eigh`` as often as
    before that fix, once per forward pass."""
    torch = pytest.importorskip("torch")
    import fismo_core._autodiff_torch as rules_module

    calls = []
    parts = rules_module._eigh_root_parts
    monkeypatch.setattr(rules_module, "_eigh_root_parts", lambda A: (calls.append(1), parts(A))[1])
    A = torch.tensor(_symmetric(np.random.default_rng(4), 3) + 4 * np.eye(3))
    root = lambda A: inverse_sqrt(A, check=False)  # noqa: E731
    for name, run, expected in [
        ("jacfwd", lambda: torch.func.jacfwd(root)(A), 1),
        ("jvp", lambda: torch.func.jvp(root, (A,), (A,)), 1),
        ("hessian", lambda: torch.func.hessian(lambda A: root(A).sum())(A), 2),  # forward, and backward's own
        ("jacrev(jacfwd)", lambda: torch.func.jacrev(torch.func.jacfwd(lambda A: root(A).sum()))(A), 2),
    ]:
        calls.clear()
        run()
        assert len(calls) == expected, name


@pytest.mark.parametrize("function", ["inverse_sqrt", "polar"])
def test_torch_batched_derivatives_through_the_rules(function: str) -> None:
    """torch's batched gradients (``jacobian(vectorize=True)``, forward-mode too, ``hessian(vectorize=True)``,
    ``autograd.grad(is_grads_batched=True)``) raised ``Batching rule not implemented for aten::swapaxes``
    (then ``linalg_diagonal``) through the rules (a user's hunt, 2026-12-04). They equal the Jacobian taken
    a row at a time (float64; the same products in another batching: 1e-12)."""
    torch = pytest.importorskip("torch")
    from torch.autograd.functional import hessian, jacobian

    rng = np.random.default_rng(5)
    if function == "inverse_sqrt":
        A = torch.tensor(_symmetric(rng, 3) + 4 * np.eye(3))
        f = lambda A: inverse_sqrt(A, check=False)  # noqa: E731
    else:
        A = torch.tensor(rng.standard_normal((3, 2)))
        f = lambda A: polar(A, method="svd")  # noqa: E731
    C = torch.tensor(rng.standard_normal(tuple(f(A).shape)))
    loop = jacobian(f, A)
    for strategy in ("reverse-mode", "forward-mode"):
        batched = jacobian(f, A, vectorize=True, strategy=strategy)
        assert torch.allclose(batched, loop, rtol=1e-12, atol=1e-12), strategy
    loss = lambda A: (f(A) * C).sum()  # noqa: E731
    assert torch.allclose(hessian(loss, A, vectorize=True), hessian(loss, A), rtol=1e-12, atol=1e-12)
    A_ = A.clone().requires_grad_(True)
    out = f(A_)
    seeds = torch.stack([C, 2 * C])
    (batched_grads,) = torch.autograd.grad(out, A_, seeds, is_grads_batched=True)
    (one,) = torch.autograd.grad(f(A_), A_, C)
    assert torch.allclose(batched_grads[1], 2 * one, rtol=1e-12, atol=1e-12)


def _with_singular_values(s: list[float], shape: tuple[int, int], seed: int = 2) -> np.ndarray:
    rng = np.random.default_rng(seed)
    U, _ = np.linalg.qr(rng.standard_normal((shape[0], len(s))))
    V, _ = np.linalg.qr(rng.standard_normal((shape[1], len(s))))
    return (U * np.asarray(s)) @ V.T


def _polar_frechet_reference(X: np.ndarray, E: np.ndarray) -> np.ndarray:
    """The derivative of ``Q = X (X^T X)^{-1/2}`` (full-rank ``X``, not wide) along ``E``: ``E H^{-1} + X
    d(H^{-1})``, ``d(H^{-1})`` the inverse root's Fréchet derivative at ``X^T X`` along ``E^T X + X^T E``
    by SciPy's block matrix: exact, and nothing of the polar rule's formula."""
    H2 = X.T @ X
    return (E @ np.real(scipy_linalg.fractional_matrix_power(H2, -0.5))
            + X @ _frechet_reference(H2, E.T @ X + X.T @ E))


#: The polar factor's derivative against `_polar_frechet_reference`, float64: the reference squares the
#: singular values (condition of X^T X up to 16 here), the rule does not; measured 6.1e-16 to 6.2e-15
#: (torch and JAX, the four CPU kernel sets; docs/scripts/exact_derivatives.py). 1e-12 as for the root.
#: Through the SVD's own derivative the cases with equal singular values were NaN or off by 0.07 to 1.2.
@pytest.mark.numbers
@pytest.mark.parametrize("mode", ["reverse", "forward"])
@pytest.mark.parametrize("target_id", sorted(TARGETS))
@pytest.mark.parametrize("singular_values, shape", [
    ([1.0] * 4, (4, 4)), ([1.0] * 4, (6, 4)), ([1.0] * 4, (4, 6)), ([2.0, 2.0, 1.0, 0.5], (6, 4)),
    ([4.0, 3.0, 2.0, 1.0], (4, 4)),
], ids=["orthogonal", "tall-orthonormal", "wide-orthonormal", "two-equal", "distinct"])
def test_polar_svd_derivative_is_the_frechet_derivative(
    target_id: str, mode: str, singular_values: list[float], shape: tuple[int, int]
) -> None:
    """``polar(X, method="svd")``'s derivative at full-rank ``X`` (orthogonal, orthonormal columns or rows,
    two equal singular values, distinct ones) against the exact derivative of ``X (X^T X)^{-1/2}`` (of the
    transpose for a wide ``X``)."""
    X = _with_singular_values(singular_values, shape)
    E = np.random.default_rng(len(singular_values)).standard_normal(shape)
    got = _derivative(_target(target_id), X, E, mode, _polar_svd)
    expected = _polar_frechet_reference(X, E) if shape[0] >= shape[1] else _polar_frechet_reference(X.T, E.T).T
    assert np.all(np.isfinite(got))
    assert _relative_error(got, expected) <= FRECHET_TOLERANCE


@pytest.mark.parametrize("target_id", sorted(TARGETS))
def test_polar_svd_derivative_holds_the_rank_of_a_rank_deficient_x(target_id: str) -> None:
    """At ``X = [[A], [0]]`` (rank 4 of 6 rows: the cut drops two zero singular values) along
    ``E = [[B], [0]]``, which keeps the rank, ``polar(X + tE) = [[polar(A + tB)], [0]]``: the derivative is
    ``A``'s, with zero rows. Through the SVD's own derivative it was NaN (two equal zero singular values)."""
    rng = np.random.default_rng(11)
    A, B = _with_singular_values([3.0, 2.0, 2.0, 1.0], (4, 4)), rng.standard_normal((4, 4))
    X, E = np.vstack([A, np.zeros((2, 4))]), np.vstack([B, np.zeros((2, 4))])
    for mode in ("forward", "reverse"):
        got = _derivative(_target(target_id), X, E, mode, _polar_svd)
        assert _relative_error(got[:4], _polar_frechet_reference(A, B)) <= FRECHET_TOLERANCE
        assert np.all(got[4:] == 0) if mode == "forward" else np.all(np.abs(got[4:]) <= 1e-15)


@pytest.mark.parametrize("target_id", sorted(TARGETS))
def test_polar_svd_derivative_of_a_huge_x(target_id: str) -> None:
    """``X`` past the square root of float64's largest number is decomposed divided by a power of two (its
    SVD would overflow); ``polar(c X) = polar(X)``, so the derivative at ``2^600 X`` is ``2^-600`` times the
    one at ``X`` (float64: both from one SVD up to exact powers of two, bound 1e-14)."""
    target = _target(target_id)
    X = _with_singular_values([2.0, 2.0, 1.0], (5, 3))
    E = np.random.default_rng(13).standard_normal((5, 3))
    for mode in ("forward", "reverse"):
        at_x = _derivative(target, X, E, mode, _polar_svd)
        at_huge = _derivative(target, X * 2.0**600, E, mode, _polar_svd)
        assert np.all(np.isfinite(at_huge)) and np.any(at_huge != 0)
        assert _relative_error(at_huge * 2.0**600, at_x) <= 1e-14


@pytest.mark.parametrize("target_id", sorted(TARGETS))
def test_values_are_those_without_a_derivative_bit_for_bit(target_id: str) -> None:
    """The rules change the derivatives only: torch's root and SVD polar factor of a tensor that requires
    grad equal the ones under ``no_grad``, and JAX's compiled ones the plain compositions', bit for bit."""
    target = _target(target_id)
    A = target.asarray(_with_eigenvalues([0.5, 1.0, 1.0, 3.0, 7.0]))
    if target.backend == "jax":
        import jax

        plain = jax.jit(lambda A: _eigh_root_parts(A)[0])(A)
        assert np.array_equal(to_numpy(jax.jit(inverse_sqrt)(A)), to_numpy(plain))
        plain = jax.jit(lambda A: _svd_polar_parts(A, None)[0])(A)
        assert np.array_equal(to_numpy(jax.jit(_polar_svd)(A)), to_numpy(plain))
        return
    import torch

    for f in (inverse_sqrt, _polar_svd):
        with torch.no_grad():
            plain = f(A)
        tracked = f(A.clone().requires_grad_(True))
        assert tracked.grad_fn is not None and torch.equal(tracked.detach(), plain)


#: Second derivatives along symmetric directions, against the Newton–Schulz twins' (products only,
#: converged to rounding), float64: the root's measured 5.3e-15 (JAX), 2.0e-14 (torch, create_graph) and
#: 5.7e-15 (torch.func.hessian) apart under each CPU kernel set, the polar factor's at most 1.5e-15.
#: 1e-10 leaves four orders; dropping the eigenvectors' dependence on ``A`` changes the value by order 1.
SECOND_DERIVATIVE_TOLERANCE = 1e-10


#: The exact methods and their matmul-only twins at convergence, for the second derivatives: the root by
#: Newton–Schulz with 30 steps (eigenvalues 4 to 5, along symmetric directions), the polar factor by the
#: cubic with 20 (singular values 1 to 2, along any directions).
SECOND_DERIVATIVE_CASES = {
    "inverse_sqrt": (inverse_sqrt, {}, {"method": "newton_schulz", "steps": 30}, [4.0, 4.5, 5.0], _symmetric),
    "polar": (polar, {"method": "svd"}, {"method": "newton_schulz", "coefficients": "cubic", "steps": 20},
              [1.0, 1.5, 2.0], lambda rng, d: rng.standard_normal((d, d))),
}


@pytest.mark.numbers
@pytest.mark.parametrize("target_id", sorted(TARGETS))
@pytest.mark.parametrize("function", sorted(SECOND_DERIVATIVE_CASES))
def test_second_derivative_is_the_librarys_own(target_id: str, function: str) -> None:
    """A second derivative differentiates the rule, whose ``eigh`` or ``svd`` the library differentiates:
    at distinct eigenvalues or singular values it is exact (torch with ``create_graph=True``,
    ``torch.func.hessian`` and ``jacrev(jacfwd(f))``, JAX's ``hessian``), as the Newton–Schulz twin's shows."""
    target = _target(target_id)
    f, exact, products, diagonal, direction = SECOND_DERIVATIVE_CASES[function]
    rng = np.random.default_rng(3)
    A, C, E1, E2 = (target.asarray(x) for x in (np.diag(diagonal), *(direction(rng, 3) for _ in range(3))))
    values = []
    for kw in (exact, products):
        loss = lambda A: (f(A, check=False, **kw) * C).sum()  # noqa: E731
        if target.backend == "jax":
            import jax

            values.append(float((E2[:, :, None, None] * jax.hessian(loss)(A) * E1).sum()))
            continue
        import torch

        A_ = A.clone().requires_grad_(True)
        (g,) = torch.autograd.grad(loss(A_), A_, create_graph=True)
        (h,) = torch.autograd.grad((g * E2).sum(), A_)
        H = torch.func.hessian(loss)(A)
        # Reverse over forward: the forward-mode rule's own derivative (until 2026-12-04 its saved vectors,
        # marked non-differentiable, were taken as constant: 1.6 and 1.3 relative off; a user's hunt).
        J = torch.func.jacrev(torch.func.jacfwd(loss))(A)
        values += [float((h * E1).sum()), float(torch.einsum("ij,ijkl,kl->", E2, H, E1)),
                   float(torch.einsum("ij,ijkl,kl->", E2, J, E1))]
    reference = values[len(values) // 2:]
    for got, expected in zip(values[:len(values) // 2], reference):
        assert abs(got - expected) <= SECOND_DERIVATIVE_TOLERANCE * abs(expected)


def _loss_after_steps(backend: str, opt: FISMO, shift, steps: int = 2):
    """``sum(W_2^2)`` after two steps from ``W``, the gradients ``tanh(W) + shift`` depending on ``W``."""
    if backend == "jax":
        import jax.numpy as tanh_lib
    else:
        import torch as tanh_lib

    def loss(W):
        state = opt.init(W.detach() if backend == "torch" else W)
        for _ in range(steps):
            W, state = opt.step(W, tanh_lib.tanh(W) + shift, state)
        return (W ** 2).sum()

    return loss


@pytest.mark.numbers
@pytest.mark.parametrize("target_id", sorted(TARGETS))
@pytest.mark.parametrize("settings", [{}, {"nonfinite": "propagate"}, {"block_size": 8}, {"polar": "svd"}],
                         ids=["default", "propagate", "blocks", "polar-svd"])
def test_grad_through_steps_with_zero_gradient_rows(target_id: str, settings: dict) -> None:
    """What backends.md says of differentiating through a step with the exact roots: a gradient whose
    first rows are zero (an embedding's unused tokens) keeps those directions of ``P`` on one eigenvalue;
    the gradient of a loss after two steps was NaN everywhere (JAX and torch). It is finite and matches
    central differences (float64, step 1e-5: truncation ~1e-10; measured agreement 4.8e-10 to 3.4e-9
    relative over the CPU kernel sets; bound 1e-6, as for Newton–Schulz roots in test_jax.py)."""
    target = _target(target_id)
    backend = target.backend
    rng = np.random.default_rng(0)
    W0, shift = rng.standard_normal((12, 16)), rng.standard_normal((12, 16))
    W0[:3] = shift[:3] = 0.0
    W0, shift = target.asarray(W0), target.asarray(shift)
    loss = _loss_after_steps(backend, FISMO(**settings), shift)
    if backend == "jax":
        import jax

        grad = to_numpy(jax.jit(jax.grad(loss))(W0))
        value = jax.jit(loss)
    else:
        import torch

        W = W0.clone().requires_grad_(True)
        (grad,) = torch.autograd.grad(loss(W), W)
        grad = to_numpy(grad)
        value = loss
    assert np.all(np.isfinite(grad))
    for i, j in [(1, 2), (5, 3), (6, 0)]:
        e = np.zeros(W0.shape)
        e[i, j] = 1e-5
        central = (float(value(W0 + target.asarray(e))) - float(value(W0 - target.asarray(e)))) / 2e-5
        assert abs(grad[i, j] - central) <= 1e-6 * max(1.0, abs(central)), (i, j)


def test_compiled_differentiation_is_one_graph() -> None:
    """Under ``torch.compile(fullgraph=True)`` the root and the SVD polar factor with their derivatives trace
    into one graph (dynamo traces an ``autograd.Function`` only without a forward-mode rule; compiled code
    takes the rules without one), and the gradient of ``<(4 I)^{-1/2}, C> + <polar(4 I), D>`` is still
    ``-C / 16 + (D - D^T) / 8`` (``dQ = (E - E^T) / (s_i + s_j)`` at ``X = 4 I``; float64: 1e-12)."""
    torch = pytest.importorskip("torch")
    from torch._dynamo.utils import counters

    rng = np.random.default_rng(5)
    C, D = torch.tensor(_symmetric(rng, 4)), torch.tensor(rng.standard_normal((4, 4)))
    torch._dynamo.reset()
    counters.clear()
    loss = torch.compile(lambda A: ((inverse_sqrt(A, check=False) * C).sum()
                                    + (polar(A, method="svd", check=False) * D).sum()),
                         backend="aot_eager", fullgraph=True)
    A = (4.0 * torch.eye(4, dtype=torch.float64)).requires_grad_(True)
    loss(A).backward()
    assert counters["stats"]["unique_graphs"] == 1
    expected = -C.numpy() / 16 + (D.numpy() - D.numpy().T) / 8
    assert _relative_error(A.grad.numpy(), expected) <= 1e-12


@pytest.mark.parametrize("target_id", sorted(TARGETS))
def test_eigenvalues_carry_their_derivative(target_id: str) -> None:
    """The root's companion output ``w`` (the optimizer's checks read it) is differentiable too: the
    gradient of ``sum(w) = tr A`` is ``I``, at repeated eigenvalues as anywhere (float64: ``V Vᵀ`` off ``I``
    by rounding, measured 4.4e-16 (JAX) and 6.7e-16 (torch); bound 1e-14)."""
    from fismo_core.linalg import _eigh_inverse_sqrt

    target = _target(target_id)
    A = target.asarray(_with_eigenvalues([1.0, 1.0, 1.0, 4.0, 9.0]))
    if target.backend == "jax":
        import jax

        grad = to_numpy(jax.grad(lambda A: _eigh_inverse_sqrt(A)[1].sum())(A))
    else:
        import torch

        A.requires_grad_(True)
        grad = to_numpy(torch.autograd.grad(_eigh_inverse_sqrt(A)[1].sum(), A)[0])
    assert np.max(np.abs(grad - np.eye(5))) <= 1e-14
