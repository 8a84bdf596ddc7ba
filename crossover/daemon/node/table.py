"""The daemon's side of the node's slot table (`crossover.slot_table`).

The daemon applies every event of a device's ring to its scheduler in ring order,
delivers the grants the plan did not make, and publishes the next plan
(`crossover.scheduler.preview`). `TablePlane` is the table itself; `TableSync` keeps it
and the scheduler in one order for the daemon: every change of the scheduler that is not
a table event waits until the events before it are applied (`change`), and a device
whose mutex stays busy is fenced.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from pathlib import Path

from crossover import environment as E
from crossover.scheduler import SlotGrant, SlotScheduler
from crossover.scheduler.preview import PlanCache, Step
from crossover.slot_table import PHASES, UNAVAILABLE, _native, table_path

log = logging.getLogger("crossover.daemon")

Key = tuple[str, int]
#: The daemon's wait for a mutex: short, it tries again on its next loop.
DAEMON_LOCK_S = 0.02
#: How long the daemon defers its changes of a device whose mutex stays busy (a rank
#: stopped inside it) before it fences the device: its ranks then use their sockets.
FENCE_S = 2.0
# the table's event kinds
KINDS = {Step.REQUEST: _native.REQUEST, Step.RELEASE: _native.RELEASE} if _native else {}


class TablePlane:
    """The daemon's side: slots for ranks, events into the scheduler, plans out.

    Args:
        path: the table file to create (replacing a killed daemon's).
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.table = _native.Table.create(str(path), _native.MAX_DEVICES)
        self._devices: dict[str, int] = {}  # device name -> index in the table
        self._fenced: set[str] = set()  # devices whose ring is closed (`fence`)
        self._owner: dict[int, Key] = {}  # slot -> the rank it is reserved for
        self._slot: dict[Key, int] = {}
        self._attached: set[int] = set()  # slots whose rank mapped the table
        self._gen: dict[int, int] = {}  # slot -> generation of its latest applied request
        # slot -> whether its latest request came through the table (a rank may ask over
        # its socket when the table refused it: then the grant goes there too)
        self._by_table: dict[int, bool] = {}
        self.mismatches = 0  # fast grants the scheduler did not make (must stay 0)
        self.plans = PlanCache()

    # --- membership ---------------------------------------------------------------------
    def reserve(self, key: Key, device: str) -> tuple[int, int] | None:
        """A slot and device index for a newly registered rank, or None (table full)."""
        if device in self._fenced:
            return None
        dev = self._devices.get(device)
        if dev is None:
            if len(self._devices) >= _native.MAX_DEVICES:
                return None  # the 65th device and on: the socket path
            dev = self._devices[device] = len(self._devices)
        free = next((s for s in range(_native.MAX_SLOTS) if s not in self._owner), None)
        if free is None:
            return None
        self._owner[free], self._slot[key] = key, free
        self._gen.pop(free, None)
        self._by_table.pop(free, None)
        self.table.bind(free, dev)
        return free, dev

    def attach(self, key: Key, ok: bool) -> None:
        """The rank said whether it mapped the table; without it, its slot goes back."""
        slot = self._slot.get(key)
        if slot is not None and ok:
            self._attached.add(slot)
        elif slot is not None:
            self.leave(key)

    def leave(self, key: Key) -> None:
        """The rank left: its slot is free again (drain its device first)."""
        slot = self._slot.pop(key, None)
        if slot is not None:
            del self._owner[slot]
            self._attached.discard(slot)
            self.table.unbind(slot)

    def has(self, device: str) -> bool:
        """Whether `device`'s ranks go through the table (it has an index and no fence)."""
        return device in self._devices and device not in self._fenced

    def devices(self) -> list[str]:
        """The devices whose ring the daemon drains."""
        return [d for d in self._devices if d not in self._fenced]

    def fence(self, sched: SlotScheduler, device: str) -> list[SlotGrant]:
        """Close `device`'s ring for good (its mutex stayed busy): its ranks ask over
        their sockets from now on. The events committed before are applied to `sched`
        (returns the grants, as `drain` does); a rank waiting in the table for a grant
        the daemon makes still gets it there (`grant` needs no mutex)."""
        self._fenced.add(device)
        return self._apply_all(sched, device, self.table.fence(self._devices[device]))

    # --- events in, grants and plans out ----------------------------------------------
    def drain(self, sched: SlotScheduler, device: str, invalidate: bool
              ) -> tuple[list[SlotGrant], int] | None:
        """Apply the device's undrained events to `sched`, in ring order.

        Args:
            invalidate: withdraw the plan (before the daemon changes the scheduler itself).

        Returns:
            (grants, seq): the grants the events caused for ranks on the socket path (the
            table's ranks are granted here, as each event is applied, the plan's grants
            again: a grant is idempotent) and the ring position reached; None if the
            mutex stayed busy.
        """
        got = self.table.drain(self._devices[device], invalidate, DAEMON_LOCK_S)
        if got is None:
            return None
        seq, events = got
        return self._apply_all(sched, device, events), seq

    def _apply_all(self, sched: SlotScheduler, device: str, events: list[tuple]
                   ) -> list[SlotGrant]:
        grants: list[SlotGrant] = []
        clock = sched.clock
        try:
            for slot, kind, phase, gen, fast, when in events:
                sched.clock = lambda when=when: when  # noqa: B023 - applied at its own time
                grants += self._apply(sched, device, slot, kind, phase, gen, fast)
        finally:
            sched.clock = clock
        return grants

    def _apply(self, sched: SlotScheduler, device: str, slot: int, kind: int, phase: int,
               gen: int, fast: int) -> list[SlotGrant]:
        """One event into the scheduler, at the time it happened: leases and patience
        count from then, as if the daemon had seen it at once."""
        key = self._owner.get(slot)
        if key is None or sched.device_of(*key) != device or phase >= len(PHASES):
            return []  # a rank that left, or a corrupt entry: nothing to apply
        if kind == _native.REQUEST:
            self._gen[slot], self._by_table[slot] = gen, True
            made = sched.request(*key)
        else:
            made = sched.release(*key, PHASES[phase])
        granted = {self._slot.get((g.job, g.rank)) for g in made}
        extra = [s for s in range(_native.MAX_SLOTS) if fast >> s & 1 and s not in granted]
        if extra:
            self.mismatches += 1
            log.error("the fast path granted slots %s on %s that the scheduler did not "
                      "(event %s): a bug; please report it", extra, device, (slot, kind))
        # Now, not after the drain: a grant answers the rank's request as of this event.
        return [g for g in made if not self.grant((g.job, g.rank))]

    def publish(self, sched: SlotScheduler, device: str, seq: int) -> bool:
        """Publish the scheduler's plan made after event `seq`; False if events came since."""
        plan = self.plans.preview(sched, device, _native.CHAIN)
        on_request = [0] * _native.MAX_SLOTS
        on_release = [0] * _native.MAX_SLOTS
        for table, kind, answers in ((on_request, Step.REQUEST, plan.on_request),
                                     (on_release, Step.RELEASE, plan.on_release)):
            for key, granted in answers.items():
                if self._slot.get(key) in self._attached:
                    table[self._slot[key]] = self._mask(granted, (key, kind) in plan.wakes, key)
        chain = []
        for key, kind, granted, wake in plan.chain:
            if self._slot.get(key) not in self._attached:
                break  # a rank on the socket path: its event never comes through the table
            chain.append((self._slot[key], KINDS[kind], self._mask(granted, wake, key)))
        return self.table.publish(self._devices[device], seq, on_request, on_release, chain,
                                  plan.concurrent, DAEMON_LOCK_S)

    def _mask(self, granted: tuple[Key, ...], wake: bool, asker: Key) -> int:
        """The table's answer to `asker`'s event: the ranks it grants through the table,
        and the daemon's wake-up if it grants a rank waiting on its socket (one not
        attached, or whose latest request came over the socket): only the daemon can
        deliver that grant, and a planned event does not wake it otherwise."""
        mask = 0
        for key in granted:
            slot = self._slot.get(key)
            if slot in self._attached and (key == asker or self._by_table.get(slot, True)):
                mask |= 1 << slot
            else:
                wake = True
        return mask | (_native.WAKE if wake else 0)

    def asked_by_socket(self, key: Key) -> None:
        """The rank's latest request came over its socket: grant it there."""
        slot = self._slot.get(key)
        if slot is not None:
            self._by_table[slot] = False

    def grant(self, key: Key) -> bool:
        """Deliver a grant through the table; False if it goes over the socket."""
        # Not `_attached`: a rank's Attached may still be unread behind events the daemon
        # drains early (another rank's arrival drains the device); a request in the ring
        # proves the rank mapped the table, and it waits there.
        slot = self._slot.get(key)
        if slot is None or not self._by_table.get(slot):
            return False
        self.table.grant(slot, self._gen.get(slot, 0))
        return True

    def fast_grants(self) -> dict[str, int]:
        """Grants made without the daemon so far, per device (for status)."""
        return {d: self.table.fast_grants(i) for d, i in self._devices.items()}


def _run(change: Callable[[], None]) -> None:
    """Run a change of the scheduler; whatever it raises stays out of the serve loop (a
    rank's own changes are guarded with their connection, see `Connections.guard`)."""
    try:
        change()
    except Exception:  # noqa: BLE001 - the daemon serves every job on the node
        log.exception("internal error in a change of the scheduler; the daemon goes on")


class TableSync:
    """The daemon's use of its table: open it, keep its rings and the scheduler in one
    order, publish plans. Without a table (no compiled module, CROSSOVER_NATIVE off, or
    a device past the table's 64) every call is a no-op and a change runs at once.

    Args:
        sched: the daemon's scheduler.
        deliver: hands grants to their ranks (through the table or over the socket).
        pids_on: the pids of the ranks on a device, for the log when one is fenced.
    """

    def __init__(self, sched: SlotScheduler, deliver: Callable[[list[SlotGrant]], None],
                 pids_on: Callable[[str], list[int]]) -> None:
        self.sched, self._deliver, self._pids_on = sched, deliver, pids_on
        self.plane: TablePlane | None = None
        self.replan: set[str] = set()  # devices whose events wait or whose plan is stale
        # Changes of the scheduler waiting for a device's mutex, and since when each
        # device's mutex has been busy.
        self._backlog: deque[tuple[str | None, Callable[[], None]]] = deque()
        self._stuck: dict[str, float] = {}

    # --- the table ----------------------------------------------------------------------
    def open(self, socket_file: Path) -> None:
        """Create the node's slot table (replacing a killed daemon's), or say once why the
        ranks here use the socket path."""
        why = UNAVAILABLE or ("" if E.native() else f"{E.NATIVE} is off")
        if why:
            log.info("native fast path off (%s); ranks use the socket path", why)
            return
        try:
            self.plane = TablePlane(table_path(socket_file))
        except (OSError, RuntimeError, ValueError) as exc:
            log.warning("native fast path off: %s; ranks use the socket path", exc)

    def close(self) -> None:
        if self.plane is not None:
            self.plane.path.unlink(missing_ok=True)

    @property
    def path(self) -> str:
        """The table's file ("" without one), for the welcome."""
        return str(self.plane.path) if self.plane is not None else ""

    def reserve(self, key: Key, device: str) -> tuple[int, int] | None:
        """A slot and device index for a new rank, or None: it uses the socket path."""
        return self.plane.reserve(key, device) if self.plane is not None else None

    def attached(self, key: Key, device: str, ok: bool) -> None:
        """The rank said whether it mapped the table."""
        if self.plane is not None:
            self.plane.attach(key, ok)
            self.replan.add(device)

    def rang(self, device: str) -> None:
        """A rank's doorbell: events wait in `device`'s ring (applied at the loop's end)."""
        if self.plane is not None:
            self.replan.add(device)

    def leave(self, key: Key) -> None:
        if self.plane is not None:
            self.plane.leave(key)

    def asked_by_socket(self, key: Key) -> None:
        if self.plane is not None:
            self.plane.asked_by_socket(key)

    def grant(self, key: Key) -> bool:
        """Deliver a grant through the table; False if it goes over the socket."""
        return self.plane is not None and self.plane.grant(key)

    def company_changed(self, device: str) -> None:
        """A device's jobs changed: its plan is stale (a dormant job's request must ring)."""
        if self.plane is not None:
            self.replan.add(device)

    def fast_grants(self) -> dict[str, int] | None:
        """Grants made without the daemon, per device; None without a table."""
        return self.plane.fast_grants() if self.plane is not None else None

    def pending(self) -> dict[str, list[str] | int]:
        """What waits, for status: devices whose next plan is not published yet, and
        changes queued behind a busy mutex."""
        return {"plans_pending": sorted(self.replan), "changes_waiting": len(self._backlog)}

    # --- one order: changes wait for the events before them ---------------------------
    @property
    def waiting(self) -> bool:
        """Whether changes wait for a device's mutex."""
        return bool(self._backlog)

    @property
    def stuck(self) -> bool:
        """Whether a device's mutex was busy at the latest try (changes wait, or the
        daemon's own: leases, re-alignment)."""
        return bool(self._backlog) or bool(self._stuck)

    def settle(self, device: str | None = None) -> bool:
        """Withdraw the plan of `device` (None: every device) and apply the events before
        now, so that the daemon may change the scheduler itself. False if a device's
        mutex stayed busy: the change must wait (`change`), or two jobs could hold one
        device; once busy for FENCE_S, the device is fenced and the change goes on."""
        if self.plane is None:
            return True
        done = True
        for name in [device] if device is not None else self.plane.devices():
            if not self.plane.has(name):
                continue
            if self._drain(name, invalidate=True) is not None:
                self._stuck.pop(name, None)
            elif self._stuck.setdefault(name, self.sched.clock()) \
                    <= self.sched.clock() - FENCE_S:
                self._fence(name)  # given up on: the change goes on without its table
            else:
                done = False
        return done

    def change(self, device: str | None, change: Callable[[], None]) -> None:
        """Run `change` (of the scheduler on `device`; None: every device) now, or once
        the table's events before it are applied, in the order the changes came."""
        if not self._backlog and self.settle(device):
            _run(change)
        else:
            self._backlog.append((device, change))

    def run_backlog(self) -> None:
        """Run the deferred changes whose devices can be drained now (`settle` fences a
        device whose mutex stayed busy for FENCE_S)."""
        while self._backlog:
            device, change = self._backlog[0]
            if not self.settle(device):
                return
            self._backlog.popleft()
            _run(change)

    def _fence(self, device: str) -> None:
        """Give up on a device whose mutex stayed busy for FENCE_S (only a rank stopped
        inside its few instructions holds it that long): apply what its ring holds, and
        let its ranks use their sockets from now on."""
        since = self._stuck.pop(device)
        self._deliver(self.plane.fence(self.sched, device))
        log.warning("the slot table's mutex of %s stayed busy for %.0f s (a rank stopped "
                    "inside it? pids there: %s): its ranks use the socket path from now "
                    "on", device, self.sched.clock() - since, self._pids_on(device))

    def _drain(self, device: str, invalidate: bool) -> int | None:
        # A busy mutex (a rank stopped inside it) is tried again on the next loop.
        self.replan.add(device)
        got = self.plane.drain(self.sched, device, invalidate)
        if got is None:
            return None
        self._deliver(got[0])
        return got[1]

    def publish_plans(self) -> None:
        """Apply the events that came and publish each touched device's next plan."""
        for device in list(self.replan):
            if self.plane is None or not self.plane.has(device) \
                    or device not in self.sched.devices():
                # the socket path, or no rank left there: no plan to publish (the events
                # of ranks that left are dropped when applied; the next rank's drain
                # finds them gone)
                self.replan.discard(device)
                continue
            for _ in range(3):  # events keep coming: they ring again, so stop trying soon
                seq = self._drain(device, invalidate=False)
                if seq is not None and self.plane.publish(self.sched, device, seq):
                    self.replan.discard(device)
                    break
