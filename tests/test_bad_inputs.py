"""A user's mistake or a damaged file is one line naming the file, row and field, or the setting: a lone UTF-16
surrogate in a problem, an answer or a demonstration (skipped and counted under `data.skip_bad_rows`), a KV-cache
budget that is not a finite number, and `make eval` sampling through the sealed compilation cache."""

import json

import pytest

from vapo_jax.cli import resolve
from vapo_jax.data.records import load_records
from vapo_jax.errors import ConfigError, DataError


def _jsonl(path, rows) -> str:
  path.write_text("".join(json.dumps(row) + "\n" for row in rows))  # json.dumps writes "\ud83d" as an escape.
  return str(path)


@pytest.mark.parametrize("field", ["problem", "answer", "solution"])
def test_a_lone_surrogate_is_named_with_file_row_and_field_and_skipped_when_asked(tmp_path, field):
  rows = [{"problem": "1+1", "answer": "2", "solution": "2"}, {"problem": "2+2", "answer": "4", "solution": "4"}]
  rows[1][field] = "4\ud83d" if field != "problem" else "2+2\ud83d"
  at = len(rows[1][field]) - 1
  path = _jsonl(tmp_path / "rows.jsonl", rows)
  with pytest.raises(DataError, match=rf"^{path}, line 2, field '{field}': a lone UTF-16 surrogate '\\ud83d' at "
                                      rf"character {at} .*not text a tokenizer can encode$"):
    load_records(path)
  with pytest.warns(UserWarning, match=r"skipped 1 bad lines of 2; first: .*line 2, field .*surrogate"):
    kept = load_records(path, skip_bad_rows=True)
  assert [r.answer for r in kept] == ["2"]


@pytest.mark.parametrize("value", ["inf", "1e400", "nan", "-1"])
def test_a_kv_cache_budget_that_is_not_a_finite_positive_number_is_one_line(value):
  with pytest.raises(ConfigError, match=r"kv_cache_budget_gib must be a finite number > 0 \(GiB\)"):
    resolve.resolve(["--exp", "tiny", f"rollout.kv_cache_budget_gib={value}"])


def test_make_eval_samples_through_the_sealed_compilation_cache(tmp_path, monkeypatch):
  """`make eval CKPT=` installs the checked cache before it samples, as `make train` does."""
  from vapo_jax import compile_cache
  from vapo_jax.cli import evaluate
  order = []
  monkeypatch.setattr(compile_cache, "install", lambda *a, **k: order.append("install") or "sealed")

  def sample(config, ckpt, path, **_):
    order.append("sample")
    return _jsonl(tmp_path / "responses.jsonl", [{"id": "0", "answer": "2", "response": "Answer: 2"}])
  monkeypatch.setattr(evaluate, "sample_from_checkpoint", sample)
  held_out = _jsonl(tmp_path / "eval.jsonl", [{"id": "0", "problem": "1+1", "answer": "2"}])
  status = evaluate.main(["--exp", "tiny", "--ckpt", str(tmp_path / "ckpt"), "--out", str(tmp_path / "out"),
                          f"eval.path={held_out}", "reward.verifier_workers=1"])
  assert status == 0 and order == ["install", "sample"]
