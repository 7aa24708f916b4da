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
