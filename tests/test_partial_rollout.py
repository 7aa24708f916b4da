"""Partial rollouts (rollout/partial.py): a rollout stopped at a decode budget and continued is the rollout never
stopped; trained groups are complete and no trained token is older than `max_staleness` versions."""

import dataclasses

import jax
import numpy as np
import pytest

from conftest import build_smoke_config
from model_utils import EOS, PROMPTS, place_module
from vapo_jax.config import RolloutConfig
from vapo_jax.errors import ConfigError
from vapo_jax.memory import topologies, xla_report, xla_report_text
from vapo_jax.rollout import RolloutPlan, common, partial
from vapo_jax.rollout.static import make_generate

GROUP, MAX_NEW = 3, 10


def _carry(sequences: int, *, max_staleness: int = 1) -> partial.Carry:
  width = common.prompt_bucket(max(map(len,
                                       PROMPTS)) + MAX_NEW - 1)  # A prompt and up to Tr − 1 carried tokens.
  return partial.Carry(samples_per_prompt=GROUP, sequences=sequences, max_response_tokens=MAX_NEW,
                       max_staleness=max_staleness, pad_id=0, prompt_width=width)


def _drawer():
  drawn = []

  def draw(n):
    out = [([str(len(drawn) + i)], PROMPTS[(len(drawn) + i) % len(PROMPTS)]) for i in range(n)]
    drawn.extend(out)
    return out
  return draw


# 14 pages of 2 tokens: a carried prefix (up to 8 pages) and a response (up to 6) are the least a pool may hold; it
# runs dry, and prompts are given back and prefilled again (make test); 120: it never does (make test-slow).
@pytest.mark.parametrize("pages", [pytest.param(120, marks=pytest.mark.slow), 14])
def test_stopped_at_the_budget_and_continued_is_the_rollout_never_stopped(model, pages):
  """4 prompts × 3 samples, the top-k/top-p sampler, a budget of 3 decode steps a round in 8 slots, each round's
  prompts and carried tokens prefilled in chunks of 3 as they take their pages: every sequence of the 4 groups has
  the unbudgeted rollout's tokens, log-probs, length and finish reason; every page comes back after every round."""
  spec = common.Sampling(max_response_tokens=MAX_NEW, stop_token_ids=(EOS,), temperature=1.3, top_k=5,
                         top_p=0.8)
  tokens, mask = common.pad_prompts(PROMPTS, pad_id=0)
  key = jax.random.key(3)
  reference = make_generate(sampling=spec, samples_per_prompt=GROUP, pad_id=0)(model, tokens, mask, key)
  carry, draw = _carry(len(PROMPTS) * GROUP), _drawer()
  plan = RolloutPlan(engine="refill", prompts=carry.sequences, samples_per_prompt=1,
                     prompt_tokens=carry.prompt_width,
                     max_response_tokens=MAX_NEW, devices=1, prompts_per_round=carry.sequences, slots=8,
                     min_slots=1,
                     steps_per_call=2, pages=pages, queue_pages=pages, page_tokens=2, block_pages=1,
                     attention="gather",
                     lanes=2, prefill_chunk=3)  # Carried prefixes of up to 16 tokens prefilled 3 at a time.
  place = lambda tree: jax.tree.map(jax.numpy.asarray, tree)
  rounds, peak, carried = 0, 0.0, 0
  while (groups := carry.take_complete(len(PROMPTS))) is None:
    call = carry.next_call(draw)
    host, steps, _, figures = partial.decode_round(model, call, key, plan=plan, sampling=spec, budget=3,
                                                   pad_id=0, cache_dtype=np.float32, jit=jax.jit, place=place)
    assert np.all(host[3] <= 3)  # At most the budget's 3 new tokens a round (its first steps may only prefill).
    carry.record(call, *host, version=0)
    assert figures["rollout/queue_pages_free_after"] == pages
    rounds, peak, carried = rounds + 1, max(peak, figures["rollout/queue_pages_peak"]), max(carried,
                                                                                            carry.carried())
  assert rounds >= 3 and carried > 0  # Responses up to 10 tokens at 3 a round: carried over at least twice.
  assert (peak == pages) == (pages == 14)
  assert [g.record for g in groups] == [["0"], ["1"], ["2"], ["3"]]
  got = carry.batch_arrays(groups, version=0)
  for field in ("response_tokens", "response_mask", "response_lengths", "finish_reason"):
    np.testing.assert_array_equal(got[field], np.asarray(getattr(reference, field)), err_msg=field)
  for field in ("sampler_logprobs", "policy_logprobs"):  # Prefilled against decoded: float32 rounding only.
    np.testing.assert_allclose(got[field], np.asarray(getattr(reference, field)), atol=1e-5, err_msg=field)
  assert np.all(got["stale"] == 0)
  lengths = np.asarray(reference.response_lengths)
  assert lengths.max() > 3 and 0 < np.mean(lengths < MAX_NEW) < 1


