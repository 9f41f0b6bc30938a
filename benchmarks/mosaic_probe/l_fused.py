"""Probe (GPU): where the fused dk/dv kernel at head dim 128 spills, and what its parts cost.

Variants (mosaic._PROBE flags): "no-dq" (no dq product or store: the split dk/dv kernel's
work plus the ds^T stores), "no-reduce" (dq product, tile stored, no TMA reduce-add), "ss-dk"
(dk += ds^T q reads ds^T from shared memory, where it already is for dq, so ds stops
occupying registers); each with the default registers and with (24, 240).

  python3 benchmarks/mosaic_probe/l_fused.py --checks --time split,ss-dk
  MOSAIC_GPU_DUMP_PTXAS=1 python3 benchmarks/mosaic_probe/l_fused.py --ptxas no-dq 2>&1 | grep -i spill
"""
import argparse, json, os, sys, traceback
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import jax, jax.numpy as jnp, numpy as np
from bench_attention import impl_fn
from bench_pallas import ours, outputs_and_grads, rel_l2
from timing import median_ms
from hilbert_ring_jax import DilatedPattern
from hilbert_ring_jax.backends import mosaic

LONGNET = ((2048, 4096, 8192), (1, 2, 4))
VARIANTS = [("split", (), (40, 232), False), ("fused", (), (40, 232), True),
            ("no-dq", ("no-dq",), (40, 232), True), ("no-reduce", ("no-reduce",), (40, 232), True),
            ("ss-dk", ("ss-dk",), (40, 232), True), ("ss-dk-240", ("ss-dk",), (24, 240), True),
            ("ss-all", ("ss-all",), (40, 232), True),
            ("dq-halves", ("dq-halves",), (40, 232), True), ("dq-halves-240", ("dq-halves",), (24, 240), True),
            ("no-store", ("no-store",), (40, 232), True), ("store-zero", ("store-zero",), (40, 232), True),
            ("no-when", ("no-when",), (40, 232), True), ("plain", ("plain",), (40, 232), True),
            ("plain-split", ("plain",), (40, 232), False)]


def use(flags, regs):
  mosaic._PROBE, mosaic._REGISTERS = frozenset(flags), regs
  mosaic._COMPILER = dict(approx_math=True, **(
      dict(reduction_scratch_bytes=0) if "ss-all" in flags else {}))
  jax.clear_caches()


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--ptxas", help="compile this variant only (with MOSAIC_GPU_DUMP_PTXAS=1)")
  ap.add_argument("--time", default="split,fused,ss-dk,ss-dk-240", help="variants to time")
  ap.add_argument("--checks", action="store_true")
  ap.add_argument("--json")
  args = ap.parse_args()
  d = 128
  if args.ptxas:
    x = jnp.ones((1, 8192, 2, d), jnp.bfloat16)
    for name, flags, regs, fused in VARIANTS:
      if name != args.ptxas:
        continue
      use(flags, regs)
      print(f"=== ptxas {name}", file=sys.stderr, flush=True)
      f = jax.jit(lambda q, k, v: jax.vjp(lambda *a: ours("mosaic", mosaic.Config(
          fused_backward=fused))(*a, DilatedPattern(*LONGNET), d ** -0.5), q, k, v)[1](q))
      f.lower(x, x, x).compile()  # compile only (some variants would hang if run)
    return
  out = []
  for name, flags, regs, fused in VARIANTS:
    if not args.checks or name != "plain":
      continue
    use(flags, regs)
    for causal, dtype in ((True, jnp.bfloat16),):
      pattern = DilatedPattern(*LONGNET, causal=causal)
      rng = np.random.default_rng(0)
      q, k, v, dout = (jnp.asarray(rng.standard_normal((1, 4096, 4, d)), dtype) for _ in range(4))
      with jax.default_matmul_precision("highest"):
        ref = outputs_and_grads(ours("xla"), q, k, v, dout, pattern, d ** -0.5)
      got = outputs_and_grads(ours("mosaic", mosaic.Config(fused_backward=True)), q, k, v, dout,
                              pattern, d ** -0.5)
      row = dict(check=name, causal=causal, **{t: rel_l2(g, r) for t, g, r in
                                                zip(("out", "dq", "dk", "dv"), got, ref)})
      print(json.dumps(row), flush=True)
      out.append(row)
  for kind, n, pattern, peer in (("full", 32768, DilatedPattern((32768,), (1,)), "cudnn"),
                                 ("longnet", 131072, DilatedPattern(*LONGNET), "folded_cudnn")):
    rng = np.random.default_rng(1)
    q, k, v, dout = (jnp.asarray(rng.standard_normal((1, n, 16, d)), jnp.bfloat16) for _ in range(4))
    s = d ** -0.5
    for rnd in range(2):  # two rounds, interleaved, against drift
      for name, flags, regs, fused in [(peer, None, None, None)] + [
          v for v in VARIANTS if v[0] in args.time.split(",")]:
        row = dict(pattern=kind, n=n, impl=name, round=rnd)
        try:
          if flags is None:
            p = impl_fn(peer, pattern)
            fn = lambda q, k, v, _p, s, p=p: p(q, k, v, s)
          else:
            use(flags, regs)
            fn = ours("mosaic", mosaic.Config(fused_backward=fused))
          fb = jax.jit(lambda q, k, v, do, fn=fn: jax.vjp(lambda *a: fn(*a, pattern, s), q, k, v)[1](do))
          row["fwdbwd_ms"] = median_ms(fb, (q, k, v, dout), 5)
        except Exception as e:
          row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
          traceback.print_exc(limit=2)
        print(json.dumps(row), flush=True)
        out.append(row)
  if args.json:
    json.dump(out, open(args.json, "w"), indent=1)


if __name__ == "__main__":
  main()
