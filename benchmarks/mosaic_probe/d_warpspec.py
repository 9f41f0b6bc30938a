# (d) warp specialization: num_threads=2 warpgroups (producer WG issues TMA, consumer WG computes),
#     ring of SMEM slots with full/empty barriers; then emit_pipeline_warp_specialized.
from common import *
from jax import lax
M, D, T, S = 256, 128, 64, 2   # S = number of SMEM slots
x = jnp.arange(M * D, dtype=jnp.float32).reshape(M, D)
NB = M // T

def body(x_gmem, o_gmem, buf, full, empty, acc_smem):
    wg = lax.axis_index("wg")
    @pl.when(wg == 1)            # producer
    def _():
        @pl.loop(0, NB)
        def _(i):
            s = i % S
            @pl.when(i >= S)
            def _(): plgpu.barrier_wait(empty.at[s])
            plgpu.copy_gmem_to_smem(x_gmem.at[pl.ds(i * T, T)], buf.at[s], full.at[s])
        # drain: JAX 0.10/0.11 interpreters require every thread to observe every barrier phase
        @pl.loop(max(NB - S, 0), NB)
        def _(i): plgpu.barrier_wait(empty.at[i % S])
    @pl.when(wg == 0)            # consumer
    def _():
        def step(i, acc):
            s = i % S
            plgpu.barrier_wait(full.at[s])
            acc = acc + buf[s]
            plgpu.barrier_arrive(empty.at[s])
            return acc
        acc = lax.fori_loop(0, NB, step, jnp.zeros((T, D), jnp.float32))
        acc_smem[...] = acc
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(acc_smem, o_gmem)
        plgpu.wait_smem_to_gmem(0)

f = plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((T, D), jnp.float32),
    scratch_types=[plgpu.SMEM((S, T, D), jnp.float32), plgpu.Barrier(num_barriers=S),
                   plgpu.Barrier(num_barriers=S), plgpu.SMEM((T, D), jnp.float32)],
    num_threads=2, thread_name="wg", interpret=INTERP)
check("d1 2-WG producer/consumer", f, (x,), lambda x: x.reshape(NB, T, D).sum(0))

# d2: emit_pipeline_warp_specialized (1 compute WG + 1 memory WG), input-only pipeline with carry via compute_context
def body2(x_gmem, o_gmem, acc_smem):
    def compute_ctx(eval_pipeline):
        acc = eval_pipeline(jnp.zeros((T, D), jnp.float32))
        acc_smem[...] = acc
        plgpu.commit_smem(); plgpu.copy_smem_to_gmem(acc_smem, o_gmem); plgpu.wait_smem_to_gmem(0)
    def step(idx, x_smem, carry):
        return carry + x_smem[...]
    pipe = plgpu.emit_pipeline_warp_specialized(step, grid=(NB,), memory_registers=40,
        in_specs=[plgpu.BlockSpec((T, D), lambda i: (i, 0))], max_concurrent_steps=2,
        wg_axis="wg", num_compute_wgs=1, compute_context=compute_ctx)
    pipe(x_gmem)
f2 = plgpu.kernel(body2, out_type=jax.ShapeDtypeStruct((T, D), jnp.float32),
    scratch_types=[plgpu.SMEM((T, D), jnp.float32)], num_threads=2, thread_name="wg", interpret=INTERP)
check("d2 emit_pipeline_warp_specialized", f2, (x,), lambda x: x.reshape(NB, T, D).sum(0))
