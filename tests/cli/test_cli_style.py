"""One CLI style: the same flags on every command, examples and exit codes in every help,
exit codes 0/1/2/130, lazy imports, bars only on a terminal, one line for a missing extra."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import struct
import subprocess
import sys
import termios
import threading
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from sclayout.cli import main

COMMANDS = sorted(main.commands)
HEAVY = ("numpy", "zarr", "tensorstore", "torch", "dask", "anndata", "scipy", "pandas", "h5py")


def run(*args: object) -> click.testing.Result:
    return CliRunner().invoke(main, [str(a) for a in args])


def one_line_error(r: click.testing.Result, code: int, *parts: str) -> None:
    assert r.exit_code == code, (r.exit_code, r.output, r.stderr)
    err = r.stderr.strip()
    assert "\n" not in err and "Traceback" not in r.output, r.output
    for p in parts:
        assert p in err, err


def test_the_group_has_the_six_commands() -> None:
    assert COMMANDS == ["bench", "calibrate", "convert", "inspect", "recommend", "verify"]


@pytest.mark.parametrize("name", COMMANDS)
def test_every_command_has_quiet_and_json(name: str) -> None:
    opts = {o: p for p in main.commands[name].params for o in p.opts}
    for flag in ("-q", "--quiet", "--json"):
        assert flag in opts and opts[flag].is_flag, (name, flag)
    assert opts["-q"] is opts["--quiet"]


@pytest.mark.parametrize("name", COMMANDS)
def test_quiet_is_parsed_by_every_command(name: str) -> None:
    """The flag reaches the command's parser (a missing one would be 'No such option')."""
    cmd = main.commands[name]
    args = ["x"] * sum(isinstance(p, click.Argument) for p in cmd.params)
    if name == "calibrate":
        args += ["--out", "p.json"]
    with cmd.make_context(name, [*args, "-q"]) as ctx:
        assert ctx.params["quiet"] is True


@pytest.mark.parametrize("name", COMMANDS)
def test_help_shows_examples_and_exit_codes(name: str) -> None:
    r = run(name, "--help")
    assert r.exit_code == 0
    examples = r.output.split("Examples:")[1].split("Exit codes:")[0]
    lines = [ln.strip() for ln in examples.strip().splitlines()]
    assert lines and all(ln.startswith(f"sclayout {name} ") for ln in lines), lines
    codes = r.output.split("Exit codes:")[1]
    for code in ("0", "2", "130"):
        assert f"\n    {code} " in codes, codes
    assert ("\n    1 " in codes) == (name in ("verify", "inspect"))  # the two checks


def test_top_level_help_has_examples_and_lists_every_command() -> None:
    r = run("--help")
    assert r.exit_code == 0 and "Examples:" in r.output and "Exit codes:" in r.output
    for name in COMMANDS:
        assert f"  {name} " in r.output


def test_enumerations_are_choices_from_the_library_lists() -> None:
    from loader.layout import ORDER_KINDS
    from sclayout.convert.codecs import CODECS

    conv = {p.name: p for p in main.commands["convert"].params}
    rec = {p.name: p for p in main.commands["recommend"].params}
    for opt in (conv["order"], rec["orders"]):
        assert isinstance(opt.type, click.Choice) and opt.type.choices == tuple(ORDER_KINDS)
    for opt in (conv["codec"], rec["codecs"]):
        assert isinstance(opt.type, click.Choice) and opt.type.choices == tuple(CODECS)
    assert "[original|shuffled|stratified|grouped]" in run("convert", "--help").output


def test_workers_is_one_integer_wherever_it_is_shown() -> None:
    for name in COMMANDS:
        for p in main.commands[name].params:
            if "--workers" in p.opts and not p.hidden:
                assert isinstance(p.type, click.IntRange) and p.type.min == 0, name


@pytest.mark.parametrize(
    ("args", "parts"),
    [
        (("convert", "nope.h5ad", "out.zarr"), ("error: SRC ",)),
        (("verify", "nope.h5ad", "nope.zarr"), ("error: ",)),
        (("inspect", "nope.zarr"), ("error: ", "nope.zarr")),
        (("recommend", "nope.h5ad", "--profile", "local-nvme"), ("error: ", "nope.h5ad")),
        (("bench", "nope.zarr", "--profile", "local-nvme"), ("error: ", "nope.zarr")),
        (("calibrate", "nope-dir", "--out", "p.json"), ("error: ", "nope-dir")),
        (("convert", "a", "b", "--order", "sorted"), ("'sorted' is not one of",)),
        (("recommend", "a", "--codecs", "blosc-lz4,lzma"), ("'lzma' is not one of",)),
        (("bench", "a", "--workers", "0,2"), ("'0,2' is not a valid integer",)),
        (("inspect", "a", "--no-such-option"), ("No such option",)),
    ],
    ids=lambda v: v[0] if isinstance(v, tuple) and len(v) > 2 else None,
)
def test_bad_input_exits_2(tmp_path: Path, monkeypatch, args, parts) -> None:
    monkeypatch.chdir(tmp_path)
    r = run(*args)
    assert r.exit_code == 2, (r.output, r.stderr)
    assert "Traceback" not in r.output
    for p in parts:
        assert p in r.stderr, r.stderr
    if r.stderr.startswith("error: "):  # a library error: one line
        one_line_error(r, 2)
    assert sorted(os.listdir(tmp_path)) == []  # nothing written


