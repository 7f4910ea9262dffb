"""Hypothesis properties against the independent oracle, on the CPU paths and on the GPU.

Inputs are drawn freely (rank, sizes, strides, dtypes, every mask form and shape, causal
with Sq != Sk, key_lengths of any integer dtype and any value, scale including 0 and
negatives, non-finite scores), then every result is compared with `naive_forward` /
`naive_backward` of test_softmax_reference (plain Python loops sharing no code with the
package) and checked for the contract's properties: hidden keys exactly 0, fully hidden
rows all 0, NaN rows NaN throughout, values in [0, 1], rows summing to 1.

CPU: NumPy and CPU torch, in CI.  GPU: CUDA tensors, more examples (skipped without one).
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import TOLS, requires_cuda
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_softmax_reference import check_softmax, naive_backward

import drvsoftmax

torch = pytest.importorskip("torch")
ml_dtypes = pytest.importorskip("ml_dtypes")

NP = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16, "float32": np.float32, "float64": np.float64}
TT = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32, "float64": torch.float64}
MASK_NP = {
    "bool": np.bool_,
    "uint8": np.uint8,
    "int8": np.int8,
    "int16": np.int16,
    "int32": np.int32,
    "int64": np.int64,
    "float16": np.float16,
    "float32": np.float32,
    "float64": np.float64,
}
KLEN_NP = [np.int8, np.uint8, np.int16, np.uint16, np.int32, np.uint32, np.int64, np.uint64]


@st.composite
def problems(draw, dtypes, max_sk=70):
    """One forward problem: x, mask, scale, causal, key_lengths (NumPy, on the host)."""
    rank = draw(st.integers(1, 4))
    shape = tuple(draw(st.lists(st.integers(1, 3), min_size=rank - 1, max_size=rank - 1))) + (
        draw(st.integers(1, max_sk)),
    )
    dtype = draw(st.sampled_from(dtypes))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape) * draw(st.sampled_from([0.1, 3.0, 30.0]))
    if draw(st.booleans()):  # non-finite scores are data
        flat = x.reshape(-1)
        for v in draw(st.lists(st.sampled_from([np.inf, -np.inf, np.nan]), max_size=3)):
            flat[rng.integers(flat.size)] = v
    x = x.astype(NP[dtype])
    mask = None
    kind = draw(st.sampled_from(["none", *MASK_NP]))
    if kind != "none":
        # Any shape broadcastable to x: each trailing dim either x's or 1, possibly fewer dims.
        keep = draw(st.integers(0, rank))
        mshape = tuple(n if draw(st.booleans()) else 1 for n in shape[rank - keep :])
        if draw(st.booleans()) and mshape:
            mshape = mshape[:-1] + (shape[-1],)
        hide = np.asarray(rng.random(mshape) < draw(st.sampled_from([0.0, 0.3, 1.0])))
        if kind.startswith("float"):
            mask = np.asarray(np.where(hide, -np.inf, rng.standard_normal(mshape) * 2)).astype(MASK_NP[kind])
        elif kind == "bool":
            mask = hide
        else:
            vals = np.where(rng.integers(0, 2, mshape) == 0, 1, 2 if kind.startswith("u") else -1)
            mask = np.asarray(np.where(hide, vals, 0)).astype(MASK_NP[kind])
    causal = rank >= 2 and draw(st.booleans())
    kl = None
    if rank >= 2 and draw(st.booleans()):
        kdt = draw(st.sampled_from(KLEN_NP))
        info = np.iinfo(kdt)
        vals = [
            draw(st.one_of(st.integers(-2, shape[-1] + 2), st.integers(int(info.min), int(info.max))))
            for _ in range(shape[0])
        ]
        kl = np.array([min(max(v, int(info.min)), int(info.max)) for v in vals], dtype=kdt)
    scale = draw(st.sampled_from([1.0, 0.0, -0.7, 0.125, 3.0]))
    return dtype, x, mask, scale, causal, kl


def _strided(t, rng_seed):
    """The same values behind another layout: a transposed, sliced copy's view."""
    if t.dim() < 2 or rng_seed % 2:
        return t
    big = torch.empty(t.shape[:-2] + (t.shape[-1], t.shape[-2] * 2), dtype=t.dtype, device=t.device)
    v = big.transpose(-1, -2)[..., ::2, :]
    v.copy_(t)
    return v


