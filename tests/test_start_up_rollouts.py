"""Every rollout of a run is checked at start-up: the training rollout and each call of the held-out evaluation
(its own problems per call and samples per problem), with the slots as the engine places them over the data-parallel
groups; an impossible setting is one line naming the setting and a value that works. The warm start is saved before
the first evaluation, so nothing after it can lose it."""

import os

import pytest

from vapo_jax.errors import ConfigError
from vapo_jax.models.config import preset
from vapo_jax.train import checkpoints, experience, held_out, responses
from vapo_jax.train.trainer import Trainer


def test_the_evaluations_pool_is_sized_for_its_own_prompts(smoke_config):
  """A queue's pool must hold its call's longest prompt and one whole response (the prompts take their pages as
  their samples are about to run). The smoke run: 3 pages a group hold a 16-token prompt (1 page) and a response
  (2 pages), not a call of 32-token prompts (2 pages + 2)."""
  config = smoke_config({"rollout.pages": 3})
  assert held_out.evaluation_calls(config, 40) == [16, 16, 8]
  assert responses.plan(config, preset("micro"), prompts=8, samples_per_prompt=4, prompt_tokens=16,
                        devices=8).engine == "refill"
  assert responses.plan(config, preset("micro"), prompts=16, samples_per_prompt=2, prompt_tokens=16,
                        devices=8).queue_pages == 3
  with pytest.raises(ConfigError, match=r"cannot hold its longest prompt \(2 pages\).*\(4 pages in all\): "
                                        r"set rollout\.pages=4 or more"):
    responses.plan(config, preset("micro"), prompts=16, samples_per_prompt=2, prompt_tokens=32, devices=8)
  responses.plan(smoke_config({"rollout.pages": 4}), preset("micro"), prompts=16, samples_per_prompt=2,
                 prompt_tokens=32,
                  devices=8)
  with pytest.raises(ConfigError,
                     match=r"raise rollout\.kv_cache_budget_gib"):  # No pages given: the budget's.
    responses.plan(smoke_config({"rollout.kv_cache_budget_gib": 4e-6}), preset("micro"), prompts=16,
                   samples_per_prompt=2,
                    prompt_tokens=16, devices=8)


def _refused_then_planned(smoke_config, field: str, refused, works, match: str, **call):
  """`field=refused` is refused (`match`) when planning `call`; the value the message names, `works`, plans it."""
  with pytest.raises(ConfigError, match=match):
    responses.plan(smoke_config({field: refused}), preset("micro"), **call)
  return responses.plan(smoke_config({field: works}), preset("micro"), **call)


def test_a_pool_split_over_queues_names_the_pages_of_every_queue(smoke_config):
  """With fewer queues than groups every device holds each queue's pool: `rollout.pages` is split over them, so
  the value named is the pages of all of them. 2 queues (2 prompts over 8 groups) of 3 // 2 = 1 page each."""
  chosen = _refused_then_planned(
      smoke_config, "rollout.pages", 3, 6, r"pool of 1 page of 16 tokens per queue \(2 queues' pools on each "
      r"device\) cannot hold .*\(3 pages in all\): set rollout\.pages=6 or more", prompts=2,
      samples_per_prompt=16, prompt_tokens=16, devices=8)
  assert chosen.queue_pages == 3


def test_slots_that_do_not_split_over_the_groups_are_refused_with_the_value_that_works(smoke_config):
  chosen = _refused_then_planned(
      smoke_config, "rollout.slots", 3, 4, r"^rollout\.slots=3 does not split over the 2 data-parallel "
      r"groups .*: set rollout\.slots=4, a multiple of 2$", prompts=8, samples_per_prompt=4, prompt_tokens=16,
      devices=2)
  assert chosen.slots == 4


def test_the_trainer_refuses_an_evaluation_that_cannot_run_before_the_first_step(smoke_config):
  """32 held-out problems: calls of 16 problems × 2 samples in 2 queues (so 3 pages a group are 1 a queue); 3 pages
  hold the training rollout's."""
  problems = "synthetic:arithmetic?terms=2-3&count=32&seed=1"
  with pytest.raises(ConfigError, match=r"\(2 queues' pools on each device\) .*set rollout\.pages=6 or more"):
    Trainer(smoke_config({"rollout.pages": 3, "eval.path": problems}), verbose=False)


