"""Storage profiles: JSON round trip, version check, presets, clear errors."""

from __future__ import annotations

import json

import pytest

from loader.errors import FormatVersionError, SpecError
from sclayout.cost.profile import (
    PROFILE_VERSION,
    Profile,
    get_preset,
    list_presets,
    load_profile,
    resolve_profile,
)


def test_round_trip_through_json(tmp_path, flat_profile):
    p = flat_profile(source="hand-made", extra={"k": 1})
    p.save(tmp_path / "p.json")
    q = load_profile(tmp_path / "p.json")
    assert q == p
    assert json.loads((tmp_path / "p.json").read_text())["version"] == PROFILE_VERSION


@pytest.mark.parametrize("name", list_presets())
def test_every_preset_loads_and_says_where_its_figures_come_from(name):
    p = get_preset(name)
    assert p.name == name
    assert len(p.source) > 40
    assert {"blosc-lz4", "blosc-zstd", "zstd", "gzip", "none"} <= set(p.codecs)
    assert Profile.from_dict(p.to_dict()) == p


def test_the_issue_presets_ship():
    assert {"local-nvme", "network-disk", "http-object-store"} <= set(list_presets())


def test_version_1_reads_without_the_worker_figures(tmp_path, flat_profile):
    d = flat_profile().to_dict()
    d["version"] = 1
    del d["worker_cores"], d["worker_cpu_s_per_cell"]
    (tmp_path / "p.json").write_text(json.dumps(d))
    p = load_profile(tmp_path / "p.json")
    assert p.version == PROFILE_VERSION and p.worker_cores == p.worker_cpu_s_per_cell == 0.0


def test_version_2_reads_without_the_cpu_scale(tmp_path, flat_profile):
    d = flat_profile(cpu_scale=((1e6, 1.5),)).to_dict()
    assert d["cpu_scale"] == [[1e6, 1.5]]
    d["version"] = 2
    del d["cpu_scale"]
    (tmp_path / "p.json").write_text(json.dumps(d))
    p = load_profile(tmp_path / "p.json")
    assert p.cpu_scale == () and p.cpu_scale_at(1e9) == 1.0


def test_cpu_scale_interpolates_on_the_log_of_the_working_set(flat_profile):
    p = flat_profile(cpu_scale=((4e6, 2.0), (1e6, 1.0)))  # sorted on reading
    assert p.cpu_scale == ((1e6, 1.0), (4e6, 2.0))
    assert p.cpu_scale_at(1e5) == 1.0  # below the measured points: the first's
    assert p.cpu_scale_at(2e6) == pytest.approx(1.5)  # halfway on the log scale
    assert p.cpu_scale_at(1e9) == 2.0  # beyond: the last's
    with pytest.raises(SpecError, match="cpu_scale"):
        flat_profile(cpu_scale=((1e6, 0.0),))


def test_newer_version_is_refused_with_upgrade_hint(tmp_path, flat_profile):
    d = flat_profile().to_dict()
    d["version"] = PROFILE_VERSION + 1
    (tmp_path / "p.json").write_text(json.dumps(d))
    with pytest.raises(
        FormatVersionError, match=rf"version {PROFILE_VERSION + 1} is not readable.*pip install -U"
    ):
        load_profile(tmp_path / "p.json")


def test_unknown_preset_lists_known_ones():
    with pytest.raises(SpecError) as e:
        get_preset("floppy")
    msg = str(e.value)
    assert "'floppy'" in msg
    for n in list_presets():
        assert n in msg


@pytest.mark.parametrize(
    ("content", "match"),
    [
        (None, "cannot read profile .*No such file"),
        ("{not json", "is not valid JSON"),
        ('{"format": "something-else"}', "is not a storage profile"),
        ('{"format": "sclayout-profile", "version": 1, "name": "x"}', "incomplete or malformed"),
    ],
    ids=["missing", "not-json", "not-a-profile", "incomplete"],
)
def test_unreadable_profiles_give_clear_errors(tmp_path, content, match):
    path = tmp_path / "p.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(SpecError, match=match):
        load_profile(path)


def test_invalid_figures_are_refused(flat_profile):
    with pytest.raises(SpecError, match=r"latency_s=-1\.0: must be a positive number"):
        flat_profile(latency_s=-1.0)
    with pytest.raises(SpecError, match="kind='tape'"):
        flat_profile(kind="tape")


def test_concurrency_curve_interpolates_log_linearly_and_is_flat_beyond(flat_profile):
    p = flat_profile(concurrency=((1, 100.0), (4, 300.0), (64, 500.0)))
    assert p.requests_per_s(1) == 100.0
    assert p.requests_per_s(2) == pytest.approx(200.0)  # halfway in log between 1 and 4
    assert p.requests_per_s(16) == pytest.approx(400.0)  # halfway in log between 4 and 64
    assert p.requests_per_s(1000) == 500.0


def test_resolve_profile_takes_files_and_presets(tmp_path, flat_profile):
    flat_profile().save(tmp_path / "p.json")
    assert resolve_profile(tmp_path / "p.json").name == "flat"
    assert resolve_profile("local-nvme").name == "local-nvme"


def test_unknown_codec_names_the_measured_ones(flat_profile):
    with pytest.raises(
        SpecError, match="codec='lzf': not in profile 'flat'; known: blosc-lz4, none"
    ):
        flat_profile().codec("lzf")
    assert flat_profile().codec("blosc-lz4-bitshuffle").ratio == 4.0


def test_a_version_3_profile_reads_with_the_rows_figure_0(tmp_path, flat_profile):
    """Version 3 had no ``assemble_s_per_nnz`` (its cost was inside the output
    figures): such a profile still loads, with that figure 0, and a new one round-trips it."""
    d = flat_profile(assemble_s_per_nnz=2e-9).to_dict()
    assert d["version"] == PROFILE_VERSION == 4
    (tmp_path / "new.json").write_text(json.dumps(d))
    assert load_profile(tmp_path / "new.json").assemble_s_per_nnz == 2e-9
    del d["assemble_s_per_nnz"]
    d["version"] = 3
    (tmp_path / "old.json").write_text(json.dumps(d))
    assert load_profile(tmp_path / "old.json").assemble_s_per_nnz == 0.0
