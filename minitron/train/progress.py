"""What python -m minitron.train shows while it runs, and the curve it draws at the end."""
from __future__ import annotations

import os


class Progress:
    """One line, rewritten in place on a terminal; a line every 10% otherwise."""

    def __init__(self, fd: int | None, total: int):
        self.out = os.fdopen(fd, "w") if fd is not None else None
        self.total, self.tty = total, self.out is not None and self.out.isatty()

    def header(self, text: str) -> None:
        if self.out is not None:
            self.out.write(text + "\n")

    def show(self, row: dict) -> None:
        if self.out is None:
            return
        n = row["step"]
        filled = int(20 * n / self.total)
        mfu = f"{row['mfu']:.1%}" if row.get("mfu") is not None else "n/a (--peak-tflops)"
        line = (f"step {n:>5}/{self.total} [{'#' * filled}{'.' * (20 - filled)}] loss {row['loss']:.3f}"
                f" | lr {row['lr']:.2e} | {row['tokens_per_s']:,.0f} tok/s | MFU {mfu}")
        if "expert_load" in row:          # 1.0: every expert got the same number of tokens
            line += f" | experts max/mean {row['expert_load']:.2f}"
        if "loss_scale" in row:
            line += f" | loss scale {row['loss_scale']:g}"
        if "eval_loss" in row:
            line += f" | eval {row['eval_loss']:.3f}"
        if self.tty:
            self.out.write("\r" + line + ("\n" if "eval_loss" in row else ""))
        elif "eval_loss" in row or n == 1:
            self.out.write(line + "\n")
        self.out.flush()

    def close(self) -> None:
        if self.out is not None:
            self.out.write("\n" if self.tty else "")
            self.out.close()


def plot(metrics: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([m["step"] for m in metrics], [m["loss"] for m in metrics], label="train")
    ev = [m for m in metrics if "eval_loss" in m]
    ax.plot([m["step"] for m in ev], [m["eval_loss"] for m in ev], "o-", label="held-out")
    ax.set(xlabel="step", ylabel="loss (nats per byte)", title="minitron.train")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
