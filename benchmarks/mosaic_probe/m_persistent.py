"""A/B of `mosaic.Config` variants (`--variant`, repeatable; default persistent=True) against
the default, interleaved (A B C ... A B C ...), medians of `--runs` per round; JSON lines and
a table (each variant's ratio of medians to the default's).
Shapes (`--shapes`, indices): non-causal full attention and LongNet (where every work item
costs the same), causal LongNet at D = 64 and 128, the attention of examples/lm_real.py's
first `--preset gpu` (6), full causal attention (7), full attention at D = 64 (8) and at 128K (9),
the LM's local model (10), causal LongNet at 32K, D = 64 and 128 (11, 12), full causal
attention at 128K (13), LongNet at 32K, D = 128 (14). Timings are
host-clocked: below a few milliseconds dispatch jitter shows (the LM shapes: `p_kernels.sh`
reads the device's clock).
`--peers`: cuDNN (full attention; the LM shapes: full causal) or folded cuDNN (LongNet) in the
same rounds, its ratio too its time over the default's; `--tokamax`: tokamax's attention
too (full attention; its wheels carried, as `run_gpu.sh` says)."""
import argparse, ast, json, statistics, sys, time
sys.path.insert(0, "benchmarks")
import jax, jax.numpy as jnp, numpy as np
from timing import median_ms
from hilbert_ring_jax import DilatedPattern, dilated_attention
from hilbert_ring_jax.backends import mosaic, mosaic_plan

ap = argparse.ArgumentParser()
ap.add_argument("--runs", type=int, default=7)
ap.add_argument("--rounds", type=int, default=3)
ap.add_argument("--variant", action="append",
                help="key=value,... of mosaic.Config (repeatable); none: the default alone")
ap.add_argument("--shapes", default="0,1,2,3,4")
ap.add_argument("--peers", action="store_true",
                help="also time the peer in the same rounds: cuDNN (full), folded cuDNN (LongNet)")
ap.add_argument("--tokamax", action="store_true",
                help="full attention: also tokamax's Mosaic GPU attention in the same rounds")
args = ap.parse_args()
LONGNET = ((2048, 4096, 8192), (1, 2, 4))
LM = ((512, 2048, 8192), (1, 4, 16))  # examples/lm_real.py --preset gpu: B=8, H=6, Hkv=2
shapes = [("full", 1, 32768, 16, 16, 128, DilatedPattern((32768,), (1,))),
          ("longnet", 1, 131072, 16, 16, 128, DilatedPattern(*LONGNET)),
          ("longnet", 1, 131072, 16, 16, 64, DilatedPattern(*LONGNET)),
          ("longnet", 1, 32768, 16, 16, 64, DilatedPattern(*LONGNET)),
          ("longnet-causal", 1, 131072, 16, 16, 64, DilatedPattern(*LONGNET, causal=True)),
          ("longnet-causal", 1, 131072, 16, 16, 128, DilatedPattern(*LONGNET, causal=True)),
          ("lm", 8, 8192, 6, 2, 128, DilatedPattern(*LM, causal=True, offsets="all")),
          ("full-causal", 1, 32768, 16, 16, 128, DilatedPattern((32768,), (1,), causal=True)),
          ("full", 1, 32768, 16, 16, 64, DilatedPattern((32768,), (1,))),
          ("full", 1, 131072, 16, 16, 128, DilatedPattern((131072,), (1,))),
          ("lm-local", 8, 8192, 6, 2, 128, DilatedPattern((512,), (1,), causal=True)),
          ("longnet-causal", 1, 32768, 16, 16, 64, DilatedPattern(*LONGNET, causal=True)),
          ("longnet-causal", 1, 32768, 16, 16, 128, DilatedPattern(*LONGNET, causal=True)),
          ("full-causal", 1, 131072, 16, 16, 128, DilatedPattern((131072,), (1,), causal=True)),
          ("longnet", 1, 32768, 16, 16, 128, DilatedPattern(*LONGNET))]
shapes = [shapes[int(i)] for i in args.shapes.split(",")]
variants = {spec: {k: ast.literal_eval(v) for k, v in (kv.split("=") for kv in spec.split(","))}
            for spec in args.variant or ["persistent=True"] if spec != "none"}
# "mosaic.NAME=value" sets a module flag of backends/mosaic_plan.py (e.g. _SHORT_ITEMS) while
# the variant compiles.
configs = {"default": (None, {}), **{
    spec: (mosaic.Config(**{k: v for k, v in kw.items() if not k.startswith("mosaic.")}),
           {k[len("mosaic."):]: v for k, v in kw.items() if k.startswith("mosaic.")})
    for spec, kw in variants.items()}}
print(json.dumps(dict(device=jax.devices()[0].device_kind, jax=jax.__version__,
                      date=time.strftime("%Y-%m-%d %H:%M:%S"), runs=args.runs,
                      rounds=args.rounds, variants=list(variants))), flush=True)
