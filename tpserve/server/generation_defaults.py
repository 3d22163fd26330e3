"""The model's own sampling defaults, from generation_config.json in its directory when present, as
vLLM's `--generation-config auto` reads them: temperature, top_p, top_k, min_p and repetition_penalty.

A request's unset sampling field takes the model's value, else tpserve's own default (greedy, no
filters). The OpenAI HTTP API's unset temperature is vLLM's instead (openai_temperature): the
serve config's default_temperature, else the model's, else 1.0. Read once at start-up; a value outside what a request may set refuses to start, naming the
file, rather than serving a default no request could ask for.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from tpserve.kernels.sampling_params import SamplingParams
from tpserve.ranks.errors import UserError

FILE_NAME = "generation_config.json"
OPENAI_TEMPERATURE = 1.0  # vLLM's (and OpenAI's) unset temperature where the model sets none
_RANGES = {  # what validation lets a request set (tpserve/server/validation.py)
    "temperature": (0.0, 100.0),
    "top_p": (1e-9, 1.0),
    "min_p": (0.0, 1.0),
    "repetition_penalty": (1e-9, 10.0),
}


def generation_defaults(model_dir: str | Path) -> SamplingParams:
    """SamplingParams holding the model directory's defaults (tpserve's where the file sets none)."""
    return SamplingParams(**_model_values(model_dir))


def openai_temperature(model_dir: str | Path, override: float | None = None) -> float:
    """An unset temperature over the OpenAI HTTP API, as vLLM's: `override` (the serve config's
    default_temperature), else the model's generation_config.json, else 1.0 (gRPC's: the model's,
    else greedy)."""
    if override is not None:
        return override
    return _model_values(model_dir).get("temperature", OPENAI_TEMPERATURE)


def _model_values(model_dir: str | Path) -> dict:
    """The sampling fields generation_config.json sets, checked; {} without the file."""
    path = Path(model_dir) / FILE_NAME
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise UserError(f"{path}: not a readable JSON file ({error})") from None
    if not isinstance(config, dict):
        raise UserError(f"{path}: not a JSON object")
    values: dict = {}
    for name, (low, high) in _RANGES.items():
        value = config.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise UserError(f"{path}: {name} {value!r} is not a number")
        if not low <= value <= high:
            raise UserError(f"{path}: {name} {value!r} is outside what a request may set")
        values[name] = float(value)
    top_k = config.get("top_k")
    if top_k is not None:
        if isinstance(top_k, bool) or not isinstance(top_k, int):
            raise UserError(f"{path}: top_k {top_k!r} is not an integer")
        values["top_k"] = max(0, top_k)  # transformers' and vLLM's off values (0, -1) are tpserve's 0
    return values
