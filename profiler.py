"""Profiling with the guide's keys and Megatron's flags: MindSpore's profiler over a window of
training steps on chosen ranks; a key the CPU profiler cannot honour is named in one warning."""
import logging
import os

import mindspore as ms

from keys import DEVICE_PROFILE_KEYS, SCHEMA

log = logging.getLogger("train")


class StepProfiler:
    """MindSpore's profiler over steps [profile_step_start, profile_step_end) on the ranks of
    profile_ranks (Megatron's --profile, --profile-step-start/-end, --profile-ranks). Each
    profiled rank writes <profile_save_path>/rank_N/<host>_<pid>_..._ascend_ms/ASCEND_PROFILER_OUTPUT/
    trace_view.json (Chrome trace format: Perfetto or chrome://tracing) and per-op CSV summaries."""

    def __init__(self, cfg, rank):
        t = cfg.training_config
        self.first, self.end, self.prof = t.profile_step_start, t.profile_step_end, None
        if not t.profile or (t.profile_ranks is not None and rank not in t.profile_ranks):
            return
        P = ms.profiler
        activities = [P.ProfilerActivity.CPU]
        options = {}
        if t.device_target == "CPU":
            ignored = [k for k in DEVICE_PROFILE_KEYS if getattr(t, k) != SCHEMA["training_config"][k].default]
            if ignored:
                log.warning(f"profile: the CPU profiler cannot collect {', '.join(f'{k}={getattr(t, k)}' for k in ignored)}"
                            " (Ascend/GPU only); profiling op times only")
        else:
            activities.append(P.ProfilerActivity.NPU if t.device_target == "Ascend" else P.ProfilerActivity.GPU)
            options = dict(with_stack=t.profile_with_stack, profile_memory=t.profile_memory,
                           data_process=t.profile_data_process, parallel_strategy=t.profile_parallel_strategy,
                           hbm_ddr=t.profile_hbm_ddr, pcie=t.profile_pcie, experimental_config=P._ExperimentalConfig(
                               profiler_level=getattr(P.ProfilerLevel, t.profile_level.capitalize()),
                               aic_metrics=list(P.AicoreMetrics)[t.profile_aicore_metrics], l2_cache=t.profile_l2_cache,
                               data_simplification=t.profile_data_simplification))
        self.path = os.path.join(t.profile_save_path, f"rank_{rank}")
        self.prof = P.profile(activities=activities, start_profile=False,
                              schedule=P.schedule(wait=0, warmup=0, active=self.end - self.first, repeat=1),
                              on_trace_ready=P.tensorboard_trace_handler(self.path), **options)

    def before(self, step):
        if self.prof is not None and step == self.first:
            self.prof.start()

    def after(self, step):
        if self.prof is None or not self.first <= step < self.end:
            return
        self.prof.step()
        if step == self.end - 1:
            self.prof.stop()
            log.info(f"profile: steps {self.first}-{step} traced under {self.path}")
