"""pytest's setup for the tests and the docstring examples (`--doctest-modules`): 8 virtual
CPU devices, for the meshes of the ring's tests and examples, set before JAX initialises."""

import jax

jax.config.update("jax_num_cpu_devices", 8)
