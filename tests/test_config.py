"""Config validation, overrides, the experiment registry and the `make train` entry point."""

import argparse
import dataclasses
import pathlib
import sys

import numpy as np
import pytest

import experiments
from experiments import aime
from vapo_jax.cli import resolve
from vapo_jax.cli import train as train_cli
from vapo_jax.config import (
  AlgoConfig,
  EvalConfig,
  ExperimentConfig,
  MeshConfig,
  OptimizerConfig,
  PackingConfig,
  RewardConfig,
  RolloutConfig,
  overrides,
)
from vapo_jax.errors import ConfigError


@pytest.mark.parametrize("factory,field,value,message", [
    (AlgoConfig, "eps_low", 1.5, r"AlgoConfig.eps_low must be in \[0.0, 1.0\)"),
    (AlgoConfig, "gamma", -0.1, r"AlgoConfig.gamma must be in \[0.0, 1.0\]"),
    (AlgoConfig, "lam_critic", 1.2, r"AlgoConfig.lam_critic must be in"),
    (AlgoConfig, "length_adaptive_alpha", 0.0, r"AlgoConfig.length_adaptive_alpha must be > 0"),
    (AlgoConfig, "dual_clip", 0.5, r"AlgoConfig.dual_clip must be > 1"),
    (AlgoConfig, "ppo_epochs", 0, r"AlgoConfig.ppo_epochs must be an integer in \[1, 2147483647\]"),
    (AlgoConfig, "value_pretrain_steps", -1, r"value_pretrain_steps must be an integer in \[0, 2147483647\]"),
    (RolloutConfig, "decode_budget", 2**31, r"RolloutConfig.decode_budget must be an integer in \[0, 2147483647\]"),
    (AlgoConfig, "micro_batch_responses", 7, r"AlgoConfig.micro_batch_responses must divide"),
    (AlgoConfig, "value_pretrain_target", "tokens",
     r"AlgoConfig.value_pretrain_target must be one of returns, outcome"),
    (OptimizerConfig, "actor_lr", 0.0, r"OptimizerConfig.actor_lr must be in \(0.0, 1.0\]"),
    (RolloutConfig, "top_p", 0.0, r"RolloutConfig.top_p must be in \(0.0, 1.0\]"),
    (RolloutConfig, "samples_per_prompt", 0, r"RolloutConfig.samples_per_prompt must be an integer"),
    (RewardConfig, "correct", -2.0, r"RewardConfig.correct must exceed incorrect"),
    (EvalConfig, "samples_per_problem", 0, r"EvalConfig.samples_per_problem"),
    (MeshConfig, "tensor", 0, r"MeshConfig.tensor must be a positive integer or -1"),
    (PackingConfig, "row_tokens", 0, r"PackingConfig.row_tokens must be an integer in \[1, 2147483647\]"),
    (PackingConfig, "micro_batch_rows", 0, r"micro_batch_rows must be an integer in \[1, 2147483647\]"),
])
def test_bad_values_fail_at_construction(factory, field, value, message):
  with pytest.raises(ConfigError, match=message):
    factory(**{field: value})


def test_configs_are_frozen_and_keyword_only():
  with pytest.raises(dataclasses.FrozenInstanceError):
    AlgoConfig().eps_low = 0.1  # type: ignore[misc]
  with pytest.raises(TypeError):
    AlgoConfig(0.2)  # type: ignore[misc]


def test_cross_field_checks():
  with pytest.raises(ConfigError, match="value_pretrain_steps must be 0 with estimator='group'"):
    AlgoConfig(estimator="group")
  with pytest.raises(ConfigError, match="algo.mini_batch_responses must divide the responses per step"):
    ExperimentConfig(name="x", rollout=RolloutConfig(prompts_per_step=3, samples_per_prompt=5))
  with pytest.raises(ConfigError, match=r"packing.row_tokens must hold the longest sequence, "
                                        r"rollout.max_prompt_tokens \+ rollout.max_response_tokens = 22528, got 22527"):
    ExperimentConfig(name="x", packing=PackingConfig(row_tokens=22527))
  with pytest.raises(ConfigError, match="rollout.samples_per_prompt must be > 1"):
    ExperimentConfig(name="x", algo=AlgoConfig(estimator="group", value_pretrain_steps=0),
                     rollout=RolloutConfig(prompts_per_step=512, samples_per_prompt=1))


