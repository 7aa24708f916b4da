"""avg@k, pass@k and maj@k against hand examples and definitions; scoring a responses file."""

import itertools
import json
import math
import warnings

import numpy as np
import pytest

from vapo_jax.cli import evaluate
from vapo_jax.config import RewardConfig
from vapo_jax.data.records import Record, load_records
from vapo_jax.errors import DataError
from vapo_jax.paths import DATA_DIR as DATA
from vapo_jax.rewards import accuracy, equivalence

LIGHTEVAL = DATA / "verifier_cases" / "lighteval_metric_cases"


def pass_at_k_by_enumeration(n, c, k):
  """The definition: the fraction of k-subsets of the n samples holding a correct one."""
  samples = [True] * c + [False] * (n - c)
  subsets = list(itertools.combinations(samples, k))
  return sum(any(s) for s in subsets) / len(subsets)


def test_pass_at_k_matches_closed_form_and_definition():
  for n in range(1, 8):
    for c in range(n + 1):
      for k in range(1, n + 1):
        got = accuracy.pass_at_k(n, c, k)
        assert got == pytest.approx(1 - math.comb(n - c, k) / math.comb(n, k), abs=1e-12)
        assert got == pytest.approx(pass_at_k_by_enumeration(n, c, k), abs=1e-12)
  assert accuracy.pass_at_k(32, 8, 1) == pytest.approx(8 / 32)
  assert accuracy.pass_at_k(1024, 3, 512) == pytest.approx(1 - math.comb(1021, 512) / math.comb(1024, 512))
  with pytest.raises(ValueError):
    accuracy.pass_at_k(4, 5, 1)
  assert accuracy.pass_ks(32) == [1, 2, 4, 8, 16, 32] and accuracy.pass_ks(6) == [1, 2, 4, 6]


def _samples(problem_id, source, answers, gold):
  correct = [a is not None and equivalence.is_equivalent(a, gold) for a in answers]
  return [accuracy.Sample(problem_id, source, i, f"\\boxed{{{a}}}", gold, a, "boxed" if a else "none", ok, "ok")
          for i, (a, ok) in enumerate(zip(answers, correct))]


def test_avg_pass_maj_on_a_hand_example():
  # Problem A: 3 of 4 correct; B: 1 of 4 correct and the majority ("8") wrong.
  samples = (_samples("A", "s1", ["7", "07", "7.0", "6"], "7")
             + _samples("B", "s2", ["7", "8", "8", None], "7"))
  summary = accuracy.summarize(samples)
  assert summary["avg@4"] == pytest.approx((3 / 4 + 1 / 4) / 2)
  assert summary["pass@1"] == pytest.approx(0.5)
  assert summary["pass@2"] == pytest.approx((1.0 + (1 - 3 / 6)) / 2)
  assert summary["pass@4"] == pytest.approx(1.0)
  assert summary["maj@4"] == pytest.approx(0.5)  # A's "7" (as 7, 07, 7.0) wins; B's "8" loses.
  assert summary["no_answer_frac"] == pytest.approx(1 / 8)
  by_source = accuracy.summarize_by_source(samples)
  assert by_source["per_source"]["s1"]["avg@4"] == pytest.approx(0.75)
  assert by_source["per_source"]["s2"]["maj@4"] == 0.0


def test_majority_vote_ties_and_no_answers():
  assert accuracy.majority_correct(["3", "4"], [False, True]) is False  # Tie: earliest wins.
  assert accuracy.majority_correct([None, None, "4"], [False, False, True]) is True
  assert accuracy.majority_correct([None, None], [False, False]) is False
  assert accuracy.majority_correct([r"\frac12", "0.5", r"\dfrac{1}{2}", "1"], [True, False, True, False]) is True


