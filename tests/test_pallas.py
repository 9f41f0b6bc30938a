"""Checks specific to the "pallas" backend: padding, block shapes, fallback, Triton lowering.

The shared suite (test_backends.py) runs the same function checks for every backend; these
exercise what only the kernels have: padded views, tiles of different sizes, the loops split
at the causal diagonal, head dims that are not a power of two, and the GPU lowering, which
is traced here on CPU down to Triton IR.
"""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import helpers
from helpers import Case
from hilbert_ring_jax import DilatedPattern, dilated_attention
from hilbert_ring_jax import backends
from hilbert_ring_jax.backends import pallas

# CI runs these on its JAX < 0.12 line, where "pallas" is a default GPU candidate.
pytestmark = pytest.mark.pallas

PADDED = {
    # N % w != 0: the last segment is shorter (and w = N caps a long one).
    "n_not_multiple_of_w": Case(50, 2, 2, (32, 16, 64), (1, 2, 4)),
    # w % r != 0: residues have different lengths.
    "w_not_multiple_of_r": Case(48, 4, 2, (24, 15), (5, 4)),
    # dilated segments of 2 and 4 rows in 16-row blocks.
    "segment_shorter_than_block": Case(64, 2, 2, (8, 16), (4, 4)),
    # several blocks, the last one partly padding (M = 34 in blocks of 16).
    "padded_multi_block": Case(100, 3, 1, (100,), (3,), offsets="all"),
    # head dim 24 runs in 32-wide tiles with masked columns.
    "head_dim_not_pow2": Case(40, 2, 2, (20, 40), (1, 2), head_dim=24),
}


# Without the causal mask with `-m slow` (the same tiles and padding, one mask fewer).
@pytest.mark.parametrize("causal", [True, pytest.param(False, marks=pytest.mark.slow)],
                         ids=["causal", "full"])
@pytest.mark.parametrize("name", list(PADDED))
def test_padded_shapes(name, causal):
  helpers.check_case(PADDED[name], causal, jnp.float32, "pallas")


# Unequal tiles move the causal diagonal inside blocks: the unmasked/masked loop split of
# every kernel must still visit exactly the keys j <= i.
BLOCKS = {
    "q32_k16": pallas.Config(block_q=32, block_k=16, block_q_dq=32, block_k_dq=16,
                             block_q_dkv=16, block_k_dkv=32),
    "q16_k32": pallas.Config(block_q=16, block_k=32, block_q_dq=16, block_k_dq=32,
                             block_q_dkv=32, block_k_dkv=16),
}


# Each tiling once on each case by default, the other pairings with `-m slow`.
_UNEQUAL = {"unpadded": Case(128, 2, 1, (64, 128), (1, 2), head_dim=16),
            "padded": Case(96, 2, 2, (96,), (2,), offsets="all")}


@pytest.mark.parametrize("case,blocks", [
    pytest.param(case, blocks, id=f"{name}-{blocks}",
                 marks=pytest.mark.slow if (name == "unpadded") == (blocks == "q32_k16") else ())
    for name, case in _UNEQUAL.items() for blocks in BLOCKS])
def test_unequal_blocks_causal(case, blocks):
  pattern = case.pattern(causal=True)
  fn = lambda q, k, v: dilated_attention(q, k, v, pattern, return_lse=True,
                                         implementation="pallas", config=BLOCKS[blocks])
  helpers.check_case(case, True, jnp.float32, "pallas", fn=fn)


@pytest.mark.parametrize("head_dim", [32, 128])
def test_typical_shape_runs_without_fallback(head_dim):
  """N a multiple of 128, w/r >= 64: the kernels run (no NotImplementedError) and agree."""
  pattern = DilatedPattern((128, 256), (1, 2), causal=True)
  case = Case(256, 2, 1, (128, 256), (1, 2), head_dim=head_dim)
  q, k, v, *_ = helpers.random_inputs(case, jnp.float32, 5)
  out, lse = jax.jit(lambda q, k, v: pallas.forward(q, k, v, pattern, 0.2))(q, k, v)
  assert out.dtype == jnp.float32  # a partial, as the kernel contract says
  ref_out, ref_lse = helpers.reference_np.attention(
      *(np.asarray(x, np.float64) for x in (q, k, v)),
      helpers.reference_np.multiplicity(256, 2, (128, 256), (1, 2), True), 0.2)
  assert helpers.rel_err(out, ref_out) < helpers.TOL[jnp.float32]
  helpers.check_lse(lse, ref_lse, helpers.TOL[jnp.float32])


def test_unsupported_head_dim_falls_back():
  case = Case(16, 2, 2, (8,), (2,), head_dim=264)
  pattern = case.pattern(causal=False)
  q, k, v, *_ = helpers.random_inputs(case, jnp.float32, 6)
  support = pallas.supports(backends.Problem.of(q, k, pattern))
  assert not support and "head dims up to 256" in support.reason
  with pytest.raises(backends.NoBackendError, match="head dims up to 256") as info:
    dilated_attention(q, k, v, pattern, implementation="pallas")
  assert list(info.value.reasons) == ["pallas"]
  with jax.default_matmul_precision("highest"):  # on a GPU, "xla" would use tf32 otherwise
    out = dilated_attention(q, k, v, pattern, implementation=["pallas", "xla"])
  ref_out, _ = helpers.reference(case, False, q, k, v, q, jnp.zeros(q.shape[:3]))[:2]
  assert helpers.rel_err(out, ref_out) < helpers.TOL[jnp.float32]


