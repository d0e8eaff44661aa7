"""The wiring the flow-matching policies (`sd3`, `flux`, `wan`) share, written once:

- [`load_flow_pipeline`]: the diffusers pipeline loaded with every component frozen, and its trained transformer(s)
  (one, or Wan 2.2 A14B's two experts), kept by the policy as ``self.flow`` (a [`FlowPipeline`]);
- the members of the `StochasticPolicy` protocol that do not depend on the model, as functions of the policy, which
  each adapter's class takes into its body by name: [`SETUP`] (``num_steps``, ``eval_num_steps``,
  ``trainable_parameters``, ``trainable_modules``, ``prepare``, ``reference``), [`SAMPLING`] (``sample``,
  ``log_prob``, ``likelihood``: the plan interpreted by [`mmgrpo.samplers.flow_plan`]) and [`CHECKPOINTS`]
  (``save_pretrained``, ``load_trainable``, ``export_pretrained``). What they read of the policy is [`FlowModel`];
  the text-to-image adapters also share their [`IMAGE_IO`] (text embeddings of the prompts in, one row per sample;
  decoded images out).

An adapter keeps what is its model's own: the options and their checks, the noise levels, text encoding, the
velocity (guidance, timesteps, latent layout), the initial noise and the decoding of the final latents.

Not a plugin: it defines no ``PLUGIN`` and its name starts with an underscore, so the registry skips it.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from mmgrpo.hub import DTYPES, load_diffusers_pipeline
from mmgrpo.pipelines._checkpointing import checkpoint_diffusers
from mmgrpo.pipelines._flow_common import TrainableTransformer
from mmgrpo.plans import FlowPlan
from mmgrpo.samplers.flow_likelihood import plan_likelihood
from mmgrpo.samplers.flow_plan import replay_plan, run_plan
from mmgrpo.types import PromptBatch, Rollout, Score

EXPERTS = ("transformer", "transformer_2")  # a pipeline's trainable transformers, in the order of its noise levels


@dataclass
class FlowPipeline:
    """A loaded diffusers flow pipeline and its trained transformer(s), made by [`load_flow_pipeline`].

    Args:
        pipeline_cls (`type`): the diffusers pipeline class (e.g. ``StableDiffusion3Pipeline``).
        pipe: the pipeline, every component frozen and in eval mode.
        names (`tuple[str]`): the trained transformers' component names (``transformer``, maybe ``transformer_2``).
        experts (`list[TrainableTransformer]`): the trained transformers, in the order of `names`.
        offload (`bool`): keep a rollout's trajectory on the CPU between sampling and training.
    """

    pipeline_cls: type
    pipe: Any
    names: tuple[str, ...]
    experts: list[TrainableTransformer]
    offload: bool = False


def load_flow_pipeline(pipeline_cls: type, config, offload: bool = False) -> FlowPipeline:
    """Loads `pipeline_cls` from ``config.pretrained`` (components in ``config.weights_dtype``), freezes every
    component and makes each transformer it has a [`TrainableTransformer`] (LoRA of ``config.lora_rank``, or full
    fine-tuning; trainable parameters float32), with gradient checkpointing when ``config.gradient_checkpointing``."""
    pipe = load_diffusers_pipeline(pipeline_cls, config.pretrained, dtype=DTYPES[config.weights_dtype])
    pipe.set_progress_bar_config(disable=True)
    for module in pipe.components.values():
        if isinstance(module, torch.nn.Module):
            module.requires_grad_(False).eval()
    names = tuple(name for name in EXPERTS if getattr(pipe, name, None) is not None)
    experts = [
        TrainableTransformer(getattr(pipe, name), lora_rank=config.lora_rank, lora_alpha=config.lora_alpha,
                             lora_targets=config.lora_targets, base_model=config.pretrained)
        for name in names
    ]
    if config.gradient_checkpointing:
        for expert in experts:
            checkpoint_diffusers(expert.module)
    return FlowPipeline(pipeline_cls, pipe, names, experts, offload)


class FlowModel(Protocol):
    """What the shared members read of a flow adapter. `inputs` below is the dict [`~FlowModel._inputs`] returns
    (text embeddings, conditions; the trajectory keeps them under `input_names`)."""

    config: Any  # the adapter's options (``pretrained``, ``num_steps``, ``eval_num_steps``)
    flow: FlowPipeline
    device: torch.device  # where the model runs (set by ``prepare``)
    input_names: tuple[str, ...]  # the keys of `inputs`

    def sigmas(self, num_steps: int) -> torch.Tensor:
        """Noise levels `[num_steps + 1]`, ending at 0."""

    def _inputs(self, batch: PromptBatch) -> dict[str, torch.Tensor]:
        """The model inputs of a prompt batch (`inputs`: text embeddings, conditions)."""

    def _pick(self, inputs: dict, rows: torch.Tensor | None) -> dict[str, torch.Tensor]:
        """The inputs of the samples `rows` (None: all), on `device`, as `velocity` reads them."""

    def velocity(self, latents: torch.Tensor, sigma, picked: dict, guidance: bool = True) -> torch.Tensor:
        """Velocity `[r, ...]` in float32 for latents `[r, ...]` at noise level `sigma`; ``guidance=False`` is the
        conditional velocity the flow-matching likelihood scores."""

    def _noise(self, count: int, generator: torch.Generator | None) -> torch.Tensor:
        """Standard normal initial latents `[count, ...]`."""

    def _outputs(self, latents: torch.Tensor, inputs: dict) -> dict[str, torch.Tensor]:
        """The rollout's decoded outputs (``{"images": ...}``, ``{"videos": ...}``) of final latents `[N, ...]`."""


