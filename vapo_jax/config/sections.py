"""The run's surroundings: the model and its numerics, the device mesh, packed rows, the data, the held-out
evaluation, checkpoints and logs (the sections of `ExperimentConfig` besides the algorithm's).
Frozen, keyword-only dataclasses, validated at construction like `experiment.py`'s."""

from typing import Literal

from vapo_jax.config.checks import frozen, in_range, positive_int, require
from vapo_jax.kinds import Attention, DType, MeshPreset, Remat, Schema, Template, names
from vapo_jax.models.config import PRESETS as MODEL_PRESETS


@frozen
class DataConfig:
  """Training prompts."""

  train_path: str | None = None  # jsonl / json / parquet file, or "hf:NAME[:CONFIG]" / a dataset dir.
  schema: Literal["auto", Schema] = "auto"  # Row schema ("auto": detected from the first row's keys).
  prompt_field: str | None = None  # Dotted path of the problem text (e.g. "prompt.0.content").
  answer_field: str | None = None  # Dotted path of the reference answer.
  id_field: str | None = None  # Dotted path of the row id (default: the row number).
  split: str = "train"  # Hugging Face datasets split.
  template: Template = "dapo"  # Instruction wrapped around each problem.
  chat_template: bool = True  # Wrap the prompt in the tokenizer's chat template.
  dedup: bool = True  # Drop repeated problems (conflicting answers are reported).
  # Training problems (data.train_path, and sft.path's demonstrations) that are also evaluation problems
  # (eval.path): true drops them (one line in the run's log says how many); false keeps them with a warning
  # that says how many the held-out accuracy has seen in training. Off by default: a run's data stays what its
  # file holds. The synthetic experiments (tiny, toy) turn it on: their small problem spaces overlap.
  drop_eval_overlap: bool = False
  seed: int = 0  # Shuffling seed.
  skip_bad_rows: bool = False  # Warn and skip malformed rows instead of failing.

  def __post_init__(self):
    positive_int(self, "seed", allow_zero=True)


@frozen
class EvalConfig:
  """Held-out evaluation (the paper: AIME 2024 avg@32 at temperature 1.0, top-p 0.7)."""

  path: str | None = None  # Evaluation problems; None: no evaluation.
  max_problems: int | None = None  # Evaluate on the first N problems only (None: all).
  samples_per_problem: int = 32  # k of avg@k.
  temperature: float = 1.0  # Sampling temperature.
  top_p: float = 0.7  # Nucleus sampling mass.
  every_steps: int = 50  # Evaluate every this many RL steps (0: only at the end).

  def __post_init__(self):
    if self.max_problems is not None:
      positive_int(self, "max_problems")
    positive_int(self, "samples_per_problem")
    in_range(self, "temperature", 0.0, 100.0)
    in_range(self, "top_p", 0.0, 1.0, lo_open=True)
    positive_int(self, "every_steps", allow_zero=True)


@frozen
class LogConfig:
  """What a run reports, and when it warns."""

  collapse_length_frac: float = 0.3  # Warn when the mean response length falls below this fraction of its first value.
  collapse_entropy: float = 0.05  # Warn when the mean token entropy (nats) falls below this.
  wandb: bool = False  # Also log to Weights & Biases (`pip install -e ".[wandb]"`).
  wandb_project: str = "vapo_jax"  # W&B project.
  wandb_entity: str | None = None  # W&B entity (team or user); None: the account's default.
  # "auto": online when an API key is found (WANDB_API_KEY or `wandb login`), else offline into
  # <run_dir>/wandb (upload later with `wandb sync`). The WANDB_MODE variable, when set, wins.
  wandb_mode: Literal["auto", "online", "offline"] = "auto"

  def __post_init__(self):
    in_range(self, "collapse_length_frac", 0.0, 1.0)
    in_range(self, "collapse_entropy", 0.0, 100.0)
    require(bool(self.wandb_project.strip()), self, "wandb_project", "must be a non-empty name",
            self.wandb_project)


@frozen
class ModelConfig:
  """Policy and critic networks."""

  # The initial policy: a Hugging Face checkpoint directory, or a Hub model "hf:NAME[@REVISION]" (downloaded
  # into the Hub cache, models/hub.py).
  checkpoint: str | None = None
  # The critic's own checkpoint (a directory or "hf:NAME"): a value model, or a reward model (a one-output
  # `score` head) as the paper's PPO baseline starts from; None: the policy's backbone with a zero value head.
  critic_checkpoint: str | None = None
  preset: str = "tiny"  # Architecture preset when no checkpoint is given (tests, CPU runs).
  dtype: DType = "bfloat16"  # Compute dtype.
  param_dtype: DType = "float32"  # Parameter storage dtype.
  # What each decoder layer keeps for the backward pass, and what it computes again (models/remat.py: "none",
  # "minimal", "save_dot_except_mlp", "save_qkv_proj", "offload_qkv_proj", "full"; true / false: "full" /
  # "none").
  remat: Remat = "full"
  # Attention kernel (models/attention.py): "auto" = splash on TPU; on GPU in bf16 cudnn (padded rows) and
  # pallas_gpu (packed rows); chunked otherwise.
  attention: Attention = "auto"
  tokenizer: str | None = None  # Tokenizer directory, "hf:NAME", or "bytes"; None: the checkpoint's.
  random_init: bool = False  # Start from random weights of `preset` (CPU experiments); else a checkpoint.
  init_seed: int = 0  # Seed of the random initialisation.
  # Log-probs, entropy and SFT hold at most B·logits_chunk·V float32 logits at once (models/logprobs.py).
  logits_chunk: int = 512
  # Decoder layers as a `lax.scan` over their stacked parameters: programs hold one layer, whatever the depth
  # (models/transformer.py); false: a Python loop over the same parameters (the tests' oracle).
  scan_layers: bool = True
  scan_unroll: int = 1  # Layers per scan iteration (`lax.scan`'s unroll; 1: a loop of L iterations).

  def __post_init__(self):
    if isinstance(self.remat, bool):  # The setting's older form (config.json files of earlier runs).
      object.__setattr__(self, "remat", "full" if self.remat else "none")
    require(self.remat in names(Remat), self, "remat", f"must be one of {', '.join(names(Remat))}",
            self.remat)
    require(self.preset in MODEL_PRESETS, self, "preset", f"must be one of {', '.join(MODEL_PRESETS)}",
             self.preset)
    positive_int(self, "logits_chunk")
    positive_int(self, "scan_unroll")


