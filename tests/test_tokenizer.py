"""The real Qwen2.5 tokenizer from data/ loads with its special tokens and chat template."""

import pytest

from vapo_jax.data.tokenizer import load_tokenizer
from vapo_jax.paths import DATA_DIR

QWEN = DATA_DIR / "qwen2.5_tokenizer"


@pytest.fixture(scope="module")
def tokenizer():
  return load_tokenizer(str(QWEN))


def test_special_tokens(tokenizer):
  assert (tokenizer.eos_token, tokenizer.eos_token_id) == ("<|im_end|>", 151645)
  assert (tokenizer.pad_token, tokenizer.pad_token_id) == ("<|endoftext|>", 151643)
  assert tokenizer.convert_tokens_to_ids("<|im_start|>") == 151644
  assert tokenizer.padding_side == "left"


def test_round_trip_and_chat_template(tokenizer):
  text = "Find $x$ if $\\frac{x}{3} = 14$. Answer: 42"
  ids = tokenizer(text).input_ids
  assert tokenizer.decode(ids) == text
  chat = tokenizer.apply_chat_template([{"role": "user", "content": "What is 1+1?"}], tokenize=False,
                                       add_generation_prompt=True)
  assert chat.endswith("<|im_start|>user\nWhat is 1+1?<|im_end|>\n<|im_start|>assistant\n")


def test_left_padded_batch(tokenizer):
  batch = tokenizer(["a", "a much longer prompt"], padding=True, return_tensors="np")
  assert batch["input_ids"][0, 0] == tokenizer.pad_token_id and batch["attention_mask"][0, 0] == 0
  assert batch["attention_mask"][1].all()


def test_missing_directory():
  with pytest.raises(FileNotFoundError, match="tokenizer directory '/nonexistent' does not exist"):
    load_tokenizer("/nonexistent")
