"""JAX's rules for the derivatives of the exact matrix functions (`fismo_core._autodiff`): ``custom_jvp``s.

JAX transposes the rule's tangent, which is linear in ``dA``, for reverse
mode, and differentiates the rule itself for a second derivative.
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import jax

from fismo_core._autodiff import inverse_sqrt_derivative, inverse_sqrt_divided_differences, polar_svd_derivative
from fismo_core.linalg import _eigh_root_parts, _svd_polar_parts

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


@functools.partial(jax.custom_jvp, nondiff_argnums=(1,))
def polar_by_svd(X: Array, rtol: Optional[float]) -> Array:
    """``polar(X, method="svd", rtol=rtol)``, bit for bit ``_svd_polar_parts``, with the kept-rank derivative."""
    return _svd_polar_parts(X, rtol)[0]


@polar_by_svd.defjvp
def _polar_jvp(rtol: Optional[float], primals: tuple, tangents: tuple) -> tuple:
    (X,), (dX,) = primals, tangents
    Q, U, S, Vh, keep, s = _svd_polar_parts(X, rtol)
    if s is not None:  # Q(X) = Q(X / s / s): dX as X was divided
        dX = dX / s / s
    return Q, polar_svd_derivative(U, S, Vh, keep, dX).astype(Q.dtype)
