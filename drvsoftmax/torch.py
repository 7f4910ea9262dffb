"""PyTorch front door: eager fast path, autograd, torch.library ops, nn.Module.

* Eager calls on CUDA tensors go straight to the launcher (no custom-op dispatch).
* Under torch.compile / torch.export (and for tensor subclasses such as FakeTensor),
  calls go through ``torch.ops.drvsoftmax.scaled_masked_softmax`` and
  ``..._backward``, registered with ``torch.library.custom_op``, ``register_fake`` and
  ``register_autograd``, so graphs hold one opaque node and never break.  That path runs
  the same argument checks as the eager one: the checks on metadata (types, dtypes,
  shapes, devices, strides) while tracing, the ones on memory (``out`` overlapping an
  input, an inference-tensor ``out``) inside the op, where the real tensors are.
* CPU tensors take the float64 NumPy reference path, with the same autograd behaviour.
* Autocast: the op is not an autocast op.  Inputs keep their dtype (no upcast copies);
  the output has x's dtype.  Under ``torch.autocast`` scores produced by a matmul are
  already in the autocast dtype, and that is what the softmax runs in.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from torch import Tensor

from . import _args, _core, _driver, _dtypes, _reference
from ._core import _pack5, _targs
from ._errors import DrvSoftmaxError, arg_type_error, arg_value_error

_DT = {getattr(torch, n): n for n in _dtypes.TABLE if hasattr(torch, n)}  # torch.dtype -> name

_PLAIN = (torch.Tensor, torch.nn.Parameter)
_DEVICE_TYPES = ("cpu", "cuda")
# key_lengths dtypes the kernels read directly; others are converted to int64 first.
_KL_DIRECT = (torch.int32, torch.int64)
# Unsigned key_lengths: the signed dtype of the same width, and 2**width (None: 64 bits,
# where every value that reads as negative is above any Sk and becomes INT64_MAX).
_KL_UNSIGNED = {
    getattr(torch, u): (getattr(torch, s), w)
    for u, s, w in (("uint16", "int16", 2**16), ("uint32", "int32", 2**32), ("uint64", "int64", None))
    if hasattr(torch, u)
}


def _no_cuda_stream(dev: int) -> int:
    raise DrvSoftmaxError("this PyTorch build has no CUDA support: no current CUDA stream")


_raw_stream: Callable[[int], int] = getattr(torch._C, "_cuda_getCurrentRawStream", None) or _no_cuda_stream
_current_device: Callable[[], int] = getattr(torch._C, "_cuda_getDevice", None) or (lambda: -1)
_external_stream: Callable[..., Any] = torch.cuda.ExternalStream


def _dtname(t: Tensor) -> str:
    return _DT.get(t.dtype) or str(t.dtype).replace("torch.", "")


def _operand(t: Tensor) -> _core.Operand:
    return _core.Operand(t.data_ptr(), _DT.get(t.dtype, str(t.dtype)), tuple(t.shape), tuple(t.stride()))


def _region(name: str, t: Tensor | None) -> _args.Region | None:
    if t is None:
        return None
    return _args.region(name, t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.element_size())


@contextlib.contextmanager
def _on_stream(stream: object, t: Tensor) -> Iterator[None]:
    """Run torch ops of the enclosed block on `stream` (a given stream, not None) so that
    what they produce is ordered before our launch on that stream."""
    if stream is None or not t.is_cuda:
        yield
        return
    ext = _external_stream(_args.stream_handle(stream), device=t.device)
    with torch.cuda.stream(ext):
        yield


# ----------------------------------------------------------------------------------
# Argument checks (shared by the eager and the traced paths).


def _check_tensor(name: str, t: Tensor) -> None:
    """A dense (strided, not nested) tensor on a CPU or CUDA device."""
    if t.is_nested:
        raise arg_type_error(name, "a dense (strided) tensor", f"a nested tensor (layout {t.layout})")
    if t.layout != torch.strided:
        raise arg_type_error(name, "a dense (strided) tensor", f"layout {t.layout}")
    if t.device.type not in _DEVICE_TYPES:
        raise arg_value_error(name, "a tensor on a CPU or CUDA device", f"device {t.device}")


def _check_out_state(out: Tensor, traced: bool = False) -> None:
    """What decides whether `out` may be written, beyond its layout (checked per call).
    While tracing, the inference-tensor test is left to the op (it runs on real tensors)."""
    if out.requires_grad and torch.is_grad_enabled():
        raise arg_value_error(
            "out",
            "a tensor that does not require grad (writes into out= are not recorded by autograd)",
            "one that does",
        )
    if not traced and out.is_inference() and not torch.is_inference_mode_enabled():
        raise arg_value_error(
            "out",
            "a normal tensor outside torch.inference_mode (inference tensors are read-only there)",
            "an inference tensor",
        )


def _check_common(
    x: Tensor, mask: Any, scale: Any, causal: Any, key_lengths: Any, out: Any, on_gpu: bool
) -> tuple[float, bool]:
    scale = _args.check_scale(scale)
    causal = _args.check_causal(causal)
    _check_tensor("x", x)
    allowed = _args.X_DTYPES_GPU if on_gpu else _args.X_DTYPES_CPU
    _args.check_x(tuple(x.shape), _dtname(x), allowed, "on the GPU" if on_gpu else "on the CPU path")
    _args.check_causal_shape(causal, tuple(x.shape))
    if mask is not None:
        if not isinstance(mask, Tensor):
            raise arg_type_error("mask", "a torch.Tensor like x (or None)", type(mask).__name__)
        _check_tensor("mask", mask)
        if mask.device != x.device:
            raise arg_value_error("mask", f"on x's device {x.device}", f"device {mask.device}")
        _args.check_mask_dtype(_dtname(mask))
        _args.check_broadcast(tuple(mask.shape), tuple(x.shape))
    if key_lengths is not None:
        if not isinstance(key_lengths, Tensor):
            raise arg_type_error(
                "key_lengths", "a torch.Tensor of integers of shape [B] (or None)", type(key_lengths).__name__
            )
        _check_tensor("key_lengths", key_lengths)
        if key_lengths.device != x.device:
            raise arg_value_error("key_lengths", f"on x's device {x.device}", f"device {key_lengths.device}")
        _args.check_key_lengths(tuple(key_lengths.shape), _dtname(key_lengths), tuple(x.shape))
    if out is not None:
        if not isinstance(out, Tensor):
            raise arg_type_error("out", "a torch.Tensor like x (or None)", type(out).__name__)
        _check_tensor("out", out)
        if out.device != x.device:
            raise arg_value_error("out", f"on x's device {x.device}", f"device {out.device}")
        _args.check_out(tuple(out.shape), _dtname(out), tuple(x.shape), _dtname(x))
        _args.check_out_strides(tuple(out.shape), tuple(out.stride()))
    return scale, causal


def _check_forward_overlap(x: Tensor, mask: Tensor | None, key_lengths: Tensor | None, out: Tensor) -> None:
    _args.check_no_overlap(
        _region("out", out),
        (_region("x", x), _region("mask", mask), _region("key_lengths", key_lengths)),
        in_place=("x",),
    )


def _check_backward(dy: Any, y: Tensor, scale: Any, out: Any) -> float:
    s = _args.check_scale(scale)
    _check_tensor("y", y)
    if not isinstance(dy, Tensor):
        raise arg_type_error("dy", "a torch.Tensor like y", type(dy).__name__)
    _check_tensor("dy", dy)
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
        _check_tensor("out", out)
        if out.device != y.device:
            raise arg_value_error("out", f"on y's device {y.device}", f"device {out.device}")
        _args.check_out(tuple(out.shape), _dtname(out), tuple(y.shape), _dtname(y), "y")
        _args.check_out_strides(tuple(out.shape), tuple(out.stride()))
    return s


def _check_backward_overlap(dy: Tensor, y: Tensor, out: Tensor) -> None:
    _args.check_no_overlap(_region("out", out), (_region("dy", dy), _region("y", y)), in_place=("dy", "y"))


# ----------------------------------------------------------------------------------
# Implementations without autograd: CUDA kernel and CPU reference.


def _to_np(t: Tensor) -> np.ndarray:
    t = t.detach().cpu()
    if t.dtype == torch.bfloat16:
        t = t.float()
    return t.numpy()


def _cpu_forward(x: Tensor, mask: Any, scale: Any, causal: Any, key_lengths: Any, out: Any, stream: object) -> Tensor:
    scale, causal = _check_common(x, mask, scale, causal, key_lengths, out, False)
    _args.check_stream(stream)
    if out is not None:
        _check_out_state(out)
        _check_forward_overlap(x, mask, key_lengths, out)
    y = _reference.softmax_forward(
        _to_np(x),
        None if mask is None else _to_np(mask),
        scale,
        causal,
        None if key_lengths is None else _to_np(key_lengths),
    )
    dst = out if out is not None else torch.empty_like(x)  # the same layout as on the GPU
    return dst.copy_(torch.from_numpy(y))


def _meta(t: object) -> tuple[Any, ...] | None:
    """Layout of an optional tensor argument, as part of a cache key."""
    if t is None:
        return None
    if not isinstance(t, Tensor):
        return (type(t),)  # never cached: the checks reject it
    return (t.dtype, t.shape, t.stride(), t.get_device())


def _lengths_int64(kl: Tensor) -> Tensor:
    """key_lengths of a dtype the kernels do not read, as contiguous int64 with the same
    meaning (values beyond int64, which only uint64 holds, exceed any Sk: INT64_MAX)."""
    spec = _KL_UNSIGNED.get(kl.dtype)
    if spec is None:  # int8, uint8, int16: every value fits
        return kl.to(torch.int64).contiguous()
    signed, wrap = spec
    v = kl.view(signed).to(torch.int64)
    fix = torch.full_like(v, 2**63 - 1) if wrap is None else v + wrap
    return torch.where(v < 0, fix, v).contiguous()


class _Template:
    """Where an operand of a cached layout lies relative to its pointer (for the overlap
    check of later calls with the same layout: only pointers change)."""

    __slots__ = ("name", "lo", "hi", "form")

    def __init__(self, region: _args.Region) -> None:
        ptr = region.layout[0]
        self.name, self.lo, self.hi, self.form = region.name, region.lo - ptr, region.hi - ptr, region.layout[1:]

    def at(self, ptr: int) -> _args.Region:
        return _args.Region(self.name, ptr + self.lo, ptr + self.hi, (ptr, *self.form))


def _template(name: str, t: Tensor | None) -> _Template | None:
    r = _region(name, t)
    return None if r is None else _Template(r)


class _OutSpans:
    """The overlap check of out= calls of one cached layout, from pointers alone.

    The interval test here only screens: whenever it sees an overlap, the decision (and
    the error) is _args.check_no_overlap's, on the same regions, as for every other door.
    """

    __slots__ = ("tx", "ty", "tm", "tk", "same_xy")

    def __init__(self, x: Tensor, out: Tensor, mask: Tensor | None, key_lengths: Tensor | None) -> None:
        self.tx, self.ty = _template("x", x), _template("out", out)
        self.tm, self.tk = _template("mask", mask), _template("key_lengths", key_lengths)
        self.same_xy = self.tx is not None and self.ty is not None and self.tx.form == self.ty.form

    def check(self, o: int, xp: int, mp: int, key_lengths: Tensor | None) -> None:
        ty = self.ty
        if ty is None:
            return
        olo, ohi = o + ty.lo, o + ty.hi
        tx, tm, tk = self.tx, self.tm, self.tk
        hit = tx is not None and xp + tx.lo < ohi and olo < xp + tx.hi and not (self.same_xy and o == xp)
        hit = hit or (tm is not None and mp + tm.lo < ohi and olo < mp + tm.hi)
        kp = 0
        if tk is not None and key_lengths is not None:
            kp = key_lengths.data_ptr()
            hit = hit or (kp + tk.lo < ohi and olo < kp + tk.hi)
        if hit:
            _args.check_no_overlap(
                ty.at(o),
                (
                    None if tx is None else tx.at(xp),
                    None if tm is None else tm.at(mp),
                    None if tk is None else tk.at(kp),
                ),
                in_place=("x",),
            )


# Prepared launches by everything that decides them except the data pointers.  A key is
# only stored after the full argument checks passed for it.  An entry holds the launch
# (or _EMPTY) and, for out= calls, the overlap check of that layout.
_prepared: dict[tuple[Any, ...], tuple[Any, _OutSpans | None]] = {}
_EMPTY = object()
# The eager fast path's launches (_eager): calls with x alone (no mask, key_lengths, out or
# stream), a float scale and a bool causal, keyed by x's layout (_fast_key), device,
# x.data_ptr() % 16, scale and causal.  An entry (_core.fast_entry) is only made by a call
# that passed every check on the full path (_forward_impl) with that key.
_fast: dict[tuple[Any, ...], tuple[Any, ...]] = {}


def _fast_key(x: Tensor, dev: int, xp: int, scale: float, causal: bool) -> tuple[Any, ...]:
    """The _fast key of x.  A contiguous x is keyed without its strides: torch calls x
    contiguous whatever the strides of its size-1 dims, which never move an element, so
    every contiguous x of one shape addresses its elements (and torch.empty_like(x) its
    output's) alike.  (_eager builds the same key inline.)"""
    if x.is_contiguous():
        return (x.shape, x.dtype, dev, xp & 15, scale, causal)
    return (x.shape, x.stride(), x.dtype, dev, xp & 15, scale, causal)


def _forget_launches() -> None:
    """After fork: the child holds no CUDA context, so nothing prepared may be reused; its
    next call prepares again and meets _driver's fork check (a clear error)."""
    _prepared.clear()
    _fast.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_launches)


