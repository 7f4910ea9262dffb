"""The JAX front door.

CPU (jax installed, any machine): CPU arrays take the reference path and come back as JAX
arrays; the refusal inside jax.jit and other transformations; out= and bad arguments; the
DLPack hand-back of our own memory (capsule, deleter) with host memory.  Without jax, the
argument checks run on stand-in objects.
GPU (jax with CUDA and a GPU): against the float64 reference, results on the input's
device, and stream order with a slow producer (no host sync in the call).
"""

from __future__ import annotations

import gc
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from helpers import assert_matches

import drvsoftmax
from drvsoftmax import _jax, _reference

REPO = Path(__file__).resolve().parents[1]

try:
    import jax
    import jax.numpy as jnp
except ImportError:  # the stand-in tests below still run
    jax = jnp = None

needs_jax = pytest.mark.skipif(jax is None, reason="needs jax")


def _jax_gpu():
    if jax is None:
        return None
    try:
        return jax.devices("gpu")[0]
    except RuntimeError:
        return None


GPU = _jax_gpu()
needs_jax_gpu = pytest.mark.skipif(GPU is None, reason="needs jax with CUDA and a GPU")
DTYPES = ("float16", "bfloat16", "float32")


def _np64(a):
    """A float array in float64 (bfloat16 included); bool and integer arrays as they are."""
    v = np.asarray(a)
    return v if v.dtype.kind in "biu" else v.astype(np.float64)


def _ref_fwd(x, mask, scale, causal, kl):
    m = None if mask is None else _np64(mask)
    return _reference.softmax_forward(_np64(x), m, scale, causal, None if kl is None else np.asarray(kl))


def _put(a, dtype, dev):
    return jax.device_put(jnp.asarray(a, dtype=dtype), dev)


# ----------------------------------------------------------------------------------
# Without jax: stand-ins reach the argument checks.


class _FakeDevice:
    platform, id, local_hardware_id = "gpu", 0, 0


_DEV = _FakeDevice()


class _FakeArray:
    """Just enough of a jax.Array (by module name) for the front door's checks."""

    def __init__(self, shape=(2, 3, 4, 8), dtype="float16"):
        if dtype == "bfloat16":
            dtype = pytest.importorskip("ml_dtypes").bfloat16
        self.shape, self.dtype = shape, np.dtype(dtype)

    def devices(self):
        return {_DEV}


_FakeArray.__module__ = "jaxlib._jax"


class _FakeTracer(_FakeArray):
    pass


_FakeTracer.__module__ = "jax._src.interpreters.partial_eval"


@pytest.fixture
def fake_tracer(monkeypatch):
    monkeypatch.setattr(_jax, "_tracer", _FakeTracer)


def test_stand_in_tracer_is_refused_naming_what_works(fake_tracer):
    for call in (
        lambda: drvsoftmax.scaled_masked_softmax(_FakeTracer()),
        lambda: drvsoftmax.scaled_masked_softmax_backward(_FakeArray(), _FakeTracer()),
    ):
        with pytest.raises(drvsoftmax.ArgumentTypeError) as e:
            call()
        msg = str(e.value)
        assert "outside jax.jit" in msg and "jax.nn.softmax" in msg and "tracer" in msg, msg


