"""Profiling with the guide's keys and Megatron's flags: MindSpore's profiler over a window of
training steps on chosen ranks; a key the CPU profiler cannot honour is named in one warning."""
import logging
import os

import mindspore as ms

from settings.keys import DEVICE_PROFILE_KEYS, SCHEMA

log = logging.getLogger("train")


class StepProfiler:
    """MindSpore's profiler over steps [profile_step_start, profile_step_end) on the ranks of
    profile_ranks (Megatron's --profile, --profile-step-start/-end, --profile-ranks). Each
    profiled rank writes
    <profile_save_path>/rank_N/<host>_<pid>_..._ascend_ms/ASCEND_PROFILER_OUTPUT/trace_view.json
    (Chrome trace format: Perfetto or chrome://tracing) and per-op CSV summaries."""

    def __init__(self, cfg, rank):
        training_cfg = cfg.training_config
        self.first, self.end = training_cfg.profile_step_start, training_cfg.profile_step_end
        self.prof = None
        ranks = training_cfg.profile_ranks
        if not training_cfg.profile or (ranks is not None and rank not in ranks):
            return
        P = ms.profiler
        activities, options = _device_options(training_cfg)
        self.path = os.path.join(training_cfg.profile_save_path, f"rank_{rank}")
        schedule = P.schedule(wait=0, warmup=0, active=self.end - self.first, repeat=1)
        self.prof = P.profile(activities=activities, start_profile=False, schedule=schedule,
                              on_trace_ready=P.tensorboard_trace_handler(self.path), **options)

    def before(self, step):
        """Before step `step`: tracing starts at the first profiled step."""
        if self.prof is not None and step == self.first:
            self.prof.start()

    def after(self, step):
        """After step `step`: a profiled step recorded; after the last the trace is written."""
        if self.prof is None or not self.first <= step < self.end:
            return
        self.prof.step()
        if step == self.end - 1:
            self.prof.stop()
            log.info(f"profile: steps {self.first}-{step} traced under {self.path}")


def _device_options(training_cfg):
    """(activities, profiler options) for `training_cfg`: on the CPU op times alone (a
    device key set there is named in one warning); on Ascend or GPU the device's activity too and
    the profile_* options."""
    P = ms.profiler
    activities = [P.ProfilerActivity.CPU]
    if training_cfg.device_target == "CPU":
        defaults = SCHEMA["training_config"]
        ignored = [k for k in DEVICE_PROFILE_KEYS
                   if getattr(training_cfg, k) != defaults[k].default]
        if ignored:
            given = ", ".join(f"{k}={getattr(training_cfg, k)}" for k in ignored)
            log.warning(f"profile: the CPU profiler cannot collect {given}"
                        " (Ascend/GPU only); profiling op times only")
        return activities, {}
    if training_cfg.device_target == "Ascend":
        activities.append(P.ProfilerActivity.NPU)
    else:
        activities.append(P.ProfilerActivity.GPU)
    experimental = P._ExperimentalConfig(
        profiler_level=getattr(P.ProfilerLevel, training_cfg.profile_level.capitalize()),
        aic_metrics=list(P.AicoreMetrics)[training_cfg.profile_aicore_metrics],
        l2_cache=training_cfg.profile_l2_cache,
        data_simplification=training_cfg.profile_data_simplification)
    options = dict(with_stack=training_cfg.profile_with_stack,
                   profile_memory=training_cfg.profile_memory,
                   data_process=training_cfg.profile_data_process,
                   parallel_strategy=training_cfg.profile_parallel_strategy,
                   hbm_ddr=training_cfg.profile_hbm_ddr,
                   pcie=training_cfg.profile_pcie, experimental_config=experimental)
    return activities, options


if __name__ == "__main__":          # imported by train.py, not a script
    raise SystemExit("error: profiler.py is a library: run `bash run.sh` (bash run.sh --help "
                     "lists the commands)")
