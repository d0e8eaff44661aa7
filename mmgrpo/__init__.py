"""mmgrpo: group-relative RL for multimodal generative models."""

__version__ = "0.1.0"
