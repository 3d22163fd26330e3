"""bench.vllm_tests' table: a test that asserts the hub model's own answers reads as not applicable,
with its reason, even in a report from a run that ran it; every other outcome stands."""

from __future__ import annotations

from bench.vllm_tests.hub_model import HUB_MODEL_TESTS
from bench.vllm_tests.run import counts

CHAT = "tests/entrypoints/openai/chat_completion/test_chat.py"
REPORT = """<testsuites><testsuite>
<testcase classname="tests.entrypoints.openai.chat_completion.test_chat" name="test_complex_message_content">
<failure message="AssertionError: assert '1+1 = 2' == '2'"/></testcase>
<testcase classname="tests.entrypoints.openai.chat_completion.test_chat" name="test_custom_role"/>
<testcase classname="tests.entrypoints.openai.chat_completion.test_chat" name="test_long_seed">
<failure message="AssertionError: wording"/></testcase>
</testsuite></testsuites>"""


def test_a_hub_model_test_is_not_applicable_with_its_reason(tmp_path):
    (tmp_path / CHAT).parent.mkdir(parents=True)
    (tmp_path / CHAT).write_text("")
    (tmp_path / "report.xml").write_text(REPORT)
    table = counts(tmp_path / "report.xml")[CHAT]
    reason = HUB_MODEL_TESTS[f"{CHAT}::test_complex_message_content"]
    assert table["not applicable"] == [f"test_complex_message_content: not applicable: {reason}"]
    assert table["passed"] == ["test_custom_role"]
    assert table["failed"] == ["test_long_seed: AssertionError: wording"]
