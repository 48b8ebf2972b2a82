"""Measurements behind ``docs/notes.md`` ("Notes on the algorithm").

Run from the repository root:

    python docs/scripts/notes_measurements.py

It prints the Markdown tables pasted into ``docs/notes.md``. Everything is
seeded and runs on NumPy float64 through the public ``fismo_core`` API
(``FISMO``, ``fismo_core.linalg``, ``fismo_core.testing.reference_gradients``);
the only code written here is the side computation of section (b), Algorithm 1
lines 4-5 with a choice of damping term, which is first checked against the
library. BLAS is pinned to one thread: small matrices run faster that way, and
the results do not depend on the machine's thread count.
"""

from __future__ import annotations

import argparse
import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import time  # noqa: E402

import numpy as np  # noqa: E402

from fismo_core import FISMO, linalg  # noqa: E402
from fismo_core.testing import reference_gradients  # noqa: E402

SHAPE = (32, 16)  # m x n
STEPS = 200
SEED = 0
SIGMAS = (1e-4, 1e-3, 1e-2, 1e-1, 1.0, 10.0)


# ---------------------------------------------------------------- helpers
def gradients(sigma: float, steps: int = STEPS, seed: int = SEED) -> list[np.ndarray]:
    """The seeded anisotropic gradients of ``fismo verify`` (row and column scales
    spread 0.3 to 3, a drifting rank-2 signal plus noise), rescaled so that the
    root mean square of the entries over the whole sequence is exactly ``sigma``."""
    raw = reference_gradients(SHAPE, steps, seed=seed)
    rms = float(np.sqrt(np.mean(np.square(raw))))
    return [sigma * g / rms for g in raw]


def rel(a: np.ndarray, b: np.ndarray) -> float:
    """||a - b||_F / ||b||_F."""
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def cond(a: np.ndarray) -> float:
    w = np.linalg.eigvalsh(a)
    return float(w[-1] / w[0])


def fmt(x: float) -> str:
    return f"{x:.2e}" if (x != 0 and (abs(x) < 1e-2 or abs(x) >= 1e4)) else f"{x:.3g}"


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---:" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def preconditioner_update(P, Q, Q_is, G, gamma, mu, damping):
    """Algorithm 1 lines 4-5 in NumPy, with the damping term of the algorithm
    (``mu tr(P_{t-1})/m``, ``mu tr(Q_{t-1})/n``) or of Theorem 1
    (``mu tr(Q_{t-1}^{-1})/n`` for P, ``mu tr(P_t^{-1})/m`` for Q).
    Inverses are squares of the inverse square roots, as in the library."""
    m, n = G.shape
    GQ = G @ Q_is
    if damping == "algorithm":
        dP = mu * np.trace(P) / m
    else:
        dP = mu * np.sum(Q_is * Q_is) / n  # tr(Q^{-1}) = ||Q^{-1/2}||_F^2
    L = GQ @ GQ.T / n + dP * np.eye(m)
    P_new = linalg.sym(linalg.trace_normalize(gamma * P + (1 - gamma) * L))
    P_is = linalg.inverse_sqrt(P_new)
    PG = P_is @ G
    if damping == "algorithm":
        dQ = mu * np.trace(Q) / n
    else:
        dQ = mu * np.sum(P_is * P_is) / m  # tr(P_t^{-1})
    R = PG.T @ PG / m + dQ * np.eye(n)
    Q_new = linalg.sym(linalg.trace_normalize(gamma * Q + (1 - gamma) * R))
    return P_new, P_is, Q_new, linalg.inverse_sqrt(Q_new)


