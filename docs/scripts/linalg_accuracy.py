"""Measure the accuracy of ``fismo_core.linalg``'s matmul-only methods against the exact ones.

Reproduces the tables in ``docs/linalg.md``::

    python docs/scripts/linalg_accuracy.py            # worst case over the CPU backends, per dtype
    python docs/scripts/linalg_accuracy.py --per-backend

``inverse_sqrt``: for each condition number kappa, a batch of four 16 x 16 SPD
matrices ``A = V diag(w) V^T`` with ``w`` geometric from 1 down to ``1/kappa``
and Haar-random ``V`` (seeded). The reference ``A^{-1/2}`` is computed in NumPy
float64 by ``eigh`` from the input *as rounded to the dtype under test*, so the
errors measure the method, not the rounding of the input. Reported:

* ``NS vs eigh``: ``||NS - eigh||_F / ||eigh||_F`` with the default 30 steps,
  both computed on the backend in the dtype under test (worst matrix);
* ``NS vs ref`` and ``eigh vs ref``: each against the float64 reference;
* ``||XAX - I||``: ``||X A X - I||_F / sqrt(d)`` for the Newton–Schulz result;
* ``steps``: the fewest Newton–Schulz steps whose error against the reference
  is within a factor 2 of the 30-step error (worst over backends).

``polar``: for kappa in 1, 10, 100, 1e3, batches of 16 x 16, 8 x 24 and 24 x 8
matrices with geometric singular values, ``||NS - U V^T||_F / ||U V^T||_F``
for the Polar Express schedule with 8 steps (converged) and Muon with 5 steps
(not meant to converge).

Only CPU backends that are installed are measured (GPU targets are skipped).
"""

from __future__ import annotations

import argparse
import math
import warnings
from collections import defaultdict

import numpy as np

from fismo_core import linalg
from fismo_core.testing import targets, to_numpy

D = 16
BATCH = 4
INV_SQRT_KAPPAS = (1.0, 1e2, 1e4, 1e6, 1e8)
POLAR_KAPPAS = (1.0, 1e1, 1e2, 1e3)
POLAR_SHAPES = ((16, 16), (8, 24), (24, 8))
MAX_STEPS = 30


def haar(rng: np.random.Generator, n: int) -> np.ndarray:
    q, r = np.linalg.qr(rng.standard_normal((n, n)))
    return q * np.sign(np.diag(r))


