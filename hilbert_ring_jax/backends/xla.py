"""The "xla" backend: segments folded into the batch, a blockwise loop in plain `jnp`.

Runs on every platform and every valid configuration. Per branch, `[B, N, H, D]` is padded to
whole segments and reshaped to `[B, S, w/r, r, H, D]`, so a dilated segment is a contiguous
row of `w/r` tokens: no gather. Residues become batch rows (`offsets="all"`) or are picked per
head with static slices (`offsets="head"`). A scan over key blocks keeps a float32
`(out, lse)` carry combined by the project's one `merge`, so scores never exceed one block
`[rows, key_block]` and memory is linear in N whatever `w` is; a causal branch splits its
queries into blocks too and runs only the tiles that reach the diagonal (`_Tiles`), in packed
rows only those whose blocks may share a document. Padding keys are masked, and so are keys of
another document than the query's (`segment_ids`, folded like the tokens).

The backward follows the kernel contract: it takes the global `lse` and
`delta = rowsum(dout * out) - dlse` and recomputes probabilities blockwise.

`step` is the portable decoding step (decode.py): the new tokens against the slots of the
compressed KV cache they read, any number of tokens, any platform.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from ..merge import merge
from ..pattern import Branch, DilatedPattern, heads_per_kv
from .base import YES, Problem, Support
from .common import ds_operands, einsum, transpose, vary_like


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
  """Tuning of the "xla" backend.

  Attributes:
    key_block: keys per step of the blockwise loop; the score block of a step is
      `[rows, key_block]` (in a causal branch of several blocks, and on a CPU a packed one, an
      eighth of the rows or more), so memory grows with it and the number of steps shrinks.
  """

  key_block: int = 512

  def __post_init__(self):
    if isinstance(self.key_block, bool) or not isinstance(self.key_block, int) or \
        self.key_block < 1:
      raise ValueError(f"key_block must be an int >= 1, got key_block={self.key_block!r}")


def supports(problem: Problem) -> Support:
  """Every valid configuration, on every platform, packed sequences included."""
  del problem
  return YES


@dataclasses.dataclass(frozen=True)
class _Fold:
  """How one branch lays `[B, N, heads, D]` out as rows of dilated segments.

  Query-like arrays become `[B, Z, K, T, D]`: Z rows (segment x residue), K key/value heads,
  and T = M * G query tokens (M per row, times the G query heads sharing a key/value head,
  so GQA needs no key copies). Key-like arrays become `[B, Z, K, M, D]`. This is the natural
  layout of `dot_general`, so the block loop needs no transposes. With `fill=0` both maps are
  linear, and their transposes (`jax.linear_transpose`) unfold outputs and gradients.
  """

  branch: Branch
  per_kv: int     # query heads per key/value head in the inputs

  @property
  def shared(self) -> int:
    """G: query heads sharing a folded key/value head (1 when keys are picked per head)."""
    heads = self.branch.heads
    aligned = heads.start % self.per_kv == 0 and heads.stop % self.per_kv == 0
    return self.per_kv if aligned and not self.branch.per_head else 1

  def _split(self, x, fill):
    """`[B, N, X, D]` -> `[B, S, M, r, X, D]`, padded with `fill` to whole segments."""
    br = self.branch
    x = _pad_axis(x, 1, br.segments * br.w, fill)
    x = x.reshape(x.shape[0], br.segments, br.w, *x.shape[2:])
    x = _pad_axis(x, 2, br.rows * br.r, fill)
    return x.reshape(x.shape[0], br.segments, br.rows, br.r, *x.shape[3:])

  def _fold(self, x, head_of, contiguous, fill):
    """`[B, N, X, D]` -> `[B, Z, E, M, D]` for the E heads picked by `head_of(h)`."""
    x5 = self._split(x, fill)  # [B, S, M, r, X, D]
    heads = self.branch.heads
    if self.branch.per_head:  # one residue per head: static slices stacked over heads
      return jnp.stack([x5[:, :, :, self.branch.residues(h)[0], head_of(h)] for h in heads],
                       axis=2)
    if contiguous:  # a run of heads: one slice
      x5 = x5[..., head_of(heads.start):head_of(heads.stop - 1) + 1, :]
    else:
      x5 = jnp.stack([x5[..., head_of(h), :] for h in heads], axis=-2)
    x5 = jnp.transpose(x5, (0, 1, 3, 4, 2, 5))  # [B, S, r, E, M, D]: residues become rows
    return x5.reshape(x5.shape[0], -1, *x5.shape[3:])

  def query(self, x, fill=0):
    """`[B, N, H, D]` -> `[B, Z, K, T, D]`."""
    x = self._fold(x, lambda h: h, True, fill)  # [B, Z, K * G, M, D]
    b, z, e, m, d = x.shape
    g = self.shared
    return jnp.swapaxes(x.reshape(b, z, e // g, g, m, d), 3, 4).reshape(b, z, e // g, m * g, d)

  def key(self, x):
    """`[B, N, Hkv, D]` -> `[B, Z, K, M, D]`."""
    # Shared key/value heads stay shared (G > 1), or are picked once per query head.
    contiguous = self.shared > 1 or self.per_kv == 1
    return self._fold(x, lambda h: h // self.per_kv, contiguous, 0)

  def query_valid(self, num_heads):
    """`[Z, K, T]` bool: which folded queries are real tokens (padding folds to False)."""
    return self.query(jnp.ones((1, self.branch.n, num_heads, 1), jnp.bool_))[0, ..., 0]

  def key_valid(self, num_kv_heads):
    """`[Z, K or 1, M]` bool: which folded keys are real tokens (padding folds to False)."""
    valid = self.key(jnp.ones((1, self.branch.n, num_kv_heads, 1), jnp.bool_))[0, ..., 0]
    return valid if self.branch.per_head else valid[:, :1]


def _pad_axis(x, axis, length, fill):
  """`x` padded at the end of `axis` with `fill` to `length` (as it is where it has that)."""
  if x.shape[axis] == length:
    return x
  pad = [(0, 0)] * x.ndim
  pad[axis] = (0, length - x.shape[axis])
  return jnp.pad(x, pad, constant_values=fill)


def _folds(pattern: DilatedPattern, q, k, branches):
  per_kv = heads_per_kv(q.shape[2], k.shape[2])
  return [_Fold(br, per_kv) for br in pattern.layout(q.shape[1], q.shape[2], branches)]


def _blocked(x, axis, nb, bk, fill=0):
  """Splits `axis` (padded to `nb * bk` with `fill`) into `nb` blocks, moved to the front."""
  x = _pad_axis(x, axis, nb * bk, fill)
  return jnp.moveaxis(x.reshape(*x.shape[:axis], nb, bk, *x.shape[axis + 1:]), axis, 0)


# Query blocks of a causal branch, at most: a tile is a step of the loop, and a GPU takes some
# 100 us a step whatever its size. 8 skip 7/16 of the pairs (1/2 at most): full causal
# attention at 32K tokens (H200, bf16, H = 16, D = 128, blocks of 512 keys) took 0.78x the
# unskipped forward+backward with 8, 0.83x with 4 and 1.16x with one a key block; on a CPU,
# 0.6x (docs/performance.md, "Measurements behind design choices").
_QUERY_BLOCKS = 8


def _split_documents() -> bool:
  """Whether non-causal branches of packed rows split their queries too, to skip the tiles of
  other documents: on a CPU, where a step costs its arithmetic (non-causal packed full
  attention at 8K tokens 3.1x quicker: docs/performance.md); on a GPU a step takes ~100 us
  whatever it does, and LongNet with every id equal ran 1.45x slower split (4x the steps,
  none skipped)."""
  return jax.default_backend() == "cpu"


@dataclasses.dataclass(frozen=True)
class _Tiles:
  """The blockwise loop of one branch: tiles of a query block against a key block.

  The folded rows split into `nb` key blocks of `bk` rows. A causal branch splits its queries
  into `nq` blocks of `per_query` key blocks' rows (`bq` folded entries: the rows times G) and
  runs only the tiles that reach its diagonal: a key block past a query block's last row holds
  no key it may see (causal order within a row is row order); in packed rows, only those of
  them whose query and key blocks may hold a document in common, in some row (`meets`). A
  non-causal branch of packed rows splits alike on a CPU (`_split_documents`), its tiles every
  pair of blocks whose documents may meet. Otherwise every query is in one block, and the
  tiles are the key blocks. Tiles run query-major, key blocks in order: each query merges its
  blocks in the order a scan over every block would.
  """

  nb: int
  bk: int
  nq: int
  per_query: int  # key blocks per query block (one query block: nb)
  bq: int         # folded query entries (rows times G) per query block
  causal: bool

  @classmethod
  def of(cls, fold, key_block, packed=False):
    rows, causal = fold.branch.rows, fold.branch.causal
    nb = -(-rows // key_block)
    bk = -(-rows // nb)  # the least padding for nb blocks
    if nb > 1 and (causal or packed and _split_documents()):
      m = -(-nb // _QUERY_BLOCKS)
      return cls(nb, bk, -(-nb // m), m, m * bk * fold.shared, causal)
    return cls(nb, bk, 1, nb, rows * fold.shared, causal)

  def pairs(self):
    """`(query block, key block)` index arrays, one entry a tile."""
    last = lambda qi: min(self.nb, (qi + 1) * self.per_query) if self.causal else self.nb
    qi, kj = np.array([(qi, kj) for qi in range(self.nq) for kj in range(last(qi))]).T
    return jnp.asarray(qi, jnp.int32), jnp.asarray(kj, jnp.int32)

  def meets(self, q_ids, q_valid, kv_ids, k_valid):
    """`[tiles]` bool: whether a tile's query and key blocks may hold a token of one document
    in some row, from the ranges of their ids (ids are compared, not ordered: disjoint ranges
    hold no id in common); None without ids or query blocks. `q_ids [B, Z, K, T]`, `q_valid
    [Z, K, T]`, and the blocks of `tiles.keys`."""
    if q_ids is None or self.nq == 1:
      return None
    lim = jnp.iinfo(q_ids.dtype)
    lo = lambda ids, valid: jnp.min(jnp.where(valid, ids, lim.max), axis=-1)
    hi = lambda ids, valid: jnp.max(jnp.where(valid, ids, lim.min), axis=-1)
    by_block = lambda x: jnp.moveaxis(self.pad(x).reshape(*x.shape[:3], self.nq, self.bq), 3, 0)
    q_ids, q_valid = by_block(q_ids), by_block(q_valid[None])  # [nq, B or 1, Z, K, bq]
    k_valid = k_valid[:, None]  # [nb, 1, Z, K', bk]
    qi, kj = self.pairs()
    meet = (lo(q_ids, q_valid)[qi] <= hi(kv_ids, k_valid)[kj]) & \
        (lo(kv_ids, k_valid)[kj] <= hi(q_ids, q_valid)[qi])  # [tiles, B, Z, K]
    return jnp.any(meet, axis=(1, 2, 3))

  def first_row(self, qi):
    """The first row of query block `qi`."""
    return qi * self.per_query * self.bk

  def pad(self, x, fill=0):
    """Folded query-like `x [B, Z, K, T, ...]` padded with `fill` to whole query blocks."""
    return _pad_axis(x, 3, self.nq * self.bq, fill)

  def get(self, x, qi):
    """Query block `qi` of a padded query-like `x`."""
    return jax.lax.dynamic_slice_in_dim(x, qi * self.bq, self.bq, axis=3)

  def put(self, x, qi, y):
    """`x` with its query block `qi` replaced by `y`."""
    return jax.lax.dynamic_update_slice_in_dim(x, y, qi * self.bq, axis=3)

  def keys(self, fold, k, v, valid, kv_ids=None):
    """Key blocks `(k, v [nb, B, Z, K, bk, D], valid [nb, Z, K', bk], kv_ids [nb, B, Z, K, bk]
    or None)`."""
    nb, bk = self.nb, self.bk
    ids = None if kv_ids is None else _blocked(kv_ids, 3, nb, bk)
    return (_blocked(fold.key(k), 3, nb, bk), _blocked(fold.key(v), 3, nb, bk),
            _blocked(valid, 2, nb, bk, fill=False), ids)

  def loop(self, step, carry, meets=None):
    """`step(carry, qi, kj)` over the tiles: `lax.scan`, in Python for a single tile (cheaper
    to compile, same result); with `meets`, a loop over the tiles it marks, in their order
    (no step for the others: a GPU takes as long for a step that does nothing)."""
    if self.nb == 1:
      return step(carry, 0, 0)
    qi, kj = self.pairs()
    if meets is None:
      return jax.lax.scan(lambda c, t: (step(c, *t), None), carry, (qi, kj))[0]
    order = jnp.argsort(~meets, stable=True)
    qi, kj = qi[order], kj[order]
    return jax.lax.fori_loop(0, jnp.sum(meets), lambda t, c: step(c, qi[t], kj[t]), carry)


def _index(blocks, i):
  """Block `i` of each of `blocks` (None passes)."""
  return tuple(None if x is None else jax.lax.dynamic_index_in_dim(x, i, keepdims=False)
               for x in blocks)


def _folded_ids(fold, segment_ids, q, k):
  """`(q_ids [B, Z, K, T], kv_ids [B, Z, K, M])`: each folded token's document, or None.
  The ids come as `[B, N]` (every head alike) or per head, `[B, N, H]` and `[B, N, Hkv]`."""
  if segment_ids is None:
    return None, None
  q_ids, kv_ids = segment_ids
  per_head = lambda ids, x: jnp.broadcast_to(
      ids[..., None] if ids.ndim == 3 else ids[:, :, None, None], (*x.shape[:3], 1))
  return fold.query(per_head(q_ids, q))[..., 0], fold.key(per_head(kv_ids, k))[..., 0]


def _tile_inputs(fold, tiles, q, k, v, segment_ids):
  """`(q_ids, blocks, meets)` of a branch's loop: the queries' folded ids padded to whole
  query blocks (or None), the key blocks (`_Tiles.keys`) and the tiles to run
  (`_Tiles.meets`)."""
  q_ids, kv_ids = _folded_ids(fold, segment_ids, q, k)
  blocks = tiles.keys(fold, k, v, fold.key_valid(k.shape[2]), kv_ids)
  meets = tiles.meets(q_ids, fold.query_valid(q.shape[2]), blocks[3], blocks[2])
  return None if q_ids is None else tiles.pad(q_ids), blocks, meets


def _scores(fold, qs, kb, valid, first_query, first_key, q_ids=None, kv_ids=None):
  """Masked scores `[B, Z, K, bq, bk]` of a block of folded, scaled queries `qs`
  (`_scaled_queries`), from row `first_query` on, against one key block (and its documents
  `kv_ids`, given those of the queries)."""
  acc = jnp.promote_types(qs.dtype, jnp.float32)
  # s: [B, Z, K, bq, bk]
  s = einsum("BZKTD,BZKJD->BZKTJ", qs, kb, preferred_element_type=acc)
  mask = valid[None, :, :, None, :]  # [1, Z, K or 1, 1, bk]
  if q_ids is not None:
    mask = mask & (q_ids[..., :, None] == kv_ids[..., None, :])
  if fold.branch.causal:  # the fold keeps order within a row: j <= i compares row indices
    q_idx = first_query + jnp.arange(qs.shape[3]) // fold.shared
    k_idx = first_key + jnp.arange(kb.shape[3])
    mask = mask & (k_idx[None, :] <= q_idx[:, None])
  return jnp.where(mask, s, -jnp.inf)


def _scaled_queries(qf, scale):
  """`qf * scale` in float32 (float64 for float64 inputs), before the product with the keys.

  The scores are then a matrix product's output, which every fusion reading it sees alike.
  Scaled after the product, XLA recomputes `dot * scale` in each fusion (the row max, the
  exponent) and contracts some into fused multiply-adds: at |s| ~ 1e9 one float32 ulp (64)
  is beyond exp's range, and rows came out inf, NaN or 0 for finite logits."""
  return qf.astype(jnp.promote_types(qf.dtype, jnp.float32)) * scale


