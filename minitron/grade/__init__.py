"""Grading: a learner's answer cells run inside the reference solution; the verdict is made here.

cli.py grades a list of notebooks (python -m minitron.grade): job.py merges each learner notebook
into its reference and reads what each cell must show, run_job.py runs it and judges each cell;
kernel.py runs the merged cells in a kernel of their own and brings back only data (statuses,
exceptions, shown values), a kernel forked from forkserver.py's server, which has imported torch; course_copy.py writes the throwaway copy of the package that kernel
imports; values.py is what check cells call (`show(label, value)`) and judge.py compares what
they showed with the reference's; report.py names cells and failures in words; recorded.py says
which torch a reference's stored outputs were recorded with.
"""
