"""Reliability: what a config, a file or a signal can give ends in one line naming the setting, file or run, and
nothing trained is lost. A damaged carry record falls back to the older checkpoint; a lowered cap ends the carried
sequences that reached it; a resume without the budget says that the carry is dropped; an unreadable checkpoint is
warned about once; a second Ctrl-C names the checkpoint a resume starts from; a warm-start file without solutions,
or of held-out problems only, is refused at start and leaves no run directory; `make eval` on a run directory
points to its export; packed micro-batches larger than a mini-batch warn. (The overlap rule: test_data.py; integer
ranges and cross-field messages: test_config.py; a finished run given more steps: test_rehearsal.py; a moved run
directory: test_stopping.py.)"""

import os
import subprocess
import sys
import warnings

import jax
import numpy as np
import pytest

from smoke_runs import ROOT
from vapo_jax.cli import resolve
from vapo_jax.data.prompt_iterator import PromptIterator
from vapo_jax.data.records import Record
from vapo_jax.errors import ConfigError, counted
from vapo_jax.models import sharding
from vapo_jax.rollout import partial
from vapo_jax.train import checkpoints, saving
from vapo_jax.train import metrics as metrics_lib
from vapo_jax.train.state import Progress

GROUP, CAP = 2, 8


def _carry(cap: int = CAP) -> partial.Carry:
  return partial.Carry(samples_per_prompt=GROUP, sequences=4, max_response_tokens=cap, max_staleness=2,
                       pad_id=0, prompt_width=16)


def _progress(carry) -> Progress:
  records = [Record(str(i), f"problem {i}", str(i), "s") for i in range(8)]
  return Progress(stage="rl", prompts=PromptIterator(records, prompts_per_step=2, seed=0),
                  sft_rng=np.random.default_rng(0), monitor=metrics_lib.CollapseMonitor(length_frac=0.5,
                                                                                        min_entropy=0.1),
                  carry=carry)


def _in_flight(lengths) -> partial.Carry:
  """A carry holding two groups, decoded `lengths` tokens each and none finished."""
  carry = _carry()
  call = carry.next_call(lambda n: [([str(i)], [5, 6, 7]) for i in range(n)])
  rows = len(call.rows)
  tokens = np.ones((rows, CAP), np.int32)
  lengths = np.asarray(lengths[:rows] + [0] * (rows - len(lengths)), np.int32)
  finish = np.full(rows, partial.common.FINISH_UNFINISHED, np.int32)
  carry.record(call, tokens, np.full((rows, CAP), -0.5, np.float32), np.full((rows, CAP), -0.4, np.float32),
               lengths, finish, version=0)
  assert carry.carried() > 0
  return carry


class _Run(saving.Saving):
  """The part of a trainer that `Saving._accept` reads: its config, progress and state."""

  def __init__(self, config, progress, state):
    self.config, self.progress, self.state = config, progress, state


