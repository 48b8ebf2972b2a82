"""``fismo verify``: FISMO on every installed backend, device and dtype, against NumPy float64.

The verification runs *streams*: a starting point ``W_0`` and a sequence of
gradients ``G_1 .. G_T``. There are two kinds:

- seeded Gaussian streams (`gaussian_streams`), one per shape of
  `fismo_core.testing.VERIFY_SHAPES`, ``--steps`` long (default 50): full
  rank, anisotropic, so that ``P`` and ``Q`` move far from the identity;
- gradients recorded from the demo's real models (`recorded_streams`, package
  data ``fismo_core/data/gradients.npz``): a classifier head (rank-deficient),
  a convolution, and a transformer's attention, output projection and MLP
  matrices, 16 steps each (or ``--steps`` if fewer).

Each stream runs once on NumPy float64 (the reference, or read from a
reference file) and once on every available target, with `FISMO.step_lines`,
which returns every quantity of Algorithm 1 at every step. Each quantity
(line 4 ``P``, line 5 ``Q``, the roots, line 6 ``G~``, line 7 ``M``, line 8
the direction, line 9 ``W``, as ``W_t - W_0``) is compared by its relative
Frobenius error, per matrix and worst over a batch. A target fails when any
error exceeds the tolerance of its dtype; the report then names the first
stream, step and line of Algorithm 1 where that happened.

A reference can be saved (`Reference.save`, ``fismo verify --save PATH``)
and checked against later on another machine (`Reference.load`,
``fismo verify --against PATH``); the file format is described in
`Reference` and in ``docs/verification.md``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib.util
import json
import math
import os
import sys
import time
import tokenize
import zipfile
import zlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, TextIO

from . import __version__
from ._paths import cannot_write_in, staged_files
from ._workers import end_quietly_on_interrupt
from .linalg import _check_integer
from .optimizer import FISMO, InverseRootConfig, PolarConfig
from .testing import (
    VERIFY_SHAPES,
    Report,
    Result,
    Target,
    _loaded,
    full_float32_matmuls,
    reference_gradients,
    relative_errors,
    targets,
    to_numpy,
)

__all__ = [
    "LINES",
    "Reference",
    "ReferenceFileError",
    "Stream",
    "VerifyResult",
    "format_table",
    "gaussian_streams",
    "main",
    "recorded_streams",
    "run_stream",
    "verify",
]

LINES: dict[str, str] = {
    "P": "line 4 P",
    "P_inv_sqrt": "root P^-1/2",
    "Q": "line 5 Q",
    "Q_inv_sqrt": "root Q^-1/2",
    "G_white": "line 6 G~",
    "M": "line 7 M",
    "direction": "line 8 direction",
    "W": "line 9 W",
}
"""The quantities compared at every step (`fismo_core.optimizer.StepLines` fields) and how the report
names them, in the order Algorithm 1 computes them: ``P_t`` (line 4), its root, ``Q_t`` (line 5, which
uses ``P_t^{-1}``), its root, then lines 6 to 9. The first one that leaves its tolerance is where a
backend parted from the reference; everything after it depends on it. ``W`` is compared as ``W_t - W_0``."""

QUANTITIES: tuple[str, ...] = tuple(LINES)

def _all_targets() -> list[Target]:
    return targets()  # looked up at call time (tests replace ``targets``); verify's argument shadows it


VerifyResult = Result
"""The outcome of one target (a `fismo_core.testing.Result`; ``where`` is ``"stream step t: line"``)."""

FORMAT_NAME = "fismo-verify-reference"
FORMAT_VERSION = 2
"""The reference file format this version writes. It reads version 1 too, whose checksum covers the
arrays only (an edited configuration loaded, and every target failed against it; until 2026-12-03)."""
READABLE_VERSIONS = (1, 2)


# ------------------------------------------------------------------ streams
@dataclass(frozen=True)
class Stream:
    """A starting point ``W0`` ``(..., m, n)`` and gradients ``G`` ``(steps, ..., m, n)``, NumPy float64."""

    name: str
    W0: Any
    G: Any
    description: str = ""

    @property
    def steps(self) -> int:
        return int(self.G.shape[0])

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.W0.shape)


def gaussian_streams(steps: int, seed: int = 0) -> list[Stream]:
    """One seeded stream per shape of `VERIFY_SHAPES` (`reference_gradients`, ``W_0`` standard normal)."""
    import numpy as np

    out = []
    for k, shape in enumerate(VERIFY_SHAPES):
        G = np.stack(reference_gradients(shape, steps, seed=seed + k))
        W0 = np.random.default_rng(seed + 1000 + k).standard_normal(shape)
        name = "gauss." + "x".join(map(str, shape))
        out.append(Stream(name, W0, G, "seeded anisotropic Gaussian gradients (fismo_core.testing.reference_gradients)"))
    return out


def recorded_streams(steps: Optional[int] = None) -> list[Stream]:
    """The gradient streams recorded from the demo's models (package data), the first ``steps`` of each.

    See ``fismo_core/data/record_gradients.py`` for how they were recorded.
    """
    import importlib.resources

    import numpy as np

    from .data import GRADIENTS_FILE

    resource = importlib.resources.files("fismo_core.data").joinpath(GRADIENTS_FILE)
    with importlib.resources.as_file(resource) as path, np.load(path, allow_pickle=False) as f:
        manifest = json.loads(str(f["manifest"]))
        out = []
        for name, info in manifest["streams"].items():
            G = np.asarray(f[f"{name}/G"], dtype=np.float64)[:steps]
            W0 = np.asarray(f[f"{name}/W0"], dtype=np.float64)
            params = ", ".join(info["parameters"])
            out.append(Stream(name, W0, G, f"recorded from the demo's {info['task']} model: {params}"))
    return sorted(out, key=lambda s: s.name)


def default_streams(steps: int = 50, seed: int = 0) -> list[Stream]:
    """What ``fismo verify`` runs: the Gaussian streams (``steps`` long) and the recorded ones (at most ``steps``)."""
    return gaussian_streams(steps, seed) + recorded_streams(steps)


# ------------------------------------------------------------- running
class _StreamError(Exception):
    def __init__(self, step: int, exc: BaseException) -> None:
        super().__init__(f"{type(exc).__name__}: {exc}")
        self.step = step


def _dense(factor: Any) -> Any:
    if isinstance(factor, tuple):  # a kronecker.Blocks (block_size): compare the block-diagonal matrix
        from .kronecker import to_dense

        return to_dense(factor)
    return factor


class _JaxStepper:
    """``optimizer.step_lines`` for one JAX target, compiled ahead of time once per shape and dtype."""

    def __init__(self, optimizer: FISMO, target: Target) -> None:
        import jax

        self.target = target
        self.optimizer = optimizer
        self.jitted = jax.jit(optimizer.step_lines)
        self.compiled: dict[tuple[int, ...], Any] = {}

    def __call__(self, W: Any, G: Any, state: Any) -> Any:
        shape = tuple(W.shape)
        if shape not in self.compiled:  # one compilation per shape, whatever the arrays' placement
            self.compiled[shape] = self.jitted.lower(W, G, state).compile()
        return self.compiled[shape](W, G, state)


def _traced_step(state: Any) -> Any:
    """A JAX state whose step count is already an array, as after a jitted step (one compilation, not two)."""
    import jax.numpy as jnp

    return state._replace(step=jnp.asarray(state.step))


_JAX_STEPPERS: dict[tuple[FISMO, str], _JaxStepper] = {}
"""Compiled JAX steps by (optimizer, target id), so that repeated verifications in one process compile once."""


def _stepper(optimizer: FISMO, target: Optional[Target]) -> Callable[..., Any]:
    """``optimizer.step_lines``; for JAX targets compiled ahead of time, once per shape (see ``docs/verification.md``)."""
    if target is None or target.backend != "jax":
        return optimizer.step_lines
    key = (optimizer, target.id)
    if key not in _JAX_STEPPERS:
        _JAX_STEPPERS[key] = _JaxStepper(optimizer, target)
    return _JAX_STEPPERS[key]


def run_stream(
    optimizer: FISMO, stream: Stream, asarray: Callable[[Any], Any], stepper: Optional[Callable[..., Any]] = None
) -> dict[str, Any]:
    """Run ``stream`` and return every quantity of `LINES` at every step, as NumPy float64 ``(steps, ...)``.

    ``asarray`` converts NumPy data to the backend under test. Values stay on
    the backend until the stream ends (no host round trip per step, except
    for JAX, whose arrays are copied to NumPy one by one to avoid compiling a
    stacking program per shape).
    """
    import numpy as np
    from array_api_compat import array_namespace, is_jax_array

    stepper = optimizer.step_lines if stepper is None else stepper
    W = asarray(stream.W0)
    state = optimizer.init(W)
    if is_jax_array(W):  # a traced step count from the start: jax.jit compiles once, not twice
        state = _traced_step(state)
    collected: dict[str, list[Any]] = {q: [] for q in QUANTITIES}
    for t in range(stream.steps):
        try:
            W, state, lines = stepper(W, asarray(stream.G[t]), state)
        except Exception as exc:
            raise _StreamError(t + 1, exc) from exc
        for q in QUANTITIES:
            collected[q].append(_dense(getattr(lines, q)))
    if is_jax_array(W):
        return {q: np.stack([to_numpy(v) for v in values]) for q, values in collected.items()}
    xp = array_namespace(W)
    return {q: to_numpy(xp.stack(values)) for q, values in collected.items()}


def line_errors(got: Mapping[str, Any], reference: Mapping[str, Any], W0: Any) -> Any:
    """Relative errors ``(steps, len(QUANTITIES))``: per step and quantity, worst over a batch."""
    import numpy as np

    steps = reference["W"].shape[0]
    out = np.empty((steps, len(QUANTITIES)))
    for i, q in enumerate(QUANTITIES):
        g, r = np.asarray(got[q]), np.asarray(reference[q])
        if g.shape != r.shape:
            raise ValueError(f"{LINES[q]} has shape {g.shape[1:]}, the reference {r.shape[1:]}")
        if q == "W":
            g, r = g - W0, r - W0
        out[:, i] = relative_errors(g, r).reshape(steps, -1).max(axis=1)
    return out


# ----------------------------------------------------------- reference
class ReferenceFileError(ValueError):
    """A reference file that cannot be used: missing, damaged, foreign or incompatible (one-line message)."""


def _config_of(optimizer: FISMO) -> dict[str, Any]:
    return json.loads(json.dumps(dataclasses.asdict(optimizer)))


def _tuples(value: Any) -> Any:
    if isinstance(value, list):
        return tuple(_tuples(v) for v in value)
    return value


def optimizer_from_config(config: Mapping[str, Any]) -> FISMO:
    """Build the `FISMO` a reference was made with; ``ValueError`` if this version cannot build the same one."""
    if not isinstance(config, Mapping):
        raise ValueError(f"the configuration is a {type(config).__name__}, not a mapping")
    fields = {f.name for f in dataclasses.fields(FISMO)}
    unknown = sorted(set(config) - fields)
    if unknown:
        raise ValueError(f"unknown FISMO option(s) {', '.join(unknown)}")
    kwargs = {}
    for key, value in config.items():
        if key == "polar":
            value = PolarConfig(**{k: _tuples(v) for k, v in value.items()})
        elif key == "inv_root":
            value = InverseRootConfig(**{k: _tuples(v) for k, v in value.items()})
        kwargs[key] = _tuples(value)
    optimizer = FISMO(**kwargs)
    if _config_of(optimizer) != json.loads(json.dumps(config)):
        raise ValueError("it builds a different optimizer here (options missing or changed meaning)")
    return optimizer


def _checksum(arrays: Mapping[str, Any], described: Optional[Mapping[str, Any]] = None) -> str:
    """The reference's ``"sha256:..."``: of its arrays and (format 2) of what the manifest says they are."""
    import numpy as np

    h = hashlib.sha256()
    for key in sorted(arrays):
        a = np.ascontiguousarray(arrays[key], dtype="<f8")
        h.update(f"{key}|{a.shape}|".encode())
        h.update(a.tobytes())
    if described is not None:
        h.update(b"manifest|" + json.dumps(described, sort_keys=True).encode())
    return "sha256:" + h.hexdigest()


