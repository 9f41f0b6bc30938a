"""A small decoder-only transformer with causal dilated attention, trained on long-range recall.

The task (generated here), associative recall: the first half of a `--seq-len` sequence holds
`--pairs` key-value tokens ("key 3 has value 5", one token per pair), each in its own local
segment, among filler tokens; every position of the second half is a query "what is the value
of key k?" for one of the stored keys, and the model must answer it there (the answers are never
part of the input). Every pair lies outside the queries' local segments, so a model that only
attends locally cannot beat chance (1 / `--values`).

Two models with the same size, steps and data are trained: LongNet dilated attention (a local
branch plus dilated branches reaching the whole sequence) and the same model with local-only
attention (its first branch alone). Both use causal attention with grouped-query heads (GQA).
A table of held-out loss and answer accuracy is printed at the end.

Runs on CPU by default in about two minutes; grow it with flags
(`--seq-len 4096 --steps 3000 --dim 256 --layers 4`). Checkpoints go to `--ckpt-dir`
(default `out/train_lm`; `none` keeps none), one folder per configuration: a run started again
with the same flags resumes from them; other flags start their own (and say so in one line).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import common
from hilbert_ring_jax import DilatedMultiHeadAttention, DilatedPattern


def DecoderLM(vocab: int, dim: int, layers: int, heads: int, kv_heads: int,
              pattern: DilatedPattern, implementation=None, *, rngs: nnx.Rngs, dtype=None):
  """Token embedding, `layers` pre-norm blocks with causal dilated attention (GQA), an output
  head. No position embedding: causal attention already tells positions apart, and the task
  only needs content. Calls take the attention layers' keywords (e.g. `prefill=True` when
  decoding, see examples/generate.py)."""
  attention = lambda rngs: DilatedMultiHeadAttention(
      heads, dim, num_kv_heads=kv_heads, pattern=pattern, implementation=implementation,
      dtype=dtype, rngs=rngs)
  return common.SequenceModel(vocab, dim, layers, attention, out=vocab, dtype=dtype,
                              rngs=rngs)


class Recall:
  """Vocabulary: fillers, key-value pair tokens, query tokens, then values (the answers)."""

  def __init__(self, seq_len: int, pairs: int, queries: int, keys: int, values: int,
               fillers: int, local: int):
    if not pairs <= keys:
      raise SystemExit(f"need --pairs <= --keys, got {pairs} and {keys}")
    if (seq_len - queries) // local < pairs:
      raise SystemExit(f"--seq-len {seq_len} leaves fewer than {pairs} local segments of "
                       f"{local} tokens before the {queries} queries")
    self.seq_len, self.pairs, self.queries = seq_len, pairs, queries
    self.keys, self.values, self.local = keys, values, local
    self.pair0 = fillers
    self.query0 = self.pair0 + keys * values
    self.value0 = self.query0 + keys
    self.vocab = self.value0 + values

  def batch(self, rng: np.random.Generator, size: int):
    """`(tokens [size, N], targets [size, N], mask [size, N])`; targets are set at queries."""
    n, p, nq = self.seq_len, self.pairs, self.queries
    tokens = rng.integers(0, self.pair0, (size, n))
    targets = np.zeros((size, n), np.int32)
    mask = np.zeros((size, n), np.float32)
    # Pairs go in distinct local segments, all before the queries.
    for b in range(size):
      keys = rng.choice(self.keys, p, replace=False)
      values = rng.integers(0, self.values, p)
      seg = rng.choice((n - nq) // self.local, p, replace=False)
      pos = seg * self.local + rng.integers(0, self.local, p)
      tokens[b, pos] = self.pair0 + keys * self.values + values
      asked = rng.integers(0, p, nq)
      tokens[b, n - nq:] = self.query0 + keys[asked]
      targets[b, n - nq:] = self.value0 + values[asked]
      mask[b, n - nq:] = 1
    return jnp.asarray(tokens), jnp.asarray(targets), jnp.asarray(mask)


def parse_args(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--seq-len", type=int, default=256)
  parser.add_argument("--local", type=int, default=32, help="first (local) segment length")
  parser.add_argument("--pairs", type=int, default=2, help="key-value pairs per sequence")
  parser.add_argument("--queries", type=int, default=None, help="default: half the sequence")
  parser.add_argument("--keys", type=int, default=4)
  parser.add_argument("--values", type=int, default=8)
  parser.add_argument("--fillers", type=int, default=8, help="filler token types")
  parser.add_argument("--dim", type=int, default=64)
  parser.add_argument("--layers", type=int, default=2)
  parser.add_argument("--heads", type=int, default=4)
  parser.add_argument("--kv-heads", type=int, default=2)
  parser.add_argument("--batch", type=int, default=16)
  parser.add_argument("--steps", type=int, default=300)
  parser.add_argument("--lr", type=float, default=5e-3)
  parser.add_argument("--eval-every", type=int, default=50)
  parser.add_argument("--impl", default=None,
                      help="xla | pallas | triton | mosaic (default: fastest; mosaic on Hopper)")
  parser.add_argument("--ckpt-dir", type=Path, default=Path("out/train_lm"),
                      help="default: out/train_lm; 'none' keeps no checkpoint")
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args(argv)
  common.check_positive(args, "seq_len", "local", "pairs", "keys", "values", "fillers", "dim",
                        "layers", "heads", "kv_heads", "batch", "steps", "lr", "eval_every")
  if args.queries is not None:
    common.check_positive(args, "queries")
  args.ckpt_dir = common.checkpoint_root(args.ckpt_dir)
  return args


def run_config(args) -> dict:
  """Every flag that changes the run, which keys its checkpoints: another --seed, --lr or
  --dim never resumes this one's."""
  return {k: v for k, v in vars(args).items() if k not in ("ckpt_dir", "eval_every")}


