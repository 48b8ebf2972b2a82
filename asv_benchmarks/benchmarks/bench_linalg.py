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
        # the method alone, as the optimizer calls it: the input check (a host read) is timed by InputChecks
        self.kwargs = {**POLAR_METHODS[method], "check": False}

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
        self.kwargs = {**INVERSE_SQRT_METHODS[method], "check": False}

    def time_inverse_sqrt(self, method, backend, size):
        block(linalg.inverse_sqrt(self.A, **self.kwargs))

    def peakmem_inverse_sqrt(self, method, backend, size):
        block(linalg.inverse_sqrt(self.A, **self.kwargs))


class InputChecks:
    """What the default input checks of ``polar`` and ``inverse_sqrt`` cost on top of the method (``check=True``)."""

    params = (["polar", "inverse_sqrt newton_schulz"], BACKENDS, sizes("256", "1024"))
    param_names = ["function", "backend", "size"]
    timeout = 300

    def setup(self, function, backend, size):
        d = int(size)
        self.fn = (lambda A: linalg.polar(A)) if function == "polar" else (
            lambda A: linalg.inverse_sqrt(A, method="newton_schulz"))
        self.A = target(backend).asarray(random_spd((d, d)))

    def time_checked(self, function, backend, size):
        block(self.fn(self.A))
