"""MixGRPO: the sliding window against the authors' scheduler (``GRPOTrainingStates``, transcribed below), exact
resume of the window through a checkpoint, SDE inside the window and ODE outside, on-policy ratio 1 and zero advantage
-> zero gradient through the real tiny SD3, the authors' k2 term, and its options' checks."""

import pytest
import torch

from algorithm_options import algo_config
from builders._runs import dgpo_config
from mmgrpo.algorithms.mix_grpo import MixGRPO, MixGRPOConfig
from mmgrpo.pipelines.sd3 import SD3Config, SD3Policy
from mmgrpo.types import PromptBatch, Score
from mmgrpo.validation import ConfigError


def mix(**options) -> MixGRPO:
    return MixGRPO(algo_config(MixGRPOConfig, **options))


class AuthorsWindow:
    """The authors' ``progressive`` scheduler (``fastvideo/utils/grpo_states.py``), as their training loop drives it:
    each iteration reads ``get_current_timesteps()`` and then calls ``update_iteration()``."""

    def __init__(self, iters_per_group, group_size, max_timesteps, prog_overlap, prog_overlap_step, roll_back):
        self.iters_per_group, self.group_size, self.max_timesteps = iters_per_group, group_size, max_timesteps
        self.prog_overlap, self.prog_overlap_step, self.roll_back = prog_overlap, prog_overlap_step, roll_back
        self.cur_timestep, self.cur_iter_in_group = 0, 0

    def update_iteration(self):
        self.cur_iter_in_group += 1
        if self.cur_iter_in_group >= self.iters_per_group:
            self.cur_iter_in_group = 0
            self.cur_timestep += self.prog_overlap_step if self.prog_overlap else self.group_size
        if self.cur_timestep > self.max_timesteps:
            if self.roll_back:
                self.cur_timestep, self.cur_iter_in_group = 0, 0
            else:
                self.cur_timestep = self.max_timesteps

    def get_current_timesteps(self):
        return list(range(self.cur_timestep, min(self.cur_timestep + self.group_size, self.max_timesteps)))


@pytest.mark.parametrize(("steps", "options", "iterations"), [
    (25, {}, 700),  # the authors' script: 25 steps, window 4, 25 iterations per position, overlap 1, roll back
    (10, {"window_size": 3, "iters_per_group": 2}, 60),
    (10, {"window_size": 3, "iters_per_group": 3, "prog_overlap": False}, 40),
    (8, {"window_size": 2, "iters_per_group": 2, "prog_overlap_step": 2, "roll_back": False}, 30),
])
def test_window_positions_follow_the_authors_scheduler(steps, options, iterations):
    algorithm = mix(**options)
    c = algorithm.config
    authors = AuthorsWindow(c.iters_per_group, c.window_size, steps - 2, c.prog_overlap, c.prog_overlap_step,
                            c.roll_back)
    seen = set()
    for _ in range(iterations):
        window = authors.get_current_timesteps()
        authors.update_iteration()
        plan = algorithm.schedule(steps, torch.Generator().manual_seed(0))
        assert plan.sde_steps == window and plan.train_units == [[s] for s in window]
        assert algorithm.schedule(steps, torch.Generator().manual_seed(1)).sde_steps == window  # schedule moves nothing
        algorithm.after_step()
        seen.add(tuple(window))
    assert len(seen) >= 3  # the window really moved (and, with roll_back, came back)


def test_random_strategy_draws_the_start_from_the_plan_generator():
    algorithm = mix(sample_strategy="random")
    starts = {algorithm.schedule(25, torch.Generator().manual_seed(s)).sde_steps[0] for s in range(40)}
    assert starts <= set(range(0, 23 - 4 + 1)) and len(starts) > 5
    plan = algorithm.schedule(25, torch.Generator().manual_seed(7))
    assert plan == algorithm.schedule(25, torch.Generator().manual_seed(7))  # the same on every process
    assert plan.sde_steps == list(range(plan.sde_steps[0], plan.sde_steps[0] + 4))


