"""colibri/usage.py (usage history, stats files, pin choice, autopin) and colibri/budget.py (RAM plan).
"""
import hashlib
import os

import numpy as np
import pytest


from colibri import usage
from colibri import budget
GB = 1_000_000_000
MB = 1_000_000


# -- counts files ----------------------------------------------------------------------------------

def test_save_then_load_round_trip_and_exact_format(tmp_path):
    c = np.zeros((3, 5), np.int64)
    c[2, 0], c[0, 4], c[0, 1], c[1, 3] = 7, 2, 10**12, 1
    p = tmp_path / "usage.txt"
    usage.save_counts(p, c)
    assert p.read_text() == "0 1 1000000000000\n0 4 2\n1 3 1\n2 0 7\n"
    assert not (tmp_path / "usage.txt.tmp").exists()
    got, skipped = usage.load_counts(p, 3, 5)
    assert got.dtype == np.int64 and np.array_equal(got, c) and skipped == 0
    c[1, 3] = 0                                     # overwrite in place, atomically
    usage.save_counts(str(p), c)
    assert "1 3" not in p.read_text()
    usage.save_counts(p, np.zeros((2, 2), np.int64))
    assert p.read_text() == ""


def test_load_ignores_comments_blank_lines_and_sums_repeats(tmp_path):
    p = tmp_path / "stats"
    p.write_text("# layer eid count\n\n  0 1 5   # hot\n\t1\t2\t3\n0 1 2\n   \n")
    got, skipped = usage.load_counts(p, 2, 4)
    assert got[0, 1] == 7 and got[1, 2] == 3 and got.sum() == 10 and skipped == 0


def test_load_skips_and_counts_records_outside_the_shape(tmp_path):
    p = tmp_path / "stats"
    p.write_text("0 0 1\n5 0 9\n0 4 9\n-1 0 9\n1 3 2\n")
    got, skipped = usage.load_counts(p, 2, 4)
    assert skipped == 3 and got.sum() == 3 and got[1, 3] == 2


@pytest.mark.parametrize("line", ["0 1", "0 1 2 3", "a 1 2", "0 1 2.5", "0 1 -3", "0x1 1 1",
                                  "0 1 \u0663", "0 1 \xff"])
def test_malformed_line_names_file_and_line(tmp_path, line):
    p = tmp_path / "bad_stats"
    p.write_bytes(f"0 0 1\n# fine\n{line}\n".encode("utf-8" if "\xff" not in line else "latin-1"))
    with pytest.raises(ValueError, match=rf"bad_stats:3: "):
        usage.load_counts(p, 4, 4)


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError):
        usage.load_counts(tmp_path / "none", 2, 2)
    got, skipped = usage.load_counts(tmp_path / "none", 2, 3, missing_ok=True)
    assert got.shape == (2, 3) and not got.any() and skipped == 0


def test_save_rejects_bad_counts_and_leaves_no_tmp(tmp_path):
    p = tmp_path / "u"
    with pytest.raises(ValueError):
        usage.save_counts(p, np.array([[1, -1]]))
    with pytest.raises(ValueError):
        usage.save_counts(p, np.array([1, 2]))
    assert list(tmp_path.iterdir()) == []


# -- usage_path ------------------------------------------------------------------------------------

def test_usage_path_in_a_writable_model_folder(tmp_path, monkeypatch):
    monkeypatch.delenv("COLIBRI_USAGE_DIR", raising=False)
    assert usage.usage_path(tmp_path) == os.path.join(str(tmp_path), ".colibri_usage")


def test_usage_dir_override(tmp_path, monkeypatch):
    monkeypatch.setenv("COLIBRI_USAGE_DIR", str(tmp_path / "hist"))
    p = usage.usage_path(tmp_path / "model")
    assert os.path.dirname(p) == str(tmp_path / "hist") and os.path.isdir(tmp_path / "hist")


def test_usage_path_falls_back_to_the_user_cache(tmp_path, monkeypatch):
    monkeypatch.delenv("COLIBRI_USAGE_DIR", raising=False)
    model = tmp_path / "site-packages" / "colibri" / "models" / "default"
    model.mkdir(parents=True)
    real_access = os.access
    monkeypatch.setattr(usage.os, "access", lambda p, m: False if str(p) == str(model) else real_access(p, m))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    got = usage.usage_path(model)
    digest = hashlib.sha256(str(model).encode()).hexdigest()[:16]
    assert got == str(tmp_path / "xdg" / "colibri" / "usage" / f"{digest}.txt")
    assert (tmp_path / "xdg" / "colibri" / "usage").is_dir()
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    got = usage.usage_path(model)
    assert got == str(tmp_path / "home" / ".cache" / "colibri" / "usage" / f"{digest}.txt")
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/dir")       # not absolute: ignored (XDG rule)
    assert usage.usage_path(model) == got
    # A relative model path hashes as its absolute path.
    monkeypatch.chdir(model.parent)
    assert usage.usage_path("default") == got


