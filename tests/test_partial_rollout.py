"""Partial rollouts (rollout/partial.py): a rollout stopped at a decode budget and continued is the rollout never
stopped; trained groups are complete and no trained token is older than `max_staleness` versions."""

import jax
import numpy as np
import pytest

from conftest import build_smoke_config
from model_utils import EOS, PROMPTS
from vapo_jax.config import RolloutConfig
from vapo_jax.errors import ConfigError
from vapo_jax.memory import topologies, xla_report, xla_report_text
from vapo_jax.rollout import RolloutPlan, common, partial
from vapo_jax.rollout.static import make_generate

GROUP, MAX_NEW = 3, 10


def _carry(sequences: int, *, max_staleness: int = 1) -> partial.Carry:
  width = common.prompt_bucket(max(map(len, PROMPTS)) + MAX_NEW - 1)  # A prompt and up to Tr − 1 carried tokens.
  return partial.Carry(group=GROUP, sequences=sequences, max_response_tokens=MAX_NEW, max_staleness=max_staleness,
                       pad_id=0, prompt_width=width)


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
  spec = common.Sampling(max_response_tokens=MAX_NEW, stop_token_ids=(EOS,), temperature=1.3, top_k=5, top_p=0.8)
  tokens, mask = common.pad_prompts(PROMPTS, pad_id=0)
  key = jax.random.key(3)
  reference = make_generate(sampling=spec, samples_per_prompt=GROUP, pad_id=0)(model, tokens, mask, key)
  carry, draw = _carry(len(PROMPTS) * GROUP), _drawer()
  plan = RolloutPlan(engine="refill", prompts=carry.sequences, group=1, prompt_tokens=carry.prompt_width,
                     max_response_tokens=MAX_NEW, devices=1, prompts_per_round=carry.sequences, slots=8, min_slots=1,
                     steps_per_call=2, pages=pages, queue_pages=pages, page_tokens=2, block_pages=1, attention="gather",
                     lanes=2, prefill_chunk=3)  # Carried prefixes of up to 16 tokens prefilled 3 at a time.
  place = lambda tree: jax.tree.map(jax.numpy.asarray, tree)
  rounds, peak, carried = 0, 0.0, 0
  while (groups := carry.take_complete(len(PROMPTS))) is None:
    call = carry.next_call(draw)
    host, steps, _, figures = partial.decode_round(model, call, key, plan=plan, sampling=spec, budget=3,
                                                   pad_id=0, cache_dtype=np.float32, jit=jax.jit, place=place)
    assert np.all(host[3] <= 3)  # At most the budget's 3 new tokens a round (its first steps may only prefill).
    carry.record(call, *host, version=0)
    assert figures["rollout/pages_free_after"] == pages
    rounds, peak, carried = rounds + 1, max(peak, figures["rollout/pages_peak"]), max(carried, carry.carried())
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
    tokens = call.ids[:, None] * 100 + call.offsets[:, None] + np.arange(MAX_NEW)[None]  # Token t of sequence i.
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
               np.full((9, MAX_NEW), -0.2, np.float32), np.arange(9) % 4, np.full(9, common.FINISH_UNFINISHED), 0)
  counters, arrays = carry.state_dict()
  copy = _carry(3 * GROUP, max_staleness=2)
  copy.load_state_dict(json.loads(json.dumps(counters)), arrays)
  counters2, arrays2 = copy.state_dict()
  assert counters2 == counters and copy.next_id == 9 and copy.carried() == carry.carried() > 0
  for name in arrays:
    np.testing.assert_array_equal(arrays2[name], arrays[name], err_msg=name)
  again = copy.next_call(draw)
  np.testing.assert_array_equal(again.prompt_tokens, carry.next_call(draw).prompt_tokens)
  lowered = partial.Carry(group=GROUP, sequences=9, max_response_tokens=2, max_staleness=2, pad_id=0, prompt_width=16)
  lowered.load_state_dict(counters, arrays)  # Lengths 0..3: those at 2 or 3 reach the new cap of 2.
  assert lowered.capped == int(np.sum(arrays["length"] >= 2)) > 0 and lowered.length.max() == 2
  assert np.all(lowered.finish[lowered.length == 2] == common.FINISH_LENGTH)
  damaged = _carry(3 * GROUP)
  with pytest.raises(ValueError, match="the carry's 'length' is"):
    damaged.load_state_dict(counters, arrays | {"length": arrays["length"][:2]})
  assert damaged.groups == [] and damaged.next_id == 0


def test_a_budget_that_cannot_finish_a_restarted_response_is_refused():
  with pytest.raises(ConfigError, match=r"decode_budget × \(max_staleness \+ 1\) = 40 must reach max_response_tokens"):
    RolloutConfig(max_response_tokens=64, decode_budget=20, max_staleness=1)
  with pytest.raises(ConfigError, match="engine must be 'refill'"):
    RolloutConfig(max_response_tokens=64, decode_budget=32, engine="static")
  RolloutConfig(max_response_tokens=64, decode_budget=32, max_staleness=1)


@pytest.mark.slow  # make test-slow, for time (make test's start-up checks plan the round: test_start_up_rollouts).
def test_a_partial_rollouts_round_is_compiled_and_checked(tmp_path):
  """With `rollout.decode_budget` the report also compiles a round: 2 × P·G sequences, one per prompt, each
  prompt a problem's with up to a response's carried tokens, in the slots of P·G, the decode taking the
  round's sequence numbers, offsets and budget; the run's verdict covers it."""
  config = build_smoke_config(tmp_path, {"eval.path": None, "rollout.decode_budget": 8, "rollout.max_staleness": 1})
  report = xla_report.compile_run(config, topologies.named("v5p:2x2x1"), phases=("rollout", "partial rollout"))
  assert [p.name for p in report.phases] == ["rollout", "partial rollout"] and not report.over()
  phase = report.phases[1]
  r = config.rollout
  width = common.prompt_bucket(r.max_prompt_tokens + r.max_response_tokens - 1)
  assert f"a round of {2 * r.responses_per_step} sequences of up to {width} prompt" in phase.detail
  assert [p.name.split(" (")[0] for p in phase.programs] == ["start", "decode", "compaction", "finish"]
  assert all(p.memory is not None and p.needs > 0 for p in phase.programs)
  assert "partial rollout" in xla_report_text.table(report)
