"""What a backend is, how one is chosen, and the one custom_vjp around the kernel contract.

A backend is a module of `hilbert_ring_jax.backends` that provides (see `Backend`):

- `Config`: a frozen, keyword-only dataclass of its tuning knobs (validated on construction);
  `None` everywhere means "the backend's own tuned defaults";
- `supports(problem) -> Support`: whether it runs a `Problem` (shapes, dtypes, pattern,
  branches, platform), decided from those facts alone: no trial trace;
- `forward(q, k, v, pattern, scale, *, branches=None, config=None, out_dtype=None)` ->
  `(out [B, N, H, D], lse [B, N, H])`: the attention over the keys of `branches` (indices into
  `pattern.branches`; None: all), merged. Both are float32 *partials*, ready for `merge`;
  a caller may ask for `out_dtype=q.dtype` for a final result (no merge follows) or for a
  partial it merges once more (one more rounding), so no float32 copy of it is materialized.
  A backend whose `supports` accepts problems with `segment_ids` set also takes
  `segment_ids=(q_ids, kv_ids)` (integer `[B, N]` each, or per head `[B, N, H]` and `[B, N,
  Hkv]`: the document of each query and of each key; a query sees a key only within its
  document), in `forward` and `backward` alike; it is passed only when set;
- `backward(q, k, v, dout, lse, delta, pattern, scale, *, branches=None, config=None,
  grad_dtype=None)` -> float32 `(dq, dk, dv)`: the contribution of `branches`, given the
  *global* `lse` and `delta = rowsum(dout * out) - dlse`, so that branches, launches and ring
  steps add up to the exact gradient (docs/SPEC.md, sections 5 and 6); a caller whose
  gradients are final, or added once more, may pass `grad_dtype=q.dtype`, and a backend may
  then return them in that dtype directly (bfloat16 only: float16 needs `attention`'s
  saturating cast), so no float32 copy of them is materialized;
- a decoding step (`decode.py`), in "xla" (the portable step, any T) and in the backends of
  `STEP_KERNELS` (a kernel of their own, one token): `step(q, k, v, ks, vs, length, tables,
  scale, *, config=None)` -> float32 `(out [B, T, H, D], lse [B, T, H])` of the new tokens at
  positions `length, length + 1, ...` (q `[B, T, H, D]`, k, v `[B, T, Hkv, D]`) over their
  own keys and the cached rows before `length` that they read. `ks, vs` are the cache (a
  `[B, Hkv, R_b, rows_b, D]` pair per branch, its slots laid out by `tables`: decode.py); a
  single token's own row is already written there (a kernel may read it from the cache).
  `supports` answers for a step when `problem.step` is set; with `problem.segment_ids` too,
  `step` also takes `first=` (one int32 `[B, r]` array a branch: each residue's cached rows
  before that position are of other documents and not read).

A kernel backend's entry points are wrapped in `common.in_32_bits`: traced as without JAX's
64-bit mode where it is on, their ids int32 (equal where the given ids are).

A backend may also provide `ring_step_config(config) -> Config`: the config its ring steps
run with (`config`: the caller's, or None), where other work (the next step's transfers)
shares the device with them; and a kernel that gathers a ring's keys itself (the ring's
`KERNEL_GATHER`): `gathers(q_shape, kv_shape, dtype, shards, scale, causal) -> Support` and
`gathered_forward(q, k, v, scale, *, axis_name, shards, causal, config=None)` -> `(out, lse,
(k, v))`, full attention of a device's queries over every device's keys (inside shard_map;
causal: each device's shard holds chunks `j` and `2P - 1 - j` of `2P`, zigzag order, queries
and keys alike), out in q's dtype, and the keys and values gathered `[B, P n, Hkv, D]` (each
device's shard in device order).

`resolve` picks the first candidate whose `supports` says yes, once per call (or per ring
branch): forward and backward are resolved from the same facts, and when every candidate
declines, `NoBackendError` keeps each one's reason. A decoding step is resolved the same way,
from a `Problem` with `step` set. To add a backend: write the module, add its name to `Name`,
and give it a place in `candidates`' platform defaults (and in `STEP_KERNELS` if it brings a
token-step kernel).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import numbers
import typing
import warnings
from collections.abc import Sequence
from types import ModuleType
from typing import Literal, Protocol

import jax
import jax.numpy as jnp

from ..pattern import DilatedPattern
from .common import cotangent_like, vary_alike, varying_axes

Name = Literal["mosaic", "triton", "pallas", "xla"]
NAMES: tuple[Name, ...] = typing.get_args(Name)
# The backends with a token-step kernel of their own (`step`, one token); every other
# backend decodes with the portable step, "xla"'s.
STEP_KERNELS: tuple[Name, ...] = ("mosaic",)


@dataclasses.dataclass(frozen=True)
class Problem:
  """What a backend is asked to compute: the abstract facts `supports` decides on.

  Attributes:
    q_shape, kv_shape: `[B, N, H, D]` and `[B, N, Hkv, D]`.
    dtype: the input dtype.
    pattern, branches: the pattern and the branch indices to compute (None: all).
    platform: `jax.default_backend()` ("cpu", "gpu", ...).
    varying: whether the inputs vary over mesh axes (inside `shard_map(check_vma=True)`).
    backward: whether the backward pass is asked for (else the forward).
    step: a decoding step: `q_shape`, `kv_shape` are the T new tokens' `[B, T, H(kv), D]`,
      read against a KV cache of `pattern` (decode.py), and the backend's `step` runs it.
    interpret: a decoding step whose kernel config asks for interpret mode
      (`mosaic_decode.Config(interpret=True)`): the kernel runs off its platform, on a CPU.
    segment_ids: packed sequences: the call passes `segment_ids=(q_ids, kv_ids)`.
    config: the call's `config` (any backend's, or None): the backend whose kind it is
      decides with it (`config_for`), the others with their defaults.
  """

  q_shape: tuple[int, ...]
  kv_shape: tuple[int, ...]
  dtype: jnp.dtype
  pattern: DilatedPattern
  branches: tuple[int, ...] | None = None
  platform: str = "cpu"
  varying: bool = False
  backward: bool = False
  step: bool = False
  interpret: bool = False
  segment_ids: bool = False
  config: typing.Any = None

  @classmethod
  def of(cls, q, k, pattern, branches=None, *, like=None) -> Problem:
    """The problem of arrays (or shape/dtype structs) `q`, `k`; `like` (default `q`) is a
    real array whose mesh-axes type, with `k`'s, tells whether the inputs vary inside
    `shard_map` (either may: a replicated operand beside a split one)."""
    varying = varying_axes(q if like is None else like) | varying_axes(k)
    return cls(tuple(q.shape), tuple(k.shape), jnp.dtype(q.dtype), pattern,
               None if branches is None else tuple(branches), jax.default_backend(),
               bool(varying))

  @property
  def head_dim(self) -> int:
    return self.q_shape[-1]


class Support(typing.NamedTuple):
  """`supports`' answer: truthy when the backend runs the problem, else falsy with a reason."""

  ok: bool
  reason: str = ""

  def __bool__(self) -> bool:
    return self.ok


