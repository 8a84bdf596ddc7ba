"""The PyTorch hooks wait for allreduces by sleeping between polls, not by spinning."""

from __future__ import annotations

import types

import pytest

pytest.importorskip("horovod.torch")


def test_synchronize_polls_with_sleeps_then_calls_horovods(monkeypatch):
    import horovod.torch.mpi_ops as mpi_ops

    import crossover.hooks.torch as hooks_torch

    polls = {"h1": 3, "h2": 1}  # polls left before each handle reports done

    def fake_poll(handle):
        polls[handle] -= 1
        return polls[handle] <= 0

    slept = []
    monkeypatch.setattr(mpi_ops, "poll", fake_poll)
    monkeypatch.setattr(hooks_torch.time, "sleep", slept.append)
    calls = []
    opt = types.SimpleNamespace(_handles={"p1": ("h1", None), "p2": (None, None),
                                          "p3": ("h2", None)})
    hooks = object.__new__(hooks_torch._SlotHooks)
    hooks.opt = opt
    hooks.client = types.SimpleNamespace(alone=lambda: False)  # another job shares the device
    assert hooks._synchronize(lambda: calls.append("horovod") or "done") == "done"
    assert calls == ["horovod"]  # Horovod's synchronize still finishes the step
    assert polls == {"h1": 0, "h2": 0}
    assert len(slept) == 2 and all(0 < s <= 5e-4 for s in slept)

    # alone on the device: nobody needs the CPU, so Horovod's own (fastest) wait
    polls.update(h1=3, h2=1)
    slept.clear()
    hooks.client = types.SimpleNamespace(alone=lambda: True)
    assert hooks._synchronize(lambda: "done") == "done"
    assert polls == {"h1": 3, "h2": 1} and slept == []
