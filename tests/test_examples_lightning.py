"""examples/lightning.py in its smoke mode: a real ``pytorch_lightning.Trainer`` with 2
spawned workers for 2 epochs, then a resume from a mid-epoch Lightning checkpoint."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "lightning.py"


@pytest.mark.slow
def test_lightning_epochs_differ_rows_once_and_resume_exact():
    res = subprocess.run(
        [sys.executable, str(EXAMPLE), "--smoke"], capture_output=True, text=True, timeout=500
    )
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    lines = res.stdout.splitlines()
    assert lines == [
        "epoch 0: 600 rows, each once: True",
        "epoch 1: 600 rows, each once: True",
        "the epochs' orders differ: True",
        "resumed from a mid-epoch checkpoint, same steps as the uninterrupted run: True",
    ]
