"""Grading: a learner's answer cells run inside the reference solution, under nbval.

cli.py merges the notebooks, runs nbval and gives each notebook its verdict (python -m
minitron.grade); report.py turns nbval's per-cell record into lines a learner can act on;
recorded.py says which torch a reference's stored outputs were recorded with; plugin.py is the
pytest plugin nbval's process loads (copied beside the graded notebooks and imported as a
module of its own, so that process never imports minitron or torch).
"""
