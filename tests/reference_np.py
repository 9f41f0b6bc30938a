"""A float64 NumPy reference written from SPEC.md, independent of the library's code."""

import numpy as np


def multiplicity(n, num_heads, segment_lengths, dilation_rates, causal=False, offsets="head",
                 head_groups=False):
  """`m[h, i, j]`: the number of branches in which key j is visible to query i, head h."""
  m = np.zeros((num_heads, n, n), np.float64)
  k = len(segment_lengths)
  if head_groups:
    sizes = [num_heads // k + (1 if b < num_heads % k else 0) for b in range(k)]
    starts = np.cumsum([0] + sizes)
    group_of = {h: b for b in range(k) for h in range(starts[b], starts[b + 1])}
  i = np.arange(n)[:, None]
  j = np.arange(n)[None, :]
  for b, (w, r) in enumerate(zip(segment_lengths, dilation_rates)):
    w = min(w, n)
    res_i, res_j = (i % w) % r, (j % w) % r
    seen = (i // w == j // w) & (res_i == res_j)  # what every head of the branch sees, ...
    if causal:
      seen &= j <= i
    for h in range(num_heads):
      if head_groups and group_of[h] != b:
        continue
      m[h] += seen & (res_i == h % r) if offsets == "head" else seen  # ... or its residue's
  return m


def same_document(q_ids, kv_ids=None):
  """`[B, X, N, N]`: True where query i and key j are of the same document (packed rows), from
  one `[B, N]` array of ids (X = 1), or the queries' and the keys' (`[B, N]` each, X = 1; or
  per head, `[B, N, H]` and `[B, N, Hkv]`, X = H)."""
  q_ids = np.asarray(q_ids)
  kv_ids = q_ids if kv_ids is None else np.asarray(kv_ids)
  if q_ids.ndim == 2:
    return q_ids[:, None, :, None] == kv_ids[:, None, None, :]
  kv_ids = np.repeat(kv_ids, q_ids.shape[2] // kv_ids.shape[2], axis=2)
  return q_ids.transpose(0, 2, 1)[..., :, None] == kv_ids.transpose(0, 2, 1)[..., None, :]


def attention(q, k, v, m, scale, dout=None, dlse=None):
  """Returns out, lse and, given cotangents, (dq, dk, dv), all in float64.

  q: [B, N, H, D]; k, v: [B, N, Hkv, D]; m: [H, N, N] multiplicities, or [B, H, N, N]
  (e.g. times `same_document(segment_ids)`). The [B, H, N, N] arrays are most of the time at
  N = 4096: worked in place (each fresh one costs its pages), the products through BLAS.
  """
  m = m if m.ndim == 4 else m[None]
  # [B, H, N, D], each head's keys and values repeated for the query heads of its group
  q, k, v = (np.asarray(x, np.float64).transpose(0, 2, 1, 3) for x in (q, k, v))
  h, hkv = q.shape[1], k.shape[1]
  kh, vh = (np.repeat(x, h // hkv, axis=1) for x in (k, v))
  s = q @ kh.swapaxes(-1, -2)
  s *= scale
  # -inf where a query does not see the key, so that e = m * exp(s - s_max) is 0 there
  np.copyto(s, -np.inf, where=m == 0)
  s_max = s.max(-1, keepdims=True)
  s_max[~np.isfinite(s_max)] = 0.0  # a query that sees no key
  s -= s_max
  e = np.multiply(m, np.exp(s, out=s), out=s)
  den = e.sum(-1, keepdims=True)
  with np.errstate(divide="ignore"):
    lse = np.log(den[..., 0]) + s_max[..., 0]  # [B, H, N]
  p = np.divide(e, np.where(den > 0, den, 1.0), out=e)  # m * exp(s - lse)
  out = p @ vh
  heads_last = lambda x: np.moveaxis(x, 1, 2)  # [B, H, N, ...] -> [B, N, H, ...]
  if dout is None:
    return heads_last(out), heads_last(lse)
  dout = np.asarray(dout, np.float64).transpose(0, 2, 1, 3)
  delta = (dout * out).sum(-1) - heads_last(np.asarray(dlse, np.float64))  # [B, H, N]
  dp = dout @ vh.swapaxes(-1, -2)
  dp -= delta[..., None]
  ds = np.multiply(p, dp, out=dp)  # p (dp - delta)
  dq = scale * (ds @ kh)
  dkh = scale * (ds.swapaxes(-1, -2) @ q)
  dvh = p.swapaxes(-1, -2) @ dout
  sum_groups = lambda x: heads_last(x.reshape(x.shape[0], hkv, h // hkv, *x.shape[2:]).sum(2))
  return heads_last(out), heads_last(lse), (heads_last(dq), sum_groups(dkh), sum_groups(dvh))
