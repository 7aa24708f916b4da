"""The jitted steps of training: scoring a rollout, and actor / critic / supervised updates.

Models are handled functionally: a graphdef (static) and a parameter `nnx.State` (a pytree) so
that the whole training state is one pytree of arrays. Every update takes a mini-batch, splits it
into micro-batches along the batch axis and accumulates gradients with `lax.scan`; losses use the
whole mini-batch's denominators (`algorithm.Denominators`), so the accumulated gradient equals
the mini-batch gradient exactly.

Shapes: `B` sequences, `S` = `Tp` + `Tr` positions (left-padded prompt, then the response), `Tr`
response tokens, `V` vocabulary. Logits at position Tp − 1 + t predict response token t, and the
critic's output there is V(s_t), the value before response token t.
"""

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from vapo_jax import algorithm, losses, masked
from vapo_jax.config import AlgoConfig, OptimizerConfig
from vapo_jax.models.transformer import positions_from_mask


class TrainBatch(NamedTuple):
  tokens: jax.Array  # [B, S] prompt then response tokens.
  attention_mask: jax.Array  # [B, S].
  response_tokens: jax.Array  # [B, Tr].
  response_mask: jax.Array  # [B, Tr].
  old_logprobs: jax.Array  # [B, Tr] policy log-probs at rollout time.
  advantages: jax.Array  # [B, Tr].
  returns: jax.Array  # [B, Tr] critic targets.
  old_values: jax.Array  # [B, Tr].
  is_positive: jax.Array  # [B] verifier said correct.
  ref_logprobs: jax.Array  # [B, Tr] reference-policy log-probs (zeros without a KL term).


def join(prompt_tokens, prompt_mask, response_tokens, response_mask):
  """`[B, Tp]` prompt and `[B, Tr]` response into `[B, S]` tokens and attention mask."""
  return (jnp.concatenate([prompt_tokens, response_tokens], axis=1).astype(jnp.int32),
          jnp.concatenate([prompt_mask, response_mask], axis=1).astype(bool))


def response_logits(model, tokens, attention_mask, response_len: int) -> jax.Array:
  """`[B, Tr, V]` logits predicting each response token."""
  logits, _ = model(tokens, positions_from_mask(attention_mask), attention_mask)
  prompt_len = tokens.shape[1] - response_len
  return logits[:, prompt_len - 1:prompt_len - 1 + response_len]


def token_logprobs(logits, response_tokens) -> jax.Array:
  """log π(o_t) `[B, Tr]` of the given tokens under `[B, Tr, V]` logits (float32)."""
  logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  return jnp.take_along_axis(logp, response_tokens[..., None].astype(jnp.int32), axis=-1)[..., 0]


def response_values(critic, tokens, attention_mask, response_len: int) -> jax.Array:
  """V(s_t) `[B, Tr]` before each response token."""
  values, _ = critic(tokens, positions_from_mask(attention_mask), attention_mask)
  prompt_len = tokens.shape[1] - response_len
  return values[:, prompt_len - 1:prompt_len - 1 + response_len]


def make_optimizer(optim: OptimizerConfig, peak_lr: float) -> tuple[optax.GradientTransformation, optax.Schedule]:
  """AdamW, linear warm-up to `peak_lr` then constant, after global-norm clipping; and the schedule."""
  if optim.warmup_steps:
    schedule = optax.join_schedules(
        [optax.linear_schedule(peak_lr / optim.warmup_steps, peak_lr, optim.warmup_steps - 1),
         optax.constant_schedule(peak_lr)], [optim.warmup_steps])
  else:
    schedule = optax.constant_schedule(peak_lr)
  adamw = optax.adamw(schedule, b1=optim.b1, b2=optim.b2, eps=optim.eps, weight_decay=optim.weight_decay)
  chain = [optax.clip_by_global_norm(optim.max_grad_norm)] if optim.max_grad_norm else []
  return optax.chain(*chain, adamw), schedule


def init_optimizer(tx: optax.GradientTransformation, params, mesh: jax.sharding.Mesh):
  """The optimizer state laid out like the parameters (moments sharded as their parameter, the
  step count replicated); a plain `jit(tx.init)` would leave it all on one device."""
  abstract = jax.eval_shape(tx.init, params)
  shardings = jax.tree.map(lambda x: x.sharding, params)
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  out = optax.tree_utils.tree_map_params(tx, lambda _, s: s, abstract, shardings,
                                         transform_non_params=lambda _: replicated)
  return jax.jit(tx.init, out_shardings=out)(params)


