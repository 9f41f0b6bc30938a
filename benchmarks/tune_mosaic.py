"""The "mosaic" backend on a Hopper GPU: checks, then launch variants timed next to peers.

Checks: `dilated_attention(implementation="mosaic")` (the Mosaic GPU kernels;
triton's backward at head dim 256) against "xla" at float32 "highest" precision, outputs and
gradients, relative L2 errors. Timings: forward and forward+backward of "mosaic" next to
"mosaic+triton" (this forward with triton's backward), cuDNN (full attention),
tokamax's Mosaic GPU attention (full attention, when importable) and folded cuDNN (LongNet),
and forward+backward of each backward `mosaic.Config` variant, all in one run; medians over
`--runs`. JSON lines on stdout, a table at the end, `--json` for all. The "lm" shape is the
attention examples/lm_real.py's `--preset gpu` trained until 2026-11-26 (B=8, N=8192, H=6/2,
D=128, causal, offsets="all", (512, 2048, 8192) x (1, 4, 16): two mosaic launches), timed next
to "triton"; `--only lm` checks and times just that shape.

  python benchmarks/tune_mosaic.py --json out/mosaic.json
  python benchmarks/tune_mosaic.py --only lm --json out/mosaic_lm.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from bench_attention import impl_fn
from bench_pallas import ours, outputs_and_grads, rel_l2
from timing import median_ms
from hilbert_ring_jax import DilatedPattern, dilated_attention
from hilbert_ring_jax.api import _Dispatch
from hilbert_ring_jax.backends import base, mosaic

LONGNET = ((2048, 4096, 8192), (1, 2, 4))
# The attention of examples/lm_real.py's first `--preset gpu`: (batch, heads, kv_heads, head dim).
LM = ((512, 2048, 8192), (1, 4, 16))
LM_SHAPE = dict(b=8, h=6, hkv=2, d=128)
# Variants, by head dim: dq fused into the dk/dv kernel everywhere, or separate kernels
# everywhere (the default: fused in launches whose queries read many keys, 1,024 a head in
# unstrided rows and 1,900 in strided ones, `Config.backward_for`), and
# a program per work item (the default: persistent, but for long causal items).
VARIANTS = {d: {"fused": dict(fused_backward=True), "split": dict(fused_backward=False),
                "per_item": dict(persistent=False)} for d in (64, 128)}


def cross(fwd, bwd):
  """The forward of backend `fwd` with the backward of backend `bwd` (the kernel contract)."""
  return lambda q, k, v, pattern, s: base.attention(q, k, v, _Dispatch(pattern, s, fwd, bwd))[0]


def diagnose():
  """N = 4099, causal, float16: where mosaic's lse differs from xla's and triton's."""
  n, h, d = 4099, 4, 128
  pattern = DilatedPattern((1024, 2048), (1, 2), causal=True)
  rng = np.random.default_rng(0)
  q, k, v = (jnp.asarray(rng.standard_normal((1, n, h, d)), jnp.float16) for _ in range(3))
  lse = {name: np.asarray(dilated_attention(q, k, v, pattern, return_lse=True,
                                            implementation=name)[1])
         for name in ("xla", "triton", "mosaic")}
  for name in ("triton", "mosaic"):
    diff = np.abs(lse[name] - lse["xla"])
    bad = np.argwhere(diff > 1e-3)
    print(f"diagnose {name}: max |lse - xla| {diff.max():.3e}, {len(bad)} rows off; first "
          f"{bad[:12].tolist()}; values {lse[name][tuple(bad[:4].T)].tolist()} vs "
          f"{lse['xla'][tuple(bad[:4].T)].tolist()}", flush=True)


