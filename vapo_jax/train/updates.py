"""A mini-batch's forward passes and updates, as pure functions of (graphdef, parameters, batch): what
`steps.Steps` jits. A batch is padded (`TrainBatch`: `micro` sequences of S tokens per micro-batch)
or packed (`packed_batch.PackedBatch`: micro-batches of m rows of L tokens, the losses' arrays at the
rows' prediction columns); every update accumulates micro-batch gradients with `lax.scan` against the
whole mini-batch's denominators (`algorithm.Denominators`), so it equals the mini-batch's gradient.

Shapes: `B` sequences, `S` = `Tp` + `Tr` positions (left-padded prompt, then the response), `Tr`
response tokens. The hidden state at position Tp − 1 + t predicts response token t, and the
critic's output there is V(s_t), the value before response token t.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from vapo_jax.config import AlgoConfig
from vapo_jax.models.logprobs import packed_token_logprobs, response_logprobs
from vapo_jax.models.transformer import positions_from_mask
from vapo_jax.rl import losses
from vapo_jax.train import algorithm, micro_batches
from vapo_jax.train.packed_batch import PackedBatch, RowBatch


class TrainBatch(NamedTuple):
  """A scored rollout batch. Fields a stage does not use are None (not zeros)."""

  tokens: jax.Array  # [B, S] prompt then response tokens.
  attention_mask: jax.Array  # [B, S].
  response_mask: jax.Array  # [B, Tr].
  returns: jax.Array  # [B, Tr] critic targets.
  old_values: jax.Array | None  # [B, Tr] (None without a critic).
  is_positive: jax.Array  # [B] verifier said correct.
  old_logprobs: jax.Array | None = None  # [B, Tr] policy log-probs at rollout time (None: critic only).
  advantages: jax.Array | None = None  # [B, Tr] (None: critic only).
  ref_logprobs: jax.Array | None = None  # [B, Tr] reference-policy log-probs (None without a KL term).
  value_mask: jax.Array | None = None  # [B, Tr] tokens of the value loss (None: response_mask).
  sampler_logprobs: jax.Array | None = None  # [B, Tr] as sampled (None without truncated importance sampling).


def join(prompt_tokens, prompt_mask, response_tokens, response_mask):
  """`[B, Tp]` prompt and `[B, Tr]` response into `[B, S]` tokens and attention mask."""
  return (jnp.concatenate([prompt_tokens, response_tokens], axis=1).astype(jnp.int32),
          jnp.concatenate([prompt_mask, response_mask], axis=1).astype(bool))


def response_values(critic, tokens, attention_mask, response_len: int) -> jax.Array:
  """V(s_t) `[B, Tr]` before each response token."""
  values, _ = critic(tokens, positions_from_mask(attention_mask), attention_mask)
  prompt_len = tokens.shape[1] - response_len
  return values[:, prompt_len - 1:prompt_len - 1 + response_len]


def _chunks(batch: TrainBatch | PackedBatch, micro: int, shards: int):
  """The micro-batches `[M, ...]` of a mini-batch: packed rows come split; padded, `micro` sequences each."""
  return batch.rows if isinstance(batch, PackedBatch) else micro_batches.split_micro(batch, micro, shards)


def _sequences(batch: TrainBatch | PackedBatch) -> tuple[jax.Array, jax.Array]:
  """Response lengths and verdicts `[n]` of a mini-batch's sequences, padded or packed."""
  if isinstance(batch, PackedBatch):
    return batch.response_lengths, batch.is_positive
  return jnp.sum(batch.response_mask, axis=-1, dtype=jnp.int32), batch.is_positive


def _value_tokens(batch: TrainBatch | PackedBatch) -> jax.Array:
  """The tokens a mini-batch's value loss fits: its value_mask's (a reward model: the last tokens),
  else every response token."""
  per_token = batch.rows if isinstance(batch, PackedBatch) else batch
  if per_token.value_mask is not None:
    return jnp.sum(per_token.value_mask).astype(jnp.float32)
  return jnp.sum(_sequences(batch)[0]).astype(jnp.float32)


def _policy(model, mb: TrainBatch | RowBatch, *, chunk: int, entropy: bool):
  """log π and H at a micro-batch's loss positions: `[micro, Tr]` padded, `[m, L]` packed."""
  if isinstance(mb, RowBatch):
    return packed_token_logprobs(model, mb.tokens, mb.segment_ids, mb.positions, chunk=chunk, entropy=entropy)
  return response_logprobs(model, mb.tokens, mb.attention_mask, mb.response_mask.shape[1], chunk=chunk,
                           entropy=entropy)


def _values(critic, mb: TrainBatch | RowBatch) -> jax.Array:
  """V(s_t) at a micro-batch's loss positions: `[micro, Tr]` padded, `[m, L]` packed."""
  if isinstance(mb, RowBatch):
    return critic(mb.tokens, mb.positions, None, segment_ids=mb.segment_ids)[0]
  return response_values(critic, mb.tokens, mb.attention_mask, mb.response_mask.shape[1])


