"""Packed rows (`segment_ids`): our kernels against the peers a user has, in one run.

Full causal attention (`--non-causal`: without the mask, ours and ours_dense only) over one row
of `--seq-len` tokens packed with documents of log-normal lengths (median `--median`, at most
`--max-doc`; the last one cut at the row's end), B = 1:
- "ours": `dilated_attention(..., segment_ids=ids)` (the default backend: mosaic on Hopper);
- "ours_dense": the same row without ids (over the whole row), the TFLOP/s yardstick;
- "cudnn_padded": the documents padded to the longest, one a batch row, cuDNN with
  `query_seq_lengths` / `key_value_seq_lengths` (inputs padded beforehand, as a data loader
  would: the padding is not timed);
- "jax_mha": JAX's Pallas-Triton `mha` with `segment_ids`;
- "tokamax": tokamax's attention with the documents as a boolean mask (when importable).
Forward and forward+backward medians of each call alone (dispatch and the wait included) and,
`_b2b`, of 10 calls back to back (as a training loop issues them), the implementations' runs
interleaved (`timing.interleaved_ms`: what drifts weighs on all alike), TFLOP/s (of the calls
alone) counted on the pairs the documents leave visible, each peer's output checked against
ours (relative L2). Then LongNet with every id equal against no ids (what packing costs where it
changes nothing), alone and (`_b2b`) back to back, the two calls' runs interleaved too.

  python benchmarks/bench_packed.py --seq-len 32768 --median 2048 --json out/packed.json
  python benchmarks/bench_packed.py --implementation xla --impl ours,ours_dense \
      --seq-len 8192 --median 512 --heads 8 --head-dim 64 --dtype float32   # on a CPU

`--implementation triton` (or pallas, xla) times our other backends in place of the default.
`--trace` adds each HLO op's kernel time per call for ours and ours_dense (jax.profiler; run
with `XLA_FLAGS=--xla_gpu_enable_command_buffer=` so that each kernel is named by its op).
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

from bench_pallas import _tokamax, rel_l2
from ring_scaling import pattern_for
from timing import busy_ns, device_events, interleaved_ms
from hilbert_ring_jax import DilatedPattern, dilated_attention

IMPLS = ("ours", "ours_dense", "cudnn_padded", "jax_mha", "tokamax")  # `peers`' rows, in order


def documents(n, median, max_doc, seed):
  """Document lengths filling `n` tokens: log-normal (sigma 1), in [1, max_doc]."""
  rng = np.random.default_rng(seed)
  lengths = []
  while sum(lengths) < n:
    lengths.append(int(np.clip(rng.lognormal(np.log(median), 1.0), 1, max_doc)))
  lengths[-1] -= sum(lengths) - n
  return lengths


def peers(lengths, n, pattern, scale, implementation=None):
  """`name -> (prepare(q, k, v, do) -> args, fn(q, k, v, meta) -> out, unprepare(out) -> [1, N,
  ...], meta)`; ours through `implementation` (None: the library's default). `meta` (the
  documents as the peer reads them: our ids, cuDNN's lengths) is an argument of the jitted
  calls, as in a training step, where each batch brings its own: a constant would let XLA
  work out what is derived from it once, at compile time."""
  ids = jnp.asarray(np.repeat(np.arange(len(lengths)), lengths)[None], jnp.int32)
  starts = np.cumsum([0] + lengths[:-1])
  longest = -(-max(lengths) // 128) * 128
  # [docs, longest] gather indices into the row (padding reads position 0, masked by lengths)
  index = np.zeros((len(lengths), longest), np.int32)
  for i, (s, length) in enumerate(zip(starts, lengths)):
    index[i, :length] = np.arange(s, s + length)
  index = jnp.asarray(index)
  lens = jnp.asarray(lengths, jnp.int32)
  flat = np.concatenate([np.arange(i * longest, i * longest + length)
                         for i, length in enumerate(lengths)])

  def pad(*xs):
    return tuple(x[0][index] for x in xs)  # [docs, longest, H, D]

  def unpad(out):
    return out.reshape(-1, *out.shape[2:])[flat][None]

  same = lambda x: x
  table = {
      "ours": (lambda *x: x, lambda q, k, v, ids: dilated_attention(
          q, k, v, pattern, scale=scale, segment_ids=ids,
          implementation=implementation), same, ids),
      "ours_dense": (lambda *x: x, lambda q, k, v, _: dilated_attention(
          q, k, v, pattern, scale=scale, implementation=implementation), None, ids),
      "cudnn_padded": (pad, lambda q, k, v, lens: jax.nn.dot_product_attention(
          q, k, v, scale=scale, is_causal=True, query_seq_lengths=lens,
          key_value_seq_lengths=lens, implementation="cudnn"), unpad, lens),
  }

  def mha(q, k, v, ids):
    from jax.experimental.pallas.ops.gpu import attention  # pylint: disable=g-import-not-at-top
    return attention.mha(q, k, v, ids, sm_scale=scale, causal=True)

  table["jax_mha"] = (lambda *x: x, mha, same, ids)

  def tokamax(q, k, v, ids):
    mask = (ids[:, None, :, None] == ids[:, None, None, :])  # [1, 1, N, N] booleans
    return _tokamax().dot_product_attention(q, k, v, scale=scale, is_causal=True, mask=mask,
                                            implementation="mosaic")

  table["tokamax"] = (lambda *x: x, tokamax, same, ids)
  return ids, table


def kernel_table(fn, args, calls=3) -> dict:
  """`fn`'s device kernels over `calls` traced calls: per HLO op, its kernels' time per call
  (us), and their busy time per call (the union of the kernels' intervals)."""
  jax.block_until_ready(fn(*args))
  with tempfile.TemporaryDirectory() as log_dir:
    with jax.profiler.trace(log_dir):
      for _ in range(calls):
        jax.block_until_ready(fn(*args))
    events = device_events(sorted(glob.glob(f"{log_dir}/**/*.xplane.pb", recursive=True))[-1])
  per_op = collections.Counter()
  for e in events:
    per_op[e["hlo_op"]] += e["ns"] / 1e3 / calls
  return dict(busy_us=busy_ns(events) / 1e3 / calls, kernels_per_call=len(events) / calls,
              by_op_us=dict(per_op.most_common()))


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--seq-len", type=int, default=32768)
  ap.add_argument("--median", type=int, default=2048)
  ap.add_argument("--max-doc", type=int, default=16384)
  ap.add_argument("--heads", type=int, default=16)
  ap.add_argument("--head-dim", type=int, default=128)
  ap.add_argument("--dtype", default="bfloat16",
                  help="the inputs' dtype (float32 for the xla backend on a CPU)")
  ap.add_argument("--impl", default=",".join(IMPLS),
                  help=f"comma-separated rows to time, of {', '.join(IMPLS)} (default: all): "
                  "ours and ours_dense are this library on --implementation's backend, the "
                  "others its peers")
  ap.add_argument("--runs", type=int, default=5)
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--implementation", default=None,
                  help="our backend (mosaic, triton, pallas, xla) in the rows ours and "
                  "ours_dense and in the LongNet comparison; default: the library's")
  ap.add_argument("--trace", action="store_true",
                  help="also trace ours (and ours_dense): each HLO op's kernel time per call")
  ap.add_argument("--non-causal", action="store_true",
                  help="full attention without the causal mask (the rows ours and ours_dense "
                  "only: the peers' rows are causal)")
  ap.add_argument("--json", default=None)
  args = ap.parse_args()
  unknown = [name for name in args.impl.split(",") if name not in IMPLS]
  if unknown:
    ap.error(f"--impl: unknown row(s) {', '.join(map(repr, unknown))}; valid: {', '.join(IMPLS)}")
  peer_rows = [name for name in args.impl.split(",") if name not in ("ours", "ours_dense")]
  if args.non_causal and peer_rows:
    ap.error(f"--non-causal: the rows ours and ours_dense only, got {', '.join(peer_rows)}")
  try:
    dtype = jnp.dtype(args.dtype)
  except TypeError:
    dtype = None
  if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
    ap.error(f"--dtype: {args.dtype!r} is not a floating dtype (bfloat16, float16, float32)")
  args.dtype = dtype.name
  n, h, d = args.seq_len, args.heads, args.head_dim
  lengths = documents(n, args.median, args.max_doc, args.seed)
  pairs = (lambda m: m * m) if args.non_causal else (lambda m: m * (m + 1) // 2)
  visible = sum(pairs(length) for length in lengths) * h
  pattern = DilatedPattern((n,), (1,), causal=not args.non_causal)
  scale = d ** -0.5
  ids, table = peers(lengths, n, pattern, scale, args.implementation)
  keys = jax.random.split(jax.random.PRNGKey(args.seed), 4)
  q, k, v, do = (jax.random.normal(key, (1, n, h, d), args.dtype) for key in keys)
  result = dict(jax=jax.__version__, device=jax.devices()[0].device_kind, args=vars(args),
                documents=lengths, rows=[])
  print(f"JAX {jax.__version__}, {jax.devices()[0].device_kind}; {len(lengths)} documents, "
        f"median {int(np.median(lengths))}, longest {max(lengths)}", flush=True)
  reference = None
  calls = {}  # name: its (fwd, fb) calls and their arguments, all timed together below
  for name in args.impl.split(","):
    prepare, fn, unprepare, meta = table[name]
    row = dict(impl=name)
    result["rows"].append(row)
    try:
      x = prepare(q, k, v, do)
      fwd = jax.jit(fn)
      out = fwd(*x[:3], meta)
      if unprepare is not None:
        out = unprepare(out)
        reference = out if reference is None else reference
        row["rel_l2_vs_ours"] = rel_l2(out, reference)
      fb = jax.jit(lambda q, k, v, do, meta, fn=fn: jax.vjp(
          lambda q, k, v: fn(q, k, v, meta), q, k, v)[1](do))
      jax.block_until_ready(fb(*x, meta))
      calls[name] = ((fwd, (*x[:3], meta)), (fb, (*x, meta)))
    except Exception as e:  # a peer that is missing or fails here: reported, not fatal
      row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
      print(json.dumps(row), flush=True)
  # The implementations' runs interleaved, so that what drifts (the host's share of a call
  # timed alone, the clocks) weighs on all of them alike.
  rows = {row["impl"]: row for row in result["rows"] if row["impl"] in calls}  # the timed ones
  for key, which in (("fwd_ms", 0), ("fwdbwd_ms", 1)):
    for suffix, repeat in (("", 1), ("_b2b", 10)):  # alone; back to back
      for name, ms in interleaved_ms({name: c[which] for name, c in calls.items()}, args.runs,
                                     calls=repeat).items():
        rows[name][key + suffix] = ms
  flops = 4 * d * visible  # TFLOP/s on the visible pairs (the dense row's own: all its pairs)
  for name, row in rows.items():
    row["fwd_tflops"] = flops / row["fwd_ms"] / 1e9
    row["fwdbwd_tflops"] = 3.5 * flops / row["fwdbwd_ms"] / 1e9
    if name == "ours_dense":  # its own TFLOP/s, on the whole row
      dense = 4 * d * pairs(n) * h
      row["own_fwd_tflops"] = dense / row["fwd_ms"] / 1e9
      row["own_fwdbwd_tflops"] = 3.5 * dense / row["fwdbwd_ms"] / 1e9
    if args.trace and name in ("ours", "ours_dense"):
      (fwd, fwd_args), (fb, fb_args) = calls[name]
      row["trace_fwd"] = kernel_table(fwd, fwd_args)
      row["trace_fwdbwd"] = kernel_table(fb, fb_args)
    print(json.dumps(row), flush=True)
  dense_work = pairs(n) / (visible / h)  # the dense row's pairs over the visible ones
  for suffix in ("", "_b2b") if "ours" in rows else ():
    ms = lambda name: rows[name]["fwdbwd_ms" + suffix]
    others = [ms(name) for name in rows if name not in ("ours", "ours_dense")]
    if others:
      result["speedup_vs_best_peer_fwdbwd" + suffix] = min(others) / ms("ours")
    if "ours_dense" in rows:
      result["visible_tflops_vs_dense_fwdbwd" + suffix] = ms("ours_dense") / ms("ours") / dense_work
  # LongNet with every id equal against no ids.
  longnet = pattern_for("longnet", n, False)  # ring_scaling's: 2048..32768 x 1..16
  zeros = jnp.zeros((1, n), jnp.int32)
  calls = {}
  for label, equal in (("no ids", False), ("equal ids", True)):
    fn = lambda q, k, v, ids, equal=equal: dilated_attention(
        q, k, v, longnet, segment_ids=ids if equal else None,
        implementation=args.implementation)
    calls[label] = (jax.jit(lambda q, k, v, do, ids, fn=fn: jax.vjp(
        lambda q, k, v: fn(q, k, v, ids), q, k, v)[1](do)), (q, k, v, do, zeros))
  times = {}  # both calls' runs interleaved: alone, the host's share drifts between runs
  for suffix, repeat in (("", 1), (" b2b", 10)):
    times.update({label + suffix: ms for label, ms in
                  interleaved_ms(calls, args.runs, calls=repeat).items()})
  result["longnet_fwdbwd_ms"] = times
  result["longnet_equal_ids_over_none_fwdbwd"] = times["equal ids"] / times["no ids"]
  result["longnet_equal_ids_over_none_fwdbwd_b2b"] = times["equal ids b2b"] / times["no ids b2b"]
  print(json.dumps({k: v for k, v in result.items() if k not in ("rows", "documents", "args")}),
        flush=True)
  if args.json:
    with open(args.json, "w") as f:
      json.dump(result, f, indent=1)


if __name__ == "__main__":
  main()
