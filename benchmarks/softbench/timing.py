"""Timing: CUDA-event medians (do_bench-like, few repeats), host time per call, the copy ceiling.

Device time:
  1. one call, then EST_CALLS calls to estimate the time of one;
  2. warm-up of WARM_MS worth of calls, then MIN_REPS..MAX_REPS calls (TARGET_MS worth), each
     between its own pair of CUDA events; the median is reported;
  3. L2 (60 MB on an H200) must not serve repeated calls: the caller passes several input sets
     when one call's working set is small (`copies`), and the calls rotate through them; the
     outputs rotate too (each slot keeps its last output alive, so the allocator hands out
     different memory);
  4. calls shorter than QUEUE_FILL_BELOW_MS are queued behind a GPU sleep, so that the host
     runs ahead and the events time the GPU rather than the launch rate (the host section
     measures host cost).
"""

from __future__ import annotations

import math
import statistics
import time

EST_CALLS = 3
WARM_MS = 10.0
TARGET_MS = 40.0
MIN_REPS, MAX_REPS = 8, 40
ROTATE_BYTES = 240e6  # working sets below this (4x the H200's L2) rotate through several input copies
MAX_COPIES = 64
QUEUE_FILL_BELOW_MS = 1.0
QUEUE_FILL_MS_PER_REP = 0.1
QUEUE_FILL_MAX_MS = 20.0
SLEEP_CYCLES_PER_MS = 2.0e6  # ~2 GHz SM clock; a slower clock only sleeps longer
HOST_CALLS, HOST_REPEATS, HOST_WARMUP = 2000, 5, 200
COPY_BYTES = 2 * 2**30

TIMING = (WARM_MS, TARGET_MS, MIN_REPS, MAX_REPS)  # for the dry run's estimate


def copies_for(working_set: int) -> int:
    """Input sets to rotate so that one pass over them is several times the L2."""
    return int(min(MAX_COPIES, max(1, math.ceil(ROTATE_BYTES / max(working_set, 1)))))


def gpu_time_ms(torch, fn, argsets: list) -> tuple[float, int]:
    """(median ms, timed calls) of fn(argsets[i]), rotating through argsets."""
    n = len(argsets)
    keep: list = [None] * n

    def call(i: int) -> None:
        out = fn(argsets[i % n])
        if n > 1:
            keep[i % n] = out

    event = torch.cuda.Event
    call(0)
    torch.cuda.synchronize()
    e0, e1 = event(enable_timing=True), event(enable_timing=True)
    e0.record()
    for i in range(1, 1 + EST_CALLS):
        call(i)
    e1.record()
    e1.synchronize()
    est = max(e0.elapsed_time(e1) / EST_CALLS, 1e-4)
    warm = int(min(max(WARM_MS / est, 1), 50))
    reps = int(min(max(TARGET_MS / est, MIN_REPS), MAX_REPS))
    off = 1 + EST_CALLS
    for i in range(off, off + warm):
        call(i)
    off += warm
    starts = [event(enable_timing=True) for _ in range(reps)]
    ends = [event(enable_timing=True) for _ in range(reps)]
    sleep = getattr(torch.cuda, "_sleep", None)
    if est < QUEUE_FILL_BELOW_MS and sleep is not None:
        sleep(int(min(reps * QUEUE_FILL_MS_PER_REP, QUEUE_FILL_MAX_MS) * SLEEP_CYCLES_PER_MS))
    for i in range(reps):
        starts[i].record()
        call(off + i)
        ends[i].record()
    ends[-1].synchronize()
    keep.clear()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends)), reps


def host_times_us(
    dev, fns: dict, calls: int = HOST_CALLS, repeats: int = HOST_REPEATS, clock=time.perf_counter
) -> dict[str, tuple[float, float] | Exception]:
    """Per provider, (median, min) microseconds per call over `repeats` runs of `calls`
    back-to-back calls (`dev.sync()` closing each run, timed by `clock`), or the exception
    its calls raised.  The providers take turns run by run, so that a host whose speed
    drifts during the section slows every provider alike."""
    out: dict[str, tuple[float, float] | Exception] = {}
    live = {}
    for name, fn in fns.items():
        try:
            for _ in range(min(HOST_WARMUP, calls)):
                fn()
            dev.sync()
        except Exception as e:  # this provider is left out; the others go on
            out[name] = e
        else:
            live[name] = fn
    samples: dict[str, list[float]] = {name: [] for name in live}
    for _ in range(repeats):
        for name, fn in list(live.items()):
            t = clock()
            try:
                for _ in range(calls):
                    fn()
                dev.sync()
            except Exception as e:
                out[name] = e
                del live[name], samples[name]
                continue
            samples[name].append((clock() - t) / calls * 1e6)
    for name, v in samples.items():
        out[name] = (statistics.median(v), min(v))
    return {name: out[name] for name in fns}


def copy_ceiling(dev, nbytes: int = COPY_BYTES) -> tuple[float, float]:
    """(GB/s, ms) of a device-to-device copy of `nbytes`, read and write counted."""
    torch = dev.torch
    src = torch.empty(nbytes // 2, dtype=torch.float16, device=dev.name).fill_(1.0)
    dst = torch.empty_like(src)
    ms, _ = dev.time_ms(lambda d: d[1].copy_(d[0]), [(src, dst)])
    del src, dst
    return 2 * nbytes / (ms * 1e6), ms


class Cuda:
    """The GPU the benchmark runs on."""

    name = "cuda"

    def __init__(self, torch):
        self.torch = torch

    def sync(self) -> None:
        self.torch.cuda.synchronize()

    def time_ms(self, fn, argsets: list) -> tuple[float, int]:
        return gpu_time_ms(self.torch, fn, argsets)

    def empty_cache(self) -> None:
        self.torch.cuda.empty_cache()


class Cpu(Cuda):
    """For the tests: the same run on the CPU with tiny shapes (its times mean nothing)."""

    name = "cpu"

    def sync(self) -> None:
        pass

    def time_ms(self, fn, argsets: list) -> tuple[float, int]:
        samples = []
        for i in range(5):
            t = time.perf_counter()
            fn(argsets[i % len(argsets)])
            samples.append((time.perf_counter() - t) * 1e3)
        return statistics.median(samples), len(samples)

    def empty_cache(self) -> None:
        pass
