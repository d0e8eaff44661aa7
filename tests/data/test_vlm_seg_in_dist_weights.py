"""The segmentation default's base (``mmgrpo:vlm_seg_in_dist``, ``scripts/train_vlm_seg.py --ood``): its supervised
stream never asks a question in one of the combinations that `seg_shapes`' ``ood`` split holds out, so that split is
out of distribution for it as for the RL and SFT runs that continue it; its training evaluated it on validation
scenes, not on the configs' held-out ones."""

import json
from pathlib import Path

from mmgrpo import config as config_mod
from mmgrpo.data.seg_shapes import HELD_OUT, SegShapes, SegShapesConfig
from mmgrpo.hub import resolve_pretrained
from builders._repo_files import load_repo_script

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = [ROOT / "configs" / "tiny" / "seg_shapes.yaml", ROOT / "configs" / "tiny" / "seg_shapes_sft.yaml"]


def _script():
    return load_repo_script("scripts", "train_vlm_seg")


def _combinations(source: SegShapes, first: int, count: int) -> set[tuple]:
    items = (source.item(index) for index in range(first, first + count))
    return {tuple(item["metadata"]["combination"]) for item in items if item is not None}


def test_the_ood_stream_never_asks_a_held_out_combination_and_asks_every_other():
    script = _script()
    args = script.argparse.Namespace(n_eval=0, size=56, template=script.TEMPLATE, thought="labelled", eval_seed=3,
                                     ood=True)
    asked = _combinations(script.supervised_source(args), script.SFT_FIRST, 3000)
    assert not asked & set(HELD_OUT)
    everything = _combinations(SegShapes(SegShapesConfig(n_train=0, n_eval=0)), script.SFT_FIRST, 3000)
    assert set(HELD_OUT) <= everything  # the plain stream asks them: the filter is what keeps them out
    assert asked == everything - set(HELD_OUT)


def test_the_default_and_its_sft_arm_start_from_the_in_dist_base_which_is_imperfect():
    metrics = json.loads(Path(resolve_pretrained("mmgrpo:vlm_seg_in_dist"), "metrics.json").read_text("utf-8"))
    assert metrics["args"]["ood"] and metrics["args"]["eval_seed"] != 0  # chosen on validation scenes
    for path in CONFIGS:
        cfg = config_mod.load(path)
        assert cfg.pipeline.options.pretrained == "mmgrpo:vlm_seg_in_dist"
        assert cfg.data.options.ood and cfg.eval.splits == ["eval", "ood"]
    last = metrics["history"][-1]
    assert last["giou"] == metrics["held_out_giou"] and 0 <= last["ood"]["giou"] <= 1
