"""The power-cut file system's server: a pass-through FUSE file system (kernel FUSE through
``/dev/fuse``, libfuse 3's high-level API through the ``mfusepy`` binding), run in a
child process of its own by :mod:`.mount` — never imported by the test process.

Every operation of a process using the mount is done on the backing directory at once
(reads are plain ``pread``\\ s of the backing files: the visible state *is* the backing
directory) and fed to the :class:`~.model.PersistenceModel`, which keeps the durable image
in memory and a journal of what is unsynced. ``fsync`` is not passed on to the backing
disk (durability is the model's business; the real disk never loses power here), so an
fsync costs a memory copy of the unsynced extents and nothing more.

A power cut (``cut``) takes the operation lock (no operation runs during it), asks the
model for a crash state, rewrites in the backing directory only what differs from it
(:func:`~.image.rebuild`), forgets every open handle (later operations on them fail with
``EIO``: the processes that held them are dead in the story) and continues with a model
of the crash state. The kernel caches nothing that could hide it: attribute, entry and
negative timeouts are 0, every open revalidates the page cache, and ``direct_io`` is off
(so shared writable ``mmap`` — SQLite's ``-shm`` — works).

The server sees what the kernel sends, which is not always one request per system call:
a ``write(2)`` that starts inside a page and crosses its end arrives as two writes, split
at the page boundary (for the fault rules' counting and for the torn variant these are
two writes), and ``open(O_TRUNC)`` arrives as an open with ``O_TRUNC`` (recorded as a
size change to 0).

Faults (``fail``, ``hold``) are checked at the entry of an operation, before the lock: a
failed operation does nothing but return its errno (a failed ``fsync`` also loses the
file's unsynced data: model rule 5); a held one waits, without the lock, until it is
released (then it runs) or the mount is cut or unmounted (then it returns ``EIO`` and
does nothing: the power went before the operation reached the disk). Note that the kernel
lets a process that was SIGKILLed during a held operation die only once the operation is
answered: kill, then ``cut()`` (or ``release()``), then wait for the process.

Control: newline-delimited JSON over the socket inherited as ``--control-fd``, one answer
per request, in order (:mod:`.mount` is the client). The server unmounts itself and exits
when the socket closes (its owner died), on ``unmount``, and on SIGTERM/SIGINT.

Not supported: symbolic links, device nodes, extended attributes, ``fallocate`` (the C
library falls back to writing zeros), ``renameat2`` flags (a rename is a plain rename);
``fchmod``/``fchown``/``futimens`` of an unlinked open file are accepted and ignored.
POSIX and BSD locks are kept by the kernel (the server implements neither), so they work
between the processes of this machine.
"""

from __future__ import annotations

import argparse
import errno
import functools
import json
import logging
import os
import socket
import stat
import subprocess
import sys
import threading
import traceback
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from .faults import FaultRules
from .image import load_tree, rebuild
from .model import PersistenceModel
from .state import NodeAttrs, crash_modes

__all__ = ["FSNAME", "SUBTYPE", "PowerCutServer", "main"]

log = logging.getLogger("botmesh_testkit.powercut")

FSNAME = "botmesh-powercut"
"""The ``fsname`` of every mount (first column of ``/proc/mounts``)."""
SUBTYPE = "powercut"
"""The subtype: the mount's type in ``/proc/mounts`` is ``fuse.powercut``."""

_OPEN_STRIP = os.O_APPEND | os.O_TRUNC | os.O_CREAT | os.O_EXCL | os.O_NOCTTY | getattr(os, "O_DIRECT", 0)
_F = TypeVar("_F", bound=Callable[..., Any])


def _guard(method: _F) -> _F:
    """Turn an unexpected exception of an operation into ``EIO`` and record it (a bug of
    this layer must show as such, not as the backend's)."""

    @functools.wraps(method)
    def wrapper(self: PowerCutServer, *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, *args, **kwargs)
        except OSError:
            raise
        except Exception as exc:  # noqa: BLE001 - reported, and the caller sees EIO
            self._internal_error(f"{method.__name__}{args!r}: {exc!r}\n{traceback.format_exc()}")
            raise OSError(errno.EIO, "internal error of the power-cut file system") from exc

    return wrapper  # type: ignore[return-value]


