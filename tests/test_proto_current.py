"""The committed gRPC stubs in tpserve/v1/ match proto/tpserve/v1/serving.proto."""

from __future__ import annotations

from tpserve import protogen


def test_committed_stubs_match_the_proto():
    stale = [
        name
        for name, text in protogen.generate_stubs().items()
        if (protogen.STUB_DIR / name).read_text() != text
    ]
    assert not stale, f"stubs out of date: {stale}; run `python -m tpserve.protogen` and commit them"


def test_stub_imports_its_messages_by_package_path():
    # Generated with -Iproto, the service stub imports the messages as `tpserve.v1.serving_pb2`,
    # which is where the installed package puts them.
    text = (protogen.STUB_DIR / "serving_pb2_grpc.py").read_text()
    assert "from tpserve.v1 import serving_pb2" in text
