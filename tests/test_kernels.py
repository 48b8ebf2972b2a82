"""The CPU kernel sets (``fismo_core.kernels``) that ``.ci/run`` runs the number-bearing tests under.

A forced set is only worth running if it really changes the kernels: each
test here starts a fresh process with the set's environment and asks the
library which kernels it chose.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from fismo_core.kernels import KERNEL_SETS, KernelSet, cpu_flags, main, runnable

FORCED = [ks for ks in KERNEL_SETS if ks.env]
CAN_RUN = [ks for ks in FORCED if runnable(ks)]

PROBE = """
import json
out = {}
try:
    import torch
    out["torch"] = torch.backends.cpu.get_cpu_capability()
except ImportError:
    pass
try:
    import numpy, threadpoolctl
    blas = [i for i in threadpoolctl.threadpool_info() if i["internal_api"] == "openblas"]
    out["openblas"] = blas[0]["architecture"] if blas else None
except ImportError:
    pass
print(json.dumps(out))
"""


def test_the_registry_names_the_two_sets_ci_must_run() -> None:
    """The issue's two kernel sets besides the CPU's own, and a native set with nothing forced."""
    by_name = {ks.name: ks for ks in KERNEL_SETS}
    assert by_name["native"].env == {} and by_name["native"].xla_isa is None
    # the two sets (OpenBLAS and torch's own kernels), with MKL (torch's matmul and eigh) to match
    assert by_name["haswell-avx2"].env == {"OPENBLAS_CORETYPE": "Haswell", "ATEN_CPU_CAPABILITY": "avx2",
                                          "MKL_CBWR": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
    assert by_name["skylakex-avx512"].env == {"OPENBLAS_CORETYPE": "SkylakeX", "ATEN_CPU_CAPABILITY": "avx512",
                                             "MKL_CBWR": "AVX512", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE"}
    assert len({ks.name for ks in KERNEL_SETS}) == len(KERNEL_SETS)


def test_environ_appends_the_xla_flag_and_keeps_the_others() -> None:
    ks = KernelSet("t", {"OPENBLAS_CORETYPE": "Haswell"}, (), "AVX2")
    base = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8 --xla_cpu_max_isa=AVX512", "PATH": "/bin"}
    env = ks.environ(base)
    assert env["XLA_FLAGS"] == "--xla_force_host_platform_device_count=8 --xla_cpu_max_isa=AVX2"
    assert env["OPENBLAS_CORETYPE"] == "Haswell" and env["PATH"] == "/bin"
    assert base["XLA_FLAGS"].endswith("AVX512")  # the caller's mapping is not modified
    assert KernelSet("native").environ({"A": "1"}) == {"A": "1"}


def test_runnable_needs_every_flag() -> None:
    ks = KernelSet("t", {"X": "1"}, ("avx2", "fma"))
    assert runnable(ks, frozenset({"avx2", "fma", "sse2"}))
    assert not runnable(ks, frozenset({"avx2"}))
    assert runnable(KernelSet("native"), frozenset())


def test_main_prints_one_line_per_runnable_forced_set(capsys) -> None:
    """The lines ``.ci/run`` reads: ``name VAR=value ...``, forced sets this CPU can run, none other."""
    assert main([]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines] == [ks.name for ks in CAN_RUN]
    for line, ks in zip(lines, CAN_RUN):
        words = dict(word.split("=", 1) for word in line.split()[1:])
        assert {k: v for k, v in words.items() if k != "XLA_FLAGS"} == dict(ks.env)
        assert words["XLA_FLAGS"] == f"--xla_cpu_max_isa={ks.xla_isa}"
    assert main(["--bogus"]) == 2
    capsys.readouterr()
    assert main(["--help"]) == 0 and capsys.readouterr().out.startswith("usage: python -m fismo_core.kernels")


@pytest.mark.skipif(not cpu_flags(), reason="no /proc/cpuinfo: the CPU's flags are unknown here")
@pytest.mark.parametrize("ks", CAN_RUN, ids=[ks.name for ks in CAN_RUN])
def test_a_forced_set_changes_the_kernels_the_libraries_use(ks: KernelSet) -> None:
    """In a fresh process, torch and NumPy's OpenBLAS report the kernels the set forces."""
    out = subprocess.run([sys.executable, "-c", PROBE], env=ks.environ(), capture_output=True, text=True,
                         check=True, timeout=300).stdout
    chose = json.loads(out)
    if "torch" in chose:
        wanted = {"default": "DEFAULT", "avx2": "AVX2", "avx512": "AVX512"}[ks.env["ATEN_CPU_CAPABILITY"]]
        assert chose["torch"] == wanted
    if chose.get("openblas") is not None:
        assert chose["openblas"].lower() == ks.env["OPENBLAS_CORETYPE"].lower()
    assert chose, "neither torch nor NumPy with threadpoolctl is installed"
