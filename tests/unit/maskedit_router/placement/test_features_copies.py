"""Reading a request's routing features copies no more of it than the message hands out: the template is hashed
through a view, in turn with the settings that key it (the key: xxh3-128 of template + settings)."""

import struct
import tracemalloc

import numpy as np
import xxhash
from tritonclient.grpc._utils import _get_inference_request

from maskedit_client.inputs import edit_inputs
from maskedit_router.placement.features import extract
from tests.conftest import png

TEMPLATE = np.random.default_rng(0).integers(0, 256, (1024, 1024, 3), np.uint8)  # noise: a PNG of ~3 MB


def _request():
    mask = np.zeros((64, 64), np.uint8)
    mask[8:24, 8:40] = 255
    inputs = edit_inputs(png(TEMPLATE), png(mask), "a hat", steps=20, seed=3)
    return _get_inference_request("edit", inputs, "", "r", None, 0, False, False, 0, None, None)


def _blob(req, name):
    i = [t.name for t in req.inputs].index(name)
    blob = req.raw_input_contents[i]
    return blob[4:4 + struct.unpack("<I", blob[:4])[0]]


def test_the_template_key_is_the_hash_of_the_template_and_its_settings():
    req = _request()
    assert len(req.raw_input_contents) == len(req.inputs)  # raw inputs, as tritonclient sends them
    steps = np.frombuffer(req.raw_input_contents[[t.name for t in req.inputs].index("STEPS")], np.int32)[0]
    settings = f"STEPS={steps};".encode()
    for name in ("GUIDANCE", "TEMPLATE_SEED", "PADDING_MASK_CROP"):
        assert name not in [t.name for t in req.inputs]  # (else they key it too)
    assert extract(req, 512).template_key == xxhash.xxh3_128(_blob(req, "TEMPLATE") + settings).hexdigest()[:20]


def test_reading_the_features_copies_the_template_at_most_once():
    req = _request()
    size = len(_blob(req, "TEMPLATE"))
    assert size > 1 << 20
    extract(req, 512)  # (imports, caches)
    tracemalloc.start()
    try:
        extract(req, 512)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # the message hands out its bytes as a copy (protobuf); a slice and a template + settings copy came on top
    assert peak < 1.5 * size, f"{peak / size:.1f} template sizes allocated at once"
