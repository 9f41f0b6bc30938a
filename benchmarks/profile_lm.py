"""Where the training step of `examples/lm_real.py --preset gpu` spends its time (GPU).

Times (medians, device-synchronized) of the parts of one step of each model at the preset's
shapes (8 windows of 8192 bytes, d = 768, 6 heads, 2 kv heads, 8 layers, bf16): the attention
layer alone (projections, rotary, kernel) forward+backward, the attention kernel alone
(`dilated_attention` or cuDNN on q, k, v) forward and forward+backward, one block's MLP
forward+backward, the whole model's loss and gradients, and the training step (AdamW). For the
dilated model, once per `--impls` backend. JSON lines, `--json` for all.

  python benchmarks/profile_lm.py --impls mosaic,triton --json out/profile_lm.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
import common  # noqa: E402  (examples/common.py)
import lm_real  # noqa: E402
from timing import median_ms  # noqa: E402
from hilbert_ring_jax import dilated_attention  # noqa: E402


def grad_of_sum(fn):
  """`args -> grads` of `sum(fn(*args))` (float32), jitted."""
  return jax.jit(jax.grad(lambda *a: fn(*a).astype(jnp.float32).sum(),
                          argnums=tuple(range(2))))


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--impls", default="auto", help="backends of the dilated model (auto: the "
                  "default dispatch)")
  ap.add_argument("--runs", type=int, default=5)
  ap.add_argument("--json")
  ap.add_argument("--preset", default="gpu")
  args = ap.parse_args()
  cfg = lm_real.parse_args(["--preset", args.preset])
  cfg.segments = lm_real.int_list("--segments", cfg.segments)
  cfg.rates = lm_real.int_list("--rates", cfg.rates)
  dtype = lm_real.DTYPES[cfg.dtype]
  b, n, d, h, hkv = cfg.batch, cfg.seq_len, cfg.dim, cfg.heads, cfg.kv_heads
  hd = d // h
  rows = []

  def record(**row):
    rows.append(row)
    print(json.dumps(row), flush=True)

  def timed(label, fn, fargs, **extra):
    try:
      record(part=label, ms=median_ms(fn, fargs, args.runs), **extra)
    except Exception as e:  # reported, and the run goes on
      traceback.print_exc(limit=2)
      record(part=label, error=f"{type(e).__name__}: {str(e)[:300]}", **extra)

  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((b, n, d)), dtype)
  q = jnp.asarray(rng.standard_normal((b, n, h, hd)), dtype)
  k, v = (jnp.asarray(rng.standard_normal((b, n, hkv, hd)), dtype) for _ in range(2))
  tokens = jnp.asarray(rng.integers(0, 256, (b, n)), jnp.int32)
  batch = (tokens, jnp.roll(tokens, -1, axis=1))

  full_impl = "cudnn" if lm_real.cudnn_runs(b, n, h, hkv, hd, dtype) is None else "ours"
  variants = [("dilated", impl) for impl in args.impls.split(",")] + [
      ("full", full_impl), ("local", "auto")]
  for name, impl in variants:
    cfg.impl = impl if name == "dilated" and impl != "auto" else None
    tag = dict(model=name, impl=impl)
    model, pattern = lm_real.build_model(name, cfg, full_impl, seed=0)
    # the kernel alone
    if name == "full" and full_impl == "cudnn":
      kernel = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                                            implementation="cudnn")
    else:
      kernel = lambda q, k, v, p=pattern, i=cfg.impl: dilated_attention(
          q, k, v, p, implementation=i)
    timed("kernel fwd", jax.jit(kernel), (q, k, v), **tag)
    timed("kernel fwd+bwd", grad_of_sum(kernel), (q, k, v), **tag)
    # the attention layer alone, and one block's MLP
    block = model.blocks[0]
    attn_graph, attn_state = nnx.split(block.attn)
    layer = lambda state, x: nnx.merge(attn_graph, state)(x)
    timed("attention layer fwd+bwd", grad_of_sum(layer), (attn_state, x), **tag)
    if name == "dilated" and impl == args.impls.split(",")[0]:
      mlp_graph, mlp_state = nnx.split((block.norm2, block.up, block.down))
      def mlp(state, x):
        norm, up, down = nnx.merge(mlp_graph, state)
        return down(nnx.gelu(up(norm(x))))
      timed("MLP fwd+bwd", grad_of_sum(mlp), (mlp_state, x), **tag)
    # the whole model: loss and gradients, and the training step
    graph, params, rest = nnx.split(model, nnx.Param, ...)
    loss = lambda params, rest, batch: lm_real.loss_fn(nnx.merge(graph, params, rest), batch)[0]
    timed("model loss fwd", jax.jit(loss), (params, rest, batch), **tag)
    timed("model loss+grads", jax.jit(jax.grad(loss)), (params, rest, batch), **tag)
    step, _ = common._functions(graph, lm_real.loss_fn, cfg.lr, cfg.steps)  # pylint: disable=protected-access
    opt_state = common.adamw(cfg.lr, cfg.steps).init(params)
    try:
      state = [params, opt_state]
      def one(batch):
        state[0], state[1], loss_v, _ = step(state[0], rest, state[1], batch)
        return loss_v
      for _ in range(2):
        jax.block_until_ready(one(batch))
      times = []
      for _ in range(args.runs):
        t = time.perf_counter()
        jax.block_until_ready(one(batch))
        times.append(1e3 * (time.perf_counter() - t))
      ms = float(np.median(times))
      record(part="train step", ms=ms, tokens_per_s=b * n / ms * 1e3, **tag)
    except Exception as e:
      traceback.print_exc(limit=2)
      record(part="train step", error=f"{type(e).__name__}: {str(e)[:300]}", **tag)
  if args.json:
    with open(args.json, "w") as fh:
      json.dump(dict(device=jax.devices()[0].device_kind, jax=jax.__version__,
                     date=time.strftime("%Y-%m-%d %H:%M:%S"), rows=rows), fh, indent=1)


if __name__ == "__main__":
  main()
