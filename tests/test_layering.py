"""The package rules of docs/design.md, checked on the code itself (every import form read with ast by
tests/import_rules.py, and the modules that must stay light imported in a fresh interpreter), and
the checks themselves shown to catch each forbidden form on small trees of their own."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests import import_rules
from tests.import_rules import (
    Code,
    cycles,
    design_list,
    design_table,
    forbidden,
    imports_of,
    in_functions,
    long_functions,
    loose_modules,
    module_name,
    off_the_faces,
    outside_allowed,
    owner,
    package_dirs,
    resolve,
    unexplained,
)

ROOT = Path(__file__).resolve().parents[1]
THIRD_PARTY_BANS = {
    "hearth.config": {"torch", "ray"},
    "hearth.proto": {"torch", "ray"},
    "hearth.engine": {"ray", "fastapi", "uvicorn", "grpc"},
    "hearth.serving": {"ray"},
}
MAX_IN_FUNCTION = 40  # imports inside functions, in all of hearth's code
MAX_FUNCTION_LINES = 60
MAX_ENGINE_MODULES = 10  # at engine/'s top level, besides its sub-packages
ENGINE_INTERNAL = ["hearth.engine.experts.mechanism"]  # never imported by serving or the cluster
FRONTS = ["hearth.serving", "hearth.cluster"]  # what may use the engine only through its faces


@pytest.fixture(scope="module")
def code() -> Code:
    return Code.read(ROOT)


@pytest.fixture(scope="module")
def design() -> str:
    return (ROOT / "docs" / "design.md").read_text()


def _report(broken: list[str]) -> str:
    return f"{len(broken)}:\n" + "\n".join(broken)


def test_design_table_names_every_package(code, design):
    rooms = design_table(design, "layering")
    homeless = sorted(m for m in code.files if m != "hearth" and owner(m, rooms) is None)
    assert not homeless, f"modules in no row of design.md's layering table: {homeless}"
    assert all(any(m == r or m.startswith(r + ".") for m in code.files) for r in rooms), rooms
    assert set(rooms) == {"hearth.config", "hearth.proto", "hearth.engine", "hearth.serving", "hearth.cluster",
                          "hearth.cli"}


def test_imports_between_packages_follow_the_design(code, design):
    broken = outside_allowed(code.imports, design_table(design, "layering"))
    assert not broken, _report(broken)


def test_rules_inside_the_engine(code, design):
    broken = forbidden(code.imports, design_table(design, "engine-layering"))
    assert not broken, _report(broken)


def test_serving_and_the_cluster_use_the_engines_public_faces(code, design):
    faces = design_list(design, "engine-faces")
    assert "hearth.engine" in faces
    broken = off_the_faces(code.imports, FRONTS, "hearth.engine", faces, ENGINE_INTERNAL)
    assert not broken, _report(broken)


def test_no_import_cycles(code):
    found = cycles(code.imports, code.files)
    assert not found, _report(found)


def test_few_imports_inside_functions(code):
    inside = in_functions(code.imports)
    assert len(inside) <= MAX_IN_FUNCTION, _report([str(i) for i in inside])


def test_imports_inside_functions_say_why(code):
    broken = unexplained(code.imports)
    assert not broken, _report(broken)


def test_no_long_functions(code):
    broken = long_functions(code.functions, MAX_FUNCTION_LINES)
    assert not broken, _report(broken)


def test_the_engines_top_level_is_small(code):
    loose = loose_modules(code.files, "hearth.engine")
    assert len(loose) <= MAX_ENGINE_MODULES, _report(loose)


def test_banned_third_party_imports(code):
    broken = [str(i) for i in code.imports
              if i.target.split(".")[0] in THIRD_PARTY_BANS.get(owner(i.importer, THIRD_PARTY_BANS) or "", ())]
    assert not broken, _report(broken)


def test_everything_imports_through_the_hearth_namespace(code):
    """``engine``, ``serving``, ... are folders, not packages of their own: an import of one would
    load a second copy of its modules (or fail once installed)."""
    folders = {"engine", "serving", "cluster", "cli", "proto"}
    package_dir = package_dirs(ROOT / "pyproject.toml")
    imports = list(code.imports)
    for path in [*(ROOT / "tests").glob("*.py"), *(ROOT / "bench").glob("*.py"), *(ROOT / "tools").glob("*.py"),
                 *(ROOT / "deploy").rglob("*.py")]:
        module, file = module_name(path, ROOT, package_dir), path.relative_to(ROOT).as_posix()
        imports += imports_of(path.read_text(), module, path.name == "__init__.py", file=file)
    broken = [str(i) for i in imports if i.target.split(".")[0] in folders]
    assert not broken, _report(broken)


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


# The checks on trees of their own: each forbidden form is reported, the allowed forms are not.

FAKE_PYPROJECT = """[tool.setuptools.package-dir]
hearth = "hearth"
"hearth.engine" = "engine"
"hearth.serving" = "serving"
"""
FAKE_FILES = ["hearth/__init__.py", "hearth/config.py", "engine/__init__.py", "engine/llm.py",
              "engine/layers/__init__.py", "engine/layers/norm.py", "engine/layers/attention.py",
              "engine/executor/__init__.py", "engine/executor/runner.py", "engine/experts/__init__.py",
              "engine/experts/mechanism/__init__.py", "engine/experts/mechanism/ring.py",
              "serving/__init__.py", "serving/app.py"]
FAKE_ALLOWED = {"hearth.config": [], "hearth.engine": ["hearth.config"],
                "hearth.serving": ["hearth.config", "hearth.engine"]}
FAKE_RULES = {"hearth.engine.layers": ["hearth.engine.executor", "hearth.serving"]}
FAKE_FACES = ["hearth.engine", "hearth.engine.layers.*"]


def _tree(root: Path, sources: dict[str, str]) -> Code:
    (root / "pyproject.toml").write_text(FAKE_PYPROJECT)
    for name in FAKE_FILES:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(sources.get(name, ""))
    return Code.read(root)


def _broken(code: Code) -> list[str]:
    return (outside_allowed(code.imports, FAKE_ALLOWED) + forbidden(code.imports, FAKE_RULES)
            + off_the_faces(code.imports, ["hearth.serving"], "hearth.engine", FAKE_FACES, ENGINE_INTERNAL)
            + unexplained(code.imports) + cycles(code.imports, code.files))


def test_module_names_follow_the_package_dir_mapping(tmp_path):
    code = _tree(tmp_path, {})
    assert set(code.files) == {"hearth", "hearth.config", "hearth.engine", "hearth.engine.llm",
                               "hearth.engine.layers", "hearth.engine.layers.norm", "hearth.engine.layers.attention",
                               "hearth.engine.executor", "hearth.engine.executor.runner", "hearth.engine.experts",
                               "hearth.engine.experts.mechanism", "hearth.engine.experts.mechanism.ring",
                               "hearth.serving", "hearth.serving.app"}
    assert module_name(tmp_path / "tests" / "helpers.py", tmp_path, {"hearth.engine": "engine"}) == "tests.helpers"
    assert package_dirs(tmp_path / "pyproject.toml")["hearth.engine"] == "engine"


def test_package_dirs_reads_pyproject_without_tomllib(monkeypatch):
    """Python 3.10 has no tomllib: the section is read line by line, to the same mapping."""
    expected = package_dirs(ROOT / "pyproject.toml")
    monkeypatch.setattr(import_rules, "tomllib", None)
    assert package_dirs(ROOT / "pyproject.toml") == expected


@pytest.mark.parametrize(("module", "is_package", "name", "level", "absolute"), [
    ("hearth.engine.layers.attention", False, "norm", 1, "hearth.engine.layers.norm"),
    ("hearth.engine.layers.attention", False, "", 1, "hearth.engine.layers"),
    ("hearth.engine.layers.attention", False, "executor.runner", 2, "hearth.engine.executor.runner"),
    ("hearth.engine.layers", True, "norm", 1, "hearth.engine.layers.norm"),
    ("hearth.engine.layers", True, "executor", 2, "hearth.engine.executor"),
    ("hearth.engine.layers", True, "hearth.engine.llm", 0, "hearth.engine.llm"),
])
def test_relative_imports_resolve_against_the_files_module(module, is_package, name, level, absolute):
    assert resolve(name, level, module, is_package) == absolute


def test_a_relative_import_above_the_top_is_an_error():
    with pytest.raises(ValueError, match="above the top-level package"):
        resolve("x", 3, "hearth.engine", False)


RUNNER = "hearth.engine.executor.runner"
TYPING = "from typing import TYPE_CHECKING\n"
# form -> (the source of engine/layers/attention.py, the line of the import, the module it imports)
FORBIDDEN_FORMS = {
    "plain import": ("import hearth.engine.executor.runner\n", 1, RUNNER),
    "import as": ("import hearth.engine.executor.runner as r\n", 1, RUNNER),
    "from import": ("from hearth.engine.executor.runner import step\n", 1, RUNNER),
    "from package import module": ("from hearth.engine.executor import runner\n", 1, RUNNER),
    "from hearth import X": ("from hearth import serving\n", 1, "hearth.serving"),
    "relative": ("from ..executor.runner import step\n", 1, RUNNER),
    "relative module": ("from ..executor import runner\n", 1, RUNNER),
    "relative package": ("from .. import executor\n", 1, "hearth.engine.executor"),
    "in a function": ("def f():\n    import hearth.engine.executor.runner  # deferred: heavy\n", 2, RUNNER),
    "in a method": ("class C:\n    def f(self):\n        from ..executor import runner  # deferred: x\n", 3, RUNNER),
    "in a class body": ("class C:\n    from hearth.engine.executor import runner\n", 2, RUNNER),
    "in try/if": ("try:\n    if True:\n        import hearth.serving.app\nexcept ImportError:\n    pass\n", 3,
                  "hearth.serving.app"),
    "typing only": (TYPING + "if TYPE_CHECKING:\n    from hearth.engine.executor import runner\n", 3, RUNNER),
    "importlib": ("import importlib\nR = importlib.import_module('hearth.engine.executor.runner')\n", 2, RUNNER),
    "import_module relative": ("from importlib import import_module as i\nR = i('..executor.runner', __package__)\n",
                               2, RUNNER),
    "import_module package=": ("import importlib as il\n"
                               "R = il.import_module('.runner', package='hearth.engine.executor')\n", 2, RUNNER),
    "__import__": ("R = __import__('hearth.engine.executor.runner')\n", 1, RUNNER),
    "__import__ fromlist": ("R = __import__('hearth.engine.executor', fromlist=['runner'])\n", 1, RUNNER),
    "in a lambda": ("import importlib\nR = lambda: importlib.import_module('hearth.serving')  # deferred: x\n", 2,
                    "hearth.serving"),
}


@pytest.mark.parametrize("form", FORBIDDEN_FORMS)
def test_each_forbidden_form_is_reported(tmp_path, form):
    source, line, target = FORBIDDEN_FORMS[form]
    broken = _broken(_tree(tmp_path, {"engine/layers/attention.py": source}))
    assert any(b.startswith(f"engine/layers/attention.py:{line} hearth.engine.layers.attention imports {target} (")
               for b in broken), broken


def test_a_package_init_resolves_relative_imports_against_itself(tmp_path):
    broken = _broken(_tree(tmp_path, {"engine/layers/__init__.py": "from ..executor import runner\n"}))
    assert broken == [f"engine/layers/__init__.py:1 hearth.engine.layers imports {RUNNER} "
                      "(hearth.engine.layers never imports hearth.engine.executor)"]


def test_serving_past_the_faces_is_reported(tmp_path):
    source = ("from hearth.engine import LLM\nfrom hearth.engine.layers.norm import rms\n"
              "from hearth.engine import executor\nfrom hearth.engine.experts.mechanism import ring\n"
              "import hearth.engine.llm\n")
    broken = _broken(_tree(tmp_path, {"serving/app.py": source}))
    assert broken == [
        "serving/app.py:3 hearth.serving.app imports hearth.engine.executor (not one of hearth.engine's public faces)",
        "serving/app.py:4 hearth.serving.app imports hearth.engine.experts.mechanism.ring "
        "(hearth.engine.experts.mechanism is internal to hearth.engine)",
        "serving/app.py:5 hearth.serving.app imports hearth.engine.llm (not one of hearth.engine's public faces)",
    ]


def test_the_allowed_forms_pass(tmp_path):
    sources = {
        "engine/layers/attention.py": "import math\nfrom . import norm\nfrom .norm import rms\nimport hearth.config\n"
                                      "from hearth.engine import experts\nfrom hearth import config\n"
                                      "def f():\n    # deferred: torch is heavy\n    import torch\n    import numpy\n",
        "engine/llm.py": "from hearth.engine.executor.runner import step\nfrom hearth.engine.layers import attention\n",
        "serving/app.py": "from hearth.engine import LLM\nfrom hearth.engine.layers.norm import rms\n"
                          "from hearth.engine.layers import attention\nimport fastapi\n",
    }
    assert _broken(_tree(tmp_path, sources)) == []


def test_a_cycle_is_reported_with_its_members(tmp_path):
    sources = {"engine/llm.py": "from hearth.engine.layers import attention\n",
               "engine/layers/attention.py": "from . import norm\n",
               "engine/layers/norm.py": "def f():\n    import importlib  # deferred: x\n"
                                        "    importlib.import_module('hearth.engine.llm')  # deferred: y\n"}
    found = cycles(_tree(tmp_path, sources).imports, ["hearth.engine.llm", "hearth.engine.layers.attention",
                                                      "hearth.engine.layers.norm"])
    assert len(found) == 1
    assert found[0].startswith("cycle of 3: hearth.engine.layers.attention, hearth.engine.layers.norm, "
                               "hearth.engine.llm\n")
    assert "engine/layers/norm.py:3 hearth.engine.layers.norm -> hearth.engine.llm (inside a function)" in found[0]


def test_a_typing_only_import_closes_no_cycle(tmp_path):
    sources = {"engine/llm.py": "from hearth.engine import executor\n",
               "engine/executor/__init__.py": "from typing import TYPE_CHECKING\n"
                                              "if TYPE_CHECKING:\n    from hearth.engine import llm\n"}
    code = _tree(tmp_path, sources)
    assert cycles(code.imports, code.files) == []
    sources["engine/executor/__init__.py"] = "from .. import llm\n"
    assert cycles(_tree(tmp_path, sources).imports, code.files)


def test_imports_inside_functions_are_counted_and_need_a_reason():
    source = ("import os\n"
              "class C:\n    import json\n"
              "    def m(self):\n        import torch  # deferred: torch is heavy\n"
              "def g():\n    # deferred: the CLI must stay light\n    import torch\n    from hearth import serving\n"
              "\n    import numpy\n"
              "def h():\n    import json, re\n"
              "def k():\n    import torch  # deferred\n"
              "def n():\n    from hearth.engine import (  # deferred: a cycle would\n        llm,\n    )\n")
    imports = imports_of(source, "hearth.engine.x", known={"hearth.engine.llm", "hearth.serving"})
    assert [i.line for i in in_functions(imports)] == [5, 8, 9, 11, 13, 15, 17]
    assert [b.split(" ")[0] for b in unexplained(imports)] == ["hearth.engine.x:11", "hearth.engine.x:13",
                                                               "hearth.engine.x:15"]


def test_long_functions_are_reported_by_name(tmp_path):
    body = "".join(f"    x = {i}\n" for i in range(59))
    sources = {"engine/llm.py": f"class C:\n    def fits(self):\n    {body.replace(chr(10), chr(10) + '    ')}\n"
                                f"def too_long():\n{body}    x = 59\n    return x\n"}
    code = _tree(tmp_path, sources)
    assert long_functions(code.functions, 60) == ["engine/llm.py:too_long:62"]
    assert [f.length for f in code.functions if f.name == "C.fits"] == [60]


def test_loose_modules_leave_the_sub_packages_out(tmp_path):
    assert loose_modules(_tree(tmp_path, {}).files, "hearth.engine") == ["hearth.engine.llm"]