def test_paper_setting():
  config = aime.vapo()
  a = config.algo
  assert (a.eps_low, a.eps_high, a.positive_nll_coef, a.length_adaptive_alpha) == (0.2, 0.28, 0.1, 0.05)
  assert (a.lam_critic, a.gamma, a.value_pretrain_steps, a.loss_agg, a.kl_coef) == (1.0, 1.0, 50, "token-mean", 0.0)
  assert (config.optim.actor_lr, config.optim.critic_lr) == (1e-6, 2e-6)
  assert config.rollout.responses_per_step == 8192 and config.updates_per_step == 16
  assert (config.eval.samples_per_problem, config.eval.top_p, config.eval.temperature) == (32, 0.7, 1.0)
  assert config.rollout.max_response_tokens == 20480


def test_each_ablation_changes_exactly_one_technique():
  base = dataclasses.asdict(aime.vapo())
  flat = lambda d, p="": {k2: v2 for k, v in d.items() for k2, v2 in (
      flat(v, f"{p}{k}.").items() if isinstance(v, dict) else [(p + k, v)])}
  base_flat = flat(base)
  expected = {
      "no_value_pretraining": {"algo.value_pretrain_steps"},
      "no_decoupled_gae": {"algo.decoupled_gae"},
      "no_length_adaptive_gae": {"algo.length_adaptive_alpha"},
      "no_clip_higher": {"algo.eps_high"},
      "no_token_level_loss": {"algo.loss_agg"},
      "no_positive_nll": {"algo.positive_nll_coef"},
      # With the generation rounds rescaled to as many sequences (a memory layout, not a technique).
      "no_group_sampling": {"rollout.prompts_per_step", "rollout.samples_per_prompt", "rollout.prompts_per_generation"},
  }
  sweep = aime.ablations()
  assert len(sweep) == 7
  for key, fields in expected.items():
    config = sweep[f"aime_vapo_{key}"]
    changed = {k for k, v in flat(dataclasses.asdict(config)).items() if v != base_flat[k]} - {"name"}
    assert changed == fields, key
    assert config.rollout.responses_per_step == 8192


def test_baselines():
  ppo, grpo, dapo = aime.ppo(), aime.grpo(), aime.dapo()
  assert (ppo.algo.lam_actor, ppo.algo.lam_critic, ppo.algo.length_adaptive_alpha) == (0.95, 0.95, None)
  assert (ppo.algo.eps_high, ppo.algo.loss_agg, ppo.algo.value_pretrain_steps) == (0.2, "seq-mean-token-mean", 0)
  assert (ppo.rollout.prompts_per_step, ppo.rollout.samples_per_prompt) == (8192, 1)
  assert grpo.algo.estimator == "group" and not grpo.algo.uses_critic
  assert dapo.algo.dynamic_sampling and dapo.algo.overlong_buffer_tokens == 4096
  assert (dapo.algo.eps_high, dapo.algo.loss_agg) == (0.28, "token-mean")


def test_reward_models_and_the_toy_knobs():
  """The reward-model experiments fit the critic on the outcome alone, with no RL; the toy's knobs are
  the paper's where the issue asked (critic lr 2× the actor's, 16 updates a step, α = 0.05 beside)."""
  for rm in (experiments.get_experiment("aime_reward_model"), experiments.get_experiment("toy_reward_model")):
    assert (rm.algo.value_pretrain_target, rm.rl_steps, rm.eval.path, rm.checkpoint.export_final) == (
        "outcome", 0, None, False)
    assert rm.algo.value_pretrain_steps > 0 and rm.model.critic_checkpoint is None
  toy = experiments.get_experiment("toy")
  assert toy.optim.critic_lr == 2 * toy.optim.actor_lr and toy.updates_per_step == 16
  assert "count=256" in toy.eval.path and toy.rl_steps // toy.eval.every_steps == 4  # 5 points with before RL.
  mechanism = experiments.SWEEPS["toy_mechanism"]()
  assert list(mechanism) == ["toy_vapo", "toy_vapo_paper_alpha", "toy_ppo", "toy_vapo_no_value_pretraining"]
  assert [c.algo.length_adaptive_alpha for c in mechanism.values()] == [1.0, 0.05, None, 1.0]
  assert mechanism["toy_vapo_no_value_pretraining"].algo.value_pretrain_steps == 0


