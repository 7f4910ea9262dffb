"""The CPU reference path against an independently written, naive float64 formula.

`drvsoftmax._reference` is the oracle of the GPU tests, so it is itself checked here against
`naive_forward` / `naive_backward`: plain Python loops over rows, one visible set per row built
from the mask, causality and key_lengths, then exp/sum with `math`.  Nothing of the package is
reused by the oracle.  The public functions are checked on NumPy arrays (fp16, bf16, fp32, fp64)
and on CPU torch tensors (values and autograd).  The last section feeds deliberately wrong
implementations to the checker to show that it has teeth.
"""

from __future__ import annotations

import math
import zlib

import ml_dtypes
import numpy as np
import pytest
from helpers import TOLS, assert_backward_matches, assert_matches, torch_or_none

import drvsoftmax
from drvsoftmax import _reference

torch = torch_or_none()  # the NumPy tests run without it; torch tests are marked requires_torch
FRONTS = ["numpy", pytest.param("torch", marks=pytest.mark.requires_torch)]

BF16 = ml_dtypes.bfloat16
NP_DTYPES = {"float16": np.float16, "float32": np.float32, "float64": np.float64, "bfloat16": BF16}
TORCH_DTYPES = {n: getattr(torch, n, None) for n in ("float16", "bfloat16", "float32", "float64")}
HIDE_DTYPES = {"bool": np.bool_, "uint8": np.uint8, "int8": np.int8, "int32": np.int32, "int64": np.int64}
ADD_DTYPES = {"add_float16": np.float16, "add_float32": np.float32, "add_float64": np.float64}
MASK_KINDS = ["none", *HIDE_DTYPES, *ADD_DTYPES]
# x is [B, H, Sq, Sk] = [2, 3, 4, 6]: Sk not a multiple of any vector width, Sq != Sk.
B, H, SQ, SK = 2, 3, 4, 6
MASK_SHAPES = {
    "b1qk": (B, 1, SQ, SK),
    "11qk": (1, 1, SQ, SK),
    "qk": (SQ, SK),
    "b11k": (B, 1, 1, SK),
    "bhqk": (B, H, SQ, SK),
}

INF = float("inf")
NAN = float("nan")


# ----------------------------------------------------------------------------------
# The independent oracle.


def _is_float_mask(mask) -> bool:
    return mask is not None and (mask.dtype.kind == "f" or mask.dtype.name == "bfloat16")


def naive_forward(x, mask=None, scale=1.0, causal=False, key_lengths=None):
    """(y, hidden) in float64, one row at a time.  `hidden` marks keys that get exactly 0:
    hidden by a source, or with a biased score of -inf."""
    x = np.asarray(x)
    shape = x.shape
    sk = shape[-1]
    mb = None if mask is None else np.broadcast_to(np.asarray(mask), shape)
    add = _is_float_mask(mb)
    y = np.zeros(shape, dtype=np.float64)
    hidden_out = np.zeros(shape, dtype=bool)
    for idx in np.ndindex(*shape[:-1]):
        scores = []
        for j in range(sk):
            hidden = False
            if mb is not None and not add and mb[idx + (j,)] != 0:
                hidden = True
            if causal and j > idx[-1] + sk - shape[-2]:
                hidden = True
            if key_lengths is not None and j >= int(key_lengths[idx[0]]):
                hidden = True
            if hidden:
                s = -INF
            else:
                s = float(x[idx + (j,)]) * float(scale)
                if add:
                    s = s + float(mb[idx + (j,)])
            scores.append(s)
        for j, s in enumerate(scores):
            hidden_out[idx + (j,)] = s == -INF
        if any(math.isnan(s) or s == INF for s in scores):
            y[idx] = NAN
            hidden_out[idx] = False
            continue
        visible = [s for s in scores if s != -INF]
        if not visible:
            continue  # all zeros
        m = max(visible)
        e = [math.exp(s - m) if s != -INF else 0.0 for s in scores]
        tot = math.fsum(e)
        y[idx] = [v / tot for v in e]
    return y, hidden_out


def naive_backward(dy, y, scale=1.0):
    dy = np.asarray(dy)
    y = np.asarray(y)
    dx = np.zeros(y.shape, dtype=np.float64)
    for idx in np.ndindex(*y.shape[:-1]):
        yr = [float(v) for v in y[idx]]
        dr = [float(v) for v in dy[idx]]
        dot = math.fsum(a * b for a, b in zip(dr, yr, strict=True))
        dx[idx] = [0.0 if yv == 0 else float(scale) * yv * (d - dot) for yv, d in zip(yr, dr, strict=True)]
    return dx


