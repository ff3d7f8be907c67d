"""The wheel users install: built from this checkout, installed in a fresh venv, imported.

The wheel is built and installed with the commands of the README's Install block. Only
flags that keep the test offline are added: the build backend (hatchling, a dev
dependency) is the test venv's, the wheel is installed without dependencies, and the
fresh venv sees the test venv's installed dependencies through a ``.pth`` line (which,
unlike a site directory, does not run that venv's own ``.pth`` files, so the editable
checkout stays out of reach).

The installed wheel must need nothing of the repository: no string the code shows a
user (messages, ``--help``) names a repository path such as ``docs/cli.md`` (links are
absolute URLs under the project's homepage, to files that exist), and no module walks
out of the installed packages with ``Path(__file__).parents[...]``.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import sysconfig
import tomllib
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
URLS = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]["urls"]

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
    "extras": meta.get_all("Provides-Extra"),
    **wheel_texts(dirs),
    "s3_without_moto": s3_without_moto(),
}))
"""

# What the installed code shows users, gathered in the fresh venv: string constants that
# are not docstrings (messages, option help), every command's --help, and the places
# where a module climbs out of its package with Path(__file__).parents[N].
TEXTS = """
import ast, re, sys
import click
from click.testing import CliRunner

def _code_strings(tree):
    bare = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr)}
    for n in ast.walk(tree):
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in bare:
            yield n.lineno, n.value

def _climbs(tree, levels):
    for n in ast.walk(tree):
        if (isinstance(n, ast.Subscript) and isinstance(n.value, ast.Attribute)
                and n.value.attr == "parents" and isinstance(n.slice, ast.Constant)
                and n.slice.value >= levels):
            yield n.lineno

def wheel_texts(dirs):
    from sclayout.cli import main as cli
    strings, climbs = [], []
    site = dirs[0].parent
    for d in dirs:
        for path in sorted(d.rglob("*.py")):
            rel = path.relative_to(site)
            tree = ast.parse(path.read_text(encoding="utf-8"))
            strings += [[f"{rel}:{line}", s] for line, s in _code_strings(tree)]
            climbs += [f"{rel}:{line}" for line in _climbs(tree, len(rel.parts) - 1)]
    helps = {}
    for name in [None, *cli.list_commands(click.Context(cli))]:
        res = CliRunner().invoke(cli, [name, "--help"] if name else ["--help"])
        assert res.exit_code == 0, (name, res.output)
        helps[name or "sclayout"] = res.output
    return {"strings": strings, "climbs": climbs, "helps": helps}

def s3_without_moto():
    sys.modules["moto"] = None  # as if moto were not installed
    from sclayout.testing import s3server
    try:
        s3server.S3Server()
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return "no error"
"""
REPO_PATH = re.compile(r"(?<![\w/.:-])(?:docs|benchmarks|examples|tests|shared)/[\w./-]*")
URL = re.compile(r"https?://[^\s'\"`<>)]+")


def _run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, **kw)
    assert res.returncode == 0, f"{cmd[:4]} failed:\n{res.stdout[-2000:]}\n{res.stderr[-2000:]}"
    return res


def _install_commands(page: str) -> list[list[str]]:
    """The commands of the page's first bash block that installs, as argument lists."""
    text = (ROOT / page).read_text(encoding="utf-8")
    blocks = re.findall(r"^```bash\n(.*?)^```", text, re.MULTILINE | re.DOTALL)
    block = next(b for b in blocks if "pip install" in b)
    commands = []
    for line in block.splitlines():
        words = shlex.split(line, comments=True)
        while "&&" in words:
            at = words.index("&&")
            commands.append(words[:at])
            words = words[at + 1 :]
        if words:
            commands.append(words)
    return commands


def _readme_command(*start: str) -> list[str]:
    """The README's install command whose words begin with ``start``."""
    commands = _install_commands("README.md")
    found = [c for c in commands if all(w.startswith(s) for w, s in zip(c, start, strict=False))]
    assert len(found) == 1, f"README's Install block has no single `{' '.join(start)}`: {commands}"
    return found[0]


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> tuple[Path, dict]:
    tmp = tmp_path_factory.mktemp("wheel")
    dist = tmp / "dist"
    # The README's build and install commands. Its paths are the checkout (".") and
    # "dist" in it: here the checkout and a temporary folder. Added flags keep it offline:
    # the backend of [build-system] is a dev dependency (no isolated build environment),
    # and the dependencies are the test venv's.
    build = _readme_command("pip", "wheel")
    assert build[2:] == ["--no-deps", ".", "-w", "dist"], build
    _run([sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "-q", "--no-deps",
          str(ROOT), "-w", str(dist)])  # fmt: skip
    (wheel,) = dist.glob("sclayout-*.whl")
    env_dir = tmp / "fresh"
    venv.EnvBuilder(system_site_packages=True, with_pip=False).create(env_dir)
    py = env_dir / "bin" / "python"
    install = _readme_command("pip", "install", "dist/")
    assert install[2:] == ["dist/sclayout-*.whl"], install
    _run([str(py), "-m", "pip", "install", "--no-deps", "--no-index", "-q", str(wheel)])
    fresh_site = Path(
        _run(
            [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]
        ).stdout.strip()
    )
    (fresh_site / "_test_venv_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    # cwd: the checkout not on sys.path; nor through a PYTHONPATH the suite was run with
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = _run([str(py), "-c", TEXTS + CHECK], cwd=tmp, env=env).stdout
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


def test_installed_code_names_no_repository_path(installed):
    _, info = installed
    shown = [(where, s) for where, s in info["strings"]] + list(info["helps"].items())
    offenders = [(where, m.group()) for where, s in shown for m in REPO_PATH.finditer(s)]
    assert offenders == [], f"paths that exist only in a clone: {offenders}"
    climbs = info["climbs"]
    assert climbs == [], f"modules that look outside the installed packages: {climbs}"


def test_links_in_help_and_messages_point_at_files_of_the_project(installed):
    _, info = installed
    home = URLS["Homepage"].rstrip("/") + "/"
    shown = [s for _, s in info["strings"]] + list(info["helps"].values())
    ours = [u.rstrip(".,;") for s in shown for u in URL.findall(s) if "sclayout" in u]
    assert any("docs/cli.md" in u for u in ours), "sclayout --help lost its link to the options"
    for url in ours:
        assert url.startswith(home + "blob/main/"), f"{url} is not a file of {home}"
        assert (ROOT / url.removeprefix(home + "blob/main/")).is_file(), f"{url}: no such file"


def test_testing_servers_name_their_extra(installed):
    _, info = installed
    assert "testing" in info["extras"], info["extras"]
    error = info["s3_without_moto"]
    assert error.startswith("InputError: the S3 test server needs moto's server ("), error
    assert error.endswith("is not installed): pip install 'sclayout[testing]'"), error
    assert "\n" not in error


def test_install_commands_match_the_repository():
    """The README clones the project's own URL; its editable install is what make does
    (less the dev extras), and the quickstart's is the README's."""
    clone = _readme_command("git", "clone")
    assert clone[2] == URLS["Homepage"] + ".git", clone
    editable = _readme_command("pip", "install", "-e")
    assert editable == ["pip", "install", "-e", ".[torch]"], editable
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    assert '-m pip install -q --no-compile --no-build-isolation -e ".[torch,dev]"' in makefile
    assert editable in _install_commands("docs/quickstart.md")
