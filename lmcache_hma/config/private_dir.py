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
    st = os.stat(path, follow_symlinks=follow_symlinks)
    if not stat.S_ISDIR(st.st_mode):
        problem = "a symbolic link" if stat.S_ISLNK(st.st_mode) else "not a directory"
    elif st.st_uid != os.getuid():
        problem = f"owned by another user (uid {st.st_uid})"
    elif st.st_mode & refused_bits & WORLD_WRITABLE:
        problem = "writable by every user"
    elif st.st_mode & refused_bits:
        problem = f"open to other users (mode {stat.S_IMODE(st.st_mode):04o})"
    else:
        return
    raise ConfigError(f"{what} {path!r} is {problem}; {hint}")