def test_state_round_trips_and_defaults_are_the_authors_script():
    algorithm = mix(iters_per_group=1)
    for _ in range(5):
        algorithm.after_step()
    again = mix(iters_per_group=1)
    again.load_state_dict(algorithm.state_dict())
    assert again.schedule(10, None).sde_steps == algorithm.schedule(10, None).sde_steps == [5, 6, 7]
    c = mix().config
    assert (c.window_size, c.iters_per_group, c.prog_overlap_step, c.roll_back, c.init_same_noise) == (4, 25, 1, True,
                                                                                                       True)
    assert (c.sde.sde_type, c.sde.noise_level, c.clip.clip_low, c.old_kl_coeff) == ("sde", 0.7, 1e-4, 0.0)
    assert mix().traits.has_state and mix().traits.after_step and not mix().traits.needs_reference


def test_config_checks():
    for bad in ({"window_size": 0}, {"iters_per_group": 0}, {"prog_overlap_step": -1}, {"old_kl_coeff": -1.0},
                {"dpm_post_compress_ratio": 0.0}, {"dpm_post_compress_ratio": 1.5}):
        with pytest.raises(ConfigError, match=next(iter(bad))):
            mix(**bad)
    with pytest.raises(ValueError, match="dpm_algorithm_type"):
        mix(dpm_algorithm_type="dpmsolver")  # only DPM-Solver++ (the authors' Flash scripts)
    with pytest.raises(ConfigError, match="needs sample_strategy: progressive"):
        mix(dpm_algorithm_type="dpmsolver++", sample_strategy="random")  # the authors assert it for "post"
    with pytest.raises(ValueError, match="dpm_solver_type"):
        mix(dpm_solver_type="euler")
    with pytest.raises(ValueError, match="sample_strategy"):
        mix(sample_strategy="decay")
    with pytest.raises(ValueError, match="group_size"):
        mix(group_size=4)  # the authors' name for the window is ours for the group: refused, not guessed
    with pytest.raises(ValueError, match="at least 3 steps"):
        mix().schedule(2, None)


def test_flash_plans_dpm_after_the_window_and_flash_star_keeps_the_window():
    """MixGRPO-Flash (ratio 0.4, 20 iterations per position) and Flash* (ratio 0.2, prog_overlap_step 0: the window
    stays at steps 0 .. 3), as the authors' two scripts; without dpm_algorithm_type the plan has no DPM part."""
    assert mix().schedule(25, None).dpm_post_ratio == 0 and "dpm_post" not in mix().schedule(25, None).features()
    flash = mix(dpm_algorithm_type="dpmsolver++", iters_per_group=20)
    plan = flash.schedule(25, None)
    assert (plan.dpm_post_ratio, plan.dpm_solver_type, plan.sde_steps) == (0.4, "midpoint", [0, 1, 2, 3])
    assert plan.features() == {"dpm_post", "init_same_noise"}
    star = mix(dpm_algorithm_type="dpmsolver++", dpm_post_compress_ratio=0.2, prog_overlap_step=0, iters_per_group=20)
    for _ in range(300):
        star.after_step()
    assert star.schedule(25, None).sde_steps == [0, 1, 2, 3] and star.schedule(25, None).dpm_post_ratio == 0.2


def test_old_kl_coeff_adds_the_authors_k2_term():
    old = torch.zeros(3, 1)
    new = torch.tensor([[1e-3], [-2e-3], [5e-4]])
    advantages = torch.tensor([1.0, -1.0, 0.5])
    plain = mix().loss(Score(log_prob=new), old, advantages)
    with_k2 = mix(old_kl_coeff=0.5).loss(Score(log_prob=new), old, advantages)
    k2 = 0.5 * float((new**2).mean())  # 0.5 * mean((new - old)^2)
    assert float(with_k2.loss) == pytest.approx(float(plain.loss) + 0.5 * k2, rel=1e-6)
    clamp = mix().loss(Score(log_prob=torch.zeros(2, 1)), torch.zeros(2, 1), torch.tensor([9.0, -9.0]))
    assert float(clamp.loss) == pytest.approx(0.0) and mix().loss(Score(log_prob=torch.zeros(1, 1)), torch.zeros(
        1, 1), torch.tensor([9.0])).loss.item() == pytest.approx(-5.0)  # advantages clamped to 5 in the loss


