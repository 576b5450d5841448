#!/usr/bin/env bash
# gpu_check.sh: what the CPU suite cannot show, on one GPU, in under 5 minutes.
#
#   bash benchmarks/gpu_check.sh          # needs one CUDA GPU and NCCL
#   bash benchmarks/gpu_check.sh --cpu    # the same checks rehearsed on gloo/CPU
#
# 1. parity at world size 1 on NCCL, CUDA numerics (NCCL runs no two ranks on
#    one GPU): FSDP2Manager (dp=1 x tp=1, SP) against the plain model; the
#    dtype-aware pipeline in bf16 (fp32 holders, a bf16 sibling) against fp32;
#    the TP-replica sync and the replica audit; the examples that run on one
#    rank (compose_pipeline.py, tp_sync_torchrun.py) under torchrun;
# 2. the training step of benchmarks/sp_step.py (titan, decoder) against
#    torchtitan's pattern by hand, on the GPU;
# 3. the memory plan (fsdptx.estimate_memory, traced on a fake mesh) against
#    torch.cuda.max_memory_allocated over one steady-state step of the llama
#    preset.
# Then one summary. Parity failures exit 1; timing and memory are figures
# with their targets, not failures. Without a GPU it prints why and exits 0.
# The test suite does not need this script.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 2
PYTHON=${PYTHON:-python}

mode=cuda
case "${1:-}" in
  "") ;;
  --cpu) mode=cpu ;;
  -h | --help) sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
  *) echo "gpu_check: unknown argument '$1' (none, --cpu or --help)" >&2; exit 2 ;;
esac

if [ "$mode" = cuda ]; then
  reason=$("$PYTHON" - 2>&1 <<'PY'
import sys
import torch
import torch.distributed as dist
if not torch.cuda.is_available():
    print("no CUDA GPU visible (torch.cuda.is_available() is False)")
    sys.exit(10)
if not dist.is_nccl_available():
    print(f"torch {torch.__version__} has no NCCL")
    sys.exit(10)
PY
  )
  status=$?
  if [ $status -eq 10 ]; then
    echo "gpu_check: skipped: $reason"
    exit 0
  elif [ $status -ne 0 ]; then
    echo "gpu_check: cannot probe for a GPU with $PYTHON:" >&2
    echo "$reason" >&2
    exit 2
  fi
fi

export PYTHONPATH=".:tests/support:benchmarks${PYTHONPATH:+:$PYTHONPATH}"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
if [ "$(uname -s)" = Linux ] && [ -z "${GLOO_SOCKET_IFNAME:-}" ]; then
  export GLOO_SOCKET_IFNAME=lo
fi
work=$(mktemp -d "${TMPDIR:-/tmp}/fsdptx-gpu-check.XXXXXX")
trap 'rm -rf "$work"' EXIT
results="$work/results.tsv" # section <TAB> check <TAB> ok|FAIL|info <TAB> detail
start=$SECONDS

# ---------------------------------------------------------------- examples
for example in compose_pipeline tp_sync_torchrun; do
  t0=$SECONDS
  if FSDPTX_EXAMPLE_DEVICE=$mode timeout 120 "$PYTHON" -m torch.distributed.run --standalone \
    --nproc-per-node 1 "examples/$example.py" >"$work/$example.log" 2>&1; then
    printf 'parity\texample %s.py, 1 rank (%s)\tok\t%ss\n' "$example" "$mode" $((SECONDS - t0)) >>"$results"
  else
    printf 'parity\texample %s.py, 1 rank (%s)\tFAIL\texit %s, log below\n' "$example" "$mode" "$?" >>"$results"
    tail -n 30 "$work/$example.log" | sed "s/^/  [$example] /"
  fi
done

# ------------------------------------------------ parity, step, memory (one process)
timeout 420 "$PYTHON" - "$mode" "$results" <<'PY'
"""World size 1 on NCCL (gloo with --cpu); results appended to the TSV file."""

import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor

import fsdptx
from fsdptx.presets import Decoder, DecoderConfig, build_preset
from fsdptx.testing import fake_mesh, free_port

