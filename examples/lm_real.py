"""Byte-level language models on the Python standard library's source: dilated vs full vs local.

The data needs no download: every Python installation ships its standard library as source.
The `*.py` files under `sysconfig.get_paths()["stdlib"]` (third-party `site-packages` and
`dist-packages` left out), sorted by path, are split by file into training and held-out sets
with a fixed seed (`--split-seed`, `--heldout-fraction`); each set is the files' bytes joined
by NUL bytes. The split (file counts, the held-out file list and SHA-256 digests of both lists
and both byte streams) is recorded in the output JSON. Python versions ship different files,
so compare figures only between runs with the same digests.

Three decoder-only transformers, identical but for their attention, are trained with the same
initial parameters (same seed), data order, steps and optimizer (AdamW, warmup and cosine
decay):
  dilated  LongNet-style causal dilated attention (`--segments` x `--rates`; the library's
           `DilatedMultiHeadAttention`), each branch in its own group of heads
           (`--head-groups`, on by default; `--no-head-groups`: every head all branches,
           mixed by their softmax denominators),
  full     causal full attention: `jax.nn.dot_product_attention` in `flax.nnx.MultiHeadAttention`
           (cuDNN on a GPU where it runs, XLA elsewhere; `--full-impl ours` runs this
           library's kernels with a single full causal branch instead),
  local    the dilated pattern's first branch alone (attention within segments of
           `--segments[0]` bytes).
Each trains on windows of `--seq-len` bytes at random offsets of the training stream (the
same windows for every model) and is evaluated on fixed windows of the held-out stream.

Reported per model (table, and `lm_real.json` in `--out-dir`): held-out bits per byte, also
by position in the window (buckets doubling up to `--seq-len`: does the model use distant
context?), training tokens/s in the steady state (compile and first step excluded), model
FLOPs per training step (`6 x` the matmul parameters per token plus `12 x head_dim` per
visible (query, key, head) triple, each counted once) and, on a GPU, the fraction of the
H100's dense bf16 peak (989.4 TFLOP/s) the step reaches, the device's peak memory and the
compiled step's memory plan. `lm_real.png` shows the loss curves and the bits per byte by
position. An Orbax checkpoint per model and configuration goes to `--ckpt-dir`; a run started
again resumes from it (or only re-evaluates a finished run).

The device's peak memory is a high-water mark of the whole process: run one model per process
(`--models dilated`, then `--models full`, ... with the same `--out-dir`; results with the
same configuration are merged into one JSON and plot) to read each model's own peak.

CPU default (about two minutes on two cores): 512-byte windows, a 2-layer d=64 model, 80
steps. `--preset gpu`: 8192-byte windows, segments (512, 2048, 8192) x rates (1, 1, 4) in
head groups (two of the six heads each: a 512-byte and a 2048-byte window, every fourth byte
of 8192), an 8-layer d=768 model, bf16 compute, 600 steps of 8 windows. Any flag overrides
the preset. The local model is the first branch in every head; a wider one for comparison:
`--models local --segments 2048,8192 --rates 1,4`.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import math
import sysconfig
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import common
from hilbert_ring_jax import DilatedMultiHeadAttention, DilatedPattern
from hilbert_ring_jax.layers_common import rotate

MODELS = ("dilated", "full", "local")
FULL_IMPLS = ("auto", "cudnn", "xla", "ours")
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
PRESETS = {
    "cpu": dict(seq_len=512, segments="32,128,512", rates="1,1,4", dim=64, layers=2, heads=4,
                kv_heads=2, batch=8, steps=80, lr=3e-3, eval_every=20, eval_windows=64,
                dtype="float32", rotary_base=10000.0, head_groups=True),
    "gpu": dict(seq_len=8192, segments="512,2048,8192", rates="1,1,4", dim=768, layers=8,
                heads=6, kv_heads=2, batch=8, steps=600, lr=8e-4, eval_every=250,
                eval_windows=128, dtype="bfloat16", rotary_base=10000.0, head_groups=True),
}
SEPARATOR = b"\0"  # between files; NUL does not occur in the standard library's source


# ----------------------------------------------------------------------------------- data


def stdlib_files(root: Path | None = None) -> tuple[Path, list[str]]:
  """The standard library's `*.py` files as sorted POSIX paths relative to its root."""
  root = Path(sysconfig.get_paths()["stdlib"]) if root is None else Path(root)
  skip = {"site-packages", "dist-packages", "__pycache__"}
  files = sorted(p.relative_to(root).as_posix() for p in root.rglob("*.py")
                 if p.is_file() and not skip & set(p.relative_to(root).parts))
  if not files:
    raise ValueError(f"no *.py files under the standard library path {root}")
  return root, files


