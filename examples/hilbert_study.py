"""Where Hilbert order matters: masked-pixel inpainting of real photographs, four token orders.

The data needs no download: scikit-image's wheel ships its sample photographs as files inside
the package (`skimage/data/*.png`, `*.jpg`; read here straight from that folder, never through
`skimage.data`'s fetcher, which downloads the images the wheel leaves out). Sixteen of them
are used, converted to grey levels in [0, 1]: twelve for training (`TRAIN_IMAGES`) and four
ordinary photographs held out for testing (`TEST_IMAGES`), split by image, never by crop.
`pip install -e ".[study]"` installs scikit-image (its dependency Pillow decodes the files).

The task: each training example is a random `--crop` x `--crop` crop of a training image
(random horizontal flip), one token per pixel. Square holes of `--hole` x `--hole` pixels, on
a grid with a random offset, are masked with probability `--mask-ratio`; a token carries its
grey level (0 where masked), a mask flag, and 2-D Fourier features of its (row, column) in the
crop. The model predicts every masked pixel's grey level (mean squared error over the masked
pixels). Reported: PSNR over all masked pixels of fixed held-out crops (`--eval-crops` per
test image, fixed masks), `10 log10(1 / MSE)` for grey levels in [0, 1]; also per test image.

The models: a pixel transformer (`common.SequenceModel`: linear embedding, `--layers` pre-norm
blocks, linear head) whose attention layers are the library's `DilatedMultiHeadAttention`
with one LongNet pattern: segments `w0, 4 w0, 16 w0, ..., N` pixels (`w0 = --first-segment`,
N = crop^2) with dilation rates `1, 4, 16, ...`, every residue read (`offsets="all"`), so
every branch gives a query `w0` keys. Per seed, the models of all orders share everything
(pattern, parameters at initialization, batches, masks) except the order their attention
layers process the pixels in (`ORDERS`):
  raster               row-major: a segment of w0 pixels is a strip of rows (or part of one);
  hilbert              a Hilbert curve over the crop (`ordering="hilbert"`): on these
                       power-of-two crops, every segment of 4^k pixels is a square patch;
  hilbert_per_segment  row-major segments, each reordered along a Hilbert curve of its own
                       (`ordering="hilbert_per_segment"`, the 1-D variant): the same segments
                       as raster, only the dilated branches' residue classes change;
  windows2d            the baseline of local 2-D windows: Z-order (Morton), an explicit
                       permutation, under which every segment of 4^k pixels is a square window
                       (the same windows as the Hilbert order's) and every rate 4^j keeps a
                       regular 2-D lattice of stride 2^j (a 2-D LongNet).
Visible (query, key, head) triples, so attention FLOPs, are the same in every order.

Also reported: the mean step time per order and the ordering's share of it (the two gathers
per layer and their gradients, timed alone on the step's activations, and the step's time
against raster's), and how much of each pixel's 2-D neighbourhood (Chebyshev radius `--hole`)
each order's pattern shows it, in the first branch and in any branch. A Gaussian
normalized-convolution fill of the holes is a classical reference. The progress lines'
`eval_acc` is the held-out PSNR in dB (per batch, averaged). `--orders` and `--seeds` pick
runs; runs of one configuration merge into `hilbert_study_<crop>px.json` in `--out-dir` (GPU
machines: a few runs per process), and checkpoints per order, seed and configuration go to
`--ckpt-dir` (a run started again resumes). With matplotlib, `hilbert_study_<crop>px.png`
shows the curves, the PSNRs and the paired differences; `--draw PATH` only draws what each
order's segments cover on a held-out photograph (no training).

CPU default (about two minutes on two cores): 32x32 crops (1,024 tokens), first segment 16
(a 4x4 patch or half a row), 2x2 holes, a 2-layer d=32 model, 100 steps of 4 crops, seed 0.
`--preset gpu`: 128x128 crops (16K tokens), first segment 256 (a 16x16 patch or two rows),
8x8 holes, 4 layers, d=128, bf16, 16 crops a step, 2000 steps, seeds 0-2. `--preset gpu64k`:
the same at 256x256 (64K tokens; the first segment is one row in raster order), 4 crops a
step. Any flag overrides the preset.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import math
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import common
from hilbert_ring_jax import (DilatedMultiHeadAttention, DilatedPattern, hilbert_permutation,
                              hilbert_permutation_per_segment, serialize, unserialize)

ORDERS = ("raster", "hilbert", "hilbert_per_segment", "windows2d")
# scikit-image's photographs (files in its wheel), split by image. The two motorcycle images
# are a stereo pair: both train. Left out: drawings, text, synthetic and tiny images.
TRAIN_IMAGES = ("astronaut.png", "brick.png", "cell.png", "coins.png", "grass.png",
                "gravel.png", "hubble_deep_field.jpg", "ihc.png", "moon.png",
                "motorcycle_left.png", "motorcycle_right.png", "retina.jpg")
TEST_IMAGES = ("camera.png", "chelsea.png", "coffee.png", "rocket.jpg")
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
PRESETS = {
    "cpu": dict(crop=32, first_segment=16, hole=2, mask_ratio=0.5, dim=32, layers=2, heads=4,
                kv_heads=2, batch=4, steps=100, lr=1e-2, eval_every=50, eval_crops=4,
                seeds="0", dtype="float32"),
    "gpu": dict(crop=128, first_segment=256, hole=8, mask_ratio=0.5, dim=128, layers=4,
                heads=4, kv_heads=2, batch=16, steps=2000, lr=2e-3, eval_every=250,
                eval_crops=16, seeds="0,1,2", dtype="bfloat16"),
    "gpu64k": dict(crop=256, first_segment=256, hole=8, mask_ratio=0.5, dim=128, layers=4,
                   heads=4, kv_heads=2, batch=4, steps=2000, lr=2e-3, eval_every=250,
                   eval_crops=8, seeds="0,1,2", dtype="bfloat16"),
}


def image_folder() -> Path:
  """scikit-image's `data` folder inside the installed package (found without importing it)."""
  spec = importlib.util.find_spec("skimage")
  if spec is None or not spec.submodule_search_locations:
    raise SystemExit('hilbert_study.py needs scikit-image (pip install -e ".[study]"): its '
                     "wheel ships the photographs")
  return Path(list(spec.submodule_search_locations)[0]) / "data"


