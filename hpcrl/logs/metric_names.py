"""Names of every log column that crosses a job boundary, defined once.

The jobs write these names (``logs/metrics.jsonl`` from the trainer, one row per
local update; ``logs/rollout-<writer>.jsonl`` from each rollout job, one row per
weight version; ``logs/staleness.jsonl.gz`` from the trainer, one row per consumed
trajectory); the launcher's follower, ``hpcrl status`` and ``hpcrl report`` read
them. verl's ``fully_async_policy`` names are kept where they exist, so dashboards
built for verl read ours. The per-update algorithm metrics (``actor/*``,
``critic/*``, ``rollout_corr/*``) are named where they are computed
(``hpcrl/trainer/``); the few that the analysis reads are named here too.

Units are in the names: ``*_s`` seconds (``time_s``: unix time), ``*_ratio`` in [0, 1].
"""
from __future__ import annotations

# ---- trainer: logs/metrics.jsonl, one row per local update -------------------------
STEP = "step"
"""Local update number, 1-based."""
PARAM_VERSION = "param_version"
"""Trainer: the version the update started from. Rollout log: the version generated with."""
CONSUMED_GROUPS = "consumed_groups"
"""Groups the trainer has consumed (trained on, dropped or skipped) so far."""
TIME_S = "time_s"
"""Unix time the row was written."""
N_TOKENS = "n_tokens"
"""Response tokens (mask 1) in the update."""
WAIT_SAMPLES_S = "timing_s/wait_samples"
"""Seconds the trainer waited for committed groups before the update."""
UPDATE_S = "timing_s/update"
"""Seconds of the update itself (log-probs, advantages, optimizer steps)."""
SIMULATED_UPDATE_MODEL_S = "simulated/update_model_s"
"""``trainer.simulated`` only: the modelled GPU seconds of the update (``timing_s/update`` x time_scale, ideally)."""
PARAM_SYNC_S = "timing_s/param_sync"
"""Seconds spent publishing a weight version after the update (0 if none)."""
PARAM_SYNC_GATHER_S = "timing_s/param_sync/gather"
"""Trainer: seconds to gather the policy's weights (ZeRO-3: onto rank 0) for a publish."""
PARAM_SYNC_FILES_S = "timing_s/param_sync/files"
"""Trainer: seconds to write the version's folder (the filesystem path, always taken)."""
PARAM_SYNC_TRANSFER_S = "timing_s/param_sync/transfer"
"""Trainer: seconds of the broadcast (group, buckets, acknowledgements); 0 if there was none."""
WEIGHTS_PATH = "weights/path"
"""How a version travelled: ``broadcast`` (trainer: at least one rollout job acknowledged it;
rollout: the engine got it from the broadcast) or ``filesystem``."""
WEIGHTS_BYTES = "weights/bytes"
"""Bytes of the version's tensors moved by the path taken."""
WEIGHTS_GB_PER_S = "weights/gb_per_s"
"""WEIGHTS_BYTES / transfer seconds / 1e9 (broadcast: buckets only; files: write or read+verify)."""
WEIGHTS_MEMBERS = "weights/broadcast_members"
"""Trainer: rollout jobs that acknowledged the broadcast of the version."""
MAX_MEMORY_ALLOCATED_GB = "perf/max_memory_allocated_gb"
"""Trainer rank 0: peak GPU memory allocated by torch during the update, GiB (verl's name; 0 on a CPU)."""
MAX_MEMORY_RESERVED_GB = "perf/max_memory_reserved_gb"
"""Trainer rank 0: peak GPU memory reserved by torch's caching allocator during the update, GiB (0 on a CPU)."""
CPU_MEMORY_USED_GB = "perf/cpu_memory_used_gb"
"""Trainer rank 0: peak resident memory of the process during the update, GiB (the kernel's high-water mark,
reset at each update's start; verl's name)."""
TRAINER_IDLE_RATIO = "trainer/idle_ratio"
"""wait / (wait + update + sync) of the update."""
TOKENS_PER_S = "throughput/tokens_per_s"
"""Response tokens per second (trainer: of the update; rollout: of the version)."""
LAG_MEAN = "fully_async/lag/mean"
"""Mean over the update's groups of trainer version - oldest token version."""
LAG_MAX = "fully_async/lag/max"
"""Max of the same."""
REWARD_MEAN = "reward/mean"
"""Mean trajectory reward of the update's groups."""
GRAD_NORM = "actor/grad_norm"
"""Global gradient norm before clipping."""

