"""A compiled float64 step that rounds as the eager one: ATen's kernels for what inductor would round otherwise.

Part of [`fismo_core.backends.torch`][fismo_core.backends.torch]. Inductor generates its own C++ for
reductions and elementwise operations, and some of those round otherwise than torch's eager kernels: on
an Intel Xeon with AVX-512 (2026-12-05) the traces of lines 4-5 (summed in another order), the square
root of the eigenvalues (torch's eager float64 ``sqrt`` is not correctly rounded, inductor's is), the
power of two's ``log2``, the update's ``addcmul`` (eager fuses a multiply-add) and the products of a
256 x 64 matrix (inductor lays the operands of a product out otherwise, and BLAS rounds by layout).
While `EagerKernels` is active (a ``TorchFunctionMode`` that dynamo traces), each of those calls
becomes one opaque graph node, a custom operator that runs the ATen kernel eager torch runs, on
operands laid out as eager's (custom operators keep their inputs' strides). Inductor still fuses the
elementwise arithmetic between them (``+``, ``*``, ``/`` are correctly rounded in both). The torch
adapter enters it in a compiled step whose FISMO groups hold a float64 parameter and which reads
nothing on the host (every group ``nonfinite="propagate"``, the roots unchecked: the one graph of the
sync-free step; dynamo cannot resume a host read's graph break inside the mode): the step then equals
the eager one bit for bit (``tests/test_torch_compile.py``) and is still faster than eager (docs/torch.md,
"The eager numbers"). In float32 and bfloat16 inductor keeps its own kernels (faster; within the
tolerances of ``tests/test_compile_core.py``).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["EagerKernels", "wants_eager_kernels"]

#: The functions `EagerKernels` runs by ATen's kernel, by the name `eager_kernel` knows them.
_NAMES: dict[Any, str] = {
    torch.sum: "sum", torch.Tensor.sum: "sum",
    torch.mean: "mean", torch.Tensor.mean: "mean",
    torch.amax: "amax", torch.Tensor.amax: "amax",
    torch.linalg.vector_norm: "vector_norm",
    torch.linalg.matrix_norm: "matrix_norm",
    torch.sqrt: "sqrt", torch.Tensor.sqrt: "sqrt",
    torch.log2: "log2", torch.Tensor.log2: "log2",
}
_PRODUCTS = (torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__)
_ADDCMUL = (torch.addcmul, torch.Tensor.addcmul)
#: The positional parameters after the input of each reduction (the norms take ``ord`` first).
_AFTER_INPUT = {"vector_norm": ("ord", "dim", "keepdim"), "matrix_norm": ("ord", "dim", "keepdim")}


def _run(x: torch.Tensor, name: str, dim: Optional[list[int]], keepdim: bool, ord: Optional[str]) -> torch.Tensor:
    """``name``'s eager call; ``ord`` as text (a custom operator takes no ``str | float``)."""
    if name == "sqrt":
        return torch.sqrt(x)
    if name == "log2":
        return torch.log2(x)
    dims = None if dim is None else tuple(dim)
    if name == "vector_norm":
        return torch.linalg.vector_norm(x, ord=2.0 if ord is None else float(ord), dim=dims, keepdim=keepdim)
    if name == "matrix_norm":
        order: Any = "fro" if ord is None else (ord if ord in ("fro", "nuc") else float(ord))
        return torch.linalg.matrix_norm(x, ord=order, dim=(-2, -1) if dims is None else dims, keepdim=keepdim)
    if name == "amax":
        return torch.amax(x, dim=() if dims is None else dims, keepdim=keepdim)
    reduce = torch.sum if name == "sum" else torch.mean
    return reduce(x) if dims is None else reduce(x, dim=dims, keepdim=keepdim)


@torch.library.custom_op("fismo::eager_kernel", mutates_args=())
def eager_kernel(x: torch.Tensor, name: str, dim: Optional[list[int]], keepdim: bool,
                 ord: Optional[str]) -> torch.Tensor:
    """A reduction, ``sqrt`` or ``log2`` (``name``) by ATen's eager kernel, as one opaque graph node."""
    return _run(x, name, dim, keepdim, ord)