@pytest.mark.parametrize("name", ["pass_at_k_math", "avg_at_k_math", "g_pass_at_k_latex"])
def test_lighteval_metric_cases(name):
  """lighteval's pass@k / avg@k cases (and G-Pass@k at threshold 0, which is pass@k)."""
  cases = json.loads((LIGHTEVAL / f"{name}.json").read_text())["test_cases"]
  for case in cases:
    gold, texts = case["doc"]["choices"][0], case["model_response"]["text"]
    forms = ("boxed", "answer_line", "math_verify")
    c = sum(equivalence.score_response(t, gold, forms=forms).correct for t in texts)
    k = case["metric_params"]["k"]
    for key, expected in case["expected_output"].items():
      if key.startswith("pass@k"):
        got = accuracy.pass_at_k(len(texts), c, k)
      elif key.startswith("avg@k"):
        got = c / len(texts)
      elif key.endswith("_0.0"):
        got = accuracy.pass_at_k(len(texts), c, k)
      else:
        continue
      assert got == pytest.approx(expected, abs=case["tolerance"]), (case["name"], key)


def test_evaluate_responses_file(tmp_path):
  """AIME 2024 + AMC 2023 problems, 4 samples each for 3 problems per source, one hanging sample."""
  problems = (load_records(str(DATA / "aime24/qwen25math_aime24_test.jsonl"))
              + load_records(str(DATA / "amc23/qwen25math_amc23_test.jsonl")))
  aime, amc = problems[:3], problems[30:33]
  lines = []
  for p in aime:  # 2 of 4 correct each; gold "025" style answered without the zero.
    for i in range(4):
      answer = str(int(p.answer)) if i % 2 == 0 else str(int(p.answer) + 1)
      lines.append({"id": p.id, "response": f"Thinking...\nAnswer: {answer}"})
  for j, p in enumerate(amc):  # All correct, except one sample that hangs the verifier.
    for i in range(4):
      hang = j == 0 and i == 3
      lines.append({"id": p.id, "response": r"\boxed{9^{9^{9^{9}}}}" if hang else f"\\boxed{{{p.answer}}}"})
  lines.append({"id": "extra", "response": "\\boxed{12}", "answer": 12, "source": "inline"})
  responses = tmp_path / "responses.jsonl"
  responses.write_text("".join(json.dumps(line) + "\n" for line in lines))
  summary = evaluate.evaluate_responses(str(responses), problems=problems, out_dir=str(tmp_path / "out"),
                                        reward_config=RewardConfig(verifier_workers=2, verifier_timeout_s=2.0))
  per_source = summary["per_source"]
  assert per_source["aime24/qwen25math_aime24_test"]["avg@4"] == pytest.approx(0.5)
  assert per_source["aime24/qwen25math_aime24_test"]["pass@1"] == pytest.approx(0.5)
  assert per_source["aime24/qwen25math_aime24_test"]["pass@2"] == pytest.approx(1 - 1 / 6)
  assert per_source["amc23/qwen25math_amc23_test"]["avg@4"] == pytest.approx((3 / 4 + 1 + 1) / 3)
  assert per_source["amc23/qwen25math_amc23_test"]["verifier_timeouts"] == 1
  assert per_source["inline"]["avg@1"] == 1.0
  assert summary["overall"]["samples"] == 25 and summary["overall"]["problems"] == 7
  assert summary["overall"]["avg@1-4"] == pytest.approx((0.5 * 3 + 0.75 + 1 + 1 + 1) / 7)
  written = [json.loads(line) for line in (tmp_path / "out" / "samples.jsonl").read_text().splitlines()]
  assert len(written) == 25 and written[0]["answer"] == str(int(aime[0].answer)) and written[0]["correct"]
  assert [w["index"] for w in written[:4]] == [0, 1, 2, 3]
  assert json.loads((tmp_path / "out" / "summary.json").read_text())["overall"] == summary["overall"]


