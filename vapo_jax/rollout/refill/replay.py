"""The refill engine replayed on the host: for each decode step, how many rows run and how many cached tokens their
attention reads, from the sequences' lengths (the roofline's model of the decode loop, `vapo_jax/roofline`).

  load = simulate(responses[:n], prompts[:p], group=G, slots=R, paged=Paged(pages, 128, 4))
  replay = partial_rounds(profile, group=G, queues=Q, slots=R, ..., budget=D, max_staleness=k, max_response_tokens=Tr)

`simulate` replays one queue (a data-parallel group) of the engine (`engine.py`) step by step: free slots take
the next sequences in order; in the tail (queue empty, at most half the rows live) the rows shrink to the fewest
of min_slots·2^k that hold the live ones. Paged (`Paged`): the queue's prompts hold their pages (⌈length / page⌉
each, given back when their last sample ends), a sequence takes its first page when it starts and one at each
page boundary, gives them back when it ends, and when the pool runs dry the sequences that started last are
preempted and restart from the prompt, as the engine does. Reads per step (`paged_attention.read_tokens`,
`decode_attention.read_tokens`: what the kernels read): paged, each live row its own tokens in whole blocks;
contiguous (`paged=None`), every row up to the longest live row's slot in a cache of `prompt_slots` (the
left-padded prompt bucket) + response slots, in blocks of `block`. With a `budget` it stops after that many
steps, as a partial rollout's round does; `partial_rounds` replays whole RL steps of partial rollouts with the
engine's own carry (`rollout/partial.py`).
"""

from typing import NamedTuple

import numpy as np

from vapo_jax.models import decode_attention, paged_attention
from vapo_jax.rollout import common
from vapo_jax.rollout.refill import queues as queues_lib


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
  held: np.ndarray | None = None  # [n] tokens each sequence holds at the end (with a budget: some unfinished).

  @property
  def steps(self) -> int:
    return len(self.rows)


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
    self.ended_at = np.zeros(len(responses), np.int64)

  def holding(self) -> np.ndarray:
    """`[n]` tokens each sequence holds: its length once ended, its tokens so far while live, else 0."""
    out = self.ended_at.copy()
    live = self.seq >= 0
    out[self.seq[live]] = self.gen[live]
    return out

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
      self.ended_at[self.seq[i]] = self.gen[i]
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
             paged: Paged | None = None, prompt_slots: int = 0, block: int = 512, cache_slots: int = 0,
             budget: int = 0) -> Load:
  """One queue's decode loop (module docstring): `responses` `[n]` its sequences' lengths in order, `prompts`
  `[n / group]` their prompts'; `slots` rows at first, shrinking to min_slots·2^k in the tail; `cache_slots`: the
  contiguous cache's slots (0: unbounded); `budget` > 0: stopped after that many steps (a partial rollout's round,
  `partial_rounds`)."""
  q, t = _Queue(responses, prompts, group=group, slots=slots, paged=paged), 0
  rows, live, read = [], [], []
  while q.remaining() and not 0 < budget <= t:
    need = int(((q.seq >= 0) & (q.held % q.tg == 0)).sum()) if paged else 0
    need, blocked = q.preempt(need) if paged and need > q.free else (need, False)
    take = q.admit(t, need, blocked)
    running = q.seq >= 0
    if paged:
      q.free -= need + take
      q.peak = max(q.peak, paged.pages - q.free)
      read.append(paged_attention.read_tokens(q.held[running] + 1, page_tokens=q.tg, block_pages=paged.block_pages))
    else:
      query = prompt_slots + np.append(q.gen[running], 0)  # No live row: the first block is read all the same.
      read.append(decode_attention.read_tokens(query, rows=q.rows, block=block, slots=cache_slots or None))
    rows.append(q.rows)
    live.append(int(running.sum()))
    q.held[running] += 1
    q.gen[running] += 1
    q.end(running & (q.gen >= q.responses[np.maximum(q.seq, 0)]))
    q.shrink(min_slots)
    t += 1
  return Load(np.asarray(rows), np.asarray(live), np.asarray(read, np.float64), q.preemptions, q.recomputed,
              q.peak, q.holding())


