"""Final-answer extraction from a model response: pure string functions, no sympy.

Forms, in the order a response is searched:

  boxed        the last `\\boxed{...}` (or `\\fbox{...}`, or `\\boxed 5`), nested braces balanced;
               a box inside a box is unwrapped (`\\boxed{\\boxed{5}}` → `5`).
  answer_line  the text after the last `Answer:` up to the end of its line (the DAPO / VAPO
               prompt's instruction, matched as DAPO's `math_dapo` does; also `Final Answer:`,
               `**Answer:**`, the full-width colon `Answer：`, and the Chinese lines `答案：`,
               `最终答案：`, `答：`, `答案是` / `答案为`; a box or the last `$...$` in it is the value,
               a trailing 。 or ， dropped).
  last_number  the last number in the text (GSM8K style; thousands separators removed).
  math_verify  math-verify's own free-text extraction (the last LaTeX or plain expression);
               it happens in the verifier (`equivalence.py`), here it only passes the text on.

`boxed` and `answer_line` are the explicit final-answer forms: when a response has both, the
one that ends later wins (an `Answer:` line after a scratch `\\boxed{}` is the final answer).
`last_number` and `math_verify` are fallbacks, tried in the order given only when no explicit
form is found, and a response answered only by a fallback is not "formatted"
(see `rewards.reward.format_penalty`).
"""

import re
from typing import Literal, NamedTuple

from vapo_jax.kinds import AnswerForm

EXPLICIT_FORMS: tuple[AnswerForm, ...] = ("boxed", "answer_line")
DEFAULT_FORMS: tuple[AnswerForm, ...] = ("boxed", "answer_line")
ALL_FORMS: tuple[AnswerForm, ...] = ("boxed", "answer_line", "last_number", "math_verify")

_BOX = re.compile(r"\\(?:boxed|fbox)\b\s*")
# `Answer:` (ASCII or full-width colon), and the Chinese answer lines of bilingual math data: 最终答案 / 答案 / 答
# followed by a colon, or by 是 / 为 ("the answer is").
_ANSWER_LINE = re.compile(r"(?i)(?:\banswer[^\S\n]*[*_]*[^\S\n]*[:：]|"
                          r"(?:最终答案|答案|答)[^\S\n]*[*_]*[^\S\n]*(?:[:：]|是|为))"
                          r"[*_]*[^\S\n]*([^\n]*)")
_NUMBER = re.compile(r"(?<![\w.])[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+)?")
_DOLLARS = re.compile(r"^\$+\s*(.*?)\s*\$+$", re.S)
_MATH = re.compile(r"\$+([^$]+)\$+")  # `$...$` segments: the answer in "Answer: $5$ minutes".


class Extraction(NamedTuple):
  """The extracted final answer: `answer` is None when no form matched."""

  answer: str | None
  form: AnswerForm | Literal["none"]
  end: int  # Character offset just after the match in the response (0 when none).

  @property
  def formatted(self) -> bool:
    """Whether the answer was given in an explicit final-answer form."""
    return self.form in EXPLICIT_FORMS


NO_ANSWER = Extraction(None, "none", 0)


def _balanced(text: str, start: int) -> int | None:
  """Index just after the `}` that closes the `{` at `text[start]`; None when unclosed."""
  depth = 0
  i = start
  while i < len(text):
    c = text[i]
    if c == "\\":  # An escaped character (`\{`, `\}`) never opens or closes a group.
      i += 2
      continue
    if c == "{":
      depth += 1
    elif c == "}":
      depth -= 1
      if depth == 0:
        return i + 1
    i += 1
  return None


def boxed_spans(text: str) -> list[tuple[str, int, int]]:
  """Every complete `\\boxed{...}` as `(content, start, end)`, outermost boxes only."""
  spans, pos = [], 0
  while (m := _BOX.search(text, pos)) is not None:
    body = m.end()
    if body < len(text) and text[body] == "{":
      end = _balanced(text, body)
      if end is None:  # Unclosed (a truncated response): no answer here.
        pos = body + 1
        continue
      spans.append((text[body + 1:end - 1], m.start(), end))
    else:  # `\boxed 5`: the next token, up to whitespace or `$`.
      token = re.match(r"[^\s$]+", text[body:])
      if token is None:
        pos = body
        continue
      end = body + token.end()
      spans.append((token.group(), m.start(), end))
    pos = end
  return spans


def unwrap(answer: str) -> str:
  """Strips `$...$`, `\\(...\\)`, surrounding boxes, markdown emphasis and a final period."""
  previous = None
  while answer != previous:
    previous = answer
    answer = answer.strip().strip("*").strip()
    if (m := _DOLLARS.match(answer)) is not None:
      answer = m.group(1)
    if answer.startswith("\\(") and answer.endswith("\\)"):
      answer = answer[2:-2]
    if answer.startswith("\\[") and answer.endswith("\\]"):
      answer = answer[2:-2]
    boxes = boxed_spans(answer)
    if len(boxes) == 1 and boxes[0][1] == 0 and boxes[0][2] == len(answer):
      answer = boxes[0][0]
    if answer.endswith(".") and not answer.endswith("..."):
      answer = answer[:-1]
    answer = answer.rstrip("。，．")  # A Chinese sentence's full stop or comma after the value.
  return answer.strip()


def last_boxed(text: str) -> Extraction:
  spans = boxed_spans(text)
  if not spans:
    return NO_ANSWER
  content, _, end = spans[-1]
  content = unwrap(content)
  return Extraction(content, "boxed", end) if content else NO_ANSWER


def last_answer_line(text: str) -> Extraction:
  for m in reversed(list(_ANSWER_LINE.finditer(text))):
    value = m.group(1)
    boxes = boxed_spans(value)
    maths = _MATH.findall(value)
    value = unwrap(boxes[-1][0] if boxes else maths[-1] if maths else value)
    if value:
      return Extraction(value, "answer_line", m.end())
  return NO_ANSWER


def last_number(text: str) -> Extraction:
  matches = list(_NUMBER.finditer(text))
  if not matches:
    return NO_ANSWER
  m = matches[-1]
  return Extraction(m.group().replace(",", "").lstrip("+"), "last_number", m.end())


def extract_answer(text: str, *, forms: tuple[AnswerForm, ...] = DEFAULT_FORMS) -> Extraction:
  """The response's final answer in the first matching form (see the module docstring).

  `math_verify` yields `Extraction(text, "math_verify", len(text))`: the whole response, left to
  math-verify's extraction.
  """
  explicit = [f(text) for form, f in (("boxed", last_boxed), ("answer_line", last_answer_line))
              if form in forms]
  found = [e for e in explicit if e.answer is not None]
  if found:
    return max(found, key=lambda e: e.end)
  for form in forms:
    if form == "last_number" and (e := last_number(text)).answer is not None:
      return e
    if form == "math_verify" and text.strip():
      return Extraction(text, "math_verify", len(text))
  return NO_ANSWER
