"""The held-out evaluation: avg@k on problems the run never trains on, sampled with keys of its own, and its
statistics from the verdicts (problem by problem, `k` samples each).

  metrics = evaluate(experience, state, records, rl_steps_done=n)   # {"eval/accuracy": ..., ...}
  accuracy_stderr(verdicts, k)              # avg@k's standard error over the problems
  accuracy_by_level(verdicts, levels, k)    # {level: avg@k of that level's problems}
"""

import jax
import numpy as np

from vapo_jax import distributed
from vapo_jax.config import ExperimentConfig
from vapo_jax.data.records import Record
from vapo_jax.train.state import TrainState


def accuracy_by_level(verdicts: np.ndarray, levels: list[int | None], k: int) -> dict[int, float]:
  """avg@k over the problems of each level (`levels`, problem by problem; `verdicts`, `k` a problem in the
  same order); {} when no problem has a level."""
  per_problem = np.asarray(verdicts, np.float64).reshape(-1, k).mean(axis=1)
  return {level: float(per_problem[[x == level for x in levels]].mean())
          for level in sorted({x for x in levels if x is not None})}


def accuracy_stderr(verdicts: np.ndarray, k: int) -> float:
  """The standard error of avg@k over problems: the sample standard deviation of the problems' accuracies
  (each the mean of its `k` verdicts, `verdicts` problem by problem) over √problems; 0 for one problem."""
  per_problem = np.asarray(verdicts, np.float64).reshape(-1, k).mean(axis=1)
  return float(per_problem.std(ddof=1) / np.sqrt(len(per_problem))) if len(per_problem) > 1 else 0.0


def by_level(evaluation: dict) -> dict[str, float]:
  """An evaluation's accuracy by problem level ({"2": 0.61, ...}, `eval/accuracy_level_{k}`)."""
  prefix = "eval/accuracy_level_"
  return {key[len(prefix):]: value for key, value in evaluation.items() if key.startswith(prefix)}


# Folded into the run's seed for the evaluation's keys: a stream apart from the training's key chain.
EVALUATION_STREAM = 0x6576616C  # "eval"


def evaluation_key(seed: int, rl_steps_done: int) -> jax.Array:
  """The held-out evaluation's sampling key after `rl_steps_done` RL steps (0: before RL), a function
  of the seed and that count alone: runs of one seed (a sweep's members) evaluate with the same keys
  at the same step, common random numbers that shrink the evaluation noise of their difference while
  their policies are close, and evaluating leaves the training's key chain as it was."""
  return jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), EVALUATION_STREAM), rl_steps_done)


def evaluate(experience, state: TrainState, records: list[Record], *, rl_steps_done: int) -> dict:
  """avg@k on held-out problems with the eval sampling settings, sampled by `experience` (`Experience`) with
  `evaluation_key(seed, rl_steps_done)` (device scalars), and the fractions of responses that failed to
  score (`eval/error_frac`: verifier time-outs, crashes, errors; they count as incorrect) and in which no
  answer was found (`eval/no_answer_frac`)."""
  config, k = experience.config, experience.config.eval.samples_per_problem
  key = distributed.replicate_local(evaluation_key(config.seed, rl_steps_done), experience.steps.mesh)
  correct, lengths, failed, policy = [], [], {"error_frac": 0.0,
                                              "no_answer_frac": 0.0}, experience.policy(state)
  starts = np.cumsum([0, *evaluation_calls(config, len(records))])
  for n, (i, j) in enumerate(zip(starts[:-1], starts[1:])):
    part = records[i:j]
    out, _ = experience.generate_in_layout(policy, part, jax.random.fold_in(key, n), samples_per_prompt=k,
                                           temperature=config.eval.temperature, top_p=config.eval.top_p)
    scored = experience.verify(out, [x.answer for x in part for _ in range(k)])
    correct.append(distributed.gather_rows(scored.correct))
    lengths.append(distributed.gather_rows(distributed.local_rows(out.response_lengths)[1]))
    for name in failed:  # Fractions of this call's responses (combined over processes), weighted by them.
      failed[name] += scored.metrics[f"reward/{name}"] * len(correct[-1])
  responses, verdicts = sum(map(len, correct)), np.concatenate(correct)
  levels = accuracy_by_level(verdicts, [r.level for r in records], k)
  return {"eval/accuracy": float(verdicts.mean()), "eval/accuracy_stderr": accuracy_stderr(verdicts, k),
          "eval/problems": float(len(records)),
          "eval/response_len_mean": float(np.concatenate(lengths).mean())
          } | {f"eval/{name}": float(total / responses) for name, total in failed.items()} | {
              f"eval/accuracy_level_{level}": value for level, value in levels.items()}


def evaluation_calls(config: ExperimentConfig, problems: int) -> list[int]:
  """The problems of each rollout call of a held-out evaluation of `problems` problems: as many sequences a
  call as a training rollout's (round) holds, `eval.samples_per_problem` per problem."""
  r = config.rollout
  per_call = max(1, (r.prompts_per_generation or r.prompts_per_step) * r.samples_per_prompt
                 // config.eval.samples_per_problem)
  return [min(per_call, problems - i) for i in range(0, problems, per_call)]
