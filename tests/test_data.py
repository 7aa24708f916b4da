"""Dataset loading on the real files in data/, bad data, templates and resumable sampling."""

import collections
import json
import re
import warnings

import numpy as np
import pytest

from vapo_jax.data import problems
from vapo_jax.data.prompt_iterator import PromptIterator, permutation
from vapo_jax.data.records import Conflict, Record, deduplicate, load_records
from vapo_jax.errors import DataError
from vapo_jax.paths import DATA_DIR as DATA

AIME25_ANSWERS = ("70 588 16 117 279 504 821 77 62 81 259 510 204 60 735 "
                  "468 49 82 106 336 293 237 610 149 907 113 19 248 104 240").split()


def load(path, **kw):
  return load_records(str(DATA / path), **kw)


@pytest.mark.parametrize("path,count,first_id,first_answer,source", [
    ("aime24/qwen25math_aime24_test.jsonl", 30, "60", "204", "aime24/qwen25math_aime24_test"),
    ("aime24/matharena_aime24.jsonl", 30, "2024-I-1", "204", "aime24/matharena_aime24"),
    ("aime24/dapo_aime-2024.parquet", 30, "2", "540", "math_dapo"),  # 960 rows = 30 × 32 copies.
    ("aime25/matharena_aime25.jsonl", 30, "2025-I-1", "70", "aime25/matharena_aime25"),
    ("amc23/qwen25math_amc23_test.jsonl", 40, "0", "27", "amc23/qwen25math_amc23_test"),
    ("math500/test.jsonl", 500, "test/precalculus/807.json", r"\left( 3, \frac{\pi}{2} \right)",
     "math500/test"),
    ("math_level3to5_simplelr/test_math500.parquet", 500, "0", "-2 + 7i", "simplelr_qwen"),
    ("gsm8k/test.jsonl", 1319, "1", "18", "gsm8k/test"),
    ("dapo_math_17k/svs_MATH-AIME-Evaluation.jsonl", 560, "1", "216", "MATH-500"),
])
def test_known_schemas(path, count, first_id, first_answer, source):
  records = load(path)
  assert len(records) == count
  assert records[0][1:4] == (first_answer, first_id, source)
  assert all(r.prompt.strip() and r.answer for r in records)
  assert not any(r.prompt.startswith("Solve the following math problem") for r in records)


def test_answers_agree_across_copies():
  """The three AIME 2024 copies and the two MATH-500 copies have the same answers."""
  qwen = sorted(int(r.answer) for r in load("aime24/qwen25math_aime24_test.jsonl"))
  assert qwen == sorted(int(r.answer) for r in load("aime24/matharena_aime24.jsonl"))
  assert qwen == sorted(int(r.answer) for r in load("aime24/dapo_aime-2024.parquet"))
  assert [r.answer for r in load("aime25/matharena_aime25.jsonl")] == AIME25_ANSWERS
  assert (sorted(r.answer for r in load("math500/test.jsonl"))
          == sorted(r.answer for r in load("math_level3to5_simplelr/test_math500.parquet")))
  sources = collections.Counter(r.source for r in load("dapo_math_17k/svs_MATH-AIME-Evaluation.jsonl"))
  assert sources == {"MATH-500": 500, "AIME-2024-30": 30, "AIME-2025-30": 30}