def _remember(key: tuple[Any, ...], entry: tuple[Any, _OutSpans | None]) -> tuple[Any, _OutSpans | None]:
    if len(_prepared) > 4096:
        _prepared.clear()
        _fast.clear()
    _prepared[key] = entry
    return entry


def _prepare_forward(
    x: Tensor,
    mask: Any,
    scale: Any,
    causal: Any,
    key_lengths: Any,
    out: Any,
    dev: int,
    aligned: bool,
    mask_aligned: bool,
) -> tuple[Any, _OutSpans | None]:
    scale, causal = _check_common(x, mask, scale, causal, key_lengths, out, True)
    spans = None if out is None else _OutSpans(x, out, mask, key_lengths)
    if x.numel() == 0:
        return _EMPTY, spans
    device = _driver.device(dev)  # first: in a forked child, this is the error to see
    y = out if out is not None else torch.empty_like(x)
    xo, yo = _operand(x), _operand(y)
    mo = None if mask is None else _operand(mask)
    ko = None
    if key_lengths is not None:  # converted to contiguous int64 per call when not int32/int64
        ko = _operand(key_lengths)
        if key_lengths.dtype not in _KL_DIRECT:
            ko = _core.Operand(0, "int64", ko.shape, (1,))
    _core.check_forward(xo, yo, mo, ko, causal)
    return _core.prepare_forward(device, xo, yo, mo, ko, causal, scale, aligned, mask_aligned), spans