def _branch_forward(fold, q, k, v, scale, key_block, segment_ids=None):
  """Folded `(out [B, Z, K, T, D], lse [B, Z, K, T])` of one branch."""
  tiles = _Tiles.of(fold, key_block, packed=segment_ids is not None)
  qf = _scaled_queries(fold.query(q), scale)
  acc = jnp.promote_types(q.dtype, jnp.float32)
  qp = tiles.pad(qf)
  q_idsp, blocks, meets = _tile_inputs(fold, tiles, q, k, v, segment_ids)

  def step(carry, qi, kj):
    kb, vb, valid, ids = _index(blocks, kj)
    s = _scores(fold, tiles.get(qp, qi), kb, valid, tiles.first_row(qi), kj * tiles.bk,
                None if q_idsp is None else tiles.get(q_idsp, qi), ids)
    # Softmax within the tile; the one merge folds it into the carry's query block.
    mx = jnp.max(s, axis=-1)
    mx = jnp.where(jnp.isfinite(mx), mx, 0.0)
    p = jnp.exp(s - mx[..., None])  # s and mx read one product: s - mx <= 0 exactly
    den = jnp.sum(p, axis=-1)
    # ob: [B, Z, K, bq, D]
    ob = einsum("BZKTJ,BZKJD->BZKTD", p.astype(vb.dtype), vb, preferred_element_type=acc)
    ob = ob / jnp.where(den > 0, den, 1.0)[..., None]
    out, lse = merge([tiles.get(carry[0], qi), ob], [tiles.get(carry[1], qi), mx + jnp.log(den)])
    return tiles.put(carry[0], qi, out), tiles.put(carry[1], qi, lse)

  # Typed like the data the steps compute from (inside shard_map, as `lax.scan` needs).
  init = vary_like((jnp.zeros(qp.shape, acc), jnp.full(qp.shape[:-1], -jnp.inf, acc)), q, k, v)
  out, lse = tiles.loop(step, init, meets)
  return out[..., :qf.shape[3], :], lse[..., :qf.shape[3]]


