"""The jitted programs of training: scoring a rollout, and the actor / critic / supervised updates.

  steps = Steps(config, mesh, rules, actor_def=..., critic_def=..., actor_tx=..., critic_tx=..., sft_tx=...)
  batch, stats = steps.score(state, rollout, rewards, correct)        # one program
  state, metrics = steps.ppo_update(state, batch, actor=True, critic=True)

Models are handled functionally: a graphdef (static) and a parameter `nnx.State` (a pytree), all
held in one `state.TrainState`. Every update takes a mini-batch, splits it into micro-batches
along the batch axis and accumulates gradients with `lax.scan`; losses use the whole
mini-batch's denominators (`algorithm.Denominators`), so the accumulated gradient equals the
mini-batch gradient exactly.

`Steps` jits them for one run: each takes and returns the `TrainState` (donated, with the output
laid out as the input), and each is traced with the run's sharding rules bound, so no program can
run unconstrained.

Shapes: `B` sequences, `S` = `Tp` + `Tr` positions (left-padded prompt, then the response), `Tr`
response tokens. The hidden state at position Tp − 1 + t predicts response token t, and the
critic's output there is V(s_t), the value before response token t.
"""

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from vapo_jax.config import AlgoConfig, ExperimentConfig
from vapo_jax.models import sharding
from vapo_jax.models.logprobs import response_logprobs
from vapo_jax.models.transformer import positions_from_mask
from vapo_jax.rl import advantages, losses, masked
from vapo_jax.rollout.common import Rollout
from vapo_jax.train import algorithm
from vapo_jax.train.optim import learning_rate
from vapo_jax.train.state import TrainState


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


def join(prompt_tokens, prompt_mask, response_tokens, response_mask):
  """`[B, Tp]` prompt and `[B, Tr]` response into `[B, S]` tokens and attention mask."""
  return (jnp.concatenate([prompt_tokens, response_tokens], axis=1).astype(jnp.int32),
          jnp.concatenate([prompt_mask, response_mask], axis=1).astype(bool))


