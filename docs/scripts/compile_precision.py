"""Two things inductor does to FISMO's step on a CPU that aot_eager does not (docs/torch.md, "torch.compile").

1. The training configuration (``FISMO.training``) rounds its polar iteration and products to bfloat16
   where bfloat16 is native. Inductor fuses the casts away and keeps float32, so its compiled step is
   further from the eager one than the float32 numbers of "The eager numbers" say; inductor's
   ``emulate_precision_casts`` keeps the roundings. Printed: the largest relative difference of one
   step's update, compiled against eager, over 8 steps, with and without that option, and eager
   against eager in float32 throughout (the size of the roundings themselves).
2. ``mode="max-autotune-no-cudagraphs"`` in float32: inductor's C++ GEMM template fails on the step's
   batched products (torch 2.13); with ``max_autotune_gemm_backends="ATEN"`` it compiles.

    python docs/scripts/compile_precision.py        # about 2 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import torch
import torch._inductor.config as inductor_config

from fismo_core.backends.torch import FISMO

torch.set_num_threads(1)
SHAPES = [(16, 8), (16, 16), (12, 16)]
STEPS = 8


def updates(compile_mode: str | None, **options) -> list[list[torch.Tensor]]:
    """Each step's update of every matrix, ``FISMO.training(nonfinite="propagate", **options)``, float32."""
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(shape, generator=gen)) for shape in SHAPES]
    grads = [[torch.randn(shape, generator=gen) for shape in SHAPES] for _ in range(STEPS)]
    opt = FISMO.training(params, lr=0.02, nonfinite="propagate", **options)
    step = opt.step if compile_mode is None else torch.compile(opt.step, backend=compile_mode)
    out = []
    for gs in grads:
        for p, g in zip(params, gs):
            p.grad = g
        before = [p.detach().clone() for p in params]
        step()
        out.append([p.detach() - b for p, b in zip(params, before)])
    return out


def worst(a: list[list[torch.Tensor]], b: list[list[torch.Tensor]]) -> float:
    return max(float((x - y).norm() / y.norm()) for xs, ys in zip(a, b) for x, y in zip(xs, ys))


def max_autotune(gemm_backends: str | None) -> str:
    torch._dynamo.reset()
    saved = inductor_config.max_autotune_gemm_backends
    if gemm_backends is not None:
        inductor_config.max_autotune_gemm_backends = gemm_backends
    try:
        W = [torch.nn.Parameter(torch.randn(16, 8))]
        opt = FISMO(W, lr=0.02, nonfinite="propagate")
        step = torch.compile(opt.step, mode="max-autotune-no-cudagraphs")
        for _ in range(2):
            W[0].grad = torch.randn_like(W[0])
            step()
        return "compiles and runs"
    except Exception as exc:  # noqa: BLE001 - the failure is what is measured
        return f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:120]}"
    finally:
        inductor_config.max_autotune_gemm_backends = saved


def main() -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()  # --help; anything else refused
    eager = updates(None)
    print(f"training configuration, polar dtype {FISMO.training([torch.nn.Parameter(torch.ones(2, 2))]).param_groups[0]['polar']['dtype']}")
    print(f"eager vs eager in float32 throughout: {worst(eager, updates(None, polar={'dtype': None}, inv_root={'matmul_dtype': None})):.3g}")
    print(f"aot_eager vs eager: {worst(updates('aot_eager'), eager):.3g}")
    torch._dynamo.reset()
    print(f"inductor vs eager: {worst(updates('inductor'), eager):.3g}")
    torch._dynamo.reset()
    inductor_config.emulate_precision_casts = True
    try:
        print(f"inductor with emulate_precision_casts vs eager: {worst(updates('inductor'), eager):.3g}")
    finally:
        inductor_config.emulate_precision_casts = False
    print(f"max-autotune-no-cudagraphs, float32: {max_autotune(None)}")
    print(f"the same with max_autotune_gemm_backends='ATEN': {max_autotune('ATEN')}")


if __name__ == "__main__":
    main()
