"""Every backend against the float64 reference, one suite; and the backend protocol.

`BACKENDS` lists each backend as the suite runs it. A check runs each of its cases on every
backend that declares the case: by the backend's own `supports(problem)` on this platform
("xla" and "pallas" everywhere, "triton" and "mosaic" on the GPUs they support), or, for the
mosaic kernels in Mosaic GPU interpret mode on a CPU (JAX >= 0.11; there `supports` declines:
no Hopper GPU), by the capability declared below. A backend does not get the cases it does not
declare (none is collected and skipped). The checks: forward, lse and gradients of small
cases in float32 and 16 bits (every corner of the pattern: `CASES`), cases at the GPU kernels'
tiles (`BLOCKS`: the only ones the mosaic kernels take; interpreted they cost 10-20 s each,
so there are few, each on another path of theirs), random configurations, causality, empty
rows, vmap, numerical range, and the contract's float32 partials.
"""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import helpers
import reference_np
from helpers import Case
from hilbert_ring_jax import DilatedPattern, backends, dilated_attention, sharded_dilated_attention
from hilbert_ring_jax.backends import pallas, xla

F32, BF16, F16 = jnp.float32, jnp.bfloat16, jnp.float16


# Meshes of 4 devices: the 8 virtual CPUs of conftest.py (a machine of one GPU skips).
FOUR_DEVICES = pytest.mark.skipif(len(jax.devices()) < 4, reason="a mesh of 4 devices")


