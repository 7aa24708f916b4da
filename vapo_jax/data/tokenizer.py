"""Tokenizers, loaded with `transformers.AutoTokenizer` from a local directory (never a hub).

A directory without tokenizer files is refused (transformers would build an empty tokenizer from
config.json alone), and `check_tokenizer_matches` refuses a tokenizer whose ids do not all fit the
model's embedding (the model would read clamped ids without a word).
"""

import contextlib
import json
import os

from vapo_jax.errors import MissingFileError, TokenizerError
from vapo_jax.models import hub


def _transformers():
  """The `transformers` module, imported on first use (a run with the byte tokenizer never pays its second
  of import) without its "PyTorch was not found" advice: torch is never needed here."""
  with contextlib.ExitStack() as quiet:
    if "TRANSFORMERS_NO_ADVISORY_WARNINGS" not in os.environ:
      os.environ["TRANSFORMERS_NO_ADVISORY_WARNINGS"] = "1"
      quiet.callback(os.environ.pop, "TRANSFORMERS_NO_ADVISORY_WARNINGS", None)
    import transformers
  return transformers

# Any of these is a loadable tokenizer (fast tokenizer; BPE vocabulary + merges; sentencepiece; WordPiece).
TOKENIZER_FILE_SETS = (("tokenizer.json",), ("vocab.json", "merges.txt"), ("tokenizer.model",),
                       ("vocab.txt",))
JSON_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "special_tokens_map.json",
              "added_tokens.json")
_DAMAGED = "the file is truncated or damaged: copy it again from the base model"


def check_files(directory: str) -> None:
  """Raises `TokenizerError` naming the file, line and column of a tokenizer file that does not parse:
  a JSON file that is not a JSON object, or a merges.txt line that is not two tokens."""
  for name in JSON_FILES:
    path = os.path.join(directory, name)
    if not os.path.isfile(path):
      continue
    try:
      with open(path, encoding="utf-8") as f:
        data = json.load(f)
    except UnicodeDecodeError as e:
      raise TokenizerError(f"{path}: not UTF-8 text (byte {e.start}); {_DAMAGED}") from None
    except json.JSONDecodeError as e:
      raise TokenizerError(f"{path}: not valid JSON ({e.msg}: line {e.lineno}, column {e.colno}); "
                           f"{_DAMAGED}") from None
    if not isinstance(data, dict):
      raise TokenizerError(f"{path}: expected a JSON object, got {type(data).__name__}; {_DAMAGED}")
  path = os.path.join(directory, "merges.txt")
  if os.path.isfile(path):
    with open(path, encoding="utf-8", errors="replace") as f:
      for number, line in enumerate(f, 1):
        if not (number == 1 and line.startswith("#version")) and len(line.split()) != 2 and line.strip():
          raise TokenizerError(f"{path}, line {number}: {line.strip()[:40]!r} is not a merge (two tokens); "
                               f"{_DAMAGED}")


def load_tokenizer(directory: str) -> "transformers.PreTrainedTokenizerBase":  # noqa: F821  (imported on use)
  """The tokenizer in `directory` (tokenizer.json, or vocab.json + merges.txt, with its config).

  Padding is on the left (prompts are left-padded for generation) and a pad token is always set
  (the EOS token when the tokenizer has none).
  """
  if not os.path.isdir(directory):
    raise MissingFileError(f"tokenizer directory {directory!r} does not exist (model.tokenizer, or else "
                           "model.checkpoint)")
  if not any(all(os.path.isfile(os.path.join(directory, f)) for f in files) for files in TOKENIZER_FILE_SETS):
    raise TokenizerError(
        f"{directory!r} has no tokenizer files (tokenizer.json, or vocab.json and merges.txt, or "
        "tokenizer.model): copy the base model's tokenizer files beside the weights, or set "
        "model.tokenizer=/path/to/tokenizer")
  check_files(directory)
  try:
    tokenizer = _transformers().AutoTokenizer.from_pretrained(directory, local_files_only=True)
  except Exception as e:  # noqa: BLE001  The tokenizers library raises bare Exceptions for damaged files.
    first = str(e).strip().splitlines()[0] if str(e).strip() else ""
    present = ", ".join(sorted(os.listdir(directory)))
    raise TokenizerError(f"cannot load the tokenizer in {directory!r} (files: {present}): "
                         f"{type(e).__name__}: {first[:300]}; copy its files again from the base model") from None
  if len(tokenizer) < 2 or not tokenizer.encode("1 + 1 = 2", add_special_tokens=False):
    raise TokenizerError(f"the tokenizer in {directory!r} is empty ({len(tokenizer)} tokens): its files are "
                         "incomplete; copy them again from the base model")
  if tokenizer.eos_token is None:
    raise TokenizerError(f"the tokenizer in {directory!r} has no EOS token (eos_token in "
                         "tokenizer_config.json or special_tokens_map.json): generation could never stop")
  tokenizer.padding_side = "left"
  if tokenizer.pad_token is None:
    tokenizer.pad_token = tokenizer.eos_token
  return tokenizer


