"""VAPO end to end: supervised warm start, value pretraining, then PPO with the VAPO techniques.

  trainer = Trainer(config); summary = trainer.run()

Each RL step draws P prompts, samples G responses each, scores them with the verifier, computes
the rollout policy's log-probs and the critic's values, the advantages the config selects
(`algorithm.compute_advantages`), and runs `updates_per_step` mini-batch updates of actor and
critic. The same loop runs VAPO, its ablations, vanilla PPO, GRPO and DAPO: only the config
differs. Orchestration only: the math is in `algorithm` / `advantages` / `losses`, the jitted
updates in `train_step`, experience in `experience`, checkpoints in `checkpointing`.

A run is a sequence of stages, sft → value_pretrain → rl → done, with held-out evaluation after
the warm start and after RL. Everything a resume needs (the arrays in `_state()`, the rest in
`_meta()`) is saved every `checkpoint.every_steps` steps and at each stage boundary; a new
Trainer on the same run directory continues from the newest complete checkpoint, and SIGTERM
finishes the current step, saves and raises `Preempted`.
"""

import dataclasses
import functools
import json
import math
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from vapo_jax import algorithm, checkpointing, data, distributed, memory_plan, metrics as metrics_lib, rollout
from vapo_jax import tokenizer as tok_lib, train_step
from vapo_jax.config import ConfigError, ExperimentConfig
from vapo_jax import experience
from vapo_jax.experience import ExperienceMixin, encode_prompt, load_problems  # noqa: F401 (re-exported)
from vapo_jax.models import checkpoint, sharding
from vapo_jax.models.config import preset as model_preset
from vapo_jax.models.transformer import CausalLM, ValueModel
from vapo_jax.rewards import reward as reward_lib

PROGRESS_KEYS = {"reward": "rollout/reward_mean", "acc": "rollout/accuracy", "len": "rollout/response_len_mean",
                 "entropy": "actor/entropy", "EV": "critic/explained_variance"}


