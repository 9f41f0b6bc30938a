"""What only the "mosaic" backend (Pallas Mosaic GPU, Hopper) has: its geometry and plans,
its lowering for the GPU, and in interpret mode its bf16 gradients and logit range.

The shared suite (test_backends.py) runs the kernels (forward, dq, dk/dv) against the float64
reference in Mosaic GPU interpret mode on CPU (JAX >= 0.11: 0.10's interpreter lacks
primitives they use), one launch per program: the very kernels the H100 compiles.
On a Hopper GPU (gpu marker) random block-aligned configurations run through
`dilated_attention`, and a cross-pass test pairs this forward with the "xla" backward and the
reverse, so a failure points at one pass.
"""

import ctypes
import dataclasses
import math
import os
import pathlib
import shutil
import subprocess
import sys
import textwrap
import types
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import helpers
from helpers import Case
from hilbert_ring_jax import DilatedPattern, dilated_attention
from hilbert_ring_jax.api import _Dispatch
from hilbert_ring_jax.backends import (base, hopper, mosaic, mosaic_decode, mosaic_plan, pallas,
                                       schedule)

INTERPRET = pytest.mark.skipif(
    jax.__version_info__ < (0, 11) or jax.default_backend() == "gpu",
    reason="Mosaic GPU interpret mode: CPU only (on a GPU the kernel itself runs), and JAX "
           ">= 0.11 (0.10's interpreter lacks run_state and layout_cast)")


def test_short_rows_launch_in_whole_blocks():
  """Rows of 32 all together (w0 / L = 128 / 4), so the kernels' launches group the branches
  in rows of 128: {128/1, 256/1} and {512/4} (the first LM preset's grouping in small; the
  shared suite's "longnet_gqa" runs them), and the geometry takes them."""
  case = Case(512, 2, 1, (128, 256, 512), (1, 1, 4), head_dim=64)
  for causal in (False, True):
    pattern = case.pattern(causal)
    assert schedule.launches(pattern, case.n, case.heads, min_row=128) == [(0, 1), (2,)]
    assert mosaic.geometry_problem(pattern, case.n, case.heads, case.kv_heads, None,
                                   mosaic.Config().resolved(case.head_dim)) is None


