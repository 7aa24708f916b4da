"""Outcome rewards for a rollout batch: verifier score + DAPO soft overlong penalty + format check.

The reward of response b (B responses) is given on its last token:

  r_b = s_b + overlong_b + format_b

  s_b        `correct` if the verifier judges the final answer equivalent to the reference, else
             `incorrect` (no answer, a wrong one, a verifier time-out or crash); VAPO: +1 / −1.
             With a user reward function, its value (a bool is a verdict, a number the score).
  overlong_b DAPO's soft overlong punishment (Yu et al. 2025, eq. 13) with L_max the maximum
             response length and L_cache the buffer:
               0                                   |y| ≤ L_max − L_cache
               ((L_max − L_cache) − |y|) / L_cache · factor    L_max − L_cache < |y| ≤ L_max
               −factor                             |y| > L_max
  format_b   `format_penalty` when the answer was not given in an explicit final-answer form
             (`\\boxed{}` or an `Answer:` line; see `extract.py`), else 0.

The pure functions take arrays and keyword hyperparameters; `compute_rewards` runs the verifier
on a `VerifierPool` and returns the scores with their metrics.
"""

import math
import time
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from vapo_jax.rewards.equivalence import Verdict
from vapo_jax.rewards.extract import DEFAULT_FORMS, EXPLICIT_FORMS, AnswerForm
from vapo_jax.rewards.pool import DEFAULT_FN, VerifierPool


def verifier_reward(correct: np.ndarray, *, correct_reward: float = 1.0,
                    incorrect_reward: float = -1.0) -> np.ndarray:
  """`[B]` scores: `correct_reward` where `correct` `[B]` is true, else `incorrect_reward`."""
  return np.where(np.asarray(correct, bool), correct_reward, incorrect_reward).astype(np.float32)


def overlong_penalty(response_lengths: np.ndarray, *, max_response_tokens: int, buffer_tokens: int,
                     penalty_factor: float = 1.0) -> np.ndarray:
  """`[B]` DAPO soft overlong penalty (≤ 0) of responses of `response_lengths` `[B]` tokens.

  `buffer_tokens` = 0 switches it off. The expected length is `max_response_tokens − buffer_tokens`.
  """
  lengths = np.asarray(response_lengths, np.float64)
  if buffer_tokens <= 0:
    return np.zeros(lengths.shape, np.float32)
  if buffer_tokens > max_response_tokens:
    raise ValueError(f"buffer_tokens={buffer_tokens} exceeds max_response_tokens={max_response_tokens}")
  expected = max_response_tokens - buffer_tokens
  penalty = np.minimum((expected - lengths) / buffer_tokens, 0.0) * penalty_factor
  return np.maximum(penalty, -penalty_factor).astype(np.float32)


def format_penalty(formatted: np.ndarray, *, penalty: float) -> np.ndarray:
  """`[B]`: `penalty` where the answer was not in an explicit form (`formatted` `[B]` false)."""
  return np.where(np.asarray(formatted, bool), 0.0, penalty).astype(np.float32)


def last_token_rewards(scores: np.ndarray, response_mask: np.ndarray) -> np.ndarray:
  """`[B, T]` token rewards: `scores` `[B]` on each response's last valid token, 0 elsewhere."""
  mask = np.asarray(response_mask, bool)
  lengths = mask.sum(-1)
  last = np.arange(mask.shape[-1])[None] == (lengths - 1)[:, None]
  return np.where(last & (lengths[:, None] > 0), np.asarray(scores, np.float32)[:, None], 0.0)


class RewardBatch(NamedTuple):
  """Rewards of a batch of B responses and what the verifier saw."""

  rewards: np.ndarray  # [B] float32 total reward (score + overlong + format terms).
  correct: np.ndarray  # [B] bool verdicts (the positive examples of VAPO's NLL loss).
  answers: list[str | None]  # [B] extracted answers (None: none found or a user function).
  forms: list[str]  # [B] how each answer was found ("none", "boxed", ...; "user" for a user fn).
  statuses: list[str]  # [B] "ok", "timeout", "crash" or "error".
  metrics: dict[str, float]


