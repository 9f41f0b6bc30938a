# GPU interpret mode with race detection on the shimmed attention_mgpu (bigger grid, causal) -- JAX 0.11.2/0.12
from common import *
from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call as ipc
from jax.experimental.pallas.ops.gpu import attention_mgpu as am
from interp_shims import RunStateShimPL, WgmmaShimPLGPU
if am.cuda_versions is None:
    import types; am.cuda_versions = types.SimpleNamespace(cuda_runtime_get_version=lambda: 13000)
am.pl = RunStateShimPL(am.pl); am.plgpu = WgmmaShimPLGPU(am.plgpu)
B, N, H, D = 1, 256, 2, 64
ks = jax.random.split(jax.random.key(1), 3)
q, k, v = (jax.random.normal(kk, (B, N, H, D), jnp.float16) for kk in ks)
import os; DR = os.environ.get("DR", "0") == "1"
for causal in (False, True):
    cfg = am.TuningConfig(block_q=64, block_kv=64, max_concurrent_steps=2, causal=causal)
    def run():
        with plgpu.force_gpu_interpret_mode(InterpretGPUParams(detect_races=DR)):
            out = jax.jit(lambda q, k, v: am.attention(q, k, v, cfg))(q, k, v)
        ref = am.attention_reference(q, k, v, causal=causal)
        np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32), atol=3e-2, rtol=3e-2)
        print("   races detected:", ipc.get_races().races_found)
    try_run(f"h attention_mgpu N=256 H=2 causal={causal} detect_races={DR}", run)
