"""Benchmark of the "pallas" backend against its peers (a GPU script; `--sizes tiny` runs on CPU).

1. Checks: "pallas" against "xla" (relative L2 error of out, lse and the three gradients,
   bf16 inputs), and the two cuDNN-based peers against "xla", on a few shapes.
2. Timings (device-synchronized medians after warm-up), bf16, B=1, H=16, D=128:
   - full attention (w = N, r = 1), N = 8K, 32K, 128K: pallas, cuDNN
     (`jax.nn.dot_product_attention(implementation="cudnn")`) and JAX's own Pallas-Triton
     `jax.experimental.pallas.ops.gpu.attention.mha`;
   - the LongNet pattern w=(2048, 4096, 8192), r=(1, 2, 4), N = 32K and 128K: pallas, xla,
     and "folded cuDNN": per branch and residue a strided slice, segments folded into the
     batch, cuDNN attention returning its log-sum-exp, merged by LSE (the same function,
     exact gradients; see `folded_cudnn`).
   Forward and forward+backward; TFLOP/s on visible FLOPs: forward 4*B*D*visible_pairs,
   forward+backward 3.5x that.

Usage:
  python benchmarks/bench_pallas.py                    # full sizes (H100: a few minutes)
  python benchmarks/bench_pallas.py --sizes small      # quick GPU run
  python benchmarks/bench_pallas.py --sizes tiny       # CPU smoke test (interpret mode)
  python benchmarks/bench_pallas.py --json out.json --causal both
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from timing import median_ms
from hilbert_ring_jax import DilatedPattern, dilated_attention, merge

LONGNET = ((2048, 4096, 8192), (1, 2, 4))
SIZES = {
    # name: (full-attention Ns, LongNet Ns, LongNet pattern, heads, head_dim)
    "full": ((8192, 32768, 131072), (32768, 131072), LONGNET, 16, 128),
    "small": ((4096, 16384), (16384,), LONGNET, 16, 128),
    "tiny": ((256,), (512,), ((64, 128, 256), (1, 2, 4)), 2, 32),
}
# What `--only` picks from: ours, then the peers (cudnn and jax_mha time full attention,
# folded_cudnn LongNet; the three on a GPU only).
TIMED = ("pallas", "xla", "cudnn", "jax_mha", "folded_cudnn")


# ---------------------------------------------------------------------------------------------
# Peers.


def _cudnn_internal():
  from jax._src.cudnn import fused_attention_stablehlo as fused  # pylint: disable=g-import-not-at-top
  return fused


def _cudnn_fwd(q, k, v, scale, causal):
  """cuDNN flash attention `(out, lse [B, T, H] float32)` on `[B, T, H, D]` folds."""
  fused = _cudnn_internal()
  out, lse = fused.dot_product_attention(
      q, k, v, scale=scale, return_residual=True,
      mask_type=fused.MaskType.CAUSAL if causal else fused.MaskType.NO_MASK)
  if lse.shape != q.shape[:3]:  # cuDNN keeps its statistics as [B, H, T]
    lse = jnp.swapaxes(lse, 1, 2)
  return out, lse.astype(jnp.float32)


def _cudnn_bwd(q, k, v, lse, out, dout, scale, causal):
  """cuDNN's attention backward with a given `out` in its `delta = rowsum(dout * out)`."""
  fused = _cudnn_internal()
  unused = jnp.zeros((0,), q.dtype)
  stats = jnp.swapaxes(lse, 1, 2)  # [B, H, T], cuDNN's layout of its statistics
  grads = fused._dot_product_attention_bwd_p_wrapper.bind(  # pylint: disable=protected-access
      q, k, v, unused, unused, unused, unused, unused, unused, unused, stats, out, dout,
      scale=scale, seed=42, dropout_rate=0.0, variadic_args=(False, False),
      mask_type=fused.MaskType.CAUSAL if causal else fused.MaskType.NO_MASK,
      layout=fused.AttentionLayout.BTNH.value, sliding_window_length=None)
  return grads[:3]


