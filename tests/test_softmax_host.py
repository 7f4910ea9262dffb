"""The eager torch fast path and the launch's argument slots, on the CPU with the driver faked.

A CPU tensor is dressed as a CUDA one (is_cuda, get_device) and the driver records each
cuLaunchKernel, reading the kernel arguments back from the memory the launch points at.
"""

from __future__ import annotations

import ctypes
from types import SimpleNamespace

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import drvsoftmax  # noqa: E402
import drvsoftmax.torch as dt  # noqa: E402
from drvsoftmax import _core, _driver  # noqa: E402


class _FakeDevice:
    ordinal, arch, cc, sm_count, name, ctx = 0, "sm_90", 90, 132, "fake", "ctx0"

    def kernel(self, name):
        return f"CUkernel<{name}>"

    def function(self, name):
        return f"CUfunction<{name}>"


class _Driver:
    CUlaunchConfig = SimpleNamespace

    def __init__(self):
        self.launches = []

    def cuLaunchKernel(self, f, gx, gy, gz, bx, by, bz, shmem, stream, argv, extra):
        nargs = 4 if "bwd" in f else 5
        slots = (ctypes.c_uint64 * nargs).from_address(argv)
        ptrs = [ctypes.c_uint64.from_address(slots[i]).value for i in range(nargs - 1)]
        self.launches.append({"f": f, "grid": gx, "block": bx, "stream": stream, "ptrs": ptrs, "params": slots[-1]})
        return (0,)

    def cuLaunchKernelEx(self, cfg, f, argv, extra):
        assert cfg.numAttrs == 0 and (cfg.gridDimY, cfg.gridDimZ, cfg.blockDimY, cfg.blockDimZ) == (1, 1, 1, 1)
        err = self.cuLaunchKernel(f, cfg.gridDimX, 1, 1, cfg.blockDimX, 1, 1, cfg.sharedMemBytes, cfg.hStream, argv, 0)
        self.launches[-1]["ex"] = True
        return err


@pytest.fixture
def fake_cuda(monkeypatch):
    return _driver_fakes(monkeypatch)


def _driver_fakes(monkeypatch):
    drv = _Driver()
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    monkeypatch.setattr(torch.Tensor, "get_device", lambda self: 0)
    monkeypatch.setattr(dt, "_raw_stream", lambda dev: 0x7F00)
    monkeypatch.setattr(dt, "_current_device", lambda: 0)
    monkeypatch.setattr(_driver, "device", lambda ordinal: _FakeDevice())
    monkeypatch.setattr(_core, "_drv", drv)
    monkeypatch.setattr(dt, "_prepared", {})
    monkeypatch.setattr(dt, "_fast", {})
    return drv


def _x(shape=(2, 3, 8, 64), dtype=torch.float16):
    n = 1
    for d in shape:
        n *= d
    buf = torch.randn(n + 256).to(dtype)
    off = (-buf.data_ptr() % 256) // buf.element_size()
    return buf[off : off + n].view(shape)


def test_fast_path_launches_what_the_full_path_prepared(fake_cuda, monkeypatch):
    x = _x()
    y1 = dt.scaled_masked_softmax(x, scale=0.5)
    assert len(dt._fast) == 1, "the first call (full path) leaves a fast-path entry"
    full = fake_cuda.launches[-1]

    def no_full_path(*a, **k):
        raise AssertionError("the full path ran for a layout seen before")

    monkeypatch.setattr(dt, "_forward_impl", no_full_path)
    y2 = drvsoftmax.scaled_masked_softmax(x, scale=0.5)
    fast = fake_cuda.launches[-1]
    assert fast["f"] == full["f"] and fast["f"].startswith("CUfunction<")
    assert fast.get("ex") and not full.get("ex"), "the fast path launches by cuLaunchKernelEx"
    assert (fast["grid"], fast["block"], fast["params"]) == (full["grid"], full["block"], full["params"])
    assert int(fast["stream"]) == int(full["stream"]) == 0x7F00
    assert fast["ptrs"] == [x.data_ptr(), y2.data_ptr(), 0, 0]
    assert full["ptrs"] == [x.data_ptr(), y1.data_ptr(), 0, 0]
    assert y2.shape == x.shape and y2.dtype == x.dtype and y2.stride() == x.stride()