def main(argv=None):
  args = parse_args(argv)

  queries = args.seq_len // 2 if args.queries is None else args.queries
  task = Recall(args.seq_len, args.pairs, queries, args.keys, args.values, args.fillers,
                args.local)
  # LongNet: segments grow x4 and dilation x4 from the local branch up to the whole sequence;
  # offsets="all" lets every head see its query's residue class in every branch.
  segments, rates = [args.local], [1]
  while segments[-1] < args.seq_len:
    segments.append(min(4 * segments[-1], args.seq_len))
    rates.append(min(4 * rates[-1], segments[-1]))
  patterns = {
      "dilated": DilatedPattern(tuple(segments), tuple(rates), causal=True, offsets="all"),
      "local only": DilatedPattern((args.local,), (1,), causal=True),
  }
  eval_batch = task.batch(np.random.default_rng([args.seed, 1 << 30]), 256)

  def loss_fn(model, batch):
    tokens, targets, mask = batch
    return common.masked_xent(model(tokens), targets, mask)

  print(f"JAX {jax.__version__} on {jax.devices()[0].platform}; N={args.seq_len}, "
        f"{args.pairs} of {args.keys} keys stored, {queries} queries, "
        f"chance = {1 / args.values:.3f}")
  rows = []
  for name, pattern in patterns.items():
    model = DecoderLM(task.vocab, args.dim, args.layers, args.heads, args.kv_heads, pattern,
                      args.impl, rngs=nnx.Rngs(args.seed))
    batch_fn = lambda step: task.batch(np.random.default_rng([args.seed, step]), args.batch)
    ckpt = common.checkpoint_dir(args.ckpt_dir, name.replace(" ", "_"), run_config(args))
    history = common.train(
        model, loss_fn, batch_fn, steps=args.steps, lr=args.lr, eval_batch=eval_batch,
        eval_every=args.eval_every, desc=name, ckpt_dir=ckpt)
    rows.append([name, f"{pattern.segment_lengths} x {pattern.dilation_rates}",
                 common.count_params(model), history["step"][-1], history["eval_loss"][-1],
                 history["eval_acc"][-1], f"{history['seconds']:.0f}"])
  print()
  print(common.table(["attention", "segments x rates", "params", "steps", "eval loss",
                      "answer accuracy", "train s"], rows))


if __name__ == "__main__":
  main()
