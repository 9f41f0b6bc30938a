"""The device timeline of `examples/lm_real.py`'s training step, op by op (jax.profiler).

For each model, the compiled training step (`examples/common.py`, the same function the example
times) runs a few warm-up steps on a text batch, then `--steps` steps under `jax.profiler`;
the trace's device events (GPU kernels; on a CPU, the XLA thunks) are summed per HLO
instruction, tied to the model part it belongs to (the named scopes of `examples/common.py`
in the optimized HLO's metadata: attention, mlp, embed, head, loss, each forward or backward,
and the optimizer), and grouped by kind: matmuls (cuBLAS / XLA gemm fusions), attention
(this library's kernels, cuDNN), everything else (fusions of elementwise ops and reductions,
copies). It also reports the busy
time (union of the kernels' intervals) and the span (first kernel's start to last kernel's end,
the profiled steps dispatched without a host sync between them, as the example's loop does)
against the host-timed step (synchronized each step), so the idle gaps show. XLA runs a
step's kernels as command buffers (CUDA graphs), whose kernels the trace attributes to the
buffer: `XLA_FLAGS=--xla_gpu_enable_command_buffer=` names each kernel's own op.

  python benchmarks/profile_step.py --preset gpu --models dilated,full --json out/step.json
  python benchmarks/profile_step.py --models dilated --steps 1        # CPU preset, quick

`--ab MODULE.NAME=EXPR` (repeatable) times instead the step as it is against the step traced
with those attributes set, in alternating chunks (both under the same clocks: the H100 is
power-capped in these steps), e.g. the GELU kept as before:
  python benchmarks/profile_step.py --preset gpu --models dilated,full \
      --ab 'common._bias_gelu=lambda y, b: nnx.gelu(y + b)'
"""

from __future__ import annotations

import argparse
import collections
import glob
import importlib
import json
import os
import re
import statistics
import sys
import tempfile
import time

import jax
from flax import nnx

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
import common  # noqa: E402  (examples/common.py)
import lm_real  # noqa: E402
from timing import busy_ns, device_events  # noqa: E402

_META = re.compile(r'^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=.*?metadata=\{op_name="([^"]*)"')
SCOPES = ("attention", "mlp", "embed", "head", "loss", "optimizer")  # examples/common.py's


def hlo_op_names(hlo_text: str) -> dict[str, str]:
  """`instruction name -> op_name` (JAX's name stack) from the optimized HLO's metadata."""
  return {m.group(1): m.group(2) for m in map(_META.match, hlo_text.splitlines()) if m}


def part_of(op_name: str) -> str:
  """The model part an op belongs to (`examples/common.py`'s named scopes), and the pass."""
  scope = next((s for s in SCOPES if f"/{s}/" in f"/{op_name}/".replace("(", "/")
                .replace(")", "/")), "other")
  if scope in ("optimizer", "other"):
    return scope
  return f"{scope} {'backward' if 'transpose(' in op_name else 'forward'}"


def kind_of(kernel: str, hlo_op: str, op_name: str) -> str:
  k, h, o = kernel.lower(), hlo_op.lower(), op_name.lower()
  if "dot_product_attention" in h or any(s in k for s in ("cudnn", "sdpa", "fmha", "flash")):
    return "attention (cuDNN)"
  if "mpmd_map" in h or any(s in k + o for s in ("pallas", "mosaic", "triton_call")):
    return "attention (ours)"
  if "dot_general" in o or "dot" in h or any(s in k for s in ("gemm", "nvjet", "xmma")):
    return "matmul"
  if "copy" in h or "transpose" in h:
    return "copy / transpose"
  if "reduce" in k or "reduce" in h:
    return "reduction fusion"
  return "elementwise fusion / other"


def _model_and_batches(name: str, cfg, full_impl: str):
  """Model `name` of seed 0 split into (graph, params, rest), and `step -> batch` of text."""
  cfg.impl = None
  model, _ = lm_real.build_model(name, cfg, full_impl, seed=0)
  graph, params, rest = nnx.split(model, nnx.Param, ...)
  corpus = lm_real.load_corpus(cfg.heldout_fraction, cfg.split_seed)
  batch = lambda i: lm_real.train_batch(corpus["train"], cfg.seq_len, cfg.batch, 0, i)
  return graph, params, rest, batch


