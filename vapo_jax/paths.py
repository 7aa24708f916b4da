"""Where the repository's own files are, found from this package, never from the working directory.

  paths.DATA_DIR                                       # <repository>/data
  paths.data_path("aime24/qwen25math_aime24_test.jsonl")   # its absolute path, a str for configs
"""

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
DATA_DIR = REPO_ROOT / "data"  # The public data sets the experiments and tests use (see data/README.md).


def data_path(relative: str) -> str:
  """The absolute path of `relative` under the repository's data/ folder."""
  return str(DATA_DIR / relative)
