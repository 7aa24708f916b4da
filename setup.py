"""vapo_jax: VAPO (Value-based Augmented PPO) for LLM reasoning RL, in JAX/Flax."""

import setuptools

setuptools.setup(
    name="vapo_jax",
    version="0.1.0",
    description="VAPO and its baselines (PPO, GRPO, DAPO) for long chain-of-thought RL in JAX/Flax",
    packages=setuptools.find_packages(include=["vapo_jax", "vapo_jax.*", "experiments"]),
    python_requires=">=3.11",
    install_requires=[
        "jax>=0.6.0,<0.13",
        "flax>=0.11.0,<0.13",
        "optax>=0.2.4,<0.3",
        "orbax-checkpoint>=0.11.0,<0.13",
        "transformers>=4.51,<6",
        "jinja2>=3.1,<4",  # transformers' chat templates.
        "numpy>=1.26,<3",
        "ml_dtypes>=0.4,<1",  # bfloat16 for numpy (a JAX dependency, used directly for safetensors).
        # Answer equivalence (pins latex2sympy2_extended; agreement figures measured on 0.9.0).
        "math-verify[antlr4_13_2]>=0.9,<0.10",
        "pyarrow>=14,<27",  # Parquet datasets (DAPO-Math-17k).
        "tensorboardX>=2.6,<3",  # TensorBoard event files without TensorFlow.
    ],
    extras_require={
        # The optional features' tests run too: W&B offline logging and the plots. (make test also installs
        # "tpu": the compile report's tests compile TPU topologies, tests/test_compile_tpu.py.)
        "test": ["pytest>=8,<10", "pytest-xdist>=3.5,<4", "hypothesis>=6.100,<7", "ruff>=0.8,<1", "wandb>=0.19,<1",
                 "matplotlib>=3.7,<4"],
        # make memory TOPOLOGY=v5p:...: libtpu's compile-only client compiles for a TPU topology on any machine.
        # jax[tpu] pins jax to the version its libtpu (0.0.42.*) was built with; only this extra pins it.
        "tpu": ["jax[tpu]==0.10.2"],
        "hf": ["datasets>=3,<6"],  # Hugging Face `datasets` inputs (hub names, saved datasets).
        "wandb": ["wandb>=0.19,<1"],  # log.wandb=true: Weights & Biases beside TensorBoard and metrics.jsonl.
        "plot": ["matplotlib>=3.7,<4"],  # make plot RUN=runs/<name>: PNG curves of a run.
    },
)
