"""GPU robustness: tensors past 2^31 and 2^32 elements, 8 threads on 8 streams, fork.

Every result is checked against a float64 reference on fresh random inputs; outputs are
poisoned with NaN first, so an element no kernel wrote shows up.  Skips without a GPU.
"""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from helpers import assert_backward_matches, assert_matches, requires_cuda, run_in_threads
from helpers import to_numpy as _np

import drvsoftmax
from drvsoftmax import _reference

torch = pytest.importorskip("torch")
pytestmark = requires_cuda
ROOT = Path(__file__).resolve().parents[1]
DT = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def _need_bytes(n):
    free, _ = torch.cuda.mem_get_info()
    if free < n:
        pytest.skip(f"needs {n / 2**30:.1f} GiB of free GPU memory, {free / 2**30:.1f} GiB free")


def _sample_rows(rows, k=61):
    """Rows spread over the whole tensor, the first and the last included."""
    idx = np.unique(np.concatenate([np.linspace(0, rows - 1, k).astype(np.int64), [0, 1, rows - 2, rows - 1]]))
    return torch.from_numpy(idx[(idx >= 0) & (idx < rows)]).cuda()


# ----------------------------------------------------------------------------------
# Past 32-bit element offsets.


@pytest.mark.parametrize(
    "dtype,rows,sk,why",
    [
        ("float16", 2**21 + 1, 1024, "register tier, 2^31 + 1024 elements"),
        ("bfloat16", 2**24 + 3, 128, "2 chunks x 2 rows per thread, 2^31 + 384 elements, many blocks"),
        ("float16", 4097, 2**20, "looped tier, 2^32 + 2^20 elements"),
        ("float32", 2**20 + 1, 2048, "fp32, 2^31 + 2048 elements"),
    ],
)
def test_forward_past_2_31_elements(dtype, rows, sk, why):
    n = rows * sk
    item = torch.tensor([], dtype=DT[dtype]).element_size()
    _need_bytes(2 * n * item + 2**30)
    x = torch.randn((rows, sk), device="cuda", dtype=DT[dtype])
    y = torch.full_like(x, float("nan"))
    drvsoftmax.scaled_masked_softmax(x, scale=0.7, out=y)
    torch.cuda.synchronize()
    assert not torch.isnan(y).any(), f"{why}: elements left unwritten"
    idx = _sample_rows(rows)
    ref = torch.softmax(x[idx].double() * 0.7, -1)
    assert_matches(_np(y[idx]), ref.cpu().numpy(), dtype, why)
    del x, y
    torch.cuda.empty_cache()


