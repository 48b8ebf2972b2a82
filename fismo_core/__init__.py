"""fismo: the reference implementation of the FISMO optimizer.

FISMO (Fisher-Structured Momentum-Orthogonalized) is Algorithm 1 of Xu, Yan and
Zhang, "FISMO: Fisher-Structured Momentum-Orthogonalized Optimizer". This
package implements it once, against the Python array API standard, so it runs
unchanged on NumPy, CuPy, PyTorch, JAX and array-api-strict.

- `FISMO`, `FISMOState`: the optimizer as pure functions.
- `fismo_core.linalg`: the matrix functions (polar factor, inverse square
  root, trace normalisation), each with an exact and a matmul-only method.
- `fismo_core.backends`: adapters to frameworks' own protocols.
"""

from . import linalg
from .optimizer import FISMO, FISMOState, InverseRootConfig, InverseRootError, InverseRootWarning, PolarConfig, state_dtype

__version__ = "0.1.0"

__all__ = ["FISMO", "FISMOState", "InverseRootConfig", "InverseRootError", "InverseRootWarning", "PolarConfig", "__version__", "linalg", "state_dtype"]
