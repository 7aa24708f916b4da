"""Accuracy of verified samples: avg@k, unbiased pass@k and majority vote maj@k, overall and per source.

For problem i with n_i samples of which c_i are correct (P problems):
  avg@n  = (1/P) Σ_i c_i / n_i                             (the VAPO paper's AIME 2024 avg@32)
  pass@k = (1/P) Σ_i [1 − C(n_i − c_i, k) / C(n_i, k)]     (unbiased; Chen et al. 2021, eq. 1)
  maj@n  = (1/P) Σ_i 1[the most frequent extracted answer of problem i is correct]
Each problem weighs the same (with equal n_i, avg@n is the mean over all samples); when the
problems have different sample counts, n is written "min-max" and pass@k stops at the smallest.
maj@n is None (printed "n/a") when a user reward function (`reward.reward_fn`) scored the samples:
it gives a verdict per response, not an answer, so there is nothing to vote on.
"""

import collections
import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from vapo_jax.kinds import AnswerForm
from vapo_jax.rewards import equivalence, reward
from vapo_jax.rewards.extract import DEFAULT_FORMS


class Sample(NamedTuple):
  """One scored response."""

  id: str  # Problem id.
  source: str  # The problem's dataset.
  index: int  # Sample number within its problem.
  response: str
  gold: str  # Reference answer.
  answer: str | None  # Extracted answer.
  form: str  # How it was found ("none": no answer).
  correct: bool
  status: str  # Verifier outcome: "ok", "timeout", "crash" or "error".
  error: str | None = None  # Why it failed to score (None: it scored).


def pass_at_k(n: int, c: int, k: int) -> float:
  """Unbiased pass@k of one problem with `c` correct among `n` samples: 1 − C(n−c, k)/C(n, k).

  Computed as 1 − Π_{i=n−c+1}^{n} (1 − k/i), which avoids huge binomials (Chen et al. 2021).
  """
  if not 0 <= c <= n or not 1 <= k <= n:
    raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
  if n - c < k:
    return 1.0
  return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def answer_key(answer: str) -> str:
  """Answers that are the same for a majority vote get the same key (integers by value)."""
  value = equivalence.as_integer(answer)
  return str(value) if value is not None else equivalence.canonical(answer)


def majority_correct(answers: Sequence[str | None], correct: Sequence[bool]) -> bool:
  """Whether the most frequent extracted answer is correct; ties go to the earliest; no answer loses."""
  votes: dict[str, list[int]] = collections.defaultdict(list)
  for i, answer in enumerate(answers):
    if answer is not None:
      votes[answer_key(answer)].append(i)
  if not votes:
    return False
  winner = max(votes.values(), key=len)  # The first of equals: dicts keep insertion order.
  return bool(correct[winner[0]])


def pass_ks(n: int) -> list[int]:
  """k values reported for n samples: 1, 2, 4, ... up to n, and n itself."""
  return sorted({2 ** i for i in range(int(math.log2(n)) + 1)} | {n}) if n >= 1 else []


def summarize(samples: Sequence[Sample]) -> dict[str, float]:
  """avg@n, pass@k for k = 1, 2, 4, ... ≤ min n, maj@n and verifier counts of `samples`."""
  groups: dict[str, list[Sample]] = collections.defaultdict(list)
  for sample in samples:
    groups[sample.id].append(sample)
  counts = [len(g) for g in groups.values()]
  n_min, n_max = min(counts), max(counts)
  n = str(n_min) if n_min == n_max else f"{n_min}-{n_max}"
  summary: dict[str, float] = {"problems": len(groups), "samples": len(samples)}
  summary[f"avg@{n}"] = float(np.mean([np.mean([s.correct for s in g]) for g in groups.values()]))
  for k in pass_ks(n_min):
    summary[f"pass@{k}"] = float(np.mean([pass_at_k(len(g), sum(s.correct for s in g), k)
                                          for g in groups.values()]))
  if n_min != n_max:  # Larger k would need more samples than some problems have.
    summary["pass@k_note"] = (f"pass@k up to k={n_min} only: problems have {n} samples (the fewest bound k; "
                              f"{sum(c == n_min for c in counts)} problem(s) have {n_min})")
  votable = all(s.form != "user" for s in samples)  # A user reward function extracts no answers.
  summary[f"maj@{n}"] = float(np.mean([majority_correct([s.answer for s in g], [s.correct for s in g])
                                       for g in groups.values()])) if votable else None
  summary["no_answer_frac"] = float(np.mean([s.form == "none" for s in samples]))
  for status, name in (("timeout", "timeouts"), ("crash", "crashes"), ("error", "errors")):
    summary[f"verifier_{name}"] = sum(s.status == status for s in samples)
  return summary


def summarize_by_source(samples: Sequence[Sample]) -> dict[str, Any]:
  by_source: dict[str, list[Sample]] = collections.defaultdict(list)
  for sample in samples:
    by_source[sample.source].append(sample)
  return {"overall": summarize(samples),
          "per_source": {source: summarize(group) for source, group in sorted(by_source.items())}}


def score(pairs: Sequence[tuple[Any, str]], pool, *, forms: tuple[AnswerForm, ...] = DEFAULT_FORMS,
          correct_reward: float = 1.0,
          incorrect_reward: float = -1.0) -> tuple[list[Sample], reward.RewardBatch]:
  """Verifies every response on `pool` as the trainer does (`reward.compute_rewards`: a user
  function's score counts as correct from `correct_reward` on); returns the samples, each with why it
  failed to score if it did, and the batch (its metrics and errors, for `reward.check_errors`)."""
  batch = reward.compute_rewards(pool, [r for _, r in pairs], [p.answer for p, _ in pairs], forms=forms,
                                 correct_reward=correct_reward, incorrect_reward=incorrect_reward)
  seen: collections.Counter = collections.Counter()
  samples = []
  for i, (problem, response) in enumerate(pairs):
    samples.append(Sample(problem.id, problem.source, seen[problem.id], response, problem.answer,
                          batch.answers[i],
                          batch.forms[i], bool(batch.correct[i]), batch.statuses[i], batch.errors[i]))
    seen[problem.id] += 1
  return samples, batch


def failures(samples: Sequence[Sample], *, limit: int = 10) -> dict[str, int]:
  """The most frequent reasons samples failed to score (`limit` of them) with their counts."""
  return dict(collections.Counter(s.error for s in samples if s.error is not None).most_common(limit))