def test_one_segment_rows_of_any_length():
  """Rows that are not whole program blocks are taken where the launch is one segment (all
  rows end at N), and the outputs then cover every program's boxes (stores past an array's
  end are not clipped reliably on the GPU); several segments still need whole blocks."""
  config = mosaic.Config().resolved(64)
  for n, w, r, heads in [(200, 200, 1, 2), (1000, 4096, 1, 2), (192, 192, 2, 1), (64, 64, 1, 4)]:
    pattern = DilatedPattern((w,), (r,), causal=True)
    assert mosaic.geometry_problem(pattern, n, heads, 1, None, config) is None
    for transposed in (False, True):
      sched = schedule.build(pattern, n, heads, 1, (0,), transposed)
      n_pad = -(-n // (8 * r)) * 8 * r
      for block_rows in (128, 256):
        last = sched.row_blocks(block_rows) * block_rows * sched.stride  # past every box
        assert mosaic_plan.out_length(sched, n_pad, block_rows) >= last >= n
  two = DilatedPattern((192, 384), (1, 1))
  assert "whole blocks" in mosaic.geometry_problem(two, 384, 2, 1, None, config)


def test_blocks_of_192_keys_where_rows_are_long(monkeypatch):
  """Blocks of 192 keys only where the launch's rows are unmasked, unstrided and whole
  blocks of 192 to within 1%: full attention from ~19K keys or in multiples of 192, not
  under a causal mask, not LongNet's strided pieces, not 2048 keys (11 blocks, 3% spare);
  and only where `setmaxnreg` gives the consumers their registers (not on JAX 0.12)."""
  def long(n, segments, rates, causal=False, heads=2):
    pattern = DilatedPattern(segments, rates, causal=causal)
    fused, *_ = mosaic_plan.launches(pattern, n, heads, None)
    sched = schedule.build(pattern, n, heads, heads, fused, False)
    return mosaic_plan.long_key_rows(sched, causal)
  assert long(32768, (32768,), (1,)) and long(6144, (6144,), (1,))
  assert not long(32768, (32768,), (1,), causal=True)
  assert not long(2048, (2048,), (1,))
  assert not long(131072, (2048, 4096, 8192), (1, 2, 4), heads=16)
  assert long(384, (384,), (1,)) and not long(256, (256,), (1,))  # 2 blocks of 192; 1.33
  config = mosaic.Config()
  monkeypatch.setattr(mosaic_plan, "REGISTERS_MOVE", False)
  assert config.resolved(128, 2, 2, long_keys=True).block_k == 128
  monkeypatch.setattr(mosaic_plan, "REGISTERS_MOVE", True)
  assert config.resolved(128, 2, 2, long_keys=True).block_k == 192
  assert config.resolved(64, 2, 2, long_keys=True).block_k == 128  # measured at D = 128
  assert config.resolved(128, 2, 4, long_keys=True).block_k == 128  # float32 tiles: no room
  assert mosaic.Config(block_k=64).resolved(128, 2, 2, long_keys=True).block_k == 64


@pytest.mark.skipif(jax.__version_info__ < (0, 11), reason="the kernels trace on JAX >= 0.11")
def test_a_backward_without_its_registers_warns(monkeypatch):
  """Where `setmaxnreg` does not move registers (JAX 0.12 without tools/no_nvjitlink.c) the
  backward warns once it traces, naming the ways out; not where they move, not interpreted."""
  case = Case(512, 2, 1, (512,), (1,))
  pattern = case.pattern(False)
  q = jax.ShapeDtypeStruct((1, case.n, 2, 64), jnp.bfloat16)
  k = jax.ShapeDtypeStruct((1, case.n, 1, 64), jnp.bfloat16)
  stat = jax.ShapeDtypeStruct((1, case.n, 2), jnp.float32)
  trace = lambda config: jax.eval_shape(lambda q, k, v, do, lse, delta: mosaic.backward(
      q, k, v, do, lse, delta, pattern, 0.125, config=config), q, k, k, q, stat, stat)
  monkeypatch.setattr(mosaic, "REGISTERS_MOVE", False)
  with pytest.warns(UserWarning, match="setmaxnreg.*gpu' extras.*no_nvjitlink"):
    trace(None)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    trace(mosaic.Config(interpret=True))
    monkeypatch.setattr(mosaic, "REGISTERS_MOVE", True)
    trace(None)


@pytest.mark.skipif(not shutil.which("cc") or sys.platform != "linux",
                    reason="needs a C compiler and dlopen's preloading (Linux)")
def test_preloaded_no_nvjitlink_hides_the_library_and_is_seen(tmp_path):
  """tools/no_nvjitlink.c preloaded: a library whose name holds "nvJitLink" no longer loads
  (a copy of libm, which loads without it), other libraries and JAX do, and hopper sees its
  marker (registers move on any JAX then)."""
  root = pathlib.Path(__file__).parents[1]
  shim = tmp_path / "no_nvjitlink.so"
  subprocess.run(["cc", "-shared", "-fPIC", "-o", shim, root / "tools" / "no_nvjitlink.c",
                  "-ldl"], check=True)
  libm = next(line.split()[-1] for line in open("/proc/self/maps") if "/libm." in line)
  fake = tmp_path / "libnvJitLink_test.so"
  shutil.copy(libm, fake)
  probe = textwrap.dedent(f"""
      import ctypes, jax.numpy as jnp
      from hilbert_ring_jax.backends import hopper
      ctypes.CDLL({str(libm)!r})
      try:
        ctypes.CDLL({str(fake)!r}); loads = True
      except OSError:
        loads = False
      print(loads, hopper._nvjitlink_hidden(), hopper.REGISTERS_MOVE, float(jnp.ones(3).sum()))
      """)
  ctypes.CDLL(str(fake))  # loads here, without the library
  assert not hopper._nvjitlink_hidden()
  assert hopper.REGISTERS_MOVE == (jax.__version_info__ < (0, 12))
  env = dict(os.environ, PYTHONPATH=str(root), JAX_PLATFORMS="cpu", LD_PRELOAD=str(shim))
  out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True,
                       check=True)
  assert out.stdout.split() == ["False", "True", "True", "3.0"]


@pytest.mark.skipif(jax.__version_info__ < (0, 11) or jax.default_backend() == "gpu",
                    reason="CPU only (a GPU compiles them for real), JAX >= 0.11")
# A backward's lowering takes ~4 s: both gradient dtypes at head dim 64, one a mask at 128
# (bf16 causal, float32 not), so each gradient dtype meets each head dim; head dim 128 with
# `-m slow` (~17 s each).
@pytest.mark.parametrize("head_dim,causal,grad_dtypes", [
    (64, True, (jnp.bfloat16, None)),
    pytest.param(128, True, (jnp.bfloat16,), marks=pytest.mark.slow),
    pytest.param(128, False, (None,), marks=pytest.mark.slow)],
                         ids=["64-True", "128-True", "128-False"])
