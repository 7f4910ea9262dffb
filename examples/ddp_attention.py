"""Data-parallel training step with drvsoftmax on every GPU of a host (torch.distributed, NCCL).

    python examples/ddp_attention.py [--gpus N]

Spawns one process per GPU; each runs the attention block of examples/torch_attention.py
(drvsoftmax.torch.ScaledMaskedSoftmax inside) on its shard of the batch under
DistributedDataParallel.  Rank 0 then compares the averaged gradients with one process
running the whole batch on one GPU, and prints the largest difference.
NVLink multicast stays off (NCCL_NVLS_ENABLE=0).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_attention import Attention  # noqa: E402

B, S, D = 8, 32, 64


def batch(device):
    g = torch.Generator().manual_seed(123)
    x = torch.randn(B, S, D, generator=g)
    pad = torch.zeros(B, 1, 1, S, dtype=torch.bool)
    pad[1::2, ..., S - 5 :] = True
    return x.to(device), pad.to(device)


def worker(rank, world, port, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), NCCL_NVLS_ENABLE="0")
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = Attention().cuda(rank)
    ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[rank])
    x, pad = batch(f"cuda:{rank}")
    shard = slice(rank * B // world, (rank + 1) * B // world)
    ddp(x[shard], padding_mask=pad[shard]).square().mean().backward()
    if rank == 0:
        out.put({n: p.grad.detach().cpu() for n, p in model.named_parameters()})
    dist.destroy_process_group()


def single():
    torch.manual_seed(0)
    model = Attention().cuda(0)
    x, pad = batch("cuda:0")
    # The DDP loss is the mean over each shard, then gradients are averaged over ranks:
    # the same as the mean over the whole batch.
    model(x, padding_mask=pad).square().mean().backward()
    return {n: p.grad.detach().cpu() for n, p in model.named_parameters()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    a = ap.parse_args()
    if a.gpus < 2:
        print(f"needs at least 2 GPUs, {a.gpus} visible")
        return 2
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = 29500 + os.getpid() % 1000
    procs = [ctx.Process(target=worker, args=(r, a.gpus, port, q)) for r in range(a.gpus)]
    for p in procs:
        p.start()
    grads = q.get(timeout=600)
    for p in procs:
        p.join()
    ref = single()
    worst = max((grads[n] - ref[n]).abs().max().item() for n in ref)
    print(f"data-parallel step on {a.gpus} GPUs: max |grad - single-process grad| = {worst:.2e}")
    return 0 if worst < 1e-5 and all(p.exitcode == 0 for p in procs) else 1


if __name__ == "__main__":
    raise SystemExit(main())