#: The manifest's entries that say what the arrays are, inside the checksum from format 2 on.
DESCRIBING = ("config", "steps", "seed", "quantities", "streams")


@dataclass
class Reference:
    """The NumPy float64 reference: the streams (inputs) and every step's `LINES` (outputs).

    **File format** (version 2): a NumPy ``.npz`` archive (a zip of ``.npy``
    arrays) with

    - ``manifest``: a 0-d string array holding JSON: ``format``
      (``"fismo-verify-reference"``), ``format_version`` (2),
      ``library_version`` (the ``fismo`` that wrote it), ``numpy``,
      ``config`` (the `FISMO` options, ``dataclasses.asdict``), ``steps`` and
      ``seed`` (of the Gaussian streams), ``quantities`` (`LINES`' keys, in
      order), ``streams`` (name, shape, steps and description of each, in
      order) and ``checksum``;
    - for each stream ``S``: ``S/W0`` ``(..., m, n)``, ``S/G``
      ``(steps, ..., m, n)`` and, for each quantity ``q``, ``S/q``
      ``(steps, ...)``: ``P`` ``(steps, ..., m, m)``, ..., ``W`` (``W_t``
      itself), all float64.

    ``checksum`` is ``"sha256:"`` and the SHA-256 of, for every array but
    the manifest in sorted key order, ``f"{key}|{shape}|"`` (UTF-8) followed
    by its little-endian float64 bytes, and then of ``"manifest|"`` and the
    JSON (keys sorted) of the manifest's `DESCRIBING` entries. Version 1
    files (read too) have the arrays' part only.
    """

    config: dict[str, Any]
    steps: int
    seed: int
    streams: list[Stream]
    outputs: dict[str, dict[str, Any]]
    library_version: str = __version__
    format_version: int = FORMAT_VERSION  # of the file it was loaded from: 1 has the arrays' checksum only

    @classmethod
    def compute(cls, optimizer: FISMO, streams: Sequence[Stream], *, steps: int, seed: int) -> "Reference":
        """Run every stream on NumPy float64."""
        import numpy as np

        def numpy64(a: Any) -> Any:
            return np.asarray(a, dtype=np.float64)

        outputs = {s.name: run_stream(optimizer, s, numpy64) for s in streams}
        return cls(_config_of(optimizer), steps, seed, list(streams), outputs)

    def optimizer(self) -> FISMO:
        """The `FISMO` this reference was made with."""
        return optimizer_from_config(self.config)

    @property
    def checksum(self) -> str:
        """``"sha256:..."`` of the arrays and what they are, as in the file's manifest."""
        return _checksum(self._arrays(), None if self.format_version == 1 else self._described())

    def _described(self) -> dict[str, Any]:
        """The manifest's `DESCRIBING` entries."""
        return {
            "config": self.config,
            "steps": self.steps,
            "seed": self.seed,
            "quantities": list(QUANTITIES),
            "streams": [
                {"name": s.name, "shape": list(s.shape), "steps": s.steps, "description": s.description}
                for s in self.streams
            ],
        }

    def _arrays(self) -> dict[str, Any]:
        arrays = {}
        for s in self.streams:
            arrays[f"{s.name}/W0"] = s.W0
            arrays[f"{s.name}/G"] = s.G
            for q in QUANTITIES:
                arrays[f"{s.name}/{q}"] = self.outputs[s.name][q]
        return arrays

    def save(self, path: str | Path) -> str:
        """Write the reference file; return its checksum."""
        import numpy as np

        arrays, described = self._arrays(), self._described()
        checksum = _checksum(arrays, described)
        manifest = {
            "format": FORMAT_NAME,
            "format_version": FORMAT_VERSION,
            "library_version": self.library_version,
            "numpy": np.__version__,
            **described,
            "checksum": checksum,
        }
        path = Path(path)
        with staged_files(path.parent) as staged, open(staged(path.name), "wb") as f:
            # A file object: np.savez would append ".npz" to a name without it.
            np.savez_compressed(f, manifest=np.array(json.dumps(manifest)), **arrays)
        return checksum

    @classmethod
    def load(cls, path: str | Path) -> "Reference":
        """Read and check a reference file; `ReferenceFileError` (one line) if it cannot be used."""
        import numpy as np

        path = Path(path)
        if not path.exists():
            raise ReferenceFileError(f"reference file {path} does not exist")
        if not path.is_file():
            raise ReferenceFileError(f"reference file {path} is not a file")
        try:
            if not zipfile.is_zipfile(path):
                raise ReferenceFileError(f"{path} is not a fismo verify reference file (not an .npz archive)")
            with np.load(path, allow_pickle=False) as f:
                if "manifest" not in f.files:
                    raise ReferenceFileError(f"{path} is not a fismo verify reference file (no manifest)")
                try:
                    manifest = json.loads(str(f["manifest"]))
                except (ValueError, TypeError, RecursionError) as exc:  # RecursionError: JSON nested too deep
                    raise ReferenceFileError(f"{path} is not a fismo verify reference file (unreadable manifest)") from exc
                if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_NAME:
                    raise ReferenceFileError(f"{path} is not a fismo verify reference file (format is not {FORMAT_NAME!r})")
                version = manifest.get("format_version")
                if type(version) is not int or version not in READABLE_VERSIONS:  # not True, which equals 1
                    raise ReferenceFileError(
                        f"{path} has reference format version {version!r}; fismo {__version__} reads versions "
                        f"{' and '.join(map(str, READABLE_VERSIONS))} (make a new reference with this version: "
                        "fismo verify --save)"
                    )
                try:
                    stream_info = manifest["streams"]
                    quantities = tuple(manifest["quantities"])
                    checksum = manifest["checksum"]
                    steps, seed, config = manifest["steps"], manifest["seed"], manifest["config"]
                    lib = manifest["library_version"]
                except (KeyError, TypeError, ValueError) as exc:
                    raise ReferenceFileError(f"{path} is damaged: its manifest is incomplete or malformed ({exc})") from exc
                # As written by `save`: integers (not "3", 3.9 or True), a seed >= 0, a version string.
                wrong = [f"{key} {value!r}" for key, value, low in (("steps", steps, 1), ("seed", seed, 0))
                         if type(value) is not int or value < low]
                wrong += [] if isinstance(lib, str) else [f"library_version {lib!r}"]
                if wrong:
                    raise ReferenceFileError(f"{path} is damaged: its manifest has {', '.join(wrong)}")
                if set(quantities) != set(QUANTITIES):
                    raise ReferenceFileError(
                        f"{path} is incompatible: it compares {', '.join(quantities)}; this version compares "
                        f"{', '.join(QUANTITIES)}"
                    )
                if not (isinstance(stream_info, list) and stream_info and all(
                        isinstance(s, dict) and isinstance(s.get("name"), str) for s in stream_info)):
                    raise ReferenceFileError(f"{path} is damaged: its manifest lists no named streams")
                names = [s["name"] for s in stream_info]
                if len(set(names)) != len(names):
                    raise ReferenceFileError(f"{path} is damaged: its manifest repeats a stream name")
                # Each stream's own steps: the Gaussian streams run `steps`, the recorded ones at most their 16,
                # a caller's own streams (verify(streams=...)) their length, which may exceed `steps`.
                stream_steps = {s["name"]: s.get("steps") for s in stream_info}
                short = [f"{n!r} {k!r}" for n, k in stream_steps.items() if type(k) is not int or k < 1]
                if short:
                    raise ReferenceFileError(
                        f"{path} is damaged: its manifest gives streams steps that are not positive integers: "
                        f"{', '.join(short[:3])}"
                    )
                expected = {f"{n}/{k}" for n in names for k in ("W0", "G", *QUANTITIES)}
                missing = sorted(expected - set(f.files))
                if missing:
                    raise ReferenceFileError(f"{path} is damaged: arrays missing ({', '.join(missing[:3])}...)")
                arrays = {k: f[k] for k in sorted(expected)}
                other = [f"{k} ({a.dtype})" for k, a in arrays.items() if a.dtype != np.float64]
                if other:
                    raise ReferenceFileError(f"{path} is damaged: arrays not float64 ({', '.join(other[:3])})")
        except ReferenceFileError:
            raise
        # NotImplementedError: zipfile's answer to a flipped compression method or version in the zip directory.
        # An array's damaged header: a shape too large to allocate (MemoryError) or to count (OverflowError),
        # or one that does not parse (tokenize.TokenError, SyntaxError); each was a traceback and exit 1,
        # which CI reads as a failed backend (a user's hunt, 2026-12-04).
        except (zipfile.BadZipFile, zlib.error, OSError, EOFError, ValueError, NotImplementedError, MemoryError,
                OverflowError, SyntaxError, tokenize.TokenError) as exc:
            raise ReferenceFileError(f"{path} is damaged: {type(exc).__name__}: {exc}") from exc
        described = None if version == 1 else {key: manifest[key] for key in DESCRIBING}
        if _checksum(arrays, described) != checksum:
            raise ReferenceFileError(
                f"{path} is damaged: its checksum does not match its contents"
                + ("" if version == 1 else " (its arrays and its manifest's configuration, steps, seed and streams)")
            )
        for name in names:  # G and every line's output hold the stream's steps of W0's batch
            W0, n_steps = arrays[f"{name}/W0"], stream_steps[name]
            lead = (n_steps, *W0.shape[:-2])
            wrong = [k for k in QUANTITIES if arrays[f"{name}/{k}"].shape[: len(lead)] != lead]
            if W0.ndim < 2 or arrays[f"{name}/G"].shape != (n_steps, *W0.shape) or wrong:
                shapes = ", ".join(f"{k} {arrays[f'{name}/{k}'].shape}" for k in ("W0", "G", *wrong[:1]))
                raise ReferenceFileError(
                    f"{path} is damaged: stream {name!r} does not hold {n_steps} steps of W0's shape ({shapes})"
                )
        try:
            optimizer_from_config(config)
        except (TypeError, ValueError, KeyError, AttributeError, OverflowError) as exc:
            raise ReferenceFileError(
                f"{path} is incompatible: its FISMO configuration cannot be built by fismo {__version__} ({exc})"
            ) from exc
        streams = [
            Stream(s["name"], arrays[f"{s['name']}/W0"], arrays[f"{s['name']}/G"], s.get("description", ""))
            for s in stream_info
        ]
        outputs = {s.name: {q: arrays[f"{s.name}/{q}"] for q in QUANTITIES} for s in streams}
        return cls(config, steps, seed, streams, outputs, library_version=lib, format_version=version)


