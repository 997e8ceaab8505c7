//! Command-line flags, named and meaning as in Horovod's `horovodrun`.

use std::path::PathBuf;

use clap::{Parser, ValueEnum};
use hvd_discovery::kubernetes::PodSelector;

/// How workers are started (`--launcher`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum LauncherKind {
    /// Local processes for 127.0.0.x, `localhost` and this host; `ssh` for the others.
    Auto,
    /// Every worker through the `hvd-agent` on its host (secret in HVD_AGENT_SECRET).
    Agent,
}

/// Where an elastic job's hosts come from (`--discovery`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum DiscoveryKind {
    /// `--host-discovery-script`, run every `--discovery-interval`.
    Script,
    /// The Ready worker pods matching `--selector`, kept current by a watch on the API server.
    Kubernetes,
}

/// Least level logged (`--log-level`), Horovod's names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
#[value(rename_all = "UPPER")]
pub enum LogLevel {
    /// Everything.
    Trace,
    /// Decisions in detail.
    Debug,
    /// Progress.
    Info,
    /// Problems that are handled (Horovod's default).
    Warning,
    /// Failures.
    Error,
    /// Failures that end the job.
    Fatal,
}

impl LogLevel {
    /// Horovod's name of the level, as `HOROVOD_LOG_LEVEL` takes it.
    pub fn name(self) -> &'static str {
        match self {
            Self::Trace => "TRACE",
            Self::Debug => "DEBUG",
            Self::Info => "INFO",
            Self::Warning => "WARNING",
            Self::Error => "ERROR",
            Self::Fatal => "FATAL",
        }
    }

    /// The `tracing` directive of the level (FATAL logs errors: tracing has no level above).
    pub fn directive(self) -> &'static str {
        hvd_rendezvous::log_directive(self.name()).unwrap_or("warn")
    }
}

/// Launches a Horovod-compatible training program on one or more hosts.
#[derive(Debug, Parser)]
#[command(
    name = "horovodrun",
    version,
    about,
    trailing_var_arg = true,
    disable_version_flag = true
)]
pub struct Args {
    /// Shows the version and exits.
    #[arg(short = 'v', long = "version", action = clap::ArgAction::Version)]
    pub version: Option<bool>,

    /// Total number of training processes (`-np`); a static job defaults to every slot of its
    /// hosts (one process here when no host is named), an elastic one to --min-np. In an LSF
    /// job (`LSB_JOBID` set) it defaults to every slot of the job, whose hosts (`LSB_MCPU_HOSTS`,
    /// else `LSB_HOSTS`) are used when no -H, --hostfile or discovery names any.
    #[arg(long = "num-proc", value_name = "N")]
    pub np: Option<usize>,

    /// Shows which frameworks, controllers and tensor operations this build has, and exits
    /// (`-cb`).
    #[arg(long = "check-build")]
    pub check_build: bool,

    /// Reads Horovod's YAML runtime configuration (params, autotune, timeline, stall_check,
    /// library_options, logging); a value given as a flag wins over the file's.
    #[arg(long = "config-file", value_name = "FILE")]
    pub config_file: Option<PathBuf>,

    /// Horovod caches the results of its launch checks for 60 minutes unless this is given;
    /// horovodrun keeps no such cache and checks afresh on every run, so this changes nothing.
    #[arg(long = "disable-cache")]
    pub disable_cache: bool,

    /// Use the Gloo controller: hvd's own TCP transport is Gloo-style and always used, so this
    /// is accepted and changes nothing.
    #[arg(long = "gloo", conflicts_with_all = ["mpi", "jsrun"])]
    pub gloo: bool,

    /// Refused: hvd does not use MPI (its collectives run over its own TCP transport).
    #[arg(long = "mpi", conflicts_with = "jsrun")]
    pub mpi: bool,

    /// Refused: hvd does not launch through jsrun; in an LSF job it reads the job's hosts from
    /// LSF and starts the workers over ssh (or through --launcher agent).
    #[arg(long = "jsrun")]
    pub jsrun: bool,

    /// Refused: hvd does not run mpirun, so there are no MPI arguments to pass.
    #[arg(long = "mpi-args", value_name = "ARGS", allow_hyphen_values = true)]
    pub mpi_args: Option<String>,

    /// Refused: process binding belongs to mpirun; hvd pins its engine thread with
    /// --thread-affinity, and a command wrapped in taskset or numactl binds the rest.
    #[arg(long = "binding-args", value_name = "ARGS", allow_hyphen_values = true)]
    pub binding_args: Option<String>,

