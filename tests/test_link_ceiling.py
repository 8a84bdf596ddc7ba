"""The makespan floor of a pair of jobs taking turns, from the allreduce's measured link
efficiencies (bench/colocation/link_ceiling.py; pure)."""

from __future__ import annotations

import pytest

from bench.colocation.link_ceiling import ceiling


@pytest.mark.parametrize(("compute", "link", "one", "two", "floor"), [
    (9.0, 17.0, 1.0, 1.0, 17.0),   # a perfect link: the link bound itself
    (9.0, 17.0, 0.9, 1.0, 17.9),   # one stream leaves 10% idle while the other computes
    (4.0, 10.0, 0.5, 0.8, 14.0),   # 4 s at half the link, the other 8 s of it at 0.8
    (10.0, 5.0, 0.9, 1.0, 10.0),   # compute-heavy: the compute bound
    (10.0, 9.5, 0.9, 1.0, 10.5),   # one stream sends 9 of the link's 9.5 s meanwhile
])
def test_ceiling_table(compute: float, link: float, one: float, two: float,
                       floor: float) -> None:
    assert ceiling(compute, link, one, two) == pytest.approx(floor, abs=0.01)