YES = Support(True)


def no(reason: str) -> Support:
  return Support(False, reason)


class Backend(Protocol):
  """The interface every backend module implements (see the module docstring); "xla" and
  the backends of `STEP_KERNELS` also have `step`, a decoding step."""

  Config: type

  def supports(self, problem: Problem) -> Support: ...

  def forward(self, q, k, v, pattern: DilatedPattern, scale: float, *, branches=None,
              config=None, out_dtype=None): ...

  def backward(self, q, k, v, dout, lse, delta, pattern: DilatedPattern, scale: float, *,
               branches=None, config=None, grad_dtype=None): ...


class NoBackendError(NotImplementedError):
  """No candidate backend runs the problem; `reasons` maps each name to why it declined."""

  def __init__(self, reasons: dict[str, str]):
    self.reasons = dict(reasons)
    super().__init__("no implementation can run this configuration: " +
                     "; ".join(f"{name}: {why}" for name, why in reasons.items()))


def load(name: Name) -> ModuleType:
  """The backend module `name`; `ImportError` if it cannot be imported here."""
  return importlib.import_module(f"{__package__}.{name}")


def candidates(implementation) -> tuple[Name, ...]:
  """`implementation` (None, a name or a sequence of names) as backend names to try in order.

  None: the platform's defaults, fastest first: on a GPU "mosaic" (Hopper only: measured
  faster than "triton" on every shape timed, forward and forward+backward; docs/performance.md),
  "triton", "pallas" (JAX < 0.12: 0.12 deprecates Pallas's Triton lowering, with a warning),
  "xla"; elsewhere "xla".
  """
  if implementation is None:
    if jax.default_backend() == "gpu":
      pallas = ("pallas",) if jax.__version_info__ < (0, 12) else ()
      return ("mosaic", "triton", *pallas, "xla")
    return ("xla",)
  names = (implementation,) if isinstance(implementation, str) else implementation
  if not isinstance(names, Sequence) or not names or any(n not in NAMES for n in names):
    raise ValueError(f"implementation must be None, one of {NAMES} or a non-empty sequence "
                     f"of them, got implementation={implementation!r}")
  return tuple(names)