    /// Disable MPI threading: it applies to MPI only, as with Horovod, and hvd does not use
    /// MPI, so it has no effect.
    #[arg(
        long = "mpi-threads-disable",
        conflicts_with = "no_mpi_threads_disable"
    )]
    pub mpi_threads_disable: bool,

    /// Keep MPI threading (no effect: hvd does not use MPI).
    #[arg(long = "no-mpi-threads-disable", hide = true)]
    pub no_mpi_threads_disable: bool,

    /// Use only TCP: hvd's transport is TCP; workers get NCCL_IB_DISABLE=1 as with Horovod,
    /// for NCCL a framework may use itself.
    #[arg(long = "tcp")]
    pub tcp: bool,

    /// Hosts and slots: `host1:2,host2:4` (a bare host has one slot).
    #[arg(short = 'H', long = "hosts", value_name = "HOSTS")]
    pub hosts: Option<String>,

    /// File of hosts: `host slots=N` a line, `#` comments.
    #[arg(long = "hostfile", value_name = "FILE", conflicts_with = "hosts")]
    pub hostfile: Option<PathBuf>,

    /// SSH port of the remote hosts.
    #[arg(short = 'p', long = "ssh-port", value_name = "PORT")]
    pub ssh_port: Option<u16>,

    /// SSH identity (private key) file for the remote hosts.
    #[arg(short = 'i', long = "ssh-identity-file", value_name = "FILE")]
    pub ssh_identity_file: Option<PathBuf>,

    /// Also write each rank's output to DIR/rank.N/{stdout,stderr}.
    #[arg(long = "output-filename", value_name = "DIR")]
    pub output_filename: Option<PathBuf>,

    /// Log the driver's decisions in detail.
    #[arg(long = "verbose")]
    pub verbose: bool,

    /// Seconds to wait for every worker to start and register (env HOROVOD_START_TIMEOUT).
    #[arg(long = "start-timeout", value_name = "SECS")]
    pub start_timeout: Option<f64>,

    /// Network interfaces the workers may use, comma-separated: hvd's transport uses the
    /// first (as Horovod's Gloo does).
    #[arg(long = "network-interfaces", value_name = "IFACES")]
    pub network_interfaces: Option<String>,

    /// A network interface the workers may use (may be given more than once; Horovod's older
    /// spelling of --network-interfaces).
    #[arg(long = "network-interface", value_name = "IFACE", action = clap::ArgAction::Append)]
    pub network_interface: Vec<String>,

    /// Elastic: fewest workers training continues with (defaults to -np). Turns elastic mode on.
    #[arg(long = "min-np", alias = "min-num-proc", value_name = "N")]
    pub min_np: Option<usize>,

    /// Elastic: most workers started (defaults to -np).
    #[arg(long = "max-np", alias = "max-num-proc", value_name = "N")]
    pub max_np: Option<usize>,

    /// Elastic: a script printing the available hosts, one `host[:slots]` a line. Turns
    /// elastic mode on.
    #[arg(long = "host-discovery-script", value_name = "SCRIPT", conflicts_with_all = ["hosts", "hostfile"])]
    pub discovery_script: Option<String>,

    /// Elastic: slots of a host the discovery script prints without `:slots`.
    #[arg(long = "slots", alias = "slots-per-host", value_name = "S")]
    pub slots: Option<usize>,

    /// Elastic: a failed host comes back after LO seconds, doubling with each failure up to HI
    /// (plus jitter). Without it, failed hosts are blacklisted for good.
    #[arg(long = "blacklist-cooldown-range", num_args = 2, value_names = ["LO", "HI"])]
    pub cooldown_range: Option<Vec<f64>>,

    /// Elastic: seconds to wait for enough slots (env HOROVOD_ELASTIC_TIMEOUT, default 600).
    #[arg(long = "elastic-timeout", value_name = "SECS")]
    pub elastic_timeout: Option<f64>,

    /// Seconds a worker may answer nothing, not even the driver's pings, before it is declared
    /// frozen (stopped, a paused VM, stuck in the kernel), killed, and its host handled as
    /// failed; a worker busy in a long step still answers (env HVD_HEARTBEAT_TIMEOUT, default
    /// 3). In a static job a frozen worker fails the job.
    #[arg(long = "heartbeat-timeout", value_name = "SECS")]
    pub heartbeat_timeout: Option<f64>,

    /// Elastic: each worker watches its cloud's instance metadata (aws, gce or azure) for a
    /// preemption notice; at one, its host leaves the job gracefully before the machine goes
    /// (env HVD_PREEMPTION_WATCH; an `hvd-agent --preemption-watch` does the same for the
    /// workers it starts).
    #[arg(long = "preemption-watch", value_name = "CLOUD", value_parser = clap::value_parser!(hvd_rendezvous::Cloud))]
    pub preemption_watch: Option<hvd_rendezvous::Cloud>,

    /// Elastic: a rank whose step takes this many times the median rank's, for 20 steps and
    /// at least 5 s, is a straggler (default 1.3; measured by the background engine, which
    /// the Python frameworks run).
    #[arg(long = "straggler-factor", value_name = "F")]
    pub straggler_factor: Option<f64>,

    /// Elastic: `warn` (the default) reports a straggler; `evict` also removes its host
    /// gracefully and cools it down with the blacklist's cooldown, one host per window and
    /// never below --min-np (env HVD_STRAGGLER_POLICY).
    #[arg(long = "straggler-policy", value_name = "POLICY", value_parser = ["warn", "evict"])]
    pub straggler_policy: Option<String>,

    /// Elastic: more resets than this fail the job (default unlimited).
    #[arg(long = "reset-limit", value_name = "K")]
    pub reset_limit: Option<usize>,

    /// Elastic: seconds between discovery script runs.
    #[arg(
        long = "discovery-interval",
        value_name = "SECS",
        default_value_t = 1.0
    )]
    pub discovery_interval: f64,

    /// Elastic: a discovery script running longer than this is killed and counts as failed.
    #[arg(
        long = "discovery-timeout",
        value_name = "SECS",
        default_value_t = 30.0
    )]
    pub discovery_timeout: f64,

    /// Record every rank's collective engine (and elastic resets) as a Chrome trace in FILE.
    #[arg(long = "timeline-filename", value_name = "FILE")]
    pub timeline: Option<PathBuf>,

    /// Mark every engine cycle on the timeline.
    #[arg(
        long = "timeline-mark-cycles",
        conflicts_with = "no_timeline_mark_cycles"
    )]
    pub timeline_mark_cycles: bool,

    /// Don't mark engine cycles on the timeline (the default).
    #[arg(long = "no-timeline-mark-cycles", hide = true)]
    pub no_timeline_mark_cycles: bool,

    /// Let the engine tune fusion threshold, cycle time, response cache and hierarchical
    /// allreduce/allgather on the running job by Bayesian optimisation of its throughput;
    /// knobs set explicitly are held constant.
    #[arg(long = "autotune", conflicts_with = "no_autotune")]
    pub autotune: bool,

    /// Don't autotune (the default).
    #[arg(long = "no-autotune", hide = true)]
    pub no_autotune: bool,

    /// Autotune: CSV log of every sample's knobs and score; the last row is the best.
    #[arg(long = "autotune-log-file", value_name = "FILE")]
    pub autotune_log_file: Option<PathBuf>,

    /// Autotune: samples discarded before optimising (default 3).
    #[arg(long = "autotune-warmup-samples", value_name = "N")]
    pub autotune_warmup_samples: Option<u32>,

    /// Autotune: steps scored per sample (default 10).
    #[arg(long = "autotune-steps-per-sample", value_name = "N")]
    pub autotune_steps_per_sample: Option<u32>,

    /// Autotune: most samples of one Bayesian optimisation (default 20).
    #[arg(long = "autotune-bayes-opt-max-samples", value_name = "N")]
    pub autotune_bayes_opt_max_samples: Option<u32>,

    /// Autotune: noise regularisation of the Gaussian process, 0 to 1 (default 0.8).
    #[arg(long = "autotune-gaussian-process-noise", value_name = "X")]
    pub autotune_gaussian_process_noise: Option<f64>,

    /// Turn the stall check off: no warning about ops some ranks have not submitted.
    #[arg(long = "no-stall-check", conflicts_with = "stall_check")]
    pub no_stall_check: bool,

    /// Keep the stall check on (the default).
    #[arg(long = "stall-check", hide = true)]
    pub stall_check: bool,

    /// Seconds an op may wait for every rank before a warning names the ranks that have not
    /// submitted it (default 60).
    #[arg(long = "stall-check-warning-time-seconds", value_name = "SECS")]
    pub stall_check_warning_time_seconds: Option<u64>,

    /// Seconds an op may wait for every rank before it fails on all of them, naming the
    /// missing ranks; applies when above the warning time (default 0: never).
    #[arg(long = "stall-check-shutdown-time-seconds", value_name = "SECS")]
    pub stall_check_shutdown_time_seconds: Option<u64>,

    /// NCCL streams per device; this build has no NCCL, so it has no effect (as in a Horovod
    /// built without NCCL).
    #[arg(long = "num-nccl-streams", value_name = "N")]
    pub num_nccl_streams: Option<u32>,

    /// Cores the workers' engine threads are pinned to, one per rank of a host: local rank i
    /// takes the i-th (`0,1,2,3`); a list shorter than a host's ranks pins nothing.
    #[arg(long = "thread-affinity", value_name = "CORES")]
    pub thread_affinity: Option<String>,

    /// Seconds a collective waits for its peers before it fails (Horovod's Gloo timeout;
    /// hvd's default is 300).
    #[arg(long = "gloo-timeout-seconds", value_name = "SECS")]
    pub gloo_timeout_seconds: Option<u64>,

    /// Least level the workers' hvd logs, and the driver's when RUST_LOG is unset
    /// (TRACE, DEBUG, INFO, WARNING, ERROR, FATAL; default WARNING).
    #[arg(
        long = "log-level",
        value_enum,
        ignore_case = true,
        value_name = "LEVEL"
    )]
    pub log_level: Option<LogLevel>,

    /// Log lines with their time (the default).
    #[arg(
        long = "log-with-timestamp",
        hide = true,
        conflicts_with = "log_without_timestamp"
    )]
    pub log_with_timestamp: bool,

    /// Log lines without their time (driver and workers).
    #[arg(
        long = "log-without-timestamp",
        visible_alias = "log-hide-timestamp",
        conflicts_with = "no_log_hide_timestamp"
    )]
    pub log_without_timestamp: bool,

    /// Horovod's older spelling of --log-with-timestamp.
    #[arg(long = "no-log-hide-timestamp", hide = true)]
    pub no_log_hide_timestamp: bool,

    /// Prefix every line of the workers' output with the local time (`-prefix-timestamp`).
    #[arg(long = "prefix-output-with-timestamp")]
    pub prefix_output_with_timestamp: bool,

    /// Milliseconds between the background engine's cycles (env HOROVOD_CYCLE_TIME).
    #[arg(long = "cycle-time-ms", value_name = "MS")]
    pub cycle_time_ms: Option<f64>,

    /// Largest fusion buffer in MiB, 0 to disable fusion (env HOROVOD_FUSION_THRESHOLD).
    #[arg(long = "fusion-threshold-mb", value_name = "MB")]
    pub fusion_threshold_mb: Option<f64>,

    /// Most ops whose negotiation each rank remembers, 0 to negotiate every op (env
    /// HOROVOD_CACHE_CAPACITY; default 1024).
    #[arg(long = "cache-capacity", value_name = "N")]
    pub cache_capacity: Option<u64>,

    /// Always use hierarchical allreduce: reduce on each host, ring across hosts, broadcast on
    /// each host. Without it, the workers choose it when a job spans hosts with several ranks each.
    #[arg(
        long = "hierarchical-allreduce",
        conflicts_with = "no_hierarchical_allreduce"
    )]
    pub hierarchical_allreduce: bool,

    /// TCP connections between each pair of ranks (1 to 15, default 1): the ring stripes its
    /// segments over them, which pays where one stream cannot fill the network (env
    /// HVD_TCP_STREAMS).
    #[arg(long = "tcp-streams", value_name = "N")]
    pub tcp_streams: Option<usize>,

    /// Never use hierarchical allreduce, even across hosts (autotune then leaves it off).
    #[arg(long = "no-hierarchical-allreduce")]
    pub no_hierarchical_allreduce: bool,

    /// Always use hierarchical allgather: gather on each host, allgather across hosts,
    /// broadcast on each host.
    #[arg(
        long = "hierarchical-allgather",
        conflicts_with = "no_hierarchical_allgather"
    )]
    pub hierarchical_allgather: bool,

    /// Never use hierarchical allgather (autotune then leaves it off).
    #[arg(long = "no-hierarchical-allgather")]
    pub no_hierarchical_allgather: bool,

    /// Refused: torus allreduce runs its cross-host step on NCCL, which this build lacks;
    /// --hierarchical-allreduce has the same shape over hvd's transport.
    #[arg(long = "torus-allreduce", conflicts_with = "no_torus_allreduce")]
    pub torus_allreduce: bool,

    /// Never use torus allreduce (hvd never does).
    #[arg(long = "no-torus-allreduce")]
    pub no_torus_allreduce: bool,

    /// How workers are started: `auto` (local processes for this machine, ssh otherwise) or
    /// `agent` (through the hvd-agent on every host; secret in HVD_AGENT_SECRET).
    #[arg(long = "launcher", value_enum, default_value_t = LauncherKind::Auto)]
    pub launcher: LauncherKind,

    /// Port the hvd-agents listen on (`--launcher agent`).
    #[arg(long = "agent-port", value_name = "PORT", default_value_t = hvd_agent::DEFAULT_PORT)]
    pub agent_port: u16,

    /// Elastic: serve the job's state as JSON on `GET /status` at this port (0: any free port,
    /// logged).
    #[arg(long = "status-port", value_name = "PORT")]
    pub status_port: Option<u16>,

    /// Elastic: keep the driver's state in etcd, `etcd://HOST:PORT[,HOST:PORT…]/PREFIX` (env
    /// HVD_STATE_STORE), so that a driver that dies is replaced (see --standby) and its workers
    /// train on meanwhile. Needs the job's secret in HVD_SECRET and a fixed
    /// --rendezvous-port, which every driver of the job shares.
    #[arg(long = "state-store", value_name = "URL")]
    pub state_store: Option<String>,

    /// With --state-store: wait while another driver of the job is active, and take over its
    /// workers when it goes away.
    #[arg(long = "standby")]
    pub standby: bool,

    /// With --state-store: seconds the active driver's lease lives without renewal; a standby
    /// takes over this long after the active driver stops (default 10).
    #[arg(long = "state-store-ttl", value_name = "SECS")]
    pub state_store_ttl: Option<f64>,

    /// With --state-store: seconds workers train on without a driver, reconnecting, before
    /// they give up and exit (default 60).
    #[arg(long = "driver-grace", value_name = "SECS")]
    pub driver_grace: Option<f64>,

    /// The port of the driver's rendezvous (default any free port). With --state-store it is
    /// required: a successor serves on the same one, where the workers look for it.
    #[arg(long = "rendezvous-port", value_name = "PORT")]
    pub rendezvous_port: Option<u16>,

    /// Elastic: where hosts come from: `script` (implied by --host-discovery-script) or
    /// `kubernetes` (the Ready pods matching --selector). Turns elastic mode on.
    #[arg(long = "discovery", value_enum, value_name = "SOURCE")]
    pub discovery: Option<DiscoveryKind>,

    /// Kubernetes discovery: label selector of the worker pods, e.g. `app=train,role=worker`.
    #[arg(long = "selector", value_name = "SELECTOR")]
    pub selector: Option<String>,

    /// Kubernetes discovery: namespace of the worker pods (default: this pod's, or the kube
    /// config's).
    #[arg(long = "namespace", value_name = "NS")]
    pub namespace: Option<String>,

    /// Kubernetes discovery: pod annotation giving a pod's slots (default `hvd.dev/slots`;
    /// pods without it have `--slots`, else 1).
    #[arg(long = "slots-annotation", value_name = "KEY")]
    pub slots_annotation: Option<String>,

    /// Kubernetes discovery: headless Service of the workers; hosts are then addressed as
    /// `<pod hostname>.<service>.<namespace>.svc` instead of by pod IP.
    #[arg(long = "service", value_name = "NAME")]
    pub service: Option<String>,

    /// The training program and its arguments.
    #[arg(required_unless_present = "check_build", value_name = "COMMAND")]
    pub command: Vec<String>,
}

