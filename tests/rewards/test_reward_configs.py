"""Every reward's options are a module-level dataclass named ``<Something>Config`` that the plugin class exposes as
``Config``, as algorithms and pipelines do."""

import dataclasses
import importlib

import pytest

from mmgrpo import registry


@pytest.mark.parametrize("name", sorted(registry.available("reward")))
def test_reward_config_is_a_module_level_dataclass(name):
    cls = registry.get("reward", name)
    config = cls.Config
    assert dataclasses.is_dataclass(config)
    assert config.__qualname__ == config.__name__ and config.__name__.endswith("Config")  # not nested in the class
    module = importlib.import_module(cls.__module__)
    assert getattr(module, config.__name__) is config and config.__module__ == cls.__module__