# -- pins and autopin ------------------------------------------------------------------------------

def test_choose_pins_ranking_and_ties():
    c = np.zeros((3, 4), np.int64)
    c[1, 2] = 9
    c[0, 3] = 5
    c[2, 0] = 5
    c[0, 1] = 5
    c[2, 3] = 1
    got = usage.choose_pins(c, 4 * 100, [100, 100, 100])
    assert got == [(1, 2), (0, 1), (0, 3), (2, 0)]      # count desc, then layer, then eid
    assert usage.choose_pins(c, 10**9, [100] * 3)[-1] == (2, 3)
    assert len(usage.choose_pins(c, 10**9, [100] * 3)) == 5   # zero counts never pinned
    assert usage.choose_pins(c, 99, [100] * 3) == []
    assert usage.choose_pins(c, 0, [100] * 3) == []
    assert usage.choose_pins(np.zeros((2, 2), np.int64), 10**9, [1, 1]) == []


def test_choose_pins_budget_with_larger_mtp_row():
    c = np.zeros((3, 4), np.int64)
    c[2, 1] = 100           # MTP row, 250-byte experts
    c[0, 0] = 50
    c[1, 0] = 40
    c[0, 2] = 30
    got = usage.choose_pins(c, 400, [100, 100, 250])
    assert got == [(2, 1), (0, 0)]                       # 250 + 100; 50 left: nothing else fits
    got = usage.choose_pins(c, 300, [100, 100, 250])
    assert got == [(2, 1)]
    got = usage.choose_pins(c, 200, [100, 100, 250])     # the MTP expert does not fit: passed over
    assert got == [(0, 0), (1, 0)]
    got = usage.choose_pins(c, 10**6, [100, 0, 250])     # row 1 has no experts (dense layer)
    assert got == [(2, 1), (0, 0), (0, 2)]
    total = sum([100, 100, 250][l] for l, _ in usage.choose_pins(c, 333, [100, 100, 250]))
    assert total <= 333


def test_autopin_budget():
    avail = 40 * GB
    assert usage.autopin_budget(4999, avail) == 0
    assert usage.autopin_budget(5000, avail) == int(avail * 0.5 * 5000 / 200000)   # 0.5 GB: at the floor
    assert usage.autopin_budget(100000, avail) == 10 * GB
    assert usage.autopin_budget(10**7, avail) == 20 * GB                         # confidence capped at 1
    assert usage.autopin_budget(5000, 30 * GB) == 0                              # 0.375 GB < 0.5 GB
    assert usage.autopin_budget(10**6, 0) == 0 and usage.autopin_budget(10**6, -5) == 0
    # Small models: the floor scales with the expert size.
    floor = usage.autopin_floor(300_000)
    assert floor == 2_400_000
    assert usage.autopin_floor(10 * GB) == 500_000_000
    assert usage.autopin_budget(200000, 10 * MB) == 0                            # 5 MB < 0.5 GB
    assert usage.autopin_budget(200000, 10 * MB, min_bytes=floor) == 5 * MB
    assert usage.autopin_budget(200000, 4 * MB, min_bytes=floor) == 0            # 2 MB < 2.4 MB


# -- available memory ------------------------------------------------------------------------------