def _forward_impl(x: Tensor, mask: Any, scale: Any, causal: Any, key_lengths: Any, out: Any, stream: object) -> Tensor:
    """The forward on x's device, no autograd.  Returns out or a new tensor."""
    if not x.is_cuda:
        return _cpu_forward(x, mask, scale, causal, key_lengths, out, stream)
    try:
        dev = x.get_device()
        xp = x.data_ptr()
        if out is None:
            aligned = not (xp & 15)  # fresh allocations are 256-byte aligned
            okey = None
        else:  # (a non-tensor out is refused by the checks below, before any launch)
            aligned = not ((xp | (out.data_ptr() if isinstance(out, Tensor) else 0)) & 15)
            okey = _meta(out)
        mp = mask.data_ptr() if isinstance(mask, Tensor) else 0
        key = (
            x.dtype,
            x.shape,
            x.stride(),
            dev,
            aligned,
            not (mp & 15),
            type(scale),
            scale,
            type(causal),
            causal,
            _meta(mask),
            _meta(key_lengths),
            okey,
        )
    except (RuntimeError, NotImplementedError):  # tensors without strides or storage (sparse, nested)
        _check_common(x, mask, scale, causal, key_lengths, out, True)
        raise
    entry = _prepared.get(key)
    if entry is None:
        entry = _remember(key, _prepare_forward(x, mask, scale, causal, key_lengths, out, dev, aligned, not (mp & 15)))
    prep, spans = entry
    # empty_like keeps x's layout when x is dense (else contiguous): a function of x's
    # shape and strides, so the prepared launch (which knows y's strides) stays valid.
    if out is not None:
        _check_out_state(out)
        if spans is not None:
            spans.check(out.data_ptr(), xp, mp, key_lengths)
        y: Tensor = out
    else:
        y = torch.empty_like(x)
    if prep is _EMPTY:
        if stream is not None:
            _args.stream_handle(stream)
        return y
    fast = mask is None and key_lengths is None and out is None and stream is None and type(scale) is float
    if fast and (causal is False or causal is True):
        _fast[_fast_key(x, dev, xp, scale, causal)] = _core.fast_entry(prep)
    if stream is None:
        s = _raw_stream(dev)
        ctx_ok: bool | None = s > 2 or _current_device() == dev
    else:
        s = _args.stream_handle(stream)
        ctx_ok = None
    kp = 0
    if key_lengths is not None:
        if key_lengths.dtype not in _KL_DIRECT:
            with _on_stream(stream, x):
                key_lengths = _lengths_int64(key_lengths)
        kp = key_lengths.data_ptr()
    _core.launch(prep, xp, y.data_ptr(), mp, kp, s, ctx_ok)
    return y


