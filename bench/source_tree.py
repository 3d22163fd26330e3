"""Makes `tpserve` importable from a bare copy of this repository, with nothing pip-installed.

A GPU machine lent for a first check gets a copy of the tree and no package index, so `pip install
-e .` cannot run there. pyproject.toml maps the folders server/, ranks/ and kernels/ to
tpserve.server, tpserve.ranks and tpserve.kernels; where no installed tpserve resolves them, a
finder on sys.meta_path applies the same mapping to this tree.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# As [tool.setuptools] package-dir in pyproject.toml.
PACKAGE_DIRS = {
    "tpserve": "tpserve",
    "tpserve.server": "server",
    "tpserve.ranks": "ranks",
    "tpserve.kernels": "kernels",
}


class TreeFinder(importlib.abc.MetaPathFinder):
    """Finds tpserve's top packages in their folders of this tree; their modules then resolve
    through each package's own path."""

    def find_spec(self, name, path=None, target=None) -> importlib.machinery.ModuleSpec | None:
        folder = PACKAGE_DIRS.get(name)
        if folder is None:
            return None
        return importlib.util.spec_from_file_location(
            name, ROOT / folder / "__init__.py", submodule_search_locations=[str(ROOT / folder)]
        )


def import_tpserve_from_tree() -> bool:
    """Install the finder unless an installed tpserve already resolves tpserve.ranks; True when
    it was installed."""
    try:
        if importlib.util.find_spec("tpserve.ranks") is not None:
            return False
    except ModuleNotFoundError:  # tpserve/__init__.py found on the path, its subpackages not
        pass
    for name in [name for name in sys.modules if name == "tpserve" or name.startswith("tpserve.")]:
        del sys.modules[name]  # a half-imported tpserve from the failed look-up
    sys.meta_path.insert(0, TreeFinder())
    return True
