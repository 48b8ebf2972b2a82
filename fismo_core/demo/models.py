"""The two small networks of ``fismo demo``.

Every hidden weight is a 2-D matrix, so that FISMO, ``torch.optim.Muon``
(which accepts 2-D parameters only) and the element-wise optimizers all see
the same parameters: the convolutions keep their kernels as
``(out_channels, in_channels * k * k)`` matrices, the layout in which the
FISMO adapter flattens a 4-D convolution weight anyway.

Each model names its output head ``head``; together with 1-D parameters and
embeddings it goes to AdamW in the matrix optimizers (see
[`fismo_core.backends.torch.param_groups`][fismo_core.backends.torch.param_groups]).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["DigitsCNN", "MatrixConv2d", "TinyGPT"]


class MatrixConv2d(nn.Module):
    """A 2-D convolution whose kernel is stored as a matrix ``(out, in * k * k)``.

    Same computation and initialisation as ``nn.Conv2d(in, out, k, padding=k // 2)``.
    """

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int) -> None:
        super().__init__()
        self.shape = (out_channels, in_channels, kernel_size, kernel_size)
        fan_in = in_channels * kernel_size * kernel_size
        bound = 1.0 / math.sqrt(fan_in)  # nn.Conv2d's default: kaiming_uniform(a=sqrt(5)) and its bias bound
        self.weight = nn.Parameter(torch.empty(out_channels, fan_in).uniform_(-bound, bound))
        self.bias = nn.Parameter(torch.empty(out_channels).uniform_(-bound, bound))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.conv2d(x, self.weight.view(self.shape), self.bias, padding=self.shape[-1] // 2)


class DigitsCNN(nn.Module):
    """conv 3x3 -> ReLU -> max-pool -> conv 3x3 -> ReLU -> max-pool -> linear -> ReLU -> head, for 8x8 images.

    Hidden matrices with the default widths (16, 32, 64): ``(16, 9)``,
    ``(32, 144)``, ``(64, 128)``; head ``(10, 64)``.
    """

    def __init__(self, channels: tuple[int, int] = (16, 32), hidden: int = 64, classes: int = 10) -> None:
        super().__init__()
        c1, c2 = channels
        self.conv1 = MatrixConv2d(1, c1, 3)
        self.conv2 = MatrixConv2d(c1, c2, 3)
        self.fc = nn.Linear(c2 * 2 * 2, hidden)
        self.head = nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.gelu(self.conv1(x)), 2)  # 8x8 -> 4x4
        x = F.max_pool2d(F.gelu(self.conv2(x)), 2)  # 4x4 -> 2x2
        return self.head(F.gelu(self.fc(x.flatten(1))))


class _Block(nn.Module):
    """Pre-LayerNorm transformer block: causal self-attention and a GELU MLP (nanoGPT's layout)."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.attn = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)
        self.ln2 = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, 4 * dim, bias=False)
        self.fc_out = nn.Linear(4 * dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.attn(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.fc_out(F.gelu(self.fc(self.ln2(x))))


class TinyGPT(nn.Module):
    """A GPT-style byte-level language model: token and position embeddings, pre-LN blocks, untied head.

    Hidden matrices per block with ``dim = 64``: ``attn (192, 64)``,
    ``proj (64, 64)``, ``fc (256, 64)``, ``fc_out (64, 256)``.
    """

    def __init__(self, vocab: int = 256, context: int = 64, dim: int = 64, layers: int = 2, heads: int = 4) -> None:
        super().__init__()
        if dim % heads:
            raise ValueError(f"dim {dim} must be a multiple of heads {heads}")
        self.context = context
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(context, dim)
        self.blocks = nn.ModuleList(_Block(dim, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        for name, p in self.named_parameters():  # GPT-2's initialisation
            if p.ndim == 2:
                std = 0.02 / math.sqrt(2 * layers) if name.endswith(("proj.weight", "fc_out.weight")) else 0.02
                nn.init.normal_(p, mean=0.0, std=std)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))
