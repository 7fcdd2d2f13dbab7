"""Installing shardsafe as the README says: the wheel built from a clone holds every module, ``py.typed``
and the ``shardsafe`` command, and declares the Python versions, the torch range and the extras; the
README's install section gives the commands; ``make test-torch`` is there and says how to call it."""

from __future__ import annotations

import email.parser
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PYTHONS = ("3.10", "3.11", "3.12", "3.13")


def _can_build_offline() -> bool:
    """Whether this environment has what pyproject.toml's build backend needs, without downloading it."""
    try:
        import setuptools
    except ImportError:
        return False
    if tuple(int(p) for p in setuptools.__version__.split(".")[:2] if p.isdigit()) < (68, 0):
        return False
    try:
        import setuptools.command.bdist_wheel  # (setuptools >= 70.1)
    except ImportError:
        try:
            import wheel.bdist_wheel  # noqa: F401
        except ImportError:
            return False
    return True


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel ``pip wheel . --no-deps`` builds, from a copy of the clone (the clone stays untouched)."""
    if not _can_build_offline():
        pytest.skip("building the wheel offline needs setuptools>=68 with bdist_wheel (or the wheel package) here")
    src = tmp_path_factory.mktemp("clone")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "src", src / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    out = tmp_path_factory.mktemp("dist")
    run = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation", "-q", "-w", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    (built,) = out.glob("shardsafe-*-py3-none-any.whl")
    return built


def test_the_wheel_holds_every_module_and_the_command(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        entry_points = next(z.read(n).decode() for n in names if n.endswith(".dist-info/entry_points.txt"))
    modules = {p.relative_to(ROOT / "src").as_posix() for p in (ROOT / "src" / "shardsafe").rglob("*.py")}
    assert modules <= names, sorted(modules - names)
    assert "shardsafe/py.typed" in names
    assert "shardsafe = shardsafe.cli:main" in entry_points


def test_the_wheel_declares_pythons_torch_and_extras(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as z:
        meta = next(z.read(n).decode() for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    doc = email.parser.Parser().parsestr(meta)
    assert doc["Requires-Python"] == ">=3.10"
    classifiers = doc.get_all("Classifier") or []
    for version in PYTHONS:
        assert f"Programming Language :: Python :: {version}" in classifiers, classifiers
    assert "Typing :: Typed" in classifiers
    requires = doc.get_all("Requires-Dist") or []
    assert "torch>=2.6" in requires, requires
    assert set(doc.get_all("Provides-Extra") or []) >= {"fabric", "lightning", "s3", "remote", "hf"}


def test_the_readme_says_how_to_install() -> None:
    readme = (ROOT / "README.md").read_text()
    assert "\n## Install\n" in readme
    section = readme.split("\n## Install\n", 1)[1].split("\n## ", 1)[0]
    for command in ("pip install .", 'pip install ".[fabric]"', "pip wheel . --no-deps", "python -m build"):
        assert command in section, command
    assert "make test-torch TORCH=" in section
    assert 'pip install "shardsafe[' not in readme  # no package index has it


def test_make_test_torch_wants_a_release() -> None:
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    run = subprocess.run(["make", "-s", "test-torch"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert run.returncode != 0 and "usage: make test-torch TORCH=2.6.0" in run.stdout + run.stderr, run
    dry = subprocess.run(
        ["make", "-n", ".venv-torch-9.9.9/.setup-stamp"], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert dry.returncode == 0 and '"torch==9.9.9"' in dry.stdout, dry.stdout + dry.stderr
