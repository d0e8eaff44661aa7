"""Contract tests parametrised over every registry entry: a new plugin is tested by these without new tests.

Each registered pipeline must have a tiny builder, `builders/<pipeline>.py` with a `build_policy(request)`; the test
that checks this fails for a new pipeline until one is added."""

import dataclasses
import importlib
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from mmgrpo import registry
from mmgrpo.protocols import Algorithm, RewardFn, StochasticPolicy
from mmgrpo.preflight import SCORING_METHODS, require_plan, require_scores
from mmgrpo.components import check_plan, score_unit
from mmgrpo.plans import FEATURE_SCORE_FIELDS
from mmgrpo.types import PromptBatch, Score
from mmgrpo.algorithms._options import AdvantageOptions, KLOptions, KLWeight
from mmgrpo.validation import build_dataclass, flat_dict, flat_hints, is_embedded
from reward_fixtures import (  # noqa: F401
    jpeg_server, tiny_aesthetic_head, tiny_clip_dir, tiny_hps_checkpoint, tiny_image_reward, tiny_owlvit_dir,
    tiny_pickscore_dir, tiny_trocr_dir,
)
from builders._sam import tiny_sam2_dir  # noqa: F401
from judge_server import judge_server  # noqa: F401
from hpsv3_checkpoint import BUDGET as HPSV3_PIXELS, tiny_hpsv3_dir  # noqa: F401
from videoscore_checkpoint import TINY_OPTIONS as VIDEOSCORE_OPTIONS, tiny_videoscore_dir  # noqa: F401


TEXTS = [
    "<think>look</think><answer>[4, 4, 20, 20]</answer>",
    "<answer>42</answer>",
    "junk [4, 4, 1, 1] 41",
    "",
    "<think>a</think><answer>\\frac{84}{2}</answer>",
]
SAMPLE_OUTPUTS = {  # modality -> outputs of n samples (a reward gets the union over its modalities)
    "image": lambda n: {"images": torch.rand(n, 3, 32, 32, generator=torch.Generator().manual_seed(n))},
    "video": lambda n: {"videos": torch.rand(n, 2, 3, 32, 32, generator=torch.Generator().manual_seed(n))},
    "text": lambda n: {"texts": [TEXTS[i % len(TEXTS)] for i in range(n)]},
    "mask": lambda n: {"masks": torch.rand(n, 16, 16, generator=torch.Generator().manual_seed(n))},
}


def _tiny_clip(request) -> dict:
    return {"model_name": f"local-dir:{request.getfixturevalue('tiny_clip_dir')}", "device": "cpu"}


def _judge_server(request):
    from mmgrpo.rewards._judge import JudgeServer

    return JudgeServer(url=request.getfixturevalue("judge_server").url, timeout=5.0, retries=0)


def _tiny_hps(folder: str, checkpoint: str) -> dict:
    return {"model_name": f"local-dir:{folder}", "checkpoint": checkpoint, "device": "cpu"}


def _tiny_image_reward(folder) -> dict:
    return {"model": str(folder), "tokenizer": str(folder / "tokenizer"), "device": "cpu"}


