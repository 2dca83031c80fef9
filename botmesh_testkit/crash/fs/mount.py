"""The test process's side of the power-cut file system: :class:`PowerCutFS` mounts it
(the FUSE server, :mod:`.fuse_server`, runs in a child process of its own), the
:class:`PowerCutMount` handle controls it — power cuts, injected errors, held operations,
counters — over a socket, each request answered before the call returns.

Where things are: ``workdir/backing`` is the backing directory (put files there before
:meth:`PowerCutFS.mount` to start from them: they count as durable), ``workdir/
powercut-server.log`` the server's log, and the mount point a fresh directory under
:func:`tempfile.gettempdir` (never anywhere else). Every mount is recorded in
:data:`REGISTRY_DIR` before it is made; :func:`cleanup_stale_mounts` (run by every
:meth:`PowerCutFS.mount`) unmounts those whose owner or server died. A server whose owner
dies unmounts itself (its control socket closes).

Errors: :class:`PowerCutUnavailable` — this machine cannot mount (the message says why:
no ``/dev/fuse``, not permitted, binding or libfuse missing); :class:`PowerCutServerDied`
— the server process died (its exit status and log in the message: a failure of the test
harness, not of the backend under test); :class:`PowerCutError` — the base of both, and
any other failure of the layer.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno as _errno
import importlib.util
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

from .fuse_server import FSNAME, SUBTYPE
from .state import Seed, TornWrite

__all__ = [
    "REGISTRY_DIR", "CutReport", "HeldOp", "PowerCutError", "PowerCutFS", "PowerCutMount", "PowerCutServerDied",
    "PowerCutStats", "PowerCutUnavailable", "cleanup_stale_mounts", "mount_refused_reason", "unavailable_reason",
]

REGISTRY_DIR = Path(tempfile.gettempdir()) / "botmesh-powercut-mounts"
"""One JSON record per mount made by this machine's test runs (mount point, owner and
server pids with their start times)."""

_FSTYPE = f"fuse.{SUBTYPE}"
_SERVER_MODULE = "botmesh_testkit.crash.fs.fuse_server"


class PowerCutError(RuntimeError):
    """A failure of the power-cut file system itself (not of the backend under test)."""


class PowerCutUnavailable(PowerCutError):
    """This machine cannot mount the power-cut file system; the message says why."""


class PowerCutServerDied(PowerCutError):
    """The FUSE server process died; the message has its exit status and log."""


@dataclass(frozen=True)
class CutReport:
    """What a power cut kept: ``kept`` and ``dropped`` unsynced operations (of
    ``unsynced_ops``; ``unsynced_bytes`` were written and unsynced), the tree left
    (``files``, ``dirs``), the torn write (``"torn"`` mode), the files the backing
    directory had to rewrite or remove, and the state's fingerprint."""

    mode: str
    seed: Seed
    description: str
    kept: int
    dropped: int
    unsynced_ops: int
    unsynced_bytes: int
    files: int
    dirs: int
    torn: TornWrite | None
    written: int
    removed: int
    fingerprint: str


@dataclass(frozen=True)
class HeldOp:
    """An operation a ``hold`` rule stopped: the rule's id, the operation, the path it
    was matched on, and the pid of the process that made it."""

    rule: int
    op: str
    path: str
    pid: int


@dataclass(frozen=True)
class PowerCutStats:
    """Counters since the mount: operations by kind (each attempt, failed ones
    included), fsyncs, fdatasyncs and directory fsyncs that succeeded, what is unsynced
    now, power cuts, open handles, the faults that fired and the holds that stopped an
    operation, and the layer's own errors (both lists should be empty)."""

    ops: dict[str, int]
    fsyncs: int
    fdatasyncs: int
    dir_fsyncs: int
    unsynced_bytes: int
    unsynced_ops: int
    cuts: int
    open_handles: int
    faults: tuple[dict[str, Any], ...]
    holds: tuple[dict[str, Any], ...]
    held: tuple[HeldOp, ...]
    rules: int
    internal_errors: tuple[str, ...]
    model_errors: tuple[str, ...]


