"""CPU kernel sets: the instruction-set code paths that OpenBLAS, MKL, torch and XLA choose at run time.

NumPy's and SciPy's OpenBLAS, torch's ATen and MKL, and JAX's XLA each pick their
CPU kernels by the CPU they find (AVX2, AVX-512, ...), and kernels of another
instruction set round differently: the same float64 program can differ in
its last bits between two CPUs. A number that the documentation or a test
states must hold under every kernel set (or be stated with its measured
spread), so the kernel sets are targets like backends and devices. Each
library can be told to use other kernels than its CPU's:

- OpenBLAS: ``OPENBLAS_CORETYPE`` (``Haswell``, ``SkylakeX``,
  ``Sandybridge``, ...), read when NumPy is imported;
- torch: ``ATEN_CPU_CAPABILITY`` (``default``, ``avx2``, ``avx512``), read
  when torch is imported, for its own kernels; its matrix products and
  decompositions go through MKL, which ``MKL_CBWR`` (``COMPATIBLE``,
  ``AVX2``, ``AVX512``) sets;
- XLA: ``--xla_cpu_max_isa`` in ``XLA_FLAGS`` (``AVX``, ``AVX2``,
  ``AVX512``), read when JAX starts its CPU backend.

All of them are read once per process, so a kernel set is run as a fresh
process with `KernelSet.environ`. ``python -m fismo_core.kernels`` prints
the sets this CPU can run, one per line (name, then the variables), which
is how ``.ci/run`` runs the number-bearing tests under each.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Optional

__all__ = ["KERNEL_SETS", "KernelSet", "cpu_flags", "main", "runnable"]


@dataclass(frozen=True)
class KernelSet:
    """One choice of CPU kernels for OpenBLAS, torch (ATen and MKL) and XLA.

    ``env`` holds the variables that force it (empty: the CPU's own choice);
    ``needs`` the CPU flags (as ``/proc/cpuinfo`` names them) without which
    the forced kernels would stop the process with an illegal instruction.
    """

    name: str
    env: Mapping[str, str] = field(default_factory=dict)
    needs: tuple[str, ...] = ()
    xla_isa: Optional[str] = None

    def environ(self, base: Optional[Mapping[str, str]] = None) -> dict[str, str]:
        """``base`` (default ``os.environ``) with this set's variables; the XLA flag is appended to ``XLA_FLAGS``."""
        env = dict(os.environ if base is None else base)
        env.update(self.env)
        if self.xla_isa is not None:
            flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith("--xla_cpu_max_isa=")]
            env["XLA_FLAGS"] = " ".join([*flags, f"--xla_cpu_max_isa={self.xla_isa}"])
        return env

    def assignments(self) -> str:
        """The variables as ``NAME=value`` words (the XLA flag as one ``XLA_FLAGS=...`` word).

        For ``env $words cmd``, which splits on spaces: the ``XLA_FLAGS`` word
        replaces the environment's ``XLA_FLAGS``, where `environ` appends the
        flag to it.
        """
        words = [f"{k}={v}" for k, v in self.env.items()]
        if self.xla_isa is not None:
            words.append(f"XLA_FLAGS=--xla_cpu_max_isa={self.xla_isa}")
        return " ".join(words)


KERNEL_SETS: tuple[KernelSet, ...] = (
    KernelSet("native"),
    KernelSet("haswell-avx2", {"OPENBLAS_CORETYPE": "Haswell", "ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2",
                               "ONEDNN_MAX_CPU_ISA": "AVX2"},
              ("avx2", "fma"), "AVX2"),
    KernelSet("skylakex-avx512",
              {"OPENBLAS_CORETYPE": "SkylakeX", "ATEN_CPU_CAPABILITY": "avx512", "MKL_CBWR": "AVX512",
               "ONEDNN_MAX_CPU_ISA": "AVX512_CORE"},
              ("avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512cd"), "AVX512"),
    KernelSet("sandybridge-default",
              {"OPENBLAS_CORETYPE": "Sandybridge", "ATEN_CPU_CAPABILITY": "default", "MKL_CBWR": "COMPATIBLE",
               "ONEDNN_MAX_CPU_ISA": "AVX"},
              ("avx",), "AVX"),
)
"""The kernel sets the tests and ``.ci/run`` know: the CPU's own, and three forced ones.

``haswell-avx2`` and ``skylakex-avx512`` are the two families of kernels
most x86-64 machines use today (AVX2, as on most AMD and older Intel CPUs,
and AVX-512); ``sandybridge-default`` is the oldest (AVX OpenBLAS kernels,
torch's portable kernels with no SIMD, MKL's compatible code path),
which rounds most differently. Each limits oneDNN to its CPU's instructions
too (``ONEDNN_MAX_CPU_ISA``; Skylake-X has no bfloat16 dot products): torch's
bfloat16 products and convolutions are oneDNN's, which ``ATEN_CPU_CAPABILITY``
does not limit."""


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags from ``/proc/cpuinfo`` (empty where there is none, e.g. macOS or Windows)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def runnable(kernel_set: KernelSet, flags: Optional[frozenset[str]] = None) -> bool:
    """Whether this CPU has every instruction the set's kernels use (the native set always runs)."""
    flags = cpu_flags() if flags is None else flags
    return all(f in flags for f in kernel_set.needs)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Print the forced kernel sets this CPU can run, one per line: ``name VAR=value ...``."""
    args = list(sys.argv[1:] if argv is None else argv)
    usage = "usage: python -m fismo_core.kernels [--all]   (--all: the native set too)"
    if args in (["-h"], ["--help"]):
        print(usage)
        return 0
    if args not in ([], ["--all"]):
        print(usage, file=sys.stderr)
        return 2
    for ks in KERNEL_SETS:
        if (ks.env or args) and runnable(ks):
            print(f"{ks.name} {ks.assignments()}".rstrip())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
