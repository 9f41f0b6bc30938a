"""Decoding with the compressed KV cache reproduces the causal rows of the full attention."""

import dataclasses
import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import TOL, Case, check_lse, random_inputs, reference, rel_err
from hilbert_ring_jax import DilatedPattern
from hilbert_ring_jax.backends.hopper import is_hopper
from hilbert_ring_jax.decode import (KVCache, _tables, dilated_attention_prefill,
                                     dilated_attention_step, init_kv_cache, step_backend)


@pytest.fixture(autouse=True)
def _float32_matmuls():
  """The jnp step's float32 products in full float32 (on a GPU they default to tf32)."""
  with jax.default_matmul_precision("highest"):
    yield


# Chunk sizes cycled through: single tokens and chunks that cross several segment boundaries
# (each size compiles a step per case: three sizes).
CHUNKS = (1, 3, 1, 7)

# Compiled once per (pattern, head layout, chunk size) for the whole module.
_step = jax.jit(dilated_attention_step, static_argnums=4, static_argnames="return_lse")
_prefill = jax.jit(dilated_attention_prefill, static_argnums=3, static_argnames="return_lse")


def _shapes(cache):
  return [(x.shape, x.dtype) for x in jax.tree_util.tree_leaves(cache)]


def _run(case, dtype, prefill, seed=0):
  """Prefill `prefill` tokens (0: start from an empty cache), then steps; checks each cache."""
  q, k, v, dout, dlse = random_inputs(case, dtype, seed)
  pattern = case.pattern(True)
  empty = init_kv_cache(pattern, batch=case.batch, num_heads=case.heads,
                        num_kv_heads=case.kv_heads, head_dim=case.head_dim, dtype=dtype)
  outs, lses = [], []
  if prefill:
    out, lse, cache = _prefill(q[:, :prefill], k[:, :prefill], v[:, :prefill], pattern,
                               return_lse=True)
    outs.append(out)
    lses.append(lse)
  else:
    cache = empty
  i = prefill
  for t in itertools.cycle(CHUNKS):
    if i >= case.n:
      break
    j = min(i + t, case.n)
    out, lse, cache = _step(q[:, i:j], k[:, i:j], v[:, i:j], cache, pattern, return_lse=True)
    assert out.dtype == dtype and out.shape == q[:, i:j].shape
    assert _shapes(cache) == _shapes(empty)  # fixed size: set by the pattern alone
    assert int(cache.length) == j
    outs.append(out)
    lses.append(lse)
    i = j
  ref_out, ref_lse, _ = reference(case, True, q, k, v, dout, dlse)
  out, lse = jnp.concatenate(outs, axis=1), jnp.concatenate(lses, axis=1)
  tol = TOL[dtype]
  assert rel_err(out, ref_out) < tol, rel_err(out, ref_out)
  if dtype == jnp.float32:
    check_lse(lse, ref_lse, tol)


@pytest.mark.parametrize("case,prefill", [
    (Case(29, 4, 2, (8, 6), (3, 4)), 0),                     # r does not divide w
    # (~12 s, `-m slow`: offsets "all" below, a prefill in the next)
    pytest.param(Case(33, 4, 2, (8, 6), (3, 4), offsets="all"), 5, marks=pytest.mark.slow),
    (Case(31, 4, 1, (4, 10, 7), (1, 4, 2), head_groups=True), 9),  # MQA, head groups
    (Case(27, 4, 4, (5, 12), (2, 5), batch=2), 0),          # H < r: residues no head reads
    (Case(25, 3, 3, (6, 9), (2, 3), offsets="all", head_groups=True), 0),
    # r=3 over kv heads {0,1}, {2,0}, {1,2}: residue 1 sits in different slots (a gather).
    (Case(26, 6, 3, (9, 4), (3, 2)), 0),
])
def test_steps_match_reference(case, prefill):
  _run(case, jnp.float32, prefill)


