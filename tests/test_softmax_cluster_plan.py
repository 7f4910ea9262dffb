"""The cluster tier on the CPU: when the planner picks it, the shapes it gives, and that its
kernels are built for sm_90+ only (their bodies compile empty below).

Rows longer than the register tier are held on chip by a thread-block cluster on sm_90+
devices whose shared memory holds them; other devices and longer rows keep the looped tier.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import chunk_slot_bytes, plan_of

from drvsoftmax import _compiler, _core, _plan

H200 = _plan.DeviceCaps(90, 232448)  # sm_90: 227 KB of shared memory per block
B200 = _plan.DeviceCaps(100, 232448)
RTX = _plan.DeviceCaps(120, 101376)  # sm_120: 99 KB per block
A100 = _plan.DeviceCaps(80, 166912)
L40 = _plan.DeviceCaps(89, 101376)
DTYPES = list(_plan.X_DTYPES)
ITEM = {dt: _plan.X_DTYPES[dt][1] for dt in DTYPES}
LONG = [16385, 16393, 20000, 32768, 65535, 65536, 100003, 262144, 524288, 1048576, 1048577, 1835008, 1835009]


_slot = chunk_slot_bytes
_plan_of = plan_of


def _xs(mk: str, dtype: str, backward: bool) -> bool:
    """An x-held cluster forward exists (16-bit x, a 1-byte hiding mask read from global
    memory, x alone in shared memory): planned where no cluster holds x and the mask."""
    return not backward and ITEM[dtype] == 2 and mk == "hide1"


def _has_reg_variant(dtype: str, mk: str, backward: bool) -> bool:
    """The cluster kernels that hold CLUSTER_REG chunks per thread in registers: every
    backward, the forward without a mask, the fp32 forward with any mask, the 16-bit forward
    with a 1-byte hiding mask (wider masks beside 16-bit x would not fit its registers)."""
    return backward or mk in ("none", "hide1") or ITEM[dtype] == 4


def test_mask_element_sizes_match_the_c_types():
    assert set(_plan.MASK_ITEMSIZE) == set(_plan.MASK_KINDS)
    for mk in _plan.MASK_KINDS:
        assert 16 + 8 * _plan.MASK_ITEMSIZE[mk] == _slot(mk, "float16", False), mk


@pytest.mark.parametrize("caps", [None, A100, L40, _plan.DeviceCaps(75, 65536)])
@pytest.mark.parametrize("backward", [False, True])
def test_no_cluster_tier_before_sm_90(caps, backward):
    """Devices without clusters (and no device at all) plan exactly as without `caps`, but
    for the coop tier (tests/test_softmax_coop_plan.py)."""
    for dtype in DTYPES:
        for sk in [1, 128, 16384, *LONG]:
            for aligned in (True, False):
                for mk in ("none", "hide1", "add_float64") if not backward else ("none",):
                    p = _plan_of(backward, 33, sk, dtype, mk, aligned, caps)
                    assert p.tier != "cluster" and p.cluster == 0
                    if p.tier != "coop":
                        assert p == _plan_of(backward, 33, sk, dtype, mk, aligned, None)
                        assert p.smem == 0


def _expected_shape(chunks: int, slot: int, caps, reg_variant: bool, big_loses: bool = False):
    """(CTAs per cluster, chunks per thread in shared memory, in registers) the planner
    should pick, or None: the smallest cluster whose blocks stay under the shared memory
    target with at most CLUSTER_CHUNKS_TARGET chunks per thread (else the smallest under
    the target, else the largest that fits); the register variant wherever there is one, else all chunks in
    shared memory."""
    limit = caps.smem_per_block - _plan.CLUSTER_SMEM_RESERVE

    def best(reg):
        shapes = {}
        for cs in (2, 4, 8, 16):
            q = 4 * -(-max(0, chunks - cs * 256 * reg) // (cs * 256 * 4))
            if q * 256 * slot <= limit:
                shapes[cs] = q
        if not shapes:
            return None
        under = [c for c in sorted(shapes) if shapes[c] * 256 * slot <= _plan.CLUSTER_SMEM_TARGET]
        few = [c for c in under if reg + shapes[c] <= _plan.CLUSTER_CHUNKS_TARGET]
        cs = few[0] if few else under[0] if under else max(shapes)
        return cs, shapes[cs], reg

    r0 = best(_plan.CLUSTER_REG if reg_variant else 0)
    # masked forwards and backwards: clusters of 16 with over 128 KB per block lose to the loop
    if big_loses and r0 is not None and r0[0] == 16 and r0[1] * 256 * slot > 128 * 1024:
        return None
    return r0


def _stream_kernel(backward: bool, dtype: str, mk: str) -> str | None:
    """The streamed cluster kernel the planner gives rows no cluster takes, or None."""
    if backward:
        return _plan.kernel_bwd_stream(dtype)
    return _plan.kernel_fwd_stream(dtype, mk) if mk in _plan.stream_mask_kinds(dtype) else None


def _assert_streamed(p, rows, chunks, slot, caps, smem_cap=None):
    """A streamed cluster plan: STREAM_CLUSTER blocks a row, whole steps of shared memory
    within the cap and the device, no more than the row needs, and chunks per thread
    (registers, shared memory, streamed) that cover the row."""
    cap = _plan.STREAM_SMEM if smem_cap is None else smem_cap
    cs = _plan.STREAM_CLUSTER
    assert p.tier == "cluster" and p.cluster == cs and p.grid == rows * cs, p
    assert p.block == 256 == 1 << p.tpr_log2 and p.rpt == 1
    assert p.smem % (256 * slot) == 0 and (p.smem // (256 * slot)) % 4 == 0, p
    q = p.smem // (256 * slot)
    assert p.smem <= min(cap, caps.smem_per_block - _plan.CLUSTER_SMEM_RESERVE), p
    assert p.nch >= _plan.CLUSTER_REG + q and (p.nch - _plan.CLUSTER_REG) % 4 == 0, p
    assert cs * p.nch * 256 >= chunks and cs * (p.nch - 4) * 256 < chunks, (p, chunks)
    assert p.kernel in _plan.all_kernel_names()


@pytest.mark.parametrize("caps", [H200, B200, RTX, _plan.DeviceCaps(90, 48 * 1024)])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("backward", [False, True])
def test_cluster_shapes_hold_the_row(caps, dtype, backward):
    """A cluster plan covers every chunk of the row with the fewest chunks per thread of
    its cluster size, fits the device's shared memory, and is taken whenever any cluster
    size holds the row; with the register variant wherever there is one."""
    limit = caps.smem_per_block - _plan.CLUSTER_SMEM_RESERVE
    kinds = ("none",) if backward else tuple(_plan.MASK_KINDS)
    regs_seen = set()
    for mk in kinds:
        slot = _slot(mk, dtype, backward)
        for sk in LONG:
            for aligned in (True, False):
                rows = 37
                p = _plan_of(backward, rows, sk, dtype, mk, aligned, caps)
                chunks = _plan.row_chunks(sk, ITEM[dtype], aligned)
                reg_variant = _has_reg_variant(dtype, mk, backward)
                if not backward:
                    assert _plan.cluster_reg(ITEM[dtype], mk) == (_plan.CLUSTER_REG if reg_variant else 0), mk
                want = _expected_shape(chunks, slot, caps, reg_variant, backward or mk != "none")
                xs = want is None and _xs(mk, dtype, backward)
                held = 16 if xs else slot  # bytes a chunk takes in shared memory: x alone where x-held
                if xs:
                    want = _expected_shape(chunks, held, caps, True, True)
                if want is None and p.kernel == _stream_kernel(backward, dtype, mk):
                    _assert_streamed(p, rows, chunks, slot, caps, _plan.STREAM_SMEM if backward else None)
                    continue
                if want is None:
                    assert p.tier in ("coop", "loop") and p.cluster == 0, (mk, sk, p)
                    continue
                cs, q, reg = want
                regs_seen.add(reg)
                assert p.tier == "cluster", (mk, sk, p)
                assert (p.cluster, p.nch, p.smem) == (cs, reg + q, q * 256 * held), (mk, sk, p, want)
                assert q % 4 == 0 and cs * (reg + q) * 256 >= chunks
                assert q == 0 or cs * (reg + q - 4) * 256 < chunks
                assert p.smem <= limit
                assert p.grid == rows * cs and p.block == 256 == 1 << p.tpr_log2
                if xs:
                    assert p.kernel == _plan.kernel_fwd_cluster_xs(dtype, mk)
                else:
                    assert p.kernel == (
                        _plan.kernel_bwd_cluster(dtype, reg) if backward else _plan.kernel_fwd_cluster(dtype, mk, reg)
                    )
                assert p.kernel in _plan.all_kernel_names()
    if caps is H200:  # the register variants where they exist; 16-bit forwards with wider masks have none
        assert regs_seen == ({0, _plan.CLUSTER_REG} if not backward and ITEM[dtype] == 2 else {_plan.CLUSTER_REG})


def test_register_variant_wherever_there_is_one():
    p = _plan.plan_backward(64, 262144, "float32", True, True, H200)  # 2 MB of dy and y per row
    assert p.kernel == "smx_bwd_cluster<float, 4>" and p.cluster == 16 and p.smem == 12 * 256 * 32
    p = _plan.plan_forward(64, 2**20, "float16", "none", True, True, H200)
    assert p.kernel == "smx_fwd_cluster<smx_f16, MaskNone, 4>" and p.nch == 32 and p.smem == 28 * 256 * 16
    # The smallest cluster whose blocks stay under CLUSTER_SMEM_TARGET (two per SM) with at
    # most CLUSTER_CHUNKS_TARGET chunks per thread.
    p = _plan.plan_forward(64, 65536, "float16", "none", True, True, H200)
    assert p.kernel.endswith(", 4>") and (p.cluster, p.nch, p.smem) == (2, 16, 12 * 256 * 16)
    p = _plan.plan_forward(64, 65536, "float32", "none", True, True, H200)
    assert p.kernel.endswith(", 4>") and (p.cluster, p.nch, p.smem) == (4, 16, 12 * 256 * 16)
    p = _plan.plan_forward(64, 262144, "float16", "none", True, True, H200)
    assert p.kernel.endswith(", 4>") and (p.cluster, p.nch, p.smem) == (8, 16, 12 * 256 * 16)
    p = _plan.plan_backward(64, 65536, "bfloat16", True, True, H200)
    assert p.kernel.endswith(", 4>") and (p.cluster, p.nch, p.smem) == (2, 16, 12 * 256 * 32)
    # fp32 forwards with any mask have the variant; 16-bit ones with a 1-byte hiding mask
    # only (4 chunks of a wider mask beside x's would not fit its registers).
    p = _plan.plan_forward(64, 262144, "float32", "hide1", True, True, H200)
    assert p.kernel == "smx_fwd_cluster<float, MaskHide<smx_u8>, 4>" and p.cluster == 16
    p = _plan.plan_forward(64, 262144, "float16", "hide1", True, True, H200)
    assert p.kernel == "smx_fwd_cluster<smx_f16, MaskHide<smx_u8>, 4>" and (p.cluster, p.nch, p.smem) == (
        8,
        16,
        12 * 256 * 24,
    )
    p = _plan.plan_forward(64, 65536, "bfloat16", "hide1", True, True, H200)
    assert p.kernel == "smx_fwd_cluster<smx_bf16, MaskHide<smx_u8>, 4>" and (p.cluster, p.nch, p.smem) == (
        2,
        16,
        12 * 256 * 24,
    )
    # ... and where no cluster holds x and the mask within CLUSTER_LOOP_SMEM, the x-held
    # kernel (x alone in shared memory, the mask read from global memory)
    p = _plan.plan_forward(64, 2**20, "bfloat16", "hide1", True, True, H200)
    assert p.kernel == "smx_fwd_cluster_xs<smx_bf16, MaskHide<smx_u8>, 4>" and (p.cluster, p.nch, p.smem) == (
        16,
        32,
        28 * 256 * 16,
    )


@pytest.mark.parametrize("xs", [True, False])
def test_the_cluster_xs_knob(monkeypatch, xs):
    """_plan.CLUSTER_XS (a test hook): True plans the x-held kernel wherever a cluster holds
    x, False never (the looped tier where no cluster holds x and the mask)."""
    monkeypatch.setattr(_plan, "CLUSTER_XS", xs)
    for dtype in ("float16", "bfloat16"):
        for sk in (20000, 65536, 262144, 2**20):
            p = _plan.plan_forward(64, sk, dtype, "hide1", True, True, H200)
            assert p.tier == ("cluster" if xs or sk < 2**20 else "loop"), p
            assert ("cluster_xs" in p.kernel) == xs, p
            assert ("the mask read from global memory" in p.reason) == xs, p  # what explain() says
            assert p.smem % (256 * (16 if xs else 24)) == 0 and p.kernel in _plan.all_kernel_names()
        # other dtypes and masks have no x-held kernel
        assert "cluster_xs" not in _plan.plan_forward(64, 65536, dtype, "none", True, True, H200).kernel
        assert "cluster_xs" not in _plan.plan_forward(64, 65536, dtype, "hide2", True, True, H200).kernel
    assert "cluster_xs" not in _plan.plan_forward(64, 65536, "float32", "hide1", True, True, H200).kernel
    assert _plan.plan_forward(64, 262144, "float16", "hide2", True, True, H200).kernel.endswith("<smx_u16>, 0>")
    assert _plan.plan_forward(64, 262144, "bfloat16", "add_bfloat16", True, True, H200).kernel.endswith(", 0>")


@pytest.mark.parametrize("backward", [False, True])
def test_cluster_tier_starts_where_the_register_tier_ends(backward):
    for dtype in DTYPES:
        last = 16384
        assert _plan_of(backward, 8, last, dtype, "none", True, H200).tier == "register"
        assert _plan_of(backward, 8, last + 1, dtype, "none", True, H200).tier == "cluster"
        # Rows off the 16-byte grid touch one chunk more: the register tier ends a chunk
        # earlier; but 16-bit forwards without a mask (edged rows: whole chunks in registers,
        # the keys outside them one per lane) hold every row of up to 16384 keys.
        n = 16 // ITEM[dtype]
        edged = not backward and ITEM[dtype] == 2
        assert _plan_of(backward, 8, last - n + 2, dtype, "none", False, H200).tier == (
            "register" if edged else "cluster"
        )
        assert _plan_of(backward, 8, last, dtype, "none", False, H200).tier == ("register" if edged else "cluster")
        assert _plan_of(backward, 8, last + 1, dtype, "none", False, H200).tier == "cluster"


@pytest.mark.parametrize(
    "dtype,mk,backward",
    [
        ("float16", "none", False),
        ("float16", "hide1", False),
        ("bfloat16", "hide1", False),
        ("float32", "none", False),
        ("float32", "hide1", False),
        ("float16", None, True),
        ("float32", None, True),
    ],
)
def test_the_longest_row_a_cluster_holds(dtype, mk, backward):
    """The last row length the cluster tier takes and the first it leaves to the loop (to
    the streamed cluster forward in fp32 without a mask or with a bool mask, to the
    streamed cluster backward); 16-bit x with a bool mask: the last the cluster that holds
    the mask beside x takes, then the x-held kernel to its own last."""
    n = 16 // ITEM[dtype]
    reg = _plan.CLUSTER_REG if _has_reg_variant(dtype, mk, backward) else 0
    after = "loop"

    def longest_of(slot: int) -> tuple[int, int]:
        qmax = (H200.smem_per_block - _plan.CLUSTER_SMEM_RESERVE) // (256 * slot) // 4 * 4
        if backward or mk != "none":
            # Masked forwards and backwards: clusters of 16 up to CLUSTER_LOOP_SMEM per block.
            qmax = min(qmax, _plan.CLUSTER_LOOP_SMEM // (256 * slot) // 4 * 4)
        return 16 * 256 * (qmax + reg) * n, qmax

    longest, qmax = longest_of(_slot(mk or "none", dtype, backward))
    p = _plan_of(backward, 2, longest, dtype, mk or "none", True, H200)
    assert p.tier == "cluster" and p.cluster == 16 and p.nch == qmax + reg and p.kernel.endswith(f", {reg}>")
    if _xs(mk, dtype, backward):
        assert "cluster_xs" not in p.kernel
        for q in (
            _plan_of(False, 2, longest + n, dtype, mk, True, H200),
            _plan_of(False, 2, longest, dtype, mk, False, H200),
        ):
            assert q.kernel == _plan.kernel_fwd_cluster_xs(dtype, mk) and q.smem % (256 * 16) == 0, q
        longest, qmax = longest_of(16)
        p = _plan_of(backward, 2, longest, dtype, mk, True, H200)
        assert p.kernel == _plan.kernel_fwd_cluster_xs(dtype, mk) and p.cluster == 16 and p.nch == qmax + reg, p
    beyond = (
        _plan_of(backward, 2, longest + 1, dtype, mk or "none", True, H200),
        _plan_of(backward, 2, longest, dtype, mk or "none", False, H200),
    )  # (one chunk more)
    for q in beyond:
        stream = _stream_kernel(backward, dtype, mk or "none")
        if stream is not None:  # a streamed cluster kernel takes the row
            assert q.kernel == stream, q
        else:
            assert q.tier == after, q


def test_long_rows_of_the_targets_take_the_cluster_tier_on_sm_90():
    for sk in (65536, 262144):
        for dtype in DTYPES:
            for mk in ("none", "hide1", f"add_{dtype}"):
                assert _plan.plan_forward(64, sk, dtype, mk, True, True, H200).tier == "cluster", (sk, dtype, mk)
            assert _plan.plan_backward(64, sk, dtype, True, True, H200).tier == "cluster", (sk, dtype)
    # 1M keys: 16-bit rows fit (2 MB of x, 4 MB of dy and y over 16 blocks, with
    # registers); fp32 rows do not (the coop tier takes them).  With a bool mask the x-held
    # kernel (x alone in shared memory) holds them.
    assert _plan.plan_forward(64, 2**20, "float16", "none", True, True, H200).tier == "cluster"
    assert _plan.plan_forward(64, 2**20, "bfloat16", "hide1", True, True, H200).kernel == _plan.kernel_fwd_cluster_xs(
        "bfloat16", "hide1"
    )
    # ... but with a wider mask, and backward, clusters of 16 with over 128 KB per block
    # lose: to the loop (16-bit masked forwards), to the streamed cluster backward
    assert _plan.plan_forward(64, 2**20, "bfloat16", "add_bfloat16", True, True, H200).tier == "loop"
    assert _plan.plan_backward(64, 2**20, "float16", True, True, H200).kernel == _stream_kernel(True, "float16", "")
    assert _plan.plan_backward(64, 262144, "float32", True, True, H200).kernel == _plan.kernel_bwd_cluster(
        "float32", _plan.CLUSTER_REG
    )
    # fp32 rows of 1M keys fit no cluster: the forward streams what shared memory does not
    # hold (without a mask and with a bool mask), and so does the backward
    for mk in ("none", "hide1"):
        assert _plan.plan_forward(64, 2**20, "float32", mk, True, True, H200).kernel == _plan.kernel_fwd_stream(
            "float32", mk
        )
    assert _plan.plan_forward(64, 2**20, "float32", "add_float32", True, True, H200).tier == "loop"
    assert _plan.plan_backward(64, 2**20, "float32", True, True, H200).kernel == _stream_kernel(True, "float32", "")


STREAM_CASES = [
    (256, 2**20, "none", True),
    (256, 2**20, "hide1", True),
    (64, 2**20 + 5, "none", False),
    (300, 3 * 2**20 + 1, "hide1", False),
    (17, 2**22, "none", True),
    (4, 2**20, "hide1", True),
    (1, 2**20 + 3, "none", False),
]


@pytest.mark.parametrize("rows,sk,mk,aligned", STREAM_CASES)
def test_streamed_forward_of_rows_no_cluster_holds(rows, sk, mk, aligned):
    """fp32 rows beyond any cluster's shared memory take the streamed cluster forward, few
    rows (where the split tier would pay) as well as many; the same rows in 16-bit x keep
    their tier (the split tier for few rows), and so do devices without clusters."""
    caps = _plan.DeviceCaps(90, 232448, 132)
    p = _plan.plan_forward(rows, sk, "float32", mk, True, aligned, caps)
    slot = _slot(mk, "float32", False)
    chunks = _plan.row_chunks(sk, 4, aligned)
    assert p.kernel == _plan.kernel_fwd_stream("float32", mk), p
    _assert_streamed(p, rows, chunks, slot, caps)
    assert p.smem == min(_plan.STREAM_SMEM // (256 * slot * 4) * 4 * 256 * slot, p.smem), p
    assert "streamed" in p.reason
    few = rows <= caps.sm_count * _plan.SPLIT_ROWS_PER_SM
    for dt in ("float16", "bfloat16"):
        q = _plan.plan_forward(rows, sk, dt, mk, True, aligned, caps)
        assert "stream" not in q.kernel
        if few and _plan.split_pays(rows, _plan.split_segments(sk, 2, aligned, False, 1 if mk != "none" else 0), caps):
            assert q.tier in ("cluster", "split"), q  # a cluster where one holds the row
    assert "stream" not in _plan.plan_forward(rows, sk, "float32", mk, True, aligned, A100).kernel


@pytest.mark.parametrize("rows,sk,mk,aligned", STREAM_CASES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_streamed_backward_of_rows_no_cluster_holds(rows, sk, mk, aligned, dtype):
    """Backward rows no cluster takes (16-bit rows of 1M keys need more than
    CLUSTER_LOOP_SMEM per block of a cluster of 16) take the streamed cluster backward, few
    rows as well as many, at most STREAM_SMEM per block; not on devices without
    clusters."""
    caps = _plan.DeviceCaps(90, 232448, 132)
    p = _plan.plan_backward(rows, sk, dtype, True, aligned, caps)
    assert p.kernel == _plan.kernel_bwd_stream(dtype), p
    _assert_streamed(p, rows, _plan.row_chunks(sk, ITEM[dtype], aligned), 32, caps, _plan.STREAM_SMEM)
    assert "streamed" in p.reason
    assert "stream" not in _plan.plan_backward(rows, sk, dtype, True, aligned, A100).kernel


def test_fp32_bool_rows_a_cluster_of_16_holds_only_in_big_blocks_stream():
    """fp32 rows with a bool mask that a cluster of 16 would hold only with more than
    CLUSTER_LOOP_SMEM per block (where it loses to the loop) take the streamed forward; the
    same rows without a mask stay in the cluster that holds them, and an additive mask (no
    streamed kernel) keeps the loop."""
    sk = 2**19
    slot = _slot("hide1", "float32", False)
    assert _plan.cluster_shape(_plan.row_chunks(sk, 4, True), slot, H200, _plan.CLUSTER_REG) is not None
    for rows in (16, 128, 1024):
        p = _plan.plan_forward(rows, sk, "float32", "hide1", True, True, H200)
        assert p.kernel == _plan.kernel_fwd_stream("float32", "hide1"), p
        _assert_streamed(p, rows, _plan.row_chunks(sk, 4, True), slot, H200)
        assert _plan.plan_forward(rows, sk, "float32", "none", True, True, H200).kernel.startswith("smx_fwd_cluster<")
        assert _plan.plan_forward(rows, sk, "float32", "add_float32", True, True, H200).tier == "loop"


def test_forced_streamed_plans_take_the_knob_s_shared_memory(monkeypatch):
    """FORCE_STREAM (a test hook) plans the streamed forward for any long fp32 row and the
    streamed backward for any long row with at most that much shared memory, down to none;
    other dtypes and masks of the forward keep their tier."""
    for cap in (0, 16 * 1024, 40 * 1024, 10**9):
        monkeypatch.setattr(_plan, "FORCE_STREAM", cap)
        for sk, aligned in ((16385, True), (70001, False), (262147, False), (2**20, True)):
            for mk in _plan.STREAM_MASK_KINDS:
                p = _plan.plan_forward(6, sk, "float32", mk, True, aligned, H200)
                _assert_streamed(p, 6, _plan.row_chunks(sk, 4, aligned), _slot(mk, "float32", False), H200, cap)
            assert "stream" not in _plan.plan_forward(6, sk, "float16", "none", True, aligned, H200).kernel
            assert "stream" not in _plan.plan_forward(6, sk, "float32", "add_float32", True, aligned, H200).kernel
            for dtype in DTYPES:
                p = _plan.plan_backward(6, sk, dtype, True, aligned, H200)
                assert p.kernel == _plan.kernel_bwd_stream(dtype), p
                _assert_streamed(p, 6, _plan.row_chunks(sk, ITEM[dtype], aligned), 32, H200, cap)
        assert _plan.plan_forward(6, 4096, "float32", "none", True, True, H200).tier != "cluster"
        assert _plan.plan_backward(6, 4096, "float32", True, True, H200).tier != "cluster"


def test_cluster_grid_beyond_the_launch_limit_takes_another_tier(monkeypatch):
    rows = _plan.MAX_GRID // 2 + 1  # 2 blocks per row would pass the limit
    assert _plan.plan_forward(rows, 20000, "float16", "none", True, True, H200).tier == "loop"
    monkeypatch.setattr(_plan, "COOP_WHERE_IT_FITS", True)
    p = _plan.plan_forward(rows, 20000, "float16", "none", True, True, H200)
    assert p.tier == "coop" and p.grid <= _plan.COOP_MAX_BLOCKS * _plan.COOP_MAX_GROUPS


def test_describe_names_the_cluster():
    p = _plan.plan_forward(64, 65536, "float16", "none", True, True, H200)
    text = p.describe()
    assert text.startswith("cluster tier: smx_fwd_cluster<smx_f16, MaskNone, 4>")
    assert f"clusters of {p.cluster}" in text and f"{p.smem} bytes of shared memory" in text


def test_forward_and_backward_params_thread_the_device_through():
    shape = (2, 3, 40000)
    strides = tuple(int(np.prod(shape[i + 1 :])) for i in range(len(shape)))
    x = _core.Operand(0, "float16", shape, strides)
    _, p = _core.forward_params(x, x, None, None, False, 1.0, True, caps=H200)
    assert p.tier == "cluster" and p.grid == 6 * p.cluster
    _, p = _core.forward_params(x, x, None, None, False, 1.0, True)
    assert p.tier == "loop"
    _, p = _core.forward_params(x, x, None, None, False, 1.0, True, caps=A100)
    assert p.tier == "loop"  # (the coop tier where it measured faster only: not before sm_90)
    _, p = _core.backward_params(x, x, x, 1.0, True, H200)
    assert p.tier == "cluster"
    _, p = _core.backward_params(x, x, x, 1.0, True)
    assert p.tier == "loop"


def test_cluster_kernels_are_built_for_sm_90_only():
    """The PTX of sm_90 holds the one-way exchange (the mbarrier, the cluster barrier that
    guards its initialisation, the distributed shared-memory stores) and the asynchronous
    copies; that of sm_80 has none of them (the bodies compile empty).  No cluster barrier
    arrives with release semantics: that compiles to a GPU-scope memory barrier."""
    try:
        _compiler.nvrtc_version()
    except Exception as e:  # no NVRTC library on this machine
        pytest.skip(f"NVRTC unavailable: {type(e).__name__}: {e}")
    names = [_plan.kernel_fwd_cluster("float16", "hide1"), _plan.kernel_bwd_cluster("float32", _plan.CLUSTER_REG)]
    text90 = _compiler.compile_kernels("compute_90", names).image.decode(errors="replace")
    text80 = _compiler.compile_kernels("compute_80", names).image.decode(errors="replace")
    for needle in (
        "mbarrier.init.shared::cta.b64",
        "fence.mbarrier_init.release.cluster",
        "barrier.cluster.arrive.relaxed",
        "barrier.cluster.wait",
        "mapa.shared::cluster",
        "st.async.shared::cluster.mbarrier::complete_tx::bytes",
        "mbarrier.try_wait.parity",
    ):
        assert text90.count(needle) >= 2, needle  # in both kernels
        assert needle not in text80
    assert "barrier.cluster.arrive.release" not in text90 and "cp.async.cg.shared.global" in text90
    assert "cp.async" not in text80


class _FakeDevice:
    """What _core.prepare_* asks of a device, without one."""

    def __init__(self, caps, ready):
        self.caps = caps
        self.ready = ready
        self.asked = []

    def kernel(self, name):
        return name

    def cluster_ready(self, name, cluster, smem, block):
        self.asked.append((name, cluster, smem, block))
        return self.ready


@pytest.mark.parametrize("ready", [True, False])
def test_prepared_cluster_launch_or_loop_fallback(ready):
    """A cluster plan is kept when the device can run its clusters (and then carries its
    launch configuration: grid, block, cluster dims, dynamic shared memory), else the
    launch is planned again without the cluster tier."""
    pytest.importorskip("cuda.bindings")
    shape = (3, 50001)
    x = _core.Operand(0, "bfloat16", shape, (50001, 1))
    dev = _FakeDevice(H200, ready)
    prep = _core.prepare_forward(dev, x, x, None, None, False, 0.5, True)
    expected = _plan.plan_forward(3, 50001, "bfloat16", "none", True, True, H200)
    assert dev.asked == [(expected.kernel, expected.cluster, expected.smem, 256)]
    if ready:
        assert prep.plan == expected and prep.kernel == expected.kernel
        cfg = prep.cluster
        assert (cfg.gridDimX, cfg.blockDimX, cfg.sharedMemBytes) == (3 * expected.cluster, 256, expected.smem)
        assert cfg.numAttrs == 1 and cfg.attrs[0].value.clusterDim.x == expected.cluster
    else:
        assert prep.plan.tier == "loop" and prep.cluster is None
        assert prep.plan == _plan.plan_forward(3, 50001, "bfloat16", "none", True, True, None)
    dev = _FakeDevice(H200, ready)
    prep = _core.prepare_backward(dev, x, x, x, 0.5, True)
    assert prep.plan.tier == ("cluster" if ready else "loop") and (prep.cluster is not None) == ready
    # Short rows never ask.
    dev = _FakeDevice(H200, ready)
    short = _core.Operand(0, "float16", (4, 1000), (1000, 1))
    prep = _core.prepare_forward(dev, short, short, None, None, False, 1.0, True)
    assert prep.plan.tier == "register" and prep.cluster is None and dev.asked == []


def test_explain_plans_for_an_architecture():
    import drvsoftmax

    text = drvsoftmax.explain((2, 8, 65536), "float16", arch="sm_90")
    assert text.startswith("cluster tier: smx_fwd_cluster<smx_f16, MaskNone, 4>") and "clusters of" in text
    assert drvsoftmax.explain((2, 8, 65536), "float16", arch="sm_90", backward=True).startswith(
        "cluster tier: smx_bwd_cluster<smx_f16, 4>"
    )
    assert drvsoftmax.explain((2, 65536), "float32", mask_dtype="bool", arch="sm_120").startswith("cluster tier")
    for arch in ("sm_75", "sm_80", "sm_89"):
        assert drvsoftmax.explain((2, 8, 65536), "float16", arch=arch).startswith("loop tier")
    # fp32 rows of 1M keys: no cluster holds them; the streamed cluster forward (without the
    # SM count, the split tier cannot be weighed; the coop tier only when asked)
    assert drvsoftmax.explain((2, 2**20), "float32", arch="sm_90").startswith(
        "cluster tier: smx_fwd_cluster_stream<float, MaskNone, 4>"
    )
    assert drvsoftmax.explain((2, 2**20), "float32", arch="sm_90", backward=True).startswith(
        "cluster tier: smx_bwd_cluster_stream<float, 4>"
    )
    assert drvsoftmax.explain((2, 8, 65536), "float16").startswith("loop tier")
    assert drvsoftmax.explain((2, 128), "float16", arch="sm_90") == drvsoftmax.explain((2, 128), "float16")
    with pytest.raises(drvsoftmax.ArgumentValueError, match=r"^arch must be of the form 'sm_XY'"):
        drvsoftmax.explain((2, 65536), "float16", arch="hopper")
    assert _plan.caps_of_arch(90) == H200 and _plan.caps_of_arch(120) == RTX and not _plan.caps_of_arch(86).clusters
