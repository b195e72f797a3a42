#!/bin/bash
# The GPU checks of a short device lease (docs/scale.md, "On a GPU"): the CUDA tests, the certify speed
# and scale benchmarks on the GPU, a slice of the paper profile (tools/gpu-check.toml) and the whole
# test suite on that machine's own packages, and whole cells of a profile (`cells`: `run --sweeps
# $CELL_SWEEPS`, continuing the run in .dev/prior, a copy of results/paper-pending, at its commit).
# Steps: STEPS="tests speed batch scale paper cells probe suite" (each with its own timeout, T_TESTS
# ...). Run from the repository root with $OUT set (the device tool's); it reads .dev/ (excluded in
# .git/info/exclude, carried), prepared once here:
#   mkdir -p .dev/fmnist && cp ../shared/wheels/*.whl .dev/ && pip download --no-deps --only-binary=:all:
#     --python-version 3.12 --platform manylinux2014_x86_64 -d .dev appdirs==1.4.4 graphviz==0.20.3
#     dask==2026.8.0 distributed==2026.8.0 partd==1.4.2 locket==1.0.0 tblib==3.2.2 zict==3.0.0
#     tornado==6.6.1
#   (auto_LiRPA, its two pure-Python needs, and Dask for `--workers`, which the GPU image lacks), and
#   the first 200 Fashion-MNIST test images in .dev/fmnist as IDX files with empty training files (the
#   repository and the whole test split would not fit the lease's 64 MiB; certify reads the test
#   split's first images only).
set -o pipefail
export PYTHONUNBUFFERED=1 MPLBACKEND=Agg BENCH_THREADS=${BENCH_THREADS:-8}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .dev/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD
mkdir -p /usr/share/datasets/fashion-mnist && cp .dev/fmnist/* /usr/share/datasets/fashion-mnist/
{ nvidia-smi -L; python3 -c "import torch,numpy,scipy,sys,auto_LiRPA;print(sys.version, torch.__version__, numpy.__version__, scipy.__version__, torch.cuda.get_device_name())"; nproc; git rev-parse HEAD; } 2>&1 | tee $OUT/env.txt
PROFILE=${PROFILE:-paper-cpu} PROBE_MODEL=${PROBE_MODEL:-fashion-mnist-d128-b3-h4-p7-c0.5-q1}
T=$(date +%s); t() { echo "== $1 at $(( $(date +%s) - T )) s" | tee -a $OUT/steps.txt; }
for step in ${STEPS:-tests speed scale paper}; do
  t "$step start"
  case $step in
  tests) timeout ${T_TESTS:-170} python3 -m pytest -v -p no:cacheprovider tests/bounds/network/test_cuda.py tests/bounds/test_dtypes.py -k cuda 2>&1 | tee $OUT/cuda_tests.txt | tail -40 ;;
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
  cells) # a run carried over in .dev/prior (its run.json and cells/) continues at its own commit, from a
         # worktree of it (this tree is the session's HEAD; the lease's .git holds that commit's history)
         where=$PWD; [ -d .dev/prior ] && rm -rf /tmp/cells && cp -r .dev/prior /tmp/cells && rm -f /tmp/cells/.lock \
           && commit=$(python3 -c "import json; print(json.load(open('.dev/prior/run.json'))['git_commit'])") \
           && git worktree add -f --detach /tmp/at-run "$commit" >/dev/null && where=/tmp/at-run
         (cd $where && BENCH_THREADS=1 timeout ${T_CELLS:-300} python3 -m bench run --profile $PROFILE \
           --sweeps "${CELL_SWEEPS:-certify_accurate_crown,certify_crown}" --device ${CELL_DEVICE:-cuda} --out /tmp/cells \
           --workers ${WORKERS:-4}) 2>&1 | tr '\r' '\n' | tail -20 | tee $OUT/cells.txt
         tar czf $OUT/cells.tgz -C /tmp cells ;;
  probe) timeout ${T_PROBE:-100} python3 -m bench certify --model zoo/$PROBE_MODEL.safetensors --dataset fashion-mnist --eps 0.02 --limit 3 \
           --bounds taylor_net,crown --pgd-steps 20 --device cuda --json > $OUT/probe.json 2> $OUT/probe.err; tail -3 $OUT/probe.err ;;
  suite) BENCH_THREADS=1 timeout ${T_SUITE:-240} python3 -m pytest -p no:cacheprovider -n ${WORKERS:-14} -v -rfE --junitxml=$OUT/suite.xml tests --timeout 400 2>&1 | tee $OUT/suite.txt | grep -E "FAILED|ERROR|passed|failed" | tail -40 ;;
  esac
done
t done