# reward name -> options needed to build it in tests (defaults otherwise); a callable gets pytest's `request`
REWARD_OPTIONS = {
    "clip_score": _tiny_clip,
    "aesthetic": lambda request: {**_tiny_clip(request), "head_path": request.getfixturevalue("tiny_aesthetic_head")},
    "pickscore": lambda request: {"model": request.getfixturevalue("tiny_pickscore_dir"), "processor": None, "device": "cpu"},
    "remote": lambda request: {"url": request.getfixturevalue("jpeg_server").url, "timeout": 10.0, "retries": 0},
    "composite": {"rewards": {"format": {"weight": 0.5}, "accuracy": {}, "jpeg": {"weight": 0.01}}},
    "temporal_consistency": _tiny_clip,
    "dpp_diversity": _tiny_clip,
    "sam_mask": lambda request: {"model": request.getfixturevalue("tiny_sam2_dir"), "device": "cpu", "coords": "original"},
    "judge": lambda request: {"server": _judge_server(request)},
    "judge_pairwise": lambda request: {"server": _judge_server(request), "template": "PAIR {prompt}"},
    "hpsv2": lambda request: _tiny_hps(*request.getfixturevalue("tiny_hps_checkpoint")),
    "ocr": lambda request: {"model": request.getfixturevalue("tiny_trocr_dir"), "device": "cpu", "max_new_tokens": 4},
    "image_reward": lambda request: _tiny_image_reward(request.getfixturevalue("tiny_image_reward")[0]),
    "hpsv3": lambda request: {"model": str(request.getfixturevalue("tiny_hpsv3_dir")), "pixels": HPSV3_PIXELS,
                              "base": str(request.getfixturevalue("tiny_hpsv3_dir") / "base"), "device": "cpu"},
    "videoscore": lambda request: {"model": str(request.getfixturevalue("tiny_videoscore_dir")), **VIDEOSCORE_OPTIONS},
    "geneval_detector": lambda request: {"clip_model_name": _tiny_clip(request)["model_name"], "device": "cpu",
                                         "detector": request.getfixturevalue("tiny_owlvit_dir"), "threshold": 0.2},
}
# fit the tiny policies' 3 steps (dgpo); read the transitions' mean and std (flow_grpo's KL term)
ALGORITHM_OPTIONS = {"dgpo": {"trunc_steps": 2, "num_train_timesteps": 2},
                     "dance_grpo": {"kl_beta": 0.04},  # the KL term reads the transitions' mean and std
                     "mix_grpo": {"kl_beta": 0.04},
                     "diffusion_nft": {"scale_rewards": "group"},
                     "awm": {"scale_rewards": "group", "num_train_timesteps": 2},
                     "flow_grpo": {"kl_beta": 0.04}}

ALGORITHM_OPTIONS["branch_grpo"] = {"tree_split_points": [0]}  # a tree of 2 leaves: the contract's groups of 2


def build_algorithm(name: str, **options):
    """Algorithm `name` with its tested options (`ALGORITHM_OPTIONS`) and `options`, flat as in a config file."""
    cls = registry.get("algorithm", name)
    return cls(build_dataclass(cls.Config, {**ALGORITHM_OPTIONS.get(name, {}), **options}, "algorithm"))
# losses that regress the log-ratio onto the advantage: with advantage 0 their gradient is 0 only on an exact replay
# (``2 beta^2 s grad s``, `s` the replayed log-ratio), so it must be negligible next to a unit advantage's instead
REGRESSION_LOSSES = {"reg_grpo"}


def _shapes_batch(n):
    from mmgrpo.data.shapes import ShapesPrompts
    from mmgrpo.prompt_stream import items_to_batch

    return items_to_batch(ShapesPrompts().train_items()[:n])


def _task_batch(n):
    """Prompts with every ground truth the text, box and mask rewards read (see each reward's docstring)."""
    truth = {"answer": "42", "boxes": [[8, 8, 40, 40]], "image_size": [64, 64], "input_size": [32, 32],
             "coords": "resized",  # the box frame a VLM pipeline declares for its model (box_iou's coords: model)
             "mask": torch.arange(256).view(16, 16) % 3 == 0, "span": [1.0, 3.0]}
    return PromptBatch(["a red circle"] * n, metadata=[dict(truth) for _ in range(n)])


def _seg_batch(n):
    """Referring-segmentation prompts: the image (in the metadata, so it survives the contract's metadata-only
    batches), its mask and its size."""
    image = torch.rand(3, 16, 16, generator=torch.Generator().manual_seed(0))
    truth = {"images": image, "mask": torch.arange(256).view(16, 16) % 3 == 0, "image_size": [16, 16]}
    return PromptBatch(["segment the cat"] * n, metadata=[dict(truth) for _ in range(n)])


def _key_steps_batch(n):
    """`_task_batch` with the key steps a reasoning path must contain (StepRAR's metadata)."""
    batch = _task_batch(n)
    for metadata in batch.metadata:
        metadata["key_steps"] = ["look", ["42", "forty-two"]]
    return batch


# rewards that need other per-prompt metadata than `_task_batch`
def _moving_shapes_batch(n):
    from mmgrpo.data.moving_shapes import MovingShapesPrompts
    from mmgrpo.prompt_stream import items_to_batch

    return items_to_batch(MovingShapesPrompts().train_items()[:n])


def _edit_batch(n):
    """Edit prompts: source and target images in the metadata (`edit_fidelity` reads them there)."""
    generator = torch.Generator().manual_seed(0)
    source = torch.rand(3, 16, 16, generator=generator)
    target = source.clone()
    target[:, 4:8, 4:8] = 1.0
    return PromptBatch(["make the square white"] * n, metadata=[{"source_image": source, "target_image": target}
                                                                for _ in range(n)])