def load_photographs(names) -> dict:
  """`{name: (grey [H, W] float32 in [0, 1], sha256 of the file)}`, read from the wheel's files.

  RGB is turned to grey with the ITU-R 601 luma weights; an alpha channel is dropped.
  """
  try:
    from PIL import Image  # pylint: disable=import-outside-toplevel
  except ImportError as e:
    raise SystemExit('hilbert_study.py needs Pillow (pip install -e ".[study]" brings it with '
                     f"scikit-image) ({e})") from e
  folder = image_folder()
  out = {}
  for name in names:
    path = folder / name
    if not path.is_file():
      raise SystemExit(f"{path} is missing: this scikit-image wheel does not ship {name}")
    raw = path.read_bytes()
    with Image.open(path) as img:
      rgb = np.asarray(img.convert("RGB"), np.float32) / 255.0
    grey = rgb @ np.array([0.299, 0.587, 0.114], np.float32)
    out[name] = (np.ascontiguousarray(grey), hashlib.sha256(raw).hexdigest())
  return out


def morton_permutation(size: int) -> np.ndarray:
  """Row-major cells of a `size` x `size` grid (a power of two) in Z-order: the bits of the
  processing index alternate column, row, column, row, ... from the lowest."""
  j = np.arange(size * size, dtype=np.int64)
  y = np.zeros_like(j)
  x = np.zeros_like(j)
  for bit in range(int(math.log2(size))):
    x |= ((j >> (2 * bit)) & 1) << bit
    y |= ((j >> (2 * bit + 1)) & 1) << bit
  return y * size + x


def pattern_for(n: int, first: int) -> DilatedPattern:
  """Segments `first * 4^k` up to `n`, rates `4^k`: `first` keys a query in every branch."""
  segments, rates = [first], [1]
  while segments[-1] < n:
    segments.append(segments[-1] * 4)
    rates.append(rates[-1] * 4)
  return DilatedPattern(tuple(segments), tuple(rates), offsets="all")


def permutation(order: str, size: int, pattern: DilatedPattern) -> np.ndarray:
  """The processing order of `order` on a `size` x `size` crop: `perm[j]` is the row-major
  pixel processed `j`-th (the identity for raster)."""
  n = size * size
  if order == "raster":
    return np.arange(n)
  if order == "hilbert":
    return hilbert_permutation((size, size))
  if order == "hilbert_per_segment":
    return hilbert_permutation_per_segment(n, pattern.segment_lengths[0])
  if order == "windows2d":
    return morton_permutation(size)
  raise ValueError(f"order must be one of {ORDERS}, got order={order!r}")


def layer_ordering(order: str, size: int) -> dict:
  """The `ordering` (and `grid_shape`) arguments of the attention layers for `order`."""
  if order == "raster":
    return {"ordering": None}
  if order == "hilbert":
    return {"ordering": "hilbert", "grid_shape": (size, size)}
  if order == "hilbert_per_segment":
    return {"ordering": "hilbert_per_segment"}
  if order == "windows2d":
    return {"ordering": morton_permutation(size)}
  raise ValueError(f"order must be one of {ORDERS}, got order={order!r}")


