"""The root conftest.py of a run of vLLM's OpenAI-server tests against tpserve (copied there by run.py).

What vLLM's test files import from vLLM itself is stood in for here, with no vLLM installed:
- `vllm.tokenizers.get_tokenizer` (and its older home `vllm.transformers_utils.tokenizer`) and
  `vllm.config.ModelConfig(...).get_vocab_size()` answer for the model tpserve serves, whatever
  name the test gives: the tests compare the server's tokens with the tokenizer's.
- Every other `vllm.*` name imports as a stand-in whose use skips the test as not applicable
  ("uses vLLM internals"): those tests check vLLM's own classes, not its server's answers.
- `huggingface_hub.snapshot_download` and vLLM's `hf_api().snapshot_download` (LoRA adapters)
  download nothing: tests of LoRA adapters are not applicable, and are skipped by their parameter.
- The tests that assert the hub model's own answers (hub_model.py, passed in harness.json) are
  skipped as not applicable, naming why.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import json
import sys
import types
from pathlib import Path

import huggingface_hub
import pytest
from transformers import AutoTokenizer

HARNESS = json.loads((Path(__file__).resolve().parent / "harness.json").read_text())
NOT_APPLICABLE = "not applicable"


def get_tokenizer(tokenizer_name: str = "", *args, **kwargs):
    return AutoTokenizer.from_pretrained(HARNESS["model_dir"])


class ModelConfig:
    def __init__(self, model: str = "", **kwargs):
        self._config = json.loads((Path(HARNESS["model_dir"]) / "config.json").read_text())

    def get_vocab_size(self) -> int:
        return self._config["vocab_size"]


class _Internal:
    """A name from vLLM's own code: using it skips the test."""

    def __init__(self, name: str):
        self._name = name

    def __call__(self, *args, **kwargs):
        pytest.skip(f"{NOT_APPLICABLE}: uses vLLM internals ({self._name})")

    def __getattr__(self, attribute: str):
        return _Internal(f"{self._name}.{attribute}")

    def __mro_entries__(self, bases):
        return (object,)

    def _skip(self, *args):
        pytest.skip(f"{NOT_APPLICABLE}: uses vLLM internals ({self._name})")

    # A value read from vLLM's own code (envs.VLLM_MAX_N_SEQUENCES + 1) skips where it is used too.
    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = _skip
    __lt__ = __le__ = __gt__ = __ge__ = __int__ = __index__ = __float__ = _skip


class _StandInModule(types.ModuleType):
    def __getattr__(self, attribute: str):
        if attribute.startswith("__"):
            raise AttributeError(attribute)
        return _Internal(f"{self.__name__}.{attribute}")


class _HubApi:
    """vLLM's hf_api() (vllm.transformers_utils.repo_utils), where newer tests fetch LoRA adapters."""

    def snapshot_download(self, repo_id: str, *args, **kwargs) -> str:
        return _no_download(repo_id)


STAND_INS = {
    "vllm.transformers_utils.repo_utils": {"hf_api": lambda: _HubApi()},
    "vllm.tokenizers": {"get_tokenizer": get_tokenizer},
    "vllm.transformers_utils.tokenizer": {"get_tokenizer": get_tokenizer},
    "vllm.config": {"ModelConfig": ModelConfig},
}


class _VllmFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path, target=None):
        if fullname == "vllm" or fullname.startswith("vllm."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _StandInModule(spec.name)
        module.__path__ = []
        module.__dict__.update(STAND_INS.get(spec.name, {}))
        return module

    def exec_module(self, module):
        pass


sys.meta_path.insert(0, _VllmFinder())


def _no_download(repo_id: str, *args, **kwargs) -> str:
    return str(Path(HARNESS["log_dir"]) / "not-downloaded" / repo_id)


huggingface_hub.snapshot_download = _no_download


@pytest.fixture
def sample_structured_outputs_choices():
    """The newer name of tests/entrypoints/conftest.py's choice list, where a checkout lacks it."""
    return ["Python", "Java", "JavaScript", "C++", "C#", "PHP", "TypeScript", "Ruby", "Swift", "Kotlin"]


def pytest_collection_modifyitems(config, items) -> None:
    hub_model = HARNESS.get("not_applicable", {})
    for item in items:
        if item.nodeid in hub_model:
            item.add_marker(pytest.mark.skip(reason=f"{NOT_APPLICABLE}: {hub_model[item.nodeid]}"))
            continue
        params = getattr(getattr(item, "callspec", None), "params", {})
        if any("lora" in str(value).lower() for value in params.values()):
            item.add_marker(pytest.mark.skip(reason=f"{NOT_APPLICABLE}: a LoRA adapter"))
