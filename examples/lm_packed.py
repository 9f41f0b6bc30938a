"""Packed rows against one document per row: a byte-level LM on whole standard-library files.

Language models train on rows of a fixed length; documents are of every length. Two ways to
fill the rows with the same documents (the Python standard library's `*.py` files, whole,
split into training and held-out files as `lm_real.py` splits them):
  padded  one document per row: a document longer than the row is cut into row-sized pieces,
          and the last piece of each is padded (the padding is computed, then masked out of
          the loss);
  packed  documents laid end to end, rows cut from the stream: `segment_ids` keep each token's
          attention (and gradient) inside its document, `positions` restart the rotary
          embedding at 0 at each document, and the one target per row that would cross into
          the next document is masked.
Both train the same model (LongNet-style causal dilated attention, the library's
`DilatedMultiHeadAttention`; same initial parameters, optimizer and number of steps of
`--batch` rows of `--seq-len` bytes), documents in the same shuffled order. Every step costs
the same; what differs is how many of its positions are real bytes ("useful tokens").

Reported per run (table, and `lm_packed.json` in `--out-dir`): useful tokens per step and in
all, useful tokens per second in the steady state, training wall time, and held-out bits per
byte on the first `--seq-len` bytes of each of `--eval-docs` held-out files (each file alone in
its row, evaluated alike for both runs).

How much a padded row wastes depends on the row length against the documents' (the median
training file is about 7 KB): one file per row fills 97% of rows of 1024 bytes, 89% of 4096,
78% of 8192 and 63% of 16384 (standard library of Python 3.11, the default split); packed
rows are full but for one masked target per document boundary.

CPU default (two minutes on two idle cores): rows of 1024 bytes, a 2-layer d=64 model, 60
steps. `--preset gpu`: rows of 16384 bytes, segments (1024, 4096, 16384) x rates (1, 2, 4), an
8-layer d=768 model, bf16, 400 steps of 4 rows. Any flag overrides the preset. On Hopper
both runs use the mosaic kernels, on other CUDA GPUs the triton ones; both skip the key
blocks of other documents in packed rows.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from flax import nnx

import common
import lm_real
from hilbert_ring_jax import DilatedMultiHeadAttention, DilatedPattern

LAYOUTS = ("padded", "packed")
PRESETS = {
    "cpu": dict(seq_len=1024, segments="128,512,1024", rates="1,2,4", dim=64, layers=2,
                heads=4, kv_heads=2, batch=8, steps=60, lr=3e-3, eval_every=30, eval_docs=32,
                dtype="float32", rotary_base=10000.0),
    "gpu": dict(seq_len=16384, segments="1024,4096,16384", rates="1,2,4", dim=768, layers=8,
                heads=6, kv_heads=2, batch=4, steps=400, lr=8e-4, eval_every=200,
                eval_docs=128, dtype="bfloat16", rotary_base=10000.0),
}


def load_documents(heldout_fraction: float, split_seed: int) -> tuple[list, list]:
  """The training and held-out files' bytes (uint8 arrays), split as `lm_real.load_corpus`
  splits them (the same files held out for the same seed and fraction)."""
  root, files = lm_real.stdlib_files()
  order = np.random.default_rng(split_seed).permutation(len(files))
  n_held = max(1, round(heldout_fraction * len(files)))
  held = sorted(files[i] for i in order[:n_held])
  train = sorted(files[i] for i in order[n_held:])
  read = lambda names: [np.frombuffer((root / n).read_bytes(), np.uint8) for n in names]
  return [d for d in read(train) if d.size > 1], [d for d in read(held) if d.size > 1]


class Rows:
  """The rows of one layout, a pure function of the step (the documents in a shuffled order
  drawn from `seed`, reshuffled each epoch), as `(tokens, targets, mask[, ids, positions])`
  `[batch, seq_len]` arrays."""

  def __init__(self, docs: list, layout: str, seq_len: int, batch: int, steps: int, seed: int):
    self.layout, self.seq_len, self.batch = layout, seq_len, batch
    need = steps * batch * (seq_len + 1)
    pieces, total, epoch = [], 0, 0
    while total < need:  # whole epochs of documents until the steps are covered
      for i in np.random.default_rng([seed, epoch]).permutation(len(docs)):
        pieces.append(docs[i])
        total += docs[i].size
      epoch += 1
    if layout == "packed":
      self.stream = np.concatenate(pieces).astype(np.int32)
      self.ids = np.repeat(np.arange(len(pieces), dtype=np.int32), [p.size for p in pieces])
      starts = np.cumsum([0] + [p.size for p in pieces[:-1]])
      self.positions = (np.arange(self.stream.size) - np.repeat(starts, [p.size for p in pieces])
                        ).astype(np.int32)
    else:  # each document cut into pieces of seq_len + 1 bytes (inputs and their targets)
      self.rows = [p[a:a + seq_len + 1] for p in pieces for a in range(0, p.size - 1, seq_len)]

  def __call__(self, step: int):
    n, b = self.seq_len, self.batch
    if self.layout == "packed":
      at = (step * b + np.arange(b))[:, None] * n + np.arange(n + 1)
      tokens, ids = self.stream[at], self.ids[at]
      mask = (ids[:, 1:] == ids[:, :-1]).astype(np.float32)
      return tuple(jnp.asarray(x) for x in (tokens[:, :-1], tokens[:, 1:], mask, ids[:, :-1],
                                            self.positions[at[:, :-1]]))
    return padded_rows(self.rows[step * b:(step + 1) * b], n)


def padded_rows(pieces: list, seq_len: int) -> tuple:
  """`(tokens, targets, mask)` of one piece per row, padded with 0 (masked)."""
  rows = np.zeros((len(pieces), seq_len + 1), np.int32)
  mask = np.zeros((len(pieces), seq_len), np.float32)
  for r, p in enumerate(pieces):
    rows[r, :p.size] = p
    mask[r, :p.size - 1] = 1.0
  return jnp.asarray(rows[:, :-1]), jnp.asarray(rows[:, 1:]), jnp.asarray(mask)


def loss_fn(model, batch):
  """Mean next-byte cross-entropy (nats) and accuracy over the real targets; packed rows
  pass their document ids and positions to every attention layer."""
  tokens, targets, mask, *packed = batch
  kwargs = dict(zip(("segment_ids", "positions"), packed))
  return common.masked_xent(model(tokens, **kwargs), targets, mask)


def build_model(args, seed: int) -> nnx.Module:
  pattern = DilatedPattern(args.segments, args.rates, causal=True, offsets="all")
  attention = lambda rngs: DilatedMultiHeadAttention(
      args.heads, args.dim, num_kv_heads=args.kv_heads, pattern=pattern,
      dtype=lm_real.DTYPES[args.dtype], implementation=args.impl,
      rotary_base=args.rotary_base, rngs=rngs)
  return common.SequenceModel(256, args.dim, args.layers, attention, out=256,
                              dtype=lm_real.DTYPES[args.dtype], rngs=nnx.Rngs(seed))


def parse_args(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
  parser.add_argument("--layouts", default=",".join(LAYOUTS),
                      help=f"comma-separated subset of {', '.join(LAYOUTS)}")
  parser.add_argument("--seq-len", type=int, help="row length in bytes")
  parser.add_argument("--segments", help="dilated segment lengths, comma-separated")
  parser.add_argument("--rates", help="dilation rates, comma-separated")
  for flag in ("dim", "layers", "heads", "kv-heads", "batch", "steps", "eval-every",
               "eval-docs"):
    parser.add_argument(f"--{flag}", type=int)
  parser.add_argument("--lr", type=float)
  parser.add_argument("--dtype", choices=sorted(lm_real.DTYPES))
  parser.add_argument("--rotary-base", type=float)
  parser.add_argument("--impl", default=None, help="the attention's implementation")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--split-seed", type=int, default=0)
  parser.add_argument("--heldout-fraction", type=float, default=0.05)
  parser.add_argument("--out-dir", type=Path, default=Path("out/lm_packed"))
  args = parser.parse_args(argv)
  for key, value in PRESETS[args.preset].items():
    if getattr(args, key) is None:
      setattr(args, key, value)
  args.segments = lm_real.int_list("--segments", str(args.segments))
  args.rates = lm_real.int_list("--rates", str(args.rates))
  args.layouts = [x for x in args.layouts.split(",") if x]
  if not args.layouts or any(x not in LAYOUTS for x in args.layouts):
    parser.error(f"--layouts must name some of {LAYOUTS}, got {','.join(args.layouts)}")
  common.check_positive(args, "seq_len", "dim", "layers", "heads", "kv_heads", "batch",
                        "steps", "eval_every", "eval_docs")
  args.ckpt_dir = "none"
  common.check_model_args(args)
  return args


def main(argv=None) -> dict:
  """Trains one model per layout; returns what it writes to `<out-dir>/lm_packed.json`."""
  args = parse_args(argv)
  train_docs, held_docs = load_documents(args.heldout_fraction, args.split_seed)
  lengths = np.array([d.size for d in train_docs])
  info = common.device_info()
  print(f"JAX {info['jax']} on {info['platform']} ({info['device_kind']}); "
        f"{len(train_docs)} training files (median {int(np.median(lengths))} bytes, "
        f"{np.mean(lengths > args.seq_len):.0%} longer than a row of {args.seq_len}), "
        f"{len(held_docs)} held out")
  eval_pieces = [d[:args.seq_len + 1] for d in held_docs[:args.eval_docs]]
  eval_batches = [padded_rows(eval_pieces[i:i + args.batch], args.seq_len)
                  for i in range(0, len(eval_pieces), args.batch)]
  runs = []
  for layout in args.layouts:
    rows = Rows(train_docs, layout, args.seq_len, args.batch, args.steps, args.seed)
    useful = [float(np.asarray(rows(s)[2]).sum()) for s in range(args.steps)]
    model = build_model(args, args.seed)
    history = common.train(model, loss_fn, rows, steps=args.steps, lr=args.lr,
                           eval_batch=eval_batches, eval_every=args.eval_every,
                           ckpt_dir=None, desc=layout)
    step_s = history["step_seconds"]
    per_step = float(np.mean(useful))
    runs.append({
        "layout": layout, "steps": args.steps, "positions_per_step": args.batch * args.seq_len,
        "useful_tokens_per_step": per_step, "useful_tokens": float(np.sum(useful)),
        "useful_fraction": per_step / (args.batch * args.seq_len),
        "step_seconds": step_s, "useful_tokens_per_s": per_step / step_s if step_s else None,
        "train_seconds": history["seconds"], "compile_seconds": history["compile_seconds"],
        "heldout_bpb": history["eval_loss"][-1] / math.log(2),
        "curves": {"eval_step": history["step"],
                   "eval_bpb": [x / math.log(2) for x in history["eval_loss"]]}})
  result = {"config": {k: (list(v) if isinstance(v, tuple) else v)
                       for k, v in vars(args).items() if k not in ("out_dir", "ckpt_dir")},
            "device": info, "runs": runs}
  by = {r["layout"]: r for r in runs}
  if len(by) == 2 and by["packed"]["useful_tokens_per_s"] and by["padded"]["useful_tokens_per_s"]:
    result["packed_over_padded_useful_tokens_per_s"] = (
        by["packed"]["useful_tokens_per_s"] / by["padded"]["useful_tokens_per_s"])
  common.write_json(args.out_dir / "lm_packed.json", result)
  print()
  print(common.table(
      ["layout", "useful tokens/step", "of the row", "useful tokens", "useful tokens/s",
       "train s", "held-out bpb"],
      [[r["layout"], f"{r['useful_tokens_per_step']:.0f}", f"{r['useful_fraction']:.0%}",
        f"{r['useful_tokens']:.0f}",
        f"{r['useful_tokens_per_s']:.0f}" if r["useful_tokens_per_s"] else "-",
        f"{r['train_seconds']:.1f}", r["heldout_bpb"]] for r in runs]))
  if "packed_over_padded_useful_tokens_per_s" in result:
    print(f"packed / padded useful tokens per second: "
          f"{result['packed_over_padded_useful_tokens_per_s']:.2f}x")
  print(f"\nresults: {args.out_dir / 'lm_packed.json'}")
  return result


if __name__ == "__main__":
  main()
