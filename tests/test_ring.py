"""Ring dilated attention on 8 CPU devices equals the float64 reference (small cases) and the
single-device result (at shard sizes users run), gradients too."""

import functools
import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import helpers
from hilbert_ring_jax import DilatedPattern, dilated_attention, merge, zigzag_positions
from hilbert_ring_jax import ring as ring_module
from hilbert_ring_jax.backends import hopper, xla
from hilbert_ring_jax.ring import _plans, ring_dilated_attention, sharded_dilated_attention

# shard_map and mesh-axes types have changed across JAX versions: CI runs the tests marked
# OLD_JAX on its oldest JAX too (one of each way the ring meets mesh-varying data).
OLD_JAX = pytest.mark.old_jax

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
  """The cases above exercise each way a branch can run (see ring.py's module docstring):
  their shards are small, so are their rings (natural order)."""
  kinds = set()
  for p, n, h, hkv, pattern in CASES.values():
    for plan in _plans(pattern, n // p, p, h, h // hkv):
      kinds.add((plan.kind, plan.compact, plan.shards % plan.span != 0, plan.gatherable))
  assert {("local", False, False, False), ("gather", False, False, False),
          ("ring", True, False, False), ("ring", False, False, False),
          ("ring", True, True, False), ("ring", False, True, False),
          ("ring", True, False, True), ("ring", False, False, True)} <= kinds, kinds


def mesh(p):
  return jax.make_mesh((p,), ("seq",), axis_types=(AUTO,), devices=jax.devices()[:p])


# One device's results by the key of their case (`_assert_ring_equals`): a ring's tests that
# differ only in the ring's settings (rotating or gathered; no ring small) share them.
_ONE_DEVICE = {}


def _assert_ring_equals(ring, single, inputs, key=None):
  """`ring` and `single` (both `(q, k, v) -> (out, lse)`) agree on outputs, lse (-inf where a
  query sees nothing) and gradients. `key`: what `single` and `inputs` depend on, all of it
  (its result is then computed once for the tests that give that key)."""
  result = _ONE_DEVICE.get(key) if key is not None else None
  if result is None:
    result = helpers.results_with_grads(single, inputs)
    if key is not None:
      _ONE_DEVICE[key] = result
  helpers.assert_same_results(helpers.results_with_grads(ring, inputs), result)


# The plans the realistic cases below do not reach (head groups, odd rates, partial sub-rings
# of compacted residues, one shard); the rest of CASES feeds the other tests.
SMALL = ["head_groups_gqa", "mqa_not_compact", "partial_sub_rings", "partial_non_causal",
         "single_shard", "spanning_all_gqa"]


def _assert_ring_matches_reference(ring, case, causal, inputs):
  """`ring` (`(q, k, v) -> (out, lse)`): outputs, lse and gradients against the reference;
  returns the ring's output."""
  q, k, v, dout, dlse = inputs
  (out, lse), grads = helpers.with_grads(ring)(q, k, v, (dout, dlse))
  helpers.check_result(case, causal, jnp.float32, inputs, out, lse, grads)
  return out


# Rings of the reference cases rotating their keys (`GATHER_LIMIT_BYTES = 0`) with no ring
# small (`SMALL_STEP_ROWS = 0`): causal ones in zigzag order, compact, a whole ring of 4 shards
# beside sub-rings of 2, and partial sub-rings of 3; a non-causal whole ring of 8. Each step's
# dk, dv are sent back up to 7 places.
LARGE = ["spanning_head", "partial_sub_rings", "spanning_all_gqa"]


# (The large rings with `-m slow`: ~12-24 s each; the realistic cases below run their plans.)
@pytest.mark.parametrize("name,large", [(name, False) for name in SMALL]
                         + [pytest.param(name, True, marks=pytest.mark.slow)
                            for name in LARGE],
                         ids=SMALL + [f"{name}-large" for name in LARGE])
def test_ring_matches_reference(monkeypatch, name, large):
  p, n, h, hkv, pattern = CASES[name]
  if large:
    monkeypatch.setattr(ring_module, "GATHER_LIMIT_BYTES", 0)
    monkeypatch.setattr(ring_module, "SMALL_STEP_ROWS", 0)
    plans = list(_plans(pattern, n // p, p, h, h // hkv))
    assert any(plan.kind == "ring" and plan.zigzag == pattern.causal for plan in plans)
  case = helpers.Case(n, h, hkv, pattern.segment_lengths, pattern.dilation_rates,
                      pattern.offsets, pattern.head_groups)
  ring = lambda q, k, v: sharded_dilated_attention(q, k, v, pattern, mesh=mesh(p),
                                                   axis_name="seq", return_lse=True)
  _assert_ring_matches_reference(ring, case, pattern.causal,
                                 helpers.random_inputs(case, jnp.float32, 9 if large else 7))


@OLD_JAX
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


def test_inputs_placed_elsewhere_are_moved():
  """Eager arrays sharded on the mesh's devices in another order, or held by devices the mesh
  lacks, are moved onto the mesh (jit refuses them otherwise): the same result."""
  p, n, h, hkv, pattern = CASES["spanning_head"]
  case = helpers.Case(n, h, hkv, pattern.segment_lengths, pattern.dilation_rates)
  q, k, v, _, _ = helpers.random_inputs(case, jnp.float32, 8)
  want = sharded_dilated_attention(q, k, v, pattern, mesh=mesh(p), axis_name="seq")
  devices = jax.devices()
  other_order = jax.sharding.Mesh(np.array(devices[:p][::-1]), ("seq",))
  elsewhere = jax.device_put(q, jax.NamedSharding(other_order, jax.P(None, "seq")))
  assert not elsewhere.sharding.is_equivalent_to(jax.NamedSharding(mesh(p), jax.P(None, "seq")),
                                                 4)
  np.testing.assert_array_equal(sharded_dilated_attention(elsewhere, k, v, pattern, mesh=mesh(p),
                                                          axis_name="seq"), want)
  outside = jax.device_put(k, devices[-1])  # a device the mesh of p < 8 lacks
  np.testing.assert_array_equal(sharded_dilated_attention(q, outside, v, pattern, mesh=mesh(p),
                                                          axis_name="seq"), want)


# Each pattern, value and layout once; with `-m slow` each pattern in the other layout too.
@pytest.mark.parametrize("name,value,layout", [
    ("full", np.nan, "natural"), ("longnet", np.inf, "zigzag"),
    pytest.param("full", np.inf, "zigzag", marks=pytest.mark.slow),
    pytest.param("longnet", np.nan, "natural", marks=pytest.mark.slow)])
def test_non_finite_key_reaches_only_its_rows(name, value, layout):
  """A NaN or inf key in a causal ring leaves the rows that cannot see it as one device
  computes them (the gathered rings hide later blocks by their lse: the merge must not weigh
  their NaN outputs by 0), also in zigzag order; the rows that read it are the same."""
  n, bad = 1024, 700
  rng = np.random.default_rng(7)
  q, k, v = (jnp.asarray(rng.standard_normal((1, n, 2, 16)), jnp.float32) for _ in range(3))
  pattern = (DilatedPattern((n,), (1,), causal=True) if name == "full" else
             DilatedPattern((128, 512, 1024), (1, 2, 4), causal=True))
  k_bad = k.at[0, bad, 0, 3].set(value)
  one = np.asarray(dilated_attention(q, k_bad, v, pattern))
  assert np.isfinite(one[0, :bad]).all()
  assert np.isnan(one[0, bad, 0]).all() or value == np.inf  # (a sign may hide it)
  perm = zigzag_positions(n, 4) if layout == "zigzag" else np.arange(n)
  out = sharded_dilated_attention(q[:, perm], k_bad[:, perm], v[:, perm], pattern,
                                  mesh=mesh(4), axis_name="seq", layout=layout)
  out = np.asarray(out)[:, np.argsort(perm)]
  np.testing.assert_array_equal(np.isfinite(out), np.isfinite(one))
  np.testing.assert_allclose(out[0, :bad], one[0, :bad], rtol=1e-5, atol=1e-6)


def test_bf16_local_partial_merges_with_the_rings(monkeypatch):
  """bf16, 1024 tokens a shard on 4 devices: the local branch's call returns its partial and
  gradients in bf16, which merge with a sub-ring's and a gathered compact ring's float32
  ones; output, lse and gradients against the float64 reference."""
  merged = []
  monkeypatch.setattr(ring_module, "merge", lambda outs, lses: (
      merged.append(tuple(str(o.dtype) for o in outs)), merge(outs, lses))[1])
  p, n = 4, 4096
  pattern = DilatedPattern((512, 2048, 4096), (1, 2, 4), causal=True)
  assert {(plan.kind, plan.compact, plan.gatherable)
          for plan in _plans(pattern, n // p, p, 2, 2)} == {
              ("local", False, False), ("ring", False, False), ("ring", True, True)}
  case = helpers.Case(n, 2, 1, pattern.segment_lengths, pattern.dilation_rates)
  inputs = helpers.random_inputs(case, jnp.bfloat16, 11)
  ring = lambda q, k, v: sharded_dilated_attention(q, k, v, pattern, mesh=mesh(p),
                                                   axis_name="seq", return_lse=True)
  (out, lse), grads = helpers.with_grads(ring)(*inputs[:3], tuple(inputs[3:]))
  helpers.check_result(case, True, jnp.bfloat16, inputs, out, lse, grads)
  assert ("bfloat16", "float32", "float32") in merged, merged  # the call's merge


_collectives = helpers.ring_collectives


def test_local_patterns_send_nothing():
  assert _collectives(DilatedPattern((8, 16), (1, 2), causal=True)) == []


def test_local_branches_run_as_one_call(monkeypatch):
  """The local branches of a shard go to their backend together (one launch where it
  schedules them together), the spanning one on its own; gradients through both."""
  from hilbert_ring_jax.backends import xla  # pylint: disable=g-import-not-at-top
  # Shards of 32: w = 4 and 8 are local, w = 64 rings over both shards.
  p, n, h, hkv, pattern = 2, 64, 4, 2, DilatedPattern((4, 8, 64), (1, 2, 4), causal=True)
  calls = []
  for name in ("forward", "backward"):
    fn = getattr(xla, name)
    monkeypatch.setattr(xla, name, lambda *a, fn=fn, name=name, **kw: (
        calls.append((name, kw.get("branches"))), fn(*a, **kw))[1])
  case = helpers.Case(n, h, hkv, pattern.segment_lengths, pattern.dilation_rates)
  ring = lambda q, k, v: sharded_dilated_attention(q, k, v, pattern, mesh=mesh(p),
                                                   axis_name="seq", return_lse=True,
                                                   implementation="xla")
  _assert_ring_matches_reference(ring, case, True, helpers.random_inputs(case, jnp.float32, 11))
  local = [br.index for br in pattern.layout(n, h) if (n // p) % br.w == 0]
  assert len(local) > 1
  # (each pass traced once or more: every call that touches a local branch takes them all)
  assert {c for c in calls if set(c[1] or ()) & set(local)} == {
      ("forward", tuple(local)), ("backward", tuple(local))}


@pytest.mark.parametrize("heads,kv_heads", [(8, 2), (4, 1)])
def test_uncompacting_is_the_exact_transpose_of_compacting(heads, kv_heads):
  """A compact ring's gradients go back to the full layout by `_uncompact` (one select per
  element and query head sharing a key head): exactly `jax.vjp` of `_compact`, for the key
  heads (grouped queries added up) and the query heads, dilated branches of several rates."""
  per_kv = heads // kv_heads
  # pylint: disable-next=protected-access
  compact, uncompact = ring_module._compact, ring_module._uncompact
  for branch in DilatedPattern((32, 64), (2, 8)).layout(64, heads):
    for x_heads, head_of, per in ((kv_heads, lambda h: h // per_kv, per_kv),
                                  (heads, lambda h: h, 1)):
      fold = functools.partial(compact, branch=branch, head_of=head_of)
      like = jnp.zeros((2, 64, x_heads, 3), jnp.float32)
      y = jax.random.normal(jax.random.PRNGKey(branch.index), jax.eval_shape(fold, like).shape)
      want = jax.jit(lambda y, fold=fold: jax.vjp(fold, like)[1](y)[0])(y)
      got = jax.jit(functools.partial(uncompact, branch=branch, out_heads=x_heads, per_kv=per))(y)
      assert got.shape == want.shape
      np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_zigzag_sub_rings_of_two_move_only_odd_chunks(monkeypatch):
  """A causal sub-ring of 2 shards in zigzag order (chunks 0, 1 | 2, 3 -> 0, 3 | 1, 2)
  swaps only the odd chunks: one collective-permute for each of q, k, v and o (not two;
  lse, unused, is not sent), besides the step's rotation of k and v. A permute that moves
  nothing still synchronises the devices (docs/performance.md, "Measurements behind design
  choices", the row "ring: zigzag permutes that move nothing")."""
  monkeypatch.setattr(ring_module, "SMALL_STEP_ROWS", 0)  # 16 rows a shard: zigzag order
  found = _collectives(DilatedPattern((32,), (1,), causal=True))  # 16 tokens a shard
  assert {kind for _, kind in found} == {"collective-permute"}
  # q, k, v, o: half-shards of 8 rows; the rotation: whole shards of k and v.
  assert sorted(re.sub(r"\{.*\}", "", shape) for shape, _ in found) == sorted(
      ["f32[1,8,2,16]"] * 4 + ["f32[1,16,2,16]"] * 2)


def test_small_causal_rings_move_only_keys():
  """Small causal rings keep natural order (`SMALL_STEP_ROWS`): no queries or outputs
  travel. A sub-ring of 2 shards shifts k and v once (one collective-permute each, to the
  later shard only); a ring over the whole axis gathers them (one all-gather each)."""
  found = _collectives(DilatedPattern((32, 64), (1, 1), causal=True))  # 16 tokens a shard
  assert sorted((re.sub(r"\{.*\}", "", shape), kind) for shape, kind in found) == sorted(
      [("f32[1,16,2,16]", "collective-permute")] * 2 + [("f32[1,64,2,16]", "all-gather")] * 2)


@pytest.mark.parametrize("causal", [False, True])
def test_compact_rings_move_keys_and_values_as_one_buffer(causal):
  """A compact ring (residue rows) moves k and v, and sends dk and dv home, as one buffer
  joined along the head dim (16 + 16): each collective synchronises the devices. A sub-ring
  of 2 shards (w = 32, r = 2) permutes them, the ring over all 4 (w = 64, r = 4) gathers
  them: one collective each in the forward, and none in the backward moves a lone one."""
  pattern = DilatedPattern((32, 64), (2, 4), causal=causal)  # 16 tokens a shard, 4 heads
  found = _collectives(pattern, h=4, hkv=4)
  assert sorted(kind for _, kind in found) == ["all-gather", "collective-permute"], found
  backward = _collectives(pattern, h=4, hkv=4, grad=True)
  assert {kind for _, kind in backward} == {"all-gather", "collective-permute",
                                            "reduce-scatter"}, backward
  assert all(re.fullmatch(r"f32\[.*,32\](\{.*\})?", shape) for shape, _ in found + backward), \
      found + backward


@pytest.mark.parametrize("gathered", [True, False])
def test_compact_zigzag_rings_move_keys_and_values_as_one_buffer(monkeypatch, gathered):
  """In zigzag order too (a causal ring of 4, no ring small), gathered or rotating, a compact
  ring joins k and v (16 + 16): the forward's only 16-wide collectives are the queries' and
  outputs' moves (two half-shard chunks each way); k, v enter zigzag order as one buffer (two
  half-shard permutes), and dk, dv leave it, or are reduce-scattered, as one."""
  monkeypatch.setattr(ring_module, "SMALL_STEP_ROWS", 0)
  monkeypatch.setattr(ring_module, "GATHER_LIMIT_BYTES", None if gathered else 0)
  pattern = DilatedPattern((64,), (4,), causal=True)  # 16 tokens a shard, 4 rows a head
  width = lambda shape: int(re.sub(r"\{.*\}", "", shape).rstrip("]").split(",")[-1])
  found = _collectives(pattern, h=4, hkv=4)
  assert [kind for shape, kind in found if width(shape) == 16] == ["collective-permute"] * 4
  backward = _collectives(pattern, h=4, hkv=4, grad=True)
  joined = [kind for shape, kind in backward if width(shape) == 32]
  if gathered:
    assert sorted(set(joined)) == ["all-gather", "reduce-scatter"], backward
    assert all(width(shape) == 32 for shape, kind in backward if kind != "collective-permute")
  else:  # k, v into zigzag order in the forward and again in the backward, dk, dv out of
    # it: half-shard chunks of 2 rows a head
    assert sum(shape.startswith("f32[1,2,4,32]") for shape, _ in backward) == 6, backward


@pytest.mark.parametrize("segment,causal", [(32, False), (32, True), (64, False)])
def test_ring_backward_sends_each_steps_key_gradients_home_once(monkeypatch, segment, causal):
  """A rotating ring's backward moves k, v as its forward does and sends each step's dk, dv
  straight back to the keys' device, one move of the pair a step (accumulators travelling
  with the keys took `g` hops): sub-rings of 2 shards (causal: k, v go to the later shard
  only, dk, dv come back from it only), and a ring of 4 rotating its keys."""
  monkeypatch.setattr(ring_module, "GATHER_LIMIT_BYTES", 0)
  moves, permute = [], jax.lax.ppermute
  monkeypatch.setattr(jax.lax, "ppermute", lambda x, axis_name, perm: (
      moves.append((len(jax.tree.leaves(x)), sorted(perm))), permute(x, axis_name, perm))[1])
  pattern = DilatedPattern((segment,), (1,), causal=causal)  # 16 tokens a shard
  spec, x = jax.P(None, "seq"), jax.ShapeDtypeStruct((1, 64, 2, 16), jnp.float32)
  f = jax.shard_map(lambda q, k, v: ring_dilated_attention(q, k, v, pattern, axis_name="seq"),
                    mesh=mesh(4), in_specs=(spec,) * 3, out_specs=spec)
  jax.eval_shape(jax.grad(lambda *a: f(*a).sum(), (0, 1, 2)), x, x, x)
  g = segment // 16
  ring = lambda hop: sorted((b + j, b + (j + hop) % g) for b in range(0, 4, g) for j in range(g))
  there = [(0, 1), (2, 3)] if causal else ring(1)
  back = lambda hop: [(1, 0), (3, 2)] if causal else ring(-hop)
  # k and v (dk and dv) each a permute of their own: uncompacted, they are the inputs, which
  # a ring does not copy into one buffer (`ring._together`).
  pair = lambda perm: [(1, perm)] * 2
  assert moves == pair(there) * (g - 1) + [m for hop in range(1, g)
                                            for m in pair(there) + pair(back(hop))], moves


def test_small_steps_are_selected_not_branched():
  """A causal ring outside zigzag order skips the steps a device does not see with a
  `lax.cond` (a host round trip on GPUs), except where its steps are small: computed and
  selected instead."""
  p, n, h, hkv, pattern = CASES["causal_without_zigzag"]
  spec, x = jax.P(None, "seq"), jax.ShapeDtypeStruct((1, n, h, 16), jnp.float32)
  f = lambda q, k, v: ring_dilated_attention(q, k, v, pattern, axis_name="seq")
  jaxpr = lambda: str(jax.make_jaxpr(jax.shard_map(f, mesh=mesh(p), in_specs=(spec,) * 3,
                                                   out_specs=spec))(x, x, x))
  assert " cond[" not in jaxpr()
  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(ring_module, "SMALL_STEP_ROWS", 0)
    assert " cond[" in jaxpr()


@pytest.mark.parametrize("rotate", [False, True])
def test_spanning_branches_send_only_dilated_rows(monkeypatch, rotate):
  """A non-causal ring over the whole axis gathers its keys at once (`GATHER_LIMIT_BYTES`
  allowing) or rotates them (a limit of 0); either way only the residue rows travel."""
  if rotate:
    monkeypatch.setattr(ring_module, "GATHER_LIMIT_BYTES", 0)
  kind, hops = ("collective-permute", 1) if rotate else ("all-gather", 4)
  # n = 16 tokens per shard; w = 64 spans all 4 shards; r = 4 with one kv head per query
  # head: k and v of 16 / 4 = 4 rows for each of the 2 heads travel, as one buffer of head
  # dim 16 + 16 (an all-gather's result holds those of the 4 shards).
  found = _collectives(DilatedPattern((64,), (4,)))
  assert found and {k for _, k in found} == {kind}
  for shape, _ in found:
    assert re.fullmatch(rf"(\(?f32\[1,{4 * hops},2,32\][^ ]*,? ?)+\)?", shape), shape
  # Undilated: the whole shard travels.
  for shape, _ in _collectives(DilatedPattern((64,), (1,))):
    assert f"f32[1,{16 * hops},2,16]" in shape, shape


@pytest.mark.parametrize("name", ["GATHER_LIMIT_BYTES", "SMALL_STEP_ROWS"])
def test_bad_settings_raise_naming_them(monkeypatch, name):
  x = jnp.zeros((1, 32, 2, 8))
  pattern = DilatedPattern((8, 32), (1, 2), causal=True)  # a ring of 4 shards
  for bad in (-1, 1.5, "4096", True):
    monkeypatch.setattr(ring_module, name, bad)
    with pytest.raises(ValueError, match=f"ring.{name} must be an int >= 0"):
      sharded_dilated_attention(x, x, x, pattern, mesh=mesh(4), axis_name="seq")
    with pytest.raises(ValueError, match=f"ring.{name}"):
      jax.eval_shape(jax.shard_map(
          lambda q, k, v: ring_dilated_attention(q, k, v, pattern, axis_name="seq"),
          mesh=mesh(4), in_specs=(jax.P(None, "seq"),) * 3, out_specs=jax.P(None, "seq")),
          x, x, x)


def test_gather_limit_default_follows_device_memory(monkeypatch):
  """`GATHER_LIMIT_BYTES=None`: 12 GiB, or a sixth of what JAX may allocate on a device
  where that is less (none reported, as on CPUs: 12 GiB); a number is taken as it is."""
  def device_with(stats):
    monkeypatch.setattr(ring_module.jax, "local_devices",
                        lambda: [types.SimpleNamespace(memory_stats=lambda: stats)])

  monkeypatch.setattr(ring_module, "GATHER_LIMIT_BYTES", None)
  for stats, limit in (({"bytes_limit": 60 << 30}, 10 << 30),
                       ({"bytes_limit": 105 << 30}, 12 << 30), (None, 12 << 30)):
    device_with(stats)
    assert ring_module._gather_limit() == limit  # pylint: disable=protected-access
  monkeypatch.setattr(ring_module, "GATHER_LIMIT_BYTES", 123)
  assert ring_module._gather_limit() == 123  # pylint: disable=protected-access


@OLD_JAX
def test_sequence_not_divisible_raises():
  x = jnp.zeros((1, 30, 2, 8))
  with pytest.raises(ValueError, match="axis_name"):
    sharded_dilated_attention(x, x, x, DilatedPattern((8,), (1,)), mesh=mesh(4), axis_name="seq")
  with pytest.raises(ValueError, match="axis_name"):
    sharded_dilated_attention(x, x, x, DilatedPattern((8,), (1,)), mesh=mesh(2), axis_name="s")


def test_each_step_takes_the_first_backend_that_runs_it(monkeypatch):
  """A backend that declines some of a branch's steps (here: rows not in whole blocks of 512,
  like a GPU kernel's blocks) runs the steps it supports; the others go to the next
  candidate, forward and backward, and the ring still computes the function."""
  from hilbert_ring_jax import backends  # pylint: disable=g-import-not-at-top
  from hilbert_ring_jax.backends import base  # pylint: disable=g-import-not-at-top
  seen = []

  def supports(problem):
    return base.Support(problem.q_shape[1] % 512 == 0, "rows of whole blocks of 512")

  def record(name):
    def run(q, *args, **kwargs):
      seen.append((name, q.shape[1]))
      return getattr(xla, name)(q, *args, **kwargs)
    return run

  picky = types.SimpleNamespace(Config=xla.Config, supports=supports,
                                forward=record("forward"), backward=record("backward"))
  load = base.load
  for module in (base, backends):
    monkeypatch.setattr(module, "load", lambda name: picky if name == "triton" else load(name))
  # 512 tokens a shard: 512/1 local (the picky backend), 2048/2 a compact ring of steps of
  # 256 residue rows (declined: "xla").
  pattern = DilatedPattern((512, 2048), (1, 2), causal=True)
  case = helpers.Case(2048, 2, 2, pattern.segment_lengths, pattern.dilation_rates, head_dim=8)
  q, k, v, *_ = inputs = helpers.random_inputs(case, jnp.float32, 24)
  ring = lambda q, k, v: sharded_dilated_attention(
      q, k, v, pattern, mesh=mesh(4), axis_name="seq", return_lse=True,
      implementation=("triton", "xla"))
  _assert_ring_matches_reference(ring, case, True, inputs)
  assert set(seen) == {("forward", 512), ("backward", 512)}, seen
  with pytest.raises(NotImplementedError, match="whole blocks of 512"):
    jax.eval_shape(lambda q, k, v: sharded_dilated_attention(
        q, k, v, pattern, mesh=mesh(4), axis_name="seq", implementation="triton"), q, k, v)


@pytest.mark.parametrize("segments,rates,rotate", [((512, 2048), (1, 2), True),
                                                  ((512, 2048), (1, 2), False),
                                                  ((256, 512), (1, 2), False)])
def test_steps_get_ring_step_config_and_local_dtypes(monkeypatch, segments, rates, rotate):
  """Ring steps run with the backend's `ring_step_config` (the keys of the next step travel
  beside them); local steps, and the one call of a ring that gathers its keys first, with
  the caller's config; the local call gets `out_dtype` / `grad_dtype` = q's dtype, whether it
  is the whole result or a partial merged with the rings' (no float32 copy of its output and
  gradients on the device), the other steps float32 partials."""
  if rotate:
    monkeypatch.setattr(ring_module, "GATHER_LIMIT_BYTES", 0)
  from hilbert_ring_jax import backends  # pylint: disable=g-import-not-at-top
  from hilbert_ring_jax.backends import base  # pylint: disable=g-import-not-at-top
  seen, ring_config = [], xla.Config(key_block=256)

  def record(name):
    def run(q, *args, config=None, **kwargs):
      dtype = kwargs.get("out_dtype" if name == "forward" else "grad_dtype")
      seen.append((name, config is ring_config, None if dtype is None else str(dtype)))
      return getattr(xla, name)(q, *args, config=config, **kwargs)
    return run

  stepper = types.SimpleNamespace(Config=xla.Config, supports=xla.supports,
                                  ring_step_config=lambda config: ring_config,
                                  forward=record("forward"), backward=record("backward"))
  load = base.load
  for module in (base, backends):
    monkeypatch.setattr(module, "load", lambda name: stepper if name == "xla" else load(name))
  # 512 tokens a shard: (512, 2048) x (1, 2) is a local branch and a ring; (256, 512) all local.
  pattern = DilatedPattern(segments, rates)
  case = helpers.Case(2048, 2, 1, segments, rates, head_dim=8)
  inputs = helpers.random_inputs(case, jnp.float32, 25)
  ring = lambda q, k, v: sharded_dilated_attention(
      q, k, v, pattern, mesh=mesh(4), axis_name="seq", return_lse=True, implementation="xla")
  _assert_ring_matches_reference(ring, case, False, inputs)
  if segments[-1] > 512:
    assert set(seen) == {("forward", False, "float32"), ("backward", False, "float32"),
                         ("forward", rotate, None), ("backward", rotate, None)}, seen
  else:
    assert set(seen) == {("forward", False, "float32"), ("backward", False, "float32")}, seen


def _ring_step_problems(monkeypatch, pattern, shards, q_shape, kv_shape, dtype):
  """The problems the ring's steps resolve a backend for (traced with "xla", not run)."""
  from hilbert_ring_jax import backends  # pylint: disable=g-import-not-at-top
  problems, resolve = [], backends.resolve
  monkeypatch.setattr(backends, "resolve",
                      lambda names, problem: (problems.append(problem), resolve(names, problem))[1])
  shapes = [jax.ShapeDtypeStruct(s, dtype) for s in (q_shape, kv_shape, kv_shape)]
  f = lambda q, k, v: sharded_dilated_attention(q, k, v, pattern, mesh=mesh(shards),
                                                axis_name="seq", implementation="xla")
  jax.eval_shape(jax.grad(lambda *x: f(*x).astype(jnp.float32).sum(), (0, 1, 2)), *shapes)
  monkeypatch.undo()
  return problems


def _random_ring_configs(count, seed):
  """Configurations users run on GPUs that the mosaic kernels run on one device: head dims
  64/128, 2-8 shards of 256-2048 tokens, LongNet-like patterns of 1-3 branches, causal or
  not, offsets, GQA."""
  from hilbert_ring_jax.backends import mosaic  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(seed)
  configs = []
  while len(configs) < count:
    shards, per = int(rng.choice([2, 4, 8])), int(rng.choice([256, 512, 1024, 2048]))
    n = shards * per
    k = int(rng.integers(1, 4))
    segments = sorted(int(x) for x in rng.choice([256, 512, 1024, 2048, 4096, 8192, n], k,
                                                 replace=False) if x <= n)
    if not segments:
      continue
    rates = [int(rng.choice([r for r in (1, 2, 4, 8) if r <= w // 64])) for w in segments]
    h = int(rng.choice([2, 4, 8]))
    hkv = int(rng.choice([x for x in (1, 2, h) if h % x == 0]))
    pattern = DilatedPattern(tuple(segments), tuple(rates), causal=bool(rng.integers(2)),
                             offsets=str(rng.choice(["head", "all"])))
    d = int(rng.choice([64, 128]))
    if mosaic.geometry_problem(pattern, n, h, hkv, None, mosaic.Config().resolved(d)) is None:
      configs.append((pattern, shards, (1, n, h, d), hkv))
  return configs


@pytest.mark.parametrize("pattern,shards,q_shape,hkv", [
    # The configuration the default dispatch refused on 4 GPUs (2026-11-26).
    (DilatedPattern((256, 512, 1024), (1, 1, 4), causal=True), 4, (1, 2048, 2, 64), 1),
    # Six drawn (each traces a ring's two passes): 2 and 8 shards (4 above), 1 and 2
    # branches (3 above), causal or not, both offsets, MQA and GQA, head dims 64 and 128.
    *_random_ring_configs(6, 5),
])
@pytest.mark.parametrize("order", ["natural", "zigzag"])
def test_mosaic_runs_every_ring_step_it_runs_on_one_device(monkeypatch, pattern, shards,
                                                           q_shape, hkv, order):
  """Wherever the mosaic kernels' geometry takes the whole problem on one device, it takes
  every step the ring makes of it (zigzag half-shards and compact residue rows included,
  partial row blocks in one-segment steps), forward and backward: no refusal on a mesh.
  The shards here are small (natural order); "zigzag": no ring is small."""
  from hilbert_ring_jax.backends import mosaic  # pylint: disable=g-import-not-at-top
  if order == "zigzag":
    monkeypatch.setattr(ring_module, "SMALL_STEP_ROWS", 0)
  b, n, h, d = q_shape
  config = mosaic.Config().resolved(d)
  assert mosaic.geometry_problem(pattern, n, h, hkv, None, config, b) is None
  problems = _ring_step_problems(monkeypatch, pattern, shards, q_shape, (b, n, hkv, d),
                                 jnp.bfloat16)
  assert problems
  for p in problems:
    why = mosaic.geometry_problem(p.pattern, p.q_shape[1], p.q_shape[2], p.kv_shape[2],
                                  p.branches, config, p.q_shape[0])
    assert why is None, (p.q_shape, p.pattern, p.branches, why)


# Data x sequence meshes at small sizes, both axis types (the realistic cases add two more).
DATA_SEQ = [("gather_fallback", 2, EXPLICIT), ("partial_non_causal", 2, AUTO),
            ("full_attention_p2", 4, EXPLICIT)]


@pytest.mark.parametrize("name,data,axis_type", DATA_SEQ,
                         ids=[f"{n}-data{d}-{t.name}" for n, d, t in DATA_SEQ])
def test_data_and_sequence_parallel(name, data, axis_type):
  p, n, h, hkv, pattern = CASES[name]
  case = helpers.Case(n, h, hkv, pattern.segment_lengths, pattern.dilation_rates,
                      pattern.offsets, pattern.head_groups, batch=2 * data)
  inputs = helpers.random_inputs(case, jnp.float32, 13)
  mesh = jax.make_mesh((data, p), ("data", "seq"), axis_types=(axis_type,) * 2,
                       devices=jax.devices()[:data * p])
  ring = lambda q, k, v: sharded_dilated_attention(q, k, v, pattern, mesh=mesh, axis_name="seq",
                                                   batch_axis="data", return_lse=True)
  rout = _assert_ring_matches_reference(ring, case, pattern.causal, inputs)
  assert rout.sharding.spec[:2] == ("data", "seq")


@OLD_JAX
def test_eager_call_compiles_once():
  """Called without jit, the ring runs as one cached program, not op by op."""
  p, n, h, hkv, pattern = CASES["full_attention_p2"]
  case = helpers.Case(n, h, hkv, pattern.segment_lengths, pattern.dilation_rates)
  q, k, v, *_ = helpers.random_inputs(case, jnp.float32, 14)
  call = lambda: sharded_dilated_attention(q, k, v, pattern, mesh=mesh(p), axis_name="seq")
  first = call()
  before = ring_module._sharded.cache_info()
  np.testing.assert_array_equal(call(), first)
  after = ring_module._sharded.cache_info()
  assert (after.hits, after.misses) == (before.hits + 1, before.misses)


@OLD_JAX
def test_bad_batch_axis():
  x = jnp.zeros((3, 32, 2, 8))
  m = jax.make_mesh((2, 4), ("data", "seq"), axis_types=(AUTO, AUTO))
  for batch_axis in ("model", "seq", 5, ("data", 5)):
    with pytest.raises(ValueError, match="batch_axis"):
      sharded_dilated_attention(x, x, x, DilatedPattern((8,), (1,)), mesh=m, axis_name="seq",
                                batch_axis=batch_axis)
  with pytest.raises(ValueError, match="batch size 3"):
    sharded_dilated_attention(x, x, x, DilatedPattern((8,), (1,)), mesh=m, axis_name="seq",
                              batch_axis="data")
  for bad in (None, {"seq": 4}, "seq"):
    with pytest.raises(ValueError, match="mesh must be a jax.sharding.Mesh"):
      sharded_dilated_attention(x, x, x, DilatedPattern((8,), (1,)), mesh=bad, axis_name="seq")


# (B, N per GPU, H, Hkv, D, pattern with N = P x N per GPU): what a user runs on GPUs.
GPU_CASES = {
    "full": (1, 8192, 4, 4, 128, lambda n: DilatedPattern((n,), (1,))),
    "full_causal_gqa": (1, 8192, 4, 2, 128, lambda n: DilatedPattern((n,), (1,), causal=True)),
    "longnet_causal_d64": (1, 8192, 4, 4, 64, lambda n: DilatedPattern(
        (2048, 4096, 8192), (1, 2, 4), causal=True)),
    "lm_preset": (2, 8192, 6, 2, 128, lambda n: DilatedPattern(
        (512, 2048, 8192), (1, 4, 16), causal=True, offsets="all")),
    # Refused by the default dispatch on 4 GPUs (2026-11-26): compact zigzag half-shards of
    # 64 residue rows (here on 2 GPUs: the same steps).
    "short_compact_steps": (1, 512, 2, 1, 64, lambda n: DilatedPattern(
        (256, 512, 2 * 512), (1, 1, 4), causal=True)),
}


def _check_ring_on_gpus(b, n, h, hkv, d, pattern, implementation=None, data=1,
                        layout="natural"):
  """The ring over every GPU of the host (a (data, seq) mesh, the batch over "data"), bf16,
  against one GPU's float32 "xla" result: outputs, lse and gradients (`layout="zigzag"`: the
  ring on the sequence in zigzag order, the reference's results in it too). Returns the
  mosaic forward launches traced (the gathering kernel's included)."""
  # pylint: disable-next=g-import-not-at-top
  from hilbert_ring_jax.backends import mosaic_forward, mosaic_gather
  gpus = jax.devices("gpu")
  case = helpers.Case(n, h, hkv, pattern.segment_lengths, pattern.dilation_rates,
                      pattern.offsets, head_dim=d, batch=b)
  natural = helpers.random_inputs(case, jnp.bfloat16, 3)
  perm = zigzag_positions(n, len(gpus) // data) if layout == "zigzag" else np.arange(n)
  q, k, v, dout, dlse = (x[:, perm] for x in natural)  # in the ring's order
  launches = []
  with pytest.MonkeyPatch.context() as patch:
    for module, name in ((mosaic_forward, "launch"), (mosaic_gather, "gathered_forward")):
      patch.setattr(module, name, lambda *a, f=getattr(module, name), **kw: (
          launches.append(1), f(*a, **kw))[1])
    jax.clear_caches()
    gpu_mesh = jax.make_mesh((data, len(gpus) // data), ("data", "seq"),
                             axis_types=(AUTO, AUTO), devices=gpus)
    ring = jax.jit(lambda q, k, v: sharded_dilated_attention(
        q, k, v, pattern, mesh=gpu_mesh, axis_name="seq", return_lse=True,
        batch_axis="data" if data > 1 else None, implementation=implementation,
        layout=layout))
    (out, lse), vjp = jax.vjp(ring, q, k, v)
    grads = vjp((dout, dlse))
  f32 = lambda *xs: [jax.device_put(x.astype(jnp.float32), gpus[0]) for x in xs]
  single = lambda q, k, v: dilated_attention(q, k, v, pattern, return_lse=True,
                                             implementation="xla")
  (ref_out, ref_lse), ref_vjp = jax.vjp(single, *f32(*natural[:3]))
  ref_grads = ref_vjp(tuple(f32(*natural[3:])))
  ref_out, ref_lse, *ref_grads = (np.asarray(x, np.float64)[:, perm]
                                  for x in (ref_out, ref_lse, *ref_grads))
  tol = helpers.TOL[jnp.bfloat16]
  assert out.dtype == jnp.bfloat16
  assert helpers.rel_err(out, ref_out) < tol
  helpers.check_lse(lse, ref_lse, tol)
  for g, ref in zip(grads, ref_grads):
    assert g.dtype == jnp.bfloat16 and helpers.rel_err(g, ref) < tol
  return launches


def _gpus():
  gpus = jax.devices("gpu")
  if len(gpus) < 2:
    pytest.skip("needs two GPUs")
  return gpus


@pytest.mark.gpu
@pytest.mark.parametrize("name", GPU_CASES)
def test_ring_on_gpus(name):
  """Each step on the default backend ("mosaic" on Hopper: its float32 partials and
  gradients) (`run_gpu.sh tests-ring`; needs two GPUs)."""
  p = len(_gpus())
  b, per_gpu, h, hkv, d, make = GPU_CASES[name]
  launches = _check_ring_on_gpus(b, p * per_gpu, h, hkv, d, make(p * per_gpu))
  if hopper.is_hopper():
    assert launches, "no step ran the mosaic kernels"


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["full_causal_gqa", "longnet_causal_d64"])
def test_ring_on_zigzag_shards_of_gpus(name):
  """`layout="zigzag"`: the whole causal ring on the shards as they are, and (LongNet) beside
  branches moved into natural order and back."""
  p = len(_gpus())
  b, per_gpu, h, hkv, d, make = GPU_CASES[name]
  _check_ring_on_gpus(b, p * per_gpu, h, hkv, d, make(p * per_gpu), layout="zigzag")


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["full", "longnet_causal_d64"])
def test_ring_on_a_data_by_sequence_mesh_of_gpus(name):
  """A (data 2, seq P/2) mesh: each sub-ring's permutes are disjoint cycles, the shape
  openxla/xla#45222 reports zeros for (needs four GPUs)."""
  p = len(_gpus())
  if p < 4 or p % 2:
    pytest.skip("needs an even number of GPUs, at least four")
  _, per_gpu, h, hkv, d, make = GPU_CASES[name]
  n = p // 2 * per_gpu
  _check_ring_on_gpus(2, n, h, hkv, d, make(n), data=2)


@pytest.mark.gpu
@pytest.mark.parametrize("index", range(4))
def test_ring_random_configurations_on_gpus_mosaic_only(index):
  """Configurations the mosaic kernels run on one GPU run on the ring with
  `implementation="mosaic"` alone (no step declined), exact. One case each (every case
  compiles its own kernels: six in one test ran past 260 s on 4 GPUs)."""
  p = len(_gpus())
  if not hopper.is_hopper():
    pytest.skip("needs Hopper GPUs")
  configs = [c for c in _random_ring_configs(60, 6) if c[1] == p]
  assert len(configs) > index
  pattern, _, (b, n, h, d), hkv = configs[index]
  assert _check_ring_on_gpus(b, n, h, hkv, d, pattern, implementation="mosaic")

# Shard sizes users run: >= 1024 keys per device, so every step walks several key blocks
# ("xla": 512 keys a block by default; the cases marked 128 ask for blocks of 128 so that
# short compact and zigzag steps walk several too). Heads and head dims stay small for CI,
# and each case adds a plan kind or a mesh the others lack. Their steps are small, so their
# causal rings keep natural order; a name ending in "_large" runs its case with no ring small
# (`SMALL_STEP_ROWS = 0`, as rings of 4096 rows a shard and more run: zigzag order where the
# half-shards allow it, else a conditional per step).
# (data, seq, tokens per device, H, Hkv, pattern over N = seq x tokens, key block or None)
REALISTIC = {
    # Ring attention itself, on 4 devices (8 did 4x the work through the same code; rings of 8
    # shards: SMALL's spanning_all_gqa, and 8 devices in data2_seq4_causal).
    "full": (1, 4, 1024, 2, 1, lambda n: DilatedPattern((n,), (1,)), None),
    # Compact sub-rings of two shards (zigzag: two key blocks a half-shard step; a compact ring
    # over all shards, 4096 / 4 here before: the user's shard_map case, 8192 / 4).
    "longnet_causal": (1, 4, 1024, 2, 2, lambda n: DilatedPattern(
        (1024, 2048), (1, 2), causal=True), 128),
    "longnet_gqa": (1, 4, 1024, 4, 2, lambda n: DilatedPattern(
        (1024, 2048, 4096), (1, 2, 4)), None),
    "gather": (1, 4, 1024, 2, 1, lambda n: DilatedPattern((512, 1536), (1, 3), causal=True),
               None),
    "partial_sub_rings_r16": (1, 4, 1200, 1, 1, lambda n: DilatedPattern(
        (3600,), (16,), causal=True, offsets="all"), 128),
    # Compact: a sub-ring of two shards beside a whole ring of four, which "_large" gathers
    # in zigzag order (k and v as one buffer), 256 residue rows a shard.
    "longnet_causal_whole": (1, 4, 1024, 2, 2, lambda n: DilatedPattern(
        (1024, 2048, 4096), (1, 2, 4), causal=True), 128),
    # A sub-ring of two shards (2048 / 1) beside a whole ring, gathered (4096 / 2).
    "data2_seq4_causal": (2, 4, 1024, 2, 1, lambda n: DilatedPattern(
        (1024, 2048, 4096), (1, 1, 2), causal=True), None),
}


def _realistic(name, monkeypatch):
  """`(case, pattern, mesh, config)` of a REALISTIC name (with "_large": no ring small, the
  setting patched for the test)."""
  if name.endswith("_large"):
    name = name[:-len("_large")]
    monkeypatch.setattr(ring_module, "SMALL_STEP_ROWS", 0)
  *problem, key_block = REALISTIC[name]
  case, pattern, m = helpers.ring_problem(*problem)
  config = None if key_block is None else xla.Config(key_block=key_block)
  return case, pattern, m, config


# The names the tests below run, on the ring alone and packed.
RUN = [*(name for name in REALISTIC if name not in ("longnet_causal", "partial_sub_rings_r16",
                                                    "longnet_causal_whole")),
       "partial_sub_rings_r16_large", "longnet_causal_whole_large"]
RUN_PACKED = ["longnet_causal_large", "longnet_gqa", "gather", "partial_sub_rings_r16",
              "data2_seq4_causal", "data2_seq4_causal_large"]


def test_realistic_cases_cover_every_plan(monkeypatch):
  """(kind, compact, zigzag, partial sub-rings, gathered whole, causal, small): every plan
  runs, and every causal one packed too."""
  kinds = {False: set(), True: set()}
  for packed, names in ((False, RUN), (True, RUN_PACKED)):
    for name in names:
      with monkeypatch.context() as patch:
        case, pattern, m, _ = _realistic(name, patch)
        seq = m.shape["seq"]
        for plan in _plans(pattern, case.n // seq, seq, case.heads, case.heads // case.kv_heads):
          kinds[packed].add((plan.kind, plan.compact, plan.zigzag, plan.shards % plan.span != 0,
                             plan.gatherable, plan.branch.causal, plan.small))
  small = {("local", False, False, False, False, True),
           ("gather", False, False, False, False, True), ("ring", False, False, False, True, False),
           ("ring", False, False, False, False, True), ("ring", False, False, False, True, True),
           ("ring", False, False, True, False, True)}
  large = {("ring", True, True, False, False, True), ("ring", False, True, False, False, True),
           ("ring", False, True, False, True, True), ("ring", False, False, True, False, True)}
  want = {(*kind, False) for kind in small if kind[0] != "ring"} | {
      (*kind, True) for kind in small if kind[0] == "ring"} | {(*kind, False) for kind in large}
  assert want <= kinds[False] | kinds[True], want - kinds[False] - kinds[True]
  causal = {kind for kind in want if kind[-2]} - {("ring", False, False, True, False, True, False)}
  assert causal <= kinds[True], causal - kinds[True]  # every causal plan packed (but the cond)


# On the oldest JAX too: the plain ring and data x sequence, causal in natural order here and
# compact in zigzag order packed below (a compact ring meets it in the user's shard_map below).
# "longnet_causal" runs packed below (zigzag); without ids a compact causal ring runs in the
# user's shard_map (2048 keys a shard, blocks of 128).
# ("full_rotating" next to "full": they share one device's result where one worker runs both.)
@pytest.mark.parametrize("name", [
    pytest.param(name, marks=OLD_JAX) if name in ("full", "data2_seq4_causal") else name
    for run in RUN for name in ((run, "full_rotating") if run == "full" else (run,))])
def test_ring_at_realistic_shard_sizes(monkeypatch, name):
  """Forward, lse and gradients of the ring equal one device's, every plan kind, data x
  sequence meshes included (the scans over key blocks meet mesh-varying data here); the
  whole rings gathered ("full", "longnet_gqa"; causal: "data2_seq4_causal", in natural order,
  and packed below in zigzag order; compact in zigzag order: "longnet_causal_whole_large")
  and rotated ("full_rotating")."""
  rotating = name == "full_rotating"
  if rotating:
    monkeypatch.setattr(ring_module, "GATHER_LIMIT_BYTES", 0)
    name = "full"
  case, pattern, m, config = _realistic(name, monkeypatch)
  inputs = helpers.random_inputs(case, jnp.float32, 21)
  batch_axis = "data" if "data" in m.shape else None
  ring = jax.jit(lambda q, k, v: sharded_dilated_attention(
      q, k, v, pattern, mesh=m, axis_name="seq", batch_axis=batch_axis, return_lse=True,
      config=config))
  single = jax.jit(lambda q, k, v: dilated_attention(q, k, v, pattern, return_lse=True))
  # ("full" and "full_rotating" share one device's result: the ring settings are the ring's.)
  _assert_ring_equals(ring, single, inputs, key=(name.removesuffix("_large"), 21))
  if name.startswith(("full", "data2_seq4_causal")):  # a whole ring's keys gathered, or rotating
    assert ("all_gather" in str(jax.make_jaxpr(ring)(*inputs[:3]))) != rotating


def _documents(batch, n, seed):
  """`[B, N]` ids of documents of 1 to 3000 tokens (edges inside shards and across them)."""
  rng = np.random.default_rng(seed)
  lengths = rng.integers(1, 3000, size=(batch, n))
  return jnp.asarray(np.stack([np.repeat(np.arange(n), row)[:n] for row in lengths]),
                     jnp.int32)


# With `-m slow`: "data2_seq4_causal" (the ring small: its "_large" twin runs by default) and
# "longnet_gqa" (not causal: its plans run without ids above). On the oldest JAX: zigzag order
# with ids travelling beside the keys ("longnet_causal_large").
@pytest.mark.parametrize("name", [
    pytest.param(name, marks=OLD_JAX if name == "longnet_causal_large" else pytest.mark.slow
                 if name in ("data2_seq4_causal", "longnet_gqa") else ())
    for name in RUN_PACKED])
def test_packed_ring_at_realistic_shard_sizes(monkeypatch, name):
  """Packed sequences on the ring (the keys' document ids travel with them, or are gathered
  with them) equal one device's packed call: compact and zigzag rings, rings in natural
  order, a whole ring gathered at once, gather, partial sub-rings, data x seq."""
  case, pattern, m, config = _realistic(name, monkeypatch)
  inputs = helpers.random_inputs(case, jnp.float32, 24)
  ids = _documents(case.batch, case.n, 25)
  batch_axis = "data" if "data" in m.shape else None
  ring = jax.jit(lambda q, k, v: sharded_dilated_attention(
      q, k, v, pattern, mesh=m, axis_name="seq", batch_axis=batch_axis, segment_ids=ids,
      return_lse=True, config=config))
  single = jax.jit(lambda q, k, v: dilated_attention(q, k, v, pattern, segment_ids=ids,
                                                     return_lse=True))
  # (A case and its "_large" twin share one device's result: the ring settings are the ring's.)
  _assert_ring_equals(ring, single, inputs, key=(name.removesuffix("_large"), 24, "ids", 25))


@OLD_JAX
def test_ring_inside_user_shard_map_at_2048_keys_per_shard():
  """The inner entry in the caller's own shard_map, at a shard size users run, gradients
  through the caller's jit too: a compact causal ring over the whole axis, gathered in
  natural order, whose steps walk four key blocks of 128 (the local branch sixteen),
  outputs, lse and gradients."""
  pattern = DilatedPattern((2048, 8192), (1, 4), causal=True)
  case = helpers.Case(8192, 2, 2, pattern.segment_lengths, pattern.dilation_rates, head_dim=8)
  spec, config = jax.P(None, "seq"), xla.Config(key_block=128)
  inner = lambda q, k, v: ring_dilated_attention(q, k, v, pattern, axis_name="seq",
                                                 return_lse=True, config=config)
  f = jax.shard_map(inner, mesh=mesh(4), in_specs=(spec,) * 3, out_specs=(spec, spec))
  single = lambda q, k, v: dilated_attention(q, k, v, pattern, return_lse=True)
  _assert_ring_equals(f, single, helpers.random_inputs(case, jnp.float32, 22))


def test_layers_with_mesh_at_1024_tokens_per_device():
  """Both layers with `mesh=` at 1024 tokens per device equal the single-device layer (two
  devices: the ring itself is checked above)."""
  from flax import nnx  # pylint: disable=g-import-not-at-top
  from hilbert_ring_jax import (  # pylint: disable=g-import-not-at-top
      DilatedMultiHeadAttention, linen)
  pattern = DilatedPattern((1024, 2048), (1, 2), causal=True)
  m = mesh(2)
  x = jnp.asarray(np.random.default_rng(23).standard_normal((1, 2048, 16)), jnp.float32)
  make = lambda **kw: DilatedMultiHeadAttention(2, 16, pattern=pattern, rngs=nnx.Rngs(0), **kw)
  sharded, plain = make(mesh=m, seq_axis="seq"), make()
  np.testing.assert_allclose(jax.jit(lambda x: sharded(x))(x), jax.jit(lambda x: plain(x))(x),
                             rtol=1e-5, atol=1e-5)
  module = linen.DilatedMultiHeadAttention(num_heads=2, pattern=pattern, mesh=m, seq_axis="seq")
  single = linen.DilatedMultiHeadAttention(num_heads=2, pattern=pattern)
  params = jax.jit(single.init)(jax.random.PRNGKey(0), x[:, :1024])  # one program
  loss = lambda mod: lambda p: jnp.sum(mod.apply(p, x) ** 2)
  g, ref = (jax.jit(jax.grad(loss(mod)))(params) for mod in (module, single))
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4), g, ref)
