#!/usr/bin/env bash
# One entry point (see README.md):
#   bash run.sh                   set up, tokenize the shipped corpus once, train config.yaml on 4
#                                 msrun workers (TP2 x PP2 with sequence parallelism), sample
#   bash run.sh test              set up, then the test suite
#   bash run.sh tour [--layouts a,b]   every layout of a tiny GPT trained beside one process, a
#                                 row per layout (tools/tour.py)
#   bash run.sh exercise list|NAME [--check|--hint|--solution]   a concept's key lines blanked in a
#                                 copy, the proofs grade yours (tools/exercises.py)
#   bash run.sh check ...         the config, layout (--nproc N) and inputs checked, nothing run
#   bash run.sh preprocess ...    Megatron tools/preprocess_data.py flags ->
#                                 <prefix>_text_document.bin/.idx
#   bash run.sh generate ...      --load DIR --prompt TEXT [--max-new-tokens N --temperature T
#                                 --top-k K]
#   bash run.sh convert|import-hf|export-hf ...   checkpoints between layouts, and to and from
#                                                 Hugging Face GPT-2
#   bash run.sh import-megatron DIR --save OUT    a Megatron-LM checkpoint (--ckpt-format torch)
#                                                 in any layout
#   bash run.sh bench ...         tokens/s of one process and the 2-worker layouts, alternating
#                                 (tools/bench.py)
#   bash run.sh parity --peer PYTHON [flags]   this project's run beside megatron-core's, step
#                                 by step (tools/parity.py)
#   bash run.sh diagnose LOG_DIR  the first collective where a failed job's ranks disagree, from
#                                 their flight records (instruments/flight_recorder.py)
#   bash run.sh plan ...          --world-size N [--config FILE] [--memory-per-device GB]:
#                                 memory, communication and FLOPs per rank, nothing allocated
#                                 (instruments/memory.py)
#   bash run.sh --nproc 1         the same model and data in one process (about 6 minutes)
#   bash run.sh [FILE.yaml] [--nproc N] [--config FILE] [Megatron flags | section.key=value ...]
#                                 train (FILE.yaml: --config FILE.yaml)
#   bash run.sh --nproc_per_node N --nnodes M --node_rank R --master_addr ADDR [--master_port P]
#               [--log_dir DIR] ...   the same on each of M nodes: one job of N x M workers
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
# How long a CPU collective waits for its peers (MS_NODE_TIMEOUT when unset): minutes, as NCCL's,
# so that a peer only slow (compiling, sharing the CPU) is waited for; a collective that can never
# complete is named by the flight recorder's watchdog within seconds (docs/when-a-run-hangs.md)
export MS_CPU_COMM_OP_TIMEOUT="${MS_CPU_COMM_OP_TIMEOUT:-600}"
# A crash (SIGSEGV, SIGABRT) first prints every thread's Python stack to the worker's log
export PYTHONFAULTHANDLER="${PYTHONFAULTHANDLER:-1}"

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
    exec python -m tools.bench "$@"
    ;;
  diagnose)
    shift
    exec python -m instruments.flight_recorder "$@"
    ;;
  tour)
    shift
    exec python -m tools.tour "$@"
    ;;
  parity)
    shift
    exec python -m tools.parity "$@"
    ;;
  exercise)
    shift
    exec python -m tools.exercises "$@"
    ;;
esac

# ---- training
for arg in "$@"; do
  case "$arg" in
    --help|-h) exec python train.py --help ;;         # the commands and every flag, no work done
  esac
done
# `bash run.sh FILE.yaml ...` is `--config FILE.yaml ...`, as in the MindSpore Transformers guide's
# `bash pretrain_gpt.sh xx.yaml`
if [[ ${1:-} == *.yaml || ${1:-} == *.yml ]] && [ -f "$1" ]; then
  set -- --config "$@"
fi

error() { echo "error: $*" >&2; exit 2; }     # one line, exit 2, before anything starts