def _backward_impl(dy: Any, y: Tensor, scale: Any, out: Any, stream: object) -> Tensor:
    scale = _check_backward(dy, y, scale, out)
    if out is not None:
        _check_out_state(out)
        _check_backward_overlap(dy, y, out)
    if not y.is_cuda:
        _args.check_stream(stream)
        dx = _reference.softmax_backward(_to_np(dy), _to_np(y), scale)
        dst = out if out is not None else torch.empty_like(y)
        return dst.copy_(torch.from_numpy(dx))
    dev = y.get_device()
    device = _driver.device(dev)  # first: in a forked child, this is the error to see
    if stream is None:
        s = _raw_stream(dev)
        ctx_ok: bool | None = s > 2 or _current_device() == dev
    else:
        s = _args.stream_handle(stream)
        ctx_ok = None
    res = out if out is not None else torch.empty_like(y)
    if y.numel() == 0:
        return res
    _core.backward(device, _operand(dy), _operand(y), _operand(res), scale, s, ctx_ok)
    return res


def _mask_grad(g: Tensor, mask: Tensor) -> Tensor:
    """dL/dmask: g summed over the dims mask was broadcast along."""
    shape = tuple(mask.shape)
    core = shape[max(0, len(shape) - g.dim()) :]
    acc = torch.promote_types(g.dtype, torch.float32)  # sum 16-bit gradients in fp32
    return g.to(acc).sum_to_size(core).reshape(shape).to(mask.dtype)


