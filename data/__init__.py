"""Prompt sources, synthetic task generators, tiny components and shipped toy weights (``mmgrpo.data``)."""
