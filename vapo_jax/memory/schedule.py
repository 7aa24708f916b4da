"""The rollout's schedule on the host: for each decode step, how many rows run and how many cached tokens their
attention reads, from a response-length profile (`roofline.py`'s model of the decode loop).

  profile = log_normal(config, prompts)            # or at_cap(config, prompts), from_run(config, prompts, run_dir)
  load = simulate(profile.responses[:n], profile.prompts[:p], group=G, slots=R, paged=Paged(pages, 128, 4))

`simulate` replays one queue (a data-parallel group) of the refill engine (`rollout/refill.py`) step by step:
free slots take the next sequences in order; in the tail (queue empty, at most half the rows live) the rows
shrink to the fewest of min_slots·2^k that hold the live ones. Paged (`Paged`): the queue's prompts hold their
pages (⌈length / page⌉ each, given back when their last sample ends), a sequence takes its first page when it
starts and one at each page boundary, gives them back when it ends, and when the pool runs dry the sequences
that started last are preempted and restart from the prompt, as the engine does. Reads per step: paged, each
live row its own tokens in whole blocks; contiguous (`paged=None`), every row up to the longest live row's
slot in a cache of `prompt_slots` (the left-padded prompt bucket) + response slots, in blocks of `block`.

A profile is one step's response lengths `[N]` and prompt lengths `[P]` (`Profile`): every response at the cap
(`at_cap`: no raggedness, the bound); a log-normal one (`log_normal`: a long tail, a stated mean); or a run's
(`from_run`: the log-normal through the median and 90th percentile its `metrics.jsonl` logged). Prompt lengths
come from the experiment's training data (`prompt_lengths`).
"""

import json
import math
import os
from typing import NamedTuple

import numpy as np

from vapo_jax.errors import DataError
from vapo_jax.rollout import common
from vapo_jax.rollout import queues as queues_lib

Z90 = 1.2815515655446004  # The standard normal's 90th percentile.


class Profile(NamedTuple):
  name: str  # In words, with where its numbers come from.
  responses: np.ndarray  # [N] int: one RL step's response lengths.
  prompts: np.ndarray  # [P] int: its prompts' lengths (real tokens).


class Paged(NamedTuple):
  pages: int  # Per queue.
  page_tokens: int
  block_pages: int  # Pages the kernel reads per block.


class Load(NamedTuple):
  """One queue's decode loop, step by step."""

  rows: np.ndarray  # [steps] rows decoded (the slots, shrinking in the tail).
  live: np.ndarray  # [steps] rows holding a sequence.
  read_tokens: np.ndarray  # [steps] cached tokens attention reads, over all rows (whole blocks).
  preemptions: int
  recomputed_tokens: int
  peak_pages: int  # Paged: the most pages in use at once (0: contiguous).

  @property
  def steps(self) -> int:
    return len(self.rows)