rows = []
for kind, b, n, h, hkv, d, pattern in shapes:
  rng = np.random.default_rng(1)
  q, do = (jnp.asarray(rng.standard_normal((b, n, h, d)), jnp.bfloat16) for _ in range(2))
  k, v = (jnp.asarray(rng.standard_normal((b, n, hkv, d)), jnp.bfloat16) for _ in range(2))
  fns = {}
  flags = {}
  for name, (config, flags[name]) in configs.items():
    f = lambda q, k, v, config=config: dilated_attention(q, k, v, pattern, implementation="mosaic",
                                                         config=config)
    fns[name] = (jax.jit(f), jax.jit(lambda q, k, v, do, f=f: jax.vjp(f, q, k, v)[1](do)))
  if args.peers:
    from bench_pallas import cudnn_full, cudnn_full_causal, folded_cudnn
    # The LM shapes' peer: the full causal attention of the LM's full model.
    peer = folded_cudnn if kind.startswith("longnet") else \
        cudnn_full_causal if pattern.causal else cudnn_full
    f = lambda q, k, v: peer(q, k, v, pattern, d ** -0.5)
    fns["peer"] = (jax.jit(f), jax.jit(lambda q, k, v, do: jax.vjp(f, q, k, v)[1](do)))
  if args.tokamax and kind.startswith("full"):
    from bench_pallas import tokamax_mosaic
    f = lambda q, k, v: tokamax_mosaic(q, k, v, pattern, d ** -0.5)
    fns["tokamax"] = (jax.jit(f), jax.jit(lambda q, k, v, do: jax.vjp(f, q, k, v)[1](do)))
  results = {}
  for name, (fwd, fb) in fns.items():
    saved = {attr: getattr(mosaic_plan, attr) for attr in flags.get(name, {})}
    try:  # compile (and run) once; a variant that does not apply here is left out
      for attr, value in flags.get(name, {}).items():
        setattr(mosaic_plan, attr, value)
      results[name] = jax.block_until_ready((fwd(q, k, v), fb(q, k, v, do)))
    except Exception as e:  # noqa: BLE001
      print(json.dumps(dict(kind=kind, n=n, d=d, variant=name, error=str(e)[:300])), flush=True)
      fns[name] = (None, None)
    finally:
      for attr, value in saved.items():
        setattr(mosaic_plan, attr, value)
  # Each variant's output and gradients against the default's (the same math: 0 expected
  # where only the schedule or the kernel's waits change).
  for name in results:
    if name not in ("default", "peer", "tokamax") and "default" in results:
      rel = lambda x, y: float(jnp.max(jnp.abs(x.astype(jnp.float32) - y.astype(jnp.float32)))
                               / jnp.max(jnp.abs(y.astype(jnp.float32))))
      diff = [rel(x, y) for x, y in zip(jax.tree.leaves(results[name]),
                                        jax.tree.leaves(results["default"]))]
      print(json.dumps(dict(kind=kind, n=n, d=d, variant=name, max_rel_diff_vs_default=diff)),
            flush=True)
  times = {(name, p): [] for name in fns for p in ("fwd", "fwdbwd")}
  for _ in range(args.rounds):
    for name, (fwd, fb) in fns.items():
      if fwd is None:
        continue
      times[name, "fwd"].append(median_ms(fwd, (q, k, v), args.runs))
      times[name, "fwdbwd"].append(median_ms(fb, (q, k, v, do), args.runs))
  row = dict(kind=kind, b=b, n=n, h=h, hkv=hkv, d=d, **{f"{a}_{b}": [round(t, 3) for t in ts]
                                    for (a, b), ts in times.items()})
  for spec in (name for name in fns if name != "default"):
    for p in ("fwd", "fwdbwd"):
      row[f"ratio_{p} {spec}"] = round(statistics.median(times[spec, p]) /
                                       statistics.median(times["default", p]), 3) \
          if times[spec, p] else None
  rows.append(row)
  print(json.dumps(row), flush=True)
for r in rows:
  med = lambda name, p: statistics.median(r[f"{name}_{p}"] or [float("nan")])
  print(f"{r['kind']:15s} N={r['n']:7d} D={r['d']:3d} default fwd {med('default', 'fwd'):8.2f} "
        f"fwd+bwd {med('default', 'fwdbwd'):8.2f}")
  for spec in [*variants, "peer", "tokamax"]:
    if f"ratio_fwd {spec}" not in r:
      continue
    print(f"    {spec:40s} fwd {med(spec, 'fwd'):8.2f} ({r['ratio_fwd ' + spec]})  fwd+bwd "
          f"{med(spec, 'fwdbwd'):8.2f} ({r['ratio_fwdbwd ' + spec]})")
