"""The membership file a run's remote hosts join and leave through
(``system.placement.hosts_file``): a run writes it and marks it ended, hosts append and
remove their own lines, and a join to a file no running run watches is refused by name."""

from __future__ import annotations

import threading

import pytest

from a3po_jax.inference.remote import membership_file as mf


def test_a_run_writes_it_hosts_join_and_leave_and_the_end_refuses_joins(tmp_path):
    path = tmp_path / "hosts"
    with pytest.raises(mf.MembershipError, match="no membership file there"):
        mf.join(path, "b:2")  # no run has started
    mf.start_run(path, ["a:1"])
    assert path.read_text() == "a:1\n"
    mf.join(path, "b:2")
    mf.join(path, "b:2")  # joining twice lists it once
    assert mf.read_hosts_file(path) == ["a:1", "b:2"]
    assert mf.leave(path, "a:1") and not mf.leave(path, "a:1")
    assert mf.read_hosts_file(path) == ["b:2"]
    with pytest.raises(mf.MembershipError, match="'b2' is not host:port"):
        mf.join(path, "b2")

    mf.end_run(path)
    mf.end_run(path)  # once
    assert path.read_text().count(mf.ENDED_LINE) == 1
    assert mf.read_hosts_file(path) == ["b:2"]  # the mark is a comment to the pool
    with pytest.raises(mf.MembershipError, match="the run that watched this file has ended"):
        mf.join(path, "c:3")
    assert mf.leave(path, "b:2")  # leaving an ended run is harmless

    path.write_text("b:2\n" + mf.ENDED_LINE + "\n")
    mf.start_run(path, ["b:2"])  # the run resumed: it watches the file again
    assert not mf.has_ended(path)
    mf.join(path, "c:3")
    assert mf.read_hosts_file(path) == ["b:2", "c:3"]


def test_the_start_refuses_a_file_that_lists_other_hosts(tmp_path):
    path = tmp_path / "hosts"
    path.write_text("a:1\n")
    with pytest.raises(ValueError, match=r"lists \['a:1'\], but the run starts with .*a:1,b:2"):
        mf.start_run(path, ["a:1", "b:2"])
    path.write_text("a:1\nnot-an-address\n")
    with pytest.raises(ValueError, match="line 2: 'not-an-address' is not host:port"):
        mf.start_run(path, ["a:1"])


def test_hosts_joining_and_leaving_at_once_lose_no_line(tmp_path):
    """The lock file makes every writer's read-modify-write whole."""
    path = tmp_path / "hosts"
    mf.start_run(path, ["a:1"])
    joiners = [f"h:{port}" for port in range(2, 34)]
    barrier = threading.Barrier(len(joiners) + 1)

    def join(address):
        barrier.wait()
        mf.join(path, address)

    def leave():
        barrier.wait()
        mf.leave(path, "a:1")

    threads = [threading.Thread(target=join, args=(a,)) for a in joiners]
    threads.append(threading.Thread(target=leave))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(mf.read_hosts_file(path)) == sorted(joiners)
