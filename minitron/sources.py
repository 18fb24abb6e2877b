"""The constants the lessons quote, each with its value and where it comes from.

A number in a lesson's prose is either printed by one of that lesson's cells (so a run that
disagrees shows it) or is one of these: a paper's table or section, a data sheet, a format's
definition. tests/test_lesson_numbers.py holds the lessons to that. The GPUs' figures are not
repeated here: they are minitron/hardware.py's, and `constants()` lists them with the rest.
"""
from __future__ import annotations

import dataclasses

from .hardware import GPUS, ring_link


@dataclasses.dataclass(frozen=True)
class Constant:
    value: float
    unit: str
    source: str


CONSTANTS = {
    # number formats
    "fp16_max": Constant(65504, "", "IEEE 754-2008 binary16: largest finite value (2 - 2^-10) * 2^15"),
    "e4m3_max": Constant(448, "", "OCP 8-bit floating point specification (2023), E4M3: largest finite 1.75 * 2^8"),
    "e4m3_eps": Constant(0.125, "", "OCP FP8 specification, E4M3: 3 mantissa bits, eps 2^-3"),
    "e5m2_eps": Constant(0.25, "", "OCP FP8 specification, E5M2: 2 mantissa bits, eps 2^-2"),
    # models and runs
    "gpt2_vocab": Constant(50257, "tokens", "Radford et al. 2019 (GPT-2), section 2.2: a vocabulary of 50,257"),
    "gpt3_params": Constant(175e9, "parameters", "Brown et al. 2020 (GPT-3), Table 2.1: 96 layers, h 12288, 96 heads"),
    "gpt3_hidden": Constant(12288, "", "Brown et al. 2020, Table 2.1: GPT-3 175B, d_model 12288"),
    "gpt3_batch": Constant(1536, "sequences", "Narayanan et al. 2021, section 5.1: GPT-3 175B, batch 1536 on 1024 A100s"),
    "narayanan_175b_tflops": Constant(140e12, "FLOP/s per GPU", "Narayanan et al. 2021, section 5.1: 140 TFLOP/s per GPU"),
    "llama3_params": Constant(405e9, "parameters", "Llama 3 (Dubey et al. 2024): the 405B model"),
    "llama3_unexpected": Constant(419, "interruptions", "Dubey et al. 2024, section 3.3.4 / Table 5: 419 unexpected interruptions in a 54-day snapshot"),
    "llama3_snapshot_days": Constant(54, "days", "Dubey et al. 2024, section 3.3.4: the 54-day snapshot of pre-training"),
    "llama3_vocab": Constant(128256, "tokens", "Llama 3's tokenizer (Dubey et al. 2024, section 3.1: 128K tokens), 128,256 in its config"),
    "llama3_8b_ffn": Constant(14336, "", "Dubey et al. 2024, Table 3: Llama 3 8B, FFN dimension 14,336"),
    "deepseek_v3_comm_sms": Constant(20, "SMs", "DeepSeek-V3 technical report (2024), section 3.2.2: 20 of the H800's SMs for communication"),
    "fa2_fwd_low": Constant(0.50, "", "Dao 2023 (FlashAttention-2), abstract: 50-73% of the A100's peak"),
    "fa2_fwd_high": Constant(0.73, "", "Dao 2023 (FlashAttention-2), abstract: 50-73% of the A100's peak"),
}


def hardware_constants() -> dict[str, Constant]:
    """The data-sheet figures of minitron/hardware.py, and the link model's bus bandwidths."""
    out = {}
    for key, g in GPUS.items():
        sheet = f"{g.name} data sheet (minitron/hardware.py)"
        out[f"{key}_peak"] = Constant(g.peak_flops, "FLOP/s", sheet + ": dense 16-bit peak")
        out[f"{key}_hbm"] = Constant(g.hbm_bw, "B/s", sheet + ": HBM bandwidth")
        out[f"{key}_memory"] = Constant(g.memory_bytes, "B", sheet + ": memory")
        out[f"{key}_nvlink"] = Constant(g.nvlink_bw, "B/s", sheet + ": NVLink per direction")
        out[f"{key}_nvlink_both"] = Constant(2 * g.nvlink_bw, "B/s", sheet + ": NVLink, both directions")
        out[f"{key}_nic_share"] = Constant(g.net_bw, "B/s", sheet + ": its share of the node's NICs")
        out[f"{key}_matmul_achieved"] = Constant(g.peak_flops * g.matmul_eff, "FLOP/s",
                                                 "best large GEMM, minitron/hardware.py (Bekman's benchmark)")
        out[f"{key}_matmul_eff"] = Constant(g.matmul_eff, "", "minitron/hardware.py")
        out[f"{key}_sms"] = Constant(g.sms, "SMs", sheet + ": streaming multiprocessors (the H800 has the H100's)")
        out[f"{key}_ridge"] = Constant(g.peak_flops / g.hbm_bw, "FLOP/B", sheet + ": peak over HBM bandwidth")
        for eff in ("hbm_eff", "nvlink_eff", "net_eff"):
            out[f"{key}_{eff}"] = Constant(getattr(g, eff), "", "minitron/hardware.py")
        for k in (1, 2, 4, 8):
            out[f"{key}_ring_{k}_per_node"] = Constant(ring_link(g, 64, k)[0], "B/s",
                                                       f"minitron/hardware.py ring_link, {k} members per node")
        out[f"{key}_ring_nvlink"] = Constant(ring_link(g, 8, 8)[0], "B/s", "minitron/hardware.py ring_link, one node")
    return out


def constants() -> dict[str, Constant]:
    """Every cited constant: this table and the hardware model's."""
    return {**CONSTANTS, **hardware_constants()}


__all__ = ["Constant", "CONSTANTS", "constants", "hardware_constants"]
