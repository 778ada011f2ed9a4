"""The arrows point down: every import inside tokenmill goes to its own layer or a lower one, and no modules import
each other in a circle (lazy imports inside functions and TYPE_CHECKING ones included). Reads the sources with
ast: no torch, milliseconds.

entry points -> server -> engine -> executor / speculation -> scheduler / runner -> model -> layers
-> loader, tokenizer, grammars, tensor parallelism's base -> native kernels, config -> errors, logging, outputs.
"""

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"

# the longest matching prefix decides a module's layer; higher numbers are higher layers
LAYERS = {
    "tokenmill": 10,  # the package itself: `from tokenmill import LLM`
    "tokenmill.__main__": 10,
    "tokenmill.entrypoints.cli": 10,
    "tokenmill.entrypoints.cli_parser": 10,
    "tokenmill.bench": 9,
    "tokenmill.server": 9,
    "tokenmill.entrypoints": 8,  # LLM, the terminal, serve's start-up
    "tokenmill.engine": 7,
    "tokenmill.executor": 6,
    "tokenmill.spec_decode": 6,
    "tokenmill.scheduler": 5,
    "tokenmill.runner": 5,
    "tokenmill.model": 4,
    "tokenmill.model.config": 2,  # what a GGUF's metadata says of the model: tensor parallelism's plan reads it
    "tokenmill.model.rope_scaling": 2,  # YaRN's numbers, which model.config reads into the config
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


def imports_of(path: Path, modules: set[str]) -> set[str]:
    """The tokenmill modules `path` imports (a `from package import module` names the module)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
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
    tokenmill runs it)."""
    paths = {module_name(p): p for p in (SRC / "tokenmill").rglob("*.py")}
    direct = {name: imports_of(path, set(paths)) for name, path in paths.items()}
    graph = {}
    for name, targets in direct.items():
        own = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 2)}
        parents = {".".join(t.split(".")[:i]) for t in targets for i in range(2, t.count(".") + 1)}
        graph[name] = (targets | {p for p in parents if p in direct and direct[p]}) - own
    return graph


def layer(module: str) -> int | None:
    prefixes = [p for p in LAYERS if module == p or module.startswith(p + ".")]
    return LAYERS[max(prefixes, key=len)] if prefixes else None


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    return sorted(
        f"{a} (layer {layer(a)}) imports {b} (layer {layer(b)})"
        for a, targets in graph.items()
        for b in targets
        if layer(b) > layer(a)
    )


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


def test_no_python_file_in_src_is_over_500_lines() -> None:
    """Small files with one job each; the C kernels (native/*.c) are not held to it."""
    lines = {str(f.relative_to(SRC)): len(f.read_text().splitlines()) for f in SRC.rglob("*.py")}
    assert len(lines) > 50  # the sources were found
    assert {f: n for f, n in lines.items() if n > 500} == {}


def test_the_checks_see_an_arrow_up_and_a_circle() -> None:
    graph = {
        "tokenmill.model.llama": {"tokenmill.engine.llm_engine"},
        "tokenmill.engine.llm_engine": {"tokenmill.loader.prefetch"},
        "tokenmill.loader.prefetch": {"tokenmill.engine.llm_engine"},
    }
    assert upward_imports(graph) == [
        "tokenmill.loader.prefetch (layer 2) imports tokenmill.engine.llm_engine (layer 7)",
        "tokenmill.model.llama (layer 4) imports tokenmill.engine.llm_engine (layer 7)",
    ]
    assert cycles(graph) == [["tokenmill.engine.llm_engine", "tokenmill.loader.prefetch"]]
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
