"""VAPO on MATH for one host: Qwen2.5-0.5B (`math`) or Qwen2.5-1.5B (`math_1.5b`), base models, on a TPU VM of
8 chips (v5e-8, v6e-8, v5p-8) or one GPU, weights from the Hub.

  make train EXP=math ARGS="model.checkpoint=hf:Qwen/Qwen2.5-0.5B"
  make train EXP=math_1.5b ARGS="model.checkpoint=hf:Qwen/Qwen2.5-1.5B"
  make sweep SWEEP=math_baselines ARGS="model.checkpoint=hf:Qwen/Qwen2.5-0.5B"     # vanilla PPO, GRPO, DAPO
  make sweep SWEEP=math_ablations ARGS="model.checkpoint=hf:Qwen/Qwen2.5-0.5B"     # each technique left out

SimpleRL-Zoo's setting (arXiv 2503.18892: "zero" RL from the base model on MATH levels 3-5) under the VAPO recipe
at the paper's hyperparameters: training prompts are `data/math_level3to5_simplelr` (8,523 problems), each in
Qwen's chat template with the boxed-answer instruction; MATH-500 is held out (its problems are dropped from
training, `data.drop_eval_overlap`) and evaluated avg@4 every 20 steps. AIME 2024 from the exported policy:

  make eval EXP=math CKPT=runs/math_vapo/export ARGS="eval.path=data/aime24/qwen25math_aime24_test.jsonl \\
    eval.samples_per_problem=32"

Sizes: 64 prompts × 8 samples a step, responses up to 4,096 tokens, mini-batches of 64 (8 updates a rollout),
100 RL steps after 50 of value pretraining; the critic starts as the paper's does, from the policy's own
checkpoint (its backbone with a zero value head, then value pretraining). Policy and critic are split over every
device (FSDP) for training; the rollout decodes in tensor-parallel pairs of devices (Qwen2.5-0.5B's 2 KV heads,
1.5B's 2) from a bfloat16 copy of the policy: decoding in the training layout would gather the whole model every
token (2.28 GiB a step per v5e chip, 2.5× the policy's weights, XLA's figure).

Machines (`make memory EXP=... TOPOLOGY=...`: every phase compiled at full depth against the chip's memory, and
the roofline's step; figures in docs/quickstart.md): the 0.5B model's defaults fit v5e-8 (v5e:2x4, the rollout's
6.2 GiB of 15.75 at the peak), v6e-8 (v6e:2x4) and v5p-8 (v5p:2x2x1) unchanged; a roofline step of 7-34 s. On a
GPU the mesh is the devices there are (`mesh.fsdp=-1`).
"""

from experiments import variants
from vapo_jax import config as c
from vapo_jax import paths

MATH_TRAIN = paths.data_path("math_level3to5_simplelr/train.parquet")
MATH_500 = paths.data_path("math500/test.jsonl")
MAX_RESPONSE_TOKENS = 4096


def vapo(*, preset: str = "qwen2.5-0.5b", name: str = "math_vapo") -> c.ExperimentConfig:
  """VAPO with every technique on, from a Qwen2.5 base model of `preset`'s size."""
  return c.ExperimentConfig(
      name=name,
      rl_steps=100,
      model=c.ModelConfig(checkpoint=None, preset=preset, dtype="bfloat16", remat="full"),
      algo=c.AlgoConfig(
          estimator="gae", gamma=1.0, lam_critic=1.0, decoupled_gae=True,
          length_adaptive_alpha=0.05, value_pretrain_steps=50, eps_low=0.2, eps_high=0.28,
          loss_agg="token-mean", positive_nll_coef=0.1, kl_coef=0.0, mini_batch_responses=64,
      ),
      optim=c.OptimizerConfig(actor_lr=1e-6, critic_lr=2e-6, warmup_updates=10 * 8),
      rollout=c.RolloutConfig(prompts_per_step=64, samples_per_prompt=8, max_prompt_tokens=1024,
                            max_response_tokens=MAX_RESPONSE_TOKENS, temperature=1.0, top_p=1.0,
                            kv_cache_budget_gib=4.0, tensor_parallel=2),
      mesh=c.MeshConfig(preset="fsdp", data=1, fsdp=-1),
      # Two of the file's 8,523 rows have an empty answer: skipped, with one line saying so.
      data=c.DataConfig(train_path=MATH_TRAIN, template="boxed", chat_template=True, drop_eval_overlap=True,
                      skip_bad_rows=True),
      eval=c.EvalConfig(path=MATH_500, samples_per_problem=4, temperature=1.0, top_p=0.7, every_steps=20),
  )


def vapo_1_5b() -> c.ExperimentConfig:
  """The same from Qwen2.5-1.5B."""
  return vapo(preset="qwen2.5-1.5b", name="math_1.5b_vapo")


def baselines() -> dict[str, c.ExperimentConfig]:
  """VAPO against vanilla PPO, GRPO and DAPO (`experiments/variants.py`), at 0.5B."""
  return variants.baselines(vapo(), prefix="math")


def ablations() -> dict[str, c.ExperimentConfig]:
  """VAPO with each of its seven techniques left out in turn (the paper's Table 1), at 0.5B."""
  return variants.ablations(vapo(), prefix="math")
