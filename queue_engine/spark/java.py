"""The Java that Spark's JVM runs on, checked before Spark starts: without it Spark's own error
is a Java gateway that "exited before sending its port number", which names neither Java nor
what to install."""

from __future__ import annotations

import os
import re
import shutil
import subprocess

# Spark 4 runs on Java 17 and 21.
REQUIRED = 17
INSTALL = (
    "install Java 17 or 21 (Debian/Ubuntu: apt install openjdk-17-jre-headless; macOS: "
    "brew install openjdk@17) and put its java on PATH, or set JAVA_HOME to its directory"
)


class JavaUnavailableError(RuntimeError):
    """Spark cannot start here: no java, or one too old (the message says what to do)."""


def java_executable() -> tuple[str | None, str]:
    """The java Spark would start (as spark-submit finds it: JAVA_HOME first, then PATH) and
    where it was looked for."""
    home = os.environ.get("JAVA_HOME")
    if home:
        path = os.path.join(home, "bin", "java")
        return (path if os.access(path, os.X_OK) else None), f"JAVA_HOME={home}"
    return shutil.which("java"), "PATH"


def major_version(version_output: str) -> int | None:
    """The major version in ``java -version``'s output: "17.0.15" -> 17, "1.8.0_402" -> 8."""
    match = re.search(r'version "(\d+)(?:\.(\d+))?', version_output)
    if match is None:
        return None
    first = int(match.group(1))
    return int(match.group(2) or 0) if first == 1 else first


def check_java() -> None:
    """Raise JavaUnavailableError unless a java of at least REQUIRED is where Spark looks."""
    path, where = java_executable()
    if path is None:
        raise JavaUnavailableError(
            f"Spark needs Java {REQUIRED} or later, and found no java ({where}): {INSTALL}"
        )
    release = os.path.join(os.path.dirname(os.path.dirname(os.path.realpath(path))), "release")
    try:
        # A JDK's own record of its version: no JVM started to ask it (java -version is one).
        with open(release) as f:
            output = f.read()
    except OSError:
        output = _version_output(path)
    major = major_version(output.replace("JAVA_VERSION=", "version "))
    if major is None or major < REQUIRED:
        found = f"Java {major}" if major is not None else "no Java version it could tell"
        raise JavaUnavailableError(
            f"Spark needs Java {REQUIRED} or later; {path} ({where}) is {found}: {INSTALL}"
        )


def _version_output(path: str) -> str:
    try:
        done = subprocess.run(
            [path, "-version"], capture_output=True, text=True, timeout=30, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise JavaUnavailableError(
            f"Spark needs Java {REQUIRED} or later; {path} did not run ({exc}): {INSTALL}"
        ) from exc
    return done.stderr + done.stdout
