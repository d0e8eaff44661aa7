"""The shared option records (`mmgrpo/algorithms/_options.py`): written flat in a config, each algorithm keeping its
own defaults under a partial override, written back flat in a run's config.json, typed for command-line overrides;
one meaning of `clip_high` (TRL's); and the advantages against the peers' worked numbers (GCPO's / VisualGRPO's eps
1e-8, TRL's batch std)."""

import dataclasses
import json

import pytest
import torch

from algorithm_options import algo_config
from mmgrpo import config as config_mod, registry
from mmgrpo.algorithms._options import AdvantageOptions, ClipOptions, KLOptions, RewardScaling
from mmgrpo.validation import ConfigError, build_dataclass, embedded, flat_hints

ALGORITHMS = sorted(registry.available("algorithm"))


def config_cls(name):
    return registry.get("algorithm", name).Config


def raw_config(tmp_path, algorithm):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red circle\na blue square\n")
    return {"output_dir": str(tmp_path / "out"), "pipeline": {"name": "sd3", "pretrained": "org/model"},
            "algorithm": algorithm, "reward": {"name": "jpeg"},
            "data": {"name": "prompt_file", "train_file": str(prompts)}}


def test_a_partial_override_keeps_the_algorithms_own_defaults():
    flow = algo_config(config_cls("flow_grpo"), adv_std="unbiased", kl_beta=0.04)
    assert flow.advantage == AdvantageOptions(adv_std="unbiased", adv_clip_max=5.0)  # eps 1e-4, clamp 5 kept
    assert flow.kl == KLOptions(kl_beta=0.04) and flow.clip == ClipOptions(clip_low=1e-4)
    chunk = algo_config(config_cls("chunk_grpo"), scale_rewards="batch")
    assert (chunk.advantage.adv_eps, chunk.advantage.adv_std, chunk.advantage.adv_clip_max) == (1e-8, "unbiased", 5.0)
    dapo = algo_config(config_cls("dapo"), clip_low=0.1)
    assert (dapo.clip.clip_low, dapo.clip.high) == (0.1, 0.28)  # its authors' clip-higher stays


def test_config_json_is_flat_and_reads_back(tmp_path):
    """A run folder's config.json holds the shared keys flat, as written, and loads back to the same config."""
    raw = raw_config(tmp_path, {"name": "grpo", "scale_rewards": "batch", "kl_schedule": "linear", "kl_beta": 0.0,
                                "kl_beta_end": 0.04, "kl_warmup_steps": 10, "clip_high": 0.3})
    cfg = config_mod.from_dict(raw)
    written = cfg.to_dict()["algorithm"]
    assert {"advantage", "kl", "clip"}.isdisjoint(written)
    assert (written["scale_rewards"], written["kl_beta_end"], written["clip_low"], written["clip_high"]) == (
        "batch", 0.04, 0.2, 0.3)
    again = config_mod.from_dict(json.loads(json.dumps(cfg.to_dict())))
    assert again.algorithm == cfg.algorithm


def test_overrides_find_the_shared_keys_types(tmp_path):
    raw = config_mod.apply_overrides(raw_config(tmp_path, {"name": "dgpo"}), [
        "algorithm.scale_rewards=batch", "algorithm.adv_clip_max=null", "algorithm.kl_beta=0.1",
        "algorithm.clip_high=5e-2"])
    options = config_mod.from_dict(raw).algorithm.options
    assert options.advantage.scale_rewards == "batch" and options.advantage.adv_clip_max is None
    assert options.kl.kl_beta == 0.1 and options.clip.high == 5e-2 and options.clip.clip_low == 1e-2
    assert config_mod.field_type(raw, ["algorithm", "scale_rewards"]) == RewardScaling  # read as text, not YAML


@pytest.mark.parametrize("key, value, message", [
    ("kl", {"kl_beta": 0.1}, r"Unknown config key algorithm\.kl\b"),  # flat only: no nested record
    ("clip_low", 0.0, r"^algorithm\.clip_low must be > 0 \(and < 1\), got 0\.0"),
    ("adv_eps", 0.0, r"^algorithm\.adv_eps must be > 0"),
    ("scale_rewards", "global", r"^algorithm\.scale_rewards must be 'group', 'batch' or 'none'"),
    ("global_std", True, r"^algorithm\.global_std was renamed: use algorithm\.scale_rewards: batch"),
])
@pytest.mark.parametrize("name", ["grpo", "flow_grpo", "gdpo"])
def test_shared_keys_are_checked_once_for_every_algorithm(name, key, value, message):
    with pytest.raises(ConfigError, match=message) as err:
        build_dataclass(config_cls(name), {key: value}, "algorithm")
    assert "\n" not in str(err.value)


def test_one_name_per_flat_key():
    @dataclasses.dataclass
    class Clashing:
        kl_beta: float = 0.0
        kl: KLOptions = embedded(KLOptions)

    with pytest.raises(TypeError, match="'kl_beta' is declared twice"):
        flat_hints(Clashing)


