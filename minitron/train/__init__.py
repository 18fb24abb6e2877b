"""The training system: the engine that takes a step, its command line, checkpoints, data.

engine.py    TrainingRun: one training step (and evaluation) on any grid it supports
cli.py       python -m minitron.train: the shipped corpus on any grid, progress, metrics, samples
data.py      the byte-level corpus, its token file and the loader each data-parallel rank reads
checkpoint.py, checkpoint_*.py
             distributed checkpoints (torch.distributed.checkpoint): atomic, checksummed,
             loadable on another grid; checkpoint.py saves and loads, _manifest its format
             and checks, _pieces the placements, _planners DCP's planners, _fp8 and _bias
             the state that lives in the manifest
hf.py        GPT-2 and Llama-style weights from and to transformers (`pip install -e .[hf]`)
"""
