"""Audits how the load's streams ended: a cut, hung, 5xx or internal-error stream is a loss; a refusal or an error
status the client was told about is not, and neither is a connection broken by killing the gateway itself."""

from __future__ import annotations

from chaos.clients import BAD, BROKEN, CUT, FIVE_XX, HUNG, INTERNAL, ClientRecord
from chaos.faults import Fault
from chaos.report import Report

_LOSSES = {CUT: "cut_streams", HUNG: "hung", FIVE_XX: "five_xx", INTERNAL: "grpc_internal", BAD: "bad_answers"}
_SLACK_S = 1.0  # clock slack around a kill when matching it to a broken connection


def audit_streams(records: list[ClientRecord], faults: list[Fault], report: Report, surface_prefix: str) -> None:
    gateway_kills = [f.at for f in faults if f.kind == "kill" and f.process == "gateway"]
    for record in records:
        surface = f"{surface_prefix}_{record.surface}"
        label = record.end
        loss = _LOSSES.get(record.end)
        if record.end == BROKEN:
            if any(record.started - _SLACK_S <= at <= record.ended + _SLACK_S for at in gateway_kills):
                label = "broken by a gateway kill"
            else:
                loss = "cut_streams"  # the connection died, but not because its own process was killed
        report.count(surface, label)
        if loss is not None:
            during = [f"{f.kind} {f.process}" for f in faults if record.started - _SLACK_S <= f.at <= record.ended]
            shown = f"request_id={record.request_id} tenant={record.tenant} faults during it: {during or 'none'}"
            report.lose(loss, surface, label, record.detail, shown)
