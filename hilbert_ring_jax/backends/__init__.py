"""Backends of `dilated_attention`: "xla" (everywhere), "pallas" (Pallas kernels), "triton"
(Triton kernels on CUDA GPUs). `base.py` says what a backend implements and how one is chosen.
"""

from .base import (NAMES, Backend, Kernel, Name, NoBackendError, Problem, Support, attention,
                   candidates, check_config, config_for, load, resolve, vary_like)

__all__ = ["NAMES", "Backend", "Kernel", "Name", "NoBackendError", "Problem", "Support",
           "attention", "candidates", "check_config", "config_for", "load", "resolve",
           "vary_like"]
