"""A synthetic reasoning task with verifiable answers, for CPU-sized end-to-end runs.

Multi-step addition written out step by step: each line adds the first two numbers of the line
before it and copies the rest, so the problem "7+5+9+3=" has the chain of thought

  12+9+3
  21+3
  24
  Answer: 24

A problem with k terms needs k − 1 steps; its response length grows several-fold from 2 to `max_terms` terms
(quadratically), and longer problems are harder (more steps to get right). Answers are integers, scored by the
same verifier as real math data (the `Answer:` line).

The "chain" task writes a running total instead (a linear-length alternative), one addition per line,
so the response grows linearly, about 8 bytes a term: "7+5+9+3=" →

  7+5=12
  12+9=21
  21+3=24
  Answer: 24

From 2 to 20 terms that is 17 to about 175 tokens with the byte tokenizer (over 10× within one
batch), and one slip anywhere in the chain makes the final answer wrong.
"""

import numpy as np

from vapo_jax.data.records import Record


def solution(terms: list[int]) -> tuple[str, int]:
  """The step-by-step response for adding `terms`, and the answer."""
  lines, rest = [], list(terms)
  while len(rest) > 1:
    rest = [rest[0] + rest[1]] + rest[2:]
    lines.append("+".join(map(str, rest)))
  lines.append(f"Answer: {rest[0]}")
  return "\n".join(lines), rest[0]


def make_problems(count: int, *, seed: int, min_terms: int = 2, max_terms: int = 7,
                  max_digit: int = 9) -> list[dict]:
  """`count` problems as rows with `problem`, `answer`, `solution` and `id` fields."""
  return _problems(count, seed=seed, terms=(min_terms, max_terms), max_digit=max_digit, solve=solution,
                   name="add")


def chain_solution(terms: list[int]) -> tuple[str, int]:
  """The running-total response for adding `terms` ("a+b=s" per line, then "Answer: s"), and the answer."""
  lines, total = [], terms[0]
  for term in terms[1:]:
    lines.append(f"{total}+{term}={total + term}")
    total += term
  lines.append(f"Answer: {total}")
  return "\n".join(lines), total


def make_chain_problems(count: int, *, seed: int, min_terms: int = 2, max_terms: int = 20,
                        max_digit: int = 9) -> list[dict]:
  """`count` running-total problems (`problem`, `answer`, `solution`, `id`, `source` fields).

  The number of terms is uniform over [min_terms, max_terms], so every length is equally common.
  """
  if not 2 <= min_terms <= max_terms:
    raise ValueError(f"chain task needs 2 <= min_terms <= max_terms, got terms={min_terms}-{max_terms}")
  rows = _problems(count, seed=seed, terms=(min_terms, max_terms), max_digit=max_digit, solve=chain_solution,
                   name="chain")
  return [row | {"source": "chain"} for row in rows]


def _problems(count: int, *, seed: int, terms: tuple[int, int], max_digit: int, solve,
              name: str) -> list[dict]:
  """`count` sums of a uniform number of terms in [terms] of digits 1..max_digit, solved by `solve`."""
  rng = np.random.default_rng(seed)
  rows = []
  for i in range(count):
    numbers = rng.integers(1, max_digit + 1, int(rng.integers(terms[0], terms[1] + 1))).tolist()
    text, answer = solve(numbers)
    rows.append({"id": f"{name}-{seed}-{i}", "problem": "+".join(map(str, numbers)) + "=",
                 "answer": str(answer),
                 "solution": text, "level": len(numbers)})  # Its level: the number of terms.
  return rows


def to_records(rows: list[dict]) -> list[Record]:
  return [Record(prompt=r["problem"], answer=r["answer"], id=r["id"], source=r.get("source", "arithmetic"),
                 solution=r.get("solution"), level=r.get("level")) for r in rows]


TASKS = {"arithmetic": (make_problems, "2-7"), "chain": (make_chain_problems, "2-20")}


def from_spec(spec: str) -> list[dict]:
  """Rows for "synthetic:arithmetic?terms=2-7&count=4000&seed=0" or "synthetic:chain?terms=2-20&..."
  (every key optional)."""
  import urllib.parse
  scheme, _, rest = spec.partition(":")
  name, _, query = rest.partition("?")
  if scheme != "synthetic" or name not in TASKS:
    raise ValueError(f"unknown synthetic task {spec!r}; expected synthetic:<task>?terms=2-7&count=N&seed=S "
                     f"with <task> one of {', '.join(TASKS)}")
  options = dict(urllib.parse.parse_qsl(query))
  unknown = set(options) - {"terms", "count", "seed"}
  if unknown:
    raise ValueError(f"{spec!r}: unknown options {sorted(unknown)} (known: terms, count, seed)")
  make, default_terms = TASKS[name]
  low, _, high = options.get("terms", default_terms).partition("-")
  return make(int(options.get("count", 4000)), seed=int(options.get("seed", 0)),
              min_terms=int(low), max_terms=int(high or low))


def is_spec(path: str | None) -> bool:
  return bool(path) and path.startswith("synthetic:")
