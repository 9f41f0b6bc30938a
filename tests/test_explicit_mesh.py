"""Arrays split over explicit mesh axes (`AxisType.Explicit`, under `jax.set_mesh`), without a
`shard_map` of the user's: `dilated_attention` runs a shard of the batch (and of the heads) at
a time and returns the sharding it was given; decoding splits the batch. Float64 reference."""

import jax
import numpy as np
import pytest

import reference_np
from hilbert_ring_jax import (DilatedMultiHeadAttention, DilatedPattern, dilated_attention,
                              dilated_attention_prefill, dilated_attention_step)

EXPLICIT = jax.sharding.AxisType.Explicit
P = jax.sharding.PartitionSpec
# Rates that do not divide the heads: each shard of the heads has its own residues.
PATTERN = DilatedPattern((16, 64), (1, 3), causal=True)


def mesh():
  return jax.make_mesh((4, 2), ("data", "model"), axis_types=(EXPLICIT,) * 2)


def inputs(batch=8, n=64, heads=4, kv_heads=2, dim=16, seed=0):
  rng = np.random.default_rng(seed)
  q = rng.standard_normal((batch, n, heads, dim)).astype(np.float32)
  k, v = (rng.standard_normal((batch, n, kv_heads, dim)).astype(np.float32) for _ in "kv")
  ids = np.repeat(rng.integers(0, 3, (batch, 4)), n // 4, axis=1).astype(np.int32)
  return q, k, v, ids


def reference(q, k, v, ids, dout):
  n, heads = q.shape[1:3]
  m = reference_np.multiplicity(n, heads, PATTERN.segment_lengths, PATTERN.dilation_rates,
                                True)[None] * reference_np.same_document(ids)
  return reference_np.attention(q, k, v, m, q.shape[-1] ** -0.5, dout, np.zeros(q.shape[:3]))


def rel(x, ref):
  return np.linalg.norm(np.asarray(x, np.float64) - ref) / np.linalg.norm(ref)


# Mesh-axis types and shard_map differ across JAX versions: CI runs these on both lines.
@pytest.mark.old_jax
@pytest.mark.parametrize("q_spec,kv_spec", [
    (P("data"), P("data")),                                   # data parallelism
    (P("data", None, "model"), P("data", None, "model")),     # and the heads split
    (P(("data", "model")), None),                             # k, v given whole
], ids=["batch", "batch_and_heads", "kv_whole"])
def test_split_inputs_match_the_reference(q_spec, kv_spec):
  """Forward and gradients of a packed causal call, jitted, against the float64 reference;
  the output keeps q's sharding."""
  q, k, v, ids = inputs()
  dout = np.random.default_rng(1).standard_normal(q.shape).astype(np.float32)
  out_ref, _, grads_ref = reference(q, k, v, ids, dout)
  with jax.set_mesh(mesh()):
    put = lambda x, spec: x if spec is None else jax.device_put(x, spec)
    args = (put(q, q_spec), put(k, kv_spec), put(v, kv_spec))
    fn = lambda q, k, v: dilated_attention(q, k, v, PATTERN, segment_ids=ids)
    out, vjp = jax.vjp(jax.jit(fn), *args)
    grads = vjp(jax.device_put(dout, q_spec))
    assert jax.typeof(out).sharding.spec == P(*q_spec, *(None,) * (4 - len(q_spec)))
  assert rel(out, out_ref) < 1e-5
  for got, want in zip(grads, grads_ref):
    assert rel(got, want) < 1e-5


@pytest.mark.parametrize("q_spec", [P("data"), P("data", None, "model")],
                         ids=["batch", "batch_and_heads"])
def test_segment_ids_split_like_q(q_spec):
  """Document ids split over the batch's explicit axis as q is, against the float64
  reference (they raised an IndexError); split unlike q, a ValueError naming them."""
  q, k, v, ids = inputs()
  out_ref = reference(q, k, v, ids, None)[0]
  with jax.set_mesh(mesh()):
    args = [jax.device_put(x, q_spec) for x in (q, k, v)]
    fn = lambda q, k, v, ids: dilated_attention(q, k, v, PATTERN, segment_ids=ids)
    out = jax.jit(fn)(*args, jax.device_put(ids, P("data")))
    assert rel(out, out_ref) < 1e-5
    with pytest.raises(ValueError, match="segment_ids must be split over the mesh as q is"):
      fn(*args, jax.device_put(ids, P("model")))


@pytest.mark.parametrize("case", ["auto_batch", "manual_heads", "mqa"])
def test_meshes_of_explicit_and_other_axes_match_the_reference(case):
  """An `Auto` batch axis beside an explicit heads axis (each device computes its own batch:
  no all-gather), an explicit batch axis inside the user's `shard_map` over the heads
  (`heads_axis`), and one kv head beside split query heads; `lse` split like `out`."""
  q, k, v, ids = inputs(kv_heads=1 if case == "mqa" else 2)
  out_ref, lse_ref = reference(q, k, v, ids, None)
  kinds = (jax.sharding.AxisType.Auto if case == "auto_batch" else EXPLICIT, EXPLICIT)
  with jax.set_mesh(jax.make_mesh((4, 2), ("data", "model"), axis_types=kinds)):
    if case == "manual_heads":
      fn = jax.shard_map(
          lambda q, k, v: dilated_attention(q, k, v, PATTERN, segment_ids=ids,
                                            return_lse=True, heads_axis="model"),
          in_specs=P(None, None, "model"), out_specs=(P(None, None, "model"),) * 2,
          axis_names={"model"})
    else:
      fn = lambda q, k, v: dilated_attention(q, k, v, PATTERN, segment_ids=ids,
                                             return_lse=True)
    heads = "model" if case != "mqa" else None
    args = [jax.device_put(x, P("data", None, h))
            for x, h in ((q, "model"), (k, heads), (v, heads))]
    compiled = jax.jit(fn).lower(*args).compile()
    out, lse = compiled(*args)
    if case == "auto_batch":
      assert "all-gather" not in compiled.as_text()
    else:
      assert jax.typeof(lse).sharding.spec == P("data", None, "model")
  assert rel(out, out_ref) < 1e-5
  finite = np.isfinite(lse_ref)
  np.testing.assert_allclose(np.asarray(lse)[finite], lse_ref[finite], rtol=1e-5, atol=1e-5)


def test_the_layer_on_a_batch_split_over_explicit_axes():
  """The NNX layer without `mesh=` (data parallelism) equals itself on one device."""
  from flax import nnx  # pylint: disable=g-import-not-at-top
  x = np.random.default_rng(0).standard_normal((8, 64, 32)).astype(np.float32)
  layer = DilatedMultiHeadAttention(4, 32, pattern=PATTERN, rngs=nnx.Rngs(0))
  want = np.asarray(layer(x))
  with jax.set_mesh(mesh()):
    got = nnx.jit(lambda layer, x: layer(x))(layer, jax.device_put(x, P("data")))
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6)


