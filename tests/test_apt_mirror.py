"""nspawn's Debian mirror: $NVPLUG_DEBIAN_MIRROR, else the host's apt sources.

Every apt tree here is made up under tmp_path (``<tmp>/etc/apt``, with an
os-release beside it where a test needs one); the host's own is never read.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
from support import nspawn
from support.nspawn import MIRROR_ENV, AptSource, Mirror, MirrorError, apt_sources, debian_mirror

MAIN = "http://mirror.example/debian"
OTHER = "https://other.example/debian/"
SECURITY = "http://security.example/debian-security"


def apt_tree(tmp_path: Path, files: dict[str, str], os_release: str | None = None) -> Path:
    """``<tmp>/etc/apt`` holding `files` (paths relative to it); returns that directory."""
    root = tmp_path / "etc" / "apt"
    root.mkdir(parents=True)
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    if os_release is not None:
        (tmp_path / "etc" / "os-release").write_text(os_release)
    return root


def mirror(root: Path) -> Mirror:
    return debian_mirror(root, environ={})


# -- the one-line format ---------------------------------------------------------


def test_one_line_with_options_block(tmp_path: Path) -> None:
    root = apt_tree(
        tmp_path,
        {
            "sources.list": (
                "# installed from a disc, then switched to the network\n"
                "deb cdrom:[Debian GNU/Linux 12.5.0 _Bookworm_ - Official amd64 DVD]/ bookworm main\n"
                "deb file:///srv/local-repo bookworm main\n"
                "\n"
                f"deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg arch=amd64] {MAIN} bookworm main"
                " contrib non-free-firmware  # the mirror\n"
                f"deb [arch=amd64]{OTHER} bookworm main\n"
            )
        },
    )
    sources = apt_sources(root)
    assert [s.uri for s in sources] == [
        "cdrom:[Debian",  # apt splits it the same way; it is skipped as not downloadable
        "file:///srv/local-repo",
        MAIN,
        OTHER,
    ]
    assert sources[2] == AptSource(
        MAIN, "bookworm", ("main", "contrib", "non-free-firmware"), f"{root / 'sources.list'}:5"
    )
    assert mirror(root) == Mirror(MAIN, f"{root / 'sources.list'}:5")


def test_option_block_with_spaces_inside(tmp_path: Path) -> None:
    root = apt_tree(tmp_path, {"sources.list.d/a.list": f"deb [ arch=amd64,arm64 trusted=yes ] {MAIN} bookworm main\n"})
    assert mirror(root).uri == MAIN


# -- deb822 ----------------------------------------------------------------------------


DEB822 = f"""\
# Disabled: must not be chosen although it comes first.
Types: deb
URIs: http://disabled.example/debian
Suites: bookworm
Components: main
Enabled: no

Types: deb deb-src
URIs: {MAIN}
 {OTHER}
Suites: bookworm bookworm-updates
Components: main non-free-firmware
Signed-By:
 -----BEGIN PGP PUBLIC KEY BLOCK-----
 .
 mQINBGPL0BUBEADmW5NdOOHwPIJlgPu6JDcKw/NwQ2tj3tTG1bOpkxcgTOhcqJ7T
 -----END PGP PUBLIC KEY BLOCK-----

