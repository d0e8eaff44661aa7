"""Rewards: one `RewardFn` per file, imported as ``mmgrpo.rewards.<name>``."""
