"""Keys and TLS on the router in front of a real tritonserver: the project's client with its key and the CA
edits, without them it gets UNAUTHENTICATED / a transport error; Triton's HTTP protocol answers 401 / 403; the
official ``openai`` client with ``api_key=`` edits, with a wrong key gets 401, a user key on an adapter route 403;
an admin key loads an adapter from the configured source directory (never from elsewhere), every backend serves it
through the ``lora`` field at once, and unloads it."""

import base64
import io
import json
import shutil
import ssl
import urllib.error
import urllib.request

import numpy as np
import openai
import pytest
from PIL import Image

from maskedit.launcher import free_port
from maskedit_client import EditClient, EditError
from maskedit_lab.harness.cluster import running_backends
from maskedit_router.__main__ import build, serve
from maskedit_router.access.auth import Keyring
from maskedit_router.access.tls import TlsFiles
from maskedit_router.frontends.lora_admin import AdapterAdmin
from maskedit_router.frontends.openai_api import OpenAIServer
from maskedit_router.proxy.health import HealthChecker
from tests.conftest import png
from tests.tls_certs import make_cert

USER, ADMIN = "sk-user-0123456789abcdef", "sk-admin-0123456789abcdef"


@pytest.fixture(scope="module")
def secured(settings, adapters, tmp_path_factory):
    d = tmp_path_factory.mktemp("security")
    keys = d / "keys.txt"
    keys.write_text(f"{USER} acme user\n{ADMIN} ops admin\n")
    cert, key = make_cert(d / "tls")
    tls = TlsFiles.of(cert, key)
    # the backends' adapter library starts empty; adapters come in from the source directory at runtime
    library, incoming = d / "loras", d / "incoming"
    library.mkdir()
    shutil.copytree(adapters / "attn-mlp-r16", incoming / "attn-mlp-r16")
    env = {"MASKEDIT_MODEL_DIR": str(settings.model_dir), "MASKEDIT_LORA_DIR": str(library)}
    with running_backends(1, d, env) as (servers, _):
        router = build([s.grpc_url for s in servers])
        ring = Keyring(keys)
        http_port, openai_port = free_port(), free_port()
        srv, port, httpd = serve(router, 0, http_port, keyring=ring, tls=tls)
        checker = HealthChecker(router).start()
        api = OpenAIServer(f"127.0.0.1:{srv.loopback_port}", openai_port, keyring=ring,
                           ssl_context=tls.ssl_context(), admin=AdapterAdmin(library, [incoming])).start()
        try:
            yield {"url": f"127.0.0.1:{port}", "cert": cert, "http": http_port, "openai": openai_port,
                   "incoming": incoming, "library": library, "backend": servers[0].grpc_url}
        finally:
            api.stop()
            checker.stop()
            srv.stop(grace=1).wait(10)
            httpd.shutdown()


def test_the_client_with_its_key_and_the_ca_edits_and_without_them_fails(secured, template_img, box_mask):
    with EditClient(secured["url"], api_key=USER, ca_file=secured["cert"], timeout_s=120) as c:
        r = c.edit(template_img, box_mask, "a red hat", seed=1, steps=2)
        assert r.image.size == (256, 256)
    with EditClient(secured["url"], ca_file=secured["cert"], timeout_s=30, retry=False) as c:
        with pytest.raises(EditError) as e:
            c.edit(template_img, box_mask, "a red hat", seed=1, steps=2)
        assert e.value.code == "UNAUTHENTICATED"
    with EditClient(secured["url"], api_key="sk-wrong-0123456789abc", ca_file=secured["cert"], retry=False) as c:
        with pytest.raises(EditError) as e:
            c.edit(template_img, box_mask, "a red hat", seed=1, steps=2)
        assert e.value.code == "UNAUTHENTICATED", str(e.value)
    with EditClient(secured["url"], api_key=USER, timeout_s=10, retry=False) as c:  # plaintext on a TLS port
        with pytest.raises(EditError) as e:
            c.edit(template_img, box_mask, "a red hat", seed=1, steps=2, timeout_s=10)
        assert e.value.code == "UNAVAILABLE"


def test_the_backend_learns_the_tenant_from_the_key_never_from_the_client(secured, template_img, box_mask):
    """The router names the key's tenant (and weight) to the backend in request parameters, over whatever the
    client put there (stream and unary paths); the backend's queue shares itself by it (``maskedit.fair_share``).
    A direct client's malformed tenant parameter is refused naming it."""
    import tritonclient.grpc as grpcclient
    from maskedit_client.inputs import bytes_input as _bytes_input, scalar_input as _scalar_input

    with EditClient(secured["url"], api_key=USER, ca_file=secured["cert"], timeout_s=120) as c:
        assert c.edit(template_img, box_mask, "a hat", seed=1, steps=1).info["tenant"] == "acme"

    def inputs():
        return [_bytes_input("TEMPLATE", png(template_img)), _bytes_input("MASK", png(box_mask)),
                _bytes_input("PROMPT", b"a hat"), _scalar_input("STEPS", 1, "INT32", np.int32)]

    def stream(url, parameters, **kw):  # the raw Triton protocol (the edit model is decoupled: a stream)
        import queue
        got = queue.Queue()
        tc = grpcclient.InferenceServerClient(url, **kw.pop("client", {}))
        tc.start_stream(lambda result, error: got.put((result, error)), **kw)
        tc.async_stream_infer("edit", inputs(), parameters=parameters)
        result, error = got.get(timeout=120)
        tc.stop_stream()
        tc.close()
        return result, error

    claimed = {"maskedit_tenant": "ops", "maskedit_tenant_weight": 50.0}
    r, err = stream(secured["url"], claimed, headers={"authorization": f"Bearer {USER}"},
                    client={"ssl": True, "root_certificates": str(secured["cert"])})
    assert err is None, err
    info = __import__("json").loads(r.as_numpy("EDIT_INFO").reshape(-1)[0])
    assert (info["tenant"], info["tenant_weight"]) == ("acme", 1.0)  # the key's, not the claimed
    _, err = stream(secured["backend"], {"maskedit_tenant": "not a name!"})
    assert "maskedit_tenant: must be a tenant name" in str(err), err