@pytest.mark.old_jax
def test_decoding_on_a_batch_split_over_explicit_axes():
  """A packed prefill, then token steps, on a batch split over explicit axes: each step's
  rows are the full call's (float64 reference), and the cache stays split."""
  q, k, v, ids = inputs(n=64)
  ids[:, -8:] = ids[:, -9:-8]  # the steps continue each row's last document
  out_ref = reference(q, k, v, ids, None)[0]
  with jax.set_mesh(mesh()):
    q_, k_, v_ = (jax.device_put(x, P("data")) for x in (q, k, v))
    out, cache = dilated_attention_prefill(q_[:, :56], k_[:, :56], v_[:, :56], PATTERN,
                                           segment_ids=ids[:, :56])
    assert rel(out, out_ref[:, :56]) < 1e-5
    step = jax.jit(dilated_attention_step, static_argnums=4)
    for t in range(56, 64):
      out, cache = step(q_[:, t:t + 1], k_[:, t:t + 1], v_[:, t:t + 1], cache, PATTERN)
      assert rel(out, out_ref[:, t:t + 1]) < 1e-5
    assert jax.typeof(cache.k[0]).sharding.spec[0] == "data"


@pytest.mark.parametrize("call,specs,match,model", [
    ("attention", (P(None, "data"), None), "q is split over explicit mesh axes along its "
                                           "sequence", 2),
    ("attention", (P(None, None, None, "data"), None), "q is split .* head dim", 2),
    ("attention", (P("data"), P("model")), "k must be split over the mesh as q is", 2),
    ("attention", (P(None, None, ("data", "model")), None), "over one mesh axis", 2),
    ("prefill", (P("data", None, "model"), P("data", None, "model")), "decoding splits only "
                                                                      "the batch", 2),
    ("attention", (P("data", None, "model"), None), "k and v's 2 heads must split over", 4),
    ("step", (None, None), "cache is split over explicit mesh axes", 2),
])
def test_splits_it_cannot_run_raise_naming_the_input(call, specs, match, model):
  """`model`: the size of the mesh's heads axis (of 8 devices)."""
  q, k, v, _ = inputs(heads=8, kv_heads=2)
  fn = dilated_attention if call == "attention" else dilated_attention_prefill
  with jax.set_mesh(jax.make_mesh((8 // model, model), ("data", "model"),
                                  axis_types=(EXPLICIT,) * 2)):
    put = lambda x, spec: x if spec is None else jax.device_put(x, spec)
    if call == "step":  # a cache split by its prefill, stepped with tokens given whole
      cache = dilated_attention_prefill(*(put(x[:, :8], P("data")) for x in (q, k, v)),
                                        PATTERN)[1]
      fn = lambda q, k, v, pattern: dilated_attention_step(q, k, v, cache, pattern)
      q, k, v = (x[:, 8:9] for x in (q, k, v))
    with pytest.raises(ValueError, match=match):
      fn(put(q, specs[0]), put(k, specs[1]), put(v, specs[1]), PATTERN)


@pytest.mark.parametrize("kwargs", [
    dict(ordering="hilbert", grid_shape=(16, 16)),
    dict(pattern=DilatedPattern((256,), (1,), causal=True), layout="zigzag"),
], ids=["hilbert", "zigzag"])
def test_sown_weights_on_a_sequence_split_over_explicit_axes(kwargs):
  """`sow_weights` of the layer on a (data, seq) mesh of explicit axes: the dense weights in
  the caller's order, as the layer on one device sows them."""
  from flax import nnx  # pylint: disable=g-import-not-at-top
  from hilbert_ring_jax import zigzag_positions  # pylint: disable=g-import-not-at-top
  kwargs = dict(dict(pattern=DilatedPattern((16, 256), (1, 4))), **kwargs)
  x = np.random.default_rng(0).standard_normal((2, 256, 32)).astype(np.float32)
  zigzag = kwargs.get("layout") == "zigzag"
  plain = DilatedMultiHeadAttention(4, 32, rngs=nnx.Rngs(0),
                                    **{k: v for k, v in kwargs.items() if k != "layout"})
  want = nnx.capture(plain, nnx.Intermediate)(x, sow_weights=True)[1]["attention_weights"][0]
  want = np.asarray(want)
  if zigzag:  # the caller's rows (and keys) in zigzag order
    order = np.asarray(zigzag_positions(256, 4))
    x, want = x[:, order], want[:, :, order][..., order]
  explicit = jax.make_mesh((2, 4), ("data", "seq"), axis_types=(EXPLICIT,) * 2)
  with jax.set_mesh(explicit):
    layer = DilatedMultiHeadAttention(4, 32, mesh=explicit, seq_axis="seq", batch_axis="data",
                                      rngs=nnx.Rngs(0), **kwargs)
    got = nnx.capture(layer, nnx.Intermediate)(jax.device_put(x, P("data", "seq")),
                                               sow_weights=True)[1]["attention_weights"][0]
  np.testing.assert_allclose(np.asarray(got), want, atol=1e-6)
