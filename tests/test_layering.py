"""The design's one-way layering, read from the source: server -> ranks -> kernels, tpserve/ on top.

A module may import its own layer and those below it; the generated gRPC stubs (tpserve.v1) are the
server's. A module importing against the layering fails here, naming the line. The lane host and
what a scheduling step runs (admission, the plan, its pass, the KV book, the queue) import no torch,
however indirectly (STYLE 6).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "tpserve"
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


# The scheduler's side of rank 0, plain Python: tested fast against the fake backend.
TORCH_FREE = (
    "tpserve.server.lane_host",
    "tpserve.server.lane_scheduler",
    "tpserve.server.lane_admit",
    "tpserve.server.admit_choice",
    "tpserve.server.admit_outcomes",
    "tpserve.server.round_pass",
    "tpserve.server.sampled_tokens",
    "tpserve.server.step_plan",
    "tpserve.server.lane_table",
    "tpserve.server.kv_blocks",
    "tpserve.server.job_queue",
)


def layer_files(layer: str) -> list[Path]:
    files = sorted((PACKAGE / layer).glob("*.py"))
    assert files, f"no modules in {PACKAGE / layer}: the layering would pass reading nothing"
    return files


@pytest.mark.parametrize("layer", sorted(ALLOWED))
def test_a_layer_imports_only_itself_and_the_layers_below(layer):
    wrong = [
        f"{path.relative_to(REPO)}:{line}: imports {module}"
        for path in layer_files(layer)
        for line, module in tpserve_imports(path)
        if not any(module == allowed or module.startswith(allowed + ".") for allowed in ALLOWED[layer])
    ]
    assert wrong == [], "imports against the layering:\n" + "\n".join(wrong)


def test_the_lane_host_and_its_step_import_no_torch():
    imports = "; ".join(f"import {module}" for module in TORCH_FREE)
    check = f"import sys; {imports}; print('torch' in sys.modules)"
    result = subprocess.run(
        [sys.executable, "-c", check], capture_output=True, text=True, cwd=REPO, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False", f"importing {', '.join(TORCH_FREE)} imports torch"