@pytest.mark.filterwarnings("ignore:Mosaic GPU of JAX >= 0.12 ignores")  # lowering only
def test_kernels_lower_for_the_gpu_on_a_cpu(head_dim, causal, grad_dtypes, monkeypatch):
  """Every kernel goes through Mosaic GPU's own lowering (layout inference, the Pallas to
  Mosaic GPU rules), not only the interpreter: forward, the fused and the split backward
  (bf16 and float32 gradients), for the CUDA platform, on a CPU. It caught constructs the
  interpreter runs and the GPU rejects (a select with a scalar predicate on vectors). The
  forward and the bf16 backward lower as one jitted step through the kernel contract's
  halves, as `dilated_attention` runs them (`Kernels.differentiable`: custom_jvp halves):
  the fused backward's accumulators once were refs JAX could not discharge there, which
  only the GPUs ran. (The unstrided launch's queries read fewer keys than the default fuses
  at: the bound is lowered.)"""
  monkeypatch.setattr(mosaic_plan, "_FUSED_UNSTRIDED_KEYS", 0)
  case = Case(1024, 2, 1, (128, 256, 1024), (1, 1, 4), head_dim=head_dim)
  pattern, scale = case.pattern(causal), head_dim ** -0.5
  q = jax.ShapeDtypeStruct((1, case.n, 2, head_dim), jnp.bfloat16)
  k = jax.ShapeDtypeStruct((1, case.n, 1, head_dim), jnp.bfloat16)
  stat = jax.ShapeDtypeStruct((1, case.n, 2), jnp.float32)
  assert len(mosaic_plan.launches(pattern, case.n, 2, None)) == 2  # an unstrided and a strided
  lower = lambda f, *args: jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",))
  kernel = helpers.Kernels(mosaic, pattern, scale, None)  # outputs, gradients in bf16

  def step(q, k, v, do):
    _, vjp = jax.vjp(lambda q, k, v: base.attention(q, k, v, kernel)[0], q, k, v)
    return vjp(do)
  # Two forward launches, the fused backward's and the split one's two kernels.
  assert lower(step, q, k, k, q).as_text().count("stablehlo.custom_call @mosaic_gpu") == 5
  for grad_dtype in set(grad_dtypes) - {jnp.bfloat16}:
    lower(lambda q, k, v, do, lse, delta: mosaic.backward(
        q, k, v, do, lse, delta, pattern, scale, grad_dtype=grad_dtype), q, k, k, q, stat, stat)
  if head_dim == 128 and not causal:  # full attention's blocks of 192 keys fit shared memory
    full = DilatedPattern((case.n,), (1,))
    lower(lambda q, k, v: mosaic.forward(q, k, v, full, scale, out_dtype=q.dtype,
                                         config=mosaic.Config(block_k=192)), q, k, k)


@pytest.mark.skipif(jax.__version_info__ < (0, 11) or jax.default_backend() == "gpu",
                    reason="CPU only (a GPU compiles them for real), JAX >= 0.11")
@pytest.mark.filterwarnings("ignore:Mosaic GPU of JAX >= 0.12 ignores")  # lowering only
def test_strided_launches_fuse_dq_where_queries_read_many_keys(monkeypatch):
  """The default backward of a strided launch lowers as one dk/dv kernel that adds dq where
  its queries read 1,900 keys a head or more (2,048 + 2,048 / 4 here), its accumulators fit
  and `setmaxnreg` moves the registers (JAX 0.11, or the preloaded tools/no_nvjitlink.c),
  and as a dq and a dk/dv kernel where they read fewer (512 + 512 / 4), the accumulators
  would exceed the bound or the config says (`Config.backward_for`)."""
  monkeypatch.setattr(mosaic_plan, "REGISTERS_MOVE", True)
  def kernels(n, segments, config=None, rates=(1, 4), heads=2):
    pattern, d = DilatedPattern(segments, rates), 64
    q = jax.ShapeDtypeStruct((1, n, heads, d), jnp.bfloat16)
    stat = jax.ShapeDtypeStruct((1, n, heads), jnp.float32)
    fn = lambda q, k, v, do, lse, delta: mosaic.backward(
        q, k, v, do, lse, delta, pattern, d ** -0.5, config=config, grad_dtype=jnp.bfloat16)
    text = jax.jit(fn).trace(q, q, q, q, stat, stat).lower(lowering_platforms=("cuda",))
    return text.as_text().count("stablehlo.custom_call @mosaic_gpu")
  assert mosaic_plan.launches(DilatedPattern((2048, 8192), (1, 4)), 8192, 2, None) == [(0, 1)]
  assert kernels(8192, (2048, 8192)) == 1
  assert kernels(8192, (2048, 8192), mosaic.Config(fused_backward=False)) == 2
  assert kernels(2048, (512, 2048)) == 2
  # Two float32 [1, 8192, 2, 64] accumulators: 8 MiB.
  monkeypatch.setattr(mosaic_plan, "_FUSED_STRIDED_BYTES", 8 << 20)
  assert kernels(8192, (2048, 8192)) == 1
  monkeypatch.setattr(mosaic_plan, "_FUSED_STRIDED_BYTES", (8 << 20) - 1)
  assert kernels(8192, (2048, 8192)) == 2
  monkeypatch.setattr(mosaic_plan, "_FUSED_STRIDED_BYTES", 4 << 30)
  # Each launch by its own keys: two launches of 64 and 16 keys a head, the bound between.
  monkeypatch.setattr(mosaic_plan, "_FUSED_STRIDED_KEYS", 32)
  assert kernels(1024, (256, 1024), rates=(2, 8), heads=4) == 1 + 2
  monkeypatch.setattr(mosaic_plan, "_FUSED_STRIDED_KEYS", 1900)
  monkeypatch.setattr(mosaic_plan, "REGISTERS_MOVE", False)  # JAX 0.12's spilling kernels
  assert kernels(8192, (2048, 8192)) == 2


