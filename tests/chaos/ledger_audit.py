"""Audits the usage ledger after the daemon stopped against what the clients saw: every completed request has a
finished row with the client's counts, every request that got a chunk has a row, no row is left running, and no
tenant is billed for another's requests."""

from __future__ import annotations

from collections import Counter, defaultdict

from chaos.clients import COMPLETE, ClientRecord
from chaos.daemon_setup import GRPC_TENANT, HTTP_TENANT, TENANTS
from chaos.report import Report


def audit_ledger(records: list[ClientRecord], rows: list[dict], unreadable: str | None, report: Report) -> None:
    report.notes["ledger_rows"] = dict(Counter(f"{row['tenant']} {row['status']}" for row in rows))
    if unreadable is not None:
        _lose(report, "ledger_missing", "ledger unreadable", unreadable)
        return
    _audit_rows(rows, records, report)
    by_id: dict[tuple[str, str], list[dict]] = defaultdict(list)
    for row in rows:
        by_id[(row["tenant"], row["request_id"])].append(row)
    # gRPC clients set their ids. Over HTTP the gateway may name the request in x-request-id: that is the ledger's
    # id only if the ledger has it; otherwise such requests are matched by their counts, among the other rows.
    exact = [r for r in records if r.surface == "grpc" or (r.tenant, r.request_id) in by_id]
    _audit_by_id(exact, by_id, report)
    claimed = {(r.tenant, r.request_id) for r in exact}
    unclaimed = [row for row in rows if (row["tenant"], row["request_id"]) not in claimed]
    exact_ids = {id(r) for r in exact}
    _audit_by_counts([r for r in records if id(r) not in exact_ids], unclaimed, report)


def _audit_rows(rows: list[dict], records: list[ClientRecord], report: Report) -> None:
    """Rows that are wrong whatever the clients saw: left running, or not the tenant's own requests."""
    issued = {(r.tenant, r.request_id) for r in records if r.request_id}
    http_requests = sum(1 for r in records if r.tenant == HTTP_TENANT)
    for row in rows:
        if row["status"] == "running":
            _lose(report, "ledger_wrong", "left running after the daemon stopped", _row(row))
        if row["tenant"] not in TENANTS:
            _lose(report, "ledger_wrong", "billed to no configured tenant", _row(row))
        elif row["tenant"] == GRPC_TENANT and (row["tenant"], row["request_id"]) not in issued:
            _lose(report, "ledger_wrong", "billed to a tenant that never sent it", _row(row))
    http_rows = sum(1 for row in rows if row["tenant"] == HTTP_TENANT)
    if http_rows > http_requests:
        _lose(
            report, "ledger_wrong", "more rows than requests", f"{HTTP_TENANT}: {http_rows} rows, {http_requests} sent"
        )


def _audit_by_id(records: list[ClientRecord], by_id: dict, report: Report) -> None:
    for record in records:
        rows = by_id.get((record.tenant, record.request_id), [])
        if record.end == COMPLETE:
            if not rows:
                _lose(report, "ledger_missing", "completed, no row", _record(record))
            elif not any(_matches(row, record) for row in rows):
                rows_shown = "; ".join(_row(row) for row in rows)
                _lose(report, "ledger_wrong", "completed, row differs", f"{_record(record)}; rows: {rows_shown}")
        elif record.got_chunk and not rows:
            _lose(report, "ledger_missing", f"got chunks then {record.end}, no row", _record(record))


def _audit_by_counts(records: list[ClientRecord], rows: list[dict], report: Report) -> None:
    """Requests whose id the client never learnt (HTTP): matched per tenant by their counts, and counted."""
    for tenant in sorted({r.tenant for r in records}):
        mine = [r for r in records if r.tenant == tenant]
        tenant_rows = [row for row in rows if row["tenant"] == tenant]
        finished = Counter(
            (row["prompt_tokens"], row["completion_tokens"]) for row in tenant_rows if row["status"] == "finished"
        )
        for record in (r for r in mine if r.end == COMPLETE):
            key = (record.prompt_tokens, record.completion_tokens)
            if finished[key] > 0:
                finished[key] -= 1
                continue
            near = any(p == record.prompt_tokens and n > 0 for (p, _), n in finished.items())
            kind = "ledger_wrong" if near else "ledger_missing"
            _lose(report, kind, "completed, no finished row with its counts", _record(record))
        with_chunks = sum(1 for r in mine if r.got_chunk)
        if len(tenant_rows) < with_chunks:
            detail = f"{tenant}: {len(tenant_rows)} rows, {with_chunks} requests got chunks"
            _lose(report, "ledger_missing", "fewer rows than requests that got chunks", detail)


def _lose(report: Report, kind: str, label: str, detail: str) -> None:
    report.lose(kind, "ledger", label, detail, signature=f"ledger: {label}")


def _matches(row: dict, record: ClientRecord) -> bool:
    return (
        row["status"] == "finished"
        and row["prompt_tokens"] == record.prompt_tokens
        and row["completion_tokens"] == record.completion_tokens
    )


def _record(record: ClientRecord) -> str:
    return (
        f"{record.surface} tenant={record.tenant} request_id={record.request_id} end={record.end} "
        f"finish={record.finish_reason} prompt/completion={record.prompt_tokens}/{record.completion_tokens}"
    )


def _row(row: dict) -> str:
    keys = ("tenant", "request_id", "status", "prompt_tokens", "completion_tokens")
    return " ".join(f"{key}={row.get(key)}" for key in keys)
