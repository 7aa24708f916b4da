"""The optimizers: AdamW with a linear warm-up, global-norm clipping, and skipped non-finite updates.

The learning rate in force is kept in the optimizer state (`learning_rate`), from optax's own update
count; `init_optimizer` lays the state out like the parameters it updates.
"""

import jax
import optax

from vapo_jax.config import OptimizerConfig


def make_optimizer(optim: OptimizerConfig, peak_lr: float) -> optax.GradientTransformation:
  """AdamW, linear warm-up to `peak_lr` then constant, after global-norm clipping. The learning rate
  in force is kept in the state (`learning_rate`), from optax's own update count."""
  if optim.warmup_updates:
    schedule = optax.join_schedules(
        [optax.linear_schedule(peak_lr / optim.warmup_updates, peak_lr, optim.warmup_updates - 1),
         optax.constant_schedule(peak_lr)], [optim.warmup_updates])
  else:
    schedule = optax.constant_schedule(peak_lr)
  adamw = optax.inject_hyperparams(optax.adamw)(learning_rate=schedule, b1=optim.b1, b2=optim.b2,
                                                eps=optim.eps, weight_decay=optim.weight_decay)
  chain = [optax.clip_by_global_norm(optim.max_grad_norm)] if optim.max_grad_norm else []
  # A non-finite gradient skips the update (parameters and moments unchanged); the trainer stops
  # the run after `optim.max_nonfinite_steps` steps of them, so optax never gives up here.
  return optax.apply_if_finite(optax.chain(*chain, adamw), max_consecutive_errors=2**30)


def learning_rate(opt_state) -> jax.Array:
  """The learning rate of the last update made with `opt_state` (`make_optimizer`'s)."""
  return opt_state.inner_state[-1].hyperparams["learning_rate"]


def init_optimizer(tx: optax.GradientTransformation, params, mesh: jax.sharding.Mesh):
  """The optimizer state laid out like the parameters (moments sharded as their parameter, the
  step count replicated); a plain `jit(tx.init)` would leave it all on one device."""
  return jax.jit(tx.init,
                 out_shardings=jax.tree.map(lambda x: x.sharding, abstract_optimizer(tx, params, mesh)))(
      params)


def abstract_optimizer(tx: optax.GradientTransformation, params, mesh: jax.sharding.Mesh):
  """`init_optimizer`'s state as `jax.ShapeDtypeStruct`s carrying its shardings, allocating nothing
  (`params` may be abstract: anything with shapes, dtypes and shardings)."""
  abstract = jax.eval_shape(tx.init, params)
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  shardings = optax.tree_utils.tree_map_params(tx, lambda _, s: s, abstract,
                                               jax.tree.map(lambda x: x.sharding, params),
                                               transform_non_params=lambda _: replicated)
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), abstract, shardings)