def _quoted_batch(n):
    """Text-rendering prompts: the text to render in double quotes (the ocr reward's target)."""
    return PromptBatch([f'a sign that says "open {i}"' for i in range(n)], metadata=[{} for _ in range(n)])


def _geneval_batch(n):
    """GenEval prompts (its metadata format): counting, colour and position clauses."""
    kinds = [{"tag": "counting", "include": [{"class": "cat", "count": 2}], "exclude": [{"class": "cat", "count": 3}]},
             {"tag": "colors", "include": [{"class": "car", "count": 1, "color": "red"}]},
             {"tag": "position", "include": [{"class": "tv", "count": 1},
                                             {"class": "clock", "count": 1, "position": ["below", 0]}]}]
    return PromptBatch(["a photo"] * n, metadata=[kinds[i % 3] for i in range(n)])


REWARD_BATCHES = {"ocr": _quoted_batch, "geneval_detector": _geneval_batch,
                  "mini_geneval": _shapes_batch, "sam_mask": _seg_batch, "step_rar": _key_steps_batch,
                  "moving_shapes": _moving_shapes_batch, "edit_fidelity": _edit_batch}


BUILDERS = Path(__file__).resolve().parents[1] / "builders"


def _declared_conditions(policy, n: int) -> dict:
    """The prompt conditions a pipeline declares it reads: an input image per prompt for the ``input_images``
    capability (image editing), none otherwise."""
    if "input_images" not in policy.capabilities:
        return {}
    generator = torch.Generator().manual_seed(3)
    return {"images": [[torch.rand(3, 32, 32, generator=generator)] for _ in range(n)]}


def _build_policy(name: str, request):
    """The tiny policy of pipeline `name`, from its builder module `builders/<name>.py`."""
    return importlib.import_module(f"builders.{name}").build_policy(request)


def test_every_pipeline_has_a_tiny_builder():
    missing = [n for n in registry.available("pipeline") if not (BUILDERS / f"{n}.py").is_file()]
    assert not missing, f"add tests/builders/<name>.py with fixtures and a build_policy(request) for: {missing}"
    for name in registry.available("pipeline"):
        assert callable(importlib.import_module(f"builders.{name}").build_policy), name