def forward(q, k, v, pattern: DilatedPattern, scale: float, *, branches=None, config=None,
            out_dtype=None, segment_ids=None):
  """`(out [B, N, H, D], lse [B, N, H])` of `branches` (default all), merged: float32 (float64
  for float64 inputs) partials, or `out` in `out_dtype` when given."""
  config = config or Config()
  h = q.shape[2]
  outs, lses = [], []
  for fold in _folds(pattern, q, k, branches):
    o, lse = _branch_forward(fold, q, k, v, scale, config.key_block, segment_ids)
    outs.append(transpose(fold.query, o, q))
    # Padding rows may hold -inf (the transpose would make NaN of them); a covered row sees
    # at least itself, so its lse is not -inf, unless queries and keys are of other documents
    # (NaN and +inf, from such inputs, pass).
    seen = (lse != -jnp.inf)[..., None]
    rows = fold.branch.covered(h, jnp)
    if segment_ids is not None:
      rows = rows & (transpose(fold.query, seen.astype(lse.dtype), q[..., :1])[..., 0] > 0)
    lse = transpose(fold.query, jnp.where(seen[..., 0], lse, 0.0)[..., None], q[..., :1])
    lses.append(jnp.where(rows, lse[..., 0], -jnp.inf))
  out, lse = merge(outs, lses)
  return out.astype(out_dtype or out.dtype), lse


