"""Partial rollouts' carry saved and restored at `aime`'s full size, as a checkpoint holds it.

  python -m benchmarks.carry_bench [--sequences 16384] [--tokens 20480]

A carry of `--sequences` sequences in flight (groups of 16), every one holding `--tokens` tokens (the cap: the
most a carry holds), its tokens, sampler and policy log-probs and versions synthesised; then `Carry.state_dict`,
saved by the run's own checkpointer (`train/checkpoints.RunCheckpoints`, Orbax, synchronous) and restored into a
new `Carry` (`load_state_dict`) as a resume does, compared whole. Prints the seconds of each half and of the round
trip, the bytes on disk, and the process's peak host memory against the carry's bytes. Target on the 2-core
machine: the round trip ≤ 60 s, the peak ≤ 2× the carry's bytes.
"""

import argparse
import json
import os
import resource
import shutil
import tempfile
import time

import numpy as np

from vapo_jax.config import CheckpointConfig
from vapo_jax.rollout import partial
from vapo_jax.train import checkpoints

GROUP = 16


def synthesised(sequences: int, tokens: int) -> partial.Carry:
  """A carry of `sequences` members of `tokens` tokens each, still decoding, drawn in groups of `GROUP`."""
  carry = partial.Carry(group=GROUP, sequences=sequences, max_response_tokens=tokens, max_staleness=4, pad_id=0,
                        prompt_width=1024)
  rng = np.random.default_rng(0)
  draw = lambda n: [([f"problem {i}", "42"], rng.integers(3, 150000, 200).tolist()) for i in range(n)]
  carry.next_call(draw)  # Draws the groups (the call's prompt array is small: prompts only).
  carry.buffers["tokens"][:] = rng.integers(3, 150000, carry.buffers["tokens"].shape, dtype=np.int32)
  carry.buffers["sampler"][:] = -rng.random(carry.buffers["sampler"].shape, dtype=np.float32)
  carry.buffers["policy"][:] = carry.buffers["sampler"] - 1e-3
  carry.buffers["versions"][:] = rng.integers(0, 5, carry.buffers["versions"].shape, dtype=np.int32)
  carry.length[:] = tokens - 1  # Still decoding: one token short of the cap.
  return carry


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--sequences", type=int, default=16384)
  parser.add_argument("--tokens", type=int, default=20480)
  parser.add_argument("--directory", default=None, help="where to write (default: a temporary directory here)")
  args = parser.parse_args(argv)
  carry = synthesised(args.sequences, args.tokens)
  counters, arrays = carry.state_dict()
  nbytes = sum(a.nbytes for a in arrays.values())
  directory = tempfile.mkdtemp(prefix="carry_bench_", dir=args.directory or os.getcwd())
  saver = checkpoints.RunCheckpoints(os.path.join(directory, "checkpoints"), CheckpointConfig(async_save=False))
  try:
    start = time.perf_counter()
    saver.save(1, {"carry": arrays}, {"carry": counters}, wait=True)
    saved = time.perf_counter()
    disk = sum(os.path.getsize(os.path.join(r, f)) for r, _, files in os.walk(directory) for f in files)
    expected = {name: array.copy() for name, array in list(arrays.items())[:1]}  # One array kept to compare.
    del arrays, carry
    target = {"carry": {name: np.zeros(shape, dtype) for name, (shape, dtype) in
                        partial.Carry.array_shapes(json.loads(json.dumps(counters)), GROUP).items()}}
    restored = saver.restore(1, target)
    copy = partial.Carry(group=GROUP, sequences=args.sequences, max_response_tokens=args.tokens, max_staleness=4,
                         pad_id=0, prompt_width=1024)
    copy.load_state_dict(counters, restored["carry"])
    done = time.perf_counter()
    name = next(iter(expected))
    same = np.array_equal(copy.state_dict()[1][name], expected[name])
  finally:
    saver.close()
    shutil.rmtree(directory, ignore_errors=True)
  peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
  print(f"carry of {args.sequences} sequences x {args.tokens} tokens: {nbytes / 2**30:.2f} GiB in memory, "
        f"{disk / 2**30:.2f} GiB on disk")
  print(f"  save {saved - start:.1f} s, restore {done - saved:.1f} s, round trip {done - start:.1f} s (target <= 60 s)")
  print(f"  peak host memory {peak / 2**30:.2f} GiB: {peak / nbytes:.2f}x the carry's bytes (target <= 2x); "
        f"restored equal: {'yes' if same else 'NO'}")


if __name__ == "__main__":
  main()
