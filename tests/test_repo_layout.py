"""The repository root, which is on sys.path for every process started in it (`make test`, `python -m
bench...`, `launch.sh`), holds no module or package named like one an installed distribution provides:
such a folder shadows that project for everything imported there. A kernels/ folder once did so to
Hugging Face's `kernels`, which transformers 5.25 requires and imports, and every test that built a
transformers model failed."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


def root_module_names() -> set[str]:
    """The names `import NAME` resolves from the repository root: packages and single-file modules."""
    names = {path.name for path in REPO_ROOT.iterdir() if (path / "__init__.py").is_file()}
    names |= {path.stem for path in REPO_ROOT.glob("*.py")}
    return names


def test_no_root_module_shadows_an_installed_distribution():
    provided = importlib.metadata.packages_distributions()  # top-level name -> distributions
    shadowing = {name: provided[name] for name in root_module_names() - {"tpserve"} if name in provided}
    assert shadowing == {}, shadowing
    assert set(provided["tpserve"]) == {"tpserve"}


def test_every_tpserve_package_imports_from_the_root_as_installed():
    # `python -m` in the root (as launch.sh runs the ranks) finds the same tpserve the install maps.
    probe = "import tpserve.kernels, tpserve.ranks, tpserve.server; print(tpserve.kernels.__file__)"
    done = subprocess.run(
        [sys.executable, "-c", probe], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert Path(done.stdout.strip()) == REPO_ROOT / "tpserve" / "kernels" / "__init__.py"
