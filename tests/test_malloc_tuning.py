"""The daemon keeps the memory a scrape frees: half a megabyte blocks, built and freed over and over, cost no
page fault once the first is made (in a child: the setting is the whole process's)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

CHILD = textwrap.dedent(
    """
    import json, resource, sys
    from nvplug.base.malloc_tuning import keep_freed_memory
    kept = keep_freed_memory() if sys.argv[1] == "kept" else None
    lines = ["x" * 150 + "\\n"] * 3300  # a busy scrape's text: half a megabyte
    def scrape():
        text = "".join(lines)
        body = text.encode()
        return len(b"HTTP/1.1 200 OK\\r\\n\\r\\n" + body)
    scrape()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(50):
        scrape()
    print(json.dumps({"kept": kept, "faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before}))
    """
)


def faults(mode: str) -> dict[str, object]:
    out = subprocess.run([sys.executable, "-c", CHILD, mode], capture_output=True, text=True, timeout=60, check=True)
    got: dict[str, object] = json.loads(out.stdout)
    return got


def test_a_scrape_s_freed_blocks_are_kept_for_the_next() -> None:
    kept, default = faults("kept"), faults("default")
    assert kept["kept"] is True  # glibc, as on every machine this runs on
    # 50 scrapes of three half-megabyte blocks: glibc's default maps most of them afresh, each page a fault.
    assert isinstance(default["faults"], int) and default["faults"] > 1000
    assert isinstance(kept["faults"], int) and kept["faults"] < 100
