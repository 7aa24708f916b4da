"""User errors are one `UserError` message naming the file, tensor, row or setting and what to do:
damaged checkpoints, a tokenizer that does not fit the model, bad data, over-long prompts, SFT
solutions from a file, unknown presets, meshes, backends and run directories."""

import json
import os
import re
import shutil
import struct
import subprocess
import sys
import warnings

import numpy as np
import pytest

from model_utils import FIXTURES
from vapo_jax.cli import preflight
from vapo_jax.config import sections
from vapo_jax.data import problems
from vapo_jax.data import tokenizer as tok_lib
from vapo_jax.data.records import Record, load_records
from vapo_jax.errors import (
  CheckpointError,
  ConfigError,
  DataError,
  MissingFileError,
  SetupError,
  TokenizerError,
  UserError,
)
from vapo_jax.models import huggingface, safetensors_io, sharding
from vapo_jax.models.config import TransformerConfig, preset
from vapo_jax.paths import DATA_DIR

QWEN_TOKENIZER = DATA_DIR / "qwen2.5_tokenizer"


@pytest.fixture
def model_dir(tmp_path):
  target = tmp_path / "ckpt"
  shutil.copytree(FIXTURES / "qwen2_untied", target)
  return target


# ----------------------------------------------------------------------------------- checkpoints
def test_a_truncated_safetensors_file_names_the_file_and_the_tensor(model_dir):
  """Named before numpy could fail deep inside with `cannot reshape array of size 4118 into shape ...`."""
  weights = model_dir / "model.safetensors"
  raw = weights.read_bytes()
  weights.write_bytes(raw[:len(raw) - 1000])
  header_len = struct.unpack("<Q", raw[:8])[0]
  header = json.loads(raw[8:8 + header_len])
  header.pop("__metadata__", None)
  name, info = next((name, info) for name, info in header.items()  # The first cut off, in the header's order.
                    if 8 + header_len + info["data_offsets"][1] > len(raw) - 1000)
  with pytest.raises(CheckpointError, match=rf"{weights}: tensor '{name}' needs bytes up to "
                                            rf"{8 + header_len + info['data_offsets'][1]}, but the file has "
                                            rf"{len(raw) - 1000}: it is truncated"):
    huggingface.load_causal_lm(str(model_dir))


def test_a_corrupt_header_length_is_not_a_memory_error(model_dir):
  """A garbage 8-byte length is refused before `f.read` asks for exabytes (a bare MemoryError)."""
  weights = model_dir / "model.safetensors"
  weights.write_bytes(b"\xff" * 8 + weights.read_bytes()[8:])
  with pytest.raises(CheckpointError, match=rf"{weights}: not a safetensors file, or a corrupt one: its header "
                                            r"length 18446744073709551615 exceeds the file's"):
    safetensors_io.SafetensorsFile(str(weights))


def test_a_header_entry_that_does_not_match_its_shape(model_dir):
  weights = model_dir / "model.safetensors"
  file = safetensors_io.SafetensorsFile(str(weights))
  tensors = [(name, np.array(file.get(name))) for name in file.keys()]
  del file
  safetensors_io.write(str(weights), tensors)
  raw = bytearray(weights.read_bytes())
  header_len = struct.unpack("<Q", raw[:8])[0]
  header = json.loads(raw[8:8 + header_len])
  name = tensors[0][0]
  header[name]["shape"] = [d + 1 for d in header[name]["shape"]]
  encoded = json.dumps(header).encode()
  weights.write_bytes(struct.pack("<Q", len(encoded)) + encoded + bytes(raw[8 + header_len:]))
  with pytest.raises(CheckpointError, match=rf"tensor '{name}' \(F32 .*\) spans \d+ bytes, which does not match"):
    safetensors_io.SafetensorsFile(str(weights))


def test_an_invalid_config_json_names_the_file_and_position(model_dir):
  path = model_dir / "config.json"
  path.write_text(path.read_text()[:-20])
  with pytest.raises(CheckpointError, match=rf"{path}: not valid JSON \(.* at line \d+, column \d+\)"):
    huggingface.load_causal_lm(str(model_dir))


