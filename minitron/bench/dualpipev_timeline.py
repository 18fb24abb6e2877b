"""The dualpipev bench's figures of a measured timeline (bench/dualpipev.py): pure functions of
pairs.recording()'s segments ("compute" | "all_to_all", action label, start, end)."""
from __future__ import annotations

import re
import statistics

from ..pipeline.actions import Event, Timeline
from ..pipeline.simulate import Costs
from .intervals import inside as _inside, union as _union   # module names: the tests plant here

_LABEL = re.compile(r"^(BW|F|B|W)(\d+)@s(\d+)$")


def _ms(segments: list) -> list:
    return [(k, lab, 1e3 * a, 1e3 * b) for k, lab, a, b in segments]


def hidden_share(segments: list[tuple[str, str, float, float]]) -> dict:
    """One rank's recorded segments -> all-to-all seconds in flight, how many of them inside
    another action's compute, and their share."""
    comm_s = inside = 0.0
    for kind, label, s, e in segments:
        if kind != "all_to_all":
            continue
        others = _union([(cs, ce) for k, lab, cs, ce in segments if k == "compute" and lab != label])
        comm_s += e - s
        inside += _inside(s, e, others)
    return {"comm": comm_s, "inside": inside, "exposed": comm_s - inside,
            "hidden": inside / comm_s if comm_s else 0.0}


def fitted_costs(segments: list[tuple[str, str, float, float]]) -> Costs:
    """Per-stage Costs (a rank holds 2 chunks: an action costs half) from a run without overlap:
    each kind's median compute per action, and the median all-to-all time per F / B / BW."""
    compute: dict[str, float] = {}
    comm_s: dict[str, float] = {}
    for kind, label, s, e in segments:
        (comm_s if kind == "all_to_all" else compute)[label] = \
            (comm_s if kind == "all_to_all" else compute).get(label, 0.0) + e - s
    by_kind = lambda k: [t for lab, t in compute.items() if _LABEL.match(lab)[1] == k]
    med = lambda xs: statistics.median(xs) if xs else None
    f, bw, b, w = (med(by_kind(k)) for k in ("F", "BW", "B", "W"))
    w = w if w is not None else bw / 2
    b = (bw - w) if bw is not None else b
    a2a = med([t for lab, t in comm_s.items() if _LABEL.match(lab)[1] != "W"]) or 0.0
    return Costs(F=2 * f, B=2 * max(b, 0.0), W=2 * w, comm=2 * a2a)


def measured_timeline(step: dict, ep_rank: int = 0) -> tuple[Timeline, dict[int, list]]:
    """One step as seen by ep rank `ep_rank` of every pipeline rank, in seconds from the step's
    first start: the executor's events (a Timeline) and each pipeline rank's recorded segments."""
    t0 = min(r["span"][0] for r in step["ranks"])
    mine = [r for r in step["ranks"] if r["ep"] == ep_rank]
    events = [Event(e.rank, e.kind, e.microbatch, e.stage, e.start - t0, e.end - t0)
              for r in mine for e in r["events"]]
    segments = {r["pp"]: [(k, lab, a - t0, b - t0) for k, lab, a, b in r["segments"]] for r in mine}
    return Timeline("dualpipev", len(mine), events), segments


def simulated_hidden(schedule, costs: Costs) -> float:
    """The simulator's share of the all-to-all hidden: each pair hides min(compute, comm) of
    the two halves together (simulate.py's max), over all the rank's all-to-all time."""
    hidden = total = 0.0
    for r, acts in schedule.actions.items():
        for a in acts:
            if not a.is_message:
                total += float(costs.parts(a.kind, 2)[1])
        for f, bw in schedule.overlapped.get(r, ()):
            (cf, nf), (cb, nb) = costs.parts(f.kind, 2), costs.parts(bw.kind, 2)
            hidden += float(min(cf + cb, nf + nb))
    return hidden / total if total else 0.0
