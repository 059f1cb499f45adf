"""Arrows only point into shared layers (issue 15): the shared sentence-pair base
``user_dir/hf_sentence`` imports no paper package, and no import cycle joins two
``user_dir`` subpackages. Imports are read with ``ast`` (module level and inside functions)."""

import ast
from pathlib import Path

from conftest import REPO

USER_DIR = REPO / "user_dir"
SUBPACKAGES = sorted(p.name for p in USER_DIR.iterdir() if (p / "__init__.py").is_file())
assert len(SUBPACKAGES) >= 7, SUBPACKAGES  # sdma, sentence_vae, qkvae, optimus, hf_sentence, topic_vq, tpr


def _user_dir_targets(path: Path):
    """Top-level names under user_dir (subpackage or module) that ``path`` imports."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0:
                names = [node.module or ""]
            else:
                # relative: climb node.level - 1 packages from the file's package
                parts = list(path.relative_to(USER_DIR).parts[:-1])
                up = node.level - 1
                if up > len(parts):
                    continue
                base = parts[:len(parts) - up]
                rest = (node.module or "").split(".") if node.module else []
                full = base + rest
                if not full:  # from .. import x  (x names modules of user_dir)
                    for alias in node.names:
                        yield alias.name
                    continue
                yield full[0]
                continue
        else:
            continue
        for name in names:
            parts = name.split(".")
            if parts[0] == "user_dir" and len(parts) > 1:
                yield parts[1]


def package_graph():
    graph = {}
    for package in SUBPACKAGES:
        targets = set()
        files = sorted((USER_DIR / package).rglob("*.py"))
        assert files, f"no Python files under user_dir/{package}"
        for path in files:
            targets.update(_user_dir_targets(path))
        graph[package] = {t for t in targets if t in SUBPACKAGES and t != package}
    return graph


def test_the_graph_sees_known_arrows():
    graph = package_graph()
    assert "hf_sentence" in graph["topic_vq"]  # topic_vq extends the shared base


def test_hf_sentence_imports_no_paper_package():
    graph = package_graph()
    assert graph["hf_sentence"] == set(), f"user_dir/hf_sentence imports {sorted(graph['hf_sentence'])}"


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


def test_shared_modules_import_no_subpackage():
    for module in ("hf_pretrained.py",):
        targets = set(_user_dir_targets(USER_DIR / module))
        assert not targets & set(SUBPACKAGES), f"user_dir/{module} imports {sorted(targets)}"
