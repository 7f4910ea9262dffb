"""PyTorch front door: eager fast path, autograd, torch.library ops, nn.Module.

* Eager calls on CUDA tensors go straight to the launcher (no custom-op dispatch).
* Under torch.compile / torch.export (and for tensor subclasses such as FakeTensor),
  calls go through ``torch.ops.drvsoftmax.scaled_masked_softmax`` and
  ``..._backward``, registered with ``torch.library.custom_op``, ``register_fake`` and
  ``register_autograd``, so graphs hold one opaque node and never break.
* CPU tensors take the float64 NumPy reference path, with the same autograd behaviour.
* Autocast: the op is not an autocast op.  Inputs keep their dtype (no upcast copies);
  the output has x's dtype.  Under ``torch.autocast`` scores produced by a matmul are
  already in the autocast dtype, and that is what the softmax runs in.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from . import _args, _core, _driver, _reference
from ._errors import arg_type_error, arg_value_error

_DT = {
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.float32: "float32",
    torch.float64: "float64",
    torch.bool: "bool",
    torch.int8: "int8",
    torch.uint8: "uint8",
    torch.int16: "int16",
    torch.int32: "int32",
    torch.int64: "int64",
}
for _n in ("uint16", "uint32", "uint64"):
    if hasattr(torch, _n):
        _DT[getattr(torch, _n)] = _n

_PLAIN = (torch.Tensor, torch.nn.Parameter)
_raw_stream = torch._C._cuda_getCurrentRawStream if hasattr(torch._C, "_cuda_getCurrentRawStream") else None


def _dtname(t: Tensor) -> str:
    return _DT.get(t.dtype) or str(t.dtype).replace("torch.", "")


def _operand(t: Tensor) -> _core.Operand:
    return _core.Operand(t.data_ptr(), _DT.get(t.dtype, str(t.dtype)), tuple(t.shape), tuple(t.stride()))


def _stream_handle(stream, dev: int) -> int:
    return _raw_stream(dev) if stream is None else _args.stream_handle(stream)


# ----------------------------------------------------------------------------------
# Implementations without autograd: CUDA kernel and CPU reference.


def _check_common(x, mask, scale, causal, key_lengths, out, on_gpu: bool):
    scale = _args.check_scale(scale)
    causal = _args.check_causal(causal)
    allowed = _args.X_DTYPES_GPU if on_gpu else _args.X_DTYPES_CPU
    _args.check_x(tuple(x.shape), _dtname(x), allowed, "on the GPU" if on_gpu else "on the CPU path")
    _args.check_causal_shape(causal, tuple(x.shape))
    if mask is not None:
        if not isinstance(mask, Tensor):
            raise arg_type_error("mask", "a torch.Tensor like x (or None)", type(mask).__name__)
        if mask.device != x.device:
            raise arg_value_error("mask", f"on x's device {x.device}", f"device {mask.device}")
        _args.check_mask_dtype(_dtname(mask))
        _args.check_broadcast(tuple(mask.shape), tuple(x.shape))
    if key_lengths is not None:
        if not isinstance(key_lengths, Tensor):
            raise arg_type_error(
                "key_lengths", "a torch.Tensor of integers of shape [B] (or None)", type(key_lengths).__name__
            )
        if key_lengths.device != x.device:
            raise arg_value_error("key_lengths", f"on x's device {x.device}", f"device {key_lengths.device}")
        _args.check_key_lengths(
            tuple(key_lengths.shape),
            _dtname(key_lengths),
            tuple(x.shape),
            _args.INT_DTYPES if not on_gpu else ("int32", "int64"),
        )
    if out is not None:
        if not isinstance(out, Tensor):
            raise arg_type_error("out", "a torch.Tensor like x (or None)", type(out).__name__)
        if out.device != x.device:
            raise arg_value_error("out", f"on x's device {x.device}", f"device {out.device}")
        _args.check_out(tuple(out.shape), _dtname(out), tuple(x.shape), _dtname(x))
        _args.check_out_strides(tuple(out.shape), tuple(out.stride()))
    return scale, causal


def _to_np(t: Tensor):
    t = t.detach().cpu()
    if t.dtype == torch.bfloat16:
        t = t.float()
    return t.numpy()


def _cpu_forward(x, mask, scale, causal, key_lengths, out):
    y = _reference.softmax_forward(
        _to_np(x),
        None if mask is None else _to_np(mask),
        scale,
        causal,
        None if key_lengths is None else _to_np(key_lengths),
    )
    dst = out if out is not None else torch.empty_like(x)  # the same layout as on the GPU
    return dst.copy_(torch.from_numpy(y))


def _meta(t):
    """Layout of an optional tensor argument, as part of a cache key."""
    if t is None:
        return None
    if not isinstance(t, Tensor):
        return (type(t),)  # never cached: the checks reject it
    return (t.dtype, t.shape, t.stride(), t.get_device())


# Prepared launches by everything that decides them except the data pointers.  A key is
# only stored after the full argument checks passed for it.
_prepared: dict = {}
_EMPTY = object()


def _remember(key, prep):
    if len(_prepared) > 4096:
        _prepared.clear()
    _prepared[key] = prep
    return prep


def _prepare_forward(x, mask, scale, causal, key_lengths, out, dev, aligned, maligned):
    scale, causal = _check_common(x, mask, scale, causal, key_lengths, out, True)
    if x.numel() == 0:
        return _EMPTY
    y = out if out is not None else torch.empty_like(x)
    xo, yo = _operand(x), _operand(y)
    mo = None if mask is None else _operand(mask)
    ko = None if key_lengths is None else _operand(key_lengths)
    _core.check_forward(xo, yo, mo, ko, causal)
    return _core.prepare_forward(_driver.device(dev), xo, yo, mo, ko, causal, scale, aligned, maligned)


def _forward_impl(x, mask, scale, causal, key_lengths, out, stream):
    """The forward on x's device, no autograd.  Returns out or a new contiguous tensor."""
    if not x.is_cuda:
        scale, causal = _check_common(x, mask, scale, causal, key_lengths, out, False)
        return _cpu_forward(x, mask, scale, causal, key_lengths, out)
    dev = x.get_device()
    xp = x.data_ptr()
    if out is None:
        aligned = not (xp & 15)  # fresh allocations are 256-byte aligned
        okey = None
    else:  # (a non-tensor out is refused by the checks below, before any launch)
        aligned = not ((xp | (out.data_ptr() if isinstance(out, Tensor) else 0)) & 15)
        okey = _meta(out)
    # The mask's pointer modulo 16 decides whether its rows can be read a chunk at a time.
    mp = mask.data_ptr() if isinstance(mask, Tensor) else 0
    key = (
        x.dtype,
        x.shape,
        x.stride(),
        dev,
        aligned,
        type(scale),
        scale,
        type(causal),
        causal,
        _meta(mask),
        _meta(key_lengths),
        okey,
        mp & 15,
    )
    prep = _prepared.get(key)
    if prep is None:
        maligned = (
            mask is not None
            and isinstance(mask, Tensor)
            and _dtname(mask) in _core.MASK_ITEMSIZE
            and _dtname(x) in _args.X_DTYPES_GPU
            and not mp % _core.mask_alignment(_dtname(mask), _dtname(x))
        )
        prep = _remember(key, _prepare_forward(x, mask, scale, causal, key_lengths, out, dev, aligned, maligned))
    # empty_like keeps x's layout when x is dense (else contiguous): a function of x's
    # shape and strides, so the prepared launch (which knows y's strides) stays valid.
    y = out if out is not None else torch.empty_like(x)
    if prep is _EMPTY:
        return y
    if stream is None:
        s = _raw_stream(dev)
        ctx_ok = s > 2 or _current_device() == dev
    else:
        s = _stream_handle(stream, dev)
        ctx_ok = None
    _core.launch(prep, xp, y.data_ptr(), mp, 0 if key_lengths is None else key_lengths.data_ptr(), s, ctx_ok)
    return y


