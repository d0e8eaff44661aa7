"""``mmgrpo export CHECKPOINT OUTPUT``: a self-contained model folder a user can hand to someone else.

The folder holds the whole diffusers pipeline or transformers model with its processor / tokenizer, loadable with the
stock library's ``from_pretrained`` alone, and a model card (``README.md``). A LoRA run is exported either merged into
the weights (``--merge-lora``) or as the base model plus the adapter in ``lora/``, which stock diffusers
(``pipe.load_lora_weights(folder / "lora")``) or peft (``PeftModel.from_pretrained(model, folder / "lora")``) read.

The merge itself goes through the stock libraries (diffusers ``fuse_lora``, peft ``merge_and_unload``) on a fresh
copy of the base model, so what is exported is what a user would get by loading the checkpoint themselves.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

from . import checkpoint, registry
from .hub import is_hub_id
from .metrics_log import read_records
from .model_card import loading_call, model_card  # noqa: F401  (model_card: the card's writer, used from here)

LORA_FOLDER = "lora"


def export_diffusers(policy, pipeline_cls, location: str, path: str | Path, merge_lora: bool, lora: bool) -> None:
    """Exports a diffusers policy: the base pipeline from `location` with the trained weights applied.

    Args:
        policy: the policy; its ``save_pretrained`` writes the trained weights (LoRA files, or component folders
            such as ``transformer/`` that replace the base pipeline's).
        pipeline_cls (`type`): the diffusers pipeline class (e.g. ``StableDiffusion3Pipeline``).
        location (`str`): the base pipeline's folder or hub id.
        path (`str` or `Path`): the output folder.
        merge_lora (`bool`): fold a LoRA into the weights (``fuse_lora``) instead of writing it to ``lora/``.
        lora (`bool`): whether the policy trains a LoRA.
    """
    from diffusers.loaders.lora_base import LoraBaseMixin

    from .hub import load_diffusers_pipeline

    path = Path(path)
    with tempfile.TemporaryDirectory() as trained:
        policy.save_pretrained(trained)
        if not lora:  # trained component folders replace the base pipeline's, loaded with the same classes
            base = load_diffusers_pipeline(pipeline_cls, location)
            replaced = {name: type(base.components[name]).from_pretrained(str(Path(trained) / name))
                        for name in base.components if (Path(trained) / name / "config.json").is_file()}
            pipe = pipeline_cls(**{**base.components, **replaced})
            pipe.save_pretrained(path)
            return
        pipe = load_diffusers_pipeline(pipeline_cls, location)
        if merge_lora and not issubclass(pipeline_cls, LoraBaseMixin):  # no LoRA loader: the transformer's own
            pipe.transformer.load_lora_adapter(trained, prefix=None, use_safetensors=True)
            pipe.transformer.fuse_lora()
            pipe.transformer.unload_lora()
        elif merge_lora:
            pipe.load_lora_weights(trained)
            fused = ["transformer"]
            second = Path(trained) / "transformer_2"  # a two-expert model's second LoRA (Wan 2.2)
            if (second / "pytorch_lora_weights.safetensors").is_file():
                pipe.load_lora_weights(str(second), load_into_transformer_2=True)
                fused.append("transformer_2")
            pipe.fuse_lora(components=fused)  # by default only `transformer`: the second expert's LoRA would be lost
            pipe.unload_lora_weights()
        pipe.save_pretrained(path)
        if not merge_lora:
            shutil.copytree(trained, path / LORA_FOLDER)


def export_transformers(policy, model_cls, location: str, path: str | Path, merge_lora: bool, lora: bool,
                        processor, **load_kwargs) -> None:
    """Exports a transformers policy: the whole model (the trained one, or the base with the adapter merged by peft,
    or the base plus the adapter in ``lora/``) and its `processor` (or tokenizer).

    Args:
        policy: the policy; its ``save_pretrained`` writes a peft adapter (LoRA) or the whole model.
        model_cls (`type`): the transformers class that loads the base model (e.g. ``Qwen2VLForConditionalGeneration``).
        location (`str`): the base model's folder or hub id.
        path (`str` or `Path`): the output folder.
        merge_lora (`bool`): merge a LoRA into the weights (peft ``merge_and_unload``) instead of writing ``lora/``.
        lora (`bool`): whether the policy trains a LoRA.
        processor: the processor or tokenizer saved beside the model.
        load_kwargs: passed to ``from_pretrained`` (e.g. ``trust_remote_code``, ``revision``).
    """
    path = Path(path)
    if not lora:
        policy.save_pretrained(str(path))  # the whole trained model and its processor
        return
    from peft import PeftModel

    with tempfile.TemporaryDirectory() as trained:
        policy.save_pretrained(trained)
        base = model_cls.from_pretrained(location, **load_kwargs)
        if merge_lora:
            PeftModel.from_pretrained(base, trained).merge_and_unload().save_pretrained(path)
        else:
            base.save_pretrained(path)
            (path / LORA_FOLDER).mkdir(parents=True, exist_ok=True)
            for name in ("adapter_config.json", "adapter_model.safetensors"):
                shutil.copy2(Path(trained) / name, path / LORA_FOLDER / name)
            if is_hub_id(location):
                name_base(path, model_cls, location, load_kwargs.get("revision"))
            else:
                name_base(path, model_cls, str(path.resolve()))
    processor.save_pretrained(path)


def name_base(path: Path, model_cls, base: str, revision: str | None = None) -> None:
    """Names, in ``lora/adapter_config.json`` of an export at `path`, the base model's class (peft's ``auto_mapping``,
    which ``AutoPeftModel`` reads when there is no task type) and where the base is: `base`, its hub id (at the
    configured `revision`), or the exported folder itself, which holds the base (a local or shipped ``mmgrpo:`` base
    is bundled)."""
    file = Path(path) / LORA_FOLDER / "adapter_config.json"
    record = json.loads(file.read_text(encoding="utf-8"))
    record["base_model_name_or_path"], record["revision"] = base, revision
    if record.get("task_type") is None:
        record["auto_mapping"] = {"base_model_class": model_cls.__name__, "parent_library": model_cls.__module__}
    file.write_text(json.dumps(record, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _run_folder(source: Path) -> tuple[Path, Path]:
    """``(checkpoint folder, run folder)`` for a checkpoint folder or a run folder (its latest checkpoint)."""
    if (source / checkpoint.STATE_FILE).is_file():
        return checkpoint.resolve(str(source), source.parent), source.parent.parent
    return checkpoint.resolve("latest", source / "checkpoints"), source


def _final_evaluation(run: Path) -> dict:
    """The last evaluation's figures of a run (``eval/...`` metrics of its last record that has them)."""
    metrics = run / "metrics.jsonl"
    evals = [r for r in read_records(metrics) if any(k.startswith("eval/") for k in r)] if metrics.is_file() else []
    return {k: v for k, v in evals[-1].items() if k == "step" or k.startswith("eval/")} if evals else {}