@pytest.mark.parametrize("edit, message", [
    (lambda hf: hf | {"model_type": "gpt2"}, r"model_type 'gpt2' is not supported: vapo_jax implements the qwen2"),
    (lambda hf: {k: v for k, v in hf.items() if k != "hidden_size"}, r"field 'hidden_size' is missing"),
    (lambda hf: hf | {"num_key_value_heads": 3}, r"num_heads=4 must be a multiple of num_kv_heads=3"),
])
def test_config_json_problems_name_the_file(model_dir, edit, message):
  path = model_dir / "config.json"
  path.write_text(json.dumps(edit(json.loads(path.read_text()))))
  with pytest.raises(CheckpointError, match=rf"{path}: .*{message}"):
    TransformerConfig.from_pretrained(str(model_dir))


def test_missing_files_and_tensors_are_named(model_dir, tmp_path):
  with pytest.raises(MissingFileError, match="checkpoint directory '/no/such/dir' does not exist"):
    huggingface.load_causal_lm("/no/such/dir")
  index = {"weight_map": {"model.embed_tokens.weight": "model-00001-of-00002.safetensors"}}
  (model_dir / "model.safetensors.index.json").write_text(json.dumps(index))
  with pytest.raises(MissingFileError, match=r"names 'model-00001-of-00002.safetensors', which is not in"):
    huggingface.load_causal_lm(str(model_dir))
  file = safetensors_io.SafetensorsFile(str(model_dir / "model.safetensors"))
  tensors = {name: np.array(file.get(name)) for name in file.keys()}
  del file
  index = {"weight_map": {name: "model.safetensors" for name in tensors}}
  (model_dir / "model.safetensors.index.json").write_text(json.dumps(index))
  safetensors_io.write(str(model_dir / "model.safetensors"),
                       [(k, v) for k, v in tensors.items() if k != "model.norm.weight"])
  with pytest.raises(CheckpointError, match=r"model.safetensors: no tensor 'model.norm.weight' in this file"):
    huggingface.load_causal_lm(str(model_dir))


def _rewrite_tensors(weights, edit) -> None:
  """Rewrites a safetensors file with `edit({name: array})`'s tensors."""
  file = safetensors_io.SafetensorsFile(str(weights))
  tensors = {name: np.array(file.get(name)) for name in file.keys()}
  del file
  safetensors_io.write(str(weights), list(edit(tensors).items()))


@pytest.mark.parametrize("name, shape, needs", [
    ("model.layers.0.self_attn.q_proj.weight", (36, 40), r"config.json \(num_heads=4, head_dim=10, hidden_size=40\) "
                                                         r"needs \(40, 40\)"),
    ("model.layers.0.self_attn.q_proj.weight", (20, 80), r"needs \(40, 40\)"),  # Same size: reshaped silently.
    ("model.layers.1.self_attn.k_proj.bias", (30,), r"config.json \(num_kv_heads=2, .*\) needs \(20,\)"),
    ("model.layers.1.self_attn.o_proj.weight", (40, 36), r"needs \(40, 40\)"),
])
def test_a_projection_of_the_wrong_shape_names_the_tensor(model_dir, name, shape, needs):
  """The shape is checked before the reshape, whose `ValueError: cannot reshape array ...` names no tensor."""
  weights = model_dir / "model.safetensors"
  _rewrite_tensors(weights, lambda t: t | {name: np.zeros(shape, np.float32)})
  message = rf"^{weights}: tensor '{name}' has shape {re.escape(str(shape))}, but .*{needs}"
  with pytest.raises(CheckpointError, match=message):
    huggingface.load_causal_lm(str(model_dir))


