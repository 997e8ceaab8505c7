//! Names of the environment variables a launcher sets for each worker, and those the driver,
//! the agents and the operator pass between them: one home for every name, which each side
//! imports, so that a renamed variable fails to compile instead of at run time.

/// The worker's global rank (Horovod's name).
pub const ENV_RANK: &str = "HOROVOD_RANK";
/// Number of workers (Horovod's name).
pub const ENV_SIZE: &str = "HOROVOD_SIZE";
/// Rank among the workers of the same host.
pub const ENV_LOCAL_RANK: &str = "HOROVOD_LOCAL_RANK";
/// Number of workers on this host.
pub const ENV_LOCAL_SIZE: &str = "HOROVOD_LOCAL_SIZE";
/// Rank among the workers with the same local rank, one per host.
pub const ENV_CROSS_RANK: &str = "HOROVOD_CROSS_RANK";
/// Number of hosts with a worker of this local rank.
pub const ENV_CROSS_SIZE: &str = "HOROVOD_CROSS_SIZE";
/// The host name the launcher placed this worker on.
pub const ENV_HOSTNAME: &str = "HOROVOD_HOSTNAME";
/// `host:port` of the driver's rendezvous listener.
pub const ENV_RENDEZVOUS_ADDR: &str = "HVD_RENDEZVOUS_ADDR";
/// The job's secret, presented on every request (and the same for every driver of a job with
/// a state store, which the operator sets in the driver pod).
pub const ENV_SECRET: &str = "HVD_SECRET";
/// The host remote workers dial the rendezvous at, when the driver's own address would not do:
/// one that outlives the driver, such as the Kubernetes Service in front of the driver pod.
pub const ENV_RENDEZVOUS_HOST: &str = "HVD_RENDEZVOUS_HOST";
/// The secret the driver and its `hvd-agent`s share.
pub const ENV_AGENT_SECRET: &str = "HVD_AGENT_SECRET";
/// The state store's (etcd's) user name.
pub const ENV_STATE_STORE_USERNAME: &str = "HVD_STATE_STORE_USERNAME";
/// The state store's (etcd's) password.
pub const ENV_STATE_STORE_PASSWORD: &str = "HVD_STATE_STORE_PASSWORD";
/// Seconds a worker that got a SIGTERM may take to leave the job gracefully before it ends at
/// once (default 30, Kubernetes' termination grace).
pub const ENV_NOTICE_GRACE: &str = "HVD_NOTICE_GRACE";
/// The process id of the launcher that started this worker (the driver or an agent): its
/// SIGTERM stops the worker at once; a SIGTERM from anyone else is a notice.
pub const ENV_LAUNCHER_PID: &str = "HVD_LAUNCHER_PID";
/// The cloud whose instance metadata this worker watches for preemption notices: `aws`, `gce`
/// or `azure` (`horovodrun --preemption-watch`, or the `hvd-agent` that started it).
pub const ENV_PREEMPTION_WATCH: &str = "HVD_PREEMPTION_WATCH";
/// Where the cloud's instance metadata server answers (default `http://169.254.169.254`, the
/// address all three use); for tests and proxies.
pub const ENV_METADATA_ENDPOINT: &str = "HVD_METADATA_ENDPOINT";
/// Seconds between two reads of the cloud's preemption notice (default 2).
pub const ENV_PREEMPTION_POLL: &str = "HVD_PREEMPTION_POLL";
/// The address this worker binds its collective listener to (`127.0.0.3` for a local "host").
pub const ENV_BIND_ADDR: &str = "HVD_BIND_ADDR";
/// A network interface whose IPv4 address the worker binds to (`--network-interface`).
pub const ENV_NETWORK_INTERFACE: &str = "HVD_NETWORK_INTERFACE";
/// Seconds a collective may wait for a peer that every rank is waiting on (no progress).
pub const ENV_COLLECTIVE_TIMEOUT: &str = "HVD_COLLECTIVE_TIMEOUT";
/// Seconds a collective waits for the other ranks to arrive at it.
pub const ENV_ARRIVAL_TIMEOUT: &str = "HVD_ARRIVAL_TIMEOUT";
/// Seconds a worker waits for the rendezvous (the driver's `--start-timeout`).
pub const ENV_START_TIMEOUT: &str = "HOROVOD_START_TIMEOUT";
/// Milliseconds between background engine cycles (Horovod's name; `--cycle-time-ms`).
pub const ENV_CYCLE_TIME: &str = "HOROVOD_CYCLE_TIME";
/// Largest fusion buffer in bytes, 0 to disable fusion (Horovod's name; `--fusion-threshold-mb`).
pub const ENV_FUSION_THRESHOLD: &str = "HOROVOD_FUSION_THRESHOLD";
/// Seconds an op may wait for every rank to submit it before the stall check warns, naming
/// the ranks that have not (Horovod's name; `--stall-check-warning-time-seconds`, default 60).
pub const ENV_STALL_CHECK_TIME: &str = "HOROVOD_STALL_CHECK_TIME_SECONDS";
/// Seconds an op may wait for every rank before it fails on every rank as stalled; 0 (the
/// default) never fails it (Horovod's name; `--stall-check-shutdown-time-seconds`).
pub const ENV_STALL_SHUTDOWN_TIME: &str = "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS";
/// Set to `1` to turn the stall check off (Horovod's name; `--no-stall-check`).
pub const ENV_STALL_CHECK_DISABLE: &str = "HOROVOD_STALL_CHECK_DISABLE";
/// `1` asks for hierarchical allgather (gather on each host, allgather across hosts, broadcast
/// on each host), `0` forbids it (Horovod's name; `--[no-]hierarchical-allgather`).
pub const ENV_HIERARCHICAL_ALLGATHER: &str = "HOROVOD_HIERARCHICAL_ALLGATHER";
/// Set to `1` to let the engine tune its knobs on the running job (Horovod's name; `--autotune`).
pub const ENV_AUTOTUNE: &str = "HOROVOD_AUTOTUNE";
/// CSV file rank 0 logs every autotune sample to (Horovod's name; `--autotune-log-file`).
pub const ENV_AUTOTUNE_LOG: &str = "HOROVOD_AUTOTUNE_LOG";
/// Samples discarded before autotune starts optimising (`--autotune-warmup-samples`, default 3).
pub const ENV_AUTOTUNE_WARMUP_SAMPLES: &str = "HOROVOD_AUTOTUNE_WARMUP_SAMPLES";
/// Steps (engine cycles with work) scored per autotune sample (`--autotune-steps-per-sample`,
/// default 10).
pub const ENV_AUTOTUNE_STEPS_PER_SAMPLE: &str = "HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE";
/// Most samples of one Bayesian optimisation (`--autotune-bayes-opt-max-samples`, default 20).
pub const ENV_AUTOTUNE_BAYES_OPT_MAX_SAMPLES: &str = "HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES";
/// Noise regularisation of autotune's Gaussian process, 0 to 1
/// (`--autotune-gaussian-process-noise`, default 0.8).
pub const ENV_AUTOTUNE_GAUSSIAN_PROCESS_NOISE: &str = "HOROVOD_AUTOTUNE_GAUSSIAN_PROCESS_NOISE";
/// Seconds a collective waits for its peers before it fails (Horovod's name;
/// `--gloo-timeout-seconds`; hvd's default is 300, Horovod's 30).
pub const ENV_GLOO_TIMEOUT_SECONDS: &str = "HOROVOD_GLOO_TIMEOUT_SECONDS";
/// Cores the engine's background threads of a host are pinned to, one per local rank
/// (`0,1,2,3`; Horovod's name; `--thread-affinity`).
pub const ENV_THREAD_AFFINITY: &str = "HOROVOD_THREAD_AFFINITY";
/// NCCL streams per device (Horovod's name; `--num-nccl-streams`): this build has no NCCL, so
/// it is recorded and has no effect.
pub const ENV_NUM_NCCL_STREAMS: &str = "HOROVOD_NUM_NCCL_STREAMS";
/// Least level the workers' hvd logs (TRACE, DEBUG, INFO, WARNING, ERROR, FATAL; Horovod's
/// name; `--log-level`). `RUST_LOG` wins where set.
pub const ENV_LOG_LEVEL: &str = "HOROVOD_LOG_LEVEL";
/// Set to `1` to leave the time out of the workers' hvd log lines (Horovod's name;
/// `--log-without-timestamp`).
pub const ENV_LOG_HIDE_TIME: &str = "HOROVOD_LOG_HIDE_TIME";
/// Most ops whose negotiation each rank remembers, 0 to negotiate every op (Horovod's name;
/// `--cache-capacity`).
pub const ENV_CACHE_CAPACITY: &str = "HOROVOD_CACHE_CAPACITY";
/// `1` forces hierarchical allreduce (reduce on each host, ring across hosts, broadcast on each
/// host), `0` forbids it; unset chooses by placement (Horovod's name; `--hierarchical-allreduce`).
pub const ENV_HIERARCHICAL_ALLREDUCE: &str = "HOROVOD_HIERARCHICAL_ALLREDUCE";
/// TCP connections to each peer, 1 to 15 (`--tcp-streams`): the ring stripes its segments over
/// them. Every rank gets the same value.
pub const ENV_TCP_STREAMS: &str = "HVD_TCP_STREAMS";
/// Most connections per peer `HVD_TCP_STREAMS` may ask for (the collectives' limit).
pub const MAX_TCP_STREAMS: usize = 15;
/// Set to `0` to keep `horovodrun` from asking the workers' allocators for transparent huge
/// pages (`GLIBC_TUNABLES=glibc.malloc.hugetlb=1` for
/// glibc's malloc, `THP_MEM_ALLOC_ENABLE=1` for PyTorch's; each unless the user set it).
pub const ENV_HUGE_PAGES: &str = "HVD_HUGE_PAGES";
/// File every rank appends its engine timeline to (a Chrome trace; `--timeline-filename`).
pub const ENV_TIMELINE: &str = "HOROVOD_TIMELINE";
/// Set to `1` to mark every engine cycle on the timeline (`--timeline-mark-cycles`).
pub const ENV_TIMELINE_MARK_CYCLES: &str = "HOROVOD_TIMELINE_MARK_CYCLES";
/// Set to `0` to keep ranks of one host from reading each other's buffers directly (they
/// then use TCP, as between hosts).
pub const ENV_SAME_HOST_COPY: &str = "HVD_SAME_HOST_COPY";
/// The driver-given id of this worker process, stable across rounds (elastic jobs).
pub const ENV_WORKER_ID: &str = "HVD_WORKER_ID";
/// Set to `1` when the job is elastic: ranks come from the driver at every round.
pub const ENV_ELASTIC: &str = "HOROVOD_ELASTIC";
/// Seconds a worker waits in a rendezvous round before giving up (Horovod's elastic timeout).
pub const ENV_ELASTIC_TIMEOUT: &str = "HOROVOD_ELASTIC_TIMEOUT";
/// Seconds a worker trains on without its driver, reconnecting to the same rendezvous
/// address, before it exits (`--driver-grace`; set only with a state store: without one a
/// worker whose driver is gone exits at once).
pub const ENV_DRIVER_GRACE: &str = "HVD_DRIVER_GRACE";

/// The `tracing` directive of one of Horovod's log levels (`TRACE`, `DEBUG`, `INFO`,
/// `WARNING`, `ERROR`, `FATAL`, any case; tracing has nothing above errors, so FATAL logs
/// errors); `None` for another word.
pub fn log_directive(level: &str) -> Option<&'static str> {
    Some(match level.trim().to_ascii_uppercase().as_str() {
        "TRACE" => "trace",
        "DEBUG" => "debug",
        "INFO" => "info",
        "WARNING" | "WARN" => "warn",
        "ERROR" | "FATAL" => "error",
        _ => return None,
    })
}
