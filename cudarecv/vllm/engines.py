"""The trainer's side of one vLLM engine (:class:`Engine`): its client, its session in the trainer's store, where it
stands (:class:`EngineState`) and the calls of one update, each bounded (:class:`Call`).

A trainer of one engine runs that engine's update and raises what fails; a trainer of a fleet runs each joined
engine's update on a thread of its own, and an engine that fails is lost (logged, joined again at a later update)
while the others go on."""

from __future__ import annotations

import enum
import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from types import TracebackType
from typing import Any, cast

from torch.distributed import DistStoreError

from .. import ReceiverFailed, TransferTimeout, UsageError
from .info import CudarecvInitInfo, CudarecvTrainerInitInfo, EngineStatus, Loaded
from .rendezvous import joined_key, loaded_key, member_key, seconds, staged_key

log = logging.getLogger("cudarecv")

#: how often a fleet engine's wait for its workers to stage a version looks again (at the store, and whether they
#: are still served)
LOOK_EVERY = 0.05


def update_bound(timeout: float) -> float:
    """The most one engine's update may take: the sum of its calls' bounds (staged, start, which may close a dead
    trainer's update and start again, pause, update, finish, resume)."""
    return 8 * timeout + 60.0


class EngineState(enum.Enum):
    """Where one engine of a trainer stands (a fleet's: each may be lost and join again)."""

    #: its ``init_weight_transfer_engine`` is under way (a thread of its own)
    JOINING = "joining"
    #: its workers receive every version, and each ``send_weights`` updates it
    JOINED = "joined"
    #: its join, a transfer to it or its update failed (``why``): a fleet joins it again at its next update
    LOST = "lost"
    #: the trainer let go of it (``shutdown``, ``remove_engine``)
    CLOSED = "closed"


#: the moves an engine's state may make, in one place
MOVES: dict[EngineState, frozenset[EngineState]] = {
    EngineState.JOINING: frozenset({EngineState.JOINED, EngineState.LOST, EngineState.CLOSED}),
    EngineState.JOINED: frozenset({EngineState.LOST, EngineState.CLOSED}),
    EngineState.LOST: frozenset({EngineState.JOINING, EngineState.CLOSED}),
    EngineState.CLOSED: frozenset(),
}


@dataclass(frozen=True)
class Joined:
    """What an engine said when it joined: its session, worker count and dtype, and (a fleet's) the fleet sender's
    receiver id of each worker."""

    session: str
    workers: int
    dtype: str
    sliced: bool
    ids: tuple[int, ...] = ()