@functools.lru_cache(maxsize=2)
def load_corpus(heldout_fraction: float, split_seed: int, root: Path | None = None) -> dict:
  """The training and held-out byte streams (uint8, read-only) and a record of the split.

  Files are assigned by a permutation drawn from `split_seed`: the first
  `round(heldout_fraction * files)` (at least one) are held out. Cached: a second run in the
  process reads nothing.
  """
  root, files = stdlib_files(root)
  order = np.random.default_rng(split_seed).permutation(len(files))
  n_held = max(1, round(heldout_fraction * len(files)))
  if n_held >= len(files):
    raise ValueError(f"--heldout-fraction {heldout_fraction} leaves no training file "
                     f"({len(files)} files)")
  held = sorted(files[i] for i in order[:n_held])
  train = sorted(files[i] for i in order[n_held:])

  def stream(names):
    data = SEPARATOR.join((root / name).read_bytes() for name in names)
    return np.frombuffer(data, np.uint8), hashlib.sha256(data).hexdigest()

  train_bytes, train_sha = stream(train)
  held_bytes, held_sha = stream(held)
  digest = lambda names: hashlib.sha256("\n".join(names).encode()).hexdigest()
  split = {"stdlib": str(root), "files": len(files), "train_files": len(train),
           "heldout_files": len(held), "train_bytes": int(train_bytes.size),
           "heldout_bytes": int(held_bytes.size), "split_seed": split_seed,
           "heldout_fraction": heldout_fraction, "train_list_sha256": digest(train),
           "heldout_list_sha256": digest(held), "train_bytes_sha256": train_sha,
           "heldout_bytes_sha256": held_sha, "heldout_list": held}
  return {"train": train_bytes, "heldout": held_bytes, "split": split}


def train_batch(data: np.ndarray, seq_len: int, batch: int, seed: int, step: int):
  """`(tokens, targets)`, `[batch, seq_len]` int32: windows at offsets drawn from
  `(seed, step)`, so every model (and a resumed run) sees the same windows."""
  starts = np.random.default_rng([seed, step]).integers(0, data.size - seq_len, batch)
  windows = data[starts[:, None] + np.arange(seq_len + 1)].astype(np.int32)
  return jnp.asarray(windows[:, :-1]), jnp.asarray(windows[:, 1:])


