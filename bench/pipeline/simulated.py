"""The simulated side of bench/pipeline/compare.py: each example model profiled on this
machine, planned by the graph partitioner and the sequential baseline under the same costs
and memory limit, and both plans simulated; the multi-branch models again with every
width scaled up; and both searches timed on a synthetic 1000-op multi-branch graph.

Imported by compare.py, not run itself.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from crossover.pipeline import (
    Costs,
    Graph,
    graph_partition,
    profile,
    schedule_for,
    sequential_partition,
    simulate,
    synthetic,
)
from crossover.pipeline.models import DLRM, CandleUno, TwoTowerTransformer, build
from crossover.pipeline.profile import Link, Runtime

LINK = Link(bandwidth=2e9, latency=30e-6)
BATCH = 256
# Fit `fixed + per_sample * b` at the two ends of the candidate micro-batch range (4..128):
# the plans mostly pick 64-128, and a slope measured at 8 and 32 extrapolated to 128
# swung gpp_vs_spp by +-0.2 between runs.
PROFILE_SIZES = (8, 128)
TIMED = ("fwd", "fwd_per_sample", "bwd", "bwd_per_sample")


def median_costs(runs: list[Costs]) -> Costs:
    """Element-wise median of independent profiles' times (sizes are deterministic)."""
    first = runs[0]
    ops = {n: replace(c, **{f: statistics.median(getattr(r.ops[n], f) for r in runs)
                            for f in TIMED}) for n, c in first.ops.items()}
    return replace(first, ops=ops)


def with_memory(costs: Costs) -> float:
    """Set the device memory limit; returns the model's parameter state in bytes."""
    state = sum(c.param_bytes for c in costs.ops.values()) * costs.param_factor
    # A device holds 60% of the model's parameter state (+4 MiB for activations): neither
    # one device nor (for Uno) pure data parallelism fits, so both partitioners pipeline.
    costs.memory = 0.6 * state + 4 * 1024 * 1024
    return state


def model_costs(module: torch.nn.Module, make_inputs: Callable[[int], dict], repeats: int,
                profiles: int) -> tuple[Graph, Costs, list[Costs], float]:
    """Graph, median costs, the single profiles (each with the memory limit), state bytes."""
    g = Graph.from_fx(module)
    runs = [profile(g, make_inputs, sizes=PROFILE_SIZES, repeats=repeats, link=LINK)
            for _ in range(profiles)]
    for c in runs:
        with_memory(c)
    costs = median_costs(runs)
    return g, costs, runs, with_memory(costs)


def simulated(g: Graph, costs: Costs, devices: int, runs: list[Costs] | None = None) -> dict:
    """Both partitioners on the identical graph and costs; `runs`: also the ratio under
    each single profile (how much the answer moves with measurement noise)."""
    row: dict[str, Any] = {}
    for kind, fn in (("graph", graph_partition), ("sequential", sequential_partition)):
        plan = fn(g, costs, devices, BATCH)
        sim = simulate(g, costs, plan, schedule_for(plan))
        row[kind] = {"plan": plan.describe(), "search_s": plan.search_s,
                     "iteration_s": sim.iteration_s, "samples_per_s": sim.samples_per_s,
                     "bubble": sim.bubble, "peak_memory": max(sim.peak_memory),
                     "stages": len(plan.stages), "micro_batch": plan.micro_batch,
                     "notes": plan.notes}
    row["gpp_vs_spp"] = row["graph"]["samples_per_s"] / row["sequential"]["samples_per_s"]
    row["search_speedup"] = row["sequential"]["search_s"] / row["graph"]["search_s"]
    if runs:
        row["gpp_vs_spp_per_profile"] = [simulated(g, c, devices)["gpp_vs_spp"] for c in runs]
    return row