_current_device = torch._C._cuda_getDevice if hasattr(torch._C, "_cuda_getDevice") else (lambda: -1)


def _check_backward(dy, y, scale, out):
    scale = _args.check_scale(scale)
    if not isinstance(dy, Tensor):
        raise arg_type_error("dy", "a torch.Tensor like y", type(dy).__name__)
    on_gpu = y.is_cuda
    _args.check_x(
        tuple(y.shape),
        _dtname(y),
        _args.X_DTYPES_GPU if on_gpu else _args.X_DTYPES_CPU,
        "on the GPU" if on_gpu else "on the CPU path",
        "y",
    )
    if dy.device != y.device:
        raise arg_value_error("dy", f"on y's device {y.device}", f"device {dy.device}")
    if tuple(dy.shape) != tuple(y.shape) or dy.dtype != y.dtype:
        raise arg_value_error(
            "dy", f"of y's shape {tuple(y.shape)} and dtype {y.dtype}", f"shape {tuple(dy.shape)}, dtype {dy.dtype}"
        )
    if out is not None:
        if not isinstance(out, Tensor):
            raise arg_type_error("out", "a torch.Tensor like y (or None)", type(out).__name__)
        if out.device != y.device:
            raise arg_value_error("out", f"on y's device {y.device}", f"device {out.device}")
        _args.check_out(tuple(out.shape), _dtname(out), tuple(y.shape), _dtname(y), "y")
        _args.check_out_strides(tuple(out.shape), tuple(out.stride()))
    return scale


