"""The jitted programs of training: scoring a rollout, and the actor / critic / supervised updates.

  steps = Steps(config, mesh, rules, actor_def=..., critic_def=..., actor_tx=..., critic_tx=..., sft_tx=...)
  batch, stats = steps.score(state, rollout, rewards, correct)        # one program
  state, metrics = steps.ppo_update(state, batch, actor=True, critic=True)

Models are handled functionally: a graphdef (static) and a parameter `nnx.State` (a pytree), all
held in one `state.TrainState`. Every update takes a mini-batch, splits it into micro-batches
and accumulates gradients with `lax.scan`; losses use the whole mini-batch's denominators
(`algorithm.Denominators`), so the accumulated gradient equals the mini-batch gradient exactly.

Two layouts (`packing.enabled`), the same programs: padded, a micro-batch is `micro` sequences of
S tokens; packed (`packed_batch`: `plan = steps.plan(state, rollout)` on the host, then
`score(..., plan=plan)` and `ppo_update(..., plan=plan)`), a micro-batch is m rows of L tokens
holding whole sequences end to end, the losses' arrays at the rows' prediction columns, and
micro-batches without a response token are skipped.

`Steps` jits them for one run: each takes and returns the `TrainState` (donated, with the output
laid out as the input), and each is traced with the run's sharding rules bound, so no program can
run unconstrained.

Shapes: `B` sequences, `S` = `Tp` + `Tr` positions (left-padded prompt, then the response), `Tr`
response tokens. The hidden state at position Tp − 1 + t predicts response token t, and the
critic's output there is V(s_t), the value before response token t.
"""

import functools
import math
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from vapo_jax import distributed
from vapo_jax.config import AlgoConfig, ExperimentConfig
from vapo_jax.errors import ConfigError
from vapo_jax.models import sharding
from vapo_jax.models.logprobs import packed_token_logprobs, response_logprobs
from vapo_jax.models.transformer import positions_from_mask
from vapo_jax.rl import advantages, losses, masked
from vapo_jax.rollout.common import Rollout
from vapo_jax.train import algorithm, micro_batches, packed_batch
from vapo_jax.train.packed_batch import PackedBatch, RowBatch
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
  value_mask: jax.Array | None = None  # [B, Tr] tokens of the value loss (None: response_mask).


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
  return batch.rows if isinstance(batch, PackedBatch) else micro_batches.split(batch, micro, shards)


def _sequences(batch: TrainBatch | PackedBatch) -> tuple[jax.Array, jax.Array]:
  """Response lengths and verdicts `[n]` of a mini-batch's sequences, in either layout."""
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


def logprobs_and_entropy(graphdef, params, tokens, attention_mask, *, response_len, chunk, micro=None, shards=1):
  """log π(o_t) and the entropy `[B, Tr]`, computed `micro` sequences at a time (None: all at once)."""
  fn = lambda p, args: response_logprobs(nnx.merge(graphdef, p), *args, response_len, chunk=chunk, entropy=True)
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


def actor_update(graphdef, tx, params, opt_state, batch: TrainBatch | PackedBatch, *, algo: AlgoConfig, micro: int,
                 shards: int = 1, chunk: int, response_len: int | None = None):
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
        ref_logprobs=mb.ref_logprobs if algo.kl_coef > 0 else None, entropy=entropy, denominators=denominators,
        segment_ids=mb.segment_ids if isinstance(mb, RowBatch) else None, norm_length=norm_length)
    return loss, (loss, metrics)

  chunks = _chunks(batch, micro, shards)
  params, opt_state, metrics = micro_batches.optimizer_step(loss_fn, tx, params, opt_state, chunks, prefix="actor",
                                                            loss_name="loss")
  return params, opt_state, metrics | {"actor/positive_frac": jnp.mean(verdicts.astype(jnp.float32))}


