"""Run logs a researcher can read: metrics.jsonl, TensorBoard, a progress line, collapse warnings."""

import json
import math
import os
import sys
import time
import warnings

import numpy as np


class MetricsWriter:
  """Appends one JSON object per record to `<run_dir>/metrics.jsonl` and mirrors it to TensorBoard.

  `keep_bytes` is how much of an existing metrics.jsonl to keep (a resumed run passes the length at
  its checkpoint, dropping records of steps it will run again; a fresh run passes 0), and
  `purge_step` makes TensorBoard drop events from that global step on, for the same reason.
  """

  def __init__(self, run_dir: str, *, enabled: bool = True, keep_bytes: int = 0, purge_step: int | None = None):
    self.enabled = enabled
    self.path = os.path.join(run_dir, "metrics.jsonl")
    self._tb = None
    if enabled:
      os.makedirs(run_dir, exist_ok=True)
      with open(self.path, "a") as f:
        f.truncate(min(keep_bytes, f.tell()))
      from tensorboardX import SummaryWriter
      self._tb = SummaryWriter(os.path.join(run_dir, "tensorboard"), purge_step=purge_step)

  def size(self) -> int:
    """Bytes written so far to metrics.jsonl (0 when disabled)."""
    return os.path.getsize(self.path) if self.enabled and os.path.exists(self.path) else 0

  def write(self, step: int, stage: str, metrics: dict[str, float], *, global_step: int | None = None,
            jsonl: bool = True) -> None:
    """One record; TensorBoard uses `global_step` (monotonic over stages) when given, else `step`.
    `jsonl=False` writes TensorBoard only (re-adding what a resume purged)."""
    if not self.enabled:
      return
    clean = {k: float(v) for k, v in sorted(metrics.items())}
    if jsonl:
      with open(self.path, "a") as f:  # Opened per record: a crash loses at most the line in flight.
        f.write(json.dumps({"step": step, "stage": stage, **clean}) + "\n")
    for key, value in clean.items():
      if math.isfinite(value):
        self._tb.add_scalar(f"{stage}/{key}" if stage != "rl" else key, value,
                            step if global_step is None else global_step)
    self._tb.flush()

  def close(self) -> None:
    if self._tb is not None:
      self._tb.close()


class Progress:
  """One console line per step: step, reward, accuracy, response length, ETA."""

  def __init__(self, stage: str, total: int, stream=sys.stdout):
    self.stage, self.total, self.stream = stage, total, stream
    self.start = time.perf_counter()

  def update(self, step: int, metrics: dict[str, float], keys: dict[str, str]) -> None:
    done = step + 1
    elapsed = time.perf_counter() - self.start
    eta = elapsed / done * (self.total - done)
    fields = " | ".join(f"{label} {metrics[k]:.3g}" for label, k in keys.items() if k in metrics)
    print(f"[{self.stage}] {done:>4}/{self.total} | {fields} | {elapsed:5.0f}s elapsed, ETA {eta:4.0f}s",
          file=self.stream, flush=True)


class CollapseMonitor:
  """Warns when the response length or the entropy collapses (what VAPO exists to prevent)."""

  def __init__(self, *, length_frac: float, min_entropy: float):
    self.length_frac, self.min_entropy = length_frac, min_entropy
    self.first_length = None
    self.warned = set()

  def state_dict(self) -> dict:
    return {"first_length": self.first_length, "warned": sorted(self.warned)}

  def load_state_dict(self, state: dict) -> None:
    self.first_length, self.warned = state["first_length"], set(state["warned"])

  def check(self, step: int, response_len: float, entropy: float) -> list[str]:
    messages = []
    if self.first_length is None:
      self.first_length = response_len
    if response_len < self.length_frac * self.first_length and "length" not in self.warned:
      messages.append(f"step {step}: mean response length {response_len:.1f} fell below "
                      f"{self.length_frac:.0%} of its first value {self.first_length:.1f} (length collapse)")
      self.warned.add("length")
    if entropy < self.min_entropy and "entropy" not in self.warned:
      messages.append(f"step {step}: mean token entropy {entropy:.3f} fell below {self.min_entropy} "
                      "(entropy collapse)")
      self.warned.add("entropy")
    for message in messages:
      warnings.warn(message, stacklevel=2)
    return messages


def summarize_lengths(lengths: np.ndarray, max_tokens: int, prefix: str = "rollout") -> dict[str, float]:
  lengths = np.asarray(lengths, np.float64)
  return {f"{prefix}/response_len_mean": lengths.mean(), f"{prefix}/response_len_min": lengths.min(),
          f"{prefix}/response_len_max": lengths.max(),
          f"{prefix}/truncated_frac": float(np.mean(lengths >= max_tokens))}
