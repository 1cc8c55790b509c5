"""The router's cost model and the simulator with temporal reuse: a step mask's computed fraction is known from the
request, an adaptive policy's is learned from the EDIT_INFO of completed requests, and TEMPORAL is read from the
forwarded request as the backend reads it."""

import json
import struct
from dataclasses import replace

import pytest
from tritonclient.grpc import service_pb2

from maskedit_common.cost_model import CostModel
from maskedit_common.temporal import computed_fraction, parse
from maskedit_lab.routing.sim_cluster import replay
from maskedit_router.placement.features import EditFeatures, edit_info, extract
from maskedit_router.placement.policies import Estimator

FB = parse({"policy": "fbcache", "threshold": 0.1}, 8)
MASK = parse({"policy": "steps", "steps": [0, 1, 2, 4, 6]}, 8)


def test_a_step_mask_scales_the_prediction_by_its_computed_fraction():
    est = Estimator(CostModel.fallback())
    f = EditFeatures("t", 0.2, 1024, 8)
    base = est.request_ms(f, False)
    frac = computed_fraction(MASK, 8, est.n_blocks)
    assert est.request_ms(replace(f, temporal=MASK), False) == pytest.approx(base * frac)
    assert est.request_ms(replace(f, temporal=FB), False) == pytest.approx(base)  # not seen yet: no reuse assumed


def test_an_adaptive_policys_fraction_is_learned_from_completions():
    est = Estimator(CostModel.fallback())
    for _ in range(40):
        est.observe_temporal(FB, 0.55)
    f = EditFeatures("t", 0.2, 1024, 8)
    assert est.request_ms(replace(f, temporal=FB), True) == pytest.approx(0.55 * est.request_ms(f, True), rel=1e-3)
    other = parse({"policy": "fbcache", "threshold": 0.3}, 8)
    assert est.computed_fraction(replace(f, temporal=other)) == 1.0  # learned per policy and threshold


def test_the_simulated_router_learns_what_the_workers_compute():
    """The workers' true fraction (the ``service`` estimator's) is what the router's copy converges to."""
    est = Estimator(CostModel.fallback())
    service = replace(est, temporal_fractions={FB.label(): 0.5})
    reqs = [(0.5 * i, EditFeatures(f"t{i % 3}", 0.2, 1024, 4, temporal=FB)) for i in range(30)]
    out = replay("round_robin", 2, reqs, est, service=service)
    assert est.computed_fraction(reqs[0][1]) == 1.0  # the caller's estimator is left as it was
    assert out["estimator"].computed_fraction(reqs[0][1]) == pytest.approx(0.5, abs=0.01)


def _bytes(value: bytes) -> bytes:
    return struct.pack("<I", len(value)) + value


def test_temporal_is_read_from_the_request_and_edit_info_from_the_response():
    req = service_pb2.ModelInferRequest(model_name="edit")
    for name, dt, shape, raw in (("STEPS", "INT32", [1], struct.pack("<i", 8)),
                                 ("TEMPORAL", "BYTES", [1], _bytes(b'{"policy": "fbcache", "threshold": 0.1}'))):
        t = req.inputs.add()
        t.name, t.datatype = name, dt
        t.shape.extend(shape)
        req.raw_input_contents.append(raw)
    f = extract(req)
    assert f.temporal == FB and f.steps == 8
    req.raw_input_contents[1] = _bytes(b'{"policy": "nope"}')
    assert extract(req).temporal is None  # malformed: the backend refuses it by name
    resp = service_pb2.ModelInferResponse()
    for name in ("IMAGE", "EDIT_INFO"):
        o = resp.outputs.add()
        o.name = name
    resp.raw_output_contents.extend([_bytes(b"png"), _bytes(json.dumps({"temporal_computed_fraction": 0.6}).encode())])
    assert edit_info(resp) == {"temporal_computed_fraction": 0.6}