# Counters: running totals over the run, in every row once the first one is counted.
STALE_SAMPLES = "fully_async/count/stale_samples_processed"
"""Groups trained on with lag > 0."""
STALE_TRAJECTORIES = "fully_async/count/stale_trajectory_processed"
"""Trajectories of those groups."""
DROPPED_MAX_STALENESS = "fully_async/count/dropped_max_staleness"
"""Groups dropped because their lag exceeded async_training.max_staleness."""
CORRUPT_GROUPS_SKIPPED = "fully_async/count/corrupt_groups_skipped"
"""Groups of shards the trainer skipped as damaged (their prompts are regenerated)."""
DROPPED_FILTER_GROUPS = "fully_async/count/dropped_filter_groups"
"""Groups dropped by dynamic sampling (algorithm.filter_groups: their metric had no spread); consumed, not trained.
(verl's fully_async counts them as ``filtered_samples_count`` on the rollout side.)"""
NUM_GEN_BATCHES = "train/num_gen_batches"
"""verl's DAPO metric: batches of R groups the update took, kept and dropped (1 when nothing was dropped)."""
DROPPED_LAG_BOUND = "fully_async/count/dropped_lag_bound"
"""Groups dropped because their newest token lagged the trainer by more than the lag bound (the rollout jobs'
commit check keeps them from being committed; this counts any that got past it)."""
COUNTERS = (STALE_SAMPLES, STALE_TRAJECTORIES, DROPPED_MAX_STALENESS, CORRUPT_GROUPS_SKIPPED, DROPPED_FILTER_GROUPS,
            DROPPED_LAG_BOUND)
"""Every counter; a reader takes 0 for a counter a row lacks."""

METRICS_COLUMNS = (STEP, PARAM_VERSION, CONSUMED_GROUPS, TIME_S, WAIT_SAMPLES_S, UPDATE_S, PARAM_SYNC_S,
                   TRAINER_IDLE_RATIO, REWARD_MEAN, N_TOKENS, TOKENS_PER_S, LAG_MEAN, LAG_MAX)
"""Columns every trainer metrics row has (the report needs them)."""

# ---- rollout: logs/rollout-<writer>.jsonl, one row per weight version ----------------
WRITER = "writer"
"""Writer name of the rollout job (``w000``)."""
GROUPS = "groups"
TRAJECTORIES = "trajectories"
TOKENS = "tokens"
WALL_S = "wall_s"
"""Seconds from this version's load to the next version's load."""
ROLLOUT_IDLE_RATIO = "rollouter/idle_ratio"
"""Share of wall_s with no group in flight."""
LOAD_WEIGHTS_S = "timing_s/load_weights"
"""Seconds to load this version into the engine."""
LOAD_TRANSFER_S = "timing_s/load_weights/transfer"
"""Rollout: seconds the version's tensors took to arrive: broadcast = receiving the buckets (in the
background, while generating) plus any wait for them at the switch; files = reading and verifying."""
LOAD_APPLY_S = "timing_s/load_weights/apply"
"""Rollout: seconds the engine took to adopt the tensors."""
ROLLOUT_REWARD_MEAN = "reward_mean"
"""Mean trajectory reward of the groups generated with this version."""
PARTIAL_GROUPS = "fully_async/partial/total_partial_num"
"""Rollout: groups in flight carried over into the next version (aborted and continued there)."""
PARTIAL_RATIO = "fully_async/partial/partial_ratio"
"""Trainer: share of an update's groups sampled under more than one version."""
MAX_PARTIAL_SPAN = "fully_async/partial/max_partial_span"
"""Trainer: largest version_end - version_start among an update's groups."""
PAUSE_S = "timing_s/pause"
"""Rollout: seconds from a new version being seen to the engine's generations stopped (partial rollout)."""
RESPONSE_CLIP_RATIO = "response_length/clip_ratio"
"""Share of this version's responses cut at rollout.response_length (no EOS; verl's name)."""
NUM_TURNS_MEAN = "num_turns/mean"
"""Turns (assistant + tool) per trajectory, mean over the version's trajectories (verl's name)."""
NUM_TURNS_MAX = "num_turns/max"
TOOL_CALLS_MEAN = "tool_calls/mean"
"""Tool calls per trajectory (answered or failed), mean."""
TOOL_ERRORS = "tool_calls/errors"
"""Tool calls that failed or did not parse (each ended its episode)."""
TOOL_LATENCY_S = "timing_s/tool_call"
"""Mean seconds per tool call."""
RESUMED_GROUPS = "fully_async/partial/resumed_num"
"""Groups continued from the state a previous job of this writer saved (control/in_flight/)."""
LAG_CARRIED = "fully_async/lag_bound/carried"
"""Rollout: finished groups refused at commit because they could be trained beyond the lag bound (the job missed
a version), carried into a newer version instead (partial rollout: their last sampled tokens generated again)."""
LAG_DROPPED = "fully_async/lag_bound/dropped"
"""Rollout: such groups dropped (no partial rollout, or nothing to reopen) and generated again from scratch."""

