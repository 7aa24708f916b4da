"""Partial rollouts: the decode stops at a step budget, and the sequences still decoding carry over.

Under a long-tailed length profile the rollout lasts as long as its longest response. With
`rollout.decode_budget` = D, a rollout *round* decodes at most D steps; a sequence still decoding then is
carried: its tokens so far (with their log-probs and the policy version that sampled each) stay on the host,
and the next round continues it from there.

  carry = Carry(group=G, sequences=2·P·G, max_response_tokens=Tr, max_staleness=k, pad_id=0, prompt_width=Tp')
  groups, restarted, rounds = carry.step(version, P, draw, decode)   # an RL step's rounds, P complete groups
    # each round: call = carry.next_call(draw); carry.record(call, *decode(call), version=version)

- **A round** decodes `OVERPROVISION` × P·G sequences (`next_call`) in the slots of P·G: the carried ones first,
  then the members of new groups drawn whole from the prompts; a slot freed before the budget takes the next
  sequence, so the slots stay full to the budget (the ones not reached wait, with no tokens, for the next round).
  A carried sequence's prompt is its problem's prompt followed by its tokens so far: the round prefills it under
  the current weights (its keys and values are the current policy's) and decodes on from there. Sequence `i` of
  the run samples its token t with `fold_in(fold_in(key, i), t)` (`resumed.Resumed`), so with the weights
  unchanged a sequence stopped and continued gives the tokens of one never stopped.
- **Complete groups only** are trained on: group baselines, the values' returns and the verifier need every
  member. A step trains on exactly P groups, the P oldest complete ones; it runs rounds, under its one set of
  weights, until P are complete (the batch keeps the size of an unbudgeted step: P prompts × G). Complete groups
  beyond P wait for the next step.
- **Bounded staleness.** A token sampled by policy version u and trained at version v is v − u versions old.
  At the start of step v every member whose first token is older than `max_staleness` versions restarts from
  its prompt (its tokens dropped, the preemption's path), so no trained token is older than k versions.
  `(k + 1) · D ≥ Tr` (checked by the config) lets a restarted sequence, started first in a round, finish.
- **Nothing lost on a stop**: `state_dict` holds every group in flight (JSON), saved with the checkpoint.

Pure host code (NumPy); `Experience.sample` runs the rounds on the devices.
"""

import dataclasses
from collections.abc import Callable

import jax
import numpy as np

from vapo_jax import distributed
from vapo_jax.rollout import common
from vapo_jax.rollout.refill import engine as refill
from vapo_jax.rollout.refill import resumed as resumed_lib

OVERPROVISION = 2  # A round's sequences per slot of an unbudgeted step's P·G.


@dataclasses.dataclass
class Member:
  """One sequence of a group in flight: its tokens so far, their log-probs and the versions that sampled them."""

  id: int  # Its sequence number in the run (its sampling key's).
  tokens: list[int] = dataclasses.field(default_factory=list)
  sampler: list[float] = dataclasses.field(default_factory=list)
  policy: list[float] = dataclasses.field(default_factory=list)
  versions: list[int] = dataclasses.field(default_factory=list)
  finish: int = -1  # common.FINISH_STOP or FINISH_LENGTH once ended; -1 while decoding or not started.

  @property
  def ended(self) -> bool:
    return self.finish >= 0

  def restart(self) -> None:
    self.tokens, self.sampler, self.policy, self.versions, self.finish = [], [], [], [], -1


@dataclasses.dataclass
class Group:
  """A prompt's G sequences, admitted together; `record` is the caller's (a JSON-able list, e.g. a `Record`)."""

  record: list
  prompt: list[int]  # The prompt's token ids.
  members: list[Member]

  @property
  def complete(self) -> bool:
    return all(m.ended for m in self.members)


@dataclasses.dataclass(frozen=True)
class Call:
  """A round's sequences: (group, member) pairs in call order, and the arrays the refill engine takes."""

  members: list[tuple[int, int]]
  prompt_tokens: np.ndarray  # [N, Tp'] int32 left-padded: the prompt, then the tokens so far.
  prompt_mask: np.ndarray  # [N, Tp'] bool.
  ids: np.ndarray  # [N] int32 sequence numbers.
  offsets: np.ndarray  # [N] int32 tokens so far.
  limits: np.ndarray  # [N] int32 tokens left to the cap (≥ 1).


