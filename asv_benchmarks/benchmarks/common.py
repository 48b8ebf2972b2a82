"""Shared set-up for the benchmarks and for ``docs/scripts/performance.py``.

One optimizer step of every kind the suite times, as a zero-argument callable that advances
its own parameters and state (so an amortised variant really recomputes its roots on every
``k``-th call): FISMO in several configurations on every installed backend, and the anchors
``torch.optim.Muon`` (as shipped: its Newton–Schulz runs in bfloat16), the same iteration in
float32, ``torch.optim.AdamW``, Shampoo, blocked Shampoo and SOAP from pytorch-optimizer, and
SOAP and KL-Shampoo from heavyball, each if installed.

Besides single shapes, *model sets* (``MODEL_SETS``) time one step over all the weight matrices
of real models: two GPT-2-small layers and LLaMA-like MLP matrices.
"""

from __future__ import annotations

import math
import os
import statistics
import time
from collections.abc import Callable
from typing import Optional

import numpy as np

from fismo_core import FISMO
from fismo_core.optimizer import TRAINING, training_options
from fismo_core.perf import step_flops
from fismo_core.testing import targets

#: The shapes of the issue: square, large square, wide, tall, and a batch of 16.
SHAPES = ["256x256", "1024x1024", "768x3072", "3072x768", "16x512x512"]

#: Targets timed (``fismo_core.testing`` ids: backend-device-dtype); each is skipped, with the
#: reason, where its library or device is missing. The GPU ones run on a CUDA machine.
BACKENDS = [
    "numpy-cpu-float64",
    "numpy-cpu-float32",
    "torch-cpu-float32",
    "jax-cpu-float32",
    "torch-cuda-float32",
    "cupy-cuda-float32",
    "jax-gpu-float32",
]

#: Devices of the torch benchmarks (anchors, targets).
TORCH_DEVICES = ["cpu", "cuda"]

#: FISMO configurations by name. "default": ``FISMO()``, exact roots with their fault checks and
#: the finiteness check (host reads). "eigh": exact roots, no host reads (``nonfinite="propagate"``),
#: the fastest faithful configuration on a CPU. "newton_schulz": matmul-only roots (Polar Express,
#: 9 steps), no host reads, the fast path for accelerators. "eigh-every10": roots recomputed every
#: 10 steps (``InverseRootConfig(every=10)``), not Algorithm 1; one call is a cycle of 10 steps.
VARIANTS: dict[str, dict] = {
    "default": {},
    "eigh": {"nonfinite": "propagate"},
    "newton_schulz": {"nonfinite": "propagate", "inv_root": "newton_schulz"},
    "eigh-every10": {"nonfinite": "propagate", "inv_root": {"every": 10}},
}

#: Block sizes of the blocked configurations (``FISMO(block_size=B)``).
BLOCK_SIZES = [256, 512, 768, 1024]
#: Blocked FISMO: "eigh-B768" is "eigh" with ``block_size=768``. "-bf16" runs the polar factor's
#: Newton–Schulz iteration in bfloat16 (``PolarConfig(dtype="bfloat16")``), as torch.optim.Muon
#: does: the like-for-like comparison with it.
for _B in BLOCK_SIZES:
    VARIANTS[f"eigh-B{_B}"] = {"nonfinite": "propagate", "block_size": _B}
    VARIANTS[f"eigh-B{_B}-bf16"] = {"nonfinite": "propagate", "block_size": _B, "polar": {"dtype": "bfloat16"}}
VARIANTS["eigh-bf16"] = {"nonfinite": "propagate", "polar": {"dtype": "bfloat16"}}
#: Matmul-only roots of the blocks (Polar Express), for accelerators: "newton_schulz-B768" etc.
for _B in BLOCK_SIZES:
    VARIANTS[f"newton_schulz-B{_B}"] = {"nonfinite": "propagate", "inv_root": "newton_schulz", "block_size": _B}
