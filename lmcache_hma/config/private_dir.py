"""A directory only this user can use: created with mode 0700, refused when it is not private.

The disk tier's directory and the lookup socket's directory both live at paths other users
can predict (often under /tmp). Whoever else can write there could plant files for us to
read or a socket for us to talk to; whoever can enter the socket's directory can ask for
resets and holds. ``ensure_private_dir`` creates the directory, or checks the one it finds,
and raises ``ConfigError`` saying what is wrong and what to do.
"""

from __future__ import annotations

import os
import stat
from typing import Optional

from lmcache_hma.config.errors import ConfigError

WORLD_WRITABLE = 0o002  # the disk tier refuses only this: a shared group may be deliberate
OPEN_TO_OTHERS = 0o077  # the lookup socket's directory refuses any access but the owner's


def ensure_private_dir(path: str, what: str, refused_bits: int, hint: str, follow_symlinks: bool = True) -> None:
    """Create ``path`` with mode 0700, or refuse the directory found there if another user
    owns it or its mode has any of ``refused_bits``.

    ``follow_symlinks=False`` refuses a symlink at ``path`` itself: one in a shared directory
    such as /tmp may belong to another user, who can point it elsewhere after the check.
    ``what`` names the directory and ``hint`` says what to do, in the error.
    """
    try:
        os.makedirs(path, mode=0o700)
        # exactly 0700: the umask only removes bits, but it may remove the owner's own
        os.chmod(path, 0o700)
        return
    except FileExistsError:  # already there (or created at this moment by our other process): check it
        pass
    except OSError as exc:  # a part of the path is a file, no permission, read-only file system, ...
        raise ConfigError(f"{what} {path!r} cannot be created: {_why_not_created(path, exc)}; {hint}") from None
    problem = dir_problem(path, refused_bits, follow_symlinks)
    if problem:
        raise ConfigError(f"{what} {path!r} is {problem}; {hint}")


def dir_problem(path: str, refused_bits: int, follow_symlinks: bool = True) -> Optional[str]:
    """Why the directory at ``path`` is refused (``ensure_private_dir``'s rules), None when it is
    not; a path that is not there yet: why it could not be created, None when it could."""
    try:
        st = os.stat(path, follow_symlinks=follow_symlinks)
    except FileNotFoundError:
        why = _why_not_creatable(path)
        return f"not creatable: {why}" if why else None
    except OSError as exc:  # e.g. a part of the path is a file
        return f"not creatable: {_why_not_created(path, exc)}"
    if not stat.S_ISDIR(st.st_mode):
        return "a symbolic link" if stat.S_ISLNK(st.st_mode) else "not a directory (a file is there)"
    if st.st_uid != os.getuid():
        return f"owned by another user (uid {st.st_uid})"
    if st.st_mode & refused_bits & WORLD_WRITABLE:
        return "writable by every user"
    if st.st_mode & refused_bits:
        return f"open to other users (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


def _why_not_creatable(path: str) -> Optional[str]:
    """None when ``path`` (not there) could be created: its nearest existing parent is a
    directory this user can write; else why not."""
    parent = os.path.dirname(os.path.abspath(path).rstrip(os.sep)) or os.sep
    while not os.path.lexists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        return f"{parent!r} is not a directory"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"this user cannot write in {parent!r}"
    return None


def _why_not_created(path: str, exc: OSError) -> str:
    if isinstance(exc, NotADirectoryError):
        return _why_not_creatable(path) or "a part of its path is a file, not a directory"
    return exc.strerror or str(exc)
