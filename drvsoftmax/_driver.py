"""Devices through the CUDA driver API: initialisation, primary contexts, kernels.

Nothing here runs at import time.  The first call that needs a device initialises the
driver, retains the device's primary context (the one PyTorch, CuPy and JAX use) and
reads the device's architecture once.  Kernels are looked up once per device and
loaded into its context before the first launch, so that later launches (also inside
a CUDA graph capture) only launch.
"""

from __future__ import annotations

import os
import threading
from typing import Any

from . import _loader, _plan
from ._errors import CudaDriverError, DrvSoftmaxError, check
from ._log import log

_lock = threading.RLock()
_init_pid: int | None = None
_driver_version: int | None = None
_devices: dict[int, Device] = {}


def _drv() -> Any:
    from cuda.bindings import driver

    return driver


def init() -> None:
    global _init_pid, _driver_version
    pid = os.getpid()
    if _init_pid == pid:
        return
    with _lock:
        if _init_pid == pid:
            return
        if _init_pid is not None:
            raise DrvSoftmaxError(
                "drvsoftmax used CUDA before this process was forked; CUDA does not survive "
                "fork(). Use the 'spawn' start method for worker processes that use the GPU."
            )
        d = _drv()
        check(d.cuInit(0), "cuInit")
        _driver_version = int(check(d.cuDriverGetVersion(), "cuDriverGetVersion"))
        _init_pid = pid


def driver_version() -> int:
    init()
    if _driver_version is None:  # init() sets it or raises
        raise DrvSoftmaxError("the CUDA driver version is unknown after cuInit")
    return _driver_version


