"""Answer extraction, equivalence, the verifier pool (time-outs, crashes) and reward functions."""

import csv
import os
import resource
import time

import numpy as np
import pytest

from vapo_jax.paths import DATA_DIR
from vapo_jax.rewards import equivalence, extract, reward
from vapo_jax.rewards.pool import DEFAULT_FN, VerifierPool, load_function

CASES = DATA_DIR / "verifier_cases" / "math_verify_examples"
FREE_TEXT = ("boxed", "answer_line", "math_verify")
GSM8K = ("boxed", "answer_line", "last_number")

# (response, forms, expected answer, expected form)
EXTRACTION_CASES = [
    (r"so $\boxed{\frac{1}{\sqrt{2}}}$ is it", extract.DEFAULT_FORMS, r"\frac{1}{\sqrt{2}}", "boxed"),
    (r"nested: \boxed{\boxed{5}}", extract.DEFAULT_FORMS, "5", "boxed"),
    (r"\boxed{3} first, then \boxed{5}", extract.DEFAULT_FORMS, "5", "boxed"),
    (r"spaced form \boxed 7$ done", extract.DEFAULT_FORMS, "7", "boxed"),
    (r"a set \boxed{\{1, 2\}}.", extract.DEFAULT_FORMS, r"\{1, 2\}", "boxed"),
    (r"matrix \boxed{\begin{pmatrix} 1 & 2 \\ 3 & 4 \end{pmatrix}}",
     extract.DEFAULT_FORMS, r"\begin{pmatrix} 1 & 2 \\ 3 & 4 \end{pmatrix}", "boxed"),
    (r"\fbox{12}", extract.DEFAULT_FORMS, "12", "boxed"),
    ("Work.\nAnswer: 25", extract.DEFAULT_FORMS, "25", "answer_line"),
    ("Answer: $\\boxed{025}$.", extract.DEFAULT_FORMS, "025", "answer_line"),
    ("**Final Answer:** $\\dfrac{3}{4}$", extract.DEFAULT_FORMS, r"\dfrac{3}{4}", "answer_line"),
    ("scratch \\boxed{24}\nAnswer: 25", extract.DEFAULT_FORMS, "25", "answer_line"),
    ("Answer: $5$ minutes", extract.DEFAULT_FORMS, "5", "answer_line"),
    ("Answer: $18", extract.DEFAULT_FORMS, "$18", "answer_line"),
    ("Answer: 24, wait.\nSo \\boxed{25}", extract.DEFAULT_FORMS, "25", "boxed"),
    ("The total is 1,234 dollars.", GSM8K, "1234", "last_number"),
    ("She pays $18.50 in all.", GSM8K, "18.50", "last_number"),
    ("it drops to -3 degrees", GSM8K, "-3", "last_number"),
    ("I am not sure about 42.", extract.DEFAULT_FORMS, None, "none"),
    ("no answer at all", GSM8K, None, "none"),
    (r"truncated \boxed{\frac{1}{2", extract.DEFAULT_FORMS, None, "none"),
    ("", extract.ALL_FORMS, None, "none"),
]
# The answer lines of bilingual (Chinese) math data, and lines that mention 答案 without giving one.
CHINESE_EXTRACTION_CASES = [
    ("计算过程。\n答案：2", extract.DEFAULT_FORMS, "2", "answer_line"),
    ("答案: 2", extract.DEFAULT_FORMS, "2", "answer_line"),
    ("最终答案：$\\frac{4}{3}$", extract.DEFAULT_FORMS, r"\frac{4}{3}", "answer_line"),
    ("Answer：2", extract.DEFAULT_FORMS, "2", "answer_line"),  # The full-width colon of a Chinese keyboard.
    ("答：7", extract.DEFAULT_FORMS, "7", "answer_line"),
    ("所以答案是 5。", extract.DEFAULT_FORMS, "5", "answer_line"),
    ("因此答案为 $12$，", extract.DEFAULT_FORMS, "12", "answer_line"),
    ("**答案**：$\\boxed{9}$。", extract.DEFAULT_FORMS, "9", "answer_line"),
    ("先写 \\boxed{3}\n最终答案：4", extract.DEFAULT_FORMS, "4", "answer_line"),
    ("我们来找答案。", extract.DEFAULT_FORMS, None, "none"),
    ("答案在最后给出", extract.DEFAULT_FORMS, None, "none"),
]