# -- availability -----------------------------------------------------------------------------------
def unavailable_reason() -> str | None:
    """Why this machine cannot mount the power-cut file system, or ``None`` when it can
    (as far as can be told without mounting: a refused mount raises
    :class:`PowerCutUnavailable` from :meth:`PowerCutFS.mount`)."""
    if not sys.platform.startswith("linux"):
        return f"power cuts need Linux's FUSE; this is {sys.platform}"
    if not os.path.exists("/dev/fuse"):
        return ("no /dev/fuse on this machine: the fuse kernel module is not loaded, or the container was "
                "started without the device (e.g. docker run --device /dev/fuse --cap-add SYS_ADMIN)")
    try:
        os.close(os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC))
    except OSError as exc:
        return f"cannot open /dev/fuse: {exc.strerror} (this user or container may not use FUSE)"
    if importlib.util.find_spec("mfusepy") is None:
        return "the FUSE binding mfusepy is not installed: pip install 'botmesh-testkit[powercuts]'"
    if ctypes.util.find_library("fuse3") is None:
        return "libfuse 3 is not installed (Debian/Ubuntu: apt-get install fuse3 libfuse3-dev)"
    if shutil.which("fusermount3") is None and (os.geteuid() != 0 or shutil.which("umount") is None):
        return "fusermount3 is not installed (Debian/Ubuntu: apt-get install fuse3)"
    return None


def mount_refused_reason() -> str | None:
    """Why this machine cannot mount the power-cut file system, found by trying:
    :func:`unavailable_reason`, then a real mount (unmounted at once) of a scratch
    directory — a container without ``CAP_SYS_ADMIN`` or a user namespace has
    ``/dev/fuse`` and ``fusermount3`` and still refuses the mount itself. ``None`` when
    it mounted. Like every mount, it first unmounts what killed runs left behind
    (:func:`cleanup_stale_mounts`)."""
    reason = unavailable_reason()
    if reason is not None:
        return reason
    with tempfile.TemporaryDirectory(prefix="botmesh-powercut-probe-") as tmp:
        try:
            PowerCutFS(tmp).mount().unmount()
        except PowerCutError as exc:
            return str(exc)
    return None


