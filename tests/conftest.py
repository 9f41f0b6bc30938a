"""Test setup: XLA's compile options on a CPU, hypothesis, markers (the 8 CPU devices: the
conftest.py above)."""

import importlib.metadata
import os

import hypothesis
import jax
import pytest

# Without a GPU plugin the suite runs on the CPU, where XLA compiling ~2,850 small programs is
# most of its time: LLVM's cheapest code generation halves a ring program's compile (the tests'
# arrays are small, so the slower code costs little). Read when the backend starts, so set
# before any test runs; the doc blocks' processes inherit it. Flags already given are kept.
_GPU_PLUGIN = any((d.metadata["Name"] or "").lower().replace("_", "-").startswith(
    ("jax-cuda", "jax-rocm")) for d in importlib.metadata.distributions())
if not _GPU_PLUGIN or os.environ.get("JAX_PLATFORMS", "").strip().lower() == "cpu":
  _flags = os.environ.get("XLA_FLAGS", "")
  for _flag in ("--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true"):
    if _flag.split("=")[0] not in _flags:
      _flags = f"{_flags} {_flag}".strip()
  os.environ["XLA_FLAGS"] = _flags

hypothesis.settings.register_profile(
    "ci", derandomize=True, deadline=None, max_examples=12, print_blob=True,
    suppress_health_check=[hypothesis.HealthCheck.too_slow])
hypothesis.settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(autouse=True)
def _own_traces_where_patched(request):
  """A test that patches the package (`monkeypatch`) traces its calls itself, and leaves no
  trace made under its patches: the jitted entries cache their traces by their arguments
  (`backends.attention`'s forward by the kernel, `dilated_attention`'s call by its
  dispatch), not by the module attributes a patch changes."""
  # pylint: disable=g-import-not-at-top,protected-access
  from hilbert_ring_jax import api
  from hilbert_ring_jax.backends import base
  patched = "monkeypatch" in request.fixturenames
  clear = lambda: [f.clear_cache() for f in (base._forward, api._attention_jit)]
  if patched:
    clear()
  yield
  if patched:
    clear()


def pytest_collection_modifyitems(config, items):
  if jax.default_backend() == "gpu":
    return
  skip = pytest.mark.skip(reason="needs a CUDA GPU")
  for item in items:
    if "gpu" in item.keywords:
      item.add_marker(skip)
