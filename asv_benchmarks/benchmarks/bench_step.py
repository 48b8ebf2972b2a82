"""A full optimizer step: FISMO on every installed backend, with Muon and AdamW as anchors."""

from __future__ import annotations

from fismo_core import FISMO

from .common import BACKENDS, SHAPES, block, cpu_target, parse_shape, random_matrix


class FISMOStep:
    params = (["exact", "newton_schulz_roots"], BACKENDS, SHAPES)
    param_names = ["roots", "backend", "shape"]
    timeout = 600

    def setup(self, roots, backend, shape):
        target = cpu_target(backend)
        dims = parse_shape(shape)
        self.opt = FISMO(inv_root="eigh" if roots == "exact" else "newton_schulz")
        self.W = target.asarray(random_matrix(dims, seed=0))
        self.G = target.asarray(random_matrix(dims, seed=1))
        # One warm-up step so the state is a typical mid-run state (P, Q off the identity).
        _, self.state = self.opt.step(self.W, self.G, self.opt.init(self.W))

    def time_step(self, roots, backend, shape):
        W, _ = self.opt.step(self.W, self.G, self.state)
        block(W)

    def peakmem_step(self, roots, backend, shape):
        self.opt.step(self.W, self.G, self.state)


class TorchAnchors:
    """torch.optim.Muon and torch.optim.AdamW on the same shapes (torch CPU float32)."""

    params = (["muon", "adamw"], SHAPES)
    param_names = ["optimizer", "shape"]
    timeout = 300

    def setup(self, optimizer, shape):
        try:
            import torch
        except ImportError as exc:
            raise NotImplementedError("torch is not installed") from exc
        dims = parse_shape(shape)
        # torch.optim.Muon takes 2-D parameters only: a batch becomes that many parameters.
        matrices = [dims] if len(dims) == 2 else [dims[1:]] * dims[0]
        self.params_ = [torch.nn.Parameter(torch.randn(*d)) for d in matrices]
        for p in self.params_:
            p.grad = torch.randn_like(p)
        if optimizer == "muon":
            self.opt = torch.optim.Muon(self.params_, lr=0.02, momentum=0.95, nesterov=False, weight_decay=0.0)
        else:
            self.opt = torch.optim.AdamW(self.params_, lr=1e-3)
        self.opt.step()

    def time_step(self, optimizer, shape):
        self.opt.step()
