"""Packaging: ProServe installs under one ``proserve`` namespace.

The repository keeps the design card's top-level folders (``scheduler/``,
``sim/``, ...); ``pyproject.toml`` maps each to ``proserve.<folder>``, so an
install adds no generic top-level ``scheduler`` or ``sim`` to site-packages.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TOPS = ("scheduler", "prefill", "decode", "kvtransfer", "profiler", "dispatcher", "sim", "bench")


def _setuptools() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def test_every_folder_with_code_is_a_listed_package():
    listed = set(_setuptools()["packages"])
    on_disk = set()
    for top in TOPS:
        for d, dirs, files in os.walk(ROOT / top):
            dirs[:] = [x for x in dirs if x != "__pycache__"]
            if any(f.endswith(".py") for f in files):
                rel = Path(d).relative_to(ROOT)
                on_disk.add("proserve." + ".".join(rel.parts))
                assert (Path(d) / "__init__.py").exists(), f"{rel} holds code but no __init__.py"
    assert on_disk == listed, (sorted(on_disk - listed), sorted(listed - on_disk))


def test_each_top_folder_maps_into_the_namespace():
    assert _setuptools()["package-dir"] == {f"proserve.{t}": t for t in TOPS}


def test_installed_names_are_namespaced():
    """Outside the repository (so the working directory's folders are not on the
    path), ``proserve.scheduler`` imports and no top-level ``scheduler``, ``sim``,
    ``bench`` or ``profiler`` does."""
    code = ("import importlib.util, proserve.scheduler, proserve.sim.cluster;"
            "print([n for n in ('scheduler', 'sim', 'bench', 'profiler', 'prefill', 'decode', 'dispatcher',"
            " 'kvtransfer') if importlib.util.find_spec(n) is not None])")
    r = subprocess.run([sys.executable, "-c", code], cwd="/", capture_output=True, text=True, timeout=120,
                       env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]", r.stdout


def test_entry_points_name_namespaced_modules():
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts and all(v.startswith("proserve.") for v in scripts.values()), scripts