def _interpreted(case, dtype):
  """What the mosaic kernels run, as its `supports` says on a Hopper GPU (docs/backends.md):
  16-bit inputs, head dims 64 and 128 (both passes), rows of whole blocks of 128 positions
  (here every branch's `w / r`) or one segment over all N."""
  one_segment = len(case.segment_lengths) == 1 and case.segment_lengths[0] >= case.n
  rows = all(w % r == 0 and (w // r) % 128 == 0
             for w, r in zip(case.segment_lengths, case.dilation_rates))
  return dtype in (BF16, F16) and case.head_dim in (64, 128) and (one_segment or rows)


@dataclasses.dataclass(frozen=True)
class Backend:
  """A backend as the suite runs it: by `name` through `dilated_attention`, or (`interpret`)
  the mosaic kernels in interpret mode through `backends.attention`, as `dilated_attention`
  calls a backend (its `supports` declines them off a GPU)."""

  name: str
  interpret: bool = False
  marks: tuple = ()

  @property
  def id(self):
    return f"{self.name}_interpret" if self.interpret else self.name

  def declares(self, case, causal, dtype) -> bool:
    """Whether this backend runs `case` here, forward and backward."""
    if self.interpret:
      return (jax.__version_info__ >= (0, 11) and jax.default_backend() == "cpu"
              and _interpreted(case, dtype))
    try:
      module = backends.load(self.name)
    except ImportError:  # e.g. "triton" without jax_triton: not on this machine
      return False
    problem = backends.Problem(
        q_shape=(case.batch, case.n, case.heads, case.head_dim),
        kv_shape=(case.batch, case.n, case.kv_heads, case.head_dim), dtype=jnp.dtype(dtype),
        pattern=case.pattern(causal), platform=jax.default_backend())
    return all(module.supports(dataclasses.replace(problem, backward=b)) for b in (False, True))

  def module(self):
    return backends.load(self.name)

  def config(self, configs=None):
    """This backend's config from `configs` (by backend name; absent: its tuned defaults),
    in interpret mode where the suite interprets it."""
    config = (configs or {}).get(self.name)
    return dataclasses.replace(config or self.module().Config(), interpret=True) \
        if self.interpret else config

  def attention(self, pattern, scale=None, configs=None):
    """`(q, k, v) -> (out, lse)` of this backend."""
    config = self.config(configs)
    if not self.interpret:
      return lambda q, k, v: dilated_attention(q, k, v, pattern, scale=scale, return_lse=True,
                                               implementation=self.name, config=config)

    def fn(q, k, v):
      kernels = helpers.Kernels(self.module(), pattern,
                         q.shape[-1] ** -0.5 if scale is None else scale, config)
      return backends.attention(q, k, v, kernels)

    return fn


BACKENDS = [Backend("xla"), Backend("pallas", marks=(pytest.mark.pallas,)), Backend("triton"),
            Backend("mosaic"), Backend("mosaic", interpret=True)]


def on_backends(cases, extra=(), exclude=(), xfail=None, only=None, slow=None):
  """Parametrizes `backend, case, causal, dtype` (and the names `extra`) over every backend of
  BACKENDS but those named in `exclude`, and each of `cases` (id -> (Case, causal, dtype,
  *extra values)) that the backend declares; `xfail`: backend name -> the known bug that
  fails its cases (a strict xfail: a fix makes them fail until the entry goes); `only`:
  backend name -> the ids of `cases` it runs (the others: elsewhere, said where); `slow`:
  backend id -> the ids of `cases` marked slow there."""
  xfail, only, slow = xfail or {}, only or {}, slow or {}
  marks = lambda b, name: (
      *b.marks, *([pytest.mark.xfail(strict=True, reason=xfail[b.name])]
                  if b.name in xfail else []),
      *([pytest.mark.slow] if name in slow.get(b.id, ()) else []))
  params = [pytest.param(b, *values, id=f"{b.id}-{name}", marks=marks(b, name))
            for b in BACKENDS if b.name not in exclude for name, values in cases.items()
            if b.declares(*values[:3]) and name in only.get(b.name, [name])]
  return pytest.mark.parametrize(["backend", "case", "causal", "dtype", *extra], params)


@pytest.mark.old_jax  # which backends run here depends on the JAX version
def test_each_backend_of_this_platform_has_cases():
  """The suite runs on this machine every backend it can: no backend's cases silently gone
  (e.g. "triton" on a GPU where jax_triton does not import)."""
  ran = {b.id for b in BACKENDS for case, causal, dtype in
         [*SMALL_F32.values(), *BLOCK_CASES.values()] if b.declares(case, causal, dtype)}
  expected = {"xla", "pallas"}
  if jax.default_backend() == "gpu":
    from hilbert_ring_jax.backends import hopper  # pylint: disable=g-import-not-at-top
    expected |= {"triton", "mosaic"} if hopper.is_hopper() else {"triton"}
  elif jax.__version_info__ >= (0, 11):
    expected.add("mosaic_interpret")
  assert ran == expected


CASES = {
    "one_branch": Case(32, 2, 2, (8,), (1,)),
    "two_branches": Case(32, 2, 2, (8, 16), (1, 2)),
    "three_partial": Case(40, 4, 4, (8, 16, 32), (1, 2, 4), batch=2),
    "r_not_dividing_w": Case(29, 4, 4, (6, 10), (4, 3)),
    "offsets_all": Case(36, 2, 2, (12, 7), (3, 2), offsets="all"),
    "head_groups": Case(32, 5, 5, (4, 8, 16), (1, 2, 4), head_groups=True),
    "gqa": Case(32, 4, 2, (8, 16), (1, 2)),
    "gqa_head_groups_unaligned": Case(24, 6, 2, (8, 24), (2, 3), head_groups=True),
    "mqa_offsets_all": Case(30, 4, 1, (10, 30), (1, 3), offsets="all"),
    "w_beyond_n": Case(24, 2, 1, (64,), (1,)),
    "single_token": Case(1, 2, 2, (4, 8), (1, 2)),
}
# Every case runs causal; these run non-causal too (the rest are covered by the random test,
# whose six draws run non-causal GQA, MQA, r not dividing w, head groups and offsets "all").
NON_CAUSAL = ["three_partial", "offsets_all", "head_groups"]
SMALL_F32 = {f"{name}-causal": (CASES[name], True, F32) for name in CASES} | {
    f"{name}-full": (CASES[name], False, F32) for name in NON_CAUSAL}


_INTERPRETED_PALLAS = jax.default_backend() != "gpu"


def _slow_where_pallas_is_interpreted(*names):
  """`on_backends`' `slow` entry marking these cases slow for "pallas" off a GPU."""
  return {"pallas": list(names)} if _INTERPRETED_PALLAS else {}


# Interpreted on a CPU (~4-12 s a case), "pallas" runs here the causal cases that
# test_pallas.py's padded shapes (each causal and not: short, partial and several segments, r
# not dividing w, GQA, MQA with offsets "all") do not repeat: a batch of two, head groups
# unaligned with GQA, one token; with `-m slow` also offsets "all" over two strided branches,
# head groups alone and w beyond N. Its other non-causal corners: the random configurations.
_PALLAS_F32 = [f"{name}-causal" for name in ("three_partial", "offsets_all", "head_groups",
                                            "gqa_head_groups_unaligned", "w_beyond_n",
                                            "single_token")]
_PALLAS_F32_SLOW = [f"{name}-causal" for name in ("offsets_all", "head_groups", "w_beyond_n")]


@on_backends(SMALL_F32, only={"pallas": _PALLAS_F32} if _INTERPRETED_PALLAS else None,
             slow=_slow_where_pallas_is_interpreted(*_PALLAS_F32_SLOW))
def test_float32(backend, case, causal, dtype):
  """Forward, lse and gradients against the reference; causal "three_partial" also leaks
  nothing (`_check_causal_leak`, on the same compiled program)."""
  both, inputs = helpers.check_case(case, causal, dtype, None,
                                    fn=backend.attention(case.pattern(causal)))
  if case is CASES["three_partial"] and causal:
    _check_causal_leak(both, inputs)


# 16-bit inputs on small cases (BLOCKS has them at the GPU kernels' tiles): one case each.
# (Interpreted "pallas" runs them in BLOCKS only: float16 causal GQA, bfloat16 causal and not.)
@on_backends({"three_partial-bf16": (CASES["three_partial"], False, BF16),
              "gqa-f16": (CASES["gqa"], True, F16)},
             exclude=["pallas"] if _INTERPRETED_PALLAS else ())
def test_low_precision(backend, case, causal, dtype):
  helpers.check_case(case, causal, dtype, None, fn=backend.attention(case.pattern(causal)))


# Cases at the GPU kernels' tiles: rows of whole blocks of 128 positions (or one segment over
# all N), head dims 64 and 128, several key blocks a row. Last: the mosaic kernels' options
# each case runs them with (on the GPU too), each case another path of theirs; the other
# backends take their defaults.
BLOCKS = {
    # LongNet in small (the first LM preset's grouping): two launches, {128/1, 256/1} and
    # {512/4}, the second merging the first's float16 output in its epilogues and adding its
    # gradients (each with a dq kernel: their queries read few keys; test_mosaic's
    # test_a_fused_launch_beside_a_split_one fuses the first); causal items list-scheduled over
    # a persistent program; two query heads on a kv head.
    "longnet_gqa": (Case(512, 2, 1, (128, 256, 512), (1, 1, 4), head_dim=64), True, F16, {}),
    # Nested branches in one strided launch (offsets="all"), a partial last segment (N = 640,
    # w = 512), head dim 128, blocks of 64 keys, 3 stages forward (2 backward: the fused
    # kernel's shared memory holds no more), dq added by the dk/dv kernel in a strided launch.
    "partial_segment": (Case(640, 1, 1, (256, 512), (1, 2), offsets="all", head_dim=128), True,
                        BF16, {"mosaic": dict(block_k=64, stages=3, backward_stages=2,
                                              fused_backward=True)}),
    # One strided segment over all N (the ring's steps), rows of 320 positions, no multiple
    # of the blocks: a partial last row block (queries past the row read zeros, keys past it
    # masked), blocks of 192 keys (the second partial), unmasked, the backward's dq from its
    # own kernel.
    "one_segment": (Case(640, 2, 1, (640,), (2,), head_dim=128), False, BF16,
                    {"mosaic": dict(block_k=192, fused_backward=False)}),
}
BLOCK_CASES = {name: case[:3] for name, case in BLOCKS.items()}


# Interpreted (~25-40 s each on a CPU), the mosaic kernels run these with `-m slow` (their
# paths, at smaller tiles: test_mosaic.py and the packed kernels' tests); on a Hopper GPU the
# suite runs all three for real. Interpreted "pallas" runs the partial segment with `-m slow`.
@on_backends(BLOCKS, extra=["options"],
             slow={"mosaic_interpret": list(BLOCKS),
                   **_slow_where_pallas_is_interpreted("partial_segment")})
def test_blocks(backend, case, causal, dtype, options):
  configs = {name: backends.load(name).Config(**kw) for name, kw in options.items()}
  helpers.check_case(case, causal, dtype, None,
                     fn=backend.attention(case.pattern(causal), configs=configs))


# Interpret-mode Pallas kernels take ~1 s each to compile on CPU, "xla"'s forward and backward
# 1-5 s: fewer random examples there. (CI's draws, derandomized, the same for both: the first
# four draw 1, 2 and 3 branches, 1 and 2 kv heads, head groups or not, offsets "all" or not,
# causal or not; the next two MQA with three query heads and two; CASES has each corner.)
RANDOM_EXAMPLES = {"pallas": 4, "xla": 6}


@pytest.mark.slow  # CASES has each corner; this draws their mixtures (~25-40 s a backend)
@pytest.mark.parametrize("backend", [
    pytest.param(b, id=b.id, marks=b.marks) for b in BACKENDS
    if b.declares(CASES["gqa"], True, F32)])
def test_random_configurations(backend):
  examples = RANDOM_EXAMPLES.get(backend.id, settings.default.max_examples)
  settings(max_examples=examples)(given(data=st.data())(_random_configuration))(backend)


def _random_configuration(backend, data):
  k = data.draw(st.integers(1, 3), "branches")
  n = data.draw(st.integers(1, 48), "n")
  segs = tuple(data.draw(st.integers(1, 40), "w") for _ in range(k))
  rates = tuple(data.draw(st.integers(1, w), "r") for w in segs)
  kv = data.draw(st.sampled_from([1, 2]), "kv_heads")
  heads = kv * data.draw(st.integers(1, 3), "group")
  groups = heads >= k and data.draw(st.booleans(), "head_groups")
  case = Case(n, heads, kv, segs, rates, data.draw(st.sampled_from(["head", "all"])), groups)
  causal = data.draw(st.booleans(), "causal")
  helpers.check_case(case, causal, F32, None, seed=data.draw(st.integers(0, 1000), "seed"),
                     fn=backend.attention(case.pattern(causal)))


def _check_causal_leak(both, inputs):
  """Perturbing keys and values after position t leaves outputs up to t unchanged (`both`:
  `helpers.with_grads` of a causal attention over 40 tokens, run on `inputs`; test_float32
  runs it, every backend of its "three_partial-causal" case, with no compile of its own)."""
  q, k, v, dout, dlse = inputs
  t = 21
  noise = np.random.default_rng(9).standard_normal(k.shape)
  noise[:, :t + 1] = 0
  (out, lse), _ = both(q, k, v, (dout, dlse))
  (out2, lse2), _ = both(q, k + 100 * noise, v + 100 * noise, (dout, dlse))
  np.testing.assert_array_equal(out[:, :t + 1], out2[:, :t + 1])
  np.testing.assert_array_equal(lse[:, :t + 1], lse2[:, :t + 1])
  assert not np.allclose(out[:, t + 1:], out2[:, t + 1:])


@on_backends({"r2": (Case(16, 2, 2, (8,), (2,)), False, F32)})
def test_queries_without_keys(backend, case, causal, dtype):
  """offsets="head", r=2: a head sees only its residue; other queries get 0, -inf, zero grad."""
  q, k, v, dout, dlse = helpers.random_inputs(case, dtype, 2)
  (out, lse), (dq, dk, dv) = helpers.with_grads(backend.attention(case.pattern(causal)))(
      q, k, v, (dout, dlse))
  blind = (np.arange(16)[:, None] % 2) != (np.arange(2)[None, :] % 2)  # [N, H]
  assert np.all(np.asarray(out)[:, blind] == 0)
  assert np.all(np.isneginf(np.asarray(lse)[:, blind]))
  assert np.all(np.asarray(dq)[:, blind] == 0)
  for g in (dq, dk, dv):
    assert np.isfinite(np.asarray(g)).all()
  # A key of residue 1 is seen only by head 1, which reads kv head 1: kv head 0 gets no grad.
  assert np.all(np.asarray(dk)[:, 1::2, 0] == 0) and np.all(np.asarray(dv)[:, 1::2, 0] == 0)


@on_backends({"gqa": (CASES["gqa"], True, F32)})
def test_vmap_and_scale(backend, case, causal, dtype):
  q, k, v, *_ = helpers.random_inputs(case, dtype, 3)
  qs, ks, vs = (jnp.stack([x, 2 * x]) for x in (q, k, v))
  fn = backend.attention(case.pattern(causal), scale=0.3)
  batched, _ = jax.jit(jax.vmap(fn))(qs, ks, vs)
  for i in range(2):
    ref_out, _ = reference_np.attention(
        *(np.asarray(x[i], np.float64) for x in (qs, ks, vs)),
        reference_np.multiplicity(case.n, case.heads, case.segment_lengths,
                                  case.dilation_rates, True), 0.3)
    assert helpers.rel_err(batched[i], ref_out) < helpers.TOL[dtype]


# The mosaic kernels' known bug (interpreted, ~8 s) with `-m slow`: `mosaic.supports` keeps a
# float16 backward off them (test_mosaic's test_a_float16_backward_goes_to_the_next_backend).
@on_backends({"d64": (Case(16, 1, 1, (16,), (1,), head_dim=64), False, F16)}, xfail={
    "mosaic": "the mosaic kernels round ds to float16 for its products (mosaic_backward.py: "
              "ds.astype(dtype)): inf in their float32 gradients, +-65504 after the cast; "
              "so mosaic.supports declines a float16 backward (interpret mode runs the "
              "kernels directly)"}, slow={"mosaic_interpret": ["d64"]})
def test_float16_backward_does_not_overflow(backend, case, causal, dtype):
  """Large `v` and `dout` make `ds = p (dp - delta)` exceed float16's range although every
  gradient fits it: the ds products must not round ds to float16 first."""
  rng = np.random.default_rng(11)
  shape = (1, 16, 1, 64)
  q, k = (jnp.asarray(rng.standard_normal(shape), dtype) for _ in range(2))
  v = jnp.asarray(1e3 * rng.choice([-1.0, 1.0], shape), dtype)
  dout = jnp.asarray(32 * rng.standard_normal(shape), dtype)
  out = lambda q, k, v: backend.attention(case.pattern(causal))(q, k, v)[0]
  _, grads = helpers.with_grads(out)(q, k, v, dout)
  _, _, ref = helpers.reference(case, False, q, k, v, dout, np.zeros(shape[:3]))
  for name, g, r in zip("qkv", grads, ref):
    assert np.abs(r).max() < 6e4  # the true gradient is representable in float16
    assert np.isfinite(np.asarray(g, np.float32)).all(), f"d{name}"
    assert helpers.rel_err(g, r) < 2 * helpers.TOL[dtype], (f"d{name}", helpers.rel_err(g, r))


@on_backends({name: (Case(32, 2, 2, (16,), (1,)), True, dtype)
              for name, dtype in (("f16", F16), ("bf16", BF16))},
             slow=_slow_where_pallas_is_interpreted("bf16"))
def test_huge_logits_keep_gradients_finite(backend, case, causal, dtype):
  """Logits of ~1e9 (q, k ~ 6e4): float32 lse rounding must not turn p = exp(s - lse) into
  inf. The softmax is one-hot there and the true gradient about 0."""
  q, k, v, dout, _ = helpers.random_inputs(case, F32, 12)
  q, k = (jnp.asarray(6e4 * jnp.sign(x), dtype) for x in (q, k))
  v, dout = v.astype(dtype), dout.astype(dtype)
  out = lambda q, k, v: backend.attention(case.pattern(causal))(q, k, v)[0]
  out, grads = helpers.with_grads(out)(q, k, v, dout)
  assert np.isfinite(np.asarray(out, np.float32)).all()
  for g in grads:
    assert np.isfinite(np.asarray(g, np.float32)).all()


# The mosaic forward's exponent is exact only up to |s log2 e| < 2^27 (docs/SPEC.md's one
# exception): its own checks (test_mosaic.py) keep to that range.
@on_backends({"d128": (helpers.HUGE_LOGITS_CASE, True, F16)}, exclude=["mosaic"])
def test_huge_logits_forward_is_exact(backend, case, causal, dtype):
  """No row of finite logits comes back inf, NaN or 0 (docs/SPEC.md: "never inf or NaN"),
  at D = 128 and with a huge scale (1e20, float32)."""
  q, k, v = helpers.huge_logits()
  out, _ = backend.attention(case.pattern(causal))(q, k, v)
  np.testing.assert_array_equal(np.asarray(out, np.float32), 1.0)
  x = jnp.asarray(np.random.default_rng(1).standard_normal((1, 64, 2, 16)), F32)
  out, lse = backend.attention(DilatedPattern((16,), (1,)), scale=1e20)(x, x, jnp.ones_like(x))
  np.testing.assert_allclose(out, 1.0, rtol=1e-6)
  assert np.isfinite(np.asarray(lse)).all()


# The contract's partials: a small case in every dtype, with all branches (float16) or the
# second alone (float32, bfloat16; all branches in float32 are what every float32 call runs,
# and test_pallas.py's typical shape takes pallas's float32 partial); a case at the kernels'
# tiles, its second branch (the mosaic kernels' float32 output tile).
_SMALL = Case(32, 4, 2, (8, 16), (1, 2))
PARTIALS = {"f32": (_SMALL, True, F32, ((1,),)), "bf16": (_SMALL, True, BF16, ((1,),)),
            "f16": (_SMALL, True, F16, (None,)),
            "blocks-bf16": (Case(256, 2, 1, (128, 256), (1, 2), head_dim=64), True, BF16,
                            ((1,),))}


# (Interpreted, the tiles' case is slow, ~45 s: `-m slow`; a Hopper GPU runs it for real.
# Interpreted "pallas" runs all branches in float16 and one at its tiles by default.)
@on_backends(PARTIALS, extra=["selections"],
             slow={"mosaic_interpret": ["blocks-bf16"],
                   **_slow_where_pallas_is_interpreted("f32", "bf16")})
def test_partials_are_float32(backend, case, causal, dtype, selections):
  """Forward partials and backward contributions are float32 whatever the input dtype (the
  ring merges them); `out_dtype` gives a final output in the input dtype, and `grad_dtype`
  final gradients."""
  module, config = backend.module(), backend.config()
  q, k, v, dout, _ = helpers.random_inputs(case, dtype, 0)
  pattern = case.pattern(causal)
  for branches in selections:
    if not backend.interpret:  # (interpreted: declared, see _interpreted)
      assert module.supports(backends.Problem.of(q, k, pattern, branches))
    forward = lambda out_dtype: jax.jit(lambda q, k, v: module.forward(
        q, k, v, pattern, 0.25, branches=branches, config=config, out_dtype=out_dtype))
    out, lse = forward(None)(q, k, v)
    assert out.dtype == lse.dtype == F32
    # The partial is the attention over the branches' keys (the float64 reference of them).
    picked = [pattern.branches[b] for b in (branches or range(pattern.num_branches))]
    m = reference_np.multiplicity(case.n, case.heads, *zip(*picked), True)
    ref_out, ref_lse = reference_np.attention(*(np.asarray(x, np.float64) for x in (q, k, v)),
                                              m, 0.25)
    assert helpers.rel_err(out, ref_out) < helpers.TOL[dtype]
    helpers.check_lse(lse, ref_lse, helpers.TOL[dtype])
    final, _ = forward(dtype)(q, k, v)
    assert final.dtype == dtype
    np.testing.assert_allclose(np.asarray(final, np.float32), out,
                               rtol=helpers.TOL[dtype], atol=helpers.TOL[dtype])
    backward = lambda grad_dtype: jax.jit(lambda *a: module.backward(
        *a, pattern, 0.25, branches=branches, config=config, grad_dtype=grad_dtype))(
            q, k, v, dout, lse, jnp.zeros(lse.shape))
    grads = backward(None)
    assert [g.dtype for g in grads] == [F32] * 3
    # Final gradients (`grad_dtype`, what `dilated_attention` asks for): mosaic's kernels
    # write bfloat16 ones, the float32 ones rounded; the others may keep float32.
    if module.__name__.endswith("mosaic") and dtype == BF16:
      for wide, final in zip(grads, backward(dtype)):
        assert final.dtype == BF16 and jnp.array_equal(wide.astype(BF16), final)


def test_resolution_keeps_every_reason():
  q = k = v = jnp.zeros((1, 16, 2, 264))  # too wide a head for pallas
  pattern = DilatedPattern((8,), (2,))
  with pytest.raises(backends.NoBackendError) as info:
    dilated_attention(q, k, v, pattern, implementation=("triton", "pallas"))
  assert set(info.value.reasons) == {"triton", "pallas"}
  assert "head dims up to 256" in info.value.reasons["pallas"]
  assert isinstance(info.value, NotImplementedError)  # what callers catch
  # With "xla" last, the first backend that supports it runs, forward and backward.
  g = jax.jit(jax.grad(lambda q: dilated_attention(q, k, v, pattern,
                                                   implementation=("pallas", "xla")).sum()))(q)
  assert g.shape == q.shape


def test_supports_declines_without_tracing(monkeypatch):
  """`supports` decides from the problem alone: a declining backend is never called."""
  def fail(*args, **kwargs):
    raise AssertionError("a declining backend was traced")

  monkeypatch.setattr(pallas, "forward", fail)
  monkeypatch.setattr(pallas, "backward", fail)
  q = jnp.ones((1, 16, 2, 264))
  pattern = DilatedPattern((8,), (1,))
  jax.grad(lambda q: dilated_attention(q, q, q, pattern, implementation=("pallas", "xla"))
           .sum())(q)


@FOUR_DEVICES
def test_ring_traces_each_step_once(monkeypatch):
  """A ring pass traces each branch's step calls only, never a probe: resolving a step's
  backend asks `supports`, it does not trace (3 branches, 4 shards: one local, two spanning
  ones with small causal steps in natural order, the whole one gathered); differentiated, its
  forward once."""
  traces = {"forward": 0, "backward": 0}
  for name in traces:
    original = getattr(xla, name)

    def counted(*args, _original=original, _name=name, **kwargs):
      traces[_name] += 1
      return _original(*args, **kwargs)

    monkeypatch.setattr(xla, name, counted)
  pattern = DilatedPattern((64, 128, 256), (1, 2, 4), causal=True)
  mesh = jax.make_mesh((4,), ("seq",), axis_types=(jax.sharding.AxisType.Auto,),
                       devices=jax.devices()[:4])
  x = jax.ShapeDtypeStruct((1, 256, 4, 16), F32)
  loss = lambda q, k, v: sharded_dilated_attention(q, k, v, pattern, mesh=mesh,
                                                   axis_name="seq").sum()
  jax.jit(loss).trace(x, x, x)
  # local: 1 call; g = 2 ring: 1 + 1 per extra step; g = 4, a whole ring gathered at once:
  # 2 (the other shards' keys, then the own shard's).
  assert traces == {"forward": 5, "backward": 0}
  traces.update(forward=0)
  jax.jit(jax.grad(loss)).trace(x, x, x)  # the forward's trace above, from jit's cache
  assert traces == {"forward": 0, "backward": 5}
  # Traced afresh, differentiated: the forward once (the primal's and the fwd rule's trace).
  jax.clear_caches()
  traces.update(forward=0, backward=0)
  jax.jit(jax.grad(loss)).trace(x, x, x)
  assert traces == {"forward": 5, "backward": 5}


def test_configs_are_validated_keyword_only_and_routed():
  with pytest.raises(ValueError, match="key_block"):
    xla.Config(key_block=0)
  with pytest.raises(TypeError):
    xla.Config(64)
  q = jnp.asarray(np.random.default_rng(0).standard_normal((1, 40, 2, 8)), F32)
  pattern = DilatedPattern((20, 40), (1, 2), causal=True)
  with pytest.raises(ValueError, match="config"):
    dilated_attention(q, q, q, pattern, config={"key_block": 8})
  # A config reaches its backend (blocks of 8 keys: a scan over 3 blocks per 20-token
  # segment, where one block needs none) and changes nothing but the blocking; another
  # backend's config is ignored by "xla".
  small = xla.Config(key_block=8)
  run = lambda config: dilated_attention(q, q, q, pattern, implementation="xla", config=config)
  assert "scan" in str(jax.make_jaxpr(lambda q: run(small))(q))
  assert "scan" not in str(jax.make_jaxpr(lambda q: run(None))(q))
  base = run(None)
  ref_out = reference_np.attention(*(np.asarray(x, np.float64) for x in (q, q, q)),
                                   reference_np.multiplicity(40, 2, (20, 40), (1, 2), True),
                                   8 ** -0.5)[0]
  assert helpers.rel_err(base, ref_out) < helpers.TOL[F32]
  np.testing.assert_allclose(run(small), base, rtol=1e-6, atol=1e-6)
  np.testing.assert_array_equal(run(pallas.Config(block_q=32)), base)


# A causal branch of several key blocks runs the tiles (a block of queries against one of keys)
# that reach the diagonal only. GQA with offsets "all" (query blocks of two heads' rows), rows
# of 50 in 5 blocks of 12 (the last partial): 15 tiles a branch, 5 if not causal; per-head
# residues, MQA, in bfloat16: rows of 96 and 64 in blocks of 16; one row of 250 in 16 key
# blocks, queries in 8 blocks of two key blocks' rows: 2 + 4 + ... + 16 = 72 tiles.
@pytest.mark.parametrize("case, dtype, key_block, causal_tiles, tiles", [
    (Case(200, 4, 2, (50, 100, 200), (1, 2, 4), offsets="all"), F32, 12, [15] * 3, [5] * 3),
    (Case(192, 3, 1, (96, 192), (1, 3)), BF16, 16, [10, 21], [4, 6]),
    (Case(250, 2, 1, (250,), (1,)), F32, 16, [72], [16]),
], ids=["gqa_all_f32", "mqa_head_bf16", "eight_query_blocks"])
def test_xla_causal_branches_skip_the_tiles_past_the_diagonal(case, dtype, key_block,
                                                              causal_tiles, tiles):
  config = xla.Config(key_block=key_block)
  fn = lambda causal: lambda q, k, v: dilated_attention(
      q, k, v, case.pattern(causal), return_lse=True, implementation="xla", config=config)
  helpers.check_case(case, True, dtype, None, fn=fn(True))
  q, k, v, *_ = helpers.random_inputs(case, dtype, 0)
  for causal, want in ((True, causal_tiles), (False, tiles)):
    jaxpr = str(jax.make_jaxpr(fn(causal))(q, k, v))
    assert sorted(map(int, re.findall(r"length=(\d+)", jaxpr))) == sorted(want)


def test_implementation_is_checked_and_defaults():
  """None is the platform's default ("xla" on a CPU); anything but a name or a non-empty
  sequence of names is refused."""
  case = CASES["gqa"]
  q, k, v, *_ = helpers.random_inputs(case, F32, 4)
  pattern = case.pattern(causal=False)
  if jax.default_backend() == "cpu":
    np.testing.assert_array_equal(dilated_attention(q, k, v, pattern),
                                  dilated_attention(q, k, v, pattern, implementation=["xla"]))
  for bad in (5, [], ["xla", "cuda"], "cuda"):
    with pytest.raises(ValueError, match="implementation"):
      dilated_attention(q, k, v, pattern, implementation=bad)


@pytest.mark.pallas
def test_pallas_declines_inside_shard_map():
  """Inside `shard_map` the inputs vary over the mesh (`Problem.of` says so, also where only
  k does), which "pallas" declines: the ring's steps then take the next candidate."""
  problems = []
  mesh = jax.make_mesh((2,), ("seq",), axis_types=(jax.sharding.AxisType.Auto,),
                       devices=jax.devices("cpu")[:2])  # also where one GPU is the default
  pattern = DilatedPattern((8,), (1,))

  def step(x, y):
    problems.append(backends.Problem.of(x, x, pattern))
    problems.append(backends.Problem.of(y, x, pattern))  # q replicated, k split
    return x

  x = jax.ShapeDtypeStruct((1, 16, 2, 16), F32)
  y = jax.ShapeDtypeStruct((1, 8, 2, 16), F32)
  jax.eval_shape(jax.shard_map(step, mesh=mesh, in_specs=(jax.P(None, "seq"), jax.P()),
                               out_specs=jax.P(None, "seq")), x, y)
  inside, mixed = problems
  assert inside.varying and mixed.varying and not backends.Problem.of(x, x, pattern).varying
  support = pallas.supports(inside)
  assert not support and "shard_map" in support.reason


@FOUR_DEVICES
@pytest.mark.parametrize("replicated", ["kv_and_ids", pytest.param("q", marks=pytest.mark.slow)])
def test_inside_shard_map_with_replicated_operands(replicated):
  """In a user's `shard_map`, operands may vary over different mesh axes (the batch split
  over "data", some operands replicated): forward and gradients equal the unsharded call's,
  the replicated operands' gradients summed over the axis."""
  mesh = jax.make_mesh((4,), ("data",), axis_types=(jax.sharding.AxisType.Auto,),
                       devices=jax.devices()[:4])
  pattern = DilatedPattern((16, 32), (1, 2), causal=True)
  rng = np.random.default_rng(3)
  shape = lambda b, h: (b, 32, h, 8)
  q_rows, kv_rows = (1, 4) if replicated == "q" else (4, 1)
  q = jnp.asarray(rng.standard_normal(shape(q_rows, 4)), F32)
  k, v = (jnp.asarray(rng.standard_normal(shape(kv_rows, 2)), F32) for _ in range(2))
  ids = jnp.asarray([[0] * 12 + [1] * 20], jnp.int32)
  split, whole = jax.P("data"), jax.P()
  specs = (split, whole, whole, whole) if replicated != "q" else (whole, split, split, whole)
  sharded = jax.shard_map(lambda q, k, v, ids: dilated_attention(q, k, v, pattern,
                                                                 segment_ids=ids),
                          mesh=mesh, in_specs=specs, out_specs=split)

  def unsharded(q, k, v, ids):
    b = max(q.shape[0], k.shape[0])
    expand = lambda x: jnp.broadcast_to(x, (b, *x.shape[1:]))
    return dilated_attention(expand(q), expand(k), expand(v), pattern, segment_ids=expand(ids))

  cot = jnp.asarray(rng.standard_normal(shape(4, 4)), F32)
  both = lambda fn: jax.jit(lambda q, k, v: (lambda out, vjp: [out, *vjp(cot)])(
      *jax.vjp(lambda q, k, v: fn(q, k, v, ids), q, k, v)))(q, k, v)
  for a, b in zip(both(sharded), both(unsharded)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