Types: deb
URIs: {SECURITY}
Suites: bookworm-security
Components: main
"""


def test_deb822_stanzas_and_enabled_no(tmp_path: Path) -> None:
    root = apt_tree(tmp_path, {"sources.list.d/debian.sources": DEB822})
    path = root / "sources.list.d" / "debian.sources"
    sources = apt_sources(root)
    # The disabled stanza is gone; the next expands to every URI and suite, in order.
    assert [(s.uri, s.suite, s.where) for s in sources] == [
        (MAIN, "bookworm", f"{path}:8"),
        (MAIN, "bookworm-updates", f"{path}:8"),
        (OTHER, "bookworm", f"{path}:8"),
        (OTHER, "bookworm-updates", f"{path}:8"),
        (SECURITY, "bookworm-security", f"{path}:19"),
    ]
    assert sources[0].components == ("main", "non-free-firmware")
    assert mirror(root) == Mirror(MAIN, f"{path}:8")


def test_deb822_field_names_and_enabled_are_case_insensitive(tmp_path: Path) -> None:
    text = (
        "types: deb\nuris: http://off.example/debian\nsuites: bookworm\ncomponents: main\nENABLED: No\n\n"
        f"TYPES: deb\nUris: {MAIN}\nSUITES: stable\nComponents: main\n"
    )
    root = apt_tree(tmp_path, {"sources.list.d/x.sources": text})
    assert mirror(root).uri == MAIN


def test_sources_list_first_then_parts_by_name(tmp_path: Path) -> None:
    root = apt_tree(
        tmp_path,
        {
            "sources.list": "# nothing here any more; see sources.list.d\n",
            "sources.list.d/b.list": "deb http://b.example/debian bookworm main\n",
            "sources.list.d/a.sources": (
                "Types: deb\nURIs: http://a.example/debian\nSuites: bookworm\nComponents: main\n"
            ),
            # Not read by apt: other suffixes and names with other characters.
            "sources.list.d/0.list.save": "deb http://save.example/debian bookworm main\n",
            "sources.list.d/0~.list": "deb http://backup.example/debian bookworm main\n",
            "sources.list.d/0.sources.disabled": "Types: deb\nURIs: http://x.example/debian\nSuites: bookworm\n",
        },
    )
    assert [s.uri for s in apt_sources(root)] == ["http://a.example/debian", "http://b.example/debian"]
    assert mirror(root).uri == "http://a.example/debian"


def test_missing_files_are_no_error(tmp_path: Path) -> None:
    assert apt_sources(tmp_path / "nowhere") == []
    root = apt_tree(tmp_path, {"sources.list.d/only.list": f"deb {MAIN} bookworm main\n"})
    assert mirror(root).uri == MAIN  # no sources.list


# -- what is chosen --------------------------------------------------------------------


def test_deb_src_is_ignored(tmp_path: Path) -> None:
    root = apt_tree(
        tmp_path,
        {
            "sources.list": f"deb-src http://src.example/debian bookworm main\ndeb {MAIN} bookworm main\n",
            "sources.list.d/src.sources": (
                "Types: deb-src\nURIs: http://src2.example/debian\nSuites: bookworm\nComponents: main\n"
            ),
        },
    )
    assert [s.uri for s in apt_sources(root)] == [MAIN]
    assert mirror(root).uri == MAIN


def test_security_and_updates_are_not_chosen_over_the_release(tmp_path: Path) -> None:
    root = apt_tree(
        tmp_path,
        {
            "sources.list": (
                f"deb {SECURITY} bookworm-security main\n"
                "deb http://updates.example/debian bookworm-updates main\n"
                "deb http://backports.example/debian bookworm-backports main\n"
                f"deb {MAIN} bookworm main\n"
            )
        },
    )
    assert mirror(root) == Mirror(MAIN, f"{root / 'sources.list'}:4")


def test_release_of_the_suite_before_aliases_and_later_releases(tmp_path: Path) -> None:
    root = apt_tree(
        tmp_path,
        {
            "sources.list": (
                f"deb {OTHER} trixie main\ndeb http://stable.example/debian stable main\ndeb {MAIN} bookworm main\n"
            )
        },
    )
    assert mirror(root).uri == MAIN
    root = apt_tree(
        tmp_path / "later", {"sources.list": f"deb {OTHER} trixie main\ndeb {SECURITY} trixie-security main\n"}
    )
    assert mirror(root).uri == OTHER  # a trixie mirror carries bookworm too


def test_updates_pocket_is_a_last_resort_and_security_never(tmp_path: Path) -> None:
    root = apt_tree(
        tmp_path,
        {"sources.list": f"deb {SECURITY} bookworm-security main\ndeb {MAIN} bookworm-updates main\n"},
    )
    assert mirror(root).uri == MAIN  # -updates lives in the same archive as bookworm
    root = apt_tree(tmp_path / "security", {"sources.list": f"deb {SECURITY} bookworm-security main\n"})
    with pytest.raises(MirrorError, match=MIRROR_ENV):
        mirror(root)


def test_third_party_repositories_are_not_chosen(tmp_path: Path) -> None:
    root = apt_tree(
        tmp_path,
        {
            "sources.list.d/00-tools.list": (
                "deb [signed-by=/usr/share/keyrings/tools.gpg] https://tools.example/linux/debian bookworm stable\n"
                "deb https://apt.example/node nodistro main\n"
                "deb https://vendor.example/apt bookworm main\n"
            ),
            "sources.list.d/debian.sources": f"Types: deb\nURIs: {MAIN}\nSuites: bookworm\nComponents: main\n",
        },
    )
    # No main; not a Debian suite; bookworm main but not at .../debian, which the archive is.
    assert mirror(root).uri == MAIN


def test_only_bookworm_main_elsewhere_still_works(tmp_path: Path) -> None:
    # A mirror at an unusual path is taken when nothing better is there.
    root = apt_tree(tmp_path, {"sources.list": "deb http://cache.example:3142/archive bookworm main\n"})
    assert mirror(root).uri == "http://cache.example:3142/archive"


# -- the environment override ---------------------------------------------------------


def test_env_override_wins(tmp_path: Path) -> None:
    root = apt_tree(tmp_path, {"sources.list": f"deb {MAIN} bookworm main\n"})
    override = "http://override.example/debian"
    assert debian_mirror(root, environ={MIRROR_ENV: override}) == Mirror(override, f"${MIRROR_ENV}")
    # Even where the apt sources give nothing.
    assert debian_mirror(tmp_path / "nowhere", environ={MIRROR_ENV: override}).uri == override
    # Empty means unset.
    assert debian_mirror(root, environ={MIRROR_ENV: "  "}).uri == MAIN


def test_env_override_from_the_process_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(MIRROR_ENV, "http://override.example/debian")
    assert debian_mirror(tmp_path / "nowhere").uri == "http://override.example/debian"


def test_ensure_image_runs_debootstrap_with_the_chosen_mirror(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(MIRROR_ENV, "http://override.example/debian")
    monkeypatch.setattr(shutil, "which", lambda tool: f"/usr/sbin/{tool}")
    calls: list[list[str]] = []

    def fake_run(argv: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
        calls.append(argv)
        return subprocess.CompletedProcess(argv, 1, "", "E: Failed getting release file\n")

    monkeypatch.setattr(subprocess, "run", fake_run)
    with pytest.raises(nspawn.ContainerError, match=r"override\.example.*\$NVPLUG_DEBIAN_MIRROR"):
        nspawn.ensure_image(tmp_path / "cache", log=lambda line: None)
    assert calls and calls[0][0] == "debootstrap" and calls[0][-1] == "http://override.example/debian"


# -- nothing usable -------------------------------------------------------------------


def test_nothing_usable_is_a_clear_error(tmp_path: Path) -> None:
    root = apt_tree(
        tmp_path,
        {"sources.list": "deb cdrom:[Debian 12]/ bookworm main\ndeb file:///srv/repo bookworm main\n"},
    )
    with pytest.raises(MirrorError) as err:
        mirror(root)
    message = str(err.value)
    assert f"Set {MIRROR_ENV}" in message
    assert f"{root / 'sources.list'}:2" in message  # says what it saw, and where


def test_no_sources_at_all_is_a_clear_error(tmp_path: Path) -> None:
    root = apt_tree(tmp_path, {})
    with pytest.raises(MirrorError, match=rf"no enabled deb entries.*Set {MIRROR_ENV}"):
        mirror(root)


def test_ubuntu_host_is_named(tmp_path: Path) -> None:
    root = apt_tree(
        tmp_path,
        {
            "sources.list.d/ubuntu.sources": (
                "Types: deb\nURIs: http://archive.example/ubuntu/\n"
                "Suites: noble noble-updates noble-backports\nComponents: main universe\n\n"
                "Types: deb\nURIs: http://security.example/ubuntu/\nSuites: noble-security\nComponents: main\n"
            )
        },
        os_release='NAME="Ubuntu"\nID=ubuntu\nID_LIKE=debian\n',
    )
    with pytest.raises(MirrorError, match=rf"Ubuntu-based.*Set {MIRROR_ENV}"):
        mirror(root)


# -- malformed sources: the error names file and line -------------------------------------


@pytest.mark.parametrize(
    ("name", "text", "line", "what"),
    [
        ("sources.list", "\ndeb-foo http://x.example/debian bookworm main\n", 2, "unknown type"),
        ("sources.list", f"deb [arch=amd64 {MAIN} bookworm main\n", 1, "not closed"),
        ("sources.list", f"deb {MAIN}\n", 1, "needs a URI and a suite"),
        ("sources.list", f"[arch=amd64] deb {MAIN} bookworm main\n", 1, "no type"),
        ("sources.list.d/x.sources", "Types: deb\nSuites: bookworm\n", 1, "no URIs"),
        ("sources.list.d/x.sources", "# c\n\nTypes: rpm\nURIs: x\nSuites: y\n", 3, "unknown type rpm"),
        ("sources.list.d/x.sources", "Types: deb\nthis is not a field\n", 2, "not a 'Field: value' line"),
        ("sources.list.d/x.sources", " continued\n", 1, "continuation line"),
    ],
)
def test_malformed_sources_name_file_and_line(tmp_path: Path, name: str, text: str, line: int, what: str) -> None:
    root = apt_tree(tmp_path, {name: text})
    with pytest.raises(MirrorError) as err:
        apt_sources(root)
    assert str(err.value).startswith(f"{root / name}:{line}: ")
    assert what in str(err.value)
