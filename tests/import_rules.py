"""hearth's code as tests/test_layering.py reads it: every import, resolved to a module name, and
every function's length.

A file's module name comes from pyproject.toml's ``[tool.setuptools.package-dir]`` mapping
(``engine/kv.py`` is ``hearth.engine.kv``); files outside the mapping are named by their path
(``tests/helpers.py`` is ``tests.helpers``). Every import form is read, wherever it stands (module
level, class body, function, ``if``/``try``):

- ``import a.b``, ``from a.b import c`` and ``from a import b`` (``a.b`` when ``b`` is a module:
  ``from hearth import serving`` imports ``hearth.serving``);
- relative imports, resolved against the file's module (an ``__init__.py`` is its package):
  ``from . import x``, ``from ..x import y``;
- ``importlib.import_module`` / ``import_module`` / ``__import__`` called with a literal name (a
  relative one resolved against a literal ``package=`` or ``__package__``/``__name__``). A name
  built at run time cannot be read and is not.

An import under ``if TYPE_CHECKING:`` is marked typing-only: it counts for the layering rules but
never runs, so it closes no import cycle.

An import inside a function must say why it is deferred: a comment containing ``deferred`` and then
the reason (``# deferred: triton is optional``), either on one of the import's own lines or in the
comment lines directly above it. A comment above a run of consecutive imports covers the run.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from collections.abc import Collection, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: package_dirs reads the one section itself
    tomllib = None

GENERATED = ("_pb2.py", "_pb2_grpc.py")  # gRPC's generated code: not written by hand
REASON = re.compile(r"\bdeferred\b\W+\w", re.IGNORECASE)
DYNAMIC = {"import_module", "__import__"}


@dataclass(frozen=True)
class Import:
    """One module imported by one statement (a statement naming two modules gives two)."""

    file: str  # as reported: relative to the root
    line: int
    importer: str  # the importing file's module
    target: str  # the absolute name of the module imported
    form: str  # "import", "from", "relative" or "dynamic"
    in_function: bool = False  # runs when the function is called, not when the module is imported
    typing_only: bool = False  # under ``if TYPE_CHECKING:``
    explained: bool = False  # carries a ``# deferred: <why>`` comment

    def __str__(self) -> str:
        return f"{self.file}:{self.line} {self.importer} imports {self.target}"


@dataclass(frozen=True)
class Function:
    file: str
    name: str  # qualified: ``Class.method``, ``outer.inner``
    line: int
    length: int  # from the ``def`` line to the last line of the body


@dataclass
class Code:
    """The modules under one root, their imports and their functions."""

    root: Path
    files: dict[str, Path]  # module name -> file
    imports: list[Import] = field(default_factory=list)
    functions: list[Function] = field(default_factory=list)

    @classmethod
    def read(cls, root: Path, package_dir: dict[str, str] | None = None) -> Code:
        """hearth's own modules under ``root``: those in the folders of ``package_dir`` (by default
        pyproject.toml's mapping)."""
        package_dir = package_dirs(root / "pyproject.toml") if package_dir is None else package_dir
        files: dict[str, Path] = {}
        for folder in package_dir.values():
            for path in sorted((root / folder).rglob("*.py")):
                if not path.name.endswith(GENERATED):
                    files.setdefault(module_name(path, root, package_dir), path)
        code = cls(root, files)
        for module, path in files.items():
            code.add(module, path)
        return code

    def add(self, module: str, path: Path) -> None:
        text = path.read_text()
        file = path.relative_to(self.root).as_posix()
        tree = ast.parse(text, file)
        self.imports += imports_of(text, module, path.name == "__init__.py", set(self.files), file, tree)
        self.functions += functions_of(tree, file)


def package_dirs(pyproject: Path) -> dict[str, str]:
    """pyproject.toml's ``[tool.setuptools.package-dir]``: package -> folder."""
    text = pyproject.read_text()
    if tomllib is None:  # the section's ``"name" = "folder"`` lines
        section = text.split("[tool.setuptools.package-dir]", 1)[1].split("\n[", 1)[0]
        return dict(re.findall(r'^"?([\w.]+)"?\s*=\s*"([^"]+)"', section, flags=re.M))
    return tomllib.loads(text)["tool"]["setuptools"]["package-dir"]