# --------------------------------------------------------------- verify
@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
    """The BLAS and OpenMP pools of NumPy and torch on one thread while verifying (restored after).

    The matrices are at most 72 wide: thread pools gain nothing on them, and
    their spinning workers made verification several times slower on a
    2-core machine (torch: 17 s against 1.3 s; NumPy's OpenBLAS on the 48- and
    64-wide factors: 4 s against 1 s; measured with other work running).
    Results do not depend on it. NumPy's OpenBLAS is reached through
    ``threadpoolctl`` when it is installed (it comes with scikit-learn).
    """
    with contextlib.ExitStack() as stack:
        try:
            from threadpoolctl import threadpool_limits
        except ImportError:
            pass
        else:
            stack.enter_context(threadpool_limits(limits=1))
        torch = _loaded("torch")  # None when missing or broken (its targets are then skipped)
        if torch is not None:
            threads = torch.get_num_threads()
            torch.set_num_threads(1)
            stack.callback(torch.set_num_threads, threads)
        yield


def _verify_target(
    optimizer: FISMO, target: Target, reference: Reference, stepper: Optional[Callable[..., Any]] = None
) -> Result:
    import numpy as np

    tolerance = target.tolerance
    worst = 0.0
    first: Optional[tuple[str, int, int, Any]] = None
    stepper = _stepper(optimizer, target) if stepper is None else stepper
    for stream in reference.streams:
        try:
            got = run_stream(optimizer, stream, target.asarray, stepper)
        except _StreamError as exc:
            return Result(target, math.inf, tolerance, exception=str(exc), where=f"{stream.name} step {exc.step}",
                          steps=reference.steps)
        errors = line_errors(got, reference.outputs[stream.name], stream.W0)
        worst = max(worst, float(errors.max(initial=0.0)))
        if first is None:
            bad = np.argwhere(~(errors <= tolerance))  # row-major: the first step, then its first line
            if bad.size:
                t, q = bad[0]
                first = (stream.name, int(t), int(q), errors[t])
    if first is None:
        return Result(target, worst, tolerance, steps=reference.steps)
    name, t, q, row = first
    details = {LINES[k]: float(e) for k, e in zip(QUANTITIES, row)}
    return Result(target, worst, tolerance, where=f"{name} step {t + 1}: {LINES[QUANTITIES[q]]}",
                  steps=reference.steps, details=details)


