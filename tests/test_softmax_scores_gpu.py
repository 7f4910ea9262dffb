"""Scores of every size, in every tier, against the float64 reference on a GPU.

A row's terms are exp2((v - m) * log2e) (smx_term in softmax_common.cuh), the max
subtracted first: rows of large scores (an additive mask of finfo.min over a whole row,
maxima near and past 2^30, scores around +-1e6) are where a shift m * log2e taken as one
rounded float went wrong (NaN or zeros), as could the sums moved between the maxima of a
row's parts and the folded STORE of the cluster tier (taken below SMX_FOLD_MAX only).  Rows whose scores are built from a big mask use x = 0 or x on a grid fine
enough that x * scale + mask is exact in fp32, so the reference (float64) and the kernels
(fp32) add the same numbers.  Every output is poisoned with NaN first.  Skips without
PyTorch or a CUDA GPU; the cluster case needs sm_90+.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import assert_matches, torch_cuda_available
from helpers import operand as _op
from helpers import to_numpy as _np

import drvsoftmax
from drvsoftmax import _core, _driver, _plan, _reference

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not torch_cuda_available(), reason="needs PyTorch with a CUDA GPU")
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
_gen = np.random.default_rng(20261201)
F32_MIN = float(np.finfo(np.float32).min)

# (tier, Sk): row lengths that each tier takes on an H200 (the loop and coop tiers are
# forced where the cluster tier would run).  16384 keys with a mask: rows of 512 threads.
TIERS = [
    ("register", 128),
    ("register", 1000),
    ("register", 16384),
    ("pipe", 16384),
    ("loop", 40003),
    ("coop", 40003),
    ("cluster", 65560),
]
# The pipelined tier has a kernel for fp32 x with an fp32 additive mask only.
MASKED_CASES = [(t, sk, dt) for t, sk in TIERS for dt in DTYPES if t != "pipe" or dt == "float32"]
UNMASKED_TIERS = [(t, sk) for t, sk in TIERS if t != "pipe"]


def _forget():
    import drvsoftmax.torch as dtorch

    _core._cache.clear()
    dtorch._forget_launches()


@pytest.fixture
def tier_forced(monkeypatch, request):
    """Plan the tier the case is about: the loop tier where clusters cannot run, the coop
    tier where the cluster tier would run, the register tier where the pipelined one would
    (fp32 rows with an fp32 mask of 16384 keys), and the pipelined one for fp32 rows."""
    tier = request.param
    dev = _driver.device(torch.cuda.current_device())
    if tier in ("cluster", "pipe") and torch.cuda.get_device_capability() < (9, 0):
        pytest.skip(f"the {tier} tier needs sm_90+")
    if tier == "register":
        monkeypatch.setattr(_plan, "PIPE_MIN_CC", 10**6)
    if tier == "pipe":
        monkeypatch.setattr(_plan, "FORCE_PIPE", True)
    if tier == "loop":
        monkeypatch.setattr(dev, "cluster_ready", lambda *a: False)
    if tier == "coop":
        monkeypatch.setattr(_plan, "FORCE_COOP", True)
    _forget()
    yield tier
    _forget()


def _run(x, mask, scale, tier, what):
    dt = str(x.dtype).replace("torch.", "")
    out = torch.full(x.shape, float("nan"), dtype=x.dtype, device="cuda")
    dev = _driver.device(torch.cuda.current_device())
    aligned = not ((x.data_ptr() | out.data_ptr()) & 15)
    mask_aligned = mask is None or not (mask.data_ptr() & 15)
    m = None if mask is None else _op(mask)
    prep = _core.prepare_forward(dev, _op(x), _op(out), m, None, False, scale, aligned, mask_aligned)
    if tier is not None:
        assert prep.plan.tier == tier, f"{what}: planned {prep.plan.describe()}"
    y = drvsoftmax.scaled_masked_softmax(x, mask, scale=scale, out=out)
    torch.cuda.synchronize()
    ref = _reference.softmax_forward(_np(x), None if mask is None else _np(mask), scale, False, None)
    got = _np(y)
    assert not np.isnan(got).any(), f"{what}: NaN in the output"
    assert_matches(got, ref, dt, what)
    sums = got.sum(-1, dtype=np.float64)
    want = ref.sum(-1)  # 1, or 0 for a row whose scores all overflow to -inf
    assert np.all(np.abs(sums - want) < 2e-2), f"{what}: rows sum to {sums}, not {want}"
    return got, ref


def _grid(sk, step):
    """Values on a grid of `step` in [-64 step, 64 step] (exact in every dtype here)."""
    return _gen.integers(-64, 65, sk) * step


def _rows_of_big_masks(sk):
    """(x, fp32 additive mask) rows, x = 0 or on a fine grid where the mask is big."""
    x = np.zeros((9, sk))
    m = np.zeros((9, sk))
    x[0] = _gen.standard_normal(sk) * 3
    m[0] = _gen.standard_normal(sk)
    m[1] = F32_MIN  # a whole row of finfo.min (a padded query's row): uniform
    x[2] = _gen.standard_normal(sk) * 3
    m[2] = np.where(_gen.random(sk) < 0.5, F32_MIN, 0.0)  # half the row at finfo.min
    m[2, sk // 3] = 0.0
    m[3] = 3e9 + 256.0 * _gen.integers(0, 4, sk)  # max 3e9 + 768: ties, the rest 2^-256 below
    m[4] = -3e9 - 256.0 * _gen.integers(0, 4, sk)
    x[5] = _grid(sk, 1 / 16)  # scores 1e6 + x: a true softmax of x at a max of 1e6
    m[5] = 1e6
    x[6] = _grid(sk, 1 / 16)
    m[6] = -1e6
    m[7] = np.where(_gen.random(sk) < 0.3, 2.0**30, 2.0**30 - 64)  # maxima of 2^30 with ties
    m[7, -1] = 2.0**30
    m[8] = np.where(_gen.random(sk) < 0.3, 2.0**30 - 64, 2.0**30 - 128)  # just below it
    m[8, 0] = 2.0**30 - 64
    return x, m


@pytest.mark.parametrize("tier_forced,sk,dtype", MASKED_CASES, indirect=["tier_forced"])
def test_rows_of_big_additive_masks(tier_forced, sk, dtype):
    """finfo.min over whole and half rows, maxima of +-3e9, 2^30 and just below, and true
    softmaxes at +-1e6: against the reference, no NaN, rows summing to 1."""
    x, m = _rows_of_big_masks(sk)
    xt = torch.from_numpy(x).to(DTYPES[dtype]).cuda()
    mt = torch.from_numpy(m).to(torch.float32).cuda()
    exact = [1, 3, 4, 5, 6, 7, 8]  # (rows 0 and 2 add x to a small mask or to finfo.min)
    assert np.array_equal(_np(xt)[exact], x[exact]), "x must be exact in its dtype where the mask is big"
    got, ref = _run(xt, mt, 1.0, tier_forced, f"{dtype} {tier_forced} Sk={sk}")
    np.testing.assert_allclose(got[1], 1.0 / sk, rtol=2e-2, err_msg="a row of finfo.min is uniform")
    assert np.all(got[2][m[2] == F32_MIN] == 0)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("tier_forced,sk", UNMASKED_TIERS, indirect=["tier_forced"])
def test_rows_of_big_scores_without_a_mask(tier_forced, sk, dtype):
    """x * scale large without a mask (the cluster tier's folded path takes maxima below
    1024 only): maxima near 1000 and 1300 with steps of 0.6-1.3 between scores, and in
    fp32 maxima of 3e9 with ties."""
    if tier_forced == "register" and sk == 16384:
        # 16-bit x without a mask at 16384 keys is a lean row (the lean kernels have a test
        # of their own below); 4 keys fewer take the edged path of the register tier (16-bit)
        # and the 8-chunk general kernel (fp32).  (More keys leave the register tier.)
        sk = 16384 - 4
    step = 1 / 16 if dtype != "bfloat16" else 1 / 2
    base = 64.0
    x = np.stack([base + _grid(sk, step), base + _grid(sk, step), _gen.standard_normal(sk)])
    if dtype == "float32":
        x[2] = 3e9 + 256.0 * _gen.integers(0, 3, sk)
    xt = torch.from_numpy(x).to(DTYPES[dtype]).cuda()
    assert np.array_equal(_np(xt)[:2], x[:2]), "the grid rows must be exact in their dtype"
    for scale in (15.0, 20.0, -15.0):
        _run(xt, None, scale, tier_forced, f"{dtype} {tier_forced} Sk={sk} scale={scale}")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("sk", [128, 4097, 8192])
def test_register_tier_16_bit_rows_of_big_scores(sk, dtype):
    """The lean (8192) and edged (4097) kernels of 16-bit rows without a mask; bf16 x of
    3.3e38 everywhere (uniform) and maxima of 2^40 with ties."""
    x = np.zeros((3, sk))
    x[0] = float(torch.finfo(torch.bfloat16).min) if dtype == "bfloat16" else -65504.0
    x[1] = 64 + _grid(sk, 1 / 16 if dtype == "float16" else 1 / 2)
    x[2] = (2.0**40 if dtype == "bfloat16" else 32768.0) * np.where(_gen.random(sk) < 0.2, 1.0, 0.5)
    xt = torch.from_numpy(x).to(DTYPES[dtype]).cuda()
    assert np.array_equal(_np(xt), x)
    for scale in (1.0, 20.0):
        _run(xt, None, scale, "register", f"{dtype} Sk={sk} scale={scale}")
