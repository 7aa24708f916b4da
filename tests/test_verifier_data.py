"""The verifier on every problem of AIME 2024, AIME 2025, AMC 2023 and MATH-500 in data/ (MATH-500 in make
test-slow, for time).

For each problem: a response ending in its gold answer (boxed, and in the `Answer:` form) must
score correct, and responses ending in another problem's gold answer must score incorrect unless
the two answers are the same. Run with `-s` to see the agreement table.
"""


import pytest

from vapo_jax.data.records import load_records
from vapo_jax.paths import DATA_DIR as DATA
from vapo_jax.rewards import reward
from vapo_jax.rewards.accuracy import answer_key
from vapo_jax.rewards.pool import VerifierPool

DATASETS = {
    "aime24": "aime24/qwen25math_aime24_test.jsonl",
    "aime25": "aime25/matharena_aime25.jsonl",
    "amc23": "amc23/qwen25math_amc23_test.jsonl",
    "math500": "math500/test.jsonl",
}
# Different strings with the same value, which the verifier rightly accepts for each other.
SAME_VALUE = {("5", "x=5"), ("x=5", "5")}
OFFSETS = (1, 7)  # Problem i is answered with the gold of problem i + offset.


def _response(problem: str, answer: str, form: str) -> str:
  reasoning = f"Restating the problem: {problem}\nWe compute $1 + 1 = 2$, then 3/4 of 12 is 9."
  if form == "boxed":
    return f"{reasoning}\nTherefore the final answer is $\\boxed{{{answer}}}$."
  return f"{reasoning}\nAnswer: {answer}"


@pytest.fixture(scope="module")
def agreement():
  """dataset → (accepted gold responses, gold responses, rejected wrong, wrong, failures), computed when asked."""
  found = {}
  with VerifierPool(workers=2, timeout_s=20.0) as pool:
    def of(name: str) -> dict:
      if name not in found:
        found[name] = _agreement(pool, name)
      return found[name]
    yield of


def _agreement(pool: VerifierPool, name: str) -> dict:
  tasks, meta = [], []
  records = load_records(str(DATA / DATASETS[name]), dedup=False)
  for i, record in enumerate(records):
    for form in ("boxed", "answer_line"):
      tasks.append((_response(record.prompt, record.answer, form), record.answer))
      meta.append(("gold", record, record.answer, form))
    for offset in OFFSETS:
      other = records[(i + offset) % len(records)].answer
      form = ("boxed", "answer_line")[i % 2]
      tasks.append((_response(record.prompt, other, form), record.answer))
      meta.append(("wrong", record, other, form))
  batch = reward.compute_rewards(pool, [t[0] for t in tasks], [t[1] for t in tasks])
  table = {"gold": [0, 0], "wrong": [0, 0], "misses": []}
  for (kind, record, given, form), correct, status in zip(meta, batch.correct, batch.statuses):
    same = answer_key(given) == answer_key(record.answer) or (record.answer, given) in SAME_VALUE
    expected = kind == "gold" or same
    row = table[kind]
    row[0] += correct == expected
    row[1] += 1
    if correct != expected:
      table["misses"].append((record.id, kind, form, record.answer, given, status))
  (a, n), (r, m) = table["gold"], table["wrong"]
  print(f"\nverifier agreement (gold accepted / wrong rejected): {name:8s} {a}/{n} = {100 * a / n:.1f}%   "
        f"{r}/{m} = {100 * r / m:.1f}%")
  for miss in table["misses"]:
    print(f"    miss: id {miss[0]} {miss[1]} ({miss[2]}): gold {miss[3]!r}, response answer {miss[4]!r}, "
          f"status {miss[5]}")
  return table


# MATH-500 (2,000 responses, 8 s) in make test-slow, for time; the AIME and AMC sets in make test.
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n == "math500" else n for n in DATASETS])
def test_gold_answers_accepted_and_others_rejected(agreement, name):
  row = agreement(name)
  assert row["gold"][1] == 2 * row["wrong"][1] // len(OFFSETS) > 0
  assert not row["misses"], f"{name}: {len(row['misses'])} disagreements: {row['misses'][:10]}"
