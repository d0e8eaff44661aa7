"""Other toolkits' names for our options: an unknown config key that TRL, Flow-GRPO or DanceGRPO spell differently
gets a hint naming our key and any difference of convention ([`hint`]), wherever it was written (at the top level, in
``train``, in a plugin's section).

Sources: TRL's ``GRPOConfig`` (and the ``TrainingArguments`` it extends), Flow-GRPO's ``config/*.py`` (``sample.*``,
``train.*``), DanceGRPO's training scripts' arguments. Keys that we spell the same way (``scale_rewards``,
``adv_clip_max``, ``timestep_fraction``...) are listed too, for when they are written in the wrong section.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PeerName:
    """One peer key.

    Args:
        toolkits (`str`): whose key it is (``"TRL"``, ``"Flow-GRPO"``...).
        ours (`tuple[str, ...]`): our key(s), ``section.key`` (a test checks that each exists).
        note (`str`): the difference of convention, or what to write instead (a whole sentence; empty: same meaning).
    """

    toolkits: str
    ours: tuple[str, ...]
    note: str = ""


PEER_NAMES: dict[str, PeerName] = {
    "beta": PeerName("TRL's and Flow-GRPO's (train.beta)", ("algorithm.kl_beta",),
                     "The same weight of the KL term; TRL defaults to 0.0, our algorithms to their authors' values "
                     "(grpo: 0.04), and Flow-GRPO's KL on the transition means is algorithm.kl_convention: "
                     "flow_grpo."),
    "num_generations": PeerName("TRL's and DanceGRPO's", ("train.group_size",), "The same: samples per prompt."),
    "num_image_per_prompt": PeerName("Flow-GRPO's (sample.num_image_per_prompt)", ("train.group_size",)),
    "epsilon": PeerName("TRL's", ("algorithm.clip_low",),
                        "The same lower clip: the ratio is clipped at 1 - clip_low (and at 1 + clip_high, which "
                        "defaults to clip_low as TRL's epsilon_high defaults to epsilon)."),
    "epsilon_high": PeerName("TRL's", ("algorithm.clip_high",),
                             "The same upper clip, 1 + clip_high (TRL's cispo loss reads it as a maximum instead: "
                             "we have no cispo)."),
    "clip_range": PeerName("Flow-GRPO's and DanceGRPO's", ("algorithm.clip_low",),
                           "The same symmetric clip of the ratio to [1 - clip_range, 1 + clip_range]; clip_high "
                           "defaults to clip_low."),
    "loss_type": PeerName("TRL's", ("algorithm.name",),
                          "The algorithm is the loss: loss_type 'grpo' is algorithm.name: grpo, 'dr_grpo' is dr_grpo, "
                          "'dapo' (TRL's default) is dapo and 'sapo' is sapo; 'bnpo', 'cispo', 'luspo' and 'vespo' "
                          "have no equivalent here."),
    "importance_sampling_level": PeerName("TRL's", ("algorithm.name",),
                                          "'sequence' (GSPO) is algorithm.name: gspo; 'token' is every other token "
                                          "algorithm."),
    "scale_rewards": PeerName("TRL's (and ours)", ("algorithm.scale_rewards",),
                              "It is an algorithm option, spelled as TRL's strings: 'group' (TRL's true), 'batch' or "
                              "'none' (TRL's false)."),
    "global_std": PeerName("Flow-GRPO's and DGPO's", ("algorithm.scale_rewards",),
                           "global_std: true is scale_rewards: batch, false is group."),
    "num_iterations": PeerName("TRL's (mu)", ("train.inner_epochs",), "The same: passes over each rollout batch."),
    "num_inner_epochs": PeerName("Flow-GRPO's (train.num_inner_epochs)", ("train.inner_epochs",)),
    "per_device_train_batch_size": PeerName(
        "TRL's", ("train.minibatch_size", "train.prompts_per_step"),
        "Samples per backward pass on each process is train.minibatch_size; the samples a step generates over all "
        "processes are train.prompts_per_step x train.group_size."),
    "gradient_accumulation_steps": PeerName(
        "TRL's, Flow-GRPO's and DanceGRPO's", ("train.updates_per_step", "train.minibatch_size"),
        "There is no such key: an update accumulates the gradients of all its minibatches, and a rollout batch gives "
        "train.updates_per_step updates."),
    "max_completion_length": PeerName("TRL's", ("pipeline.max_new_tokens", "pipeline.gen_length"),
                                      "max_new_tokens for qwen_vl, gen_length for mdlm."),
    "temperature": PeerName("TRL's", ("pipeline.temperature",), "A pipeline option (qwen_vl)."),
    "reward_weights": PeerName("TRL's", ("reward.rewards",),
                               "With reward.name: composite, each reward's weight goes in its entry: "
                               "rewards: {format: {weight: 0.5}, accuracy: {}}."),
    "multi_objective_aggregation": PeerName("TRL's", ("reward.normalize",),
                                            "composite's normalize: 'sum_then_normalize' or 'normalize_then_sum', "
                                            "as TRL's."),
    "learning_rate": PeerName("TRL's, Flow-GRPO's and DanceGRPO's", ("train.learning_rate",)),
    "max_grad_norm": PeerName("TRL's, Flow-GRPO's and DanceGRPO's", ("train.max_grad_norm",)),
    "max_steps": PeerName("TRL's and DanceGRPO's", ("train.max_steps",)),
    "warmup_steps": PeerName("TRL's", ("train.warmup_steps",)),
    "weight_decay": PeerName("TRL's", ("train.weight_decay",)),
    "noise_level": PeerName("Flow-GRPO's (sample.noise_level)", ("algorithm.noise_level",),
                            "The same SDE noise scale, an algorithm option."),
    "eta": PeerName("DanceGRPO's", ("algorithm.noise_level",),
                    "The same SDE noise scale, with algorithm.sde_type: dance (dance_grpo's default)."),
    "timestep_fraction": PeerName("Flow-GRPO's and DanceGRPO's", ("algorithm.timestep_fraction",),
                                  "An algorithm option: flow_grpo trains the first int(num_steps x fraction) steps as "
                                  "Flow-GRPO does, dance_grpo a random int(fraction x (num_steps - 1)) per sample as "
                                  "DanceGRPO does."),
    "adv_clip_max": PeerName("Flow-GRPO's and DanceGRPO's", ("algorithm.adv_clip_max",), "An algorithm option."),
    "sde_window_size": PeerName("Flow-GRPO's", ("algorithm.sde_window_size",), "A flow_grpo option."),
    "num_steps": PeerName("Flow-GRPO's (sample.num_steps)", ("pipeline.num_steps",)),
    "sampling_steps": PeerName("DanceGRPO's", ("pipeline.num_steps",)),
    "eval_num_steps": PeerName("Flow-GRPO's (sample.eval_num_steps)", ("pipeline.eval_num_steps",)),
    "guidance_scale": PeerName("Flow-GRPO's (sample.guidance_scale)", ("pipeline.guidance_scale",)),
    "resolution": PeerName("Flow-GRPO's", ("pipeline.resolution",)),
    "shift": PeerName("DanceGRPO's", ("pipeline.flow_shift",), "A pipeline option where the pipeline has it (wan)."),
    "init_same_noise": PeerName("DanceGRPO's", ("algorithm.init_same_noise",),
                                "A dance_grpo option: a group's members start from one noise, drawn per group from "
                                "the run's seed."),
    "same_latent": PeerName("Flow-GRPO's (sample.same_latent)", ("algorithm.init_same_noise",),
                            "dance_grpo's option: one initial noise per group, drawn from the run's seed (Flow-GRPO "
                            "seeds it from a hash of the prompt)."),
}


def hint(key: str) -> str:
    """A sentence naming our key for peer key `key` and the difference of convention, or ``""`` (not a peer key)."""
    peer = PEER_NAMES.get(key)
    if peer is None:
        return ""
    ours = " or ".join(peer.ours)
    return f" {key} is {peer.toolkits} name: use {ours}." + (f" {peer.note}" if peer.note else "")
