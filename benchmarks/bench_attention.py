"""Dilated attention benchmark: our implementations next to their peers, in one run.

For each N and implementation: forward and forward+backward, device-synchronized medians
(warm-up, then `--runs` timed runs of `--calls` calls each), TFLOP/s on visible FLOPs
(forward 4*B*D*pairs, forward+backward 3.5x), tokens/s, and the compiled program's device
memory (XLA's memory analysis: arguments + outputs + temporaries). Peers: cuDNN full attention
(`jax.nn.dot_product_attention`), "folded cuDNN" LongNet (segments folded into the batch, cuDNN
per branch and residue, merged by LSE: SPEC's function), tokamax's Pallas Mosaic GPU
attention ("tokamax", when importable), JAX's Pallas-Triton `mha`, and the dense masked XLA
reference at small N. Writes JSON and a PNG plot of TFLOP/s against N.

  python benchmarks/bench_attention.py --pattern longnet --seq-len 32768,131072 \
      --impl triton,pallas,folded_cudnn --json out/longnet.json --plot out/longnet.png
  python benchmarks/bench_attention.py --pattern full --seq-len 8192,32768 --causal
  python benchmarks/bench_attention.py --memory 1048576      # LongNet forward at 1M tokens
  python benchmarks/bench_attention.py --longest --heads 8    # doubling N, forward+backward
  python benchmarks/bench_attention.py --impl mosaic,cudnn --causal \
      --seq-len 1024,2048,4096,32768 --tokens 32768     # the same tokens in rows of N
  python benchmarks/bench_attention.py ... --calls 10   # 10 calls back to back a run
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import jax
import jax.numpy as jnp

from bench_pallas import cudnn_full, cudnn_full_causal, folded_cudnn, jax_mha, tokamax_mosaic
from timing import median_ms
from hilbert_ring_jax import DilatedPattern, dilated_attention, dilated_attention_reference

PATTERNS = {"longnet": ((2048, 4096, 8192), (1, 2, 4))}
OURS = ("mosaic", "triton", "pallas", "xla")  # this library's backends
PEERS = ("cudnn", "folded_cudnn", "jax_mha", "tokamax", "dense_xla")


def make_pattern(name, n, causal):
  if name == "full":
    return DilatedPattern((n,), (1,), causal=causal)
  if name in PATTERNS:
    return DilatedPattern(*PATTERNS[name], causal=causal)
  segs, rates = name.split("/")  # e.g. "2048,4096/1,2"
  return DilatedPattern(tuple(map(int, segs.split(","))), tuple(map(int, rates.split(","))),
                        causal=causal)


def impl_fn(name, pattern):
  if name in OURS:
    return lambda q, k, v, s: dilated_attention(q, k, v, pattern, scale=s, implementation=name)
  peers = {"cudnn": cudnn_full_causal if pattern.causal else cudnn_full,
           "folded_cudnn": folded_cudnn, "jax_mha": jax_mha, "tokamax": tokamax_mosaic,
           "dense_xla": lambda q, k, v, p, s: dilated_attention_reference(q, k, v, p, scale=s)}
  return lambda q, k, v, s: peers[name](q, k, v, pattern, s)


def applicable(name, pattern, n):
  full = pattern.num_branches == 1 and pattern.dilation_rates == (1,) and \
      pattern.segment_lengths[0] >= n
  if name in ("cudnn", "jax_mha", "tokamax"):
    return full
  if name == "dense_xla":
    return n <= 8192
  if name == "xla":
    return n <= 32768
  return True


def device_bytes(fn, args):
  m = jax.jit(fn).lower(*args).compile().memory_analysis()
  if m is None:
    return None
  return int(m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
             - m.alias_size_in_bytes)


def inputs(b, n, h, hkv, d, dtype):
  key = jax.random.PRNGKey(n)
  ks = jax.random.split(key, 4)
  make = jax.jit(lambda: (jax.random.normal(ks[0], (b, n, h, d), dtype),
                          jax.random.normal(ks[1], (b, n, hkv, d), dtype),
                          jax.random.normal(ks[2], (b, n, hkv, d), dtype),
                          jax.random.normal(ks[3], (b, n, h, d), dtype)))
  return make()


def measure(name, pattern, args, a, backward=True):
  batch = (a.tokens or a.n) // a.n  # rows of N (`--tokens`), else one
  q, k, v, do = inputs(batch, a.n, a.heads, a.kv_heads, a.head_dim, a.dtype)
  scale = a.head_dim ** -0.5
  f = impl_fn(name, pattern)
  fwd = jax.jit(lambda q, k, v: f(q, k, v, scale))
  flops = 4 * a.head_dim * pattern.visible_pairs(a.n, a.heads) * batch
  row = dict(impl=name, n=a.n, batch=batch, causal=pattern.causal,
             pattern=str(pattern.branches), heads=a.heads, kv_heads=a.kv_heads,
             head_dim=a.head_dim, dtype=jnp.dtype(a.dtype).name)
  row["fwd_ms"] = median_ms(fwd, (q, k, v), args.runs, calls=args.calls)
  row["fwd_tflops"] = flops / row["fwd_ms"] / 1e9
  row["fwd_tokens_per_s"] = batch * a.n / row["fwd_ms"] * 1e3
  row["fwd_bytes"] = device_bytes(lambda q, k, v: f(q, k, v, scale), (q, k, v))
  if backward:
    fb = jax.jit(lambda q, k, v, do: jax.vjp(lambda *x: f(*x, scale), q, k, v)[1](do))
    row["fwdbwd_ms"] = median_ms(fb, (q, k, v, do), args.runs, calls=args.calls)
    row["fwdbwd_tflops"] = 3.5 * flops / row["fwdbwd_ms"] / 1e9
    row["fwdbwd_bytes"] = device_bytes(
        lambda q, k, v, do: jax.vjp(lambda *x: f(*x, scale), q, k, v)[1](do), (q, k, v, do))
  return row


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--impl", default="triton,pallas,cudnn,folded_cudnn,jax_mha,dense_xla",
                  help=f"comma-separated: our backends ({', '.join(OURS)}) and peers "
                  f"({', '.join(PEERS)})")
  ap.add_argument("--seq-len", default="8192,32768")
  ap.add_argument("--pattern", default="full", help="full | longnet | 'w1,w2/r1,r2'")
  ap.add_argument("--causal", action="store_true")
  ap.add_argument("--dtype", default="bfloat16")
  ap.add_argument("--heads", type=int, default=16)
  ap.add_argument("--kv-heads", type=int, default=None)
  ap.add_argument("--head-dim", type=int, default=128)
  ap.add_argument("--runs", type=int, default=5)
  ap.add_argument("--calls", type=int, default=1,
                  help="calls dispatched back to back a run, waited for once (1: each alone)")
  ap.add_argument("--forward-only", action="store_true")
  ap.add_argument("--memory", type=int, default=0, help="LongNet forward at this N: bytes")
  ap.add_argument("--longest", action="store_true", help="double N until fwd+bwd fails")
  ap.add_argument("--longest-start", type=int, default=1 << 20)
  ap.add_argument("--tokens", type=int, default=None,
                  help="rows of N making this many tokens (B = tokens / N), else B = 1")
  ap.add_argument("--json", default=None)
  ap.add_argument("--plot", default=None)
  args = ap.parse_args()
  unknown = [name for name in args.impl.split(",") if name not in OURS + PEERS]
  if unknown:
    ap.error(f"--impl: unknown implementation(s) {', '.join(map(repr, unknown))}; valid: "
             f"{', '.join(OURS + PEERS)}")
  args.kv_heads = args.kv_heads or args.heads
  if args.tokens and (args.memory or args.longest):
    ap.error("--tokens goes with --seq-len (not --memory or --longest)")
  if args.tokens and any(args.tokens % int(n) for n in args.seq_len.split(",")):
    ap.error(f"--tokens {args.tokens} must be a multiple of every --seq-len")
  args.dtype = jnp.dtype(args.dtype)
  meta = dict(device=jax.devices()[0].device_kind, jax=jax.__version__, argv=sys.argv[1:],
              date=time.strftime("%Y-%m-%d %H:%M:%S"))
  print(json.dumps(meta), flush=True)
  rows = []
  a = argparse.Namespace(**vars(args))

  if args.memory:
    a.n = args.memory
    pattern = make_pattern("longnet", a.n, args.causal)
    for name in args.impl.split(","):
      q, k, v, _ = inputs(1, a.n, a.heads, a.kv_heads, a.head_dim, a.dtype)
      f = impl_fn(name, pattern)
      try:
        total = device_bytes(lambda q, k, v: f(q, k, v, a.head_dim ** -0.5), (q, k, v))
        qkvo = (2 * q.size + 2 * k.size) * q.dtype.itemsize
        rows.append(dict(kind="memory", impl=name, n=a.n, bytes=total, qkvo_bytes=qkvo,
                         ratio=total / qkvo))
      except Exception as e:
        rows.append(dict(kind="memory", impl=name, n=a.n, error=f"{type(e).__name__}: {e}"[:300]))
      print(json.dumps(rows[-1]), flush=True)

  if args.longest:
    a.n = args.longest_start
    name = args.impl.split(",")[0]
    while True:
      pattern = make_pattern(args.pattern, a.n, args.causal)
      try:
        row = measure(name, pattern, argparse.Namespace(runs=1, calls=1), a)
      except Exception as e:
        print(f"longest: N={a.n} failed: {type(e).__name__}: {str(e)[:160]}", flush=True)
        break
      row["kind"] = "longest"
      rows.append(row)
      print(json.dumps(row), flush=True)
      a.n *= 2

  if not (args.memory or args.longest):
    for n in [int(x) for x in args.seq_len.split(",")]:
      a.n = n
      pattern = make_pattern(args.pattern, n, args.causal)
      for name in args.impl.split(","):
        if not applicable(name, pattern, n):
          continue
        try:
          row = measure(name, pattern, args, a, not args.forward_only)
        except Exception as e:  # a peer that cannot run is reported, not fatal
          row = dict(impl=name, n=n, error=f"{type(e).__name__}: {str(e)[:300]}")
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(f"\n{'impl':13} {'N':>8} {'fwd ms':>9} {'TFLOP/s':>8} {'fwd+bwd ms':>11} {'TFLOP/s':>8}"
          f" {'fwd GB':>7}")
    for r in rows:
      if "error" in r:
        print(f"{r['impl']:13} {r['n']:8} error {r['error'][:70]}")
        continue
      fb = (f"{r['fwdbwd_ms']:11.3f} {r['fwdbwd_tflops']:8.1f}" if "fwdbwd_ms" in r
            else f"{'-':>11} {'-':>8}")
      gb = f"{r['fwd_bytes'] / 2**30:7.2f}" if r.get("fwd_bytes") else f"{'-':>7}"
      print(f"{r['impl']:13} {r['n']:8} {r['fwd_ms']:9.3f} {r['fwd_tflops']:8.1f} {fb} {gb}")
  if args.json:
    with open(args.json, "w") as f:
      json.dump(dict(meta=meta, rows=rows), f, indent=1, default=str)
  if args.plot and rows:
    import matplotlib  # pylint: disable=g-import-not-at-top
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key in zip(axes, ("fwd_tflops", "fwdbwd_tflops")):
      for name in dict.fromkeys(r["impl"] for r in rows if key in r):
        pts = sorted((r["n"], r[key]) for r in rows if r["impl"] == name and key in r)
        ax.plot(*zip(*pts), marker="o", label=name)
      ax.set_xscale("log", base=2)
      ax.set_xlabel("N (tokens)")
      ax.set_ylabel("TFLOP/s (visible FLOPs)")
      ax.set_title(key.split("_")[0].replace("fwdbwd", "forward+backward").replace(
          "fwd", "forward") + f", {args.pattern}{' causal' if args.causal else ''}")
      ax.legend()
    fig.tight_layout()
    fig.savefig(args.plot, dpi=120)


if __name__ == "__main__":
  main()
