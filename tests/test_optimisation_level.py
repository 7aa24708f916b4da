"""`make test` compiles at XLA's backend optimisation level 0 (LLVM unoptimised: a third less compile
time) with the CPU's fusion emitters off (its older loop emitters: about 40 % less compile time again);
`make test-slow`, `make bench` and runs compile at the defaults (level 3, fusion emitters on). The two
settings differ only in floating-point rounding (LLVM reorders and fuses arithmetic at 3; the emitters
vectorise reductions differently), which this test bounds on one actor update of the micro model:
every updated parameter and every metric agrees within 1e-5, the tolerance of the suite's
packed-vs-padded and micro-batch comparisons. A difference beyond it means the suite's settings hide a
bug that the defaults would show, or the reverse."""

import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from vapo_jax.config import AlgoConfig, OptimizerConfig
from vapo_jax.models.config import preset
from vapo_jax.models.transformer import CausalLM
from vapo_jax.train import optim, updates

B, TP, TR = 4, 6, 10
TOLERANCE = dict(rtol=1e-5, atol=1e-5)
MAKE_TEST = {"xla_backend_optimization_level": 0, "xla_cpu_use_fusion_emitters": False}  # The Makefile's XLA_FLAGS.
DEFAULT = {"xla_backend_optimization_level": 3, "xla_cpu_use_fusion_emitters": True}


def _batch():
  rng = np.random.default_rng(0)
  lengths = np.array([10, 3, 7, 1])
  response_mask = np.arange(TR)[None] < lengths[:, None]
  mask = np.concatenate([np.ones((B, TP), bool), response_mask], axis=1)
  tokens = rng.integers(3, 259, (B, TP + TR)) * mask
  f32 = lambda x: jnp.asarray(x * response_mask, jnp.float32)
  old_logprobs = f32(-rng.exponential(size=(B, TR)))
  return updates.TrainBatch(jnp.asarray(tokens, jnp.int32), jnp.asarray(mask), jnp.asarray(response_mask),
                            f32(rng.normal(size=(B, TR))), None, jnp.asarray([True, False, True, False]),
                            old_logprobs, f32(rng.normal(size=(B, TR))))


def test_make_test_sets_the_flags_this_test_compares():
  recipe = re.search(r"^test:.*\n\t(.*)$", (pathlib.Path(__file__).parents[1] / "Makefile").read_text(), re.M)[1]
  flags = dict(re.findall(r"--(xla_\w+)=(\w+)", recipe))
  assert flags == {k: str(v).lower() for k, v in MAKE_TEST.items()}, flags


@pytest.mark.slow  # For time (14 s): an update compiled twice, under make test's XLA flags and the defaults.
def test_an_actor_update_agrees_under_make_tests_compiler_settings_and_the_defaults():
  graphdef, params = nnx.split(CausalLM(preset("micro"), rngs=nnx.Rngs(0)))
  tx = optim.make_optimizer(OptimizerConfig(), 1e-2)  # A large step, so the update is far from the parameters.
  update = jax.jit(lambda p, o, b: updates.actor_update(graphdef, tx, p, o, b, algo=AlgoConfig(), micro=2, chunk=4))
  lowered = update.lower(params, tx.init(params), _batch())
  runs = [jax.device_get(lowered.compile(options)(params, tx.init(params), _batch()))
          for options in (MAKE_TEST, DEFAULT)]
  (fast_params, _, fast_metrics), (want_params, _, want_metrics) = runs
  assert fast_metrics.keys() == want_metrics.keys() and "actor/pg_loss" in want_metrics
  for key in want_metrics:
    np.testing.assert_allclose(fast_metrics[key], want_metrics[key], **TOLERANCE, err_msg=key)
  for (path, got), (_, want) in zip(nnx.to_flat_state(fast_params), nnx.to_flat_state(want_params)):
    np.testing.assert_allclose(got.get_value(), want.get_value(), **TOLERANCE, err_msg=str(path))
  moved = [np.abs(w.get_value() - p.get_value()).max() for (_, w), (_, p) in zip(nnx.to_flat_state(want_params),
                                                                                   nnx.to_flat_state(params))]
  assert min(moved) > 1e-4  # Every parameter took a step the comparison can see.
