"""What pip puts in a user's site-packages: one import name, ``parnas``, with every package under it, so that a user's
own ``study.py`` or another distribution's ``strategies`` shadows nothing of parnas."""

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    """The wheel of a copy of what it is built from: pip builds in the source folder, whose build/ would otherwise
    linger in the checkout, a stale copy of every module."""
    out, source = tmp_path_factory.mktemp("wheel"), tmp_path_factory.mktemp("source")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    shutil.copytree(ROOT / "parnas", source / "parnas", ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out),
                    str(source)], check=True, capture_output=True, timeout=300)
    (path,) = out.glob("*.whl")
    return zipfile.ZipFile(path)


def test_the_wheel_installs_one_import_name(wheel):
    top = {name.split("/")[0] for name in wheel.namelist() if ".dist-info/" not in name}
    assert top == {"parnas"}
    (top_level,) = [n for n in wheel.namelist() if n.endswith(".dist-info/top_level.txt")]
    assert wheel.read(top_level).decode().split() == ["parnas"]


def test_every_package_of_the_checkout_is_in_the_wheel(wheel):
    """The packages are listed by hand in pyproject.toml: one added to parnas/ and not listed would be left out."""
    names = set(wheel.namelist())
    modules = {p.relative_to(ROOT).as_posix() for p in (ROOT / "parnas").rglob("*.py")}
    assert {"parnas/strategies/search.py", "parnas/study/run.py", "parnas/retrain/run.py"} <= modules <= names, \
        sorted(modules - names)


def test_the_distribution_is_named_apart_from_the_import_name(wheel):
    """"parnas" on the package index is an unrelated project; the distribution is parnas-nni."""
    assert Path(wheel.filename).name.startswith("parnas_nni-")
    (entry_points,) = [n for n in wheel.namelist() if n.endswith(".dist-info/entry_points.txt")]
    assert "parnas = parnas.cli:run" in wheel.read(entry_points).decode()


@pytest.mark.slow
def test_a_user_study_module_shadows_nothing(tmp_path):
    """A user's own study.py and strategies.py in the working folder: parnas's commands still import their own."""
    (tmp_path / "study.py").write_text("raise SystemExit('the user study module was imported')\n")
    (tmp_path / "strategies.py").write_text("raise SystemExit('the user strategies module was imported')\n")
    code = "import parnas.study.run, parnas.strategies.search, parnas.retrain.run; print('ok')"
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr
