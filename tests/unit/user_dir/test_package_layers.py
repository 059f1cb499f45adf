"""Arrows only point into shared layers: a paper's package imports no other paper's package,
only the shared bases (``user_dir/hf_sentence``, ``user_dir/sentence_vae``), which import no
paper package; the tools (``user_dir/tools/<paper>/``) import their paper's package and the shared
bases, and nothing fairseq loads imports a tool; no import cycle joins two modules;
``latent_core`` imports neither toolkit package; no module takes another module's private names.
Imports are read with ``ast`` (module level and inside functions)."""

import ast
import functools
from pathlib import Path

from conftest import REPO

USER_DIR = REPO / "user_dir"
TOOLS = "tools"  # user_dir/tools/<paper>/: the commands, apart from what fairseq loads
SUBPACKAGES = sorted(p.name for p in USER_DIR.iterdir() if (p / "__init__.py").is_file() and p.name != TOOLS)
assert len(SUBPACKAGES) >= 7, SUBPACKAGES  # sdma, sentence_vae, qkvae, optimus, hf_sentence, topic_vq, tpr


def package_graph():
    """user_dir subpackage -> the other subpackages it imports, read off :func:`module_graph`."""
    graph = module_graph()
    arrows = {package: set() for package in SUBPACKAGES}
    for name, targets in graph.items():
        parts = name.split(".")
        if parts[0] == "user_dir" and len(parts) > 1 and parts[1] in arrows:
            arrows[parts[1]] |= ({t.split(".")[1] for t in targets if t.startswith("user_dir.")}
                                 & set(SUBPACKAGES)) - {parts[1]}
    return arrows


def test_the_graph_sees_known_arrows():
    graph = package_graph()
    assert "hf_sentence" in graph["topic_vq"]  # topic_vq extends the shared base


# the shared bases: the sentence-pair classifier and the sentence-VAE task/criterion
SHARED_BASES = {"hf_sentence", "sentence_vae"}


def test_shared_bases_import_no_paper_package():
    graph = package_graph()
    for base in sorted(SHARED_BASES):
        assert graph[base] == set(), f"user_dir/{base} imports {sorted(graph[base])}"


def test_paper_packages_import_only_the_shared_bases():
    """No arrow from one paper's package to another's (generic measurement lives in latent_core)."""
    graph = package_graph()
    arrows = sorted(f"{package} -> {target}" for package, targets in graph.items() if package not in SHARED_BASES
                    for target in targets - SHARED_BASES)
    assert arrows == []


