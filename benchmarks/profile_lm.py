"""Where the training step of `examples/lm_real.py --preset gpu` spends its time (GPU).

Times (medians, device-synchronized) of the parts of one step of each model at the preset's
shapes (8 windows of 8192 bytes, d = 768, 6 heads, 2 kv heads, 8 layers, bf16): the attention
layer alone (projections, rotary, kernel) forward+backward, the attention kernel alone
(`dilated_attention` or cuDNN on q, k, v) forward and forward+backward, one block's MLP
forward+backward, and the training step (loss, gradients, AdamW). For the
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
  ap.add_argument("--loops", action="store_true", help="only: the local model's step in a loop "
                  "on one batch of uniform random bytes, on a text batch drawn each step, and "
                  "on one text batch (the embedding's gradient used to depend on the data)")
  ap.add_argument("--loop", action="store_true", help="also time examples/common.train's loop "
                  "(the dilated model's first backend and the local model)")
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

  if args.loops:  # the local model's step on uniform random bytes vs text
    corpus = lm_real.load_corpus(cfg.heldout_fraction, cfg.split_seed)
    model, _ = lm_real.build_model("local", cfg, "cudnn", seed=0)
    graph, params, rest = nnx.split(model, nnx.Param, ...)
    step, _ = common._functions(graph, lm_real.loss_fn, cfg.lr, cfg.steps)  # pylint: disable=protected-access
    opt_state = common.adamw(cfg.lr, cfg.steps).init(params)
    state = [params, opt_state]
    host = lambda i: lm_real.train_batch(corpus["train"], n, b, 0, i)
    fixed = lambda i: batch
    text = host(0)
    for label, batches in (("uniform random bytes", fixed), ("text, drawn each step", host),
                           ("one text batch", lambda i: text)):
      for i in range(2):
        state[0], state[1], loss_v, _ = step(state[0], rest, state[1], batches(i))
      jax.block_until_ready(loss_v)
      t = time.perf_counter()
      for i in range(10):
        state[0], state[1], loss_v, _ = step(state[0], rest, state[1], batches(i))
      jax.block_until_ready(loss_v)
      record(part=f"loop: {label}", ms=(time.perf_counter() - t) * 100, model="local")
    t = time.perf_counter()
    for i in range(10):
      jax.block_until_ready(host(i))
    record(part="host batch alone", ms=(time.perf_counter() - t) * 100)
    return
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
    # the training step
    graph, params, rest = nnx.split(model, nnx.Param, ...)
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
    if args.loop and (name, impl) in ((variants[0]), ("local", "auto")):
      # examples/common.train's loop (a batch drawn on the host each step, the compiled step
      # called through jax.stages.Compiled), on the real corpus: its steady-state step time
      corpus = lm_real.load_corpus(cfg.heldout_fraction, cfg.split_seed)
      model, _ = lm_real.build_model(name, cfg, full_impl, seed=0)
      steps = 3 * args.runs + 1
      history = common.train(
          model, lm_real.loss_fn,
          lambda step: lm_real.train_batch(corpus["train"], n, b, 0, step), steps=steps,
          lr=cfg.lr, eval_batch=batch, eval_every=steps, ckpt_dir=None, desc=name)
      record(part="train loop (common.train)", ms=1e3 * history["step_seconds"],
             tokens_per_s=b * n / history["step_seconds"], **tag)
  if args.json:
    with open(args.json, "w") as fh:
      json.dump(dict(device=jax.devices()[0].device_kind, jax=jax.__version__,
                     date=time.strftime("%Y-%m-%d %H:%M:%S"), rows=rows), fh, indent=1)


if __name__ == "__main__":
  main()
