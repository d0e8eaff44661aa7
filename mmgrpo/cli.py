"""Command line: ``mmgrpo check CONFIG [key=value ...]``, ``mmgrpo train CONFIG [key=value ...]``,
``mmgrpo sft CONFIG [key=value ...]`` (supervised cold start, see [`mmgrpo.sft`]),
``mmgrpo eval CONFIG [--checkpoint DIR] [--split train]``,
``mmgrpo list``, ``mmgrpo show NAME [--kind KIND]``, ``mmgrpo serve-reward CONFIG [--port P]``,
``mmgrpo convert-checkpoint DIR... --trust-pickles``, ``mmgrpo export CHECKPOINT OUTPUT [--merge-lora]
[--push-to-hub REPO]``, ``mmgrpo --version``."""

from __future__ import annotations

import argparse
import json
import os
import sys

from . import plugin_help, registry
from .config import ConfigError, load
from .config_yaml import dump_yaml
from .hub import is_hub_id, resolve_config
from .preflight import check_remote_code, preflight


class _PrintVersion(argparse.Action):
    """``--version``: prints the versions on one line (argparse's own action re-wraps the text) and exits."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        print(plugin_help.version_text())
        parser.exit()


def _list() -> int:
    for kind, title in (("pipeline", "pipelines"), ("algorithm", "algorithms"), ("reward", "rewards"), ("data", "prompt sources")):
        print(f"{title}:")
        for name, summary in registry.available(kind).items():
            print(f"  {name:<16} {summary}")
    return 0


def _convert_checkpoints(folders: list[str], trust_pickles: bool) -> int:
    """``mmgrpo convert-checkpoint DIR... --trust-pickles``: older checkpoints' pickled state to safetensors + JSON."""
    if not trust_pickles:
        print("mmgrpo: convert-checkpoint reads pickle files, which can run arbitrary code: add --trust-pickles if you "
              "trust where these checkpoints came from.", file=sys.stderr)
        return 2
    from . import checkpoint

    print("mmgrpo: warning: loading pickled checkpoint state (torch's restricted unpickler; only do this for "
          "checkpoints you trust).", file=sys.stderr)
    for folder in folders:
        try:
            done = checkpoint.convert_legacy(folder)
        except (OSError, ValueError, RuntimeError) as err:
            print(f"mmgrpo: {err}", file=sys.stderr)
            return 2
        converted = ", ".join(f"{old} -> {new}" for old, new in done)
        print(f"{folder}: {'converted ' + converted + ' (pickles deleted)' if done else 'already pickle-free'}")
    return 0


def _evaluate(config, split: str) -> dict:
    """``mmgrpo eval``: a trainer built without resuming, then the trainable weights only of the checkpoint
    (``checkpoint.resume_from``, which ``--checkpoint`` sets), so no optimizer, schedule, RNG or algorithm state is
    read; one evaluation."""
    from .trainer import Trainer

    source, config.checkpoint.resume_from = config.checkpoint.resume_from, None
    trainer = Trainer(config, record_config=False)  # the run's own config.json stays as training wrote it
    if source:
        trainer.load_weights(source)
    if split == "train":  # the same evaluation (sampler, noise, count, names) on the first train items
        trainer.eval_items = {"eval": trainer.data.train_items()}  # `evaluate` takes the first eval.num_prompts
    return trainer.evaluate(trainer.step)