def test_stand_in_argument_errors(fake_tracer):
    x = _FakeArray()
    with pytest.raises(drvsoftmax.ArgumentTypeError, match="out must be None for JAX arrays"):
        drvsoftmax.scaled_masked_softmax(x, out=_FakeArray())
    with pytest.raises(
        drvsoftmax.ArgumentTypeError, match="x must be of dtype float16, bfloat16, float32 on the GPU, got dtype int32"
    ):
        drvsoftmax.scaled_masked_softmax(_FakeArray(dtype="int32"))
    with pytest.raises(drvsoftmax.ArgumentTypeError, match="x must be"):
        drvsoftmax.scaled_masked_softmax(_FakeArray(dtype="float64"))  # float64 only on the CPU path
    with pytest.raises(drvsoftmax.DrvSoftmaxError, match="mask"):
        drvsoftmax.scaled_masked_softmax(x, mask=np.zeros((2, 3, 4, 8), bool))
    with pytest.raises(drvsoftmax.DrvSoftmaxError, match="mask"):
        drvsoftmax.scaled_masked_softmax(x, mask=_FakeArray((5, 8), "bool"))
    with pytest.raises(drvsoftmax.DrvSoftmaxError, match="scale"):
        drvsoftmax.scaled_masked_softmax(x, scale=float("nan"))
    with pytest.raises(drvsoftmax.DrvSoftmaxError, match="stream"):
        drvsoftmax.scaled_masked_softmax(x, stream=0)  # a default stream cannot order JAX's work
    with pytest.raises(drvsoftmax.DrvSoftmaxError, match="dy"):
        drvsoftmax.scaled_masked_softmax_backward(_FakeArray((2, 3)), x)
    with pytest.raises(drvsoftmax.ArgumentTypeError, match="dy"):
        drvsoftmax.scaled_masked_softmax_backward(np.zeros((2, 3, 4, 8), np.float16), x)


def test_row_major_strides():
    assert _jax._row_major((2, 3, 4)) == (12, 4, 1)
    assert _jax._row_major((0, 3, 1)) == (3, 1, 1)
    assert _jax._row_major(()) == ()


# ----------------------------------------------------------------------------------
# CPU jax.


@needs_jax
@pytest.mark.parametrize("dtype", DTYPES)
def test_cpu_arrays_against_float64(dtype):
    rng = np.random.default_rng(1)
    cpu = jax.devices("cpu")[0]
    x = _put(rng.standard_normal((2, 3, 5, 33)) * 3, dtype, cpu)
    mask = _put(rng.random((2, 1, 5, 33)) < 0.3, "bool", cpu)
    kl = [20, 33]
    y = drvsoftmax.scaled_masked_softmax(x, mask, scale=0.7, causal=True, key_lengths=kl)
    assert isinstance(y, jax.Array) and y.dtype == x.dtype and y.devices() == {cpu}
    assert_matches(np.asarray(y).astype(np.float64), _ref_fwd(x, mask, 0.7, True, kl), dtype, f"cpu {dtype}")
    dy = _put(rng.standard_normal(x.shape), dtype, cpu)
    dx = drvsoftmax.scaled_masked_softmax_backward(dy, y, scale=0.7)
    ref = _reference.softmax_backward(np.asarray(dy).astype(np.float64), np.asarray(y).astype(np.float64), 0.7)
    assert dx.dtype == x.dtype and dx.devices() == {cpu}
    assert_matches(np.asarray(dx).astype(np.float64), ref, dtype, f"cpu backward {dtype}")


@needs_jax
def test_inside_jit_and_transformations_is_refused():
    x = jnp.ones((2, 8), jnp.float32)
    f = lambda t: drvsoftmax.scaled_masked_softmax(t)  # noqa: E731
    for transformed in (jax.jit(f), jax.vmap(f), lambda t: jax.grad(lambda u: f(u).sum())(t)):
        with pytest.raises(drvsoftmax.ArgumentTypeError, match="outside jax.jit") as e:
            transformed(x)
        assert "tracer" in str(e.value)
    with pytest.raises(drvsoftmax.ArgumentTypeError, match="outside jax.jit"):
        jax.jit(lambda t: drvsoftmax.scaled_masked_softmax_backward(t, t))(x)
    y = f(x)  # outside: works
    np.testing.assert_allclose(np.asarray(y), np.full((2, 8), 1 / 8), rtol=1e-6)


