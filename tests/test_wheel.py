"""lorapipe as a user installs it: a wheel built from this checkout, installed into a fresh virtual
environment outside the repository, imports everything under `lorapipe.*`, puts nothing named
cache, stages or flows at the top of site-packages, and runs `lorapipe tiny-model` and a stage
there, then serves that stage from its cache."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel built from a copy of this checkout."""
    root = tmp_path_factory.mktemp("wheel")
    source = checkout_copy(root / "source")  # setuptools' build/ in the checkout would keep moved modules
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                            "-w", str(root / "dist"), str(source)], capture_output=True, text=True, timeout=600)
    assert built.returncode == 0, built.stderr[-3000:]
    return next((root / "dist").glob("lorapipe-*.whl"))


def test_the_wheel_holds_every_package_folder_of_the_namespace(wheel):
    inits = {f"lorapipe/{init.relative_to(REPO)}" for top in ("cache", "stages", "flows")
             for init in (REPO / top).rglob("__init__.py")}
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
    assert inits | {"lorapipe/__init__.py", "lorapipe/configs/demo.yaml"} <= names, sorted(inits - names)


@pytest.fixture(scope="module")
def installed(tmp_path_factory, wheel) -> Path:
    """A fresh venv with the wheel installed; the libraries come from this venv's site-packages
    (a .pth file: the wheel is installed without dependencies, so nothing is downloaded)."""
    venv = tmp_path_factory.mktemp("venv") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=300)
    site = Path(subprocess.run([venv / "bin" / "python", "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                               capture_output=True, text=True, check=True).stdout.strip())
    (site / "libraries.pth").write_text(sysconfig.get_path("purelib") + "\n")
    done = subprocess.run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "-q",
                           "--ignore-installed", "--no-deps", str(wheel)],  # this venv's editable lorapipe is visible
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return venv


def checkout_copy(target: Path) -> Path:
    """The checkout's files as git sees them (tracked, and new ones not ignored), nothing built."""
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO, capture_output=True,
                            check=True).stdout.decode().split("\0")
    for rel in filter(None, listed):
        if (REPO / rel).is_file():
            (target / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / rel, target / rel)
    return target


def in_venv(venv: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {name: value for name, value in os.environ.items() if name != "PYTHONPATH"}
    env |= {"PREFECT_HOME": str(cwd / "prefect-home"), "HF_HUB_OFFLINE": "1"}
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=900)


def test_the_wheel_installs_one_namespace_and_runs_a_stage_outside_the_repository(installed, tmp_path):
    python = installed / "bin" / "python"
    site = Path(in_venv(installed, str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))",
                        cwd=tmp_path).stdout.strip())
    assert not {"cache", "stages", "flows"} & {p.name for p in site.iterdir()}
    where = in_venv(installed, str(python), "-c", "import lorapipe.stages.families as f; print(f.__file__)",
                    cwd=tmp_path)
    assert where.stdout.strip().startswith(str(site / "lorapipe")), where.stdout + where.stderr

    built = in_venv(installed, str(installed / "bin" / "lorapipe"), "tiny-model", "model", cwd=tmp_path)
    assert built.returncode == 0, built.stderr[-3000:]
    assert (tmp_path / "model" / "model_index.json").is_file()
    images = tmp_path / "data"
    images.mkdir()
    demo_images = site / "lorapipe" / "stages" / "assets" / "demo_images"
    for photo in sorted(demo_images.iterdir()):
        (images / photo.name).write_bytes(photo.read_bytes())
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({"cache_dir": "cache", "output_dir": "out", "model": {"path": "model"},
                                      "data": {"path": "data"}, "train": {}, "evaluate": {"prompts": ["a cat"]}}))
    runs = [in_venv(installed, str(python), "-m", "lorapipe", "run", "config.yaml", "--only", "preprocess", "--json",
                    cwd=tmp_path) for _ in range(2)]
    for run in runs:
        assert run.returncode == 0, run.stderr[-3000:]
    statuses = [json.loads(run.stdout)["stages"][0]["status"] for run in runs]
    assert statuses == ["computed", "hit"]