@frozen
class MeshConfig:
  """Device mesh (data, fsdp, tensor) and the sharding preset mapping logical axes onto it."""

  preset: MeshPreset = "fsdp"  # Logical-axis → mesh-axis rules (models/sharding.py).
  data: int = -1  # Data-parallel size; -1 fills the devices left over.
  fsdp: int = 1  # Parameter-sharding (ZeRO-3) size.
  tensor: int = 1  # Tensor-parallel size.
  # On a host without an accelerator, the CPU devices JAX makes, each running its share on its own thread: a
  # `dp` mesh over them uses that many cores. None: JAX's one. VAPO_LOCAL_DEVICES and XLA_FLAGS'
  # --xla_force_host_platform_device_count come first (`distributed.initialize`).
  cpu_devices: int | None = None
  device_memory_gib: float | None = None  # Memory per device the programs must fit; None: the device's own.
  check_memory: bool = True  # At start-up, refuse a run whose compiled programs exceed the memory.
  memory_margin: float = 0.08  # Share of the device memory kept free: a phase may need at most (1 - margin).
  # The TPU compiler's windowed einsums: a weight's all-gather (or a result's reduce-scatter) split into steps
  # that overlap the matmul, each step's partial result accumulated in HBM. False: libtpu's
  # --xla_tpu_enable_windowed_einsum_for_{all_gather,reduce_scatter}=false (`distributed.tpu_compiler_flags`).
  windowed_einsum: bool = True
  # Under `fsdp_tp`: each decoder block gathers its sequence-split input and reduces its output over tensor in steps
  # around its matmuls' chunks, each step's transfer overlapping a chunk's multiply (models/collective_matmul.py).
  collective_matmul: bool = False

  def __post_init__(self):
    if self.cpu_devices is not None:
      positive_int(self, "cpu_devices")
    if self.device_memory_gib is not None:
      in_range(self, "device_memory_gib", 0.0, 1e6, lo_open=True)
    in_range(self, "memory_margin", 0.0, 1.0, hi_open=True)
    for name in ("data", "fsdp", "tensor"):
      value = getattr(self, name)
      require(isinstance(value, int) and (value >= 1 or value == -1), self, name,
               "must be a positive integer or -1 (fill)", value)
    require(sum(getattr(self, n) == -1 for n in ("data", "fsdp", "tensor")) <= 1, self, "data",
             "allows at most one axis of -1", (self.data, self.fsdp, self.tensor), cross_field=True)
    require(not self.collective_matmul or (self.preset == "fsdp_tp" and self.tensor != 1), self,
            "collective_matmul", "needs a sequence split over tensor: mesh.preset=fsdp_tp with mesh.tensor > 1 "
            f"(here preset {self.preset!r}, tensor {self.tensor})", self.collective_matmul, cross_field=True)


@frozen
class PackingConfig:
  """Packed rows (`train/packing.py`, docs/packing.md): scoring, both updates, value
  pretraining and the warm start run on sequences laid end to end in rows of `row_tokens`, so their
  compute follows the real tokens. Off, every sequence is padded to the prompt bucket +
  `rollout.max_response_tokens`: the layout the packed one is tested against."""

  enabled: bool = True  # Packed rows; false: one padded sequence per row.
  row_tokens: int | None = None  # Tokens per row; None: the prompt bucket + rollout.max_response_tokens.
  micro_batch_rows: int | None = None  # Rows per micro-batch (scoring, updates); None: one per data-parallel device.
  # The update's mini-batches cut from each epoch's shuffled order where their rows fill whole micro-batches
  # (`packing.cut_filled`): still K = responses / algo.mini_batch_responses updates an epoch, every response
  # once, each a contiguous piece of the order, but a number of responses that varies with their lengths;
  # false: exactly algo.mini_batch_responses each, the last micro-batch of each partly padding.
  fill_micro_batches: bool = False

  def __post_init__(self):
    if self.row_tokens is not None:
      positive_int(self, "row_tokens")
    if self.micro_batch_rows is not None:
      positive_int(self, "micro_batch_rows")


@frozen
class CheckpointConfig:
  """Orbax checkpoints of the whole training state, automatic resume and preemption."""

  every_steps: int = 50  # Save after every this many steps of a stage (and at each stage's end); 0: never.
  keep: int = 3  # Keep the last this many checkpoints.
  async_save: bool = True  # Write in the background (arrays are copied to host first).
  resume: bool = True  # Resume from the newest complete checkpoint of the run directory.
  allow_config_change: bool = False  # Resume even when the resolved config differs (the fields are listed).
  export_final: bool = True  # Write the final policy as a Hugging Face directory (`<run>/export`).

  def __post_init__(self):
    positive_int(self, "every_steps", allow_zero=True)
    positive_int(self, "keep")
