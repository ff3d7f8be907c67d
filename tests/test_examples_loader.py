"""examples/train_minimal.py in its smoke mode, as a user runs it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "train_minimal.py"


@pytest.mark.slow
def test_train_minimal_smoke_resumes_exactly():
    res = subprocess.run(
        [sys.executable, str(EXAMPLE), "--smoke"], capture_output=True, text=True, timeout=300
    )
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    lines = res.stdout.splitlines()
    assert [ln.split(":")[0] for ln in lines[:2]] == ["epoch 0", "epoch 1"]
    assert lines[-1] == "resumed run ends with the uninterrupted run's loss: True"
