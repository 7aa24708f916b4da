"""The refill engine replayed on the host: for each decode step, how many rows run and how many cached tokens
their attention reads, from the sequences' lengths (the roofline's model of the decode loop,
`vapo_jax/roofline`).

  load = simulate(responses[:n], prompts[:p], samples_per_prompt=G, slots=R,
                  paged=Paged(queue_pages, 128, 4, lanes, chunk))

`simulate` replays one queue (a data-parallel group) of the engine (`engine.py`) step by step: free slots take
the next sequences in order; in the tail (queue empty, at most half the rows live) the rows shrink to the
fewest of min_slots·2^k that hold the live ones. Paged (`Paged`), as `slots.py` and `prefill.py` run it: a
prompt takes its pages (⌈length / page⌉) when a prefill lane takes it for the next sequences and is prefilled
`chunk` tokens a step; its samples take slots once it is ready, a first page each and one at each page
boundary, giving them back when they end, the prompt's when its last sample ends; when the pool runs dry the
queue gives back idle prompts, prefills and the sequences that started last (which restart from the prompt).
Reads per step (`paged_attention.read_tokens`, `decode_attention.read_tokens`: what the kernels read): paged,
each live row its own tokens in whole blocks; contiguous (`paged=None`, every prompt prefilled at the start),
every row up to the longest live row's slot in a cache of `prompt_slots` (the left-padded prompt bucket) +
response slots, in blocks of `block`. With a `budget` it stops after that many steps, as a partial rollout's
round does (`rollout/partial_replay.py` replays whole RL steps of them with the engine's own carry).
"""

from typing import NamedTuple

import numpy as np

from vapo_jax.models import decode_attention, paged_attention
from vapo_jax.rollout.refill import queues as queues_lib


class Paged(NamedTuple):
  queue_pages: int  # Pages of each queue's pool.
  page_tokens: int
  block_pages: int  # Pages the kernel reads per block.
  lanes: int = 4  # Prefill lanes per queue (`rollout.prefill_lanes`).
  chunk: int = 512  # Tokens a lane prefills per step (`RolloutPlan.prefill_chunk`).


class Load(NamedTuple):
  """One queue's decode loop, step by step."""

  rows: np.ndarray  # [steps] rows decoded (the slots, shrinking in the tail).
  live: np.ndarray  # [steps] rows holding a sequence.
  read_tokens: np.ndarray  # [steps] cached tokens attention reads, over all rows (whole blocks).
  preemptions: int
  recomputed_tokens: int
  peak_pages: int  # Paged: the most pages in use at once (0: contiguous).
  held: np.ndarray | None = None  # [n] tokens each sequence holds at the end (with a budget: some unfinished).
  prefills: int = 0  # Paged: prompts prefilled (again, after being given back, too).
  chunks: np.ndarray | None = None  # Paged: [steps] prefill lanes that ran a chunk.
  prefill_tokens: np.ndarray | None = None  # Paged: [steps] prompt tokens prefilled.
  prefill_lengths: np.ndarray | None = None  # Paged: [prefills] each prompt's tokens, as its prefill started.

  @property
  def steps(self) -> int:
    return len(self.rows)


