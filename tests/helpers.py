"""Shared checks: one configuration run through an implementation and the float64 reference."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np

import reference_np
from hilbert_ring_jax import DilatedPattern, dilated_attention, sharded_dilated_attention

@dataclasses.dataclass(frozen=True)
class Kernels:
  """A backend's forward and backward as `backends.attention` differentiates them, the way
  `dilated_attention` calls them (final output and gradients in the input dtype; packed rows'
  `segment_ids` passed through; the "xla" twin's derivatives where a gradient is itself
  differentiated: `differentiable`)."""

  backend: object
  pattern: DilatedPattern
  scale: float
  config: object

  def differentiable(self):
    from hilbert_ring_jax.backends import xla  # pylint: disable=import-outside-toplevel
    return None if self.backend is xla else Kernels(xla, self.pattern, self.scale, None)

  def forward(self, q, k, v, **ids):
    return self.backend.forward(q, k, v, self.pattern, self.scale, config=self.config,
                                out_dtype=q.dtype, **ids)

  def backward(self, q, k, v, dout, lse, delta, **ids):
    return self.backend.backward(q, k, v, dout, lse, delta, self.pattern, self.scale,
                                 config=self.config, grad_dtype=q.dtype, **ids)


def second_derivatives(loss):
  """Jitted `(q, k, v) ->` second derivatives of the scalar `loss(q, k, v)`: `d/d(q, k, v)` of
  the squared norm of its gradient (reverse over reverse; 16-bit gradients squared in
  float32), then its Hessian times `(q, k, v)` (forward over reverse: `jax.jvp` of the
  gradient)."""
  grad = jax.grad(loss, argnums=(0, 1, 2))

  def norm(q, k, v):
    return sum(jnp.sum(g.astype(jnp.promote_types(g.dtype, jnp.float32)) ** 2)
               for g in grad(q, k, v))

  def both(q, k, v):
    hvp = jax.jvp(grad, (q, k, v), (q, k, v))[1]
    return (*jax.grad(norm, argnums=(0, 1, 2))(q, k, v), *hvp)
  return jax.jit(both)


# Relative L2 error allowed against the float64 reference, by input dtype.
TOL = {jnp.float32: 2e-5, jnp.bfloat16: 3e-2, jnp.float16: 6e-3}


@dataclasses.dataclass(frozen=True)
class Case:
  n: int
  heads: int
  kv_heads: int
  segment_lengths: tuple
  dilation_rates: tuple
  offsets: str = "head"
  head_groups: bool = False
  batch: int = 1
  head_dim: int = 16  # the smallest head dim every backend runs (Triton: 16)

  def pattern(self, causal):
    return DilatedPattern(self.segment_lengths, self.dilation_rates, causal=causal,
                          offsets=self.offsets, head_groups=self.head_groups)


def random_inputs(case, dtype, seed):
  """q, k, v, dout (dtype) and dlse (float32), drawn with NumPy: no compile per shape."""
  rng = np.random.default_rng(seed)
  q_shape = (case.batch, case.n, case.heads, case.head_dim)
  kv_shape = (case.batch, case.n, case.kv_heads, case.head_dim)
  draw = lambda shape, dt=dtype: jnp.asarray(rng.standard_normal(shape), dt)
  return draw(q_shape), draw(kv_shape), draw(kv_shape), draw(q_shape), draw(q_shape[:3],
                                                                             jnp.float32)


def rel_err(x, ref):
  x = np.asarray(x, np.float64)
  return np.linalg.norm(x - ref) / max(np.linalg.norm(ref), 1e-30)


def reference(case, causal, q, k, v, dout, dlse, scale=None):
  scale = case.head_dim ** -0.5 if scale is None else scale
  m = reference_np.multiplicity(case.n, case.heads, case.segment_lengths, case.dilation_rates,
                                causal, case.offsets, case.head_groups)
  return reference_np.attention(*(np.asarray(x, np.float64) for x in (q, k, v)), m, scale,
                                np.asarray(dout, np.float64), np.asarray(dlse, np.float64))


def check_lse(lse, ref_lse, tol):
  lse = np.asarray(lse, np.float64)
  assert lse.dtype == np.float64 and np.array_equal(np.isneginf(lse), np.isneginf(ref_lse))
  assert not np.isnan(lse).any()
  finite = np.isfinite(ref_lse)
  np.testing.assert_allclose(lse[finite], ref_lse[finite], atol=50 * tol, rtol=0)


def check_case(case, causal, dtype, implementation, seed=0, fn=None):
  """Forward, lse and gradients of `fn` (default: dilated_attention) against the reference.
  Returns the compiled `with_grads(fn)` and its inputs `(q, k, v, dout, dlse)`, for further
  checks of the same program."""
  q, k, v, dout, dlse = inputs = random_inputs(case, dtype, seed)
  pattern = case.pattern(causal)
  if fn is None:
    fn = lambda q, k, v: dilated_attention(q, k, v, pattern, return_lse=True,
                                           implementation=implementation)
  both = with_grads(fn)
  (out, lse), grads = both(q, k, v, (dout, dlse))
  check_result(case, causal, dtype, inputs, out, lse, grads)
  return both, inputs


def with_grads(fn):
  """`(q, k, v, cotangent) -> (fn(q, k, v), its gradients)`, jitted: both passes in one
  program (one compile, where an eager `jax.vjp` of a jitted `fn` compiles several)."""
  def both(q, k, v, cotangent):
    result, vjp = jax.vjp(fn, q, k, v)
    return result, vjp(cotangent)

  return jax.jit(both)


def results_with_grads(fn, inputs):
  """`((out, lse), (dq, dk, dv))` of `fn` (`(q, k, v) -> (out, lse)`) at `random_inputs`'
  five, on the host."""
  q, k, v, dout, dlse = inputs
  return jax.device_get(with_grads(fn)(q, k, v, (dout, dlse)))


def assert_same_results(got, want):
  """Two `results_with_grads` agree: outputs, lse (-inf at the same queries) and gradients,
  to float32's rounding of differently ordered sums."""
  (out, lse), grads = got
  (want_out, want_lse), want_grads = want
  np.testing.assert_allclose(out, want_out, rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(want_lse))
  finite = np.isfinite(np.asarray(want_lse))
  np.testing.assert_allclose(np.asarray(lse)[finite], np.asarray(want_lse)[finite], atol=1e-5)
  for g, want_g in zip(grads, want_grads):
    np.testing.assert_allclose(g, want_g, rtol=1e-4, atol=1e-5)


