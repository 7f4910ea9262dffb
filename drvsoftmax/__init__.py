"""drvsoftmax: fused ``softmax(x * scale + mask)`` on NVIDIA GPUs through the CUDA driver API.

    y  = drvsoftmax.scaled_masked_softmax(x, mask=None, *, scale=1.0, causal=False,
                                          key_lengths=None, out=None, stream=None)
    dx = drvsoftmax.scaled_masked_softmax_backward(dy, y, *, scale=1.0, out=None, stream=None)

Softmax runs over the last axis of ``x`` ([..., Sq, Sk], canonically [B, H, Sq, Sk]).
Mask semantics, with keys j along the last axis and queries i along the one before::

    bool / integer mask : nonzero = HIDDEN (Megatron / apex / key_padding_mask convention,
                          the opposite of SDPA's boolean attn_mask)
    float mask          : added after scaling; -inf hides
    causal=True         : key j hidden from query i when j > i + (Sk - Sq)
                          (bottom-right aligned:  Sq=2, Sk=4  ->  . . . x
                                                                  . . . .   x = hidden)
    key_lengths [B]     : keys j >= key_lengths[b] hidden (any integer dtype; clamped to [0, Sk])

A row with no visible key is all zeros; a row whose scores hold NaN or +inf is NaN.
CUDA torch tensors, CuPy and Numba arrays, jax.Arrays on a GPU (outside ``jax.jit``) and
any CUDA array that speaks DLPack or ``__cuda_array_interface__`` run the fused kernel;
results come back in the input's own array type.  NumPy arrays, CPU tensors and CPU JAX
arrays take a float64 reference path with the same semantics.  ``drvsoftmax.raw`` takes raw
device pointers.  Nothing here touches the GPU at import time.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

import numpy as np

from . import _args
from ._errors import (
    ArgumentTypeError,
    ArgumentValueError,
    CudaDriverError,
    DrvSoftmaxError,
    KernelUnavailableError,
    NvrtcError,
    arg_type_error,
    arg_value_error,
)
from ._version import __version__

__all__ = [
    "scaled_masked_softmax",
    "scaled_masked_softmax_backward",
    "explain",
    "DrvSoftmaxError",
    "ArgumentTypeError",
    "ArgumentValueError",
    "CudaDriverError",
    "NvrtcError",
    "KernelUnavailableError",
    "__version__",
]


_tfront: Any = None  # drvsoftmax.torch, once a torch tensor has been seen
_teager: Any = None  # its eager fast path (drvsoftmax.torch._eager), likewise


def _torch_front(x: object) -> Any:
    global _tfront, _teager
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(x, torch.Tensor):
        from . import torch as front

        _tfront, _teager = front, front._eager
        return front
    return None


def _door(x: object, name: str) -> Any:
    """The door of a non-torch array: a module with ``forward`` and ``backward``.

    The one dispatch point: NumPy arrays take the reference path; JAX arrays their own
    door (tried first, before the generic intake would read them through DLPack); every
    other object the intake reads (CuPy, Numba, DLPack and CUDA-array-interface
    producers) the GPU array door.
    """
    if isinstance(x, np.ndarray):
        from . import _numpy

        return _numpy
    if type(x).__module__.startswith("jax"):
        door = _jax_door()
        if door is not None:
            return door
    arrays = _arrays_door or _load_arrays_door()
    if arrays._intake.kind(x):
        return arrays
    raise arg_type_error(
        name,
        "a torch.Tensor, a NumPy array or a CUDA array (__dlpack__ or __cuda_array_interface__)",
        type(x).__name__,
    )


_arrays_door: Any = None  # drvsoftmax._arrays, once imported


def _load_arrays_door() -> Any:
    global _arrays_door
    from . import _arrays

    _arrays_door = _arrays
    return _arrays


def _jax_door() -> Any:
    """drvsoftmax._jax where it exists (None: JAX arrays go through the generic intake)."""
    try:
        return importlib.import_module(f"{__name__}._jax")
    except ModuleNotFoundError as e:
        if e.name != f"{__name__}._jax":
            raise
        return None


def scaled_masked_softmax(
    x: Any,
    mask: Any = None,
    *,
    scale: float = 1.0,
    causal: bool = False,
    key_lengths: Any = None,
    out: Any = None,
    stream: Any = None,
) -> Any:
    """``softmax(x * scale + bias, axis=-1)``, fused, with every mask source combined.

    Args:
        x: [..., Sk] scores; float16, bfloat16 or float32 (float64 on the CPU path): a
            torch.Tensor, a NumPy array, a CuPy or Numba device array, or any CUDA array
            that speaks DLPack (``__dlpack__``/``__dlpack_device__``) or
            ``__cuda_array_interface__``.  Leading dims may have any strides; nothing is copied.
        mask: optional, broadcastable to x.shape ([B,1,Sq,Sk], [1,1,Sq,Sk], [Sq,Sk],
            [B,1,1,Sk], ...). bool/integer: nonzero hides. float: added; -inf hides.
        scale: finite real multiplier applied to x before the mask (0 and negatives too).
        causal: hide key j from query i when j > i + (Sk - Sq).
        key_lengths: integers of shape [B] (B = x.shape[0]); keys j >= key_lengths[b] hidden.
            Any integer dtype on every path (int32/int64 are read directly on the GPU,
            others are converted there first: B elements); values clamp to [0, Sk].
        out: optional destination of x's shape and dtype; ``out=x`` works in place.  Any
            other overlap of out with x, mask or key_lengths is refused, as is a read-only
            out.  Required for CUDA arrays of libraries other than CuPy and Numba.
        stream: None for the framework's current stream, else a CUstream, an int handle,
            or an object with ``__cuda_stream__`` (checked on the CPU paths too).  The
            launch waits, without a host sync, for the stream each input's producer names
            (DLPack: the producer is given this stream; ``__cuda_array_interface__`` v3:
            its ``stream`` entry; CuPy: its current stream).

    Returns y of x's dtype and array type: a torch.Tensor (with autograd), a CuPy or Numba
    device array, a NumPy array, or ``out``.
    """
    eager = _teager
    if eager is not None and mask is None and key_lengths is None and out is None and stream is None:
        y = eager(x, scale, causal)  # (None unless x is a torch tensor on the eager fast path)
        if y is not None:
            return y
    front = _tfront
    if front is None or not isinstance(x, front.Tensor):
        front = _torch_front(x)
    if front is not None:
        return front.scaled_masked_softmax(
            x, mask, scale=scale, causal=causal, key_lengths=key_lengths, out=out, stream=stream
        )
    return _door(x, "x").forward(x, mask, scale, causal, key_lengths, out, stream)


def scaled_masked_softmax_backward(dy: Any, y: Any, *, scale: float = 1.0, out: Any = None, stream: Any = None) -> Any:
    """``dx = scale * y * (dy - sum(dy * y, -1))``; exactly 0 where y == 0.

    dy and y have the same shape and dtype; neither is written unless ``out`` is exactly
    one of them (any other overlap of out with dy or y is refused).  Same array types and
    streams as the forward; on tensors that require grad the result is differentiable.
    """
    front = _tfront
    if front is None or not isinstance(y, front.Tensor):
        front = _torch_front(y)
    if front is not None:
        return front.scaled_masked_softmax_backward(dy, y, scale=scale, out=out, stream=stream)
    return _door(y, "y").backward(dy, y, scale, out, stream)


def _dtype_arg(v: object) -> str:
    """A dtype given as a name, a NumPy dtype or type, or a torch.dtype: its name."""
    if isinstance(v, str):
        return v.replace("torch.", "")
    if type(v).__module__ == "torch":
        return str(v).replace("torch.", "")
    try:
        return str(np.dtype(v).name)  # type: ignore[call-overload]
    except (TypeError, ValueError):
        return repr(v)


def explain(
    x_shape: Any,
    dtype: Any = "float16",
    *,
    mask_dtype: Any = None,
    causal: bool = False,
    backward: bool = False,
    arch: str | None = None,
) -> str:
    """What would run for an input of this shape and dtype: tier, kernel, launch shape.

    Needs no GPU.  Assumes a contiguous layout (16-byte accesses); strided layouts use
    the same tier with element-wise accesses.  `arch` ('sm_90', ...) plans for that GPU
    architecture: rows beyond the register tier take the cluster tier on sm_90+ where its
    shared memory holds them, else the coop tier (co-resident blocks; its groups of blocks
    are set at launch from the device's occupancy); None plans the tiers every GPU has.
    """
    from . import _core, _plan

    shape = _args.check_shape_arg("x_shape", x_shape)
    dt = _dtype_arg(dtype)
    _args.check_x(shape, dt, _args.X_DTYPES_GPU, "on the GPU")
    causal = _args.check_causal(causal)
    backward = _args.check_flag("backward", backward)
    _args.check_causal_shape(causal, shape)
    kind = "none"
    if mask_dtype is not None:
        mdt = _dtype_arg(mask_dtype)
        _args.check_mask_dtype(mdt)
        kind = _core.MASK_KIND_OF_DTYPE[mdt]
    if shape[-1] > _core.MAX_SK:
        raise arg_value_error("x", f"rows of at most {_core.MAX_SK} elements", f"Sk = {shape[-1]}")
    rows = 1
    for n in shape[:-1]:
        rows *= n
    if rows == 0 or shape[-1] == 0:
        return f"no kernel: x of shape {shape} is empty (the result is returned without a launch)"
    caps = None
    if arch is not None:
        from ._compiler import parse_arch

        caps = _plan.caps_of_arch(parse_arch(arch)[1])
    itemsize = _plan.X_DTYPES[dt][1]
    contig = tuple(int(np.prod(shape[i + 1 :])) for i in range(len(shape)))
    ops = [_core.Operand(0, dt, shape, contig)]
    vec = _core._vector_ok(itemsize, ops, shape[:-1])
    ra = _core.rows_aligned(ops, shape[:-1], _core.CHUNK_ELEMS[itemsize])
    if backward:
        return _plan.plan_backward(rows, shape[-1], dt, vec, ra, caps).describe()
    return _plan.plan_forward(rows, shape[-1], dt, kind, vec, ra, caps, causal=causal).describe()