class _Queue:
  """One queue's rows, pages, prompts and prefill lanes, step by step, as the refill engine keeps them
  (`simulate`; the engine's steps: `slots.py`, `prefill.py`)."""

  def __init__(self, responses, prompts, *, samples_per_prompt: int, slots: int, paged: Paged | None):
    self.responses, self.prompts, self.paged = responses, np.asarray(prompts), paged
    self.samples_per_prompt = samples_per_prompt
    self.seq, self.held, self.gen = np.full(slots, -1), np.zeros(slots, np.int64), np.zeros(slots, np.int64)
    self.started, self.shared = np.zeros(slots, np.int64), np.zeros(slots, np.int64)
    self.waiting, self.next_new, self.rows = [], 0, slots
    self.tg = paged.page_tokens if paged else 1
    self.prompt_pages = -(-self.prompts // self.tg)
    self.free, self.peak = (paged.queue_pages, 0) if paged else (0, 0)
    self.p_started, self.p_done = np.full(len(self.prompts), -1), np.zeros(len(self.prompts), np.int64)
    self.users = np.full(len(self.prompts), samples_per_prompt)
    self.lanes = [-1] * (paged.lanes if paged else 0)  # The prompt each lane fills; -1: none.
    self.preemptions = self.recomputed = self.prefills = 0
    self.prefilled: list[int] = []  # Each prefill's prompt length, in order.
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

  def ready(self, p) -> bool:
    return self.p_started[p] >= 0 and self.p_done[p] >= self.prompts[p]

  def members(self) -> np.ndarray:
    """`[P]` each prompt's live rows."""
    live = self.seq >= 0
    return np.bincount(self.seq[live] // self.samples_per_prompt, minlength=len(self.prompts))

  def need(self) -> int:
    return int(((self.seq >= 0) & (self.held % self.tg == 0)).sum())

  def release_prompt(self, p) -> None:
    self.free += int(self.prompt_pages[p]) if self.p_started[p] >= 0 else 0
    self.p_started[p], self.p_done[p] = -1, 0
    self.lanes = [-1 if lane == p else lane for lane in self.lanes]

  def candidates(self, count: int) -> list[int]:
    """The next `count` sequences to start: the preempted ones (latest first), then new ones in order."""
    fresh = range(self.next_new, min(self.next_new + count, len(self.responses)))
    return (self.waiting[::-1] + list(fresh))[:count]

  def preempt(self) -> bool:
    """Under pressure (`slots.preempt`): idle prompts, prefills (latest started first), then rows (latest
    started first, a prompt going back with its last live row) until the live rows' pages fit. Returns whether
    anything went back."""
    need, members = self.need(), self.members()
    resident = self.p_started >= 0
    idle = [p for p in range(len(self.prompts)) if resident[p] and self.ready(p) and members[p] == 0]
    filling = sorted((p for p in range(len(self.prompts)) if resident[p] and not self.ready(p)),
                     key=lambda p: -self.p_started[p])
    rows = sorted(np.flatnonzero(self.seq >= 0), key=lambda i: (self.started[i], i), reverse=True)
    left = members.copy()
    gone, chosen = [], []
    for kind, x in [("prompt", p) for p in idle + filling] + [("row", i) for i in rows]:
      if need <= self.free:
        break
      if kind == "prompt":
        gone.append(x)
        self.free += int(self.prompt_pages[x])
        self.p_started[x] = -2  # Counted: given back below.
        continue
      need -= int(self.held[x] % self.tg == 0)
      self.free += self.own(x)
      chosen.append(x)
      p = self.seq[x] // self.samples_per_prompt
      left[p] -= 1
      if left[p] == 0:
        gone.append(p)
        self.free += int(self.prompt_pages[p])
        self.p_started[p] = -2
    for i in sorted(chosen):  # Waiting in slot order, as the engine stacks them.
      self.preemptions, self.recomputed = self.preemptions + 1, self.recomputed + int(self.gen[i])
      self.waiting.append(self.seq[i])
      self.seq[i] = -1
    for p in gone:
      self.p_started[p], self.p_done[p] = -1, 0
      self.lanes = [-1 if lane == p else lane for lane in self.lanes]
    return bool(gone or chosen)

  def begin(self, t: int, blocked: bool) -> None:
    """Free lanes take the next sequences' prompts that are not resident, in order (`prefill.begin`)."""
    lanes = self.paged.lanes
    members = self.members()
    idle = sum(1 for p in range(len(self.prompts)) if self.ready(p) and members[p] == 0 and self.users[p] > 0)
    allowed = 0 if blocked else max(lanes - sum(lane >= 0 for lane in self.lanes) - idle, 0)
    budget, firsts = self.free - self.need(), []
    for n in self.candidates(self.rows + lanes):
      p = n // self.samples_per_prompt
      if self.p_started[p] < 0 and p not in firsts:
        firsts.append(p)
    for p in firsts[:allowed]:
      if self.prompt_pages[p] > budget:
        break
      budget -= int(self.prompt_pages[p])
      self.free -= int(self.prompt_pages[p])
      self.p_started[p], self.p_done[p] = t, 0
      self.lanes[self.lanes.index(-1)] = p
      self.prefills += 1
      self.prefilled.append(int(self.prompts[p]))

  def chunk(self) -> tuple[int, int]:
    """Every lane's next chunk (`prefill.chunk`): (lanes that ran, tokens prefilled)."""
    ran = tokens = 0
    for k, p in enumerate(self.lanes):
      if p < 0:
        continue
      step = min(self.paged.chunk, int(self.prompts[p] - self.p_done[p]))
      self.p_done[p] += step
      ran, tokens = ran + 1, tokens + step
      if self.p_done[p] >= self.prompts[p]:
        self.lanes[k] = -1
    return ran, tokens

  def admit(self, t: int, blocked: bool) -> int:
    """Free slots take the next sequences (preempted ones first) while the next one's prompt is ready and
    pages last (`slots.admit`); returns how many."""
    open_slots = np.flatnonzero(self.seq[:self.rows] < 0)
    ready = 0
    for n in self.candidates(len(open_slots)):
      if self.paged and not self.ready(n // self.samples_per_prompt):
        break
      ready += 1
    take = ready if not self.paged else 0 if blocked else min(ready, max(self.free - self.need(), 0))
    for i in open_slots[:take]:
      self.seq[i] = self.waiting.pop() if self.waiting else self.next_new
      self.next_new += self.seq[i] == self.next_new
      p = self.seq[i] // self.samples_per_prompt
      self.held[i], self.gen[i], self.started[i] = (self.prompts[p] if self.paged else 0), 0, t
      self.shared[i] = self.prompts[p] // self.tg if self.paged else 0
    return take

  def end(self, ended) -> None:
    for i in np.flatnonzero(ended):
      self.ended_at[self.seq[i]] = self.gen[i]
      p = self.seq[i] // self.samples_per_prompt
      if self.paged:
        self.free += self.own(i)
        self.users[p] -= 1
        if self.users[p] == 0:
          self.release_prompt(p)
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


def simulate(responses: np.ndarray, prompts: np.ndarray, *, samples_per_prompt: int, slots: int,
             min_slots: int = 1,
             paged: Paged | None = None, prompt_slots: int = 0, block: int = 512, cache_slots: int = 0,
             budget: int = 0) -> Load:
  """One queue's decode loop (module docstring): `responses` `[n]` its sequences' lengths in order, `prompts`
  `[n / group]` their prompts'; `slots` rows at first, shrinking to min_slots·2^k in the tail; `cache_slots`:
  the contiguous cache's slots (0: unbounded); `budget` > 0: stopped after that many steps that decoded a row
  (a partial rollout's round)."""
  q, t, decoded = _Queue(responses, prompts, samples_per_prompt=samples_per_prompt, slots=slots,
                         paged=paged), 0, 0
  rows, live, read, chunks, prefilled = [], [], [], [], []
  while q.remaining() and not 0 < budget <= decoded:  # The budget counts the steps that decoded a row.
    blocked = False
    if paged:
      blocked = q.preempt() if q.need() > q.free else False
      q.begin(t, blocked)
      ran, tokens = q.chunk()
      chunks.append(ran)
      prefilled.append(tokens)
    need = q.need() if paged else 0  # The live rows' pages, then one for each row just taken.
    take = q.admit(t, blocked)
    running = q.seq >= 0
    if paged:
      q.free -= need + take
      q.peak = max(q.peak, paged.queue_pages - q.free)
      read.append(paged_attention.read_tokens(q.held[running] + 1, page_tokens=q.tg,
                                              block_pages=paged.block_pages))
    else:
      query = prompt_slots + np.append(q.gen[running],
                                       0)  # No live row: the first block is read all the same.
      read.append(decode_attention.read_tokens(query, rows=q.rows, block=block, slots=cache_slots or None))
    rows.append(q.rows)
    live.append(int(running.sum()))
    decoded += bool(running.any())
    q.held[running] += 1
    q.gen[running] += 1
    q.end(running & (q.gen >= q.responses[np.maximum(q.seq, 0)]))
    q.shrink(min_slots)
    t += 1
  array = lambda x: np.asarray(x, np.int64) if paged else None
  return Load(np.asarray(rows), np.asarray(live), np.asarray(read, np.float64), q.preemptions, q.recomputed,
              q.peak, q.holding(), q.prefills, array(chunks), array(prefilled), array(q.prefilled))
