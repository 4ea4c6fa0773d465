"""The thread governor against modelled machines: a fake clock advances by what a step would cost on
each thread count, so each test is exact and instant. (Its effect on a real busy machine is measured
in docs/benchmarks.md, not here.)"""

import pytest

from inferno import cpu_quota
from inferno.runtime.threads import PROBE_COST, ThreadGovernor, _ladder


class Machine:
    """Seconds a one-token step takes on each thread count, changeable mid-run."""

    def __init__(self, costs: dict[int, float]):
        self.costs, self.now, self.applied, self.notices = costs, 0.0, [], []

    def governor(self, most: int, others: float | None = None) -> ThreadGovernor:
        gov = ThreadGovernor(most, apply=self.applied.append, clock=lambda: self.now, others=lambda: others)
        gov.notice = self.notices.append
        return gov

    def run(self, gov: ThreadGovernor, steps: int, tokens: int = 1) -> list[int]:
        counts = []
        for _ in range(steps):
            with gov.step(tokens) as threads:
                self.now += self.costs[threads] * tokens
            counts.append(threads)
        return counts


QUIET = {2: 0.008, 1: 0.013}  # two threads 1.6x one, as on the quiet 2-core machine
BUSY = {2: 0.060, 1: 0.014}  # one busy neighbour: two threads wait on each other's preemption


def test_a_quiet_machine_keeps_every_thread_and_probing_costs_little():
    machine = Machine(QUIET)
    gov = machine.governor(2)
    counts = machine.run(gov, 1000)
    assert gov.current == 2 and machine.notices == []
    assert counts.count(1) <= 12  # probes, spaced further apart as each loses
    assert machine.now <= 1000 * QUIET[2] * (1 + PROBE_COST)


def test_a_busy_machine_moves_to_one_thread_at_once_and_says_so_once():
    machine = Machine(BUSY)
    gov = machine.governor(2)
    counts = machine.run(gov, 64)
    assert counts[:3] == [2, 1, 1]  # one step on two threads, then the probe wins
    assert gov.current == 1
    assert len(machine.notices) == 1 and "1 of 2 threads" in machine.notices[0]
    assert "4.3x faster" in machine.notices[0]
    # Probes back to two threads are the slow steps; they are spaced so that they cost little.
    assert machine.now <= 64 * BUSY[1] * 1.25


def test_load_arriving_and_leaving_is_followed_both_ways():
    machine = Machine(dict(QUIET))
    gov = machine.governor(2)
    machine.run(gov, 100)
    assert gov.current == 2
    machine.costs.update(BUSY)  # a neighbour starts: the current count's time jumps
    counts = machine.run(gov, 10)
    assert gov.current == 1 and counts.index(1) <= 4
    machine.costs.update(QUIET)  # it stops: the next probe up wins
    machine.run(gov, 300)
    assert gov.current == 2
    assert len(machine.notices) == 1  # said once per process


def test_the_first_count_follows_how_busy_others_kept_the_cpus_at_start_up(monkeypatch):
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    machine = Machine(BUSY)
    gov = machine.governor(2, others=0.9)  # a neighbour spun while the command started
    assert gov.settle() == 1 and machine.applied == [1]  # the warm-up runs on it too
    assert "kept 0.9 CPUs busy" in machine.notices[0] and "1 of 2 threads" in machine.notices[0]
    counts = machine.run(gov, 64)
    assert counts.count(2) == 0  # no slow probe of two threads in a short run
    quiet = Machine(QUIET)
    gov = quiet.governor(2, others=0.2)
    assert quiet.run(gov, 3)[0] == 2 and quiet.notices == []
    unknown = Machine(QUIET)
    assert unknown.governor(2, others=None).settle() == 2


def test_one_thread_swinging_with_time_slices_is_no_reason_to_probe(monkeypatch):
    """Two neighbours on two cores: one thread's steps run 17 ms with a core to itself, 36 ms sharing
    one, in phases of a few steps. Only the spaced probes try two threads (each a slow step)."""
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    machine = Machine({2: 0.200, 1: 0.017})
    gov = machine.governor(2, others=1.8)
    counts = []
    for phase in range(60):
        machine.costs[1] = 0.017 if phase % 2 else 0.036
        counts += machine.run(gov, 4)
    assert counts.count(2) <= 1  # 240 steps: at most the one probe spaced for a 200 ms step


def test_steps_of_different_sizes_are_compared_only_with_their_like():
    machine = Machine(QUIET)
    gov = machine.governor(2)
    for _ in range(50):
        machine.run(gov, 1, tokens=1)
        machine.run(gov, 1, tokens=200)  # slower in total, not a sign of load
    assert gov.current == 2


def test_a_fixed_count_is_used_for_every_step_and_never_probed():
    machine = Machine(BUSY)
    gov = machine.governor(2)
    gov.fix(2)
    assert set(machine.run(gov, 100)) == {2}
    assert machine.notices == [] and set(machine.applied) == {2}
    gov.fix(None)
    machine.run(gov, 5)
    assert gov.current == 1


def test_larger_pools_probe_down_a_ladder_of_halves():
    assert _ladder(8) == [8, 4, 2, 1] and _ladder(6) == [6, 3, 1] and _ladder(1) == [1]
    machine = Machine({8: 0.050, 4: 0.010, 2: 0.012, 1: 0.020})
    gov = machine.governor(8)
    machine.run(gov, 400)
    assert gov.current == 4
    one = Machine({1: 0.01})
    gov = one.governor(1)
    assert set(one.run(gov, 50)) == {1}


@pytest.mark.parametrize(("files", "expected"), [
    ({"cpu.max": "150000 100000\n"}, 1),
    ({"cpu.max": "400000 100000\n"}, 4),
    ({"cpu.max": "50000 100000\n"}, 1),  # half a CPU still runs one thread
    ({"cpu.max": "max 100000\n"}, None),
    ({"cpu/cpu.cfs_quota_us": "200000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 2),
    ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None),
    ({"cpu.max": "garbage"}, None),
    ({}, None),
])
def test_cpu_quota_reads_cgroup_v2_and_v1(tmp_path, files, expected):
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert cpu_quota(str(tmp_path)) == expected