def prompt_lengths(config, *, count: int = 512, seed: int = 0) -> tuple[np.ndarray, str]:
  """(`count` prompt lengths, where they come from): prompts of `config`'s training data encoded as the run does,
  with its tokenizer (`model.tokenizer` or `model.checkpoint`, or for a Qwen2.5 preset the repository's
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
  """A long tail: log-normal response lengths whose mean is `mean_frac` of the cap (before the cap clips them),
  log-standard deviation `sigma`, clipped to [1, cap]."""
  r = config.rollout
  cap = r.max_response_tokens
  mu = math.log(mean_frac * cap) - sigma**2 / 2
  lengths = _draw(mu, sigma, r.responses_per_step, cap, seed)
  return Profile(f"log-normal response lengths, mean {mean_frac:g} of the cap before clipping (σ {sigma:g}; "
                 f"drawn mean {lengths.mean():.0f} tokens, {np.mean(lengths >= cap):.1%} at the cap); {where}",
                 lengths, _prompts(prompts, r.prompts_per_step))


def from_run(config, prompts: np.ndarray, where: str, run_dir: str, *, last: int = 10, seed: int = 0) -> Profile:
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
    raise DataError(f"{path}: no RL step logged rollout/response_len_p50 (a run's metrics.jsonl has one per RL step)")
  p50 = float(np.mean([row["rollout/response_len_p50"] for row in steps]))
  p90 = float(np.mean([row["rollout/response_len_p90"] for row in steps]))
  sigma = max(math.log(max(p90, p50) / p50) / Z90, 1e-3)
  r = config.rollout
  lengths = _draw(math.log(p50), sigma, r.responses_per_step, r.max_response_tokens, seed)
  return Profile(f"{path}: log-normal through its median {p50:.0f} and 90th percentile {p90:.0f} over the last "
                 f"{len(steps)} RL steps (σ {sigma:.2f}; drawn mean {lengths.mean():.0f}); {where}",
                 lengths, _prompts(prompts, r.prompts_per_step))


def _draw(mu: float, sigma: float, n: int, cap: int, seed: int) -> np.ndarray:
  drawn = np.random.default_rng(seed).lognormal(mu, sigma, size=n)
  return np.clip(np.round(drawn), 1, cap).astype(np.int64)


def _prompts(prompts: np.ndarray, count: int) -> np.ndarray:
  return np.resize(np.asarray(prompts, np.int64), count)


def simulate(responses: np.ndarray, prompts: np.ndarray, *, group: int, slots: int, min_slots: int = 1,
             paged: Paged | None = None, prompt_slots: int = 0, block: int = 512) -> Load:
  """One queue's decode loop (module docstring): `responses` `[n]` its sequences' lengths in order, `prompts`
  `[n / group]` their prompts'; `slots` rows at first, shrinking to min_slots·2^k in the tail."""
  n = len(responses)
  seq, held, gen = (np.full(slots, -1), np.zeros(slots, np.int64), np.zeros(slots, np.int64))
  started, shared = np.zeros(slots, np.int64), np.zeros(slots, np.int64)
  waiting, next_new, rows, t = [], 0, slots, 0
  tg = paged.page_tokens if paged else 1
  prompt_pages = -(-np.asarray(prompts) // tg)
  free = (paged.pages - int(prompt_pages.sum())) if paged else 0
  users = np.full(len(prompts), group)
  out_rows, out_live, out_read = [], [], []
  preemptions = recomputed = 0
  peak = paged.pages - free if paged else 0
  own = lambda rows_: -(-held[rows_] // tg) - shared[rows_]
  while next_new < n or waiting or (seq >= 0).any():
    live = seq >= 0
    need = int((live & (held % tg == 0)).sum()) if paged else 0
    blocked = False
    if paged and need > free:
      chosen = []  # The rows that started last (then the highest slots) until the rest fit.
      for i in sorted(np.flatnonzero(live), key=lambda i: (started[i], i), reverse=True):
        if need <= free:
          break
        need -= int(held[i] % tg == 0)
        free += int(own(i))
        chosen.append(i)
      for i in sorted(chosen):  # Waiting in slot order, as the engine stacks them.
        preemptions, recomputed, blocked = preemptions + 1, recomputed + int(gen[i]), True
        waiting.append(seq[i])
        seq[i] = -1
      live = seq >= 0
    open_slots = np.flatnonzero(~live[:rows])
    take = min(len(open_slots), len(waiting) + n - next_new)
    if paged:
      take = 0 if blocked else min(take, max(free - need, 0))
    for i in open_slots[:take]:
      seq[i] = waiting.pop() if waiting else next_new
      next_new += seq[i] == next_new
      p = seq[i] // group
      held[i], gen[i], started[i] = (prompts[p] if paged else 0), 0, t
      shared[i] = prompts[p] // tg if paged else 0
    live = seq >= 0
    if paged:
      free -= need + take
      peak = max(peak, paged.pages - free)
      span = tg * paged.block_pages
      out_read.append(int((-(-(held[live] + 1) // span) * span).sum()))
    else:
      longest = prompt_slots + int(gen[live].max(initial=0)) + 1
      out_read.append(rows * -(-longest // block) * block)
    out_rows.append(rows)
    out_live.append(int(live.sum()))
    held[live] += 1
    gen[live] += 1
    ended = live & (gen >= responses[np.maximum(seq, 0)])
    for i in np.flatnonzero(ended):
      p = seq[i] // group
      if paged:
        free += int(own(i))
        users[p] -= 1
        free += int(prompt_pages[p]) if users[p] == 0 else 0
      seq[i] = -1
    t += 1
    live_now = int((seq >= 0).sum())
    shrink_at = queues_lib.shrink_threshold(rows, min_slots)
    if next_new >= n and not waiting and 0 < live_now <= shrink_at:
      kept = np.flatnonzero(seq >= 0)  # The compaction: the live rows first, in slot order.
      rows = queues_lib.shrunk_slots(live_now, min_slots)
      for array, empty in ((seq, -1), (held, 0), (gen, 0), (started, 0), (shared, 0)):
        moved = array[kept].copy()
        array[:] = empty
        array[:len(kept)] = moved
  return Load(np.asarray(out_rows), np.asarray(out_live), np.asarray(out_read, np.float64), preemptions, recomputed,
              peak)
