"""The one background loop (``probing.worker.Worker``): it starts once, a
stop joins its thread (and a step that stops its own worker does not wait
for itself), a step that raises is counted and kept and the loop goes on,
the period holds, ``sooner`` shortens a wait, ``at_once`` steps before the
first wait, and a worker run once sleeps with ``wait`` until stopped."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import pytest

from probing.errors import NoProbe
from probing.worker import Worker, error_text


def _until(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "the condition never came true"
        time.sleep(0.005)


def _threads(name: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == name]


@pytest.fixture
def workers() -> Iterator[list[Worker]]:
    """Every worker a test makes is stopped after it, whatever it asserted."""
    made: list[Worker] = []
    yield made
    for w in made:
        w.stop(timeout=5)


def test_a_worker_steps_on_a_named_daemon_thread_until_stopped(workers) -> None:  # type: ignore[no-untyped-def]
    ran: list[str] = []
    w = Worker("probing-test-loop", lambda: ran.append(threading.current_thread().name), 0.001)
    workers.append(w)
    assert w.state == "stopped" and not w.running
    w.start()
    _until(lambda: len(ran) >= 3)
    [thread] = _threads("probing-test-loop")
    assert thread.daemon and w.running and w.state == "running"
    assert set(ran) == {"probing-test-loop"}
    w.stop()
    assert not thread.is_alive() and w.state == "stopped" and not w.running
    assert w.steps >= 3 and w.errors == 0 and w.last_error is None


def test_a_second_start_does_nothing(workers) -> None:  # type: ignore[no-untyped-def]
    w = Worker("probing-test-twice", lambda: None, 0.01)
    workers.append(w)
    w.start()
    w.start()
    assert len(_threads("probing-test-twice")) == 1
    w.stop()
    assert _threads("probing-test-twice") == []


def test_a_stopped_worker_starts_again(workers) -> None:  # type: ignore[no-untyped-def]
    w = Worker("probing-test-again", lambda: None, 0.001)
    workers.append(w)
    w.start()
    w.stop()
    before = w.steps
    w.start()
    _until(lambda: w.steps > before)
    assert w.running


def test_a_step_that_stops_its_own_worker_does_not_wait_for_itself(workers) -> None:  # type: ignore[no-untyped-def]
    w: Worker

    def step() -> None:
        w.stop(timeout=None)  # from its own thread: no join (a join would never end)

    w = Worker("probing-test-self-stop", step, 0.001)
    workers.append(w)
    w.start()
    _until(lambda: w.state == "stopped", timeout=5)
    assert w.steps == 1 and w.errors == 0


def test_a_probing_error_is_kept_by_its_text_and_the_loop_goes_on(workers, capfd) -> None:  # type: ignore[no-untyped-def]
    told: list[Exception] = []

    def step() -> None:
        raise NoProbe("pid 7 has no probe", hint="start it with PROBING=1")

    w = Worker("probing-test-error", step, 0.001, what="testing", on_error=told.append)
    workers.append(w)
    w.start()
    _until(lambda: w.errors >= 3)
    assert w.running and w.steps >= 3
    assert w.last_error == "pid 7 has no probe (start it with PROBING=1)"
    assert all(isinstance(e, NoProbe) for e in told)
    w.stop()
    assert "testing" not in capfd.readouterr().err  # said in status, not a bug to log


def test_a_bug_is_kept_with_its_type_and_logged_once(workers, capfd) -> None:  # type: ignore[no-untyped-def]
    def step() -> None:
        raise KeyError("a bug")

    w = Worker("probing-test-bug", step, 0.001, what="testing the loop")
    workers.append(w)
    w.start()
    _until(lambda: w.errors >= 3)
    w.stop()
    assert w.last_error == "KeyError: 'a bug'" == error_text(KeyError("a bug"))
    log = capfd.readouterr().err
    assert log.count("testing the loop: KeyError: 'a bug'") == 1 and "Traceback" in log


def test_a_bug_of_a_worker_without_words_for_it_is_not_logged(capfd) -> None:  # type: ignore[no-untyped-def]
    w = Worker("probing-test-quiet", lambda: 1 / 0)  # once: the step is the loop
    w.run()
    assert w.errors == 1 and w.last_error == "ZeroDivisionError: division by zero"
    assert capfd.readouterr().err == ""


def test_steps_come_every_period_measured_from_the_end_of_the_last(workers) -> None:  # type: ignore[no-untyped-def]
    at: list[float] = []
    w = Worker("probing-test-period", lambda: at.append(time.monotonic()), 0.05)
    workers.append(w)
    began = time.monotonic()
    w.start()
    _until(lambda: len(at) >= 4)
    w.stop()
    assert at[0] - began >= 0.05  # the first after one period
    gaps = [b - a for a, b in zip(at, at[1:], strict=False)]
    assert min(gaps) >= 0.05


def test_at_once_steps_before_the_first_wait(workers) -> None:  # type: ignore[no-untyped-def]
    at: list[float] = []
    w = Worker("probing-test-at-once", lambda: at.append(time.monotonic()), 60.0, at_once=True)
    workers.append(w)
    began = time.monotonic()
    w.start()
    _until(lambda: len(at) == 1)
    assert at[0] - began < 30.0
    w.stop()  # its wait of a minute is cut short
    assert w.state == "stopped" and w.steps == 1


def test_sooner_shortens_the_wait_and_never_lengthens_it(workers) -> None:  # type: ignore[no-untyped-def]
    at: list[float] = []
    due: list[float | None] = [0.01]
    w = Worker(
        "probing-test-sooner", lambda: at.append(time.monotonic()), 60.0,
        at_once=True, sooner=lambda: due[0],
    )  # fmt: skip
    workers.append(w)
    w.start()
    _until(lambda: len(at) >= 3)  # every 10 ms, not every minute
    w.every_s = 0.02
    due[0] = 3600.0  # later than the period: the period
    n = len(at)
    _until(lambda: len(at) >= n + 2)
    due[0] = None  # nothing due: the period
    n = len(at)
    _until(lambda: len(at) >= n + 2)


def test_a_bug_in_sooner_is_counted_and_the_period_holds(workers) -> None:  # type: ignore[no-untyped-def]
    def sooner() -> float:
        raise ValueError("no pace")

    w = Worker("probing-test-bad-sooner", lambda: None, 0.001, sooner=sooner)
    workers.append(w)
    w.start()
    _until(lambda: w.steps >= 3)
    assert w.running and w.errors >= 2 and w.last_error == "ValueError: no pace"


def test_a_worker_run_once_sleeps_until_stopped_and_wake_reaches_its_wait(workers) -> None:  # type: ignore[no-untyped-def]
    cond = threading.Condition()
    woken: list[bool] = []

    def step() -> None:  # the loop is the step's own: a condition, not wait()
        with cond:
            while not w.stopping:
                cond.wait()
        woken.append(True)

    def wake() -> None:
        with cond:
            cond.notify()

    w = Worker("probing-test-once", step, wake=wake)
    workers.append(w)
    w.start()
    _until(lambda: w.state == "running")
    w.stop(timeout=5)
    assert woken == [True] and w.state == "stopped" and w.steps == 1


def test_wait_returns_early_when_stopped(workers) -> None:  # type: ignore[no-untyped-def]
    slept: list[bool] = []
    w: Worker
    w = Worker("probing-test-wait", lambda: slept.append(w.wait(60.0)))
    workers.append(w)
    w.start()
    _until(lambda: w.state == "running")
    began = time.monotonic()
    w.stop(timeout=5)
    assert slept == [True] and time.monotonic() - began < 5.0


def test_an_event_held_by_the_owner_stops_every_worker_on_it_and_is_not_cleared(workers) -> None:  # type: ignore[no-untyped-def]
    stop = threading.Event()
    a = Worker("probing-test-shared-a", lambda: None, 0.001, event=stop)
    b = Worker("probing-test-shared-b", lambda: None, 0.001, event=stop)
    workers.extend([a, b])
    a.start()
    b.start()
    _until(lambda: a.steps > 0 and b.steps > 0)
    stop.set()
    _until(lambda: a.state == b.state == "stopped")
    a.start()  # the owner's stop holds until the owner clears it
    _until(lambda: a.state == "stopped")
    assert stop.is_set()


def test_run_on_the_calling_thread_keeps_a_stop_asked_before_it() -> None:
    ran: list[int] = []
    w = Worker("probing-test-here", lambda: ran.append(1), 0.0)
    w.stop()
    w.run()
    assert ran == [] and w.state == "stopped"


STOPPED_BY_SIGNAL = """
import signal, sys
from probing.worker import Worker, stop_on_signals
loop = Worker("probing-test", lambda: None, every_s=1e-5)  # always in or near its wait
stop_on_signals(loop.stop, (signal.SIGTERM,))
print("ready", flush=True)
loop.run()
# the burst's later signals may come this late (the asker descheduled between
# them): ignored from here, as Python's finalizing would not run the handler
signal.signal(signal.SIGTERM, signal.SIG_IGN)
print("stopped", flush=True)
"""


@pytest.mark.parametrize("attempt", range(5))
def test_a_signal_stops_a_loop_whose_thread_waits_in_the_lock_stop_takes(attempt: int) -> None:
    # the handler takes no lock: stop() runs on a thread of its own, so a
    # SIGTERM landing while the loop's thread holds its event's lock stops it
    import signal
    import subprocess
    import sys

    p = subprocess.Popen(
        [sys.executable, "-c", STOPPED_BY_SIGNAL], stdout=subprocess.PIPE, text=True
    )
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        for _ in range(3):  # a burst: the second and third find a stop on its way
            p.send_signal(signal.SIGTERM)
        out, _ = p.communicate(timeout=30)
    finally:
        p.kill()
    assert p.returncode == 0 and out.strip() == "stopped"


def test_a_worker_thread_is_named_in_the_kernel_too() -> None:
    """``top -H``, py-spy and the engine-cost benchmark tell the loops apart
    by the kernel's name of each thread."""
    import os
    import threading

    seen: list[str] = []
    stepped = threading.Event()

    def step() -> None:
        tid = threading.get_native_id()
        with open(f"/proc/{os.getpid()}/task/{tid}/comm") as f:
            seen.append(f.read().strip())
        stepped.set()

    w = Worker("probing-test-loop-long-name", step, None)
    w.start()
    assert stepped.wait(10)
    w.stop()
    assert seen == ["probing-test-lo"]  # the kernel keeps 15 bytes
    with open(f"/proc/{os.getpid()}/comm") as f:
        assert f.read().strip() != "probing-test-lo"  # the process keeps its name


