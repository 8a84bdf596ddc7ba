"""The slot lifecycle the PyTorch adapters share (hooks/_lifecycle.py): its pure logic,
with a stand-in client that records calls. The adapters under mpirun are covered by
tests/test_mpi_core.py and tests/test_callbacks.py."""

from __future__ import annotations

import types

import pytest

pytest.importorskip("torch")

from crossover.hooks import _lifecycle  # noqa: E402
from crossover.hooks._lifecycle import SlotLifecycle  # noqa: E402
from crossover.protocol import Phase  # noqa: E402


class RecordingClient:
    """The part of SlotClient the lifecycle calls, recording the calls."""

    def __init__(self, keeps: bool = False) -> None:
        self.calls: list[str] = []
        self.holding = False
        self.keeps = keeps  # alone on the device: it keeps it

    def acquire(self) -> None:
        self.calls.append("acquire")
        self.holding = True

    def release(self, phase: Phase) -> None:
        self.calls.append(f"release {phase.value}")
        self.holding = False

    def yield_slot(self) -> None:
        self.calls.append("yield")

    def renew(self) -> None:
        self.calls.append("renew")

    def keeps_device(self) -> bool:
        return self.keeps

    def note_wait(self, seconds: float) -> None:
        self.calls.append(f"waited {seconds:g}")


def horovod_opt(*handles) -> types.SimpleNamespace:
    """An object shaped like hvd.DistributedOptimizer: `_handles` and `synchronize`."""
    opt = types.SimpleNamespace(_handles={f"p{i}": (h, None) for i, h in enumerate(handles)})
    opt.synchronize = lambda: "synchronized"
    return opt


def fake_waits(monkeypatch):
    """Freeze the lifecycle's clock; returns `wait(s)`: a synchronize that takes s."""
    now = [0.0]
    monkeypatch.setattr(_lifecycle, "time", types.SimpleNamespace(monotonic=lambda: now[0]))

    def wait(seconds: float):
        return lambda: now.__setitem__(0, now[0] + seconds)
    return wait


def test_one_step_in_order():
    client, opt = RecordingClient(keeps=True), horovod_opt("h1")
    life = SlotLifecycle(client, [opt])
    life.begin_compute()
    life.renew()
    life.end_backward()
    assert life.wait_for_gradients(opt) == "synchronized"
    life.begin_update()
    life.end_step()
    life.close()
    calls = [c for c in client.calls if not c.startswith("waited")]
    assert calls == ["acquire", "renew", "release communicate", "acquire", "yield",
                     "release idle"]


def test_release_only_with_allreduces_in_flight():
    client = RecordingClient()
    accumulating = horovod_opt(None, None)  # backward_passes_per_step > 1: no allreduce yet
    life = SlotLifecycle(client, [accumulating])
    life.begin_compute()
    life.end_backward()
    assert client.holding and client.calls == ["acquire"]  # compute goes on
    accumulating._handles["p1"] = ("h1", None)  # the last pass launched the allreduces
    life.end_backward()
    assert not client.holding and client.calls[-1] == "release communicate"
    life.end_backward()  # again before the wait (step() does): nothing more to release
    assert client.calls == ["acquire", "release communicate"]


def test_caller_marked_backward_end_always_releases():
    client = RecordingClient()
    life = SlotLifecycle(client)  # no optimizers: the loop's own event is the release point
    life.begin_compute()
    life.end_backward()
    assert client.calls == ["acquire", "release communicate"]


def test_device_synchronized_before_release_only(monkeypatch):
    synced = []
    monkeypatch.setattr(_lifecycle, "device_sync", synced.append)
    client, device = RecordingClient(), object()
    life = SlotLifecycle(client, [horovod_opt(None)], device)
    life.begin_compute()
    life.end_backward()  # accumulation pass: the device keeps computing, no sync
    assert synced == []
    life.optimizers = [horovod_opt("h1")]
    life.end_backward()
    assert synced == [device]


def test_crossover_off_still_synchronizes():
    calls = []
    life = SlotLifecycle(None, [horovod_opt("h1")])
    for event in (life.begin_compute, life.renew, life.end_backward, life.begin_update,
                  life.end_step, life.close):
        event()  # no client: no-ops
    assert life.wait_for_gradients(None, lambda: calls.append("horovod")) is None
    assert calls == ["horovod"]  # Lightning's synchronize runs with CROSSOVER_ENABLE=0


