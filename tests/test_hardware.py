"""minitron/hardware.py's link model: a ring collective's latency is NCCL's own (src/graph/tuning.cc:
a base per collective, a per-step latency inside a node and another across nodes), and its bytes
move at the bus bandwidth of where the group's members sit."""
import pytest

from minitron.hardware import GPUS, cpu, ring_link, ring_seconds

US = 1e-6


@pytest.mark.parametrize("n, per_node, steps_inside, steps_across", [
    (8, 8, 14, 0),          # tp8 in one DGX: 2(n-1) NVLink steps
    (64, 1, 0, 126),        # dp64, one member per node: every step leaves the node
    (64, 8, 112, 14),       # dp64, eight per node: 2(nodes-1) of the 2(n-1) steps cross
])
def test_an_all_reduces_latency_is_nccls_base_and_steps(n, per_node, steps_inside, steps_across):
    """NCCL's Ring/Simple constants: base 8.4 us, 3.4 us an NVLink step, 14 us a network step.
    A zero-byte all-reduce costs exactly that. Fails with a per-step latency alone (no base) or
    with every step of a node-crossing ring charged the network's."""
    g = GPUS["a100"]
    want = 8.4 * US + steps_inside * 3.4 * US + steps_across * 14 * US
    assert ring_seconds(0.0, n, ring_link(g, n, per_node)) == pytest.approx(want)
    assert ring_seconds(0.0, n, ring_link(g, n, per_node), phases=1) == pytest.approx(
        8.4 * US + (steps_inside * 3.4 + steps_across * 14) / 2 * US)


def test_bytes_move_at_the_bus_bandwidth_and_a_measured_cpu_has_no_base():
    g = GPUS["h100"]
    bw, _ = ring_link(g, 8, 8)
    t = ring_seconds(1e9, 8, (bw, 0.0), base=0.0)
    assert t == pytest.approx(2 * 7 / 8 * 1e9 / (g.nvlink_bw * g.nvlink_eff))
    here = cpu(1e11, 1e10, 1e9, 1e-4)
    assert ring_seconds(0.0, 2, ring_link(here, 2, 2), base=here.collective_latency) == pytest.approx(2e-4)
    assert ring_seconds(5.0, 1, ring_link(g, 1, 1)) == 0.0