@pytest.mark.parametrize("response,forms,answer,form", EXTRACTION_CASES + CHINESE_EXTRACTION_CASES)
def test_extraction(response, forms, answer, form):
  got = extract.extract_answer(response, forms=forms)
  assert (got.answer, got.form) == (answer, form)
  assert got.formatted == (form in ("boxed", "answer_line"))


# (prediction, gold, expected)
EQUIVALENCE_CASES = [
    (r"\frac{1}{2}", "0.5", True),
    (r"\dfrac{1}{2}", r"\frac12", True),
    ("1/2", r"\frac{1}{2}", True),
    (r"\frac{1}{3}", "0.33", False),
    (r"\tfrac{3}{4}", "0.75", True),
    (r"10\%", "10", True),
    ("10", r"10\%", True),
    (r"20\%", "10", False),
    (r"5\text{ cm}", "5", True),
    (r"12 \text{ inches}", "12", True),
    (r"90^\circ", "90", True),
    (r"\$18.90", "18.90", True),
    ("$18", "18", True),
    ("025", "25", True),
    ("25", "025", True),
    ("25", "026", False),
    ("27", "27.0", True),  # AMC 2023 stores answers as floats.
    ("1,000", "1000", True),
    (r"1\,000", "1000", True),
    ("22099999999999998951424", "22099999999999998951425", False),  # Exact, not float.
    (r"\frac{50}{2}", "25", True),  # Integer gold, non-integer spelling: math-verify.
    ("[1, 2)", "[1,2)", True),
    ("(1, 2]", "[1, 2]", False),
    (r"(-\infty, 3]", r"(-\infty,3]", True),
    (r"x \in [-2,7]", "[-2,7]", True),
    (r"\begin{pmatrix}1&2\\3&4\end{pmatrix}", r"\begin{bmatrix}1&2\\3&4\end{bmatrix}", True),
    (r"\begin{pmatrix}1&2\\3&4\end{pmatrix}", r"\begin{pmatrix}1&2\\3&5\end{pmatrix}", False),
    (r"(3, \frac{\pi}{2})", r"\left( 3, \frac{\pi}{2} \right)", True),
    (r"(3, \pi)", r"\left( 3, \frac{\pi}{2} \right)", False),
    (r"\{2, 1\}", r"\{1,2\}", True),
    (r"\sqrt{8}", r"2\sqrt{2}", True),
    ("x^2+2x+1", "(x+1)^2", True),
    (r"\text{Monday}", "Monday", True),
    ("24", "25", False),
]


@pytest.mark.parametrize("pred,gold,expected", EQUIVALENCE_CASES)
def test_equivalence(pred, gold, expected):
  assert equivalence.is_equivalent(pred, gold) == expected


def test_integer_answers_compare_exactly_without_sympy():
  """AIME-style integer golds: exact integer comparison, math-verify (sympy) is not called."""
  before = equivalence.parse_answer.cache_info()
  assert equivalence.is_equivalent("025", "25") and equivalence.is_equivalent("25", "025")
  assert not equivalence.is_equivalent("24", "025")
  assert equivalence.is_equivalent("$1{,}000$", "1000") and equivalence.is_equivalent("-7", "-7.0")
  assert not equivalence.is_equivalent("1" + "0" * 30, "1" + "0" * 29 + "1")
  assert equivalence.parse_answer.cache_info() == before
  assert equivalence.as_integer("3.5") is None and equivalence.as_integer(r"\boxed{-012}") == -12