def _aime_responses(tmp_path, name, answer_line):
  """4 samples of each of 3 AIME 2024 problems, 2 of them right, the answer written by `answer_line`."""
  problems = load_records(str(DATA / "aime24/qwen25math_aime24_test.jsonl"))[:3]
  lines = [{"id": p.id, "response": "推理过程。\n" + answer_line(int(p.answer) + (i % 2))}
           for p in problems for i in range(4)]
  path = tmp_path / f"{name}.jsonl"
  path.write_text("".join(json.dumps(line, ensure_ascii=False) + "\n" for line in lines))
  return str(path), problems


@pytest.mark.parametrize("form", ["答案：{}", "答案: {}", "最终答案：${}$", "Answer：{}", "所以答案是 {}。", "答：{}"])
def test_chinese_answer_lines_score_as_the_english_one(tmp_path, form):
  config = RewardConfig(verifier_workers=1)
  english, problems = _aime_responses(tmp_path, "english", "Answer: {}".format)
  chinese, _ = _aime_responses(tmp_path, "chinese", form.format)
  scores = [evaluate.evaluate_responses(path, problems=problems, out_dir=str(tmp_path / name), reward_config=config)
            for path, name in ((english, "en"), (chinese, "zh"))]
  assert scores[0]["overall"]["avg@4"] == pytest.approx(0.5)
  assert scores[1]["overall"] == scores[0]["overall"]  # avg@k, pass@k, maj@k, no_answer_frac, ...


def test_many_unanswered_responses_warn_naming_their_ending(tmp_path):
  path, problems = _aime_responses(tmp_path, "unknown", "ANS => {}".format)  # No known form.
  with pytest.warns(UserWarning, match=r"no answer was found in 12 of 12 responses .*'ANS => \d+'"):
    evaluate.evaluate_responses(path, problems=problems, out_dir=str(tmp_path / "out"),
                                reward_config=RewardConfig(verifier_workers=1))
  answered, _ = _aime_responses(tmp_path, "answered", "Answer: {}".format)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    evaluate.evaluate_responses(answered, problems=problems, out_dir=str(tmp_path / "out2"),
                                reward_config=RewardConfig(verifier_workers=1))


def test_bad_responses_file(tmp_path):
  problems = [Record("1+1?", "2", "p1", "s")]
  bad = tmp_path / "bad.jsonl"
  for line, message in [('{"id": "p1"}', r"line 1, field 'response': expected a string, got NoneType"),
                        ('{"id": "p9", "response": "x"}', r"line 1, field 'id': 'p9': no problem has this id"),
                        ('{"id": "p1", "response": "x", "answer": ""}', r"line 1, field 'answer'"),
                        ('{"id": "p1", "response": ', r"line 1, field \(line\): malformed JSON")]:
    bad.write_text(line + "\n")
    with pytest.raises(DataError, match=message):
      evaluate.read_responses(str(bad), problems)
  bad.write_text('{"id": "p1", "response": "x"}\n')
  with pytest.raises(DataError, match="no problem file is set"):
    evaluate.read_responses(str(bad), None)


def test_cli(tmp_path, capsys):
  problems = load_records(str(DATA / "aime24/qwen25math_aime24_test.jsonl"))
  responses = tmp_path / "r.jsonl"
  responses.write_text("".join(json.dumps({"id": p.id, "response": f"Answer: {p.answer}"}) + "\n"
                               for p in problems))
  args = ["--exp", "aime", f"eval.path={DATA / 'aime24/qwen25math_aime24_test.jsonl'}",
          "--out", str(tmp_path / "o")]
  assert evaluate.main(args + ["--responses", str(responses), "reward.correct=2.0"]) == 0
  out = capsys.readouterr().out
  assert "overall: problems 30  samples 30  avg@1 1" in out
  summary = json.loads((tmp_path / "o" / "summary.json").read_text())
  assert summary["overall"]["avg@1"] == 1.0 and summary["overall"]["maj@1"] == 1.0
  assert evaluate.main(args + ["--ckpt", str(tmp_path)]) == 2
  assert "no config.json in checkpoint directory" in capsys.readouterr().err
  assert evaluate.main(args + ["--responses", str(responses), "eval.nope=1"]) == 2
  assert np.isfinite(summary["verify_responses_per_s"])