def backward(q, k, v, dout, lse, delta, pattern: DilatedPattern, scale: float, *,
             branches=None, config=None, grad_dtype=None, segment_ids=None):
  """float32 `(dq, dk, dv)` from the global `lse` and `delta = rowsum(dout * out) - dlse`
  (whatever `grad_dtype`)."""
  config = config or Config()
  acc = jnp.promote_types(q.dtype, jnp.float32)
  # A loss like `out.sum()` makes dout a constant; with v a constant too (captured by a jitted
  # gradient with respect to q), XLA would fold dp = dout v^T at compile time, slowly.
  dout = jax.lax.optimization_barrier(dout)
  # p = exp(s - lse) must vanish on rows with no visible key (lse = -inf) and on padding.
  lse = jnp.where(lse == -jnp.inf, jnp.inf, lse.astype(acc))
  dq, dk, dv = (jnp.zeros(x.shape, acc) for x in (q, k, v))
  for fold in _folds(pattern, q, k, branches):
    tiles = _Tiles.of(fold, config.key_block, packed=segment_ids is not None)
    qf = fold.query(q)
    qp, qs = tiles.pad(qf), tiles.pad(_scaled_queries(qf, scale))
    dof = tiles.pad(fold.query(dout))
    lsef = tiles.pad(fold.query(lse[..., None], fill=jnp.inf)[..., 0], fill=jnp.inf)
    deltaf = tiles.pad(fold.query(delta[..., None].astype(acc))[..., 0])
    q_idsp, blocks, meets = _tile_inputs(fold, tiles, q, k, v, segment_ids)

    def step(carry, qi, kj):
      dqf, dkb, dvb = carry
      kb, vb, valid, ids = _index(blocks, kj)
      dob = tiles.get(dof, qi)
      s = _scores(fold, tiles.get(qs, qi), kb, valid, tiles.first_row(qi), kj * tiles.bk,
                  None if q_idsp is None else tiles.get(q_idsp, qi), ids)
      # p <= 1 exactly; clipping keeps float32 rounding of huge logits (s ~ lse ~ 1e9) from
      # giving exp of a large positive error.
      p = jnp.exp(jnp.minimum(s - tiles.get(lsef, qi)[..., None], 0.0))
      dp = einsum("BZKTD,BZKJD->BZKTJ", dob, vb, preferred_element_type=acc)
      ds = p * (dp - tiles.get(deltaf, qi)[..., None]) * scale
      dqf = tiles.put(dqf, qi, tiles.get(dqf, qi) + einsum(
          "BZKTJ,BZKJD->BZKTD", *ds_operands(ds, kb), preferred_element_type=acc))
      # The keys' gradients of the tile: [B, Z, K, bk, D], added into block kj.
      dkt = einsum("BZKTJ,BZKTD->BZKJD", *ds_operands(ds, tiles.get(qp, qi)),
                   preferred_element_type=acc)
      dvt = einsum("BZKTJ,BZKTD->BZKJD", p.astype(dob.dtype), dob, preferred_element_type=acc)
      add = lambda x, y: jax.lax.dynamic_update_index_in_dim(x, _index((x,), kj)[0] + y, kj, 0)
      return dqf, add(dkb, dkt), add(dvb, dvt)

    init = vary_like(tuple(jnp.zeros(x.shape, acc) for x in (qs, *blocks[:2])),
                     q, k, v, dout, lse, delta)
    dqf, dkb, dvb = tiles.loop(step, init, meets)
    # [nb, B, Z, K, bk, D] -> [B, Z, K, M, D]
    rows = fold.branch.rows
    dkb, dvb = (jnp.moveaxis(x, 0, 3).reshape(*x.shape[1:4], -1, x.shape[-1])[..., :rows, :]
                for x in (dkb, dvb))
    dq = dq + transpose(fold.query, dqf[..., :qf.shape[3], :], q)
    dk = dk + transpose(fold.key, dkb, k)
    dv = dv + transpose(fold.key, dvb, k)
  return dq, dk, dv


