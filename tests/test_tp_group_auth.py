"""A tensor-parallel group's proof of membership, over real gloo process groups in this process (one thread per
rank): ranks that hold the group's secret start, a rank that does not makes every rank refuse, naming it; and
each command on the step channel is taken only with rank 0's MAC, in sequence."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from gpu_runtime.ipc.peer_auth import PeerAuth
from gpu_runtime.tp.group_auth import GroupRefused, prove_group, wrong_answers
from gpu_runtime.tp.step_channel import ForgedCommand, StepChannel, Stop

pytestmark = pytest.mark.fast

SECRET, OTHER = b"s" * 32, b"o" * 32


def _prove_in_threads(tmp_path, secrets: list[bytes]) -> dict[int, BaseException | None]:
    """Each rank, a thread with its own gloo process group (a FileStore in tmp_path), runs the challenge."""
    world_size, outcomes = len(secrets), {}

    def rank_main(rank: int) -> None:
        try:
            store = dist.FileStore(str(tmp_path / "rendezvous"), world_size)
            group = dist.ProcessGroupGloo(store, rank, world_size, timedelta(seconds=60))
            prove_group(group, rank, world_size, PeerAuth(secrets[rank]), torch.device("cpu"))
            outcomes[rank] = None
        except BaseException as error:  # the test reads each rank's outcome
            outcomes[rank] = error

    threads = [threading.Thread(target=rank_main, args=(rank,)) for rank in range(world_size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert len(outcomes) == world_size, "a rank hung in the challenge"
    return outcomes


def test_ranks_holding_the_groups_secret_start(tmp_path):
    assert _prove_in_threads(tmp_path, [SECRET] * 3) == {0: None, 1: None, 2: None}


def test_a_rank_without_the_secret_makes_every_rank_refuse_to_start_naming_it(tmp_path):
    outcomes = _prove_in_threads(tmp_path, [SECRET, OTHER, SECRET])
    for rank in (0, 2):  # the honest ranks refuse; rank 0's refusal is what stops the group (RankGroup raises)
        assert isinstance(outcomes[rank], GroupRefused)
        assert "tensor-parallel rank 1 of 3 could not prove it holds the group's secret" in str(outcomes[rank])


def test_an_answer_replayed_from_another_challenge_or_rank_is_wrong():
    auth = PeerAuth(SECRET)
    transcript = b"n" * 64
    good = [auth.tp_answer(transcript, rank, 2) for rank in range(2)]
    assert wrong_answers(auth, transcript, good) == []
    assert wrong_answers(auth, transcript, [good[0], good[0]]) == [1]  # rank 0's answer is not rank 1's
    assert wrong_answers(auth, b"m" * 64, good) == [0, 1]  # nor an earlier group's


def test_the_step_channel_takes_only_rank_0s_commands_in_order():
    sender, receiver = StepChannel(PeerAuth(SECRET)), StepChannel(PeerAuth(SECRET))
    first, second = sender.seal(Stop("one")), sender.seal(Stop("two"))
    assert receiver.open(first) == Stop("one")
    with pytest.raises(ForgedCommand, match="command 1: its MAC is not rank 0's"):
        receiver.open(first)  # replayed
    tampered = second.replace(b"two", b"owt")
    with pytest.raises(ForgedCommand):
        receiver.open(tampered)
    assert receiver.open(second) == Stop("two")
    with pytest.raises(ForgedCommand):
        StepChannel(PeerAuth(OTHER)).open(StepChannel(PeerAuth(OTHER)).seal(Stop("x"))[:-1] + b"\0")
    with pytest.raises(ForgedCommand):  # sealed with another secret
        StepChannel(PeerAuth(SECRET)).open(StepChannel(PeerAuth(OTHER)).seal(Stop("x")))
    with pytest.raises(ForgedCommand):
        StepChannel(PeerAuth(SECRET)).open(b"short")
