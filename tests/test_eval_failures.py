"""`make eval` holds to training's standard: problem ids name one problem each, a dropped duplicate's
responses count for the problem kept, a reward function's failures are checked and explained, and every
input error is one line naming the file and line, with exit status 2."""

import gzip
import json

import pytest

from vapo_jax.cli import evaluate
from vapo_jax.errors import USER_ERROR_EXIT_CODE


def _jsonl(path, rows) -> str:
  path.write_text("".join(json.dumps(row) + "\n" for row in rows))
  return str(path)


def _run(capsys, *args) -> tuple[int, str, str]:
  code = evaluate.main(["--exp", "aime", *map(str, args)])
  out, err = capsys.readouterr()
  return code, out, err


@pytest.fixture
def problem_file(tmp_path):
  return _jsonl(tmp_path / "problems.jsonl", [{"id": "a", "problem": "1+1?", "answer": "2"},
                                               {"id": "b", "problem": "2+2?", "answer": "4"}])


def _bad_inputs(tmp):
  """(what, eval.path, --responses, the error's text after "error: "), made in `tmp`."""
  problems = _jsonl(tmp / "ok.jsonl", [{"id": "a", "problem": "1+1?", "answer": "2"}])
  responses = _jsonl(tmp / "ok_responses.jsonl", [{"id": "a", "response": "Answer: 2"}])
  (tmp / "latin1.jsonl").write_bytes(b'{"id": "a", "problem": "1+1?", "answer": "2"}\n'
                                     b'{"id": "b", "problem": "caf\xe9?", "answer": "2"}\n')
  (tmp / "latin1.json").write_bytes(b'[{"problem": "a", "answer": "1"},\n {"problem": "caf\xe9", "answer": "2"}]')
  (tmp / "gz.jsonl.gz").write_bytes(gzip.compress(b'{"id": "a", "problem": "1+1?", "answer": "2"}\n'))
  (tmp / "bad.parquet").write_text("not parquet")
  (tmp / "empty_dir").mkdir()
  (tmp / "r_latin1.jsonl").write_bytes(b'{"id": "a", "response": "ok"}\n{"id": "a", "response": "caf\xe9"}\n')
  (tmp / "r.jsonl.gz").write_bytes(gzip.compress(b'{"id": "a", "response": "ok"}\n'))
  bad_json = _jsonl(tmp / "r_json.jsonl", [{"id": "a", "response": "ok"}])
  with open(bad_json, "a") as f:
    f.write('{"id": "a", "response": \n')
  unknown = _jsonl(tmp / "r_unknown.jsonl", [{"id": "a", "response": "ok"}, {"id": "zz", "response": "ok"}])
  two = _jsonl(tmp / "r_two.jsonl", [{"id": "q", "response": "ok", "answer": 3}, {"id": "q", "response": "x",
                                                                                 "answer": "5"}])
  t = str(tmp)
  return [
      ("eval.path missing", f"{t}/no.jsonl", responses, f"{t}/no.jsonl: no such file"),
      ("eval.path not UTF-8", f"{t}/latin1.jsonl", responses,
       f"{t}/latin1.jsonl, line 2, field (line): not UTF-8 text (byte 0xe9"),
      ("eval.path .json not UTF-8", f"{t}/latin1.json", responses, f"{t}/latin1.json, line 2: not UTF-8 text"),
      ("eval.path gzip", f"{t}/gz.jsonl.gz", responses, f"{t}/gz.jsonl.gz: a gzip-compressed file: decompress it"),
      ("eval.path not parquet", f"{t}/bad.parquet", responses, f"{t}/bad.parquet: not a readable parquet file"),
      ("eval.path an empty directory", f"{t}/empty_dir", responses, f"{t}/empty_dir: a directory holding no data set"),
      ("responses missing", problems, f"{t}/none.jsonl", f"{t}/none.jsonl: no such file"),
      ("responses a directory", problems, f"{t}/empty_dir", f"{t}/empty_dir: a directory holding no data set"),
      ("responses not UTF-8", problems, f"{t}/r_latin1.jsonl",
       f"{t}/r_latin1.jsonl, line 2, field (line): not UTF-8 text (byte 0xe9"),
      ("responses gzip", problems, f"{t}/r.jsonl.gz", f"{t}/r.jsonl.gz: a gzip-compressed file"),
      ("responses malformed JSON", problems, bad_json, f"{bad_json}, line 2, field (line): malformed JSON"),
      ("responses unknown id", problems, unknown, f"{unknown}, line 2, field 'id': 'zz': no problem has this id"),
      ("one id, two answers", problems, two, f"{two}, line 2, field 'answer': '5', but id 'q' has the answer '3'"),
  ]


def test_every_input_error_is_one_line_and_exit_2(tmp_path, capsys):
  """Each is one line and exit 2, not a traceback (exit 1): a missing, directory, non-UTF-8 or gzip
  responses file, a parquet that is not one, and an empty directory (not a request to `pip install datasets`)."""
  for what, problems, responses, message in _bad_inputs(tmp_path):
    code, out, err = _run(capsys, f"eval.path={problems}", "--responses", responses, "--out", tmp_path / "out")
    assert (code, err.count("\n")) == (USER_ERROR_EXIT_CODE, 1), (what, err)
    assert err.startswith(f"error: {message}"), (what, err)
    assert "Traceback" not in out + err and "pip install datasets" not in err


