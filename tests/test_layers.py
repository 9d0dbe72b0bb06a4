"""DESIGN.md's layers, checked on every import of every file under fleetd/ and tui/.

Every import counts: module level, inside functions, under TYPE_CHECKING. A layer may import only
the layers listed for it (data flows down, never back up), and no set of modules may import each
other in a circle.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# The layers of DESIGN.md and what each may import. "fleetd" is the package root: its own small
# modules (errors, ports, models, tools, supervise) that import nothing above them.
ALLOWED: dict[str, set[str]] = {
    "fleetd": {"fleetd"},
    "fleetd.wire": {"fleetd", "fleetd.wire"},
    "fleetd.transport": {"fleetd", "fleetd.wire", "fleetd.transport"},
    "fleetd.compute": {"fleetd", "fleetd.wire", "fleetd.transport", "fleetd.compute"},
    "fleetd.server": {"fleetd", "fleetd.wire", "fleetd.transport", "fleetd.compute", "fleetd.server"},
    "fleetd.client": {"fleetd", "fleetd.wire", "fleetd.transport", "fleetd.client"},
    "fleetd.pipeline": {
        "fleetd",
        "fleetd.wire",
        "fleetd.transport",
        "fleetd.compute",
        "fleetd.client",
        "fleetd.pipeline",
    },
    "fleetd.fleet": {
        "fleetd",
        "fleetd.wire",
        "fleetd.transport",
        "fleetd.compute",  # fleetctl stage hashes weights with the daemon's own native FNV-1a
        "fleetd.client",
        "fleetd.pipeline",
        "fleetd.fleet",
    },
    "fleetd.ctl": {
        "fleetd",
        "fleetd.wire",
        "fleetd.transport",
        "fleetd.client",
        "fleetd.pipeline",
        "fleetd.fleet",
        "fleetd.ctl",
        "tui",
    },
    "tui": {"fleetd", "fleetd.fleet", "tui"},
}


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def layer_of(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] == "tui":
        return "tui"
    if parts[0] != "fleetd":
        return None
    if len(parts) >= 2 and f"fleetd.{parts[1]}" in ALLOWED:
        return f"fleetd.{parts[1]}"
    return "fleetd"


def project_files() -> list[Path]:
    return sorted(p for d in ("fleetd", "tui") for p in (ROOT / d).rglob("*.py"))


def imports_of(path: Path, known: set[str]) -> set[str]:
    """Project modules `path` imports, anywhere in the file. `from pkg import name` counts as an
    import of pkg.name when that is a module, else of pkg."""
    tree = ast.parse(path.read_text(), filename=str(path))
    me = module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t and t != me:
                found.add(t)
    return found


def import_graph() -> dict[str, set[str]]:
    files = project_files()
    known = {module_name(p) for p in files}
    return {module_name(p): imports_of(p, known) for p in files}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def package_inits_only(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """A package's __init__ re-exporting its own modules is not a circle: drop the edges from a
    package to the modules inside it, keep everything else."""
    return {m: {t for t in deps if not t.startswith(m + ".")} for m, deps in graph.items()}


def test_every_import_respects_the_layers():
    violations = []
    for module, deps in sorted(import_graph().items()):
        layer = layer_of(module)
        assert layer is not None, module
        for dep in sorted(deps):
            if layer_of(dep) not in ALLOWED[layer]:
                violations.append(f"{module} ({layer}) imports {dep} ({layer_of(dep)})")
    assert not violations, "layer violations:\n" + "\n".join(violations)


def test_no_import_circles():
    found = circles(package_inits_only(import_graph()))
    assert not found, "import circles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_the_checker_sees_a_violation_and_a_circle(tmp_path):
    # The checks above must be able to fail: a function-level upward import and a circle.
    graph = {"fleetd.wire.a": {"fleetd.server.b"}, "fleetd.server.b": {"fleetd.wire.a"}}
    assert circles(graph) == [["fleetd.server.b", "fleetd.wire.a"]]
    src = tmp_path / "m.py"
    src.write_text("def f():\n    from fleetd.server import daemon\n")
    known = {"fleetd.server", "fleetd.server.daemon"}
    global ROOT
    saved, ROOT = ROOT, tmp_path
    try:
        assert imports_of(src, known) == {"fleetd.server.daemon"}
    finally:
        ROOT = saved
    assert layer_of("fleetd.server.daemon") not in ALLOWED["fleetd.wire"]


# What a node runs: the daemon's layers and the package root. Its fleetd has no ctl extra.
DAEMON_PACKAGES = ("fleetd.server", "fleetd.compute", "fleetd.wire", "fleetd.transport", "fleetd.client")
CTL_EXTRA = {"rich", "textual", "paramiko"}


def test_the_daemon_imports_nothing_of_the_ctl_extra():
    # A fresh interpreter: this one has long imported rich for other tests. __main__ modules
    # are skipped, importing one starts the daemon.
    code = f"""
import importlib, pkgutil, sys
import fleetd
names = [m.name for m in pkgutil.iter_modules(fleetd.__path__, "fleetd.") if not m.ispkg]
for package in {DAEMON_PACKAGES!r}:
    names.append(package)
    names += [m.name for m in pkgutil.walk_packages(importlib.import_module(package).__path__, package + ".")]
for name in names:
    if not name.endswith("__main__"):
        importlib.import_module(name)
print(len(names), sorted({{m.partition(".")[0] for m in sys.modules}} & {CTL_EXTRA!r}))
"""
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )
    assert done.returncode == 0, done.stderr
    count, loaded = done.stdout.split(" ", 1)
    assert int(count) > 50 and loaded.strip() == "[]", done.stdout