@needs_jax
def test_cpu_out_and_mask_types_refused():
    x = jnp.ones((2, 8), jnp.float32)
    with pytest.raises(drvsoftmax.ArgumentTypeError, match="out must be None for JAX arrays"):
        drvsoftmax.scaled_masked_softmax(x, out=x)
    with pytest.raises(drvsoftmax.ArgumentTypeError, match="mask must be a jax.Array"):
        drvsoftmax.scaled_masked_softmax(x, mask=np.zeros((2, 8), bool))
    with pytest.raises(drvsoftmax.ArgumentTypeError, match="key_lengths"):
        drvsoftmax.scaled_masked_softmax(x.reshape(2, 1, 8), key_lengths="3")


class _PublicOnly:
    """jaxlib's module without its private DLPack import (the public from_dlpack is used)."""

    def __init__(self, mod):
        self.mod = mod

    def __getattr__(self, name):
        if name == "dlpack_managed_tensor_to_buffer":
            raise AttributeError(name)
        return getattr(self.mod, name)


@needs_jax
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("way", ["jaxlib", "from_dlpack"])
def test_result_hand_back_through_our_capsule(dtype, way, monkeypatch):
    """The DLPack view of memory we own: JAX reads our values with JAX's dtype, and our
    release runs (once) when JAX lets go; exported references kept alive until then."""
    if way == "from_dlpack":
        monkeypatch.setattr(_jax, "_jaxlib_mod", _PublicOnly(_jax._jaxlib()))
    cpu = jax.devices("cpu")[0]
    npdt = np.dtype(jnp.dtype(dtype))
    raw = np.zeros(4096, np.uint8)
    off = -raw.ctypes.data % 64  # JAX takes host memory aligned to 64 bytes
    a = raw[off : off + 2 * 3 * 5 * npdt.itemsize].view(npdt).reshape(2, 3, 5)
    a[...] = np.random.default_rng(0).standard_normal(a.shape).astype(npdt)
    released = []
    keep = (object(),)
    gc.collect()
    before = len(_jax._live)  # results of earlier tests may still be alive
    y = _jax._result(cpu, a.ctypes.data, a.shape, dtype, None, lambda: released.append(1), keep, dl_type=1)
    assert y.dtype == jnp.dtype(dtype) and y.shape == a.shape
    np.testing.assert_array_equal(np.asarray(y), a)
    assert released == [] and len(_jax._live) == before + 1
    del y
    gc.collect()
    assert released == [1] and len(_jax._live) == before