def branch_groups(perm: np.ndarray, pattern: DilatedPattern, branch: int) -> np.ndarray:
  """For every row-major pixel, the id of the (segment, residue class) it falls in, in branch
  `branch` of `pattern` under processing order `perm`: pixels see each other in that branch
  exactly when their ids agree (`offsets="all"`)."""
  n = len(perm)
  w, r = min(pattern.segment_lengths[branch], n), pattern.dilation_rates[branch]
  pos = np.empty(n, np.int64)
  pos[perm] = np.arange(n)
  return (pos // w) * r + (pos % w) % r


def neighbourhood_coverage(perm: np.ndarray, size: int, pattern: DilatedPattern,
                           radius: int) -> dict:
  """Of each pixel's neighbours within Chebyshev distance `radius` (inside the crop), the
  share that its first branch shows it, and the share that some branch shows it."""
  groups = [branch_groups(perm, pattern, b).reshape(size, size)
            for b in range(pattern.num_branches)]
  first = anywhere = total = 0
  for dy in range(-radius, radius + 1):
    for dx in range(-radius, radius + 1):
      if dy == dx == 0:
        continue
      ys = slice(max(0, -dy), size - max(0, dy))
      xs = slice(max(0, -dx), size - max(0, dx))
      ys2 = slice(max(0, dy), size - max(0, -dy))
      xs2 = slice(max(0, dx), size - max(0, -dx))
      same = [g[ys, xs] == g[ys2, xs2] for g in groups]
      first += int(same[0].sum())
      anywhere += int(np.logical_or.reduce(same).sum())
      total += same[0].size
  return {"radius": radius, "first_branch": first / total, "any_branch": anywhere / total}


def features(pixels, mask):
  """Per-token inputs `[B, N, 2 + 4 log2(size)]`: the grey level centred (0 where masked), the
  mask flag, and sines and cosines of the row and column at periods `2 size, size, ..., 4`."""
  b, n = pixels.shape
  size = math.isqrt(n)
  freqs = jnp.pi * 2.0 ** jnp.arange(int(math.log2(size))) / size
  coord = jnp.arange(size, dtype=jnp.float32)[:, None] * freqs  # [size, F]
  rows = jnp.repeat(coord, size, axis=0)  # pixel y * size + x -> its row's features
  cols = jnp.tile(coord, (size, 1))
  pos = jnp.concatenate([jnp.sin(rows), jnp.cos(rows), jnp.sin(cols), jnp.cos(cols)], -1)
  visible = jnp.where(mask, 0.0, pixels - 0.5)
  return jnp.concatenate([visible[..., None], mask[..., None].astype(jnp.float32),
                          jnp.broadcast_to(pos, (b, n, pos.shape[-1]))], -1)


def in_features(size: int) -> int:
  return 2 + 4 * int(math.log2(size))


def squared_errors(model, pixels, mask):
  """Per crop: the sum of squared errors over its masked pixels, and their count."""
  pred = model(features(pixels, mask))[..., 0].astype(jnp.float32) + 0.5
  err = jnp.where(mask, (pred - pixels) ** 2, 0.0)
  return jnp.sum(err, axis=1), jnp.sum(mask, axis=1)


def loss_fn(model, batch):
  """Mean squared error over the batch's masked pixels, and the batch's PSNR (dB)."""
  sse, count = squared_errors(model, *batch)
  mse = jnp.sum(sse) / jnp.maximum(jnp.sum(count), 1)
  return mse, -10.0 * jnp.log10(mse)


def hole_mask(rng: np.random.Generator, count: int, size: int, hole: int,
              ratio: float) -> np.ndarray:
  """`[count, size * size]` bool: holes of `hole` x `hole` pixels on a grid with a random
  offset per crop, each masked with probability `ratio` (at least one per crop)."""
  cells = size // hole + 1
  out = np.empty((count, size * size), bool)
  for i in range(count):
    oy, ox = rng.integers(0, hole, 2)
    chosen = rng.random((cells, cells)) < ratio
    if not chosen.any():
      chosen[rng.integers(cells), rng.integers(cells)] = True
    grid = np.repeat(np.repeat(chosen, hole, 0), hole, 1)
    out[i] = grid[oy:oy + size, ox:ox + size].reshape(-1)
  return out


def crop_sampler(images: list[np.ndarray], size: int):
  """`(rng, count) -> [count, size * size]` random crops, images drawn by their number of crop
  positions, each crop flipped left-right with probability 1/2."""
  weights = np.array([(h - size + 1) * (w - size + 1) for h, w in (i.shape for i in images)],
                     np.float64)
  weights /= weights.sum()

  def sample(rng, count):
    out = np.empty((count, size, size), np.float32)
    for k, i in enumerate(rng.choice(len(images), count, p=weights)):
      h, w = images[i].shape
      y, x = rng.integers(0, h - size + 1), rng.integers(0, w - size + 1)
      c = images[i][y:y + size, x:x + size]
      out[k] = c[:, ::-1] if rng.random() < 0.5 else c
    return out.reshape(count, -1)
  return sample


def eval_set(test: dict, size: int, per_image: int, hole: int, ratio: float,
             seed: int) -> dict:
  """Fixed held-out crops (`per_image` at random positions of each test image) and masks."""
  rng = np.random.default_rng([seed, size, 1 << 20])
  pixels, owner = [], []
  for name, image in test.items():
    h, w = image.shape
    for _ in range(per_image):
      y, x = rng.integers(0, h - size + 1), rng.integers(0, w - size + 1)
      pixels.append(image[y:y + size, x:x + size].reshape(-1))
      owner.append(name)
  pixels = np.stack(pixels)
  return {"pixels": pixels, "mask": hole_mask(rng, len(pixels), size, hole, ratio),
          "image": np.array(owner)}


def eval_batches(data: dict, batch: int) -> list:
  """The held-out crops in equal batches of at most `batch` (one compiled shape)."""
  n = len(data["pixels"])
  chunk = -(-n // -(-n // batch))
  return [(jnp.asarray(data["pixels"][i:i + chunk]), jnp.asarray(data["mask"][i:i + chunk]))
          for i in range(0, n, chunk)]


def psnr(sse: float, count: float) -> float:
  return 10.0 * math.log10(count / sse) if sse > 0 else float("inf")


def interpolation_psnr(data: dict, sigma: float) -> float:
  """PSNR of a classical fill: Gaussian normalized convolution of the visible pixels."""
  from scipy.ndimage import gaussian_filter  # pylint: disable=import-outside-toplevel
  size = math.isqrt(data["pixels"].shape[1])
  sse = count = 0.0
  for pixels, mask in zip(data["pixels"], data["mask"]):
    img, vis = pixels.reshape(size, size), (~mask).reshape(size, size).astype(np.float64)
    num, den = gaussian_filter(img * vis, sigma), gaussian_filter(vis, sigma)
    fill = np.where(den > 1e-6, num / np.maximum(den, 1e-6), img[vis > 0].mean())
    m = mask.reshape(size, size)
    sse += float(((fill - img)[m] ** 2).sum())
    count += float(m.sum())
  return psnr(sse, count)


def build_model(order: str, args, seed: int) -> nnx.Module:
  size = args.crop
  pattern = pattern_for(size * size, args.first_segment)
  attention = lambda rngs: DilatedMultiHeadAttention(
      args.heads, args.dim, num_kv_heads=args.kv_heads, pattern=pattern,
      dtype=DTYPES[args.dtype], implementation=args.impl, rngs=rngs,
      **layer_ordering(order, size))
  return common.SequenceModel(None, args.dim, args.layers, attention, out=1,
                              in_features=in_features(size), norm=nnx.LayerNorm,
                              dtype=DTYPES[args.dtype], rngs=nnx.Rngs(seed))


def ordering_seconds(perm: np.ndarray, batch: int, dim: int, layers: int, dtype,
                     repeats: int = 5) -> float:
  """The time a training step spends ordering: per layer, `serialize` of the attention's input
  and `unserialize` of its output `[batch, N, dim]`, forward and backward, timed against the
  same function without them, times `layers`."""
  n = len(perm)
  keys = jax.random.split(jax.random.key(0), 3)
  x, c = (jax.random.normal(k, (batch, n, dim), dtype) for k in keys[:2])
  w = jax.random.normal(keys[2], (dim,), dtype)

  def timed(order):
    def f(x, c):
      y = order(x) * w
      return jnp.sum((order(y, inverse=True) * c).astype(jnp.float32))
    grad = jax.jit(jax.grad(f))
    jax.block_until_ready(grad(x, c))
    t = time.perf_counter()
    for _ in range(repeats):
      out = grad(x, c)
    jax.block_until_ready(out)
    return (time.perf_counter() - t) / repeats

  gathers = timed(lambda y, inverse=False: unserialize(y, perm) if inverse else
                  serialize(y, perm))
  plain = timed(lambda y, inverse=False: y)
  return layers * max(gathers - plain, 0.0)


def evaluate(model, data: dict, batch: int) -> dict:
  """Held-out PSNR over all masked pixels, and per test image."""
  run = nnx.jit(squared_errors)
  sse, count = [], []
  for pixels, mask in eval_batches(data, batch):
    s, c = run(model, pixels, mask)
    sse.append(np.asarray(s, np.float64))
    count.append(np.asarray(c, np.float64))
  sse, count = np.concatenate(sse), np.concatenate(count)
  per_image = {name: psnr(sse[data["image"] == name].sum(), count[data["image"] == name].sum())
               for name in dict.fromkeys(data["image"].tolist())}
  return {"psnr": psnr(sse.sum(), count.sum()), "psnr_per_image": per_image}


def train_one(order: str, seed: int, args, train_images: list, test: dict,
              config: dict) -> dict:
  model = build_model(order, args, seed)
  sample = crop_sampler(train_images, args.crop)

  def batch_fn(step):
    rng = np.random.default_rng([seed, step])
    pixels = sample(rng, args.batch)
    mask = hole_mask(rng, args.batch, args.crop, args.hole, args.mask_ratio)
    return jnp.asarray(pixels), jnp.asarray(mask)

  ckpt = common.checkpoint_dir(args.ckpt_dir, f"{order}-seed{seed}", config)
  history = common.train(model, loss_fn, batch_fn, steps=args.steps, lr=args.lr,
                         eval_batch=eval_batches(test, args.batch), eval_every=args.eval_every,
                         ckpt_dir=ckpt, desc=f"{order} (seed {seed})")
  result = evaluate(model, test, args.batch)
  return {"order": order, "seed": seed, "heldout_psnr": result["psnr"],
          "heldout_psnr_per_image": result["psnr_per_image"],
          "steps": history["step"][-1] if history["step"] else 0,
          "step_seconds": history["step_seconds"], "compile_seconds": history["compile_seconds"],
          "train_seconds": history["seconds"],
          "curves": {"step": list(range(1, len(history["loss"]) + 1)),
                     "train_mse": history["loss"], "eval_step": history["step"],
                     "heldout_psnr": [psnr(m, 1.0) for m in history["eval_loss"]]}}


def summarize(runs: list[dict], timing: dict) -> dict:
  """Per order: PSNR mean and sample std over seeds; per order but raster: the paired
  (same-seed) differences from raster, and whether the mean beats raster's by more than the
  larger of the two seed spreads; the ordering's share of the step time."""
  out = {}
  for order in ORDERS:
    mine = [r for r in runs if r["order"] == order]
    if not mine:
      continue
    values = [r["heldout_psnr"] for r in mine]
    mean, std = common.mean_std(values)
    steps = [r["step_seconds"] for r in mine if r["step_seconds"]]
    step_s = common.mean_std(steps)[0] if steps else None
    out[order] = {"seeds": [r["seed"] for r in mine], "heldout_psnr": values, "mean": mean,
                  "std": std, "step_seconds": step_s,
                  "ordering_seconds": timing.get(order),
                  "ordering_share": (timing[order] / step_s
                                     if step_s and timing.get(order) is not None else None)}
  if "raster" in out:
    base = {r["seed"]: r["heldout_psnr"] for r in runs if r["order"] == "raster"}
    for order in ORDERS[1:]:
      if order not in out:
        continue
      diffs = [r["heldout_psnr"] - base[r["seed"]] for r in runs
               if r["order"] == order and r["seed"] in base]
      if not diffs:
        continue
      mean, std = common.mean_std(diffs)
      spread = max(out[order]["std"], out["raster"]["std"])
      out[order]["minus_raster"] = {"per_seed": diffs, "mean": mean, "std": std,
                                    "seed_spread": spread,
                                    "ahead_by_more_than_spread": len(diffs) > 1
                                    and mean > spread}
      r_step, o_step = out["raster"]["step_seconds"], out[order]["step_seconds"]
      out[order]["step_share_vs_raster"] = (1 - r_step / o_step) if r_step and o_step else None
  return out


def parse_args(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu",
                      help="sizes; flags given override it (default: cpu)")
  parser.add_argument("--crop", type=int, help="side of the square crops (a power of two)")
  parser.add_argument("--first-segment", type=int,
                      help="w0, the first branch's segment (a power of 4, below crop^2)")
  parser.add_argument("--hole", type=int, help="side of the masked squares, in pixels")
  parser.add_argument("--mask-ratio", type=float, help="probability that a hole is masked")
  parser.add_argument("--dim", type=int)
  parser.add_argument("--layers", type=int)
  parser.add_argument("--heads", type=int)
  parser.add_argument("--kv-heads", type=int)
  parser.add_argument("--batch", type=int, help="crops a step")
  parser.add_argument("--steps", type=int)
  parser.add_argument("--lr", type=float)
  parser.add_argument("--eval-every", type=int)
  parser.add_argument("--eval-crops", type=int, help="held-out crops per test image")
  parser.add_argument("--eval-seed", type=int, default=0, help="the held-out crops and masks")
  parser.add_argument("--seeds", help="comma-separated seeds (init, batches, masks)")
  parser.add_argument("--orders", default=",".join(ORDERS),
                      help=f"comma-separated, of {', '.join(ORDERS)} (default: all)")
  parser.add_argument("--dtype", choices=sorted(DTYPES), help="computation dtype")
  parser.add_argument("--impl", default=None, help="xla | triton | mosaic (default: fastest)")
  parser.add_argument("--out-dir", type=Path, default=Path("out/hilbert_study"))
  parser.add_argument("--ckpt-dir", type=Path, default=None,
                      help="default: <out-dir>/ckpt; 'none' keeps no checkpoint")
  parser.add_argument("--draw", type=Path, default=None,
                      help="only draw each order's first segments on a held-out photograph "
                      "to this PNG (needs matplotlib), no training")
  args = parser.parse_args(argv)
  for key, val in PRESETS[args.preset].items():
    if getattr(args, key) is None:
      setattr(args, key, val)
  return args


def check_args(args) -> None:
  """`ValueError` naming the flag for every inconsistent setting."""
  common.check_positive(args, "crop", "first_segment", "hole", "mask_ratio", "dim", "layers",
                        "heads", "kv_heads", "batch", "steps", "lr", "eval_every",
                        "eval_crops")
  for flag, text in (("seeds", args.seeds), ("orders", args.orders)):
    items = tuple(s.strip() for s in str(text).split(","))
    if len(set(items)) < len(items) or "" in items:
      raise ValueError(f"--{flag} must be distinct and comma-separated, got {text!r}")
    setattr(args, flag, items)
  try:
    args.seeds = tuple(int(s) for s in args.seeds)
  except ValueError:
    raise ValueError(f"--seeds must be comma-separated integers, got {args.seeds}") from None
  bad = [o for o in args.orders if o not in ORDERS]
  if bad:
    raise ValueError(f"--orders must be of {ORDERS}, got {bad}")
  args.orders = tuple(o for o in ORDERS if o in args.orders)
  size = args.crop
  if size < 8 or size & (size - 1):
    raise ValueError(f"--crop must be a power of two >= 8, got {size}")
  w0 = args.first_segment
  if w0 < 4 or w0 & (w0 - 1) or int(math.log2(w0)) % 2 or w0 >= size * size:
    raise ValueError(f"--first-segment must be a power of 4 from 4 to below crop^2 = "
                     f"{size * size}, got {w0}")
  if args.hole >= size:
    raise ValueError(f"--hole must be below --crop {size}, got {args.hole}")
  if not args.mask_ratio < 1:
    raise ValueError(f"--mask-ratio must be in (0, 1), got {args.mask_ratio}")
  common.check_model_args(args)


def run_config(args, digests: dict) -> dict:
  """What decides the results: runs of one configuration merge into one JSON, and a change of
  any entry names a new checkpoint folder."""
  keys = ("crop", "first_segment", "hole", "mask_ratio", "dim", "layers", "heads", "kv_heads",
          "batch", "steps", "lr", "eval_every", "eval_crops", "eval_seed", "dtype", "impl")
  config = {k: getattr(args, k) for k in keys}
  config["images_sha256"] = hashlib.sha256(json.dumps(digests, sort_keys=True).encode()
                                           ).hexdigest()[:16]
  return config


def plot(path: Path, runs: list[dict], summary: dict) -> bool:
  """Held-out PSNR during training (every run), at the end (each seed, per order), and each
  order's paired difference from raster."""
  plt = common.pyplot()
  if plt is None:
    return False
  fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(18, 4.6))
  colors = dict(zip(ORDERS, ("C3", "C0", "C1", "C2")))
  for r in runs:
    c = r["curves"]
    ax1.plot(c["eval_step"], c["heldout_psnr"], "o-", ms=3, alpha=0.6,
             color=colors[r["order"]], label=r["order"] if r["seed"] == runs[0]["seed"] else None)
  ax1.set(xlabel="step", ylabel="held-out PSNR of masked pixels (dB)", title="training")
  ax1.legend()
  orders = [o for o in ORDERS if o in summary]
  for i, order in enumerate(orders):
    s = summary[order]
    ax2.plot([i] * len(s["heldout_psnr"]), s["heldout_psnr"], "o", color=colors[order])
    ax2.errorbar([i + 0.15], [s["mean"]], yerr=[s["std"]], fmt="s", color="k", capsize=4)
  ax2.set(xticks=range(len(orders)), xticklabels=orders, ylabel="held-out PSNR (dB)",
          title="each seed (dots), mean +- std (squares)")
  others = [o for o in orders if "minus_raster" in summary[o]]
  for i, order in enumerate(others):
    d = summary[order]["minus_raster"]
    ax3.plot([i] * len(d["per_seed"]), d["per_seed"], "o", color=colors[order])
    ax3.errorbar([i + 0.15], [d["mean"]], yerr=[d["std"]], fmt="s", color="k", capsize=4)
  ax3.axhline(0.0, color="C3", lw=1)
  ax3.set(xticks=range(len(others)), xticklabels=others, ylabel="minus raster (dB)",
          title="paired by seed: each seed, mean +- std")
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)
  return True


