#!/bin/bash
# The one-GPU device check of the CUDA path (never run so far: no GPU has been lent). From the repo root on
# the device machine: `bash tests/cuda_check.sh` (about 5 minutes; writes logs under $OUT if set). Uses the
# machine's python3 (torch with CUDA, transformers, safetensors, tokenizers, pytest-timeout); no network.
export PYTHONPATH=.:tests PYTHONUNBUFFERED=1 SPLASH_COMM=gloo
OUT=${OUT:-/tmp}
nvidia-smi -L
python3 -c "import torch,transformers as t;print('torch',torch.__version__,torch.version.cuda,torch.cuda.is_available(),'transformers',t.__version__)"
# 1 T=1 float64 parity (CUDA vs CPU engine vs transformers)  2 bf16 + seeded sampling + syncs per decode step
# 3 live switches, 2 gloo ranks sharing cuda:0, stream delays injected (side stream / compute stream)
timeout 240 python3 tests/cuda_check.py 2>&1 | grep -v -e '^Writing' -e '^Loading' | tee "$OUT/check.log"
# 4 T=2 over NCCL on ONE GPU: must fail at once with "2 ranks on this node need 2 CUDA devices"
timeout 90 python3 -m splash generate --model tiny --tp 2 --device cuda --layout tp --prompt-ids 1,2,3 --max-tokens 2 \
  2>&1 | tail -5 | cut -c1-400 | tee "$OUT/nccl_two_ranks_one_gpu.log"; echo "rc=${PIPESTATUS[0]} (2 = clear error, 124 = hung)"
# 5 the repo's CUDA tests only (`-m cuda`: without it, tests that do not pin the CPU would run on the GPU)
timeout 150 python3 -m pytest --cuda -m cuda tests/test_engine_cuda.py -x -q -p no:cacheprovider 2>&1 | tail -15
