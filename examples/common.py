"""What the training examples share: models, a resumable optax loop, measurements, output.

`train` trains an `nnx.Module` functionally (split once into a graph definition and its
parameters, one jitted step compiled ahead of the loop), shows a progress bar, evaluates every
`eval_every` steps and keeps the latest state plus the metric history in an Orbax
`CheckpointManager`, so a run started again with the same `ckpt_dir` resumes where it stopped
(or just re-evaluates). It also times the steady-state step (the compile and the first step
left out) and records the compiled step's memory plan.

`SequenceModel` is the transformer both the language models and the pixel models are built
from: the caller passes the attention layer, so models that differ only in attention (or in
the attention's token order) are otherwise built, initialized and trained identically.

The optional packages degrade gracefully: without tqdm there is a plain progress line per
evaluation, without Orbax no checkpoint, without matplotlib no plot; each says once what it
skipped.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import re
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import optax
from flax import nnx

try:
  from tqdm import tqdm
except ImportError:  # optional: a plain line per evaluation instead of a bar
  tqdm = None
try:
  import orbax.checkpoint as ocp
except ImportError:  # optional: no checkpoint
  ocp = None

# NVIDIA H100 SXM, dense bf16 tensor-core peak (without sparsity), in FLOP/s.
H100_BF16_PEAK = 989.4e12

_said = set()


def log(msg: str) -> None:
  """Prints without breaking a tqdm bar."""
  if tqdm is not None:
    tqdm.write(msg)
  else:
    print(msg, flush=True)


def skipped(package: str, what: str) -> None:
  """Says once that an optional package is missing and what is skipped without it."""
  if package not in _said:
    _said.add(package)
    log(f"[{package} is not installed: {what}]")


class _Progress:
  """The part of tqdm's interface `train` uses, printing one line per `set_postfix`."""

  def __init__(self, iterable, desc: str, total: int):
    self.iterable, self.desc, self.total = iterable, desc, total
    self.n = 0

  def __iter__(self):
    for item in self.iterable:
      self.n = item + 1  # steps done once the loop body has run
      yield item

  def set_postfix(self, **values):
    print(f"{self.desc}: step {self.n}/{self.total} "
          + " ".join(f"{k}={v}" for k, v in values.items()), flush=True)

  def close(self):
    pass


def progress(start: int, steps: int, desc: str):
  """A tqdm bar over `range(start, steps)`, or a plain line per evaluation without tqdm."""
  if tqdm is None:
    skipped("tqdm", "no progress bar, a line per evaluation instead")
    return _Progress(range(start, steps), desc, steps)
  return tqdm(range(start, steps), desc=desc, initial=start, total=steps, dynamic_ncols=True,
              file=sys.stdout)


def pyplot():
  """`matplotlib.pyplot` on the Agg backend, or None (said once) when matplotlib is missing."""
  try:
    import matplotlib  # pylint: disable=import-outside-toplevel
  except ImportError:
    skipped("matplotlib", "no PNG plot")
    return None
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  return plt


def adamw(lr: float, steps: int) -> optax.GradientTransformation:
  warmup = min(100, steps // 10)
  schedule = optax.warmup_cosine_decay_schedule(0.0, lr, warmup, max(steps, warmup + 1),
                                                end_value=lr / 10)
  return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=0.01))


def masked_xent(logits, labels, mask):
  """Mean cross-entropy and accuracy over the positions where `mask` is set."""
  with jax.named_scope("loss"):
    losses = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), labels)
    hits = jnp.argmax(logits, axis=-1) == labels
    count = jnp.maximum(jnp.sum(mask), 1)
    return jnp.sum(losses * mask) / count, jnp.sum(hits * mask) / count


class Block(nnx.Module):
  """Pre-norm transformer block: the given self-attention layer and a GELU MLP (4x wide)."""

  def __init__(self, dim: int, attention: Callable[[nnx.Rngs], nnx.Module], *, norm=nnx.RMSNorm,
               dtype=None, rngs: nnx.Rngs):
    self.norm1 = norm(dim, dtype=dtype, rngs=rngs)
    self.attn = attention(rngs)
    self.norm2 = norm(dim, dtype=dtype, rngs=rngs)
    self.up = nnx.Linear(dim, 4 * dim, dtype=dtype, rngs=rngs)
    self.down = nnx.Linear(4 * dim, dim, dtype=dtype, rngs=rngs)

  def __call__(self, x, **attn_kwargs):
    """`attn_kwargs` go to the attention layer (e.g. `prefill=True` when decoding)."""
    with jax.named_scope("attention"):  # names the ops in profiles (benchmarks/profile_step.py)
      x = x + self.attn(_recomputed(self.norm1, x), **attn_kwargs)
    with jax.named_scope("mlp"):
      return x + self.down(self._up_gelu(_recomputed(self.norm2, x)))

  def _up_gelu(self, x):
    """`gelu(self.up(x))`, the GELU recomputed in the backward pass from the matmul's output."""
    up = self.up
    x, kernel, bias = up.promote_dtype((x, up.kernel[...], up.bias[...]), dtype=up.dtype)
    return _bias_gelu(jnp.dot(x, kernel, precision=up.precision), bias)


