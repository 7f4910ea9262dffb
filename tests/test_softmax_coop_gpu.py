"""The coop tier on a GPU against the float64 reference, on fresh random inputs.

Runs alone: `python -m pytest tests/test_softmax_coop_gpu.py`.  Skips cleanly without
PyTorch or without a CUDA GPU.  On sm_90+ the coop tier is forced for every long row
(`_plan.FORCE_COOP`, the planner hook behind DRVSOFTMAX_FORCE_COOP), so that rows the
cluster tier would take run here; older GPUs plan it of their own.  Every output is
poisoned with NaN first, so an element no block writes shows up as a NaN the reference
does not have.  Each case first checks that the launch really is of the coop tier on this
device (its plan after the device's measured capacity).
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
from helpers import LONG_ROW_MASK_KINDS, assert_backward_matches, assert_matches, long_row_mask, torch_cuda_available
from helpers import cuda_device as _dev
from helpers import operand as _op
from helpers import to_numpy as _np

import drvsoftmax
from drvsoftmax import _core, _plan, _reference

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.skipif(not torch_cuda_available(), reason="needs PyTorch with a CUDA GPU")

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
ITEM = {"float16": 2, "bfloat16": 2, "float32": 4}
_gen = np.random.default_rng(20261201)


def _forget():
    import drvsoftmax.torch as dtorch

    _core._cache.clear()
    dtorch._forget_launches()  # the torch door's own prepared launches


@pytest.fixture(autouse=True)
def _force_coop(monkeypatch):
    """Plan the coop tier where the cluster tier would run; prepared launches of other
    tests (and of the other setting) are forgotten before and after."""
    monkeypatch.setattr(_plan, "FORCE_COOP", True)
    _forget()
    yield
    _forget()


@functools.lru_cache(maxsize=1)
def _caps() -> _plan.DeviceCaps:
    return _dev().caps


def _rand(shape, dtype, scale=3.0):
    return torch.from_numpy(_gen.standard_normal(shape) * scale).to(dtype).cuda()


def _fwd_prepared(x, mask=None, *, causal=False, key_lengths=None, out=None, scale=1.0) -> _core.Prepared:
    """The prepared launch (device capacity applied) of this forward."""
    y = out if out is not None else x
    m = _op(mask) if mask is not None else None
    k = _op(key_lengths) if key_lengths is not None else None
    aligned = not ((x.data_ptr() | y.data_ptr()) & 15)
    mask_aligned = mask is None or not (mask.data_ptr() & 15)
    return _core.prepare_forward(_dev(), _op(x), _op(y), m, k, causal, scale, aligned, mask_aligned)


def _bwd_prepared(dy, y, out) -> _core.Prepared:
    aligned = not ((dy.data_ptr() | y.data_ptr() | out.data_ptr()) & 15)
    return _core.prepare_backward(_dev(), _op(dy), _op(y), _op(out), 1.0, aligned)


def _check_forward(x, mask=None, *, scale=1.0, causal=False, key_lengths=None, what="", out=None, any_tier=False):
    dt = str(x.dtype).replace("torch.", "")
    mnp = None if mask is None else _np(mask)
    knp = None if key_lengths is None else _np(key_lengths)
    ref = _reference.softmax_forward(_np(x), mnp, scale, causal, knp)
    if out is None:
        out = torch.full(x.shape, float("nan"), dtype=x.dtype, device=x.device)
    prep = _fwd_prepared(x, mask, causal=causal, key_lengths=key_lengths, out=out, scale=scale)
    assert any_tier or prep.plan.tier == "coop", f"{what}: planned {prep.plan.describe()}"
    y = drvsoftmax.scaled_masked_softmax(x, mask, scale=scale, causal=causal, key_lengths=key_lengths, out=out)
    assert y is out
    torch.cuda.synchronize()
    got = _np(y)
    assert_matches(got, ref, dt, what)
    hidden = np.broadcast_to(_reference.hidden_positions(x.shape, mnp, causal, knp), x.shape)
    assert np.all(got[hidden] == 0), f"{what}: hidden positions are not exactly 0"
    if not np.isnan(ref).any():
        visible = ~np.all(ref == 0, axis=-1)
        sums = got.sum(-1, dtype=np.float64)
        tol = {"float16": 1e-2, "bfloat16": 3e-2, "float32": 1e-4}[dt] * max(1.0, np.sqrt(x.shape[-1]) / 16)
        assert np.all(np.abs(sums[visible] - 1) < tol), f"{what}: rows do not sum to 1"
        assert np.all(sums[~visible] == 0)
    return prep.plan


def _same_bits(a, b):
    """Bit for bit (NaN included, which torch.equal calls unequal)."""
    it = {2: torch.int16, 4: torch.int32}[a.element_size()]
    return torch.equal(a.contiguous().view(it), b.contiguous().view(it))


def _check_backward(dy, y, *, scale=0.5, what="", out=None, any_tier=False):
    dt = str(y.dtype).replace("torch.", "")
    ynp, dynp = _np(y), _np(dy)
    ref = _reference.softmax_backward(dynp, ynp, scale)
    in_place = out is not None
    if out is None:
        out = torch.full(y.shape, float("nan"), dtype=y.dtype, device="cuda")
    prep = _bwd_prepared(dy, y, out)
    assert any_tier or prep.plan.tier == "coop", f"{what}: planned {prep.plan.describe()}"
    dy_before, y_before = dy.clone(), y.clone()
    dx = drvsoftmax.scaled_masked_softmax_backward(dy, y, scale=scale, out=out)
    torch.cuda.synchronize()
    got = _np(dx)
    assert_backward_matches(got, dynp, ynp, ref, scale, dt, what)
    if not in_place:
        assert _same_bits(dy, dy_before) and _same_bits(y, y_before), f"{what}: dy and y must not be written"
    return prep.plan


def _planned(dtype: str, sk: int, backward: bool) -> _plan.LaunchPlan:
    if backward:
        return _plan.plan_backward(2, sk, dtype, True, True, _caps())
    return _plan.plan_forward(2, sk, dtype, "none", True, True, _caps())


def _boundary_sks(dtype: str, backward: bool, top: int = 2**18) -> list[tuple[int, _plan.LaunchPlan]]:
    """Row lengths (up to `top`) around every change of launch shape of the coop tier on
    this device (blocks per row, chunks per thread, register variant; the register tier
    before it), each with the plan it gets: just below, at and one past each change."""
    n = 16 // ITEM[dtype]

    def key(c):
        p = _planned(dtype, c * n, backward)
        return p.tier, p.kernel, p.coop, p.nch

    last = 2048 if ITEM[dtype] == 2 else 4096  # the register tier's last row, in chunks
    changes, c, prev = [last], last + 1, key(last + 1)
    while prev[0] == "coop" and c * n < top:
        c += 1024
        cur = key(c)
        if cur != prev:
            lo, hi = c - 1024, c  # the change lies in (lo, hi]
            while hi - lo > 1:
                mid = (lo + hi) // 2
                lo, hi = (mid, hi) if key(mid) == prev else (lo, mid)
            changes.append(lo)
        prev = cur
    out = []
    for chunks in changes:
        for sk in (chunks * n - 1, chunks * n, chunks * n + 1):
            p = _planned(dtype, sk, backward)
            if p.tier == "coop" and sk <= top:
                out.append((sk, p))
    return out


# ----------------------------------------------------------------------------------
# Forward


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_forward_around_every_block_count_boundary(dtype):
    """Rows just below, at and beyond each change of blocks per row, chunks per thread or
    register variant up to 2^18 keys, odd lengths among them; then a few longer rows."""
    cases = _boundary_sks(dtype, False)
    assert len({p.coop for _, p in cases}) >= 3, [(sk, p.kernel, p.coop) for sk, p in cases]
    for sk, p in cases:
        x = _rand((2, sk), DTYPES[dtype])
        _check_forward(x, scale=0.37, what=f"{dtype} Sk={sk} ({p.kernel}, {p.coop} x {p.nch})", any_tier=True)
    for sk in (16385, 16393, 20001, 40000, 65537, 99999, 524289, 2**20 + 3):
        x = _rand((3, sk), DTYPES[dtype])
        _check_forward(x, scale=-0.6, what=f"{dtype} Sk={sk}")


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_forward_register_variant(dtype):
    """Rows whose slices would leave one block per SM take CLUSTER_REG chunks per thread in
    registers (found by the planner on this device; skipped where no row up to 2^23 does)."""
    for sk in (2**21, 3 * 2**20, 2**22, 2**23):
        p = _planned(dtype, sk, False)
        if p.tier == "coop" and p.kernel.endswith(f", {_plan.CLUSTER_REG}>"):
            break
    else:
        pytest.skip("no register variant planned on this device")
    x = _rand((1, sk), DTYPES[dtype])
    _check_forward(x, scale=0.5, what=f"{dtype} Sk={sk} register variant")


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_forward_many_waves(dtype):
    """More rows than groups in flight: every block runs several waves, the last one partly
    past the last row."""
    sk = 40003
    many = torch.empty(sk, device="cuda", dtype=DTYPES[dtype]).as_strided((100000, sk), (0, 1))
    prep = _fwd_prepared(many)  # (rows enough to fill the device: its groups are what the device holds)
    assert prep.plan.tier == "coop"
    groups = prep.coop[1]
    assert 0 < groups < 100000
    rows = 3 * groups + 5
    x = torch.randn((rows, sk), device="cuda", dtype=DTYPES[dtype]) * 2
    plan = _fwd_prepared(x).plan
    assert plan.tier == "coop" and plan.grid // plan.coop < rows, plan.describe()
    y = torch.full_like(x, float("nan"))
    drvsoftmax.scaled_masked_softmax(x, scale=0.5, out=y)
    torch.cuda.synchronize()
    assert not torch.isnan(y).any(), "an element was not written"
    idx = torch.cat([torch.arange(0, rows, 7, device="cuda"), torch.tensor([rows - 1], device="cuda")])
    ref = torch.softmax(x[idx].double() * 0.5, -1)
    assert_matches(_np(y[idx].float()), ref.cpu().numpy(), dtype, "waves")


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("sk", [16385, 65536, 200003])
@pytest.mark.parametrize("kind", LONG_ROW_MASK_KINDS)
def test_forward_masks(dtype, sk, kind):
    b, h, q = 2, 2, 2
    x = _rand((b, h, q, sk), DTYPES[dtype])
    m = long_row_mask(kind, b, q, sk, DTYPES[dtype], _gen)
    # 8-byte masks on rows of 16385 keys: no coop shape leaves every block a chunk of the row
    short = kind in ("int64_11qk", "add_f64_qk") and sk == 16385
    _check_forward(x, m, scale=0.5, what=f"{dtype} Sk={sk} mask {kind}", any_tier=short)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("sq,sk", [(3, 40000), (5, 65536), (2, 262145)])
def test_forward_causal(dtype, sq, sk):
    x = _rand((2, 1, sq, sk), DTYPES[dtype])
    _check_forward(x, causal=True, scale=0.5, what=f"{dtype} causal {sq}x{sk}")


@pytest.mark.parametrize("kl_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("sk", [20000, 65536, 131075])
def test_forward_key_lengths(kl_dtype, sk):
    x = _rand((5, 1, 2, sk), torch.float16)
    # 0, 1, a length inside the first block's slice, past it, > Sk (all legal)
    kl = torch.tensor([0, 1, 3000, sk - 7, sk + 10], dtype=kl_dtype, device="cuda")
    _check_forward(x, key_lengths=kl, what=f"key_lengths Sk={sk}")


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_forward_every_source_together(dtype):
    b, h, q, sk = 3, 2, 3, 70001
    x = _rand((b, h, q, sk), DTYPES[dtype])
    m = torch.from_numpy(_gen.random((b, 1, q, sk)) < 0.3).cuda()
    kl = torch.tensor([sk, sk // 2, 0], dtype=torch.int64, device="cuda")
    _check_forward(x, m, scale=-0.8, causal=True, key_lengths=kl, what=f"{dtype} all sources")


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("sk", [16385, 40000, 262144])
def test_forward_nonfinite_and_hidden_rows(dtype, sk):
    x = _rand((1, 1, 7, sk), DTYPES[dtype])
    x[0, 0, 0, sk // 2 + 3] = float("nan")  # NaN row (the NaN in a later block's slice)
    x[0, 0, 1, sk - 1] = float("inf")  # +inf row: NaN throughout
    x[0, 0, 2, :] = float("-inf")  # every score -inf: all zeros
    x[0, 0, 3, sk - 1] = float("-inf")  # one -inf key: hidden
    m = torch.zeros((1, 1, 7, sk), dtype=torch.bool, device="cuda")
    m[0, 0, 4, :] = True  # fully masked row: zeros
    m[0, 0, 5, 0] = True
    x[0, 0, 5, 0] = float("nan")  # NaN under a boolean mask is hidden, not NaN
    m[0, 0, 6, : sk - 1] = True  # only the last key visible: 1 there
    _check_forward(x, m, what=f"{dtype} nonfinite Sk={sk}")


@pytest.mark.parametrize("sk", [20000, 65537])
def test_forward_strided_and_unaligned_rows(sk):
    base = _rand((2, 3, 2 * sk + 8), torch.float16)
    views = {
        "rows off the 16-byte grid": base[..., 1 : 1 + sk],
        "slice": base[:, ::2, 4 : 4 + sk],
        "last_dim_stride2": base[..., : 2 * sk : 2],
        "expanded_rows": base[:1, :1, :sk].expand(2, 3, sk),
    }
    for name, v in views.items():
        _check_forward(v, scale=0.3, what=f"{name} Sk={sk}")
    # out= a row-misaligned view of a bigger buffer, x aligned: element-wise accesses
    x = _rand((3, sk), torch.float32)
    buf = torch.full((3 * sk + 1,), float("nan"), dtype=torch.float32, device="cuda")
    _check_forward(x, scale=0.3, out=buf[1:].view(3, sk), what=f"misaligned out Sk={sk}")
    # out= strided along the row (the pairs go to every other element)
    wide = torch.full((3, 2 * sk), float("nan"), dtype=torch.float32, device="cuda")
    _check_forward(x, scale=0.3, out=wide[:, ::2], what=f"strided out Sk={sk}")
    assert torch.isnan(wide[:, 1::2]).all(), "elements between the strided output's were written"


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("sk", [16387, 65536, 262147])
def test_forward_in_place(dtype, sk):
    """out=x: each block writes its pair over x elements it already holds on chip."""
    x = _rand((3, 2, sk), DTYPES[dtype])
    m = torch.from_numpy(_gen.random((1, 2, sk)) < 0.2).cuda()
    ref = _reference.softmax_forward(_np(x), _np(m), 0.7, False, None)
    assert _fwd_prepared(x, m, out=x, scale=0.7).plan.tier == "coop"
    y = drvsoftmax.scaled_masked_softmax(x, m, scale=0.7, out=x)
    torch.cuda.synchronize()
    assert y is x
    assert_matches(_np(x), ref, dtype, f"out=x Sk={sk}")
    # rows off the 16-byte grid, in place
    base = _rand((3, sk + 1), DTYPES[dtype])
    v = base[:, 1:]
    ref = _reference.softmax_forward(_np(v), None, 0.5, False, None)
    drvsoftmax.scaled_masked_softmax(v, scale=0.5, out=v)
    torch.cuda.synchronize()
    assert_matches(_np(v), ref, dtype, f"out=x unaligned Sk={sk}")


def test_forward_on_a_side_stream_and_in_a_cuda_graph():
    x = _rand((4, 50000), torch.bfloat16)
    assert _fwd_prepared(x, scale=0.25).plan.tier == "coop"
    ref = _reference.softmax_forward(_np(x), None, 0.25)
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        y = drvsoftmax.scaled_masked_softmax(x, scale=0.25)
    s.synchronize()
    assert_matches(_np(y), ref, "bfloat16", "side stream")
    out = torch.full_like(x, float("nan"))
    drvsoftmax.scaled_masked_softmax(x, scale=0.25, out=out)  # prepared (and loaded) before capture
    out.fill_(float("nan"))
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        drvsoftmax.scaled_masked_softmax(x, scale=0.25, out=out)
    g.replay()
    torch.cuda.synchronize()
    assert_matches(_np(out), ref, "bfloat16", "graph replay")
    out.fill_(float("nan"))
    g.replay()  # the barrier word left by the last replay starts the next
    torch.cuda.synchronize()
    assert_matches(_np(out), ref, "bfloat16", "second graph replay")


def test_fp32_rows_of_1m_keys_on_sm_90(monkeypatch):
    """fp32 rows of 2^20 keys fit no cluster of an H200: by default a cluster streams their
    forwards and their backwards, however few (measured faster than the coop, looped and
    split tiers); forced, the coop tier reads them once, forward and backward."""
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("needs sm_90+ (an H200: no cluster holds these rows there)")
    sk = 2**20
    monkeypatch.setattr(_plan, "FORCE_COOP", False)
    many = 4 * _caps().sm_count
    many_fwd = _plan.plan_forward(many, sk, "float32", "none", True, True, _caps())
    assert many_fwd.kernel == _plan.kernel_fwd_stream("float32", "none"), many_fwd  # streamed by a cluster
    many_bwd = _plan.plan_backward(many, sk, "float32", True, True, _caps())
    assert many_bwd.kernel == _plan.kernel_bwd_stream("float32"), many_bwd  # streamed too
    few_fwd = _plan.plan_forward(3, sk, "float32", "none", True, True, _caps())
    assert few_fwd.kernel == _plan.kernel_fwd_stream("float32", "none"), few_fwd
    few_bwd = _plan.plan_backward(3, sk, "float32", True, True, _caps())
    assert few_bwd.kernel == _plan.kernel_bwd_stream("float32"), few_bwd
    monkeypatch.setattr(_plan, "FORCE_COOP", True)
    _forget()
    x = _rand((3, sk), torch.float32)
    _check_forward(x, scale=0.6, what="fp32 Sk=1M")
    y = torch.softmax(_rand((3, sk), torch.float32), -1)
    _check_backward(_rand((3, sk), torch.float32, 1.0), y, what="fp32 Sk=1M backward")


def test_loop_tier_when_the_device_cannot_hold_a_row(monkeypatch):
    """A device that cannot hold G such blocks at once plans the looped tier."""
    dev = _dev()
    monkeypatch.setattr(dev, "coop_capacity", lambda *a: 1)
    x = _rand((2, 262147), torch.float16)
    prep = _fwd_prepared(x)
    assert prep.plan.tier == "loop" and prep.coop is None


def test_refused_cooperative_launch_falls_back_to_the_loop():
    """A cooperative launch the driver refuses as too large runs the looped tier instead
    (that launch and the later ones), with the same result."""
    x = _rand((3, 65536), torch.float16)
    y = torch.full_like(x, float("nan"))
    prep = _fwd_prepared(x, out=y)
    assert prep.plan.tier == "coop" and prep.fallback is not None and prep.fallback.tier == "loop"
    g = prep.coop[0]
    cap = _dev().coop_capacity(prep.plan.kernel, prep.plan.smem, prep.block)
    prep.coop = (g, min(cap // g + 1, _plan.COOP_MAX_GROUPS))  # one group more than fit at once
    stream = torch.cuda.current_stream().cuda_stream
    _core.launch(prep, x.data_ptr(), y.data_ptr(), 0, 0, stream)
    torch.cuda.synchronize()
    assert prep.coop is None and prep.plan.tier == "loop"
    assert_matches(_np(y), _reference.softmax_forward(_np(x), None, 1.0), "float16", "fallback")


# ----------------------------------------------------------------------------------
# Backward


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_backward_around_every_block_count_boundary(dtype):
    cases = _boundary_sks(dtype, True)
    assert len({p.coop for _, p in cases}) >= 3, [(sk, p.kernel, p.coop) for sk, p in cases]
    for sk, p in cases:
        y = torch.softmax(_rand((2, sk), torch.float32), -1).to(DTYPES[dtype])
        dy = _rand((2, sk), DTYPES[dtype], 1.0)
        _check_backward(dy, y, what=f"{dtype} Sk={sk} ({p.kernel}, {p.coop} x {p.nch})", any_tier=True)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("sk", [16385, 40001, 65536, 262144])
def test_backward_of_masked_causal_forward(dtype, sk):
    shape = (2, 1, 3, sk)
    x = _rand(shape, DTYPES[dtype])
    m = torch.from_numpy(_gen.random((2, 1, 3, sk)) < 0.3).cuda()
    m[0, 0, 0, :] = True  # a fully hidden row: y == 0, dx == 0
    y = drvsoftmax.scaled_masked_softmax(x, m, scale=0.5, causal=True)
    dy = _rand(shape, DTYPES[dtype], 1.0)
    _check_backward(dy, y, scale=0.5, what=f"{dtype} Sk={sk}")


def test_backward_many_waves():
    sk = 30001
    y1 = torch.softmax(_rand((1, sk), torch.float32), -1).half()
    prep = _bwd_prepared(y1, y1, y1.clone())
    assert prep.plan.tier == "coop"
    rows = 2 * prep.coop[1] + 3
    y = torch.softmax(torch.randn((rows, sk), device="cuda"), -1).half()
    dy = torch.randn((rows, sk), device="cuda").half()
    dx = torch.full_like(y, float("nan"))
    drvsoftmax.scaled_masked_softmax_backward(dy, y, scale=0.5, out=dx)
    torch.cuda.synchronize()
    assert not torch.isnan(dx).any(), "an element was not written"
    idx = torch.cat([torch.arange(0, rows, 5, device="cuda"), torch.tensor([rows - 1], device="cuda")])
    yd, dyd = y[idx].double(), dy[idx].double()
    ref = 0.5 * yd * (dyd - (dyd * yd).sum(-1, keepdim=True))
    err = (dx[idx].double() - ref).abs()
    assert (err <= 4e-3 * yd.abs() * (dyd.abs() + (dyd * yd).sum(-1, keepdim=True).abs()) * 0.5 + 1e-7).all()


def test_backward_strided_unaligned_and_in_place():
    sk = 30001
    base = torch.softmax(_rand((3, 2 * sk + 8), torch.float32), -1).to(torch.float16)
    dbase = _rand((3, 2 * sk + 8), torch.float16, 1.0)
    for name, (dy, y) in {
        "rows off the 16-byte grid": (dbase[:, 1 : 1 + sk], base[:, 1 : 1 + sk]),
        "last_dim_stride2": (dbase[:, : 2 * sk : 2], base[:, : 2 * sk : 2]),
    }.items():
        _check_backward(dy, y, what=name)
    for dtype in DTYPES:
        y = torch.softmax(_rand((3, 65539), torch.float32), -1).to(DTYPES[dtype])
        dy = _rand((3, 65539), DTYPES[dtype], 1.0)
        _check_backward(dy, y, out=dy, what=f"{dtype} out=dy")


def test_backward_nan_rows():
    sk = 70000
    y = torch.softmax(_rand((3, sk), torch.float32), -1)
    dy = _rand((3, sk), torch.float32, 1.0)
    y[0, sk - 3] = float("nan")
    dy[1, 5] = float("inf")
    _check_backward(dy, y, what="nonfinite backward")
