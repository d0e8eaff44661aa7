"""Plugins from the user's own code: installed distributions' entry points (listed, shown and used by name like the
built-in plugins, without a flag) and ``module:attribute`` specs (imported only with ``--allow-plugins``), both checked
against their kind's declarations before any model loads; a plain function as a reward.

The third-party package is a real installed-distribution layout written into a temporary folder on ``sys.path``: the
package and a ``.dist-info`` folder whose ``entry_points.txt`` ``importlib.metadata`` reads."""

import sys
import textwrap

import pytest
import torch

from mmgrpo import config as config_mod, registry
from mmgrpo.cli import main
from mmgrpo.config_yaml import dump_yaml
from mmgrpo.trainer import Trainer

REWARDS = '''
"""Rewards of the acme package."""

from dataclasses import dataclass

from mmgrpo.types import RewardResult


@dataclass
class BrightConfig:
    """Options of BrightReward.

    Args:
        scale (`float`): multiplies the score.
    """

    scale: float = 1.0


class BrightReward:
    """Mean pixel brightness of each image, times scale."""

    Config = BrightConfig
    modalities = frozenset({"image"})
    artifacts = frozenset()
    group_stage = None

    @classmethod
    def modalities_for(cls, config):
        return frozenset({"image"})

    @classmethod
    def artifacts_for(cls, config):
        return frozenset()

    def __init__(self, config=None):
        self.config = config or BrightConfig()

    def __call__(self, outputs, batch):
        return RewardResult(scores=outputs["images"].mean(dim=(1, 2, 3)) * self.config.scale)


def brightness(outputs, batch, scale=1.0):
    """Mean pixel brightness, as a plain function."""
    return outputs["images"].mean(dim=(1, 2, 3)) * scale


def wrong_length(outputs, batch):
    return [0.5]


class Undeclared:
    """A class that declares a Config and nothing else."""

    @dataclass
    class Config:
        pass
'''
PROMPTS = '''
"""Prompt sources of the acme package."""

from dataclasses import dataclass


@dataclass
class WordsConfig:
    """Options of WordsPrompts.

    Args:
        n (`int`): training items.
    """

    n: int = 4


class WordsPrompts:
    """Colour words as prompts, two held out."""

    Config = WordsConfig
    disjoint_splits = True

    def __init__(self, config=None):
        self.config = config or WordsConfig()

    def train_items(self):
        return [{"prompt": f"a red circle {i}", "metadata": {}} for i in range(self.config.n)]

    def eval_items(self):
        return [{"prompt": "a blue square", "metadata": {}}, {"prompt": "a green square", "metadata": {}}]

    def eval_splits(self):
        return {"eval": self.eval_items()}
'''
ENTRY_POINTS = """
[mmgrpo.rewards]
acme_bright = acme_plugins.rewards:BrightReward
acme_brightness = acme_plugins.rewards:brightness

[mmgrpo.data]
acme_words = acme_plugins.prompts:WordsPrompts
"""


@pytest.fixture
def acme(tmp_path, monkeypatch):
    """The ``acme-plugins`` distribution, installed into a folder on ``sys.path``; forgotten afterwards."""
    site = tmp_path / "site"
    package = site / "acme_plugins"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text('"""The acme plugins."""\n')
    (package / "rewards.py").write_text(REWARDS)
    (package / "prompts.py").write_text(PROMPTS)
    (package / "noisy.py").write_text(f"open({str(tmp_path / 'ran.txt')!r}, 'w').write('ran')\n")
    info = site / "acme_plugins-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: acme-plugins\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(textwrap.dedent(ENTRY_POINTS))
    monkeypatch.syspath_prepend(str(site))
    yield tmp_path
    registry.allow_user_code(False)
    for name in [m for m in sys.modules if m == "acme_plugins" or m.startswith("acme_plugins.")]:
        del sys.modules[name]


def shapes_config(tmp_path, reward: dict, data: str = "shapes") -> list[str]:
    """A config file of the shipped tiny text-to-image model with this reward and prompt source."""
    file = tmp_path / "run.yaml"
    file.write_text(dump_yaml({
        "output_dir": str(tmp_path / "out"),
        "pipeline": {"name": "sd3", "pretrained": "mmgrpo:t2i_shapes_p2", "resolution": 32, "num_steps": 4,
                     "guidance_scale": 1.0, "max_sequence_length": 4, "lora_rank": 0},
        "algorithm": {"name": "flow_grpo"}, "reward": reward, "data": {"name": data},
        "train": {"prompts_per_step": 2, "group_size": 2, "minibatch_size": 4}, "eval": {"every": 0}}))
    return [str(file)]


def test_list_and_show_include_installed_plugins_without_importing_them(acme, capsys):
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    bright = next(line for line in out.splitlines() if line.split()[:1] == ["acme_bright"])
    assert "Mean pixel brightness of each image, times scale." in bright and "acme-plugins" in bright
    assert any(line.split()[:1] == ["acme_words"] for line in out.splitlines())
    assert "acme_plugins" not in sys.modules  # listing runs no third-party code
    assert main(["show", "acme_bright"]) == 0
    shown = capsys.readouterr().out
    assert shown.startswith("reward acme_bright:") and "scale: float = 1.0" in shown and "multiplies the score" in shown


