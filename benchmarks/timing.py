"""What the benchmark scripts share: timing with device synchronization, device traces."""

import statistics
import time

import jax


def median_ms(fn, args, runs=5, warmup=2, calls=1):
  """Median wall time in ms of `fn(*args)` over `runs` runs after `warmup` calls (the first
  compiles). A run is `calls` calls dispatched back to back and waited for once on the device,
  divided by `calls`: 1 times each call alone (dispatch and the wait included), more times
  them as a training loop issues them, the host running ahead of the devices."""
  for _ in range(warmup):
    jax.block_until_ready(fn(*args))
  times = []
  for _ in range(runs):
    t = time.perf_counter()
    for _ in range(calls):
      out = fn(*args)
    jax.block_until_ready(out)
    times.append(1e3 * (time.perf_counter() - t) / calls)
  return statistics.median(times)


def device_events(path: str) -> list[dict]:
  """Kernel (GPU) or thunk (CPU) events of a `jax.profiler` trace (`*.xplane.pb`) with an
  `hlo_op` stat: name, op, device (plane), stream (line), start, duration."""
  from jax.profiler import ProfileData  # pylint: disable=import-outside-toplevel
  data = ProfileData.from_file(path)
  gpu = [p for p in data.planes if p.name.startswith("/device:GPU")]
  planes = gpu or [p for p in data.planes if p.name == "/host:CPU"]
  events = []
  for plane in planes:
    for line in plane.lines:
      if gpu and not line.name.startswith("Stream"):
        continue
      for ev in line.events:
        stats = dict(ev.stats)
        if "hlo_op" not in stats:
          continue
        events.append({"kernel": ev.name, "hlo_op": str(stats["hlo_op"]), "device": plane.name,
                       "stream": line.name, "start": ev.start_ns, "ns": ev.duration_ns})
  return events


def busy_ns(events) -> float:
  """The union of the events' intervals, in ns."""
  spans = sorted((e["start"], e["start"] + e["ns"]) for e in events)
  total, end = 0.0, -1.0
  for a, b in spans:
    if b > end:
      total += b - max(a, end)
      end = b
  return total
