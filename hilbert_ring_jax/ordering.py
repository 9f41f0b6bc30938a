"""Hilbert orderings of grid tokens and the gathers that apply them (sequence axis 1).

`perm[j]` is the caller's index of the token processed `j`-th: `x_serial[:, j] = x[:, perm[j]]`.
Permutations are host-side NumPy arrays built once per (static) shape.

The permutation contract of `serialize`, `unserialize` and `inverse_permutation`: `perm` is host
data (a NumPy array, a Python sequence or a concrete `jax.Array`), converted to NumPy and checked
to be a permutation of `0 .. N-1` when it is passed in, also while tracing under `jax.jit` (as a
closed-over constant). A traced `perm` (a `jax.core.Tracer`: a jit argument, or computed inside
the traced function, `jnp.asarray` included) cannot be checked there, since a gather with a
repeated or out-of-range index silently duplicates rows or yields NaN, so it is refused with a
`ValueError` unless the caller passes `validate=False`: "perm is a device-computed permutation
whose validity I guarantee". Nothing about its values is checked then (its rank, integer dtype
and length still are); a non-permutation gives unspecified results.
"""

from __future__ import annotations

import functools
import math
import numbers

import jax
import jax.numpy as jnp
import numpy as np


_MAX_CELLS = 1 << 28  # 2 GiB of int64 on the host; far beyond the sequences a mesh holds


def _check_grid_shape(grid_shape) -> tuple[int, ...]:
  try:
    dims = tuple(grid_shape)
  except TypeError:
    dims = (grid_shape,)
  if not 1 <= len(dims) <= 3 or any(
      isinstance(d, bool) or not isinstance(d, numbers.Integral) or d < 1 for d in dims):
    raise ValueError(f"grid_shape must be 1 to 3 positive ints, got grid_shape={grid_shape!r}")
  dims = tuple(int(d) for d in dims)
  if math.prod(dims) > _MAX_CELLS:  # the permutation is a host array of int64 per cell
    raise ValueError(f"grid_shape={grid_shape!r} has {math.prod(dims)} cells, more than the "
                     f"{_MAX_CELLS} a host permutation is built for")
  return dims


def _sign(v):
  return tuple((x > 0) - (x < 0) for x in v)


def _add(*vs):
  return tuple(map(sum, zip(*vs)))


def _neg(v):
  return tuple(-x for x in v)


