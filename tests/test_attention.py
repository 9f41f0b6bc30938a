"""dilated_attention against the float64 reference: every implementation, one suite."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import helpers
from helpers import Case
from hilbert_ring_jax import DilatedPattern, dilated_attention

# "triton" needs a CUDA GPU: the gpu marker skips it elsewhere.
IMPLEMENTATIONS = ["xla", pytest.param("pallas", marks=pytest.mark.pallas),
                   pytest.param("triton", marks=pytest.mark.gpu)]

CASES = {
    "one_branch": Case(32, 2, 2, (8,), (1,)),
    "two_branches": Case(32, 2, 2, (8, 16), (1, 2)),
    "three_partial": Case(40, 4, 4, (8, 16, 32), (1, 2, 4), batch=2),
    "r_not_dividing_w": Case(29, 4, 4, (6, 10), (4, 3)),
    "offsets_all": Case(36, 2, 2, (12, 7), (3, 2), offsets="all"),
    "head_groups": Case(32, 5, 5, (4, 8, 16), (1, 2, 4), head_groups=True),
    "gqa": Case(32, 4, 2, (8, 16), (1, 2)),
    "gqa_head_groups_unaligned": Case(24, 6, 2, (8, 24), (2, 3), head_groups=True),
    "mqa_offsets_all": Case(30, 4, 1, (10, 30), (1, 3), offsets="all"),
    "w_beyond_n": Case(24, 2, 1, (64,), (1,)),
    "single_token": Case(1, 2, 2, (4, 8), (1, 2)),
}
# Every case runs causal; these run non-causal too (the rest are covered by the random test).
NON_CAUSAL = ["two_branches", "three_partial", "r_not_dividing_w", "offsets_all", "gqa",
              "head_groups"]
F32 = [(name, True) for name in CASES] + [(name, False) for name in NON_CAUSAL]


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("case,causal", F32, ids=[f"{n}-{'causal' if c else 'full'}" for n, c in F32])
def test_float32(case, causal, implementation):
  helpers.check_case(CASES[case], causal, jnp.float32, implementation)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("case", ["three_partial", "gqa"])
def test_low_precision(case, dtype, implementation):
  helpers.check_case(CASES[case], case == "gqa", dtype, implementation)


# Interpret-mode Pallas kernels take ~1 s each to compile on CPU: fewer random examples there.
RANDOM_EXAMPLES = {"pallas": 6}


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_random_configurations(implementation):
  examples = RANDOM_EXAMPLES.get(implementation, settings.default.max_examples)
  settings(max_examples=examples)(given(data=st.data())(_random_configuration))(implementation)


def _random_configuration(implementation, data):
  k = data.draw(st.integers(1, 3), "branches")
  n = data.draw(st.integers(1, 48), "n")
  segs = tuple(data.draw(st.integers(1, 40), "w") for _ in range(k))
  rates = tuple(data.draw(st.integers(1, w), "r") for w in segs)
  kv = data.draw(st.sampled_from([1, 2]), "kv_heads")
  heads = kv * data.draw(st.integers(1, 3), "group")
  groups = heads >= k and data.draw(st.booleans(), "head_groups")
  case = Case(n, heads, kv, segs, rates, data.draw(st.sampled_from(["head", "all"])), groups)
  helpers.check_case(case, data.draw(st.booleans(), "causal"), jnp.float32, implementation,
                     seed=data.draw(st.integers(0, 1000), "seed"))


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_causal_leak(implementation):
  """Perturbing keys and values after position t leaves outputs up to t unchanged."""
  case = CASES["three_partial"]
  pattern = case.pattern(causal=True)
  q, k, v, *_ = helpers.random_inputs(case, jnp.float32, 1)
  t = 21
  noise = np.random.default_rng(9).standard_normal(k.shape)
  noise[:, :t + 1] = 0
  fn = jax.jit(lambda q, k, v: dilated_attention(q, k, v, pattern, return_lse=True,
                                                 implementation=implementation))
  out, lse = fn(q, k, v)
  out2, lse2 = fn(q, k + 100 * noise, v + 100 * noise)
  np.testing.assert_array_equal(out[:, :t + 1], out2[:, :t + 1])
  np.testing.assert_array_equal(lse[:, :t + 1], lse2[:, :t + 1])
  assert not np.allclose(out[:, t + 1:], out2[:, t + 1:])


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_queries_without_keys(implementation):
  """offsets="head", r=2: a head sees only its residue; other queries get 0, -inf, zero grad."""
  pattern = DilatedPattern((8,), (2,))
  q, k, v, dout, dlse = helpers.random_inputs(Case(16, 2, 2, (8,), (2,)), jnp.float32, 2)
  fn = lambda q, k, v: dilated_attention(q, k, v, pattern, return_lse=True,
                                         implementation=implementation)
  (out, lse), vjp = jax.vjp(fn, q, k, v)
  dq, dk, dv = vjp((dout, dlse))
  blind = (np.arange(16)[:, None] % 2) != (np.arange(2)[None, :] % 2)  # [N, H]
  assert np.all(np.asarray(out)[:, blind] == 0)
  assert np.all(np.isneginf(np.asarray(lse)[:, blind]))
  assert np.all(np.asarray(dq)[:, blind] == 0)
  for g in (dq, dk, dv):
    assert np.isfinite(np.asarray(g)).all()
  # A key of residue 1 is seen only by head 1, which reads kv head 1: kv head 0 gets no grad.
  assert np.all(np.asarray(dk)[:, 1::2, 0] == 0) and np.all(np.asarray(dv)[:, 1::2, 0] == 0)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_vmap_and_scale(implementation):
  case = CASES["gqa"]
  pattern = case.pattern(causal=True)
  q, k, v, *_ = helpers.random_inputs(case, jnp.float32, 3)
  qs, ks, vs = (jnp.stack([x, 2 * x]) for x in (q, k, v))
  fn = lambda q, k, v: dilated_attention(q, k, v, pattern, scale=0.3,
                                         implementation=implementation)
  batched = jax.jit(jax.vmap(fn))(qs, ks, vs)
  for i in range(2):
    ref_out, _ = helpers.reference_np.attention(
        *(np.asarray(x[i], np.float64) for x in (qs, ks, vs)),
        helpers.reference_np.multiplicity(case.n, case.heads, case.segment_lengths,
                                          case.dilation_rates, True), 0.3)
    assert helpers.rel_err(batched[i], ref_out) < helpers.TOL[jnp.float32]


def test_dispatcher():
  case = CASES["gqa"]
  q, k, v, *_ = helpers.random_inputs(case, jnp.float32, 4)
  pattern = case.pattern(causal=False)
  default = dilated_attention(q, k, v, pattern)
  np.testing.assert_array_equal(default, dilated_attention(q, k, v, pattern,
                                                           implementation=["xla"]))
  with pytest.raises(ValueError, match="implementation"):
    dilated_attention(q, k, v, pattern, implementation="cuda")
  with pytest.raises(ValueError, match="implementation"):
    dilated_attention(q, k, v, pattern, implementation=[])


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


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_float16_backward_does_not_overflow(implementation):
  """Large `v` and `dout` make `ds = p (dp - delta)` exceed float16's range although every
  gradient fits it: the ds products must not round ds to float16 first."""
  case = Case(16, 1, 1, (16,), (1,), head_dim=64)
  rng = np.random.default_rng(11)
  shape = (1, 16, 1, 64)
  q, k = (jnp.asarray(rng.standard_normal(shape), jnp.float16) for _ in range(2))
  v = jnp.asarray(1e3 * rng.choice([-1.0, 1.0], shape), jnp.float16)
  dout = jnp.asarray(32 * rng.standard_normal(shape), jnp.float16)
  pattern = case.pattern(causal=False)
  fn = lambda q, k, v: dilated_attention(q, k, v, pattern, implementation=implementation)
  grads = jax.vjp(jax.jit(fn), q, k, v)[1](dout)
  _, _, ref = helpers.reference(case, False, q, k, v, dout, np.zeros(shape[:3]))
  for name, g, r in zip("qkv", grads, ref):
    assert np.abs(r).max() < 6e4  # the true gradient is representable in float16
    assert np.isfinite(np.asarray(g, np.float32)).all(), f"d{name}"
    assert helpers.rel_err(g, r) < 2 * helpers.TOL[jnp.float16], (f"d{name}", helpers.rel_err(g, r))


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16], ids=["f16", "bf16"])
def test_huge_logits_keep_gradients_finite(implementation, dtype):
  """Logits of ~1e9 (q, k ~ 6e4): float32 lse rounding must not turn p = exp(s - lse) into
  inf. The softmax is one-hot there and the true gradient about 0."""
  case = Case(32, 2, 2, (16,), (1,), head_dim=16)
  q, k, v, dout, dlse = helpers.random_inputs(case, jnp.float32, 12)
  q, k = (jnp.asarray(6e4 * jnp.sign(x), dtype) for x in (q, k))
  v, dout = v.astype(dtype), dout.astype(dtype)
  pattern = case.pattern(causal=True)
  fn = lambda q, k, v: dilated_attention(q, k, v, pattern, implementation=implementation)
  out, vjp = jax.vjp(jax.jit(fn), q, k, v)
  assert np.isfinite(np.asarray(out, np.float32)).all()
  for g in vjp(dout):
    assert np.isfinite(np.asarray(g, np.float32)).all()


def _huge_logits(seed=0):
  """float16 q, k uniform in +-4e4 at D = 128 (|logits| up to ~5e8; the scale 128 ** -0.5 no
  power of two) and v = 1: every true output is exactly 1."""
  rng = np.random.default_rng(seed)
  q, k = (jnp.asarray(rng.uniform(-4e4, 4e4, (1, 256, 2, 128)), jnp.float16) for _ in "qk")
  return q, k, jnp.ones_like(k), DilatedPattern((16, 32, 64), (1, 2, 4), causal=True)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_huge_logits_forward_is_exact(implementation):
  """No row of finite logits comes back inf, NaN or 0 (docs/SPEC.md: "never inf or NaN"),
  at D = 128 and with a huge scale (1e20, float32)."""
  q, k, v, pattern = _huge_logits()
  out = dilated_attention(q, k, v, pattern, implementation=implementation)
  np.testing.assert_array_equal(np.asarray(out, np.float32), 1.0)
  x = jnp.asarray(np.random.default_rng(1).standard_normal((1, 64, 2, 16)), jnp.float32)
  out, lse = dilated_attention(x, x, jnp.ones_like(x), DilatedPattern((16,), (1,)), scale=1e20,
                               return_lse=True, implementation=implementation)
  np.testing.assert_allclose(out, 1.0, rtol=1e-6)
  assert np.isfinite(np.asarray(lse)).all()


def test_huge_logits_forward_is_exact_on_the_ring():
  q, k, v, pattern = _huge_logits(2)
  from hilbert_ring_jax import sharded_dilated_attention  # pylint: disable=g-import-not-at-top
  mesh = jax.make_mesh((4,), ("seq",), axis_types=(jax.sharding.AxisType.Auto,),
                       devices=jax.devices()[:4])
  out = sharded_dilated_attention(q, k, v, pattern, mesh=mesh, axis_name="seq")
  np.testing.assert_array_equal(np.asarray(out, np.float32), 1.0)
