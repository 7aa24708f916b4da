"""Shared helpers for the model tests."""

import pathlib

import numpy as np

from vapo_jax.paths import DATA_DIR  # noqa: F401  The repository's data/ folder, for the model tests.

FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "parity"
PARITY_MODELS = ("qwen2_untied", "qwen2_tied", "llama3")


def reference(name: str) -> dict[str, np.ndarray]:
  with np.load(FIXTURES / name / "reference.npz") as f:
    return dict(f)