def write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_mem_available_parsing_and_cgroup_clamp(tmp_path):
    mi = tmp_path / "meminfo"
    write(mi, "MemTotal:       24684096 kB\nMemFree:  100 kB\nMemAvailable:   2000000 kB\n")
    none = tmp_path / "no-cgroup"
    assert budget.linux_mem_available_bytes(mi, tmp_path / "cg", none) == 2000000 * 1024
    write(tmp_path / "old", "MemFree: 10 kB\nBuffers: 5 kB\nCached: 20 kB\n")
    assert budget.linux_mem_available_bytes(tmp_path / "old", tmp_path / "cg", none) == 35 * 1024
    assert budget.linux_mem_available_bytes(tmp_path / "missing", tmp_path / "cg", none) == 0
    # cgroup v2: limit 1 GB, 700 MB used of which 100 MB inactive file cache -> 400 MB allowed
    pc = tmp_path / "self_cgroup"
    write(pc, "0::/app/job\n")
    cg = tmp_path / "cg2"
    write(cg / "app" / "job" / "memory.max", "1000000000\n")
    write(cg / "app" / "job" / "memory.current", "700000000\n")
    write(cg / "app" / "job" / "memory.stat", "anon 600000000\ninactive_file 100000000\n")
    assert budget.linux_mem_available_bytes(mi, cg, pc) == 400_000_000
    write(cg / "app" / "job" / "memory.max", "max\n")          # unlimited leaf, limited parent
    write(cg / "app" / "memory.max", "1500000000\n")
    write(cg / "app" / "memory.current", "1000000000\n")
    assert budget.linux_mem_available_bytes(mi, cg, pc) == 500_000_000
    # cgroup v1, namespaced (the mount shows the process's own cgroup)
    write(pc, "4:memory:/process_api/abc\n0::/\n")
    cg1 = tmp_path / "cg1"
    write(cg1 / "memory" / "memory.limit_in_bytes", "9223372036854771712\n")   # no limit
    write(cg1 / "memory" / "memory.usage_in_bytes", "4263960576\n")
    write(cg1 / "memory" / "memory.stat", "total_inactive_file 1\n")
    assert budget.linux_mem_available_bytes(mi, cg1, pc) == 2000000 * 1024
    write(cg1 / "memory" / "memory.limit_in_bytes", "3000000000\n")
    write(cg1 / "memory" / "memory.usage_in_bytes", "900000000\n")      # 2.1 GB allowed
    assert budget.linux_mem_available_bytes(mi, cg1, pc) == 2000000 * 1024         # MemAvailable is lower
    write(cg1 / "memory" / "memory.usage_in_bytes", "2900000000\n")
    assert budget.linux_mem_available_bytes(mi, cg1, pc) == 100_000_001


def test_mem_available_on_this_machine_is_a_number():
    assert budget.mem_available_bytes() >= 0


# -- the RAM plan ----------------------------------------------------------------------------------

def check_sum(plan):
    comp = plan.components()
    assert sum(comp.values()) == plan.projected_peak_bytes
    assert all(isinstance(v, int) and not isinstance(v, bool) for v in comp.values())
    assert plan.projected_peak_bytes <= plan.budget_bytes
    assert plan.lru_bytes == plan.capacity * plan.n_moe_rows * plan.expert_bytes
    assert plan.mtp_bytes == plan.capacity * plan.mtp_expert_bytes


BASE = dict(resident_bytes=2 * GB, kv_bytes=300 * MB, work_bytes=200 * MB, expert_bytes=20 * MB,
            n_moe_rows=10, n_experts=64)


def test_auto_capacity_is_the_largest_that_fits():
    ram = 15 * GB
    plan = budget.plan_ram(**BASE, requested_capacity=0, ram_bytes=ram, mtp_expert_bytes=40 * MB)
    check_sum(plan)
    assert 1 <= plan.capacity < 64 and plan.streaming and plan.page_cache_reserve_bytes == 2_500_000_000
    bigger = budget.plan_ram(**BASE, requested_capacity=plan.capacity + 1, ram_bytes=ram,
                             mtp_expert_bytes=40 * MB)
    assert bigger.capacity == plan.capacity and bigger.notes       # cap + 1 does not fit: lowered
    # Hand check: fixed = 2.5 GB + 40 MB buffers (largest row) ; per capacity step 10·20 + 40 = 240 MB;
    # call = 16·40 MB ; reserve 2.5 GB -> (15000 - 2540 - 640 - 2500) / 240 = 38.8 -> 38
    # (all 64 without the reserve would need 2540 + 64·240 = 17900 MB)
    assert plan.capacity == 38
    assert plan.buffers_bytes == 40 * MB and plan.call_bytes == 16 * 40 * MB
    assert plan.mtp_bytes == 38 * 40 * MB
    assert plan.expert_avail_bytes == ram - (2 * GB + 300 * MB + 200 * MB + 40 * MB + 640 * MB + 2_500_000_000)
    everything = budget.plan_ram(**BASE, requested_capacity=0, ram_bytes=17_900 * MB, mtp_expert_bytes=40 * MB)
    assert everything.capacity == 64 and everything.projected_peak_bytes == 17_900 * MB
    check_sum(everything)


def test_everything_fits_no_streaming_no_reserve():
    plan = budget.plan_ram(**BASE, requested_capacity=0, ram_bytes=100 * GB)
    check_sum(plan)
    assert plan.capacity == 64 and not plan.streaming
    assert plan.page_cache_reserve_bytes == 0 and plan.call_bytes == 0 and plan.notes == []
    forced = budget.plan_ram(**BASE, requested_capacity=0, ram_bytes=100 * GB, streaming=True)
    assert forced.page_cache_reserve_bytes == 2_500_000_000
    check_sum(forced)


