"""torch's rule for the derivative of the exact inverse square root (`fismo_core._autodiff`).

Two ``autograd.Function``s: one with a forward-mode rule (``jvp``:
``torch.func.jvp``, ``torch.autograd.forward_ad``, ``torch.func.hessian``)
for eager code, and one without for compiled code, since dynamo traces an
``autograd.Function`` without a graph break only when it defines no
``jvp``.
"""

from __future__ import annotations

from typing import Any

import torch

from fismo_core._autodiff import inverse_sqrt_derivative, inverse_sqrt_divided_differences
from fismo_core.linalg import _eigh_root_parts


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

    @staticmethod
    def backward(ctx: Any, grad_Z: torch.Tensor, grad_w: torch.Tensor, _: Any) -> torch.Tensor:
        A, w, V = ctx.saved_tensors
        if torch.is_grad_enabled():
            # A graph of this gradient is being built (create_graph=True, torch.func): w and V again, from
            # an eigh autograd follows, so that the second derivative is torch's own, as JAX's is.
            _, w, V = _eigh_root_parts(A)
        grad_A, _ = inverse_sqrt_derivative(V, inverse_sqrt_divided_differences(w), grad_Z)
        grad_A = grad_A + (V * grad_w[..., None, :]) @ V.mT
        return grad_A.to(A.dtype)


class InverseSqrtByEighForwardMode(InverseSqrtByEigh):
    """`InverseSqrtByEigh` with the forward-mode rule."""

    @staticmethod
    def jvp(ctx: Any, dA: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        A, w, V = ctx.saved_tensors
        dZ, dw = inverse_sqrt_derivative(V, inverse_sqrt_divided_differences(w), dA)
        return dZ.to(A.dtype), dw, None


def inverse_sqrt_by_eigh(A: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(A^{-1/2}, w)`` by ``eigh``, bit for bit ``_eigh_root_parts``, with the Daleckii–Krein derivative."""
    rule = InverseSqrtByEigh if torch.compiler.is_compiling() else InverseSqrtByEighForwardMode
    Z, w, _ = rule.apply(A)
    return Z, w
