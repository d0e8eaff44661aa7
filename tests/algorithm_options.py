"""`algo_config(Config, **options)`: an algorithm's Config from the flat options of a config file's ``algorithm:``
section (shared records included, e.g. ``kl_beta``, ``clip_low``, ``scale_rewards``), as `mmgrpo check` builds it."""

from mmgrpo.validation import build_dataclass


def algo_config(cls: type, **options):
    return build_dataclass(cls, options, "algorithm")
