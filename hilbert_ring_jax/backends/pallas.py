"""The "pallas" backend: blockwise dilated attention as Pallas kernels.

On a GPU the kernels lower through Pallas's Triton backend; everywhere else they run in Pallas
interpret mode, so the CPU test suite checks the very code the GPU compiles.

Per branch `(w, r)`, `[B, N, H, D]` is viewed as `[B, S, M, R, H, D]` (S segments, M dilated
rows of R residues): a free reshape when `N % w == 0`, `w % r == 0` and M is a multiple of the
block size, otherwise a zero-padded copy whose padding the kernels mask from each row's index.
A dilated segment is then one strided row of M tokens, so the BlockSpecs pick a segment, a
residue (`(head_offset + h) % r` for offsets="head", a grid axis for "all") and a head
straight from the view: no gather of q, k, v or out. GQA reads the shared key/value head in
the index map.
In dilated coordinates causality is `key row <= query row`, so the kernels loop over the key
blocks up to the diagonal only; the upper triangle is never loaded.

Packed rows (`segment_ids`): each program also reads its queries' document ids and the key
row's, split like the tokens, and its block's document window, run and id range (`_block_table`:
`common.contract_windows` worked out once over the row, as rows of each branch's dilated row,
reduced per block before the launch), and loops only over the blocks the window reaches. Blocks
inside the run go as without ids. Of the others, a key block whose ids' range `[min, max]`
misses the query block's is skipped; one whose ids and the queries' are all one document runs
without the id comparison; any other block compares ids per score.

Branches combine through the project's one `merge`, inside the forward kernel: each branch
takes the running float32 `(out, lse)` aliased to its outputs and merges its partial into the
rows it covers. The backward follows the kernel contract (global `lse`, `delta`): a dq kernel
and a dk/dv kernel per branch, accumulating into aliased float32 gradients.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ..merge import merge
from ..pattern import Branch, DilatedPattern, heads_per_kv
from .base import YES, Problem, Support, no
from .common import FAR, contract_windows, ds_operands, in_32_bits, reduce_windows

_LOG2E = math.log2(math.e)
_LN2 = math.log(2.0)
_MIN_BLOCK = 16      # Triton's smallest matrix-multiplied block
_MAX_HEAD_DIM = 256  # beyond this the [block, D] float32 tiles no longer fit in registers
_TABLE = 8  # entries of a block's `_block_table` row (6 used: blocks are powers of two)
_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


def _pow2(x: int) -> bool:
  return x >= 1 and x & (x - 1) == 0


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
  """Tile sizes and launch parameters of the kernels (keyword-only; None: tuned defaults).

  Attributes:
    block_q, block_k: forward: query rows per program, key rows per loop step.
    block_q_dq, block_k_dq: dq kernel: query rows per program, key rows per loop step.
    block_q_dkv, block_k_dkv: dk/dv kernel: query rows per loop step, key rows per program.
    num_warps, num_stages: Triton launch parameters of the forward kernel.
    num_warps_bwd, num_stages_bwd: the same for the two backward kernels.
    interpret: run in Pallas interpret mode; None: everywhere but on a GPU (where the
      kernels go through Triton).

  Blocks are powers of two >= 16 (Triton's matrix tiles); a branch whose dilated segment is
  shorter than a block uses the smallest power of two (at least 16) that holds it.
  Example: `Config(block_q=64, block_k=64)` keeps the other fields' defaults.
  """

  block_q: int | None = None
  block_k: int | None = None
  block_q_dq: int | None = None
  block_k_dq: int | None = None
  block_q_dkv: int | None = None
  block_k_dkv: int | None = None
  num_warps: int | None = None
  num_stages: int | None = None
  num_warps_bwd: int | None = None
  num_stages_bwd: int | None = None
  interpret: bool | None = None

  def __post_init__(self):
    for field in dataclasses.fields(self):
      value = getattr(self, field.name)
      if value is None:
        continue
      if field.name == "interpret":
        if not isinstance(value, bool):
          raise ValueError(f"interpret must be a bool or None, got interpret={value!r}")
      elif isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{field.name} must be an int or None, got {field.name}={value!r}")
      elif field.name.startswith("block") and not (_pow2(value) and value >= _MIN_BLOCK):
        raise ValueError(f"{field.name} must be a power of two >= {_MIN_BLOCK}, got "
                         f"{field.name}={value}")
      elif value < 1:
        raise ValueError(f"{field.name} must be >= 1, got {field.name}={value}")

  def resolved(self, head_dim: int, dtype) -> Config:
    """This config with every None filled from the defaults for `head_dim` and `dtype`."""
    interpret = default_interpret() if self.interpret is None else self.interpret
    base = _defaults(head_dim, dtype, interpret)
    return dataclasses.replace(base, interpret=interpret, **{
        f.name: getattr(self, f.name) for f in dataclasses.fields(self)
        if getattr(self, f.name) is not None and f.name != "interpret"})

  @property
  def blocks(self) -> tuple[int, ...]:
    return (self.block_q, self.block_k, self.block_q_dq, self.block_k_dq, self.block_q_dkv,
            self.block_k_dkv)


def _defaults(head_dim: int, dtype, interpret: bool) -> Config:
  """Defaults by head dim and dtype, measured on an H100 (benchmarks/tune_pallas.py;
  docs/performance.md).

  In interpret mode: the smallest tiles, which keep CPU tests fast.
  """
  def tiles(q, k, q_dq, k_dq, q_dkv, k_dkv, warps, stages, warps_bwd, stages_bwd):
    return Config(block_q=q, block_k=k, block_q_dq=q_dq, block_k_dq=k_dq, block_q_dkv=q_dkv,
                  block_k_dkv=k_dkv, num_warps=warps, num_stages=stages,
                  num_warps_bwd=warps_bwd, num_stages_bwd=stages_bwd)

  if interpret:
    return tiles(16, 16, 16, 16, 16, 16, 1, 1, 1, 1)
  if jnp.dtype(dtype).itemsize > 2:  # float32: twice the shared memory per tile
    b = 64 if head_dim <= 128 else 32
    return tiles(b, b, b, b, b, b, 4, 2, 4, 2)
  if head_dim <= 64:
    return tiles(64, 64, 64, 64, 64, 64, 4, 3, 4, 2)
  if head_dim <= 128:
    # 128x128 forward tiles with 3 stages just fit the 227 KiB of shared memory of Hopper;
    # older GPUs (A100: 163 KiB) get 128x64 tiles in 2 stages.
    if not _is_hopper():
      return tiles(128, 64, 64, 64, 64, 64, 8, 2, 4, 2)
    return tiles(128, 128, 64, 64, 64, 64, 8, 3, 4, 2)
  return tiles(64, 64, 32, 32, 32, 32, 8, 2, 8, 2)


def _is_hopper() -> bool:
  """Hopper or data-center Blackwell (sm_90, sm_100): about 227 KiB of shared memory."""
  capability = str(getattr(jax.devices()[0], "compute_capability", "0.0"))
  return capability.split(".")[0] in ("9", "10")


def default_interpret() -> bool:
  """Interpret mode everywhere but on a GPU (where the kernels go through Triton)."""
  return jax.default_backend() != "gpu"


@dataclasses.dataclass(frozen=True)
class _Branch:
  """One branch (`geo`) laid out as `[B, S, M_pad, R, X, ...]`, with its kernels' blocks."""

  geo: Branch
  blocks: tuple[int, ...]  # Config.blocks, each clipped to the segment

  @property
  def bq(self) -> int:
    return self.blocks[0]

  @property
  def bk(self) -> int:
    return self.blocks[1]

  @property
  def m_pad(self) -> int:
    """Rows per residue padded to whole blocks (the last rows may be padding)."""
    unit = max(self.blocks)  # powers of two: a multiple of every block
    return -(-self.geo.rows // unit) * unit

  @property
  def padded(self) -> bool:
    """Whether the view is a padded copy (and the kernels must mask rows past the tokens)."""
    g = self.geo
    return g.n % g.w != 0 or g.w % g.r != 0 or self.m_pad != g.rows

  @property
  def all_residues(self) -> bool:
    """offsets="all" with r > 1: residues are a grid axis."""
    return not self.geo.per_head and self.geo.r > 1

  def covers_all(self, num_heads: int) -> bool:
    """Whether every (token, head) is a query row of this branch."""
    return not self.geo.per_head and self.geo.heads == range(num_heads)

  def split(self, x, fill=0):
    """`[B, N, ...]` -> `[B, S, M_pad, R, ...]`; free unless `padded`."""
    g = self.geo
    b, rest = x.shape[0], x.shape[2:]
    if not self.padded:
      return x.reshape(b, g.segments, g.rows, g.r, *rest)
    widths = [(0, 0)] * (x.ndim - 2)
    x = jnp.pad(x, [(0, 0), (0, g.segments * g.w - g.n), *widths], constant_values=fill)
    x = x.reshape(b, g.segments, g.w, *rest)
    x = jnp.pad(x, [(0, 0), (0, 0), (0, self.m_pad * g.r - g.w), *widths], constant_values=fill)
    return x.reshape(b, g.segments, self.m_pad, g.r, *rest)

  def unsplit(self, x):
    """Inverse of `split`: drops the padding."""
    g = self.geo
    b, rest = x.shape[0], x.shape[4:]
    if not self.padded:
      return x.reshape(b, g.n, *rest)
    x = x.reshape(b, g.segments, self.m_pad * g.r, *rest)[:, :, :g.w]
    return x.reshape(b, g.segments * g.w, *rest)[:, :g.n]

  def n_valid(self, s, c):
    """Real tokens in the dilated row of segment `s`, residue `c` (traced ints)."""
    g = self.geo
    if not self.padded:
      return g.rows
    w_s = jnp.minimum(g.w, g.n - s * g.w)  # the last segment may be shorter
    return lax.div(w_s - c + g.r - 1, g.r)  # numerator >= 1: w_s >= 1, c < r


def _branches(pattern: DilatedPattern, n: int, num_heads: int, config: Config,
              selected=None):
  for geo in pattern.layout(n, num_heads, selected):
    # A segment shorter than a block runs in the smallest power-of-two block holding it.
    cap = max(_MIN_BLOCK, pl.next_power_of_2(geo.rows))
    yield _Branch(geo, tuple(min(b, cap) for b in config.blocks))


def supports(problem: Problem) -> Support:
  """Float32/bfloat16/float16, head dims up to 256, outside `shard_map(check_vma=True)`."""
  if problem.varying:  # pallas_call's outputs would need their varying mesh axes spelled out
    return no("the pallas backend does not run inside shard_map with check_vma=True (the "
              "ring); its steps use the next implementation")
  if problem.head_dim > _MAX_HEAD_DIM:
    return no(f"the pallas backend supports head dims up to {_MAX_HEAD_DIM} (its [block, D] "
              f"float32 tiles live in registers), got head_dim={problem.head_dim}")
  if not any(problem.dtype == t for t in _DTYPES):
    return no(f"the pallas backend runs float32, bfloat16 and float16, got "
              f"dtype={problem.dtype}")
  return YES


# ---------------------------------------------------------------------------------------------
# In-kernel helpers. Refs hold [rows, Dp] tiles with Dp = D rounded up to a power of two (at
# least 16); the columns past D are masked on load (read as 0) and on store.


def _head_mask(d, dp):
  return None if d == dp else (jnp.arange(dp) < d)[None, :]


def _load(ref, dmask):
  return ref[...] if dmask is None else plgpu.load(ref, mask=dmask, other=0.0)


def _store(ref, x, dmask):
  if dmask is None:
    ref[...] = x
  else:
    plgpu.store(ref, x, mask=dmask)


def _dot(a, b, trans_a=False, trans_b=False):
  # Float32 inputs ask for IEEE float32 products: Triton's default would be tf32.
  precision = lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
  return plgpu.dot(a, b, trans_a=trans_a, trans_b=trans_b, precision=precision)


def _coords(br: _Branch, ids, n_blocks: int):
  """Grid indices -> (query block, b, h, s, c): the residue comes from the head or the grid.

  Causal query blocks run last-first: the late blocks see the most keys, and starting them
  first keeps them out of the tail of the launch.
  """
  blk, b, hh, s = ids[:4]
  if br.geo.causal:
    blk = n_blocks - 1 - blk
  h = hh + br.geo.heads.start
  if br.all_residues:
    c = ids[4]
  elif br.geo.per_head:
    c = lax.rem(h + br.geo.head_offset, br.geo.r)
  else:
    c = 0
  return blk, b, h, s, c


def _query_specs(br: _Branch, n_blocks: int, block_q: int, dp: int, per_kv: int,
                 per_head_ids: bool = False):
  """BlockSpecs of a grid over query blocks: a query block, its key/value row, its stats,
  and the document ids of the query block and of the key row (`_split_ids`' views) and the
  query block's entry of `_block_table`.

  Dilation is the index map: the residue `c` of the view `[B, S, M, R, H, D]`. A key/value
  head is shared by `per_kv` query heads and read in place.
  """
  def q_map(*ids):
    i, b, hh, s, c = _coords(br, ids, n_blocks)
    return b, s, i, c, hh, 0

  def kv_map(*ids):
    _, b, hh, s, c = _coords(br, ids, n_blocks)
    return b, s, 0, c, hh // per_kv, 0

  def ids_map(map_):
    def index(*ids):
      b, s, i, c, head, _ = map_(*ids)
      return b, s, i, c, head if per_head_ids else 0
    return index

  return (pl.BlockSpec((None, None, block_q, None, None, dp), q_map),
          pl.BlockSpec((None, None, br.m_pad, None, None, dp), kv_map),
          pl.BlockSpec((None, None, block_q, None, None), lambda *ids: q_map(*ids)[:5]),
          (pl.BlockSpec((None, None, block_q, None, None), ids_map(q_map)),
           pl.BlockSpec((None, None, br.m_pad, None, None), ids_map(kv_map)),
           pl.BlockSpec((None,) * 5 + (_TABLE,), lambda *ids: ids_map(q_map)(*ids) + (0,))))


def _kv_coords(br: _Branch, g0: int, ids):
  """dk/dv grid indices -> (key block, b, kv head, s, c): every residue is a grid axis."""
  blk, b, gg, s = ids[:4]
  return blk, b, gg + g0, s, (ids[4] if br.geo.r > 1 else 0)


def _program_ids(ndim):
  return [pl.program_id(a) for a in range(ndim)]


def _grid(br: _Branch, blocks: int, heads: int, batch: int):
  return (blocks, batch, heads, br.geo.segments) + ((br.geo.r,) if br.all_residues else ())


def _mask(br, q_rows, k_rows, n_valid, ids=None):
  """Visibility of a [rows, keys] tile in dilated coordinates (None: all visible); `ids`:
  None or the tile's `(query ids [rows], key ids [keys])`, compared per score."""
  mask = None if ids is None else ids[0][:, None] == ids[1][None, :]
  if br.geo.causal:
    causal = k_rows[None, :] <= q_rows[:, None]
    mask = causal if mask is None else mask & causal
  if br.padded:
    valid = (k_rows[None, :] < n_valid) & (q_rows[:, None] < n_valid)
    mask = valid if mask is None else mask & valid
  return mask


def _key_ranges(br, q_block, bq, bk, n_valid):
  """`[(lo, hi, masked)]`: key blocks a query block visits, split where masks are needed."""
  n_blocks = br.m_pad // bk
  if br.padded:  # rare: one masked loop over the blocks holding real keys
    hi = pl.cdiv(n_valid, bk)
    if br.geo.causal:
      hi = jnp.minimum(hi, pl.cdiv((q_block + 1) * bq, bk))
    return [(0, hi, True)]
  if not br.geo.causal:
    return [(0, n_blocks, False)]
  # Blocks entirely at or below the first query row need no mask; then up to the diagonal.
  n_full = lax.div(q_block * bq + 1, bk)
  return [(0, n_full, False), (n_full, pl.cdiv((q_block + 1) * bq, bk), True)]


def _query_ranges(br, k_block, bq, bk, n_valid):
  """`[(lo, hi, masked)]`: query blocks that see a key block (the dk/dv loop)."""
  n_blocks = br.m_pad // bq
  if br.padded:
    lo = lax.div(k_block * bk, bq) if br.geo.causal else 0
    return [(lo, pl.cdiv(n_valid, bq), True)]
  if not br.geo.causal:
    return [(0, n_blocks, False)]
  lo = lax.div(k_block * bk, bq)
  full = pl.cdiv(k_block * bk + bk - 1, bq)  # first block whose rows all follow the keys
  full = jnp.minimum(full, n_blocks)
  return [(lo, full, True), (full, n_blocks, False)]


def _fori(ranges, body, carry, ids=None):
  """Runs `body(masked, j, carry, pair)` over the blocks `j` of `ranges` (`[(lo, hi,
  masked)]`). `ids`: None, or `(mine() -> [rows], theirs(j) -> [block], table, size)`:
  functions loading the program's own block's document ids and those of block `j`, the own
  block's `_block_table` entry (6 scalars) and the size of a visited block. Then only the
  blocks the window reaches are visited; the blocks inside the run go as the range says
  (`pair` None), without a look at their ids; of the others, a block whose ids' range misses this
  block's is skipped, one where both are a single same document runs as the range says, and
  any other compares ids per score (masked, `pair` the two id vectors)."""
  if ids is None:
    for lo, hi, masked in ranges:
      carry = lax.fori_loop(lo, hi, lambda j, c, m=masked: body(m, j, c, None), carry)
    return carry
  mine, theirs, (u0, u1, r0, r1, lo_m, hi_m), size = ids
  first, stop = lax.div(u0, size), lax.div(u1, size) + 1
  # The blocks every key of which lies in the run (none where there is no run).
  inside = (lax.div(r0 + size - 1, size), lax.div(r1 + 1, size))

  def checked(masked, j, carry):
    other = theirs(j)
    lo_o, hi_o = jnp.min(other), jnp.max(other)
    one = (lo_m == hi_m) & (lo_o == hi_o) & (lo_m == lo_o)
    visit = lambda c: lax.cond(one, lambda c: body(masked, j, c, None),
                               lambda c: body(True, j, c, (mine(), other)), c)
    return lax.cond((lo_o <= hi_m) & (hi_o >= lo_m), visit, lambda c: c, carry)

  for lo, hi, masked in ranges:
    lo, hi = jnp.maximum(lo, first), jnp.minimum(hi, stop)
    a = jnp.clip(inside[0], lo, hi)
    b = jnp.clip(inside[1], a, hi)
    carry = lax.fori_loop(lo, a, functools.partial(checked, masked), carry)
    carry = lax.fori_loop(a, b, lambda j, c, m=masked: body(m, j, c, None), carry)
    carry = lax.fori_loop(b, hi, functools.partial(checked, masked), carry)
  return carry


def _per_head(segment_ids) -> bool:
  return segment_ids is not None and segment_ids[0].ndim == 3


def _split_ids(br, ids):
  """`[B, N]` or per-head `[B, N, X]` document ids -> the view `[B, S, M_pad, R, X']` of the
  tokens (X' = 1 where every head shares them)."""
  return br.split(ids if ids.ndim == 3 else ids[:, :, None])


def _row_windows(br, windows):
  """The windows and runs `(u0, u1, r0, r1)` of `common.contract_windows` (`[B, N, X]` each)
  as rows of the branch's dilated rows, in `_split_ids`' view `[B, S, M_pad, R, X]`: the first
  and last row of each token's own segment and residue that may share its document, and those
  that surely do (first > last where none)."""
  g = br.geo
  # Against the views' [B, S, M_pad, R, X]: each segment's first position, and row 0's of
  # each residue.
  seg = (jnp.arange(g.segments) * g.w)[:, None, None, None]
  start = seg + jnp.arange(g.r)[:, None]
  rows = []
  for lo, hi in zip(windows[::2], windows[1::2]):
    lo, hi = br.split(lo, fill=FAR), br.split(hi, fill=-1)
    rows += [(jnp.maximum(lo, seg) - start + g.r - 1) // g.r,
             (jnp.minimum(hi, seg + g.w - 1) - start) // g.r]
  return rows


def _block_table(br, block, ids, rows, per_kv=1):
  """Per block of `block` rows of the views `[B, S, M_pad, R, X]`: the union of the rows'
  windows, the intersection of their runs (`rows`: `_row_windows`') and the range of their
  document ids (`ids`: `_split_ids`' view; a key/value head's column for each of its `per_kv`
  query heads where the windows are per head), int32 `[B, S, M_pad / block, R, X, _TABLE]`:
  `(first, last, run first, run last, lowest id, highest id, 0, 0)`, what each program's
  loop bounds need, worked out before the launch rather than by each program (design table
  of docs/performance.md)."""
  if ids.shape[-1] < rows[0].shape[-1]:
    ids = jnp.repeat(ids, per_kv, axis=-1)
  bsz, segments, m, r, _ = rows[0].shape
  blocks = lambda v: v.reshape(bsz, segments, m // block, block, r, v.shape[-1])
  ids = blocks(ids)
  table = reduce_windows([blocks(v) for v in rows], axis=3) + [ids.min(3), ids.max(3)]
  return jnp.stack(table + [jnp.zeros_like(table[0])] * (_TABLE - 6), axis=-1)


# ---------------------------------------------------------------------------------------------
# Forward.


def _forward_kernel(q_ref, k_ref, v_ref, *refs, br, d, scale, mode, packed):
  o_ref, lse_ref = refs[-2:]
  if mode == "merge":
    o_prev_ref, lse_prev_ref = refs[:2]
  # ("first": aliased, but nothing to merge with yet)
  ids = None
  if packed:
    q_ids_ref, kv_ids_ref, table_ref = refs[-5:-2]
    ids = (lambda: q_ids_ref[...], lambda j: kv_ids_ref[pl.ds(j * br.bk, br.bk)],
           tuple(table_ref[t] for t in range(6)), br.bk)
  bq, bk, dp = br.bq, br.bk, q_ref.shape[-1]
  i, _, _, s, c = _coords(br, _program_ids(4 + br.all_residues), br.m_pad // bq)
  n_valid = br.n_valid(s, c)
  dmask = _head_mask(d, dp)
  q = _load(q_ref, dmask)  # [bq, Dp]
  q = -q if scale < 0 else q  # (exact) so that the scale applied below is positive
  # Scores in base 2 so the exponentials are exp2; a zero scale scores every visible key 0
  # (`body`) with c = 1, as -inf * 0 would be NaN.
  c = abs(scale) * _LOG2E or 1.0
  q_rows = i * bq + jnp.arange(bq)

  def body(masked, j, carry, pair):
    # m: the running maximum of the unscaled products t. The exponent scales differences,
    # t - m <= 0 exactly: scaling t first, the compiler may fuse the product into the
    # subtraction (an FMA) but not into the maximum, and at |s| ~ 1e9 one ulp of difference
    # is beyond exp2's range (inf, NaN or 0 for finite logits).
    acc, m, l = carry
    kb = _load(k_ref.at[pl.ds(j * bk, bk)], dmask)
    t = _dot(q, kb, trans_b=True)  # [bq, bk]
    if scale == 0:
      t = jnp.zeros_like(t)
    if masked:
      t = jnp.where(_mask(br, q_rows, j * bk + jnp.arange(bk), n_valid, pair), t, -jnp.inf)
    m_new = jnp.maximum(m, jnp.max(t, axis=1))
    # A row with nothing visible yet keeps m = -inf; shifting by 0 keeps exp2 from NaN.
    shift = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    p = jnp.exp2((t - shift[:, None]) * c)
    alpha = jnp.exp2((m - shift) * c)
    vb = _load(v_ref.at[pl.ds(j * bk, bk)], dmask)
    acc = acc * alpha[:, None] + _dot(p.astype(vb.dtype), vb)
    return acc, m_new, l * alpha + jnp.sum(p, axis=1)

  init = (jnp.zeros((bq, dp), jnp.float32), jnp.full((bq,), -jnp.inf, jnp.float32),
          jnp.zeros((bq,), jnp.float32))
  acc, m, l = _fori(_key_ranges(br, i, bq, bk, n_valid), body, init, ids)
  seen = l != 0  # (a NaN row stays NaN)
  l = jnp.where(seen, l, 1.0)
  out = acc / l[:, None]
  lse = jnp.where(seen, (m * c + jnp.log2(l)) * _LN2, -jnp.inf)
  if mode == "merge":
    out, lse = merge([_load(o_prev_ref, dmask), out], [lse_prev_ref[...], lse])
  _store(o_ref, out.astype(o_ref.dtype), dmask)
  lse_ref[...] = lse


def _forward_branch(br, q, k, v, acc, scale, mode, out_dtype, cfg, segment_ids=None,
                    windows=None):
  """Runs one branch; returns the running `(out, lse)` in `[B, N, H, D]`, `[B, N, H]`."""
  bsz, _, h, d = q.shape
  per_kv = heads_per_kv(h, k.shape[2])
  dp = max(_MIN_BLOCK, pl.next_power_of_2(d))
  qs, ks, vs = br.split(q), br.split(k), br.split(v)
  n_blocks = br.m_pad // br.bq
  grid = _grid(br, n_blocks, br.geo.heads.stop - br.geo.heads.start, bsz)

  q_spec, kv_spec, lse_spec, ids_specs = _query_specs(br, n_blocks, br.bq, dp, per_kv,
                                                     _per_head(segment_ids))
  args, in_specs, aliases = [qs, ks, vs], [q_spec, kv_spec, kv_spec], {}
  if mode != "fresh":
    args += [br.split(acc[0]), br.split(acc[1], fill=-jnp.inf)]
    in_specs += [q_spec, lse_spec]
    aliases = {3: 0, 4: 1}
  if segment_ids is not None:
    views = [_split_ids(br, x) for x in segment_ids]
    args += views + [_block_table(br, br.bq, views[0], _row_windows(br, windows))]
    in_specs += ids_specs
  out, lse = pl.pallas_call(
      functools.partial(_forward_kernel, br=br, d=d, scale=scale, mode=mode,
                        packed=segment_ids is not None),
      grid=grid,
      in_specs=in_specs,
      out_specs=[q_spec, lse_spec],
      out_shape=[jax.ShapeDtypeStruct(qs.shape, out_dtype),
                 jax.ShapeDtypeStruct(qs.shape[:-1], jnp.float32)],
      input_output_aliases=aliases,
      compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps,
                                           num_stages=cfg.num_stages),
      interpret=cfg.interpret,
      name=f"dilated_forward_w{br.geo.w}_r{br.geo.r}",
  )(*args)
  return br.unsplit(out), br.unsplit(lse)


@in_32_bits
def forward(q, k, v, pattern: DilatedPattern, scale: float, *, branches=None, config=None,
            out_dtype=None, segment_ids=None):
  """`(out [B, N, H, D], lse [B, N, H])` of `branches`, merged in-kernel: float32 partials,
  or `out` in `out_dtype` when given (written directly by a single branch). `segment_ids`:
  None or `(q_ids, kv_ids)`, `[B, N]` or per head (the backend contract)."""
  cfg = (config or Config()).resolved(q.shape[-1], q.dtype)
  b, n, h, _ = q.shape
  branches = list(_branches(pattern, n, h, cfg, branches))
  windows = None if segment_ids is None else contract_windows(segment_ids)
  # One branch writes the result directly; several merge into float32 accumulators.
  acc_dtype = (out_dtype or jnp.float32) if len(branches) == 1 else jnp.float32
  acc = None
  for idx, br in enumerate(branches):
    if idx > 0:
      mode = "merge"
    elif br.covers_all(h):
      mode = "fresh"
    else:  # rows the first branch does not cover must read as out = 0, lse = -inf
      mode = "first"
      acc = (jnp.zeros(q.shape, acc_dtype), jnp.full((b, n, h), -jnp.inf, jnp.float32))
    acc = _forward_branch(br, q, k, v, acc, scale, mode, acc_dtype, cfg, segment_ids,
                          windows)
  return acc[0].astype(out_dtype or jnp.float32), acc[1]


# ---------------------------------------------------------------------------------------------
# Backward.


def _probs(br, q, kb, lse2, q_rows, k_rows, n_valid, masked, scale, pair=None):
  """`p = exp(s - lse)` of a [rows, keys] tile; lse2 is the global lse in base 2; `pair`:
  None or the tile's document ids (`_mask`)."""
  s2 = _dot(q, kb, trans_b=True) * (scale * _LOG2E)
  if masked:
    s2 = jnp.where(_mask(br, q_rows, k_rows, n_valid, pair), s2, -jnp.inf)
  return jnp.exp2(jnp.minimum(s2 - lse2[:, None], 0.0))  # p <= 1: clip rounding of huge s


def _global_lse2(lse):
  # Rows with no visible key (lse = -inf) must give p = 0: +inf does that without a NaN.
  return jnp.where(lse == -jnp.inf, jnp.inf, lse * _LOG2E)


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *refs, br, d, scale, accumulate,
               packed):
  dq_ref = refs[-1]
  bq, bk, dp = br.blocks[2], br.blocks[3], q_ref.shape[-1]
  ids = None
  if packed:
    q_ids_ref, kv_ids_ref, table_ref = refs[-4:-1]
    ids = (lambda: q_ids_ref[...], lambda j: kv_ids_ref[pl.ds(j * bk, bk)],
           tuple(table_ref[t] for t in range(6)), bk)
  i, _, _, s, c = _coords(br, _program_ids(4 + br.all_residues), br.m_pad // bq)
  n_valid = br.n_valid(s, c)
  dmask = _head_mask(d, dp)
  q, do = _load(q_ref, dmask), _load(do_ref, dmask)
  lse2, delta = _global_lse2(lse_ref[...]), delta_ref[...]
  q_rows = i * bq + jnp.arange(bq)

  def body(masked, j, dq, pair):
    kb = _load(k_ref.at[pl.ds(j * bk, bk)], dmask)
    vb = _load(v_ref.at[pl.ds(j * bk, bk)], dmask)
    p = _probs(br, q, kb, lse2, q_rows, j * bk + jnp.arange(bk), n_valid, masked, scale, pair)
    ds = p * (_dot(do, vb, trans_b=True) - delta[:, None])  # [bq, bk]
    return dq + _dot(*ds_operands(ds, kb))

  dq = _fori(_key_ranges(br, i, bq, bk, n_valid), body, jnp.zeros((bq, dp), jnp.float32), ids)
  dq = dq * scale
  if accumulate:
    dq = dq + _load(refs[0], dmask)
  _store(dq_ref, dq.astype(dq_ref.dtype), dmask)


def _dkv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *refs, br, d, scale, per_kv,
                g0, accumulate, packed):
  dk_ref, dv_ref = refs[-2:]
  if packed:  # the query row's ids `[M_pad, X]` (X: 1 or every head), this key block's `[bk]`,
    # and its `_block_table` entries `[X, _TABLE]` (its keys' windows over the queries)
    q_ids_ref, kv_ids_ref, table_ref = refs[-5:-2]
  bq, bk, dp = br.blocks[4], br.blocks[5], q_ref.shape[-1]
  j, _, g, s, c = _kv_coords(br, g0, _program_ids(4 + (br.geo.r > 1)))
  n_valid = br.n_valid(s, c)
  dmask = _head_mask(d, dp)
  kb, vb = _load(k_ref, dmask), _load(v_ref, dmask)
  k_rows = j * bk + jnp.arange(bk)
  # The query heads of kv head g in this branch's range; offsets="head": those reading c.
  h_lo = jnp.maximum(g * per_kv, br.geo.heads.start)
  h_hi = jnp.minimum((g + 1) * per_kv, br.geo.heads.stop)
  step = br.geo.r if br.geo.per_head else 1
  if br.geo.per_head:
    h_lo = h_lo + lax.rem(c - lax.rem(h_lo + br.geo.head_offset, br.geo.r) + br.geo.r, br.geo.r)
  n_heads = jnp.maximum(lax.div(h_hi - h_lo + step - 1, step), 0)

  def head_body(t, carry):
    h = h_lo + t * step

    def body(masked, i, carry, pair):
      dk, dv = carry
      rows = pl.ds(i * bq, bq)
      q = _load(q_ref.at[rows, h], dmask)
      do = _load(do_ref.at[rows, h], dmask)
      lse2, delta = _global_lse2(lse_ref[rows, h]), delta_ref[rows, h]
      pair = None if pair is None else pair[::-1]  # (query ids, key ids)
      p = _probs(br, q, kb, lse2, i * bq + jnp.arange(bq), k_rows, n_valid, masked, scale,
                 pair)
      dv = dv + _dot(p.astype(do.dtype), do, trans_a=True)
      ds = p * (_dot(do, vb, trans_b=True) - delta[:, None])  # [bq, bk]
      return dk + _dot(*ds_operands(ds, q), trans_a=True), dv

    ids = None
    if packed:  # here the program's own block is the key block, the visited ones queries
      column = h if q_ids_ref.shape[-1] > 1 else 0
      ids = (lambda: kv_ids_ref[...], lambda i: q_ids_ref[pl.ds(i * bq, bq), column],
             tuple(table_ref[column, t] for t in range(6)), bq)
    return _fori(_query_ranges(br, j, bq, bk, n_valid), body, carry, ids)

  zeros = jnp.zeros((bk, dp), jnp.float32)
  dk, dv = lax.fori_loop(0, n_heads, head_body, (zeros, zeros))
  dk = dk * scale
  if accumulate:
    dk = dk + _load(refs[0], dmask)
    dv = dv + _load(refs[1], dmask)
  _store(dk_ref, dk.astype(dk_ref.dtype), dmask)
  _store(dv_ref, dv.astype(dv_ref.dtype), dmask)


def _backward_branch(br, q, k, v, dout, lse, delta, grads, scale, modes, cfg, segment_ids=None,
                     windows=None):
  """Adds one branch's `(dq, dk, dv)` to `grads` (or creates them: mode "fresh")."""
  bsz, _, h, d = q.shape
  per_kv = heads_per_kv(h, k.shape[2])
  dp = max(_MIN_BLOCK, pl.next_power_of_2(d))
  qs, ks, vs, dos = (br.split(x) for x in (q, k, v, dout))
  lses, deltas = br.split(lse, fill=-jnp.inf), br.split(delta)
  params = plgpu.CompilerParams(num_warps=cfg.num_warps_bwd, num_stages=cfg.num_stages_bwd)
  _, _, bq_dq, _, _, bk_dkv = br.blocks
  dq_mode, kv_mode = modes
  dq, dk, dv = grads

  # dq: one program per (query block, b, h, s, c), like the forward.
  n_blocks = br.m_pad // bq_dq

  packed, per_head = segment_ids is not None, _per_head(segment_ids)
  id_views = [] if not packed else [_split_ids(br, x) for x in segment_ids]
  q_spec, kv_spec, row_spec, ids_specs = _query_specs(br, n_blocks, bq_dq, dp, per_kv, per_head)
  args = [qs, ks, vs, dos, lses, deltas]
  in_specs = [q_spec, kv_spec, kv_spec, q_spec, row_spec, row_spec]
  accumulate = dq_mode == "merge"
  if dq_mode != "fresh":
    args.append(br.split(dq))
    in_specs.append(q_spec)
  if packed:
    args += id_views + [_block_table(br, bq_dq, id_views[0], _row_windows(br, windows[0]))]
    in_specs += ids_specs
  dq = br.unsplit(pl.pallas_call(
      functools.partial(_dq_kernel, br=br, d=d, scale=scale, accumulate=accumulate,
                        packed=packed),
      grid=_grid(br, n_blocks, br.geo.heads.stop - br.geo.heads.start, bsz),
      in_specs=in_specs,
      out_specs=q_spec,
      out_shape=jax.ShapeDtypeStruct(qs.shape, jnp.float32),
      input_output_aliases={6: 0} if dq_mode != "fresh" else {},
      compiler_params=params,
      interpret=cfg.interpret,
      name=f"dilated_dq_w{br.geo.w}_r{br.geo.r}",
  )(*args))

  # dk, dv: one program per (key block, b, kv head, s, c); the kernel loops over query heads.
  g0, g1 = br.geo.heads.start // per_kv, (br.geo.heads.stop - 1) // per_kv + 1

  def k_map(*ids):
    j, b, g, s, c = _kv_coords(br, g0, ids)
    return b, s, j, c, g, 0

  def q_all_map(*ids):
    _, b, _, s, c = _kv_coords(br, g0, ids)
    return b, s, 0, c, 0, 0

  k_spec = pl.BlockSpec((None, None, bk_dkv, None, None, dp), k_map)
  qa_spec = pl.BlockSpec((None, None, br.m_pad, None, h, dp), q_all_map)
  rows_spec = pl.BlockSpec((None, None, br.m_pad, None, h), lambda *ids: q_all_map(*ids)[:5])
  args = [qs, ks, vs, dos, lses, deltas]
  in_specs = [qa_spec, k_spec, k_spec, qa_spec, rows_spec, rows_spec]
  if kv_mode != "fresh":
    args += [br.split(dk), br.split(dv)]
    in_specs += [k_spec, k_spec]
  if packed:
    args += id_views + [_block_table(br, bk_dkv, id_views[1], _row_windows(br, windows[1]),
                                     per_kv)]
    in_specs += [
        pl.BlockSpec((None, None, br.m_pad, None, h if per_head else 1),
                     lambda *ids: q_all_map(*ids)[:5]),
        pl.BlockSpec((None, None, bk_dkv, None, None),
                     lambda *ids: k_map(*ids)[:4] + ((k_map(*ids)[4] if per_head else 0),)),
        pl.BlockSpec((None, None, None, None, h if per_head else 1, _TABLE),
                     lambda *ids: k_map(*ids)[:4] + (0, 0))]
  residues = (br.geo.r,) if br.geo.r > 1 else ()  # every residue is a grid axis here
  dk, dv = pl.pallas_call(
      functools.partial(_dkv_kernel, br=br, d=d, scale=scale, per_kv=per_kv, g0=g0,
                        accumulate=kv_mode == "merge", packed=packed),
      grid=(br.m_pad // bk_dkv, bsz, g1 - g0, br.geo.segments) + residues,
      in_specs=in_specs,
      out_specs=[k_spec, k_spec],
      out_shape=[jax.ShapeDtypeStruct(ks.shape, jnp.float32),
                 jax.ShapeDtypeStruct(vs.shape, jnp.float32)],
      input_output_aliases={6: 0, 7: 1} if kv_mode != "fresh" else {},
      compiler_params=params,
      interpret=cfg.interpret,
      name=f"dilated_dkv_w{br.geo.w}_r{br.geo.r}",
  )(*args)
  return dq, br.unsplit(dk), br.unsplit(dv)


@in_32_bits
def backward(q, k, v, dout, lse, delta, pattern: DilatedPattern, scale: float, *,
             branches=None, config=None, grad_dtype=None, segment_ids=None):
  """float32 `(dq, dk, dv)` from the global `lse` and `delta = rowsum(dout * out) - dlse`
  (whatever `grad_dtype`)."""
  cfg = (config or Config()).resolved(q.shape[-1], q.dtype)
  n, h, hkv = q.shape[1], q.shape[2], k.shape[2]
  per_kv = heads_per_kv(h, hkv)
  lse, delta = lse.astype(jnp.float32), delta.astype(jnp.float32)
  windows = None if segment_ids is None else (contract_windows(segment_ids),
                                              contract_windows(segment_ids, keys=True))
  grads = (None, None, None)
  for idx, br in enumerate(_branches(pattern, n, h, cfg, branches)):
    if idx > 0:
      modes = ("merge", "merge")
    else:
      heads = br.geo.heads
      all_kv = (heads.start // per_kv, (heads.stop - 1) // per_kv + 1) == (0, hkv)
      modes = ("fresh" if br.covers_all(h) else "first", "fresh" if all_kv else "first")
      # Rows or heads the first branch does not write must read as zero gradients.
      grads = tuple(jnp.zeros(x.shape, jnp.float32) if mode == "first" else None
                    for x, mode in zip((q, k, v), (modes[0], modes[1], modes[1])))
    grads = _backward_branch(br, q, k, v, dout, lse, delta, grads, scale, modes, cfg,
                             segment_ids, windows)
  return grads
