"""vapo_jax: VAPO (Value-based Augmented PPO) and its baselines for LLM reasoning RL in JAX/Flax."""

__version__ = "0.1.0"
