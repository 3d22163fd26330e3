"""vLLM's tests that assert what the test's own hub model answers: not applicable to another model.

The issue counts as applicable what needs no GPU, LoRA, vLLM internals or hub model. A test is
listed here only where an assertion holds for that one checkpoint's tokenizer, template or weights
(a prompt's token count, an exact reply text), so no server serving a different model could pass
it; a test a capable small model could pass stays applicable, and counts when it fails.
Keys are pytest node ids under the checkout's root; run.py skips them and names the reason.
"""

from __future__ import annotations

CHAT = "tests/entrypoints/openai/chat_completion/test_chat.py"
COMPLETION = "tests/entrypoints/openai/completion/test_completion.py"
ZEPHYR = "HuggingFaceH4/zephyr-7b-beta"

HUB_MODEL_TESTS: dict[str, str] = {
    f"{COMPLETION}::test_completion_streaming[Qwen/Qwen3-0.6B]": (
        "asserts the greedy reply to 'What is an LLM?' runs its 5 tokens (finish_reason length), "
        "as Qwen3-0.6B's does; SmolLM2-135M-Instruct's likeliest first token is <|im_end|>"
    ),
    f"{CHAT}::test_more_than_one_prompt_logprobs_chat[{ZEPHYR}]": (
        "asserts prompt_logprobs=1 gives one entry at prompt position 3: zephyr-7b-beta's likeliest "
        "token there is the prompt's; SmolLM2's is '#', so the row holds it and the prompt's 'You'"
    ),
    f"{CHAT}::test_single_chat_session[{ZEPHYR}]": (
        "asserts prompt_tokens=37, the length of its chat in zephyr-7b-beta's template and tokenizer"
    ),
    f"{CHAT}::test_complex_message_content": (
        "asserts zephyr-7b-beta's exact reply, '2', to a greedy 1+1 question"
    ),
}
