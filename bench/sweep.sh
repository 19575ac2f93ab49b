#!/usr/bin/env bash
# One command for the serving Pareto sweep on the GPU machine (docs/bench.md, "The full sweep on the GPU"):
# for each real-dimension shape in bench/shapes/serve/, sparrow serves it with dummy weights and
# `sparrow bench sweep` runs the workload at every concurrency, with the decode roofline beside each point;
# a vLLM peer runs the same shape folder and workload when asked (PEERS=vllm); tools/plot_sweep.py draws
# each shape's front when matplotlib is there.
#
#   bench/sweep.sh [SHAPE ...]        SHAPE: deepseek_v3.2, kimi_k3.1_pro, minimax_m3.1_flash, kimi_linear_48b
#                                     (default: all four),
#                                     or the path of any config.json-like file
#
# A shape's model folder is made under $MODELS/<shape>: the shape's config.json plus the bundled
# model's tokenizer (models/minimax_m3: ids below 4096, valid in every shape's vocabulary), so both engines
# can take text prompts and `--tokenizer` makes them exactly ISL tokens long.
# Writes into $OUT (the device tool's result folder; else out/serve/), per shape:
#   <shape>/sweep-sparrow.json   the sweep (points + roofline); <shape>/sweep-vllm.json with PEERS=vllm
#   <shape>/front.png, .svg      the plot (if matplotlib imports)
#   <shape>/sweep.log            every step's output for that shape
# Env: SPARROW (binary, default build/sparrow), DEVICE (default cuda), DATASET (random | agentic, default random), ISL / OSL (random
# lengths, default 8192 / 1024: InferenceX's 8K/1K), CONCURRENCIES (default 1,2,4,8,16,32,64,128,256),
# PROMPTS_PER_CONCURRENCY (default 4), NUM_WARMUPS (untimed requests before each point, at least one wave
# at its concurrency, default 1; 0: none), MODELS (where the model folders go, default $OUT/models), KV_MEMORY (sparrow's --kv-cache-memory, default 40GiB; the shape's, below),
# MAX_MODEL_LEN (default 16384; agentic: 131072), MAX_NUM_BATCHED_TOKENS (every engine's step token budget,
# default 8192: vLLM's default; sparrow serve's own default is 2048), KV_CACHE_DTYPE (sparrow's --kv-cache-dtype, also the
# roofline's; default: the shape's, below), SERVE_ARGS (more sparrow serve flags), PEERS (vllm: also
# sweep `vllm serve <shape folder> --load-format dummy`; hf: run the same requests through transformers'
# model.generate, bench/peers/hf_serve_peer.py; both: PEERS=vllm,hf), VLLM_ARGS (more vllm serve flags),
# HF_CONCURRENCIES (default 1,2,4,8,16: static batches of a 60 GB bf16 model soon run out of memory and time),
# HF_PROMPTS_PER_CONCURRENCY (default 1: one batch per point), HF_ARGS (more hf_serve_peer.py run flags),
# VLLM (the command that runs vLLM's CLI, default vllm; e.g. "python3 -m vllm.entrypoints.cli.main" where vLLM
# is installed without its scripts), MOE_ROUTING (uniform_random, the default: both engines draw each token's
# experts uniformly, sparrow with --moe-routing-simulation and vLLM with VLLM_MOE_ROUTING_SIMULATION_STRATEGY;
# own: each engine routes as its dummy weights make it; see ROUTING below), PEER_WARM_PASS (0: no
# untimed warm pass of vLLM before its sweep, see
# WARM_PASS below), SPARROW_SWEEP (0: skip sparrow's sweep, to run the peers of a shape in a
# call of their own), LAUNCH_TIMEOUT (s, default 1800), PEER_PORT (vLLM's port, default 8100; the HF peer's
# request capture takes PEER_PORT + 100; sparrow's servers take a free port), so that two sweeps can share a
# machine of two GPUs: CUDA_VISIBLE_DEVICES=1 PEER_PORT=8300 bench/sweep.sh <another shape> beside the first.
set -uo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
OUT="${OUT:-$ROOT/out/serve}"
mkdir -p "$OUT"
export LD_LIBRARY_PATH="$ROOT/.devlibs:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}"
SPARROW="${SPARROW:-$ROOT/build/sparrow}"
DEVICE="${DEVICE:-cuda}"
DATASET="${DATASET:-random}"
ISL="${ISL:-8192}"
OSL="${OSL:-1024}"
CONCURRENCIES="${CONCURRENCIES:-1,2,4,8,16,32,64,128,256}"
PROMPTS_PER_CONCURRENCY="${PROMPTS_PER_CONCURRENCY:-4}"
NUM_WARMUPS="${NUM_WARMUPS:-1}"
MODELS="${MODELS:-$OUT/models}"
if [[ "$DATASET" == "agentic" ]]; then MAX_MODEL_LEN="${MAX_MODEL_LEN:-131072}"; else MAX_MODEL_LEN="${MAX_MODEL_LEN:-16384}"; fi
LAUNCH_TIMEOUT="${LAUNCH_TIMEOUT:-1800}"
PEER_PORT="${PEER_PORT:-8100}"
# The step token budget (chunked prefill), the same for every engine: vLLM's default, 8192.
MAX_NUM_BATCHED_TOKENS="${MAX_NUM_BATCHED_TOKENS:-8192}"
PEERS="${PEERS:-}"
SHAPES=("$@")
[[ ${#SHAPES[@]} -eq 0 ]] && SHAPES=(deepseek_v3.2 kimi_k3.1_pro minimax_m3.1_flash kimi_linear_48b)
[[ -x "$SPARROW" ]] || { echo "no $SPARROW (build the sparrow target and carry it)" >&2; exit 1; }
status=0

# The workload flags, the same for every engine.
WORKLOAD=(--dataset-name "$DATASET" --concurrencies "$CONCURRENCIES" --num-warmups "$NUM_WARMUPS" --ignore-eos --disable-tqdm)
if [[ "$DATASET" == "random" ]]; then
  WORKLOAD+=(--random-input-len "$ISL" --random-output-len "$OSL" --prompts-per-concurrency "$PROMPTS_PER_CONCURRENCY")
fi
# vLLM's warm pass: the same points with shorter requests and another seed (so nothing it leaves in the
# prefix cache is asked for again), untimed. vLLM compiles some Triton kernels on first use, when a batch
# first takes a new size class: a point's warm-up wave does not reach them all (its 2026-11-30 DeepSeek run
# compiled three MoE / quantisation kernels during the c = 64 point, whose p99 ITL was 2.1 s). sparrow's
# kernels are compiled ahead of time; its CUDA graphs are captured in the points' warm-up waves.
WARM_PASS=(--dataset-name "$DATASET" --concurrencies "$CONCURRENCIES" --num-warmups 0 --ignore-eos --disable-tqdm --seed 1000)
if [[ "$DATASET" == "random" ]]; then
  WARM_PASS+=(--random-input-len "$ISL" --random-output-len $((OSL < 32 ? OSL : 32)) --prompts-per-concurrency 1)
else
  WARM_PASS+=(--sessions-per-concurrency 1 --agentic-turns 2)
fi

# MoE routing, the same for both engines. vLLM's --load-format dummy draws every float parameter uniform in
# [-1e-3, 1e-3] from a seed that depends only on the parameter's size
# (vllm/model_executor/model_loader/weight_utils.py, initialize_dummy_weights): the norm before the router,
# the router and its e_score_correction_bias alike, the same values in every layer. The router's scores then
# vary by ~1e-5 from token to token while the bias spreads the experts by ~1e-3, so the bias picks nearly the
# same experts for every token: ~5 of MiniMax-M3's 128 and ~10 of Kimi's or DeepSeek's 256 at any batch,
# where a real model touches 51 / 102 at batch 16 (bench/peers/vllm/dummy_routing.py). Measured so, vLLM
# reads a fraction of the expert bytes a real model would (its Kimi-Linear-48B TPOT at c = 16 was half the
# roofline's, 2026-11-30). With uniform_random both engines draw top_k distinct experts per token uniformly
# (vLLM: torch.randint; sparrow: a hash of the token's hidden state, kernels/uniform_routing.h), which is
# what the roofline assumes; sparrow's own dummy routing is a real initialisation's (docs/bench.md).
case "${MOE_ROUTING:-uniform_random}" in
  uniform_random) ROUTING=uniform_random ;;
  own) ROUTING="" ;;
  *) echo "MOE_ROUTING must be uniform_random or own, not '${MOE_ROUTING}'" >&2; exit 2 ;;
