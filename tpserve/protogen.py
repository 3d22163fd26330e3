"""Regenerates the Python gRPC stubs in tpserve/v1/ from proto/tpserve/v1/serving.proto.

`python -m tpserve.protogen` rewrites the committed stubs; `generate_stubs()` returns them as text so a
test can check that the committed ones match the proto.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = REPO_ROOT / "proto"
PROTO_FILES = ("tpserve/v1/serving.proto",)
STUB_DIR = REPO_ROOT / "tpserve" / "v1"
STUB_NAMES = ("serving_pb2.py", "serving_pb2.pyi", "serving_pb2_grpc.py")


class ProtocError(RuntimeError):
    """protoc refused the proto files."""


def generate_stubs(proto_root: Path = PROTO_ROOT) -> dict[str, str]:
    """Runs protoc over PROTO_FILES; returns {stub file name: its text}."""
    # Imported here, not at the top: grpc_tools is a test/development dependency, and the server
    # never needs it to run.
    import grpc_tools
    from grpc_tools import protoc

    well_known = Path(grpc_tools.__file__).parent / "_proto"
    with tempfile.TemporaryDirectory() as out:
        args = [
            "protoc",
            f"-I{proto_root}",
            f"-I{well_known}",
            f"--python_out={out}",
            f"--pyi_out={out}",
            f"--grpc_python_out={out}",
            *PROTO_FILES,
        ]
        status = protoc.main(args)
        if status != 0:
            raise ProtocError(f"protoc exited with {status} on {', '.join(PROTO_FILES)}")
        generated = Path(out) / "tpserve" / "v1"
        return {name: (generated / name).read_text() for name in STUB_NAMES}


def write_stubs(stub_dir: Path = STUB_DIR) -> list[Path]:
    """Writes the generated stubs into stub_dir; returns the paths written."""
    written = []
    for name, text in generate_stubs().items():
        path = stub_dir / name
        path.write_text(text)
        written.append(path)
    return written


def main() -> int:
    for path in write_stubs():
        print(f"wrote {path.relative_to(REPO_ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
