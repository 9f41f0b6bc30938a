"""`dilated_attention` itself: what the "xla" backend's memory grows with, the numerical range
on the ring, and gradients of gradients. (Every backend against the reference:
test_backends.py.)"""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import helpers
import reference_np
from hilbert_ring_jax import (DilatedPattern, backends, dilated_attention,
                              dilated_attention_reference, sharded_dilated_attention)
from hilbert_ring_jax.api import _Dispatch


def _temp_bytes(n, w, r, grad):
  pattern = DilatedPattern((w,), (r,))
  x = jax.ShapeDtypeStruct((1, n, 2, 16), jnp.float32)
  f = lambda q, k, v: dilated_attention(q, k, v, pattern, implementation="xla").sum()
  f = jax.grad(f, argnums=(0, 1, 2)) if grad else f
  return jax.jit(f).lower(x, x, x).compile().memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize("grad", [False, True], ids=["forward", "gradient"])
def test_xla_memory_is_linear_in_n_and_flat_in_w(grad):
  """Compiled temporary buffers: double N -> about double; grow w past a key block -> flat.

  (Below one key block of 512, a longer segment means a longer block, as it should.)
  """
  base = _temp_bytes(2048, 1024, 1, grad)
  assert _temp_bytes(2048, 2048, 1, grad) < 1.3 * base
  assert _temp_bytes(2048, 2048, 2, grad) < 1.3 * base
  assert 1.6 * base < _temp_bytes(4096, 1024, 1, grad) < 2.4 * base
  assert 1.6 * base < _temp_bytes(4096, 4096, 1, grad) < 2.4 * base


def test_captured_keys_leave_nothing_to_fold():
  """A gradient with respect to q alone of `out.sum()`, k and v captured by the jitted
  function: dout and v are then constants, and XLA folded dout v^T at compile time (10-20x
  the compile time at N = 4096). The compiled gradient holds no constant larger than the
  captured arrays, as a folded block of scores would be."""
  rng = np.random.default_rng(0)
  q, k, v = (jnp.asarray(rng.standard_normal((1, 256, 2, 16)), jnp.float32) for _ in range(3))
  pattern = DilatedPattern((64, 256), (1, 4))
  grad = jax.grad(lambda q: dilated_attention(q, k, v, pattern, implementation="xla").sum())
  text = jax.jit(grad).lower(q).compile().as_text()
  shapes = re.findall(r"\w+\[([\d,]*)\](?:\{[\d,]*\})? constant\(", text)
  assert shapes and max(np.prod([int(d) for d in s.split(",") if d]) for s in shapes) <= q.size


def test_float32_products_are_full_on_every_platform():
  """With float32 inputs the "xla" backend (forward and backward) and the reference multiply
  at HIGHEST precision: XLA's default on GPUs rounds float32 products to TF32 (errors ~1e-3;
  the quickstart's check against the reference failed so on an H200 with JAX 0.12, where
  float32 falls back to "xla"). With bf16 inputs the backend keeps XLA's default (TF32 rounds
  less than bf16 did; the full products would be several times slower there)."""
  pattern = DilatedPattern((64, 256), (1, 4), causal=True)
  attend = lambda q, k, v: dilated_attention(q, k, v, pattern, implementation="xla")
  loss = lambda q, k, v: jnp.sum(attend(q, k, v).astype(jnp.float32) ** 2)
  reference = lambda q, k, v: dilated_attention_reference(q, k, v, pattern)

  def dots(dtype, fn):
    x = jax.ShapeDtypeStruct((1, 256, 2, 16), dtype)
    return [line for line in jax.jit(fn).lower(x, x, x).as_text().splitlines()
            if "dot_general" in line]

  for fn in (attend, jax.grad(loss, argnums=(0, 1, 2)), reference):
    full = dots(jnp.float32, fn)
    assert full and all("HIGHEST" in line for line in full)
  for fn in (attend, jax.grad(loss, argnums=(0, 1, 2))):
    assert not any("HIGHEST" in line for line in dots(jnp.bfloat16, fn))


