"""Properties of ``plan --fit``'s step-time model: more bytes, the same
bytes on a slower link, or a larger pipeline bubble never predict a faster
step, whatever the mesh (context and pipeline dims included), the work and
the hardware."""

from __future__ import annotations

import dataclasses

from hypothesis import assume, given
from hypothesis import strategies as st

from fsdptx.cli._hardware import Hardware, predict

MESHES = [
    {"dp_shard": 8},
    {"dp_shard": 32, "tp": 8},
    {"dp_replicate": 4, "dp_shard": 2, "tp": 4},
    {"dp_replicate": 16, "dp_shard": 8, "tp": 2},
    {"dp_shard": 4, "cp": 2, "tp": 2},
    {"pp": 4, "dp_replicate": 2, "dp_shard": 2, "tp": 4},
]
KINDS = ("fsdp_all_gather", "fsdp_reduce_scatter", "hsdp_all_reduce", "tp", "cp_ring", "pp_p2p", "offload_host_copies")
LINKS = ("nvlink", "network", "pcie")

rates = st.floats(min_value=1e6, max_value=1e16, allow_nan=False)
hardware = st.builds(
    Hardware,
    name=st.just("random"),
    flops=rates,
    nvlink=rates,
    network=rates,
    pcie=rates,
    gpus_per_node=st.sampled_from([1, 2, 4, 8, 16]),
    mfu=st.floats(min_value=0.01, max_value=1.0),
)


@st.composite
def steps(draw: st.DrawFn) -> tuple[dict[str, int], dict[str, int], float]:
    mesh = draw(st.sampled_from(MESHES))
    nbytes = {
        k: draw(st.integers(0, 10**12)) if k == "offload_host_copies" or mesh.get(dim, 1) > 1 else 0
        for k, dim in zip(KINDS, ("dp_shard", "dp_shard", "dp_replicate", "tp", "cp", "pp", ""))
    }
    return mesh, nbytes, draw(st.floats(min_value=0, max_value=1e18))


@given(steps(), hardware, st.sampled_from(KINDS), st.integers(1, 10**12))
def test_more_bytes_never_predict_a_faster_step(
    step: tuple[dict[str, int], dict[str, int], float], hw: Hardware, kind: str, more: int
) -> None:
    mesh, nbytes, flops = step
    assume(nbytes[kind] > 0 or kind == "offload_host_copies")  # a dim the mesh lacks carries no bytes
    before = predict(mesh, nbytes, flops, hw, tokens=1.0).total
    after = predict(mesh, {**nbytes, kind: nbytes[kind] + more}, flops, hw, tokens=1.0).total
    assert after >= before


@given(steps(), hardware, st.sampled_from(LINKS), st.floats(min_value=1.0, max_value=1e6))
def test_a_slower_link_never_predicts_a_faster_step(
    step: tuple[dict[str, int], dict[str, int], float], hw: Hardware, link: str, slower: float
) -> None:
    mesh, nbytes, flops = step
    before = predict(mesh, nbytes, flops, hw, tokens=1.0).total
    after = predict(mesh, nbytes, flops, dataclasses.replace(hw, **{link: getattr(hw, link) / slower}), tokens=1.0).total
    assert after >= before


@given(steps(), hardware, st.floats(min_value=0, max_value=1e18))
def test_more_work_never_predicts_a_faster_step(
    step: tuple[dict[str, int], dict[str, int], float], hw: Hardware, more: float
) -> None:
    mesh, nbytes, flops = step
    assert predict(mesh, nbytes, flops + more, hw, tokens=1.0).total >= predict(mesh, nbytes, flops, hw, tokens=1.0).total


@given(steps(), hardware, st.floats(min_value=0, max_value=100), st.floats(min_value=0, max_value=100))
def test_a_larger_pipeline_bubble_never_predicts_a_faster_step(
    step: tuple[dict[str, int], dict[str, int], float], hw: Hardware, bubble: float, more: float
) -> None:
    mesh, nbytes, flops = step
    before = predict(mesh, nbytes, flops, hw, tokens=1.0, bubble=bubble).total
    assert predict(mesh, nbytes, flops, hw, tokens=1.0, bubble=bubble + more).total >= before
