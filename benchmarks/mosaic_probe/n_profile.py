"""One call of a shape's forward (or forward+backward), after a warm-up call, for Nsight
Compute: `ncu --clock-control none --profile-from-start off ... python3 n_profile.py ...`
profiles the kernels of the second call only (cuProfilerStart/Stop around it).

  python3 benchmarks/mosaic_probe/n_profile.py --shape longnet-causal-64 --variant persistent=True
  python3 benchmarks/mosaic_probe/n_profile.py --shape full-32k --impl tokamax
"""
import argparse, ast, ctypes, sys
sys.path.insert(0, "benchmarks")
import jax, jax.numpy as jnp, numpy as np
from hilbert_ring_jax import DilatedPattern, dilated_attention
from hilbert_ring_jax.backends import mosaic, mosaic_plan

LONGNET = ((2048, 4096, 8192), (1, 2, 4))
LM = ((512, 2048, 8192), (1, 4, 16))
# name: (B, N, H, Hkv, D, pattern)
SHAPES = {"full-32k": (1, 32768, 16, 16, 128, DilatedPattern((32768,), (1,))),
          "full-causal-32k": (1, 32768, 16, 16, 128, DilatedPattern((32768,), (1,), causal=True)),
          "longnet-64": (1, 131072, 16, 16, 64, DilatedPattern(*LONGNET)),
          "longnet-causal-64": (1, 131072, 16, 16, 64, DilatedPattern(*LONGNET, causal=True)),
          "longnet-causal-128": (1, 131072, 16, 16, 128, DilatedPattern(*LONGNET, causal=True)),
          "lm": (8, 8192, 6, 2, 128, DilatedPattern(*LM, causal=True, offsets="all")),
          "lm-local": (8, 8192, 6, 2, 128, DilatedPattern((512,), (1,), causal=True)),
          "lm-full": (8, 8192, 6, 2, 128, DilatedPattern((8192,), (1,), causal=True))}

ap = argparse.ArgumentParser()
ap.add_argument("--shape", choices=list(SHAPES), required=True)
ap.add_argument("--variant", default="", help="key=value,... of mosaic.Config")
ap.add_argument("--impl", default="mosaic", help="mosaic, or a peer: cudnn, tokamax")
ap.add_argument("--backward", action="store_true", help="forward+backward")
ap.add_argument("--flags", default="", help="NAME=value,... module flags of backends/mosaic_plan.py")
args = ap.parse_args()
b, n, h, hkv, d, pattern = SHAPES[args.shape]
config = mosaic.Config(**{k: ast.literal_eval(v) for k, v in
                          (kv.split("=") for kv in args.variant.split(",") if kv)})
for kv in filter(None, args.flags.split(",")):
  setattr(mosaic_plan, kv.split("=")[0], ast.literal_eval(kv.split("=")[1]))
rng = np.random.default_rng(0)
q, do = (jnp.asarray(rng.standard_normal((b, n, h, d)), jnp.bfloat16) for _ in range(2))
k, v = (jnp.asarray(rng.standard_normal((b, n, hkv, d)), jnp.bfloat16) for _ in range(2))
if args.impl == "mosaic":
  f = lambda q, k, v: dilated_attention(q, k, v, pattern, implementation="mosaic", config=config)
else:
  from bench_attention import impl_fn
  f = lambda q, k, v: impl_fn(args.impl, pattern)(q, k, v, d ** -0.5)
fn = jax.jit(lambda q, k, v, do: jax.vjp(f, q, k, v)[1](do)) if args.backward else \
    jax.jit(lambda q, k, v, do: f(q, k, v))
jax.block_until_ready(fn(q, k, v, do))
cuda = ctypes.CDLL("libcuda.so.1")
cuda.cuProfilerStart()
jax.block_until_ready(fn(q, k, v, do))
cuda.cuProfilerStop()
print("profiled", args)
