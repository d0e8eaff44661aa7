"""The shipped image-editing base model (``mmgrpo:edit_shapes``, trained by scripts/train_edit_shapes.py) loads with
plain `FluxKontextPipeline.from_pretrained` and through the `flux_kontext` policy as the embedded edit default
configures it, edits held-out scenes that `edit_fidelity` can score, and is clearly imperfect (RL has room)."""

import json
from pathlib import Path

from mmgrpo import config as config_mod
from mmgrpo.hub import resolve_pretrained

from builders._repo_files import load_repo_script
from builders._runs import held_out_flow_rollout

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "tiny" / "edit_shapes.yaml"


def shipped() -> tuple[Path, dict]:
    path = Path(resolve_pretrained("mmgrpo:edit_shapes"))
    return path, json.loads((path / "metrics.json").read_text(encoding="utf-8"))


def test_shipped_metrics_record_an_imperfect_base_and_the_sampling_settings():
    cfg = config_mod.load(CONFIG)
    path, metrics = shipped()
    assert 0.1 <= metrics["heldout"]["strict"] <= 0.6, metrics["heldout"]  # room to improve, but it edits
    assert metrics["vae_reconstruction_strict"] >= 0.95  # the VAE alone loses (almost) nothing
    sampling, options = metrics["sampling"], cfg.pipeline.options
    assert sampling["height"] == sampling["width"] == options.resolution == cfg.data.options.size
    assert sampling["max_sequence_length"] == options.max_sequence_length
    assert sampling["num_inference_steps"] == options.num_steps
    weights = sum(f.stat().st_size for f in path.rglob("*.safetensors"))
    assert weights == metrics["weights_bytes"] < 8e6  # small enough for the repository


def test_shipped_model_loads_in_the_stock_pipeline_and_edits_through_the_policy(monkeypatch):
    import torch
    from diffusers import FluxKontextPipeline

    path, metrics = shipped()
    pipe = FluxKontextPipeline.from_pretrained(path, use_safetensors=True)
    counts = {name: sum(p.numel() for p in getattr(pipe, name).parameters()) for name in metrics["parameters"]}
    assert counts == metrics["parameters"]
    monkeypatch.chdir(ROOT)
    cfg, batch, rollout, reward = held_out_flow_rollout(CONFIG, 12)
    images = rollout.outputs["images"]  # [N, 3, H, W]
    assert images.shape == (12, 3, cfg.pipeline.options.resolution, cfg.pipeline.options.resolution)
    result = reward(rollout.outputs, batch)
    # the edit keeps most of the scene (an untrained model's noise keeps nothing) and it edits some right
    assert result.components["edit_preserve"].mean() >= 0.8, result.components["edit_preserve"]
    assert torch.isfinite(result.scores).all()


def test_script_defaults_build_the_shipped_architecture(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    script = load_repo_script("scripts", "train_edit_shapes")
    args = script.parse_args(["--output", "unused"])
    path, metrics = shipped()
    defaults = {k: v for k, v in vars(args).items() if k != "output"}
    assert {k: defaults[k] for k in metrics["args"]} == metrics["args"]
    # options added after the shipped model was trained are off by default (it trained its text encoders)
    assert {k: v for k, v in defaults.items() if k not in metrics["args"]} == {"freeze_text_encoders": False,
                                                                                 "all_edits_per_scene": False,
                                                                                 "context_loss": 0.0}
    pipe = script.build_pipeline(args)
    config = json.loads((path / "transformer" / "config.json").read_text(encoding="utf-8"))
    assert pipe.transformer.config.num_layers == config["num_layers"]
    assert sum(p.numel() for p in pipe.transformer.parameters()) == metrics["parameters"]["transformer"]


def test_frozen_text_encoders_stay_at_their_initialisation(monkeypatch, tmp_path):
    """`--freeze-text-encoders`: a few steps of the script train the transformer only; the saved pipeline's text
    encoders are the randomly initialised ones `build_pipeline` makes for the seed."""
    import torch
    from diffusers import FluxKontextPipeline

    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    script = load_repo_script("scripts", "train_edit_shapes")
    argv = ["--output", str(tmp_path / "model"), "--freeze-text-encoders", "--n-train", "64", "--vae-steps", "2",
            "--vae-batch", "4", "--steps", "3", "--batch", "4", "--warmup", "1", "--eval-start", "2",
            "--eval-every", "2", "--n-select", "3", "--n-eval", "3", "--eval-steps", "2", "--checkpoint-every", "2"]
    initial = script.build_pipeline(script.parse_args(argv))
    script.main(argv)
    saved = FluxKontextPipeline.from_pretrained(tmp_path / "model")
    for name in ("text_encoder", "text_encoder_2"):
        before, after = getattr(initial, name).state_dict(), getattr(saved, name).state_dict()
        assert all(torch.equal(before[k], after[k]) for k in before), name
    moved = [not torch.equal(v, saved.transformer.state_dict()[k]) for k, v in initial.transformer.state_dict().items()]
    assert any(moved)  # the transformer trained
    assert json.loads((tmp_path / "model" / "metrics.json").read_text())["args"]["freeze_text_encoders"] is True


def test_all_edits_per_scene_trains_every_edit_of_the_same_scenes(monkeypatch):
    """`--all-edits-per-scene`: the base's training edits are every edit of the same training scenes that the one
    drawn edit per scene comes from."""
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    script = load_repo_script("scripts", "train_edit_shapes")
    one = script.training_edits(script.parse_args(["--output", "unused", "--n-train", "12"]))
    every = script.training_edits(script.parse_args(["--output", "unused", "--n-train", "12", "--all-edits-per-scene"]))
    key = lambda item: (repr(item["metadata"]["scene"]), item["prompt"])
    assert len(one) == 12 and {key(i) for i in one} < {key(i) for i in every}
    assert {repr(i["metadata"]["scene"]) for i in every} == {repr(i["metadata"]["scene"]) for i in one}


def test_context_loss_adds_the_change_at_the_input_tokens(monkeypatch):
    """`--context-loss w`: the base's loss is rectified flow on the target tokens plus w times the squared error of
    the outputs at the input's tokens against target - input, computed here element by element; 0 leaves the
    input's outputs out of the loss."""
    import torch

    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    script = load_repo_script("scripts", "train_edit_shapes")
    g = torch.Generator().manual_seed(0)
    pred, noise, x0, image = (torch.randn(shape, generator=g) for shape in [(2, 6, 4), (2, 3, 4), (2, 3, 4), (2, 3, 4)])
    flow = sum((pred[b, t, c] - (noise[b, t, c] - x0[b, t, c])) ** 2 for b in range(2) for t in range(3)
               for c in range(4)) / 24
    context = sum((pred[b, 3 + t, c] - (x0[b, t, c] - image[b, t, c])) ** 2 for b in range(2) for t in range(3)
                  for c in range(4)) / 24
    torch.testing.assert_close(script.edit_flow_loss(pred, noise, x0, image), flow)
    torch.testing.assert_close(script.edit_flow_loss(pred, noise, x0, image, 0.5), flow + 0.5 * context)
    changed = pred.clone()
    changed[:, 3:] += 1.0  # the input's outputs do not count without the option
    torch.testing.assert_close(script.edit_flow_loss(changed, noise, x0, image), flow)
