"""Answer equivalence: exact integers for AIME-style answers, math-verify for everything else.

  is_equivalent("25", "025")                    → True   (integer gold: exact integer comparison)
  is_equivalent(r"\\frac{1}{2}", "0.5")          → True   (math-verify: symbolic / numeric)
  score_response(response, gold, forms=...)     → Verdict(correct, answer, form)

math-verify (huggingface/Math-Verify) parses LaTeX and plain answers into sympy and compares
them (numbers within 6 decimals, symbolic equality, sets, intervals, matrices, relations,
percentages, units removed). Its own signal-based time-outs are switched off here: the time-out
is the verifier pool's (`pool.py`), which kills a worker stuck in sympy. Called in-process, these
functions have no time limit. It is imported at the first answer parsed, not with this module: the
programs of a run (`make memory`, the GPU check) compile without it.
"""

import functools
import logging
import re
from typing import NamedTuple

from vapo_jax.kinds import AnswerForm
from vapo_jax.rewards.extract import DEFAULT_FORMS, extract_answer, unwrap

# We deliberately pass timeout=None (the pool enforces time-outs); silence the warning about it.
logging.getLogger("math_verify").setLevel(logging.ERROR)

_INTEGER = re.compile(r"^[+-]?\d+(?:\.0*)?$")
_THOUSANDS = re.compile(r"(?<=\d)(?:,|\{,\}|\\,|\\!|\s)(?=\d{3}(?!\d))")
_SPACING = re.compile(r"\\[,;:! ]|\\quad|\\qquad|\s+")
_FORMATTING = re.compile(r"\\left|\\right|\\displaystyle|\^\{?\\circ\}?|\\%|%|\$")
_TEXT = re.compile(r"\\(?:text|textbf|mathrm|mbox)\{([^{}]*)\}")


class Verdict(NamedTuple):
  """The verifier's judgement of one response."""

  correct: bool
  answer: str | None  # The extracted answer (None: no answer found).
  form: str  # How it was found: a `kinds.AnswerForm`, or "none".


def as_integer(text: str) -> int | None:
  """`text` as an exact integer when it is written as one ("025", "-3", "1,000", "27.0")."""
  text = unwrap(text)
  text = _THOUSANDS.sub("", text).replace(" ", "")
  if not _INTEGER.match(text):
    return None
  return int(text.split(".")[0])


def canonical(text: str) -> str:
  """A formatting-free spelling for a cheap exact comparison (same value, same string)."""
  text = unwrap(text)
  text = _TEXT.sub(r"\1", text)
  text = text.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
  text = _FORMATTING.sub("", text)
  return _SPACING.sub("", text)


@functools.lru_cache(maxsize=8192)
def parse_answer(text: str) -> tuple:
  """math-verify's parse of one answer string: `(sympy object, latex string)`, or `()`."""
  import math_verify

  parsed = math_verify.parse("\\boxed{" + text + "}", extraction_config=[math_verify.LatexExtractionConfig()],
                             parsing_timeout=None)
  if not parsed:
    parsed = math_verify.parse(text, extraction_config=[math_verify.ExprExtractionConfig()],
                               parsing_timeout=None)
  return tuple(parsed)


@functools.lru_cache(maxsize=1024)
def parse_free_text(text: str) -> tuple:
  """math-verify's extraction from free text (its last LaTeX or plain expression), parsed."""
  import math_verify

  return tuple(math_verify.parse(text, parsing_timeout=None))


def _verify(gold: tuple, pred: tuple) -> bool:
  import math_verify

  return bool(gold and pred) and math_verify.verify(list(gold), list(pred), timeout_seconds=None)


def is_equivalent(pred: str, gold: str) -> bool:
  """Whether the answer `pred` equals the reference `gold` (asymmetric: gold is the reference).

  An integer gold ("025", "27.0") is compared as an exact integer when `pred` is written as an
  integer too; any other spelling of `pred` ("\\frac{50}{2}") goes to math-verify.
  """
  pred, gold = unwrap(pred), unwrap(gold)
  gold_int = as_integer(gold)
  if gold_int is not None and (pred_int := as_integer(pred)) is not None:
    return pred_int == gold_int
  if canonical(pred) == canonical(gold) and canonical(gold):
    return True
  return _verify(parse_answer(gold), parse_answer(pred))


def score_response(response: str, gold: str, forms: tuple[AnswerForm, ...] = DEFAULT_FORMS) -> Verdict:
  """Extracts the final answer of `response` and compares it with `gold`."""
  extraction = extract_answer(response, forms=forms)
  if extraction.answer is None:
    return Verdict(False, None, "none")
  if extraction.form == "math_verify":
    parsed = parse_free_text(extraction.answer)
    answer = next((p for p in reversed(parsed) if isinstance(p, str)), None)
    if answer is None:
      return Verdict(False, None, "none")
    gold = unwrap(gold)
    gold_int = as_integer(gold)
    if gold_int is not None and (pred_int := as_integer(answer)) is not None:
      return Verdict(pred_int == gold_int, answer, "math_verify")
    return Verdict(_verify(parse_answer(gold), parsed), answer, "math_verify")
  return Verdict(is_equivalent(extraction.answer, gold), extraction.answer, extraction.form)
