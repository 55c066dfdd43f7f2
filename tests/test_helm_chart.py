"""The helm chart (helm/shardmq/), checked by the real helm binary and Kubernetes' own JSON schemas.

No Kubernetes cluster (kind, minikube) is available here, so nothing is installed: `helm lint` and
`helm template` run for the default values and every value set in helm/shardmq/ci/, each rendered
manifest is validated (strict: unknown fields fail) against the schemas of Kubernetes K8S_VERSION
that kubernetes-validate ships (offline), and the tests read the rendered objects for what the
chart promises (probes, PDB, anti-affinity, security context, Services, etcd, the INI file).
scripts/test.sh installs the pinned helm into .venv/bin (scripts/_common.sh: ensure_helm).
"""

from __future__ import annotations

import base64
import configparser
import math
import re
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import kubernetes_validate
import pika
import pytest
import yaml

from broker import cpus
from broker.config import load_settings
from tests.design_names import known_ini_keys, unknown_names
from tests.kube_api_stub import KubeApiStub

REPO = Path(__file__).resolve().parent.parent
CHART = REPO / "helm" / "shardmq"
VALUE_SETS = sorted(p.name for p in (CHART / "ci").glob("*-values.yaml"))
# The Kubernetes release the manifests are validated against (and helm renders for).
K8S_VERSION = "1.33.0"
RELEASE, NAMESPACE = "mq", "messaging"


def helm_binary() -> str:
    for candidate in (REPO / ".venv" / "bin" / "helm", shutil.which("helm")):
        if candidate and Path(candidate).is_file():
            return str(candidate)
    raise AssertionError("helm not found: run scripts/test.sh (it installs the pinned helm into .venv/bin)")


