"""A disk that forgets every byte not fsync'd, on command: ``../shared/tools/powercut`` (a FUSE
file system on mfusepy and Debian's fuse3) mounted over a directory of the test's."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from tests.conftest import ROOT

POWERCUT = ROOT.parent / "shared" / "tools" / "powercut"


def missing() -> str | None:
    """Why power-cut tests cannot run here (None: they can)."""
    if not (POWERCUT / "mount").exists():
        return f"no power-cut file system at {POWERCUT} (../shared is absent)"
    if not os.path.exists("/dev/fuse"):
        return "no /dev/fuse on this machine"
    if shutil.which("fusermount3") is None:
        return "fuse3 is not installed (Debian: apt-get install fuse3)"
    if importlib.util.find_spec("mfusepy") is None:
        return "the mfusepy package is not installed"
    return None


class PowerCutDisk:
    """The mount point ``mnt`` over ``backing``: what is synced lands in ``backing``."""

    def __init__(self, root: Path) -> None:
        self.backing = root / "disk"
        self.mnt = root / "mnt"
        self.log = root / "mnt.log"
        self.ctl = root / "mnt.ctl"
        self.cuts = 0

    def mount(self) -> PowerCutDisk:
        env = {**os.environ, "POWERCUT_PYTHON": sys.executable}
        subprocess.run(
            [str(POWERCUT / "mount"), str(self.backing), str(self.mnt)],
            check=True,
            env=env,
            capture_output=True,
            timeout=30,
        )
        return self

    def unmount(self) -> None:
        for _ in range(50):
            done = subprocess.run(
                ["fusermount3", "-u", str(self.mnt)], capture_output=True, check=False
            )
            if done.returncode == 0 or not self.mounted():
                break
            time.sleep(0.1)
        else:
            subprocess.run(["fusermount3", "-uz", str(self.mnt)], check=False)
        # The file system's own process ends once unmounted.
        deadline = time.monotonic() + 10
        while self.mounted() and time.monotonic() < deadline:
            time.sleep(0.05)

    def mounted(self) -> bool:
        with open("/proc/mounts") as f:
            return any(line.split()[1] == str(self.mnt) for line in f)

    def cut(self, *pids: int) -> None:
        """A power cut under the processes ``pids`` and their children: all frozen at one
        instant, the unsynced bytes dropped, then killed; the disk comes back as a machine's
        disk does after the power returns (mounted again, holding only what was synced)."""
        victims = _tree(pids)
        for p in victims:
            _signal(p, signal.SIGSTOP)
        self.cuts += 1
        with open(self.ctl, "w") as f:
            f.write("cut\n")
        deadline = time.monotonic() + 30
        while self.log.read_text(errors="replace").count(" cut done ") < self.cuts:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the power cut did not happen: {self.log.read_text()}")
            time.sleep(0.02)
        for p in victims:
            _signal(p, signal.SIGKILL)
        psutil.wait_procs(victims, timeout=10)
        self.unmount()
        self.mount()


def _tree(pids: tuple[int, ...]) -> list[psutil.Process]:
    found: list[psutil.Process] = []
    for pid in pids:
        try:
            parent = psutil.Process(pid)
        except psutil.NoSuchProcess:
            continue
        found.append(parent)
        found.extend(parent.children(recursive=True))
    return found


def _signal(p: psutil.Process, sig: signal.Signals) -> None:
    with contextlib.suppress(psutil.NoSuchProcess):
        p.send_signal(sig)
