"""The streamed cluster forward and backward (sm_90+) on a GPU against the float64
reference, on fresh random inputs.

Runs alone: `python -m pytest tests/test_softmax_stream_gpu.py`.  Skips cleanly without
PyTorch, without a CUDA GPU, or on a GPU older than sm_90 (no thread-block clusters).  By
default only fp32 rows that the cluster tier does not take stream (rows of about 1M keys
and more; with a bool mask, beyond 458752 keys); here `_plan.FORCE_STREAM` (a test hook)
caps each block's shared memory, down to none, so that shorter rows stream too: every
slice then has chunks in registers, in shared memory and streamed (read in PAIR and again
in STORE), with the row's ends, hidden keys and odd alignments among them.  Every output
is poisoned with NaN first, so an element no block writes shows up as a NaN the reference
does not have.  Each case first checks that the launch really is of the streamed kernel.
The backward streams in every dtype of x: by default rows no cluster takes.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import assert_backward_matches, assert_matches, torch_cuda_available
from helpers import cuda_device as _dev
from helpers import operand as _op
from helpers import to_numpy as _np

import drvsoftmax
from drvsoftmax import _core, _plan, _reference

torch = pytest.importorskip("torch")


def _sm90() -> bool:
    return torch_cuda_available() and torch.cuda.get_device_capability() >= (9, 0)


pytestmark = pytest.mark.skipif(not _sm90(), reason="needs PyTorch with an sm_90+ CUDA GPU (thread-block clusters)")

_gen = np.random.default_rng(20261206)
# Shared memory per block the forced plans may take: none (all but the registers streamed),
# a little (one step of shared memory per thread, the rest streamed), the default.
CAPS = {"none": 0, "16K": 16 * 1024, "default": _plan.STREAM_SMEM}


def _forget():
    import drvsoftmax.torch as dtorch

    _core._cache.clear()
    dtorch._forget_launches()


@pytest.fixture(params=list(CAPS))
def stream(request, monkeypatch):
    """Plan the streamed forward, its shared memory capped, for every long fp32 row."""
    monkeypatch.setattr(_plan, "FORCE_STREAM", CAPS[request.param])
    _forget()
    yield CAPS[request.param]
    _forget()


def _rand(shape, scale=3.0):
    return torch.from_numpy(_gen.standard_normal(shape) * scale).to(torch.float32).cuda()


def _prepared(x, mask=None, *, causal=False, key_lengths=None, out=None, scale=1.0) -> _core.Prepared:
    y = out if out is not None else x
    m = _op(mask) if mask is not None else None
    k = _op(key_lengths) if key_lengths is not None else None
    aligned = not ((x.data_ptr() | y.data_ptr()) & 15)
    mask_aligned = mask is None or not (mask.data_ptr() & 15)
    return _core.prepare_forward(_dev(), _op(x), _op(y), m, k, causal, scale, aligned, mask_aligned)


def _assert_streams(prep: _core.Prepared, cap: int | None, what: str) -> None:
    p = prep.plan
    kind = "none" if "MaskNone" in p.kernel else "hide1"
    assert p.kernel == _plan.kernel_fwd_stream("float32", kind), f"{what}: planned {p.describe()}"
    assert p.cluster == _plan.STREAM_CLUSTER and prep.cluster is not None, f"{what}: {p.describe()}"
    if cap is not None:
        assert p.smem <= cap, f"{what}: {p.describe()}"


def _check(x, mask=None, *, scale=1.0, causal=False, key_lengths=None, out=None, what="", cap=None):
    mnp = None if mask is None else _np(mask)
    knp = None if key_lengths is None else _np(key_lengths)
    ref = _reference.softmax_forward(_np(x), mnp, scale, causal, knp)
    if out is None:
        out = torch.full(x.shape, float("nan"), dtype=x.dtype, device=x.device)
    _assert_streams(_prepared(x, mask, causal=causal, key_lengths=key_lengths, out=out, scale=scale), cap, what)
    y = drvsoftmax.scaled_masked_softmax(x, mask, scale=scale, causal=causal, key_lengths=key_lengths, out=out)
    assert y is out
    torch.cuda.synchronize()
    got = _np(y)
    assert_matches(got, ref, "float32", what)
    hidden = np.broadcast_to(_reference.hidden_positions(x.shape, mnp, causal, knp), x.shape)
    assert np.all(got[hidden] == 0), f"{what}: hidden positions are not exactly 0"
    if not np.isnan(ref).any():
        visible = ~np.all(ref == 0, axis=-1)
        sums = got.sum(-1, dtype=np.float64)
        assert np.all(np.abs(sums[visible] - 1) < 1e-4 * max(1.0, np.sqrt(x.shape[-1]) / 16)), f"{what}: row sums"
        assert np.all(sums[~visible] == 0)


@pytest.mark.parametrize("sk", [16385, 16389, 65536, 70001, 200003, 2**20 + 3])
def test_rows_without_a_mask(stream, sk):
    """Slices whose registers, shared memory and streamed steps end anywhere in the row."""
    _check(_rand((3, sk)), scale=0.37, what=f"Sk={sk}", cap=stream)


@pytest.mark.parametrize("sk", [16385, 65537, 200003])
@pytest.mark.parametrize("shape", ["b1qk", "11qk", "bhqk"])
def test_bool_masks(stream, sk, shape):
    b, h, q = 2, 2, 2
    x = _rand((b, h, q, sk))
    dims = {"b1qk": (b, 1, q, sk), "11qk": (1, 1, q, sk), "bhqk": (b, h, q, sk)}[shape]
    m = torch.from_numpy(_gen.random(dims) < 0.3).cuda()
    _check(x, m, scale=-0.6, what=f"bool {shape} Sk={sk}", cap=stream)


@pytest.mark.parametrize("sq,sk", [(3, 40000), (2, 262145)])
def test_causal(stream, sq, sk):
    _check(_rand((2, 1, sq, sk)), causal=True, scale=0.5, what=f"causal {sq}x{sk}", cap=stream)


@pytest.mark.parametrize("kl_dtype", [torch.int32, torch.int64])
def test_key_lengths_and_every_source_together(stream, kl_dtype):
    sk = 70001
    x = _rand((5, 1, 2, sk))
    # 0, 1, a length inside the first block's slice, past it, > Sk (all legal)
    kl = torch.tensor([0, 1, 3000, sk - 7, sk + 10], dtype=kl_dtype, device="cuda")
    _check(x, key_lengths=kl, what="key_lengths", cap=stream)
    m = torch.from_numpy(_gen.random((5, 1, 2, sk)) < 0.3).cuda()
    _check(x, m, scale=-0.8, causal=True, key_lengths=kl, what="all sources", cap=stream)


def test_nonfinite_and_hidden_rows(stream):
    sk = 40000
    x = _rand((1, 1, 7, sk))
    x[0, 0, 0, sk // 2 + 3] = float("nan")  # NaN row (the NaN in a streamed step)
    x[0, 0, 1, sk - 1] = float("inf")  # +inf row: NaN throughout
    x[0, 0, 2, :] = float("-inf")  # every score -inf: all zeros
    x[0, 0, 3, sk - 1] = float("-inf")  # one -inf key: hidden
    m = torch.zeros((1, 1, 7, sk), dtype=torch.bool, device="cuda")
    m[0, 0, 4, :] = True  # fully masked row: zeros
    m[0, 0, 5, 0] = True
    x[0, 0, 5, 0] = float("nan")  # NaN under a boolean mask is hidden, not NaN
    m[0, 0, 6, : sk - 1] = True  # only the last key visible: 1 there
    _check(x, m, what="nonfinite", cap=stream)


def test_strided_unaligned_and_in_place_rows(stream):
    sk = 65537
    base = _rand((2, 3, 2 * sk + 8))
    views = {
        "rows off the 16-byte grid": base[..., 1 : 1 + sk],
        "slice": base[:, ::2, 4 : 4 + sk],
        "last_dim_stride2": base[..., : 2 * sk : 2],
        "expanded_rows": base[:1, :1, :sk].expand(2, 3, sk),
    }
    for name, v in views.items():
        _check(v, scale=0.3, what=name, cap=stream)
    x = _rand((3, sk))
    buf = torch.full((3 * sk + 1,), float("nan"), dtype=torch.float32, device="cuda")
    _check(x, scale=0.3, out=buf[1:].view(3, sk), what="misaligned out", cap=stream)
    wide = torch.full((3, 2 * sk), float("nan"), dtype=torch.float32, device="cuda")
    _check(x, scale=0.3, out=wide[:, ::2], what="strided out", cap=stream)
    assert torch.isnan(wide[:, 1::2]).all(), "elements between the strided output's were written"
    # out=x: every streamed chunk is read again before its own y is written over it
    m = torch.from_numpy(_gen.random((1, 1, sk)) < 0.2).cuda()
    ref = _reference.softmax_forward(_np(x), _np(m), 0.7, False, None)
    _assert_streams(_prepared(x, m, out=x, scale=0.7), stream, "out=x")
    assert drvsoftmax.scaled_masked_softmax(x, m, scale=0.7, out=x) is x
    torch.cuda.synchronize()
    assert_matches(_np(x), ref, "float32", "out=x")


@pytest.mark.parametrize(
    "rows,sk,masks",
    [("many", 2**20, ("none", "bool")), (3, 2**20, ("none", "bool")), (5, 2**19, ("bool",))],
)
def test_rows_no_cluster_takes_stream_by_default(rows, sk, masks):
    """Without the hook: fp32 rows the cluster tier does not take stream, with and without
    a bool mask: rows of 1M keys (no cluster holds them), more than the split tier would
    take and as few as 3; rows of 512K keys with a bool mask (a cluster of 16 would need
    more than CLUSTER_LOOP_SMEM per block).  A sample of rows against float64."""
    _forget()
    if rows == "many":
        rows = int(_dev().caps.sm_count * _plan.SPLIT_ROWS_PER_SM) + 2
    x = torch.randn((rows, sk), device="cuda") * 3
    m = torch.rand((rows, sk), device="cuda") < 0.25
    for mask in [None if mk == "none" else m for mk in masks]:
        _assert_streams(_prepared(x, mask, scale=0.125), None, f"default, mask {mask is not None}")
        y = torch.full_like(x, float("nan"))
        drvsoftmax.scaled_masked_softmax(x, mask, scale=0.125, out=y)
        torch.cuda.synchronize()
        assert not torch.isnan(y).any(), "an element was not written"
        idx = torch.tensor(sorted({0, 1, rows // 2, rows - 1}), device="cuda")
        s = x[idx].double() * 0.125
        if mask is not None:
            s = s.masked_fill(mask[idx], float("-inf"))
        assert_matches(_np(y[idx]), torch.softmax(s, -1).cpu().numpy(), "float32", f"{sk} keys")
    _forget()


# ---------------------------------------------------------------------------------------
# The streamed backward: dy and y of a slice in registers, shared memory and streamed.


def _bwd_inputs(shape, dtype, gen_scale=3.0):
    """y a softmax of random scores (some exactly 0 where scores are -inf), dy random."""
    s = _gen.standard_normal(shape) * gen_scale
    s[..., ::7] = -np.inf
    y = np.exp(s - s.max(-1, keepdims=True))
    y /= y.sum(-1, keepdims=True)
    dy = _gen.standard_normal(shape)
    return torch.from_numpy(dy).to(dtype).cuda(), torch.from_numpy(y).to(dtype).cuda()


def _bits(t):
    """The tensor's bytes as integers, so a NaN compares equal to itself."""
    return t.view({torch.float32: torch.int32}.get(t.dtype, torch.int16))


