#!/bin/bash
# The decode step on an accelerator under XLA:GPU's command-buffer flags, with out-major weights at
# batch 1, and the kernel count of the SmolLM2 batch-32 step (design §6, "On a GPU").
#   bash results/bench_gpu_h200/dispatch_flags.sh   # from the repository root, jax[cuda]
export PYTHONPATH=$(pwd):$(pwd)/scripts PYTHONUNBUFFERED=1
M="--models smollm2,qwen2.5-1.5b --dtype bfloat16 --steps 100"
echo "=== default"; timeout 150 python3 scripts/bench_decode_dispatch.py $M --batches 1,8,32
echo "=== out-major at batch 1"; timeout 100 python3 results/bench_gpu_h200/dispatch_out_major.py $M --batches 1
echo "=== command buffers off"; XLA_FLAGS=--xla_gpu_enable_command_buffer= timeout 100 python3 scripts/bench_decode_dispatch.py $M --batches 1,32
echo "=== min graph size 1"; XLA_FLAGS=--xla_gpu_graph_min_graph_size=1 timeout 100 python3 scripts/bench_decode_dispatch.py $M --batches 1,32
echo "=== kernels in the smollm2 batch-32 step"
XLA_FLAGS="--xla_dump_to=/tmp/dump --xla_dump_hlo_module_re=.*generate.*" timeout 60 python3 scripts/bench_decode_dispatch.py --models smollm2 --dtype bfloat16 --batches 32 --steps 5 > /dev/null 2>&1
f=$(ls /tmp/dump/*generate*after_optimizations.txt 2>/dev/null | head -1); echo "$f"
python3 - "$f" <<'PY'
import re, sys
s = open(sys.argv[1]).read()
entry = s[s.index("ENTRY"):]
entry = entry[:entry.index("\n}")]
kinds = {}
for line in entry.splitlines():
    m = re.search(r"= [^ ]+ (fusion|custom-call|copy|dynamic-update-slice|scatter|while|conditional|call)\(", line)
    if m: kinds[m.group(1)] = kinds.get(m.group(1), 0) + 1
print("entry instructions by kind:", kinds, "total lines", len(entry.splitlines()))
PY
