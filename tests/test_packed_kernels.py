"""Packed sequences in the kernels: each backend that takes `segment_ids` against the float64
reference (in interpret mode on CPU), the per-head ids of the backend contract, and the key
blocks that packing lets a kernel skip. pallas's cases run on CI's oldest JAX (`pallas`),
mosaic's interpreted ones on JAX >= 0.11."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import helpers
from hilbert_ring_jax import backends, dilated_attention
from hilbert_ring_jax.pattern import DilatedPattern
from hilbert_ring_jax.backends import common, mosaic, mosaic_pipeline, mosaic_plan, schedule
from test_packed import CASES, check_packed, packed_ids
import reference_np

INTERPRET = pytest.mark.skipif(
    jax.__version_info__ < (0, 11) or jax.default_backend() == "gpu",
    reason="Mosaic GPU interpret mode: CPU only, JAX >= 0.11")


@pytest.mark.pallas
@pytest.mark.parametrize("name", [  # offsets "all" with ids interpreted: `-m slow` (~12 s)
    "longnet_causal_gqa", pytest.param("longnet_all_offsets", marks=pytest.mark.slow)])
def test_pallas_packed_matches_the_reference(name):
  """Forward, lse and gradients: documents cut by the 16-row interpret blocks, so blocks are
  skipped (no shared document), run without the id comparison (one document) and masked."""
  case, causal, median = CASES[name]
  check_packed(case, causal, jnp.float32, packed_ids(case.batch, case.n, median, len(name)),
               implementation="pallas")


@pytest.mark.pallas
def test_pallas_ids_are_compared_not_ordered():
  """Ids that come back later in the row, negative ones, and a padded view (a segment that
  is not a whole number of blocks): a block's id range only decides what is skipped."""
  case = helpers.Case(96, 2, 1, (48, 96), (1, 2))
  ids = jnp.asarray(np.tile(np.repeat([7, -3, 7], 8), 4)[None], jnp.int32)
  check_packed(case, True, jnp.float32, ids, implementation="pallas")


@pytest.mark.pallas
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

  # Each backend's passes as one program (op by op they compiled ~370 small ones: 25 s); float32
  # products in full on a GPU too, where XLA's default would round them to TF32.
  with jax.default_matmul_precision("highest"):
    outs = {name: jax.jit(functools.partial(passes, backends.load(name)))(
        q, k, v, dout, (q_ids, kv_ids)) for name in ("pallas", "xla")}
  for a, ref in zip(outs["pallas"], outs["xla"]):
    np.testing.assert_allclose(a, ref, rtol=2e-5, atol=2e-5)


@pytest.mark.pallas
@pytest.mark.parametrize("contiguous", [True, False])
def test_pallas_row_windows_hold_each_document_of_a_dilated_row(contiguous):
  """`pallas._row_windows` (the rows a program's loop may reach, and those it runs without a
  look at the ids): for every token of a branch's dilated rows (rate 3, segments of 48 over
  100 tokens: a short last segment, a padded view), the window holds every row of its segment
  and residue in its document, and the run holds the token's own row and only rows of its
  document; with each document in one piece both are exactly the first and last such row."""
  from hilbert_ring_jax.backends import pallas  # pylint: disable=import-outside-toplevel
  n, w, r = 100, 48, 3
  rng = np.random.default_rng(3)
  ids = np.repeat(np.arange(12), rng.integers(1, 20, 12))[:n] if contiguous else \
      rng.integers(0, 4, n)
  ids = np.pad(ids, (0, n - len(ids)), mode="edge")[None]
  (br,) = pallas._branches(DilatedPattern((w,), (r,), offsets="all"), n, 1,
                           pallas.Config().resolved(16, jnp.float32))
  assert br.padded
  windows = common.contract_windows((jnp.asarray(ids, jnp.int32),) * 2)
  first, last, run0, run1 = (np.asarray(x)[0, ..., 0] for x in pallas._row_windows(br, windows))
  checked = 0
  for s in range(br.geo.segments):
    for c in range(r):
      positions = np.arange(s * w + c, min(n, s * w + w), r)  # the dilated row's tokens
      for m, p in enumerate(positions):
        same = np.flatnonzero(ids[0, positions] == ids[0, p])
        window, run = (first[s, m, c], last[s, m, c]), (run0[s, m, c], run1[s, m, c])
        assert window[0] <= same[0] and window[1] >= same[-1]
        assert run[0] <= m <= run[1]
        assert (ids[0, positions[run[0]:run[1] + 1]] == ids[0, p]).all()
        if contiguous:
          assert window == run == (same[0], same[-1])
        checked += 1
  assert checked == n


@pytest.mark.pallas
def test_pallas_takes_packed_problems():
  """pallas's `supports` takes packed problems; dispatch picks it where it comes first."""
  problem = backends.Problem((1, 256, 4, 64), (1, 256, 4, 64), jnp.dtype(jnp.bfloat16),
                             DilatedPattern((256,), (1,)), platform="gpu", segment_ids=True)
  assert backends.load("pallas").supports(problem)
  assert backends.resolve(("pallas", "xla"), problem) == "pallas"


