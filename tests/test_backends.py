"""The backend protocol (`backends/base.py`): the contract's dtypes, resolution, configs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import helpers
import reference_np
from hilbert_ring_jax import DilatedPattern, backends, dilated_attention, sharded_dilated_attention
from hilbert_ring_jax.backends import pallas, xla

# "triton" needs a CUDA GPU: the gpu marker skips it elsewhere.
BACKENDS = ["xla", pytest.param("pallas", marks=pytest.mark.pallas),
            pytest.param("triton", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16],
                         ids=["f32", "bf16", "f16"])
@pytest.mark.parametrize("name", BACKENDS)
def test_partials_are_float32(name, dtype):
  """Forward partials and backward contributions are float32 whatever the input dtype (the
  ring merges them); `out_dtype` gives a final output in the input dtype."""
  backend = backends.load(name)
  case = helpers.Case(32, 4, 2, (8, 16), (1, 2))
  q, k, v, dout, _ = helpers.random_inputs(case, dtype, 0)
  pattern = case.pattern(causal=True)
  for branches in (None, (1,)):
    assert backend.supports(backends.Problem.of(q, k, pattern, branches))
    out, lse = backend.forward(q, k, v, pattern, 0.25, branches=branches)
    assert out.dtype == lse.dtype == jnp.float32
    # The partial is the attention over the branches' keys (the float64 reference of them).
    picked = [pattern.branches[b] for b in (branches or range(pattern.num_branches))]
    m = reference_np.multiplicity(case.n, case.heads, *zip(*picked), True)
    ref_out, ref_lse = reference_np.attention(*(np.asarray(x, np.float64) for x in (q, k, v)),
                                              m, 0.25)
    assert helpers.rel_err(out, ref_out) < helpers.TOL[dtype]
    helpers.check_lse(lse, ref_lse, helpers.TOL[dtype])
    final, _ = backend.forward(q, k, v, pattern, 0.25, branches=branches, out_dtype=dtype)
    assert final.dtype == dtype
    np.testing.assert_allclose(np.asarray(final, np.float32), out,
                               rtol=helpers.TOL[dtype], atol=helpers.TOL[dtype])
    grads = backend.backward(q, k, v, dout, lse, jnp.zeros(lse.shape), pattern, 0.25,
                             branches=branches)
    assert [g.dtype for g in grads] == [jnp.float32] * 3


def test_resolution_keeps_every_reason():
  q = k = v = jnp.zeros((1, 16, 2, 264))  # too wide a head for pallas
  pattern = DilatedPattern((8,), (2,))
  with pytest.raises(backends.NoBackendError) as info:
    dilated_attention(q, k, v, pattern, implementation=("triton", "pallas"))
  assert set(info.value.reasons) == {"triton", "pallas"}
  assert "head dims up to 256" in info.value.reasons["pallas"]
  assert isinstance(info.value, NotImplementedError)  # what callers catch
  # With "xla" last, the first backend that supports it runs, forward and backward.
  g = jax.grad(lambda q: dilated_attention(q, k, v, pattern,
                                           implementation=("pallas", "xla")).sum())(q)
  assert g.shape == q.shape


def test_supports_declines_without_tracing(monkeypatch):
  """`supports` decides from the problem alone: a declining backend is never called."""
  def fail(*args, **kwargs):
    raise AssertionError("a declining backend was traced")

  monkeypatch.setattr(pallas, "forward", fail)
  monkeypatch.setattr(pallas, "backward", fail)
  q = jnp.ones((1, 16, 2, 264))
  pattern = DilatedPattern((8,), (1,))
  jax.grad(lambda q: dilated_attention(q, q, q, pattern, implementation=("pallas", "xla"))
           .sum())(q)


def test_ring_traces_each_step_once(monkeypatch):
  """A ring pass traces each branch's step calls only, never a probe: resolving a step's
  backend asks `supports`, it does not trace (3 branches, 4 shards: one local, two spanning
  ones with causal zigzag steps)."""
  traces = {"forward": 0, "backward": 0}
  for name in traces:
    original = getattr(xla, name)

    def counted(*args, _original=original, _name=name, **kwargs):
      traces[_name] += 1
      return _original(*args, **kwargs)

    monkeypatch.setattr(xla, name, counted)
  pattern = DilatedPattern((64, 128, 256), (1, 2, 4), causal=True)
  mesh = jax.make_mesh((4,), ("seq",), axis_types=(jax.sharding.AxisType.Auto,),
                       devices=jax.devices()[:4])
  x = jax.ShapeDtypeStruct((1, 256, 4, 16), jnp.float32)
  loss = lambda q, k, v: sharded_dilated_attention(q, k, v, pattern, mesh=mesh,
                                                   axis_name="seq").sum()
  jax.jit(loss).trace(x, x, x)
  # local: 1 call; g = 2 zigzag ring: 3 + 2 per extra step; g = 4: 3 + 3 x 3 (was 30).
  assert traces == {"forward": 15, "backward": 0}
  traces.update(forward=0)
  jax.jit(jax.grad(loss)).trace(x, x, x)
  assert traces == {"forward": 15, "backward": 15}  # was 45 and 15


def test_configs_are_validated_keyword_only_and_routed():
  with pytest.raises(ValueError, match="key_block"):
    xla.Config(key_block=0)
  with pytest.raises(TypeError):
    xla.Config(64)
  q = jnp.asarray(np.random.default_rng(0).standard_normal((1, 40, 2, 8)), jnp.float32)
  pattern = DilatedPattern((20, 40), (1, 2), causal=True)
  with pytest.raises(ValueError, match="config"):
    dilated_attention(q, q, q, pattern, config={"key_block": 8})
  # A config reaches its backend (blocks of 8 keys: a scan over 3 blocks per 20-token
  # segment, where one block needs none) and changes nothing but the blocking; another
  # backend's config is ignored by "xla".
  small = xla.Config(key_block=8)
  run = lambda config: dilated_attention(q, q, q, pattern, implementation="xla", config=config)
  assert "scan" in str(jax.make_jaxpr(lambda q: run(small))(q))
  assert "scan" not in str(jax.make_jaxpr(lambda q: run(None))(q))
  base = run(None)
  ref_out = reference_np.attention(*(np.asarray(x, np.float64) for x in (q, q, q)),
                                   reference_np.multiplicity(40, 2, (20, 40), (1, 2), True),
                                   8 ** -0.5)[0]
  assert helpers.rel_err(base, ref_out) < helpers.TOL[jnp.float32]
  np.testing.assert_allclose(run(small), base, rtol=1e-6, atol=1e-6)
  np.testing.assert_array_equal(run(pallas.Config(block_q=32)), base)


def test_implementation_is_checked():
  q = jnp.zeros((1, 8, 1, 4))
  pattern = DilatedPattern((8,), (1,))
  for bad in (5, [], ["xla", "cuda"], "cuda"):
    with pytest.raises(ValueError, match="implementation"):
      dilated_attention(q, q, q, pattern, implementation=bad)


@pytest.mark.pallas
def test_pallas_declines_inside_shard_map():
  """Inside `shard_map` the inputs vary over the mesh (`Problem.of` says so), which "pallas"
  declines: the ring's steps then take the next candidate."""
  problems = []
  mesh = jax.make_mesh((2,), ("seq",), axis_types=(jax.sharding.AxisType.Auto,),
                       devices=jax.devices()[:2])
  pattern = DilatedPattern((8,), (1,))

  def step(x):
    problems.append(backends.Problem.of(x, x, pattern))
    return x

  x = jax.ShapeDtypeStruct((1, 16, 2, 16), jnp.float32)
  jax.eval_shape(jax.shard_map(step, mesh=mesh, in_specs=jax.P(None, "seq"),
                               out_specs=jax.P(None, "seq")), x)
  (inside,) = problems
  assert inside.varying and not backends.Problem.of(x, x, pattern).varying
  support = pallas.supports(inside)
  assert not support and "shard_map" in support.reason