def _backward_impl(dy, y, scale, out, stream):
    scale = _check_backward(dy, y, scale, out)
    if not y.is_cuda:
        dx = _reference.softmax_backward(_to_np(dy), _to_np(y), scale)
        dst = out if out is not None else torch.empty_like(y)
        return dst.copy_(torch.from_numpy(dx))
    dev = y.get_device()
    dx = out if out is not None else torch.empty_like(y)
    if y.numel() == 0:
        return dx
    if stream is None:
        s = _raw_stream(dev)
        ctx_ok = s > 2 or _current_device() == dev
    else:
        s = _stream_handle(stream, dev)
        ctx_ok = None
    _core.backward(_driver.device(dev), _operand(dy), _operand(y), _operand(dx), scale, s, ctx_ok)
    return dx


def _mask_grad(g: Tensor, mask: Tensor) -> Tensor:
    """dL/dmask: g summed over the dims mask was broadcast along."""
    shape = tuple(mask.shape)
    core = shape[max(0, len(shape) - g.dim()) :]
    acc = torch.promote_types(g.dtype, torch.float32)  # sum 16-bit gradients in fp32
    return g.to(acc).sum_to_size(core).reshape(shape).to(mask.dtype)


def _grads(gy, y, mask, scale, need_x, need_mask, bwd):
    dx = dmask = None
    if need_mask:
        g = bwd(gy, y, 1.0)
        dmask = _mask_grad(g, mask)
        if need_x:
            dx = g * scale
    elif need_x:
        dx = bwd(gy, y, scale)
    return dx, dmask


# ----------------------------------------------------------------------------------
# Eager autograd.


class _SoftmaxFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, mask, scale, causal, key_lengths, stream):
        y = _forward_impl(x, mask, scale, causal, key_lengths, None, stream)
        ctx.scale = float(scale)
        ctx.stream = stream
        ctx.mask_float = mask is not None and mask.is_floating_point()
        ctx.save_for_backward(y, mask if ctx.mask_float else None)
        return y

    @staticmethod
    def backward(ctx, gy):
        y, mask = ctx.saved_tensors
        need_mask = ctx.mask_float and ctx.needs_input_grad[1]
        if torch.is_grad_enabled():  # create_graph=True: a differentiable backward
            bwd = torch.ops.drvsoftmax.scaled_masked_softmax_backward
        else:

            def bwd(a, b, s):
                return _backward_impl(a, b, s, None, ctx.stream)

        dx, dmask = _grads(gy, y, mask, ctx.scale, ctx.needs_input_grad[0], need_mask, bwd)
        return dx, dmask, None, None, None, None


# ----------------------------------------------------------------------------------
# torch.library ops (torch.compile, torch.export, opcheck).


@torch.library.custom_op("drvsoftmax::scaled_masked_softmax", mutates_args=())
def _op_forward(x: Tensor, mask: Tensor | None, scale: float, causal: bool, key_lengths: Tensor | None) -> Tensor:
    return _forward_impl(x, mask, scale, causal, key_lengths, None, None)


@_op_forward.register_fake
def _op_forward_fake(x, mask, scale, causal, key_lengths):
    return torch.empty_like(x)


@torch.library.custom_op("drvsoftmax::scaled_masked_softmax_backward", mutates_args=())
def _op_backward(dy: Tensor, y: Tensor, scale: float) -> Tensor:
    return _backward_impl(dy, y, scale, None, None)


@_op_backward.register_fake
def _op_backward_fake(dy, y, scale):
    return torch.empty_like(y)


def _op_setup(ctx, inputs, output):
    x, mask, scale, causal, key_lengths = inputs
    ctx.scale = float(scale)
    ctx.mask_float = mask is not None and mask.is_floating_point()
    ctx.save_for_backward(output, mask if ctx.mask_float else None)