# The norms and the GELU are memory-bound: the backward pass recomputes them from their inputs
# (which the matmuls keep anyway) instead of keeping their intermediates (the GELU's: five
# arrays of the MLP's width; the norms': float32 copies), which writes and reads less memory
# (examples/lm_real.py --preset gpu on an H100: faster steps, docs/performance.md).
_recomputed = nnx.remat(lambda module, x: module(x))
_bias_gelu = jax.checkpoint(lambda y, bias: nnx.gelu(y + bias))


_ONE_HOT_VOCAB = 1024  # token inputs from vocabularies up to this size embed by a matmul


class SequenceModel(nnx.Module):
  """Input embedding (+ learned positions), `layers` blocks, a final norm and a linear head.

  Args:
    vocab: input token types (integer inputs `[B, N]`, embedded by a table); None for
      real-valued inputs `[B, N, in_features]`, embedded by a linear layer.
    dim: model width.
    layers: number of `Block`s.
    attention: `rngs -> module`, called once per block: the self-attention layer
      (`[B, N, dim] -> [B, N, dim]`), e.g. a `DilatedMultiHeadAttention`.
    out: output features of the head (classes, or the vocabulary of a language model).
    in_features: input features when `vocab` is None.
    positions: learned absolute position embeddings for this many positions (None: none).
    norm: the normalization layer class (`nnx.RMSNorm`, `nnx.LayerNorm`).
    pool: average the tokens before the head (one prediction per sequence) instead of one
      per token.
    dtype: computation dtype (parameters stay float32), e.g. `jnp.bfloat16`.
    remat: recompute each block's activations in the backward pass instead of keeping them
      (`nnx.remat`): less memory, about a third more compute.
  """

  def __init__(self, vocab: int | None, dim: int, layers: int,
               attention: Callable[[nnx.Rngs], nnx.Module], *, out: int,
               in_features: int | None = None, positions: int | None = None,
               norm=nnx.RMSNorm, pool: bool = False, dtype=None, remat: bool = False,
               rngs: nnx.Rngs):
    if (vocab is None) == (in_features is None):
      raise ValueError(f"give vocab (token inputs) or in_features (real-valued inputs), not "
                       f"both or neither: got {vocab=}, {in_features=}")
    self.dtype, self.pool, self.remat = dtype, pool, remat
    self.embed = (nnx.Embed(vocab, dim, dtype=dtype, rngs=rngs) if vocab is not None else
                  nnx.Linear(in_features, dim, dtype=dtype, rngs=rngs))
    self.pos = (nnx.Param(0.02 * jax.random.normal(rngs.params(), (positions, dim)))
                if positions else nnx.data(None))
    self.blocks = nnx.List([Block(dim, attention, norm=norm, dtype=dtype, rngs=rngs)
                            for _ in range(layers)])
    self.norm = norm(dim, dtype=dtype, rngs=rngs)
    self.head = nnx.Linear(dim, out, dtype=dtype, rngs=rngs)

  def __call__(self, inputs, **attn_kwargs):
    with jax.named_scope("embed"):
      x = self._embed(inputs)
    for block in self.blocks:
      call = lambda block, x: block(x, **attn_kwargs)
      x = nnx.remat(call)(block, x) if self.remat else call(block, x)
    with jax.named_scope("head"):
      x = self.norm(x)
      return self.head(jnp.mean(x, axis=1) if self.pool else x)

  def _embed(self, inputs):
    if isinstance(self.embed, nnx.Embed) and self.embed.num_embeddings <= _ONE_HOT_VOCAB:
      # A one-hot matmul, not a gather: the gather's gradient is a scatter-add, which on a
      # GPU serializes on repeated tokens (text: measured 35 ms more per training step of
      # examples/lm_real.py --preset gpu than for uniform tokens).
      table = self.embed.embedding[...].astype(self.dtype or self.embed.embedding.dtype)
      x = jax.nn.one_hot(inputs, self.embed.num_embeddings, dtype=table.dtype) @ table
    else:
      x = self.embed(inputs)
    if self.pos is not None:
      x = x + self.pos[:inputs.shape[1]].astype(x.dtype)
    return x


