"""Files written whole or not at all: what a driver killed mid-write, or a machine that loses
power, leaves is the old version or none, never a torn one. No torch here: the web service uses it
too."""

from __future__ import annotations

import os
import shutil
import time
import uuid
from pathlib import Path


def replace_folder(new: Path, folder: Path) -> None:
    """``new`` becomes ``folder``; an old folder there is moved aside first (and put back if the
    second rename fails), then removed. Readers that find no folder for that moment see no
    artifact, never a mixed one; one that opened a file of the old folder reads it whole."""
    old = None
    if folder.exists():
        old = folder.with_name(f".{folder.name}.old-{uuid.uuid4().hex[:8]}")
        folder.rename(old)
    try:
        new.rename(folder)
    except BaseException:
        if old is not None:
            old.rename(folder)
        raise
    fsync_dir(folder.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` whole or not at all, on disk when this returns: a temporary
    file beside it, synced, renamed over it. A driver killed while writing leaves the old file
    (or none), never a torn one."""
    path = Path(path)
    partial = path.with_name(f".{path.name}.partial-{uuid.uuid4().hex[:8]}")
    try:
        with partial.open("w", encoding="utf-8") as out:
            out.write(text)
            out.flush()
            os.fsync(out.fileno())
        os.replace(partial, path)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


STALE_S = 3600.0
"""A writer's leftovers (``.<name>.partial-*``, ``.<name>.old-*``) older than this are from one
that died (a killed driver, a full disk): the next write of that folder removes them."""


def sweep_leftovers(folder: Path) -> None:
    """Remove what writers of ``folder`` that died left beside it (see ``STALE_S``)."""
    if not folder.parent.is_dir():
        return
    now = time.time()
    for pattern in (f".{folder.name}.partial-*", f".{folder.name}.old-*"):
        for leftover in folder.parent.glob(pattern):
            try:
                if now - leftover.stat().st_mtime > STALE_S:
                    shutil.rmtree(leftover, ignore_errors=True)
            except OSError:
                continue