def _softmax_parts(parts, scale):
  """Softmax over the union of key sets: `parts` is `[(scores, mask, values, spec)]`.

  `scores [B, Hkv, G, T, K_i]` are unscaled float32 dot products, `mask` broadcasts against
  them, and `einsum(spec, p, values)` gives that part's `[B, Hkv, G, T, D]` output; with
  `spec=None`, `values [B, Hkv, T or 1, K_i, D]` are summed against `p` directly (a fused
  reduction: no transposed copy of the values, which a matrix-vector product can cost).
  Returns `(o, lse)`, with `o = 0`, `lse = -inf` where a query sees no key.

  Masked values are not read: a cache's hidden rows (of earlier segments, documents or
  requests, or other heads' residues) may hold a NaN or inf, which `p = 0` would not cancel.
  With `spec=None` each query skips its own; with a `spec`, the keys no query sees are zeroed.
  """
  scores = [jnp.where(mask, scale * s, -jnp.inf) for s, mask, _, _ in parts]
  s_max = functools.reduce(jnp.maximum, [s.max(axis=-1) for s in scores])
  seen = s_max > -jnp.inf
  shift = jnp.where(seen, s_max, 0.0)
  den, o = 0.0, 0.0
  for s, (_, mask, values, spec) in zip(scores, parts):
    p = jnp.exp(s - shift[..., None])  # exactly 0 on masked keys
    den = den + p.sum(axis=-1)
    if spec is None:
      seen_values = jnp.where(mask[..., None], values[:, :, None].astype(jnp.float32), 0.0)
      o = o + (p[..., None] * seen_values).sum(axis=-2)
    else:  # as the kernels do: p in the values' dtype, float32 accumulation
      values = jnp.where(jnp.any(mask, axis=(2, 3))[..., None], values, 0)
      o = o + einsum(spec, p.astype(values.dtype), values, preferred_element_type=jnp.float32)
  safe_den = jnp.where(seen, den, 1.0)
  lse = jnp.where(seen, shift + jnp.log(safe_den), -jnp.inf)
  return o / safe_den[..., None], lse


