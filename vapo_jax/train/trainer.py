"""VAPO end to end: supervised warm start, value pretraining, then PPO with the VAPO techniques.

  trainer = Trainer(config); summary = trainer.run()

A run is a sequence of stages, sft → value_pretrain → rl → done, with held-out evaluation after the warm
start, every `eval.every_steps` RL steps and after RL (keys: `held_out.evaluation_key`). Its state is one
immutable pytree (`state.TrainState`: parameters, optimizer states, reference policy, PRNG key) passed through
the jitted programs of `steps.Steps`, plus a host record (`state.Progress`). `step` is one RL (or
value-pretraining) step from prompts to update; one loop runs VAPO, its ablations, PPO, GRPO and DAPO (the
math: `algorithm`, `advantages`, `losses`). The critic starts from `model.critic_checkpoint` (the paper's: a
reward model, VAPO §4.1), else from the policy with a zero value head (`critic_from_actor`).

A checkpoint is (state, progress), saved every `checkpoint.every_steps` steps and at each stage
boundary; a new Trainer on the same run directory continues from the newest complete one, and
SIGTERM (or Ctrl-C) finishes the current step, saves and raises `checkpoints.Preempted` (`saving.py`).
"""

import contextlib
import functools
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from vapo_jax import distributed
from vapo_jax.config import ExperimentConfig, RolloutConfig
from vapo_jax.data import problems
from vapo_jax.data import tokenizer as tok_lib
from vapo_jax.data.prompt_iterator import PromptIterator
from vapo_jax.errors import ConfigError
from vapo_jax.models import hf_export, huggingface, sharding
from vapo_jax.models.config import preset as model_preset
from vapo_jax.models.transformer import CausalLM, ValueModel
from vapo_jax.rewards import reward as reward_lib
from vapo_jax.rollout.layout import RolloutLayout, layout_for
from vapo_jax.train import algorithm, build, checkpoints, held_out, optim, runlock, start_up
from vapo_jax.train import metrics as metrics_lib
from vapo_jax.train import steps as steps_lib
from vapo_jax.train.experience import Experience
from vapo_jax.train.responses import demonstration_rows, demonstrations
from vapo_jax.train.saving import Saving
from vapo_jax.train.state import Progress, TrainState

PROGRESS_KEYS = {"reward": "rollout/reward_mean", "acc": "rollout/accuracy",
                 "len": "rollout/response_len_mean",
                 "entropy": "actor/entropy", "EV": "critic/explained_variance"}


@functools.lru_cache(maxsize=4)
def _layout(settings: RolloutConfig, mesh, dtype: str, preset: str) -> RolloutLayout:
  """`layout_for`, once for the same settings and mesh in this process: a later trainer of the same run (a
  resume, a test's second trainer) runs the rollout programs the layout jitted (`rollout.static.make_generate`
  and the refill engine's are cached by their `jit`) without tracing them again."""
  return layout_for(settings, mesh, compute_dtype=dtype, training_rules=sharding.PRESETS[preset])