class Engine:
    """One vLLM engine as its trainer sees it: ``client`` (wrapped by :func:`~.client.as_client`), named ``label``
    in logs and :class:`~.info.EngineStatus`."""

    def __init__(self, client: Any, label: str, info: CudarecvTrainerInitInfo, index: int) -> None:
        self.client, self.label, self.info, self.index = client, label, info, index
        # (the state, the thread that works on the engine and what goes with them: one change at a time)
        self._lock = threading.RLock()
        self._state = EngineState.LOST
        self.why: str | None = "not joined yet"
        self._said: str | None = (
            None  # (the last loss logged: a join that fails again is not logged again)
        )
        self.joined: Joined | None = None
        #: the last version it put in place (0: none), and how each worker did it
        self.version = 0
        self.loaded: dict[int, Loaded] = {}
        #: the thread that joins or updates it, if any (never two at once: an engine is asked one thing at a time)
        self._working: threading.Thread | None = None
        self._asked = False  # whether it was ever asked to join (its workers may hold this trainer's connection)
        self._attempts = 0  # (the joins tried)
        #: the session of its last join, in the store's keys (each join its own: what a dead incarnation of the
        #: engine left there is never read)
        self.session = ""

    # -- where it stands ---------------------------------------------------------------------------------
    @property
    def state(self) -> EngineState:
        return self._state

    def move(self, to: EngineState, why: str | None = None) -> bool:
        """Move to ``to``; False, and nothing changed, where the table forbids it (a closed engine stays closed:
        a join or update that ends after the trainer let go of it changes nothing). A loss is logged once per
        reason."""
        with self._lock:
            if to not in MOVES[self._state]:
                return False
            self._state, self.why = to, why
            said, self._said = self._said, (why if to is EngineState.LOST else None)
        if to is EngineState.LOST and why != said:
            log.warning("vLLM engine %s is lost to the trainer: %s", self.label, why)
        elif to is EngineState.JOINED:
            log.info("vLLM engine %s joined the trainer", self.label)
        return True

    def busy(self) -> bool:
        """Whether a join or an update of it is still under way (on its thread)."""
        working = self._working
        return working is not None and working.is_alive()

    def status(self) -> EngineStatus:
        with self._lock:
            state = cast(Any, self._state.value)  # (the enum's values are the Literal's)
            return EngineStatus(self.label, state, self.version, dict(self.loaded), self.why)

    # -- joining -----------------------------------------------------------------------------------------
    def connecting(self) -> None:
        """(One engine's trainer:) its init is asked now, on the trainer's thread."""
        self._asked = True
        self.move(EngineState.JOINING)

    def connected(self, joined: Joined) -> None:
        """(One engine's trainer:) its workers joined."""
        self.joined = joined
        self.move(EngineState.JOINED)

    def begin_join(
        self,
        store: Any,
        fleet: str,
        session: str,
        served: Callable[[tuple[int, ...]], bool],
        dtype: Callable[[], str | None],
    ) -> bool:
        """Start joining the fleet sender ``fleet`` of the trainer's ``session`` on a thread of its own, if the
        engine is lost and nothing else of it is under way; whether one started. ``served`` says whether the
        sender serves receivers of these ids; ``dtype`` the fleet's dtype, once it is known."""
        with self._lock:
            if self._state is not EngineState.LOST or self.busy():
                return False
            self._attempts += 1
            self._asked = True
            self.session = f"{session}-{self.index}-{self._attempts}"
            self._working = threading.Thread(
                target=self._join,
                # (a client of the store of its own: a wait on a shared one holds up every other thread's call)
                args=(store.clone(), fleet, self.session, served, dtype),
                name=f"cudarecv-vllm-join-{self.label}",
                daemon=True,
            )
            self.move(EngineState.JOINING)
            self._working.start()
            return True

    def wait(self, timeout: float) -> None:
        """Wait (at most ``timeout``) for its join or update under way, if any."""
        working = self._working
        if working is not None:
            working.join(max(timeout, 0.0))

    def _join(
        self,
        store: Any,
        fleet: str,
        session: str,
        served: Callable[[tuple[int, ...]], bool],
        dtype: Callable[[], str | None],
    ) -> None:
        info = self.info
        worker_info = CudarecvInitInfo(
            host=info.host,
            port=store.port,
            session=session,
            timeout=info.timeout,
            transport=info.transport,
            staged=info.staged,
            fleet=fleet,
        )
        try:
            if info.pause is not None:
                # a trainer that died during its update may have left it paused: it generates again from here
                self.resume()
            Call(
                lambda: self.client.init_weight_transfer_engine(asdict(worker_info)),
                "init_weight_transfer_engine",
                2 * info.timeout,
            ).join()
            first = json.loads(store.get(member_key(session, 0)))
            want = dtype()
            if want is not None and first["dtype"] != want:
                self._release()
                raise UsageError(f"its dtype is {first['dtype']}, the fleet's {want}")
            workers = int(first["workers"])
            ids = tuple(
                int(json.loads(store.get(joined_key(session, i)))["id"]) for i in range(workers)
            )
            # (the sender serves a receiver once its side of the handshake is done too: then the next push is its)
            deadline = time.monotonic() + info.timeout
            while not served(ids):
                if time.monotonic() > deadline:
                    raise TransferTimeout(
                        f"the trainer's sender did not serve the engine's workers {list(ids)} within "
                        f"{info.timeout:g} s of their join"
                    )
                time.sleep(0.02)  # (a poll of the sender's own state, bounded by the deadline)
            self.joined = Joined(session, workers, str(first["dtype"]), False, ids)
        except Exception as error:  # noqa: BLE001 - an engine that cannot join is lost, said; the fleet goes on
            self.move(EngineState.LOST, f"its join failed: {type(error).__name__}: {error}")
            return
        self.move(EngineState.JOINED)

    # -- an update ---------------------------------------------------------------------------------------
    def begin_update(self, run: Callable[[], None]) -> threading.Thread | None:
        """(A fleet's:) run its update (``run``) on a thread of its own, unless a join or an update of it is still
        under way; the thread, if one started."""
        with self._lock:
            if self._state is not EngineState.JOINED or self.busy():
                return None
            self._working = threading.Thread(
                target=run, name=f"cudarecv-vllm-update-{self.label}", daemon=True
            )
            self._working.start()
            return self._working

    def update(self, store: Any, version: int, alive: Callable[[], bool] | None = None) -> None:
        """Put ``version`` in place on this engine: wait (bounded) for its workers to stage it, then the engine's
        start, pause, update, finish and resume. ``alive`` (a fleet's) says whether its workers are still served: a
        wait ends at once when they are not. Raises what failed."""
        joined = self.joined
        if joined is None:
            raise UsageError(f"vLLM engine {self.label} never joined")
        if self.info.staged:
            self._wait_staged(store, joined, version, alive)
        self._start(version)
        # (after the start, which loads nothing, so that the pause is as short as it can be; a pause that fails
        # or times out may still take effect in the engine: it is resumed all the same)
        paused = self.info.pause is not None
        try:
            self._pause()
            try:  # (the workers load it now: bounded, as every answer of the engine)
                Call(
                    lambda: self.client.update_weights({"version": version}),
                    "update_weights",
                    self.info.timeout + 30.0,
                ).join()
            except BaseException:
                self._close_session(version)
                raise
            Call(
                lambda: self.client.finish_weight_update(str(version)),
                "finish_weight_update",
                self.info.timeout,
            ).join()
        except BaseException:
            if paused:
                self._resume(failed=True)
            raise
        if paused:
            self._resume()
        loaded = self._loaded(store, joined, version)
        with self._lock:
            self.version, self.loaded = version, loaded

    def _wait_staged(
        self, store: Any, joined: Joined, version: int, alive: Callable[[], bool] | None
    ) -> None:
        """Wait (bounded by the timeout) until every worker has staged ``version``, or found it cannot (it then
        reloads it in the pause), so that the engine pauses only to put it in place. Workers that do not say so in
        time are logged and the update goes on: a worker whose staging is not done within a few seconds of its
        ``update_weights`` reloads the version in the pause instead. A fleet's engine whose workers are no longer
        served (``alive``) ends the wait at once: :class:`~cudarecv.PeerError`-like, raised as ReceiverFailed."""
        keys = [staged_key(joined.session, index, version) for index in range(joined.workers)]
        started = time.monotonic()
        deadline = started + self.info.timeout
        try:
            if alive is None:
                store.wait(keys, seconds(self.info.timeout))
            else:  # (a look at the keys and at the workers in turn: no wait on the store, which logs each timeout)
                while not store.check(keys):
                    if not alive():
                        raise ReceiverFailed(
                            f"vLLM engine {self.label}: its workers are no longer served (died, or dropped) "
                            f"before they staged version {version}"
                        )
                    if time.monotonic() > deadline:
                        raise DistStoreError(f"waited {self.info.timeout:g} s for {keys}")
                    time.sleep(LOOK_EVERY)  # (a poll of the store's keys, bounded by the deadline)
        except DistStoreError as error:  # (the store's timeout, or the poll's)
            log.warning(
                "vLLM engine %s: workers did not stage version %d within %g s (%s); updating anyway",
                self.label,
                version,
                self.info.timeout,
                str(error).splitlines()[0],
            )
            return
        log.debug(
            "vLLM engine %s: version %d staged on every worker after %.2f s",
            self.label,
            version,
            time.monotonic() - started,
        )

    def _pause(self) -> None:
        """Pause the engine's scheduler for the update as :attr:`info` says (bounded)."""
        mode = self.info.pause
        if mode is not None:
            Call(lambda: self.client.pause(mode), "pause", self.info.timeout + 30.0).join()

    def _resume(self, failed: bool = False) -> None:
        """Resume the engine's scheduler (bounded). A failure is raised, or logged after an update that ``failed``
        (whose own error goes on): an engine left paused generates nothing until it is resumed (``POST /resume``,
        or the next trainer's ``trainer_init``)."""
        try:
            Call(self.client.resume, "resume", self.info.timeout).join()
        except Exception:
            if not failed:
                raise
            log.exception(
                "vLLM engine %s could not be resumed after an update that failed", self.label
            )

    def resume(self) -> None:
        """(At a trainer's start:) resume the engine, which a trainer that died during its update left paused."""
        Call(self.client.resume, "resume", self.info.timeout).join()

    def _loaded(self, store: Any, joined: Joined, version: int) -> dict[int, Loaded]:
        """How each worker put ``version`` in place, as it said in the store (a worker that did not, or a store
        that does not answer: left out; the update itself is done)."""
        said = {}
        for index in range(joined.workers):
            key = loaded_key(joined.session, index, version)
            try:
                if store is not None and store.check([key]):
                    said[index] = Loaded(**json.loads(store.get(key)))
            except Exception as error:  # noqa: BLE001 - said, not raised: the version is in place
                log.warning(
                    "how worker %d of vLLM engine %s loaded version %d is not known: %s",
                    index,
                    self.label,
                    version,
                    error,
                )
        return said

    def _close_session(self, version: int) -> None:
        """After a failed update: close the engine's update session if it is still open (best effort, bounded,
        logged), so that the next ``send_weights`` can start one."""
        try:
            Call(self.client.finish_weight_update, "finish_weight_update", self.info.timeout).join()
        except Exception as error:  # noqa: BLE001 - a worker whose update failed closed its session itself
            log.info(
                "after the failed update %d, vLLM engine %s's update session was already closed (%s)",
                version,
                self.label,
                type(error).__name__,
            )

    def _start(self, version: int) -> None:
        """The engine's ``start_weight_update``. A trainer that died between its start and its update left the
        engine's update session open, which refuses a new start ("already active"): such a session is closed
        (it holds nothing of a version: a worker loads only a whole one) and the start made again."""
        start = self.client.start_weight_update
        try:
            Call(start, "start_weight_update", self.info.timeout).join()
        except Exception as error:  # noqa: BLE001 - what the engine says differs by client (an RPC, an HTTP 500)
            if "already active" not in str(error):
                raise
            log.warning(
                "vLLM engine %s refused to start update %d: an update is already active (a previous "
                "trainer's, which died); closing it, then starting again",
                self.label,
                version,
            )
            Call(self.client.finish_weight_update, "finish_weight_update", self.info.timeout).join()
            Call(start, "start_weight_update", self.info.timeout).join()

    # -- ending ------------------------------------------------------------------------------------------
    def lose(self, error: BaseException) -> None:
        """(A fleet's:) its update failed: lost, joined again at a later update."""
        self.move(EngineState.LOST, f"{type(error).__name__}: {error}")

    def close(self, tell: bool, timeout: float) -> None:
        """Let go of it: wait (at most ``timeout``) for its join or update under way, then (``tell``) ask an engine
        that was ever asked to join to release this trainer's connection (bounded, logged), whatever came of it."""
        if not self.move(EngineState.CLOSED):
            return
        self.wait(timeout)
        if tell and self._asked:
            self._release()

    def _release(self) -> None:
        """Ask the engine to release this trainer's connection (its workers close their receivers; bounded,
        logged)."""
        shut = getattr(self.client, "shutdown_weight_transfer_engine", None)
        if shut is None:
            return
        try:  # (bounded: an engine still busy with this trainer's call answers late or never)
            Call(shut, "shutdown_weight_transfer_engine", self.info.timeout).join()
        except Exception as error:  # noqa: BLE001 - the trainer's side is closed; the engine's is said
            log.warning(
                "vLLM engine %s did not release this trainer's connection: %s: %s",
                self.label,
                type(error).__name__,
                error,
            )