# (case, strides of its launches, the bounds lowered: (unstrided, strided) keys, plain and
# causal): the unstrided launch {128/1, 256/1} fused beside the strided {512/4} split, and two
# strided launches (256 and 1024 over rates 2 and 8, 64 and 16 keys a head; causal 32 and 8).
_FUSED_BESIDE_SPLIT = {
    "unstrided_fused": (Case(512, 2, 1, (128, 256, 512), (1, 1, 4), head_dim=64), (1, 4),
                        ((100, 1900), (50, 1900))),
    "strided_fused": (Case(1024, 4, 2, (256, 1024), (2, 8), head_dim=64), (2, 8),
                      ((1024, 32), (1024, 20))),
}


@INTERPRET
@pytest.mark.slow
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("which", _FUSED_BESIDE_SPLIT)
def test_a_fused_launch_beside_a_split_one(which, causal, monkeypatch):
  """One call whose first launch adds dq in its dk/dv kernel and whose second has a dq
  kernel (the default's bounds lowered between their keys a head), GQA, bf16 gradients:
  against the float64 reference, and dk, dv as all-split launches give them (interpreted,
  ~1 minute each)."""
  case, strides, bounds = _FUSED_BESIDE_SPLIT[which]
  unstrided, strided = bounds[causal]
  monkeypatch.setattr(mosaic_plan, "REGISTERS_MOVE", True)
  monkeypatch.setattr(mosaic_plan, "_FUSED_UNSTRIDED_KEYS", unstrided)
  monkeypatch.setattr(mosaic_plan, "_FUSED_STRIDED_KEYS", strided)
  pattern = case.pattern(causal)
  launches = mosaic_plan.launches(pattern, case.n, case.heads, None)
  assert [schedule.build(pattern, case.n, case.heads, case.kv_heads, f, False).stride
          for f in launches] == list(strides)
  assert [mosaic_plan.Config().backward_for(stride, 64, keys=mosaic_plan.keys_per_query(
      pattern, case.n, case.heads, f), accumulator_bytes=0).fused_backward
          for stride, f in zip(strides, launches, strict=True)] == [True, False]
  fused = helpers.fused_launches(monkeypatch)  # as the backward runs them
  q, k, v, dout, dlse = helpers.random_inputs(case, jnp.bfloat16, 3)
  grads = {}
  for name, config in (("default", mosaic.Config(interpret=True)),
                       ("split", mosaic.Config(interpret=True, fused_backward=False))):
    kernel = helpers.Kernels(mosaic, pattern, case.head_dim ** -0.5, config)
    fn = lambda q, k, v, kernel=kernel: base.attention(q, k, v, kernel)
    _, grads[name] = helpers.with_grads(fn)(q, k, v, (dout, dlse))
    assert len(fused) == 1, (name, len(fused))  # the default's first launch; split: none
  _, _, ref_grads = helpers.reference(case, causal, q, k, v, dout, dlse)
  for g, ref in zip(grads["default"], ref_grads):
    assert helpers.rel_err(g, ref) < 2 * helpers.TOL[jnp.bfloat16]
  for g, split in zip(grads["default"][1:], grads["split"][1:]):
    np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(split, np.float32))


def test_causal_plan_balances_items():
  """Persistent programs under a causal mask take the items a host-side list scheduling
  gives them: every item once, each program's in launch order, and no program loaded past
  the mean plus one item (the list-scheduling bound), on costs counted here independently:
  full causal attention, item `i` of a row (heaviest first) walks `64 - i % 64` key blocks
  (plus one for the item itself)."""
  n, heads = 8192, 4
  pattern = Case(n, heads, heads, (n,), (1,)).pattern(True)
  sched = schedule.build(pattern, n, heads, heads, (0,), False)
  ranges = mosaic_plan.Ranges(True, n, 1, True, 128, 128)
  work = mosaic_plan.Work.of(sched, 1, mosaic.Config(persistent=True), True, ranges)
  programs, items = work.programs, work.items
  assert items == heads * n // 128 and programs == min(items, hopper.sm_count()) < items
  offsets, order = work.plan[:programs + 1], work.plan[programs + 1:]
  assert offsets[0] == 0 and offsets[-1] == items and (np.diff(offsets) >= 1).all()
  assert sorted(order.tolist()) == list(range(items))
  cost = 65 - np.arange(items) % 64
  loads = [cost[order[a:b]].sum() for a, b in zip(offsets[:-1], offsets[1:])]
  for a, b in zip(offsets[:-1], offsets[1:]):
    assert (np.diff(order[a:b]) > 0).all()
  assert max(loads) <= cost.sum() / programs + cost.max()
  static = [cost[p::programs].sum() for p in range(programs)]  # items p, p + programs, ...
  assert max(loads) < max(static)
  assert mosaic_plan.Work.of(sched, 1, mosaic.Config(persistent=False), True,
                             ranges).plan is None  # a program per item: the GPU's order
  # The default: persistent where items walk few blocks on average (here 32.5 + 1), else a
  # program per item (at N = 32768: 128.5 + 1).
  assert mosaic_plan.Work.of(sched, 1, mosaic.Config(), True,
                             ranges).plan is not None
  # Two batch elements: the items of the second cost what the first's do (launch order:
  # batch-major), and the plan covers both.
  two = mosaic_plan.Work.of(sched, 2, mosaic.Config(persistent=True), True, ranges)
  offsets, order = two.plan[:programs + 1], two.plan[programs + 1:]
  assert two.items == 2 * items and sorted(order.tolist()) == list(range(2 * items))
  cost2 = np.tile(cost, 2)
  assert (work.costs(1, ranges) == cost).all() and (two.costs(2, ranges) == cost2).all()
  loads = [cost2[order[a:b]].sum() for a, b in zip(offsets[:-1], offsets[1:])]
  assert max(loads) <= cost2.sum() / programs + cost2.max()
  n = 32768
  long_rows = schedule.build(Case(n, heads, heads, (n,), (1,)).pattern(True), n, heads, heads,
                             (0,), False)
  work = mosaic_plan.Work.of(long_rows, 1, mosaic.Config(), True,
                             mosaic_plan.Ranges(True, n, 1, True, 128, 128))
  assert work.plan is None and not work.persistent and work.programs == work.items


