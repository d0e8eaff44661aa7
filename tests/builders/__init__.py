"""Tiny real-class models for tests, one module per registered pipeline, named after it (``builders/<pipeline>.py``).

Each module provides:

- session-scoped pytest fixtures that write a tiny random model with ``save_pretrained`` to a temporary folder and
  return its path (e.g. ``tiny_sd3_dir``); `tests/conftest.py` registers every module here as a pytest plugin;
- ``build_policy(request)``: a tiny policy of its pipeline for the contract tests, which take it by the pipeline's
  registry name. A builder asks pytest's ``request`` for the fixtures it needs.

Adding a pipeline therefore touches its adapter file and its builder here, not a table in a test.
"""