def test_masked_causal_forward_and_backward_past_2_31_elements():
    # [B, H, Sq, Sk] with B*H*Sq*Sk > 2^31: mask, causal and key_lengths index with 64-bit
    # offsets; the backward reads dy and y and writes dx past 2^31 as well.
    b, h, sq, sk = 2, 16, 8192, 8200  # 2.15e9 elements
    _need_bytes(4 * b * h * sq * sk * 2 + 2**31)
    x = torch.randn((b, h, sq, sk), device="cuda", dtype=torch.float16)
    mask = torch.rand((b, 1, sq, sk), device="cuda") < 0.1
    kl = torch.tensor([sk, sk // 3], device="cuda")
    y = torch.full_like(x, float("nan"))
    drvsoftmax.scaled_masked_softmax(x, mask, scale=0.5, causal=True, key_lengths=kl, out=y)
    torch.cuda.synchronize()
    assert not torch.isnan(y).any()
    for bi, hi, qi in [(0, 0, 0), (1, 15, sq - 1), (1, 7, 4000), (0, 15, sq - 2), (1, 0, 1)]:
        # One row at a time; causal for query qi (bottom-right aligned) hides keys
        # j > qi + (Sk - Sq), written here as -inf scores (which hide as well).
        hidden = np.arange(sk) > qi + (sk - sq)
        ref = _reference.softmax_forward(
            np.where(hidden, -np.inf, _np(x[bi, hi, qi]).astype(np.float64))[None, None, None],
            _np(mask[bi : bi + 1, :, qi : qi + 1]),
            0.5,
            False,
            _np(kl[bi : bi + 1]),
        )
        assert_matches(_np(y[bi, hi, qi])[None, None, None], ref, "float16", f"row {bi},{hi},{qi}")
    dy = torch.randn_like(x)
    dx = torch.full_like(x, float("nan"))
    drvsoftmax.scaled_masked_softmax_backward(dy, y, scale=0.5, out=dx)
    torch.cuda.synchronize()
    assert not torch.isnan(dx).any()
    for bi, hi, qi in [(0, 0, 0), (1, 15, sq - 1), (1, 3, 5000)]:
        rdx = _reference.softmax_backward(_np(dy[bi, hi, qi]), _np(y[bi, hi, qi]), 0.5)
        got = _np(dx[bi, hi, qi]).astype(np.float64)
        yv, dyv = _np(y[bi, hi, qi]).astype(np.float64), _np(dy[bi, hi, qi]).astype(np.float64)
        mag = np.abs(yv) * (np.abs(dyv) + abs((dyv * yv).sum())) * 0.5
        assert np.all(np.abs(got - rdx) <= 4e-3 * mag + 1e-7), f"backward row {bi},{hi},{qi}"
    del x, y, dy, dx, mask
    torch.cuda.empty_cache()


def test_strided_view_whose_offsets_pass_2_31():
    # Leading strides that put later rows more than 2^31 elements from the pointer.
    rows, sk = 2**20 + 7, 1000
    _need_bytes(rows * 2048 * 2 + rows * sk * 2 + 2**30)
    big = torch.randn((rows, 2048), device="cuda", dtype=torch.float16)
    x = big[:, 24 : 24 + sk]  # row stride 2048: the last row starts past 2^31
    y = torch.full((rows, sk), float("nan"), device="cuda", dtype=torch.float16)
    drvsoftmax.scaled_masked_softmax(x, scale=1.3, out=y)
    torch.cuda.synchronize()
    assert not torch.isnan(y).any()
    idx = _sample_rows(rows)
    assert_matches(_np(y[idx]), torch.softmax(x[idx].double() * 1.3, -1).cpu().numpy(), "float16", "strided")
    del big, x, y
    torch.cuda.empty_cache()


# ----------------------------------------------------------------------------------
# Threads and streams.


def test_eight_threads_on_eight_streams():
    # Each thread launches on its own stream (half through stream=, half through the
    # current-stream context), with its own shapes, dtypes and mask forms, sharing the
    # prepared-launch caches with the others.  Results are checked after each stream sync.
    streams = [torch.cuda.Stream() for _ in range(8)]
    configs = [
        ("float16", (2, 4, 33, 200), "bool"),
        ("bfloat16", (3, 2, 17, 1000), "add"),
        ("float32", (1, 8, 5, 4097), "none"),
        ("float16", (4, 1, 64, 64), "klen"),
        ("float32", (2, 2, 9, 40000), "bool"),
        ("bfloat16", (6, 3, 3, 7), "add"),
        ("float16", (1, 1, 300, 300), "causal"),
        ("float32", (5, 2, 4, 513), "klen"),
    ]
    errors_found = []

    def work(i):
        dtype, shape, kind = configs[i]
        s = streams[i]
        g = torch.Generator(device="cuda").manual_seed(1000 + i)
        for it in range(25):
            with torch.cuda.stream(s):
                x = (torch.randn(shape, device="cuda", generator=g) * 3).to(DT[dtype])
                mask = None
                if kind == "bool":
                    mask = torch.rand((shape[0], 1, shape[2], shape[3]), device="cuda", generator=g) < 0.3
                elif kind == "add":
                    mask = torch.randn(shape[-2:], device="cuda", generator=g)
                kl = (
                    torch.randint(0, shape[-1] + 2, (shape[0],), device="cuda", generator=g, dtype=torch.int32)
                    if kind == "klen"
                    else None
                )
                causal = kind == "causal"
                dy = torch.randn(shape, device="cuda", generator=g).to(DT[dtype])
            if it % 2:
                y = drvsoftmax.scaled_masked_softmax(x, mask, scale=0.4, causal=causal, key_lengths=kl, stream=s)
                dx = drvsoftmax.scaled_masked_softmax_backward(dy, y, scale=0.4, stream=s)
            else:
                with torch.cuda.stream(s):
                    y = drvsoftmax.scaled_masked_softmax(x, mask, scale=0.4, causal=causal, key_lengths=kl)
                    dx = drvsoftmax.scaled_masked_softmax_backward(dy, y, scale=0.4)
            s.synchronize()
            ref = _reference.softmax_forward(
                _np(x), None if mask is None else _np(mask), 0.4, causal, None if kl is None else _np(kl)
            )
            try:
                assert_matches(_np(y), ref, dtype, f"thread {i} iteration {it}")
                rdx = _reference.softmax_backward(_np(dy), _np(y), 0.4)
                assert_backward_matches(
                    _np(dx), _np(dy), _np(y), rdx, 0.4, dtype, f"thread {i} iteration {it}: backward"
                )
            except AssertionError as e:
                errors_found.append(e)

    errors = run_in_threads(work, 8)
    assert not errors, errors
    assert not errors_found, errors_found[:3]


def test_narrow_key_lengths_are_converted_on_the_launch_stream():
    # key_lengths of uint16 (values past 2^15 included) on a busy stream: the conversion
    # must run on that stream, after the producer.
    s = torch.cuda.Stream()
    sk = 40000
    x = torch.randn((3, 2, 4, sk), device="cuda", dtype=torch.float16)
    host = torch.tensor([sk, 33000, 5], dtype=torch.uint16)  # (few CUDA kernels take uint16: copies only)
    torch.cuda.synchronize()
    with torch.cuda.stream(s):
        torch.cuda._sleep(20_000_000)
        kl = host.to("cuda")  # ready on s only after the sleep
    y = drvsoftmax.scaled_masked_softmax(x, key_lengths=kl, stream=s)
    s.synchronize()
    ref = _reference.softmax_forward(_np(x), None, 1.0, False, np.array([sk, 33000, 5]))
    assert_matches(_np(y), ref, "float16", "uint16 key_lengths")


# ----------------------------------------------------------------------------------
# fork and spawn.


def _child_after_fork(conn):
    # In the child of a process that used the GPU: the CPU path works, the GPU path is a
    # clear DrvSoftmaxError (CUDA does not survive fork), never a hang or a crash.
    try:
        rng = np.random.default_rng(0)
        x = rng.standard_normal((2, 3, 7)).astype(np.float32)
        y = drvsoftmax.scaled_masked_softmax(x, scale=0.5)
        ok_cpu = np.allclose(y, _reference.softmax_forward(x, None, 0.5), rtol=1e-6, atol=1e-7)
        msgs = []
        for call in (
            lambda: drvsoftmax.scaled_masked_softmax(_child_after_fork.x),
            lambda: drvsoftmax.scaled_masked_softmax_backward(_child_after_fork.x, _child_after_fork.x),
        ):
            try:
                call()
                msgs.append("no error")
            except drvsoftmax.DrvSoftmaxError as e:
                msgs.append(f"DrvSoftmaxError: {e}")
            except Exception as e:
                msgs.append(f"{type(e).__name__}: {e}")
        conn.send((bool(ok_cpu), msgs))
    except Exception as e:  # reported to the parent's assertion
        conn.send((False, [f"{type(e).__name__}: {e}"]))
    finally:
        conn.close()


def test_fork_after_gpu_use_is_safe():
    x = torch.randn((2, 3, 4, 100), device="cuda", dtype=torch.float16)
    drvsoftmax.scaled_masked_softmax(x)  # the parent holds a context and prepared launches
    drvsoftmax.scaled_masked_softmax_backward(x, x)
    torch.cuda.synchronize()
    _child_after_fork.x = x
    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe()
    p = ctx.Process(target=_child_after_fork, args=(child,))
    p.start()
    try:
        assert parent.poll(120), "the forked child did not answer (hang?)"
        ok_cpu, msgs = parent.recv()
        p.join(30)
    finally:
        if p.is_alive():
            p.kill()
    assert p.exitcode == 0, f"the forked child died: exit code {p.exitcode}"
    assert ok_cpu, msgs
    for m in msgs:
        assert m.startswith("DrvSoftmaxError") and "fork" in m, m
    # The parent is unaffected.
    y = drvsoftmax.scaled_masked_softmax(x, scale=0.5)
    torch.cuda.synchronize()
    assert_matches(_np(y), _reference.softmax_forward(_np(x), None, 0.5), "float16", "parent after fork")


def test_spawned_workers_use_the_gpu(tmp_path):
    script = tmp_path / "spawn_workers.py"  # spawn re-imports the main module: a file, not -c
    script.write_text(
        textwrap.dedent(
            """
        import multiprocessing as mp
        import numpy as np, torch, drvsoftmax
        from drvsoftmax import _reference

        def work(i):
            x = torch.randn((2, 3, 5, 300 + i), device="cuda", dtype=torch.float16)
            y = drvsoftmax.scaled_masked_softmax(x, scale=0.25, causal=True)
            ref = _reference.softmax_forward(x.float().cpu().numpy(), None, 0.25, True)
            return float(np.max(np.abs(y.float().cpu().numpy() - ref)))

        if __name__ == "__main__":
            torch.zeros(1, device="cuda")  # the parent uses the GPU first
            with mp.get_context("spawn").Pool(2) as pool:
                errs = pool.map(work, range(4))
            assert max(errs) < 2e-3, errs
            print("spawn ok", errs)
        """
        )
    )
    r = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert r.returncode == 0 and "spawn ok" in r.stdout, r.stdout + r.stderr