def _micro(tree, micro: int, shards: int = 1):
  """Splits the leading batch axis `[B, ...]` into `[M, micro, ...]` micro-batches.

  With the batch in `shards` equal contiguous blocks (one per device along the batch axes),
  micro-batch m takes the m-th part of every block, so each micro-batch stays spread over all
  devices and nothing moves between them; `_unmicro` is the inverse. Which rows share a
  micro-batch does not change any result: losses use whole-batch denominators.
  """
  def split(x):
    b, m = x.shape[0], x.shape[0] // micro
    if shards <= 1 or b % shards or (b // shards) % m:
      return x.reshape((m, micro) + x.shape[1:])
    x = x.reshape((shards, m, b // shards // m) + x.shape[1:])
    return jnp.swapaxes(x, 0, 1).reshape((m, micro) + x.shape[3:])
  return jax.tree.map(split, tree)


def _unmicro(tree, shards: int = 1):
  """`[M, micro, ...]` back to `[B, ...]` (the inverse of `_micro`)."""
  def join(x):
    m, micro = x.shape[:2]
    b = m * micro
    if shards <= 1 or b % shards or (b // shards) % m:
      return x.reshape((b,) + x.shape[2:])
    x = x.reshape((m, shards, micro // shards) + x.shape[2:])
    return jnp.swapaxes(x, 0, 1).reshape((b,) + x.shape[3:])
  return jax.tree.map(join, tree)


# Metrics that are a micro-batch's share of the mini-batch value (losses with whole-batch
# denominators, counts): summed over micro-batches. Per-sequence means: averaged (micro-batches
# have equal numbers of sequences). Every other metric is a mean over valid tokens: weighted by
# each micro-batch's valid tokens, which gives the mini-batch's token mean exactly.
SUMMED_METRICS = frozenset({"actor/pg_loss", "actor/nll_loss", "actor/ref_kl", "actor/loss",
                            "actor/positive_tokens"})
SEQUENCE_METRICS = frozenset({"actor/positive_frac"})


def _accumulate(loss_fn, params, batch: TrainBatch, micro: int, shards: int = 1):
  """Σ over micro-batches of (loss, grads) and the mini-batch's metrics (see `SUMMED_METRICS`)."""
  grad_fn = jax.grad(loss_fn, has_aux=True)
  chunks = _micro(batch, micro, shards)
  zeros = jax.tree.map(jnp.zeros_like, params)

  def body(grads, chunk):
    g, (loss, metrics) = grad_fn(params, chunk)
    return jax.tree.map(jnp.add, grads, g), (loss, metrics, jnp.sum(chunk.response_mask).astype(jnp.float32))

  grads, (loss, metrics, tokens) = jax.lax.scan(body, zeros, chunks)
  weights = tokens / jnp.maximum(jnp.sum(tokens), 1.0)
  combined = {k: jnp.sum(v) if k in SUMMED_METRICS else jnp.mean(v) if k in SEQUENCE_METRICS else jnp.sum(v * weights)
              for k, v in metrics.items()}
  return jnp.sum(loss), grads, combined


def _update(loss_fn, tx, schedule, params, opt_state, opt_step, batch: TrainBatch, micro: int, shards: int, *,
            prefix: str, loss_name: str):
  """Accumulates `loss_fn`'s gradients over micro-batches and applies one optimizer step; the
  metrics under `prefix/` with the loss as `prefix/loss_name`, the gradient norm and the lr."""
  loss, grads, metrics = _accumulate(loss_fn, params, batch, micro, shards)
  updates, opt_state = tx.update(grads, opt_state, params)
  extra = {loss_name: loss, "grad_norm": optax.tree.norm(grads), "lr": schedule(opt_step)}
  return optax.apply_updates(params, updates), opt_state, metrics | {f"{prefix}/{k}": v for k, v in extra.items()}


@functools.partial(jax.jit, static_argnames=("graphdef", "response_len", "micro", "shards"))
def logprobs_and_entropy(graphdef, params, tokens, attention_mask, response_tokens, *, response_len, micro=None,
                         shards=1):
  """log π(o_t) and the entropy `[B, Tr]`, computed `micro` sequences at a time (None: all at once)."""
  model = nnx.merge(graphdef, params)

  def chunk(args):
    logits = response_logits(model, *args[:2], response_len)
    return token_logprobs(logits, args[2]), losses.entropy_from_logits(logits)
  return _in_micro_batches(chunk, (tokens, attention_mask, response_tokens), micro, shards)


@functools.partial(jax.jit, static_argnames=("graphdef", "response_len", "micro", "shards"))
def values(graphdef, params, tokens, attention_mask, *, response_len, micro=None, shards=1):
  """V(s_t) `[B, Tr]`, computed `micro` sequences at a time (None: all at once)."""
  critic = nnx.merge(graphdef, params)
  return _in_micro_batches(lambda args: response_values(critic, *args, response_len), (tokens, attention_mask),
                           micro, shards)


def _in_micro_batches(fn, args, micro, shards):
  if micro is None or micro >= args[0].shape[0] or args[0].shape[0] % micro:
    return fn(args)
  return _unmicro(jax.lax.map(fn, _micro(args, micro, shards)), shards)


def actor_update(graphdef, tx, schedule, params, opt_state, opt_step, batch: TrainBatch, *, algo: AlgoConfig,
                 micro: int, shards: int = 1):
  """One optimizer update of the policy on a mini-batch (not jitted here: see `Steps`)."""
  denominators = algorithm.Denominators.of(algo, batch.response_mask, batch.is_positive)
  response_len = batch.response_tokens.shape[1]

  def loss_fn(p, mb: TrainBatch):
    logits = response_logits(nnx.merge(graphdef, p), mb.tokens, mb.attention_mask, response_len)
    logprobs = token_logprobs(logits, mb.response_tokens)
    entropy = losses.entropy_from_logits(logits)
    loss, metrics = algorithm.actor_loss(
        algo, logprobs, mb.old_logprobs, mb.advantages, mb.response_mask, mb.is_positive,
        ref_logprobs=mb.ref_logprobs if algo.kl_coef > 0 else None,
        entropy=entropy if algo.entropy_coef > 0 else None, denominators=denominators)
    metrics["actor/entropy"] = masked.masked_mean(jax.lax.stop_gradient(entropy), mb.response_mask)
    return loss, (loss, metrics)

  return _update(loss_fn, tx, schedule, params, opt_state, opt_step, batch, micro, shards, prefix="actor",
                 loss_name="loss")


def critic_update(graphdef, tx, schedule, params, opt_state, opt_step, batch: TrainBatch, *, algo: AlgoConfig,
                  micro: int, shards: int = 1):
  """One optimizer update of the critic towards `batch.returns` on a mini-batch."""
  denominator = jnp.sum(batch.response_mask).astype(jnp.float32)
  response_len = batch.response_tokens.shape[1]

  def loss_fn(p, mb: TrainBatch):
    v = response_values(nnx.merge(graphdef, p), mb.tokens, mb.attention_mask, response_len)
    loss, metrics = losses.value_loss(v, mb.old_values, mb.returns, mb.response_mask,
                                      clip_range=algo.value_clip, denominator=denominator)
    metrics = {f"critic/{k}": val for k, val in metrics.items() if k != "explained_variance"}
    return loss, (loss, metrics)

  return _update(loss_fn, tx, schedule, params, opt_state, opt_step, batch, micro, shards, prefix="critic",
                 loss_name="value_loss")


def sft_update(graphdef, tx, schedule, params, opt_state, opt_step, batch: TrainBatch, *, micro: int,
               shards: int = 1):
  """One supervised update: token-level NLL of the response tokens (demonstrations)."""
  denominator = jnp.sum(batch.response_mask).astype(jnp.float32)
  response_len = batch.response_tokens.shape[1]

  def loss_fn(p, mb: TrainBatch):
    logits = response_logits(nnx.merge(graphdef, p), mb.tokens, mb.attention_mask, response_len)
    nll = -token_logprobs(logits, mb.response_tokens)
    loss = losses.aggregate_loss(nll, mb.response_mask, mode="token-mean", denominator=denominator)
    return loss, (loss, {})

  return _update(loss_fn, tx, schedule, params, opt_state, opt_step, batch, micro, shards, prefix="sft",
                 loss_name="nll")
