"""The pipeline's ``Qwen2VLProcessor`` where torchvision is missing.

``transformers`` 5 builds a ``Qwen2VLProcessor`` from an image processor, a tokenizer *and a video processor*, and
its video processors need torchvision; torchvision's wheels on PyPI are CUDA builds that do not import beside a CPU
torch. The pipeline never passes videos, so where torchvision is missing the family hands ``from_pretrained`` a
``Qwen2VLProcessor`` without one (``ImageOnlyProcessor``: the same class, its constructor's class check told that
the video slot is empty), made from the model's own ``processor/`` files; the stock pipeline in the tests gets the
same. Where torchvision imports (a CUDA host), ``from_pretrained`` loads the processor itself.

The files are the layout ``Qwen2VLProcessor.save_pretrained`` writes (tokenizer files, ``preprocessor_config.json``,
``video_preprocessor_config.json``, ``processor_config.json``), so either host loads them.
"""

from __future__ import annotations

import json
from pathlib import Path

from transformers import Qwen2VLProcessor

CLASS_NAME = "Qwen2VLProcessor"  # what model_index.json and processor_config.json name


class ImageOnlyProcessor(Qwen2VLProcessor):
    """``Qwen2VLProcessor`` with no video processor (images and text only)."""

    def check_argument_for_proper_class(self, argument_name, argument):
        if argument_name == "video_processor" and argument is None:
            return None
        return super().check_argument_for_proper_class(argument_name, argument)

    def save_pretrained(self, save_directory, push_to_hub: bool = False, **kwargs):
        save_processor(self, Path(save_directory))
        return [str(Path(save_directory) / "processor_config.json")]


def save_processor(processor, d: Path) -> None:
    """Write ``processor``'s files as ``Qwen2VLProcessor.save_pretrained`` lays them out; its video processor's
    config is written from the image processor's settings (what the class would hold)."""
    d.mkdir(parents=True, exist_ok=True)
    processor.tokenizer.save_pretrained(d)
    ip = processor.image_processor
    ip.save_pretrained(d)
    video = {"video_processor_type": "Qwen2VLVideoProcessor", "patch_size": ip.patch_size,
             "temporal_patch_size": ip.temporal_patch_size, "merge_size": ip.merge_size, "size": dict(ip.size),
             "processor_class": CLASS_NAME}
    (d / "video_preprocessor_config.json").write_text(json.dumps(video, indent=2))
    (d / "processor_config.json").write_text(json.dumps({"processor_class": CLASS_NAME}, indent=2))
    for f in ("tokenizer_config.json", "preprocessor_config.json"):  # the processor class they belong to
        cfg = json.loads((d / f).read_text())
        cfg["processor_class"] = CLASS_NAME
        (d / f).write_text(json.dumps(cfg, indent=2))


def torchvision_imports() -> bool:
    from transformers.utils import is_torchvision_available

    return is_torchvision_available()


def load_processor(d: Path) -> ImageOnlyProcessor:
    """The processor saved in ``d`` without a video processor (its image processor and tokenizer from their files)."""
    from transformers import AutoImageProcessor, AutoTokenizer

    return ImageOnlyProcessor(image_processor=AutoImageProcessor.from_pretrained(d),
                              tokenizer=AutoTokenizer.from_pretrained(d), video_processor=None)
