"""dora_jax: DORA (Dynamic ORchestration for Asynchronous Rollout) in JAX."""

__version__ = "0.1.0"
