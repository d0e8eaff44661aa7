"""What the Qwen-VL adapter tests (`test_qwen_vl_policy.py`, `test_qwen3_vl.py`) build alike: the LoRA test policy of
a tiny model fixture, solid-colour images, the prompt batch with images, several images and video, and the log-probs
and gradients of a replay with or without the prefix-shared group forward."""

import torch
from PIL import Image

from mmgrpo.pipelines.qwen_vl import QwenVLConfig, QwenVLPolicy
from mmgrpo.types import PromptBatch


def vl_policy(request, fixture: str, max_new_tokens: int, **options) -> QwenVLPolicy:
    """The Qwen-VL policy of the tiny model of `fixture` (LoRA rank 4, alpha 8 unless `options` say otherwise)."""
    options = {"max_new_tokens": max_new_tokens, "lora_rank": 4, "lora_alpha": 8, **options}
    return QwenVLPolicy(QwenVLConfig(pretrained=request.getfixturevalue(fixture), **options))


def image(w: int, h: int, colour) -> Image.Image:
    """A `w` x `h` RGB image of one colour."""
    return Image.new("RGB", (w, h), colour)


def vision_batch(group_size: int = 2, image_and_video: bool = False) -> PromptBatch:
    """Three prompts: one image, two images, one 4-frame video; with `image_and_video` a fourth, an image and the
    video. Each prompt repeated `group_size` times (a group shares its prompt)."""
    frames = [image(64, 64, (0, 40 * i, 200)) for i in range(4)]
    prompts = ["how many circles?", "which is red?", "what moves?"]
    images = [image(100, 80, (255, 0, 0)), [image(60, 70, (0, 255, 0)), image(64, 64, (9, 9, 9))], None]
    videos = [None, None, frames]
    if image_and_video:
        prompts, videos = prompts + ["is it in the video?"], videos + [frames]
        images = images + [image(70, 70, (1, 2, 3))]
    return PromptBatch(prompts, metadata=[{"image_size": [100, 80]}] + [{}] * (len(prompts) - 1),
                       conditions={"images": images, "video": videos}).repeat(group_size)


def scored_grads(policy, rollout, steps: list[int], shared: bool):
    """The replayed log-probs `[n, k]` of `steps`, with the prefix-shared group forward or not, and the gradients (by
    parameter name) of a fixed weighted sum of them."""
    policy.config.prefix_sharing = shared
    policy.model.zero_grad(set_to_none=True)
    out = policy.log_prob(rollout, steps)
    weights = torch.linspace(-1, 1, out.log_prob.numel()).view_as(out.log_prob)  # [n, k]
    (out.log_prob * weights).sum().backward()
    grads = {n: p.grad.clone() for n, p in policy.model.named_parameters() if p.grad is not None}
    return out.log_prob.detach(), grads
