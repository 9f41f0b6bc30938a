"""Probe (GPU): compiler knobs and tile variants of the mosaic kernels, checked and timed.

Knobs: `unsafe_no_auto_barriers` + `reduction_scratch_bytes=0` (mosaic._COMPILER), which also
lets 3 forward stages fit at head dim 128; (the forward optimization-barrier hint of the first run was removed:
no gain). One row per (shape, variant): fwd ms, fwd+bwd ms; peers in the same run.

  python3 benchmarks/mosaic_probe/k_knobs.py --json out/knobs.json
  MOSAIC_GPU_DUMP_PTXAS=1 python3 benchmarks/mosaic_probe/k_knobs.py --ptxas 2>&1 | grep -i spill
"""
import argparse, json, os, sys, traceback
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import jax, jax.numpy as jnp, numpy as np
from bench_attention import impl_fn
from bench_pallas import ours, outputs_and_grads, rel_l2
from timing import median_ms
from hilbert_ring_jax import DilatedPattern
from hilbert_ring_jax.backends import mosaic

BASE = dict(approx_math=True)
KNOBS = dict(approx_math=True, unsafe_no_auto_barriers=True, reduction_scratch_bytes=0)
LONGNET = ((2048, 4096, 8192), (1, 2, 4))


def setting(knobs, hint=False):
  mosaic._COMPILER = KNOBS if knobs else BASE
  jax.clear_caches()  # the inner jit would otherwise reuse kernels traced under another setting