def test_slot_tables():
  """Which slot a query reads: shared by all kv heads (a slice) or per kv head (a gather)."""
  t3, t2 = _tables(DilatedPattern((9, 4), (3, 2), causal=True), 6, 3)
  np.testing.assert_array_equal(t3.slot, [[0, 1, -1], [0, -1, 1], [-1, 0, 1]])
  assert t3.slots == 2 and t3.uniform is None
  np.testing.assert_array_equal(t2.uniform, [0, 1])
  (t,) = _tables(DilatedPattern((8,), (4,), causal=True, offsets="all"), 2, 1)
  np.testing.assert_array_equal(t.uniform, [0, 1, 2, 3])


def test_steps_bfloat16():
  _run(Case(23, 4, 2, (8, 6), (3, 2)), jnp.bfloat16, 0)


def test_cache_shapes_follow_the_pattern():
  p = DilatedPattern((8, 16), (3, 4), causal=True)
  cache = init_kv_cache(p, batch=2, num_heads=4, num_kv_heads=2, head_dim=16,
                        dtype=jnp.bfloat16)
  # Branch 0 (r=3): kv head 0 reads residues {0, 1}, kv head 1 {2, 0} -> 2 slots of 3 rows.
  # Branch 1 (r=4): {0, 1} and {2, 3} -> 2 slots of 4 rows. Slots hold whole tiles of 8 rows.
  assert [x.shape for x in cache.k] == [(2, 2, 2, 8, 16), (2, 2, 2, 8, 16)]
  assert all(x.dtype == jnp.bfloat16 for x in cache.k + cache.v)
  all_offsets = DilatedPattern((8, 16), (3, 4), causal=True, offsets="all")
  cache = init_kv_cache(all_offsets, batch=1, num_heads=4, num_kv_heads=1, head_dim=8,
                        dtype=jnp.float32)
  assert [x.shape for x in cache.v] == [(1, 1, 3, 8, 8), (1, 1, 4, 8, 8)]
  # The prefill of any prompt length gives the same shapes and bytes (traced, not compiled).
  sizes = set()
  for n in (3, 17, 40):
    kv = jax.ShapeDtypeStruct((1, n, 1, 8), jnp.float32)
    q = jax.ShapeDtypeStruct((1, n, 4, 8), jnp.float32)
    _, c = jax.eval_shape(lambda q, k, v: dilated_attention_prefill(q, k, v, all_offsets),
                          q, kv, kv)
    sizes.add((tuple(_shapes(c)), sum(x.size * x.dtype.itemsize
                                      for x in jax.tree_util.tree_leaves(c))))
  assert len(sizes) == 1


def test_jit_with_donation():
  case = Case(20, 2, 1, (4, 8), (1, 2))
  q, k, v, dout, dlse = random_inputs(case, jnp.float32, 1)
  pattern = case.pattern(True)
  step = jax.jit(dilated_attention_step, static_argnums=4, donate_argnums=3)
  prefill = jax.jit(dilated_attention_prefill, static_argnums=3, donate_argnames="cache")
  cache = init_kv_cache(pattern, batch=1, num_heads=2, num_kv_heads=1, head_dim=16,
                        dtype=jnp.float32)
  out, cache = prefill(q[:, :6], k[:, :6], v[:, :6], pattern, cache=cache)
  outs = [out]
  for i in range(6, case.n):
    out, cache = step(q[:, i:i + 1], k[:, i:i + 1], v[:, i:i + 1], cache, pattern)
    outs.append(out)
  ref_out = reference(case, True, q, k, v, dout, dlse)[0]
  assert rel_err(jnp.concatenate(outs, axis=1), ref_out) < TOL[jnp.float32]
  assert isinstance(cache, KVCache) and int(cache.length) == case.n


P = DilatedPattern((8, 16), (1, 2), causal=True)


def _cache(**kwargs):
  args = dict(batch=1, num_heads=4, num_kv_heads=2, head_dim=8, dtype=jnp.float32)
  return init_kv_cache(P, **{**args, **kwargs})


@pytest.mark.parametrize("kwargs,match", [
    (dict(batch=0), "batch"),
    (dict(num_heads=2.0), "num_heads"),
    (dict(num_kv_heads=3), "num_kv_heads"),
    (dict(head_dim=-1), "head_dim"),
    (dict(dtype=jnp.int32), "dtype"),
    (dict(dtype=jnp.float8_e4m3fn), "dtype must be float32, bfloat16 or float16"),
])
def test_bad_init(kwargs, match):
  with pytest.raises(ValueError, match=match):
    _cache(**kwargs)