def _user_score(value, *, correct_reward: float, incorrect_reward: float) -> tuple[float, bool] | None:
  """A user function's bool verdict or numeric score as `(score, correct)`; None if invalid."""
  if isinstance(value, (bool, np.bool_)):
    return (correct_reward if value else incorrect_reward), bool(value)
  if isinstance(value, (int, float, np.integer, np.floating)) and math.isfinite(value):
    return float(value), float(value) >= correct_reward
  return None


def compute_rewards(
    pool: VerifierPool,
    responses: Sequence[str],
    answers: Sequence[str],
    response_lengths: np.ndarray | None = None,
    *,
    correct_reward: float = 1.0,
    incorrect_reward: float = -1.0,
    forms: tuple[AnswerForm, ...] = DEFAULT_FORMS,
    max_response_tokens: int | None = None,
    overlong_buffer_tokens: int = 0,
    overlong_penalty_factor: float = 1.0,
    format_penalty_value: float = 0.0,
) -> RewardBatch:
  """Scores B `responses` against their reference `answers` on `pool` (see the module doc).

  The pool runs the built-in verifier (`pool.fn == DEFAULT_FN`), or a user function
  `fn(response, answer) -> bool | float`. Failed tasks (time-out, crash, exception, a value that
  is neither a bool nor a finite number) score `incorrect_reward` and are counted in the metrics.
  `response_lengths` `[B]` (tokens) is needed when `overlong_buffer_tokens` > 0.
  """
  if len(responses) != len(answers):
    raise ValueError(f"{len(responses)} responses but {len(answers)} answers")
  builtin = pool.fn == DEFAULT_FN
  tasks = [(r, a, forms) if builtin else (r, a) for r, a in zip(responses, answers)]
  start = time.perf_counter()
  outcomes = pool.map(tasks)
  elapsed = time.perf_counter() - start
  scores, correct, extracted, found_forms, statuses = [], [], [], [], []
  for outcome in outcomes:
    status, score, ok, answer, form = outcome.status, incorrect_reward, False, None, "none"
    if status == "ok" and builtin:
      verdict: Verdict = outcome.value
      ok, answer, form = verdict.correct, verdict.answer, verdict.form
      score = correct_reward if ok else incorrect_reward
    elif status == "ok":
      form = "user"
      parsed = _user_score(outcome.value, correct_reward=correct_reward, incorrect_reward=incorrect_reward)
      if parsed is None:
        status = "error"
      else:
        score, ok = parsed
    scores.append(score)
    correct.append(ok)
    extracted.append(answer)
    found_forms.append(form)
    statuses.append(status)
  rewards = np.asarray(scores, np.float32)
  if overlong_buffer_tokens > 0:
    if response_lengths is None or max_response_tokens is None:
      raise ValueError("the overlong penalty needs response_lengths and max_response_tokens")
    rewards = rewards + overlong_penalty(response_lengths, max_response_tokens=max_response_tokens,
                                         buffer_tokens=overlong_buffer_tokens,
                                         penalty_factor=overlong_penalty_factor)
  if format_penalty_value and builtin:
    formatted = np.asarray([f in EXPLICIT_FORMS for f in found_forms], bool)
    rewards = rewards + format_penalty(formatted, penalty=format_penalty_value)
  n = max(len(responses), 1)
  metrics = {
      "reward/mean": float(rewards.mean()) if len(rewards) else 0.0,
      "reward/accuracy": sum(correct) / n,
      "reward/no_answer_frac": sum(f == "none" and s == "ok" for f, s in zip(found_forms, statuses)) / n,
      "reward/verifier_timeouts": float(statuses.count("timeout")),
      "reward/verifier_crashes": float(statuses.count("crash")),
      "reward/verifier_errors": float(statuses.count("error")),
      "time/verify_s": elapsed,
      "perf/verify_responses_per_s": len(responses) / max(elapsed, 1e-9),
  }
  return RewardBatch(rewards, np.asarray(correct, bool), extracted, found_forms, statuses, metrics)


def make_pool(*, reward_fn: str | None = None, workers: int = 0, timeout_s: float = 10.0,
              memory_limit_mb: int | None = 4096) -> VerifierPool:
  """The verifier pool: the built-in verifier, or the user function at `reward_fn`."""
  return VerifierPool(fn=reward_fn or DEFAULT_FN, workers=workers, timeout_s=timeout_s,
                      memory_limit_mb=memory_limit_mb)