def check_softmax(
    got, x, mask=None, scale=1.0, causal=False, key_lengths=None, dtype="float64", what="", fp32_scores=False
):
    """The checker: closeness to the naive oracle plus the properties of the contract.

    `fp32_scores`: the output of a GPU kernel, which computes the scaled scores x * scale in
    fp32 (the contract: all arithmetic is fp32 inside the kernels); the oracle then starts
    from those rounded scores, so that large scores (|x * scale| in the hundreds, where the
    rounding alone moves exp by about 1e-5) do not count against fp32's tolerance."""
    if fp32_scores and np.isfinite(scale):
        with np.errstate(over="ignore", invalid="ignore"):
            xs = (np.asarray(x, dtype=np.float32) * np.float32(scale)).astype(np.float64)
        ref, hidden = naive_forward(xs, mask, 1.0, causal, key_lengths)
    else:
        ref, hidden = naive_forward(x, mask, scale, causal, key_lengths)
    got = np.asarray(got).astype(np.float64)
    assert_matches(got, ref, dtype, what)
    assert np.all(got[hidden] == 0), f"{what}: hidden positions are not exactly 0"
    nan_rows = np.isnan(ref).all(axis=-1)
    assert np.all(np.isnan(got[nan_rows])), f"{what}: a NaN row is not NaN throughout"
    fin = got[~nan_rows]
    assert np.all((fin >= 0) & (fin <= 1)), f"{what}: outputs outside [0, 1]"
    empty_rows = hidden.all(axis=-1) & ~nan_rows
    assert np.all(got[empty_rows] == 0), f"{what}: a fully hidden row is not all zeros"
    live = ~nan_rows & ~empty_rows
    tol = TOLS[dtype]
    sums = got.sum(axis=-1)
    # Each element is within atol + rtol*y of the truth, so the row sum within atol*Sk + rtol.
    assert np.all(np.abs(sums[live] - 1) <= tol["atol"] * x.shape[-1] + tol["rtol"]), f"{what}: rows do not sum to 1"


# ----------------------------------------------------------------------------------
# Inputs.


def _rng(*key):
    """A fixed-seed generator per test case (crc32, not hash(): str hashes vary per process)."""
    return np.random.default_rng([20261130, zlib.crc32(repr(key).encode())])


def make_x(rng, shape, dtype="float64", scale=3.0):
    return (rng.standard_normal(shape) * scale).astype(NP_DTYPES[dtype])


def make_mask(rng, kind, shape):
    """A mask of this kind with ~30% hidden keys and its first query row (or first batch,
    for [B,1,1,Sk]) fully hidden, so that fully hidden rows are always exercised."""
    if kind == "none":
        return None
    hide = rng.random(shape) < 0.3
    if len(shape) >= 2 and shape[-2] > 1:
        hide[..., 0, :] = True
    else:
        hide[0, ...] = True
    if kind in HIDE_DTYPES:
        dt = HIDE_DTYPES[kind]
        if dt is np.bool_:
            return hide
        lo = -3 if np.issubdtype(dt, np.signedinteger) else 1
        vals = rng.integers(lo, 4, shape)
        vals = np.where(vals == 0, 2, vals)  # nonzero (negative too) hides
        return np.where(hide, vals, 0).astype(dt)
    m = rng.standard_normal(shape) * 2
    return np.where(hide, -np.inf, m).astype(ADD_DTYPES[kind])


def _grid():
    for dtype in NP_DTYPES:
        for kind in MASK_KINDS:
            for mshape in ["-"] if kind == "none" else MASK_SHAPES:
                yield dtype, kind, mshape


# ----------------------------------------------------------------------------------
# NumPy: the reference path and the public function.


@pytest.mark.parametrize("dtype,kind,mshape", list(_grid()))
def test_forward_grid_against_naive(dtype, kind, mshape):
    rng = _rng(dtype, kind, mshape)
    x = make_x(rng, (B, H, SQ, SK), dtype)
    mask = make_mask(rng, kind, MASK_SHAPES.get(mshape))
    what = f"{dtype} mask={kind}{mshape}"
    ref = _reference.softmax_forward(x, mask, 0.8)
    assert ref.dtype == np.float64
    check_softmax(ref, x, mask, 0.8, dtype="float64", what="reference " + what)
    y = drvsoftmax.scaled_masked_softmax(x, mask, scale=0.8)
    assert isinstance(y, np.ndarray) and y.dtype == x.dtype and y.shape == x.shape
    check_softmax(y, x, mask, 0.8, dtype=dtype, what="public " + what)


@pytest.mark.parametrize("dtype", list(NP_DTYPES))
@pytest.mark.parametrize("sq,sk", [(3, 7), (7, 3), (5, 5), (1, 4), (4, 1)])
def test_causal_bottom_right(dtype, sq, sk):
    rng = _rng("causal", dtype, sq, sk)
    x = make_x(rng, (2, 2, sq, sk), dtype)
    y = drvsoftmax.scaled_masked_softmax(x, scale=0.5, causal=True)
    check_softmax(y, x, None, 0.5, True, dtype=dtype, what=f"causal {sq}x{sk}")
    # The visible prefix of query i is j <= i + Sk - Sq, spelled out (queries with none: zeros).
    nz = (y.astype(np.float64) != 0).sum(-1)
    want = np.clip(np.arange(sq) + sk - sq + 1, 0, sk)
    assert np.array_equal(nz, np.broadcast_to(want, nz.shape)), (nz, want)
    check_softmax(_reference.softmax_forward(x, None, 0.5, True), x, None, 0.5, True, what="reference causal")


@pytest.mark.parametrize("kl_dtype", [np.int32, np.int64, np.uint8, np.int16])
def test_key_lengths_zero_and_beyond_sk(kl_dtype):
    rng = _rng("klen", kl_dtype)
    x = make_x(rng, (4, 2, 3, SK), "float32")
    kl = np.array([0, 3, SK, SK + 5], dtype=kl_dtype)
    y = drvsoftmax.scaled_masked_softmax(x, key_lengths=kl)
    check_softmax(y, x, key_lengths=kl, dtype="float32", what="key_lengths")
    assert np.all(y[0] == 0), "key_lengths 0 must give all-zero rows"
    assert np.all(y[1, ..., 3:] == 0) and np.all(y[1, ..., :3] > 0)
    np.testing.assert_array_equal(y[3], drvsoftmax.scaled_masked_softmax(x[3]))
    np.testing.assert_array_equal(drvsoftmax.scaled_masked_softmax(x, key_lengths=list(kl.astype(int))), y)


