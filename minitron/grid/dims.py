"""The grid's dimensions and which of them vary inside each kind of process group."""

DIMS = ("tp", "cp", "ep", "dp", "pp")  # fastest first
CP_VARIANTS = ("ring", "allgather", "ulysses", "hierarchical")

# group name -> the dimensions that vary inside it
GROUP_DIMS = {
    "tp": ("tp",), "cp": ("cp",), "ep": ("ep",), "dp": ("dp",), "pp": ("pp",),
    "dp_cp": ("cp", "dp"), "dense_dp": ("cp", "ep", "dp"), "tp_ep": ("tp", "ep"),
    "ep_dp": ("ep", "dp"),
}
# FP8's amax reduction group (Megatron-Core's): every rank holding a piece or a replica of a dense
# layer's tensors, so one logical tensor is cast with one scale (tensor_parallel/fp8.py)
AMAX_DIMS = ("tp", "cp", "ep", "dp")
