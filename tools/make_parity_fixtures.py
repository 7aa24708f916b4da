"""Regenerates the model-parity fixtures in tests/fixtures/parity/ with transformers (PyTorch, CPU).

  .venv/bin/pip install torch==2.13.0     (development only; not needed to run or test)
  .venv/bin/python tools/make_parity_fixtures.py

For each architecture it builds a tiny random model with `transformers`, sets *every* tensor to
non-trivial random values (attention biases, norm weights included, so a port that drops a term
fails), saves it as a Hugging Face checkpoint directory (config.json + model.safetensors) and
writes `reference.npz`: a left-padded batch of token ids, its attention mask and position ids, and
the float32 logits transformers computes for it (eager attention).
"""

import json
import os
import sys

import numpy as np
import torch
import transformers

OUT = os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures", "parity")

COMMON = dict(vocab_size=97, hidden_size=40, intermediate_size=72, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
              rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0)

MODELS = {
    "qwen2_untied": (transformers.Qwen2Config, dict(COMMON, rope_theta=10000.0, tie_word_embeddings=False)),
    "qwen2_tied": (transformers.Qwen2Config, dict(COMMON, rope_theta=1000000.0, tie_word_embeddings=True)),
    "llama3": (transformers.LlamaConfig, dict(
        COMMON, head_dim=12, tie_word_embeddings=False, attention_bias=False, mlp_bias=False,
        rope_theta=500000.0,
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=16))),
}


def randomize(model: torch.nn.Module, generator: torch.Generator) -> None:
  with torch.no_grad():
    for name, tensor in model.named_parameters():
      noise = torch.randn(tensor.shape, generator=generator)
      if "norm" in name:
        tensor.copy_(1.0 + 0.3 * noise)
      elif name.endswith("bias"):
        tensor.copy_(0.3 * noise)
      elif "embed" in name:
        tensor.copy_(noise)
      else:
        tensor.copy_(noise / np.sqrt(tensor.shape[-1]))


def batch(vocab: int, rng: np.random.Generator):
  lengths = [13, 9, 1, 13]
  steps = max(lengths)
  ids = rng.integers(3, vocab, size=(len(lengths), steps))
  mask = np.zeros((len(lengths), steps), np.int64)
  for b, n in enumerate(lengths):
    mask[b, steps - n:] = 1  # Left padding.
  ids = np.where(mask == 1, ids, 0)
  positions = np.maximum(np.cumsum(mask, -1) - 1, 0)
  return ids, mask, positions


def main() -> int:
  torch.manual_seed(0)
  rng = np.random.default_rng(0)
  for name, (config_cls, kwargs) in MODELS.items():
    config = config_cls(**kwargs, attn_implementation="eager", torch_dtype=torch.float32)
    model_cls = (transformers.Qwen2ForCausalLM if config_cls is transformers.Qwen2Config
                 else transformers.LlamaForCausalLM)
    model = model_cls(config).eval()
    randomize(model, torch.Generator().manual_seed(len(name)))
    if config.tie_word_embeddings:
      model.tie_weights()
    directory = os.path.join(OUT, name)
    model.save_pretrained(directory, safe_serialization=True)
    for extra in ("generation_config.json",):
      if os.path.exists(os.path.join(directory, extra)):
        os.remove(os.path.join(directory, extra))
    ids, mask, positions = batch(config.vocab_size, rng)
    with torch.no_grad():
      logits = model(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask),
                     position_ids=torch.tensor(positions)).logits.float().numpy()
    np.savez(os.path.join(directory, "reference.npz"), input_ids=ids, attention_mask=mask,
             position_ids=positions, logits=logits)
    size = sum(os.path.getsize(os.path.join(directory, f)) for f in os.listdir(directory))
    print(f"{name}: {size / 1024:.0f} KiB, logits std {logits[mask == 1].std():.3f}")
  with open(os.path.join(OUT, "VERSIONS.json"), "w") as f:
    json.dump({"transformers": transformers.__version__, "torch": torch.__version__}, f, indent=2)
  return 0


if __name__ == "__main__":
  sys.exit(main())
