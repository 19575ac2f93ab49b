"""/openapi.json: built from the server's own route table, so it lists exactly what is served. Every
route it names answers (no 404 / 405), every endpoint of docs/server.md's table is in it and it names
none that the table lacks."""
from __future__ import annotations

import re
from pathlib import Path

import httpx

from sparrow_server import API_KEY

REPO = Path(__file__).resolve().parents[2]
HEADERS = {"Authorization": f"Bearer {API_KEY}"}


def documented_endpoints() -> set[tuple[str, str]]:
    """(method, path) of each row of docs/server.md's Endpoints table: "| `GET /ping`, `POST /ping` | ..."."""
    text = (REPO / "docs" / "server.md").read_text()
    table = text.split("## Endpoints", 1)[1].split("\n\n", 2)[1]
    out = set()
    for row in table.splitlines()[2:]:
        first_cell = row.split("|")[1]
        out |= set(re.findall(r"`(GET|POST) (/[^`\s]*)`", first_cell))
    return out


def test_openapi_lists_exactly_what_is_served(server):
    response = httpx.get(server.url + "/openapi.json")  # open, as in vLLM: no API key
    assert response.status_code == 200 and response.headers["content-type"] == "application/json"
    document = response.json()
    assert document["openapi"].startswith("3.1") and document["info"]["title"] == "sparrow"
    listed = {(method.upper(), path) for path, methods in document["paths"].items() for method in methods}
    assert listed == documented_endpoints()
    for path, methods in document["paths"].items():
        for method, operation in methods.items():
            assert operation["summary"] and "\n" not in operation["summary"], (method, path)
            assert "200" in operation["responses"]
            if method == "post" and path != "/ping":
                schema = operation["requestBody"]["content"]["application/json"]["schema"]
                assert schema == {"type": "object"}
            else:
                assert "requestBody" not in operation, (method, path)
            # Served: an empty JSON object is a 400 for the POST routes that read one, never 404 or 405.
            answer = httpx.request(method.upper(), server.url + path, headers=HEADERS, timeout=30,
                                   json={} if method == "post" else None)
            assert answer.status_code in ((200, 400) if method == "post" else (200,)), (method, path, answer.text)


def test_a_path_it_does_not_list_is_not_served(server):
    document = httpx.get(server.url + "/openapi.json").json()
    assert "/docs" not in document["paths"]
    assert httpx.get(server.url + "/docs").status_code == 404
    assert httpx.post(server.url + "/openapi.json").status_code == 405
