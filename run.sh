#!/usr/bin/env bash
# One entry point (see README.md):
#   bash run.sh                   set up, tokenize the shipped corpus once, train config.yaml on 4
#                                 msrun workers (TP2 x PP2 with sequence parallelism), sample
#   bash run.sh test              set up, then the test suite
#   bash run.sh check ...         the config, layout (--nproc N) and inputs checked, nothing run
#   bash run.sh preprocess ...    Megatron tools/preprocess_data.py flags -> <prefix>_text_document.bin/.idx
#   bash run.sh generate ...      --load DIR --prompt TEXT [--max-new-tokens N --temperature T --top-k K]
#   bash run.sh convert|import-hf|export-hf ...   checkpoints between layouts, and to and from Hugging Face GPT-2
#   bash run.sh import-megatron DIR --save OUT    a Megatron-LM checkpoint (--ckpt-format torch) in any layout
#   bash run.sh bench ...         tokens/s of one process and the 2-worker layouts, alternating (bench.py)
#   bash run.sh plan ...          --world-size N [--config FILE] [--memory-per-device GB]: memory,
#                                 communication and FLOPs per rank, nothing allocated (memory.py)
#   bash run.sh --nproc 1         the same model and data in one process (about 6 minutes)
#   bash run.sh [--nproc N] [--config FILE] [Megatron flags | section.key=value ...]   train
set -euo pipefail
cd "$(dirname "$0")"

# ---- set-up: a .venv with requirements.txt, made once and refreshed when the file changes
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
stamp=.venv/.requirements.sha256
want=$(sha256sum requirements.txt | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  .venv/bin/python -m pip install --quiet --disable-pip-version-check -r requirements.txt
  echo "$want" > "$stamp"
fi
export PATH="$PWD/.venv/bin:$PATH"          # msrun starts `python` from PATH
export GLOG_v="${GLOG_v:-3}"                # MindSpore: errors only on the console
# msrun stops the other workers as soon as one fails, then its scheduler waits this many seconds
# for their heartbeats (30 by default) before the job ends
export MS_NODE_TIMEOUT="${MS_NODE_TIMEOUT:-10}"

case "${1:-}" in
  test)
    shift
    exec python -m pytest test_all.py "$@"
    ;;
  check|preprocess|generate|convert|import-hf|export-hf|import-megatron|plan)
    exec python train.py "$@"
    ;;
  bench)
    shift
    exec python bench.py "$@"
    ;;
esac

# ---- training
for arg in "$@"; do
  case "$arg" in
    --help|-h) exec python train.py --help ;;         # the commands and every flag, no work done
  esac
done
nproc=""
args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --nproc) nproc="$2"; shift 2 ;;
    --nproc=*) nproc="${1#--nproc=}"; shift ;;
    *) args+=("$1"); shift ;;
  esac
done
default_run=0
if [ ${#args[@]} -eq 0 ]; then
  default_run=1                 # the default run ends with a sample from the trained model
  if [ -z "$nproc" ]; then
    # 4 workers: tensor x pipeline parallel with SP, compiled; 2 micro-batches of 4 per step (the
    # same 8 sequences as one process); the last step's pipeline timeline is written to output/
    nproc=4
    args=(--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --sequence-parallel
          --micro-batch-size 4 --global-batch-size 8 training_config.pipeline_trace=true)
  fi
fi
nproc=${nproc:-1}
case "$nproc" in
  ''|*[!0-9]*|0*) echo "error: --nproc $nproc: give the number of workers, a whole number from 1" >&2; exit 2 ;;
esac
if [ "$default_run" -eq 1 ] && [ -e output/latest_checkpointed_iteration.txt ]; then
  # the default run is a demonstration: it starts over (train with --save DIR to keep a run)
  echo "bash run.sh: the previous default run's checkpoints in output/ are replaced"
  rm -rf output/iter_* output/.iter_* output/latest_checkpointed_iteration.txt
fi

if [ "$nproc" -gt 1 ]; then
  # the config, the layout for $nproc workers and the input files, checked once in one process
  # (one error line, exit 2), and the shipped corpus tokenized, before msrun starts the workers
  python train.py check --nproc "$nproc" ${args[@]+"${args[@]}"}
  port=$((8100 + RANDOM % 800))
  # msrun relays every worker's console; MindSpore's "[INFO] DISTRIBUTED ... Event base dispatch
  # success!" lines are not news, so they are dropped (pipefail keeps msrun's exit code)
  logs=output/msrun_log
  export RUN_SH_PID_DIR=$logs/pids            # each worker writes rank_N.pid
  rm -rf "$RUN_SH_PID_DIR" && mkdir -p "$RUN_SH_PID_DIR"
  if ! msrun --worker_num "$nproc" --local_worker_num "$nproc" --master_port "$port" \
        --log_dir "$logs" --join True --cluster_time_out 300 \
        train.py ${args[@]+"${args[@]}"} 2>&1 | { grep --line-buffered -v '^\[INFO\] DISTRIBUTED' || true; } \
        | tee "$logs/console.log"; then
    # a worker killed from outside (kill -9, out of memory) prints nothing: msrun names its pid
    dead=$(sed -n 's/.*Worker process \([0-9]*\) exit with exception\. Error code: -\([0-9]*\)\..*/\1 \2/p' \
           "$logs/console.log" | head -1)
    if [ -n "$dead" ]; then
      set -- $dead
      rank=$(grep -lx "$1" "$RUN_SH_PID_DIR"/rank_*.pid 2>/dev/null | sed 's/.*rank_\([0-9]*\)\.pid/\1/' || true)
      echo "error: rank ${rank:-?} (pid $1) was killed by signal $2; its log: $logs/worker_${rank:-N}.log" >&2
    fi
    exit 1
  fi
else
  python train.py ${args[@]+"${args[@]}"}
fi

if [ "$default_run" -eq 1 ]; then
  echo "---- sample from the trained model (bash run.sh generate --load output --prompt ...)"
  python train.py generate --load output --prompt "ROMEO:" --max-new-tokens 80 --temperature 0.8 --top-k 40
fi