def test_wait_ema_follows_the_waits(monkeypatch):
    wait = fake_waits(monkeypatch)
    life = SlotLifecycle(RecordingClient(keeps=True), [])

    assert life.wait_ema_s is None
    life.wait_for_gradients(None, wait(1.0))
    assert life.wait_ema_s == pytest.approx(1.0)  # the first wait is the average
    life.wait_for_gradients(None, wait(2.0))
    assert life.wait_ema_s == pytest.approx(1.0 + _lifecycle.WAIT_EMA_WEIGHT)
    for _ in range(100):
        life.wait_for_gradients(None, wait(0.5))
    assert life.wait_ema_s == pytest.approx(0.5)


def test_the_wait_is_reported_only_after_a_release(monkeypatch):
    # (the daemons compare it across nodes: a wait with the device kept says nothing)
    wait = fake_waits(monkeypatch)
    client = RecordingClient(keeps=True)  # (Horovod's own wait: no handles to poll)
    life = SlotLifecycle(client, None)

    life.begin_compute()
    life.end_backward()
    life.wait_for_gradients(None, wait(0.25))
    life.wait_for_gradients(None, wait(0.5))  # no release before this one
    assert client.calls == ["acquire", "release communicate", "waited 0.25"]


def test_a_wait_the_framework_made_itself_is_reported_from_the_release(monkeypatch):
    # DDP waits for its buckets at the end of backward: from the release to then
    wait = fake_waits(monkeypatch)
    client = RecordingClient()
    life = SlotLifecycle(client, None)

    life.begin_compute()
    life.end_backward()
    wait(0.25)()
    life.allreduces_done()
    life.allreduces_done()  # once a release
    life.begin_update()
    assert client.calls == ["acquire", "release communicate", "waited 0.25", "acquire"]
    SlotLifecycle(None, None).allreduces_done()  # crossover off: nothing to report

    life.end_backward()  # a backward that raised after its release: no wait to report
    life.begin_compute()
    wait(1.0)()
    life.allreduces_done()
    assert not any(c == "waited 1" for c in client.calls)


@pytest.mark.parametrize("pays", [True, False])
def test_quiet_wait_is_decided_by_one_method(monkeypatch, pays):
    quiet = []
    monkeypatch.setattr(SlotLifecycle, "_quiet_wait_pays", lambda self: pays)
    monkeypatch.setattr(SlotLifecycle, "_wait_quietly", lambda self, opt: quiet.append(opt))
    opt = horovod_opt("h1")
    # whatever keeps_device() says: the decision is _quiet_wait_pays's alone
    for keeps in (True, False):
        life = SlotLifecycle(RecordingClient(keeps=keeps), [opt])
        assert life.wait_for_gradients(opt) == "synchronized"
    assert quiet == ([opt, opt] if pays else [])


def test_quiet_wait_pays_in_antiphase_for_waits_that_are_long_enough():
    sharing = SlotLifecycle(RecordingClient(keeps=False))
    assert sharing._quiet_wait_pays()  # nothing measured yet
    sharing.wait_ema_s = _lifecycle.QUIET_MIN_WAIT_S / 2  # a fast allreduce: spin
    assert not sharing._quiet_wait_pays()
    sharing.wait_ema_s = 10 * _lifecycle.QUIET_MIN_WAIT_S
    assert sharing._quiet_wait_pays()
    kept = SlotLifecycle(RecordingClient(keeps=True))  # alone, or served concurrently
    kept.wait_ema_s = 1.0
    assert not kept._quiet_wait_pays()


def test_horovod_optimizer_check():
    opt = horovod_opt("h1")
    assert _lifecycle.horovod_optimizer(opt, "here") is opt
    lightning_optimizer = types.SimpleNamespace(_optimizer=opt, synchronize=None,
                                                _handles=None)
    assert _lifecycle.horovod_optimizer(lightning_optimizer, "here") is opt  # the original
    with pytest.raises(TypeError, match=r"my\.adapter needs the hvd\.DistributedOptimizer.*"
                                        r"got SimpleNamespace.*horovod\.torch\."
                                        r"DistributedOptimizer\(optimizer"):
        _lifecycle.horovod_optimizer(types.SimpleNamespace(), "my.adapter")


def test_allreduces_in_flight():
    assert not _lifecycle.allreduces_in_flight([])
    assert not _lifecycle.allreduces_in_flight([horovod_opt(None), horovod_opt()])
    assert _lifecycle.allreduces_in_flight([horovod_opt(None), horovod_opt(None, "h")])
