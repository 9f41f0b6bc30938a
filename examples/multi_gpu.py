"""Ring dilated attention over every device of a job: one process, or one process per GPU.

One process over all local devices (CPU default: 8 virtual CPU devices):
  python examples/multi_gpu.py

One process per GPU under JAX's multi-controller runtime (same numbers):
  for i in 0 1 2 3; do
    CUDA_VISIBLE_DEVICES=$i python examples/multi_gpu.py --distributed \
        --coordinator localhost:12345 --num-processes 4 --process-id $i &
  done; wait

Every process builds the same global inputs from a seed, the sequence is sharded over a mesh of
all devices of all processes, and the forward output and gradients are reduced to a short
fingerprint (norms and a checksum) printed by process 0, next to the error against one device
computing the whole sequence alone. The fingerprint agrees between the two ways of launching.
"""

from __future__ import annotations

import argparse

import numpy as np


def main():
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
  ap.add_argument("--impl", default=None)
  args = ap.parse_args()

  import jax  # configured before first use: virtual CPU devices, CPU collectives
  jax.config.update("jax_num_cpu_devices", args.cpu_devices)
  if args.distributed:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(args.coordinator, args.num_processes, args.process_id)
  import jax.numpy as jnp
  from jax.experimental import multihost_utils

  from hilbert_ring_jax import DilatedPattern, dilated_attention
  from hilbert_ring_jax.ring import sharded_dilated_attention

  n = args.seq_len
  pattern = DilatedPattern((n // 8, n // 2, n), (1, 2, 4), causal=args.causal)
  mesh = jax.make_mesh((jax.device_count(),), ("seq",),
                       axis_types=(jax.sharding.AxisType.Explicit,))
  sharding = jax.NamedSharding(mesh, jax.P(None, "seq"))
  rng = np.random.default_rng(0)
  shapes = [(1, n, args.heads, args.head_dim)] + [(1, n, args.kv_heads, args.head_dim)] * 2
  host = [rng.standard_normal(s).astype(np.float32) for s in shapes + shapes[:1]]
  # Each process places the slices its devices hold of the same global arrays.
  q, k, v, dout = (jax.make_array_from_callback(x.shape, sharding, lambda idx, x=x: x[idx])
                   for x in host)

  def loss(q, k, v, dout):
    out = sharded_dilated_attention(q, k, v, pattern, mesh=mesh, axis_name="seq",
                                    implementation=args.impl)
    return jnp.sum(out * dout), out

  grad_fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))
  (_, out), grads = grad_fn(q, k, v, dout)
  results = [multihost_utils.process_allgather(x, tiled=True) for x in (out, *grads)]

  if jax.process_index() == 0:
    print(f"{jax.process_count()} process(es), {jax.device_count()} x "
          f"{jax.devices()[0].device_kind}, N={n}, pattern {pattern.segment_lengths} x "
          f"{pattern.dilation_rates}{' causal' if args.causal else ''}")
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
