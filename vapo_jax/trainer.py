"""VAPO end to end: supervised warm start, value pretraining, then PPO with the VAPO techniques.

  trainer = Trainer(config); summary = trainer.run()

Each RL step draws P prompts, samples G responses each, scores them with the verifier, computes
the rollout policy's log-probs and the critic's values, the advantages the config selects
(`algorithm.compute_advantages`), and runs `updates_per_step` mini-batch updates of actor and
critic. The same loop runs VAPO, its ablations, vanilla PPO, GRPO and DAPO: only the config
differs. Orchestration only: the math is in `algorithm` / `advantages` / `losses`, the jitted
updates in `train_step`, generation in `rollout`, scoring in `rewards`.
"""

import functools
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from vapo_jax import advantages as adv_lib
from vapo_jax import algorithm, data, losses, masked, metrics as metrics_lib, rollout, tasks, tokenizer as tok_lib
from vapo_jax import train_step
from vapo_jax.config import ConfigError, ExperimentConfig
from vapo_jax.models import checkpoint, sharding
from vapo_jax.models.config import preset as model_preset
from vapo_jax.models.transformer import CausalLM, ValueModel
from vapo_jax.rewards import reward as reward_lib

PROGRESS_KEYS = {"reward": "rollout/reward_mean", "acc": "rollout/accuracy", "len": "rollout/response_len_mean",
                 "entropy": "actor/entropy", "EV": "critic/explained_variance"}


def load_problems(path: str, config: ExperimentConfig) -> list[dict]:
  """Rows with `problem`, `answer`, `id` (and `solution` when known) from a file or a synthetic spec."""
  if tasks.is_spec(path):
    return tasks.from_spec(path)
  d = config.data
  records = data.load_records(path, schema=d.schema, prompt_field=d.prompt_field, answer_field=d.answer_field,
                              id_field=d.id_field, split=d.split, skip_bad_rows=d.skip_bad_rows)
  if d.dedup:
    records, _ = data.deduplicate(records)
  return [{"problem": r.prompt, "answer": r.answer, "id": r.id, "source": r.source} for r in records]


def encode_prompt(row: dict, tokenizer, config: ExperimentConfig) -> list[int]:
  """Token ids of a problem in the configured template (and chat template); too long is an error."""
  d = config.data
  chat = d.chat_template and isinstance(tokenizer, tok_lib.HFTokenizer)
  text = data.format_prompt(row["problem"], template=d.template, tokenizer=tokenizer.tokenizer if chat else None)
  ids = tokenizer.encode(text)
  if len(ids) > config.rollout.max_prompt_tokens:
    raise data.DataError(f"prompt of problem id {row['id']!r} has {len(ids)} tokens, over "
                         f"rollout.max_prompt_tokens={config.rollout.max_prompt_tokens}")
  return ids


