"""The real-data examples run end to end at a tiny size: finite results, the JSON they promise,
learning (losses fall), resumption from their checkpoints, and flag checks."""

import importlib.util
import json
import math
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None

LM_TINY = ["--seq-len", "64", "--segments", "8,32,64", "--rates", "1,1,4", "--dim", "32",
           "--layers", "1", "--heads", "4", "--kv-heads", "2", "--batch", "4", "--steps", "16",
           "--eval-every", "16", "--eval-windows", "8", "--lr", "1e-2"]
DIGITS_TINY = ["--size", "8", "--dim", "32", "--layers", "1", "--heads", "2", "--kv-heads", "1",
               "--batch", "32", "--steps", "40", "--eval-every", "20", "--seeds", "0,1",
               "--lr", "1e-2"]


@pytest.fixture
def examples(monkeypatch):
  """The examples import each other as scripts do: from their own folder."""
  pytest.importorskip("optax")
  monkeypatch.syspath_prepend(str(EXAMPLES))


def finite(*xs):
  return all(isinstance(x, (int, float)) and math.isfinite(x) for x in xs)


@pytest.mark.slow  # ~45 s; lm_packed's and train_lm's tests (also slow) run the same loop
def test_lm_real(examples, tmp_path):
  """Two of the three models (the local one is the dilated layer with one branch: it is built
  and counted below, not trained, to keep the test short)."""
  import lm_real  # pylint: disable=import-outside-toplevel
  out = tmp_path / "lm"
  result = lm_real.main(LM_TINY + ["--out-dir", str(out), "--models", "full,dilated"])
  saved = json.loads((out / "lm_real.json").read_text())
  assert saved["config"] == result["config"]
  assert {"config", "device", "data", "runs", "summary"} <= saved.keys()
  split = saved["data"]
  assert split["train_files"] + split["heldout_files"] == split["files"] > 100
  assert len(split["heldout_list"]) == split["heldout_files"]
  assert all(len(split[k]) == 64 for k in ("train_list_sha256", "heldout_list_sha256",
                                           "train_bytes_sha256", "heldout_bytes_sha256"))
  runs = {r["model"]: r for r in saved["runs"]}
  assert list(runs) == ["dilated", "full"]
  for r in runs.values():
    assert r["steps"] == 16 and r["params"] == runs["full"]["params"]
    assert finite(r["heldout_bpb"], r["tokens_per_s"], r["step_seconds"], *r["bpb_by_position"])
    assert len(r["bpb_by_position"]) == len(r["position_edges"]) - 1
    # A fraction of the H100's peak on a GPU only.
    assert (r["fraction_of_h100_bf16_peak"] is None) == (lm_real.jax.default_backend() != "gpu")
    # It learns: from about 8 bits (a uniform guess over bytes) well below.
    assert r["curves"]["train_bpb"][0] > 7.0
    assert r["heldout_bpb"] < r["curves"]["train_bpb"][0] - 1.5
  assert {"dilated", "full", "dilated_bpb_over_full"} <= saved["summary"].keys()
  assert (out / "lm_real.png").exists() == HAS_MATPLOTLIB
  # Model FLOPs: full attention scores the most pairs, local the fewest.
  args = lm_real.parse_args(LM_TINY)
  lm_real.check_args(args)
  local, pattern = lm_real.build_model("local", args, "xla", 0)
  assert pattern.segment_lengths == (8,) and pattern.causal
  flops = lm_real.common.train_step_flops(
      local, batch=4, seq_len=64, attention_pairs=pattern.visible_pairs(64, 4, distinct=True),
      head_dim=8, layers=1)
  # The presets give each branch its own heads; --no-head-groups gives every head all three.
  assert lm_real.attention_spec("dilated", args, "xla")[0].head_groups
  mixed = lm_real.parse_args(LM_TINY + ["--no-head-groups"])
  lm_real.check_args(mixed)
  assert not lm_real.attention_spec("dilated", mixed, "xla")[0].head_groups
  assert runs["full"]["model_flops_per_step"] > runs["dilated"]["model_flops_per_step"] > flops
  # Again for one model: re-evaluated from its checkpoint (the same figure, the timing kept)
  # and merged into the same JSON next to the other.
  again = lm_real.main(LM_TINY + ["--out-dir", str(out), "--models", "dilated"])
  assert [r["model"] for r in again["runs"]] == ["dilated", "full"]
  dilated = again["runs"][0]
  assert dilated["heldout_bpb"] == pytest.approx(runs["dilated"]["heldout_bpb"], rel=1e-5)
  assert dilated["step_seconds"] == pytest.approx(runs["dilated"]["step_seconds"])
  assert again["runs"][1] == runs["full"]


