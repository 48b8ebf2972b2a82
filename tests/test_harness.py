"""The public harness: ``fismo_core.testing.check_backends`` (values, and each output's
namespace, device, dtype and shape; harness errors kept apart from the function's;
functions from array-api-extra and SciPy run through it), ``targets`` filters,
``full_float32_matmuls``, the pytest plugin's fixtures, and the errata claims
of ``docs/verification.md`` (the paper's Theorem 1 against Algorithm 1)."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pytest
from array_api_compat import array_namespace, is_numpy_namespace
from array_api_compat import device as array_device

import fismo_core.testing as testing_mod

from fismo_core import FISMO
from fismo_core.testing import (
    TOLERANCES,
    HarnessError,
    Report,
    Target,
    check_backends,
    full_float32_matmuls,
    max_relative_error,
    reference_gradients,
    targets,
    to_numpy,
)
from fismo_core.verify import gaussian_streams, run_stream

AVAILABLE = [t for t in targets() if t.available]
RNG = np.random.default_rng(0)
X = RNG.standard_normal((3, 8, 5))
Y = RNG.standard_normal((3, 5, 4))


def gram(x: Any) -> Any:
    """An array-API function: the scaled Gram matrix of each matrix in a batch."""
    xp = array_namespace(x)
    return x @ xp.matrix_transpose(x) / x.shape[-1]


def test_a_correct_function_passes_everywhere() -> None:
    report = check_backends(gram, X)
    assert isinstance(report, Report) and report.ok
    assert [r.target.id for r in report] == [t.id for t in targets()]
    for r in report:
        if not r.target.available:
            assert r.error is None and r.passed is None
            continue
        assert r.passed and r.where is None and r.tolerance == TOLERANCES[r.target.dtype]
        assert list(r.details) == ["output"] and r.mismatches == {}
        if r.target.dtype == "float32":
            assert 1e-9 < r.error < 1e-6  # float32 rounding of one product, not a copy of the reference
        elif r.target.backend in ("numpy", "array_api_strict"):
            assert r.error == 0.0  # the same LAPACK/BLAS as the reference
    table = report.table().splitlines()
    assert table[0].split()[:3] == ["backend", "device", "dtype"] and "steps" not in table[0]
    assert len(table) == 2 + len(report)
    assert report.summary() == f"{len(AVAILABLE)} passed, 0 failed, {len(report) - len(AVAILABLE)} skipped"
    assert str(report).endswith(report.summary())


def _off_on_torch(x: Any) -> Any:
    """Correct on every backend but torch, where it forgets to divide one output."""
    xp = array_namespace(x)
    g = x @ xp.matrix_transpose(x)
    scale = 1.0 if type(x).__module__.startswith("torch") else 1.0 / x.shape[-1]
    return {"gram": g / x.shape[-1], "scaled": g * scale, "trace": xp.sum(g, axis=(-2, -1))}


def test_a_function_that_writes_into_its_input_changes_neither_the_caller_nor_the_reference() -> None:
    """NumPy and torch convert without copying: the reference call and the NumPy, strict and torch
    float64 targets shared the caller's array, so an in-place ``fn`` doubled it once per call (16
    times here) and moved the reference under the rows. Every call now gets its own copies; JAX,
    whose arrays cannot be written, is the row that fails."""

    def double_in_place(a: Any) -> Any:
        a[...] = a * 2
        return a

    x = RNG.standard_normal((3, 4))
    before = x.copy()
    report = check_backends(double_in_place, x)
    assert np.array_equal(x, before)
    for r in report:
        if r.target.available and not r.target.backend.startswith("jax"):
            assert r.passed, (r.target.id, r.verdict)


def test_a_backend_dependent_bug_fails_and_names_the_output() -> None:
    report = check_backends(_off_on_torch, X)
    assert not report.ok
    failed = {r.target.id for r in report.failed}
    assert failed == {t.id for t in AVAILABLE if t.backend == "torch"}
    for r in report.failed:
        assert r.where == "output['scaled']"
        assert r.details["output['gram']"] <= r.tolerance < r.details["output['scaled']"]
        assert "FAIL at output['scaled']" in report.table()
    explained = report.explain()
    for r in report.failed:
        assert f"{r.target.id}: FAIL at output['scaled']" in explained
    assert explained.count("> tolerance") == len(report.failed)


class Pair(NamedTuple):
    left: Any
    right: Any


def test_nested_outputs_are_named_in_order() -> None:
    def f(x: Any, y: Any) -> Any:
        return Pair(x @ y, [x, {"sum": x + 1.0}])

    report = check_backends(f, X, Y, targets=[t for t in AVAILABLE if t.backend == "numpy"])
    assert report.ok
    assert list(report[0].details) == ["output.left", "output.right[0]", "output.right[1]['sum']"]


def test_integer_and_boolean_arrays_are_converted_with_their_dtype_and_other_arguments_pass_unchanged() -> None:
    """An index or mask array was passed to every target as NumPy: torch's ``where`` and array-api-strict's
    ``take`` then failed the row, blaming the function (a user's hunt, 2026-12-03). Now it reaches each target
    as an array of its backend and device, with its own dtype, a copy; Python numbers pass unchanged."""
    seen = []
    columns, keep = np.array([4, 0, 2]), np.array([True, False, True])

    def f(x: Any, axis: int, index: Any, mask: Any, *, scale: float) -> Any:
        xp = array_namespace(x)
        seen.append((axis, scale, index is columns, array_namespace(index, mask) is xp,
                     array_device(index) == array_device(x), str(index.dtype).rsplit(".", 1)[-1],
                     str(mask.dtype).rsplit(".", 1)[-1]))
        return xp.where(mask, xp.take(xp.sum(x, axis=axis), index, axis=-1), 0.0) * scale

    report = check_backends(f, X, 1, columns, keep, scale=2.0)
    assert report.ok, report.explain()
    assert set(seen) == {(1, 2.0, False, True, True, "int64", "bool")}


def test_complex_inputs_get_the_complex_dtype_of_the_target() -> None:
    """A complex input was passed as NumPy complex128 to every target: a float32 row computed in float64
    and failed its dtype, torch's and array-api-strict's raised. Now complex64 on float32, complex128 on
    float64, like the outputs (`test_a_complex_output_has_the_complex_dtype_of_the_targets_floating_one`)."""
    z = X[0] + 1j * X[1]

    def f(w: Any, x: Any) -> Any:
        xp = array_namespace(w, x)
        return xp.real(w * xp.conj(w)) + x[0, ...]

    report = check_backends(f, z, X)
    assert report.ok, report.explain()
    only_complex = check_backends(lambda w: w * 2, z)  # a complex array alone says the precision too
    assert only_complex.ok, only_complex.explain()


def test_a_raising_target_fails_its_row_and_a_raising_reference_propagates() -> None:
    def f(x: Any) -> Any:
        xp = array_namespace(x)
        if x.dtype == xp.float32:
            raise RuntimeError("no float32 here")
        return x * 2

    report = check_backends(f, X, targets=[t for t in AVAILABLE if t.backend == "numpy"])
    r32 = next(r for r in report if r.target.dtype == "float32")
    assert r32.passed is False and r32.error == math.inf and r32.exception == "RuntimeError: no float32 here"
    assert "FAIL (RuntimeError: no float32 here)" in report.table()

    def broken(x: Any) -> Any:
        raise ValueError("reference fails")

    with pytest.raises(ValueError, match="reference fails"):
        check_backends(broken, X)


def test_a_message_of_several_lines_keeps_the_table_one_row_per_target() -> None:
    """torch's ``TypeError`` for a bad call lists every overload, one per line: the table's row broke over
    a dozen lines. The row keeps the first line; `Report.explain` keeps the whole message."""
    calls = []

    def g(x: Any) -> Any:
        calls.append(x)
        if len(calls) > 1:  # the NumPy float64 reference is the first call
            raise ValueError("the first line\nthe second line")
        return x

    report = check_backends(g, X, targets=NUMPY)
    lines = report.table().splitlines()
    assert len(lines) == 2 + len(NUMPY), report.table()
    assert lines[-1].endswith("FAIL (ValueError: the first line [...; the rest in Report.explain()]")
    assert "the second line" in report.explain()


def test_shape_mismatch_fails_and_names_both_shapes() -> None:
    def f(x: Any) -> Any:
        xp = array_namespace(x)
        return x if is_numpy_namespace(xp) else x[..., :-1]

    report = check_backends(f, X, targets=AVAILABLE)
    for r in report:
        if r.target.backend == "numpy":
            assert r.passed
        else:  # values of another shape cannot be compared: the error is inf, the verdict names the shapes
            assert r.passed is False and r.exception is None and r.error == math.inf
            assert r.verdict == f"FAIL at output: shape (3, 8, 4), expected {X.shape}"


def test_tolerances_are_per_dtype_and_overridable() -> None:
    def noisy(x: Any) -> Any:  # float32 rounding of x: relative error ~ 3e-8
        return x * 1.0

    numpy_targets = [t for t in AVAILABLE if t.backend == "numpy"]
    assert check_backends(noisy, X, targets=numpy_targets).ok
    strict = check_backends(noisy, X, targets=numpy_targets, tolerances={"float64": 0.0, "float32": 1e-9})
    assert [r.passed for r in strict] == [True, False]
    with pytest.raises(ValueError, match="no tolerance for dtype 'float32'"):
        check_backends(noisy, X, targets=numpy_targets, tolerances={"float64": 1e-10})


@pytest.mark.parametrize("scale", [1e-170, 1.0, 1e200])
def test_max_relative_error_holds_at_any_scale(scale: float) -> None:
    """The sums of squares underflowed below ~1e-154 (a wrong tiny output had error 0 and passed) and
    overflowed above ~1e154 (a one-ulp difference was inf and failed); the error is scale-free."""
    reference = np.array([[1.0, -2.0], [0.5, 3.0]]) * scale
    assert max_relative_error(2 * reference, reference) == 1.0
    one_ulp = reference.copy()
    one_ulp[1, 1] = np.nextafter(one_ulp[1, 1], np.inf)
    assert 0 < max_relative_error(one_ulp, reference) < 2 * np.finfo(np.float64).eps
    assert max_relative_error(np.array([[np.nan, 0.0], [0.0, 0.0]]), reference) == math.inf
    # A zero reference makes the error absolute, in the arrays' units (not the scaled ones).
    assert max_relative_error(np.array([[3.0, 4.0]]) * scale, np.zeros((1, 2))) == pytest.approx(5.0 * scale)


def test_max_relative_error_holds_for_subnormal_numbers() -> None:
    """Entries below 2**-1022 (float64's subnormals): the scaling factor 2**-exponent overflowed to inf, and
    identical arrays had error inf (``check_backends`` failed an exact output; found by a user's hunt,
    2026-12-02). Subnormals carry fewer digits, so the zero-reference case is checked to 1e-2 only."""
    tiny = np.array([[1e-310, -2e-310]])
    assert max_relative_error(tiny, tiny.copy()) == 0.0
    assert max_relative_error(2 * tiny, tiny) == 1.0
    assert max_relative_error(np.array([[5e-324]]), np.array([[1e-323]])) == 0.5
    assert max_relative_error(np.array([[3e-320, 4e-320]]), np.zeros((1, 2))) == pytest.approx(5e-320, rel=1e-2)
    z = tiny * (1 + 1j)
    assert max_relative_error(z, z.copy()) == 0.0
    assert max_relative_error(np.conj(z), z) == pytest.approx(math.sqrt(2.0), rel=1e-12)  # |2 Im z| / |z|


def test_max_relative_error_takes_a_reference_of_any_backend() -> None:
    """The reference went through ``numpy.asarray``: a torch reference that requires grad, or is bfloat16,
    raised (``got`` of the same kinds was accepted). Both sides now go through `to_numpy`."""
    torch = pytest.importorskip("torch")
    a = np.arange(4.0).reshape(2, 2)
    assert max_relative_error(a, torch.asarray(a).requires_grad_()) == 0.0
    assert max_relative_error(a, torch.asarray(a).to(torch.bfloat16)) == 0.0  # 0 to 3 are exact in bfloat16
    assert max_relative_error([[0.0, 1.0], [2.0, 4.0]], [[0.0, 1.0], [2.0, 3.0]]) == pytest.approx(1 / math.sqrt(14))


def test_complex_outputs_are_compared_with_their_imaginary_part() -> None:
    """``to_numpy`` cast complex to float64, dropping the imaginary part: a conjugated output passed
    (error 0) on torch and NumPy. Complex arrays are now compared by modulus."""
    assert max_relative_error(np.array([[1 + 5j]]), np.array([[1.0]])) == 5.0
    assert to_numpy(np.array([1 - 2j])).dtype == np.complex128

    def conjugated_off_numpy(x):
        xp = array_namespace(x)
        z = xp.astype(x, xp.complex128) * (1 + 1j)
        return z if is_numpy_namespace(xp) else xp.conj(z)

    x = np.random.default_rng(0).standard_normal((3, 3))
    report = check_backends(conjugated_off_numpy, x, targets=targets(dtypes=["float64"]), out_dtypes="complex128")
    ran = [r for r in report if r.error is not None]
    numpy_rows = [r for r in ran if r.target.backend == "numpy"]
    others = [r for r in ran if r.target.backend != "numpy"]
    assert numpy_rows and all(r.error == 0.0 for r in numpy_rows)
    assert others and all(r.error == pytest.approx(math.sqrt(2)) for r in others), [(r.target.id, r.error) for r in others]


def test_targets_filters() -> None:
    assert {t.backend for t in targets(backends=["numpy"])} == {"numpy"}
    assert {t.dtype for t in targets(dtypes=["float64"])} == {"float64"}
    assert [t.id for t in targets(backends=["torch"], dtypes=["float32"])] == ["torch-cpu-float32", "torch-cuda-float32"]
    with pytest.raises(ValueError, match="unknown backend 'tensorflow'"):
        targets(backends=["tensorflow"])
    with pytest.raises(ValueError, match="unknown dtypes"):
        targets(dtypes=["float16"])


@pytest.mark.parametrize("backend", ["cupy", "array_api_strict"])
def test_a_backend_whose_import_fails_otherwise_than_importerror_is_skipped_with_the_error(
    backend: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An installed backend that cannot load (CuPy or torch without the CUDA libraries they link: an
    ``OSError``) is an unavailable target whose reason is the error, as a missing one is; it was a
    traceback out of ``targets()`` and ``fismo verify``."""
    fake = tmp_path / backend
    fake.mkdir()
    (fake / "__init__.py").write_text('raise OSError("libcudart.so.12: cannot open shared object file")\n')
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, backend, raising=False)
    chosen = targets(backends=[backend])
    assert chosen and all(not t.available for t in chosen)
    assert {t.reason for t in chosen} == {
        f"{backend} is installed but failed to import (OSError: libcudart.so.12: cannot open shared object file)"
    }


def test_full_float32_matmuls_pins_and_restores() -> None:
    torch = pytest.importorskip("torch")
    before = (torch.backends.cuda.matmul.allow_tf32, torch.get_float32_matmul_precision())
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.set_float32_matmul_precision("high")
    try:
        with full_float32_matmuls():
            assert torch.backends.cuda.matmul.allow_tf32 is False
            assert torch.get_float32_matmul_precision() == "highest"
        assert torch.backends.cuda.matmul.allow_tf32 is True
        assert torch.get_float32_matmul_precision() == "high"
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before[0]
        torch.set_float32_matmul_precision(before[1])


def test_check_backends_runs_with_tf32_off() -> None:
    torch = pytest.importorskip("torch")
    seen = []

    def f(x: Any) -> Any:
        seen.append(torch.get_float32_matmul_precision())
        return x

    torch.set_float32_matmul_precision("medium")
    try:
        check_backends(f, X, targets=[t for t in AVAILABLE if t.backend == "numpy"])
    finally:
        torch.set_float32_matmul_precision("highest")
    assert set(seen) == {"highest"}


# --------------------------------------- each output's namespace, device, dtype, shape
NAMESPACE = {"numpy": "numpy", "array_api_strict": "array_api_strict", "torch": "torch", "jax": "jax.numpy", "cupy": "cupy"}
"""How a verdict names each backend's namespace: array_api_compat's module, without its ``array_api_compat.`` prefix."""

NUMPY = [t for t in AVAILABLE if t.backend == "numpy"]


def _numpy_inside(x: Any) -> Any:
    """Issue 18's example: right values, computed in and returned as NumPy whatever the input."""
    return np.tanh(np.asarray(x)) * 2


def _float64_mean(x: Any) -> Any:
    """Returns float64 whatever the input's dtype."""
    xp = array_namespace(x)
    return xp.mean(xp.astype(x, xp.float64), axis=-1)


def test_a_numpy_array_returned_for_another_backend_fails_its_namespace() -> None:
    report = check_backends(_numpy_inside, X, targets=AVAILABLE)
    assert {"array_api_strict", "torch", "jax"} <= {r.target.backend for r in report}  # the test extras' backends
    for r in report:
        assert r.error <= r.tolerance  # the values are right ...
        if r.target.backend == "numpy":
            assert r.passed, r.verdict
        else:  # ... the array is NumPy's
            assert r.passed is False and r.exception is None
            assert r.verdict == f"FAIL at output: namespace numpy, expected {NAMESPACE[r.target.backend]}"
    assert "output                   0.00e+00  namespace numpy, expected torch" in report.explain()


def test_a_float64_result_for_float32_input_fails_the_float32_rows_unless_declared() -> None:
    report = check_backends(_float64_mean, X, targets=AVAILABLE)
    for r in report:
        assert r.error <= r.tolerance
        if r.target.dtype == "float64":
            assert r.passed, r.verdict
        else:
            assert r.verdict == "FAIL at output: dtype float64, expected float32"
    assert check_backends(_float64_mean, X, targets=AVAILABLE, out_dtypes="float64").ok
    # Per output: the first keeps the inputs' dtype, the second is declared.
    def both(x: Any) -> Any:
        return x * 2.0, _float64_mean(x)

    assert check_backends(both, X, targets=AVAILABLE, out_dtypes={"output[1]": "float64"}).ok
    declared_wrong = check_backends(both, X, targets=AVAILABLE, out_dtypes={"output[0]": "float64"})
    for r in declared_wrong:
        if r.target.dtype == "float32":
            assert r.verdict == "FAIL at output[0]: dtype float32, expected float64"
            assert r.mismatches == {"output[0]": "dtype float32, expected float64",
                                    "output[1]": "dtype float64, expected float32"}
        else:
            assert r.passed


def test_a_0d_result_passes_everywhere_numpy_scalars_included() -> None:
    assert type(np.mean(X)) is np.float64  # NumPy returns a scalar, not an array: the case that used to crash

    def mean(x: Any) -> Any:
        return array_namespace(x).mean(x)

    report = check_backends(mean, X, targets=AVAILABLE)
    assert report.ok and len(report) == len(AVAILABLE), report.explain()
    assert all(r.error <= r.tolerance and list(r.details) == ["output"] for r in report)


@pytest.mark.parametrize("target", AVAILABLE, ids=lambda t: t.id)
def test_to_numpy_takes_0d_arrays_and_scalars(target: Target) -> None:
    xp, x = target.xp, target.asarray(X)
    for value in (xp.mean(x), xp.sum(x), x[0, 0, 0]):
        got = to_numpy(value)
        assert isinstance(got, np.ndarray) and got.shape == () and got.dtype == np.float64
    # float32 rounding of the data and of the sum: well within the float32 tolerance
    assert abs(float(to_numpy(xp.mean(x))) - float(np.mean(X))) <= TOLERANCES[target.dtype] * np.mean(np.abs(X))
    big = xp.asarray([2**40 + 1])  # integers widen exactly (through float32, 2**40 + 1 would round)
    assert int(to_numpy(big)[0]) == 2**40 + 1


def test_to_numpy_takes_numpy_scalars_and_python_numbers() -> None:
    for value, expected in ((np.float32(1.5), 1.5), (np.float64(2.5), 2.5), (np.int64(3), 3.0), (True, 1.0), (7, 7.0), (0.25, 0.25)):
        got = to_numpy(value)
        assert got.shape == () and got.dtype == np.float64 and got == expected


def test_an_output_on_another_device_fails_its_device() -> None:
    xs = pytest.importorskip("array_api_strict")
    other = xs.Device("device1")  # array-api-strict's virtual devices: a device mismatch without a GPU

    def moved(x: Any) -> Any:
        xp = array_namespace(x)
        return xp.asarray(x, device=other) if xp is xs else x

    report = check_backends(moved, X, targets=[t for t in AVAILABLE if t.backend in ("numpy", "array_api_strict")])
    for r in report:
        if r.target.backend == "numpy":
            assert r.passed
        else:
            assert r.verdict == f"FAIL at output: device {other}, expected {xs.Device('CPU_DEVICE')}"


def test_every_wrong_property_is_named() -> None:
    def f(x: Any) -> Any:  # on float32 input: another dtype and another shape
        xp = array_namespace(x)
        return x if x.dtype == xp.float64 else xp.astype(x[..., :-1], xp.float64)

    r32 = check_backends(f, X, targets=NUMPY)[1]
    assert r32.target.dtype == "float32" and r32.error == math.inf
    assert r32.verdict == f"FAIL at output: dtype float64, expected float32; shape (3, 8, 4), expected {X.shape}"


def test_index_and_mask_outputs_keep_numpys_dtype() -> None:
    def f(x: Any) -> Any:
        xp = array_namespace(x)
        return xp.argmax(x, axis=-1), x > 0

    assert check_backends(f, X, targets=AVAILABLE).ok

    def narrow_indices(x: Any) -> Any:
        xp = array_namespace(x)
        i = xp.argmax(x, axis=-1)
        return i if x.dtype == xp.float64 else xp.astype(i, xp.int32)

    report = check_backends(narrow_indices, X, targets=NUMPY)
    assert [r.verdict for r in report] == ["pass", "FAIL at output: dtype int32, expected int64"]
    assert check_backends(narrow_indices, X, targets=NUMPY[1:], out_dtypes="int32").ok


def test_index_mask_and_count_outputs_must_be_equal_not_close() -> None:
    """An index off by one in a vector of 300,000 entries passed a float32 row: its relative error, 5e-6,
    was compared with the floating tolerance (a user's hunt, 2026-12-02). Integer and boolean outputs, arrays
    or Python numbers, are equal or wrong; the row says how many entries differ."""
    x = np.zeros(300_000)
    x[200_000], x[200_001] = 1.0, 0.6

    def off_by_one_in_float32(x: Any) -> Any:
        xp = array_namespace(x)
        shift = int(x.dtype == xp.float32)
        return xp.argmax(x) + shift, x > 0.5 + 0.2 * shift, int(xp.sum(x > 0)) + shift

    report = check_backends(off_by_one_in_float32, x, targets=NUMPY)
    assert report[0].verdict == "pass"
    assert report[1].details["output[0]"] < report[1].tolerance  # what passed the index before
    assert report[1].verdict == "FAIL at output[0]: it differs (integer and boolean outputs must be equal)"
    assert report[1].mismatches == {
        "output[0]": "it differs (integer and boolean outputs must be equal)",
        "output[1]": "1 of 300000 entries differ (integer and boolean outputs must be equal)",
        "output[2]": "it differs (integer and boolean outputs must be equal)",
    }


def test_big_endian_and_longdouble_inputs_are_converted_for_every_target() -> None:
    """A big-endian float64 array (FITS data, a '>f8' file) or a longdouble one stopped the whole check with
    ``HarnessError`` on torch, which takes neither (a user's hunt, 2026-12-03); every target converts them."""
    for data in (X.astype(">f8"), X.astype(np.longdouble)):
        report = check_backends(lambda a: a * 2.0, data, targets=AVAILABLE)
        assert report.ok and len(report) == len(AVAILABLE), report.explain()


def test_a_tolerance_is_printed_in_the_digits_that_give_it_back() -> None:
    """``tolerances={"float32": 1.4e-4}`` printed as ``1e-04`` (one digit), beside an error of 1.2e-4 that passed."""
    report = check_backends(lambda a: a * 2.0, X, targets=NUMPY, tolerances={"float64": 1e-10, "float32": 1.4e-4})
    assert [line.split()[4] for line in report.table().splitlines()[2:4]] == ["1e-10", "1.4e-04"]


def test_a_python_complex_is_a_python_number() -> None:
    """``to_numpy(1 + 2j)`` raised ``TypeError`` and ``check_backends`` refused a Python ``complex`` output,
    though both take "a Python number" (a user's hunt, 2026-12-03): compared by value, as a float is."""
    assert to_numpy(1 + 2j).dtype == np.complex128 and to_numpy(1 + 2j) == 1 + 2j

    def f(x: Any) -> Any:
        xp = array_namespace(x)
        return complex(float(xp.sum(x)), 1.0 if x.dtype == xp.float64 else 1.5)

    report = check_backends(f, X, targets=NUMPY)
    assert [r.verdict for r in report] == ["pass", "FAIL at output"]


def test_integers_beyond_two_to_the_53_are_compared_exactly() -> None:
    """Integer outputs were compared through float64, which holds integers exactly up to 2**53 only: int64
    values 2**53 + 1 against 2**53, and a Python int 2**60 + 3 against 2**60, passed on every backend (a
    user's hunt, 2026-12-03)."""
    def ids(x: Any) -> Any:
        xp = array_namespace(x)
        off = 0 if is_numpy_namespace(xp) and x.dtype == xp.float64 else 1
        return xp.asarray([2**53 + off, 2**62], dtype=xp.int64, device=array_device(x)), 2**60 + 3 * off

    report = check_backends(ids, X, targets=[t for t in AVAILABLE if t.dtype == "float64" or t.backend == "numpy"])
    assert report[0].verdict == "pass"
    for r in report[1:]:
        assert r.mismatches == {"output[0]": "1 of 2 entries differ (integer and boolean outputs must be equal)",
                                "output[1]": "it differs (integer and boolean outputs must be equal)"}, r.target.id
        # The error column is the exact one, not float64's 0 (both ids round to 2**53): ||(1, 0)|| / ||(2**53, 2**62)||
        # and 3 / 2**60, each rounded once (rel=1e-15: a few roundings of the norms).
        assert r.details["output[0]"] == pytest.approx(1 / math.hypot(2.0**53, 2.0**62), rel=1e-15), r.target.id
        assert r.details["output[1]"] == pytest.approx(3 / 2.0**60, rel=1e-15), r.target.id
        assert r.error > 0


def test_torch_named_results_are_named_as_numpys() -> None:
    """torch returns ``slogdet``, ``eigh`` and ``svd`` results as struct sequences, tuples without ``_fields``:
    they were named ``output[0]``, NumPy's ``output.sign``, and every torch row failed as "missing" (a user's
    hunt, 2026-12-03). Both are named tuples of the array API standard's fields now."""
    A = X[0, :4, :4] @ X[0, :4, :4].T + np.eye(4)

    def slogdet_and_eigh(a: Any) -> Any:
        xp = array_namespace(a)
        return xp.linalg.slogdet(a), xp.linalg.eigh(a).eigenvalues

    report = check_backends(slogdet_and_eigh, A, targets=[t for t in AVAILABLE if t.dtype == "float64"])
    assert report.ok, report.explain()
    assert all(list(r.details) == ["output[0].sign", "output[0].logabsdet", "output[1]"] for r in report)


def test_a_complex_output_has_the_complex_dtype_of_the_targets_floating_one() -> None:
    """rfft of float32 is complex64 in every array API library; the harness expected NumPy float64's
    complex128 on every target, so a correct function failed every float32 row, whatever out_dtypes said."""

    def spectrum(x: Any) -> Any:
        return array_namespace(x).fft.rfft(x, axis=-1)

    assert check_backends(spectrum, X, targets=AVAILABLE).ok

    def always_complex128(x: Any) -> Any:
        xp = array_namespace(x)
        return xp.astype(x, xp.complex128)

    report = check_backends(always_complex128, X, targets=NUMPY)
    assert [r.verdict for r in report] == ["pass", "FAIL at output: dtype complex128, expected complex64"]
    assert check_backends(always_complex128, X, targets=NUMPY, out_dtypes="complex128").ok


def test_python_numbers_are_compared_by_value_and_type() -> None:
    def total(x: Any) -> Any:
        return float(array_namespace(x).sum(x))

    assert check_backends(total, X, targets=AVAILABLE).ok

    def float_on_numpy_only(x: Any) -> Any:
        xp = array_namespace(x)
        return float(xp.sum(x)) if is_numpy_namespace(xp) else xp.sum(x)

    for r in check_backends(float_on_numpy_only, X, targets=AVAILABLE):
        if r.target.backend == "numpy":
            assert r.passed
        else:
            kind = type(r.target.xp.sum(r.target.asarray(X)))
            assert r.verdict == f"FAIL at output: type {kind.__module__}.{kind.__qualname__}, expected float"


def test_outputs_missing_extra_or_not_arrays_on_a_target_fail() -> None:
    def f(x: Any) -> Any:
        xp = array_namespace(x)
        if is_numpy_namespace(xp):
            return x, None, x
        if x.dtype == xp.float64:
            return x, x  # output[1]: an array where NumPy gives None; output[2] missing
        return x, None, "x", x  # output[2]: not an array; output[3]: extra

    report = check_backends(f, X, targets=[t for t in AVAILABLE if t.backend in ("numpy", "torch")])
    for r in report:
        if r.target.backend == "numpy":
            assert r.passed
        elif r.target.dtype == "float64":
            assert r.mismatches == {"output[1]": "Tensor where NumPy float64 returns None",
                                    "output[2]": "missing (NumPy float64 returns it)"}
            assert r.where == "output[1]"
        else:
            assert r.mismatches == {"output[2]": "namespace: str is not an array, expected torch",
                                    "output[3]": "not among NumPy float64's outputs"}
            assert r.verdict == "FAIL at output[2]: namespace: str is not an array, expected torch"


def test_bad_arguments_are_refused_before_fn_runs() -> None:
    calls = []

    def f(x: Any) -> Any:
        calls.append(x)
        return x

    with pytest.raises(ValueError, match=r"needs at least one floating \(or complex\) NumPy array"):
        check_backends(f, [1.0, 2.0], targets=NUMPY)
    with pytest.raises(ValueError, match=r"needs at least one floating \(or complex\) NumPy array"):
        check_backends(f, np.arange(3), targets=NUMPY)  # an integer array alone gives no precision to check
    with pytest.raises(ValueError, match=r"arrays inside lists, tuples or dicts are not converted"):
        check_backends(f, [X], targets=NUMPY)
    with pytest.raises(TypeError, match=r"got the Target numpy-cpu-float64 alone: pass \[target\]"):
        check_backends(f, X, targets=NUMPY[0])  # was "'Target' object is not iterable"
    with pytest.raises(TypeError, match="out_dtypes must be a dtype name or a mapping"):
        check_backends(f, X, targets=NUMPY, out_dtypes=np.float32)
    with pytest.raises(ValueError, match=r"out_dtypes: unknown dtype name\(s\) \['float16'\]"):
        check_backends(f, X, targets=NUMPY, out_dtypes="float16")
    with pytest.raises(ValueError, match="no tolerance for dtype 'float32'"):
        check_backends(f, X, targets=NUMPY, tolerances={"float64": 1e-10})
    assert calls == []
    # Output names are known once the reference has run; nothing else has.
    with pytest.raises(ValueError, match=r"out_dtypes names \['output\[3\]'\], which are not array outputs of fn"):
        check_backends(f, X, targets=NUMPY, out_dtypes={"output[3]": "float64"})
    with pytest.raises(ValueError, match="fn returned a str at output on NumPy float64"):
        check_backends(lambda x: "x", X, targets=NUMPY)


def test_what_the_harness_cannot_judge_is_refused_before_any_target_runs() -> None:
    """From a user's hunt (2026-12-04): targets given by name failed with ``'str' object has no attribute
    'dtype'``; a NaN or negative tolerance failed exact rows with no reason; a function that returns
    nothing (one that writes into its input) passed every row, even one wrong on a backend; a string,
    object or datetime output failed with a raw conversion error or a HarnessError blaming a target."""
    calls = []

    def f(x: Any) -> Any:
        calls.append(x)
        return x

    for bad in (["numpy", "torch"], "numpy"):
        with pytest.raises(TypeError, match=r"targets must be a list of Target.*targets\(backends=\["):
            check_backends(f, X, targets=bad)
    for tolerance in (math.nan, -1.0, "1e-4", True, None):
        with pytest.raises(ValueError, match=r"tolerances\['float32'\] must be a number >= 0"):
            check_backends(f, X, targets=NUMPY, tolerances={"float64": 1e-10, "float32": tolerance})
    assert calls == []
    for nothing in (lambda x: None, lambda x: (), lambda x: {}):
        with pytest.raises(ValueError, match="fn returned nothing to compare"):
            check_backends(nothing, X, targets=NUMPY)
    for output, kind in ((np.array(["a", "b"]), "<U1"), (np.array([None, 1]), "object"),
                         (np.array(["2026-12-04"], dtype="datetime64[D]"), "datetime64")):
        with pytest.raises(ValueError, match=f"fn returned an array of dtype {kind}.*compares numeric arrays"):
            check_backends(lambda x, out=output: out, X, targets=NUMPY)


def test_an_in_place_function_that_returns_its_input_is_judged() -> None:
    """The refusal above says how: return the input. Then a backend that writes the wrong values fails."""
    def scale_(v: Any) -> Any:
        xp = array_namespace(v)
        v[...] = 0.0 if "torch" in xp.__name__ else 2 * v
        return v

    report = check_backends(scale_, X, targets=[t for t in AVAILABLE if t.backend in ("numpy", "torch")])
    assert {r.target.backend for r in report.failed} == {"torch"} and len(report.ran) > len(report.failed)


def test_an_unavailable_or_hand_built_target_raises_with_its_reason() -> None:
    """``asarray`` and ``xp`` of an unavailable target returned ``None`` (or raised about an attribute of
    ``None``, CuPy's); a ``Target`` built by hand returned ``None`` (a user's hunt, 2026-12-04)."""
    missing = Target("jax", "cpu", "float64", reason="jax is not installed (pip install jax)")
    for use in (lambda: missing.xp, lambda: missing.asarray(np.ones(2))):
        with pytest.raises(RuntimeError, match=r"target jax-cpu-float64 is not available: jax is not installed"):
            use()
    by_hand = Target("numpy", "cpu", "float64")
    for use in (lambda: by_hand.xp, lambda: by_hand.asarray(np.ones(2))):
        with pytest.raises(RuntimeError, match="a Target built by hand has no library"):
            use()
    for target in targets():
        if not target.available:
            with pytest.raises(RuntimeError, match="is not available"):
                target.asarray(np.ones(2))


def test_targets_run_a_backend_named_twice_once() -> None:
    assert [t.id for t in targets(backends=["numpy", "numpy"])] == [t.id for t in targets(backends=["numpy"])]


def test_max_relative_error_refuses_several_outputs_and_compares_integers_exactly() -> None:
    """A tuple of vectors was stacked into one matrix: a 50 % error of one hid behind the other's 1e6; and
    integers beyond 2**53 compared equal through float64 (a user's hunt, 2026-12-04)."""
    got, ref = (np.full(3, 1e6), np.ones(3)), (np.full(3, 1e6), np.full(3, 2.0))
    with pytest.raises(TypeError, match="got a list or tuple of arrays"):
        max_relative_error(got, ref)
    assert max_relative_error(got[1], ref[1]) == pytest.approx(0.5)
    assert max_relative_error(np.array([2**53 + 1]), np.array([2**53])) == pytest.approx(2.0**-53)
    assert max_relative_error(np.array([2**64 - 1], np.uint64), np.array([2**64 - 2], np.uint64)) > 0
    assert max_relative_error(np.array([True, False]), np.array([True, False])) == 0.0
    assert max_relative_error([[0.0, 1.0]], [[0.0, 1.0]]) == 0.0  # nested lists of numbers still go


@pytest.mark.parametrize("shape", [(5,), 5, (), (3, -1), (2.5, 3)])
def test_reference_gradients_refuses_a_shape_of_fewer_than_two_sizes(shape: Any) -> None:
    with pytest.raises(ValueError, match="shape must have at least two dimensions|each size of shape"):
        reference_gradients(shape, 2)


def test_a_routine_that_reads_torchs_older_cudnn_flag_runs_under_the_harness() -> None:
    """Inside the harness torch's ``cudnn.allow_tf32`` raised ("a mix of the legacy and new APIs"): the
    harness set the newer settings only, and a routine that read the older flag failed even on a
    NumPy-only check (a user's hunt, 2026-12-04). A fresh process: the default state of the flags."""
    pytest.importorskip("torch")
    script = (
        "import numpy as np, torch\n"
        "from fismo_core.testing import check_backends, targets\n"
        "before = torch.backends.cudnn.allow_tf32\n"
        "seen = []\n"
        "def f(x):\n"
        "    seen.append(torch.backends.cudnn.allow_tf32)\n"
        "    return x * 2\n"
        "report = check_backends(f, np.ones(3), targets=targets(backends=['numpy', 'torch']))\n"
        "print(before, set(seen), torch.backends.cudnn.allow_tf32, report.ok)\n"
    )
    assert _fresh_process(script).split() == ["True", "{False}", "True", "True"]


def test_plugin_refuses_array_xp_beside_array_target64(pytester: pytest.Pytester) -> None:
    """Both fixtures are parametrized on their own: the test ran on every pair, 72 of them with torch's
    target beside JAX's namespace (a user's hunt, 2026-12-04)."""
    pytester.makepyfile(
        """
        def test_both(array_target64, array_xp):
            assert array_xp is array_target64.xp
        """
    )
    result = pytester.runpytest_inprocess("-p", "fismo_core.pytest_plugin", "-q")
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*uses both array_target (or array_xp, its namespace) and array_target64*"])


# ------------------------------------------- the harness's errors are not the function's
def test_a_harness_error_is_raised_never_reported_as_the_functions_failure(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []

    def f(x: Any) -> Any:
        calls.append(type(x))
        return x * 2

    def broken(*args: Any, **kwargs: Any) -> float:
        raise RuntimeError("a bug in the comparison")

    monkeypatch.setattr(testing_mod, "max_relative_error", broken)
    with pytest.raises(HarnessError, match=r"numpy-cpu-float64 .*RuntimeError: a bug in the comparison") as info:
        check_backends(f, X, targets=NUMPY)
    assert isinstance(info.value.__cause__, RuntimeError)
    assert calls == [np.ndarray, np.ndarray]  # the reference and the target: fn returned before the harness failed


def test_an_input_the_harness_cannot_convert_is_a_harness_error() -> None:
    calls = []

    def unconvertible(a: Any, dtype: str) -> Any:
        raise BufferError("no such device")

    target = Target("numpy", "cpu", "float32", _asarray=unconvertible)
    with pytest.raises(HarnessError, match=r"could not convert the inputs to numpy-cpu-float32 \(BufferError: no such device\)"):
        check_backends(lambda x: calls.append(x) or x, X, targets=[target])
    assert len(calls) == 1  # only the reference call ran


# ------------------------------------------------------- functions nobody here wrote
SAMPLES = np.random.default_rng(0).standard_normal((4, 50))
DOCS = Path(__file__).resolve().parents[1] / "docs" / "verification.md"


def _dtype_name(dtype: Any) -> str:
    return str(dtype).rsplit(".", 1)[-1]  # torch.float32, array_api_strict.float32, float32


def test_array_api_extra_sinc_and_kron_pass_every_target() -> None:
    xpx = pytest.importorskip("array_api_extra")
    a, b = np.random.default_rng(1).standard_normal((2, 3, 4))
    for report in (check_backends(xpx.sinc, SAMPLES, targets=AVAILABLE), check_backends(xpx.kron, a, b, targets=AVAILABLE)):
        assert report.ok and len(report) == len(AVAILABLE), report.explain()


def test_array_api_extra_cov_is_judged_by_the_dtype_it_really_returns() -> None:
    """xpx.cov computes in float64 on some backends and keeps float32 on others; each row's verdict is
    what the function returns there, read directly (not through the harness)."""
    xpx = pytest.importorskip("array_api_extra")
    report = check_backends(xpx.cov, SAMPLES, targets=AVAILABLE)
    for r in report:
        returned = _dtype_name(xpx.cov(r.target.asarray(SAMPLES)).dtype)
        assert r.error <= r.tolerance
        if returned == r.target.dtype:
            assert r.passed, r.verdict
        else:
            assert r.verdict == f"FAIL at output: dtype {returned}, expected {r.target.dtype}"


def _documented(marker: str) -> tuple[str, list[str]]:
    """The python block of docs/verification.md that contains ``marker``, and the lines of the text block after it."""
    for code, shown in re.findall(r"```python\n(.*?)\n```\s*```text\n(.*?)\n```", DOCS.read_text(), re.S):
        if marker in code:
            return code, shown.splitlines()
    raise AssertionError(f"no python block with {marker!r} followed by its output in {DOCS}")


def _available_lines(shown: list[str], printed: list[str]) -> None:
    """The page's lines for the targets available here are exactly what the code printed (in order)."""
    ids = {t.id for t in AVAILABLE}
    expected = [line for line in shown if any(f" {i} " in f" {line} " for i in ids)]
    assert printed == expected
    assert any("numpy-cpu-float32" in line for line in printed)


@pytest.mark.numbers
@pytest.mark.parametrize("marker", ["def numpy_inside", "xpx.cov"])
def test_the_pages_examples_print_what_it_shows(marker: str, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("array_api_extra")
    code, shown = _documented(marker)
    exec(compile(code, str(DOCS), "exec"), {"np": np, "array_namespace": array_namespace, "check_backends": check_backends})
    _available_lines(shown, capsys.readouterr().out.splitlines())


@pytest.mark.numbers
def test_the_pages_gram_table_has_the_verdicts_this_machine_gives() -> None:
    """The table's error digits are per CPU kernel (the page says so); its rows and verdicts are not."""
    code, shown = _documented("def gram")
    rows = {tuple(re.split(r"\s{2,}", line)[:3]): re.split(r"\s{2,}", line)[-1] for line in shown[2:] if line.strip()
            and not SUMMARY_LINE.match(line)}
    report = check_backends(gram, np.random.default_rng(0).standard_normal((8, 5)), targets=AVAILABLE)
    for r in report:
        assert rows[(r.target.backend, r.target.device, r.target.dtype)] == r.verdict == "pass"


SUMMARY_LINE = re.compile(r"^\d+ passed, \d+ failed, \d+ skipped$")


SCIPY_CHECK = """
import json, os, sys
os.environ["SCIPY_ARRAY_API"] = "1"
import numpy as np
from array_api_compat import is_numpy_array
exec(compile(sys.argv[1], "docs/verification.md", "exec"), {})
import scipy.linalg
from fismo_core.testing import targets
x = np.random.default_rng(0).standard_normal((4, 4)) / 4
returns_numpy = {t.id: is_numpy_array(scipy.linalg.expm(t.asarray(x))) for t in targets() if t.available}
print(json.dumps(returns_numpy))
"""


def test_scipy_functions_run_through_the_harness() -> None:
    """SciPy reads SCIPY_ARRAY_API at its first import: the page's example runs in a fresh process. What it prints
    is what the page shows; expm's rows fail on namespace exactly where expm itself returns a NumPy array."""
    pytest.importorskip("scipy")
    code, shown = _documented("scipy.linalg.expm")
    env = {k: v for k, v in os.environ.items() if k != "SCIPY_ARRAY_API"}
    proc = subprocess.run([sys.executable, "-c", SCIPY_CHECK, code], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    *printed, last = proc.stdout.splitlines()
    _available_lines(shown, printed)
    returns_numpy = json.loads(last)
    for line in printed:
        name, target_id, verdict = line.split(maxsplit=2)
        backend = target_id.split("-")[0]
        if name == "logsumexp" or backend == "numpy":
            assert verdict == "pass"
        else:
            assert returns_numpy[target_id]
            assert verdict == f"FAIL at output: namespace numpy, expected {NAMESPACE[backend]}"


# ------------------------------------------------------------- the plugin
def test_plugin_fixture_is_every_target(array_target: Target, request: pytest.FixtureRequest) -> None:
    assert request.node.callspec.id == array_target.id
    assert array_target.available  # unavailable ones were skipped with their reason
    x = array_target.asarray(X)
    assert to_numpy(gram(x)).shape == (3, 8, 8)


@pytest.mark.array_targets(backends=["numpy"], dtypes=["float32"])
def test_plugin_marker_narrows(array_target: Target, array_xp: Any) -> None:
    assert array_target.id == "numpy-cpu-float32"
    assert array_xp is array_target.xp


def test_plugin_float64_fixture(array_target64: Target) -> None:
    assert array_target64.dtype == "float64" and array_target64.tolerance == TOLERANCES["float64"]


# The plugin module is already imported by this session's conftest: pytest notes it cannot rewrite its asserts.
@pytest.mark.filterwarnings("ignore::pytest.PytestAssertRewriteWarning")
def test_plugin_collects_the_whole_matrix(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        import pytest

        def test_each(array_target):
            assert array_target.available

        @pytest.mark.array_targets(dtypes=["float64"])
        def test_some(array_target):
            assert array_target.dtype == "float64"
        """
    )
    result = pytester.runpytest_inprocess("-p", "fismo_core.pytest_plugin", "-q")
    n, n64 = len(targets()), len(targets(dtypes=["float64"]))
    avail, avail64 = len(AVAILABLE), len([t for t in AVAILABLE if t.dtype == "float64"])
    result.assert_outcomes(passed=avail + avail64, skipped=(n - avail) + (n64 - avail64))


def test_plugin_refuses_a_positional_marker_argument(pytester: pytest.Pytester) -> None:
    """``array_targets(["torch"])`` was ignored (every target ran): now a collection error that says
    the marker takes keywords."""
    pytester.makepyfile(
        """
        import pytest

        @pytest.mark.array_targets(["torch"])
        def test_some(array_target):
            pass
        """
    )
    result = pytester.runpytest_inprocess("-p", "fismo_core.pytest_plugin", "-q")
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*array_targets takes keywords only*"])


@pytest.mark.parametrize(("marker", "fixture", "error"), [
    ('array_targets(backend=["numpy"])', "array_target", "*unknown keywords ?'backend'?*"),
    ('array_targets(dtypes=["float32"])', "array_target64", "*holds ('float64',) targets only*"),
    # dtypes=[] ran every float64 target on array_target64 and skipped array_target as an empty parameter
    # set (a user's hunt, 2026-12-03): both are errors now.
    ("array_targets(dtypes=[])", "array_target64", "*holds ('float64',) targets only*"),
    ("array_targets(dtypes=[])", "array_target", "*selects no targets*"),
    ("array_targets(backends=[])", "array_target", "*selects no targets*"),
    # dtypes="float64" on array_target64 said it "holds ('float64',) targets only" (its letters were
    # compared), backends=3 raised a bare TypeError, and a marker on a test without the fixtures was
    # ignored (a user's hunt, 2026-12-03).
    ('array_targets(dtypes="float64")', "array_target64", "*dtypes must be a list of names, not the string 'float64'*"),
    ('array_targets(dtypes=["float16"])', "array_target64", "*unknown dtypes ?'float16'?*"),
    ("array_targets(backends=3)", "array_target", "*backends must be a list of names, got 3*"),
    ('array_targets(backends=["torhc"])', "array_target", "*unknown backends ?'torhc'?*"),
    ('array_targets(backends=["numpy"])', "tmp_path", "*the test uses neither array_target nor array_target64*"),
])
def test_plugin_refuses_a_marker_it_would_ignore(pytester: pytest.Pytester, marker: str, fixture: str, error: str) -> None:
    """A misspelt keyword (``backend=``) ran every target; ``array_target64`` asked for float32 gave an
    empty parametrisation (one ``[NOTSET]`` skip): both are now collection errors saying why."""
    pytester.makepyfile(
        f"""
        import pytest

        @pytest.mark.{marker}
        def test_some({fixture}):
            pass
        """
    )
    result = pytester.runpytest_inprocess("-p", "fismo_core.pytest_plugin", "-q")
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines([error])


def test_target_asarray_is_a_copy(target: Target) -> None:
    """NumPy, array-api-strict and torch (same dtype, on the CPU) shared the caller's memory: a routine
    that wrote into its input changed the test's data, and the next test saw it (a user's hunt,
    2026-12-03)."""
    data = X.copy()
    converted = target.asarray(data)
    data[...] = 0.0  # the caller's array changes; the target's must not
    assert np.array_equal(to_numpy(converted), X.astype(target.dtype))


@pytest.mark.filterwarnings("ignore::pytest.PytestAssertRewriteWarning")
def test_plugin_markers_stack(pytester: pytest.Pytester) -> None:
    """Only the closest ``array_targets`` marker counted: a module's ``backends`` with a function's
    ``dtypes`` ran every backend, and two decorators kept the inner one only. Each marker narrows."""
    pytester.makepyfile(
        """
        import pytest

        pytestmark = pytest.mark.array_targets(backends=["numpy", "array_api_strict"])

        @pytest.mark.array_targets(dtypes=["float32"])
        def test_module_and_function(array_target):
            pass

        @pytest.mark.array_targets(backends=["numpy", "numpy"])
        @pytest.mark.array_targets(dtypes=["float64"])
        def test_two_decorators_and_a_repeated_name(array_target):
            pass
        """
    )
    result = pytester.runpytest_inprocess("-p", "fismo_core.pytest_plugin", "-v")
    result.assert_outcomes(passed=3)
    result.stdout.fnmatch_lines_random([
        "*test_module_and_function?numpy-cpu-float32? PASSED*",
        "*test_module_and_function?array_api_strict-CPU_DEVICE-float32? PASSED*",
        "*test_two_decorators_and_a_repeated_name?numpy-cpu-float64? PASSED*",
    ])


_JAX_DEFAULTS = """
import jax.numpy as jnp

def test_{name}():
    assert jnp.zeros(3).dtype == jnp.float32  # JAX's own default, x64 off
"""


@pytest.mark.skipif(not any(t.backend == "jax" and t.available for t in targets()), reason="JAX is not installed")
def test_plugin_leaves_no_setting_behind(pytester: pytest.Pytester) -> None:
    """Collecting a test that used the fixtures switched JAX's x64 on for the whole session (earlier tests and
    deselected runs included), and loading the plugin imported torch and JAX. Now a JAX target's settings hold
    during its test only, and the plugin imports nothing until a test uses it. A fresh process: this
    session's conftest turns x64 on."""
    pytester.makepyfile(
        test_a_before=_JAX_DEFAULTS.format(name="before"),
        test_b_targets="""
            import jax.numpy as jnp
            import pytest

            @pytest.mark.array_targets(backends=["jax"])
            def test_jax(array_target, array_xp):
                x = array_target.asarray([1.0, 2.0])
                assert x.dtype == getattr(jnp, array_target.dtype)
                assert array_xp.zeros(3).dtype == jnp.float64  # x64 on, as in fismo verify
        """,
        test_c_after=_JAX_DEFAULTS.format(name="after"),
    )
    result = pytester.runpytest_subprocess("-p", "fismo_core.pytest_plugin", "-p", "no:cacheprovider", "-q")
    result.assert_outcomes(passed=4)
    result = pytester.runpytest_subprocess("-p", "fismo_core.pytest_plugin", "-p", "no:cacheprovider", "-q",
                                           "-k", "after")  # the x64 switch came at collection
    result.assert_outcomes(passed=1, deselected=3)

    pytester.makepyfile(test_a_before="""
        import sys

        def test_nothing_imported():
            assert not {"torch", "jax"} & set(sys.modules)
    """)
    result = pytester.runpytest_subprocess("-p", "fismo_core.pytest_plugin", "-p", "no:cacheprovider", "-q",
                                           "test_a_before.py")
    result.assert_outcomes(passed=1)


def _fresh_process(script: str) -> str:
    """What ``script`` prints, run by this Python in a new process (which must succeed)."""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.mark.skipif(not any(t.backend == "jax" and t.available for t in targets()), reason="JAX is not installed")
def test_check_backends_leaves_jaxs_x64_as_it_was() -> None:
    """It listed the targets, which switched x64 on for the rest of the process; the JAX float64 row still
    runs in float64 (inside `Target.configured`)."""
    script = (
        "import jax, numpy as np\n"
        "from fismo_core.testing import check_backends, targets\n"
        "seen = []\n"
        "report = check_backends(lambda x: seen.append(str(x.dtype)) or x * 2, np.ones(3), "
        "targets=targets(backends=['jax']))\n"
        "print(report.ok, sorted(set(seen)), jax.config.jax_enable_x64, jax.numpy.zeros(1).dtype)\n"
    )
    assert _fresh_process(script).split() == ["True", "['float32',", "'float64']", "False", "float32"]


def test_full_float32_matmuls_reads_and_restores_torchs_newer_api() -> None:
    """A program that set TF32 through torch's newer API (``fp32_precision``, torch >= 2.9, as torch
    advises) made `check_backends` raise torch's "mix of the legacy and new APIs" ``RuntimeError``: it
    read ``allow_tf32``. A fresh process, since that state makes torch's older reading raise."""
    torch = pytest.importorskip("torch")
    if not hasattr(torch.backends.cuda.matmul, "fp32_precision"):
        pytest.skip(f"torch {torch.__version__} has no fp32_precision settings (torch < 2.9)")
    script = (
        "import numpy as np, torch\n"
        "from fismo_core.testing import check_backends, full_float32_matmuls, targets\n"
        "leaves = [torch.backends.cuda.matmul, torch.backends.cudnn.conv, torch.backends.mkldnn.matmul]\n"
        "torch.backends.cuda.matmul.fp32_precision = 'tf32'\n"
        "torch.backends.mkldnn.matmul.fp32_precision = 'bf16'\n"
        "before = [leaf.fp32_precision for leaf in leaves]\n"
        "with full_float32_matmuls():\n"
        "    inside = [leaf.fp32_precision for leaf in leaves]\n"
        "report = check_backends(lambda x: x @ x.T, np.ones((3, 3)), targets=targets(backends=['torch']))\n"
        "print(before, inside, [leaf.fp32_precision for leaf in leaves], report.ok)\n"
    )
    before, inside, after, ok = _fresh_process(script).strip().split("] ")
    assert before == after == "['tf32', 'tf32', 'bf16'"
    assert inside == "['ieee', 'ieee', 'ieee'" and ok == "True"


@pytest.mark.skipif(not any(t.backend == "jax" and t.available for t in targets()), reason="JAX is not installed")
def test_full_float32_matmuls_overrides_a_jax_precision_scope_and_leaves_it() -> None:
    """Inside the caller's ``jax.default_matmul_precision("bfloat16")`` the harness's "highest" was not in
    effect (a scoped value wins over the global one it set), and restoring wrote "bfloat16" as the global."""
    import jax

    global_before = jax.config.jax_default_matmul_precision
    with jax.default_matmul_precision("bfloat16"):
        with full_float32_matmuls():
            assert jax.config.jax_default_matmul_precision == "highest"
        assert jax.config.jax_default_matmul_precision == "bfloat16"
    assert jax.config.jax_default_matmul_precision == global_before


def test_targets_refuses_a_single_string() -> None:
    """``targets(backends="numpy")`` was split into characters ("unknown backend 'n'")."""
    with pytest.raises(TypeError, match=r"backends must be a list of names, not the string 'numpy'"):
        targets(backends="numpy")
    with pytest.raises(TypeError, match=r"dtypes must be a list of names"):
        targets(dtypes="float64")


# ------------------------------------------------------- errata (docs/verification.md)
def _objective(P: Any, Q: Any, grads: Any, mu: float) -> float:
    """The paper's J(P, Q) (eq. best_kron_obj_matrix), expectation as the mean over ``grads``."""
    m, n = P.shape[0], Q.shape[0]
    Pi, Qi = np.linalg.inv(P), np.linalg.inv(Q)
    data = np.mean([np.trace(Pi @ G @ Qi @ G.T) for G in grads])
    return float(data + mu * np.trace(Pi) * np.trace(Qi) + n * np.linalg.slogdet(P)[1] + m * np.linalg.slogdet(Q)[1])


def test_erratum_objective_is_not_convex_in_P_but_is_in_its_inverse() -> None:
    """Theorem 1's proof calls J strictly convex in P: the midpoint of P1 = 10 I and P2 = 100 I is a counterexample.
    In X = P^{-1} it is convex (a linear term plus -n log det X), so the minimiser is still unique."""
    m, n, mu = 4, 6, 1e-3
    grads = np.random.default_rng(0).standard_normal((8, m, n))
    Q = np.eye(n)
    P1, P2 = 10 * np.eye(m), 100 * np.eye(m)
    J = lambda P: _objective(P, Q, grads, mu)  # noqa: E731
    assert J((P1 + P2) / 2) > (J(P1) + J(P2)) / 2  # midpoint convexity fails in P
    rng = np.random.default_rng(1)
    for _ in range(20):  # ... and holds in P^{-1}, on random pairs of SPD matrices
        A, B = rng.standard_normal((2, m, m))
        X1, X2 = A @ A.T + 0.1 * np.eye(m), B @ B.T + 0.1 * np.eye(m)
        Jx = lambda X: J(np.linalg.inv(X))  # noqa: E731
        assert Jx((X1 + X2) / 2) <= (Jx(X1) + Jx(X2)) / 2 + 1e-9
    # The stationary point of Theorem 1 is the minimiser: random perturbations only increase J.
    P_star = np.mean([G @ G.T for G in grads], axis=0) / n + mu * np.trace(np.linalg.inv(Q)) / n * np.eye(m)
    for _ in range(20):
        E = rng.standard_normal((m, m)) * 1e-2
        assert J(P_star + E @ E.T) > J(P_star)


def test_erratum_algorithm_damping_is_mu_times_identity_not_theorem_1s() -> None:
    """Algorithm 1 damps L_t with mu tr(P_{t-1})/m I = mu I (tr P = m after every step); Theorem 1's
    minimiser has mu tr(Q^{-1})/n I, which is larger whenever Q != I (tr Q = n, AM-HM)."""
    stream = gaussian_streams(50)[0]
    out = run_stream(FISMO(), stream, lambda a: np.asarray(a, dtype=np.float64))
    m, n = stream.shape[-2:]
    trace_P = np.trace(out["P"], axis1=-2, axis2=-1) / m
    assert np.allclose(trace_P, 1.0, rtol=0, atol=1e-12)  # Algorithm 1's factor: exactly 1 (up to rounding)
    theorem = np.trace(np.linalg.inv(out["Q"]), axis1=-2, axis2=-1) / n
    assert np.all(theorem >= 1.0 - 1e-12)
    assert np.max(theorem[-1]) > 1.5  # at step 50 Theorem 1 would damp P more than 1.5x as strongly


def _lemma_run(steps: int = 30) -> list[tuple[float, float, float, float]]:
    """Algorithm 1 on L(W) = ||W - A||_F^2 / 2 (smooth with L = 1) with exact gradients and beta = 0, so that the
    convergence lemma's two error terms are 0. Per step: (K_PQ, L(W_t), the lemma's bound, the corrected bound)."""
    m, n, eta = 6, 4, 1e-3
    A = np.diag(np.geomspace(0.1, 10, m)) @ np.random.default_rng(0).standard_normal((m, n))  # anisotropic
    loss = lambda W: 0.5 * float(np.sum((W - A) ** 2))  # noqa: E731
    nuclear = lambda X: float(np.linalg.svd(X, compute_uv=False).sum())  # noqa: E731
    opt = FISMO(lr=eta, beta=0.0, gamma=0.5, mu=1e-3, polar="svd")
    W = np.zeros((m, n))
    state, out = opt.init(W), []
    for _ in range(steps):
        G = W - A  # the exact gradient
        W_new, state, lines = opt.step_lines(W, G, state)
        P_inv_sqrt, Q_inv_sqrt = np.asarray(lines.P_inv_sqrt), np.asarray(lines.Q_inv_sqrt)
        K = float(np.linalg.norm(P_inv_sqrt, 2) * np.linalg.norm(Q_inv_sqrt, 2))
        lemma = loss(W) - eta * K * nuclear(G) + eta**2 / 2 * min(m, n) * K**2
        # <grad, D> = ||P^-1/2 G Q^-1/2||_* >= ||G||_* / (||P^1/2||_2 ||Q^1/2||_2): the lower bound the proof needs
        sqrt_norms = float(np.linalg.norm(np.linalg.inv(P_inv_sqrt), 2) * np.linalg.norm(np.linalg.inv(Q_inv_sqrt), 2))
        corrected = loss(W) - eta * nuclear(G) / sqrt_norms + eta**2 / 2 * float(np.sum(np.asarray(lines.direction) ** 2))
        out.append((K, loss(W_new), lemma, corrected))
        W = W_new
    return out


def test_erratum_convergence_lemma_uses_an_upper_bound_where_it_needs_a_lower_one() -> None:
    """Lemma lem:cvg-lem bounds L(W_t) with -eta K_PQ ||grad L||_*, but its proof gets there by plugging the upper
    bound ||P^-1/2 grad Q^-1/2||_* <= K_PQ ||grad||_* (eq. cvg-lem-1) into a term with a minus sign, which needs a
    lower bound (an independent reading, 2026-12-04). On a quadratic with exact gradients and beta = 0 (both error
    terms 0) the lemma's bound fails at every step, and the bound with ||grad||_* / (||P^1/2||_2 ||Q^1/2||_2)
    holds at every step (to rounding: 1e-9 on losses of about 146)."""
    for K, loss_t, lemma, corrected in _lemma_run():
        assert K > 1 and loss_t > lemma, (K, loss_t, lemma)
        assert loss_t <= corrected + 1e-9, (loss_t, corrected)


def test_non_finite_values_in_the_same_places_agree() -> None:
    """An output with NaN or infinity where NumPy float64 has the same (a log of zero, a masked fill)
    failed every target with an inf error; such entries now agree, as ``assert_allclose`` counts them,
    and the error is that of the other entries. Any other non-finite value still fails."""
    reference = np.array([[np.nan, np.inf, 1.0], [-np.inf, 2.0, 3.0]])
    assert max_relative_error(reference.copy(), reference) == 0.0
    shifted = reference.copy()
    shifted[1, 2] = 3.0 * (1 + 1e-6)
    assert max_relative_error(shifted, reference) == pytest.approx(3e-6 / math.sqrt(1 + 4 + 9))
    for where, value in [((0, 1), -np.inf), ((0, 0), np.inf), ((0, 2), np.nan), ((0, 1), 5.0)]:
        wrong = reference.copy()
        wrong[where] = value
        assert max_relative_error(wrong, reference) == math.inf, (where, value)
    # Complex: each part must agree; a NaN real part beside a different imaginary part does not.
    z = np.array([complex(np.nan, 1.0), 2 + 0j])
    assert max_relative_error(z.copy(), z) == 0.0
    assert max_relative_error(np.array([complex(np.nan, 2.0), 2 + 0j]), z) == math.inf

    def log_and_mean(x: Any) -> Any:
        xp = array_namespace(x)
        return xp.log(xp.where(x > 0, x, xp.zeros_like(x))), xp.mean(x)  # log 0 = -inf where x <= 0

    x = np.array([[1.0, -2.0], [0.5, 3.0]])
    with np.errstate(divide="ignore"):  # NumPy's log(0), in the reference call
        report = check_backends(log_and_mean, x, targets=AVAILABLE)
    assert report.ok, report.table()


def test_to_numpy_reads_torchs_lazy_conjugate_and_negative_views() -> None:
    """``torch.conj`` of a complex tensor is a view with the conjugate bit set, which ``Tensor.numpy()``
    refuses: ``to_numpy`` raised on a complex128 one (a complex64 one was converted, and so resolved)."""
    torch = pytest.importorskip("torch")
    z = torch.tensor([1 + 2j, 3 - 1j], dtype=torch.complex128)
    assert torch.conj(z).is_conj()
    np.testing.assert_array_equal(to_numpy(torch.conj(z)), np.array([1 - 2j, 3 + 1j]))
    negative = torch.tensor([1.0, 2.0], dtype=torch.float64)._neg_view()
    assert negative.is_neg()
    np.testing.assert_array_equal(to_numpy(negative), np.array([-1.0, -2.0]))


def test_reversed_inputs_reach_every_target(target: Target) -> None:
    """A negative-stride view (``x[::-1]``, ``np.flip``) made ``target.asarray`` raise torch's "At least one
    stride in the given numpy array is negative", and ``check_backends`` stop with a `HarnessError` for
    the whole matrix (a user's hunt, 2026-12-04)."""
    reversed_view = np.flip(X, 0)
    assert any(s < 0 for s in reversed_view.strides)
    assert np.array_equal(to_numpy(target.asarray(reversed_view)), reversed_view.astype(target.dtype))


def test_check_backends_takes_reversed_arrays() -> None:
    """Reversed floating and integer arguments (integer ones keep their dtype: they failed on torch's
    float32 rows as well)."""
    report = check_backends(lambda a, i: array_namespace(a).take(a, i, axis=0) * 2, np.flip(X, 0), np.arange(3)[::-1])
    assert report.ok and all(r.passed for r in report if r.target.available), report.table()


@pytest.mark.parametrize("order", [["torch", "numpy"], {"numpy", "torch", "jax"}], ids=["list", "set"])
def test_targets_come_in_the_librarys_order(order: Any) -> None:
    """A set's order depends on string hashing (``PYTHONHASHSEED``): ``targets(backends={...})`` and the
    marker listed their targets in another order in each process, and pytest-xdist's workers refused to run
    ("Different tests were collected between gw0 and gw1"; a user's hunt, 2026-12-04). Whatever the order
    given, the targets come in the library's."""
    chosen = [t.backend for t in targets(backends=order)]
    assert chosen == [t.backend for t in targets() if t.backend in set(order)]


def test_a_set_of_backends_collects_the_same_tests_under_every_hash_seed(pytester: pytest.Pytester,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    pytester.makepyfile(
        """
        import pytest

        @pytest.mark.array_targets(backends={"torch", "numpy", "array_api_strict", "jax"})
        def test_some(array_target):
            pass
        """
    )
    collected = set()
    for seed in ("1", "3", "7"):
        monkeypatch.setenv("PYTHONHASHSEED", seed)  # the subprocess's environment is this one's
        result = pytester.runpytest_subprocess("-p", "fismo_core.pytest_plugin", "--collect-only", "-q")
        collected.add(tuple(line for line in result.outlines if "test_some[" in line))
    assert len(collected) == 1 and len(next(iter(collected))) > 1, collected


def test_plugin_refuses_a_marker_on_one_param(pytester: pytest.Pytester) -> None:
    """A marker on one ``pytest.param`` was ignored: the case ran on every target (a user's hunt,
    2026-12-04). The targets are chosen per function; such a case now errors, saying so, and the
    others run."""
    pytester.makepyfile(
        """
        import pytest

        @pytest.mark.parametrize("n", [1, pytest.param(2, marks=pytest.mark.array_targets(backends=["numpy"]))])
        @pytest.mark.array_targets(backends=["numpy"], dtypes=["float64"])
        def test_some(array_target, n):
            pass
        """
    )
    result = pytester.runpytest_inprocess("-p", "fismo_core.pytest_plugin", "-q")
    result.assert_outcomes(passed=1, errors=1)
    result.stdout.fnmatch_lines(["*the array_targets marker of a pytest.param (marks=...) cannot narrow*"])


def test_bfloat16_numpy_inputs_are_floating() -> None:
    """``np.asarray`` of a JAX bfloat16 array is an ml_dtypes array, of NumPy kind ``"V"``: alone it was
    refused ("needs at least one floating ... NumPy array"), and beside a float64 array it reached every
    backend unconverted (array-api-strict raised, blamed on ``fn``; a user's hunt, 2026-12-04). It is
    converted to each target's dtype as any floating input."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    narrow = X.astype(ml_dtypes.bfloat16)
    for args in ((narrow,), (narrow, X)):
        report = check_backends(lambda *a: sum(a[1:], a[0]) * 2, *args, targets=[
            t for t in AVAILABLE if t.backend in ("numpy", "array_api_strict")])
        assert report.ok, report.table()
    assert testing_mod._is_ml_dtypes_float(narrow.dtype)
    assert not testing_mod._is_ml_dtypes_float(np.dtype(ml_dtypes.int4))


def test_python_ints_beyond_int64_are_compared_exactly() -> None:
    """A Python int beyond int64 is held as an object array, which was compared within the floating
    tolerance: 2**70 + 1 against 2**70 passed a float32 row, where 2**62 + 1 against 2**62 failed (a
    user's hunt, 2026-12-04)."""
    assert max_relative_error(2**70 + 1, 2**70) > 0
    assert max_relative_error(2**70, 2**70) == 0

    def count(x: Any) -> int:
        xp = array_namespace(x)
        return 2**70 + (0 if is_numpy_namespace(xp) and x.dtype == xp.float64 else 1)

    report = check_backends(count, X, targets=NUMPY)
    assert report[0].verdict == "pass"
    assert report[1].mismatches == {"output": "it differs (integer and boolean outputs must be equal)"}
