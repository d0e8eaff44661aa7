"""`pipelines/`, `rewards/` and `data/` install as `mmgrpo.pipelines`, `mmgrpo.rewards`, `mmgrpo.data`, never as
top-level modules (those names belong to other PyPI distributions), in an editable install and in a wheel."""

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CHECK = (
    "import importlib.util, sys\n"
    "import mmgrpo.pipelines, mmgrpo.rewards, mmgrpo.data\n"
    "for name in ('pipelines', 'rewards', 'data'):\n"
    "    assert importlib.util.find_spec(name) is None, name\n"
    "print(mmgrpo.pipelines.__file__)\n"
)


def test_editable_install_maps_folders_into_namespace(tmp_path):
    proc = subprocess.run([sys.executable, "-c", CHECK], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert Path(proc.stdout.strip()) == ROOT / "pipelines" / "__init__.py"


def test_built_wheel_installs_only_the_mmgrpo_package(tmp_path):
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path / "dist"), str(ROOT)],
        capture_output=True, text=True, timeout=300,
    )
    assert build.returncode == 0, build.stderr[-2000:]
    wheel = next((tmp_path / "dist").glob("mmgrpo-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert "mmgrpo/pipelines/sd3.py" in names and "mmgrpo/rewards/jpeg.py" in names
    assert "mmgrpo/data/prompt_file.py" in names
    assert not any(n.split("/")[0] in ("pipelines", "rewards", "data", "tests", "configs") for n in names)
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