def _https(secured, path, key=None, method="GET"):
    req = urllib.request.Request(f"https://127.0.0.1:{secured['http']}{path}", method=method,
                                 data=b"" if method == "POST" else None,
                                 headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(req, timeout=30, context=ssl.create_default_context(
                cafile=str(secured["cert"]))) as r:
            return r.status, r.headers, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers, e.read()


def test_triton_http_protocol_answers_401_without_a_key_and_403_for_a_user_on_model_load(secured):
    code, headers, _ = _https(secured, "/v2/models/edit")
    assert code == 401 and headers["WWW-Authenticate"] == "Bearer"
    assert _https(secured, "/v2/models/edit", "sk-nope-0123456789abcd")[0] == 401
    code, _, body = _https(secured, "/v2/models/edit", USER)
    assert code == 200 and b'"edit"' in body
    assert _https(secured, "/v2/repository/models/edit/load", USER, "POST")[0] == 403
    assert _https(secured, "/health")[0] == 200  # the probe stays open
    assert _https(secured, "/v2/health/ready")[0] == 200


def test_the_openai_client_with_api_key_edits(secured, template_img, box_mask):
    http = openai.DefaultHttpxClient(verify=ssl.create_default_context(cafile=str(secured["cert"])))
    base = f"https://127.0.0.1:{secured['openai']}/v1"
    client = openai.OpenAI(base_url=base, api_key=USER, max_retries=0, timeout=120, http_client=http)
    r = client.images.edit(image=("t.png", io.BytesIO(png(template_img)), "image/png"),
                           mask=("m.png", io.BytesIO(png(box_mask)), "image/png"), prompt="a hat",
                           extra_body={"seed": 3, "steps": 2})
    img = np.asarray(Image.open(io.BytesIO(base64.b64decode(r.data[0].b64_json))))
    assert img.shape[:2] == (256, 256)
    wrong = openai.OpenAI(base_url=base, api_key="sk-wrong-0123456789abc", max_retries=0, timeout=30,
                          http_client=http)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
    http.close()


def test_an_admin_loads_an_adapter_every_backend_serves_through_the_lora_field_and_unloads_it(
        secured, template_img, box_mask):
    http = openai.DefaultHttpxClient(verify=ssl.create_default_context(cafile=str(secured["cert"])))
    base = f"https://127.0.0.1:{secured['openai']}/v1"
    user = openai.OpenAI(base_url=base, api_key=USER, max_retries=0, timeout=120, http_client=http)
    admin = openai.OpenAI(base_url=base, api_key=ADMIN, max_retries=0, timeout=60, http_client=http)
    load = {"lora_name": "uploaded", "lora_path": str(secured["incoming"] / "attn-mlp-r16")}
    with pytest.raises(openai.PermissionDeniedError):
        user.post("/load_lora_adapter", body=load, cast_to=object)
    with pytest.raises(openai.BadRequestError) as e:  # outside the source directories: refused, never opened
        admin.post("/load_lora_adapter", body={"lora_name": "x", "lora_path": "/etc/passwd"}, cast_to=object)
    assert e.value.body["param"] == "lora_path"

    def edit(lora):
        r = user.images.edit(image=("t.png", io.BytesIO(png(template_img)), "image/png"),
                             mask=("m.png", io.BytesIO(png(box_mask)), "image/png"), prompt="a hat",
                             extra_body={"seed": 5, "steps": 2, "lora": json.dumps(lora)})
        return np.asarray(Image.open(io.BytesIO(base64.b64decode(r.data[0].b64_json))), dtype=int)

    with pytest.raises(openai.BadRequestError) as e:  # not loaded yet
        edit({"name": "uploaded", "scale": 0.8})
    assert e.value.body["param"] == "lora" and "uploaded" in e.value.body["message"]
    assert admin.post("/load_lora_adapter", body=load, cast_to=object)["status"] == "loaded"
    assert admin.post("/load_lora_adapter", body=load, cast_to=object)["status"] == "already loaded"
    assert "uploaded" in [m.id for m in user.models.list().data]
    served = edit({"name": "uploaded", "scale": 0.8})
    with EditClient(secured["url"], api_key=USER, ca_file=secured["cert"], timeout_s=120) as c:
        plain = np.asarray(c.edit(template_img, box_mask, "a hat", seed=5, steps=2).image, dtype=int)
    assert np.abs(served - plain).max() > 10  # the adapter is applied
    with pytest.raises(openai.PermissionDeniedError):
        user.post("/unload_lora_adapter", body={"lora_name": "uploaded"}, cast_to=object)
    assert admin.post("/unload_lora_adapter", body={"lora_name": "uploaded"}, cast_to=object)["status"] == "unloaded"
    with pytest.raises(openai.NotFoundError):
        admin.post("/unload_lora_adapter", body={"lora_name": "uploaded"}, cast_to=object)
    with pytest.raises(openai.BadRequestError):
        edit({"name": "uploaded", "scale": 0.8})
    assert "uploaded" not in [m.id for m in user.models.list().data]
    http.close()
