"""Prompt sources, one per file (``mmgrpo.data.<name>``, the registry name), and the toy base models that configs
name as ``mmgrpo:<name>`` (``weights/<name>``)."""