def _host(t):
    t = t.detach().cpu()
    return (t.float() if t.dtype == torch.bfloat16 else t).numpy()


def _tensor(a, device, dtype=None):
    if a is None:
        return None
    if a.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(a.astype(np.float32)).to(device, torch.bfloat16)
    t = torch.from_numpy(np.ascontiguousarray(a)).to(device)
    return t if dtype is None else t.to(dtype)


def _check_backward(got, dy, y, scale, dtype):
    ref = naive_backward(dy, y, scale)
    got = np.asarray(got, dtype=np.float64)
    yv = np.asarray(y, dtype=np.float64)
    assert np.all(got[yv == 0] == 0), "backward: positions with y == 0 must get exactly 0"
    dyv = np.asarray(dy, dtype=np.float64)
    mag = np.abs(yv) * (np.abs(dyv) + np.abs((dyv * yv).sum(-1, keepdims=True))) * abs(scale)
    rtol = {"float16": 4e-3, "bfloat16": 3e-2, "float32": 1e-5, "float64": 1e-12}[dtype]
    ok = np.abs(got - ref) <= rtol * mag + TOLS[dtype]["atol"]
    assert np.all(ok | (np.isnan(ref) & np.isnan(got))), f"backward {dtype}: {np.abs(got - ref).max()}"


CPU_SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@CPU_SETTINGS
@given(p=problems(list(NP)))
def test_numpy_forward_and_backward_match_the_oracle(p):
    dtype, x, mask, scale, causal, kl = p
    x_before = x.copy()
    y = drvsoftmax.scaled_masked_softmax(x, mask, scale=scale, causal=causal, key_lengths=kl)
    assert y.dtype == x.dtype and y.shape == x.shape
    assert x.tobytes() == x_before.tobytes()
    check_softmax(y, x, mask, scale, causal, kl, dtype=dtype, what="numpy")
    dy = np.random.default_rng(1).standard_normal(x.shape).astype(x.dtype)
    ys = np.nan_to_num(y.astype(np.float64)).astype(x.dtype)
    _check_backward(drvsoftmax.scaled_masked_softmax_backward(dy, ys, scale=scale), dy, ys, scale, dtype)


@CPU_SETTINGS
@given(p=problems(list(NP)), seed=st.integers(0, 3))
def test_torch_cpu_forward_and_backward_match_the_oracle(p, seed):
    dtype, x, mask, scale, causal, kl = p
    xt = _strided(_tensor(x, "cpu"), seed)
    y = drvsoftmax.scaled_masked_softmax(
        xt, _tensor(mask, "cpu"), scale=scale, causal=causal, key_lengths=_tensor(kl, "cpu")
    )
    assert y.dtype == TT[dtype] and tuple(y.shape) == x.shape
    check_softmax(_host(y), x, mask, scale, causal, kl, dtype=dtype, what="torch cpu")


GPU_SETTINGS = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@requires_cuda
@GPU_SETTINGS
@given(p=problems(["float16", "bfloat16", "float32"], max_sk=1500), seed=st.integers(0, 3))
def test_cuda_forward_and_backward_match_the_oracle(p, seed):
    dtype, x, mask, scale, causal, kl = p
    xt = _strided(_tensor(x, "cuda"), seed)
    out = torch.full(xt.shape, float("nan"), dtype=xt.dtype, device="cuda")  # unwritten shows as NaN
    y = drvsoftmax.scaled_masked_softmax(
        xt, _tensor(mask, "cuda"), scale=scale, causal=causal, key_lengths=_tensor(kl, "cuda"), out=out
    )
    torch.cuda.synchronize()
    assert y is out
    yh = _host(y)
    check_softmax(yh, x, mask, scale, causal, kl, dtype=dtype, what="cuda", fp32_scores=True)
    dy = torch.randn(xt.shape, device="cuda").to(xt.dtype)
    ys = torch.nan_to_num(y)
    dx = drvsoftmax.scaled_masked_softmax_backward(dy, ys, scale=scale)
    torch.cuda.synchronize()
    _check_backward(_host(dx), _host(dy), _host(ys), scale, dtype)