def _save_two(tmp_path, first: dict, second: dict, arrays: tuple[dict, dict]):
  mesh = sharding.make_mesh(data=8, fsdp=1, tensor=1)
  config = resolve.resolve(["--exp", "tiny", "checkpoint.async_save=false"])[0]
  found = checkpoints.RunCheckpoints(str(tmp_path), config.checkpoint)
  state = {"w": jax.device_put(np.arange(8.0),
                               jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data")))}
  for step, (record, extra) in enumerate(zip((first, second), arrays), start=1):
    found.save(step, {"state": state} | extra, {"progress": record, "n": step}, wait=True)
  found.close()
  return config, checkpoints.RunCheckpoints(str(tmp_path), config.checkpoint), state


def test_a_damaged_carry_record_falls_back_to_the_older_checkpoint_warned_once(tmp_path):
  """The newest checkpoint's carry counters do not fit its arrays (valid JSON of the wrong shape): the restore takes
  the older checkpoint, and one warning names the damaged one, although the record was read twice."""
  saved = _progress(_in_flight([3, 3, 3, 3]))
  record, arrays = saved.checkpoint()
  damaged = record | {"carry": record["carry"] | {"groups": record["carry"]["groups"] + 1}}
  config, found, state = _save_two(tmp_path, record, damaged, (arrays, arrays))
  progress = _progress(_carry())
  with warnings.catch_warnings(record=True) as said:
    warnings.simplefilter("always")
    assert found.latest_meta()[0] == 2  # Its JSON reads: the record is damaged, not the file.
    target = lambda meta: {"state": checkpoints.abstract(state)} | progress.array_target(meta["progress"])
    step, _, meta = found.restore_latest(target, lambda tree, meta: progress.load(meta["progress"], tree))
  skipped = [str(w.message) for w in said if "skipping it" in str(w.message)]
  assert (step, meta["n"]) == (1, 1) and len(skipped) == 1 and "/2 is incomplete or unreadable" in skipped[0]
  assert progress.carry.carried() == saved.carry.carried()
  found.close()


def test_a_lowered_cap_ends_the_carried_sequences_that_reached_it_with_one_line(monkeypatch):
  saved = _progress(_in_flight([6, 2, 6, 2]))
  record, arrays = saved.checkpoint()
  config = resolve.resolve(["--exp", "tiny", "rollout.max_response_tokens=5"])[0]
  run = _Run(config, _progress(_carry(cap=5)), None)
  run.state = type("S", (), {"key": jax.random.key(0)})()
  monkeypatch.setattr(saving, "from_checkpoint", lambda tree,
                      impl: sorted(tree))  # The state: none saved here.
  with pytest.warns(UserWarning) as said:
    run._accept(arrays, {"progress": record})
  assert run.state == []  # The carry's arrays are the progress's, not the state's.
  lines = [str(w.message) for w in said]
  assert lines == ["2 carried sequence(s) held rollout.max_response_tokens=5 tokens or more (the cap was "
                   "lowered since the save): they end there, finish reason \"length\""]
  carry = run.progress.carry
  assert carry.capped == 2 and carry.length[:4].tolist() == [5, 2, 5,
                                                             2] and carry.finish[:4].tolist()[::2] == [
      partial.common.FINISH_LENGTH] * 2


def test_a_resume_without_the_budget_says_that_the_carried_groups_are_dropped():
  record, arrays = _progress(_in_flight([3, 3, 3, 3])).checkpoint()
  unbudgeted = _progress(None)
  with pytest.warns(UserWarning, match=r"^the checkpoint holds 2 group\(s\) of partial rollouts in flight; "
                                       r"without rollout.decode_budget they are dropped and the run samples "
                                       r"anew$"):
    unbudgeted.load(record, arrays)
  assert unbudgeted.stage_step == 0 and unbudgeted.carry is None


def test_a_second_ctrl_c_names_the_newest_complete_checkpoint_in_one_line(tmp_path):
  """`cli.train`'s answer to a second Ctrl-C while a save is under way: exit 130 at once, Orbax's unfinished save
  abandoned quietly, one line naming the newest complete checkpoint (not the temporary one being written)."""
  run_dir = tmp_path / "run"
  for name in ("1", "2", "3.orbax-checkpoint-tmp-99"):
    (run_dir / "checkpoints" / name).mkdir(parents=True)
  code = ("import sys; from vapo_jax.cli import train; status = train._aborted(sys.argv[1]); "
          "assert train._interrupted_start[0]; sys.exit(status)")
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
  done = subprocess.run([sys.executable, "-c", code, str(run_dir)], cwd=ROOT, env=env, capture_output=True,
                        text=True, timeout=120)
  assert done.returncode == 130, done.stderr
  assert done.stderr.splitlines() == [
      f"interrupted (a second Ctrl-C): stopped at once, any save in progress abandoned; the newest complete "
      f"checkpoint, {run_dir}/checkpoints/2, is intact: run the same command again to resume from it."]


def test_a_refused_warm_start_file_leaves_no_run_directory(tmp_path, capsys):
  from vapo_jax.cli import train
  demonstrations = tmp_path / "sft.jsonl"
  demonstrations.write_text('{"problem": "1 + 1", "answer": "2"}\n')
  runs = tmp_path / "runs"
  argv = ["--exp", "tiny", "--smoke", f"run_dir={runs}", "name=x", f"sft.path={demonstrations}",
          "sft.steps=2"]
  assert train.main(argv) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert err[-1].startswith(f"error: {demonstrations}: supervised warm start needs a 'solution'"), err[-3:]
  assert not runs.exists()


def test_a_warm_start_file_of_evaluation_problems_is_refused_at_start_naming_its_demonstrations(tmp_path,
                                                                                                capsys):
  """Every demonstration is a held-out problem and `data.drop_eval_overlap=true` would drop them all: refused when
  the run starts (before any model is built), calling them demonstrations, and no run directory is left."""
  import json

  from vapo_jax.cli import train
  from vapo_jax.data import problems
  runs = tmp_path / "runs"
  argv = ["--exp", "tiny", "--smoke", f"run_dir={runs}", "name=x", "sft.steps=2",
          "data.drop_eval_overlap=true"]
  held_out = problems.eval_problems(resolve.resolve(argv)[0])
  demonstrations = tmp_path / "sft.jsonl"
  demonstrations.write_text("".join(json.dumps({"problem": r.prompt, "answer": r.answer,
                                                "solution": r.answer})
                                    + "\n" for r in held_out))
  assert train.main(argv + [f"sft.path={demonstrations}"]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert err[-1].startswith(f"error: {demonstrations}: every one of its {len(held_out)} demonstrations is an "
                            "evaluation problem of "), err[-3:]
  assert not runs.exists()


def test_make_eval_on_a_run_directory_points_to_its_export(tmp_path):
  from vapo_jax.cli import evaluate
  run = tmp_path / "run"
  (run / "export").mkdir(parents=True)
  (run / "config.json").write_text("{}")
  config = resolve.resolve(["--exp", "tiny"])[0]
  with pytest.raises(ConfigError, match=rf"^{run} is a run directory, not a Hugging Face checkpoint: pass "
                                        rf"its exported policy, CKPT={run}/export$"):
    evaluate.sample_from_checkpoint(config, str(run), str(tmp_path / "out.jsonl"))


def test_packed_micro_batches_larger_than_a_mini_batch_warn_naming_a_size_that_fits():
  from vapo_jax.train.steps import warn_padded_micro_batches
  config = resolve.resolve(["--exp", "tiny", "algo.mini_batch_responses=8", "rollout.prompts_per_step=2",
                            "rollout.samples_per_prompt=8"])[0]
  with pytest.warns(UserWarning, match=r"^packing.micro_batch_rows=128 is more rows than a mini-batch of 8 "
                                       r"sequences packs into \(one a row at the most\): 94% of each "
                                       r"update's micro-batch is padding at least; "
                                       r"packing.micro_batch_rows=8 fits$"):
    warn_padded_micro_batches(config, 128, 8)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    warn_padded_micro_batches(config, 8, 8)


def test_counts_are_said_in_the_singular_and_the_plural():
  assert [counted(1, "page"), counted(2, "page"), counted(1, "bad line"), counted(0, "entry", "entries")] == [
      "1 page", "2 pages", "1 bad line", "0 entries"]
