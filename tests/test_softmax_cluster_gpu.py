"""The cluster tier (sm_90+) on a GPU against the float64 reference, on fresh random inputs.

Runs alone: `python -m pytest tests/test_softmax_cluster_gpu.py`.  Skips cleanly without
PyTorch, without a CUDA GPU, or on a GPU older than sm_90 (no thread-block clusters).
Every output is poisoned with NaN first, so an element no block writes shows up as a NaN
the reference does not have.  Each case first checks that the planner really sends it to
the cluster tier on this device (with the cluster size the case is about).
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
from helpers import LONG_ROW_MASK_KINDS, assert_backward_matches, assert_matches, long_row_mask, torch_cuda_available
from helpers import to_numpy as _np

import drvsoftmax
from drvsoftmax import _core, _driver, _plan, _reference

torch = pytest.importorskip("torch")


def _sm90() -> bool:
    return torch_cuda_available() and torch.cuda.get_device_capability() >= (9, 0)


pytestmark = pytest.mark.skipif(not _sm90(), reason="needs PyTorch with an sm_90+ CUDA GPU (thread-block clusters)")

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
ITEM = {"float16": 2, "bfloat16": 2, "float32": 4}
_gen = np.random.default_rng(20261130)


@functools.lru_cache(maxsize=1)
def _caps() -> _plan.DeviceCaps:
    return _driver.device(torch.cuda.current_device()).caps


def _rand(shape, dtype, scale=3.0):
    return torch.from_numpy(_gen.standard_normal(shape) * scale).to(dtype).cuda()


def _fwd_plan(x, mask=None, *, causal=False, key_lengths=None, out=None):
    def op(t):
        return _core.Operand(t.data_ptr(), str(t.dtype).replace("torch.", ""), tuple(t.shape), tuple(t.stride()))

    y = out if out is not None else x
    m = None
    if mask is not None:
        m = op(mask)
    k = op(key_lengths) if key_lengths is not None else None
    aligned = not ((x.data_ptr() | y.data_ptr()) & 15)
    return _core.forward_params(op(x), op(y), m, k, causal, 1.0, aligned, caps=_caps())[1]


def _bwd_plan(dy, y):
    def op(t):
        return _core.Operand(t.data_ptr(), str(t.dtype).replace("torch.", ""), tuple(t.shape), tuple(t.stride()))

    aligned = not ((dy.data_ptr() | y.data_ptr()) & 15)
    return _core.backward_params(op(dy), op(y), op(dy), 1.0, aligned, _caps())[1]


def _check_forward(x, mask=None, *, scale=1.0, causal=False, key_lengths=None, what="", cluster=None, any_tier=False):
    dt = str(x.dtype).replace("torch.", "")
    out = torch.full(x.shape, float("nan"), dtype=x.dtype, device=x.device)
    plan = _fwd_plan(x, mask, causal=causal, key_lengths=key_lengths, out=out)
    assert any_tier or plan.tier == "cluster", f"{what}: planned {plan.describe()}"
    if cluster is not None:
        assert plan.cluster == cluster, f"{what}: planned {plan.describe()}"
    y = drvsoftmax.scaled_masked_softmax(x, mask, scale=scale, causal=causal, key_lengths=key_lengths, out=out)
    assert y is out
    torch.cuda.synchronize()
    mnp = None if mask is None else _np(mask)
    knp = None if key_lengths is None else _np(key_lengths)
    ref = _reference.softmax_forward(_np(x), mnp, scale, causal, knp)
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
    return y


def _same_bits(a, b):
    """Bit for bit (NaN included, which torch.equal calls unequal)."""
    it = {2: torch.int16, 4: torch.int32}[a.element_size()]
    return torch.equal(a.contiguous().view(it), b.contiguous().view(it))


def _check_backward(dy, y, *, scale=0.5, what="", cluster=None, any_tier=False):
    dt = str(y.dtype).replace("torch.", "")
    plan = _bwd_plan(dy, y)
    assert any_tier or plan.tier == "cluster", f"{what}: planned {plan.describe()}"
    if cluster is not None:
        assert plan.cluster == cluster, f"{what}: planned {plan.describe()}"
    dy_before, y_before = dy.clone(), y.clone()
    out = torch.full(y.shape, float("nan"), dtype=y.dtype, device="cuda")
    dx = drvsoftmax.scaled_masked_softmax_backward(dy, y, scale=scale, out=out)
    torch.cuda.synchronize()
    ynp, dynp = _np(y), _np(dy)
    ref = _reference.softmax_backward(dynp, ynp, scale)
    got = _np(dx)
    assert_backward_matches(got, dynp, ynp, ref, scale, dt, what)
    assert _same_bits(dy, dy_before) and _same_bits(y, y_before), f"{what}: dy and y must not be written"


def _planned(dtype: str, sk: int, backward: bool, mask_kind: str = "none") -> _plan.LaunchPlan:
    if backward:
        return _plan.plan_backward(2, sk, dtype, True, True, _caps())
    return _plan.plan_forward(2, sk, dtype, mask_kind, True, True, _caps())


def _boundary_sks(dtype: str, backward: bool, mask_kind: str = "none") -> list[tuple[int, _plan.LaunchPlan]]:
    """Row lengths around every change of launch shape of the cluster tier on this device
    (cluster size, chunks per thread, register variant; the register tier before it and the
    loop, split or streamed forward after it), each with the plan it gets: just below, at and
    one past each change.  The scan ends at the first row the cluster tier does not hold: a
    streamed plan (tier "cluster" too) takes rows of any length."""
    n = 16 // ITEM[dtype]

    def key(c):
        p = _planned(dtype, c * n, backward, mask_kind)
        return p.tier, p.kernel, p.cluster, p.nch

    last = 2048 if ITEM[dtype] == 2 else 4096  # the register tier's last row, in chunks
    changes, c, prev = [last], last + 1, key(last + 1)
    while prev[0] == "cluster" and "stream" not in prev[1]:
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
            p = _planned(dtype, sk, backward, mask_kind)
            if p.tier == "cluster":
                out.append((sk, p))
    return out


# ----------------------------------------------------------------------------------
# Forward


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_forward_around_every_cluster_size_boundary(dtype):
    """Rows just below, at and beyond each change of cluster size, chunks per thread or
    register variant, odd lengths among them."""
    cases = _boundary_sks(dtype, False)
    assert {p.cluster for _, p in cases} == {2, 4, 8, 16}, [(sk, p.kernel, p.cluster) for sk, p in cases]
    assert any(p.kernel.endswith(", 4>") for _, p in cases)  # the register variant
    for sk, p in cases:
        x = _rand((2, sk), DTYPES[dtype])
        # (the plan of these x may differ from the probe's where odd rows touch one chunk
        # more: at the top of the tier, the looped tier)
        _check_forward(x, scale=0.37, what=f"{dtype} Sk={sk} ({p.kernel}, {p.cluster} x {p.nch})", any_tier=True)
    for sk in (16385, 16393, 20001, 40000, 65537, 99999):
        x = _rand((3, sk), DTYPES[dtype])
        _check_forward(x, scale=-0.6, what=f"{dtype} Sk={sk}")


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_forward_with_a_bool_mask_around_every_cluster_size_boundary(dtype):
    """As above with a bool mask of every row's own (the register variant holds 4 chunks of
    x and of the mask per thread in registers, the rest of the slice in shared memory), up
    to the last row the tier takes; about 20% of the keys hidden."""
    cases = _boundary_sks(dtype, False, "hide1")
    assert {p.cluster for _, p in cases} == {2, 4, 8, 16}, [(sk, p.kernel, p.cluster) for sk, p in cases]
    assert all(p.kernel.endswith(", 4>") for _, p in cases), [p.kernel for _, p in cases]
    for sk, p in cases:
        x = _rand((2, sk), DTYPES[dtype])
        m = torch.from_numpy(_gen.random((2, sk)) < 0.2).cuda()
        _check_forward(
            x, m, scale=0.37, what=f"{dtype} Sk={sk} bool ({p.kernel}, {p.cluster} x {p.nch})", any_tier=True
        )


# Logits past SMX_FOLD_MAX (scale 30 on std 40) in 16-bit rows only; fp32 rows are never
# folded and take x of std 4 (logits of tens): fp32's own rounding of x * scale (2^-24 of
# the logit, which exp turns into that relative error of the term) exceeds fp32's tolerance
# at logits of a few hundred (on the H200, one term of 196680 did at scale 2.5 on std 40).
@pytest.mark.parametrize(
    "dtype,scale",
    [(d, s) for d in DTYPES for s in (2.5, 30.0, 1e-3, 0.0, -1.3, 1e38, 3e38) if not (s == 30.0 and ITEM[d] == 4)],
)
def test_forward_interior_at_every_kind_of_scale(dtype, scale):
    """The interior of 16-bit rows folds the scale and 1 / sum into the exponent where
    0 < scale * log2e < inf (with a bool mask too): large logits (std 40), logits whose max
    passes SMX_FOLD_MAX (scale 30, 16-bit: the exact terms), a zero, a
    negative, an overflowing x * scale (1e38: the rows turn NaN as x * scale turns +inf in
    fp32) and an overflowing scale * log2e (3e38); whole steps hidden, a row with nothing
    visible, rows off the 16-byte grid (their first and last steps take the general path)."""
    sk = 65536 + 24
    std = 40.0 if ITEM[dtype] == 2 else 4.0
    x = _rand((4, sk), DTYPES[dtype], scale=std)
    if scale > 1e30:
        x[3] = 0.0  # one row that no such scale overflows: uniform
    m = torch.from_numpy(_gen.random((4, sk)) < 0.2)
    m[:, 0] = False
    m[1, 1000:9000] = True  # whole steps of every thread hidden
    m[2, :] = True  # nothing visible: zeros
    m = m.cuda()
    what = f"{dtype} scale={scale}"
    if scale > 1e30:
        for mm in (m, None):
            y = drvsoftmax.scaled_masked_softmax(x, mm, scale=scale)
            ref = _reference.softmax_forward(_np(x), None if mm is None else _np(mm), scale, False, None)
            assert np.isnan(ref).any() and not np.isnan(ref).all()
            assert_matches(_np(y), ref, dtype, what)
        return
    _check_forward(x, m, scale=scale, what=what + " bool")
    _check_forward(x, scale=scale, what=what)
    off = _rand((3, sk + 1), DTYPES[dtype], scale=std)[:, 1:]  # rows off the grid
    _check_forward(off, scale=scale, what=what + " off the grid", any_tier=True)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("sk", [16385, 65536, 200003])
@pytest.mark.parametrize("kind", LONG_ROW_MASK_KINDS)
def test_forward_masks(dtype, sk, kind):
    b, h, q = 2, 2, 2
    x = _rand((b, h, q, sk), DTYPES[dtype])
    m = long_row_mask(kind, b, q, sk, DTYPES[dtype], _gen)
    # 8-byte masks on rows of 200003 keys: clusters of 16 beyond CLUSTER_LOOP_SMEM, the looped tier
    wide = kind in ("int64_11qk", "add_f64_qk") and sk > 100000
    _check_forward(x, m, scale=0.5, what=f"{dtype} Sk={sk} mask {kind}", any_tier=wide)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("mdtype", [torch.int8, torch.uint8])
def test_forward_one_byte_masks_hide_every_nonzero_value(dtype, mdtype):
    """Any nonzero byte hides, whatever its bits (the folded interior tests them four to a
    word): 1, 2, 0x7f, 0x80 and 0xff, beside zeros, in a row of whole steps."""
    b, q, sk = 2, 3, 65536
    x = _rand((b, 1, q, sk), DTYPES[dtype])
    pick = _gen.integers(0, 6, (b, 1, q, sk))
    vals = np.array([0, 1, 2, 0x7F, 0x80, 0xFF], dtype=np.uint8)[pick]
    vals[..., 0] = 0
    m = torch.from_numpy(vals.view(np.int8) if mdtype == torch.int8 else vals).cuda()
    _check_forward(x, m, scale=0.9, what=f"{dtype} {mdtype} mask")
    _check_forward(x, m[:, :, :1], scale=0.9, what=f"{dtype} {mdtype} mask, one row for every query")


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("sq,sk", [(3, 40000), (5, 65536), (2, 262145)])
def test_forward_causal(dtype, sq, sk):
    x = _rand((2, 1, sq, sk), DTYPES[dtype])
    _check_forward(x, causal=True, scale=0.5, what=f"{dtype} causal {sq}x{sk}")


@pytest.mark.parametrize("kl_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("sk", [20000, 65536, 131075])
def test_forward_key_lengths(kl_dtype, sk):
    x = _rand((5, 1, 2, sk), torch.float16)
    # 0, 1, a length inside one block's slice, past the first block, > Sk (all legal)
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
    out = buf[1:].view(3, sk)
    drvsoftmax.scaled_masked_softmax(x, scale=0.3, out=out)
    torch.cuda.synchronize()
    assert_matches(_np(out), _reference.softmax_forward(_np(x), None, 0.3), "float32", "misaligned out")


@pytest.mark.parametrize(
    "dtype,sk,mask",
    [("float16", 2**20, False), ("bfloat16", 2**20, True), ("float16", 2**20, "own"), ("float32", 262144, True)],
)
def test_forward_longest_targets(dtype, sk, mask):
    """1M-key 16-bit rows (clusters of 16: the non-portable size; with a bool mask, a
    padding mask or one of every row's own, the x-held kernel, the mask read from global
    memory) and 256K fp32 rows."""
    x = _rand((3, sk), DTYPES[dtype])
    m = torch.from_numpy(_gen.random((3 if mask == "own" else 1, sk)) < 0.3).cuda() if mask else None
    _check_forward(x, m, scale=0.7, what=f"{dtype} Sk={sk} mask={mask}", cluster=16)
    assert ("cluster_xs" in _fwd_plan(x, m).kernel) == (bool(mask) and ITEM[dtype] == 2)


@pytest.fixture(params=[True, False], ids=["x-held", "mask-held"])
def xs(request, monkeypatch):
    """The 16-bit forward with a bool mask in the cluster tier, by `_plan.CLUSTER_XS`: the
    x-held kernel (the mask read from global memory) wherever a cluster holds x, and the
    kernel that holds the mask beside x (the one planned for these rows)."""
    monkeypatch.setattr(_plan, "CLUSTER_XS", request.param)
    _core._cache.clear()
    yield request.param
    _core._cache.clear()


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_forward_bool_mask_both_cluster_kernels(dtype, xs):
    """Both 16-bit cluster kernels of a bool mask: a padding mask `[1, Sk]` read by every
    row, a mask of every row's own, a strided mask (read element-wise), rows off the
    16-byte grid (edge chunks), causal rows and key_lengths (steps past the visible
    prefix), a scale the fold does not take (the exact path reads the mask again in
    STORE) and logits past SMX_FOLD_MAX (PAIR folds, STORE does not)."""
    sk = 65536 + 40
    t = DTYPES[dtype]
    kern = "smx_fwd_cluster_xs" if xs else "smx_fwd_cluster<"
    x = _rand((3, sk), t)
    pad = torch.from_numpy(_gen.random((1, sk)) < 0.25).cuda()
    own = torch.from_numpy(_gen.random((3, sk)) < 0.25).cuda()
    own[1, 5000:20000] = True
    assert _fwd_plan(x, own).kernel.startswith(kern)
    for what, m in (("padding", pad), ("own", own)):
        for scale in (0.6, -0.8, 0.0):
            _check_forward(x, m, scale=scale, what=f"{dtype} {what} scale={scale}")
    big = _rand((3, sk), t, scale=40.0)
    _check_forward(big, own, scale=30.0, what=f"{dtype} max past SMX_FOLD_MAX")
    wide = torch.from_numpy(_gen.random((3, 2 * sk)) < 0.25).cuda()
    _check_forward(x, wide[:, ::2], scale=0.6, what=f"{dtype} strided mask")
    off = _rand((3, sk + 1), t)[:, 1:]
    _check_forward(off, own, scale=0.6, what=f"{dtype} rows off the grid", any_tier=True)
    xq = _rand((1, 1, 3, sk), t)
    _check_forward(xq, own.view(1, 1, 3, sk), scale=0.6, causal=True, what=f"{dtype} causal")
    kl = torch.tensor([sk, 33333, 7], dtype=torch.int32, device="cuda")
    _check_forward(x, pad, scale=0.6, key_lengths=kl, what=f"{dtype} key_lengths")


def test_forward_many_clusters_cover_every_row():
    rows, sk = 2000, 65536
    x = torch.randn((rows, sk), device="cuda", dtype=torch.float16)
    assert _fwd_plan(x).tier == "cluster"
    y = torch.full_like(x, float("nan"))
    drvsoftmax.scaled_masked_softmax(x, scale=0.5, out=y)
    idx = torch.cat([torch.arange(0, rows, 37, device="cuda"), torch.tensor([rows - 1], device="cuda")])
    ref = torch.softmax(x[idx].double() * 0.5, -1)
    assert_matches(y[idx].float().cpu().numpy(), ref.cpu().numpy(), "float16", "many clusters")
    assert not torch.isnan(y).any()


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_rows_that_differ_in_every_way_in_one_launch(dtype):
    """Rows of one launch that differ in alignment (a strided view whose rows start at every
    offset from the 16-byte grid), mask, key lengths, causal visibility and non-finite
    values; forward and backward."""
    rows, sk = 7, 40003
    base = _rand((rows, sk + 3), DTYPES[dtype])
    x = base[:, 1 : sk + 1]
    mask = torch.from_numpy(_gen.random((rows, sk)) < 0.3).cuda()
    mask[3, :] = True
    kl = torch.tensor([sk, 5, 20000, sk - 1, 1, 0, 33333], device="cuda", dtype=torch.int32)
    _check_forward(x, mask, scale=0.7, what=f"{dtype} masked")
    _check_forward(x.reshape(1, rows, sk), causal=True, key_lengths=kl[:1], what=f"{dtype} causal")
    _check_forward(x.reshape(rows, 1, sk), key_lengths=kl, what=f"{dtype} key lengths")
    x[2, 100:300] = float("inf")  # rows of NaN (a row whose scores hold +inf or NaN is all NaN)
    x[5, 7] = float("nan")
    x[4, :] = float("-inf")  # zeros
    _check_forward(x, what=f"{dtype} non-finite")
    y = torch.softmax(_rand((rows, sk), torch.float32), -1).to(DTYPES[dtype])
    _check_backward(_rand((rows, sk), DTYPES[dtype]), y, what=f"{dtype} backward")
    _check_backward(_rand((rows, sk + 3), DTYPES[dtype])[:, 2 : sk + 2], y, what=f"{dtype} backward, unaligned dy")


def test_forward_on_a_side_stream_and_in_a_cuda_graph():
    x = _rand((4, 50000), torch.bfloat16)
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


def test_loop_tier_when_clusters_cannot_run(monkeypatch):
    """A device whose clusters of that size cannot be resident plans the looped tier."""
    dev = _driver.device(torch.cuda.current_device())
    monkeypatch.setattr(dev, "cluster_ready", lambda *a: False)
    x = _rand((2, 40003), torch.float16)
    aligned = not (x.data_ptr() & 15)
    xo = _core.Operand(x.data_ptr(), "float16", tuple(x.shape), tuple(x.stride()))
    prep = _core.prepare_forward(dev, xo, xo, None, None, False, 1.0, aligned)
    assert prep.plan.tier == "loop" and prep.cluster is None


# ----------------------------------------------------------------------------------
# Backward


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_backward_around_every_cluster_size_boundary(dtype):
    cases = _boundary_sks(dtype, True)
    assert {p.cluster for _, p in cases} >= {4, 8, 16}
    assert any(p.kernel.endswith(", 4>") for _, p in cases)  # the register variant
    for sk, p in cases:
        y = torch.softmax(_rand((2, sk), torch.float32), -1).to(DTYPES[dtype])
        dy = _rand((2, sk), DTYPES[dtype], 1.0)
        _check_backward(dy, y, what=f"{dtype} Sk={sk} ({p.kernel}, {p.cluster} x {p.nch})", any_tier=True)


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


def test_backward_strided_and_unaligned():
    sk = 30001
    base = torch.softmax(_rand((3, 2 * sk + 8), torch.float32), -1).to(torch.float16)
    dbase = _rand((3, 2 * sk + 8), torch.float16, 1.0)
    for name, (dy, y) in {
        "rows off the 16-byte grid": (dbase[:, 1 : 1 + sk], base[:, 1 : 1 + sk]),
        "last_dim_stride2": (dbase[:, : 2 * sk : 2], base[:, : 2 * sk : 2]),
    }.items():
        _check_backward(dy, y, what=name)


def test_backward_nan_rows():
    sk = 70000
    y = torch.softmax(_rand((3, sk), torch.float32), -1)
    dy = _rand((3, sk), torch.float32, 1.0)
    y[0, sk - 3] = float("nan")
    dy[1, 5] = float("inf")
    _check_backward(dy, y, what="nonfinite backward")