class _Folding:
  """Branch `(w, r)` of `[B, N, H, D]` as cuDNN batches, one per residue c (heads c::r)."""

  def __init__(self, n, w, r, per_head):
    if n % w or w % r:
      raise ValueError(f"folded cuDNN needs N % w == 0 and w % r == 0, got {n=} {w=} {r=}")
    self.n, self.w, self.r, self.per_head = n, w, r, per_head

  def fold(self, x, c):
    """`[B, N, H, D]` -> `[B * S, M, H', D]`: residue c's rows (and, per head, heads c::r)."""
    b, _, h, d = x.shape
    x = x.reshape(b, self.n // self.w, self.w // self.r, self.r, h, d)[:, :, :, c]
    if self.per_head:
      x = x[:, :, :, c::self.r]
    return x.reshape(-1, self.w // self.r, *x.shape[3:])

  def unfold(self, parts, fill):
    """Inverse of `fold` over all residues: `[B*S, M, H', ...]` per c -> `[B, N, H, ...]`."""
    b = parts[0].shape[0] // (self.n // self.w)
    rest = parts[0].shape[3:]
    y = jnp.stack([p.reshape(b, self.n // self.w, self.w // self.r, *p.shape[2:])
                   for p in parts], axis=3)  # [B, S, M, R, H', ...]
    if self.per_head:  # head h = t * r + c reads residue c: a diagonal over (row, head) residue
      eye = np.eye(self.r, dtype=bool).reshape(self.r, 1, self.r, *(1,) * len(rest))
      y = jnp.where(eye, y[:, :, :, :, :, None], fill)  # [B, S, M, R, T, R, ...]
    return y.reshape(b, self.n, -1, *rest)


def folded_cudnn(q, k, v, pattern: DilatedPattern, scale: float):
  """SPEC's function through cuDNN: segments folded into the batch, branches merged by LSE.

  Exact gradients without differentiating the statistics: each branch's backward is cuDNN's,
  fed `w_b * dout` and the *merged* output, so its `rowsum(dO * O)` is `w_b * delta` and its
  probabilities `exp(s - lse_b) * w_b = exp(s - lse)`, the kernel contract's global form.
  Needs MHA, no head groups, `N % w == 0`, `w % r == 0`; the cotangent of lse is taken as 0.
  """
  if q.shape[2] != k.shape[2] or pattern.head_groups:
    raise NotImplementedError("folded cuDNN peer: MHA without head groups only")
  n = q.shape[1]
  foldings = [_Folding(n, min(w, n), r, pattern.offsets == "head" and r > 1)
              for w, r in pattern.branches]

  def branches_forward(q, k, v):
    outs, lses = [], []
    for f in foldings:
      parts = [_cudnn_fwd(f.fold(q, c), f.fold(k, c), f.fold(v, c), scale, pattern.causal)
               for c in range(f.r)]
      outs.append(f.unfold([o.astype(jnp.float32) for o, _ in parts], 0.0))
      lses.append(f.unfold([l[..., None] for _, l in parts], -jnp.inf)[..., 0])
    return outs, lses

  @jax.custom_vjp
  def attention(q, k, v):
    out, _ = merge(*branches_forward(q, k, v))
    return out.astype(q.dtype)

  def fwd(q, k, v):
    outs, lses = branches_forward(q, k, v)
    out, lse = merge(outs, lses)
    out = out.astype(q.dtype)
    return out, (q, k, v, out, lses, lse)

  def bwd(res, dout):
    q, k, v, out, lses, lse = res
    grads = [jnp.zeros(x.shape, jnp.float32) for x in (q, k, v)]
    for f, lse_b in zip(foldings, lses):
      weight = jnp.exp(lse_b - jnp.where(jnp.isfinite(lse), lse, 0.0))  # 0 off the branch
      dout_b = (weight[..., None] * dout.astype(jnp.float32)).astype(q.dtype)
      parts = [_cudnn_bwd(f.fold(q, c), f.fold(k, c), f.fold(v, c), f.fold(lse_b[..., None], c)[..., 0],
                          f.fold(out, c), f.fold(dout_b, c), scale, pattern.causal)
               for c in range(f.r)]
      for i in range(3):
        grads[i] = grads[i] + f.unfold([p[i].astype(jnp.float32) for p in parts], 0.0)
    return tuple(g.astype(x.dtype) for g, x in zip(grads, (q, k, v)))

  attention.defvjp(fwd, bwd)
  return attention(q, k, v)


def cudnn_full(q, k, v, pattern, scale):
  del pattern
  return jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=False,
                                      implementation="cudnn")


def cudnn_full_causal(q, k, v, pattern, scale):
  del pattern
  return jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=True,
                                      implementation="cudnn")


def jax_mha(q, k, v, pattern, scale):
  from jax.experimental.pallas.ops.gpu import attention  # pylint: disable=g-import-not-at-top
  return attention.mha(q, k, v, None, sm_scale=scale, causal=pattern.causal)


def _tokamax():
  """tokamax (optional; Python >= 3.12, JAX >= 0.11.1). Its benchmarking module imports
  `xprof.cli.tools`, which its attention op does not use: a stub stands in when xprof is
  missing."""
  import importlib.machinery  # pylint: disable=g-import-not-at-top
  import importlib.util  # pylint: disable=g-import-not-at-top
  import types  # pylint: disable=g-import-not-at-top
  if "xprof" not in sys.modules and importlib.util.find_spec("xprof") is None:
    for name in ("xprof", "xprof.cli", "xprof.cli.tools"):
      module = types.ModuleType(name)
      module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
      module.__path__ = []
      sys.modules[name] = module
    sys.modules["xprof.cli.tools"].get_kernel_stats_tool = None
  import tokamax  # pylint: disable=g-import-not-at-top
  return tokamax


def tokamax_mosaic(q, k, v, pattern, scale):
  """tokamax's Pallas Mosaic GPU attention (full attention only)."""
  return _tokamax().dot_product_attention(q, k, v, scale=scale, is_causal=pattern.causal,
                                          implementation="mosaic")


def ours(name, config=None):
  def fn(q, k, v, pattern, scale):
    return dilated_attention(q, k, v, pattern, scale=scale, implementation=name, config=config)
  return fn


# ---------------------------------------------------------------------------------------------
# Measuring.


def inputs(n, heads, head_dim, dtype, seed=0):
  rng = np.random.default_rng(seed)
  shape = (1, n, heads, head_dim)
  return tuple(jnp.asarray(rng.standard_normal(shape), dtype) for _ in range(4))


def rel_l2(x, ref):
  x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
  finite = np.isfinite(ref)
  return float(np.linalg.norm(np.where(finite, x - ref, 0)) / np.linalg.norm(ref[finite]))


def outputs_and_grads(fn, q, k, v, dout, pattern, scale):
  f = lambda q, k, v: fn(q, k, v, pattern, scale)
  out, vjp = jax.vjp(jax.jit(f), q, k, v)
  return (out, *vjp(dout))


def time_case(fn, n, pattern, heads, head_dim, dtype, runs):
  q, k, v, dout = inputs(n, heads, head_dim, dtype)
  scale = head_dim ** -0.5
  f = jax.jit(lambda q, k, v: fn(q, k, v, pattern, scale))
  fb = jax.jit(lambda q, k, v, do: jax.vjp(lambda *a: fn(*a, pattern, scale), q, k, v)[1](do))
  flops = 4 * head_dim * pattern.visible_pairs(n, heads)  # B = 1
  fwd_ms = median_ms(f, (q, k, v), runs)
  fb_ms = median_ms(fb, (q, k, v, dout), runs)
  return {"fwd_ms": fwd_ms, "fwd_tflops": flops / fwd_ms / 1e9,
          "fwdbwd_ms": fb_ms, "fwdbwd_tflops": 3.5 * flops / fb_ms / 1e9}


def run_checks(sizes, on_gpu):
  """pallas (and, on a GPU, the cuDNN-based peers) against xla: relative L2 errors.

  The reference runs at float32 "highest" matmul precision (no tf32), from the same inputs.
  """
  bf16, f32, f16 = jnp.bfloat16, jnp.float32, jnp.float16
  if sizes == "tiny":
    shapes = [(512, 2, 32, ((64, 128, 256), (1, 2, 4)), 2, bf16, {}),
              (300, 4, 48, ((64, 100), (1, 4)), 2, bf16, {})]  # padded: N % w, w % r, D
  else:
    shapes = [(4096, 4, 128, ((512, 1024, 2048), (1, 2, 4)), 4, bf16, {}),
              (4096, 8, 64, ((1024, 4096), (1, 4)), 2, bf16, {}),   # GQA
              (3000, 4, 96, ((512, 1000), (1, 3)), 4, bf16, {}),    # padded, D not 2^k
              (8192, 4, 128, ((8192,), (1,)), 4, bf16, {}),         # full attention
              (2048, 6, 256, ((256, 2048), (2, 4)), 3, bf16, {"offsets": "all"}),
              (2048, 5, 32, ((128, 512, 2048), (1, 2, 4)), 5, f16, {"head_groups": True}),
              (1024, 4, 64, ((256, 1024), (1, 2)), 2, f32, {}),
              (1024, 2, 256, ((1024,), (4,)), 2, f32, {})]
  rows = []
  for n, heads, d, (segs, rates), kv, dtype, extra in shapes:
    for causal in (False, True):
      pattern = DilatedPattern(segs, rates, causal=causal, **extra)
      rng = np.random.default_rng(1)
      q = jnp.asarray(rng.standard_normal((1, n, heads, d)), dtype)
      k, v = (jnp.asarray(rng.standard_normal((1, n, kv, d)), dtype) for _ in range(2))
      dout = jnp.asarray(rng.standard_normal((1, n, heads, d)), dtype)
      scale = d ** -0.5
      with jax.default_matmul_precision("highest"):
        ref = outputs_and_grads(ours("xla"), q, k, v, dout, pattern, scale)
        lse_ref = dilated_attention(q, k, v, pattern, return_lse=True, implementation="xla")[1]
      peers = {"pallas": ours("pallas")}
      if (on_gpu and kv == heads and not extra and dtype == bf16
          and all(n % w == 0 and w % r == 0 for w, r in pattern.branches)):
        peers["folded_cudnn"] = folded_cudnn
        if pattern.num_branches == 1 and rates == (1,) and segs[0] == n:
          peers["cudnn"] = cudnn_full_causal if causal else cudnn_full
          peers["jax_mha"] = jax_mha
      for name, fn in peers.items():
        row = {"impl": name, "n": n, "heads": heads, "kv_heads": kv, "head_dim": d,
               "dtype": jnp.dtype(dtype).name, "segments": segs, "rates": rates,
               "causal": causal, **extra}
        try:
          got = outputs_and_grads(fn, q, k, v, dout, pattern, scale)
          row.update({f"err_{t}": rel_l2(g, r) for t, g, r in zip(("out", "dq", "dk", "dv"),
                                                                   got, ref)})
          if name == "pallas":
            lse = dilated_attention(q, k, v, pattern, return_lse=True, implementation="pallas")[1]
            row["err_lse"] = rel_l2(lse, lse_ref)
        except Exception as e:  # a peer that cannot run is reported, not fatal
          row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        rows.append(row)
        errs = " ".join(f"{key[4:]}={row[key]:.1e}" for key in row if key.startswith("err_"))
        print(f"check {name:13s} N={n:5d} H={heads}/{kv} D={d:3d} {row['dtype']:8s} w={segs} "
              f"r={rates} {extra or ''} causal={causal!s:5s} {errs or row.get('error')}",
              flush=True)
  return rows


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--sizes", choices=sorted(SIZES), default="full")
  parser.add_argument("--causal", choices=["no", "yes", "both"], default="no")
  parser.add_argument("--runs", type=int, default=5)
  parser.add_argument("--json", default=None, help="write all results here")
  parser.add_argument("--skip-checks", action="store_true")
  parser.add_argument("--only", default=None,
                      help=f"comma-separated implementations to time, of {', '.join(TIMED)} "
                      "(default: all that run here)")
  args = parser.parse_args()
  unknown = [name for name in args.only.split(",") if name not in TIMED] if args.only else []
  if unknown:
    parser.error(f"--only: unknown implementation(s) {', '.join(map(repr, unknown))}; valid: "
                 f"{', '.join(TIMED)}")
  on_gpu = jax.default_backend() == "gpu"
  dtype = jnp.bfloat16
  causals = {"no": [False], "yes": [True], "both": [False, True]}[args.causal]
  full_ns, longnet_ns, longnet, heads, head_dim = SIZES[args.sizes]
  device = jax.devices()[0]
  meta = {"device": getattr(device, "device_kind", str(device)), "backend": jax.default_backend(),
          "jax": jax.__version__, "python": platform.python_version(), "sizes": args.sizes,
          "date": time.strftime("%Y-%m-%d %H:%M:%S"), "dtype": "bfloat16", "batch": 1,
          "heads": heads, "head_dim": head_dim, "runs": args.runs, "argv": sys.argv[1:]}
  print(json.dumps(meta), flush=True)
  results = {"meta": meta, "checks": [], "timings": []}
  if not args.skip_checks:
    results["checks"] = run_checks(args.sizes, on_gpu)

  plan = []
  for causal in causals:
    for n in full_ns:
      pattern = DilatedPattern((n,), (1,), causal=causal)
      impls = {"pallas": ours("pallas")}
      if on_gpu:
        impls.update(cudnn=cudnn_full_causal if causal else cudnn_full, jax_mha=jax_mha)
      if not on_gpu or n <= 8192:
        impls["xla"] = ours("xla")
      plan.append(("full", n, pattern, impls))
    for n in longnet_ns:
      pattern = DilatedPattern(*longnet, causal=causal)
      impls = {"pallas": ours("pallas"), "xla": ours("xla")}
      if on_gpu:
        impls["folded_cudnn"] = folded_cudnn
      plan.append(("longnet", n, pattern, impls))
  only = set(args.only.split(",")) if args.only else None
  for kind, n, pattern, impls in plan:
    for name, fn in impls.items():
      if only and name not in only:
        continue
      row = {"pattern": kind, "impl": name, "n": n, "causal": pattern.causal,
             "segments": pattern.segment_lengths, "rates": pattern.dilation_rates}
      try:
        row.update(time_case(fn, n, pattern, heads, head_dim, dtype, args.runs))
      except Exception as e:  # report and go on: one peer failing must not end the run
        row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        traceback.print_exc(limit=2)
      results["timings"].append(row)
      print(json.dumps(row), flush=True)

  print(f"\n{'pattern':8s} {'causal':6s} {'N':>7s} {'impl':13s} {'fwd ms':>9s} {'TFLOP/s':>8s} "
        f"{'fwd+bwd ms':>11s} {'TFLOP/s':>8s}")
  for row in results["timings"]:
    if "error" in row:
      print(f"{row['pattern']:8s} {row['causal']!s:6s} {row['n']:7d} {row['impl']:13s} "
            f"error: {row['error'][:60]}")
      continue
    print(f"{row['pattern']:8s} {row['causal']!s:6s} {row['n']:7d} {row['impl']:13s} "
          f"{row['fwd_ms']:9.3f} {row['fwd_tflops']:8.1f} {row['fwdbwd_ms']:11.3f} "
          f"{row['fwdbwd_tflops']:8.1f}")
  if args.json:
    with open(args.json, "w") as fh:
      json.dump(results, fh, indent=1, default=str)
    print(f"wrote {args.json}")
  # bf16/f16 inputs: errors of a few 1e-3 against the float32 reference; float32: ~1e-6.
  limit = {"bfloat16": 3e-2, "float16": 1e-2, "float32": 1e-4}
  bad = [c for c in results["checks"] if c["impl"] == "pallas" and
         ("error" in c or max(v for key, v in c.items() if key.startswith("err_"))
          > limit[c["dtype"]])]
  if bad:
    print(f"FAILED checks: {bad}")
    sys.exit(1)


if __name__ == "__main__":
  main()