def _cached_slots(kb, vb, c_t, table):
  """The cache slot each query reads, `[B, Hkv, T, rows, D]`, for `T <= R_b` queries.

  A query of residue `c` reads only keys of residue `c`, so of the `R_b` slots of a kv head
  it needs the one holding `c` (where none does, no query head of that kv head takes part).
  One slot per branch needs no copy; a slot shared by all kv heads is a dynamic slice; else a
  gather.
  """
  if table.slots == 1:
    return kb[:, :, :1], vb[:, :, :1]
  if table.uniform is not None and c_t.shape[0] == 1:
    slot = jnp.asarray(table.uniform)[c_t[0]]
    return (jax.lax.dynamic_slice_in_dim(kb, slot, 1, axis=2),
            jax.lax.dynamic_slice_in_dim(vb, slot, 1, axis=2))
  if table.uniform is not None:
    slot = jnp.asarray(table.uniform)[c_t]                      # [T]
    return jnp.take(kb, slot, axis=2, mode="clip"), jnp.take(vb, slot, axis=2, mode="clip")
  slot = jnp.maximum(jnp.asarray(table.slot)[:, c_t], 0)       # [Hkv, T]
  idx = slot[None, :, :, None, None]
  return (jnp.take_along_axis(kb, idx, axis=2, mode="clip"),
          jnp.take_along_axis(vb, idx, axis=2, mode="clip"))


