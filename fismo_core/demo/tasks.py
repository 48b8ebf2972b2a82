"""The two training tasks of ``fismo demo``: a model, a batch stream and a held-out evaluation each."""

from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .data import ByteCorpus, DigitsData, load_digits_split, load_stdlib_corpus
from .models import DigitsCNN, TinyGPT

__all__ = ["DigitsTask", "Task", "TextTask"]


@dataclass(frozen=True)
class DigitsTask:
    """Classify scikit-learn's 8x8 digits with [`DigitsCNN`][fismo_core.demo.models.DigitsCNN]."""

    batch_size: int = 64
    channels: tuple[int, int] = (16, 32)
    hidden: int = 64

    name = "digits"
    title = "CNN on scikit-learn digits"
    has_accuracy = True

    @property
    def data(self) -> DigitsData:
        return _digits()

    def model(self) -> nn.Module:
        return DigitsCNN(self.channels, self.hidden)

    def batches(self, generator: torch.Generator) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Mini-batches of shuffled training images, epoch after epoch (the last partial batch is dropped).

        Each image is shifted by a random -1, 0 or +1 pixel in each
        direction (the uncovered border gets the background value): without
        this augmentation the network memorises the 1437 training images
        within a few epochs, its gradients vanish and the held-out loss only
        grows.
        """
        data = self.data
        n = len(data.y_train)
        background = data.x_train.min()
        while True:
            order = torch.randperm(n, generator=generator)
            for i in range(0, n - self.batch_size + 1, self.batch_size):
                idx = order[i : i + self.batch_size]
                yield _shift(data.x_train[idx], background, generator), data.y_train[idx]

    def loss(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(model(x), y)

    @torch.no_grad()
    def evaluate(self, model: nn.Module) -> tuple[float, float]:
        """Cross-entropy and accuracy on the whole held-out set."""
        data = self.data
        logits = model(data.x_val)
        return F.cross_entropy(logits, data.y_val).item(), (logits.argmax(1) == data.y_val).float().mean().item()

    def describe(self) -> str:
        d = self.data
        return f"{len(d.y_train)} training and {len(d.y_val)} held-out images, batch {self.batch_size}"


@dataclass(frozen=True)
class TextTask:
    """Next-byte prediction on the standard library's source with [`TinyGPT`][fismo_core.demo.models.TinyGPT]."""

    batch_size: int = 32
    context: int = 64
    dim: int = 64
    layers: int = 2
    heads: int = 4
    max_train_bytes: int = 2_000_000
    max_val_bytes: int = 200_000
    val_windows: int = 128

    name = "text"
    title = "GPT on Python stdlib source (bytes)"
    has_accuracy = False

    @property
    def corpus(self) -> ByteCorpus:
        return _corpus(self.max_train_bytes, self.max_val_bytes)

    def model(self) -> nn.Module:
        return TinyGPT(256, self.context, self.dim, self.layers, self.heads)

    def _windows(self, text: torch.Tensor, starts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        offsets = starts[:, None] + torch.arange(self.context + 1)
        chunk = text[offsets].long()
        return chunk[:, :-1], chunk[:, 1:]

    def batches(self, generator: torch.Generator) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Windows of ``context`` bytes at uniformly random offsets of the training text, and their next bytes."""
        text = self.corpus.train
        while True:
            starts = torch.randint(0, len(text) - self.context - 1, (self.batch_size,), generator=generator)
            yield self._windows(text, starts)

    def loss(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Mean next-byte cross-entropy; the bytes go to the model's device (the data stay on the CPU)."""
        device = next(model.parameters()).device
        x, y = x.to(device), y.to(device)
        return F.cross_entropy(model(x).flatten(0, 1), y.flatten())

    @torch.no_grad()
    def evaluate(self, model: nn.Module) -> tuple[float, float]:
        """Mean cross-entropy (nats per byte) over ``val_windows`` evenly spaced held-out windows; no accuracy."""
        text = self.corpus.val
        starts = torch.linspace(0, len(text) - self.context - 2, self.val_windows).long()
        x, y = self._windows(text, starts)
        return self.loss(model, x, y).item(), float("nan")

    def describe(self) -> str:
        return f"{self.corpus.description}, context {self.context}, batch {self.batch_size}"


def _shift(x: torch.Tensor, background: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Translate each image ``(B, 1, H, W)`` by a random -1, 0 or +1 pixel along each axis."""
    b, _, h, w = x.shape
    padded = F.pad(x, (1, 1, 1, 1), value=float(background))
    dy, dx = torch.randint(0, 3, (2, b), generator=generator)
    rows = (dy[:, None] + torch.arange(h))[:, :, None]
    cols = (dx[:, None] + torch.arange(w))[:, None, :]
    return padded[torch.arange(b)[:, None, None], 0, rows, cols].unsqueeze(1)


Task = DigitsTask | TextTask


@functools.lru_cache(maxsize=1)
def _digits() -> DigitsData:
    return load_digits_split()


@functools.lru_cache(maxsize=2)
def _corpus(max_train_bytes: int, max_val_bytes: int) -> ByteCorpus:
    return load_stdlib_corpus(max_train_bytes, max_val_bytes)
