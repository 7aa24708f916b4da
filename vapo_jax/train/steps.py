"""The jitted programs of training: scoring a rollout, and the actor / critic / supervised updates.

  steps = Steps(config, mesh, rules, actor_def=..., critic_def=..., actor_tx=..., critic_tx=..., sft_tx=...)
  batch, stats = steps.score(state, rollout, rewards, correct)        # one program
  state, metrics = steps.ppo_update(state, batch, actor=True, critic=True)

Models are handled functionally: a graphdef (static) and a parameter `nnx.State` (a pytree), all
held in one `state.TrainState`; the forward passes and updates of a mini-batch are pure functions
(`train/updates.py`: micro-batches, gradients accumulated with `lax.scan` against the whole
mini-batch's denominators, so the accumulated gradient equals the mini-batch gradient exactly).

Two layouts (`packing.enabled`), the same programs: padded, a micro-batch is `micro` sequences of
S tokens; packed (`packed_batch`: `plan = steps.plan_packing(state, rollout)` on the host, then
`score(..., plan=plan)` and `ppo_update(..., plan=plan)`), a micro-batch is m rows of L tokens
holding whole sequences end to end, the losses' arrays at the rows' prediction columns, and
micro-batches without a response token are skipped.

`Steps` jits them for one run: each takes and returns the `TrainState` (donated, with the output
laid out as the input), and each is traced with the run's sharding rules bound, so no program can
run unconstrained. `shared(...)` hands a trainer the `Steps` an earlier trainer of the same programs built in
this process (a resumed run, a test's second trainer): its programs are traced and compiled once.
"""

import collections
import dataclasses
import functools
import math
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from vapo_jax import distributed
from vapo_jax.config import ExperimentConfig
from vapo_jax.errors import ConfigError
from vapo_jax.models import sharding
from vapo_jax.rl import advantages, losses, masked
from vapo_jax.rollout.common import Rollout
from vapo_jax.train import algorithm, packed_batch, packing
from vapo_jax.train.packed_batch import PackedBatch
from vapo_jax.train.state import TrainState
from vapo_jax.train.updates import (
  TrainBatch,
  actor_update,
  critic_update,
  join,
  logprobs_and_entropy,
  mini_batch_orders,
  packed_logprobs_and_entropy,
  packed_values,
  sft_update,
  values,
)


