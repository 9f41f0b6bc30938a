# (c) wgmma on bf16 SMEM tiles (tiling+swizzle transforms, TMA in), ACC via run_scoped and via run_state
from common import *
M, N, K = 64, 64, 64
tr = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))  # 64 bf16 = 128 B rows
ka, kb = jax.random.split(jax.random.key(0))
a = jax.random.normal(ka, (M, K), jnp.bfloat16); b = jax.random.normal(kb, (N, K), jnp.bfloat16)
ref = jnp.dot(a.astype(jnp.float32), b.astype(jnp.float32).T)

def make(mode):
    def body(a_gmem, b_gmem, o_gmem, a_smem, b_smem, o_smem, bar):
        plgpu.copy_gmem_to_smem(a_gmem, a_smem, bar.at[0])
        plgpu.copy_gmem_to_smem(b_gmem, b_smem, bar.at[1])
        plgpu.barrier_wait(bar.at[0]); plgpu.barrier_wait(bar.at[1])
        def mm(acc_ref):                       # S = A @ B^T  (B stored [N, K], like K in attention)
            plgpu.wgmma(acc_ref, a_smem, b_smem if mode == "noT" else b_smem.T)
            return acc_ref[...]
        if mode in ("run_scoped", "noT"):
            acc = pl.run_scoped(mm, plgpu.ACC((M, N), jnp.float32))
        else:  # run_state: accumulate onto an existing register value (attention's PV update)
            init = plgpu.layout_cast(jnp.zeros((M, N), jnp.float32), plgpu.Layout.WGMMA)
            def mm2(acc_ref): plgpu.wgmma(acc_ref, a_smem, b_smem.T)
            acc = pl.run_state(mm2)(plgpu.ACC.init(init))
        o_smem[...] = acc
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, o_gmem)
        plgpu.wait_smem_to_gmem(0)
    return plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((M, N), jnp.float32),
        scratch_types=[plgpu.SMEM((M, K), jnp.bfloat16, transforms=tr), plgpu.SMEM((N, K), jnp.bfloat16, transforms=tr),
                       plgpu.SMEM((M, N), jnp.float32), plgpu.Barrier(num_barriers=2)],
        interpret=INTERP)
ref_noT = jnp.dot(a.astype(jnp.float32), b.astype(jnp.float32))   # B stored [K, N]
check("c wgmma A@B (run_scoped ACC)", make("noT"), (a, b), lambda a, b: ref_noT, rtol=1e-2, atol=1e-2)
for mode in ["run_scoped", "run_state"]:
    check(f"c wgmma A@B^T ({mode} ACC)", make(mode), (a, b), lambda a, b: ref, rtol=1e-2, atol=1e-2)
