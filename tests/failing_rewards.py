"""Reward functions that misbehave, for the failure tests (imported by verifier worker processes)."""

import os
import signal
import time


def equal_slowly(response: str, answer: str) -> bool:
  """Takes 50 ms, so that a batch is still being scored when a signal arrives."""
  time.sleep(0.05)
  return response == answer


def signal_own_group(response: str, answer: str) -> bool:
  """On "term": SIGTERM to the whole process group (what systemd and Slurm do), mid-scoring."""
  if response == "term":
    os.killpg(os.getpgrp(), signal.SIGTERM)
    time.sleep(0.2)  # Still running when the signal lands.
  return equal_slowly(response, answer)


def kill_fork_server(response: str, answer: str) -> bool:
  """On "kill": SIGKILL to the fork server (this worker's parent) and to this worker itself."""
  if response == "kill":
    os.kill(os.getppid(), signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)
  return equal_slowly(response, answer)


def always_raises(response: str, answer: str) -> bool:
  """A reward function with a bug: fails on every response."""
  return int(answer) / 0 > 1


def raises_on_odd_length(response: str, answer: str) -> bool:
  if len(response) % 2:
    raise KeyError(f"no key for {response!r}")
  return response == answer


def returns_text(response: str, answer: str):
  return "yes"


def contains_answer(response: str, answer: str) -> bool:
  """A well-behaved user function: a verdict, no extracted answer."""
  return answer in response


def returns_what_it_is_told(response: str, answer: str):
  """Returns the non-score a response names ("nan", "inf", "none", "tuple", "dict"), raises on "raise",
  else the verdict `answer in response`."""
  values = {"nan": float("nan"), "inf": float("inf"), "none": None, "tuple": (True, 1.0), "dict": {"score": 1.0}}
  if response == "raise":
    raise ValueError(f"cannot score {response!r}")
  return values[response] if response in values else answer in response
