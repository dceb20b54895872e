"""The package's import structure: no import circle, and every module imports on its own.

- `test_the_import_graph_has_no_circle`: the graph with an edge A -> B for every import of an
  smc_sd module B written in module A is acyclic. Every import statement of A counts, at module
  level or deferred inside a function: a deferred import only hides a circle from the
  interpreter, the two modules still depend on each other. A deferred import may reach across
  layers (`HFLanguageModel.default` reads the embedded model's directory from `smc_sd.models`)
  as long as it closes no circle. Imports under `if TYPE_CHECKING:` are edges too: they never
  run, but a name a module's annotations need from above is the same dependency. `from P import name` is an edge to the submodule P.name when that is a module, else to
  P; the parent packages Python initialises on the way to a module are not edges (a package's
  `__init__` re-exporting its submodules forms no circle).
- `test_the_packages_form_layers`: the same graph with each subpackage of smc_sd (program,
  compiler, engine, constraints, backends, ...) and each top-level module (api, cli, ...) as one
  node is acyclic too: the program is data that runs through `smc_sd.api`, the engine compiles
  and runs plans, the compiler lowers programs, and none of them reaches back up.
- `test_every_module_imports_alone`: each module of smc_sd and smc_sd.programs is the first
  smc_sd module imported in its interpreter, so it imports in whatever order its own imports
  impose. One interpreter loads the third-party packages the tree imports at module level, then
  forks a child per module (an import per fresh interpreter would take minutes: torch,
  transformers and genlm-control take about 10 s to load).
"""

from __future__ import annotations

import ast
import json
import pathlib
import subprocess
import sys

import networkx as nx

ROOT = pathlib.Path(__file__).resolve().parents[1]
# package name -> its folder (setuptools installs programs/ as smc_sd.programs)
PACKAGES = {"smc_sd": ROOT / "smc_sd", "smc_sd.programs": ROOT / "programs"}


def package_modules() -> dict[str, pathlib.Path]:
    """Every module of the package, by dotted name, with its file."""
    modules = {}
    for package, folder in PACKAGES.items():
        for path in sorted(folder.rglob("*.py")):
            parts = path.relative_to(folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join((package, *parts))] = path
    return modules


def import_statements(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """The import statements anywhere in a module: at module level, inside functions and under
    `if TYPE_CHECKING:`."""
    return [node for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))]


def imported_names(statement: ast.Import | ast.ImportFrom, module: str, is_package: bool) -> list[str]:
    """The dotted names a statement imports: `import a.b` gives a.b; `from a import b` gives a.b
    (resolved to a, or further up, by `internal_module` when a.b is not a module)."""
    if isinstance(statement, ast.Import):
        return [alias.name for alias in statement.names]
    base = statement.module or ""
    if statement.level:
        # a relative import counts from the module's package (a package is its own)
        anchor = module.split(".")[: None if is_package else -1]
        anchor = anchor[: len(anchor) - statement.level + 1]
        base = ".".join(anchor + ([base] if base else []))
    return [f"{base}.{alias.name}" for alias in statement.names]


def internal_module(name: str, modules: dict) -> str | None:
    """The longest prefix of a dotted name that is a module of the package, if any."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def import_graph() -> nx.DiGraph:
    """The package's modules, with an edge A -> B for every import of B written in A."""
    modules = package_modules()
    graph = nx.DiGraph()
    for module, path in modules.items():
        graph.add_node(module)
        for statement in import_statements(ast.parse(path.read_text(), str(path))):
            for name in imported_names(statement, module, path.name == "__init__.py"):
                target = internal_module(name, modules)
                if target is not None and target != module:
                    graph.add_edge(module, target)
    return graph


def third_party_imports() -> list[str]:
    """The modules outside the package that the tree imports at module level (sorted)."""
    names = set()
    for path in package_modules().values():
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module != "__future__":
                names.add(node.module)
    return sorted(name for name in names if name.partition(".")[0] != "smc_sd")


# Loads `third_party`, then imports each of `modules` in a forked child as the first smc_sd
# module of that interpreter; writes {module: traceback} of the failures to `out`.
IMPORT_EACH_ALONE = r"""
import importlib, json, os, sys, traceback
third_party, modules, out = json.loads(sys.argv[1]), json.loads(sys.argv[2]), sys.argv[3]
for name in third_party:
    importlib.import_module(name)
loaded = [m for m in sys.modules if m == "smc_sd" or m.startswith("smc_sd.")]
assert not loaded, f"loading third-party modules loaded {loaded}"
sys.stdout.flush()
failures = {}
for module in modules:
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        try:
            importlib.import_module(module)
            status = 0
        except BaseException:
            os.write(write, traceback.format_exc().encode())
            status = 1
        os._exit(status)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        message = pipe.read().decode()
    _, status = os.waitpid(pid, 0)
    if status:
        failures[module] = message or f"wait status {status}"
with open(out, "w") as file:
    json.dump(failures, file)
"""


def test_the_import_graph_has_no_circle():
    graph = import_graph()
    # the graph is read from the files: a module that moves must still be seen importing
    assert graph.has_edge("smc_sd.constraints.potentials", "smc_sd.constraints.scores")
    assert graph.has_edge("smc_sd.backends.hf", "smc_sd.models.smollm2")
    circles = sorted(" -> ".join(circle + circle[:1]) for circle in nx.simple_cycles(graph))
    assert not circles, "import circles:\n" + "\n".join(circles)


def package_of(module: str) -> str:
    """The node of the package graph a module belongs to: smc_sd.X for anything under smc_sd.X."""
    return ".".join(module.split(".")[:2])


def test_the_packages_form_layers():
    graph = nx.DiGraph()
    for a, b in import_graph().edges():
        if package_of(a) != package_of(b):
            graph.add_edge(package_of(a), package_of(b))
    # the layers, top to bottom, as the graph must show them
    assert graph.has_edge("smc_sd.program", "smc_sd.api") and graph.has_edge("smc_sd.api", "smc_sd.engine")
    assert graph.has_edge("smc_sd.engine", "smc_sd.compiler") and graph.has_edge("smc_sd.compiler", "smc_sd.constraints")
    circles = sorted(" -> ".join(circle + circle[:1]) for circle in nx.simple_cycles(graph))
    assert not circles, "circles between packages:\n" + "\n".join(circles)


def test_every_module_imports_alone(tmp_path):
    modules = sorted(package_modules())
    out = tmp_path / "failures.json"
    subprocess.run(
        [sys.executable, "-c", IMPORT_EACH_ALONE, json.dumps(third_party_imports()), json.dumps(modules), str(out)],
        cwd=ROOT, check=True, timeout=300,
    )
    failures = json.loads(out.read_text())
    assert not failures, "modules that fail to import alone:\n" + "\n".join(f"{m}:\n{t}" for m, t in failures.items())