def _branch_step(qg, k_new, v_new, kb, vb, length, table, scale, first=None):
  """One branch's `(o [B, Hkv, G, T, D], lse [B, Hkv, G, T])` for the new queries.

  Cached rows and the chunk's own keys form one key set (they are disjoint), softmaxed once.
  With `T <= R_b` new tokens (decoding: `T = 1`) each query reads only the cache slot of its
  residue, `rows_b` rows per kv head; longer chunks read all `R_b` slots once. `table`: the
  branch's slot table (decode.py: `w, r, rows, slots`, `slot [Hkv, r]`, `residue [Hkv, R_b]`,
  `takes_part [H, r]`, `uniform`). `first` (None or `[B, r]`): packed rows, each residue's
  cached rows before position `first` not read (decode.py: `KVCache.first`).
  """
  batch, num_kv_heads, group, steps, head_dim = qg.shape
  w, r = table.w, table.r
  f32 = dict(preferred_element_type=jnp.float32)
  t = length + jnp.arange(steps)                        # query positions [T]
  c_t, seg_t = (t % w) % r, t // w
  takes_part = jnp.asarray(table.takes_part)[:, c_t]    # [H, T]
  takes_part = takes_part.reshape(num_kv_heads, group, steps)[None, :, :, :, None]
  # Cached row j of the slot holding residue c is position seg_start(t) + j r + c.
  rows = np.arange(table.rows) * r
  if steps <= table.slots:
    kc, vc = _cached_slots(kb, vb, c_t, table)          # [B, Hkv, T or 1, rows, D]
    kc = jnp.broadcast_to(kc, (batch, num_kv_heads, steps) + kc.shape[3:])
    vc = jnp.broadcast_to(vc, kc.shape)
    offset = rows[None, :] + c_t[:, None]               # [T, rows]
    pos = (seg_t * w)[:, None] + offset
    mask_c = ((offset < w) & (pos < length))[None]      # [1 or B, T, rows]
    if first is not None:
      mask_c = mask_c & (pos[None] >= jnp.take(first, c_t, axis=1)[..., None])
    s_c = einsum("bhgtd,bhtkd->bhgtk", qg, kc, **f32)
    cached = (s_c, mask_c[:, None, None] & takes_part, vc, None)
  else:
    res = np.repeat(table.residue, table.rows, axis=1)   # [Hkv, R rows]
    offset = np.tile(rows, table.slots)[None, :] + res
    static_ok = jnp.asarray((res >= 0) & (offset < w))
    pos = (seg_t * w)[None, :, None] + jnp.asarray(offset)[:, None, :]  # [Hkv, T, R rows]
    mask_c = (static_ok[:, None, :] & (jnp.asarray(res)[:, None, :] == c_t[None, :, None])
              & (pos < length))[None]                    # [1 or B, Hkv, T, R rows]
    if first is not None:  # the first position of each row's residue: [B, Hkv, 1, R rows]
      mask_c = mask_c & (pos[None] >= jnp.take(first, np.maximum(res, 0), axis=1)[:, :, None])
    kc = kb.reshape(batch, num_kv_heads, -1, head_dim)
    vc = vb.reshape(batch, num_kv_heads, -1, head_dim)
    s_c = einsum("bhgtd,bhkd->bhgtk", qg, kc, **f32)
    cached = (s_c, mask_c[:, :, None] & takes_part, vc, "bhgtk,bhkd->bhgtd")
  mask_n = ((seg_t[:, None] == seg_t[None, :]) & (c_t[:, None] == c_t[None, :])
            & (t[None, :] <= t[:, None]))                # [T, T]
  k_new, v_new = k_new.transpose(0, 2, 1, 3), v_new.transpose(0, 2, 1, 3)  # [B, Hkv, T, D]
  s_n = einsum("bhgtd,bhkd->bhgtk", qg, k_new, **f32)
  # Few tokens (decoding): each query skips the keys it does not see (`_softmax_parts`).
  values, spec = ((v_new[:, :, None], None) if steps <= table.slots else
                  (v_new, "bhgtk,bhkd->bhgtd"))
  new = (s_n, mask_n[None, None, None] & takes_part, values, spec)
  return _softmax_parts([cached, new], scale)