class Trainer:
  """Holds the run's models, optimizers, data and verifier; `run()` executes every stage."""

  def __init__(self, config: ExperimentConfig, *, devices=None, write_logs: bool = True, verbose: bool = True):
    self.config, self.verbose = config, verbose
    m, algo = config.model, config.algo
    if m.checkpoint is None and not m.random_init:
      raise ConfigError(f"experiment {config.name!r} needs a model: pass model.checkpoint=/path/to/"
                        f"{m.preset} (a Hugging Face directory with config.json and *.safetensors), e.g. "
                        f"make train EXP=... ARGS=\"model.checkpoint=/ckpt/{m.preset}\"")
    self.run_dir = os.path.join(config.run_dir, config.name)
    self.writer = metrics_lib.MetricsWriter(self.run_dir, enabled=write_logs)
    mesh_cfg = config.mesh
    self.mesh = sharding.make_mesh(data=mesh_cfg.data, fsdp=mesh_cfg.fsdp, tensor=mesh_cfg.tensor, devices=devices)
    self.rules = sharding.PRESETS[mesh_cfg.preset]
    self.tokenizer = tok_lib.load(m.tokenizer or m.checkpoint)
    self.stop_ids = tuple(sorted({self.tokenizer.eos_token_id, *config.rollout.stop_token_ids}))
    self.key = jax.random.key(config.seed)
    self.train_rows = load_problems(config.data.train_path, config)
    self.eval_rows = load_problems(config.eval.path, config)[:config.eval.max_problems] if config.eval.path else []
    self.prompts = data.PromptIterator(
        [data.Record(r["problem"], r["answer"], str(r["id"]), r.get("source", "")) for r in self.train_rows],
        prompts_per_step=config.rollout.prompts_per_step, seed=config.data.seed)
    self._build_models()
    self.pool = reward_lib.make_pool(reward_fn=config.reward.reward_fn, workers=config.reward.verifier_workers,
                                     timeout_s=config.reward.verifier_timeout_s,
                                     memory_limit_mb=config.reward.verifier_memory_mb)
    self._advantages = jax.jit(functools.partial(algorithm.compute_advantages, algo,
                                                 group_size=config.rollout.samples_per_prompt))
    self.history: list[dict] = []

  # ----------------------------------------------------------------------------------- setup
  def _build_models(self):
    c, m = self.config, self.config.model
    kwargs = dict(dtype=m.dtype, param_dtype=m.param_dtype, remat=m.remat)
    with sharding.use_rules(self.mesh, self.rules):
      if m.checkpoint:
        actor = checkpoint.load_causal_lm(m.checkpoint, mesh=self.mesh, rules=self.rules, **kwargs)
      else:
        cfg = model_preset(m.preset)
        actor = sharding.create_sharded(lambda: CausalLM(cfg, rngs=nnx.Rngs(m.init_seed), **kwargs),
                                        self.mesh, self.rules)
      self.model_cfg = actor.cfg
      if m.critic_checkpoint:
        critic = checkpoint.load_value_model(m.critic_checkpoint, from_policy=False, mesh=self.mesh,
                                             rules=self.rules, **kwargs)
      else:
        critic = sharding.create_sharded(lambda: ValueModel(self.model_cfg, rngs=nnx.Rngs(m.init_seed), **kwargs),
                                         self.mesh, self.rules)
    self.actor_def, self.actor = nnx.split(actor)
    self.critic_def, self.critic = nnx.split(critic)
    if not m.critic_checkpoint:
      self.critic_from_actor()
    self.actor_tx, self.actor_schedule = train_step.make_optimizer(c.optim, c.optim.actor_lr)
    self.critic_tx, self.critic_schedule = train_step.make_optimizer(c.optim, c.optim.critic_lr)
    self.actor_opt = jax.jit(self.actor_tx.init)(self.actor)
    self.critic_opt = jax.jit(self.critic_tx.init)(self.critic)
    self.actor_updates = self.critic_updates = 0
    self.ref = None
    micro = c.algo.micro_batch_responses or c.algo.mini_batch_responses
    jit = lambda f, **kw: jax.jit(functools.partial(f, **kw), donate_argnums=(0, 1))
    self._actor_update = jit(lambda p, o, s, b, **kw: train_step.actor_update(
        self.actor_def, self.actor_tx, self.actor_schedule, p, o, s, b, **kw), algo=c.algo, micro=micro)
    self._critic_update = jit(lambda p, o, s, b, **kw: train_step.critic_update(
        self.critic_def, self.critic_tx, self.critic_schedule, p, o, s, b, **kw), algo=c.algo, micro=micro)
    sft_micro = min(micro, c.sft.batch_size)
    self._sft_update = jit(lambda p, o, s, b, **kw: train_step.sft_update(
        self.actor_def, self.actor_tx, self.actor_schedule, p, o, s, b, **kw), micro=sft_micro)

  def critic_from_actor(self):
    """The critic's backbone := the policy's; value head := 0 (VAPO initialises from the policy)."""
    critic = nnx.merge(self.critic_def, self.critic)
    backbone = nnx.state(nnx.merge(self.actor_def, self.actor).model)
    nnx.update(critic.model, jax.tree.map(jnp.copy, backbone))  # A copy: updates donate their buffers.
    critic.value_head[...] = jnp.zeros_like(critic.value_head[...])
    self.critic = nnx.state(critic)

  def _shard_batch(self, tree):
    data_size = self.mesh.shape["data"] * self.mesh.shape["fsdp"]
    spec = sharding.partition_spec(("batch",), self.rules)
    def put(x):
      x = jnp.asarray(x)
      if x.ndim == 0 or x.shape[0] % data_size:
        return jax.device_put(x, jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec()))
      return jax.device_put(x, jax.sharding.NamedSharding(self.mesh, spec))
    return jax.tree.map(put, tree)

  def _next_key(self):
    self.key, sub = jax.random.split(self.key)
    return sub

  def log(self, message: str):
    if self.verbose:
      print(message, flush=True)

  # ------------------------------------------------------------------------------ experience
  def encode_prompt(self, row: dict) -> list[int]:
    return encode_prompt(row, self.tokenizer, self.config)

  def generate(self, rows: list[dict], *, group: int, temperature: float, top_p: float, top_k: int = 0):
    """Samples `group` responses for each row's prompt; numpy `Rollout` with B = len(rows)·group."""
    r = self.config.rollout
    tokens, mask = rollout.pad_prompts([self.encode_prompt(row) for row in rows], pad_id=self.tokenizer.pad_token_id)
    data_size = self.mesh.shape["data"] * self.mesh.shape["fsdp"]
    rollout.check_cache_fits(self.model_cfg, batch=len(rows) * group, prompt_tokens=tokens.shape[1],
                             max_new_tokens=r.max_response_tokens, budget_bytes=int(r.kv_cache_budget_gib * 2**30),
                             dtype=jnp.dtype(self.config.model.dtype), devices=data_size)
    sampling = rollout.Sampling(max_new_tokens=r.max_response_tokens, stop_token_ids=self.stop_ids,
                                temperature=temperature, top_p=top_p, top_k=top_k)
    fn = rollout.make_generate(sampling=sampling, samples_per_prompt=group, pad_id=self.tokenizer.pad_token_id,
                               cache_dtype=jnp.dtype(self.config.model.dtype))
    with sharding.use_rules(self.mesh, self.rules):
      out = fn(nnx.merge(self.actor_def, self.actor), *self._shard_batch((tokens, mask)), self._next_key())
    return jax.tree.map(np.asarray, jax.device_get(out))

  def score(self, out: rollout.Rollout, answers: list[str]) -> reward_lib.RewardBatch:
    c = self.config
    texts = [self.tokenizer.decode(t[:n]) for t, n in zip(out.response_tokens, out.response_lengths)]
    return reward_lib.compute_rewards(
        self.pool, texts, answers, out.response_lengths, correct_reward=c.reward.correct,
        incorrect_reward=c.reward.incorrect, forms=c.reward.answer_forms,
        max_response_tokens=c.rollout.max_response_tokens, overlong_buffer_tokens=c.algo.overlong_buffer_tokens,
        overlong_penalty_factor=c.algo.overlong_penalty_factor, format_penalty_value=c.reward.format_penalty)

  def sample_batch(self):
    """A scored rollout batch of P prompts × G samples (DAPO: refilled with mixed groups)."""
    c, group = self.config, self.config.rollout.samples_per_prompt
    kept_out, spare, rounds = [], [], 0
    while True:
      rows = [{"problem": r.prompt, "answer": r.answer, "id": r.id} for r in next(self.prompts)]
      out = self.generate(rows, group=group, temperature=c.rollout.temperature, top_p=c.rollout.top_p,
                          top_k=c.rollout.top_k)
      scored = self.score(out, [row["answer"] for row in rows for _ in range(group)])
      rounds += 1
      accuracy = scored.correct.reshape(len(rows), group).mean(axis=1)
      for p, row in enumerate(rows):
        piece = (jax.tree.map(lambda x: x[p * group:(p + 1) * group], out), row,
                 jax.tree.map(lambda x: x[p * group:(p + 1) * group], _reward_arrays(scored)))
        mixed = 0 < accuracy[p] < 1
        (kept_out if mixed or not c.algo.dynamic_sampling else spare).append(piece)
      if not c.algo.dynamic_sampling or len(kept_out) >= len(rows) or rounds > c.algo.dynamic_sampling_max_rounds:
        break
    pieces = (kept_out + spare)[:c.rollout.prompts_per_step]
    out = _concat_rollouts([p[0] for p in pieces])
    rows = [p[1] for p in pieces]
    arrays = {k: np.concatenate([p[2][k] for p in pieces]) for k in pieces[0][2]}
    stats = scored.metrics | {"rollout/sampling_rounds": float(rounds),
                              "rollout/mixed_group_frac": min(len(kept_out), len(pieces)) / len(pieces)}
    return out, rows, arrays, stats


  def train_batch(self, out: rollout.Rollout, arrays: dict[str, np.ndarray]):
    """Log-probs, values and advantages for a scored rollout; the `TrainBatch` and its metrics."""
    c, response_len = self.config, out.response_tokens.shape[1]
    tokens, attention = train_step.join(out.prompt_tokens, out.prompt_mask, out.response_tokens, out.response_mask)
    tokens, attention, response_tokens = self._shard_batch((tokens, attention, out.response_tokens))
    mask = jnp.asarray(out.response_mask)
    with sharding.use_rules(self.mesh, self.rules):
      old_logprobs, entropy = train_step.logprobs_and_entropy(self.actor_def, self.actor, tokens, attention,
                                                              response_tokens, response_len=response_len)
      values = (train_step.values(self.critic_def, self.critic, tokens, attention, response_len=response_len)
                if c.algo.uses_critic else jnp.zeros(mask.shape, jnp.float32))
      ref = (train_step.logprobs_and_entropy(self.actor_def, self.ref, tokens, attention, response_tokens,
                                             response_len=response_len)[0]
             if self.ref is not None else jnp.zeros(mask.shape, jnp.float32))
    token_rewards = reward_lib.last_token_rewards(arrays["rewards"], out.response_mask)
    est = self._advantages(token_rewards, jnp.where(mask, values, 0.0), mask, arrays["rewards"])
    batch = train_step.TrainBatch(tokens, attention, response_tokens, mask, old_logprobs, est.advantages,
                                  est.returns, values, jnp.asarray(arrays["correct"]), ref)
    stats = {
        "actor/entropy_rollout": masked.masked_mean(entropy, mask),
        "rollout/logprob_gap": masked.masked_mean(jnp.abs(jnp.asarray(out.policy_logprobs) - old_logprobs), mask),
        "critic/explained_variance": losses.explained_variance(values, est.returns, mask) if c.algo.uses_critic else 0.0,
        "critic/value_mean": masked.masked_mean(values, mask), "critic/return_mean": masked.masked_mean(est.returns, mask),
        "adv/lam_actor_mean": jnp.mean(est.lam_actor), "adv/lam_actor_min": jnp.min(est.lam_actor),
        "adv/lam_actor_max": jnp.max(est.lam_actor), "adv/mean_abs": masked.masked_mean(jnp.abs(est.advantages), mask),
    }
    return batch, {k: float(v) for k, v in stats.items()}

  def update(self, batch: train_step.TrainBatch, *, actor: bool, critic: bool) -> dict[str, float]:
    """`ppo_epochs` passes of shuffled mini-batch updates; metrics averaged over the updates."""
    c, size = self.config, batch.response_mask.shape[0]
    mini = min(c.algo.mini_batch_responses, size)
    collected = []
    for _ in range(c.algo.ppo_epochs):
      order = np.asarray(jax.random.permutation(self._next_key(), size))
      for start in range(0, size - mini + 1, mini):
        mb = self._shard_batch(jax.tree.map(lambda x: jnp.asarray(x)[order[start:start + mini]], batch))
        step_metrics = {}
        with sharding.use_rules(self.mesh, self.rules):
          if critic:
            self.critic, self.critic_opt, m = self._critic_update(self.critic, self.critic_opt, self.critic_updates, mb)
            self.critic_updates += 1
            step_metrics |= m
          if actor:
            self.actor, self.actor_opt, m = self._actor_update(self.actor, self.actor_opt, self.actor_updates, mb)
            self.actor_updates += 1
            step_metrics |= m
        collected.append(step_metrics)
    return {k: float(np.mean([m[k] for m in collected])) for k in collected[0]} if collected else {}

  # ---------------------------------------------------------------------------------- stages
  def sft_stage(self):
    c = self.config
    if not c.sft.steps or not c.sft.path:
      return
    rows = load_problems(c.sft.path, c)
    if any("solution" not in r for r in rows):
      raise data.DataError(f"{c.sft.path}: supervised warm start needs a 'solution' field on every row")
    tx, schedule = train_step.make_optimizer(c.optim, c.sft.lr)
    opt = jax.jit(tx.init)(self.actor)
    update = jax.jit(lambda p, o, s, b: train_step.sft_update(self.actor_def, tx, schedule, p, o, s, b,
                                                              micro=c.sft.batch_size), donate_argnums=(0, 1))
    rng = np.random.default_rng(c.seed)
    eos, length = self.tokenizer.eos_token_id, c.rollout.max_response_tokens
    progress = metrics_lib.Progress("sft", c.sft.steps)
    for step in range(c.sft.steps):
      picked = [rows[i] for i in rng.integers(0, len(rows), c.sft.batch_size)]
      prompt_tokens, prompt_mask = rollout.pad_prompts([self.encode_prompt(r) for r in picked],
                                                       pad_id=self.tokenizer.pad_token_id)
      response = np.full((len(picked), length), self.tokenizer.pad_token_id, np.int32)
      lengths = np.zeros(len(picked), np.int32)
      for b, row in enumerate(picked):
        ids = (self.tokenizer.encode(row["solution"]) + [eos])[:length]
        response[b, :len(ids)], lengths[b] = ids, len(ids)
      response_mask = np.arange(length)[None] < lengths[:, None]
      tokens, attention = train_step.join(prompt_tokens, prompt_mask, response, response_mask)
      zeros = np.zeros(response.shape, np.float32)
      batch = self._shard_batch(train_step.TrainBatch(tokens, attention, response, response_mask, zeros, zeros,
                                                      zeros, zeros, np.zeros(len(picked), bool), zeros))
      with sharding.use_rules(self.mesh, self.rules):
        self.actor, opt, m = update(self.actor, opt, step, batch)
      m = {k: float(v) for k, v in m.items()}
      self.writer.write(step, "sft", m)
      self.history.append({"stage": "sft", **m})
      if self.verbose and (step % 20 == 0 or step == c.sft.steps - 1):
        progress.update(step, m, {"nll": "sft/nll"})
    if not c.model.critic_checkpoint:
      self.critic_from_actor()  # The critic starts from the warm-started policy.

  def value_pretrain_stage(self):
    """Critic only, on Monte-Carlo returns (λ = 1) of the fixed initial policy's samples."""
    c = self.config
    steps = c.algo.value_pretrain_steps if c.algo.uses_critic else 0
    best, since_best = -np.inf, 0
    progress = metrics_lib.Progress("value-pretrain", steps)
    for step in range(steps):
      start = time.perf_counter()
      out, rows, arrays, stats = self.sample_batch()
      batch, batch_stats = self.train_batch(out, arrays)
      returns = adv_lib.monte_carlo_returns(reward_lib.last_token_rewards(arrays["rewards"], out.response_mask),
                                            out.response_mask, gamma=c.algo.gamma)
      m = batch_stats | self.update(batch._replace(returns=returns), actor=False, critic=True)
      m["critic/explained_variance"] = float(losses.explained_variance(batch.old_values, returns, batch.response_mask))
      m["time/step_s"] = time.perf_counter() - start
      self.writer.write(step, "value_pretrain", m | stats)
      self.history.append({"stage": "value_pretrain", **m})
      if self.verbose:
        progress.update(step, m, {"value_loss": "critic/value_loss", "EV": "critic/explained_variance"})
      if m["critic/explained_variance"] > best + 0.01:
        best, since_best = m["critic/explained_variance"], 0
      else:
        since_best += 1
        if since_best >= c.log.value_pretrain_patience:
          self.log(f"value pretraining converged after {step + 1} steps (explained variance {best:.3f})")
          break
    if steps:
      path = os.path.join(self.run_dir, "critic_pretrained")
      checkpoint.export(nnx.merge(self.critic_def, self.critic), path)
      self.log(f"pretrained critic saved to {path}")


  def rl_stage(self):
    c = self.config
    if c.algo.kl_coef > 0:
      self.ref = jax.tree.map(jnp.copy, self.actor)  # The reference policy: the RL starting point.
    monitor = metrics_lib.CollapseMonitor(length_frac=c.log.collapse_length_frac, min_entropy=c.log.collapse_entropy)
    progress = metrics_lib.Progress("rl", c.rl_steps)
    for step in range(c.rl_steps):
      t0 = time.perf_counter()
      out, rows, arrays, stats = self.sample_batch()
      t1 = time.perf_counter()
      batch, batch_stats = self.train_batch(out, arrays)
      t2 = time.perf_counter()
      m = stats | batch_stats | self.update(batch, actor=True, critic=c.algo.uses_critic)
      t3 = time.perf_counter()
      tokens = float(out.response_lengths.sum())
      m |= metrics_lib.summarize_lengths(out.response_lengths, c.rollout.max_response_tokens)
      m |= {"rollout/reward_mean": float(arrays["rewards"].mean()), "rollout/accuracy": float(arrays["correct"].mean()),
            "actor/positive_frac": float(arrays["correct"].mean()),
            "time/rollout_s": t1 - t0 - stats.get("time/verify_s", 0.0), "time/scoring_s": stats.get("time/verify_s", 0.0),
            "time/logprobs_values_s": t2 - t1, "time/update_s": t3 - t2, "time/step_s": t3 - t0,
            "perf/tokens_per_s": tokens / (t3 - t0)}
      if c.eval.every_steps and (step + 1) % c.eval.every_steps == 0 and step + 1 < c.rl_steps:
        m |= self.evaluate()
      self.writer.write(step, "rl", m)
      self.history.append({"stage": "rl", **m})
      monitor.check(step, m["rollout/response_len_mean"], m.get("actor/entropy", np.inf))
      if self.verbose:
        progress.update(step, m, PROGRESS_KEYS)

  def evaluate(self) -> dict[str, float]:
    """avg@k on the held-out problems with the eval sampling settings."""
    e = self.config.eval
    if not self.eval_rows:
      return {}
    out = self.generate(self.eval_rows, group=e.samples_per_problem, temperature=e.temperature, top_p=e.top_p)
    scored = self.score(out, [r["answer"] for r in self.eval_rows for _ in range(e.samples_per_problem)])
    return {"eval/accuracy": float(scored.correct.mean()),
            "eval/response_len_mean": float(out.response_lengths.mean())}

  def run(self) -> dict:
    """SFT warm start → value pretraining → RL, with held-out evaluation before and after RL."""
    c, start = self.config, time.perf_counter()
    try:
      self.sft_stage()
      before = self.evaluate()
      self.writer.write(0, "eval_before_rl", before)
      if before:
        self.log(f"held-out accuracy before RL: {before['eval/accuracy']:.3f} (avg@{c.eval.samples_per_problem} "
                 f"on {len(self.eval_rows)} problems)")
      self.value_pretrain_stage()
      self.rl_stage()
      after = self.evaluate()
      self.writer.write(c.rl_steps, "eval_after_rl", after)
      summary = {"run_dir": self.run_dir, "seconds": time.perf_counter() - start,
                 "accuracy_before_rl": before.get("eval/accuracy"), "accuracy_after_rl": after.get("eval/accuracy")}
      if after:
        self.log(f"held-out accuracy after RL: {after['eval/accuracy']:.3f} (before: {before['eval/accuracy']:.3f})")
      if self.writer.enabled:
        with open(os.path.join(self.run_dir, "summary.json"), "w") as f:
          json.dump(summary, f, indent=2)
      return summary
    finally:
      self.pool.close()
      self.writer.close()


def _reward_arrays(scored: reward_lib.RewardBatch) -> dict[str, np.ndarray]:
  return {"rewards": scored.rewards, "correct": scored.correct}


def _concat_rollouts(parts: list[rollout.Rollout]) -> rollout.Rollout:
  """Concatenates rollouts along the batch, left-padding prompts to the widest."""
  width = max(p.prompt_tokens.shape[1] for p in parts)
  def pad(x):
    return np.pad(x, ((0, 0), (width - x.shape[1], 0)))
  parts = [p._replace(prompt_tokens=pad(p.prompt_tokens), prompt_mask=pad(p.prompt_mask)) for p in parts]
  return rollout.Rollout(*(np.concatenate(fields) for fields in zip(*parts)))
