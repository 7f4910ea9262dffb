"""The coop tier on the CPU: when the planner picks it, the shapes it gives, the testing
knob that forces it, its launch-time grid and fallbacks, and its kernels' PTX.

Rows longer than the register tier that no cluster holds (and every such row before
sm_90) are held on chip by G co-resident blocks (cooperative launch) where the device's
shared memory holds them; the looped tier takes the rest.
"""

from __future__ import annotations

import pytest
from helpers import chunk_slot_bytes, plan_of

from drvsoftmax import _compiler, _core, _plan

H200 = _plan.DeviceCaps(90, 232448, 132)
A100 = _plan.DeviceCaps(80, 166912, 108)
L40 = _plan.DeviceCaps(89, 101376, 142)
T4 = _plan.DeviceCaps(75, 65536, 40)
DTYPES = list(_plan.X_DTYPES)
ITEM = {dt: _plan.X_DTYPES[dt][1] for dt in DTYPES}
LONG = [16385, 16393, 20000, 32768, 65535, 65536, 100003, 262144, 524288, 1048576, 1048577, 4194305]


@pytest.fixture
def force(monkeypatch):
    monkeypatch.setattr(_plan, "FORCE_COOP", True)


@pytest.fixture(autouse=True)
def where_it_fits(request, monkeypatch):
    """These tests check the coop tier wherever it holds a row (COOP_WHERE_IT_FITS); the
    default policy (where it measured faster) has tests of its own, marked `default_policy`."""
    if "default_policy" not in request.keywords:
        monkeypatch.setattr(_plan, "COOP_WHERE_IT_FITS", True)
    # (the split tier, which takes some of the looped tier's rows, has tests of its own)
    monkeypatch.setattr(_plan, "SPLIT", False)


@pytest.mark.default_policy
@pytest.mark.parametrize("caps", [A100, L40, T4, H200])
def test_default_policy_keeps_the_looped_tier(caps):
    """By default the coop tier is not planned (the looped tier measured faster where rows
    fill the GPU): long rows take the cluster tier where it holds them, else the loop."""
    for dtype in DTYPES:
        for sk in (65536, 2**20, 4194305):
            for mk in ("none", "hide1"):
                p = _plan.plan_forward(8, sk, dtype, mk, True, True, caps)
                assert p.tier in ("cluster", "loop"), (dtype, sk, mk, p)
            assert _plan.plan_backward(8, sk, dtype, True, True, caps).tier in ("cluster", "loop")
    if caps is H200:  # fp32 rows of 1M keys fit no cluster: streamed by one
        p = _plan.plan_forward(8, 2**20, "float32", "none", True, True, caps)
        assert p.kernel == _plan.kernel_fwd_stream("float32", "none"), p
        q = _plan.plan_backward(8, 2**20, "float32", True, True, caps)
        assert q.kernel == _plan.kernel_bwd_stream("float32"), q


_slot = chunk_slot_bytes
_plan_of = plan_of