MODE, RESULTS = sys.argv[1], sys.argv[2]
CUDA = MODE == "cuda"
DEVICE = torch.device("cuda", 0) if CUDA else torch.device("cpu")
# Sizes: the GPU gets the real ones; the CPU rehearsal only walks the code.
MEMORY_LAYERS, MEMORY_SEQ = (4, 2048) if CUDA else (2, 128)
ROUNDS, WARMUP, STEPS = (3, 3, 20) if CUDA else (1, 1, 2)
PARITY_RTOL = 1e-4  # fp32 on both sides: only reduction order differs
BF16_RTOL = 5e-2  # bf16 compute against fp32
STEP_TARGET = 1.05  # benchmarks/README.md, sp_step.py: fsdptx / torchtitan at most 1.05x
MEMORY_TARGET = (-0.10, 0.15)  # docs/memory.md: the plan against FSDPMemTracker


def record(section: str, check: str, verdict: str, detail: str) -> None:
    line = f"{section}\t{check}\t{verdict}\t{detail}"
    print(f"gpu_check: {line.replace(chr(9), ' | ')}", flush=True)
    with open(RESULTS, "a") as f:
        f.write(line + "\n")


def guarded(section: str, check: str, body: Callable[[], None]) -> None:
    """A check that raises is a failure of that check, not of the script."""
    try:
        body()
    except Exception as e:  # noqa: BLE001 - every failure goes into the summary
        traceback.print_exc()
        record(section, check, "FAIL", f"{type(e).__name__}: {e}".splitlines()[0][:200])


def sync() -> None:
    if CUDA:
        torch.cuda.synchronize()


def mesh_of(shape: tuple[int, ...], names: tuple[str, ...]) -> DeviceMesh:
    return init_device_mesh(DEVICE.type, shape, mesh_dim_names=names)