def test_config_validation():
  with pytest.raises(ValueError, match="block_q"):
    pallas.Config(block_q=48)
  with pytest.raises(ValueError, match="block_k_dkv"):
    pallas.Config(block_k_dkv=8)
  with pytest.raises(ValueError, match="num_warps"):
    pallas.Config(num_warps=0)
  with pytest.raises(ValueError, match="interpret"):
    pallas.Config(interpret="yes")
  with pytest.raises(TypeError):  # keyword-only
    pallas.Config(64)
  for d in (32, 64, 128, 256):
    for dtype in (jnp.bfloat16, jnp.float32):
      cfg = pallas.Config(interpret=False, block_k=32).resolved(d, dtype)
      assert cfg.block_q >= 32 and cfg.block_k == 32 and cfg.interpret is False


def _primitives(jaxpr):
  """Names of the primitives of `jaxpr` and its sub-jaxprs (jit), pallas kernels excluded."""
  names = set()
  for eqn in jaxpr.eqns:
    names.add(eqn.primitive.name)
    if eqn.primitive.name == "pallas_call":
      continue
    for param in eqn.params.values():
      sub = getattr(param, "jaxpr", param)  # ClosedJaxpr -> Jaxpr
      if hasattr(sub, "eqns"):
        names |= _primitives(sub)
  return names


def test_common_case_copies_nothing():
  """N % w == 0, w % r == 0, M a multiple of the block: views only, no pad/gather/scatter."""
  pattern = DilatedPattern((64, 128), (1, 2), causal=True)
  x = jax.ShapeDtypeStruct((1, 256, 4, 32), jnp.bfloat16)
  lse = jax.ShapeDtypeStruct((1, 256, 4), jnp.float32)
  fwd = jax.make_jaxpr(lambda q, k, v: pallas.forward(q, k, v, pattern, 0.1))(x, x, x)
  bwd = jax.make_jaxpr(lambda *a: pallas.backward(*a, pattern, 0.1))(x, x, x, x, lse, lse)
  copies = {"pad", "gather", "scatter", "scatter-add", "concatenate", "dynamic_slice", "slice",
            "transpose"}
  for jaxpr in (fwd.jaxpr, bwd.jaxpr):
    names = _primitives(jaxpr)
    assert "pallas_call" in names and not names & copies, names
  # The check sees copies where there are some: N = 250 pads the last segment.
  x = jax.ShapeDtypeStruct((1, 250, 4, 32), jnp.bfloat16)
  padded = jax.make_jaxpr(lambda q, k, v: pallas.forward(q, k, v, pattern, 0.1))(x, x, x)
  assert "pad" in _primitives(padded.jaxpr)


def _abstract_gpu():
  """A context that lowers for an H100 without one: JAX >= 0.12 reads the GPU's kind there
  instead of from a device, and older JAX accepts it too."""
  try:
    device = jax.sharding.AbstractDevice(device_kind="NVIDIA H100", num_cores=132,
                                         platform="gpu")
    mesh = jax.sharding.AbstractMesh((1,), ("x",), (jax.sharding.AxisType.Explicit,),
                                     abstract_device=device)
  except (AttributeError, TypeError) as e:
    pytest.skip(f"this JAX cannot lower for CUDA without a GPU (no abstract GPU device: {e})")
  return jax.sharding.use_abstract_mesh(mesh)


def _triton_kernels(fn, *args):
  """Lowers `fn` for CUDA from this CPU machine (Pallas -> Triton IR); counts Triton calls."""
  with _abstract_gpu(), warnings.catch_warnings():
    # JAX 0.12 deprecates this lowering (dispatch leaves "pallas" off its GPU default there);
    # the test checks that the kernels still lower for users who ask for them.
    warnings.filterwarnings("ignore", "The Pallas Triton backend is deprecated",
                            DeprecationWarning)
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  return text.count("custom_call @__gpu$xla.gpu.triton(")


@pytest.mark.parametrize("config", [
    dict(n=512, heads=4, kv=4, d=128, segs=(128, 256, 512), rates=(1, 2, 4)),
    dict(n=300, heads=4, kv=2, d=96, segs=(64, 100), rates=(1, 3), causal=True),
    dict(n=256, heads=6, kv=2, d=64, segs=(64, 256), rates=(2, 4), offsets="all",
         head_groups=True, dtype=jnp.float32),
    dict(n=128, heads=2, kv=1, d=256, segs=(128,), rates=(1,), causal=True),
], ids=["longnet", "padded_gqa_d96", "all_groups_f32", "d256"])
def test_triton_lowering(config):
  """The GPU path (interpret=False) lowers to Triton kernels, forward and backward."""
  c = dict(causal=False, offsets="head", head_groups=False, dtype=jnp.bfloat16) | config
  pattern = DilatedPattern(c["segs"], c["rates"], causal=c["causal"], offsets=c["offsets"],
                           head_groups=c["head_groups"])
  q = jax.ShapeDtypeStruct((1, c["n"], c["heads"], c["d"]), c["dtype"])
  kv = jax.ShapeDtypeStruct((1, c["n"], c["kv"], c["d"]), c["dtype"])
  lse = jax.ShapeDtypeStruct((1, c["n"], c["heads"]), jnp.float32)
  gpu = pallas.Config(interpret=False)
  fwd = lambda q, k, v: pallas.forward(q, k, v, pattern, 0.1, config=gpu)
  bwd = lambda *a: pallas.backward(*a, pattern, 0.1, config=gpu)
  # One forward kernel and two backward kernels (dq; dk and dv) per branch.
  assert _triton_kernels(fwd, q, kv, kv) == len(c["segs"])
  assert _triton_kernels(bwd, q, kv, kv, q, lse, lse) == 2 * len(c["segs"])