# ------------------------------------------------------ (a) scale sensitivity
def section_a() -> None:
    m, n = SHAPE
    fismo, muon = FISMO(), FISMO(gamma=1.0)
    g, mu = fismo.gamma, fismo.mu
    print(f"## (a) Scale sensitivity: {STEPS} steps, shape {m}x{n}, FISMO() defaults "
          f"(gamma={g}, mu={mu}), Muon = FISMO(gamma=1)\n")
    rows = []
    for sigma in SIGMAS:
        Gs = gradients(sigma)
        s_f, s_m = fismo.init(Gs[0]), muon.init(Gs[0])
        for G in Gs:
            d_f, s_f = fismo.direction(G, s_f)
            d_m, s_m = muon.direction(G, s_m)
        # Effective EMA weight of the old P in one step (Q ~ I): gamma / (gamma + (1-gamma)(sigma^2 + mu)).
        g_eff = g / (g + (1 - g) * (sigma**2 + mu))
        cos = float(np.sum(d_f * d_m) / (np.linalg.norm(d_f) * np.linalg.norm(d_m)))
        rows.append([
            f"{sigma:g}",
            fmt(np.linalg.norm(s_f.P - np.eye(m)) / np.sqrt(m)),
            fmt(np.linalg.norm(s_f.Q - np.eye(n)) / np.sqrt(n)),
            fmt(cond(s_f.P)),
            fmt(cond(s_f.Q)),
            fmt(rel(d_f, d_m)),
            f"{cos:.4f}",
            f"{np.linalg.norm(d_f) / np.linalg.norm(d_m):.4g}",
            f"{g_eff:.6f}" if g_eff > 0.99 else f"{g_eff:.3f}",
        ])
    print(table(["sigma", "‖P−I‖/√m", "‖Q−I‖/√n", "cond(P)", "cond(Q)",
                 "‖d_F − d_M‖/‖d_M‖", "cos(d_F, d_M)", "‖d_F‖/‖d_M‖", "gamma_eff"], rows))
    print()

    # Longer horizons: how far P gets from I, and the steady state it heads for.
    horizons = (200, 2000, 10000)
    print("### (a2) ‖P−I‖/√m after T steps (same gradients, FISMO() defaults)\n")
    rows = []
    for sigma in (1e-2, 1e-1, 1.0):
        Gs = gradients(sigma, steps=max(horizons))
        s = fismo.init(Gs[0])
        out = {}
        for t, G in enumerate(Gs, 1):
            _, s = fismo.direction(G, s)
            if t in horizons:
                out[t] = (np.linalg.norm(s.P - np.eye(m)) / np.sqrt(m), cond(s.P))
        tau = g / ((1 - g) * (sigma**2 + mu))
        rows.append([f"{sigma:g}", f"{tau:.0f}"]
                    + [f"{fmt(out[t][0])} (cond {fmt(out[t][1])})" for t in horizons])
    print(table(["sigma", "time constant (steps)"] + [f"T = {t}" for t in horizons], rows))
    print()


# -------------------------------------------------------------- (b) damping
def section_b() -> None:
    m, n = SHAPE
    fismo = FISMO()
    g, mu = fismo.gamma, fismo.mu
    print("## (b) Damping: algorithm (mu tr(P_{t-1})/m I) vs Theorem 1 (mu tr(Q^{-1})/n I)\n")

    # tr(P_t) = m and tr(Q_t) = n at every step, so the algorithm's damping is mu I.
    rows = []
    for sigma in SIGMAS:
        Gs = gradients(sigma)
        s = fismo.init(Gs[0])
        dp = dq = 0.0
        for G in Gs:
            _, s = fismo.direction(G, s)
            dp = max(dp, abs(np.trace(s.P) / m - 1))
            dq = max(dq, abs(np.trace(s.Q) / n - 1))
        rows.append([f"{sigma:g}", fmt(dp), fmt(dq)])
    print(f"### (b1) Largest abs(tr(P_t)/m − 1) and abs(tr(Q_t)/n − 1) over {STEPS} steps\n")
    print(table(["sigma", "max abs(tr(P_t)/m − 1)", "max abs(tr(Q_t)/n − 1)"], rows))
    print()

    for sigma, mu_ in ((1.0, mu), (0.1, mu), (1.0, 0.1)):
        opt = FISMO(mu=mu_)
        Gs = gradients(sigma)
        s = opt.init(Gs[0])
        alg = (s.P, s.P_inv_sqrt, s.Q, s.Q_inv_sqrt)
        thm = alg
        check = 0.0
        rows = []
        for t, G in enumerate(Gs, 1):
            prev = s
            _, s = opt.direction(G, s)
            # Side computation 1: the same lines 4-5, algorithm damping: must equal the library.
            alg = preconditioner_update(alg[0], alg[2], alg[3], G, g, mu_, "algorithm")
            check = max(check, rel(alg[0], s.P), rel(alg[2], s.Q))
            # Side computation 2: one step with Theorem 1's damping from the library's state t-1.
            one = preconditioner_update(prev.P, prev.Q, prev.Q_inv_sqrt, G, g, mu_, "theorem")
            # Side computation 3: a whole trajectory with Theorem 1's damping.
            thm = preconditioner_update(thm[0], thm[2], thm[3], G, g, mu_, "theorem")
            if t in (1, 10, 50, 100, 200):
                rows.append([
                    str(t),
                    f"{np.sum(prev.Q_inv_sqrt ** 2) / n:.4f}",
                    f"{np.sum(s.P_inv_sqrt ** 2) / m:.4f}",
                    fmt(rel(one[0], s.P)),
                    fmt(rel(thm[0], s.P)),
                    fmt(rel(thm[2], s.Q)),
                ])
        print(f"### (b2) sigma = {sigma:g}, mu = {mu_:g}, gamma = {g} "
              f"(side computation with algorithm damping vs library: max rel. diff {check:.1e})\n")
        print(table(["t", "tr(Q_{t-1}⁻¹)/n", "tr(P_t⁻¹)/m", "P: one step",
                     "P: trajectory", "Q: trajectory"], rows))
        print()


