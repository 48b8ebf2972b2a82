"""The derivatives of the exact matrix functions (docs/linalg.md, "Derivatives"; docs/backends.md).

Prints, for JAX and torch in float64:

1. the relative Frobenius error of the derivative of ``inverse_sqrt(A)``
   along a symmetric ``E`` (forward and reverse mode, the worse of the two)
   against SciPy's Fréchet derivative (the upper right block of
   ``fractional_matrix_power([[A, E], [0, A]], -0.5)``), and the same for
   the derivative the library gives through its own ``eigh`` (what FISMO
   used before its rule), at eigenvalues all equal, three equal, or distinct;
   and the same for ``polar(X, method="svd")`` against the exact derivative
   of ``X (X^T X)^{-1/2}`` at full-rank ``X`` (orthogonal, orthonormal
   columns or rows, two equal singular values, distinct ones), and at a
   rank-deficient ``X = [[A], [0]]`` along ``[[B], [0]]`` (which keeps the
   rank) against ``A``'s;
2. the second derivatives along two directions at distinct eigenvalues
   (singular values) against those of the Newton–Schulz twins at
   convergence (JAX's ``hessian``, torch's ``create_graph=True`` and
   ``torch.func.hessian``);
3. the gradient of ``sum(W_2^2)`` after two FISMO steps from a 12 x 16 ``W``
   whose first 3 rows of gradient are zero, against central differences
   (step 1e-5) at three entries, worst relative error, and its count of
   non-finite entries; with the rules, and without them (through ``eigh`` and the SVD).

    python docs/scripts/exact_derivatives.py     # about 35 s
"""

from __future__ import annotations

import argparse
import jax
import jax.numpy as jnp
import numpy as np
import scipy.linalg
import torch

from fismo_core import FISMO, _autodiff
from fismo_core.linalg import _eigh_root_parts, _svd_polar_parts, inverse_sqrt, polar

jax.config.update("jax_enable_x64", True)
torch.set_default_dtype(torch.float64)
needs_derivative = _autodiff.needs_derivative
CASES = {"all equal": [4.0] * 4, "three equal": [1.0, 1.0, 1.0, 4.0, 9.0], "distinct": [0.5, 2.0, 3.0, 4.0, 9.0]}


def symmetric(rng: np.random.Generator, d: int) -> np.ndarray:
    E = rng.standard_normal((d, d))
    return E + E.T


def with_eigenvalues(w: list[float]) -> np.ndarray:
    Q, _ = np.linalg.qr(np.random.default_rng(1).standard_normal((len(w), len(w))))
    A = (Q * np.asarray(w)) @ Q.T
    return (A + A.T) / 2


def frechet(A: np.ndarray, E: np.ndarray) -> np.ndarray:
    d = len(A)
    return np.real(scipy.linalg.fractional_matrix_power(np.block([[A, E], [np.zeros((d, d)), A]]), -0.5)[:d, d:])


def with_singular_values(s: list[float], shape: tuple[int, int]) -> np.ndarray:
    rng = np.random.default_rng(2)
    U, _ = np.linalg.qr(rng.standard_normal((shape[0], len(s))))
    V, _ = np.linalg.qr(rng.standard_normal((shape[1], len(s))))
    return (U * np.asarray(s)) @ V.T


def polar_frechet(X: np.ndarray, E: np.ndarray) -> np.ndarray:
    """The derivative of X (X^T X)^{-1/2} along E (full rank, m >= n; the transpose's for a wide X)."""
    if X.shape[0] < X.shape[1]:
        return polar_frechet(X.T, E.T).T
    H2 = X.T @ X
    return E @ np.real(scipy.linalg.fractional_matrix_power(H2, -0.5)) + X @ frechet(H2, E.T @ X + X.T @ E)


def derivatives(backend: str, root, A: np.ndarray, E: np.ndarray) -> list[np.ndarray]:
    """Forward and reverse mode derivatives of ``root`` at ``A`` along ``E``."""
    if backend == "jax":
        A_, E_ = jnp.asarray(A), jnp.asarray(E)
        return [np.asarray(jax.jvp(root, (A_,), (E_,))[1]),
                np.asarray(jax.grad(lambda A: (root(A) * E_).sum())(A_))]
    A_, E_ = torch.tensor(A), torch.tensor(E)
    forward = torch.func.jvp(root, (A_,), (E_,))[1].numpy()
    A_.requires_grad_(True)
    return [forward, torch.autograd.grad((root(A_) * E_).sum(), A_)[0].numpy()]


