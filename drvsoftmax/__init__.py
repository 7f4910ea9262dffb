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
CUDA torch tensors run the fused kernel; NumPy arrays and CPU tensors take a float64
reference path with the same semantics.  Nothing here touches the GPU at import time.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from . import _args, _reference
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


def _torch_front(x: object) -> Any:
    global _tfront
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(x, torch.Tensor):
        from . import torch as front

        _tfront = front
        return front
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
        x: [..., Sk] scores; float16, bfloat16 or float32 (float64 on the CPU path).
            Leading dims may have any strides; nothing is copied.
        mask: optional, broadcastable to x.shape ([B,1,Sq,Sk], [1,1,Sq,Sk], [Sq,Sk],
            [B,1,1,Sk], ...). bool/integer: nonzero hides. float: added; -inf hides.
        scale: finite real multiplier applied to x before the mask (0 and negatives too).
        causal: hide key j from query i when j > i + (Sk - Sq).
        key_lengths: integers of shape [B] (B = x.shape[0]); keys j >= key_lengths[b] hidden.
            Any integer dtype on every path (int32/int64 are read directly on the GPU,
            others are converted there first: B elements); values clamp to [0, Sk].
        out: optional destination of x's shape and dtype; ``out=x`` works in place.  Any
            other overlap of out with x, mask or key_lengths is refused.
        stream: None for the framework's current stream, else a CUstream, an int handle,
            or an object with ``__cuda_stream__`` (checked on the CPU paths too).

    Returns y of x's dtype and array type: a torch.Tensor (with autograd), a CuPy or Numba
    device array, or a NumPy array.
    """
    front = _tfront
    if front is None or not isinstance(x, front.Tensor):
        front = _torch_front(x)
    if front is not None:
        return front.scaled_masked_softmax(
            x, mask, scale=scale, causal=causal, key_lengths=key_lengths, out=out, stream=stream
        )
    if isinstance(x, np.ndarray):
        return _numpy_forward(x, mask, scale, causal, key_lengths, out, stream)
    if hasattr(x, "__cuda_array_interface__"):  # CuPy, Numba, ...
        from . import _cai

        return _cai.forward(x, mask, scale, causal, key_lengths, out, stream)
    raise arg_type_error(
        "x", "a torch.Tensor, a NumPy array or a CUDA array (__cuda_array_interface__)", type(x).__name__
    )


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
    if isinstance(y, np.ndarray):
        return _numpy_backward(dy, y, scale, out, stream)
    if hasattr(y, "__cuda_array_interface__"):
        from . import _cai

        return _cai.backward(dy, y, scale, out, stream)
    raise arg_type_error(
        "y", "a torch.Tensor, a NumPy array or a CUDA array (__cuda_array_interface__)", type(y).__name__
    )


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
    shared memory holds them; None plans the tiers every GPU has.
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
    vec = _core._vector_ok(itemsize, [_core.Operand(0, dt, shape, contig)], shape[:-1])
    if backward:
        return _plan.plan_backward(rows, shape[-1], dt, vec, True, caps).describe()
    return _plan.plan_forward(rows, shape[-1], dt, kind, vec, True, caps).describe()


# ----------------------------------------------------------------------------------
# NumPy: the reference path.


def _np_region(name: str, a: np.ndarray) -> _args.Region | None:
    return _args.region_bytes(name, int(a.__array_interface__["data"][0]), a.shape, a.strides, a.itemsize)


def _check_np_out(out: np.ndarray) -> None:
    if not out.flags.writeable:
        raise arg_value_error("out", "a writable array", "a read-only array")
    # Element strides for the overlap test (a stride that is no whole number of elements
    # cannot step onto another element's start, so its floor is conservative enough).
    _args.check_out_strides(out.shape, tuple(s // max(out.itemsize, 1) for s in out.strides))


def _np_lengths(key_lengths: object) -> np.ndarray:
    if isinstance(key_lengths, np.ndarray):
        return key_lengths
    if isinstance(key_lengths, (list, tuple)):
        return _args.lengths_array(key_lengths)
    raise arg_type_error(
        "key_lengths",
        "a NumPy integer array, a list or tuple of integers of shape [B] (or None)",
        type(key_lengths).__name__,
    )


def _numpy_forward(
    x: np.ndarray, mask: Any, scale: Any, causal: Any, key_lengths: Any, out: Any, stream: Any
) -> np.ndarray:
    scale = _args.check_scale(scale)
    causal = _args.check_causal(causal)
    _args.check_stream(stream)
    _args.check_x(x.shape, x.dtype.name, _args.X_DTYPES_CPU, "on the CPU path")
    if mask is not None:
        if not isinstance(mask, np.ndarray):
            raise arg_type_error("mask", "a numpy.ndarray like x (or None)", type(mask).__name__)
        _args.check_mask_dtype(mask.dtype.name)
        _args.check_broadcast(mask.shape, x.shape)
    _args.check_causal_shape(causal, x.shape)
    kl = None
    if key_lengths is not None:
        kl = _np_lengths(key_lengths)
        _args.check_key_lengths(kl.shape, kl.dtype.name, x.shape)
    if out is not None:
        if not isinstance(out, np.ndarray):
            raise arg_type_error("out", "a numpy.ndarray like x (or None)", type(out).__name__)
        _args.check_out(out.shape, out.dtype.name, x.shape, x.dtype.name)
        _check_np_out(out)
        _args.check_no_overlap(
            _np_region("out", out),
            (
                _np_region("x", x),
                None if mask is None else _np_region("mask", mask),
                None if kl is None else _np_region("key_lengths", kl),
            ),
            in_place=("x",),
        )
    y = _reference.softmax_forward(x, mask, scale, causal, kl).astype(x.dtype)
    if out is None:
        return y
    dst: np.ndarray = out
    dst[...] = y
    return dst


def _numpy_backward(dy: Any, y: np.ndarray, scale: Any, out: Any, stream: Any) -> np.ndarray:
    scale = _args.check_scale(scale)
    _args.check_stream(stream)
    _args.check_x(y.shape, y.dtype.name, _args.X_DTYPES_CPU, "on the CPU path", "y")
    if not isinstance(dy, np.ndarray):
        raise arg_type_error("dy", "a numpy.ndarray like y", type(dy).__name__)
    if dy.shape != y.shape or dy.dtype != y.dtype:
        raise arg_value_error(
            "dy", f"of y's shape {y.shape} and dtype {y.dtype}", f"shape {dy.shape}, dtype {dy.dtype}"
        )
    if out is not None:
        if not isinstance(out, np.ndarray):
            raise arg_type_error("out", "a numpy.ndarray like y (or None)", type(out).__name__)
        _args.check_out(out.shape, out.dtype.name, y.shape, y.dtype.name, "y")
        _check_np_out(out)
        _args.check_no_overlap(_np_region("out", out), (_np_region("dy", dy), _np_region("y", y)), in_place=("dy", "y"))
    dx = _reference.softmax_backward(dy, y, scale).astype(y.dtype)
    if out is None:
        return dx
    dst: np.ndarray = out
    dst[...] = dx
    return dst