@pytest.mark.pallas
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


def _mosaic_passes(case, causal, ids, config=None, seed=0):
  """`(out, lse, grads)` of the interpreted mosaic kernels (bf16) with `segment_ids=ids` (one
  program), and the inputs `(q, k, v, dout, dlse)`."""
  inputs = helpers.random_inputs(case, jnp.bfloat16, seed)
  kernel = helpers.Kernels(mosaic, case.pattern(causal), case.head_dim ** -0.5,
                           config or mosaic.Config(interpret=True, persistent=True))

  @jax.jit
  def passes(q, k, v, dout, dlse, ids):
    (out, lse), vjp = jax.vjp(lambda q, k, v: backends.attention(q, k, v, kernel, ids), q, k, v)
    return out, lse, vjp((dout, dlse))

  return (*passes(*inputs, ids), inputs)


def _check_mosaic(case, causal, ids, **kwargs):
  """Forward, lse and gradients against the float64 reference."""
  out, lse, grads, (q, k, v, dout, dlse) = _mosaic_passes(case, causal, ids, **kwargs)
  m = reference_np.multiplicity(case.n, case.heads, case.segment_lengths, case.dilation_rates,
                                causal, case.offsets, case.head_groups)
  ref_out, ref_lse, ref_grads = reference_np.attention(
      q, k, v, m[None] * reference_np.same_document(*ids), case.head_dim ** -0.5, dout, dlse)
  tol = helpers.TOL[jnp.bfloat16]
  assert out.dtype == jnp.bfloat16 and helpers.rel_err(out, ref_out) < tol
  helpers.check_lse(lse, ref_lse, tol)
  for g, ref in zip(grads, ref_grads):
    assert g.dtype == jnp.bfloat16 and helpers.rel_err(g, ref) < 2 * tol


@INTERPRET
@pytest.mark.slow  # ~45 s interpreted, CI's largest; a Hopper runs the kernels with ids for
# real (test_mosaic_packed_on_a_gpu), test_mosaic_packed_lowers_for_the_gpu lowers them here
# and test_mosaic_packed_items_taken_by_several_programs runs dynamic work's here
def test_mosaic_packed_matches_the_reference():
  """LongNet, causal, GQA, in rows of whole 128-blocks (launches of an unstrided and strided
  branches: the forward, dq and dk/dv kernels, split): documents of ~60 tokens, so the
  kernels skip blocks outside a tile's documents, run blocks inside one document's run
  unmasked and compare ids in the others; the ids are negative and reused by documents far
  apart (a document's tokens scattered). Per-head ids, as ring steps pass them: the second
  query head's differ from the key/value head's it reads (dk/dv's windows: the union over
  its query heads, the run they all share)."""
  case = helpers.Case(512, 2, 1, (128, 256, 512), (1, 1, 2), head_dim=64)
  ids = np.asarray(packed_ids(1, case.n, 60, seed=7))  # 8 documents of 22-180 tokens
  ids = (ids * 7919) % 5 - 2  # 5 ids for 8 documents: some come back later in the row
  assert len(np.unique(ids)) == 5 and np.count_nonzero(np.diff(ids)) == 7
  other = np.asarray(packed_ids(1, case.n, 60, seed=8)) % 4  # head 1's documents
  _check_mosaic(case, True, (jnp.asarray(np.stack([ids, other], -1), jnp.int32),
                             jnp.asarray(ids[..., None], jnp.int32)))


@INTERPRET
@pytest.mark.slow  # ~35 s interpreted (a GPU: a partial last block, test_mosaic_packed_on_a_gpu)
def test_mosaic_packed_one_segment_of_any_length():
  """Full attention, not causal, at N = 300 (a partial last block, past which nothing is
  read): pieces of several blocks, so each tile's document windows decide which blocks are
  walked at both ends; a program per item (ring steps' config) and the fused backward (dq
  added by the dk/dv kernel). Windows of the padded tile rows stay empty."""
  case = helpers.Case(300, 2, 2, (300,), (1,), head_dim=64)
  ids = packed_ids(1, case.n, 80, seed=4)  # documents of 41, 67 and 192 tokens
  _check_mosaic(case, False, (ids, ids),
                config=mosaic.Config(interpret=True, persistent=False, fused_backward=True))