def step(q, k, v, ks, vs, length, tables, scale: float, *, config=None, first=None):
  """A decoding step of any T tokens (the contract of `base.py`; every backend without a
  token-step kernel decodes with it, and chunks always do): per branch, each new token
  scored against the cached rows of its residue's slot before `length` and the new tokens
  it sees, one softmax over both (`_branch_step`); branches merged. `config` is not read:
  the portable step has no knobs. `first` (packed rows: one `[B, r]` array a branch): each
  residue's cached rows before that position are not read."""
  del config
  batch, steps, num_heads, head_dim = q.shape
  num_kv_heads = k.shape[2]
  group = heads_per_kv(num_heads, num_kv_heads)
  qg = q.reshape(batch, steps, num_kv_heads, group, head_dim)
  qg = qg.transpose(0, 2, 3, 1, 4)                       # [B, Hkv, G, T, D]
  outs, lses = [], []
  for i, (table, kb, vb) in enumerate(zip(tables, ks, vs)):
    o, lse = _branch_step(qg, k, v, kb, vb, length, table, scale,
                          None if first is None else first[i])
    outs.append(o.transpose(0, 3, 1, 2, 4).reshape(batch, steps, num_heads, head_dim))
    lses.append(lse.transpose(0, 3, 1, 2).reshape(batch, steps, num_heads))
  return merge(outs, lses)
