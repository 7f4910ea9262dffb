"""The split tier (smx_fwd_split, smx_bwd_split) on a GPU against the float64 reference.

Skips cleanly without PyTorch or a CUDA GPU.  The tier takes the rows the looped tier
would; `_plan.FORCE_SPLIT` puts it also where the cluster tier would run, so that every
row length is tested on it on any GPU.  Each case first checks that the launch really is
of the tier.  Outputs are poisoned with NaN first: an element no block writes shows up as a
NaN the reference does not have.  One case has more segments per row than the device
holds blocks at once: its first blocks cannot see their row complete and must compute the
missing pairs themselves (the tier's path that keeps it from ever waiting forever).
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import assert_matches, torch_cuda_available
from helpers import cuda_device as _dev
from helpers import operand as _op
from helpers import to_numpy as _np

import drvsoftmax
from drvsoftmax import _core, _plan, _reference

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.skipif(not torch_cuda_available(), reason="needs PyTorch with a CUDA GPU")

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
_gen = np.random.default_rng(20261204)


def _forget():
    import drvsoftmax.torch as dtorch

    _core._cache.clear()
    dtorch._forget_launches()


@pytest.fixture(autouse=True)
def _force_split(monkeypatch):
    monkeypatch.setattr(_plan, "FORCE_SPLIT", True)
    _forget()
    yield
    _forget()


def _fwd_plan(x, mask, causal, kl, out, scale) -> _plan.LaunchPlan:
    m = None if mask is None else _op(mask)
    k = None if kl is None else _op(kl)
    aligned = not ((x.data_ptr() | out.data_ptr()) & 15)
    mask_aligned = mask is None or not (mask.data_ptr() & 15)
    return _core.prepare_forward(_dev(), _op(x), _op(out), m, k, causal, scale, aligned, mask_aligned).plan


def _mask(kind, shape, dtype):
    """A bool mask hiding about a third of the keys (and all of query 1's), or an additive
    one of x's dtype with -inf at a fifth of the keys (and all of query 2's)."""
    if kind == "bool":
        m = _gen.random(shape) < 0.3
        m[..., 1, :] = True
        return torch.from_numpy(m).cuda()
    m = _gen.standard_normal(shape) * 2
    m[_gen.random(shape) < 0.2] = -np.inf
    m[..., 2, :] = -np.inf
    return torch.from_numpy(m).to(dtype).cuda()


def _check_fwd(x, mask=None, causal=False, kl=None, scale=0.37, what=""):
    out = torch.full(x.shape, float("nan"), dtype=x.dtype, device="cuda")
    plan = _fwd_plan(x, mask, causal, kl, out, scale)
    assert plan.tier == "split", f"{what}: planned {plan.describe()}"
    y = drvsoftmax.scaled_masked_softmax(x, mask, scale=scale, causal=causal, key_lengths=kl, out=out)
    torch.cuda.synchronize()
    mnp = None if mask is None else _np(mask)
    knp = None if kl is None else _np(kl)
    ref = _reference.softmax_forward(_np(x), mnp, scale, causal, knp)
    got = _np(y)
    assert_matches(got, ref, str(x.dtype).replace("torch.", ""), what)
    hidden = np.broadcast_to(_reference.hidden_positions(x.shape, mnp, causal, knp), x.shape)
    assert np.all(got[hidden] == 0), f"{what}: hidden positions are not exactly 0"
    return got


def _x(shape, dtype, sd=4.0):
    return torch.from_numpy(_gen.standard_normal(shape) * sd).to(DTYPES[dtype]).cuda()


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("sk", [16385, 40003, 65536, 262144])
def test_forward_every_mask_kind(sk, dtype):
    """No mask, a bool mask and an additive one over several segments per row, the last
    segment partial (and rows off the 16-byte grid at odd lengths)."""
    rows = max(3, (1 << 21) // sk)
    shape = (1, 2, rows // 2 + 1, sk)
    x = _x(shape, dtype)
    what = f"{dtype} {shape}"
    _check_fwd(x, what=what + " no mask")
    _check_fwd(x, _mask("bool", (1, 1, shape[2], sk), None), what=what + " bool")
    _check_fwd(x, _mask("add", shape, DTYPES[dtype]), what=what + " add")


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_forward_causal_and_key_lengths(dtype):
    """Visible prefixes that end inside, at the start of and before whole segments."""
    sk = 70001
    x = _x((5, 2, 9, sk), dtype)
    _check_fwd(x, causal=True, what="causal")  # (Sq < Sk: the prefixes are long)
    kl = torch.tensor([0, 8191, 8192, 50000, sk], dtype=torch.int64, device="cuda")
    _check_fwd(x, kl=kl, what="key_lengths")
    kl32 = torch.tensor([sk - 1, 1, 16384, 3, 40000], dtype=torch.int32, device="cuda")
    _check_fwd(x, _mask("bool", (5, 1, 9, sk), None), kl=kl32, what="bool mask and key_lengths")


def test_forward_strided_and_unaligned_rows():
    """A view one element into each row (every row off the 16-byte grid) and a
    transposed one (element-wise access)."""
    base = _x((6, 33001), "float16")
    _check_fwd(base[:, 1:], what="rows off the grid")
    t = _x((20000, 4), "float32").t()
    _check_fwd(t, what="strided rows")


def test_forward_nan_inf_and_empty_rows():
    sk = 50000
    x = _x((5, sk), "float32", 1.0)
    x[0, 17] = float("nan")
    x[1, 40000] = float("inf")
    mask = torch.zeros((5, sk), dtype=torch.bool, device="cuda")
    mask[2] = True
    got = _check_fwd(x, mask, scale=1.0, what="nan/inf/empty")
    assert np.isnan(got[0]).all() and np.isnan(got[1]).all() and (got[2] == 0).all()
    assert np.isfinite(got[3:]).all()


def test_big_scores_keep_every_segment_exact():
    """Maxima of 3e9 in one segment and finfo.min elsewhere in another: the merge of the
    segments' pairs takes differences of maxima, never a rounded shift."""
    sk = 65536
    x = np.zeros((3, sk))
    x[0] = 3e9 + 256.0 * _gen.integers(0, 3, sk)
    x[1] = float(np.finfo(np.float32).min)
    x[2, :100] = 1e6
    x[2, 100:] = -1e6
    xt = torch.from_numpy(x).float().cuda()
    got = _check_fwd(xt, scale=1.0, what="big scores")
    np.testing.assert_allclose(got[1], 1.0 / sk, rtol=1e-5)


