"""FLOPs of one training iteration from the model's shape; tokens/s and MFU.

Narayanan et al. (2021), "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM", appendix: count only the matrix multiplications (2 FLOPs per multiply-add).
A layer's forward over B sequences of s tokens, hidden h (MHA, a 4h GeLU MLP):

    QKV 6Bsh^2, scores QK^T 2Bs^2h, probabilities x V 2Bs^2h, out-projection 2Bsh^2,
    MLP 16Bsh^2                                             = 24Bsh^2 + 4Bs^2h
    the output layer (logits)                               = 2BshV

Backward costs twice the forward (the input's gradient and the weight's), so one iteration
is 3x the forward; full recomputation runs each layer's forward once more (4x for the
layers), which gives the paper's formula

    F = 96 B s l h^2 (1 + s/(6h) + V/(16 l h))          (full recomputation)
    F = 72 B s l h^2 (1 + s/(6h) + V/(12 l h))          (none)

and selective recomputation adds only the attention core's 4Bs^2h per layer. Causal masking
is not discounted (the paper's convention). Grouped-query attention, a different MLP width
and SwiGLU's third matrix are counted from the shape; a mixture-of-experts layer counts its
MLP once per routed expert a token visits (topk) and once per shared expert, each of the
experts' own width (shape.expert_ffn).

Model FLOPs (recomputation not counted) over time and peak is the MFU of Chowdhery et al.
(PaLM); counting the recomputation gives the hardware FLOPs utilisation (HFU), which is what
Narayanan et al. report as "achieved teraFLOP/s per GPU".
"""
from __future__ import annotations

from ..hardware import peak_of
from ..config import ModelConfig
from .activations import RECOMPUTE
from .shape import expert_ffn, mlp_matrices, shared_experts



def layer_forward_flops(cfg: ModelConfig, b: int, s: int, moe: bool = False) -> tuple[int, int]:
    """(matmul FLOPs of one layer's forward outside the attention core, the core's) for b x s;
    `moe`: the layer's MLP is its experts (topk routed + shared, of the experts' width)."""
    h, hd = cfg.hidden, cfg.head_dim
    q, kv = cfg.n_heads * hd, cfg.kv_heads * hd
    mlp = mlp_matrices(cfg) * h * cfg.ffn
    if moe:
        mlp = mlp_matrices(cfg) * h * expert_ffn(cfg) * (cfg.topk + shared_experts(cfg)) + h * cfg.n_experts
    dense = 2 * b * s * (h * (q + 2 * kv) + q * h + mlp)
    core = 2 * 2 * b * s * s * q            # QK^T and PV
    return dense, core


def iteration_flops(cfg: ModelConfig, batch: int, seq: int | None = None,
                    recompute: str = "none") -> int:
    """FLOPs of one iteration (forward + backward [+ recomputation]) over `batch` sequences."""
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute={recompute!r}: choose one of {RECOMPUTE}")
    s = seq or cfg.seq_len
    n_moe = sum(cfg.is_moe_layer(i) for i in range(cfg.n_layers)) if cfg.n_experts else 0
    total = 0
    for layers, moe in ((cfg.n_layers - n_moe, False), (n_moe, True)):
        dense, core = layer_forward_flops(cfg, batch, s, moe)
        extra = {"none": 0, "selective": core, "full": dense + core}[recompute]
        total += layers * (3 * (dense + core) + extra)
    logits = 2 * batch * s * cfg.hidden * cfg.vocab_size
    return total + 3 * logits


def narayanan_flops(b: int, s: int, l: int, h: int, V: int) -> float:
    """The paper's closed form (full recomputation, MHA, 4h MLP)."""
    return 96 * b * s * l * h * h * (1 + s / (6 * h) + V / (16 * l * h))


def narayanan_params(l: int, h: int, V: int, s: int) -> float:
    """The paper's parameter count P = 12 l h^2 (1 + 13/(12h) + (V + s)/(12 l h))."""
    return 12 * l * h * h * (1 + 13 / (12 * h) + (V + s) / (12 * l * h))


def training_seconds(tokens: float, params: float, gpus: int, flops_per_gpu: float,
                     recompute: bool = True) -> float:
    """The paper's end-to-end estimate: 8TP/(nX) with recomputation (6TP/(nX) without)."""
    return (8 if recompute else 6) * tokens * params / (gpus * flops_per_gpu)


def detect_peak() -> tuple[float, str] | None:
    """(peak FLOP/s, device name) of this machine's first GPU if it is one we know, else None."""
    try:
        import torch
        if not torch.cuda.is_available():
            return None
        name = torch.cuda.get_device_name(0)
    except Exception:   # no driver, no torch build with CUDA: nothing to detect
        return None
    peak = peak_of(name)                  # the one data-sheet table: minitron/hardware.py
    return (peak, name) if peak else None


def throughput(cfg: ModelConfig, batch: int, seconds: float, gpus: int = 1,
               peak: float | None = None, recompute: str = "none", seq: int | None = None) -> dict:
    """tokens/s, achieved FLOP/s per GPU, and MFU/HFU against `peak` (per GPU), for an
    iteration of `batch` sequences that took `seconds` on `gpus` devices."""
    if seconds <= 0:
        raise ValueError(f"seconds must be positive, got {seconds}")
    s = seq or cfg.seq_len
    model = iteration_flops(cfg, batch, s, "none")
    hardware = iteration_flops(cfg, batch, s, recompute)
    out = {"tokens/s": batch * s / seconds, "model FLOP/s per GPU": model / seconds / gpus,
           "hardware FLOP/s per GPU": hardware / seconds / gpus}
    if peak:
        out["MFU"] = out["model FLOP/s per GPU"] / peak
        out["HFU"] = out["hardware FLOP/s per GPU"] / peak
    return out