def _checkpoint_manager(ckpt_dir):
  if ckpt_dir is None:
    return None
  if ocp is None:
    skipped("orbax-checkpoint", "no checkpoint is kept")
    return None
  return ocp.CheckpointManager(Path(ckpt_dir).absolute(),
                               options=ocp.CheckpointManagerOptions(max_to_keep=1))


def _memory_plan(compiled) -> dict | None:
  """The compiled step's buffers as XLA planned them (bytes), where the backend says."""
  try:
    stats = compiled.memory_analysis()
  except Exception:  # pylint: disable=broad-except  # not every backend implements it
    return None
  if stats is None:
    return None
  fields = ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes",
            "temp_size_in_bytes", "generated_code_size_in_bytes")
  plan = {f: int(getattr(stats, f)) for f in fields if hasattr(stats, f)}
  if {"argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes"} <= plan.keys():
    # Donated arguments alias outputs: count them once.
    plan["total_bytes"] = (plan["argument_size_in_bytes"] + plan["output_size_in_bytes"]
                           - plan.get("alias_size_in_bytes", 0) + plan["temp_size_in_bytes"])
  return plan


def _mean_eval(evaluate, params, rest, eval_batch) -> tuple[float, float]:
  """`(loss, accuracy)` of `evaluate` on one batch, or over a list of batches: their means
  weighted by the batches' sizes (the leading axis of their first array)."""
  batches = eval_batch if isinstance(eval_batch, list) else [eval_batch]
  results = jax.device_get([evaluate(params, rest, b) for b in batches])  # one fetch
  sizes = [len(jax.tree.leaves(b)[0]) for b in batches]
  return tuple(float(sum(r[i] * n for r, n in zip(results, sizes)) / sum(sizes))
               for i in (0, 1))


@functools.lru_cache(maxsize=16)
def _functions(graphdef, loss_fn, lr: float, steps: int):
  """The jitted training step and evaluation of a model structure: one per structure, so
  models that differ only in their parameters (other seeds) share their compilations."""
  tx = adamw(lr, steps)

  def apply(params, rest, batch):
    return loss_fn(nnx.merge(graphdef, params, rest), batch)

  def step_fn(params, rest, opt_state, batch):
    (loss, acc), grads = jax.value_and_grad(apply, has_aux=True)(params, rest, batch)
    with jax.named_scope("optimizer"):
      updates, opt_state = tx.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state, loss, acc

  # Parameters and optimizer state are donated: updated in place.
  return jax.jit(step_fn, donate_argnums=(0, 2)), jax.jit(apply)


_executables = {}


def _compile(step_fn, *args):
  """`step_fn` compiled ahead of the loop for `args`' shapes (once per function and shapes),
  and its memory plan: the compile is timed apart from the steps."""
  leaves, treedef = jax.tree.flatten(args)
  key = (step_fn, treedef, tuple((jnp.shape(x), jnp.result_type(x)) for x in leaves))
  if key not in _executables:
    compiled = step_fn.lower(*args).compile()
    _executables[key] = compiled, _memory_plan(compiled)
  return _executables[key]


