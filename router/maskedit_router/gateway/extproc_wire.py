"""Two ext_proc fields that the pinned ``xds-protos`` stubs do not have, read and written on the wire.

xds-protos 1.62.3 is the last release built for protobuf 4 (tritonclient 2.50 needs protobuf<5), and its Envoy
API predates two fields the Gateway API Inference Extension protocol uses:

- ``ProcessingRequest.metadata_context`` (field 8, ``envoy.config.core.v3.Metadata``): where the proxy offers the
  endpoint subset (``envoy.lb.subset_hint`` / ``x-gateway-destination-endpoint-subset``);
- ``BodyMutation.streamed_response`` (field 3, ``StreamedBodyResponse{bytes body = 1; bool end_of_stream = 2}``):
  how a server answers body chunks in ``FULL_DUPLEX_STREAMED`` mode, which the protocol requires.

Protobuf keeps fields it does not know as unknown fields, byte for byte, through parsing, copying and
serializing; these helpers read and add them there. With stubs that know the fields, the stubs' own are used.
The field numbers are those of Envoy's ``external_processor.proto``.
"""

from __future__ import annotations

from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from google.protobuf import unknown_fields

METADATA_CONTEXT = 8  # ProcessingRequest.metadata_context
STREAMED_RESPONSE = 3  # BodyMutation.streamed_response
_LEN = 2  # wire type of length-delimited fields


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b, n = n & 0x7F, n >> 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
    return _varint(number << 3 | _LEN) + _varint(len(payload)) + payload


def _read_varint(data: bytes, i: int) -> tuple[int, int]:
    n = shift = 0
    while True:
        b = data[i]
        n |= (b & 0x7F) << shift
        i += 1
        if not b & 0x80:
            return n, i
        shift += 7


def _unknown(msg, number: int) -> list[bytes]:
    return [f.data for f in unknown_fields.UnknownFieldSet(msg) if f.field_number == number and f.wire_type == _LEN]


def metadata_context(req: ep.ProcessingRequest) -> base_pb2.Metadata:
    """The request's ``metadata_context`` (empty if the proxy sent none)."""
    if "metadata_context" in ep.ProcessingRequest.DESCRIPTOR.fields_by_name:
        return req.metadata_context
    md = base_pb2.Metadata()
    for blob in _unknown(req, METADATA_CONTEXT):
        md.MergeFromString(blob)  # repeated occurrences of a message field merge, as protobuf defines
    return md


def with_metadata_context(req: ep.ProcessingRequest, md: base_pb2.Metadata) -> ep.ProcessingRequest:
    """``req`` with ``metadata_context`` set (what the proxy does; tests play the proxy)."""
    if "metadata_context" in ep.ProcessingRequest.DESCRIPTOR.fields_by_name:
        req.metadata_context.CopyFrom(md)
        return req
    return ep.ProcessingRequest.FromString(req.SerializeToString() + _field(METADATA_CONTEXT,
                                                                            md.SerializeToString()))


def streamed_body(body: bytes, end_of_stream: bool) -> ep.BodyMutation:
    """A ``BodyMutation`` carrying one ``streamed_response`` chunk."""
    inner = (_field(1, body) if body else b"") + (b"\x10\x01" if end_of_stream else b"")
    if "streamed_response" in ep.BodyMutation.DESCRIPTOR.fields_by_name:
        return ep.BodyMutation(streamed_response=ep.StreamedBodyResponse(body=body, end_of_stream=end_of_stream))
    return ep.BodyMutation.FromString(_field(STREAMED_RESPONSE, inner))


def read_streamed_body(mutation: ep.BodyMutation) -> tuple[bytes, bool] | None:
    """``(body, end_of_stream)`` of a ``streamed_response`` mutation, None if it is not one."""
    if "streamed_response" in ep.BodyMutation.DESCRIPTOR.fields_by_name:
        if not mutation.HasField("streamed_response"):
            return None
        return mutation.streamed_response.body, mutation.streamed_response.end_of_stream
    blobs = _unknown(mutation, STREAMED_RESPONSE)
    if not blobs:
        return None
    body, eos, data, i = b"", False, blobs[-1], 0
    while i < len(data):
        key, i = _read_varint(data, i)
        if key & 7 == _LEN:
            n, i = _read_varint(data, i)
            if key >> 3 == 1:
                body = data[i:i + n]
            i += n
        else:  # varint
            v, i = _read_varint(data, i)
            if key >> 3 == 2:
                eos = bool(v)
    return body, eos
