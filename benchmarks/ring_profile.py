"""Where a ring call's time goes on the GPUs: a device trace of `sharded_dilated_attention`.

For each configuration (pattern, tokens per GPU, pass) it times the ring over every GPU and
one GPU doing the whole problem alone, then traces `--calls` ring calls under
`jax.profiler` and reports, per device and per call:
- span (first kernel's start to last kernel's end) and busy time (union of the kernels);
- kernel time by kind: attention (our kernels: custom calls), collectives (collective-permute,
  all-gather; NCCL kernels), fusions (merges, masks, layout), copies;
- overlap: the share of the collectives' time during which an attention kernel runs on the
  same device (what the ring hides behind compute);
- idle: span minus busy (launch gaps, waits on peers);
- in the JSON, each HLO op's kernel time (what a fusion or a kernel call costs);
and with `--timeline` every kernel of the first device, in order, with its stream.
XLA's command buffers (CUDA graphs) attribute their kernels to the buffer: run with
`XLA_FLAGS=--xla_gpu_enable_command_buffer=` so that each kernel keeps its own op.

  XLA_FLAGS=--xla_gpu_enable_command_buffer= python benchmarks/ring_profile.py \
      --per-gpu 8192 --patterns full,longnet --json out/ring_profile.json
  XLA_FLAGS=--xla_force_host_platform_device_count=4 python benchmarks/ring_profile.py \
      --per-gpu 1024 --heads 2 --head-dim 32 --dtype float32 --runs 2   # CPU smoke test
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import tempfile

import jax
import jax.numpy as jnp

from ring_scaling import add_problem_arguments, attention_fn, inputs, pattern_for
from timing import busy_ns, device_events, median_ms


def kind_of(event) -> str:
  op, kernel = event["hlo_op"].lower(), event["kernel"].lower()
  if "nccl" in kernel or any(s in op for s in ("collective-permute", "all-gather", "all-reduce",
                                               "all-to-all", "send", "recv")):
    return "collective"
  if "custom-call" in op or "mosaic" in kernel:
    return "attention"
  if "copy" in op or "transpose" in op:
    return "copy"
  return "fusion / other"


def overlap_ns(a, b) -> float:
  """Time during which some interval of `a` and some interval of `b` both run."""
  return busy_ns(a) + busy_ns(b) - busy_ns(a + b)


def breakdown(events, calls: int) -> dict:
  per_device = {}
  for device in sorted({e["device"] for e in events}):
    evs = [e for e in events if e["device"] == device]
    kinds, ops = collections.defaultdict(float), collections.Counter()
    for e in evs:
      kinds[kind_of(e)] += e["ns"]
      ops[e["hlo_op"]] += e["ns"]
    span = max(e["start"] + e["ns"] for e in evs) - min(e["start"] for e in evs)
    coll = [e for e in evs if kind_of(e) == "collective"]
    attn = [e for e in evs if kind_of(e) == "attention"]
    ms = lambda ns: ns / 1e6 / calls
    per_device[device] = {
        "span_ms": ms(span), "busy_ms": ms(busy_ns(evs)), "idle_ms": ms(span - busy_ns(evs)),
        "by_kind_ms": {k: ms(v) for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])},
        "collective_busy_ms": ms(busy_ns(coll)),
        "collective_hidden": overlap_ns(coll, attn) / busy_ns(coll) if coll else None,
        "kernels_per_call": len(evs) / calls,
        "by_op_us": {op: ns / 1e3 / calls for op, ns in ops.most_common()}}
  return per_device


def print_timeline(events, device: str):
  """Every kernel of `device` in the traced calls: start (us from the first), duration (us),
  stream and HLO op: what runs beside what, and the gaps."""
  evs = sorted((e for e in events if e["device"] == device), key=lambda e: e["start"])
  for e in evs:
    print(f"    {(e['start'] - evs[0]['start']) / 1e3:9.1f} {e['ns'] / 1e3:8.1f} us  "
          f"{e['stream'][:22]:22} {e['hlo_op'][:40]}", flush=True)


def trace(fn, args, calls: int) -> list[dict]:
  jax.block_until_ready(fn(*args))
  with tempfile.TemporaryDirectory() as log_dir:
    with jax.profiler.trace(log_dir):
      for _ in range(calls):
        out = fn(*args)
      jax.block_until_ready(out)
    return device_events(sorted(glob.glob(f"{log_dir}/**/*.xplane.pb", recursive=True))[-1])


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--per-gpu", default="8192")
  add_problem_arguments(ap, passes="fwd")
  ap.add_argument("--calls", type=int, default=3, help="ring calls traced")
  ap.add_argument("--timeline", action="store_true",
                  help="print every kernel of the first device in the traced calls")
  ap.add_argument("--json", default=None)
  args = ap.parse_args()
  p = len(jax.devices())
  mesh = jax.make_mesh((p,), ("seq",), axis_types=(jax.sharding.AxisType.Auto,))
  print(f"JAX {jax.__version__}, {p} x {jax.devices()[0].device_kind}", flush=True)
  rows = []
  for name in args.patterns.split(","):
    for backward in [x == "fwdbwd" for x in args.passes.split(",")]:
      for t in [int(x) for x in args.per_gpu.split(",")]:
        n = p * t
        pattern = pattern_for(name, n, args.causal)
        dtype = jnp.dtype(args.dtype)
        ring_args = inputs(n, args.heads, args.head_dim, dtype, mesh)
        one_args = inputs(n, args.heads, args.head_dim, dtype)
        ring = attention_fn(pattern, mesh, args.impl, backward, layers=args.layers,
                            layout=args.layout)
        call = (lambda f: f) if backward else (lambda f: lambda q, k, v, do: f(q, k, v))
        # ms per layer, as ring_scaling.py reports them; the trace's breakdown is per program
        # (all `--layers` calls).
        ring_ms = median_ms(call(ring), ring_args, args.runs) / args.layers
        one_ms = median_ms(call(attention_fn(pattern, None, args.impl, backward,
                                             layers=args.layers)), one_args,
                           args.runs) / args.layers
        events = trace(call(ring), ring_args, args.calls)
        if args.timeline:
          print_timeline(events, min(e["device"] for e in events))
        row = dict(pattern=name, causal=args.causal, pass_="fwdbwd" if backward else "fwd",
                   n=n, p=p, ring_ms=ring_ms, one_gpu_ms=one_ms,
                   efficiency=one_ms / (p * ring_ms), devices=breakdown(events, args.calls))
        rows.append(row)
        print(f"{name:8} {row['pass_']:7} N={n:>8} P={p}: ring {ring_ms:.3f} ms, one GPU "
              f"{one_ms:.3f} ms, efficiency {row['efficiency']:.0%}", flush=True)
        for device, d in row["devices"].items():
          kinds = ", ".join(f"{k} {v:.3f}" for k, v in d["by_kind_ms"].items())
          hidden = d["collective_hidden"]
          print(f"  {device}: span {d['span_ms']:.3f} busy {d['busy_ms']:.3f} idle "
                f"{d['idle_ms']:.3f} ms | {kinds} | collectives busy "
                f"{d['collective_busy_ms']:.3f} ms, hidden "
                f"{'-' if hidden is None else f'{hidden:.0%}'} | "
                f"{d['kernels_per_call']:.0f} kernels", flush=True)
  if args.json:
    with open(args.json, "w") as f:
      json.dump(dict(jax=jax.__version__, device=jax.devices()[0].device_kind, devices=p,
                     args=vars(args), rows=rows), f, indent=1)


if __name__ == "__main__":
  main()