def test_key_lengths_negative_hides_everything():
    x = make_x(_rng("kneg"), (2, 3, 5), "float64")
    y = drvsoftmax.scaled_masked_softmax(x, key_lengths=np.array([-4, 2], np.int64))
    check_softmax(y, x, key_lengths=[-4, 2], what="negative key_lengths")
    assert np.all(y[0] == 0)


def test_key_lengths_uint64_huge_clamps_to_sk():
    x = make_x(_rng("ku64"), (2, 3, 5), "float64")
    kl = np.array([2**64 - 1, 2], np.uint64)
    y = drvsoftmax.scaled_masked_softmax(x, key_lengths=kl)
    check_softmax(y, x, key_lengths=[2**64 - 1, 2], what="uint64 key_lengths")


@pytest.mark.parametrize("dtype", list(NP_DTYPES))
@pytest.mark.parametrize("kind", ["bool", "int8", "add_float32", "add_float16"])
@pytest.mark.parametrize("sq,sk", [(3, 7), (7, 3), (5, 5)])
def test_all_sources_together(dtype, kind, sq, sk):
    rng = _rng("all", dtype, kind, sq, sk)
    x = make_x(rng, (3, 2, sq, sk), dtype)
    mask = make_mask(rng, kind, (3, 1, sq, sk))
    kl = np.array([sk, 2, 0], np.int64)
    y = drvsoftmax.scaled_masked_softmax(x, mask, scale=-0.7, causal=True, key_lengths=kl)
    check_softmax(y, x, mask, -0.7, True, kl, dtype=dtype, what=f"all sources {kind} {sq}x{sk}")
    ref = _reference.softmax_forward(x, mask, -0.7, True, kl)
    check_softmax(ref, x, mask, -0.7, True, kl, what="reference all sources")


@pytest.mark.parametrize(
    "xshape,mshape,causal,klen",
    [
        ((9,), None, False, None),  # 1-D: a single row
        ((9,), (9,), False, None),
        ((9,), (1,), False, None),
        ((4, 9), (9,), True, None),  # 2-D [Sq, Sk]
        ((4, 9), (4, 1), False, [9, 0, 3, 20]),  # 2-D with key_lengths over rows
        ((2, 2, 3, 4, 5), (2, 1, 1, 4, 5), True, [5, 2]),  # 5-D
        ((2, 2, 3, 4, 5), (4, 5), False, [1, 6]),
        ((2, 2, 3, 4, 5), (3, 1, 5), True, None),
    ],
)
@pytest.mark.parametrize("kind", ["none", "bool", "add_float64"])
def test_other_ranks(xshape, mshape, causal, klen, kind):
    rng = _rng("rank", xshape, mshape, kind)
    x = make_x(rng, xshape, "float32")
    mask = None if mshape is None else make_mask(rng, kind, mshape)
    kl = None if klen is None else np.array(klen, np.int32)
    y = drvsoftmax.scaled_masked_softmax(x, mask, scale=1.3, causal=causal, key_lengths=kl)
    check_softmax(y, x, mask, 1.3, causal, kl, dtype="float32", what=f"x{xshape} mask{mshape}")


def test_strided_views_match_naive():
    rng = _rng("views")
    base = make_x(rng, (3, 4, 6, 20), "float32")
    mask = make_mask(rng, "bool", (1, 1, 6, 7))
    views = {
        "transpose": base[..., :7].transpose(1, 0, 2, 3),
        "negative": base[::-1, :, ::-2, 3:10],
        "last_stride": base[..., :14:2],
    }
    for name, v in views.items():
        m = mask if v.shape[-2] == 6 else None
        y = drvsoftmax.scaled_masked_softmax(v, m, causal=True)
        check_softmax(y, v, m, 1.0, True, dtype="float32", what=name)


def test_empty_batch():
    x = np.zeros((0, 3, 4, 5), np.float32)
    y = drvsoftmax.scaled_masked_softmax(x, np.zeros((4, 5), bool), causal=True)
    assert y.shape == x.shape and y.dtype == x.dtype


@pytest.mark.parametrize("front", FRONTS)
def test_empty_rows_sk_zero(front):
    x = np.zeros((2, 3, 0), np.float32)
    if front == "torch":
        x = torch.from_numpy(x)
    y = drvsoftmax.scaled_masked_softmax(x, causal=True)
    assert tuple(y.shape) == (2, 3, 0)


@pytest.mark.parametrize("kind", ["bool", "add_float32"])
@pytest.mark.parametrize("front", FRONTS)
def test_mask_with_leading_unit_dims(kind, front):
    rng = _rng("lead1", kind)
    x = make_x(rng, (2, 3, 4, 5), "float32")
    mask = make_mask(rng, kind, (1, 1, 3, 4, 5))
    xx, mm = (torch.from_numpy(x), torch.from_numpy(mask)) if front == "torch" else (x, mask)
    try:
        y = drvsoftmax.scaled_masked_softmax(xx, mm)
    except drvsoftmax.DrvSoftmaxError as e:  # rejecting it cleanly, naming the mask, is fine too
        assert "mask" in str(e)
        return
    check_softmax(np.asarray(y), x, mask[0], dtype="float32", what="leading unit dims")


