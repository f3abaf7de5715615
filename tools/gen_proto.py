"""Generate the gRPC modules of ``proto/hearth.proto`` as ``hearth.proto.hearth_pb2*``.

protoc names the generated imports after the file's path below its include directory, and the
package maps ``proto/`` to ``hearth.proto``: so the file is compiled as ``hearth/proto/hearth.proto``
through a temporary directory whose ``hearth/proto`` links to the real folder.

    python tools/gen_proto.py            # rewrite proto/hearth_pb2.py, .pyi and _grpc.py
    python tools/gen_proto.py --out DIR  # write them to DIR instead (the staleness test)
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUTPUTS = ("hearth_pb2.py", "hearth_pb2.pyi", "hearth_pb2_grpc.py")


def generate(out_dir: Path) -> list[Path]:
    """Compile the contract into ``out_dir``; returns the files written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        include, build = Path(tmp, "include"), Path(tmp, "build")
        (include / "hearth").mkdir(parents=True)
        (include / "hearth" / "proto").symlink_to(ROOT / "proto", target_is_directory=True)
        build.mkdir()
        subprocess.run([sys.executable, "-m", "grpc_tools.protoc", f"-I{include}", f"--python_out={build}",
                        f"--pyi_out={build}", f"--grpc_python_out={build}", "hearth/proto/hearth.proto"], check=True)
        written = []
        for name in OUTPUTS:
            shutil.copyfile(build / "hearth" / "proto" / name, out_dir / name)
            written.append(out_dir / name)
    return written


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=ROOT / "proto", help="where to write (default: proto/)")
    for path in generate(p.parse_args().out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
