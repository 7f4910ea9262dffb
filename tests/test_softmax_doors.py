"""The framework-agnostic doors: the DLPack / CUDA-array intake, stream order, raw pointers.

CPU part: hand-made DLPack capsules and ``__cuda_array_interface__`` objects go through the
public functions with the launch (and the cross-stream wait) replaced by recorders, so
everything the doors decide (pointers, dtypes, strides, streams, waits, ownership of the
capsules, refusals) is checked without a GPU.  GPU part (skipped without one): each door
against the float64 reference, the stream order with a slow producer, a raw-pointer call
on memory from cuMemAlloc, and the examples.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from dlpack_fakes import CODES, ITEM, Capsule, FakeDLPack, OldDLPack
from helpers import TOLS, assert_matches, requires_cuda

import drvsoftmax
import drvsoftmax.raw as raw
from drvsoftmax import _args, _core, _dtypes, _intake, _plan, _reference

ROOT = Path(__file__).resolve().parent.parent
_gen = np.random.default_rng()


class FakeCAI:
    """``__cuda_array_interface__`` only (no memory behind it)."""

    __module__ = "fakecai"

    def __init__(self, shape, typestr="<f4", ptr=1 << 41, strides=None, stream=None, readonly=False, version=3):
        self.__cuda_array_interface__ = {
            "shape": tuple(shape),
            "typestr": typestr,
            "data": (ptr, readonly),
            "strides": strides,
            "version": version,
            "stream": stream,
        }

        class _Dev:
            id = 0

        self.device = _Dev()


@pytest.fixture
def recorded(monkeypatch):
    """Replace the launches and the stream waits by recorders."""
    calls = {"fwd": [], "bwd": [], "wait": []}
    monkeypatch.setattr(raw, "run_forward", lambda *a: calls["fwd"].append(a))
    monkeypatch.setattr(raw, "run_backward", lambda *a: calls["bwd"].append(a))
    monkeypatch.setattr(raw, "_ordinal", lambda d: d)
    monkeypatch.setattr(_intake, "wait", lambda p, c, dev: calls["wait"].append((p, c, dev)))
    return calls


def _random_layout(nd):
    shape = tuple(int(n) for n in _gen.integers(1, 6, nd))
    perm = _gen.permutation(nd)
    strides = [0] * nd
    acc = int(_gen.integers(1, 3))
    for i in reversed(perm):  # a permuted, possibly padded, layout
        strides[i] = acc
        acc *= shape[i] + int(_gen.integers(0, 2))
    return shape, tuple(strides)


# ----------------------------------------------------------------------------------
# DLPack capsules.


@pytest.mark.parametrize("versioned", [False, True], ids=["dltensor", "versioned"])
@pytest.mark.parametrize("dtype", list(_dtypes.TABLE))
def test_capsule_read_back(dtype, versioned):
    # Every dtype of the table, from its DLPack code: pointer + byte_offset, shape and
    # strides as laid out, the capsule renamed 'used' and its deleter called exactly once.
    shape, strides = _random_layout(int(_gen.integers(1, 5)))
    ptr, off = int(_gen.integers(1, 2**40)) * 256, int(_gen.integers(0, 64)) * ITEM[dtype]
    c = Capsule(ptr, shape, dtype, strides, byte_offset=off, versioned=versioned)
    it = _intake.parse_capsule(c.capsule, "x")
    assert it.op == _core.Operand(ptr + off, dtype, shape, strides)
    assert (it.device, it.readonly, it.producer) == (0, False, None)
    assert c.renamed() and c.deleted == 0
    it.release()
    it.release()
    assert c.deleted == 1


def test_capsule_without_strides_is_row_major():
    shape = tuple(int(n) for n in _gen.integers(1, 7, 4))
    c = Capsule(4096, shape, "float16")
    it = _intake.parse_capsule(c.capsule, "x")
    it.release()
    want = tuple(int(np.prod(shape[i + 1 :])) for i in range(4))
    assert it.op.strides == want and c.deleted == 1


def test_dtype_comes_from_the_code_not_the_item_size():
    # Three dtypes of 2 bytes: only the type code tells them apart.
    got = []
    for dt in ("float16", "bfloat16", "uint16", "int16"):
        c = Capsule(4096, (3,), dt)
        it = _intake.parse_capsule(c.capsule, "mask")
        it.release()
        got.append(it.op.dtype)
    assert got == ["float16", "bfloat16", "uint16", "int16"]
    assert _dtypes.OF_DLPACK[(4, 16)] == "bfloat16" and len(_dtypes.OF_DLPACK) == len(_dtypes.TABLE)


@pytest.mark.parametrize(
    "kw,exc,pattern",
    [
        (dict(dtype="complex64"), TypeError, r"^x must be an array of a supported dtype, got DLPack dtype code 5, 64"),
        (
            dict(code_bits=(2, 8)),
            TypeError,
            r"^x must be an array of a supported dtype, got DLPack dtype code 2, 8 bits",
        ),
        (dict(lanes=2), TypeError, r"^x must be an array of a supported dtype, .*2 lanes"),
        (dict(device=(1, 0)), ValueError, r"^x must be an array in CUDA device memory, got a DLPack tensor on CPU"),
        (dict(versioned=True, version=(2, 0)), ValueError, r"^x must be a DLPack 1.x capsule, got version 2.0"),
    ],
    ids=["complex", "float8", "lanes", "cpu", "version2"],
)
def test_capsule_refusals_free_the_tensor(kw, exc, pattern):
    c = Capsule(4096, (2, 3), **{"dtype": "float32", **kw})
    with pytest.raises(exc, match=pattern):
        _intake.parse_capsule(c.capsule, "x")
    assert c.deleted == 1, "a refused capsule must still be freed"


def test_not_a_capsule():
    with pytest.raises(ValueError, match=r"^x must be a DLPack capsule named 'dltensor'"):
        _intake.parse_capsule(object(), "x")
    c = Capsule(4096, (2,))
    _intake.parse_capsule(c.capsule, "x").release()
    with pytest.raises(ValueError, match=r"^x must be a DLPack capsule"):  # a used capsule is not taken twice
        _intake.parse_capsule(c.capsule, "x")
    assert c.deleted == 1


# ----------------------------------------------------------------------------------
# The DLPack door through the public functions.


def _fakes(shape=(2, 3, 4, 5), dtype="float16", versioned=False, cls=FakeDLPack, **kw):
    ptr = int(_gen.integers(1, 2**20)) << 24  # far apart: no accidental overlap
    return cls(shape, dtype, ptr=ptr, versioned=versioned, **kw)


@pytest.mark.parametrize("versioned", [False, True], ids=["dltensor", "versioned"])
def test_dlpack_forward_launch_and_release(recorded, versioned):
    x, out = _fakes(versioned=versioned), _fakes(versioned=versioned)
    m = _fakes((2, 1, 4, 5), "bool", versioned=versioned)
    kl = _fakes((2,), "int32", versioned=versioned)
    scale = float(_gen.uniform(-2, 2))
    y = drvsoftmax.scaled_masked_softmax(x, m, scale=scale, causal=True, key_lengths=kl, out=out)
    assert y is out
    (dev, xo, yo, mo, ko, causal, sc, stream), *more = recorded["fwd"]
    assert not more and dev == 0 and causal is True and sc == scale
    assert stream == 0  # no stream named, no CUDA-array-interface stream: the legacy default stream
    assert (xo.ptr, xo.dtype, xo.shape, xo.strides) == (x.ptr, "float16", (2, 3, 4, 5), (60, 20, 5, 1))
    assert (yo.ptr, mo.ptr, mo.dtype, mo.shape, ko.ptr, ko.dtype) == (
        out.ptr,
        m.ptr,
        "bool",
        (2, 1, 4, 5),
        kl.ptr,
        "int32",
    )
    for a in (x, out, m, kl):
        assert a.streams == [1], "DLPack spells the legacy default stream 1"
        (c,) = a.capsules
        assert c.versioned is versioned and c.renamed() and c.deleted == 1
    assert recorded["wait"] == []  # DLPack producers order our stream themselves


def test_dlpack_backward_launch(recorded):
    dy, y, out = _fakes(), _fakes(), _fakes()
    assert drvsoftmax.scaled_masked_softmax_backward(dy, y, scale=0.5, out=out, stream=77) is out
    (dev, do, yo, xo, sc, stream), *_ = recorded["bwd"]
    assert (do.ptr, yo.ptr, xo.ptr, sc, stream) == (dy.ptr, y.ptr, out.ptr, 0.5, 77)
    assert all(a.streams == [77] and a.capsules[0].deleted == 1 for a in (dy, y, out))


class _Stream:
    def __init__(self, h):
        self.h = h

    def __cuda_stream__(self):
        return (0, self.h)


@pytest.mark.parametrize(
    "given,expect,launch",
    [(None, 1, 0), (0, 1, 0), (1, 1, 1), (2, 2, 2), (0x5EED0, 0x5EED0, 0x5EED0), ("obj", 0xABC0, 0xABC0)],
)
def test_dlpack_gets_our_stream(recorded, given, expect, launch):
    stream = _Stream(0xABC0) if given == "obj" else given
    x, out = _fakes(), _fakes()
    drvsoftmax.scaled_masked_softmax(x, out=out, stream=stream)
    assert x.streams == [expect] and out.streams == [expect]
    assert recorded["fwd"][0][-1] == launch


def test_dlpack_producer_without_max_version(recorded):
    x, out = _fakes(cls=OldDLPack), _fakes(cls=OldDLPack)
    drvsoftmax.scaled_masked_softmax(x, out=out)
    drvsoftmax.scaled_masked_softmax(x, out=out)
    assert [c.versioned for c in x.capsules] == [False, False] and all(c.deleted == 1 for c in x.capsules)


def test_dlpack_readonly_out_refused_and_every_capsule_freed(recorded):
    x, out = _fakes(versioned=True), _fakes(versioned=True, readonly=True)
    with pytest.raises(drvsoftmax.ArgumentValueError, match=r"^out must be a writable array, got a read-only array"):
        drvsoftmax.scaled_masked_softmax(x, out=out)
    with pytest.raises(drvsoftmax.ArgumentValueError, match=r"^out must be a writable array"):
        drvsoftmax.scaled_masked_softmax_backward(_fakes(versioned=True), x, out=out)
    ro_x = _fakes(versioned=True, readonly=True)  # a read-only input is fine
    drvsoftmax.scaled_masked_softmax(ro_x, out=_fakes(versioned=True))
    assert len(recorded["fwd"]) == 1 and recorded["fwd"][0][1].ptr == ro_x.ptr
    assert all(c.deleted == 1 for a in (x, out, ro_x) for c in a.capsules)


def test_dlpack_errors_name_the_argument(recorded):
    x = _fakes()
    with pytest.raises(TypeError, match=r"^out must be given for arrays of this library .*fakedlpack.FakeDLPack"):
        drvsoftmax.scaled_masked_softmax(x)
    with pytest.raises(ValueError, match=r"^mask must be an array in CUDA device memory, got a DLPack array on CPU"):
        drvsoftmax.scaled_masked_softmax(x, _fakes(device=(1, 0)), out=_fakes())
    with pytest.raises(TypeError, match=r"^key_lengths must be int32 or int64 for arrays of this library"):
        drvsoftmax.scaled_masked_softmax(x, key_lengths=_fakes((2,), "int16"), out=_fakes())
    with pytest.raises(ValueError, match=r"^out must be on x's device 0, got device 1"):
        drvsoftmax.scaled_masked_softmax(x, out=_fakes(device=(2, 1)))
    with pytest.raises(TypeError, match=r"^x must be of dtype float16, bfloat16, float32 on the GPU, got dtype int8"):
        drvsoftmax.scaled_masked_softmax(_fakes(dtype="int8"), out=_fakes(dtype="int8"))
    with pytest.raises(ValueError, match=r"^out must be memory that does not overlap x's"):
        drvsoftmax.scaled_masked_softmax(x, out=FakeDLPack(x.shape, "float16", ptr=x.ptr + 2))
    with pytest.raises(TypeError, match=r"^x must be a torch.Tensor, a NumPy array or a CUDA array \(__dlpack__ or"):
        drvsoftmax.scaled_masked_softmax([1.0, 2.0])
    assert recorded["fwd"] == []
    drvsoftmax.scaled_masked_softmax(x, out=x)  # in place
    assert recorded["fwd"][0][1].ptr == recorded["fwd"][0][2].ptr == x.ptr


class _BrokenDLPack:
    __module__ = "broken"

    def __dlpack_device__(self):
        return (2, 0)

    def __dlpack__(self, stream=None, max_version=None):
        raise RuntimeError("cannot export")


def test_broken_producer_is_an_argument_error(recorded):
    with pytest.raises(ValueError, match=r"^x must be an array whose __dlpack__\(stream=...\) gives a capsule"):
        drvsoftmax.scaled_masked_softmax(_BrokenDLPack(), out=_fakes())


# ----------------------------------------------------------------------------------
# __cuda_array_interface__: producer streams are waited on, read-only out refused.


def test_cai_streams_are_waited_on(recorded):
    x = FakeCAI((2, 3, 4), "<f2", ptr=1 << 40, stream=0x70)
    m = FakeCAI((4,), "|b1", ptr=2 << 40, stream=0x90)
    out = FakeCAI((2, 3, 4), "<f2", ptr=3 << 40, stream=None)
    drvsoftmax.scaled_masked_softmax(x, m, out=out)  # launches on x's stream, after m's producer
    assert recorded["fwd"][-1][-1] == 0x70
    assert recorded["wait"] == [(0x90, 0x70, 0)]
    recorded["wait"].clear()
    drvsoftmax.scaled_masked_softmax(x, m, out=out, stream=0xB0)  # a named stream waits for both
    assert recorded["fwd"][-1][-1] == 0xB0
    assert recorded["wait"] == [(0x70, 0xB0, 0), (0x90, 0xB0, 0)]


def test_cai_version_2_has_no_stream(recorded):
    x = FakeCAI((2, 3), stream=0x70, version=2)
    drvsoftmax.scaled_masked_softmax(x, out=FakeCAI((2, 3), ptr=2 << 40, stream=0x90))
    assert recorded["fwd"][-1][-1] == 0 and recorded["wait"] == [(0x90, 0, 0)]


def test_cai_wait_skips_the_same_stream():
    _intake.wait(0x70, 0x70, 0)  # would need a GPU if it did anything
    _intake.wait(1, 0, 0)  # 0 and 1 are both the legacy default stream


def test_cai_readonly_out_refused(recorded):
    x = FakeCAI((2, 3), ptr=1 << 40)
    with pytest.raises(drvsoftmax.ArgumentValueError, match=r"^out must be a writable array, got a read-only array"):
        drvsoftmax.scaled_masked_softmax(x, out=FakeCAI((2, 3), ptr=2 << 40, readonly=True))
    with pytest.raises(drvsoftmax.ArgumentValueError, match=r"^out must be a writable array"):
        drvsoftmax.scaled_masked_softmax_backward(x, FakeCAI((2, 3), ptr=3 << 40), out=FakeCAI((2, 3), readonly=True))
    drvsoftmax.scaled_masked_softmax(FakeCAI((2, 3), ptr=4 << 40, readonly=True), out=x)  # read-only x is fine
    assert len(recorded["fwd"]) == 1 and recorded["wait"] == []


def test_cai_masked_array_refused(recorded):
    x = FakeCAI((2, 3))
    x.__cuda_array_interface__["mask"] = FakeCAI((2, 3), "|b1")
    with pytest.raises(ValueError, match=r"^x must be an array without a mask"):
        drvsoftmax.scaled_masked_softmax(x, out=FakeCAI((2, 3), ptr=2 << 40))


# ----------------------------------------------------------------------------------
# The one dispatch point.


class _JaxLike(FakeDLPack):
    __module__ = "jaxlib.xla_extension"


def test_jax_arrays_reach_the_jax_door_before_dlpack(monkeypatch, recorded):
    seen = []

    class Door:
        @staticmethod
        def forward(*a):
            seen.append(("fwd", a[0]))
            return "jax-result"

        @staticmethod
        def backward(*a):
            seen.append(("bwd", a[1]))
            return "jax-grad"

    x = _JaxLike((2, 3), "float32")
    monkeypatch.setattr(drvsoftmax, "_jax_door", lambda: Door)
    assert drvsoftmax.scaled_masked_softmax(x) == "jax-result"
    assert drvsoftmax.scaled_masked_softmax_backward(x, x) == "jax-grad"
    assert seen == [("fwd", x), ("bwd", x)] and x.streams == [], "the DLPack intake read a JAX array"
    monkeypatch.setattr(drvsoftmax, "_jax_door", lambda: None)  # no JAX door: the generic intake
    drvsoftmax.scaled_masked_softmax(x, out=_fakes((2, 3), "float32"))
    assert x.streams == [1] and len(recorded["fwd"]) == 1


# ----------------------------------------------------------------------------------
# Raw pointers: argument checks and the operands they launch with.


def test_raw_forward_operands(recorded):
    B, H, Sq, Sk = (int(n) for n in _gen.integers(1, 6, 4))
    shape = (B, H, Sq, Sk)
    scale = float(_gen.uniform(-3, 3))
    raw.forward(
        1 << 40,
        2 << 40,
        shape,
        "bfloat16",
        scale=scale,
        mask=3 << 40,
        mask_dtype="uint8",
        mask_strides=(Sq * Sk, 0, Sk, 1),
        causal=True,
        key_lengths=4 << 40,
        key_lengths_dtype="int64",
        stream=0x123,
        device=0,
    )
    (dev, xo, yo, mo, ko, causal, sc, stream), *_ = recorded["fwd"]
    contig = (H * Sq * Sk, Sq * Sk, Sk, 1)
    assert xo == _core.Operand(1 << 40, "bfloat16", shape, contig) and yo.strides == contig
    assert mo == _core.Operand(3 << 40, "uint8", (B, 1 if H > 1 else H, Sq, Sk), (Sq * Sk, 0, Sk, 1))
    assert ko == _core.Operand(4 << 40, "int64", (B,), (1,))
    assert (dev, causal, sc, stream) == (0, True, scale, 0x123)
    raw.forward(1 << 40, 2 << 40, shape, "float32", mask=3 << 40, mask_dtype="float32", mask_shape=(Sq, Sk))
    mo = recorded["fwd"][-1][3]
    assert (mo.shape, mo.strides, recorded["fwd"][-1][-1]) == ((Sq, Sk), (Sk, 1), 0)


def test_raw_backward_operands(recorded):
    raw.backward(1 << 40, 2 << 40, 3 << 40, (3, 8), "float16", dy_strides=(16, 1), scale=2.0, stream=9)
    (dev, do, yo, xo, sc, s), *_ = recorded["bwd"]
    assert (do.strides, yo.strides, xo.ptr, sc, s) == ((16, 1), (8, 1), 3 << 40, 2.0, 9)


P = 1 << 40


@pytest.mark.parametrize(
    "kw,exc,pattern",
    [
        (dict(x=1.5), TypeError, r"^x must be a device pointer \(an int\), got float 1.5"),
        (dict(y=-1), ValueError, r"^y must be a device pointer in \[0, 2\*\*64\), got -1"),
        (dict(y=True), TypeError, r"^y must be a device pointer"),
        (dict(shape="abc"), TypeError, r"^shape must be a sequence of non-negative integers"),
        (dict(dtype="half"), TypeError, r"^dtype must be a dtype name \(bool, .*\), got 'half'"),
        (dict(dtype="int32"), TypeError, r"^x must be of dtype float16, bfloat16, float32 on the GPU, got dtype int32"),
        (dict(x_strides=(1, 2)), ValueError, r"^x_strides must be one stride per dim of shape \(2, 3, 4\), got 2"),
        (dict(y_strides=(12, 4, 1.0)), TypeError, r"^y_strides must be an integer, got float"),
        (dict(y_strides=(12, 0, 1)), ValueError, r"^out must be writable without overlap"),
        (dict(mask=P * 3), TypeError, r"^mask_dtype must be a dtype name when mask is given, got None"),
        (dict(mask=P * 3, mask_dtype="bool"), ValueError, r"^mask_shape must be given \(or mask_strides\)"),
        (dict(mask_dtype="bool"), ValueError, r"^mask must be a pointer when mask_dtype"),
        (dict(mask=P * 3, mask_dtype="bool", mask_shape=(5, 4)), ValueError, r"^mask must be broadcastable to x.shape"),
        (dict(mask=P * 3, mask_dtype="complex", mask_shape=(4,)), TypeError, r"^mask_dtype must be a dtype name"),
        (dict(key_lengths=P * 4, key_lengths_dtype="int16"), TypeError, r"^key_lengths_dtype must be int32 or int64"),
        (dict(key_lengths=P * 4, key_lengths_stride="1"), TypeError, r"^key_lengths_stride must be an integer"),
        (dict(scale=float("nan")), ValueError, r"^scale must be a finite float"),
        (dict(causal=1), TypeError, r"^causal must be a bool"),
        (dict(stream=-1), ValueError, r"^stream must be a stream handle in \[0, 2\*\*64\)"),
        (dict(stream="s"), TypeError, r"^stream must be"),
        (dict(device="0"), TypeError, r"^device must be an integer, got str"),
        (dict(device=-1), ValueError, r"^device must be a CUDA device ordinal \(>= 0\), got -1"),
        (dict(y=P + 4), ValueError, r"^out must be memory that does not overlap x's"),
        (dict(x=0), ValueError, r"^x must be a non-null device pointer"),
    ],
    ids=lambda v: str(v)[:40] if isinstance(v, dict) else None,
)
def test_raw_argument_errors(monkeypatch, kw, exc, pattern):
    calls = []
    monkeypatch.setattr(raw, "run_forward", lambda *a: calls.append(a))
    args = dict(x=P, y=2 * P, shape=(2, 3, 4), dtype="float32")
    args.update(kw)
    pos = [args.pop(k) for k in ("x", "y", "shape", "dtype")]
    with pytest.raises(exc, match=pattern) as e:
        raw.forward(*pos, **args)
    assert isinstance(e.value, drvsoftmax.DrvSoftmaxError) and calls == []


def test_raw_empty_and_in_place(recorded):
    raw.forward(0, 0, (2, 0, 4), "float16")  # nothing to do, null pointers fine
    raw.forward(P, P, (2, 4), "float16")  # in place
    raw.backward(P, 2 * P, P, (2, 4), "float32")  # dx = dy
    with pytest.raises(ValueError, match=r"^out must be memory that does not overlap y's"):
        raw.backward(P, 2 * P, 2 * P + 4, (2, 4), "float32")
    assert len(recorded["fwd"]) == 1 and len(recorded["bwd"]) == 1


def test_raw_imports_no_framework():
    code = "import sys, drvsoftmax.raw; bad = {'torch', 'cupy', 'numba', 'jax'} & set(sys.modules); print(sorted(bad))"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


# ----------------------------------------------------------------------------------
# One dtype table.


def test_one_dtype_table():
    assert _plan.X_DTYPES is _dtypes.KERNEL_CTYPES
    assert _core.MASK_KIND_OF_DTYPE is _dtypes.MASK_KIND_OF_DTYPE
    assert (_args.X_DTYPES_GPU, _args.ITEMSIZE, _args.INT_DTYPES) == (
        _dtypes.X_DTYPES_GPU,
        _dtypes.ITEMSIZE,
        _dtypes.INT_DTYPES,
    )
    for name, d in _dtypes.TABLE.items():
        assert d.dlpack == CODES[name] and d.itemsize * 8 == d.dlpack[1]
        if d.typestr:  # the interface's typestr is NumPy's
            assert np.dtype("<" + d.typestr).name == name and np.dtype(name).itemsize == d.itemsize


# ----------------------------------------------------------------------------------
# GPU: each door against the float64 reference.

DTYPES = ("float16", "bfloat16", "float32")


def _inputs(dtype, shape=(3, 4, 33, 200)):
    import ml_dtypes

    np_dt = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.dtype(dtype)
    x = (_gen.standard_normal(shape) * 3).astype(np_dt)
    mask = _gen.random((shape[0], 1, shape[2], shape[3])) < 0.25  # broadcast over heads
    kl = _gen.integers(0, shape[-1] + 3, shape[0]).astype(np.int32)
    scale = float(_gen.uniform(0.1, 1.0))
    ref = _reference.softmax_forward(x, mask, scale, True, kl)
    return x, mask, kl, scale, ref


def _bits(a):
    """A CuPy array of a's bytes (bfloat16 travels as uint16: CuPy has no bfloat16)."""
    import cupy as cp

    return cp.asarray(a.view(np.uint16) if a.dtype.name == "bfloat16" else a)