def test_bad_pattern():
  loose = DilatedPattern((8, 16), (1, 2))
  x, kv = jnp.ones((1, 2, 4, 8)), jnp.ones((1, 2, 2, 8))
  with pytest.raises(ValueError, match="pattern"):
    init_kv_cache(loose, batch=1, num_heads=4, num_kv_heads=2, head_dim=8, dtype=jnp.float32)
  with pytest.raises(ValueError, match="pattern"):
    dilated_attention_step(x, kv, kv, _cache(), loose)
  with pytest.raises(ValueError, match="pattern"):
    dilated_attention_prefill(x, kv, kv, loose)


@pytest.mark.parametrize("q_shape,kv_shape,dtype,kwargs", [
    ((1, 1, 4, 8), (1, 1, 2, 8), jnp.float32, dict(head_dim=16)),
    ((1, 1, 4, 8), (1, 1, 2, 8), jnp.float32, dict(num_kv_heads=1)),
    ((1, 1, 4, 8), (1, 1, 2, 8), jnp.float32, dict(num_heads=2)),
    ((1, 1, 4, 8), (1, 1, 2, 8), jnp.float32, dict(batch=2)),
    ((1, 1, 4, 8), (1, 1, 2, 8), jnp.bfloat16, dict()),
])
def test_cache_mismatch(q_shape, kv_shape, dtype, kwargs):
  q, kv = jnp.ones(q_shape, dtype), jnp.ones(kv_shape, dtype)
  with pytest.raises(ValueError, match="cache"):
    dilated_attention_step(q, kv, kv, _cache(**kwargs), P)
  with pytest.raises(ValueError, match="cache"):
    dilated_attention_prefill(q, kv, kv, P, cache=_cache(**kwargs))


def test_bad_step_inputs():
  q, kv = jnp.ones((1, 1, 4, 8)), jnp.ones((1, 1, 2, 8))
  with pytest.raises(ValueError, match="cache"):
    dilated_attention_step(q, kv, kv, {"length": 0}, P)
  with pytest.raises(ValueError, match="k and v"):
    dilated_attention_step(q, kv, jnp.ones((1, 1, 2, 4)), _cache(), P)
  with pytest.raises(ValueError, match="scale"):
    dilated_attention_step(q, kv, kv, _cache(), P, scale="big")
  np.testing.assert_array_equal(_step(q, kv, kv, _cache(), P)[0], 1.0)  # all-ones values


def test_cache_knows_its_pattern():
  """A step under another pattern with the same cache shapes is refused, naming both (it
  would read rows laid out for the other branches: off by up to 1.57 before)."""
  built = DilatedPattern((8, 16), (1, 2), causal=True)
  other = DilatedPattern((6, 14), (1, 2), causal=True)
  cache = init_kv_cache(built, batch=1, num_heads=4, num_kv_heads=2, head_dim=8)
  assert _shapes(cache) == _shapes(init_kv_cache(other, batch=1, num_heads=4, num_kv_heads=2,
                                                 head_dim=8))
  q, kv = jnp.ones((1, 1, 4, 8)), jnp.ones((1, 1, 2, 8))
  with pytest.raises(ValueError, match=r"pattern=DilatedPattern\(segment_lengths=\(8, 16\)"
                                       r".*pattern=DilatedPattern\(segment_lengths=\(6, 14\)"):
    dilated_attention_step(q, kv, kv, cache, other)
  with pytest.raises(ValueError, match="cache was built for pattern"):
    _step(q, kv, kv, cache, other)
  assert _step(q, kv, kv, cache, built)[1].pattern == built