# Why a kernel declines a batch of `jax.export`'s symbolic dimensions.
SYMBOLIC_BATCH = "a symbolic batch (jax.export): the kernels' launches are planned on it"


def resolve(names: Sequence[Name], problem: Problem) -> Name:
  """The first of `names` whose backend supports `problem`; `NoBackendError` if none does.

  A decoding step (`problem.step`) asks a backend of `STEP_KERNELS` whether its kernel runs
  it (one token); any other backend, and any chunk of several tokens, decodes with the
  portable step: "xla" stands in for it."""
  reasons = {}
  for name in names:
    if problem.step and (name not in STEP_KERNELS or problem.q_shape[1] != 1):
      name = "xla"
    if name != "xla" and not isinstance(problem.q_shape[0], numbers.Integral):
      reasons[name] = SYMBOLIC_BATCH
      continue
    try:
      backend = load(name)
    except ImportError as e:  # e.g. jax_triton missing
      reasons[name] = f"unavailable here ({e})"
      continue
    support = backend.supports(problem)
    if support:
      if SYMBOLIC_BATCH in reasons.values():
        warnings.warn(f"{SYMBOLIC_BATCH}: this call runs the portable {name!r} backend (export "
                      f"with a concrete batch for the kernels)", stacklevel=2)
      return name
    reasons[name] = support.reason
  raise NoBackendError(reasons)


def config_for(backend: ModuleType, config, ring_step: bool = False):
  """`config` if it is `backend`'s kind of config, else None (that backend's defaults). For a
  ring step (`ring_step`: the keys of the next step travel while it runs), a backend with a
  `ring_step_config(config)` fills in its defaults for running beside the transfers."""
  config = config if isinstance(config, backend.Config) else None
  if ring_step and hasattr(backend, "ring_step_config"):
    return backend.ring_step_config(config)
  return config


def check_config(config) -> None:
  if config is not None and not any(
      isinstance(config, getattr(_loaded(name), "Config", ())) for name in NAMES):
    raise ValueError(f"config must be None or a backend's Config (e.g. "
                     f"hilbert_ring_jax.backends.xla.Config), got config={config!r}")


def _loaded(name):
  try:
    return load(name)
  except ImportError:
    return None


class Kernel(Protocol):
  """The two halves `attention` differentiates: any computation following the contract.
  A kernel called with `segment_ids` (`attention`'s argument) gets them as a keyword. A
  kernel whose `saves` is true keeps residuals of its own for its backward: its forward is
  called with `save=True` and returns `(out, lse, saved)` (undifferentiated, the program
  drops them), and its backward gets `saved=` (the ring: keys its forward gathered, which
  the backward then need not).
  A kernel may also provide `differentiable()`: the same computation by backends whose code
  JAX differentiates ("xla"), or None where its own is; where a gradient is itself
  differentiated (a gradient of a gradient), the halves take that one's derivatives (the GPU
  kernels have none of their own)."""

  saves: bool = False

  def forward(self, q, k, v): ...  # -> (out, lse)

  def backward(self, q, k, v, dout, lse, delta): ...  # -> (dq, dk, dv), float32 or q's dtype


def _ids(segment_ids) -> dict:
  return {} if segment_ids is None else {"segment_ids": segment_ids}


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def attention(q, k, v, kernel: Kernel, segment_ids=None):
  """`(out, lse)` of `kernel` with the contract's exact gradient: out in q's dtype, lse float32.

  The one custom_vjp of the package: `dilated_attention`, the ring and the tests all go
  through it. `kernel` is a hashable object (a static argument) with `forward(q, k, v)` and
  `backward(q, k, v, dout, lse, delta)`; the backward gets `delta = rowsum(dout * out) - dlse`,
  the one row statistic every backward needs. `segment_ids` (None, or integer arrays: the
  documents of packed sequences) go to both halves as a keyword and get no gradient.
  """
  return _forward(q, k, v, kernel, segment_ids)[:2]  # (as `_attention_fwd`: one trace)


