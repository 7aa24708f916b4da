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
on a `VerifierPool` and returns the scores with their metrics, and `check_errors` turns failures
into something a user sees: the first error of a user function is warned about once, a batch in
which more than `max_error_frac` of the responses failed to score is warned about, and a batch in
which every response failed raises `RewardFunctionError` (a reward function that fails on every
response would otherwise train on a constant reward).
"""

import math
import time
import warnings
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from vapo_jax.errors import RewardFunctionError
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


class RewardBatch(NamedTuple):
  """Rewards of a batch of B responses and what the verifier saw."""

  rewards: np.ndarray  # [B] float32 total reward (score + overlong + format terms).
  correct: np.ndarray  # [B] bool verdicts (the positive examples of VAPO's NLL loss).
  answers: list[str | None]  # [B] extracted answers (None: none found or a user function).
  forms: list[str]  # [B] how each answer was found ("none", "boxed", ...; "user" for a user fn).
  statuses: list[str]  # [B] "ok", "timeout", "crash" or "error".
  metrics: dict[str, float]
  first_error: str | None = None  # What went wrong with the first response that failed to score.
  errors: list[str | None] | None = None  # [B] what went wrong with each response (None: it scored).


def _invalid_value(value) -> str:
  text = repr(value)
  return (f"returned {text[:100]}{'...' if len(text) > 100 else ''} ({type(value).__name__}), "
          "expected a bool or a finite number")


def _user_score(value, *, correct_reward: float, incorrect_reward: float) -> tuple[float, bool] | None:
  """A user function's bool verdict or numeric score as `(score, correct)`; None if invalid."""
  if isinstance(value, (bool, np.bool_)):
    return (correct_reward if value else incorrect_reward), bool(value)
  if isinstance(value, (int, float, np.integer, np.floating)) and math.isfinite(value):
    return float(value), float(value) >= correct_reward
  return None


def _verdicts(outcomes, *, builtin: bool, correct_reward: float, incorrect_reward: float):
  """Per response: a user function's score (None: the verdict decides), the verdict, the extracted
  answer, how it was found, the task's status and what went wrong (None: nothing); and the first failure."""
  user_scores, correct, extracted, found_forms, statuses, errors = [], [], [], [], [], []
  for outcome in outcomes:
    status, score, ok, answer, form, error = outcome.status, None, False, None, "none", None
    if status == "ok" and builtin:
      verdict: Verdict = outcome.value
      ok, answer, form = verdict.correct, verdict.answer, verdict.form
    elif status == "ok":
      form = "user"
      parsed = _user_score(outcome.value, correct_reward=correct_reward, incorrect_reward=incorrect_reward)
      if parsed is None:
        status, error = "error", _invalid_value(outcome.value)
      else:
        score, ok = parsed
    elif status != "ok":
      error = f"{status}: {outcome.value}"
    user_scores.append(score)
    correct.append(ok)
    extracted.append(answer)
    found_forms.append(form)
    statuses.append(status)
    errors.append(error)
  first_error = next((f"response {i}: {e}" for i, e in enumerate(errors) if e is not None), None)
  return user_scores, correct, extracted, found_forms, statuses, errors, first_error


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
    max_error_frac: float | None = None,
) -> RewardBatch:
  """Scores B `responses` against their reference `answers` on `pool` (see the module doc).

  The pool runs the built-in verifier (`pool.fn == DEFAULT_FN`), or a user function
  `fn(response, answer) -> bool | float`. Failed tasks (time-out, crash, exception, a value that
  is neither a bool nor a finite number) score `incorrect_reward` and are counted in the metrics;
  `first_error` says what went wrong with the first of them. `response_lengths` `[B]` (tokens) is
  needed when `overlong_buffer_tokens` > 0. With `max_error_frac`, `check_errors` is applied.
  """
  if len(responses) != len(answers):
    raise ValueError(f"{len(responses)} responses but {len(answers)} answers")
  builtin = pool.fn == DEFAULT_FN
  tasks = [(r, a, forms) if builtin else (r, a) for r, a in zip(responses, answers)]
  start = time.perf_counter()
  outcomes = pool.map(tasks)
  elapsed = time.perf_counter() - start
  user_scores, correct, extracted, found_forms, statuses, errors, first_error = _verdicts(
      outcomes, builtin=builtin, correct_reward=correct_reward, incorrect_reward=incorrect_reward)
  rewards = verifier_reward(np.asarray(correct, bool), correct_reward=correct_reward,
                            incorrect_reward=incorrect_reward)
  scored = [i for i, value in enumerate(user_scores) if value is not None]  # A user function's own numbers.
  rewards[scored] = np.asarray([user_scores[i] for i in scored], np.float32)
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
      "reward/no_answer_frac": sum(f == "none" and s == "ok" for f, s in zip(found_forms, statuses)) / n,
      "reward/verifier_timeouts": float(statuses.count("timeout")),
      "reward/verifier_crashes": float(statuses.count("crash")),
      "reward/verifier_errors": float(statuses.count("error")),
      "reward/error_frac": sum(s != "ok" for s in statuses) / n,
      "time/verify_s": elapsed,
      "perf/verify_responses_per_s": len(responses) / max(elapsed, 1e-9),
  }
  batch = RewardBatch(rewards, np.asarray(correct, bool), extracted, found_forms, statuses, metrics,
                      first_error, errors)
  if max_error_frac is not None:
    check_errors(batch, pool, max_error_frac=max_error_frac)
  return batch


