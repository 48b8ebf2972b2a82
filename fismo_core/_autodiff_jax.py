"""JAX's rule for the derivative of the exact inverse square root (`fismo_core._autodiff`): a ``custom_jvp``.

JAX transposes the rule's tangent, which is linear in ``dA``, for reverse
mode, and differentiates the rule itself for a second derivative.
"""

from __future__ import annotations

from typing import Any

import jax

from fismo_core._autodiff import inverse_sqrt_derivative, inverse_sqrt_divided_differences
from fismo_core.linalg import _eigh_root_parts

Array = Any


@jax.custom_jvp
def inverse_sqrt_by_eigh(A: Array) -> tuple[Array, Array]:
    """``(A^{-1/2}, w)`` by ``eigh``, bit for bit ``_eigh_root_parts``, with the Daleckii–Krein derivative."""
    Z, w, _ = _eigh_root_parts(A)
    return Z, w


@inverse_sqrt_by_eigh.defjvp
def _jvp(primals: tuple, tangents: tuple) -> tuple:
    (A,), (dA,) = primals, tangents
    Z, w, V = _eigh_root_parts(A)
    dZ, dw = inverse_sqrt_derivative(V, inverse_sqrt_divided_differences(w), dA)
    return (Z, w), (dZ.astype(Z.dtype), dw)
