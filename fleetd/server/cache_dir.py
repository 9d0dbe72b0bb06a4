"""The cache directory of SET_TENSOR's cache flag and SET_TENSOR_HASH.

Files are named `%016x` of the FNV-1a 64 of their content, exactly as the stock rpc-server names
them and the stock client computes the hash: SET_TENSOR_HASH sends only that hash, so the name
is the only key there is and it carries nothing else.

    store   written to a temp file, hashed as written, fsync'd, renamed to its name, the
            directory fsync'd: after a crash a name holds its whole content or is absent
    size    the size a file had when stored, in the xattr user.fleetd.size (the name cannot
            hold it). A hit whose file is shorter or longer than its record (cut by a crash of
            the file system, by hand, by another program) is a miss and is removed. A file
            without a record (a stock server's, an older fleetd's, a file system without user
            xattrs) is re-hashed before its first hit and, when it matches, given one; where
            xattrs cannot be written, each hit re-hashes (one warning at start).
            Chosen over re-hashing every hit (a second pass over gigabytes per model load, at
            ~1 GB/s for the C hash) and over a size suffix in the name (names must stay the
            stock ones).
    budget  at most max_bytes of files; the oldest by mtime go first (a hit touches its file),
            never the file just stored. A file larger than the budget is not stored.

Several fleetd sharing one directory each keep their own budget over the whole directory.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import threading
import time
from pathlib import Path
from typing import BinaryIO

from fleetd.compute.native import fnv1a_64, native_available
from fleetd.wire.hashing import FNV_OFFSET, cache_file_name

log = logging.getLogger("fleetd.cache")

HASH_CHUNK = 1 << 20  # cache-sized reads: the file's pages are not mapped into the daemon
SIZE_XATTR = "user.fleetd.size"
# The default budget: this share of what the file system holds free plus what the cache holds,
# at start (so a restart does not shrink it by the cache's own files).
DEFAULT_SHARE = 0.5
# Temp files older than this are a crashed store's (a live one is seconds old): removed at start.
STALE_TEMP_S = 3600.0
_NAME = re.compile(r"^[0-9a-f]{16}$")
_TEMP_PREFIX = ".store."


def file_fnv1a_64(f) -> int:
    """FNV-1a of an open file, read from its start in chunks."""
    chunk = memoryview(bytearray(HASH_CHUNK))
    h = FNV_OFFSET
    f.seek(0)
    while n := f.readinto(chunk):
        h = fnv1a_64(chunk[:n], h)
    return h


def parse_budget(raw, free: int) -> int:
    """`cache_max_bytes`: None (DEFAULT_SHARE x `free`), a share like "0.5x", or a size (64G)."""
    from fleetd.server.config import parse_size

    if raw is None:
        return int(free * DEFAULT_SHARE)
    text = str(raw).strip()
    try:
        value = int(free * float(text[:-1])) if text.lower().endswith("x") else parse_size(raw)
    except (TypeError, ValueError):
        raise ValueError(f"cache_max_bytes {raw!r}: a size (64G) or a share of free space (0.5x)") from None
    if value <= 0:
        raise ValueError(f"cache_max_bytes {raw!r}: must be above 0")
    return value


class CacheDir:
    """The cache directory of one daemon: its files by name and size, stored, looked up and evicted
    within `max_bytes` (see the module docstring)."""

    def __init__(self, path: Path, max_bytes=None) -> None:
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        native_available()  # loads the C FNV-1a now, or warns now that it is missing
        self._lock = threading.Lock()
        self._files: dict[str, list] = {}  # name -> [size, mtime]
        self.held = 0
        self._scan()
        st = os.statvfs(self.path)
        self.max_bytes = parse_budget(max_bytes, st.f_bavail * st.f_frsize + self.held)
        self.xattrs = self._xattrs_work()
        if not self.xattrs:
            log.warning(
                "cache directory %s: no user xattrs here, so each hit re-hashes its file "
                "to check it is whole",
                self.path,
            )
        log.info(
            "cache directory %s: %d files, %d of %d bytes",
            self.path,
            len(self._files),
            self.held,
            self.max_bytes,
        )
        self._evict(keep=None)

    # -- start ------------------------------------------------------------------------------

    def _scan(self) -> None:
        now = time.time()
        for entry in os.scandir(self.path):
            try:
                st = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            if entry.name.startswith(_TEMP_PREFIX) and now - st.st_mtime > STALE_TEMP_S:
                Path(entry.path).unlink(missing_ok=True)
            elif _NAME.match(entry.name) and entry.is_file(follow_symlinks=False):
                self._files[entry.name] = [st.st_size, st.st_mtime]
                self.held += st.st_size

    def _xattrs_work(self) -> bool:
        probe = self.path / f"{_TEMP_PREFIX}probe.{os.getpid()}"
        try:
            fd = os.open(probe, os.O_CREAT | os.O_WRONLY, 0o600)
            try:
                os.setxattr(fd, SIZE_XATTR, b"0")
                return True
            finally:
                os.close(fd)
                probe.unlink(missing_ok=True)
        except OSError:
            return False

    # -- store ------------------------------------------------------------------------------

    def store(self, data) -> None:
        """Write `data` (a view of the buffer it landed in) as <dir>/<fnv1a %016x>.

        The hash is taken of the file as written, not of the buffer: another session may write
        into a shared buffer meanwhile, and a name that is not its file's hash would hand a
        later SET_TENSOR_HASH other bytes than the client's. A failed write costs only the
        cache entry: the data is in its buffer already."""
        view = memoryview(data).cast("B")
        size = view.nbytes
        if size > self.max_bytes:
            log.warning(
                "cache directory: %d bytes not stored: above the budget of %d (cache_max_bytes)",
                size,
                self.max_bytes,
            )
            return
        tmp = self.path / f"{_TEMP_PREFIX}{os.getpid()}.{threading.get_ident()}"
        try:
            with open(tmp, "w+b", buffering=0) as f:
                done = 0
                while done < size:  # one write() moves at most ~2 GiB
                    done += f.write(view[done:])
                h = file_fnv1a_64(f)
                if self.xattrs:
                    os.setxattr(f.fileno(), SIZE_XATTR, str(size).encode())
                os.fsync(f.fileno())  # the content is on disk before any name points at it
            name = cache_file_name(h)
            os.replace(tmp, self.path / name)  # no reader sees half a file
            self._fsync_dir()  # and the name is on disk before SET_TENSOR answers
        except OSError as exc:
            log.warning("cache directory: %d bytes not stored: %s", size, exc)
            tmp.unlink(missing_ok=True)
            return
        with self._lock:
            old = self._files.get(name)
            self.held += size - (old[0] if old else 0)
            self._files[name] = [size, time.time()]
        self._evict(keep=name)

    def _fsync_dir(self) -> None:
        fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def _evict(self, keep: str | None) -> None:
        """Oldest first (by mtime) until the files fit the budget; never `keep`."""
        while True:
            with self._lock:
                if self.held <= self.max_bytes:
                    return
                victims = [(m, n) for n, (_, m) in self._files.items() if n != keep]
                if not victims:
                    return
                _, name = min(victims)
                size, _ = self._files.pop(name)
                self.held -= size
            try:
                (self.path / name).unlink()
            except FileNotFoundError:
                pass
            except OSError as exc:
                log.warning("cache directory: %s not evicted: %s", name, exc)
            log.debug("cache directory: evicted %s (%d bytes)", name, size)

    # -- hit --------------------------------------------------------------------------------

    def open(self, h: int) -> BinaryIO | None:
        """The cache file of hash `h`, open unbuffered (the caller reads it straight into the
        tensor's buffer), or None. Files are replaced whole, so an open one does not change;
        one that is not whole (see the module's docstring) is a miss and is removed."""
        name = cache_file_name(h)
        try:
            f = open(self.path / name, "rb", buffering=0)
        except OSError:
            return None
        try:
            why = self._not_whole(f, h)
            if why is not None:
                log.warning("cache directory: %s %s: a miss, removed", name, why)
                self._forget(name, os.fstat(f.fileno()).st_ino)
                f.close()
                return None
            now = time.time()
            try:
                os.utime(f.fileno(), (now, now))  # a hit is young again (eviction is by mtime)
            except OSError:
                pass
            st = os.fstat(f.fileno())
            with self._lock:
                old = self._files.get(name)
                self.held += st.st_size - (old[0] if old else 0)
                self._files[name] = [st.st_size, now]
            f.seek(0)
            return f
        except OSError:
            f.close()
            return None

    def _not_whole(self, f, h: int) -> str | None:
        size = os.fstat(f.fileno()).st_size
        try:
            recorded = int(os.getxattr(f.fileno(), SIZE_XATTR))
        except OSError as exc:
            if exc.errno not in (errno.ENODATA, errno.ENOTSUP, errno.EOPNOTSUPP):
                raise
            recorded = None
        except ValueError:
            return "has an unreadable size record"
        if recorded is not None:
            return None if recorded == size else f"is {size} bytes, stored as {recorded}"
        # No record: not stored by this fleetd. Its hash says whether it is whole.
        if file_fnv1a_64(f) != h:
            return f"({size} bytes, no size record) does not hash to its name"
        if self.xattrs:
            try:
                os.setxattr(f.fileno(), SIZE_XATTR, str(size).encode())
            except OSError:
                pass
        return None

    def _forget(self, name: str, ino: int) -> None:
        path = self.path / name
        try:
            if os.stat(path).st_ino == ino:  # not a whole file renamed in meanwhile
                path.unlink()
        except OSError:
            pass
        with self._lock:
            old = self._files.pop(name, None)
            if old:
                self.held -= old[0]
