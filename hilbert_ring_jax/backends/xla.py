"""The "xla" backend: segments folded into the batch, a blockwise loop in plain `jnp`.

Runs on every platform and every valid configuration. Per branch, `[B, N, H, D]` is padded to
whole segments and reshaped to `[B, S, w/r, r, H, D]`, so a dilated segment is a contiguous
row of `w/r` tokens: no gather. Residues become batch rows (`offsets="all"`) or are picked per
head with static slices (`offsets="head"`). A scan over key blocks keeps a float32
`(out, lse)` carry combined by the project's one `merge`, so scores never exceed one block
`[rows, key_block]` and memory is linear in N whatever `w` is. Padding keys are masked.

The backward follows the kernel contract: it takes the global `lse` and
`delta = rowsum(dout * out) - dlse` and recomputes probabilities blockwise.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from ..merge import merge
from ..pattern import DilatedPattern

KEY_BLOCK = 512


@dataclasses.dataclass(frozen=True)
class _Fold:
  """How one branch lays `[B, N, heads, D]` out as rows of dilated segments.

  Query-like arrays become `[B, Z, M, K, G, D]` (Z rows of M tokens; K key/value heads of G
  query heads each), key-like arrays `[B, Z, M, K, D]`. With `fill=0` both maps are linear,
  so their transposes (`jax.linear_transpose`) unfold outputs and gradients.
  """

  n: int                  # sequence length
  w: int                  # effective segment length min(w_b, N)
  r: int                  # dilation rate
  heads: tuple[int, ...]  # the query heads this branch covers
  kv_group: int           # query heads per key/value head in the inputs (H // Hkv)
  per_head: bool          # offsets="head" with r > 1: head h reads residue h % r only
  grouped: bool           # shared key/value heads stay shared (no per-query-head copies)

  @property
  def m(self) -> int:
    return -(-self.w // self.r)

  def _split(self, x, fill):
    """`[B, N, ...]` -> `[B, S, M, r, ...]`, padded with `fill` to whole segments."""
    seg = -(-self.n // self.w)
    pad = [(0, 0)] * x.ndim
    pad[1] = (0, seg * self.w - self.n)
    x = jnp.pad(x, pad, constant_values=fill).reshape(x.shape[0], seg, self.w, *x.shape[2:])
    pad = [(0, 0)] * x.ndim
    pad[2] = (0, self.m * self.r - self.w)
    x = jnp.pad(x, pad, constant_values=fill)
    return x.reshape(x.shape[0], seg, self.m, self.r, *x.shape[3:])

  def _rows(self, x, pick, fill):
    """`[B, N, Hx, D]` -> `[B, Z, M, len(heads) or kv heads, D]`."""
    x5 = self._split(x, fill)  # [B, S, M, r, Hx, D]
    if self.per_head:  # one residue per head: static slices stacked over heads
      return jnp.stack([x5[:, :, :, h % self.r, pick(h)] for h in self.heads], axis=3)
    if self.grouped:
      x5 = x5[..., pick(self.heads[0]):pick(self.heads[-1]) + 1, :]
    else:
      x5 = jnp.stack([x5[..., pick(h), :] for h in self.heads], axis=-2)
    x5 = jnp.swapaxes(x5, 2, 3)  # residues join the segments as rows
    return x5.reshape(x5.shape[0], -1, *x5.shape[3:])

  def query(self, x, fill=0):
    """`[B, N, H, D]` -> `[B, Z, M, K, G, D]`."""
    rows = self._rows(x, lambda h: h, fill)
    g = self.kv_group if self.grouped else 1
    return rows.reshape(*rows.shape[:3], rows.shape[3] // g, g, rows.shape[4])

  def key(self, x):
    """`[B, N, Hkv, D]` -> `[B, Z, M, K, D]`."""
    return self._rows(x, lambda h: h // self.kv_group, 0)

  def key_valid(self, num_kv_heads):
    """`[Z, M, K or 1]` bool: which folded keys are real tokens (padding folds to False)."""
    valid = self.key(jnp.ones((1, self.n, num_kv_heads, 1), jnp.bool_))[0, ..., 0]
    return valid if self.per_head else valid[..., :1]


def _folds(pattern: DilatedPattern, n: int, num_heads: int, kv_group: int):
  for (w, r), (h0, h1) in zip(pattern.branches, pattern.head_ranges(num_heads)):
    per_head = pattern.offsets == "head" and r > 1
    aligned = h0 % kv_group == 0 and h1 % kv_group == 0
    yield _Fold(n, min(w, n), r, tuple(range(h0, h1)), kv_group, per_head,
                aligned and not per_head)


def _blocked(x, axis, nb, bk, fill=0):
  """Splits `axis` (padded to `nb * bk` with `fill`) into `nb` blocks, moved to the front."""
  pad = [(0, 0)] * x.ndim
  pad[axis] = (0, nb * bk - x.shape[axis])
  x = jnp.pad(x, pad, constant_values=fill)
  return jnp.moveaxis(x.reshape(*x.shape[:axis], nb, bk, *x.shape[axis + 1:]), axis, 0)


def _key_scan(fold, k, v, valid):
  """Key blocks to scan over: `(index, k [B,Z,bk,K,D], v, valid [Z,bk,K'])` and block size."""
  nb = -(-fold.m // KEY_BLOCK)
  bk = -(-fold.m // nb)  # the least padding for nb blocks
  return (jnp.arange(nb), _blocked(fold.key(k), 2, nb, bk), _blocked(fold.key(v), 2, nb, bk),
          _blocked(valid, 1, nb, bk, fill=False)), bk


def _scores(qf, kb, valid, first_key, causal, scale):
  """Masked scores `[B, Z, M, K, G, bk]` of all folded queries against one key block."""
  acc = jnp.promote_types(qf.dtype, jnp.float32)
  # s: [B, Z, M, K, G, bk]
  s = jnp.einsum("BZQKGD,BZJKD->BZQKGJ", qf, kb, preferred_element_type=acc) * scale
  # mask: [1, Z, 1, K or 1, 1, bk]
  mask = jnp.swapaxes(valid, 1, 2)[None, :, None, :, None, :]
  if causal:  # the fold keeps order within a row, so j <= i is a comparison of row indices
    q_idx = jnp.arange(qf.shape[2])
    k_idx = first_key + jnp.arange(kb.shape[2])
    mask = mask & (k_idx[None, :] <= q_idx[:, None])[:, None, None, :]
  return jnp.where(mask, s, -jnp.inf)


def _branch_forward(fold, q, k, v, causal, scale):
  """Folded `(out [B,Z,M,K,G,D], lse [B,Z,M,K,G])` of one branch."""
  qf = fold.query(q)
  acc = jnp.promote_types(q.dtype, jnp.float32)
  blocks, bk = _key_scan(fold, k, v, fold.key_valid(k.shape[2]))

  def step(carry, blk):
    i, kb, vb, valid = blk
    s = _scores(qf, kb, valid, i * bk, causal, scale)
    # Softmax within the block; the one merge folds it into the carry.
    mx = jnp.max(s, axis=-1)
    mx = jnp.where(jnp.isfinite(mx), mx, 0.0)
    p = jnp.exp(s - mx[..., None])
    den = jnp.sum(p, axis=-1)
    # ob: [B, Z, M, K, G, D]
    ob = jnp.einsum("BZQKGJ,BZJKD->BZQKGD", p.astype(vb.dtype), vb,
                    preferred_element_type=acc)
    ob = ob / jnp.where(den > 0, den, 1.0)[..., None]
    return merge([carry[0], ob], [carry[1], mx + jnp.log(den)]), None

  init = (jnp.zeros(qf.shape, acc), jnp.full(qf.shape[:-1], -jnp.inf, acc))
  return jax.lax.scan(step, init, blocks)[0]


def _unfold(fold, x, like):
  """Transpose of `fold.query`: folded `x` back to the `[B, N, H, D]` shape of `like`."""
  spec = jax.ShapeDtypeStruct(like.shape, x.dtype)
  return jax.linear_transpose(fold.query, spec)(x)[0]


def forward(q, k, v, pattern: DilatedPattern, scale: float):
  """`(out [B, N, H, D] in q's dtype, lse [B, N, H] float32)`, branches merged."""
  b, n, h, _ = q.shape
  acc = jnp.promote_types(q.dtype, jnp.float32)
  outs, lses = [], []
  for fold in _folds(pattern, n, h, h // k.shape[2]):
    o, lse = _branch_forward(fold, q, k, v, pattern.causal, scale)
    outs.append(_unfold(fold, o, q))
    # A folded query always sees itself, so covered rows have finite lse; the rest are -inf.
    like = jax.ShapeDtypeStruct((b, n, h, 1), acc)
    covered = _unfold(fold, jnp.ones(lse.shape + (1,), acc), like)[..., 0]
    lse = _unfold(fold, lse[..., None], like)[..., 0]
    lses.append(jnp.where(covered > 0, lse, -jnp.inf))
  out, lse = merge(outs, lses)
  return out.astype(q.dtype), lse.astype(jnp.float32)


def backward(q, k, v, dout, lse, delta, pattern: DilatedPattern, scale: float):
  """`(dq, dk, dv)` from the global `lse` and `delta = rowsum(dout * out) - dlse`."""
  n, h = q.shape[1], q.shape[2]
  acc = jnp.promote_types(q.dtype, jnp.float32)
  # p = exp(s - lse) must vanish on rows with no visible key (lse = -inf) and on padding.
  lse = jnp.where(lse == -jnp.inf, jnp.inf, lse.astype(acc))
  dq, dk, dv = (jnp.zeros(x.shape, acc) for x in (q, k, v))
  for fold in _folds(pattern, n, h, h // k.shape[2]):
    qf, dof = fold.query(q), fold.query(dout)
    lsef = fold.query(lse[..., None], fill=jnp.inf)[..., 0]
    deltaf = fold.query(delta[..., None].astype(acc))[..., 0]
    blocks, bk = _key_scan(fold, k, v, fold.key_valid(k.shape[2]))

    def step(dqf, blk):
      i, kb, vb, valid = blk
      s = _scores(qf, kb, valid, i * bk, pattern.causal, scale)
      p = jnp.exp(s - lsef[..., None])
      # dv, dk: [B, Z, bk, K, D]
      dvb = jnp.einsum("BZQKGJ,BZQKGD->BZJKD", p.astype(dof.dtype), dof,
                       preferred_element_type=acc)
      dp = jnp.einsum("BZQKGD,BZJKD->BZQKGJ", dof, vb, preferred_element_type=acc)
      ds = p * (dp - deltaf[..., None]) * scale
      dqf = dqf + jnp.einsum("BZQKGJ,BZJKD->BZQKGD", ds.astype(kb.dtype), kb,
                             preferred_element_type=acc)
      dkb = jnp.einsum("BZQKGJ,BZQKGD->BZJKD", ds.astype(qf.dtype), qf,
                       preferred_element_type=acc)
      return dqf, (dkb, dvb)

    dqf, (dkb, dvb) = jax.lax.scan(step, jnp.zeros(qf.shape, acc), blocks)
    # [nb, B, Z, bk, K, D] -> [B, Z, M, K, D]
    dkb, dvb = (jnp.moveaxis(x, 0, 2).reshape(*x.shape[1:3], -1, *x.shape[4:])[:, :, :fold.m]
                for x in (dkb, dvb))
    unfold_kv = jax.linear_transpose(fold.key, jax.ShapeDtypeStruct(k.shape, acc))
    dq = dq + _unfold(fold, dqf, q)
    dk = dk + unfold_kv(dkb)[0]
    dv = dv + unfold_kv(dvb)[0]
  return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)