@pytest.mark.parametrize(("sde_type", "flash"), [("sde", None), ("dance", None), ("sde", "dpmsolver++")])
def test_window_is_sde_elsewhere_ode_ratio_one_and_zero_advantage_zero_gradient(tiny_sd3_dir, sde_type, flash):
    policy = SD3Policy(SD3Config(pretrained=tiny_sd3_dir, resolution=32, num_steps=5, guidance_scale=1.0, lora_rank=4,
                                 max_sequence_length=16))
    algorithm = mix(window_size=2, iters_per_group=1, sde_type=sde_type, noise_level=0.5, dpm_algorithm_type=flash)
    algorithm.after_step()  # the window moved to [1, 2]
    plan = algorithm.schedule(5, torch.Generator().manual_seed(0))
    assert plan.sde_steps == [1, 2]
    batch = PromptBatch(["a red circle", "a blue square"]).repeat(2)
    rollout = policy.sample(batch, plan, generator=torch.Generator().manual_seed(2))
    assert (rollout.old_log_probs[:, [0, 3, 4]] == 0).all() and (rollout.old_log_probs[:, [1, 2]] != 0).all()
    assert rollout.mask[:, [1, 2]].all() and not rollout.mask[:, [0, 3, 4]].any()
    start = rollout.trajectory["latents"][:, 0]
    assert torch.equal(start[0], start[1]) and not torch.equal(start[0], start[2])  # init_same_noise
    levels = rollout.trajectory["shared_sigmas"]  # Flash: 5 - 2 = 3 steps after the window, 2 levels: one DPM step
    assert (levels[4] == 0) == (flash is not None) and levels[3] > 0
    for unit in plan.train_units:
        new = policy.log_prob(rollout, unit)
        out = algorithm.loss(new, rollout.old_log_probs[:, unit], torch.zeros(4))
        assert out.metrics["ratio_mean"] == pytest.approx(1.0, abs=1e-6)
        out.loss.backward()
        assert all(p.grad is None or torch.count_nonzero(p.grad) == 0 for p in policy.trainable_parameters())


def test_a_resumed_run_keeps_the_window_and_evaluation_moves_nothing(tmp_path, tiny_sd3_dir):
    """The trainer counts one rollout iteration per step (``after_step``), updates taken or not; the count is in the
    checkpoint, so the resumed run continues the window where it was; an evaluation does not move it."""
    from mmgrpo import config as config_mod
    from mmgrpo.trainer import Trainer

    raw = dgpo_config(tmp_path, tiny_sd3_dir, max_steps=3)
    raw["algorithm"] = {"name": "mix_grpo", "window_size": 1, "iters_per_group": 1, "clip_low": 1e-3}
    raw["checkpoint"] = {"every": 3, "keep_last": 1}
    trainer = Trainer(config_mod.from_dict(raw))
    trainer.train()
    assert trainer.algorithm.iterations == 3
    assert trainer.algorithm.schedule(3, None).sde_steps == []  # start 1 = M: an empty window
    trainer.evaluate(3)
    assert trainer.algorithm.iterations == 3
    raw["train"]["max_steps"] = 4
    raw["checkpoint"]["resume_from"] = "latest"
    resumed = Trainer(config_mod.from_dict(raw))
    assert resumed.step == 3 and resumed.algorithm.iterations == 3
    resumed.train()
    assert resumed.algorithm.iterations == 4
