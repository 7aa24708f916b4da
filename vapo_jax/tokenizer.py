"""Tokenizers, loaded with `transformers.AutoTokenizer` from a local directory (never a hub)."""

import os

import transformers


def load_tokenizer(directory: str) -> transformers.PreTrainedTokenizerBase:
  """The tokenizer in `directory` (tokenizer.json, or vocab.json + merges.txt, with its config).

  Padding is on the left (prompts are left-padded for generation) and a pad token is always set
  (the EOS token when the tokenizer has none).
  """
  if not os.path.isdir(directory):
    raise FileNotFoundError(f"tokenizer directory {directory!r} does not exist")
  tokenizer = transformers.AutoTokenizer.from_pretrained(directory, local_files_only=True)
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
  """"bytes" for `ByteTokenizer`, else a tokenizer directory (a checkpoint's, usually)."""
  return ByteTokenizer() if name == "bytes" else HFTokenizer(load_tokenizer(name), directory=name)
