"""fismo_core.linalg: the polar factor and the inverse square root, each method."""

from __future__ import annotations

from fismo_core import linalg

from .common import BACKENDS, SHAPES, block, parse_shape, random_matrix, random_spd, sizes, target

#: Polar methods: Newton–Schulz with Muon's quintic (5 steps, as torch.optim.Muon) and with
#: Polar Express (8 steps), and the exact SVD.
POLAR_METHODS = {
    "muon-5": {"method": "newton_schulz", "coefficients": "muon", "steps": 5},
    "polar_express-8": {"method": "newton_schulz", "coefficients": "polar_express", "steps": 8},
    "svd": {"method": "svd"},
}

#: Inverse square root methods: eigh, and Newton–Schulz with each schedule's default steps.
INVERSE_SQRT_METHODS = {
    "eigh": {"method": "eigh"},
    "polar_express-9": {"method": "newton_schulz", "coefficients": "polar_express"},
    "cubic-22": {"method": "newton_schulz", "coefficients": "cubic"},
}


class Polar:
    params = (list(POLAR_METHODS), BACKENDS, SHAPES)
    param_names = ["method", "backend", "shape"]
    timeout = 300

    def setup(self, method, backend, shape):
        self.X = target(backend).asarray(random_matrix(parse_shape(shape)))
        self.kwargs = POLAR_METHODS[method]

    def time_polar(self, method, backend, shape):
        block(linalg.polar(self.X, **self.kwargs))

    def peakmem_polar(self, method, backend, shape):
        block(linalg.polar(self.X, **self.kwargs))


class InverseSqrt:
    params = (list(INVERSE_SQRT_METHODS), BACKENDS, sizes("256", "768", "1024", "3072", "16x512"))
    param_names = ["method", "backend", "size"]
    timeout = 600

    def setup(self, method, backend, size):
        *batch, d = (int(v) for v in size.split("x"))
        self.A = target(backend).asarray(random_spd((*batch, d, d)))
        self.kwargs = INVERSE_SQRT_METHODS[method]

    def time_inverse_sqrt(self, method, backend, size):
        block(linalg.inverse_sqrt(self.A, **self.kwargs))

    def peakmem_inverse_sqrt(self, method, backend, size):
        block(linalg.inverse_sqrt(self.A, **self.kwargs))
