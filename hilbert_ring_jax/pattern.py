"""`DilatedPattern`: the static description of a LongNet-style dilated attention pattern."""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Sequence

import numpy as np

_OFFSETS = ("head", "all")


def _as_int_tuple(name: str, value) -> tuple[int, ...]:
  if isinstance(value, numbers.Integral) and not isinstance(value, bool):
    value = (value,)
  if isinstance(value, np.ndarray) and value.ndim == 1:  # a NumPy vector, as a list
    value = value.tolist()
  if not isinstance(value, Sequence) or isinstance(value, str):
    raise ValueError(f"{name} must be an int or a sequence of ints, got {name}={value!r}")
  out = []
  for x in value:
    if isinstance(x, bool) or not isinstance(x, numbers.Integral):
      raise ValueError(f"{name} must hold ints, got {name}={tuple(value)!r}")
    out.append(int(x))
  return tuple(out)


@dataclasses.dataclass(frozen=True)
class DilatedPattern:
  """Branches `(w_b, r_b)` of segment length and dilation rate, mixed as in LongNet.

  For branch `b`, key `j` is visible to query `i` (head `h`) when both lie in the same
  segment of `w_b` tokens and share the residue `(p % w_b) % r_b`; with `offsets="head"` that
  residue must also be `h % r_b`, with `offsets="all"` every residue class attends within
  itself. `causal` adds `j <= i`; `head_groups` gives branch `b` only the `b`-th contiguous
  group of heads. See docs/SPEC.md for the exact function. With `offsets="head"` and fewer heads
  than `r_b`, the residues `>= H` of branch `b` are read by no head; use `offsets="all"` when
  every token should take part in every branch.

  `head_offset` and `total_heads` make a call on some of the heads compute what a call on
  all of them computes for those: its head `h` is head `head_offset + h` of `total_heads`
  (default: the call's own heads), for the residues and the head groups above. Tensor
  parallelism needs them, each device holding a slice of the heads; `heads_axis=` of the
  attention functions sets them for each shard.

  Hashable and immutable, so it can be a static argument of `jax.jit`.

  Example:
    >>> p = DilatedPattern(segment_lengths=(2048, 4096, 8192), dilation_rates=(1, 2, 4))
    >>> p.num_branches
    3
  """

  segment_lengths: tuple[int, ...]
  dilation_rates: tuple[int, ...]
  causal: bool = False
  offsets: str = "head"
  head_groups: bool = False
  head_offset: int = 0
  total_heads: int | None = None

  def __post_init__(self):
    segment_lengths = _as_int_tuple("segment_lengths", self.segment_lengths)
    dilation_rates = _as_int_tuple("dilation_rates", self.dilation_rates)
    object.__setattr__(self, "segment_lengths", segment_lengths)
    object.__setattr__(self, "dilation_rates", dilation_rates)
    if not segment_lengths:
      raise ValueError(f"segment_lengths must not be empty, got {segment_lengths=}")
    if len(segment_lengths) != len(dilation_rates):
      raise ValueError(
          f"{segment_lengths=} and {dilation_rates=} must have the same length")
    for b, (w, r) in enumerate(zip(segment_lengths, dilation_rates)):
      if w < 1:
        raise ValueError(f"segment_lengths must be >= 1, got {segment_lengths=}")
      if r < 1:
        raise ValueError(f"dilation_rates must be >= 1, got {dilation_rates=}")
      if r > w:
        raise ValueError(
            f"dilation_rates[{b}]={r} exceeds segment_lengths[{b}]={w}: "
            f"need r <= w ({segment_lengths=}, {dilation_rates=})")
    if self.offsets not in _OFFSETS:
      raise ValueError(f"offsets must be one of {_OFFSETS}, got offsets={self.offsets!r}")
    for name in ("causal", "head_groups"):
      if not isinstance(getattr(self, name), (bool, np.bool_)):  # NumPy's, as configs give
        raise ValueError(f"{name} must be a bool, got {name}={getattr(self, name)!r}")
      object.__setattr__(self, name, bool(getattr(self, name)))
    for name, low in (("head_offset", 0), ("total_heads", 1)):
      value = getattr(self, name)
      if value is None and name == "total_heads":
        continue
      if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
        raise ValueError(f"{name} must be an int >= {low}, got {name}={value!r}")
      object.__setattr__(self, name, int(value))
    if self.total_heads is not None and self.head_offset >= self.total_heads:
      raise ValueError(f"head_offset must be below total_heads, got "
                       f"head_offset={self.head_offset}, total_heads={self.total_heads}")

  @property
  def num_branches(self) -> int:
    return len(self.segment_lengths)

  @property
  def branches(self) -> tuple[tuple[int, int], ...]:
    """`((w_0, r_0), (w_1, r_1), ...)`."""
    return tuple(zip(self.segment_lengths, self.dilation_rates))

  def head_ranges(self, num_heads: int) -> tuple[tuple[int, int], ...]:
    """The `[start, stop)` of a call's `num_heads` query heads (numbered from 0) each branch
    applies to: empty where a branch covers none of them (`head_offset`).

    Without `head_groups` every branch covers all heads; with it the `total_heads` split
    into `num_branches` contiguous groups whose sizes differ by at most one, the first groups
    taking the extra head.
    """
    k, offset = self.num_branches, self.head_offset
    total = offset + num_heads if self.total_heads is None else self.total_heads
    if offset + num_heads > total:
      raise ValueError(f"a call's {num_heads} query heads from head_offset={offset} exceed "
                       f"total_heads={total}")
    if not self.head_groups:
      return ((0, num_heads),) * k
    if total < k:
      raise ValueError(
          f"head_groups=True needs at least one head per branch: num_heads={total} "
          f"< {k} branches (segment_lengths={self.segment_lengths})")
    base, extra = divmod(total, k)
    bounds = [0]
    for b in range(k):
      bounds.append(bounds[-1] + base + (1 if b < extra else 0))
    local = [min(max(x - offset, 0), num_heads) for x in bounds]
    return tuple(zip(local[:-1], local[1:]))

  def covering(self, num_heads: int) -> tuple[int, ...] | None:
    """The branches covering some of a call's `num_heads` heads; None where all do (a call
    on a slice of the heads, `head_offset`, may meet none of a head group's)."""
    live = tuple(b for b, (lo, hi) in enumerate(self.head_ranges(num_heads)) if hi > lo)
    return None if len(live) == self.num_branches else live

  def shard_key(self, num_heads: int):
    """What a call's result depends on of `head_offset` and `total_heads`: calls whose keys
    are equal compute alike (their heads read the same residues, in the same groups)."""
    residues = (tuple(self.head_offset % r for r in self.dilation_rates)
                if self.offsets == "head" else ())
    return self.head_ranges(num_heads), residues

  def layout(self, seq_len: int, num_heads: int, branches=None) -> tuple[Branch, ...]:
    """The geometry of `branches` (indices, default all) over `seq_len` tokens and `num_heads`
    query heads: the one place where segments, residues and head coverage are derived."""
    ranges = self.head_ranges(num_heads)
    indices = range(self.num_branches) if branches is None else branches
    return tuple(Branch(b, seq_len, min(self.segment_lengths[b], seq_len),
                        self.dilation_rates[b], range(*ranges[b]), self.offsets == "head",
                        self.causal, self.head_offset) for b in indices)

  def visible_pairs(self, seq_len: int, num_heads: int, *, distinct: bool = False,
                    branches=None) -> int:
    """Query-key-head triples the pattern makes visible, counted with multiplicity `m`.

    `4 * batch * head_dim * visible_pairs` is the FLOP count of forward attention used by the
    benchmarks (the backward is counted as 2.5x that). `branches`: those branches' triples
    only (indices; default all; with multiplicity).

    With `distinct=True` a triple that several branches make visible counts once: the scores
    the function needs (the Triton backend computes each once, with the bias `log m`), the
    basis of model-FLOP counts. Counted exactly by inclusion-exclusion over the branches, in
    `O(2^branches * n)` per set of heads reading the same residues (one set with
    `offsets="all"`).
    """
    for name, value in (("seq_len", seq_len), ("num_heads", num_heads)):
      if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {name}={value!r}")
    seq_len, num_heads = int(seq_len), int(num_heads)
    if distinct:
      if branches is not None:
        raise ValueError("visible_pairs counts distinct triples of all branches only: pass "
                         "branches=None with distinct=True")
      return _distinct_pairs(self, seq_len, num_heads)
    total = 0
    for br in self.layout(seq_len, num_heads, branches):
      for h in br.heads:
        # (segment length, how many segments of it): the full ones and a shorter last one.
        for length, count in ((br.w, seq_len // br.w), (seq_len % br.w, 1)):
          for c in br.residues(h):
            n = len(range(c, length, br.r))
            total += count * (n * (n + 1) // 2 if self.causal else n * n)
    return total


@dataclasses.dataclass(frozen=True)
class Branch:
  """Branch `index` of a pattern laid over `n` tokens: its geometry, derived once.

  Segment `s` holds positions `[s w, (s + 1) w)` (the last may be shorter); within it, the
  residue of position `p` is `(p % w) % r`, and residue class `c` is the strided *row*
  `c, c + r, ...` of at most `rows = ceil(w / r)` tokens. Query head `h` takes part when it is
  in `heads`; with `offsets="head"` it then reads only the class `(head_offset + h) % r`
  (`per_head`), with `offsets="all"` every class. Backends lay rows out their own way
  (folded into a batch, an index map, a schedule), but read these fields rather than
  re-deriving them.

  Example:
    >>> (br,) = DilatedPattern((8,), (2,)).layout(20, num_heads=4)
    >>> br.segments, br.rows, br.residues(3), br.per_head
    (3, 4, (1,), True)
  """

  index: int
  n: int            # sequence length
  w: int            # effective segment length: min(w_b, n)
  r: int            # dilation rate
  heads: range      # the query heads this branch covers (head_groups: a contiguous group)
  head_offsets: bool  # offsets="head"
  causal: bool
  head_offset: int = 0  # the pattern's: what the call's head 0 is of all heads

  @property
  def segments(self) -> int:
    return -(-self.n // self.w)

  @property
  def rows(self) -> int:
    """Tokens of a residue class in a whole segment: `ceil(w / r)`."""
    return -(-self.w // self.r)

  @property
  def per_head(self) -> bool:
    """Whether each head reads one residue class (offsets="head" with r > 1)."""
    return self.head_offsets and self.r > 1

  def residues(self, h: int) -> tuple[int, ...]:
    """The residue classes query head `h` reads (none if the branch does not cover it)."""
    if h not in self.heads:
      return ()
    return ((self.head_offset + h) % self.r,) if self.per_head else tuple(range(self.r))

  def covered(self, num_heads: int, xp=np):
    """`[n, H]` bool: the (token, head) rows this branch computes. `xp=jax.numpy` builds it
    in the traced program (from iotas) instead of as an `n x H` host constant."""
    pos, head = xp.arange(self.n)[:, None], xp.arange(num_heads)[None, :]
    inside = (head >= self.heads.start) & (head < self.heads.stop)
    if not self.per_head:
      return inside
    return inside & ((pos % self.w) % self.r == (head + self.head_offset) % self.r)

  def visible(self, num_heads: int) -> np.ndarray:
    """`[H, n, n]` bool: key `j` visible to query `i` for head `h` (dense: for checks)."""
    p = np.arange(self.n)
    res = (p % self.w) % self.r
    vis = (p[:, None] // self.w == p[None, :] // self.w) & (res[:, None] == res[None, :])
    if self.causal:
      vis &= p[None, :] <= p[:, None]
    rows = self.covered(num_heads).T  # [H, n]: queries (hence, same class, keys) per head
    return vis[None] & rows[:, :, None]


def _in_range_congruent(lo, hi, i, period):
  """How many `j` in `[lo, hi)` have `j = i (mod period)` (elementwise; 0 for empty ranges)."""
  return np.maximum((hi - 1 - i) // period - (lo - 1 - i) // period, 0)


def _distinct_pairs(pattern: DilatedPattern, n: int, num_heads: int) -> int:
  """`visible_pairs(..., distinct=True)`: for query `i`, branch `b` shows the keys of its
  segment `[s_b, e_b)` (`e_b <= i + 1` if causal) congruent to `i` modulo `r_b`, when `i`'s
  residue is one the head reads. The union over branches is counted by inclusion-exclusion:
  an intersection is the overlap of the segments, congruent to `i` modulo the rates' lcm."""
  layout = pattern.layout(n, num_heads)
  i = np.arange(n, dtype=np.int64)
  bounds = []
  for br in layout:
    lo = (i // br.w) * br.w
    hi = np.minimum(lo + br.w, n)
    bounds.append((lo, np.minimum(hi, i + 1) if br.causal else hi, (i % br.w) % br.r))
  groups = {}  # heads reading the same residues in every branch see the same pairs
  for h in range(num_heads):
    key = tuple(br.residues(h) for br in layout)
    groups[key] = groups.get(key, 0) + 1
  total = 0
  for residues, count in groups.items():
    active = [np.isin(res_i, res) for (_, _, res_i), res in zip(bounds, residues)]
    for subset in range(1, 1 << len(layout)):
      members = [b for b in range(len(layout)) if subset >> b & 1]
      lo = np.max([bounds[b][0] for b in members], axis=0)
      hi = np.min([bounds[b][1] for b in members], axis=0)
      period = math.lcm(*(layout[b].r for b in members))
      on = np.logical_and.reduce([active[b] for b in members])
      sign = 1 if len(members) % 2 else -1
      total += sign * count * int(np.sum(_in_range_congruent(lo, hi, i, period)[on]))
  return total


def heads_per_kv(num_heads: int, num_kv_heads: int) -> int:
  """Query heads sharing one key/value head (GQA); query head `h` reads `h // heads_per_kv`."""
  return num_heads // num_kv_heads