def test_shared_workers_of_one_name_run_on_one_thread_that_ends_with_the_last(workers) -> None:  # type: ignore[no-untyped-def]
    """An engine's ranks each drain, sample and look: one thread a kind of
    loop (``Beat``), however many ranks; each worker keeps its own period,
    and the thread ends once none is left."""
    ran: dict[int, list[str]] = {0: [], 1: [], 2: []}
    made = [
        Worker(
            "probing-test-beat",
            lambda i=i: ran[i].append(threading.current_thread().name),  # type: ignore[misc]
            0.002 if i < 2 else 3600,
            at_once=i == 2,
            shared=True,
        )
        for i in range(3)
    ]
    workers.extend(made)
    for w in made:
        w.start()
    _until(lambda: len(ran[0]) >= 5 and len(ran[1]) >= 5)
    assert len(_threads("probing-test-beat")) == 1
    assert {n for names in ran.values() for n in names} == {"probing-test-beat"}
    assert len(ran[2]) == 1  # at once, then its own hour
    assert all(w.running and w.state == "running" for w in made)
    made[0].stop()
    assert made[0].state == "stopped" and made[1].running
    steps = made[0].steps
    _until(lambda: len(ran[1]) >= steps + 10)
    assert made[0].steps == steps  # taken off, never stepped again
    made[1].stop()
    made[2].stop()
    _until(lambda: not _threads("probing-test-beat"))
    made[1].start()  # a new one starts the thread again
    _until(lambda: made[1].steps > steps)
    assert len(_threads("probing-test-beat")) == 1


