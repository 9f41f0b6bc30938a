"""What the benchmark scripts share: timing with device synchronization."""

import statistics
import time

import jax


def median_ms(fn, args, runs=5, warmup=2):
  """Median wall time in ms of `fn(*args)` over `runs` calls, each waited for on the device,
  after `warmup` calls (the first compiles)."""
  for _ in range(warmup):
    jax.block_until_ready(fn(*args))
  times = []
  for _ in range(runs):
    t = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(1e3 * (time.perf_counter() - t))
  return statistics.median(times)
