"""Generation with the dilated KV cache: a small causal LM trained briefly, then decoded greedily.

The model is `train_lm.py`'s decoder (causal dilated attention, GQA), trained for a few steps on
cycles: each sequence walks a random set of 2..`--max-period` tokens in increasing order,
cyclically (the next token is the next larger member of the set, read from the context). Then,
from prompts of `--prompt` tokens of new sequences, `--new` tokens are generated greedily in two
ways, each one jitted program:

- cached: `nnx.view(model, decode=True)`, `init_cache`, one prefill call on the prompt (the
  regular kernels, `prefill=True`), then a `lax.scan` of one-token steps against the
  compressed per-branch cache (its size set by the pattern, not the length);
- recomputed: no cache; for each new token the model runs on the whole token buffer (prompt
  and the tokens so far, padded to its final length `prompt + new`: causal attention, so the
  padding never changes the logits read), in a `lax.scan` too.

It checks that both give the same tokens and logits (and the cached logits against the
non-decoding model on the generated sequence), and prints a JSON line with the tokens/s of
both, the cache size and the fraction of generated tokens that follow the cycle rule.

  python examples/generate.py                    # CPU, tiny: about half a minute
  python examples/generate.py --preset gpu       # one H100: bf16, 4 layers of 2048, 32K prompt

A token generated after position `w` of the longest branch starts a new segment there and sees
none of the tokens before it: the presets keep prompt + generation within one such segment.
At the CPU preset's 128 tokens the compressed cache is no smaller than a full one (its longest
branch keeps all residues of a 128-token segment); at the GPU preset's it is the rows of the
current segments only.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import common
from hilbert_ring_jax import DilatedPattern
from train_lm import DecoderLM

PRESETS = {
    # A local branch and one over the whole training length; offsets="all" (as in train_lm.py)
    # lets the 2 layers carry the set across local segments within a few hundred steps.
    "cpu": dict(dim=64, layers=2, heads=4, kv_heads=2, segments="16,128", rates="1,4",
                offsets="all", seq_len=128, batch=16, steps=300, lr=5e-3, gen_batch=4,
                prompt=48, new=80, dtype="float32", runs=3),
    # The LongNet pattern, H = 16, D = 128; prompt and generation fill one segment
    # of the longest branch.
    "gpu": dict(dim=2048, layers=4, heads=16, kv_heads=16, segments="2048,4096,8192,16384,32768",
                rates="1,2,4,6,12", offsets="head", seq_len=32768, batch=2, steps=100, lr=1e-3,
                gen_batch=4, prompt=32512, new=256, dtype="bfloat16", runs=3),
}
DTYPES = ("bfloat16", "float16", "float32")


class Cycles:
  """Each sequence walks a random set of 2..`max_period` tokens in increasing order, cyclically:
  the next token is the next larger member of the set (the smallest after the largest), so
  predicting it needs the set, read from the context, and the current token."""

  def __init__(self, vocab: int, seq_len: int, max_period: int):
    self.vocab, self.seq_len, self.max_period = vocab, seq_len, max_period

  def sequences(self, rng: np.random.Generator, size: int, length: int) -> np.ndarray:
    out = np.empty((size, length), np.int32)
    for b in range(size):
      members = np.sort(rng.choice(self.vocab, rng.integers(2, self.max_period + 1), False))
      out[b] = np.roll(np.resize(members, length + len(members)),
                       -rng.integers(len(members)))[:length]
    return out

  @staticmethod
  def follows_rule(sequences: np.ndarray, start: int) -> np.ndarray:
    """`[B, N - start]` bool: token `t >= start` is the successor of token `t - 1` in the set
    of its sequence (the set read from the tokens before `start`)."""
    ok = np.zeros((sequences.shape[0], sequences.shape[1] - start), bool)
    for b, seq in enumerate(sequences):
      members = np.unique(seq[:start])
      successor = dict(zip(members, np.roll(members, -1)))
      ok[b] = [successor.get(prev) == tok for prev, tok in zip(seq[start - 1:-1], seq[start:])]
    return ok

  def batch(self, rng: np.random.Generator, size: int):
    """`(inputs, targets, mask)`: next-token targets, scored once a whole cycle has been seen."""
    seq = self.sequences(rng, size, self.seq_len + 1)
    mask = np.arange(1, self.seq_len + 1)[None, :] >= self.max_period
    return (jnp.asarray(seq[:, :-1]), jnp.asarray(seq[:, 1:]),
            jnp.asarray(np.broadcast_to(mask, seq[:, 1:].shape), jnp.float32))


def median_s(fn, runs):
  """Median seconds of `fn()` (which blocks on its results) over `runs` calls after one warm-up."""
  fn()
  times = []
  for _ in range(runs):
    t = time.perf_counter()
    fn()
    times.append(time.perf_counter() - t)
  return statistics.median(times)


def main(argv=None) -> dict:
  """Trains, generates both ways, prints and returns the result line (`argv`: the flags)."""
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--preset", choices=list(PRESETS), default="cpu")
  for name, val in PRESETS["cpu"].items():
    parser.add_argument(f"--{name.replace('_', '-')}", type=type(val), default=None,
                        choices=DTYPES if name == "dtype" else None,
                        help=f"(cpu preset: {val}, gpu preset: {PRESETS['gpu'][name]})")
  parser.add_argument("--vocab", type=int, default=16)
  parser.add_argument("--max-period", type=int, default=6)
  parser.add_argument("--impl", default=None,
                      help="xla | pallas | triton | mosaic (default: fastest; mosaic on Hopper)")
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args(argv)
  for name, val in PRESETS[args.preset].items():
    if getattr(args, name) is None:
      setattr(args, name, val)
  common.check_positive(args, "dim", "layers", "heads", "kv_heads", "seq_len", "batch", "steps",
                        "lr", "gen_batch", "prompt", "new", "runs", "vocab")
  if not 2 <= args.max_period <= args.vocab:
    raise ValueError(f"--max-period must be in [2, --vocab {args.vocab}] (the tokens of a cycle "
                     f"are distinct), got {args.max_period}")
  dtype = jnp.dtype(args.dtype)
  pattern = DilatedPattern(tuple(map(int, args.segments.split(","))),
                           tuple(map(int, args.rates.split(","))), causal=True,
                           offsets=args.offsets)
  task = Cycles(args.vocab, args.seq_len, args.max_period)
  print(f"JAX {jax.__version__} on {jax.devices()[0].device_kind}; {pattern.branches}, "
        f"dim {args.dim} x {args.layers} layers, {args.heads}/{args.kv_heads} heads, {dtype.name}",
        flush=True)

  # 1. Train briefly.
  model = DecoderLM(args.vocab, args.dim, args.layers, args.heads, args.kv_heads, pattern,
                    args.impl, rngs=nnx.Rngs(args.seed), dtype=dtype)
  loss_fn = lambda model, batch: common.masked_xent(model(batch[0]), batch[1], batch[2])
  history = common.train(
      model, loss_fn, lambda step: task.batch(np.random.default_rng([args.seed, step]), args.batch),
      steps=args.steps, lr=args.lr,
      eval_batch=task.batch(np.random.default_rng(1 << 30), 2 * args.batch),
      eval_every=args.steps, ckpt_dir=None, desc="train")

  # 2. Generate: prompts are the starts of new sequences.
  batch, prompt_len, new = args.gen_batch, args.prompt, args.new
  prompt = jnp.asarray(task.sequences(np.random.default_rng([args.seed, 1 << 31]), batch,
                                      prompt_len))

  decoder = nnx.view(model, decode=True)  # shares the parameters
  for block in decoder.blocks:
    block.attn.init_cache((batch, prompt_len, args.dim), dtype=dtype)
  graphdef, empty_cache, rest = nnx.split(decoder, nnx.Cache, ...)
  cache_bytes = sum(x.nbytes for x in jax.tree.leaves(empty_cache))

  # The parameters go in as arguments (closed over, they would be compiled in as constants).
  @jax.jit
  def prefill(cache, rest, prompt):
    m = nnx.merge(graphdef, cache, rest)
    logits = m(prompt, prefill=True)[:, -1]
    return nnx.state(m, nnx.Cache), logits

  # The parameters ride in the scan's carry: captured by its body, Flax (0.12.12) refuses the
  # blocks' `nnx.remat` on them ("Cannot mutate Param from a different trace level").
  @functools.partial(jax.jit, static_argnums=3, donate_argnums=0)
  def decode(cache, rest, token, steps):
    def body(carry, _):
      cache, rest, token = carry
      m = nnx.merge(graphdef, cache, rest)
      logits = m(token[:, None])[:, -1]
      token = jnp.argmax(logits, axis=-1).astype(token.dtype)
      return (nnx.state(m, nnx.Cache), rest, token), (token, logits)

    (cache, _, _), (tokens, logits) = jax.lax.scan(body, (cache, rest, token), length=steps)
    return cache, tokens.T, logits.transpose(1, 0, 2)

  def start():
    cache, logits0 = prefill(empty_cache, rest, prompt)
    return jax.block_until_ready((cache, jnp.argmax(logits0, axis=-1).astype(prompt.dtype),
                                  logits0))

  def cached():
    cache, first, logits0 = start()
    _, tokens, logits = decode(cache, rest, first, new - 1)
    out = (jnp.concatenate([first[:, None], tokens], axis=1),
           jnp.concatenate([logits0[:, None], logits], axis=1))
    return jax.block_until_ready(out)

  def steps_s():
    """Median seconds of the `new - 1` cached steps alone (each run on a fresh prefill)."""
    times = []
    for _ in range(args.runs + 1):
      cache, first, _ = start()
      t = time.perf_counter()
      jax.block_until_ready(decode(cache, rest, first, new - 1))
      times.append(time.perf_counter() - t)
    return statistics.median(times[1:])

  plain_graphdef, plain_state = nnx.split(model)

  @jax.jit
  def recompute(state, prompt):
    buffer = jnp.zeros((batch, prompt_len + new), prompt.dtype).at[:, :prompt_len].set(prompt)

    def body(carry, i):  # token prompt_len + i from the logits at prompt_len + i - 1
      buffer, state = carry  # (the parameters in the carry, as in `decode`)
      logits = nnx.merge(plain_graphdef, state)(buffer)
      logits = jax.lax.dynamic_index_in_dim(logits, prompt_len + i - 1, 1, keepdims=False)
      token = jnp.argmax(logits, axis=-1).astype(buffer.dtype)
      return (buffer.at[:, prompt_len + i].set(token), state), (token, logits)

    _, (tokens, logits) = jax.lax.scan(body, (buffer, state), jnp.arange(new))
    return tokens.T, logits.transpose(1, 0, 2)

  # Timings: the prefill alone, cached generation (prefill + steps), recomputation.
  prefill_s = median_s(start, args.runs)
  cached_s = median_s(cached, args.runs)
  step_s = steps_s()
  recompute_s = median_s(lambda: jax.block_until_ready(recompute(plain_state, prompt)), args.runs)
  tokens_c, logits_c = cached()
  tokens_r, logits_r = recompute(plain_state, prompt)

  # Checks: same tokens; logits equal up to rounding (up to the first difference, if any);
  # the cached logits against the non-decoding model run on the generated sequence.
  same = np.asarray(tokens_c == tokens_r).all(axis=0)
  upto = new if same.all() else int(np.argmin(same)) + 1
  logit_diff = float(jnp.abs(logits_c[:, :upto] - logits_r[:, :upto]).max())
  sequence = jnp.concatenate([prompt, tokens_c], axis=1)
  forced = jax.jit(lambda s, x: nnx.merge(plain_graphdef, s)(x))(plain_state, sequence)
  forced_diff = float(jnp.abs(forced[:, prompt_len - 1:-1] - logits_c).max())
  scale = float(jnp.abs(logits_r).max())
  tol = 1e-4 if dtype == jnp.float32 else 5e-2
  result = dict(
      device=jax.devices()[0].device_kind, dtype=dtype.name, pattern=str(pattern.branches),
      dim=args.dim, layers=args.layers, heads=args.heads, kv_heads=args.kv_heads,
      train_steps=args.steps, eval_acc=round(history["eval_acc"][-1], 4),
      batch=batch, prompt=prompt_len, new_tokens=new,
      prefill_ms=round(1e3 * prefill_s, 3),
      cached_step_tokens_per_s=round(batch * (new - 1) / step_s, 1),
      cached_tokens_per_s=round(batch * new / cached_s, 1),
      recompute_tokens_per_s=round(batch * new / recompute_s, 1),
      speedup=round(recompute_s / cached_s, 2),
      cache_bytes=cache_bytes,
      full_kv_cache_bytes=int(2 * args.layers * batch * (prompt_len + new) * args.kv_heads
                              * (args.dim // args.heads) * dtype.itemsize),
      tokens_identical=bool(same.all()), max_logit_diff=logit_diff,
      teacher_forced_max_logit_diff=forced_diff, logit_scale=scale,
      follows_rule=round(float(task.follows_rule(np.asarray(sequence), prompt_len).mean()), 4))
  print(json.dumps(result), flush=True)
  if not (logit_diff <= tol * max(scale, 1.0) and forced_diff <= tol * max(scale, 1.0)):
    raise SystemExit(f"cached and recomputed logits differ: {logit_diff=}, {forced_diff=}")
  if dtype == jnp.float32 and not same.all():
    raise SystemExit("cached and recomputed generations differ")
  return result


if __name__ == "__main__":
  main()
