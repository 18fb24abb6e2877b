"""Planted wrong answer for exercises/04_pipeline_parallel.ipynb: the span of the run is taken
from time 0 to the last end instead of from the first start (a simulated timeline starts at 0,
so only a measured one, in seconds since some earlier moment, shows it). Check 1's timeline in
seconds, which starts at 100.5, catches it: its bubble comes out near 1."""

WRONG = {
    "e04c0004": '''def bubble_fraction(events, pp):
    span = max(e.end for e in events)          # wrong: assumes the run starts at time 0
    busy = sum(e.end - e.start for e in events)
    return (pp * span - busy) / (pp * span)
''',
}

FAILS_AT = "Check 1"
