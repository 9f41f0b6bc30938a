"""Shims that let Mosaic GPU attention-style kernels run under GPU interpret mode (JAX 0.11.2 / 0.12).

Two interpreter gaps (all of 0.10.2 / 0.11.2 / 0.12.0.1):
  * pl.run_state(f)(plgpu.ACC.init(acc)) -- no rule for run_state_p
      (0.10.2: NotImplementedError: Higher-order primitive run_state;
       0.11/0.12: falls through to bind -> ValueError: Cannot lower jaxpr with effects ...).
  * plgpu.wgmma with a register (value) LHS, e.g. P @ V in flash attention
      (ValueError: Expected shape (6,) but got (64, 64) -- interpreter wants an SMEM ref for A).
Under interpret mode we run the accumulator update on values with jnp.dot instead.
On GPU (interpret=False) the real primitives are used, so the kernel body is shared.
"""
import jax, jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu


class _ValueAcc:
    """Stand-in for an ACC ref inside run_state under interpret mode."""
    def __init__(self, value): self.value = value
    def __getitem__(self, idx): return self.value[idx]


def acc_run_state(f, acc, interpret: bool):
    """== pl.run_state(f)(plgpu.ACC.init(acc)); f(acc_ref) must issue wgmmas through `wgmma_any`."""
    if not interpret:
        return pl.run_state(f)(plgpu.ACC.init(acc))
    box = _ValueAcc(acc)
    f(box)
    return box.value


def wgmma_any(acc_ref, a, b, interpret: bool = False, **kw):
    if isinstance(acc_ref, _ValueAcc):           # interpret-mode run_state path
        a_val = a if isinstance(a, jax.Array) else a[...]
        acc_ref.value = acc_ref.value + jnp.dot(a_val, b[...], preferred_element_type=acc_ref.value.dtype)
        return
    return plgpu.wgmma(acc_ref, a, b, **kw)


class RunStateShimPL:       # module proxy for `pl` (used to patch library kernels, e.g. attention_mgpu)
    def __init__(self, m): self._m = m
    def __getattr__(self, n): return getattr(self._m, n)
    def run_state(self, f):
        return lambda init: acc_run_state(f, init._init, interpret=True)


class WgmmaShimPLGPU:       # module proxy for `plgpu`
    def __init__(self, m): self._m = m
    def __getattr__(self, n): return getattr(self._m, n)
    def wgmma(self, acc, a, b, **kw): return wgmma_any(acc, a, b, **kw)