def losses_of(model: nn.Module, vocab: int, steps: int, *, after_backward: Callable[[], object] = lambda: None) -> list[float]:
    """Per-step losses of AdamW on one fixed batch (the same on both sides)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, vocab, (4, 17), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    out = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.float().reshape(-1, vocab), tokens[:, 1:].reshape(-1))
        loss.backward()
        after_backward()
        opt.step()
        out.append(loss.item())
    return out


def worst_rel(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))


# ------------------------------------------------ 3a. the plan (before any group exists)

estimate: Any = None


def plan_memory() -> None:
    global estimate
    with torch.device("meta"):
        model = build_preset("llama", MEMORY_LAYERS)
    with fake_mesh((1,), ("dp",)) as mesh:
        estimate = fsdptx.estimate_memory(fsdptx.FSDP2Manager(fsdptx.FSDP2Config(), mesh), model, batch=1, seq=MEMORY_SEQ)


guarded("memory", "estimate_memory (fake mesh)", plan_memory)

os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
if CUDA:
    torch.cuda.set_device(DEVICE)
    torch.backends.cuda.matmul.allow_tf32 = False  # parity in fp32 means fp32
    torch.backends.cudnn.allow_tf32 = False
dist.init_process_group("nccl" if CUDA else "gloo", timeout=timedelta(seconds=60))
record("setup", "process group", "info", f"{dist.get_backend()} world 1 on {torch.cuda.get_device_name(DEVICE) if CUDA else 'cpu'}, torch {torch.__version__}")

# -------------------------------------------------------------------- 1. parity

SMALL = DecoderConfig(vocab=128, dim=64, hidden=128, layers=2)


def small(cfg: DecoderConfig = SMALL) -> Decoder:
    torch.manual_seed(0)
    return Decoder(cfg).to(DEVICE)


def manager_parity() -> None:
    reference = losses_of(small(), SMALL.vocab, 4)
    mesh = mesh_of((1, 1), ("dp", "tp"))
    model = small()
    config = fsdptx.FSDP2Config(sequence_parallel=True, activation_checkpointing=True, mp_policy=None)
    fsdptx.FSDP2Manager(config, mesh).parallelize(model)
    ours = losses_of(model, SMALL.vocab, 4, after_backward=lambda: fsdptx.synchronize_tp_replica_gradients([model], mesh))
    err = worst_rel(ours, reference)
    audit = fsdptx.audit_replicas([model], mesh)
    verdict = "ok" if err <= PARITY_RTOL and audit.ok else "FAIL"
    record("parity", "FSDP2Manager dp=1 x tp=1 + SP + AC vs plain, fp32, 4 AdamW steps", verdict,
           f"worst relative loss difference {err:.1e} (limit {PARITY_RTOL:.0e}); audit ok: {audit.ok}; losses {ours[0]:.4f} -> {ours[-1]:.4f}")


def mixed_dtype_parity() -> None:
    cfg = DecoderConfig(vocab=128, dim=64, hidden=128, layers=2, fp32_holders=True, sibling_dtype=torch.bfloat16)
    reference = losses_of(small(cfg).float(), cfg.vocab, 3)
    model = small(cfg)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    pipeline = fsdptx.compose(fsdptx.shard_by_dtype, fsdptx.shard_across_blocks, fsdptx.mark_reduction)
    plan = fsdptx.plan(model, pipeline, mp_policy=policy)
    sinks = [n for n, _ in model.named_parameters() if "sinks" in n]
    fp32_sinks = all(plan.units[plan.owned_params[n]].compute_dtype == torch.float32 for n in sinks)
    fsdptx.apply_plan(plan, model, mesh_of((1,), ("dp",)))
    ours = losses_of(model, cfg.vocab, 3)
    err = worst_rel(ours, reference)
    finite = all(torch.isfinite(torch.tensor(ours)))
    verdict = "ok" if err <= BF16_RTOL and finite and fp32_sinks and sinks else "FAIL"
    record("parity", "dtype-aware pipeline, bf16 compute (fp32 sinks, bf16 gate) vs fp32", verdict,
           f"worst relative loss difference {err:.1e} (limit {BF16_RTOL:.0e}); {len(sinks)} sinks planned fp32: {fp32_sinks}")


def tp_sync_identity() -> None:
    """One TP rank: the sync and the broadcast run their collectives and
    must leave every gradient and replica exactly as it was."""
    mesh = mesh_of((1,), ("tp",))
    model = small()
    for i, p in enumerate(model.parameters()):
        p.grad = torch.randn_like(p) + i
    before = [p.grad.clone() for p in model.parameters()]
    weights = [p.detach().clone() for p in model.parameters()]
    synced = fsdptx.synchronize_tp_replica_gradients([model], mesh)
    fsdptx.broadcast_tp_replicas([model], mesh)
    same = all(torch.equal(a, p.grad) for a, p in zip(before, model.parameters()))
    same &= all(torch.equal(w, p.detach()) for w, p in zip(weights, model.parameters()))
    audit = fsdptx.audit_replicas([model], mesh)
    record("parity", "TP-replica sync, broadcast and audit on a 1-rank TP group", "ok" if same and audit.ok else "FAIL",
           f"{synced} gradients synced, all unchanged: {same}; audit ok: {audit.ok}")


guarded("parity", "FSDP2Manager vs plain", manager_parity)
guarded("parity", "dtype-aware pipeline in bf16", mixed_dtype_parity)
guarded("parity", "TP-replica sync", tp_sync_identity)

# -------------------------------------------------- 2. the step against torchtitan's pattern


def step_benchmark() -> None:
    import sp_step  # benchmarks/ on PYTHONPATH
    from titan_pattern import explicit_plan, parallelize_by_hand  # tests/support on PYTHONPATH

    for name in ("titan", "decoder"):
        times: dict[str, list[float]] = {"torchtitan": [], "fsdptx": [], "fsdptx_no_sync": []}
        first: dict[str, float] = {}
        for _ in range(ROUNDS):
            for method in times:
                mesh = mesh_of((1, 1), ("dp", "tp"))
                model = sp_step.build(name).to(DEVICE)
                if method == "torchtitan":
                    parallelize_by_hand(model, name, mesh)
                else:
                    plan = explicit_plan("titan") if name == "titan" else None
                    config = fsdptx.FSDP2Config(sequence_parallel=True, mp_policy=None, tp_plan=plan)
                    fsdptx.FSDP2Manager(config, mesh).parallelize(model)
                opt = torch.optim.SGD(model.parameters(), lr=0.01)
                tokens = torch.randint(0, sp_step.VOCAB, (sp_step.BATCH, sp_step.SEQ + 1), generator=torch.Generator().manual_seed(0)).to(DEVICE)

                def step() -> float:
                    opt.zero_grad()
                    loss = F.cross_entropy(model(tokens[:, :-1]).reshape(-1, sp_step.VOCAB), tokens[:, 1:].reshape(-1))
                    loss.backward()
                    if method == "fsdptx":
                        fsdptx.synchronize_tp_replica_gradients([model], mesh)
                    opt.step()
                    return loss.detach()

                first.setdefault(method, float(step()))
                for _ in range(WARMUP):
                    step()
                sync()
                per_step = []
                for _ in range(STEPS):
                    t = time.perf_counter()
                    step()
                    sync()
                    per_step.append(time.perf_counter() - t)
                times[method].append(statistics.median(per_step))
                del model, opt
        err = abs(first["fsdptx"] - first["torchtitan"]) / abs(first["torchtitan"])
        record("parity", f"{name}: first-step loss, fsdptx vs torchtitan's pattern", "ok" if err <= PARITY_RTOL else "FAIL",
               f"{first['fsdptx']:.6f} vs {first['torchtitan']:.6f} (relative {err:.1e})")
        ratios = [a / b for a, b in zip(times["fsdptx"], times["torchtitan"])]
        bare = [a / b for a, b in zip(times["fsdptx_no_sync"], times["torchtitan"])]
        ratio = statistics.median(ratios)
        record("step", f"{name}: step time fsdptx / torchtitan, {ROUNDS} rounds x {STEPS} steps", "info",
               f"{1e3 * statistics.median(times['fsdptx']):.2f} ms vs {1e3 * statistics.median(times['torchtitan']):.2f} ms: "
               f"{ratio:.3f}x (range {min(ratios):.3f}-{max(ratios):.3f}; without the sync call {statistics.median(bare):.3f}x); "
               f"target <= {STEP_TARGET}x {'met' if ratio <= STEP_TARGET else 'MISSED'}")


guarded("step", "step benchmark", step_benchmark)

# --------------------------------------------------- 3b. the plan against the allocator


def measure_memory() -> None:
    if estimate is None:
        record("memory", "plan vs max_memory_allocated", "FAIL", "no estimate (see above)")
        return
    torch.manual_seed(0)
    with torch.device(DEVICE):
        model = build_preset("llama", MEMORY_LAYERS)
    fsdptx.FSDP2Manager(fsdptx.FSDP2Config(), mesh_of((1,), ("dp",))).parallelize(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    vocab = model.config.vocab
    tokens = torch.randint(0, vocab, (1, MEMORY_SEQ), device=DEVICE)
    labels = torch.randint(0, vocab, (1, MEMORY_SEQ), device=DEVICE)

    def step() -> None:  # what the trace runs: forward, fp32 loss, backward, AdamW
        logits = model(tokens)
        loss = F.cross_entropy(logits.flatten(0, -2).float(), labels.flatten())
        del logits
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()  # AdamW's state now exists: the steady state the plan describes
    local = lambda t: t.to_local() if isinstance(t, DTensor) else t  # noqa: E731
    params = sum(local(p).untyped_storage().nbytes() for p in model.parameters())
    states = sum(local(v).nbytes for s in opt.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0)
    summary = (f"llama preset, {MEMORY_LAYERS} layers, batch 1 x seq {MEMORY_SEQ}, dp=1, bf16 compute: "
               f"params {estimate.params_bytes:,} planned vs {params:,} held, optimizer {estimate.optimizer_bytes:,} vs {states:,}")
    if not CUDA:
        record("memory", "plan vs max_memory_allocated", "info", summary + "; peak not measured on CPU (no CUDA allocator)")
        return
    sync()
    torch.cuda.reset_peak_memory_stats(DEVICE)
    step()
    sync()
    peak = torch.cuda.max_memory_allocated(DEVICE)
    err = estimate.peak_bytes / peak - 1
    low, high = MEMORY_TARGET
    record("memory", "plan vs max_memory_allocated", "info",
           f"{summary}; peak {estimate.peak_bytes:,} planned ({estimate.peak_at}) vs {peak:,} allocated: {100 * err:+.1f}% "
           f"(target {100 * low:+.0f}%/{100 * high:+.0f}% {'met' if low <= err <= high else 'MISSED'})")


guarded("memory", "plan vs max_memory_allocated", measure_memory)
dist.destroy_process_group()
sys.stdout.flush()
os._exit(0)  # skip the interpreter's teardown, as the examples do (docs/launching.md)
PY
status=$?
if [ $status -ne 0 ]; then
  printf 'run\tparity, step and memory checks\tFAIL\tthe Python part exited %s (124: past its 420 s limit)\n' "$status" >>"$results"
fi

# ---------------------------------------------------------------- summary
echo
echo "== gpu_check summary ($mode, $((SECONDS - start)) s)"
awk -F'\t' '{ printf "  %-4s %-7s %s: %s\n", $3, $1, $2, $4 }' "$results"
failed=$(awk -F'\t' '$3 == "FAIL"' "$results" | wc -l)
checks=$(wc -l <"$results")
echo "== $checks lines, $failed failed"
[ "$failed" -eq 0 ]