@pytest.mark.parametrize("claims", [False, True])
def test_packed_launches_number_items_block_major(claims):
  """Packed rows' causal launches (`Work.of(..., packed=True)`) number their items
  block-major: block `i` of every row (here every head's, or every head and class's of a
  strided launch), then block `i + 1` (reversed under `reverse`), each item exactly once,
  with the rows, blocks and pieces that a row-major launch gives the same item otherwise;
  with a program per item (the causal default at 32K) or, where the kernel takes items
  itself (`claims`: the forward and dk/dv kernels), dynamic persistent programs. Not causal:
  row-major."""
  heads, batch = 4, 2
  longnet = DilatedPattern((256, 512, 1024), (1, 2, 4), causal=True)
  launches = [(Case(32768, heads, heads, (32768,), (1,)).pattern(True), 32768, (0,))] + [
      (longnet, 1024, branches) for branches in schedule.launches(longnet, 1024, heads,
                                                                  min_row=128)]
  for pattern, n, branches in launches:
    sched = schedule.build(pattern, n, heads, heads, branches, False)
    ranges = mosaic_plan.Ranges(True, n, sched.stride, True, 128, 128)
    rows = sched.arrays()[0].reshape(-1)
    count, blocks = len(sched.rows), sched.row_blocks(128)
    for reverse in (False, True):
      packed = mosaic_plan.Work.of(sched, batch, mosaic.Config(), reverse, ranges, True, claims)
      plain = mosaic_plan.Work.of(sched, batch, mosaic.Config(), reverse, ranges)
      assert packed.interleaved and not plain.interleaved
      assert not plain.dynamic and (packed.dynamic == (claims and packed.plan is None))

      def decoded(work):
        def item(i):
          prog = mosaic_plan.Program.decode(rows, sched, 128, n, i, reverse, work.interleaved)
          return prog.b, prog.base, prog.head, prog.first, prog.start, prog.p0, prog.busy

        return np.stack([np.asarray(x) for x in jax.vmap(item)(jnp.arange(work.items))], 1)

      ours, theirs = decoded(packed), decoded(plain)
      assert len(ours) == batch * sched.periods * count * blocks
      assert sorted(map(tuple, ours)) == sorted(map(tuple, theirs))  # every item once
      first = ours[:count * blocks].reshape(blocks, count, -1)
      assert (first[..., :2] == 0).all()  # (batch, period)-major, as before
      order = np.arange(blocks)[::-1] if reverse else np.arange(blocks)
      assert (first[..., 4] == 128 * order[:, None]).all()  # block-major
      row_major = theirs[:count * blocks].reshape(count, blocks, -1)
      for column in (2, 3, 5):  # the rows in their order within each block: head, first, p0
        assert (first[..., column] == row_major[None, :, 0, column]).all()
    not_causal = mosaic_plan.Ranges(True, n, sched.stride, False, 128, 128)
    assert not mosaic_plan.Work.of(sched, batch, mosaic.Config(), False, not_causal, True,
                                   claims).interleaved


def test_ring_steps_run_a_program_per_item():
  """A ring step's config (`ring_step_config`, which the ring asks for): programs of one work
  item each where the caller left `persistent` unset, so that SMs free up for the transfers
  that run beside the step; the caller's other choices, and an explicit `persistent`, kept."""
  n, heads = 8192, 4
  sched = schedule.build(Case(n, heads, heads, (n,), (1,)).pattern(False), n, heads, heads,
                         (0,), False)
  ranges = mosaic_plan.Ranges(False, n, 1, True, 128, 128)
  for config, persistent in ((None, False), (mosaic.Config(block_k=128), False),
                             (mosaic.Config(persistent=True), True)):
    step = mosaic.ring_step_config(config)
    assert step.persistent is persistent and step.block_k == (config and config.block_k)
    work = mosaic_plan.Work.of(sched, 1, step, False, ranges)
    assert work.persistent is persistent
    assert work.programs == (min(work.items, hopper.sm_count()) if persistent else work.items)


