# Lowering-only checks on CPU (MODE=lower semantics): attention_mgpu, abstract-mesh variant, and
# whether lowering catches typical kernel bugs.
import os; os.environ["MODE"] = "lower"
from common import *
from jax.experimental.pallas.ops.gpu import attention_mgpu as am
if am.cuda_versions is None:
    import types; am.cuda_versions = types.SimpleNamespace(cuda_runtime_get_version=lambda: 13000)
B, N, H, D = 2, 1024, 4, 128
q = jax.ShapeDtypeStruct((B, N, H, D), jnp.float16)
cfg = am.TuningConfig(block_q=64, block_kv=64, max_concurrent_steps=2)
check("e attention_mgpu fwd B2 N1024 H4 D128", lambda q, k, v: am.attention(q, k, v, cfg), (q, q, q), None)
cfgc = am.TuningConfig(block_q=64, block_kv=64, max_concurrent_steps=2, causal=True)
check("e attention_mgpu fwd causal", lambda q, k, v: am.attention(q, k, v, cfgc), (q, q, q), None)
cfgb = am.TuningConfig(block_q=64, block_kv=64, max_concurrent_steps=2, block_q_dkv=64, block_kv_dkv=64, block_q_dq=64, block_kv_dq=64)
check("e attention_mgpu fwd+bwd (grad)", jax.grad(lambda q, k, v: am.attention(q, k, v, cfgb).astype(jnp.float32).sum(), argnums=(0, 1, 2)), (q, q, q), None)

# same inside an abstract mesh carrying an H100 AbstractDevice (the Pallas-Triton trick)
def in_abstract_mesh():
    dev = jax.sharding.AbstractDevice(device_kind="NVIDIA H100", num_cores=132, platform="gpu")
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=dev)
    with jax.sharding.use_abstract_mesh(mesh):
        txt = lower_cuda(lambda q, k, v: am.attention(q, k, v, cfg), q, q, q)
    assert "mosaic_gpu" in txt
try_run("e attention_mgpu under use_abstract_mesh(H100 AbstractDevice)", in_abstract_mesh)

# Negative tests: does lowering (no GPU) reject bad kernels?
def bad_wgmma(M):
    tr = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    def body(a_gmem, o_gmem, a_smem, o_smem, bar):
        plgpu.copy_gmem_to_smem(a_gmem, a_smem, bar); plgpu.barrier_wait(bar)
        def mm(acc):
            plgpu.wgmma(acc, a_smem, a_smem.T); return acc[...]
        o_smem[...] = pl.run_scoped(mm, plgpu.ACC((M, M), jnp.float32))
        plgpu.commit_smem(); plgpu.copy_smem_to_gmem(o_smem, o_gmem); plgpu.wait_smem_to_gmem(0)
    return plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((M, M), jnp.float32),
        scratch_types=[plgpu.SMEM((M, 64), jnp.bfloat16, transforms=tr), plgpu.SMEM((M, M), jnp.float32), plgpu.Barrier()])
a32 = jax.ShapeDtypeStruct((32, 64), jnp.bfloat16)
try_run("NEG wgmma M=32 (<64) rejected at lowering?", lambda: (lower_cuda(bad_wgmma(32), a32), print("    lowered (NOT caught)")))
def big_smem():
    def body(x, o, s1, s2):
        o[...] = x[...]
    f = plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((64, 128), jnp.float32),
                     scratch_types=[plgpu.SMEM((512, 128), jnp.float32)] * 2)   # 2 x 256 KiB
    lower_cuda(f, jax.ShapeDtypeStruct((64, 128), jnp.float32))
try_run("NEG 512 KiB SMEM rejected at lowering?", lambda: (big_smem(), print("    lowered (NOT caught)")))
def bad_tma_shape():
    def body(x_gmem, o_gmem, smem, bar):
        plgpu.copy_gmem_to_smem(x_gmem.at[pl.ds(0, 64)], smem, bar)   # 64 rows into a 32-row buffer
        plgpu.barrier_wait(bar)
        o_gmem[...] = smem[...]
    f = plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((32, 128), jnp.float32),
                     scratch_types=[plgpu.SMEM((32, 128), jnp.float32), plgpu.Barrier()])
    lower_cuda(f, jax.ShapeDtypeStruct((128, 128), jnp.float32))
try_run("NEG TMA src/dst shape mismatch rejected?", lambda: (bad_tma_shape(), print("    lowered (NOT caught)")))
