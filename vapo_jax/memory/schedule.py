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


class _Queue:
  """One queue's rows and pages, step by step, as the refill engine keeps them (`simulate`)."""

  def __init__(self, responses, prompts, *, group: int, slots: int, paged: Paged | None):
    self.responses, self.prompts, self.group, self.paged = responses, np.asarray(prompts), group, paged
    self.seq, self.held, self.gen = np.full(slots, -1), np.zeros(slots, np.int64), np.zeros(slots, np.int64)
    self.started, self.shared = np.zeros(slots, np.int64), np.zeros(slots, np.int64)
    self.waiting, self.next_new, self.rows = [], 0, slots
    self.tg = paged.page_tokens if paged else 1
    self.prompt_pages = -(-self.prompts // self.tg)
    self.free = (paged.pages - int(self.prompt_pages.sum())) if paged else 0
    self.peak = paged.pages - self.free if paged else 0
    self.users = np.full(len(self.prompts), group)
    self.preemptions = self.recomputed = 0

  def own(self, i) -> int:
    return int(-(-self.held[i] // self.tg) - self.shared[i])

  def remaining(self) -> bool:
    return self.next_new < len(self.responses) or bool(self.waiting) or bool((self.seq >= 0).any())

  def preempt(self, need: int) -> tuple[int, bool]:
    """The rows that started last (then the highest slots) until the rest's pages fit; (need left, preempted)."""
    chosen = []
    for i in sorted(np.flatnonzero(self.seq >= 0), key=lambda i: (self.started[i], i), reverse=True):
      if need <= self.free:
        break
      need -= int(self.held[i] % self.tg == 0)
      self.free += self.own(i)
      chosen.append(i)
    for i in sorted(chosen):  # Waiting in slot order, as the engine stacks them.
      self.preemptions, self.recomputed = self.preemptions + 1, self.recomputed + int(self.gen[i])
      self.waiting.append(self.seq[i])
      self.seq[i] = -1
    return need, bool(chosen)

  def admit(self, t: int, need: int, blocked: bool) -> int:
    """Free slots take the waiting sequences, then the next ones, while pages last; returns how many."""
    open_slots = np.flatnonzero(self.seq[:self.rows] < 0)
    take = min(len(open_slots), len(self.waiting) + len(self.responses) - self.next_new)
    if self.paged:
      take = 0 if blocked else min(take, max(self.free - need, 0))
    for i in open_slots[:take]:
      self.seq[i] = self.waiting.pop() if self.waiting else self.next_new
      self.next_new += self.seq[i] == self.next_new
      p = self.seq[i] // self.group
      self.held[i], self.gen[i], self.started[i] = (self.prompts[p] if self.paged else 0), 0, t
      self.shared[i] = self.prompts[p] // self.tg if self.paged else 0
    return take

  def end(self, ended) -> None:
    for i in np.flatnonzero(ended):
      p = self.seq[i] // self.group
      if self.paged:
        self.free += self.own(i)
        self.users[p] -= 1
        self.free += int(self.prompt_pages[p]) if self.users[p] == 0 else 0
      self.seq[i] = -1

  def shrink(self, min_slots: int) -> None:
    """The compaction: once the queue is drained and at most half the rows live, the live rows first."""
    live = int((self.seq >= 0).sum())
    if self.next_new < len(self.responses) or self.waiting or not 0 < live <= queues_lib.shrink_threshold(
        self.rows, min_slots):
      return
    kept = np.flatnonzero(self.seq >= 0)
    self.rows = queues_lib.shrunk_slots(live, min_slots)
    for array, empty in ((self.seq, -1), (self.held, 0), (self.gen, 0), (self.started, 0), (self.shared, 0)):
      moved = array[kept].copy()
      array[:] = empty
      array[:len(kept)] = moved


def simulate(responses: np.ndarray, prompts: np.ndarray, *, group: int, slots: int, min_slots: int = 1,
             paged: Paged | None = None, prompt_slots: int = 0, block: int = 512) -> Load:
  """One queue's decode loop (module docstring): `responses` `[n]` its sequences' lengths in order, `prompts`
  `[n / group]` their prompts'; `slots` rows at first, shrinking to min_slots·2^k in the tail."""
  q, t = _Queue(responses, prompts, group=group, slots=slots, paged=paged), 0
  rows, live, read = [], [], []
  while q.remaining():
    need = int(((q.seq >= 0) & (q.held % q.tg == 0)).sum()) if paged else 0
    need, blocked = q.preempt(need) if paged and need > q.free else (need, False)
    take = q.admit(t, need, blocked)
    running = q.seq >= 0
    if paged:
      q.free -= need + take
      q.peak = max(q.peak, paged.pages - q.free)
      span = q.tg * paged.block_pages
      read.append(int((-(-(q.held[running] + 1) // span) * span).sum()))
    else:
      longest = prompt_slots + int(q.gen[running].max(initial=0)) + 1
      read.append(q.rows * -(-longest // block) * block)
    rows.append(q.rows)
    live.append(int(running.sum()))
    q.held[running] += 1
    q.gen[running] += 1
    q.end(running & (q.gen >= q.responses[np.maximum(q.seq, 0)]))
    q.shrink(min_slots)
    t += 1
  return Load(np.asarray(rows), np.asarray(live), np.asarray(read, np.float64), q.preemptions, q.recomputed,
              q.peak)
