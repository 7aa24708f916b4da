"""The rollout's plan: what one rollout call runs, decided once, from the config, the model, the call and the
devices.

  plan = plan_rollout(config.rollout, model_cfg, prompts=P, samples_per_prompt=G, prompt_tokens=Tp, dtype=...,
                      devices=D)
  out, metrics = rollout.sample(model, tokens, mask, key, sampling=..., plan=plan, ...)
  fns = plan.programs(sampling=..., pad_id=..., cache_dtype=..., jit=...)   # what `sample` and `make memory` run

`plan_rollout` is the one place that decides the engine and sizes it, and the one place that raises the KV
cache's `MemoryError` (naming the setting to change and a value that works):

- **static** (`rollout.engine="static"`): rounds of `rollout.prompts_per_generation` prompts, each one batch
  until its longest response ends; its KV cache must fit `rollout.kv_cache_budget_gib`.
- **refill** (`rollout.engine="refill"`, `rollout/refill/`): `slots` decode rows over a pool of pages, the
  prompts prefilled into pages as their samples are about to run (`prefill_lanes` lanes a queue, chunks of
  `prefill_chunk` tokens). The pool is sized per data-parallel group (`pages`, `rollout.pages`' meaning, or as
  many as `kv_cache_budget_gib` holds but no more than the slots need at the cap beside the prompts in flight:
  a slot's worth of each group in a slot and one prompt per lane); the slots are `rollout.slots`, or as many
  as that pool holds with every response at the cap. The pool must hold the call's longest prompt and one
  whole sequence (`common.check_pool`); past that, running out of pages costs recomputation, not a refusal.
  The sequences run in `queues` queues: the most dividing the groups, the prompts, the slots and `min_slots`,
  so each queue is a group's with its own devices; with fewer queues than groups every device holds every
  queue's pool (replicated), so a queue holds `pages / queues` (`queue_pages`). When every sequence has a slot
  and its queue's pool holds them all at the cap with every prompt, nothing would be refilled or paged: the
  static batch runs instead (the same tokens), unless the call is a partial rollout's round (`budgeted`),
  which only the refill engine can stop.
"""

import dataclasses
import math

import numpy as np

from vapo_jax.kinds import RolloutEngine
from vapo_jax.models import kv_cache, paged_attention, sharding
from vapo_jax.models.kv_cache import KVCache
from vapo_jax.rollout import common, static
from vapo_jax.rollout.refill import engine as refill
from vapo_jax.rollout.refill import queues as queues_lib

OVERPROVISION = 2  # A partial rollout's round: its sequences per slot of an unbudgeted step's P·G.


