"""Probe: a float32 accumulator in global memory that a Mosaic GPU kernel adds into with TMA
reduce-add stores, starting from zeros through a mutable ref (jax.new_ref) input."""
import jax, jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

def body(x_ref, acc_ref, smem, bar):
  i = lax.axis_index("i")
  plgpu.copy_gmem_to_smem(x_ref.at[pl.ds(i * 64, 64)], smem, bar)
  plgpu.barrier_wait(bar)
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(smem, acc_ref.at[pl.ds(0, 64)], reduction_op="add")
  plgpu.wait_smem_to_gmem(0)

def f(x):
  acc = jax.new_ref(jnp.zeros((64, 128), jnp.float32))
  plgpu.kernel(body, out_type=(), grid=(4,), grid_names=("i",),
               scratch_types=[plgpu.SMEM((64, 128), jnp.float32), plgpu.Barrier()])(x, acc)
  return acc[...]

x = jax.ShapeDtypeStruct((256, 128), jnp.float32)
txt = jax.jit(f).trace(x).lower(lowering_platforms=("cuda",)).as_text()
print("lowered:", "mosaic_gpu" in txt, len(txt))