def _box_curve(a, b, c, memo) -> np.ndarray:
  """Cells of the box spanned by axis vectors `a, b, c` along a generalized Hilbert curve.

  The curve starts at the box's origin and ends at `a - sign(a)`, one edge away, so the
  curves of consecutive sub-boxes join as grid neighbours. A long box is cut in two along
  `a`; a flat one into three (the 2-D Hilbert step); otherwise into five pieces that visit
  the eight octants in Gray-code order, two pairs merged. Halves are nudged to even lengths,
  which keeps every step a unit step except in rare odd shapes, where one may be diagonal.
  On a `2^k x 2^k` square this is the classic Hilbert curve. Curves depend on `(a, b, c)`
  alone, and few distinct boxes occur, so `memo` makes the whole curve cost O(cells).

  Returns int64 `[cells, 3]` offsets from the origin, in curve order.
  """
  key = (a, b, c)
  if key in memo:
    return memo[key]
  la, lb, lc = (abs(sum(v)) for v in (a, b, c))
  ua, ub, uc = _sign(a), _sign(b), _sign(c)
  if (la == 1) + (lb == 1) + (lc == 1) >= 2:  # a straight run
    length, unit = max((la, ua), (lb, ub), (lc, uc))
    out = np.arange(length, dtype=np.int64)[:, None] * np.array(unit, np.int64)
  else:
    def half(v, u, length):
      h = tuple(x // 2 for x in v)
      return _add(h, u) if abs(sum(h)) % 2 and length > 2 else h

    a2, b2, c2 = half(a, ua, la), half(b, ub, lb), half(c, uc, lc)
    ra, rb, rc = _add(a, _neg(a2)), _add(b, _neg(b2)), _add(c, _neg(c2))  # the other halves
    ea, eb2, ec2 = _add(a, _neg(ua)), _add(b2, _neg(ub)), _add(c2, _neg(uc))  # far edges
    if 2 * la > 3 * lb and 2 * la > 3 * lc:
      subs = [((0, 0, 0), a2, b, c), (a2, ra, b, c)]
    elif 3 * lb > 4 * lc:
      subs = [((0, 0, 0), b2, c, a2), (b2, a, rb, c), (_add(ea, eb2), _neg(b2), c, _neg(ra))]
    elif 3 * lc > 4 * lb:
      subs = [((0, 0, 0), c2, a2, b), (c2, a, b, rc), (_add(ea, ec2), _neg(c2), _neg(ra), b)]
    else:
      ec = _add(c, _neg(uc))
      subs = [((0, 0, 0), b2, c2, a2), (b2, c, a2, rb), (_add(eb2, ec), a, _neg(b2), _neg(rc)),
              (_add(ea, b2, ec), _neg(c), _neg(ra), rb), (_add(ea, eb2), _neg(b2), c2, _neg(ra))]
    out = np.concatenate([np.array(o, np.int64) + _box_curve(sa, sb, sc, memo)
                          for o, sa, sb, sc in subs
                          if all(sum(v) != 0 for v in (sa, sb, sc))])
  memo[key] = out
  return out


def _curve(sizes: tuple[int, int, int]) -> np.ndarray:
  """Cells `(x, y, z)` of a box of `sizes` in generalized Hilbert order, `[cells, 3]`."""
  axes = sorted(range(3), key=lambda i: -sizes[i])  # the longest axis leads ...
  if np.prod(sizes) % 2 == 0 and sizes[axes[0]] % 2:
    # ... unless it is odd and the cell count even: a curve from a corner to the next corner
    # along an odd edge then has both ends on one colour of the checkerboard, which forces a
    # diagonal step; leading with an even edge avoids it.
    axes.sort(key=lambda i: sizes[i] % 2)
  e = np.eye(3, dtype=np.int64)
  vecs = [tuple(int(x) for x in e[i] * sizes[i]) for i in axes]
  return _box_curve(*vecs, {})


@functools.lru_cache(maxsize=64)
def _hilbert_cached(dims: tuple[int, ...]) -> np.ndarray:
  sizes = tuple(reversed(dims)) + (1,) * (3 - len(dims))  # (x, y, z) = last axis first
  xyz = _curve(sizes)
  index = xyz[:, 0] + sizes[0] * (xyz[:, 1] + sizes[1] * xyz[:, 2])
  index.flags.writeable = False
  return index


def hilbert_permutation(grid_shape) -> np.ndarray:
  """Row-major cell indices of a 1-D, 2-D or 3-D grid in the order of a Hilbert curve.

  Cells are numbered row-major: `(H, W)` -> `y * W + x`, `(T, H, W)` -> `(t * H + y) * W + x`.
  On a `2^k x 2^k` grid this is the classic Hilbert curve (every step moves to a grid
  neighbour); other shapes get a generalized Hilbert curve that is continuous wherever the
  shape allows.

  Args:
    grid_shape: `(H, W)` or `(T, H, W)` (a 1-D shape gives the identity).

  Returns:
    int64 `perm` of length `prod(grid_shape)`; use with `serialize` / `unserialize`.

  Example:
    >>> hilbert_permutation((2, 2)).tolist()
    [0, 2, 3, 1]
  """
  return np.array(_hilbert_cached(_check_grid_shape(grid_shape)))


def hilbert_permutation_per_segment(n: int, w: int) -> np.ndarray:
  """A Hilbert order inside each segment of `w` tokens (the 1-D variant of the PyTorch work).

  Token `t` of a segment of length `L` sits at cell `(t // 2^k, t % 2^k)` of the smallest
  `2^k x 2^k` grid with `4^k >= L`; the segment's tokens follow the Hilbert curve over that
  grid, skipping cells `t >= L`. The last, shorter segment uses its own length.

  Example:
    >>> hilbert_permutation_per_segment(8, 4).tolist()
    [0, 2, 3, 1, 4, 6, 7, 5]
  """
  for name, val in (("n", n), ("w", w)):
    if isinstance(val, bool) or not isinstance(val, numbers.Integral) or val < 1:
      raise ValueError(f"{name} must be a positive int, got {name}={val!r}")

  def within(length: int) -> np.ndarray:
    side = 1
    while side * side < length:
      side *= 2
    order = _hilbert_cached((side, side))
    return order[order < length]

  full, last = divmod(n, w)
  parts = [(np.arange(full)[:, None] * w + within(w)[None]).reshape(-1)]
  if last:
    parts.append(full * w + within(last))
  return np.concatenate(parts).astype(np.int64)


def _not_a_permutation(arr: np.ndarray, name: str) -> str:
  """Why `arr` (1-D, integer) is not a permutation: its first out-of-range or repeated entry."""
  n = len(arr)
  bad = np.flatnonzero((arr < 0) | (arr >= n))
  if len(bad):
    return f"{name}[{bad[0]}] = {arr[bad[0]]} is out of range"
  _, first = np.unique(arr, return_index=True)
  repeat = np.setdiff1d(np.arange(n), first)[0]  # the first index holding an earlier value
  return (f"{name}[{repeat}] = {arr[repeat]} repeats "
          f"{name}[{np.flatnonzero(arr == arr[repeat])[0]}]")


def check_perm(perm, n: int | None = None, name: str = "perm", *,
                validate: bool = True) -> np.ndarray | jax.Array:
  """`perm` as a NumPy array, checked (`ValueError` naming `name`); a traced `perm` only with
  `validate=False`, unchecked. The one permutation check: the layers' orderings use it too."""
  if isinstance(perm, jax.core.Tracer):
    if validate:
      # Its values are unknown while tracing, and a gather with a bad index fails silently.
      raise ValueError(
          f"{name} is a traced value ({perm.dtype}{list(perm.shape)}), whose values cannot be "
          f"checked to be a permutation: pass {name} as host data (a NumPy array built outside "
          f"the traced function and closed over, not a jit argument, nor jnp.asarray inside "
          f"it), or pass validate=False if {name} is a device-computed permutation whose "
          f"validity you guarantee")
    arr = perm
  else:
    arr = np.asarray(perm)
  if (arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer)
      or (n is not None and arr.shape[0] != n)):
    raise ValueError(
        f"{name} must be a 1-D integer permutation of 0..{'N' if n is None else n}-1, "
        f"got dtype {arr.dtype} and shape {arr.shape}")
  if validate and not np.array_equal(np.sort(arr), np.arange(len(arr))):
    raise ValueError(
        f"{name} is not a permutation of 0..{len(arr) - 1}: {_not_a_permutation(arr, name)}")
  return arr


