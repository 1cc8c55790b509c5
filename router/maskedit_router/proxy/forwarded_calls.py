"""The calls the router forwards as they are (health, metadata, config, repository) and the statistics it sums
over its backends, so perf_analyzer's server-side view matches the traffic it sent: a mixin of ``server.Router``.
"""

from __future__ import annotations

import grpc
from tritonclient.grpc import service_pb2


class ForwardedCalls:
    """Needs ``available()`` (backends in rotation) and ``backends`` (every backend by address)."""

    def _forward(self, method: str, request, context):
        last = None
        for b in self.available() or list(self.backends.values()):
            try:
                return getattr(b.stub, method)(request, timeout=_timeout(context, 30.0))
            except grpc.RpcError as e:
                last = e
                if e.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    context.abort(e.code(), e.details())
                b.failed()
        context.abort(grpc.StatusCode.UNAVAILABLE, f"no backend answered {method}: {last}")

    def ServerLive(self, request, context):
        return service_pb2.ServerLiveResponse(live=True)

    def ServerReady(self, request, context):
        return service_pb2.ServerReadyResponse(ready=bool(self.available()))

    def ModelReady(self, request, context):
        return self._forward("ModelReady", request, context)

    def ServerMetadata(self, request, context):
        return self._forward("ServerMetadata", request, context)

    def ModelMetadata(self, request, context):
        return self._forward("ModelMetadata", request, context)

    def ModelConfig(self, request, context):
        return self._forward("ModelConfig", request, context)

    def ModelStatistics(self, request, context):
        """Summed over every backend, so perf_analyzer's server-side view matches the traffic it sent."""
        merged, by_key = None, {}
        for b in self.available():
            try:
                resp = b.stub.ModelStatistics(request, timeout=_timeout(context, 10.0))
            except grpc.RpcError:
                continue
            if merged is None:
                merged = resp
                by_key = {(m.name, m.version): m for m in merged.model_stats}
                continue
            for m in resp.model_stats:
                if (m.name, m.version) in by_key:
                    _add_stats(by_key[(m.name, m.version)], m)
                else:
                    merged.model_stats.add().CopyFrom(m)
        if merged is None:
            context.abort(grpc.StatusCode.UNAVAILABLE, "no backend answered ModelStatistics")
        return merged

    def RepositoryIndex(self, request, context):
        return self._forward("RepositoryIndex", request, context)

    def RepositoryModelLoad(self, request, context):
        """Admin only (the transport checks the role): load a model on every backend (Triton answers its own error
        unless it runs with explicit model control)."""
        return self._forward_all("RepositoryModelLoad", request, context)

    def RepositoryModelUnload(self, request, context):
        return self._forward_all("RepositoryModelUnload", request, context)

    def _forward_all(self, method: str, request, context):
        """``method`` on every backend (the served set is the same everywhere); the first error is the answer."""
        resp = None
        for b in list(self.backends.values()):
            try:
                resp = getattr(b.stub, method)(request, timeout=_timeout(context, 120.0))
            except grpc.RpcError as e:
                context.abort(e.code(), f"{b.addr}: {e.details()}")
        if resp is None:
            context.abort(grpc.StatusCode.UNAVAILABLE, "no backend")
        return resp


def _add_stats(dst, src) -> None:
    """dst += src over every counter of a statistics message (max for timestamps)."""
    for fd, val in src.ListFields():
        if fd.type == fd.TYPE_MESSAGE:
            if fd.label == fd.LABEL_REPEATED:
                target = getattr(dst, fd.name)
                if fd.message_type.GetOptions().map_entry:
                    for k, v in val.items():
                        _add_stats(target[k], v)
                else:
                    for i, item in enumerate(val):
                        if i < len(target):
                            _add_stats(target[i], item)
                        else:
                            target.add().CopyFrom(item)
            else:
                _add_stats(getattr(dst, fd.name), val)
        elif fd.label != fd.LABEL_REPEATED and isinstance(val, int) and fd.name != "batch_size":
            cur = getattr(dst, fd.name)
            setattr(dst, fd.name, max(cur, val) if fd.name.startswith("last_") else cur + val)


def _timeout(context, default: float) -> float:
    remaining = context.time_remaining()
    return default if remaining is None else max(0.1, min(default, remaining))