def test_score_response_without_answer_is_incorrect():
  assert equivalence.score_response("I give up.", "5") == equivalence.Verdict(False, None, "none")
  assert equivalence.score_response("so \\boxed{5}", "5") == equivalence.Verdict(True, "5", "boxed")


def _csv(name):
  with open(CASES / name, newline="") as f:
    return list(csv.DictReader(f))


def test_math_verify_shipped_examples():
  """Math-Verify's example outputs: each free-text answer equals its gold, parsed as upstream."""
  rows, outputs = _csv("model_outputs.csv"), _csv("output.csv")
  assert len(rows) == len(outputs) == 6
  for row, output in zip(rows, outputs):
    assert output["original_answer"] == row["answer"]
    verdict = equivalence.score_response(row["answer"], row["gold"], forms=FREE_TEXT)
    assert verdict.correct and verdict.form == "math_verify", (row, verdict)
    parsed = equivalence.parse_free_text(row["answer"])
    assert str(parsed[0]) == output["extracted_answer"]
    # And a different gold is rejected.
    assert not equivalence.score_response(row["answer"], "$17$", forms=FREE_TEXT).correct


# Workers import these by path ("test_rewards:..."): the tests folder is on sys.path under pytest.
def flaky_verifier(response: str, answer: str):
  """A user reward function that hangs on "hang", dies on "crash" and raises on "raise"."""
  if response == "hang":
    time.sleep(10_000)
  if response == "crash":
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # No core file in the working directory.
    os.abort()  # SIGABRT: what a segfault in a C extension looks like to the parent.
  if response == "raise":
    raise ZeroDivisionError("boom")
  if response == "oom":
    return len(bytearray(8 * 2**30))  # 8 GiB, over the pool's 1 GiB address-space limit.
  if response == "score":
    return 0.25
  if response == "junk":
    return "not a score"
  return response == answer


@pytest.fixture(scope="module")
def flaky_pool():
  with VerifierPool(fn="test_rewards:flaky_verifier", workers=2, timeout_s=1.0, chunk_size=4,
                    memory_limit_mb=1024) as pool:
    yield pool


def test_pool_times_out_and_survives_crashes(flaky_pool):
  tasks = [("a", "a"), ("hang", "x"), ("b", "c"), ("crash", "x"), ("d", "d"), ("raise", "x"), ("oom", "x")] * 2
  start = time.perf_counter()
  outcomes = flaky_pool.map(tasks)
  elapsed = time.perf_counter() - start
  statuses = [o.status for o in outcomes]
  assert statuses == ["ok", "timeout", "ok", "crash", "ok", "error", "error"] * 2
  assert [o.value for o in outcomes[:3:2]] == [True, False]
  assert "ZeroDivisionError" in outcomes[5].value and "MemoryError" in outcomes[6].value
  assert elapsed < 15, f"two 1 s time-outs took {elapsed:.1f}s"
  # The pool is still whole: every worker is alive and a new batch runs normally.
  assert flaky_pool.map([("e", "e")] * 8) == [(True, "ok")] * 8


def test_user_reward_function_scores_failures_incorrect(flaky_pool):
  batch = reward.compute_rewards(flaky_pool, ["a", "hang", "crash", "b", "score", "junk"],
                                 ["a", "a", "a", "a", "a", "a"], correct_reward=1.0, incorrect_reward=-1.0)
  np.testing.assert_allclose(batch.rewards, [1.0, -1.0, -1.0, -1.0, 0.25, -1.0])
  assert batch.statuses == ["ok", "timeout", "crash", "ok", "ok", "error"]
  assert batch.correct.tolist() == [True, False, False, False, False, False]
  assert batch.metrics["reward/verifier_timeouts"] == 1
  assert batch.metrics["reward/verifier_crashes"] == 1
  assert batch.metrics["reward/verifier_errors"] == 1


@pytest.fixture(scope="module")
def verifier_pool():
  with VerifierPool(workers=2, timeout_s=2.0) as pool:
    yield pool


