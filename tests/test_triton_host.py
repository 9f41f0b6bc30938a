"""The "triton" backend's host side against the installed jax-triton, without a GPU.

jax-triton 0.3 and 0.4 disagree on the launch contract (0.4 renamed `out_shape=` and gives
an aliased output no kernel parameter of its own), so these trace every kind of launch:
single- and multi-launch patterns, forward and backward (the backward of a multi-launch
pattern accumulates into the first launch's gradients). With a CUDA-enabled jaxlib installed
(`pip install -e ".[gpu]"`) the kernels are also compiled for sm_90 on the CPU.
"""

import re
import warnings

import jax
import jax.numpy as jnp
import pytest

from hilbert_ring_jax import DilatedPattern

try:  # jax-triton imports only with a CUDA-enabled jaxlib (the plugin runs on CPU machines)
  from hilbert_ring_jax.backends import triton as tb
except ImportError as e:
  pytest.skip(f"jax-triton is not importable here ({e}); pip install -e '.[triton]'",
              allow_module_level=True)

PATTERNS = {
    "one_launch": DilatedPattern((128, 512, 2048), (1, 2, 4)),
    # Rows of 8 all together: {128/1, 512/4} (rows of 32), then {2048/16}.
    "multi_launch": DilatedPattern((128, 512, 2048), (1, 4, 16)),
    "multi_launch_causal_gqa": DilatedPattern((96, 160), (1, 2), causal=True),
}


def _avals(n=2048, heads=4, kv_heads=2, d=64, dtype=jnp.bfloat16):
  q = jax.ShapeDtypeStruct((1, n, heads, d), dtype)
  kv = jax.ShapeDtypeStruct((1, n, kv_heads, d), dtype)
  lse = jax.ShapeDtypeStruct((1, n, heads), jnp.float32)
  return q, kv, lse


@pytest.mark.parametrize("name", list(PATTERNS))
def test_launches_trace(name):
  pattern = PATTERNS[name]
  q, kv, lse = _avals()
  with warnings.catch_warnings():
    warnings.simplefilter("error", DeprecationWarning)  # jax-triton 0.4 deprecates old names
    out, out_lse = jax.eval_shape(lambda q, k, v: tb.forward(q, k, v, pattern, 0.1),
                                  q, kv, kv)
    grads = jax.eval_shape(lambda *a: tb.backward(*a, pattern, 0.1), q, kv, kv, q, lse, lse)
  assert (out.shape, out_lse.shape) == (q.shape, lse.shape)
  assert out.dtype == out_lse.dtype == jnp.float32  # partials, as the kernel contract says
  assert [(g.shape, g.dtype) for g in grads] == [(x.shape, jnp.float32) for x in (q, kv, kv)]


def test_kernels_compile_for_sm90():
  """The multi-launch backward compiles to sm_90 machine code (Triton's own compiler, CPU)."""
  if problem := tb.lowering_problem():  # the backend declines there, and dispatch moves on
    pytest.skip(problem)
  pattern = PATTERNS["multi_launch"]
  q, kv, lse = _avals(n=1024, d=32)
  sm90 = tb.Config(compute_capability=90)
  fn = jax.jit(lambda *a: tb.backward(*a, pattern, 0.1, config=sm90))
  text = fn.trace(q, kv, kv, q, lse, lse).lower(lowering_platforms=("cuda",)).as_text()
  # Two launches, {128/1, 512/4} and {1024/16}: a dq and a dk/dv kernel each, none aliased.
  assert len(re.findall(r"custom_call @triton_kernel_call\w*\(", text)) == 4
  assert "output_operand_aliases" not in text


@pytest.mark.parametrize("per_head", [False, True])
def test_packed_kernels_compile_for_sm90(per_head):
  """Packed rows (`segment_ids`, shared or per head): the forward and the multi-launch
  backward compile to sm_90 machine code, each kernel taking the ids and windows; and the
  backend's `supports` takes packed problems, so dispatch gives them to it."""
  if problem := tb.lowering_problem():
    pytest.skip(problem)
  from hilbert_ring_jax import backends  # pylint: disable=import-outside-toplevel
  packed = backends.Problem((1, 1024, 4, 32), (1, 1024, 2, 32), jnp.dtype(jnp.bfloat16),
                            PATTERNS["multi_launch"], platform="gpu", segment_ids=True)
  assert tb.supports(packed)
  assert backends.resolve(("triton", "xla"), packed) == "triton"
  pattern = PATTERNS["multi_launch_causal_gqa"]
  q, kv, lse = _avals(n=1024, d=32)
  ids = tuple(jax.ShapeDtypeStruct((1, 1024) + ((x.shape[2],) if per_head else ()), jnp.int32)
              for x in (q, kv))
  sm90 = tb.Config(compute_capability=90)
  lower = lambda f, *a: jax.jit(f).trace(*a).lower(lowering_platforms=("cuda",)).as_text()
  text = lower(lambda q, k, v, *ids: tb.forward(q, k, v, pattern, 0.1, config=sm90,
                                                segment_ids=ids), q, kv, kv, *ids)
  assert len(re.findall(r"custom_call @triton_kernel_call\w*\(", text)) == 2
  text = lower(lambda *a: tb.backward(*a[:6], pattern, 0.1, config=sm90, segment_ids=a[6:]),
               q, kv, kv, q, lse, lse, *ids)
  assert len(re.findall(r"custom_call @triton_kernel_call\w*\(", text)) == 4