def response_values(critic, tokens, attention_mask, response_len: int) -> jax.Array:
  """V(s_t) `[B, Tr]` before each response token."""
  values, _ = critic(tokens, positions_from_mask(attention_mask), attention_mask)
  prompt_len = tokens.shape[1] - response_len
  return values[:, prompt_len - 1:prompt_len - 1 + response_len]


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
  def join_(x):
    m, micro = x.shape[:2]
    b = m * micro
    if shards <= 1 or b % shards or (b // shards) % m:
      return x.reshape((b,) + x.shape[2:])
    x = x.reshape((m, shards, micro // shards) + x.shape[2:])
    return jnp.swapaxes(x, 0, 1).reshape((b,) + x.shape[3:])
  return jax.tree.map(join_, tree)


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


def _update(loss_fn, tx, params, opt_state, batch: TrainBatch, micro: int, shards: int, *, prefix: str,
            loss_name: str):
  """Accumulates `loss_fn`'s gradients over micro-batches and applies one optimizer step; the
  metrics under `prefix/` with the loss as `prefix/loss_name`, the gradient norm and the lr."""
  loss, grads, metrics = _accumulate(loss_fn, params, batch, micro, shards)
  updates, opt_state = tx.update(grads, opt_state, params)
  extra = {loss_name: loss, "grad_norm": optax.tree.norm(grads), "lr": learning_rate(opt_state),
           "skipped_frac": 1.0 - opt_state.last_finite.astype(jnp.float32)}
  return optax.apply_updates(params, updates), opt_state, metrics | {f"{prefix}/{k}": v for k, v in extra.items()}


def logprobs_and_entropy(graphdef, params, tokens, attention_mask, *, response_len, chunk, micro=None, shards=1):
  """log π(o_t) and the entropy `[B, Tr]`, computed `micro` sequences at a time (None: all at once)."""
  model = nnx.merge(graphdef, params)
  fn = lambda args: response_logprobs(model, *args, response_len, chunk=chunk, entropy=True)
  return _in_micro_batches(fn, (tokens, attention_mask), micro, shards)


def values(graphdef, params, tokens, attention_mask, *, response_len, micro=None, shards=1):
  """V(s_t) `[B, Tr]`, computed `micro` sequences at a time (None: all at once)."""
  critic = nnx.merge(graphdef, params)
  return _in_micro_batches(lambda args: response_values(critic, *args, response_len), (tokens, attention_mask),
                           micro, shards)


def _in_micro_batches(fn, args, micro, shards):
  if micro is None or micro >= args[0].shape[0] or args[0].shape[0] % micro:
    return fn(args)
  return _unmicro(jax.lax.map(fn, _micro(args, micro, shards)), shards)


def actor_update(graphdef, tx, params, opt_state, batch: TrainBatch, *, algo: AlgoConfig, micro: int, shards: int = 1,
                 chunk: int):
  """One optimizer update of the policy on a mini-batch. The entropy is computed in the loss only
  when it is a term of it (`entropy_coef > 0`); its metric comes from scoring."""
  denominators = algorithm.Denominators.of(algo, batch.response_mask, batch.is_positive)
  response_len = batch.response_mask.shape[1]

  def loss_fn(p, mb: TrainBatch):
    logprobs, entropy = response_logprobs(nnx.merge(graphdef, p), mb.tokens, mb.attention_mask, response_len,
                                          chunk=chunk, entropy=algo.entropy_coef > 0)
    loss, metrics = algorithm.actor_loss(
        algo, logprobs, mb.old_logprobs, mb.advantages, mb.response_mask, mb.is_positive,
        ref_logprobs=mb.ref_logprobs if algo.kl_coef > 0 else None, entropy=entropy, denominators=denominators)
    return loss, (loss, metrics)

  return _update(loss_fn, tx, params, opt_state, batch, micro, shards, prefix="actor", loss_name="loss")


def critic_update(graphdef, tx, params, opt_state, batch: TrainBatch, *, algo: AlgoConfig, micro: int,
                  shards: int = 1):
  """One optimizer update of the critic towards `batch.returns` on a mini-batch."""
  denominator = jnp.sum(batch.response_mask).astype(jnp.float32)
  response_len = batch.response_mask.shape[1]

  def loss_fn(p, mb: TrainBatch):
    v = response_values(nnx.merge(graphdef, p), mb.tokens, mb.attention_mask, response_len)
    loss, metrics = losses.value_loss(v, mb.old_values, mb.returns, mb.response_mask,
                                      clip_range=algo.value_clip, denominator=denominator)
    metrics = {f"critic/{k}": val for k, val in metrics.items() if k != "explained_variance"}
    return loss, (loss, metrics)

  return _update(loss_fn, tx, params, opt_state, batch, micro, shards, prefix="critic", loss_name="value_loss")


def sft_update(graphdef, tx, params, opt_state, batch: TrainBatch, *, micro: int, shards: int = 1, chunk: int):
  """One supervised update: token-level NLL of the response tokens (demonstrations)."""
  denominator = jnp.sum(batch.response_mask).astype(jnp.float32)
  response_len = batch.response_mask.shape[1]

  def loss_fn(p, mb: TrainBatch):
    logprobs, _ = response_logprobs(nnx.merge(graphdef, p), mb.tokens, mb.attention_mask, response_len, chunk=chunk)
    loss = losses.aggregate_loss(-logprobs, mb.response_mask, mode="token-mean", denominator=denominator)
    return loss, (loss, {})

  return _update(loss_fn, tx, params, opt_state, batch, micro, shards, prefix="sft", loss_name="nll")


class Steps:
  """The run's jitted programs, `(state, batch) -> (state, metrics)` with the state donated and laid
  out as it came in; built once from the run's config, mesh, rules, graphdefs and optimizers."""

  def __init__(self, config: ExperimentConfig, mesh, rules, *, actor_def, critic_def, actor_tx, critic_tx, sft_tx):
    self.config, self.mesh, self.rules = config, mesh, rules
    self.actor_def, self.critic_def = actor_def, critic_def
    self.txs = {"actor": actor_tx, "critic": critic_tx, "sft": sft_tx}
    self.micro = config.algo.micro_batch_responses or config.algo.mini_batch_responses
    self.shards = mesh.shape["data"] * mesh.shape["fsdp"]
    self.chunk = config.model.logits_chunk
    self.rows = jax.sharding.NamedSharding(mesh, sharding.partition_spec(("batch",), rules))
    self._programs = {}
    self._score = {only: self.jit(functools.partial(self._score_program, critic_only=only)) for only in (False, True)}

  def jit(self, fn, **kwargs):
    """`jax.jit(fn)` traced with the run's sharding rules bound (so `constrain` always applies)."""
    return sharding.jit(fn, self.mesh, self.rules, **kwargs)

  def place(self, tree):
    """Host arrays (the same on every process) → global arrays split over the batch axes (replicated
    when the batch does not divide evenly over them)."""
    return sharding.place(tree, self.mesh, self.rules)

  def score(self, state: TrainState, out: Rollout, rewards, correct, *, critic_only: bool = False):
    """The `TrainBatch` of a verified rollout (rewards and verdicts `[B]`) and its statistics (device
    scalars), in one program: values, log-probs, advantages. `critic_only` (value pretraining):
    values and Monte-Carlo returns, no actor forward."""
    return self._score[critic_only](state, out, rewards, correct)

  def _score_program(self, state: TrainState, out: Rollout, rewards, correct, *, critic_only: bool):
    config, algo, mask = self.config, self.config.algo, out.response_mask
    tokens, attention = join(out.prompt_tokens, out.prompt_mask, out.response_tokens, mask)
    chunks = {"response_len": mask.shape[1], "micro": self.micro, "shards": self.shards}
    lengths = jnp.sum(mask, axis=-1)
    token_rewards = advantages.last_token_rewards(rewards, mask)
    value = values(self.critic_def, state.critic, tokens, attention, **chunks) if algo.uses_critic else None
    stats = {"rollout/reward_mean": jnp.mean(rewards), "rollout/accuracy": jnp.mean(correct.astype(jnp.float32)),
             "actor/positive_frac": jnp.mean(correct.astype(jnp.float32)),
             "rollout/response_len_mean": jnp.mean(lengths), "rollout/response_len_min": jnp.min(lengths),
             "rollout/truncated_frac": jnp.mean((lengths >= config.rollout.max_response_tokens).astype(jnp.float32))}
    if critic_only:
      returns = advantages.monte_carlo_returns(token_rewards, mask, gamma=algo.gamma)
      stats["critic/explained_variance"] = losses.explained_variance(value, returns, mask)
      return TrainBatch(tokens, attention, mask, returns, value, correct), stats
    old_logprobs, entropy = logprobs_and_entropy(self.actor_def, state.actor, tokens, attention, chunk=self.chunk,
                                                 **chunks)
    ref = (logprobs_and_entropy(self.actor_def, state.ref, tokens, attention, chunk=self.chunk, **chunks)[0]
           if state.ref is not None else None)
    est = algorithm.compute_advantages(algo, token_rewards, jnp.where(mask, value, 0.0) if value is not None
                                       else jnp.zeros(mask.shape, jnp.float32), mask, rewards,
                                       group_size=config.rollout.samples_per_prompt)
    critic_stats = {"critic/explained_variance": losses.explained_variance(value, est.returns, mask),
                    "critic/value_mean": masked.masked_mean(value, mask)} if value is not None else {
                        "critic/explained_variance": 0.0, "critic/value_mean": 0.0}
    stats |= critic_stats | {
        "actor/entropy": masked.masked_mean(entropy, mask),  # Of the rollout policy, on this batch.
        "rollout/logprob_gap": masked.masked_mean(jnp.abs(out.policy_logprobs - old_logprobs), mask),
        "critic/return_mean": masked.masked_mean(est.returns, mask),
        "adv/lam_actor_mean": jnp.mean(est.lam_actor), "adv/lam_actor_min": jnp.min(est.lam_actor),
        "adv/lam_actor_max": jnp.max(est.lam_actor), "adv/mean_abs": masked.masked_mean(jnp.abs(est.advantages), mask)}
    return TrainBatch(tokens, attention, mask, est.returns, value, correct, old_logprobs, est.advantages, ref), stats

  def _state_program(self, name, fn, state: TrainState):
    """`fn(state, batch)` jitted with the state donated and its output placed like `state`."""
    layout = jax.tree.map(lambda x: x.sharding, state)
    key = (name, jax.tree.structure(state))
    if key not in self._programs:
      self._programs[key] = self.jit(fn, donate_argnums=(0,), out_shardings=(layout, None))
    return self._programs[key]

  def ppo_update(self, state: TrainState, batch: TrainBatch, *, actor: bool, critic: bool):
    """`ppo_epochs` passes of shuffled mini-batch updates of the critic and/or actor; metrics
    averaged over the updates."""
    return self._state_program(("ppo", actor, critic), functools.partial(self._ppo, actor=actor, critic=critic),
                               state)(state, batch)

  def _ppo(self, state: TrainState, batch: TrainBatch, *, actor: bool, critic: bool):
    algo = self.config.algo
    size = batch.response_mask.shape[0]
    mini = min(algo.mini_batch_responses, size)
    micro = min(self.micro, mini)
    key, *epoch_keys = jax.random.split(state.key, algo.ppo_epochs + 1)
    row_sharded = lambda x: sharding.constrain(x, ("batch",) + (None,) * (x.ndim - 1))

    def one_update(state: TrainState, rows):
      mb = jax.tree.map(lambda x: row_sharded(x[rows]), batch)
      metrics = {}
      if critic:
        params, opt, m = critic_update(self.critic_def, self.txs["critic"], state.critic, state.critic_opt, mb,
                                       algo=algo, micro=micro, shards=self.shards)
        state, metrics = state._replace(critic=params, critic_opt=opt), metrics | m
      if actor:
        params, opt, m = actor_update(self.actor_def, self.txs["actor"], state.actor, state.actor_opt, mb,
                                      algo=algo, micro=micro, shards=self.shards, chunk=self.chunk)
        state, metrics = state._replace(actor=params, actor_opt=opt), metrics | m
      return state, metrics

    def epoch(state: TrainState, epoch_key):
      order = jax.random.permutation(epoch_key, size)[:size // mini * mini].reshape(size // mini, mini)
      return jax.lax.scan(one_update, state, order)

    state, metrics = jax.lax.scan(epoch, state._replace(key=key), jnp.stack(epoch_keys))
    return state, jax.tree.map(jnp.mean, metrics)

  def sft_update(self, state: TrainState, batch: TrainBatch):
    micro = math.gcd(self.micro, batch.response_mask.shape[0])

    def fn(state: TrainState, batch: TrainBatch):
      params, opt, m = sft_update(self.actor_def, self.txs["sft"], state.actor, state.sft_opt, batch, micro=micro,
                                  shards=self.shards, chunk=self.chunk)
      return state._replace(actor=params, sft_opt=opt), m
    return self._state_program("sft", fn, state)(state, batch)
