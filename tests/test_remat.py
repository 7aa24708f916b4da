"""Every rematerialisation policy (`model.remat`, models/remat.py) computes the gradients of keeping everything
("none"): within 1e-6 in float32 on 8 CPU devices, in the `fsdp_tp` training layout, on packed rows (each row
several sequences end to end), for the actor's token NLL and the critic's squared error. The policies differ in
what the compiled backward pass keeps: "none" recomputes no matmul, "full" the whole layer.

The weights are the initial ones plus noise of 0.1 (`training_layout_model`'s scale): at 0.3, 15x their initial
scale, XLA's default CPU optimisation fuses a recomputed forward unlike the first one and single elements differ
by up to 1.2e-6 in float32 (today's "full" too; 3.6e-7 at make test's optimisation level 0); at 0.1 by under 1e-7."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from model_utils import MESHES, TP_CFG, place_module, training_layout_model
from vapo_jax import kinds
from vapo_jax.config import ExperimentConfig, ModelConfig
from vapo_jax.errors import ConfigError
from vapo_jax.models import remat, sharding
from vapo_jax.models.transformer import ValueModel

POLICIES = kinds.names(kinds.Remat)


def with_policy(module, policy):
  graphdef, state = nnx.split(module)
  copy = nnx.merge(graphdef, state)
  copy.model.remat = policy
  return copy


def packed_rows(cfg, rows=4, length=16, seed=0):
  """Rows of 2-3 sequences end to end (segment ids 1, 2, ..., 0 on the padding), positions restarting per sequence."""
  rng = np.random.default_rng(seed)
  segments = np.zeros((rows, length), np.int32)
  positions = np.zeros((rows, length), np.int32)
  for r in range(rows):
    cuts = sorted(rng.choice(np.arange(3, length - 2), size=2, replace=False)) + [length - r]
    start = 0
    for s, end in enumerate(cuts, 1):
      segments[r, start:end], positions[r, start:end] = s, np.arange(end - start)
      start = end
  tokens = rng.integers(0, cfg.vocab_size, (rows, length))
  return jnp.asarray(tokens), jnp.asarray(positions), jnp.asarray(segments)


# make test-slow, for time (one program per case, 11 s and more: its compile): make test holds the policies to what
# they keep (test_the_policies_keep_what_they_name) and the full policy's gradients to the unrolled layers'
# (test_scan_layers.py).
@pytest.mark.slow
@pytest.mark.parametrize("compared", [("offload_qkv_proj",), ("minimal_with_inputs", "minimal", "save_dot_except_mlp",
                                                               "save_qkv_proj", "full")])
def test_every_policy_gives_the_gradients_of_keeping_everything(compared):
  actor, _, mesh, _ = training_layout_model(mesh_shape=MESHES["fsdp_tp"], scale=0.1)
  rules = sharding.PRESETS["fsdp_tp"]
  critic = ValueModel(TP_CFG, rngs=nnx.Rngs(4))
  nnx.update(critic.model, nnx.state(actor.model))
  actor, critic = place_module(actor, mesh, rules), place_module(critic, mesh, rules)
  tokens, positions, segments = packed_rows(TP_CFG)
  targets = jnp.asarray(np.random.default_rng(2).normal(size=tokens.shape), jnp.float32)
  same = (segments[:, 1:] == segments[:, :-1]) & (segments[:, 1:] != 0)  # Next token in the same sequence.

  def losses(a, c):
    logits = a(tokens, positions, None, segment_ids=segments)[0][:, :-1]
    logprobs = jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[:, 1:, None], -1)[..., 0]
    values = c(tokens, positions, None, segment_ids=segments)[0]
    valid = segments != 0
    return -jnp.sum(logprobs * same) / jnp.sum(same), jnp.sum(valid * (values - targets) ** 2) / valid.sum()

  def grads(a, c):  # The policies compared in one program: one compile.
    out = {}
    for policy in ("none", *compared):
      pa, pc = with_policy(a, policy), with_policy(c, policy)
      out[policy] = (nnx.grad(lambda m: losses(m, pc)[0])(pa), nnx.grad(lambda m: losses(pa, m)[1])(pc))
    return out

  found = sharding.jit(grads, mesh, rules)(actor, critic)
  reference = jax.tree.leaves(found["none"])
  for policy in compared:
    for a, b in zip(jax.tree.leaves(found[policy]), reference, strict=True):
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6, rtol=1e-6, err_msg=policy)
  assert max(float(jnp.abs(g).max()) for g in reference) > 1e-3  # The gradients are not all zero.


def test_the_policies_keep_what_they_name():
  """The gradient program of "none" computes each forward matmul once, and so does "minimal" (it keeps attention's
  output and log-sum-exp, so attention's forward does not run again); "save_dot_except_mlp" recomputes attention's
  own products and the MLP's, "save_qkv_proj" the output projection too, "full" every one (dot_generals counted in
  the lowered program; the rotary embedding's products with its permutation `[N, H, H]` aside: like the elementwise
  work, every policy but "none" computes them again)."""
  cfg = TP_CFG
  from vapo_jax.models.transformer import CausalLM
  model = CausalLM(cfg, rngs=nnx.Rngs(0))
  tokens, positions, segments = packed_rows(cfg)
  rotation = tuple(f"tensor<{n}x{cfg.head_dim}x{cfg.head_dim}x" for n in (cfg.num_heads, cfg.num_kv_heads))
  rotations = []

  def dots(policy):
    m = with_policy(model, policy)
    loss = lambda m: m(tokens, positions, None, segment_ids=segments)[0].sum()
    text = jax.jit(nnx.grad(loss)).lower(m).as_text()
    lines = [line for line in text.splitlines() if "stablehlo.dot_general" in line]
    rotations.append(sum(any(r in line for r in rotation) for line in lines))
    return len(lines) - rotations[-1]

  counts = {policy: dots(policy) for policy in POLICIES}
  assert min(rotations) >= 2, rotations  # q's and k's: the filter finds them.
  order = [counts[p] for p in ("none", "save_dot_except_mlp", "save_qkv_proj", "full")]
  assert order == sorted(set(order)), counts  # Each recomputes more matmuls than the one before it.
  assert counts["minimal"] == counts["none"], counts
  assert counts["minimal_with_inputs"] == counts["minimal"], counts  # It keeps more, but no matmul output.
  assert counts["offload_qkv_proj"] == counts["save_qkv_proj"], counts  # The same arrays kept, on the host.


def test_minimal_with_inputs_keeps_the_blocks_normed_inputs_beside_minimals(capsys):
  """"minimal_with_inputs" keeps two arrays more than "minimal" (its matmuls the same): each block's normed
  input, stacked over the layers `[L, rows, T, D]` (jax's list of a gradient's saved residuals)."""
  from vapo_jax.models.transformer import CausalLM
  model = CausalLM(TP_CFG, rngs=nnx.Rngs(0))
  tokens, positions, segments = packed_rows(TP_CFG)

  def kept(policy):
    graphdef, state = nnx.split(with_policy(model, policy))
    loss = lambda s: nnx.merge(graphdef, s)(tokens, positions, None, segment_ids=segments)[0].sum()
    capsys.readouterr()
    jax.ad_checkpoint.print_saved_residuals(loss, state)
    return sorted(line.split()[0] for line in capsys.readouterr().out.splitlines() if line.strip())

  minimal, more = kept("minimal"), kept("minimal_with_inputs")
  for array in minimal:
    more.remove(array)
  inputs = f"f32[{TP_CFG.num_layers},{','.join(map(str, tokens.shape))},{TP_CFG.hidden_size}]"
  assert more == [inputs, inputs]


def test_the_setting_takes_a_policy_and_its_older_true_and_false():
  assert ModelConfig(remat=True).remat == "full" and ModelConfig(remat=False).remat == "none"
  assert ModelConfig(remat="save_qkv_proj").remat == "save_qkv_proj"
  with pytest.raises(ConfigError, match="remat must be one of none, minimal_with_inputs, minimal, save_dot_except"):
    ModelConfig(remat="everything")
  assert ExperimentConfig(name="x").model.remat == "full"
  assert remat.policy_name(True) == "full"
