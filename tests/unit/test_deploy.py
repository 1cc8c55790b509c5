"""deploy/: every overlay renders with ``kubectl kustomize`` and every object validates against its schema (the
``kubernetes`` package's models for core objects, with unknown fields forbidden; the vendored CRD OpenAPI
schemas for InferencePool, HTTPRoute and GRPCRoute), and the objects agree with each other and with the code."""

import json
import shutil
import subprocess

import jsonschema
import kubernetes.client
import pytest
import yaml

from maskedit_router.__main__ import parser as router_parser
from tests.conftest import REPO_ROOT

DEPLOY = REPO_ROOT / "deploy"
OVERLAYS = ["standalone", "gateway", "secured", "gateway-secured"]
SCHEMAS = {}
for path in (DEPLOY / "schemas").glob("*.json"):
    s = json.loads(path.read_text())
    SCHEMAS[(f"{s['group']}/{s['version']}", s["kind"])] = s["openAPIV3Schema"]

pytestmark = pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")


def render(overlay: str) -> list[dict]:
    out = subprocess.run(["kubectl", "kustomize", str(DEPLOY / "overlays" / overlay)], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def strict(schema):
    """The CRD schema with unknown fields rejected (the API server would prune them: a typo would vanish)."""
    if isinstance(schema, dict):
        schema = {k: strict(v) for k, v in schema.items()}
        if "properties" in schema and not schema.get("x-kubernetes-preserve-unknown-fields"):
            schema.setdefault("additionalProperties", False)
        return schema
    if isinstance(schema, list):
        return [strict(v) for v in schema]
    return schema


def validate(obj: dict) -> None:
    key = (obj["apiVersion"], obj["kind"])
    if key in SCHEMAS:
        schema = strict(SCHEMAS[key])
        schema["properties"]["metadata"] = {"type": "object"}  # ObjectMeta: checked with the core model below
        jsonschema.validate(obj, schema)
        kubernetes.client.V1ObjectMeta.model_validate(obj["metadata"])
        return
    version = obj["apiVersion"].split("/")[-1].capitalize()
    model = getattr(kubernetes.client, f"{version}{obj['kind']}", None)
    assert model is not None, f"no schema for {key}"
    model.model_validate(obj)  # pydantic: strict types, required fields, unknown fields forbidden


@pytest.fixture(scope="module", params=OVERLAYS)
def objects(request):
    return request.param, render(request.param)


def _by_kind(objs, kind):
    return {o["metadata"]["name"]: o for o in objs if o["kind"] == kind}


def test_every_object_validates(objects):
    _, objs = objects
    for obj in objs:
        validate(obj)


def test_the_validator_rejects_typos_and_bad_values():
    objs = render("gateway")
    dep = json.loads(json.dumps(_by_kind(objs, "Deployment")["maskedit-triton"]))
    dep["spec"]["template"]["spec"]["containers"][0]["volumeMount"] = []
    with pytest.raises(Exception, match="volumeMount"):
        validate(dep)
    pool = json.loads(json.dumps(_by_kind(objs, "InferencePool")["maskedit-grpc"]))
    pool["spec"]["targetPorts"][0]["number"] = 70000
    with pytest.raises(jsonschema.ValidationError):
        validate(pool)
    route = json.loads(json.dumps(_by_kind(objs, "HTTPRoute")["maskedit-http"]))
    route["spec"]["rules"][0]["matchs"] = route["spec"]["rules"][0].pop("matches")
    with pytest.raises(jsonschema.ValidationError, match="matchs"):
        validate(route)


def _container(dep):
    return dep["spec"]["template"]["spec"]["containers"][0]


def _env(container) -> dict:
    return {e["name"]: e["value"] for e in container.get("env", [])}


def _gib(q: str) -> int:
    assert q.endswith("Gi"), q
    return int(q[:-2]) << 30


def test_triton_pods_have_a_gpu_a_real_readiness_probe_and_shm_for_the_memory_tier(objects):
    _, objs = objects
    triton = _by_kind(objs, "Deployment")["maskedit-triton"]
    c = _container(triton)
    assert c["resources"]["requests"]["nvidia.com/gpu"] == "1" == c["resources"]["limits"]["nvidia.com/gpu"]
    assert c["readinessProbe"]["exec"]["command"][:3] == ["python3", "-m", "maskedit_router.probe"]
    volumes = {v["name"]: v for v in triton["spec"]["template"]["spec"]["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    shm = volumes[mounts["/dev/shm"]]["emptyDir"]
    env = _env(c)
    assert shm["medium"] == "Memory" and env["MASKEDIT_CACHE_MEM_DIR"].startswith("/dev/shm/")
    # the memory tier plus room for Triton's Python-backend regions
    assert _gib(shm["sizeLimit"]) >= int(env["MASKEDIT_CACHE_MEM_BYTES"]) + (2 << 30)
    disk_mount = next(p for p in mounts if env["MASKEDIT_CACHE_DISK_DIR"].startswith(p + "/"))
    assert "hostPath" in volumes[mounts[disk_mount]]  # node-local
    svc = _by_kind(objs, "Service")["maskedit-triton"]
    assert svc["spec"]["clusterIP"] == "None"  # headless: DNS lists the pods
    assert svc["spec"]["selector"].items() <= triton["spec"]["template"]["metadata"]["labels"].items()


def _router_args(dep):
    """The container's command, parsed by the router's own command line."""
    cmd = _container(dep)["command"]
    assert cmd[0] == "maskedit-router"
    return router_parser().parse_args(cmd[1:])


def test_router_and_picker_find_the_triton_pods_and_expose_their_ports(objects):
    overlay, objs = objects
    deps, svcs = _by_kind(objs, "Deployment"), _by_kind(objs, "Service")
    name = {"standalone": "maskedit-router", "gateway": "maskedit-picker", "secured": "maskedit-router",
            "gateway-secured": "maskedit-picker"}[overlay]
    args = _router_args(deps[name])
    host, port = args.backends_dns.split(":")
    assert host in svcs and svcs[host]["spec"]["clusterIP"] == "None"
    assert int(port) in [p["port"] for p in svcs[host]["spec"]["ports"] if p["name"] == "grpc"]
    assert args.host == "0.0.0.0"
    ports = {p["containerPort"] for p in _container(deps[name])["ports"]}
    assert {args.http_port, args.openai_port} <= ports
    if overlay.startswith("gateway"):
        assert args.ext_proc_port in ports
    svc_targets = {p["targetPort"] for p in svcs[name]["spec"]["ports"]}
    assert svc_targets <= {p["name"] for p in _container(deps[name])["ports"]}


def test_pools_routes_and_picker_agree():
    objs = render("gateway")
    pools, svcs, deps = _by_kind(objs, "InferencePool"), _by_kind(objs, "Service"), _by_kind(objs, "Deployment")
    triton_labels = deps["maskedit-triton"]["spec"]["template"]["metadata"]["labels"]
    args = _router_args(deps["maskedit-picker"])
    ports = {"maskedit-grpc": args.target_port, "maskedit-http": args.http_target_port}
    for name, pool in pools.items():
        assert pool["spec"]["selector"]["matchLabels"].items() <= triton_labels.items()
        assert [p["number"] for p in pool["spec"]["targetPorts"]] == [ports[name]]
        ref = pool["spec"]["endpointPickerRef"]
        assert ref["port"]["number"] in [p["port"] for p in svcs[ref["name"]]["spec"]["ports"]]
        assert args.ext_proc_port == ref["port"]["number"]
    refs = [b for kind in ("HTTPRoute", "GRPCRoute") for r in _by_kind(objs, kind).values()
            for rule in r["spec"]["rules"] for b in rule["backendRefs"]]
    for b in refs:
        if b.get("kind") == "InferencePool":
            assert b["name"] in pools
        else:
            assert b["port"] in [p["port"] for p in svcs[b["name"]]["spec"]["ports"]]
    assert {b["name"] for b in refs} == {"maskedit-grpc", "maskedit-http", "maskedit-picker"}


def test_the_image_has_what_the_manifests_run():
    """Router, picker and the readiness probe run from the project's image (see the Dockerfile)."""
    dockerfile = (REPO_ROOT / "Dockerfile").read_text()
    assert "COPY router ./router" in dockerfile and "cost_model_bench-flux-fill.json" in dockerfile
    serve = (REPO_ROOT / "requirements-serve.txt").read_text()
    for pkg in ("tritonclient[all]", "aiohttp", "xds-protos", "prometheus-client"):
        assert f"\n{pkg}==" in serve, pkg


def test_the_secured_overlay_mounts_the_key_file_and_certificate_from_secrets_where_the_settings_point():
    from maskedit_common.settings import VARIABLES

    objs = render("secured")
    router = _by_kind(objs, "Deployment")["maskedit-router"]["spec"]["template"]["spec"]
    c = router["containers"][0]
    env = {e["name"]: e["value"] for e in c["env"]}
    assert {"MASKEDIT_API_KEYS_FILE", "MASKEDIT_TLS_CERT", "MASKEDIT_TLS_KEY"} <= set(env)
    assert set(env) <= {v.name for v in VARIABLES}  # names the settings read
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    secrets = {v["name"]: v["secret"]["secretName"] for v in router["volumes"] if "secret" in v}
    for var, secret in (("MASKEDIT_API_KEYS_FILE", "maskedit-api-keys"), ("MASKEDIT_TLS_CERT", "maskedit-router-tls"),
                        ("MASKEDIT_TLS_KEY", "maskedit-router-tls")):
        d = env[var].rsplit("/", 1)[0]
        assert secrets[mounts[d]] == secret, var
    assert all(m.get("readOnly") for m in c["volumeMounts"] if m["name"] in ("api-keys", "tls"))
    assert c["readinessProbe"]["httpGet"]["scheme"] == "HTTPS"  # /health stays open, over TLS
    assert not any(o["kind"] == "Secret" for o in objs)  # the secrets themselves are never in the repository


def _allowed(policies, pod_labels: dict, port: str, namespace_labels=None) -> bool:
    """Whether a pod with ``pod_labels`` (in the policies' namespace, or in another one when ``namespace_labels``)
    may reach ``port`` of the pods the policies select: NetworkPolicy's rules, for the selectors used here."""
    def matches(sel, labels):
        ok = sel.get("matchLabels", {}).items() <= labels.items()
        for e in sel.get("matchExpressions", []):
            assert e["operator"] == "In", e
            ok = ok and labels.get(e["key"]) in e["values"]
        return ok

    for pol in policies:
        for rule in pol["spec"].get("ingress", []):
            if rule.get("ports") and port not in [p["port"] for p in rule["ports"]]:
                continue
            if "from" not in rule:
                return True
            for peer in rule["from"]:
                if "namespaceSelector" in peer:
                    if not matches(peer["namespaceSelector"], namespace_labels or {}):
                        continue
                elif namespace_labels is not None:
                    continue  # a podSelector alone: the policy's own namespace only
                if matches(peer.get("podSelector", {}), pod_labels):
                    return True
    return False


def test_only_the_router_picker_and_gateway_reach_the_triton_pods_model_ports(objects):
    """A client that reached a pod could name its own tenant to the backends' fair share: the NetworkPolicies let
    in only what sets the tenant from a key (router, picker, the gateway's proxies), and metrics from anywhere."""
    overlay, objs = objects
    deps = _by_kind(objs, "Deployment")
    triton = deps["maskedit-triton"]["spec"]["template"]["metadata"]["labels"]
    policies = [p for p in _by_kind(objs, "NetworkPolicy").values()
                if p["spec"]["podSelector"]["matchLabels"].items() <= triton.items()]
    assert all(p["spec"]["policyTypes"] == ["Ingress"] for p in policies) and policies
    named = {p["name"] for p in _container(deps["maskedit-triton"])["ports"]}
    assert all(p["port"] in named for pol in policies for r in pol["spec"]["ingress"] for p in r.get("ports", []))
    front = "maskedit-picker" if overlay.startswith("gateway") else "maskedit-router"
    front_labels = deps[front]["spec"]["template"]["metadata"]["labels"]
    gateway_proxy = {"gateway.networking.k8s.io/gateway-name": "inference-gateway"}
    for port in ("grpc", "http"):
        assert _allowed(policies, front_labels, port)
        assert not _allowed(policies, {"app": "someone-else"}, port)  # the negative control
        assert not _allowed(policies, front_labels, port, namespace_labels={"x": "y"})  # elsewhere: not the front
        assert _allowed(policies, gateway_proxy, port, {"kubernetes.io/metadata.name": "gw"}) == \
            overlay.startswith("gateway")
    assert _allowed(policies, {"app": "prometheus"}, "metrics", {"kubernetes.io/metadata.name": "monitoring"})


def test_the_gateway_secured_overlay_gives_the_picker_the_key_file_from_its_secret():
    objs = render("gateway-secured")
    picker = _by_kind(objs, "Deployment")["maskedit-picker"]["spec"]["template"]["spec"]
    c = picker["containers"][0]
    path = _env(c)["MASKEDIT_API_KEYS_FILE"]
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    mount = mounts[path.rsplit("/", 1)[0]]
    assert mount["readOnly"]
    assert {v["name"]: v["secret"]["secretName"] for v in picker["volumes"]}[mount["name"]] == "maskedit-api-keys"
    assert not any(o["kind"] == "Secret" for o in objs)
