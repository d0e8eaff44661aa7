"""A self-describing command line: ``mmgrpo --version`` and ``mmgrpo show NAME`` (every plugin's options, types,
defaults and documentation, read from its ``Config``)."""

import dataclasses
from importlib import metadata

import pytest

from mmgrpo import __version__, cli, plugin_help, registry
from mmgrpo.validation import is_embedded

ALL_PLUGINS = [(kind, name) for kind in registry.KINDS for name in registry.available(kind)]


def test_version_names_mmgrpo_and_the_pinned_libraries(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--version"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"mmgrpo {__version__} (")
    for name in ("torch", "diffusers", "transformers", "accelerate", "peft"):
        assert f"{name} {metadata.version(name)}" in out


@pytest.mark.parametrize("kind, name", ALL_PLUGINS, ids=[f"{k}-{n}" for k, n in ALL_PLUGINS])
def test_show_lists_every_option_with_its_default_and_documentation(kind, name):
    text = plugin_help.describe(name, kind)
    config = registry.get(kind, name).Config
    assert text.startswith(f"{kind} {name}: ")
    for field in dataclasses.fields(config):
        if not field.init:
            continue
        if is_embedded(field):  # a shared record's keys, listed flat with this plugin's defaults
            record = field.default_factory()
            defaults = {f.name: getattr(record, f.name) for f in dataclasses.fields(record) if f.init}
        else:
            defaults = {field.name: field.default}
        for key, default in defaults.items():
            entry = next((line for line in text.splitlines() if line.startswith(f"  {key}: ")), None)
            assert entry is not None, f"{key} is not listed"
            if default is not dataclasses.MISSING:
                assert entry.endswith(f"= {default!r}")
    assert "(undocumented)" not in text, f"document every option of {kind} {name} in its Config docstring's Args"


def test_show_from_the_command_line(capsys):
    assert cli.main(["show", "flow_grpo"]) == 0
    out = capsys.readouterr().out
    assert "kl_convention: 'transition' | 'flow_grpo' = 'transition'" in out
    assert "Flow-GRPO's published code" in out
    # the shared options, flat, with this algorithm's defaults and the shared record's documentation
    assert "  adv_std: 'population' | 'unbiased' = 'population'" in out and "  adv_clip_max: float | None = 5.0" in out
    assert "  scale_rewards: 'group' | 'batch' | 'none' = 'group'" in out and "global_std: true" in out
    assert cli.main(["show", "chunk_grpo"]) == 0
    assert "  adv_eps: float = 1e-08" in capsys.readouterr().out  # GCPO's


def test_show_refuses_unknown_and_ambiguous_names_with_the_fix(capsys):
    assert cli.main(["show", "no_such_plugin"]) == 2
    assert "no plugin 'no_such_plugin'" in capsys.readouterr().err
    shared = sorted(set(registry.available("reward")) & set(registry.available("data")))
    if shared:  # a reward and a prompt source may share a name: --kind chooses
        assert cli.main(["show", shared[0]]) == 2
        assert "--kind" in capsys.readouterr().err
        assert cli.main(["show", shared[0], "--kind", "reward"]) == 0


def test_argument_docs_reads_shared_and_continued_entries():
    doc = """Options.

    Args:
        low (`float`), high (`float`): the clip range,
            both ends.
        mode (`str`, *optional*): one of

            - ``"a"``: first;
            - ``"b"``: second.

    Returns:
        nothing (`None`): not an argument.
    """
    docs = plugin_help.argument_docs(doc)
    assert docs == {
        "low": "the clip range, both ends.",
        "high": "the clip range, both ends.",
        "mode": 'one of\n- ``"a"``: first;\n- ``"b"``: second.',
    }


def test_shipped_configs_run_by_name_from_any_folder(tmp_path, monkeypatch, capsys):
    """``mmgrpo check t2i_shapes`` from a folder without the repository finds the config shipped with the package."""
    monkeypatch.chdir(tmp_path)
    assert cli.main(["check", "t2i_shapes", "train.max_steps=3"]) == 0
    out = capsys.readouterr().out
    assert "max_steps: 3" in out and out.rstrip().endswith("ok")
    assert cli.main(["check", "tiny/vlm_count.yaml"]) == 0
    capsys.readouterr()
    assert cli.main(["check", "no_such_config"]) == 2
    err = capsys.readouterr().err
    assert "neither a file nor a shipped config" in err and "t2i_shapes" in err
