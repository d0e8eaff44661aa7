"""mmgrpo: group-relative RL for multimodal generative models."""

# the one version number: pyproject.toml reads it, `mmgrpo --version` prints it, checkpoints record it
__version__ = "0.2.0"