def _grads(
    gy: Tensor,
    y: Tensor,
    mask: Tensor | None,
    scale: float,
    need_x: bool,
    need_mask: bool,
    bwd: Callable[[Tensor, Tensor, float], Tensor],
) -> tuple[Tensor | None, Tensor | None]:
    dx = dmask = None
    if need_mask:
        assert mask is not None  # need_mask implies a float mask was saved
        g = bwd(gy, y, 1.0)
        dmask = _mask_grad(g, mask)
        if need_x:
            dx = g * scale
    elif need_x:
        dx = bwd(gy, y, scale)
    return dx, dmask


def _backward_grads(dy: Tensor, y: Tensor, s: float, gdx: Tensor) -> tuple[Tensor, Tensor]:
    """d/d(dy) and d/d(y) of dx = s*y*(dy - <dy,y>), masked where y == 0 (the op's zeros)."""
    dot = (dy * y).sum(-1, keepdim=True)
    gy_ = s * gdx * y
    d_dy = gy_ - (gy_.sum(-1, keepdim=True)) * y
    d_y = s * gdx * (dy - dot) - (gy_.sum(-1, keepdim=True)) * dy
    return d_dy, d_y


# ----------------------------------------------------------------------------------
# Eager autograd.


class _SoftmaxFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, mask: Any, scale: Any, causal: Any, key_lengths: Any, stream: object) -> Tensor:
        y = _forward_impl(x, mask, scale, causal, key_lengths, None, stream)
        ctx.scale = float(scale)
        ctx.stream = stream
        ctx.mask_float = mask is not None and mask.is_floating_point()
        ctx.save_for_backward(y, mask if ctx.mask_float else None)
        return y

    @staticmethod
    def backward(ctx: Any, gy: Tensor) -> tuple[Tensor | None, ...]:
        y, mask = ctx.saved_tensors
        need_mask = ctx.mask_float and ctx.needs_input_grad[1]
        if torch.is_grad_enabled():  # create_graph=True: a differentiable backward

            def bwd(a: Tensor, b: Tensor, s: float) -> Tensor:
                return _backward_fn(a, b, s, ctx.stream)
        else:

            def bwd(a: Tensor, b: Tensor, s: float) -> Tensor:
                return _backward_impl(a, b, s, None, ctx.stream)

        dx, dmask = _grads(gy, y, mask, ctx.scale, ctx.needs_input_grad[0], need_mask, bwd)
        return dx, dmask, None, None, None, None


