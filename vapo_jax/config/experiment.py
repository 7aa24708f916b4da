"""Configuration dataclasses: every setting of a run, declared once.

All configs are frozen, keyword-only dataclasses. Invalid values are rejected at construction
with a message naming the field and its valid range; derived values are properties. An
`ExperimentConfig` is the whole run: the algorithm and what it samples and learns from are here
(`AlgoConfig`, `OptimizerConfig`, `RolloutConfig`, `RewardConfig`, `SFTConfig`), the run's surroundings
(model, mesh, packed rows, data, evaluation, checkpoints, logs) in `sections.py`. Each VAPO
technique is one field of `AlgoConfig`, so each ablation is one `dataclasses.replace` (the section
of the VAPO paper, arXiv 2504.05118, that introduces it in brackets):

  1. value pretraining (§4.1)        `value_pretrain_steps` (0 disables)
  2. decoupled GAE (§4.1)            `decoupled_gae` (critic targets use `lam_critic`, else λ_actor)
  3. length-adaptive GAE (§4.2)      `length_adaptive_alpha` (None: fixed `lam_actor`)
  4. clip-higher (§4.3)              `eps_high` (= `eps_low` is symmetric PPO)
  5. token-level loss (§4.2)         `loss_agg` ("token-mean")
  6. positive-example LM loss (§4.3) `positive_nll_coef` (0 disables)
  7. group sampling (§4.3)           `RolloutConfig.samples_per_prompt` (1 disables)
"""

import math
import os
from typing import Literal

from vapo_jax.config import sections
from vapo_jax.config.checks import frozen, in_range, positive_int, require
from vapo_jax.kinds import AnswerForm, Estimator, KLEstimator, LossAggregation, RolloutEngine, ValueTarget, names