class Carry:
  """The groups in flight between rounds and steps (module docstring)."""

  def __init__(self, *, group: int, sequences: int, max_response_tokens: int, max_staleness: int, pad_id: int,
               prompt_width: int):
    self.group, self.sequences, self.max_response_tokens = group, sequences, max_response_tokens
    self.max_staleness, self.pad_id, self.prompt_width = max_staleness, pad_id, prompt_width
    self.groups: list[Group] = []
    self.next_id = 0  # The next new sequence's number.

  def pending(self) -> list[tuple[int, int]]:
    """(group, member) of every sequence not ended: the started ones first, then the rest, each in group order."""
    started, fresh = [], []
    for g, group in enumerate(self.groups):
      for j, m in enumerate(group.members):
        if not m.ended:
          (started if m.tokens else fresh).append((g, j))
    return started + fresh

  def restart_stale(self, version: int) -> int:
    """Restarts every member whose first token is more than `max_staleness` versions older than `version`;
    returns how many."""
    restarted = 0
    for group in self.groups:
      for m in group.members:
        if m.versions and version - m.versions[0] > self.max_staleness:
          m.restart()
          restarted += 1
    return restarted

  def next_call(self, draw: Callable[[int], list[tuple[list, list[int]]]]) -> Call:
    """The next round's `sequences` sequences; `draw(n)` gives n new groups' (record, prompt tokens), drawn
    whole while fewer are pending."""
    while len(self.pending()) < self.sequences:
      need = -(-(self.sequences - len(self.pending())) // self.group)
      for record, prompt in draw(need):
        ids = range(self.next_id, self.next_id + self.group)
        self.groups.append(Group(list(record), list(prompt), [Member(i) for i in ids]))
        self.next_id += self.group
    members = self.pending()[:self.sequences]
    width = self.prompt_width
    tokens = np.full((len(members), width), self.pad_id, np.int32)
    mask = np.zeros((len(members), width), bool)
    ids, offsets = np.zeros(len(members), np.int32), np.zeros(len(members), np.int32)
    for n, (g, j) in enumerate(members):
      m = self.groups[g].members[j]
      row = self.groups[g].prompt + m.tokens
      if len(row) > width:
        raise ValueError(f"sequence {m.id}: {len(row)} prompt and carried tokens over the call's width {width}")
      tokens[n, width - len(row):], mask[n, width - len(row):] = row, True
      ids[n], offsets[n] = m.id, len(m.tokens)
    return Call(members, tokens, mask, ids, offsets, (self.max_response_tokens - offsets).astype(np.int32))

  def record(self, call: Call, tokens: np.ndarray, sampler: np.ndarray, policy: np.ndarray, held: np.ndarray,
             finish: np.ndarray, version: int) -> None:
    """A round's results `[N, Tr]` / `[N]` (host): each sequence's new tokens up to `held`, and whether it
    ended (`finish` not `common.FINISH_UNFINISHED`); a sequence preempted and not restarted holds 0."""
    for n, (g, j) in enumerate(call.members):
      m, k = self.groups[g].members[j], int(held[n])
      m.tokens += tokens[n, :k].tolist()
      m.sampler += sampler[n, :k].tolist()
      m.policy += policy[n, :k].tolist()
      m.versions += [version] * k
      if finish[n] != common.FINISH_UNFINISHED:
        m.finish = int(finish[n])

  def take_complete(self, count: int) -> list[Group] | None:
    """The `count` oldest complete groups, removed from the carry; None while fewer are complete."""
    done = [i for i, g in enumerate(self.groups) if g.complete][:count]
    if len(done) < count:
      return None
    taken = [self.groups[i] for i in done]
    self.groups = [g for i, g in enumerate(self.groups) if i not in set(done)]
    return taken

  def step(self, version: int, count: int, draw: Callable, decode: Callable) -> tuple[list[Group], int, int]:
    """One RL step at policy version `version`: the stale restarted, then rounds (`next_call` with `draw`;
    `decode(call)` → the round's (tokens, sampler, policy, held, finish), `record`ed) until `count` groups are
    complete. Returns (those groups, the sequences restarted, the rounds run)."""
    restarted, rounds = self.restart_stale(version), 0
    while (groups := self.take_complete(count)) is None:
      call = self.next_call(draw)
      self.record(call, *decode(call), version=version)
      rounds += 1
    return groups, restarted, rounds

  def carried(self) -> int:
    """Sequences holding tokens that have not ended: what the next step continues."""
    return sum(bool(m.tokens) and not m.ended for g in self.groups for m in g.members)

  def state_dict(self) -> dict:
    return {"next_id": self.next_id,
            "groups": [{"record": g.record, "prompt": g.prompt, "members": [dataclasses.asdict(m) for m in g.members]}
                       for g in self.groups]}

  def load_state_dict(self, state: dict) -> None:
    self.next_id = int(state["next_id"])
    self.groups = [Group(list(g["record"]), list(g["prompt"]), [Member(**m) for m in g["members"]])
                   for g in state["groups"]]


def batch_arrays(groups: list[Group], *, max_response_tokens: int, pad_id: int, version: int) -> dict[str, np.ndarray]:
  """The trained rows of complete `groups` (B = groups × G, each group's members contiguous) as host arrays: the
  fields of a `common.Rollout` and `stale` `[B]`, each row's tokens sampled before `version`."""
  members = [(g, m) for g in groups for m in g.members]
  b, max_response_tokens = len(members), max_response_tokens
  prompts, prompt_mask = common.pad_prompts([g.prompt for g, _ in members], pad_id=pad_id)
  tokens = np.full((b, max_response_tokens), pad_id, np.int32)
  sampler, policy = np.zeros((b, max_response_tokens), np.float32), np.zeros((b, max_response_tokens), np.float32)
  lengths, finish, stale = np.zeros(b, np.int32), np.zeros(b, np.int32), np.zeros(b, np.int32)
  for n, (_, m) in enumerate(members):
    k = len(m.tokens)
    tokens[n, :k], sampler[n, :k], policy[n, :k] = m.tokens, m.sampler, m.policy
    lengths[n], finish[n] = k, m.finish
    stale[n] = sum(u < version for u in m.versions)
  mask = np.arange(max_response_tokens)[None] < lengths[:, None]
  return dict(prompt_tokens=prompts, prompt_mask=prompt_mask, response_tokens=tokens, response_mask=mask,
              response_lengths=lengths, finish_reason=finish, sampler_logprobs=sampler, policy_logprobs=policy,
              stale=stale)


def decode_round(model, call: Call, key: jax.Array, *, plan, sampling: common.Sampling, budget: int, pad_id: int,
                 cache_dtype, jit: Callable, place: Callable):
  """One round on the devices: the refill engine as `plan` (a budgeted `RolloutPlan` of the call, one sequence per
  prompt) says, over `call`'s sequences, stopped at `budget` decode steps. Returns the host arrays (tokens,
  sampler, policy `[N, Tr]`; held, finish `[N]`), the decode steps and the rows decoded (Σ slots × steps), and
  the engine's figures."""
  resumed = resumed_lib.Resumed(*place((call.ids, call.offsets, np.asarray(budget, np.int32))))
  tokens, mask, key = place((call.prompt_tokens, call.prompt_mask, key))
  out, steps, row_steps, figures = refill.generate_refill(
      model, tokens, mask, key, plan=plan, sampling=sampling, pad_id=pad_id, cache_dtype=cache_dtype, jit=jit,
      length_limits=place(call.limits), resumed=resumed)
  host = distributed.to_host((out.response_tokens, out.sampler_logprobs, out.policy_logprobs, out.response_lengths,
                              out.finish_reason))
  return tuple(np.asarray(x) for x in host), steps, row_steps, figures


def prompt_width(max_prompt_tokens: int, max_response_tokens: int) -> int:
  """The prompt bucket of every round: a prompt and up to Tr − 1 carried tokens (one program for the run)."""
  return common.prompt_bucket(max_prompt_tokens + max_response_tokens - 1)


def stale_token_frac(stale: np.ndarray, lengths: np.ndarray) -> float:
  return float(np.sum(stale) / max(int(np.sum(lengths)), 1))
