"""torch's rules for the derivatives of the exact matrix functions (`fismo_core._autodiff`).

For each, two ``autograd.Function``s: one with a forward-mode rule (``jvp``:
``torch.func.jvp``, ``torch.autograd.forward_ad``, ``torch.func.hessian``)
for eager code, and one without for compiled code, since dynamo traces an
``autograd.Function`` without a graph break only when it defines no
``jvp``.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch._C._functorch import TransformType
from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters

from fismo_core._autodiff import inverse_sqrt_derivative, inverse_sqrt_divided_differences, polar_svd_derivative
from fismo_core.linalg import _eigh_root_parts, _svd_polar_parts


class InverseSqrtByEigh(torch.autograd.Function):
    """``(A^{-1/2}, w, V)`` by ``eigh`` (``V`` not differentiable), with the Daleckii–Krein derivative."""

    generate_vmap_rule = True  # torch.func.vmap of the step, and of its gradient (jacrev, hessian)

    @staticmethod
    def forward(A: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return _eigh_root_parts(A)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
        (A,) = inputs
        _, w, V = output
        ctx.mark_non_differentiable(V)
        ctx.save_for_backward(A, w, V)
        ctx.save_for_forward(A, w, V)
        ctx.set_materialize_grads(False)  # an unused w (the optimizer reads it in its checks only) costs nothing

    @staticmethod
    def backward(ctx: Any, grad_Z: Optional[torch.Tensor], grad_w: Optional[torch.Tensor], _: Any) -> torch.Tensor:
        A, w, V = ctx.saved_tensors
        if torch.is_grad_enabled():
            # A graph of this gradient is being built (create_graph=True, torch.func): w and V again, from
            # an eigh autograd follows, so that the second derivative is torch's own, as JAX's is.
            _, w, V = _eigh_root_parts(A)
        grad_A = torch.zeros_like(V)
        if grad_Z is not None:
            grad_A, _ = inverse_sqrt_derivative(V, inverse_sqrt_divided_differences(w), grad_Z)
        if grad_w is not None:
            grad_A = grad_A + (V * grad_w[..., None, :]) @ V.mT
        return grad_A.to(A.dtype)


class InverseSqrtByEighForwardMode(InverseSqrtByEigh):
    """`InverseSqrtByEigh` with the forward-mode rule."""

    @staticmethod
    def jvp(ctx: Any, dA: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        A, w, V = ctx.saved_tensors
        if _differentiated(A):
            _, w, V = _eigh_root_parts(A)  # as in backward: an outer transform follows the vectors' dependence on A
        dZ, dw = inverse_sqrt_derivative(V, inverse_sqrt_divided_differences(w), dA)
        return dZ.to(A.dtype), dw, None


def inverse_sqrt_by_eigh(A: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(A^{-1/2}, w)`` by ``eigh``, bit for bit ``_eigh_root_parts``, with the Daleckii–Krein derivative."""
    rule = InverseSqrtByEigh if torch.compiler.is_compiling() else InverseSqrtByEighForwardMode
    Z, w, _ = rule.apply(A)
    return Z, w


class PolarBySVD(torch.autograd.Function):
    """``(Q, U, S, Vh, keep, s)`` of ``_svd_polar_parts`` (all but ``Q`` not differentiable), with the
    kept-rank derivative of ``Q = polar(X, method="svd", rtol=rtol)`` (`fismo_core._autodiff`)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(X: torch.Tensor, rtol: Optional[float]) -> tuple[Optional[torch.Tensor], ...]:
        return _svd_polar_parts(X, rtol)  # keep and s are tensors: polar_by_svd takes no empty X

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
        X, ctx.rtol = inputs
        ctx.mark_non_differentiable(*output[1:])
        ctx.save_for_backward(X, *output[1:])
        ctx.save_for_forward(X, *output[1:])

    @staticmethod
    def backward(ctx: Any, grad_Q: torch.Tensor, *_: Any) -> tuple[torch.Tensor, None]:
        X, *parts = ctx.saved_tensors
        if torch.is_grad_enabled():
            # A graph of this gradient is being built (create_graph=True, torch.func): the SVD again, one
            # autograd follows, so that the second derivative is torch's own.
            parts = list(_svd_polar_parts(X, ctx.rtol)[1:])
        return _polar_derivative(X, parts, grad_Q), None


class PolarBySVDForwardMode(PolarBySVD):
    """`PolarBySVD` with the forward-mode rule."""

    @staticmethod
    def jvp(ctx: Any, dX: torch.Tensor, _: Any) -> tuple[Optional[torch.Tensor], ...]:
        X, *parts = ctx.saved_tensors
        if _differentiated(X):
            parts = list(_svd_polar_parts(X, ctx.rtol)[1:])  # as in backward
        return (_polar_derivative(X, parts, dX), None, None, None, None, None)


def _differentiated(A: torch.Tensor) -> bool:
    """Whether a forward-mode rule's result is itself differentiated in reverse (``jacrev(jacfwd(f))``, a
    tangent taken back by ``autograd.grad``): then its decomposition is taken again, from ``A``, where the
    saved one is marked non-differentiable and an outer derivative took it as constant (wrong by 1.3 to 1.6
    relative at distinct eigenvalues until 2026-12-04; a user's hunt). Asked of autograd (``A`` requires
    grad) and of torch.func's stack of transforms (a ``grad`` transform outside this forward-mode one; the
    transforms inside it are set aside while the rule runs), so that forward mode alone (``jacfwd``,
    ``torch.func.jvp``, ``hessian``) decomposes once."""
    if A.requires_grad and torch.is_grad_enabled():
        return True
    return any(interpreter.key() == TransformType.Grad for interpreter in retrieve_all_functorch_interpreters())


def _polar_derivative(X: torch.Tensor, parts: list, E: torch.Tensor) -> torch.Tensor:
    U, S, Vh, keep, s = parts
    return polar_svd_derivative(U, S, Vh, keep, E / s / s).to(X.dtype)  # Q(X) = Q(X / s / s)


def polar_by_svd(X: torch.Tensor, rtol: Optional[float]) -> torch.Tensor:
    """``polar(X, method="svd", rtol=rtol)``, bit for bit ``_svd_polar_parts``, with the kept-rank derivative
    (an empty ``X``, which has no singular values, as it is)."""
    if 0 in X.shape[-2:]:
        return _svd_polar_parts(X, rtol)[0]
    rule = PolarBySVD if torch.compiler.is_compiling() else PolarBySVDForwardMode
    return rule.apply(X, rtol)[0]