@frozen
class AlgoConfig:
  """The RL algorithm: advantage estimation, losses and update schedule. Defaults are VAPO's."""

  estimator: Estimator = "gae"  # "gae": critic + GAE (PPO, VAPO); "group": GRPO/DAPO.
  gamma: float = 1.0  # Discount γ per response token.
  lam_actor: float = 0.95  # Actor λ when `length_adaptive_alpha` is None.
  lam_critic: float = 1.0  # Critic λ for value targets when `decoupled_gae` (VAPO: 1.0).
  decoupled_gae: bool = True  # Technique 2: critic targets with λ_critic; False uses λ_actor.
  length_adaptive_alpha: float | None = 0.05  # Technique 3: λ_actor = 1 − 1/(α·l); None: fixed.
  value_pretrain_steps: int = 50  # Technique 1: critic-only steps on λ=1 returns before RL.
  value_pretrain_target: ValueTarget = "returns"  # "outcome": fit the last token's verdict alone (a reward model).
  # "prefix": "outcome" plus, for this many prefixes of each response (lengths uniform below its own), the
  # verdict of the prefix read as a finished response (no answer yet: the incorrect reward).
  value_pretrain_prefixes: int = 4
  # Value pretraining runs all `value_pretrain_steps` steps (the paper: 50) unless early stopping is
  # asked for: then it stops once `value_pretrain_min_steps` are done, the explained variance has
  # reached `value_pretrain_min_ev` and has not risen by 0.01 for `value_pretrain_patience` steps.
  value_pretrain_patience: int | None = None  # None: no early stopping.
  value_pretrain_min_steps: int = 10  # Early stopping never before this many steps.
  value_pretrain_min_ev: float = 0.5  # Early stopping never below this explained variance.
  eps_low: float = 0.2  # Lower PPO clip: ratio ≥ 1 − eps_low.
  eps_high: float = 0.28  # Technique 4 (clip-higher): ratio ≤ 1 + eps_high.
  dual_clip: float | None = None  # Dual-clip constant c > 1 for negative advantages; None: off.
  # Truncated importance sampling (TIS): each token's policy-gradient term weighted by min(π_old / π_sampler,
  # C), correcting for a sampler that differs from the trainer (bfloat16 rollout weights, a cache's precision,
  # tokens sampled under older weights); C = tis_cap ≥ 1, None: off (the loss is untouched).
  tis_cap: float | None = None
  loss_agg: LossAggregation = "token-mean"  # Technique 5: policy-loss aggregation.
  positive_nll_coef: float = 0.1  # Technique 6: μ, weight of the NLL on correct responses.
  whiten_advantages: bool = True  # Batch-wide whitening of GAE advantages over valid tokens.
  group_std_normalize: bool = True  # "group" estimator: divide by the group std (False: Dr. GRPO).
  value_clip: float | None = None  # Clip range of the value loss around old values; None: off.
  dynamic_sampling: bool = False  # DAPO: keep only groups with accuracy strictly in (0, 1).
  dynamic_sampling_max_rounds: int = 10  # Cap on extra sampling rounds to fill the batch.
  # At the cap, the batch is filled with unmixed groups (zero advantage): "warn" says so (and the
  # metric rollout/unmixed_groups counts them), "raise" stops the run as verl does.
  dynamic_sampling_on_cap: Literal["warn", "raise"] = "warn"
  overlong_buffer_tokens: int = 0  # DAPO soft overlong penalty buffer below the max length; 0: off.
  overlong_penalty_factor: float = 1.0  # Penalty at the max length (linear over the buffer).
  kl_coef: float = 0.0  # Weight of KL(π ‖ π_ref) in the actor loss; 0: no reference policy.
  kl_estimator: KLEstimator = "k3"  # Per-token KL estimator.
  entropy_coef: float = 0.0  # Entropy bonus weight.
  ppo_epochs: int = 1  # Passes over each rollout batch.
  mini_batch_responses: int = 512  # Responses per optimizer update.
  micro_batch_responses: int | None = None  # Gradient-accumulation chunk; None: whole mini-batch.

  def __post_init__(self):
    in_range(self, "gamma", 0.0, 1.0)
    in_range(self, "lam_actor", 0.0, 1.0)
    in_range(self, "lam_critic", 0.0, 1.0)
    if self.length_adaptive_alpha is not None:
      require(self.length_adaptive_alpha > 0, self, "length_adaptive_alpha", "must be > 0 or None",
               self.length_adaptive_alpha)
    positive_int(self, "value_pretrain_steps", allow_zero=True)
    require(self.value_pretrain_target in names(ValueTarget), self, "value_pretrain_target",
            f"must be one of {', '.join(names(ValueTarget))}", self.value_pretrain_target)
    positive_int(self, "value_pretrain_prefixes")
    if self.value_pretrain_patience is not None:
      positive_int(self, "value_pretrain_patience")
    positive_int(self, "value_pretrain_min_steps", allow_zero=True)
    in_range(self, "value_pretrain_min_ev", -1e9, 1.0)
    in_range(self, "eps_low", 0.0, 1.0, hi_open=True)
    in_range(self, "eps_high", 0.0, 10.0)
    if self.dual_clip is not None:
      require(self.dual_clip > 1, self, "dual_clip", "must be > 1 or None", self.dual_clip)
    if self.tis_cap is not None:
      require(self.tis_cap >= 1, self, "tis_cap", "must be >= 1 or None", self.tis_cap)
    in_range(self, "positive_nll_coef", 0.0, 100.0)
    if self.value_clip is not None:
      require(self.value_clip > 0, self, "value_clip", "must be > 0 or None", self.value_clip)
    positive_int(self, "dynamic_sampling_max_rounds", allow_zero=True)
    positive_int(self, "overlong_buffer_tokens", allow_zero=True)
    in_range(self, "overlong_penalty_factor", 0.0, 100.0)
    in_range(self, "kl_coef", 0.0, 100.0)
    in_range(self, "entropy_coef", 0.0, 100.0)
    positive_int(self, "ppo_epochs")
    positive_int(self, "mini_batch_responses")
    if self.micro_batch_responses is not None:
      positive_int(self, "micro_batch_responses")
      require(self.mini_batch_responses % self.micro_batch_responses == 0, self,
               "micro_batch_responses", f"must divide mini_batch_responses={self.mini_batch_responses}",
               self.micro_batch_responses, cross_field=True)
    if self.estimator == "group":
      require(self.value_pretrain_steps == 0, self, "value_pretrain_steps",
               "must be 0 with estimator='group' (there is no critic to pretrain)",
               self.value_pretrain_steps, cross_field=True)

  @property
  def uses_critic(self) -> bool:
    return self.estimator == "gae"