def test_huge_logits_forward_is_exact_on_the_ring():
  q, k, v = helpers.huge_logits(2)
  pattern = helpers.HUGE_LOGITS_CASE.pattern(causal=True)
  mesh = jax.make_mesh((4,), ("seq",), axis_types=(jax.sharding.AxisType.Auto,),
                       devices=jax.devices()[:4])
  out = sharded_dilated_attention(q, k, v, pattern, mesh=mesh, axis_name="seq")
  np.testing.assert_array_equal(np.asarray(out, np.float32), 1.0)


def _second_order(attention):
  """`helpers.second_derivatives` of a loss on `attention`'s output and log-sum-exp, in the
  inputs' dtype."""
  def loss(q, k, v):
    out, lse = attention(q, k, v)
    return jnp.sum(out ** 2) + jnp.sum(jnp.sin(lse))
  return helpers.second_derivatives(loss)


SECOND_ORDER_CASE = helpers.Case(128, 2, 1, (32, 128), (1, 4), head_dim=8)


def _check_second_order(attention):
  """`attention(q, k, v, pattern)` -> `(out, lse)` on `SECOND_ORDER_CASE`, causal: its second
  derivatives against the dense reference's, in float64."""
  case = SECOND_ORDER_CASE
  pattern = case.pattern(causal=True)
  inputs = helpers.random_inputs(case, jnp.float32, 3)[:3]
  ours = _second_order(lambda q, k, v: attention(q, k, v, pattern))(*inputs)
  with jax.enable_x64():
    ref = _second_order(lambda q, k, v: dilated_attention_reference(
        q, k, v, pattern, return_lse=True))(*(jnp.asarray(x, jnp.float64) for x in inputs))
    ref = [np.asarray(r) for r in ref]
  assert ref[0].dtype == np.float64
  for x, r in zip(ours, ref):
    assert helpers.rel_err(x, r) < 1e-4


@dataclasses.dataclass(frozen=True)
class _NoDerivatives:
  """A kernel without derivatives of its own, as the GPU kernels are: the contract computed by
  the float64 NumPy reference behind `jax.pure_callback`, which JAX cannot differentiate;
  `differentiable()` is the same call on the "xla" backend."""
  pattern: DilatedPattern
  heads: int
  scale: float

  def _reference(self, q, k, v, *cotangents):
    m = reference_np.multiplicity(q.shape[1], self.heads, self.pattern.segment_lengths,
                                  self.pattern.dilation_rates, self.pattern.causal,
                                  self.pattern.offsets)
    return reference_np.attention(q, k, v, m, self.scale, *cotangents)

  def forward(self, q, k, v):
    host = lambda *x: tuple(y.astype(np.float32) for y in self._reference(*x))
    shapes = (jax.ShapeDtypeStruct(q.shape, jnp.float32),
              jax.ShapeDtypeStruct(q.shape[:3], jnp.float32))
    return jax.pure_callback(host, shapes, q, k, v)

  def backward(self, q, k, v, dout, lse, delta):
    def host(q, k, v, dout, lse, delta):
      out, _ = self._reference(q, k, v)
      dlse = (dout * out).sum(-1) - delta  # as `delta` was made
      return tuple(g.astype(np.float32) for g in self._reference(q, k, v, dout, dlse)[2])
    shapes = tuple(jax.ShapeDtypeStruct(x.shape, jnp.float32) for x in (q, k, v))
    return jax.pure_callback(host, shapes, q, k, v, dout, lse, delta)

  def differentiable(self):
    return _Dispatch(self.pattern, self.scale, "xla", "xla")


def test_a_gradient_of_a_gradient():
  """Reverse over reverse and forward over reverse (Hessian-vector products) through a kernel
  without derivatives of its own: where a gradient is differentiated, `attention`'s halves
  take those of the kernel's `differentiable()` twin (before, the GPU kernels failed there:
  "pallas" with a bare AssertionError, "mosaic" with "Differentiation rule for 'mpmd_map' not
  implemented"). Against the dense reference's second derivatives."""
  case = SECOND_ORDER_CASE
  _check_second_order(lambda q, k, v, pattern: backends.attention(
      q, k, v, _NoDerivatives(pattern, case.heads, case.head_dim ** -0.5)))