def logprobs_and_entropy(graphdef, params, tokens, attention_mask, *, response_len, chunk, micro=None,
                         shards=1):
  """log π(o_t) and the entropy `[B, Tr]`, computed `micro` sequences at a time (None: all at once)."""
  fn = lambda p, args: response_logprobs(nnx.merge(graphdef, p), *args, response_len, chunk=chunk,
                                         entropy=True)
  return micro_batches.forward(fn, params, (tokens, attention_mask), micro, shards)


def values(graphdef, params, tokens, attention_mask, *, response_len, micro=None, shards=1):
  """V(s_t) `[B, Tr]`, computed `micro` sequences at a time (None: all at once)."""
  fn = lambda p, args: response_values(nnx.merge(graphdef, p), *args, response_len)
  return micro_batches.forward(fn, params, (tokens, attention_mask), micro, shards)


def packed_logprobs_and_entropy(graphdef, params, rows: RowBatch, *, chunk: int):
  """log π of the next token and H `[M, m, L]` at every column of packed rows, a micro-batch at a time."""
  fn = lambda p, mb: _policy(nnx.merge(graphdef, p), mb, chunk=chunk, entropy=True)
  return micro_batches.forward_rows(fn, params, rows)


def packed_values(graphdef, params, rows: RowBatch) -> jax.Array:
  """V `[M, m, L]` at every column of packed rows, a micro-batch at a time."""
  return micro_batches.forward_rows(lambda p, mb: _values(nnx.merge(graphdef, p), mb), params, rows)


def actor_update(graphdef, tx, params, opt_state, batch: TrainBatch | PackedBatch, *, algo: AlgoConfig,
                 micro: int, shards: int = 1, chunk: int, response_len: int | None = None):
  """One optimizer update of the policy on a mini-batch. The entropy is computed in the loss only
  when it is a term of it (`entropy_coef > 0`); its metric comes from scoring. `response_len` (Tr,
  for seq-mean-token-sum-norm): needed for packed rows; padded, the response mask's width."""
  lengths, verdicts = _sequences(batch)
  denominators = algorithm.Denominators.from_lengths(algo, lengths, verdicts)
  norm_length = response_len or batch.response_mask.shape[1]

  def loss_fn(p, mb: TrainBatch | RowBatch):
    logprobs, entropy = _policy(nnx.merge(graphdef, p), mb, chunk=chunk, entropy=algo.entropy_coef > 0)
    loss, metrics = algorithm.actor_loss(
        algo, logprobs, mb.old_logprobs, mb.advantages, mb.response_mask, mb.is_positive,
        ref_logprobs=mb.ref_logprobs if algo.kl_coef > 0 else None, entropy=entropy,
        denominators=denominators,
        segment_ids=mb.segment_ids if isinstance(mb, RowBatch) else None, norm_length=norm_length,
        sampler_logprobs=mb.sampler_logprobs)
    return loss, (loss, metrics)

  chunks = _chunks(batch, micro, shards)
  params, opt_state, metrics = micro_batches.optimizer_step(loss_fn, tx, params, opt_state, chunks,
                                                            prefix="actor", loss_name="loss")
  return params, opt_state, metrics


def critic_update(graphdef, tx, params, opt_state, batch: TrainBatch | PackedBatch, *, algo: AlgoConfig,
                  micro: int, shards: int = 1):
  """One optimizer update of the critic towards `batch.returns` on a mini-batch."""
  fitted = lambda b: b.response_mask if b.value_mask is None else b.value_mask
  denominator = _value_tokens(batch)

  def loss_fn(p, mb: TrainBatch | RowBatch):
    v = _values(nnx.merge(graphdef, p), mb)
    loss, metrics = losses.value_loss(v, mb.old_values, mb.returns, fitted(mb),
                                      clip_range=algo.value_clip, denominator=denominator)
    metrics = {f"critic/{k}": val for k, val in metrics.items() if k != "explained_variance"}
    return loss, (loss, metrics)

  return micro_batches.optimizer_step(loss_fn, tx, params, opt_state, _chunks(batch, micro, shards),
                                      prefix="critic", loss_name="value_loss")


def sft_update(graphdef, tx, params, opt_state, batch: TrainBatch | PackedBatch, *, micro: int,
               shards: int = 1, chunk: int):
  """One supervised update: token-level NLL of the response tokens (demonstrations)."""
  denominator = jnp.sum(_sequences(batch)[0]).astype(jnp.float32)

  def loss_fn(p, mb: TrainBatch | RowBatch):
    logprobs, _ = _policy(nnx.merge(graphdef, p), mb, chunk=chunk, entropy=False)
    loss = losses.aggregate_loss(-logprobs, mb.response_mask, mode="token-mean", denominator=denominator)
    return loss, (loss, {})

  return micro_batches.optimizer_step(loss_fn, tx, params, opt_state, _chunks(batch, micro, shards),
                                      prefix="sft", loss_name="nll")


def mini_batch_orders(key: jax.Array, size: int, mini: int, epochs: int) -> tuple[jax.Array, jax.Array]:
  """The state's next key and the sequence ids `[E, K, mini]` of each epoch's K = size // mini shuffled
  mini-batches (the same in both layouts: the packed host plan fetches them)."""
  key, *epoch_keys = jax.random.split(key, epochs + 1)
  orders = [jax.random.permutation(k, size)[:size // mini * mini].reshape(size // mini,
                                                                          mini) for k in epoch_keys]
  return key, jnp.stack(orders)
