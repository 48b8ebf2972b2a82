"""Where bfloat16 is native, and the precision ``FISMO.training`` picks from that.

The rule is measured, not assumed: on CPUs without bfloat16 dot products torch and
oneDNN emulate bfloat16 matrix products at several times float32's cost (documentation
page "Performance", "bfloat16 where it is native"). Re-exported by
``fismo_core.backends.torch``; see ``docs/torch.md``.
"""

from __future__ import annotations

import os
from typing import Optional, Union

import torch


#: The environment variables that limit oneDNN's CPU ISA: today's name, then the older one oneDNN still
#: reads when the first is not set.
ONEDNN_ISA_VARIABLES = ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")


def onednn_isa_limit() -> Optional[tuple[str, str]]:
    """``(variable, value)`` of the environment variable that limits oneDNN's CPU ISA, or ``None``."""
    return next(((v, os.environ[v]) for v in ONEDNN_ISA_VARIABLES if os.environ.get(v)), None)


#: oneDNN's CPU ISA limits (``ONEDNN_MAX_CPU_ISA``) below the first with bfloat16 dot products
#: (``AVX512_CORE_BF16``): under them oneDNN emulates bfloat16 matrix products.
_ONEDNN_ISAS_WITHOUT_BF16 = frozenset(
    {"SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE", "AVX512_CORE_VNNI"})


def bfloat16_is_native(device: Union[torch.device, str]) -> bool:
    """Whether torch multiplies bfloat16 matrices on ``device`` with bfloat16 instructions.

    A CUDA GPU of compute capability 8.0 or later (Ampere on; on ROCm, what
    ``torch.cuda.is_bf16_supported(including_emulation=False)`` says); a CPU
    with AVX512-BF16 or AMX-BF16 instructions, oneDNN enabled and not
    limited below ``AVX512_CORE_BF16`` (``ONEDNN_MAX_CPU_ISA``): torch sends
    bfloat16 products to oneDNN by the CPU's own features, whatever its
    elementwise kernels are (``ATEN_CPU_CAPABILITY=avx2`` alone leaves them
    at 0.25 times float32's time; until 2026-12-03 this rule answered
    ``False`` there). Elsewhere bfloat16 is emulated, at several times
    float32's cost (measured on the documentation page "Performance",
    "bfloat16 where it is native"). ARM CPUs with BF16 and other devices
    are answered ``False``: untested.
    """
    device = torch.device(device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            return False
        if torch.version.hip is not None:
            with torch.cuda.device(device):
                return bool(torch.cuda.is_bf16_supported(including_emulation=False))
        return torch.cuda.get_device_capability(device) >= (8, 0)
    if device.type != "cpu":
        return False
    limit = onednn_isa_limit()
    if limit is not None and limit[1].upper() in _ONEDNN_ISAS_WITHOUT_BF16:
        return False
    if not (torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled):
        return False
    capabilities = getattr(torch.cpu, "get_capabilities", None)
    if capabilities is not None:
        found = capabilities()
        return bool(found.get("avx512_bf16") or found.get("amx_bf16"))
    return bool(getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)())


def training_precision(native_bfloat16: bool) -> dict:
    """The precision options [`FISMO.training`][fismo_core.backends.torch.FISMO.training] adds to the core's
    [`TRAINING`][fismo_core.optimizer.TRAINING]: with ``native_bfloat16``
    (every parameter's device has bfloat16 instructions,
    [`bfloat16_is_native`][fismo_core.backends.torch.bfloat16_is_native]), ``torch.optim.Muon``'s bfloat16
    for the polar iteration and the preconditioners' products; otherwise
    ``None`` for both, the parameters' dtype (float32 for bf16 parameters,
    whose state is float32)."""
    dtype = "bfloat16" if native_bfloat16 else None
    return {"polar": {"dtype": dtype}, "inv_root": {"matmul_dtype": dtype}}
