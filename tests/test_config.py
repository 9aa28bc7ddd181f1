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
    with pytest.raises(config.ConfigError, match=r"c\.yaml, line 3: unknown key 'flagz'"):
        config.load(path)


def test_bad_version_and_bad_yaml(tmp_path: Path) -> None:
    with pytest.raises(config.ConfigError, match="version 'v2' is not supported"):
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