def inverse_permutation(perm, *, validate: bool = True) -> np.ndarray | jax.Array:
  """`inv` with `inv[perm[j]] = j`.

  Args:
    perm: a permutation of `0 .. N-1` as host data (NumPy array, sequence or concrete
      `jax.Array`), checked; a traced one is refused unless `validate=False`.
    validate: False declares `perm` a permutation whose validity the caller guarantees: its
      values are not checked, and a traced `perm` is accepted (inverted by a scatter).

  Returns:
    A NumPy array, or for a traced `perm` a traced array of its dtype.

  Example:
    >>> inverse_permutation([2, 0, 1]).tolist()
    [1, 2, 0]
    >>> jax.jit(lambda p: inverse_permutation(p, validate=False))(jnp.array([2, 0, 1])).tolist()
    [1, 2, 0]
  """
  perm = check_perm(perm, validate=validate)
  if isinstance(perm, jax.core.Tracer):
    # A scatter, O(N), rather than an argsort; the caller promised the indices are unique.
    return jnp.zeros_like(perm).at[perm].set(jnp.arange(perm.shape[0], dtype=perm.dtype),
                                             unique_indices=True)
  inv = np.zeros_like(perm)
  inv[perm] = np.arange(len(perm), dtype=perm.dtype)
  return inv


