"""The synthetic tasks: the arithmetic task's problems stay the same for a seed (the tiny and toy
experiments' data), and the chain task's responses are running sums whose length grows linearly."""

import hashlib
import json

import pytest

from vapo_jax.data import tasks
from vapo_jax.data.tokenizer import ByteTokenizer


def test_arithmetic_problems_are_fixed_by_their_seed():
  rows = tasks.from_spec("synthetic:arithmetic?terms=2-5&count=4000&seed=0")  # docs/results.md's earlier runs.
  assert rows[0] == {"id": "add-0-0", "problem": "6+5+3+3+1=", "answer": "18",
                     "solution": "11+3+3+1\n14+3+1\n17+1\n18\nAnswer: 18", "level": 5}  # Level: its terms.
  # The problems as they were before rows carried their level (the digest of every other field).
  digest = hashlib.sha256(json.dumps([{k: v for k, v in r.items() if k != "level"} for r in rows]).encode()).hexdigest()
  assert digest == "ef485c5a8bb6dcdf245e8c0adea19e06f1866e1798c40657e4224039bce0f260"


def test_toy_arithmetic_lengths_vary_tenfold():
  lengths = [len(ByteTokenizer().encode(r["solution"])) + 1  # + EOS
             for r in tasks.from_spec("synthetic:arithmetic?terms=2-11&count=4000&seed=0")]
  assert min(lengths) <= 14 and max(lengths) >= 10 * min(lengths)


def test_chain_solution_is_a_running_sum():
  text, answer = tasks.chain_solution([7, 5, 9, 3])
  assert (text, answer) == ("7+5=12\n12+9=21\n21+3=24\nAnswer: 24", 24)
  rows = tasks.from_spec("synthetic:chain?terms=2-20&count=500&seed=3")
  for row in rows:
    terms = [int(t) for t in row["problem"].rstrip("=").split("+")]
    assert 2 <= len(terms) <= 20 and row["answer"] == str(sum(terms)) and row["source"] == "chain"
    assert row["solution"].count("\n") == len(terms) - 1
  lengths = [len(r["solution"]) + 1 for r in rows]
  assert max(lengths) >= 10 * min(lengths)


def test_unknown_task_or_option_is_refused():
  with pytest.raises(ValueError, match="arithmetic, chain"):
    tasks.from_spec("synthetic:multiply?count=3")
  with pytest.raises(ValueError, match="unknown options"):
    tasks.from_spec("synthetic:chain?digits=3")
  with pytest.raises(ValueError, match="min_terms"):
    tasks.from_spec("synthetic:chain?terms=1-4")
