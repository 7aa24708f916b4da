"""Response-length profiles: one RL step's response lengths `[N]` and prompt lengths `[P]` (`Profile`), on
which the roofline replays the rollout (`rollout/refill/replay.py`) and counts the micro-batches that run.

  prompts, where = prompt_lengths(config)           # the training data's prompts, encoded as the run does
  profile = log_normal(config, prompts, where)      # or at_cap(...), from_run(..., run_dir)

Every response at the cap (`at_cap`: no raggedness, the bound); a log-normal one (`log_normal`: a long tail, a
stated mean); or a run's (`from_run`: the log-normal through the median and 90th percentile its
`metrics.jsonl` logged). Prompt lengths come from the experiment's training data (`prompt_lengths`).
"""

import json
import math
import os
from typing import NamedTuple

import numpy as np

from vapo_jax.errors import DataError
from vapo_jax.rollout import common

Z90 = 1.2815515655446004  # The standard normal's 90th percentile.


class Profile(NamedTuple):
  name: str  # In words, with where its numbers come from.
  responses: np.ndarray  # [N] int: one RL step's response lengths.
  prompts: np.ndarray  # [P] int: its prompts' lengths (real tokens).


def prompt_lengths(config, *, count: int = 512, seed: int = 0) -> tuple[np.ndarray, str]:
  """(`count` prompt lengths, where they come from): prompts of `config`'s training data encoded as the run
  does, with its tokenizer (`model.tokenizer` or `model.checkpoint`, or for a Qwen2.5 preset the repository's
  `data/qwen2.5_tokenizer`); without one, every prompt at the bucket length (`rollout.max_prompt_tokens`)."""
  from vapo_jax import paths
  from vapo_jax.data import problems
  from vapo_jax.data import tokenizer as tok_lib

  name = config.model.tokenizer or config.model.checkpoint or (
      paths.data_path("qwen2.5_tokenizer") if config.model.preset.startswith("qwen2.5") else None)
  bucket = common.prompt_bucket(config.rollout.max_prompt_tokens)
  if name is None or config.data.train_path is None:
    return np.full(count, bucket), f"every prompt at the {bucket}-token bucket (no tokenizer to measure them)"
  tokenizer = tok_lib.load(name)
  rows = problems.load_problems(config.data.train_path, config, tokenizer, dedup=False)
  picked = np.random.default_rng(seed).choice(len(rows), size=min(count, len(rows)), replace=False)
  lengths = np.array([len(problems.encode_prompt(rows[i], tokenizer, config)) for i in picked])
  return (np.resize(lengths, count), f"prompts of {config.data.train_path} ({len(picked)} drawn, mean "
          f"{lengths.mean():.0f} tokens, encoded with {os.path.basename(str(name))})")


def at_cap(config, prompts: np.ndarray, where: str) -> Profile:
  """Every response at `rollout.max_response_tokens`: no raggedness (the roofline's bound)."""
  r = config.rollout
  return Profile(f"every response at the {r.max_response_tokens}-token cap; {where}",
                 np.full(r.responses_per_step, r.max_response_tokens), _prompts(prompts, r.prompts_per_step))


def log_normal(config, prompts: np.ndarray, where: str, *, mean_frac: float = 0.3, sigma: float = 0.9,
               seed: int = 0) -> Profile:
  """A long tail: log-normal response lengths whose mean is `mean_frac` of the cap (before the cap clips
  them), log-standard deviation `sigma`, clipped to [1, cap]."""
  r = config.rollout
  max_response_tokens = r.max_response_tokens
  mu = math.log(mean_frac * max_response_tokens) - sigma**2 / 2
  lengths = _draw(mu, sigma, r.responses_per_step, max_response_tokens, seed)
  return Profile(f"log-normal response lengths, mean {mean_frac:g} of the cap before clipping (σ {sigma:g}; "
                 f"drawn mean {lengths.mean():.0f} tokens, {np.mean(lengths >= max_response_tokens):.1%} at "
                 f"the cap); {where}", lengths, _prompts(prompts, r.prompts_per_step))


def from_run(config, prompts: np.ndarray, where: str, run_dir: str, *, last: int = 10,
             seed: int = 0) -> Profile:
  """The log-normal through the median and 90th percentile of the response lengths a run logged
  (`rollout/response_len_p50`, `_p90` in `<run_dir>/metrics.jsonl`, averaged over its last `last` RL steps),
  at `config`'s cap and batch."""
  path = os.path.join(run_dir, "metrics.jsonl")
  try:
    with open(path) as f:
      rows = [json.loads(line) for line in f if line.strip()]
  except (OSError, json.JSONDecodeError) as e:
    raise DataError(f"{path}: cannot read the run's logged response lengths ({e})") from None
  steps = [row for row in rows if row.get("stage") == "rl" and "rollout/response_len_p50" in row][-last:]
  if not steps:
    raise DataError(f"{path}: no RL step logged rollout/response_len_p50 (a run's metrics.jsonl has one per "
                    "RL step)")
  p50 = float(np.mean([row["rollout/response_len_p50"] for row in steps]))
  p90 = float(np.mean([row["rollout/response_len_p90"] for row in steps]))
  sigma = max(math.log(max(p90, p50) / p50) / Z90, 1e-3)
  r = config.rollout
  lengths = _draw(math.log(p50), sigma, r.responses_per_step, r.max_response_tokens, seed)
  return Profile(f"{path}: log-normal through its median {p50:.0f} and 90th percentile {p90:.0f} over the "
                 f"last {len(steps)} RL steps (σ {sigma:.2f}; drawn mean {lengths.mean():.0f}); {where}",
                 lengths, _prompts(prompts, r.prompts_per_step))


def _draw(mu: float, sigma: float, n: int, max_response_tokens: int, seed: int) -> np.ndarray:
  drawn = np.random.default_rng(seed).lognormal(mu, sigma, size=n)
  return np.clip(np.round(drawn), 1, max_response_tokens).astype(np.int64)


def _prompts(prompts: np.ndarray, count: int) -> np.ndarray:
  return np.resize(np.asarray(prompts, np.int64), count)