def _host_of(a, dtype):
    import cupy as cp
    import ml_dtypes

    h = cp.asnumpy(a)
    return h.view(ml_dtypes.bfloat16) if dtype == "bfloat16" else h


class DLPackOnly:
    """A producer with only __dlpack__ / __dlpack_device__, wrapping a CuPy array; it
    reports `dtype` through its own capsule (so bfloat16 too) and orders the consumer's
    stream after CuPy's current stream as the protocol asks."""

    __module__ = "dlpackonly"

    def __init__(self, a, dtype=None):
        self.a, self.dtype = a, dtype or a.dtype.name
        self.held: list[Capsule] = []

    def __dlpack_device__(self):
        return (2, self.a.device.id)

    def __dlpack__(self, stream=None, max_version=None):
        import cupy as cp

        if stream is not None:
            cur = cp.cuda.get_current_stream()
            if stream != (cur.ptr or 1):
                cp.cuda.ExternalStream(stream).wait_event(cur.record())
        item = self.a.itemsize
        c = Capsule(
            self.a.data.ptr,
            self.a.shape,
            self.dtype,
            tuple(s // item for s in self.a.strides),
            device=(2, self.a.device.id),
            versioned=max_version is not None,
        )
        self.held.append(c)
        return c.capsule


@requires_cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_cupy_door(dtype):
    cp = pytest.importorskip("cupy")
    if dtype == "bfloat16":
        pytest.skip("CuPy has no bfloat16 dtype (bfloat16 reaches the GPU doors through DLPack and raw pointers)")
    x, mask, kl, scale, ref = _inputs(dtype)
    y = drvsoftmax.scaled_masked_softmax(
        cp.asarray(x), cp.asarray(mask), scale=scale, causal=True, key_lengths=cp.asarray(kl)
    )
    assert isinstance(y, cp.ndarray) and y.dtype == x.dtype
    assert_matches(cp.asnumpy(y), ref, dtype, f"cupy {dtype}")
    dy = _gen.standard_normal(x.shape).astype(x.dtype)
    dx = drvsoftmax.scaled_masked_softmax_backward(cp.asarray(dy), y, scale=scale)
    rdx = _reference.softmax_backward(dy, cp.asnumpy(y), scale)
    np.testing.assert_allclose(cp.asnumpy(dx).astype(np.float64), rdx, **_bwd_tol(dtype))


def _bwd_tol(dtype):
    return dict(atol=20 * TOLS[dtype]["rtol"] * 0.1, rtol=5 * TOLS[dtype]["rtol"])


@requires_cuda
@pytest.mark.parametrize("dtype", ("float16", "float32"))
def test_numba_door(dtype):
    cuda = pytest.importorskip("numba.cuda")
    x, mask, kl, scale, ref = _inputs(dtype)
    y = drvsoftmax.scaled_masked_softmax(
        cuda.to_device(x), cuda.to_device(mask), scale=scale, causal=True, key_lengths=cuda.to_device(kl)
    )
    cuda.synchronize()
    assert type(y).__module__.startswith("numba")
    assert_matches(y.copy_to_host(), ref, dtype, f"numba {dtype}")


@requires_cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_dlpack_only_door(dtype):
    cp = pytest.importorskip("cupy")
    x, mask, kl, scale, ref = _inputs(dtype)
    xd, outd = (
        DLPackOnly(_bits(x), dtype),
        DLPackOnly(cp.full(x.shape, 0xFFFF if x.itemsize == 2 else -1, _bits(x).dtype), dtype),
    )
    m, k = DLPackOnly(cp.asarray(mask)), DLPackOnly(cp.asarray(kl))
    y = drvsoftmax.scaled_masked_softmax(xd, m, scale=scale, causal=True, key_lengths=k, out=outd)
    assert y is outd
    cp.cuda.get_current_stream().synchronize()
    assert_matches(_host_of(outd.a, dtype), ref, dtype, f"dlpack {dtype}")
    assert all(c.deleted == 1 for a in (xd, outd, m, k) for c in a.held)


@requires_cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_raw_door(dtype):
    cp = pytest.importorskip("cupy")
    x, mask, kl, scale, ref = _inputs(dtype)
    xg, mg, kg = _bits(x), cp.asarray(mask), cp.asarray(kl)
    yg = cp.empty_like(xg)
    cp.cuda.get_current_stream().synchronize()  # the copies above ran on CuPy's stream, not on s
    s = cp.cuda.Stream(non_blocking=True)
    raw.forward(
        xg.data.ptr,
        yg.data.ptr,
        x.shape,
        dtype,
        scale=scale,
        mask=mg.data.ptr,
        mask_dtype="bool",
        mask_shape=mask.shape,
        causal=True,
        key_lengths=kg.data.ptr,
        key_lengths_dtype="int32",
        stream=s.ptr,
        device=xg.device.id,
    )
    s.synchronize()
    assert_matches(_host_of(yg, dtype), ref, dtype, f"raw {dtype}")


# ----------------------------------------------------------------------------------
# GPU: stream order with a slow producer, checked without a host sync.

_SPIN = r"""
extern "C" __global__ void spin_then_copy(const unsigned short* src, unsigned short* dst, long long n,
                                          long long cycles) {
    if (threadIdx.x == 0 && blockIdx.x == 0) {
        long long t0 = clock64();
        while (clock64() - t0 < cycles) { }
    }
    __syncthreads();
    // one block: every thread waits for thread 0's spin, then copies
    for (long long i = threadIdx.x; i < n; i += blockDim.x) dst[i] = src[i];
}
"""


class CAIOnly:
    """``__cuda_array_interface__`` (v3) of a CuPy array, naming `stream` as its producer's."""

    __module__ = "caionly"

    def __init__(self, a, stream):
        cai = dict(a.__cuda_array_interface__)
        cai["stream"] = stream
        self.__cuda_array_interface__ = cai
        self.a = a

        class _Dev:
            id = a.device.id

        self.device = _Dev()


@requires_cuda
@pytest.mark.parametrize("door", ["cupy", "dlpack", "cai"])
def test_stream_order_without_host_sync(door):
    cp = pytest.importorskip("cupy")
    drvsoftmax.scaled_masked_softmax(cp.zeros((4, 256), cp.float16))  # kernels loaded before the producer runs
    cp.cuda.Device().synchronize()
    xh = (_gen.standard_normal((4, 256)) * 2).astype(np.float16)
    src = cp.asarray(xh)
    x = cp.full(xh.shape, cp.nan, dtype=cp.float16)  # what an early read would see
    out = cp.full(xh.shape, 7, dtype=cp.float16)
    cp.cuda.Device().synchronize()
    producer, ours = cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)
    spin = cp.RawKernel(_SPIN, "spin_then_copy")
    rate = cp.cuda.Device().attributes["ClockRate"]  # kHz
    with producer:
        spin((1,), (256,), (src.view(cp.uint16), x.view(cp.uint16), np.int64(x.size), np.int64(rate * 300)))  # ~0.3 s
        if door == "cupy":
            drvsoftmax.scaled_masked_softmax(x, out=out, stream=ours)
        elif door == "dlpack":
            drvsoftmax.scaled_masked_softmax(DLPackOnly(x), out=DLPackOnly(out), stream=ours)
        else:
            drvsoftmax.scaled_masked_softmax(CAIOnly(x, producer.ptr), out=CAIOnly(out, None), stream=ours)
    busy = not ours.done
    producer_busy = not producer.done
    ours.synchronize()
    assert producer_busy, "the producer finished before the check: the test proves nothing"
    assert busy, "our stream was idle while the producer still ran: it did not wait"
    assert_matches(cp.asnumpy(out), _reference.softmax_forward(xh, None, 1.0), "float16", f"{door} after producer")


