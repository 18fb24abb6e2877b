"""Groups inside groups: dp cut into shard x replicate (HSDP), cp into all-to-all x ring.

Two dimensions of the grid split once more, the faster digit inside (neighbouring ranks, as
tp's are, so the inner group is the one that stays inside a node):

    dp = dp_shard * dp_replicate     dp_rank = shard_rank + dp_shard * replicate_rank
    cp = cp_a2a * cp_ring            cp_rank = a2a_rank + cp_a2a * ring_rank

Hybrid sharded data parallelism (torchtitan's HSDP, Megatron-FSDP's hybrid mode, DeepSpeed's
ZeRO++ hpZ) shards the ZeRO state over the ranks that hold the same weights *and* the same
shard group, and replicates it across groups; hierarchical context parallelism (Megatron-
Core's "a2a+p2p") runs Ulysses' all-to-all inside cp_a2a and the ring across cp_ring.

  dense_dp_shard  dense weights' ZeRO shards       (cp x ep x dp_shard: all-gathers and
                                                    reduce-scatters stay in here)
  dp_cp_shard     expert weights' ZeRO shards      (cp x dp_shard)
  dp_replicate    copies of one shard              (only the gradient all-reduce crosses it)
  cp_a2a          Ulysses inside                   (q, k, v and out: all-to-all)
  cp_ring         the ring across                  (K/V blocks: send/recv)

With dp_shard = dp (the default) the shard groups are dense_dp and dp_cp themselves, and
dp_replicate has one rank: nothing new is built and nothing changes.
"""
from __future__ import annotations

from ..config import ConfigError, divisors, near

# a split dimension -> its two digits, fastest first
SPLITS = {"dp": ("dp_shard", "dp_replicate"), "cp": ("cp_a2a", "cp_ring")}

# group name -> the digits (and whole dimensions) that vary inside it
SUBGROUP_DIMS = {
    "dense_dp_shard": ("cp", "ep", "dp_shard"), "dp_cp_shard": ("cp", "dp_shard"),
    "dp_replicate": ("dp_replicate",), "cp_a2a": ("cp_a2a",), "cp_ring": ("cp_ring",),
}
# an inner group that spans its whole dimension (dp_shard = dp, cp_a2a = cp) is this existing one
SAME_WHEN_WHOLE = {"dense_dp_shard": ("dp", "dense_dp"), "dp_cp_shard": ("dp", "dp_cp"),
                   "cp_a2a": ("cp", "cp")}
INNER = {dim: inner for dim, (inner, _) in SPLITS.items()}


def split_size(cfg, dim: str) -> int:
    """The inner digit's size of `dim` (dp_shard or cp_a2a; None, the default, is all of dim)."""
    value = getattr(cfg, INNER[dim])
    return getattr(cfg, dim) if value is None else value


def same_group(cfg, name: str) -> str | None:
    """The existing group `name` equals on this config, if any (then nothing new is built)."""
    dim, same = SAME_WHEN_WHOLE.get(name, (None, None))
    return same if dim is not None and split_size(cfg, dim) == getattr(cfg, dim) else None


def digit_sizes(cfg) -> dict[str, int]:
    """Every digit of a rank's number, fastest first: tp, cp_a2a, cp_ring, ep, dp_shard, ..."""
    out = {}
    for d, n in cfg.sizes().items():
        if d in SPLITS:
            inner, outer = SPLITS[d]
            out[inner] = split_size(cfg, d)
            out[outer] = n // out[inner]
        else:
            out[d] = n
    return out


def expand(dims) -> tuple[str, ...]:
    """Whole dimensions written as their digits (dp -> dp_shard, dp_replicate)."""
    return tuple(x for d in dims for x in SPLITS.get(d, (d,)))


def settle_splits(cfg) -> None:
    """ParallelConfig's check of dp_shard and cp_a2a. The whole dimension is stored as None,
    the default, so that equal splits compare equal and dataclasses.replace(cfg, dp=8) keeps
    'all of dp' rather than an old number (hierarchical cp keeps its cp_a2a as given)."""
    hierarchical = cfg.cp_variant == "hierarchical"
    if hierarchical and cfg.cp_a2a is None:
        raise ConfigError("{cp_variant} needs the all-to-all group's size, cp_a2a (a divisor "
                          "of {cp})", {"cp_variant": "hierarchical", "cp": cfg.cp},
                          [{"cp_a2a": d} for d in range(2, cfg.cp) if cfg.cp % d == 0][:1]
                          or [{"cp_variant": "ulysses"}])
    if not hierarchical and cfg.cp_a2a not in (None, cfg.cp):
        raise ConfigError("{cp_a2a} sizes the all-to-all group of the hierarchical variant, "
                          "not of {cp_variant}", {"cp_a2a": cfg.cp_a2a, "cp_variant": cfg.cp_variant},
                          [{"cp_variant": "hierarchical"}, {"cp_a2a": None}])
    check_split(cfg, "dp", "dp_shard", "ZeRO shards over dp_shard ranks, dp/dp_shard replicas")
    check_split(cfg, "cp", "cp_a2a", "Ulysses runs inside cp_a2a ranks, the ring across cp/cp_a2a")
    if cfg.dp_shard == cfg.dp:
        object.__setattr__(cfg, "dp_shard", None)        # frozen: set once, here
    if cfg.cp_a2a == cfg.cp and not hierarchical:
        object.__setattr__(cfg, "cp_a2a", None)


def check_split(cfg, dim: str, inner: str, why: str) -> None:
    """inner must divide dim (ConfigError naming both and divisors that work)."""
    value, whole = getattr(cfg, inner), getattr(cfg, dim)
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1 or whole % value:
        good = [d for d in divisors(whole) if d != value]
        fixes = near(good, value) if isinstance(value, int) and not isinstance(value, bool) else good[-1:]
        raise ConfigError("{%s} must divide {%s}: %s" % (inner, dim, why),
                          {inner: value, dim: whole}, [{inner: v} for v in fixes])
