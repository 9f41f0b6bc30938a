"""Hilbert vs raster token order on a 2-D task where spatial neighbourhoods matter.

The task (generated here): a `--grid` x `--grid` image holds a few filled squares on a blank
background. Each square has a class, written on one pixel of it only (a "marker" token); every
other pixel of the square is a plain "on" token. The model labels every pixel with the class of
the square it belongs to (or background), so each pixel must find the marker of its own square:
a 2-D neighbourhood, a few pixels away in any direction.

Two models, identical in everything but the token order, are trained on the same data for the
same steps with the same dilated pattern (LongNet: segments of N/16, N/4 and N tokens with
dilation 1, 4, 16, non-causal): one reads the pixels in raster (row-major) order, where a segment
of N/16 tokens is a strip of a few rows, the other along a Hilbert curve, where it is a compact
square patch. The table reports the pixel accuracy on squares (background is easy) for both.
A PNG in `--out-dir` shows the training curves, both token orders drawn over the grid (coloured
by segment), and a sample with both models' predictions.

Runs on CPU by default in about two minutes; grow it with flags (`--grid 64 --steps 2000
--dim 128`). Checkpoints go to `--ckpt-dir` (default `out/image_hilbert_ckpt`; `none` keeps
none), one folder per model and configuration: a run started again with the same flags resumes
from them; other flags start their own (and say so in one line).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import common
from hilbert_ring_jax import DilatedMultiHeadAttention, DilatedPattern, hilbert_permutation

BACKGROUND, ON, MARKER0 = 0, 1, 2  # input tokens; class c is marked by token MARKER0 + c


def PixelTransformer(grid, classes, dim, layers, heads, kv_heads, pattern, ordering,
                     implementation=None, *, rngs):
  """Token and position embeddings (row-major), pre-norm blocks, a per-pixel classifier.

  The attention layers take `ordering="hilbert"` or None: the model's inputs and outputs stay
  row-major either way; only the order attention processes the tokens in differs.
  """
  attention = lambda rngs: DilatedMultiHeadAttention(
      heads, dim, num_kv_heads=kv_heads, pattern=pattern, ordering=ordering,
      grid_shape=(grid, grid) if ordering == "hilbert" else None,
      implementation=implementation, rngs=rngs)
  return common.SequenceModel(MARKER0 + classes, dim, layers, attention, out=classes + 1,
                              positions=grid * grid, norm=nnx.LayerNorm, rngs=rngs)


def make_batch(rng, size, grid, objects, classes, sides):
  """`(tokens, labels)`, both `[size, grid * grid]` row-major; labels 0 = background."""
  tokens = np.full((size, grid, grid), BACKGROUND, np.int32)
  labels = np.zeros((size, grid, grid), np.int32)
  for b in range(size):
    for _ in range(objects):
      for _ in range(20):  # a few tries to place a square that touches no other square
        s = rng.integers(sides[0], sides[1] + 1)
        y, x = rng.integers(0, grid - s + 1, 2)
        if not labels[b, max(y - 1, 0):y + s + 1, max(x - 1, 0):x + s + 1].any():
          break
      else:
        continue
      c = rng.integers(classes)
      tokens[b, y:y + s, x:x + s] = ON
      labels[b, y:y + s, x:x + s] = c + 1
      my, mx = rng.integers(0, s, 2)
      tokens[b, y + my, x + mx] = MARKER0 + c
  return jnp.asarray(tokens.reshape(size, -1)), jnp.asarray(labels.reshape(size, -1))


def loss_fn(model, batch):
  """Cross-entropy over all pixels; accuracy over the squares' pixels."""
  tokens, labels = batch
  logits = model(tokens)
  loss, _ = common.masked_xent(logits, labels, jnp.ones(labels.shape))
  _, acc = common.masked_xent(logits, labels, (labels > 0).astype(jnp.float32))
  return loss, acc


def plot(path, grid, pattern, histories, sample, predictions) -> bool:
  """Draws the PNG; False (nothing written) without matplotlib."""
  plt = common.pyplot()
  if plt is None:
    return False
  fig, axes = plt.subplots(2, 4, figsize=(16, 8))
  ax = axes[0, 0]
  for name, h in histories.items():
    ax.plot(h["step"], h["eval_acc"], label=name)
  ax.set(xlabel="step", ylabel="pixel accuracy on squares (held out)", title="training")
  ax.legend()
  ax = axes[1, 0]
  for name, h in histories.items():
    ax.plot(h["step"], h["eval_loss"], label=name)
  ax.set(xlabel="step", ylabel="held-out loss", yscale="log")
  ax.legend()
  w = pattern.segment_lengths[0]
  orders = {"raster": np.arange(grid * grid), "hilbert": hilbert_permutation((grid, grid))}
  for ax, (name, perm) in zip(axes[0, 1:3], orders.items()):
    segment = np.empty(grid * grid, int)
    segment[perm] = np.arange(grid * grid) // w  # the segment each cell is processed in
    ax.imshow(segment.reshape(grid, grid) % 20, cmap="tab20", interpolation="nearest")
    y, x = np.divmod(perm, grid)
    ax.plot(x, y, color="k", linewidth=0.8)
    ax.set(title=f"{name} order, segments of {w}", xticks=[], yticks=[])
  tokens, labels = sample
  tokens = np.asarray(tokens)
  # Markers in their class's colour, plain square pixels grey.
  tokens = np.where(tokens == ON, 7, np.where(tokens >= MARKER0, tokens - MARKER0 + 1, 0))
  shown = [("input (grey squares, class markers)", tokens), ("labels", labels)] + [
      (f"{name} prediction", pred) for name, pred in predictions.items()]
  for ax, (title, img) in zip(list(axes[0, 3:]) + list(axes[1, 1:]), shown):
    ax.imshow(np.asarray(img).reshape(grid, grid), cmap="tab10", vmin=0, vmax=9,
              interpolation="nearest")
    ax.set(title=title, xticks=[], yticks=[])
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)
  return True


