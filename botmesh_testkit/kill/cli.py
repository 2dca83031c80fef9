"""``python -m botmesh_testkit.kill``: one kill loop from a shell (:func:`main`)."""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
from collections.abc import Callable, Coroutine
from typing import Any, cast

from ..backends.base import BackendHarness
from ..backends.registry import resolve
from ..matrix.cells import POLICIES
from ..matrix.profiles import KILL_MESSAGES
from .childproc import replies
from .loop import KILLS, KillLoop


def _text_limit(raw: str) -> int:
    """``--text-limit``: a whole number of characters >= 1 (argparse names the option
    in the error)."""
    try:
        value = int(raw)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a whole number of characters >= 1, got {raw!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"a whole number of characters >= 1, got {raw!r}")
    return value


def main(argv: list[str] | None = None) -> int:
    """``python -m botmesh_testkit.kill``: one kill loop on a file, SQLite, PostgreSQL or
    Redis backend, its report printed; exit status 0 when the run passed.

    The storage is the backend harness's, in the work directory
    (:meth:`~botmesh_testkit.backends.base.BackendHarness.kill_spec`). PostgreSQL and
    Redis need a server URL (``--postgres-url`` / ``--redis-url``, else
    ``$BOTMESH_POSTGRES_URL`` / ``$BOTMESH_REDIS_URL``); the run uses a table prefix
    (PostgreSQL) or key prefix (Redis) of its own, derived from the work directory, and
    drops it at the end — unless the run failed or ``--keep`` is given, so that what the
    children journaled can be inspected (the prefix is printed)."""
    p = argparse.ArgumentParser(prog="python -m botmesh_testkit.kill",
                                description="Kill a bot with SIGKILL in a loop and judge what the channel saw.")
    p.add_argument("--backend", default="sqlite", choices=["file", "file+log", "sqlite", "events", "events-shared",
                                                            "events-shared+log", "postgres", "redis"])
    p.add_argument("--postgres-url", default=None, metavar="URL",
                   help="server of --backend=postgres (default $BOTMESH_POSTGRES_URL)")
    p.add_argument("--redis-url", default=None, metavar="URL", help="server of --backend=redis (default $BOTMESH_REDIS_URL)")
    p.add_argument("--keep", action="store_true", help="keep the PostgreSQL table / Redis keys even when the run passed")
    p.add_argument("--kills", type=int, default=KILLS)
    p.add_argument("--messages", type=int, default=KILL_MESSAGES)
    p.add_argument("--seed", type=int, default=None, help="seed of the loop (default: drawn, and printed)")
    p.add_argument("--policy", choices=POLICIES, default="skip")
    p.add_argument("--replies", type=int, default=2)
    p.add_argument("--text-limit", type=_text_limit, default=None, metavar="N",
                   help="the channel's text limit: each reply ('msg <i>/reply <n>') longer than N characters is "
                        "split into parts (OUT-12, OUT-13), so kills land between the parts' writes and sends "
                        "(default: no limit)")
    p.add_argument("--workdir", default=None)
    p.add_argument("--start-method", default="forkserver", choices=["forkserver", "spawn"])
    p.add_argument("-v", "--verbose", action="store_true")
    args = p.parse_args(argv)
    server_url: str | None = None
    if args.backend in ("postgres", "redis"):
        option, env = f"--{args.backend}-url", f"BOTMESH_{args.backend.upper()}_URL"
        server_url = getattr(args, f"{args.backend}_url") or os.environ.get(env)
        if not server_url:
            p.error(f"--backend={args.backend} needs a server: give {option}=URL or set ${env}")
        # fail fast, as the plugin does: a URL that does not answer is a usage error now,
        # not a pool timeout after the loop started
        from ..servers import redact_url
        from ..servers.postgres import pg_probe
        from ..servers.redis import redis_probe

        why = (pg_probe if args.backend == "postgres" else redis_probe)(server_url, 5.0)
        if why is not None:
            source = option if getattr(args, f"{args.backend}_url") else f"${env}"
            p.error(f"{source}: {redact_url(server_url)} does not answer: {why}")
    if args.seed is None:
        import random

        args.seed = random.SystemRandom().randrange(2**31)
    print(f"kill loop seed {args.seed} (rerun with --seed {args.seed})")
    workdir = args.workdir or tempfile.mkdtemp(prefix="botmesh-kill-")
    drop: Callable[[], Coroutine[Any, Any, Any]] | None = None
    where = ""
    harness: BackendHarness
    if args.backend == "postgres":
        from ..backends.postgres import PostgresHarness

        pg = PostgresHarness(workdir, url=cast(str, server_url))
        harness, drop, where = pg, pg.drop_table, f"table {pg.table_prefix}durable"
    elif args.backend == "redis":
        from ..backends.redis import RedisHarness

        rh = RedisHarness(workdir, url=cast(str, server_url))
        harness, drop, where = rh, rh.delete_keys, f"keys of prefix {rh.prefix!r}"
    else:
        harness = resolve(args.backend)(workdir)
    spec = harness.kill_spec()
    assert spec is not None  # a child reaches the storage of every --backend choice
    loop = KillLoop(spec, replies(args.replies), messages=args.messages, kills=args.kills, seed=args.seed,
                    on_ambiguous=args.policy, workdir=workdir, start_method=args.start_method, text_limit=args.text_limit,
                    progress=print if args.verbose else None)
    result = loop.run()
    print(result.report())
    if drop is not None:
        if result.passed and not args.keep:
            asyncio.run(drop())
        else:
            from ..servers import redact_url

            print(f"kept for inspection: {where} on {redact_url(cast(str, server_url))}")
    return 0 if result.passed else 1
