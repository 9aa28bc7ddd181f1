"""The suite does not depend on the machine's own CDI directories. On a GPU node that runs nvplug as a
service, /var/run/cdi holds nvplug's spec; a simulated node must see only its own files, so the
doctor, daemon and demo tests pass with such a spec there, and the machine's directory is left
exactly as it was found."""

from __future__ import annotations

import fcntl
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from nvplug.testing import fakenvml_library

MACHINE_DIR = Path("/var/run/cdi")
SPEC = MACHINE_DIR / "k8s.device-plugin.nvidia.com-gpu.json"
REPO = Path(__file__).resolve().parent.parent
# The machine's directory is one for every suite on the machine: a second run of the suite, beside
# this one, waits for it here, so neither finds the other's spec (or removes it from under it).
LOCK = Path(tempfile.gettempdir()) / "nvplug-tests-machine-cdi.lock"
# The tests that read the machine's directories before the simulated node had its own.
TESTS = (
    "tests/test_doctor.py::test_all_pass_on_a_healthy_node",
    "tests/test_doctor.py::test_cdi_names_that_do_not_resolve_and_a_conflicting_spec",
    "tests/test_doctor.py::test_daemon_with_an_unhealthy_gpu",
    "tests/test_doctor.py::test_end_to_end_with_the_daemon",
    "tests/test_devices.py::test_end_to_end_with_the_daemon",
    "tests/test_cdi_e2e.py::test_a_foreign_spec_of_our_kind_is_reported",
    "tests/test_demo.py",
)

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0, reason="writes the machine's /var/run/cdi (and leaves it as it found it): needs root"
)


def snapshot(directory: Path) -> dict[str, bytes] | None:
    """What the directory holds, file by file; None if it does not exist."""
    if not directory.is_dir():
        return None
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir()) if p.is_file()}


@pytest.fixture
def foreign_spec() -> Iterator[Path]:
    """nvplug's spec in the machine's /var/run/cdi, naming the simulated node's own GPUs; one that is
    there already (a real nvplug's) is used as it is."""
    with LOCK.open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield from _foreign_spec()


def _foreign_spec() -> Iterator[Path]:
    before = snapshot(MACHINE_DIR)
    made_dir = before is None
    made_spec = not SPEC.exists()
    if made_spec:
        uuids = re.findall(r"uuid=(GPU-[0-9a-f-]+)", fakenvml_library.DEFAULT_SCENARIO.read_text())
        devices = ",".join(f'{{"name":"{u}","containerEdits":{{"deviceNodes":[{{"path":"/dev/nvidia0"}}]}}}}'
                           for u in uuids)  # fmt: skip
        MACHINE_DIR.mkdir(parents=True, exist_ok=True)
        SPEC.write_text(f'{{"cdiVersion":"0.5.0","kind":"k8s.device-plugin.nvidia.com/gpu","devices":[{devices}]}}')
    try:
        yield SPEC
    finally:
        if made_spec:
            SPEC.unlink()
        if made_dir:
            MACHINE_DIR.rmdir()
        assert snapshot(MACHINE_DIR) == before, f"{MACHINE_DIR} is not as it was found"


def test_the_simulated_node_sees_only_its_own_cdi_dirs(foreign_spec: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *TESTS],
        cwd=REPO, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    summary = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else ""
    print(f"with {foreign_spec} present: {summary}")
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    assert "failed" not in summary and "passed" in summary
