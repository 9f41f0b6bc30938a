"""Ring dilated attention scaling over the GPUs of one host (weak, strong, longest sequence).

For P in `--devices` (e.g. 1,2,4), with the sequence sharded over P GPUs:
- weak scaling: `--per-gpu` tokens on each GPU (N = P * t);
- strong scaling: N = `--strong` tokens split over P GPUs;
for the patterns `full` (w = N, r = 1) and `longnet` (w = 2048..32768, r = 1..16), forward and
forward+backward, bf16, B = 1. Efficiency is `T_1(N) / (P * T_P(N))`: one GPU doing the whole
problem alone against P GPUs sharing it ("whole"). For full attention also against one GPU
running the same per-GPU steps without communication ("steps": P blocks of t x t).
`--longest` doubles N (H = 8 unless set) until forward+backward on all GPUs fails.

  python benchmarks/ring_scaling.py --devices 1,2,4 --json out/ring.json
  python benchmarks/ring_scaling.py --devices 1,2 --per-gpu 512 --strong 2048 --heads 2 \
      --head-dim 32 --dtype float32   # CPU smoke test (XLA_FLAGS=--xla_force_host_platform_device_count=4)
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp

from timing import median_ms
from hilbert_ring_jax import DilatedPattern, dilated_attention
from hilbert_ring_jax.ring import sharded_dilated_attention

LONGNET = ((2048, 4096, 8192, 16384, 32768), (1, 2, 4, 8, 16))


def pattern_for(name, n, causal):
  if name == "full":
    return DilatedPattern((n,), (1,), causal=causal)
  segs, rates = LONGNET
  return DilatedPattern(tuple(min(w, n) for w in segs),
                        tuple(min(r, min(w, n)) for w, r in zip(segs, rates)), causal=causal)


def inputs(n, heads, head_dim, dtype, mesh=None):
  """Random q, k, v (and a cotangent), created already sharded over the sequence axis."""
  shape = (1, n, heads, head_dim)
  sharding = None if mesh is None else jax.NamedSharding(mesh, jax.P(None, "seq"))
  make = jax.jit(lambda key: tuple(jax.random.normal(k, shape, dtype)
                                   for k in jax.random.split(key, 4)),
                 out_shardings=None if sharding is None else (sharding,) * 4)
  return make(jax.random.PRNGKey(n))


def attention_fn(pattern, mesh, impl, backward, config=None, layers=1, layout="natural"):
  """The jitted call timed: `layers` attention calls in one program, each one's output the
  next one's queries (as a model's layers run; 1: one call alone). `layout`: the order of the
  ring's shards (`sharded_dilated_attention`; random inputs, so no permutation is timed: a
  model puts its tokens in that order once, in its data pipeline)."""
  if mesh is None:
    one = lambda q, k, v: dilated_attention(q, k, v, pattern, implementation=impl, config=config)
  else:
    one = lambda q, k, v: sharded_dilated_attention(q, k, v, pattern, mesh=mesh, axis_name="seq",
                                                    implementation=impl, config=config,
                                                    layout=layout)

  def fwd(q, k, v):
    for _ in range(layers):
      q = one(q, k, v)
    return q
  if not backward:
    return jax.jit(fwd)
  def fwd_bwd(q, k, v, do):
    out, vjp = jax.vjp(fwd, q, k, v)
    return out, vjp(do)
  return jax.jit(fwd_bwd)


_TIMED = {}


def time_case(n, p, pattern, args, backward):
  """Median ms of one call; each (n, p, pattern, pass) is timed once per run of the script."""
  key = (n, p, pattern, backward, args.heads)
  if key not in _TIMED:
    _TIMED[key] = _time_case(n, p, pattern, args, backward)
  return _TIMED[key]


def _time_case(n, p, pattern, args, backward):
  mesh = None if p == 1 else jax.make_mesh(
      (p,), ("seq",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:p])
  q, k, v, do = inputs(n, args.heads, args.head_dim, jnp.dtype(args.dtype), mesh)
  fn = attention_fn(pattern, mesh, args.impl, backward, layers=args.layers, layout=args.layout)
  try:
    return median_ms(fn, (q, k, v, do) if backward else (q, k, v), args.runs,
                     calls=getattr(args, "calls", 1)) / args.layers
  except Exception as e:  # e.g. out of memory: reported, not fatal
    print(f"  failed: N={n} P={p} {type(e).__name__}: {str(e)[:200]}", flush=True)
    return float("nan")


def tflops(pattern, n, args, backward, ms):
  flops = 4 * args.head_dim * pattern.visible_pairs(n, args.heads) * (3.5 if backward else 1)
  return flops / ms / 1e9


def add_problem_arguments(ap, passes):
  """The flags of the problem timed (shared with ring_profile.py)."""
  ap.add_argument("--patterns", default="full,longnet")
  ap.add_argument("--passes", default=passes)
  ap.add_argument("--causal", action="store_true")
  ap.add_argument("--heads", type=int, default=16)
  ap.add_argument("--head-dim", type=int, default=128)
  ap.add_argument("--dtype", default="bfloat16")
  ap.add_argument("--impl", default=None)
  ap.add_argument("--runs", type=int, default=5)
  ap.add_argument("--layout", default="natural", choices=["natural", "zigzag"],
                  help="the order of the ring's shards (sharded_dilated_attention's layout)")
  ap.add_argument("--layers", type=int, default=1,
                  help="attention calls chained in one program, as a model's layers (ms are "
                       "per layer)")


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--devices", default="1,2,4")
  ap.add_argument("--per-gpu", default="8192,32768,131072", help="weak scaling ('': none)")
  ap.add_argument("--strong", type=int, default=131072, help="strong scaling (0: none)")
  ap.add_argument("--calls", type=int, default=10,
                  help="calls a timed run dispatches back to back (1: each call alone)")
  add_problem_arguments(ap, passes="fwd,fwdbwd")
  ap.add_argument("--longest", action="store_true")
  ap.add_argument("--longest-heads", type=int, default=8)
  ap.add_argument("--longest-start", type=int, default=1 << 20)
  ap.add_argument("--json", default=None)
  ap.add_argument("--plot", default=None, help="efficiency plot (PNG) of the weak scaling")
  ap.add_argument("--plot-from", default=None, help="only plot this earlier --json file")
  args = ap.parse_args()
  if args.plot_from:
    with open(args.plot_from) as f:
      plot(json.load(f), args.plot)
    return
  devices = [int(x) for x in args.devices.split(",")]
  rows = []
  print(f"JAX {jax.__version__}, {len(jax.devices())} x {jax.devices()[0].device_kind}", flush=True)

  def save():  # after every row, so that a run cut short keeps what it measured
    if args.json:
      with open(args.json, "w") as f:
        json.dump(dict(jax=jax.__version__, device=jax.devices()[0].device_kind,
                       devices=len(jax.devices()), args=vars(args), rows=rows), f, indent=1)

  def record(kind, name, backward, n, p, ms, base_ms, step_ms=None):
    pattern = pattern_for(name, n, args.causal)
    row = dict(kind=kind, pattern=name, causal=args.causal, pass_="fwdbwd" if backward else "fwd",
               n=n, p=p, ms=ms, tflops_per_gpu=tflops(pattern, n, args, backward, ms) / p,
               one_gpu_ms=base_ms, eff_whole=base_ms / (p * ms) if base_ms else None,
               eff_steps=step_ms * p / ms if step_ms else None)
    rows.append(row)
    save()
    pct = lambda x: "-" if x is None else f"{x:.0%}"
    print(f"{kind:6} {name:8} {row['pass_']:7} N={n:>9} P={p} {ms:10.2f} ms "
          f"{row['tflops_per_gpu']:7.1f} TFLOP/s/GPU  eff(whole)={pct(row['eff_whole'])} "
          f"eff(steps)={pct(row['eff_steps'])}", flush=True)

  for name in args.patterns.split(","):
    for backward in [p == "fwdbwd" for p in args.passes.split(",")]:
      for t in [int(x) for x in args.per_gpu.split(",") if x]:
        for p in devices:
          n = p * t
          ms = time_case(n, p, pattern_for(name, n, args.causal), args, backward)
          base = time_case(n, 1, pattern_for(name, n, args.causal), args, backward) if p > 1 else ms
          step = None
          if name == "full" and not args.causal and p > 1:
            step = time_case(t, 1, DilatedPattern((t,), (1,)), args, backward)
          record("weak", name, backward, n, p, ms, base, step)
      n = args.strong
      base = None
      for p in devices if n else ():
        ms = time_case(n, p, pattern_for(name, n, args.causal), args, backward)
        base = ms if p == 1 else base
        record("strong", name, backward, n, p, ms, base)

  if args.longest:
    p = max(devices)
    args.heads = args.longest_heads
    n, best = args.longest_start, None
    while True:
      ms = time_case(n, p, pattern_for("longnet", n, args.causal), args, True)
      if ms != ms:  # NaN: failed
        break
      best = (n, ms)
      print(f"longest: N={n} forward+backward on {p} GPUs in {ms:.0f} ms", flush=True)
      n *= 2
    rows.append(dict(kind="longest", pattern="longnet", p=p, heads=args.heads,
                     n=best[0] if best else None, ms=best[1] if best else None))
    save()
  if args.plot:
    plot(dict(device=jax.devices()[0].device_kind, jax=jax.__version__, rows=rows), args.plot)


def plot(result, path):
  """Weak-scaling efficiency ("whole") against tokens per GPU, a line per pattern and pass,
  a panel per GPU count."""
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  rows = [r for r in result["rows"] if r["kind"] == "weak" and r["p"] > 1]
  counts = sorted({r["p"] for r in rows})
  fig, axes = plt.subplots(1, len(counts), figsize=(5 * len(counts), 3.6), squeeze=False)
  for ax, p in zip(axes[0], counts):
    lines = sorted({(r["pattern"], r["causal"], r["pass_"]) for r in rows if r["p"] == p})
    for pattern, causal, pass_ in lines:
      pts = sorted((r["n"] // p, r["eff_whole"]) for r in rows if r["p"] == p and
                   (r["pattern"], r["causal"], r["pass_"]) == (pattern, causal, pass_))
      label = f"{pattern}{', causal' if causal else ''}, {pass_}"
      ax.plot([t for t, _ in pts], [100 * e for _, e in pts], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_ylim(0, 110)
    ax.set_xlabel("tokens per GPU")
    ax.set_ylabel("efficiency T1 / (P TP), %")
    ax.set_title(f"{p} x {result['device']} (JAX {result['jax']})")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=120)


if __name__ == "__main__":
  main()
