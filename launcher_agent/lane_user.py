"""The user lanes run as (`lanes agent --lane-user`), when it is not the agent's own.

An agent started as root (a container's, or a unit an operator runs so) hands each llama-server
to an unprivileged user: the kernel then clears every capability at the switch, and the lane
cannot read the agent's `/proc/<pid>/environ` (another user's), its credentials file (not that
user's group) nor the key files of the agent (0600, the agent's). Its own key file and the
saved-slots folder are given to that user, since llama-server reads the one and writes the other.
What this does not give: lanes of one host share the user, so one lane could read another's
key file or saved slots (docs/security.md).
"""

from __future__ import annotations

import grp
import os
import pwd
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class LaneUser:
    name: str
    uid: int
    gid: int
    groups: tuple[int, ...]  # its supplementary groups (GPU devices: video, render)

    def spawn_args(self) -> dict:
        """What subprocess/asyncio take to start a child as this user."""
        return {"user": self.uid, "group": self.gid, "extra_groups": list(self.groups)}

    def give(self, path: Path) -> None:
        """Hand a file or folder the lane must read or write to this user (the agent keeps root's reach)."""
        os.chown(path, self.uid, self.gid)

    def blocked_at(self, path: Path) -> Path | None:
        """The first folder on the way to `path` this user may not pass through (its key file and
        the models lie below), or None. `path` itself and what is below it are not looked at:
        the agent makes those passable (may_pass)."""
        for folder in reversed(path.resolve().parents):
            try:
                st = os.stat(folder)
            except FileNotFoundError:
                return None  # the agent makes the rest (0755)
            if st.st_uid == self.uid:
                allowed = st.st_mode & 0o100
            elif st.st_gid == self.gid or st.st_gid in self.groups:
                allowed = st.st_mode & 0o010
            else:
                allowed = st.st_mode & 0o001
            if not allowed:
                return folder
        return None

    def may_pass(self, *folders: Path) -> None:
        """Let it pass through these folders, not list them (0711), to reach its key file there."""
        for folder in folders:
            folder.mkdir(parents=True, exist_ok=True)
            os.chmod(folder, 0o711)


def lane_user(name: str | None) -> LaneUser | None:
    """The named user, or None for the agent's own; ValueError says why it cannot be used."""
    if not name:
        return None
    try:
        entry = pwd.getpwnam(name)
    except KeyError:
        raise ValueError(f"no user {name!r} on this host (deploy/systemd/install creates lanes-lane)") from None
    if entry.pw_uid == 0:
        raise ValueError(f"--lane-user {name} is root: lanes would run with every privilege")
    if os.geteuid() != 0 and entry.pw_uid != os.geteuid():
        raise ValueError(f"--lane-user {name}: only an agent running as root can start lanes as another user")
    groups = tuple(g.gr_gid for g in grp.getgrall() if name in g.gr_mem and g.gr_gid != entry.pw_gid)
    return LaneUser(name, entry.pw_uid, entry.pw_gid, groups)
