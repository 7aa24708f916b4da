"""Partial rollouts' carry saved and restored at `aime`'s full size, as a checkpoint holds it.

  python -m benchmarks.carry_bench [--sequences 16384] [--tokens 20480]

A carry of `--sequences` sequences in flight (groups of 16), every one holding `--tokens` tokens (the cap: the
most a carry holds), its tokens, sampler and policy log-probs and versions synthesised; then `Carry.state_dict`,
saved by the run's own checkpointer (`train/checkpoints.RunCheckpoints`: Orbax, the carry as host arrays written
from themselves, `train/host_arrays`) and restored into a
new `Carry` (`load_state_dict`) as a resume does, compared whole (by digest). Prints the seconds of each half and
of the round trip, the bytes on disk, and the process's peak host memory while saving and while restoring (Linux's
VmHWM, reset before each; the carry itself is held throughout the save) against the carry's bytes. Target on the
2-core machine: the round trip <= 60 s, the peak <= 2x the carry's bytes.
"""

import argparse
import hashlib
import json
import os
import shutil
import tempfile
import time

import numpy as np

from vapo_jax.config import CheckpointConfig
from vapo_jax.rollout import partial
from vapo_jax.train import checkpoints

GROUP = 16
BLOCK = 1024  # Rows synthesised at a time.


def synthesised(sequences: int, tokens: int) -> partial.Carry:
  """A carry of `sequences` members of `tokens` tokens each, still decoding, drawn in groups of `GROUP`; filled a
  block of rows at a time (no whole-size temporaries: the carry's own bytes are what the process holds)."""
  carry = partial.Carry(samples_per_prompt=GROUP, sequences=sequences, max_response_tokens=tokens,
                        max_staleness=4, pad_id=0, prompt_width=1024)
  rng = np.random.default_rng(0)
  draw = lambda n: [([f"problem {i}", "42"], rng.integers(3, 150000, 200).tolist()) for i in range(n)]
  carry.next_call(draw)  # Draws the groups (the call's prompt array is small: prompts only).
  b = carry.buffers
  for start in range(0, len(b["tokens"]), BLOCK):
    rows = slice(start, start + BLOCK)
    b["tokens"][rows] = rng.integers(3, 150000, b["tokens"][rows].shape, dtype=np.int32)
    b["sampler"][rows] = rng.random(b["sampler"][rows].shape, dtype=np.float32)
    np.negative(b["sampler"][rows], out=b["sampler"][rows])
    np.subtract(b["sampler"][rows], np.float32(1e-3), out=b["policy"][rows])
    b["versions"][rows] = rng.integers(0, 5, b["versions"][rows].shape, dtype=np.int32)
  carry.length[:] = tokens - 1  # Still decoding: one token short of the cap.
  return carry


def _digests(arrays: dict) -> dict[str, str]:
  """Each array's digest (blake2b of its bytes): what the restore is compared against, without a second copy."""
  return {name: hashlib.blake2b(memoryview(np.ascontiguousarray(a)).cast("B")).hexdigest() for name, a in
          arrays.items()}


def _resident() -> tuple[int, int]:
  """(current, peak) resident bytes of this process (Linux's VmRSS, VmHWM)."""
  with open("/proc/self/status") as f:
    fields = dict(line.split(":", 1) for line in f)
  return tuple(int(fields[k].split()[0]) * 1024 for k in ("VmRSS", "VmHWM"))


def _reset_peak() -> None:
  """Linux: the peak resident size starts again from the current one (`clear_refs` 5)."""
  with open("/proc/self/clear_refs", "w") as f:
    f.write("5")


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--sequences", type=int, default=16384)
  parser.add_argument("--tokens", type=int, default=20480)
  parser.add_argument("--directory", default=None,
                      help="where to write (default: a temporary directory here)")
  args = parser.parse_args(argv)
  carry = synthesised(args.sequences, args.tokens)
  counters, arrays = carry.state_dict()
  nbytes = sum(a.nbytes for a in arrays.values())
  expected = _digests(arrays)
  directory = tempfile.mkdtemp(prefix="carry_bench_", dir=args.directory or os.getcwd())
  saver = checkpoints.RunCheckpoints(os.path.join(directory, "checkpoints"),
                                     CheckpointConfig(async_save=False))
  try:
    held, _ = _resident()  # The carry, as a run holds it when it saves.
    _reset_peak()
    start = time.perf_counter()
    saver.save(1, {"host": {"carry": arrays}}, {"carry": counters}, wait=True)
    saved = time.perf_counter()
    save_peak = _resident()[1]
    disk = sum(os.path.getsize(os.path.join(r, f)) for r, _, files in os.walk(directory) for f in files)
    del arrays, carry
    _reset_peak()
    restore_start = time.perf_counter()
    target = {"host": {"carry": {name: np.zeros(shape, dtype) for name, (shape, dtype) in
                        partial.Carry.array_shapes(json.loads(json.dumps(counters)), GROUP).items()}}}
    restored = saver.restore(1, target)
    copy = partial.Carry(samples_per_prompt=GROUP, sequences=args.sequences, max_response_tokens=args.tokens,
                         max_staleness=4, pad_id=0, prompt_width=1024)
    copy.load_state_dict(counters, restored["host"]["carry"])
    del target, restored
    done = time.perf_counter()
    restore_peak = _resident()[1]
    same = _digests(copy.state_dict()[1]) == expected
  finally:
    saver.close()
    shutil.rmtree(directory, ignore_errors=True)
  peak = max(save_peak, restore_peak)
  print(f"carry of {args.sequences} sequences x {args.tokens} tokens: {nbytes / 2**30:.2f} GiB in memory, "
        f"{disk / 2**30:.2f} GiB on disk")
  print(f"  save {saved - start:.1f} s, restore {done - restore_start:.1f} s, round trip "
        f"{saved - start + done - restore_start:.1f} s (target <= 60 s)")
  print(f"  peak host memory {peak / 2**30:.2f} GiB while saving or restoring (the process held "
        f"{held / 2**30:.2f} GiB with the carry): {peak / nbytes:.2f}x the carry's bytes (target <= 2x; "
        f"saving {save_peak / nbytes:.2f}x, "
        f"restoring {restore_peak / nbytes:.2f}x); restored equal: {'yes' if same else 'NO'}")


if __name__ == "__main__":
  main()