def test_dapo_math_17k_both_formats_and_conflicts(tmp_path):
  import pyarrow.parquet as pq

  # The jsonl copy as its PROVENANCE.md derives it (byte for byte the shared copy, left out of data/).
  rows = pq.read_table(DATA / "dapo_math_17k/dapo_math_17k.parquet").to_pylist()
  write_jsonl(tmp_path / "dapo_math_17k.jsonl", [json.dumps(
      {"index": r["extra_info"]["index"], "problem": r["prompt"][0]["content"],
       "answer": r["reward_model"]["ground_truth"]}, ensure_ascii=False) for r in rows])
  raw_jsonl = load_records(str(tmp_path / "dapo_math_17k.jsonl"), dedup=False)
  raw_parquet = load("dapo_math_17k/dapo_math_17k.parquet", dedup=False)
  assert len(raw_jsonl) == len(raw_parquet) == 17917
  assert [(r.prompt, r.answer, r.id) for r in raw_jsonl] == [(r.prompt, r.answer, r.id) for r in raw_parquet]
  # PROVENANCE.md: 17,290 distinct texts, 11 of them with conflicting answers (exact text);
  # whitespace-normalised, 17,188 problems and 12 conflicts.
  assert len({r.prompt for r in raw_jsonl}) == 17290
  with pytest.warns(UserWarning, match="12 problems appear with conflicting answers"):
    kept, conflicts = deduplicate(raw_jsonl)
  assert len(kept) == 17188 and len(conflicts) == 12
  assert ("35", "179") in [c.ids[:2] for c in conflicts]
  assert all(len(set(c.answers)) > 1 for c in conflicts)


def test_real_bad_rows_in_simplelr_train():
  """Two rows of SimpleRL's training parquet have an empty ground truth."""
  path = str(DATA / "math_level3to5_simplelr/train.parquet")
  with pytest.raises(DataError, match=r"train\.parquet, row 5055, field 'reward_model\.ground_truth': "
                     "empty answer"):
    load_records(path)
  with pytest.warns(UserWarning, match=r"skipped 2 bad rows of 8523"):
    records = load_records(path, skip_bad_rows=True, dedup=False)
  assert len(records) == 8521


