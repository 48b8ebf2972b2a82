"""``fismo verify``: FISMO on every installed backend, device and dtype, against NumPy float64.

For each shape of `fismo_core.testing.VERIFY_SHAPES` a seeded 50-step
trajectory runs on the reference (NumPy, float64) and on every available
target. The error of a target is the worst, over steps and shapes, of the
relative Frobenius errors of ``W_t - W_0``, ``P_t``, ``Q_t``, ``M_t`` and the
cached roots ``P_t^{-1/2}``, ``Q_t^{-1/2}``. A target that raises is a failure.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import Optional, TextIO

from .optimizer import FISMO
from .testing import (
    VERIFY_SHAPES,
    Target,
    max_relative_error,
    pin_full_float32_matmuls,
    reference_gradients,
    run_trajectory,
    targets,
    to_numpy,
)

__all__ = ["VerifyResult", "verify", "main"]


@dataclass(frozen=True)
class VerifyResult:
    """The outcome for one target: ``error`` is ``None`` when it was skipped."""

    target: Target
    steps: int
    error: Optional[float]
    exception: Optional[str] = None

    @property
    def passed(self) -> Optional[bool]:
        return None if self.error is None else self.error <= self.target.tolerance


def _trajectory_errors(optimizer: FISMO, target: Target, steps: int, seed: int) -> float:
    import numpy as np

    worst = 0.0
    for k, shape in enumerate(VERIFY_SHAPES):
        gradients = reference_gradients(shape, steps, seed=seed + k)
        W0 = np.random.default_rng(seed + 1000 + k).standard_normal(shape)
        reference = run_trajectory(optimizer, W0, gradients, lambda a: np.asarray(a, dtype=np.float64))
        candidate = run_trajectory(optimizer, W0, gradients, target.asarray)
        for (W_ref, s_ref), (W, s) in zip(reference, candidate):
            worst = max(
                worst,
                max_relative_error(to_numpy(W) - W0, W_ref - W0),
                max_relative_error(s.P, s_ref.P),
                max_relative_error(s.Q, s_ref.Q),
                max_relative_error(s.M, s_ref.M),
                max_relative_error(s.P_inv_sqrt, s_ref.P_inv_sqrt),
                max_relative_error(s.Q_inv_sqrt, s_ref.Q_inv_sqrt),
            )
    return worst


def verify(*, steps: int = 50, seed: int = 0, optimizer: Optional[FISMO] = None) -> list[VerifyResult]:
    """Run the verification trajectory on every target; unavailable ones come back with ``error=None``."""
    try:
        import numpy  # noqa: F401
    except ImportError as exc:
        raise RuntimeError("fismo verify needs NumPy, the reference backend: pip install 'fismo[numpy]'") from exc
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be a positive integer, got {steps!r}")
    optimizer = optimizer or FISMO()
    pin_full_float32_matmuls()
    results = []
    for target in targets():
        if not target.available:
            results.append(VerifyResult(target, steps, None))
            continue
        try:
            error = _trajectory_errors(optimizer, target, steps, seed)
        except Exception as exc:  # a backend that crashes is a failure of that row, not of the run
            results.append(VerifyResult(target, steps, math.inf, f"{type(exc).__name__}: {exc}"))
        else:
            results.append(VerifyResult(target, steps, error))
    return results


def format_table(results: list[VerifyResult]) -> str:
    """The results as a fixed-width text table."""
    header = ("backend", "device", "dtype", "steps", "max rel. error", "tolerance", "result")
    rows = []
    for r in results:
        t = r.target
        if r.error is None:
            rows.append((t.backend, t.device, t.dtype, "-", "-", f"{t.tolerance:.0e}", f"skipped: {t.reason}"))
        else:
            verdict = "pass" if r.passed else ("FAIL" if r.exception is None else f"FAIL ({r.exception})")
            rows.append((t.backend, t.device, t.dtype, str(r.steps), f"{r.error:.2e}", f"{t.tolerance:.0e}", verdict))
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header) - 1)]
    lines = []
    for row in [header, *rows]:
        lines.append("  ".join(cell.ljust(w) for cell, w in zip(row, widths)) + "  " + row[-1])
        if row is header:
            lines.append("  ".join("-" * w for w in widths) + "  " + "-" * len(header[-1]))
    return "\n".join(lines)


def main(*, steps: int = 50, seed: int = 0, out: Optional[TextIO] = None) -> int:
    """Print the verification table to ``out`` (standard output); return 0 if every available target passed, 1 otherwise."""
    out = sys.stdout if out is None else out
    results = verify(steps=steps, seed=seed)
    print(f"FISMO verification: {steps}-step seeded trajectories on shapes "
          f"{', '.join('x'.join(map(str, s)) for s in VERIFY_SHAPES)}, against NumPy float64\n", file=out)
    print(format_table(results), file=out)
    ran = [r for r in results if r.error is not None]
    failed = [r for r in ran if not r.passed]
    print(f"\n{len(ran) - len(failed)} passed, {len(failed)} failed, {len(results) - len(ran)} skipped", file=out)
    return 1 if failed or not ran else 0
