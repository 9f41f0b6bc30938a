"""Packed sequences in the kernels: each backend that takes `segment_ids` against the float64
reference (in interpret mode on CPU), the per-head ids of the backend contract, and the key
blocks that packing lets a kernel skip."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import helpers
from hilbert_ring_jax import backends
from hilbert_ring_jax.pattern import DilatedPattern
from test_packed import CASES, check_packed, packed_ids

pytestmark = pytest.mark.pallas


@pytest.mark.parametrize("name", ["longnet_causal_gqa", "longnet_all_offsets"])
def test_pallas_packed_matches_the_reference(name):
  """Forward, lse and gradients: documents cut by the 16-row interpret blocks, so blocks are
  skipped (no shared document), run without the id comparison (one document) and masked."""
  case, causal, median = CASES[name]
  check_packed(case, causal, jnp.float32, packed_ids(case.batch, case.n, median, len(name)),
               implementation="pallas")


def test_pallas_ids_are_compared_not_ordered():
  """Ids that come back later in the row, negative ones, and a padded view (a segment that
  is not a whole number of blocks): a block's id range only decides what is skipped."""
  case = helpers.Case(96, 2, 1, (48, 96), (1, 2))
  ids = jnp.asarray(np.tile(np.repeat([7, -3, 7], 8), 4)[None], jnp.int32)
  check_packed(case, True, jnp.float32, ids, implementation="pallas")


def test_pallas_per_head_ids_match_xla():
  """The contract's per-head ids (`[B, N, H]` for queries, `[B, N, Hkv]` for keys, as ring
  steps pass them): the pallas kernels agree with the xla backend, forward and backward."""
  b, n, h, hkv, d = 1, 64, 4, 2, 16
  rng = np.random.default_rng(5)
  q, dout = (jnp.asarray(rng.standard_normal((b, n, h, d)), jnp.float32) for _ in range(2))
  k, v = (jnp.asarray(rng.standard_normal((b, n, hkv, d)), jnp.float32) for _ in range(2))
  kv_ids = jnp.asarray(np.sort(rng.integers(0, 4, (b, n, hkv)), axis=1), jnp.int32)
  q_ids = jnp.repeat(kv_ids, h // hkv, axis=2)
  pattern = DilatedPattern((32, 64), (1, 2), causal=True)

  def passes(backend, q, k, v, dout, ids):
    out, lse = backend.forward(q, k, v, pattern, d ** -0.5, segment_ids=ids)
    delta = jnp.sum(dout * out, axis=-1)
    grads = backend.backward(q, k, v, dout, lse, delta, pattern, d ** -0.5, segment_ids=ids)
    return (out, jnp.where(jnp.isfinite(lse), lse, 0.0), *grads)

  # Each backend's passes as one program (op by op they compiled ~370 small ones: 25 s).
  outs = {name: jax.jit(functools.partial(passes, backends.load(name)))(
      q, k, v, dout, (q_ids, kv_ids)) for name in ("pallas", "xla")}
  for a, ref in zip(outs["pallas"], outs["xla"]):
    np.testing.assert_allclose(a, ref, rtol=2e-5, atol=2e-5)


def test_pallas_takes_packed_problems():
  """pallas's `supports` takes packed problems; dispatch picks it where it comes first."""
  problem = backends.Problem((1, 256, 4, 64), (1, 256, 4, 64), jnp.dtype(jnp.bfloat16),
                             DilatedPattern((256,), (1,)), platform="gpu", segment_ids=True)
  assert backends.load("pallas").supports(problem)
  assert backends.resolve(("pallas", "xla"), problem) == "pallas"


@pytest.mark.parametrize("per_head", [False, True])
def test_pallas_packed_lowers_to_triton(per_head):
  """The GPU path (interpret=False) of the packed kernels lowers to Triton, forward and
  backward: the per-block id ranges and the skip are Triton code, not only interpreted."""
  from test_pallas import _triton_kernels  # pylint: disable=import-outside-toplevel
  pattern = DilatedPattern((128, 256, 512), (1, 2, 4), causal=True)
  q = jax.ShapeDtypeStruct((1, 512, 4, 128), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((1, 512, 2, 128), jnp.bfloat16)
  lse = jax.ShapeDtypeStruct((1, 512, 4), jnp.float32)
  ids = tuple(jax.ShapeDtypeStruct((1, 512) + ((x.shape[2],) if per_head else ()), jnp.int32)
              for x in (q, kv))
  pallas = backends.load("pallas")
  gpu = pallas.Config(interpret=False)
  fwd = lambda q, k, v, *ids: pallas.forward(q, k, v, pattern, 0.1, config=gpu, segment_ids=ids)
  bwd = lambda q, k, v, do, lse, delta, *ids: pallas.backward(
      q, k, v, do, lse, delta, pattern, 0.1, config=gpu, segment_ids=ids)
  assert _triton_kernels(fwd, q, kv, kv, *ids) == 3
  assert _triton_kernels(bwd, q, kv, kv, q, lse, lse, *ids) == 6
