"""Backends of `dilated_attention`: "xla" (everywhere), "pallas" (Pallas kernels), "triton"
(Triton kernels on CUDA GPUs), "mosaic" (Pallas Mosaic GPU kernels on Hopper). `base.py` says
what a backend implements and how one is chosen; `common.py` and `hopper.py` hold what several
of them share (no backend imports another), `schedule.py` the block tables the GPU kernels walk.
"""

from .base import (NAMES, Backend, Kernel, Name, NoBackendError, Problem, Support, attention,
                   candidates, check_config, config_for, load, resolve)
from .common import vary_like

__all__ = ["NAMES", "Backend", "Kernel", "Name", "NoBackendError", "Problem", "Support",
           "attention", "candidates", "check_config", "config_for", "load", "resolve",
           "vary_like"]
