"""What every Redis client of the backend tells the server about itself."""

from __future__ import annotations

import functools
from typing import Any


@functools.lru_cache(maxsize=1)
def driver_options() -> dict[str, Any]:
    """The client metadata redis-py sends with ``CLIENT SETINFO`` (its name and version),
    made once per process and shared by every client: left to redis-py, each new client
    looks the version up in the installed package metadata again (~0.5 ms of parsing),
    which a crash cell paid for every client it opened. The same values are sent. Empty
    (redis-py's own default) for a redis-py without ``driver_info``."""
    try:
        from redis.driver_info import DriverInfo
    except ImportError:
        return {}
    return {"driver_info": DriverInfo()}