def test_document_windows_in_key_indices():
  """`_window_keys`, how the kernels turn a tile's document window (positions) into the keys
  of a piece they walk (packed rows), against a direct count: stride 1 and the launch's L,
  windows before, across, inside and past the piece, empty ones (`w0 > w1`)."""
  rng = np.random.default_rng(0)
  n, L = 96, 4
  for _ in range(300):
    stride = int(rng.choice([1, L]))
    piece = types.SimpleNamespace(stride=jnp.int32(stride))
    at, w0 = int(rng.integers(0, 40)), int(rng.integers(-10, 110))
    w1 = w0 + int(rng.integers(-5, 60))
    i0, i1 = mosaic_plan._window_keys(piece, jnp.int32(at), jnp.int32(w0), jnp.int32(w1), L, n)
    inside = [i for i in range(n) if stride * i < n and w0 <= at + stride * i <= w1]
    assert (int(i0), int(i1)) == ((inside[0], inside[-1] + 1) if inside else (int(i0), int(i0)))


def test_a_float16_backward_goes_to_the_next_backend(monkeypatch):
  """On a Hopper (patched) the kernels take a float16 forward and a bf16 backward, and decline
  a float16 backward (its ds products overflow float16: the strict xfail of test_backends'
  float16 test, interpreted with `-m slow`)."""
  monkeypatch.setattr(mosaic, "is_hopper", lambda: True)
  pattern = Case(1024, 2, 2, (256, 512), (1, 2)).pattern(True)
  for dtype, backward in ((jnp.float16, False), (jnp.bfloat16, True), (jnp.float16, True)):
    q = (1, 1024, 2, 64)
    support = mosaic.supports(base.Problem(q, q, jnp.dtype(dtype), pattern, platform="gpu",
                                           backward=backward))
    runs = jax.__version_info__ >= (0, 11) and not (dtype == jnp.float16 and backward)
    assert bool(support) == runs, support.reason
  assert jax.__version_info__ < (0, 11) or "float16 backward" in support.reason


def test_supports_judges_rows_with_the_calls_config(monkeypatch):
  """Rows of whole 128-position blocks fit the default forward blocks (64 query rows a
  consumer) but not `Config(block_q=128)`'s (256): with that config the backend declines (the
  next candidate runs) rather than raising while the call traces; another backend's config
  leaves the defaults."""
  monkeypatch.setattr(mosaic, "is_hopper", lambda: True)
  pattern = DilatedPattern((128, 512), (1, 4), causal=True)  # rows of 128 positions
  q, kv = (1, 512, 2, 64), (1, 512, 1, 64)
  problem = lambda config: base.Problem(q, kv, jnp.dtype(jnp.bfloat16), pattern, platform="gpu",
                                        config=config)
  runs = jax.__version_info__ >= (0, 11)
  assert bool(mosaic.supports(problem(None))) == runs
  assert bool(mosaic.supports(problem(pallas.Config()))) == runs
  support = mosaic.supports(problem(mosaic.Config(block_q=128)))
  assert not support and (not runs or "whole blocks of 256" in support.reason)