def test_more_segments_than_the_device_holds_at_once():
    """A row of 2^22 fp32 keys: 512 segments, more blocks than an H200 holds at once, so
    the first blocks must compute the pairs of segments not yet launched."""
    sk = 1 << 22
    x = _x((2, sk), "float32")
    plan = _fwd_plan(x, None, False, None, torch.empty_like(x), 1.0)
    assert plan.split == 512, plan.describe()
    _check_fwd(x, what="4M keys")
    dy = _x((2, sk), "float32")
    y = torch.softmax(x.double(), -1).float()
    _check_bwd(dy, y, 1.0, "4M keys")


def _check_bwd(dy, y, scale, what):
    dx = torch.full(y.shape, float("nan"), dtype=y.dtype, device="cuda")
    aligned = not ((dy.data_ptr() | y.data_ptr() | dx.data_ptr()) & 15)
    plan = _core.prepare_backward(_dev(), _op(dy), _op(y), _op(dx), scale, aligned).plan
    assert plan.tier == "split", f"{what}: planned {plan.describe()}"
    drvsoftmax.scaled_masked_softmax_backward(dy, y, scale=scale, out=dx)
    torch.cuda.synchronize()
    ref = _reference.softmax_backward(_np(dy), _np(y), scale)
    assert_matches(_np(dx), ref, str(y.dtype).replace("torch.", ""), what)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("sk", [16385, 65536, 262147])