def module_name(path: Path, root: Path, package_dir: dict[str, str]) -> str:
    """The module a file is imported as: the mapped folder deepest above it gives the package."""
    rel = path.resolve().relative_to(root.resolve()).with_suffix("").parts
    mapped = [(Path(folder).parts, package) for package, folder in package_dir.items()]
    folder, package = max((m for m in mapped if rel[: len(m[0])] == m[0]), key=lambda m: len(m[0]), default=((), ""))
    names = [*filter(None, package.split(".")), *rel[len(folder) :]]
    return ".".join(names[:-1] if names[-1] == "__init__" else names)


def resolve(name: str, level: int, module: str, is_package: bool) -> str:
    """The absolute name of ``'.' * level + name`` imported from ``module``."""
    if level == 0:
        return name
    base = module.split(".") if is_package else module.split(".")[:-1]
    if level - 1 >= len(base):
        raise ValueError(f"{module}: relative import {'.' * level}{name} goes above the top-level package")
    base = base[: len(base) - (level - 1)]
    return ".".join([*base, name] if name else base)


def imports_of(text: str, module: str, is_package: bool = False, known: Collection[str] = (),
               file: str | None = None, tree: ast.AST | None = None) -> list[Import]:
    """Every import in one file's source (``tree``: its parse, where the caller has it). ``known``: the
    modules that exist, to tell ``from a import b`` of a module ``a.b`` from that of a name in ``a``."""
    tree = ast.parse(text, file or module) if tree is None else tree
    reader = _Reader(module, is_package, set(known), file or module)
    reader.dynamic |= {a.asname for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module == "importlib"
                       for a in n.names if a.name == "import_module" and a.asname}
    reader.visit(tree)
    comments = _comments(text)
    groups = _import_lines(tree)
    return [_explain(found, node, comments, groups) for found, node in reader.found]


