"""The lane host's scheduling thread: its life from start to stop, failure or a broken engine.

The thread runs Scheduler steps while there is work and sleeps on HostState's condition when idle.
Stopping lets live streams finish within a grace period, then ends the rest cancelled; a failure
reported from any thread (a rank lost) ends every stream at once and latches the host broken.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from tpserve.server.backend import Backend, BackendBroken
from tpserve.server.host_state import HostState
from tpserve.server.lane_scheduler import Scheduler
from tpserve.server.requests import CANCELLED

log = logging.getLogger(__name__)

IDLE_WAIT_S = 0.5  # an idle scheduler re-checks this often even without a wake-up (room can free up)
JOIN_MARGIN_S = 5.0  # stop() waits this long past the grace period for the scheduler thread


class SchedulerThread:
    def __init__(
        self,
        backend: Backend,
        state: HostState,
        scheduler: Scheduler,
        on_step: Callable[[], None] | None = None,
    ):
        self._backend = backend
        self._on_step = on_step or (lambda: None)
        self._state = state
        self._scheduler = scheduler
        self._stop_deadline = 0.0

    def start(self) -> None:
        """Run the scheduler on a daemon thread; it sleeps on a condition when idle."""
        thread = threading.Thread(target=self._run, name="lane-host", daemon=True)
        self._state.claim_thread(thread)
        thread.start()

    def _run(self) -> None:
        try:
            while self._state.broken_reason is None:
                stopping, failure = self._state.next_signals()
                if failure is not None:
                    self._scheduler.latch_broken(failure)
                    return
                if stopping:
                    self._drain()
                    return
                stepped = self._scheduler.step()
                self._on_step()
                if not stepped:
                    self._going_idle()
                    self._state.wait_for_wake(IDLE_WAIT_S)
        except BaseException as error:
            log.exception("the lane host's scheduler failed")
            self._scheduler.latch_broken(f"the lane host failed: {error!r}")

    def fail(self, reason: str) -> None:
        """From any thread: the engine is gone (a rank lost). Every stream ends now with an error,
        also while the scheduler sits in a backend call that may only fail at its timeout; the
        scheduler latches broken when it next looks (its lanes are its own to forget)."""
        self._state.set_failure(reason)
        self._scheduler.latch_broken(reason, forget_lanes=self._state.thread is None)

    def _going_idle(self) -> None:
        # A backend with followers tells them no message is coming soon (see tpserve/ranks/channel.py),
        # so they wait off any collective timeout. It sends that once per idle spell. A broken
        # engine has no followers to tell.
        if self._state.broken_reason is not None:
            return
        try:
            self._backend.idle()
        except BackendBroken as error:
            self._scheduler.latch_broken(str(error))

    def stop(self, grace_s: float) -> bool:
        """Stop admitting; live streams get grace_s to finish, the rest end cancelled. False when
        the scheduler is stuck in a backend call (a follower that does not answer)."""
        self._stop_deadline = time.monotonic() + grace_s  # set before the thread can see the stop
        queued, thread = self._state.begin_stop()
        for job in queued:
            self._state.finish(job, CANCELLED)
        if thread is None:
            self._drain()
            return True
        if thread is threading.current_thread():
            return True  # called from on_broken on the scheduler thread: it is about to end by itself
        thread.join(timeout=grace_s + JOIN_MARGIN_S)
        if thread.is_alive():
            # A backend call is stuck. Its lanes stay held, but no client waits on it any longer.
            log.error("the lane host's scheduler did not stop within %.1f s", grace_s + JOIN_MARGIN_S)
            for job in self._state.unfinished():
                self._state.finish(job, CANCELLED, "the server stopped while the engine was busy")
            return False
        return True

    def _drain(self) -> None:
        """Let live streams run until the stop deadline, then end the rest cancelled."""
        lanes = self._scheduler.lanes
        while lanes.num_busy and self._state.broken_reason is None and time.monotonic() < self._stop_deadline:
            self._scheduler.step()
            self._on_step()
        if self._state.broken_reason is not None:
            return
        try:
            self._scheduler.end_all(CANCELLED)
        except BackendBroken as error:
            self._scheduler.latch_broken(str(error))