def wider_space(g: Graph, costs: Costs, devices: int = 8) -> dict:
    """The graph search with and without stages that cut inside branches, each
    simulated against the sequential plan (`gpp_vs_spp`) on the same costs."""
    seq = sequential_partition(g, costs, devices, BATCH)
    seq_s = simulate(g, costs, seq, schedule_for(seq)).iteration_s
    row: dict[str, Any] = {"devices": devices, "sequential_iteration_s": seq_s}
    for key, wider in (("with", True), ("without", False)):
        plan = graph_partition(g, costs, devices, BATCH, wider=wider)
        sim = simulate(g, costs, plan, schedule_for(plan)).iteration_s
        row[key] = {"plan": plan.describe(), "iteration_s": sim, "gpp_vs_spp": seq_s / sim,
                    "search_s": plan.search_s}
    row["with_over_without"] = row["without"]["iteration_s"] / row["with"]["iteration_s"]
    return row


def scaled_model(name: str, scale: int) -> tuple[torch.nn.Module, Callable[[int], dict]]:
    """A multi-branch example model with every width (and DLRM's vocabulary) x `scale`;
    the same structure as `models.build(name)`, which is scale 1."""
    torch.manual_seed(0)
    if name == "two_tower":
        m = TwoTowerTransformer(d=64 * scale, ff=128 * scale)
    elif name == "dlrm":
        m = DLRM(vocab=1000 * scale, d=32 * scale, bottom=256 * scale, top=256 * scale)
    elif name == "uno":
        m = CandleUno(tuple(d * scale for d in (128, 256, 256)), 256 * scale, 3, 256 * scale, 2)
    else:
        raise KeyError(f"no scaled variant of {name!r}")

    def make_inputs(b: int) -> dict:
        gen = torch.Generator().manual_seed(0)
        if name == "two_tower":
            return {"tokens": torch.randint(0, m.embed.num_embeddings, (b, 16), generator=gen),
                    "patches": torch.randn(b, 16, m.patch.in_features, generator=gen)}
        if name == "dlrm":
            return {"dense": torch.randn(b, m.bottom[0].in_features, generator=gen),
                    "sparse": torch.randint(0, m.embs[0][0].num_embeddings, (b, m.tables),
                                            generator=gen)}
        return {k: torch.randn(b, t[0].in_features, generator=gen)
                for k, t in zip(("cell", "drug1", "drug2"), m.towers, strict=True)}

    return m, make_inputs


def big_graph(ops: int = 1000, seed: int = 0, memory_share: float | None = None):
    """A multi-branch graph of `ops` ops: blocks of 3-4 parallel chains joined in series.
    With `memory_share`, ops hold parameters (none, 100 kB or 1 MB each) and a device
    holds that share of the model's parameter state, so plans must pipeline."""
    rng = random.Random(seed)
    nodes, prev, i = [], "x", 0
    while i < ops - 60:
        outs = []
        for _br in range(rng.choice([3, 4])):
            p = prev
            for _ in range(rng.randint(15, 40)):
                name = f"op{i}"
                nodes.append((name, lambda *xs: xs[0], [p]))
                p, i = name, i + 1
            outs.append(p)
        name = f"join{i}"
        nodes.append((name, lambda *xs: xs[0], outs))
        prev, i = name, i + 1
    g = Graph.from_modules(["x"], nodes)
    per = {n: rng.uniform(1e-5, 1e-4) for n in g.ops}
    if memory_share is None:
        return g, synthetic(g, per, fixed=2e-5, act_per_sample=4096.0, link=LINK)
    params = {n: rng.choice([0.0, 1e5, 1e6]) for n in g.ops}
    costs = synthetic(g, per, fixed=2e-5, act_per_sample=4096.0, param_bytes=params,
                      link=LINK)
    costs.memory = memory_share * costs.param_factor * sum(params.values())
    return g, costs


