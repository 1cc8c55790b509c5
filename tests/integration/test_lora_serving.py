"""LoRA adapters on the real ``edit`` ensemble (the session's tritonserver): ``LORAS`` over gRPC and Triton's HTTP
generate endpoint changes the image, equals the in-process run (``maskedit.local``) with the same adapter, and a bad
adapter is INVALID_ARGUMENT naming LORAS while a good request beside it succeeds."""

import base64
import json
import urllib.error
import urllib.request

import numpy as np
import pytest

from maskedit.local import LocalEditor
from maskedit_client import EditError
from tests.conftest import png

ADAPTER = ("attn-mlp-r16", 0.8)


@pytest.fixture(scope="module")
def local(settings, adapters):
    ed = LocalEditor(settings)
    yield ed
    ed.close()


def _pixels(png_bytes) -> np.ndarray:
    from PIL import Image
    import io

    return np.asarray(Image.open(io.BytesIO(png_bytes)), dtype=int)


def _generate(server, body):
    req = urllib.request.Request(f"http://{server.http_url}/v2/models/edit/generate", data=json.dumps(body).encode(),
                                 method="POST")
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_an_adapter_over_grpc_and_http_generate_changes_the_image_as_the_local_run_does(
        server, client, local, template_img, box_mask):
    kw = dict(seed=4, steps=2, use_cache=False)
    plain = client.edit(template_img, box_mask, "a red hat", **kw)
    served = client.edit(template_img, box_mask, "a red hat", loras=[ADAPTER], **kw)
    ref, _, _ = local.edit(png(template_img), png(box_mask), "a red hat", loras=[ADAPTER], **kw)
    a, b, r = _pixels(plain.png), _pixels(served.png), _pixels(ref)
    assert np.abs(b - a).max() > 10, "the adapter must change the edit"
    assert np.abs(b - r).max() <= 1, "served with the adapter = the in-process run with it"
    assert served.info.get("cache") in (None, "off")
    status, out = _generate(server, {"TEMPLATE": base64.b64encode(png(template_img)).decode(),
                                     "MASK": base64.b64encode(png(box_mask)).decode(), "PROMPT": "a red hat",
                                     "SEED": 4, "STEPS": 2, "USE_CACHE": False,
                                     "LORAS": json.dumps([{"name": ADAPTER[0], "scale": ADAPTER[1]}])})
    assert status == 200, out
    assert np.abs(_pixels(base64.b64decode(out["IMAGE"])) - b).max() <= 1


BAD = {
    "unknown": ('[{"name": "no-such-adapter"}]', "unknown adapter 'no-such-adapter'"),
    "malformed": ('[{"name": "attn-r4", ', "not valid JSON"),
    "too_many": (json.dumps([{"name": f"a{i}"} for i in range(5)]), "above the limit of 4"),
    "scale": ('[{"name": "attn-r4", "scale": 9}]', "scale must be between"),
    "path": ('[{"name": "../attn-r4"}]', "names, not paths"),
}


def test_bad_adapters_are_invalid_argument_naming_loras_while_a_good_request_beside_them_succeeds(
        server, client, adapters, template_img, box_mask):
    good = client.submit(template_img, box_mask, "a hat", seed=2, steps=2, loras=[("attn-r4", 0.5)])
    bad = {k: client.submit(template_img, box_mask, "a hat", seed=2, steps=2, loras=v) for k, (v, _) in BAD.items()}
    for case, fut in bad.items():
        with pytest.raises(EditError) as e:
            fut.result(120)
        assert e.value.code == "INVALID_ARGUMENT" and e.value.field == "LORAS", (case, str(e.value))
        assert BAD[case][1] in str(e.value), (case, str(e.value))
    assert good.result(120).image.size == template_img.size
    status, out = _generate(server, {"TEMPLATE": base64.b64encode(png(template_img)).decode(),
                                     "MASK": base64.b64encode(png(box_mask)).decode(), "PROMPT": "a hat",
                                     "STEPS": 2, "LORAS": BAD["unknown"][0]})
    assert status == 400 and "LORAS" in out["error"] and "no-such-adapter" in out["error"], out