def first_derivatives() -> None:
    print("1. d(A^{-1/2})[E] against SciPy's Frechet derivative "
          "(relative Frobenius error, worse of forward and reverse)")
    for backend in ("jax", "torch"):
        for case, w in CASES.items():
            A, E = with_eigenvalues(w), symmetric(np.random.default_rng(len(w)), len(w))
            reference = frechet(A, E)
            row = []
            for name, root in (("FISMO", lambda A: inverse_sqrt(A, check=False)),
                               ("through eigh", lambda A: _eigh_root_parts(A)[0])):
                errors = [np.linalg.norm(d - reference) / np.linalg.norm(reference)
                          for d in derivatives(backend, root, A, E)]
                row.append(f"{name} {max(errors):.1e}")
            print(f"   {backend:5s} {case:11s}: " + ", ".join(row))
    print("   polar(X, method='svd') against the derivative of X (X^T X)^{-1/2}")
    rng = np.random.default_rng(11)
    A, B = with_singular_values([3.0, 2.0, 2.0, 1.0], (4, 4)), rng.standard_normal((4, 4))
    polar_cases = {
        "orthogonal 4x4": ([1.0] * 4, (4, 4)), "orthonormal 6x4": ([1.0] * 4, (6, 4)),
        "orthonormal 4x6": ([1.0] * 4, (4, 6)), "two equal 6x4": ([2.0, 2.0, 1.0, 0.5], (6, 4)),
        "distinct 4x4": ([4.0, 3.0, 2.0, 1.0], (4, 4)), "rank 4 of 6x4": None,
    }
    for backend in ("jax", "torch"):
        for case, spec in polar_cases.items():
            if spec is None:  # [[A], [0]] along [[B], [0]]: the kept rank held, A's derivative
                X, E = np.vstack([A, np.zeros((2, 4))]), np.vstack([B, np.zeros((2, 4))])
                reference = np.vstack([polar_frechet(A, B), np.zeros((2, 4))])
            else:
                X = with_singular_values(*spec)
                E = np.random.default_rng(len(spec[0])).standard_normal(spec[1])
                reference = polar_frechet(X, E)
            row = []
            for name, f in (("FISMO", lambda X: polar(X, method="svd")),
                            ("through the SVD", lambda X: _svd_polar_parts(X, None)[0])):
                errors = [np.linalg.norm(d - reference) / np.linalg.norm(reference)
                          for d in derivatives(backend, f, X, E)]
                row.append(f"{name} {max(errors):.1e}")
            print(f"   {backend:5s} {case:15s}: " + ", ".join(row))


def second_derivatives() -> None:
    print("2. second derivatives at distinct values against the Newton-Schulz twins' (relative difference)")
    cases = {  # the function, its exact and matmul-only settings, the diagonal of X, symmetric directions?
        "inverse_sqrt at eigenvalues 4, 4.5, 5": (inverse_sqrt, {}, {"method": "newton_schulz", "steps": 30},
                                                  [4.0, 4.5, 5.0], True),
        "polar at singular values 1, 1.5, 2": (polar, {"method": "svd"},
                                               {"method": "newton_schulz", "coefficients": "cubic", "steps": 20},
                                               [1.0, 1.5, 2.0], False),
    }
    for case, (f, exact, products, diagonal, symmetric_directions) in cases.items():
        rng = np.random.default_rng(3)
        A = np.diag(diagonal)
        C, E1, E2 = (symmetric(rng, 3) if symmetric_directions else rng.standard_normal((3, 3)) for _ in range(3))
        values: dict[tuple[str, int], float] = {}
        for k, kw in enumerate((exact, products)):
            H = jax.hessian(lambda A: (f(A, check=False, **kw) * C).sum())(jnp.asarray(A))
            values["jax hessian", k] = float(np.einsum("ij,ijkl,kl->", E2, np.asarray(H), E1))
            loss = lambda A: (f(A, check=False, **kw) * torch.tensor(C)).sum()  # noqa: E731
            A_ = torch.tensor(A, requires_grad=True)
            (g,) = torch.autograd.grad(loss(A_), A_, create_graph=True)
            (h,) = torch.autograd.grad((g * torch.tensor(E2)).sum(), A_)
            values["torch create_graph", k] = float((h * torch.tensor(E1)).sum())
            H = torch.func.hessian(loss)(torch.tensor(A)).numpy()
            values["torch.func.hessian", k] = float(np.einsum("ij,ijkl,kl->", E2, H, E1))
        for name in ("jax hessian", "torch create_graph", "torch.func.hessian"):
            print(f"   {case}, {name:19s}: {abs(values[name, 0] - values[name, 1]) / abs(values[name, 1]):.1e}")


def through_steps() -> None:
    print("3. gradient of a loss after two steps, 3 of 12 gradient rows zero, against central differences")
    rng = np.random.default_rng(0)
    W0, shift = rng.standard_normal((12, 16)), rng.standard_normal((12, 16))
    W0[:3] = shift[:3] = 0.0
    for backend in ("jax", "torch"):
        lib = jnp if backend == "jax" else torch
        as_array = jnp.asarray if backend == "jax" else torch.tensor
        W_, shift_ = as_array(W0), as_array(shift)
        for settings in ({}, {"nonfinite": "propagate"}, {"block_size": 8}, {"polar": "svd"}):
            opt = FISMO(**settings)

            def loss(W):
                state = opt.init(W if backend == "jax" else W.detach())
                for _ in range(2):
                    W, state = opt.step(W, lib.tanh(W) + shift_, state)
                return (W ** 2).sum()

            row = []
            for name, rule in (("FISMO", True), ("without the rules", False)):
                _autodiff.needs_derivative = needs_derivative if rule else (lambda A: False)
                if backend == "jax":
                    grad, value = np.asarray(jax.jit(jax.grad(loss))(W_)), jax.jit(loss)
                else:
                    W = W_.clone().requires_grad_(True)
                    grad, value = torch.autograd.grad(loss(W), W)[0].numpy(), loss
                errors = []
                for i, j in [(1, 2), (5, 3), (6, 0)]:
                    e = np.zeros(W0.shape)
                    e[i, j] = 1e-5
                    e_ = as_array(e)
                    central = (float(value(W_ + e_)) - float(value(W_ - e_))) / 2e-5
                    errors.append(abs(grad[i, j] - central) / max(1.0, abs(central)))
                row.append(f"{name} {np.max(errors):.1e} ({int(np.sum(~np.isfinite(grad)))} of {grad.size} not finite)")
            _autodiff.needs_derivative = needs_derivative
            print(f"   {backend:5s} FISMO({settings}): " + ", ".join(row))


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()  # --help; anything else refused
    first_derivatives()
    second_derivatives()
    through_steps()
