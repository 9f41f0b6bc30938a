"""What the training examples share: a resumable optax loop with an Orbax checkpoint.

`train` trains an `nnx.Module` functionally (split once into a graph definition and its
parameters, one jitted step), shows a tqdm progress bar, evaluates every `eval_every` steps and
keeps the latest state plus the metric history in an Orbax `CheckpointManager`, so a run
started again with the same `ckpt_dir` resumes where it stopped (or just re-evaluates).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import optax
import orbax.checkpoint as ocp
from flax import nnx
from tqdm import tqdm


def adamw(lr: float, steps: int) -> optax.GradientTransformation:
  warmup = min(100, steps // 10)
  schedule = optax.warmup_cosine_decay_schedule(0.0, lr, warmup, max(steps, warmup + 1),
                                                end_value=lr / 10)
  return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=0.01))


def masked_xent(logits, labels, mask):
  """Mean cross-entropy and accuracy over the positions where `mask` is set."""
  losses = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), labels)
  hits = jnp.argmax(logits, axis=-1) == labels
  count = jnp.maximum(jnp.sum(mask), 1)
  return jnp.sum(losses * mask) / count, jnp.sum(hits * mask) / count


def train(model: nnx.Module, loss_fn: Callable, batch_fn: Callable[[int], tuple], *,
          steps: int, lr: float, eval_batch: tuple, eval_every: int, ckpt_dir: Path | None,
          desc: str) -> dict:
  """Trains `model` in place; returns the history (steps, losses, accuracies, timing).

  Args:
    model: the module; its parameters are updated in place at the end.
    loss_fn: `(model, batch) -> (loss, accuracy)`, traced under `jax.jit`.
    batch_fn: `step -> batch`, a pure function of the step so a resumed run sees the same data.
    eval_batch: a fixed held-out batch, evaluated every `eval_every` steps and at the end.
    ckpt_dir: where to keep the checkpoint (None: no checkpoint).
  """
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  tx = adamw(lr, steps)
  opt_state = tx.init(params)

  def apply(params, batch):
    return loss_fn(nnx.merge(graphdef, params, rest), batch)

  @jax.jit
  def step_fn(params, opt_state, batch):
    (loss, acc), grads = jax.value_and_grad(apply, has_aux=True)(params, batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss, acc

  evaluate = jax.jit(apply)
  history = {"step": [], "train_loss": [], "eval_loss": [], "eval_acc": [], "seconds": 0.0}
  start = 0
  manager = None
  if ckpt_dir is not None:
    manager = ocp.CheckpointManager(Path(ckpt_dir).absolute(),
                                    options=ocp.CheckpointManagerOptions(max_to_keep=1))
    if manager.latest_step() is not None:
      start = manager.latest_step()
      target = {"params": params, "opt_state": opt_state}
      abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, target)
      restored = manager.restore(start, args=ocp.args.Composite(
          state=ocp.args.StandardRestore(abstract), history=ocp.args.JsonRestore()))
      params, opt_state = restored.state["params"], restored.state["opt_state"]
      history = restored.history
      tqdm.write(f"{desc}: resumed from {ckpt_dir} at step {start}")

  def save(step):
    if manager is not None:
      manager.save(step, args=ocp.args.Composite(
          state=ocp.args.StandardSave({"params": params, "opt_state": opt_state}),
          history=ocp.args.JsonSave(history)), force=True)

  bar = tqdm(range(start, steps), desc=desc, initial=start, total=steps, dynamic_ncols=True)
  t0 = time.perf_counter()
  for step in bar:
    params, opt_state, loss, acc = step_fn(params, opt_state, batch_fn(step))
    if (step + 1) % eval_every == 0 or step + 1 == steps:
      eval_loss, eval_acc = (float(x) for x in evaluate(params, eval_batch))
      history["step"].append(step + 1)
      history["train_loss"].append(float(loss))
      history["eval_loss"].append(eval_loss)
      history["eval_acc"].append(eval_acc)
      history["seconds"] += time.perf_counter() - t0
      t0 = time.perf_counter()
      bar.set_postfix(loss=f"{float(loss):.3f}", eval_acc=f"{eval_acc:.3f}")
      save(step + 1)
  if manager is not None:
    manager.wait_until_finished()
    manager.close()
  nnx.update(model, params)
  return history


def table(header: list[str], rows: list[list]) -> str:
  """A Markdown table (it reads fine in a terminal too)."""
  cells = [header] + [[f"{c:.3f}" if isinstance(c, float) else str(c) for c in r] for r in rows]
  widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
  fmt = lambda r: "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |"
  lines = [fmt(cells[0]), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
  return "\n".join(lines + [fmt(r) for r in cells[1:]])


def count_params(model: nnx.Module) -> int:
  return sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