def test_fast_path_keeps_every_check(fake_cuda):
    x = _x()
    dt.scaled_masked_softmax(x, scale=1.0, causal=True)
    assert len(dt._fast) == 1
    with pytest.raises(drvsoftmax.DrvSoftmaxError, match="scale"):
        dt.scaled_masked_softmax(x, scale=True, causal=True)  # == 1.0, but a bool
    with pytest.raises(drvsoftmax.DrvSoftmaxError, match="causal"):
        dt.scaled_masked_softmax(x, scale=1.0, causal=1)  # == True, but an int
    # Another layout, dtype or alignment is a new key, prepared on the full path.
    n = len(fake_cuda.launches)
    dt.scaled_masked_softmax(x.transpose(1, 2), scale=1.0, causal=True)
    dt.scaled_masked_softmax(_x(dtype=torch.float32), scale=1.0, causal=True)
    dt.scaled_masked_softmax(_x((2 * 3 * 8 * 64 + 1,))[1:].view(2, 3, 8, 64), scale=1.0, causal=True)
    assert len(dt._fast) == 4 and len(fake_cuda.launches) == n + 3


def test_fast_path_leaves_autograd_to_autograd(fake_cuda):
    x = _x(dtype=torch.float32)
    dt.scaled_masked_softmax(x, scale=0.5)
    xg = x.detach().requires_grad_(True)
    y = dt.scaled_masked_softmax(xg, scale=0.5)
    assert y.grad_fn is not None, "x requiring grad takes the autograd path"
    with torch.no_grad():
        assert dt.scaled_masked_softmax(xg, scale=0.5).grad_fn is None


def test_backward_launch_writes_three_pointers(fake_cuda):
    y = _x()
    dy = _x()
    dx = dt.scaled_masked_softmax_backward(dy, y, scale=2.0)
    got = fake_cuda.launches[-1]
    assert got["f"].startswith("CUfunction<smx_bwd")
    assert got["ptrs"] == [dy.data_ptr(), y.data_ptr(), dx.data_ptr()]


