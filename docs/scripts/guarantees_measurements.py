"""The measured figures of the documentation page "Guarantees and failure modes".

Run from the repository root:

    python docs/scripts/guarantees_measurements.py                  # every section (a few minutes)
    python docs/scripts/guarantees_measurements.py --only stable    # one section: degenerate, retry, long, stable, roots

Sections:

* ``degenerate``: float32 (and float64) against NumPy float64 on the degenerate inputs of
  ``tests/test_reliability.py::test_degenerate_gradients_give_finite_sensible_steps`` (the
  test's own cases), worst relative error over ``W_t - W_0``, the directions, ``P`` and ``Q``;
* ``retry``: a float32 ``eigh`` that raises or returns NaN, retried in float64, against the
  fault-free float32 run (``test_failed_float32_root_is_recomputed_in_float64``);
* ``long``: 10,000 NumPy float32 steps of ``test_ten_thousand_float32_steps_stay_sane``, the
  largest trace deviation ``|tr P - m| / m``, ``|tr Q - n| / n`` (every 10 steps);
* ``stable``: the table "The stable range": the largest condition number of ``P_t``, ``Q_t``
  over 200 steps of Gaussian noise gradients of scale ``sigma`` (``np.random.default_rng(0)``),
  ``FISMO()`` defaults, NumPy float64, with the first step that fell back and the step that
  raised ``InverseRootError``; the same in float32;
* ``roots``: the residuals ``||Z A Z - I||_F`` of the inverse roots along the runs of
  ``stable`` (without the fallback, so that every root is seen), for ``eigh`` and the cubic
  Newton–Schulz iteration with 30 steps, NumPy and torch, float64 and float32; a root is
  correct when its residual is at most ``InverseRootConfig().tolerance`` (0.1). Reported: the
  largest ratio residual / kappa of a correct root, the largest residual of a correct root
  (with its kappa), and the residuals of the roots that fail.

Everything is seeded and runs on one BLAS and torch thread. The first two sections use the
tests' own set-ups (``tests/test_reliability.py``), so they need the ``test`` extra (pytest,
hypothesis); the others need NumPy (and torch for ``roots``). Rounding-level figures and the
steps of the unstable runs depend on the CPU kernels (OpenBLAS and torch pick them per CPU);
run it under ``OPENBLAS_CORETYPE=Haswell``, ``SkylakeX`` or ``Sandybridge`` and
``ATEN_CPU_CAPABILITY=avx2`` or ``avx512`` to see the spread.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))

from fismo_core import FISMO  # noqa: E402
from fismo_core.optimizer import InverseRootError, InverseRootWarning  # noqa: E402
from fismo_core.testing import max_relative_error, reference_gradients, targets  # noqa: E402

SHAPES = ((8, 12), (8, 8), (12, 8))
SIGMAS = (1, 3, 10, 30, 100)
STEPS = 200


def _one_thread() -> None:
    from threadpoolctl import threadpool_limits

    threadpool_limits(1)
    try:
        import torch
    except ImportError:
        return
    torch.set_num_threads(1)


def _cpu(dtype: str) -> list:
    return [t for t in targets() if t.available and t.device in ("cpu", "CPU_DEVICE") and t.dtype == dtype]


def degenerate() -> None:
    import test_reliability as tr

    print("## Degenerate input: worst relative error against NumPy float64 (W_t - W_0, directions, P, Q)\n")
    print("| case | " + " | ".join(t.id for t in _cpu("float32") + _cpu("float64")) + " |")
    print("|---|" + "---|" * len(_cpu("float32") + _cpu("float64")))
    for case, grads in tr.DEGENERATE.items():
        W0 = np.random.default_rng(4).standard_normal(grads[0].shape)
        W_ref, s_ref, d_ref = tr._run(FISMO(), targets()[0], W0, grads)
        cells = []
        for t in _cpu("float32") + _cpu("float64"):
            W, s, d = tr._run(FISMO(), t, W0, grads)
            errors = [max_relative_error(W - W0, W_ref - W0)] + [max_relative_error(a, b) for a, b in zip(d, d_ref)]
            errors += [max_relative_error(getattr(s, f), getattr(s_ref, f)) for f in ("P", "Q")]
            cells.append(f"{max(errors):.1e}")
        print(f"| {case} | " + " | ".join(cells) + " |")
    print()


def retry() -> None:
    from _pytest.monkeypatch import MonkeyPatch

    import test_reliability as tr

    print("## A float32 eigh that fails, retried in float64: worst relative error against the fault-free run\n")
    for fault in ("raise", "nan"):
        for t in _cpu("float32"):
            xp = t.xp
            grads = reference_gradients((2, 4, 6), 3, seed=12)
            W0 = np.random.default_rng(13).standard_normal((2, 4, 6))
            W_ref, s_ref, _ = tr._run(FISMO(), t, W0, grads)
            patch = MonkeyPatch()
            tr._patch_eigh(patch, xp, fault, when=lambda A: xp.full(A.shape[:-2], A.dtype == xp.float32, dtype=xp.bool))
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("error", InverseRootWarning)
                    W, s, _ = tr._run(FISMO(), t, W0, grads)
            finally:
                patch.undo()
            errors = [max_relative_error(W - W0, W_ref - W0)]
            errors += [max_relative_error(getattr(s, f), getattr(s_ref, f)) for f in ("P", "Q")]
            print(f"- {t.id}, eigh {'raises' if fault == 'raise' else 'returns NaN'}: {max(errors):.1e}")
    print()


def long_run() -> None:
    print("## 10,000 NumPy float32 steps, 8 x 12: largest |tr P - m| / m, |tr Q - n| / n (every 10 steps)\n")
    m, n = 8, 12
    for c in (1e-3, 3.0):
        rng = np.random.default_rng(18)
        W_star = rng.standard_normal((m, n)).astype(np.float32)
        opt = FISMO()
        W = np.zeros((m, n), np.float32)
        state = opt.init(W)
        worst = 0.0
        for t in range(10_000):
            G = (c * ((W - W_star) + rng.standard_normal((m, n)))).astype(np.float32)
            W, state = opt.step(W, G, state)
            if t % 10 == 9 or t == 0:
                for A, d in ((state.P, m), (state.Q, n)):
                    worst = max(worst, abs(float(np.trace(A, dtype=np.float64)) - d) / d)
        print(f"- scale {c:g}: {worst:.1e}")
    print()


def _noise_run(shape: tuple[int, int], sigma: float, dtype: str) -> tuple[float, int | None, int | None]:
    """Largest cond(P_t), cond(Q_t), first step that fell back, step that raised (None: none)."""
    rng = np.random.default_rng(0)
    opt = FISMO()
    W = np.zeros(shape, dtype=dtype)
    state = opt.init(W)
    largest, fell_back, raised = 1.0, None, None
    for t in range(1, STEPS + 1):
        G = (sigma * rng.standard_normal(shape)).astype(dtype)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", InverseRootWarning)
            try:
                W, state = opt.step(W, G, state)
            except InverseRootError:
                raised = t
                break
        if fell_back is None and any(issubclass(w.category, InverseRootWarning) for w in caught):
            fell_back = t
        for A in (state.P, state.Q):
            w = np.linalg.eigvalsh(np.asarray(A, dtype=np.float64))
            largest = max(largest, w[-1] / w[0] if w[0] > 0 else np.inf)
    return largest, fell_back, raised


def stable() -> None:
    print(f"## The stable range: largest cond(P_t), cond(Q_t) over {STEPS} steps of Gaussian noise of scale sigma\n")
    for dtype in ("float64", "float32"):
        print(f"{dtype}:\n")
        print("| shape | " + " | ".join(f"sigma = {s:g}" for s in SIGMAS) + " |")
        print("|---|" + "---|" * len(SIGMAS))
        for shape in SHAPES:
            cells = []
            for sigma in SIGMAS:
                largest, fell_back, raised = _noise_run(shape, sigma, dtype)
                cell = f"{largest:.1e}"
                if fell_back:
                    cell += f": fallback from step {fell_back}"
                if raised:
                    cell += f", error at {raised}"
                cells.append(cell)
            print(f"| {shape[0]}x{shape[1]} | " + " | ".join(cells) + " |")
        print()


def roots() -> None:
    import torch

    from fismo_core import InverseRootConfig

    tolerance = InverseRootConfig().tolerance
    methods = {"eigh": {"method": "eigh"}, "cubic, 30 steps": {"method": "newton_schulz", "coefficients": "cubic", "steps": 30}}
    backends = {"numpy": lambda a: a, "torch": torch.as_tensor}
    print(f"## Inverse-root residuals ||Z A Z - I||_F along the runs of the stable range (NumPy and torch, "
          f"fallback off), against the tolerance {tolerance}\n")
    for dtype in ("float64", "float32"):
        for name, config in methods.items():
            opt = FISMO(inv_root={**config, "fallback": False})
            passed, failed, nan = [], [], 0
            for to in backends.values():
                for shape in SHAPES:
                    for sigma in SIGMAS:
                        rng = np.random.default_rng(0)
                        W = to(np.zeros(shape, dtype=dtype))
                        state = opt.init(W)
                        for _ in range(STEPS):
                            G = to((sigma * rng.standard_normal(shape)).astype(dtype))
                            try:
                                W, state = opt.step(W, G, state)
                            except Exception:  # eigh of non-finite input, or a NaN W: the run is over
                                break
                            pairs = [(np.asarray(A, dtype=np.float64), np.asarray(Z, dtype=np.float64))
                                     for A, Z in ((state.P, state.P_inv_sqrt), (state.Q, state.Q_inv_sqrt))]
                            if not all(np.isfinite(A).all() and np.isfinite(Z).all() for A, Z in pairs):
                                nan += 1
                                break
                            for A, Z in pairs:
                                w = np.linalg.eigvalsh(A)
                                kappa = w[-1] / w[0] if w[0] > 0 else np.inf
                                residual = float(np.linalg.norm(Z @ A @ Z - np.eye(A.shape[0])))
                                (passed if residual <= tolerance else failed).append((residual, kappa))
            worst = max(passed, key=lambda rk: rk[0] / rk[1])
            largest = max(passed)
            line = (f"- {dtype}, {name}: {len(passed)} roots within the tolerance, residual / kappa at most "
                    f"{worst[0] / worst[1]:.1e}, largest residual {largest[0]:.3f} (kappa {largest[1]:.1e}); "
                    f"{len(failed)} above it")
            if failed:
                first = min(failed, key=lambda rk: rk[1])
                line += (f" (residuals {min(failed)[0]:.2f} to {max(failed)[0]:.3g}, the first at kappa "
                         f"{first[1]:.1e}: residual {first[0]:.2f})")
            print(line + f"; {nan} runs ended in NaN")
    print()


SECTIONS = {"degenerate": degenerate, "retry": retry, "long": long_run, "stable": stable, "roots": roots}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=sorted(SECTIONS), action="append", help="run only this section (repeatable)")
    args = parser.parse_args()
    _one_thread()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for name in args.only or SECTIONS:
            SECTIONS[name]()


if __name__ == "__main__":
    main()
