"""What every deltaq command shares: the settings flags, one settings object, one-line errors,
and a progress line for long one-shot runs.

``deltaq <command>`` (deltaq/cli.py) and ``spark-submit jobs/<job>.py`` both build their
parser from the same ``add_arguments`` of each job, so the flags and ``--help`` agree.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

from queue_engine.settings import Settings, load_settings
from queue_engine.store.storage import check_store, export_storage_options

# Read the whole resolved settings as JSON from standard input (how ``deltaq up`` hands its
# settings to the jobs process: one object, nothing through files or the environment).
SETTINGS_FROM_STDIN = "-"


def add_settings_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--warehouse",
        help="where the tables live: a local path or an s3:// abfss:// gs:// URL "
        "(default: the settings' warehouse, deltaq-data)",
    )
    parser.add_argument(
        "--config",
        metavar="FILE",
        help="a TOML file of settings (conf/default.toml lists them all); "
        "DELTAQ_* environment variables override it, flags override both",
    )


def settings_of(args: argparse.Namespace, **overrides: Any) -> Settings:
    """The one settings object of this process: from the file and the environment, with the
    flags given on top; ``--config -`` reads a resolved object as JSON from stdin. The
    warehouse's store is configured and checked here, before any command touches it."""
    given = {"warehouse": getattr(args, "warehouse", None), **overrides}
    if getattr(args, "config", None) == SETTINGS_FROM_STDIN:
        base = Settings.model_validate_json(sys.stdin.read())
        settings = base.model_copy(update={k: v for k, v in given.items() if v is not None})
    else:
        settings = load_settings(getattr(args, "config", None), **given)
    export_storage_options(settings.storage_options)
    check_store(settings.warehouse)
    return settings


def standalone_main(
    name: str,
    description: str | None,
    add_arguments: Callable[[argparse.ArgumentParser], None],
    run: Callable[[argparse.Namespace, Settings], int],
    argv: list[str] | None,
    *,
    log_level: int = logging.INFO,
) -> int:
    """``main`` of a job file run on its own (``spark-submit jobs/<name>.py``): the same flags
    and help as ``deltaq <name>``."""
    parser = argparse.ArgumentParser(
        prog=f"deltaq {name}",
        description=description,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_settings_arguments(parser)
    add_arguments(parser)
    args = parser.parse_args(argv)
    configure_logging(log_level)
    return run_reporting_errors(name, lambda: run(args, settings_of(args)))


def settings_json(settings: Settings) -> str:
    return json.dumps(settings.model_dump(mode="json"))


def configure_logging(level: int = logging.INFO) -> None:
    logging.basicConfig(
        level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    # py4j logs every gateway connection at INFO: noise for a user of the jobs.
    logging.getLogger("py4j").setLevel(logging.WARNING)


# The exit code of a Spark command that found no usable Java: deltaq up does not restart it.
JAVA_UNAVAILABLE = 4


class CommandError(Exception):
    """A command cannot do what it was asked; the message is the whole explanation."""


def run_reporting_errors(command: str, run: Callable[[], int]) -> int:
    """``run()``, with every failure a user can act on printed as one line (exit 1; no usable
    Java: JAVA_UNAVAILABLE)."""
    from queue_engine.spark.java import JavaUnavailableError

    try:
        return run()
    except KeyboardInterrupt:
        return 130
    except Exception as exc:
        if not _user_facing(exc):
            raise
        print(f"deltaq {command}: error: {one_line(exc)}", file=sys.stderr)
        return JAVA_UNAVAILABLE if isinstance(exc, JavaUnavailableError) else 1


def _user_facing(exc: BaseException) -> bool:
    from pydantic import ValidationError

    from queue_engine.auth import AuthConfigError
    from queue_engine.errors import QueueError
    from queue_engine.ports import PortInUseError
    from queue_engine.spark.java import JavaUnavailableError
    from queue_engine.store.coordination import WarehouseBusyError
    from queue_engine.store.storage import StoreError

    user_errors = (
        CommandError,
        QueueError,
        ValidationError,
        OSError,
        AuthConfigError,
        PortInUseError,
        JavaUnavailableError,
    )
    if isinstance(exc, (*user_errors, WarehouseBusyError, StoreError)):
        return True
    # Spark's errors (AnalysisException, ParseException, ...) carry a readable first line;
    # pyspark is imported only by the jobs that use it.
    return type(exc).__module__.startswith("pyspark.errors")


def one_line(exc: BaseException) -> str:
    from pydantic import ValidationError

    if isinstance(exc, ValidationError):
        # Its first line only counts the errors: say what each one is.
        return "; ".join(
            ".".join(str(part) for part in error["loc"]) + ": " + error["msg"]
            if error["loc"]
            else error["msg"].removeprefix("Value error, ")
            for error in exc.errors()
        )
    text = str(exc).strip()
    first = text.splitlines()[0] if text else type(exc).__name__
    return first.strip()


class Progress:
    """One progress line on stderr: rewritten in place on a terminal, else a line every few
    seconds (and the last one), so logs of cron runs stay short."""

    def __init__(self, stream: TextIO | None = None, every_s: float = 5.0) -> None:
        self._stream = stream or sys.stderr
        self._tty = self._stream.isatty()
        self._every_s = every_s
        self._last = 0.0
        self._pending = ""

    def __call__(self, text: str) -> None:
        now = time.monotonic()
        if self._tty:
            self._stream.write(f"\r\x1b[K{text}")
            self._stream.flush()
            return
        self._pending = text
        if now - self._last >= self._every_s:
            self._flush()
            self._last = now

    def done(self, text: str) -> None:
        if self._tty:
            self._stream.write(f"\r\x1b[K{text}\n")
        else:
            self._pending = text
            self._flush()
        self._stream.flush()

    def _flush(self) -> None:
        if self._pending:
            self._stream.write(self._pending + "\n")
            self._pending = ""
