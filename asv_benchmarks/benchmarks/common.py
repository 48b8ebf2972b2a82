"""Shared set-up for the benchmarks: which backends are installed, and seeded inputs."""

from __future__ import annotations

import os

import numpy as np

from fismo_core.testing import targets

#: The shapes of the issue: square, large square, wide, tall, and a batch of 16.
SHAPES = ["256x256", "1024x1024", "768x3072", "3072x768", "16x512x512"]

#: (backend, dtype) pairs timed; each is skipped when its library is missing.
BACKENDS = ["numpy-float64", "numpy-float32", "torch-float32", "jax-float32"]

#: ``FISMO_ASV_SMOKE=1`` shrinks the grid to one small shape per backend: CI's smoke run.
SMOKE = os.environ.get("FISMO_ASV_SMOKE") == "1"
if SMOKE:
    SHAPES = ["64x96"]


def parse_shape(name: str) -> tuple[int, ...]:
    return tuple(int(v) for v in name.split("x"))


def sizes(*names: str) -> list[str]:
    """``names``, or the smoke grid's single small size."""
    return ["64"] if SMOKE else list(names)


def cpu_target(backend_dtype: str):
    """The CPU target of ``backend-dtype``, or ``NotImplementedError`` (asv's skip) if unavailable."""
    backend, dtype = backend_dtype.split("-")
    for t in targets():
        if t.backend == backend and t.dtype == dtype and t.device == "cpu":
            if not t.available:
                raise NotImplementedError(t.reason)
            return t
    raise NotImplementedError(f"no target {backend_dtype}")


def random_matrix(shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape) / np.sqrt(shape[-1])


def random_spd(shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    """SPD matrices ``(..., d, d)`` with trace d, like FISMO's P and Q."""
    X = random_matrix(shape, seed)
    d = shape[-1]
    A = X @ np.swapaxes(X, -1, -2) / d + 1e-3 * np.eye(d)
    return d * A / np.trace(A, axis1=-2, axis2=-1)[..., None, None]


def block(x) -> None:
    """Wait for asynchronous backends (JAX) to finish, so timings cover the work."""
    ready = getattr(x, "block_until_ready", None)
    if ready is not None:
        ready()
