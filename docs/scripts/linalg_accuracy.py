"""Measure the accuracy of ``fismo_core.linalg``'s matmul-only methods against the exact ones.

Reproduces the tables in ``docs/linalg.md``::

    python docs/scripts/linalg_accuracy.py            # worst case over the CPU backends, per dtype
    python docs/scripts/linalg_accuracy.py --per-backend

``inverse_sqrt``: for each condition number kappa, a batch of four 16 x 16 SPD
matrices ``A = V diag(w) V^T`` with ``w`` geometric from 1 down to ``1/kappa``
and Haar-random ``V`` (seeded). The reference ``A^{-1/2}`` is computed in NumPy
float64 by ``eigh`` from the input *as rounded to the dtype under test*, so the
errors measure the method, not the rounding of the input. Three methods per
kappa: ``eigh``, and ``newton_schulz`` with each convergent schedule,
``"polar_express"`` and ``"cubic"``. Each schedule runs its default step count
(9 and 22) up to kappa = 1e6; at kappa = 1e8, beyond the range of the defaults,
it runs the count of the docstring's table for kappa' = 1e8 (12 and 28).
Reported, per method (worst matrix):

* ``vs eigh``: ``||X - eigh||_F / ||eigh||_F``, both computed on the backend
  in the dtype under test;
* ``vs reference``: ``||X - ref||_F / ||ref||_F`` against the float64 reference;
* ``||XAX - I||``: ``||X A X - I||_F / sqrt(d)``, with ``A`` as rounded;
* ``steps needed``: the fewest steps whose error against the reference is
  within a factor 2 of the error after ``CONVERGED_STEPS`` steps (worst over
  backends).

Below the table: the worst error divided by ``eps`` (kappa = 1) and by
``eps * kappa'`` (kappa >= 1e2) over every backend and method, and, for
float32 at kappa = 1e8 (not representable), each method's error against the
``A^{-1/2}`` of the unrounded float64 matrix.

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
SCHEDULES = ("polar_express", "cubic")
#: Steps at kappa = 1e8, where the defaults (enough up to kappa' = 1e6) are not: the
#: docstring's table for kappa' = 1e8.
STEPS_AT_1E8 = {"polar_express": 12, "cubic": 28}
#: The error after this many steps counts as converged (for "steps needed").
CONVERGED_STEPS = {"polar_express": 20, "cubic": 40}
EPS = {"float64": 2.0**-52, "float32": 2.0**-23}
POLAR_KAPPAS = (1.0, 1e1, 1e2, 1e3)
POLAR_SHAPES = ((16, 16), (8, 24), (24, 8))


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


def steps_used(name: str, kappa: float) -> int:
    return linalg.inverse_sqrt_steps(name) if kappa <= 1e6 else STEPS_AT_1E8[name]


def measure_inverse_sqrt(target) -> dict:
    """``{kappa: {"kappa_F": ..., method: {"vs_eigh", "vs_ref", "xax", "steps"}}}``.

    ``check=False`` throughout: float32 at kappa = 1e6 and 1e8 is below the input checks' cut
    (docs/linalg.md, "Input checks"), and this script measures what the methods return there.
    """
    out = {}
    identity = np.eye(D)
    for kappa in INV_SQRT_KAPPAS:
        if target.dtype == "float32" and kappa > 1e6:
            continue  # eigenvalues below eps_32 * lambda_max do not survive rounding to float32
        A64 = spd_batch(kappa)
        A_rounded = A64.astype(target.dtype).astype(np.float64)
        ref = inverse_sqrt_reference(A_rounded)
        A = target.asarray(A64)
        eig = to_numpy(linalg.inverse_sqrt(A, method="eigh", check=False))
        row = {
            "kappa_F": float(np.max(np.linalg.norm(A_rounded, axis=(-2, -1)) / np.linalg.eigvalsh(A_rounded)[..., 0])),
        }
        results = {"eigh": (eig, None)}
        for name in SCHEDULES:
            errs = [
                rel(to_numpy(linalg.inverse_sqrt(A, method="newton_schulz", coefficients=name, steps=k, check=False)), ref)
                for k in range(1, CONVERGED_STEPS[name] + 1)
            ]
            X = to_numpy(linalg.inverse_sqrt(A, method="newton_schulz", coefficients=name, steps=steps_used(name, kappa), check=False))
            results[name] = (X, next(k for k, e in enumerate(errs, 1) if e <= 2 * errs[-1]))
        for method, (X, needed) in results.items():
            row[method] = {
                "vs_eigh": rel(X, eig),
                "vs_ref": rel(X, ref),
                "xax": float(np.max(np.linalg.norm(X @ A_rounded @ X - identity, axis=(-2, -1)) / math.sqrt(D))),
                "needed": needed,
            }
        out[kappa] = row
    return out


def measure_unrepresentable(target) -> dict:
    """float32, kappa = 1e8: each method's error against A^{-1/2} of the unrounded float64 A."""
    A64 = spd_batch(INV_SQRT_KAPPAS[-1])
    ref = inverse_sqrt_reference(A64)
    A = target.asarray(A64)
    out = {"eigh": rel(to_numpy(linalg.inverse_sqrt(A, method="eigh", check=False)), ref)}
    for name in SCHEDULES:
        X = linalg.inverse_sqrt(A, method="newton_schulz", coefficients=name, steps=STEPS_AT_1E8[name], check=False)
        out[name] = rel(to_numpy(X), ref)
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


