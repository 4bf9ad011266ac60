"""deploy/k8s and deploy/Dockerfile: every overlay renders (kubectl kustomize), every object is valid against a
pinned Kubernetes API (kubernetes-validate, offline schemas), every container's args parse with our own CLI parsers
and build a valid config (a flag typo fails here, not in a cluster), and the image installs what the README does."""

from __future__ import annotations

import re
import shutil
import subprocess
import warnings
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from hybridpd.cli import build_parser
from hybridpd.proxy.main import config_from_args as proxy_config
from hybridpd.server.args import configs_from_args as node_configs, parse_size

ROOT = Path(__file__).resolve().parents[3]
K8S = ROOT / "deploy" / "k8s"
KUBERNETES_VERSION = "1.32.0"  # the API the manifests are written against (kubectl 1.32 renders them here)
TARGETS = ["base", "overlays/image-model", "overlays/pvc-model", "overlays/monitoring", "overlays/kv-offload",
           "overlays/cache-aware"]
POD_IP = "10.1.2.3"

if shutil.which("kubectl") is None:
    warnings.warn("kubectl is not installed: the manifest tests of deploy/k8s are SKIPPED", stacklevel=1)
pytestmark = pytest.mark.skipif(shutil.which("kubectl") is None,
                                reason="SKIPPED LOUDLY: kubectl (with kustomize) is not installed on this machine")


def render(target: str) -> list[dict]:
    done = subprocess.run(["kubectl", "kustomize", str(K8S / target)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


def containers(objects: list[dict]) -> list[tuple[str, dict, dict]]:
    return [(o["metadata"]["name"], o, c) for o in objects if o["kind"] == "Deployment"
            for c in o["spec"]["template"]["spec"]["containers"]]


@pytest.fixture(scope="module", params=TARGETS)
def rendered(request) -> list[dict]:
    return render(request.param)


def test_every_object_is_valid_for_the_pinned_api(rendered):
    assert {o["kind"] for o in rendered} >= {"Deployment", "Service", "PodDisruptionBudget"}
    for obj in rendered:
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)


def test_every_container_parses_with_our_cli(rendered, tmp_path):
    token = tmp_path / "token"
    token.write_text("a-cluster-token\n")
    for name, _, container in containers(rendered):
        assert container["image"].startswith("hybridpd")
        args = [a.replace("$(POD_IP)", POD_IP).replace("/etc/hybridpd/token/token", str(token))
                for a in container["args"]]
        try:
            parsed = build_parser(args[0]).parse_args(args)
        except SystemExit as exc:  # argparse's answer to an unknown or malformed flag
            pytest.fail(f"{name}: `hybridpd {' '.join(args)}` does not parse (exit {exc.code})")
        if args[0] == "serve":
            configs = node_configs(parsed, default_model_dir=lambda: Path("/opt/hybridpd/cache/small-v2"))
            assert configs.kv_transfer.kv_host == POD_IP and configs.server.host == "0.0.0.0"
            assert configs.server.cluster_token == "a-cluster-token"
        else:
            assert args[0] == "proxy"
            config = proxy_config(parsed)
            assert config.prefill_dns is not None and config.decode_dns is not None
            assert config.cluster_token == "a-cluster-token"


def test_the_cache_aware_overlay_publishes_events_where_the_pods_expose_them(tmp_path):
    token = tmp_path / "token"
    token.write_text("a-cluster-token\n")
    for name, _, container in containers(render("overlays/cache-aware")):
        args = [a.replace("$(POD_IP)", POD_IP).replace("/etc/hybridpd/token/token", str(token))
                for a in container["args"]]
        parsed = build_parser(args[0]).parse_args(args)
        if args[0] == "proxy":
            config = proxy_config(parsed)
            assert config.routing.value == "cache_aware" and config.cost_rule.pd_threshold > 0
            continue
        events = node_configs(parsed, default_model_dir=lambda: Path("/opt/hybridpd/cache/small-v2")).kv_events
        assert events.publishes, name
        ports = {p["containerPort"] for p in container["ports"]}
        for endpoint in (events.endpoint, events.replay_endpoint):
            assert endpoint is not None and endpoint.startswith("tcp://*:") and int(endpoint.rsplit(":", 1)[1]) in ports


def test_node_pods_are_sized_from_their_flags(rendered):
    for name, deployment, container in containers(rendered):
        spec = deployment["spec"]["template"]["spec"]
        flags = dict(a.split("=", 1) for a in container["args"] if a.startswith("--") and "=" in a)
        assert deployment["spec"]["template"]["metadata"]["annotations"]["prometheus.io/scrape"] == "true"
        if "--shutdown-grace" in flags:
            assert spec["terminationGracePeriodSeconds"] > float(flags["--shutdown-grace"])
        if "--kv-cache-memory" in flags:
            request = _bytes(container["resources"]["requests"]["memory"])
            limit = _bytes(container["resources"]["limits"]["memory"])
            assert request >= parse_size(flags["--kv-cache-memory"]) + 512 * 2**20 and limit > request
            assert container["readinessProbe"]["httpGet"]["path"] == "/health"
            assert container["livenessProbe"]["httpGet"]["path"] == "/health"


def test_no_secret_material_in_the_manifests(rendered):
    for obj in rendered:
        assert obj["kind"] != "Secret", "the cluster token's Secret is created by the operator, never committed"
    text = yaml.safe_dump_all(rendered)
    assert "--cluster-token=" not in text and "secretName: hybridpd-cluster-token" in text


def test_headless_services_back_the_proxys_dns_discovery():
    objects = render("base")
    services = {o["metadata"]["name"]: o for o in objects if o["kind"] == "Service"}
    proxy_args = next(c["args"] for _, _, c in containers(objects) if c["args"][0] == "proxy")
    for flag in ("--prefiller-dns", "--decoder-dns"):
        name, port = next(a.split("=", 1)[1] for a in proxy_args if a.startswith(flag)).rsplit(":", 1)
        service = services[name]
        assert service["spec"]["clusterIP"] == "None"
        assert int(port) in {p["port"] for p in service["spec"]["ports"]}


def _bytes(quantity: str) -> int:
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30}
    match = re.fullmatch(r"(\d+)(Ki|Mi|Gi)?", quantity)
    assert match, quantity
    return int(match[1]) * units.get(match[2] or "", 1)


def test_the_image_installs_what_the_readme_installs():
    dockerfile = (ROOT / "deploy" / "Dockerfile").read_text()
    makefile = (ROOT / "Makefile").read_text()
    pin = re.search(r"pip install -q (torch==[\d.]+)", makefile)[1]
    assert re.search(rf"pip install [^\n]*{re.escape(pin)}\n", dockerfile), f"the image must install {pin} first"
    assert dockerfile.index(pin) < dockerfile.index("RUN pip install .")
    readme = (ROOT / "README.md").read_text()
    assert pin in readme
    make_extras = set(re.search(r"pip install -q -e '\.\[([^\]]*)\]'", makefile)[1].split(","))
    image_extras = set(re.findall(r"pip install \.\[([^\]]*)\]", dockerfile))
    assert image_extras <= make_extras  # the image: runtime dependencies only, never another set of extras
    assert "USER 10001" in dockerfile and 'ENTRYPOINT ["hybridpd"]' in dockerfile
    assert "default_model_dir()" in dockerfile  # the default model generated into the image at build time
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert ".venv" in ignored and ".git" in ignored


def test_parse_size_is_what_the_sizes_use():
    assert parse_size("512MiB") == 512 * 2**20


