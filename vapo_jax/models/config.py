"""Architecture config of a decoder-only transformer, read from a Hugging Face `config.json`.

Covers the Qwen2 / Qwen2.5 (q/k/v bias) and Llama (Llama-3 rope scaling) families. Both rope
forms are accepted: the top-level `rope_theta` + `rope_scaling` and the newer `rope_parameters`.
"""

import dataclasses
import json
import math
import os
from typing import Any, Literal

import numpy as np

from vapo_jax.errors import CheckpointError, ConfigError, MissingFileError
from vapo_jax.models import hub

DType = Literal["float32", "bfloat16"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class TransformerConfig:
  """Shapes use the project alphabet: V vocab, D width, F MLP width, L layers, N query heads,
  K key/value heads, H head dim."""

  model_type: Literal["qwen2", "llama"] = "qwen2"  # Hugging Face `model_type`.
  vocab_size: int  # V.
  hidden_size: int  # D.
  intermediate_size: int  # F.
  num_layers: int  # L.
  num_heads: int  # N.
  num_kv_heads: int  # K (grouped-query attention: N is a multiple of K).
  head_dim: int  # H.
  rms_norm_eps: float = 1e-6  # RMSNorm ε.
  rope_theta: float = 10000.0  # Rotary base.
  rope_scaling: tuple[tuple[str, Any], ...] = ()  # Llama-3 scaling parameters, as sorted items.
  qkv_bias: bool = True  # Bias on q/k/v projections (Qwen2: true; Llama: `attention_bias`).
  mlp_bias: bool = False  # Bias on the MLP projections (Llama's `mlp_bias`).
  tie_word_embeddings: bool = False  # Output projection shares the embedding matrix.
  max_position_embeddings: int = 32768  # Longest position the checkpoint was trained for.
  bos_token_id: int | None = None  # Carried for export.
  eos_token_id: int | tuple[int, ...] | None = None  # Carried for export.

  def __post_init__(self):
    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                 "num_kv_heads", "head_dim"):
      if getattr(self, name) < 1:
        raise ValueError(f"TransformerConfig.{name} must be >= 1, got {getattr(self, name)}")
    if self.num_heads % self.num_kv_heads:
      raise ValueError(f"TransformerConfig.num_heads={self.num_heads} must be a multiple of "
                       f"num_kv_heads={self.num_kv_heads}")
    if self.head_dim % 2:
      raise ValueError(f"TransformerConfig.head_dim must be even for rotary embeddings, got {self.head_dim}")

  @property
  def rope(self) -> dict[str, Any]:
    return dict(self.rope_scaling)

  def inv_frequencies(self) -> np.ndarray:
    """Rotary inverse frequencies `[H/2]` (float32), with Llama-3 scaling when configured."""
    exponents = np.arange(0, self.head_dim, 2, dtype=np.float64) / self.head_dim
    inv_freq = 1.0 / (self.rope_theta**exponents)
    rope = self.rope
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "llama3":
      factor = rope["factor"]
      low, high = rope["low_freq_factor"], rope["high_freq_factor"]
      original = rope["original_max_position_embeddings"]
      wavelen = 2 * math.pi / inv_freq
      scaled = np.where(wavelen > original / low, inv_freq / factor, inv_freq)
      smooth = (original / wavelen - low) / (high - low)
      smoothed = (1 - smooth) * scaled / factor + smooth * scaled
      medium = (wavelen >= original / high) & (wavelen <= original / low)
      inv_freq = np.where(medium, smoothed, scaled)
    elif rope_type != "default":
      raise ValueError(f"rope type {rope_type!r} is not supported (default, llama3)")
    return inv_freq.astype(np.float32)

  @classmethod
  def from_hf(cls, hf: dict[str, Any]) -> "TransformerConfig":
    """From a parsed Hugging Face `config.json`."""
    model_type = hf.get("model_type")
    if model_type not in ("qwen2", "llama"):
      raise CheckpointError(f"model_type {model_type!r} is not supported: vapo_jax implements the qwen2 "
                            "(Qwen2, Qwen2.5) and llama architectures")
    rope = dict(hf.get("rope_parameters") or {})
    rope_theta = rope.pop("rope_theta", hf.get("rope_theta", 10000.0))
    rope |= dict(hf.get("rope_scaling") or {})
    if rope.get("rope_type", rope.get("type", "default")) == "default":
      rope = {}
    num_heads = hf["num_attention_heads"]
    eos = hf.get("eos_token_id")
    return cls(
        model_type=model_type,
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=hf.get("num_key_value_heads") or num_heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
        rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        rope_theta=float(rope_theta),
        rope_scaling=tuple(sorted(rope.items())),
        qkv_bias=True if model_type == "qwen2" else bool(hf.get("attention_bias", False)),
        mlp_bias=bool(hf.get("mlp_bias", False)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        max_position_embeddings=hf.get("max_position_embeddings", 32768),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_id=tuple(eos) if isinstance(eos, list) else eos,
    )

  @classmethod
  def from_pretrained(cls, directory: str) -> "TransformerConfig":
    """From `directory/config.json` (a Hub model's, `hub`); every problem is a `CheckpointError` naming the file."""
    directory = hub.local(directory)
    if not os.path.isdir(directory):
      raise MissingFileError(f"checkpoint directory {directory!r} does not exist (model.checkpoint)")
    path = os.path.join(directory, "config.json")
    if not os.path.isfile(path):
      raise MissingFileError(f"no config.json in checkpoint directory {directory!r}: a Hugging Face model "
                             "directory holds config.json beside its *.safetensors files")
    try:
      with open(path, encoding="utf-8") as f:
        hf = json.load(f)
    except json.JSONDecodeError as e:
      raise CheckpointError(f"{path}: not valid JSON ({e.msg} at line {e.lineno}, column {e.colno}); "
                            "restore the file from the model's original copy") from None
    except UnicodeDecodeError as e:
      raise CheckpointError(f"{path}: not UTF-8 text (byte {e.start}); restore the file from the model's "
                            "original copy") from None
    if not isinstance(hf, dict):
      raise CheckpointError(f"{path}: expected a JSON object, got {type(hf).__name__}")
    try:
      return cls.from_hf(hf)
    except KeyError as e:
      raise CheckpointError(f"{path}: field {e.args[0]!r} is missing") from None
    except (TypeError, ValueError) as e:
      raise CheckpointError(f"{path}: {e}") from None

  def to_hf(self) -> dict[str, Any]:
    """A Hugging Face `config.json` dict that transformers loads as this architecture."""
    architecture = {"qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM"}[self.model_type]
    hf = {
        "architectures": [architecture], "model_type": self.model_type, "hidden_act": "silu",
        "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
        "intermediate_size": self.intermediate_size, "num_hidden_layers": self.num_layers,
        "num_attention_heads": self.num_heads, "num_key_value_heads": self.num_kv_heads,
        "head_dim": self.head_dim, "rms_norm_eps": self.rms_norm_eps, "rope_theta": self.rope_theta,
        "rope_scaling": (self.rope | {"rope_type": "llama3"}) if self.rope else None,
        "tie_word_embeddings": self.tie_word_embeddings,
        "max_position_embeddings": self.max_position_embeddings,
        "bos_token_id": self.bos_token_id, "eos_token_id": self.eos_token_id,
        "torch_dtype": "float32", "use_cache": True,
    }
    if self.model_type == "llama":
      hf |= {"attention_bias": self.qkv_bias, "mlp_bias": self.mlp_bias}
    return hf

  def num_parameters(self) -> int:
    """Parameter count of the causal LM (the value model swaps V·D output for D)."""
    d, f, h = self.hidden_size, self.intermediate_size, self.head_dim
    q, kv = self.num_heads * h, self.num_kv_heads * h
    attention = d * q + 2 * d * kv + q * d + (q + 2 * kv if self.qkv_bias else 0)
    mlp = 3 * d * f + ((2 * f + d) if self.mlp_bias else 0)
    per_layer = attention + mlp + 2 * d
    output = 0 if self.tie_word_embeddings else self.vocab_size * d
    return self.vocab_size * d + self.num_layers * per_layer + d + output


# Values from each model's Hugging Face config.json (0.5B and 32B as shipped in data/qwen2.5_configs).
_QWEN25 = dict(model_type="qwen2", rms_norm_eps=1e-6, rope_theta=1000000.0,
               max_position_embeddings=32768)
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(model_type="qwen2", vocab_size=259, hidden_size=48, intermediate_size=88,
                 num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=2, head_dim=8,
                 rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False,
                 max_position_embeddings=4096),
    # One layer, for the trainer tests (compiles fastest).
    "micro": dict(model_type="qwen2", vocab_size=259, hidden_size=32, intermediate_size=56,
                  num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                  rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False,
                  max_position_embeddings=4096),
    # The default CPU experiment's model: byte vocabulary, about 0.8 M parameters.
    "small": dict(model_type="qwen2", vocab_size=259, hidden_size=128, intermediate_size=352,
                  num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                  rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=True,
                  max_position_embeddings=4096),
    "qwen2.5-0.5b": _QWEN25 | dict(vocab_size=151936, hidden_size=896, intermediate_size=4864,
                                   num_hidden_layers=24, num_attention_heads=14,
                                   num_key_value_heads=2, tie_word_embeddings=True,
                                   bos_token_id=151643, eos_token_id=151645),
    "qwen2.5-1.5b": _QWEN25 | dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960,
                                   num_hidden_layers=28, num_attention_heads=12,
                                   num_key_value_heads=2, tie_word_embeddings=True,
                                   max_position_embeddings=131072),
    "qwen2.5-7b": _QWEN25 | dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                                 num_hidden_layers=28, num_attention_heads=28,
                                 num_key_value_heads=4, tie_word_embeddings=False,
                                 max_position_embeddings=131072),
    "qwen2.5-32b": _QWEN25 | dict(vocab_size=152064, hidden_size=5120, intermediate_size=27648,
                                  num_hidden_layers=64, num_attention_heads=40,
                                  num_key_value_heads=8, rms_norm_eps=1e-5,
                                  tie_word_embeddings=False, max_position_embeddings=131072,
                                  bos_token_id=151643, eos_token_id=151643),
}


def preset(name: str) -> TransformerConfig:
  """A named architecture (`tiny` for tests and CPU runs; Qwen2.5 0.5B/1.5B/7B/32B)."""
  if name not in PRESETS:
    raise ConfigError(f"unknown model preset {name!r} (model.preset); known: {', '.join(PRESETS)}")
  return TransformerConfig.from_hf(PRESETS[name])