def test_declines_off_hopper_and_on_unaligned_rows(monkeypatch):
  q = jax.ShapeDtypeStruct((1, 1024, 2, 64), jnp.bfloat16)
  pattern = Case(1024, 2, 2, (256, 512), (1, 2)).pattern(False)
  support = mosaic.supports(base.Problem.of(q, q, pattern))
  if jax.default_backend() != "gpu":
    assert not support and "Hopper" in support.reason
  why = mosaic.geometry_problem(Case(96, 2, 2, (32,), (1,)).pattern(False), 96, 2, 2, None,
                                mosaic.Config().resolved(64))
  assert why and "whole blocks of 128" in why
  with pytest.raises(ValueError, match="block_k"):
    mosaic.Config(block_k=32)
  for name in ("block_q", "block_k", "stages", "backward_stages"):  # ints, not floats
    with pytest.raises(ValueError, match=f"{name} must be None or one of"):
      mosaic.Config(**{name: 128.0 if name.startswith("block") else 2.0})
  with pytest.raises(ValueError, match="block_k must be None or one of"):
    mosaic_decode.Config(block_k=64.0)
  with pytest.raises(ValueError, match="backward_stages"):
    mosaic.Config(backward_stages=5)
  with pytest.raises(ValueError, match="fused_backward"):
    mosaic.Config(fused_backward=1)
  with pytest.raises(ValueError, match="persistent"):
    mosaic.Config(persistent="yes")
  # The backward's choices per launch: fused (2 stages) where rows are unstrided and queries
  # read at least 1,024 keys a head, or strided with at least 1,900, accumulators of at most
  # 4 GiB (known) and no stages asked for; else split (3 stages where they fit), unless the
  # config says.
  monkeypatch.setattr(mosaic_plan, "REGISTERS_MOVE", True)  # as on JAX 0.11
  default = mosaic.Config().resolved(128)
  assert default.fused_backward is None and default.backward_stages is None
  fused, split = default.backward_for(1, 128, keys=1024), default.backward_for(4, 64, keys=1899)
  assert (fused.fused_backward, fused.backward_stages) == (True, 2)
  assert (split.fused_backward, split.backward_stages) == (False, 3)
  assert default.backward_for(1, 64, keys=1023).fused_backward is False
  strided = lambda config, **kw: config.backward_for(4, 64, **kw).fused_backward
  assert strided(default, keys=1900, accumulator_bytes=4 << 30)
  assert not strided(default, keys=1900, accumulator_bytes=(4 << 30) + 1)
  assert not strided(default, keys=1899, accumulator_bytes=0)
  assert not strided(default, keys=1900)  # bytes unknown
  assert not strided(mosaic.Config(backward_stages=2), keys=1900, accumulator_bytes=0)
  monkeypatch.setattr(mosaic_plan, "REGISTERS_MOVE", False)  # JAX 0.12's spilling kernels
  assert not strided(default, keys=1900, accumulator_bytes=0)
  assert default.backward_for(1, 64, keys=1024).fused_backward  # unstrided: the same rule
  assert default.backward_for(4, 128, keys=0).backward_stages == 2  # 3 exceed shared memory
  assert not mosaic.Config(fused_backward=False).backward_for(1, 64, keys=4096).fused_backward
  assert mosaic.Config(fused_backward=True, backward_stages=3).backward_for(2, 64, keys=0) == \
      mosaic.Config(fused_backward=True, backward_stages=3)
  # What a launch's queries read a head: LongNet at 32K reads 2,048 keys in each branch, on
  # 1/r of a head's rows (its residue): 2048 (1 + 1/2 + ... + 1/16) = 3,968; causal, about
  # half; every residue in every head (offsets="all"): 5 x 2048; one branch a head
  # (head_groups), fewer. The first LM preset's segments and rates with offsets="head":
  # launches of 512 + 512/4 keys, halved, and 512/16, halved.
  longnet = DilatedPattern((2048, 4096, 8192, 16384, 32768), (1, 2, 4, 8, 16))
  reads = lambda pattern, n=32768: [mosaic_plan.keys_per_query(pattern, n, 16, f)
                                    for f in mosaic_plan.launches(pattern, n, 16, None)]
  assert reads(longnet) == [3968]
  assert reads(dataclasses.replace(longnet, causal=True)) == [1984]
  assert reads(dataclasses.replace(longnet, offsets="all")) == [10240]
  assert reads(dataclasses.replace(longnet, head_groups=True))[0] < 1900
  assert reads(DilatedPattern((512, 2048, 8192), (1, 4, 16), causal=True), 8192) == [320, 16]


def _aligned_case(data):
  """A random configuration whose strided rows come in whole blocks of 128 positions, at the
  head dims the kernels run both passes for."""
  rates = sorted(data.draw(st.sets(st.sampled_from([1, 2, 4]), min_size=1, max_size=3), "r"))
  lcm = math.lcm(*rates)
  segs = tuple(128 * lcm * 2 ** i for i in range(len(rates)))
  kv = data.draw(st.sampled_from([1, 2]), "kv_heads")
  heads = kv * data.draw(st.integers(1, 2), "group")
  n = segs[-1] + data.draw(st.sampled_from([0, 128 * lcm, 3]), "extra")  # 3: padded copy
  groups = heads >= len(rates) and data.draw(st.booleans(), "head_groups")
  return Case(n, heads, kv, segs, tuple(rates), data.draw(st.sampled_from(["head", "all"])),
              groups, head_dim=data.draw(st.sampled_from([64, 128]), "d"))


@pytest.mark.gpu
def test_random_configurations_gpu():
  @settings(max_examples=10)
  @given(data=st.data())
  def check(data):
    case = _aligned_case(data)  # bf16: the backward's only dtype (`mosaic.supports`)
    helpers.check_case(case, data.draw(st.booleans(), "causal"), jnp.bfloat16, "mosaic")

  check()


@pytest.mark.gpu
@pytest.mark.parametrize("n,causal,head_dim", [(200, True, 64), (1000, False, 128),
                                                (4000, True, 128), (1100, False, 64)])
def test_one_segment_of_any_length_gpu(n, causal, head_dim):
  """Full attention at lengths that are no multiple of the blocks: the partial last program
  blocks' stores land in the outputs' padding, never in another row (compiled kernels:
  stores past an array's end are not clipped reliably)."""
  helpers.check_case(Case(n, 4, 2, (n,), (1,), head_dim=head_dim), causal, jnp.bfloat16,
                     "mosaic")