# ----------------------------------------------------------------------------------
# Properties and non-finite data.


@pytest.mark.parametrize("dtype", list(NP_DTYPES))
def test_nonfinite_scores(dtype):
    rng = _rng("nonfinite", dtype)
    x = make_x(rng, (1, 8, 6), dtype).astype(np.float64)
    mask = np.zeros((1, 8, 6), bool)
    x[0, 0, 2] = NAN  # NaN -> row NaN
    x[0, 1, 0] = INF  # +inf -> row NaN
    x[0, 2, :] = -INF  # every score -inf -> zeros, never NaN
    x[0, 3, 5] = -INF  # one -inf key -> that key 0
    mask[0, 4, :] = True  # fully masked -> zeros
    x[0, 5, 1] = NAN
    mask[0, 5, 1] = True  # NaN under a boolean mask is hidden: row fine
    x[0, 6, 3] = INF
    mask[0, 6, 3] = True  # +inf under a boolean mask too
    x[0, 7, :] = 1e4  # huge equal logits: uniform, no overflow
    x = x.astype(NP_DTYPES[dtype])
    y = drvsoftmax.scaled_masked_softmax(x, mask)
    check_softmax(y, x, mask, dtype=dtype, what="nonfinite")
    yf = y.astype(np.float64)
    assert np.isnan(yf[0, 0]).all() and np.isnan(yf[0, 1]).all()
    assert np.all(yf[0, 2] == 0) and np.all(yf[0, 4] == 0)
    assert not np.isnan(yf[0, 2:]).any()
    np.testing.assert_allclose(yf[0, 7], 1 / 6, rtol=TOLS[dtype]["rtol"])


def test_nonfinite_from_scale_and_float_mask():
    x = np.array([[1.0, 2.0, INF], [1.0, -INF, 0.0], [1.0, 2.0, -INF], [1.0, 2.0, 3.0], [0.5, NAN, 1.0]])
    mask = np.array([[0.0, -INF, -INF], [0.0, 0.0, 0.0], [0.0, 0.0, -INF], [INF, 0.0, 0.0], [0.0, -INF, 0.0]])
    # Row 0: +inf * -1 + -inf = -inf, hidden, fine.  Row 1: -inf * -1 = +inf: NaN.  Row 2:
    # +inf + -inf = NaN: NaN.  Row 3: a +inf mask: NaN.  Row 4: NaN + -inf = NaN: NaN.
    y = drvsoftmax.scaled_masked_softmax(x, mask, scale=-1.0)
    check_softmax(y, x, mask, -1.0, what="non-finite through scale/mask")
    assert not np.isnan(y[0]).any() and np.isnan(y[1:]).all(axis=-1).all()
    # scale 0 turns +-inf into NaN (as torch: inf * 0): NaN rows.
    y0 = drvsoftmax.scaled_masked_softmax(np.array([[1.0, INF], [2.0, 3.0]]), scale=0.0)
    assert np.isnan(y0[0]).all() and np.all(y0[1] == 0.5)