_POOL: Any = None


def _jax_pool() -> Any:
    """One worker process for the JAX targets, started once per process and kept (its compiled steps with it).

    JAX compiles one XLA program per shape and dtype, about 1 s of CPU each
    and most of the JAX rows' time; compiling holds Python's lock much of the
    time, so threads do not overlap it with the other backends, but a
    process does: on two cores the JAX rows then run while NumPy,
    array-api-strict and torch are checked. The process is started with
    ``spawn`` (safe after torch and JAX have started threads) and imports
    JAX while this process computes the reference.
    """
    global _POOL
    if _POOL is None:
        import atexit
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        _POOL = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"), initializer=_jax_worker_init)
        atexit.register(_shut_jax_pool)
    return _POOL


def _shut_jax_pool() -> None:
    """Stop the JAX worker at exit, while the interpreter is whole.

    Left to the garbage collector, the executor is finalised during the
    interpreter's teardown, when its callbacks find modules already gone
    and print ``Exception ignored in: ... weakref_cb``.
    """
    global _POOL
    if _POOL is not None:
        _POOL.shutdown(wait=True, cancel_futures=True)
        _POOL = None


#: How long the time line waits for the JAX worker to report its CPU time (it answers in milliseconds).
_WORKER_ANSWER_SECONDS = 30.0