#: The configurations of the single-shape benchmarks (``FISMOStep``): the blocked ones are timed
#: on the model sets.
STEP_VARIANTS = ["default", "eigh", "newton_schulz", "eigh-every10"]

#: The weight matrices of real models, each (m, n) as a FISMO step sees it (GPT-2's Conv1D
#: layout, in x out). "gpt2-2layers": two GPT-2-small layers (attention in 768x2304, attention
#: out 768x768, MLP 768x3072 and 3072x768); "llama-2048x5504": a LLaMA-like MLP matrix;
#: "llama-4096x11008": a LLaMA-7B MLP matrix (asv only: 1.4 GB of full-FISMO state and minutes
#: per step on a small machine).
GPT2_LAYER = [(768, 2304), (768, 768), (768, 3072), (3072, 768)]
MODEL_SETS: dict[str, list[tuple[int, int]]] = {
    "gpt2-2layers": GPT2_LAYER * 2,
    "llama-2048x5504": [(2048, 5504)],
    "llama-4096x11008": [(4096, 11008)],
}

#: The anchors' names: torch.optim.Muon as shipped, its iteration in float32, AdamW, and from
#: pytorch-optimizer Shampoo (inverse roots every step) and SOAP (its default precondition
#: frequency, 10: one call is a cycle of 10 steps).
ANCHORS = ["muon", "muon-float32", "adamw", "shampoo", "soap"]

#: All anchors of the model sets: the above, and pytorch-optimizer's ScalableShampoo (blocks of
#: 512, its default; roots every step), heavyball's SOAP and KL-Shampoo (their defaults: factors
#: of sides up to 2048 (``max_precond_dim``), eigenbases refreshed every 2 steps; run eagerly).
MODEL_ANCHORS = ANCHORS + ["scalable-shampoo", "heavyball-soap", "heavyball-klshampoo"]

#: Steps per call of the amortised optimizers (a whole cycle, so that a call's time is typical).
CYCLE = {"eigh-every10": 10, "soap": 10, "heavyball-soap": 2, "heavyball-klshampoo": 2}

#: The training configuration ("FISMO-T": ``FISMO.training()``, roots every 10 steps) as the torch
#: optimizer runs it where bfloat16 is native, in ``torch.optim.Muon``'s bfloat16 (the polar factor and
#: the preconditioners' products, ``inv_root={"matmul_dtype": "bfloat16"}``), blocked: "training-B768";
#: "-fp32", as it runs where bfloat16 is emulated (both in the parameters' dtype). Both are
#: ``fismo_core.backends.torch.training_precision``'s, which tests/test_overhead.py checks.
#: "-fp32mm" keeps the products in the parameters' dtype (the configuration before 2026-11-27). Its default
#: ``nonfinite="raise"`` is kept (the finiteness check and the roots' checks, with their host reads).
#: One call is a cycle of 10 steps.
TRAINING_BLOCK_SIZES = [512, 768, 1024]
for _B in TRAINING_BLOCK_SIZES:
    VARIANTS[f"training-B{_B}"] = training_options(
        TRAINING, {"polar": {"dtype": "bfloat16"}, "block_size": _B, "inv_root": {"matmul_dtype": "bfloat16"}}
    )
    VARIANTS[f"training-B{_B}-fp32mm"] = training_options(TRAINING, {"polar": {"dtype": "bfloat16"}, "block_size": _B})
    VARIANTS[f"training-B{_B}-fp32"] = training_options(TRAINING, {"block_size": _B})
    CYCLE[f"training-B{_B}"] = CYCLE[f"training-B{_B}-fp32mm"] = CYCLE[f"training-B{_B}-fp32"] = TRAINING["inv_root"]["every"]

#: ``FISMO_ASV_SMOKE=1`` shrinks the grid to one small shape per backend: CI's smoke run.
SMOKE = os.environ.get("FISMO_ASV_SMOKE") == "1"
if SMOKE:
    # One target per library, on the CPU: each parameter combination is a process of its own (about
    # 4 s of imports on a 2-core CI machine), and a GPU target would only be skipped there.
    BACKENDS = ["numpy-cpu-float64", "torch-cpu-float32", "jax-cpu-float32"]
    TORCH_DEVICES = ["cpu"]
    SHAPES = ["64x96"]
    BLOCK_SIZES = [32]
    MODEL_SETS = {"tiny": [(32, 96), (96, 32)]}
    VARIANTS["eigh-B32"] = {"nonfinite": "propagate", "block_size": 32}