def draw_segments(path: Path, image: np.ndarray, size: int, first: int,
                  orders=ORDERS) -> bool:
  """What each order's pattern covers on `image` (a `size` x `size` crop), one column per
  order. Top: the first branch's segments (outlined), segments 0 and 1 in red and blue.
  Middle: the second branch's segment 0, outlined, and its residue class 0 in red (the keys a
  pixel of that class sees there). Bottom: every pixel one pixel (the cross) sees in one layer,
  coloured by the first branch that shows it."""
  plt = common.pyplot()
  if plt is None:
    return False
  from matplotlib.colors import ListedColormap  # pylint: disable=import-outside-toplevel
  pattern = pattern_for(size * size, first)
  w1, r1 = pattern.segment_lengths[1], pattern.dilation_rates[1]
  branches = pattern.num_branches
  query = (size // 2 + 3) * size + size // 2 + 5  # a pixel off every segment boundary
  fig, axes = plt.subplots(3, len(orders), figsize=(3.6 * len(orders), 11.4), squeeze=False)
  line = ListedColormap([(0, 0, 0, 0), (1, 0.85, 0, 0.8)])
  marks = ListedColormap([(0, 0, 0, 0), (0.9, 0.1, 0.1, 0.75), (0.1, 0.3, 1.0, 0.75)])
  palette = plt.get_cmap("plasma")(np.linspace(0, 0.9, branches))
  palette[:, 3] = 0.75
  seen_map = ListedColormap([(0, 0, 0, 0)] + [tuple(c) for c in palette])

  def outline(labels):
    """Pixels whose right or lower neighbour has another label."""
    edge = np.zeros(labels.shape, bool)
    edge[:, :-1] |= labels[:, :-1] != labels[:, 1:]
    edge[:-1] |= labels[:-1] != labels[1:]
    return edge

  for col, order in enumerate(orders):
    perm = permutation(order, size, pattern)
    pos = np.empty(size * size, np.int64)
    pos[perm] = np.arange(size * size)
    for ax in axes[:, col]:
      ax.imshow(image, cmap="gray", vmin=0, vmax=1, interpolation="nearest")
      ax.set(xticks=[], yticks=[])
    segment = (pos // first).reshape(size, size)
    ax = axes[0, col]
    ax.imshow(outline(segment), cmap=line, interpolation="nearest")
    ax.imshow(np.where(segment < 2, segment + 1, 0), cmap=marks, vmin=0, vmax=2,
              interpolation="nearest")
    ax.set_title(f"{order}\nbranch ({first}, 1): segments 0 and 1", fontsize=10)
    ax = axes[1, col]
    in_first = (pos < w1).reshape(size, size)
    ax.imshow(outline(in_first), cmap=line, interpolation="nearest")
    ax.imshow(in_first & (pos % r1 == 0).reshape(size, size), cmap=marks, vmin=0, vmax=2,
              interpolation="nearest")
    ax.set_title(f"branch ({w1}, {r1}): segment 0, residue 0", fontsize=10)
    ax = axes[2, col]
    shown = np.zeros(size * size, np.int64)
    for b in reversed(range(branches)):
      groups = branch_groups(perm, pattern, b)
      shown[groups == groups[query]] = b + 1
    ax.imshow(shown.reshape(size, size), cmap=seen_map, vmin=0, vmax=branches,
              interpolation="nearest")
    ax.plot([query % size], [query // size], "c+", ms=14, mew=2)
    ax.set_title(f"what the cross sees: {shown.astype(bool).sum()} pixels,\n"
                 "by first branch (dark: 0 ... light: last)", fontsize=10)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return True


def main(argv=None) -> dict | None:
  """Runs the study; returns what it writes to `<out-dir>/hilbert_study_<crop>px.json`."""
  args = parse_args(argv)
  check_args(args)
  size, n = args.crop, args.crop ** 2
  pattern = pattern_for(n, args.first_segment)
  photos = load_photographs(TRAIN_IMAGES + TEST_IMAGES)
  small = [k for k, (img, _) in photos.items() if min(img.shape) < size]
  if small:
    raise ValueError(f"--crop {size} exceeds the photographs {small}")
  if args.draw is not None:
    image = photos[TEST_IMAGES[0]][0]
    y, x = (image.shape[0] - size) // 2, (image.shape[1] - size) // 2
    if not draw_segments(args.draw, image[y:y + size, x:x + size], size, args.first_segment):
      raise SystemExit("--draw needs matplotlib")
    print(f"drew {args.draw}")
    return None
  train_images = [photos[k][0] for k in TRAIN_IMAGES]
  test = eval_set({k: photos[k][0] for k in TEST_IMAGES}, size, args.eval_crops, args.hole,
                  args.mask_ratio, args.eval_seed)
  info = common.device_info()
  print(f"JAX {info['jax']} on {info['platform']} ({info['device_kind']}); {size}x{size} crops "
        f"({n} tokens) of {len(TRAIN_IMAGES)} training photographs, {len(test['pixels'])} "
        f"held-out crops of {len(TEST_IMAGES)} others; pattern {pattern.segment_lengths} x "
        f"{pattern.dilation_rates}; {args.hole}x{args.hole} holes; seeds {args.seeds}")
  digests = {k: d for k, (_, d) in photos.items()}
  config = run_config(args, digests)
  perms = {o: permutation(o, size, pattern) for o in ORDERS}
  geometry = {o: neighbourhood_coverage(perms[o], size, pattern, args.hole) for o in ORDERS}
  heads = args.heads
  pairs = pattern.visible_pairs(n, heads, distinct=True)

  out_json = args.out_dir / f"hilbert_study_{size}px.json"
  runs, timing = [], {}
  if out_json.exists():  # earlier runs of this configuration (a few runs per process)
    old = json.loads(out_json.read_text())
    if old.get("config") == config and old.get("device") == info:
      runs = [r for r in old["runs"]
              if not (r["order"] in args.orders and r["seed"] in args.seeds)]
      timing = old.get("ordering_seconds", {})
  t = time.perf_counter()
  for seed in args.seeds:
    for order in args.orders:
      runs.append(train_one(order, seed, args, train_images, test, config))
  for order in args.orders:
    timing[order] = (0.0 if order == "raster" else
                     ordering_seconds(perms[order], args.batch, args.dim, args.layers,
                                      DTYPES[args.dtype]))
  model = build_model(args.orders[0], args, 0)
  flops = common.train_step_flops(model, batch=args.batch, seq_len=n, attention_pairs=pairs,
                                  head_dim=args.dim // heads, layers=args.layers)
  runs.sort(key=lambda r: (ORDERS.index(r["order"]), r["seed"]))
  summary = summarize(runs, timing)
  import skimage  # pylint: disable=import-outside-toplevel
  result = {
      "config": config, "device": info,
      "pattern": {"segment_lengths": pattern.segment_lengths,
                  "dilation_rates": pattern.dilation_rates, "offsets": pattern.offsets},
      "attention_pairs_per_layer": pairs, "model_flops_per_step": flops,
      "params": common.count_params(model),
      "data": {"source": "scikit-image's wheel, skimage/data", "scikit_image": skimage.__version__,
               "train_images": list(TRAIN_IMAGES), "test_images": list(TEST_IMAGES),
               "sha256": digests, "heldout_crops": len(test["pixels"]),
               "heldout_masked_pixels": int(test["mask"].sum())},
      "neighbourhood_coverage": geometry,
      "interpolation_psnr": interpolation_psnr(test, max(1.0, args.hole / 2)),
      "ordering_seconds": timing, "runs": runs, "summary": summary,
      "seconds": time.perf_counter() - t}
  common.write_json(out_json, result)
  png = args.out_dir / f"hilbert_study_{size}px.png"
  plotted = plot(png, runs, summary)

  rows = [[r["order"], r["seed"], r["steps"], r["heldout_psnr"],
           f"{r['step_seconds'] * 1e3:.1f}" if r["step_seconds"] else "-"] for r in runs]
  print()
  print(common.table(["order", "seed", "steps", "held-out PSNR (dB)", "ms/step"], rows))
  print(f"\nsame pattern, parameters and FLOPs in every order: {flops / 1e9:.2f} GFLOP a step;"
        f" Gaussian fill of the holes: {result['interpolation_psnr']:.2f} dB")
  for order, s in summary.items():
    g = geometry[order]
    spread = f" +- {s['std']:.3f}" if len(s["seeds"]) > 1 else ""  # none from one seed
    line = (f"{order:20} {s['mean']:.3f}{spread} dB over {len(s['seeds'])} seed(s); "
            f"neighbours within {g['radius']} px seen: first branch {g['first_branch']:.2f}, "
            f"any {g['any_branch']:.2f}")
    if s.get("ordering_share") is not None:
      line += f"; ordering {100 * s['ordering_share']:.1f}% of the step"
    print(line)
    d = s.get("minus_raster")
    if d:
      print(f"{'':20} minus raster {d['mean']:+.3f} +- {d['std']:.3f} dB (paired by seed: "
            + ", ".join(f"{x:+.3f}" for x in d["per_seed"]) + ")")
  print(f"\nresults: {out_json}" + (f"\nplot: {png}" if plotted else ""))
  return result


if __name__ == "__main__":
  main()