def _worker_cpu_seconds() -> Optional[float]:
    """CPU seconds the JAX worker has used so far: 0 when it has not been started, ``None`` when it ended
    early (killed, out of memory; `verify` then checked JAX in this process) or did not answer in
    ``_WORKER_ANSWER_SECONDS`` (the time line is not worth a hang)."""
    from concurrent.futures import TimeoutError as NoAnswer
    from concurrent.futures.process import BrokenProcessPool

    if _POOL is None:
        return 0.0
    try:
        return _POOL.submit(time.process_time).result(timeout=_WORKER_ANSWER_SECONDS)
    except (BrokenProcessPool, NoAnswer):  # the time line raised these, a traceback under the finished table
        return None


def _time_taken(wall_start: float, cpu_start: float, worker_start: Optional[float]) -> str:
    """The line ``fismo verify`` ends with: wall time, and CPU time here and in the JAX worker.

    CPU time is what carries over between machines of the same speed: the
    wall time also depends on how many cores are free (on 2 busy cores it
    grows two- to four-fold, the CPU time barely).
    """
    wall = time.perf_counter() - wall_start
    here = time.process_time() - cpu_start
    worker_now = _worker_cpu_seconds()
    if worker_now is None or worker_start is None:
        return (f"time: {wall:.1f} s wall, {here:.1f} s CPU in this process (the JAX worker ended early or "
                "did not answer: its CPU time is unknown)")
    worker = worker_now - worker_start
    return (f"time: {wall:.1f} s wall, {here + worker:.1f} s CPU ({here:.1f} s in this process, "
            f"{worker:.1f} s in the JAX worker)")