def check(n, h, hkv, d, segs, rates, causal, dtype, cfg):
  pattern = DilatedPattern(segs, rates, causal=causal)
  rng = np.random.default_rng(0)
  q, dout = (jnp.asarray(rng.standard_normal((1, n, h, d)), dtype) for _ in range(2))
  k, v = (jnp.asarray(rng.standard_normal((1, n, hkv, d)), dtype) for _ in range(2))
  with jax.default_matmul_precision("highest"):
    ref = outputs_and_grads(ours("xla"), q, k, v, dout, pattern, d ** -0.5)
  got = outputs_and_grads(ours("mosaic", mosaic.Config(**cfg)), q, k, v, dout, pattern, d ** -0.5)
  return {t: rel_l2(g, r) for t, g, r in zip(("out", "dq", "dk", "dv"), got, ref)}


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--json"); ap.add_argument("--runs", type=int, default=5)
  ap.add_argument("--ptxas", action="store_true")
  args = ap.parse_args()
  print(json.dumps(dict(device=jax.devices()[0].device_kind, jax=jax.__version__)), flush=True)
  if args.ptxas:  # compile only: fused/split backward at 128 and 64 with the knobs
    setting(True)
    for d, cfg in ((128, dict(fused_backward=True)), (128, dict(fused_backward=False)),
                   (64, dict(fused_backward=True)), (128, dict(stages=3))):
      print(f"=== ptxas D={d} {cfg}", file=sys.stderr, flush=True)
      x = jnp.ones((1, 8192, 2, d), jnp.bfloat16)
      f = jax.jit(lambda q, k, v: jax.vjp(lambda *a: ours("mosaic", mosaic.Config(**cfg))(
          *a, DilatedPattern(*LONGNET), d ** -0.5), q, k, v)[1](q))
      jax.block_until_ready(f(x, x, x))
    return
  out = dict(checks=[], timings=[])
  for knobs in (True,):
    setting(knobs)
    for shape in ((4096, 4, 4, 128, *LONGNET, True, jnp.bfloat16, dict(stages=3)),
                  (4096, 4, 4, 128, *LONGNET, False, jnp.float16, dict(fused_backward=True)),
                  (4096, 4, 2, 128, (4096,), (1,), True, jnp.bfloat16, {}),
                  (4096, 4, 1, 64, *LONGNET, True, jnp.bfloat16, dict(stages=4))):
      try:
        row = dict(shape=str(shape[:7]), cfg=shape[8], knobs=knobs, **check(*shape))
      except Exception as e:
        row = dict(shape=str(shape[:7]), error=f"{type(e).__name__}: {str(e)[:300]}")
        traceback.print_exc(limit=2)
      print(json.dumps(row, default=str), flush=True)
      out["checks"].append(row)
  plan = [("full", 32768, 128, DilatedPattern((32768,), (1,)), "cudnn",
           [("base", False, False, {}), ("knobs", True, False, {}),
            ("knobs-s3", True, False, dict(stages=3)), ("knobs-s3-hint", True, True, dict(stages=3)),
            ("knobs-fused", True, False, dict(fused_backward=True))]),
          ("longnet", 131072, 128, DilatedPattern(*LONGNET), "folded_cudnn",
           [("base", False, False, {}), ("knobs", True, False, {}),
            ("knobs-s3", True, False, dict(stages=3)), ("knobs-s3-hint", True, True, dict(stages=3)),
            ("knobs-fused", True, False, dict(fused_backward=True))]),
          ("longnet-causal", 131072, 128, DilatedPattern(*LONGNET, causal=True), "folded_cudnn",
           [("base", False, False, {}), ("knobs-s3", True, False, dict(stages=3))]),
          ("longnet", 131072, 64, DilatedPattern(*LONGNET), "folded_cudnn",
           [("base", False, False, {}), ("knobs", True, False, {}),
            ("knobs-s3", True, False, dict(stages=3)), ("knobs-s4", True, False, dict(stages=4)),
            ("knobs-hint", True, True, {}), ("knobs-split", True, False, dict(fused_backward=False))]),
          ("longnet-causal", 131072, 64, DilatedPattern(*LONGNET, causal=True), "folded_cudnn",
           [("base", False, False, {}), ("knobs", True, False, {}), ("knobs-s4", True, False, dict(stages=4))])]
  for kind, n, d, pattern, peer, variants in plan:
    rng = np.random.default_rng(1)
    q, k, v, dout = (jnp.asarray(rng.standard_normal((1, n, 16, d)), jnp.bfloat16) for _ in range(4))
    s = d ** -0.5
    for name, knobs, hint, cfg in [(peer, None, None, None)] + variants:
      row = dict(pattern=kind, n=n, head_dim=d, impl=name)
      try:
        if knobs is None:
          p = impl_fn(peer, pattern)
          fn = lambda q, k, v, _p, s, p=p: p(q, k, v, s)
        else:
          setting(knobs, hint)
          fn = ours("mosaic", mosaic.Config(**cfg))
        fwd = jax.jit(lambda q, k, v, fn=fn: fn(q, k, v, pattern, s))
        row["fwd_ms"] = median_ms(fwd, (q, k, v), args.runs)
        fb = jax.jit(lambda q, k, v, do, fn=fn: jax.vjp(lambda *a: fn(*a, pattern, s), q, k, v)[1](do))
        row["fwdbwd_ms"] = median_ms(fb, (q, k, v, dout), args.runs)
      except Exception as e:
        row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        traceback.print_exc(limit=2)
      out["timings"].append(row)
      print(json.dumps(row), flush=True)
  peer = {}
  for r in out["timings"]:
    key = (r["pattern"], r["n"], r["head_dim"])
    if r["impl"] in ("cudnn", "folded_cudnn"):
      peer[key] = r
      continue
    p = peer.get(key, {})
    if "fwd_ms" in r and "fwd_ms" in p:
      print(f"{r['pattern']:15s} {r['n']:7d} {r['head_dim']:4d} {r['impl']:15s} fwd {r['fwd_ms']:8.2f} "
            f"({r['fwd_ms'] / p['fwd_ms']:.3f}) fwd+bwd {r.get('fwdbwd_ms', float('nan')):8.2f} "
            f"({r.get('fwdbwd_ms', float('nan')) / p['fwdbwd_ms']:.3f})", flush=True)
  if args.json:
    json.dump(out, open(args.json, "w"), indent=1, default=str)


if __name__ == "__main__":
  main()
