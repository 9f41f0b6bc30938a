"""Test setup: 8 CPU devices for the ring tests (before JAX initialises), hypothesis, markers."""

import os

import jax

jax.config.update("jax_num_cpu_devices", 8)

import hypothesis  # noqa: E402
import pytest  # noqa: E402

hypothesis.settings.register_profile(
    "ci", derandomize=True, deadline=None, max_examples=12, print_blob=True,
    suppress_health_check=[hypothesis.HealthCheck.too_slow])
hypothesis.settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def pytest_collection_modifyitems(config, items):
  if jax.default_backend() == "gpu":
    return
  skip = pytest.mark.skip(reason="needs a CUDA GPU")
  for item in items:
    if "gpu" in item.keywords:
      item.add_marker(skip)