impl Args {
    /// Every network interface named, in order: --network-interfaces' list, then each
    /// --network-interface.
    pub fn nics(&self) -> Vec<String> {
        self.network_interfaces
            .iter()
            .flat_map(|l| l.split(','))
            .chain(self.network_interface.iter().map(String::as_str))
            .map(str::trim)
            .filter(|n| !n.is_empty())
            .map(String::from)
            .collect()
    }

    /// The interface the workers use: the first named (hvd's transport, like Horovod's Gloo,
    /// uses one).
    pub fn nic(&self) -> Option<String> {
        self.nics().into_iter().next()
    }

    /// Why a flag given here has no meaning in hvd, naming the flag and what to use instead.
    pub fn refused(&self) -> Option<String> {
        let why = [
            (
                self.mpi,
                "--mpi: hvd does not use MPI; its collectives run over its own Gloo-style TCP \
                 transport, which --gloo (or nothing) selects",
            ),
            (
                self.jsrun,
                "--jsrun: hvd does not launch through jsrun; in an LSF job horovodrun reads the \
                 job's hosts from LSB_MCPU_HOSTS and starts the workers over ssh, or run an \
                 hvd-agent on each host and use --launcher agent",
            ),
            (
                self.mpi_args.is_some(),
                "--mpi-args: hvd does not run mpirun, so there are no MPI arguments to pass; \
                 drop the flag (hvd's own flags cover the launch)",
            ),
            (
                self.binding_args.is_some(),
                "--binding-args: process binding is mpirun's; pin the engine thread with \
                 --thread-affinity, or wrap the command in taskset or numactl",
            ),
            (
                self.torus_allreduce,
                "--torus-allreduce: torus allreduce runs its cross-host step on NCCL, which this \
                 build lacks; --hierarchical-allreduce has the same shape over hvd's transport",
            ),
        ];
        why.iter()
            .find(|(given, _)| *given)
            .map(|(_, msg)| (*msg).to_string())
    }