# --------------------------------------------------- (c) gamma = 0 is Theorem 1
def section_c() -> None:
    m, n = SHAPE
    print("## (c) gamma = 0: line 4 is P*(Q_{t-1}) of Theorem 1, line 5 is Q*(P_t)\n")
    rows = []
    for sigma in (1e-2, 1.0):
        opt = FISMO(gamma=0.0)
        mu = opt.mu
        Gs = gradients(sigma)
        s = opt.init(Gs[0])
        worst = {"P_alg": 0.0, "Q_alg": 0.0, "P_thm": 0.0, "Q_thm": 0.0, "trQ": 0.0, "trP": 0.0, "cP": 0.0}
        for G in Gs:
            prev = s
            _, s = opt.direction(G, s)
            Q_inv = prev.Q_inv_sqrt @ prev.Q_inv_sqrt
            P_inv = s.P_inv_sqrt @ s.P_inv_sqrt
            # Theorem 1 with a single sample: E[G Q^{-1} G^T] -> G Q^{-1} G^T.
            data_P = G @ Q_inv @ G.T / n
            data_Q = G.T @ P_inv @ G / m
            P_thm = data_P + mu * np.trace(Q_inv) / n * np.eye(m)
            Q_thm = data_Q + mu * np.trace(P_inv) / m * np.eye(n)
            P_alg = data_P + mu * np.eye(m)  # the algorithm's damping, mu tr(P_{t-1})/m = mu
            Q_alg = data_Q + mu * np.eye(n)
            worst["trQ"] = max(worst["trQ"], np.trace(Q_inv) / n)
            worst["trP"] = max(worst["trP"], np.trace(P_inv) / m)
            worst["cP"] = max(worst["cP"], cond(s.P))
            tn = linalg.trace_normalize
            worst["P_alg"] = max(worst["P_alg"], rel(s.P, tn(P_alg)))
            worst["Q_alg"] = max(worst["Q_alg"], rel(s.Q, tn(Q_alg)))
            worst["P_thm"] = max(worst["P_thm"], rel(s.P, tn(P_thm)))
            worst["Q_thm"] = max(worst["Q_thm"], rel(s.Q, tn(Q_thm)))
        rows.append([f"{sigma:g}"] + [fmt(worst[k]) for k in ("P_alg", "Q_alg", "P_thm", "Q_thm", "trQ", "trP", "cP")])
    print(f"Largest relative difference over {STEPS} steps of FISMO(gamma=0)'s P_t, Q_t from the "
          "trace-normalised single-sample minimisers of Theorem 1\n")
    print(table(["sigma", "P vs P*, damping mu I", "Q vs Q*, damping mu I",
                 "P vs P*, damping of Thm 1", "Q vs Q*, damping of Thm 1",
                 "max tr(Q_{t-1}⁻¹)/n", "max tr(P_t⁻¹)/m", "max cond(P_t)"], rows))
    print()


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()  # --help; anything else refused
    start = time.perf_counter()
    section_a()
    section_b()
    section_c()
    print(f"(total {time.perf_counter() - start:.1f} s)")
