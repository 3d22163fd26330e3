"""An unset temperature over the OpenAI HTTP API is vLLM's: the model's generation_config.json value,
else 1.0, or the serve config's default_temperature where set; gRPC's unset stays greedy. Against the
real daemon on the shipped model (SmolLM2-135M-Instruct, whose generation_config.json sets none).
"""

from __future__ import annotations

import openai
import pytest
from daemon import read_reply, running_daemon

from tpserve.server.config import ConfigError, load_config
from tpserve.server.generation_defaults import openai_temperature
from tpserve.v1 import serving_pb2

PROMPT = "Once upon a time"
SEEDS = (1, 2, 3, 4)
ARGS = ("--tp", "1", "--lanes", "2", "--context", "256")


def token_ids(client, **fields) -> list[int]:
    reply = client.completions.create(
        model=None,
        prompt=PROMPT,
        max_tokens=12,
        extra_body={"ignore_eos": True, "return_token_ids": True},
        **fields,
    )
    return reply.choices[0].model_extra["token_ids"]


def served_client(daemon) -> openai.OpenAI:
    return openai.OpenAI(base_url=daemon.http_url, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def daemon(default_model, tmp_path_factory):
    with running_daemon("spawn", default_model, tmp_path_factory.mktemp("temperature"), *ARGS) as served:
        yield served


def test_an_unset_temperature_samples_at_one_over_http_and_stays_greedy_over_grpc(daemon):
    with served_client(daemon) as client:
        greedy = token_ids(client, temperature=0)
        unset = {seed: token_ids(client, seed=seed) for seed in SEEDS}
        assert unset == {seed: token_ids(client, seed=seed, temperature=1.0) for seed in SEEDS}
        assert any(ids != greedy for ids in unset.values())  # sampled, not greedy
    request = serving_pb2.GenerateRequest(prompt=PROMPT, max_tokens=12, ignore_eos=True, seed=SEEDS[0])
    assert read_reply(daemon.stub.Generate(request, timeout=120)).token_ids == greedy


def test_default_temperature_sets_what_unset_means_over_http(default_model, tmp_path):
    args = (*ARGS, "--default-temperature", "0.5")
    with running_daemon("spawn", default_model, tmp_path, *args) as served, served_client(served) as client:
        unset = {seed: token_ids(client, seed=seed) for seed in SEEDS}
        assert unset == {seed: token_ids(client, seed=seed, temperature=0.5) for seed in SEEDS}
        assert unset != {seed: token_ids(client, seed=seed, temperature=1.0) for seed in SEEDS}


def test_the_models_temperature_then_one_unless_the_config_says(tmp_path):
    assert openai_temperature(tmp_path) == 1.0  # no generation_config.json
    (tmp_path / "generation_config.json").write_text('{"temperature": 0.6}')
    assert openai_temperature(tmp_path) == 0.6
    assert openai_temperature(tmp_path, override=0.0) == 0.0
    assert load_config(None, {"default_temperature": "0.3"}).default_temperature == 0.3
    assert load_config(None, {"default_temperature": "auto"}).default_temperature is None
    with pytest.raises(ConfigError, match="default_temperature: must be from 0 to 100, not 101"):
        load_config(None, {"default_temperature": "101"})