class _Reader(ast.NodeVisitor):
    def __init__(self, module: str, is_package: bool, known: set[str], file: str) -> None:
        self.module, self.is_package, self.known, self.file = module, is_package, known, file
        self.found: list[tuple[Import, ast.AST]] = []
        self.dynamic = set(DYNAMIC)  # the names import_module goes by here (``from importlib import ... as``)
        self.functions = 0  # how many function bodies enclose the node visited
        self.typing = 0  # how many ``if TYPE_CHECKING:`` bodies enclose it

    def _add(self, node: ast.AST, target: str, form: str) -> None:
        found = Import(self.file, node.lineno, self.module, target, form, self.functions > 0, self.typing > 0)
        self.found.append((found, node))

    def _submodule(self, base: str, name: str) -> str:
        return f"{base}.{name}" if name != "*" and f"{base}.{name}" in self.known else base

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda) -> None:
        # Decorators, defaults and annotations run when the function is defined, its body when called.
        outside = [*getattr(node, "decorator_list", ()), node.args, getattr(node, "returns", None)]
        for child in filter(None, outside):
            self.visit(child)
        self.functions += 1
        for child in node.body if isinstance(node.body, list) else [node.body]:
            self.visit(child)
        self.functions -= 1

    visit_AsyncFunctionDef = visit_FunctionDef
    visit_Lambda = visit_FunctionDef

    def visit_If(self, node: ast.If) -> None:
        test = node.test
        if (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
                isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"):
            self.visit(test)
            self.typing += 1
            for child in node.body:
                self.visit(child)
            self.typing -= 1
            for child in node.orelse:
                self.visit(child)
        else:
            self.generic_visit(node)

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._add(node, alias.name, "import")

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        base = resolve(node.module or "", node.level, self.module, self.is_package)
        for target in dict.fromkeys(self._submodule(base, alias.name) for alias in node.names):  # each once
            self._add(node, target, "relative" if node.level else "from")

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        if isinstance(func, ast.Attribute):  # importlib.import_module, il.import_module, builtins.__import__
            called = func.attr if func.attr in DYNAMIC else None
        else:
            called = getattr(func, "id", None)
            called = "__import__" if called == "__import__" else "import_module" if called in self.dynamic else None
        name = _literal(node.args[0]) if called and node.args else None
        if isinstance(name, str):
            for target in dict.fromkeys(self._dynamic(node, called, name)):
                self._add(node, target, "dynamic")
        self.generic_visit(node)

    def _dynamic(self, node: ast.Call, called: str, name: str) -> list[str]:
        """``import_module(name, package)`` or ``__import__(name, globals, locals, fromlist, level)``."""
        keywords = {k.arg: k.value for k in node.keywords}
        if called == "import_module":
            level = len(name) - len(name.lstrip("."))
            if not level:
                return [name]
            package = node.args[1] if len(node.args) > 1 else keywords.get("package")
            return [resolve(name[level:], level, self._package(package), True)]
        level = _literal(node.args[4] if len(node.args) > 4 else keywords.get("level")) or 0
        base = resolve(name, level, self.module, self.is_package)
        fromlist = _literal(node.args[3] if len(node.args) > 3 else keywords.get("fromlist")) or ()
        names = [n for n in fromlist if isinstance(n, str)] if isinstance(fromlist, list | tuple) else []
        return [self._submodule(base, n) for n in names] or [base]

    def _package(self, node: ast.AST | None) -> str:
        if isinstance(node, ast.Name) and node.id == "__package__":
            return self.module if self.is_package else self.module.rpartition(".")[0]
        if isinstance(node, ast.Name) and node.id == "__name__":
            return self.module
        package = _literal(node)
        if not isinstance(package, str):
            raise ValueError(f"{self.file}:{getattr(node, 'lineno', '?')}: relative import_module without a package")
        return package


def _literal(node: ast.AST | None) -> object:
    try:
        return ast.literal_eval(node) if node is not None else None
    except ValueError:
        return None


def _comments(text: str) -> dict[int, str]:
    """Line -> the comment on it."""
    tokens = tokenize.generate_tokens(io.StringIO(text).readline)
    return {t.start[0]: t.string for t in tokens if t.type == tokenize.COMMENT}


def _import_lines(tree: ast.AST) -> dict[int, int]:
    """The last line of each import statement -> its first line."""
    return {n.end_lineno: n.lineno for n in ast.walk(tree) if isinstance(n, ast.Import | ast.ImportFrom)}


def _explain(found: Import, node: ast.AST, comments: dict[int, str], imports: dict[int, int]) -> Import:
    own = [comments.get(line, "") for line in range(node.lineno, node.end_lineno + 1)]
    above, line = [], node.lineno - 1
    while line in comments or line in imports:  # the comment lines above, across a run of imports
        if line in imports:
            line = imports[line] - 1
            continue
        above.append(comments[line])
        line -= 1
    explained = any(REASON.search(c) for c in own + above)
    return Import(found.file, found.line, found.importer, found.target, found.form, found.in_function,
                  found.typing_only, explained)


def functions_of(tree: ast.AST, file: str) -> list[Function]:
    """Every function and method, nested ones included (an outer function's length counts them)."""
    found = []

    def walk(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                name = f"{prefix}{child.name}"
                if not isinstance(child, ast.ClassDef):
                    found.append(Function(file, name, child.lineno, child.end_lineno - child.lineno + 1))
                walk(child, name + ".")
            else:
                walk(child, prefix)

    walk(tree, "")
    return found


def within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def owner(module: str, packages: Iterable[str]) -> str | None:
    """The most specific of ``packages`` that holds ``module``."""
    return max((p for p in packages if within(module, p)), key=len, default=None)


def import_graph(imports: Iterable[Import], modules: Collection[str]) -> dict[str, set[str]]:
    """Module -> the modules it imports (at import time or later), typing-only imports left out. An
    import of something that is no module of ours (a compiled extension) counts for the nearest
    module above it."""
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for found in imports:
        target = found.target
        while target and target not in graph:
            target = target.rpartition(".")[0]
        if target and target != found.importer and not found.typing_only:
            graph.setdefault(found.importer, set()).add(target)
    return graph


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components with more than one member, each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in sorted(graph):
        if start in index:
            continue
        work: list[tuple[str, Iterator[str]]] = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            nxt = next(edges, None)
            if nxt is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    members = []
                    while not members or members[-1] != node:
                        members.append(stack.pop())
                        on_stack.discard(members[-1])
                    if len(members) > 1:
                        found.append(sorted(members))
            elif nxt not in index:
                index[nxt] = low[nxt] = len(index)
                stack.append(nxt)
                on_stack.add(nxt)
                work.append((nxt, iter(sorted(graph.get(nxt, ())))))
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
    return sorted(found)


# The rules. Each returns what breaks it, one line each (nothing: the rule holds).


def design_table(text: str, marker: str) -> dict[str, list[str]]:
    """The table between two ``<!-- marker -->`` lines: the module of each row's first cell -> the
    modules its second cell names."""
    parts = text.split(f"<!-- {marker} -->")
    assert len(parts) >= 3, f"docs/design.md lost its {marker} table"
    rows = re.findall(r"^\| `([\w.]+)` \| (.*?) \|", parts[1], flags=re.M)
    assert rows, f"docs/design.md's {marker} table has no rows"
    return {name: re.findall(r"`([\w.*]+)`", cell) for name, cell in rows}


def design_list(text: str, marker: str) -> list[str]:
    """The modules that start the items of the list between two ``<!-- marker -->`` lines."""
    parts = text.split(f"<!-- {marker} -->")
    assert len(parts) >= 3, f"docs/design.md lost its {marker} list"
    return re.findall(r"^- `([\w.*]+)`", parts[1], flags=re.M)


def outside_allowed(imports: Iterable[Import], allowed: dict[str, Collection[str]]) -> list[str]:
    """Imports from one package of the table into another that its row does not name."""
    broken = []
    for found in imports:
        source, target = owner(found.importer, allowed), owner(found.target, allowed)
        if source and target and source != target and target not in allowed[source]:
            broken.append(f"{found} ({source} may not import {target})")
    return broken


def forbidden(imports: Iterable[Import], rules: dict[str, Collection[str]]) -> list[str]:
    """Imports that a rule ``part -> what it never imports`` forbids."""
    broken = []
    for found in imports:
        for part, banned in rules.items():
            hit = owner(found.target, banned) if within(found.importer, part) else None
            if hit:
                broken.append(f"{found} ({part} never imports {hit})")
    return broken


def is_face(module: str, faces: Iterable[str]) -> bool:
    """``faces`` names modules; ``a.b.*`` names ``a.b`` and every module under it."""
    return any(module == f or (f.endswith(".*") and within(module, f[:-2])) for f in faces)


def off_the_faces(imports: Iterable[Import], importers: Collection[str], package: str, faces: Collection[str],
                  internal: Collection[str]) -> list[str]:
    """Imports from ``importers`` into ``package`` that go past its public ``faces`` or into an
    ``internal`` part of it (forbidden even where a face would cover it)."""
    broken = []
    for found in imports:
        if not owner(found.importer, importers) or not within(found.target, package):
            continue
        inner = owner(found.target, internal)
        if inner:
            broken.append(f"{found} ({inner} is internal to {package})")
        elif not is_face(found.target, faces):
            broken.append(f"{found} (not one of {package}'s public faces)")
    return broken


def cycles(imports: Collection[Import], modules: Collection[str]) -> list[str]:
    """Each import cycle: its members, then the imports between them."""
    graph = import_graph(imports, modules)
    found = []
    for members in strongly_connected(graph):
        inside = set(members)
        edges = sorted({f"    {i.file}:{i.line} {i.importer} -> {_node(i.target, graph)}"
                        + (" (inside a function)" if i.in_function else "")
                        for i in imports if i.importer in inside and _node(i.target, graph) in inside
                        and i.importer != _node(i.target, graph) and not i.typing_only})
        found.append(f"cycle of {len(members)}: {', '.join(members)}\n" + "\n".join(edges))
    return found


def _node(target: str, graph: dict[str, set[str]]) -> str:
    while target and target not in graph:
        target = target.rpartition(".")[0]
    return target


def in_functions(imports: Iterable[Import]) -> list[Import]:
    """The import statements inside functions (a statement naming two modules counts once)."""
    return list({(i.file, i.line): i for i in imports if i.in_function}.values())


def unexplained(imports: Iterable[Import]) -> list[str]:
    return [f"{i} inside a function, with no '# deferred: <why>'" for i in in_functions(imports) if not i.explained]


def long_functions(functions: Iterable[Function], limit: int) -> list[str]:
    """``file:function:length`` of each function longer than ``limit`` lines."""
    return [f"{f.file}:{f.name}:{f.length}" for f in functions if f.length > limit]


def loose_modules(files: dict[str, Path], package: str) -> list[str]:
    """The modules at ``package``'s top level, its sub-packages left out."""
    return sorted(m for m, p in files.items() if m.rpartition(".")[0] == package and p.name != "__init__.py")
