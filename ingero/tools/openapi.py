"""The OpenAPI 3.1 document of the tools API, generated from the registry (one path per tool)."""

from __future__ import annotations

import copy
from typing import Any

from ingero import API_VERSION, __version__
from ingero.tools import toolset
from ingero.tools.failures import STATUS_OF_KIND

# The tools API's paths (ingero.tools.http serves them; this document describes them).
VERSIONS_PATH = "/api/versions"
TOOLS_PREFIX = "/api/v1/tools/"
OPENAPI_PATH = "/api/v1/openapi.json"

_FAILURE = {
    "type": "object",
    "required": ["ok", "status", "kind", "error"],
    "properties": {
        "ok": {"const": False},
        "status": {"type": "integer"},
        "kind": {"type": "string", "enum": sorted(STATUS_OF_KIND)},
        "error": {"type": "string", "description": "one line a human can act on"},
    },
}
_ANSWER = {"type": "object", "description": "the tool's answer (compact JSON, the same text MCP returns)"}


def _json(schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _failures(*statuses: int) -> dict[str, Any]:
    ref = {"$ref": "#/components/schemas/Failure"}
    names = {s: k for k, s in STATUS_OF_KIND.items()}
    return {str(s): _json(ref, names.get(s, "failure")) for s in statuses}


def _inline_defs(schema: dict[str, Any], defs: dict[str, Any], prefix: str) -> dict[str, Any]:
    """Move a pydantic schema's ``$defs`` into components (OpenAPI resolves refs from the root)."""
    schema = copy.deepcopy(schema)
    local = schema.pop("$defs", {})

    def fix(node: Any) -> Any:
        if isinstance(node, dict):
            if isinstance(node.get("$ref"), str) and node["$ref"].startswith("#/$defs/"):
                node["$ref"] = f"#/components/schemas/{prefix}{node['$ref'][len('#/$defs/') :]}"
            return {k: fix(v) for k, v in node.items()}
        if isinstance(node, list):
            return [fix(v) for v in node]
        return node

    for name, sub in local.items():
        defs[f"{prefix}{name}"] = fix(sub)
    result: dict[str, Any] = fix(schema)
    return result


def openapi_document(title: str = "ingero tools API") -> dict[str, Any]:
    schemas: dict[str, Any] = {"Failure": _FAILURE}
    paths: dict[str, Any] = {
        VERSIONS_PATH: {
            "get": {
                "operationId": "versions",
                "summary": "API versions and capabilities (no authentication)",
                "security": [],
                "responses": {"200": _json({"type": "object"}, "versions")},
            }
        },
        TOOLS_PREFIX + "list": {
            "get": {
                "operationId": "list_tools",
                "summary": "Every tool with its input schema",
                "responses": {"200": _json({"type": "object"}, "the tools"), **_failures(401, 429)},
            }
        },
        OPENAPI_PATH: {
            "get": {
                "operationId": "openapi",
                "summary": "This document",
                "responses": {"200": _json({"type": "object"}, "OpenAPI 3.1"), **_failures(401, 429)},
            }
        },
    }
    for t in toolset.tools().values():
        args = _inline_defs(t.input_schema, schemas, f"{t.name}.")
        paths[TOOLS_PREFIX + t.name] = {
            "post": {
                "operationId": t.name,
                "summary": t.title,
                "description": t.description,
                "tags": [t.scope],
                "requestBody": {"required": False, "content": {"application/json": {"schema": args}}},
                "responses": {
                    "200": _json(_ANSWER, "the answer"),
                    **_failures(400, 401, 403, 404, 408, 413, 429, 500, 503),
                },
            }
        }
    return {
        "openapi": "3.1.0",
        "info": {"title": title, "version": f"{API_VERSION} (ingero {__version__})"},
        "paths": paths,
        "components": {
            "schemas": schemas,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
        "security": [{"bearer": []}],
    }