def label(client: Any) -> str:
    """How logs and :class:`~.info.EngineStatus` name an engine: ``vllm serve``'s URL, an ``LLM`` object's model,
    a Ray client's actor count."""
    inner = getattr(client, "client", client)  # (a SpokenClient's)
    url = getattr(inner, "base_url", None)
    if isinstance(url, str):
        return url
    llm = getattr(inner, "llm", None)
    if llm is not None:
        model = getattr(getattr(llm, "llm_engine", None), "model_config", None)
        return f"LLM({getattr(model, 'model', '?')}) at {id(llm):#x}"
    handles = getattr(inner, "handles", None)
    if isinstance(handles, list):
        return f"Ray engine of {len(handles)} actor(s) at {id(inner):#x}"
    return f"{type(inner).__name__} at {id(inner):#x}"


class Call:
    """One call of the engine's client on a thread of its own, so that waiting for its answer is bounded (a client
    may wait for ever). ``join`` waits for it (bounded) and raises what it raised; as a context manager (while
    this thread does its part, e.g. the rendezvous during the engine's init) it joins on the way out, and an error
    of the block wins over the call's (which becomes its context)."""

    def __init__(self, call: Callable[[], object], what: str, timeout: float) -> None:
        self.what, self.timeout = what, timeout
        self._error: BaseException | None = None
        self._thread = threading.Thread(
            target=self._run, args=(call,), name=f"cudarecv-vllm-{what}", daemon=True
        )
        self._thread.start()

    def __enter__(self) -> Call:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        if error is None:
            self.join()
            return
        try:
            self.join()
        except BaseException as answer:  # noqa: BLE001 - the block's error propagates, this one as its context
            error.__context__ = answer

    def _run(self, call: Callable[[], object]) -> None:
        try:
            call()
        except BaseException as error:  # noqa: BLE001 - raised by join, on the caller's thread
            self._error = error

    def join(self) -> None:
        self._thread.join(self.timeout)
        # (a thread still waiting ends with the engine's answer: it holds nothing of ours)
        if self._thread.is_alive():
            raise TransferTimeout(
                f"the vLLM engine did not answer {self.what} within {self.timeout:g} s"
            )
        if self._error is not None:
            raise self._error
