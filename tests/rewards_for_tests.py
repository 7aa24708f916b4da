"""User reward functions for the trainer tests (imported by the verifier worker processes)."""


def even_first_byte(response: str, answer: str) -> bool:
  """About half of a random policy's responses are "correct": a verdict visible after one token."""
  return bool(response) and response.encode()[0] % 2 == 0


def large_answer(response: str, answer: str) -> bool:
  """Decided by the problem alone (its sum is at least 10): a critic can learn it from the prompt."""
  return int(answer) >= 10


def answer_at_least_five(response: str, answer: str) -> bool:
  """With one-term problems ("7="), decided by the single prompt digit: easy for a tiny critic."""
  return int(answer) >= 5
