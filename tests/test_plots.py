"""`make plot`: PNGs of a run's metrics.jsonl, written by the MetricsWriter; the shared plotting core."""

import numpy as np
import pytest

from vapo_jax.cli import plots
from vapo_jax.train import metrics

pytest.importorskip("matplotlib", reason="matplotlib is in the test and plot extras")

PNG = b"\x89PNG\r\n\x1a\n"


def _write_run(run_dir, rl_steps=12, vp_steps=4, eval_every=4, seed=0):
  """A run's records as the trainer writes them: SFT, value pretraining, evaluations, RL steps."""
  rng = np.random.default_rng(seed)
  writer = metrics.MetricsWriter(str(run_dir))
  g = 0
  for step in range(3):
    writer.write(step, "sft", {"sft/nll": 2.0 / (step + 1), "sft/grad_norm": 1.0}, global_step=g)
    g += 1
  for step in range(vp_steps):
    writer.write(step, "value_pretrain", {"critic/value_loss": 1.0 / (step + 1),
                                          "critic/explained_variance": step / vp_steps} | _bias(step), global_step=g)
    g += 1
  writer.write(0, "eval_before_rl", {"eval/accuracy": 0.1, "eval/response_len_mean": 40.0}, global_step=g)
  for step in range(rl_steps):
    t = step / rl_steps
    m = {"rollout/reward_mean": 2 * t - 1 + 0.1 * rng.standard_normal(), "rollout/accuracy": t,
         "rollout/response_len_mean": 30 + 10 * t, "rollout/response_len_max": 64.0, "rollout/truncated_frac": 0.1,
         "actor/entropy": 1.5 - t, "actor/entropy_term": 1.5 - t, "critic/explained_variance": 0.5 + 0.4 * t,
         "actor/clip_frac_low": 0.01, "actor/clip_frac_high": 0.02 + 0.01 * t, "critic/clip_frac": 0.0,
         "adv/lam_actor_mean": 0.95, "adv/lam_actor_min": 0.93, "adv/lam_actor_max": 0.98,
         "actor/approx_kl": 1e-3 * (1 + t), "rollout/logprob_gap": 2e-3, "actor/pg_loss": -0.01,
         "critic/value_loss": 0.2 * (1 - t), "actor/nll_loss": 0.5, "time/step_s": 1.0, "time/update_s": 0.5,
         "reward/no_answer_frac": 0.5 * (1 - t), "reward/error_frac": 0.0,
         "actor/ref_kl": float("nan"), "adv/early_mean": 0.3 * (1 - t), "adv/early_mean_unwhitened": 0.1 * (1 - t)}
    m |= _bias(vp_steps + step)
    if (step + 1) % eval_every == 0 and step + 1 < rl_steps:
      m |= {"eval/accuracy": 0.1 + 0.5 * (step + 1) / rl_steps, "eval/response_len_mean": 40.0}
    writer.write(step, "rl", m, global_step=g)
    g += 1
  writer.write(rl_steps, "eval_after_rl", {"eval/accuracy": 0.6, "eval/response_len_mean": 45.0}, global_step=g)
  writer.close()


def _bias(step):
  """Value bias by decile, shrinking with the step."""
  return {f"critic/value_bias_decile_{k}": (k - 4.5) / 10 / (1 + step) for k in range(10)}


def test_make_plot_writes_each_figure_of_a_run(tmp_path, capsys):
  run_dir = tmp_path / "runs" / "tiny_vapo"
  _write_run(run_dir)
  assert plots.main([str(run_dir)]) == 0
  written = capsys.readouterr().out.split()
  names = sorted(p.rsplit("/", 1)[1] for p in written)
  assert names == sorted([f"{figure[0]}.png" for figure in plots.FIGURES] + ["sft.png"])
  for path in written:
    data = open(path, "rb").read()
    assert data.startswith(PNG) and len(data) > 10_000, path
    assert path.startswith(str(run_dir / "plots"))
  assert plots.main([str(tmp_path / "nowhere")]) == 2


def test_run_curves_place_each_stage_on_the_rl_step_axis(tmp_path):
  _write_run(tmp_path, rl_steps=12, vp_steps=4, eval_every=4)
  (tmp_path / "metrics.jsonl").open("a").write("garbage\n")
  with pytest.warns(UserWarning, match="skipped 1 line that is not a metric record"):
    curves = plots.run_curves(plots.read_metrics(str(tmp_path / "metrics.jsonl")))
  x, y = curves["eval/accuracy"]  # Before RL, after steps 3 and 7 (4 and 8 updates), after RL.
  np.testing.assert_array_equal(x, [0, 4, 8, 12])
  np.testing.assert_allclose(y, [0.1, 0.1 + 0.5 * 4 / 12, 0.1 + 0.5 * 8 / 12, 0.6])
  x, y = curves["critic/explained_variance"]  # Value pretraining at −4..−1, then RL steps 0..11.
  np.testing.assert_array_equal(x, np.arange(-4, 12))
  np.testing.assert_allclose(y[:4], [0, 0.25, 0.5, 0.75])
  assert "actor/ref_kl" not in curves and "sft/nll" not in curves  # NaN only; SFT has its own axis.


def test_aggregate_over_seeds_and_the_band(tmp_path):
  runs = [(np.array([0.0, 1, 2, 3]), np.array([0.0, 1, 2, 3])),
          (np.array([0.0, 2, 4]), np.array([1.0, 1, 1]))]  # Covers 0..4 at even steps only.
  x, mean, lo, hi = plots.aggregate(runs)
  np.testing.assert_array_equal(x, [0, 1, 2, 3])  # The range both cover, on the union of their x.
  np.testing.assert_allclose(mean, [0.5, 1.0, 1.5, 2.0])
  np.testing.assert_allclose(lo, [0, 1, 1, 1])
  np.testing.assert_allclose(hi, [1, 1, 2, 3])
  seeds = []
  for seed in range(3):
    _write_run(tmp_path / f"s{seed}", seed=seed)
    seeds.append(plots.run_curves(plots.read_metrics(str(tmp_path / f"s{seed}" / "metrics.jsonl"))))
  path = plots.plot_curves({"vapo": [s["rollout/reward_mean"] for s in seeds],
                            "vapo accuracy": [s["rollout/accuracy"] for s in seeds]},
                           title="Training reward", ylabel="reward", path=str(tmp_path / "sweep" / "reward.png"))
  assert open(path, "rb").read().startswith(PNG)


def test_panels_of_one_member(tmp_path):
  """The sweep's per-member mechanism figure: several panels, one with ten ordered lines."""
  seeds = []
  for seed in range(2):
    _write_run(tmp_path / f"s{seed}", seed=seed)
    seeds.append(plots.run_curves(plots.read_metrics(str(tmp_path / f"s{seed}" / "metrics.jsonl"))))
  deciles = {f"decile {k + 1}": [s[f"critic/value_bias_decile_{k}"] for s in seeds] for k in range(10)}
  panels = [("Held-out accuracy", "avg@k", {"held-out": [s["eval/accuracy"] for s in seeds]}),
            ("Value bias", "V − G", deciles),
            ("Clipped", "fraction", {"high": [s["actor/clip_frac_high"] for s in seeds]}), ("Empty", "nothing", {})]
  path = plots.plot_panels(panels, title="member", path=str(tmp_path / "panels" / "m.png"))
  data = open(path, "rb").read()
  assert data.startswith(PNG) and len(data) > 20_000