@INTERPRET
@pytest.mark.parametrize("fused", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_mosaic_packed_items_taken_by_several_programs(monkeypatch, fused):
  """Dynamic work (`Work.mine`: the packed forward's and dk/dv kernel's persistent programs
  take items from a counter) with three programs, each starting at its own item: interpret
  mode runs one program after another, so the first takes every item but the others' first
  ones, and those take theirs and stop. Every item is walked, and each dk/dv item loads the
  next one's rows before its epilogue (fused: after the other consumer's last dq turn): the
  causal forward, lse and gradients against the float64 reference (the dq kernel keeps its
  static work)."""
  of = mosaic_plan.Work.of.__func__

  def three(cls, sched, batch, config, reverse, ranges, packed=False, claims=False):
    work = of(cls, sched, batch, config, reverse, ranges, packed, claims)
    return dataclasses.replace(work, dynamic=True, persistent=True, plan=None,
                               programs=min(3, work.items)) if claims else work

  monkeypatch.setattr(mosaic_plan.Work, "of", classmethod(three))
  case = helpers.Case(512, 2, 1, (512,), (1,), head_dim=64)  # 4 items of 128 rows a head
  ids = jnp.asarray(packed_ids(1, case.n, 60, seed=7))
  _check_mosaic(case, True, (ids, ids),
                config=mosaic.Config(interpret=True, fused_backward=fused))


# With `-m slow` (~17 s): documents of a median of 400 tokens but for the dq kernel's blocks
# (64 keys) in strided launches and the forward's (128) in full ones; the medians of 60 take
# every consumer's blocks in both.
@pytest.mark.parametrize("name,median,keys,block", [
    pytest.param(name, median, keys, block, marks=pytest.mark.slow)
    if median == 400 and (name, keys, block) not in (("strided", True, 64), ("full", True, 128))
    else (name, median, keys, block)
    for keys, block in ((True, 128), (True, 64), (False, 64))
    for name, median in (("full", 60), ("strided", 60), ("full", 400), ("strided", 400))])
def test_consumers_skip_only_blocks_their_rows_cannot_see(name, median, keys, block):
  """A consumer's blocks (`mosaic_plan.Ranges` with its `rows` and windows), evaluated here
  for every item (128 rows, 64 a consumer), consumer and piece of a causal pattern's launches,
  against which pairs its rows see: blocks of keys (`keys`: the forward's 128, dq's 64) or of
  queries (dk/dv's 64), in full attention and in launches of strided rows ((256, 512, 1024) x
  (1, 2, 4)); rows packed with documents of a median of 60 or 400 tokens (the keys' ids equal
  to the queries', or, strided, a third of the documents' differing: the windows of a ring
  step's ids), and without ids. The blocks of `[lo, s0)` and `[s1, hi)` (which the backward
  kernels skip) hold no pair the consumer's rows see, those it runs unmasked (`[a, b)`) only
  such pairs, and each such pair lies in `[lo, hi)` and among the keys or queries `[x0, x1)`
  (by which the forward halves its masked blocks: the first consumer's diagonal, documents'
  starts). There are skipped blocks: without ids, where blocks are the rows' size, the second
  consumer's first query block (dk/dv) and the first's last key block (dq); with short
  documents' ids also the other documents' blocks of items across two documents. The pieces
  inside the run common to an item's rows (long documents' some), whose blocks are worked out
  as without ids, get the blocks the windows give."""
  n, rows, heads = 1024, 64, 2
  pattern = (DilatedPattern((n,), (1,), causal=True) if name == "full" else
             DilatedPattern((256, 512, 1024), (1, 2, 4), causal=True))
  q_ids = np.asarray(packed_ids(1, n, median, seed=7))
  k_ids = q_ids if name == "full" else np.where(q_ids % 3 == 1, q_ids + 1000, q_ids)
  row_ids, block_ids = (q_ids, k_ids) if keys else (k_ids, q_ids)
  skipped, halved, inside = {}, {}, 0
  for packed in (True, False):
    skipped[packed] = halved[packed] = 0
    for fused in schedule.launches(pattern, n, heads, min_row=2 * rows):
      sched = schedule.build(pattern, n, heads, heads, fused, not keys)
      L = sched.stride
      n_pad = -(-n // (8 * L)) * 8 * L
      ranges = mosaic_plan.Ranges(keys, n, L, True, 2 * rows, block)
      kernel_ids = mosaic._ids(jnp.asarray(q_ids), jnp.asarray(k_ids), 1, keys=not keys)
      tiles = mosaic_pipeline.IdTiles.of(
          kernel_ids, mosaic_plan.out_length(sched, n_pad, 2 * rows), L, rows)
      table = tiles.inputs(kernel_ids, n_pad)[3]
      table_rows, pieces, bias = sched.arrays()
      program = lambda item: mosaic_plan.Program.decode(table_rows.reshape(-1), sched,
                                                        2 * rows, n, item, False)

      @jax.jit  # a launch's blocks: one compiled call an (item, consumer, piece)
      def blocks(item, wg, at0, at1, p, packed=packed):
        prog = program(item)
        window = ((*tiles.window(table, prog, 0, 1), *tiles.window(table, prog, wg))
                  if packed else None)
        piece, *bounds = ranges(prog, pieces.reshape(-1), bias, (at0, at1), window)(p)
        where = (piece.first, piece.stride, piece.count)
        if not packed:
          return where, bounds, None, False
        # The same windows without a common run: always cut by them.
        windowed = ranges(prog, pieces.reshape(-1), bias, (at0, at1),
                          (*window[:2], common.FAR, -1, *window[4:]))(p)[1:]
        return where, bounds, windowed, mosaic_plan._windowed(piece, prog.base, window,
                                                              lambda _, w: w is None)

      fields = jax.jit(lambda item: [getattr(program(item), name) for name in
                                     ("base", "first", "nrows", "start", "p0", "p1")])
      for item in range(int(np.prod(sched.grid(1, 2 * rows)))):
        base, first, count, start, p0, p1 = (int(x) for x in fields(item))
        for wg in range(2):
          mine = np.arange(start + wg * rows, min(start + (wg + 1) * rows, count))
          if not len(mine):
            continue
          at = first + L * mine  # this consumer's rows' positions in their period
          ends, at = (at[0], at[-1]), at + base
          for p in range(p0, p1):
            (p_first, stride, length), bounds, windowed, in_run = jax.device_get(
                blocks(item, wg, *ends, p))
            lo, s0, a, b, s1, hi, x0, x1 = (int(x) for x in bounds)
            if packed:
              assert [int(x) for x in windowed] == [lo, s0, a, b, s1, hi, x0, x1]
              inside += bool(in_run)
            assert lo <= s0 <= a <= b <= s1 <= hi
            other = base + int(p_first) + int(stride) * np.arange(int(length))
            sees = at[:, None] >= other[None] if keys else at[:, None] <= other[None]
            if packed:
              sees &= row_ids[0][at][:, None] == block_ids[0][other][None]
            seen = [sees[:, j * block:(j + 1) * block] for j in range(-(-len(other) // block))]
            assert not any(seen[j].any() for j in [*range(lo, s0), *range(s1, hi)])
            assert not sees[:, :x0].any() and not sees[:, x1:].any()
            half = block // 2
            for j in [*range(s0, a), *range(b, s1)]:  # masked: the forward's halves
              meets = [x0 < j * block + c + half and x1 > j * block + c for c in (0, half)]
              for c, meet in zip((0, half), meets):
                assert meet or not sees[:, j * block + c:j * block + c + half].any()
              halved[packed] += meets.count(True) == 1
            assert all(seen[j].all() and seen[j].shape[1] == block for j in range(a, b))
            assert not any(seen[j].any() for j in [*range(min(lo, len(seen))),
                                                   *range(hi, len(seen))])
            skipped[packed] += (s0 - lo) + (hi - s1)
  # Without ids, where blocks are the rows' size, at least the diagonal's; more with short
  # documents' ids (long ones' windows may cut the blocks from the walk instead).
  assert skipped[False] >= (block == rows)
  assert skipped[True] > skipped[False] or median == 400
  if keys and block == 2 * rows:  # the forward's halved blocks: the first consumer's diagonal,
    assert halved[False] > 0  # and with short documents' ids also their starts
    assert halved[True] > halved[False] or median == 400
  assert inside > 0 or median == 60 or name == "full"  # (full: pieces of the whole row)


@pytest.mark.parametrize("stride", [1, 4])
def test_pieces_inside_the_common_run_skip_the_windows(stride):
  """`mosaic_plan._windowed` works a piece's blocks out without windows exactly where all of
  its positions lie in the run common to an item's rows (`window[2:4]`): that run's ends one
  stride before, at and one stride after the piece's first and last positions, strided
  pieces and pieces of one position (the branch a predicate off by a stride would take runs
  a neighbouring document's keys unmasked)."""
  base, first = 1000, 8
  at = base + first
  for count in (1, 2, 5):
    last = at + stride * (count - 1)
    piece = mosaic_plan._Piece(head=jnp.int32(0), first=jnp.int32(first),
                               stride=jnp.int32(stride), count=jnp.int32(count),
                               bias=jnp.float32(0.0))
    for c0 in (at - stride, at, at + stride):
      for c1 in (last - stride, last, last + stride):
        with jax.disable_jit():
          taken = mosaic_plan._windowed(piece, jnp.int32(base), (0, 10 ** 6, c0, c1),
                                        lambda _, w: w is None)
        assert bool(taken) == (c0 <= at and last <= c1), (count, c0 - at, c1 - last)


def _wide(ids):
  """64-bit ids (JAX's 64-bit mode keeps them) apart only beyond their low 32 bits: document
  `d`'s id is `d * 2**32 - 5`, so that narrowed to their low bits every document is one."""
  return np.asarray(ids, np.int64) * 2 ** 32 - 5


def test_int32_ids_keep_ids_apart():
  """`common.int32_ids`: int32 ids equal exactly where the given ones are, the queries' with
  the keys' (any pair of the call's): 64-bit ids (64-bit mode) apart only beyond 32 bits or
  in their sign bit, uint64's past int64's range, uint32's past int32's; narrower ids as
  they are."""
  rng = np.random.default_rng(3)
  values = {np.int64: [-2 ** 63, -5, 2 ** 32 - 5, 2 ** 33 - 5, 2 ** 63 - 5, 7],
            np.uint64: [0, 2 ** 32, 2 ** 63, 2 ** 64 - 1, 2 ** 63 - 1],
            np.uint32: [0, 2 ** 31, 2 ** 32 - 1, 2 ** 31 - 1], np.int8: [-128, 0, 127]}
  with jax.enable_x64():
    for dtype, vals in values.items():
      vals = np.array(vals, dtype)
      given = (vals[rng.integers(0, len(vals), (2, 48, 2))],  # per head, as ring steps pass
               vals[rng.integers(0, len(vals), (2, 48))])
      got = [np.asarray(x) for x in common.int32_ids(tuple(jnp.asarray(x) for x in given))]
      assert all(x.dtype == np.int32 for x in got), dtype
      equal = lambda a, b: a.ravel()[:, None] == b.ravel()[None]
      for i, j in ((0, 1), (0, 0), (1, 1)):
        assert np.array_equal(equal(got[i], got[j]), equal(given[i], given[j])), dtype
      if dtype is np.int8:
        assert all(np.array_equal(a, b) for a, b in zip(got, given))


@pytest.fixture
def x64():
  """JAX's 64-bit mode switched on for the test, as a program does (`jax.config.update`: the
  interpreted mosaic kernels run in a callback, on a thread `jax.enable_x64()` leaves alone)."""
  before = jax.config.jax_enable_x64
  jax.config.update("jax_enable_x64", True)
  try:
    yield
  finally:
    jax.config.update("jax_enable_x64", before)


@pytest.mark.pallas
@pytest.mark.usefixtures("x64")
def test_pallas_in_64_bit_mode():
  """JAX's 64-bit mode: the kernels traced as without it (`common.in_32_bits`; Python ints
  would be int64 there, which their index arithmetic does not mix with), and 64-bit ids apart
  only beyond 32 bits kept apart (`common.int32_ids`): forward, lse and gradients against the
  float64 reference: two branches, causal, documents of 3-15 tokens."""
  case = helpers.Case(64, 2, 1, (32, 64), (1, 2))
  ids = jnp.asarray(_wide(packed_ids(1, case.n, 12, seed=10)))  # 7 documents
  assert ids.dtype == jnp.int64
  check_packed(case, True, jnp.float32, ids, implementation="pallas")


@INTERPRET
@pytest.mark.usefixtures("x64")
def test_mosaic_in_64_bit_mode():
  """As `test_pallas_in_64_bit_mode`, the mosaic kernels interpreted: full causal
  attention, documents of ~40 tokens whose ids differ only beyond 32 bits."""
  case = helpers.Case(128, 2, 1, (128,), (1,), head_dim=64)
  ids = jnp.asarray(_wide(packed_ids(1, case.n, 40, seed=7)))
  _check_mosaic(case, True, (ids, ids))


def test_id_windows():
  """`common.id_windows` against a direct count: each query's first and last key of its id
  (none: u0 > u1) and the run of equal keys around its own position (where that key has the
  query's id), with reused, negative and absent ids, and queries whose ids differ from the
  keys' (ring steps); ids equal modulo N (40) share a window spanning both documents."""
  rng = np.random.default_rng(7)
  k_ids = rng.integers(-2, 3, (3, 40)).astype(np.int32)
  q_ids = np.where(rng.random((3, 40)) < 0.7, k_ids, rng.integers(-4, 5, (3, 40))).astype(np.int32)
  k_ids[2, 30:] += 80  # 80 apart: the same slot of 40 as the unshifted ids
  windows = np.asarray(common.id_windows(jnp.asarray(q_ids), jnp.asarray(k_ids)))
  for b in range(3):
    for t in range(40):
      u0, u1, r0, r1 = windows[:, b, t]
      same = np.flatnonzero(k_ids[b] == q_ids[b, t])
      alike = np.flatnonzero(k_ids[b] % 40 == q_ids[b, t] % 40)
      if len(alike):
        assert (u0, u1) == (alike[0], alike[-1])
        assert b == 2 or np.array_equal(same, alike)
      else:
        assert u0 > u1
      if k_ids[b, t] == q_ids[b, t]:
        lo, hi = t, t
        while lo > 0 and k_ids[b, lo - 1] == k_ids[b, t]:
          lo -= 1
        while hi < 39 and k_ids[b, hi + 1] == k_ids[b, t]:
          hi += 1
        assert (r0, r1) == (lo, hi)
      else:
        assert r0 > r1
  assert (windows[1, 2] > np.array([np.flatnonzero(k_ids[2] == i)[-1] if (k_ids[2] == i).any()
                                    else -1 for i in q_ids[2]])).any()  # a window did widen


def test_mosaic_takes_packed_problems(monkeypatch):
  """mosaic's `supports` (on a Hopper GPU, faked) takes packed forwards, backwards and token
  steps (these in interpret mode here, as the step's config asks)."""
  problem = backends.Problem((1, 1024, 2, 64), (1, 1024, 1, 64), jnp.dtype(jnp.bfloat16),
                             DilatedPattern((1024,), (1,)), platform="gpu", segment_ids=True)
  monkeypatch.setattr(mosaic, "is_hopper", lambda: True)
  step = dataclasses.replace(problem, q_shape=(1, 1, 2, 64), step=True, interpret=True)
  for p in (problem, dataclasses.replace(problem, backward=True), step):
    support = mosaic.supports(p)
    assert bool(support) == (jax.__version_info__ >= (0, 11)), support


@pytest.mark.skipif(jax.__version_info__ < (0, 11), reason="Mosaic GPU lowering: JAX >= 0.11")
@pytest.mark.slow  # ~45 s; test_mosaic.py lowers the kernels without ids by default
def test_mosaic_packed_lowers_for_the_gpu(monkeypatch):
  """The packed kernels go through Mosaic GPU's own lowering for CUDA on a CPU (not only the
  interpreter): an unstrided and a strided launch, causal, per-head ids (shared ones take
  the same code, reading head 0), forward (outputs in q's dtype and in float32) and
  backward, and the token step of a packed cache."""
  per_head = True
  pattern = DilatedPattern((128, 256, 1024), (1, 1, 4), causal=True)
  q = jax.ShapeDtypeStruct((1, 1024, 2, 128), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((1, 1024, 1, 128), jnp.bfloat16)
  ids = tuple(jax.ShapeDtypeStruct((1, 1024) + ((x.shape[2],) if per_head else ()), jnp.int32)
              for x in (q, kv))
  lse = jax.ShapeDtypeStruct((1, 1024, 2), jnp.float32)
  lower = lambda f, *args: jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  text = lower(lambda q, k, v, *ids: mosaic.forward(q, k, v, pattern, 0.1, out_dtype=q.dtype,
                                                    segment_ids=ids), q, kv, kv, *ids)
  assert text.count("mosaic_gpu") >= 2
  # The ids' windows are computed without XLA while loops (each level's predicate would be
  # read on the host: a wait for the device in every call).
  assert "stablehlo.while" not in text
  # Float32 outputs (a ring step's partials): a tile of their own beside the ids' buffers
  # (each buffer placed at a multiple of 1 KiB) still fits in shared memory.
  lower(lambda q, k, v, *ids: mosaic.forward(q, k, v, pattern, 0.1, segment_ids=ids),
        q, kv, kv, *ids)
  # The backward, fused (the unstrided launch: its 193 keys a head under a lowered bound) and
  # split (the strided one): 1 + 2 kernels.
  monkeypatch.setattr(mosaic_plan, "_FUSED_UNSTRIDED_KEYS", 0)
  text = lower(lambda q, k, v, do, lse, delta, *ids: mosaic.backward(
      q, k, v, do, lse, delta, pattern, 0.1, grad_dtype=q.dtype, segment_ids=ids),
               q, kv, kv, q, lse, lse, *ids)
  assert "stablehlo.while" not in text
  assert text.count("stablehlo.custom_call @mosaic_gpu") == 3
  # Full causal attention's long items, which the forward's and the dk/dv kernel's programs
  # take from a counter (`Work.mine`, dynamic work: an atomic add inlined through
  # `plgpu.inline_mgpu`; the counter a `hopper.Zeroed` buffer, beside dq's accumulator in
  # dk/dv), through the kernel contract's custom_jvp halves as `dilated_attention` runs them.
  n = 32768
  full = DilatedPattern((n,), (1,), causal=True)
  rows = [jax.ShapeDtypeStruct((1, n, h, 128), jnp.bfloat16) for h in (2, 1, 1)]
  one = jax.ShapeDtypeStruct((1, n), jnp.int32)
  kernel = helpers.Kernels(mosaic, full, 0.1, None)
  attend = lambda q, k, v, ids: backends.attention(q, k, v, kernel, (ids, ids))[0]
  forward = lower(attend, *rows, one).count("atomic_rmw")
  both = lower(lambda q, k, v, ids, do: jax.vjp(lambda *x: attend(*x, ids), q, k, v)[1](do),
               *rows, one, rows[0]).count("atomic_rmw")
  assert forward > 0 and both > forward
  # The token step of a packed cache (reading each slot from its `first` position).
  from hilbert_ring_jax import decode  # pylint: disable=import-outside-toplevel
  from hilbert_ring_jax.backends import mosaic_decode  # pylint: disable=g-import-not-at-top
  cache = jax.eval_shape(lambda q, k, ids: decode.dilated_attention_prefill(
      q, k, k, pattern, segment_ids=ids)[1], q, kv, jax.ShapeDtypeStruct((1, 1024), jnp.int32))
  tables = decode._tables(pattern, 2, 1)  # pylint: disable=protected-access
  text = lower(lambda q, ks, vs, length, first: mosaic_decode.step(
      q, ks, vs, length, tables, 0.1, None, first), jax.ShapeDtypeStruct((1, 2, 128),
      jnp.bfloat16), cache.k, cache.v, cache.length, cache.first)
  assert "mosaic_gpu" in text


@INTERPRET
def test_mosaic_token_steps_continue_the_last_document():
  """Packed caches on the token-step kernel: after a packed prefill, each new token reads
  only its row's last document. Row 0's last run starts past the current segments' first
  blocks in both branches, and its id marks an earlier run in reach of both (moved next to
  the last run: the blocks before skipped, the next masked); row 1's starts before one
  segment and inside the other's first block; against the float64 reference."""
  from hilbert_ring_jax.backends import mosaic_decode  # pylint: disable=g-import-not-at-top
  case = helpers.Case(236, 4, 2, (128, 256), (1, 2), head_dim=64, batch=2)
  ids = np.zeros((2, case.n), np.int32)
  ids[0, 90:], ids[0, 150:], ids[0, 200:] = 1, 2, 1  # row 0: its last run starts at 200
  ids[1, 20:] = 5                    # row 1: at 20
  _check_token_steps(case, helpers.random_inputs(case, jnp.bfloat16, 13)[:3], ids, 233,
                     mosaic_decode.Config(interpret=True, block_k=64, splits=2))


def _check_token_steps(case, qkv, ids, prompt, config=None):
  """A packed prefill of `prompt` tokens, then mosaic's token steps (`config`) to `case.n`,
  against the float64 reference with `ids` (the steps' own: their row's last document)."""
  from hilbert_ring_jax import (  # pylint: disable=import-outside-toplevel
      dilated_attention_prefill, dilated_attention_step)
  (q, k, v), pattern = qkv, case.pattern(True)
  _, cache = dilated_attention_prefill(q[:, :prompt], k[:, :prompt], v[:, :prompt], pattern,
                                       segment_ids=jnp.asarray(ids[:, :prompt]))
  outs = []
  for t in range(prompt, case.n):
    out, cache = dilated_attention_step(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], cache,
                                        pattern, implementation="mosaic", config=config)
    outs.append(out)
  m = reference_np.multiplicity(case.n, case.heads, case.segment_lengths, case.dilation_rates,
                                True)
  ref = reference_np.attention(q, k, v, m[None] * reference_np.same_document(ids),
                               case.head_dim ** -0.5)[0]
  assert helpers.rel_err(jnp.concatenate(outs, axis=1), ref[:, prompt:]) < \
      helpers.TOL[jnp.bfloat16]


@pytest.mark.gpu
@pytest.mark.parametrize("segments,rates,causal,fuses", [
    ((4000,), (1,), True, True), ((1024, 2048, 4096), (1, 2, 4), False, False),
    ((2048, 8192), (1, 2), False, "where registers move")])
def test_mosaic_packed_on_a_gpu(segments, rates, causal, fuses, monkeypatch):
  """On Hopper the mosaic kernels themselves (not a fallback: `implementation="mosaic"`) run
  packed rows, bf16, D = 128, against the float64 reference: full causal attention at N =
  4000 (a partial last block), LongNet (strided launches whose queries read few keys: a dq
  kernel of their own), and a launch of a rate-1 and a rate-2 branch over 8192 tokens (4,096
  keys a head: its dq inside the dk/dv kernel where `setmaxnreg` moves registers), forward,
  lse and gradients; the launches that add dq in their dk/dv kernel counted."""
  if not mosaic.is_hopper():
    pytest.skip("the mosaic kernels run on Hopper GPUs")
  n = segments[0] if len(segments) == 1 else segments[-1]
  case = helpers.Case(n, 4, 2, segments, rates, head_dim=128)
  fused = helpers.fused_launches(monkeypatch)
  check_packed(case, causal, jnp.bfloat16, packed_ids(1, n, 300, seed=18),
               implementation="mosaic")
  assert bool(fused) == (mosaic_plan.REGISTERS_MOVE if fuses == "where registers move" else fuses)


@pytest.mark.gpu
@pytest.mark.parametrize("name,dtype", [(name, jnp.float32) for name in CASES]
                         + [("longnet_4096", jnp.bfloat16), ("scattered", jnp.float32),
                            ("per_head", jnp.float32)])
def test_triton_packed_on_a_gpu(name, dtype):
  """The triton kernels themselves (`implementation="triton"`) run packed rows against the
  float64 reference, forward, lse and gradients: the CPU suite's cases in float32 (several
  launches, strided pieces, GQA, head groups, a batch of 2), causal LongNet at 4096 tokens in
  bf16 (D = 128), ids that come back later in the row, and the contract's per-head ids."""
  pytest.importorskip("jax_triton")
  if name == "per_head":  # the backend contract's per-head ids, as ring steps pass them
    b, n, h, hkv, d = 1, 256, 4, 2, 64
    rng = np.random.default_rng(5)
    q, dout = (jnp.asarray(rng.standard_normal((b, n, h, d)), jnp.float32) for _ in range(2))
    k, v = (jnp.asarray(rng.standard_normal((b, n, hkv, d)), jnp.float32) for _ in range(2))
    kv_ids = jnp.asarray(np.sort(rng.integers(0, 6, (b, n, hkv)), axis=1), jnp.int32)
    ids = (jnp.repeat(kv_ids, h // hkv, axis=2), kv_ids)
    pattern = DilatedPattern((64, 256), (1, 2), causal=True)
    triton = backends.load("triton")

    @jax.jit
    def passes(q, k, v, dout):
      out, lse = triton.forward(q, k, v, pattern, d ** -0.5, segment_ids=ids)
      delta = jnp.sum(dout * out, axis=-1)
      return out, lse, triton.backward(q, k, v, dout, lse, delta, pattern, d ** -0.5,
                                       segment_ids=ids)

    out, lse, grads = passes(q, k, v, dout)
    m = reference_np.multiplicity(n, h, (64, 256), (1, 2), True)
    ref_out, ref_lse, ref_grads = reference_np.attention(
        q, k, v, m[None] * reference_np.same_document(*ids), d ** -0.5, dout,
        np.zeros((b, n, h)))
    tol = helpers.TOL[jnp.float32]
    assert helpers.rel_err(out, ref_out) < tol
    helpers.check_lse(lse, ref_lse, tol)
    for g, ref in zip(grads, ref_grads):
      assert helpers.rel_err(g, ref) < 2 * tol
    return
  if name == "longnet_4096":
    case, causal = helpers.Case(4096, 4, 2, (512, 1024, 2048, 4096), (1, 2, 4, 8),
                                head_dim=128), True
    ids = packed_ids(1, 4096, 400, seed=15)
  elif name == "scattered":
    case, causal = helpers.Case(512, 2, 1, (128, 512), (1, 2)), True
    ids = jnp.asarray(np.tile(np.repeat([7, -3, 7, 2], 16), 8)[None], jnp.int32)
  else:
    case, causal, median = CASES[name]
    ids = packed_ids(case.batch, case.n, median, seed=len(name))
  check_packed(case, causal, dtype, ids, implementation="triton")


@pytest.mark.gpu
@pytest.mark.parametrize("implementation", ["mosaic", "triton", "pallas"])
@pytest.mark.usefixtures("x64")
def test_kernels_in_64_bit_mode_on_a_gpu(implementation):
  """On a GPU in JAX's 64-bit mode, each kernel backend itself runs packed rows whose 64-bit
  ids differ only beyond 32 bits: causal LongNet at 4096 tokens, bf16, D = 128, forward, lse
  and gradients against the float64 reference; mosaic's token-step kernel too, after a
  packed prefill (its new tokens continue the last document)."""
  if implementation == "mosaic" and not mosaic.is_hopper():
    pytest.skip("the mosaic kernels run on Hopper GPUs")
  if implementation == "triton":
    pytest.importorskip("jax_triton")
  case = helpers.Case(4096, 4, 2, (512, 1024, 2048, 4096), (1, 2, 4, 8), head_dim=128)
  ids = _wide(packed_ids(1, case.n, 400, seed=15))
  check_packed(case, True, jnp.bfloat16, jnp.asarray(ids), implementation=implementation)
  if implementation != "mosaic":
    return
  prompt = case.n - 4
  ids[:, prompt:] = ids[:, prompt - 1]
  _check_token_steps(case, helpers.random_inputs(case, jnp.bfloat16, 4)[:3], ids, prompt)


@pytest.mark.gpu
def test_mosaic_packed_kernels_take_items_as_programs_free_up(monkeypatch):
  """The packed forward's and dk/dv kernel's persistent programs take their items from a
  counter in global memory (`Work.mine`, dynamic work; the default where full causal
  attention's items would each be a program): at 1,024 items a launch, over the SMs, the
  output, lse, dk and dv equal those of a program per item (each item computes the same
  either way; the dk/dv kernel loads each next item's rows before its epilogue), and dq
  (added across items in float32) does to rounding; causal documents of ~1K tokens, the
  fused and the split backward."""
  if not mosaic.is_hopper():
    pytest.skip("the mosaic kernels run on Hopper GPUs")
  of, dynamic_launches = mosaic_plan.Work.of.__func__, []

  def spy(cls, *args, **kwargs):
    work = of(cls, *args, **kwargs)
    if work.dynamic:
      dynamic_launches.append("forward" if args[4].keys else "dk/dv")  # (`Ranges.keys`)
    return work

  monkeypatch.setattr(mosaic_plan.Work, "of", classmethod(spy))
  n, heads = 32768, 4
  pattern = DilatedPattern((n,), (1,), causal=True)
  q, k, v, dout = (jax.random.normal(key, (1, n, heads, 128), jnp.bfloat16)
                   for key in jax.random.split(jax.random.PRNGKey(3), 4))
  ids = jnp.asarray(packed_ids(1, n, 1000, seed=5))

  def passes(config):
    attend = lambda q, k, v: dilated_attention(q, k, v, pattern, implementation="mosaic",
                                               config=config, segment_ids=ids)
    out, vjp = jax.vjp(attend, q, k, v)
    lse = mosaic.forward(q, k, v, pattern, 128 ** -0.5, config=config, out_dtype=q.dtype,
                         segment_ids=(ids, ids))[1]
    return out, lse, *vjp(dout)

  for fused in (True, False):
    dynamic, per_item = (passes(mosaic.Config(persistent=p, fused_backward=fused))
                         for p in (None, False))
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), dynamic, per_item):
      a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
      if name == "dq":  # each element within a few bf16 roundings (a tile's race: far off)
        assert helpers.rel_err(a, b) < 1e-2, name
        np.testing.assert_allclose(a, b, rtol=2 ** -6, atol=2 ** -6 * np.abs(b).max())
      else:
        np.testing.assert_array_equal(a, b, err_msg=name)
  assert {"forward", "dk/dv"} <= set(dynamic_launches), dynamic_launches
