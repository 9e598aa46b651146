"""Writing a checkpoint directory so that an interrupted write never leaves one that loads, and
nothing the user pointed kdj at is overwritten without an explicit request.

Files are written into a temporary sibling directory (".<name>.partial-<pid>-<id>") that is
renamed onto the destination at the end; on any error, or Ctrl-C, the temporary is removed.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import uuid
from pathlib import Path


def check_destination(path, *, overwrite: bool = False, replaces=()) -> bool:
    """Raise FileExistsError unless `path` is absent or an empty directory, or `overwrite`;
    returns whether it holds files. `replaces` names the files a write would replace."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise FileExistsError(f"{path} is a file, not a directory: choose a directory to write")
    full = path.exists() and any(path.iterdir())
    if full and not overwrite:
        fix = f" or pass overwrite=True to replace its {', '.join(replaces)}" if replaces else ""
        raise FileExistsError(f"{path} exists and is not empty: write into a new directory{fix}")
    return full


@contextlib.contextmanager
def staged(path, *, overwrite: bool = False, replaces=(), last: str | None = None):
    """Yield a temporary directory to write into; on success it becomes `path`.

    An empty or absent `path` is replaced by the directory in one rename. A non-empty one
    (only with `overwrite`) keeps every file but `replaces`: those are moved in one by one
    (removed when the new write has none), `last` (the file that makes the directory load,
    e.g. config.json) removed first and moved in last, so a write cut short never loads."""
    path = Path(path).absolute()
    full = check_destination(path, overwrite=overwrite, replaces=replaces)
    tmp = path.parent / f".{path.name}.partial-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.mkdir()
    except OSError as e:
        raise _naming(e, path) from None
    try:
        try:
            yield tmp
        except OSError as e:  # the temporary's name would mean nothing to the caller
            if str(tmp) not in str(e.filename):
                raise
            raise _naming(e, path) from None
        if not full:
            if path.exists():
                path.rmdir()  # empty: the rename needs it gone
            tmp.rename(path)
            return
        order = [n for n in replaces if n != last] + ([last] if last else [])
        if last:
            (path / last).unlink(missing_ok=True)
        for name in order:
            if (tmp / name).exists():
                os.replace(tmp / name, path / name)
            else:
                (path / name).unlink(missing_ok=True)  # a stale file of the old write
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)


def _naming(error: OSError, path: Path) -> OSError:
    """`error` (about the temporary directory) as one about the directory the caller named."""
    message = f"cannot write {path}: {error.strerror or error}"
    return OSError(error.errno, message) if error.errno else OSError(message)
