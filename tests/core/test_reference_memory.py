"""No weights held for nothing: a fully fine-tuned policy keeps a frozen reference copy only when its algorithm reads
the reference (a KL term); without one, entering the reference is a clear error, not a silent use of the trained
weights."""

import pytest
import torch

from mmgrpo import config as config_mod
from mmgrpo.reference import reference_needed
from mmgrpo.trainer import Trainer, build_components

from builders._runs import dgpo_config


def _full_run(tmp_path, tiny_sd3_dir, kl_beta):
    raw = dgpo_config(tmp_path, tiny_sd3_dir, 1)
    raw["pipeline"]["lora_rank"] = 0
    raw["algorithm"] = {"name": "flow_grpo", "kl_beta": kl_beta}
    return config_mod.from_dict(raw)


def _parameters(module) -> int:
    return sum(p.numel() for p in module.parameters())


def test_full_fine_tuning_without_kl_keeps_no_reference_copy(tmp_path, tiny_sd3_dir):
    policy, algorithm, _, _ = build_components(_full_run(tmp_path / "a", tiny_sd3_dir, 0.0))
    assert not algorithm.traits.needs_reference and policy.trainable.switch.frozen is None
    with pytest.raises(RuntimeError, match="keeps no reference copy"):
        with policy.reference():
            pass


def test_full_fine_tuning_with_kl_keeps_the_initial_weights_as_reference(tmp_path, tiny_sd3_dir):
    config = _full_run(tmp_path / "b", tiny_sd3_dir, 0.04)
    trainer = Trainer(config)
    frozen = trainer.policy.trainable.switch.frozen
    assert frozen is not None and _parameters(frozen) == _parameters(trainer.policy.transformer)
    before = [p.detach().clone() for p in frozen.parameters()]
    trainer.train()
    for a, b in zip(frozen.parameters(), before):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_lora_needs_no_copy_either_way_and_the_context_restores(tiny_sd3_dir):
    from mmgrpo.pipelines.sd3 import SD3Config, SD3Policy

    options = dict(pretrained=tiny_sd3_dir, resolution=32, num_steps=2, guidance_scale=1.0, max_sequence_length=16)
    with reference_needed(False):
        lora = SD3Policy(SD3Config(lora_rank=4, **options))
    with lora.reference():  # the adapter switched off: no copy needed
        pass
    full = SD3Policy(SD3Config(lora_rank=0, **options))  # outside the context: the copy is kept
    assert lora.trainable.switch.frozen is None and full.trainable.switch.frozen is not None
