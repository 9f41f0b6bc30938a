# (e) JAX's own attention_mgpu (3 warpgroups, run_state for PV accumulation) under GPU interpret mode
from common import *
from jax.experimental.pallas.ops.gpu import attention_mgpu as am
if am.cuda_versions is None:   # CPU-only jaxlib: module asserts a CUDA runtime version
    import types; am.cuda_versions = types.SimpleNamespace(cuda_runtime_get_version=lambda: 13000)
try:
    from jax.experimental.pallas.mosaic_gpu import force_gpu_interpret_mode
except ImportError:
    from jax._src.pallas.mosaic_gpu.interpret.params import force_gpu_interpret_mode
B, N, H, D = 1, 128, 1, 64
ks = jax.random.split(jax.random.key(0), 3)
q, k, v = (jax.random.normal(kk, (B, N, H, D), jnp.float16) for kk in ks)
cfg = am.TuningConfig(block_q=64, block_kv=64, max_concurrent_steps=2)
def run():
    with force_gpu_interpret_mode(INTERP):
        out = jax.jit(lambda q, k, v: am.attention(q, k, v, cfg))(q, k, v)
    ref = am.attention_reference(q, k, v)
    np.testing.assert_allclose(out.astype(np.float32), ref.astype(np.float32), atol=3e-2, rtol=3e-2)
try_run("e attention_mgpu fwd", run)
# same, with pl.run_state and plgpu.wgmma shimmed inside attention_mgpu (see interp_shims.py)
from interp_shims import RunStateShimPL, WgmmaShimPLGPU
am.pl = RunStateShimPL(am.pl); am.plgpu = WgmmaShimPLGPU(am.plgpu); jax.clear_caches()
try_run("e attention_mgpu fwd (run_state/wgmma shims)", run)