def test_a_shared_workers_stop_waits_for_its_step_and_not_for_the_others(workers) -> None:  # type: ignore[no-untyped-def]
    """``stop`` returns once the worker's own step in progress ended; a step
    that stops its own worker, or another on the beat, does not wait."""
    inside, release = threading.Event(), threading.Event()
    others: list[Worker] = []

    def slow() -> None:
        inside.set()
        release.wait(10)

    def stopper() -> None:
        others[0].stop(timeout=None)  # from the beat's thread: no wait

    a = Worker("probing-test-beat-stop", slow, 0.001, at_once=True, shared=True)
    b = Worker("probing-test-beat-stop", stopper, 3600, shared=True)
    others.append(b)
    workers.extend([a, b])
    a.start()
    inside.wait(10)
    stopped = threading.Thread(target=a.stop)
    stopped.start()
    stopped.join(0.2)
    assert stopped.is_alive() and a.state == "stopping"  # its step runs on
    release.set()
    stopped.join(10)
    assert not stopped.is_alive() and a.state == "stopped"
    b.start()
    b.every_s = 3600
    c = Worker("probing-test-beat-stop", lambda: b.stop(timeout=None), 0.001, shared=True)
    workers.append(c)
    c.start()
    _until(lambda: b.state == "stopped")


