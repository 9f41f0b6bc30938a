# (a) GMEM->SMEM (TMA + barrier) -> GMEM copy, plgpu.kernel
from common import *
M, D = 64, 128
def body(x_gmem, o_gmem, smem, bar):
    plgpu.copy_gmem_to_smem(x_gmem, smem, bar)
    plgpu.barrier_wait(bar)
    smem[...] = smem[...] * 2
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(smem, o_gmem)
    plgpu.wait_smem_to_gmem(0)
f = plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((M, D), jnp.float32),
                 scratch_types=[plgpu.SMEM((M, D), jnp.float32), plgpu.Barrier(num_arrivals=1)],
                 interpret=INTERP)
x = jnp.arange(M * D, dtype=jnp.float32).reshape(M, D)
check("a copy TMA+barrier", f, (x,), lambda x: x * 2)