def _velocity(model: FlowModel, inputs: dict, guidance: bool = True):
    """``velocity(latents [r, ...], sigma, rows)`` over the samples `rows` (None: all) of `inputs`."""

    def velocity(x, sigma, rows=None):
        return model.velocity(x, sigma, model._pick(inputs, rows), guidance=guidance)

    return velocity


def _inputs(model: FlowModel, trajectory: dict) -> dict[str, torch.Tensor]:
    return {k: trajectory[k] for k in model.input_names if k in trajectory}


# --------------------------------------------------------------------------------------------------------- set-up
num_steps = property(lambda self: self.config.num_steps, doc="Denoising steps of a training rollout.")
eval_num_steps = property(lambda self: self.config.eval_num_steps or self.config.num_steps,
                          doc="Denoising steps of an evaluation sample (``eval_num_steps``, else ``num_steps``).")


def trainable_parameters(self: FlowModel) -> list[torch.nn.Parameter]:
    """The trainable parameters of every trained transformer (its LoRA, or all of it when fully fine-tuned)."""
    return [p for expert in self.flow.experts for p in expert.parameters()]


def trainable_modules(self: FlowModel) -> dict[str, torch.nn.Module]:
    """The unwrapped trained transformers by component name (``transformer``, maybe ``transformer_2``)."""
    return {name: expert.module for name, expert in zip(self.flow.names, self.flow.experts)}


def prepare(self: FlowModel, accelerator) -> list[torch.nn.Module]:
    """Moves every component to the accelerator's device and wraps the trained transformer(s) for distribution."""
    self.device = accelerator.device
    self.flow.pipe.to(self.device)
    return [wrapped for expert in self.flow.experts for wrapped in expert.prepare(accelerator)]


@contextlib.contextmanager
def reference(self: FlowModel):
    """The reference policy: LoRA adapters disabled, or the frozen initial transformer(s) when fully fine-tuned."""
    with contextlib.ExitStack() as stack:
        for expert in self.flow.experts:
            stack.enter_context(expert.reference())
        yield


# ------------------------------------------------------------------------------------------------------- sampling
@torch.no_grad()
def sample(self: FlowModel, batch: PromptBatch, plan: FlowPlan, *, generator: torch.Generator | None = None) -> Rollout:
    """Samples one output per prompt following `plan` (SDE on `plan.sde_steps`, ODE elsewhere; merged steps,
    branches from a shared anchor, the DPM solver: see [`mmgrpo.samplers.flow_plan.run_plan`]).

    The trajectory keeps every latent (``latents`` `[N, S + 1, ...]`), the model inputs and the parameters of each
    step, so `log_prob` can re-score exactly the transitions taken; with ``offload`` its tensors stay on the CPU.
    """
    inputs = self._inputs(batch)
    group_ids = batch.group_ids if batch.group_ids is not None else torch.arange(len(batch))
    trajectory, log_probs, mask, group_ids = run_plan(
        _velocity(self, inputs), self._noise, self.sigmas(plan.num_steps), plan, group_ids, batch.member_ids, generator
    )
    outputs = self._outputs(trajectory["latents"][:, -1], inputs)
    trajectory = {**trajectory, **inputs}
    if self.flow.offload:
        trajectory = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in trajectory.items()}
    return Rollout(group_ids=group_ids, outputs=outputs, old_log_probs=log_probs, mask=mask, trajectory=trajectory)


def log_prob(self: FlowModel, rollout: Rollout, steps: list[int]) -> Score:
    """Replays transitions `steps` under the current parameters (with gradients), for the samples that train them
    (`rollout.mask`).

    Returns:
        [`Score`] with `log_prob` `[n, k]`, `mean` `[n, k, ...]` (the latents' shape), ``std`` `[n, k, 1, ...]` and
        ``mask`` `[n, k]` (which entries are replayed transitions); see [`mmgrpo.samplers.flow_plan.replay_plan`].
    """
    velocity = _velocity(self, _inputs(self, rollout.trajectory))
    return replay_plan(velocity, rollout.trajectory, rollout.group_ids, rollout.mask, steps, self.device)


def likelihood(self: FlowModel, rollout: Rollout, steps: list[int]) -> Score:
    """Minus the flow-matching loss of the final latents at noise levels ``sigmas[j]``, `j` in `steps`, with noise
    shared within a group; the conditional velocity (no CFG), with gradients.

    Returns:
        [`Score`] with `log_prob` `[n, k]`, `velocity` `[n, k, ...]` and ``group_ids`` `[n]`; see
        [`mmgrpo.samplers.flow_likelihood.plan_likelihood`].
    """
    velocity = _velocity(self, _inputs(self, rollout.trajectory), guidance=False)
    return plan_likelihood(velocity, self._noise, rollout.trajectory, rollout.group_ids, steps, self.device)


