"""Rematerialisation policies (`model.remat`): what a decoder layer keeps from its forward pass for the
backward pass, and what it computes again. Least recomputation (most memory) first:

  none                 keeps everything: no second forward.
  minimal_with_inputs  `minimal`, and each block's normed input as its matmuls read it (under sequence
                       parallelism gathered along the sequence): the backward pass neither norms nor gathers it
                       again for the weights' gradients.
  minimal              keeps every matmul output without batch dimensions (the q/k/v/o and MLP projections) and
                       attention's output and log-sum-exp (its kernel's residuals, `ATTENTION_CONTEXT`):
                       recomputes the elementwise work, and attention only in its own backward.
  save_dot_except_mlp  keeps the attention's q/k/v and output projections (by name); recomputes the MLP.
  save_qkv_proj        keeps the q/k/v projections; recomputes the output projection and the MLP.
  offload_qkv_proj     `save_qkv_proj` with the kept arrays in host memory (pinned), copied back for the backward
                       pass: the device holds none of them, the host link carries them twice.
  full                 keeps only the layer's input: the whole layer forward again.

  layer_step = remat.wrap(layer_step, "save_qkv_proj", prevent_cse=False)

The names are those the attention gives its projections (`checkpoint_name`, models/transformer.py); MaxText
names its policies the same way. Every policy computes the same gradients (tests/test_remat.py); only memory
and time differ, which `make memory` compiles (`--remat`)."""

import jax
from jax.ad_checkpoint import checkpoint_name

from vapo_jax import kinds

QUERY, KEY, VALUE, OUT = "query_proj", "key_proj", "value_proj", "out_proj"
ATTENTION_IN, MLP_IN = "attention_in", "mlp_in"  # The blocks' normed inputs, as their matmuls read them.
# Attention's residuals, its output and log-sum-exp (models/splash.py, models/flash.py): kept, the backward pass
# does not run attention's forward again.
ATTENTION_CONTEXT = "attention_context"
_policies = jax.checkpoint_policies
POLICIES = {
    "none": None,
    "minimal_with_inputs": _policies.save_from_both_policies(
        _policies.dots_with_no_batch_dims_saveable,
        _policies.save_only_these_names(ATTENTION_CONTEXT, ATTENTION_IN, MLP_IN)),
    "minimal": _policies.save_from_both_policies(_policies.dots_with_no_batch_dims_saveable,
                                                 _policies.save_only_these_names(ATTENTION_CONTEXT)),
    "save_dot_except_mlp": _policies.save_only_these_names(QUERY, KEY, VALUE, OUT),
    "save_qkv_proj": _policies.save_only_these_names(QUERY, KEY, VALUE),
    "offload_qkv_proj": _policies.save_and_offload_only_these_names(
        names_which_can_be_saved=[], names_which_can_be_offloaded=[QUERY, KEY, VALUE], offload_src="device",
        offload_dst="pinned_host"),
    "full": _policies.nothing_saveable,
}
kinds.check_table(kinds.Remat, POLICIES, "models/remat.py POLICIES")


def policy_name(remat: kinds.Remat | bool) -> kinds.Remat:
  """A policy's name; a bool is the setting's older form (true: "full", false: "none")."""
  if isinstance(remat, bool):
    return "full" if remat else "none"
  if remat not in POLICIES:
    raise ValueError(f"model.remat must be one of {', '.join(POLICIES)}, got {remat!r}")
  return remat


def wrap(fn, remat: kinds.Remat | bool, *, prevent_cse: bool):
  """`fn` (one decoder layer's step) under `remat`'s policy: as is for "none"."""
  name = policy_name(remat)
  return fn if name == "none" else jax.checkpoint(fn, policy=POLICIES[name], prevent_cse=prevent_cse)


def named(x: jax.Array, name: str) -> jax.Array:
  """`x` named for the policies (an identity outside `jax.checkpoint`)."""
  return checkpoint_name(x, name)
