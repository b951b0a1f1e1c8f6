#!/usr/bin/env bash
# Everything that needs the GPU, in one call of the device tool.
#
#   bash scripts/gpu_check.sh [tests|tune|retime|bench|anchors|auto|check|full|hf|fast|decode|gemvstages|gemv2steps|gemv1reduce|gemv2input|parts|keepa|configs|flush|quantchunks|gemm2|unmarked|pending|ids|route|hfroute|halfheight|warmup|timingmethods|host|all ...] [-- extra pytest args]
#
# tests: the GPU-marked tests (real preset shapes, determinism, CUDA-graph replay, cutlass, auto).
# bench: `moekit bench` at the anchor points (BENCHMARKS.md, Reference points): the expert GEMMs alone
#        (--mode gemm) and the whole layer, for GLM-4.5V-FP8 TP2, Mixtral-8x7B FP8 and
#        DeepSeek-V3 TP8, every backend plus auto.
# anchors: the anchor points alone (ANCHOR_M), shorter than `bench`: the two GEMMs (triton, cutlass)
#        and the whole layer (triton, cutlass, auto) per model in precise mode, then GEMMs and layer
#        of the channel-scale models in fast mode (MOEKIT_FP8_ACCUMULATION=fast) at the prefill
#        anchors, where fast mode is the one in question; no plots; then scripts/anchors_report.py
#        per mode (issue 3's must-hold at those points: anchors-report-<mode>.md / .json). Not part of `all`.
#        ANCHOR_MODELS ("glm-4.5v-fp8 mixtral-8x7b", say) runs only those models' points,
#        ANCHOR_MODES ("precise" or "fast"; default both) only those modes, ANCHOR_M ("1", say)
#        only those batch sizes in precise mode (and in the bench step).
# auto:  the whole layer on every backend plus auto, at the sizes the shipped decision tables
#        measured, the sizes between, and others off both grids, 4 routings per point (is auto
#        within 3% of the fastest everywhere?).
# check: `moekit check` on the same models.
# tune:  `moekit tune` on the shipped-table models (TUNE_BUDGET each, default 5m; TUNE_MODELS
#        "model:tp[:scheme] ..." to choose; TUNE_ARGS adds arguments, e.g. "--batch-sizes 1 2 4 8
#        --no-between" for decode sizes only); the tables land in tuned/ of the archive, ready to
#        copy into moekit/configs/.
# retime: `moekit tune --search-space none` on the TUNE_MODELS with the journals in TUNE_DIR
#        (default tune-journal/, git-ignored: carry it; TUNE_ARGS adds arguments): no search, only
#        what is missing with the configs found before (the sizes between after a change of their
#        rule, GEMM2's own launch on the best configs found before, say); the tables
#        land in tuned/ of the archive and the steps after it use them, as after `tune`; the
#        journals come back in journal/ of the archive (also when the call is cut short).
#        TUNE_SEARCH=pruned (or full) searches too, on top of the journals: only configs they do
#        not hold yet are timed (new ones of the space, say), and the tables keep every other size.
# full:  the exhaustive search (`--search-space full`) of GLM-4.5V TP2 at FULL_SIZES (default
#        "64 1024"), to compare with the pruned search of the tune step at the same sizes.
# hf:    one GLM-4.5V-size layer through moekit against transformers' grouped_mm.
# fast:  scripts/diag_fast.py (the triton layer precise, fast, fast with the joined tile, precise
#        through fused_moe, and cutlass, in the same rounds) and `moekit check` of the triton
#        backend with MOEKIT_FP8_ACCUMULATION=fast (class kernel-fast); not part of `all`.
# decode: scripts/diag_decode.py --pdl, the tiled decode layer against the GEMV path's configs
#        (GLM-4.5V, Mixtral, DeepSeek-V3 at M = 1-16), each with programmatic dependent launch on
#        and off (DECODE_ARGS adds arguments: "--batch-sizes 1 2", "--parts"); not part of `all`.
# gemvstages: scripts/diag_gemv_stages.py, the GEMV path's K loops pipelined (num_stages 2-4) against
#        unpipelined (1) at decode sizes, per K step, the layer and each GEMM alone
#        (GEMV_STAGES_ARGS adds arguments: "--points glm-4.5v-fp8:2:1"); not part of `all`.
# gemv2steps: scripts/diag_gemv_gemm2_steps.py, the GEMV path's GEMM2 alone with K steps of its own
#        (one 128-group per pair up to the whole intermediate) and column blocks down to 1, against the
#        table's GEMM2 (GEMV2_STEPS_ARGS adds arguments: "--points glm-4.5v-fp8:2:1"); not part of `all`.
# gemv1reduce: scripts/diag_gemv1_reduce.py, the GEMV path's GEMM1 against the same products reduced once
#        after the K loop, on the tensor cores (operands swapped), and against the bare reading of its
#        weights on the same grid (the ceiling of its access pattern), GLM-4.5V M = 1 and 4, Mixtral M = 1 (GEMV1_REDUCE_ARGS adds arguments);
#        not part of `all`.
# gemv2input: scripts/diag_gemv2_input.py, the GEMV path's GEMM2 alone on its input quantized per
#        1x128 group while loading (its own), per row, unquantized and already FP8: what quantizing
#        costs it (GEMV2_INPUT_ARGS adds arguments); not part of `all`.
# parts: scripts/diag_parts.py, each launch of the tiled layer alone at prefill sizes (alignment,
#        x's quantization, GEMM1, GEMM2, the combine) beside the layer and `moekit bench --mode gemm`'s
#        closure, in the same rounds (PARTS_ARGS adds arguments); not part of `all`.
# keepa: scripts/diag_gemm2_keep_a.py, GEMM2 alone with the table's launch against runs keeping
#        their row block's activations (KernelConfig.KEEP_A2) over widths, warps, stages and run
#        lengths, then the whole layer with the fastest, GLM-4.5V TP2 at M = 1024, 4096 and 8192
#        (KEEPA_ARGS adds arguments: "--points deepseek-v3:8:4096 --runs 8 16"); not part of `all`.
# configs: scripts/diag_configs.py, the whole layer with the configs CONFIGS_ARGS names against the
#        table's, in the same rounds, each checked against the reference and bitwise against the
#        others (CONFIGS_ARGS="--points glm-4.5v-fp8:2:64 --configs KEY ... --scheme fp8-channel-token");
#        not part of `all`.
# flush: scripts/diag_flush.py, the triton layer, the GEMV path's GEMMs alone and bare reads of their
#        weights' bytes, timed after the harness's L2 flush (zeroing 512 MiB, which leaves the L2
#        dirty) and after a flush that reads it (clean), at the anchors' decode points
#        (FLUSH_ARGS adds arguments); not part of `all`.
# quantchunks: scripts/diag_quantize_chunks.py, x's quantization in chunks of columns (launch.QUANTIZE_CHUNK)
#        against a whole row per program: the quantize launch alone and the layer, DeepSeek-V3 and
#        GLM-4.5V at M = 1-64 (QUANT_CHUNKS_ARGS adds arguments); not part of `all`.
# gemm2: scripts/diag_gemm2.py, GEMM2 alone at prefill sizes with the table's config and variants
#        of its width, warps, stages and grouping (would GEMM2 gain from a config of its own?), and
#        the combine pass alone (GEMM2_ARGS adds arguments: "--points glm-4.5v-fp8:2:4096"); not
#        part of `all`.
# unmarked: the tests WITHOUT the gpu mark, on the GPU (those taking the `device` fixture run on
#        CUDA there, not under the interpreter; `-- -k EXPR` narrows them, UNMARKED_TESTS="tests/a.py
#        tests/b.py" picks files: all of them compile hundreds of kernels, more than one call's 10
#        minutes, so split them over calls, carrying nothing: Triton's cache stays on a warm machine); not part of `all`.
# pending: what no GPU has run yet: NaN propagation on every backend and triton path
#        (test_nan_propagation.py), the glue's tests, all of them (the bf16 rounding it changed),
#        and int64 ids read as they are by the triton backend (test_triton_id_check.py,
#        test_api.py; twentieth session), and route()'s routing kernel (test_routing_kernel.py,
#        test_routing.py, test_layer.py) and the glue's id check, int64 ids read as they are by cutlass
#        and torch (test_glue_id_check.py; twenty-first session), and transformers' routers fused
#        (test_hf_routers.py; twenty-second). All of them passed on an H200 in the twenty-third
#        session (BENCHMARKS.md); the list stays for the next code written without a GPU. Added in
#        the twenty-fifth session, passed on an H100 in the twenty-sixth: warmup (test_compile_ahead.py,
#        test_hf_compile_ahead.py), the timing harness (test_timing.py) and the tuner's
#        incumbent and confirmation (test_tune.py, its unmarked tests on CUDA). Passed on an
#        H100 in the thirty-first: the glue's warmup (test_compile_ahead.py's
#        test_after_warmup_the_glue_compiles_nothing), the GEMV path's GEMM2 on a launch and depth of
#        its own and its pipelined K loops (test_triton_gemv.py -k "pipelined or own", and its gpu_ tests),
#        x quantized in chunks of columns (test_triton_backend.py -k chunks_of_columns). Passed on an
#        H200 in the thirty-seventh: the thirty-sixth session's input checks and the refusal of
#        TRITON_INTERPRET set after import (test_api.py, test_layer.py, test_weights_validation.py;
#        test_triton_overlap.py to 97% in 290 s: run it alone). Passed on an H100 in the
#        thirty-eighth: test_triton_overlap.py alone (418 s), device_capability remembered per device
#        (test_select_auto.py), test_cli_info.py, the weight scales' check (test_weights_validation.py);
#        test_tune.py passed there but for 2 tests (empty_weights' scales, fixed since). Passed on an
#        H100 in the thirty-ninth: test_tune.py with the fix, the scale check left pending for a
#        MoELayer's weights and made by fused_moe (test_layer.py, test_api.py,
#        test_weights_validation.py); test_compile.py but for one test, torch 2.11's (fixed since,
#        checked with torch 2.11 on the CPU): not yet run on a GPU since the fix (test_compile.py,
#        test_hf_compile_ahead.py). Passed on an H100 in the forty-first: those two, and the fortieth's
#        GEMM1 own K step (test_triton_gemm1_k_step.py, with its bf16 case's tile fixed; with
#        test_triton_backend.py on the retimed tables). Written in the forty-first without a GPU (the
#        review fixes; CPU-tested, nothing GPU-specific but the routing kernel's fallback when
#        TRITON_INTERPRET is set after import): test_api.py, test_routing.py, test_layer.py,
#        test_hf_load.py, test_hf_errors.py; passed on an H100 in the forty-second, with the CLI
#        fixes (test_select_auto.py, test_compile_ahead.py, test_cutlass_gpu.py, ...), but for
#        test_hf_load.py (9: the device's transformers) and test_bench_cli.py (1: a test backend
#        recording during a graph capture): both fixed since, and passed on an H200 in the
#        forty-third (carry device-wheels/ for test_hf_load.py). The forty-third's review fixes:
#        test_layer.py, test_api.py, test_hf_load.py and test_weights_validation.py passed on an
#        H100 at 0553f12; the second review's fixes after it (test_layer.py, test_hf_load.py,
#        test_weights_validation.py, test_compile.py, test_hf_eval.py, test_select_auto.py,
#        test_hf_errors.py) and the forty-fourth's routing and README fixes (test_routing.py,
#        test_routing_kernel.py, test_hf_routers.py, test_bench_cli.py) passed on an H100 in the
#        forty-fourth. Written in the forty-fourth after its device time (CPU-tested; not yet on
#        a GPU): table entries validated when read and unreadable table folders skipped (the
#        triton lookup every GPU call makes: test_table_layering.py, test_select_auto.py,
#        test_triton_backend.py), the tuner's signals, routing digest and written record
#        (test_tune.py), and the distributed fixes (their NCCL side needs two GPUs:
#        scripts/bench_distributed.py --check under torchrun). Run test_triton_gemv.py
#        with -k filters: unfiltered it passes one call's time. Not
#        part of `all`. PENDING_TESTS ("test_routing_kernel test_api", say) picks files: all of
#        them may not fit one call.
# ids:   scripts/bench_ids_dtype.py --narrow: the whole layer with int32 ids, int64 ids, and int64
#        ids narrowed first (what fused_moe did before the twentieth session), on triton, then on
#        cutlass (which also skips fused_moe's own id check since the twenty-first); not part of `all`.
# route: scripts/bench_route.py: moekit.route's routing kernel against its torch ops, per preset
#        and batch size, in CUDA graphs and eager back-to-back calls; not part of `all`.
# hfroute: scripts/bench_hf_router.py: transformers' routers against the same routers fused by
#        moekit.hf.fuse_routers (GLM-4.5, DeepSeek-V3, Qwen3, Mixtral, Llama-4 router sizes), in CUDA
#        graphs and eager back-to-back calls; not part of `all`.
# halfheight: the 128-row Gluon GEMM1's half-height tile timed on and off (diag_half_tail.py,
#        DeepSeek-V3 / Qwen3 block FP8 and Mixtral per-channel, precise mode; measured in the
#        nineteenth session: bitwise, no clear win, so it stays off); not part of `all`.
# warmup: `moekit warmup` of WARMUP_MODELS (default GLM-4.5V TP2; "glm-4.5v-fp8 mixtral-8x7b
#        deepseek-v3" for all three anchor models) up to M = 8192, twice: the first compiles (a
#        fresh machine: Triton's on-disk cache empty), the second finds every kernel on disk (a
#        new process); how long each takes. Not part of `all`.
# host:  scripts/bench_eager.py --profile (HOST_ARGS: its other arguments, default
#        "--batch-sizes 1 8 64 1024"; a GLM-4.5V layer called eagerly against its CUDA-graph
#        replay, and cProfile of the host path) and scripts/bench_select.py (choosing a backend,
#        fused_moe around a do-nothing backend, route); not part of `all`.
# timingmethods: scripts/diag_timing_methods.py: the two ways of taking the L2 flush out of a
#        sample (an event between flush and replay, the harness's since the twenty-sixth session;
#        flush + replay less the flushes timed apart, before), on a tiny kernel and the layer at
#        decode and prefill points, in the same rounds; not part of `all`.
# FAST_ARGS adds arguments to the fast step's diag_fast.py ("--batch-sizes 1 2 4 8").
#
# A step after `tune` in the same call (auto, bench, check) uses the tables just tuned
# (MOEKIT_CONFIG_DIR), before the shipped ones.
#
# Wheels in device-wheels/ (git-ignored; carry it with the device tool) are installed first, for
# what the device image lacks: compressed-tensors and pydantic, without which transformers cannot
# even read a compressed-tensors config. Fetch them here with
#   pip download compressed-tensors pydantic pydantic-core loguru annotated-types typing-inspection \
#     --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_17_x86_64 -d device-wheels
#
# The device tool brings back at most 8 files, named without '=' or ',' (tables have both), so
# every result goes into one archive: $OUT/results.tgz (+ $OUT/gpu_check.log, the whole output).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-results}; mkdir -p "$OUT"
WORK=$(mktemp -d /tmp/moekit-gpu.XXXX)
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
if compgen -G "device-wheels/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --target "$WORK/site" device-wheels/*.whl \
    && export PYTHONPATH=$PYTHONPATH:$WORK/site  # only packages the image lacks (--no-deps)