def test_a_shared_worker_ends_when_the_event_its_owner_holds_is_set(workers) -> None:  # type: ignore[no-untyped-def]
    event = threading.Event()
    w = Worker("probing-test-beat-event", lambda: None, 0.001, event=event, shared=True)
    workers.append(w)
    w.start()
    _until(lambda: w.steps >= 2)
    event.set()
    _until(lambda: w.state == "stopped")
    _until(lambda: not _threads("probing-test-beat-event"))


def test_a_shared_worker_is_periodic() -> None:
    with pytest.raises(ValueError, match="periodic"):
        Worker("probing-test-beat-once", lambda: None, shared=True)


def test_a_shared_worker_started_again_while_its_step_ends_steps_once_a_period(workers) -> None:  # type: ignore[no-untyped-def]
    """A stop that gave up waiting, then a start, while the step still runs:
    one entry on the beat, not two (it would step twice a period)."""
    inside, release = threading.Event(), threading.Event()
    times: list[float] = []

    def step() -> None:
        times.append(time.monotonic())
        if len(times) == 1:
            inside.set()
            release.wait(10)

    w = Worker("probing-test-beat-again", step, 0.05, at_once=True, shared=True)
    workers.append(w)
    w.start()
    inside.wait(10)
    w.stop(timeout=0.01)  # its step runs on
    w.start()
    release.set()
    _until(lambda: len(times) >= 6)
    gaps = [b - a for a, b in zip(times[1:], times[2:], strict=False)]
    assert min(gaps) >= 0.04, gaps


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_step_that_escapes_its_loop_leaves_the_others_of_its_beat_running(workers) -> None:  # type: ignore[no-untyped-def]
    """Only an Exception is a step's error; anything else ends the thread it
    ran on (as a thread of its own would end). The others of the name go on."""

    class Escapes(BaseException):
        pass

    ran: list[int] = []

    def escape() -> None:
        raise Escapes

    a = Worker("probing-test-beat-escape", escape, 3600, at_once=True, shared=True)
    b = Worker("probing-test-beat-escape", lambda: ran.append(1), 0.005, shared=True)
    workers.extend([a, b])
    b.start()
    _until(lambda: len(ran) >= 2)
    a.start()
    seen = len(ran)
    _until(lambda: len(ran) >= seen + 5)
    _until(lambda: len(_threads("probing-test-beat-escape")) == 1)  # the escaped one ended
