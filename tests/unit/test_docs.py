"""README and docs/ without a server: README stays short, every code block says how the suite treats it
(``tests/doc_examples.py``; the runnable ones run in tests/integration/test_docs_examples.py), payload examples parse,
examples write under out/ only, and docs/openai.md lists every field the endpoint reads."""

import re

import pytest

from tests.doc_examples import REPO_ROOT, RUN_KINDS, blocks, written_paths

README_MAX_BYTES = 15_000  # README: what it is, the two set-up commands, how to call it, where the docs are
ALL = blocks()


def test_readme_stays_short():
    size = len((REPO_ROOT / "README.md").read_bytes())
    assert size <= README_MAX_BYTES, f"README.md is {size} bytes (at most {README_MAX_BYTES}): move detail to docs/"


def test_every_code_block_says_how_the_suite_treats_it():
    unmarked = [b.name for b in ALL if b.kind is None]
    assert not unmarked, f"code blocks without an <!-- example: KIND --> marker (tests/doc_examples.py): {unmarked}"
    assert not [b.name for b in ALL if b.kind == "skip" and not b.arg], "a skipped block must say why"
    runnable = [b for b in ALL if b.kind in RUN_KINDS]
    assert {b.lang for b in runnable} <= {"bash", "python"}
    assert sum(b.path.name == "README.md" for b in runnable) >= 5  # the client, CLI, curl and OpenAI examples


@pytest.mark.parametrize("block", [b for b in ALL if b.kind == "check"], ids=lambda b: b.name)
def test_payload_and_file_examples_parse(block):
    if block.arg == "controls":
        from maskedit_common.controls import parse

        assert parse(block.text, max_controls=8)
    elif block.arg == "loras":
        from maskedit_common.loras import parse

        assert parse(block.text)
    else:
        from maskedit_router.access.auth import parse

        assert parse(block.text, str(block.name))


@pytest.mark.parametrize("block", [b for b in ALL if b.kind in RUN_KINDS], ids=lambda b: b.name)
def test_examples_write_under_out_only(block):
    paths = written_paths(block.text)
    assert paths and all(p.startswith("out/") for p in paths), paths


def test_openai_md_lists_every_field_the_endpoint_reads():
    from maskedit_router.frontends.openai_form import KNOWN

    doc = (REPO_ROOT / "docs" / "openai.md").read_text()
    fields = doc[doc.index("## Fields"):doc.index("## The mask rule")]
    names = {n for row in re.findall(r"^\|.*\|$", fields, re.M) for n in re.findall(r"`([^`]+)`", row)}
    assert not KNOWN - names, f"docs/openai.md's field tables do not name {sorted(KNOWN - names)}"


def test_ports_are_named_one_way():
    """7002 is the router's HTTP port (Triton's HTTP/REST, /metrics, /health) wherever the docs name it."""
    for path in [REPO_ROOT / "README.md", *(REPO_ROOT / "docs").glob("*.md")]:
        for line in path.read_text().splitlines():
            for m in re.finditer(r"metrics(?:/health| and `?/health`?)? 7002|7002 \((?:metrics|Prometheus)", line):
                pytest.fail(f"{path.name}: 7002 named as a metrics port only: {line.strip()[:120]}")