def _check_backward(dy, y, *, scale=0.5, out=None, what="", cap=None):
    dt = str(y.dtype).replace("torch.", "")
    ynp, dynp = _np(y), _np(dy)
    ref = _reference.softmax_backward(dynp, ynp, scale)
    if out is None:
        out = torch.full(y.shape, float("nan"), dtype=y.dtype, device="cuda")
    aligned = not ((dy.data_ptr() | y.data_ptr() | out.data_ptr()) & 15)
    prep = _core.prepare_backward(_dev(), _op(dy), _op(y), _op(out), scale, aligned)
    p = prep.plan
    assert p.kernel == _plan.kernel_bwd_stream(dt), f"{what}: planned {p.describe()}"
    assert p.cluster == _plan.STREAM_CLUSTER and prep.cluster is not None, f"{what}: {p.describe()}"
    if cap is not None:
        assert p.smem <= cap, f"{what}: {p.describe()}"
    dy_before, y_before = dy.clone(), y.clone()
    dx = drvsoftmax.scaled_masked_softmax_backward(dy, y, scale=scale, out=out)
    assert dx is out
    torch.cuda.synchronize()
    assert_backward_matches(_np(dx), dynp, ynp, ref, scale, dt, what)
    if out.data_ptr() not in (dy.data_ptr(), y.data_ptr()):
        assert torch.equal(_bits(dy), _bits(dy_before)), f"{what}: dy written"
        assert torch.equal(_bits(y), _bits(y_before)), f"{what}: y written"


