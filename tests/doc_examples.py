"""The code blocks of README.md and docs/*.md, and how the suite treats each one.

Every fenced block carries a marker on the line before its fence, ``<!-- example: KIND -->``:

- ``both``: a user would paste it with a server up: run against one Triton server (``make serve``) and against the
  router (``make serve INSTANCES=2``), its ports mapped as README says (8001 -> 7001, 8000 -> 7002);
- ``router``: the same, against the router only (the OpenAI port 7003);
- ``check controls`` / ``check loras`` / ``check keyfile``: a payload or file, read by the parser the service reads
  it with;
- ``skip: why``: what the suite cannot run (a Kubernetes cluster, Docker, a GPU, a long-running server, the suite
  itself), and why.

``tests/unit/test_docs.py`` fails on a block without a marker, ``tests/integration/test_docs_examples.py`` runs them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
FENCE = re.compile(r"^```(\S*)\s*$")
MARKER = re.compile(r"^<!-- example: (both|router|check (?:controls|loras|keyfile)|skip: .+?) -->$")
RUN_KINDS = ("both", "router")
# The ports the docs name, per serving mode: the role each one has there (README's port table).
DOC_PORTS = {8000: "http", 8001: "grpc", 8002: "metrics", 7001: "router_grpc", 7002: "router_http", 7003: "openai"}
PORT = re.compile(r"(?<![\w.])(%s)(?!\w)" % "|".join(map(str, DOC_PORTS)))


@dataclass(frozen=True)
class Block:
    path: Path  # relative to the repository
    line: int  # the fence's line, 1-based
    lang: str
    text: str
    kind: str | None  # both, router, check, skip; None: no marker
    arg: str = ""  # what a check reads, or why a block is skipped

    @property
    def name(self) -> str:
        return f"{self.path}:{self.line}"


def doc_files() -> list[Path]:
    return [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]


def blocks(paths=None) -> list[Block]:
    out = []
    for path in paths or doc_files():
        lines = path.read_text().splitlines()
        i = 0
        while i < len(lines):
            m = FENCE.match(lines[i])
            if not m:
                i += 1
                continue
            end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
            marker = MARKER.match(lines[i - 1].strip()) if i > 0 else None
            kind, arg = None, ""
            if marker:
                kind, _, arg = marker.group(1).partition(" ")
                kind = kind.rstrip(":")
            out.append(Block(path.relative_to(REPO_ROOT), i + 1, m.group(1), "\n".join(lines[i + 1:end]) + "\n",
                             kind, arg.strip()))
            i = end + 1
    return out


def with_ports(text: str, ports: dict[str, int]) -> str:
    """``text`` with each documented port replaced by the port of its role in ``ports`` (role -> port); a role the
    mode does not serve raises ``KeyError`` naming it."""
    return PORT.sub(lambda m: str(ports[DOC_PORTS[int(m.group(1))]]), text)


# What a runnable block writes: it must all go under out/ (never into the checkout's root).
WRITES = re.compile(r"""--out\s+(\S+)|-o\s+(\S+)|>\s*(\S+)|open\(f?["']([^"']+)["'],\s*["']wb["']\)|\.save\(["']([^"']+)["']\)""")


def written_paths(text: str) -> list[str]:
    return [next(g for g in m.groups() if g) for m in WRITES.finditer(text)]
