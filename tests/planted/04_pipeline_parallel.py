"""Planted wrong answer for exercises/04_pipeline_parallel.ipynb: the wait before a rank's first
action is measured from time 0 instead of from the run's first start (a simulated timeline starts
at 0, so only a measured one, in seconds since some earlier moment, shows it). Check 1's timeline
in seconds, which starts at 100.5, catches it: rank 0 waits 100.5 s and the bubble comes out
near 1."""

WRONG = {
    "e04c0004": '''def idle_parts(events, pp):
    last = max(e.end for e in events)
    parts = {}
    for r in range(pp):
        mine = [e for e in events if e.rank == r]
        start, end = min(e.start for e in mine), max(e.end for e in mine)
        busy = sum(e.end - e.start for e in mine)
        parts[r] = (start, (end - start) - busy, last - end)    # wrong: waits counted from 0
    return parts
''',
}

FAILS_AT = "Check 1"