@pytest.mark.pallas
@pytest.mark.slow  # ~8 s interpreted; the mechanism: test_a_gradient_of_a_gradient
def test_a_gradient_of_a_gradient_through_pallas():
  """The same through the "pallas" kernels (interpreted off a GPU)."""
  _check_second_order(lambda q, k, v, pattern: dilated_attention(
      q, k, v, pattern, return_lse=True, implementation="pallas"))


@pytest.mark.slow  # ~8 s; the mechanism: test_a_gradient_of_a_gradient, and the ring's first
# order through it: test_ring's test_each_step_takes_the_first_backend_that_runs_it
def test_a_gradient_of_a_gradient_on_the_ring():
  """The same on 2 devices, the branch of 128 a ring; "pallas" first among the candidates (it
  declines inside shard_map, so the steps run on "xla"), so that the ring's halves take the
  derivatives of its all-"xla" twin."""
  mesh = jax.make_mesh((2,), ("seq",), axis_types=(jax.sharding.AxisType.Auto,),
                       devices=jax.devices()[:2])
  _check_second_order(lambda q, k, v, pattern: sharded_dilated_attention(
      q, k, v, pattern, mesh=mesh, axis_name="seq", return_lse=True,
      implementation=("pallas", "xla")))


def _non_finite_rows(implementation, n, head_dim, dtype, pattern):
  """A NaN or an inf in q, k or v (one entry): exactly the rows that read it come out
  non-finite (the query's own row; the rows that see the key), out and lse alike where it
  is in q or k (lse NaN or +inf: never finite or -inf beside a broken output), out only
  where it is in v; every other row as the reference's. (An inf in k scores -inf against
  queries of the other sign, which rightly pass: not a case here.)"""
  rng = np.random.default_rng(4)
  at, head = n // 4, 1
  sees = reference_np.multiplicity(n, 2, pattern.segment_lengths, pattern.dilation_rates,
                                   pattern.causal)[head, :, at] > 0  # the rows seeing key `at`
  for where, bad in (("q", np.inf), ("q", np.nan), ("k", np.nan), ("v", np.inf), ("v", np.nan)):
    qkv = [rng.standard_normal((1, n, 2, head_dim)) for _ in range(3)]
    qkv["qkv".index(where)][0, at, head, 0] = bad
    qkv = [jnp.asarray(x, dtype) for x in qkv]
    out, lse = dilated_attention(*qkv, pattern, return_lse=True, implementation=implementation)
    ref_out, ref_lse = dilated_attention_reference(*qkv, pattern, return_lse=True)
    broken = np.zeros((1, n, 2), bool)
    broken[0, :, head] = np.arange(n) == at if where == "q" else sees
    out, lse = np.asarray(out, np.float32), np.asarray(lse)
    assert np.array_equal(~np.isfinite(out).all(-1), broken), (where, bad)
    if where == "v":  # the scores are finite: so is lse
      np.testing.assert_allclose(lse, ref_lse, rtol=1e-2, atol=1e-2)
    else:
      assert np.array_equal(np.isnan(lse) | np.isposinf(lse), broken), (where, bad)
    if implementation == "xla" and where != "v":  # the reference's NaN and inf, exactly
      np.testing.assert_array_equal(np.isnan(lse), np.isnan(ref_lse))
    # The other rows as the reference's (whose dense p @ v makes NaN of 0 * inf in v).
    ref_out = np.asarray(ref_out, np.float32)
    rows = ~broken & np.isfinite(ref_out).all(-1)
    assert rows.sum() >= n, (where, bad)
    np.testing.assert_allclose(out[rows], ref_out[rows], rtol=helpers.TOL[dtype],
                               atol=helpers.TOL[dtype])


@pytest.mark.parametrize("implementation",
                         ["xla", pytest.param("pallas", marks=pytest.mark.pallas)])
def test_non_finite_inputs_reach_only_their_rows(implementation):
  """`_non_finite_rows` on CPU, two branches (the merge keeps a broken row broken); the xla
  backend's lse has the reference's NaN and inf exactly (before, such rows had lse 0; pallas's
  -inf, or a finite one beside a NaN output)."""
  _non_finite_rows(implementation, 16, 8, jnp.float32, DilatedPattern((8, 16), (1, 2)))


