"""The serving config and the engine's settings: one set of defaults, and every engine setting a flag."""

from __future__ import annotations

from dataclasses import fields

import pytest

from tpserve.ranks.settings import EngineSettings
from tpserve.server.config import ENGINE_KEYS, ENGINE_NAMES, ConfigError, ServeConfig, load_config


def test_engine_tests_run_with_the_daemons_defaults():
    # An engine-level test that leaves a setting alone (EngineSettings(model_dir=...)) gets what
    # `tpserve serve` with no flags and no YAML gives the ranks.
    served = load_config(None, {}, environ={}).engine_settings("model")
    assert served == EngineSettings(model_dir="model") == ServeConfig().engine_settings("model")
    assert (served.prefix_caching, served.draft_tokens, served.init_timeout_s) == (True, None, 120.0)


def test_every_engine_setting_is_a_config_key_and_reaches_the_engine_under_its_name():
    drills_set_in_code = {"model_dir", "shape_dependent_on_rank"}
    engine_names = {f.name for f in fields(EngineSettings)} - drills_set_in_code
    assert {ENGINE_NAMES.get(key, key) for key in ENGINE_KEYS} == engine_names
    flags = {"tp": "1", "lanes": "3", "context": "512", "prefix_caching": "false", "init_timeout_s": "9"}
    settings = load_config(None, flags, environ={}).engine_settings("model")
    assert (settings.tp_size, settings.num_lanes, settings.context_size) == (1, 3, 512)
    assert (settings.prefix_caching, settings.init_timeout_s) == (False, 9.0)
    drill = load_config(None, {"refuse_token_on_rank": "1,300"}, environ={}).engine_settings("model")
    assert drill.refuse_token_on_rank == (1, 300)


def test_a_retired_key_says_what_took_its_place(tmp_path):
    path = tmp_path / "old.yaml"
    path.write_text("cache_budget_bytes: 0\n")
    with pytest.raises(ConfigError, match="'cache_budget_bytes' is gone: .*prefix_caching"):
        load_config(str(path), {})
