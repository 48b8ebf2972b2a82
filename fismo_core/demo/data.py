"""The two data sets of ``fismo demo``, both already on the machine (no download).

- **digits**: scikit-learn's handwritten digits (``sklearn.datasets.load_digits``,
  1797 images of 8x8 pixels, 10 classes), split once into a stratified
  training set and a held-out set.
- **stdlib**: the Python standard library's own ``.py`` files, as bytes.
  Files are sorted by name; every ``val_every``-th file is held out, so the
  validation text comes from files the model never saw.

Both splits are fixed (independent of the run's seed), so every optimizer and
seed is scored on the same held-out data.
"""

from __future__ import annotations

import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["ByteCorpus", "DigitsData", "load_digits_split", "load_stdlib_corpus", "stdlib_files"]


@dataclass(frozen=True)
class DigitsData:
    """Standardised digits images ``(N, 1, 8, 8)`` and integer labels, training and held-out."""

    x_train: torch.Tensor
    y_train: torch.Tensor
    x_val: torch.Tensor
    y_val: torch.Tensor


def load_digits_split(val_fraction: float = 0.2, split_seed: int = 0) -> DigitsData:
    """scikit-learn's digits, stratified into training and held-out images.

    Pixels (0..16) are standardised with the training set's mean and standard
    deviation (one scalar each), so no statistic of the held-out set leaks in.
    """
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1)  # (1797, 1, 8, 8)
    y = torch.tensor(digits.target, dtype=torch.long)
    idx_train, idx_val = train_test_split(
        list(range(len(y))), test_size=val_fraction, random_state=split_seed, stratify=digits.target
    )
    x_train, x_val = x[idx_train], x[idx_val]
    mean, std = x_train.mean(), x_train.std()
    return DigitsData((x_train - mean) / std, y[idx_train], (x_val - mean) / std, y[idx_val])


@dataclass(frozen=True)
class ByteCorpus:
    """A byte-level text corpus: training and held-out bytes as ``uint8`` tensors, and their files."""

    train: torch.Tensor
    val: torch.Tensor
    train_files: tuple[str, ...]
    val_files: tuple[str, ...]

    @property
    def description(self) -> str:
        """One line: where the text comes from and how much of it there is."""
        return (
            f"{len(self.train_files)} training files ({len(self.train) / 1e3:.0f} KB) and "
            f"{len(self.val_files)} held-out files ({len(self.val) / 1e3:.0f} KB) of the Python standard library"
        )


def stdlib_files() -> list[Path]:
    """The top-level ``.py`` files of this interpreter's standard library, sorted by name."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.glob("*.py") if p.is_file())


def load_stdlib_corpus(max_train_bytes: int, max_val_bytes: int, val_every: int = 10) -> ByteCorpus:
    """The standard library's source as bytes, split by file.

    Files are taken in sorted order; file ``i`` is held out when
    ``i % val_every == val_every // 2``. Each side is filled with whole files
    until its byte budget is reached (the last file is cut). Files are joined
    with a blank line. The text is whatever this Python version ships, so the
    numbers differ slightly between Python versions (the results page names
    the one used).
    """
    files = stdlib_files()
    if not files:
        raise RuntimeError(f"no .py files found under {sysconfig.get_paths()['stdlib']}")
    sides: dict[str, list[bytes]] = {"train": [], "val": []}
    names: dict[str, list[str]] = {"train": [], "val": []}
    budget = {"train": max_train_bytes, "val": max_val_bytes}
    for i, path in enumerate(files):
        side = "val" if i % val_every == val_every // 2 else "train"
        used = sum(len(b) for b in sides[side])
        if used >= budget[side]:
            continue
        data = path.read_bytes() + b"\n\n"
        sides[side].append(data[: budget[side] - used])
        names[side].append(path.name)
    tensors = {k: torch.frombuffer(bytearray(b"".join(v)), dtype=torch.uint8) for k, v in sides.items()}
    return ByteCorpus(tensors["train"], tensors["val"], tuple(names["train"]), tuple(names["val"]))
