"""Backends of `dilated_attention`: "xla" (everywhere), "pallas" (Pallas kernels), "triton"
(Triton kernels on CUDA GPUs). `base.py` says what a backend implements and how one is chosen.
"""

from .base import (NAMES, YES, Backend, Kernel, Name, NoBackendError, Problem, Support,
                   attention, candidates, check_config, config_for, load, no, resolve)

__all__ = ["NAMES", "YES", "Backend", "Kernel", "Name", "NoBackendError", "Problem", "Support",
           "attention", "candidates", "check_config", "config_for", "load", "no", "resolve"]
