"""The package rule: ``loader`` is the bottom layer and stays light for training."""

from __future__ import annotations

import json
import subprocess
import sys


def test_importing_loader_loads_no_toolkit_modules():
    code = (
        "import sys, json, loader; "
        "print(json.dumps(sorted(m for m in sys.modules "
        "if m.split('.')[0] in {'sclayout', 'dask', 'click', 'distributed'})))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == []


def test_loader_sources_do_not_import_sclayout():
    from pathlib import Path

    import loader

    offenders = []
    for path in Path(loader.__file__).parent.rglob("*.py"):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            s = line.strip()
            if s.startswith(("import sclayout", "from sclayout", "import dask", "from dask")):
                offenders.append(f"{path.name}:{n}: {s}")
    assert offenders == []


def test_one_version_for_both_packages():
    from importlib.metadata import version

    import loader
    import sclayout

    assert sclayout.__version__ == loader.__version__ == version("sclayout")


def test_tests_share_helpers_through_fixtures_only():
    """Tests mirror the packages and reach shared helpers through conftest.py fixtures:
    no test imports a helper module by name."""
    import re
    from pathlib import Path

    tests = Path(__file__).parent
    by_name = re.compile(r"^\s*(from|import)\s+(tests\b|conftest\b|_(?!_))")
    offenders = [
        f"{path.relative_to(tests)}:{n}: {line.strip()}"
        for path in sorted(tests.rglob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if by_name.match(line)
    ]
    assert offenders == []
    assert {p.name for p in tests.iterdir() if p.is_dir() and p.name != "__pycache__"} >= {
        "loader",
        "convert",
        "cost",
        "cli",
    }