@pytest.mark.gpu
@pytest.mark.parametrize("implementation", ["mosaic", "triton", "pallas"])
def test_non_finite_inputs_reach_only_their_rows_on_a_gpu(implementation):
  """`_non_finite_rows` in the kernels themselves, bf16, D = 64, two launches' branches."""
  if implementation == "mosaic" and not backends.load("mosaic").is_hopper():
    pytest.skip("the mosaic kernels run on Hopper GPUs")
  if implementation == "triton":
    pytest.importorskip("jax_triton")
  _non_finite_rows(implementation, 512, 64, jnp.bfloat16, DilatedPattern((256, 512), (1, 2)))


def test_export_with_a_symbolic_batch_and_a_static_sequence():
  """`jax.export` with a symbolic batch: the forward called at two batch sizes and its
  gradient at one, against the float64 reference; a symbolic sequence length raises naming it
  (the pattern is planned on it). The layer exports alike."""
  from flax import nnx  # pylint: disable=g-import-not-at-top
  from hilbert_ring_jax import DilatedMultiHeadAttention  # pylint: disable=g-import-not-at-top
  export = jax.export
  pattern = DilatedPattern((16, 64), (1, 4), causal=True)
  batch, n = export.symbolic_shape("b, n")
  spec = lambda *shape, dtype=jnp.float32: jax.ShapeDtypeStruct(shape, dtype)
  fn = lambda q, k, v, ids: dilated_attention(q, k, v, pattern, segment_ids=ids)
  args = (spec(batch, 64, 4, 16), spec(batch, 64, 2, 16), spec(batch, 64, 2, 16),
          spec(batch, 64, dtype=jnp.int32))
  forward = export.export(jax.jit(fn))(*args)
  grads = export.export(jax.jit(jax.grad(lambda *a: fn(*a).sum(), argnums=(0, 1, 2))))(*args)
  m = reference_np.multiplicity(64, 4, pattern.segment_lengths, pattern.dilation_rates, True)
  rng = np.random.default_rng(0)
  for b in (1, 3):
    q = rng.standard_normal((b, 64, 4, 16)).astype(np.float32)
    k, v = (rng.standard_normal((b, 64, 2, 16)).astype(np.float32) for _ in "kv")
    ids = np.repeat(rng.integers(0, 2, (b, 4)), 16, axis=1).astype(np.int32)
    out, _, want = reference_np.attention(q, k, v, m[None] * reference_np.same_document(ids),
                                          0.25, np.ones(q.shape), np.zeros(q.shape[:3]))
    assert helpers.rel_err(forward.call(q, k, v, ids), out) < 1e-6
  for got, w in zip(grads.call(q, k, v, ids), want):
    assert helpers.rel_err(got, w) < 1e-5
  # The kernels decline it (their launches are planned on B), by name; the xla backend runs.
  kernel_first = lambda q, k, v: dilated_attention(q, k, v, pattern,
                                                    implementation=("pallas", "xla"))
  with pytest.warns(UserWarning, match="symbolic batch .* runs the portable 'xla' backend"):
    export.export(jax.jit(kernel_first))(*args[:3])
  with pytest.raises(NotImplementedError, match="pallas: a symbolic batch"):
    export.export(jax.jit(lambda *a: dilated_attention(*a, pattern, implementation="pallas")))(
        *args[:3])
  with pytest.raises(ValueError, match=r"q's sequence length \(axis 1\) must be known"):
    export.export(jax.jit(fn))(spec(batch, n, 4, 16), spec(batch, n, 2, 16),
                               spec(batch, n, 2, 16), spec(batch, n, dtype=jnp.int32))
  layer = DilatedMultiHeadAttention(4, 32, pattern=pattern, rngs=nnx.Rngs(0))
  graph, state = nnx.split(layer)
  exported = export.export(jax.jit(lambda state, x: nnx.merge(graph, state)(x)))(
      state, spec(batch, 64, 32))
  x = rng.standard_normal((2, 64, 32)).astype(np.float32)
  np.testing.assert_allclose(exported.call(state, x), layer(x), atol=1e-5)
