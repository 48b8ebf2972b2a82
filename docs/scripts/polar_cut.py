"""How soon the default cut of ``polar="svd"`` lets the whitening's rounding into FISMO's direction.

``FISMO(polar="svd")`` drops the singular values of ``M_t`` at or below
``PolarConfig.rtol`` (default ``max(m, n) * eps``) times the largest. On a
rank-deficient gradient stream the whitening ``P^{-1/2} G Q^{-1/2}`` puts
rounding errors of relative size about ``eps * kappa(P^{1/2}) kappa(Q^{1/2})``
into the null directions of ``M_t``; once they pass the cut, the polar factor
maps them to singular value 1 and the direction is no longer the minimum-norm
``U_r V_r^T`` of Theorem 2. For each stream (NumPy float64, ``eigh`` roots),
this prints the first step whose direction differs by more than 1e-6 from the
one with the cut at 1e-10 (which agrees with a 50-digit run of Algorithm 1 to
rounding), the ratio of the two directions' norms and their numerical ranks
there, the worst difference over the run, and the worst difference of the
matmul-only converging polar factor (Polar Express, 8 steps) from the same.

    python docs/scripts/polar_cut.py        # a few seconds
"""

from __future__ import annotations

import argparse

import numpy as np

from fismo_core import FISMO, PolarConfig

STEPS = 60


def streams(rng: np.random.Generator) -> dict[str, tuple[dict, list[np.ndarray]]]:
    """Name -> (FISMO keywords, gradients): rank-1 gradients of fixed row and column spaces (a linear layer
    fed one sample, say), and rank-2 gradients of new spaces each step."""
    defaults = {"lr": 0.02}
    out = {}
    for m, n in ((32, 24), (16, 16)):
        u, v = rng.standard_normal(m), rng.standard_normal(n)
        grads = [rng.standard_normal() * np.outer(u, v) for _ in range(STEPS)]
        out[f"rank 1, fixed spaces, {m}x{n}, default hyperparameters"] = (defaults, grads)
    grads = [rng.standard_normal((8, 2)) @ rng.standard_normal((2, 8)) for _ in range(STEPS)]
    out["rank 2, new spaces each step, 8x8, gamma = 0, beta = 0, mu = 0.01"] = (
        {"lr": 0.1, "beta": 0.0, "gamma": 0.0, "mu": 1e-2}, grads)
    return out


def rank(X: np.ndarray) -> int:
    s = np.linalg.svd(X, compute_uv=False)
    return int(np.sum(s > 1e-6 * s[0]))


def main() -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()  # --help; no options
    print("| stream | first step off by > 1e-6 | ||dW|| / ||dW at rtol 1e-10|| there | rank there (rtol 1e-10) | worst "
          "| Polar Express, 8 steps: worst |")
    print("|---|---|---|---|---|---|")
    for name, (options, grads) in streams(np.random.default_rng(0)).items():
        runs = [FISMO(polar="svd", **options), FISMO(polar=PolarConfig(method="svd", rtol=1e-10), **options),
                FISMO(polar={"coefficients": "polar_express", "steps": 8}, **options)]
        W = np.random.default_rng(1).standard_normal(grads[0].shape)
        states = [opt.init(W) for opt in runs]  # the polar factor changes no state: both runs keep equal ones
        first, worst, worst_express = None, 0.0, 0.0
        for t, G in enumerate(grads, 1):
            directions = []
            for i, opt in enumerate(runs):
                d, states[i] = opt.direction(G, states[i])
                directions.append(d)
            default, cut, express = directions
            err = float(np.linalg.norm(default - cut) / np.linalg.norm(cut))
            worst = max(worst, err)
            worst_express = max(worst_express, float(np.linalg.norm(express - cut) / np.linalg.norm(cut)))
            if first is None and err > 1e-6:
                first = (t, np.linalg.norm(default) / np.linalg.norm(cut), rank(default), rank(cut))
        if first is None:
            print(f"| {name} | none | | | {worst:.2g} | {worst_express:.2g} |")
        else:
            t, ratio, r_default, r_cut = first
            print(f"| {name} | {t} | {ratio:.1f} | {r_default} ({r_cut}) | {worst:.2g} | {worst_express:.2g} |")


if __name__ == "__main__":
    main()