REWARD_ERRORS = "reward/errors"
"""Responses whose reward function raised (each got reward 0; logged with its sample id)."""
REWARD_FIRST_ERROR = "reward/first_error"
"""Text: the sample id and message of the version's first reward error (only in rows with errors)."""
TOOL_FIRST_ERROR = "tool_calls/first_error"
"""Text: the sample id and message of the version's first tool error (only in rows with errors)."""
PROMPTS_FILTERED = "data/prompts_filtered"
"""Prompts of data.source the rollout job dropped for being over data.max_prompt_length (the whole file)."""
PROMPTS_TRUNCATED = "data/prompts_truncated"
"""Prompts it cut to data.max_prompt_length (data.truncation left/right; the whole file)."""
SAMPLE_ID = "sample/id"
"""Text: ``<writer>/<prompt index>/<j>`` of one response of the version (the first group's first one)."""
SAMPLE_PROMPT = "sample/prompt"
"""Text: its prompt (the last message's content), cut to 200 characters."""
SAMPLE_RESPONSE = "sample/response"
"""Text: its response, cut to 500 characters (``hpcrl samples RUN`` decodes them all from the shards)."""
SAMPLE_REWARD = "sample/reward"
"""Its reward."""
TIMING_REWARD = "timing_s/reward"
"""Seconds the version's groups waited for the reward model after they finished generating, summed (verl's timing
name of reward computation; the engine generated other groups meanwhile)."""
REWARD_MODEL_GROUPS = "reward_model/groups"
"""Groups scored by the reward model in the version."""
REWARD_MODEL_S_PER_GROUP = "reward_model/seconds_per_group"
"""Mean seconds from a group's request to the reward model until all its scores were in."""
REWARD_MODEL_PROBLEMS = "reward_model/problems"
"""Responses the reward model gave no score (an input too long, a judge's text without a verdict, a failed job)."""
REWARD_MODEL_FIRST_PROBLEM = "reward_model/first_problem"
"""Text: the first of them (only in rows with problems)."""
REWARD_MODEL_RETRIES = "reward_model/retries"
"""Requests sent again since the job started (a reward job gone, a damaged or late reply)."""
PROBLEM_COUNTS = (REWARD_ERRORS, TOOL_ERRORS)
"""Per-version counts of things that went wrong, shown on the console, in ``hpcrl status`` and the report."""
REWARD_EXTRA_PREFIX = "reward_extra/"
"""+ key: mean over the version's responses of a number a reward function returned besides ``score``."""

ROLLOUT_COLUMNS = (WRITER, PARAM_VERSION, GROUPS, TOKENS, WALL_S, ROLLOUT_IDLE_RATIO, LOAD_WEIGHTS_S, TOKENS_PER_S,
                   TIME_S)
"""Columns every rollout row has (the report needs them)."""

# ---- reward jobs: logs/reward-<i>.jsonl, a row a minute and a last one (hpcrl/reward/job.py) ----
REWARD_JOB_ITEMS = "reward_job/items"
"""Responses scored (and free prompts answered) since the job started."""
REWARD_JOB_REQUESTS = "reward_job/requests"
"""Requests answered since the job started."""
REWARD_JOB_IDLE_RATIO = "reward_job/idle_ratio"
"""Share of the job's serving time its model was not computing."""
REWARD_JOB_ITEMS_PER_S = "reward_job/items_per_s"
"""Responses scored per second of the model's computing time."""
REWARD_JOB_QUEUE_MAX = "reward_job/queue_max"
"""Most items one batch of the model took (requests of several clients together)."""

# ---- evaluation: the metrics of a logs/eval.jsonl row (hpcrl/logs/eval_log.py), verl's names ----
VAL_CORE = "val-core"
"""verl's section of the headline validation metrics: ``val-core/<data_source>/<key>/<stat>`` (``hpcrl/eval/metrics.py``
says which are core)."""
VAL_AUX = "val-aux"
"""verl's section of every other validation metric."""
VAL_RESPONSE_LENGTH = "response_length/mean"
"""+ ``val-aux/<data_source>/``: mean response length in tokens."""
VAL_CLIP_RATIO = "response_length/clip_ratio"
"""+ ``val-aux/<data_source>/``: share of responses cut at the response length."""

# ---- logs/staleness.jsonl.gz, one row per consumed trajectory -----------------------------
STALENESS_COLUMNS = [
    "sample_id",        # "<writer>/<prompt_index>/<j>": trajectory j of that group
    "group_id",         # "<writer>/<prompt_index>"
    "writer",
    "shard",
    "version_start",    # oldest policy version among the trajectory's tokens
    "version_end",      # newest policy version among its tokens
    "trainer_version",  # newest published version when the trainer consumed it
    "trainer_step",     # local update that consumed it (1-based)
    "lag",              # trainer_version - version_start
    "n_tokens",         # response tokens (mask 1)
    "reward",
    # unix times: generation started, group complete, shard committed, and the end of the
    # local update that trained on it (after that update's weight publish, if any)
    "created_s", "finished_s", "committed_s", "consumed_s",
    "dropped",          # "" if trained on; else why it was dropped (e.g. "max_staleness")
]
"""Columns of the staleness log, in order."""
