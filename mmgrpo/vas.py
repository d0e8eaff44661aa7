"""MMR1's Variance-Aware Sampling (VAS, https://arxiv.org/abs/2509.21268): the options (``train.vas``) and the
refresh of the prompt weights from dedicated extra rollouts, which the trainer calls at a step boundary.

Each refresh scores prompts of the training set with the current policy: ``rollouts`` samples per prompt, ``p`` the
mean of the reward's accuracy (``accuracy``: a component, or ``score`` for the reward itself) over them, and the
prompt's learnability ``p (1 - p)`` (MMR1's outcome variance score). [`~mmgrpo.prompt_stream.PromptStream`] turns the
scores into weights (min-max over the dataset, momentum) and draws ``int(B * prompt_sampling_mix)`` prompts of each
batch by weight, the rest from a sequential shuffled pool. The trainer refreshes before the first step and then after
every ``update_every`` steps. MMR1's diversity terms (distinct n-grams, self-BLEU, edit distance) are not offered.
"""

from __future__ import annotations

from dataclasses import dataclass

from .validation import ConfigError, check_fields, check_range, check_text

ROLLOUTS_LIMIT = 1024  # samples per prompt of a refresh
BATCH_LIMIT = 2**16  # prompts per sampling call, and prompts scored per refresh (2**40: the whole set)


@dataclass
class VASConfig:
    """Options of ``train.prompt_sampling: vas`` (MMR1's variance-aware sampling, see [`mmgrpo.vas`]).

    Args:
        update_every (`int`, defaults to 4): refresh the weights after every this many trainer steps (one rollout
            batch each, MMR1's global steps; MMR1's released config: 4), and once before the first step.
        rollouts (`int`, defaults to 8): samples per prompt at a refresh (MMR1's ``curriculum_rollout_n``).
        batch_prompts (`int`, defaults to 8): prompts per sampling call of a refresh, on each process (each call
            samples ``batch_prompts * rollouts`` outputs; MMR1's ``curriculum_rollout_batch_size``, over all GPUs).
        momentum (`float`, defaults to 0.0): ``w = momentum * w_old + (1 - momentum) * w_new`` at each refresh after
            the first (MMR1's released config: 0, the new weights replace the old).
        score_prompts (`int`, defaults to 0): prompts scored per refresh. 0 (MMR1): the whole training set, each
            refresh. Otherwise the next this many of a fixed shuffled order of the training prompts (cycling), to
            bound a refresh's cost on a large set; a prompt not scored yet takes the largest score seen so far.
        accuracy (`str`, defaults to `"score"`): what ``p`` averages over a prompt's samples: the reward component of
            that name (e.g. ``accuracy`` in a composite; MMR1 reads the reward's accuracy), or ``score``, the reward
            itself. Read per sample, before any group stage; a prompt none of whose samples has a finite value scores
            learnability 0.
    """

    update_every: int = 4
    rollouts: int = 8
    batch_prompts: int = 8
    momentum: float = 0.0
    score_prompts: int = 0
    accuracy: str = "score"

    def __post_init__(self):
        check_fields(self)
        check_range("train.vas.update_every", self.update_every, 1, 10**9, fix="MMR1 refreshes every 4 steps")
        check_range("train.vas.rollouts", self.rollouts, 2, ROLLOUTS_LIMIT, fix="MMR1 samples 8 per prompt")
        check_range("train.vas.batch_prompts", self.batch_prompts, 1, BATCH_LIMIT, fix="prompts per sampling call")
        check_range("train.vas.momentum", self.momentum, 0, 1, high_open=True, fix="0 replaces the weights")
        check_range("train.vas.score_prompts", self.score_prompts, 0, 2**40, fix="0 scores every training prompt")
        check_text("train.vas.accuracy", self.accuracy)


def check_sampling(train) -> None:
    """The checks of ``train.prompt_sampling_mix`` (`train`: a [`~mmgrpo.sections.TrainConfig`]): MMR1's mixture ratio
    in [0, 1] under ``vas``; under ``group_variance`` the share of draws by variance, in [0, 1) (the rest uniform)."""
    mix = train.prompt_sampling_mix
    if train.prompt_sampling == "vas":
        check_range("train.prompt_sampling_mix", mix, 0, 1, fix="int(B * mix) prompts of a batch are drawn by weight")
    else:
        check_range("train.prompt_sampling_mix", mix, 0, 1, high_open=True, fix="1 - mix is the share of uniform draws")


def refresh_weights(stream, policy, algorithm, reward, accelerator, seed: int, step: int) -> dict[str, float]:
    """Scores the prompts `stream` asks for ([`~mmgrpo.prompt_stream.PromptStream.items_to_score`]) with extra rollouts
    of `policy` under `algorithm`'s sampling plan, `reward`'s accuracy of each sample, and hands them to
    ``stream.refresh``. Every process samples its share in the same number of calls (the last share padded), and the
    accuracies are gathered. Returns the refresh's metrics (``vas/...``).

    Args:
        seed (`int`), step (`int`): the run's seed and the trainer step about to run (seeds the plan and the noise).
    """
    import torch

    from .seeding import mix_seed

    options = stream.vas
    indices = stream.items_to_score()
    world, rank = accelerator.num_processes, accelerator.process_index
    per_call = options.batch_prompts
    calls = -(-len(indices) // (per_call * world))
    padded = indices + indices[:1] * (calls * per_call * world - len(indices))
    plan = algorithm.schedule(policy.num_steps, torch.Generator().manual_seed(mix_seed(seed, step, 3)))
    generator = torch.Generator().manual_seed(mix_seed(seed, step, rank, 3))
    scores = []
    for call in range(calls):
        first = (call * world + rank) * per_call
        mine = padded[first : first + per_call]
        accuracy = sample_accuracy(policy, plan, reward, [stream.items[i] for i in mine], options, generator)
        scores.append(accelerator.gather(accuracy.to(accelerator.device)).cpu())  # [world * per_call, rollouts]
    # [calls * world * per_call, n]: call by call, rank by rank, so row r holds padded[r] (the padding rows last)
    gathered = torch.cat(scores) if scores else torch.zeros(0, options.rollouts)
    by_item = {index: gathered[row] for row, index in enumerate(indices)}  # [n] each
    return stream.refresh(by_item, step - 1)


def sample_accuracy(policy, plan, reward, items: list[dict], options: VASConfig, generator):
    """`options.rollouts` samples of each of `items` and the accuracy of each: `[len(items), rollouts]` (float32, NaN
    where not applicable). No sample is a teacher-forced ground-truth member (members are numbered from 1)."""
    import torch

    from .prompt_stream import items_to_batch

    batch = items_to_batch(items).repeat(options.rollouts)
    batch.member_ids = batch.member_ids + 1  # every sample is the policy's own (member 0 would be a ground truth)
    with torch.no_grad():
        rollout = policy.sample(batch, plan, generator=generator)
    result = reward(rollout.outputs, batch)
    if options.accuracy == "score":
        values = result.scores
    elif options.accuracy in result.components:
        values = result.components[options.accuracy]
    else:
        raise ConfigError(f"train.vas.accuracy: the reward has no component {options.accuracy!r}; use 'score' or one "
                          f"of {sorted(result.components)}.")
    return values.detach().float().cpu().reshape(len(items), options.rollouts)
