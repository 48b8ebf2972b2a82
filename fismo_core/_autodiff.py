"""The derivatives of the exact matrix functions, for the libraries that differentiate (JAX, torch autograd).

**The inverse square root.**

``A^{-1/2} = V diag(w^{-1/2}) V^T`` from ``A = V diag(w) V^T``. Left to the
libraries, its derivative goes through that of ``eigh``, which divides by the
gaps ``w_i - w_j``, and FISMO's factors have repeated eigenvalues by
construction (``P_0 = Q_0 = I``; a gradient with zero rows, as an embedding's
unused tokens give, keeps those directions of ``P`` on one value): the
derivative of a loss through a step came out NaN, or wrong where rounding
left equal eigenvalues a few units apart. The root is a function of
``A`` alone, and its Fréchet derivative (Daleckii–Krein) needs no gap:

    d(A^{-1/2})[E] = V (F ∘ (V^T E V)) V^T,
    F_ij = (w_i^{-1/2} - w_j^{-1/2}) / (w_i - w_j) = -1 / (s_i s_j (s_i + s_j)),   s = w^{1/2},

which at ``w_i = w_j`` is the derivative ``-w^{-3/2} / 2`` itself. The
eigenvalues' own derivative is ``dw_i = (V^T E V)_ii``. ``E`` is taken
symmetric (``(E + E^T) / 2``): the root reads a symmetric ``A``.

The first derivative is this one; a second differentiates the rule itself,
whose ``eigh`` has the library's own derivative (exact where the eigenvalues
are distinct, NaN or wrong where they repeat), in JAX and in torch alike (its
backward pass decomposes ``A`` again when it builds a graph). Forward mode
(``jax.jvp``, ``torch.func.jvp``, ``torch.autograd.forward_ad``) gives the
same first derivative.

**The polar factor by SVD.** ``polar(X, method="svd") = U diag(k) V^T`` from
the thin SVD ``X = U diag(s) V^T``, ``k_i = 1`` for a kept singular value
(``s_i`` above the cut) and 0 for a cut one. The SVD's derivative divides
by the gaps ``s_i^2 - s_j^2``; at equal singular values (an orthogonal
``X``, or the zero ones of a rank-deficient ``X``) it came out NaN. The
polar factor's own derivative, with the kept rank held (``U_k``, ``V_k`` the
kept singular vectors, ``K = U^T E V``):

    dQ = U Ω V^T + (I - U_k U_k^T) E V_k S_k^{-1} V_k^T + U_k S_k^{-1} U_k^T E (I - V_k V_k^T),
    Ω_ij = k_i k_j (K_ij - K_ji) / (s_i + s_j),

divides by sums of kept singular values only. For a full-rank ``X`` it is
the polar factor's derivative (the last two terms vanish for a square
one, one of them for a tall or wide one); where singular values are cut,
the polar factor is not continuous in ``X`` (a perturbation lifts them over
the cut), and this is its derivative along the perturbations that keep the
rank. The map is self-adjoint, so it also turns the gradient of a loss in
``Q`` into the one in ``X``.

The rules are in ``_autodiff_jax`` and ``_autodiff_torch``, imported at
first use.
"""

from __future__ import annotations

import sys
from typing import Any, Optional

from array_api_compat import array_namespace, device

Array = Any


def inverse_sqrt_divided_differences(w: Array) -> Array:
    """``F_ij = (w_i^{-1/2} - w_j^{-1/2}) / (w_i - w_j)``, ``-w_i^{-3/2} / 2`` where ``w_i = w_j``: no gap divides."""
    xp = array_namespace(w)
    s = xp.sqrt(w)
    s_i, s_j = s[..., :, None], s[..., None, :]
    return -1 / ((s_i * s_j) * (s_i + s_j))