@frozen
class OptimizerConfig:
  """AdamW with linear warm-up then a constant learning rate, for actor and critic."""

  actor_lr: float = 1e-6  # Peak actor learning rate.
  critic_lr: float = 2e-6  # Peak critic learning rate.
  # Linear warm-up over this many optimizer updates (not RL steps: an RL step makes
  # `ExperimentConfig.updates_per_step` of them), then constant. The critic counts its value-
  # pretraining updates too, so with value pretraining its warm-up happens there, by intent: the
  # critic is the model being trained then, and RL starts at its full learning rate.
  warmup_updates: int = 10
  weight_decay: float = 0.01  # Decoupled weight decay.
  b1: float = 0.9  # Adam β1.
  b2: float = 0.999  # Adam β2.
  eps: float = 1e-8  # Adam ε.
  max_grad_norm: float | None = 1.0  # Global-norm gradient clipping; None: off.
  # A non-finite loss or gradient skips its update; this many RL steps in a row with skipped updates stop the
  # run.
  max_nonfinite_steps: int = 3

  def __post_init__(self):
    in_range(self, "actor_lr", 0.0, 1.0, lo_open=True)
    in_range(self, "critic_lr", 0.0, 1.0, lo_open=True)
    positive_int(self, "warmup_updates", allow_zero=True)
    in_range(self, "weight_decay", 0.0, 1.0)
    in_range(self, "b1", 0.0, 1.0, hi_open=True)
    in_range(self, "b2", 0.0, 1.0, hi_open=True)
    in_range(self, "eps", 0.0, 1.0, lo_open=True)
    if self.max_grad_norm is not None:
      require(self.max_grad_norm > 0, self, "max_grad_norm", "must be > 0 or None", self.max_grad_norm)
    positive_int(self, "max_nonfinite_steps")


@frozen
class RolloutConfig:
  """Sampling of training responses (technique 7: group sampling)."""

  prompts_per_step: int = 512  # P: prompts drawn per RL step.
  samples_per_prompt: int = 16  # G: responses sampled per prompt (1: no group sampling).
  max_prompt_tokens: int = 2048  # Longer prompts are rejected when the data is loaded.
  max_response_tokens: int = 20480  # Generation stops here (finish reason "length").
  # Sampling temperature (0: greedy). The trainer's log-probs (PPO ratio, NLL, KL) are of the
  # untempered policy π_θ, the one evaluated and exported; verl tempers them (logits / T). At the
  # paper's T = 1, the two agree; at T ≠ 1 ours treat the tempered samples as π_old's.
  temperature: float = 1.0
  top_p: float = 1.0  # Nucleus sampling mass (1: off).
  top_k: int = 0  # Top-k sampling (0: off).
  stop_token_ids: tuple[int, ...] = ()  # Stop tokens besides the tokenizer's EOS.
  # Per-device KV-cache budget: the refill engine's pool of pages, the static engine's cache; a larger
  # static rollout, or a pool that cannot hold one sequence, is refused.
  kv_cache_budget_gib: float = 16.0
  # The KV cache's storage: "model" (model.dtype), or "int8" with a float32 scale per token and KV head
  # (models/paged_int8.py): the budget holds about twice the tokens, a decode step reads about half.
  kv_cache_dtype: Literal["model", "int8"] = "model"
  # The rollout's weights: "model" (model.dtype), or "int8" layer kernels with a scale per output channel
  # (models/int8_weights.py): a decode step reads about half. With either int8 the sampler's log-probs are the
  # quantised model's, the trainer's full precision's (algo.tis_cap corrects that; rollout/sampler_kl measures it).
  weight_dtype: Literal["model", "int8"] = "model"
  prompts_per_generation: int | None = None  # Generate in rounds of this many prompts (None: all at once).
  # "refill": decode slots that take the next queued sequence as soon as theirs ends (continuous
  # batching); "static": one batch per round that runs until its longest response ends. Same tokens.
  engine: RolloutEngine = "refill"
  # refill: decode slots (concurrent sequences); None: as many as the pool holds with every response at the
  # cap (more slots than that share the pages: the engine preempts and restarts sequences when they run out).
  slots: int | None = None
  pages: int | None = None  # refill: pages of the pool per data-parallel group; None: kv_cache_budget_gib's.
  page_tokens: int | None = None  # refill: tokens per page; None: 128 on TPU, 16 elsewhere.
  block_pages: int | None = None  # refill: pages read per block of paged attention; None: per platform.
  decode_steps_per_call: int = 256  # refill: decode steps run on the device per host call.
  # refill: prompts (a partial rollout's carried tokens with them) take their pages when their samples are
  # about to run and are prefilled inside the decode loop, `prefill_lanes` prompts a queue at once,
  # `prefill_chunk` tokens each per iteration (a 32,768-token prompt in 64 chunks of 512, each reading the
  # pages before it).
  prefill_chunk: int = 512
  prefill_lanes: int = 4
  # refill: once the queue is empty, compact the live sequences into half the slots (or fewer)
  # while at most half are live, so stragglers decode in a small batch (one program per size).
  shrink_slots: bool = True
  # static: KV-cache slots per block read by decode attention; None: 64 on CPU, 512 on GPU/TPU; 0: every slot.
  decode_block: int | None = None
  # Chips per tensor-parallel group while decoding (rollout/layout.py): the weights split over the
  # group (heads, MLP, vocabulary; the KV cache by KV heads) stay still; 1: decode in the training layout.
  tensor_parallel: int = 1
  # Partial rollouts (refill engine): a rollout round stops after this many decode steps; the sequences still
  # decoding carry over into the next round and step, continued under the newer weights (rollout/partial.py).
  # 0: off, every response ends in the step it started.
  decode_budget: int = 0
  # Partial rollouts: a carried sequence whose first token is more than this many policy versions old is
  # restarted from its prompt, so no token trained on is older. (max_staleness + 1) × decode_budget must reach
  # max_response_tokens, so that a restarted sequence can finish.
  max_staleness: int = 1

  def __post_init__(self):
    positive_int(self, "prompts_per_step")
    for name in ("kv_cache_dtype", "weight_dtype"):
      require(getattr(self, name) in ("model", "int8"), self, name, "must be 'model' or 'int8'", getattr(self, name))
    positive_int(self, "decode_budget", allow_zero=True)
    positive_int(self, "max_staleness", allow_zero=True)
    if self.decode_budget:
      require(self.engine == "refill", self, "engine", "must be 'refill' with decode_budget > 0 (the static "
              "engine cannot stop at a budget)", self.engine, cross_field=True)
      reach = (self.max_staleness + 1) * self.decode_budget
      require(reach >= self.max_response_tokens, self, "decode_budget",
              f"× (max_staleness + 1) = {reach} must reach max_response_tokens={self.max_response_tokens}, "
              "or a response that long is restarted before it can finish: raise decode_budget or "
              "max_staleness", self.decode_budget, cross_field=True)
    if self.prompts_per_generation is not None:
      positive_int(self, "prompts_per_generation")
      require(self.prompts_per_step % self.prompts_per_generation == 0, self, "prompts_per_generation",
               f"must divide prompts_per_step={self.prompts_per_step}", self.prompts_per_generation,
              cross_field=True)
    for name in ("slots", "pages", "page_tokens", "block_pages"):
      if getattr(self, name) is not None:
        positive_int(self, name)
    positive_int(self, "decode_steps_per_call")
    positive_int(self, "prefill_chunk")
    positive_int(self, "prefill_lanes")
    positive_int(self, "tensor_parallel")
    if self.decode_block is not None:
      positive_int(self, "decode_block", allow_zero=True)
    positive_int(self, "samples_per_prompt")
    positive_int(self, "max_prompt_tokens")
    positive_int(self, "max_response_tokens")
    in_range(self, "temperature", 0.0, 100.0)
    in_range(self, "top_p", 0.0, 1.0, lo_open=True)
    positive_int(self, "top_k", allow_zero=True)
    require(0 < self.kv_cache_budget_gib < math.inf, self, "kv_cache_budget_gib", "must be a finite number > "
                                                                                  "0 (GiB)",
            self.kv_cache_budget_gib)

  @property
  def responses_per_step(self) -> int:
    return self.prompts_per_step * self.samples_per_prompt


