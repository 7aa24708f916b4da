"""Shared helpers for the model tests."""

import pathlib

import numpy as np

FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "parity"
PARITY_MODELS = ("qwen2_untied", "qwen2_tied", "llama3")
SHARED_DATA = pathlib.Path(__file__).resolve().parents[2] / "shared" / "data"


def reference(name: str) -> dict[str, np.ndarray]:
  with np.load(FIXTURES / name / "reference.npz") as f:
    return dict(f)
