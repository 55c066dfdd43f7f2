"""A stand-in Kubernetes API server for `helm template --dry-run=server`: just enough discovery for
the chart's kinds and GETs that answer from a dict of existing objects (404 otherwise).

It exists to test the chart's `lookup` (a generated secret kept across upgrades) without a
cluster: helm does the lookups, the ownership checks and the rendering for real; only the API
server's answers are canned. It serves loopback only and stops with the test.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

# group/version -> [(plural, Kind)] of every kind the chart renders (core is "v1").
RESOURCES = {
    "v1": [("secrets", "Secret"), ("services", "Service"), ("configmaps", "ConfigMap"),
           ("serviceaccounts", "ServiceAccount")],
    "apps/v1": [("statefulsets", "StatefulSet")],
    "policy/v1": [("poddisruptionbudgets", "PodDisruptionBudget")],
}


class KubeApiStub:
    def __init__(self) -> None:
        # "/api/v1/namespaces/NS/secrets/NAME" -> object
        self.objects: dict[str, dict] = {}
        self.requests: list[str] = []
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                stub.requests.append(self.path)
                status, body = stub.answer(self.path.split("?", 1)[0])
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *_args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def add(self, obj: dict) -> None:
        group_version = obj["apiVersion"]
        plural = next(p for p, k in RESOURCES[group_version] if k == obj["kind"])
        prefix = "/api/v1" if group_version == "v1" else f"/apis/{group_version}"
        self.objects[f"{prefix}/namespaces/{obj['metadata']['namespace']}/{plural}/{obj['metadata']['name']}"] = obj

    def answer(self, path: str) -> tuple[int, dict]:
        if path == "/version":
            return 200, {"major": "1", "minor": "33", "gitVersion": "v1.33.0", "platform": "linux/amd64"}
        if path == "/api":
            return 200, {"kind": "APIVersions", "versions": ["v1"], "serverAddressByClientCIDRs": []}
        if path == "/apis":
            groups = [gv.split("/")[0] for gv in RESOURCES if "/" in gv]
            return 200, {"kind": "APIGroupList", "apiVersion": "v1", "groups": [
                {"name": g, "versions": [{"groupVersion": f"{g}/v1", "version": "v1"}],
                 "preferredVersion": {"groupVersion": f"{g}/v1", "version": "v1"}} for g in groups]}
        for group_version, kinds in RESOURCES.items():
            prefix = "/api/v1" if group_version == "v1" else f"/apis/{group_version}"
            if path == prefix:
                return 200, {"kind": "APIResourceList", "groupVersion": group_version, "resources": [
                    {"name": plural, "singularName": kind.lower(), "namespaced": True, "kind": kind,
                     "verbs": ["get", "list"]} for plural, kind in kinds]}
        if path in self.objects:
            return 200, self.objects[path]
        return 404, {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "NotFound", "code": 404}

    def kubeconfig(self, path: Path, namespace: str) -> Path:
        path.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "stub",
            "clusters": [{"name": "stub", "cluster": {"server": self.url}}],
            "users": [{"name": "stub", "user": {"token": "stub"}}],
            "contexts": [{"name": "stub", "context": {"cluster": "stub", "user": "stub", "namespace": namespace}}],
        }))
        return path

    def __enter__(self) -> KubeApiStub:
        self.thread.start()
        return self

    def __exit__(self, *_exc) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5)