@pytest.mark.parametrize("name", sorted(registry.available("pipeline")))
@pytest.mark.parametrize("algorithm_name", sorted(registry.available("algorithm")))
def test_pipeline_contract(name, algorithm_name, request):
    """Replay consistency, on-policy ratio 1 and zero advantage -> zero gradient, for every pipeline x algorithm."""
    policy = _build_policy(name, request)
    assert isinstance(policy, StochasticPolicy)
    algorithm = build_algorithm(algorithm_name)
    names = SimpleNamespace(algorithm=SimpleNamespace(name=algorithm_name), pipeline=SimpleNamespace(name=name))
    if algorithm.plan_family not in policy.plan_families:  # another family's plan: refused, naming the families
        with pytest.raises(ValueError, match=f"emits '{algorithm.plan_family}' plans.*plan family mismatch"):
            check_plan(policy, algorithm, names)
        return
    plan = algorithm.schedule(policy.num_steps, torch.Generator().manual_seed(0))
    missing = plan.features() - policy.plan_features
    if missing:  # an unsupported pair must be refused before any step, naming what is missing
        with pytest.raises(ValueError, match=f"algorithm '{algorithm_name}' needs .*{sorted(missing)[0]}"):
            check_plan(policy, algorithm, names)
        return
    unread = algorithm.traits.reads - policy.provides[SCORING_METHODS[algorithm.scoring]]
    if unread:  # the pipeline's score lacks a field the loss reads: refused, naming the field
        with pytest.raises(ValueError, match=f"reads the score field.*'{sorted(unread)[0]}'"):
            check_plan(policy, algorithm, names)
        return
    check_plan(policy, algorithm, names)  # the trainer accepts the pair
    batch = PromptBatch(["a red circle", "a blue square"], conditions=_declared_conditions(policy, 2)).repeat(2)
    rollout = policy.sample(batch, plan, generator=torch.Generator().manual_seed(1))
    assert rollout.old_log_probs.shape[0] == 4 and rollout.mask.shape == rollout.old_log_probs.shape
    assert torch.equal(rollout.group_ids, torch.tensor([0, 0, 1, 1]))
    for unit in plan.train_units:
        # what the trainer feeds the loss: the policy's score now, the old policy's (recorded, or the algorithm's own
        # old model), the reference's
        new, old, ref = score_unit(policy, algorithm, rollout, unit, torch.device("cpu"))
        # the declarations do not lie: the score has exactly the fields the pipeline declares, among them every field
        # the algorithm reads, and the loss reads no other (it is unchanged with every other field left out); a field
        # filled only for plans with a feature (FEATURE_SCORE_FIELDS) is there exactly when the plan has the feature
        method = SCORING_METHODS[algorithm.scoring]
        unasked = {f for feature, fs in FEATURE_SCORE_FIELDS.items() if feature not in plan.features() for f in fs}
        assert new.provided() == policy.provides[method] - unasked and (ref is None or ref.provided() == new.provided())
        assert algorithm.traits.reads <= new.provided()
        bare = {f: None for f in Score.field_names() - algorithm.traits.reads}
        only_read = algorithm.loss(dataclasses.replace(new, **bare), old, torch.zeros(4),
                                   ref and dataclasses.replace(ref, **bare))
        old_log_prob = old.log_prob if algorithm.traits.old_score else old  # the old model's whole Score, or its log-probs
        scored = torch.ones_like(old_log_prob, dtype=torch.bool) if new.mask is None else new.mask  # real transitions
        assert scored.any()
        torch.testing.assert_close(new.log_prob.detach()[scored], old_log_prob[scored], rtol=0, atol=1e-5)
        out = algorithm.loss(new, old, torch.zeros(4), ref)
        assert out.metrics == only_read.metrics and torch.equal(out.loss.detach(), only_read.loss.detach())
        assert out.metrics["ratio_mean"] == pytest.approx(1.0, abs=1e-5)
        out.loss.backward()
        if algorithm_name in REGRESSION_LOSSES:
            at_zero = sum(float(p.grad.abs().sum()) for p in policy.trainable_parameters() if p.grad is not None)
            for p in policy.trainable_parameters():
                p.grad = None
            new, old, ref = score_unit(policy, algorithm, rollout, unit, torch.device("cpu"))
            algorithm.loss(new, old, torch.tensor([1.0, -1.0, 1.0, -1.0]), ref).loss.backward()
            at_unit = sum(float(p.grad.abs().sum()) for p in policy.trainable_parameters() if p.grad is not None)
            assert at_zero <= 1e-3 * at_unit, (at_zero, at_unit)
            continue
        assert all(p.grad is None or torch.count_nonzero(p.grad) == 0 for p in policy.trainable_parameters())


@pytest.mark.parametrize("pipeline", ["qwen_vl", "mdlm"])
def test_a_pipeline_without_a_field_the_algorithm_reads_is_refused_before_loading(pipeline):
    """Flow-GRPO's KL term reads the SDE transitions' ``mean`` and ``std``, which a token policy's score has not: the
    score check refuses it from the pipeline's class (no model loaded), naming the field; without the KL it passes."""
    cls = registry.get("algorithm", "flow_grpo")
    names = SimpleNamespace(algorithm=SimpleNamespace(name="flow_grpo"), pipeline=SimpleNamespace(name=pipeline))
    policy_cls = registry.get("pipeline", pipeline)
    with pytest.raises(ValueError, match=r"reads the score field\(s\) \['mean', 'std'\], which pipeline .*kl_beta=0"):
        require_scores(policy_cls, build_algorithm("flow_grpo", kl_beta=0.04), names)
    require_scores(policy_cls, build_algorithm("flow_grpo", kl_beta=0.0), names)


@pytest.mark.parametrize(("pipeline", "algorithm", "speaks"), [
    ("sd3", "grpo", "['flow']"), ("flux", "dapo", "['flow']"), ("qwen_vl", "flow_grpo", "['token']"),
    ("qwen_vl", "cj_grpo", "['token']"), ("mdlm", "dgpo", "['masked', 'token']"),
])
def test_an_algorithm_of_another_plan_family_is_refused_before_loading(pipeline, algorithm, speaks, monkeypatch):
    """A pipeline reads only the plan families it declares: an algorithm emitting another family's plan (a token
    algorithm on a flow pipeline...) is refused from the pipeline's class, before any model loads and before the plan
    is even built, naming both families."""
    instance = build_algorithm(algorithm)
    monkeypatch.setattr(instance, "schedule", lambda *args: pytest.fail("the plan was built before the family check"))
    names = SimpleNamespace(algorithm=SimpleNamespace(name=algorithm), pipeline=SimpleNamespace(name=pipeline))
    with pytest.raises(ValueError, match=rf"algorithm '{algorithm}' emits '{instance.plan_family}' plans, but pipeline "
                                         rf"'{pipeline}' reads only \{speaks}\ plans \(plan family mismatch\)"):
        require_plan(registry.get("pipeline", pipeline), instance, 6, names)


