"""Hilbert vs raster token order on real images: scikit-learn's handwritten digits.

The data installs with scikit-learn (`sklearn.datasets.load_digits`: 1797 8x8 grey images of
the digits 0-9, shipped inside the wheel, no download). Each image is upsampled bilinearly to
`--size` x `--size` pixels, one token per pixel: its intensity (0-16 stored, scaled to 0-1),
embedded by a linear layer.
A fixed stratified split (`--split-seed`) holds out 20% of the images for testing.

Two pixel-level sequence models are trained per seed, identical in everything but the order
their attention layers process the pixels in: raster (row-major) or a Hilbert curve
(`DilatedMultiHeadAttention(..., ordering="hilbert", grid_shape=(size, size))`). Both use the
same LongNet pattern (non-causal; segments of N/16, N/4 and N pixels with dilation 1, 4 and
16), the same initial parameters, the same batches (random shifts of up to `--shift` pixels
as augmentation) and steps. In raster order the local segment of N/16 pixels is a strip of
rows; along the Hilbert curve it is a square patch. The inputs, the position embeddings and
the average pooling before the classifier are in row-major order in both models.

Reported (table, and `image_digits.json` in `--out-dir`): test accuracy per seed and order,
mean and sample standard deviation over the seeds, and the per-seed (paired) difference.
`image_digits.png` draws both orders over a test digit, with the local segments coloured, and
the training curves of every seed. Checkpoints per order, seed and configuration go to
`--ckpt-dir`; a run started again resumes from them.

CPU default (about two minutes on two cores): the 8x8 images as stored (64 tokens), a 2-layer
d=32 model, 3 seeds, 150 steps. `--preset gpu`: 32x32 images (1024 tokens), a 4-layer d=128
model, bf16 compute, 5 seeds, 1200 steps. Any flag overrides the preset.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import common
from hilbert_ring_jax import DilatedMultiHeadAttention, DilatedPattern, hilbert_permutation

ORDERS = ("hilbert", "raster")
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
PRESETS = {
    "cpu": dict(size=8, dim=32, layers=2, heads=4, kv_heads=2, batch=64, steps=150, lr=3e-3,
                eval_every=50, seeds="0,1,2", dtype="float32"),
    "gpu": dict(size=32, dim=128, layers=4, heads=4, kv_heads=2, batch=64, steps=1200, lr=2e-3,
                eval_every=200, seeds="0,1,2,3,4", dtype="bfloat16"),
}


def load_images(size: int, split_seed: int) -> dict:
  """The digits upsampled to `size` x `size` pixels (`[n, size, size]` float32 in [0, 1]),
  split 80/20, stratified by class."""
  try:
    from sklearn.datasets import load_digits  # pylint: disable=import-outside-toplevel
    from sklearn.model_selection import train_test_split  # pylint: disable=import-outside-toplevel
  except ImportError as e:
    raise SystemExit("image_digits.py needs scikit-learn (pip install scikit-learn): its "
                     f"wheel ships the digits ({e})") from e
  digits = load_digits()
  images = jnp.asarray(digits.images / 16.0, jnp.float32)  # [n, 8, 8]
  if size != 8:
    images = jax.image.resize(images, (images.shape[0], size, size), "linear")
  images = np.clip(np.asarray(images), 0.0, 1.0)
  labels = digits.target.astype(np.int32)
  train_idx, test_idx = train_test_split(np.arange(len(labels)), test_size=0.2,
                                         random_state=split_seed, stratify=labels)
  return {"train": (images[train_idx], labels[train_idx]),
          "test": (images[test_idx], labels[test_idx]),
          "test_index": np.sort(test_idx)}


def shifted(images: np.ndarray, rng: np.random.Generator, shift: int) -> np.ndarray:
  """Each image moved by up to `shift` pixels along each axis, the border filled with 0."""
  if shift == 0:
    return images
  n, size, _ = images.shape
  out = np.zeros_like(images)
  dy, dx = rng.integers(-shift, shift + 1, (2, n))
  for i in range(n):
    src = images[i, max(0, -dy[i]):size - max(0, dy[i]), max(0, -dx[i]):size - max(0, dx[i])]
    out[i, max(0, dy[i]):max(0, dy[i]) + src.shape[0],
        max(0, dx[i]):max(0, dx[i]) + src.shape[1]] = src
  return out


def pattern_for(n: int) -> DilatedPattern:
  """LongNet: segments of N/16, N/4 and N pixels, dilation 1, 4, 16; every residue read."""
  return DilatedPattern((max(n // 16, 1), max(n // 4, 4), n), (1, 4, 16), offsets="all")


def build_model(order: str, args, seed: int) -> nnx.Module:
  pattern = pattern_for(args.size ** 2)
  hilbert = order == "hilbert"
  attention = lambda rngs: DilatedMultiHeadAttention(
      args.heads, args.dim, num_kv_heads=args.kv_heads, pattern=pattern,
      dtype=DTYPES[args.dtype], ordering="hilbert" if hilbert else None,
      grid_shape=(args.size, args.size) if hilbert else None,
      implementation=args.impl, rngs=rngs)
  return common.SequenceModel(None, args.dim, args.layers, attention, out=10, in_features=1,
                              positions=args.size ** 2, norm=nnx.LayerNorm, pool=True,
                              dtype=DTYPES[args.dtype], rngs=nnx.Rngs(seed))


def loss_fn(model, batch):
  """Mean cross-entropy and accuracy of the digit class."""
  pixels, labels = batch
  return common.masked_xent(model(pixels), labels, jnp.ones(labels.shape, jnp.float32))


def parse_args(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu",
                      help="sizes; flags given override it (default: cpu)")
  parser.add_argument("--size", type=int, help="side of the upsampled image (8: as stored)")
  parser.add_argument("--dim", type=int)
  parser.add_argument("--layers", type=int)
  parser.add_argument("--heads", type=int)
  parser.add_argument("--kv-heads", type=int)
  parser.add_argument("--batch", type=int)
  parser.add_argument("--steps", type=int)
  parser.add_argument("--lr", type=float)
  parser.add_argument("--eval-every", type=int)
  parser.add_argument("--seeds", help="comma-separated seeds (init and batches)")
  parser.add_argument("--dtype", choices=sorted(DTYPES), help="computation dtype")
  parser.add_argument("--shift", type=int, default=None,
                      help="augmentation: random shifts of up to this many pixels "
                      "(default: size // 8)")
  parser.add_argument("--split-seed", type=int, default=0)
  parser.add_argument("--impl", default=None,
                      help="xla | pallas | triton | mosaic (default: fastest; mosaic on Hopper)")
  parser.add_argument("--out-dir", type=Path, default=Path("out/image_digits"))
  parser.add_argument("--ckpt-dir", type=Path, default=None,
                      help="default: <out-dir>/ckpt; 'none' keeps no checkpoint")
  args = parser.parse_args(argv)
  for key, val in PRESETS[args.preset].items():
    if getattr(args, key) is None:
      setattr(args, key, val)
  return args


def check_args(args) -> None:
  """`ValueError` naming the flag for every inconsistent setting."""
  common.check_positive(args, "size", "dim", "layers", "heads", "kv_heads", "batch", "steps",
                        "lr", "eval_every")
  try:
    args.seeds = tuple(int(s) for s in str(args.seeds).split(","))
  except ValueError:
    raise ValueError(f"--seeds must be comma-separated integers, got {args.seeds!r}") from None
  if len(set(args.seeds)) < len(args.seeds):
    raise ValueError(f"--seeds must be distinct, got {args.seeds}")
  if args.size < 8:
    raise ValueError(f"--size must be at least 8 (the digits are 8x8), got {args.size}")
  if args.shift is None:
    args.shift = args.size // 8
  if not 0 <= args.shift < args.size:
    raise ValueError(f"--shift must be in [0, --size), got {args.shift}")
  common.check_model_args(args)


def train_one(order: str, seed: int, args, data: dict, config: dict) -> tuple[dict, nnx.Module]:
  model = build_model(order, args, seed)
  train_x, train_y = data["train"]
  test_x, test_y = data["test"]
  size = args.size

  def batch_fn(step):
    rng = np.random.default_rng([seed, step])
    idx = rng.integers(0, len(train_y), args.batch)
    x = shifted(train_x[idx], rng, args.shift).reshape(args.batch, size * size, 1)
    return jnp.asarray(x), jnp.asarray(train_y[idx])

  chunk = -(-len(test_y) // -(-len(test_y) // 256))  # equal batches of at most 256: one shape
  eval_batches = [(jnp.asarray(test_x[i:i + chunk].reshape(-1, size * size, 1)),
                   jnp.asarray(test_y[i:i + chunk])) for i in range(0, len(test_y), chunk)]
  ckpt = common.checkpoint_dir(args.ckpt_dir, f"{order}-seed{seed}", config)
  history = common.train(model, loss_fn, batch_fn, steps=args.steps, lr=args.lr,
                         eval_batch=eval_batches, eval_every=args.eval_every, ckpt_dir=ckpt,
                         desc=f"{order} (seed {seed})")
  accuracy = history["eval_acc"][-1]  # over the whole test set
  run = {"order": order, "seed": seed, "test_accuracy": accuracy,
         "test_errors": round((1 - accuracy) * len(test_y)), "test_loss": history["eval_loss"][-1],
         "steps": history["step"][-1] if history["step"] else 0,
         "step_seconds": history["step_seconds"], "compile_seconds": history["compile_seconds"],
         "train_seconds": history["seconds"],
         "curves": {"step": list(range(1, len(history["loss"]) + 1)),
                    "train_loss": history["loss"], "eval_step": history["step"],
                    "test_loss": history["eval_loss"], "test_accuracy": history["eval_acc"]}}
  return run, model


def summarize(runs: list[dict], seeds) -> dict:
  out = {}
  for order in ORDERS:
    accs = [r["test_accuracy"] for r in runs if r["order"] == order]
    mean, std = common.mean_std(accs)
    out[order] = {"seeds": list(seeds), "test_accuracy": accs, "mean": mean, "std": std}
  diffs = [h - r for h, r in zip(out["hilbert"]["test_accuracy"], out["raster"]["test_accuracy"])]
  mean, std = common.mean_std(diffs)
  spread = max(out["hilbert"]["std"], out["raster"]["std"])
  out["hilbert_minus_raster"] = {"per_seed": diffs, "mean": mean, "std": std}
  out["seed_spread"] = spread  # the larger of the two orders' standard deviations
  out["hilbert_beats_raster_by_more_than_spread"] = (len(seeds) > 1 and
                                                     out["hilbert"]["mean"] -
                                                     out["raster"]["mean"] > spread)
  return out


def plot(path: Path, args, runs: list[dict], sample: np.ndarray, label: int) -> bool:
  plt = common.pyplot()
  if plt is None:
    return False
  size, n = args.size, args.size ** 2
  w = pattern_for(n).segment_lengths[0]
  fig, axes = plt.subplots(1, 4, figsize=(20, 4.8))
  orders = {"raster": np.arange(n), "hilbert": hilbert_permutation((size, size))}
  for ax, (name, perm) in zip(axes[:2], orders.items()):
    segment = np.empty(n, int)
    segment[perm] = np.arange(n) // w  # the local segment each pixel is processed in
    ax.imshow(segment.reshape(size, size) % 10, cmap="tab10", alpha=0.35,
              interpolation="nearest")
    ax.imshow(np.ma.masked_less(sample, 0.05), cmap="Greys", vmin=0, vmax=1,
              alpha=0.8, interpolation="nearest")
    y, x = np.divmod(perm, size)
    ax.plot(x, y, color="k", linewidth=0.7)
    ax.set(title=f"{name} order (digit {label}), local segments of {w} coloured",
           xticks=[], yticks=[])
  colors = {"hilbert": "C0", "raster": "C3"}
  for r in runs:
    c = r["curves"]
    window = max(1, len(c["step"]) // 30)
    smooth = np.convolve(c["train_loss"], np.ones(window) / window, mode="valid")
    axes[2].plot(c["step"][window - 1:], smooth, color=colors[r["order"]], alpha=0.5,
                 label=f"{r['order']}" if r["seed"] == runs[0]["seed"] else None)
    axes[3].plot(c["eval_step"], c["test_accuracy"], "o-", ms=3, color=colors[r["order"]],
                 alpha=0.6, label=f"{r['order']}" if r["seed"] == runs[0]["seed"] else None)
  axes[2].set(xlabel="step", ylabel="training loss (running mean)", yscale="log",
              title=f"training, {len(args.seeds)} seeds per order")
  axes[3].set(xlabel="step", ylabel="test accuracy", title="test accuracy (each seed)")
  for ax in axes[2:]:
    ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)
  return True


def main(argv=None) -> dict:
  """Runs the comparison; returns what it writes to `<out-dir>/image_digits.json`."""
  args = parse_args(argv)
  check_args(args)
  data = load_images(args.size, args.split_seed)
  info = common.device_info()
  n = args.size ** 2
  pattern = pattern_for(n)
  print(f"JAX {info['jax']} on {info['platform']} ({info['device_kind']}); digits "
        f"{args.size}x{args.size} ({n} tokens), {len(data['train'][1])} training and "
        f"{len(data['test'][1])} test images; pattern {pattern.segment_lengths} x "
        f"{pattern.dilation_rates}; seeds {args.seeds}")
  keys = ("size", "dim", "layers", "heads", "kv_heads", "batch", "steps", "lr", "eval_every",
          "shift", "split_seed", "impl", "dtype")
  config = {k: getattr(args, k) for k in keys}
  runs = []
  t = time.perf_counter()
  for seed in args.seeds:
    for order in ORDERS:
      run, _ = train_one(order, seed, args, data, config)
      runs.append(run)
  summary = summarize(runs, args.seeds)
  import sklearn  # pylint: disable=import-outside-toplevel
  result = {"config": config, "device": info, "pattern": {
      "segment_lengths": pattern.segment_lengths, "dilation_rates": pattern.dilation_rates},
      "data": {"dataset": "sklearn.datasets.load_digits", "sklearn": sklearn.__version__,
               "train_images": len(data["train"][1]), "test_images": len(data["test"][1]),
               "test_index": data["test_index"].tolist()},
      "runs": runs, "summary": summary, "seconds": time.perf_counter() - t}
  common.write_json(args.out_dir / "image_digits.json", result)
  png = args.out_dir / "image_digits.png"
  test_x, test_y = data["test"]
  plotted = plot(png, args, runs, test_x[0], int(test_y[0]))

  rows = [[r["order"], r["seed"], r["steps"], r["test_loss"], r["test_accuracy"],
           r["test_errors"], f"{r['step_seconds'] * 1e3:.1f}" if r["step_seconds"] else "-"]
          for r in runs]
  print()
  print(common.table(["order", "seed", "steps", "test loss", "test accuracy", "errors",
                      "ms/step"], rows))
  for order in ORDERS:
    s = summary[order]
    print(f"{order:8} test accuracy {s['mean']:.4f} +- {s['std']:.4f} (sample std over "
          f"{len(args.seeds)} seeds)")
  d = summary["hilbert_minus_raster"]
  print(f"hilbert - raster: {d['mean']:+.4f} +- {d['std']:.4f} (paired by seed: "
        + ", ".join(f"{x:+.4f}" for x in d["per_seed"]) + ")")
  print(f"\nresults: {args.out_dir / 'image_digits.json'}" + (f"\nplot: {png}" if plotted else ""))
  return result


if __name__ == "__main__":
  main()
