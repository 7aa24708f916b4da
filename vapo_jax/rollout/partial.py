"""Partial rollouts: the decode stops at a step budget, and the sequences still decoding carry over.

Under a long-tailed length profile the rollout lasts as long as its longest response. With
`rollout.decode_budget` = D, a rollout *round* decodes at most D steps; a sequence still decoding then is
carried: its tokens so far (with their log-probs and the policy version that sampled each) stay on the host,
and the next round continues it from there.

  plan = plan_round(config.rollout, ...)                             # `rollout/plan.py`: the round's sizes
  carry = Carry(samples_per_prompt=G, sequences=plan.prompts, max_response_tokens=Tr, max_staleness=k, pad_id=0,
                prompt_width=plan.prompt_tokens)
  groups, restarted, rounds = carry.step(version, P, draw, decode, queues=Q)   # an RL step's rounds: P groups
    # each round: call = carry.next_call(draw, queues=Q); carry.record(call, *decode(call), version=version)
  batch = carry.batch_arrays(groups, version=version)                          # the trained rows, then freed

- **A round** decodes `plan.OVERPROVISION` × P·G sequences (`next_call`; its plan: `plan.plan_round`) in the
  slots of P·G: the carried ones first, then the members of new groups drawn whole from the prompts; a slot
  freed before the budget takes the next sequence, so the slots stay full to the budget (the ones not reached
  wait, with no tokens, for the next round). A carried sequence's prompt is its problem's prompt followed by
  its tokens so far: the round prefills it under the current weights (its keys and values are the current
  policy's) and decodes on from there. Sequence `i` of the run samples its token t with `fold_in(fold_in(key,
  i), t)` (`resumed.Resumed`), so with the weights unchanged a sequence stopped and continued gives the tokens
  of one never stopped.
- **Every queue its share of the oldest.** The engine's queue q serves the call's sequences [q·N/Q,
  (q+1)·N/Q); the call deals the pending sequences, oldest first, round-robin over the Q queues, so the
  carried ones spread over every data-parallel group rather than crowding the first.
- **Complete groups only** are trained on: group baselines, the values' returns and the verifier need every
  member. A step trains on exactly P groups, the P oldest complete ones; it runs rounds, under its one set of
  weights, until P are complete (the batch keeps the size of an unbudgeted step: P prompts × G). Complete
  groups beyond P wait for the next step.
- **Bounded staleness.** A token sampled by policy version u and trained at version v is v − u versions old.
  At the start of step v every member whose first token is older than `max_staleness` versions restarts from
  its prompt (its tokens dropped, the preemption's path), so no trained token is older than k versions.
  `(k + 1) · D ≥ Tr` (checked by the config) lets a restarted sequence, started first in a round, finish.

The carry is arrays: each member's tokens, sampler and policy log-probs and versions in preallocated NumPy
buffers `[M, Tr]` beside its length and finish (grown by doubling when more members are in flight), and each
group's record, prompt and rows. A round's call and results move whole sequences (slices), never a token at a
time. `state_dict` gives its counters (JSON) and its arrays, saved as arrays in the checkpoint: nothing lost
on a stop. The host side of a round; `decode_round` runs it on the devices.
"""

import dataclasses
import json
from collections.abc import Callable

import jax
import numpy as np

from vapo_jax import distributed
from vapo_jax.rollout import common
from vapo_jax.rollout.refill import engine as refill
from vapo_jax.rollout.refill import resumed as resumed_lib

_BUFFERS = {"tokens": np.int32, "sampler": np.float32, "policy": np.float32, "versions": np.int32}


@dataclasses.dataclass
class Group:
  """A prompt's G sequences in flight: its record (JSON-able, the caller's), prompt token ids and buffer rows."""

  record: list
  prompt: np.ndarray  # [Tp] int32.
  rows: np.ndarray  # [G] the carry's rows of its members, in member order.


