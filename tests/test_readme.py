"""The README's decoding example runs as written and computes what it says."""

import pathlib
import re

import jax
import numpy as np

from hilbert_ring_jax import dilated_attention, init_kv_cache

README = pathlib.Path(__file__).parents[1] / "README.md"


def test_decoding_example():
  text = README.read_text()
  (code,) = re.findall(r"<!-- Run by tests/test_readme.py. -->\n```python\n(.*?)```", text,
                       re.S)
  env = {}
  with jax.default_matmul_precision("highest"):
    exec(compile(code, str(README), "exec"), env)  # pylint: disable=exec-used
    q, k, v, pattern, x, layer = (env[n] for n in ("q", "k", "v", "pattern", "x", "layer"))
    full = dilated_attention(q, k, v, pattern)
    np.testing.assert_allclose(env["out"], full[:, :200], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(env["out_t"], full[:, -1:], rtol=1e-5, atol=1e-5)
    empty = init_kv_cache(pattern, batch=1, num_heads=8, num_kv_heads=2, head_dim=32)
    assert [c.shape for c in env["cache"].k] == [c.shape for c in empty.k]
    assert int(env["cache"].length) == 300
    expected = layer(x, decode=False)[:, :201]  # same shapes as q, k, v: compiled already
    np.testing.assert_allclose(env["y"], expected[:, :200], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(env["y_next"], expected[:, 200:], rtol=1e-5, atol=1e-5)
    assert int(layer.cache_index[...]) == 201
