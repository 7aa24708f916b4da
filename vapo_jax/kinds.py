"""Every named choice of the package, declared once (a leaf: imports nothing of the package).

`config` declares its fields with these types, the command line parses them, and the module that
owns each choice takes it as an argument (`match` at the use site). Where an owner keeps a table
keyed by the names (schemas, templates, sharding presets), it checks at import that its keys are
exactly these. Keeping them here lets `import vapo_jax.config` load no JAX.
"""

import typing
from typing import Literal

# rl/: the pure math.
LossAggregation = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum",
                          "seq-mean-token-sum-norm"]
KLEstimator = Literal["k1", "k2", "k3"]
Estimator = Literal["gae", "group"]  # "gae": critic + GAE (PPO, VAPO); "group": GRPO / DAPO.
# Value pretraining: MC returns on every token; the outcome on the last; the outcome on the last and, at
# sampled prefixes, the verdict of the prefix read as a finished response (a reward model that knows
# "unfinished").
ValueTarget = Literal["returns", "outcome", "prefix"]

# models/: numerics, attention kernels (models/attention.py) and sharding presets (models/sharding.py).
DType = Literal["float32", "bfloat16"]
Attention = Literal["auto", "chunked", "cudnn", "splash", "pallas_gpu", "reference"]
# What a decoder layer keeps for the backward pass (models/remat.py), least recomputation first.
Remat = Literal["none", "minimal_with_inputs", "minimal", "save_dot_except_mlp", "save_qkv_proj", "offload_qkv_proj",
                "full"]
MeshPreset = Literal["dp", "fsdp", "fsdp_tp", "tp"]  # "tp": the rollout layout (rollout/layout.py).

# rollout/: the decoding engine (rollout/__init__.py).
RolloutEngine = Literal["static", "refill"]

# data/: row layouts (data/records.py SCHEMAS) and instruction templates (data/problems.py TEMPLATES).
Schema = Literal["verl", "problem_answer", "gsm8k", "question_answer", "svs"]
Template = Literal["raw", "boxed", "dapo"]

# rewards/: where an answer is read from (rewards/extract.py).
AnswerForm = Literal["boxed", "answer_line", "last_number", "math_verify"]


def names(kind) -> tuple[str, ...]:
  """The names a Literal allows, in declaration order."""
  return typing.get_args(kind)


def check_table(kind, table, owner: str) -> None:
  """Raises at import when a table keyed by a choice's names has other keys than the Literal."""
  if tuple(table) != names(kind):
    raise AssertionError(f"{owner}: table keys {tuple(table)} differ from the declared choices {names(kind)}")