class Trainer(Saving):
  """A run's models, data, verifier and programs; `state` and `progress` are all that changes."""

  def __init__(self, config: ExperimentConfig, *, devices=None, write_logs: bool = True,
               verbose: bool = True):
    self.config, self.verbose = config, verbose
    if config.model.checkpoint is None and not config.model.random_init:
      raise ConfigError(f"experiment {config.name!r} needs a model: pass model.checkpoint=/path/to/"
                        f"{config.model.preset} (a Hugging Face directory with config.json and "
                        "*.safetensors) or model.checkpoint=hf:NAME (a Hub model, downloaded into the Hub "
                        "cache), e.g. make train EXP=... "
                        f"ARGS=\"model.checkpoint=/ckpt/{config.model.preset}\"")
    self.run_dir = config.run_directory
    self.lock = runlock.RunLock(self.run_dir) if write_logs and distributed.is_main_process() else None
    if self.lock is not None:
      self.lock.acquire()  # A second start on the same run directory is refused, naming the holder.
    self.checkpoints = self.pool = self.writer = None
    try:
      self._start(devices, write_logs)
    except BaseException:
      self.close(failed=True)
      raise

  def _start(self, devices, write_logs: bool):
    config = self.config
    self.checkpoints = self._open_checkpoints() if write_logs else None
    devices = sharding.tensor_groups(jax.devices() if devices is None else devices,
                                     config.rollout.tensor_parallel)
    self.mesh = sharding.make_mesh(data=config.mesh.data, fsdp=config.mesh.fsdp, tensor=config.mesh.tensor,
                                   devices=devices)  # Rollout tensor groups: physical neighbours (rollout/layout.py).
    rules = sharding.rules(config.mesh.preset, collective_matmul=config.mesh.collective_matmul)
    self.layout = _layout(config.rollout, self.mesh, config.model.dtype, config.mesh.preset)
    self.layout.check_model(build.model_configs(config)[0])
    self.tokenizer = tok_lib.load(config.model.tokenizer or config.model.checkpoint)
    tok_lib.check_tokenizer_matches(huggingface.read_config(config.model.checkpoint) if config.model.checkpoint
                                    else model_preset(config.model.preset), self.tokenizer,
                                    config.model.checkpoint)
    self.pool = reward_lib.make_pool(reward_fn=config.reward.reward_fn,
                                     workers=config.reward.verifier_workers,
                                     timeout_s=config.reward.verifier_timeout_s,
                                     memory_limit_mb=config.reward.verifier_memory_mb)  # A bad reward_fn fails now.
    self.eval_rows = problems.eval_problems(config, self.tokenizer)
    train = problems.training_problems(config, self.tokenizer, self.eval_rows,
                                       say=self.log)  # Overlap: warned/dropped.
    self.sft_rows = (demonstration_rows(config, self.tokenizer, self.eval_rows, say=self.log)
                     if config.sft.steps and config.sft.path else [])  # Checked now.
    actor, critic = self._build_models(rules)
    for path, module in ((config.model.checkpoint, actor), (config.model.critic_checkpoint, critic)):
      if path:
        huggingface.check_finite(path, module)
    self.model_cfg = actor.cfg
    actor_def, actor_params = nnx.split(actor)
    critic_def, critic_params = nnx.split(critic)
    self.steps = steps_lib.shared(config, self.mesh, rules, actor_def=actor_def, critic_def=critic_def,
                                  optimizers=lambda: build.optimizers(config))  # An earlier trainer's, if the same.
    txs = self.steps.txs
    self.experience = Experience(config, steps=self.steps, layout=self.layout, model_cfg=self.model_cfg,
                                 tokenizer=self.tokenizer, pool=self.pool)
    plans = self.experience.check_cache_budget(len(self.eval_rows))  # Now, not after the warm start: every rollout.
    stage = "sft" if config.sft.steps and config.sft.path else "value_pretrain"
    init_opt = lambda name, params: optim.init_optimizer(txs[name], params, self.mesh)
    self.state = TrainState(actor=actor_params, critic=critic_params,
                            actor_opt=init_opt("actor", actor_params),
                            critic_opt=init_opt("critic", critic_params),
                            key=distributed.replicate_local(jax.random.key(config.seed), self.mesh),
                            sft_opt=init_opt("sft", actor_params) if stage == "sft" else None)
    if not config.model.critic_checkpoint:
      self.state = self.critic_from_actor(self.state)
    self.progress = Progress(stage=stage, prompts=PromptIterator(
        train, prompts_per_step=config.rollout.prompts_per_step, seed=config.data.seed),
        sft_rng=np.random.default_rng(config.seed), monitor=metrics_lib.CollapseMonitor(
            length_frac=config.log.collapse_length_frac, min_entropy=config.log.collapse_entropy),
        carry=self.experience.partial and self.experience.partial.carry)
    self._resume(write_logs)
    start_up.run_rollouts(self.experience, self.state, plans)  # Each engine run once, in the rollout layout.
    self.preemption = checkpoints.PreemptionFlag()
    self.history: list[dict] = []

  # ----------------------------------------------------------------------------------- setup
  def _build_models(self, rules) -> tuple[CausalLM, ValueModel]:
    model, kwargs = self.config.model, build.model_kwargs(self.config)
    if model.checkpoint:
      actor = huggingface.load_causal_lm(model.checkpoint, mesh=self.mesh, rules=rules, **kwargs)
    else:  # `key`: a later trainer of the same model config runs the first one's initialisation program.
      actor = sharding.create_sharded(lambda: CausalLM(model_preset(model.preset), rngs=nnx.Rngs(model.init_seed),
                                                       **kwargs), self.mesh, rules, key=("actor", model))
    if model.critic_checkpoint:
      critic = huggingface.load_value_model(model.critic_checkpoint, from_policy=False, mesh=self.mesh,
                                            rules=rules, **kwargs)
    else:
      cfg = actor.cfg  # Not the actor itself: the kept program's closure would keep its arrays.
      critic = sharding.create_sharded(lambda: ValueModel(cfg, rngs=nnx.Rngs(model.init_seed), **kwargs),
                                       self.mesh, rules, key=("critic", model, cfg))
    return actor, critic

  def critic_from_actor(self, state: TrainState) -> TrainState:
    """The critic's backbone := the policy's; value head := 0 (without `model.critic_checkpoint`)."""
    critic = nnx.merge(self.steps.critic_def, state.critic)
    backbone = nnx.state(nnx.merge(self.steps.actor_def, state.actor).model)
    nnx.update(critic.model, jax.tree.map(jnp.copy, backbone))  # A copy: updates donate their buffers.
    critic.value_head[...] = jnp.zeros_like(critic.value_head[...])
    return state._replace(critic=nnx.state(critic))

  def log(self, message: str):
    if self.verbose and distributed.is_main_process():
      print(message, flush=True)

  # ------------------------------------------------------------------------------------ steps
  def step(self, state: TrainState, *,
           value_pretraining: bool = False) -> tuple[TrainState, dict[str, float]]:
    """One RL step, prompts to parameter update (value pretraining: the critic alone, on λ = 1 returns). Host
    transfers: the prompts, the verifier's share and its verdicts, packed rows' lengths and placements, the
    metrics."""
    start = time.perf_counter()
    state, key = state.split_key()
    if value_pretraining:
      sampled = self.experience.sample(state, self.progress.prompts, key,
                                       prefix_step=self.progress.global_step)
    else:
      sampled = self.experience.rl_rollout(state, self.progress.prompts, key,
                                           version=self.progress.stage_step)
    out, rewards, correct, stats, prefixes = sampled
    sampled = time.perf_counter()
    row_plan = self.steps.plan_packing(state, out)  # Packed rows' plan: None unless packing.enabled.
    batch, batch_stats = self.steps.score(state, out, rewards, correct, critic_only=value_pretraining,
                                          plan=row_plan, prefixes=prefixes)
    jax.block_until_ready(batch)
    scored = time.perf_counter()
    state, update_metrics = self.steps.ppo_update(state, batch, actor=not value_pretraining,
                                                  critic=self.config.algo.uses_critic, plan=row_plan)
    metrics = metrics_lib.fetch(stats | batch_stats | update_metrics)
    end, n = time.perf_counter(), out.response_lengths.shape[0]
    tokens = metrics["rollout/response_len_mean"] * n
    metrics |= {"time/logprobs_values_s": scored - sampled,
                "time/update_s": end - scored, "time/step_s": end - start,
                "perf/tokens_per_s": tokens / (end - start),
                "perf/train_tokens_per_s": (tokens + metrics["rollout/prompt_len_mean"] * n) / (end - sampled)}
    return state, metrics

  def _record(self, stage: str, step: int, m: dict, progress=None, keys=None):
    if self.checkpoints is not None:
      self.checkpoints.check()  # A save failing in the background is said as the save's, before the logs fail.
    self.writer.write(step, stage, m, global_step=self.progress.global_step)
    self.history.append({"stage": stage, **m})
    if progress is not None and self.verbose and distributed.is_main_process():
      progress.update(step, m, keys)
    metrics_lib.check_finite(stage, step, m, self.progress, self.config.optim.max_nonfinite_steps)

  # ---------------------------------------------------------------------------------- stages
  def sft_stage(self):
    """Token-level NLL on demonstrations (`sft.path` rows with a `solution`)."""
    config, rows = self.config, self.sft_rows
    progress = metrics_lib.ProgressLine("sft", config.sft.steps)
    for step in range(self.progress.stage_step, config.sft.steps):
      picked = [rows[i] for i in self.progress.sft_rng.integers(0, len(rows), config.sft.batch_size)]
      batch, start = demonstrations(picked, self.tokenizer, config), time.perf_counter()
      self.state, m = self.steps.sft_update(self.state, self.steps.place(batch), self.steps.sft_plan(batch))
      m = metrics_lib.fetch(m) | {"perf/train_tokens_per_s":
                                  np.sum(batch.attention_mask) / (time.perf_counter() - start)}
      self._record("sft", step, m, progress if step % 20 == 0 or step == config.sft.steps - 1 else None,
                   {"nll": "sft/nll"})
      self._after_step(last=step == config.sft.steps - 1)
    self.state = self.state._replace(sft_opt=None)
    if not config.model.critic_checkpoint:
      self.state = self.critic_from_actor(self.state)  # The critic starts from the warm-started policy.

  def value_pretrain_stage(self):
    """Critic only, on Monte-Carlo returns (λ = 1) of the fixed initial policy's samples, or on the last
    token's verdict alone (`algo.value_pretrain_target="outcome"`: a reward model); exported."""
    config, done = self.config, self.progress
    steps = config.algo.value_pretrain_steps if config.algo.uses_critic else 0
    progress = metrics_lib.ProgressLine("value-pretrain", steps)
    while done.stage_step < steps and not algorithm.value_pretraining_converged(done.stage_step, done.vp_best,
                                                                      done.vp_since_best, config.algo):
      step = done.stage_step
      self.state, m = self.step(self.state, value_pretraining=True)
      self._record("value_pretrain", step, m, progress, {"value_loss": "critic/value_loss",
                                                         "EV": "critic/explained_variance"})
      ev = m["critic/explained_variance"]
      if done.vp_best is None or ev > done.vp_best + 0.01:
        done.vp_best, done.vp_since_best = ev, 0
      else:
        done.vp_since_best += 1
      converged = algorithm.value_pretraining_converged(step + 1, done.vp_best, done.vp_since_best,
                                                        config.algo)
      if converged:
        self.log(f"value pretraining converged after {step + 1} steps (explained variance {done.vp_best:.3f})")
      self._after_step(last=converged or step == steps - 1)
    if steps and self.checkpoints is not None:
      path = os.path.join(self.run_dir, "critic_pretrained")
      hf_export.export(nnx.merge(self.steps.critic_def, self.state.critic), path)
      self.log(f"pretrained critic saved to {path}")

  def rl_stage(self):
    config = self.config
    if config.algo.kl_coef > 0 and self.state.ref is None:  # The reference policy: the RL starting point.
      self.state = self.state._replace(ref=jax.tree.map(jnp.copy, self.state.actor))
    progress = metrics_lib.ProgressLine("rl", config.rl_steps)
    for step in range(self.progress.stage_step, config.rl_steps):
      self.state, m = self.step(self.state)
      if config.eval.every_steps and (step + 1) % config.eval.every_steps == 0 and step + 1 < config.rl_steps:
        m |= self.evaluate(step + 1)
      self._record("rl", step, m, progress, PROGRESS_KEYS)
      self.progress.monitor.check(step, m["rollout/response_len_mean"], m["actor/entropy"])
      self._after_step(last=step == config.rl_steps - 1)

  def evaluate(self, rl_steps_done: int) -> dict[str, float]:
    """avg@k on the held-out problems with the eval sampling settings, after `rl_steps_done` RL steps."""
    return held_out.evaluate(self.experience, self.state, self.eval_rows,
                                    rl_steps_done=rl_steps_done) if self.eval_rows else {}

  def run(self) -> dict:
    """SFT warm start → value pretraining → RL, with held-out evaluation before and after RL."""
    config, done, start, rerun = self.config, self.progress, time.perf_counter(), self.progress.stage == "done"
    self.preemption.install()
    try:
      if done.stage == "sft":
        self.sft_stage()
        self._enter("value_pretrain")  # The warm start saved before anything else (the evaluation) can fail.
      if done.eval_before is None:
        done.eval_before = self.evaluate(0)
        self.writer.write(0, "eval_before_rl", done.eval_before, global_step=done.global_step)
        if done.eval_before:
          self.log(f"held-out accuracy before RL: {done.eval_before['eval/accuracy']:.3f} "
                   f"(avg@{config.eval.samples_per_problem} on {len(self.eval_rows)} problems)")
        self._enter(done.stage, save=done.stage_step == 0)
      if done.stage == "value_pretrain":
        self.value_pretrain_stage()
        self._enter("rl")
      if done.stage == "rl":
        self.rl_stage()
        done.eval_after = self.evaluate(config.rl_steps)
        self.writer.write(config.rl_steps, "eval_after_rl", done.eval_after, global_step=done.global_step)
        if config.checkpoint.export_final and self.checkpoints is not None:  # Before "done" is saved.
          self.export(os.path.join(self.run_dir, "export"))
          self.log(f"final policy exported to {os.path.join(self.run_dir, 'export')} (Hugging Face format)")
        self._enter("done")
      before, after = done.eval_before or {}, done.eval_after or {}
      summary = {"run_dir": self.run_dir, "seconds": time.perf_counter() - start,
                 "accuracy_before_rl": before.get("eval/accuracy"),
                 "accuracy_after_rl": after.get("eval/accuracy"),
                 "stderr_before_rl": before.get("eval/accuracy_stderr"),
                 "stderr_after_rl": after.get("eval/accuracy_stderr"),
                 "eval_problems": after.get("eval/problems"),
                 "eval_samples_per_problem": config.eval.samples_per_problem} | {
                 f"accuracy_by_level_{when}": levels for when, levels in (
                     ("before_rl", held_out.by_level(before)), ("after_rl", held_out.by_level(after))) if levels}
      if after:
        self.log(f"held-out accuracy after RL: {after['eval/accuracy']:.3f} (before: "
                 f"{before['eval/accuracy']:.3f})")
      return self.writer.write_summary(summary, rerun=rerun)  # A finished run's re-run keeps its summary.
    finally:
      self.preemption.uninstall()
      self.close(failed=sys.exc_info()[0] is not None)  # A failing run's error is the one reported.

  def close(self, *, failed: bool = False) -> None:
    """Closes the verifier, logs, checkpoints (each, even if one fails) and lock; removes an empty checkpoints/."""
    errors = []  # A full disk: the first error is raised once every part is closed (after a failed start, not).
    for part in [p for p in (self.pool, self.writer, self.checkpoints) if p is not None]:
      try:
        part.close()
      except Exception as e:  # noqa: BLE001
        errors.append(e)
    if failed and self.checkpoints is not None:
      with contextlib.suppress(OSError):  # Not empty: it holds a run's checkpoints, which stay.
        os.rmdir(self.checkpoints.directory)
    self.pool = self.writer = self.checkpoints = None
    if self.lock is not None:
      self.lock.release()
    if errors and not failed:
      raise errors[0]

