"""`pipelines/`, `rewards/`, `data/` and `configs/` install as `mmgrpo.pipelines`, `mmgrpo.rewards`, `mmgrpo.data`,
`mmgrpo.configs`, never as top-level modules (those names belong to other PyPI distributions), in an editable install
and in a wheel. The wheel ships every config, the toy base models that configs name (``mmgrpo:<name>``) and no tiny
test builder or training script."""

import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHECK = (
    "import importlib.util, sys\n"
    "import mmgrpo.pipelines, mmgrpo.rewards, mmgrpo.data\n"
    "for name in ('pipelines', 'rewards', 'data'):\n"
    "    assert importlib.util.find_spec(name) is None, name\n"
    "print(mmgrpo.pipelines.__file__)\n"
)
SOURCES = ("pyproject.toml", "README.md", "mmgrpo", "pipelines", "rewards", "data", "configs")


def test_editable_install_maps_folders_into_namespace(tmp_path):
    proc = subprocess.run([sys.executable, "-c", CHECK], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert Path(proc.stdout.strip()) == ROOT / "pipelines" / "__init__.py"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel, built from a fresh copy of the sources (an in-tree ``build/`` may hold files since removed)."""
    tmp_path = tmp_path_factory.mktemp("wheel")
    source = tmp_path / "src"
    source.mkdir()
    for name in SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(ROOT / name, source / name)
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path / "dist"),
         str(source)],
        capture_output=True, text=True, timeout=300,
    )
    assert build.returncode == 0, build.stderr[-2000:]
    return next((tmp_path / "dist").glob("mmgrpo-*.whl"))


def _configured_toy_models() -> set[str]:
    """The shipped toy models that some config names as ``pretrained: mmgrpo:<name>`` (a policy) or ``model:
    mmgrpo:<name>`` (a reward's model, e.g. the tiny SAM 2)."""
    found = set()
    for config in (ROOT / "configs").rglob("*.yaml"):
        found.update(re.findall(r"(?:pretrained|model):\s*mmgrpo:(\w+)", config.read_text(encoding="utf-8")))
    return found


def test_built_wheel_installs_only_the_mmgrpo_package(wheel, tmp_path):
    names = zipfile.ZipFile(wheel).namelist()
    assert "mmgrpo/pipelines/sd3.py" in names and "mmgrpo/rewards/jpeg.py" in names
    assert "mmgrpo/data/prompt_file.py" in names
    assert not any(n.split("/")[0] in ("pipelines", "rewards", "data", "tests", "configs", "scripts") for n in names)
    target = tmp_path / "site"
    install = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "--target", str(target), str(wheel)],
        capture_output=True, text=True, timeout=300,
    )
    assert install.returncode == 0, install.stderr[-2000:]
    assert sorted(p.name for p in target.iterdir() if not p.name.endswith((".dist-info", "bin"))) == ["mmgrpo"]
    # -S: no site-packages, so the editable install cannot answer; only the wheel's files are importable
    code = f"import sys; sys.path.insert(0, {str(target)!r})\n" + CHECK
    proc = subprocess.run([sys.executable, "-S", "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert Path(proc.stdout.strip()) == target / "mmgrpo" / "pipelines" / "__init__.py"


def test_wheel_ships_the_configured_toy_models_and_no_test_builder_or_training_script(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    data = sorted(n.removeprefix("mmgrpo/data/") for n in names if n.startswith("mmgrpo/data/"))
    # data/ ships prompt sources (modules), the toy base models and the example rows, nothing else
    assert [n for n in data if not (n.startswith(("weights/", "examples/")) or n.count("/") == 0
                                    and n.endswith(".py"))] == []
    assert not [n for n in names if re.search(r"(^|/)(tiny_\w+|train_\w+|_tokenizers)\.py$", n)]
    assert not [n for n in names if n.endswith("samples.png")]
    configured = _configured_toy_models()
    embedded = {"t2i_shapes", "t2i_shapes_p2", "t2v_shapes", "edit_shapes", "vlm_shapes", "mdlm_arith"}
    assert embedded <= configured  # the embedded defaults
    for name in configured:
        model = ROOT / "data" / "weights" / name
        files = {f"mmgrpo/data/weights/{name}/{p.relative_to(model).as_posix()}" for p in model.rglob("*")
                 if p.is_file() and p.name != "samples.png"}
        assert files, f"a config names mmgrpo:{name}, but data/weights/{name} holds no files"
        assert files <= names, f"mmgrpo:{name} files missing from the wheel: {sorted(files - names)}"
    shipped = {n.split("/")[3] for n in names if n.startswith("mmgrpo/data/weights/")}
    assert shipped == configured, f"shipped toy models no config uses: {sorted(shipped - configured)}"


def test_wheel_ships_every_config_so_an_installed_mmgrpo_runs_them_by_name(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    configs = {f"mmgrpo/configs/{p.relative_to(ROOT / 'configs').as_posix()}" for p in (ROOT / "configs").rglob("*.yaml")}
    assert "mmgrpo/configs/tiny/t2i_shapes.yaml" in configs
    assert configs <= names, f"configs missing from the wheel: {sorted(configs - names)}"


def test_one_version_number_for_the_package_the_readme_and_checkpoints(wheel):
    """pyproject.toml reads the version from `mmgrpo.__version__` (no second number to forget), the wheel carries it
    and the README names it (checkpoints record it: `test_broken_files`)."""
    from mmgrpo import __version__, checkpoint

    assert "version =" not in (ROOT / "pyproject.toml").read_text().split("[project]")[1].split("\n[")[0]
    assert wheel.name.startswith(f"mmgrpo-{__version__}-")
    assert f"mmgrpo {__version__}" in (ROOT / "README.md").read_text()
    assert checkpoint.FORMAT == 2  # the pickle-free format that 0.2 introduced (the README's conversion note)


EXAMPLE_CONFIGS = sorted(p.stem for p in (ROOT / "configs").glob("*.yaml") if "data/examples/" in p.read_text())
INSTALLED_CHECK = (
    "import sys\n"
    "import mmgrpo\n"
    "from mmgrpo import cli, memory_check\n"
    "assert mmgrpo.__file__.startswith(sys.argv[1]), mmgrpo.__file__\n"
    "memory_check.machine_memory = lambda: 2**40 + 8 * memory_check.ACCELERATOR_ALLOWANCE  # the 8-accelerator node\n"
    "for name in sys.argv[2:]:\n"
    "    assert cli.main(['check', name]) == 0, name\n"
)


def test_wheel_ships_the_example_data_so_the_real_model_configs_check_from_an_installed_copy(wheel, tmp_path):
    """The real-model configs read example rows under ``data/examples/`` (a format to copy); installed from the wheel
    and run from a folder without them, ``mmgrpo check`` passes on each: the package's copy answers."""
    names = set(zipfile.ZipFile(wheel).namelist())
    examples = {f"mmgrpo/{p.relative_to(ROOT).as_posix()}" for p in (ROOT / "data" / "examples").rglob("*") if p.is_file()}
    assert examples and examples <= names, f"example data missing from the wheel: {sorted(examples - names)}"
    assert len(EXAMPLE_CONFIGS) >= 5, EXAMPLE_CONFIGS
    target = tmp_path / "site"
    install = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "--target", str(target), str(wheel)],
        capture_output=True, text=True, timeout=300,
    )
    assert install.returncode == 0, install.stderr[-2000:]
    env = {**os.environ, "PYTHONPATH": str(target), "HF_HUB_OFFLINE": "1"}  # the wheel's mmgrpo before the editable one
    proc = subprocess.run([sys.executable, "-c", INSTALLED_CHECK, str(target), *EXAMPLE_CONFIGS], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("ok\n") == len(EXAMPLE_CONFIGS)