def test_registry():
  for name in list(experiments.EXPERIMENTS) + ["aime_vapo_no_clip_higher", "aime_grpo"]:
    assert isinstance(experiments.get_experiment(name), ExperimentConfig)
  with pytest.raises(ConfigError, match="unknown experiment 'nope'"):
    experiments.get_experiment("nope")


def test_overrides():
  config = overrides.apply_overrides(aime.vapo(), [
      "algo.eps_high=0.3", "--algo.dual-clip=3", "algo.length_adaptive_alpha=none",
      "model.checkpoint=/ckpt", "algo.decoupled_gae=false", "rollout.top_k=20"])
  assert config.algo.eps_high == 0.3 and config.algo.dual_clip == 3.0
  assert config.algo.length_adaptive_alpha is None and not config.algo.decoupled_gae
  assert config.model.checkpoint == "/ckpt" and config.rollout.top_k == 20
  assert len(overrides.field_paths(config)) > 50


@pytest.mark.parametrize("item,message", [
    ("algo.eps_hi=0.3", r"unknown config field 'algo.eps_hi' \(did you mean algo.eps_high"),
    ("nonsense=1", r"unknown config field 'nonsense'"),
    ("algo.eps_low=2", r"AlgoConfig.eps_low must be in"),
    ("algo.ppo_epochs=1.5", r"algo.ppo_epochs must be int"),
    ("mesh.preset=zz", r"mesh.preset must be one of"),
    ("algo.decoupled_gae=maybe", r"algo.decoupled_gae must be true or false"),
    ("algo.eps_low", r"not of the form field.path=value"),
])
def test_bad_overrides(item, message):
  with pytest.raises(ConfigError, match=message):
    overrides.apply_overrides(aime.vapo(), [item])


def test_main_without_a_model_fails_at_once(capsys):
  assert train_cli.main(["--exp", "aime"]) == 2
  err = capsys.readouterr().err
  assert "needs a model: pass model.checkpoint=/path/to/qwen2.5-32b" in err and "make train" in err


def test_main_rejects_unknown_field(capsys):
  assert train_cli.main(["--exp", "tiny", "algo.nope=1"]) == 2
  assert "unknown config field 'algo.nope'" in capsys.readouterr().err


def test_main_help_lists_fields(capsys):
  assert train_cli.main(["--exp", "aime", "--help"]) == 0
  assert "algo.eps_high = 0.28" in capsys.readouterr().out


def test_overrides_that_must_change_together_validate_together():
  config = overrides.apply_overrides(aime.vapo(), ["algo.estimator=group", "algo.value_pretrain_steps=0"])
  assert config.algo.estimator == "group" and config.algo.value_pretrain_steps == 0
  with pytest.raises(ConfigError, match="value_pretrain_steps must be 0 with estimator='group'"):
    overrides.apply_overrides(aime.vapo(), ["algo.estimator=group"])


def test_an_empty_experiment_name_is_an_error_not_the_default():
  for argv in (["--exp="], ["--exp"]):
    with pytest.raises(ConfigError, match="--exp needs an experiment name"):
      resolve.resolve(argv)