def write_jsonl(path, lines):
  path.write_text("\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines) + "\n")
  return str(path)


GOOD = {"problem": "1+1?", "answer": "2", "id": "a"}


@pytest.mark.parametrize("bad_line,message", [
    ({"answer": "2"}, r"line 2, field 'problem': missing"),
    ({"problem": "   ", "answer": "2"}, r"line 2, field 'problem': empty prompt"),
    ({"problem": "1+1?", "answer": ""}, r"line 2, field 'answer': empty answer"),
    ({"problem": "1+1?"}, r"line 2, field 'answer': missing"),
    ({"problem": "1+1?", "answer": None}, r"line 2, field 'answer': missing"),
    ({"problem": 12, "answer": "2"}, r"line 2, field 'problem': expected a string, got int"),
    ({"problem": "1+1?", "answer": ["2"]}, r"line 2, field 'answer': expected a string or a number, got list"),
    ({"problem": "1+1?", "answer": True}, r"line 2, field 'answer': expected a string or a number, got bool"),
    ({"problem": "1+1?", "answer": "2", "id": {"x": 1}}, r"line 2, field 'id': expected a string or an integer"),
    ('{"problem": "1+1?", "answer": ', r"line 2, field \(line\): malformed JSON"),
    ('["1+1?", "2"]', r"line 2, field \(row\): expected an object, got list"),
])
def test_bad_rows_name_file_line_and_field(tmp_path, bad_line, message):
  path = write_jsonl(tmp_path / "bad.jsonl", [GOOD, bad_line, GOOD | {"id": "c", "problem": "3+3?"}])
  with pytest.raises(DataError, match=str(tmp_path / "bad.jsonl").replace(".", r"\.") + ", " + message):
    load_records(path)
  with pytest.warns(UserWarning, match=r"bad\.jsonl: skipped 1 bad lines of 3; first: .*" + message):
    records = load_records(path, skip_bad_rows=True)
  assert [r.id for r in records] == ["a", "c"]


def test_bad_rows_in_json_and_parquet_are_numbered(tmp_path):
  import pyarrow as pa
  import pyarrow.parquet as pq

  rows = [GOOD, GOOD | {"problem": "2+2?", "answer": ""}]
  (tmp_path / "d.json").write_text(json.dumps(rows))
  with pytest.raises(DataError, match=r"d\.json, row 2, field 'answer': empty answer"):
    load_records(str(tmp_path / "d.json"))
  columns = {"problem": ["1+1?", "2+2?"], "answer": ["2", "4"]}
  (tmp_path / "cols.json").write_text(json.dumps(columns))
  assert [r.answer for r in load_records(str(tmp_path / "cols.json"))] == ["2", "4"]
  pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
  with pytest.raises(DataError, match=r"d\.parquet, row 2, field 'answer': empty answer"):
    load_records(str(tmp_path / "d.parquet"))
  (tmp_path / "broken.json").write_text('[{"problem": "1+1?",\n "answer": }]')
  with pytest.raises(DataError, match=r"broken\.json, line 2: malformed JSON"):
    load_records(str(tmp_path / "broken.json"))


def test_empty_and_unusable_datasets(tmp_path):
  with pytest.raises(DataError, match=r"empty\.jsonl: empty dataset \(0 lines"):
    load_records(write_jsonl(tmp_path / "empty.jsonl", [""]))
  all_bad = write_jsonl(tmp_path / "allbad.jsonl", [{"problem": "x", "answer": ""}] * 2)
  with pytest.raises(DataError, match=r"empty dataset \(2 lines, none valid\)"):
    with pytest.warns(UserWarning):
      load_records(all_bad, skip_bad_rows=True)
  with pytest.raises(DataError, match="no known schema has the keys \\['a', 'b'\\]"):
    load_records(write_jsonl(tmp_path / "keys.jsonl", [{"a": 1, "b": 2}]))
  with pytest.raises(DataError, match="no such file"):
    load_records(str(tmp_path / "missing.jsonl"))
  with pytest.raises(DataError, match=r"unknown file type '\.csv'"):
    (tmp_path / "x.csv").write_text("a,b\n")
    load_records(str(tmp_path / "x.csv"))
  gsm = write_jsonl(tmp_path / "gsm.jsonl", [{"question": "q", "answer": "so 5\n#### 1,200"},
                                             {"question": "q2", "answer": "no marker"}])
  with pytest.raises(DataError, match=r"line 2, field 'answer': no '####' marker"):
    load_records(gsm, schema="gsm8k")


def test_field_mapping_and_answer_types(tmp_path):
  rows = [{"q": {"text": "What is 2+2?"}, "sol": {"final": 4}, "uid": 7},
          {"q": {"text": "What is 1/2?"}, "sol": {"final": 0.5}, "uid": 8},
          {"q": {"text": "AMC style?"}, "sol": {"final": 27.0}, "uid": 9}]
  path = write_jsonl(tmp_path / "custom.jsonl", rows)
  records = load_records(path, prompt_field="q.text", answer_field="sol.final", id_field="uid",
                              source="mine")
  assert records == [Record("What is 2+2?", "4", "7", "mine"),
                     Record("What is 1/2?", "0.5", "8", "mine"),
                     Record("AMC style?", "27", "9", "mine")]
  gsm = write_jsonl(tmp_path / "gsm.jsonl", [{"question": "q", "answer": "so 5\n#### 1,200"}])
  assert load_records(gsm)[0][:3] == ("q", "1200", "1")


def test_deduplicate_reports_conflicts():
  records = [Record("Find  x.", "025", "1", "s"), Record("Find x.", "25", "2", "s"),
             Record("Find y.", "3", "3", "s"), Record(" Find y. ", "4", "4", "s")]
  with pytest.warns(UserWarning, match=r"1 problems appear with conflicting answers.*ids \['3', '4'\]"):
    kept, conflicts = deduplicate(records)
  assert [r.id for r in kept] == ["1", "3"]
  assert conflicts == [Conflict("Find y.", ("3", "4"), ("3", "4"))]


def test_dapo_template_matches_dapo_prompts():
  import pyarrow.parquet as pq

  rows = pq.read_table(DATA / "aime24/dapo_aime-2024.parquet").to_pylist()
  for row in rows:
    assert problems.format_prompt(row["extra_info"]["raw_problem"], template="dapo") == row["prompt"][0]["content"]
  assert problems.format_prompt("What is {x}?", template="boxed") == (
      "What is {x}?\nPlease reason step by step, and put your final answer within \\boxed{}.")


def test_chat_template_from_qwen_tokenizer():
  transformers = pytest.importorskip("transformers")
  tokenizer = transformers.AutoTokenizer.from_pretrained(str(DATA / "qwen2.5_tokenizer"), local_files_only=True)
  prompt = problems.format_prompt("What is 1+1?", template="raw", tokenizer=tokenizer)
  assert prompt == ("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
                    "assistant.<|im_end|>\n<|im_start|>user\nWhat is 1+1?<|im_end|>\n<|im_start|>assistant\n")


def _records(n):
  return [Record(f"p{i}", str(i), str(i), "s") for i in range(n)]


def test_epoch_orders_are_fixed_by_seed_and_epoch():
  a, b = permutation(50, seed=3, epoch=0), permutation(50, seed=3, epoch=0)
  np.testing.assert_array_equal(a, b)
  assert sorted(a) == list(range(50)) and list(a) != list(range(50))
  assert list(permutation(50, seed=4, epoch=0)) != list(a)
  assert list(permutation(50, seed=3, epoch=1)) != list(a)


def test_iterator_covers_each_epoch_and_resumes_exactly():
  records = _records(10)
  it = PromptIterator(records, prompts_per_step=4, seed=1)
  batches = [next(it) for _ in range(5)]  # 20 prompts: two full epochs.
  assert all(len(b) == 4 for b in batches)
  drawn = [r.id for b in batches for r in b]
  assert sorted(drawn[:10]) == sorted(drawn[10:]) == sorted(r.id for r in records)
  assert drawn[:10] != drawn[10:]  # Each epoch reshuffled.
  fresh = PromptIterator(records, prompts_per_step=4, seed=1)
  next(fresh), next(fresh)
  state = json.loads(json.dumps(fresh.state_dict()))  # Saved with a checkpoint.
  assert state["epoch"] == 0 and state["position"] == 8
  resumed = PromptIterator(records, prompts_per_step=4, seed=1)
  resumed.load_state_dict(state)
  assert [next(resumed) for _ in range(3)] == batches[2:]
  with pytest.raises(DataError, match="saved seed=1, but the data now has seed=2"):
    PromptIterator(records, prompts_per_step=4, seed=2).load_state_dict(state)
  with pytest.raises(DataError, match="fingerprint"):
    PromptIterator(_records(9) + [Record("p", "x", "9", "s")], prompts_per_step=4, seed=1).load_state_dict(state)


def test_huggingface_datasets(tmp_path):
  datasets = pytest.importorskip("datasets", reason="the optional `datasets` package is not installed")
  rows = [{"problem": "1+1?", "answer": "2", "id": "a"}, {"problem": "2+2?", "answer": "", "id": "b"}]
  datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
  with pytest.raises(DataError, match=r"saved, row 2, field 'answer': empty answer"):
    load_records(str(tmp_path / "saved"))
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    assert load_records(str(tmp_path / "saved"), skip_bad_rows=True) == [
        Record("1+1?", "2", "a", f"{tmp_path.name}/saved")]
  (tmp_path / "local").mkdir()
  write_jsonl(tmp_path / "local" / "test.jsonl", rows[:1])
  assert len(load_records(str(tmp_path / "local"), split="test")) == 1
  with pytest.raises(DataError, match="cannot load split 'train'"):
    load_records(str(tmp_path / "local"))


def _jsonl(path, rows):
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  return str(path)


def test_training_problems_that_are_evaluation_problems_are_warned_about_and_can_be_dropped(tmp_path):
  import dataclasses

  from vapo_jax.config import ExperimentConfig
  train = _jsonl(tmp_path / "train.jsonl", [{"id": f"t{i}", "problem": f"What is {i} + {i}?", "answer": str(2 * i)}
                                            for i in range(10)])
  held_out = _jsonl(tmp_path / "eval.jsonl", [{"id": "e0", "problem": "What is 3 +  3?", "answer": "6"},  # Spacing.
                                              {"id": "e1", "problem": "What is 30 + 30?", "answer": "60"}])
  base = ExperimentConfig(name="overlap")
  config = lambda train_path, eval_path, drop=False: dataclasses.replace(
      base, data=dataclasses.replace(base.data, train_path=train_path, drop_eval_overlap=drop, template="raw"),
      eval=dataclasses.replace(base.eval, path=eval_path))
  c = config(train, held_out)
  eval_rows = problems.eval_problems(c)
  with pytest.warns(UserWarning, match=r"1 of 10 training problems .* are also evaluation problems .* id 't3'"):
    assert len(problems.training_problems(c, eval_rows=eval_rows)) == 10
  said = []
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # Dropped as asked: said in the run's log, not warned about.
    kept = problems.training_problems(config(train, held_out, drop=True), eval_rows=eval_rows, say=said.append)
  assert [r.id for r in kept] == [f"t{i}" for i in range(10) if i != 3]
  assert len(said) == 1 and re.match(r"data: 1 of 10 training problems .* id 't3'; dropped from training", said[0])
  same = config(train, train)  # One file as both: every problem, by its text and answer.
  with pytest.warns(UserWarning, match="10 of 10 training problems"):
    problems.training_problems(same, eval_rows=problems.eval_problems(same))
  with pytest.raises(DataError, match="every one of its 10 training problems is an evaluation problem"), \
      warnings.catch_warnings():
    warnings.simplefilter("ignore")
    problems.training_problems(config(train, train, drop=True), eval_rows=problems.eval_problems(same))
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # No overlap: no warning.
    assert len(problems.training_problems(config(train, None), eval_rows=[])) == 10


def test_the_default_experiments_held_out_problems_are_none_of_its_training_problems():
  from experiments import tiny, toy
  for config in (tiny.tiny(), toy.vapo()):
    held_out, said = problems.eval_problems(config), []
    for path in (config.data.train_path, config.sft.path):
      kept = problems.training_problems(config, eval_rows=held_out, path=path, say=said.append)
      assert kept and problems.eval_overlap(kept, held_out) == [], (config.name, path)
    assert len(said) == 2 and all("dropped from training" in line for line in said), said
  config = tiny.tiny()  # Enough to measure: at least 256 held-out problems, of every term count the task trains on.
  held_out, trained = problems.eval_problems(config), problems.load_problems(config.data.train_path, config)
  assert len(held_out) >= 256 and {r.level for r in held_out} == {r.level for r in trained}, len(held_out)


def test_two_files_numbering_their_rows_from_zero_share_no_problem_by_their_ids(tmp_path):
  """verl-style files of one `data_source`, each numbering `extra_info.index` from 0: the overlap is the same
  problem text and answer, never the (source, id) pair; a problem with the same text and another answer is
  another problem."""
  import dataclasses

  from vapo_jax.config import ExperimentConfig
  row = lambda i, text, answer: {"data_source": "math", "prompt": [{"role": "user", "content": text}],
                                 "reward_model": {"ground_truth": answer}, "extra_info": {"index": i}}
  train = _jsonl(tmp_path / "train.jsonl", [row(i, f"Train problem {i}.", str(i)) for i in range(6)])
  held_out = _jsonl(tmp_path / "eval.jsonl", [row(0, "Held-out problem.", "1"), row(1, "Train problem 4.", "4"),
                                              row(2, "Train problem 5.", "50")])
  base = ExperimentConfig(name="overlap")
  config = dataclasses.replace(base, data=dataclasses.replace(base.data, train_path=train, drop_eval_overlap=True,
                                                              template="raw"),
                               eval=dataclasses.replace(base.eval, path=held_out))
  eval_rows = problems.eval_problems(config)
  assert {(r.source, r.id) for r in eval_rows} <= {(r.source, r.id) for r in problems.load_problems(train, config)}
  said = []
  kept = problems.training_problems(config, eval_rows=eval_rows, say=said.append)
  assert [r.prompt for r in kept] == [f"Train problem {i}." for i in (0, 1, 2, 3, 5)]  # Only problem 4 is shared.
  assert len(said) == 1 and "1 of 6 training problems" in said[0]
