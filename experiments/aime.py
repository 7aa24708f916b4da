"""The VAPO paper's setting (arXiv 2504.05118 §5) and its comparisons, on AIME 2024.

  make train EXP=aime ARGS="model.checkpoint=/path/to/Qwen2.5-32B"

Policy and critic start from a Qwen2.5-32B base checkpoint; training prompts are DAPO-Math-17k,
evaluation is AIME 2024 avg@32 at temperature 1.0, top-p 0.7. Reported there: VAPO 60.4,
DAPO 50, vanilla PPO 5; leaving out each technique in turn gives 11 / 33 / 45 / 46 / 53 / 54 / 55
(value pretraining, decoupled GAE, length-adaptive GAE, clip-higher, token-level loss,
positive-example LM loss, group sampling).

Critic. The paper's critics start from a reward model (VAPO §4.1; value pretraining removes its
bias, and vanilla PPO and "w/o value pretraining" keep it). Make one from the policy's samples and
pass it to every row, as the toy sweeps do:

  make train EXP=aime_reward_model ARGS="model.checkpoint=/ckpt/Qwen2.5-32B"
  make train EXP=aime \\
    ARGS="model.checkpoint=/ckpt/Qwen2.5-32B model.critic_checkpoint=runs/aime_reward_model/critic_pretrained"

(or any reward model: a Hugging Face directory with a one-output `score` head). Without
`model.critic_checkpoint` the critic starts from the policy's backbone with a zero value head,
which lacks that bias: a different, probably stronger PPO baseline than the paper's.

Baselines (`experiments/variants.py` builds them, and the toy experiment's, from `vapo()`):
`aime_dapo` uses verl's DAPO recipe settings where they differ from VAPO's: dual clip 10, weight
decay 0.1, no KL; its warm-up is VAPO's, 20 RL steps, which is the DAPO paper's (verl's recipe
uses 10).

Data: the repository's own copies under data/ (found from the package, whatever the working
directory); pass `data.train_path=... eval.path=...` for others, e.g. the hub copy
`data.train_path=hf:BytedTsinghua-SIA/DAPO-Math-17k data.template=raw` (needs `datasets`).
"""

from experiments import variants
from vapo_jax import paths
from vapo_jax.config import (
  AlgoConfig,
  DataConfig,
  EvalConfig,
  ExperimentConfig,
  MeshConfig,
  ModelConfig,
  OptimizerConfig,
  PackingConfig,
  RolloutConfig,
)

DAPO_MATH_17K = paths.data_path("dapo_math_17k/dapo_math_17k.parquet")
AIME_2024 = paths.data_path("aime24/qwen25math_aime24_test.jsonl")
MAX_RESPONSE_TOKENS = 20480