def check_result(case, causal, dtype, inputs, out, lse, grads):
  """`out`, `lse` and `grads` (of the cotangents `dout`, `dlse`) computed from `inputs`
  (`random_inputs`' five) against the reference."""
  q, k, v, dout, dlse = inputs
  ref_out, ref_lse, ref_grads = reference(case, causal, q, k, v, dout, dlse)
  tol = TOL[dtype]
  assert out.dtype == dtype and out.shape == q.shape and lse.dtype == jnp.float32
  assert rel_err(out, ref_out) < tol, rel_err(out, ref_out)
  check_lse(lse, ref_lse, tol)
  for name, g, ref, x in zip("qkv", grads, ref_grads, (q, k, v)):
    assert g.dtype == x.dtype and g.shape == x.shape
    assert np.isfinite(np.asarray(g, np.float32)).all()
    assert rel_err(g, ref) < 2 * tol, (f"d{name}", rel_err(g, ref))


# float16 q, k uniform in +-4e4 at D = 128 (|logits| up to ~5e8; the scale 128 ** -0.5 no
# power of two) and v = 1: every true output is exactly 1.
HUGE_LOGITS_CASE = Case(256, 2, 2, (16, 32, 64), (1, 2, 4), head_dim=128)


def huge_logits(seed=0):
  """q, k, v of HUGE_LOGITS_CASE (its pattern causal)."""
  rng = np.random.default_rng(seed)
  q, k = (jnp.asarray(rng.uniform(-4e4, 4e4, (1, 256, 2, 128)), jnp.float16) for _ in "qk")
  return q, k, jnp.ones_like(k)


def fused_launches(monkeypatch) -> list:
  """A list that grows by one each time the mosaic backward traces a launch whose dk/dv
  kernel adds dq (`mosaic._fused_backward`); caches cleared, so that the next call traces
  afresh instead of reusing an earlier identical trace."""
  from hilbert_ring_jax.backends import mosaic  # pylint: disable=import-outside-toplevel
  fused, original = [], mosaic._fused_backward  # pylint: disable=protected-access

  def counted(*args):
    fused.append(1)
    return original(*args)
  monkeypatch.setattr(mosaic, "_fused_backward", counted)
  jax.clear_caches()
  return fused


def ring_problem(data, seq, per, heads, kv_heads, make):
  """`(case, pattern, mesh)` of a ring test on `data * seq` devices: `seq` shards of `per`
  tokens, the pattern `make(N)`, head dim 8, a batch of `data` (split over a "data" axis of
  the mesh where `data > 1`)."""
  n = seq * per
  pattern = make(n)
  case = Case(n, heads, kv_heads, pattern.segment_lengths, pattern.dilation_rates,
              pattern.offsets, batch=data, head_dim=8)
  devices, auto = jax.devices()[:data * seq], jax.sharding.AxisType.Auto
  mesh = (jax.make_mesh((seq,), ("seq",), axis_types=(auto,), devices=devices) if data == 1
          else jax.make_mesh((data, seq), ("data", "seq"), axis_types=(auto, auto),
                             devices=devices))
  return case, pattern, mesh


def ring_collectives(pattern, p=4, n=64, h=2, hkv=2, grad=False, layout="natural"):
  """`(shape, kind)` of the result of every collective in the ring program over `p` CPU
  devices (`n` tokens in all; `grad`: its forward and backward), as lowered: every move the
  ring makes, before XLA's passes, which only merge or drop moves (a backward's with the
  forward's), a second a program instead of several."""
  x = jax.ShapeDtypeStruct((1, n, h, 16), jnp.float32)
  kv = jax.ShapeDtypeStruct((1, n, hkv, 16), jnp.float32)
  mesh = jax.make_mesh((p,), ("seq",), axis_types=(jax.sharding.AxisType.Auto,),
                       devices=jax.devices()[:p])
  call = lambda q, k, v: sharded_dilated_attention(q, k, v, pattern, mesh=mesh,
                                                   axis_name="seq", layout=layout)
  f = jax.grad(lambda *a: call(*a).sum(), (0, 1, 2)) if grad else call
  hlo = jax.jit(f).lower(x, kv, kv).as_text(dialect="hlo")
  return re.findall(r"= (\S+) (collective-permute|all-gather|all-reduce|all-to-all|"
                    r"reduce-scatter)(?:-start)?\(", hlo)
