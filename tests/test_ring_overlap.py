"""The ring's transfers overlap its kernels in XLA's schedule (GPUs only: on CPU a
collective-permute is one synchronous op, with no start and done to schedule around)."""

import re

import jax
import jax.numpy as jnp
import pytest

from hilbert_ring_jax import DilatedPattern
from hilbert_ring_jax import ring
from hilbert_ring_jax.ring import sharded_dilated_attention


def kernels_between_permutes(hlo: str) -> list[int]:
  """For each asynchronous collective-permute of the entry computation of a scheduled HLO
  module (instructions in execution order), how many custom calls (kernels) XLA placed
  between its start and its done."""
  entry = hlo[hlo.index("\nENTRY"):].splitlines()
  starts, counts = {}, []
  for i, line in enumerate(entry):
    name = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = ", line)
    if name and " collective-permute-start(" in line:
      starts[name.group(1)] = i
    done = re.search(r" collective-permute-done\(%?([\w.\-]+)\)", line)
    if done and done.group(1) in starts:
      between = entry[starts[done.group(1)] + 1:i]
      counts.append(sum(" custom-call(" in x for x in between))
  return counts


@pytest.mark.gpu
def test_a_step_kernel_runs_while_keys_travel(monkeypatch):
  """Full attention over 2 GPUs, keys rotating (not gathered at once): some step's kernel
  sits between the start and the done of a collective-permute, so the transfer can run
  beside it (docs/ring.md, "Where a ring call's time goes": XLA runs one of a step's
  permutes asynchronously, the other synchronously)."""
  if len(jax.devices("gpu")) < 2:
    pytest.skip("needs two GPUs")
  monkeypatch.setattr(ring, "GATHER_LIMIT_BYTES", 0)
  mesh = jax.make_mesh((2,), ("seq",), axis_types=(jax.sharding.AxisType.Auto,),
                       devices=jax.devices("gpu")[:2])
  n, shape = 2 * 2048, (1, 2 * 2048, 4, 64)
  sharding = jax.NamedSharding(mesh, jax.P(None, "seq"))
  q, k, v = (jax.device_put(jnp.ones(shape, jnp.bfloat16), sharding) for _ in range(3))
  pattern = DilatedPattern((n,), (1,))
  fn = jax.jit(lambda q, k, v: sharded_dilated_attention(q, k, v, pattern, mesh=mesh,
                                                         axis_name="seq"))
  counts = kernels_between_permutes(fn.lower(q, k, v).compile().as_text())
  assert counts and max(counts) >= 1, counts
