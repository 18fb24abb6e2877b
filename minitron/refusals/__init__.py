"""Every combination of options minitron refuses, in one table: which options, why, what works.

    refusals.check(Options.of(pcfg, mcfg, dtype, zero, schedule, fp8), level="engine")

Each option here works on its own; a row names options that do not run (or cannot be compared
with one device) together. The engine (train/engine.py check_supported), the models' builders
(level "model"), both command lines (before any rank starts), `verify --matrix` (its refused
rows) and the README's list (`python -m minitron.refusals --readme README.md` writes it; tests/
test_refusals.py checks it) all read this table, so no two places can disagree.

A row's level says who refuses it:
  model    the split model cannot be built on this grid (ParallelGPT, PipelineGPT, ParallelMoE)
  engine   the engine does not train it (TrainingRun, python -m minitron.train)
  verify   the engine trains it, but the verifier cannot compare it with one device number for
           number (python -m minitron.verify)
Each row's fixes are other values that do run, rendered as flags on a command line and as
fields from Python (like config.py's ConfigError); tests/test_refusals.py checks that each fix
passes the table, and that each row's example is refused by both command lines.

Not here: a value out of range or a size that does not divide (ModelConfig, ParallelConfig,
model/splits.py, the flags' own checks) and a flag that means nothing without another (--sp
without tp > 1, --fp8-recipe without --dtype fp8): those are bad input, not combinations.
This package imports only config.py's option_name (both errors name options alike), so every
floor may read it: options.py (what a run combines), refused.py (the error and its flags),
table.py (the rows), readme.py (shown).
"""
from .options import LEVELS, SIXTEEN_BIT, V_SHAPED, Options
from .readme import BEGIN, END, _example_options, example_options, main, markdown, with_table
from .refused import FLAGS, Refused
from .table import BY_NAME, TABLE, Refusal, check, check_model, refusal

__all__ = ["LEVELS", "SIXTEEN_BIT", "V_SHAPED", "Options", "FLAGS", "Refused", "Refusal", "TABLE",
           "BY_NAME", "refusal", "check", "check_model", "markdown", "example_options",
           "with_table", "BEGIN", "END", "main"]