def test_every_plan_family_has_a_pipeline_and_an_algorithm():
    """Each family's plans are emitted by some algorithm and read by some pipeline, and its deterministic plan (the
    evaluation's) is of that family, greedy / ODE, with nothing trained."""
    from mmgrpo.plans import PLAN_TYPES, deterministic_plan

    emitted = {registry.get("algorithm", n).plan_family for n in registry.available("algorithm")}
    spoken = {f for n in registry.available("pipeline") for f in registry.get("pipeline", n).plan_families}
    assert emitted == spoken == set(PLAN_TYPES) == {"flow", "token", "masked"}
    for family in PLAN_TYPES:
        plan = deterministic_plan(family, 3)
        assert plan.family == family and plan.train_units == [] and not plan.features()
    with pytest.raises(ValueError, match="Unknown plan family 'video'"):
        deterministic_plan("video", 3)


@pytest.mark.parametrize("name", sorted(registry.available("algorithm")))
def test_algorithm_contract(name):
    algorithm = build_algorithm(name)
    assert isinstance(algorithm, Algorithm) and algorithm.scoring in ("trajectory", "likelihood")
    scores = torch.tensor([1.0, 0.0, float("nan"), 2.0, 2.0, 0.5])
    groups = torch.tensor([0, 0, 0, 1, 1, 1])
    adv = algorithm.advantages(scores, groups)
    assert adv.shape == (6,) and torch.isfinite(adv).all() and adv[2] == 0  # NaN = not applicable
    assert adv[0] > 0 > adv[1]
    tied = algorithm.advantages(torch.full((8,), 2 / 3), torch.zeros(8, dtype=torch.long))  # mean != 2/3 in float32
    assert torch.count_nonzero(tied) == 0  # identical rewards: exactly no signal
    plan = algorithm.schedule(6, torch.Generator().manual_seed(0))
    assert plan.train_units and plan.scoring == algorithm.scoring
    assert type(plan).family == algorithm.plan_family  # the declared family is the plan's type
    if algorithm.plan_family == "flow" and algorithm.scoring == "trajectory":
        assert all(s in plan.sde_steps for unit in plan.train_units for s in unit)
    same = algorithm.schedule(6, torch.Generator().manual_seed(0))
    assert same == plan  # identical on every process that seeds the generator identically
    # optional members are declared: an algorithm has the hook and the state methods exactly when its traits say so
    traits = algorithm.traits
    assert callable(getattr(algorithm, "after_update", None)) == traits.after_update
    assert callable(getattr(algorithm, "after_step", None)) == traits.after_step
    assert callable(getattr(algorithm, "step_advantages", None)) == traits.step_advantages
    assert callable(getattr(algorithm, "select_samples", None)) == traits.selects_samples
    assert all(callable(getattr(algorithm, m, None)) == traits.has_state for m in ("state_dict", "load_state_dict"))
    if traits.has_state:
        algorithm.load_state_dict(algorithm.state_dict())
    if traits.old_source == "old_model":
        assert callable(algorithm.old_policy)
    # every algorithm holds its KL weight as the declared member `kl`, which the trainer steps and checkpoints
    assert isinstance(algorithm.kl, KLWeight) and algorithm.kl.options == algorithm.config.kl
    algorithm.kl.step()
    assert algorithm.kl.state_dict() == {"kl_updates": 1} and algorithm.kl() == algorithm.config.kl.kl_beta


@pytest.mark.parametrize("name", sorted(registry.available("algorithm")))
def test_every_algorithm_embeds_the_shared_records(name):
    """One home for the shared options: every Config embeds the advantage and KL records (and the clip record where
    it clips a ratio), whose keys a config file writes flat, and run folders' config.json keep them flat."""
    cls = registry.get("algorithm", name)
    kinds = {type(f.default_factory()) for f in dataclasses.fields(cls.Config) if is_embedded(f)}
    assert {AdvantageOptions, KLOptions} <= kinds, kinds
    flat = flat_hints(cls.Config)
    assert {"scale_rewards", "adv_std", "adv_eps", "adv_clip_max", "kl_beta", "kl_schedule"} <= set(flat)
    assert not {"global_std", "advantage", "kl", "clip"} & set(flat)  # one vocabulary, written flat
    config = build_dataclass(cls.Config, ALGORITHM_OPTIONS.get(name, {}), "algorithm")
    assert build_dataclass(cls.Config, flat_dict(config), "algorithm") == config  # a run folder's config reads back