# ----------------------------------------------------------------------------------
# GPU: memory from cuMemAlloc, through cuda.bindings alone; and the examples.


@requires_cuda
def test_raw_on_cumemalloc_memory_in_a_fresh_process():
    r = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "raw_pointers.py")],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "frameworks imported: none" in r.stdout and "max |y - ref|" in r.stdout


@requires_cuda
@pytest.mark.parametrize(
    "example,needs", [("cupy_softmax.py", "cupy"), ("numba_softmax.py", "numba"), ("dlpack_softmax.py", "cupy")]
)
def test_examples_run(example, needs):
    pytest.importorskip(needs)
    r = subprocess.run(
        [sys.executable, str(ROOT / "examples" / example)],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "max |y - ref|" in r.stdout


# ----------------------------------------------------------------------------------
# The CuPy door's fast path: a repeated plain call of a checked layout (a fake CuPy here).


class _FakeCupyArray:
    """What the CuPy door reads of a cupy.ndarray."""

    _next = [1 << 32]

    def __init__(self, shape, dtype, ptr=None, strides=None, dev=0):
        self.shape, self.dtype = tuple(shape), np.dtype(dtype)
        self.itemsize = self.dtype.itemsize
        if strides is None:
            strides, acc = [], self.itemsize
            for n in reversed(self.shape):
                strides.insert(0, acc)
                acc *= n
        self.strides = tuple(strides)
        if ptr is None:
            ptr = self._next[0]
            self._next[0] += 1 << 20
        self.data = SimpleNamespace(ptr=ptr, device_id=dev)
        self.device = SimpleNamespace(id=dev)


_FakeCupyArray.__module__ = "cupy._core.core"


@pytest.fixture
def fake_cupy(monkeypatch):
    from types import ModuleType

    from drvsoftmax import _arrays

    state = SimpleNamespace(device=0, stream=0x5000, general=[], fast=[], prepared=[])
    cp = ModuleType("cupy")
    cp.ndarray = _FakeCupyArray
    cp.empty = lambda shape, dtype=None: _FakeCupyArray(shape, dtype, dev=state.device)
    cp.cuda = SimpleNamespace(
        runtime=SimpleNamespace(getDevice=lambda: state.device),
        get_current_stream=lambda: SimpleNamespace(ptr=state.stream),
        Device=lambda d: contextlib.nullcontext(),
    )
    monkeypatch.setitem(sys.modules, "cupy", cp)
    monkeypatch.setattr(_intake, "_cupy_nd", _FakeCupyArray)
    monkeypatch.setattr(_intake, "_kind_of_type", {})
    monkeypatch.setattr(_arrays, "_fast", {})
    monkeypatch.setattr(raw, "run_forward", lambda *a: state.general.append(a))
    monkeypatch.setattr(_intake, "wait", lambda p, c, dev: None)
    monkeypatch.setattr(_arrays._driver, "device", lambda d: SimpleNamespace(ordinal=d))

    def prepared(dev, x, y, mask, klen, causal, scale):
        state.prepared.append((dev.ordinal, x.dtype, x.shape, x.strides, not ((x.ptr | y.ptr) & 15), causal, scale))
        return ("prep", len(state.prepared) - 1)

    monkeypatch.setattr(_core, "prepared_forward", prepared)
    monkeypatch.setattr(_core, "launch", lambda *a: state.fast.append(a))
    return state


def test_cupy_fast_path_launches_a_checked_layout_and_nothing_else(fake_cupy):
    st = fake_cupy
    x = _FakeCupyArray((2, 3, 8), "float16")
    y = drvsoftmax.scaled_masked_softmax(x, scale=0.5)  # the first call runs every check (and learns the layout)
    assert isinstance(y, _FakeCupyArray) and y.shape == x.shape and y.dtype == x.dtype
    assert len(st.general) == 1 and not st.fast
    assert st.prepared[-1] == (0, "float16", (2, 3, 8), (24, 8, 1), True, False, 0.5)
    y = drvsoftmax.scaled_masked_softmax(x, scale=0.5)
    assert len(st.general) == 1 and len(st.fast) == 1
    prep, xp, yp, mp, kp, stream, ctx_ok = st.fast[0]
    assert (prep, xp, yp, mp, kp, stream, ctx_ok) == (
        ("prep", len(st.prepared) - 1),
        x.data.ptr,
        y.data.ptr,
        0,
        0,
        st.stream,
        True,
    )
    assert isinstance(y, _FakeCupyArray) and y.shape == x.shape and y.dtype == x.dtype
    st.stream = 0x6000  # CuPy's current stream at the time of the call
    drvsoftmax.scaled_masked_softmax(x, scale=0.5)
    assert st.fast[-1][5] == 0x6000
    # Anything else takes the checked path: another scale, causal, a misaligned x (once),
    # another current device, a stream, out=, a mask.
    n = len(st.general)
    drvsoftmax.scaled_masked_softmax(x, scale=0.25)
    drvsoftmax.scaled_masked_softmax(x, scale=0.5, causal=True)
    drvsoftmax.scaled_masked_softmax(_FakeCupyArray((2, 3, 8), "float16", ptr=x.data.ptr + 2), scale=0.5)
    st.device = 1
    drvsoftmax.scaled_masked_softmax(x, scale=0.5)
    st.device = 0
    drvsoftmax.scaled_masked_softmax(x, scale=0.5, stream=0x7000)
    drvsoftmax.scaled_masked_softmax(x, scale=0.5, out=_FakeCupyArray((2, 3, 8), "float16"))
    drvsoftmax.scaled_masked_softmax(x, _FakeCupyArray((2, 1, 8), "bool"), scale=0.5)
    assert len(st.general) == n + 7
    # A misaligned x learnt once is fast from then on, under its own prepared launch.
    xm = _FakeCupyArray((2, 3, 8), "float16", ptr=x.data.ptr + 2)
    drvsoftmax.scaled_masked_softmax(xm, scale=0.5)
    assert len(st.general) == n + 7 and st.fast[-1][1] == xm.data.ptr
    assert st.prepared[st.fast[-1][0][1]][4] is False


def test_cupy_fast_path_never_skips_a_failing_check(fake_cupy):
    st = fake_cupy
    for bad, exc in (
        (_FakeCupyArray((2, 3, 8), "float64"), TypeError),
        (_FakeCupyArray((2, 3, 8), "float16", strides=(48, 16, 3)), ValueError),
    ):
        for _ in range(3):
            with pytest.raises(exc):
                drvsoftmax.scaled_masked_softmax(bad, scale=0.5)
    x = _FakeCupyArray((2, 3, 8), "float16")
    for _ in range(3):
        with pytest.raises(ValueError, match="scale"):
            drvsoftmax.scaled_masked_softmax(x, scale=float("nan"))
    assert not st.fast and not st.general


@requires_cuda
def test_cupy_repeated_calls_on_the_fast_path_stay_right():
    """Calls 2.. of a layout skip the checks: results stay right for contiguous, strided and
    misaligned views, across scales, causal, and CuPy's null and non-blocking streams."""
    cp = pytest.importorskip("cupy")
    from drvsoftmax import _arrays

    flat = cp.asarray(_gen.standard_normal(3 * 5 * 48 + 1).astype(np.float16) * 3)
    views = {
        "contiguous": flat[: 3 * 5 * 40].reshape(3, 5, 40),
        "strided rows": flat[: 3 * 5 * 48].reshape(3, 5, 48)[..., :40],
        "misaligned": flat[1 : 1 + 3 * 5 * 40].reshape(3, 5, 40),
    }
    streams = [cp.cuda.Stream.null, cp.cuda.Stream(non_blocking=True)]
    for name, x in views.items():
        xh = cp.asnumpy(x)
        for scale, causal in ((0.5, False), (0.5, False), (0.5, False), (1.5, True), (1.5, True), (0.5, False)):
            for s in streams:
                with s:
                    y = drvsoftmax.scaled_masked_softmax(x, scale=scale, causal=causal)
                    s.synchronize()
                ref = _reference.softmax_forward(xh, None, scale, causal, None)
                assert_matches(cp.asnumpy(y), ref, "float16", f"{name} scale={scale} causal={causal}")
        key = (x.shape, x.strides, x.dtype, 0.5, False, x.data.device_id)
        assert key in _arrays._fast and _arrays._fast[key].preps, f"{name}: the fast path was never taken"
