"""Lost-rank detection: heartbeats through the c10d store, errors that name the lost rank.

Each rank bumps ``beat/<rank>`` in the c10d store every ``interval_s`` and watches the next rank
of the group (a ring); a counter still for ``timeout_s`` is published under ``lost``. A survivor
blocked in a collective that never errors exits with :data:`EXIT_CODE_LOST`, as NCCL's watchdog.

Bounds after a rank dies (``h = interval_s``, ``T = timeout_s``, ``P = probe_s``,
``G = exit_grace_s``): a survivor whose collective errors raises within ``P`` plus one store round
trip; every other one within ``T + 2h + G`` (11 s by default).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
import uuid
from typing import Iterator

import torch.distributed as dist

logger = logging.getLogger(__name__)

EXIT_CODE_LOST = 75  # EX_TEMPFAIL: a peer was lost; restarting from a checkpoint may succeed


class Heartbeat:
    """Per-rank heartbeat and lost-rank watchdog over the default c10d store; a context manager,
    or :meth:`start` / :meth:`stop`. Constructing it is collective over ``group``.

    Args:
        group: process group whose ranks watch each other (default: the world).
        interval_s: seconds between two beats (and two checks) of the watchdog thread.
        timeout_s: seconds without a beat after which the watching neighbour declares a rank
            lost; must exceed ``interval_s`` (``>= 4 * interval_s`` is safe from jitter).
        probe_s: seconds a counter must stay still, after a collective error, for its rank to
            be named; default ``3 * interval_s``.
        exit_grace_s: seconds a rank that knows of a lost peer waits for the main thread to
            raise through :meth:`guard` before ending the process; ``None`` never exits.
        store: c10d store to use (default: the default process group's store).

    Raises:
        ValueError: non-positive intervals, or ``timeout_s <= interval_s``.
        RuntimeError: ``torch.distributed`` is not initialized.
    """

    def __init__(self, group: dist.ProcessGroup | None = None, *, interval_s: float = 0.5,
                 timeout_s: float = 5.0, probe_s: float | None = None,
                 exit_grace_s: float | None = 5.0, store: dist.Store | None = None) -> None:
        if not dist.is_initialized():
            raise RuntimeError("dmuon: Heartbeat needs torch.distributed; call init_process_group first")
        if interval_s <= 0 or timeout_s <= interval_s:
            raise ValueError(f"dmuon: Heartbeat needs 0 < interval_s < timeout_s, got "
                             f"interval_s={interval_s}, timeout_s={timeout_s}")
        if exit_grace_s is not None and exit_grace_s < 0:
            raise ValueError(f"dmuon: exit_grace_s must be >= 0 or None, got {exit_grace_s}")
        self.group = group if group is not None else dist.group.WORLD
        self.ranks = dist.get_process_group_ranks(self.group)  # global ranks, in group order
        self.rank = dist.get_rank()
        self.interval_s = float(interval_s)
        self.timeout_s = float(timeout_s)
        self.probe_s = float(probe_s) if probe_s is not None else 3.0 * self.interval_s
        self.exit_grace_s = exit_grace_s
        token = [uuid.uuid4().hex if dist.get_rank(self.group) == 0 else None]
        dist.broadcast_object_list(token, src=self.ranks[0], group=self.group)
        base = store if store is not None else dist.distributed_c10d._get_default_store()
        self.store = dist.PrefixStore(f"dmuon/heartbeat/{token[0]}/", base)
        self.store.add(f"beat/{self.rank}", 1)
        self._lost: list[int] = []
        self._lost_at: float | None = None
        self._reported = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _read_beat(self, rank: int) -> int:
        return int(self.store.add(f"beat/{rank}", 0))  # add(0) reads without blocking

    def _read_lost(self) -> list[int]:
        if not self.store.check(["lost"]):
            return []
        text = self.store.get("lost").decode()
        return sorted({int(r) for r in text.split(",") if r})

    def start(self) -> Heartbeat:
        """Start the watchdog thread (idempotent). Returns ``self``."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="dmuon-heartbeat", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        """Stop the watchdog thread (it finishes its current interval)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.interval_s + 5.0)
            self._thread = None

    def __enter__(self) -> Heartbeat:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def lost(self) -> list[int]:
        """Global ranks known to be lost (empty while every rank beats)."""
        return list(self._lost)

    def _run(self) -> None:
        me = self.ranks.index(self.rank)
        neighbour = self.ranks[(me + 1) % len(self.ranks)] if len(self.ranks) > 1 else None
        last_value, last_change = -1, time.monotonic()
        while not self._stop.wait(self.interval_s):
            try:
                self.store.add(f"beat/{self.rank}", 1)
                now = time.monotonic()
                if neighbour is not None and not self._lost:
                    value = self._read_beat(neighbour)
                    if value != last_value:
                        last_value, last_change = value, now
                    elif now - last_change > self.timeout_s:
                        logger.error("dmuon: rank %d sees no heartbeat from rank %d for %.1f s",
                                     self.rank, neighbour, now - last_change)
                        self.store.append("lost", f"{neighbour},")
                if not self._lost:
                    lost = self._read_lost()
                    if lost:
                        self._lost, self._lost_at = lost, now
            except Exception as e:  # noqa: BLE001 - the store itself is gone
                if not self._lost:
                    self._lost, self._lost_at = [self.ranks[0]], time.monotonic()
                    logger.error("dmuon: rank %d cannot reach the c10d store (%s)", self.rank, e)
            if self._lost and self.exit_grace_s is not None and not self._reported:
                if time.monotonic() - self._lost_at > self.exit_grace_s:
                    sys.stderr.write(f"{self._message(self._lost, 'a collective')}\nExiting with code "
                                     f"{EXIT_CODE_LOST}: the main thread is blocked in a "
                                     f"collective that cannot be interrupted.\n")
                    sys.stderr.flush()
                    os._exit(EXIT_CODE_LOST)

    def probe(self) -> list[int]:
        """Global ranks whose heartbeat does not move for ``probe_s`` (blocks up to ``probe_s``),
        or the published ``lost`` ranks as soon as a watcher has named some.

        Raises:
            RuntimeError: the c10d store is unreachable (its host is lost).
        """
        try:
            published = self._lost or self._read_lost()
            if published:
                return published
            first = {r: self._read_beat(r) for r in self.ranks}
            deadline = time.monotonic() + self.probe_s
            while True:
                time.sleep(min(self.interval_s, max(0.0, deadline - time.monotonic())))
                published = self._read_lost()
                if published:
                    return published
                still = [r for r in self.ranks if r != self.rank and self._read_beat(r) == first[r]]
                if not still or time.monotonic() >= deadline:
                    return still
        except (RuntimeError, dist.DistError) as e:
            raise RuntimeError(
                f"dmuon: rank {self.rank} cannot reach the c10d store ({e}); the store host is "
                f"lost (rank {self.ranks[0]} under env:// rendezvous, the launcher under torchrun)"
            ) from e

    def _message(self, lost: list[int], where: str | None) -> str:
        who = ", ".join(str(r) for r in lost)
        return (f"dmuon: rank {who} {'is' if len(lost) == 1 else 'are'} lost (no heartbeat for "
                f">= {min(self.probe_s, self.timeout_s):.1f} s); rank {self.rank} stops"
                f"{' in ' + where if where else ''}. Restart the job from the last complete "
                f"checkpoint (a directory with a .metadata file).")

    def raise_if_lost(self, where: str | None = None) -> None:
        """Raise at once if a lost rank is known (cheap: no store access).

        Raises:
            RuntimeError: naming the lost ranks.
        """
        if self._lost:
            self._reported = True  # the main thread is alive and told: no need to exit for it
            raise RuntimeError(self._message(self._lost, where))

    @contextlib.contextmanager
    def guard(self, where: str = "the training step") -> Iterator[None]:
        """Run a block of collectives; a lost peer becomes a ``RuntimeError`` naming it.

        Args:
            where: phase named in the error (e.g. ``"forward"``).

        Raises:
            RuntimeError: ``"dmuon: rank K is lost ..."`` chained to the transport error, when
                a rank is lost before or during the block (checking a ``RuntimeError``,
                ``DistError`` or ``ConnectionError`` takes up to ``probe_s``). Other errors pass.
        """
        self.raise_if_lost(where)
        try:
            yield
        except (RuntimeError, dist.DistError, ConnectionError) as e:  # what broken collectives raise
            try:
                lost = self.probe()
            except RuntimeError as store_error:
                self._reported = True
                raise store_error from e
            if not lost:
                raise
            self._lost, self._reported = lost, True
            raise RuntimeError(self._message(lost, where)) from e