class _BackwardFn(torch.autograd.Function):
    """The eager backward op on tensors that require grad: differentiable (double backward),
    like the compiled path's ``torch.ops.drvsoftmax.scaled_masked_softmax_backward``."""

    @staticmethod
    def forward(ctx: Any, dy: Tensor, y: Tensor, scale: Any, stream: object) -> Tensor:
        dx = _backward_impl(dy, y, scale, None, stream)
        ctx.scale = float(scale)
        ctx.save_for_backward(dy, y)
        return dx

    @staticmethod
    def backward(ctx: Any, gdx: Tensor) -> tuple[Tensor | None, ...]:
        dy, y = ctx.saved_tensors
        d_dy, d_y = _backward_grads(dy, y, ctx.scale, gdx)
        return d_dy, d_y, None, None


# ----------------------------------------------------------------------------------
# torch.library ops (torch.compile, torch.export, opcheck).


@torch.library.custom_op("drvsoftmax::scaled_masked_softmax", mutates_args=())
def _op_forward(
    x: Tensor, mask: Tensor | None, scale: float, causal: bool, key_lengths: Tensor | None, out: Tensor | None = None
) -> Tensor:
    """Returns a new tensor; `out` (optional) is only checked, for the traced path that
    copies the result into it: it may not overlap the inputs (other than being x)."""
    if out is not None:
        _check_out_state(out)
        _check_forward_overlap(x, mask, key_lengths, out)
    return _forward_impl(x, mask, scale, causal, key_lengths, None, None)


@_op_forward.register_fake
def _op_forward_fake(
    x: Tensor, mask: Tensor | None, scale: float, causal: bool, key_lengths: Tensor | None, out: Tensor | None = None
) -> Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("drvsoftmax::scaled_masked_softmax_backward", mutates_args=())
def _op_backward(dy: Tensor, y: Tensor, scale: float, out: Tensor | None = None) -> Tensor:
    """Returns a new tensor; `out` (optional) is only checked, as in the forward op."""
    if out is not None:
        _check_out_state(out)
        _check_backward_overlap(dy, y, out)
    return _backward_impl(dy, y, scale, None, None)


@_op_backward.register_fake
def _op_backward_fake(dy: Tensor, y: Tensor, scale: float, out: Tensor | None = None) -> Tensor:
    return torch.empty_like(y)


