"""The launcher's allocator settings for its workers (runtime/memory.py)."""

from __future__ import annotations

from shardtune.runtime.cpu_tuning import HUGE_PAGES, worker_malloc_env


def test_cpu_workers_get_huge_pages_and_gpu_workers_nothing():
    assert worker_malloc_env("cpu", {}) == {"GLIBC_TUNABLES": HUGE_PAGES}
    assert worker_malloc_env("cuda", {}) == {}


def test_the_users_tunables_are_kept_and_their_own_choice_wins():
    assert worker_malloc_env("cpu", {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}) == {
        "GLIBC_TUNABLES": f"glibc.malloc.arena_max=2:{HUGE_PAGES}"}
    assert worker_malloc_env("cpu", {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}) == {}
    assert worker_malloc_env("cpu", {"SHARDTUNE_MALLOC": "default"}) == {}
