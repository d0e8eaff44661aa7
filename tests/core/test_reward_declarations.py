"""What a reward scores and adds for the sample writers comes from its class's declarations for its options
(``modalities_for``, ``artifacts_for``), read by ``mmgrpo check`` before any model loads: a reward of the user's own,
without a ``modality`` option, is checked by its declaration; a composite derives its own from its components'; the
artifacts must be drawn by a writer of the pipeline's modalities and added by one component only."""

import sys
import textwrap

import pytest

import mmgrpo.rewards
from builders._sam import tiny_sam2_dir  # noqa: F401
from mmgrpo import config as config_mod, registry
from mmgrpo.preflight import check_modalities, reward_artifacts, reward_modalities
from mmgrpo.validation import ConfigError

PLUGIN = "decl_probe_reward"  # a module name no shipped reward uses
SOURCE = '''
    """Scores what its `target` option names (a reward of the user's own: no `modality` option, no probing)."""
    from dataclasses import dataclass

    import torch

    from mmgrpo.types import RewardResult


    @dataclass
    class TargetConfig:
        target: str = "text"
        heatmaps: bool = False


    class Target:
        Config = TargetConfig
        modalities = frozenset()  # an instance holds its options'
        artifacts = frozenset()
        group_stage = None

        @classmethod
        def modalities_for(cls, config):
            return frozenset({config.target})

        @classmethod
        def artifacts_for(cls, config):
            return frozenset({"heatmap"}) if config.heatmaps else frozenset()

        def __init__(self, config):
            self.modalities, self.artifacts = self.modalities_for(config), self.artifacts_for(config)

        def __call__(self, outputs, batch):
            return RewardResult(scores=torch.zeros(len(batch)))


    PLUGIN = Target
'''


@pytest.fixture
def own_reward(tmp_path):
    """A reward module of the user's own, found by the registry beside the shipped ones."""
    (tmp_path / f"{PLUGIN}.py").write_text(textwrap.dedent(SOURCE))
    mmgrpo.rewards.__path__.append(str(tmp_path))
    try:
        yield PLUGIN
    finally:
        mmgrpo.rewards.__path__.remove(str(tmp_path))
        sys.modules.pop(f"mmgrpo.rewards.{PLUGIN}", None)


def _config(tmp_path, reward: dict):
    """A text experiment (the shipped tiny masked-diffusion LM) with `reward`; nothing is loaded to check it."""
    return config_mod.from_dict({
        "output_dir": str(tmp_path / "out"),
        "pipeline": {"name": "mdlm", "pretrained": "mmgrpo:mdlm_arith", "gen_length": 4, "steps_per_block": 4},
        "algorithm": {"name": "cj_grpo"}, "reward": reward, "data": {"name": "arith", "digits": 2, "n_train": 100, "n_eval": 20},
    })


def test_an_own_reward_is_checked_by_its_declaration(own_reward, tmp_path):
    check_modalities(_config(tmp_path, {"name": own_reward, "target": "text"}))
    assert reward_modalities(own_reward, registry.get("reward", own_reward).Config(target="video")) == {"video"}
    with pytest.raises(ConfigError, match=rf"reward '{own_reward}' scores \['video'\] but pipeline 'mdlm' produces"):
        check_modalities(_config(tmp_path, {"name": own_reward, "target": "video"}))


def test_a_composite_derives_its_modalities_from_its_components(own_reward, tmp_path):
    both = {"name": "composite", "rewards": {"own": {"name": own_reward, "target": "video"}, "format": {}}}
    config = _config(tmp_path, both)
    assert reward_modalities("composite", config.reward.options) == {"video", "text"}
    with pytest.raises(ConfigError, match=r"reward 'composite' scores \['text', 'video'\]"):
        check_modalities(config)
    both["rewards"]["own"]["target"] = "text"
    check_modalities(_config(tmp_path, both))


def test_artifacts_need_a_writer_and_one_owner(own_reward, tmp_path):
    with pytest.raises(ConfigError, match=r"adds the artifacts \['heatmap'\] for the sample writers, which no writer"):
        check_modalities(_config(tmp_path, {"name": own_reward, "heatmaps": True}))
    twice = {"name": "composite", "rewards": {"a": {"name": own_reward, "heatmaps": True},
                                              "b": {"name": own_reward, "heatmaps": True}}}
    with pytest.raises(ConfigError, match=r"reward\.rewards\.a and reward\.rewards\.b both add the artifact 'heatmap'"):
        check_modalities(_config(tmp_path, twice))
    once = _config(tmp_path, {"name": "composite", "rewards": {"a": {"name": own_reward}, "format": {}}})
    assert reward_artifacts("composite", once.reward.options) == frozenset()


def test_sam_mask_in_a_composite_declares_its_overlay_artifacts(tmp_path, tiny_sam2_dir):
    rewards = {"sam": {"name": "sam_mask", "model": tiny_sam2_dir, "device": "cpu"}, "format": {}}
    config = _config(tmp_path, {"name": "composite", "rewards": rewards})
    assert reward_artifacts("composite", config.reward.options) == {"mask", "seg_prompts"}
    check_modalities(config)  # the text writer draws them
    rewards["sam"]["attach_masks"] = False
    assert reward_artifacts("composite", _config(tmp_path, {"name": "composite", "rewards": rewards}).reward.options) \
        == frozenset()