class ByteTokenizer:
  """UTF-8 bytes as tokens: id = byte + 3, with pad 0, bos 1, eos 2 (vocabulary 259).

  For the tiny CPU experiments: no files, nothing to download, and every string round-trips.
  """

  pad_token_id, bos_token_id, eos_token_id = 0, 1, 2
  vocab_size = 259
  directory = None  # No files: nothing to copy beside an exported checkpoint.

  def encode(self, text: str) -> list[int]:
    return [b + 3 for b in text.encode("utf-8")]

  def decode(self, ids) -> str:
    return bytes(int(i) - 3 for i in ids if int(i) >= 3).decode("utf-8", errors="replace")


class HFTokenizer:
  """A transformers tokenizer behind the same small interface as `ByteTokenizer`."""

  def __init__(self, tokenizer, directory: str | None = None):
    self.tokenizer, self.directory = tokenizer, directory
    self.pad_token_id, self.eos_token_id = tokenizer.pad_token_id, tokenizer.eos_token_id
    self.bos_token_id = tokenizer.bos_token_id
    self.vocab_size = len(tokenizer)

  def encode(self, text: str) -> list[int]:
    return self.tokenizer.encode(text, add_special_tokens=False)

  def decode(self, ids) -> str:
    return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=True)


def load(name: str) -> ByteTokenizer | HFTokenizer:
  """"bytes" for `ByteTokenizer`, else a tokenizer directory (a checkpoint's, usually) or Hub model (`models.hub`)."""
  if name == "bytes":
    return ByteTokenizer()
  directory = hub.local(name)
  return HFTokenizer(load_tokenizer(directory), directory=directory)


def check_tokenizer_matches(model_cfg, tokenizer: ByteTokenizer | HFTokenizer,
                            checkpoint_path: str | None) -> None:
  """Raises `TokenizerError` unless every id of `tokenizer` has a row in the model's embedding.

  `model_cfg` is the model's `TransformerConfig` (`vocab_size` V: for a checkpoint, from
  `huggingface.read_config`, which has checked config.json against the embedding tensor, so the
  tokenizer is the one that disagrees); `checkpoint_path` names the model in the message (None: a
  random initialisation of `model.preset`). A model may have more rows than the tokenizer has tokens
  (Qwen2.5 pads V to a multiple of 128), never fewer: ids ≥ V would be clamped by the embedding lookup
  and the run would train on the wrong tokens.
  """
  model = f"the checkpoint {checkpoint_path!r}" if checkpoint_path else "the randomly initialised model (model.preset)"
  agree = (" (config.json's vocab_size and its tensor 'model.embed_tokens.weight' agree: the tokenizer is "
           "the one that does not fit)" if checkpoint_path else "")
  source = getattr(tokenizer, "directory", None) or type(tokenizer).__name__
  special = {"eos": tokenizer.eos_token_id, "pad": tokenizer.pad_token_id, "bos": tokenizer.bos_token_id}
  largest = max([tokenizer.vocab_size - 1, *(i for i in special.values() if i is not None)])
  if largest >= model_cfg.vocab_size:
    raise TokenizerError(
        f"the tokenizer {source!r} uses ids up to {largest} ({tokenizer.vocab_size} tokens), but {model} has "
        f"an embedding of only {model_cfg.vocab_size} rows{agree}: ids beyond it would be clamped silently. "
        "Use the tokenizer that belongs to the model (model.tokenizer=, or the tokenizer files in the "
        "checkpoint directory).")
