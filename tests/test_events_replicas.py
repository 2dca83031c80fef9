"""Three bots on one ``SharedFileEventJournal`` (issue 15; EVENTS-4, REPL-1..4): real
child processes (:class:`botmesh_testkit.kill.Replicas`), one frozen with SIGSTOP past its
lease while its handler runs, one SIGKILLed in the middle of its work; the third finishes
everything. Judged by the kill loops' judge: every message handled, every send delivered
exactly once or accounted for as ambiguous (OUT-14), the frozen bot's completion refused
by its stale fencing token (LEASE-2)."""

from __future__ import annotations

from typing import Any

import psutil
import pytest
from botmesh_testkit import kill
from botmesh_testkit.kill import Replicas

spec = pytest.mark.spec


def slow_on_a() -> Any:
    async def handler(ctx: Any) -> None:
        if ctx.text == "slow" and kill.child().name == "a":
            kill.hold(1.0)  # replica a blocks here; the parent freezes it at this marker
        await ctx.reply(f"done {ctx.text}")

    return handler


@spec("EVENTS-4", "REPL-1", "REPL-3", "REPL-4", "LEASE-2", "OUT-14")
@pytest.mark.parametrize("backend", ["events-shared", "events-shared+log"])
def test_three_bots_one_frozen_past_its_lease_one_killed(backend: str, tmp_path: Any) -> None:
    spec_ = ("factory", "botmesh_testkit.backends.events:child_backend", str(tmp_path), backend)
    msgs = [(f"m{i}", f"c{i % 3}", f"msg {i}") for i in range(1, 10)]
    with Replicas(spec_, slow_on_a(), workdir=str(tmp_path), lease_ms=500, timeout=60) as r:
        a = r.start("a")
        r.start("b")
        r.start("c", stop_at=15)
        r.feed("a", [("s1", "cs", "slow")])
        journaled = r.wait_marker("a", lambda m: m.op == "inbox.journal" and m.ident == "s1" and m.when == "after")
        r.wait_marker("a", lambda m: m.op == "mark" and m.ident == "hold")
        r.freeze("a")
        assert psutil.Process(a.pid).status() == psutil.STATUS_STOPPED
        r.feed("c", msgs)
        r.wait_frozen("c")
        c = r.child("c")
        r.kill("c")
        assert not psutil.pid_exists(c.pid)
        took = r.wait_marker("b", lambda m: m.op == "inbox.claim" and m.ident == "s1" and m.when == "after"
                             and m.info.get("claimed") is not None)
        assert took.info["claimed"] > journaled.info["token"]  # a larger fencing token, once a's lease expired
        r.redeliver("b")  # the channel redelivers what c never acknowledged
        r.wait_marker("b", lambda m: m.op == "inbox.complete" and m.ident == "s1" and m.when == "after")
        r.thaw("a")
        refused = r.wait_marker("a", lambda m: m.op == "inbox.complete" and m.ident == "s1" and m.when == "after")
        assert refused.info == {"token": journaled.info["token"], "ok": False}
        assert r.metrics("a")["stale_leases"] >= 1
        r.drain("b")
        result = r.finish()
    print(result.report())
    result.assert_ok()
    assert result.inbox_states == {"done": 10}
    delivered = [d.key for d in result.run.ledger()]
    assert delivered.count("s1:1") == 1  # the frozen bot's reply was answered from the outbox, not sent twice