def spd_batch(kappa: float, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    w = np.geomspace(1.0, 1.0 / kappa, D)
    mats = []
    for _ in range(BATCH):
        V = haar(rng, D)
        A = (V * w) @ V.T
        mats.append((A + A.T) / 2)
    return np.stack(mats)


def inverse_sqrt_reference(A: np.ndarray) -> np.ndarray:
    w, V = np.linalg.eigh(A)
    return (V / np.sqrt(w)[..., None, :]) @ np.swapaxes(V, -1, -2)


def rel(got: np.ndarray, ref: np.ndarray) -> float:
    """Worst ``||got - ref||_F / ||ref||_F`` over the batch."""
    return float(np.max(np.linalg.norm(got - ref, axis=(-2, -1)) / np.linalg.norm(ref, axis=(-2, -1))))


def measure_inverse_sqrt(target) -> dict:
    out = {}
    for kappa in INV_SQRT_KAPPAS:
        if target.dtype == "float32" and kappa > 1e6:
            continue  # eigenvalues below eps_32 * lambda_max do not survive rounding to float32
        A64 = spd_batch(kappa)
        A_rounded = A64.astype(target.dtype).astype(np.float64)
        ref = inverse_sqrt_reference(A_rounded)
        A = target.asarray(A64)
        eig = to_numpy(linalg.inverse_sqrt(A, method="eigh"))
        errs = []
        for k in range(1, MAX_STEPS + 1):
            errs.append(rel(to_numpy(linalg.inverse_sqrt(A, method="newton_schulz", steps=k)), ref))
        ns = to_numpy(linalg.inverse_sqrt(A, method="newton_schulz"))
        identity = np.eye(D)
        out[kappa] = {
            "kappa_F": float(np.max(np.linalg.norm(A_rounded, axis=(-2, -1)) / np.linalg.eigvalsh(A_rounded)[..., 0])),
            "ns_vs_eigh": rel(ns, eig),
            "ns_vs_ref": rel(ns, ref),
            "eigh_vs_ref": rel(eig, ref),
            "xax": float(np.max(np.linalg.norm(ns @ A_rounded @ ns - identity, axis=(-2, -1)) / math.sqrt(D))),
            "steps": next(k for k, e in enumerate(errs, 1) if e <= 2 * errs[-1]),
        }
    return out


def polar_batch(shape: tuple[int, int], kappa: float, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    m, n = shape
    r = min(m, n)
    s = np.geomspace(1.0, 1.0 / kappa, r)
    X, exact = [], []
    for _ in range(BATCH):
        U, V = haar(rng, m)[:, :r], haar(rng, n)[:, :r]
        X.append((U * s) @ V.T)
        exact.append(U @ V.T)
    return np.stack(X), np.stack(exact)


def measure_polar(target) -> dict:
    out = {}
    for kappa in POLAR_KAPPAS:
        worst = defaultdict(float)
        for shape in POLAR_SHAPES:
            X, exact = polar_batch(shape, kappa)
            Xb = target.asarray(X)
            for name, coefficients, steps in (("polar_express_8", "polar_express", 8), ("muon_5", "muon", 5)):
                got = to_numpy(linalg.polar(Xb, coefficients=coefficients, steps=steps))
                worst[name] = max(worst[name], rel(got, exact))
            worst["svd"] = max(worst["svd"], rel(to_numpy(linalg.polar(Xb, method="svd")), exact))
        out[kappa] = dict(worst)
    return out


def fmt_kappa(kappa: float) -> str:
    return "1" if kappa == 1 else f"1e{round(math.log10(kappa))}"


def fmt_sci(value: float) -> str:
    """1.5e2 rather than 1.5e+02; plain for values below 10."""
    if value < 10:
        return f"{value:.1f}"
    mantissa, exponent = f"{value:.1e}".split("e")
    return f"{mantissa}e{int(exponent)}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--per-backend", action="store_true", help="one row per backend instead of the worst case")
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    cpu = [t for t in targets() if t.available and t.device in ("cpu", "CPU_DEVICE")]
    print("backends:", ", ".join(t.id for t in cpu))

    inv = {t.id: (t, measure_inverse_sqrt(t)) for t in cpu}
    print("\n### inverse_sqrt: newton_schulz (30 steps) against eigh and the float64 reference\n")
    print("| dtype | κ | κ' = ‖A‖_F/λ_min | ‖NS − eigh‖_F / ‖eigh‖_F | NS vs reference | eigh vs reference | ‖X A X − I‖_F / √d (NS) | steps needed |")
    print("|---|---|---|---|---|---|---|---|")
    groups = [(t.id, [t.id]) for t in cpu] if args.per_backend else [
        (dtype, [t.id for t in cpu if t.dtype == dtype]) for dtype in ("float64", "float32")
    ]
    for label, ids in groups:
        for kappa in INV_SQRT_KAPPAS:
            rows = [inv[i][1][kappa] for i in ids if kappa in inv[i][1]]
            if not rows:
                print(f"| {label} | {fmt_kappa(kappa)} | — | not representable | | | | |")
                continue
            worst = {k: max(r[k] for r in rows) for k in rows[0]}
            print(
                f"| {label} | {fmt_kappa(kappa)} | {fmt_sci(worst['kappa_F'])} | {worst['ns_vs_eigh']:.1e} | {worst['ns_vs_ref']:.1e} "
                f"| {worst['eigh_vs_ref']:.1e} | {worst['xax']:.1e} | {worst['steps']} |"
            )

    pol = {t.id: measure_polar(t) for t in cpu}
    print("\n### polar: ‖result − U V^T‖_F / ‖U V^T‖_F\n")
    print("| dtype | κ | polar_express, 8 steps | muon, 5 steps | svd |")
    print("|---|---|---|---|---|")
    for label, ids in groups:
        for kappa in POLAR_KAPPAS:
            worst = {k: max(pol[i][kappa][k] for i in ids) for k in pol[ids[0]][kappa]}
            print(f"| {label} | {fmt_kappa(kappa)} | {worst['polar_express_8']:.1e} | {worst['muon_5']:.1e} | {worst['svd']:.1e} |")


if __name__ == "__main__":
    main()