def fmt_err(value: float) -> str:
    """NaN and inf as words, so a failure is visible in the table."""
    return f"{value:.1e}" if math.isfinite(value) else str(value)


def worst(values):
    """Largest value; NaN wins, so a failure is never hidden by a finite one."""
    values = list(values)
    return math.nan if any(math.isnan(v) for v in values) else max(values)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--per-backend", action="store_true", help="one row per backend instead of the worst case")
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    cpu = [t for t in targets() if t.available and t.device in ("cpu", "CPU_DEVICE")]
    print("backends:", ", ".join(t.id for t in cpu))
    groups = [(t.id, [t.id]) for t in cpu] if args.per_backend else [
        (dtype, [t.id for t in cpu if t.dtype == dtype]) for dtype in ("float64", "float32")
    ]
    dtype_of = {t.id: t.dtype for t in cpu}

    inv = {t.id: measure_inverse_sqrt(t) for t in cpu}
    print(
        "\n### inverse_sqrt: eigh and newton_schulz (polar_express, cubic) against the float64 reference\n"
    )
    print("| dtype | κ | κ' = ‖A‖_F/λ_min | method | steps | vs eigh | vs reference | ‖X A X − I‖_F / √d | steps needed |")
    print("|---|---|---|---|---|---|---|---|---|")
    for label, ids in groups:
        for kappa in INV_SQRT_KAPPAS:
            rows = [inv[i][kappa] for i in ids if kappa in inv[i]]
            if not rows:
                print(f"| {label} | {fmt_kappa(kappa)} | — | not representable | | | | | |")
                continue
            kappa_f = fmt_sci(max(r["kappa_F"] for r in rows))
            for method in ("eigh",) + SCHEDULES:
                w = {k: worst(r[method][k] for r in rows) for k in ("vs_eigh", "vs_ref", "xax")}
                if method == "eigh":
                    steps, vs_eigh, needed = "—", "—", "—"
                else:
                    steps = str(steps_used(method, kappa)) + ("*" if kappa > 1e6 else "")
                    vs_eigh, needed = fmt_err(w["vs_eigh"]), str(max(r[method]["needed"] for r in rows))
                print(
                    f"| {label} | {fmt_kappa(kappa)} | {kappa_f} | `{method}` | {steps} | {vs_eigh} "
                    f"| {fmt_err(w['vs_ref'])} | {fmt_err(w['xax'])} | {needed} |"
                )
    print(
        f"\n\\* κ = 1e8 is beyond the range of the default step counts; these rows use "
        f"{STEPS_AT_1E8['polar_express']} (polar_express) and {STEPS_AT_1E8['cubic']} (cubic) steps."
    )
    print(
        f"Steps needed: the fewest steps within a factor 2 of the error after "
        f"{CONVERGED_STEPS['polar_express']} (polar_express) or {CONVERGED_STEPS['cubic']} (cubic) steps."
    )

    # Every error as a multiple of eps (kappa = 1) and of eps * kappa' (kappa >= 1e2), over all runs.
    at_one, above = defaultdict(float), defaultdict(float)
    for i, per_kappa in inv.items():
        eps = EPS[dtype_of[i]]
        for kappa, row in per_kappa.items():
            for method in ("eigh",) + SCHEDULES:
                for key in ("vs_eigh", "vs_ref", "xax"):
                    if method == "eigh" and key == "vs_eigh":
                        continue
                    if kappa == 1:
                        at_one[method] = max(at_one[method], row[method][key] / eps)
                    else:
                        above[method] = max(above[method], row[method][key] / (eps * row["kappa_F"]))
    print("\nworst error / eps at κ = 1, and / (eps κ') at κ ≥ 1e2, over every backend and column:")
    for method in ("eigh",) + SCHEDULES:
        print(f"  {method}: {at_one[method]:.2g} eps; {above[method]:.2g} eps κ'")

    f32 = [t for t in cpu if t.dtype == "float32"]
    if f32:
        print("\nfloat32, κ = 1e8 (not representable): error against A^{-1/2} of the unrounded float64 A")
        for t in f32:
            errs = measure_unrepresentable(t)
            print(f"  {t.id}: " + ", ".join(f"{m} {fmt_err(e)}" for m, e in errs.items()))

    pol = {t.id: measure_polar(t) for t in cpu}
    print("\n### polar: ‖result − U V^T‖_F / ‖U V^T‖_F\n")
    print("| dtype | κ | polar_express, 8 steps | muon, 5 steps | svd |")
    print("|---|---|---|---|---|")
    for label, ids in groups:
        for kappa in POLAR_KAPPAS:
            worst_pol = {k: max(pol[i][kappa][k] for i in ids) for k in pol[ids[0]][kappa]}
            print(
                f"| {label} | {fmt_kappa(kappa)} | {worst_pol['polar_express_8']:.1e} "
                f"| {worst_pol['muon_5']:.1e} | {worst_pol['svd']:.1e} |"
            )


if __name__ == "__main__":
    main()