def warn_padded_micro_batches(config, micro_rows: int, shards: int) -> None:
  """Warns when `packing.micro_batch_rows` is more rows than a mini-batch's sequences fill (one a row at the
  most): the rest of every micro-batch is padding computed."""
  most = min(config.algo.mini_batch_responses, config.rollout.responses_per_step)
  if micro_rows > most:
    fits = max(shards, most // shards * shards)
    warnings.warn(f"packing.micro_batch_rows={micro_rows} is more rows than a mini-batch of {most} sequences "
                  f"packs into (one a row at the most): {1 - most / micro_rows:.0%} of each update's "
                  f"micro-batch is padding at least; packing.micro_batch_rows={fits} fits", stacklevel=3)


_SHARED: collections.OrderedDict = collections.OrderedDict()
_KEEP = 4  # Trainers' `Steps` kept for later ones in this process (their programs' executables with them).


def shared(config: ExperimentConfig, mesh, rules, *, actor_def, critic_def, optimizers) -> "Steps":
  """The `Steps` of a run with `config` on `mesh`: the one built for an earlier trainer in this process whose
  programs are the same (an equal config but for the directory the run writes under, `run_dir`; the same mesh
  and model graphs), else a new one with `optimizers()` ({"actor", "critic", "sft"}: optax transformations,
  which follow from the config). Its checks and warnings apply to every run, reused or not."""
  key = (dataclasses.replace(config, run_dir="runs"), mesh, actor_def, critic_def)
  if key in _SHARED:
    check(config, mesh)
  else:
    txs = optimizers()
    _SHARED[key] = Steps(config, mesh, rules, actor_def=actor_def, critic_def=critic_def,
                         actor_tx=txs["actor"], critic_tx=txs["critic"], sft_tx=txs["sft"])
    while len(_SHARED) > _KEEP:
      _SHARED.popitem(last=False)
  _SHARED.move_to_end(key)
  return _SHARED[key]


def check(config: ExperimentConfig, mesh) -> None:
  """Refuses packed rows that do not split over the data-parallel devices; warns of micro-batches mostly padding."""
  shards = mesh.shape["data"] * mesh.shape["fsdp"]
  micro_rows = packed_batch.micro_rows(config, shards)
  if config.packing.enabled and micro_rows % shards:
    raise ConfigError(f"PackingConfig.micro_batch_rows must be a multiple of the data-parallel devices "
                      f"(mesh data x fsdp = {shards}), got {micro_rows}")
  if config.packing.enabled:
    warn_padded_micro_batches(config, micro_rows, shards)


class Steps:
  """The run's jitted programs, `(state, batch) -> (state, metrics)` with the state donated and laid
  out as it came in; built once from the run's config, mesh, rules, graphdefs and optimizers."""

  def __init__(self, config: ExperimentConfig, mesh, rules, *, actor_def, critic_def, actor_tx, critic_tx,
               sft_tx):
    self.config, self.mesh, self.rules = config, mesh, rules
    self.actor_def, self.critic_def = actor_def, critic_def
    self.txs = {"actor": actor_tx, "critic": critic_tx, "sft": sft_tx}
    self.micro = config.algo.micro_batch_responses or config.algo.mini_batch_responses
    self.shards = mesh.shape["data"] * mesh.shape["fsdp"]
    self.chunk = config.model.logits_chunk
    self.rows = jax.sharding.NamedSharding(mesh, sharding.partition_spec(("batch",), rules))
    self.replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    self.packed = config.packing.enabled
    self.row_tokens, self.micro_rows = packed_batch.row_tokens(config), packed_batch.micro_rows(config,
                                                                                                self.shards)
    check(config, mesh)
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
  def largest_rows(self, sequences: int) -> int | None:
    """The most rows a plan compiles for a group of `sequences` (each in a row of its own: every
    response at the cap); None when padded. What the compile report compiles."""
    return packing.bucket_rows(sequences, multiple=self.micro_rows) if self.packed else None

  def _mini(self, size: int) -> int:
    return min(self.config.algo.mini_batch_responses, size)

  def _plan_inputs_program(self, key, prompt_mask, response_mask):
    """`[2 + E, B]` int32: prompt and response lengths, then each epoch's mini-batch orders."""
    size, epochs = response_mask.shape[0], self.config.algo.ppo_epochs
    _, orders = mini_batch_orders(key, size, self._mini(size), epochs)
    lengths = [jnp.sum(m, axis=-1, dtype=jnp.int32) for m in (prompt_mask, response_mask)]
    return jnp.concatenate([jnp.stack(lengths), orders.reshape(epochs, size)]).astype(jnp.int32)

  def plan_packing(self, state: TrainState, out: Rollout) -> packed_batch.RowPlan | None:
    """Packed rows for this step's scoring and mini-batches (None when `packing.enabled` is false).
    Host transfers: the lengths and mini-batch orders `[2 + E, B]` int32 come to the host (the
    orders from the state's key, as the update draws them); each sequence's (row, offset) go back."""
    if not self.packed:
      return None
    start = time.perf_counter()
    host = np.asarray(self._plan_inputs(state.key, out.prompt_mask, out.response_mask))
    orders = host[2:].reshape(self.config.algo.ppo_epochs, -1, self._mini(host.shape[1]))
    found = packed_batch.plan_rows(host[0], host[1], orders, row_tokens=self.row_tokens,
                                   micro_rows=self.micro_rows, fill=self.config.packing.fill_micro_batches)
    members = None if found.members is None else distributed.global_array(found.members, self.replicated)
    return found._replace(placement=distributed.global_array(found.placement, self.replicated), members=members,
                          scoring_metrics=found.scoring_metrics | {"time/pack_s": time.perf_counter() - start})

  def sft_plan(self, batch: TrainBatch) -> packed_batch.RowPlan | None:
    """Packed rows of a host batch of demonstrations (one mini-batch, no scoring)."""
    if not self.packed:
      return None
    response = np.sum(batch.response_mask, axis=-1)
    found = packed_batch.plan_rows(np.sum(batch.attention_mask, axis=-1) - response, response,
                                   np.arange(response.size)[None, None], row_tokens=self.row_tokens,
                                   micro_rows=self.micro_rows, phase="sft")
    return found._replace(placement=distributed.global_array(found.placement, self.replicated))

  def _rows(self, batch: TrainBatch, lengths: packed_batch.Lengths, sequences, place,
            rows: int) -> PackedBatch:
    return packed_batch.mini_batch(batch, sequences, lengths, place[0], place[1], rows=rows,
                                   micro_rows=self.micro_rows, row_tokens=self.row_tokens)

  # ------------------------------------------------------------------------------ scoring
  def score(self, state: TrainState, out: Rollout, rewards, correct, *, critic_only: bool = False,
            plan: packed_batch.RowPlan | None = None, prefixes: algorithm.PrefixLabels | None = None):
    """The `TrainBatch` of a verified rollout (rewards and verdicts `[B]`) and its statistics (device
    scalars), in one program: values, log-probs, advantages. `critic_only` (value pretraining):
    values and Monte-Carlo returns, no actor forward. `plan`: on packed rows (`plan_packing`).
    `prefixes`: value pretraining's prefix labels (`algo.value_pretrain_target="prefix"`)."""
    program = self.score_program(critic_only=critic_only, rows=plan and plan.scoring_rows)
    batch, stats = program(state, out, rewards, correct, plan and plan.placement, prefixes)
    return batch, stats | (plan.scoring_metrics if plan else {})

  def score_program(self, *, critic_only: bool = False, rows: int | None = None):
    """The jitted program `score` runs: `(state, rollout, rewards, correct, placement[, prefixes]) -> (batch,
    stats)`;
    `rows`: packed scoring's row count (`RowPlan.scoring_rows`; None: padded, placement None)."""
    return self._program(("score", critic_only, rows), lambda: self.jit(
        functools.partial(self._score_program, critic_only=critic_only, rows=rows)))

  def _forward(self, state: TrainState, tokens, attention, mask, place, *, critic_only: bool,
               rows: int | None):
    """Values, log-probs, entropy and reference log-probs `[B, Tr]` (None where not computed)."""
    use_critic, use_ref = self.config.algo.uses_critic, state.ref is not None and not critic_only
    if place is None:
      chunks = {"response_len": mask.shape[1], "micro": self.micro, "shards": self.shards}
      policy = lambda params: logprobs_and_entropy(self.actor_def, params, tokens, attention,
                                                   chunk=self.chunk, **chunks)
      value = values(self.critic_def, state.critic, tokens, attention, **chunks) if use_critic else None
    else:
      lengths = packed_batch.Lengths.of(attention, mask)
      inputs, unpack = packed_batch.scoring_rows(tokens, lengths, place[0], place[1],
                                                 response_len=mask.shape[1],
                                                 rows=rows, micro_rows=self.micro_rows,
                                                 row_tokens=self.row_tokens)
      policy = lambda params: tuple(map(unpack, packed_logprobs_and_entropy(self.actor_def, params, inputs,
                                                                            chunk=self.chunk)))
      value = unpack(packed_values(self.critic_def, state.critic, inputs)) if use_critic else None
    if critic_only:
      return value, None, None, None
    old_logprobs, entropy = policy(state.actor)
    return value, old_logprobs, entropy, policy(state.ref)[0] if use_ref else None

  def _score_program(self, state: TrainState, out: Rollout, rewards, correct, place, prefixes=None, *,
                     critic_only: bool, rows: int | None):
    config, algo, mask = self.config, self.config.algo, out.response_mask
    tokens, attention = join(out.prompt_tokens, out.prompt_mask, out.response_tokens, mask)
    token_rewards = advantages.last_token_rewards(rewards, mask)
    scoring_place = None if place is None else place[0]
    value, old_logprobs, entropy, ref = self._forward(state, tokens, attention, mask, scoring_place,
                                                      critic_only=critic_only, rows=rows)
    stats = algorithm.batch_metrics(rewards, correct, mask, out.prompt_mask,
                                    max_response_tokens=config.rollout.max_response_tokens)
    if place is None:
      stats["perf/padding_frac_scoring"] = 1.0 - jnp.mean(attention.astype(jnp.float32))
    if critic_only:
      returns, fitted = algorithm.value_targets(algo, token_rewards, mask, prefixes)
      stats["critic/explained_variance"] = losses.explained_variance(value, returns, fitted)
      # The bias V − G against the Monte-Carlo return G (a prefix's target is its own verdict, not G).
      stats |= algorithm.position_metrics(None, value, advantages.monte_carlo_returns(token_rewards, mask,
                                                                                    gamma=algo.gamma), mask)
      return TrainBatch(tokens, attention, mask, returns, value, correct, value_mask=fitted), stats
    est = algorithm.compute_advantages(algo, token_rewards, jnp.where(mask, value, 0.0) if value is not None
                                       else jnp.zeros(mask.shape, jnp.float32), mask, rewards,
                                       group_size=config.rollout.samples_per_prompt)
    stats |= algorithm.advantage_metrics(est, value, entropy, jnp.abs(out.policy_logprobs - old_logprobs),
                                         mask)
    log_ratio = jnp.where(mask, old_logprobs - out.sampler_logprobs, 0.0)  # log π_old / π_sampler per token.
    stats["rollout/sampler_kl"] = masked.masked_mean(jnp.exp(log_ratio) - 1.0 - log_ratio, mask)  # k3, ≥ 0.
    stats |= algorithm.position_metrics(
        est, value,
        None if value is None else advantages.monte_carlo_returns(token_rewards, mask, gamma=algo.gamma),
        mask)
    sampled = out.sampler_logprobs if algo.tis_cap is not None else None
    return TrainBatch(tokens, attention, mask, est.returns, value, correct, old_logprobs, est.advantages, ref,
                      sampler_logprobs=sampled), stats

  # ------------------------------------------------------------------------------ updates
  def _state_program(self, name, fn, state: TrainState):
    """`fn(state, ...)` jitted with the state donated and its output placed like `state`."""
    shardings = jax.tree.map(lambda x: x.sharding, state)
    return self._program((name, jax.tree.structure(state)), lambda: self.jit(
        fn, donate_argnums=(0,), out_shardings=(shardings, None)))

  def ppo_update(self, state: TrainState, batch: TrainBatch, *, actor: bool, critic: bool,
                 plan: packed_batch.RowPlan | None = None):
    """`ppo_epochs` passes of shuffled mini-batch updates of the critic and/or actor; metrics
    averaged over the updates. `plan`: on packed rows (`plan_packing`)."""
    program = self.ppo_program(state, actor=actor, critic=critic, rows=plan and plan.update_rows)
    state, metrics = program(state, batch, plan and plan.placement, plan and plan.members)
    if plan is None:
      mini = self._mini(batch.response_mask.shape[0])
      return state, metrics | {"perf/micro_batches": float(mini // min(self.micro, mini))}
    return state, metrics | plan.update_metrics

  def ppo_program(self, state: TrainState, *, actor: bool, critic: bool, rows: int | None = None):
    """The jitted program `ppo_update` runs for a state laid out like `state`: `(state, batch,
    placement, members) -> (state, metrics)`; `rows`: a packed mini-batch's row count (`RowPlan.update_rows`);
    `members`: the mini-batches' sequence ids (`RowPlan.members`), or None: the state key's orders."""
    return self._state_program(("ppo", actor, critic, rows), functools.partial(
        self._ppo, actor=actor, critic=critic, rows=rows), state)

  def _ppo(self, state: TrainState, batch: TrainBatch, places, members=None, *, actor: bool, critic: bool,
           rows: int | None):
    algo = self.config.algo
    size = batch.response_mask.shape[0]
    mini = self._mini(size)
    micro = min(self.micro, mini)
    key, orders = mini_batch_orders(state.key, size, mini, algo.ppo_epochs)
    orders = orders if members is None else members  # Cut by the plan from these same orders.
    lengths = packed_batch.Lengths.of(batch.attention_mask,
                                      batch.response_mask)  # Once, for every mini-batch.
    row_sharded = lambda x: sharding.constrain(x, ("batch",) + (None,) * (x.ndim - 1))
    tr = batch.response_mask.shape[1]

    def one_update(state: TrainState, sequences, place):
      mb = (_taken(batch, sequences, row_sharded) if rows is None
            else self._rows(batch, lengths, sequences, place, rows))
      metrics = {}
      if critic:
        params, opt, m = critic_update(self.critic_def, self.txs["critic"], state.critic, state.critic_opt,
                                       mb, algo=algo, micro=micro, shards=self.shards)
        state, metrics = state._replace(critic=params, critic_opt=opt), metrics | m
      if actor:
        params, opt, m = actor_update(self.actor_def, self.txs["actor"], state.actor, state.actor_opt, mb,
                                      algo=algo, micro=micro, shards=self.shards, chunk=self.chunk,
                                      response_len=tr)
        state, metrics = state._replace(actor=params, actor_opt=opt), metrics | m
      return state, metrics

    def epoch(state: TrainState, xs):
      order, place = xs
      return jax.lax.scan(lambda s, sequences: one_update(s, sequences, place), state, order)

    places = jnp.zeros((algo.ppo_epochs,), jnp.int32) if places is None else places[1:]  # Scoring's is first.
    state, metrics = jax.lax.scan(epoch, state._replace(key=key), (orders, places))
    padded = {} if rows else {"perf/padding_frac_update": 1.0 - jnp.mean(batch.attention_mask.astype(jnp.float32))}
    return state, jax.tree.map(jnp.mean, metrics) | padded

  def sft_update(self, state: TrainState, batch: TrainBatch, plan: packed_batch.RowPlan | None = None):
    """One supervised update on a placed batch of demonstrations (`plan`: from `sft_plan`)."""
    size = batch.response_mask.shape[0]
    program = self.sft_program(state, size, rows=plan and plan.update_rows)
    state, metrics = program(state, batch, plan and plan.placement)
    return state, metrics | (plan.update_metrics if plan else {"perf/micro_batches": float(
        size // math.gcd(self.micro, size))})

  def sft_program(self, state: TrainState, size: int, *, rows: int | None = None):
    """The jitted program `sft_update` runs on batches of `size` demonstrations: `(state, batch,
    placement) -> (state, metrics)`; `rows`: packed, the rows they fill (`RowPlan.update_rows`)."""
    micro = math.gcd(self.micro, size)

    def fn(state: TrainState, batch: TrainBatch, place):
      lengths = packed_batch.Lengths.of(batch.attention_mask, batch.response_mask)
      mb = batch if place is None else self._rows(batch, lengths, jnp.arange(lengths.response.shape[0]),
                                                  place[1], rows)
      params, opt, m = sft_update(self.actor_def, self.txs["sft"], state.actor, state.sft_opt, mb,
                                  micro=micro, shards=self.shards, chunk=self.chunk)
      padded = {} if rows else {"perf/padding_frac_sft": 1.0 - jnp.mean(batch.attention_mask.astype(jnp.float32))}
      return state._replace(actor=params, sft_opt=opt), m | padded
    return self._state_program(("sft", micro, rows), fn, state)


def _taken(batch: TrainBatch, sequences, constrain) -> TrainBatch:
  """The padded mini-batch `sequences` `[n]` of `batch`; an id −1 (past a shorter mini-batch's own,
  `RowPlan.members`) is no sequence: its row is there, with no response token, value target or verdict."""
  given = sequences >= 0
  mb = jax.tree.map(lambda x: constrain(x[sequences]), batch)
  tokens = lambda mask: None if mask is None else mask & given[:, None]
  return mb._replace(response_mask=tokens(mb.response_mask), value_mask=tokens(mb.value_mask),
                     is_positive=mb.is_positive & given)
