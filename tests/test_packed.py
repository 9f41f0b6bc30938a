"""Packed sequences: `segment_ids` against the float64 reference, leaks, bad ids."""

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import helpers
import reference_np
from hilbert_ring_jax import (DilatedMultiHeadAttention, DilatedPattern, backends,
                              dilated_attention, dilated_attention_fn, linen)
from hilbert_ring_jax.reference import dilated_attention_reference
from hilbert_ring_jax.ring import sharded_dilated_attention


def packed_ids(batch, n, median, seed):
  """`[B, N]` int32 document ids: rows packed with documents of log-normal lengths (median
  `median`, the last one cut at N), numbered from 0 in each row."""
  rng = np.random.default_rng(seed)
  rows = []
  for _ in range(batch):
    lengths = []
    while sum(lengths) < n:
      lengths.append(max(1, int(rng.lognormal(np.log(median), 1.0))))
    rows.append(np.repeat(np.arange(len(lengths)), lengths)[:n])
  return jnp.asarray(np.stack(rows), jnp.int32)


def check_packed(case, causal, dtype, ids, seed=0, **kwargs):
  """Forward, lse and gradients with `segment_ids=ids` against the float64 reference."""
  q, k, v, dout, dlse = helpers.random_inputs(case, dtype, seed)
  pattern = case.pattern(causal)
  fn = lambda q, k, v: dilated_attention(q, k, v, pattern, segment_ids=ids, return_lse=True,
                                         **kwargs)
  (out, lse), grads = helpers.with_grads(fn)(q, k, v, (dout, dlse))
  m = reference_np.multiplicity(case.n, case.heads, case.segment_lengths, case.dilation_rates,
                                causal, case.offsets, case.head_groups)
  ref_out, ref_lse, ref_grads = reference_np.attention(
      q, k, v, m[None] * reference_np.same_document(ids), case.head_dim ** -0.5, dout, dlse)
  tol = helpers.TOL[dtype]
  assert out.dtype == dtype and helpers.rel_err(out, ref_out) < tol
  helpers.check_lse(lse, ref_lse, tol)
  for g, ref in zip(grads, ref_grads):
    assert g.dtype == dtype and helpers.rel_err(g, ref) < 2 * tol


# (case, causal, median document length): the documents' edges fall inside segments and
# across them, several documents in a dilated row, a document longer than a segment.
CASES = {
    "longnet_causal_gqa": (helpers.Case(256, 4, 2, (32, 64, 128), (1, 2, 4)), True, 24),
    "longnet_all_offsets": (helpers.Case(192, 3, 3, (16, 48, 96), (1, 2, 4), offsets="all"),
                            False, 40),
    "head_groups": (helpers.Case(128, 4, 1, (32, 128), (1, 4), head_groups=True), True, 16),
    "full_causal_batch2": (helpers.Case(160, 2, 2, (160,), (1,), batch=2), True, 30),
}


@pytest.mark.parametrize("name", CASES)
def test_packed_matches_the_reference(name):
  case, causal, median = CASES[name]
  ids = packed_ids(case.batch, case.n, median, seed=len(name))
  assert len(np.unique(np.asarray(ids[0]))) > 2  # several documents a row
  check_packed(case, causal, jnp.float32, ids)


def test_packed_longnet_at_4096_tokens():
  """A size users run: 4096 tokens of documents of log-normal lengths (median 200, some over
  a thousand) under a causal LongNet pattern, GQA, several key blocks a branch."""
  case = helpers.Case(4096, 2, 1, (512, 1024, 2048, 4096), (1, 2, 4, 8), head_dim=8)
  ids = packed_ids(1, 4096, 200, seed=13)
  assert len(np.unique(np.asarray(ids))) > 4
  check_packed(case, True, jnp.float32, ids)


def test_packed_bf16_several_key_blocks():
  """bf16, and key blocks of 32 so that a document's edge cuts blocks."""
  case = helpers.Case(256, 2, 2, (64, 256), (1, 2))
  check_packed(case, True, jnp.bfloat16, packed_ids(1, 256, 20, seed=3),
               config=backends.xla.Config(key_block=32))