def test_interrupted_convert_exits_130_and_writes_nothing(synth_h5ad, tmp_path, monkeypatch):
    from sclayout.convert.write import Runner

    real = Runner.run
    calls = []

    def interrupted(self, *a, **kw):  # Ctrl-C arrives after the first step did its work
        calls.append(kw.get("desc"))
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(self, *a, **kw)

    monkeypatch.setattr(Runner, "run", interrupted)
    r = run("convert", synth_h5ad, tmp_path / "out.zarr")
    assert len(calls) == 2
    one_line_error(r, 130, "interrupted; nothing written")
    assert r.stdout == ""
    assert os.listdir(tmp_path) == []  # no store, no temporary sibling


def test_interrupted_inspect_exits_130(synth_store, monkeypatch):
    import sclayout.checks.inspect as inspect_mod

    def interrupted(*a, **kw):
        raise KeyboardInterrupt

    monkeypatch.setattr(inspect_mod, "inspect_store", interrupted)
    one_line_error(run("inspect", synth_store), 130, "interrupted")


def test_verify_json_and_exit_codes(synth_h5ad, synth_store) -> None:
    r = run("verify", synth_h5ad, synth_store, "--json", "--quiet")
    assert r.exit_code == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["equal"] is True and out["differences"] == [] and out["n_values"] > 0
    assert out["n_checked"] > 0 and out["skipped"] == []


def test_verify_of_a_changed_source_exits_1_with_json(synth_h5ad, synth_store, tmp_path):
    import anndata as ad

    other = ad.read_h5ad(synth_h5ad)
    other.X = other.X.copy()
    other.X.data[0] += 1
    other.write_h5ad(tmp_path / "changed.h5ad")
    r = run("verify", tmp_path / "changed.h5ad", synth_store, "--json")
    assert r.exit_code == 1, r.stderr
    out = json.loads(r.stdout)
    assert out["equal"] is False and out["n_differences"] >= 1 and out["differences"]


def test_convert_json_describes_the_store(synth_h5ad, tmp_path) -> None:
    from loader.store import open_layout

    r = run("convert", synth_h5ad, tmp_path / "s.zarr", "--block-size", "8", "--json", "-q")
    assert r.exit_code == 0, r.stderr
    out = json.loads(r.stdout)
    m = open_layout(tmp_path / "s.zarr").manifest
    assert (out["n_obs"], out["n_vars"], out["n_blocks"]) == (m.n_obs, m.n_vars, m.n_blocks)
    assert out["block_size"] == 8 and out["order"] == "original"
    assert out["files"] == sum(len(f) for _, _, f in os.walk(tmp_path / "s.zarr"))