def test_host_benchmark_runs_stubbed():
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    r = subprocess.run(
        [sys.executable, str(repo / "benchmarks" / "host_torch.py"), "--stub", "--calls", "50", "--repeats", "2"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=str(repo),
    )
    assert r.returncode == 0, r.stdout + r.stderr
    for row in ("drvsoftmax.torch", "drvsoftmax ", "launch only", "torch.empty_like"):
        assert row in r.stdout, r.stdout


class _PickyDriver(_Driver):
    """Refuses the CUfunction with `code` (as a stream of another context would), takes the CUkernel."""

    def __init__(self, code):
        super().__init__()
        self.code = code

    def cuLaunchKernel(self, f, *rest):
        if f.startswith("CUfunction<"):
            self.launches.append({"f": f, "refused": self.code})
            return (self.code,)
        return super().cuLaunchKernel(f, *rest)


@pytest.mark.parametrize("code", [400, 201])
def test_launch_falls_back_to_the_kernel_handle(fake_cuda, monkeypatch, code):
    drv = _PickyDriver(code)
    monkeypatch.setattr(_core, "_drv", drv)
    x = _x()
    y = dt.scaled_masked_softmax(x, scale=0.5)
    assert [launch["f"].split("<")[0] for launch in drv.launches] == ["CUfunction", "CUkernel"]
    assert drv.launches[-1]["ptrs"] == [x.data_ptr(), y.data_ptr(), 0, 0]


def test_launch_error_is_raised_not_retried(fake_cuda, monkeypatch):
    drv = _PickyDriver(700)  # CUDA_ERROR_ILLEGAL_ADDRESS: no retry
    monkeypatch.setattr(_core, "_drv", drv)
    with pytest.raises(drvsoftmax.CudaDriverError, match="cuLaunchKernel"):
        dt.scaled_masked_softmax(_x(), scale=0.5)
    assert len(drv.launches) == 1


def test_fast_path_keys_a_contiguous_x_by_its_shape(fake_cuda, monkeypatch):
    """Contiguous x of one shape share an entry whatever the strides of their size-1 dims
    (torch.empty_like keeps those strides; no element moves); a strided x has its own."""
    x = _x((1, 3, 8, 64))
    dt.scaled_masked_softmax(x, scale=0.5)
    full = fake_cuda.launches[-1]
    odd = x.as_strided(x.shape, (7, 512, 64, 1))  # the size-1 dim's stride is never used
    assert odd.is_contiguous() and odd.stride() != x.stride()

    def no_full_path(*a, **k):
        raise AssertionError("the full path ran for a contiguous layout of a shape seen before")

    monkeypatch.setattr(dt, "_forward_impl", no_full_path)
    y = drvsoftmax.scaled_masked_softmax(odd, scale=0.5)
    fast = fake_cuda.launches[-1]
    assert len(dt._fast) == 1 and (fast["f"], fast["params"]) == (full["f"], full["params"])
    assert fast["ptrs"] == [x.data_ptr(), y.data_ptr(), 0, 0] and y.is_contiguous()
    monkeypatch.undo()
    # (undo dropped the fixture too: set it up again for a strided x of that shape)
    fake_cuda = _driver_fakes(monkeypatch)
    dt.scaled_masked_softmax(x, scale=0.5)
    dt.scaled_masked_softmax(x.transpose(1, 2).contiguous().transpose(1, 2), scale=0.5)
    assert len(dt._fast) == 2 and len(fake_cuda.launches) == 2


def test_fast_path_relaunches_and_raises_as_the_launcher_does(fake_cuda, monkeypatch):
    """The fast path's own cuLaunchKernel: a CUfunction refused for its context is launched
    again through the CUkernel; any other error is raised, not retried."""
    x = _x()
    dt.scaled_masked_softmax(x, scale=0.5)
    assert len(dt._fast) == 1
    drv = _PickyDriver(400)
    monkeypatch.setattr(_core, "_drv", drv)
    y = drvsoftmax.scaled_masked_softmax(x, scale=0.5)
    assert [launch["f"].split("<")[0] for launch in drv.launches] == ["CUfunction", "CUkernel"]
    assert drv.launches[-1]["ptrs"] == [x.data_ptr(), y.data_ptr(), 0, 0]
    monkeypatch.setattr(_core, "_drv", _PickyDriver(700))
    with pytest.raises(drvsoftmax.CudaDriverError, match="cuLaunchKernel"):
        dt.scaled_masked_softmax(x, scale=0.5)


def test_fast_path_leaves_other_launches_to_the_launcher(fake_cuda, monkeypatch):
    """A tier launched otherwise than by one cuLaunchKernel (cluster, coop, split), or the
    default stream while another device is current, goes through _core.launch."""
    x = _x()
    dt.scaled_masked_softmax(x, scale=0.5)
    ((key, ent),) = dt._fast.items()
    prep = ent[-1]
    assert ent[0] == prep.func and ent[2] == prep.params_addr
    calls = []
    monkeypatch.setattr(_core, "launch", lambda *a: calls.append(a))
    monkeypatch.setattr(dt, "_raw_stream", lambda dev: 0)
    monkeypatch.setattr(dt, "_current_device", lambda: 1)
    y = dt.scaled_masked_softmax(x, scale=0.5)
    assert calls == [(prep, x.data_ptr(), y.data_ptr(), 0, 0, 0, False)]
    monkeypatch.setattr(dt, "_current_device", lambda: 0)
    prep.cluster = object()
    dt._fast[key] = _core.fast_entry(prep)
    assert dt._fast[key][0] is None
    y = drvsoftmax.scaled_masked_softmax(x, scale=0.5)
    assert calls[-1] == (prep, x.data_ptr(), y.data_ptr(), 0, 0, 0, True)
    assert len(fake_cuda.launches) == 1


def test_gpu_test_helpers_describe_tensors():
    """The GPU tests' shared helpers, on CPU tensors: host values (bfloat16 as float32, exact)
    and the core's Operand of a strided view."""
    from helpers import operand, to_numpy

    x = torch.randn(3, 4, 5).to(torch.bfloat16)
    v = x.transpose(0, 2)
    got = to_numpy(v)
    assert got.dtype == np.float32 and got.shape == (5, 4, 3)
    assert np.array_equal(got, v.float().numpy())
    assert to_numpy(x.half()).dtype == np.float16
    op = operand(v)
    assert op == _core.Operand(x.data_ptr(), "bfloat16", (5, 4, 3), (1, 5, 20))