@frozen
class RewardConfig:
  """Verifier reward, given on the last response token."""

  correct: float = 1.0  # Reward when the verifier judges the answer equivalent.
  incorrect: float = -1.0  # Reward otherwise (including no answer and verifier time-outs).
  answer_forms: tuple[AnswerForm, ...] = ("boxed", "answer_line")  # Where the answer is read from.
  format_penalty: float = 0.0  # Added when the answer is in neither \boxed{} nor an Answer: line.
  reward_fn: str | None = None  # "pkg.module:function" (response, answer) -> bool | float instead.
  verifier_workers: int = 0  # Verifier processes (0: one per CPU core).
  verifier_timeout_s: float = 10.0  # Per-response limit; a time-out or crash scores `incorrect`.
  verifier_memory_mb: int | None = 4096  # Address-space limit per verifier process.
  max_error_frac: float = 0.5  # Warn when more of a batch's responses fail to score; all failing stops the run.

  def __post_init__(self):
    require(len(self.answer_forms) > 0, self, "answer_forms", "must name at least one form",
             self.answer_forms)
    in_range(self, "format_penalty", -100.0, 0.0)
    positive_int(self, "verifier_workers", allow_zero=True)
    in_range(self, "verifier_timeout_s", 0.0, 3600.0, lo_open=True)
    if self.verifier_memory_mb is not None:  # None: no limit.
      positive_int(self, "verifier_memory_mb")
    in_range(self, "max_error_frac", 0.0, 1.0)
    if self.reward_fn is not None:
      require(":" in self.reward_fn, self, "reward_fn", "must look like 'package.module:function'",
               self.reward_fn)
    require(self.correct > self.incorrect, self, "correct", f"must exceed incorrect={self.incorrect}",
             self.correct, cross_field=True)