fi
moekit() { python3 -m moekit.cli "$@"; }
steps=(); pytest_args=()
while (($#)); do
  if [[ $1 == -- ]]; then shift; pytest_args=("$@"); break; fi
  steps+=("$1"); shift
done
((${#steps[@]})) || steps=(all)
want() { [[ " ${steps[*]} " == *" $1 "* || " ${steps[*]} " == *" all "* ]]; }

# the anchor points of the bench and anchors steps (precise mode; fast mode's are fixed below)
ANCHOR_M=${ANCHOR_M:-"1 8 64 192 1024 4096 8192"}
LAYER_M="1 8 32 64 192 512 1024 2048 4096 8192"
MODELS=("glm-4.5v-fp8 2 fp8-channel-token" "mixtral-8x7b 1 fp8-channel-token" "deepseek-v3 8 fp8-block128")
run_all() {
local status=0
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
if [[ -f .snapshot-commit ]]; then  # a git-archived snapshot (scripts/snapshot.sh): its own commit
  echo "commit $(cat .snapshot-commit) (snapshot)"
else
  git log -1 --format='commit %h %s' 2>/dev/null || true
fi

if want tests; then
  python3 -m pytest -q -m gpu -p no:cacheprovider tests "${pytest_args[@]}" 2>&1 | tee "$WORK/gpu_tests.log"
  status=${PIPESTATUS[0]}
fi
if want tune; then
  for m in ${TUNE_MODELS:-glm-4.5v-fp8:2 mixtral-8x7b:1:fp8-channel-token deepseek-v3:8 qwen3-30b-a3b-fp8:1}; do
    IFS=: read -r model tp scheme <<<"$m"
    moekit tune --model "$model" --tp "$tp" ${scheme:+--scheme "$scheme"} --budget "${TUNE_BUDGET:-5m}" \
      --out "$WORK/tuned" --export-vllm "$WORK/tuned/vllm" ${TUNE_ARGS:-}
  done
  export MOEKIT_CONFIG_DIR=$WORK/tuned  # the steps below run with these tables
fi
if [[ " ${steps[*]} " == *" retime "* ]]; then  # not part of `all`: it needs carried journals
  for m in ${TUNE_MODELS:-glm-4.5v-fp8:2 mixtral-8x7b:1:fp8-channel-token deepseek-v3:8 qwen3-30b-a3b-fp8:1}; do
    IFS=: read -r model tp scheme <<<"$m"
    moekit tune --model "$model" --tp "$tp" ${scheme:+--scheme "$scheme"} --search-space "${TUNE_SEARCH:-none}" \
      --out "${TUNE_DIR:-tune-journal}" ${TUNE_ARGS:-} || status=1
  done
  mkdir -p "$WORK/tuned" && cp -r "${TUNE_DIR:-tune-journal}/triton" "${TUNE_DIR:-tune-journal}/backends" "$WORK/tuned/" \
    || status=1
  export MOEKIT_CONFIG_DIR=$WORK/tuned
fi
if want bench; then
  moekit info
  for m in "${MODELS[@]}"; do
    read -r model tp scheme <<<"$m"
    gemm_backends="triton cutlass"; [[ $scheme == fp8-block128 ]] && gemm_backends=triton  # no block cutlass
    moekit bench --model "$model" --tp "$tp" --scheme "$scheme" --mode gemm --backends $gemm_backends \
      --batch-sizes $ANCHOR_M --no-check --out "$WORK/bench-gemm-$model"
    moekit bench --model "$model" --tp "$tp" --scheme "$scheme" --mode layer --model-estimate \
      --batch-sizes $LAYER_M --out "$WORK/bench-layer-$model"
  done
fi
if [[ " ${steps[*]} " == *" anchors "* ]]; then
  moekit info
  for mode in ${ANCHOR_MODES:-precise fast}; do
    for m in "${MODELS[@]}"; do
      read -r model tp scheme <<<"$m"
      [[ -n ${ANCHOR_MODELS:-} && " $ANCHOR_MODELS " != *" $model "* ]] && continue
      sizes=$ANCHOR_M; backends="triton cutlass"
      [[ $scheme == fp8-block128 ]] && backends=triton  # no block cutlass
      if [[ $mode == fast ]]; then
        [[ $scheme == fp8-block128 ]] && continue  # block scales promote every K step in both modes
        sizes="1024 4096 8192"
      fi
      MOEKIT_FP8_ACCUMULATION=$mode moekit bench --model "$model" --tp "$tp" --scheme "$scheme" --mode gemm \
        --backends $backends --batch-sizes $sizes --no-check --no-plots --out "$WORK/anchors-$mode-gemm-$model" || status=1
      MOEKIT_FP8_ACCUMULATION=$mode moekit bench --model "$model" --tp "$tp" --scheme "$scheme" --mode layer \
        --backends $backends auto --batch-sizes $sizes --no-plots --out "$WORK/anchors-$mode-layer-$model" || status=1
    done
    # issue 3's must-hold at these points, against BENCHMARKS.md's reference table
    COLUMNS=160 python3 scripts/anchors_report.py "$WORK" --mode "$mode" --markdown "$WORK/anchors-report-$mode.md" \
      --json "$WORK/anchors-report-$mode.json" || status=1
  done
fi
if want auto; then
  for m in "${MODELS[@]}"; do
    read -r model tp scheme <<<"$m"
    moekit bench --model "$model" --tp "$tp" --scheme "$scheme" --mode layer --no-check \
      --batch-sizes 1 4 8 16 32 48 64 128 192 320 512 728 768 1024 1280 1448 1536 1792 2048 2896 3072 4096 5792 6144 8192 \
      --out "$WORK/bench-auto-$model"
  done
fi
if want check; then
  for m in "${MODELS[@]}"; do
    read -r model tp scheme <<<"$m"
    moekit check --model "$model" --tp "$tp" --scheme "$scheme" --out "$WORK/check-$model" || status=1
  done
fi
if want full; then
  moekit tune --model glm-4.5v-fp8 --tp 2 --search-space full --batch-sizes ${FULL_SIZES:-64 1024} \
    --out "$WORK/search-full"
fi
if [[ " ${steps[*]} " == *" fast "* ]]; then
  python3 scripts/diag_fast.py ${FAST_ARGS:-} --json "$WORK/diag_fast.json"
  for m in "glm-4.5v-fp8 2" "mixtral-8x7b 1"; do
    read -r model tp <<<"$m"
    MOEKIT_FP8_ACCUMULATION=fast moekit check --model "$model" --tp "$tp" --scheme fp8-channel-token \
      --backends triton --out "$WORK/check-fast-$model" || status=1
  done
fi
if [[ " ${steps[*]} " == *" gemm2 "* ]]; then
  python3 scripts/diag_gemm2.py ${GEMM2_ARGS:-} --json "$WORK/diag_gemm2.json" || status=1
fi
if [[ " ${steps[*]} " == *" unmarked "* ]]; then
  # the tests without the gpu mark that take the `device` fixture run on CUDA here (on the CPU they
  # run under the interpreter): run() at M = 0, fp16 with FP8 weights, much of the glue
  python3 -m pytest -q -m "not gpu" -p no:cacheprovider ${UNMARKED_TESTS:-tests} "${pytest_args[@]}" 2>&1 \
    | tee "$WORK/unmarked_tests.log"
  ((PIPESTATUS[0] == 0)) || status=1
fi
if [[ " ${steps[*]} " == *" pending "* ]]; then
  # each file logged on its own: a call stopped at its limit still returns the finished files'
  # (PENDING_TESTS="test_a test_b" runs only those: split the list over calls of the device tool)
  for f in ${PENDING_TESTS:-test_routing_kernel test_glue_id_check test_nan_propagation test_routing test_layer \
           test_glue test_torch_backend test_cutlass_gpu test_triton_id_check test_api test_hf_routers \
           test_compile_ahead test_hf_compile_ahead test_timing test_tune test_triton_gemv test_weights_validation \
           test_triton_overlap test_select_auto test_triton_gemm1_k_step test_hf_load test_hf_errors}; do
    python3 -m pytest -q -p no:cacheprovider "tests/$f.py" "${pytest_args[@]}" >"$WORK/pending_$f.log" 2>&1 || status=1
    tail -n 3 "$WORK/pending_$f.log"
  done
fi
if [[ " ${steps[*]} " == *" ids "* ]]; then
  python3 scripts/bench_ids_dtype.py --narrow --json "$WORK/ids_dtype.json" || status=1
  python3 scripts/bench_ids_dtype.py --narrow --backend cutlass --models glm-4.5v-fp8:2 mixtral-8x7b:1:fp8-channel-token \
    --json "$WORK/ids_dtype_cutlass.json" || status=1
fi
if [[ " ${steps[*]} " == *" route "* ]]; then
  python3 scripts/bench_route.py --json "$WORK/route.json" || status=1
fi
if [[ " ${steps[*]} " == *" hfroute "* ]]; then
  python3 scripts/bench_hf_router.py --json "$WORK/hf_router.json" || status=1
fi
if [[ " ${steps[*]} " == *" halfheight "* ]]; then
  tall=M128-N128-K128-G8-w8-s4-ov  # the 128-row Gluon GEMM1 (the tables' tall entries' tile)
  python3 scripts/diag_half_tail.py --switch gluon-half-height --modes precise --config "$tall" \
    --points deepseek-v3:8:4096 deepseek-v3:8:8192 qwen3-30b-a3b-fp8:1:4096 --json "$WORK/half_height_block.json" || status=1
  python3 scripts/diag_half_tail.py --switch gluon-half-height --modes precise --config "$tall" --scheme fp8-channel-token \
    --points mixtral-8x7b:1:1024 mixtral-8x7b:1:4096 --json "$WORK/half_height_channel.json" || status=1
fi
if [[ " ${steps[*]} " == *" decode "* ]]; then
  python3 scripts/diag_decode.py --pdl ${DECODE_ARGS:-} --json "$WORK/diag_decode.json" || status=1
fi
if [[ " ${steps[*]} " == *" gemvstages "* ]]; then
  python3 scripts/diag_gemv_stages.py ${GEMV_STAGES_ARGS:-} --json "$WORK/diag_gemv_stages.json" || status=1
fi
if [[ " ${steps[*]} " == *" gemv2steps "* ]]; then
  python3 scripts/diag_gemv_gemm2_steps.py ${GEMV2_STEPS_ARGS:-} --json "$WORK/diag_gemv_gemm2_steps.json" || status=1
fi
if [[ " ${steps[*]} " == *" gemv1reduce "* ]]; then
  python3 scripts/diag_gemv1_reduce.py ${GEMV1_REDUCE_ARGS:-} --json "$WORK/diag_gemv1_reduce.json" || status=1
fi
if [[ " ${steps[*]} " == *" gemv2input "* ]]; then
  python3 scripts/diag_gemv2_input.py ${GEMV2_INPUT_ARGS:-} --json "$WORK/diag_gemv2_input.json" || status=1
fi
if [[ " ${steps[*]} " == *" parts "* ]]; then
  python3 scripts/diag_parts.py ${PARTS_ARGS:-} --json "$WORK/diag_parts.json" 2>&1 | tee "$WORK/diag_parts.log"
  [[ ${PIPESTATUS[0]} == 0 ]] || status=1
fi
if [[ " ${steps[*]} " == *" keepa "* ]]; then
  python3 scripts/diag_gemm2_keep_a.py ${KEEPA_ARGS:-} --json "$WORK/diag_gemm2_keep_a.json" 2>&1 | tee "$WORK/diag_gemm2_keep_a.log"
  [[ ${PIPESTATUS[0]} == 0 ]] || status=1
fi
if [[ " ${steps[*]} " == *" configs "* ]]; then
  python3 scripts/diag_configs.py ${CONFIGS_ARGS:?CONFIGS_ARGS names the points and configs} --json "$WORK/diag_configs.json" \
    2>&1 | tee "$WORK/diag_configs.log"
  [[ ${PIPESTATUS[0]} == 0 ]] || status=1
fi
if [[ " ${steps[*]} " == *" flush "* ]]; then
  python3 scripts/diag_flush.py ${FLUSH_ARGS:-} --json "$WORK/diag_flush.json" 2>&1 | tee "$WORK/diag_flush.log"
  [[ ${PIPESTATUS[0]} == 0 ]] || status=1
fi
if [[ " ${steps[*]} " == *" quantchunks "* ]]; then
  python3 scripts/diag_quantize_chunks.py ${QUANT_CHUNKS_ARGS:-} --json "$WORK/diag_quantize_chunks.json" || status=1
fi
if [[ " ${steps[*]} " == *" warmup "* ]]; then
  for pass in compile from-disk; do
    for m in "${MODELS[@]}"; do
      read -r model tp scheme <<<"$m"
      [[ " ${WARMUP_MODELS:-glm-4.5v-fp8} " != *" $model "* ]] && continue
      start=$SECONDS
      moekit warmup --model "$model" --tp "$tp" --scheme "$scheme" --max-batch-size 8192 || status=1
      echo "warmup $pass $model: $((SECONDS - start)) s wall, Python start-up included"
    done
  done
fi
if [[ " ${steps[*]} " == *" host "* ]]; then
  python3 scripts/bench_eager.py ${HOST_ARGS:---batch-sizes 1 8 64 1024} --profile 2>&1 | tee "$WORK/bench_eager.log"
  [[ ${PIPESTATUS[0]} == 0 ]] || status=1
  python3 scripts/bench_select.py 2>&1 | tee "$WORK/bench_select.log"
  [[ ${PIPESTATUS[0]} == 0 ]] || status=1
fi
if [[ " ${steps[*]} " == *" timingmethods "* ]]; then
  python3 scripts/diag_timing_methods.py --json "$WORK/timing_methods.json" || status=1
fi
if want hf; then
  python3 scripts/bench_hf_layer.py --tp 2 --scheme fp8-channel-token --backends auto triton cutlass \
    --out "$WORK/hf_layer_tp2.json"
fi
echo "$status" > "$WORK/status"
}
# Killed by `timeout` (a call's time limit), still archive what was measured so far.
# A retime's journals come back too (journal/ in the archive), so that a call cut short is
# carried on by the next one: extract them over the carried folder.
finish() {
  if [[ " ${steps[*]} " == *" retime "* && -d ${TUNE_DIR:-tune-journal} ]]; then
    mkdir -p "$WORK/journal" && cp -r "${TUNE_DIR:-tune-journal}/." "$WORK/journal/"
  fi
  tar czf "$OUT/results.tgz" -C "$WORK" .
}
trap finish EXIT
trap 'exit 143' TERM
echo 1 > "$WORK/status"
run_all 2>&1 | tee "$OUT/gpu_check.log"
exit "$(cat "$WORK/status")"
