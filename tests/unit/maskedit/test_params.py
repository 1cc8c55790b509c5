import pytest

from maskedit.errors import InvalidInput
from maskedit.params import parse_params
from maskedit.settings import Settings, load_settings

S = Settings(steps=8, guidance=30.0, max_steps=100, max_prompt_chars=50)


def test_defaults_apply():
    p = parse_params(S, b"a hat")
    assert (p.prompt, p.seed, p.steps, p.guidance, p.raw_output) == ("a hat", 0, 8, 30.0, False)


@pytest.mark.parametrize("kw,field", [
    ({"prompt": b""}, "PROMPT"), ({"prompt": b"   "}, "PROMPT"), ({"prompt": b"x" * 51}, "PROMPT"),
    ({"prompt": b"\xff\xfe"}, "PROMPT"), ({"steps": 0}, "STEPS"), ({"steps": 101}, "STEPS"),
    ({"guidance": -1.0}, "GUIDANCE"), ({"guidance": float("nan")}, "GUIDANCE"), ({"guidance": 1e9}, "GUIDANCE"),
    ({"seed": -1}, "SEED"), ({"negative_prompt": b"\xff"}, "NEGATIVE_PROMPT"),
    ({"negative_prompt": "x" * 51}, "NEGATIVE_PROMPT"),
])
def test_out_of_range_names_the_field(kw, field):
    args = {"prompt": b"ok", **kw}
    with pytest.raises(InvalidInput) as e:
        parse_params(S, **args)
    assert e.value.field == field and str(e.value).startswith(field + ":")


def test_env_overrides_model_defaults(tmp_path):
    (tmp_path / "maskedit.json").write_text('{"resolution": 128, "steps": 4, "unknown": 1}')
    s = load_settings({"MASKEDIT_MODEL_DIR": str(tmp_path), "MASKEDIT_STEPS": "6"})
    assert (s.resolution, s.steps, s.model_dir) == (128, 6, tmp_path)
