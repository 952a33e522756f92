"""What pip puts in a user's site-packages: one import name, ``parnas``, whatever folders the repository keeps
beside it, so that a user's own ``study.py`` or another distribution's ``strategies`` shadows nothing of parnas."""

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out),
                    str(ROOT)], check=True, capture_output=True, timeout=300)
    (path,) = out.glob("*.whl")
    return zipfile.ZipFile(path)


def test_the_wheel_installs_one_import_name(wheel):
    top = {name.split("/")[0] for name in wheel.namelist() if ".dist-info/" not in name}
    assert top == {"parnas"}
    (top_level,) = [n for n in wheel.namelist() if n.endswith(".dist-info/top_level.txt")]
    assert wheel.read(top_level).decode().split() == ["parnas"]


def test_the_folders_beside_parnas_install_as_its_subpackages(wheel):
    names = set(wheel.namelist())
    for folder in ("search_spaces", "strategies", "retrain", "study"):
        modules = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / folder).glob("*.py"))
        assert modules and {f"parnas/{m}" for m in modules} <= names, folder


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