CLIPPING = [name for name in ALGORITHMS if "clip_low" in flat_hints(config_cls(name))]


def test_the_clipping_algorithms_are_found():
    assert {"grpo", "dapo", "flow_grpo", "chunk_grpo", "gdpo"} <= set(CLIPPING) < set(ALGORITHMS)


@pytest.mark.parametrize("name", CLIPPING)
def test_clip_high_unset_is_clip_low_in_every_algorithm(name):
    """TRL's rule (``epsilon_high`` unset = ``epsilon``) wherever a ratio is clipped."""
    cls = config_cls(name)
    symmetric = algo_config(cls, clip_low=0.1, clip_high=None)
    assert symmetric.clip.high == 0.1
    asymmetric = algo_config(cls, clip_low=0.1, clip_high=0.3)
    assert (asymmetric.clip.clip_low, asymmetric.clip.high) == (0.1, 0.3)


# GCPO and VisualGRPO: (r - mean) / (unbiased std + 1e-8); a group [1, 2, 3, 4] has unbiased std 1.2909944
GCPO = [-1.161895, -0.387298, 0.387298, 1.161895]
WITH_1E4 = [-1.161805, -0.387268, 0.387268, 1.161805]


@pytest.mark.parametrize("name", ["chunk_grpo", "e_grpo"])
def test_advantage_eps_is_the_authors(name):
    scores, groups = torch.tensor([1.0, 2.0, 3.0, 4.0]), torch.zeros(4, dtype=torch.long)
    algorithm = registry.get("algorithm", name)
    ours = algorithm(config_cls(name)()).advantages(scores, groups)
    torch.testing.assert_close(ours, torch.tensor(GCPO), rtol=0, atol=1e-6)
    pinned = algorithm(algo_config(config_cls(name), adv_eps=1e-4)).advantages(scores, groups)  # the tiny configs'
    torch.testing.assert_close(pinned, torch.tensor(WITH_1E4), rtol=0, atol=1e-6)
    assert float((ours - pinned).abs().max()) > 5e-5


def test_grpo_batch_scale_is_trls():
    """TRL's ``scale_rewards="batch"``: the group's mean, the whole batch's unbiased std + 1e-4 (the notes' example:
    summed rewards of two groups of three)."""
    scores = torch.tensor([1.1, 0.4, 1.25, 0.45, 0.05, 1.2])
    groups = torch.tensor([0, 0, 0, 1, 1, 1])
    grpo = registry.get("algorithm", "grpo")
    batch = grpo(algo_config(config_cls("grpo"), scale_rewards="batch")).advantages(scores, groups)
    torch.testing.assert_close(batch, torch.tensor([0.362686, -1.022115, 0.659429, -0.2308, -1.022115, 1.252916]),
                               rtol=0, atol=2e-6)
    group = grpo(config_cls("grpo")()).advantages(scores, groups)
    torch.testing.assert_close(group, torch.tensor([0.404006, -1.138562, 0.734556, -0.199803, -0.884841, 1.084643]),
                               rtol=0, atol=2e-6)


def test_e_grpo_kl_is_the_transition_kl_at_each_samples_own_step():
    """E-GRPO takes the shared KL options too: ``kl_beta`` times the exact KL of the Gaussian transitions to the
    reference, ``(mu - mu_ref)^2 / (2 std^2)`` averaged over the elements of each sample's own SDE step only."""
    cls = registry.get("algorithm", "e_grpo")
    assert not cls(config_cls("e_grpo")()).traits.needs_reference  # off by default: no reference forward
    algorithm = cls(algo_config(config_cls("e_grpo"), sde_steps=[0, 1], kl_beta=0.5))
    assert algorithm.traits.needs_reference and {"mean", "std"} <= algorithm.traits.reads
    mask = torch.tensor([[True, False], [False, True]])  # [2, K=2]: each sample's own step
    mean = torch.tensor([[[1.0, 2.0], [9.0, 9.0]], [[9.0, 9.0], [0.5, -0.5]]], requires_grad=True)  # [2, 2, 2]
    ref_mean = torch.tensor([[[0.0, 2.0], [0.0, 0.0]], [[0.0, 0.0], [0.0, 0.0]]])
    std = torch.tensor([[[0.5], [0.0]], [[0.0], [1.0]]])  # [2, 2, 1]; 0 at the placeholders
    from mmgrpo.types import Score

    new = Score(log_prob=torch.zeros(2, 2), mask=mask, mean=mean, std=std)
    out = algorithm.loss(new, torch.zeros(2, 2), torch.zeros(2), Score(log_prob=torch.zeros(2, 2), mean=ref_mean))
    by_hand = ((1.0 / (2 * 0.25) + 0.0) / 2 + (0.25 / 2 + 0.25 / 2) / 2) / 2  # sample 0: (2 + 0) / 2; sample 1: 0.25
    assert out.metrics["kl"] == pytest.approx(by_hand) and out.loss.item() == pytest.approx(0.5 * by_hand)