def profile_model(name: str, cfg, full_impl: str, steps: int, top: int,
                  loop_steps: int, hlo_dir: str | None = None) -> dict:
  graph, params, rest, batch = _model_and_batches(name, cfg, full_impl)
  step_fn, _ = common._functions(graph, lm_real.loss_fn, cfg.lr, cfg.steps)  # pylint: disable=protected-access
  opt_state = common.adamw(cfg.lr, cfg.steps).init(params)
  compiled = step_fn.lower(params, rest, opt_state, batch(0)).compile()
  op_names = hlo_op_names(compiled.as_text())
  if hlo_dir:  # the optimized HLO, to read what each fusion holds
    os.makedirs(hlo_dir, exist_ok=True)
    with open(os.path.join(hlo_dir, f"step_{name}.hlo.txt"), "w") as fh:
      fh.write(compiled.as_text())
  state = [params, opt_state]

  def run(i):
    state[0], state[1], loss, _ = compiled(state[0], rest, state[1], batch(i))
    return loss

  for i in range(3):
    jax.block_until_ready(run(i))
  times = []
  for i in range(5):
    t = time.perf_counter()
    jax.block_until_ready(run(3 + i))
    times.append(1e3 * (time.perf_counter() - t))
  loop = []  # ms a step over chunks of 50 steps dispatched without a host sync
  for c in range(0, loop_steps, 50):
    t = time.perf_counter()
    for i in range(c, min(c + 50, loop_steps)):
      loss = run(8 + steps + i)
    jax.block_until_ready(loss)
    loop.append(1e3 * (time.perf_counter() - t) / (min(c + 50, loop_steps) - c))
  result = {"model": name, "step_ms_host_median": statistics.median(times),
            "loop_ms_per_step_by_chunk": loop}
  if not steps:
    return result
  with tempfile.TemporaryDirectory() as log_dir:
    with jax.profiler.trace(log_dir):
      for i in range(steps):  # as examples/common.train's loop: no host sync between steps
        loss = run(8 + i)
      jax.block_until_ready(loss)
    path = sorted(glob.glob(f"{log_dir}/**/*.xplane.pb", recursive=True))[-1]
    events = device_events(path)
  by_op = collections.defaultdict(lambda: {"ns": 0.0, "count": 0,
                                           "kernels": collections.Counter()})
  for e in events:
    row = by_op[e["hlo_op"]]
    row["ns"] += e["ns"]
    row["count"] += 1
    row["kernels"][e["kernel"][:80]] += e["ns"]
  ops = []
  for op, row in by_op.items():  # each op named by its longest-running kernel
    kernel, op_name = row["kernels"].most_common(1)[0][0], op_names.get(op, "")
    ops.append({"hlo_op": op, "us_per_step": row["ns"] / 1e3 / steps,
                "kernels_per_step": row["count"] / steps, "kernel": kernel,
                "kind": kind_of(kernel, op, op_name), "part": part_of(op_name),
                "op_name": op_name[-160:]})
  ops.sort(key=lambda r: -r["us_per_step"])
  kinds = collections.defaultdict(float)
  for r in ops:
    kinds[r["kind"]] += r["us_per_step"]
  parts = collections.defaultdict(float)
  for r in ops:
    parts[f'{r["part"]}: {r["kind"]}'] += r["us_per_step"]
  return {
      **result, "kernel_ms_per_step": sum(r["us_per_step"] for r in ops) / 1e3,
      "busy_ms_per_step": busy_ns(events) / 1e6 / steps,
      "span_ms_per_step": (max(e["start"] + e["ns"] for e in events)
                           - min(e["start"] for e in events)) / 1e6 / steps,
      "by_kind_ms": {k: v / 1e3 for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])},
      "by_part_ms": {k: v / 1e3 for k, v in sorted(parts.items(), key=lambda kv: -kv[1])},
      "top_ops": ops[:top], "ops": len(ops)}


def ab_loop(name: str, cfg, full_impl: str, variant: dict, rounds: int, chunk: int) -> dict:
  """The training step as it is (A) and with `variant`'s module attributes set while it is
  traced (B), timed in alternating chunks of `chunk` steps (no host sync within a chunk), so
  both see the same clocks (the H100 runs at its power cap here): ms a step by chunk."""
  graph, params, rest, batch = _model_and_batches(name, cfg, full_impl)
  runs = {}
  for label in ("A", "B"):
    saved = {}
    if label == "B":
      for (module, attr), value in variant.items():
        saved[module, attr] = getattr(module, attr)
        setattr(module, attr, value)
    try:  # a fresh jitted step (not _functions' cached one), traced with the attributes set
      step_fn, _ = common._functions.__wrapped__(graph, lm_real.loss_fn, cfg.lr, cfg.steps)  # pylint: disable=protected-access
      p = jax.tree.map(jax.numpy.copy, params)
      opt_state = common.adamw(cfg.lr, cfg.steps).init(p)
      compiled = step_fn.lower(p, rest, opt_state, batch(0)).compile()
    finally:
      for (module, attr), value in saved.items():
        setattr(module, attr, value)
    runs[label] = (compiled, [p, opt_state])
  times = {"A": [], "B": []}
  for r in range(rounds + 1):  # round 0 warms up
    for label, (compiled, state) in runs.items():
      t = time.perf_counter()
      for i in range(chunk):
        state[0], state[1], loss, _ = compiled(state[0], rest, state[1], batch(r * chunk + i))
      jax.block_until_ready(loss)
      if r:
        times[label].append(1e3 * (time.perf_counter() - t) / chunk)
  return {"model": name, "ms_by_chunk": times,
          "median_ms": {k: statistics.median(v) for k, v in times.items()}}