    /// The pods to watch for `--discovery kubernetes`; `None` for the other host sources.
    ///
    /// # Errors
    /// A missing `--selector`, a second host source, or a Kubernetes flag without
    /// `--discovery kubernetes`, each named.
    pub fn pod_selector(&self) -> Result<Option<PodSelector>, String> {
        let kube_flags = [
            ("--selector", self.selector.is_some()),
            ("--namespace", self.namespace.is_some()),
            ("--slots-annotation", self.slots_annotation.is_some()),
            ("--service", self.service.is_some()),
        ];
        match self.discovery {
            Some(DiscoveryKind::Kubernetes) => {}
            Some(DiscoveryKind::Script) if self.discovery_script.is_none() => {
                return Err("--discovery script needs --host-discovery-script".into());
            }
            _ => {
                return match kube_flags.iter().find(|(_, set)| *set) {
                    Some((flag, _)) => {
                        Err(format!("{flag} works with --discovery kubernetes only"))
                    }
                    None => Ok(None),
                };
            }
        }
        if self.discovery_script.is_some() || self.hosts.is_some() || self.hostfile.is_some() {
            return Err(
                "--discovery kubernetes takes its hosts from the API server; drop \
                 --host-discovery-script, -H and --hostfile"
                    .into(),
            );
        }
        let selector = match self.selector.as_deref().map(str::trim) {
            Some(s) if !s.is_empty() => s.to_string(),
            _ => {
                return Err(
                    "--discovery kubernetes needs --selector, the worker pods' labels \
                     (e.g. 'app=train,role=worker')"
                        .into(),
                );
            }
        };
        if self.slots == Some(0) {
            return Err("--slots must be at least 1".into());
        }
        let mut sel = PodSelector::new(selector, self.slots.unwrap_or(1));
        sel.namespace.clone_from(&self.namespace);
        sel.service.clone_from(&self.service);
        if let Some(a) = &self.slots_annotation {
            sel.slots_annotation.clone_from(a);
        }
        Ok(Some(sel))
    }
}