#: The FISMO configurations of the model sets: full (exact roots, no host reads) and blocked with
#: each block size, each with the polar iteration in float32 and in bfloat16.
MODEL_VARIANTS = ["eigh", "eigh-bf16"] + [f"eigh-B{B}" for B in BLOCK_SIZES] + [f"eigh-B{B}-bf16" for B in BLOCK_SIZES]
MODEL_VARIANTS += [f"training-B{B}{suffix}" for B in TRAINING_BLOCK_SIZES for suffix in ("", "-fp32mm", "-fp32")]
if SMOKE:
    MODEL_VARIANTS = ["eigh-B32"]
    MODEL_ANCHORS = ["muon-float32"]


def parse_shape(name: str) -> tuple[int, ...]:
    return tuple(int(v) for v in name.split("x"))


def sizes(*names: str) -> list[str]:
    """``names``, or the smoke grid's single small size."""
    return ["64"] if SMOKE else list(names)


def target(target_id: str):
    """The target ``backend-device-dtype``, or ``NotImplementedError`` (asv's skip) if unavailable."""
    for t in targets():
        if t.id == target_id:
            if not t.available:
                raise NotImplementedError(t.reason)
            return t
    raise NotImplementedError(f"no target {target_id} on this machine")


def torch_device(device: str):
    """torch and the device, or ``NotImplementedError`` (asv's skip) if either is missing."""
    try:
        import torch
    except ImportError as exc:
        raise NotImplementedError("torch is not installed") from exc
    if device == "cuda" and not torch.cuda.is_available():
        raise NotImplementedError("torch reports no CUDA device")
    return torch, torch.device(device)


def random_matrix(shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape) / np.sqrt(shape[-1])


