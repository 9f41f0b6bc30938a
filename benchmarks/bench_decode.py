"""Decoding benchmark: the dilated KV cache against a full KV cache, per token and in bytes.

For each batch size, kv head count and prompt length `L`:

- checks: the relative error of 3 token steps after a prompt of the longest length, against
  `dilated_attention`'s rows, for each of `--steps` ("default": the platform's token step,
  the "mosaic" kernel on Hopper; "xla": the jnp step).
- ours: `dilated_attention_step` with one new token (`T = 1`) on the compressed cache of
  `init_kv_cache` (filled with random rows), donated and threaded through the calls. The jnp
  step reads whole slots wherever the token is; the "mosaic" kernel reads the `(t % w) // r + 1`
  rows up to the token, so its cost depends on the position: with `--at end` (the default) the
  timed tokens are the last `S` before `L` (`S` = every timed step; `first_position = L - S`),
  at the issue's lengths (multiples of every `w`) the ends of all branches' segments, where a
  step reads the most rows; with `--at start` they are `L, L + 1, ...`, the first tokens of
  segments (the fewest rows). `step_ms`: the median of single jitted
  calls, each waited for (what a Python generation loop sees, dispatch included);
  `loop_step_ms`: the median over `--loops` runs of `--inner` steps in one `lax.fori_loop`,
  divided by `--inner`. `ours` names the step that ran; where it is not "xla" and `--steps`
  has "xla", the jnp step is timed too (`xla_step_ms`, `xla_loop_step_ms`).
- peer: what a user has today, a full KV cache `[B, L + S, Hkv, D]` holding `L` tokens, updated in place
  (`lax.dynamic_update_slice`) and `jax.nn.dot_product_attention` of the new token over it with
  `key_value_seq_lengths` (cuDNN where it runs, else XLA; the reason is recorded). Timed the
  same two ways. A cache that cannot fit is skipped with the bytes it needs; one that fails to
  allocate or run is recorded as "oom" (or the error).
- bytes: our cache against the issue's row count (per kv head and branch: the residues its
  query heads read, `ceil(w / r)` rows each; `offsets="all"`: all `r`), and the peer's.
  `rows_read_per_token` (per batch element, keys; values the same): ours `Hkv * sum(ceil(w/r))`
  (one slot per branch and kv head: what the jnp step reads; an upper bound for the "mosaic"
  kernel, which reads only the rows up to the token, and no slot of a kv head none of whose
  query heads reads the branch at the token's position), the peer's `Hkv * (L + 1)`.

And prefill: `dilated_attention_prefill` of a `--prefill` token prompt against
`dilated_attention`'s forward on the same input (medians of jitted calls).

  XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 python benchmarks/bench_decode.py --json out/decode.json
  python benchmarks/bench_decode.py --quick                       # tiny, CPU: checks the script

(the issue's configuration; without the memory fraction JAX takes 75% of the GPU, and the
peer's 64 GiB cache at 1M tokens and B = 8 is skipped.)
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import json
import re
import statistics
import sys
import time

import jax
import jax.numpy as jnp

from timing import median_ms
from hilbert_ring_jax import (DilatedPattern, dilated_attention, dilated_attention_prefill,
                              dilated_attention_step, init_kv_cache)
from hilbert_ring_jax.backends import NAMES, mosaic_decode
from hilbert_ring_jax.decode import step_backend

ISSUE = dict(batch="1,8", heads=16, kv_heads="16,4", head_dim=128, dtype="bfloat16",
             pattern="2048,4096,8192,16384,32768/1,2,4,6,12", prompts="65536,1048576",
             prefill=131072, runs=20, inner=32, loops=5, peer="cudnn,xla")
QUICK = dict(batch="1,2", heads=4, kv_heads="4,2", head_dim=16, dtype="float32",
             pattern="16,32,64/1,2,4", prompts="100,1000", prefill=256, runs=3, inner=4,
             loops=2, peer="cudnn,xla")


def parse_pattern(text: str) -> DilatedPattern:
  segs, rates = text.split("/")
  return DilatedPattern(tuple(map(int, segs.split(","))), tuple(map(int, rates.split(","))),
                        causal=True)


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def fill(shape, dtype, seed):
  """Pseudo-random values in [-1, 1) from a hash of the index: one fused kernel, no float32
  temporaries (a 64 GiB bfloat16 cache must not need 128 GiB to fill)."""
  i = jax.lax.broadcasted_iota(jnp.uint32, shape, len(shape) - 1)
  stride = jnp.uint32(shape[-1])
  for axis in range(len(shape) - 2, -1, -1):
    i = i + jax.lax.broadcasted_iota(jnp.uint32, shape, axis) * stride
    stride = stride * jnp.uint32(shape[axis])
  h = (i + jnp.uint32(seed)) * jnp.uint32(2654435761)
  h = h ^ (h >> 15)
  return ((h & jnp.uint32(0xFFFF)).astype(jnp.float32) / 32768.0 - 1.0).astype(dtype)


def formula_rows(pattern: DilatedPattern, num_heads: int, num_kv_heads: int) -> int:
  """The issue's row count, summed over kv heads and branches, for one of k or v and B = 1."""
  group = num_heads // num_kv_heads
  total = 0
  for (w, r), (start, stop) in zip(pattern.branches, pattern.head_ranges(num_heads)):
    for g in range(num_kv_heads):
      heads = [h for h in range(g * group, (g + 1) * group) if start <= h < stop]
      residues = set(range(r)) if pattern.offsets == "all" else {h % r for h in heads}
      total += (len(residues) if heads else 0) * -(-w // r)
  return total


def error_text(e: Exception) -> str:
  text = f"{type(e).__name__}: {e}"
  if "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower():
    return "oom"
  return text[:300]


def time_threaded(step, state, runs, warmup=3):
  """Median ms of `out, state = step(state)` over `runs` calls after `warmup`, each waited for.

  `step` returns what it computes (`out`) with the state: a result nobody reads could be
  compiled away."""
  for _ in range(warmup):
    _, state = jax.block_until_ready(step(state))
  times = []
  for _ in range(runs):
    t = time.perf_counter()
    _, state = jax.block_until_ready(step(state))
    times.append(1e3 * (time.perf_counter() - t))
  return statistics.median(times), state


def bench_ours(pattern, a, batch, kv_heads, prompt, dtype, impl=None, config=None):
  h, d = a.heads, a.head_dim
  cache = init_kv_cache(pattern, batch=batch, num_heads=h, num_kv_heads=kv_heads, head_dim=d,
                        dtype=dtype)
  rows = lambda xs, seed: tuple(fill(x.shape, x.dtype, seed + i) for i, x in enumerate(xs))
  first = max(prompt - timed_steps(a), 0) if a.at == "end" else prompt
  cache = dataclasses.replace(cache, length=jnp.asarray(first, jnp.int32),
                              k=rows(cache.k, 10), v=rows(cache.v, 20))
  q = fill((batch, 1, h, d), dtype, 1)
  k, v = fill((batch, 1, kv_heads, d), dtype, 2), fill((batch, 1, kv_heads, d), dtype, 3)
  row = dict(cache_bytes=int(sum(x.nbytes for x in jax.tree.leaves(cache))),
             formula_bytes=2 * batch * formula_rows(pattern, h, kv_heads) * d * dtype.itemsize,
             rows_read_per_token=kv_heads * sum(-(-w // r) for w, r in pattern.branches))
  row["cache_vs_formula"] = round(row["cache_bytes"] / row["formula_bytes"], 4)
  row["first_position"] = first

  row["ours"] = step_backend(q, k, pattern, impl, config)
  step = jax.jit(lambda q, k, v, c: dilated_attention_step(q, k, v, c, pattern,
                                                           implementation=impl, config=config),
                 donate_argnums=3)

  @functools.partial(jax.jit, donate_argnums=3)
  def loop(q, k, v, cache):
    def body(_, carry):
      q, cache = carry
      out, cache = dilated_attention_step(q, k, v, cache, pattern, implementation=impl,
                                          config=config)
      return q + 1e-3 * out, cache  # each step depends on the last
    return jax.lax.fori_loop(0, a.inner, body, (q, cache))

  row["step_ms"], cache = time_threaded(lambda c: step(q, k, v, c), cache, a.runs)
  loop_ms, cache = time_threaded(lambda c: loop(q, k, v, c), cache, a.loops, warmup=1)
  row["loop_step_ms"] = loop_ms / a.inner
  row["length_after"] = int(cache.length)
  return row


def timed_steps(a) -> int:
  """Token steps one timing threads through a cache: warm-up, calls, loops."""
  return 3 + a.runs + a.inner * (1 + a.loops)


def bench_peer(a, batch, kv_heads, prompt, dtype, impl):
  """The full KV cache: dynamic_update_slice, then dot_product_attention over it."""
  h, d = a.heads, a.head_dim
  capacity = prompt + timed_steps(a)
  need = 2 * batch * capacity * kv_heads * d * dtype.itemsize
  row = dict(peer=impl, peer_cache_bytes=need, peer_rows_read_per_token=kv_heads * (prompt + 1))
  limit = (jax.devices()[0].memory_stats() or {}).get("bytes_limit")
  if limit and need > 0.95 * limit:
    row["peer_status"] = f"skip: the cache needs {need / 2**30:.1f} GiB of {limit / 2**30:.1f}"
    return row
  q = fill((batch, 1, h, d), dtype, 1)
  k, v = fill((batch, 1, kv_heads, d), dtype, 2), fill((batch, 1, kv_heads, d), dtype, 3)

  def one(q, state):
    kc, vc, length = state
    at = (0, length, 0, 0)
    kc = jax.lax.dynamic_update_slice(kc, k, at)
    vc = jax.lax.dynamic_update_slice(vc, v, at)
    out = jax.nn.dot_product_attention(
        q, kc, vc, key_value_seq_lengths=jnp.full((batch,), length + 1, jnp.int32),
        implementation=impl)
    return out, (kc, vc, length + 1)

  step = jax.jit(one, donate_argnums=1)

  @functools.partial(jax.jit, donate_argnums=1)
  def loop(q, state):
    def body(_, carry):
      q, state = carry
      out, state = one(q, state)
      return q + 1e-3 * out, state
    return jax.lax.fori_loop(0, a.inner, body, (q, state))

  state = None
  try:
    state = (fill((batch, capacity, kv_heads, d), dtype, 4),
             fill((batch, capacity, kv_heads, d), dtype, 5), jnp.asarray(prompt, jnp.int32))
    row["peer_step_ms"], state = time_threaded(lambda s: step(q, s), state, a.runs)
    loop_ms, state = time_threaded(lambda s: loop(q, s), state, a.loops, warmup=1)
    row["peer_loop_step_ms"] = loop_ms / a.inner
    row["peer_status"] = "ok"
  except Exception as e:  # an implementation that cannot run here is reported, not fatal
    row["peer_status"] = error_text(e)
  del state
  gc.collect()
  return row


def bench_prefill(pattern, a, batch, kv_heads, dtype):
  n, h, d = a.prefill, a.heads, a.head_dim
  q = fill((batch, n, h, d), dtype, 1)
  k, v = fill((batch, n, kv_heads, d), dtype, 2), fill((batch, n, kv_heads, d), dtype, 3)
  prefill = jax.jit(lambda q, k, v: dilated_attention_prefill(q, k, v, pattern))
  forward = jax.jit(lambda q, k, v: dilated_attention(q, k, v, pattern))
  row = dict(prefill_tokens=n)
  try:
    row["prefill_ms"] = median_ms(prefill, (q, k, v), a.runs)
    row["forward_ms"] = median_ms(forward, (q, k, v), a.runs)
    row["prefill_vs_forward"] = round(row["prefill_ms"] / row["forward_ms"], 4)
  except Exception as e:
    row["prefill_status"] = error_text(e)
  return row


def check_step(pattern, a, kv_heads, dtype, impl=None):
  """Our step after a prefill against `dilated_attention`'s last rows (a check of what is
  timed): the largest relative error of 3 tokens' outputs, the last 3 before `--prompts`' last
  length (`--at end`) or the first 3 after it (`--at start`), after a prefill of the tokens
  before them (the token steps' `impl`; prefill and reference on the platform's defaults)."""
  n, h, d = max(int(x) for x in a.prompts.split(",")), a.heads, a.head_dim
  n += 3 if a.at == "start" else 0
  q = fill((1, n, h, d), dtype, 11)
  k, v = fill((1, n, kv_heads, d), dtype, 12), fill((1, n, kv_heads, d), dtype, 13)

  @jax.jit
  def diff(q, k, v):
    _, cache = dilated_attention_prefill(q[:, :-3], k[:, :-3], v[:, :-3], pattern)
    ref = dilated_attention(q, k, v, pattern)[:, -3:].astype(jnp.float32)
    errs = []
    for t in range(n - 3, n):
      out, cache = dilated_attention_step(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], cache,
                                          pattern, implementation=impl)
      r = ref[:, t - n + 3]
      errs.append(jnp.linalg.norm(out[:, 0].astype(jnp.float32) - r) / jnp.linalg.norm(r))
    return jnp.stack(errs).max()

  return float(diff(q, k, v))


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--quick", action="store_true", help="tiny sizes (CPU): checks the script")
  for name, val in ISSUE.items():
    ap.add_argument(f"--{name.replace('_', '-')}", type=type(val), default=None,
                    help=f"default {val} (--quick: {QUICK[name]})")
  ap.add_argument("--skip-peer", action="store_true")
  ap.add_argument("--skip-prefill", action="store_true")
  ap.add_argument("--skip-check", action="store_true")
  ap.add_argument("--at", choices=("end", "start"), default="end",
                  help="time our steps at the ends of segments (the most rows read; default) "
                       "or at their starts (the fewest)")
  ap.add_argument("--configs", default=None,
                  help="mosaic token-step variants to time too, e.g. "
                       "'block_k=64,stages=3;splits=8' (mosaic_decode.Config fields)")
  ap.add_argument("--steps", default="default,xla",
                  help="token steps to check and time: 'default' (the platform's: the mosaic "
                       "kernel on Hopper) and/or 'xla' (the jnp step); other backend names "
                       "without a token-step kernel run the jnp step")
  ap.add_argument("--json", default=None)
  a = ap.parse_args(argv)
  for name, val in (QUICK if a.quick else ISSUE).items():
    if getattr(a, name) is None:
      setattr(a, name, val)
  unknown = [x for x in a.steps.split(",") if x != "default" and x not in NAMES]
  if unknown:
    ap.error(f"--steps: unknown step(s) {', '.join(map(repr, unknown))}; valid: default, "
             f"{', '.join(NAMES)}")
  if not re.fullmatch(r"\d+(,\d+)*/\d+(,\d+)*", re.sub(r"\s", "", a.pattern)):
    ap.error(f"--pattern must be 'w1,w2,.../r1,r2,...' (segment lengths / dilation rates), "
             f"got {a.pattern!r}")
  try:
    pattern = parse_pattern(a.pattern)
  except ValueError as e:  # not a valid DilatedPattern
    ap.error(f"--pattern {a.pattern!r}: {e}")
  dtype = jnp.dtype(a.dtype)
  meta = dict(device=jax.devices()[0].device_kind, jax=jax.__version__, argv=sys.argv[1:],
              date=time.strftime("%Y-%m-%d %H:%M:%S"), pattern=str(pattern.branches),
              heads=a.heads, head_dim=a.head_dim, dtype=dtype.name)
  print(json.dumps(meta), flush=True)
  rows = []
  impls = [None if x == "default" else x for x in a.steps.split(",")]
  peers = [] if a.skip_peer else a.peer.split(",")
  if jax.default_backend() != "gpu":
    peers = [p for p in peers if p != "cudnn"]
  for kv_heads in map(int, a.kv_heads.split(",")):
    if not a.skip_check:
      for impl in impls:
        rows.append(dict(kind="check", kv_heads=kv_heads, step=impl or "default",
                         max_rel_err=check_step(pattern, a, kv_heads, dtype, impl)))
        print(json.dumps(rows[-1]), flush=True)
    for batch in map(int, a.batch.split(",")):
      for prompt in map(int, a.prompts.split(",")):
        row = dict(kind="step", batch=batch, kv_heads=kv_heads, prompt=prompt)
        row.update(bench_ours(pattern, a, batch, kv_heads, prompt, dtype))
        if "xla" in impls and row["ours"] != "xla":  # the jnp step, same run
          xla = bench_ours(pattern, a, batch, kv_heads, prompt, dtype, "xla")
          row.update(xla_step_ms=xla["step_ms"], xla_loop_step_ms=xla["loop_step_ms"])
        for spec in filter(None, (a.configs or "").split(";")):  # kernel variants, same run
          config = mosaic_decode.Config(**{k: int(v) for k, v in
                                           (kv.split("=") for kv in spec.split(","))})
          var = bench_ours(pattern, a, batch, kv_heads, prompt, dtype, "mosaic", config)
          row.setdefault("variants", []).append(
              dict(config=spec, step_ms=var["step_ms"], loop_step_ms=var["loop_step_ms"]))
        for impl in peers:  # the first peer that runs
          peer = bench_peer(a, batch, kv_heads, prompt, dtype, impl)
          row.setdefault("peer_attempts", []).append(
              dict(peer=impl, status=peer["peer_status"]))
          if peer["peer_status"] == "ok" or impl == peers[-1]:
            row.update(peer)
            break
        if "peer_step_ms" in row:
          row["peer_vs_ours"] = round(row["peer_step_ms"] / row["step_ms"], 3)
          row["peer_vs_ours_loop"] = round(row["peer_loop_step_ms"] / row["loop_step_ms"], 3)
        rows.append(row)
        print(json.dumps(row), flush=True)
        gc.collect()
      if not a.skip_prefill:
        row = dict(kind="prefill", batch=batch, kv_heads=kv_heads)
        row.update(bench_prefill(pattern, a, batch, kv_heads, dtype))
        rows.append(row)
        print(json.dumps(row), flush=True)
        gc.collect()
  if a.json:
    with open(a.json, "w") as f:
      json.dump(dict(meta=meta, rows=rows), f, indent=1, default=str)
  return dict(meta=meta, rows=rows)


if __name__ == "__main__":
  main()
