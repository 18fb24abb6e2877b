"""The refusal a row raises (Refused), and how it names options: `--flag value` for a
command line (FLAGS), `field=value` for Python."""
from __future__ import annotations

from ..config import option_name as _name

class Refused(ValueError):
    """A refused combination: names the options (`--flag value` through as_flags, for a command
    line; `field=value` as str, for Python), why, and options that work (its fixes)."""

    def __init__(self, name: str, template: str, values: dict, fixes=()):
        self.name, self.template, self.values = name, template, dict(values)
        self.fixes = [dict(f) for f in fixes]
        super().__init__(self._render(None))

    def __reduce__(self):                 # picklable: a rank may send one back
        return type(self), (self.name, self.template, self.values, self.fixes)

    def as_flags(self, flags: dict[str, str] | None = None) -> str:
        return self._render({**FLAGS, **(flags or {})})

    def fixes_text(self, flags: dict[str, str] | None = None) -> str:
        return " or ".join(" ".join(_name(f, v, flags, fix=True) for f, v in fix.items())
                           for fix in self.fixes)

    def _render(self, flags: dict[str, str] | None) -> str:
        text = self.template.format(**{f: _name(f, v, flags) for f, v in self.values.items()})
        return text + ("; use " + self.fixes_text(flags) if self.fixes else "")


# Options' fields -> the flags both command lines give them
FLAGS = {"tp": "--tp", "pp": "--pp", "dp": "--dp", "cp": "--cp", "ep": "--ep",
         "virtual_pp": "--virtual", "sequence_parallel": "--sp",
         "tp_comm_overlap": "--tp-comm-overlap", "cp_variant": "--cp-variant",
         "dp_shard": "--dp-shard", "n_experts": "--experts", "capacity_factor": "--capacity-factor",
         "aux_loss_scope": "--aux-loss-scope",
         "tie_embeddings": "--tie", "recompute": "--recompute", "use_kernels": "--kernels",
         "dtype": "--dtype", "fp8_recipe": "--fp8-recipe", "zero": "--zero",
         "fp8_amax_unreduced": "--no-fp8-amax-reduce",
         "schedule": "--schedule", "reference_routing": "--reference-routing"}
