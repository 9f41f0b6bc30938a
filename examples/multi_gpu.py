"""Ring dilated attention over every device of a job: one process, or one process per GPU.

One process over all local devices (CPU default: 8 virtual CPU devices):
  python examples/multi_gpu.py
  python examples/multi_gpu.py --data-parallel 2     # (data=2, seq=4): batch x sequence
  python examples/multi_gpu.py --causal --layout zigzag   # the sequence kept in zigzag order

One process per GPU under JAX's multi-controller runtime (the same fingerprint, see below):
  for i in 0 1 2 3; do
    CUDA_VISIBLE_DEVICES=$i python examples/multi_gpu.py --distributed \
        --coordinator localhost:12345 --num-processes 4 --process-id $i &
  done; wait

Two processes of 4 virtual CPU devices each, on one machine (add JAX_PLATFORMS=cpu on a GPU host):
  for i in 0 1; do
    python examples/multi_gpu.py --distributed --coordinator localhost:12345 \
        --num-processes 2 --process-id $i --cpu-devices 4 &
  done; wait

Every process builds the same global inputs from a seed, the sequence is sharded over a mesh of
all devices of all processes, and the forward output and gradients are reduced to a short
fingerprint (norms and a checksum) printed by process 0, next to the error against one device
computing the whole sequence alone. The two ways of launching agree to the printed digits except
the last digit of some checksums: `out` and `dq` are bitwise equal, `dk` and `dv` differ by a
few float32 roundings (up to 6e-7), summed in another order.

When a process dies, the others do not hang. A watchdog in each process (--step-timeout,
default 60 s with --distributed) exits with a message naming the step that made no progress
and the likely cause; without it (--step-timeout 0), JAX's coordination service (in process 0)
declares a process dead once its heartbeats stop for --heartbeat-timeout seconds (JAX's
default: 100) and every other process aborts with SIGABRT and no Python error ("Terminating
process because the JAX distributed service detected fatal errors"). The timings, measured on
CPU with two processes and process 1 SIGKILLed mid-run, are in docs/ring.md ("When a process
dies"). --steps N leaves time to try it.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time

import numpy as np


class Watchdog:
  """Exits the process with a message when what it waits for makes no progress for
  `timeout` seconds (0: never): a collective whose peer died blocks forever otherwise, until
  JAX's heartbeat check aborts the process without a Python error."""

  def __init__(self, process: int, timeout: float):
    self.process, self.timeout = process, timeout
    self.what, self.since = None, time.monotonic()
    if timeout:
      threading.Thread(target=self._watch, daemon=True).start()

  def expect(self, what: str | None) -> None:
    """Now waiting for `what` (None: nothing more)."""
    self.what, self.since = what, time.monotonic()

  def _watch(self) -> None:
    while True:
      time.sleep(min(1.0, self.timeout / 4))
      what, since = self.what, self.since
      if what is not None and time.monotonic() - since > self.timeout:
        print(f"process {self.process}: {what} made no progress for {self.timeout:g} s; another "
              f"process has most likely died or hung (a collective waits for every process). "
              f"Exiting (raise --step-timeout if steps are this slow).", file=sys.stderr,
              flush=True)
        os._exit(3)


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--distributed", action="store_true", help="call jax.distributed.initialize")
  ap.add_argument("--coordinator", default=None, help="host:port of process 0")
  ap.add_argument("--num-processes", type=int, default=None)
  ap.add_argument("--process-id", type=int, default=None)
  ap.add_argument("--cpu-devices", type=int, default=8, help="virtual devices when on CPU")
  ap.add_argument("--seq-len", type=int, default=4096)
  ap.add_argument("--heads", type=int, default=4)
  ap.add_argument("--kv-heads", type=int, default=2)
  ap.add_argument("--head-dim", type=int, default=32)
  ap.add_argument("--causal", action="store_true")
  ap.add_argument("--layout", default="natural", choices=("natural", "zigzag"),
                  help="the order of the sequence on the mesh: zigzag, as a data pipeline gives "
                       "it to a causal model (sharded_dilated_attention's layout); the results "
                       "are put back in natural order before they are compared")
  ap.add_argument("--data-parallel", type=int, default=1, metavar="D",
                  help="split the devices into a (data=D, seq=devices/D) mesh: the batch (of D "
                       "sequences) over 'data', each sequence over 'seq'")
  ap.add_argument("--impl", default=None)
  ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                  help="the inputs' dtype (the comparison with one device is made in it too)")
  ap.add_argument("--steps", type=int, default=1,
                  help="repeat the sharded forward and backward this many times, printing each "
                       "process's progress (a window to see what a dead process does)")
  ap.add_argument("--heartbeat-timeout", type=int, default=None, metavar="SECONDS",
                  help="with --distributed: a process that sends no heartbeat for this long is "
                       "declared dead and every other process aborts (JAX's default: 100). Lower "
                       "it to fail fast; it must exceed any pause of a healthy process")
  ap.add_argument("--init-timeout", type=int, default=None, metavar="SECONDS",
                  help="with --distributed: how long processes wait for each other to start "
                       "(JAX's default: 300)")
  ap.add_argument("--step-timeout", type=float, default=None, metavar="SECONDS",
                  help="with --distributed: exit with a message when a step (or the final "
                       "gather) makes no progress for this long, e.g. because a peer died "
                       "(default 60; 0: off, leaving it to JAX's heartbeat abort)")
  ap.add_argument("--shutdown-timeout", type=int, default=None, metavar="SECONDS",
                  help="with --distributed: how long a finished process waits at exit for the "
                       "others to finish too (JAX's default: 300)")
  args = ap.parse_args(argv)
  # Passed only when given, so JAX's own defaults apply otherwise (JAX 0.10 to 0.12 take all 3).
  timeouts = {name: value for name, value in (
      ("heartbeat_timeout_seconds", args.heartbeat_timeout),
      ("initialization_timeout", args.init_timeout),
      ("shutdown_timeout_seconds", args.shutdown_timeout)) if value is not None}
  if (timeouts or args.step_timeout is not None) and not args.distributed:
    ap.error("--heartbeat-timeout, --init-timeout, --shutdown-timeout and --step-timeout need "
             "--distributed")
  step_timeout = 60.0 if args.step_timeout is None else args.step_timeout
  if step_timeout < 0:
    ap.error(f"--step-timeout must be >= 0, got {args.step_timeout}")
  if args.steps < 1:
    ap.error(f"--steps must be at least 1, got {args.steps}")
  if args.data_parallel < 1:
    ap.error(f"--data-parallel must be at least 1, got {args.data_parallel}")
  if args.cpu_devices < 1:
    ap.error(f"--cpu-devices must be at least 1, got {args.cpu_devices}")

  import jax  # configured before first use: virtual CPU devices, CPU collectives
  jax.config.update("jax_num_cpu_devices", args.cpu_devices)
  if args.distributed:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(args.coordinator, args.num_processes, args.process_id,
                               **timeouts)
  import jax.numpy as jnp
  from jax.experimental import multihost_utils

  from hilbert_ring_jax import (DilatedPattern, dilated_attention, inverse_permutation,
                                zigzag_positions)
  from hilbert_ring_jax.ring import sharded_dilated_attention

  n = args.seq_len
  pattern = DilatedPattern((n // 8, n // 2, n), (1, 2, 4), causal=args.causal)
  data = args.data_parallel
  if jax.device_count() % data:
    raise SystemExit(f"--data-parallel {data} must divide the {jax.device_count()} devices")
  seq = jax.device_count() // data
  chunks = 2 * seq if args.layout == "zigzag" else seq  # zigzag: two chunks a device
  if n % chunks:
    raise SystemExit(f"--seq-len {n} must be divisible by {chunks}: the sequence is split "
                     f"over the {seq} devices of the 'seq' axis"
                     + (" in two chunks each (--layout zigzag)" if chunks > seq else ""))
  mesh = jax.make_mesh((data, seq), ("data", "seq"),
                       axis_types=(jax.sharding.AxisType.Explicit,) * 2)
  sharding = jax.NamedSharding(mesh, jax.P("data", "seq"))
  rng = np.random.default_rng(0)
  shapes = [(data, n, args.heads, args.head_dim)] + [(data, n, args.kv_heads, args.head_dim)] * 2
  host = [rng.standard_normal(s).astype(np.float32) for s in shapes + shapes[:1]]
  # Each process places the slices its devices hold of the same global arrays (in zigzag
  # order: as the data pipeline of a model that keeps its tokens so would give them).
  dtype = jnp.dtype(args.dtype)
  host = [x.astype(dtype) for x in host]
  order = (zigzag_positions(n, mesh.shape["seq"]) if args.layout == "zigzag" else
           np.arange(n))
  q, k, v, dout = (jax.make_array_from_callback(x.shape, sharding,
                                                lambda idx, x=x: x[:, order][idx])
                   for x in host)

  def loss(q, k, v, dout):
    out = sharded_dilated_attention(q, k, v, pattern, mesh=mesh, axis_name="seq",
                                    batch_axis="data", implementation=args.impl,
                                    layout=args.layout)
    return jnp.sum(out * dout), out

  grad_fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))
  watchdog = Watchdog(jax.process_index(), step_timeout if args.distributed else 0)
  start = time.monotonic()
  step_ms = []
  for step in range(args.steps):
    watchdog.expect(f"step {step + 1}/{args.steps}")
    began = time.perf_counter()
    (_, out), grads = grad_fn(q, k, v, dout)
    jax.block_until_ready(grads)
    step_ms.append((time.perf_counter() - began) * 1e3)
    if args.steps > 1:
      print(f"process {jax.process_index()}: step {step + 1}/{args.steps} done "
            f"({time.monotonic() - start:.1f} s)", flush=True)
  watchdog.expect("the final gather")
  results = [multihost_utils.process_allgather(x, tiled=True)[:, inverse_permutation(order)]
             for x in (out, *grads)]  # in natural order
  watchdog.expect(None)

  if jax.process_index() == 0:
    print(f"{jax.process_count()} process(es), {jax.device_count()} x "
          f"{jax.devices()[0].device_kind} as (data={data}, seq={jax.device_count() // data}), "
          f"N={n}, pattern {pattern.segment_lengths} x "
          f"{pattern.dilation_rates}{' causal' if args.causal else ''}, {args.dtype}, "
          f"{args.layout} order")
    if args.steps > 1:  # the first step compiles
      print(f"forward+backward: median {np.median(step_ms[1:]):.3f} ms a step over steps "
            f"2-{args.steps}")
    local = jax.local_devices()[0]
    qs, ks, vs = (jax.device_put(x, local) for x in host[:3])
    ref_out = dilated_attention(qs, ks, vs, pattern, implementation=args.impl)
    ref_grads = jax.grad(lambda q, k, v: jnp.sum(dilated_attention(
        q, k, v, pattern, implementation=args.impl) * host[3]), argnums=(0, 1, 2))(qs, ks, vs)
    print(f"{'':6}{'L2 norm':>14}{'checksum':>16}{'max |sharded - one device|':>30}")
    for name, x, ref in zip(("out", "dq", "dk", "dv"), results, (ref_out, *ref_grads)):
      x = np.asarray(x, np.float64)
      checksum = float(np.sum(x * np.cos(np.arange(x.size)).reshape(x.shape)))
      err = float(np.max(np.abs(x - np.asarray(ref, np.float64))))
      print(f"{name:6}{np.linalg.norm(x):14.6f}{checksum:16.6f}{err:30.2e}")


if __name__ == "__main__":
  main()