def _jax_worker_init() -> None:
    end_quietly_on_interrupt()
    targets(backends=["jax"])  # imports JAX now, while the parent computes the reference (x64: at first use)


def _jax_worker(optimizer: FISMO, ids: Sequence[str], reference: Reference) -> list[dict[str, Any]]:
    """Run in the worker: verify the JAX targets ``ids``; results as plain dicts (a `Target` does not pickle)."""
    by_id = {t.id: t for t in targets(backends=["jax"])}
    out = []
    with full_float32_matmuls(), _one_thread():
        for target_id in ids:
            target = by_id[target_id]
            try:
                r = _verify_target(optimizer, target, reference)
            except Exception as exc:
                r = Result(target, math.inf, target.tolerance, exception=f"{type(exc).__name__}: {exc}",
                           steps=reference.steps)
            out.append({f.name: getattr(r, f.name) for f in dataclasses.fields(r) if f.name != "target"})
    return out


def verify(
    *,
    steps: int = 50,
    seed: int = 0,
    optimizer: Optional[FISMO] = None,
    reference: Optional[Reference] = None,
    streams: Optional[Sequence[Stream]] = None,
    targets: Optional[Sequence[Target]] = None,
    jax_process: bool = False,
) -> Report:
    """Check every target against the NumPy float64 reference; unavailable ones come back with ``error=None``.

    Without ``reference``, it is computed here from ``streams`` (default
    `default_streams` of ``steps`` and ``seed``) with ``optimizer``
    (default ``FISMO()``). With ``reference`` (e.g. `Reference.load`), its
    streams are run with ``optimizer`` or, by default, the optimizer the
    reference was made with. ``targets`` defaults to every target
    (`fismo_core.testing.targets`); unavailable ones are reported as skipped.

    ``jax_process=True`` (what ``fismo verify`` uses) checks the JAX targets
    in a worker process, in parallel with the others (see `_jax_pool`). It
    starts the worker with ``spawn``, which imports the calling script again:
    call it from a script only under ``if __name__ == "__main__":``. If the
    worker cannot take the optimizer (a class it cannot import), JAX is
    checked in this process.
    """
    if importlib.util.find_spec("numpy") is None:
        raise RuntimeError("fismo verify needs NumPy, the reference backend: pip install 'fismo[numpy]'")
    steps = _check_integer("steps", steps)
    report = Report()
    with full_float32_matmuls(), _one_thread():
        if reference is None:
            optimizer = optimizer or FISMO()
            chosen = default_streams(steps, seed) if streams is None else list(streams)
        else:
            optimizer = optimizer or reference.optimizer()
            chosen = reference.streams
        chosen_targets = _all_targets() if targets is None else list(targets)
        jax_ids = [t.id for t in chosen_targets if t.available and t.backend == "jax"]
        pool = _jax_pool() if jax_process and jax_ids else None  # starts importing JAX now
        if reference is None:
            reference = Reference.compute(optimizer, chosen, steps=steps, seed=seed)
        jax_results = None
        pending: list[int] = []  # the rows the JAX worker answers
        if pool is not None:
            try:
                jax_results = pool.submit(_jax_worker, optimizer, jax_ids, reference)
            except Exception:  # e.g. an optimizer that cannot be pickled: check JAX here instead
                jax_results = None
        for target in chosen_targets:
            if not target.available:
                report.append(Result(target, None, target.tolerance))
            elif target.backend != "jax" or jax_results is None:
                try:
                    report.append(_verify_target(optimizer, target, reference))
                except Exception as exc:  # anything else a backend raises fails its row, not the run
                    report.append(Result(target, math.inf, target.tolerance,
                                         exception=f"{type(exc).__name__}: {exc}", steps=reference.steps))
            else:
                pending.append(len(report))  # filled in below, from the JAX worker's answer
                report.append(Result(target, None, target.tolerance))
        if jax_results is not None:
            try:
                done = dict(zip(jax_ids, jax_results.result()))
            except Exception:  # the worker could not run (pickling, a broken process): check JAX here
                done = {}
                for t in chosen_targets:
                    if t.id in jax_ids:
                        r = _verify_target(optimizer, t, reference)
                        done[t.id] = {f.name: getattr(r, f.name) for f in dataclasses.fields(r) if f.name != "target"}
            for i in pending:
                report[i] = Result(report[i].target, **done[report[i].target.id])
    report.reference = reference  # type: ignore[attr-defined]
    return report


