"""Per-device state, with fake devices on the CPU.

Each device keeps its own kernel table (loaded into its own primary context) and its
own prepared launches; devices of one architecture share the loaded image.  The driver
is replaced by fakes, so this runs without a GPU.
"""

from __future__ import annotations

import pytest
from helpers import run_in_threads

from drvsoftmax import _core, _driver, _loader


@pytest.fixture
def fake_driver(monkeypatch):
    archs = {0: "sm_90", 1: "sm_90", 2: "sm_80"}
    found = []

    def fake_find_kernel(name, arch, driver_version):
        found.append((name, arch))
        return f"CUkernel<{arch}:{name}>", f"fake {arch}"

    monkeypatch.setattr(_driver, "_devices", {})
    monkeypatch.setattr(_driver, "_init_pid", __import__("os").getpid())
    monkeypatch.setattr(_driver, "_driver_version", 13000)
    monkeypatch.setattr(_loader, "find_kernel", fake_find_kernel)

    def fake_device_init(self, ordinal):
        self.ordinal, self.arch, self.cc = ordinal, archs[ordinal], int(archs[ordinal][3:])
        self.sm_count, self.name, self.ctx = 132, f"fake{ordinal}", f"ctx{ordinal}"
        self._kernels, self._functions, self.origins = {}, {}, {}
        self.pushed = []

    monkeypatch.setattr(_driver.Device, "__init__", fake_device_init)

    class D:  # the driver calls Device.kernel and device() make
        @staticmethod
        def cuDeviceGetCount():
            return (0, len(archs))

        @staticmethod
        def cuCtxPushCurrent(ctx):
            return (0,)

        @staticmethod
        def cuKernelGetFunction(k):
            return (0, f"CUfunction<{k}>")

        @staticmethod
        def cuCtxPopCurrent():
            return (0, None)

    monkeypatch.setattr(_driver, "_drv", lambda: D)
    yield found


def test_one_state_per_device_and_kernels_per_device(fake_driver):
    d0, d1, d2 = (_driver.device(i) for i in range(3))
    assert _driver.device(1) is d1 and len({id(d0), id(d1), id(d2)}) == 3
    name = "smx_fwd<smx_f16, MaskNone, 2, 1, true>"
    k0, k1, k2 = d0.kernel(name), d1.kernel(name), d2.kernel(name)
    assert k0 == k1 == "CUkernel<sm_90:" + name + ">" and k2 == "CUkernel<sm_80:" + name + ">"
    # Looked up for each device (each loads it into its own context), by its own architecture.
    assert fake_driver == [(name, "sm_90"), (name, "sm_90"), (name, "sm_80")]
    d0.kernel(name)
    assert len(fake_driver) == 3, "a device looks a kernel up once"
    with pytest.raises(Exception, match="out of range"):
        _driver.device(3)


def test_prepared_launches_are_keyed_by_device(fake_driver, monkeypatch):
    launched = []
    monkeypatch.setattr(_core, "launch", lambda prep, *a: launched.append((prep, a)))
    monkeypatch.setattr(_core, "_cache", {})
    shape = (2, 3, 4, 64)
    st = (768, 256, 64, 1)
    for ordinal in (0, 1, 0, 2):
        dev = _driver.device(ordinal)
        x = _core.Operand(0x10000 * (ordinal + 1), "float16", shape, st)
        y = _core.Operand(0x20000 * (ordinal + 1), "float16", shape, st)
        _core.forward(dev, x, y, None, None, False, 1.0, 7)
    preps = [p for p, _ in launched]
    assert preps[0] is preps[2], "the same device and layout reuse the prepared launch"
    assert preps[0] is not preps[1] and preps[1] is not preps[3]
    assert [p.dev.ordinal for p in preps] == [0, 1, 0, 2]
    assert preps[3].kernel.startswith("CUkernel<sm_80")


def test_devices_from_many_threads_at_once(fake_driver):
    got = []

    def work(i):
        for _ in range(50):
            dev = _driver.device(i % 3)
            got.append((i % 3, dev.kernel("smx_bwd_loop<float, 4>")))

    errors = run_in_threads(work, 12)
    assert not errors, errors
    assert {o for o, _ in got} == {0, 1, 2}
    assert len(_driver._devices) == 3
    # Each device looked the kernel up exactly once despite the race.
    assert sorted(a for _, a in fake_driver) == ["sm_80", "sm_90", "sm_90"]
