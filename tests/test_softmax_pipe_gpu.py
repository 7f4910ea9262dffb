"""The pipelined register tier (smx_fwd_pipe) on a GPU against the float64 reference.

Skips cleanly without PyTorch, without a CUDA GPU, or on a GPU older than the tier's
first architecture (`_plan.PIPE_MIN_CC`).  Every row its kernels take is forced onto the
tier (`_plan.FORCE_PIPE`), not only those the planner picks by default; each case first checks that the launch really is
of the tier, on a grid no larger than the device holds at once.  Outputs are poisoned
with NaN first: an element no block writes shows up as a NaN the reference does not have.
Row counts are chosen so that the persistent grid takes several rounds, the last one
partial, and blocks of several rows end on a partial group.
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
_gen = np.random.default_rng(20261203)


def _forget():
    import drvsoftmax.torch as dtorch

    _core._cache.clear()
    dtorch._forget_launches()


@pytest.fixture(autouse=True)
def _force_pipe(monkeypatch):
    """Every row the tier's kernels take runs on it; prepared launches of
    other tests are forgotten before and after."""
    if _dev().cc < _plan.PIPE_MIN_CC:
        pytest.skip(f"the pipelined register tier needs sm_{_plan.PIPE_MIN_CC}+, this GPU is {_dev().arch}")
    monkeypatch.setattr(_plan, "FORCE_PIPE", True)
    _forget()
    yield
    _forget()


def _prepared(x, mask, causal, key_lengths, out, scale) -> _core.Prepared:
    m = None if mask is None else _op(mask)
    k = None if key_lengths is None else _op(key_lengths)
    aligned = not ((x.data_ptr() | out.data_ptr()) & 15)
    mask_aligned = mask is None or not (mask.data_ptr() & 15)
    return _core.prepare_forward(_dev(), _op(x), _op(out), m, k, causal, scale, aligned, mask_aligned)


def _mask(kind: str, shape, dtype):
    """[B, 1, Sq, Sk]: a bool mask hiding about a third of the keys (whole rows of some
    queries), or an additive one of x's dtype with -inf at a fifth of the keys."""
    b, _, sq, sk = shape
    mshape = (b, 1, sq, sk)
    if kind == "bool":
        m = _gen.random(mshape) < 0.3
        m[:, :, 1, :] = True  # a query that sees nothing: a row of zeros
        return torch.from_numpy(m).cuda()
    m = _gen.standard_normal(mshape) * 2
    m[_gen.random(mshape) < 0.2] = -np.inf
    m[:, :, 2, :] = -np.inf
    return torch.from_numpy(m).to(dtype).cuda()


def _check(shape, dtype, mask_kind, causal, lengths, scale=0.37):
    x = torch.from_numpy(_gen.standard_normal(shape) * 4).to(DTYPES[dtype]).cuda()
    mask = None if mask_kind is None else _mask(mask_kind, shape, DTYPES[dtype])
    kl = None
    if lengths:
        kl = torch.from_numpy(_gen.integers(0, shape[-1] + 1, size=shape[0])).cuda()
    out = torch.full(shape, float("nan"), dtype=x.dtype, device="cuda")
    what = f"{dtype} {shape} mask={mask_kind} causal={causal} key_lengths={lengths}"
    prep = _prepared(x, mask, causal, kl, out, scale)
    p = prep.plan
    assert p.tier == "pipe", f"{what}: planned {p.describe()}"
    cap = _dev().resident_blocks(p.kernel, p.smem, p.block)
    assert 1 <= prep.grid <= cap and prep.smem == p.smem > 0, (what, prep.grid, cap, prep.smem)
    y = drvsoftmax.scaled_masked_softmax(x, mask, scale=scale, causal=causal, key_lengths=kl, out=out)
    torch.cuda.synchronize()
    mnp = None if mask is None else _np(mask)
    knp = None if kl is None else _np(kl)
    ref = _reference.softmax_forward(_np(x), mnp, scale, causal, knp)
    got = _np(y)
    assert_matches(got, ref, dtype, what)
    hidden = np.broadcast_to(_reference.hidden_positions(x.shape, mnp, causal, knp), x.shape)
    assert np.all(got[hidden] == 0), f"{what}: hidden positions are not exactly 0"
    return prep


# Its rows (fp32 x, an fp32 additive mask, 8 chunks per thread): within a warp, blocks of
# 128 and 256 threads (forced), and the planned ones of more than 256 (a block of 384 whole
# warps for 375 threads, one of 512).
SKS = (1000, 4096, 8192, 12000, 16384)


def test_every_row_shape():
    """Each row shape, with causal rows and key_lengths in turn; row counts that leave the
    last round of the persistent grid (and the last block's group) partial."""
    for sk in SKS:
        sq = 67 if sk <= 4096 else 9
        for causal, lengths in ((False, False), (True, False), (False, True)):
            prep = _check((3, 5, sq, sk), "float32", "add", causal, lengths)
            assert prep.plan.nch == 8


def test_many_rounds_of_the_persistent_grid():
    """Far more row groups than the device holds: every block takes many, alternating its
    two exchange sets; and causal rows whose prefixes leave most slots unread."""
    prep = _check((4, 8, 1031, 1000), "float32", "add", False, False)
    groups = -(-4 * 8 * 1031 // max(prep.block >> prep.plan.tpr_log2, 1))
    assert prep.grid < groups // 4, (prep.grid, groups)
    _check((2, 4, 301, 16384), "float32", "add", True, False)


def test_scores_that_make_rows_nan_and_empty():
    """NaN and +inf scores make their rows NaN, other rows of the same block unaffected; a
    row with every key hidden is zeros."""
    shape = (2, 4, 33, 16384)
    x = torch.from_numpy(_gen.standard_normal(shape)).float().cuda()
    x[0, 0, 3, 17] = float("nan")
    x[1, 2, 5, 200] = float("inf")
    mask = torch.zeros((2, 1, 33, 16384), dtype=torch.float32, device="cuda")
    mask[:, :, 7, :] = -float("inf")
    out = torch.full(shape, -1.0, dtype=x.dtype, device="cuda")
    prep = _prepared(x, mask, False, None, out, 1.0)
    assert prep.plan.tier == "pipe", prep.plan.describe()
    drvsoftmax.scaled_masked_softmax(x, mask, out=out)
    ref = _reference.softmax_forward(_np(x), _np(mask), 1.0, False, None)
    assert_matches(_np(out), ref, "float32", "nan/inf/empty rows")
    assert torch.isnan(out[0, 0, 3]).all() and torch.isnan(out[1, 2, 5]).all()
    assert (out[:, :, 7] == 0).all()


def test_planned_by_default_where_the_register_tier_holds_one_block_per_sm(monkeypatch):
    """Without the knob: fp32 rows of more than 8192 keys with an fp32 additive mask."""
    monkeypatch.setattr(_plan, "FORCE_PIPE", False)
    _forget()
    _check((2, 3, 41, 16384), "float32", "add", False, False)
    _check((2, 3, 41, 12000), "float32", "add", True, True)