@pytest.mark.parametrize(
    ("args", "module", "pip"),
    [
        (("recommend", "{store}", "--profile", "local-nvme", "--plot", "f.png"), "matplotlib",
         "pip install 'sclayout[plot]'"),
        (("bench", "{store}", "--profile", "local-nvme", "--workers", "2"), "torch",
         "pip install 'sclayout[torch]'"),
        (("convert", "{src}", "o.zarr", "--scheduler", "tcp://127.0.0.1:1"), "distributed",
         "pip install 'sclayout[distributed]'"),
    ],
    ids=["matplotlib", "torch", "distributed"],
)  # fmt: skip
def test_a_missing_extra_is_one_line_with_its_pip_command(
    synth_h5ad, synth_store, tmp_path, monkeypatch, args, module, pip
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setitem(sys.modules, module, None)  # import raises ImportError
    args = [a.format(store=synth_store, src=synth_h5ad) for a in args]
    one_line_error(run(*args), 2, f"needs {module}, which is not installed", pip)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize(
    ("flags", "evict", "note"),
    [((), True, False), (("--warm",), False, False), (("--no-evict",), False, True)],
    ids=["cold", "warm", "no-evict"],
)
def test_calibrate_warm_and_its_deprecated_alias(tmp_path, monkeypatch, flags, evict, note):
    import sclayout.cost.calibrate as calibrate_mod
    from sclayout.cost.profile import get_preset

    seen = {}

    def fake(target, **kw):  # the storage is not what this test is about
        seen.update(kw)
        return get_preset("local-nvme")

    monkeypatch.setattr(calibrate_mod, "calibrate", fake)
    (tmp_path / "disk").mkdir()
    r = run("calibrate", tmp_path / "disk", "--out", tmp_path / "p.json", "-q", *flags)
    assert r.exit_code == 0, r.stderr
    assert seen["evict"] is evict and seen["progress"] is False
    assert ("--no-evict is deprecated; use --warm" in r.stderr) is note
    assert r.stdout == "" and (tmp_path / "p.json").is_file()


def test_recommend_workers_is_a_deprecated_alias_of_worker_counts(synth_h5ad) -> None:
    base = ("recommend", synth_h5ad, "--profile", "local-nvme", "--json", "--block-sizes", "8",
            "--fetch-factors", "4", "--codecs", "blosc-lz4", "--orders", "shuffled")  # fmt: skip
    new = run(*base, "--worker-counts", "0")
    old = run(*base, "--workers", "0")
    assert new.exit_code == old.exit_code == 0, old.stderr
    assert json.loads(new.stdout)["pick"] == json.loads(old.stdout)["pick"]
    assert json.loads(new.stdout)["pick"]["workers"] == 0
    assert new.stderr == "" and "deprecated; use --worker-counts" in old.stderr


# -- the real process ----------------------------------------------------------------------


def _python(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, timeout=120, **kw
    )


def test_python_dash_m_sclayout() -> None:
    r = _python("-m", "sclayout", "--help")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("Usage: sclayout ") and "Examples:" in r.stdout
    r = _python("-m", "sclayout", "inspect")
    assert r.returncode == 2 and "Missing argument 'STORE'" in r.stderr


def test_help_imports_no_numpy_zarr_or_torch() -> None:
    """What makes `sclayout --help` quick: the modules it imports, not a timing."""
    r = _python("-X", "importtime", "-m", "sclayout", "--help")
    assert r.returncode == 0, r.stderr
    imported = {ln.split("|")[-1].strip().split(".")[0] for ln in r.stderr.splitlines()}
    assert "click" in imported and "sclayout" in imported  # the probe sees imports
    assert not imported & {*HEAVY, "loader"}, sorted(imported & {*HEAVY, "loader"})
    code = "import sys, sclayout.cli; print(' '.join(sorted(sys.modules)))"
    loaded = {m.split(".")[0] for m in _python("-c", code).stdout.split()}
    assert "sclayout" in loaded and not loaded & set(HEAVY), sorted(loaded & set(HEAVY))


_HELP_OF_EVERY_COMMAND = """
import json, sys
from sclayout.cli import main
out = {}
for name in sorted(main.commands):
    code = main([name, "--help"], standalone_mode=False)
    out[name] = [code, sorted({m.split(".")[0] for m in sys.modules})]
print(json.dumps(out))
"""


def test_every_command_help_imports_no_numpy_zarr_or_torch() -> None:
    """What makes `sclayout COMMAND --help` quick: no library behind the command loads.

    One process runs every command's help in turn, so each later command also sees
    what the earlier ones loaded.
    """
    r = _python("-c", _HELP_OF_EVERY_COMMAND)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout.splitlines()[-1])
    assert sorted(got) == COMMANDS
    for name, (code, loaded) in got.items():
        assert code == 0 and "click" in loaded and "sclayout" in loaded, (name, code)
        heavy = set(loaded) & {*HEAVY, "loader"}
        assert not heavy, (name, sorted(heavy))


def _stderr_of_convert_on_a_terminal(src: Path, dst: Path, *, quiet: bool = False) -> str:
    """What ``sclayout convert`` in a child process writes to its stderr, a terminal."""
    cmd = [sys.executable, "-m", "sclayout", "convert", str(src), str(dst), "--block-size", "8"]
    cmd += ["--quiet"] if quiet else []
    master, slave = pty.openpty()  # stderr is a terminal: isatty() is true in the child
    # 80 columns: on a terminal of width 0 tqdm draws nothing
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))
    chunks: list[bytes] = []

    def drain() -> None:  # read while it runs: a full pty buffer would block the child
        while True:
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: the child closed the terminal
                return
            if not data:
                return
            chunks.append(data)

    reader = threading.Thread(target=drain)
    reader.start()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=slave)
    os.close(slave)
    try:
        assert proc.wait(timeout=300) == 0
    finally:
        reader.join(timeout=30)
        os.close(master)
    return b"".join(chunks).decode(errors="replace")


def test_progress_bars_only_on_a_terminal(synth_h5ad, tmp_path, run_cli) -> None:
    from concurrent.futures import ThreadPoolExecutor

    on_a_terminal = _stderr_of_convert_on_a_terminal
    with ThreadPoolExecutor(2) as pool:  # two independent child processes
        futures = [
            pool.submit(on_a_terminal, synth_h5ad, tmp_path / f"{k}.zarr", quiet=k == "c")
            for k in "ac"
        ]
        # stderr not a terminal (captured by click's runner, as a pipe would be): this
        # process, while the children run
        off_tty = run_cli("convert", synth_h5ad, tmp_path / "b.zarr", "--block-size", "8")
    on_tty, quiet = (f.result() for f in futures)
    assert "copy X:" in on_tty and "task" in on_tty, on_tty  # the probe sees bars
    assert off_tty.exit_code == 0 and off_tty.stderr == ""
    assert quiet == ""
