"""GPU check of the attention shapes of examples/lm_real.py's GPU preset: `--hg` the
head-grouped patterns (the preset's (512, 2048, 8192) x (1, 1, 4) since 2026-11-26, and
(1, 2, 4)); otherwise the first preset's (1, 4, 16) (its own offsets="all" first, alone with
`--lm`; then with the default offsets="head"): each backend that runs them against "xla" at
float32 "highest" (outputs and gradients). Run from the repository root with PYTHONPATH=.
(and the wheels of run_gpu.sh for "triton")."""
import sys
sys.path.insert(0, "benchmarks")
import jax, jax.numpy as jnp, numpy as np
from bench_pallas import ours, outputs_and_grads, rel_l2
from hilbert_ring_jax import DilatedPattern, backends

def check(n, h, hkv, d, segs, rates, causal, dtype, impls, batch=1, offsets="head",
          head_groups=False):
  rng = np.random.default_rng(0)
  q, dout = (jnp.asarray(rng.standard_normal((batch, n, h, d)), dtype) for _ in range(2))
  k, v = (jnp.asarray(rng.standard_normal((batch, n, hkv, d)), dtype) for _ in range(2))
  pattern = DilatedPattern(segs, rates, causal=causal, offsets=offsets, head_groups=head_groups)
  with jax.default_matmul_precision("highest"):
    ref = outputs_and_grads(ours("xla"), q, k, v, dout, pattern, d ** -0.5)
  for impl in impls:
    prob = backends.Problem.of(q, k, pattern)
    try:
      name = backends.resolve(backends.candidates(impl), prob)
      got = outputs_and_grads(ours(impl), q, k, v, dout, pattern, d ** -0.5)
      errs = " ".join(f"{t}={rel_l2(g, r):.1e}" for t, g, r in zip(("out", "dq", "dk", "dv"), got, ref))
    except Exception as e:
      name, errs = "-", f"{type(e).__name__}: {str(e)[:200]}"
    print(f"N={n} B={batch} H={h}/{hkv} D={d} w={segs} r={rates} causal={causal} offsets={offsets} hg={head_groups} {jnp.dtype(dtype).name} {impl}->{name}: {errs}", flush=True)

if "--hg" in sys.argv:  # head-grouped candidates for the LM (one launch each)
  for segs, rates in (((512, 2048, 8192), (1, 1, 4)), ((512, 2048, 8192), (1, 2, 4)),
                      ((512, 8192), (1, 4))):
    check(8192, 6, 2, 128, segs, rates, True, jnp.bfloat16, [None], batch=2, offsets="all",
          head_groups=True)
  sys.exit()
check(8192, 6, 2, 128, (512, 2048, 8192), (1, 4, 16), True, jnp.bfloat16, [None], batch=2,
      offsets="all")  # the first LM preset's attention (two launches)
if "--lm" in sys.argv:
  sys.exit()
for causal in (True, False):
  check(8192, 6, 2, 128, (512, 2048, 8192), (1, 4, 16), causal, jnp.bfloat16, [None, "triton"], batch=2)
check(8192, 6, 6, 128, (512, 2048, 8192), (1, 4, 16), True, jnp.bfloat16, [None])
check(8192, 6, 2, 128, (512, 2048, 8192), (1, 4, 16), True, jnp.float32, ["triton"])
check(8192, 6, 2, 128, (512,), (1,), True, jnp.bfloat16, [None, "triton"], batch=2)
check(8192, 6, 2, 128, (512, 2048), (1, 4), True, jnp.bfloat16, [None])
check(8192, 6, 2, 128, (8192,), (16,), True, jnp.bfloat16, [None])
check(8192, 6, 2, 128, (2048,), (4,), True, jnp.bfloat16, [None])
