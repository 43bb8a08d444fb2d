"""Within a model's pool, a request goes to the group whose latest load report projects the soonest first
token (the frontend's admission with real scheduler states, fed load reports as the schedulers send them)."""

from __future__ import annotations

import asyncio

import pytest
from link_fixtures import MODEL, ready_link, report_load

from frontend.admission import AdmissionController
from frontend.metrics import FrontendMetrics
from frontend.scheduler_link import SchedulerLink
from frontend.spec import AdmissionSpec
from gpu_runtime.ipc.enums import Priority


@pytest.fixture
def make_link():
    links = []

    def make(groups: int) -> SchedulerLink:
        links.append(ready_link(groups))
        return links[-1]

    yield make
    for link in links:
        link.close()  # its zmq context, which would otherwise block the interpreter's exit


def _admitted_group(link: SchedulerLink) -> str:
    async def admit() -> str:
        controller = AdmissionController(link, AdmissionSpec(), FrontendMetrics(), tenants=[])
        try:
            scheduler = await asyncio.wait_for(controller.admit(MODEL, None, Priority.INTERACTIVE, cost=10), 5)
            return scheduler.address.group
        finally:
            controller.close()

    return asyncio.run(admit())


def _burst(link: SchedulerLink, count: int) -> list[str]:
    """The groups `count` requests go to, one after another before any load report: each stays in flight."""
    groups = []
    for i in range(count):
        groups.append(_admitted_group(link))
        link.schedulers[int(groups[-1])].requests.add(f"r{i}")
    return groups


def test_a_request_goes_to_the_group_projecting_the_soonest_first_token_even_if_it_is_busier(make_link):
    link = make_link(3)
    slow, fast, idle_but_slower = link.schedulers
    report_load(slow, running=1, projected_ttft=2.5)
    report_load(fast, running=6, projected_ttft=0.2)  # more requests, but its queue moves faster
    report_load(idle_but_slower, running=0, projected_ttft=0.4)
    fast.requests.update(f"r{i}" for i in range(6))
    assert _admitted_group(link) == "1"


def test_between_equal_projections_the_group_with_fewer_requests_in_flight_wins(make_link):
    link = make_link(2)
    link.schedulers[0].requests.update({"a", "b"})
    link.schedulers[1].requests.add("c")
    assert _admitted_group(link) == "1"


def test_a_full_group_is_passed_over_whatever_it_projects(make_link):
    link = make_link(2)
    full, other = link.schedulers
    full.requests.update(f"r{i}" for i in range(8))  # max_num_seqs requests in flight: no slot here
    report_load(other, running=3, projected_ttft=1.5)
    assert _admitted_group(link) == "1"


def test_a_burst_between_load_reports_spreads_over_both_groups(make_link):
    """Both idle, one projecting a slightly sooner first token: requests sent since the last report count against
    it, so eight requests arriving before the next report do not all land there."""
    link = make_link(2)
    quicker, other = link.schedulers
    report_load(quicker, running=0, projected_ttft=0.010)
    report_load(other, running=0, projected_ttft=0.012)
    groups = _burst(link, 8)
    assert groups.count("0") == 4 and groups.count("1") == 4


def test_a_burst_spreads_even_when_one_idle_group_projects_no_wait_at_all(make_link):
    """An idle group may report a projected TTFT of 0 s. A first token still takes a step, so the requests sent
    to it since that report count against it too: a burst does not all land on it."""
    link = make_link(2)
    zero, other = link.schedulers
    report_load(zero, running=0, projected_ttft=0.0)
    report_load(other, running=0, projected_ttft=0.012)
    groups = _burst(link, 8)
    assert "1" in groups[:4] and 3 <= groups.count("1") <= 5, groups


def test_a_group_that_has_not_reported_its_load_yet_does_not_take_a_whole_burst(make_link):
    """A worker that just became ready has sent no load report: it projects nothing, and requests sent to it still
    count against it."""
    link = make_link(2)
    unreported, other = link.schedulers
    unreported.load = None
    report_load(other, running=0, projected_ttft=0.0)
    groups = _burst(link, 8)
    assert "1" in groups and "0" in groups, groups
