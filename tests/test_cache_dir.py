"""The cache directory (fleetd.server.cache_dir): stores are durable before they are named, a file
that is not whole is a miss, and the byte budget evicts the oldest files first."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import REPO

from fleetd.server.cache_dir import SIZE_XATTR, CacheDir, parse_budget
from fleetd.wire import fnv1a_64


def name_of(data: bytes) -> str:
    return f"{fnv1a_64(data):016x}"


def blob(seed: int, n: int = 1000) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


def files(d: Path) -> set[str]:
    return {p.name for p in d.iterdir() if not p.name.startswith(".")}


@pytest.mark.skipif(shutil.which("strace") is None, reason="strace not installed")
def test_store_fsyncs_the_file_before_the_rename_and_the_directory_after(tmp_path):
    cache = tmp_path / "cache"
    script = (
        f"from fleetd.server.cache_dir import CacheDir\nCacheDir({str(cache)!r}, '1G').store(b'x' * 5000)\n"
    )
    trace = tmp_path / "trace"
    subprocess.run(
        [
            "strace",
            "-f",
            "-qq",
            "-o",
            str(trace),
            "-e",
            "trace=openat,fsync,fdatasync,rename,renameat,renameat2",
            sys.executable,
            "-c",
            script,
        ],
        check=True,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
        timeout=120,
    )
    calls = [line.split(None, 1)[1] for line in trace.read_text().splitlines() if " " in line]
    name = name_of(b"x" * 5000)
    (tmp_fd,) = {
        m.group(1) for c in calls if (m := re.search(r'openat\(.*/\.store\.[0-9.]+", .*\) = (\d+)', c))
    }
    i_rename = next(i for i, c in enumerate(calls) if c.startswith("rename") and name in c)
    i_file_sync = next(i for i, c in enumerate(calls) if c.startswith(f"fsync({tmp_fd})"))
    dir_opens = [
        (i, m.group(1))
        for i, c in enumerate(calls)
        if (m := re.search(rf'openat\(AT_FDCWD, "{re.escape(str(cache))}", .*O_DIRECTORY.*\) = (\d+)', c))
    ]
    i_dir_sync = next(
        i
        for i, c in enumerate(calls)
        for j, fd in dir_opens
        if i > j > i_rename and c.startswith(f"fsync({fd})")
    )
    assert i_file_sync < i_rename < i_dir_sync, calls
    assert files(cache) == {name}


def test_a_file_that_is_not_whole_is_a_miss_and_is_removed(tmp_path, caplog):
    c = CacheDir(tmp_path / "c", "1G")
    assert c.xattrs  # ext4/tmpfs here; the test below covers a file without a record
    data = blob(1)
    c.store(data)
    path = tmp_path / "c" / name_of(data)
    assert os.getxattr(path, SIZE_XATTR) == b"1000"
    with c.open(fnv1a_64(data)) as f:
        assert f.read() == data
    # Cut short (a crash of the file system, a full disk, a hand): its record says 1000.
    os.truncate(path, 600)
    assert c.open(fnv1a_64(data)) is None
    assert not path.exists() and c.held == 0
    assert "is 600 bytes, stored as 1000: a miss, removed" in caplog.text
    # Stored empty (the stock server stores 0-byte tensors too): a hit, of nothing.
    c.store(b"")
    with c.open(fnv1a_64(b"")) as f:
        assert f.read() == b""


def test_a_file_without_a_size_record_is_checked_by_its_hash_once(tmp_path):
    d = tmp_path / "c"
    d.mkdir()
    good, bad = blob(2), blob(3)
    (d / name_of(good)).write_bytes(good)  # as a stock server (or an older fleetd) left it
    (d / name_of(bad)).write_bytes(bad[:10])  # a short one, no record
    c = CacheDir(d, "1G")
    with c.open(fnv1a_64(good)) as f:
        assert f.read() == good
    assert os.getxattr(d / name_of(good), SIZE_XATTR) == b"1000"  # checked: recorded now
    assert c.open(fnv1a_64(bad)) is None and not (d / name_of(bad)).exists()


def test_the_budget_evicts_the_oldest_files_first_and_a_hit_makes_one_young(tmp_path):
    d = tmp_path / "c"
    c = CacheDir(d, 3000)
    a, b, e, g = blob(10), blob(11), blob(12), blob(13)
    for i, data in enumerate((a, b, e)):
        c.store(data)
        t = 1_000_000 + i * 100  # explicit ages: a oldest, then b, then e
        os.utime(d / name_of(data), (t, t))
        c._files[name_of(data)][1] = t
    assert files(d) == {name_of(x) for x in (a, b, e)} and c.held == 3000
    with c.open(fnv1a_64(a)):  # a hit: a is the youngest now
        pass
    assert (d / name_of(a)).stat().st_mtime > 1_000_200
    c.store(g)  # 4000 > 3000: the oldest goes, b
    assert files(d) == {name_of(x) for x in (a, e, g)} and c.held == 3000
    c.store(blob(14, 2500))  # needs e, a and g to go: the newest file is never evicted
    assert files(d) == {name_of(blob(14, 2500))} and c.held == 2500
    c.store(blob(15, 3001))  # above the whole budget: not stored, nothing evicted for it
    assert files(d) == {name_of(blob(14, 2500))}


def test_a_directory_over_budget_at_start_is_trimmed_oldest_first(tmp_path):
    d = tmp_path / "c"
    d.mkdir()
    for i in range(4):
        data = blob(20 + i)
        (d / name_of(data)).write_bytes(data)
        os.utime(d / name_of(data), (1_000_000 + i, 1_000_000 + i))
    (d / ".store.1.2").write_bytes(b"a crashed store")
    os.utime(d / ".store.1.2", (1_000_000, 1_000_000))
    c = CacheDir(d, "2500")
    assert files(d) == {name_of(blob(22)), name_of(blob(23))} and c.held == 2000
    assert not (d / ".store.1.2").exists()


def test_budget_settings():
    assert parse_budget(None, 1000) == 500  # the default: half of what is free at start
    assert parse_budget("0.25x", 1000) == 250
    assert parse_budget("64G", 1) == 64 << 30
    for bad in ("0", "lots", "-1x"):
        with pytest.raises(ValueError, match="cache_max_bytes"):
            parse_budget(bad, 1000)
