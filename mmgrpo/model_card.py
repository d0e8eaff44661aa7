"""The model card (``README.md``) of an exported model, written with ``huggingface_hub``'s ``ModelCard`` and
``ModelCardData``: front matter the hub reads (library, ``base_model`` as a hub id where the base came from one,
``pipeline_tag``, tags), what was trained, how and how well (figures rounded), a runnable loading-and-generation
example, and the full training config."""

from __future__ import annotations

import json
from pathlib import Path

from .config_yaml import dump_yaml
from .hub import is_hub_id
from .metrics_log import json_safe

PLACEHOLDER = "<this folder>"  # where the example loads from when no folder is named
SIGNIFICANT = 4  # significant digits of the figures in the card


def loading_call(folder: Path) -> tuple[str, str]:
    """``(class, extra arguments)`` that load an exported folder: the diffusers pipeline's ``_class_name`` with its
    absent components named as None (an SD3 pipeline saved without T5 needs them), or the transformers model's first
    architecture."""
    index = folder / "model_index.json"
    if index.is_file():
        import diffusers

        entries = json.loads(index.read_text(encoding="utf-8"))
        cls = entries.get("_class_name", "DiffusionPipeline")
        optional = set(getattr(getattr(diffusers, cls, None), "_optional_components", []))
        absent = [key for key, value in entries.items()
                  if isinstance(value, list) and value[0] is None and key not in optional]
        return cls, "".join(f", {key}=None" for key in absent)
    if (folder / "config.json").is_file():
        architectures = json.loads((folder / "config.json").read_text(encoding="utf-8")).get("architectures") or []
        return (architectures[0] if architectures else "AutoModel"), ""
    return "AutoModel", ""


def _diffusers_lora_call(cls: str) -> str:
    """The line that loads an unmerged ``lora/`` into a pipeline of class `cls`: ``pipe.load_lora_weights``, or the
    transformer's own ``load_lora_adapter`` for a pipeline diffusers has no LoRA loader for (HunyuanVideo 1.5)."""
    import diffusers
    from diffusers.loaders.lora_base import LoraBaseMixin

    pipeline_cls = getattr(diffusers, cls, None)  # a library lookup by name, as `loading_call`
    if isinstance(pipeline_cls, type) and issubclass(pipeline_cls, diffusers.DiffusionPipeline) \
            and not issubclass(pipeline_cls, LoraBaseMixin):
        return "pipe.transformer.load_lora_adapter(f\"{folder}/lora\", prefix=None, use_safetensors=True)\n"
    return "pipe.load_lora_weights(f\"{folder}/lora\")\n"


def pipeline_tag(cls: str, library: str) -> str:
    """The hub's task tag of a loading class: a diffusers pipeline that edits an input image, makes videos or images;
    a transformers model that reads images (``...ForConditionalGeneration``) or text only."""
    if library == "diffusers":
        if any(word in cls for word in ("Edit", "Kontext", "Img2Img")):
            return "image-to-image"
        return "text-to-video" if any(word in cls for word in ("Video", "Wan", "LTX")) else "text-to-image"
    return "image-text-to-text" if "ConditionalGeneration" in cls or "ImageTextToText" in cls else "text-generation"


def _call_arguments(cls: str) -> set[str]:
    """The keyword arguments the diffusers pipeline class `cls` takes when called (all sampling options when it is
    not a diffusers class)."""
    import inspect

    import diffusers

    pipeline_cls = getattr(diffusers, cls, None)  # a library lookup by name, as `loading_call`
    if not isinstance(pipeline_cls, type):
        return {"num_inference_steps", "guidance_scale", "height", "width", "num_frames", "max_sequence_length"}
    return set(inspect.signature(pipeline_cls.__call__).parameters)


def _diffusers_example(cls: str, extra: str, options: dict, lora: bool, prompt: str, tag: str) -> list[str]:
    """Lines that load the exported pipeline and generate one sample with the run's sampling options."""
    size = options.get("resolution")
    call = [f"{json.dumps(prompt)}"]
    if tag == "image-to-image":
        call.append("image=Image.new(\"RGB\", (512, 512), \"white\")")  # replace with your input image
    accepted = _call_arguments(cls)
    for ours, theirs in (("num_steps", "num_inference_steps"), ("guidance_scale", "guidance_scale"),
                         ("height", "height"), ("width", "width"), ("num_frames", "num_frames"),
                         ("max_sequence_length", "max_sequence_length")):
        if options.get(ours) is not None and theirs in accepted:
            call.append(f"{theirs}={options[ours]!r}")
    if size is not None and "height" not in options:
        call += [f"height={size!r}", f"width={size!r}"]
    lines = ["import torch", f"from diffusers import {cls}"]
    lines += ["from PIL import Image"] if tag == "image-to-image" else []
    lines += ["from diffusers.utils import export_to_video"] if tag == "text-to-video" else []
    lines += ["", "folder = FOLDER", f"pipe = {cls}.from_pretrained(folder{extra})"]
    lines += [_diffusers_lora_call(cls).rstrip()] if lora else []
    out = "frames[0]" if tag == "text-to-video" else "images[0]"
    lines += [f"sample = pipe({', '.join(call)}, generator=torch.Generator().manual_seed(0)).{out}"]
    lines += ["export_to_video(sample, \"sample.mp4\")" if tag == "text-to-video" else "sample.save(\"sample.png\")"]
    return lines


