"""The arrows point down: every import inside tokenmill goes to its own layer or a lower one, and neither modules
nor packages import each other in a circle (lazy imports inside functions and TYPE_CHECKING ones included). Reads
the sources with ast: no torch, milliseconds.

entry points -> server -> engine -> executor / speculation -> scheduler / runner -> model -> layers
-> loader, tokenizer, grammars, tensor parallelism's base -> native kernels, config -> errors, logging, outputs.

Layers are given to packages (and top-level modules), never to a single module inside a package: a module whose
imports do not fit its package's layer belongs in another package. The package itself (tokenmill/__init__.py) is
at the bottom, as every import of a tokenmill module runs it; its public names (`from tokenmill import LLM`) are a
front for users that imports them lazily, from any layer, and that no tokenmill module may use.
"""

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"

ROOT = "tokenmill"

# the longest matching prefix decides a module's layer (the package itself matches only itself); higher numbers are
# higher layers
LAYERS = {
    "tokenmill": 0,  # the package's __init__ as it runs: every tokenmill import runs it first (its front: below)
    "tokenmill.__main__": 10,  # `python -m tokenmill`: the command line
    "tokenmill.entrypoints": 10,  # the command line and its bench commands, LLM, the terminal, serve's start-up
    "tokenmill.server": 9,
    "tokenmill.engine": 7,
    "tokenmill.executor": 6,
    "tokenmill.spec_decode": 6,
    "tokenmill.scheduler": 5,
    "tokenmill.runner": 5,
    "tokenmill.model": 4,
    "tokenmill.layers": 3,
    "tokenmill.distributed": 2,
    "tokenmill.loader": 2,
    "tokenmill.tokenizer": 2,
    "tokenmill.structured": 2,
    "tokenmill.parsers": 2,  # a reply read back into thinking, answer and tool calls
    "tokenmill.sampling_params": 2,
    "tokenmill.pooling_params": 2,
    "tokenmill.native": 1,
    "tokenmill.config": 1,
    "tokenmill.errors": 0,
    "tokenmill.log": 0,
    "tokenmill.cache": 0,
    "tokenmill.outputs": 0,
}


def module_name(path: Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def front_of(tree: ast.Module) -> list[ast.stmt]:
    """The package's front in its __init__: the module `__getattr__` that imports a public name when a user first
    asks for it, and the `if TYPE_CHECKING:` block that shows type checkers the same names."""
    return [
        node
        for node in tree.body
        if (isinstance(node, ast.FunctionDef) and node.name == "__getattr__")
        or (isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING")
    ]


def imports_of(path: Path, modules: set[str]) -> set[str]:
    """The tokenmill modules `path` imports (a `from package import module` names the module); for the package's
    __init__, those it imports as it runs, not those of its front (front_of)."""
    tree = ast.parse(path.read_text())
    front = {id(n) for f in front_of(tree) for n in ast.walk(f)} if module_name(path) == ROOT else set()
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in front:
            continue
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = module_name(path).split(".")
                package = package if path.name == "__init__.py" else package[:-1]
                base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in modules)
    return {name for name in found if name in modules}


def import_graph() -> dict[str, set[str]]:
    """Each module's imports; importing a module runs its packages' __init__ first, so those that import
    anything are arrows too, but not the importer's own packages (already running) nor tokenmill's (any import of
    tokenmill runs it: it is held to the bottom layer instead)."""
    paths = {module_name(p): p for p in (SRC / "tokenmill").rglob("*.py")}
    direct = {name: imports_of(path, set(paths)) for name, path in paths.items()}
    graph = {}
    for name, targets in direct.items():
        own = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 2)}
        parents = {".".join(t.split(".")[:i]) for t in targets for i in range(2, t.count(".") + 1)}
        graph[name] = (targets | {p for p in parents if p in direct and direct[p]}) - own
    return graph


def layer(module: str) -> int | None:
    prefixes = [p for p in LAYERS if module == p or (p != ROOT and module.startswith(p + "."))]
    return LAYERS[max(prefixes, key=len)] if prefixes else None


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    return sorted(
        f"{a} (layer {layer(a)}) imports {b} (layer {layer(b)})"
        for a, targets in graph.items()
        for b in targets
        if None not in (layer(a), layer(b)) and layer(b) > layer(a)  # a module with none: the test above names it
    )


