"""``eigh`` for a compiled torch step whose inverse roots are checked: NaN where LAPACK fails, not an error.

Eagerly, `fismo_core.guards._checked_root` catches an ``eigh`` that raises
``torch.linalg.LinAlgError`` (LAPACK does not converge, as on a matrix of
NaN, which line 5 makes of ``Q_t`` from the NaN root of a singular ``P_t``) and marks that matrix's root failed, so that the float64 retry
and the fallback repair it. Inside a ``torch.compile`` graph nothing can
catch it: it escaped the compiled step as torch's error, naming no
parameter. This operator is that ``eigh`` as one opaque graph node: the
batched ``torch.linalg.eigh``, and where it raises, each matrix alone, with
NaN eigenvalues and eigenvectors for those that fail (as JAX's ``eigh``
gives). Their NaN roots then fail the check as an eager step's do. Where
nothing fails its values are ``torch.linalg.eigh``'s, bit for bit.

Imported by `fismo_core.guards` the first time a compiled torch step checks
a root: importing it registers ``torch.ops.fismo.eigh_nan_where_it_fails``.
"""

import math

import torch


@torch.library.custom_op("fismo::eigh_nan_where_it_fails", mutates_args=())
def eigh_nan_where_it_fails(A: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(w, V)`` of ``torch.linalg.eigh(A)`` for a stack ``A`` of symmetric matrices; NaN for those it fails on."""
    try:
        return torch.linalg.eigh(A)
    except torch.linalg.LinAlgError:
        pass
    d = A.shape[-1]
    spectra, bases = [], []
    for matrix in A.reshape(-1, d, d):
        try:
            w, V = torch.linalg.eigh(matrix)
        except torch.linalg.LinAlgError:
            w = torch.full((d,), math.nan, dtype=A.dtype, device=A.device)
            V = torch.full((d, d), math.nan, dtype=A.dtype, device=A.device)
        spectra.append(w)
        bases.append(V)
    # eigh's layout (each V column-major), which the graph was traced with (register_fake below)
    V = torch.stack(bases).reshape(A.shape).mT.contiguous().mT
    return torch.stack(spectra).reshape(A.shape[:-1]), V


@eigh_nan_where_it_fails.register_fake
def _(A: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.linalg.eigh(A)  # shapes, dtypes and strides: eigh's own meta function