def test_cache_length_is_range_checked():
  """Negative lengths, and lengths whose int32 positions would wrap, are refused where the
  length is known (outside jit); so is a length that is not an integer scalar array."""
  q, kv = jnp.ones((1, 2, 4, 8)), jnp.ones((1, 2, 2, 8))
  cache = _cache()
  for length in (-1, 2 ** 31 - 2):
    bad = dataclasses.replace(cache, length=jnp.asarray(length, jnp.int32))
    with pytest.raises(ValueError, match=f"cache.length={length}"):
      dilated_attention_step(q, kv, kv, bad, P)
  ok = dataclasses.replace(cache, length=jnp.asarray(2 ** 31 - 3, jnp.int32))
  assert int(dilated_attention_step(q, kv, kv, ok, P)[1].length) == 2 ** 31 - 1
  for bad in (5, jnp.float32(5), jnp.zeros(1, jnp.int32)):  # not an integer scalar array
    with pytest.raises(ValueError, match="cache.length must be an integer scalar array"):
      dilated_attention_step(q, kv, kv, dataclasses.replace(cache, length=bad), P)


def test_return_lse_is_a_bool():
  q, kv = jnp.ones((1, 1, 4, 8)), jnp.ones((1, 1, 2, 8))
  for call in (lambda: dilated_attention_step(q, kv, kv, _cache(), P, return_lse="no"),
               lambda: dilated_attention_prefill(q, kv, kv, P, return_lse="no")):
    with pytest.raises(ValueError, match="return_lse='no'"):
      call()


# On CPU the kernel runs in Mosaic GPU interpret mode, on a Hopper GPU itself.
MOSAIC = pytest.mark.skipif(
    jax.__version_info__ < (0, 11) or (jax.default_backend() == "gpu" and not is_hopper()),
    reason="the mosaic token step: JAX >= 0.11, on a CPU (interpret mode) or a Hopper GPU")


@MOSAIC
@pytest.mark.parametrize("case,prefill,dtype", [
    # Three blocks of 64 rows in the long branch, split over two programs; GQA (2 per kv head).
    # (Each interpreted token costs ~1 s: two tokens either side of a segment boundary.)
    pytest.param(Case(162, 4, 2, (160, 48), (1, 3), head_dim=64), 158, jnp.float16,
                 marks=pytest.mark.slow),
    # MQA, offsets="all", head groups: the query heads of one kv head read different branches.
    (Case(98, 4, 1, (96, 40), (1, 2), offsets="all", head_groups=True, head_dim=64), 94,
     jnp.bfloat16),
    # H = Hkv < r: residues no head reads (those kv heads read nothing in that branch): 2 and
    # 3 before the boundary at 72, 0 and 1 (read) after it.
    pytest.param(Case(74, 2, 2, (72, 24), (1, 4), head_dim=128, batch=2), 70, jnp.bfloat16,
                 marks=pytest.mark.slow),
])
def test_mosaic_token_steps_interpret(case, prefill, dtype):
  """The token-step kernel across segment boundaries against the float64 reference: outputs
  and log-denominators."""
  from hilbert_ring_jax.backends import mosaic_decode
  config = mosaic_decode.Config(interpret=jax.default_backend() != "gpu", block_k=64, splits=2)
  q, k, v, dout, dlse = random_inputs(case, dtype, 3)
  pattern = case.pattern(True)
  out, lse, cache = _prefill(q[:, :prefill], k[:, :prefill], v[:, :prefill], pattern,
                             return_lse=True)
  outs, lses = [out], [lse]
  for i in range(prefill, case.n):
    out, lse, cache = dilated_attention_step(q[:, i:i + 1], k[:, i:i + 1], v[:, i:i + 1], cache,
                                             pattern, return_lse=True, implementation="mosaic",
                                             config=config)
    outs.append(out)
    lses.append(lse)
  assert out.dtype == dtype and int(cache.length) == case.n
  ref_out, ref_lse, _ = reference(case, True, q, k, v, dout, dlse)
  out, lse = jnp.concatenate(outs, axis=1), jnp.concatenate(lses, axis=1)
  assert rel_err(out[:, prefill:], ref_out[:, prefill:]) < TOL[dtype]
  check_lse(lse[:, prefill:], ref_lse[:, prefill:], 1e-5)


