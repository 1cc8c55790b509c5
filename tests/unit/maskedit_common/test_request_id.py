"""The request id in an error's text: written by the backend and the router, read by the router and the client."""

from maskedit_client import client as client_mod
from maskedit_common.request_id import PATTERN, named, tagged


def test_a_message_is_tagged_once_and_the_id_read_back():
    assert tagged("UNAVAILABLE: busy", "r-7") == "UNAVAILABLE: busy [request id: r-7]"
    assert tagged("UNAVAILABLE: busy [request id: r-7]", "r-7") == "UNAVAILABLE: busy [request id: r-7]"
    assert tagged("UNAVAILABLE: busy", None) == tagged("UNAVAILABLE: busy", "") == "UNAVAILABLE: busy"
    assert named(tagged("in ensemble 'edit', INVALID_ARG: bad MASK", "c1-42")) == "c1-42"
    assert named("no id here") is None


def test_the_client_reads_the_same_pattern():  # it ships without server code, so it mirrors it
    assert client_mod._REQUEST_ID.pattern == PATTERN.pattern
    assert client_mod.EditClient._error_request_id(tagged("RESOURCE_EXHAUSTED: full", "x-3")) == "x-3"
