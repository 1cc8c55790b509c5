"""Where the Triton instances are: a fixed list, a file, or every address of a DNS name (a headless Service).

A Kubernetes headless Service's name resolves to the IPs of its ready pods, so re-resolving it every few seconds
follows pods as they come, go and pass or fail their readiness probes, with no access to the Kubernetes API.
"""

from __future__ import annotations

import ipaddress
import socket
from pathlib import Path


def from_list(text: str) -> list[str]:
    return [a.strip() for a in text.replace("\n", ",").split(",") if a.strip()]


def from_file(path: Path) -> list[str]:
    return from_list(Path(path).read_text())


def _endpoint(ip: str, port: int) -> str:
    return f"[{ip}]:{port}" if ipaddress.ip_address(ip).version == 6 else f"{ip}:{port}"


def from_dns(name_port: str) -> list[str]:
    """``host:port`` -> sorted ``ip:port`` of every address ``host`` resolves to (empty if it does not)."""
    host, port = name_port.rsplit(":", 1)
    try:
        infos = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
    except socket.gaierror:
        return []
    return sorted({_endpoint(info[4][0], int(port)) for info in infos})