# ---------------------------------------------------------------------------------------------------- checkpoints
def save_pretrained(self: FlowModel, path: str) -> None:
    """Writes the trainable weights: a diffusers LoRA file (``pipe.load_lora_weights(path)`` reads it; a second
    expert's in ``transformer_2/``, read with ``load_into_transformer_2=True``) or, when fully fine-tuned,
    ``transformer/`` (and ``transformer_2/``) folders that replace the base pipeline's."""
    for name, expert in zip(self.flow.names, self.flow.experts):
        expert.save(path, self.flow.pipeline_cls, name=name)


def load_trainable(self: FlowModel, path: str) -> None:
    """Loads weights written by ``save_pretrained`` into the trained transformer(s)."""
    for name, expert in zip(self.flow.names, self.flow.experts):
        expert.load(path, name=name)


def export_pretrained(self: FlowModel, path: str, merge_lora: bool = False) -> None:
    """Writes the whole diffusers pipeline with the trained weights (LoRA fused into each transformer, or in
    ``lora/``), loadable with the pipeline class's ``from_pretrained`` (see [`mmgrpo.export.export_diffusers`])."""
    from mmgrpo.export import export_diffusers

    lora = self.flow.experts[0].lora
    export_diffusers(self, self.flow.pipeline_cls, self.config.pretrained, path, merge_lora, lora)


# ---------------------------------------------------------------------------------------------- text-to-image
def _prompt_inputs(self: FlowModel, batch: PromptBatch) -> dict[str, torch.Tensor]:
    """The text embeddings of the batch's prompts, one row per sample (the adapter's ``encode(prompts)``)."""
    return self.encode(batch.prompts)


def _pick_rows(self: FlowModel, inputs: dict[str, torch.Tensor], rows: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """Every entry of `inputs` (one row per sample) restricted to samples `rows` (None: all), on the device."""
    picked = inputs if rows is None else {k: v[rows.to(v.device)] for k, v in inputs.items()}
    return {k: v.to(self.device) for k, v in picked.items()}


def _images(self: FlowModel, latents: torch.Tensor, inputs: dict) -> dict[str, torch.Tensor]:
    """``{"images": [N, 3, H, W] in [0, 1]}`` on the CPU, the adapter's ``decode`` of final latents `[N, ...]`."""
    return {"images": self.decode(latents).cpu()}


# ------------------------------------------------------------- prompts encoded once (`hunyuan_video15`, `ltx2`)
@torch.no_grad()
def encode_distinct_prompts(self, batch: PromptBatch) -> dict[str, torch.Tensor]:
    """Text inputs computed once per distinct prompt by the adapter's ``_encode_text(texts) -> {key: [U, ...]}``:
    ``shared_<key>`` `[U, ...]`, ``prompt_index`` `[N]` into them, and, when the adapter's ``do_cfg``,
    ``shared_negative_<key>`` `[1, ...]` of ``config.negative_prompt``."""
    position: dict[str, int] = {}
    index = torch.tensor([position.setdefault(p, len(position)) for p in batch.prompts], dtype=torch.long)
    out = {"prompt_index": index, **{f"shared_{k}": v for k, v in self._encode_text(list(position)).items()}}
    if self.do_cfg:
        negative = self._encode_text([self.config.negative_prompt])
        out.update({f"shared_negative_{k}": v for k, v in negative.items()})
    return out


def pick_distinct_prompts(self, inputs: dict[str, torch.Tensor], rows: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """The text inputs of samples `rows` (None: all) from [`encode_distinct_prompts`]'s: ``<key>`` `[r, ...]`, and
    ``negative_<key>`` (the one negative prompt expanded to `r` rows) with CFG, on the device."""
    index = inputs["prompt_index"] if rows is None else inputs["prompt_index"][rows.cpu()]
    out = {}
    for name, value in inputs.items():
        if name.startswith("shared_negative_"):
            negative = value.to(self.device)
            out["negative_" + name.removeprefix("shared_negative_")] = negative.expand(len(index), *negative.shape[1:])
        elif name.startswith("shared_"):
            out[name.removeprefix("shared_")] = value.to(self.device)[index.to(self.device)]
    return out


SETUP = (num_steps, eval_num_steps, trainable_parameters, trainable_modules, prepare, reference)
SAMPLING = (sample, log_prob, likelihood)
CHECKPOINTS = (save_pretrained, load_trainable, export_pretrained)
# the model-facing members of the text-to-image adapters (`sd3`, `flux`): per-sample text embeddings in, images out
IMAGE_IO = (_prompt_inputs, _pick_rows, _images)
# the text inputs of the adapters that encode each distinct prompt once (`hunyuan_video15`, `ltx2`)
DISTINCT_PROMPTS = (encode_distinct_prompts, pick_distinct_prompts)
