"""The fused kernels on a GPU against the float64 reference, on fresh random inputs.

Skips cleanly where there is no CUDA GPU.  Every output is poisoned with NaN first, so an
element the kernel fails to write shows up as a NaN the reference does not have.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import TOLS, assert_backward_matches, assert_matches
from helpers import requires_torch_cuda as requires_cuda
from helpers import to_numpy as _np

import drvsoftmax
from drvsoftmax import _reference

torch = pytest.importorskip("torch")
pytestmark = requires_cuda

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
# Row lengths at the planner's boundaries (16-byte chunks per row C: 8 16-bit or 4 fp32
# elements): 1 element and odd sizes; C = 64 (512 / 256) +-1, the end of 2 rows x 2
# chunks per thread; C = 512 (4096 / 2048) +-1, where a row spans several warps;
# C = 2048 (16384 / 8192) +-1, the end of 8 chunks per thread (16-bit: of the register
# tier); fp32 16384 +-1; the looped tier beyond.  Odd lengths make rows that start off a
# 16-byte boundary (one chunk more per row, first and last chunk element-wise).
SKS = [1, 2, 3, 15, 16, 17, 31, 32, 33, 127, 255, 256, 257, 511, 512, 513, 1000, 1023, 2047, 2048, 2049]
SKS += [4095, 4096, 4097, 8191, 8192, 8193, 16383, 16384, 16385, 32769, 65536]
MASKS = [
    "none",
    "bool_b1qk",
    "uint8_11qk",
    "int8_qk",
    "bool_b11k",
    "int64_bhqk",
    "add_own_b1qk",
    "add_f32_qk",
    "add_f16_b11k",
    "add_bf16_11qk",
    "add_f64_bhqk",
]

_gen = np.random.default_rng(20261129)


def _shape_for(sk: int):
    # Enough rows to fill several blocks at short lengths, few at long ones.
    if sk <= 128:
        return (2, 3, 7, sk)
    if sk <= 4097:
        return (2, 2, 3, sk)
    return (1, 2, 2, sk)


def _make_mask(kind: str, shape, dtype):
    if kind == "none":
        return None
    b, h, q, k = shape
    dims = {"b1qk": (b, 1, q, k), "11qk": (1, 1, q, k), "qk": (q, k), "b11k": (b, 1, 1, k), "bhqk": (b, h, q, k)}
    mshape = dims[kind.rsplit("_", 1)[1]]
    if kind.startswith("add"):
        mdt = {"own": dtype, "f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16, "f64": torch.float64}[
            kind.split("_")[1]
        ]
        m = torch.from_numpy(_gen.standard_normal(mshape)).to(mdt)
        hide = torch.from_numpy(_gen.random(mshape) < 0.2)
        return m.masked_fill(hide, float("-inf")).cuda()
    mdt = {"bool": torch.bool, "uint8": torch.uint8, "int8": torch.int8, "int64": torch.int64}[kind.split("_")[0]]
    hide = _gen.random(mshape) < 0.3
    vals = _gen.integers(1, 5, mshape) * hide
    return torch.from_numpy(vals).to(mdt).cuda()


def _rand(shape, dtype, scale=3.0):
    return (torch.from_numpy(_gen.standard_normal(shape) * scale)).to(dtype).cuda()


def _check_forward(x, mask=None, *, scale=1.0, causal=False, key_lengths=None, what="", rounded_scores=False):
    """`rounded_scores`: the reference takes x * scale rounded to x's dtype (as torch.softmax(x * scale))."""
    dt = str(x.dtype).replace("torch.", "")
    out = torch.full(x.shape, float("nan"), dtype=x.dtype, device=x.device)
    y = drvsoftmax.scaled_masked_softmax(x, mask, scale=scale, causal=causal, key_lengths=key_lengths, out=out)
    assert y is out
    torch.cuda.synchronize()
    ref_x, ref_scale = (_np(x * scale), 1.0) if rounded_scores else (_np(x), scale)
    ref = _reference.softmax_forward(
        ref_x, None if mask is None else _np(mask), ref_scale, causal, None if key_lengths is None else _np(key_lengths)
    )
    got = _np(y)
    assert_matches(got, ref, dt, what)
    hidden = np.broadcast_to(
        _reference.hidden_positions(
            x.shape, None if mask is None else _np(mask), causal, None if key_lengths is None else _np(key_lengths)
        ),
        x.shape,
    )
    assert np.all(got[hidden] == 0), f"{what}: hidden positions are not exactly 0"
    visible_rows = ~np.all(np.broadcast_to(ref == 0, ref.shape), axis=-1)
    sums = got.sum(-1, dtype=np.float64)
    tol = {"float16": 1e-2, "bfloat16": 3e-2, "float32": 1e-4}[dt] * max(1.0, np.sqrt(x.shape[-1]) / 16)
    if not np.isnan(ref).any():
        assert np.all(np.abs(sums[visible_rows] - 1) < tol), f"{what}: rows do not sum to 1"
        assert np.all(sums[~visible_rows] == 0)
    return y


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("sk", SKS)
@pytest.mark.parametrize("mask", MASKS)
def test_forward_grid(dtype, sk, mask):
    shape = _shape_for(sk)
    x = _rand(shape, DTYPES[dtype])
    m = _make_mask(mask, shape, DTYPES[dtype])
    _check_forward(x, m, scale=0.37, what=f"{dtype} Sk={sk} mask={mask}")


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("sk", SKS)
def test_forward_all_sources_together(dtype, sk):
    b, h, q = (3, 2, 5) if sk <= 4097 else (2, 1, 3)
    x = _rand((b, h, q, sk), DTYPES[dtype])
    m = _make_mask("bool_b1qk", (b, h, q, sk), DTYPES[dtype])
    kl = torch.tensor([sk, max(1, sk // 2), 0][:b], dtype=torch.int64, device="cuda")
    _check_forward(x, m, scale=-0.8, causal=True, key_lengths=kl, what=f"{dtype} Sk={sk} all")


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("sk", [7, 128, 1000, 4096, 4097, 20000])
@pytest.mark.parametrize("mask", ["bool_b1qk", "uint8_11qk", "add_own_b1qk", "add_f32_qk", "bool_b11k"])
def test_mask_shared_by_heads_in_head_inner_row_order(monkeypatch, dtype, sk, mask):
    """With the reuse threshold at 0 every mask broadcast over a leading dim runs the rows
    sharing a mask row together (the order large masks take); every source still lands on
    its own row: mask, causal, key_lengths, strided x."""
    from drvsoftmax import _core
    from drvsoftmax import torch as tfront

    monkeypatch.setattr(_core, "MASK_REUSE_BYTES", 0)
    _core._cache.clear()
    tfront._prepared.clear()
    try:
        b, h, q = (3, 4, 5) if sk <= 4097 else (2, 3, 2)
        x = _rand((b, h, q, sk), DTYPES[dtype])
        m = _make_mask(mask, (b, h, q, sk), DTYPES[dtype])
        kl = torch.tensor([sk, max(1, sk // 3), 0][:b], dtype=torch.int32, device="cuda")
        what = f"{dtype} Sk={sk} {mask} head-inner"
        _check_forward(x, m, scale=0.6, what=what)
        _check_forward(x, m, scale=0.6, causal=True, key_lengths=kl, what=what + " causal klen")
        xt = _rand((b, q, h, sk), DTYPES[dtype]).transpose(1, 2)  # heads not outermost in memory
        _check_forward(xt, m, scale=0.6, causal=True, what=what + " strided")
    finally:
        _core._cache.clear()
        tfront._prepared.clear()


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("sk", [1032, 2048, 4096, 12000, 16376, 16384])
def test_lean_kernels_with_every_row_source(dtype, sk):
    """The lean kernels (16-bit, no mask, whole-chunk rows beyond 1024 keys: values computed
    afresh in each pass) with key_lengths (0, short, beyond Sk), a negative scale, scores far
    from 0, and rows holding NaN and +inf; causal rows take the 4-chunk kernels."""
    from drvsoftmax import _plan

    assert _plan.plan_forward(64, sk, dtype, "none", True, True).nch == _plan.LEAN_NCH
    assert _plan.plan_forward(64, sk, dtype, "none", True, True, causal=True).nch == 4
    b, h, q = 4, 2, 3
    x = _rand((b, h, q, sk), DTYPES[dtype])
    kl = torch.tensor([sk, max(1, sk // 3), 0, sk + 5], dtype=torch.int32, device="cuda")
    _check_forward(x, scale=0.7, what=f"lean {dtype} Sk={sk}")
    _check_forward(x, scale=-1.3, key_lengths=kl, what=f"lean {dtype} Sk={sk} klen")
    _check_forward(x, scale=0.9, causal=True, key_lengths=kl, what=f"{dtype} Sk={sk} causal klen")
    _check_forward(x + 200.0, scale=0.5, what=f"lean {dtype} Sk={sk} shifted")
    xs = x.clone()
    xs[0, 0, 0, sk // 2] = float("nan")
    xs[1, 1, 2, sk - 1] = float("inf")
    xs[2, 0, 1, :] = float("-inf")
    _check_forward(xs, scale=1.0, what=f"lean {dtype} Sk={sk} nan/inf rows")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("sk", [1000, 4097, 12000, 16383])
@pytest.mark.parametrize("scale", [2.5, 30.0, 1e-3, 0.0, -1.3, 1e38, 3e38])
def test_folded_rows_at_every_kind_of_scale(dtype, sk, scale):
    """16-bit rows without a mask fold (sm_80 to sm_100; the lean kernels at 12000 keys: the
    max over pairs of 16-bit values, one FMA in each term's and output's exponent; the edged
    lean ones at 4097 and 16383: the max and the sum's terms, hidden keys -inf in x's bits;
    the 4-chunk kernels at 1000 keys do not) where 0 < scale * log2e < inf, a thread's chunks
    are all visible (whole-chunk rows) and the max is below SMX_FOLD_MAX: logits of hundreds
    (std 40, scale 2.5), past SMX_FOLD_MAX (scale 30: the exact terms), a zero, a negative,
    an overflowing x * scale (1e38: such rows turn NaN) and an overflowing scale * log2e
    (3e38: the exact path); key_lengths that cut a row inside a thread's chunks (the fold
    and the exact path in one row), and rows of one very large logit beside small ones."""
    from drvsoftmax import _plan

    nch = _plan.plan_forward(64, sk, dtype, "none", True, True).nch
    assert nch == (4 if sk == 1000 else _plan.LEAN_NCH)
    x = _rand((4, 1, 3, sk), DTYPES[dtype], scale=40.0)
    what = f"{dtype} Sk={sk} ({nch} chunks per thread) scale={scale}"
    if scale > 1e30:
        x[3] = 0.0  # rows that no such scale overflows: uniform
        y = drvsoftmax.scaled_masked_softmax(x, scale=scale)
        ref = _reference.softmax_forward(_np(x), None, scale, False, None)
        assert np.isnan(ref).any() and not np.isnan(ref).all()
        assert_matches(_np(y), ref, dtype, what)
        return
    x[1, 0, 0, 17] = 1000.0  # one logit far above the others (the row's max alone)
    x[1, 0, 1, :] = -60000.0 if dtype == "float16" else -1e30
    x[1, 0, 1, sk - 3] = 5.0
    kl = torch.tensor([sk, sk // 2 + 1, 1, sk - 8], dtype=torch.int64, device="cuda")
    _check_forward(x, scale=scale, what=what)
    _check_forward(x, scale=scale, key_lengths=kl, what=what + " klen")


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("sk", [1000, 4097, 12000])
def test_rows_of_huge_equal_scores_are_uniform(dtype, sk):
    """Rows whose scores are all the same huge value (a fully padded row filled with
    finfo.min or -1e30 by the caller) at a scale that rounds x * scale: uniform, as
    torch.softmax makes them, in every kernel (the 4-chunk, edged lean and lean kernels at
    these lengths, for 16-bit x).  The passes that compute values again subtract the max
    from x * scale rounded (an FMA's unrounded product made these rows NaN or 0)."""
    big = float(torch.finfo(DTYPES[dtype]).min) if dtype != "float16" else -60000.0
    scale = 96**-0.5 if dtype != "float16" else 2.0e5
    x = _rand((2, 1, 3, sk), DTYPES[dtype])
    x[0, 0, 0, :] = big
    x[1, 0, 1, :] = -1e30 if dtype != "float16" else -65504.0
    x[1, 0, 2, : sk // 2] = big  # half of a row huge, the rest of it ordinary scores
    y = _check_forward(x, scale=scale, what=f"{dtype} Sk={sk} huge equal scores")
    got = _np(y)
    np.testing.assert_allclose(got[0, 0, 0], 1.0 / sk, rtol=TOLS[dtype]["rtol"])
    np.testing.assert_allclose(got[1, 0, 1], 1.0 / sk, rtol=TOLS[dtype]["rtol"])


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("sq,sk", [(1, 7), (4, 9), (9, 4), (3, 33000), (130, 130), (5, 1)])
def test_causal_bottom_right(dtype, sq, sk):
    x = _rand((2, 2, sq, sk), DTYPES[dtype])
    _check_forward(x, causal=True, scale=0.5, what=f"causal {sq}x{sk}")


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("sk", [520, 1024, 2048])
def test_causal_rows_ignore_what_they_hide(dtype, sk):
    """Square causal rows (every prefix length from 1 key to Sk) in the whole-chunk kernels
    of 4 chunks per thread, with NaN, +-inf and huge scores in every key past a row's
    prefix: the chunks wholly past it (16-bit: neither read nor converted) and the hidden
    keys of its partly visible chunk let none of it into the row; then key_lengths cut
    some rows shorter still."""
    from drvsoftmax import _plan

    assert _plan.plan_forward(64, sk, dtype, "none", True, True, causal=True).nch == 4
    x = _rand((2, 1, sk, sk), DTYPES[dtype])
    junk = torch.tensor([float("nan"), float("inf"), float("-inf"), 6.0e4], dtype=DTYPES[dtype], device="cuda")
    i = torch.arange(sk, device="cuda")
    past = i[None, :] > i[:, None]
    x = torch.where(past, junk[(i[:, None] + 3 * i[None, :]) % 4], x)
    _check_forward(x, scale=0.6, causal=True, what=f"{dtype} Sk={sk} causal, junk past the prefix")
    kl = torch.tensor([sk // 3 + 1, sk], dtype=torch.int32, device="cuda")
    _check_forward(x, scale=-0.9, causal=True, key_lengths=kl, what=f"{dtype} Sk={sk} causal klen, junk")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("sk", [200, 1000, 2048])
@pytest.mark.parametrize("top", [1000.0, 1100.0])
def test_terms_either_side_of_the_fold_limit(dtype, sk, top):
    """16-bit rows of the kernels that hold their values (2 and 4 chunks per thread; causal
    rows of 2048 keys) whose max lies just below SMX_FOLD_MAX (each term one FMA in its
    exponent) or just above it (exact terms), the scores spread over a few units so that many
    terms count: within the dtype's tolerance of float64, with and without a mask."""
    shape = (2, 3, 4, sk)
    x = (top + _rand(shape, torch.float32, scale=3.0)).to(DTYPES[dtype])
    what = f"{dtype} Sk={sk} max near {top}"
    _check_forward(x, scale=1.0, what=what)
    _check_forward(x, scale=1.0, causal=True, what=what + " causal")
    _check_forward(x, _make_mask("bool_b1qk", shape, DTYPES[dtype]), scale=1.0, what=what + " bool mask")
    _check_forward(x, _make_mask("add_own_b1qk", shape, DTYPES[dtype]), scale=1.0, what=what + " additive mask")


@pytest.mark.parametrize("kl_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("sk", [5, 300, 20000, 40000])
def test_key_lengths(kl_dtype, sk):
    x = _rand((4, 2, 3, sk), torch.float16)
    kl = torch.tensor([sk, 1, 0, sk + 10], dtype=kl_dtype, device="cuda")  # 0 and > Sk are legal
    _check_forward(x, key_lengths=kl, what=f"key_lengths Sk={sk}")


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("sk", [3, 64, 1000, 20000, 40000])
def test_nonfinite_rows(dtype, sk):
    x = _rand((1, 1, 6, sk), DTYPES[dtype])
    x[0, 0, 0, 1 % sk] = float("nan")  # NaN row
    x[0, 0, 1, 0] = float("inf")  # +inf row
    x[0, 0, 2, :] = float("-inf")  # every score -inf: hidden, zeros
    x[0, 0, 3, sk - 1] = float("-inf")  # one -inf key: hidden
    m = torch.zeros((1, 1, 6, sk), dtype=torch.bool, device="cuda")
    m[0, 0, 4, :] = True  # fully masked row
    m[0, 0, 5, 0] = True
    x[0, 0, 5, 0] = float("nan")  # NaN under a boolean mask is hidden, not NaN
    _check_forward(x, m, what=f"nonfinite Sk={sk}")


@pytest.mark.parametrize("scale", [0.0, -1.5, 1e-30, 1e4])
def test_scales(scale):
    """Scales of every kind on fp32 rows.  The scores are x * scale rounded to fp32 (as in
    torch.softmax(x * scale)): at scale 1e4 a score near 3e4 carries up to 0.001 of rounding,
    a factor e^0.001 on a term, beyond fp32's tolerance against the unrounded product, so
    the reference takes the rounded scores (against the unrounded ones the check failed on
    some draws of x)."""
    x = _rand((2, 3, 4, 77), torch.float32)
    _check_forward(x, scale=scale, rounded_scores=True, what=f"scale={scale}")


@pytest.mark.parametrize("sk", [33, 1024, 40000])
def test_strided_inputs_are_not_copied(sk):
    base = _rand((3, 4, 6, 2 * sk + 8), torch.float16)
    views = {
        "transpose": base[..., :sk].transpose(1, 2),
        "slice": base[:, 1:3, ::2, 4 : 4 + sk],
        "last_dim_stride2": base[..., : 2 * sk : 2],
        "expanded_rows": base[:1, :1, :1, :sk].expand(2, 3, 5, sk),
    }
    for name, v in views.items():
        _check_forward(v, _make_mask("bool_b11k", tuple(v.shape), v.dtype), scale=0.3, what=name)


@pytest.mark.parametrize("mdtype", [torch.bool, torch.float16, torch.float32, torch.int64])
@pytest.mark.parametrize("sk", [64, 1000, 40000])
def test_mask_rows_read_whole_or_element_wise(mdtype, sk):
    # Aligned contiguous masks are read a chunk at a time; a mask view starting one element
    # in, or with a stride along the row, is read element by element.  Same answers.
    x = _rand((2, 3, 4, sk), torch.float16)
    big = _make_mask("add_own_b1qk" if mdtype.is_floating_point else "bool_b1qk", (2, 3, 4, 2 * sk + 8), torch.float16)
    big = big.to(mdtype)
    for name, m in {
        "aligned": big[..., :sk].contiguous(),
        "offset": big[..., 1 : 1 + sk],
        "strided": big[..., : 2 * sk : 2],
    }.items():
        _check_forward(x, m, scale=0.5, what=f"mask {name} {mdtype} Sk={sk}")


@pytest.mark.parametrize(
    "dtype,rows,sk",
    [
        ("float16", 1_100_000, 256),  # 2 rows x 16 rows per block: > 65535 blocks
        ("float32", 140_000, 2048),  # a row of 256 threads, 2 rows per thread
        ("bfloat16", 70_000, 32769),  # looped tier, a row per block
    ],
)
def test_many_blocks_cover_every_row(dtype, rows, sk):
    # Many blocks (more than 65535 at short rows).  Checked against a float64
    # softmax on the GPU at rows spread over the whole tensor, the last one included.
    x = torch.randn((rows, sk), device="cuda", dtype=DTYPES[dtype])
    y = torch.full_like(x, float("nan"))
    drvsoftmax.scaled_masked_softmax(x, scale=0.5, out=y)
    idx = torch.cat([torch.arange(0, rows, max(1, rows // 97), device="cuda"), torch.tensor([rows - 1], device="cuda")])
    ref = torch.softmax(x[idx].double() * 0.5, -1)
    assert_matches(y[idx].float().cpu().numpy(), ref.cpu().numpy(), dtype, f"grid-stride {dtype} {rows}x{sk}")
    assert not torch.isnan(y).any()


def test_in_place_out_equals_x():
    for sk in (100, 40000):
        x = _rand((2, 2, 3, sk), torch.bfloat16)
        ref = _reference.softmax_forward(_np(x), None, 0.7, True, None)
        y = drvsoftmax.scaled_masked_softmax(x, scale=0.7, causal=True, out=x)
        assert y is x
        torch.cuda.synchronize()
        assert_matches(_np(x), ref, "bfloat16", f"out=x Sk={sk}")


def test_empty_inputs_launch_nothing():
    for shape in [(0, 3, 4, 5), (2, 0, 4, 5), (2, 3, 0, 5), (2, 3, 4, 0)]:
        x = torch.empty(shape, dtype=torch.float16, device="cuda")
        y = drvsoftmax.scaled_masked_softmax(x, scale=2.0, causal=True)
        assert y.shape == x.shape and y.dtype == x.dtype and y.is_cuda


def test_non_default_stream_and_explicit_stream_argument():
    x = _rand((4, 8, 128, 1000), torch.float16)
    ref = _reference.softmax_forward(_np(x), None, 0.25)
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        y = drvsoftmax.scaled_masked_softmax(x, scale=0.25)
    s.synchronize()
    assert_matches(_np(y), ref, "float16", "current stream")
    y2 = drvsoftmax.scaled_masked_softmax(x, scale=0.25, stream=s.cuda_stream)
    s.synchronize()
    assert_matches(_np(y2), ref, "float16", "stream=int")


@pytest.mark.parametrize("sk", [128, 1000, 40000])
def test_repeated_eager_calls_on_the_fast_path(sk):
    """A layout seen before launches from the eager fast path: contiguous x (also with an
    odd stride on a size-1 dim, which shares the entry), a strided x, causal, and on a
    non-default stream; every output poisoned first (freed NaN blocks the allocator hands
    out again) and checked against the reference."""
    import drvsoftmax.torch as dt

    base = _rand((1, 3, 5, sk), torch.bfloat16)
    odd = base.as_strided(base.shape, (7,) + base.stride()[1:])
    strided = _rand((1, 5, 3, sk), torch.bfloat16).transpose(1, 2)
    s = torch.cuda.Stream()
    for x, causal in ((base, False), (odd, False), (strided, False), (base, True), (strided, True)):
        ref = _reference.softmax_forward(_np(x), None, 0.6, causal)
        for i in range(3):
            for _ in range(4):  # freed blocks of NaN for torch.empty_like to take
                torch.full(x.shape, float("nan"), dtype=x.dtype, device="cuda")
            if i == 2:
                with torch.cuda.stream(s):
                    y = drvsoftmax.scaled_masked_softmax(x, scale=0.6, causal=causal)
                s.synchronize()
            else:
                y = dt.scaled_masked_softmax(x, scale=0.6, causal=causal)
                torch.cuda.synchronize()
            assert y.shape == x.shape and y.stride() == torch.empty_like(x).stride()
            assert_matches(_np(y), ref, "bfloat16", f"call {i} of Sk={sk} {tuple(x.stride())} causal={causal}")
    keys = [k for k in dt._fast if k[0] == base.shape or k[0] == strided.shape]
    assert len(keys) >= 4, "the fast path kept no entry for these layouts"


# ----------------------------------------------------------------------------------
# Backward


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("sk", SKS)
def test_backward_grid(dtype, sk):
    shape = _shape_for(sk)
    x = _rand(shape, DTYPES[dtype])
    m = _make_mask("bool_b1qk", shape, DTYPES[dtype])
    y = drvsoftmax.scaled_masked_softmax(x, m, scale=0.5, causal=True)
    dy = _rand(shape, DTYPES[dtype], 1.0)
    dy_before, y_before = dy.clone(), y.clone()
    out = torch.full(shape, float("nan"), dtype=DTYPES[dtype], device="cuda")
    dx = drvsoftmax.scaled_masked_softmax_backward(dy, y, scale=0.5, out=out)
    torch.cuda.synchronize()
    ref = _reference.softmax_backward(_np(dy), _np(y), 0.5)
    assert_backward_matches(_np(dx), _np(dy), _np(y), ref, 0.5, dtype, f"{dtype} Sk={sk}: backward")
    assert torch.equal(dy, dy_before) and torch.equal(y, y_before), "dy and y must not be written"


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("sk,gap", [(7, 3), (77, 5), (197, 3), (1001, 1), (4097, 7)])
def test_partial_chunks_leave_the_gaps_between_rows_alone(dtype, sk, gap):
    """Rows `gap` elements apart in memory and off the 16-byte grid: each row's partial
    first and last chunk is stored without its neighbours' bytes (16-byte accesses where
    whole, aligned 2/4/8-byte stores for the rest); the gaps keep their poison, forward and
    backward."""
    t = DTYPES[dtype]
    b, h, q = 2, 3, 5
    poison = 7.0

    def padded(fill=None):
        buf = torch.full((b, h, q, sk + gap), poison, dtype=t, device="cuda")
        if fill is not None:
            buf[..., :sk] = fill
        return buf, buf[..., :sk]

    _, x = padded(_rand((b, h, q, sk), t))
    ybuf, y = padded()
    got = drvsoftmax.scaled_masked_softmax(x, scale=0.7, out=y)
    assert got is y
    torch.cuda.synchronize()
    assert_matches(_np(y), _reference.softmax_forward(_np(x), None, 0.7, False, None), dtype, f"{dtype} Sk={sk} padded")
    assert torch.all(ybuf[..., sk:] == poison), "a forward store reached into the gap between rows"

    _, dy = padded(_rand((b, h, q, sk), t, 1.0))
    dxbuf, dx = padded()
    drvsoftmax.scaled_masked_softmax_backward(dy, y, scale=0.7, out=dx)
    torch.cuda.synchronize()
    ref = _reference.softmax_backward(_np(dy), _np(y), 0.7)
    assert_backward_matches(_np(dx), _np(dy), _np(y), ref, 0.7, dtype, f"{dtype} Sk={sk}: padded backward")
    assert torch.all(dxbuf[..., sk:] == poison), "a backward store reached into the gap between rows"


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_edged_rows_at_every_length_and_phase(dtype):
    """Rows that are not whole 16-byte chunks, without a mask: the edged path (a row's
    whole 16-byte blocks as chunks, the keys outside them one per lane) wherever the
    planner takes it, the general path elsewhere.  Every length to 300 keys and the
    planner's boundaries beyond, 18 rows each (odd lengths put the rows at every phase of
    the 16-byte grid); plain, causal with key_lengths, and rows holding NaN and +-inf."""
    t = DTYPES[dtype]
    item = torch.empty((), dtype=t).element_size()
    assert "edged rows" in drvsoftmax.explain((4, 4097 if item == 2 else 197), dtype)
    sks = list(range(1, 300)) + [511, 513, 1001, 2047, 2049, 4095, 4097, 8191, 8193, 12289, 16383]
    for sk in sks:
        x = _rand((2, 1, 9, sk), t)
        _check_forward(x, scale=0.7, what=f"{dtype} Sk={sk}")
        kl = torch.tensor([max(1, sk // 3), sk + 2], dtype=torch.int32, device="cuda")
        _check_forward(x, scale=-1.1, causal=True, key_lengths=kl, what=f"{dtype} Sk={sk} causal key_lengths")
        if sk in (77, 197, 4097):
            xs = x.clone()
            xs[0, 0, 1, 0] = float("nan")  # a head key
            xs[0, 0, 3, sk - 1] = float("inf")  # a tail key
            xs[1, 0, 4, sk // 2] = float("nan")  # a chunk key
            xs[1, 0, 6, :] = float("-inf")
            _check_forward(xs, scale=1.0, what=f"{dtype} Sk={sk} nan/inf rows")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("sk", [1100, 4097])
def test_edged_lean_kernel_on_a_launch_it_cannot_take_edged(monkeypatch, dtype, sk):
    """The 8-chunk general kernels (16-bit, no mask) exist for edged rows; launched where
    that path does not hold (never planned: here rows with a key stride of 2, so no 16-byte
    access), they still give the softmax, key by key (causal rows are never lean)."""
    from drvsoftmax import _core, _plan
    from drvsoftmax import torch as tfront

    real = _plan.plan_forward

    def forced(rows, sk_, dtype_, mask_kind, vector, *args, **kw):
        return real(rows, sk_, dtype_, mask_kind, True, False, *args[1:], **kw)

    monkeypatch.setattr(_plan, "plan_forward", forced)
    _core._cache.clear()
    tfront._prepared.clear()
    try:
        x = _rand((2, 3, 2 * sk), DTYPES[dtype])[..., ::2]
        assert (
            forced(6, sk, dtype, "none", False).kernel == f"smx_fwd<{_plan.X_DTYPES[dtype][0]}, MaskNone, 8, 1, false>"
        )
        _check_forward(x, scale=0.8, what=f"{dtype} Sk={sk} key stride 2")
        kl = torch.tensor([sk // 2, sk + 1], dtype=torch.int64, device="cuda")
        _check_forward(x, scale=-0.6, key_lengths=kl, what=f"{dtype} Sk={sk} key stride 2 key_lengths")
        out = torch.full((2, 3, 2 * sk), 5.0, dtype=DTYPES[dtype], device="cuda")
        drvsoftmax.scaled_masked_softmax(x, scale=0.8, out=out[..., ::2])
        torch.cuda.synchronize()
        assert torch.all(out[..., 1::2] == 5.0), "a store reached between the keys of a strided row"
    finally:
        _core._cache.clear()
        tfront._prepared.clear()
