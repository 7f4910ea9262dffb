"""PyTorch integration: autograd, torch.library ops, torch.compile, export, graphs, streams.

Tests run on the CPU reference path everywhere and again on CUDA where a GPU exists.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import assert_matches, run_in_threads
from helpers import requires_torch_cuda as requires_cuda
from helpers import torch_cuda_available as cuda_available

torch = pytest.importorskip("torch")
import drvsoftmax  # noqa: E402
from drvsoftmax import _reference  # noqa: E402
from drvsoftmax.torch import ScaledMaskedSoftmax  # noqa: E402

DEVICES = ["cpu"] + (["cuda"] if cuda_available() else [])
ROOT = Path(__file__).resolve().parents[1]


def torch_reference(x, mask=None, scale=1.0, causal=False):
    """The contract written with torch ops (differentiable), for gradients."""
    v = x * scale
    sq, sk = x.shape[-2], x.shape[-1]
    hidden = torch.zeros(x.shape, dtype=torch.bool, device=x.device)
    if causal:
        hidden = hidden | torch.ones(sq, sk, dtype=torch.bool, device=x.device).triu(sk - sq + 1)
    if mask is not None:
        if mask.is_floating_point():
            v = v + mask
        else:
            hidden = hidden | (mask != 0)
    v = v.masked_fill(hidden, float("-inf"))
    return torch.softmax(v, -1).nan_to_num(0.0)


@pytest.mark.parametrize("device", DEVICES)
def test_autograd_matches_torch_and_mask_bias_gets_gradient(device):
    g = torch.Generator().manual_seed(1)
    dtype = torch.float64 if device == "cpu" else torch.float32
    x = torch.randn(2, 3, 5, 37, generator=g, dtype=dtype).to(device).requires_grad_()
    bias = torch.randn(1, 3, 5, 37, generator=g, dtype=dtype).to(device).requires_grad_()
    dy = torch.randn(2, 3, 5, 37, generator=g, dtype=dtype).to(device)
    y = drvsoftmax.scaled_masked_softmax(x, bias, scale=0.7, causal=True)
    gx, gb = torch.autograd.grad(y, (x, bias), dy)
    x2, b2 = x.detach().double().requires_grad_(), bias.detach().double().requires_grad_()
    y2 = torch_reference(x2, b2, 0.7, True)
    rx, rb = torch.autograd.grad(y2, (x2, b2), dy.double())
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(y.double(), y2, **tol)
    torch.testing.assert_close(gx.double(), rx, **tol)
    torch.testing.assert_close(gb.double(), rb, **tol)
    assert gb.shape == bias.shape


@pytest.mark.parametrize("device", DEVICES)
def test_bool_mask_and_key_lengths_get_no_gradient(device):
    x = torch.randn(2, 2, 4, 9, device=device, requires_grad=True)
    m = torch.rand(2, 1, 4, 9, device=device) < 0.3
    kl = torch.tensor([9, 4], device=device)
    y = drvsoftmax.scaled_masked_softmax(x, m, key_lengths=kl, causal=True)
    (gx,) = torch.autograd.grad(y.sum() + (y * y).sum(), (x,))
    assert torch.isfinite(gx).all()
    hidden = torch.from_numpy(
        np.broadcast_to(
            _reference.hidden_positions(tuple(x.shape), m.cpu().numpy(), True, kl.cpu().numpy()), x.shape
        ).copy()
    )
    assert (gx.cpu()[hidden] == 0).all()


@pytest.mark.parametrize("device", DEVICES)
def test_backward_saves_y_not_x(device):
    x = torch.randn(2, 3, 4, 16, device=device, requires_grad=True)
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = drvsoftmax.scaled_masked_softmax(x, scale=0.5)
    ptrs = [t.data_ptr() for t in saved]
    assert y.data_ptr() in ptrs
    assert x.data_ptr() not in ptrs


def test_gradcheck_cpu_float64():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 2, 3, 6, generator=g, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(2, 1, 1, 6, generator=g, dtype=torch.float64, requires_grad=True)

    def f(a, b):
        return drvsoftmax.scaled_masked_softmax(a, b, scale=-0.6, causal=True)

    assert torch.autograd.gradcheck(f, (x, bias))
    assert torch.autograd.gradgradcheck(lambda a: drvsoftmax.scaled_masked_softmax(a, scale=0.4), (x,))


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_both_ops(device):
    dtype = torch.float32
    x = torch.randn(2, 3, 4, 40, device=device, dtype=dtype, requires_grad=True)
    for mask in (
        None,
        torch.rand(2, 1, 4, 40, device=device) < 0.2,
        torch.randn(1, 1, 4, 40, device=device, dtype=dtype, requires_grad=True),
    ):
        for kl in (None, torch.tensor([40, 7], device=device)):
            torch.library.opcheck(torch.ops.drvsoftmax.scaled_masked_softmax, (x, mask, 0.5, True, kl))
    y = torch.softmax(torch.randn(2, 3, 4, 40, device=device), -1).requires_grad_()
    dy = torch.randn(2, 3, 4, 40, device=device, requires_grad=True)
    torch.library.opcheck(torch.ops.drvsoftmax.scaled_masked_softmax_backward, (dy, y, 0.5))


def _attention(q, k, v, bias):
    s = q @ k.transpose(-1, -2)
    p = drvsoftmax.scaled_masked_softmax(s, bias, scale=1.0 / math.sqrt(q.shape[-1]), causal=True)
    return p @ v


@pytest.mark.parametrize("device", DEVICES)
def test_compile_fullgraph_matches_eager(device):
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, 2, 8, 16, generator=g).to(device).requires_grad_() for _ in range(3))
    bias = torch.randn(1, 2, 8, 8, generator=g).to(device).requires_grad_()
    backend = "inductor" if device == "cuda" else "aot_eager"
    compiled = torch.compile(_attention, fullgraph=True, backend=backend)
    out_c = compiled(q, k, v, bias)
    out_e = _attention(q, k, v, bias)
    torch.testing.assert_close(out_c, out_e, rtol=1e-5, atol=1e-5)
    gc = torch.autograd.grad(out_c.sum(), (q, k, v, bias))
    ge = torch.autograd.grad(out_e.sum(), (q, k, v, bias))
    for a, b in zip(gc, ge):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_module_and_export(device):
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.sm = ScaledMaskedSoftmax(scale=0.25, causal=True)

        def forward(self, s, m):
            return self.sm(s, m)

    s = torch.randn(2, 3, 6, 6, device=device)
    m = torch.rand(2, 1, 6, 6, device=device) < 0.2
    ep = torch.export.export(Block(), (s, m))
    assert "drvsoftmax.scaled_masked_softmax" in str(ep.graph)
    torch.testing.assert_close(ep.module()(s, m), Block()(s, m))
    torch.testing.assert_close(Block()(s, m), torch_reference(s, m, 0.25, True), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
def test_out_with_grad_is_refused_and_autocast_keeps_dtype(device):
    x = torch.randn(2, 4, device=device, requires_grad=True)
    with pytest.raises(ValueError, match="out"):
        drvsoftmax.scaled_masked_softmax(x, out=torch.empty(2, 4, device=device))
    dev_type = "cuda" if device == "cuda" else "cpu"
    ac_dtype = torch.float16 if device == "cuda" else torch.bfloat16
    with torch.autocast(dev_type, dtype=ac_dtype):
        y = drvsoftmax.scaled_masked_softmax(x.detach())
    assert y.dtype == torch.float32  # inputs keep their dtype: no silent down- or up-cast


def test_example_runs():
    r = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "torch_attention.py")],
        capture_output=True,
        text=True,
        timeout=600,
        env={**__import__("os").environ, "PYTHONPATH": str(ROOT)},
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "max |drvsoftmax - PyTorch|" in r.stdout


# ----------------------------------------------------------------------------------
# CUDA only: graphs, streams, threads, devices.


def _fresh(shape, dtype=torch.float16):
    return (torch.randn(shape, device="cuda") * 3).to(dtype)


@requires_cuda
def test_cuda_graph_capture_and_replay_forward_backward():
    x = _fresh((2, 4, 64, 300))
    m = torch.rand(2, 1, 64, 300, device="cuda") < 0.2
    dy = _fresh((2, 4, 64, 300))
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up: compile, load, prepare
        for _ in range(2):
            y = drvsoftmax.scaled_masked_softmax(x, m, scale=0.3)
            dx = drvsoftmax.scaled_masked_softmax_backward(dy, y, scale=0.3)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = drvsoftmax.scaled_masked_softmax(x, m, scale=0.3)
        dx = drvsoftmax.scaled_masked_softmax_backward(dy, y, scale=0.3)
    for _ in range(2):
        x.copy_(_fresh(x.shape))
        dy.copy_(_fresh(dy.shape))
        y.fill_(float("nan"))
        dx.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ry = _reference.softmax_forward(x.float().cpu().numpy(), m.cpu().numpy(), 0.3)
        assert_matches(y.float().cpu().numpy(), ry, "float16", "graph forward")
        rdx = _reference.softmax_backward(dy.float().cpu().numpy(), y.float().cpu().numpy(), 0.3)
        np.testing.assert_allclose(dx.float().cpu().numpy(), rdx, atol=2e-3, rtol=2e-2)


@requires_cuda
def test_long_producer_on_same_stream_needs_no_host_sync():
    s = torch.cuda.Stream()
    x = torch.empty((8, 16, 128, 512), device="cuda", dtype=torch.float16)
    src = _fresh(x.shape)
    # Load both kernels first: a first call may read them from disk, which can take longer
    # than the producer below runs (that is loading, not a host sync).
    drvsoftmax.scaled_masked_softmax_backward(src, drvsoftmax.scaled_masked_softmax(src, scale=0.5), scale=1.0)
    torch.cuda.synchronize()
    with torch.cuda.stream(s):
        torch.cuda._sleep(50_000_000)  # ~25 ms of GPU time before the data exists
        x.copy_(src)
        y = drvsoftmax.scaled_masked_softmax(x, scale=0.5)
        z = drvsoftmax.scaled_masked_softmax_backward(y, y, scale=1.0)
    assert not s.query(), "the producer should still be running: our op must not have synchronised"
    s.synchronize()
    ref = _reference.softmax_forward(src.float().cpu().numpy(), None, 0.5)
    assert_matches(y.float().cpu().numpy(), ref, "float16", "after producer")
    assert torch.isfinite(z).all()


@requires_cuda
def test_threads_without_a_current_context():
    x = _fresh((3, 5, 200))
    ref = _reference.softmax_forward(x.float().cpu().numpy(), None, 1.0)
    results = []

    def work(_):
        for _ in range(20):
            y = drvsoftmax.scaled_masked_softmax(x)  # NULL stream, fresh thread
            s = torch.cuda.Stream()
            y2 = drvsoftmax.scaled_masked_softmax(x, stream=s)
            s.synchronize()
            torch.cuda.synchronize()
            results.append((y.float().cpu().numpy(), y2.float().cpu().numpy()))

    errors = run_in_threads(work, 4)
    assert not errors, errors
    for a, b in results:
        assert_matches(a, ref, "float16", "thread")
        assert_matches(b, ref, "float16", "thread, own stream")


@requires_cuda
def test_tensor_on_another_device_than_current():
    n = torch.cuda.device_count()
    if n < 2:
        pytest.skip("needs two GPUs: a tensor on cuda:1 while cuda:0 is current")
    with torch.cuda.device(0):
        x = _fresh((2, 3, 4, 100)).to("cuda:1").requires_grad_()
        s1 = torch.cuda.Stream(device=1)
        with torch.cuda.stream(s1):  # cuda:1's current stream, while cuda:0 is the current device
            y = drvsoftmax.scaled_masked_softmax(x, causal=True)
            (gx,) = torch.autograd.grad(y, (x,), torch.ones_like(y))
        s1.synchronize()
    assert y.device == x.device == gx.device
    ref = _reference.softmax_forward(x.detach().float().cpu().numpy(), None, 1.0, True)
    assert_matches(y.detach().float().cpu().numpy(), ref, "float16", "cuda:1")
    assert gx.abs().max().item() < 1e-2  # d/dx of sum(softmax) is 0

    def work(i):
        dev = i % 2
        with torch.cuda.device(1 - dev):  # the other device is current
            xi = _fresh((3, 5, 300)).to(f"cuda:{dev}")
            for _ in range(10):
                yi = drvsoftmax.scaled_masked_softmax(xi, scale=0.5)
                torch.cuda.synchronize(dev)
                assert_matches(
                    yi.float().cpu().numpy(),
                    _reference.softmax_forward(xi.float().cpu().numpy(), None, 0.5),
                    "float16",
                    "thr",
                )

    errors = run_in_threads(work, 4)
    assert not errors, errors


@requires_cuda
def test_data_parallel_step_matches_single_process():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs: examples/ddp_attention.py runs one process per GPU")
    r = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "ddp_attention.py")],
        capture_output=True,
        text=True,
        timeout=900,
        env={**__import__("os").environ, "PYTHONPATH": str(ROOT), "NCCL_NVLS_ENABLE": "0"},
    )
    assert r.returncode == 0, r.stdout + r.stderr


# ----------------------------------------------------------------------------------
# The eager backward function on tensors that require grad: differentiable, as the
# compiled path (torch.ops...scaled_masked_softmax_backward) is.


def _backward_reference(dy, y, s):
    """dx = s*y*(dy - <dy, y>) written with torch ops (differentiable), in float64."""
    return s * y * (dy - (dy * y).sum(-1, keepdim=True))


@pytest.mark.parametrize("device", DEVICES)
def test_eager_backward_is_differentiable_like_the_compiled_path(device):
    g = torch.Generator().manual_seed(11)
    dtype = torch.float64 if device == "cpu" else torch.float32
    x = torch.randn(2, 3, 4, 33, generator=g, dtype=dtype).to(device)
    y = drvsoftmax.scaled_masked_softmax(x, scale=0.6).requires_grad_()
    dy = torch.randn(x.shape, generator=g, dtype=dtype).to(device).requires_grad_()
    gdx = torch.randn(x.shape, generator=g, dtype=dtype).to(device)
    dx = drvsoftmax.scaled_masked_softmax_backward(dy, y, scale=0.6)
    assert dx.requires_grad and dx.grad_fn is not None
    got = torch.autograd.grad(dx, (dy, y), gdx)
    dxc = torch.ops.drvsoftmax.scaled_masked_softmax_backward(dy, y, 0.6)
    want_c = torch.autograd.grad(dxc, (dy, y), gdx)
    dy2, y2 = dy.detach().double().requires_grad_(), y.detach().double().requires_grad_()
    want = torch.autograd.grad(_backward_reference(dy2, y2, 0.6), (dy2, y2), gdx.double())
    tol = dict(rtol=1e-10, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(dx.double(), _backward_reference(dy2, y2, 0.6).detach(), **tol)
    for a, b, c in zip(got, want_c, want):
        torch.testing.assert_close(a.double(), c, **tol)
        torch.testing.assert_close(a, b, **tol)
    # Only one of them requiring grad: still differentiable in that one.
    dx1 = drvsoftmax.scaled_masked_softmax_backward(dy.detach(), y, scale=0.6)
    (gy1,) = torch.autograd.grad(dx1, (y,), gdx)
    torch.testing.assert_close(gy1.double(), want[1], **tol)
    with torch.no_grad():  # grad mode off: a plain result, as everywhere in torch
        assert not drvsoftmax.scaled_masked_softmax_backward(dy, y, scale=0.6).requires_grad


def test_eager_backward_gradcheck_cpu_float64():
    g = torch.Generator().manual_seed(12)
    y = torch.softmax(torch.randn(2, 3, 7, generator=g, dtype=torch.float64), -1).requires_grad_()
    dy = torch.randn(2, 3, 7, generator=g, dtype=torch.float64, requires_grad=True)

    def f(a, b):
        return drvsoftmax.scaled_masked_softmax_backward(a, b, scale=-0.8)

    assert torch.autograd.gradcheck(f, (dy, y))
    assert torch.autograd.gradgradcheck(f, (dy, y))


# ----------------------------------------------------------------------------------
# key_lengths: one dtype rule everywhere (any integer dtype; values clamp to [0, Sk]).

_INT_TORCH = [torch.int8, torch.uint8, torch.int16, torch.uint16, torch.int32, torch.uint32, torch.int64, torch.uint64]


def _limits(dt):
    info = torch.iinfo(dt)
    return info.min, info.max


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kdtype", _INT_TORCH, ids=str)
def test_key_lengths_of_every_integer_dtype(device, kdtype):
    sk = 300
    lo, hi = _limits(kdtype)
    # The extremes of the dtype, 0, Sk and values on either side of Sk and of 2**15.
    vals = [v for v in (lo, hi, 0, 1, sk - 1, sk, sk + 1, 32767, 32768, 40000, 2**31 + 5) if lo <= v <= hi]
    kl = torch.tensor(vals, dtype=kdtype) if kdtype != torch.uint64 else _uint64(vals)
    x = torch.randn(len(vals), 2, 3, sk, device=device)
    y = drvsoftmax.scaled_masked_softmax(x, key_lengths=kl.to(device), scale=0.5)
    if device == "cuda":
        torch.cuda.synchronize()
    ref = _reference.softmax_forward(x.cpu().numpy(), None, 0.5, False, np.array(vals, dtype=object).astype(float))
    assert_matches(y.cpu().numpy(), ref, "float32", f"key_lengths {kdtype}")


def _uint64(vals):
    return torch.from_numpy(np.array(vals, dtype=np.uint64))


def test_key_lengths_conversion_for_the_kernels_keeps_every_value():
    # The GPU path converts dtypes the kernels do not read to int64; the conversion is
    # device-agnostic, so it is checked here on every value class of every dtype.
    from drvsoftmax.torch import _lengths_int64

    rng = np.random.default_rng(5)
    for dt in _INT_TORCH:
        lo, hi = _limits(dt)
        vals = [lo, hi, 0, 1, hi // 2, hi // 2 + 1] + [
            int(v) for v in rng.integers(lo, hi, 50, endpoint=True, dtype=np.int64 if hi < 2**63 else np.uint64)
        ]
        src = _uint64(vals) if dt == torch.uint64 else torch.tensor(vals, dtype=dt)
        for t in (src, src[::2]):  # contiguous and strided
            got = _lengths_int64(t)
            assert got.dtype == torch.int64 and got.is_contiguous()
            want = [min(int(v), 2**63 - 1) for v in (vals if t is src else vals[::2])]
            assert got.tolist() == want, dt


@pytest.mark.parametrize("stream", [0, 7, None])
def test_cpu_paths_take_a_valid_stream(stream):
    # stream= is validated on the CPU paths too (bad ones are in test_softmax_badinput);
    # a valid one changes nothing there.
    x = torch.randn(2, 3, 9)
    want = drvsoftmax.scaled_masked_softmax(x, scale=0.3)
    assert torch.equal(drvsoftmax.scaled_masked_softmax(x, scale=0.3, stream=stream), want)
    assert np.array_equal(
        drvsoftmax.scaled_masked_softmax(x.numpy(), scale=0.3, stream=stream),
        drvsoftmax.scaled_masked_softmax(x.numpy(), scale=0.3),
    )
    dy = torch.randn(2, 3, 9)
    assert torch.equal(
        drvsoftmax.scaled_masked_softmax_backward(dy, want, stream=stream),
        drvsoftmax.scaled_masked_softmax_backward(dy, want),
    )


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_prepared_launches_are_forgotten_in_a_forked_child():
    # A child of fork() has no CUDA context: launches prepared by the parent must not be
    # reused there (its next call prepares again and meets the driver's fork check).
    from drvsoftmax import torch as dtorch

    key = ("a prepared launch of the parent",)
    dtorch._prepared[key] = (object(), ())
    try:
        pid = os.fork()
        if pid == 0:  # the child: report through the exit status only
            os._exit(0 if key not in dtorch._prepared else 1)
        _, status = os.waitpid(pid, 0)
    finally:
        dtorch._prepared.pop(key, None)
    assert os.waitstatus_to_exitcode(status) == 0


def test_cached_overlap_screen_agrees_with_the_overlap_check():
    # The CUDA fast path screens out= calls with cached spans and pointers; whatever it
    # decides must be what _args.check_no_overlap decides on the same tensors.  Random
    # views of one buffer (shifted, strided, transposed, equal), on the CPU.
    from drvsoftmax import _args
    from drvsoftmax.torch import _OutSpans, _region

    rng = np.random.default_rng(3)
    base = torch.zeros(4000)
    shape = (2, 3, 4, 5)
    layouts = [(60, 20, 5, 1), (60, 20, 1, 4), (120, 40, 10, 2), (0, 20, 5, 1), (1, 2, 6, 24)]

    def view(offset, strides):
        return base.as_strided(shape, strides, offset)

    decided = {True: 0, False: 0}
    for _ in range(3000):
        xs = layouts[rng.integers(len(layouts))]
        os_ = (60, 20, 5, 1) if rng.random() < 0.7 else (120, 40, 10, 2)
        x = view(int(rng.integers(0, 300)), xs)
        out = x if rng.random() < 0.15 and xs[0] else view(int(rng.integers(0, 300)), os_)
        # Masks and lengths anywhere, or just touching out's first or last element (+-2).
        lo, hi = out.storage_offset(), out.storage_offset() + sum((n - 1) * st for n, st in zip(shape, out.stride()))
        edge = int(rng.choice([lo - 20, hi])) + int(rng.integers(-2, 3))
        moff = edge if rng.random() < 0.5 else int(rng.integers(0, 3000))
        koff = (
            int(rng.choice([lo - 2, hi])) + int(rng.integers(-2, 3))
            if rng.random() < 0.5
            else int(rng.integers(0, 3000))
        )
        mask = base.as_strided((4, 5), (5, 1), max(moff, 0)) if rng.random() < 0.6 else None
        kl = base.view(torch.int32).as_strided((2,), (1,), max(koff, 0)) if rng.random() < 0.6 else None
        try:
            _args.check_no_overlap(
                _region("out", out), (_region("x", x), _region("mask", mask), _region("key_lengths", kl)), ("x",)
            )
            want = False
        except drvsoftmax.ArgumentValueError:
            want = True
        spans = _OutSpans(x, out, mask, kl)
        # Later calls of the same layouts at other pointers: shift everything alike.
        try:
            spans.check(out.data_ptr(), x.data_ptr(), 0 if mask is None else mask.data_ptr(), kl)
            got = False
        except drvsoftmax.ArgumentValueError:
            got = True
        assert got == want, (xs, os_, x.storage_offset(), out.storage_offset())
        decided[want] += 1
    assert decided[True] > 300 and decided[False] > 300, decided