def train(model: nnx.Module, loss_fn: Callable, batch_fn: Callable[[int], tuple], *,
          steps: int, lr: float, eval_batch: tuple | list, eval_every: int,
          ckpt_dir: Path | None, desc: str) -> dict:
  """Trains `model` in place; returns the history (steps, losses, accuracies, timing, memory).

  Args:
    model: the module; its parameters are updated in place at the end.
    loss_fn: `(model, batch) -> (loss, accuracy)`, traced under `jax.jit`; a module-level
      function, so models of one structure (other seeds) share the compiled step.
    batch_fn: `step -> batch`, a pure function of the step so a resumed run sees the same data.
    eval_batch: a fixed held-out batch (or a list of them, averaged by size), evaluated every
      `eval_every` steps and at the end.
    ckpt_dir: where to keep the checkpoint (None: no checkpoint).

  The history holds, at each evaluation, `step`, `train_loss` (of that step), `eval_loss`
  and `eval_acc`; the training loss of every step in `loss`; `seconds` of training (evaluation
  and compilation excluded); `compile_seconds` (near 0 when a model of the same structure was
  compiled earlier in the process); `step_seconds`, the mean time of the steps after the first of
  this run (None when fewer than two ran), measured between device synchronizations at the
  evaluations only; and `memory`, the compiled step's buffer plan (bytes; None where the
  backend has none). A resumed run keeps the timing of the run that trained the steps, unless
  it trains more.
  """
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  step_fn, evaluate = _functions(graphdef, loss_fn, lr, steps)
  opt_state = adamw(lr, steps).init(params)
  history = {"step": [], "train_loss": [], "eval_loss": [], "eval_acc": [], "loss": [],
             "seconds": 0.0, "compile_seconds": None, "step_seconds": None, "memory": None}
  start = 0
  manager = _checkpoint_manager(ckpt_dir)
  if manager is not None and manager.latest_step() is not None:
    start = manager.latest_step()
    target = {"params": params, "opt_state": opt_state}
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, target)
    restored = manager.restore(start, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract), history=ocp.args.JsonRestore()))
    params, opt_state = restored.state["params"], restored.state["opt_state"]
    history = {**history, **restored.history}
    log(f"{desc}: resumed from {ckpt_dir} at step {start}")

  def save(step):
    if manager is not None:
      manager.save(step, args=ocp.args.Composite(
          state=ocp.args.StandardSave({"params": params, "opt_state": opt_state}),
          history=ocp.args.JsonSave(history)), force=True)

  if start < steps:
    t = time.perf_counter()
    compiled, history["memory"] = _compile(step_fn, params, rest, opt_state, batch_fn(start))
    history["compile_seconds"] = time.perf_counter() - t
  bar = progress(start, steps, desc)
  losses = []  # device scalars, fetched at the evaluations (no host sync per step)
  timed_steps, timed_seconds = 0, 0.0
  t0 = time.perf_counter()
  for step in bar:
    params, opt_state, loss, acc = compiled(params, rest, opt_state, batch_fn(step))
    losses.append(loss)
    if step == start:  # the first step of a run warms up; the steady state is timed after it
      jax.block_until_ready((params, loss))
      history["seconds"] += time.perf_counter() - t0
      t0 = time.perf_counter()
      first_timed = step + 1
    if (step + 1) % eval_every == 0 or step + 1 == steps:
      jax.block_until_ready((params, opt_state, loss))
      elapsed = time.perf_counter() - t0
      history["seconds"] += elapsed
      if step + 1 > first_timed:
        timed_steps += step + 1 - first_timed
        timed_seconds += elapsed
      history["loss"].extend(float(x) for x in jax.device_get(losses))
      losses = []
      eval_loss, eval_acc = _mean_eval(evaluate, params, rest, eval_batch)
      history["step"].append(step + 1)
      history["train_loss"].append(history["loss"][-1])
      history["eval_loss"].append(eval_loss)
      history["eval_acc"].append(eval_acc)
      if timed_steps:
        history["step_seconds"] = timed_seconds / timed_steps
      bar.set_postfix(loss=f"{history['loss'][-1]:.3f}", eval_loss=f"{eval_loss:.3f}",
                      eval_acc=f"{eval_acc:.3f}")
      save(step + 1)
      t0 = time.perf_counter()
      first_timed = step + 1
  bar.close()
  if manager is not None:
    manager.wait_until_finished()
    manager.close()
  nnx.update(model, params)
  return history


def check_model_args(args) -> None:
  """The checks every example's model flags share (`--dim`, `--heads`, `--kv-heads`), and
  `--ckpt-dir`'s default (`--out-dir`/ckpt; "none": no checkpoints), in place."""
  if args.dim % args.heads:
    raise ValueError(f"--dim {args.dim} must be divisible by --heads {args.heads}")
  if args.heads % args.kv_heads:
    raise ValueError(f"--kv-heads {args.kv_heads} must divide --heads {args.heads}")
  if args.ckpt_dir is None:
    args.ckpt_dir = args.out_dir / "ckpt"
  else:
    args.ckpt_dir = checkpoint_root(args.ckpt_dir)


def checkpoint_root(ckpt_dir: Path | str | None) -> Path | None:
  """`--ckpt-dir`'s folder, or None (keep no checkpoint) for "none" (any case) or None."""
  if ckpt_dir is None or str(ckpt_dir).lower() == "none":
    return None
  return Path(ckpt_dir)