def _rename_bundled_base(tmp: Path, output: Path) -> None:
    """An adapter whose base is bundled in the export names the folder under its final name, not the temporary one
    it is written in."""
    file = tmp / LORA_FOLDER / "adapter_config.json"
    if file.is_file():
        record = json.loads(file.read_text(encoding="utf-8"))
        if record.get("base_model_name_or_path") == str(tmp.resolve()):
            record["base_model_name_or_path"] = str(output.resolve())
            file.write_text(json.dumps(record, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _example_prompt(config) -> str | None:
    """The first held-out (else training) prompt of the run's prompt source, for the model card's example; None when
    the source cannot be read here (its files are elsewhere, a hub dataset offline)."""
    source = registry.get("data", config.data.name)(config.data.options)
    try:
        items = source.eval_items() or source.train_items()
    except (OSError, ValueError):
        return None
    prompt = items[0].get("prompt") if items else None
    return prompt if isinstance(prompt, str) else None


def export_checkpoint(source: str | Path, output: str | Path, merge_lora: bool = False,
                      trust_remote_code: bool = False) -> Path:
    """Builds the run's policy (no reward, no optimizer), loads the checkpoint's weights only, and writes the
    self-contained folder with its model card. Returns the output folder. A run folder's config that asks to run
    the model's own code (``trust_remote_code: true``) is refused unless `trust_remote_code` (the command line's
    ``--trust-remote-code``) allows it: the folder may have been written by someone else.

    Raises:
        `FileNotFoundError`: no checkpoint or no ``config.json`` of its run.
        `FileExistsError`: `output` exists and is not empty (nothing is overwritten).
        [`~mmgrpo.validation.ConfigError`]: the run's config asks for remote code that was not allowed.
    """
    from .config import from_dict
    from .preflight import check_remote_code

    ckpt, run = _run_folder(Path(source))
    config_file = run / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{config_file} not found: export a checkpoint inside the run folder `mmgrpo train` wrote")
    output = Path(output)
    if output.exists() and any(output.iterdir()):
        raise FileExistsError(f"{output} exists and is not empty: choose a new folder (nothing is overwritten)")
    raw = json.loads(config_file.read_text(encoding="utf-8"))
    config = from_dict(raw)
    check_remote_code(config, trust_remote_code)  # before anything loads
    policy = registry.get("pipeline", config.pipeline.name)(config.pipeline.options)
    meta = checkpoint.load_weights(ckpt, policy)
    lora = config.pipeline.options.lora_rank > 0
    # all or nothing: a failed export (a full disk...) leaves no half-written folder under the requested name
    with checkpoint.atomic_folder(output, "the exported model") as tmp:
        policy.export_pretrained(str(tmp), merge_lora=merge_lora)
        index = tmp / "model_index.json"
        if index.is_file():  # diffusers records the folder it loaded from: name the configured base model instead
            entries = json.loads(index.read_text(encoding="utf-8"))
            entries["_name_or_path"] = raw["pipeline"].get("pretrained", "")
            index.write_text(json.dumps(entries, indent=2) + "\n", encoding="utf-8")
        _rename_bundled_base(tmp, output)
        card = model_card(raw, int(meta["step"]), _final_evaluation(run), lora, merge_lora, loading_call(tmp),
                          folder=str(output.resolve()), prompt=_example_prompt(config))
        (tmp / "README.md").write_text(card, encoding="utf-8")
    return output


def hub_files(folder: Path, repo_id: str) -> dict[str, bytes]:
    """The files of an export that name its local folder, as they are uploaded to `repo_id`: the model card's example
    downloads the repository (``snapshot_download``) and a bundled base model is the repository itself.

    Returns:
        `dict[str, bytes]`: path in the repository -> content, for the files that change.
    """
    local = str(folder.resolve())
    changed = {}
    card = folder / "README.md"
    if card.is_file():
        text = card.read_text(encoding="utf-8").replace(
            f"folder = {json.dumps(local)}",
            f"from huggingface_hub import snapshot_download\nfolder = snapshot_download({json.dumps(repo_id)})")
        changed["README.md"] = text.encode("utf-8")
    adapter = folder / LORA_FOLDER / "adapter_config.json"
    if adapter.is_file():
        record = json.loads(adapter.read_text(encoding="utf-8"))
        if record.get("base_model_name_or_path") == local:
            record["base_model_name_or_path"] = repo_id
            text = json.dumps(record, indent=2, sort_keys=True) + "\n"
            changed[f"{LORA_FOLDER}/adapter_config.json"] = text.encode("utf-8")
    return changed


def push_to_hub(folder: str | Path, repo_id: str, private: bool = False) -> str:
    """Uploads an exported folder to the Hugging Face hub (creating the repository if needed); returns its URL.

    One request without retries (``whoami``) comes first, so no network, an unreachable endpoint or a missing or
    invalid token fail within seconds, before the upload's own retries.

    Raises:
        `RuntimeError`: the hub cannot be reached (offline mode, no network, no token, refused); a one-line message
            that says what to do.
    """
    import httpx2  # huggingface_hub's HTTP client: its transport errors are no connection, DNS, timeouts
    from huggingface_hub import CommitOperationAdd, HfApi, constants
    from huggingface_hub.errors import HfHubHTTPError, LocalTokenNotFoundError, OfflineModeIsEnabled

    later = f"or upload {folder} yourself later with `hf upload {repo_id} {folder}`."
    if constants.is_offline_mode():
        raise RuntimeError(f"cannot push to {repo_id!r}: HF_HUB_OFFLINE is set. Unset it (and log in with `hf auth "
                           f"login`), {later}")
    api = HfApi()
    try:
        api.whoami()
        api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
        rewritten = hub_files(Path(folder), repo_id)
        files = sorted(p for p in Path(folder).rglob("*") if p.is_file())
        api.create_commit(repo_id, repo_type="model", commit_message="Upload model exported by mmgrpo", operations=[
            CommitOperationAdd(path_in_repo=name, path_or_fileobj=rewritten.get(name, str(file)))
            for file in files for name in [file.relative_to(folder).as_posix()]])
    except OfflineModeIsEnabled:
        raise RuntimeError(f"cannot push to {repo_id!r}: HF_HUB_OFFLINE is set. Unset it, {later}") from None
    except LocalTokenNotFoundError:
        raise RuntimeError(f"cannot push to {repo_id!r}: not logged in to the hub. Run `hf auth login` (or set "
                           f"HF_TOKEN) and export again with --push-to-hub, {later}") from None
    except httpx2.TransportError as err:
        reason = " ".join(str(err).split()) or type(err).__name__
        raise RuntimeError(f"cannot push to {repo_id!r}: the hub at {api.endpoint} cannot be reached ({reason}). Check "
                           f"the network (or HF_ENDPOINT, a proxy), {later}") from None
    except HfHubHTTPError as err:
        reason = " ".join(str(err).split())[:300]
        raise RuntimeError(f"cannot push to {repo_id!r}: the hub refused ({reason}). Check the token's write access "
                           f"to {repo_id} (`hf auth whoami`), {later}") from None
    return f"https://huggingface.co/{repo_id}"
