"""Shared harness. MODE=interpret (default): run kernels in Mosaic GPU interpret mode on CPU and compare.
MODE=lower: only lower for CUDA (sm_90) on this CPU machine and check for the Mosaic GPU custom call."""
import os, sys, traceback
os.environ.setdefault("JAX_PLATFORMS", "cpu")
import jax, jax.numpy as jnp, numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
try:
    from jax.experimental.pallas.mosaic_gpu import InterpretGPUParams
except ImportError:  # JAX 0.10.2: not exported publicly
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
MODE = os.environ.get("MODE", "interpret")
INTERP = InterpretGPUParams() if MODE == "interpret" else False
print("jax", jax.__version__, "MODE", MODE, file=sys.stderr)

def _fail(name, e):
    tb = traceback.extract_tb(e.__traceback__)[-1]
    msg = (str(e).strip().splitlines() or [""])[0][:300]
    print(f"FAIL {name}: {type(e).__name__}: {msg}  [{tb.filename.split('site-packages/')[-1]}:{tb.lineno}]")
    try:
        from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call as ipc
        ipc.reset_gpu_interpret_mode_state()   # required after an error in interpret mode
    except Exception: pass

def try_run(name, fn):
    try:
        fn(); print("OK", name); return True
    except Exception as e:
        _fail(name, e); return False

def lower_cuda(f, *args):
    """Lower (no compile) for CUDA on a CPU-only machine. Returns StableHLO text."""
    return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()

def check(name, f, args, ref_fn, **tol):
    if MODE == "interpret":
        def go():
            out = jax.jit(f)(*args)
            np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref_fn(*args), np.float32), **tol)
        return try_run(name, go)
    def go():
        txt = lower_cuda(f, *args)
        assert "mosaic_gpu" in txt, "no mosaic_gpu custom call in lowered text"
        import re; cc = sorted(set(re.findall(r"custom_call @(\w+)", txt)))
        print(f"   lowered {len(txt)} chars, custom calls: {cc}")
    return try_run(name + " [lower cuda]", go)