def _op_setup(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
    mask, scale = inputs[1], inputs[2]
    ctx.scale = float(scale)
    ctx.mask_float = mask is not None and mask.is_floating_point()
    ctx.save_for_backward(output, mask if ctx.mask_float else None)


def _op_grad(ctx: Any, gy: Tensor) -> tuple[Tensor | None, ...]:
    y, mask = ctx.saved_tensors
    need_mask = ctx.mask_float and ctx.needs_input_grad[1]
    dx, dmask = _grads(
        gy, y, mask, ctx.scale, ctx.needs_input_grad[0], need_mask, torch.ops.drvsoftmax.scaled_masked_softmax_backward
    )
    return dx, dmask, None, None, None, None


def _op_backward_setup(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
    dy, y, scale = inputs[0], inputs[1], inputs[2]
    ctx.scale = float(scale)
    ctx.save_for_backward(dy, y)


def _op_backward_grad(ctx: Any, gdx: Tensor) -> tuple[Tensor | None, ...]:
    dy, y = ctx.saved_tensors
    d_dy, d_y = _backward_grads(dy, y, ctx.scale, gdx)
    return d_dy, d_y, None, None


# The autograd.Function entry points, typed (torch declares `apply` without types).
_softmax_fn: Callable[..., Tensor] = _SoftmaxFn.apply
_backward_fn: Callable[..., Tensor] = _BackwardFn.apply

_op_forward.register_autograd(_op_grad, setup_context=_op_setup)
_op_backward.register_autograd(_op_backward_grad, setup_context=_op_backward_setup)


# ----------------------------------------------------------------------------------
# Public functions.

_is_compiling = torch.compiler.is_compiling
_grad_enabled = torch.is_grad_enabled


def _traced_path(x: Tensor) -> bool:
    return type(x) not in _PLAIN or _is_compiling()


def _as_lengths(key_lengths: Any, x: Tensor, stream: object) -> Any:
    """key_lengths given as a list, tuple or NumPy array: a tensor on x's device (a small
    host-to-device copy, on the launch stream; pass a tensor on x's device to avoid it)."""
    if key_lengths is None or isinstance(key_lengths, Tensor):
        return key_lengths
    if isinstance(key_lengths, np.ndarray):
        _args.check_key_lengths(key_lengths.shape, key_lengths.dtype.name, tuple(x.shape))
        a = key_lengths
    elif isinstance(key_lengths, (list, tuple)):
        a = _args.lengths_array(key_lengths)
    else:
        raise arg_type_error(
            "key_lengths", "a tensor, list or array of integers of shape [B] (or None)", type(key_lengths).__name__
        )
    with _on_stream(None if _is_compiling() else stream, x):
        return torch.as_tensor(a, device=x.device)


def _check_traced_stream(stream: object, x: Tensor) -> None:
    """stream= on the traced path: the eager path's checks; then, for CUDA tensors under
    torch.compile, where the op runs on the current stream, a stream is refused."""
    if stream is None:
        return
    compiled_cuda = x.is_cuda and _is_compiling()
    if not compiled_cuda or isinstance(stream, (bool, int, float, str, bytes)):  # (values dynamo traces)
        _args.stream_handle(stream)
    if compiled_cuda:
        raise arg_value_error(
            "stream",
            "None under torch.compile/torch.export (the traced op runs on the current stream: "
            "call the compiled function inside torch.cuda.stream(...))",
            f"{type(stream).__name__}",
        )


def _refuse_out_with_grad(out: Any, grad: bool, what: str) -> None:
    if out is not None and grad:
        raise arg_value_error("out", f"None when {what} requires grad (out= cannot be differentiated)", "a tensor")


# Measured on the H200 host (benchmarks/host_torch.py and host_launch.py, rows taking turns,
# commit db65073): 7.93 us per call through drvsoftmax.scaled_masked_softmax, of which the
# cuda.bindings cuLaunchKernel is 3.84 and torch.empty_like 1.84 (torch.softmax 6.25).
# Hence the launch by cuLaunchKernelEx with a CUlaunchConfig per prepared launch and stream
# (4.90 against 5.19 us for cuLaunchKernel in that run; a config shared across threads may
# not have its stream set per call, so each stream has its own).  With it, on another host
# (commit 29e4cc8): 8.59 us, torch.softmax 6.50.  On an H100 host (host_launch.py, tree of
# 6186790): cuLaunchKernelEx with the config 5.53 us, the driver's cuLaunchKernelEx entry
# point (cuGetProcAddress) called through ctypes 5.81, cuLaunchKernel 5.89: cuda.bindings'
# call is kept.  This function inlined into scaled_masked_softmax (a Python call less)
# saved 0.07-0.12 of 14.0-14.5 us per call on that (slow) host: not kept.
def _eager(x: Any, scale: Any, causal: Any) -> Tensor | None:
    """The eager fast path of a forward of x alone (no mask, key_lengths, out or stream):
    y, launched on the current stream, where x is a plain tensor that needs no autograd
    and its layout, scale and causal were prepared before; else None (the full path then
    checks and prepares)."""
    if not (
        type(x) is Tensor
        and type(scale) is float
        and (causal is False or causal is True)
        and not (x.requires_grad and _grad_enabled())
        and not _is_compiling()
    ):
        return None
    try:
        xp = x.data_ptr()
        dev = x.get_device()
        ent = _fast.get(
            (x.shape, x.dtype, dev, xp & 15, scale, causal)
            if x.is_contiguous()
            else (x.shape, x.stride(), x.dtype, dev, xp & 15, scale, causal)
        )
    except (RuntimeError, NotImplementedError):  # tensors without strides or storage: the full path says why
        return None
    if ent is None:
        return None
    func, configs, params, prep = ent
    y = torch.empty_like(x)
    s = _raw_stream(dev)
    ctx_ok = s > 2 or _current_device() == dev
    if func is not None and ctx_ok:
        # A plain launch in a context that is current (see _core.launch): made here.
        cfg = configs.get(s)
        if cfg is None:
            if len(configs) >= 16:
                configs.clear()
            cfg = configs[s] = _core.plain_config(prep, s)
        buf, argv = _targs.a5
        _pack5(buf, 32, params, xp, y.data_ptr(), 0, 0)
        err = _core._drv.cuLaunchKernelEx(cfg, func, argv, 0)[0]
        if err:
            _core._relaunch(prep, argv, s, err, "cuLaunchKernelEx")
        return y
    _core.launch(prep, xp, y.data_ptr(), 0, 0, s, ctx_ok)
    return y


def scaled_masked_softmax(
    x: Tensor,
    mask: Tensor | None = None,
    *,
    scale: float = 1.0,
    causal: bool = False,
    key_lengths: Any = None,
    out: Tensor | None = None,
    stream: object = None,
) -> Tensor:
    """See :func:`drvsoftmax.scaled_masked_softmax`."""
    if mask is None and key_lengths is None and out is None and stream is None:
        y = _eager(x, scale, causal)
        if y is not None:
            return y
    if not isinstance(x, Tensor):
        raise arg_type_error("x", "a torch.Tensor", type(x).__name__)
    key_lengths = _as_lengths(key_lengths, x, stream)
    needs_grad = torch.is_grad_enabled() and (x.requires_grad or (isinstance(mask, Tensor) and mask.requires_grad))
    if type(x) not in _PLAIN or _is_compiling():
        scale, causal = _check_common(x, mask, scale, causal, key_lengths, out, x.is_cuda)
        _check_traced_stream(stream, x)
        _refuse_out_with_grad(out, needs_grad, "x or mask")
        if out is not None:
            _check_out_state(out, _is_compiling())
        with _on_stream(None if _is_compiling() else stream, x):
            y = torch.ops.drvsoftmax.scaled_masked_softmax(x, mask, scale, causal, key_lengths, out)
        if out is not None:
            out.copy_(y)
            return out
        return y  # type: ignore[no-any-return]
    if needs_grad:
        _refuse_out_with_grad(out, True, "x or mask")
        return _softmax_fn(x, mask, scale, causal, key_lengths, stream)
    return _forward_impl(x, mask, scale, causal, key_lengths, out, stream)


def scaled_masked_softmax_backward(
    dy: Tensor, y: Tensor, *, scale: float = 1.0, out: Tensor | None = None, stream: object = None
) -> Tensor:
    """See :func:`drvsoftmax.scaled_masked_softmax_backward`.  On tensors that require grad
    (with grad mode on) the result is differentiable, as on the compiled path."""
    if not isinstance(y, Tensor):
        raise arg_type_error("y", "a torch.Tensor", type(y).__name__)
    needs_grad = torch.is_grad_enabled() and (y.requires_grad or (isinstance(dy, Tensor) and dy.requires_grad))
    if _traced_path(y):
        s = _check_backward(dy, y, scale, out)
        _check_traced_stream(stream, y)
        _refuse_out_with_grad(out, needs_grad, "dy or y")
        if out is not None:
            _check_out_state(out, _is_compiling())
        with _on_stream(None if _is_compiling() else stream, y):
            dx = torch.ops.drvsoftmax.scaled_masked_softmax_backward(dy, y, s, out)
        if out is not None:
            out.copy_(dx)
            return out
        return dx  # type: ignore[no-any-return]
    if needs_grad:
        _refuse_out_with_grad(out, True, "dy or y")
        return _backward_fn(dy, y, scale, stream)
    return _backward_impl(dy, y, scale, out, stream)


class ScaledMaskedSoftmax(torch.nn.Module):
    """Drop-in attention softmax: ``forward(scores, mask=None, key_lengths=None)``.

    ``scale`` and ``causal`` are fixed at construction, as in Megatron's
    ``FusedScaleMaskSoftmax``; mask semantics are drvsoftmax's (nonzero bool hides,
    float adds).  Argument errors of ``forward`` name ``scores`` where the function
    would name ``x``.
    """

    def __init__(self, scale: float = 1.0, causal: bool = False) -> None:
        super().__init__()
        self.scale = _args.check_scale(scale)
        self.causal = _args.check_causal(causal)

    def forward(self, scores: Tensor, mask: Tensor | None = None, key_lengths: Any = None) -> Tensor:
        if not isinstance(scores, Tensor):
            raise arg_type_error("scores", "a torch.Tensor", type(scores).__name__)
        try:
            return scaled_masked_softmax(scores, mask, scale=self.scale, causal=self.causal, key_lengths=key_lengths)
        except DrvSoftmaxError as e:
            msg = str(e)
            if msg.startswith("x "):
                raise type(e)("scores" + msg[1:]) from None
            raise

    def extra_repr(self) -> str:
        return f"scale={self.scale}, causal={self.causal}"
