"""Tiny real-class models for tests, one module per registered pipeline, named after it (``builders/<pipeline>.py``).

Each module provides:

- session-scoped pytest fixtures that write a tiny random model with ``save_pretrained`` to a temporary folder and
  return its path (e.g. ``tiny_sd3_dir``); `tests/conftest.py` registers every module here as a pytest plugin;
- ``build_policy(request)``: a tiny policy of its pipeline for the contract tests, which take it by the pipeline's
  registry name. A builder asks pytest's ``request`` for the fixtures it needs;
- the functions that build the tiny model (e.g. ``tiny_sd3_pipeline``), also used by the base-model training scripts
  of `scripts/`.

Parts shared by several builders live in ``_``-prefixed modules, which are not registered as plugins: the offline
tokenizers (`_tokenizers.py`: CLIP, T5, Qwen, character-level) and the diffusers parts (`_diffusers.py`).

Adding a pipeline therefore touches its adapter file and its builder here, not a table in a test.
"""
