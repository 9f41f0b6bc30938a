"""Test setup: hypothesis, markers (the 8 CPU devices: the conftest.py above)."""

import os

import hypothesis
import jax
import pytest

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
