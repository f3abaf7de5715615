"""Build the native CPU kernels in place, without pip: for a source tree used as it is (the GPU
contact check on a machine with no package index, where ``pip install -e .`` cannot run).

    python3 tools/build_kernels.py [--jobs N] [--force]

Each library (``engine/kernels/cpu/sources.py: kernel_builds``) is compiled straight to
``engine/kernels/cpu/<name><EXT_SUFFIX>`` with the same flags ``setup.py`` gives setuptools, and the
same source fingerprint, so the runtime loads it as it loads an installed build. A library that
does not build (no compiler, no ``Python.h``, an old compiler) is reported and left out: the
engine then runs its torch paths for what it lacks. Exits 0 either way; prints one JSON line with
what was built.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

KERNELS = Path(__file__).resolve().parents[1] / "engine" / "kernels" / "cpu"


def _sources_module():
    """engine/kernels/cpu/sources.py, loaded by path (nothing of the package needs to be importable)."""
    spec = importlib.util.spec_from_file_location("hearth_kernel_sources", KERNELS / "sources.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def compiler() -> str | None:
    """The C++ compiler: $CXX, else the first of c++, g++ and clang++ on the PATH."""
    candidates = [os.environ["CXX"]] if os.environ.get("CXX") else ["c++", "g++", "clang++"]
    return next((shutil.which(c) for c in candidates if shutil.which(c)), None)


def command(cxx: str, name: str, source: str, isa_flags: tuple[str, ...], source_hash: str) -> list[str]:
    """The compile-and-link command of one library."""
    sources = _sources_module()
    out = KERNELS / f"{name}{sysconfig.get_config_var('EXT_SUFFIX')}"
    return [cxx, *sources.COMMON_FLAGS, f'-DHEARTH_SOURCE_HASH="{source_hash}"', *isa_flags, "-shared", "-fPIC",
            f"-I{KERNELS}", f"-I{sysconfig.get_paths()['include']}", str(KERNELS / source), "-o", str(out),
            "-fopenmp"]


def build_one(cmd: list[str]) -> dict:
    start = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    ok = proc.returncode == 0
    return {"ok": ok, "seconds": round(time.time() - start, 1),
            **({} if ok else {"error": (proc.stderr or proc.stdout).strip().splitlines()[-3:]})}


def build(jobs: int, force: bool = False) -> dict:
    """Build every library this machine's architecture has; {name: result} plus the reason when
    nothing could be tried."""
    sources = _sources_module()
    cxx = compiler()
    if cxx is None:
        return {"built": [], "skipped": "no C++ compiler on the PATH (set CXX)"}
    if not (Path(sysconfig.get_paths()["include"]) / "Python.h").exists():
        return {"built": [], "skipped": f"no Python.h under {sysconfig.get_paths()['include']} (python3-dev)"}
    source_hash = sources.source_hash(KERNELS)
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    todo = {name: command(cxx, name, source, flags, source_hash)
            for name, source, flags in sources.kernel_builds(platform.machine())
            if force or not _up_to_date(KERNELS / f"{name}{suffix}", sources.kernel_sources(KERNELS))}
    with ThreadPoolExecutor(max(jobs, 1)) as threads:
        results = dict(zip(todo, threads.map(build_one, todo.values()), strict=True))
    built = [n for n, _, _ in sources.kernel_builds(platform.machine()) if (KERNELS / f"{n}{suffix}").exists()]
    return {"built": built, "compiler": cxx, "results": results}


def _up_to_date(target: Path, sources: list[Path]) -> bool:
    return target.exists() and target.stat().st_mtime >= max(p.stat().st_mtime for p in sources)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--force", action="store_true", help="rebuild libraries that look up to date")
    args = ap.parse_args()
    report = build(args.jobs, args.force)
    print(json.dumps(report))
    print(f"hearth: native CPU kernels built in place: {', '.join(report['built']) or 'none'}"
          + (f" ({report['skipped']}; the torch paths will run)" if "skipped" in report else ""), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