def _differentiated_as(fallback, fn, *args):
  """`fn(*args)`, whose derivatives, where JAX takes some (a gradient of a gradient), are
  those of `fallback(*args)`: the same function's first outputs by code JAX differentiates
  (`Kernel.differentiable`; None: `fn`'s own). Outputs past `fallback`'s (the kernel's saved
  residuals) get zero tangents: the backward's fallback does not read them."""
  if fallback is None:
    return fn(*args)
  call = jax.custom_jvp(fn)

  def jvp(primals, tangents):
    out = fn(*primals)
    _, derived = jax.jvp(fallback, primals, tangents)
    derived = [d.astype(o.dtype) for d, o in zip(derived, out)]
    return out, (*derived, *(jax.tree.map(jnp.zeros_like, o) for o in out[len(derived):]))

  call.defjvp(jvp)
  return call(*args)


def _differentiable(kernel):
  """`kernel.differentiable()`, or None where the kernel has none."""
  differentiable = getattr(kernel, "differentiable", None)
  return None if differentiable is None else differentiable()


@functools.partial(jax.jit, static_argnames="kernel")
def _forward(q, k, v, kernel, segment_ids):
  """`(out, lse, saved)`: `saved` the kernel's own residuals where it keeps some
  (`Kernel.saves`), else None.

  Jitted, and called alike by `attention` and `_attention_fwd` (a primal call's program
  drops the residuals): a call differentiated from outside a `jax.jit` or `shard_map` around
  it stages the primal, then traces the fwd rule, which then comes from jit's cache (a ring's
  forward+backward traced in 1.3 s instead of 2.1 on a CPU). The cache keys on `kernel`: a
  kernel holds whatever its trace depends on (the ring: its module settings)."""
  # Inside shard_map the operands may vary over different mesh axes (q sharded, k and v
  # replicated): the kernel gets them typed alike, and the backward sums the gradients back.
  leaves, tree = jax.tree.flatten(segment_ids)
  q, k, v, *leaves = vary_alike(q, k, v, *leaves)
  saves = getattr(kernel, "saves", False)

  def forward(kernel, saves, q, k, v, *leaves):
    ids = _ids(jax.tree.unflatten(tree, leaves))
    if saves:
      return kernel.forward(q, k, v, save=True, **ids)
    return (*kernel.forward(q, k, v, **ids), None)

  other = _differentiable(kernel)
  out, lse, saved = _differentiated_as(
      None if other is None else lambda *arrays: forward(other, False, *arrays)[:2],
      functools.partial(forward, kernel, saves), q, k, v, *leaves)
  return (*vary_alike(out.astype(q.dtype), lse.astype(jnp.float32), q)[:2], saved)


def _attention_fwd(q, k, v, kernel, segment_ids):
  out, lse, saved = _forward(q, k, v, kernel, segment_ids)
  return (out, lse), (q, k, v, out, lse, segment_ids, saved)


def _attention_bwd(kernel, res, cotangents):
  q, k, v, out, lse, segment_ids, saved = res
  dout, dlse = cotangents
  delta = jnp.sum(dout.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)
  delta = delta - dlse.astype(jnp.float32)
  leaves, tree = jax.tree.flatten(segment_ids)
  operands = vary_alike(q, k, v, dout, lse, delta, *leaves)

  def backward(kernel, saved, *operands):
    ids = _ids(jax.tree.unflatten(tree, operands[6:]))
    return kernel.backward(*operands[:6], **ids, **({} if saved is None else {"saved": saved}))

  other = _differentiable(kernel)
  grads = _differentiated_as(
      None if other is None else lambda _, *operands: backward(other, None, *operands),
      functools.partial(backward, kernel), saved, *operands)
  # Integer ids get no cotangent (None: zero).
  return (*(_saturate(cotangent_like(g, x), x.dtype) for g, x in zip(grads, (q, k, v))),
          jax.tree.map(lambda _: None, segment_ids))


def _saturate(x, dtype):
  """`x` cast to `dtype`, float16 saturating at its largest finite value rather than inf."""
  if dtype == jnp.float16:
    big = float(jnp.finfo(jnp.float16).max)
    x = jnp.clip(x, -big, big)
  return x.astype(dtype)


attention.defvjp(_attention_fwd, _attention_bwd)