def package_of(module: str) -> str:
    """tokenmill.loader.gguf_file -> tokenmill.loader; a top-level module (tokenmill.errors) is its own."""
    return ".".join(module.split(".")[:2])


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The arrows between packages: one where any module of one imports any module of another."""
    packages: dict[str, set[str]] = {}
    for a, targets in graph.items():
        packages.setdefault(package_of(a), set()).update(package_of(b) for b in targets)
    return {p: targets - {p} for p, targets in packages.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_every_module_has_a_layer() -> None:
    assert [m for m in import_graph() if layer(m) is None] == []


def test_no_import_goes_to_a_higher_layer() -> None:
    assert upward_imports(import_graph()) == []


def test_no_modules_import_each_other_in_a_circle() -> None:
    assert cycles(import_graph()) == []


def test_no_packages_import_each_other_in_a_circle() -> None:
    """Two packages on one layer may import each other's modules without a circle of modules; they may not both
    do it (the loader building tokenizers that read the loader's files, the command line's bench commands on LLM
    in a package of their own beside the command line): what both need goes in one of them, or lower."""
    assert cycles(package_graph(import_graph())) == []


def front_names() -> set[str]:
    """The names the package's front gives users: its __all__, less __version__ (a constant it defines)."""
    tree = ast.parse((SRC / "tokenmill" / "__init__.py").read_text())
    (names,) = [
        ast.literal_eval(node.value)
        for node in tree.body
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets)
    ]
    return set(names) - {"__version__"}