@MOSAIC
def test_mosaic_token_step_under_vmap_and_jit():
  """The kernel under `vmap` (a leading axis of independent caches) and `jit` with the cache
  donated: each member's token equals the float64 reference."""
  from hilbert_ring_jax.backends import mosaic_decode
  config = mosaic_decode.Config(interpret=jax.default_backend() != "gpu", block_k=64)
  case = Case(70, 2, 1, (64, 32), (1, 2), head_dim=64)
  pattern = case.pattern(True)
  members = [random_inputs(case, jnp.bfloat16, seed) for seed in (4, 5)]
  q, k, v = (jnp.stack([m[i] for m in members]) for i in range(3))
  _, cache = jax.vmap(lambda q, k, v: _prefill(q, k, v, pattern))(
      q[:, :, :-1], k[:, :, :-1], v[:, :, :-1])
  step = jax.jit(jax.vmap(lambda q, k, v, c: dilated_attention_step(
      q, k, v, c, pattern, implementation="mosaic", config=config)), donate_argnums=3)
  out, cache = step(q[:, :, -1:], k[:, :, -1:], v[:, :, -1:], cache)
  np.testing.assert_array_equal(cache.length, case.n)
  for i, member in enumerate(members):
    ref_out = reference(case, True, *member)[0]
    assert rel_err(out[i], ref_out[:, -1:]) < TOL[jnp.bfloat16]


def _steps(pattern, q, k, v, prefill, implementation, segment_ids=None, cache=None):
  """The outputs of the tokens after the first `prefill`, stepped one at a time."""
  config = None
  if implementation == "mosaic":
    from hilbert_ring_jax.backends import mosaic_decode
    config = mosaic_decode.Config(interpret=jax.default_backend() != "gpu", block_k=64)
  ids = None if segment_ids is None else segment_ids[:, :prefill]
  _, cache = dilated_attention_prefill(q[:, :prefill], k[:, :prefill], v[:, :prefill], pattern,
                                       segment_ids=ids, cache=cache)
  outs = []
  for i in range(prefill, q.shape[1]):
    out, cache = dilated_attention_step(q[:, i:i + 1], k[:, i:i + 1], v[:, i:i + 1], cache,
                                        pattern, implementation=implementation, config=config)
    outs.append(out)
  return jnp.concatenate(outs, axis=1)


@pytest.mark.parametrize("implementation", ["xla", pytest.param("mosaic", marks=MOSAIC)])
def test_hidden_cache_rows_are_not_read(implementation):
  """A NaN in a cache row that a step does not see leaves the step's output as it is without
  the NaN: rows of an earlier request (its cache lent to a prefill), of an earlier document
  (packed), of another head's residue; with the portable step also of the row's earlier
  segments (the token-step kernel weighs those by 0: docs/SPEC.md, "Numerical range")."""
  case = Case(12, 2, 1, (64,), (1,), head_dim=64)
  q, k, v, _, _ = random_inputs(dataclasses.replace(case, n=48), jnp.bfloat16, 6)
  causal = DilatedPattern((64,), (1,), causal=True)
  nan_at = lambda x, i: x.at[:, i].set(jnp.nan)
  steps = functools.partial(_steps, implementation=implementation)
  # An earlier request, whose last segment held a NaN, lends its cache to the next prompt.
  _, stale = dilated_attention_prefill(q, k, nan_at(v, 30), causal)
  clean = steps(causal, q[:, :10], k[:, :10], v[:, :10], 8)
  np.testing.assert_array_equal(steps(causal, q[:, :10], k[:, :10], v[:, :10], 8, cache=stale),
                                clean)
  assert np.isfinite(np.asarray(clean, np.float32)).all()
  # Packed: the steps continue document 1; document 0 holds a NaN.
  ids = jnp.asarray([[0] * 20 + [1] * 28], jnp.int32)
  np.testing.assert_array_equal(steps(causal, q[:, :30], k[:, :30], nan_at(v, 10)[:, :30], 28,
                                      segment_ids=ids),
                                steps(causal, q[:, :30], k[:, :30], v[:, :30], 28,
                                      segment_ids=ids))
  # Another head's residue: head 1 alone reads odd positions, head 0 sees no key there.
  heads = DilatedPattern((64,), (2,), causal=True)
  bad = steps(heads, q[:, :10], k[:, :10], nan_at(v, 3)[:, :10], 8)
  np.testing.assert_array_equal(bad[:, :, 0], steps(heads, q[:, :10], k[:, :10], v[:, :10],
                                                    8)[:, :, 0])
  assert np.isnan(np.asarray(bad[:, 1, 1], np.float32)).all()  # position 9 reads it
  if implementation == "xla":  # the row's earlier segment: (16,) segments, NaN at 3
    short = DilatedPattern((16,), (1,), causal=True)
    np.testing.assert_array_equal(
        steps(short, q[:, :20], k[:, :20], nan_at(v, 3)[:, :20], 16),
        steps(short, q[:, :20], k[:, :20], v[:, :20], 16))


