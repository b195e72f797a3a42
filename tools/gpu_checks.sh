#!/bin/bash
# The GPU checks of a short device lease (docs/scale.md, "On a GPU"): the CUDA tests, the certify speed
# and scale benchmarks on the GPU, a slice of the paper profile (tools/gpu-check.toml) and the whole
# test suite on that machine's own packages. Steps: STEPS="tests speed batch scale paper suite" (each with
# its own timeout, T_TESTS ...). Run from the repository root with $OUT set (the device tool's); it
# reads .dev/ (git-ignored, carried), prepared once here:
#   mkdir -p .dev/fmnist && cp ../shared/wheels/*.whl .dev/ && pip download --no-deps --only-binary=:all:
#     --python-version 3.12 --platform manylinux2014_x86_64 -d .dev appdirs==1.4.4 graphviz==0.20.3
#   (auto_LiRPA and its two pure-Python needs that the GPU image lacks), and the Fashion-MNIST test
#   files in .dev/fmnist with empty training files (the 26 MB training images would not fit the lease's
#   64 MiB; certify reads the test split only).
set -o pipefail
export PYTHONUNBUFFERED=1 MPLBACKEND=Agg BENCH_THREADS=${BENCH_THREADS:-8}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .dev/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD
mkdir -p /usr/share/datasets/fashion-mnist && cp .dev/fmnist/* /usr/share/datasets/fashion-mnist/
{ nvidia-smi -L; python3 -c "import torch,numpy,scipy,sys,auto_LiRPA;print(sys.version, torch.__version__, numpy.__version__, scipy.__version__, torch.cuda.get_device_name())"; nproc; } 2>&1 | tee $OUT/env.txt
T=$(date +%s); t() { echo "== $1 at $(( $(date +%s) - T )) s" | tee -a $OUT/steps.txt; }
for step in ${STEPS:-tests speed scale paper}; do
  t "$step start"
  case $step in
  tests) timeout ${T_TESTS:-170} python3 -m pytest -v -p no:cacheprovider tests/test_cuda.py tests/test_dtypes.py -k cuda 2>&1 | tee $OUT/cuda_tests.txt | tail -40 ;;
  speed) BENCH_DEVICE=cuda timeout ${T_SPEED:-170} python3 -m pytest -q -p no:cacheprovider benchmarks/test_certify_speed.py \
           --benchmark-enable --benchmark-only -k "not alpha_crown or digits-d32-b1" --benchmark-json=$OUT/certify_speed.json \
           --benchmark-columns=median,rounds 2>&1 | tee $OUT/certify_speed.txt | tail -25 ;;
  batch) BENCH_DEVICE=cuda BENCH_IMAGES=${IMAGES:-64} timeout ${T_BATCH:-150} python3 -m pytest -q -p no:cacheprovider benchmarks/test_certify_speed.py \
           --benchmark-enable --benchmark-only -k "taylor_net or lofast_M or (crown and not alpha and digits-d32-b1)" --benchmark-json=$OUT/certify_batch.json \
           --benchmark-columns=median,rounds 2>&1 | tee $OUT/certify_batch.txt | tail -25 ;;
  scale) timeout ${T_SCALE:-80} python3 -m pytest -q -p no:cacheprovider benchmarks/test_scale.py -k "vit_b or network" \
           --benchmark-enable --benchmark-only --benchmark-json=$OUT/scale.json --benchmark-columns=median,rounds 2>&1 | tee $OUT/scale.txt | tail -12 ;;
  paper) timeout ${T_PAPER:-110} python3 -m bench run --profile tools/gpu-check.toml --device cuda --out /tmp/gpu-run --fresh 2>&1 | tail -15 | tee $OUT/paper_slice.txt
         tar czf $OUT/gpu-run.tgz -C /tmp gpu-run ;;
  suite) BENCH_THREADS=1 timeout ${T_SUITE:-240} python3 -m pytest -p no:cacheprovider -n ${WORKERS:-14} -v -rfE --junitxml=$OUT/suite.xml tests --timeout 400 2>&1 | tee $OUT/suite.txt | grep -E "FAILED|ERROR|passed|failed" | tail -40 ;;
  esac
done
t done