def random_spd(shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    """SPD matrices ``(..., d, d)`` with trace d, like FISMO's P and Q."""
    X = random_matrix(shape, seed)
    d = shape[-1]
    A = X @ np.swapaxes(X, -1, -2) / d + 1e-3 * np.eye(d)
    return d * A / np.trace(A, axis1=-2, axis2=-1)[..., None, None]


def block(x) -> None:
    """Wait for asynchronous backends (JAX, CUDA) to finish, so timings cover the work."""
    ready = getattr(x, "block_until_ready", None)
    if ready is not None:
        ready()
        return
    module = type(x).__module__
    if module.startswith("torch") and x.is_cuda:
        import torch

        torch.cuda.synchronize(x.device)
    elif module.startswith("cupy"):
        import cupy

        cupy.cuda.get_current_stream().synchronize()


def fismo_step(variant: str, backend: str, shape: tuple[int, ...], *, separate: bool = False) -> Callable[[], None]:
    """One step of ``FISMO(**VARIANTS[variant])`` through the core (one call per step; a cycle of
    10 for "eigh-every10"), on ``backend`` (a target id: "numpy-cpu-float64", "torch-cuda-float32",
    ...), advancing W and the state. JAX runs the step under ``jax.jit``. ``separate=True`` with a batch shape
    ``(B, m, n)`` makes B separate calls instead of one batched call.

    The gradient is fixed (a seeded Gaussian of RMS 1/sqrt(n)); one warm-up step runs first, so
    that P and Q are off the identity.
    """
    t = target(backend)
    opt = make_fismo(variant)
    W = t.asarray(random_matrix(shape, seed=0))
    G = t.asarray(random_matrix(shape, seed=1))
    step = opt.step
    if t.backend == "jax":
        if opt.inv_root.every > 1:
            raise NotImplementedError("an amortised step under jax.jit needs refresh_roots per call: not timed")
        import jax

        step = jax.jit(opt.step)
    if separate:
        if len(shape) != 3:
            raise ValueError("separate calls need a batch shape (B, m, n)")
        items = [[W[i, ...], G[i, ...], opt.init(W[i, ...])] for i in range(shape[0])]
    else:
        items = [[W, G, opt.init(W)]]
    for item in items:  # warm-up (and jit compilation)
        item[0], item[2] = step(*item)
        block(item[0])
    calls = CYCLE.get(variant, 1)

    def run() -> None:
        for _ in range(calls):
            for item in items:
                item[0], item[2] = step(*item)
        block(items[-1][0])

    return run


def make_fismo(variant: str) -> FISMO:
    """``FISMO(**VARIANTS[variant])``, or ``NotImplementedError`` (asv's skip) where this version of
    the core lacks an option the variant needs (``block_size``, the polar's ``dtype``)."""
    try:
        return FISMO(**VARIANTS[variant])
    except TypeError as exc:
        raise NotImplementedError(f"FISMO{VARIANTS[variant]} is not supported by this core: {exc}") from exc


def model_fismo_step(
    variant: str, model: str, backend: str = "torch-cpu-float32", shapes: Optional[list] = None
) -> Callable[[], None]:
    """One step of ``FISMO(**VARIANTS[variant])`` over every matrix of ``MODEL_SETS[model]`` (or
    of ``shapes``), the matrices of one shape batched in one call of the core (as the torch
    optimizer buckets them). A call is one step (a cycle for the amortised variants); one warm-up
    step runs first."""
    t = target(backend)
    opt = make_fismo(variant)
    counts: dict[tuple[int, int], int] = {}
    for shape in MODEL_SETS[model] if shapes is None else shapes:
        counts[shape] = counts.get(shape, 0) + 1
    items = []
    for i, ((m, n), k) in enumerate(counts.items()):
        shape = (k, m, n) if k > 1 else (m, n)
        W = t.asarray(random_matrix(shape, seed=2 * i))
        items.append([W, t.asarray(random_matrix(shape, seed=2 * i + 1)), opt.init(W)])
    for item in items:
        item[0], item[2] = opt.step(*item)
    block(items[-1][0])
    calls = CYCLE.get(variant, 1)

    def run() -> None:
        for _ in range(calls):
            for item in items:
                item[0], item[2] = opt.step(*item)
        block(items[-1][0])

    return run


def muon_float32_step(params: list, momentum: float = 0.95, lr: float = 0.02, steps: int = 5) -> Callable[[], None]:
    """``torch.optim.Muon``'s update (EMA momentum by ``lerp_``, its quintic by ``torch.addmm``,
    its shape-dependent lr) with the Newton–Schulz iteration in float32 instead of bfloat16: the
    twin FISMO is compared with, at the same dtype and number of steps."""
    import torch

    a, b, c = 3.4445, -4.7750, 2.0315
    buffers = [torch.zeros_like(p) for p in params]

    @torch.no_grad()
    def run() -> None:
        for p, buf in zip(params, buffers):
            buf.lerp_(p.grad, 1 - momentum)
            X = buf.T if p.shape[0] > p.shape[1] else buf
            X = X / X.norm().clamp(min=1e-7)
            for _ in range(steps):
                gram = X @ X.T
                X = torch.addmm(X, torch.addmm(gram, gram, gram, beta=b, alpha=c), X, beta=a)
            update = X.T if p.shape[0] > p.shape[1] else X
            p.add_(update, alpha=-lr * math.sqrt(max(1, p.shape[0] / p.shape[1])))

    return run


def anchor_step(name: str, shape, device: str = "cpu") -> Callable[[], None]:
    """One step of an anchor optimizer on torch float32 parameters of ``shape`` (a batch
    ``(B, m, n)`` is B parameters: torch.optim.Muon takes matrices only), or of each shape of a
    list of shapes (a model set). ``NotImplementedError`` if its package or the device is missing."""
    torch, dev = torch_device(device)
    if isinstance(shape, list):
        matrices = shape
    else:
        matrices = [shape] if len(shape) == 2 else [shape[1:]] * shape[0]
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter((torch.randn(*s, generator=gen) / math.sqrt(s[-1])).to(dev)) for s in matrices]
    grads = [(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1])).to(dev) for p in params]
    for p, g in zip(params, grads):
        p.grad = g
    if name == "muon":
        opt = torch.optim.Muon(params, lr=0.02, momentum=0.95, nesterov=False, weight_decay=0.0)
    elif name == "muon-float32":
        twin = muon_float32_step(params)

        def run() -> None:
            twin()
            block(params[-1])

        run()
        return run
    elif name == "adamw":
        opt = torch.optim.AdamW(params, lr=1e-3)
    elif name in ("shampoo", "soap"):
        try:
            import pytorch_optimizer
        except ImportError as exc:
            raise NotImplementedError("pytorch-optimizer is not installed (pip install pytorch-optimizer)") from exc
        if name == "shampoo":
            opt = pytorch_optimizer.Shampoo(params, lr=1e-3, preconditioning_compute_steps=1)
        else:
            opt = pytorch_optimizer.SOAP(params, lr=3e-3)  # precondition_frequency=10, its default
    elif name == "scalable-shampoo":
        try:
            import pytorch_optimizer
        except ImportError as exc:
            raise NotImplementedError("pytorch-optimizer is not installed (pip install pytorch-optimizer)") from exc
        # Its default blocks (block_size=512); roots every step from the first (its defaults, 1000
        # and 25, would time mostly its grafted SGD).
        opt = pytorch_optimizer.ScalableShampoo(
            params, lr=1e-3, preconditioning_compute_steps=1, start_preconditioning_step=1
        )
    elif name in ("heavyball-soap", "heavyball-klshampoo"):
        try:
            import heavyball
            import heavyball.utils
        except ImportError as exc:
            raise NotImplementedError("heavyball is not installed (pip install heavyball)") from exc
        # Eager: compiling its step (its default, mode max-autotune) takes minutes per shape on a CPU.
        heavyball.utils.compile_mode = None
        cls = heavyball.SOAP if name == "heavyball-soap" else heavyball.KLShampoo
        opt = cls(params, lr=1e-3)  # max_precond_dim=2048, precondition_frequency=2: its defaults
    else:
        raise ValueError(f"unknown anchor {name!r}")
    def one_step() -> None:
        for p, g in zip(params, grads):  # heavyball consumes .grad (sets it to None) in its step
            p.grad = g
        opt.step()

    for _ in range(2):  # warm-up; SOAP sets up its eigenbases on its first steps
        one_step()
    calls = CYCLE.get(name, 1)

    def run() -> None:
        for _ in range(calls):
            one_step()
        block(params[-1])

    return run


def interleaved_medians(fns: dict[str, Callable[[], None]], repeats: int, *, warmup: bool = True) -> dict[str, float]:
    """Median seconds per call of each function, timed in turn (A B C A B C ...), one warm-up
    call each first (``warmup=False``: none, for callables that warmed up when they were made):
    the functions see the same machine state, so their ratios are fair on a noisy machine."""
    for fn in fns.values() if warmup else ():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def flops_per_step(variant: str, m: int, n: int) -> float:
    """Operations of one step of ``FISMO(**VARIANTS[variant])`` on an ``m x n`` matrix
    (``fismo_core.perf.step_flops``), averaged over a cycle of ``InverseRootConfig.every`` steps:
    one step recomputes the roots, the others reuse them."""
    opt = FISMO(**VARIANTS[variant])
    every = opt.inv_root.every
    refresh = step_flops(m, n, opt)["total"]
    cached = step_flops(m, n, opt, refresh_roots=False)["total"] if every > 1 else 0
    return (refresh + (every - 1) * cached) / every


def steps_per_call(name: str) -> int:
    """How many optimizer steps one call of ``fismo_step(name)`` or ``anchor_step(name)`` makes."""
    return CYCLE.get(name, 1)
