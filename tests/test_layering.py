"""The package rules of docs/design.md, checked on the code itself (imports read with ast, and the
modules that must stay light imported in a fresh interpreter)."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Package -> its folder in the repository (pyproject.toml maps them into one ``hearth`` namespace).
FOLDERS = {"hearth.config": "hearth/config.py", "hearth.proto": "proto", "hearth.engine": "engine",
           "hearth.serving": "serving", "hearth.cluster": "cluster", "hearth.cli": "cli"}
THIRD_PARTY_BANS = {
    "hearth.config": {"torch", "ray"},
    "hearth.proto": {"torch", "ray"},
    "hearth.engine": {"ray", "fastapi", "uvicorn", "grpc"},
    "hearth.serving": {"ray"},
}


def files_of(package: str) -> list[Path]:
    target = ROOT / FOLDERS[package]
    found = [target] if target.suffix == ".py" else sorted(target.rglob("*.py"))
    return [p for p in found if not p.name.endswith(("_pb2.py", "_pb2_grpc.py"))]


def imported_modules(path: Path) -> set[str]:
    """Every module a file imports, at module level or inside functions."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def package_of(module: str) -> str | None:
    return next((p for p in FOLDERS if module == p or module.startswith(p + ".")), None)


def allowed_from_design() -> dict[str, set[str]]:
    """The 'may import' table of docs/design.md."""
    text = (ROOT / "docs" / "design.md").read_text()
    table = text.split("<!-- layering -->", 2)[1]
    rows = re.findall(r"^\| `(hearth\.[a-z]+)` \| (.*?) \|", table, flags=re.M)
    assert rows, "docs/design.md lost its layering table"
    return {pkg: set(re.findall(r"`(hearth\.[a-z]+)`", allowed)) for pkg, allowed in rows}


def test_design_table_names_every_package():
    assert set(allowed_from_design()) == set(FOLDERS)


def test_imports_between_packages_follow_the_design():
    allowed = allowed_from_design()
    broken = []
    for package in FOLDERS:
        for path in files_of(package):
            for module in imported_modules(path):
                target = package_of(module)
                if target is not None and target != package and target not in allowed[package]:
                    broken.append(f"{path.relative_to(ROOT)} imports {module} ({package} may not import {target})")
    assert not broken, "\n".join(broken)


def test_banned_third_party_imports():
    broken = []
    for package, banned in THIRD_PARTY_BANS.items():
        for path in files_of(package):
            for module in imported_modules(path):
                if module.split(".")[0] in banned:
                    broken.append(f"{path.relative_to(ROOT)} imports {module}")
    assert not broken, "\n".join(broken)


def test_everything_imports_through_the_hearth_namespace():
    """``engine``, ``serving``, ... are folders, not packages of their own: an import of one would
    load a second copy of its modules (or fail once installed)."""
    folders = {"engine", "serving", "cluster", "cli", "proto"}
    paths = [p for pkg in FOLDERS for p in files_of(pkg)]
    paths += sorted((ROOT / "tests").glob("*.py")) + sorted((ROOT / "bench").glob("*.py"))
    paths += sorted((ROOT / "tools").glob("*.py")) + sorted((ROOT / "deploy").rglob("*.py"))
    broken = [f"{p.relative_to(ROOT)}: {m}" for p in paths for m in imported_modules(p) if m.split(".")[0] in folders]
    assert not broken, "\n".join(broken)


def _fresh(code: str) -> None:
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT / "tests", timeout=120)


def test_serving_and_single_machine_commands_load_no_ray():
    _fresh("import sys, contextlib, io\n"
           "import hearth.serving.server, hearth.serving.app, hearth.engine\n"
           "from hearth.cli.main import build_parser\n"
           "for cmd in ('serve', 'generate', 'bench', 'inspect', 'convert', 'profile', 'pool'):\n"
           "    with contextlib.redirect_stdout(io.StringIO()):\n"
           "        try: build_parser().parse_args([cmd, '--help'])\n"
           "        except SystemExit: pass\n"
           "assert 'ray' not in sys.modules, 'ray was imported'\n")


def test_contracts_config_and_the_cli_parser_load_no_torch():
    _fresh("import sys\nimport hearth, hearth.config, hearth.proto.contracts, hearth.cli.main\n"
           "hearth.cli.main.build_parser()\n"
           "assert 'torch' not in sys.modules and 'ray' not in sys.modules, sorted(sys.modules)[:0]\n")
