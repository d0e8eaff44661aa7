"""``train.ema``: the moving average of the trained weights that evaluations, checkpoints and exports hold, against the
authors' rule (Flow-GRPO / DiffusionNFT ``EMAModuleWrapper``), with exact resume."""

import pytest
import torch
from hypothesis import given, settings, strategies as st

from mmgrpo import checkpoint, config as config_mod, preflight
from mmgrpo.trainer import Trainer
from mmgrpo.validation import ConfigError
from mmgrpo.weight_ema import TRAINED_FILE, EMAConfig, WeightEMA

from test_trainer import make_config, read_metrics, weights


def authors_average(initial, trained, decay, interval):
    """The authors' rule written out: the average starts at the initial weights; after the optimizer step that makes
    `global_step` = u (1-based), if (u + 1) % interval == 0, ema += (1 - min((1 + u) / (10 + u), decay)) (p - ema)."""
    ema = [t.clone() for t in initial]
    for u, params in enumerate(trained, start=1):
        if (u + 1) % interval == 0:
            one_minus_decay = 1 - min((1 + u) / (10 + u), decay)
            ema = [e + one_minus_decay * (p - e) for e, p in zip(ema, params)]
    return ema


@settings(max_examples=40, deadline=None)
@given(decay=st.floats(0.0, 0.999), interval=st.integers(1, 5), n=st.integers(0, 12), seed=st.integers(0, 2**16))
def test_average_follows_the_authors_rule(decay, interval, n, seed):
    gen = torch.Generator().manual_seed(seed)
    param = torch.nn.Parameter(torch.randn(3, 2, generator=gen))
    initial = [param.detach().clone()]
    ema = WeightEMA(EMAConfig(decay=decay, update_every=interval))
    ema.start([param])
    trained = []
    for _ in range(n):
        with torch.no_grad():
            param.add_(torch.randn(3, 2, generator=gen))
        trained.append([param.detach().clone()])
        ema.after_update([param])
    expected = authors_average(initial, trained, decay, interval)
    torch.testing.assert_close(ema.average.shadow[0], expected[0], rtol=1e-5, atol=1e-5)
    with ema.applied([param]):
        torch.testing.assert_close(param.detach(), expected[0], rtol=1e-5, atol=1e-5)
    assert torch.equal(param.detach(), trained[-1][0] if trained else initial[0])  # restored bit for bit


@pytest.mark.parametrize("options, message", [({"decay": 1.0}, "train.ema.decay"),
                                              ({"update_every": 0}, "train.ema.update_every"),
                                              ({"decay": "high"}, "decay"), ({"rate": 0.9}, "rate")])
def test_bad_options_are_refused_before_anything_loads(tmp_path, tiny_sd3_dir, options, message):
    raw = make_config(tmp_path, tiny_sd3_dir, ema=options)
    with pytest.raises(ConfigError, match=message):
        config_mod.from_dict(raw)


def ema_config(tmp_path, tiny_sd3_dir, max_steps=4):
    raw = make_config(tmp_path, tiny_sd3_dir, ema={"decay": 0.9})
    raw["train"]["max_steps"] = max_steps
    return raw


def test_evaluations_and_checkpoints_hold_the_average_and_training_the_trained_weights(tmp_path, tiny_sd3_dir):
    trainer = Trainer(config_mod.from_dict(ema_config(tmp_path, tiny_sd3_dir)))
    initial, trained = weights(trainer), []
    for _ in range(4):  # one optimizer update per step (minibatch = the whole batch)
        trainer.step += 1
        trainer.train_step()
        trained.append(weights(trainer))
    expected = authors_average(initial, trained, 0.9, 1)
    assert any(not torch.equal(e, t) for e, t in zip(expected, trained[-1]))  # the average lags the weights
    for shadow, value in zip(trainer.weight_ema.average.shadow, expected):
        torch.testing.assert_close(shadow, value, rtol=1e-6, atol=1e-7)
    metrics = trainer.evaluate(4)
    path = trainer.save()
    assert all(torch.equal(a, b) for a, b in zip(weights(trainer), trained[-1]))  # trained weights back, bit for bit
    assert (path / TRAINED_FILE).is_file()

    # the checkpoint's weights/ are the average: `mmgrpo eval` (load_weights + evaluate) sees what training evaluated
    raw = ema_config(tmp_path, tiny_sd3_dir)
    raw["output_dir"] = str(tmp_path / "eval")
    evaluator = Trainer(config_mod.from_dict(raw), record_config=False)
    evaluator.load_weights(str(path))
    for a, b in zip(weights(evaluator), trainer.weight_ema.average.shadow):
        assert torch.equal(a, b)
    assert evaluator.evaluate(4) == metrics


def test_resume_with_the_average_is_exact(tmp_path, tiny_sd3_dir):
    full = Trainer(config_mod.from_dict(ema_config(tmp_path / "a", tiny_sd3_dir)))
    full.train()
    part = ema_config(tmp_path / "b", tiny_sd3_dir, max_steps=2)
    Trainer(config_mod.from_dict(part)).train()
    part["train"]["max_steps"], part["checkpoint"]["resume_from"] = 4, "latest"
    resumed = Trainer(config_mod.from_dict(part))
    assert resumed.step == 2
    resumed.train()
    for a, b in zip(weights(full), weights(resumed)):
        assert torch.equal(a, b)
    for a, b in zip(full.weight_ema.average.shadow, resumed.weight_ema.average.shadow):
        assert torch.equal(a, b)
    ma = [r for r in read_metrics(tmp_path / "a" / "run") if r["step"] == 4][0]
    mb = [r for r in read_metrics(tmp_path / "b" / "run") if r["step"] == 4][0]
    for key in ("reward/mean", "train/policy_loss", "eval/jpeg_kb"):
        assert ma[key] == mb[key]

    # without train.ema the averaged checkpoint is refused: training would go on from the average
    plain = make_config(tmp_path / "b", tiny_sd3_dir)
    plain["checkpoint"]["resume_from"] = "latest"
    plain["train"]["max_steps"] = 6
    with pytest.raises(ConfigError, match="train.ema"):  # `mmgrpo train`'s checks, before any model loads
        preflight.check_checkpoint(config_mod.from_dict(plain), resuming=True)
    with pytest.raises(ConfigError, match="train.ema"):
        Trainer(config_mod.from_dict(plain))
    assert [p.name for p in checkpoint.complete_checkpoints(tmp_path / "b" / "run" / "checkpoints")] == \
        ["step_0000002", "step_0000004"]
