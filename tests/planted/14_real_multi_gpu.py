"""Planted wrong answer for exercises/14_real_multi_gpu.ipynb: the device is cuda:RANK, the global
rank, instead of cuda:LOCAL_RANK, the classic bug of a script that works on one node (where the two
are equal) and asks for a GPU that does not exist on every other node."""

# answer-cell id -> the learner's WHOLE cell source
WRONG = {
    "c14s03": '''def rank_placement(env, gpus_here):
    per_node = int(env["LOCAL_WORLD_SIZE"])
    backend = "nccl" if gpus_here >= per_node else "gloo"
    device = f"cuda:{int(env['RANK'])}" if backend == "nccl" else "cpu"   # wrong: the global rank
    return backend, device, int(env["RANK"]) // per_node
''',
}

# The grader's summary line must contain "FAIL at " + FAILS_AT.
FAILS_AT = "Check 1"
