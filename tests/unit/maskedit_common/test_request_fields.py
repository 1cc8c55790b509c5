"""The request schema is the one description of an edit's inputs: the ensemble's config, the server's parsing, the
OpenAI form and the Python client all agree with it."""

import inspect
import re

import numpy as np
import pytest

from maskedit_common.request_fields import OPENAI_EXTRAS, PARAMS, REQUEST_FIELDS
from maskedit.params import EditParams, parse_params
from maskedit.repository import REPOSITORY
from maskedit.settings import Settings


def test_the_ensembles_committed_config_has_exactly_the_schemas_inputs():
    text = (REPOSITORY / "edit" / "config.pbtxt").read_text()
    block = text[text.index("input ["):text.index("output [")]
    found = re.findall(r'name: "(\w+)"\s+data_type: TYPE_(\w+)\s+dims: \[ (-?1) \](\s+optional: true)?', block)
    assert [(n, t, (int(d),), bool(o)) for n, t, d, o in found] == [
        (f.name, f.dtype, f.dims, f.optional) for f in REQUEST_FIELDS]


def test_server_parameters_are_the_schemas():
    assert set(EditParams.__dataclass_fields__) == {f.attr for f in PARAMS}
    s = Settings(steps=8, guidance=30.0, max_steps=100, max_prompt_chars=50, max_guidance=100.0)
    p = parse_params(s, "a hat")
    for f in PARAMS:  # every default is the schema's (or its setting's)
        if f.attr == "temporal":  # parsed: the default's JSON (empty) is no reuse
            assert not p.temporal.on and f.default_for(s) == ""
        elif f.attr != "prompt":
            assert getattr(p, f.attr) == f.default_for(s), f.name


@pytest.mark.parametrize("f", [f for f in PARAMS if f.kind in (int, float)], ids=lambda f: f.name)
def test_every_numeric_limit_is_enforced_and_named(f):
    from maskedit.errors import InvalidInput

    s = Settings(steps=8, guidance=30.0, max_steps=100, max_prompt_chars=50, max_guidance=100.0)
    lo, hi = f.limits(s)
    assert parse_params(s, "x", **{f.attr: lo}) is not None and parse_params(s, "x", **{f.attr: hi}) is not None
    for bad in (lo - 1, hi + 1):
        with pytest.raises(InvalidInput) as e:
            parse_params(s, "x", **{f.attr: bad})
        assert e.value.field == f.name and f"between {lo} and {hi}" in str(e.value)


def test_the_python_client_sends_every_parameter_as_the_schema_types_it(monkeypatch):
    from maskedit_client import client as client_mod

    sent = []
    monkeypatch.setattr(client_mod.EditClient, "submit_inputs", lambda self, inputs, *a, **k: sent.extend(inputs))
    c = client_mod.EditClient("127.0.0.1:1")
    kwargs = set(inspect.signature(c.submit).parameters)
    params = {f.attr for f in REQUEST_FIELDS} - {"progress"}  # progress: asked for by passing on_progress
    assert params <= kwargs, params - kwargs
    png = b"\x89PNG\r\n\x1a\n" + b"\0" * 16
    values = {"seed": 3, "steps": 4, "guidance": 2.5, "raw_output": True, "template_seed": 5, "use_cache": False,
              "register": True, "deadline_ms": 1000, "negative_prompt": "blur",
              "loras": [("style", 0.5)], "controls": [("edges", 0.5, 0.0, 0.5)], "control_images": [png, png],
              "temporal": {"policy": "fbcache", "threshold": 0.08}, "reference_images": [png],
              "strength": 0.6, "padding_mask_crop": 32, "guidance_rescale": 0.7, "true_cfg_scale": 4.0,
              "output_format": "jpeg", "output_quality": 80}
    c.submit(png, png, "a hat", on_progress=lambda *a: None, **values)
    got = {t.name(): t.datatype() for t in sent}
    assert got == {f.name: ("BYTES" if f.dtype == "STRING" else f.dtype) for f in REQUEST_FIELDS}


def test_the_openai_form_reads_the_schemas_extras():
    from maskedit_router.frontends.openai_form import KNOWN, PARAM_OF_TENSOR, parse

    assert {f.attr for f in OPENAI_EXTRAS} <= KNOWN
    assert all(PARAM_OF_TENSOR[f.name] == f.attr for f in OPENAI_EXTRAS)
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.zeros((16, 16, 4), np.uint8)).save(buf, "PNG")
    job = parse({"image": buf.getvalue(), "prompt": "x", "steps": "4", "guidance": "2.5", "use_cache": "false",
                 "negative_prompt": "blur", "deadline_ms": "900", "template_seed": "2", "seed": "1",
                 "temporal": '{"policy": "fbcache", "threshold": 0.1}'}, ["m"])
    assert (job.steps, job.guidance, job.use_cache, job.negative_prompt, job.deadline_ms, job.template_seed,
            job.seed, job.temporal) == (4, 2.5, False, "blur", 900, 2, 1, '{"policy": "fbcache", "threshold": 0.1}')