def helm(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run([helm_binary(), *args], capture_output=True, text=True, timeout=60)
    if check and proc.returncode != 0:
        raise AssertionError(f"helm {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


def render(*values: str, sets: tuple[str, ...] = (), set_files: tuple[str, ...] = ()) -> list[dict]:
    args = ["template", RELEASE, str(CHART), "--namespace", NAMESPACE, "--kube-version", K8S_VERSION]
    for name in values:
        args += ["-f", str(CHART / "ci" / name)]
    for item in sets:
        args += ["--set", item]
    for item in set_files:
        args += ["--set-file", item]
    return [doc for doc in yaml.safe_load_all(helm(*args).stdout) if doc]


def objects(docs: list[dict], kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def one(docs: list[dict], kind: str, name: str) -> dict:
    found = objects(docs, kind)
    assert name in found, f"no {kind} {name}; have {sorted(found)}"
    return found[name]


def ini_of(docs: list[dict]) -> configparser.ConfigParser:
    ini = configparser.ConfigParser(interpolation=None)
    ini.read_string(one(docs, "ConfigMap", "mq-shardmq")["data"]["shardmq.ini"])
    return ini


def container(docs: list[dict], name: str = "mq-shardmq") -> dict:
    (c,) = one(docs, "StatefulSet", name)["spec"]["template"]["spec"]["containers"]
    return c


# ---------------------------------------------------------------------------------- lint and schemas
def test_helm_version_is_the_pinned_one():
    assert helm("version", "--short").stdout.startswith("v4.1.4")


@pytest.mark.parametrize("values", [None, *VALUE_SETS])
def test_lint_strict(values):
    args = ["lint", "--strict", str(CHART), "--namespace", NAMESPACE, "--kube-version", K8S_VERSION]
    if values:
        args += ["-f", str(CHART / "ci" / values)]
    out = helm(*args).stdout
    assert "0 chart(s) failed" in out


@pytest.mark.parametrize("values", [None, *VALUE_SETS])
def test_every_rendered_manifest_validates_against_the_kubernetes_schemas(values):
    docs = render(*([values] if values else []))
    assert docs
    for doc in docs:
        where = f"{doc.get('kind')} {doc.get('metadata', {}).get('name')}"
        if doc["apiVersion"] == "monitoring.coreos.com/v1":
            _check_servicemonitor(doc, docs)
        elif doc["apiVersion"] == "cert-manager.io/v1":
            _check_certificate(doc)
        else:
            try:
                kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
            except kubernetes_validate.ValidationError as exc:
                raise AssertionError(f"{where}: {exc.message} at {list(exc.path)}") from None
        # Names must be DNS labels; helm would not catch a too-long generated one.
        assert len(doc["metadata"]["name"]) <= 63, where


def _check_servicemonitor(doc: dict, docs: list[dict]) -> None:
    # The prometheus-operator CRD is not in Kubernetes' schemas: check what it must refer to.
    assert doc["kind"] == "ServiceMonitor"
    service = one(docs, "Service", "mq-shardmq")
    assert doc["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    port_names = {p["name"] for p in service["spec"]["ports"]}
    for endpoint in doc["spec"]["endpoints"]:
        assert endpoint["port"] in port_names and endpoint["path"] == "/metrics"


def _check_certificate(doc: dict) -> None:
    # cert-manager's CRD is not in Kubernetes' schemas either.
    assert doc["kind"] == "Certificate"
    spec = doc["spec"]
    assert spec["secretName"] and spec["issuerRef"]["name"] and spec["dnsNames"]
    assert set(spec) <= {"secretName", "duration", "renewBefore", "commonName", "dnsNames", "usages", "issuerRef"}


# ---------------------------------------------------------------------------------- what the chart promises
def test_default_is_a_three_node_cluster_with_bundled_etcd():
    docs = render()
    sts = one(docs, "StatefulSet", "mq-shardmq")
    spec, pod = sts["spec"], sts["spec"]["template"]["spec"]
    assert spec["replicas"] == 3 and spec["serviceName"] == "mq-shardmq-headless"
    assert spec["volumeClaimTemplates"][0]["spec"]["resources"]["requests"]["storage"] == "8Gi"
    # Probes on the health routes, and a startup probe long enough to recover a big data dir.
    c = container(docs)
    assert c["readinessProbe"]["httpGet"] == {"path": "/api/health/checks/ready", "port": "http"}
    assert c["livenessProbe"]["tcpSocket"] == {"port": "http"}
    startup = c["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 3600
    # Non-root, read-only root filesystem, no capabilities, graceful stop.
    assert pod["securityContext"]["runAsNonRoot"] and pod["securityContext"]["runAsUser"] != 0
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert c["securityContext"]["capabilities"]["drop"] == ["ALL"]
    assert pod["terminationGracePeriodSeconds"] >= 30
    assert "preferredDuringSchedulingIgnoredDuringExecution" in pod["affinity"]["podAntiAffinity"]
    # Every port a Service targets by name exists on the container.
    port_names = {p["name"] for p in c["ports"]}
    for service in objects(docs, "Service").values():
        if service["metadata"]["name"].startswith("mq-shardmq-etcd"):
            continue
        for p in service["spec"]["ports"]:
            assert p["targetPort"] in port_names, (service["metadata"]["name"], p)
    assert {"amqp", "mqtt", "ws", "http", "metrics", "replication"} <= port_names
    headless = one(docs, "Service", "mq-shardmq-headless")["spec"]
    assert headless["clusterIP"] == "None" and headless["publishNotReadyAddresses"] is True
    assert one(docs, "Service", "mq-shardmq")["spec"]["type"] == "ClusterIP"
    assert one(docs, "PodDisruptionBudget", "mq-shardmq")["spec"]["maxUnavailable"] == 1
    # Per-pod identity through DESIGN's flags; the cluster settings through its INI keys.
    assert "--node-name=$(POD_NAME)" in c["args"]
    assert "--advertised-host=$(POD_NAME).mq-shardmq-headless.$(POD_NAMESPACE).svc" in c["args"]
    ini = ini_of(docs)
    assert ini["clustering"]["enabled"] == "true"
    assert ini["clustering"]["etcd_endpoints"] == ",".join(
        f"mq-shardmq-etcd-{i}.mq-shardmq-etcd-headless.messaging.svc:2379" for i in range(3))
    assert ini["clustering"]["secret_file"] == "/etc/shardmq/cluster/cluster-secret"
    # The bundled etcd: 3 members that know each other.
    etcd = one(docs, "StatefulSet", "mq-shardmq-etcd")
    assert etcd["spec"]["replicas"] == 3
    args = etcd["spec"]["template"]["spec"]["containers"][0]["args"]
    initial = next(a for a in args if a.startswith("--initial-cluster="))
    assert initial.count("=http://") == 3
    assert one(docs, "Service", "mq-shardmq-etcd-headless")["spec"]["publishNotReadyAddresses"] is True
    secret = one(docs, "Secret", "mq-shardmq")["data"]
    assert len(base64.b64decode(secret["cluster-secret"])) == 48 and secret["default-pass"]
    assert objects(docs, "ServiceMonitor") == {}  # off by default


def test_standalone_has_no_etcd_and_no_cluster_settings():
    docs = render("standalone-values.yaml")
    assert one(docs, "StatefulSet", "mq-shardmq")["spec"]["replicas"] == 1
    assert list(objects(docs, "StatefulSet")) == ["mq-shardmq"]
    assert not ini_of(docs).has_section("clustering")
    assert "cluster-secret" not in one(docs, "Secret", "mq-shardmq")["data"]
    c = container(docs)
    assert c["args"] == ["--config=/etc/shardmq/shardmq.ini"]
    assert "replication" not in {p["name"] for p in c["ports"]}


def test_external_etcd_and_existing_secrets():
    docs = render("external-etcd-values.yaml")
    assert list(objects(docs, "StatefulSet")) == ["mq-shardmq"]
    ini = ini_of(docs)
    assert ini["clustering"]["etcd_endpoints"] == "etcd-a.infra.svc:2379,etcd-b.infra.svc:2379,etcd-c.infra.svc:2379"
    assert (ini["clustering"]["etcd_prefix"], ini["clustering"]["min_isr"]) == ("shardmq-prod", "1")
    assert "Secret" not in {d["kind"] for d in docs}  # both secrets come from the operator
    pod = one(docs, "StatefulSet", "mq-shardmq")["spec"]["template"]["spec"]
    vols = {v["name"]: v for v in pod["volumes"]}
    assert vols["cluster-secret"]["secret"]["secretName"] == "shardmq-cluster"
    env = {e["name"]: e for e in container(docs)["env"]}
    assert env["SHARDMQ_DEFAULT_PASS"]["valueFrom"]["secretKeyRef"]["name"] == "shardmq-users"
    assert "requiredDuringSchedulingIgnoredDuringExecution" in pod["affinity"]["podAntiAffinity"]


def test_tls_from_an_existing_secret():
    docs = render("tls-values.yaml")
    ini = ini_of(docs)
    assert dict(ini["tls"]) == {"cert": "/etc/shardmq/tls/tls.crt", "key": "/etc/shardmq/tls/tls.key",
                                "ca": "/etc/shardmq/tls/ca.crt", "verify_peer": "1"}
    assert (ini["amqp"]["tls_port"], ini["mqtt"]["tls_port"]) == ("5671", "8883")
    service_ports = {p["name"]: p["port"] for p in one(docs, "Service", "mq-shardmq")["spec"]["ports"]}
    assert (service_ports["amqps"], service_ports["mqtts"]) == (5671, 8883)
    mounts = {m["name"]: m["mountPath"] for m in container(docs)["volumeMounts"]}
    assert mounts["tls"] == "/etc/shardmq/tls"
    vols = {v["name"]: v for v in one(docs, "StatefulSet", "mq-shardmq")["spec"]["template"]["spec"]["volumes"]}
    assert vols["tls"]["secret"]["secretName"] == "shardmq-tls"


def test_tls_inline_material_becomes_a_tls_secret(tmp_path):
    cert, key = tmp_path / "c.pem", tmp_path / "k.pem"
    cert.write_text("-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n")
    key.write_text("-----BEGIN PRIVATE KEY-----\nMIIE\n-----END PRIVATE KEY-----\n")
    docs = render(sets=("tls.enabled=true",), set_files=(f"tls.cert={cert}", f"tls.key={key}"))
    secret = one(docs, "Secret", "mq-shardmq-tls")
    assert secret["type"] == "kubernetes.io/tls"
    assert base64.b64decode(secret["data"]["tls.crt"]).decode() == cert.read_text()
    assert "ca" not in ini_of(docs)["tls"]
    for doc in docs:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_cert_manager_and_servicemonitor():
    docs = render("cert-manager-values.yaml")
    cert = one(docs, "Certificate", "mq-shardmq")["spec"]
    assert cert["secretName"] == "mq-shardmq-tls" and cert["issuerRef"]["kind"] == "ClusterIssuer"
    assert "mq.example.com" in cert["dnsNames"] and "*.mq-shardmq-headless.messaging.svc" in cert["dnsNames"]
    assert "mq-shardmq-tls" not in objects(docs, "Secret")  # cert-manager writes it
    monitor = one(docs, "ServiceMonitor", "mq-shardmq")
    assert monitor["metadata"]["labels"]["release"] == "prometheus"
    assert monitor["spec"]["endpoints"][0]["port"] == "metrics"


def test_loadbalancer_and_nodeport_services():
    lb = one(render("loadbalancer-values.yaml"), "Service", "mq-shardmq")
    assert lb["spec"]["type"] == "LoadBalancer" and lb["spec"]["externalTrafficPolicy"] == "Local"
    assert lb["spec"]["loadBalancerSourceRanges"] == ["10.0.0.0/8"]
    assert "ws" not in {p["name"] for p in lb["spec"]["ports"]}  # listeners.ws: 0 = off
    assert lb["metadata"]["annotations"]["service.beta.kubernetes.io/aws-load-balancer-type"] == "nlb"
    docs = render("nodeport-values.yaml")
    ports = {p["name"]: p for p in one(docs, "Service", "mq-shardmq")["spec"]["ports"]}
    assert (ports["amqp"]["nodePort"], ports["http"]["nodePort"]) == (30672, 31672)
    assert "nodePort" not in ports["mqtt"]
    assert "volumeClaimTemplates" not in one(docs, "StatefulSet", "mq-shardmq")["spec"]
    assert not objects(docs, "PodDisruptionBudget").get("mq-shardmq")


def test_generated_secrets_are_random_unless_given():
    first = one(render(), "Secret", "mq-shardmq")["data"]["cluster-secret"]
    second = one(render(), "Secret", "mq-shardmq")["data"]["cluster-secret"]
    assert first != second  # `helm template` has no cluster to look the old one up in
    given = one(render(sets=("cluster.secret=s3cret", "auth.defaultPassword=pw")), "Secret", "mq-shardmq")["data"]
    assert base64.b64decode(given["cluster-secret"]) == b"s3cret" and base64.b64decode(given["default-pass"]) == b"pw"


@pytest.mark.parametrize(("sets", "message"), [
    (("etcd.bundled=false",), "replicaCount > 1 is a cluster and needs etcd"),
    (("tls.enabled=true",), "tls.enabled needs tls.existingSecret"),
    (("replicaCount=0",), "minimum: got 0, want 1"),
    (("service.type=Ingress",), "service/type"),
    (("config.sync=sometimes",), "config/sync"),
    (("etcd.endpoints={etcd:2379,bad host}",), "etcd/endpoints"),
])
def test_bad_values_are_refused_with_a_message(sets, message):
    args = ["template", RELEASE, str(CHART), "--kube-version", K8S_VERSION]
    for item in sets:
        args += ["--set", item]
    proc = helm(*args, check=False)
    assert proc.returncode != 0
    assert message in proc.stderr, proc.stderr


@pytest.mark.parametrize("values", [None, *VALUE_SETS])
def test_ini_file_uses_the_names_of_the_design_and_loads_where_built(values, tmp_path):
    docs = render(*([values] if values else []))
    ini = ini_of(docs)
    pairs = {(s, k) for s in ini.sections() for k in ini[s]}
    flags = {a.split("=", 1)[0] for a in container(docs)["args"]}
    env = {e["name"] for e in container(docs)["env"] if e["name"].startswith("SHARDMQ_")}
    assert unknown_names(pairs, flags, env) == []
    # The keys broker/config.py has today load through it, with the values the chart meant.
    known = known_ini_keys()
    built = configparser.ConfigParser(interpolation=None)
    for section, key in sorted(pairs & known):
        if not built.has_section(section):
            built.add_section(section)
        built[section][key] = ini[section][key]
    path = tmp_path / "built.ini"
    with open(path, "w") as fh:
        built.write(fh)
    settings = load_settings(["--config", str(path)], {})
    assert (settings.bind, settings.port, settings.http_bind, settings.http_port) == ("0.0.0.0", 5672, "0.0.0.0", 15672)
    # A subdirectory of the volume mounted at /var/lib/shardmq: fsGroup makes the volume's root
    # group-writable, which the node refuses as a data dir.
    assert settings.data_dir == "/var/lib/shardmq/data"
    assert settings.loopback_users == []


@pytest.mark.parametrize("values", [None, *VALUE_SETS])
def test_process_counts_follow_the_cpu_limit(values):
    # The chart leaves --frontends/--shards to the node's rule (broker/cpus.py), which reads the
    # container's CPU quota: the counts the pod runs are the rule's for the limit the chart sets,
    # and the scheduler reserves that many cores (request == limit).
    docs = render(*([values] if values else []))
    main = ini_of(docs)["main"]
    assert "frontends" not in main and "shards" not in main
    resources = container(docs)["resources"]
    limit = resources["limits"]["cpu"]
    assert resources["requests"]["cpu"] == limit
    cores = math.ceil(float(limit[:-1]) / 1000 if str(limit).endswith("m") else float(limit))
    assert (cpus.default_frontends(cores), cpus.default_shards(cores)) == (1, 1)


def test_explicit_process_counts_are_written_to_the_ini():
    main = ini_of(render(sets=("config.frontends=3", "config.shards=1")))["main"]
    assert (main["frontends"], main["shards"]) == ("3", "1")


def _release_secret(data: dict[str, bytes]) -> dict:
    # What the first install left: the release's Secret with helm's ownership metadata.
    return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
            "metadata": {"name": "mq-shardmq", "namespace": NAMESPACE,
                         "labels": {"app.kubernetes.io/managed-by": "Helm"},
                         "annotations": {"meta.helm.sh/release-name": RELEASE,
                                         "meta.helm.sh/release-namespace": NAMESPACE}},
            "data": {k: base64.b64encode(v).decode() for k, v in data.items()}}


def _render_against(stub: KubeApiStub, tmp_path: Path, *sets: str) -> dict[str, bytes]:
    args = ["template", RELEASE, str(CHART), "--namespace", NAMESPACE, "--dry-run=server",
            "--kubeconfig", str(stub.kubeconfig(tmp_path / "kubeconfig", NAMESPACE)),
            "--disable-openapi-validation"]
    for item in sets:
        args += ["--set", item]
    docs = [d for d in yaml.safe_load_all(helm(*args).stdout) if d]
    return {k: base64.b64decode(v) for k, v in one(docs, "Secret", "mq-shardmq")["data"].items()}


def test_upgrade_keeps_the_generated_secrets_through_lookup(tmp_path):
    # helm renders against an API server that has the release's Secret: its lookup must read the
    # generated values back instead of making new ones (new ones would lock every client out and
    # split the cluster). The API server is a stand-in (tests/kube_api_stub.py); helm is real.
    with KubeApiStub() as stub:
        stub.add(_release_secret({"default-pass": b"first-pass", "cluster-secret": b"first-cluster-secret"}))
        kept = _render_against(stub, tmp_path)
        assert kept == {"default-pass": b"first-pass", "cluster-secret": b"first-cluster-secret"}
        assert f"/api/v1/namespaces/{NAMESPACE}/secrets/mq-shardmq" in stub.requests
        # A value given explicitly still wins over the kept one.
        assert _render_against(stub, tmp_path, "auth.defaultPassword=rotated")["default-pass"] == b"rotated"


def test_standalone_upgraded_to_a_cluster_keeps_the_password_and_gets_a_cluster_secret(tmp_path):
    with KubeApiStub() as stub:
        stub.add(_release_secret({"default-pass": b"standalone-pass"}))
        kept = _render_against(stub, tmp_path)
        assert kept["default-pass"] == b"standalone-pass" and len(kept["cluster-secret"]) == 48


@pytest.mark.parametrize(("values", "expected", "absent"), [
    (None, ["a cluster of 3 nodes", "etcd: bundled (3 members)", "amqp://admin:PASSWORD@mq-shardmq.messaging.svc:5672/",
            "port-forward svc/mq-shardmq 5672 15672"], ["amqps://"]),
    ("standalone-values.yaml", ["one standalone node"], ["etcd:"]),
    ("tls-values.yaml", ["amqps://admin:PASSWORD@mq-shardmq.messaging.svc:5671/"], []),
    ("loadbalancer-values.yaml", ["status.loadBalancer.ingress"], ["port-forward"]),
    ("external-etcd-values.yaml", ["etcd: etcd-a.infra.svc:2379,etcd-b.infra.svc:2379", "get secret shardmq-users"], []),
])
def test_notes_say_how_to_connect(values, expected, absent, tmp_path):
    # NOTES.txt is rendered by install; --dry-run=client needs no cluster.
    args = ["install", RELEASE, str(CHART), "--namespace", NAMESPACE, "--dry-run=client",
            "--kubeconfig", str(tmp_path / "none")]
    if values:
        args += ["-f", str(CHART / "ci" / values)]
    out = helm(*args).stdout
    notes = out[out.index("NOTES:"):]
    for text in expected:
        assert text in notes, notes
    for text in absent:
        assert text not in notes, notes


class PodProcess:
    """One pod of the rendered StatefulSet run as a process: its args (with Kubernetes' $(VAR)
    expansion done for ``pod``), its INI file (less the keys of parts not on this branch, with the
    pod's listeners moved to loopback: harness flags win over the INI), the password from its Secret
    through SHARDMQ_DEFAULT_PASS, and the cluster secret file from the Secret."""

    def __init__(self, docs: list[dict], node_factory, workdir: Path, pod: str,
                 ini_overrides: dict[tuple[str, str], str] = (), extra_args: tuple[str, ...] = ()) -> None:
        self.c = c = container(docs)
        ini = ini_of(docs)
        workdir.mkdir(parents=True, exist_ok=True)
        secret = {k: base64.b64decode(v).decode() for k, v in one(docs, "Secret", "mq-shardmq")["data"].items()}
        overrides = {("amqp", "bind"): "127.0.0.1", ("http", "bind"): "127.0.0.1", **dict(ini_overrides)}
        if ini.has_section("clustering"):
            secret_file = workdir / "cluster-secret"
            secret_file.write_text(secret["cluster-secret"])
            overrides.update({("clustering", "secret_file"): str(secret_file), ("clustering", "bind"): "127.0.0.1"})
        if ini.has_section("tls"):
            # The TLS Secret as its volume mounts it (/etc/shardmq/tls/<key>), here in the workdir.
            tls_dir = workdir / "tls"
            tls_dir.mkdir()
            volumes = one(docs, "StatefulSet", "mq-shardmq")["spec"]["template"]["spec"]["volumes"]
            tls_secret = next(v["secret"]["secretName"] for v in volumes if v["name"] == "tls")
            for key, value in one(docs, "Secret", tls_secret)["data"].items():
                (tls_dir / key).write_bytes(base64.b64decode(value))
            for key in ("cert", "key", "ca"):
                if key in ini["tls"]:
                    overrides[("tls", key)] = ini["tls"][key].replace("/etc/shardmq/tls", str(tls_dir))
        built = configparser.ConfigParser(interpolation=None)
        for section in ini.sections():
            for key, value in ini[section].items():
                if (section, key) in known_ini_keys() and key != "data_dir":
                    if not built.has_section(section):
                        built.add_section(section)
                    built[section][key] = overrides.get((section, key), value)
        config = workdir / "shardmq.ini"
        with open(config, "w") as fh:
            built.write(fh)
        env_ref = next(e for e in c["env"] if e["name"] == "SHARDMQ_DEFAULT_PASS")["valueFrom"]["secretKeyRef"]
        self.user, self.password = ini["amqp"]["default_user"], secret[env_ref["key"]]
        subst = {"POD_NAME": pod, "POD_NAMESPACE": NAMESPACE}
        args = [re.sub(r"\$\((\w+)\)", lambda m: subst[m.group(1)], a).replace("/etc/shardmq/shardmq.ini", str(config))
                for a in c["args"]]
        self.node = node_factory(name=pod, start=False, frontends=1, shards=1, extra_args=[*args, *extra_args],
                                 env={"SHARDMQ_DEFAULT_PASS": self.password})
        self.node.start(wait=False)
        self.ports = {p["name"]: p["containerPort"] for p in c["ports"]}

    def probe(self, kind: str) -> bool:
        spec = self.c[kind]
        name = spec.get("httpGet", spec.get("tcpSocket"))["port"]
        port = {"amqp": self.node.port, "http": self.node.http_port}[name]
        try:
            if "httpGet" in spec:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}{spec['httpGet']['path']}", timeout=2) as resp:
                    return resp.status == 200
            with socket.create_connection(("127.0.0.1", port), timeout=2):
                return True
        except OSError:
            return False

    def wait_probes(self, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while not all(self.probe(p) for p in ("startupProbe", "readinessProbe", "livenessProbe")):
            assert time.monotonic() < deadline, self.node.log_tail()
            time.sleep(0.1)

    def login(self) -> pika.BlockingConnection:
        return pika.BlockingConnection(pika.ConnectionParameters(
            host="127.0.0.1", port=self.node.port, credentials=pika.PlainCredentials(self.user, self.password),
            connection_attempts=1))


@pytest.mark.integration
def test_the_pod_as_rendered_runs_as_a_real_node(node_factory, tmp_path):
    # The standalone pod as a process: its probes pass against the real node, and the default user
    # logs in with the password of the chart's Secret.
    docs = render("standalone-values.yaml", sets=("auth.defaultPassword=pod-secret",))
    pod = PodProcess(docs, node_factory, tmp_path / "pod", "mq-shardmq-0")
    pod.wait_probes()
    conn = pod.login()
    conn.channel().queue_declare("from-the-chart")
    conn.close()
    assert pod.node.stop() == 0


def _self_signed(tmp_path: Path) -> tuple[Path, Path]:
    """A CA-less server certificate for 127.0.0.1 (its own CA), PEM files."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "mq-shardmq")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = tmp_path / "server.pem", tmp_path / "server.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_path, key_path


@pytest.mark.integration
def test_the_tls_pod_as_rendered_serves_amqps_with_the_secret_material(node_factory, tmp_path):
    # TLS from inline PEM: the chart's TLS Secret, mounted where its INI says, serves AMQPS; a client
    # that trusts the CA logs in as the default user over TLS.
    import ssl

    from tests.harness import free_port

    cert, key = _self_signed(tmp_path)
    docs = render("standalone-values.yaml", sets=("tls.enabled=true",),
                  set_files=(f"tls.cert={cert}", f"tls.key={key}", f"tls.ca={cert}"))
    amqps, metrics_tls = free_port(), free_port()
    assert ini_of(docs)["http"]["prometheus_tls_port"] == "15691"  # and the Service exposes it:
    service_ports = {p["name"]: p["port"] for p in one(docs, "Service", "mq-shardmq")["spec"]["ports"]}
    assert service_ports["metrics-tls"] == 15691
    pod = PodProcess(docs, node_factory, tmp_path / "pod", "mq-shardmq-0",
                     ini_overrides={("amqp", "tls_port"): str(amqps), ("mqtt", "tls_port"): str(free_port())},
                     extra_args=("--prometheus-tls-port", str(metrics_tls)))  # the harness turns it off
    pod.wait_probes()
    ctx = ssl.create_default_context(cafile=str(cert))
    conn = pika.BlockingConnection(pika.ConnectionParameters(
        host="127.0.0.1", port=amqps, ssl_options=pika.SSLOptions(ctx, "127.0.0.1"),
        credentials=pika.PlainCredentials(pod.user, pod.password), connection_attempts=1))
    conn.channel().queue_declare("over-tls")
    conn.close()
    # Prometheus over HTTPS with the same Secret's certificate (waits for the listener to come up).
    deadline = time.monotonic() + 30
    while True:
        try:
            with urllib.request.urlopen(f"https://127.0.0.1:{metrics_tls}/metrics", context=ctx, timeout=5) as resp:
                assert b"rabbitmq_queues" in resp.read()
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
    assert pod.node.stop() == 0


@pytest.mark.integration
def test_the_cluster_pods_as_rendered_elect_a_leader_and_both_pass_their_probes(node_factory, tmp_path):
    # Two pods of the default (cluster) release as processes, on a real etcd instead of the
    # bundled one: one leads, the other follows, both pass the readiness probe (a follower serves
    # by proxying), and the default user gets in through the follower too.
    from loadtest.etcd import EtcdCluster
    from tests.harness import free_port

    etcd = EtcdCluster(1, tmp_path / "etcd")
    etcd.start()
    try:
        docs = render(sets=("cluster.leaseTtl=2",))
        pods = [PodProcess(docs, node_factory, tmp_path / f"mq-shardmq-{i}", f"mq-shardmq-{i}",
                           ini_overrides={("clustering", "etcd_endpoints"): etcd.endpoints,
                                          ("clustering", "port"): str(free_port())},
                           extra_args=("--advertised-host", "127.0.0.1")) for i in range(2)]
        for pod in pods:
            pod.wait_probes(60)
        leader_checks = [pod.c["readinessProbe"]["httpGet"]["path"].replace("ready", "leader") for pod in pods]
        statuses = []
        for pod, path in zip(pods, leader_checks, strict=True):
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{pod.node.http_port}{path}", timeout=2) as resp:
                    statuses.append(resp.status)
            except urllib.error.HTTPError as exc:
                statuses.append(exc.code)
        assert sorted(statuses) == [200, 503], statuses
        follower = pods[statuses.index(503)]
        conn = follower.login()
        conn.channel().queue_declare("through-the-follower")
        conn.close()
    finally:
        etcd.stop()
