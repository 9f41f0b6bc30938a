"""What the benchmark scripts share: timing with device synchronization, device traces."""

import statistics
import time

import jax


def median_ms(fn, args, runs=5, warmup=2, calls=1):
  """Median wall time in ms of `fn(*args)` over `runs` runs after `warmup` calls (the first
  compiles). A run is `calls` calls dispatched back to back and waited for once on the device,
  divided by `calls`: 1 times each call alone (dispatch and the wait included), more times
  them as a training loop issues them, the host running ahead of the devices."""
  return interleaved_ms({None: (fn, args)}, runs, warmup, calls)[None]


def interleaved_ms(calls_by_label, runs=5, warmup=2, calls=1):
  """`median_ms` of each `label: (fn, args)`, their runs interleaved (a round is one run of
  each, in order), so that what drifts during a measurement (the host, the clocks) weighs on
  all of them alike: for ratios of calls timed alone, whose host share moves from run to
  run."""
  for fn, args in calls_by_label.values():
    for _ in range(warmup):
      jax.block_until_ready(fn(*args))
  times = {label: [] for label in calls_by_label}
  for _ in range(runs):
    for label, (fn, args) in calls_by_label.items():
      t = time.perf_counter()
      for _ in range(calls):
        out = fn(*args)
      jax.block_until_ready(out)
      times[label].append(1e3 * (time.perf_counter() - t) / calls)
  return {label: statistics.median(ts) for label, ts in times.items()}


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