def _simulate(*, steps: int, budget: int, max_staleness: int, prompts: int = 3, seed: int = 0):
  """Partial rollouts over `steps` RL steps with a stand-in engine (each called sequence decodes up to `budget`
  more of its drawn length): each step's trained members (id, tokens, versions) and batch, the restarts and the
  drawn lengths."""
  rng = np.random.default_rng(seed)
  carry, draw = _carry(prompts * GROUP, max_staleness=max_staleness), _drawer()
  lengths = {}
  trained, restarted = [], 0

  def decode(call):
    n = len(call.rows)
    target = np.asarray([lengths.setdefault(int(i), int(rng.integers(1, MAX_NEW + 1))) for i in call.ids])
    held = np.minimum(target - call.offsets, budget)
    ended = call.offsets + held == target
    tokens = call.ids[:, None] * 100 + call.offsets[:,
                                                    None] + np.arange(MAX_NEW)[None]  # Token t of sequence i.
    finish = np.where(ended, common.FINISH_STOP, common.FINISH_UNFINISHED)
    return tokens, np.zeros((n, MAX_NEW)), np.zeros((n, MAX_NEW)), held, finish

  for version in range(steps):
    groups, restarts, _ = carry.step(version, prompts, draw, decode)
    members = [(int(carry.ids[r]), carry.buffers["tokens"][r, :carry.length[r]].tolist(),
                carry.buffers["versions"][r, :carry.length[r]].tolist(), bool(carry.finish[r] >= 0))
               for g in groups for r in g.rows]
    trained.append((version, groups, members, carry.batch_arrays(groups, version=version)))
    restarted += restarts
  return trained, restarted, lengths


