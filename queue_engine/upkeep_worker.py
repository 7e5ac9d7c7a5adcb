"""The maintenance process: table upkeep rounds asked for by a serving process.

``python -m queue_engine.upkeep_worker``, started by ``Maintenance`` with
``in_process=False``. It reads pickled requests from stdin, one at a time, does each round
(``table_upkeep``) and writes back ``(True, done)`` or ``(False, why)``. It ends when its
stdin closes: its parent stopped it, or died (then what a round had done is committed or was
never visible: every step of upkeep is one put-if-absent commit or a deletion vacuum allows).
"""

from __future__ import annotations

import logging
import os
import pickle
import signal
import sys
from typing import BinaryIO

from queue_engine.process_memory import prepare_serving_process, tune_malloc


def serve(requests: BinaryIO, answers: BinaryIO) -> None:
    # Not at the top: the memory set-up comes before anything loads pyarrow.
    from queue_engine.store.upkeep import table_upkeep

    while True:
        try:
            request = pickle.load(requests)
        except EOFError:
            return
        try:
            answer: tuple[bool, object] = (True, table_upkeep(*request))
        except Exception as exc:  # reported to the parent, which logs it and goes on
            answer = (False, f"upkeep of {request[0]} failed: {exc!r}")
        pickle.dump(answer, answers)
        answers.flush()


def main() -> None:
    # The same allocators and left-out modules as the serving process: this one opens tables
    # and compacts them, and pandas (which pyarrow.dataset imports if it can) it never uses.
    prepare_serving_process()
    tune_malloc()
    # The parent stops this process (by closing its input); a terminal's Ctrl-C is its own.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s maintenance %(name)s: %(message)s"
    )
    # Answers go on a copy of stdout; anything a library prints goes to stderr instead.
    answers = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    serve(sys.stdin.buffer, answers)


if __name__ == "__main__":
    main()