def critic_update(graphdef, tx, params, opt_state, batch: TrainBatch | PackedBatch, *, algo: AlgoConfig, micro: int,
                  shards: int = 1):
  """One optimizer update of the critic towards `batch.returns` on a mini-batch."""
  fitted = lambda b: b.response_mask if b.value_mask is None else b.value_mask
  denominator = _value_tokens(batch)

  def loss_fn(p, mb: TrainBatch | RowBatch):
    v = _values(nnx.merge(graphdef, p), mb)
    loss, metrics = losses.value_loss(v, mb.old_values, mb.returns, fitted(mb),
                                      clip_range=algo.value_clip, denominator=denominator)
    metrics = {f"critic/{k}": val for k, val in metrics.items() if k != "explained_variance"}
    return loss, (loss, metrics)

  return micro_batches.optimizer_step(loss_fn, tx, params, opt_state, _chunks(batch, micro, shards), prefix="critic",
                                      loss_name="value_loss")


def sft_update(graphdef, tx, params, opt_state, batch: TrainBatch | PackedBatch, *, micro: int, shards: int = 1,
               chunk: int):
  """One supervised update: token-level NLL of the response tokens (demonstrations)."""
  denominator = jnp.sum(_sequences(batch)[0]).astype(jnp.float32)

  def loss_fn(p, mb: TrainBatch | RowBatch):
    logprobs, _ = _policy(nnx.merge(graphdef, p), mb, chunk=chunk, entropy=False)
    loss = losses.aggregate_loss(-logprobs, mb.response_mask, mode="token-mean", denominator=denominator)
    return loss, (loss, {})

  return micro_batches.optimizer_step(loss_fn, tx, params, opt_state, _chunks(batch, micro, shards), prefix="sft",
                                      loss_name="nll")