def checks(quick=False, only=None, variants=()):
  """Each shape against "xla" for the default config and each variant named in `variants`
  (the VARIANTS of the shape's head dim)."""
  if not quick and only is None:
    diagnose()
  rows = []
  lm = (8192, LM_SHAPE["h"], LM_SHAPE["hkv"], LM_SHAPE["d"], LM, {"offsets": "all"})
  shapes = [(4096, 4, 4, 128, LONGNET, {}), (8192, 4, 2, 128, ((8192,), (1,)), {}),
            (4096, 4, 1, 64, ((1024, 2048, 4096), (1, 2, 4)), {"offsets": "all"}),
            (4099, 4, 4, 128, ((1024, 2048), (1, 2)), {}),   # N % L != 0: padded copy
            (2048, 4, 4, 256, ((512, 2048), (1, 4)), {}),
            (4096, 6, 6, 128, ((512, 1024, 2048), (1, 2, 4)), {"head_groups": True}),
            lm]  # two launches
  if quick:  # LongNet, N % L != 0, GQA with a stride-1 row, and the LM's two launches
    shapes = [shapes[0], shapes[3], shapes[1], lm]
  if only == "lm":
    shapes = [lm]
  for n, h, hkv, d, (segs, rates), extra in shapes:
    configs = [("mosaic", None)] + [(name, mosaic.Config(**VARIANTS[d][name]))
                                    for name in variants if name in VARIANTS.get(d, {})]
    for causal, dtype in ((False, jnp.bfloat16), (True, jnp.float16)):
      pattern = DilatedPattern(segs, rates, causal=causal, **extra)
      rng = np.random.default_rng(0)
      q, dout = (jnp.asarray(rng.standard_normal((1, n, h, d)), dtype) for _ in range(2))
      k, v = (jnp.asarray(rng.standard_normal((1, n, hkv, d)), dtype) for _ in range(2))
      s = d ** -0.5
      ref = None  # "xla" at "highest", once for all configs
      for name, config in configs:
        row = dict(n=n, heads=h, kv_heads=hkv, head_dim=d, segments=segs, rates=rates,
                   causal=causal, dtype=jnp.dtype(dtype).name, impl=name, **extra)
        try:
          if ref is None:
            with jax.default_matmul_precision("highest"):
              ref = (*outputs_and_grads(ours("xla"), q, k, v, dout, pattern, s),
                     dilated_attention(q, k, v, pattern, return_lse=True,
                                       implementation="xla")[1])
          got = outputs_and_grads(ours("mosaic", config), q, k, v, dout, pattern, s)
          lse = dilated_attention(q, k, v, pattern, return_lse=True, implementation="mosaic",
                                  config=config)[1]
          row.update({f"err_{t}": rel_l2(g, r) for t, g, r in
                      zip(("out", "dq", "dk", "dv", "lse"), (*got, lse), ref)})
        except Exception as e:  # reported, and the run goes on
          row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
          traceback.print_exc(limit=3)
        rows.append(row)
        errs = " ".join(f"{key[4:]}={row[key]:.1e}" for key in row if key.startswith("err_"))
        print(f"check {name} N={n} H={h}/{hkv} D={d} w={segs} r={rates} {extra or ''} "
              f"causal={causal} {row['dtype']}: {errs or row.get('error')}", flush=True)
  return rows