def _fits(caps, g, q, reg, slot, sk, n):
    """Independent statement of what a coop shape must satisfy: every chunk of the row held,
    the slice within the per-block limit, every block holding at least one chunk of the row,
    and, with a known SM count, G blocks surely resident (at most two per SM, as shared
    memory allows)."""
    smem = q * 256 * slot
    per_sm = min(2, (caps.smem_per_block + 1024) // (smem + 1024))
    return (
        smem <= caps.smem_per_block - 1024
        and sk - (g - 1) * (q + reg) * 256 * n >= n
        and (not caps.sm_count or g <= caps.sm_count * per_sm)
    )


@pytest.mark.parametrize("caps", [A100, L40, T4, _plan.DeviceCaps(80, 166912)])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("backward", [False, True])
def test_coop_shapes_hold_the_row(caps, dtype, backward):
    """A coop plan covers every chunk of the row (G blocks x (R + Q) chunks per thread),
    with the fewest chunks per thread Q (a multiple of 4) of its G, a slice that fits the
    device, at least one chunk of the row in the last block, and G surely resident; no
    smaller G could have held it under the same rules.  Otherwise the looped tier."""
    n_of = 16 // ITEM[dtype]
    kinds = ("none",) if backward else ("none", "hide1", "add_float64", f"add_{dtype}")
    tiers = set()
    for mk in kinds:
        slot = _slot(mk, dtype, backward)
        for sk in LONG:
            for aligned in (True, False):
                p = _plan_of(backward, 37, sk, dtype, mk, aligned, caps)
                tiers.add(p.tier)
                assert p.tier in ("coop", "loop") and p.cluster == 0, (mk, sk, p)
                chunks = _plan.row_chunks(sk, ITEM[dtype], aligned)
                if p.tier == "loop":
                    # nothing fits: not even the largest slice of one block per SM
                    for g in range(1, 1025):
                        q = 4 * -(-chunks // (g * 256 * 4))
                        assert not _fits(caps, g, q, 0, slot, sk, n_of), (mk, sk, g)
                    continue
                g = p.coop
                reg = _plan.CLUSTER_REG if p.kernel.endswith(f", {_plan.CLUSTER_REG}>") else 0
                q = p.nch - reg
                assert q % 4 == 0 and g * (reg + q) * 256 >= chunks, (mk, sk, p)
                assert q == 0 or g * (reg + q - 4) * 256 < chunks, (mk, sk, p)
                assert p.smem == q * 256 * slot and _fits(caps, g, q, reg, slot, sk, n_of), (mk, sk, p)
                assert p.block == 256 == 1 << p.tpr_log2 and p.grid % g == 0
                groups = p.grid // g
                assert 1 <= groups <= 37
                if caps.sm_count:
                    assert groups == min(
                        37, caps.sm_count * min(2, (caps.smem_per_block + 1024) // (p.smem + 1024)) // g
                    )
                else:
                    assert groups == 1  # set at launch
                assert p.kernel == (
                    _plan.kernel_bwd_coop(dtype, reg) if backward else _plan.kernel_fwd_coop(dtype, mk, reg)
                )
                assert p.kernel in _plan.all_kernel_names()
                if reg == 0:
                    for g2 in range(1, g):  # no fewer blocks under the target with two per SM
                        q2 = 4 * -(-chunks // (g2 * 256 * 4))
                        smem2 = q2 * 256 * slot
                        two = 2 * (smem2 + 1024) <= caps.smem_per_block + 1024
                        assert not (
                            _fits(caps, g2, q2, 0, slot, sk, n_of) and smem2 <= _plan.COOP_SMEM_TARGET and two
                        ), (mk, sk, g2, p)
    assert "coop" in tiers


def test_coop_on_sm_80_for_long_rows_and_loop_only_beyond_the_chip():
    for dtype in DTYPES:
        for sk in (16385, 65536, 262144, 2**20):
            assert _plan.plan_forward(64, sk, dtype, "none", True, True, A100).tier == "coop", (dtype, sk)
            assert _plan.plan_forward(64, sk, dtype, "hide1", True, True, A100).tier == "coop", (dtype, sk)
            assert _plan.plan_backward(64, sk, dtype, True, True, A100).tier == "coop", (dtype, sk)
    # fp32 rows of 16M keys (64 MB) exceed every SM's shared memory of an A100 together.
    assert _plan.plan_forward(4, 2**24, "float32", "none", True, True, A100).tier == "loop"
    assert _plan.plan_backward(4, 2**23, "float32", True, True, A100).tier == "loop"
    # The register tier keeps its rows.
    assert _plan.plan_forward(64, 16384, "float16", "none", True, True, A100).tier == "register"
    assert _plan.plan_forward(64, 16384, "float32", "none", True, True, A100).tier == "register"


@pytest.mark.parametrize("backward", [False, True])
def test_coop_starts_where_the_register_tier_ends_on_sm_80(backward):
    for dtype in DTYPES:
        assert _plan_of(backward, 8, 16384, dtype, "none", True, A100).tier == "register"
        assert _plan_of(backward, 8, 16385, dtype, "none", True, A100).tier == "coop"
        n = 16 // ITEM[dtype]
        edged = not backward and ITEM[dtype] == 2  # (edged rows: see the cluster plan's test)
        assert _plan_of(backward, 8, 16384 - n + 2, dtype, "none", False, A100).tier == (
            "register" if edged else "coop"
        )
        assert _plan_of(backward, 8, 16385, dtype, "none", False, A100).tier == "coop"


def test_cluster_first_on_sm_90_coop_beyond_it():
    for dtype in DTYPES:
        for sk in (16385, 65536, 262144):
            assert _plan.plan_forward(64, sk, dtype, "none", True, True, H200).tier == "cluster"
            assert _plan.plan_backward(64, sk, dtype, True, True, H200).tier == "cluster"
    p = _plan.plan_forward(64, 2**20, "float32", "none", True, True, H200)
    assert p.tier == "coop" and p.kernel == "smx_fwd_coop<float, MaskNone, 0>"
    assert (p.coop, p.nch, p.smem) == (64, 16, 65536) and p.grid == 64 * 4  # 2 per SM: 264 blocks, 4 rows
    p = _plan.plan_backward(64, 2**20, "float32", True, True, H200)
    assert p.tier == "coop" and p.coop == 128 and p.smem == 65536 and p.grid == 256
    assert _plan.plan_forward(64, 2**21, "float16", "none", True, True, H200).tier == "coop"


def test_force_knob_takes_the_coop_tier_where_the_cluster_would_run(force):
    for dtype in DTYPES:
        for sk in (16385, 65536, 262144):
            p = _plan.plan_forward(64, sk, dtype, "none", True, True, H200)
            assert p.tier == "coop" and p.cluster == 0 and p.coop >= 1, p
            assert _plan.plan_backward(64, sk, dtype, True, True, H200).tier == "coop"
        # rows of the register tier stay there; no device: no coop tier
        assert _plan.plan_forward(64, 4096, dtype, "none", True, True, H200).tier == "register"
        assert _plan.plan_forward(64, 65536, dtype, "none", True, True, None).tier == "loop"


def test_force_knob_from_the_environment():
    import subprocess
    import sys

    code = "from drvsoftmax import _plan; print(_plan.FORCE_COOP)"
    for value, want in (("1", "True"), ("0", "False"), ("", "False")):
        env = {"DRVSOFTMAX_FORCE_COOP": value, "PATH": ""}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        assert out.stdout.strip() == want, (value, out)


def test_no_coop_tier_without_a_device_or_before_sm_70():
    assert _plan.plan_forward(4, 65536, "float16", "none", True, True, None).tier == "loop"
    assert _plan.plan_forward(4, 65536, "float16", "none", True, True, _plan.DeviceCaps(61, 98304, 20)).tier == "loop"
    assert _plan.caps_of_arch(80) == _plan.DeviceCaps(80, 166912)
    assert _plan.caps_of_arch(75).coop and not _plan.caps_of_arch(75).clusters
    assert not _plan.caps_of_arch(72).coop


def test_every_block_holds_room_for_its_pair():
    """Rows whose last block would hold less than one chunk take more chunks per block."""
    for dtype in DTYPES:
        n = 16 // ITEM[dtype]
        for sk in range(16385, 16385 + 40 * 1024 * n, 997):
            for caps in (A100, T4, L40):
                p = _plan.plan_forward(3, sk, dtype, "none", True, False, caps)
                if p.tier == "coop":
                    per = p.nch * 256 * n  # elements per block (ofs 0: the fewest in the last)
                    assert sk - (p.coop - 1) * per >= n, (dtype, sk, p)


def test_describe_names_the_groups():
    p = _plan.plan_forward(64, 2**20, "float32", "none", True, True, H200)
    text = p.describe()
    assert text.startswith("coop tier: smx_fwd_coop<float, MaskNone, 0>, grid 256 x block 256")
    assert "as 4 group(s) of 64 co-resident blocks, 65536 bytes of shared memory per block" in text


def test_explain_plans_the_coop_tier_for_an_architecture():
    import drvsoftmax

    text = drvsoftmax.explain((2, 8, 65536), "float32", arch="sm_80")
    assert text.startswith("coop tier: smx_fwd_coop<float, MaskNone, 0>") and "co-resident" in text
    assert drvsoftmax.explain((2, 2**20), "float32", arch="sm_90").startswith("coop tier")
    assert drvsoftmax.explain((2, 65536), "float32", arch="sm_90").startswith("cluster tier")


class _FakeDevice:
    """What _core.prepare_* asks of a device, without one."""

    def __init__(self, caps, capacity):
        self.caps = caps
        self.capacity = capacity
        self.asked = []

    def kernel(self, name):
        return name

    def cluster_ready(self, name, cluster, smem, block):
        return True

    def coop_capacity(self, name, smem, block):
        self.asked.append((name, smem, block))
        return self.capacity


@pytest.mark.parametrize("capacity", [0, 63, 64, 200, 10**6])
def test_prepared_coop_grid_from_the_device_or_loop_fallback(capacity):
    """A coop plan's groups come from the device's measured capacity (rows at most); a
    device that cannot hold G blocks at once plans the looped tier.  The looped tier's plan
    is kept for a refused launch."""
    shape = (5, 2**20)
    x = _core.Operand(0, "float32", shape, (2**20, 1))
    dev = _FakeDevice(H200, capacity)
    prep = _core.prepare_forward(dev, x, x, None, None, False, 0.5, True)
    expected = _plan.plan_forward(5, 2**20, "float32", "none", True, True, H200)
    assert dev.asked == [(expected.kernel, expected.smem, 256)]
    g = expected.coop
    if capacity < g:
        assert prep.plan.tier == "loop" and prep.coop is None and prep.fallback is None
        assert prep.plan == _plan.plan_forward(5, 2**20, "float32", "none", True, True, None)
    else:
        groups = min(5, capacity // g)
        assert prep.coop == (g, groups) and prep.plan.grid == g * groups and prep.cluster is None
        assert prep.fallback == _plan.plan_forward(5, 2**20, "float32", "none", True, True, None)
        # the looped kernel reads the same parameters
        v_coop = _core.forward_params(x, x, None, None, False, 0.5, True, caps=H200)[0]
        v_loop = _core.forward_params(x, x, None, None, False, 0.5, True)[0]
        assert v_coop == v_loop
    dev = _FakeDevice(H200, capacity)
    prep = _core.prepare_backward(dev, x, x, x, 0.5, True)
    assert _plan.plan_backward(5, 2**20, "float32", True, True, H200).coop == 128
    assert prep.plan.tier == ("coop" if capacity >= 128 else "loop")
    # Short rows never ask.
    dev = _FakeDevice(A100, capacity)
    short = _core.Operand(0, "float16", (4, 1000), (1000, 1))
    prep = _core.prepare_forward(dev, short, short, None, None, False, 1.0, True)
    assert prep.plan.tier == "register" and prep.coop is None and dev.asked == []


def test_coop_kernels_are_built_for_every_architecture():
    """The PTX of sm_75, sm_80 and sm_90 holds the grid barrier on the driver's workspace
    (%envreg1/%envreg2, a gpu-scope fence, atomic add and acquire polls) and relaxed loads
    of the pairs; cp.async from sm_80 only."""
    try:
        _compiler.nvrtc_version()
    except Exception as e:  # no NVRTC library on this machine
        pytest.skip(f"NVRTC unavailable: {type(e).__name__}: {e}")
    names = [_plan.kernel_fwd_coop("float16", "hide1"), _plan.kernel_bwd_coop("float32", _plan.CLUSTER_REG)]
    for arch in ("compute_75", "compute_80", "compute_90"):
        text = _compiler.compile_kernels(arch, names).image.decode(errors="replace")
        for needle in ("%envreg1", "%envreg2", "fence.acq_rel.gpu", "atom.add.relaxed.gpu", "ld.acquire.gpu"):
            assert text.count(needle) >= 2, (arch, needle)  # in both kernels
        assert "ld.relaxed.gpu" in text and "barrier.cluster" not in text
        assert ("cp.async" in text) == (arch != "compute_75"), arch


class _FakeDriver:
    """The driver calls of a coop launch, recorded; cuLaunchCooperativeKernel answers `coop_err`."""

    def __init__(self, coop_err):
        self.coop_err = coop_err
        self.calls = []

    def cuCtxGetCurrent(self):
        return (0, "ctx")

    def cuLaunchCooperativeKernel(self, f, gx, gy, gz, bx, by, bz, smem, stream, params):
        self.calls.append(("coop", f, gx, gy, gz, bx, smem))
        return (self.coop_err,)

    def cuLaunchKernel(self, f, gx, gy, gz, bx, by, bz, smem, stream, params, extra):
        self.calls.append(("plain", f, gx, gy, gz, bx, smem))
        return (0,)


class _LaunchDevice(_FakeDevice):
    ctx = "ctx"

    def function(self, name):
        return "F:" + name


@pytest.mark.parametrize("coop_err", [0, 720, 1])
def test_coop_launch_and_its_fallback_when_refused(monkeypatch, coop_err):
    """A coop launch is one cuLaunchCooperativeKernel of grid (G, groups) with its shared
    memory; refused as too large (720), it and every later launch of the same prepared
    launch run the looped tier with the same parameters; other errors raise."""
    from drvsoftmax._errors import CudaDriverError

    drv = _FakeDriver(coop_err)
    monkeypatch.setattr(_core, "_drv", drv)
    monkeypatch.setattr(_core, "_stream_obj", lambda s: s)
    x = _core.Operand(0, "float32", (5, 2**20), (2**20, 1))
    prep = _core.prepare_forward(_LaunchDevice(H200, 10**6), x, x, None, None, False, 0.5, True)
    g, groups = prep.coop
    kernel, smem = prep.plan.kernel, prep.plan.smem
    loop = _plan.plan_forward(5, 2**20, "float32", "none", True, True, None)
    if coop_err == 1:
        with pytest.raises(CudaDriverError, match="cuLaunchCooperativeKernel"):
            _core.launch(prep, 1, 2, 0, 0, 7)
        assert prep.coop == (g, groups)
        return
    _core.launch(prep, 1, 2, 0, 0, 7)
    _core.launch(prep, 1, 2, 0, 0, 7)
    first = ("coop", "F:" + kernel, g, groups, 1, 256, smem)
    if coop_err == 0:
        assert drv.calls == [first, first] and prep.coop == (g, groups)
    else:
        plain = ("plain", "F:" + loop.kernel, loop.grid, 1, 1, 256, 0)
        assert drv.calls == [first, plain, plain]
        assert prep.coop is None and prep.plan == loop and prep.grid == 5


class _FakeSplitDriver(_FakeDriver):
    """The driver calls of a split launch, recorded; cuMemAllocAsync answers the errors of
    `alloc_errs` in turn (then 0)."""

    def __init__(self, alloc_errs):
        super().__init__(0)
        self.alloc_errs = list(alloc_errs)

    def cuMemAllocAsync(self, nbytes, stream):
        err = self.alloc_errs.pop(0) if self.alloc_errs else 0
        self.calls.append(("alloc", nbytes, err))
        return (err, 0 if err else 4096)

    def cuMemsetD32Async(self, ptr, value, count, stream):
        self.calls.append(("memset", ptr, value, count))
        return (0,)

    def cuMemFreeAsync(self, ptr, stream):
        self.calls.append(("free", ptr))
        return (0,)


@pytest.mark.default_policy
@pytest.mark.parametrize("alloc_errs", [[], [2], [801]])
def test_split_launch_and_its_fallbacks_when_the_workspace_is_refused(monkeypatch, alloc_errs):
    """A split launch allocates its workspace on the stream, zeroes it, launches grid (S, G)
    and frees it.  A pool out of memory (2) runs the looped tier for that launch only; a
    device without stream-ordered memory (801, not supported; any other error alike) moves
    this launch and every later one of the same prepared launch to the looped tier."""
    monkeypatch.setattr(_plan, "FORCE_SPLIT", True)
    drv = _FakeSplitDriver(alloc_errs)
    monkeypatch.setattr(_core, "_drv", drv)
    monkeypatch.setattr(_core, "_stream_obj", lambda s: s)
    rows, sk = 4, 2**20
    x = _core.Operand(0, "float32", (rows, sk), (sk, 1))
    prep = _core.prepare_forward(_LaunchDevice(A100, 10**6), x, x, None, None, False, 0.5, True)
    assert prep.plan.tier == "split" and prep.split is not None
    segs, groups, nbytes = prep.split
    assert nbytes == rows * segs * _plan.SPLIT_SLOT
    loop = _plan.plan_forward(rows, sk, "float32", "none", True, True, None)
    split = [
        ("alloc", nbytes, 0),
        ("memset", 4096, 0, nbytes // 4),
        ("plain", "F:" + prep.plan.kernel, segs, groups, 1, 256, 0),
        ("free", 4096),
    ]
    plain = ("plain", "F:" + loop.kernel, loop.grid, 1, 1, 256, 0)
    _core.launch(prep, 1, 2, 0, 0, 7)
    _core.launch(prep, 1, 2, 0, 0, 7)
    if not alloc_errs:
        assert drv.calls == split + split
    elif alloc_errs == [2]:
        assert drv.calls == [("alloc", nbytes, 2), plain] + split
        assert prep.split == (segs, groups, nbytes) and prep.plan.tier == "split"
    else:
        assert drv.calls == [("alloc", nbytes, 801), plain, plain]
        assert prep.split is None and prep.plan == loop and prep.grid == rows
