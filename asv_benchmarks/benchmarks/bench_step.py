"""A full optimizer step: FISMO on every installed backend, the anchors, and the targets of the
documentation page "Performance" as ``track_`` benchmarks (ratios measured within one process).

A call of the amortised variants ("eigh-every10" and the anchor "soap") is a whole cycle of 10
steps; the ``track_`` benchmarks divide by it.
"""

from __future__ import annotations

from .common import (
    ANCHORS,
    BACKENDS,
    BLOCK_SIZES,
    MODEL_ANCHORS,
    MODEL_SETS,
    MODEL_VARIANTS,
    SHAPES,
    SMOKE,
    STEP_VARIANTS,
    TORCH_DEVICES,
    VARIANTS,
    anchor_step,
    fismo_step,
    flops_per_step,
    interleaved_medians,
    model_fismo_step,
    parse_shape,
    steps_per_call,
    torch_device,
)

#: Shapes of the ratio and FLOP-rate targets; the batch of the batched-call target.
TARGET_SHAPES = ["64x96"] if SMOKE else ["1024x1024", "768x3072"]
BATCH = "4x32x48" if SMOKE else "16x512x512"
#: Interleaved repeats per ratio (medians); a smoke run needs only to run.
REPEATS = 2 if SMOKE else 7


class FISMOStep:
    params = (STEP_VARIANTS, BACKENDS, SHAPES)
    param_names = ["variant", "backend", "shape"]
    timeout = 900

    def setup(self, variant, backend, shape):
        self.run = fismo_step(variant, backend, parse_shape(shape))

    def time_step(self, variant, backend, shape):
        self.run()

    def peakmem_step(self, variant, backend, shape):
        self.run()


class Anchors:
    """torch.optim.Muon (bfloat16 iteration, as shipped), the same in float32, torch.optim.AdamW,
    and Shampoo and SOAP from pytorch-optimizer: torch float32, on the CPU and on CUDA."""

    params = (ANCHORS, SHAPES, TORCH_DEVICES)
    param_names = ["optimizer", "shape", "device"]
    timeout = 600

    def setup(self, optimizer, shape, device):
        self.run = anchor_step(optimizer, parse_shape(shape), device)

    def time_step(self, optimizer, shape, device):
        self.run()

    def peakmem_step(self, optimizer, shape, device):
        self.run()


class Targets:
    """The targets of issue #5 on torch float32 (CPU; CUDA where present), each measured within
    one process."""

    params = (["eigh", "newton_schulz", "eigh-every10"], TARGET_SHAPES, TORCH_DEVICES)
    param_names = ["variant", "shape", "device"]
    timeout = 1800

    def setup(self, variant, shape, device):
        dims = parse_shape(shape)
        fismo = fismo_step(variant, f"torch-{device}-float32", dims)
        muon = anchor_step("muon-float32", dims, device)
        self.medians = interleaved_medians({"fismo": fismo, "muon": muon}, REPEATS)
        self.per_step = self.medians["fismo"] / steps_per_call(variant)
        self.flops = flops_per_step(variant, *dims[-2:])

    def track_ratio_to_muon_float32(self, variant, shape, device):
        return self.per_step / self.medians["muon"]

    track_ratio_to_muon_float32.unit = "FISMO step / Muon float32 step"

    def track_gflops(self, variant, shape, device):
        return self.flops / self.per_step / 1e9

    track_gflops.unit = "GFLOP/s (eigh counted as 9 d^3)"


class MatmulRate:
    """The matmul FLOP rate of this machine (torch float32), the yardstick of track_gflops."""

    params = (TARGET_SHAPES, TORCH_DEVICES)
    param_names = ["shape", "device"]

    def setup(self, shape, device):
        torch, dev = torch_device(device)
        m, n = parse_shape(shape)
        a, b = torch.randn(m, n, device=dev), torch.randn(n, n, device=dev)
        sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
        self.seconds = interleaved_medians({"mm": lambda: (a @ b, sync())}, 5 * REPEATS)["mm"]
        self.flops = 2 * m * n * n

    def track_matmul_gflops(self, shape, device):
        return self.flops / self.seconds / 1e9

    track_matmul_gflops.unit = "GFLOP/s"


class Batched:
    """One batched call on the same-shape matrices of ``BATCH`` (16 of 512 x 512; 4 in the smoke grid) against
    one call per matrix (the core, eigh roots)."""

    params = [["torch-cpu-float32", "numpy-cpu-float32", "torch-cuda-float32", "cupy-cuda-float32"]]
    param_names = ["backend"]
    timeout = 900

    def setup(self, backend):
        dims = parse_shape(BATCH)
        self.medians = interleaved_medians(
            {
                "batched": fismo_step("eigh", backend, dims),
                "separate": fismo_step("eigh", backend, dims, separate=True),
            },
            REPEATS,
        )

    def track_separate_over_batched(self, backend):
        return self.medians["separate"] / self.medians["batched"]

    track_separate_over_batched.unit = "separate calls / 1 batched call"


def model_step(name: str, model: str, device: str):
    """One step of FISMO variant or anchor ``name`` over the matrices of ``MODEL_SETS[model]``."""
    if name in VARIANTS:
        return model_fismo_step(name, model, f"torch-{device}-float32")
    return anchor_step(name, MODEL_SETS[model], device)


class ModelStep:
    """One step over all the weight matrices of a real model (two GPT-2-small layers; LLaMA-like
    MLP matrices), torch float32: FISMO full and blocked (float32 and bfloat16 polar iteration),
    the anchors, and pytorch-optimizer's blocked Shampoo and heavyball's SOAP and KL-Shampoo.
    A call of an amortised optimizer is a whole cycle (``CYCLE``)."""

    params = (MODEL_VARIANTS + MODEL_ANCHORS, list(MODEL_SETS), TORCH_DEVICES)
    param_names = ["optimizer", "model", "device"]
    timeout = 3600

    def setup(self, optimizer, model, device):
        self.run = model_step(optimizer, model, device)

    def time_step(self, optimizer, model, device):
        self.run()

    def peakmem_step(self, optimizer, model, device):
        self.run()


#: The blocked configurations of the targets: B = 768 on GPT-2, B = 1024 on the LLaMA shapes.
MODEL_TARGETS = [f"eigh-B{B}" for B in BLOCK_SIZES[-2:]] + [f"eigh-B{B}-bf16" for B in BLOCK_SIZES[-2:]]
if SMOKE:
    MODEL_TARGETS = [f"eigh-B{BLOCK_SIZES[0]}"]


class ModelTargets:
    """Blocked FISMO against the float32 Muon step and torch.optim.Muon (bfloat16 iteration) on
    the model sets, both ratios measured within one process (interleaved medians)."""

    params = (MODEL_TARGETS, list(MODEL_SETS), TORCH_DEVICES)
    param_names = ["variant", "model", "device"]
    timeout = 3600

    def setup(self, variant, model, device):
        self.medians = interleaved_medians(
            {name: model_step(name, model, device) for name in (variant, "muon-float32", "muon")},
            max(2, REPEATS // 2),
        )
        self.per_step = self.medians[variant] / steps_per_call(variant)

    def track_ratio_to_muon_float32(self, variant, model, device):
        return self.per_step / self.medians["muon-float32"]

    track_ratio_to_muon_float32.unit = "FISMO step / Muon float32 step"

    def track_ratio_to_torch_muon(self, variant, model, device):
        return self.per_step / self.medians["muon"]

    track_ratio_to_torch_muon.unit = "FISMO step / torch.optim.Muon step"