@pytest.mark.gpu
@pytest.mark.parametrize("scale", ["large", -0.3, 0.0])
def test_large_logits_and_any_scale_gpu(scale):
  """The compiled forward (its fused multiply-adds for real): logits up to the documented
  range with v = 1 give 1; negative and zero scales match the reference, gradients too."""
  case = Case(1024, 4, 2, (256, 1024), (1, 2), head_dim=64)
  pattern = case.pattern(True)
  if scale == "large":
    q, k = _large_logits(case)
    out = dilated_attention(q, k, jnp.ones_like(k), pattern, implementation="mosaic")
    np.testing.assert_allclose(np.asarray(out, np.float32), 1.0, atol=1e-2)
    return
  q, k, v, dout, dlse = helpers.random_inputs(case, jnp.bfloat16, 2)
  fn = lambda q, k, v: dilated_attention(q, k, v, pattern, scale=scale, return_lse=True,
                                         implementation="mosaic")
  (out, lse), grads = helpers.with_grads(fn)(q, k, v, (dout, dlse))
  ref_out, ref_lse, ref_grads = helpers.reference(case, True, q, k, v, dout, dlse, scale=scale)
  assert helpers.rel_err(out, ref_out) < helpers.TOL[jnp.bfloat16]
  helpers.check_lse(lse, ref_lse, helpers.TOL[jnp.bfloat16])
  for g, ref in zip(grads, ref_grads):
    assert helpers.rel_err(g, ref) < 2 * helpers.TOL[jnp.bfloat16]


@pytest.mark.gpu
@pytest.mark.parametrize("fwd,bwd", [("mosaic", "xla"), ("xla", "mosaic")])
def test_cross_pass_gpu(fwd, bwd):
  case = Case(2048, 4, 2, (512, 1024, 2048), (1, 2, 4), head_dim=128)
  pattern = case.pattern(True)
  kernel = _Dispatch(pattern, case.head_dim ** -0.5, fwd, bwd)  # one backend per pass
  helpers.check_case(case, True, jnp.bfloat16, None,
                     fn=lambda q, k, v: base.attention(q, k, v, kernel))


@INTERPRET
@pytest.mark.parametrize("scale", ["large", pytest.param(-0.3, marks=pytest.mark.slow),
                                   pytest.param(0.0, marks=pytest.mark.slow)])
def test_interpret_large_logits_and_any_scale(scale):
  """Logits up to the forward's documented range (|s log2 e| < 2^27, docs/SPEC.md) with
  v = 1 give 1 (no row inf, NaN or 0); a negative scale (the row maximum is then the
  smallest score) and a zero one match the reference."""
  case = Case(256, 2, 1, (256,), (1,), head_dim=64)
  pattern = case.pattern(True)
  config = mosaic.Config(interpret=True)
  if scale == "large":
    q, k = _large_logits(case)
    out, lse = mosaic.forward(q, k, jnp.ones_like(k), pattern, 64 ** -0.5, config=config)
    np.testing.assert_allclose(out, 1.0, atol=1e-2)  # p rounds to bf16 in P @ V
    assert np.isfinite(np.asarray(lse)).all()
    return
  q, k, v, dout, dlse = helpers.random_inputs(case, jnp.bfloat16, 1)
  out, lse = mosaic.forward(q, k, v, pattern, scale, config=config)
  ref_out, ref_lse, _ = helpers.reference(case, True, q, k, v, dout, dlse, scale=scale)
  assert helpers.rel_err(out, ref_out) < helpers.TOL[jnp.bfloat16]
  helpers.check_lse(lse, ref_lse, helpers.TOL[jnp.bfloat16])


def _large_logits(case):
  """bfloat16 q, k whose largest |s log2 e| (over every pair of heads) is in [2^25, 2^27)."""
  rng = np.random.default_rng(3)
  shapes = [(1, case.n, h, case.head_dim) for h in (case.heads, case.kv_heads)]
  c = case.head_dim ** -0.5 * math.log2(math.e)
  top = lambda q, k: c * np.abs(np.einsum("bnhd,bmgd->bhgnm", *(np.asarray(x, np.float64)
                                                               for x in (q, k)))).max()
  q, k = (jnp.asarray(rng.uniform(-1.0, 1.0, shape), jnp.bfloat16) for shape in shapes)
  a = float(2 ** 13 / np.sqrt(top(q, k)))  # |s| grows with a^2: to about 2^26
  q, k = (jnp.asarray(np.asarray(x, np.float32) * a, jnp.bfloat16) for x in (q, k))
  assert 2 ** 25 <= top(q, k) < 2 ** 27
  return q, k


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_a_gradient_of_a_gradient_gpu(causal):
  """Reverse over reverse and forward over reverse (a Hessian-vector product) through the
  compiled kernels (before, "Differentiation rule for 'mpmd_map' not implemented"): the
  second derivatives of the same call on "xla", the first derivatives the kernels' own."""
  case = Case(1024, 4, 2, (256, 1024), (1, 2), head_dim=64)
  pattern = case.pattern(causal)
  q, k, v = helpers.random_inputs(case, jnp.bfloat16, 4)[:3]

  def second_order(implementation):
    def loss(q, k, v):
      out = dilated_attention(q, k, v, pattern, implementation=implementation)
      return jnp.sum(out.astype(jnp.float32) ** 2)
    return helpers.second_derivatives(loss)(q, k, v)

  for x, ref in zip(second_order("mosaic"), second_order("xla")):
    assert helpers.rel_err(x, np.asarray(ref, np.float64)) < helpers.TOL[jnp.bfloat16]
