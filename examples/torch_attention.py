"""A small attention block that materialises its probabilities with drvsoftmax.

    python examples/torch_attention.py [--device cuda|cpu] [--compile]

Runs forward and backward eagerly and (with --compile) through
torch.compile(fullgraph=True), and checks both against plain PyTorch.
"""

from __future__ import annotations

import argparse
import math

import torch

from drvsoftmax.torch import ScaledMaskedSoftmax


class Attention(torch.nn.Module):
    def __init__(self, dim: int = 64, heads: int = 4, causal: bool = True):
        super().__init__()
        self.heads, self.dh = heads, dim // heads
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.proj = torch.nn.Linear(dim, dim)
        self.softmax = ScaledMaskedSoftmax(scale=1.0 / math.sqrt(self.dh), causal=causal)

    def forward(self, x, padding_mask=None, bias=None):
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, self.dh).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-1, -2)  # [B, H, S, S]
        # A learned additive bias, or a bool padding mask (True = hidden).
        p = self.softmax(scores, bias if bias is not None else padding_mask)
        return self.proj((p @ v).transpose(1, 2).reshape(b, s, d))


def reference(model: Attention, x, padding_mask=None, bias=None):
    b, s, d = x.shape
    q, k, v = model.qkv(x).view(b, s, 3, model.heads, model.dh).permute(2, 0, 3, 1, 4)
    scores = (q @ k.transpose(-1, -2)) * model.softmax.scale
    hidden = torch.ones(s, s, dtype=torch.bool, device=x.device).triu(1)
    if padding_mask is not None:
        hidden = hidden | padding_mask
    if bias is not None:
        scores = scores + bias
    p = torch.softmax(scores.masked_fill(hidden, float("-inf")), -1)
    return model.proj((p @ v).transpose(1, 2).reshape(b, s, d))


def run(device: str = "cpu", compile: bool = False, seed: int = 0) -> float:
    torch.manual_seed(seed)
    model = Attention().to(device)
    x = torch.randn(2, 16, 64, device=device, requires_grad=True)
    pad = torch.zeros(2, 1, 1, 16, dtype=torch.bool, device=device)
    pad[1, ..., 12:] = True  # last keys of batch 1 are padding
    bias = torch.randn(1, 4, 16, 16, device=device, requires_grad=True)
    fn = (
        torch.compile(model, fullgraph=True, backend="inductor" if device == "cuda" else "aot_eager")
        if compile
        else model
    )
    worst = 0.0
    for kwargs in ({"padding_mask": pad}, {"bias": bias}):
        out = fn(x, **kwargs)
        ref = reference(model, x, **kwargs)
        g = torch.randn_like(out)
        got = torch.autograd.grad(out, [x, *model.parameters()] + ([bias] if "bias" in kwargs else []), g)
        want = torch.autograd.grad(ref, [x, *model.parameters()] + ([bias] if "bias" in kwargs else []), g)
        worst = max(worst, (out - ref).abs().max().item())
        worst = max(worst, max((a - b).abs().max().item() for a, b in zip(got, want)))
    return worst


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--compile", action="store_true")
    a = ap.parse_args()
    err = run(a.device, a.compile)
    print(
        f"attention block on {a.device}{' (compiled)' if a.compile else ''}: "
        f"max |drvsoftmax - PyTorch| over outputs and gradients = {err:.2e}"
    )
    if err > 1e-4:
        raise SystemExit("mismatch")


if __name__ == "__main__":
    main()
