"""Ring dilated attention on 8 CPU devices equals the single-device result, gradients too."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import helpers
from hilbert_ring_jax import DilatedPattern, dilated_attention
from hilbert_ring_jax import ring as ring_module
from hilbert_ring_jax.ring import _plans, ring_dilated_attention, sharded_dilated_attention

AUTO = jax.sharding.AxisType.Auto
EXPLICIT = jax.sharding.AxisType.Explicit

# (P, N, H, Hkv, pattern) -- local-only, spanning, full attention, mixed, fallbacks.
CASES = {
    "local_only": (4, 64, 2, 2, DilatedPattern((8, 16), (1, 2))),
    "spanning_head": (4, 64, 4, 4, DilatedPattern((8, 32, 64), (1, 2, 4), causal=True)),
    "spanning_all_gqa": (8, 64, 4, 2, DilatedPattern((16, 64), (2, 8), offsets="all")),
    "full_attention": (8, 64, 2, 1, DilatedPattern((128,), (1,), causal=True)),
    "full_attention_p2": (2, 32, 2, 2, DilatedPattern((32,), (1,))),
    "mqa_not_compact": (4, 48, 4, 1, DilatedPattern((12, 24), (3, 2), causal=True)),
    "head_groups_gqa": (4, 64, 6, 2, DilatedPattern((8, 32, 64), (1, 4, 2), causal=True,
                                                    head_groups=True)),
    "gather_fallback": (4, 48, 2, 2, DilatedPattern((8, 18), (2, 3), causal=True)),
    "partial_sub_rings": (4, 48, 2, 2, DilatedPattern((36, 36), (1, 3), causal=True)),
    "partial_non_causal": (4, 48, 2, 1, DilatedPattern((36,), (3,))),
    "causal_without_zigzag": (4, 48, 2, 2, DilatedPattern((24,), (4,), causal=True,
                                                          offsets="all")),
    "single_shard": (1, 32, 2, 2, DilatedPattern((8, 32), (1, 4), causal=True)),
}


def test_cases_cover_every_plan():
  """The cases above exercise each way a branch can run (see ring.py's module docstring)."""
  kinds = set()
  for p, n, h, hkv, pattern in CASES.values():
    for plan in _plans(pattern, n // p, p, h, h // hkv):
      kinds.add((plan.kind, plan.compact, plan.zigzag, plan.shards % plan.span != 0))
  assert {("local", False, False, False), ("gather", False, False, False),
          ("ring", True, True, False), ("ring", False, True, False),
          ("ring", False, False, False), ("ring", True, True, True),
          ("ring", False, True, True), ("ring", True, False, True)} <= kinds, kinds


def mesh(p):
  return jax.make_mesh((p,), ("seq",), axis_types=(AUTO,), devices=jax.devices()[:p])


@pytest.mark.parametrize("name", CASES)
def test_ring_equals_single_device(name):
  p, n, h, hkv, pattern = CASES[name]
  case = helpers.Case(n, h, hkv, pattern.segment_lengths, pattern.dilation_rates,
                      pattern.offsets, pattern.head_groups)
  q, k, v, dout, dlse = helpers.random_inputs(case, jnp.float32, 7)
  single = lambda q, k, v: dilated_attention(q, k, v, pattern, return_lse=True)
  ring = jax.jit(lambda q, k, v: sharded_dilated_attention(
      q, k, v, pattern, mesh=mesh(p), axis_name="seq", return_lse=True))
  (out, lse), vjp = jax.vjp(single, q, k, v)
  (rout, rlse), rvjp = jax.vjp(ring, q, k, v)
  np.testing.assert_allclose(rout, out, rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(np.isneginf(rlse), np.isneginf(lse))
  finite = np.isfinite(np.asarray(lse))
  np.testing.assert_allclose(np.asarray(rlse)[finite], np.asarray(lse)[finite], atol=1e-5)
  for g, rg in zip(vjp((dout, dlse)), rvjp((dout, dlse))):
    np.testing.assert_allclose(rg, g, rtol=1e-5, atol=1e-5)
  # And against the float64 reference directly.
  ref_out, _, _ = helpers.reference(case, pattern.causal, q, k, v, dout, dlse)
  assert helpers.rel_err(rout, ref_out) < helpers.TOL[jnp.float32]


def test_ring_bf16_and_explicit_mesh():
  p, n, h, hkv, pattern = CASES["spanning_head"]
  case = helpers.Case(n, h, hkv, pattern.segment_lengths, pattern.dilation_rates)
  q, k, v, dout, dlse = helpers.random_inputs(case, jnp.bfloat16, 8)
  explicit = jax.make_mesh((p,), ("seq",), axis_types=(jax.sharding.AxisType.Explicit,),
                           devices=jax.devices()[:p])
  out = jax.jit(lambda q, k, v: sharded_dilated_attention(q, k, v, pattern, mesh=explicit,
                                                          axis_name="seq"))(q, k, v)
  assert out.dtype == jnp.bfloat16
  ref_out, _, _ = helpers.reference(case, True, q, k, v, dout, dlse)
  assert helpers.rel_err(out, ref_out) < helpers.TOL[jnp.bfloat16]


def _collectives(pattern, p=4, n=64, h=2, hkv=2):
  """Shapes of the operands of every collective in the compiled ring program."""
  x = jax.ShapeDtypeStruct((1, n, h, 16), jnp.float32)
  kv = jax.ShapeDtypeStruct((1, n, hkv, 16), jnp.float32)
  f = jax.jit(lambda q, k, v: sharded_dilated_attention(q, k, v, pattern, mesh=mesh(p),
                                                        axis_name="seq"))
  hlo = f.lower(x, kv, kv).compile().as_text()
  return re.findall(r"= (\S+) (collective-permute|all-gather|all-reduce|all-to-all)"
                    r"(?:-start)?\(", hlo)


def test_local_patterns_send_nothing():
  assert _collectives(DilatedPattern((8, 16), (1, 2), causal=True)) == []


def test_local_branches_run_as_one_call(monkeypatch):
  """The local branches of a shard go to their backend together (one launch where it
  schedules them together), the spanning one on its own; gradients through both."""
  from hilbert_ring_jax.backends import xla  # pylint: disable=g-import-not-at-top
  # Shards of 16: w = 4 and 8 are local, w = 64 rings over all four shards.
  p, n, h, hkv, pattern = 4, 64, 4, 2, DilatedPattern((4, 8, 64), (1, 2, 4), causal=True)
  calls = []
  for name in ("forward", "backward"):
    fn = getattr(xla, name)
    monkeypatch.setattr(xla, name, lambda *a, fn=fn, name=name, **kw: (
        calls.append((name, kw.get("branches"))), fn(*a, **kw))[1])
  case = helpers.Case(n, h, hkv, pattern.segment_lengths, pattern.dilation_rates)
  q, k, v, dout, _ = helpers.random_inputs(case, jnp.float32, 11)
  ring = jax.jit(lambda q, k, v: sharded_dilated_attention(
      q, k, v, pattern, mesh=mesh(p), axis_name="seq", implementation="xla"))
  out, vjp = jax.vjp(ring, q, k, v)
  grads = vjp(dout)
  local = [br.index for br in pattern.layout(n, h) if (n // p) % br.w == 0]
  assert len(local) > 1
  # (each pass traced once or more: every call that touches a local branch takes them all)
  assert {c for c in calls if set(c[1] or ()) & set(local)} == {
      ("forward", tuple(local)), ("backward", tuple(local))}
  single = lambda q, k, v: dilated_attention(q, k, v, pattern, implementation="xla")
  ref, ref_vjp = jax.vjp(single, q, k, v)
  np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)
  for g, r in zip(grads, ref_vjp(dout)):
    np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5)


def test_spanning_branches_send_only_dilated_rows():
  # n = 16 tokens per shard; w = 64 spans all 4 shards; r = 4 with one kv head per query
  # head: each step sends k and v of 16 / 4 = 4 rows for each of the 2 heads.
  found = _collectives(DilatedPattern((64,), (4,)))
  assert found and {kind for _, kind in found} == {"collective-permute"}
  for shape, _ in found:
    assert re.fullmatch(r"(\(?f32\[1,4,2,16\][^ ]*,? ?)+\)?", shape), shape
  # Undilated: the whole shard travels.
  for shape, _ in _collectives(DilatedPattern((64,), (1,))):
    assert "f32[1,16,2,16]" in shape, shape


def test_sequence_not_divisible_raises():
  x = jnp.zeros((1, 30, 2, 8))
  with pytest.raises(ValueError, match="axis_name"):
    sharded_dilated_attention(x, x, x, DilatedPattern((8,), (1,)), mesh=mesh(4), axis_name="seq")
  with pytest.raises(ValueError, match="axis_name"):
    sharded_dilated_attention(x, x, x, DilatedPattern((8,), (1,)), mesh=mesh(2), axis_name="s")


def test_ring_inside_user_shard_map():
  """The inner entry, called in the caller's own shard_map."""
  p, n, h, hkv, pattern = CASES["spanning_all_gqa"]
  case = helpers.Case(n, h, hkv, pattern.segment_lengths, pattern.dilation_rates, "all")
  q, k, v, *_ = helpers.random_inputs(case, jnp.float32, 9)
  spec = jax.P(None, "seq")
  f = jax.jit(jax.shard_map(lambda q, k, v: ring_dilated_attention(q, k, v, pattern,
                                                                   axis_name="seq"),
                            mesh=mesh(p), in_specs=(spec,) * 3, out_specs=spec))
  np.testing.assert_allclose(f(q, k, v), dilated_attention(q, k, v, pattern), rtol=1e-5,
                             atol=1e-5)


def test_ring_steps_fall_back_to_the_next_backend():
  """pallas declines shard_map(check_vma=True); the ring's steps then use "xla"."""
  p, n, h, hkv, pattern = CASES["spanning_head"]
  case = helpers.Case(n, h, hkv, pattern.segment_lengths, pattern.dilation_rates)
  q, k, v, *_ = helpers.random_inputs(case, jnp.float32, 10)
  ring = lambda impl: jax.jit(lambda q, k, v: sharded_dilated_attention(
      q, k, v, pattern, mesh=mesh(p), axis_name="seq", implementation=impl))
  np.testing.assert_allclose(ring(("pallas", "xla"))(q, k, v), dilated_attention(q, k, v, pattern),
                             rtol=1e-5, atol=1e-5)
  with pytest.raises(NotImplementedError, match="pallas"):
    ring("pallas")(q, k, v)


# Data x sequence meshes: every plan kind, (data=2, seq=4) and (data=4, seq=2), both axis types.
DATA_SEQ = [("spanning_head", 2, EXPLICIT), ("mqa_not_compact", 2, AUTO),
            ("head_groups_gqa", 2, AUTO), ("gather_fallback", 2, EXPLICIT),
            ("partial_non_causal", 2, AUTO), ("causal_without_zigzag", 2, EXPLICIT),
            ("full_attention_p2", 4, EXPLICIT), ("local_only", 2, AUTO)]


@pytest.mark.parametrize("name,data,axis_type", DATA_SEQ,
                         ids=[f"{n}-data{d}-{t.name}" for n, d, t in DATA_SEQ])
def test_data_and_sequence_parallel(name, data, axis_type):
  p, n, h, hkv, pattern = CASES[name]
  case = helpers.Case(n, h, hkv, pattern.segment_lengths, pattern.dilation_rates,
                      pattern.offsets, pattern.head_groups, batch=2 * data)
  q, k, v, dout, dlse = helpers.random_inputs(case, jnp.float32, 13)
  mesh = jax.make_mesh((data, p), ("data", "seq"), axis_types=(axis_type,) * 2,
                       devices=jax.devices()[:data * p])
  ring = lambda q, k, v: sharded_dilated_attention(q, k, v, pattern, mesh=mesh, axis_name="seq",
                                                   batch_axis="data", return_lse=True)
  single = lambda q, k, v: dilated_attention(q, k, v, pattern, return_lse=True)
  (out, lse), vjp = jax.vjp(single, q, k, v)
  (rout, rlse), rvjp = jax.vjp(jax.jit(ring), q, k, v)
  assert rout.sharding.spec[:2] == ("data", "seq")
  np.testing.assert_allclose(rout, out, rtol=1e-5, atol=1e-5)
  finite = np.isfinite(np.asarray(lse))
  np.testing.assert_allclose(np.asarray(rlse)[finite], np.asarray(lse)[finite], atol=1e-5)
  for g, rg in zip(vjp((dout, dlse)), rvjp((dout, dlse))):
    np.testing.assert_allclose(rg, g, rtol=1e-5, atol=1e-5)


def test_eager_call_compiles_once():
  """Called without jit, the ring runs as one cached program, not op by op."""
  p, n, h, hkv, pattern = CASES["spanning_head"]
  case = helpers.Case(n, h, hkv, pattern.segment_lengths, pattern.dilation_rates)
  q, k, v, *_ = helpers.random_inputs(case, jnp.float32, 14)
  call = lambda: sharded_dilated_attention(q, k, v, pattern, mesh=mesh(p), axis_name="seq")
  first = call()
  before = ring_module._sharded.cache_info()
  np.testing.assert_array_equal(call(), first)
  after = ring_module._sharded.cache_info()
  assert (after.hits, after.misses) == (before.hits + 1, before.misses)


def test_bad_batch_axis():
  x = jnp.zeros((3, 32, 2, 8))
  m = jax.make_mesh((2, 4), ("data", "seq"), axis_types=(AUTO, AUTO))
  for batch_axis in ("model", "seq"):
    with pytest.raises(ValueError, match="batch_axis"):
      sharded_dilated_attention(x, x, x, DilatedPattern((8,), (1,)), mesh=m, axis_name="seq",
                                batch_axis=batch_axis)
  with pytest.raises(ValueError, match="batch size 3"):
    sharded_dilated_attention(x, x, x, DilatedPattern((8,), (1,)), mesh=m, axis_name="seq",
                              batch_axis="data")


# (B, N per GPU, H, Hkv, D, pattern with N = P x N per GPU): what a user runs on GPUs.
GPU_CASES = {
    "full": (1, 8192, 4, 4, 128, lambda n: DilatedPattern((n,), (1,))),
    "full_causal_gqa": (1, 8192, 4, 2, 128, lambda n: DilatedPattern((n,), (1,), causal=True)),
    "longnet_causal_d64": (1, 8192, 4, 4, 64, lambda n: DilatedPattern(
        (2048, 4096, 8192), (1, 2, 4), causal=True)),
    "lm_preset": (2, 8192, 6, 2, 128, lambda n: DilatedPattern(
        (512, 2048, 8192), (1, 4, 16), causal=True, offsets="all")),
}


@pytest.mark.gpu
@pytest.mark.parametrize("name", GPU_CASES)
def test_ring_on_gpus(name, monkeypatch):
  """The ring over every GPU of the host, bf16, each step on the default backend ("mosaic" on
  Hopper: its float32 partials and gradients), against one GPU's float32 "xla" result:
  outputs, lse and gradients (`run_gpu.sh tests-ring`; needs two GPUs)."""
  from hilbert_ring_jax.backends import mosaic  # pylint: disable=g-import-not-at-top
  gpus = jax.devices("gpu")
  if len(gpus) < 2:
    pytest.skip("needs two GPUs")
  b, per_gpu, h, hkv, d, make = GPU_CASES[name]
  p, n = len(gpus), len(gpus) * per_gpu
  pattern = make(n)
  case = helpers.Case(n, h, hkv, pattern.segment_lengths, pattern.dilation_rates,
                      pattern.offsets, head_dim=d, batch=b)
  q, k, v, dout, dlse = helpers.random_inputs(case, jnp.bfloat16, 3)
  launches = []
  launch = mosaic._forward_launch  # pylint: disable=protected-access
  monkeypatch.setattr(mosaic, "_forward_launch",
                      lambda *a, **kw: (launches.append(1), launch(*a, **kw))[1])
  jax.clear_caches()
  gpu_mesh = jax.make_mesh((p,), ("seq",), axis_types=(AUTO,), devices=gpus)
  ring = jax.jit(lambda q, k, v: sharded_dilated_attention(
      q, k, v, pattern, mesh=gpu_mesh, axis_name="seq", return_lse=True))
  (out, lse), vjp = jax.vjp(ring, q, k, v)
  grads = vjp((dout, dlse))
  f32 = lambda *xs: [jax.device_put(x.astype(jnp.float32), gpus[0]) for x in xs]
  single = lambda q, k, v: dilated_attention(q, k, v, pattern, return_lse=True,
                                             implementation="xla")
  (ref_out, ref_lse), ref_vjp = jax.vjp(single, *f32(q, k, v))
  ref_grads = ref_vjp(tuple(f32(dout, dlse)))
  ref_out, ref_lse, *ref_grads = (np.asarray(x, np.float64)
                                  for x in (ref_out, ref_lse, *ref_grads))
  tol = helpers.TOL[jnp.bfloat16]
  assert out.dtype == jnp.bfloat16
  assert helpers.rel_err(out, ref_out) < tol
  helpers.check_lse(lse, ref_lse, tol)
  for g, ref in zip(grads, ref_grads):
    assert g.dtype == jnp.bfloat16 and helpers.rel_err(g, ref) < tol
  if mosaic._is_hopper():  # pylint: disable=protected-access
    assert launches, "no step ran the mosaic kernels"
