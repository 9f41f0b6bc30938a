"""examples/hilbert_study.py: its orders are distinct permutations at equal FLOPs, they are what
the layers compute, its train/test split is by image, and its smallest run ends finite."""

import importlib.util
import itertools
import json
import math
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

from hilbert_ring_jax import DilatedMultiHeadAttention, serialize, unserialize

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
HAS_SKIMAGE = importlib.util.find_spec("skimage") is not None
HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None
# Two orders and two branches, (16, 64) x (1, 4): compiling the steps is most of the time.
TINY = ["--crop", "8", "--first-segment", "16", "--hole", "2", "--dim", "8", "--layers", "1",
        "--heads", "2", "--kv-heads", "1", "--batch", "2", "--steps", "2", "--eval-every", "2",
        "--eval-crops", "1", "--seeds", "0", "--orders", "raster,hilbert"]


@pytest.fixture
def study(monkeypatch):
  """The example, imported as scripts import each other: from their own folder."""
  pytest.importorskip("optax")
  monkeypatch.syspath_prepend(str(EXAMPLES))
  import hilbert_study  # pylint: disable=import-outside-toplevel
  return hilbert_study


@pytest.mark.parametrize("size, first", [(8, 4), (16, 16), (32, 16)])
def test_orders_are_distinct_permutations_at_equal_flops(study, size, first):
  n = size * size
  pattern = study.pattern_for(n, first)
  assert pattern.segment_lengths[0] == first and pattern.segment_lengths[-1] == n
  perms = {o: study.permutation(o, size, pattern) for o in study.ORDERS}
  for perm in perms.values():
    assert np.array_equal(np.sort(perm), np.arange(n))
  for a, b in itertools.combinations(study.ORDERS, 2):
    assert not np.array_equal(perms[a], perms[b]), (a, b)
  # The same visible pairs in every order (so the same attention FLOPs), counted from where
  # each order puts the pixels: the pattern's own count.
  for order, perm in perms.items():
    pairs = sum(int((np.bincount(study.branch_groups(perm, pattern, b)) ** 2).sum())
                for b in range(pattern.num_branches))
    assert pairs == pattern.visible_pairs(n, 1), order

  def segments(order, branch):
    """Each pixel's segment, numbered by its smallest pixel (comparable across orders)."""
    w = pattern.segment_lengths[branch]
    pos = np.empty(n, np.int64)
    pos[perms[order]] = np.arange(n)
    first_pixel = {}
    for pixel, seg in enumerate(pos // w):
      first_pixel.setdefault(seg, pixel)
    return np.array([first_pixel[s] for s in pos // w])

  for b, w in enumerate(pattern.segment_lengths):
    # Global Hilbert and the 2-D windows share every segment, each a square; Hilbert per
    # segment keeps raster's segments (only residue classes differ).
    assert np.array_equal(segments("hilbert", b), segments("windows2d", b))
    assert np.array_equal(segments("raster", b), segments("hilbert_per_segment", b))
    side = math.isqrt(w)
    for start in np.unique(segments("windows2d", b)):
      ys, xs = np.divmod(np.flatnonzero(segments("windows2d", b) == start), size)
      assert np.ptp(ys) + 1 == np.ptp(xs) + 1 == side
  cover = {o: study.neighbourhood_coverage(perms[o], size, pattern, 1) for o in perms}
  assert cover["hilbert"]["first_branch"] > cover["raster"]["first_branch"]


def test_layers_process_in_the_studied_orders(study):
  """A layer built with an order's arguments is the unordered layer applied in that order."""
  size = 8
  pattern = study.pattern_for(size * size, 4)
  x = jax.random.normal(jax.random.key(0), (2, size * size, 8))
  plain = DilatedMultiHeadAttention(2, 8, pattern=pattern, rngs=nnx.Rngs(0))
  for order in study.ORDERS:
    layer = DilatedMultiHeadAttention(2, 8, pattern=pattern, rngs=nnx.Rngs(0),
                                      **study.layer_ordering(order, size))
    perm = study.permutation(order, size, pattern)
    expected = unserialize(plain(serialize(x, perm)), perm)
    np.testing.assert_allclose(layer(x), expected, rtol=1e-5, atol=1e-5, err_msg=order)


def test_split_is_by_image(study):
  assert not set(study.TRAIN_IMAGES) & set(study.TEST_IMAGES)
  if not HAS_SKIMAGE:
    pytest.skip("scikit-image is not installed: the image files are not checked")
  photos = study.load_photographs(study.TRAIN_IMAGES + study.TEST_IMAGES)
  train = {photos[k][1] for k in study.TRAIN_IMAGES}
  assert len(train) == len(study.TRAIN_IMAGES)
  assert not train & {photos[k][1] for k in study.TEST_IMAGES}  # no file in both
  for name, (image, _) in photos.items():
    assert image.dtype == np.float32 and 0 <= image.min() < image.max() <= 1, name
    assert min(image.shape) >= 256, name  # the 256x256 crops fit every photograph


@pytest.mark.parametrize("argv, match", [
    (["--crop", "24"], "--crop"), (["--first-segment", "8"], "--first-segment"),
    (["--hole", "32"], "--hole"), (["--orders", "raster,zigzag"], "--orders"),
    (["--seeds", "0,0"], "--seeds")])
def test_bad_flags(study, argv, match):
  with pytest.raises(ValueError, match=match):
    study.main(argv)


@pytest.mark.skipif(not HAS_SKIMAGE, reason='needs scikit-image (pip install -e ".[study]")')
def test_smallest_run(study, tmp_path):
  result = study.main(TINY + ["--out-dir", str(tmp_path), "--ckpt-dir", "none"])
  saved = json.loads((tmp_path / "hilbert_study_8px.json").read_text())
  assert saved["summary"] == json.loads(json.dumps(result["summary"]))
  assert [(r["order"], r["seed"]) for r in saved["runs"]] == [("raster", 0), ("hilbert", 0)]
  finite = lambda *xs: all(isinstance(x, float) and math.isfinite(x) for x in xs)
  for r in saved["runs"]:
    assert r["steps"] == 2 and finite(r["heldout_psnr"], *r["curves"]["train_mse"])
    assert set(r["heldout_psnr_per_image"]) == set(study.TEST_IMAGES)
  # The same parameters and batches, another order: another function.
  assert saved["runs"][0]["heldout_psnr"] != saved["runs"][1]["heldout_psnr"]
  assert saved["pattern"]["segment_lengths"] == [16, 64]
  # heads x N x (the keys of each branch, less those both branches show: counted once)
  assert saved["attention_pairs_per_layer"] == 2 * 64 * (16 + 16 - 4)
  data = saved["data"]
  assert not set(data["train_images"]) & set(data["test_images"])
  assert data["heldout_crops"] == len(study.TEST_IMAGES)
  assert finite(saved["interpolation_psnr"], saved["model_flops_per_step"] * 1.0)
  assert finite(saved["summary"]["hilbert"]["minus_raster"]["mean"])
  assert saved["ordering_seconds"]["hilbert"] >= 0 == saved["ordering_seconds"]["raster"]
  assert (tmp_path / "hilbert_study_8px.png").exists() == HAS_MATPLOTLIB