@pytest.mark.parametrize("max_staleness", [0, 1, 3])
def test_trained_groups_are_complete_and_no_token_is_older_than_max_staleness(max_staleness):
  budget = -(-MAX_NEW // (max_staleness + 1))  # The smallest budget the config allows.
  trained, restarted, lengths = _simulate(steps=12, budget=budget, max_staleness=max_staleness)
  seen, stale = set(), 0
  for version, groups, members, arrays in trained:
    assert len(groups) == 3 and all(len(g.rows) == GROUP for g in groups) and len(members) == 3 * GROUP
    for i, tokens, versions, ended in members:
      assert ended and i not in seen  # Complete, and trained once.
      seen.add(i)
      assert len(tokens) == lengths[i] == len(versions)  # Whole: every token, none twice.
      assert tokens == [i * 100 + t for t in range(len(tokens))]
      assert all(0 <= version - u <= max_staleness for u in versions)
      stale += sum(u < version for u in versions)
    assert arrays["stale"].tolist() == [sum(u < version for u in v) for _, _, v, _ in members]
    assert arrays["response_lengths"].tolist() == [len(t) for _, t, _, _ in members]
  assert (stale > 0) == (max_staleness > 0)  # Tokens do carry over, when allowed.
  if max_staleness == 1:
    assert restarted > 0  # Budget 5, lengths up to 10: some sequences start late in a round and age out.


def test_the_carry_round_trips_through_its_counters_and_arrays():
  """`state_dict`: counters through JSON, arrays as they are (a checkpoint's); the copy continues as the original
  does. A lowered cap cuts the sequences that reached it; a damaged record is refused before anything changes."""
  import json
  carry, draw = _carry(3 * GROUP, max_staleness=2), _drawer()
  call = carry.next_call(draw)
  carry.record(call, np.ones((len(call.rows), MAX_NEW), np.int32), np.full((9, MAX_NEW), -0.1, np.float32),
               np.full((9, MAX_NEW), -0.2, np.float32), np.arange(9) % 4,
               np.full(9, common.FINISH_UNFINISHED), 0)
  counters, arrays = carry.state_dict()
  copy = _carry(3 * GROUP, max_staleness=2)
  copy.load_state_dict(json.loads(json.dumps(counters)), arrays)
  counters2, arrays2 = copy.state_dict()
  assert counters2 == counters and copy.next_id == 9 and copy.carried() == carry.carried() > 0
  for name in arrays:
    np.testing.assert_array_equal(arrays2[name], arrays[name], err_msg=name)
  again = copy.next_call(draw)
  np.testing.assert_array_equal(again.prompt_tokens, carry.next_call(draw).prompt_tokens)
  lowered = partial.Carry(samples_per_prompt=GROUP, sequences=9, max_response_tokens=2, max_staleness=2,
                          pad_id=0, prompt_width=16)
  lowered.load_state_dict(counters, arrays)  # Lengths 0..3: those at 2 or 3 reach the new cap of 2.
  assert lowered.capped == int(np.sum(arrays["length"] >= 2)) > 0 and lowered.length.max() == 2
  assert np.all(lowered.finish[lowered.length == 2] == common.FINISH_LENGTH)
  damaged = _carry(3 * GROUP)
  with pytest.raises(ValueError, match="the carry's 'length' is"):
    damaged.load_state_dict(counters, arrays | {"length": arrays["length"][:2]})
  assert damaged.groups == [] and damaged.next_id == 0


def test_a_budget_that_cannot_finish_a_restarted_response_is_refused():
  with pytest.raises(ConfigError, match=r"decode_budget × \(max_staleness \+ 1\) = 40 must reach "
                                        r"max_response_tokens"):
    RolloutConfig(max_response_tokens=64, decode_budget=20, max_staleness=1)
  with pytest.raises(ConfigError, match="engine must be 'refill'"):
    RolloutConfig(max_response_tokens=64, decode_budget=32, engine="static")
  RolloutConfig(max_response_tokens=64, decode_budget=32, max_staleness=1)


@pytest.mark.slow  # make test-slow, for time (make test's start-up checks plan the round: test_start_up_rollouts).
def test_a_partial_rollouts_round_is_compiled_and_checked(tmp_path):
  """With `rollout.decode_budget` the report also compiles a round: 2 × P·G sequences, one per prompt, each
  prompt a problem's with up to a response's carried tokens, in the slots of P·G, the decode taking the
  round's sequence numbers, offsets and budget; the run's verdict covers it."""
  config = build_smoke_config(tmp_path,
                              {"eval.path": None, "rollout.decode_budget": 8, "rollout.max_staleness": 1})
  report = xla_report.compile_run(config, topologies.named("v5p:2x2x1"),
                                  phases=("rollout", "partial rollout"))
  assert [p.name for p in report.phases] == ["rollout", "partial rollout"] and not report.over()
  phase = report.phases[1]
  r = config.rollout
  width = common.prompt_bucket(r.max_prompt_tokens + r.max_response_tokens - 1)
  assert f"a round of {2 * r.responses_per_step} sequences of up to {width} prompt" in phase.detail
  assert [p.name.split(" (")[0] for p in phase.programs] == ["start", "decode", "compaction", "finish"]
  assert all(p.memory is not None and p.needs > 0 for p in phase.programs)
  assert "partial rollout" in xla_report_text.table(report)


def _rounds_on(model, devices: int, *, steps: int = 10, budget: int = 4, prompts: int = 8):
  """Partial rollouts of `prompts` prompts × 4 samples a step over `devices` data-parallel devices, the round as its
  plan runs it (its slots in a queue per device, prefill lanes for every slot: the prefill never holds a slot back),
  each sequence stopping at its drawn length (a long tail of 1..16 tokens through `length_limits`): (the stale
  fraction of the trained tokens, rounds a step) after the first two steps."""
  from vapo_jax.models import sharding
  from vapo_jax.rollout.plan import plan_round

  r = RolloutConfig(prompts_per_step=prompts, samples_per_prompt=4, max_prompt_tokens=8,
                    max_response_tokens=16,
                    decode_budget=budget, max_staleness=3, page_tokens=4, decode_steps_per_call=8,
                    prefill_lanes=4 * prompts)
  plan = plan_round(r, model.cfg, dtype=np.float32, devices=devices)
  mesh, rules = sharding.make_mesh(data=devices, devices=jax.devices()[:devices]), sharding.PRESETS["dp"]
  sharded = place_module(model, mesh, rules)
  jit, place = (lambda fn,
                **kw: sharding.jit(fn, mesh, rules, **kw)), (lambda t: sharding.place(t, mesh, rules))
  spec = common.Sampling(max_response_tokens=16, stop_token_ids=(), temperature=1.0)
  carry = partial.Carry(samples_per_prompt=4, sequences=plan.prompts, max_response_tokens=16, max_staleness=3,
                        pad_id=0, prompt_width=plan.prompt_tokens)
  draw, lengths = _drawer(), np.random.default_rng(7).lognormal(1.2, 0.8, 4096).clip(1, 16).astype(int)

  def decode(call):
    limited = dataclasses.replace(call, limits=np.minimum(call.limits, lengths[call.ids] - call.offsets))
    host, *_ = partial.decode_round(sharded, limited, jax.random.key(5), plan=plan, sampling=spec,
                                    budget=budget, pad_id=0, cache_dtype=np.float32, jit=jit, place=place)
    return host

  stale, trained, rounds = 0, 0, 0
  for version in range(steps):
    groups, _, ran = carry.step(version, prompts, draw, decode, queues=plan.queues)
    batch = carry.batch_arrays(groups, version=version)
    if version >= 2:
      stale, trained, rounds = stale + batch["stale"].sum(), trained + batch["response_lengths"].sum(), rounds + ran
  assert plan.queues == devices
  return stale / trained, rounds / (steps - 2)


@pytest.mark.slow  # For time (20 s): make test deals a round over the queues (below).
def test_the_schedule_of_partial_rounds_does_not_depend_on_the_data_parallel_groups(model):
  """The carried sequences are dealt round-robin over the queues: on 2 and 4 devices (a queue each, 16 and 8 of the
  32 slots) the trained tokens' stale fraction and the rounds a step are one device's, within 0.05 and 1."""
  import warnings
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # The parity model's vocabulary does not split over 4 devices: replicated.
    one, *more = (_rounds_on(model, devices) for devices in (1, 2, 4))
  assert one[0] > 0  # Tokens are carried over.
  for devices, (frac, rounds) in zip((2, 4), more):
    assert abs(frac - one[0]) <= 0.05 and abs(rounds - one[1]) <= 1, (devices, frac, rounds, one)


def test_a_round_deals_its_oldest_sequences_round_robin_over_the_queues():
  """Queue q of Q serves the call's [q·N/Q, (q+1)·N/Q): each queue's share holds every Q-th pending sequence, so the
  carried ones (first in line) spread evenly rather than fill the first queue."""
  carry, draw = _carry(12), _drawer()
  call = carry.next_call(draw, queues=2)
  held = np.where(np.arange(12) < 6, 3, 0)  # Half of them carried over with 3 tokens each.
  carry.record(call, np.ones((12, MAX_NEW), np.int32), np.zeros((12, MAX_NEW)), np.zeros((12, MAX_NEW)), held,
               np.full(12, common.FINISH_UNFINISHED), 0)
  for queues in (1, 2, 3):
    call = carry.next_call(draw, queues=queues)
    carried = (call.offsets > 0).reshape(queues, -1).sum(axis=1)
    assert carried.tolist() == [6 // queues] * queues, (queues, carried)
    pending = carry.pending()[:12]
    np.testing.assert_array_equal(call.rows.reshape(queues, -1), pending.reshape(-1, queues).T)


@pytest.mark.slow  # Under a minute; make test runs aime's rehearsal (tensor-parallel groups, the refill engine).
def test_a_budgeted_run_with_tensor_parallel_rollout_groups_trains_on_two_devices(smoke_config):
  """`rollout.tensor_parallel=2` on 2 devices (one rollout group; the key and every input of a round placed in the
  rollout layout): the trainer's budgeted RL steps run and carry sequences over, every metric finite."""
  from vapo_jax.train.trainer import Trainer
  config = smoke_config({"rollout.decode_budget": 8, "rollout.max_staleness": 1, "rollout.tensor_parallel": 2,
                         "eval.path": None, "sft.steps": 0, "algo.value_pretrain_steps": 0, "rl_steps": 2})
  trainer = Trainer(config, devices=jax.devices()[:2], verbose=False, write_logs=False)
  assert trainer.layout.tensor_parallel == 2 and trainer.layout.data_devices == 1
  trainer.run()
  rl = [m for m in trainer.history if m["stage"] == "rl"]
  assert len(rl) == 2 and all(np.isfinite(v) for m in rl for v in m.values() if isinstance(v, float))
  assert rl[0]["rollout/carried_sequences"] > 0 and rl[1]["rollout/stale_token_frac"] > 0