def test_step_kernel_choice():
  """"mosaic" alone where it cannot run names why; other names and chunks run the jnp step."""
  from hilbert_ring_jax.backends import base
  q, kv = jnp.ones((1, 1, 4, 8)), jnp.ones((1, 1, 2, 8))
  with pytest.raises(base.NoBackendError, match="mosaic"):
    dilated_attention_step(q, kv, kv, _cache(), P, implementation="mosaic")
  out, _ = dilated_attention_step(q, kv, kv, _cache(), P, implementation=("mosaic", "xla"))
  np.testing.assert_array_equal(out, 1.0)
  out, _ = dilated_attention_step(jnp.ones((1, 2, 4, 8)), jnp.ones((1, 2, 2, 8)),
                                  jnp.ones((1, 2, 2, 8)), _cache(), P, implementation="mosaic")
  np.testing.assert_array_equal(out, 1.0)
  with pytest.raises(ValueError, match="implementation"):
    dilated_attention_step(q, kv, kv, _cache(), P, implementation="cuda")
  with pytest.raises(ValueError, match="config"):
    dilated_attention_step(q, kv, kv, _cache(), P, config="fast")


def test_step_resolves_through_the_backend_protocol():
  """A step is a `Problem` with `step` set, resolved by `base.resolve`: "mosaic" (the one
  backend with a token-step kernel) answers for single tokens through `supports`, with its
  reasons; chunks and backends without a step kernel decode with "xla"'s portable step,
  which every name then runs (a backend need not be importable here for that)."""
  from hilbert_ring_jax.backends import base, mosaic, xla
  token = base.Problem.of(jnp.ones((1, 1, 4, 64), jnp.bfloat16),
                          jnp.ones((1, 1, 2, 64), jnp.bfloat16), P)
  token = dataclasses.replace(token, step=True)
  chunk = dataclasses.replace(token, q_shape=(1, 3, 4, 64), kv_shape=(1, 3, 2, 64))
  assert base.STEP_KERNELS == ("mosaic",) and hasattr(mosaic, "step") and hasattr(xla, "step")
  for names in (("triton",), ("pallas", "mosaic"), ("xla",)):
    assert base.resolve(names, token) == "xla"
  assert base.resolve(("mosaic",), chunk) == "xla"
  if jax.__version_info__ >= (0, 11):
    assert base.resolve(("mosaic",), dataclasses.replace(token, interpret=True)) == "mosaic"
    for change, why in ((dict(dtype=jnp.dtype(jnp.float32)), "bf16 and f16"),
                        (dict(q_shape=(1, 1, 4, 32), kv_shape=(1, 1, 2, 32)), "head dim"),
                        (dict(q_shape=(1, 1, 130, 64), kv_shape=(1, 1, 2, 64)), "at most 64")):
      support = mosaic.supports(dataclasses.replace(token, interpret=True, **change))
      assert not support and why in support.reason
  if jax.default_backend() != "gpu":
    with pytest.raises(base.NoBackendError, match="mosaic token step"):
      base.resolve(("mosaic",), token)
    assert base.resolve(("mosaic", "triton"), token) == "xla"
    q, kv = jnp.ones((1, 1, 4, 64), jnp.bfloat16), jnp.ones((1, 1, 2, 64), jnp.bfloat16)
    assert step_backend(q, kv, P) == step_backend(q, kv, P, "triton") == "xla"
