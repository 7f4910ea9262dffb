"""drvsoftmax on JAX arrays: attention probabilities between jitted functions.

    python examples/jax_softmax.py [--device gpu|cpu]

The scores come from a jitted function, drvsoftmax turns them into probabilities (on
JAX's stream, without waiting on the host), and a second jitted function uses them.
drvsoftmax runs outside jax.jit: inside it, the call is refused with an error that says so.
"""

from __future__ import annotations

import argparse
import math

import jax
import jax.numpy as jnp
import numpy as np

import drvsoftmax


@jax.jit
def scores(q, k):
    return (q @ jnp.swapaxes(k, -1, -2)).astype(jnp.bfloat16)  # [B, H, S, S]


@jax.jit
def attend(p, v):
    return p.astype(v.dtype) @ v


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="gpu", choices=("gpu", "cpu"))
    a = ap.parse_args()
    dev = jax.devices(a.device)[0]
    b, h, s, d = 2, 4, 128, 64
    kq, kk, kv = jax.random.split(jax.random.key(0), 3)
    q, k, v = (jax.device_put(jax.random.normal(r, (b, h, s, d)), dev) for r in (kq, kk, kv))
    lengths = jax.device_put(jnp.array([s, s // 2], dtype=jnp.int32), dev)
    scale = 1.0 / math.sqrt(d)

    x = scores(q, k)
    p = drvsoftmax.scaled_masked_softmax(x, scale=scale, causal=True, key_lengths=lengths)
    out = attend(p, v)

    # The same in plain JAX.
    i, j = np.arange(s)[:, None], np.arange(s)[None, :]
    hidden = (j > i)[None, None] | (np.arange(s)[None, None, None, :] >= np.asarray(lengths)[:, None, None, None])
    ref = jax.nn.softmax(jnp.where(hidden, -jnp.inf, x.astype(jnp.float32) * scale), axis=-1)
    err = float(jnp.max(jnp.abs(p.astype(jnp.float32) - ref)))
    print(f"{type(p).__name__} {p.dtype} {p.shape} on {p.devices()}: max |p - jax.nn.softmax| = {err:.2e}")
    assert p.dtype == x.dtype and err < 1e-2, err

    dp = jnp.ones_like(p)
    dx = drvsoftmax.scaled_masked_softmax_backward(dp, p, scale=scale)
    print(f"backward: {dx.dtype} {dx.shape}, |dx| max {float(jnp.max(jnp.abs(dx.astype(jnp.float32)))):.2e}")
    print(f"attention output {out.shape}: OK")

    try:
        jax.jit(lambda t: drvsoftmax.scaled_masked_softmax(t))(x)
    except drvsoftmax.DrvSoftmaxError as e:
        print(f"inside jax.jit: {type(e).__name__}: {str(e)[:72]}...")


if __name__ == "__main__":
    main()
