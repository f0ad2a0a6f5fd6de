"""CallerWatch (statefulset.loading.watchdog): the watchdog's reports for work the caller does on its
own thread, from a guard thread armed without a wake. The work here is the caller waiting (bounded)
until the guard has reported it, so the reports always land, whatever the machine's load."""

from __future__ import annotations

import logging
import threading

import pytest

from statefulset.errors import StatefulsetError
from statefulset.loading.watchdog import CallerWatch, Watchdog


class Seen(logging.Handler):
    """The statefulset log's messages; ``wanted`` is set once ``count`` of them contain ``text``."""

    def __init__(self, text: str, count: int = 1) -> None:
        super().__init__(logging.DEBUG)
        self.text, self.count = text, count
        self.messages: list[tuple[int, str]] = []
        self.wanted = threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append((record.levelno, record.getMessage()))
        if sum(self.text in m for _, m in self.messages) >= self.count:
            self.wanted.set()


@pytest.fixture
def seen(request):
    text, count = request.param
    handler = Seen(text, count)
    log = logging.getLogger("statefulset")
    log.addHandler(handler)
    yield handler
    log.removeHandler(handler)


def _what() -> str:
    return "the test's own thread was building replica-batch 7"


@pytest.mark.parametrize("seen", [("statefulset watchdog: no batch for", 1)], indirect=True)
def test_work_outlasting_the_watchdog_is_reported_meanwhile_and_raises_when_it_returns(seen):
    watch = CallerWatch(Watchdog(0.2, fail_on_timeout=True, stall_seconds=0.1))
    start = watch.arm(False, _what)
    assert seen.wanted.wait(60), seen.messages  # the work: until the guard thread said it gave up
    with pytest.raises(StatefulsetError, match=r"watchdog: no batch for \d+ s: the test's own .* replica-batch 7"):
        watch.check(start, False, _what)
    stalls = [m for level, m in seen.messages if m.startswith("statefulset stall") and level == logging.WARNING]
    assert stalls and "replica-batch 7" in stalls[0]
    gave_up = [m for level, m in seen.messages if level == logging.ERROR]
    assert len(gave_up) == 1 and "replica-batch 7" in gave_up[0] and "raises when the work returns" in gave_up[0]


@pytest.mark.parametrize("seen", [("still waiting", 2)], indirect=True)
def test_without_fail_on_timeout_a_late_result_is_used_after_the_periods_warned(seen):
    watch = CallerWatch(Watchdog(0.5, stall_seconds=None))
    start = watch.arm(False, _what)
    assert seen.wanted.wait(60), seen.messages  # two periods warned, far from the ten that give up
    watch.check(start, False, _what)  # no error: the result is used
    warned = [m for _, m in seen.messages if "still waiting" in m]
    assert all("replica-batch 7" in m for m in warned)
    assert not [m for level, m in seen.messages if level >= logging.ERROR]


@pytest.mark.parametrize("seen", [("statefulset", 1)], indirect=True)
def test_work_that_raised_is_disarmed_and_the_next_is_watched_from_its_own_start(seen):
    watch = CallerWatch(Watchdog(0.2, fail_on_timeout=True, stall_seconds=None))
    watch.arm(False, lambda: "the first work")
    watch.disarm()  # it raised: nothing more is reported about it
    start = watch.arm(False, _what)
    assert seen.wanted.wait(60), seen.messages
    with pytest.raises(StatefulsetError, match="replica-batch 7"):
        watch.check(start, False, _what)
    assert not [m for _, m in seen.messages if "the first work" in m]
