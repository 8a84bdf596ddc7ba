"""The PyTorch hooks wait for allreduces by sleeping between polls, not by spinning."""

from __future__ import annotations

import types

import pytest

pytest.importorskip("horovod.torch")


def test_synchronize_polls_with_sleeps_then_calls_horovods(monkeypatch):
    import horovod.torch.mpi_ops as mpi_ops

    import crossover.hooks._lifecycle as lifecycle
    import crossover.hooks.torch as hooks_torch

    polls = {"h1": 3, "h2": 1}  # polls left before each handle reports done

    def fake_poll(handle):
        polls[handle] -= 1
        return polls[handle] <= 0

    slept = []
    monkeypatch.setattr(mpi_ops, "poll", fake_poll)
    monkeypatch.setattr(lifecycle.time, "sleep", slept.append)
    calls = []
    opt = types.SimpleNamespace(_handles={"p1": ("h1", None), "p2": (None, None),
                                          "p3": ("h2", None)})
    hooks = object.__new__(hooks_torch._SlotHooks)
    hooks.opt = opt
    # another job shares the device
    hooks.life = lifecycle.SlotLifecycle(types.SimpleNamespace(keeps_device=lambda: False), [opt])
    assert hooks._synchronize(lambda: calls.append("horovod") or "done") == "done"
    assert calls == ["horovod"]  # Horovod's synchronize still finishes the step
    assert polls == {"h1": 0, "h2": 0}
    assert len(slept) == 2 and all(0 < s <= 5e-4 for s in slept)

    # keeps the device (alone, or concurrent: plain co-location): Horovod's own wait
    polls.update(h1=3, h2=1)
    slept.clear()
    hooks.life.client = types.SimpleNamespace(keeps_device=lambda: True)
    assert hooks._synchronize(lambda: "done") == "done"
    assert polls == {"h1": 3, "h2": 1} and slept == []