def test_real_verifier_hang_times_out(verifier_pool):
  """sympy evaluates 9^(9^(9^9)) forever: the response scores incorrect, the batch completes."""
  responses = [r"\boxed{9^{9^{9^{9}}}}", r"\boxed{\frac{1}{2}}", "Answer: 0.5", "no answer"]
  batch = reward.compute_rewards(verifier_pool, responses, [r"\frac{1}{2}"] * 4)
  assert batch.statuses == ["timeout", "ok", "ok", "ok"]
  assert batch.correct.tolist() == [False, True, True, False]
  assert batch.forms == ["none", "boxed", "answer_line", "none"]
  np.testing.assert_allclose(batch.rewards, [-1, 1, 1, -1])
  assert batch.metrics["reward/verifier_timeouts"] == 1
  assert batch.metrics["reward/no_answer_frac"] == 0.25


def test_verifier_throughput(verifier_pool):
  """A few thousand responses (AIME-style integers and LaTeX fractions), verified in parallel."""
  rng = np.random.default_rng(0)
  golds = [str(g) for g in rng.integers(0, 1000, 3000)]
  responses = [f"Some reasoning with 17 and $x^2$.\n\\boxed{{{g if i % 2 else int(g) + 1}}}"
               for i, g in enumerate(golds)]
  fractions = [(f"so \\boxed{{\\frac{{{i}}}{{{i + 1}}}}}", f"\\frac{{{2 * i}}}{{{2 * i + 2}}}")
               for i in range(1, 201)]
  batch = reward.compute_rewards(verifier_pool, responses + [r for r, _ in fractions],
                                 golds + [g for _, g in fractions])
  expected = [i % 2 == 1 for i in range(3000)] + [True] * 200
  assert batch.correct.tolist() == expected
  rate = batch.metrics["perf/verify_responses_per_s"]
  print(f"\nverifier: {len(expected)} responses in {batch.metrics['time/verify_s']:.2f}s = {rate:.0f}/s "
        f"on {verifier_pool.num_workers} workers")
  assert rate > 100


def test_overlong_penalty_closed_form():
  lengths = np.array([0, 60, 80, 81, 90, 100, 130])
  got = reward.overlong_penalty(lengths, max_response_tokens=100, buffer_tokens=20, penalty_factor=0.5)
  np.testing.assert_allclose(got, [0, 0, 0, -0.5 / 20, -0.5 * 10 / 20, -0.5, -0.5], rtol=1e-6)
  np.testing.assert_array_equal(
      reward.overlong_penalty(lengths, max_response_tokens=100, buffer_tokens=0), np.zeros(7))


def test_verifier_and_format_rewards():
  np.testing.assert_array_equal(reward.verifier_reward(np.array([True, False]), correct_reward=2.0,
                                                       incorrect_reward=0.0), [2.0, 0.0])
  np.testing.assert_array_equal(reward.format_penalty(np.array([True, False]), penalty=-0.5), [0.0, -0.5])


def test_combined_rewards(verifier_pool):
  """Score + overlong + format terms; a GSM8K-style last-number answer counts but is unformatted."""
  responses = ["\\boxed{7}", "Answer: 8", "so it is 7", "\\boxed{7}"]
  batch = reward.compute_rewards(
      verifier_pool, responses, ["7"] * 4, np.array([10, 10, 10, 95]), forms=GSM8K,
      max_response_tokens=100, overlong_buffer_tokens=10, overlong_penalty_factor=1.0,
      format_penalty_value=-0.5)
  np.testing.assert_allclose(batch.rewards, [1.0, -1.0, 1.0 - 0.5, 1.0 - 0.5], rtol=1e-6)
  assert batch.forms == ["boxed", "answer_line", "last_number", "boxed"]


def test_bad_function_path_fails_early():
  with pytest.raises(ValueError, match="cannot load function"):
    load_function("vapo_jax.rewards.nope:fn")
  with pytest.raises(ValueError, match="not of the form"):
    VerifierPool(fn="nodots", workers=1)
  assert load_function(DEFAULT_FN) is equivalence.score_response
