"""Backends of `dilated_attention`. Each module provides, per the kernel contract:

- `forward(q, k, v, pattern, scale) -> (out, lse)`: `out` in q's dtype, `lse` float32 `[B, N, H]`;
- `backward(q, k, v, dout, lse, delta, pattern, scale) -> (dq, dk, dv)`, taking the global
  `lse` and `delta = rowsum(dout * out) - dlse`;

and raises `NotImplementedError` from `forward` for a configuration it cannot run, so the
dispatcher moves on to the next implementation.
"""

import importlib

NAMES = ("triton", "pallas", "xla")


def load(name: str):
  """The backend module `name`; `NotImplementedError` if it cannot be imported here."""
  try:
    return importlib.import_module(f"{__name__}.{name}")
  except ImportError as e:  # e.g. jax_triton missing: fall through to the next backend
    raise NotImplementedError(f"backend {name!r} is unavailable: {e}") from e