@pytest.mark.slow  # ~30 s, four short trainings: its flags are checked below, the layers in
# Hilbert order by test_nn and test_hilbert_study
def test_image_digits(examples, tmp_path):
  pytest.importorskip("sklearn")
  import image_digits  # pylint: disable=import-outside-toplevel
  out = tmp_path / "digits"
  result = image_digits.main(DIGITS_TINY + ["--out-dir", str(out), "--ckpt-dir", "none"])
  saved = json.loads((out / "image_digits.json").read_text())
  assert saved["summary"] == result["summary"]
  assert saved["data"]["train_images"] + saved["data"]["test_images"] == 1797
  assert [(r["order"], r["seed"]) for r in saved["runs"]] == [
      ("hilbert", 0), ("raster", 0), ("hilbert", 1), ("raster", 1)]
  for r in saved["runs"]:
    assert finite(r["test_accuracy"], r["test_loss"], r["step_seconds"])
    losses = r["curves"]["train_loss"]
    assert len(losses) == 40
    # It learns: the loss falls from about ln 10, and the test accuracy beats chance (0.1).
    assert sum(losses[-6:]) / 6 < sum(losses[:6]) / 6 - 0.15
    assert r["test_accuracy"] > 0.2
  summary = saved["summary"]
  for order in ("hilbert", "raster"):
    assert len(summary[order]["test_accuracy"]) == 2
    assert finite(summary[order]["mean"], summary[order]["std"])
  assert len(summary["hilbert_minus_raster"]["per_seed"]) == 2
  assert (out / "image_digits.png").exists() == HAS_MATPLOTLIB


@pytest.mark.parametrize("script,argv,match", [
    ("lm_real", ["--segments", "8,32", "--rates", "1"], "--segments"),
    ("lm_real", ["--segments", "32,8", "--rates", "1,4"], "--segments must increase"),
    ("lm_real", ["--rates", "2,4,16"], "--rates must start with 1"),
    ("lm_real", ["--models", "dilated,sparse"], "--models"),
    ("lm_real", ["--dim", "30"], "--dim 30 must be divisible by --heads"),
    ("lm_real", ["--steps", "0"], "--steps must be positive"),
    ("lm_real", ["--seeds", "a"], "--seeds"),
    ("lm_real", ["--rotary-base", "0.5"], "--rotary-base"),
    ("lm_real", ["--heads", "2", "--kv-heads", "1"], "--head-groups needs a head per branch"),
    ("image_digits", ["--size", "4"], "--size must be at least 8"),
    ("image_digits", ["--kv-heads", "3"], "--kv-heads 3 must divide --heads"),
    ("image_digits", ["--lr", "-1"], "--lr must be positive"),
    ("image_digits", ["--seeds", "1,1"], "--seeds must be distinct"),
    # The synthetic examples and the quickstart: checked before any JAX work too.
    ("train_lm", ["--steps", "0"], "--steps must be positive"),
    ("train_lm", ["--eval-every", "0"], "--eval-every must be positive"),
    ("train_lm", ["--local", "0"], "--local must be positive"),
    ("train_lm", ["--fillers", "0"], "--fillers must be positive"),
    ("image_hilbert", ["--eval-every", "0"], "--eval-every must be positive"),
    ("image_hilbert", ["--classes", "0"], "--classes must be positive"),
    ("image_hilbert", ["--objects", "0"], "--objects must be positive"),
    ("generate", ["--steps", "0"], "--steps must be positive"),
    ("generate", ["--max-period", "1"], r"--max-period must be in \[2, --vocab 16\]"),
    ("generate", ["--max-period", "40"], r"--max-period must be in \[2, --vocab 16\]"),
    ("image_hilbert", ["--grid", "3"], "--grid must be at least 4"),
    ("quickstart", ["--runs", "0"], "--runs must be at least 1"),
    ("quickstart", ["--grid", "3"], "--grid must be at least 4"),
])
def test_bad_flags(examples, script, argv, match):
  module = __import__(script)
  with pytest.raises(ValueError, match=match):
    module.main(argv)


@pytest.mark.parametrize("script,argv,match", [
    ("generate", ["--dtype", "float8"], "argument --dtype: invalid choice: 'float8'"),
    ("multi_gpu", ["--cpu-devices", "0"], "--cpu-devices must be at least 1, got 0"),
])
def test_bad_flags_argparse(examples, capsys, script, argv, match):
  """Flags argparse refuses (usage and the error on stderr, exit status 2), before any JAX
  work (multi_gpu: before it configures the CPU devices)."""
  module = __import__(script)
  with pytest.raises(SystemExit) as exit_:
    module.main(argv)
  assert exit_.value.code == 2 and match in capsys.readouterr().err