class Trainer(ExperienceMixin):
  """Holds the run's models, optimizers, data, verifier and progress; `run()` executes every stage."""

  def __init__(self, config: ExperimentConfig, *, devices=None, write_logs: bool = True, verbose: bool = True):
    self.config, self.verbose = config, verbose
    c, m = config, config.model
    if m.checkpoint is None and not m.random_init:
      raise ConfigError(f"experiment {c.name!r} needs a model: pass model.checkpoint=/path/to/"
                        f"{m.preset} (a Hugging Face directory with config.json and *.safetensors), e.g. "
                        f"make train EXP=... ARGS=\"model.checkpoint=/ckpt/{m.preset}\"")
    self.run_dir = os.path.join(c.run_dir, c.name)
    self.checkpoints = self._open_checkpoints() if write_logs else None
    self.mesh = sharding.make_mesh(data=c.mesh.data, fsdp=c.mesh.fsdp, tensor=c.mesh.tensor, devices=devices)
    self.rules = sharding.PRESETS[c.mesh.preset]
    self.memory = memory_plan.plan(c, dict(self.mesh.shape))
    if verbose:
      self.log(self.memory.format())
    if c.mesh.check_memory:
      memory_plan.check(self.memory, memory_plan.device_memory_bytes(c))
    self.tokenizer = tok_lib.load(m.tokenizer or m.checkpoint)
    self.stop_ids = tuple(sorted({self.tokenizer.eos_token_id, *c.rollout.stop_token_ids}))
    self.train_rows = load_problems(c.data.train_path, c)
    self.eval_rows = load_problems(c.eval.path, c)[:c.eval.max_problems] if c.eval.path else []
    self.prompts = data.PromptIterator(
        [data.Record(r["problem"], r["answer"], str(r["id"]), r.get("source", "")) for r in self.train_rows],
        prompts_per_step=c.rollout.prompts_per_step, seed=c.data.seed)
    # Progress: everything below is saved in checkpoints and restored on resume.
    self.stage = "sft" if c.sft.steps and c.sft.path else "value_pretrain"
    self.stage_step = self.global_step = self.actor_updates = self.critic_updates = self.saves = 0
    self.key = jax.random.key(c.seed)
    self.sft_rng = np.random.default_rng(c.seed)
    self.eval_before, self.eval_after = None, None
    self.vp_best, self.vp_since_best = None, 0
    self.monitor = metrics_lib.CollapseMonitor(length_frac=c.log.collapse_length_frac,
                                               min_entropy=c.log.collapse_entropy)
    self._build_models()
    restored = self.checkpoints.restore_latest(self._restore_target) if self.checkpoints else None
    if restored:
      self._restore(*restored)
    if self.checkpoints is not None:  # New saves are numbered after every listed one, unreadable ones too.
      self.saves = max(self.checkpoints.steps(), default=0)
    self.writer = metrics_lib.MetricsWriter(self.run_dir, enabled=write_logs and distributed.is_main_process(),
                                            keep_bytes=restored[2]["metrics_bytes"] if restored else 0,
                                            purge_step=self.global_step)
    for stage, result in (("eval_before_rl", self.eval_before), ("eval_after_rl", self.eval_after)):
      if restored and result:  # TensorBoard purged from the checkpoint's step on, which may include these.
        self.writer.write(0, stage, result, global_step=self.global_step, jsonl=False)
    self.pool = reward_lib.make_pool(reward_fn=c.reward.reward_fn, workers=c.reward.verifier_workers,
                                     timeout_s=c.reward.verifier_timeout_s, memory_limit_mb=c.reward.verifier_memory_mb)
    self._advantages = jax.jit(lambda rewards, values, mask, seq_rewards: algorithm.compute_advantages(
        c.algo, rewards, jnp.where(mask, values, 0.0), mask, seq_rewards, group_size=c.rollout.samples_per_prompt))
    self.preemption = checkpointing.PreemptionFlag()
    self.history: list[dict] = []

  # ----------------------------------------------------------------------------------- setup
  def _open_checkpoints(self):
    c = self.config
    directory = os.path.join(self.run_dir, "checkpoints")
    found = checkpointing.RunCheckpoints(directory, c.checkpoint)
    latest = found.latest_meta()
    if latest and not c.checkpoint.resume:
      raise ConfigError(f"{directory} holds checkpoints of an earlier run (newest: step {latest[0]}) and "
                        "checkpoint.resume=false: choose another name= or run_dir=, or delete the directory")
    if latest:
      checkpointing.check_resumable(c, latest[1]["config"], directory)
    return found

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
    actor_tx, actor_schedule = train_step.make_optimizer(c.optim, c.optim.actor_lr)
    critic_tx, critic_schedule = train_step.make_optimizer(c.optim, c.optim.critic_lr)
    sft_tx, sft_schedule = train_step.make_optimizer(c.optim, c.sft.lr)
    self.actor_opt = train_step.init_optimizer(actor_tx, self.actor, self.mesh)
    self.critic_opt = train_step.init_optimizer(critic_tx, self.critic, self.mesh)
    self.sft_opt = train_step.init_optimizer(sft_tx, self.actor, self.mesh) if self.stage == "sft" else None
    self.ref = None
    # Micro-batches (updates and scoring) take an equal part of every device's rows.
    self.micro = micro = c.algo.micro_batch_responses or c.algo.mini_batch_responses
    self.batch_shards = shards = self.mesh.shape["data"] * self.mesh.shape["fsdp"]
    jit = lambda f, **kw: jax.jit(functools.partial(f, **kw), donate_argnums=(0, 1))
    self._actor_update = jit(functools.partial(train_step.actor_update, self.actor_def, actor_tx, actor_schedule),
                             algo=c.algo, micro=micro, shards=shards)
    self._critic_update = jit(functools.partial(train_step.critic_update, self.critic_def, critic_tx,
                                                critic_schedule), algo=c.algo, micro=micro, shards=shards)
    self._sft_update = jit(functools.partial(train_step.sft_update, self.actor_def, sft_tx, sft_schedule),
                           micro=math.gcd(micro, c.sft.batch_size), shards=shards)
    self._take = jax.jit(lambda tree, idx: jax.tree.map(lambda x: x[idx], tree))

  def critic_from_actor(self):
    """The critic's backbone := the policy's; value head := 0 (VAPO initialises from the policy)."""
    critic = nnx.merge(self.critic_def, self.critic)
    backbone = nnx.state(nnx.merge(self.actor_def, self.actor).model)
    nnx.update(critic.model, jax.tree.map(jnp.copy, backbone))  # A copy: updates donate their buffers.
    critic.value_head[...] = jnp.zeros_like(critic.value_head[...])
    self.critic = nnx.state(critic)

  def log(self, message: str):
    if self.verbose and distributed.is_main_process():
      print(message, flush=True)

  # ----------------------------------------------------------------------------- checkpoints
  def _state(self) -> dict:
    """Every array a resume needs, as one pytree."""
    state = {"actor": self.actor, "critic": self.critic, "actor_opt": self.actor_opt, "critic_opt": self.critic_opt}
    if self.sft_opt is not None:
      state["sft_opt"] = self.sft_opt
    if self.ref is not None:
      state["ref"] = self.ref
    return state

  def _meta(self) -> dict:
    """Everything else a resume needs, JSON-serialisable."""
    return {"stage": self.stage, "stage_step": self.stage_step, "global_step": self.global_step,
            "actor_updates": self.actor_updates, "critic_updates": self.critic_updates,
            "key": np.asarray(jax.random.key_data(self.key)).tolist(), "prompts": self.prompts.state_dict(),
            "sft_rng": self.sft_rng.bit_generator.state, "vp_best": self.vp_best, "vp_since_best": self.vp_since_best,
            "eval_before": self.eval_before, "eval_after": self.eval_after, "monitor": self.monitor.state_dict(),
            "metrics_bytes": self.writer.size(), "has_ref": self.ref is not None,
            "config": dataclasses.asdict(self.config)}

  def _restore_target(self, meta: dict):
    checkpointing.check_resumable(self.config, meta["config"], self.checkpoints.directory)
    state = {k: v for k, v in self._state().items() if k not in ("sft_opt", "ref")}  # Those two: as saved.
    if meta["stage"] == "sft":
      state["sft_opt"] = self.sft_opt
    if meta["has_ref"]:
      state["ref"] = self.actor
    return checkpointing.abstract(state, self.mesh)

  def _restore(self, step: int, state: dict, meta: dict):
    self.actor, self.critic = state["actor"], state["critic"]
    self.actor_opt, self.critic_opt = state["actor_opt"], state["critic_opt"]
    self.sft_opt, self.ref = state.get("sft_opt"), state.get("ref")
    self.stage, self.stage_step, self.global_step = meta["stage"], meta["stage_step"], meta["global_step"]
    self.actor_updates, self.critic_updates = meta["actor_updates"], meta["critic_updates"]
    self.key = jax.random.wrap_key_data(np.asarray(meta["key"], np.uint32))
    self.prompts.load_state_dict(meta["prompts"])
    self.sft_rng.bit_generator.state = meta["sft_rng"]
    self.vp_best, self.vp_since_best = meta["vp_best"], meta["vp_since_best"]
    self.eval_before, self.eval_after = meta["eval_before"], meta["eval_after"]
    self.monitor.load_state_dict(meta["monitor"])
    self.log(f"resumed from {self.checkpoints.directory}/{step}: stage {self.stage}, step {self.stage_step}")

  def save(self, *, wait: bool = False):
    """A checkpoint of the current state (Orbax numbers checkpoints by a save counter)."""
    if self.checkpoints is not None:
      self.saves += 1
      self.checkpoints.save(self.saves, self._state(), self._meta(), wait=wait)

  def _after_step(self, *, last: bool):
    """Counts a finished step; saves every N steps; on SIGTERM saves and stops."""
    self.stage_step += 1
    self.global_step += 1
    every = self.config.checkpoint.every_steps
    periodic = bool(every and not last and self.stage_step % every == 0)
    if periodic:
      self.save()
    if self.preemption.is_set():
      if periodic and self.checkpoints is not None:
        self.checkpoints.wait()
      else:
        self.save(wait=True)
      raise checkpointing.Preempted(f"stopped by SIGTERM after {self.stage} step {self.stage_step}; "
                                    f"checkpoint saved in {self.checkpoints and self.checkpoints.directory}")

  def _enter(self, stage: str, *, save: bool = True):
    self.stage, self.stage_step = stage, 0
    if save and self.config.checkpoint.every_steps:
      self.save()
    if save and stage != "done" and self.preemption.is_set():
      if not self.config.checkpoint.every_steps:
        self.save(wait=True)
      raise checkpointing.Preempted(f"stopped by SIGTERM on entering {stage}; checkpoint saved")

  # ------------------------------------------------------------------------------- updating
  def update(self, batch: train_step.TrainBatch, *, actor: bool, critic: bool) -> dict[str, float]:
    """`ppo_epochs` passes of shuffled mini-batch updates; metrics averaged over the updates."""
    c, size = self.config, batch.response_mask.shape[0]
    mini = min(c.algo.mini_batch_responses, size)
    collected = []
    for _ in range(c.algo.ppo_epochs):
      order = np.asarray(jax.random.permutation(self.next_key(), size))
      for start in range(0, size - mini + 1, mini):
        mb = self._take(batch, self.shard_batch(order[start:start + mini]))
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
    return {k: float(np.mean([float(m[k]) for m in collected])) for k in collected[0]} if collected else {}

  def _record(self, stage: str, step: int, m: dict, progress=None, keys=None):
    self.writer.write(step, stage, m, global_step=self.global_step)
    self.history.append({"stage": stage, **m})
    if progress is not None and self.verbose and distributed.is_main_process():
      progress.update(step, m, keys)

  # ---------------------------------------------------------------------------------- stages
  def sft_stage(self):
    """Token-level NLL on demonstrations (`sft.path` rows with a `solution`)."""
    c = self.config
    rows = load_problems(c.sft.path, c)
    if any("solution" not in r for r in rows):
      raise data.DataError(f"{c.sft.path}: supervised warm start needs a 'solution' field on every row")
    eos, length, pad = self.tokenizer.eos_token_id, c.rollout.max_response_tokens, self.tokenizer.pad_token_id
    progress = metrics_lib.Progress("sft", c.sft.steps)
    for step in range(self.stage_step, c.sft.steps):
      picked = [rows[i] for i in self.sft_rng.integers(0, len(rows), c.sft.batch_size)]
      prompt_tokens, prompt_mask = rollout.pad_prompts([self.encode_prompt(r) for r in picked], pad_id=pad)
      response = np.full((len(picked), length), pad, np.int32)
      lengths = np.zeros(len(picked), np.int32)
      for b, row in enumerate(picked):
        ids = (self.tokenizer.encode(row["solution"]) + [eos])[:length]
        response[b, :len(ids)], lengths[b] = ids, len(ids)
      response_mask = np.arange(length)[None] < lengths[:, None]
      tokens, attention = train_step.join(prompt_tokens, prompt_mask, response, response_mask)
      zeros = np.zeros(response.shape, np.float32)
      batch = self.shard_batch(train_step.TrainBatch(np.asarray(tokens), np.asarray(attention), response,
                                                     response_mask, zeros, zeros, zeros, zeros,
                                                     np.zeros(len(picked), bool), zeros))
      with sharding.use_rules(self.mesh, self.rules):
        self.actor, self.sft_opt, m = self._sft_update(self.actor, self.sft_opt, step, batch)
      m = {k: float(v) for k, v in m.items()}
      self._record("sft", step, m, progress if step % 20 == 0 or step == c.sft.steps - 1 else None, {"nll": "sft/nll"})
      self._after_step(last=step == c.sft.steps - 1)
    self.sft_opt = None
    if not c.model.critic_checkpoint:
      self.critic_from_actor()  # The critic starts from the warm-started policy.

  def value_pretrain_stage(self):
    """Critic only, on Monte-Carlo returns (λ = 1) of the fixed initial policy's samples."""
    c = self.config
    steps = c.algo.value_pretrain_steps if c.algo.uses_critic else 0
    progress = metrics_lib.Progress("value-pretrain", steps)
    while self.stage_step < steps and self.vp_since_best < c.log.value_pretrain_patience:
      step, start = self.stage_step, time.perf_counter()
      out, _, arrays, stats = self.sample_batch()
      batch, batch_stats = self.train_batch(out, arrays, critic_only=True)
      m = stats | batch_stats | self.update(batch, actor=False, critic=True)
      m["time/step_s"] = time.perf_counter() - start
      self._record("value_pretrain", step, m, progress, {"value_loss": "critic/value_loss",
                                                         "EV": "critic/explained_variance"})
      ev = m["critic/explained_variance"]
      if self.vp_best is None or ev > self.vp_best + 0.01:
        self.vp_best, self.vp_since_best = ev, 0
      else:
        self.vp_since_best += 1
      converged = self.vp_since_best >= c.log.value_pretrain_patience
      if converged:
        self.log(f"value pretraining converged after {step + 1} steps (explained variance {self.vp_best:.3f})")
      self._after_step(last=converged or step == steps - 1)
    if steps and self.checkpoints is not None:
      path = os.path.join(self.run_dir, "critic_pretrained")
      checkpoint.export(nnx.merge(self.critic_def, self.critic), path)
      self.log(f"pretrained critic saved to {path}")

  def rl_stage(self):
    c = self.config
    if c.algo.kl_coef > 0 and self.ref is None:
      self.ref = jax.tree.map(jnp.copy, self.actor)  # The reference policy: the RL starting point.
    progress = metrics_lib.Progress("rl", c.rl_steps)
    for step in range(self.stage_step, c.rl_steps):
      t0 = time.perf_counter()
      out, _, arrays, stats = self.sample_batch()
      t1 = time.perf_counter()
      batch, batch_stats = self.train_batch(out, arrays)
      t2 = time.perf_counter()
      m = stats | batch_stats | self.update(batch, actor=True, critic=c.algo.uses_critic)
      t3 = time.perf_counter()
      m |= metrics_lib.summarize_lengths(out.response_lengths, c.rollout.max_response_tokens)
      m |= {"rollout/reward_mean": float(arrays["rewards"].mean()), "rollout/accuracy": float(arrays["correct"].mean()),
            "actor/positive_frac": float(arrays["correct"].mean()),
            "time/rollout_s": t1 - t0 - stats.get("time/verify_s", 0.0), "time/scoring_s": stats.get("time/verify_s", 0.0),
            "time/logprobs_values_s": t2 - t1, "time/update_s": t3 - t2, "time/step_s": t3 - t0,
            "perf/tokens_per_s": float(out.response_lengths.sum()) / (t3 - t0)}
      if c.eval.every_steps and (step + 1) % c.eval.every_steps == 0 and step + 1 < c.rl_steps:
        m |= self.evaluate()
      self._record("rl", step, m, progress, PROGRESS_KEYS)
      self.monitor.check(step, m["rollout/response_len_mean"], m.get("actor/entropy", np.inf))
      self._after_step(last=step == c.rl_steps - 1)

  def evaluate(self) -> dict[str, float]:
    """avg@k on the held-out problems with the eval sampling settings."""
    e = self.config.eval
    if not self.eval_rows:
      return {}
    ro = self.config.rollout  # Rounds of at most as many sequences as a training generation round.
    per_call = max(1, (ro.prompts_per_generation or ro.prompts_per_step) * ro.samples_per_prompt // e.samples_per_problem)
    out = experience.concat_rollouts([
        self.generate(self.eval_rows[i:i + per_call], group=e.samples_per_problem, temperature=e.temperature,
                      top_p=e.top_p) for i in range(0, len(self.eval_rows), per_call)])
    scored = self.score(out, [r["answer"] for r in self.eval_rows for _ in range(e.samples_per_problem)])
    return {"eval/accuracy": float(scored.correct.mean()),
            "eval/response_len_mean": float(out.response_lengths.mean())}

  def export(self, directory: str) -> None:
    """The current policy as a Hugging Face directory, with the tokenizer's files beside it."""
    checkpoint.export(nnx.merge(self.actor_def, self.actor), directory,
                      tokenizer_dir=getattr(self.tokenizer, "directory", None))

  def run(self) -> dict:
    """SFT warm start → value pretraining → RL, with held-out evaluation before and after RL."""
    c, start = self.config, time.perf_counter()
    self.preemption.install()
    try:
      if self.stage == "sft":
        self.sft_stage()
        self._enter("value_pretrain", save=False)
      if self.eval_before is None:
        self.eval_before = self.evaluate()
        self.writer.write(0, "eval_before_rl", self.eval_before, global_step=self.global_step)
        if self.eval_before:
          self.log(f"held-out accuracy before RL: {self.eval_before['eval/accuracy']:.3f} "
                   f"(avg@{c.eval.samples_per_problem} on {len(self.eval_rows)} problems)")
        self._enter(self.stage, save=self.stage_step == 0)
      if self.stage == "value_pretrain":
        self.value_pretrain_stage()
        self._enter("rl")
      if self.stage == "rl":
        self.rl_stage()
        self.eval_after = self.evaluate()
        self.writer.write(c.rl_steps, "eval_after_rl", self.eval_after, global_step=self.global_step)
        if c.checkpoint.export_final and self.checkpoints is not None:  # Before "done" is saved.
          self.export(os.path.join(self.run_dir, "export"))
          self.log(f"final policy exported to {os.path.join(self.run_dir, 'export')} (Hugging Face format)")
        self._enter("done")
      before, after = self.eval_before or {}, self.eval_after or {}
      summary = {"run_dir": self.run_dir, "seconds": time.perf_counter() - start,
                 "accuracy_before_rl": before.get("eval/accuracy"), "accuracy_after_rl": after.get("eval/accuracy")}
      if after:
        self.log(f"held-out accuracy after RL: {after['eval/accuracy']:.3f} (before: {before['eval/accuracy']:.3f})")
      if self.writer.enabled:
        with open(os.path.join(self.run_dir, "summary.json"), "w") as f:
          json.dump(summary, f, indent=2)
      return summary
    finally:
      self.preemption.uninstall()
      self.pool.close()
      self.writer.close()
      if self.checkpoints is not None:
        self.checkpoints.close()