@dataclass
class _Handle:
    fd: int
    ino: int
    path: str  # relative path it was opened by (what rules match)
    sync: bool  # opened O_SYNC / O_DSYNC: every write is durable at once


def _stat_dict(st: os.stat_result) -> dict[str, Any]:
    return {
        "st_mode": st.st_mode, "st_nlink": st.st_nlink, "st_uid": st.st_uid, "st_gid": st.st_gid,
        "st_size": st.st_size, "st_blocks": st.st_blocks, "st_blksize": st.st_blksize, "st_rdev": st.st_rdev,
        "st_atime": st.st_atime_ns, "st_mtime": st.st_mtime_ns, "st_ctime": st.st_ctime_ns,
    }


def _caller() -> tuple[int, int, int]:
    import mfusepy  # the binding is only ever imported in the server process

    uid, gid, pid = mfusepy.fuse_get_context()
    return int(uid), int(gid), int(pid)


class PowerCutServer:
    """The FUSE operations (the ``mfusepy`` operations protocol) plus the control channel.
    Every operation runs under one lock, so the model sees them in the order the backing
    directory did."""

    use_ns = True  # timestamps in nanoseconds (mfusepy)

    def __init__(self, backing: str, mountpoint: str, control: socket.socket) -> None:
        self._backing = os.path.abspath(backing)
        self._mountpoint = mountpoint
        self._control = control
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()  # the operation lock
        self._rules = FaultRules(lambda: _caller()[2])
        self._root_attrs = self._attrs_of(os.stat(self._backing))
        self._model: PersistenceModel = load_tree(self._backing)
        self._handles: dict[int, _Handle] = {}
        self._next_fh = 1  # never reused, so a handle of before a cut is simply unknown
        self._fsyncs: Counter[str] = Counter()
        self._cuts = 0
        self._internal: list[str] = []
        self._model_errors: list[str] = []
        self._unmounted = False
        self._is_root = os.geteuid() == 0

    # -- helpers -------------------------------------------------------------------------------
    @staticmethod
    def _attrs_of(st: os.stat_result) -> NodeAttrs:
        return NodeAttrs(stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid)

    @staticmethod
    def _rel(path: str | None) -> str:
        if path is None:
            raise OSError(errno.EIO, "no path for this operation")
        return path.lstrip("/")

    def _real(self, path: str | None) -> str:
        rel = self._rel(path)
        return os.path.join(self._backing, rel) if rel else self._backing

    def _internal_error(self, text: str) -> None:
        log.error("internal error: %s", text)
        self._internal.append(text)

    def _model_do(self, what: str, fn: Callable[..., Any], *args: Any) -> Any:
        """Feed an operation the backing directory already did to the model; a refusal is a
        divergence between the two (recorded: ``check`` reports it), never the caller's."""
        try:
            return fn(*args)
        except (OSError, ValueError, KeyError) as exc:
            text = f"{what}: the model refused an operation the backing directory did: {exc!r}"
            log.error("%s", text)
            self._model_errors.append(text)
            return None

    def _handle(self, fh: int) -> _Handle:
        h = self._handles.get(fh)
        if h is None:
            raise OSError(errno.EIO, "stale handle (a power cut happened since it was opened)")
        return h

    def _gate(self, op: str, *paths: str) -> tuple[int, int]:
        """The fault rules' verdict on an operation (:meth:`FaultRules.gate`)."""
        return self._rules.gate(op, *paths)

    def _check_gen(self, gen: int) -> None:
        if gen != self._rules.generation:
            raise OSError(errno.EIO, "operation overtaken by a power cut")

    def _chown_new(self, real: str) -> tuple[int, int]:
        """New files and directories belong to the caller (the server runs as root)."""
        uid, gid, _ = _caller()
        if self._is_root and (uid, gid) != (0, 0):
            os.chown(real, uid, gid)
        return uid, gid

    # -- mfusepy: lifecycle ----------------------------------------------------------------------
    def init_with_config(self, conn: Any, config: Any) -> None:
        """Kernel caches off (module docstring); unlinked open files have no hidden name."""
        if config is not None:
            config.attr_timeout = 0.0
            config.entry_timeout = 0.0
            config.negative_timeout = 0.0
            config.hard_remove = 1
            config.use_ino = 0
            config.direct_io = 0
            config.kernel_cache = 0
            config.auto_cache = 0
        self.send({"event": "ready", "pid": os.getpid()})

    def destroy(self, path: str) -> None:
        """Unmounted."""

    # -- mfusepy: metadata -------------------------------------------------------------------------
    @_guard
    def getattr(self, path: str | None, fh: int | None = None) -> dict[str, Any]:
        """``stat`` of the backing file (through the open handle when there is one)."""
        with self._lock:
            h = self._handles.get(fh) if fh is not None else None
            if h is not None:
                return _stat_dict(os.fstat(h.fd))
            return _stat_dict(os.lstat(self._real(path)))

    @_guard
    def access(self, path: str, amode: int) -> int:
        """Exists (permissions are the kernel's: ``default_permissions``)."""
        with self._lock:
            os.lstat(self._real(path))
        return 0

    @_guard
    def readdir(self, path: str, fh: int) -> list[str]:
        """The backing directory's names."""
        with self._lock:
            return [".", "..", *os.listdir(self._real(path))]

    @_guard
    def statfs(self, path: str) -> dict[str, int]:
        """The backing file system's figures."""
        v = os.statvfs(self._backing)
        return {k: getattr(v, k) for k in ("f_bsize", "f_frsize", "f_blocks", "f_bfree", "f_bavail", "f_files",
                                            "f_ffree", "f_favail", "f_flag", "f_namemax")}

    @_guard
    def chmod(self, path: str | None, mode: int) -> int:
        """Applied at once (modes are not crash-modelled)."""
        if path is None:
            return 0
        with self._lock:
            os.chmod(self._real(path), stat.S_IMODE(mode))
            ino = self._model.lookup(self._rel(path))
            if ino is not None:
                self._model.set_attrs(ino, mode=stat.S_IMODE(mode))
        return 0

    @_guard
    def chown(self, path: str | None, uid: int, gid: int) -> int:
        """Applied at once (owners are not crash-modelled)."""
        if path is None:
            return 0
        with self._lock:
            os.lchown(self._real(path), uid, gid)
            ino = self._model.lookup(self._rel(path))
            if ino is not None:
                st = os.lstat(self._real(path))
                self._model.set_attrs(ino, uid=st.st_uid, gid=st.st_gid)
        return 0

    @_guard
    def utimens(self, path: str | None, times: tuple[int, int] | None = None) -> int:
        """Applied at once (timestamps are not modelled)."""
        if path is None:
            return 0
        with self._lock:
            if times is None:
                os.utime(self._real(path))
            else:
                os.utime(self._real(path), ns=(int(times[0]), int(times[1])))
        return 0

    # -- mfusepy: files ------------------------------------------------------------------------------
    def _open_fd(self, real: str, rel: str, flags: int, fd: int | None, ino: int) -> int:
        if flags & os.O_TRUNC and self._model.size(ino) > 0:
            os.truncate(real, 0)
            self._model.truncate(ino, 0)
        if fd is None:
            fd = os.open(real, (flags & ~_OPEN_STRIP) | os.O_CLOEXEC)
        self._model.open_handle(ino)
        fh = self._next_fh
        self._next_fh += 1
        self._handles[fh] = _Handle(fd, ino, rel, bool(flags & (os.O_SYNC | os.O_DSYNC)))
        return fh

    @_guard
    def open(self, path: str, flags: int) -> int:
        """Open the backing file (``O_APPEND`` is the kernel's business: it sends offsets)."""
        rel = self._rel(path)
        gen, fault = self._gate("open", rel)
        if fault:
            raise OSError(fault, os.strerror(fault))
        with self._lock:
            self._check_gen(gen)
            ino = self._model.lookup(rel)
            if ino is None:
                raise OSError(errno.ENOENT, "No such file or directory (model)", rel)
            return self._open_fd(self._real(path), rel, flags, None, ino)

    @_guard
    def create(self, path: str, mode: int, flags: int) -> int:
        """Create and open a file (its name is unsynced until its directory is fsynced)."""
        rel = self._rel(path)
        gen, fault = self._gate("create", rel)
        if fault:
            raise OSError(fault, os.strerror(fault))
        real = self._real(path)
        with self._lock:
            self._check_gen(gen)
            try:
                fd = os.open(real, os.O_CREAT | os.O_EXCL | (flags & ~_OPEN_STRIP) | os.O_CLOEXEC,
                             stat.S_IMODE(mode))
            except FileExistsError:
                if flags & os.O_EXCL:
                    raise
                ino = self._model.lookup(rel)
                if ino is None:
                    raise OSError(errno.EIO, "exists in the backing directory, not in the model", rel) from None
                return self._open_fd(real, rel, flags, None, ino)
            try:
                uid, gid = self._chown_new(real)
                ino = self._model_do(f"create {rel}", self._model.create, rel,
                                     NodeAttrs(stat.S_IMODE(mode), uid, gid))
                if ino is None:
                    raise OSError(errno.EIO, "model refused create", rel)
                return self._open_fd(real, rel, flags & ~os.O_TRUNC, fd, ino)
            except BaseException:
                os.close(fd)
                raise

    @_guard
    def read(self, path: str | None, size: int, offset: int, fh: int) -> bytes:
        """``pread`` of the backing file."""
        h = self._handle(fh)
        gen, fault = self._gate("read", h.path)
        if fault:
            raise OSError(fault, os.strerror(fault))
        with self._lock:
            self._check_gen(gen)
            return os.pread(self._handle(fh).fd, size, offset)

    @_guard
    def write(self, path: str | None, data: bytes, offset: int, fh: int) -> int:
        """``pwrite`` to the backing file; unsynced in the model until an fsync."""
        h = self._handle(fh)
        gen, fault = self._gate("write", h.path)
        if fault:
            raise OSError(fault, os.strerror(fault))
        with self._lock:
            self._check_gen(gen)
            h = self._handle(fh)
            n = os.pwrite(h.fd, data, offset)
            self._model.write(h.ino, offset, data if n == len(data) else data[:n])
            if h.sync:
                self._model.fsync(h.ino)
            return n

    @_guard
    def truncate(self, path: str | None, length: int, fh: int | None = None) -> int:
        """``ftruncate``/``truncate``: a size change, unsynced until the file's fsync."""
        h = self._handles.get(fh) if fh is not None else None
        rel = h.path if h is not None else self._rel(path)
        gen, fault = self._gate("truncate", rel)
        if fault:
            raise OSError(fault, os.strerror(fault))
        with self._lock:
            self._check_gen(gen)
            if fh is not None and h is not None:
                h = self._handle(fh)
                os.ftruncate(h.fd, length)
                self._model.truncate(h.ino, length)
                return 0
            os.truncate(self._real(path), length)
            ino = self._model.lookup(rel)
            if ino is None:
                self._model_errors.append(f"truncate {rel}: not in the model")
            else:
                self._model.truncate(ino, length)
        return 0

    @_guard
    def fsync(self, path: str | None, datasync: int, fh: int) -> int:
        """Make the file's unsynced data durable in the model (a failed one loses it)."""
        h = self._handle(fh)
        gen, fault = self._gate("fsync", h.path)
        with self._lock:
            self._check_gen(gen)
            h = self._handle(fh)
            if fault:
                self._model.fsync_failed(h.ino)
                raise OSError(fault, os.strerror(fault))
            self._fsyncs["fdatasync" if datasync else "fsync"] += 1
            self._model.fsync(h.ino)
        return 0

    @_guard
    def flush(self, path: str | None, fh: int) -> int:
        """``close`` of one descriptor: nothing to do (writes are write-through)."""
        return 0

    @_guard
    def release(self, path: str | None, fh: int) -> int:
        """The last descriptor of an open file was closed."""
        with self._lock:
            h = self._handles.pop(fh, None)
            if h is not None:
                os.close(h.fd)
                self._model.close_handle(h.ino)
        return 0

    # -- mfusepy: directories ----------------------------------------------------------------------
    @_guard
    def fsyncdir(self, path: str | None, datasync: int, fh: int) -> int:
        """Make the directory's entry changes durable in the model."""
        rel = self._rel(path)
        gen, fault = self._gate("fsyncdir", rel)
        if fault:
            raise OSError(fault, os.strerror(fault))
        with self._lock:
            self._check_gen(gen)
            self._fsyncs["fsyncdir"] += 1
            self._model_do(f"fsyncdir {rel}", self._model.fsync, rel)
        return 0

    @_guard
    def mkdir(self, path: str, mode: int) -> int:
        """``mkdir``: unsynced until the parent is fsynced."""
        rel = self._rel(path)
        gen, fault = self._gate("mkdir", rel)
        if fault:
            raise OSError(fault, os.strerror(fault))
        with self._lock:
            self._check_gen(gen)
            real = self._real(path)
            os.mkdir(real, stat.S_IMODE(mode))
            uid, gid = self._chown_new(real)
            self._model_do(f"mkdir {rel}", self._model.mkdir, rel, NodeAttrs(stat.S_IMODE(mode), uid, gid))
        return 0

    @_guard
    def rmdir(self, path: str) -> int:
        """``rmdir``: unsynced until the parent is fsynced."""
        rel = self._rel(path)
        gen, fault = self._gate("rmdir", rel)
        if fault:
            raise OSError(fault, os.strerror(fault))
        with self._lock:
            self._check_gen(gen)
            os.rmdir(self._real(path))
            self._model_do(f"rmdir {rel}", self._model.rmdir, rel)
        return 0

    @_guard
    def unlink(self, path: str) -> int:
        """``unlink``: unsynced until the parent is fsynced."""
        rel = self._rel(path)
        gen, fault = self._gate("unlink", rel)
        if fault:
            raise OSError(fault, os.strerror(fault))
        with self._lock:
            self._check_gen(gen)
            os.unlink(self._real(path))
            self._model_do(f"unlink {rel}", self._model.unlink, rel)
        return 0

    @_guard
    def rename(self, old: str, new: str) -> int:
        """``rename``: unsynced until both directories are fsynced."""
        src, dst = self._rel(old), self._rel(new)
        gen, fault = self._gate("rename", src, dst)
        if fault:
            raise OSError(fault, os.strerror(fault))
        with self._lock:
            self._check_gen(gen)
            os.rename(self._real(old), self._real(new))
            self._model_do(f"rename {src} {dst}", self._model.rename, src, dst)
        return 0

    @_guard
    def link(self, target: str, source: str) -> int:
        """A hard link ``target`` to ``source`` (mfusepy's argument order)."""
        src, dst = self._rel(source), self._rel(target)
        gen, fault = self._gate("link", dst)
        if fault:
            raise OSError(fault, os.strerror(fault))
        with self._lock:
            self._check_gen(gen)
            os.link(self._real(source), self._real(target))
            self._model_do(f"link {src} {dst}", self._model.link, src, dst)
        return 0

    # -- control ---------------------------------------------------------------------------------------
    def send(self, message: dict[str, Any]) -> None:
        """One JSON line to the controlling process (ignored once it is gone)."""
        line = (json.dumps(message) + "\n").encode()
        with self._send_lock:
            try:
                self._control.sendall(line)
            except OSError:
                pass

    def serve_control(self) -> None:
        """Answer requests until the socket closes or ``unmount``; then unmount and exit."""
        reader = self._control.makefile("rb")
        try:
            for raw in reader:
                try:
                    request = json.loads(raw)
                except ValueError:
                    self.send({"id": None, "ok": False, "error": f"not JSON: {raw[:200]!r}"})
                    continue
                rid = request.get("id")
                cmd = request.get("cmd")
                try:
                    result = self._command(str(cmd), request)
                except Exception as exc:  # noqa: BLE001 - answered to the client, who raises it
                    self.send({"id": rid, "ok": False, "error": str(exc), "type": type(exc).__name__,
                               "traceback": traceback.format_exc()})
                    continue
                self.send({"id": rid, "ok": True, "result": result})
                if cmd == "unmount":
                    break
        finally:
            self.shutdown()

    def _command(self, cmd: str, req: dict[str, Any]) -> Any:
        if cmd == "ping":
            return {"pid": os.getpid()}
        if cmd == "cut":
            return self.cut(str(req.get("mode", "drop")), req.get("seed", 0), req.get("sector"))
        if cmd in ("fail", "hold"):
            return {"rule": self._rules.add(cmd, str(req.get("op")), str(req.get("path_glob", "*")),
                                            int(req.get("nth", 1)), int(req.get("errno", errno.EIO)))}
        if cmd == "wait_held":
            return self._rules.wait_held(float(req.get("timeout", 60.0)), int(req.get("count", 1)))
        if cmd == "release":
            named = req.get("rule")
            return {"released": self._rules.release(None if named is None else int(named))}
        if cmd == "cancel":
            named = req.get("rule")
            return {"cancelled": self._rules.cancel(None if named is None else int(named))}
        if cmd == "clear":
            return {"released": self._rules.clear()}
        if cmd == "sync":
            with self._lock:
                self._model.sync_all()
            return {}
        if cmd == "stats":
            return self.stats()
        if cmd == "unsynced":
            with self._lock:
                return self._model.unsynced()
        if cmd == "check":
            return self.check()
        if cmd == "unmount":
            self._unmount()
            return {"unmounted": True}
        raise ValueError(f"unknown command {cmd!r}")

    def cut(self, mode: str, seed: Any, sector: Any) -> dict[str, Any]:
        """The power cut (module docstring). Returns what the crash state kept."""
        if mode not in crash_modes():
            raise ValueError(f"unknown power-cut mode {mode!r}: one of {', '.join(crash_modes())}")
        with self._lock:
            self._rules.cut()
            unsynced_bytes = self._model.unsynced_bytes()
            unsynced_ops = self._model.unsynced_ops()
            state = self._model.crash(mode, seed, sector=None if sector is None else int(sector))
            live = self._model.visible_paths()
            diverged = self._model.diverged()
            for h in self._handles.values():
                try:
                    os.close(h.fd)
                except OSError:
                    pass
            self._handles.clear()
            report = rebuild(self._backing, state, live=live, diverged=diverged)
            self._model = PersistenceModel.from_state(state, self._root_attrs)
            self._cuts += 1
        torn = state.torn
        return {
            "mode": state.mode, "seed": seed, "description": state.description,
            "kept": len(state.kept), "dropped": len(state.dropped), "unsynced_ops": unsynced_ops,
            "unsynced_bytes": unsynced_bytes, "files": len(state.files), "dirs": len(state.dirs),
            "torn": None if torn is None else {"path": torn.path, "offset": torn.offset, "length": torn.length,
                                               "kept": torn.kept, "sector": torn.sector},
            "written": report.written, "removed": report.removed, "fingerprint": state.fingerprint(),
        }

    def stats(self) -> dict[str, Any]:
        """Counters (operations by kind, fsyncs, cuts, faults), what is unsynced now."""
        with self._lock:
            unsynced_bytes = self._model.unsynced_bytes()
            unsynced_ops = self._model.unsynced_ops()
            handles = len(self._handles)
            fsyncs = dict(self._fsyncs)
        return {
            **self._rules.snapshot(), "fsyncs": fsyncs.get("fsync", 0), "fdatasyncs": fsyncs.get("fdatasync", 0),
            "dir_fsyncs": fsyncs.get("fsyncdir", 0), "unsynced_bytes": unsynced_bytes,
            "unsynced_ops": unsynced_ops, "cuts": self._cuts, "open_handles": handles,
            "internal_errors": list(self._internal), "model_errors": list(self._model_errors),
        }

    def check(self) -> list[str]:
        """Differences between the backing directory and the model's visible state (files
        whose data a failed fsync lost are not compared); empty when they agree."""
        with self._lock:
            state = self._model.visible_state()
            lost = self._model.lost_writes()
            problems = list(self._model_errors) + [f"internal error: {t.splitlines()[0]}" for t in self._internal]
            seen: set[str] = set()
            for dirpath, dirnames, filenames in os.walk(self._backing):
                rel = os.path.relpath(dirpath, self._backing)
                prefix = "" if rel == "." else rel + "/"
                for name in dirnames:
                    seen.add(prefix + name)
                    if prefix + name not in state.dirs:
                        problems.append(f"directory {prefix + name} exists, not in the model")
                for name in filenames:
                    path = prefix + name
                    seen.add(path)
                    if path not in state.files:
                        problems.append(f"file {path} exists, not in the model")
                        continue
                    if state.inodes[path] in lost:
                        continue
                    with open(os.path.join(dirpath, name), "rb") as f:
                        data = f.read()
                    if data != state.files[path]:
                        problems.append(f"file {path}: {len(data)} bytes on disk, the model has "
                                        f"{len(state.files[path])}, and they differ")
            problems += [f"{p} is in the model, missing on disk" for p in [*state.dirs, *state.files] if p not in seen]
        return problems

    # -- shutting down ------------------------------------------------------------------------------
    def _unmount(self) -> None:
        if self._unmounted:
            return
        self._unmounted = True
        self._rules.stop()
        for cmd in (["fusermount3", "-u", "-z", self._mountpoint], ["umount", "-l", self._mountpoint]):
            try:
                done = subprocess.run(cmd, capture_output=True, timeout=60, check=False)
            except (OSError, subprocess.TimeoutExpired):
                continue
            if done.returncode == 0:
                return

    def shutdown(self) -> None:
        """Unmount (lazily: a descriptor still open must not keep the mount) and end the
        process; the kernel aborts the connection when ``/dev/fuse`` closes."""
        self._unmount()
        try:
            os.rmdir(self._mountpoint)  # empty once unmounted; the owner may be gone
        except OSError:
            pass
        try:
            self._control.close()
        finally:
            logging.shutdown()
            os._exit(0)