def _transformers_example(cls: str, options: dict, lora: bool, prompt: str, tag: str) -> list[str]:
    """Lines that load the exported model (with peft's ``AutoPeftModel`` on ``lora/`` for an unmerged LoRA) and
    generate one answer."""
    tokens = options.get("max_new_tokens") or options.get("gen_length") or 64
    load = ["from peft import AutoPeftModel", ""] if lora else [f"from transformers import {cls}", ""]
    model = "AutoPeftModel.from_pretrained(f\"{folder}/lora\")" if lora else f"{cls}.from_pretrained(folder)"
    if tag != "image-text-to-text":  # a masked diffusion LM: one forward pass (it samples by unmasking, not generate)
        return ["import torch", "from transformers import AutoTokenizer", *load, "folder = FOLDER",
                f"model = {model}.eval()", "tokenizer = AutoTokenizer.from_pretrained(folder)",
                f"ids = tokenizer({json.dumps(prompt)}, return_tensors=\"pt\").input_ids",
                "with torch.no_grad():", "    logits = model(input_ids=ids).logits  # [1, length, vocabulary]"]
    return [
        "from PIL import Image", "from transformers import AutoProcessor", *load, "folder = FOLDER",
        f"model = {model}.eval()", "processor = AutoProcessor.from_pretrained(folder)",
        "image = Image.new(\"RGB\", (224, 224), \"white\")  # replace with your image",
        "messages = [{\"role\": \"user\", \"content\": [{\"type\": \"image\"}, {\"type\": \"text\", \"text\": "
        f"{json.dumps(prompt)}}}]}}]",
        "text = processor.apply_chat_template(messages, add_generation_prompt=True)",
        "inputs = processor(text=[text], images=[image], return_tensors=\"pt\")",
        f"answer = model.generate(**inputs, max_new_tokens={int(tokens)}, do_sample=False)",
        "print(processor.batch_decode(answer[:, inputs[\"input_ids\"].shape[1]:], skip_special_tokens=True)[0])",
    ]


def _figure(value) -> str:
    """A metric value rounded to `SIGNIFICANT` significant digits (integers and text as they are)."""
    return f"{value:.{SIGNIFICANT}g}" if isinstance(value, float) else str(value)


def model_card(config: dict, step: int, evaluation: dict, lora: bool, merged: bool,
               loading: tuple[str, str] = ("", ""), folder: str | None = None, prompt: str | None = None) -> str:
    """A Hugging Face model card (``ModelCard`` text): front matter (``ModelCardData``), what was trained, how and
    how well, a runnable example that loads the model from `folder` (see [`loading_call`] for `loading`) and
    generates from `prompt`, and the full config."""
    from huggingface_hub import ModelCard, ModelCardData

    pipeline, algorithm = config["pipeline"], config["algorithm"]
    cls, extra = loading
    library = "diffusers" if cls.endswith("Pipeline") else "transformers"  # a diffusers folder loads with a *Pipeline
    cls = cls or ("DiffusionPipeline" if library == "diffusers" else "AutoModel")
    tag = pipeline_tag(cls, library)
    base = pipeline.get("pretrained", "")
    data = ModelCardData(library_name=library, pipeline_tag=tag, base_model=base if is_hub_id(base) else None,
                         tags=["mmgrpo", "reinforcement-learning", algorithm["name"]])
    how = ("LoRA merged into the weights" if lora and merged else "LoRA adapter in `lora/`" if lora
           else "full fine-tuning")
    figures = "\n".join(f"| `{k}` | {_figure(v)} |" for k, v in evaluation.items() if k != "step") \
        or "| (no evaluation) | |"
    prompt = prompt or "a photo"
    unmerged = lora and not merged
    example = _diffusers_example(cls, extra, pipeline, unmerged, prompt, tag) if library == "diffusers" \
        else _transformers_example(cls, pipeline, unmerged, prompt, tag)
    code = "\n".join(f"folder = {json.dumps(folder or PLACEHOLDER)}" if line == "folder = FOLDER" else line
                     for line in example)
    text = "\n".join([
        "---", data.to_yaml(), "---", "",
        f"# {pipeline['name']} trained with {algorithm['name']} (mmgrpo)", "",
        f"- Base model: `{base}`" + ("" if is_hub_id(base) or not base else " (bundled in this folder)"),
        f"- Algorithm: `{algorithm['name']}`; reward: `{config['reward']['name']}`; "
        f"prompts: `{config['data']['name']}`",
        f"- Training steps: {step} ({how})", "",
        "## Evaluation (held-out prompts, last evaluation)", "",
        "| metric | value |", "|---|---|", figures, "",
        "## Loading and generating", "", "```python", code, "```", "",
        "## Training config", "", "```yaml", dump_yaml(json_safe(config)).rstrip(), "```", "",
    ])
    return str(ModelCard(text))
