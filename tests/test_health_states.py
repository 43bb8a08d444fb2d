"""The whole server's health (what load balancers, systemd's readiness and the test harness wait for) says SERVING
only once every worker that should serve takes new requests: a worker that answered ready but that the daemon
has not yet counted serving is passed over by routing, so a server SERVING then would send a P/D request's prompt
to the decode worker, or every request to the one worker up."""

from __future__ import annotations

import pytest
from link_fixtures import ready_link

from frontend.control_messages import WorkerState
from frontend.lifecycle import Lifecycle


@pytest.fixture
def link():
    link = ready_link(2)
    yield link
    link.close()


def test_a_worker_ready_but_not_yet_counted_serving_holds_health_back(link):
    lifecycle = Lifecycle(None, link)
    assert lifecycle.is_serving
    link.schedulers[1].worker_state = WorkerState.STARTING  # the daemon's view: not warm yet
    assert not lifecycle.is_serving
    assert lifecycle.model_is_serving("llama")  # the model itself takes requests, on the other worker


def test_standbys_draining_workers_and_a_rollouts_new_workers_do_not_hold_health_back(link):
    lifecycle = Lifecycle(None, link)
    starting = link.schedulers[1]
    for state, epoch in ((WorkerState.STANDBY, 0), (WorkerState.DRAINING, 0), (WorkerState.STARTING, 1)):
        starting.worker_state, starting.epoch = state, epoch
        assert lifecycle.is_serving, state


def test_an_unresponsive_worker_holds_health_back(link):
    lifecycle = Lifecycle(None, link)
    link.schedulers[0].unresponsive = True
    assert not lifecycle.is_serving