@dataclasses.dataclass(frozen=True)
class Call:
  """A round's sequences: the carry's rows in call order, and the arrays the refill engine takes."""

  rows: np.ndarray  # [N] int.
  prompt_tokens: np.ndarray  # [N, Tp'] int32 left-padded: the prompt, then the tokens so far.
  prompt_mask: np.ndarray  # [N, Tp'] bool.
  ids: np.ndarray  # [N] int32 sequence numbers.
  offsets: np.ndarray  # [N] int32 tokens so far.
  limits: np.ndarray  # [N] int32 tokens left to the cap (≥ 1).


class Carry:
  """The groups in flight between rounds and steps (module docstring)."""

  def __init__(self, *, samples_per_prompt: int, sequences: int, max_response_tokens: int, max_staleness: int,
               pad_id: int, prompt_width: int):
    self.samples_per_prompt, self.sequences = samples_per_prompt, sequences
    self.max_response_tokens = max_response_tokens
    self.max_staleness, self.pad_id, self.prompt_width = max_staleness, pad_id, prompt_width
    self.groups: list[Group] = []
    self.next_id = 0  # The next new sequence's number.
    self.capped = 0  # Sequences ended at a lowered cap by the last `load_state_dict`.
    self._allocate(0)

  def _allocate(self, rows: int) -> None:
    """Empty buffers of `rows` members."""
    self.buffers = {name: np.zeros((rows, self.max_response_tokens), dtype) for name,
                    dtype in _BUFFERS.items()}
    self.length, self.finish = np.zeros(rows, np.int32), np.full(rows, -1, np.int32)
    self.ids, self.used = np.zeros(rows, np.int64), np.zeros(rows, bool)

  def _take_rows(self, count: int) -> np.ndarray:
    """`count` free rows, the buffers doubled when too few are free."""
    free = np.flatnonzero(~self.used)
    if len(free) < count:
      old = len(self.used)
      grown = max(2 * old, old + count - len(free), self.sequences)
      kept = (self.buffers, self.length, self.finish, self.ids, self.used)
      self._allocate(grown)
      for name, buffer in kept[0].items():
        self.buffers[name][:old] = buffer
      for new, old_array in zip((self.length, self.finish, self.ids, self.used), kept[1:]):
        new[:old] = old_array
      free = np.flatnonzero(~self.used)
    rows = free[:count]
    self.used[rows], self.length[rows], self.finish[rows] = True, 0, -1
    return rows

  def _rows(self) -> np.ndarray:
    """Every member's row, in group order."""
    return np.concatenate([g.rows for g in self.groups]) if self.groups else np.zeros(0, np.int64)

  def pending(self) -> np.ndarray:
    """The rows of every sequence not ended: the started ones first, then the rest, each in group order."""
    rows = self._rows()
    rows = rows[self.finish[rows] < 0]
    started = self.length[rows] > 0
    return np.concatenate([rows[started], rows[~started]])

  def restart_stale(self, version: int) -> int:
    """Restarts every member whose first token is more than `max_staleness` versions older than `version`;
    returns how many."""
    rows = self._rows()  # Ended ones too: their group is not complete yet, and their first token ages the same.
    stale = rows[(self.length[rows] > 0) & (version - self.buffers["versions"][rows, 0] > self.max_staleness)]
    self.length[stale], self.finish[stale] = 0, -1
    return len(stale)

  def next_call(self, draw: Callable[[int], list[tuple[list, list[int]]]], *, queues: int = 1) -> Call:
    """The next round's `sequences` sequences, dealt round-robin over `queues` queues; `draw(n)` gives n new
    groups' (record, prompt tokens), drawn whole while fewer are pending."""
    while len(pending := self.pending()) < self.sequences:
      for record, prompt in draw(-(-(self.sequences - len(pending)) // self.samples_per_prompt)):
        rows = self._take_rows(self.samples_per_prompt)
        self.ids[rows] = np.arange(self.next_id, self.next_id + self.samples_per_prompt)
        self.next_id += self.samples_per_prompt
        self.groups.append(Group(list(record), np.asarray(prompt, np.int32), rows))
    picked = pending[:self.sequences]
    rows = picked.reshape(-1, queues).T.reshape(-1)  # Queue q's share: the q-th, (q + Q)-th, ... oldest.
    prompts = {int(r): g.prompt for g in self.groups for r in g.rows}
    width, n = self.prompt_width, len(rows)
    tokens, mask = np.full((n, width), self.pad_id, np.int32), np.zeros((n, width), bool)
    offsets = self.length[rows].astype(np.int32)
    for i, (r, k) in enumerate(zip(rows, offsets)):  # Whole sequences: a prompt and its tokens, slices.
      prompt = prompts[int(r)]
      start = width - len(prompt) - k
      if start < 0:
        raise ValueError(f"sequence {self.ids[r]}: {len(prompt) + k} prompt and carried tokens over the "
                         f"call's width {width}")
      tokens[i, start:start + len(prompt)], tokens[i, width - k:] = prompt, self.buffers["tokens"][r, :k]
      mask[i, start:] = True
    return Call(rows, tokens, mask, self.ids[rows].astype(np.int32), offsets,
                (self.max_response_tokens - offsets).astype(np.int32))

  def record(self, call: Call, tokens: np.ndarray, sampler: np.ndarray, policy: np.ndarray, held: np.ndarray,
             finish: np.ndarray, version: int) -> None:
    """A round's results `[N, Tr]` / `[N]` (host): each sequence's new tokens up to `held`, and whether it
    ended (`finish` not `common.FINISH_UNFINISHED`); a sequence preempted and not restarted holds 0."""
    new = {"tokens": tokens, "sampler": sampler, "policy": policy}
    for i, (r, k) in enumerate(zip(call.rows, np.asarray(held, np.int64))):
      start = self.length[r]
      if k + start > self.max_response_tokens:
        raise ValueError(f"sequence {self.ids[r]}: {start} + {k} tokens over the cap "
                         f"{self.max_response_tokens}")
      for name, source in new.items():
        self.buffers[name][r, start:start + k] = source[i, :k]
      self.buffers["versions"][r, start:start + k] = version
    self.length[call.rows] += np.asarray(held, np.int32)
    ended = np.asarray(finish) != common.FINISH_UNFINISHED
    self.finish[call.rows[ended]] = np.asarray(finish)[ended]

  def take_complete(self, count: int) -> list[Group] | None:
    """The `count` oldest complete groups, removed from the carry (their rows read by `batch_arrays`, which
    frees them); None while fewer are complete."""
    if not self.groups:
      return None
    complete = np.all(self.finish[np.stack([g.rows for g in self.groups])] >= 0, axis=1)
    done = np.flatnonzero(complete)[:count]
    if len(done) < count:
      return None
    taken = [self.groups[i] for i in done]
    self.groups = [g for g, c in zip(self.groups, np.isin(np.arange(len(self.groups)), done)) if not c]
    return taken

  def batch_arrays(self, groups: list[Group], *, version: int) -> dict[str, np.ndarray]:
    """The trained rows of complete `groups` (B = groups × G, each group's members contiguous) as host arrays:
    the fields of a `common.Rollout` and `stale` `[B]`, each row's tokens sampled before `version`; their rows
    freed."""
    rows = np.concatenate([g.rows for g in groups])
    prompts, prompt_mask = common.pad_prompts([g.prompt.tolist() for g in groups for _ in g.rows],
                                              pad_id=self.pad_id)
    lengths = self.length[rows].copy()
    mask = np.arange(self.max_response_tokens)[None] < lengths[:, None]
    take = lambda name, fill: np.where(mask, self.buffers[name][rows], fill)
    out = dict(prompt_tokens=prompts, prompt_mask=prompt_mask, response_tokens=take("tokens", self.pad_id),
               response_mask=mask, response_lengths=lengths, finish_reason=self.finish[rows].copy(),
               sampler_logprobs=take("sampler", 0.0), policy_logprobs=take("policy", 0.0),
               stale=np.sum(mask & (self.buffers["versions"][rows] < version), axis=1, dtype=np.int32))
    self.used[rows] = False
    return out

  def step(self, version: int, count: int, draw: Callable, decode: Callable, *,
           queues: int = 1) -> tuple[list[Group], int, int]:
    """One RL step at policy version `version`: the stale restarted, then rounds (`next_call` with `draw` over
    `queues` queues; `decode(call)` → the round's (tokens, sampler, policy, held, finish), `record`ed) until
    `count` groups are complete. Returns (those groups, the sequences restarted, the rounds run)."""
    restarted, rounds = self.restart_stale(version), 0
    while (groups := self.take_complete(count)) is None:
      call = self.next_call(draw, queues=queues)
      self.record(call, *decode(call), version=version)
      rounds += 1
    return groups, restarted, rounds

  def carried(self) -> int:
    """Sequences holding tokens that have not ended: what the next step continues."""
    rows = self._rows()
    return int(np.sum((self.length[rows] > 0) & (self.finish[rows] < 0)))

  def _compact(self) -> None:
    """The members in group order at rows [0, n), one buffer at a time (`state_dict` then saves views)."""
    rows = self._rows()
    if np.array_equal(rows, np.arange(len(rows))):
      return
    for name in _BUFFERS:
      self.buffers[name][:len(rows)] = self.buffers[name][rows]  # One buffer's members in flight at a time.
    for array in (self.length, self.finish, self.ids):
      array[:len(rows)] = array[rows]
    self.used[:] = np.arange(len(self.used)) < len(rows)
    start = 0
    for g in self.groups:
      g.rows, start = np.arange(start, start + len(g.rows)), start + len(g.rows)

  def state_dict(self) -> tuple[dict, dict[str, np.ndarray]]:
    """(counters, arrays): the JSON record's counters and shapes, and every group in flight as arrays (members
    in group order, whole rows: views of the buffers; the records as UTF-8 JSON bytes)."""
    self._compact()
    rows, width = self._rows(), self.max_response_tokens  # Whole rows: views of the buffers, and back the same.
    prompts = [g.prompt for g in self.groups]
    prompt_width = max((len(p) for p in prompts), default=1)
    prompt_tokens = np.full((len(prompts), prompt_width), self.pad_id, np.int32)
    for i, p in enumerate(prompts):
      prompt_tokens[i, :len(p)] = p
    records = np.frombuffer(json.dumps([g.record for g in self.groups]).encode(), np.uint8)
    arrays = {name: self.buffers[name][:len(rows), :width] for name in _BUFFERS} | {
        "length": self.length[rows], "finish": self.finish[rows], "ids": self.ids[rows],
        "prompt_tokens": prompt_tokens, "prompt_lengths": np.asarray([len(p) for p in prompts], np.int32),
        "records": records}
    counters = {"next_id": self.next_id, "groups": len(self.groups), "width": width,
                "prompt_width": prompt_width,
                "record_bytes": len(records)}
    return counters, arrays

  @staticmethod
  def array_shapes(counters: dict, samples_per_prompt: int) -> dict[str, tuple[tuple, np.dtype]]:
    """The shapes and dtypes of `state_dict`'s arrays, from its counters (a checkpoint's restore target)."""
    n, width = int(counters["groups"]) * samples_per_prompt, int(counters["width"])
    return {name: ((n, width), np.dtype(dtype)) for name, dtype in _BUFFERS.items()} | {
        "length": ((n,), np.dtype(np.int32)), "finish": ((n,), np.dtype(np.int32)),
        "ids": ((n,), np.dtype(np.int64)),
        "prompt_tokens": ((int(counters["groups"]), int(counters["prompt_width"])), np.dtype(np.int32)),
        "prompt_lengths": ((int(counters["groups"]),), np.dtype(np.int32)),
        "records": ((int(counters["record_bytes"]),), np.dtype(np.uint8))}

  def load_state_dict(self, counters: dict, arrays: dict[str, np.ndarray]) -> None:
    """The carry of `state_dict`; a `ValueError` naming what is wrong when the two do not fit each other
    (nothing is changed then). Under a lower `max_response_tokens` than the save's, a sequence holding the new
    cap or more is cut there and ends with finish reason "length" (`capped`: how many)."""
    if not int(counters["groups"]):  # Nothing in flight: no arrays were saved.
      self.groups, self.next_id, self.capped = [], int(counters["next_id"]), 0
      self._allocate(0)
      return
    shapes = self.array_shapes(counters, self.samples_per_prompt)
    for name, (shape, _) in shapes.items():
      got = arrays.get(name)
      if got is None or tuple(np.shape(got)) != shape:
        raise ValueError(f"the carry's {name!r} is {None if got is None else np.shape(got)}, expected {shape}")
    records = json.loads(bytes(np.asarray(arrays["records"], np.uint8)).decode())
    lengths, width = np.asarray(arrays["length"], np.int32), int(counters["width"])
    finish = np.asarray(arrays["finish"], np.int32)
    if len(records) != int(counters["groups"]) or not all(isinstance(r, list) for r in records):
      raise ValueError(f"the carry's records are not {counters['groups']} lists")
    if lengths.min(initial=0) < 0 or lengths.max(initial=0) > width:
      raise ValueError(f"the carry's lengths are outside [0, {width}]")
    cap = self.max_response_tokens  # A cap lowered since the save: a sequence that reached it ends there ("length").
    self.capped = int(np.sum((lengths >= cap) & (finish < 0)))
    finish = np.where((lengths >= cap) & (finish < 0), common.FINISH_LENGTH, finish)
    lengths, width = np.minimum(lengths, cap), min(width, cap)
    n = len(lengths)
    whole = int(counters["width"]) == self.max_response_tokens
    self._allocate(0 if whole else max(n, self.sequences))
    for name, dtype in _BUFFERS.items():
      given = arrays[name]
      if whole:  # Whole rows of the cap: the restored arrays are the buffers (no second copy).
        self.buffers[name] = np.require(given, dtype, ["C", "W"])
      else:
        self.buffers[name][:n, :width] = given[:, :width]
    if whole:
      self.length, self.finish, self.ids, self.used = (np.zeros(n, np.int32), np.full(n, -1, np.int32),
                                                       np.zeros(n, np.int64), np.zeros(n, bool))
    self.length[:n], self.finish[:n] = lengths, finish
    self.ids[:n], self.used[:n] = arrays["ids"], True
    prompt_lengths = np.asarray(arrays["prompt_lengths"])
    self.groups = [Group(record, np.asarray(arrays["prompt_tokens"][i, :prompt_lengths[i]], np.int32),
                         np.arange(i * self.samples_per_prompt, (i + 1) * self.samples_per_prompt)) for i,
                   record in enumerate(records)]
    self.next_id = int(counters["next_id"])


def decode_round(model, call: Call, key: jax.Array, *, plan, sampling: common.Sampling, budget: int,
                 pad_id: int, cache_dtype, jit: Callable, place: Callable):
  """One round on the devices: the refill engine as `plan` (a budgeted `RolloutPlan` of the call, one sequence
  per prompt) says, over `call`'s sequences, stopped at `budget` decode steps. Returns the host arrays
  (tokens, sampler, policy `[N, Tr]`; held, finish `[N]`), the decode steps and the rows decoded (Σ slots ×
  steps), and the engine's figures."""
  resumed = resumed_lib.Resumed(*place((call.ids, call.offsets, np.asarray(budget, np.int32))))
  tokens, mask, key = place((call.prompt_tokens, call.prompt_mask, key))
  out, steps, row_steps, figures = refill.generate_refill(
      model, tokens, mask, key, plan=plan, sampling=sampling, pad_id=pad_id, cache_dtype=cache_dtype, jit=jit,
      length_limits=place(call.limits), resumed=resumed)
  host = distributed.to_host((out.response_tokens, out.sampler_logprobs, out.policy_logprobs,
                              out.response_lengths, out.finish_reason))
  return tuple(np.asarray(x) for x in host), steps, row_steps, figures


def stale_token_frac(stale: np.ndarray, lengths: np.ndarray) -> float:
  return float(np.sum(stale) / max(int(np.sum(lengths)), 1))