def format_table(results: Sequence[Result]) -> str:
    """The results as the fixed-width text table of ``fismo verify``."""
    return Report(results).table()


def _describe(reference: Reference) -> str:
    lines = []
    for s in reference.streams:
        lines.append(f"  {s.name:<16s} {'x'.join(map(str, s.shape)):<10s} {s.steps:>3d} steps  {s.description}")
    return "\n".join(lines)


def main(
    *,
    steps: int = 50,
    seed: int = 0,
    save: Optional[str] = None,
    against: Optional[str] = None,
    explain: bool = False,
    out: Optional[TextIO] = None,
    err: Optional[TextIO] = None,
) -> int:
    """``fismo verify``: print the table; return 0 if every available target passed, 1 if not, 2 for a bad reference file."""
    out = sys.stdout if out is None else out
    err = sys.stderr if err is None else err
    started = (time.perf_counter(), time.process_time(), _worker_cpu_seconds())
    if importlib.util.find_spec("numpy") is None:
        print("fismo verify: needs NumPy, the reference backend: pip install 'fismo[numpy]'", file=err)
        return 2
    if save is not None and (not save or save.endswith(("/", os.sep))):  # Path() drops the slash: "x.npz/" passed
        what = "it is empty" if not save else f"it names a directory (it ends with {save[-1]!r})"
        print(f"fismo verify: --save {save!r}: {what}; give a file name, e.g. reference.npz", file=err)
        return 2
    parent = None if save is None else Path(save).resolve().parent
    if parent is not None and not parent.is_dir():
        blocking = next((p for p in (parent, *parent.parents) if p.exists()), None)
        why = f"{blocking} is a file, not a directory" if blocking is not None and not blocking.is_dir() \
            else f"directory {parent} does not exist"
        print(f"fismo verify: cannot write {save}: {why}", file=err)
        return 2
    if save is not None and Path(save).is_dir():  # refused before the run, not after it
        print(f"fismo verify: cannot write {save}: it is a directory (give a file name, e.g. {Path(save) / 'reference.npz'})", file=err)
        return 2
    if save is not None and Path(save).exists() and not Path(save).is_file():  # a device: it was replaced
        print(f"fismo verify: cannot write {save}: it exists and is not a regular file", file=err)
        return 2
    if parent is not None and (reason := cannot_write_in(parent)) is not None:
        print(f"fismo verify: cannot write {save}: {reason} in {parent}", file=err)
        return 2
    if against is not None:
        try:
            reference = Reference.load(against)
        except ReferenceFileError as exc:
            print(f"fismo verify: {exc}", file=err)
            return 2
        print(f"FISMO verification against {against} ({reference.checksum}, made by fismo "
              f"{reference.library_version}; this is fismo {__version__}):", file=out)
        report = verify(steps=reference.steps, seed=reference.seed, reference=reference, jax_process=True)
    else:
        report = verify(steps=steps, seed=seed, jax_process=True)
        reference = report.reference  # type: ignore[attr-defined]
        print("FISMO verification against NumPy float64, FISMO() defaults:", file=out)
    print(_describe(reference) + "\n", file=out)
    print(report.table(), file=out)
    if explain and report.failed:
        print("\nPer-line relative errors at the first failure of each failed target:\n", file=out)
        print(report.explain(), file=out)
    print(f"\n{report.summary()}", file=out)
    print(_time_taken(*started), file=out)
    if save is not None:
        try:
            checksum = reference.save(save)
        except OSError as exc:
            print(f"fismo verify: cannot write {save}: {exc}", file=err)
            return 2
        print(f"wrote the reference to {save} ({checksum})", file=out)
    return 0 if report.ok else 1