def test_backward(sk, dtype):
    rows = max(3, (1 << 21) // sk)
    x = torch.from_numpy(_gen.standard_normal((rows, sk)) * 3).cuda()
    x[0, : sk // 2] = -float("inf")  # y == 0 there: dx exactly 0
    y = torch.softmax(x, -1).to(DTYPES[dtype])
    dy = _x((rows, sk), dtype, 1.0)
    _check_bwd(dy, y, 0.7, f"{dtype} Sk={sk}")
    # rows off the 16-byte grid
    yb = torch.empty((rows, sk + 1), dtype=y.dtype, device="cuda")
    yb[:, 1:] = y
    db = torch.empty_like(yb)
    db[:, 1:] = dy
    _check_bwd(db[:, 1:], yb[:, 1:], 1.0, f"{dtype} Sk={sk} off the grid")


def test_autograd_and_the_default_plan(monkeypatch):
    """Without the knob, with the tier on (`_plan.SPLIT`): rows the looped tier would take
    run on the split tier, through autograd too (16-bit rows of 1M keys with a bool mask:
    a cluster of 16 would need more than CLUSTER_LOOP_SMEM per block, and 16-bit x has no
    streamed forward; their backward streams where the device has clusters)."""
    monkeypatch.setattr(_plan, "FORCE_SPLIT", False)
    monkeypatch.setattr(_plan, "SPLIT", True)
    _forget()
    dev = _dev()
    sk = 1 << 20
    x = _x((3, sk), "float16").requires_grad_()
    m = torch.from_numpy(_gen.random((1, sk)) < 0.3).cuda()
    plan = _fwd_plan(x.detach(), m, False, None, torch.empty_like(x), 1.0)
    if plan.tier == "cluster":  # (where clusters of 16 hold such rows)
        pytest.skip(f"the cluster tier takes these rows on {dev.arch}")
    assert plan.tier == "split", plan.describe()
    y = drvsoftmax.scaled_masked_softmax(x, m, scale=0.5)
    g = _x((3, sk), "float16")
    (y * g).sum().backward()
    ref_y = _reference.softmax_forward(_np(x), _np(m), 0.5, False, None)
    assert_matches(_np(y), ref_y, "float16", "autograd forward")
    ref_dx = _reference.softmax_backward(_np(g), _np(y), 0.5)
    assert_matches(_np(x.grad), ref_dx, "float16", "autograd backward")


def test_cuda_graph_capture_and_replay():
    """The launch's workspace (allocated, zeroed and freed on the stream) is captured with
    the kernel: replays on new inputs give new answers, each against the reference."""
    sk = 1 << 20
    x = _x((4, sk), "float32")
    out = torch.full_like(x, float("nan"))
    assert _fwd_plan(x, None, False, None, out, 0.5).tier == "split"
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        drvsoftmax.scaled_masked_softmax(x, scale=0.5, out=out)  # (warm-up: compile, prepare)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        drvsoftmax.scaled_masked_softmax(x, scale=0.5, out=out)
    for _ in range(3):
        x.copy_(_x((4, sk), "float32"))
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        assert_matches(_np(out), _reference.softmax_forward(_np(x), None, 0.5, False, None), "float32", "replay")


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_forward_wide_masks(dtype):
    """Masks of 4- and 8-byte elements (kernels of fewer chunks per thread)."""
    sk = 40003
    shape = (2, 1, 5, sk)
    x = _x(shape, dtype)
    hide = torch.from_numpy((_gen.random(shape) < 0.3).astype(np.int32)).cuda()
    _check_fwd(x, hide, what=f"{dtype} int32 mask")
    _check_fwd(x, hide.to(torch.int64), what=f"{dtype} int64 mask")
    _check_fwd(x, _mask("add", shape, torch.float32), what=f"{dtype} fp32 additive mask")
    _check_fwd(x, _mask("add", shape, torch.float64), what=f"{dtype} fp64 additive mask")
