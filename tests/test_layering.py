"""The design's one-way layering, read from the source: server -> ranks -> kernels, tpserve/ on top.

A module may import its own layer and those below it; the generated gRPC stubs (tpserve.v1) are the
server's. A module importing against the layering fails here, naming the line.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
ALLOWED = {
    "kernels": ("tpserve.kernels",),
    "ranks": ("tpserve.kernels", "tpserve.ranks"),
    "server": ("tpserve.kernels", "tpserve.ranks", "tpserve.server", "tpserve.v1"),
}


def tpserve_imports(path: Path):
    """(line, module) of every import of a tpserve module in the file."""
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            names = [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [(node.lineno, node.module)]
        else:
            continue
        yield from ((line, name) for line, name in names if name == "tpserve" or name.startswith("tpserve."))


@pytest.mark.parametrize("layer", sorted(ALLOWED))
def test_a_layer_imports_only_itself_and_the_layers_below(layer):
    wrong = [
        f"{path.relative_to(REPO)}:{line}: imports {module}"
        for path in sorted((REPO / layer).glob("*.py"))
        for line, module in tpserve_imports(path)
        if not any(module == allowed or module.startswith(allowed + ".") for allowed in ALLOWED[layer])
    ]
    assert wrong == [], "imports against the layering:\n" + "\n".join(wrong)
