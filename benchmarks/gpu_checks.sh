#!/usr/bin/env bash
# The GPU checks, one stage per call of the device machine (each call: 10 minutes at most).
#
#   bash benchmarks/gpu_checks.sh tests     # pytest -m gpu tests/  (kernels + corpus)
#   bash benchmarks/gpu_checks.sh kernels   # benchmarks/kernels.py --tune gemm
#   bash benchmarks/gpu_checks.sh attention # the attention tables alone, with the decoder
#                                           # causal bias as data vs mask_is_causal
#   bash benchmarks/gpu_checks.sh gemm      # the GEMM part alone: Triton and Mosaic sweeps,
#                                           # the GEMM tables (Mosaic column on a Hopper)
#   bash benchmarks/gpu_checks.sh e2e       # benchmarks/e2e.py --size gpu, whole corpus
#   bash benchmarks/gpu_checks.sh e2e-mosaic  # the same, PYPM_GEMM_BACKEND=prefer-mosaic
#
# Run from the repository root on the device (docs/STATUS.md, "Next steps"). Its image has
# JAX, Flax, pytest and Hypothesis, but transformers 5 (no Flax models) and a
# huggingface_hub 1.x that transformers 4.57.6 refuses: carry the wheels in `.whl/`
# (git-ignored), made here with
#
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --implementation cp --platform manylinux_2_17_x86_64 -d .whl \
#     transformers==4.57.6 huggingface_hub==0.36.2 tokenizers==0.22.2
#
# and name `.whl` in the call's carry. Output goes to $OUT (the device tool brings it back)
# and to the terminal; the first lines name the GPU and the versions.
set -uo pipefail
stage=${1:?usage: gpu_checks.sh tests|kernels|attention|gemm|e2e|e2e-mosaic}
OUT=${OUT:-/tmp/pypm-gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site:$PWD
fi
{
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    python3 - <<'EOF'
import sys, jax, flax
try:
    import transformers
    hf = transformers.__version__
except Exception as exc:  # the HF part of the corpus then skips or fails loudly
    hf = f"unavailable ({type(exc).__name__}: {exc})"
print(f"python {sys.version.split()[0]}, jax {jax.__version__}, flax {flax.__version__}, "
      f"transformers {hf}, devices {jax.devices()}")
EOF
} 2>&1 | tee "$OUT/device.txt"

case "$stage" in
tests)
    # One process runs it all in ~20 minutes (Triton compiles: a corpus test takes 16-185 s
    # on an H100), past a device call's 10. Six processes share the GPU instead (no
    # preallocation), the slow tests spread over them; each writes its own log.
    export XLA_PYTHON_CLIENT_PREALLOCATE=false
    C=tests/rules/test_rules_corpus_gpu.py
    T=$C::test_every_site_rewritten_outputs_and_gradients_match_gpu
    groups=(
        "tests/pallas_kernels"
        "$T[llama] $T[vit] $T[distilbert]"
        "$T[bart] $T[bert] $T[nnx_mha_masked]"
        "$T[linen_scan] $T[gpt2]"
        "$T[linen_mha] $T[linen_scan_remat] $T[nnx_mha]"
        "$T[linen_mha_masked] $C::test_bf16_models_gpu"
    )
    i=0
    for g in "${groups[@]}"; do
        i=$((i + 1))
        # shellcheck disable=SC2086  # (the group is a list of test ids)
        python3 -m pytest -q -m gpu $g -p no:cacheprovider -rs --durations=5 \
            >"$OUT/gpu_tests_$i.txt" 2>&1 &
    done
    wait
    tail -n 4 "$OUT"/gpu_tests_*.txt | tee "$OUT/gpu_tests.txt"
    # every test id must have run: a group that lost a test to a rename would pass silently
    python3 -m pytest -q -m gpu tests/ --collect-only -p no:cacheprovider 2>/dev/null |
        tail -n 1 | tee -a "$OUT/gpu_tests.txt"
    ;;
kernels)
    python3 benchmarks/kernels.py --tune gemm 2>&1 | tee "$OUT/kernels.txt"
    ;;
attention)
    python3 benchmarks/kernels.py --only attention 2>&1 | tee "$OUT/attention.txt"
    ;;
gemm)
    python3 benchmarks/kernels.py --tune gemm --only gemm 2>&1 | tee "$OUT/gemm.txt"
    ;;
e2e)
    python3 benchmarks/e2e.py --size gpu --samples 10 --json "$OUT/e2e.json" 2>&1 |
        tee "$OUT/e2e.txt"
    ;;
e2e-mosaic)
    # the same with the Hopper GEMM wherever it serves the call (bf16/f16 models)
    PYPM_GEMM_BACKEND=prefer-mosaic python3 benchmarks/e2e.py --size gpu --samples 10 \
        --json "$OUT/e2e_mosaic.json" 2>&1 | tee "$OUT/e2e_mosaic.txt"
    ;;
*)
    echo "unknown stage $stage (tests, kernels, attention, gemm, e2e or e2e-mosaic)" >&2
    exit 2
    ;;
esac