def timings(runs, quick=False, cross_pass=True, only=None, names=None):
  """`names`: the VARIANTS timed (None: all)."""
  plan = []  # kind, N, D, pattern, peers, shape (batch, heads, kv heads; default 1, 16, 16)
  full = ((32768, False), (32768, True)) if quick else (
      (32768, False), (32768, True), (131072, False), (131072, True))
  for n, causal in full:
    plan.append(("full", n, 128, DilatedPattern((n,), (1,), causal=causal),
                 ["cudnn"] if quick else ["cudnn", "tokamax"], {}))
  for n, causal in ((131072, False), (131072, True)) if quick else (
      (32768, False), (131072, False), (131072, True)):
    plan.append(("longnet", n, 128, DilatedPattern(*LONGNET, causal=causal),
                 ["folded_cudnn"], {}))
  plan.append(("longnet", 131072, 64, DilatedPattern(*LONGNET), ["folded_cudnn"], {}))
  if not quick:
    plan.append(("longnet", 131072, 64, DilatedPattern(*LONGNET, causal=True),
                 ["folded_cudnn"], {}))
  lm_shape = {key: LM_SHAPE[key] for key in ("b", "h", "hkv")}
  plan.append(("lm", 8192, LM_SHAPE["d"], DilatedPattern(*LM, causal=True, offsets="all"),
               ["triton"], lm_shape))
  if only is not None:
    plan = [entry for entry in plan if entry[0] == only]
  rows = []
  for kind, n, d, pattern, peers, shape in plan:
    b, h, hkv = shape.get("b", 1), shape.get("h", 16), shape.get("hkv", 16)
    rng = np.random.default_rng(1)
    q, dout = (jnp.asarray(rng.standard_normal((b, n, h, d)), jnp.bfloat16) for _ in range(2))
    k, v = (jnp.asarray(rng.standard_normal((b, n, hkv, d)), jnp.bfloat16) for _ in range(2))
    s = d ** -0.5
    flops = 4 * b * d * pattern.visible_pairs(n, h)
    variants = {k: c for k, c in VARIANTS[d].items() if names is None or k in names}
    impls = [("mosaic", None)] + [("mosaic+triton", None)] * cross_pass
    impls += [(p, None) for p in peers]
    impls += [(name, mosaic.Config(**cfg)) for name, cfg in variants.items()]
    for name, config in impls:
      row = dict(pattern=kind, n=n, head_dim=d, causal=pattern.causal, impl=name, batch=b,
                 heads=h, kv_heads=hkv)
      try:
        if name in variants or name == "mosaic":
          fn = ours("mosaic", config)
        elif name == "mosaic+triton":
          fn = cross("mosaic", "triton")
        else:
          peer = impl_fn(name, pattern)
          fn = lambda q, k, v, _p, s, peer=peer: peer(q, k, v, s)
        fwd = jax.jit(lambda q, k, v, fn=fn: fn(q, k, v, pattern, s))
        row["fwd_ms"] = median_ms(fwd, (q, k, v), runs)
        row["fwd_tflops"] = flops / row["fwd_ms"] / 1e9
        fb = jax.jit(lambda q, k, v, do, fn=fn: jax.vjp(
            lambda *a: fn(*a, pattern, s), q, k, v)[1](do))
        row["fwdbwd_ms"] = median_ms(fb, (q, k, v, dout), runs)
        row["fwdbwd_tflops"] = 3.5 * flops / row["fwdbwd_ms"] / 1e9
      except Exception as e:
        row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        traceback.print_exc(limit=2)
      rows.append(row)
      print(json.dumps(row), flush=True)
  return rows


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--runs", type=int, default=5)
  ap.add_argument("--json", default=None)
  ap.add_argument("--skip-checks", action="store_true")
  ap.add_argument("--skip-timings", action="store_true")
  ap.add_argument("--quick", action="store_true", help="fewer checks and shapes, no tokamax")
  ap.add_argument("--no-cross", action="store_true", help="skip mosaic+triton")
  ap.add_argument("--variants", default=None,
                  help="comma-separated VARIANTS names timed (default: all)")
  ap.add_argument("--check-variants", default="",
                  help="comma-separated VARIANTS names also checked (e.g. per_item)")
  ap.add_argument("--only", choices=["full", "longnet", "lm"], default=None,
                  help="time one kind of shape only (with --only lm, check only that shape)")
  args = ap.parse_args()
  dev = jax.devices()[0]
  meta = dict(device=getattr(dev, "device_kind", str(dev)), jax=jax.__version__,
              date=time.strftime("%Y-%m-%d %H:%M:%S"), runs=args.runs, dtype="bfloat16",
              only=args.only)  # batch, heads, kv_heads: per timing row
  print(json.dumps(meta), flush=True)
  variants = [v for v in args.check_variants.split(",") if v]
  out = dict(meta=meta, checks=[] if args.skip_checks else checks(args.quick, args.only,
                                                                   variants),
             timings=[] if args.skip_timings else timings(
                 args.runs, args.quick, not args.no_cross, args.only,
                 None if args.variants is None else args.variants.split(",")))
  print(f"\n{'pattern':8s} {'causal':6s} {'N':>7s} {'D':>4s} {'impl':12s} {'fwd ms':>8s} "
        f"{'TFLOP/s':>8s} {'fwd+bwd':>8s} {'TFLOP/s':>8s}")
  for r in out["timings"]:
    if "error" in r:
      print(f"{r['pattern']:8s} {r['causal']!s:6s} {r['n']:7d} {r['head_dim']:4d} "
            f"{r['impl']:12s} error: {r['error'][:80]}")
      continue
    fb = f"{r['fwdbwd_ms']:8.2f} {r['fwdbwd_tflops']:8.1f}" if "fwdbwd_ms" in r else ""
    print(f"{r['pattern']:8s} {r['causal']!s:6s} {r['n']:7d} {r['head_dim']:4d} "
          f"{r['impl']:12s} {r['fwd_ms']:8.2f} {r['fwd_tflops']:8.1f} {fb}")
  if args.json:
    with open(args.json, "w") as fh:
      json.dump(out, fh, indent=1, default=str)
  limit = {"bfloat16": 3e-2, "float16": 1e-2}
  bad = [c for c in out["checks"] if "error" in c or
         max(v for key, v in c.items() if key.startswith("err_")) > limit[c["dtype"]]]
  if bad:
    print(f"FAILED checks: {json.dumps(bad)}")
    sys.exit(1)


if __name__ == "__main__":
  main()