def parse_args(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--grid", type=int, default=16, help="side of the square image")
  parser.add_argument("--objects", type=int, default=4, help="squares per image (at most)")
  parser.add_argument("--classes", type=int, default=4)
  parser.add_argument("--dim", type=int, default=64)
  parser.add_argument("--layers", type=int, default=2)
  parser.add_argument("--heads", type=int, default=4)
  parser.add_argument("--kv-heads", type=int, default=2)
  parser.add_argument("--batch", type=int, default=16)
  parser.add_argument("--steps", type=int, default=200)
  parser.add_argument("--lr", type=float, default=3e-3)
  parser.add_argument("--eval-every", type=int, default=20)
  parser.add_argument("--impl", default=None,
                      help="xla | pallas | triton | mosaic (default: fastest; mosaic on Hopper)")
  parser.add_argument("--out-dir", type=Path, default=Path("out"))
  parser.add_argument("--ckpt-dir", type=Path, default=Path("out/image_hilbert_ckpt"),
                      help="default: out/image_hilbert_ckpt; 'none' keeps no checkpoint")
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args(argv)
  common.check_positive(args, "objects", "classes", "dim", "layers", "heads", "kv_heads",
                        "batch", "steps", "lr", "eval_every")
  if args.grid < 4:
    raise ValueError(f"--grid must be at least 4 (the pattern's dilation 16 needs 16 pixels), "
                     f"got {args.grid}")
  args.ckpt_dir = common.checkpoint_root(args.ckpt_dir)
  return args


def run_config(args) -> dict:
  """Every flag that changes the run, which keys its checkpoints: another --seed, --lr or
  --dim never resumes this one's."""
  return {k: v for k, v in vars(args).items() if k not in ("ckpt_dir", "eval_every", "out_dir")}


def main(argv=None):
  args = parse_args(argv)
  n = args.grid ** 2
  pattern = DilatedPattern((max(n // 16, 1), max(n // 4, 4), n), (1, 4, 16), offsets="all")
  sides = (max(2, args.grid // 5), max(3, args.grid // 3))
  data = lambda rng, size: make_batch(rng, size, args.grid, args.objects, args.classes, sides)
  eval_batch = data(np.random.default_rng([args.seed, 1 << 30]), 128)
  print(f"JAX {jax.__version__} on {jax.devices()[0].platform}; {args.grid}x{args.grid} grid, "
        f"pattern {pattern.segment_lengths} x {pattern.dilation_rates}, squares of side "
        f"{sides[0]}..{sides[1]}")

  rows, histories, predictions = [], {}, {}
  for name, ordering in (("hilbert", "hilbert"), ("raster", None)):
    model = PixelTransformer(args.grid, args.classes, args.dim, args.layers, args.heads,
                             args.kv_heads, pattern, ordering, args.impl,
                             rngs=nnx.Rngs(args.seed))
    history = common.train(
        model, loss_fn, lambda step: data(np.random.default_rng([args.seed, step]), args.batch),
        steps=args.steps, lr=args.lr, eval_batch=eval_batch, eval_every=args.eval_every,
        ckpt_dir=common.checkpoint_dir(args.ckpt_dir, name, run_config(args)), desc=name)
    histories[name] = history
    predictions[name] = jnp.argmax(nnx.jit(lambda m, t: m(t))(model, eval_batch[0][:1]), -1)
    rows.append([name, history["step"][-1], history["eval_loss"][-1], history["eval_acc"][-1],
                 f"{history['seconds']:.0f}"])

  args.out_dir.mkdir(parents=True, exist_ok=True)
  png = args.out_dir / "image_hilbert.png"
  plotted = plot(png, args.grid, pattern, histories, (eval_batch[0][0], eval_batch[1][0]),
                 predictions)
  print()
  print(common.table(["token order", "steps", "eval loss", "square-pixel accuracy", "train s"],
                     rows))
  if plotted:
    print(f"\nplot: {png}")


if __name__ == "__main__":
  main()