@pytest.mark.slow  # For time (8 s): make test runs the CLI on responses (above, below); the trainer's held-out
# generation runs in aime's rehearsal.
def test_cli_generates_from_a_checkpoint(tmp_path, capsys):
  from flax import nnx

  from vapo_jax.models import hf_export
  from vapo_jax.models.config import preset
  from vapo_jax.models.transformer import CausalLM
  hf_export.export(CausalLM(preset("tiny"), rngs=nnx.Rngs(0)), str(tmp_path / "ckpt"))
  args = ["--exp", "tiny", "--ckpt", str(tmp_path / "ckpt"), "--out", str(tmp_path / "o"),
          "eval.max_problems=3", "eval.samples_per_problem=2", "rollout.max_response_tokens=6"]
  assert evaluate.main(args) == 0
  lines = (tmp_path / "o" / "responses.jsonl").read_text().splitlines()
  assert len(lines) == 6 and all(set(json.loads(line)) == {"id", "answer", "source", "response"} for line in lines)
  summary = json.loads((tmp_path / "o" / "summary.json").read_text())
  assert summary["overall"]["problems"] == 3 and summary["overall"]["samples"] == 6


def test_make_eval_reads_the_problems_as_the_trainer_does(tmp_path, smoke_config, capsys):
  """One file with its own field names, a repeated problem and a cap on the problems: `make eval`
  and the trainer's held-out evaluation read the same records (the data settings apply to both)."""
  from vapo_jax.train.trainer import Trainer
  rows = [{"q": {"text": f"{a}+{a}="}, "sol": str(2 * a), "uid": f"u{a}"} for a in range(5)]
  rows.insert(2, dict(rows[1], uid="again"))  # The same problem again: dropped as a duplicate.
  path = tmp_path / "held_out.jsonl"
  path.write_text("".join(json.dumps(row) + "\n" for row in rows))
  fields = {"eval.path": str(path), "data.prompt_field": "q.text", "data.answer_field": "sol",
            "data.id_field": "uid", "eval.max_problems": 4}
  trainer = Trainer(smoke_config(fields), write_logs=False, verbose=False)
  trainer.close()
  assert [(r.id, r.prompt, r.answer) for r in trainer.eval_rows] == [(f"u{a}", f"{a}+{a}=", str(2 * a))
                                                                      for a in range(4)]
  responses = tmp_path / "responses.jsonl"
  responses.write_text("".join(json.dumps({"id": r.id, "response": f"Answer: {r.answer}"}) + "\n"
                               for r in trainer.eval_rows))
  args = ["--exp", "tiny", "--smoke", *(f"{k}={v}" for k, v in fields.items()), "--responses", str(responses),
          "--out", str(tmp_path / "out")]
  assert evaluate.main(args) == 0, capsys.readouterr().err
  summary = json.loads((tmp_path / "out" / "summary.json").read_text())["overall"]
  assert summary["problems"] == 4 and summary["avg@1"] == 1.0


def test_pass_at_k_stops_at_the_fewest_samples_and_says_so():
  """Problems with 4 and 2 samples: pass@k up to k = 2, and a note saying why pass@4 is left out."""
  samples = _samples("A", "s1", ["7", "6", "6", "6"], "7") + _samples("B", "s1", ["5", "6"], "5")
  summary = accuracy.summarize(samples)
  assert "avg@2-4" in summary and "pass@2" in summary and "pass@4" not in summary
  assert summary["pass@k_note"] == ("pass@k up to k=2 only: problems have 2-4 samples (the fewest bound k; "
                                    "1 problem(s) have 2)")
  assert "pass@k_note" not in accuracy.summarize(samples[:4])