class PartialLoad(NamedTuple):
  """One queue's partial rollouts (`partial_rounds`) over the measured RL steps."""

  load: Load  # Their rounds' decode steps, end to end.
  steps: int  # RL steps measured.
  rounds: int
  prefill: np.ndarray  # [sequences prefilled] each round's prompts with their carried tokens.
  restarted: int  # Sequences restarted for `max_staleness`.
  carried: float  # Mean sequences carried out of a step.
  stale_frac: float  # Trained tokens sampled by an older version.


def partial_rounds(responses: np.ndarray, prompts: np.ndarray, *, group: int, queues: int, slots: int,
                   min_slots: int, paged: Paged | None, budget: int, max_staleness: int, max_response_tokens: int,
                   warm: int = 4, measured: int = 4) -> PartialLoad:
  """One queue's partial rollouts (`rollout/partial.py`) replayed with the engine's own carry: each RL step
  restarts the stale, then runs rounds of `budget` decode steps (`simulate`, one sequence per prompt: a prompt
  with its carried tokens) until its share of groups is complete. Groups come from one step's `responses` `[N]`
  and `prompts` `[N / group]` in turn, the queue serving 1/`queues` of them; `warm` steps fill the pipeline, the
  next `measured` are counted."""
  from vapo_jax.rollout import partial  # The carry itself: the replay follows the engine's rules.

  per_step, sequences = len(prompts) // queues, partial.OVERPROVISION * len(responses) // queues
  carry = partial.Carry(group=group, sequences=sequences, max_response_tokens=max_response_tokens,
                        max_staleness=max_staleness, pad_id=0,
                        prompt_width=partial.prompt_width(int(prompts.max()), max_response_tokens))
  drawn = [0]

  def draw(n):
    out = []
    for j in range(drawn[0], drawn[0] + n):
      g = j % len(prompts)
      out.append((responses[g * group:(g + 1) * group].tolist(), [0] * int(prompts[g])))
    drawn[0] += n
    return out

  loads, prefill = [], []

  def decode(call):  # The round in the replay: each sequence decodes on towards its drawn length.
    target = np.asarray([carry.groups[g].record[j] for g, j in call.members])
    held = call.prompt_mask.sum(axis=1)
    load = simulate(target - call.offsets, held, group=1, slots=slots, min_slots=min_slots, paged=paged,
                    budget=budget)
    loads.append(load)
    prefill.append(held)
    zeros = np.zeros((len(target), max(int(load.held.max()), 1)))
    finish = np.where(call.offsets + load.held >= target, common.FINISH_STOP, common.FINISH_UNFINISHED)
    return zeros.astype(np.int32), zeros, zeros, load.held, finish

  rounds, restarted, carried, stale, trained = 0, 0, 0, 0, 0
  for version in range(warm + measured):
    if version == warm:  # The pipeline is full: count from here.
      del loads[:], prefill[:]
    groups, restarts, ran = carry.step(version, per_step, draw, decode)
    if version >= warm:
      versions = [u for g in groups for m in g.members for u in m.versions]
      rounds, restarted, carried = rounds + ran, restarted + restarts, carried + carry.carried()
      stale, trained = stale + sum(u < version for u in versions), trained + len(versions)
  joined = Load(*(np.concatenate([getattr(x, f) for x in loads]) for f in ("rows", "live", "read_tokens")),
                sum(x.preemptions for x in loads), sum(x.recomputed_tokens for x in loads),
                max(x.peak_pages for x in loads))
  return PartialLoad(joined, measured, rounds, np.concatenate(prefill), restarted, carried / measured,
                     stale / max(trained, 1))
