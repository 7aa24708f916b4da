"""The smoke-size run that the resume and multi-host tests start as `make train` would, in subprocesses."""

import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The default experiment at smoke size (`--smoke`, experiments/smoke.py): 20 training prompts, 8 per step, so the
# data's epoch boundary falls inside the RL stage; every stage runs (warm start, evaluation, value pretraining, RL).
TINY_ARGS = ["--exp", "tiny", "--smoke", "name=resume", "seed=3", "model.init_seed=3", "rl_steps=5", "sft.steps=3",
             "algo.value_pretrain_steps=3",
             "data.train_path=synthetic:arithmetic?terms=2-3&count=20&seed=0", "eval.every_steps=2",
             "checkpoint.every_steps=1", "mesh.data=2"]
VARYING = ("time/", "perf/")  # Wall-clock figures differ between runs; everything else must not.