def test_every_mistake_of_an_override_list_is_reported_together():
  """One run names every mistake, not the first alone."""
  config = experiments.get_experiment("tiny")
  with pytest.raises(ConfigError) as error:
    overrides.apply_overrides(config, ["algo.eps_high=abc", "rollout.top_p=2", "no.such=1", "algo.ppo_epochs=0",
                                       "mesh.preset=zz", "bad"])
  message = str(error.value)
  assert message.startswith("6 config errors: (1) ") and "\n" not in message
  for part in ("algo.eps_high must be float, got 'abc'", "RolloutConfig.top_p must be in (0.0, 1.0], got 2.0",
               "unknown config field 'no.such'", "AlgoConfig.ppo_epochs must be an integer in [1, 2147483647], got 0",
               "mesh.preset must be one of", "override 'bad' is not of the form field.path=value"):
    assert part in message, part
  with pytest.raises(ConfigError, match=r"^AlgoConfig.value_pretrain_steps must be 0 with estimator='group'"):
    overrides.apply_overrides(config, ["algo.estimator=group"])  # A check across fields of one dataclass.


def test_entry_points_choose_the_cpu_where_no_accelerator_device_exists(tmp_path):
  """A CPU-only machine never starts libtpu, whose probe of a TPU VM prints errors (train, eval, memory)."""
  from vapo_jax import cli
  environ = {}
  cli.cpu_only_platform(environ, files=(str(tmp_path / "accel*"),))
  assert environ == {"JAX_PLATFORMS": "cpu"}
  (tmp_path / "accel0").write_text("")  # A TPU VM's chip: JAX chooses.
  environ = {}
  cli.cpu_only_platform(environ, files=(str(tmp_path / "accel*"),))
  assert environ == {}
  environ = {"JAX_PLATFORMS": "cuda"}  # Set by the user: kept.
  cli.cpu_only_platform(environ, files=())
  assert environ == {"JAX_PLATFORMS": "cuda"}


ENTRY_POINTS = ("train", "evaluate", "sweep", "plots", "memory")


def _run_entry_point(tool: str, *argv: str):
  """`python -m vapo_jax.cli.<tool> argv...` in a process that fails (exit 3) if it imports JAX."""
  import subprocess
  import sys
  code = (f"import runpy, sys\nsys.argv = ['tool', *{list(argv)!r}]\ncode = 0\ntry:\n"
          f"  runpy.run_module('vapo_jax.cli.{tool}', run_name='__main__')\nexcept SystemExit as e:\n"
          "  code = e.code or 0\nif 'jax' in sys.modules:\n  sys.exit(3)\nsys.exit(code)")
  return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                        cwd=pathlib.Path(__file__).resolve().parents[1])


def test_every_entry_points_help_is_its_usage_without_jax():
  """`python -m vapo_jax.cli.<tool> --help`: the usage and exit 0, in a process that never imports JAX."""
  for tool in ENTRY_POINTS:
    result = _run_entry_point(tool, "--help")
    assert result.returncode == 0, (tool, result.stderr[-2000:])
    assert "usage" in result.stdout.lower() or "python -m vapo_jax.cli" in result.stdout, (tool, result.stdout[:300])


def test_every_entry_points_bad_argument_is_one_line_and_exit_2_without_jax():
  """`python -m vapo_jax.cli.<tool> [its positional arguments] --no-such-option`: one line on stderr
  naming it, exit 2, no JAX."""
  positional = {"sweep": ("toy",), "plots": ("runs/tiny_vapo",)}
  for tool in ENTRY_POINTS:
    result = _run_entry_point(tool, *positional.get(tool, ()), "--no-such-option")
    assert result.returncode == 2, (tool, result.returncode, result.stderr[-2000:])
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "no-such-option" in lines[0], (tool, lines)


