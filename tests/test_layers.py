"""The packages' layers, ``runtime <- envs <- agents <- autotune`` (README, Architecture): a module imports only
from its own layer and those below, at import time or inside a function alike."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ("runtime", "envs", "agents", "autotune")


def upward_imports(root: Path) -> list[str]:
    """``path:line imports module`` for every import in a layer's package of a higher layer's module."""
    found = []
    for level, package in enumerate(LAYERS):
        for path in sorted((root / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                for name in names:
                    top = name.partition(".")[0]
                    if top in LAYERS and LAYERS.index(top) > level:
                        found.append(f"{path.relative_to(root)}:{node.lineno} imports {name}")
    return found


def test_no_package_imports_a_higher_layer() -> None:
    assert upward_imports(ROOT) == []


def test_an_upward_import_is_found_even_inside_a_function(tmp_path: Path) -> None:
    for package in LAYERS:
        (tmp_path / package).mkdir()
    (tmp_path / "envs" / "ok.py").write_text("from runtime.workload import Workload\nimport envs.simulator\n")
    (tmp_path / "envs" / "bad.py").write_text("def f():\n    from agents.base import Problem\n    import autotune\n")
    assert upward_imports(tmp_path) == ["envs/bad.py:2 imports agents.base", "envs/bad.py:3 imports autotune"]
