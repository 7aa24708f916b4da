"""What a run is built from, shared by the trainer and the memory reports: the models' architecture
and settings, the optimizers, and the run's `TrainState` as abstract arrays.

  actor_cfg, critic_cfg = build.model_configs(config)
  txs = build.optimizers(config)
  actor_def, critic_def, state = build.abstract_state(config, mesh, rules, txs, stage="rl")

`abstract_state` allocates nothing: every leaf is a `jax.ShapeDtypeStruct` with the shape, dtype and
`NamedSharding` the trainer's arrays have in that stage (parameters as `sharding.create_sharded`
places them, optimizer states as `optim.init_optimizer` does, the key replicated), so programs can
be lowered and compiled for a mesh of devices that are not there (a TPU topology).
"""

import dataclasses

import jax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from vapo_jax.config import ExperimentConfig
from vapo_jax.models import sharding
from vapo_jax.models.config import TransformerConfig, preset
from vapo_jax.models.transformer import CausalLM, ValueModel
from vapo_jax.train import optim
from vapo_jax.train.state import TrainState


def model_configs(config: ExperimentConfig) -> tuple[TransformerConfig, TransformerConfig]:
  """Architectures of the policy and the critic (from their checkpoints' config.json when given)."""
  m = config.model
  actor = TransformerConfig.from_pretrained(m.checkpoint) if m.checkpoint else preset(m.preset)
  critic = TransformerConfig.from_pretrained(m.critic_checkpoint) if m.critic_checkpoint else actor
  return actor, critic


def model_kwargs(config: ExperimentConfig) -> dict:
  """The keyword arguments every model of the run is built with."""
  m = config.model
  return dict(dtype=m.dtype, param_dtype=m.param_dtype, remat=m.remat, attention=m.attention,
              scan_layers=m.scan_layers, scan_unroll=m.scan_unroll)


def optimizers(config: ExperimentConfig) -> dict:
  """The run's optimizers by name: actor, critic and the supervised warm start's."""
  return {name: optim.make_optimizer(config.optim, lr) for name, lr in
          (("actor", config.optim.actor_lr), ("critic", config.optim.critic_lr), ("sft", config.sft.lr))}


def abstract_state(config: ExperimentConfig, mesh, rules, txs: dict, *, stage: str,
                   layers: int | None = None):
  """(actor graphdef, critic graphdef, `TrainState` of abstract arrays) as the trainer holds them in
  `stage` ("sft": with the warm start's optimizer state; "rl": with the reference policy when
  `algo.kl_coef` > 0). `layers`: only the first this many decoder layers (a quick look at a deep model)."""
  actor_cfg, critic_cfg = (c if layers is None else dataclasses.replace(c, num_layers=layers)
                           for c in model_configs(config))
  kwargs, seed = model_kwargs(config), config.model.init_seed
  actor_def, actor = sharding.abstract_sharded(lambda: CausalLM(actor_cfg, rngs=nnx.Rngs(seed), **kwargs),
                                               mesh, rules)
  critic_def, critic = sharding.abstract_sharded(lambda: ValueModel(critic_cfg, rngs=nnx.Rngs(seed),
                                                                    **kwargs), mesh,
                                                 rules)
  key = jax.eval_shape(lambda: jax.random.key(config.seed))
  state = TrainState(
      actor=actor, critic=critic, actor_opt=optim.abstract_optimizer(txs["actor"], actor, mesh),
      critic_opt=optim.abstract_optimizer(txs["critic"], critic, mesh),
      key=jax.ShapeDtypeStruct(key.shape, key.dtype, sharding=NamedSharding(mesh, PartitionSpec())),
      sft_opt=optim.abstract_optimizer(txs["sft"], actor, mesh) if stage == "sft" else None,
      ref=actor if stage == "rl" and config.algo.kl_coef > 0 else None)
  return actor_def, critic_def, state
