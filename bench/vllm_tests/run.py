"""vLLM's own tests of its OpenAI server, run unchanged against the tpserve daemon.

    python -m bench.vllm_tests.run VLLM_CHECKOUT [FILE ...] [--model DIR] [--extra-path DIR] [-- PYTEST_ARGS]

VLLM_CHECKOUT is a directory holding vLLM's `tests/` tree (a checkout of vllm-project/vllm, or just
the files to run at their paths in it): nothing is fetched, and no vLLM file is kept in this
repository. FILEs are paths under it (default: DEFAULT_FILES). The files are copied to a fresh
directory beside stand-ins for what they import from vLLM (harness_conftest.py) and for
`tests.utils.RemoteOpenAIServer` (remote_server.py: it starts `tpserve serve` on one rank, the CPU,
with the test's model name as a served alias), and run there with pytest. The model is the shipped
default (SmolLM2-135M-Instruct, `tpserve prepare`) unless --model names another.

Needs pytest-asyncio and jsonschema, which the tests import and tpserve does not: install them, or
`pip install --target DIR pytest-asyncio jsonschema` and pass --extra-path DIR.

Prints a table per file: items, those not applicable (LoRA, vLLM internals: skipped with the
reason), passed, failed; then each failure's first line.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

from bench.vllm_tests.hub_model import HUB_MODEL_TESTS
from tpserve.prepare import prepare

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
DEFAULT_FILES = (
    "tests/entrypoints/openai/completion/test_completion.py",
    "tests/entrypoints/openai/chat_completion/test_chat.py",
    "tests/entrypoints/openai/chat_completion/test_chat_echo.py",
    "tests/entrypoints/openai/chat_completion/test_chat_logit_bias_validation.py",
    "tests/entrypoints/serve/tokenize/test_tokenization.py",
)
# The daemon's unset max_tokens. vLLM's is the context left (2048 or 8192 tokens in these tests),
# which a GPU writes in seconds; a reply sampled at vLLM's unset temperature (1.0) that runs that
# long takes this 2-core CPU past the openai client's 600 s, so such a test would fail on the
# machine's speed, by chance. 512 leaves every test's reply room for what it checks.
DEFAULT_MAX_TOKENS = 512
SUPPORT_FILES = ("tests/entrypoints/conftest.py", "tests/entrypoints/openai/conftest.py")
PYTEST_INI = """[pytest]
asyncio_default_fixture_loop_scope = function
timeout = 1800
"""


def lay_out(
    checkout: Path, files: list[str], model_dir: Path, root: Path, num_lanes: int, max_tokens: str
) -> None:
    """The run's directory: vLLM's files at their paths, the stand-ins, and harness.json."""
    for relative in [*files, *SUPPORT_FILES]:
        source = checkout / relative
        if source.is_file():
            (root / relative).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source, root / relative)
        elif relative in files:
            raise SystemExit(f"{source} is not a file: VLLM_CHECKOUT must hold vLLM's tests/ tree")
    (root / "tests" / "__init__.py").write_text("")
    shutil.copyfile(HERE / "remote_server.py", root / "tests" / "utils.py")
    shutil.copyfile(HERE / "harness_conftest.py", root / "conftest.py")
    (root / "pytest.ini").write_text(PYTEST_INI)
    (root / "logs").mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}
    env.pop("TPSERVE_API_KEY", None)
    harness = {
        "model_dir": str(model_dir),
        "python": sys.executable,
        "repo": str(REPO),
        "log_dir": str(root / "logs"),
        "num_lanes": num_lanes,
        "extra_args": ["--tp", "1", "--threads-per-rank", "2", "--default-max-tokens", max_tokens],
        "env": env,
        "not_applicable": HUB_MODEL_TESTS,  # skipped by harness_conftest.py, naming the reason
    }
    (root / "harness.json").write_text(json.dumps(harness, indent=1))


def test_file(classname: str, root: Path) -> str:
    """The test file a junit classname (its module's dotted path, then any class) names."""
    parts = classname.split(".")
    for end in range(len(parts), 0, -1):
        candidate = "/".join(parts[:end]) + ".py"
        if (root / candidate).is_file():
            return candidate
    return classname


def counts(report: Path) -> dict[str, dict[str, list[str]]]:
    """file -> outcome (passed, failed, not applicable) -> the items' names (with a failure's line or
    the reason it does not apply). A test of HUB_MODEL_TESTS is not applicable even where it ran (a
    report from a run before it was listed)."""
    table: dict[str, dict[str, list[str]]] = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        file = test_file(case.get("classname", ""), report.parent)
        outcome, name = "passed", case.get("name", "")
        for child in case:
            if child.tag in ("failure", "error"):
                outcome = "failed"
                message = (child.get("message") or child.text or "").strip().splitlines()
                name += f": {message[0][:200] if message else child.tag}"
            elif child.tag == "skipped":
                outcome = "not applicable"
                name += f": {child.get('message', '')}"
        reason = HUB_MODEL_TESTS.get(f"{file}::{case.get('name', '')}")
        if reason is not None and outcome != "not applicable":
            outcome, name = "not applicable", f"{case.get('name', '')}: not applicable: {reason}"
        table.setdefault(file, {"passed": [], "failed": [], "not applicable": []})[outcome].append(name)
    return table


def print_table(table: dict[str, dict[str, list[str]]]) -> None:
    print(f"\n{'file':62} {'items':>5} {'n/a':>4} {'pass':>4} {'fail':>4}")
    totals = [0, 0, 0, 0]
    for file, outcome in sorted(table.items()):
        row = [sum(len(v) for v in outcome.values()), len(outcome["not applicable"])]
        row += [len(outcome["passed"]), len(outcome["failed"])]
        totals = [a + b for a, b in zip(totals, row)]
        print(f"{file:62} {row[0]:>5} {row[1]:>4} {row[2]:>4} {row[3]:>4}")
    applicable = totals[2] + totals[3]
    share = f"{100 * totals[2] / applicable:.0f}%" if applicable else "-"
    print(
        f"{'total':62} {totals[0]:>5} {totals[1]:>4} {totals[2]:>4} {totals[3]:>4}  ({share} of applicable)"
    )
    for file, outcome in sorted(table.items()):
        for line in outcome["failed"]:
            print(f"FAILED {file}::{line}")
        for line in outcome["not applicable"]:
            print(f"N/A    {file}::{line}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkout", type=Path, help="a directory holding vLLM's tests/ tree")
    parser.add_argument("files", nargs="*", default=list(DEFAULT_FILES))
    parser.add_argument("--model", type=Path, default=None, help="default: the shipped default model")
    parser.add_argument("--extra-path", action="append", default=[], help="more import paths (deps)")
    parser.add_argument("--lanes", type=int, default=4)
    parser.add_argument(
        "--default-max-tokens",
        default=str(DEFAULT_MAX_TOKENS),
        help=f"the daemon's unset max_tokens (default {DEFAULT_MAX_TOKENS}; auto: vLLM's, the context left)",
    )
    parser.add_argument("--keep", action="store_true", help="keep the run's directory (its daemon logs)")
    argv = sys.argv[1:] if argv is None else argv
    ours, pytest_args = (
        (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    )
    parser.add_argument("--report", type=Path, help="only print the table of a kept run's report.xml")
    args = parser.parse_args(ours)
    if args.report is not None:
        print_table(counts(args.report))
        return 0
    model_dir = args.model or prepare(progress=False)
    root = Path(tempfile.mkdtemp(prefix="tpserve-vllm-tests-"))
    try:
        lay_out(args.checkout.resolve(), args.files, model_dir, root, args.lanes, args.default_max_tokens)
        paths = os.pathsep.join([str(root), str(REPO), *args.extra_path])
        env = {**os.environ, "PYTHONPATH": paths, "HF_HUB_OFFLINE": "1"}
        command = [sys.executable, "-m", "pytest", "--import-mode=importlib"]
        command += ["-rfEs", "-v", f"--junitxml={root / 'report.xml'}", *args.files]
        command += pytest_args
        subprocess.run(command, cwd=root, env=env, check=False)
        if not (root / "report.xml").is_file():
            print("pytest wrote no report", file=sys.stderr)
            return 2
        print_table(counts(root / "report.xml"))
        return 0
    finally:
        if args.keep:
            print(f"kept {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
