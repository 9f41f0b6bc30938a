"""Quickstart: Hilbert-serialized grid tokens through LongNet dilated attention.

Runs on CPU by default (`python examples/quickstart.py`), in well under a minute:
1. tokens of a 2-D grid are put in Hilbert order, so each attention segment is a compact
   patch of the image rather than a few thin rows;
2. dilated attention with a LongNet pattern is checked against the dense reference at a
   small size;
3. forward and forward+backward are timed at a larger size, next to the dense masked
   reference computing the same function; a short table is printed.
Flags make it bigger (`--large-grid 256 --heads 8`) or pick a backend (`--impl pallas`).
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from hilbert_ring_jax import (DilatedPattern, dilated_attention, dilated_attention_reference,
                              hilbert_permutation, serialize, unserialize)


def longnet_pattern(n: int, causal: bool = False) -> DilatedPattern:
  """Three branches: local segments of n/16 tokens, n/4 at rate 4, all n at rate 16.

  `offsets="all"`: every residue class of a dilated branch attends within itself, so every
  token takes part in every branch whatever the head count. LongNet's `offsets="head"` reads
  only residue `h % r` in head `h`, and would leave 75% of the tokens out of the rate-16 branch
  with the default 4 heads.
  """
  return DilatedPattern((n // 16, n // 4, n), (1, 4, 16), causal=causal, offsets="all")


def grid_locality(side: int, w: int) -> tuple[float, float]:
  """Share of grid-neighbour pairs that land in one segment of w tokens: raster vs Hilbert."""
  idx = np.arange(side * side).reshape(side, side)
  pairs = np.concatenate([np.stack([idx[:, :-1].ravel(), idx[:, 1:].ravel()], 1),
                          np.stack([idx[:-1].ravel(), idx[1:].ravel()], 1)])
  position = np.argsort(hilbert_permutation((side, side)))  # processing position of each cell
  raster = np.mean(pairs[:, 0] // w == pairs[:, 1] // w)
  hilbert = np.mean(position[pairs[:, 0]] // w == position[pairs[:, 1]] // w)
  return float(raster), float(hilbert)


def make_inputs(side, heads, head_dim, dtype, seed=0):
  """q, k, v `[1, side*side, heads, head_dim]` of a grid, in the grid's row-major order."""
  rng = np.random.default_rng(seed)
  shape = (1, side * side, heads, head_dim)
  return tuple(jnp.asarray(rng.standard_normal(shape), dtype) for _ in range(3))


def median_ms(fn, *args, runs):
  jax.block_until_ready(fn(*args))  # compile and warm up
  times = []
  for _ in range(runs):
    t = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(1e3 * (time.perf_counter() - t))
  return float(np.median(times))


def main(argv=None):
  """Runs the three steps (flags: `argv`, default the command line's); returns the check's
  `max |out - reference|` and the timed rows `(pass, ms, tokens/s, GFLOP/s)`."""
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--grid", type=int, default=16, help="side of the grid checked exactly")
  parser.add_argument("--large-grid", type=int, default=64, help="side of the timed grid")
  parser.add_argument("--heads", type=int, default=4)
  parser.add_argument("--head-dim", type=int, default=32)
  parser.add_argument("--causal", action="store_true")
  parser.add_argument("--impl", default=None,
                      help="xla | pallas | triton | mosaic (default: fastest; mosaic on Hopper)")
  parser.add_argument("--runs", type=int, default=5)
  args = parser.parse_args(argv)
  for name, least in (("grid", 4), ("large_grid", 4), ("heads", 1), ("head_dim", 1), ("runs", 1)):
    if getattr(args, name) < least:  # grids of 4 x 4 and up: local segments of N/16 >= 1
      raise ValueError(f"--{name.replace('_', '-')} must be at least {least}, got "
                       f"{getattr(args, name)}")
  print(f"JAX {jax.__version__} on {jax.devices()[0].platform}")

  def attend(pattern):
    # Serialize into Hilbert order, attend, and bring outputs back to row-major order.
    perm = hilbert_permutation((int(np.sqrt(pattern.segment_lengths[-1])),) * 2)
    def fn(q, k, v):
      q, k, v = (serialize(x, perm) for x in (q, k, v))
      return unserialize(dilated_attention(q, k, v, pattern, implementation=args.impl), perm)
    return jax.jit(fn)

  # 1. Exactness at a small size, against the dense reference in float32.
  n = args.grid ** 2
  pattern = longnet_pattern(n, args.causal)
  q, k, v = make_inputs(args.grid, args.heads, args.head_dim, jnp.float32)
  perm = hilbert_permutation((args.grid, args.grid))
  ref = unserialize(dilated_attention_reference(*(serialize(x, perm) for x in (q, k, v)),
                                                pattern), perm)
  err = float(jnp.max(jnp.abs(attend(pattern)(q, k, v) - ref)))
  print(f"check  N={n:>6}  {pattern.segment_lengths} x {pattern.dilation_rates}, "
        f"offsets={pattern.offsets!r}: "
        f"max |out - reference| = {err:.2e}")
  if not err < 1e-4:
    raise SystemExit("mismatch against the reference")

  # 2. Timing at a larger size.
  side = args.large_grid
  n = side * side
  pattern = longnet_pattern(n, args.causal)
  q, k, v = make_inputs(side, args.heads, args.head_dim, jnp.float32, seed=1)
  fwd = attend(pattern)
  loss = jax.jit(jax.grad(lambda q, k, v: jnp.sum(fwd(q, k, v) ** 2), argnums=(0, 1, 2)))
  flops = 4 * args.head_dim * pattern.visible_pairs(n, args.heads)
  dense = jax.jit(lambda q, k, v: dilated_attention_reference(q, k, v, pattern))
  rows = []
  for name, fn, mult in (("forward", fwd, 1.0), ("forward+backward", loss, 3.5),
                         ("dense reference", dense, 1.0)):
    ms = median_ms(fn, q, k, v, runs=args.runs)
    rows.append((name, ms, n / ms * 1e3, mult * flops / ms / 1e6))
  raster, hilbert = grid_locality(side, pattern.segment_lengths[0])

  print(f"\nN = {side}x{side} = {n} tokens, H={args.heads}, D={args.head_dim}, "
        f"pattern {pattern.segment_lengths} x {pattern.dilation_rates}, "
        f"offsets={pattern.offsets!r}{', causal' if args.causal else ''}")
  print(f"{'pass':<18}{'ms (median)':>12}{'tokens/s':>12}{'GFLOP/s':>10}")
  for name, ms, tps, gflops in rows:
    print(f"{name:<18}{ms:>12.1f}{tps:>12.0f}{gflops:>10.1f}")
  print(f"\ngrid neighbours sharing a {pattern.segment_lengths[0]}-token segment: "
        f"raster {raster:.1%}, Hilbert {hilbert:.1%}")
  return {"max_abs_error": err, "rows": rows}


if __name__ == "__main__":
  main()