# -- mounts and the registry -------------------------------------------------------------------------
def _unescape(field: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def _our_mounts() -> set[str]:
    """Mount points of power-cut file systems, from /proc/mounts."""
    out: set[str] = set()
    try:
        with open("/proc/mounts", encoding="utf-8", errors="surrogateescape") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 3 and (parts[2] == _FSTYPE or parts[0] == FSNAME):
                    out.add(_unescape(parts[1]))
    except OSError:
        pass
    return out


def _is_mounted(path: str) -> bool:
    return os.path.realpath(path) in {os.path.realpath(p) for p in _our_mounts()}


def _start_time(pid: int) -> int | None:
    """The start time of process ``pid`` (clock ticks since boot), to tell a live owner
    from a new process that reused its pid; ``None`` when there is no such process."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            text = f.read()
    except OSError:
        return None
    fields = text[text.rfind(")") + 2:].split()
    try:
        state, start = fields[0], int(fields[19])
    except (IndexError, ValueError):
        return None
    return None if state in ("Z", "X") else start


def _alive(pid: Any, start: Any) -> bool:
    return isinstance(pid, int) and pid > 0 and _start_time(pid) == start


def _force_unmount(path: str) -> None:
    """Lazily unmount ``path`` however this machine allows; quiet when it is not mounted."""
    for cmd in (["fusermount3", "-u", "-z", path], ["umount", "-l", path]):
        if not _is_mounted(path):
            return
        if shutil.which(cmd[0]) is None:
            continue
        try:
            subprocess.run(cmd, capture_output=True, timeout=60, check=False)
        except (OSError, subprocess.TimeoutExpired):
            continue
    if _is_mounted(path):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.umount2(os.fsencode(path), 2)  # MNT_DETACH


def _read_record(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _write_record(path: Path, record: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record), encoding="utf-8")
    os.replace(tmp, path)


def _remove_mountpoint(path: str) -> None:
    try:
        os.rmdir(path)
    except OSError:
        pass


def cleanup_stale_mounts() -> list[str]:
    """Unmount every power-cut file system left behind by a run that died: those whose
    record names a dead owner or a dead server, and those under the temporary directory
    with no record at all. Returns the mount points cleaned. Mounts of live runs (owner
    and server alive, or being set up) are left alone."""
    REGISTRY_DIR.mkdir(parents=True, exist_ok=True)
    mounted = _our_mounts()
    cleaned: list[str] = []
    recorded: set[str] = set()
    for rec_path in sorted(REGISTRY_DIR.glob("*.json")):
        rec = _read_record(rec_path)
        if rec is None:
            rec_path.unlink(missing_ok=True)
            continue
        mp = str(rec.get("mountpoint", ""))
        owner_alive = _alive(rec.get("owner_pid"), rec.get("owner_start"))
        server_known = rec.get("server_pid") is not None
        server_alive = server_known and _alive(rec.get("server_pid"), rec.get("server_start"))
        if owner_alive and (server_alive or not server_known):
            recorded.add(mp)
            continue
        # Unmount first, then stop an orphaned server: whoever waits for that server to end
        # then finds the mount gone (it would unmount itself anyway, its socket closed).
        if mp and mp in mounted:
            _force_unmount(mp)
            cleaned.append(mp)
        if server_alive:
            try:
                os.kill(int(rec["server_pid"]), signal.SIGKILL)
            except OSError:
                pass
        if mp:
            _remove_mountpoint(mp)
        rec_path.unlink(missing_ok=True)
    tmp = os.path.realpath(tempfile.gettempdir())
    for mp in sorted(mounted - recorded - set(cleaned)):
        if os.path.realpath(mp).startswith(tmp + os.sep):
            _force_unmount(mp)
            _remove_mountpoint(mp)
            cleaned.append(mp)
    return cleaned


# -- the file system and its handle -------------------------------------------------------------------
class PowerCutFS:
    """A power-cut file system over ``workdir/backing`` (module docstring). ``timeout``
    bounds every wait for the server (mounting, each request) in seconds: generous, so a
    loaded machine does not fail a test; ``debug`` logs every operation to the server log."""

    def __init__(self, workdir: str | os.PathLike[str], *, timeout: float = 120.0, debug: bool = False) -> None:
        self.workdir = Path(workdir).resolve()
        self.backing = self.workdir / "backing"
        self.log_path = self.workdir / "powercut-server.log"
        self.timeout = timeout
        self.debug = debug

    def mount(self) -> PowerCutMount:
        """Mount it and return the handle once the kernel has the mount. Raises
        :class:`PowerCutUnavailable` when this machine cannot (the reason in the
        message), :class:`PowerCutError` for anything else."""
        reason = unavailable_reason()
        if reason is not None:
            raise PowerCutUnavailable(reason)
        cleanup_stale_mounts()
        self.backing.mkdir(parents=True, exist_ok=True)
        mountpoint = tempfile.mkdtemp(prefix="botmesh-powercut-mnt-")
        record_path = REGISTRY_DIR / f"{uuid.uuid4().hex}.json"
        record: dict[str, Any] = {"mountpoint": mountpoint, "owner_pid": os.getpid(),
                                  "owner_start": _start_time(os.getpid()), "server_pid": None,
                                  "server_start": None, "backing": str(self.backing)}
        _write_record(record_path, record)
        parent, child = socket.socketpair()
        log = open(self.log_path, "ab")  # the server process writes it
        # -c rather than -m: the package's __init__ imports the module (runpy would warn).
        cmd = [sys.executable, "-c", f"import sys; from {_SERVER_MODULE} import main; sys.exit(main())",
               "--backing", str(self.backing), "--mountpoint", mountpoint, "--control-fd", str(child.fileno())]
        if self.debug:
            cmd.append("--debug")
        env = dict(os.environ, FUSE_LIBRARY_NAME="fuse3")  # mfusepy would prefer libfuse 2 when present
        try:
            proc = subprocess.Popen(cmd, pass_fds=(child.fileno(),), stdin=subprocess.DEVNULL, stdout=log,
                                    stderr=log, start_new_session=True, env=env)
        except OSError as exc:
            parent.close()
            log.close()
            record_path.unlink(missing_ok=True)
            _remove_mountpoint(mountpoint)
            raise PowerCutError(f"cannot start the power-cut FUSE server: {exc}") from exc
        finally:
            child.close()
        record.update(server_pid=proc.pid, server_start=_start_time(proc.pid))
        _write_record(record_path, record)
        handle = PowerCutMount(self, Path(mountpoint), proc, parent, log, record_path)
        handle._wait_ready()
        return handle


class PowerCutMount:
    """A mounted power-cut file system. Use :attr:`path` as the backend's directory.
    Every method sends one request and returns once the server answered it; the handle
    may be used from several threads (requests are serialised)."""

    def __init__(self, fs: PowerCutFS, path: Path, proc: subprocess.Popen[bytes], sock: socket.socket,
                 log: Any, record: Path) -> None:
        self.fs = fs
        self.path = path
        """The mount point."""
        self.backing = fs.backing
        """The backing directory (do not touch it while mounted)."""
        self._proc = proc
        self._sock = sock
        self._log = log
        self._record = record
        self._buf = bytearray()
        self._lock = threading.Lock()
        self._next_id = 0
        self._closed = False

    @property
    def server_pid(self) -> int:
        """The FUSE server's pid."""
        return self._proc.pid

    def __enter__(self) -> PowerCutMount:
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        self.unmount()

    def __repr__(self) -> str:
        return f"<PowerCutMount {self.path} server pid {self._proc.pid}{' unmounted' if self._closed else ''}>"

    # -- the control API -------------------------------------------------------------------------------
    def cut(self, mode: str = "drop", seed: Seed = 0, *, sector: int | None = None) -> CutReport:
        """A power cut: afterwards the mount shows only what the model made durable
        (``mode`` ``"drop"``, ``"subset"`` or ``"torn"``, drawn from ``seed``; ``sector``
        fixes the torn write's boundary). Open files of before are dead: their
        operations fail with ``EIO``. A held operation is answered ``EIO`` undone."""
        r = self._request("cut", mode=mode, seed=seed, sector=sector)
        torn = r["torn"]
        return CutReport(r["mode"], r["seed"], r["description"], r["kept"], r["dropped"], r["unsynced_ops"],
                         r["unsynced_bytes"], r["files"], r["dirs"], None if torn is None else TornWrite(**torn),
                         r["written"], r["removed"], r["fingerprint"])

    def sync(self) -> None:
        """Make everything written so far durable, as if the disk had been flushed whole
        (set-up before the workload: a database created, a server initialised). A
        ``sync(2)`` or ``syncfs(2)`` of a process does not reach the FUSE layer, so only
        this does it."""
        self._request("sync")

    def fail(self, op: str, path_glob: str = "*", nth: int = 1, errno: int = _errno.EIO) -> int:
        """Make the ``nth`` operation ``op`` (one of :data:`~.faults.FAULT_OPS` or
        ``"*"``) on a path matching ``path_glob`` (``fnmatch`` on the path relative to
        the mount; ``*`` also matches ``/``), counted from now, fail with ``errno`` —
        once. Returns the rule's id. A failed fsync also loses the file's unsynced data."""
        return int(self._request("fail", op=op, path_glob=path_glob, nth=nth, errno=errno)["rule"])

    def hold(self, op: str, path_glob: str = "*", nth: int = 1) -> int:
        """Make the ``nth`` matching operation (as :meth:`fail`) wait before it does
        anything, until :meth:`release` (it then runs), :meth:`cancel` or a cut or
        unmount (it then fails with ``EIO``, undone). ``op`` may join several operations
        with ``|`` (``"write|truncate|rename"``: the n-th of any of them). :meth:`wait_held`
        waits until it is waiting.
        Returns the rule's id. A SIGKILLed process dies only once its held operation is
        answered: kill, then :meth:`cut`, :meth:`cancel` or :meth:`release`, then wait
        for it."""
        return int(self._request("hold", op=op, path_glob=path_glob, nth=nth)["rule"])

    def wait_held(self, timeout: float = 120.0) -> HeldOp:
        """Wait until an operation is held and return it (the first, when several are);
        ``TimeoutError`` after ``timeout`` seconds."""
        held = self._request("wait_held", timeout=timeout, _wait=timeout)
        first = held[0]
        return HeldOp(int(first["rule"]), str(first["op"]), str(first["path"]), int(first["pid"]))

    def release(self, rule: int | None = None) -> int:
        """Let the held operations of rule ``rule`` (every rule: ``None``) run; a named
        rule that has not fired yet is dropped. Returns how many operations went on."""
        return int(self._request("release", rule=rule)["released"])

    def poll_held(self) -> HeldOp | None:
        """The first operation held now, or ``None`` (:meth:`wait_held` without the wait)."""
        try:
            return self.wait_held(timeout=0.0)
        except TimeoutError:
            return None

    def cancel(self, rule: int | None = None) -> int:
        """Answer the held operations of rule ``rule`` (every rule: ``None``) with
        ``EIO`` without doing them and without a power cut — for a process killed while
        its operation was held: the operation never lands, everything it did before stays
        visible (a process death, not a power loss). A named rule that has not fired yet
        is dropped. Returns how many were cancelled."""
        return int(self._request("cancel", rule=rule)["cancelled"])

    def server_died(self, doing: str) -> PowerCutServerDied | None:
        """:class:`PowerCutServerDied` naming the server's death (while ``doing``) when its
        process has ended, else ``None``: ask it before blaming the backend for what went
        wrong on the mount."""
        if self._proc.poll() is None:
            return None
        return self._died(doing)

    def clear(self) -> None:
        """Drop every fail and hold rule; held operations go on."""
        self._request("clear")

    def stats(self) -> PowerCutStats:
        """The counters (:class:`PowerCutStats`)."""
        r = self._request("stats")
        return PowerCutStats(
            dict(r["ops"]), r["fsyncs"], r["fdatasyncs"], r["dir_fsyncs"], r["unsynced_bytes"], r["unsynced_ops"],
            r["cuts"], r["open_handles"], tuple(r["faults"]), tuple(r["holds"]),
            tuple(HeldOp(int(h["rule"]), str(h["op"]), str(h["path"]), int(h["pid"])) for h in r["held"]),
            r["rules"], tuple(r["internal_errors"]), tuple(r["model_errors"]))

    def unsynced(self) -> list[str]:
        """The unsynced operations, in the order they were made, in words."""
        return [str(x) for x in self._request("unsynced")]

    def check(self) -> list[str]:
        """Differences between what the mount shows and what the model tracks (and the
        layer's own errors): empty when the layer is sound."""
        return [str(x) for x in self._request("check")]

    def alive(self) -> bool:
        """Whether the server process is running."""
        return self._proc.poll() is None

    def unmount(self) -> None:
        """Unmount, stop the server, remove the mount point. Idempotent; also cleans up
        after a server that died."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        try:
            if self._proc.poll() is None:
                try:
                    self._send({"id": -1, "cmd": "unmount"})
                except OSError:
                    pass
                try:
                    self._proc.wait(timeout=self.fs.timeout)
                except subprocess.TimeoutExpired:
                    self._proc.kill()
                    self._proc.wait(timeout=self.fs.timeout)
            _force_unmount(str(self.path))
        finally:
            self._sock.close()
            self._log.close()
            _remove_mountpoint(str(self.path))
            self._record.unlink(missing_ok=True)

    # -- the wire --------------------------------------------------------------------------------------
    def _send(self, message: dict[str, Any]) -> None:
        self._sock.sendall((json.dumps(message) + "\n").encode())

    def _readline(self, deadline: float) -> bytes:
        """One line from the server; ``b""`` when the server closed the socket."""
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError
            self._sock.settimeout(left)
            try:
                chunk = self._sock.recv(65536)
            except TimeoutError:
                raise
            except OSError:
                return b""
            if not chunk:
                return b""
            self._buf += chunk
        line, _, rest = bytes(self._buf).partition(b"\n")
        self._buf = bytearray(rest)
        return line

    def _died(self, doing: str) -> PowerCutServerDied:
        try:
            code = self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            code = None
        if code is None:
            how = "closed its control socket but is still running"
        elif code < 0:
            how = f"killed by {signal.Signals(-code).name}"
        else:
            how = f"exited with status {code}"
        return PowerCutServerDied(
            f"the power-cut FUSE server (pid {self._proc.pid}) {how} while {doing}: the mount at {self.path} is "
            f"gone — a failure of the test harness's file system, not of the backend under test. Server log "
            f"({self.fs.log_path}):\n{self._log_tail()}")

    def _log_tail(self, limit: int = 4000) -> str:
        try:
            data = self.fs.log_path.read_bytes()
        except OSError:
            return "(no log)"
        return data[-limit:].decode("utf-8", "replace").strip() or "(empty)"

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.fs.timeout
        try:
            while True:
                try:
                    line = self._readline(deadline)
                except TimeoutError:
                    self._abandon()
                    raise PowerCutError(f"the power-cut FUSE server did not mount {self.path} within "
                                        f"{self.fs.timeout} s; its log:\n{self._log_tail()}") from None
                if not line:
                    self._abandon()
                    raise PowerCutUnavailable(f"mounting the power-cut file system failed (the server exited "
                                              f"with {self._proc.returncode}): {self._log_tail()}")
                message = json.loads(line)
                if message.get("event") == "ready":
                    break
                if message.get("event") == "error":
                    error = str(message.get("error"))
                    self._abandon()
                    if error.startswith("mount failed"):
                        raise PowerCutUnavailable(f"mounting the power-cut file system was refused here "
                                                  f"({error}): {self._log_tail()}")
                    raise PowerCutError(f"{error}; server log: {self._log_tail()}")
        except BaseException:
            self._abandon()
            raise
        # The kernel answered FUSE_INIT; the mount is in the table by now.
        if not _is_mounted(str(self.path)):
            self.unmount()
            raise PowerCutError(f"the power-cut FUSE server said it mounted {self.path}, but /proc/mounts "
                                f"does not list it")

    def _abandon(self) -> None:
        """Clean up after a mount that did not come up."""
        if self._closed:
            return
        self._closed = True
        if self._proc.poll() is None:
            self._proc.kill()
        try:
            self._proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
        _force_unmount(str(self.path))
        self._sock.close()
        self._log.close()
        _remove_mountpoint(str(self.path))
        self._record.unlink(missing_ok=True)

    def _request(self, cmd: str, _wait: float = 0.0, **fields: Any) -> Any:
        with self._lock:
            if self._closed:
                raise PowerCutError(f"{self!r}: unmounted")
            self._next_id += 1
            rid = self._next_id
            try:
                self._send({"id": rid, "cmd": cmd, **fields})
            except OSError:
                raise self._died(f"sending {cmd!r}") from None
            deadline = time.monotonic() + self.fs.timeout + _wait
            while True:
                try:
                    line = self._readline(deadline)
                except TimeoutError:
                    if self._proc.poll() is not None:
                        raise self._died(f"answering {cmd!r}") from None
                    raise PowerCutError(f"the power-cut FUSE server did not answer {cmd!r} within "
                                        f"{self.fs.timeout + _wait} s") from None
                if not line:
                    raise self._died(f"answering {cmd!r}")
                message = json.loads(line)
                if message.get("id") == rid:
                    break
        if message.get("ok"):
            return message.get("result")
        kind, error = message.get("type"), str(message.get("error"))
        if kind == "ValueError":
            raise ValueError(error)
        if kind == "TimeoutError":
            raise TimeoutError(error)
        raise PowerCutError(f"{cmd} failed in the power-cut FUSE server: {error}\n{message.get('traceback', '')}")