@pytest.mark.parametrize("script", ["train_lm", "image_hilbert"])
def test_synthetic_checkpoint_flags(examples, script):
  """`--ckpt-dir none` keeps no checkpoint (as in the real-data examples), and the folder of
  a run's checkpoints is keyed by its flags: another --seed, --lr or --dim never resumes it."""
  module = __import__(script)
  assert module.parse_args(["--ckpt-dir", "none"]).ckpt_dir is None
  assert module.parse_args(["--ckpt-dir", "None"]).ckpt_dir is None
  digest = lambda argv: module.common.config_digest(module.run_config(module.parse_args(argv)))
  assert digest([]) == digest(["--ckpt-dir", "none", "--eval-every", "7"])
  for flag in (["--seed", "5"], ["--lr", "0.1"], ["--dim", "32"]):
    assert digest(flag) != digest([]), flag


def common_digest(train_lm, argv):
  """The digest `train_lm` keys its checkpoints by, for these flags."""
  args = train_lm.parse_args(argv)
  return train_lm.common.config_digest(train_lm.run_config(args))


TRAIN_LM_TINY = ["--seq-len", "32", "--local", "8", "--dim", "16", "--layers", "1", "--heads",
                 "2", "--kv-heads", "1", "--batch", "4", "--steps", "1", "--eval-every", "1"]


def test_train_lm_digests_its_flags(examples):
  """The digest that names a run's checkpoint folder changes with each flag of the run."""
  import train_lm  # pylint: disable=import-outside-toplevel
  digest = common_digest(train_lm, TRAIN_LM_TINY)
  assert digest == common_digest(train_lm, list(TRAIN_LM_TINY))
  for flag in (["--seed", "1"], ["--lr", "1e-3"], ["--dim", "32"]):
    assert common_digest(train_lm, TRAIN_LM_TINY + flag) != digest, flag


@pytest.mark.slow  # ~17 s (two models' first step, compile-bound); its digest: the test above
def test_train_lm_keys_checkpoints_by_its_flags(examples, tmp_path, capsys):
  """Another --seed (or --lr, --dim) never resumes this run's checkpoint: each configuration
  has its own folder, and the run says in one line that others exist."""
  import train_lm  # pylint: disable=import-outside-toplevel
  tiny = TRAIN_LM_TINY + ["--ckpt-dir", str(tmp_path)]
  for name in ("dilated", "local_only"):  # checkpoints of other flags (their folders)
    (tmp_path / f"{name}-0123456789").mkdir()
  train_lm.main(tiny)
  out = capsys.readouterr()
  said = out.out + out.err
  assert "resumed" not in said and said.count("holds checkpoints of other flags") == 2
  ours = sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith("-0123456789"))
  assert len(ours) == 2 and all(len(name.rsplit("-", 1)[1]) == 10 for name in ours)


def test_quickstart(monkeypatch):
  """README's first command at a smaller size (its default grid of 64 x 64 takes ~25 s on
  one CPU core): the check against the dense reference, then the timed passes. (It needs
  none of the examples' extras.)"""
  monkeypatch.syspath_prepend(str(EXAMPLES))
  import quickstart  # pylint: disable=import-outside-toplevel
  result = quickstart.main(["--grid", "8", "--large-grid", "8", "--runs", "1"])
  assert result["max_abs_error"] < 1e-5
  assert [r[0] for r in result["rows"]] == ["forward", "forward+backward", "dense reference"]
  assert all(math.isfinite(x) and x > 0 for r in result["rows"] for x in r[1:])


def test_generate(examples):
  """`generate.py` at a tiny size: a cached decode (prefill, then a scan of one-token steps)
  and recomputation give the same tokens and logits. (Its blocks recompute their norms with
  `nnx.remat`; with the parameters captured by the scans' bodies instead of carried, Flax
  0.12.12 refused them.)"""
  import generate  # pylint: disable=import-outside-toplevel
  result = generate.main(["--steps", "2", "--runs", "1", "--prompt", "16", "--new", "8",
                          "--batch", "4", "--dim", "32", "--layers", "1", "--gen-batch", "2"])
  assert result["tokens_identical"] and result["max_logit_diff"] < 1e-4
  assert result["new_tokens"] == 8 and finite(result["cached_tokens_per_s"])