def test_requested_capacity_honoured_lowered_or_clamped():
    plan = budget.plan_ram(**BASE, requested_capacity=8, ram_bytes=100 * GB)
    check_sum(plan)
    assert plan.capacity == 8 and plan.notes == [] and plan.streaming
    assert plan.call_bytes == 16 * 20 * MB
    small = budget.plan_ram(**BASE, requested_capacity=8, ram_bytes=6 * GB, prefetch=False)
    check_sum(small)
    # fixed 2.5 GB, call 320 MB, reserve 2.5 GB -> (6000 - 2500 - 320 - 2500) / 200 = 3.4 -> 3
    assert small.capacity == 3 and small.buffers_bytes == 0
    assert any("lowered 8 -> 3" in n for n in small.notes)
    clamped = budget.plan_ram(**BASE, requested_capacity=500, ram_bytes=100 * GB)
    assert clamped.capacity == 64 and any("clamped" in n for n in clamped.notes)
    check_sum(clamped)


def test_pins_reduce_the_lru():
    a = budget.plan_ram(**BASE, requested_capacity=0, ram_bytes=12 * GB)
    b = budget.plan_ram(**BASE, requested_capacity=0, ram_bytes=12 * GB, pin_bytes=2 * GB)
    check_sum(a)
    check_sum(b)
    assert b.pin_bytes == 2 * GB and b.capacity == a.capacity - 10      # 2 GB = 10 capacity steps


def test_small_model_reserve_scales_with_the_model():
    plan = budget.plan_ram(resident_bytes=5 * MB, kv_bytes=MB, work_bytes=MB, expert_bytes=300_000,
                           n_moe_rows=2, n_experts=16, requested_capacity=2, ram_bytes=GB)
    check_sum(plan)
    assert plan.capacity == 2 and plan.page_cache_reserve_bytes == 16 * 2 * 300_000
    custom = budget.plan_ram(resident_bytes=5 * MB, kv_bytes=MB, work_bytes=MB, expert_bytes=300_000,
                             n_moe_rows=2, n_experts=16, requested_capacity=2, ram_bytes=GB,
                             page_cache_reserve=123, extra_call_experts=4)
    assert custom.page_cache_reserve_bytes == 123 and custom.call_bytes == 4 * 300_000
    check_sum(custom)


def test_not_even_one_expert_fits():
    with pytest.raises(ValueError, match=r"needs .*GB.*budget is 3.00 GB \(3000000000 bytes, given\)"):
        budget.plan_ram(**BASE, requested_capacity=4, ram_bytes=3 * GB)


def test_budget_from_available_memory(monkeypatch):
    def boom():
        raise AssertionError("MemAvailable read although ram_bytes was given")
    monkeypatch.setattr(budget, "mem_available_bytes", boom)
    plan = budget.plan_ram(**BASE, requested_capacity=4, ram_bytes=50 * GB)
    assert plan.budget_bytes == 50 * GB and plan.budget_source == "given"
    plan = budget.plan_ram(**BASE, requested_capacity=4, mem_available=50 * GB)
    assert plan.budget_bytes == 44 * GB
    monkeypatch.setattr(budget, "mem_available_bytes", lambda: 25 * GB)
    plan = budget.plan_ram(**BASE, requested_capacity=4)
    assert plan.budget_bytes == 22 * GB and "0.88" in plan.budget_source
    monkeypatch.setattr(budget, "mem_available_bytes", lambda: 0)
    plan = budget.plan_ram(**BASE, requested_capacity=4)
    assert plan.budget_bytes == 8 * GB and any("unknown" in n for n in plan.notes)
    check_sum(plan)


def test_plan_is_deterministic_and_summary_is_one_line():
    a = budget.plan_ram(**BASE, requested_capacity=0, ram_bytes=15 * GB, mtp_expert_bytes=40 * MB)
    b = budget.plan_ram(**BASE, requested_capacity=0, ram_bytes=15 * GB, mtp_expert_bytes=40 * MB)
    assert a == b
    s = a.summary()
    assert "\n" not in s and "38/64" in s and "15.00 GB" in s


def test_bad_plan_arguments():
    with pytest.raises(ValueError):
        budget.plan_ram(**BASE, requested_capacity=-1, ram_bytes=GB)
    with pytest.raises(ValueError):
        budget.plan_ram(**dict(BASE, n_experts=0), requested_capacity=1, ram_bytes=GB)
    with pytest.raises(ValueError):
        budget.plan_ram(**dict(BASE, kv_bytes=-1), requested_capacity=1, ram_bytes=GB)