/// How many words follow `flag` as its values (0 for a switch or an unknown flag), from the
/// parser's own definitions, so a new flag can't be forgotten here.
fn values_of(flag: &str) -> usize {
    use clap::CommandFactory;
    let cmd = Args::command();
    let found = cmd.get_arguments().find(|a| {
        let mut longs = a.get_all_aliases().unwrap_or_default();
        longs.extend(a.get_long());
        let mut shorts = a.get_all_short_aliases().unwrap_or_default();
        shorts.extend(a.get_short());
        flag.strip_prefix("--").is_some_and(|l| longs.contains(&l))
            || (flag.len() == 2
                && flag.starts_with('-')
                && flag.chars().nth(1).is_some_and(|c| shorts.contains(&c)))
    });
    match found {
        Some(a) if a.get_action().takes_values() => {
            a.get_num_args().map_or(1, |r| r.min_values().max(1))
        }
        _ => 0,
    }
}

/// Horovod's single-dash long flags (`-np`, `-hostfile`, `-cb`, `-prefix-timestamp`) in the
/// form the parser knows, with an attached `=value` kept.
fn single_dash_long(a: &str) -> Option<String> {
    let (flag, value) = match a.split_once('=') {
        Some((f, v)) => (f, Some(v)),
        None => (a, None),
    };
    let long = match flag {
        "-np" => "--num-proc",
        "-hostfile" => "--hostfile",
        "-cb" if value.is_none() => "--check-build",
        "-prefix-timestamp" if value.is_none() => "--prefix-output-with-timestamp",
        _ => return None,
    };
    Some(match value {
        Some(v) => format!("{long}={v}"),
        None => long.to_string(),
    })
}

