"""The manifests under deploy/, read as Kubernetes would, and the vendored RayService schema.

A CRD's schema leaves unknown fields to the API server, which refuses them (kubectl's default
``--validate=strict``) instead of failing the schema; ``strict`` adds that refusal, so a misspelled
key fails here as it would on apply. CEL rules (``x-kubernetes-validations``) are not checked: the
CRD has three, all on fields these manifests leave unset.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema
import yaml

DEPLOY_DIR = Path(__file__).resolve().parents[2] / "deploy"
SCHEMA_PATH = DEPLOY_DIR / "schemas" / "ray.io_rayservices.v1.json.gz"
RAYSERVICE_API = ("ray.io/v1", "RayService")
SERVICE_API = ("v1", "Service")
POOL_GROUPS = ("prefill", "decode")
GPU = "nvidia.com/gpu"  # the NVIDIA device plugin's resource name


@dataclass(frozen=True)
class Document:
    path: Path
    index: int  # its place among the file's YAML documents
    body: dict[str, Any]

    @property
    def name(self) -> str:
        return f"{self.path.relative_to(DEPLOY_DIR)}#{self.index}"


def documents() -> list[Document]:
    """Every non-empty YAML document of every manifest under deploy/ (anchors expanded)."""
    found = []
    for path in sorted(DEPLOY_DIR.rglob("*.yaml")) + sorted(DEPLOY_DIR.rglob("*.yml")):
        for index, body in enumerate(yaml.safe_load_all(path.read_text())):
            if body is not None:
                found.append(Document(path, index, body))
    return found


def rayservice() -> dict[str, Any]:
    (doc,) = [d.body for d in documents() if (d.body.get("apiVersion"), d.body.get("kind")) == RAYSERVICE_API]
    return doc


def services() -> list[dict[str, Any]]:
    return [d.body for d in documents() if (d.body.get("apiVersion"), d.body.get("kind")) == SERVICE_API]


def strict(schema: Any) -> Any:
    """``schema`` with unknown fields refused wherever it names the fields an object may have."""
    if isinstance(schema, list):
        return [strict(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    # "properties" maps field names to schemas: its keys are names, not keywords.
    out = {key: value if key == "properties" else strict(value) for key, value in schema.items()}
    if "properties" in schema:
        out["properties"] = {name: strict(sub) for name, sub in schema["properties"].items()}
        if "additionalProperties" not in schema and not schema.get("x-kubernetes-preserve-unknown-fields"):
            out["additionalProperties"] = False
    return out


def crd_schema() -> dict[str, Any]:
    return json.loads(gzip.decompress(SCHEMA_PATH.read_bytes()))


def validator(kind: tuple[str, str]) -> jsonschema.Draft4Validator:
    """The validator of a document of ``kind``: the CRD's schema, or for a core Service the copy
    the CRD embeds as ``spec.serveService``. Draft 4: what OpenAPI 3.0's schema objects extend.
    Formats (int32, int64, date-time) are not checked, as jsonschema does not by default."""
    schema = crd_schema()
    if kind == SERVICE_API:
        schema = schema["properties"]["spec"]["properties"]["serveService"]
    elif kind != RAYSERVICE_API:
        raise ValueError(f"no schema for {kind}: add one, or keep the manifest out of deploy/")
    return jsonschema.Draft4Validator(strict(schema))


def schema_errors(body: dict[str, Any]) -> list[str]:
    """What the schema refuses in ``body``, one line each ("spec.x.y: message")."""
    kind = (body.get("apiVersion"), body.get("kind"))
    errors = []
    if not (body.get("metadata") or {}).get("name"):  # both schemas leave metadata open
        errors.append("metadata.name: required")
    for error in validator(kind).iter_errors(body):  # type: ignore[arg-type]
        where = ".".join(str(part) for part in error.absolute_path) or "(top)"
        errors.append(f"{where}: {error.message}")
    return sorted(errors)


def groups(service: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Group name -> group spec; the head group is "head"."""
    cluster = service["spec"]["rayClusterConfig"]
    found = {"head": cluster["headGroupSpec"]}
    for group in cluster.get("workerGroupSpecs") or []:
        assert group["groupName"] not in found, f"group {group['groupName']} is named twice"
        found[group["groupName"]] = group
    return found


def ray_container(group: dict[str, Any]) -> dict[str, Any]:
    return group["template"]["spec"]["containers"][0]  # KubeRay runs Ray in the first container


def containers() -> Iterator[tuple[str, dict[str, Any]]]:
    for name, group in groups(rayservice()).items():
        for container in group["template"]["spec"]["containers"]:
            yield name, container


def offered_resources(group: dict[str, Any]) -> dict[str, float]:
    """The Ray custom resources a group's pods offer, read as KubeRay reads rayStartParams
    (its quotes trimmed, then JSON) or its ``resources`` field."""
    text = (group.get("rayStartParams") or {}).get("resources")
    offered = json.loads(text.strip("'\"` ")) if text else {}
    offered.update({name: float(amount) for name, amount in (group.get("resources") or {}).items()})
    return offered


def port_number(container: dict[str, Any], port: int | str) -> int:
    """A probe's or a Service's port: a number, or the name of one of the container's ports."""
    if isinstance(port, int):
        return port
    (number,) = [p["containerPort"] for p in container.get("ports") or [] if p.get("name") == port]
    return number


def serve_config(service: dict[str, Any]) -> dict[str, Any]:
    return yaml.safe_load(service["spec"]["serveConfigV2"])


def pdserve_app(service: dict[str, Any]) -> dict[str, Any]:
    (app,) = serve_config(service)["applications"]
    return app