def _take(x, idx):
  """`x[:, idx]`; `idx` is a permutation, so every index is in bounds (no clamping or fill).
  (`jnp.asarray`: under `jax.grad` a NumPy `x` reaches `_permute_fwd` as NumPy data.)"""
  return jnp.asarray(x).at[:, idx].get(mode="promise_in_bounds")


@jax.custom_vjp
def _permute(x, perm, inv):
  """`x[:, perm]`, whose gradient is the gather `g[:, inv]` by the inverse permutation.

  The gradient JAX derives for a gather is a scatter-add (of `N` rows into `N`, atomics on a
  GPU, slower than a gather on a CPU too); for a permutation the inverse gather is the same
  result. Reverse mode only: `jax.jvp` through it raises.
  """
  return _take(x, perm)


def _permute_fwd(x, perm, inv):
  return _take(x, perm), (perm, inv)


def _permute_bwd(residual, g):
  perm, inv = residual
  return _take(g, inv), None, None


_permute.defvjp(_permute_fwd, _permute_bwd)


def _index(perm):
  """A host permutation as int32 (int64 is truncated without x64 anyway); traced as given."""
  if isinstance(perm, np.ndarray) and len(perm) <= np.iinfo(np.int32).max:
    return perm.astype(np.int32)
  return perm


def _sequence_array(x):
  """`x` as a `jax.Array` with a sequence axis 1 (NumPy arrays are taken as `jnp` ones)."""
  if isinstance(x, np.ndarray):
    x = jnp.asarray(x)
  if not isinstance(x, jax.Array):
    raise ValueError(f"x must be a jax or NumPy array [B, N, ...], got {type(x).__name__}")
  if x.ndim < 2:
    raise ValueError(f"x must have a sequence axis 1, got shape {x.shape}")
  return x


def serialize(x, perm, *, validate: bool = True):
  """Reorders the sequence axis (1) of `x` into processing order: `x[:, perm]`.

  Differentiable in reverse mode, where the gradient is the inverse gather (`unserialize` of
  the cotangent) rather than the scatter-add JAX would derive; `jax.jvp` is not supported.

  Args:
    x: an array `[B, N, ...]`.
    perm: a permutation of `0 .. N-1` as host data (NumPy array, sequence or concrete
      `jax.Array`), checked; a traced one is refused unless `validate=False`.
    validate: False declares `perm` a permutation whose validity the caller guarantees, e.g. one
      computed on the device under `jax.jit`: it is accepted traced and its values unchecked.

  Example:
    >>> x = jnp.arange(4.0).reshape(1, 4)
    >>> serialize(x, hilbert_permutation((2, 2))).tolist()
    [[0.0, 2.0, 3.0, 1.0]]
  """
  x = _sequence_array(x)
  perm = check_perm(perm, x.shape[1], validate=validate)
  # Host perms are inverted on the host; a traced one by a scatter of N ints, which only the
  # backward uses (dead code otherwise).
  inv = inverse_permutation(perm, validate=False)
  return _permute(x, _index(perm), _index(inv))


def unserialize(x, perm, *, validate: bool = True):
  """Undoes `serialize`: `unserialize(serialize(x, perm), perm) == x`.

  Differentiable in reverse mode like `serialize` (its gradient is a gather by `perm`).

  Args:
    x: an array `[B, N, ...]` in processing order.
    perm: the permutation `serialize` used, as host data; a traced one is refused unless
      `validate=False` (see `serialize`).
    validate: False declares `perm` a permutation whose validity the caller guarantees.

  Example:
    >>> perm = hilbert_permutation((2, 2))
    >>> unserialize(jnp.array([[0.0, 2.0, 3.0, 1.0]]), perm).tolist()
    [[0.0, 1.0, 2.0, 3.0]]
  """
  x = _sequence_array(x)
  # Checked once here; the inversion need not check again.
  perm = check_perm(perm, x.shape[1], validate=validate)
  return _permute(x, _index(inverse_permutation(perm, validate=False)), _index(perm))