def mini_batch_orders(key: jax.Array, size: int, mini: int, epochs: int) -> tuple[jax.Array, jax.Array]:
  """The state's next key and the sequence ids `[E, K, mini]` of each epoch's K = size // mini shuffled
  mini-batches (the same in both layouts: the packed host plan fetches them)."""
  key, *epoch_keys = jax.random.split(key, epochs + 1)
  orders = [jax.random.permutation(k, size)[:size // mini * mini].reshape(size // mini, mini) for k in epoch_keys]
  return key, jnp.stack(orders)


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
    self.replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    self.packed = config.packing.enabled
    self.row_tokens, self.micro_rows = packed_batch.row_tokens(config), packed_batch.micro_rows(config, self.shards)
    if self.packed and self.micro_rows % self.shards:
      raise ConfigError(f"PackingConfig.micro_batch_rows must be a multiple of the data-parallel devices "
                        f"(mesh data x fsdp = {self.shards}), got {self.micro_rows}")
    self._programs = {}
    self._plan_inputs = self.jit(self._plan_inputs_program, out_shardings=self.replicated)

  def jit(self, fn, **kwargs):
    """`jax.jit(fn)` traced with the run's sharding rules bound (so `constrain` always applies)."""
    return sharding.jit(fn, self.mesh, self.rules, **kwargs)

  def place(self, tree):
    """Host arrays (the same on every process) → global arrays split over the batch axes (replicated
    when the batch does not divide evenly over them)."""
    return sharding.place(tree, self.mesh, self.rules)

  def _program(self, key, make):
    if key not in self._programs:
      self._programs[key] = make()
    return self._programs[key]

  # --------------------------------------------------------------------------- packed rows
  def _mini(self, size: int) -> int:
    return min(self.config.algo.mini_batch_responses, size)

  def _plan_inputs_program(self, key, prompt_mask, response_mask):
    """`[2 + E, B]` int32: prompt and response lengths, then each epoch's mini-batch orders."""
    size, epochs = response_mask.shape[0], self.config.algo.ppo_epochs
    _, orders = mini_batch_orders(key, size, self._mini(size), epochs)
    lengths = [jnp.sum(m, axis=-1, dtype=jnp.int32) for m in (prompt_mask, response_mask)]
    return jnp.concatenate([jnp.stack(lengths), orders.reshape(epochs, size)]).astype(jnp.int32)

  def plan(self, state: TrainState, out: Rollout) -> packed_batch.Plan | None:
    """Packed rows for this step's scoring and mini-batches (None when `packing.enabled` is false).
    Host transfers: the lengths and mini-batch orders `[2 + E, B]` int32 come to the host (the
    orders from the state's key, as the update draws them); each sequence's (row, offset) go back."""
    if not self.packed:
      return None
    start = time.perf_counter()
    host = np.asarray(self._plan_inputs(state.key, out.prompt_mask, out.response_mask))
    orders = host[2:].reshape(self.config.algo.ppo_epochs, -1, self._mini(host.shape[1]))
    found = packed_batch.plan(host[0], host[1], orders, row_tokens=self.row_tokens, micro_rows=self.micro_rows)
    return found._replace(placement=distributed.global_array(found.placement, self.replicated),
                          scoring_metrics=found.scoring_metrics | {"time/pack_s": time.perf_counter() - start})

  def sft_plan(self, batch: TrainBatch) -> packed_batch.Plan | None:
    """Packed rows of a host batch of demonstrations (one mini-batch, no scoring)."""
    if not self.packed:
      return None
    response = np.sum(batch.response_mask, axis=-1)
    found = packed_batch.plan(np.sum(batch.attention_mask, axis=-1) - response, response,
                              np.arange(response.size)[None, None], row_tokens=self.row_tokens,
                              micro_rows=self.micro_rows, phase="sft")
    return found._replace(placement=distributed.global_array(found.placement, self.replicated))

  def _rows(self, batch: TrainBatch, lengths: packed_batch.Lengths, sequences, place, rows: int) -> PackedBatch:
    return packed_batch.mini_batch(batch, sequences, lengths, place[0], place[1], rows=rows,
                                   micro_rows=self.micro_rows, row_tokens=self.row_tokens)

  # ------------------------------------------------------------------------------ scoring
  def score(self, state: TrainState, out: Rollout, rewards, correct, *, critic_only: bool = False,
            plan: packed_batch.Plan | None = None):
    """The `TrainBatch` of a verified rollout (rewards and verdicts `[B]`) and its statistics (device
    scalars), in one program: values, log-probs, advantages. `critic_only` (value pretraining):
    values and Monte-Carlo returns, no actor forward. `plan`: on packed rows (`plan`)."""
    program = self.score_program(critic_only=critic_only, rows=plan and plan.scoring_rows)
    batch, stats = program(state, out, rewards, correct, plan and plan.placement)
    return batch, stats | (plan.scoring_metrics if plan else {})

  def score_program(self, *, critic_only: bool = False, rows: int | None = None):
    """The jitted program `score` runs: `(state, rollout, rewards, correct, placement) -> (batch, stats)`;
    `rows`: packed scoring's row count (`Plan.scoring_rows`; None: padded, placement None)."""
    return self._program(("score", critic_only, rows), lambda: self.jit(
        functools.partial(self._score_program, critic_only=critic_only, rows=rows)))

  def _forward(self, state: TrainState, tokens, attention, mask, place, *, critic_only: bool, rows: int | None):
    """Values, log-probs, entropy and reference log-probs `[B, Tr]` (None where not computed)."""
    use_critic, use_ref = self.config.algo.uses_critic, state.ref is not None and not critic_only
    if place is None:
      chunks = {"response_len": mask.shape[1], "micro": self.micro, "shards": self.shards}
      policy = lambda params: logprobs_and_entropy(self.actor_def, params, tokens, attention, chunk=self.chunk,
                                                   **chunks)
      value = values(self.critic_def, state.critic, tokens, attention, **chunks) if use_critic else None
    else:
      lengths = packed_batch.Lengths.of(attention, mask)
      inputs, unpack = packed_batch.scoring_rows(tokens, lengths, place[0], place[1], response_len=mask.shape[1],
                                                 rows=rows, micro_rows=self.micro_rows, row_tokens=self.row_tokens)
      policy = lambda params: tuple(map(unpack, packed_logprobs_and_entropy(self.actor_def, params, inputs,
                                                                            chunk=self.chunk)))
      value = unpack(packed_values(self.critic_def, state.critic, inputs)) if use_critic else None
    if critic_only:
      return value, None, None, None
    old_logprobs, entropy = policy(state.actor)
    return value, old_logprobs, entropy, policy(state.ref)[0] if use_ref else None

  def _score_program(self, state: TrainState, out: Rollout, rewards, correct, place, *, critic_only: bool,
                     rows: int | None):
    config, algo, mask = self.config, self.config.algo, out.response_mask
    tokens, attention = join(out.prompt_tokens, out.prompt_mask, out.response_tokens, mask)
    lengths = jnp.sum(mask, axis=-1)
    token_rewards = advantages.last_token_rewards(rewards, mask)
    scoring_place = None if place is None else place[0]
    value, old_logprobs, entropy, ref = self._forward(state, tokens, attention, mask, scoring_place,
                                                      critic_only=critic_only, rows=rows)
    stats = {"rollout/reward_mean": jnp.mean(rewards), "rollout/accuracy": jnp.mean(correct.astype(jnp.float32)),
             "actor/positive_frac": jnp.mean(correct.astype(jnp.float32)),
             "rollout/response_len_mean": jnp.mean(lengths), "rollout/response_len_min": jnp.min(lengths),
             "rollout/prompt_len_mean": jnp.mean(jnp.sum(out.prompt_mask, axis=-1)),
             "rollout/truncated_frac": jnp.mean((lengths >= config.rollout.max_response_tokens).astype(jnp.float32))}
    if place is None:
      stats["perf/padding_frac_scoring"] = 1.0 - jnp.mean(attention.astype(jnp.float32))
    if critic_only:
      returns, fitted = algorithm.value_targets(algo, token_rewards, mask)
      stats["critic/explained_variance"] = losses.explained_variance(value, returns, fitted)
      stats |= algorithm.position_metrics(None, value, returns, mask)
      return TrainBatch(tokens, attention, mask, returns, value, correct, value_mask=fitted), stats
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
    stats |= algorithm.position_metrics(
        est, value, None if value is None else advantages.monte_carlo_returns(token_rewards, mask, gamma=algo.gamma),
        mask)
    return TrainBatch(tokens, attention, mask, est.returns, value, correct, old_logprobs, est.advantages, ref), stats

  # ------------------------------------------------------------------------------ updates
  def _state_program(self, name, fn, state: TrainState):
    """`fn(state, ...)` jitted with the state donated and its output placed like `state`."""
    layout = jax.tree.map(lambda x: x.sharding, state)
    return self._program((name, jax.tree.structure(state)), lambda: self.jit(
        fn, donate_argnums=(0,), out_shardings=(layout, None)))

  def ppo_update(self, state: TrainState, batch: TrainBatch, *, actor: bool, critic: bool,
                 plan: packed_batch.Plan | None = None):
    """`ppo_epochs` passes of shuffled mini-batch updates of the critic and/or actor; metrics
    averaged over the updates. `plan`: on packed rows (`plan`)."""
    program = self.ppo_program(state, actor=actor, critic=critic, rows=plan and plan.update_rows)
    state, metrics = program(state, batch, plan and plan.placement)
    if plan is None:
      mini = self._mini(batch.response_mask.shape[0])
      return state, metrics | {"perf/micro_batches": float(mini // min(self.micro, mini))}
    return state, metrics | plan.update_metrics

  def ppo_program(self, state: TrainState, *, actor: bool, critic: bool, rows: int | None = None):
    """The jitted program `ppo_update` runs for a state laid out like `state`: `(state, batch,
    placement) -> (state, metrics)`; `rows`: a packed mini-batch's row count (`Plan.update_rows`)."""
    return self._state_program(("ppo", actor, critic, rows), functools.partial(
        self._ppo, actor=actor, critic=critic, rows=rows), state)

  def _ppo(self, state: TrainState, batch: TrainBatch, places, *, actor: bool, critic: bool, rows: int | None):
    algo = self.config.algo
    size = batch.response_mask.shape[0]
    mini = self._mini(size)
    micro = min(self.micro, mini)
    key, orders = mini_batch_orders(state.key, size, mini, algo.ppo_epochs)
    lengths = packed_batch.Lengths.of(batch.attention_mask, batch.response_mask)  # Once, for every mini-batch.
    row_sharded = lambda x: sharding.constrain(x, ("batch",) + (None,) * (x.ndim - 1))
    tr = batch.response_mask.shape[1]

    def one_update(state: TrainState, sequences, place):
      mb = (jax.tree.map(lambda x: row_sharded(x[sequences]), batch) if rows is None
            else self._rows(batch, lengths, sequences, place, rows))
      metrics = {}
      if critic:
        params, opt, m = critic_update(self.critic_def, self.txs["critic"], state.critic, state.critic_opt, mb,
                                       algo=algo, micro=micro, shards=self.shards)
        state, metrics = state._replace(critic=params, critic_opt=opt), metrics | m
      if actor:
        params, opt, m = actor_update(self.actor_def, self.txs["actor"], state.actor, state.actor_opt, mb,
                                      algo=algo, micro=micro, shards=self.shards, chunk=self.chunk, response_len=tr)
        state, metrics = state._replace(actor=params, actor_opt=opt), metrics | m
      return state, metrics

    def epoch(state: TrainState, xs):
      order, place = xs
      return jax.lax.scan(lambda s, sequences: one_update(s, sequences, place), state, order)

    places = jnp.zeros((algo.ppo_epochs,), jnp.int32) if places is None else places[1:]  # Scoring's is first.
    state, metrics = jax.lax.scan(epoch, state._replace(key=key), (orders, places))
    padded = {} if rows else {"perf/padding_frac_update": 1.0 - jnp.mean(batch.attention_mask.astype(jnp.float32))}
    return state, jax.tree.map(jnp.mean, metrics) | padded

  def sft_update(self, state: TrainState, batch: TrainBatch, plan: packed_batch.Plan | None = None):
    """One supervised update on a placed batch of demonstrations (`plan`: from `sft_plan`)."""
    size = batch.response_mask.shape[0]
    program = self.sft_program(state, size, rows=plan and plan.update_rows)
    state, metrics = program(state, batch, plan and plan.placement)
    return state, metrics | (plan.update_metrics if plan else {"perf/micro_batches": float(
        size // math.gcd(self.micro, size))})

  def sft_program(self, state: TrainState, size: int, *, rows: int | None = None):
    """The jitted program `sft_update` runs on batches of `size` demonstrations: `(state, batch,
    placement) -> (state, metrics)`; `rows`: packed, the rows they fill (`Plan.update_rows`)."""
    micro = math.gcd(self.micro, size)

    def fn(state: TrainState, batch: TrainBatch, place):
      lengths = packed_batch.Lengths.of(batch.attention_mask, batch.response_mask)
      mb = batch if place is None else self._rows(batch, lengths, jnp.arange(lengths.response.shape[0]), place[1], rows)
      params, opt, m = sft_update(self.actor_def, self.txs["sft"], state.actor, state.sft_opt, mb, micro=micro,
                                  shards=self.shards, chunk=self.chunk)
      padded = {} if rows else {"perf/padding_frac_sft": 1.0 - jnp.mean(batch.attention_mask.astype(jnp.float32))}
      return state._replace(actor=params, sft_opt=opt), m | padded
    return self._state_program(("sft", micro, rows), fn, state)