@pytest.mark.slow  # For time (10 s): make test saves after each stage and resumes from it (aime's rehearsal).
def test_the_warm_start_is_saved_before_the_first_evaluation(smoke_config, monkeypatch):
  config = smoke_config({"algo.value_pretrain_steps": 0, "rl_steps": 0})
  trainer = Trainer(config, verbose=False)
  monkeypatch.setattr(trainer, "evaluate", lambda *a: (_ for _ in ()).throw(RuntimeError("the evaluation "
                                                                                         "failed")))
  with pytest.raises(RuntimeError, match="the evaluation failed"):
    trainer.run()
  found = checkpoints.RunCheckpoints(os.path.join(config.run_directory, "checkpoints"), config.checkpoint)
  step, meta = found.latest_meta()
  found.close()
  assert meta["progress"]["stage"] == "value_pretrain" and meta["progress"]["eval_before"] is None, meta["progress"]


def test_a_partial_round_that_cannot_fit_is_refused_naming_the_budget(smoke_config):
  """8 prompts × 4 a step over 8 groups: a group's 3 pages hold its training rollout (1 prompt page + 2 for a
  response), not a partial round's sequence of a prompt and up to 15 carried tokens (2 pages + 2)."""
  import types
  config = smoke_config({"rollout.decode_budget": 8, "rollout.max_staleness": 1, "rollout.pages": 3})
  responses.plan(config, preset("micro"), prompts=8, samples_per_prompt=4, prompt_tokens=16, devices=8)
  run = types.SimpleNamespace(config=config, model_cfg=preset("micro"),
                              layout=types.SimpleNamespace(data_devices=8))
  with pytest.raises(ConfigError, match=r"^a partial rollout's round \(rollout\.decode_budget=8\) cannot "
                                        r"run: .*its longest prompt \(2 pages\).*set rollout\.pages=4 or "
                                        r"more.*; or set rollout\.decode_budget=0$"):
    experience.Experience.plan_round(run)
  config = smoke_config({"rollout.decode_budget": 8, "rollout.max_staleness": 1, "rollout.pages": 4})
  assert experience.Experience.plan_round(types.SimpleNamespace(**vars(run) | {"config": config})).queue_pages == 4


def test_the_start_up_check_runs_each_engine_and_says_a_layout_mistake_in_one_line(smoke_config, monkeypatch):
  """With tensor-parallel rollout groups, each engine of the run samples one token at start-up through the rollout
  layout's placement; a placement that leaves the training mesh's key where it is (the mistake that crashed `aime`'s
  first rollout) is refused there in one line."""
  from vapo_jax.models import sharding
  from vapo_jax.rollout.layout import RolloutLayout
  from vapo_jax.train import start_up

  config = smoke_config({"rollout.tensor_parallel": 2, "rollout.slots": 8, "rollout.pages": 6,
                         "eval.path": None})
  ran = []
  monkeypatch.setattr(start_up, "_run_one", lambda *a, _run=start_up._run_one: ran.append(a[-1]) or _run(*a))
  Trainer(config, verbose=False, write_logs=False).close()
  assert ran == ["refill"]

  def training_mesh_keys(self,
                         tree):  # Host arrays placed; device arrays (the key) left on the training mesh.
    import jax
    return jax.tree.map(lambda x: x if isinstance(x, jax.Array) else sharding.place(x, self.mesh, self.rules),
                        tree)
  monkeypatch.setattr(RolloutLayout, "place", training_mesh_keys)
  with pytest.raises(ConfigError, match=r"^start-up check: the refill rollout failed on one prompt in the "
                                        r"rollout layout \(rollout\.tensor_parallel=2\): .*Mesh.*[^\n]$"):
    Trainer(config, verbose=False, write_logs=False)