def test_a_vocab_size_below_the_embedding_blames_config_json(model_dir, smoke_config):
  """config.json's vocab_size under the tokenizer's blames config.json, not the tokenizer: the tensor
  has 97 rows, and the message quotes the tensor's rows, not config.json's number."""
  from vapo_jax.train.trainer import Trainer
  config_json = model_dir / "config.json"
  config_json.write_text(json.dumps(json.loads(config_json.read_text()) | {"vocab_size": 50}))
  bytes_model = smoke_config({"model.checkpoint": str(model_dir), "model.random_init": False})  # 259 byte tokens.
  message = (rf"^{config_json} says vocab_size=50, but tensor 'model.embed_tokens.weight' in "
             rf"{model_dir}/model.safetensors has 97 rows: config.json does not describe these weights; set its "
             r"vocab_size to 97")
  with pytest.raises(CheckpointError, match=message):
    Trainer(bytes_model, verbose=False)
  with pytest.raises(CheckpointError, match=message):
    huggingface.load_causal_lm(str(model_dir))
  config_json.write_text(json.dumps(json.loads(config_json.read_text()) | {"vocab_size": 97}))
  with pytest.raises(TokenizerError, match=r"uses ids up to 258 \(259 tokens\), but the checkpoint .* has an embedding "
                                           r"of only 97 rows \(config.json's vocab_size and its tensor "
                                           r"'model.embed_tokens.weight' agree: the tokenizer is the one"):
    Trainer(bytes_model, verbose=False)


def test_unknown_model_preset_names_the_setting():
  with pytest.raises(ConfigError, match=r"ModelConfig.preset must be one of tiny, .*qwen2.5-32b, got 'qwen3-8b'"):
    sections.ModelConfig(preset="qwen3-8b")
  with pytest.raises(ConfigError, match=r"unknown model preset 'qwen3-8b' \(model.preset\)"):
    preset("qwen3-8b")


# ------------------------------------------------------------------------------------- tokenizer
def test_a_checkpoint_directory_without_tokenizer_files_is_refused(model_dir):
  """Refused, where transformers would build an empty tokenizer (1 token, encoding everything to [])
  from config.json."""
  with pytest.raises(TokenizerError, match=rf"'{model_dir}' has no tokenizer files \(tokenizer.json, or vocab.json "
                                           r"and merges.txt, or tokenizer.model\).*model.tokenizer="):
    tok_lib.load(str(model_dir))
  with pytest.raises(MissingFileError, match="tokenizer directory '/no/such' does not exist"):
    tok_lib.load("/no/such")


def test_a_tokenizer_larger_than_the_model_vocabulary_is_refused(model_dir):
  """Refused at start: the lookup would clamp ids past the embedding silently."""
  small = TransformerConfig.from_pretrained(str(model_dir))  # V = 97.
  with pytest.raises(TokenizerError, match=rf"the tokenizer 'ByteTokenizer' uses ids up to 258 \(259 tokens\), but "
                                           rf"the checkpoint '{model_dir}' has an embedding of only 97 rows"):
    tok_lib.check_tokenizer_matches(small, tok_lib.ByteTokenizer(), str(model_dir))
  qwen = tok_lib.load(str(QWEN_TOKENIZER))
  with pytest.raises(TokenizerError, match=r"uses ids up to 151664 \(151665 tokens\), but the randomly initialised"):
    tok_lib.check_tokenizer_matches(preset("tiny"), qwen, None)
  tok_lib.check_tokenizer_matches(preset("qwen2.5-0.5b"), qwen, "/ckpt/qwen2.5-0.5b")  # V = 151936 ≥ 151665.
  tok_lib.check_tokenizer_matches(preset("tiny"), tok_lib.ByteTokenizer(), None)  # 259 = 259.


@pytest.fixture(scope="module")
def tokenizer_files(tmp_path_factory):
  """The Qwen2.5 tokenizer's files, tokenizer.json (the fast tokenizer) included."""
  directory = tmp_path_factory.mktemp("tokenizer")
  shutil.copytree(QWEN_TOKENIZER, directory, dirs_exist_ok=True)
  tok_lib.load(str(QWEN_TOKENIZER)).tokenizer.backend_tokenizer.save(str(directory / "tokenizer.json"))
  return directory


