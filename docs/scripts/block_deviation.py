"""How far blocked FISMO's direction is from full FISMO's along a real gradient stream (the
documentation page "Performance", section "Blocking and the direction").

1. Record a real gradient stream: a GPT-style byte-level model (``fismo_core.demo.models.TinyGPT``,
   ``dim = 192``: a GPT-2-small layer at a quarter of its width, so its matrices are
   576 x 192, 192 x 192, 768 x 192 and 192 x 768, GPT-2's 2304 x 768, 768 x 768, 3072 x 768 and
   768 x 3072 divided by 4) trains for ``--steps`` steps with AdamW on the Python standard
   library's source; the gradients of the four matrices of its first layer are kept at every step.
2. Feed the same stream to full FISMO and to blocked FISMO with ``B`` = 64, 128, 192 and 256 (a
   quarter of 256, 512, 768 and 1024, so every matrix is split into the same number of blocks as
   its GPT-2 twin), and to Muon's direction (``Polar(M_t)``, no preconditioning) as a yardstick,
   all in float64, so that the differences are the algorithms' and not rounding; and, for scale,
   full FISMO with the polar factor's iteration in bfloat16 (``PolarConfig(dtype="bfloat16")``).
   Both statistics of lines 4-5 are run: ``"printed"`` (Algorithm 1, the default), with which
   ``P`` and ``Q`` hardly leave the identity at this gradient scale (entries of RMS about 1e-3;
   see the page "Notes on the algorithm"), and ``"scale_invariant"``, with which they do.
3. Report, per matrix and ``B``, the relative deviation of the direction,
   ``||dW_t(B) - dW_t(full)||_F / ||dW_t(full)||_F``, over the steps (median, max, and the median
   of the last 50 steps, where a drift would show), and plot it against the step.

    python docs/scripts/block_deviation.py              # 200 steps (52 minutes on 2 cores at load 10)
    python docs/scripts/block_deviation.py --steps 50   # quicker

Open loop: every optimizer sees the gradients of the AdamW run, so the deviation is that of the
direction for the same input, not of two training runs (that is the Results page's question).
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
PLOT = ROOT / "docs" / "performance" / "block_deviation.png"

#: Block sizes of the stand-in, and the GPT-2-scale block sizes they stand for (x 4).
BLOCKS = [64, 128, 192, 256]
#: The first layer's matrices of the stand-in: name -> (the module's attribute, GPT-2 twin's shape).
MATRICES = {
    "attn": ("attn", "2304×768"),
    "proj": ("proj", "768×768"),
    "fc": ("fc", "3072×768"),
    "fc_out": ("fc_out", "768×3072"),
}


def record_gradients(steps: int, seed: int = 0) -> dict[str, list[np.ndarray]]:
    """The gradients of the first layer's four matrices along ``steps`` AdamW steps of TinyGPT."""
    import torch

    from fismo_core.demo.data import load_stdlib_corpus
    from fismo_core.demo.models import TinyGPT

    torch.manual_seed(seed)
    context, batch = 64, 16
    corpus = load_stdlib_corpus(2_000_000, 1)
    text = corpus.train.long()
    model = TinyGPT(dim=192, layers=2, heads=4, context=context)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    gen = torch.Generator().manual_seed(seed)
    layer = model.blocks[0]
    grads: dict[str, list[np.ndarray]] = {name: [] for name in MATRICES}
    losses = []
    for _ in range(steps):
        starts = torch.randint(0, len(text) - context - 1, (batch,), generator=gen)
        idx = torch.stack([text[s : s + context + 1] for s in starts.tolist()])
        x, y = idx[:, :-1], idx[:, 1:]
        loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        for name, (attr, _) in MATRICES.items():
            grads[name].append(getattr(layer, attr).weight.grad.double().numpy().copy())
        opt.step()
        losses.append(loss.item())
    print(f"<!-- recorded {steps} steps of TinyGPT(dim=192) with AdamW: loss {losses[0]:.2f} -> "
          f"{statistics.mean(losses[-10:]):.2f} (mean of the last 10) -->")
    return grads


STATISTICS = ["printed", "scale_invariant"]


def directions(stream: list[np.ndarray], block_size, statistics: str, polar_dtype=None) -> list[np.ndarray]:
    """FISMO's direction dW_t along the stream (torch float64, exact roots; ``polar_dtype``: the
    Newton-Schulz iteration's dtype, ``PolarConfig(dtype=...)``)."""
    import torch

    from fismo_core import FISMO

    polar = {"dtype": polar_dtype} if polar_dtype else {}
    opt = FISMO(nonfinite="propagate", block_size=block_size, statistics=statistics, polar=polar)
    state = opt.init(torch.zeros(stream[0].shape, dtype=torch.float64))
    out = []
    for G in stream:
        d, state = opt.direction(torch.from_numpy(G), state)
        out.append(d.numpy())
    return out


