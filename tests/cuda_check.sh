#!/bin/bash
# The one-GPU device check of the CUDA path (never run so far: no GPU has been lent). From the repo root on
# the device machine: `bash tests/cuda_check.sh` (about 7 minutes; writes logs under $OUT if set). Uses the
# machine's python3 (torch with CUDA, Triton, transformers, safetensors, tokenizers, pytest-timeout); no
# network. Every check prints a PASS/FAIL line; the summary at the end repeats them. PARTS selects parts
# (default "fast,engine,kernel-tests,nccl,pytest"; the timeouts add up to 13 minutes at worst).
export PYTHONPATH=.:tests PYTHONUNBUFFERED=1 SPLASH_COMM=gloo
OUT=${OUT:-/tmp}
PARTS=${PARTS:-fast,engine,kernel-tests,nccl,pytest}
rm -f "$OUT/fast.log" "$OUT/kernel_tests.log" "$OUT/check.log"  # the summary reads only this run's logs
if ! python3 -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  echo "FAIL: python3 cannot import torch or torch sees no CUDA device; tests/cuda_check.sh is for the GPU machine" \
       "(CPU tests: pytest; the Triton kernel under the interpreter: see tests/test_triton_mla.py)"
  exit 2
fi
nvidia-smi -L
python3 -c "import torch,transformers as t;print('torch',torch.__version__,torch.version.cuda,torch.cuda.is_available(),'transformers',t.__version__)"
python3 -c "import triton;print('triton',triton.__version__)" || echo "FAIL: triton does not import (the fast path needs it)"
case ",$PARTS," in *,fast,*)
# 0 the fast decode path (tests/cuda_fast_check.py): Triton kernel parity vs the torch reference (fp64/fp32/
#   bf16) and inside a CUDA graph; the float64 engine on CUDA through the torch reference, Triton eager and
#   Triton + graphs vs transformers on the GPU (1e-9); no host sync in the eager forward; eager vs graph
#   decode step times at a few batch sizes (table)
timeout 240 python3 tests/cuda_fast_check.py 2>&1 | grep -v -e '^Writing' -e '^Loading' | tee "$OUT/fast.log"
echo "fast path rc=${PIPESTATUS[0]} (0 = all pass, 1 = a check failed, 124 = timed out)";;
esac
case ",$PARTS," in *,engine,*)
# 1 T=1 float64 parity (CUDA vs CPU engine vs transformers)  2 bf16 + seeded sampling + syncs per decode step
# 3 live switches, 2 gloo ranks sharing cuda:0, stream delays injected (side stream / compute stream)
timeout 240 python3 tests/cuda_check.py 2>&1 | grep -v -e '^Writing' -e '^Loading' | tee "$OUT/check.log";;
esac
case ",$PARTS," in *,kernel-tests,*)
# 0b the kernel's and the graph runner's unit tests, the kernel compiled for the GPU (not interpreted)
timeout 90 python3 -m pytest -q -p no:cacheprovider tests/test_triton_mla.py tests/test_decode_graphs.py 2>&1 \
  | tail -4 | tee "$OUT/kernel_tests.log";;
esac
case ",$PARTS," in *,nccl,*)
# 4 T=2 over NCCL on ONE GPU: must fail at once with "2 ranks on this node need 2 CUDA devices"
timeout 90 python3 -m splash generate --model tiny --tp 2 --device cuda --layout tp --prompt-ids 1,2,3 --max-tokens 2 \
  2>&1 | tail -5 | cut -c1-400 | tee "$OUT/nccl_two_ranks_one_gpu.log"; echo "rc=${PIPESTATUS[0]} (2 = clear error, 124 = hung)";;
esac
case ",$PARTS," in *,pytest,*)
# 5 the repo's CUDA tests only (`-m cuda`: without it, tests that do not pin the CPU would run on the GPU)
timeout 120 python3 -m pytest --cuda -m cuda tests/test_engine_cuda.py -x -q -p no:cacheprovider 2>&1 | tail -15;;
esac
echo "==== summary of the PASS/FAIL lines ===="
cat "$OUT/fast.log" "$OUT/kernel_tests.log" 2>/dev/null | grep -e "PASS" -e "FAIL" -e "passed" -e "failed" -e "error"
grep -h -e "PART" "$OUT/check.log" 2>/dev/null | cut -c1-300
