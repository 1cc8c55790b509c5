import base64

from maskedit_common.wire import maybe_base64
from tests.conftest import png


def test_base64_is_detected_and_raw_is_left_alone(template_img):
    raw = png(template_img)
    assert maybe_base64(raw) == (raw, False)
    assert maybe_base64(base64.b64encode(raw)) == (raw, True)
    assert maybe_base64(b"???") == (b"???", False)
