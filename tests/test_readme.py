"""The README is a front door that stays true: at most 200 lines, and every repository path, `make`
target and link it names exists."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
# Paths a run creates: its directory's files, the environment and the compilation cache.
MADE_BY_RUNS = ("runs/", ".venv/", ".jax_cache/")
RUN_FILES = {"config.json", "metrics.jsonl", "tensorboard/", "summary.json", "critic_pretrained/", "checkpoints/",
             "export/"}


def _named_paths(text: str) -> set[str]:
  """Backticked words that look like repository paths (a folder/ or a file with an extension)."""
  found = set()
  for word in re.findall(r"`([^`\s]+)`", text):
    word = word.rstrip(",.;:")
    if any(c in word for c in "<>*{}=$") or word.startswith(MADE_BY_RUNS) or word in RUN_FILES or "://" in word:
      continue
    if re.fullmatch(r"[\w./-]+/|[\w./-]+\.(py|md|json|jsonl|txt|cfg|toml)", word) and not word.startswith("."):
      found.add(word)
  return found


def test_the_readme_has_at_most_200_lines():
  assert len(README.splitlines()) <= 200


def test_every_path_the_readme_names_exists():
  tables = {"vapo_jax/": ROOT / "vapo_jax"}  # A table row's bare file names sit in the row's folder.
  missing = []
  for line in README.splitlines():
    folder = next((ROOT / m for m in re.findall(r"`((?:vapo_jax|experiments|benchmarks|tests)/[\w/]*)`", line)), None)
    for path in _named_paths(line):
      candidates = [ROOT / path] + ([folder / path] if folder and folder.is_dir() else []) + [
          t / path for t in tables.values()]
      if not any(c.exists() for c in candidates):
        missing.append(path)
  assert not missing, missing


def test_every_make_target_and_link_the_readme_names_exists():
  makefile = (ROOT / "Makefile").read_text()
  targets = set(re.findall(r"^([a-z][\w-]*):", makefile, re.M))
  named = set(re.findall(r"\bmake ([a-z][\w-]*)", README)) - {"it"}
  assert named and named <= targets, named - targets
  links = [link for link in re.findall(r"\]\(([^)#]+)\)", README) if "://" not in link]
  assert links and all((ROOT / link).exists() for link in links), [l for l in links if not (ROOT / l).exists()]


def test_every_docs_page_links_to_files_that_exist():
  missing = []
  for page in (ROOT / "docs").glob("*.md"):
    for link in re.findall(r"\]\(([^)#]+)\)", page.read_text()):
      if "://" not in link and not (page.parent / link).exists():
        missing.append(f"{page.name}: {link}")
  assert not missing, missing