# ---- the launch flags, `--flag value` or `--flag=value`: torchrun's, as the guides' scripts pass
# them (DISTRIBUTED_ARGS), msrun's own names, and --nproc; the other arguments go to train.py
per_node="" per_node_flag=--nproc worker_num="" nnodes="" node_rank=""
master_addr="" master_port="" log_dir=output/msrun_log
launch_flag() {   # FLAG VALUE: keeps a launch flag's value; returns 1 for any other argument
  case "$1" in
    --nproc|--nproc_per_node|--local_worker_num) per_node=$2 per_node_flag=$1 ;;
    --worker_num) worker_num=$2 ;;                      # msrun's: the workers of all nodes
    --nnodes) nnodes=$2 ;;
    --node_rank) node_rank=$2 ;;
    --master_addr) master_addr=$2 ;;
    --master_port) master_port=$2 ;;
    --log_dir) log_dir=$2 ;;
    *) return 1 ;;
  esac
  [ -n "$2" ] || error "$1 needs a value: $1 VALUE or $1=VALUE"
}
args=()
while [ $# -gt 0 ]; do
  if [[ $1 == --*=* ]] && launch_flag "${1%%=*}" "${1#*=}"; then
    shift
  elif launch_flag "$1" "${2-}"; then
    shift 2
  else
    args+=("$1")
    shift
  fi
done

whole() {   # FLAG VALUE WHAT MIN [MAX]: the value, if given, is a whole number from MIN (to MAX)
  local fix="give $3, a whole number from $4${5:+ to $5}"
  case "$2" in
    '') ;;
    *[!0-9]*|0?*|??????????*) error "$1 $2: $fix" ;;
    *) [ "$2" -ge "$4" ] && [ "$2" -le "${5:-$2}" ] || error "$1 $2: $fix" ;;
  esac
}
whole "$per_node_flag" "$per_node" "the number of workers" 1
whole --worker_num "$worker_num" "the number of workers of all nodes" 1
whole --nnodes "$nnodes" "the number of nodes" 1
whole --master_port "$master_port" "a port for msrun's scheduler" 1024 65535

if [ -n "$worker_num" ]; then
  # every node runs the same number of workers, as torchrun's nodes do (and msrun assumes when
  # given --node_rank)
  [ -n "$per_node" ] || per_node=$((worker_num / ${nnodes:-1}))
  [ -n "$nnodes" ] || nnodes=$((worker_num / per_node))
  [ $((per_node * nnodes)) -eq "$worker_num" ] || error "--worker_num $worker_num is not" \
    "$per_node workers per node x $nnodes nodes: every node runs as many workers" \
    "(--worker_num = --local_worker_num x --nnodes)"
fi
nnodes=${nnodes:-1}
whole --node_rank "$node_rank" "this node's rank among --nnodes $nnodes" 0 $((nnodes - 1))
if [ "$nnodes" -gt 1 ]; then
  # each node names the same scheduler address and its own rank: a default would suit one node
  [ -n "$master_addr" ] || error "a job of $nnodes nodes needs --master_addr:" \
    "node 0's address, the same on every node"
  [ -n "$node_rank" ] || error "a job of $nnodes nodes needs --node_rank:" \
    "this node's rank, 0 to $((nnodes - 1))"
  master_port=${master_port:-29500}     # torchrun's default: every node must agree on the port
fi
node_rank=${node_rank:-0}
master_addr=${master_addr:-127.0.0.1}
# PORT: a process accepts there. Only a loopback address is asked: elsewhere a proxy can accept a
# connection whatever listens (probed: any outside address here)
listened() {
  case "$master_addr" in 127.*|localhost) ;; *) return 1 ;; esac
  (exec 3<>"/dev/tcp/$master_addr/$1") 2>/dev/null
}
# One node: the scheduler's port is random, so that two jobs on one machine do not collide, and
# free. MindSpore's workers listen from 8118 up (256 ports a rank; servers above them to 16309): a
# scheduler that finds its port taken fails, and its workers register with whatever listens there
# and wait out --cluster_time_out (probed: a second job on a first job's worker port hung so).
if [ "$nnodes" -eq 1 ] && [ -n "$master_port" ] && listened "$master_port"; then
  error "--master_port $master_port: another process listens there; choose a free port" \
        "or leave the flag out (a random free one)"
fi
free_port() {   # a random port no process listens on, for one node's scheduler
  master_port=$((20000 + RANDOM % 9000))              # the range cli.scheduler_port picks from
  while listened "$master_port"; do master_port=$((20000 + RANDOM % 9000)); done
}
[ -n "$master_port" ] || free_port