def vapo() -> ExperimentConfig:
  """VAPO with every technique on: the paper's main run (AIME 2024 avg@32 60.4)."""
  return ExperimentConfig(
      name="aime_vapo",
      rl_steps=5000,
      # remat "minimal": the least recomputation whose update fits v5p:8x8x4 in the mesh below (68.26 GiB of 88.08,
      # attention's output and log-sum-exp kept, so its forward kernel runs once; "minimal_with_inputs", which also
      # keeps each block's gathered normed input, needs 95.87: `make memory EXP=aime TOPOLOGY=v5p:8x8x4
      # REMAT=1`, docs/pod.md): no matmul and no attention forward again.
      model=ModelConfig(checkpoint=None, preset="qwen2.5-32b", dtype="bfloat16", remat="minimal"),
      algo=AlgoConfig(
          estimator="gae", gamma=1.0, lam_critic=1.0, decoupled_gae=True,
          length_adaptive_alpha=0.05, value_pretrain_steps=50, eps_low=0.2, eps_high=0.28,
          loss_agg="token-mean", positive_nll_coef=0.1, kl_coef=0.0, mini_batch_responses=512,
          micro_batch_responses=None,  # The whole mini-batch at once: 2 sequences per chip on 256 chips.
          # The rollout samples from int8 weights and an int8 KV cache (below), the trainer scores in bfloat16:
          # truncated importance sampling (FlashRL's, C = 2) weights each token by the two policies' ratio.
          tis_cap=2.0,
      ),
      # Warm-up over 20 RL steps of 16 updates (DAPO's recipe counts 20 rollout steps; the VAPO paper
      # gives none). The critic's is spent in its 50 value-pretraining steps (see OptimizerConfig).
      optim=OptimizerConfig(actor_lr=1e-6, critic_lr=2e-6, warmup_updates=20 * 16),
      # Decoding in the training layout gathers the whole model every token and does not fit (XLA refuses
      # the refill decode loop at 155.78 GiB per chip); the rollout decodes in tensor-parallel groups of
      # 8 chips (a 2x2x2 cube of a v5p slice; 32 groups on 256 chips) from a copy resharded once per step,
      # each layer's seven kernels quantised to int8 (a scale per output channel: 4.10 GB a chip that a decode
      # step reads, against bfloat16's 8.00), over a paged int8 KV cache (a scale per token and KV head): a
      # pool of 64 GiB per chip (31,775 pages of 128 tokens per group, 16.5 KiB per token per chip), every one
      # of a group's 256 sequences in a slot at once: the fewest decode steps (the longest response's). Under
      # the roofline's long-tailed profile (B) the rollout is 106 s of a 396-s step (448 s by the compiler's
      # cycles), against 191 s in bfloat16 (docs/pod.md); on the toy, int8 sampling moved the sampler by a KL of
      # 1e-5 a token and cost no held-out gain (docs/results.md). With every response at the cap the pool holds
      # about 200 sequences a group and the engine preempts and restarts the latest-started. Sized by XLA's
      # figures (`make memory EXP=aime TOPOLOGY=v5p:8x8x4`, docs/pod.md): the peak, the decode, needs 71.57 GiB
      # per chip of the 88.08 allowed;
      # a larger pool buys no speed there, so the rest is margin. `rollout.weight_dtype=model
      # rollout.kv_cache_dtype=model algo.tis_cap=null` samples in bfloat16.
      rollout=RolloutConfig(prompts_per_step=512, samples_per_prompt=16,
                            max_response_tokens=MAX_RESPONSE_TOKENS, temperature=1.0, top_p=1.0,
                            prompts_per_generation=128, kv_cache_budget_gib=64.0, tensor_parallel=8,
                            slots=8192, page_tokens=128, weight_dtype="int8", kv_cache_dtype="int8"),
      # Training: FSDP over 64 chips and tensor parallelism over 4 (heads, MLP, vocabulary: a 2x2 face of each
      # rollout group's cube), parameters and optimizer state split over all 256; the residual stream split along
      # the sequence over the 4. A micro-batch then needs a multiple of 64 packed rows (one per FSDP group), not
      # 256: micro-batches of 64 rows of 22,528 tokens. A tensor group's activations cross it at every block
      # whatever its size, while its share of the matmuls halves with each doubling: over 4 chips the step's
      # collectives are 32 s, over 8 they were 49 s, and the wider MLP matmuls price better (docs/pod.md). Under
      # the roofline's long-tailed profile (B) a mini-batch of 512 responses packs into 128-146 rows, 2.0-2.3
      # micro-batches; so each epoch's shuffled order is cut where the rows fill whole micro-batches
      # (`packing.fill_micro_batches`): still 16 updates of every response once, each mini-batch a contiguous
      # piece of the order with 2 or 3 micro-batches' share of its tokens (446-750 responses under B), 99.5% of the
      # slots real: 34 micro-batches a step, the least the tokens allow (equal mini-batches: 47, 72.0% real).
      # Without the compiler's windowed einsums: with them, each of the FSDP gather's steps accumulates a
      # partial [tokens, width] result in HBM, and the update is bound by HBM (B: 422 s a step's update,
      # against 295 s without; FSDP alone, 401 s; docs/pod.md).
      mesh=MeshConfig(preset="fsdp_tp", data=1, fsdp=64, tensor=4, windowed_einsum=False),
      packing=PackingConfig(micro_batch_rows=64, fill_micro_batches=True),
      data=DataConfig(train_path=DAPO_MATH_17K),
      eval=EvalConfig(path=AIME_2024, samples_per_problem=32, temperature=1.0, top_p=0.7),
  )


def reward_model() -> ExperimentConfig:
  """The outcome reward model the paper's critics start from (`variants.reward_model`): 50 steps of
  8192 samples of the starting policy, the critic fitted to each one's verdict at its last token at
  the critic's learning rate; exported to `runs/aime_reward_model/critic_pretrained/`."""
  base = vapo()
  return variants.reward_model(base, name="aime_reward_model", steps=50, lr=base.optim.critic_lr)


def ppo() -> ExperimentConfig:
  """Vanilla PPO (paper: 5): λ = 0.95 for actor and critic, ε = 0.2, sequence-mean loss, 8192 prompts
  × 1 sample; its critic from `model.critic_checkpoint` (the paper's: a reward model, see above)."""
  return variants.ppo(vapo(), name="aime_ppo")


def grpo() -> ExperimentConfig:
  """GRPO: no critic, group-normalised outcome advantages, symmetric clip, k3 KL to the start."""
  return variants.grpo(vapo(), name="aime_grpo")


def dapo() -> ExperimentConfig:
  """DAPO (paper: 50) with verl's recipe settings: clip-higher, token-mean, dynamic sampling, overlong
  buffer 4096, dual clip 10, weight decay 0.1 (`experiments/variants.py`)."""
  return variants.dapo(vapo(), name="aime_dapo")


def baselines() -> dict[str, ExperimentConfig]:
  """The paper's comparison table: VAPO against vanilla PPO, GRPO and DAPO."""
  return {config.name: config for config in (vapo(), ppo(), grpo(), dapo())}


def ablations() -> dict[str, ExperimentConfig]:
  """VAPO with each of its seven techniques left out in turn (the paper's Table 1 order)."""
  return variants.ablations(vapo(), prefix="aime")