def main(argv: list[str] | None = None) -> int:
    """Mount the power-cut file system (``python -m botmesh_testkit.crash.fs.fuse_server``)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--backing", required=True)
    parser.add_argument("--mountpoint", required=True)
    parser.add_argument("--control-fd", type=int, required=True)
    parser.add_argument("--debug", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.debug else logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    os.umask(0)  # the kernel applied the caller's umask already
    control = socket.socket(fileno=args.control_fd)
    try:
        server = PowerCutServer(args.backing, args.mountpoint, control)
    except Exception as exc:  # noqa: BLE001 - reported to the client, which raises it
        control.sendall((json.dumps({"event": "error", "error": f"loading {args.backing}: {exc!r}"}) + "\n").encode())
        return 2
    threading.Thread(target=server.serve_control, name="powercut-control", daemon=True).start()
    try:
        import mfusepy

        root = os.geteuid() == 0
        options: dict[str, Any] = {"fsname": FSNAME, "subtype": SUBTYPE}
        if root:
            options.update(allow_other=True, default_permissions=True)
        mfusepy.FUSE(server, args.mountpoint, foreground=True, **options)
    except BaseException as exc:  # noqa: BLE001 - reported to the client, which raises it
        server.send({"event": "error", "error": f"mount failed: {exc!r}"})
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