class Device:
    """One CUDA device: primary context, architecture, and its loaded kernels."""

    def __init__(self, ordinal: int) -> None:
        d = _drv()
        self.ordinal = ordinal
        self.cudev = check(d.cuDeviceGet(ordinal), "cuDeviceGet")
        A = d.CUdevice_attribute
        major = check(d.cuDeviceGetAttribute(A.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, self.cudev))
        minor = check(d.cuDeviceGetAttribute(A.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, self.cudev))
        self.sm_count = check(d.cuDeviceGetAttribute(A.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, self.cudev))
        self.cc = int(major) * 10 + int(minor)
        self.arch = f"sm_{self.cc}"
        smem = check(d.cuDeviceGetAttribute(A.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN, self.cudev))
        self.caps = _plan.DeviceCaps(self.cc, int(smem), int(self.sm_count))
        self._cluster_ready: dict[tuple[str, int, int], bool] = {}
        self._resident: dict[tuple[str, int, int], int] = {}
        self._coop: bool | None = None  # cooperative launches, once asked
        self._smem_set: dict[str, int] = {}
        name = check(d.cuDeviceGetName(256, self.cudev), "cuDeviceGetName")
        self.name = bytes(name).split(b"\0", 1)[0].decode(errors="replace")
        self.ctx = check(d.cuDevicePrimaryCtxRetain(self.cudev), "cuDevicePrimaryCtxRetain")
        self._kernels: dict[str, object] = {}
        self._functions: dict[str, object] = {}
        self.origins: dict[str, str] = {}

    def kernel(self, name: str) -> Any:
        """The CUkernel `name`, loaded into this device's context."""
        k = self._kernels.get(name)
        if k is not None:
            return k
        with _lock:
            k = self._kernels.get(name)
            if k is not None:
                return k
            k, origin = _loader.find_kernel(name, self.arch, driver_version())
            d = _drv()
            # Load it into this device's context now (lazy loading would otherwise do it
            # at the first launch, which may be inside a graph capture).
            check(d.cuCtxPushCurrent(self.ctx), "cuCtxPushCurrent")
            try:
                f = check(d.cuKernelGetFunction(k), "cuKernelGetFunction")
            finally:
                check(d.cuCtxPopCurrent(), "cuCtxPopCurrent")
            self.origins[name] = origin
            self._functions[name] = f
            self._kernels[name] = k
            return k

    def function(self, name: str) -> Any:
        """The CUfunction of kernel `name` in this device's primary context: launches take it
        as it is (a CUkernel would be resolved to it by the driver on every launch)."""
        f = self._functions.get(name)
        if f is None:
            self.kernel(name)
            f = self._functions[name]
        return f

    def cluster_ready(self, name: str, cluster: int, smem: int, block: int) -> bool:
        """Prepare the kernel `name` for launches in clusters of `cluster` blocks with `smem`
        bytes of dynamic shared memory (once per kernel and size), and say whether such
        clusters can run on this device at all (cuOccupancyMaxActiveClusters > 0)."""
        key = (name, cluster, smem)
        ok = self._cluster_ready.get(key)
        if ok is not None:
            return ok
        with _lock:
            d = _drv()
            k = self.kernel(name)
            F = d.CUfunction_attribute
            check(d.cuCtxPushCurrent(self.ctx), "cuCtxPushCurrent")
            try:
                f = check(d.cuKernelGetFunction(k), "cuKernelGetFunction")
                if self._smem_set.get(name, 0) < smem:
                    check(
                        d.cuFuncSetAttribute(f, F.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem),
                        "cuFuncSetAttribute",
                    )
                    self._smem_set[name] = smem
                if cluster > _plan.CLUSTER_PORTABLE:
                    check(
                        d.cuFuncSetAttribute(f, F.CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED, 1),
                        "cuFuncSetAttribute",
                    )
                cfg = cluster_config(cluster, cluster, block, smem)
                n = int(check(d.cuOccupancyMaxActiveClusters(f, cfg), "cuOccupancyMaxActiveClusters"))
            except CudaDriverError as e:  # a size this device refuses: the looped tier instead
                log.info("clusters of %d x %d bytes for %s unavailable on %s: %s", cluster, smem, name, self.name, e)
                n = 0
            finally:
                check(d.cuCtxPopCurrent(), "cuCtxPopCurrent")
            ok = self._cluster_ready[key] = n > 0
            return ok

    def resident_blocks(self, name: str, smem: int, block: int) -> int:
        """Blocks of kernel `name` (`block` threads, `smem` bytes of dynamic shared memory)
        this device holds at once: the occupancy per SM times the SM count, 0 where it
        refuses the size.  Prepares the kernel for that size (in every context); asked once
        per kernel and size."""
        key = (name, smem, block)
        cap = self._resident.get(key)
        if cap is not None:
            return cap
        with _lock:
            d = _drv()
            k = self.kernel(name)
            F = d.CUfunction_attribute
            check(d.cuCtxPushCurrent(self.ctx), "cuCtxPushCurrent")
            try:
                f = check(d.cuKernelGetFunction(k), "cuKernelGetFunction")
                if self._smem_set.get(name, 0) < smem:
                    check(
                        d.cuFuncSetAttribute(f, F.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem),
                        "cuFuncSetAttribute",
                    )
                    # (launches through the CUkernel in another context, see _core._relaunch)
                    check(
                        d.cuKernelSetAttribute(F.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem, k, self.cudev),
                        "cuKernelSetAttribute",
                    )
                    self._smem_set[name] = smem
                per_sm = check(
                    d.cuOccupancyMaxActiveBlocksPerMultiprocessor(f, block, smem),
                    "cuOccupancyMaxActiveBlocksPerMultiprocessor",
                )
                cap = int(per_sm) * int(self.sm_count)
            except CudaDriverError as e:  # a size this device refuses: another tier instead
                log.info("blocks of %s with %d bytes unavailable on %s: %s", name, smem, self.name, e)
                cap = 0
            finally:
                check(d.cuCtxPopCurrent(), "cuCtxPopCurrent")
            self._resident[key] = cap
            return cap

    def coop_capacity(self, name: str, smem: int, block: int) -> int:
        """Blocks of kernel `name` that a cooperative launch can hold on this device at once
        (resident_blocks), 0 where the device has no cooperative launch or refuses the size."""
        if self._coop is None:
            d = _drv()
            A = d.CUdevice_attribute
            self._coop = bool(check(d.cuDeviceGetAttribute(A.CU_DEVICE_ATTRIBUTE_COOPERATIVE_LAUNCH, self.cudev)))
        return self.resident_blocks(name, smem, block) if self._coop else 0


def cluster_config(grid: int, cluster: int, block: int, smem: int) -> Any:
    """A CUlaunchConfig of `grid` blocks of `block` threads in clusters of `cluster`, with
    `smem` bytes of dynamic shared memory; the stream is set per launch."""
    d = _drv()
    cfg = d.CUlaunchConfig()
    cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = grid, 1, 1
    cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = block, 1, 1
    cfg.sharedMemBytes = smem
    attr = d.CUlaunchAttribute()
    attr.id = d.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
    attr.value.clusterDim.x = cluster
    attr.value.clusterDim.y = 1
    attr.value.clusterDim.z = 1
    cfg.attrs = [attr]
    cfg.numAttrs = 1
    return cfg


def device(ordinal: int) -> Device:
    dev = _devices.get(ordinal)
    if dev is not None and _init_pid == os.getpid():
        return dev
    init()
    with _lock:
        dev = _devices.get(ordinal)
        if dev is None:
            count = check(_drv().cuDeviceGetCount(), "cuDeviceGetCount")
            if not 0 <= ordinal < count:
                raise DrvSoftmaxError(f"device ordinal {ordinal} out of range: {count} CUDA device(s)")
            dev = _devices[ordinal] = Device(ordinal)
        return dev


def device_count() -> int:
    init()
    return int(check(_drv().cuDeviceGetCount(), "cuDeviceGetCount"))