def heldout_batches(data: np.ndarray, seq_len: int, windows: int, batch: int) -> list:
  """Up to `windows` windows spread evenly over the held-out stream, in batches of `batch`."""
  count = min(windows, (data.size - 1) // seq_len)
  if count < 1:
    raise ValueError(f"the held-out stream ({data.size} bytes) is shorter than --seq-len "
                     f"{seq_len}: raise --heldout-fraction")
  starts = np.linspace(0, data.size - seq_len - 1, count).astype(np.int64)
  windows = data[starts[:, None] + np.arange(seq_len + 1)].astype(np.int32)
  return [(jnp.asarray(windows[i:i + batch, :-1]), jnp.asarray(windows[i:i + batch, 1:]))
          for i in range(0, count, batch)]


# ---------------------------------------------------------------------------------- models


def full_attention_fn(implementation: str, rotary_base: float | None = None):
  """An `attention_fn` for `nnx.MultiHeadAttention`: causal `jax.nn.dot_product_attention`,
  queries and keys turned by the library's rotary embedding first (as the dilated layer does
  with the same `rotary_base`)."""

  def attention_fn(query, key, value, bias=None, mask=None, **unused):
    del unused  # dropout is off; dtype and precision are the projections' business
    if bias is not None or mask is not None:
      raise ValueError("full_attention_fn is causal self-attention: no mask or bias")
    query, key = rotate(query, key, rotary_base, jnp.arange(query.shape[-3]))
    return jax.nn.dot_product_attention(query, key, value, is_causal=True,
                                        implementation=implementation)

  return attention_fn


def cudnn_runs(batch: int, seq_len: int, heads: int, kv_heads: int, head_dim: int,
               dtype) -> str | None:
  """None if cuDNN's causal attention compiles and runs forward and backward for these
  shapes on this machine, else why not."""
  if jax.default_backend() != "gpu":
    return f"no GPU (platform {jax.default_backend()})"
  try:
    q = jnp.zeros((batch, seq_len, heads, head_dim), dtype)
    k = jnp.zeros((batch, seq_len, kv_heads, head_dim), dtype)
    fn = full_attention_fn("cudnn")
    loss = lambda q, k, v: fn(q, k, v).astype(jnp.float32).sum()
    jax.block_until_ready(jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, k))
  except Exception as e:  # pylint: disable=broad-except  # cuDNN says no in many ways
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
  return None


def attention_spec(name: str, args, full_impl: str) -> tuple[DilatedPattern, str | None]:
  """The causal pattern a model's attention computes (full: one branch over the window) and,
  for the full model through `jax.nn.dot_product_attention`, its implementation."""
  if name == "dilated":
    return DilatedPattern(args.segments, args.rates, causal=True, offsets="all",
                          head_groups=args.head_groups), None
  if name == "local":
    return DilatedPattern(args.segments[:1], (1,), causal=True), None
  pattern = DilatedPattern((args.seq_len,), (1,), causal=True)
  return pattern, (None if full_impl == "ours" else full_impl)


def build_model(name: str, args, full_impl: str, seed: int) -> tuple[nnx.Module, DilatedPattern]:
  pattern, sdpa = attention_spec(name, args, full_impl)
  dtype = DTYPES[args.dtype]
  rotary = args.rotary_base or None  # 0: learned absolute positions instead
  if sdpa is None:
    # offsets="all": every head reads every residue class (the rates exceed the head count).
    attention = lambda rngs: DilatedMultiHeadAttention(
        args.heads, args.dim, num_kv_heads=args.kv_heads, pattern=pattern, dtype=dtype,
        implementation=args.impl, rotary_base=rotary, rngs=rngs)
  else:
    # Same parameter layout and, from the same seed, the same initial values.
    attention = lambda rngs: nnx.MultiHeadAttention(
        args.heads, args.dim, num_kv_heads=args.kv_heads,
        attention_fn=full_attention_fn(sdpa, rotary),
        decode=False, dtype=dtype, rngs=rngs)
  model = common.SequenceModel(256, args.dim, args.layers, attention, out=256,
                               positions=None if rotary else args.seq_len, dtype=dtype,
                               remat=args.remat,
                               rngs=nnx.Rngs(seed))
  return model, pattern


def loss_fn(model, batch):
  """Mean next-byte cross-entropy (nats) and accuracy."""
  tokens, targets = batch
  return common.masked_xent(model(tokens), targets, jnp.ones(targets.shape, jnp.float32))


@nnx.jit
def position_nats(model, tokens, targets):
  """`[B, N]` float32 cross-entropy of each position."""
  logits = model(tokens).astype(jnp.float32)
  return -jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None], -1)[..., 0]


