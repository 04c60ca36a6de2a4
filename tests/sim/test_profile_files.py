"""Profile files: saved bare or with their provenance (``loraplane bench profile --out``), fields added since a
file was saved take their defaults, and the packaged measured profiles load by name."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from loraplane.sim.profile import LARGE_GPU, PROFILES, ProfileError, load_profile


def test_saved_profiles_load_bare_wrapped_and_without_newer_fields(tmp_path: Path) -> None:
    measured = replace(LARGE_GPU, name="measured", request_overhead_ms=7.5)
    wrapped = tmp_path / "wrapped.json"
    wrapped.write_text(json.dumps({"profile": measured.to_dict(), "measurement": {"note": "how"}}))
    assert load_profile(str(wrapped)) == measured
    old = LARGE_GPU.to_dict()
    del old["request_overhead_ms"]  # a file saved before the field existed
    (tmp_path / "old.json").write_text(json.dumps(old))
    assert load_profile(str(tmp_path / "old.json")) == LARGE_GPU and LARGE_GPU.request_overhead_ms == 0.0
    for bad in ({**old, "surprise": 1}, {k: v for k, v in old.items() if k != "decode_base_ms"}):
        (tmp_path / "bad.json").write_text(json.dumps(bad))
        with pytest.raises(ProfileError, match="expected keys"):
            load_profile(str(tmp_path / "bad.json"))


def test_packaged_profiles_load_by_name() -> None:
    packaged = sorted(Path(__file__).resolve().parents[2].joinpath("sim", "data").glob("*.profile.json"))
    for path in packaged:
        data = json.loads(path.read_text())
        profile = load_profile(data["profile"]["name"])
        assert profile is PROFILES[profile.name] and profile.to_dict() == data["profile"]
        assert data["measurement"]["note"]