@frozen
class SFTConfig:
  """Supervised warm start on demonstrations (token-level NLL), before any RL."""

  path: str | None = None  # jsonl of (problem, solution) rows, or "synthetic:arithmetic:MIN-MAX"; None: no SFT.
  steps: int = 0  # Optimizer updates.
  batch_size: int = 32  # Demonstrations per update.
  lr: float = 1e-5  # Peak learning rate (AdamW, same warm-up as RL).

  def __post_init__(self):
    positive_int(self, "steps", allow_zero=True)
    positive_int(self, "batch_size")
    in_range(self, "lr", 0.0, 1.0, lo_open=True)


@frozen
class ExperimentConfig:
  """A whole run."""

  name: str  # Run name (the run directory's default name).
  seed: int = 0  # Seed of every PRNG stream of the run.
  rl_steps: int = 1000  # RL steps (each: one rollout batch and its PPO updates).
  run_dir: str = "runs"  # Parent directory of the run directory.
  model: sections.ModelConfig = sections.ModelConfig()
  algo: AlgoConfig = AlgoConfig()
  packing: sections.PackingConfig = sections.PackingConfig()
  optim: OptimizerConfig = OptimizerConfig()
  rollout: RolloutConfig = RolloutConfig()
  reward: RewardConfig = RewardConfig()
  data: sections.DataConfig = sections.DataConfig()
  eval: sections.EvalConfig = sections.EvalConfig()
  sft: SFTConfig = SFTConfig()
  log: sections.LogConfig = sections.LogConfig()
  mesh: sections.MeshConfig = sections.MeshConfig()
  checkpoint: sections.CheckpointConfig = sections.CheckpointConfig()

  def __post_init__(self):
    require(bool(self.name), self, "name", "must be non-empty", self.name)
    positive_int(self, "seed", allow_zero=True)
    positive_int(self, "rl_steps", allow_zero=True)
    responses = self.rollout.responses_per_step
    require(responses % self.algo.mini_batch_responses == 0, self, "algo.mini_batch_responses",
             f"must divide the responses per step ({self.rollout.prompts_per_step} prompts × "
             f"{self.rollout.samples_per_prompt} samples = {responses})", self.algo.mini_batch_responses,
            cross_field=True)
    if self.algo.estimator == "group":
      require(self.rollout.samples_per_prompt > 1, self, "rollout.samples_per_prompt",
               "must be > 1 with algo.estimator='group' (advantages are relative to the group)",
               self.rollout.samples_per_prompt, cross_field=True)
    longest = self.rollout.max_prompt_tokens + self.rollout.max_response_tokens
    if self.packing.row_tokens is not None:
      require(self.packing.row_tokens >= longest, self, "packing.row_tokens",
               "must hold the longest sequence, rollout.max_prompt_tokens + rollout.max_response_tokens = "
               f"{longest}", self.packing.row_tokens, cross_field=True)
    if self.packing.fill_micro_batches:
      require(self.packing.enabled, self, "packing.fill_micro_batches",
               "must be false with packing.enabled=false (it cuts mini-batches by their packed rows)",
               self.packing.fill_micro_batches, cross_field=True)
    if self.rollout.decode_budget:
      require(not self.algo.dynamic_sampling, self, "algo.dynamic_sampling",
               "must be false with rollout.decode_budget > 0 (partial rollouts train on the groups that "
               "complete)", self.algo.dynamic_sampling, cross_field=True)
    if self.algo.overlong_buffer_tokens:
      require(self.algo.overlong_buffer_tokens < self.rollout.max_response_tokens, self,
               "algo.overlong_buffer_tokens",
               f"must be below rollout.max_response_tokens={self.rollout.max_response_tokens}",
               self.algo.overlong_buffer_tokens, cross_field=True)

  @property
  def run_directory(self) -> str:
    """`<run_dir>/<name>`, absolute: the same run however the directory is spelled."""
    return os.path.abspath(os.path.join(self.run_dir, self.name))

  @property
  def cache_dtype(self) -> str:
    """The KV cache's dtype (`rollout.kv_cache_dtype`): "int8", or the model's."""
    return "int8" if self.rollout.kv_cache_dtype == "int8" else self.model.dtype

  @property
  def updates_per_step(self) -> int:
    """Optimizer updates per RL step (the paper: 8192 / 512 = 16)."""
    return self.algo.ppo_epochs * self.rollout.responses_per_step // self.algo.mini_batch_responses