def muon_directions(stream: list[np.ndarray]) -> list[np.ndarray]:
    """Muon's direction along the stream: FISMO with gamma = 1 (P = Q = I), i.e. Polar(M_t)."""
    import torch

    from fismo_core import FISMO

    opt = FISMO(gamma=1.0, nonfinite="propagate")
    state = opt.init(torch.zeros(stream[0].shape, dtype=torch.float64))
    out = []
    for G in stream:
        d, state = opt.direction(torch.from_numpy(G), state)
        out.append(d.numpy())
    return out


def relative(a: list[np.ndarray], ref: list[np.ndarray]) -> np.ndarray:
    return np.array([np.linalg.norm(x - r) / np.linalg.norm(r) for x, r in zip(a, ref)])


def main() -> None:
    from _arguments import positive_int  # docs/scripts/, on sys.path when the script runs

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=positive_int, default=200)
    parser.add_argument("--threads", type=positive_int, help="torch.set_num_threads (default: torch's choice)")
    parser.add_argument("--no-plot", action="store_true")
    args = parser.parse_args()
    import torch

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    started = time.time()
    grads = record_gradients(args.steps)
    rms = {name: statistics.median(float(np.sqrt(np.mean(G**2))) for G in stream) for name, stream in grads.items()}
    print("<!-- median RMS of the gradient entries: " + ", ".join(f"{k} {v:.1e}" for k, v in rms.items()) + " -->\n")
    curves: dict[str, dict[str, dict[str, np.ndarray]]] = {}
    late = max(1, min(50, args.steps // 4))
    muon = {name: muon_directions(stream) for name, stream in grads.items()}
    for stats in STATISTICS:
        print(f"**statistics = \"{stats}\"**\n")
        print("| matrix (GPT-2 twin) | B (GPT-2 twin) | blocks of P, Q | deviation: median | max | median, last "
              f"{late} steps |")
        print("|---|---|---|---|---|---|")
        curves[stats] = {}
        for name, (_, twin) in MATRICES.items():
            stream = grads[name]
            m, n = stream[0].shape
            full = directions(stream, None, stats)
            curves[stats][name] = {}
            rows = [(f"{B} ({4 * B})", B) for B in BLOCKS] + [("full, bf16 polar", "bf16"), ("Muon's direction", "muon")]
            for label, B in rows:
                if B == "muon":
                    got = muon[name]
                elif B == "bf16":
                    got = directions(stream, None, stats, "bfloat16")
                else:
                    got = directions(stream, B, stats)
                dev = relative(got, full)
                curves[stats][name][label] = dev
                blocks = "—" if isinstance(B, str) else f"{math.ceil(m / B)}, {math.ceil(n / B)}"
                print(f"| {m}×{n} ({twin}) | {label} | {blocks} | {np.median(dev):.2g} | {dev.max():.2g} "
                      f"| {np.median(dev[-late:]):.2g} |")
        print()
    print(f"<!-- {time.time() - started:.0f} s, torch {torch.__version__}, {torch.get_num_threads()} threads -->")
    if not args.no_plot:
        plot(curves, grads)


def plot(curves: dict, grads: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(curves), len(MATRICES), figsize=(4 * len(MATRICES), 3.2 * len(curves)),
                             sharey=True, squeeze=False)
    for row, (stats, by_matrix) in zip(axes, curves.items()):
        for ax, (name, by_label) in zip(row, by_matrix.items()):
            m, n = grads[name][0].shape
            for label, dev in by_label.items():
                style = {"color": "black", "ls": "--"} if label.startswith("Muon") else {}
                if label.startswith("full"):
                    style = {"color": "gray", "ls": ":"}
                ax.plot(np.arange(1, len(dev) + 1), dev, lw=1, **style,
                        label=label if label[0].isalpha() else f"B = {label}")
            ax.set_yscale("log")
            ax.set_title(f"{name}: {m}×{n} (GPT-2: {MATRICES[name][1]}), {stats}", fontsize=8)
            ax.grid(True, which="both", alpha=0.3)
        row[0].set_ylabel("‖dW(B) − dW(full)‖ / ‖dW(full)‖", fontsize=8)
    for ax in axes[-1]:
        ax.set_xlabel("step")
    axes[0][-1].legend(fontsize=7)
    fig.suptitle("Blocked against full FISMO along a recorded gradient stream (float64)", fontsize=10)
    fig.tight_layout()
    PLOT.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(PLOT, dpi=110)
    print(f"<!-- plot written to {PLOT.relative_to(ROOT)} -->")


if __name__ == "__main__":
    main()