def test_different_problems_sharing_an_id_are_named_by_their_line(tmp_path, capsys):
  """Two problems with id 7 are named by their lines rather than merged (their responses scored against one answer)."""
  problems = _jsonl(tmp_path / "p.jsonl", [{"id": 7, "problem": "1+1?", "answer": "2"},
                                            {"id": 8, "problem": "2+2?", "answer": "4"},
                                            {"id": 7, "problem": "3+3?", "answer": "6"}])
  ambiguous = _jsonl(tmp_path / "r.jsonl", [{"id": 8, "response": "Answer: 4"}, {"id": 7, "response": "Answer: 6"}])
  code, _, err = _run(capsys, f"eval.path={problems}", "--responses", ambiguous, "--out", tmp_path / "o")
  assert code == USER_ERROR_EXIT_CODE
  assert err.splitlines()[0] == (f"warning: {problems}: 1 id(s) name different problems, e.g. id '7' (lines 1, 3); "
                                 "each such problem is now named by its line ('7@line1', '7@line3'): give every "
                                 "problem its own id, or use those")
  assert err.splitlines()[1] == (f"error: {ambiguous}, line 2, field 'id': '7': the problem file's different problems "
                                 "with this id were renamed by their line when loaded: use one of '7@line1', "
                                 "'7@line3', and the line has no 'answer'")
  named = _jsonl(tmp_path / "named.jsonl", [{"id": "7@line1", "response": "Answer: 2"},
                                            {"id": "7@line3", "response": "Answer: 6"},
                                            {"id": "7@line3", "response": "Answer: 2"}])
  code, out, err = _run(capsys, f"eval.path={problems}", "--responses", named, "--out", tmp_path / "o")
  assert code == 0, err
  summary = json.loads((tmp_path / "o" / "summary.json").read_text())["overall"]
  assert summary["problems"] == 2 and summary["avg@1-2"] == pytest.approx((1 + 0.5) / 2)


def test_responses_to_a_dropped_duplicate_count_for_the_kept_problem(tmp_path, capsys):
  """Loading drops a repeated problem; its id's responses count for the kept one (not "no problem has this id")."""
  problems = _jsonl(tmp_path / "p.jsonl", [{"id": "a", "problem": "1+1?", "answer": "2"},
                                            {"id": "b", "problem": "2+2?", "answer": "4"},
                                            {"id": "c", "problem": " 1+1? ", "answer": "2"}])  # = "a".
  responses = _jsonl(tmp_path / "r.jsonl", [{"id": "a", "response": "Answer: 2"}, {"id": "c", "response": "Answer: 3"},
                                            {"id": "b", "response": "Answer: 4"}, {"id": "b", "response": "Answer: 4"}])
  code, out, err = _run(capsys, f"eval.path={problems}", "--responses", responses, "--out", tmp_path / "o")
  assert code == 0, err
  samples = [json.loads(line) for line in (tmp_path / "o" / "samples.jsonl").read_text().splitlines()]
  assert [(s["id"], s["index"], s["gold"], s["correct"]) for s in samples] == [
      ("a", 0, "2", True), ("a", 1, "2", False), ("b", 0, "4", True), ("b", 1, "4", True)]
  assert "overall: problems 2  samples 4  avg@2 0.75" in out


def test_a_reward_function_returning_non_scores_is_stopped_with_its_reasons(tmp_path, capsys, problem_file):
  """A function raising or returning NaN, inf, None, a tuple or a dict stops make eval with its reasons
  (not exit 0, avg 0 and `verifier_errors N`): make eval checks the error fraction as training does,
  and writes every failure's reason to samples.jsonl and summary.json."""
  kinds = ["nan", "inf", "none", "tuple", "dict", "raise"]
  responses = _jsonl(tmp_path / "r.jsonl", [{"id": "a", "response": kind} for kind in kinds])
  args = [f"eval.path={problem_file}", "reward.reward_fn=failing_rewards:returns_what_it_is_told",
          "reward.verifier_workers=1", "--out", tmp_path / "o"]
  code, out, err = _run(capsys, *args, "--responses", responses)
  assert (code, err.count("\n")) == (USER_ERROR_EXIT_CODE, 1), err
  assert err.startswith("error: the reward function 'failing_rewards:returns_what_it_is_told' (reward.reward_fn) "
                        f"failed on all 6 responses of the batch; the first failure: {responses}, line 1 (id 'a'): "
                        "returned nan (float), expected a bool or a finite number.")
  assert f"reason is in {tmp_path}/o/samples.jsonl" in err
  samples = [json.loads(line) for line in (tmp_path / "o" / "samples.jsonl").read_text().splitlines()]
  assert [s["error"] for s in samples] == [
      "returned nan (float), expected a bool or a finite number",
      "returned inf (float), expected a bool or a finite number",
      "returned None (NoneType), expected a bool or a finite number",
      "returned (True, 1.0) (tuple), expected a bool or a finite number",
      "returned {'score': 1.0} (dict), expected a bool or a finite number",
      "error: ValueError: cannot score 'raise'"]
  failed = json.loads((tmp_path / "o" / "summary.json").read_text())["failed_to_score"]
  assert failed["responses"] == 6 and len(failed["reasons"]) == 6
  assert failed["first"] == f"{responses}, line 1 (id 'a'): returned nan (float), expected a bool or a finite number"
  some = _jsonl(tmp_path / "some.jsonl", [{"id": "a", "response": r} for r in ("so 2", "tuple", "so 2", "so 2")])
  code, out, err = _run(capsys, *args, "--responses", some)
  assert code == 0 and "avg@4 0.75" in out
  assert err.splitlines() == [f"warning: the reward function 'failing_rewards:returns_what_it_is_told' "
                              f"(reward.reward_fn) failed to score a response: {some}, line 2 (id 'a'): returned "
                              "(True, 1.0) (tuple), expected a bool or a finite number. Such responses score "
                              "incorrect; this is reported once, then counted in summary.json's failed_to_score "
                              "(each sample's reason: samples.jsonl 'error')"]  # Not the trainer's metric.
  assert f"1 of 4 responses failed to score (they count as incorrect); the first: {some}, line 2" in out
