"""Ceilings of the algorithms' options: far above what the papers use, far below what poisons a run. Each algorithm's
``Config.__post_init__`` passes them to [`~mmgrpo.validation.check_range`] as `high`.

Not a plugin: its name starts with an underscore, so the registry skips it.
"""

KL_BETA_LIMIT = 100.0  # a KL weight (papers: 0 to ~0.1)
CLIP_LIMIT = 10.0  # a ratio clip range (papers: 1e-4 to ~0.3; above 1 the lower bound is already below 0)
ADV_CLIP_LIMIT = 1e6  # an advantage clamp (5 is usual; 1e6 clamps nothing)
ADV_EPS_LIMIT = 1e3  # the eps added to a group's reward std (1e-4 is usual)
NOISE_LEVEL_RANGE = (1e-3, 10.0)  # an SDE's noise level (papers: 0.3 to 1.2; below it log-probs blow up)
STEP_LIMIT = 1000  # a denoising-step index or count (flow models are trained on 1000 noise levels)
DRAWS_LIMIT = 1024  # likelihood draws per rollout (each costs forwards; 1 is usual)
UPDATES_LIMIT = 10**9  # optimizer updates of a schedule
SCALE_LIMIT = 1e4  # a temperature, weight or sharpness of a loss term (papers: ~0.1 to 100)
SHIFT_LIMIT = 100.0  # a flow-matching sigma shift (real models: 1 to ~17)
GROUP_LIMIT = 1024  # samples of a group selected for training (train.group_size is at most 1024)