def asks_the_front(source: str, names: set[str]) -> list[str]:
    """Where a tokenmill module takes one of the front's names from the package (`from tokenmill import LLM`,
    `tokenmill.LLM`): an import of LLM's layer that the layer checks would not see."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module == ROOT and node.level == 0:
            found += [f"line {node.lineno}: from tokenmill import {a.name}" for a in node.names if a.name in names]
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == ROOT:
            found += [f"line {node.lineno}: tokenmill.{node.attr}"] if node.attr in names else []
    return found


def test_the_package_front_imports_lazily_and_no_module_uses_it() -> None:
    """`from tokenmill import LLM` is for users. The package's __init__ runs before any tokenmill module does, so
    what it imports as it runs is held to the bottom layer (0: logging) by the checks above; LLM (layer 10) comes
    from its module __getattr__, when a user first asks. A tokenmill module asking the package for LLM would import
    layer 10 through it, so none may: they import names from their modules."""
    root = SRC / "tokenmill" / "__init__.py"
    names = front_names()
    assert {"LLM", "SamplingParams"} <= names
    front_imports = set()
    for node in front_of(ast.parse(root.read_text())):
        front_imports |= {n.module for n in ast.walk(node) if isinstance(n, ast.ImportFrom)}
    assert "tokenmill.entrypoints.llm" in front_imports  # read, and left out of the graph: the front is lazy
    assert "tokenmill.entrypoints.llm" not in import_graph()[ROOT]
    found = {
        str(path.relative_to(SRC)): asks
        for path in sorted((SRC / "tokenmill").rglob("*.py"))
        if path != root and (asks := asks_the_front(path.read_text(), names))
    }
    assert found == {}


def test_no_python_file_in_src_is_over_500_lines() -> None:
    """Small files with one job each; the C kernels (native/*.c) are not held to it."""
    lines = {str(f.relative_to(SRC)): len(f.read_text().splitlines()) for f in SRC.rglob("*.py")}
    assert len(lines) > 50  # the sources were found
    assert {f: n for f, n in lines.items() if n > 500} == {}


def test_the_checks_see_an_arrow_up_and_a_circle() -> None:
    graph = {
        "tokenmill.model.llama": {"tokenmill.engine.llm_engine"},
        "tokenmill.engine.llm_engine": {"tokenmill.loader.gguf_file"},
        "tokenmill.loader.gguf_file": {"tokenmill.engine.llm_engine"},
    }
    assert upward_imports(graph) == [
        "tokenmill.loader.gguf_file (layer 2) imports tokenmill.engine.llm_engine (layer 7)",
        "tokenmill.model.llama (layer 4) imports tokenmill.engine.llm_engine (layer 7)",
    ]
    assert cycles(graph) == [["tokenmill.engine.llm_engine", "tokenmill.loader.gguf_file"]]
    # a circle of packages on one layer, with none of modules
    graph = {
        "tokenmill.loader.model_source": {"tokenmill.tokenizer.gguf_tokenizer"},
        "tokenmill.tokenizer.gguf_tokenizer": {"tokenmill.loader.gguf_file"},
        "tokenmill.loader.gguf_file": set(),
    }
    assert upward_imports(graph) == [] and cycles(graph) == []
    assert cycles(package_graph(graph)) == [["tokenmill.loader", "tokenmill.tokenizer"]]
    # the package itself is at the bottom, and gives no layer to modules LAYERS misses
    assert layer("tokenmill") == 0 and layer("tokenmill.somewhere_new") is None
    assert upward_imports({"tokenmill": {"tokenmill.entrypoints.llm"}}) == [
        "tokenmill (layer 0) imports tokenmill.entrypoints.llm (layer 10)"
    ]
    assert asks_the_front(
        "from tokenmill import LLM, native, __version__\nx = tokenmill.SamplingParams", {"LLM", "SamplingParams"}
    ) == ["line 1: from tokenmill import LLM", "line 2: tokenmill.SamplingParams"]
    # and the real graph is read: the engine core imports the scheduler
    assert "tokenmill.scheduler.scheduler" in import_graph()["tokenmill.engine.core"]


# ---- the server asks the served model's front, never the engine's insides ---------------------------------------

SERVER = SRC / "tokenmill" / "server"
FRONT = SERVER / "served_model.py"  # the one server module that reads LLMEngine
# names that hold the engine's async front in the server's code: reading `.engine` off one reaches into LLMEngine
ENGINE_HOLDERS = {"engine", "_engine", "async_engine", "require_engine"}


def _holder_name(node: ast.expr) -> str | None:
    if isinstance(node, ast.Call):
        node = node.func
    if isinstance(node, ast.Attribute):
        return node.attr
    return node.id if isinstance(node, ast.Name) else None


def reaches_past_the_front(source: str) -> list[str]:
    """What a server module's source does that only the front may: import LLMEngine's module, read `.engine` off the
    engine's async front (`state.engine.engine`, `require_engine().engine`), or hand it a function to run on
    the engine (`run_on_engine`)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module == "tokenmill.engine.llm_engine":
            found.append(f"line {node.lineno}: imports tokenmill.engine.llm_engine")
        elif isinstance(node, ast.Import) and any(a.name == "tokenmill.engine.llm_engine" for a in node.names):
            found.append(f"line {node.lineno}: imports tokenmill.engine.llm_engine")
        elif isinstance(node, ast.Attribute) and node.attr == "engine" and _holder_name(node.value) in ENGINE_HOLDERS:
            found.append(f"line {node.lineno}: reads .engine off {ast.unparse(node.value)}")
        elif isinstance(node, ast.Attribute) and node.attr == "run_on_engine":
            found.append(f"line {node.lineno}: runs a function on the engine")
    return found


def test_no_server_module_reaches_past_the_served_model() -> None:
    found = {
        str(path.relative_to(SRC)): reaches
        for path in sorted(SERVER.rglob("*.py"))
        if path != FRONT and (reaches := reaches_past_the_front(path.read_text()))
    }
    assert found == {}


def test_the_front_check_sees_a_reach() -> None:
    source = """
from tokenmill.engine.llm_engine import LLMEngine
a = state.require_engine().engine.tokenizer
b = state.engine.engine.max_model_len
c = state.engine.stats()  # the async front itself is fine
await state.require_engine().run_on_engine(lambda e: e.kv)
"""
    assert reaches_past_the_front(source) == [
        "line 2: imports tokenmill.engine.llm_engine",
        "line 3: reads .engine off state.require_engine()",
        "line 4: reads .engine off state.engine",
        "line 6: runs a function on the engine",
    ]


TAIL = SERVER / "stream_or_collect.py"  # the one stream-or-collect tail: a client that leaves, its abort, its 499


def handler_tail_copies(source: str) -> list[str]:
    """What only the shared tail (stream_or_collect.py) and the app's one handler (errors.py) may do: catch
    ClientDisconnected, or answer a 499 by hand."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if (
            isinstance(node, ast.ExceptHandler)
            and node.type is not None
            and "ClientDisconnected" in ast.unparse(node.type)
        ):
            found.append(f"line {node.lineno}: catches ClientDisconnected")
        elif isinstance(node, ast.keyword) and node.arg == "status_code" and ast.unparse(node.value) == "499":
            found.append(f"line {node.value.lineno}: answers 499 by hand")
    return found


def test_the_stream_or_collect_tail_exists_once() -> None:
    assert TAIL.exists()
    found = {
        str(path.relative_to(SRC)): copies
        for path in sorted(SERVER.rglob("*.py"))
        if path not in (TAIL, SERVER / "errors.py") and (copies := handler_tail_copies(path.read_text()))
    }
    assert found == {}


def test_the_tail_check_sees_a_copy() -> None:
    source = """
try:
    finals = await generation.collect(http_request)
except (ClientDisconnected, ValueError):
    return JSONResponse({}, status_code=499)
"""
    assert handler_tail_copies(source) == ["line 4: catches ClientDisconnected", "line 5: answers 499 by hand"]