def _advantage_variants(name: str) -> list[tuple[dict, bool]]:
    """The algorithm's tested options, and each option that normalises over the batch, with whether the advantages
    should be group-local."""
    import dataclasses

    options = dict(ALGORITHM_OPTIONS.get(name, {}))
    return [(options, True), ({**options, "scale_rewards": "batch"}, False)]  # every algorithm's one name for it


@pytest.mark.parametrize("name", sorted(registry.available("algorithm")))
def test_group_local_advantages_are_declared_truthfully(name):
    """``traits.group_local_advantages`` (what ``group_placement: contiguous`` relies on) is true exactly when each
    group's advantages computed alone equal those computed in the whole batch."""
    cls = registry.get("algorithm", name)
    scores = torch.tensor([1.0, 0.0, 0.5, 0.25, 4.0, -2.0, 3.0, 0.0])  # [8] two groups of 4, different spreads
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    for options, local in _advantage_variants(name):
        algorithm = cls(build_dataclass(cls.Config, options, "algorithm"))
        assert algorithm.traits.group_local_advantages == local, options
        joint = algorithm.advantages(scores, groups)  # [8]
        alone = torch.cat([algorithm.advantages(scores[groups == g], groups[groups == g]) for g in (0, 1)])  # [8]
        if local:
            torch.testing.assert_close(joint, alone)
        else:
            assert not torch.allclose(joint, alone), options  # the batch statistic changes them


@pytest.mark.parametrize("name", sorted(registry.available("reward")))
def test_reward_contract(name, request):
    cls = registry.get("reward", name)
    assert dataclasses.is_dataclass(cls.Config)
    options = REWARD_OPTIONS.get(name, {})
    config = cls.Config(**(options(request) if callable(options) else options))
    reward = cls(config)
    assert isinstance(reward, RewardFn) and reward.modalities
    # the instance holds its class's declarations for its options (read before any model loads)
    assert reward.modalities == cls.modalities_for(config) and reward.artifacts == cls.artifacts_for(config)
    outputs = {k: v for modality in sorted(reward.modalities) for k, v in SAMPLE_OUTPUTS[modality](5).items()}
    keys = sorted(outputs)
    batch = REWARD_BATCHES.get(name, _task_batch)(5)
    first, second = reward(outputs, batch), reward(outputs, batch)
    assert sorted(outputs) == keys  # a reward only reads the outputs: what it adds are its result's artifacts
    assert first.artifacts.keys() == reward.artifacts  # exactly the declared kinds, each N per-sample values
    assert all(len(values) == 5 for values in first.artifacts.values())
    assert first.scores.shape == (5,) and first.scores.dtype == torch.float32
    assert torch.isfinite(first.scores).all()
    torch.testing.assert_close(first.scores, second.scores, rtol=0, atol=0)  # deterministic
    for values in first.components.values():
        assert values.shape == (5,) and values.dtype == torch.float32
    # an item the reward does not apply to is NaN or a number, never an exception
    no_metadata = reward(outputs, PromptBatch(["?"] * 5))
    assert no_metadata.scores.shape == (5,) and no_metadata.scores.dtype == torch.float32
    # NaN pass-through: an item without metadata does not change the others' scores
    mixed = reward(outputs, PromptBatch(batch.prompts, metadata=[{}] + batch.metadata[1:]))
    torch.testing.assert_close(mixed.scores[1:], first.scores[1:], rtol=0, atol=0)
    if reward.group_stage is not None:  # the stage after the gather: whole groups in, one finite score per sample out
        groups = torch.tensor([0, 0, 1, 1, 2])
        staged = reward.group_stage(first, groups)
        assert staged.scores.shape == (5,) and staged.scores.dtype == torch.float32
        assert torch.isfinite(staged.scores).all()
        torch.testing.assert_close(reward.group_stage(second, groups).scores, staged.scores, rtol=0, atol=0)
        for values in staged.components.values():
            assert values.shape == (5,)


@pytest.mark.parametrize("name", sorted(registry.available("data")))
def test_registered_entries_import_and_define_config(name):
    cls = registry.get("data", name)
    assert dataclasses.is_dataclass(cls.Config)
