"""examples/train_minimal.py and examples/lightning.py in their smoke modes, as a user
runs them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def smoke(name: str, timeout: float) -> list[str]:
    """stdout lines of ``examples/NAME --smoke`` (which must succeed)."""
    res = subprocess.run(
        [sys.executable, str(EXAMPLES / name), "--smoke"],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    return res.stdout.splitlines()


@pytest.mark.slow
def test_train_minimal_smoke_resumes_exactly():
    lines = smoke("train_minimal.py", timeout=300)
    assert [ln.split(":")[0] for ln in lines[:2]] == ["epoch 0", "epoch 1"]
    assert lines[-1] == "resumed run ends with the uninterrupted run's loss: True"


@pytest.mark.slow
def test_lightning_epochs_differ_rows_once_and_resume_exact():
    """A real pytorch_lightning.Trainer, 2 spawned workers, 2 epochs, then a resume
    from a mid-epoch Lightning checkpoint in a new Trainer."""
    assert smoke("lightning.py", timeout=500) == [
        "epoch 0: 600 rows, each once: True",
        "epoch 1: 600 rows, each once: True",
        "the epochs' orders differ: True",
        "resumed from a mid-epoch checkpoint, same steps as the uninterrupted run: True",
    ]
