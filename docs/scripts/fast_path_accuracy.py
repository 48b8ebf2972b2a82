"""Accuracy of FISMO's shortcuts against the exact path, along a 1,000-step trajectory.

Measures the tables of the documentation page "Performance" (sections "The fast path" and
"Amortised roots"):

* Newton–Schulz inverse roots (Polar Express, 9 steps) against ``eigh``: at every step, the
  relative error of the Newton–Schulz run's ``P_t^{-1/2}``, ``Q_t^{-1/2}`` against ``eigh`` of
  the same ``P_t``, ``Q_t`` (the per-step error: a drift would show as growth), and the relative
  difference of the two runs' ``P_t``, ``Q_t`` and directions ``dW_t`` (the trajectory error);
* ``InverseRootConfig(every=k)`` against ``every=1``: the relative difference of the directions.

Both runs see the same gradients, ``fismo_core.testing.reference_gradients`` (the sequence of
``fismo verify``): row and column scales spread over a factor of 10 and a drifting low-rank
signal plus noise, so that ``P_t`` and ``Q_t`` move well away from the identity. The gradients
do not depend on ``W``: the runs differ only by their arithmetic. A window after the first 100
steps (while ``P`` and ``Q`` leave the identity) is compared with the last 100 steps: a drift
would show as growth.

    python docs/scripts/fast_path_accuracy.py                # the tables (6 min 16 s on 2 busy cores, 2026-12-02)
    python docs/scripts/fast_path_accuracy.py --steps 200    # quicker
"""

from __future__ import annotations

import argparse

import numpy as np

from fismo_core import FISMO
from fismo_core.testing import reference_gradients, targets, to_numpy


def rel(a: np.ndarray, b: np.ndarray) -> float:
    """max over the batch of ||a - b||_F / ||b||_F."""
    return float(np.max(np.linalg.norm(a - b, axis=(-2, -1)) / np.linalg.norm(b, axis=(-2, -1))))


def inverse_sqrt64(A: np.ndarray) -> np.ndarray:
    w, V = np.linalg.eigh(A.astype(np.float64))
    return (V / np.sqrt(w)[..., None, :]) @ np.swapaxes(V, -1, -2)


def trajectories(target, shape, steps: int, optimizers: dict):
    """Run every optimizer of ``optimizers`` on the same gradients; yield per step
    ``{name: (direction, state)}`` (directions as NumPy float64)."""
    W0 = target.asarray(np.zeros(shape))
    states = {name: opt.init(W0) for name, opt in optimizers.items()}
    for G64 in reference_gradients(shape, steps):
        G = target.asarray(G64)
        out = {}
        for name, opt in optimizers.items():
            direction, states[name] = opt.direction(G, states[name])
            out[name] = (to_numpy(direction), states[name])
        yield out


def newton_schulz_errors(target, shape, steps: int) -> dict:
    """Per-step errors of the Newton–Schulz run (see the module docstring), as arrays over t."""
    runs = {
        "eigh": FISMO(nonfinite="propagate"),
        "ns": FISMO(nonfinite="propagate", inv_root="newton_schulz"),
    }
    names = ("root P", "root Q", "P", "Q", "direction")
    errors = {k: [] for k in names}
    for out in trajectories(target, shape, steps, runs):
        (d_e, s_e), (d_n, s_n) = out["eigh"], out["ns"]
        P, Q = to_numpy(s_n.P), to_numpy(s_n.Q)
        errors["root P"].append(rel(to_numpy(s_n.P_inv_sqrt), inverse_sqrt64(P)))
        errors["root Q"].append(rel(to_numpy(s_n.Q_inv_sqrt), inverse_sqrt64(Q)))
        errors["P"].append(rel(P, to_numpy(s_e.P)))
        errors["Q"].append(rel(Q, to_numpy(s_e.Q)))
        errors["direction"].append(rel(d_n, d_e))
    result = {k: np.array(v) for k, v in errors.items()}
    result["cond"] = (float(np.max(np.linalg.cond(P))), float(np.max(np.linalg.cond(Q))))
    return result


def amortisation_errors(target, shape, steps: int, every: tuple[int, ...]) -> dict:
    """Per-step relative difference of the directions with ``every=k`` and ``every=1``."""
    runs = {1: FISMO(nonfinite="propagate")}
    runs.update({k: FISMO(nonfinite="propagate", inv_root={"every": k}) for k in every})
    errors = {k: [] for k in every}
    for out in trajectories(target, shape, steps, runs):
        exact = out[1][0]
        for k in every:
            errors[k].append(rel(out[k][0], exact))
    return {k: np.array(v) for k, v in errors.items()}


def cpu_target(backend: str, dtype: str):
    """The available CPU target of ``backend`` and ``dtype``, or None."""
    return next((t for t in targets() if t.id == f"{backend}-cpu-{dtype}" and t.available), None)


def more_than_100(text: str) -> int:
    """``--steps``: above 100, since the table compares steps 100-199 with the last 100 (50 raised
    ``ValueError: zero-size array`` after the whole computation; a user's hunt, 2026-12-04)."""
    from _arguments import positive_int  # docs/scripts/, on sys.path when the script runs

    value = positive_int(text)
    if value <= 100:
        raise argparse.ArgumentTypeError(f"must be above 100 (the table compares steps 100-199 with the last 100), got {value}")
    return value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=more_than_100, default=1000,
                        help="steps of each trajectory, above 100 (the table compares steps 100-199 with the last 100)")
    args = parser.parse_args()
    shapes = [(64, 96), (96, 64)]
    print(f"## Newton–Schulz roots (Polar Express, 9 steps) against eigh, {args.steps} steps\n")
    print("| backend | dtype | shape | cond P, Q (last) | root P^-1/2 | root Q^-1/2 | P_t | Q_t | direction | "
          "direction, steps 100-199 / last 100 |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for backend, dtype in [("numpy", "float64"), ("torch", "float64"), ("numpy", "float32"), ("torch", "float32")]:
        target = cpu_target(backend, dtype)
        if target is None:
            continue
        for shape in shapes:
            e = newton_schulz_errors(target, shape, args.steps)
            early, last = e["direction"][100:200].max(), e["direction"][-100:].max()
            print(f"| {backend} | {dtype} | {shape[0]}×{shape[1]} | {e['cond'][0]:.0f}, {e['cond'][1]:.0f} "
                  f"| {e['root P'].max():.1e} | {e['root Q'].max():.1e} | {e['P'].max():.1e} | {e['Q'].max():.1e} "
                  f"| {e['direction'].max():.1e} | {early:.1e} / {last:.1e} |")
    every = (2, 5, 10, 20)
    print(f"\n## Amortised roots: ||dW(every=k) - dW(every=1)||_F / ||dW(every=1)||_F, {args.steps} steps\n")
    print("| backend | dtype | shape | " + " | ".join(f"k = {k}: median, max" for k in every) + " |")
    print("|---|---|---|" + "---|" * len(every))
    target = cpu_target("numpy", "float64")
    for shape in shapes:
        e = amortisation_errors(target, shape, args.steps, every)
        cells = " | ".join(f"{np.median(e[k]):.1e}, {e[k].max():.1e}" for k in every)
        print(f"| numpy | float64 | {shape[0]}×{shape[1]} | {cells} |")


if __name__ == "__main__":
    main()