def test_a_finished_runs_closing_lines_round_the_accuracies_and_name_the_plot_command():
  from vapo_jax.cli.train import closing_lines
  lines = closing_lines({"seconds": 212.4, "accuracy_before_rl": 0.21370967741935484,
                         "accuracy_after_rl": 0.38306451612903225}, "runs/tiny_vapo")
  assert lines[0] == "done in 212s. held-out accuracy: before RL 0.214, after RL 0.383"
  assert lines[1].startswith("run directory: runs/tiny_vapo (")
  assert lines[2] == "curves: make plot RUN=runs/tiny_vapo (PNGs in runs/tiny_vapo/plots/)"  # Without matplotlib.
  drawn = closing_lines({"seconds": 1.0, "accuracy_before_rl": 0.2, "accuracy_after_rl": 0.3}, "r",
                        "r/plots/reward_accuracy.png")
  assert drawn[2] == ("curves: r/plots/reward_accuracy.png (held-out accuracy and mean reward by step; make plot RUN=r "
                      "draws the others)")
  none = closing_lines({"seconds": 1.0, "accuracy_before_rl": None, "accuracy_after_rl": None}, "r")
  assert none[0] == "done in 1s. no held-out evaluation (eval.path is unset)"
  errors = closing_lines({"seconds": 212.4, "accuracy_before_rl": 0.31, "accuracy_after_rl": 0.52,
                          "stderr_before_rl": 0.012, "stderr_after_rl": 0.016, "eval_problems": 256.0,
                          "eval_samples_per_problem": 4}, "r")
  assert errors[0] == ("done in 212s. held-out accuracy: before RL 0.310, after RL 0.520 (+0.210 ± 0.020, "
                       "256 problems × 4)")


def test_avg_at_k_standard_error_is_the_problems_spread_over_their_root():
  from vapo_jax.train.held_out import accuracy_stderr
  verdicts = np.array([1, 1, 0, 0, 1, 1, 1, 1, 0, 0, 0, 1], bool)  # 3 problems × 4: 0.5, 1.0, 0.25.
  means = [sum(verdicts[i * 4:(i + 1) * 4]) / 4 for i in range(3)]
  mean = sum(means) / 3
  spread = (sum((m - mean) ** 2 for m in means) / 2) ** 0.5  # The sample standard deviation, from its definition.
  assert accuracy_stderr(verdicts, 4) == pytest.approx(spread / 3 ** 0.5, rel=1e-12)
  assert accuracy_stderr(np.ones(4, bool), 4) == 0.0  # One problem: no spread to measure.


def test_the_packages_warnings_are_one_line_and_a_librarys_keep_pythons_form(capsys):
  import warnings

  from vapo_jax.cli import one_line_warnings
  from vapo_jax.data import problems
  with warnings.catch_warnings():
    warnings.showwarning = lambda message, category, filename, lineno, *_: print(  # Python's, as pytest leaves it.
        f"{filename}:{lineno}: {category.__name__}: {message}", file=sys.stderr)
    with one_line_warnings():
      warnings.simplefilter("always")
      warnings.warn_explicit("a setting to look at", UserWarning, problems.__file__, 7)
      warnings.warn_explicit("library noise", UserWarning, argparse.__file__, 9)
  err = capsys.readouterr().err.splitlines()
  assert err == ["warning: a setting to look at", f"{argparse.__file__}:9: UserWarning: library noise"]


def test_a_refused_section_is_not_followed_by_a_knock_on_error_about_its_defaults():
  """rollout refused: the whole config's cross-field checks are not run against the rollout defaults left in its
  place (they would blame algo.mini_batch_responses=24 against the default 16 × 8 responses)."""
  with pytest.raises(ConfigError) as refused:
    resolve.resolve(["--exp", "tiny", "rollout.samples_per_prompt=-1", "algo.mini_batch_responses=24"])
  assert str(refused.value) == "RolloutConfig.samples_per_prompt must be an integer in [1, 2147483647], got -1"


def test_a_cross_field_refusal_reports_the_users_values_and_the_sections_own_error():
  """A section refused as a whole reports its own error about the values given, not a re-check of each field
  against the experiment's defaults (which blamed the budget against the default cap of 64)."""
  with pytest.raises(ConfigError) as refused:
    resolve.resolve(["--exp", "tiny", "rollout.decode_budget=24", "rollout.max_staleness=0", "rollout.engine=static",
                     "rollout.max_response_tokens=24"])
  assert str(refused.value) == ("RolloutConfig.engine must be 'refill' with decode_budget > 0 (the static engine "
                                "cannot stop at a budget), got 'static'")