@pytest.mark.parametrize("name", ["vocab.json", "merges.txt", "tokenizer.json", "tokenizer_config.json",
                                  "special_tokens_map.json", "added_tokens.json"])
def test_a_truncated_tokenizer_file_is_named(tokenizer_files, tmp_path, name):
  """Each truncated file is named: left to the tokenizers library, vocab.json escapes as a 70-line
  traceback naming no file, tokenizer.json or tokenizer_config.json names only the directory, and
  special_tokens_map.json or added_tokens.json loads without a word."""
  directory = tmp_path / "tok"
  shutil.copytree(tokenizer_files, directory)
  if name != "tokenizer.json":
    (directory / "tokenizer.json").unlink()  # As shipped (data/qwen2.5_tokenizer): transformers reads the others.
  raw = (directory / name).read_bytes()
  (directory / name).write_bytes(raw[:len(raw) // 2])
  line = (r", line \d+: '.*' is not a merge \(two tokens\)" if name == "merges.txt" else
          r": not valid JSON \(.*: line \d+")
  with pytest.raises(TokenizerError, match=rf"^{directory / name}{line}.*truncated or damaged: copy it again"):
    tok_lib.load(str(directory))


def test_importing_the_tokenizers_prints_no_pytorch_advice():
  """Every start printed transformers' "PyTorch was not found" line (torch is never needed here)."""
  result = subprocess.run([sys.executable, "-c", "import vapo_jax.data.tokenizer as t, os, sys\nt._transformers()\n"
                           "assert 'transformers' in sys.modules\n"
                           "print(os.environ.get('TRANSFORMERS_NO_ADVISORY_WARNINGS'))"],
                          capture_output=True, text=True, timeout=120)
  assert result.returncode == 0 and "PyTorch" not in result.stderr + result.stdout
  assert result.stdout.strip() == "None"  # The environment is left as it was.


# ------------------------------------------------------------------------------------------ data
def test_non_utf8_lines_are_named_and_skipped_when_asked(tmp_path):
  path = tmp_path / "latin1.jsonl"
  path.write_bytes(b'{"problem": "a", "answer": "1"}\n{"problem": "caf\xe9", "answer": "2"}\n'
                   b'{"problem": "b", "answer": "3"}\n')
  with pytest.raises(DataError, match=rf"{path}, line 2, field \(line\): not UTF-8 text \(byte 0xe9 at column 17\)"):
    load_records(str(path))
  with pytest.warns(UserWarning, match=r"skipped 1 bad lines of 3; first: .*line 2.*not UTF-8"):
    records = load_records(str(path), skip_bad_rows=True)
  assert [r.answer for r in records] == ["1", "3"]
  as_json = tmp_path / "latin1.json"
  as_json.write_bytes(b'[{"problem": "a", "answer": "1"},\n {"problem": "caf\xe9", "answer": "2"}]')
  with pytest.raises(DataError, match=rf"{as_json}, line 2: not UTF-8 text \(byte 0xe9 at column 18\)"):
    load_records(str(as_json))
  bom = tmp_path / "bom.jsonl"
  bom.write_bytes(b'\xef\xbb\xbf{"problem": "a", "answer": "1"}\n')
  assert load_records(str(bom))[0].prompt == "a"


def test_solutions_are_kept_for_supervised_warm_start(tmp_path):
  """`sft.path=file.jsonl` loads: the loader keeps the solution field."""
  path = tmp_path / "sft.jsonl"
  rows = [{"problem": "1+1?", "answer": "2", "solution": "1+1=2. Answer: 2"},
          {"problem": "2+2?", "answer": "4", "response": "2+2=4. Answer: 4"},
          {"problem": "3+3?", "answer": "6", "solution": "  "},
          {"problem": "4+4?", "answer": "8"}]
  path.write_text("".join(json.dumps(row) + "\n" for row in rows))
  records = load_records(str(path))
  assert [r.solution for r in records] == ["1+1=2. Answer: 2", "2+2=4. Answer: 4", None, None]
  assert records[0][:4] == ("1+1?", "2", "1", f"{tmp_path.name}/sft")
  path.write_text(json.dumps({"problem": "1+1?", "answer": "2", "solution": ["1", "+"]}) + "\n")
  with pytest.raises(DataError, match=r"line 1, field 'solution': expected a string solution, got list"):
    load_records(str(path))
  math500 = load_records(str(DATA_DIR / "math500/test.jsonl"))
  assert all(r.solution and "boxed" in r.solution for r in math500)


def _rows(lengths):
  return [Record("x" * n, "1", f"id{i}", "s") for i, n in enumerate(lengths)]


def test_over_long_prompts_are_found_at_load_time():
  tokenizer = tok_lib.ByteTokenizer()  # One token per byte: the "raw" template's prompt has len(problem) tokens.
  kwargs = dict(max_prompt_tokens=10, template="raw", chat_template=True, path="train.jsonl")
  rows = _rows([3, 10, 11, 4, 30])
  with pytest.raises(DataError, match=r"train.jsonl, problem id 'id2': the prompt \(template 'raw'\) has 11 tokens, "
                                      r"over rollout.max_prompt_tokens=10. Raise rollout.max_prompt_tokens, shorten "
                                      r"the problem, or set data.skip_bad_rows=true .* \(2 of 5 are too long\)"):
    problems.check_prompt_lengths(rows, tokenizer, **kwargs)
  with pytest.warns(UserWarning, match=r"train.jsonl: skipped 2 of 5 problems whose prompt is over "
                                       r"rollout.max_prompt_tokens=10; first: .*'id2'.* 11 tokens"):
    kept = problems.check_prompt_lengths(rows, tokenizer, skip_bad_rows=True, **kwargs)
  assert [r.id for r in kept] == ["id0", "id1", "id3"]
  with pytest.raises(DataError, match=r"every prompt is over rollout.max_prompt_tokens=10"):
    problems.check_prompt_lengths(_rows([11, 12]), tokenizer, skip_bad_rows=True, **kwargs)
  dicts = [{"problem": "x" * 12, "id": 7, "answer": "1"}]  # The trainer's rows.
  with pytest.raises(DataError, match=r"problem id '7'.* 12 tokens"):
    problems.check_prompt_lengths(dicts, tokenizer, **kwargs)


def test_prompt_length_check_counts_tokens_as_the_rollout_does():
  """Qwen2.5's chat template and BPE: the kept rows are exactly those a per-row encoding keeps."""
  tokenizer = tok_lib.load(str(QWEN_TOKENIZER))
  records = load_records(str(DATA_DIR / "math500/test.jsonl"))[:200]
  exact = [len(tokenizer.encode(problems.format_prompt(r.prompt, template="dapo", tokenizer=tokenizer.tokenizer)))
           for r in records]
  limit = int(np.median(exact))
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    kept = problems.check_prompt_lengths(records, tokenizer, max_prompt_tokens=limit, template="dapo",
                                         chat_template=True, path="math500", skip_bad_rows=True)
  assert kept == [r for r, n in zip(records, exact) if n <= limit]
  assert problems.check_prompt_lengths(records, tokenizer, max_prompt_tokens=max(exact), template="dapo",
                                   chat_template=True, path="math500") == records


def test_eval_max_problems_must_be_positive():
  """-1 is refused rather than dropping the last problem silently (`rows[:-1]`)."""
  for value in (-1, 0):
    with pytest.raises(ConfigError,
                       match=rf"EvalConfig.max_problems must be an integer in \[1, 2147483647\], got {value}"):
      sections.EvalConfig(max_problems=value)
  assert (sections.EvalConfig(max_problems=None).max_problems is None
          and sections.EvalConfig(max_problems=3).max_problems == 3)


# ------------------------------------------------------------------------------------- machine
def test_a_mesh_needing_more_devices_names_the_settings():
  with pytest.raises(ConfigError, match=r"need 16 devices, but 8 are available \(mesh.data=4, mesh.fsdp=4, "
                                        r"mesh.tensor=1; JAX sees 8 cpu devices\): choose sizes whose product is 8"):
    sharding.make_mesh(data=4, fsdp=4)
  with pytest.raises(ConfigError, match=r"mesh.fsdp=3.*not a multiple of 3"):
    sharding.make_mesh(data=-1, fsdp=3)


@pytest.mark.parametrize("platforms", ["tpu", pytest.param("nosuchplatform", marks=pytest.mark.slow)])
def test_an_absent_jax_backend_names_jax_platforms(platforms):
  """A platform JAX cannot start is one error naming JAX_PLATFORMS. make test covers it with "tpu" (the
  pod's platform on a machine without one); an unknown name, the same refusal, runs in make test-slow."""
  env = dict(os.environ, JAX_PLATFORMS=platforms)
  script = ("from vapo_jax.cli import preflight\ntry:\n  preflight.check_backend()\n"
            "except Exception as e:\n  print(type(e).__name__, e)")
  out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120).stdout
  assert out.startswith(f"SetupError JAX cannot start the platform(s) JAX_PLATFORMS='{platforms}': ")
  assert "Unset JAX_PLATFORMS" in out
  assert len(preflight.check_backend()) == 8  # This process: the 8 CPU devices conftest asks for.


def test_run_directory_problems_are_refused_with_a_message(tmp_path):
  blocker = tmp_path / "runs"
  blocker.write_text("a file where the run directory should be")
  with pytest.raises(SetupError, match=rf"cannot write to the run directory '{blocker}/exp'.*a file is in the way"):
    preflight.check_run_dir(str(blocker / "exp"))
  with pytest.raises(SetupError, match=r"GiB free, less than the .* GiB needed"):
    preflight.check_run_dir(str(tmp_path / "new" / "exp"), min_free_bytes=2**62)
  assert not (tmp_path / "new").exists()  # A refused start leaves no directory behind.
  preflight.check_run_dir(str(tmp_path / "ok" / "exp"))
  assert os.listdir(tmp_path / "ok" / "exp") == []


def _writable(directory: str) -> bool:
  try:
    with open(os.path.join(directory, "probe"), "w"):
      pass
    os.remove(os.path.join(directory, "probe"))
    return True
  except OSError:
    return False


def test_a_read_only_run_directory_is_refused(tmp_path):
  """A directory nobody may write to: mode 555, or (root writes anywhere) immutable, or else sysfs."""
  parent = tmp_path / "ro"
  parent.mkdir()
  os.chmod(parent, 0o555)
  immutable = False
  if _writable(str(parent)):  # Root.
    immutable = subprocess.run(["chattr", "+i", str(parent)], capture_output=True).returncode == 0
  try:
    if not _writable(str(parent)):
      with pytest.raises(SetupError, match=rf"cannot write to the run directory '{parent}/runs/exp' \({parent}/runs\): "
                                           r"(permission denied|operation not permitted). Choose another place"):
        preflight.check_run_dir(str(parent / "runs" / "exp"))
    with pytest.raises(SetupError, match=r"cannot write to the run directory '/sys/vapo_jax_runs/exp' "
                                         r"\(/sys/vapo_jax_runs\): (operation not permitted|permission denied|its file "
                                         r"system is read-only)"):
      preflight.check_run_dir("/sys/vapo_jax_runs/exp")  # sysfs takes no new directories, not even root's.
  finally:
    if immutable:
      subprocess.run(["chattr", "-i", str(parent)], check=True)
    os.chmod(parent, 0o755)


def test_every_user_error_is_a_value_error_for_older_handlers():
  for cls in (ConfigError, DataError, CheckpointError, TokenizerError, SetupError, MissingFileError):
    assert issubclass(cls, UserError) and issubclass(cls, ValueError)
  assert issubclass(MissingFileError, FileNotFoundError)