/// Rewrites Horovod's single-dash long flags (`-np`, `-hostfile`, `-cb`, `-prefix-timestamp`)
/// into the form the parser knows. The rewrite
/// stops where the training command starts, so `./train -np 3` reaches the program untouched.
pub fn normalize<I: IntoIterator<Item = String>>(argv: I) -> Vec<String> {
    let mut out = Vec::new();
    let mut it = argv.into_iter();
    out.extend(it.next());
    while let Some(a) = it.next() {
        if let Some(long) = single_dash_long(&a) {
            out.push(long);
            if a == "-np" || a == "-hostfile" {
                out.extend(it.next());
            }
        } else if a == "--" || !a.starts_with('-') {
            out.push(a);
            break;
        } else {
            let values = values_of(&a);
            out.push(a);
            for _ in 0..values {
                out.extend(it.next());
            }
        }
    }
    out.extend(it);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every flag that takes a value is known to the rewrite, so `-np` after it is still
    /// Horovod's and the training command starts after the flag's value.
    #[test]
    fn every_value_flag_is_known_to_the_np_rewrite() {
        for f in [
            "--num-proc",
            "-H",
            "--hosts",
            "--hostfile",
            "-p",
            "-i",
            "--min-np",
            "--max-num-proc",
            "--host-discovery-script",
            "--state-store",
            "--state-store-ttl",
            "--driver-grace",
            "--rendezvous-port",
            "--agent-port",
            "--network-interface",
        ] {
            assert_eq!(values_of(f), 1, "{f}");
        }
        assert_eq!(values_of("--blacklist-cooldown-range"), 2);
        for f in ["--standby", "-v", "--verbose", "--no-such-flag"] {
            assert_eq!(values_of(f), 0, "{f}");
        }
        let argv = [
            "horovodrun",
            "--state-store-ttl",
            "30",
            "-np",
            "2",
            "train",
            "-np",
            "9",
        ];
        assert_eq!(
            normalize(argv.map(String::from)),
            [
                "horovodrun",
                "--state-store-ttl",
                "30",
                "--num-proc",
                "2",
                "train",
                "-np",
                "9"
            ]
        );
    }

    fn parse(args: &[&str]) -> Result<Args, clap::Error> {
        let argv = std::iter::once("horovodrun")
            .chain(args.iter().copied())
            .map(String::from);
        Args::try_parse_from(normalize(argv))
    }

    #[test]
    fn horovod_flags() {
        let a = parse(&[
            "-np",
            "4",
            "-H",
            "a:2,b:2",
            "-p",
            "2222",
            "--start-timeout",
            "5",
            "./train",
            "--lr",
            "0.1",
        ])
        .unwrap();
        assert_eq!(a.np, Some(4));
        assert_eq!(a.hosts.as_deref(), Some("a:2,b:2"));
        assert_eq!(a.ssh_port, Some(2222));
        assert_eq!(a.command, vec!["./train", "--lr", "0.1"]);
        assert_eq!(parse(&["-np=2", "x"]).unwrap().np, Some(2));
        let a = parse(&["-H", "a", "-np", "1", "./train", "-np", "3"]).unwrap();
        assert_eq!(a.command, vec!["./train", "-np", "3"]);
    }

    #[test]
    fn elastic_flags() {
        let a = parse(&[
            "-np",
            "2",
            "--min-np",
            "1",
            "--max-np",
            "4",
            "--host-discovery-script",
            "./d.sh",
            "--slots-per-host",
            "2",
            "--blacklist-cooldown-range",
            "1",
            "10",
            "--reset-limit",
            "3",
            "./train",
            "--steps",
            "5",
        ])
        .unwrap();
        assert_eq!(
            (a.min_np, a.max_np, a.slots, a.reset_limit),
            (Some(1), Some(4), Some(2), Some(3))
        );
        assert_eq!(a.cooldown_range, Some(vec![1.0, 10.0]));
        assert_eq!(a.heartbeat_timeout, None);
        let h = parse(&["--heartbeat-timeout", "2.5", "-np", "2", "x"]).unwrap();
        assert_eq!(h.heartbeat_timeout, Some(2.5));
        let e = parse(&["--heartbeat-timeout", "soon", "x"])
            .unwrap_err()
            .to_string();
        assert!(e.contains("--heartbeat-timeout"), "{e}");
        assert_eq!(a.discovery_script.as_deref(), Some("./d.sh"));
        assert_eq!(a.command, vec!["./train", "--steps", "5"]);
        assert!(parse(&["-H", "a", "--host-discovery-script", "d", "x"]).is_err());
    }

    #[test]
    fn launcher_and_status_flags() {
        let a = parse(&["-np", "2", "x"]).unwrap();
        assert_eq!(
            (a.launcher, a.agent_port, a.status_port),
            (LauncherKind::Auto, 7077, None)
        );
        let a = parse(&[
            "--launcher",
            "agent",
            "--agent-port",
            "9000",
            "--status-port",
            "8080",
            "-np",
            "2",
            "./train",
            "--launcher",
            "x",
        ])
        .unwrap();
        assert_eq!(
            (a.launcher, a.agent_port, a.status_port),
            (LauncherKind::Agent, 9000, Some(8080))
        );
        assert_eq!(a.command, ["./train", "--launcher", "x"]);
        let e = parse(&["--launcher", "ssh", "x"]).unwrap_err().to_string();
        assert!(
            e.contains("ssh") && e.contains("auto") && e.contains("agent"),
            "{e}"
        );
        assert!(parse(&["--agent-port", "70000", "x"]).is_err());
    }

    #[test]
    fn kubernetes_discovery_flags() {
        let a = parse(&[
            "--discovery",
            "kubernetes",
            "--selector",
            "app=train,role=worker",
            "--namespace",
            "ml",
            "--slots",
            "4",
            "--slots-annotation",
            "example.com/gpus",
            "--service",
            "workers",
            "-np",
            "2",
            "./train",
        ])
        .unwrap();
        assert_eq!(a.discovery, Some(DiscoveryKind::Kubernetes));
        let sel = a.pod_selector().unwrap().unwrap();
        assert_eq!(sel.label_selector, "app=train,role=worker");
        assert_eq!(sel.namespace.as_deref(), Some("ml"));
        assert_eq!(sel.default_slots, 4);
        assert_eq!(sel.slots_annotation, "example.com/gpus");
        assert_eq!(sel.service.as_deref(), Some("workers"));
        assert_eq!(a.command, ["./train"]);

        let a = parse(&["--discovery", "kubernetes", "--selector", "app=t", "x"]).unwrap();
        let sel = a.pod_selector().unwrap().unwrap();
        assert_eq!(
            (
                sel.namespace,
                sel.default_slots,
                sel.slots_annotation.as_str(),
                sel.service
            ),
            (
                None,
                1,
                hvd_discovery::kubernetes::DEFAULT_SLOTS_ANNOTATION,
                None
            )
        );
        // Script discovery has no selector.
        let a = parse(&["--host-discovery-script", "./d.sh", "x"]).unwrap();
        assert_eq!(a.pod_selector().unwrap(), None);
    }

    #[test]
    fn kubernetes_discovery_misuse_is_named() {
        let err = |args: &[&str]| parse(args).unwrap().pod_selector().unwrap_err();
        assert!(err(&["--discovery", "kubernetes", "x"]).contains("needs --selector"));
        assert!(
            err(&["--discovery", "kubernetes", "--selector", " ", "x"])
                .contains("needs --selector")
        );
        assert!(
            err(&[
                "--discovery",
                "kubernetes",
                "--selector",
                "a=b",
                "-H",
                "h:1",
                "x"
            ])
            .contains("-H")
        );
        assert!(
            err(&["--selector", "a=b", "-H", "h", "x"])
                .contains("--selector works with --discovery kubernetes")
        );
        assert!(err(&["--service", "s", "x"]).contains("--service works with"));
        assert!(err(&["--discovery", "script", "x"]).contains("needs --host-discovery-script"));
        assert!(parse(&["--discovery", "consul", "x"]).is_err());
    }

    #[test]
    fn horovods_other_flags() {
        let a = parse(&[
            "-np",
            "2",
            "-hostfile",
            "hf",
            "-prefix-timestamp",
            "--gloo",
            "--network-interfaces",
            "eth1, eth0",
            "--network-interface",
            "ib0",
            "--autotune",
            "--autotune-warmup-samples",
            "5",
            "--stall-check-warning-time-seconds",
            "30",
            "--no-stall-check",
            "--log-level",
            "warning",
            "--log-hide-timestamp",
            "--disable-cache",
            "./train",
        ])
        .unwrap();
        assert_eq!(a.hostfile.as_deref(), Some(std::path::Path::new("hf")));
        assert!(a.prefix_output_with_timestamp && a.gloo && a.autotune && a.no_stall_check);
        assert!(a.disable_cache && a.log_without_timestamp);
        assert_eq!(a.nics(), ["eth1", "eth0", "ib0"]);
        assert_eq!(a.nic().as_deref(), Some("eth1"));
        assert_eq!(a.autotune_warmup_samples, Some(5));
        assert_eq!(a.stall_check_warning_time_seconds, Some(30));
        assert_eq!(a.log_level, Some(LogLevel::Warning));
        assert_eq!(a.refused(), None);
        // -cb needs no command; -v is Horovod's --version.
        assert!(parse(&["-cb"]).unwrap().check_build);
        let v = parse(&["-v"]).unwrap_err();
        assert_eq!(v.kind(), clap::error::ErrorKind::DisplayVersion);
        assert!(parse(&["--log-level", "LOUD", "x"]).is_err());
        assert!(parse(&["--autotune", "--no-autotune", "x"]).is_err());
    }

    #[test]
    fn flags_without_meaning_here_are_refused_by_name() {
        for (args, flag) in [
            (&["--mpi", "x"][..], "--mpi:"),
            (&["--jsrun", "x"], "--jsrun:"),
            (&["--mpi-args=--map-by ppr:6:node", "x"], "--mpi-args:"),
            (&["--mpi-args", "-gpu", "x"], "--mpi-args:"),
            (&["--binding-args", "--rankfile f", "x"], "--binding-args:"),
            (&["--torus-allreduce", "x"], "--torus-allreduce:"),
        ] {
            let why = parse(args).unwrap().refused().unwrap_or_default();
            assert!(why.starts_with(flag), "{args:?}: {why}");
        }
        for ok in [
            &["--mpi-threads-disable", "x"][..],
            &["--no-torus-allreduce", "x"],
            &["--tcp", "x"],
        ] {
            assert_eq!(parse(ok).unwrap().refused(), None, "{ok:?}");
        }
        assert_eq!(values_of("--mpi-args"), 1);
    }

    #[test]
    fn unknown_flags_and_missing_command_are_errors() {
        let e = parse(&["-np", "2", "--bogus", "x"])
            .unwrap_err()
            .to_string();
        assert!(e.contains("--bogus"), "{e}");
        assert!(parse(&["-np", "2"]).is_err());
        assert!(parse(&["-H", "a", "--hostfile", "f", "x"]).is_err());
    }
}