def bucket_edges(seq_len: int, local: int) -> list[int]:
  """Position buckets `[e_k, e_k+1)` doubling from `local / 8` up to the window."""
  edges, e = [0], max(local // 8, 1)
  while e < seq_len:
    edges.append(e)
    e *= 2
  return edges + [seq_len]


def heldout_bits(model, batches, edges) -> dict:
  """Held-out bits per byte, overall and per position bucket."""
  nats = np.concatenate([np.asarray(position_nats(model, t, y)) for t, y in batches])
  per_position = nats.mean(axis=0) / math.log(2)
  return {"bpb": float(nats.mean() / math.log(2)), "windows": int(nats.shape[0]),
          "position_edges": edges,
          "bpb_by_position": [float(per_position[a:b].mean()) for a, b in zip(edges, edges[1:])]}


# -------------------------------------------------------------------------------- the run


def parse_args(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu",
                      help="sizes; flags given override it (default: cpu)")
  parser.add_argument("--models", default=",".join(MODELS),
                      help=f"comma-separated subset of {', '.join(MODELS)} (default: all)")
  parser.add_argument("--seq-len", type=int, help="context window in bytes")
  parser.add_argument("--segments", help="dilated segment lengths, comma-separated; the "
                      "first is the local model's segment")
  parser.add_argument("--rates", help="dilation rates, comma-separated")
  parser.add_argument("--head-groups", action=argparse.BooleanOptionalAction,
                      help="the dilated model gives each branch its own contiguous group of "
                      "heads (`DilatedPattern(head_groups=True)`) instead of every head all "
                      "branches (default: on in both presets)")
  parser.add_argument("--dim", type=int)
  parser.add_argument("--layers", type=int)
  parser.add_argument("--heads", type=int)
  parser.add_argument("--kv-heads", type=int)
  parser.add_argument("--batch", type=int, help="windows per step")
  parser.add_argument("--steps", type=int)
  parser.add_argument("--lr", type=float)
  parser.add_argument("--eval-every", type=int)
  parser.add_argument("--eval-windows", type=int, help="held-out windows evaluated")
  parser.add_argument("--dtype", choices=sorted(DTYPES), help="computation dtype")
  parser.add_argument("--rotary-base", type=float, help="rotary position embedding of queries "
                      "and keys with this base in every model; 0: a learned absolute position "
                      "embedding at the input instead (default 10000)")
  parser.add_argument("--remat", action="store_true",
                      help="recompute activations in the backward (less memory; model FLOPs "
                      "and their fraction of the peak do not count the recomputation)")
  parser.add_argument("--impl", default=None,
                      help="backend of the dilated attention: xla | pallas | triton | mosaic "
                      "(default: the fastest that runs; mosaic on Hopper)")
  parser.add_argument("--full-impl", choices=FULL_IMPLS, default="auto",
                      help="full attention: cudnn or xla (jax.nn.dot_product_attention), or "
                      "ours (this library, one full branch); auto: cudnn where it runs on a "
                      "GPU, else ours on a GPU and xla on a CPU")
  parser.add_argument("--seeds", default="0", help="comma-separated seeds (init and data "
                      "order); several give a spread")
  parser.add_argument("--split-seed", type=int, default=0)
  parser.add_argument("--heldout-fraction", type=float, default=0.05)
  parser.add_argument("--out-dir", type=Path, default=Path("out/lm_real"))
  parser.add_argument("--ckpt-dir", type=Path, default=None,
                      help="default: <out-dir>/ckpt; 'none' keeps no checkpoint")
  args = parser.parse_args(argv)
  for key, val in PRESETS[args.preset].items():
    if getattr(args, key) is None:
      setattr(args, key, val)
  return args


def int_list(flag: str, text: str) -> tuple[int, ...]:
  try:
    values = tuple(int(x) for x in str(text).split(","))
  except ValueError:
    raise ValueError(f"{flag} must be comma-separated integers, got {text!r}") from None
  return values


def check_args(args) -> None:
  """`ValueError` naming the flag for every inconsistent setting."""
  common.check_positive(args, "seq_len", "dim", "layers", "heads", "kv_heads", "batch",
                        "steps", "lr", "eval_every", "eval_windows")
  if not (args.rotary_base == 0 or args.rotary_base > 1):
    raise ValueError(f"--rotary-base must be 0 (learned positions) or > 1, got "
                     f"{args.rotary_base}")
  args.segments = int_list("--segments", args.segments)
  args.rates = int_list("--rates", args.rates)
  args.seeds = int_list("--seeds", args.seeds)
  args.models = tuple(m.strip() for m in args.models.split(","))
  if not args.models or set(args.models) - set(MODELS) or len(set(args.models)) < len(args.models):
    raise ValueError(f"--models must be distinct names from {MODELS}, got {args.models}")
  if len(args.segments) != len(args.rates):
    raise ValueError(f"--segments {args.segments} and --rates {args.rates} must have the same "
                     f"length")
  if list(args.segments) != sorted(set(args.segments)) or args.segments[-1] > args.seq_len:
    raise ValueError(f"--segments must increase and end at most at --seq-len {args.seq_len}, "
                     f"got {args.segments}")
  if args.rates[0] != 1:
    raise ValueError(f"--rates must start with 1 (the local branch), got {args.rates}")
  DilatedPattern(args.segments, args.rates, causal=True, offsets="all")  # ValueError if bad
  if args.head_groups and args.heads < len(args.segments):
    raise ValueError(f"--head-groups needs a head per branch: --heads {args.heads} < "
                     f"{len(args.segments)} branches")
  if not 0.0 < args.heldout_fraction < 1.0:
    raise ValueError(f"--heldout-fraction must be in (0, 1), got {args.heldout_fraction}")
  common.check_model_args(args)


def resolve_full_impl(args) -> tuple[str, str | None]:
  """The full model's implementation and, when auto could not use cuDNN, why (probed only
  when the full model runs)."""
  if args.full_impl != "auto" or "full" not in args.models:
    return args.full_impl, None
  if jax.default_backend() != "gpu":
    return "xla", None
  why = cudnn_runs(1, args.seq_len, args.heads, args.kv_heads, args.dim // args.heads,
                   DTYPES[args.dtype])
  return ("cudnn", None) if why is None else ("ours", why)


def run_config(args, split: dict) -> dict:
  """What decides the results: runs of one configuration merge into one JSON, and a change of
  any entry names a new checkpoint folder (the full model's also names its implementation)."""
  keys = ("seq_len", "segments", "rates", "dim", "layers", "heads", "kv_heads", "batch",
          "steps", "lr", "eval_every", "eval_windows", "dtype", "rotary_base", "remat", "impl",
          "head_groups", "split_seed", "heldout_fraction")
  config = {k: list(v) if isinstance(v, tuple) else v for k in keys
            for v in [getattr(args, k)]}  # as JSON reads back: lists
  config["data_sha256"] = split["train_bytes_sha256"][:16] + split["heldout_bytes_sha256"][:16]
  return config


def train_one(name: str, seed: int, args, full_impl: str, corpus: dict, config: dict,
              eval_batches: list, edges: list[int], why: str | None = None) -> dict:
  model, pattern = build_model(name, args, full_impl, seed)
  ckpt = common.checkpoint_dir(args.ckpt_dir, f"{name}-seed{seed}",
                               {**config, "full_impl": full_impl} if name == "full" else config)
  train = corpus["train"]
  history = common.train(
      model, loss_fn, lambda step: train_batch(train, args.seq_len, args.batch, seed, step),
      steps=args.steps, lr=args.lr, eval_batch=eval_batches, eval_every=args.eval_every,
      ckpt_dir=ckpt, desc=f"{name} (seed {seed})")
  t = time.perf_counter()
  bits = heldout_bits(model, eval_batches, edges)
  eval_seconds = time.perf_counter() - t
  head_dim = args.dim // args.heads
  pairs = pattern.visible_pairs(args.seq_len, args.heads, distinct=True)
  flops = common.train_step_flops(model, batch=args.batch, seq_len=args.seq_len,
                                  attention_pairs=pairs, head_dim=head_dim, layers=args.layers)
  step_s = history["step_seconds"]
  on_gpu = jax.default_backend() == "gpu"
  if name == "full":
    attention = (f"full causal, jax.nn.dot_product_attention({full_impl})"
                 if full_impl != "ours" else "full causal, hilbert_ring_jax (one branch)")
  else:
    attention = (f"{name}: segments {pattern.segment_lengths} x rates "
                 f"{pattern.dilation_rates}, causal, offsets={pattern.offsets}"
                 + (", head groups" if pattern.head_groups else ""))
  ln2 = math.log(2)
  return {
      "model": name, "seed": seed, "attention": attention,
      "device_kind": jax.devices()[0].device_kind,
      "full_impl_note": why if name == "full" else None,
      "params": common.count_params(model), "matmul_params": common.matmul_params(model),
      "steps": history["step"][-1] if history["step"] else 0,
      "heldout_bpb": bits["bpb"], "heldout_windows": bits["windows"],
      "position_edges": bits["position_edges"], "bpb_by_position": bits["bpb_by_position"],
      "tokens_per_s": args.batch * args.seq_len / step_s if step_s else None,
      "step_seconds": step_s, "compile_seconds": history["compile_seconds"],
      "train_seconds": history["seconds"], "eval_seconds": eval_seconds,
      "attention_pairs_per_layer": pairs, "model_flops_per_step": flops,
      "model_tflops_per_s": flops / step_s / 1e12 if step_s else None,
      "fraction_of_h100_bf16_peak": (flops / step_s / common.H100_BF16_PEAK
                                     if step_s and on_gpu else None),
      "peak_memory_bytes": common.peak_memory_bytes(), "step_memory_plan": history["memory"],
      "curves": {"step": list(range(1, len(history["loss"]) + 1)),
                 "train_bpb": [x / ln2 for x in history["loss"]],
                 "eval_step": history["step"],
                 "eval_bpb": [x / ln2 for x in history["eval_loss"]],
                 "eval_next_byte_accuracy": history["eval_acc"]},
  }


def summarize(runs: list[dict]) -> dict:
  """Per model: mean and spread (sample std) over seeds of bpb and tokens/s; and the ratios
  the issue's goals are stated in."""
  out = {}
  for name in MODELS:
    mine = [r for r in runs if r["model"] == name]
    if not mine:
      continue
    bpb = [r["heldout_bpb"] for r in mine]
    tps = [r["tokens_per_s"] for r in mine if r["tokens_per_s"]]
    mean, std = common.mean_std(bpb)
    out[name] = {"seeds": [r["seed"] for r in mine], "heldout_bpb": bpb,
                 "heldout_bpb_mean": mean, "heldout_bpb_std": std,
                 "tokens_per_s_mean": common.mean_std(tps)[0] if tps else None}
  if "dilated" in out and "full" in out:
    d, f = out["dilated"], out["full"]
    out["dilated_bpb_over_full"] = d["heldout_bpb_mean"] / f["heldout_bpb_mean"]
    if d["tokens_per_s_mean"] and f["tokens_per_s_mean"]:
      out["dilated_tokens_per_s_over_full"] = d["tokens_per_s_mean"] / f["tokens_per_s_mean"]
  if "dilated" in out and "local" in out:
    out["local_minus_dilated_bpb"] = (out["local"]["heldout_bpb_mean"]
                                      - out["dilated"]["heldout_bpb_mean"])
  return out


def plot(path: Path, runs: list[dict]) -> bool:
  plt = common.pyplot()
  if plt is None:
    return False
  fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.8))
  colors = {"dilated": "C0", "full": "C1", "local": "C2"}
  for r in runs:
    c = r["curves"]
    window = max(1, len(c["step"]) // 50)  # a running mean over ~2% of the steps
    smooth = np.convolve(c["train_bpb"], np.ones(window) / window, mode="valid")
    label = f"{r['model']} (seed {r['seed']})"
    ax1.plot(c["step"][window - 1:], smooth, color=colors[r["model"]], alpha=0.6, label=label)
    ax1.plot(c["eval_step"], c["eval_bpb"], "o", color=colors[r["model"]], ms=4)
    edges = r["position_edges"]
    mids = [max(a, 0.5) * 0.5 + b * 0.5 for a, b in zip(edges, edges[1:])]
    ax2.plot(mids, r["bpb_by_position"], "o-", color=colors[r["model"]], label=label)
  ax1.set(xlabel="step", ylabel="bits per byte",
          title="training (lines, running mean) and held-out (dots)")
  ax1.legend()
  ax2.set(xscale="log", xlabel="position in the window (bucket centres)",
          ylabel="held-out bits per byte", title="does the model use distant context?")
  ax2.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)
  return True