def parse_variant(specs: list[str]) -> dict:
  """`["MODULE.NAME=EXPR", ...]` -> `{(module, name): value}`: MODULE is `common`, `lm_real`
  (the examples') or an importable module (e.g. `hilbert_ring_jax.backends.mosaic`); EXPR is
  evaluated with jax, jnp, nnx and those two in scope."""
  scope = {"jax": jax, "jnp": jax.numpy, "nnx": nnx, "common": common, "lm_real": lm_real}
  variant = {}
  for spec in specs:
    target, _, expr = spec.partition("=")
    module, _, attr = target.strip().rpartition(".")
    if not module or not expr:
      raise ValueError(f"--ab takes MODULE.NAME=EXPR, got {spec!r}")
    module = scope[module] if module in scope else importlib.import_module(module)
    if not hasattr(module, attr):
      raise ValueError(f"--ab: {module.__name__} has no {attr!r}")
    variant[module, attr] = eval(expr, scope)  # pylint: disable=eval-used
  return variant


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--preset", default="cpu")
  ap.add_argument("--models", default="dilated,full")
  ap.add_argument("--steps", type=int, default=3, help="profiled steps (0: no trace)")
  ap.add_argument("--top", type=int, default=40)
  ap.add_argument("--loop", type=int, default=0, help="also time this many steps (chunks of 50, "
                  "no host sync within a chunk: the example's loop), before the trace")
  ap.add_argument("--set", default="", help="lm_real flags for every model, e.g. "
                  "'--remat' (one string)")
  ap.add_argument("--ab", action="append", default=[], metavar="MODULE.NAME=EXPR",
                  help="instead of profiling, time the step as it is against the step traced "
                  "with these attributes set (repeatable), in alternating chunks")
  ap.add_argument("--rounds", type=int, default=6, help="--ab: chunks each way")
  ap.add_argument("--chunk", type=int, default=40, help="--ab: steps a chunk")
  ap.add_argument("--hlo-dir", help="write each model's optimized HLO here")
  ap.add_argument("--json")
  args = ap.parse_args()
  cfg = lm_real.parse_args(["--preset", args.preset] + args.set.split())
  lm_real.check_args(cfg)
  full_impl, _ = lm_real.resolve_full_impl(cfg)
  results = []
  if args.ab:
    variant = parse_variant(args.ab)
    for name in args.models.split(","):
      r = {**ab_loop(name, cfg, full_impl, variant, args.rounds, args.chunk), "b": args.ab}
      results.append(r)
      print(f"== {name}: A {r['median_ms']['A']:.2f} ms, B {r['median_ms']['B']:.2f} ms a step "
            f"(medians of {args.rounds} chunks of {args.chunk}); A "
            + " ".join(f"{t:.2f}" for t in r["ms_by_chunk"]["A"]) + "; B "
            + " ".join(f"{t:.2f}" for t in r["ms_by_chunk"]["B"]), flush=True)
  for name in [] if args.ab else args.models.split(","):
    r = profile_model(name, cfg, full_impl, args.steps, args.top, args.loop, args.hlo_dir)
    results.append(r)
    print(f"== {name}: step {r['step_ms_host_median']:.2f} ms (host, synchronized); loop "
          + " ".join(f"{t:.2f}" for t in r["loop_ms_per_step_by_chunk"]) + " ms a step",
          flush=True)
    if not args.steps:
      continue
    print(f"   kernels "
          f"{r['kernel_ms_per_step']:.2f} ms, busy {r['busy_ms_per_step']:.2f} ms, span "
          f"{r['span_ms_per_step']:.2f} ms; "
          + ", ".join(f"{k} {v:.2f}" for k, v in r["by_kind_ms"].items()), flush=True)
    for k, v in r["by_part_ms"].items():
      print(f"   {v:8.3f} ms  {k}")
    for o in r["top_ops"][:25]:
      print(f"   {o['us_per_step']:9.1f} us x{o['kernels_per_step']:4.0f} {o['kind'][:18]:18s} "
            f"{o['part'][:18]:18s} {o['hlo_op'][:30]:30s} {o['kernel'][:40]}")
  if args.json:
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as fh:
      json.dump({"device": jax.devices()[0].device_kind, "jax": jax.__version__,
                 "date": time.strftime("%Y-%m-%d %H:%M:%S"), "full_impl": full_impl,
                 "results": results}, fh, indent=1)


if __name__ == "__main__":
  main()