def test_installed_plugins_pass_check_by_name_without_a_flag(acme, capsys):
    args = shapes_config(acme, {"name": "acme_bright", "scale": 2.0}, "acme_words")
    assert main(["check", *args]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "name: acme_bright" in out and "scale: 2.0" in out and out.endswith("ok\n")


def test_a_module_attribute_spec_is_imported_only_with_allow_plugins(acme, capsys):
    args = shapes_config(acme, {"name": "acme_plugins.noisy:anything", "modalities": ["image"]})
    assert main(["check", *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "reward.name" in err and "--allow-plugins" in err
    assert not (acme / "ran.txt").exists() and "acme_plugins" not in sys.modules
    spec = shapes_config(acme, {"name": "acme_plugins.rewards:brightness", "modalities": ["image"],
                                  "kwargs": {"scale": 3.0}})
    assert main(["check", *spec, "--allow-plugins"]) == 0, capsys.readouterr().err
    assert "kwargs:\n    scale: 3.0" in capsys.readouterr().out


@pytest.mark.parametrize("name, complaint", [
    ("acme_plugins.rewards:Undeclared", "does not declare 'group_stage'"),
    ("acme_plugins.rewards:BrightConfig", "must declare `Config`"),  # a dataclass, not a reward
    ("acme_plugins.rewards:missing", "has no top-level 'missing'"),
    ("acme_plugins.nowhere:Reward", "could not be imported"),
])
def test_specs_get_the_declaration_checks_of_built_ins(acme, capsys, name, complaint):
    assert main(["check", *shapes_config(acme, {"name": name}), "--allow-plugins"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("mmgrpo: config error: reward.name:") and complaint in err


def test_an_algorithm_or_pipeline_spec_gets_its_kinds_checks(acme, capsys):
    file = shapes_config(acme, {"name": "acme_bright"})[0]
    for key, complaint in (("algorithm.name", "does not declare 'scoring'"),
                           ("pipeline.name", "does not declare 'modalities'")):
        assert main(["check", file, f"{key}=acme_plugins.rewards:Undeclared", "--allow-plugins"]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"mmgrpo: config error: {key}:") and complaint in err, err


def test_a_function_reward_needs_its_modalities_and_checks_what_it_returns(acme, capsys):
    assert main(["check", *shapes_config(acme, {"name": "acme_brightness"})]) == 2  # an installed function
    assert "reward.modalities" in capsys.readouterr().err
    registry.allow_user_code()  # what --allow-plugins says
    reward_cls = registry.get("reward", "acme_plugins.rewards:wrong_length")
    reward = reward_cls(reward_cls.Config(modalities=["image"]))
    with pytest.raises(ValueError, match="shape \\(1,\\) for 2 samples"):
        reward({"images": torch.rand(2, 3, 4, 4)}, [None, None])


def test_a_function_reward_trains(acme, tmp_path, tiny_sd3_dir):
    """One step of the tiny SD3 rewarded by the plain function, its scores logged as the reward."""
    registry.allow_user_code()
    raw = {"output_dir": str(tmp_path / "run"), "seed": 0,
           "pipeline": {"name": "sd3", "pretrained": tiny_sd3_dir, "resolution": 32, "num_steps": 2,
                        "guidance_scale": 1.0, "lora_rank": 4, "max_sequence_length": 16},
           "algorithm": {"name": "flow_grpo"},
           "reward": {"name": "acme_plugins.rewards:brightness", "modalities": ["image"], "kwargs": {"scale": 2.0}},
           "data": {"name": "acme_words"},
           "train": {"max_steps": 1, "prompts_per_step": 2, "group_size": 2, "minibatch_size": 4},
           "eval": {"every": 0}, "tracking": {"log_with": []}}
    trainer = Trainer(config_mod.from_dict(raw))
    images = trainer.policy.sample(trainer.stream.next_batch(2).repeat(2), trainer.algorithm.schedule(2)).outputs
    expected = images["images"].mean(dim=(1, 2, 3)) * 2.0
    assert trainer.reward(images, [None] * 4).scores.tolist() == pytest.approx(expected.tolist())
    assert trainer.train()["steps"] == 1
    assert 0 < trainer.log.path.read_text().count("reward/mean")


def test_show_a_module_attribute_spec_only_with_allow_plugins(acme, capsys):
    assert main(["show", "acme_plugins.noisy:anything"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--allow-plugins" in err
    assert not (acme / "ran.txt").exists() and "acme_plugins" not in sys.modules  # nothing imported
    assert main(["show", "acme_plugins.rewards:BrightReward", "--allow-plugins"]) == 0, capsys.readouterr().err
    shown = capsys.readouterr().out
    assert shown.startswith("reward acme_plugins.rewards:BrightReward: Mean pixel brightness")
    assert "scale: float = 1.0" in shown and "multiplies the score" in shown
    assert main(["show", "acme_plugins.prompts:WordsPrompts", "--kind", "data", "--allow-plugins"]) == 0
    assert "n: int = 4" in capsys.readouterr().out
    assert main(["show", "acme_plugins.rewards:brightness", "--allow-plugins"]) == 0  # a plain function
    shown = capsys.readouterr().out
    assert shown.startswith("reward acme_plugins.rewards:brightness: Mean pixel brightness, as a plain function.")
    assert "modalities: list = []" in shown and "kwargs: dict = {}" in shown
    assert main(["show", "acme_plugins.rewards:Undeclared", "--allow-plugins"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no plugin of any kind" in err and "does not declare 'group_stage'" in err
    assert main(["show", "acme_plugins.rewards:Undeclared", "--kind", "reward", "--allow-plugins"]) == 2
    assert "does not declare 'group_stage'" in capsys.readouterr().err