@needs_jax
def test_example_runs_on_cpu():
    r = subprocess.run(
        [sys.executable, str(REPO / "examples" / "jax_softmax.py"), "--device", "cpu"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=str(REPO),
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "OK" in r.stdout and "inside jax.jit: ArgumentTypeError" in r.stdout


# ----------------------------------------------------------------------------------
# GPU.


@needs_jax_gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mask_kind", ["bool", "add", None])
def test_gpu_against_float64(dtype, mask_kind):
    rng = np.random.default_rng(2)
    x = _put(rng.standard_normal((2, 4, 37, 300)) * 4, dtype, GPU)
    mask = None
    if mask_kind == "bool":
        mask = _put(rng.random((2, 1, 37, 300)) < 0.2, "bool", GPU)  # broadcast over heads
    elif mask_kind == "add":
        mask = _put(
            np.where(rng.random((1, 1, 37, 300)) < 0.2, -np.inf, rng.standard_normal((1, 1, 37, 300))), dtype, GPU
        )
    for causal, kl in ((False, None), (True, None), (True, _put([300, 123], "int32", GPU))):
        y = drvsoftmax.scaled_masked_softmax(x, mask, scale=0.3, causal=causal, key_lengths=kl)
        assert isinstance(y, jax.Array) and y.dtype == x.dtype and y.devices() == {GPU} and y.shape == x.shape
        ref = _ref_fwd(x, mask, 0.3, causal, kl)
        assert_matches(np.asarray(y).astype(np.float64), ref, dtype, f"{dtype} {mask_kind} causal={causal} kl={kl}")


@needs_jax_gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_backward_and_list_lengths(dtype):
    rng = np.random.default_rng(3)
    x = _put(rng.standard_normal((3, 2, 16, 1000)), dtype, GPU)
    y = drvsoftmax.scaled_masked_softmax(x, scale=1.5, key_lengths=[1000, 7, 0])
    assert_matches(np.asarray(y).astype(np.float64), _ref_fwd(x, None, 1.5, False, [1000, 7, 0]), dtype, "lengths")
    dy = _put(rng.standard_normal(x.shape), dtype, GPU)
    dx = drvsoftmax.scaled_masked_softmax_backward(dy, y, scale=1.5)
    assert isinstance(dx, jax.Array) and dx.dtype == x.dtype and dx.devices() == {GPU}
    ref = _reference.softmax_backward(np.asarray(dy).astype(np.float64), np.asarray(y).astype(np.float64), 1.5)
    assert_matches(np.asarray(dx).astype(np.float64), ref, dtype, "backward")


@needs_jax_gpu
def test_gpu_inside_jit_is_refused():
    x = _put(np.ones((2, 64)), "float16", GPU)
    with pytest.raises(drvsoftmax.ArgumentTypeError, match="outside jax.jit"):
        jax.jit(lambda t: drvsoftmax.scaled_masked_softmax(t))(x)


@needs_jax_gpu
def test_gpu_results_outlive_inputs_and_many_calls():
    """Results released in any order, inputs dropped right after the call: values stay right."""
    rng = np.random.default_rng(4)
    keep = []
    for i in range(50):
        xn = rng.standard_normal((4, 256)).astype(np.float32)
        y = drvsoftmax.scaled_masked_softmax(_put(xn, "float32", GPU))  # x dropped at once
        keep.append((xn, y))
        if i % 3 == 0:
            keep.pop(0)
    for xn, y in keep:
        assert_matches(np.asarray(y), _ref_fwd(xn, None, 1.0, False, None), "float32", "kept result")
    del keep
    gc.collect()


@needs_jax_gpu
def _slow_producer_run():
    """(x from a jitted producer of about half a second, y of our call on it, seconds our
    call took, seconds the producer ran in all, whether x was still being computed when our
    call returned, whether y was pending then).

    The producer's loop count is static: XLA runs a loop of a traced count with a host
    round trip per iteration, so dispatching such a producer would itself wait on the host."""
    n = 2048

    def producer(a, w, iters):
        return jax.lax.fori_loop(0, iters, lambda i, v: jnp.tanh(v @ w) * 4.0, a)

    slow = jax.jit(producer, static_argnums=2)

    rng = np.random.default_rng(5)
    a = _put(rng.standard_normal((n, n)), "float32", GPU)
    w = _put(rng.standard_normal((n, n)) / np.sqrt(n), "float32", GPU)
    drvsoftmax.scaled_masked_softmax(a).block_until_ready()  # kernels loaded before the timed part
    iters = 16
    while True:  # a producer of about half a second (or more); each count compiles once
        slow(a, w, iters).block_until_ready()
        t = time.perf_counter()
        slow(a, w, iters).block_until_ready()
        if time.perf_counter() - t >= 0.5 or iters >= 1 << 16:
            break
        iters *= 4

    t0 = time.perf_counter()
    x = slow(a, w, iters)
    t1 = time.perf_counter()
    y = drvsoftmax.scaled_masked_softmax(x, scale=0.25)
    t2 = time.perf_counter()
    x_pending = not x.is_ready()  # non-blocking queries
    y_pending = not y.is_ready()
    y.block_until_ready()
    t3 = time.perf_counter()
    assert t3 - t0 > 0.3, f"the producer ran only {t3 - t0:.3f} s: the test has no margin"
    return x, y, t2 - t1, t3 - t0, x_pending, y_pending


@needs_jax_gpu
def test_gpu_stream_order_after_a_slow_producer():
    """x still being computed by a long jitted function is read only after it finished."""
    x, y, _, _, x_pending, _ = _slow_producer_run()
    assert x_pending, "x was computed before our call returned: the test proves nothing"
    assert_matches(np.asarray(y), _ref_fwd(np.asarray(x), None, 0.25, False, None), "float32", "after producer")


@needs_jax_gpu
@needs_jax_gpu
def test_gpu_no_host_sync_on_a_pending_input():
    """The call returns while x is still being computed, and y is pending then."""
    _, _, call, total, x_pending, y_pending = _slow_producer_run()
    assert call < 0.25 * total, f"the call took {call:.3f} s of a {total:.3f} s producer: a host sync"
    assert x_pending, "x was computed before our call returned: the test proves nothing"
    assert y_pending, "the result was ready while its input was still being computed"


@needs_jax_gpu
def test_gpu_example_runs():
    r = subprocess.run(
        [sys.executable, str(REPO / "examples" / "jax_softmax.py")], capture_output=True, text=True, timeout=600
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "OK" in r.stdout and "cuda" in r.stdout.lower()


class _FakeGpuDevice:
    platform, id, local_hardware_id = "gpu", 0, 0

    def get_stream_for_external_ready_events(self):
        return 0x7F00


class _FakeGpuArray(_FakeArray):
    dev = _FakeGpuDevice()

    def __init__(self, shape=(2, 3, 4, 8), dtype="float16", ptr=0x1000):
        super().__init__(shape, dtype)
        self.ptr = ptr

    def devices(self):
        return {self.dev}

    def unsafe_buffer_pointer(self):
        return self.ptr


_FakeGpuArray.__module__ = "jaxlib._jax"


@pytest.fixture
def fake_gpu(monkeypatch, fake_tracer):
    from drvsoftmax import _core, _driver

    calls = []

    class Dev:
        ordinal, ctx = 0, "ctx0"

    class NoContext:
        def __init__(self, dev):
            pass

        def __enter__(self):
            calls.append(("enter",))

        def __exit__(self, *a):
            calls.append(("exit",))

    monkeypatch.setattr(_jax, "_streams", {})
    monkeypatch.setattr(_jax, "_export", lambda a, s: calls.append(("export", a.ptr, s)) or ("capsule", a.ptr))
    monkeypatch.setattr(_driver, "device", lambda o: Dev())
    monkeypatch.setattr(_jax, "_Context", NoContext)
    monkeypatch.setattr(_jax, "_alloc", lambda shape, dt, s, o: calls.append(("alloc", shape, dt, s, o)) or 0x9000)
    monkeypatch.setattr(_core, "forward", lambda *a: calls.append(("forward", *a[1:])))
    monkeypatch.setattr(_core, "backward", lambda *a: calls.append(("backward", *a[1:])))

    def result(jdev, ptr, shape, dtype, stream, release, keep, dl_type=2):
        calls.append(("result", ptr, shape, dtype, stream, keep))
        return "Y"

    monkeypatch.setattr(_jax, "_result", result)
    monkeypatch.setattr(_jax, "_fast", {})
    monkeypatch.setattr(
        _core, "prepared_forward", lambda dev, x, y, m, k, c, sc: calls.append(("prepared", x, c, sc)) or "PREP"
    )
    monkeypatch.setattr(_core, "launch", lambda *a: calls.append(("launch", *a)))
    # our context is current (the fast path's condition)
    monkeypatch.setattr(_jax, "_drv", SimpleNamespace(cuCtxGetCurrent=lambda: (0, "ctx0")))
    return calls


def test_gpu_repeated_plain_calls_take_the_fast_path(fake_gpu):
    """After a plain call of a layout succeeded, the next one exports x, allocates, launches
    the prepared kernel and hands the result back, without the checks; anything else (a
    mask, another scale, causal, a stream) takes the checked path."""
    x = _FakeGpuArray(ptr=0x1000)
    assert drvsoftmax.scaled_masked_softmax(x, scale=0.5) == "Y"
    assert [c[0] for c in fake_gpu] == ["export", "enter", "alloc", "forward", "result", "exit", "prepared"]
    _, xo, causal, scale = fake_gpu[-1]
    assert (xo.ptr, xo.shape, xo.strides, causal, scale) == (0x1000, (2, 3, 4, 8), (96, 32, 8, 1), False, 0.5)
    del fake_gpu[:]
    x2 = _FakeGpuArray(ptr=0x4000)
    assert drvsoftmax.scaled_masked_softmax(x2, scale=0.5) == "Y"
    assert [c[0] for c in fake_gpu] == ["export", "alloc", "launch", "result"], fake_gpu
    assert fake_gpu[2][1:] == ("PREP", 0x4000, 0x9000, 0, 0, 0x7F00, True)
    assert fake_gpu[3][1:] == (0x9000, (2, 3, 4, 8), "float16", 0x7F00, (("capsule", 0x4000),))
    for kw in (dict(scale=0.25), dict(scale=0.5, causal=True), dict(scale=0.5, stream=0x5500)):
        del fake_gpu[:]
        drvsoftmax.scaled_masked_softmax(x2, **kw)
        assert "forward" in [c[0] for c in fake_gpu], kw
    del fake_gpu[:]
    drvsoftmax.scaled_masked_softmax(x2, _FakeGpuArray((2, 1, 4, 8), "bool", ptr=0x2000), scale=0.5)
    assert "forward" in [c[0] for c in fake_gpu]


def test_gpu_glue_orders_exports_alloc_launch_and_hand_back(fake_gpu):
    x = _FakeGpuArray(ptr=0x1000)
    mask = _FakeGpuArray((2, 1, 4, 8), "bool", ptr=0x2000)
    kl = _FakeGpuArray((2,), "int32", ptr=0x3000)
    assert drvsoftmax.scaled_masked_softmax(x, mask, scale=0.5, causal=True, key_lengths=kl) == "Y"
    names = [c[0] for c in fake_gpu]
    assert names == ["export", "export", "export", "enter", "alloc", "forward", "result", "exit"], names
    assert [c[1:] for c in fake_gpu[:3]] == [(0x1000, 0x7F00), (0x2000, 0x7F00), (0x3000, 0x7F00)]
    assert fake_gpu[4][1:] == ((2, 3, 4, 8), "float16", 0x7F00, 0)
    xo, yo, mo, ko, causal, scale, stream = fake_gpu[5][1:]
    assert (xo.ptr, yo.ptr, mo.ptr, ko.ptr) == (0x1000, 0x9000, 0x2000, 0x3000)
    assert xo.strides == yo.strides == (96, 32, 8, 1) and mo.strides == (32, 32, 8, 1) and ko.dtype == "int32"
    assert (causal, scale, stream) == (True, 0.5, 0x7F00)
    ptr, shape, dtype, stream, keep = fake_gpu[6][1:]
    assert (ptr, shape, dtype, stream) == (0x9000, (2, 3, 4, 8), "float16", 0x7F00)
    assert keep == (("capsule", 0x1000), ("capsule", 0x2000), ("capsule", 0x3000)), "inputs held until the result goes"


def test_gpu_glue_backward_and_a_given_stream(fake_gpu):
    y, dy = _FakeGpuArray(dtype="bfloat16", ptr=0x1000), _FakeGpuArray(dtype="bfloat16", ptr=0x2000)
    assert drvsoftmax.scaled_masked_softmax_backward(dy, y, scale=2.0, stream=0x5500) == "Y"
    names = [c[0] for c in fake_gpu]
    assert names == ["export", "export", "enter", "alloc", "backward", "result", "exit"], names
    do, yo, dxo, scale, stream = fake_gpu[4][1:]
    assert (do.ptr, yo.ptr, dxo.ptr, do.dtype, scale, stream) == (0x2000, 0x1000, 0x9000, "bfloat16", 2.0, 0x5500)
    assert fake_gpu[5][4] == 0x5500
