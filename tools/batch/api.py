"""The REST front of the batch-inference API (FastAPI, served by uvicorn).

    POST /v1/batches                  submit items: {"model", "items", "version"?, "idempotency_key"?}
    GET  /v1/batches/{id}             status and progress
    GET  /v1/batches/{id}/results     per-item results in input order (?offset=&limit=)
    POST /v1/batches/{id}/cancel      stop dispatching; items already sent may still finish
    GET  /healthz                     the store answers
    GET  /openapi.json, /docs         the OpenAPI spec

Every state change is one transaction in the store (SQLite or PostgreSQL), so the process can be killed
at any moment: a batch is either wholly accepted (and its id returned after the commit) or
not at all, and a client that never saw the answer re-submits with the same idempotency key
(`Idempotency-Key` header or body field) and gets the same batch. The body is parsed here,
not by FastAPI's model binding, so that malformed JSON and each bad field get our own 4xx
with a message naming the field rather than a generic validation dump.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from fastapi import FastAPI, Query, Request
from fastapi.responses import JSONResponse, Response

from tools.batch.engines import open_store
from tools.batch.policy import BatchLimits, SubmissionError, validate_submission
from tools.batch.store_base import (
    MAX_RESULTS_PAGE,
    BatchNotFound,
    BatchQueue,
    BatchView,
    IdempotencyConflict,
    ItemResult,
)

SUBMISSION_SCHEMA = {
    "type": "object",
    "required": ["model", "items"],
    "properties": {
        "model": {"type": "string", "description": "a model the service serves, e.g. embed or llm"},
        "version": {"type": "integer", "minimum": 1, "description": "model version; default: the served split"},
        "idempotency_key": {"type": "string", "maxLength": 200,
                            "description": "re-submitting with the same key returns the same batch"},
        "items": {"type": "array", "minItems": 1, "description": "embed: strings; llm: {prompt, max_tokens?}",
                  "items": {"oneOf": [{"type": "string"}, {"type": "object", "required": ["prompt"],
                                      "properties": {"prompt": {"type": "string"},
                                                     "max_tokens": {"type": "integer", "minimum": 1}}}]}},
    },
}


def error(status: int, message: str, **extra: object) -> JSONResponse:
    return JSONResponse({"error": message, **extra}, status_code=status)


def batch_json(view: BatchView) -> dict:
    counts = view.counts
    return {
        "id": view.batch_id,
        "model": view.model,
        "version": view.version,
        "status": str(view.status),
        "idempotency_key": view.idempotency_key,
        "created_at": view.created_at_s,
        "cancelled_at": view.cancelled_at_s,
        "finished_at": view.finished_at_s,
        "counts": {"total": counts.num_items, "queued": counts.num_queued, "running": counts.num_leased,
                   "ok": counts.num_ok, "failed": counts.num_failed, "cancelled": counts.num_cancelled},
        "progress": round(view.fraction_done, 6),
    }


def results_page_json(view: BatchView, offset: int, page: Sequence[ItemResult]) -> str:
    """The results page as JSON text: the stored results are spliced in as they are, since
    decoding and re-encoding a page of embeddings costs far more CPU than serving it."""
    end = offset + len(page)
    head = json.dumps({"id": view.batch_id, "status": str(view.status), "offset": offset,
                       "total": view.counts.num_items,
                       "next_offset": end if end < view.counts.num_items else None}, ensure_ascii=False)
    items = ",".join(
        f'{{"index":{r.index},"status":{json.dumps(r.status)},"result":{r.result_json or "null"},'
        f'"error":{json.dumps(r.error, ensure_ascii=False)},"attempts":{r.attempts}}}' for r in page)
    return f'{head[:-1]},"results":[{items}]}}'


def create_app(db: str | Path, limits: BatchLimits | None = None, clock: Callable[[], float] = time.time) -> FastAPI:
    """The API on the queue `db` names: a SQLite file or a postgresql:// URL (`engines.open_store`)."""
    limits = limits or BatchLimits()
    # One connection, opened and used on the event loop's thread only: a store call takes about a
    # millisecond, a single writer per process is what SQLite is best at, and PostgreSQL gets one
    # connection per API process rather than a pool to size.
    opened: dict[str, BatchQueue] = {}

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI):
        opened["store"] = open_store(db)
        try:
            yield
        finally:
            opened.pop("store").close()

    def store() -> BatchQueue:
        return opened["store"]

    app = FastAPI(title="triton-slo-kit batch inference API", version="1.0", lifespan=lifespan,
                  description="Submit many items at once; every item gets exactly one result, in input order.")
    max_body_bytes = limits.max_batch_bytes + 64 * 1024  # the items plus the envelope

    @app.post("/v1/batches", status_code=201, openapi_extra={
        "requestBody": {"required": True, "content": {"application/json": {"schema": SUBMISSION_SCHEMA}}}},
        responses={200: {"description": "the batch this idempotency key already made"},
                   201: {"description": "created"}, 400: {"description": "malformed JSON"},
                   409: {"description": "idempotency key used with another body"},
                   413: {"description": "body too large"}, 422: {"description": "a field is not valid"}})
    async def submit(request: Request):
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > max_body_bytes:
            return error(413, f"body of {int(length)} bytes is over the {max_body_bytes} allowed")
        body = await request.body()
        if len(body) > max_body_bytes:
            return error(413, f"body of {len(body)} bytes is over the {max_body_bytes} allowed")
        try:
            raw = json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            return error(400, f"malformed JSON: {err}")
        header_key = request.headers.get("idempotency-key")
        if header_key is not None and isinstance(raw, dict):
            if raw.get("idempotency_key") not in (None, header_key):
                return error(422, "the Idempotency-Key header and the body's idempotency_key differ",
                             field="idempotency_key")
            raw = {**raw, "idempotency_key": header_key}
        try:
            submission = validate_submission(raw, limits)
        except SubmissionError as err:
            status = 413 if "more than the" in str(err) else 422  # too many items, or too many bytes
            return error(status, str(err), field=err.field)
        try:
            batch_id, created = store().submit(submission, clock())
        except IdempotencyConflict as err:
            return error(409, str(err), batch_id=err.batch_id)
        return JSONResponse(batch_json(store().get_batch(batch_id)), status_code=201 if created else 200)

    @app.get("/v1/batches/{batch_id}")
    async def get_batch(batch_id: str):
        try:
            return batch_json(store().get_batch(batch_id))
        except BatchNotFound:
            return error(404, f"no batch {batch_id!r}")

    @app.get("/v1/batches/{batch_id}/results")
    async def results(batch_id: str, offset: int = Query(0, ge=0),
                      limit: int = Query(1000, ge=1, le=MAX_RESULTS_PAGE)):
        try:
            view = store().get_batch(batch_id)
            page = store().results(batch_id, offset, limit)
        except BatchNotFound:
            return error(404, f"no batch {batch_id!r}")
        return Response(results_page_json(view, offset, page), media_type="application/json")

    @app.post("/v1/batches/{batch_id}/cancel")
    async def cancel(batch_id: str):
        try:
            store().cancel(batch_id, clock())
            return batch_json(store().get_batch(batch_id))
        except BatchNotFound:
            return error(404, f"no batch {batch_id!r}")

    @app.get("/healthz")
    async def healthz():
        with contextlib.suppress(BatchNotFound):
            store().get_batch("")  # one query against the store: it answers, or this raises (500)
        return {"status": "ok"}

    return app