@dataclasses.dataclass(frozen=True, kw_only=True)
class RolloutPlan:
  """One rollout call's engine and sizes (a change compiles new programs)."""

  engine: RolloutEngine  # What runs: "static" or "refill".
  prompts: int  # P.
  samples_per_prompt: int  # G samples per prompt.
  prompt_tokens: int  # Tp: the prompt bucket.
  max_response_tokens: int  # Tr: the length cap.
  devices: int  # Data-parallel groups of the rollout layout.
  prompts_per_round: int  # static: prompts a round (P: one round).
  decode_block: int | None = None  # static: KV-cache slots per block of decode attention (None: per platform).
  slots: int = 0  # refill: decode rows, all queues.
  queues: int = 1  # refill: queues, each with its share of the slots, prompts, outputs and pages.
  min_slots: int = 0  # refill: in the tail the rows shrink to min_slots·2^k (0: never).
  steps_per_call: int = 256  # refill: decode iterations on the device per host call, at most.
  pages: int = 0  # refill: pages of the pool per data-parallel group (per device: every queue's share it holds).
  queue_pages: int = 0  # refill: pages each queue holds.
  page_tokens: int = 0  # refill: tokens per page.
  block_pages: int = 0  # refill: pages read per block of paged attention.
  attention: str = ""  # refill: paged attention's implementation (`paged_attention.IMPLEMENTATIONS`).
  least_pages: int = 0  # refill: the fewest pages per group `rollout.pages` may ask for (`common.check_pool`).
  lanes: int = 0  # refill: prefill lanes per queue.
  prefill_chunk: int = 0  # refill: tokens a lane prefills per iteration.

  @property
  def sequences(self) -> int:
    return self.prompts * self.samples_per_prompt

  @property
  def decode_groups(self) -> int:
    """The groups of rows that decode apart: the refill engine's queues; the static engine's data-parallel groups."""
    return self.queues if self.engine == "refill" else self.devices

  @property
  def rounds(self) -> int:
    """Static rounds (1 for the refill engine)."""
    return self.prompts // self.prompts_per_round if self.engine == "static" else 1

  @property
  def decode_rows(self) -> int:
    """Rows the decode loop runs at first: the slots, or a static round's sequences."""
    return self.slots if self.engine == "refill" else self.prompts_per_round * self.samples_per_prompt

  @property
  def prompt_pages(self) -> int:
    """refill: the pages of one prompt at the bucket."""
    return -(-self.prompt_tokens // self.page_tokens) if self.engine == "refill" else 0

  @property
  def pool_share(self) -> float:
    """refill: the share of a queue's slots its pool holds with every response at the cap, beside the prompts
    in flight (1: all of them; below 1 the engine can run out of pages and preempt)."""
    if self.engine != "refill":
      return 1.0
    slots = min(self.slots, self.sequences) // self.queues
    prompts = min(self.prompts // self.queues,
                  -(-slots // self.samples_per_prompt) + self.lanes) * self.prompt_pages
    return min(1.0,
               max(0, self.queue_pages - prompts) / (slots * common.sequence_pages(self.max_response_tokens,
                                                                                        self.page_tokens)))

  @property
  def preempts(self) -> bool:
    """Whether the engine can run out of pages and preempt (`pool_share` < 1)."""
    return self.pool_share < 1

  @property
  def shrink_sizes(self) -> list[int]:
    """refill: the slot counts the tail shrinks through."""
    return queues_lib.shrink_sizes(self.slots, self.min_slots) if self.engine == "refill" else []

  def programs(self, *, sampling: common.Sampling, pad_id: int, cache_dtype, jit, slots: int | None = None):
    """The programs the engine runs: refill, `engine.Programs` (start, decode, finish) at `slots` rows
    (default: `self.slots`; `shrink_sizes` the others; `engine.compaction` moves between them); static, its
    generate."""
    if self.engine == "static":
      return static.make_generate(sampling=sampling, samples_per_prompt=self.samples_per_prompt,
                                  pad_id=pad_id,
                                  cache_dtype=cache_dtype, decode_block=self.decode_block, jit=jit)
    return refill.programs(self, sampling=sampling, slots=slots, pad_id=pad_id, cache_dtype=cache_dtype,
                           jit=jit)


def _plan_static(r, model_cfg, base: dict, *, dtype) -> RolloutPlan:
  """The static engine's plan: rounds of `rollout.prompts_per_generation` prompts, their cache within the budget."""
  prompts = base["prompts"]
  per_round = min(r.prompts_per_generation or prompts, prompts)
  common.check_cache_fits(model_cfg, batch=per_round * base["samples_per_prompt"], prompt_tokens=base["prompt_tokens"],
                          max_response_tokens=base["max_response_tokens"], dtype=dtype, devices=base["devices"],
                          tensor=r.tensor_parallel, budget_bytes=int(r.kv_cache_budget_gib * 2**30))
  return RolloutPlan(engine="static", prompts_per_round=per_round, **base)


def plan_rollout(r, model_cfg, *, prompts: int, samples_per_prompt: int, prompt_tokens: int, dtype,
                 devices: int, platform: str | None = None, prompt_lengths=None, budgeted: bool = False,
                 slot_sequences: int | None = None) -> RolloutPlan:
  """The plan of a call of `prompts` × `samples_per_prompt` sequences of `prompt_tokens`-token (bucketed)
  prompts under the `RolloutConfig` `r`, split over `devices` data-parallel groups (each of
  `r.tensor_parallel` chips, which split the KV cache by heads), on `platform` (default: the one traced for,
  `sharding.platform()`). `prompt_lengths` `[P]`: the prompts' real tokens (default: every prompt at the
  bucket), which their queue's pages must hold. With fewer queues than groups, every device holds every
  queue's pool: `rollout.pages` is split over the queues, else each queue's pool holds its own slots at the
  cap, within the budget. `budgeted`: a partial rollout's round (the refill engine, whatever the sizes);
  `slot_sequences`: the sequences the slots are sized for (default: the call's). A `MemoryError` names what to
  change."""
  max_response_tokens, sequences = r.max_response_tokens, prompts * samples_per_prompt
  base = dict(prompts=prompts, samples_per_prompt=samples_per_prompt, prompt_tokens=prompt_tokens,
              max_response_tokens=max_response_tokens, devices=devices, decode_block=r.decode_block)
  if r.engine == "static":
    return _plan_static(r, model_cfg, base, dtype=dtype)
  platform = platform or sharding.platform()
  tg = r.page_tokens or common.default_page_tokens(platform)
  token_bytes = KVCache.bytes_per_token(model_cfg, dtype) / r.tensor_parallel
  in_budget = int(r.kv_cache_budget_gib * 2**30 // (tg * token_bytes))
  prompt_pages, per_sequence = -(-prompt_tokens // tg), common.sequence_pages(max_response_tokens, tg)
  lanes, per_group = r.prefill_lanes, -(-prompts // devices)
  if prompt_lengths is None:  # Every prompt at the bucket (the start-up check); else checked below.
    common.check_pool(queue_pages=r.pages or in_budget, held=prompt_pages,
                      max_response_tokens=max_response_tokens, page_tokens=tg, given=bool(r.pages))

  def in_flight(slots: int, prompts: int) -> int:
    """Pages of `slots` slots at the cap beside the prompts in flight of a queue of `prompts` prompts."""
    return slots * per_sequence + min(prompts, -(-slots // samples_per_prompt) + lanes) * prompt_pages
  pool = r.pages or in_budget
  fit = max(1, (pool - lanes * prompt_pages) * samples_per_prompt // (per_sequence * samples_per_prompt + prompt_pages))
  slots = r.slots or max(1, min(-(-(slot_sequences or sequences) // devices), fit)) * devices
  if slots % devices:
    raise MemoryError(f"rollout.slots={slots} does not split over the {devices} data-parallel groups (each "
                      f"decodes its own slots from its own pages): set rollout.slots="
                      f"{-(-slots // devices) * devices}, a multiple of {devices}")
  min_slots = devices if r.shrink_slots else 0
  queues = math.gcd(devices, prompts, slots, min_slots)
  slots = min(slots, -(-sequences // queues) * queues)
  whole = prompts // queues * prompt_pages + sequences // queues * per_sequence
  if queues < devices:  # Every device holds all Q queues' pools (replicated): a group's memory is Q shares.
    queue_pages = (r.pages // queues if r.pages
                   else min(in_budget // queues, in_flight(slots // queues, prompts // queues)))
    pages = queue_pages * queues
  else:
    pages = queue_pages = r.pages or min(in_budget, in_flight(slots // devices, per_group))
  if not budgeted and slots >= sequences and queue_pages >= whole:  # Nothing to refill or page.
    return RolloutPlan(engine="static", prompts_per_round=prompts, **base)
  lengths = np.full(prompts, prompt_tokens) if prompt_lengths is None else prompt_lengths
  common.check_pool(queue_pages=queue_pages, held=common.longest_prompt_pages(lengths, tg),
                    max_response_tokens=max_response_tokens, page_tokens=tg, given=bool(r.pages),
                    shares=queues if queues < devices else 1)
  return RolloutPlan(
      engine="refill", prompts_per_round=prompts, slots=slots, queues=queues, min_slots=min_slots,
      steps_per_call=r.decode_steps_per_call, pages=pages, queue_pages=queue_pages, page_tokens=tg,
      block_pages=r.block_pages or paged_attention.default_block_pages(tg, platform), least_pages=prompt_pages
      + per_sequence, attention=paged_attention.default_implementation(
          platform, head_dim=model_cfg.head_dim, page_tokens=tg, int8=kv_cache.quantized(dtype)),
      lanes=lanes, prefill_chunk=min(r.prefill_chunk, prompt_tokens), **base)


def round_width(r) -> int:
  """A partial rollout's round's prompt bucket: a prompt and up to Tr − 1 carried tokens (one program a run)."""
  return common.prompt_bucket(r.max_prompt_tokens + r.max_response_tokens - 1)


def plan_round(r, model_cfg, *, dtype, devices: int, platform: str | None = None) -> RolloutPlan:
  """The plan of a partial rollout's round (`rollout.decode_budget`, `rollout/partial.py`): `OVERPROVISION` ×
  P·G sequences, one per prompt (each a problem's prompt with its carried tokens, `round_width`), in the slots
  of an unbudgeted step's P·G, on the refill engine, which admits each to pages when it is about to run and
  prefills it in chunks. A `MemoryError` names what to change."""
  return plan_rollout(r, model_cfg, prompts=OVERPROVISION * r.responses_per_step, samples_per_prompt=1,
                      prompt_tokens=round_width(r), dtype=dtype, devices=devices, platform=platform,
                      budgeted=True, slot_sequences=r.responses_per_step)
