"""Runtime adapter loading (``lora_admin``, the OpenAI port's ``/v1/load_lora_adapter`` and
``/v1/unload_lora_adapter``): only paths inside the configured roots (symlinks resolved) and only regular files (a
FIFO is refused without blocking), each adapter fully checked against the served model before it is installed (a
truncated file or one made for another model is refused naming ``lora_path``), installed into the library the
backends read (their ``AdapterLibrary`` finds it with the same bytes), identical reloads are no-ops, conflicts 400,
unknown unloads 404, the operator's own adapters stay; admin keys only on the HTTP routes."""

import json
import os
import shutil
import urllib.error
import urllib.request

import numpy as np
import pytest
from safetensors.numpy import save_file

from maskedit.adapters.library import AdapterLibrary
from maskedit.errors import InvalidInput
from maskedit_common.loras import LoraRef, library_names
from maskedit_router.access.auth import Keyring
from maskedit_router.frontends.lora_admin import MARKER, AdapterAdmin, AdminError, ChildCheck
from maskedit_router.frontends.openai_api import OpenAIServer
from tests.blocking import in_time

USER, ADMIN = "sk-user-0123456789abcdef", "sk-admin-0123456789abcdef"


@pytest.fixture(scope="module")
def check():
    """The real check (the backends' loader in a child process, against the tiny model), shared by the module's
    tests: each adapter's bytes are checked once."""
    return ChildCheck()


def _adapter(adapters, path, which):
    """A copy of the tiny model's adapter ``which`` (real LoRA factors for its denoiser) at ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(adapters / which / "pytorch_lora_weights.safetensors", path)
    return path


@pytest.fixture
def lib(tmp_path, adapters, check):
    library, src = tmp_path / "loras", tmp_path / "incoming"
    _adapter(adapters, library / "static" / "pytorch_lora_weights.safetensors", "attn-r64")
    _adapter(adapters, src / "style-a" / "pytorch_lora_weights.safetensors", "attn-r4")
    _adapter(adapters, src / "style-b.safetensors", "attn-mlp-r8")
    (tmp_path / "secret").mkdir()
    _adapter(adapters, tmp_path / "secret" / "x.safetensors", "attn-mlp-r16")
    return AdapterAdmin(library, [src], reserved=["edit"], check=check), library, src, tmp_path


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


def test_a_fifo_named_like_an_adapter_is_refused_without_blocking(lib):
    admin, library, src, _ = lib
    (src / "piped").mkdir()
    os.mkfifo(src / "piped" / "x.safetensors")  # open() would wait for a writer forever
    os.mkfifo(src / "direct.safetensors")
    for path in ("piped", "direct.safetensors"):
        out = in_time(lambda: admin.load({"lora_name": "p", "lora_path": path}), 20.0)
        e = out.get("error")
        assert isinstance(e, AdminError) and e.status == 400 and e.param == "lora_path", out
        assert "regular file" in str(e) or "not an adapter" in str(e), str(e)
    # the backends' library: a FIFO placed there is refused by name, never opened
    os.mkfifo(library / "fifo.safetensors")
    out = in_time(lambda: AdapterLibrary(library).file("fifo"), 20.0)
    assert isinstance(out.get("error"), InvalidInput) and "LORAS" in str(out["error"]), out
    (library / "dirfifo").mkdir()
    os.mkfifo(library / "dirfifo" / "w.safetensors")
    out = in_time(lambda: AdapterLibrary(library).file("dirfifo"), 20.0)
    assert isinstance(out.get("error"), InvalidInput) and "regular file" in str(out["error"]), out
    assert "p" not in library_names(library)  # nothing installed


def test_an_adapter_is_fully_checked_before_it_is_loaded(lib, adapters):
    """A truncated file whose header is intact, and an adapter whose shapes are another model's, pass the header
    check and are refused by the full one, naming ``lora_path``; the real adapter they came from loads."""
    admin, library, src, _ = lib
    good = (adapters / "attn-r4" / "pytorch_lora_weights.safetensors").read_bytes()
    (src / "truncated.safetensors").write_bytes(good[:-1000])
    msg = _refused(admin.load, {"lora_name": "t", "lora_path": "truncated.safetensors"}, 400, "lora_path")
    assert "truncated" in msg or "corrupt" in msg, msg
    rng = np.random.default_rng(0)
    save_file({"transformer.single_transformer_blocks.0.attn.to_q.lora_A.weight": rng.standard_normal(
        (4, 48), dtype=np.float32), "transformer.single_transformer_blocks.0.attn.to_q.lora_B.weight":
        rng.standard_normal((32, 4), dtype=np.float32)}, str(src / "other-model.safetensors"))
    msg = _refused(admin.load, {"lora_name": "o", "lora_path": "other-model.safetensors"}, 400, "lora_path")
    assert "shapes" in msg, msg
    assert library_names(library) == ["static"]
    assert not [p for p in os.listdir(library) if p.startswith(".staging")]
    (src / "whole.safetensors").write_bytes(good)  # the control: the same adapter, whole
    assert admin.load({"lora_name": "w", "lora_path": "whole.safetensors"})["status"] == "loaded"
