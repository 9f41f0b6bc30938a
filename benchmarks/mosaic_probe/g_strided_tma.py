# (3) Dilated ("strided") TMA tiles: from the free 6-D view [B, N/w, w/r, r, H, D] of x[B, N, H, D],
# fetch the 2-D tile rows x D for fixed (b, seg, residue c, head h): row stride = r*H*D elements.
from common import *
from jax import lax
B, N, H, D = 2, 512, 2, 64
w, r = 256, 4
S, R = N // w, w // r            # segments, rows per residue (=64)
T = 64                           # tile rows (R % T == 0)
tr = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))   # wgmma-ready bf16 layout
x = jax.random.normal(jax.random.key(0), (B, N, H, D), jnp.bfloat16)
x6 = x.reshape(B, S, R, r, H, D)                       # free view (row-major bitcast)
ref6 = lambda x6: (x6.transpose(0, 1, 3, 4, 2, 5).astype(jnp.float32) * 2)   # [B,S,r,H,R,D]
OUT = jax.ShapeDtypeStruct((B, S, r, H, R, D), jnp.float32)
GRID = dict(grid=(B, S, r * H), grid_names=("b", "s", "ch"))

def ids():
    b, s, ch = lax.axis_index("b"), lax.axis_index("s"), lax.axis_index("ch")
    return b, s, ch // H, ch % H

# v1: plgpu.copy_gmem_to_smem on x6.at[b, s, pl.ds(i*T, T), c, h]  (4 squeezed dims, 6-D GMEM ref)
def body1(x_gmem, o_gmem, x_smem, o_smem, bar):
    b, s, c, h = ids()
    for i in range(R // T):
        plgpu.copy_gmem_to_smem(x_gmem.at[b, s, pl.ds(i * T, T), c, h], x_smem, bar)
        plgpu.barrier_wait(bar)
        o_smem[...] = x_smem[...].astype(jnp.float32) * 2
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, o_gmem.at[b, s, c, h, pl.ds(i * T, T)])
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
f1 = plgpu.kernel(body1, out_type=OUT, scratch_types=[plgpu.SMEM((T, D), jnp.bfloat16, transforms=tr),
                  plgpu.SMEM((T, D), jnp.float32), plgpu.Barrier()], interpret=INTERP, **GRID)
check("g1 6-D view, copy_gmem_to_smem(x6.at[b,s,ds,c,h])", f1, (x6,), ref6)

# (a scalar python/int32 init_carry here fails to LOWER: 'Shaped arrays must be represented by ir.Values, got: 0')
# v2: plgpu.emit_pipeline with BlockSpec over the 6-D view, None = squeezed dims, index_map closes over b,s,c,h
def body2(x_gmem, o_gmem, o_smem):
    b, s, c, h = ids()
    def step(idx, x_smem):
        (i,) = idx
        o_smem[...] = x_smem[...].astype(jnp.float32) * 2
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, o_gmem.at[b, s, c, h, pl.ds(i * T, T)])
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    plgpu.emit_pipeline(step, grid=(R // T,), max_concurrent_steps=2,
        in_specs=[plgpu.BlockSpec((None, None, T, None, None, D), lambda i: (b, s, i, c, h, 0), transforms=tr)],
    )(x_gmem)
f2 = plgpu.kernel(body2, out_type=OUT, scratch_types=[plgpu.SMEM((T, D), jnp.float32)], interpret=INTERP, **GRID)
check("g2 6-D view, emit_pipeline BlockSpec((None,None,T,None,None,D))", f2, (x6,), ref6)

# v3: same tile from a 4-D view [B*S, R, r*H, D] (TMA max rank is 5; fallback if 6-D is rejected)
x4 = x.reshape(B * S, R, r * H, D)
def body3(x_gmem, o_gmem, x_smem, o_smem, bar):
    b, s, c, h = ids()
    for i in range(R // T):
        plgpu.copy_gmem_to_smem(x_gmem.at[b * S + s, pl.ds(i * T, T), c * H + h], x_smem, bar)
        plgpu.barrier_wait(bar)
        o_smem[...] = x_smem[...].astype(jnp.float32) * 2
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, o_gmem.at[b, s, c, h, pl.ds(i * T, T)])
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
f3 = plgpu.kernel(body3, out_type=OUT, scratch_types=[plgpu.SMEM((T, D), jnp.bfloat16, transforms=tr),
                  plgpu.SMEM((T, D), jnp.float32), plgpu.Barrier()], interpret=INTERP, **GRID)
check("g3 4-D view [B*S, R, r*H, D]", f3, (x4,), lambda x4: ref6(x4.reshape(B, S, R, r, H, D)))
