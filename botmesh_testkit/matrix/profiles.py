"""Matrix profiles: TOML files naming the workloads, the policies, how many random
cells to draw per workload, and the real kill loops (``kills`` SIGKILLs per loop, one
loop per backend and policy, over ``kill_messages`` messages; only for backends that
claim ``survives_crash``). Built-in ones are the files of the top-level ``matrices/``
folder (``smoke``, ``full``), shipped as the package ``botmesh_testkit.matrices``; a
path to a ``.toml`` file selects a profile of one's own."""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from importlib.resources import files
from importlib.resources.abc import Traversable
from pathlib import Path

from .cells import POLICIES
from .workloads import WORKLOADS

BUILTIN_PACKAGE = "botmesh_testkit.matrices"
"""The built-in profiles: the top-level ``matrices/`` folder of the source tree, shipped
as this package's data (read through :mod:`importlib.resources`)."""

KILL_MESSAGES = 20
"""Messages of a kill loop unless told otherwise: a profile's ``kill_messages``, the
``messages`` of :class:`~botmesh_testkit.kill.KillLoop` and the kill command line's
``--messages``."""

KEYS = ("description", "workloads", "policies", "random_per_workload", "kills", "kill_messages", "kill_text_limit",
        "power_cuts", "held_ops", "io_errors", "explore_examples", "explore_seconds", "corruption_variants")
"""Every key a profile file may have (``matrices/README.md`` says what each means)."""


def _builtin(name: str) -> Traversable:
    return files(BUILTIN_PACKAGE).joinpath(f"{name}.toml")


class ProfileError(ValueError):
    """A profile name or file that cannot be used; the message names it."""


@dataclass(frozen=True)
class Profile:
    """A matrix profile: the workloads whose every crash point runs, under which
    ``on_ambiguous`` policies, how many random cells per workload, and the kill loops."""

    name: str
    description: str
    workloads: tuple[str, ...]
    policies: tuple[str, ...]
    random_per_workload: int
    kills: int = 0
    """Real SIGKILLs per kill loop (one loop per backend and policy; 0: no kill loops)."""
    kill_messages: int = KILL_MESSAGES
    kill_text_limit: int = 0
    """The kill loops' channel text limit: a reply longer than this many characters is
    split into parts (OUT-12, OUT-13), so kills land between the parts' writes and sends
    (0: no limit). The built-in handler's replies are ``msg <i>/reply <n>``: 13 splits
    those of messages 10 and up and leaves those of messages 1..9 whole, so each loop
    has both."""
    power_cuts: int = 0
    """Kills, each followed by a power cut, per power-cut loop (one loop per backend and
    policy, over ``kill_messages`` messages; for backends that claim ``survives_crash``
    and keep their storage in the workdir; 0: no power cuts)."""
    held_ops: int = 0
    """Points of the held-operation sweep per backend (:mod:`botmesh_testkit.kill.held`):
    the bot's process SIGKILLed while its n-th write, truncate or rename of a short
    workload is held, n over every operation of it (or this many spread over them), each
    followed by a process death only or a power cut; same backends as the power cuts,
    except the server ones; under the first of ``policies`` (0: no sweep)."""
    io_errors: bool = False
    """Run the I/O-error loop too (every file-system operation of a short workload
    failed once, in turn; same backends as the power cuts)."""
    explore_examples: int = 0
    """Generated stories per backend in the ``explore`` part (0: none)."""
    explore_seconds: float = 60.0
    """Real seconds after which explore starts no new story (per backend)."""
    corruption_variants: int = 0
    """Damaged copies of a backend's files in the ``corruption`` part (one loop per
    backend whose storage is files in its workdir; 0: none)."""


def builtin_names() -> list[str]:
    """The names of the built-in profiles."""
    return sorted(p.name.removesuffix(".toml") for p in files(BUILTIN_PACKAGE).iterdir() if p.name.endswith(".toml"))


def load_profile(name_or_path: str) -> Profile:
    """A built-in profile by name, or a TOML file by path."""
    if name_or_path.endswith(".toml"):
        path = Path(name_or_path)
        name = path.stem
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise ProfileError(f"matrix profile file {str(path)!r} does not exist") from None
    else:
        builtin = _builtin(name_or_path)
        if not builtin.is_file():
            raise ProfileError(f"unknown matrix profile {name_or_path!r}; choose one of {', '.join(builtin_names())} "
                               "or give a path to a .toml file")
        name, path, text = name_or_path, Path(f"{name_or_path}.toml"), builtin.read_text(encoding="utf-8")
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ProfileError(f"matrix profile {str(path)!r} is not valid TOML: {exc}") from None
    unknown = set(data) - set(KEYS)
    if unknown:
        raise ProfileError(f"{path}: unknown key(s) {sorted(unknown)}; known: {', '.join(KEYS)}")
    workloads = tuple(data.get("workloads", list(WORKLOADS)))
    bad = [w for w in workloads if w not in WORKLOADS]
    if bad:
        raise ProfileError(f"{path}: unknown workload(s) {bad}; known: {', '.join(WORKLOADS)}")
    policies = tuple(data.get("policies", list(POLICIES)))
    if not policies or any(p not in POLICIES for p in policies):
        raise ProfileError(f"{path}: policies must be a non-empty subset of {list(POLICIES)}, got {list(policies)}")
    count = data.get("random_per_workload", 0)
    if not isinstance(count, int) or isinstance(count, bool) or count < 0:
        raise ProfileError(f"{path}: random_per_workload must be an integer >= 0, got {count!r}")
    counts = {}
    for key, default in (("kills", 0), ("kill_messages", KILL_MESSAGES), ("kill_text_limit", 0), ("power_cuts", 0),
                         ("held_ops", 0), ("corruption_variants", 0)):
        value = data.get(key, default)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ProfileError(f"{path}: {key} must be an integer >= 0, got {value!r}")
        counts[key] = value
    if (counts["kills"] or counts["power_cuts"]) and not counts["kill_messages"]:
        raise ProfileError(f"{path}: kill_messages must be > 0 when kills or power_cuts is set")
    io_errors = data.get("io_errors", False)
    if not isinstance(io_errors, bool):
        raise ProfileError(f"{path}: io_errors must be true or false, got {io_errors!r}")
    examples = data.get("explore_examples", 0)
    if not isinstance(examples, int) or isinstance(examples, bool) or examples < 0:
        raise ProfileError(f"{path}: explore_examples must be an integer >= 0, got {examples!r}")
    seconds = data.get("explore_seconds", 60.0)
    if not isinstance(seconds, (int, float)) or isinstance(seconds, bool) or not 0 < seconds < float("inf"):
        raise ProfileError(f"{path}: explore_seconds must be a number of seconds > 0, got {seconds!r}")
    return Profile(name, str(data.get("description", "")), workloads, policies, count, io_errors=io_errors,
                   explore_examples=examples, explore_seconds=float(seconds), **counts)
