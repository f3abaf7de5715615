"""The benchmark helpers that label CPU figures: the machine's facts, and the flag on a decode rate that a
cache, not memory, served."""

from __future__ import annotations

from pathlib import Path

from bench.common import ISA_FLAGS, machine_facts, memory_share, share_label


def test_a_share_above_the_read_rate_is_flagged_cache_bound():
    # 1 GB a token at 20 tok/s is 20 GB/s: 50 % of 40 GB/s, 200 % of 10 GB/s.
    memory = memory_share(10**9, 20.0, 40e9)
    cached = memory_share(10**9, 20.0, 10e9)
    assert memory == {"roofline_share": 0.5, "cache_bound": False}
    assert cached == {"roofline_share": 2.0, "cache_bound": True}
    assert share_label(memory) == "50 %" and share_label(cached) == "200 % (cache-bound)"


def test_machine_facts_name_the_cpu_and_its_instruction_sets():
    facts = machine_facts()
    assert set(facts) == {"date", "cpu", "cpu_id", "cores", "isa", "last_level_cache_bytes"}
    assert set(facts["isa"]) <= set(ISA_FLAGS) and facts["cores"] >= 1
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        flags = next(line for line in cpuinfo.read_text().splitlines() if line.startswith("flags")).split()
        assert facts["isa"] == [f for f in ISA_FLAGS if f in flags]
        assert facts["cpu"] != "unknown"
        if any(line.startswith("cpu family") for line in cpuinfo.read_text().splitlines()):
            assert facts["cpu_id"].startswith("family ") and " model " in facts["cpu_id"]
