"""Single-device Pallas kernels with pure-jnp references (no mesh knowledge)."""
