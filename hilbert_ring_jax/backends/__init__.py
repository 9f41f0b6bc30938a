"""Backends of `dilated_attention`. Each module provides, per the kernel contract:

- `forward(q, k, v, pattern, scale, branches=None) -> (out, lse)`: `out [B, N, H, D]` and
  `lse [B, N, H]`, both float32 (the accumulation dtype), merged over `branches` (indices into
  `pattern.branches`; None: all);
- `backward(q, k, v, dout, lse, delta, pattern, scale, branches=None) -> (dq, dk, dv)`: the
  float32 contribution of `branches`, taking the global `lse` and
  `delta = rowsum(dout * out) - dlse`, so branches and ring steps add up exactly;

Callers cast to the input dtypes once, at the end. A backend raises `NotImplementedError` from
`forward` for a configuration it cannot run, so the dispatcher moves on to the next one.
"""

import importlib

import jax

NAMES = ("triton", "pallas", "xla")


def load(name: str):
  """The backend module `name`; `NotImplementedError` if it cannot be imported here."""
  try:
    return importlib.import_module(f"{__name__}.{name}")
  except ImportError as e:  # e.g. jax_triton missing: fall through to the next backend
    raise NotImplementedError(f"backend {name!r} is unavailable: {e}") from e


def select(names, q, k, v, pattern, scale, branches=None) -> str:
  """The first backend in `names` whose forward accepts this configuration (checked abstractly)."""
  errors = []
  for name in names:
    try:  # the arrays themselves: inside shard_map their types carry the mesh axes
      jax.eval_shape(lambda q, k, v: load(name).forward(q, k, v, pattern, scale, branches),
                     q, k, v)
      return name
    except NotImplementedError as e:
      errors.append(f"{name}: {e}")
  raise NotImplementedError("no implementation can run this configuration: " + "; ".join(errors))
