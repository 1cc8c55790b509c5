"""Runtime adapter loading (``lora_admin``, the OpenAI port's ``/v1/load_lora_adapter`` and
``/v1/unload_lora_adapter``): only paths inside the configured roots (symlinks resolved), installed into the library
the backends read (their ``AdapterLibrary`` finds it with the same bytes), identical reloads are no-ops, conflicts
400, unknown unloads 404, the operator's own adapters stay; admin keys only on the HTTP routes."""

import json
import os
import urllib.error
import urllib.request

import numpy as np
import pytest
from safetensors.numpy import save_file

from maskedit.adapters.library import AdapterLibrary
from maskedit_common.loras import LoraRef, library_names
from maskedit_router.auth import Keyring
from maskedit_router.lora_admin import MARKER, AdapterAdmin, AdminError
from maskedit_router.openai_api import OpenAIServer

USER, ADMIN = "sk-user-0123456789abcdef", "sk-admin-0123456789abcdef"


def _adapter(path, seed=0):
    rng = np.random.default_rng(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({"transformer.x.lora_A.weight": rng.standard_normal((4, 8), dtype=np.float32),
               "transformer.x.lora_B.weight": rng.standard_normal((8, 4), dtype=np.float32)}, str(path))
    return path


@pytest.fixture
def lib(tmp_path):
    library, src = tmp_path / "loras", tmp_path / "incoming"
    _adapter(library / "static" / "pytorch_lora_weights.safetensors", seed=9)
    _adapter(src / "style-a" / "pytorch_lora_weights.safetensors", seed=1)
    _adapter(src / "style-b.safetensors", seed=2)
    (tmp_path / "secret").mkdir()
    _adapter(tmp_path / "secret" / "x.safetensors", seed=3)
    return AdapterAdmin(library, [src], reserved=["edit"]), library, src, tmp_path


def _refused(fn, body, status, param):
    with pytest.raises(AdminError) as e:
        fn(body)
    assert e.value.status == status and e.value.param == param, (e.value.status, str(e.value))
    assert str(e.value).startswith(f"{param}: ") if param else True
    return str(e.value)


def test_load_installs_into_the_library_the_backends_read_and_unload_removes_it(lib):
    admin, library, src, _ = lib
    out = admin.load({"lora_name": "style-a", "lora_path": str(src / "style-a")})
    assert out["status"] == "loaded"
    out_b = admin.load({"lora_name": "b", "lora_path": "style-b.safetensors"})  # relative: to the first root
    assert out_b["status"] == "loaded"
    assert library_names(library) == ["b", "static", "style-a"]
    backend = AdapterLibrary(library)  # what preprocess and denoise resolve names with
    (r,) = backend.resolve((LoraRef("style-a", 0.5),))
    assert r.digest == out["digest"] and backend.file("b").digest == out_b["digest"]
    assert (library / "style-a" / MARKER).is_file()
    # the same name and bytes again: a no-op; other bytes under the name: refused
    assert admin.load({"lora_name": "style-a", "lora_path": str(src / "style-a")})["status"] == "already loaded"
    msg = _refused(admin.load, {"lora_name": "style-a", "lora_path": str(src / "style-b.safetensors")}, 400,
                   "lora_name")
    assert "exists" in msg
    assert admin.unload({"lora_name": "style-a"})["status"] == "unloaded"
    assert "style-a" not in library_names(library)
    assert not [p for p in os.listdir(library) if p.startswith((".staging", ".unloading"))]
    with pytest.raises(Exception, match="unknown adapter 'style-a'"):
        backend.resolve((LoraRef("style-a", 0.5),))
    _refused(admin.unload, {"lora_name": "style-a"}, 404, "lora_name")
    msg = _refused(admin.unload, {"lora_name": "static"}, 400, "lora_name")  # the operator's file stays
    assert "part of the library" in msg and (library / "static").is_dir()


def test_paths_outside_the_roots_are_refused_before_anything_is_opened(lib, tmp_path):
    admin, library, src, root = lib
    os.symlink(root / "secret" / "x.safetensors", src / "link.safetensors")  # a link out of the root
    (src / "dirlink").mkdir()
    os.symlink(root / "secret" / "x.safetensors", src / "dirlink" / "w.safetensors")
    for path in (str(root / "secret" / "x.safetensors"), str(src / "link.safetensors"), "../secret/x.safetensors",
                 str(src / "dirlink"), "/etc/passwd", str(src / "missing"), str(library / "static")):
        msg = _refused(admin.load, {"lora_name": "n", "lora_path": path}, 400, "lora_path")
        assert "passwd" not in msg or "not inside" in msg
    (src / "junk.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")
    assert "header" in _refused(admin.load, {"lora_name": "n", "lora_path": "junk.safetensors"}, 400, "lora_path")
    save_file({"w": np.zeros(2, np.float32)}, str(src / "plain.safetensors"))
    assert "no LoRA" in _refused(admin.load, {"lora_name": "n", "lora_path": "plain.safetensors"}, 400, "lora_path")
    for name in ("../x", "a/b", "", None, 3, "edit"):
        _refused(admin.load, {"lora_name": name, "lora_path": "style-b.safetensors"}, 400, "lora_name")
    off = AdapterAdmin(library, [])
    assert "MASKEDIT_LORA_ROOTS" in _refused(off.load, {"lora_name": "n", "lora_path": "style-b.safetensors"}, 400,
                                             "lora_path")
    assert library_names(library) == ["static"]


def _post(port, path, body, key=None):
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json",
                                          **({"Authorization": f"Bearer {key}"} if key else {})})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_the_openai_port_serves_them_to_admin_keys_only_and_lists_the_change(lib, tmp_path):
    admin, library, src, _ = lib
    keys = tmp_path / "keys.txt"
    keys.write_text(f"{USER} acme user\n{ADMIN} ops admin\n")
    api = OpenAIServer("127.0.0.1:1", 0, keyring=Keyring(keys), admin=admin).start()
    try:
        body = {"lora_name": "style-a", "lora_path": str(src / "style-a")}
        assert _post(api.port, "/v1/load_lora_adapter", body)[0] == 401
        assert _post(api.port, "/v1/load_lora_adapter", body, USER)[0] == 403
        assert "style-a" not in library_names(library)
        status, out = _post(api.port, "/v1/load_lora_adapter", body, ADMIN)
        assert status == 200 and out["lora_name"] == "style-a"
        req = urllib.request.Request(f"http://127.0.0.1:{api.port}/v1/models",
                                     headers={"Authorization": f"Bearer {USER}"})
        with urllib.request.urlopen(req, timeout=10) as r:
            listed = {m["id"]: m for m in json.loads(r.read())["data"]}
        assert listed["style-a"]["type"] == "lora" and listed["style-a"]["parent"] == "edit"
        status, err = _post(api.port, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/etc"}, ADMIN)
        assert status == 400 and err["error"]["param"] == "lora_path"
        assert _post(api.port, "/v1/unload_lora_adapter", {"lora_name": "style-a"}, USER)[0] == 403
        assert _post(api.port, "/v1/unload_lora_adapter", {"lora_name": "style-a"}, ADMIN)[0] == 200
        status, err = _post(api.port, "/v1/unload_lora_adapter", {"lora_name": "style-a"}, ADMIN)
        assert status == 404 and err["error"]["param"] == "lora_name"
    finally:
        api.stop()