def table(header: list[str], rows: list[list]) -> str:
  """A Markdown table (it reads fine in a terminal too)."""
  cells = [header] + [[f"{c:.3f}" if isinstance(c, float) else str(c) for c in r] for r in rows]
  widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
  fmt = lambda r: "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |"
  lines = [fmt(cells[0]), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
  return "\n".join(lines + [fmt(r) for r in cells[1:]])


def count_params(model: nnx.Module) -> int:
  return sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


def matmul_params(model: nnx.Module) -> int:
  """Parameters that multiply activations: every `kernel` (embedding tables, positions, norm
  scales and biases excluded). A token's forward pass costs `2 * matmul_params` FLOPs in them."""
  total = 0
  for path, x in jax.tree_util.tree_leaves_with_path(nnx.state(model, nnx.Param)):
    if any(getattr(k, "key", None) == "kernel" for k in path):
      total += x.size
  return total


def train_step_flops(model: nnx.Module, *, batch: int, seq_len: int,
                     attention_pairs: int, head_dim: int, layers: int) -> int:
  """Model FLOPs of one training step (forward and backward, no recomputation counted).

  The projections and MLPs: `6 * matmul_params` per token (forward 2, backward 4). Attention:
  `4 * head_dim` per visible (query, key, head) triple in the forward (scores and the weighted
  sum of values), three times that with the backward; `attention_pairs` is the triples of one
  sequence in one layer (e.g. `DilatedPattern.visible_pairs(N, H, distinct=True)`).
  """
  tokens = batch * seq_len
  return 6 * matmul_params(model) * tokens + 12 * head_dim * attention_pairs * batch * layers


def device_info() -> dict:
  """The platform, device kind and count, JAX and Python versions."""
  d = jax.devices()[0]
  return {"platform": d.platform, "device_kind": d.device_kind, "devices": jax.device_count(),
          "jax": jax.__version__, "python": sys.version.split()[0]}


def peak_memory_bytes() -> int | None:
  """The device's peak bytes in use so far in this process (None where the backend does not
  track it, e.g. the CPU). It never decreases: run one model per process for separate peaks."""
  try:
    stats = jax.devices()[0].memory_stats()
  except Exception:  # pylint: disable=broad-except
    return None
  return None if not stats else stats.get("peak_bytes_in_use")


def config_digest(config: dict) -> str:
  """A short digest of a JSON-able configuration: names checkpoint folders per configuration,
  so a run with other flags never resumes from an incompatible checkpoint."""
  return hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:10]


def checkpoint_dir(root: Path | None, name: str, config: dict) -> Path | None:
  """`root / f"{name}-{digest}"`, the checkpoint folder of `name` under this configuration
  (None when `root` is). Where `root` holds `name`'s checkpoints of other flags, says so in
  one line: they are kept, and this run does not resume from them."""
  if root is None:
    return None
  folder = Path(root) / f"{name}-{config_digest(config)}"
  mine = re.compile(rf"{re.escape(name)}-[0-9a-f]{{10}}")
  others = sorted(p.name for p in Path(root).glob(f"{name}-*")
                  if p != folder and p.is_dir() and mine.fullmatch(p.name))
  if others:
    log(f"{name}: {root} holds checkpoints of other flags ({', '.join(others)}); this "
        f"configuration starts its own, {folder.name}")
  return folder


def write_json(path: Path, data: dict) -> None:
  path.parent.mkdir(parents=True, exist_ok=True)

  def clean(x):  # NaN and infinities are not JSON
    if isinstance(x, float) and not math.isfinite(x):
      return None
    if isinstance(x, dict):
      return {k: clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
      return [clean(v) for v in x]
    return x

  path.write_text(json.dumps(clean(data), indent=1) + "\n")


def check_positive(args, *names) -> None:
  """`ValueError` naming the flag unless each named flag (an `argparse` attribute) is a
  positive number."""
  for name in names:
    val = getattr(args, name)
    if isinstance(val, bool) or not isinstance(val, (int, float)) or not val > 0:
      raise ValueError(f"--{name.replace('_', '-')} must be positive, got {val!r}")


def mean_std(xs: Sequence[float]) -> tuple[float, float]:
  """Mean and sample standard deviation (0 for a single value)."""
  n = len(xs)
  mean = sum(xs) / n
  return mean, (math.sqrt(sum((x - mean) ** 2 for x in xs) / (n - 1)) if n > 1 else 0.0)