BWD_DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("dtype", BWD_DTYPES, ids=lambda t: str(t).replace("torch.", ""))
@pytest.mark.parametrize("sk", [16385, 70001, 300007, 2**20 + 5])
def test_backward_rows(stream, dtype, sk):
    """Slices whose registers, shared memory and streamed steps end anywhere in the row."""
    dy, y = _bwd_inputs((3, sk), dtype)
    _check_backward(dy, y, scale=0.37, what=f"{dtype} Sk={sk}", cap=stream)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=lambda t: str(t).replace("torch.", ""))
def test_backward_strided_unaligned_and_in_place(stream, dtype):
    sk = 65537
    dyb, yb = _bwd_inputs((2, 3, 2 * sk + 8), dtype)
    views = {
        "rows off the 16-byte grid": (dyb[..., 1 : 1 + sk], yb[..., 1 : 1 + sk]),
        "slice": (dyb[:, ::2, 4 : 4 + sk], yb[:, ::2, 4 : 4 + sk]),
        "last_dim_stride2": (dyb[..., : 2 * sk : 2], yb[..., : 2 * sk : 2]),
        "expanded dy": (dyb[:1, :1, :sk].expand(2, 3, sk), yb[..., :sk]),
    }
    for name, (dy, y) in views.items():
        _check_backward(dy, y, what=f"{dtype} {name}", cap=stream)
    dy, y = _bwd_inputs((3, sk), dtype)
    buf = torch.full((3 * sk + 1,), float("nan"), dtype=dtype, device="cuda")
    _check_backward(dy, y, out=buf[1:].view(3, sk), what=f"{dtype} misaligned out", cap=stream)
    # out=dy: every streamed chunk is read again before its own dx is written over it
    ref_dy, ref_y = dy.clone(), y.clone()
    _check_backward(dy, y, out=dy, what=f"{dtype} out=dy", cap=stream)
    assert torch.equal(y, ref_y) and not torch.equal(dy, ref_dy)