@eager_kernel.register_fake
def _(x: torch.Tensor, name: str, dim: Optional[list[int]], keepdim: bool, ord: Optional[str]) -> torch.Tensor:
    return _run(x, name, dim, keepdim, ord)  # shapes and dtypes: the function's own meta kernels


@torch.library.custom_op("fismo::eager_matmul", mutates_args=())
def eager_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` by ATen's eager kernel, on operands laid out as eager's."""
    return torch.matmul(a, b)


@eager_matmul.register_fake
def _(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.matmul(a, b)


@torch.library.custom_op("fismo::eager_addcmul", mutates_args=())
def eager_addcmul(x: torch.Tensor, t1: torch.Tensor, t2: torch.Tensor, value: float) -> torch.Tensor:
    """``x + value * t1 * t2`` by ATen's eager kernel (a fused multiply-add where eager fuses one)."""
    return torch.addcmul(x, t1, t2, value=value)


@eager_addcmul.register_fake
def _(x: torch.Tensor, t1: torch.Tensor, t2: torch.Tensor, value: float) -> torch.Tensor:
    return torch.addcmul(x, t1, t2, value=value)


def _dims(dim: Any) -> Optional[list[int]]:
    if dim is None:
        return None
    return [int(dim)] if isinstance(dim, int) else [int(d) for d in dim]


class EagerKernels(TorchFunctionMode):
    """Runs the calls inductor rounds otherwise by ATen's eager kernels, each as one opaque graph node.

    Any other call, or one of these with arguments it does not know (a ``dtype``, an ``out``), runs
    as it is, and so does every call outside dynamo's tracing (a distributed step, which runs eagerly
    inside ``torch.compile``, may hold ``DTensor`` parameters, for which these operators have no sharding rule).
    The adapter enters it only in a compiled float64 step (`wants_eager_kernels`) that reads nothing on
    the host (``FISMO._step_reads_the_host``).
    """

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = dict(kwargs or {})
        if not torch.compiler.is_compiling():  # eager (a distributed step inside torch.compile): as it is
            return func(*args, **kwargs)
        tensors = all(isinstance(a, torch.Tensor) and a.is_floating_point() for a in args)
        if func in _PRODUCTS and len(args) == 2 and not kwargs and tensors:
            return eager_matmul(*args)
        if func in _ADDCMUL and len(args) == 3 and set(kwargs) <= {"value"} and tensors:
            return eager_addcmul(*args, float(kwargs.get("value", 1)))
        name = _NAMES.get(func)
        if name is None or not args or not isinstance(args[0], torch.Tensor) or not args[0].is_floating_point():
            return func(*args, **kwargs)
        if "keepdims" in kwargs:  # the array API's spelling, which torch takes too
            kwargs["keepdim"] = kwargs.pop("keepdims")
        if kwargs.get("dtype") is None:
            kwargs.pop("dtype", None)
        parameters: tuple[str, ...] = () if name in ("sqrt", "log2") else _AFTER_INPUT.get(name, ("dim", "keepdim"))
        if len(args) - 1 > len(parameters) or set(kwargs) - set(parameters):
            return func(*args, **kwargs)
        bound = {**dict(zip(parameters, args[1:])), **kwargs}
        ord = bound.get("ord")
        if ord is not None and not isinstance(ord, (int, float, str)):
            return func(*args, **kwargs)
        return eager_kernel(args[0], name, _dims(bound.get("dim")), bool(bound.get("keepdim", False)),
                            None if ord is None else str(ord))


def wants_eager_kernels(param_groups: list[dict]) -> bool:
    """Whether a compiled step enters `EagerKernels`: a FISMO group holds a float64 parameter."""
    return any(p.dtype == torch.float64 for group in param_groups if group["algorithm"] == "fismo"
               for p in group["params"])
