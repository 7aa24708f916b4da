"""Micro-batches: splitting a mini-batch, accumulating gradients over its parts, and forward passes
part by part, in either form (padded sequences or packed rows, `packed_batch`).

  chunks = micro_batches.split_micro(batch, micro, shards)            # padded: [B, ...] -> [M, micro, ...]
  loss, grads, metrics = micro_batches.accumulate(loss_fn, params, chunks)
  params, opt_state, metrics = micro_batches.optimizer_step(loss_fn, tx, params, opt_state, chunks, ...)

Losses use the whole mini-batch's denominators, so the accumulated gradient is the mini-batch's
exactly, whichever rows share a micro-batch. A micro-batch without a response token (packed rows past
the last one first-fit decreasing filled) is skipped with `lax.cond`: it would add 0.
"""

import jax
import jax.numpy as jnp
import optax

from vapo_jax.train.optim import learning_rate

MICRO_BATCHES = "micro_batches"  # `jax.named_scope` of the loops over micro-batches: their op_name in compiled HLO.


def split_micro(tree, micro: int, shards: int = 1):
  """Splits the leading batch axis `[B, ...]` into `[M, micro, ...]` micro-batches.

  With the batch in `shards` equal contiguous blocks (one per device along the batch axes),
  micro-batch m takes the m-th part of every block, so each micro-batch stays spread over all
  devices and nothing moves between them; `unsplit` is the inverse. Which rows share a
  micro-batch does not change any result: losses use whole-batch denominators.
  """
  def split_(x):
    b, m = x.shape[0], x.shape[0] // micro
    if shards <= 1 or b % shards or (b // shards) % m:
      return x.reshape((m, micro) + x.shape[1:])
    x = x.reshape((shards, m, b // shards // m) + x.shape[1:])
    return jnp.swapaxes(x, 0, 1).reshape((m, micro) + x.shape[3:])
  return jax.tree.map(split_, tree)


def unsplit(tree, shards: int = 1):
  """`[M, micro, ...]` back to `[B, ...]` (the inverse of `split_micro`)."""
  def join_(x):
    m, micro = x.shape[:2]
    b = m * micro
    if shards <= 1 or b % shards or (b // shards) % m:
      return x.reshape((b,) + x.shape[2:])
    x = x.reshape((m, shards, micro // shards) + x.shape[2:])
    return jnp.swapaxes(x, 0, 1).reshape((b,) + x.shape[3:])
  return jax.tree.map(join_, tree)


# Metrics that are a micro-batch's share of the mini-batch value (losses with whole-batch
# denominators, counts): summed over micro-batches. Every other metric is a mean over valid tokens:
# weighted by each micro-batch's valid tokens, which gives the mini-batch's token mean exactly.
SUMMED_METRICS = frozenset({"actor/pg_loss", "actor/nll_loss", "actor/ref_kl", "actor/entropy_term",
                            "actor/loss",
                            "actor/positive_tokens"})


def _zeros_like_output(fn, *args):
  return jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), jax.eval_shape(fn, *args))


def accumulate(loss_fn, params, chunks):
  """Σ over micro-batches `[M, ...]` (each with a `response_mask`) of `loss_fn(params, chunk) -> (loss,
  (loss, metrics))`'s loss and gradient, and the mini-batch's metrics (see `SUMMED_METRICS`)."""
  grad_fn = jax.grad(loss_fn, has_aux=True)

  def body(grads, chunk):
    tokens = jnp.sum(chunk.response_mask).astype(jnp.float32)
    g, (loss, metrics) = jax.lax.cond(tokens > 0, lambda: grad_fn(params, chunk),
                                      lambda: _zeros_like_output(grad_fn, params, chunk))
    return jax.tree.map(jnp.add, grads, g), (loss, metrics, tokens)

  with jax.named_scope(MICRO_BATCHES):
    grads, (loss, metrics, tokens) = jax.lax.scan(body, jax.tree.map(jnp.zeros_like, params), chunks)
  weights = tokens / jnp.maximum(jnp.sum(tokens), 1.0)
  combined = {k: jnp.sum(v) if k in SUMMED_METRICS else jnp.sum(v * weights) for k, v in metrics.items()}
  return jnp.sum(loss), grads, combined


def optimizer_step(loss_fn, tx, params, opt_state, chunks, *, prefix: str, loss_name: str):
  """Accumulates `loss_fn`'s gradients over the micro-batches and applies one optimizer step; the
  metrics under `prefix/` with the loss as `prefix/loss_name`, the gradient norm and the lr."""
  loss, grads, metrics = accumulate(loss_fn, params, chunks)
  updates, opt_state = tx.update(grads, opt_state, params)
  extra = {loss_name: loss, "grad_norm": optax.tree.norm(grads), "lr": learning_rate(opt_state),
           "skipped_frac": 1.0 - opt_state.last_finite.astype(jnp.float32)}
  return optax.apply_updates(params, updates), opt_state, metrics | {f"{prefix}/{k}": v for k,
                                                                     v in extra.items()}


def _map(fn, params, xs):
  """`fn(params, x)` over the leading axis of `xs`. The parameters ride in the loop's carry, so that a
  model merged from them inside `fn` holds the loop's own tracers: `nnx.remat` (`model.remat`) refuses
  to update variables whose values were closed over from an outer trace."""
  with jax.named_scope(MICRO_BATCHES):
    return jax.lax.scan(lambda carried, x: (carried, fn(carried, x)), params, xs)[1]


def forward(fn, params, args, micro: int | None, shards: int):
  """`fn(params, args)` on padded sequences, `micro` at a time (None, or not dividing the batch: all at once)."""
  if micro is None or micro >= args[0].shape[0] or args[0].shape[0] % micro:
    return fn(params, args)
  return unsplit(_map(fn, params, split_micro(args, micro, shards)), shards)


def forward_rows(fn, params, rows):
  """`fn(params, micro-batch)` over packed rows `[M, m, L]` (a `packed_batch.RowBatch`), skipping
  micro-batches that hold no sequence."""
  def one(params, mb):
    return jax.lax.cond(jnp.any(mb.segment_ids > 0), fn, lambda *a: _zeros_like_output(fn, *a), params, mb)
  return _map(one, params, rows)