def _export(args) -> int:
    """``mmgrpo export``: a self-contained model folder with its model card, optionally pushed to the hub."""
    from .errors import RunError
    from .export import export_checkpoint, push_to_hub

    if args.push_to_hub and not is_hub_id(args.push_to_hub):  # refused before the export, not after it
        print(f"mmgrpo: export: --push-to-hub {args.push_to_hub!r} is not a hub repository id; give "
              "'namespace/name' (letters, digits, '-', '_', '.'; no '--' or '..'; at most 96 characters)",
              file=sys.stderr)
        return 2
    try:
        folder = export_checkpoint(args.checkpoint, args.output, merge_lora=args.merge_lora,
                                   trust_remote_code=args.trust_remote_code)
    except (OSError, ValueError, RunError) as err:  # RunError: the folder could not be written (a full disk)
        print(f"mmgrpo: export: {' '.join(str(err).split())}", file=sys.stderr)
        return 2
    print(f"exported {args.checkpoint} -> {folder}")
    if args.push_to_hub:
        try:
            print(f"pushed to {push_to_hub(folder, args.push_to_hub, private=args.private)}")
        except RuntimeError as err:
            print(f"mmgrpo: {err}", file=sys.stderr)
            return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mmgrpo", description="Group-relative RL for multimodal generative models.")
    parser.add_argument("--version", action=_PrintVersion, help="print the versions of mmgrpo and its pinned libraries")
    sub = parser.add_subparsers(dest="command", required=True)
    p_check = sub.add_parser("check", help="validate a config without loading weights and print it resolved")
    p_check.add_argument("config")
    p_check.add_argument("overrides", nargs="*", help="key.subkey=value overrides")
    p_train = sub.add_parser("train", help="train from a YAML config")
    p_train.add_argument("config")
    p_train.add_argument("overrides", nargs="*", help="key.subkey=value overrides (values parsed as YAML)")
    p_sft = sub.add_parser("sft", help="supervised fine-tuning on the prompt source's target completions (a cold "
                           "start: writes OUTPUT_DIR/model, which pipeline.pretrained then trains with RL)")
    p_sft.add_argument("config")
    p_sft.add_argument("overrides", nargs="*", help="key.subkey=value overrides (sft.thought_dropout=0.5...)")
    p_eval = sub.add_parser("eval", help="evaluate a checkpoint on the held-out prompts")
    p_eval.add_argument("config")
    p_eval.add_argument("--checkpoint", help="a checkpoint folder written by `mmgrpo train` (default: the config's "
                        "checkpoint.resume_from if set, else its pretrained model as it is, i.e. the base of a run); "
                        "only its weights are read")
    p_eval.add_argument("--split", choices=["eval", "train"], default="eval",
                        help="score the held-out splits (default: those of eval.splits, else every split the "
                        "prompt source declares, e.g. eval and ood) or the train prompts (is a gap over-fitting?)")
    p_eval.add_argument("overrides", nargs="*")
    sub.add_parser("list", help="list registered pipelines, algorithms, rewards and prompt sources")
    p_show = sub.add_parser("show", help="a plugin's options: type, default and documentation")
    p_show.add_argument("name", help="a name from `mmgrpo list`, or module:attribute (with --allow-plugins)")
    p_show.add_argument("--kind", choices=sorted(registry.KINDS), help="needed when two kinds share the name")
    p_convert = sub.add_parser("convert-checkpoint", help="convert checkpoints of older mmgrpo versions (pickled "
                               "training state) to the pickle-free format, in place")
    p_convert.add_argument("folders", nargs="+", metavar="DIR", help="checkpoint folders (step_XXXXXXX)")
    p_convert.add_argument("--trust-pickles", action="store_true",
                           help="required: you trust the checkpoints' source (their pickles are loaded)")
    p_export = sub.add_parser("export", help="write a self-contained model folder (stock from_pretrained + model card)")
    p_export.add_argument("checkpoint", help="a checkpoint folder (step_XXXXXXX) or a run folder (its latest checkpoint)")
    p_export.add_argument("output", help="a new folder")
    p_export.add_argument("--merge-lora", action="store_true", help="fold a LoRA into the weights (default: lora/)")
    p_export.add_argument("--push-to-hub", metavar="REPO", help="then upload the folder to this hub repository")
    p_export.add_argument("--private", action="store_true", help="create the hub repository as private")
    for command in (p_check, p_train, p_sft, p_eval, p_export):
        command.add_argument("--trust-remote-code", action="store_true",
                             help="allow a config's trust_remote_code: true to run the model's own Python code (from "
                             "its folder or the hub); without this flag such a config is refused, whatever its file "
                             "says")
    p_serve = sub.add_parser("serve-reward", help="serve the config's reward over HTTP (for the `remote` reward)",
                             allow_abbrev=False)  # `--token SECRET` must not pass for `--token-file`
    p_serve.add_argument("config", help="an experiment YAML (its reward section) or a YAML with the reward's name")
    p_serve.add_argument("--host", default="127.0.0.1", help="interface to listen on (loopback by default)")
    p_serve.add_argument("--port", type=int, default=8000, help="port (0: any free port, printed at start)")
    p_serve.add_argument("--token-file", help="file holding the shared secret (default: $MMGRPO_REWARD_TOKEN); "
                         "required off loopback")
    for flag, kind, text in (  # ServerLimits fields, defaults there (mmgrpo.reward_server)
        ("--max-body-mb", float, "largest request body in MiB, 413 beyond (default 256)"),
        ("--max-decoded-mpixels", float, "millions of pixels the images and tensors of one request may decode to, "
         "read from their headers before decoding, 413 beyond (default 64: 64 images of 1024x1024)"),
        ("--header-timeout", int, "seconds a request's headers may take, however slowly they arrive (default 10)"),
        ("--idle-timeout", int, "seconds a connection may stay open between requests (default 30)"),
        ("--channel-timeout", int, "seconds a request body or an unread answer may make no progress (default 60)"),
        ("--connection-limit", int, "open connections in total; a newcomer replaces the connection waiting longest "
         "without a request being served (default 32)"),
        ("--max-connections-per-client", int, "open connections per client address (default 16)"),
        ("--threads", int, "worker threads reading and answering requests; at most this many requests are in the "
         "batcher at once, so set it above the number of clients whose requests should merge (default 16)"),
        ("--max-batch", int, "most samples merged from concurrent requests into one call of the reward; a larger "
         "request is scored alone (default 64, at most 65536; 1: each request alone)"),
        ("--batch-wait", float, "seconds a request arriving at an idle reward waits for others to merge with "
         "(default 0.01, at most 10; 0: merge only requests that arrived while the reward was busy)"),
        ("--max-queue", int, "requests waiting to be scored; beyond it 503 (default 64, at most 1024)"),
    ):
        p_serve.add_argument(flag, type=kind, default=argparse.SUPPRESS, help=text)
    p_serve.add_argument("overrides", nargs="*")
    for command in (p_check, p_train, p_sft, p_eval, p_serve, p_export, p_show):
        command.add_argument("--allow-plugins", action="store_true",
                             help="allow plugin names of the form module:attribute (your own code) in the config; "
                             "importing them runs their code, so a config file alone cannot")
    args, extra = parser.parse_known_args(argv)
    unknown = [item for item in extra if "=" not in item or item.startswith("-")]
    if unknown or (extra and args.command in ("list", "show", "convert-checkpoint", "export")):
        parser.error(f"unrecognized arguments: {' '.join(unknown or extra)}")

    if args.command == "list":
        return _list()
    if args.command == "show":
        registry.allow_user_code(args.allow_plugins)  # a module:attribute name is imported only if allowed
        try:
            print(plugin_help.describe(args.name, args.kind))
        except ValueError as err:
            print(f"mmgrpo: {err}", file=sys.stderr)
            return 2
        return 0
    if args.command == "export":
        registry.allow_user_code(args.allow_plugins)  # a run whose pipeline is a module:attribute of the user's
        return _export(args)
    if args.command == "convert-checkpoint":
        return _convert_checkpoints(args.folders, args.trust_pickles)
    overrides = list(args.overrides) + extra  # key=value overrides may also follow --checkpoint DIR
    registry.allow_user_code(args.allow_plugins)  # module:attribute plugins: imported only if the command line says so
    if args.command == "serve-reward":
        from dataclasses import fields

        from .reward_server import ServerLimits, serve

        given = {f.name: vars(args)[f.name] for f in fields(ServerLimits) if f.name in vars(args)}  # flags passed
        return serve(args.config, overrides, args.host, args.port, args.token_file, **given)
    if args.command == "eval" and args.checkpoint:
        overrides.append(f"checkpoint.resume_from={args.checkpoint}")  # checked with the config; eval reads weights
    try:
        config = load(resolve_config(args.config), overrides)  # every key, type, range and local path checked
        check_remote_code(config, args.trust_remote_code)  # a model's own code runs only if the command line says so
        if args.command == "sft":
            from .sft import check as check_sft

            items = check_sft(config)  # the pipeline takes teacher-forced targets; every item has one
        else:
            split = args.split if args.command == "eval" else None  # only `mmgrpo eval` has --split
            preflight(config, split)  # what else can be checked before any model loads
    except (ConfigError, ValueError, OSError) as err:
        print(f"mmgrpo: config error: {' '.join(str(err).split())}", file=sys.stderr)
        return 2
    if args.command == "check":
        print(dump_yaml(json.loads(json.dumps(config.to_dict()))), end="")
        print("ok")
        return 0
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from .progress import quiet_library_bars

    quiet_library_bars()  # no loading bars in a log file (ours print plain lines there)
    from .checkpoint import LegacyCheckpointError
    from .errors import RunError
    from .trainer import train

    try:
        if args.command == "sft":
            from .sft import sft

            summary = sft(config, items)
        else:
            summary = train(config) if args.command == "train" else _evaluate(config, args.split)
    except LegacyCheckpointError as err:  # resuming from a checkpoint of an older version: say how to convert it
        print(f"mmgrpo: {' '.join(str(err).split())}", file=sys.stderr)
        return 2
    except RunError as err:  # e.g. the reward server stopped answering: the message says what to do
        print(f"mmgrpo: {' '.join(str(err).split())}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # a second Ctrl-C during training, or one during set-up or evaluation
        print("mmgrpo: stopped at once (no checkpoint written for the current step)", file=sys.stderr)
        return 130
    from .sharding import end_processes

    end_processes()  # under torchrun: every process has finished before any closes its connections
    if summary:
        print(json.dumps(summary, indent=2))
    if summary and summary.get("stopped_by"):  # stopped by SIGINT / SIGTERM after saving: the shell's convention
        import signal

        return 128 + signal.Signals[summary["stopped_by"]].value
    return 0


if __name__ == "__main__":
    sys.exit(main())
