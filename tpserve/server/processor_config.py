"""Which file of a checkpoint holds its image processor's settings, as transformers 4 and 5 save them.

transformers 4 writes `preprocessor_config.json` (the image processor's own fields); transformers 5's
`ProcessorMixin.save_pretrained` writes one `processor_config.json` with the image processor's fields
under "image_processor" (and the processor's own beside them: patch_size, image_token), and no
preprocessor_config.json. Where both are present, preprocessor_config.json is read, as transformers
reads it first. A video processor's settings are read in transformers' order: processor_config.json's
"video_processor", then `video_preprocessor_config.json`, then the image processor's file (a checkpoint
saved before video processors had their own file, as Qwen2.5-VL's own are).
"""

from __future__ import annotations

import json
from pathlib import Path

from tpserve.ranks.errors import ModelFileError

PREPROCESSOR_FILE = "preprocessor_config.json"  # transformers 4
PROCESSOR_FILE = "processor_config.json"  # transformers 5
VIDEO_PREPROCESSOR_FILE = "video_preprocessor_config.json"
IMAGE_PROCESSOR_KEY = "image_processor"
VIDEO_PROCESSOR_KEY = "video_processor"


def image_processor_settings(model_dir: str | Path) -> tuple[dict, Path]:
    """The image processor's fields and the file they came from (for errors naming it)."""
    model_dir = Path(model_dir)
    preprocessor = model_dir / PREPROCESSOR_FILE
    if preprocessor.is_file():
        return _json_object(preprocessor), preprocessor
    processor = model_dir / PROCESSOR_FILE
    if processor.is_file():
        settings = _json_object(processor).get(IMAGE_PROCESSOR_KEY)
        if not isinstance(settings, dict):
            raise ModelFileError(
                processor, f"holds no {IMAGE_PROCESSOR_KEY!r} object (and there is no {PREPROCESSOR_FILE})"
            )
        return settings, processor
    raise ModelFileError(
        preprocessor,
        f"missing, and so is {PROCESSOR_FILE} (a vision model needs its image processor's config)",
    )


def video_processor_settings(model_dir: str | Path) -> tuple[dict, Path]:
    """The video processor's fields and the file they came from."""
    model_dir = Path(model_dir)
    processor = model_dir / PROCESSOR_FILE
    if processor.is_file():
        settings = _json_object(processor).get(VIDEO_PROCESSOR_KEY)
        if isinstance(settings, dict):
            return settings, processor
    video = model_dir / VIDEO_PREPROCESSOR_FILE
    if video.is_file():
        return _json_object(video), video
    return image_processor_settings(model_dir)


def processor_field(model_dir: str | Path, key: str) -> tuple[object, Path]:
    """A processor's own field (Idefics3's image_seq_len) from processor_config.json, None where the
    file or the field is missing, and the file."""
    processor = Path(model_dir) / PROCESSOR_FILE
    return (_json_object(processor).get(key) if processor.is_file() else None), processor


def _json_object(path: Path) -> dict:
    try:
        raw = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ModelFileError(path, f"not valid JSON ({error})") from None
    if not isinstance(raw, dict):
        raise ModelFileError(path, "not a JSON object")
    return raw
