"""The reference semantics, in NumPy and float64.

This is the CPU path of the public functions and the oracle the GPU tests compare
against.  It spells the contract out literally; speed is no concern here.
"""

from __future__ import annotations

from typing import Any

import numpy as np


def _f64(a: Any) -> np.ndarray:
    arr = np.asarray(a)
    if arr.dtype.kind in "fiub":
        return arr.astype(np.float64)
    return arr.astype(np.float32).astype(np.float64)  # bfloat16 (ml_dtypes) and friends


def is_float_dtype(dt: np.dtype) -> bool:
    return dt.kind == "f" or dt.name == "bfloat16"


def _fit(a: Any, ndim: int) -> np.ndarray:
    """Drop leading size-1 dims beyond `ndim` (legal under broadcasting to x's shape)."""
    arr = np.asarray(a)
    return arr.reshape(arr.shape[arr.ndim - ndim :]) if arr.ndim > ndim else arr


def hidden_positions(
    shape: tuple[int, ...], mask: Any = None, causal: bool = False, key_lengths: Any = None
) -> np.ndarray:
    """Boolean array broadcastable to `shape`: True where a key is hidden by a
    boolean/integer mask, by causality or by key_lengths."""
    sk = shape[-1]
    hidden = np.zeros((1,) * len(shape), dtype=bool)
    if mask is not None and not is_float_dtype(np.asarray(mask).dtype):
        hidden = hidden | (_fit(mask, len(shape)) != 0)
    j = np.arange(sk)
    if causal:
        sq = shape[-2]
        i = np.arange(sq)[:, None]
        hidden = hidden | (j[None, :] > i + (sk - sq))
    if key_lengths is not None:
        kl = np.clip(np.asarray(key_lengths), 0, sk).astype(np.int64)  # no wrap-around of huge uint64
        kl = kl.reshape((shape[0],) + (1,) * (len(shape) - 1))
        hidden = hidden | (j >= kl)
    return hidden


_FLT_MAX = float(np.finfo(np.float32).max)


def _fp32_range(v: np.ndarray, fp32: bool) -> np.ndarray:
    """The kernels scale and add in fp32: beyond its range a score is +-inf there too."""
    if not fp32:
        return v
    return np.where(np.abs(v) > _FLT_MAX * (1 + 2.0**-25), np.copysign(np.inf, v), v)


def softmax_forward(
    x: Any, mask: Any = None, scale: float = 1.0, causal: bool = False, key_lengths: Any = None
) -> np.ndarray:
    """y = softmax(x * scale + bias) in float64, with drvsoftmax's rules:
    hidden keys are exactly 0, a row with no visible key is all 0, a row whose biased
    scores hold NaN or +inf is all NaN."""
    xf = _f64(x)
    if xf.shape[-1] == 0:
        return np.zeros(xf.shape)
    add = _fit(mask, xf.ndim) if mask is not None and is_float_dtype(np.asarray(mask).dtype) else None
    fp32 = np.asarray(x).dtype != np.float64
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        v = _fp32_range(xf * float(scale), fp32)
        if add is not None:
            v = _fp32_range(v + _f64(add), fp32)
        v = np.where(hidden_positions(xf.shape, mask, causal, key_lengths), -np.inf, v)
        v = np.broadcast_to(v, xf.shape)
        bad = np.any(np.isnan(v) | (v == np.inf), axis=-1, keepdims=True)
        m = np.max(np.where(np.isnan(v), -np.inf, v), axis=-1, keepdims=True)
        m = np.where(np.isfinite(m), m, 0.0)
        e = np.exp(v - m)
        s = e.sum(axis=-1, keepdims=True)
        y = np.where(s > 0, e / np.where(s > 0, s, 1.0), 0.0)
        y = np.where(bad, np.nan, y)
    return y


def softmax_backward(dy: Any, y: Any, scale: float = 1.0) -> np.ndarray:
    """dx = scale * y * (dy - sum(dy * y)) in float64; exactly 0 where y == 0."""
    dyf, yf = _f64(dy), _f64(y)
    with np.errstate(invalid="ignore", over="ignore"):
        dot = np.sum(dyf * yf, axis=-1, keepdims=True)
        dx = float(scale) * yf * (dyf - dot)
    return np.where(yf == 0, 0.0, dx)