if [ -z "$per_node" ] && [ -n "${ASCEND_RT_VISIBLE_DEVICES:-}" ]; then
  # the MindSpore Transformers guide's script starts one worker per device listed ("0,1,2,3");
  # on an Ascend target the variable also picks the devices, on this CPU it gives the count alone
  IFS=, read -r -a devices <<< "$ASCEND_RT_VISIBLE_DEVICES"
  per_node=${#devices[@]}
  echo "bash run.sh: $per_node workers per node, one per device in" \
       "ASCEND_RT_VISIBLE_DEVICES=$ASCEND_RT_VISIBLE_DEVICES (on this CPU, the count alone)"
fi
default_run=0
if [ ${#args[@]} -eq 0 ]; then
  default_run=1                 # the default run ends with a sample from the trained model
  if [ -z "$per_node" ]; then
    # the layout configs/default_run.yaml names (TP2 x PP2 with SP) on its 4 workers
    per_node=4
    args=(--config configs/default_run.yaml)
  fi
fi
per_node=${per_node:-1}
workers=$((per_node * nnodes))

if [ "$default_run" -eq 1 ] && [ -e output/latest_checkpointed_iteration.txt ]; then
  # the default run is a demonstration: it starts over (train with --save DIR to keep a run)
  echo "bash run.sh: the previous default run's checkpoints in output/ are replaced"
  rm -rf output/iter_* output/.iter_* output/latest_checkpointed_iteration.txt
fi

# ---- stopping: SIGINT (Ctrl-C), SIGTERM or SIGHUP to run.sh stops what it started, then it
# exits 128 + the signal's number (130, 143, 129). What runs is launched in the background and
# waited for, since bash runs a trap only once a foreground command has ended; each launch is a
# process group of its own, so that a terminal's Ctrl-C reaches it once, through run.sh
GRACE=10        # seconds what is stopped has to end (--exit-signal-handler saves), then kill -9
running="" launched=""      # the process group of the launch running, its command
launch() {   # COMMAND...: run as a launch; its exit code
  set -m
  "$@" </dev/null &
  set +m
  waited_for $! "${*:1:2}"
}
waited_for() {   # PID WHAT: the launch of PID (its pipeline's last command) waited for
  local code=0
  stat_of "$1" && running=${fields[2]} launched=$2
  wait "$1" || code=$?
  running="" launched=""
  return "$code"
}
stat_of() {   # PID: its /proc/PID/stat after "PID (COMMAND) " in $fields (state ppid pgrp ...);
  # false once it is gone
  local line
  { read -r line < "/proc/$1/stat"; } 2>/dev/null || return 1
  fields=(${line##*) })
}
running() {   # PID: whether it has not ended (a zombie has), its stat in $fields
  stat_of "$1" && [ "${fields[0]}" != Z ]
}
alive() {   # PGID...: the processes of these process groups that have not ended
  local stat
  for stat in /proc/[0-9]*/stat; do
    stat=${stat#/proc/} && stat=${stat%/stat}
    running "$stat" && [[ " $* " == *" ${fields[2]} "* ]] && echo "$stat"
  done
  return 0
}
ended() {   # SIGNAL PGID...: each process group signalled (SIGNAL 0: none), waited for, and
  # killed (kill -9) once GRACE s have passed
  local sig=$1 waited=0
  shift
  for group; do kill -"$sig" -- -"$group" 2>/dev/null || true; done
  while [ -n "$(alive "$@")" ]; do
    [ "$waited" -lt $((GRACE * 5)) ] || { kill -9 $(alive "$@") 2>/dev/null || true; return; }
    sleep 0.2
    waited=$((waited + 1))
  done
}
stop_msrun() {   # the job of the msrun launch running: its workers (each leads a process group)
  # get SIGTERM, as msrun's own stop of a failed job does and --exit-signal-handler saves on;
  # then msrun SIGINT, its Ctrl-C, which ends its scheduler and log readers (SIGTERM ends msrun
  # alone: probed). Prints what was stopped
  local msrun pid workers=""
  if ! msrun=$(cat "$RUN_SH_PID_DIR/msrun.pid" 2>/dev/null); then
    ended TERM "$running"
    echo "msrun's launch (pid $running), before msrun started"
    return
  fi
  # the pid files, and msrun's children: a worker still starting has written no pid file
  for pid in $(cat "$RUN_SH_PID_DIR"/rank_*.pid /proc/"$msrun"/task/*/children 2>/dev/null \
               | tr ' ' '\n' | sort -un); do
    if stat_of "$pid" && [ "${fields[2]}" = "$pid" ]; then workers+=" $pid"; fi
  done
  ended TERM $workers
  kill -INT "$msrun" 2>/dev/null || true
  ended 0 "$running"
  echo "msrun (pid $msrun) and its workers (pids${workers:- none})"
}
stop() {   # SIGNAL: the trap: what runs stopped, named in one line, exit 128 + the signal's number
  local code=$((128 + $(kill -l "$1"))) what="nothing running"
  trap '' INT TERM HUP                            # stopping already
  [ -z "${watcher:-}" ] || kill -- -"$watcher" 2>/dev/null || true
  if [ "$launched" = msrun ]; then
    what=$(stop_msrun)
  elif [ -n "$running" ]; then
    what="$launched (pid $running)"
    ended "$1" "$running"
  fi
  echo "bash run.sh: SIG$1: stopped $what; exit code $code" >&2
  exit "$code"
}
trap 'stop INT' INT
trap 'stop TERM' TERM
trap 'stop HUP' HUP
# kill -9 of run.sh cannot be trapped: train.py's processes end with it (SIGTERM), and msrun
# (SIGINT) with it, its workers with msrun (PR_SET_PDEATHSIG)
export RUN_SH_PARENT=$$

# "max_restarts save_folder" of the run, which train.py writes there once its config is checked
RUN_SH_LAUNCH_FILE=$(mktemp "${TMPDIR:-/tmp}/run_sh_launch.XXXXXX")
export RUN_SH_LAUNCH_FILE
trap 'rm -f "$RUN_SH_LAUNCH_FILE"' EXIT
if [ "$workers" -gt 1 ]; then
  # the config, the layout for all the workers and the input files, checked once in one process
  # (one error line, exit 2), and the shipped corpus tokenized, before msrun starts the workers
  export MS_LOCAL_WORKER_NUM=$per_node           # msrun names no local count: threads, backends
  launch python train.py check --nproc "$workers" ${args[@]+"${args[@]}"}
  export RUN_SH_PID_DIR=$log_dir/pids            # each worker writes rank_N.pid
  export FLIGHT_RECORDER_DIR=$log_dir            # each worker writes flight_recorder_rank_N.json
  # a secret of this launch, which names its shared-memory segments (backends/shared_memory.py)
  export MGPT_SHM_TOKEN=$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')
fi

failure=""      # what named the last failure, its pids left out
timed_out_rank() {   # the rank msrun's scheduler took for lost (no heartbeat for MS_NODE_TIMEOUT s)
  sed -n 's/.*The node: \([0-9]*\) is timed out.*/\1/p' "$log_dir/scheduler.log" 2>/dev/null \
    | head -1 || true
}
no_heartbeat() {   # what failed when msrun's scheduler took rank $1 for lost
  echo "rank $1 sent no heartbeat for $MS_NODE_TIMEOUT s"
}
name_lost() {   # the line naming rank $1, lost; $2: what ended it
  echo "error: $(no_heartbeat "$1") (MS_NODE_TIMEOUT): stopped (SIGSTOP, a debugger) or its node" \
       "lost; $2; its log: $log_dir/worker_$1.log" >&2
}
rank_of() {   # the rank of worker pid $1 (its pid file), or nothing
  grep -lx "$1" "$RUN_SH_PID_DIR"/rank_*.pid 2>/dev/null | sed 's/.*rank_\([0-9]*\)\.pid/\1/' \
    || true
}
killed() {   # what failed when worker pid $1 was killed by signal $2
  local rank
  rank=$(rank_of "$1")
  echo "rank ${rank:-?} was killed by signal $2"
}
name_killed() {   # the line naming worker pid $1, killed by signal $2
  local rank
  rank=$(rank_of "$1")
  echo "error: rank ${rank:-?} (pid $1) was killed by signal $2;" \
       "its log: $log_dir/worker_${rank:-N}.log" >&2
}
first_dead() {   # "PID SIGNAL" of the first worker msrun saw end by a signal (it prints nothing)
  local exited='Worker process \([0-9]*\) exit with exception\. Error code: -\([0-9]*\)\.'
  sed -n "s/.*$exited.*/\\1 \\2/p" "$log_dir/console.log" 2>/dev/null | head -1
}
end_readers() {   # MSRUN (its pid, its launch's process group), ended: the `tail -f` it started
  # for each worker's log would hold the console's pipe, and run.sh, for ever. msrun ends them as
  # it exits; killed (kill -9, or SIGINT before its handler is set: probed), it does not
  local pid
  for pid in $(alive "$1"); do
    [ "$(cat "/proc/$pid/comm" 2>/dev/null)" != tail ] || kill "$pid" 2>/dev/null || true
  done
}
parent_is_run_sh() {   # whether this subshell's parent is still run.sh
  stat_of "$BASHPID" && [ "${fields[1]}" = $$ ]
}
watch_workers() {   # while msrun runs, each second; what it names, named at once (msrun ends the
  # job seconds later: its scheduler waits for the lost worker, then a SIGTERM to each other)
  local lost pid dead msrun
  while sleep 1; do
    msrun=$(cat "$RUN_SH_PID_DIR/msrun.pid" 2>/dev/null || true)
    if ! parent_is_run_sh; then         # run.sh killed (kill -9): msrun ends with it (SIGINT);
      [ -z "$msrun" ] || ended 0 "$msrun"         # what is left of its launch, GRACE s on
      exit 0
    fi
    [ -z "$msrun" ] || running "$msrun" || end_readers "$msrun"
    # kill -9 from outside (a user, the out-of-memory killer): its pid in "named", once named
    # (this loop ended between the two, run_workers names it again rather than never)
    dead=$(first_dead)
    if [ "${dead#* }" = 9 ] && [ ! -f "$RUN_SH_PID_DIR/named" ] \
         && [ "${dead% *}" != "$(cat "$RUN_SH_PID_DIR/reaped" 2>/dev/null)" ]; then
      name_killed $dead
      echo "${dead% *}" > "$RUN_SH_PID_DIR/named"
    fi
    # a stopped worker msrun's scheduler took for lost: kill -9, its pid in "reaped". Only a
    # stopped one (state T, or t under a debugger): a worker killed from outside is dead already
    lost=$(timed_out_rank)
    [ -n "$lost" ] && [ -f "$RUN_SH_PID_DIR/rank_$lost.pid" ] \
      && [ ! -f "$RUN_SH_PID_DIR/reaped" ] || continue
    pid=$(cat "$RUN_SH_PID_DIR/rank_$lost.pid")
    stat_of "$pid" || continue
    case "${fields[0]}" in
      T|t) echo "$pid" > "$RUN_SH_PID_DIR/reaped" && kill -9 "$pid" 2>/dev/null \
             && name_lost "$lost" "run.sh ended it (kill -9), msrun ends the job" || true ;;
    esac
  done
}
start_msrun() {   # msrun, its pid in msrun.pid and RUN_SH_PARENT (its workers end with it); it
  # gets SIGINT (its Ctrl-C: it ends its workers) when run.sh ends, however (util-linux's
  # setpriv; without it, kill -9 of run.sh leaves msrun's job running)
  echo "$BASHPID" > "$RUN_SH_PID_DIR/msrun.pid"
  local pdeathsig=(setpriv --pdeathsig INT)
  command -v setpriv >/dev/null || pdeathsig=()
  RUN_SH_PARENT=$BASHPID exec ${pdeathsig[@]+"${pdeathsig[@]}"} \
    msrun --worker_num "$workers" --local_worker_num "$per_node" --node_rank "$node_rank" \
    --master_addr "$master_addr" --master_port "$master_port" --log_dir "$log_dir" \
    --join True --cluster_time_out 300 train.py ${args[@]+"${args[@]}"} \
    ${resume[@]+"${resume[@]}"}
}
run_workers() {   # the msrun launch; a failure named on the console and in $failure
  rm -rf "$RUN_SH_PID_DIR" && mkdir -p "$RUN_SH_PID_DIR"
  rm -f "$log_dir"/flight_recorder_rank_*.json "$log_dir/scheduler.log"
  # msrun ends a job with a lost worker by SIGTERM to each, which a stopped one (SIGSTOP, a
  # debugger) only takes once continued: the job would wait for it; run.sh kills it instead
  set -m                                # a process group: ended with its sleep (which holds stderr)
  watch_workers </dev/null >/dev/null &
  set +m
  watcher=$!
  # msrun relays every worker's console; MindSpore's "[INFO] DISTRIBUTED ... Event base dispatch
  # success!" lines are not news, so they are dropped (pipefail keeps msrun's exit code). A launch
  # (see launch), each command run.sh's child: msrun ends with run.sh
  local code=0
  set -m
  start_msrun 2>&1 </dev/null \
    | { grep --line-buffered -v '^\[INFO\] DISTRIBUTED' || true; } | tee "$log_dir/console.log" &
  set +m
  waited_for $! msrun || code=$?
  kill -- -"$watcher" 2>/dev/null || true
  watcher=""
  [ "$code" -ne 0 ] || return 0
  # a worker that sent no heartbeat for MS_NODE_TIMEOUT s (stopped, or its node lost): msrun
  # then stops the others with SIGTERM, and only the scheduler's log names it
  lost=$(timed_out_rank)
  dead=$(first_dead)
  # msrun's own SIGTERM, or run.sh's kill of the lost worker, is not the cause
  if [ -n "$lost" ] && { [ "${dead#* }" = 15 ] \
       || [ "${dead% *}" = "$(cat "$RUN_SH_PID_DIR/reaped" 2>/dev/null)" ]; }; then dead=""; fi
  if grep -q 'Worker process [0-9]* exit with exception\. Error code: 2\.' "$log_dir/console.log"
  then      # a worker named an expected failure itself (a full disk): a restart cannot cure it
    failure="a worker's own error (exit code 2)"
    return 2
  fi
  if [ -n "$dead" ]; then
    set -- $dead
    # a crash's signal after every rank's training returned, its flight record written at exit:
    # the run is done (seen: SIGSEGV in MindSpore's own exit, after the project's exit handlers;
    # the scheduler may then time out a rank that exited, so a lost rank does not matter here).
    # kill -9 comes from outside (a user, the out-of-memory killer), never from a crash
    if [ "$2" != 9 ] && python -m instruments.flight_recorder --ended "$per_node" "$log_dir"; then
      rank=$(rank_of "$1")
      echo "warning: rank ${rank:-?} (pid $1) was killed by signal $2 after its training" \
           "ended (every rank's flight record written at exit, no error): the run is complete;" \
           "its log: $log_dir/worker_${rank:-N}.log" >&2
      return 0
    fi
    failure=$(killed "$1" "$2")
    [ "$1" = "$(cat "$RUN_SH_PID_DIR/named" 2>/dev/null)" ] || name_killed "$1" "$2"
  elif [ -n "$lost" ]; then
    failure=$(no_heartbeat "$lost")
    # a stopped worker of this node was named when run.sh killed it (watch_workers)
    [ -f "$RUN_SH_PID_DIR/reaped" ] || name_lost "$lost" "msrun ended the job"
  else                # the first collective where the ranks' flight records disagree
    failure=$(python -m instruments.flight_recorder "$log_dir" 2>&1 || true)
    echo "$failure"
  fi
  return 1
}
run_one() {   # one process; a failure named in $failure (exit 2: a bad input, named by train.py)
  launch python train.py ${args[@]+"${args[@]}"} ${resume[@]+"${resume[@]}"} && return 0
  local code=$?
  failure="exit code $code"
  [ "$code" -gt 128 ] && failure="the process was killed by signal $((code - 128))" \
    && echo "error: $failure" >&2
  return "$code"
}

# ---- restarts (torchrun's --max-restarts; training_config.max_restarts): a failed job, named,
# is launched again from the last checkpoint in its --save folder (--load), up to that many
# times; a bad input (exit 2, named before any work) and the same failure twice from the same
# checkpoint are not: a restart cannot cure them
resume=() attempt=0 seen=""
while true; do
  if [ "$workers" -gt 1 ]; then run_workers && break; else run_one && break; fi
  code=$?
  [ "$code" -ne 2 ] || exit 2
  read -r max_restarts save < "$RUN_SH_LAUNCH_FILE" || exit "$code"    # failed before its config
  [ "$attempt" -lt "$max_restarts" ] || exit "$code"
  resume=(--load "$save")
  # a latest checkpoint damaged since its save is set aside, named, by one process, before the
  # workers read it
  launch python train.py check --nproc "$workers" ${args[@]+"${args[@]}"} "${resume[@]}" || exit 2
  from=$(cat "$save/latest_checkpointed_iteration.txt" 2>/dev/null || echo 0)
  [ "$failure @ $from" != "$seen" ] || error "the same failure twice from iteration $from" \
    "($failure): not restarted; fix its cause, then resume with --load $save"
  seen="$failure @ $from" attempt=$((attempt + 1))
  # a new scheduler: one node's workers, restarted first, would join the old job's, still up
  # on node 0 while it waits for the lost node; every node's restart k meets at the port + k
  if [ "$nnodes" -gt 1 ]; then master_port=$((master_port + 1)); else free_port; fi
  echo "bash run.sh: restart $attempt of $max_restarts, from iteration $from in $save" >&2
done

if [ "$default_run" -eq 1 ] && [ "$node_rank" -eq 0 ]; then     # once, on node 0
  echo "---- sample from the trained model (bash run.sh generate --load output --prompt ...)"
  launch python train.py generate --load output --prompt "ROMEO:" --max-new-tokens 80 \
    --temperature 0.8 --top-k 40
fi
