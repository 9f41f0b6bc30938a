"""A/B of the ring's step configuration in one process, in interleaved rounds.

For each pattern, pass and tokens per GPU: one GPU doing the whole problem alone, the ring
over all GPUs as the defaults run it ("default"), and the ring with the mosaic `Config`
given by `--config` (e.g. `persistent=True`, the persistent programs ring steps ran before
2026-11-27) or, with `--set NAME=VALUE`, the defaults with the ring module's setting NAME
(`GATHER_LIMIT_BYTES`: 0, whole rings rotate their keys instead of gathering them;
`SMALL_STEP_ROWS`: 0, no ring is small; `KERNEL_GATHER`: True, whole rings of full
attention gather their keys inside the kernel instead of an all-gather before one call, with
custom calls out of XLA's command buffers) set to VALUE.
Each round times every variant once (10 calls back to back, 3 where one GPU takes over 50 ms
a call), so that drifts between processes and over time hit them alike; medians over
`--rounds`. Efficiency as in `ring_scaling.py`: `T_1 / (P T_P)`. "dispatch" is the host's
time to issue a call (the loop of calls until it returns, before the wait): near the call's
time, the host sets the pace.

  python benchmarks/ring_ab.py --per-gpu 8192,32768 --config persistent=True --json ab.json
  python benchmarks/ring_ab.py --per-gpu 8192,32768 --set GATHER_LIMIT_BYTES=0 --json ab.json

`--layout zigzag` adds both ring variants on shards in zigzag order (`layout="zigzag"`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp

from ring_scaling import attention_fn, inputs, pattern_for
from hilbert_ring_jax import ring
from hilbert_ring_jax.backends import mosaic


def parse_config(text):
  """`key=value,...` (values: True, False, None or ints) -> mosaic.Config."""
  words = {"True": True, "False": False, "None": None}
  fields = dict(item.split("=") for item in text.split(",") if item)
  return mosaic.Config(**{k: words[v] if v in words else int(v) for k, v in fields.items()})


# The ring's settings, read when a call is traced and part of the key its compiled programs are
# cached under (a setting outside that key would leave both variants one program).
SETTINGS = ("GATHER_LIMIT_BYTES", "SMALL_STEP_ROWS", "KERNEL_GATHER")


def setting_value(text):
  """A setting's value as `--set` gives it: True, False or an int."""
  return {"True": True, "False": False}[text] if text in ("True", "False") else int(text)


def with_setting(fn, name, value):
  """`fn` run (so traced, on its first call) with the ring module's `name` set to `value`."""
  def call(*args):
    saved = getattr(ring, name)
    setattr(ring, name, value)
    try:
      return fn(*args)
    finally:
      setattr(ring, name, saved)
  return call


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--per-gpu", default="8192,32768")
  ap.add_argument("--patterns", default="full,longnet")
  ap.add_argument("--passes", default="fwd,fwdbwd")
  ap.add_argument("--causal", action="store_true")
  ap.add_argument("--heads", type=int, default=16)
  ap.add_argument("--head-dim", type=int, default=128)
  ap.add_argument("--config", default="persistent=True", help="the other variant's Config")
  ap.add_argument("--set", default=None, metavar="NAME=VALUE",
                  help="the other variant: the defaults with the ring module's setting NAME "
                       f"({', '.join(SETTINGS)}) = VALUE (an int, True or False)")
  ap.add_argument("--layout", default=None, choices=["zigzag"],
                  help="also time both ring variants on shards in this order (layout=)")
  ap.add_argument("--rounds", type=int, default=5)
  ap.add_argument("--json", default=None)
  args = ap.parse_args()
  setting = None if args.set is None else args.set.split("=", 1)
  if setting and (len(setting) != 2 or setting[0] not in SETTINGS):
    ap.error(f"--set takes NAME=VALUE with NAME one of {SETTINGS}, got {args.set!r}")
  other = None if setting else parse_config(args.config)
  label = args.config if other else args.set
  p = jax.device_count()
  mesh = jax.make_mesh((p,), ("seq",), axis_types=(jax.sharding.AxisType.Auto,))
  result = dict(jax=jax.__version__, device=jax.devices()[0].device_kind, devices=p,
                args=vars(args), rows=[])
  print(f"JAX {jax.__version__}, {p} x {jax.devices()[0].device_kind}", flush=True)
  for name in args.patterns.split(","):
    for pass_ in args.passes.split(","):
      backward = pass_ == "fwdbwd"
      for t in [int(x) for x in args.per_gpu.split(",")]:
        n = p * t
        pattern = pattern_for(name, n, args.causal)
        sharded = inputs(n, args.heads, args.head_dim, jnp.bfloat16, mesh)[:4 if backward else 3]
        alone = tuple(jax.device_put(x, jax.devices()[0]) for x in sharded)
        variants = {"one GPU": (attention_fn(pattern, None, None, backward), alone),
                    "default": (attention_fn(pattern, mesh, None, backward), sharded),
                    label: (attention_fn(pattern, mesh, None, backward, other), sharded)}
        if args.layout:
          variants[f"default, {args.layout}"] = (
              attention_fn(pattern, mesh, None, backward, layout=args.layout), sharded)
          variants[f"{label}, {args.layout}"] = (
              attention_fn(pattern, mesh, None, backward, other, layout=args.layout), sharded)
        if other is None:
          value = setting_value(setting[1])
          for v in [label] + ([f"{label}, {args.layout}"] if args.layout else []):
            variants[v] = (with_setting(variants[v][0], setting[0], value), sharded)
        for fn, x in variants.values():  # compile, warm up
          for _ in range(2):
            jax.block_until_ready(fn(*x))
        start = time.perf_counter()
        jax.block_until_ready(variants["one GPU"][0](*alone))
        calls = 10 if time.perf_counter() - start < 0.05 else 3
        times, issued = {v: [] for v in variants}, {v: [] for v in variants}
        for _ in range(args.rounds):
          for v, (fn, x) in variants.items():
            start = time.perf_counter()
            for _ in range(calls):
              out = fn(*x)
            issued[v].append(1e3 * (time.perf_counter() - start) / calls)
            jax.block_until_ready(out)
            times[v].append(1e3 * (time.perf_counter() - start) / calls)
        one = statistics.median(times["one GPU"])
        for v in list(variants)[1:]:
          ms, dispatch = statistics.median(times[v]), statistics.median(issued[v])
          result["rows"].append(dict(pattern=name, causal=args.causal, pass_=pass_, n=n, p=p,
                                     variant=v, ms=ms, one_gpu_ms=one, eff_whole=one / (p * ms),
                                     runs=times[v], one_gpu_runs=times["one GPU"],
                                     dispatch_ms=dispatch))
          print(f"{name:8} {pass_:7} {t:>7} per GPU  {v:18} {ms:9.3f} ms  one GPU {one:9.3f} "
                f"ms  efficiency {one / (p * ms):.1%}  dispatch {dispatch:.3f} ms", flush=True)
        if args.json:
          with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
  main()
