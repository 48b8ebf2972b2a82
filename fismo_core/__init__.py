"""fismo: the reference implementation of the FISMO optimizer.

FISMO (Fisher-Structured Momentum-Orthogonalized) is Algorithm 1 of Xu, Yan and
Zhang, "FISMO: Fisher-Structured Momentum-Orthogonalized Optimizer". This
package implements it once, against the Python array API standard, so it runs
unchanged on NumPy, CuPy, PyTorch, JAX and array-api-strict.

- `FISMO`, `FISMOState`: the optimizer as pure functions; `FISMO()` is
  Algorithm 1 as printed, `FISMO.training()` the configuration for training
  (`TRAINING`: scale-invariant statistics with Muon's conventions).
- `fismo_core.linalg`: the matrix functions (polar factor, inverse square
  root, trace normalisation), each with an exact and a matmul-only method.
- `fismo_core.kronecker`: the Kronecker factors ``P`` and ``Q`` (full, or
  block-diagonal with ``FISMO(block_size=B)``).
- `fismo_core.guards`: checks, non-finite policies and root fault handling
  around the algorithm.
- `fismo_core.backends`: adapters to frameworks' own protocols.
"""

from . import guards, kronecker, linalg
from .guards import FactorSizeWarning
from .kronecker import Blocks
from .optimizer import (
    FISMO,
    FISMOState,
    InverseRootConfig,
    InverseRootError,
    InverseRootWarning,
    PolarConfig,
    RootSchedule,
    StepLines,
    StepResult,
    TRAINING,
    state_dtype,
)

__version__ = "0.1.0"

__all__ = [
    "FISMO",
    "Blocks",
    "FISMOState",
    "FactorSizeWarning",
    "InverseRootConfig",
    "InverseRootError",
    "InverseRootWarning",
    "PolarConfig",
    "RootSchedule",
    "StepLines",
    "StepResult",
    "TRAINING",
    "__version__",
    "guards",
    "kronecker",
    "linalg",
    "state_dtype",
]
