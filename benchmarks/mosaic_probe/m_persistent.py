"""A/B of a `mosaic.Config` variant (`--variant`, default persistent=True) against the
default, interleaved (A B A B ...), medians of `--runs` per round; JSON lines and a table.
Shapes (`--shapes`, indices): non-causal full attention and LongNet (where every work item
costs the same), causal LongNet at D = 64 and 128."""
import argparse, ast, json, statistics, sys, time
sys.path.insert(0, "benchmarks")
import jax, jax.numpy as jnp, numpy as np
from timing import median_ms
from hilbert_ring_jax import DilatedPattern, dilated_attention
from hilbert_ring_jax.backends import mosaic

ap = argparse.ArgumentParser()
ap.add_argument("--runs", type=int, default=7)
ap.add_argument("--rounds", type=int, default=3)
ap.add_argument("--variant", default="persistent=True", help="key=value,... of mosaic.Config")
ap.add_argument("--shapes", default="0,1,2,3,4")
args = ap.parse_args()
LONGNET = ((2048, 4096, 8192), (1, 2, 4))
shapes = [("full", 32768, 128, DilatedPattern((32768,), (1,))),
          ("longnet", 131072, 128, DilatedPattern(*LONGNET)),
          ("longnet", 131072, 64, DilatedPattern(*LONGNET)),
          ("longnet", 32768, 64, DilatedPattern(*LONGNET)),
          ("longnet-causal", 131072, 64, DilatedPattern(*LONGNET, causal=True)),
          ("longnet-causal", 131072, 128, DilatedPattern(*LONGNET, causal=True))]
shapes = [shapes[int(i)] for i in args.shapes.split(",")]
variant = {k: ast.literal_eval(v) for k, v in (kv.split("=") for kv in args.variant.split(","))}
configs = {"default": None, "persistent": mosaic.Config(**variant)}
print(json.dumps(dict(device=jax.devices()[0].device_kind, jax=jax.__version__,
                      date=time.strftime("%Y-%m-%d %H:%M:%S"), runs=args.runs,
                      rounds=args.rounds, variant=variant)), flush=True)
rows = []
for kind, n, d, pattern in shapes:
  rng = np.random.default_rng(1)
  q, k, v, do = (jnp.asarray(rng.standard_normal((1, n, 16, d)), jnp.bfloat16) for _ in range(4))
  fns = {}
  for name, config in configs.items():
    f = lambda q, k, v, config=config: dilated_attention(q, k, v, pattern, implementation="mosaic",
                                                         config=config)
    fns[name] = (jax.jit(f), jax.jit(lambda q, k, v, do, f=f: jax.vjp(f, q, k, v)[1](do)))
  times = {(name, p): [] for name in configs for p in ("fwd", "fwdbwd")}
  for _ in range(args.rounds):
    for name, (fwd, fb) in fns.items():
      times[name, "fwd"].append(median_ms(fwd, (q, k, v), args.runs))
      times[name, "fwdbwd"].append(median_ms(fb, (q, k, v, do), args.runs))
  row = dict(kind=kind, n=n, d=d, **{f"{a}_{b}": [round(t, 3) for t in ts]
                                    for (a, b), ts in times.items()})
  for p in ("fwd", "fwdbwd"):
    row[f"ratio_{p}"] = round(statistics.median(times["persistent", p]) /
                              statistics.median(times["default", p]), 3)
  rows.append(row)
  print(json.dumps(row), flush=True)
for r in rows:
  print(f"{r['kind']:15s} N={r['n']:7d} D={r['d']:3d} fwd {statistics.median(r['default_fwd']):8.2f} -> "
        f"{statistics.median(r['persistent_fwd']):8.2f} ({r['ratio_fwd']})  fwd+bwd "
        f"{statistics.median(r['default_fwdbwd']):8.2f} -> {statistics.median(r['persistent_fwdbwd']):8.2f} "
        f"({r['ratio_fwdbwd']})")