def check_errors(batch: RewardBatch, pool: VerifierPool, *, max_error_frac: float,
                 counted_in: str = "reward/error_frac") -> None:
  """Warns or stops on responses that failed to score (time-out, crash, exception, invalid value).

  A user function's first error is warned about once per pool; more than `max_error_frac` of the
  batch failing is warned about; every response failing raises `RewardFunctionError` with the
  first error's text. Reads the fraction from `batch.metrics["reward/error_frac"]`, so that with
  several processes, called on the gathered metrics, every process decides the same way. `counted_in`:
  where the caller records the failures (the trainer's metric; `make eval`'s summary field).
  """
  frac, first = batch.metrics["reward/error_frac"], batch.first_error or "(on another process: see its log)"
  user = pool.fn != DEFAULT_FN
  what = f"the reward function {pool.fn!r} (reward.reward_fn)" if user else "the built-in verifier"
  if frac >= 1.0 and len(batch.statuses):
    hints = {"timeout": "raise reward.verifier_timeout_s", "MemoryError": "raise reward.verifier_memory_mb",
             "crash": "check the function with a response from the batch in a plain Python shell"}
    hint = next((h for key, h in hints.items() if key in first), "fix the function" if user else
                "check the verifier's installation (sympy, math-verify)")
    raise RewardFunctionError(f"{what} failed on all {len(batch.statuses)} responses of the batch; the first "
                              f"failure: {first}. Every response would score reward.incorrect (training "
                              f"would learn nothing, an evaluation would read 0): {hint}.")
  if frac > max_error_frac:
    warnings.warn(f"{frac:.0%} of the batch's responses failed to score with {what}, more than "
                  f"reward.max_error_frac={max_error_frac:g}; they score incorrect. The first failure: "
                  f"{first}", stacklevel=2)
  elif user and batch.first_error and not pool.failure_reported:
    warnings.warn(f"{what} failed to score a response: {batch.first_error}. Such responses score incorrect; "
                  f"this is reported once, then counted in {counted_in}", stacklevel=2)
  if user and batch.first_error:
    pool.failure_reported = True


def make_pool(*, reward_fn: str | None = None, workers: int = 0, timeout_s: float = 10.0,
              memory_limit_mb: int | None = 4096) -> VerifierPool:
  """The verifier pool: the built-in verifier, or the user function at `reward_fn`."""
  return VerifierPool(fn=reward_fn or DEFAULT_FN, workers=workers, timeout_s=timeout_s,
                      memory_limit_mb=memory_limit_mb)