@pytest.mark.parametrize("causal", [True, False])
def test_xla_skips_the_tiles_of_other_documents(monkeypatch, causal):
  """The xla backend's tiles of packed rows (blocks of 64 keys, queries in 8 blocks of 128
  rows here; non-causal branches split so on a CPU, here on any platform) run only where a
  query block and a key block may share a document in some row: for rows of documents
  numbered in order, exactly the tiles a brute-force count finds a shared document in (a
  skipped tile would add nothing: the test is of the loop's own `meets`). Results match the
  reference, with ids that come back later in a row and negative ones too."""
  case = helpers.Case(1024, 2, 1, (1024,), (1,), batch=2)
  xla = backends.load("xla")
  monkeypatch.setattr(xla, "_split_documents", lambda: True)
  config = xla.Config(key_block=64)
  ids = np.stack([np.arange(1024) // 100, np.arange(1024) // 300])
  returning = np.tile(np.repeat([7, -3, 7, 2], 64), 4)[None].repeat(2, 0)
  for row_ids in (ids, returning):
    check_packed(case, causal, jnp.float32, jnp.asarray(row_ids, jnp.int32),
                 implementation="xla", config=config)
  q, k, v, _, _ = helpers.random_inputs(case, jnp.float32, 0)
  fold, = xla._folds(case.pattern(causal), q, k, None)
  tiles = xla._Tiles.of(fold, config.key_block, packed=True)
  meets = np.asarray(xla._tile_inputs(fold, tiles, q, k, v, (jnp.asarray(ids),) * 2)[2])
  shared = [any(set(row[qi * 128:qi * 128 + 128]) & set(row[kj * 64:kj * 64 + 64]) for row in ids)
            for qi, kj in zip(*map(np.asarray, tiles.pairs()))]
  assert len(shared) == (72 if causal else 128) and meets.tolist() == shared
  assert sum(shared) < (40 if causal else 64), sum(shared)


def test_ids_are_compared_not_ordered():
  """A document id may come back later in a row (equal ids see each other wherever they
  are), and ids may be any integers, negative ones included."""
  case = helpers.Case(64, 2, 2, (32, 64), (1, 2))
  ids = jnp.asarray(np.tile(np.repeat([7, -3], 8), 4)[None], jnp.int32)
  check_packed(case, False, jnp.float32, ids)


def test_one_document_is_no_ids():
  case = helpers.Case(128, 4, 2, (32, 64, 128), (1, 2, 4))
  q, k, v, _, _ = helpers.random_inputs(case, jnp.float32, 0)
  pattern = case.pattern(True)
  plain = dilated_attention(q, k, v, pattern)
  packed = dilated_attention(q, k, v, pattern, segment_ids=jnp.full((1, 128), 5, jnp.int32))
  np.testing.assert_allclose(packed, plain, rtol=1e-6, atol=1e-6)


def test_no_gradient_crosses_documents():
  """A loss on one document's outputs gives exactly zero gradient to every other document's
  queries, keys and values."""
  case = helpers.Case(256, 4, 2, (64, 128, 256), (1, 2, 4))
  q, k, v, _, _ = helpers.random_inputs(case, jnp.float32, 1)
  ids = packed_ids(1, 256, 30, seed=4)
  doc = int(ids[0, 100])
  mine = (ids[0] == doc)[None, :, None, None]
  for causal in (False, True):
    pattern = case.pattern(causal)
    loss = lambda q, k, v: jnp.sum(jnp.where(
        mine, dilated_attention(q, k, v, pattern, segment_ids=ids), 0.0) ** 2)
    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    for g in grads:
      g = np.asarray(g)
      assert np.all(g[:, ~np.asarray(mine[0, :, 0, 0])] == 0.0)
      assert np.abs(g[:, np.asarray(mine[0, :, 0, 0])]).max() > 0


def test_packed_under_vmap_and_the_public_reference():
  case = helpers.Case(64, 2, 1, (16, 64), (1, 2))
  q, k, v, _, _ = helpers.random_inputs(case, jnp.float32, 2)
  ids = packed_ids(3, 64, 12, seed=5)
  pattern = case.pattern(True)
  qs, ks, vs = (jnp.concatenate([x, 2 * x, -x]) for x in (q, k, v))
  ref = dilated_attention_reference(qs, ks, vs, pattern, segment_ids=ids)
  # Also in blocks of 8 keys: each row's own count of the xla backend's tiles to run.
  for config in (None, backends.load("xla").Config(key_block=8)):
    batched = jax.vmap(lambda q, k, v, ids: dilated_attention(
        q[None], k[None], v[None], pattern, segment_ids=ids[None], config=config)[0])(
            qs, ks, vs, ids)
    np.testing.assert_allclose(batched, ref, rtol=2e-5, atol=2e-5)


def test_bad_segment_ids():
  q = jnp.ones((2, 32, 2, 8))
  p = DilatedPattern((16,), (1,))
  for bad, match in (([[0] * 32] * 2, "segment_ids must be None or an integer array"),
                     (jnp.zeros((2, 16), jnp.int32), r"shape \[B, N\] = \(2, 32\)"),
                     (jnp.zeros((32,), jnp.int32), r"segment_ids.shape=\(32,\)"),
                     (jnp.zeros((2, 32)), "integer dtype"),
                     (np.zeros((2, 32), bool), "integer dtype")):
    with pytest.raises(ValueError, match=match):
      dilated_attention(q, q, q, p, segment_ids=bad)
    with pytest.raises(ValueError, match=match):
      dilated_attention_reference(q, q, q, p, segment_ids=bad)
  # Traced ids are checked on shape and dtype alike.
  with pytest.raises(ValueError, match="integer dtype"):
    jax.jit(lambda ids: dilated_attention(q, q, q, p, segment_ids=ids))(jnp.zeros((2, 32)))
  # 64-bit NumPy ids beyond 32 bits: JAX without 64-bit mode would keep their low 32 bits, and
  # ids 0 and 2**32 would be one document. Within 32 bits they are taken.
  wide = np.repeat(np.array([0, 2 ** 32], np.int64), 16)[None].repeat(2, 0)
  if not jax.config.jax_enable_x64:
    for call in (dilated_attention, dilated_attention_reference):
      with pytest.raises(ValueError, match="beyond 32 bits"):
        call(q, q, q, p, segment_ids=wide)
      with pytest.raises(ValueError, match="beyond 32 bits"):
        call(q, q, q, p, segment_ids=wide.astype(np.uint64))
    # Through the layers, also where an ordering gathers the ids before the call's checks.
    for kw in (dict(pattern=p), dict(pattern=p, ordering="hilbert", grid_shape=(4, 8))):
      layer = DilatedMultiHeadAttention(2, 8, **kw, rngs=nnx.Rngs(0))
      with pytest.raises(ValueError, match="segment_ids holds values beyond 32 bits"):
        layer(jnp.ones((2, 32, 8)), segment_ids=wide)
      with pytest.raises(ValueError, match="segment_ids holds values beyond 32 bits"):
        linen.DilatedMultiHeadAttention(num_heads=2, **kw).init(
            jax.random.PRNGKey(0), jnp.ones((2, 32, 8)), segment_ids=wide)
  narrow = np.where(wide > 0, -(2 ** 31), 7).astype(np.int64)
  np.testing.assert_array_equal(dilated_attention(q, q, q, p, segment_ids=narrow),
                                dilated_attention(q, q, q, p, segment_ids=narrow.astype(np.int32)))


def _documents_alone(call, x, ids):
  """`call(x)` run on each document of `x [1, N, F]` alone, concatenated."""
  starts = np.flatnonzero(np.diff(np.asarray(ids[0]), prepend=-1))
  ends = list(starts[1:]) + [x.shape[1]]
  return jnp.concatenate([call(x[:, a:b]) for a, b in zip(starts, ends)], axis=1)


def _restarting_positions(ids):
  """Each token's place in its run of equal ids: `[B, N]`."""
  ids = np.asarray(ids)
  pos = np.zeros(ids.shape, np.int32)
  for b in range(ids.shape[0]):
    start = 0
    for i in range(1, ids.shape[1]):
      start = i if ids[b, i] != ids[b, i - 1] else start
      pos[b, i] = i - start
  return jnp.asarray(pos)


def test_layers_packed_rows_equal_documents_alone():
  """A causal full pattern with rotary positions restarting at each document: a packed row
  through either layer gives what each document alone gives."""
  pattern = DilatedPattern((192,), (1,), causal=True)
  x = jnp.asarray(np.random.default_rng(6).standard_normal((1, 192, 32)), jnp.float32)
  # Documents of two lengths (each length compiles once when run alone).
  ids = jnp.asarray(np.repeat(np.arange(4), [64, 32, 64, 32])[None], jnp.int32)
  pos = _restarting_positions(ids)
  layer = DilatedMultiHeadAttention(4, 32, num_kv_heads=2, pattern=pattern, rotary_base=1e4,
                                    rngs=nnx.Rngs(0))
  packed = layer(x, segment_ids=ids, positions=pos)
  np.testing.assert_allclose(packed, _documents_alone(layer, x, ids), rtol=1e-5, atol=1e-5)
  module = linen.DilatedMultiHeadAttention(num_heads=4, pattern=pattern, rotary_base=1e4)
  params = module.init(jax.random.PRNGKey(0), x)
  packed = module.apply(params, x, segment_ids=ids, positions=pos)
  alone = _documents_alone(lambda x: module.apply(params, x), x, ids)
  np.testing.assert_allclose(packed, alone, rtol=1e-5, atol=1e-5)


def test_layer_packed_with_hilbert_order_and_mesh():
  """With a Hilbert order and a mesh the ids follow their tokens: no gradient crosses
  documents, and the sharded layer equals the single-device one."""
  pattern = DilatedPattern((64, 256), (1, 4))
  rng = np.random.default_rng(8)
  x = jnp.asarray(rng.standard_normal((2, 256, 16)), jnp.float32)
  ids = jnp.asarray(np.repeat(np.arange(4), 64)[None] * np.ones((2, 1), int), jnp.int32)
  mesh = jax.make_mesh((2, 4), ("data", "seq"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  make = lambda **kw: DilatedMultiHeadAttention(2, 16, pattern=pattern, ordering="hilbert",
                                                grid_shape=(16, 16), rngs=nnx.Rngs(0), **kw)
  plain, sharded = make(), make(mesh=mesh, seq_axis="seq", batch_axis="data")
  out = plain(x, segment_ids=ids)
  np.testing.assert_allclose(sharded(x, segment_ids=ids), out, rtol=1e-5, atol=1e-5)
  first = (ids == 0)[..., None]
  loss = lambda x: jnp.sum(jnp.where(first, plain(x, segment_ids=ids), 0.0) ** 2)
  dx = jax.jit(jax.grad(loss))(x)
  assert np.all(np.asarray(dx)[~np.asarray(first[..., 0])] == 0.0)
  assert np.abs(np.asarray(dx)[np.asarray(first[..., 0])]).max() > 0


def test_attention_fn_passes_segment_ids():
  pattern = DilatedPattern((32, 64), (1, 2), causal=True)
  case = helpers.Case(64, 2, 2, (32, 64), (1, 2))
  q, k, v, _, _ = helpers.random_inputs(case, jnp.float32, 9)
  ids = packed_ids(1, 64, 10, seed=10)
  out = dilated_attention_fn(pattern)(q, k, v, segment_ids=ids)
  ref = dilated_attention_reference(q, k, v, pattern, segment_ids=ids)
  np.testing.assert_allclose(out, ref, rtol=2e-5, atol=2e-5)


def test_layer_bad_segment_ids_and_positions():
  pattern = DilatedPattern((16,), (1,), causal=True)
  x = jnp.ones((2, 16, 8))
  layer = DilatedMultiHeadAttention(2, 8, pattern=pattern, rngs=nnx.Rngs(0))
  ids = jnp.zeros((2, 16), jnp.int32)
  for kwargs, match in (({"segment_ids": ids[:1]}, r"segment_ids must be an integer array of "
                                                   r"shape \(2, 16\)"),
                        ({"segment_ids": ids.astype(float)}, "segment_ids.dtype=float32"),
                        ({"positions": ids}, "positions .* need rotary_base"),
                        ({"segment_ids": [0] * 16}, "got list")):
    with pytest.raises(ValueError, match=match):
      layer(x, **kwargs)
  with pytest.raises(ValueError, match="keys of another length"):
    layer(x, jnp.ones((2, 8, 8)), segment_ids=ids)
  layer.init_cache((2, 16, 8))
  with pytest.raises(ValueError, match="decode takes no segment_ids"):
    layer(x, decode=True, segment_ids=ids)
  with pytest.raises(ValueError, match=r"packed cache: init_cache\(input_shape, packed=True"):
    layer(x, decode=True, prefill=True, segment_ids=ids)


EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def test_packed_and_padded_rows(monkeypatch):
  """examples/lm_packed.py's rows: packed rows are the documents end to end, the ids change
  and the positions restart where a document starts, only the targets across documents are
  masked; padded rows hold one piece of a document each, its padding masked."""
  pytest.importorskip("optax")
  monkeypatch.syspath_prepend(str(EXAMPLES))
  import lm_packed  # pylint: disable=import-outside-toplevel
  rng = np.random.default_rng(11)
  docs = [rng.integers(1, 255, size, dtype=np.uint8) for size in (5, 40, 17, 3, 90, 12)]
  packed = lm_packed.Rows(docs, "packed", 16, 2, 4, seed=1)
  order = np.concatenate([np.random.default_rng([1, e]).permutation(6) for e in range(2)])
  stream = np.concatenate([docs[i] for i in order])
  starts = np.cumsum([0] + [docs[i].size for i in order])
  for step in range(4):
    tokens, targets, mask, ids, pos = (np.asarray(x) for x in packed(step))
    for r in range(2):
      a = (step * 2 + r) * 16
      np.testing.assert_array_equal(tokens[r], stream[a:a + 16])
      np.testing.assert_array_equal(targets[r], stream[a + 1:a + 17])
      doc = np.searchsorted(starts, np.arange(a, a + 17), side="right") - 1
      np.testing.assert_array_equal(mask[r], doc[1:] == doc[:-1])
      np.testing.assert_array_equal(pos[r], np.arange(a, a + 16) - starts[doc[:-1]])
      assert np.all((ids[r][1:] != ids[r][:-1]) == (doc[1:-1] != doc[:-2]))
  padded = lm_packed.Rows(docs, "padded", 16, 3, 2, seed=1)
  pieces = [docs[i][a:a + 17] for i in order for a in range(0, docs[i].size - 1, 16)]
  for step in range(2):
    tokens, targets, mask = (np.asarray(x) for x in padded(step))
    for r, piece in enumerate(pieces[step * 3:step * 3 + 3]):
      np.testing.assert_array_equal(tokens[r, :piece.size - 1], piece[:-1])
      np.testing.assert_array_equal(targets[r, :piece.size - 1], piece[1:])
      assert mask[r].sum() == piece.size - 1 and np.all(mask[r, :piece.size - 1] == 1)


@pytest.mark.slow  # ~19 s, two short trainings: its rows are checked above, its packed layer
# by the tests of this file
def test_lm_packed_runs(monkeypatch, tmp_path):
  pytest.importorskip("optax")
  monkeypatch.syspath_prepend(str(EXAMPLES))
  import lm_packed  # pylint: disable=import-outside-toplevel
  result = lm_packed.main(["--seq-len", "128", "--segments", "32,128", "--rates", "1,2",
                           "--dim", "32", "--layers", "1", "--heads", "2", "--kv-heads", "1",
                           "--batch", "4", "--steps", "4", "--eval-every", "4",
                           "--eval-docs", "4", "--out-dir", str(tmp_path)])
  saved = json.loads((tmp_path / "lm_packed.json").read_text())
  assert [r["layout"] for r in saved["runs"]] == ["padded", "packed"]
  padded, packed = saved["runs"]
  assert packed["useful_fraction"] >= padded["useful_fraction"] > 0.5
  for r in (padded, packed):
    assert 0 < r["heldout_bpb"] < 9 and r["useful_tokens_per_s"] > 0
  assert result["packed_over_padded_useful_tokens_per_s"] > 0


def _decode(q, k, v, pattern, ids, prompt, chunk, prefill=None):
  """A prefill of `prompt` packed tokens (`dilated_attention_prefill`, or `prefill`), then
  steps of `chunk` tokens to the end: `(every output [B, N, H, D], the prefill's cache)`."""
  from hilbert_ring_jax import (  # pylint: disable=import-outside-toplevel
      dilated_attention_prefill, dilated_attention_step)
  out, cache = (prefill or dilated_attention_prefill)(
      q[:, :prompt], k[:, :prompt], v[:, :prompt], pattern, segment_ids=ids[:, :prompt])
  outs, filled = [out], cache
  step = jax.jit(dilated_attention_step, static_argnums=4)
  for t in range(prompt, q.shape[1], chunk):
    o, cache = step(q[:, t:t + chunk], k[:, t:t + chunk], v[:, t:t + chunk], cache, pattern)
    outs.append(o)
  return jnp.concatenate(outs, axis=1), filled


@pytest.mark.parametrize("chunk", [1, 3])
def test_decoding_continues_the_last_document(chunk):
  """A prefill of packed rows, then steps (tokens, or chunks of 3): the new tokens see only
  their row's last document, as `dilated_attention` over the whole sequence does with the new
  tokens in that document; rows of a batch end their documents at different places."""
  pattern = DilatedPattern((16, 32, 64), (1, 2, 4), causal=True)
  case = helpers.Case(48, 4, 2, (16, 32, 64), (1, 2, 4), batch=2)
  q, k, v, _, _ = helpers.random_inputs(case, jnp.float32, 12)
  prompt = 39
  ids = np.zeros((2, 48), np.int32)
  ids[0, 10:], ids[0, 33:] = 1, 2   # row 0: the last document starts at 33
  ids[1, 25:] = 7                   # row 1: at 25
  ids = jnp.asarray(ids)
  outs, cache = _decode(q, k, v, pattern, ids, prompt, chunk)
  np.testing.assert_array_equal(cache.start, [33, 25])
  ref = dilated_attention_reference(q, k, v, pattern, segment_ids=ids)
  np.testing.assert_allclose(outs, ref, rtol=2e-5, atol=2e-5)
  # Without the ids the steps would read the earlier documents: a different result.
  plain = dilated_attention_reference(q, k, v, pattern)
  assert not np.allclose(ref[:, prompt:], plain[:, prompt:], atol=1e-3)


def test_a_returning_last_id_decodes_as_dilated_attention():
  """Where a row's last id also marks earlier tokens that the next tokens' segments reach,
  the steps see them too, as `dilated_attention` does (the prefill moves those cached rows
  next to the last run: `KVCache.first`): concrete ids then token steps, traced ids (a
  jitted prefill) then chunks of 3; rows with one earlier run, with two, and with one out
  of the shorter branch's reach."""
  from hilbert_ring_jax import (  # pylint: disable=import-outside-toplevel
      dilated_attention_prefill)
  pattern = DilatedPattern((16, 64), (1, 4), causal=True)
  case = helpers.Case(96, 4, 2, (16, 64), (1, 4), batch=3)
  q, k, v, _, _ = helpers.random_inputs(case, jnp.float32, 13)
  ids = jnp.asarray(np.stack([np.repeat([2, 7, 2], [20, 12, 64]),
                              np.repeat([7, 2, 7], [36, 2, 58]),
                              np.repeat([5, 3, 5, 3, 5], [8, 2, 12, 3, 71])]), jnp.int32)
  prompt = 40
  ref = dilated_attention_reference(q, k, v, pattern, segment_ids=ids)
  for prefill, chunk in ((dilated_attention_prefill, 1),
                         (jax.jit(dilated_attention_prefill, static_argnums=3), 3)):
    outs, cache = _decode(q, k, v, pattern, ids, prompt, chunk, prefill)
    np.testing.assert_array_equal(cache.start, [32, 38, 25])
    np.testing.assert_allclose(outs, ref, rtol=2e-5, atol=2e-5)
  # Reading only the last run would differ: the earlier runs matter here.
  last_run = jnp.where(jnp.arange(96) < jnp.asarray([32, 38, 25])[:, None], -1, ids)
  other = dilated_attention_reference(q, k, v, pattern, segment_ids=last_run)
  assert not np.allclose(other[:, prompt:], ref[:, prompt:], atol=1e-3)


def test_a_short_last_document_where_segments_are_not_whole_periods():
  """With w % r != 0 a residue may have no row left in the prompt's last segment after the
  rows before its last run: its `first` is then the next segment's start (not past it),
  whose rows the steps read whole. Token steps and chunks, against the reference (the
  audit's case: (9,) x (5,), a last document of one token)."""
  pattern = DilatedPattern((9, 6), (5, 4), causal=True)
  case = helpers.Case(30, 2, 1, (9, 6), (5, 4), batch=2)
  q, k, v, _, _ = helpers.random_inputs(case, jnp.float32, 15)
  ids = jnp.asarray([[0] * 8 + [1] * 22, [3] * 4 + [2] * 4 + [3] * 22], jnp.int32)
  ref = dilated_attention_reference(q, k, v, pattern, segment_ids=ids)
  for chunk in (1, 2):
    outs, cache = _decode(q, k, v, pattern, ids, 9, chunk)
    assert (cache.first[0] <= 9).all() and (cache.first[1] <= 12).all()  # next segments
    np.testing.assert_allclose(outs, ref, rtol=2e-5, atol=2e-5)


def test_a_packed_cache_is_checked():
  """`start` and `first` come together, `first` one `[B, r]` array a branch: else a
  ValueError naming them."""
  import dataclasses  # pylint: disable=import-outside-toplevel
  from hilbert_ring_jax import (  # pylint: disable=import-outside-toplevel
      dilated_attention_prefill, dilated_attention_step, init_kv_cache)
  pattern = DilatedPattern((8, 16), (1, 4), causal=True)
  cache = init_kv_cache(pattern, batch=2, num_heads=4, num_kv_heads=2, head_dim=8, packed=True)
  assert [x.shape for x in cache.first] == [(2, 1), (2, 4)] and cache.start.shape == (2,)
  x, kv = jnp.ones((2, 1, 4, 8)), jnp.ones((2, 1, 2, 8))
  dilated_attention_step(x, kv, kv, cache, pattern)
  _, lent = dilated_attention_prefill(jnp.ones((2, 5, 4, 8)), jnp.ones((2, 5, 2, 8)),
                                      jnp.ones((2, 5, 2, 8)), pattern, cache=cache)
  assert jax.tree.structure(lent) == jax.tree.structure(cache)  # still packed: one document
  assert all(int(x.max()) == 0 for x in (lent.start, *lent.first))
  for bad, match in ((dataclasses.replace(cache, first=None), "cache.first and cache.start"),
                     (dataclasses.replace(cache, start=[0, 0]), "cache.start must be"),
                     (dataclasses.replace(cache, first=([[0]] * 2, [[0] * 4] * 2)),
                      r"\[B, r\] arrays"),
                     (dataclasses.replace(cache, first=cache.first[:1]), r"\[B, r\] arrays"),
                     (dataclasses.replace(cache, first=(cache.first[0], cache.first[0])),
                      r"\[B, r\] arrays")):
    with pytest.raises(ValueError, match=match):
      dilated_attention_step(x, kv, kv, bad, pattern)


def test_packed_step_backend():
  """Packed caches step on the token-step kernel where it runs (here: interpret mode, as the
  config asks), else on "xla"; chunks always on "xla"."""
  from hilbert_ring_jax.backends import mosaic_decode  # pylint: disable=g-import-not-at-top
  from hilbert_ring_jax.decode import step_backend  # pylint: disable=import-outside-toplevel
  q = jnp.ones((1, 1, 4, 64), jnp.bfloat16)
  pattern = DilatedPattern((64,), (1,), causal=True)
  assert step_backend(q, q, pattern, ("mosaic", "xla"), packed=True) == (
      "mosaic" if jax.default_backend() == "gpu" and jax.__version_info__ >= (0, 11) else "xla")
  interpret = mosaic_decode.Config(interpret=True)
  assert step_backend(q, q, pattern, ("mosaic", "xla"), interpret, packed=True) == (
      "mosaic" if jax.__version_info__ >= (0, 11) else "xla")
  chunk = jnp.ones((1, 3, 4, 64), jnp.bfloat16)
  assert step_backend(chunk, chunk, pattern, ("mosaic", "xla"), interpret, packed=True) == "xla"


def test_layers_decode_packed_prompts():
  """A packed prompt through the layers' decode mode (NNX: init_cache(packed=True); Linen: init
  with segment_ids), then token steps: the same as the non-decoding layer on the whole
  sequence with the new tokens in their row's last document and rotary positions restarting
  at each run of ids (row 1's last id returns: its earlier run is seen too)."""
  pattern = DilatedPattern((16, 32), (1, 2), causal=True)
  rng = np.random.default_rng(14)
  x = jnp.asarray(rng.standard_normal((2, 36, 16)), jnp.float32)
  ids = np.zeros((2, 36), np.int32)
  ids[0, 12:], ids[1, 5:], ids[1, 12:], ids[1, 21:] = 1, 1, 2, 1
  ids = jnp.asarray(ids)
  pos = _restarting_positions(ids)
  prompt = 31
  layer = DilatedMultiHeadAttention(4, 16, num_kv_heads=2, pattern=pattern, rotary_base=1e4,
                                    rngs=nnx.Rngs(0))
  want = layer(x, segment_ids=ids, positions=pos)
  layer.init_cache((2, 36, 16), packed=True)
  ys = [layer(x[:, :prompt], decode=True, prefill=True, segment_ids=ids[:, :prompt])]
  ys += [layer(x[:, t:t + 1], decode=True) for t in range(prompt, 36)]
  np.testing.assert_array_equal(layer.cache_start[...], [12, 21])
  np.testing.assert_allclose(jnp.concatenate(ys, axis=1), want, rtol=2e-5, atol=2e-5)
  module = linen.DilatedMultiHeadAttention(num_heads=4, num_kv_heads=2, pattern=pattern,
                                           rotary_base=1e4, decode=True)
  variables = module.init(jax.random.PRNGKey(0), x, segment_ids=ids)
  assert variables["cache"]["cache_start"].shape == (2,)
  assert [x.shape for x in variables["cache"]["cache_first"]] == [(2, 1), (2, 2)]  # [B, r]
  plain = linen.DilatedMultiHeadAttention(num_heads=4, num_kv_heads=2, pattern=pattern,
                                          rotary_base=1e4)
  want = plain.apply({"params": variables["params"]}, x, segment_ids=ids, positions=pos)
  y, mutated = module.apply(variables, x[:, :prompt], prefill=True,
                            segment_ids=ids[:, :prompt], mutable=["cache"])
  ys = [y]
  for t in range(prompt, 36):
    y, mutated = module.apply({"params": variables["params"], **mutated}, x[:, t:t + 1],
                              mutable=["cache"])
    ys.append(y)
  np.testing.assert_allclose(jnp.concatenate(ys, axis=1), want, rtol=2e-5, atol=2e-5)


@pytest.mark.gpu
def test_packed_on_a_gpu_bf16():
  """On a GPU the default dispatch runs packed rows (on the backend that takes them), bf16,
  against the float64 reference: causal LongNet at 4096 tokens, D = 128."""
  case = helpers.Case(4096, 4, 2, (512, 1024, 2048, 4096), (1, 2, 4, 8), head_dim=128)
  check_packed(case, True, jnp.bfloat16, packed_ids(1, 4096, 400, seed=15))


@pytest.mark.gpu
def test_packed_ring_on_gpus():
  """Packed rows on a ring over every GPU of the host equal one GPU's packed call."""
  gpus = jax.devices("gpu")
  if len(gpus) < 2:
    pytest.skip("needs two GPUs")
  n = 4096 * len(gpus)
  pattern = DilatedPattern((2048, 4096, n), (1, 2, 4), causal=True)
  case = helpers.Case(n, 4, 2, pattern.segment_lengths, pattern.dilation_rates, head_dim=128)
  q, k, v, dout, _ = helpers.random_inputs(case, jnp.bfloat16, 16)
  ids = packed_ids(1, n, 1500, seed=17)
  mesh = jax.make_mesh((len(gpus),), ("seq",), axis_types=(jax.sharding.AxisType.Auto,),
                       devices=gpus)
  ring = lambda q, k, v: sharded_dilated_attention(q, k, v, pattern, mesh=mesh, axis_name="seq",
                                                   segment_ids=ids)
  single = lambda q, k, v: dilated_attention(q, k, v, pattern, segment_ids=ids)
  outs = []
  for fn in (ring, single):
    out, vjp = jax.vjp(jax.jit(fn), q, k, v)
    outs.append([np.asarray(x, np.float32) for x in (out, *vjp(dout))])
  for a, b in zip(*outs):
    np.testing.assert_allclose(a, b, rtol=2e-2, atol=2e-2)