@pytest.mark.parametrize("kind", ["none", "bool", "add_float64"])
def test_shift_invariance(kind):
    rng = _rng("shift", kind)
    x = make_x(rng, (B, H, SQ, SK), "float64")
    mask = make_mask(rng, kind, (B, 1, SQ, SK))
    kl = np.array([SK, 2])
    y = drvsoftmax.scaled_masked_softmax(x, mask, causal=True, key_lengths=kl)
    y100 = drvsoftmax.scaled_masked_softmax(x + 100, mask, causal=True, key_lengths=kl)
    assert_matches(y100, y, "float64", "x + 100")
    ym = drvsoftmax.scaled_masked_softmax(x - 1e5, mask, causal=True, key_lengths=kl)
    np.testing.assert_allclose(ym, y, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("scale", [0.0, -1.0, -0.25, 1e-30, 7.5])
def test_scales(scale):
    rng = _rng("scale", scale)
    x = make_x(rng, (B, H, SQ, SK), "float32")
    mask = make_mask(rng, "bool", (B, 1, SQ, SK))
    y = drvsoftmax.scaled_masked_softmax(x, mask, scale=scale)
    check_softmax(y, x, mask, scale, dtype="float32", what=f"scale={scale}")
    if scale == 0.0:  # uniform over the visible keys
        vis = (~mask).sum(-1, keepdims=True)
        want = np.where(mask, 0.0, 1.0 / np.maximum(vis, 1))
        np.testing.assert_allclose(y, np.broadcast_to(want, y.shape), rtol=1e-6)
    if scale < 0:  # softmax(x * s) == softmax(-x * |s|)
        assert_matches(y, drvsoftmax.scaled_masked_softmax(-x, mask, scale=-scale), "float32", "negative scale")


@pytest.mark.parametrize("dtype", list(NP_DTYPES))
def test_out_and_in_place(dtype):
    rng = _rng("out", dtype)
    x = make_x(rng, (B, H, SQ, SK), dtype)
    mask = make_mask(rng, "add_float32", (SQ, SK))
    want = drvsoftmax.scaled_masked_softmax(x, mask, scale=0.6, causal=True)
    out = np.full(x.shape, np.nan, dtype=x.dtype)
    y = drvsoftmax.scaled_masked_softmax(x, mask, scale=0.6, causal=True, out=out)
    assert y is out
    np.testing.assert_array_equal(out, want)
    x_copy = x.copy()
    y = drvsoftmax.scaled_masked_softmax(x, mask, scale=0.6, causal=True, out=x)
    assert y is x
    np.testing.assert_array_equal(x, want)
    check_softmax(x, x_copy, mask, 0.6, True, dtype=dtype, what="out=x")


def test_inputs_are_not_written():
    rng = _rng("nowrite")
    x = make_x(rng, (B, H, SQ, SK), "float32")
    mask = make_mask(rng, "add_float32", (SQ, SK))
    kl = np.array([3, 6])
    copies = x.copy(), mask.copy(), kl.copy()
    drvsoftmax.scaled_masked_softmax(x, mask, causal=True, key_lengths=kl)
    for a, b in zip((x, mask, kl), copies, strict=True):
        np.testing.assert_array_equal(a, b)


# ----------------------------------------------------------------------------------
# Backward.


@pytest.mark.parametrize("dtype", list(NP_DTYPES))
@pytest.mark.parametrize("scale", [0.8, -1.5, 0.0])
def test_backward_against_naive(dtype, scale):
    rng = _rng("bwd", dtype, scale)
    x = make_x(rng, (B, H, SQ, SK), dtype)
    mask = make_mask(rng, "bool", (B, 1, SQ, SK))
    y = drvsoftmax.scaled_masked_softmax(x, mask, scale=scale, causal=True)
    dy = make_x(rng, x.shape, dtype, 1.0)
    ref = naive_backward(dy, y, scale)
    got_ref = _reference.softmax_backward(dy, y, scale)
    assert_matches(got_ref, ref, "float64", "reference backward")
    dx = drvsoftmax.scaled_masked_softmax_backward(dy, y, scale=scale)
    assert dx.dtype == y.dtype and dx.shape == y.shape
    assert_matches(dx, ref, dtype, "public backward")
    assert np.all(dx[y.astype(np.float64) == 0] == 0), "dx must be exactly 0 where y == 0"
    out = np.full_like(dy, np.nan)
    assert drvsoftmax.scaled_masked_softmax_backward(dy, y, scale=scale, out=out) is out
    np.testing.assert_array_equal(out, dx)


def test_backward_zero_where_y_zero_even_for_huge_dy():
    y = np.array([[0.25, 0.0, 0.75], [0.0, 0.0, 0.0]])
    dy = np.array([[1.0, 1e300, -2.0], [5.0, -1e300, 3.0]])
    dx = drvsoftmax.scaled_masked_softmax_backward(dy, y, scale=2.0)
    assert dx[0, 1] == 0 and np.all(dx[1] == 0)
    np.testing.assert_allclose(dx, naive_backward(dy, y, 2.0), rtol=1e-14)


def _loss(x, dy, mask, scale, causal, kl):
    return float(np.sum(dy * _reference.softmax_forward(x, mask, scale, causal, kl)))


@pytest.mark.parametrize("scale", [0.9, -1.7])
def test_backward_is_the_gradient_finite_differences(scale):
    rng = _rng("fd", scale)
    x = make_x(rng, (2, 3, 5), "float64", 1.0)
    mask = make_mask(rng, "add_float64", (3, 5))
    kl = np.array([5, 3])
    dy = make_x(rng, x.shape, "float64", 1.0)
    y = drvsoftmax.scaled_masked_softmax(x, mask, scale=scale, causal=True, key_lengths=kl)
    dx = drvsoftmax.scaled_masked_softmax_backward(dy, y, scale=scale)
    num = np.zeros_like(x)
    eps = 1e-6
    for idx in np.ndindex(*x.shape):
        xp, xm = x.copy(), x.copy()
        xp[idx] += eps
        xm[idx] -= eps
        num[idx] = (_loss(xp, dy, mask, scale, True, kl) - _loss(xm, dy, mask, scale, True, kl)) / (2 * eps)
    np.testing.assert_allclose(dx, num, rtol=1e-6, atol=1e-9)
    assert np.all(dx[y == 0] == 0) and np.all(num[y == 0] == 0)


# ----------------------------------------------------------------------------------
# torch CPU tensors through the public front door.


def _t(a, dtype=None):
    if a is None:
        return None
    if a.dtype.name == "bfloat16":
        return torch.from_numpy(a.astype(np.float32)).to(torch.bfloat16)
    t = torch.from_numpy(np.ascontiguousarray(a))
    return t if dtype is None else t.to(dtype)


def _n(t):
    t = t.detach()
    return (t.float() if t.dtype == torch.bfloat16 else t).numpy()


@pytest.mark.requires_torch
@pytest.mark.parametrize("dtype", list(TORCH_DTYPES))
@pytest.mark.parametrize("kind", MASK_KINDS)
def test_torch_cpu_forward_matches(dtype, kind):
    rng = _rng("torch", dtype, kind)
    x = make_x(rng, (B, H, SQ, SK), dtype)
    mask = make_mask(rng, kind, (B, 1, SQ, SK))
    kl = np.array([SK, 3], np.int64)
    y = drvsoftmax.scaled_masked_softmax(_t(x), _t(mask), scale=0.9, causal=True, key_lengths=_t(kl))
    assert isinstance(y, torch.Tensor) and y.dtype == TORCH_DTYPES[dtype] and tuple(y.shape) == x.shape
    check_softmax(_n(y), x, mask, 0.9, True, kl, dtype=dtype, what=f"torch {dtype} {kind}")
    out = torch.full(y.shape, NAN, dtype=y.dtype)
    assert drvsoftmax.scaled_masked_softmax(_t(x), _t(mask), scale=0.9, causal=True, key_lengths=_t(kl), out=out) is out
    assert torch.equal(out, y)


@pytest.mark.requires_torch
def test_torch_cpu_in_place_and_backward_function():
    rng = _rng("torch_inplace")
    x = _t(make_x(rng, (B, H, SQ, SK), "float32"))
    want = drvsoftmax.scaled_masked_softmax(x, scale=0.5, causal=True)
    assert drvsoftmax.scaled_masked_softmax(x, scale=0.5, causal=True, out=x) is x
    assert torch.equal(x, want)
    dy = _t(make_x(rng, (B, H, SQ, SK), "float32", 1.0))
    dx = drvsoftmax.scaled_masked_softmax_backward(dy, x, scale=0.5)
    assert isinstance(dx, torch.Tensor) and dx.dtype == torch.float32
    assert_matches(_n(dx), naive_backward(_n(dy), _n(x), 0.5), "float32", "torch backward")


@pytest.mark.requires_torch
@pytest.mark.parametrize("mshape", [(1, 1, 3, 5), (2, 1, 3, 5), (3, 5), (2, 1, 1, 5)])
def test_torch_gradcheck_x_and_float_mask(mshape):
    rng = _rng("gradcheck", mshape)
    x = _t(make_x(rng, (2, 2, 3, 5), "float64", 1.0)).requires_grad_(True)
    m = _t(make_mask(rng, "add_float64", mshape)).requires_grad_(True)
    kl = torch.tensor([5, 4])

    def f(a, b):
        return drvsoftmax.scaled_masked_softmax(a, b, scale=0.7, causal=True, key_lengths=kl)

    assert torch.autograd.gradcheck(f, (x, m), eps=1e-6, atol=1e-7, rtol=1e-5)


def _expected_grads(x, m, dy, scale, causal=False, kl=None):
    """dL/dx and dL/dmask (summed over mask's broadcast dims) from the naive oracle."""
    y, _ = naive_forward(x, m, scale, causal, kl)
    g = naive_backward(dy, y, 1.0)
    gm = g
    while gm.ndim > m.ndim:
        gm = gm.sum(0)
    gm = gm.sum(axis=tuple(i for i, n in enumerate(m.shape) if n == 1), keepdims=True)
    return scale * g, gm


@pytest.mark.requires_torch
def test_torch_broadcast_mask_gets_summed_gradient():
    rng = _rng("maskgrad")
    x = make_x(rng, (2, 3, 4, 6), "float64", 1.0)
    m = make_mask(rng, "add_float64", (1, 1, 4, 6))
    dy = make_x(rng, x.shape, "float64", 1.0)
    xt, mt = _t(x).requires_grad_(True), _t(m).requires_grad_(True)
    y = drvsoftmax.scaled_masked_softmax(xt, mt, scale=0.6, causal=True)
    y.backward(_t(dy))
    gx, gm = _expected_grads(x, m, dy, 0.6, True)
    assert mt.grad is not None and tuple(mt.grad.shape) == m.shape and mt.grad.dtype == torch.float64
    np.testing.assert_allclose(xt.grad.numpy(), gx, rtol=1e-10, atol=1e-13)
    np.testing.assert_allclose(mt.grad.numpy(), gm, rtol=1e-5, atol=1e-7)


@pytest.mark.requires_torch
def test_torch_mask_gradient_keeps_float64_precision():
    # Summing a float64 mask gradient in float32 (as torch.py once did) gives ~1e-8 errors.
    rng = _rng("maskgrad64")
    x = make_x(rng, (4, 6, 8, 16), "float64", 1.0)
    m = make_mask(rng, "add_float64", (1, 1, 8, 16))
    dy = make_x(rng, x.shape, "float64", 1.0)
    xt, mt = _t(x), _t(m).requires_grad_(True)
    drvsoftmax.scaled_masked_softmax(xt, mt, scale=0.6).backward(_t(dy))
    y = _reference.softmax_forward(x, m, 0.6)
    want = _reference.softmax_backward(dy, y, 1.0).sum(axis=(0, 1), keepdims=True)
    np.testing.assert_allclose(mt.grad.numpy(), want, rtol=1e-12, atol=1e-13)


@pytest.mark.requires_torch
@pytest.mark.parametrize("mdtype", ["bool", "uint8", "int64"])
def test_torch_hiding_mask_gets_no_grad(mdtype):
    mdtype = getattr(torch, mdtype)
    rng = _rng("boolgrad", str(mdtype))
    x = make_x(rng, (2, 3, 4, 6), "float64", 1.0)
    m = make_mask(rng, "bool", (2, 1, 4, 6))
    dy = make_x(rng, x.shape, "float64", 1.0)
    xt, mt = _t(x).requires_grad_(True), _t(m, mdtype)
    y = drvsoftmax.scaled_masked_softmax(xt, mt, scale=1.2)
    y.backward(_t(dy))
    assert mt.grad is None
    y_ref, _ = naive_forward(x, m, 1.2)
    np.testing.assert_allclose(xt.grad.numpy(), 1.2 * naive_backward(dy, y_ref, 1.0), rtol=1e-10, atol=1e-13)
    assert torch.autograd.gradcheck(lambda a: drvsoftmax.scaled_masked_softmax(a, mt, scale=1.2), (xt,))


@pytest.mark.requires_torch
def test_torch_grad_to_mask_only_and_float_mask_without_grad():
    rng = _rng("maskonly")
    x = make_x(rng, (2, 3, 4, 6), "float64", 1.0)
    m = make_mask(rng, "add_float64", (2, 1, 4, 6))
    dy = make_x(rng, x.shape, "float64", 1.0)
    xt, mt = _t(x), _t(m).requires_grad_(True)
    drvsoftmax.scaled_masked_softmax(xt, mt, scale=2.0).backward(_t(dy))
    assert xt.grad is None
    _, gm = _expected_grads(x, m, dy, 2.0)
    np.testing.assert_allclose(mt.grad.numpy(), gm, rtol=1e-10, atol=1e-13)
    xt2, mt2 = _t(x).requires_grad_(True), _t(m)
    drvsoftmax.scaled_masked_softmax(xt2, mt2, scale=2.0).backward(_t(dy))
    assert mt2.grad is None and xt2.grad is not None


@pytest.mark.requires_torch
def test_torch_double_backward():
    # A backward that runs NumPy without a graph would give silent zero second derivatives.
    rng = _rng("gradgrad")
    x = _t(make_x(rng, (2, 3, 5), "float64", 1.0)).requires_grad_(True)
    m = _t(make_mask(rng, "add_float64", (3, 5))).requires_grad_(True)

    def f(a, b):
        return drvsoftmax.scaled_masked_softmax(a, b, scale=0.7, causal=True)

    assert torch.autograd.gradgradcheck(f, (x, m))


# ----------------------------------------------------------------------------------
# Known-wrong implementations must fail the checker.


def _plain_softmax(v, axis=-1):
    m = np.max(v, axis=axis, keepdims=True)
    e = np.exp(v - m)
    return e / e.sum(axis=axis, keepdims=True)


def _wrong_ignores_mask(x, mask, scale, causal=False, kl=None):
    return _reference.softmax_forward(x, None, scale, causal, kl)


def _wrong_sdpa_bool_convention(x, mask, scale, causal=False, kl=None):
    return _reference.softmax_forward(x, mask == 0, scale, causal, kl)  # True = keep


def _wrong_top_left_causal(x, mask, scale, causal=True, kl=None):
    sq, sk = x.shape[-2:]
    tl = np.arange(sk)[None, :] > np.arange(sq)[:, None]
    return _reference.softmax_forward(x, tl | mask.astype(bool) if mask is not None else tl, scale, False, kl)


def _wrong_sentinel(x, mask, scale, causal=False, kl=None):
    # apex/TE style: hidden -> -10000, no special case for fully hidden rows.
    v = x.astype(np.float64) * scale
    v = np.where(np.broadcast_to(mask, v.shape) != 0, -10000.0, v)
    return _plain_softmax(v)


def _wrong_low_precision(acc):
    def impl(x, mask, scale, causal=False, kl=None):
        hidden = np.broadcast_to(mask, x.shape) != 0
        s = np.where(hidden, -np.inf, x.astype(np.float64) * scale).astype(acc)
        m = np.max(s, axis=-1, keepdims=True)
        with np.errstate(invalid="ignore", divide="ignore"):
            e = np.exp((s - m).astype(np.float32)).astype(acc)
            tot = np.zeros(e.shape[:-1] + (1,), acc)
            for j in range(e.shape[-1]):  # sequential accumulation in the low precision
                tot = (tot + e[..., j : j + 1]).astype(acc)
            y = (e.astype(np.float32) / tot.astype(np.float32)).astype(acc)
        return np.where(np.isfinite(m.astype(np.float32)), y.astype(np.float64), 0.0)

    return impl


def _wrong_nan_ignoring(x, mask, scale, causal=False, kl=None):
    v = np.where(np.broadcast_to(mask, x.shape) != 0, -np.inf, x.astype(np.float64) * scale)
    v = np.where(np.isnan(v), -np.inf, v)  # drops NaN instead of propagating it
    return _reference.softmax_forward(v, None, 1.0)


def _wrong_nan_for_hidden_rows(x, mask, scale, causal=False, kl=None):
    with np.errstate(invalid="ignore"):
        v = np.where(np.broadcast_to(mask, x.shape) != 0, -np.inf, x.astype(np.float64) * scale)
        return _plain_softmax(v)  # torch.softmax of an all -inf row: NaN


# Each wrong implementation gets only the inputs that expose its own flaw (`nan_row` only
# where NaN handling is the flaw), so the checker fails for the right reason.
@pytest.mark.parametrize(
    "name,impl,dtype,nan_row,hidden_row",
    [
        ("ignores the mask", _wrong_ignores_mask, "float32", False, False),
        ("SDPA boolean convention", _wrong_sdpa_bool_convention, "float32", False, False),
        ("-10000 sentinel", _wrong_sentinel, "float32", False, True),
        ("fully hidden rows NaN", _wrong_nan_for_hidden_rows, "float32", False, True),
        ("NaN dropped", _wrong_nan_ignoring, "float32", True, False),
        ("float16 accumulation of fp32", _wrong_low_precision(np.float16), "float32", False, False),
        ("bfloat16 accumulation of fp16", _wrong_low_precision(BF16), "float16", False, False),
    ],
)
def test_known_wrong_implementations_fail_the_checker(name, impl, dtype, nan_row, hidden_row):
    rng = _rng("wrong", name)
    x = make_x(rng, (2, 2, 4, 64), dtype, 2.0)
    mask = make_mask(rng, "bool", (2, 1, 4, 64))  # query row 0 fully hidden
    if not hidden_row:
        mask[:, :, 0, :] = rng.random((2, 1, 64)) < 0.3
    if nan_row:
        x[0, 0, 1, 3] = NAN  # a NaN row the mask does not hide
        mask[:, :, 1, 3] = False
    good = drvsoftmax.scaled_masked_softmax(x, mask, scale=0.5)
    check_softmax(good, x, mask, 0.5, dtype=dtype, what="the real thing passes")
    bad = impl(x, mask, 0.5)
    bad = np.asarray(bad).astype(NP_DTYPES[dtype]) if dtype != "float64" else bad
    with pytest.raises(AssertionError):
        check_softmax(bad, x, mask, 0.5, dtype=dtype, what=name)


def test_top_left_causal_fails_the_checker():
    rng = _rng("wrong_causal")
    for sq, sk in [(3, 7), (7, 3)]:
        x = make_x(rng, (2, 2, sq, sk), "float32")
        good = drvsoftmax.scaled_masked_softmax(x, causal=True)
        check_softmax(good, x, None, 1.0, True, dtype="float32")
        with pytest.raises(AssertionError):
            check_softmax(
                _wrong_top_left_causal(x, None, 1.0).astype(np.float32),
                x,
                None,
                1.0,
                True,
                dtype="float32",
                what="top-left causal",
            )


def test_wrong_backward_fails_the_checker():
    rng = _rng("wrong_bwd")
    x = make_x(rng, (2, 3, 4, 6), "float32")
    mask = make_mask(rng, "bool", (2, 1, 4, 6))
    y = drvsoftmax.scaled_masked_softmax(x, mask, scale=0.5)
    dy = make_x(rng, x.shape, "float32", 1.0)
    ref = naive_backward(dy, y, 0.5)
    assert_matches(drvsoftmax.scaled_masked_softmax_backward(dy, y, scale=0.5), ref, "float32")
    forgot_scale = _reference.softmax_backward(dy, y, 1.0).astype(np.float32)
    forgot_dot = (0.5 * y.astype(np.float64) * dy).astype(np.float32)
    for wrong in (forgot_scale, forgot_dot):
        with pytest.raises(AssertionError):
            assert_matches(wrong, ref, "float32")


def test_the_backward_checker_takes_rows_of_infinite_dy():
    """Where y == 0 dx is exactly 0 even in a row whose sum(dy * y) is NaN (an infinite dy
    times y == 0, the rest of the row NaN): the checker accepts those zeros and still
    refuses anything else there, and in the finite rows beside them."""
    y = np.array([[0.0, 0.25, 0.75, 0.0], [0.5, 0.5, 0.0, 0.0]], dtype=np.float32)
    dy = np.array([[np.inf, 1.0, -2.0, 3.0], [1.0, -1.0, 2.0, 0.0]], dtype=np.float32)
    ref = _reference.softmax_backward(dy, y, 0.5)
    assert (ref[y == 0] == 0).all() and np.isnan(ref[0, 1:3]).all() and np.isfinite(ref[1]).all()
    assert_backward_matches(ref.astype(np.float32), dy, y, ref, 0.5, "float32", "exact")
    for r, j in ((0, 0), (0, 3), (1, 0), (1, 2)):
        wrong = ref.copy()
        wrong[r, j] += 1e-3
        with pytest.raises(AssertionError):
            assert_backward_matches(wrong, dy, y, ref, 0.5, "float32", "perturbed")


@pytest.mark.parametrize("x_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("front", FRONTS)
def test_rows_of_the_dtype_minimum_are_uniform_not_nan(front, x_dtype):
    """A padded query under an additive mask of finfo(dtype).min (the convention of many
    Transformer codebases, float32 and bfloat16 masks): every score of that row is the same
    huge negative number, and its softmax is uniform, as torch.softmax gives; the other rows
    keep their visible keys.  (The GPU kernels' case: tests/test_softmax_scores_gpu.py.)"""
    npdt = NP_DTYPES[x_dtype]
    gen = np.random.default_rng(7)
    x = gen.standard_normal((3, 2, 5, 9)).astype(npdt)
    lo = float(ml_dtypes.finfo(BF16).min if x_dtype == "bfloat16" else np.finfo(np.float32).min)
    mask = np.zeros((3, 1, 5, 9), dtype=npdt)
    mask[:, :, :, 6:] = lo  # padded keys
    mask[1, :, 3:, :] = lo  # padded queries of sequence 1: every key at the minimum
    if front == "torch":
        tdt = getattr(torch, x_dtype)
        xt = torch.from_numpy(x.astype(np.float32)).to(tdt)
        got = drvsoftmax.scaled_masked_softmax(xt, torch.from_numpy(mask.astype(np.float32)).to(tdt))
        got = got.float().numpy()
    else:
        got = np.asarray(drvsoftmax.scaled_masked_softmax(x, mask), dtype=np.float64)
    assert not np.isnan(got).any()
    np.testing.assert_allclose(got[1, :, 3:, :], 1 / 9, rtol=TOLS[x_dtype]["rtol"])
    assert np.all(got[0, :, :, 6:] == 0) and np.all(got[1, :, :3, 6:] == 0)
    np.testing.assert_allclose(got.sum(-1), 1.0, rtol=1e-2)
