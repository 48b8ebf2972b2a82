"""Record the real gradient streams of `fismo verify` from the demo's two tasks.

    python -m fismo_core.data.record_gradients            # rewrites fismo_core/data/gradients.npz
    python -m fismo_core.data.record_gradients --check    # records again and compares with the shipped file

Needs the ``demo`` extra (torch, scikit-learn). Each task trains a small
version of its demo model with AdamW (seed 0, one torch thread, CPU) for
``WARMUP`` steps, past the transient of the initialisation, then records
``STEPS`` consecutive steps: the value of each chosen weight at the start of
the recording (``W_0``) and its gradient at every step (``G_t``), in the
float32 the model trains in. Matrices of the same role in the GPT's two
blocks are stacked, so those streams are batches of two matrices.

The streams (name: shape, source):

- ``digits.head`` ``(10, 32)``: the classifier head of the digits CNN. The
  rows of a softmax cross-entropy head gradient sum to zero
  (``1^T G = 0``), so ``G`` and the momentum ``M`` have rank at most 9 < 10:
  the rank-deficient case where exact polar factors need a convention.
- ``digits.conv2`` ``(16, 72)``: the second convolution's kernel as a matrix
  ``(out, in * 3 * 3)``.
- ``gpt.attn`` ``(2, 48, 16)``: the query-key-value projections of the byte
  GPT's two blocks (nearly rank-deficient: their input is a LayerNorm output,
  orthogonal to the all-ones vector up to the learned LayerNorm gains).
- ``gpt.proj`` ``(2, 16, 16)``: the attention output projections (square).
- ``gpt.fc_out`` ``(2, 16, 64)``: the MLP output matrices.

``gpt.proj`` and ``gpt.fc_out`` write into the residual stream, which is only
ever read through LayerNorms; a LayerNorm ignores a shift along the all-ones
vector, so their gradients also satisfy ``1^T G = 0`` (rank at most 15 < 16).
The recording prints ``sigma_min / sigma_max`` of every gradient: about
``1e-8`` (float32 rounding) for the head, ``proj`` and ``fc_out``.

The file is small (float32, compressed: about 0.3 MB) and is package data;
reading it needs only NumPy.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path
from typing import Any

import numpy as np

from . import GRADIENTS_FILE

WARMUP = 20
"""AdamW steps before the recording starts."""
STEPS = 16
"""Consecutive steps recorded per stream."""
LR = 3e-3
"""AdamW learning rate of the recording runs (the demo's AdamW grids span 1e-3 to 1e-2)."""
FORMAT = 1
CHECK_RTOL = 1e-3
"""Largest difference `--check` accepts, relative to each array's largest entry. The recording is float32
training, whose rounding follows the CPU's kernels: with torch's AVX-512 kernels (those it was recorded with)
the file is reproduced exactly, with its AVX2 kernels to 1.7e-6 and with its default (unvectorised) ones to
6.7e-5 (2026-12-04, an AMD EPYC with AVX-512, ``ATEN_CPU_CAPABILITY``); a recording of another seed, step or model
differs by O(1)."""

#: stream name -> (task, parameter names stacked into one stream)
STREAMS: dict[str, tuple[str, tuple[str, ...]]] = {
    "digits.head": ("digits", ("head.weight",)),
    "digits.conv2": ("digits", ("conv2.weight",)),
    "gpt.attn": ("text", ("blocks.0.attn.weight", "blocks.1.attn.weight")),
    "gpt.proj": ("text", ("blocks.0.proj.weight", "blocks.1.proj.weight")),
    "gpt.fc_out": ("text", ("blocks.0.fc_out.weight", "blocks.1.fc_out.weight")),
}


def _tasks() -> dict[str, Any]:
    from fismo_core.demo.tasks import DigitsTask, TextTask

    return {
        "digits": DigitsTask(batch_size=64, channels=(8, 16), hidden=32),
        "text": TextTask(batch_size=16, context=32, dim=16, layers=2, heads=2, max_train_bytes=300_000, max_val_bytes=10_000),
    }


def record() -> tuple[dict[str, Any], dict[str, Any]]:
    """Train both tasks and return the arrays (``<stream>/W0``, ``<stream>/G``) and the manifest."""
    import torch

    torch.set_num_threads(1)
    arrays: dict[str, np.ndarray] = {}
    described: dict[str, Any] = {}
    tasks = _tasks()
    for task_name, task in tasks.items():
        torch.manual_seed(0)
        model = task.model()
        params = dict(model.named_parameters())
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        batches = task.batches(torch.Generator().manual_seed(0))
        mine = {name: names for name, (t, names) in STREAMS.items() if t == task_name}
        grads: dict[str, list[np.ndarray]] = {name: [] for name in mine}
        for step in range(WARMUP + STEPS):
            if step == WARMUP:
                for name, names in mine.items():
                    arrays[f"{name}/W0"] = _stack([params[p] for p in names])
            x, y = next(batches)
            opt.zero_grad(set_to_none=True)
            task.loss(model, x, y).backward()
            if step >= WARMUP:
                for name, names in mine.items():
                    grads[name].append(_stack([params[p].grad for p in names]))
            opt.step()
        for name, names in mine.items():
            G = np.stack(grads[name])
            arrays[f"{name}/G"] = G
            described[name] = {
                "task": task_name,
                "task_config": repr(task),
                "parameters": list(names),
                "shape": list(G.shape[1:]),
                "steps": STEPS,
            }
    manifest = {
        "format": FORMAT,
        "recorded_by": "python -m fismo_core.data.record_gradients",
        "optimizer": f"torch.optim.AdamW(lr={LR})",
        "warmup_steps": WARMUP,
        "seed": 0,
        "dtype": "float32",
        "torch": torch.__version__,
        "python": platform.python_version(),
        "streams": described,
    }
    return arrays, manifest


def _stack(tensors: list[Any]) -> np.ndarray:
    out = np.stack([t.detach().to("cpu").numpy().astype(np.float32) for t in tensors])
    return out[0] if len(tensors) == 1 else out


def _relative_difference(recorded: np.ndarray, shipped: np.ndarray) -> float:
    """The largest difference of two arrays relative to ``shipped``'s largest entry (0 where they are equal)."""
    difference = float(np.max(np.abs(recorded - shipped)))
    return difference / float(np.max(np.abs(shipped))) if difference else 0.0


def write(path: Path) -> None:
    arrays, manifest = record()
    with open(path, "wb") as f:  # a file object: np.savez would append ".npz" to a name without it
        np.savez_compressed(f, manifest=np.array(json.dumps(manifest, sort_keys=True)), **arrays)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(Path(__file__).with_name(GRADIENTS_FILE)), help="output file")
    parser.add_argument("--check", action="store_true", help="record again and compare with --out instead of writing")
    args = parser.parse_args(argv)
    out = Path(args.out)
    if args.check and not out.is_file():  # a traceback after recording (a user's hunt, 2026-12-04)
        parser.error(f"--check compares with --out {args.out}, which is not a file")
    if not args.check and (out.is_dir() or not out.parent.is_dir()):
        parser.error(f"--out {args.out}: {'it is a directory' if out.is_dir() else 'its directory does not exist'}")
    if args.check:
        arrays, _ = record()
        with np.load(args.out, allow_pickle=False) as shipped:
            other = sorted(k for k in arrays if k not in shipped.files or shipped[k].shape != arrays[k].shape)
            if other:
                print(f"{args.out} does not hold these arrays in these shapes: {', '.join(other)}")
                return 1
            worst = max(float(np.max(np.abs(arrays[k] - shipped[k]))) for k in arrays)
            relative = max(_relative_difference(arrays[k], shipped[k]) for k in arrays)
        accepted = f" (relative {relative:.1e}; accepted up to {CHECK_RTOL:g}: float32 training rounds by the CPU's kernels)"
        print(f"largest difference from {args.out}: {worst:.3e}" + (accepted if worst else ""))
        return 0 if relative <= CHECK_RTOL else 1
    write(Path(args.out))
    with np.load(args.out, allow_pickle=False) as f:
        for key in sorted(f.files):
            if key.endswith("/G"):
                s = np.linalg.svd(f[key].astype(np.float64), compute_uv=False)
                ratio = float(np.max(s[..., -1] / s[..., 0]))
                print(f"{key[:-2]:14s} {str(f[key].shape[1:]):14s} steps {f[key].shape[0]}  max sigma_min/sigma_max {ratio:.1e}")
    print(f"wrote {args.out} ({Path(args.out).stat().st_size / 1e3:.0f} kB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
