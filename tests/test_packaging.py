"""The package installed from a wheel, not editable: the quickstart's configs, the recipes and
the planner's calibration tables resolve from the installed copy, with no source checkout on
the path.

The wheel is built from a copy of the sources: setuptools writes ``build/`` and ``*.egg-info``
into the tree it builds, and a ``build/`` left in the checkout would ship stale modules.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
SOURCES = ("pyproject.toml", "README.md", "megatron_mtraining", "patches", "configs")
# Run with -S: no site-packages, so nothing but the installed copy (and the standard library)
# can provide megatron_mtraining.
PROBE = """
import json
from megatron_mtraining import configs
from megatron_mtraining.examples import quickstart
from megatron_mtraining.planning import tables

args = quickstart._parse_cli(["--workdir", "w"])
print(json.dumps({
    "quickstart": quickstart.__file__,
    "default_config": args.config,
    "mix_config": str(quickstart.MIX_CONFIG),
    "recipe": str(configs.find("qwen2.5-3b/512k.yaml")),
    "recipes": configs.recipes(),
    "calibration": {name: len(tables.table(name)) for name in tables.TABLES},
}))
"""


def _installed(tmp_path: Path) -> Path:
    source, target = tmp_path / "source", tmp_path / "site"
    source.mkdir()
    for name in SOURCES:
        path = REPO / name
        if path.is_dir():
            shutil.copytree(path, source / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(path, source / name)
    cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation", "--no-index"]
    subprocess.run([*cmd, "--target", str(target), str(source)], check=True, capture_output=True, timeout=300)
    return target


def test_configs_resolve_from_a_non_editable_install(tmp_path):
    site = _installed(tmp_path)
    env = {**os.environ, "PYTHONPATH": str(site)}
    proc = subprocess.run(
        [sys.executable, "-S", "-c", PROBE], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    found = json.loads(proc.stdout)
    installed = site / "megatron_mtraining"
    assert Path(found["quickstart"]).is_relative_to(installed), found
    # Every package of the checkout is installed: pyproject.toml lists them by hand.
    checkout_packages = {p.parent.relative_to(REPO) for p in (REPO / "megatron_mtraining").rglob("__init__.py")}
    installed_packages = {p.parent.relative_to(site) for p in installed.rglob("__init__.py")}
    assert not checkout_packages - installed_packages, sorted(map(str, checkout_packages - installed_packages))
    for key in ("default_config", "mix_config", "recipe"):
        path = Path(found[key])
        assert path.is_relative_to(installed / "configs") and path.is_file(), (key, found)
    assert Path(found["default_config"]).name == "quickstart.yaml"
    assert all(found["calibration"].values()), found["calibration"]
    # Every recipe of the checkout is packaged, and so is the base: file each one names.
    checkout = REPO / "configs"
    names = (p.relative_to(checkout) for p in checkout.rglob("*.yaml"))
    expected = sorted(name.as_posix() for name in names if name.parts[0] != "data")
    assert found["recipes"] == expected
    for name in found["recipes"]:
        base = (yaml.safe_load((installed / "configs" / name).read_text()) or {}).get("base")
        if base is not None:
            assert (installed / "configs" / name).parent.joinpath(base).is_file(), (name, base)
