"""`make router-cpu` (`python -m maskedit_lab.routing.router_cpu`): the router's own CPU per request, stage by stage,
in one process: reading a request off the wire (protobuf parse), its routing features (the mask decoded onto the
token grid, the template's hash), writing it to its backend (serialise), and the backend stream it goes on: one
opened per request (as the router did before it kept one stream per backend, shared by its client streams) against
one stream reused (as it does now), and one reused stream on ``grpc.aio`` (an event loop fed from the sending thread,
as a relay moved onto the router's loop would be: no gRPC consumer or reader thread), to one emulated instance
(``triton_emulator``, in its own process: only this side's CPU is counted, wall time per round trip beside it).
Process CPU time (``time.process_time``), not latency: it moves little with the host's load, so before/after runs
side by side on a shared host say something (the latencies of ``make router-scale`` need a quiet one).

Before/after in one run: ``features_box_grid`` is the features as read before the whole-cell reduction
(``ANY_CELL_MAX = 0``: every mask through the BOX resize), ``features`` as shipped; both on the same requests, every
mask new to the router (decoded). ``features_mask_again``: the same requests with the router's mask memory on
(their masks sent before: a hash each, no decode). ``template_sha1`` against ``template_xxh3``: the template key's
hash as it was (SHA-1) and is (xxh3-128).
The requests are ``make router-scale``'s (``scale.Payloads``): a ~0.45 MB noise template at 512², masks over the
workload's ratios. Writes JSON and a bar plot.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import statistics
import queue
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import xxhash

from maskedit_lab.routing.scale import Payloads, commit, edit_request, running_emulator

OUT = Path("perf_profiles/results/router_cpu.json")


@contextmanager
def _box_grid():
    """The grid as read before: no whole-cell reduction."""
    from maskedit_router.placement import features

    saved = features.ANY_CELL_MAX
    features.ANY_CELL_MAX = 0
    try:
        with _mask_sent_once():
            yield
    finally:
        features.ANY_CELL_MAX = saved


@contextmanager
def _mask_sent_once():
    """Every mask new to the router: its mask memory remembers none (each request decodes its mask)."""
    from maskedit_router.placement import features

    saved = features.MASK_RATIOS
    features.MASK_RATIOS = features.MaskRatios(size=0)
    try:
        yield
    finally:
        features.MASK_RATIOS = saved


def stages(resolution: int, requests: int, n_masks: int = 48) -> dict:
    """Each stage as a function of request ``i`` (and the context it runs under)."""
    from tritonclient.grpc import service_pb2

    from maskedit_router.placement.features import _tensor_bytes, mask_tokens, routing_features

    payloads = Payloads(resolution, n_masks=n_masks)
    reqs = [edit_request(payloads, f"t{i}", i % n_masks, 8) for i in range(requests)]
    wire = [r.SerializeToString() for r in reqs]
    template = [_tensor_bytes(r, [t.name for t in r.inputs].index("TEMPLATE"), True, view=True) for r in reqs]

    def parse(i):
        service_pb2.ModelInferRequest.FromString(wire[i])

    return {
        "parse": (parse, None),
        "features": (lambda i: routing_features(reqs[i], resolution), _mask_sent_once),
        "features_mask_again": (lambda i: routing_features(reqs[i], resolution), None),
        "features_box_grid": (lambda i: routing_features(reqs[i], resolution), _box_grid),
        "mask_grid": (lambda i: mask_tokens(payloads.masks[i % n_masks], resolution), None),
        "mask_grid_box": (lambda i: mask_tokens(payloads.masks[i % n_masks], resolution), _box_grid),
        "template_sha1": (lambda i: hashlib.sha1(template[i]).digest(), None),
        "template_xxh3": (lambda i: xxhash.xxh3_128(template[i]).digest(), None),
        "serialise": (lambda i: reqs[i].SerializeToString(), None),
    }, {"request_bytes": len(wire[0]), "template_bytes": len(template[0]), "resolution": resolution}


def measure(fn, ctx, requests: int, repeats: int) -> list[float]:
    """CPU ms per request of ``fn`` over all requests, ``repeats`` times (after one warm pass)."""
    out = []
    with ctx() if ctx else _nothing():
        for r in range(repeats + 1):
            c0 = time.process_time()
            for i in range(requests):
                fn(i)
            if r:
                out.append((time.process_time() - c0) / requests * 1e3)
    return out


@contextmanager
def _nothing():
    yield


def _round_trips(stub, reqs: list, reuse: bool) -> None:
    """Each request sent and its answer read, in turn: on one stream (``reuse``) or each on a stream of its own,
    closed after its answer, as the router's ``_BackendStream`` was (a reader thread each; gRPC adds its own)."""
    def stream():
        q: queue.Queue = queue.Queue()
        answered = threading.Event()
        call = stub.ModelStreamInfer(iter(q.get, None))

        def read():
            for _ in call:
                answered.set()
        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        return q, answered, reader

    q = None
    for r in reqs:
        if q is None:
            q, answered, reader = stream()
        answered.clear()
        q.put(r)
        if not answered.wait(30.0):
            raise RuntimeError("the emulated instance did not answer in 30 s")
        if not reuse:
            q.put(None)
            reader.join(30.0)
            q = None
    if q is not None:
        q.put(None)
        reader.join(30.0)


