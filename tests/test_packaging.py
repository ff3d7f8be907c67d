"""The wheel users install: built from this checkout, installed in a fresh venv, imported.

Nothing is downloaded: the build backend (hatchling, a dev dependency) is the test venv's,
the wheel is installed without dependencies, and the fresh venv sees the test venv's
installed dependencies through a ``.pth`` line (which, unlike a site directory, does
not run that venv's own ``.pth`` files, so the editable checkout stays out of reach).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow

CHECK = """
import importlib.metadata as md, json, pathlib
import loader, sclayout, sclayout.cost.profile
meta = md.metadata("sclayout")
dirs = [pathlib.Path(m.__file__).parent for m in (loader, sclayout)]
print(json.dumps({
    "loader": loader.__file__,
    "sclayout": sclayout.__file__,
    "typed": [(d / "py.typed").is_file() for d in dirs],
    "presets": sorted(p.name for p in (dirs[1] / "cost" / "presets").glob("*.json")),
    "requires": meta.get_all("Requires-Dist"),
    "classifiers": meta.get_all("Classifier"),
    "urls": meta.get_all("Project-URL"),
    "license_files": [f.name for f in md.distribution("sclayout").files if f.name == "LICENSE"],
}))
"""


def _run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, **kw)
    assert res.returncode == 0, f"{cmd[:4]} failed:\n{res.stdout[-2000:]}\n{res.stderr[-2000:]}"
    return res


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> tuple[Path, dict]:
    tmp = tmp_path_factory.mktemp("wheel")
    dist = tmp / "dist"
    # the backend of [build-system] is a dev dependency: no isolated build environment
    pip_wheel = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation"]
    _run([*pip_wheel, "-q", "-w", str(dist), str(ROOT)])
    (wheel,) = dist.glob("sclayout-*.whl")
    env_dir = tmp / "fresh"
    venv.EnvBuilder(system_site_packages=True, with_pip=False).create(env_dir)
    py = env_dir / "bin" / "python"
    _run([str(py), "-m", "pip", "install", "--no-deps", "--no-index", "-q", str(wheel)])
    fresh_site = Path(
        _run(
            [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]
        ).stdout.strip()
    )
    (fresh_site / "_test_venv_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    # cwd: the checkout not on sys.path; nor through a PYTHONPATH the suite was run with
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = _run([str(py), "-c", CHECK], cwd=tmp, env=env).stdout
    return env_dir, json.loads(out.strip().splitlines()[-1])


def test_both_packages_import_from_the_wheel(installed):
    env_dir, info = installed
    for name in ("loader", "sclayout"):
        path = Path(info[name]).resolve()
        assert env_dir.resolve() in path.parents, f"{name} imported from {path}, not the wheel"
        assert ROOT not in path.parents


def test_wheel_ships_type_markers_presets_and_license(installed):
    _, info = installed
    assert info["typed"] == [True, True]
    # the cited presets ship; profiles measured on one VM stay in benchmarks/results/presets
    assert {"local-nvme.json", "network-disk.json", "http-object-store.json"} <= set(
        info["presets"]
    )
    assert "local-disk-here.json" not in info["presets"]
    assert info["license_files"] == ["LICENSE"]


def test_metadata_torch_uncapped_classifiers_and_urls(installed):
    _, info = installed
    torch_reqs = [r for r in info["requires"] if r.startswith("torch")]
    assert torch_reqs, info["requires"]
    for req in torch_reqs:
        spec = req.split(";")[0]
        assert "<" not in spec and "==" not in spec, f"torch is capped for users: {req}"
    assert "License :: OSI Approved :: BSD License" in info["classifiers"]
    assert "Typing :: Typed" in info["classifiers"]
    assert any(u.startswith("Documentation,") for u in info["urls"]), info["urls"]