def search_times(g: Graph, costs: Costs, reps: int, devices: int = 8) -> dict:
    """Both searches on one graph at `devices` devices (micro-batches of 8 and 32): wall
    times (medians of `reps`), the plans' estimates and simulated iterations."""
    rows: dict[str, list] = {"graph": [], "sequential": []}
    plans = {}
    for _ in range(reps):
        for kind, fn in (("graph", graph_partition), ("sequential", sequential_partition)):
            t0 = time.perf_counter()
            plans[kind] = fn(g, costs, devices, BATCH, micro_batches=[8, 32])
            rows[kind].append(time.perf_counter() - t0)
    graph_s, seq_s = statistics.median(rows["graph"]), statistics.median(rows["sequential"])
    sims = {kind: simulate(g, costs, p, schedule_for(p)).iteration_s
            for kind, p in plans.items()}
    return {"ops": len(g), "devices": devices, "micro_batches": [8, 32],
            "graph_simulated_s": sims["graph"], "sequential_simulated_s": sims["sequential"],
            "graph_s_median": graph_s, "graph_s_all": rows["graph"],
            "sequential_s_median": seq_s, "sequential_s_all": rows["sequential"],
            "search_speedup": seq_s / graph_s,
            "graph_estimate_s": plans["graph"].estimate,
            "sequential_estimate_s": plans["sequential"].estimate,
            "gpp_vs_spp_estimate": plans["sequential"].estimate / plans["graph"].estimate,
            "graph_plan": [[len(s.ops), s.replicas] for s in plans["graph"].stages],
            "notes": plans["graph"].notes[:3]}


def model_entry(name: str, runtime: Runtime, repeats: int, profiles: int
                ) -> tuple[Graph, Costs, dict[str, Any]]:
    """One example model profiled and simulated: its graph, its median costs (with the
    runner's costs, unstretched) and its row (2, 4 and 8 devices; the wider space)."""
    spec = build(name)
    g, costs, runs, state = model_costs(spec.module, lambda b, s=spec: s.make_batch(b, 0)[0],
                                        repeats, profiles)
    # simulated devices each have their own core: the runner's costs, no stretch
    per_device = replace(runtime, cores=0)
    costs = replace(costs, runtime=per_device)
    runs = [replace(c, runtime=per_device) for c in runs]
    entry: dict[str, Any] = {
        "ops": len(g), "param_state_bytes": state, "memory_limit": costs.memory,
        "simulated": {str(d): simulated(g, costs, d, runs if profiles > 1 else None)
                      for d in (2, 4, 8)}}
    if name in ("uno", "dlrm"):
        entry["wider_space"] = wider_space(g, costs)
        print(name, "8 devices, with and without cuts inside branches",
              {k: round(entry["wider_space"][k]["gpp_vs_spp"], 3)
               for k in ("with", "without")}, flush=True)
    return g, costs, entry


def scaled_rows(scales: list[int], repeats: int, profiles: int) -> dict[str, dict]:
    """The multi-branch models with every width x each of `scales`, simulated."""
    rows = {}
    for scale in scales:
        for name in ("two_tower", "dlrm", "uno"):
            module, make_inputs = scaled_model(name, scale)
            g, costs, runs, state = model_costs(module, make_inputs, repeats, profiles)
            sims = {}
            for d in (2, 4, 8):
                try:
                    sims[str(d)] = simulated(g, costs, d, runs if profiles > 1 else None)
                except ValueError as exc:  # PartitionError: nothing fits on so few devices
                    sims[str(d)] = {"error": str(exc)}
            rows[f"{name}_x{scale}"] = {
                "scale": scale, "ops": len(g), "param_state_bytes": state,
                "memory_limit": costs.memory, "simulated": sims}
            print(f"{name} x{scale}", {d: round(v["gpp_vs_spp"], 3) for d, v in sims.items()
                                       if "gpp_vs_spp" in v}, flush=True)
    return rows


def search_rows(reps: int, devices: int, label: str) -> dict[str, dict]:
    """Both searches on the 1000-op graph, with unbounded and with bounded memory."""
    rows = {}
    for variant, memory_share in (("unbounded memory", None), ("memory-bound", 0.3)):
        g, costs = big_graph(memory_share=memory_share)
        row = search_times(g, costs, reps, devices=devices)
        rows[variant] = row
        print(label, variant, {k: row[k] for k in (
            "graph_s_median", "sequential_s_median", "gpp_vs_spp_estimate")}, flush=True)
    return rows
