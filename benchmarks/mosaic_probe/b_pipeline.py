# (b1) pl.pallas_call with grid+BlockSpecs (Mosaic GPU auto-pipelining), (b2) plgpu.emit_pipeline in plgpu.kernel
from common import *
M, D, T = 256, 128, 64
x = jnp.arange(M * D, dtype=jnp.float32).reshape(M, D)

def add1(x_ref, o_ref):
    o_ref[...] = x_ref[...] + 1
f1 = pl.pallas_call(add1, out_shape=jax.ShapeDtypeStruct((M, D), jnp.float32), grid=(M // T,),
    in_specs=[pl.BlockSpec((T, D), lambda i: (i, 0))], out_specs=pl.BlockSpec((T, D), lambda i: (i, 0)),
    compiler_params=plgpu.CompilerParams(max_concurrent_steps=2), interpret=INTERP)
check("b1 pallas_call grid+BlockSpecs", f1, (x,), lambda x: x + 1)

def body(x_gmem, o_gmem):
    def step(idx, x_smem, o_smem):
        o_smem[...] = x_smem[...] + 1
    plgpu.emit_pipeline(step, grid=(M // T,), in_specs=[pl.BlockSpec((T, D), lambda i: (i, 0))],
                        out_specs=[pl.BlockSpec((T, D), lambda i: (i, 0))], max_concurrent_steps=2)(x_gmem, o_gmem)
f2 = plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((M, D), jnp.float32), interpret=INTERP)
check("b2 emit_pipeline in+out specs", f2, (x,), lambda x: x + 1)

# b3: emit_pipeline with carry (used for online-softmax-style accumulation)
def body3(x_gmem, o_gmem):
    def step(idx, x_smem, carry):
        return carry + x_smem[...]
    acc = plgpu.emit_pipeline(step, grid=(M // T,), in_specs=[pl.BlockSpec((T, D), lambda i: (i, 0))],
                              max_concurrent_steps=2, init_carry=jnp.zeros((T, D), jnp.float32))(x_gmem)
    o_gmem[...] = acc
f3 = plgpu.kernel(body3, out_type=jax.ShapeDtypeStruct((T, D), jnp.float32), interpret=INTERP)
check("b3 emit_pipeline in-only + carry", f3, (x,), lambda x: x.reshape(M // T, T, D).sum(0))