class _AioStream:
    """One ``grpc.aio`` stream to ``addr`` on an event loop thread of its own: ``round_trips`` hands each request to the
    loop (``call_soon_threadsafe``, one writer task: aio allows one write at a time) and waits for its answer, read
    by a reader task, as ``_round_trips`` does on a sync stream."""

    def __init__(self, addr: str, options: list):
        import asyncio

        import grpc
        from tritonclient.grpc import service_pb2_grpc

        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.answered = threading.Event()

        async def open_():
            self.channel = grpc.aio.insecure_channel(addr, options=options)
            self.call = service_pb2_grpc.GRPCInferenceServiceStub(self.channel).ModelStreamInfer()
            self.q = asyncio.Queue()

            async def write():
                while (r := await self.q.get()) is not None:
                    await self.call.write(r)
                await self.call.done_writing()

            async def read():
                async for _ in self.call:
                    self.answered.set()
            self.tasks = [asyncio.ensure_future(write()), asyncio.ensure_future(read())]
        asyncio.run_coroutine_threadsafe(open_(), self.loop).result(30)

    def round_trips(self, reqs: list) -> None:
        for r in reqs:
            self.answered.clear()
            self.loop.call_soon_threadsafe(self.q.put_nowait, r)
            if not self.answered.wait(30.0):
                raise RuntimeError("the emulated instance did not answer in 30 s")

    def close(self) -> None:
        import asyncio

        async def close_():
            self.q.put_nowait(None)
            await asyncio.wait(self.tasks, timeout=10)
            await self.channel.close()
        asyncio.run_coroutine_threadsafe(close_(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


def stream_rows(resolution: int, requests: int, repeats: int) -> list[dict]:
    """Per-request CPU and wall time of a backend stream opened per request against one reused, sync and aio."""
    import grpc
    from tritonclient.grpc import service_pb2_grpc

    from maskedit_router.__main__ import default_profile

    payloads = Payloads(resolution, n_masks=4)
    reqs = [edit_request(payloads, f"s{i}", i % 4, 1) for i in range(requests)]
    for i, r in enumerate(reqs):
        r.id = f"s{i}"
    samples: dict[str, list[tuple[float, float]]] = {"backend_stream_per_request": [], "backend_stream_reused": [],
                                                      "backend_stream_reused_aio": []}
    options = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]
    with tempfile.TemporaryDirectory() as d, running_emulator(1, default_profile(), 0.001, Path(d)) as (_, addrs):
        with grpc.insecure_channel(addrs[0], options=options) as ch:
            stub = service_pb2_grpc.GRPCInferenceServiceStub(ch)
            aio = _AioStream(addrs[0], options)
            try:
                send = {"backend_stream_per_request": lambda: _round_trips(stub, reqs, reuse=False),
                        "backend_stream_reused": lambda: _round_trips(stub, reqs, reuse=True),
                        "backend_stream_reused_aio": lambda: aio.round_trips(reqs)}
                _round_trips(stub, reqs[:4], reuse=True)  # (connections, imports)
                aio.round_trips(reqs[:4])
                for _ in range(repeats):
                    for name in samples:
                        c0, w0 = time.process_time(), time.perf_counter()
                        send[name]()
                        samples[name].append(((time.process_time() - c0) / requests * 1e3,
                                              (time.perf_counter() - w0) / requests * 1e3))
            finally:
                aio.close()
    return [{"stage": name, "cpu_ms_per_request_median": round(statistics.median(c for c, _ in s), 4),
             "cpu_ms_per_request_min": round(min(c for c, _ in s), 4),
             "wall_ms_per_round_trip_median": round(statistics.median(w for _, w in s), 3), "repeats": len(s)}
            for name, s in samples.items()]


def run(resolution: int, requests: int, repeats: int, streams: bool = True) -> dict:
    fns, meta = stages(resolution, requests)
    rows = []
    # interleaved: each repeat runs every stage in turn, so a load change on the host touches all of them alike
    samples: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for name, (fn, ctx) in fns.items():
            samples[name] += measure(fn, ctx, requests, 1)
    for name, ms in samples.items():
        rows.append({"stage": name, "cpu_ms_per_request_median": round(statistics.median(ms), 4),
                     "cpu_ms_per_request_min": round(min(ms), 4), "repeats": len(ms)})
    if streams:
        rows += stream_rows(resolution, requests, repeats)  # as many passes: aio against sync is a ~10 % difference
    by = {r["stage"]: r["cpu_ms_per_request_median"] for r in rows}
    ratios = {"features_vs_box_grid": round(by["features"] / by["features_box_grid"], 3),
              "features_mask_again_vs_sent_once": round(by["features_mask_again"] / by["features"], 3),
              "template_xxh3_vs_sha1": round(by["template_xxh3"] / by["template_sha1"], 3),
              "mask_grid_vs_box": round(by["mask_grid"] / by["mask_grid_box"], 3)}
    if streams:
        ratios["backend_stream_reused_vs_per_request"] = round(
            by["backend_stream_reused"] / by["backend_stream_per_request"], 3)
        wall = {r["stage"]: r["wall_ms_per_round_trip_median"] for r in rows if "wall_ms_per_round_trip_median" in r}
        ratios["backend_stream_aio_vs_reused"] = round(by["backend_stream_reused_aio"] / by["backend_stream_reused"], 3)
        ratios["backend_stream_aio_vs_reused_wall"] = round(wall["backend_stream_reused_aio"] /
                                                            wall["backend_stream_reused"], 3)
    return {"meta": {**meta, **commit(), "requests": requests, "device": platform.processor() or platform.machine(),
                     "python": platform.python_version(), "clock": "time.process_time (process CPU)",
                     "loadavg_1m": round(os.getloadavg()[0], 2)},
            "rows": rows, "ratios": ratios}


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    fig, ax = plt.subplots(figsize=(7, 3.2))
    ax.barh([r["stage"] for r in rows], [r["cpu_ms_per_request_median"] for r in rows], color="#4a7")
    ax.set_xlabel("router CPU ms per request (median)")
    ax.set_title(f"router stages, {result['meta']['resolution']}² edit, {result['meta']['request_bytes'] // 1024} KB")
    ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--resolution", type=int, default=512, help="the model's working resolution (masks at it)")
    ap.add_argument("--requests", type=int, default=48, help="distinct requests per pass")
    ap.add_argument("--repeats", type=int, default=15, help="passes per stage (the median is reported)")
    ap.add_argument("--no-streams", action="store_true", help="skip the backend stream stages (no emulator)")
    ap.add_argument("--out", type=Path, default=OUT)
    a = ap.parse_args(argv)
    result = run(a.resolution, a.requests, a.repeats, streams=not a.no_streams)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=1) + "\n")
    plot(result, a.out.with_suffix(".png"))
    for r in result["rows"]:
        print(f"{r['stage']:>20}  {r['cpu_ms_per_request_median']:.3f} ms CPU/request")
    print(json.dumps(result["ratios"]), "->", a.out)


if __name__ == "__main__":
    main()
