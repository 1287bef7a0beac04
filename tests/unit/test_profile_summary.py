"""The step breakdown of train.profile, on hand-made Chrome trace events whose answer is known."""

from __future__ import annotations

import pytest

from shardforge.train.profile_summary import CATEGORIES, breakdown, comm_kind, table

MAIN, WORKER = 1, 2


def span(name: str, ts: float, dur: float, tid: int = MAIN, cat: str = "cpu_op") -> dict:
    return {"ph": "X", "name": name, "ts": ts, "dur": dur, "tid": tid, "cat": cat}


def annotation(name: str, ts: float, dur: float) -> dict:
    return span(name, ts, dur, cat="user_annotation")


@pytest.mark.parametrize(
    ("name", "kind"),
    [
        ("c10d::allreduce_", "all_reduce"),
        ("c10d::_allgather_base_", "all_gather"),
        ("c10d::_reduce_scatter_base_", "reduce_scatter"),
        ("c10d::alltoall_base_", "all_to_all"),
        ("c10d::send", "send_recv"),
        ("c10d::recv_", "send_recv"),
        ("c10d::broadcast_", "other_comm"),
        ("_c10d_functional::all_gather_into_tensor", "all_gather"),
        ("_c10d_functional::wait_tensor", "wait"),
        ("_c10d_functional::_wrap_tensor_autograd", None),
        ("gloo:all_reduce", "all_reduce"),
        ("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL", "reduce_scatter"),
        ("ncclDevKernel_AllGather_RING_LL", "all_gather"),
        ("ncclDevKernel_SendRecv", "send_recv"),
        ("aten::mm", None),
        ("aten::scatter_add_", None),
    ],
)
def test_collectives_are_named_by_kind(name, kind):
    assert comm_kind(name) == kind


def test_each_instant_of_a_cpu_step_goes_to_one_category():
    """A 100 us step: data 0-10; a matmul 10-40 while gloo's worker all-gathers 20-60 (overlapped until 40,
    exposed 40-60); a norm 60-80 whose all-reduce is issued and waited for inside its span (exposed: the
    innermost operator is the wait); the optimizer phase 80-100 with Adam's math 85-95; idle elsewhere."""
    events = [
        annotation("shardforge.step", 0, 100),
        annotation("shardforge.data", 0, 10),
        span("aten::mm", 10, 30),
        span("c10d::_allgather_base_", 18, 2),
        span("gloo:all_gather", 20, 40, tid=WORKER),
        span("aten::linalg_vector_norm", 60, 20),
        span("_c10d_functional::all_reduce", 61, 2),
        span("_c10d_functional::wait_tensor", 64, 12),
        span("gloo:all_reduce", 63, 13, tid=WORKER),
        annotation("shardforge.optimizer", 80, 20),
        span("aten::_foreach_add_", 85, 10),
    ]
    b = breakdown(events)
    assert b.steps == 1 and b.step_ms == pytest.approx(0.1)
    us = {k: round(v * 1e3, 6) for k, v in b.categories.items()}
    # compute: mm 10-18 and 20-40 (18-20 is the c10d call), the norm's own 60-61, 63-64 and 76-80
    assert us == {
        "compute": 8 + 20 + 1 + 1 + 4,
        "all_reduce": 2 + 12,
        "all_gather": 2 + 20,
        "reduce_scatter": 0,
        "all_to_all": 0,
        "send_recv": 0,
        "other_comm": 0,
        "data": 10,
        "optimizer": 20,
        "idle": 0,
    }
    assert sum(b.categories.values()) == pytest.approx(b.step_ms)
    assert b.comm_total["all_gather"] * 1e3 == pytest.approx(2 + 40)
    assert b.exposed_comm_share == pytest.approx(0.36)


def test_gaps_are_idle_and_steps_are_averaged():
    events = [
        annotation("shardforge.step", 0, 50),
        span("aten::mm", 0, 20),
        annotation("shardforge.step", 100, 30),
        span("aten::mm", 100, 30),
        span("aten::mm", 60, 30),  # between the steps: not counted
    ]
    b = breakdown(events, rank=3)
    assert (b.rank, b.steps) == (3, 2)
    assert b.step_ms == pytest.approx(0.04)
    assert b.categories["compute"] == pytest.approx(0.025) and b.categories["idle"] == pytest.approx(0.015)


def test_on_cuda_kernels_decide_and_overlapped_nccl_is_not_exposed():
    """Kernels: compute 0-50, NCCL all-reduce 30-70 (exposed 50-70); the optimizer's kernels 80-90 inside
    its GPU annotation; the CPU's data wait 90-100 while the GPU has nothing to do."""
    gpu = 7
    events = [
        annotation("shardforge.step", 0, 100),
        span("sm80_xmma_gemm", 0, 50, tid=gpu, cat="kernel"),
        span("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 30, 40, tid=gpu, cat="kernel"),
        span("shardforge.optimizer", 78, 14, tid=gpu, cat="gpu_user_annotation"),
        span("multi_tensor_apply_kernel", 80, 10, tid=gpu, cat="kernel"),
        annotation("shardforge.data", 90, 10),
    ]
    b = breakdown(events)
    us = {k: round(v * 1e3, 6) for k, v in b.categories.items() if v}
    assert us == {"compute": 50, "all_reduce": 20, "optimizer": 12, "data": 10, "idle": 8}


def test_a_trace_without_profiled_steps_is_an_error():
    with pytest.raises(ValueError, match=r"shardforge\.step"):
        breakdown([span("aten::mm", 0, 1)])


def test_the_table_shows_the_categories_used():
    events = [annotation("shardforge.step", 0, 10), span("c10d::allreduce_", 0, 5)]
    text = table([breakdown(events, 0), breakdown(events, 1)])
    head = text.splitlines()[0].split()
    assert {"compute", "all_reduce", "data", "optimizer", "idle"} <= set(head)
    assert "all_gather" not in head and len(CATEGORIES) > len(head) - 4
    assert text.splitlines()[2].split()[-1] == "50.0%"


@pytest.mark.parametrize(
    ("start", "steps", "run", "window", "warned"),
    [
        (10, 3, (0, 100), (10, 12), None),
        (10, 3, (0, 11), (10, 11), "only steps 10..11"),  # the run ends inside the window
        (10, 3, (10, 100), (11, 12), "only steps 11..12"),  # resumed inside it
        (10, 3, (20, 100), None, "nothing is profiled"),  # resumed after it
    ],
)
def test_the_profiled_window_is_clipped_to_the_steps_this_run_trains(
    tmp_path, start, steps, run, window, warned
):
    from shardforge.config.schema import ProfileSection
    from shardforge.log import collected
    from shardforge.train.profiling import StepProfiler

    with collected() as warnings:
        profiler = StepProfiler(ProfileSection(start=start, steps=steps), tmp_path, False, run)
    if window is not None:
        assert (profiler.first, profiler.last) == window
    else:
        assert profiler.first > profiler.last
    assert (warnings == []) if warned is None else (len(warnings) == 1 and warned in warnings[0])
