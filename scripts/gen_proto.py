#!/usr/bin/env python3
"""Regenerate the committed Python code for the kubelet APIs: device plugin, PodResources, plugin
registration and DRA (v1beta1, v1).

python scripts/gen_proto.py            # rewrite nvplug/protos/*_pb2*
python scripts/gen_proto.py --check    # exit 1 if the committed code is stale
"""

from __future__ import annotations

import argparse
import filecmp
import re
import sys
import tempfile
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
API = ROOT / "nvplug" / "protos"
PROTOS = ("deviceplugin", "podresources", "pluginregistration", "dra_v1beta1", "dra_v1", "dra_health_v1alpha1")
OUTPUTS = tuple(f"{name}{suffix}" for name in PROTOS for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py"))


def generate(out: Path) -> None:
    for name in PROTOS:
        proto = API / f"{name}.proto"
        args = ["protoc", f"-I{API}", f"--python_out={out}", f"--pyi_out={out}", f"--grpc_python_out={out}", str(proto)]
        if protoc.main(args) != 0:
            raise SystemExit(f"protoc failed on {proto}")
        # grpc_tools emits a top-level import; the package needs a relative one.
        grpc_py = out / f"{name}_pb2_grpc.py"
        text = grpc_py.read_text()
        text = re.sub(rf"^import {name}_pb2 as", f"from . import {name}_pb2 as", text, flags=re.M)
        grpc_py.write_text(text)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="compare instead of writing")
    opts = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        generate(out)
        stale = [
            name
            for name in OUTPUTS
            if not (API / name).exists() or not filecmp.cmp(out / name, API / name, shallow=False)
        ]
        if opts.check:
            for name in stale:
                print(f"stale: {API / name} differs from what its .proto generates", file=sys.stderr)
            return 1 if stale else 0
        for name in OUTPUTS:
            (API / name).write_bytes((out / name).read_bytes())
            print(f"wrote {API / name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