def _op_grad(ctx, gy):
    y, mask = ctx.saved_tensors
    need_mask = ctx.mask_float and ctx.needs_input_grad[1]
    dx, dmask = _grads(
        gy, y, mask, ctx.scale, ctx.needs_input_grad[0], need_mask, torch.ops.drvsoftmax.scaled_masked_softmax_backward
    )
    return dx, dmask, None, None, None


def _op_backward_setup(ctx, inputs, output):
    dy, y, scale = inputs
    ctx.scale = float(scale)
    ctx.save_for_backward(dy, y)


def _op_backward_grad(ctx, gdx):
    # d/d(dy) and d/d(y) of dx = s*y*(dy - <dy,y>): enough for double backward.
    dy, y = ctx.saved_tensors
    s = ctx.scale
    dot = (dy * y).sum(-1, keepdim=True)
    gy_ = s * gdx * y
    d_dy = gy_ - (gy_.sum(-1, keepdim=True)) * y
    d_y = s * gdx * (dy - dot) - (gy_.sum(-1, keepdim=True)) * dy
    return d_dy, d_y, None


_op_forward.register_autograd(_op_grad, setup_context=_op_setup)
_op_backward.register_autograd(_op_backward_grad, setup_context=_op_backward_setup)


# ----------------------------------------------------------------------------------
# Public functions.

_is_compiling = torch.compiler.is_compiling


def _traced_path(x) -> bool:
    return type(x) not in _PLAIN or _is_compiling()


def _as_lengths(key_lengths, x):
    """key_lengths given as a list, tuple or NumPy array: a tensor on x's device (a small
    host-to-device copy; pass a tensor on x's device to avoid it)."""
    if key_lengths is None or isinstance(key_lengths, Tensor):
        return key_lengths
    if isinstance(key_lengths, (list, tuple, np.ndarray)):
        return torch.as_tensor(np.asarray(key_lengths), device=x.device)
    raise arg_type_error(
        "key_lengths", "a tensor, list or array of integers of shape [B] (or None)", type(key_lengths).__name__
    )


def scaled_masked_softmax(x, mask=None, *, scale=1.0, causal=False, key_lengths=None, out=None, stream=None):
    """See :func:`drvsoftmax.scaled_masked_softmax`."""
    key_lengths = _as_lengths(key_lengths, x)
    if type(x) not in _PLAIN or _is_compiling():
        scale, causal = _args.check_scale(scale), _args.check_causal(causal)
        y = torch.ops.drvsoftmax.scaled_masked_softmax(x, mask, scale, causal, key_lengths)
        if out is not None:
            out.copy_(y)
            return out
        return y
    if torch.is_grad_enabled() and (x.requires_grad or (isinstance(mask, Tensor) and mask.requires_grad)):
        if out is not None:
            raise arg_value_error(
                "out", "None when x or mask requires grad (out= cannot be differentiated)", "a tensor"
            )
        return _SoftmaxFn.apply(x, mask, scale, causal, key_lengths, stream)
    return _forward_impl(x, mask, scale, causal, key_lengths, out, stream)


def scaled_masked_softmax_backward(dy, y, *, scale=1.0, out=None, stream=None):
    """See :func:`drvsoftmax.scaled_masked_softmax_backward`."""
    if _traced_path(y):
        dx = torch.ops.drvsoftmax.scaled_masked_softmax_backward(dy, y, float(scale))
        if out is not None:
            out.copy_(dx)
            return out
        return dx
    return _backward_impl(dy, y, scale, out, stream)


class ScaledMaskedSoftmax(torch.nn.Module):
    """Drop-in attention softmax: ``forward(scores, mask=None, key_lengths=None)``.

    ``scale`` and ``causal`` are fixed at construction, as in Megatron's
    ``FusedScaleMaskSoftmax``; mask semantics are drvsoftmax's (nonzero bool hides,
    float adds).
    """

    def __init__(self, scale: float = 1.0, causal: bool = False):
        super().__init__()
        self.scale = _args.check_scale(scale)
        self.causal = _args.check_causal(causal)

    def forward(self, scores: Tensor, mask: Tensor | None = None, key_lengths: Tensor | None = None) -> Tensor:
        return scaled_masked_softmax(scores, mask, scale=self.scale, causal=self.causal, key_lengths=key_lengths)

    def extra_repr(self) -> str:
        return f"scale={self.scale}, causal={self.causal}"