def inverse_sqrt_derivative(V: Array, F: Array, E: Array) -> tuple[Array, Array]:
    """``(V (F ∘ (V^T E_s V)) V^T, diag(V^T E_s V))`` with ``E_s = (E + E^T) / 2``: the root's and the
    eigenvalues' derivatives along ``E``, in ``V``'s dtype. Linear in ``E``, and self-adjoint (``F`` is
    symmetric), so the same map gives the gradient of a loss from the root's."""
    xp = array_namespace(V)
    E = xp.astype(E, V.dtype, copy=False)
    Vt = V.mT  # .mT, not xp.matrix_transpose (torch.swapaxes), nor xp.linalg.diagonal below: torch's batched
    S = Vt @ ((E + E.mT) / 2) @ V  # gradients (is_grads_batched, jacobian(vectorize=True)) have no rule for those
    eye = xp.eye(S.shape[-1], dtype=S.dtype, device=device(S))
    return V @ (F * S) @ Vt, xp.sum(S * eye, axis=-1)  # the diagonal, exactly (the rest adds zeros)


def polar_svd_derivative(U: Array, S: Array, Vh: Array, keep: Optional[Array], E: Array) -> Array:
    """``dQ`` above, the derivative of ``U diag(keep) Vh`` along ``E`` with the kept rank held, in ``U``'s dtype.
    Linear in ``E`` and self-adjoint. ``keep`` is ``None`` for an empty ``X`` (no singular values)."""
    xp = array_namespace(U)
    E = xp.astype(E, U.dtype, copy=False)
    if keep is None:
        return xp.zeros_like(E)
    EV, UtE = E @ Vh.mT, U.mT @ E  # .mT: as in inverse_sqrt_derivative
    K = UtE @ Vh.mT
    kept_pairs = keep[..., :, None] * keep[..., None, :]
    # A cut pair's entry is 0 times anything finite: its denominator and 1 / s are taken as 1 there.
    sums = xp.where(kept_pairs > 0, S[..., :, None] + S[..., None, :], xp.ones_like(kept_pairs))
    Omega = kept_pairs * (K - K.mT) / sums
    inverse = keep / xp.where(keep > 0, S, xp.ones_like(S))  # S_k^{-1}, 0 for a cut value
    # With U_k^T E V = diag(keep) K and inverse 0 where keep is: the second term is
    # (EV - U diag(keep) K) diag(inverse) V^T, the third U diag(inverse) (U^T E - K diag(keep) V^T).
    # Gathered: six products (twelve as written above).
    C = Omega - keep[..., :, None] * K * inverse[..., None, :] - inverse[..., :, None] * K * keep[..., None, :]
    return U @ (C @ Vh + inverse[..., :, None] * UtE) + (EV * inverse[..., None, :]) @ Vh


def needs_derivative(A: Array) -> bool:
    """Whether a derivative of a matrix function of ``A`` may be asked for: ``A`` is a JAX array (any of its
    transformations may differentiate), or a torch tensor that requires grad with grad mode on, is
    inside a ``torch.func`` transform or carries a forward-mode tangent. Neither library is imported
    for this (``sys.modules``)."""
    jax = sys.modules.get("jax")
    if jax is not None and isinstance(A, jax.Array):
        return True
    torch = sys.modules.get("torch")
    if torch is None or not isinstance(A, torch.Tensor):
        return False
    if A.requires_grad and torch.is_grad_enabled():
        return True
    if torch.compiler.is_compiling():  # a compiled step differentiates through autograd (above) only
        return False
    return (torch._C._functorch.is_functorch_wrapped_tensor(A)  # torch.func's transforms
            or torch.autograd.forward_ad.unpack_dual(A).tangent is not None)


def rules(A: Array) -> Any:
    """The module of ``A``'s library that holds the rules (``_autodiff_jax`` or ``_autodiff_torch``, each with
    ``inverse_sqrt_by_eigh`` and ``polar_by_svd``), imported at first use: each imports its library. For
    ``A`` where `needs_derivative`."""
    jax = sys.modules.get("jax")
    if jax is not None and isinstance(A, jax.Array):
        from fismo_core import _autodiff_jax

        return _autodiff_jax
    from fismo_core import _autodiff_torch

    return _autodiff_torch