def test_no_cycle_between_subpackages():
    graph = package_graph()
    state = {}
    path = []

    def visit(node):
        state[node] = "open"
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                cycle = path[path.index(nxt):] + [nxt]
                raise AssertionError("package import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt)
        path.pop()
        state[node] = "done"

    for package in SUBPACKAGES:
        if package not in state:
            visit(package)


def _is_tool(module: str) -> bool:
    return module == f"user_dir.{TOOLS}" or module.startswith(f"user_dir.{TOOLS}.")


def test_nothing_fairseq_loads_imports_a_tool():
    """``--user-dir user_dir`` imports the package ``user_dir``: what it reaches, directly or not,
    holds no tool, and no module of ``user_dir`` outside the tools imports one (the drivers above may)."""
    graph = module_graph()
    reached, todo = set(), ["user_dir"]
    while todo:
        module = todo.pop()
        if module not in reached:
            reached.add(module)
            todo += graph[module]
    assert "user_dir.sdma.model" in reached and "user_dir.tpr.model" in reached  # the walk sees the models
    assert sorted(m for m in reached if _is_tool(m)) == []
    arrows = sorted(f"{name} -> {target}" for name, targets in graph.items()
                    if name.startswith("user_dir") and not _is_tool(name) for target in targets if _is_tool(target))
    assert arrows == []


def test_tools_import_their_paper_and_the_shared_bases_only():
    graph = module_graph()
    tools = [name for name in graph if _is_tool(name) and name.count(".") >= 3]  # user_dir.tools.<paper>.<module>
    assert "user_dir.tools.sdma.redundancy" in tools
    allowed_bases = SHARED_BASES | {f"{TOOLS}.{base}" for base in SHARED_BASES}
    arrows = []
    for name in tools:
        paper = name.split(".")[2]
        for target in graph[name]:
            parts = target.split(".")
            if parts[0] != "user_dir" or len(parts) < 2 or parts[1] not in SUBPACKAGES + [TOOLS]:
                continue
            into = f"{TOOLS}.{parts[2]}" if parts[1] == TOOLS and len(parts) > 2 else parts[1]
            if into not in {paper, f"{TOOLS}.{paper}"} | allowed_bases:
                arrows.append(f"{name} -> {target}")
    assert sorted(arrows) == []


def test_shared_modules_import_no_subpackage():
    graph = module_graph()
    for module in ("hf_pretrained", "model_wrappers"):
        targets = {t.split(".")[1] for t in graph[f"user_dir.{module}"] if t.startswith("user_dir.")}
        assert not targets & set(SUBPACKAGES), f"user_dir/{module}.py imports {sorted(targets)}"


# ------------------------------------------------------------------ modules of the project's packages
PACKAGES = ("latent_core", "pipelines", "user_dir", "espnet_plugin", "transformers_plugin", "benchmarks", "experiments")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _module_imports(path: Path, modules):
    """(module imported, names taken from it) for every import of ``path`` that resolves to one of
    ``modules`` (the deepest module the dotted name reaches), module level and inside functions."""
    package = _module_name(path).split(".") if path.name == "__init__.py" else _module_name(path).split(".")[:-1]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            found = [(alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[:len(package) - (node.level - 1)] + ([node.module] if node.module else []))
            names = [alias.name for alias in node.names]
            # `from package import module` imports the module; `from module import name` the module
            found = [(f"{base}.{name}", []) for name in names if f"{base}.{name}" in modules] + [(base, names)]
        else:
            continue
        for name, taken in found:
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name:
                yield name, taken


@functools.lru_cache(maxsize=None)  # parsed once per run: every test reads the same tree (the tests only read it)
def module_imports():
    """module -> its (module imported, names taken) pairs, for every module of :data:`PACKAGES`."""
    files = [p for package in PACKAGES for p in sorted((REPO / package).rglob("*.py"))]
    modules = {_module_name(p): p for p in files}
    return {name: list(_module_imports(path, modules)) for name, path in modules.items()}


def module_graph():
    """module -> the other modules of :data:`PACKAGES` it imports."""
    return {name: {target for target, _ in found if target != name} for name, found in module_imports().items()}


def test_no_import_cycle_between_modules():
    """latent_core, user_dir and espnet_plugin module by module: an import cycle (also one hidden by an
    import inside a function) fails, naming the modules."""
    graph = module_graph()
    assert "latent_core.redundancy" in graph["latent_core.redundancy_plot"]  # the graph sees arrows
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(node):  # Tarjan's strongly connected components
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    assert cycles == [], f"import cycles: {cycles}"


def test_latent_core_imports_neither_toolkit_package():
    graph = module_graph()
    arrows = sorted(f"{name} -> {target}" for name, targets in graph.items() if name.startswith("latent_core")
                    for target in targets if not target.startswith("latent_core"))
    assert arrows == []


def test_no_module_takes_another_modules_private_names():
    taken = sorted(f"{module}: from {target} import {name}" for module, found in module_imports().items()
                   for target, names in found if target != module
                   for name in names if name.startswith("_") and not name.startswith("__"))
    assert taken == []


def layer(module: str) -> int:
    """The project's floors, bottom up: 1 the mathematics, 2 data preparation and the run helpers, 3 the three
    toolkit adapters, 4 the commands on trained models, 5 the benchmarks, 6 the experiment drivers."""
    parts = module.split(".")
    if parts[0] in ("user_dir", "espnet_plugin") and len(parts) > 1 and parts[1] == "tools":
        return 4
    return {"latent_core": 1, "pipelines": 2, "user_dir": 3, "espnet_plugin": 3, "transformers_plugin": 3,
            "benchmarks": 5, "experiments": 6}[parts[0]]


def test_no_import_runs_back_up_a_floor():
    """Every import (module level and inside functions) points to the module's own floor or one below it."""
    graph = module_graph()
    assert "pipelines.runs" in graph["experiments.sdma.quickstart"]  # the graph sees the top floor
    arrows = sorted(f"{name} -> {target}" for name, targets in graph.items() for target in targets
                    if layer(target) > layer(name))
    assert arrows == []


def test_the_adapters_import_each_other_nowhere():
    """fairseq, ESPnet and transformers users load one adapter each: none imports another (the benchmarks and
    drivers above them may import several)."""
    graph = module_graph()
    arrows = sorted(f"{name} -> {target}" for name, targets in graph.items() for target in targets
                    if layer(name) in (3, 4) and layer(target) in (3, 4)
                    and name.split(".")[0] != target.split(".")[0])
    assert arrows == []