def test_backward_nonfinite_rows(stream):
    sk = 40000
    dy, y = _bwd_inputs((4, sk), torch.float32)
    dy[0, sk // 2 + 3] = float("nan")  # a NaN in a streamed step: NaN where y != 0
    dy[1, sk - 1] = float("inf")
    y[2, :] = 0  # a fully hidden row: zeros
    _check_backward(dy, y, what="nonfinite", cap=stream)


@pytest.mark.parametrize("rows,dtype", [("many", torch.float32), (3, torch.float32), (5, torch.float16)])
def test_backward_rows_no_cluster_takes_stream_by_default(rows, dtype):
    """Without the hook: backward rows the cluster tier does not take stream (rows of 1M
    keys: no cluster holds fp32 ones, 16-bit ones only in blocks of more than
    CLUSTER_LOOP_SMEM), as many as fill the device and as few as 3.  A sample of rows
    against float64."""
    _forget()
    if rows == "many":
        rows = int(_dev().caps.sm_count * _plan.SPLIT_ROWS_PER_SM) + 2
    sk = 2**20
    dt = str(dtype).replace("torch.", "")
    y = torch.softmax(torch.randn((rows, sk), device="cuda") * 3, -1).to(dtype)
    dy = torch.randn((rows, sk), device="cuda").to(dtype)
    dx = torch.full_like(y, float("nan"))
    prep = _core.prepare_backward(_dev(), _op(dy), _op(y), _op(dx), 0.5, True)
    assert prep.plan.kernel == _plan.kernel_bwd_stream(dt), prep.plan.describe()
    drvsoftmax.scaled_masked_softmax_backward(dy, y, scale=0.5, out=dx)
    torch.cuda.synchronize()
    assert not torch.isnan(dx).any(), "an element was not written"
    idx = torch.tensor(sorted({0, 1, rows // 2, rows - 1}), device="cuda")
    dynp, ynp = _np(dy[idx]), _np(y[idx])
    ref = _reference.softmax_backward(dynp, ynp, 0.5)
    assert_backward_matches(_np(dx[idx]), dynp, ynp, ref, 0.5, dt, f"{rows}x{sk} {dt}")
    _forget()
