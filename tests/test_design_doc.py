"""docs/design.md's module table is the package: every module of ``headkit/`` has one row, no
row names a module that does not exist, rows go in import order (a module imports only modules
in rows above it, imports inside functions included) and layer numbers never go down."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "headkit"
ROW = re.compile(r"^\|\s*(\d+)\s*\|\s*`([\w/]+\.py)`\s*\|")


def table() -> list[tuple[int, str]]:
    """(layer, module path relative to headkit/) of each row, in order."""
    rows = []
    for line in (ROOT / "docs" / "design.md").read_text().splitlines():
        m = ROW.match(line)
        if m:
            rows.append((int(m.group(1)), m.group(2)))
    return rows


def modules() -> set[str]:
    return {p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*.py")}


def _path_of(dotted: str) -> str | None:
    """``headkit.heads.base`` → ``heads/base.py`` (a package → its ``__init__.py``)."""
    parts = dotted.split(".")[1:]
    for candidate in ("/".join(parts) + ".py", "/".join([*parts, "__init__.py"])):
        if (PACKAGE / candidate).is_file():
            return candidate
    return None


def imports_of(module: str) -> set[str]:
    """The headkit modules ``module`` imports (paths), not counting ``TYPE_CHECKING`` ones."""
    path = PACKAGE / module
    tree = ast.parse(path.read_text())
    skipped = {
        id(node)
        for block in ast.walk(tree)
        if isinstance(block, ast.If) and "TYPE_CHECKING" in ast.unparse(block.test)
        for node in ast.walk(block)
    }
    package = ["headkit", *Path(module).parent.parts]
    found = set()
    for node in ast.walk(tree):
        if id(node) in skipped or not isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        else:
            base = package[: len(package) - node.level + 1] if node.level else []
            stem = ".".join([*base, *([node.module] if node.module else [])])
            targets = [f"{stem}.{a.name}" for a in node.names] + ([stem] if node.module else [])
        for dotted in targets:
            if dotted.split(".")[0] != "headkit":
                continue
            target = _path_of(dotted)
            if target is not None and target != module:
                found.add(target)
    return found


def test_the_table_names_every_module_once_and_nothing_else():
    listed = [m for _, m in table()]
    twice = sorted({m for m in listed if listed.count(m) > 1})
    assert not twice, f"docs/design.md lists these modules more than once: {twice}"
    missing = sorted(modules() - set(listed))
    assert not missing, f"modules missing from docs/design.md's table: {missing}"
    unknown = sorted(set(listed) - modules())
    assert not unknown, f"docs/design.md's table names modules that do not exist: {unknown}"


def test_the_table_is_in_import_order():
    rows = table()
    layers = [layer for layer, _ in rows]
    assert layers == sorted(layers), "layer numbers go down somewhere in docs/design.md's table"
    position = {m: i for i, (_, m) in enumerate(rows)}
    late = [
        f"{m} imports {t}"
        for m in position
        if m in modules()
        for t in sorted(imports_of(m))
        if t in position and position[t] > position[m]
    ]
    assert not late, f"docs/design.md lists these imports below their importer: {late}"


def test_the_checks_see_real_imports():
    """The parser finds what the code imports (else the order test could pass on nothing)."""
    assert {"heads/base.py", "losses/objective.py", "errors.py"} <= imports_of("config.py")
    assert "checkpoint/__init__.py" in imports_of("model/headed.py")
    assert "model/headed.py" not in imports_of("checkpoint/restore.py")  # TYPE_CHECKING only
    assert "data/collator.py" in imports_of("metrics.py")  # inside a function
