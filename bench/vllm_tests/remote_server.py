"""The stand-in for vLLM's `tests.utils.RemoteOpenAIServer`: the tpserve daemon instead of `vllm serve`.

bench/vllm_tests/run.py copies this file to `tests/utils.py` in the directory it runs vLLM's tests
from, so their `from tests.utils import RemoteOpenAIServer` starts tpserve (one rank, the CPU) on
the model the run names. The test's model name becomes a served alias, so requests that name it are
answered. vLLM's serve flags are read where tpserve has the same setting and left out otherwise
(printed at start, so a reader of the log sees what was not carried over).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import httpx
import openai

from tpserve.ranks.local_ranks import free_port

HARNESS = Path(__file__).resolve().parent.parent / "harness.json"  # written by run.py
START_TIMEOUT_S = 600.0  # the default model's first start on a busy two-core machine
# vLLM's flags with a tpserve setting of the same meaning, and how many values each takes.
CARRIED = {
    "--max-model-len": "--context",
    "--served-model-name": "--served-model-name",
    "--chat-template": "--chat-template",
    "--tool-call-parser": "--tool-call-parser",
    "--reasoning-parser": "--reasoning-parser",
    "--api-key": "--api-key",
    "--max-logprobs": "--max-logprobs",
}
SWITCHES = {
    "--enforce-eager",
    "--enable-prompt-tokens-details",
    "--no-enable-prefix-caching",
    "--enable-lora",
}


def translate(model: str, vllm_args: list[str], num_lanes: int) -> tuple[list[str], list[str]]:
    """(tpserve's flags, vLLM's flags left out) for `vllm serve model *vllm_args`."""
    carried, dropped = ["--lanes", str(num_lanes)], []
    aliases = [model]
    i = 0
    while i < len(vllm_args):
        flag = vllm_args[i]
        name, _, inline = flag.partition("=")
        takes_value = name not in SWITCHES and not inline and i + 1 < len(vllm_args)
        value = inline or (vllm_args[i + 1] if takes_value and not vllm_args[i + 1].startswith("--") else "")
        step = 2 if value and not inline else 1
        if name == "--served-model-name":
            aliases.append(value)
        elif name in CARRIED:
            carried += [CARRIED[name], value]
        else:
            dropped.append(f"{name} {value}".strip())
        i += step
    return [*carried, "--served-model-name", ",".join(dict.fromkeys(aliases))], dropped


class RemoteOpenAIServer:
    DUMMY_API_KEY = "token-abc123"

    def __init__(self, model: str, vllm_serve_args: list[str], *, env_dict=None, seed=0, **_ignored):
        harness = json.loads(HARNESS.read_text())
        flags, dropped = translate(model, list(vllm_serve_args), harness["num_lanes"])
        self.host, self.port = "127.0.0.1", free_port()
        ports = ["--http-port", str(self.port), "--port", str(free_port())]
        ports += ["--metrics-port", str(free_port())]
        command = [harness["python"], "-m", "tpserve.cli", "serve", "--model", harness["model_dir"]]
        command += [*ports, "--device", "cpu", *flags, *harness["extra_args"]]
        print(f"tpserve for {model}: {' '.join(command)}\n  vLLM flags left out: {dropped}", flush=True)
        log_path = Path(harness["log_dir"]) / f"daemon-{self.port}.log"
        self._log = open(log_path, "wb")  # noqa: SIM115 (closed in shutdown)
        self.proc = subprocess.Popen(
            command, cwd=harness["repo"], env={**harness["env"], **(env_dict or {})}, stdout=self._log,
            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip
        self._wait_serving(log_path)

    def _wait_serving(self, log_path: Path) -> None:
        started = time.monotonic()
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"tpserve exited with {self.proc.returncode}; see {log_path}")
            try:
                if httpx.get(self.url_for("health"), timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() - started > START_TIMEOUT_S:
                self.shutdown()
                raise RuntimeError(f"tpserve did not serve within {START_TIMEOUT_S:g} s; see {log_path}")
            time.sleep(0.5)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()

    def shutdown(self) -> None:
        """The daemon's whole process group (rank 0 and what it started), SIGKILL after 30 s."""
        for signum, wait_s in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
            try:
                os.killpg(self.proc.pid, signum)
                self.proc.wait(wait_s)
                break
            except ProcessLookupError:
                break
            except subprocess.TimeoutExpired:
                continue
        self._log.close()

    @property
    def url_root(self) -> str:
        return f"http://{self.host}:{self.port}"

    def url_for(self, *parts: str) -> str:
        return self.url_root + "/" + "/".join(parts)

    def get_client(self, **kwargs) -> openai.OpenAI:
        kwargs.setdefault("timeout", 600)
        return openai.OpenAI(base_url=self.url_for("v1"), api_key=self.DUMMY_API_KEY, max_retries=0, **kwargs)

    def get_async_client(self, **kwargs) -> openai.AsyncOpenAI:
        kwargs.setdefault("timeout", 600)
        return openai.AsyncOpenAI(
            base_url=self.url_for("v1"), api_key=self.DUMMY_API_KEY, max_retries=0, **kwargs
        )
