"""The batch API's HTTP front on a real queue (SQLite, then PostgreSQL), without workers or a server."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from tools.batch.api import create_app, results_page_json
from tools.batch.policy import BatchLimits, BatchStatus, ItemCounts
from tools.batch.store_base import BatchView, ItemResult


@pytest.fixture
def client(db):
    with TestClient(create_app(db, BatchLimits(max_items_per_batch=50))) as test_client:
        yield test_client


def test_a_submitted_batch_is_queued_with_every_item_pending_in_order(client):
    created = client.post("/v1/batches", json={"model": "embed", "items": ["a", "b", "c"]})
    assert created.status_code == 201
    batch = created.json()
    assert batch["status"] == "queued" and batch["counts"]["total"] == 3 and batch["progress"] == 0.0
    page = client.get(f"/v1/batches/{batch['id']}/results", params={"offset": 1, "limit": 1}).json()
    assert page["results"] == [{"index": 1, "status": "pending", "result": None, "error": None, "attempts": 0}]
    assert page["next_offset"] == 2 and page["total"] == 3


def test_the_idempotency_key_from_header_or_body_names_one_batch(client):
    first = client.post("/v1/batches", json={"model": "embed", "items": ["a"], "idempotency_key": "k1"})
    again = client.post("/v1/batches", json={"model": "embed", "items": ["a"]}, headers={"Idempotency-Key": "k1"})
    assert (first.status_code, again.status_code) == (201, 200) and first.json()["id"] == again.json()["id"]
    conflict = client.post("/v1/batches", json={"model": "embed", "items": ["b"], "idempotency_key": "k1"})
    assert conflict.status_code == 409 and conflict.json()["batch_id"] == first.json()["id"]
    differing = client.post("/v1/batches", json={"model": "embed", "items": ["a"], "idempotency_key": "k2"},
                            headers={"Idempotency-Key": "k3"})
    assert differing.status_code == 422 and "differ" in differing.json()["error"]


@pytest.mark.parametrize(("body", "status", "field"), [
    (b"{", 400, None),
    (b'{"model": "embed", "items": []}', 422, "items"),
    (b'{"model": "embed", "items": ["a", {"prompt": "x"}]}', 422, "items[1]"),
    (b'{"model": "llm", "items": [{"prompt": ""}]}', 422, "items[0].prompt"),
    (b'{"model": "embed", "items": ["a"], "version": 0}', 422, "version"),
    (json.dumps({"model": "embed", "items": ["a"] * 51}).encode(), 413, "items"),
])
def test_bad_submissions_are_refused_naming_the_field(client, body, status, field):
    response = client.post("/v1/batches", content=body)
    assert response.status_code == status, response.text
    assert response.json()["error"]
    assert response.json().get("field") == field


def test_cancel_ends_queued_items_and_unknown_batches_are_404(client):
    batch_id = client.post("/v1/batches", json={"model": "embed", "items": ["a", "b"]}).json()["id"]
    cancelled = client.post(f"/v1/batches/{batch_id}/cancel").json()
    assert cancelled["status"] == "cancelled" and cancelled["counts"]["cancelled"] == 2
    for path in ("/v1/batches/nope", "/v1/batches/nope/results"):
        assert client.get(path).status_code == 404
    assert client.post("/v1/batches/nope/cancel").status_code == 404
    assert client.get("/v1/batches/nope/results", params={"limit": 0}).status_code == 422


def test_the_openapi_spec_documents_the_submission_body(client):
    spec = client.get("/openapi.json").json()
    body = spec["paths"]["/v1/batches"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body["required"] == ["model", "items"]


def test_a_results_page_splices_the_stored_results_into_valid_json():
    view = BatchView(batch_id="b1", model="embed", version=None, idempotency_key=None, created_at_s=0.0,
                     cancelled_at_s=None, finished_at_s=None, status=BatchStatus.RUNNING,
                     counts=ItemCounts(num_queued=1, num_ok=2, num_failed=1, num_leased=1))
    page = [ItemResult(3, "ok", json.dumps({"embedding": [0.5, -1e-7]}), None, 1),
            ItemResult(4, "ok", json.dumps({"text": "naïve \"quoted\" ✓"}, ensure_ascii=False), None, 2),
            ItemResult(5, "failed", None, 'invalid: bad "item" — ünïcode', 1),
            ItemResult(6, "pending", None, None, 0)]
    assert json.loads(results_page_json(view, 3, page)) == {
        "id": "b1", "status": "running", "offset": 3, "total": 5, "next_offset": None,
        "results": [{"index": 3, "status": "ok", "result": {"embedding": [0.5, -1e-7]}, "error": None, "attempts": 1},
                    {"index": 4, "status": "ok", "result": {"text": "naïve \"quoted\" ✓"}, "error": None,
                     "attempts": 2},
                    {"index": 5, "status": "failed", "result": None, "error": 'invalid: bad "item" — ünïcode',
                     "attempts": 1},
                    {"index": 6, "status": "pending", "result": None, "error": None, "attempts": 0}]}
    assert json.loads(results_page_json(view, 0, page[:1]))["next_offset"] == 1
    assert json.loads(results_page_json(view, 0, []))["results"] == []
