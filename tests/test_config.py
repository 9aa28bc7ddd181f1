"""Config loading: defaults, explicit files, and errors that name file, key and line."""

from __future__ import annotations

from pathlib import Path

import pytest

from nvplug import config


def test_missing_default_file_means_built_in_defaults(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(config, "DEFAULT_PATH", tmp_path / "absent.yaml")
    assert config.load(None) == config.Config()


def test_missing_explicit_file_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(config.ConfigError, match=r"absent\.yaml: no such config file"):
        config.load(tmp_path / "absent.yaml")


def test_nvidia_v1_file_loads(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("version: v1\nflags:\n  migStrategy: none\nsharing:\n  timeSlicing: {}\n")
    assert config.load(path).source == str(path)


def test_unknown_key_names_file_key_and_line(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("version: v1\n\nflagz: {}\n")
    with pytest.raises(config.ConfigError, match=r"c\.yaml, line 3: flagz: unknown key"):
        config.load(path)


def test_bad_version_and_bad_yaml(tmp_path: Path) -> None:
    with pytest.raises(config.ConfigError, match="line 1: version: 'v2' is not supported"):
        config.parse("version: v2\n", "x")
    with pytest.raises(config.ConfigError, match="not valid YAML"):
        config.parse("a: [\n", "x")
    with pytest.raises(config.ConfigError, match="top level must be a mapping"):
        config.parse("- a\n", "x")


def test_huge_file_is_refused_unparsed(tmp_path: Path) -> None:
    path = tmp_path / "big.yaml"
    path.write_bytes(b"#" * (config.MAX_BYTES + 10))
    with pytest.raises(config.ConfigError, match="larger than"):
        config.load(path)


def test_health_section(tmp_path: Path) -> None:
    text = """
nvplug:
  health:
    ignoreXids: [48, 0x4F]
    fatalXids: [13]
    reprobeInitialSeconds: 0.5
    reprobeMaxSeconds: 8
"""
    health = config.parse(text, "c.yaml").health
    assert health == config.HealthConfig(frozenset({48, 79}), frozenset({13}), 0.5, 8.0)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("nvplug:\n  health:\n    ignoreXid: [1]\n", r"line 3: nvplug\.health\.ignoreXid: unknown key"),
        ("nvplug:\n  health:\n    ignoreXids: 13\n", r"line 3: nvplug\.health\.ignoreXids: must be a list"),
        ("nvplug:\n  health:\n    fatalXids: [x]\n", r"line 3: nvplug\.health\.fatalXids: must be an XID number"),
        ("nvplug:\n  health:\n    fatalXids: [-4]\n", r"line 3: nvplug\.health\.fatalXids: -4 is not an XID"),
        ("nvplug:\n  health:\n    reprobeMaxSeconds: 0\n", r"reprobeMaxSeconds: must be positive"),
        ("nvplug:\n  health:\n    reprobeMaxSeconds: '5'\n", r"reprobeMaxSeconds: must be a number"),
        ("nvplug:\n  health:\n    ignoreXids: [79]\n    fatalXids: [79]\n", r"\[79\] are both"),
        ("nvplug:\n  health:\n    reprobeInitialSeconds: 9\n    reprobeMaxSeconds: 3\n", "below"),
        ("nvplug:\n  health: []\n", r"line 2: nvplug\.health must be a mapping"),
        ("nvplug:\n  bogus: 1\n", r"line 2: nvplug\.bogus: unknown key"),
        ("version: v1\nversion: v1\n", r"line 2: version: given twice"),
    ],
)
def test_health_section_errors_name_key_and_line(text: str, message: str) -> None:
    with pytest.raises(config.ConfigError, match=message):
        config.parse(text, "c.yaml")