def main(argv=None) -> dict:
  """Runs the comparison; returns what it writes to `<out-dir>/lm_real.json`."""
  args = parse_args(argv)
  check_args(args)
  corpus = load_corpus(args.heldout_fraction, args.split_seed)
  split = corpus["split"]
  if split["train_bytes"] <= args.seq_len:
    raise ValueError(f"--seq-len {args.seq_len} exceeds the training stream")
  full_impl, why = resolve_full_impl(args)
  info = common.device_info()
  print(f"JAX {info['jax']} on {info['platform']} ({info['device_kind']}), Python "
        f"{info['python']}; {split['train_files']} training files ({split['train_bytes']} "
        f"bytes), {split['heldout_files']} held out ({split['heldout_bytes']} bytes); "
        f"context {args.seq_len}"
        + (f", full attention: {full_impl}" if "full" in args.models else "")
        + (f" (cuDNN declined: {why})" if why else ""))
  config = run_config(args, split)
  eval_batches = heldout_batches(corpus["heldout"], args.seq_len, args.eval_windows, args.batch)
  edges = bucket_edges(args.seq_len, args.segments[0])

  out_json = args.out_dir / "lm_real.json"
  runs = []
  if out_json.exists():  # earlier runs of this configuration (one model per process)
    old = json.loads(out_json.read_text())
    if old.get("config") == config and old.get("device") == info:
      runs = [r for r in old["runs"]
              if not (r["model"] in args.models and r["seed"] in args.seeds)]
  for seed in args.seeds:
    for name in args.models:
      runs.append(train_one(name, seed, args, full_impl, corpus, config, eval_batches, edges,
                            why))
  runs.sort(key=lambda r: (MODELS.index(r["model"]), r["seed"]))
  result = {"config": config, "device": info, "data": split, "runs": runs,
            "summary": summarize(runs)}
  common.write_json(out_json, result)
  png = args.out_dir / "lm_real.png"
  plotted = plot(png, runs)

  rows = []
  for r in runs:
    mem = r["peak_memory_bytes"] or (r["step_memory_plan"] or {}).get("total_bytes")
    rows.append([r["model"], r["seed"], r["params"], r["steps"], r["heldout_bpb"],
                 f"{r['tokens_per_s']:.0f}" if r["tokens_per_s"] else "-",
                 f"{r['model_flops_per_step'] / 1e9:.1f}",
                 f"{100 * r['fraction_of_h100_bf16_peak']:.1f}%"
                 if r["fraction_of_h100_bf16_peak"] else "-",
                 f"{mem / 2**30:.2f}" if mem else "-"])
  print()
  print(common.table(["model", "seed", "params", "steps", "held-out bpb", "tokens/s",
                      "GFLOP/step", "of H100 bf16 peak", "memory GiB"], rows))
  print("memory: the device's peak where it keeps one, else the compiled step's buffers")
  print("held-out bits per byte by position (bucket start):")
  for r in runs:
    print(f"  {r['model']:8} seed {r['seed']}: " + " ".join(
        f"{a}:{b:.2f}" for a, b in zip(r["position_edges"], r["bpb_by_position"])))
  print(f"\nresults: {out_json}" + (f"\nplot: {png}" if plotted else ""))
  return result


if __name__ == "__main__":
  main()
