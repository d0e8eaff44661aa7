"""The shipped text-to-video base model (``mmgrpo:t2v_shapes``, trained by scripts/train_t2v_shapes.py) loads through
the `wan` policy as the embedded default configures it, samples clips of the configured shape that the moving-shapes
reward can score, and is clearly imperfect (RL has room)."""

import json
from pathlib import Path

from mmgrpo import config as config_mod
from mmgrpo.hub import resolve_pretrained

from builders._repo_files import load_repo_script
from builders._runs import held_out_flow_rollout

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "tiny" / "t2v_shapes.yaml"


def test_shipped_metrics_record_an_imperfect_base_and_the_sampling_settings():
    cfg = config_mod.load(CONFIG)
    path = Path(resolve_pretrained("mmgrpo:t2v_shapes"))
    metrics = json.loads((path / "metrics.json").read_text(encoding="utf-8"))
    assert 0.25 <= metrics["heldout"]["strict"] <= 0.6, metrics["heldout"]  # room to improve, but it draws clips
    sampling, options = metrics["sampling"], cfg.pipeline.options
    assert (sampling["height"], sampling["width"], sampling["num_frames"]) == (
        options.height, options.width, options.num_frames)
    assert sampling["max_sequence_length"] == options.max_sequence_length
    assert list(metrics["args"]["kinds"]) == list(cfg.data.options.kinds)  # RL trains the kinds the base model knows


def test_shipped_model_samples_clips_through_the_wan_policy(monkeypatch):
    monkeypatch.chdir(ROOT)
    cfg, batch, rollout, reward = held_out_flow_rollout(CONFIG, 12)
    videos = rollout.outputs["videos"]  # [N, F, 3, H, W]
    options = cfg.pipeline.options
    assert videos.shape == (12, options.num_frames, 3, options.height, options.width)
    assert videos.min() >= 0 and videos.max() <= 1
    result = reward(rollout.outputs, batch)
    # the model passes some of the checks (an untrained one passes none: the share of checks passed is 0)
    assert result.components["partial"].mean() >= 0.15, result.components["partial"]


def test_script_defaults_build_the_shipped_architecture(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))  # the script imports its image sibling's schedule
    script = load_repo_script("scripts", "train_t2v_shapes")
    args = script.parse_args(["--output", "unused"])
    path = Path(resolve_pretrained("mmgrpo:t2v_shapes"))
    shipped = json.loads((path / "metrics.json").read_text(encoding="utf-8"))
    assert (args.patch_t, args.patch_s) == (shipped["args"]["patch_t"], shipped["args"]["patch_s"]) == (3, 1)
    pipe = script.build_pipeline(args)
    config = json.loads((path / "transformer" / "config.json").read_text(encoding="utf-8"))
    assert list(pipe.transformer.config.patch_size) == config["patch_size"] == [3, 1, 1]
    assert sum(p.numel() for p in pipe.transformer.parameters()) == shipped["parameters"]["transformer"]
