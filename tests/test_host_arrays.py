"""Host arrays in a checkpoint (`train/host_arrays`): written as files from themselves and read back in place, in
the checkpoint's own directory, so that an incomplete or damaged set makes the checkpoint unreadable (the next
older one is tried), never a wrong restore."""

import os

import numpy as np
import pytest

from vapo_jax.config import CheckpointConfig
from vapo_jax.train import checkpoints, host_arrays


def _tree(seed: int = 0) -> dict:
  rng = np.random.default_rng(seed)
  return {"carry": {"tokens": rng.integers(0, 1000, (6, 7), dtype=np.int32),
                    "sampler": rng.standard_normal((6, 7), dtype=np.float32),
                    "ids": rng.integers(0, 10**12, (6,), dtype=np.int64),
                    "records": np.frombuffer(b'[["x"]]', np.uint8).copy()}}


def _zeros(tree: dict) -> dict:
  return {k: _zeros(v) if isinstance(v, dict) else np.zeros_like(v) for k, v in tree.items()}


def test_written_and_read_back_in_place(tmp_path):
  tree = _tree()
  host_arrays.write(str(tmp_path), tree)
  assert sorted(os.listdir(tmp_path)) == ["carry.ids.npy", "carry.records.npy", "carry.sampler.npy",
                                          "carry.tokens.npy"]
  target = _zeros(tree)
  got = host_arrays.read_into(str(tmp_path), target)
  for name, array in tree["carry"].items():
    assert got["carry"][name] is target["carry"][name]  # Filled in place: no second copy.
    np.testing.assert_array_equal(got["carry"][name], array)
    assert np.load(tmp_path / f"carry.{name}.npy").dtype == array.dtype  # Plain .npy: NumPy reads them too.


def test_a_file_of_another_shape_or_cut_short_is_refused_by_name(tmp_path):
  tree = _tree()
  host_arrays.write(str(tmp_path), tree)
  wrong = _zeros(tree)
  wrong["carry"]["tokens"] = np.zeros((6, 8), np.int32)
  with pytest.raises(ValueError, match=r"carry\.tokens\.npy holds int32\[6, 7\], expected int32\[6, 8\]"):
    host_arrays.read_into(str(tmp_path), wrong)
  path = tmp_path / "carry.sampler.npy"
  path.write_bytes(path.read_bytes()[:-4])
  with pytest.raises(ValueError, match=r"carry\.sampler\.npy is cut short"):
    host_arrays.read_into(str(tmp_path), _zeros(tree))


def test_a_checkpoint_holds_them_beside_the_state_and_a_damaged_one_falls_back(tmp_path):
  """Saved by the run's checkpointer with a device tree: restored equal; the newest checkpoint's file cut short makes
  `restore_latest` take the older one with a warning."""
  found = checkpoints.RunCheckpoints(str(tmp_path), CheckpointConfig(async_save=False))
  for step in (1, 2):
    found.save(step, {"w": np.arange(4.0) + step, host_arrays.ITEM: _tree(step)}, {"n": step}, wait=True)
  files = os.listdir(tmp_path / "2" / host_arrays.ITEM)
  assert "carry.tokens.npy" in files
  target = {"w": np.zeros(4), host_arrays.ITEM: _zeros(_tree())}
  restored = found.restore(2, target)
  np.testing.assert_array_equal(restored["w"], np.arange(4.0) + 2)
  np.testing.assert_array_equal(restored[host_arrays.ITEM]["carry"]["ids"], _tree(2)["carry"]["ids"])
  cut = tmp_path / "2" / host_arrays.ITEM / "carry.ids.npy"
  cut.write_bytes(cut.read_bytes()[:-8])
  with pytest.warns(UserWarning, match=r"/2 is incomplete or unreadable \(ValueError: .*carry\.ids\.npy is cut"):
    step, state, meta = found.restore_latest(lambda meta: {"w": np.zeros(4), host_arrays.ITEM: _zeros(_tree())})
  assert (step, meta["n"]) == (1, 1)
  np.testing.assert_array_equal(state[host_arrays.ITEM]["carry"]["tokens"], _tree(1)["carry"]["tokens"])
  found.close()