esac
SPARROW_ROUTING=()
[[ -n "$ROUTING" ]] && SPARROW_ROUTING=(--moe-routing-simulation "$ROUTING")

for shape in "${SHAPES[@]}"; do
  config="bench/shapes/serve/$shape.json"
  if [[ -f "$shape" ]]; then config="$shape"; shape=$(basename "$(dirname "$shape")")-$(basename "$shape" .json); fi
  [[ -f "$config" ]] || { echo "no $config" >&2; status=1; continue; }
  model="$MODELS/$shape"
  mkdir -p "$model" "$OUT/$shape"
  LOG="$OUT/$shape/sweep.log"
  : > "$LOG"
  cp "$config" "$model/config.json"
  cp models/minimax_m3/tokenizer.json models/minimax_m3/tokenizer_config.json "$model/"

  # What a shape needs from each engine to serve the same cache: DeepSeek-V3.2 in FlashMLA's FP8 layout (656 B a
  # token; vLLM's only DSA path on Hopper, fp8_ds_mla, 64-token pages), MiniMax-M3 with 128-token pages in vLLM
  # (one MSA block a page: its sparse layers take no other size).
  # Kimi-Linear-48B is whole and bf16 (98 GB): its cache gets 32 GiB, of which 23 GB are the recurrent
  # state slots (44.9 MB a sequence for 256 running sequences and 256 prefix snapshots).
  shape_kv=auto shape_vllm=() shape_kv_memory=40GiB
  case "$shape" in
    deepseek_v3.2) shape_kv=fp8 shape_vllm=(--kv-cache-dtype fp8_ds_mla --block-size 64) ;;
    minimax_m3.1_flash) shape_vllm=(--block-size 128) ;;
    kimi_linear_48b) shape_kv_memory=32GiB ;;
  esac
  kv_dtype="${KV_CACHE_DTYPE:-$shape_kv}"
  kv_memory="${KV_MEMORY:-$shape_kv_memory}"

  if [[ "${SPARROW_SWEEP:-1}" != 0 ]]; then
  echo "== sparrow: $shape" | tee -a "$LOG" >&2
  "$SPARROW" bench sweep "${WORKLOAD[@]}" --tokenizer "$model" --label sparrow --kv-cache-dtype "$kv_dtype" \
      --launch "$model --load-format dummy ${SPARROW_ROUTING[*]} --device $DEVICE --max-model-len $MAX_MODEL_LEN --max-num-seqs 256 --max-num-batched-tokens $MAX_NUM_BATCHED_TOKENS --kv-cache-memory $kv_memory --kv-cache-dtype $kv_dtype ${SERVE_ARGS:-}" \
      --launch-timeout "$LAUNCH_TIMEOUT" --output "$OUT/$shape/sweep-sparrow.json" >> "$LOG" 2>&1 \
    || { echo "sparrow sweep of $shape failed (see $shape/sweep.log)" >&2; status=1; }
  fi
  peers=()

  if [[ ",$PEERS," == *",vllm,"* ]]; then
    echo "== vllm: $shape" | tee -a "$LOG" >&2
    read -ra vllm_cmd <<< "${VLLM:-vllm}"
    if command -v "${vllm_cmd[0]}" >/dev/null; then
      # The same folder, dummy weights, the same workload, sparrow's client (vLLM's metric definitions).
      echo "vllm routing: ${ROUTING:-as its dummy weights make it} (VLLM_MOE_ROUTING_SIMULATION_STRATEGY)" >> "$LOG"
      VLLM_MOE_ROUTING_SIMULATION_STRATEGY="$ROUTING" "${vllm_cmd[@]}" serve "$model" --load-format dummy --port "$PEER_PORT" --max-model-len "$MAX_MODEL_LEN" --max-num-seqs 256 \
          --max-num-batched-tokens "$MAX_NUM_BATCHED_TOKENS" \
          --trust-remote-code "${shape_vllm[@]}" ${VLLM_ARGS:-} >> "$OUT/$shape/vllm-server.log" 2>&1 &
      vllm_pid=$!
      for _ in $(seq "$LAUNCH_TIMEOUT"); do
        curl -sf http://127.0.0.1:$PEER_PORT/v1/models >/dev/null 2>&1 && break
        kill -0 "$vllm_pid" 2>/dev/null || break
        sleep 1
      done
      if curl -sf http://127.0.0.1:$PEER_PORT/v1/models >/dev/null 2>&1; then
        [[ "${PEER_WARM_PASS:-1}" == 0 ]] || "$SPARROW" bench sweep "${WARM_PASS[@]}" --tokenizer "$model" --label vllm-warm-pass \
            --base-url http://127.0.0.1:$PEER_PORT --output "$OUT/$shape/sweep-vllm-warm-pass.json" >> "$LOG" 2>&1 \
          || echo "vllm warm pass of $shape failed (see $shape/sweep.log); sweeping anyway" | tee -a "$LOG" >&2
        "$SPARROW" bench sweep "${WORKLOAD[@]}" --tokenizer "$model" --label vllm --base-url http://127.0.0.1:$PEER_PORT --kv-cache-dtype "$kv_dtype" \
            --model-config "$model" --output "$OUT/$shape/sweep-vllm.json" >> "$LOG" 2>&1 \
          && peers+=(--peer "vllm=$OUT/$shape/sweep-vllm.json") \
          || { echo "vllm sweep of $shape failed (see $shape/sweep.log)" >&2; status=1; }
      else
        echo "vllm serve $shape did not come up: the end of its log:" | tee -a "$LOG" >&2
        tail -n 20 "$OUT/$shape/vllm-server.log" | tee -a "$LOG" >&2
        status=1
      fi
      kill "$vllm_pid" 2>/dev/null; wait "$vllm_pid" 2>/dev/null
    else
      echo "PEERS=vllm but no ${vllm_cmd[0]} command here: skipped" | tee -a "$LOG" >&2
    fi
  fi

  if [[ ",$PEERS," == *",hf,"* ]]; then
    echo "== hf: $shape" | tee -a "$LOG" >&2
    if [[ "$DATASET" != "random" ]]; then
      echo "PEERS=hf: only the random workload (static batches have no sessions or think times): skipped" | tee -a "$LOG" >&2
    elif ! python3 -c 'import torch, transformers' 2>/dev/null; then
      echo "PEERS=hf but torch / transformers do not import here: skipped" | tee -a "$LOG" >&2
    else
      # sparrow's client sends its workload to a stand-in server that records it (--max-concurrency 1 keeps
      # the order); point c replays the first c x K of them, as many as sparrow bench sweep sends there (the
      # sweep draws each point's with its own seed; generate() has no prefix cache, so only lengths matter).
      hf_c="${HF_CONCURRENCIES:-1,2,4,8,16}"
      hf_k="${HF_PROMPTS_PER_CONCURRENCY:-1}"
      hf_n=$(( $(tr ',' '\n' <<< "$hf_c" | sort -n | tail -1) * hf_k ))
      python3 bench/peers/hf_serve_peer.py capture --port "$((PEER_PORT + 100))" --count "$hf_n" --output "$OUT/$shape/hf-requests.jsonl" >> "$LOG" 2>&1 &
      cap_pid=$!
      sleep 2
      "$SPARROW" bench serve --base-url http://127.0.0.1:$((PEER_PORT + 100)) --tokenizer "$model" --dataset-name random \
          --random-input-len "$ISL" --random-output-len "$OSL" --ignore-eos --num-prompts "$hf_n" --max-concurrency 1 \
          --disable-tqdm >> "$LOG" 2>&1
      kill "$cap_pid" 2>/dev/null; wait "$cap_pid" 2>/dev/null
      python3 bench/peers/hf_serve_peer.py run "$model" --dummy --device "$DEVICE" --requests "$OUT/$shape/hf-requests.jsonl" \
          --concurrencies "$hf_c" --prompts-per-concurrency "$hf_k" --ignore-eos --label hf --result-dir "$OUT/$shape/hf" \
          ${HF_ARGS:-} >> "$LOG" 2>&1 \
        || { echo "hf peer of $shape failed (see $shape/sweep.log)" | tee -a "$LOG" >&2; status=1; }
      ls "$OUT/$shape/hf/"hf-concurrency*.json >/dev/null 2>&1 && peers+=(--peer "hf=$OUT/$shape/hf")
    fi
  fi

  if [[ -f "$OUT/$shape/sweep-sparrow.json" ]] && python3 -c 'import matplotlib' 2>/dev/null; then
    python3 tools/plot_sweep.py "$OUT/$shape/sweep-sparrow.json" "${peers[@]}" --output "$OUT/$shape/front" >> "$LOG" 2>&1 \
      || { echo "plot of $shape failed (see $shape/sweep.log)" >&2; status=1; }
  fi
done
exit $status
