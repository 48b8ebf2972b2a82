"""fismo_core.linalg: the polar factor and the inverse square root, each method."""

from __future__ import annotations

from fismo_core import linalg

from .common import BACKENDS, SHAPES, SMOKE, block, cpu_target, parse_shape, random_matrix, random_spd, sizes


class Polar:
    params = (["newton_schulz", "svd"], BACKENDS, SHAPES if SMOKE else ["256x256", "1024x1024", "768x3072", "16x512x512"])
    param_names = ["method", "backend", "shape"]
    timeout = 300

    def setup(self, method, backend, shape):
        self.X = cpu_target(backend).asarray(random_matrix(parse_shape(shape)))

    def time_polar(self, method, backend, shape):
        block(linalg.polar(self.X, method=method))

    def peakmem_polar(self, method, backend, shape):
        linalg.polar(self.X, method=method)


class InverseSqrt:
    params = (["eigh", "newton_schulz"], BACKENDS, sizes("256", "768", "1024", "3072"))
    param_names = ["method", "backend", "size"]
    timeout = 300

    def setup(self, method, backend, size):
        d = int(size)
        self.A = cpu_target(backend).asarray(random_spd((d, d)))

    def time_inverse_sqrt(self, method, backend, size):
        block(linalg.inverse_sqrt(self.A, method=method))

    def peakmem_inverse_sqrt(self, method, backend, size):
        linalg.inverse_sqrt(self.A, method=method)
