//! `horovodrun`: launches a training program on several hosts and supervises it.

mod agent;
mod cli;
mod elastic;
mod horovod;
mod hosts;
mod job;
mod launch;
mod liveness;
mod log_tail;
mod lsf;
mod metrics;
mod rendezvous;
mod status;

use std::os::unix::process::ExitStatusExt;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context, bail};
use clap::Parser;
use hvd_discovery::{HostSpec, parse_host_list, parse_hostfile};
use hvd_rendezvous::{ENV_RENDEZVOUS_HOST, HostSlots, assign_static};

use crate::job::{JobSpec, Outcome};
use crate::launch::LaunchMode;

/// Exit code for a usage or configuration error (sysexits EX_USAGE).
const EX_USAGE: u8 = 64;

/// Seconds a worker may be silent before it is declared frozen, when `--heartbeat-timeout`
/// is not given.
const ENV_HEARTBEAT_TIMEOUT: &str = "HVD_HEARTBEAT_TIMEOUT";
/// `--straggler-policy`'s variable.
const ENV_STRAGGLER_POLICY: &str = "HVD_STRAGGLER_POLICY";

fn main() -> ExitCode {
    let mut args = match cli::Args::try_parse_from(cli::normalize(std::env::args())) {
        Ok(a) => a,
        Err(e) => {
            let usage = e.use_stderr();
            let _ = e.print();
            return if usage {
                ExitCode::from(EX_USAGE)
            } else {
                ExitCode::SUCCESS
            };
        }
    };
    if let Err(e) = horovod::apply_config_file(&mut args) {
        eprintln!("horovodrun: error: {e:#}");
        return ExitCode::from(EX_USAGE);
    }
    if let Some(why) = args.refused() {
        eprintln!("horovodrun: error: {why}");
        return ExitCode::from(EX_USAGE);
    }
    init_tracing(&args);
    if args.check_build {
        let torch = horovod::torch_available();
        if let (Err(why), true) = (&torch, args.verbose) {
            eprintln!("PyTorch: {why}");
        }
        print!("{}", horovod::check_build_report(torch.is_ok()));
        return ExitCode::SUCCESS;
    }
    match horovod::check_environment(std::env::vars()) {
        Ok(warnings) => warnings.iter().for_each(|w| tracing::warn!("{w}")),
        Err(e) => {
            eprintln!("horovodrun: error: {e:#}");
            return ExitCode::from(EX_USAGE);
        }
    }
    if args.disable_cache {
        tracing::debug!(
            "--disable-cache: horovodrun caches no launch checks; each run checks afresh"
        );
    }
    if args.nics().len() > 1 {
        tracing::info!(
            "the workers use {} (hvd's transport, like Horovod's Gloo, uses the first interface named)",
            args.nic().unwrap_or_default()
        );
    }
    launch::set_timestamped_output(args.prefix_output_with_timestamp);
    if args.discovery_script.is_some()
        || args.discovery.is_some()
        || args.min_np.is_some_and(|n| n > 0)
    {
        return drive(plan_elastic(&args), elastic::run::run, report_elastic);
    }
    if args.state_store.is_some() || args.standby || args.preemption_watch.is_some() {
        let e = anyhow::anyhow!(
            "--state-store, --standby and --preemption-watch apply to elastic jobs (--min-np \
             or --host-discovery-script): a static job ends with any failure, and can't let a \
             host go"
        );
        return drive(
            Err::<((), ()), _>(e),
            |_| async { Ok(()) },
            |()| ExitCode::SUCCESS,
        );
    }
    drive(
        plan(&args).map(|s| (s.slots.len(), s)),
        |(np, spec)| async move { job::run(spec).await.map(|o| (o, np)) },
        |(outcome, np)| report(outcome, np),
    )
}

/// Plans, runs and reports one job: a plan that fails is a usage error, reported before
/// anything starts.
fn drive<S, O, F: std::future::Future<Output = anyhow::Result<O>>>(
    spec: anyhow::Result<S>,
    run: impl FnOnce(S) -> F,
    report: impl FnOnce(O) -> ExitCode,
) -> ExitCode {
    let spec = match spec {
        Ok(s) => s,
        Err(e) => {
            eprintln!("horovodrun: error: {e:#}");
            return ExitCode::from(EX_USAGE);
        }
    };
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("horovodrun: error: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(spec)) {
        Ok(o) => report(o),
        Err(e) => {
            eprintln!("horovodrun: error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn report_elastic(end: elastic::run::Ending) -> ExitCode {
    if end.code == 0 {
        tracing::info!("job succeeded: {}", end.message);
        ExitCode::SUCCESS
    } else {
        eprintln!("horovodrun: error: {}", end.message);
        ExitCode::from(end.code)
    }
}

/// A duration in seconds from a flag, else an environment variable, else a default.
fn seconds(flag: Option<f64>, name: &str, env: &str, default: f64) -> anyhow::Result<Duration> {
    seconds_from(flag, name, env, std::env::var(env).ok(), default)
}

/// [`seconds`] with the environment variable's value passed in; an error names where the bad
/// value came from.
fn seconds_from(
    flag: Option<f64>,
    name: &str,
    env: &str,
    env_value: Option<String>,
    default: f64,
) -> anyhow::Result<Duration> {
    let (v, from) = match (flag, env_value) {
        (Some(s), _) => (s, name.to_string()),
        (None, Some(v)) => (
            v.trim()
                .parse()
                .with_context(|| format!("{env}='{v}' ({name}) is not a number"))?,
            format!("{env} ({name})"),
        ),
        (None, None) => (default, name.to_string()),
    };
    if !(v.is_finite() && v > 0.0) {
        bail!("{from} must be a positive number of seconds, not {v}");
    }
    Ok(Duration::from_secs_f64(v))
}

/// `--heartbeat-timeout`, else `HVD_HEARTBEAT_TIMEOUT`, else [`HEARTBEAT_TIMEOUT_DEFAULT`].
fn heartbeat_timeout(args: &cli::Args) -> anyhow::Result<Duration> {
    seconds(
        args.heartbeat_timeout,
        "--heartbeat-timeout",
        ENV_HEARTBEAT_TIMEOUT,
        HEARTBEAT_TIMEOUT_DEFAULT,
    )
}

/// `--straggler-factor`, and `--straggler-policy` (else `HVD_STRAGGLER_POLICY`).
fn straggler_policy(args: &cli::Args) -> anyhow::Result<liveness::StragglerPolicy> {
    let mut p = liveness::StragglerPolicy::default();
    if let Some(f) = args.straggler_factor {
        if !(f.is_finite() && f > 1.0) {
            bail!(
                "--straggler-factor must be a number above 1 (a step that many times the median rank's), not {f}"
            );
        }
        p.factor = f;
    }
    let policy = match &args.straggler_policy {
        Some(p) => p.clone(),
        None => std::env::var(ENV_STRAGGLER_POLICY).unwrap_or_default(),
    };
    p.evict = match policy.trim() {
        "" | "warn" => false,
        "evict" => true,
        other => bail!("{ENV_STRAGGLER_POLICY} must be warn or evict, not '{other}'"),
    };
    Ok(p)
}

/// The heartbeat timeout's default, in seconds: three times the 1 s at which the whole driver
/// suite, the chaos run and a machine with every core busy declared no live worker frozen
/// (docs/elastic.md, "Frozen workers").
const HEARTBEAT_TIMEOUT_DEFAULT: f64 = 3.0;

/// Turns the flags of an elastic job into its spec; everything is checked before anything starts.
fn plan_elastic(args: &cli::Args) -> anyhow::Result<elastic::run::ElasticSpec> {
    use hvd_discovery::CooldownRange;
    let lsf = lsf_allocation(
        args,
        args.discovery.is_none() && args.discovery_script.is_none(),
    )?;
    let np = args
        .np
        .or(lsf.as_deref().map(lsf::total_slots))
        .or(args.min_np)
        .context("elastic mode needs -np (the slots needed before training starts)")?;
    let min_np = args.min_np.filter(|&n| n > 0).unwrap_or(np);
    let max_np = args.max_np.unwrap_or(np);
    if np == 0 || min_np > np || np > max_np {
        bail!("elastic mode needs 1 <= --min-np ({min_np}) <= -np ({np}) <= --max-np ({max_np})");
    }
    let source = match args.pod_selector().map_err(anyhow::Error::msg)? {
        Some(sel) => {
            tracing::info!(selector = %sel.label_selector, namespace = ?sel.namespace, "hosts from Kubernetes pods");
            elastic::run::Source::Kubernetes(sel)
        }
        None => discovery_source(args, lsf)?,
    };
    let cooldown = match args.cooldown_range.as_deref() {
        None => None,
        Some([lo, hi]) => {
            let lo = positive(*lo, "--blacklist-cooldown-range LO")?;
            let hi = positive(*hi, "--blacklist-cooldown-range HI")?;
            Some(CooldownRange::new(lo, hi).context("--blacklist-cooldown-range")?)
        }
        Some(other) => bail!("--blacklist-cooldown-range takes two numbers, not {other:?}"),
    };
    let elastic_timeout = seconds(
        args.elastic_timeout.filter(|&t| t != 0.0),
        "--elastic-timeout",
        hvd_rendezvous::ENV_ELASTIC_TIMEOUT,
        600.0,
    )?;
    let start_timeout = seconds(
        args.start_timeout,
        "--start-timeout",
        hvd_rendezvous::ENV_START_TIMEOUT,
        30.0,
    )?;
    let own = nix::unistd::gethostname()
        .map(|h| h.to_string_lossy().into_owned())
        .unwrap_or_default();
    let named = std::env::var(ENV_RENDEZVOUS_HOST)
        .ok()
        .map(|h| h.trim().to_string())
        .filter(|h| !h.is_empty());
    let rendezvous_host = match (&named, &args.nic()) {
        // A name that outlives this driver (a Kubernetes Service): its successor's workers
        // dial the same one.
        (Some(h), _) => h.clone(),
        (None, Some(i)) => interface_ip(i)?,
        // A pod's host name resolves only inside the pod: its peers reach it by IP.
        (None, None) if matches!(source, elastic::run::Source::Kubernetes(_)) => own_ip(&own),
        (None, None) => own,
    };
    let seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    tracing::info!(np, min_np, max_np, "elastic job");
    Ok(elastic::run::ElasticSpec {
        core: elastic::core::Config {
            np,
            min_np,
            max_np,
            elastic_timeout,
            round_timeout: start_timeout,
            reset_limit: args.reset_limit,
            cooldown,
            seed,
        },
        source,
        interval: positive(args.discovery_interval, "--discovery-interval")?,
        command: args.command.clone(),
        ssh_port: args.ssh_port,
        ssh_identity: args.ssh_identity_file.clone(),
        output_dir: args.output_filename.clone(),
        network_interface: args.nic(),
        rendezvous_host,
        start_timeout,
        extra_env: shared_worker_env(args)?,
        launch: launch_mode(args, std::env::var(hvd_agent::ENV_AGENT_SECRET).ok())?,
        status_port: args.status_port,
        heartbeat_timeout: heartbeat_timeout(args)?,
        stragglers: straggler_policy(args)?,
        rendezvous_port: args.rendezvous_port,
        store: store_spec(args, |k| std::env::var(k))?,
    })
}

/// `--state-store` and its companions; `var` reads the environment (`HVD_STATE_STORE`, the
/// job's secret in `HVD_SECRET`).
fn store_spec(
    args: &cli::Args,
    var: impl Fn(&str) -> Result<String, std::env::VarError>,
) -> anyhow::Result<Option<elastic::control::StoreSpec>> {
    let Some(url) = args
        .state_store
        .clone()
        .or_else(|| var("HVD_STATE_STORE").ok().filter(|v| !v.trim().is_empty()))
    else {
        for (set, flag) in [
            (args.standby, "--standby"),
            (args.state_store_ttl.is_some(), "--state-store-ttl"),
            (args.driver_grace.is_some(), "--driver-grace"),
        ] {
            if set {
                bail!("{flag} needs --state-store (or HVD_STATE_STORE)");
            }
        }
        return Ok(None);
    };
    let url: hvd_store::StoreUrl = url.trim().parse()?;
    let secret = var(hvd_rendezvous::ENV_SECRET)
        .ok()
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
        .with_context(|| {
            format!(
                "--state-store needs the job's secret in {}, the same for every driver of the \
                 job: a driver that takes over presents it to the workers",
                hvd_rendezvous::ENV_SECRET
            )
        })?;
    if args.rendezvous_port.is_none_or(|p| p == 0) {
        bail!(
            "--state-store needs a fixed --rendezvous-port: the workers of a driver that goes \
             away look for its successor there"
        );
    }
    let ttl = positive(args.state_store_ttl.unwrap_or(10.0), "--state-store-ttl")?;
    if ttl < std::time::Duration::from_secs(1) {
        bail!("--state-store-ttl must be at least 1 second (etcd leases count whole seconds)");
    }
    let credentials = hvd_store::Credentials::from_env()?;
    Ok(Some(elastic::control::StoreSpec {
        url,
        credentials,
        standby: args.standby,
        ttl,
        grace: positive(args.driver_grace.unwrap_or(60.0), "--driver-grace")?,
        secret,
        args: std::env::args().collect(),
    }))
}

/// How workers are started, from `--launcher`, `--agent-port` and the agent secret (from
/// `HVD_AGENT_SECRET`, passed in).
fn launch_mode(args: &cli::Args, secret: Option<String>) -> anyhow::Result<LaunchMode> {
    match args.launcher {
        cli::LauncherKind::Auto => Ok(LaunchMode::Auto),
        cli::LauncherKind::Agent => {
            let secret = secret.map(|s| s.trim().to_string()).unwrap_or_default();
            if secret.is_empty() {
                bail!(
                    "--launcher agent needs the agents' shared secret in {}",
                    hvd_agent::ENV_AGENT_SECRET
                );
            }
            if args.agent_port == 0 {
                bail!("--agent-port must be a port number from 1 to 65535, not 0");
            }
            Ok(LaunchMode::Agent {
                port: args.agent_port,
                secret,
            })
        }
    }
}

/// The script or fixed host source of an elastic job; `lsf`, the LSF job's hosts, where no
/// flag names any.
fn discovery_source(
    args: &cli::Args,
    lsf: Option<Vec<HostSpec>>,
) -> anyhow::Result<elastic::run::Source> {
    use hvd_discovery::ScriptDiscovery;
    Ok(
        match (&args.discovery_script, &args.hosts, &args.hostfile) {
            (Some(script), _, _) => {
                let timeout = positive(args.discovery_timeout, "--discovery-timeout")?;
                elastic::run::Source::Script(ScriptDiscovery::new(
                    horovod::discovery_command(script, std::env::var_os("PATH").as_deref()),
                    timeout,
                    args.slots,
                ))
            }
            (None, Some(list), _) => elastic::run::Source::Fixed(parse_host_list(list)?),
            (None, None, Some(path)) => {
                let text = std::fs::read_to_string(path)
                    .with_context(|| format!("reading hostfile {}", path.display()))?;
                elastic::run::Source::Fixed(parse_hostfile(&path.display().to_string(), &text)?)
            }
            (None, None, None) => match lsf {
                Some(hosts) => elastic::run::Source::Fixed(hosts),
                None => bail!(
                    "elastic mode needs --host-discovery-script, --discovery kubernetes, -H or --hostfile"
                ),
            },
        },
    )
}

/// The variables every worker of the job gets, static or elastic, whatever starts it (a local
/// process, ssh, an agent, so a Kubernetes pod too): unbuffered Python output, huge pages for
/// large allocations, the engine settings (`--cycle-time-ms`, `--fusion-threshold-mb`,
/// `--cache-capacity`, `--[no-]hierarchical-allreduce`, `--tcp-streams`), a fresh timeline file
/// for `--timeline-filename`, and Horovod's variables of horovodrun's own environment.
fn shared_worker_env(args: &cli::Args) -> anyhow::Result<Vec<(String, String)>> {
    let mut env = huge_pages_env(|k| std::env::var(k).ok());
    env.extend(unbuffered_env(std::env::var_os(PYTHON_UNBUFFERED)));
    env.extend(horovod::knob_env(args)?);
    for (flag, value, var, scale) in [
        (
            "--cycle-time-ms",
            args.cycle_time_ms,
            hvd_rendezvous::ENV_CYCLE_TIME,
            1.0,
        ),
        (
            "--fusion-threshold-mb",
            args.fusion_threshold_mb,
            hvd_rendezvous::ENV_FUSION_THRESHOLD,
            1024.0 * 1024.0,
        ),
    ] {
        if let Some(v) = value {
            if !(v.is_finite() && v >= 0.0) {
                bail!("{flag} must be a non-negative number, not {v}");
            }
            env.push((var.to_string(), format!("{}", v * scale)));
        }
    }
    if let Some(k) = args.tcp_streams {
        if !(1..=hvd_rendezvous::MAX_TCP_STREAMS).contains(&k) {
            bail!(
                "--tcp-streams must be 1 to {}, not {k}",
                hvd_rendezvous::MAX_TCP_STREAMS
            );
        }
        env.push((hvd_rendezvous::ENV_TCP_STREAMS.to_string(), k.to_string()));
    }
    if let Some(cloud) = args.preemption_watch {
        env.push((
            hvd_rendezvous::ENV_PREEMPTION_WATCH.to_string(),
            cloud.to_string(),
        ));
    }
    if let Some(n) = args.cache_capacity {
        env.push((
            hvd_rendezvous::ENV_CACHE_CAPACITY.to_string(),
            n.to_string(),
        ));
    }
    if args.hierarchical_allreduce || args.no_hierarchical_allreduce {
        let on = if args.hierarchical_allreduce {
            "1"
        } else {
            "0"
        };
        env.push((
            hvd_rendezvous::ENV_HIERARCHICAL_ALLREDUCE.to_string(),
            on.into(),
        ));
    }
    let Some(path) = &args.timeline else {
        let own = horovod::forwarded_env(std::env::vars(), &env);
        env.extend(own);
        return Ok(env);
    };
    std::fs::write(path, "[\n")
        .with_context(|| format!("--timeline-filename {}", path.display()))?;
    let abs = std::path::absolute(path)
        .with_context(|| format!("--timeline-filename {}", path.display()))?;
    env.push((
        hvd_rendezvous::ENV_TIMELINE.to_string(),
        abs.display().to_string(),
    ));
    if args.timeline_mark_cycles {
        env.push((
            hvd_rendezvous::ENV_TIMELINE_MARK_CYCLES.to_string(),
            "1".into(),
        ));
    }
    let own = horovod::forwarded_env(std::env::vars(), &env);
    env.extend(own);
    Ok(env)
}

/// Asks glibc's malloc in the workers for transparent huge pages on large allocations: tensors
/// then sit on 2 MiB pages, which same-host transfers (`process_vm_readv` pins every page it
/// copies) read about 2.7× faster here, with fewer TLB misses for the training itself. malloc's
/// mmap threshold stays dynamic: fixed at 2 MiB, every large activation of a PyTorch step was
/// mapped and faulted in afresh, which cost ResNet-50 10–25% of its speed here; the engine's
/// fusion buffer has a mapping of its own instead, so it still goes back to the system at every
/// elastic reset. A `GLIBC_TUNABLES` of the user's is left alone, and `HVD_HUGE_PAGES=0` turns
/// it off.
///
/// glibc 2.35 and 2.36 (Debian 12, Ubuntu 22.04) read the kernel's huge-page mode into an
/// unterminated buffer and ignore the tunable in some processes, at random; PyTorch's own
/// allocator is therefore asked too ([`THP_ALLOC`]), and `hvd::HugeBuffer` asks the kernel
/// directly.
const HUGE_PAGES_TUNABLES: &str = "glibc.malloc.hugetlb=1";

/// PyTorch's switch for its CPU allocator: tensors of 2 MiB and more are aligned to huge pages
/// and advised as such, whatever glibc does.
const THP_ALLOC: &str = "THP_MEM_ALLOC_ENABLE";

/// The huge-page variables workers get: each unless the user set it, none with
/// `HVD_HUGE_PAGES=0`. `user` tells whether a variable is already set.
fn huge_pages_env(user: impl Fn(&str) -> Option<String>) -> Vec<(String, String)> {
    if user(hvd_rendezvous::ENV_HUGE_PAGES).is_some_and(|v| v.trim() == "0") {
        return Vec::new();
    }
    [("GLIBC_TUNABLES", HUGE_PAGES_TUNABLES), (THP_ALLOC, "1")]
        .into_iter()
        .filter(|(k, _)| user(k).is_none())
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

/// Python's switch for unbuffered `stdout` and `stderr`.
const PYTHON_UNBUFFERED: &str = "PYTHONUNBUFFERED";

/// `PYTHONUNBUFFERED` for the workers, so that a Python worker's `print()` reaches
/// horovodrun's output when it is printed, not when the worker exits. Horovod's launcher sets
/// it to `1` for every worker, static and elastic (`_slot_info_to_command_fn` in
/// `horovod/runner/gloo_run.py`), over any value of the user's; here a value of the user's
/// (`user`: horovodrun's own, any, even `0` or empty) is passed on as it is, to remote workers
/// too. `None` for a value that is not UTF-8: local workers inherit it, it can't be sent.
fn unbuffered_env(user: Option<std::ffi::OsString>) -> Option<(String, String)> {
    let value = match user {
        None => "1".to_string(),
        Some(v) => v.into_string().ok()?,
    };
    Some((PYTHON_UNBUFFERED.to_string(), value))
}

fn positive(v: f64, name: &str) -> anyhow::Result<Duration> {
    if !(v.is_finite() && v > 0.0) {
        bail!("{name} must be a positive number of seconds, not {v}");
    }
    Ok(Duration::from_secs_f64(v))
}

/// The driver's log: `RUST_LOG` where set, else `--log-level` for everything, else progress
/// (`--verbose`: decisions in detail); `--log-without-timestamp` drops the time.
fn init_tracing(args: &cli::Args) {
    let default = match (args.log_level, args.verbose) {
        (Some(l), _) => l.directive().to_string(),
        (None, true) => "horovodrun=debug,hvd_store=debug,info".into(),
        (None, false) => "horovodrun=info,hvd_store=info,warn".into(),
    };
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    use tracing_subscriber::Layer;
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::util::SubscriberInitExt;
    type Filtered = tracing_subscriber::layer::Layered<
        tracing_subscriber::EnvFilter,
        tracing_subscriber::Registry,
    >;
    // The same lines, without colour, for the status page's log tail.
    let tail = log_tail::LogTail::new(log_tail::LINES_KEPT);
    tail.install();
    let stderr = tracing_subscriber::fmt::layer()
        .with_target(false)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(hvd_rendezvous::log_stderr);
    let kept = tracing_subscriber::fmt::layer()
        .with_target(false)
        .with_ansi(false)
        .with_writer(tail);
    let layers: Vec<Box<dyn Layer<Filtered> + Send + Sync>> = if args.log_without_timestamp {
        vec![stderr.without_time().boxed(), kept.without_time().boxed()]
    } else {
        vec![stderr.boxed(), kept.boxed()]
    };
    tracing_subscriber::registry()
        .with(filter)
        .with(layers)
        .init();
}

/// Turns the flags into a job: hosts, slots, ranks. Everything is checked before anything starts.
fn plan(args: &cli::Args) -> anyhow::Result<JobSpec> {
    args.pod_selector().map_err(anyhow::Error::msg)?; // stray Kubernetes flags are errors
    if args.status_port.is_some() {
        bail!(
            "--status-port serves an elastic job's state; turn elastic mode on with --min-np, \
             --host-discovery-script or --discovery"
        );
    }
    let lsf = lsf_allocation(args, true)?;
    let hosts: Vec<HostSpec> = match (&args.hosts, &args.hostfile, &lsf) {
        (Some(list), _, _) => parse_host_list(list)?,
        (None, Some(path), _) => {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("reading hostfile {}", path.display()))?;
            parse_hostfile(&path.display().to_string(), &text)?
        }
        (None, None, Some(job)) => job.clone(),
        (None, None, None) => vec![HostSpec {
            host: "localhost".into(),
            slots: args.np.unwrap_or(1),
        }],
    };
    let available: usize = hosts.iter().map(|h| h.slots).sum();
    let np = args
        .np
        .or(lsf.as_deref().map(lsf::total_slots))
        .unwrap_or(available);
    let slots = assign_static(
        &hosts
            .iter()
            .map(|h| HostSlots {
                host: h.host.clone(),
                slots: h.slots,
            })
            .collect::<Vec<_>>(),
        np,
    )?;
    let own = nix::unistd::gethostname()
        .map(|h| h.to_string_lossy().into_owned())
        .unwrap_or_default();
    let local: Vec<bool> = slots
        .iter()
        .map(|s| hosts::is_local(&s.host, &own))
        .collect();
    let start_timeout = seconds(
        args.start_timeout,
        "--start-timeout",
        hvd_rendezvous::ENV_START_TIMEOUT,
        30.0,
    )?
    .as_secs_f64();
    if let Some(i) = &args.ssh_identity_file
        && !i.is_file()
    {
        bail!("--ssh-identity-file {}: no such file", i.display());
    }
    let all_local = local.iter().all(|&l| l);
    let (rendezvous_bind, rendezvous_host) = if all_local {
        (Some("127.0.0.1".to_string()), "127.0.0.1".to_string())
    } else {
        let host = match &args.nic() {
            Some(i) => interface_ip(i)?,
            None => own.clone(),
        };
        (None, host)
    };
    tracing::info!(
        np,
        hosts = %slots.iter().fold(Vec::<String>::new(), |mut v, s| {
            if !v.iter().any(|h| h.starts_with(&format!("{}:", s.host))) { v.push(format!("{}:{}", s.host, s.local_size)); }
            v
        }).join(","),
        "launching workers"
    );
    Ok(JobSpec {
        slots,
        local,
        command: args.command.clone(),
        ssh_port: args.ssh_port,
        ssh_identity: args.ssh_identity_file.clone(),
        output_dir: args.output_filename.clone(),
        start_timeout: Duration::from_secs_f64(start_timeout),
        network_interface: args.nic(),
        rendezvous_host,
        rendezvous_bind,
        extra_env: shared_worker_env(args)?,
        launch: launch_mode(args, std::env::var(hvd_agent::ENV_AGENT_SECRET).ok())?,
        heartbeat_timeout: heartbeat_timeout(args)?,
    })
}

/// The hosts of the LSF job horovodrun runs in (see [`lsf`]), where they matter: for the hosts
/// when no `-H` or `--hostfile` names them (and, `no_discovery`, no discovery), and for
/// `-np`'s default, which in an LSF job is every slot of the job, as with Horovod.
fn lsf_allocation(args: &cli::Args, no_discovery: bool) -> anyhow::Result<Option<Vec<HostSpec>>> {
    let names_hosts = args.hosts.is_some() || args.hostfile.is_some() || !no_discovery;
    if args.np.is_some() && names_hosts {
        return Ok(None);
    }
    let hosts = lsf::hosts(|k| std::env::var(k).ok())?;
    if let Some(h) = &hosts {
        let list: Vec<String> = h
            .iter()
            .map(|h| format!("{}:{}", h.host, h.slots))
            .collect();
        tracing::info!(hosts = %list.join(","), "an LSF job; LSF lists these hosts");
    }
    Ok(hosts)
}

/// The first non-loopback IPv4 address `own` (this machine's host name) resolves to here,
/// else `own` itself. In a pod, `/etc/hosts` maps the pod's host name to its IP.
fn own_ip(own: &str) -> String {
    use std::net::ToSocketAddrs;
    let found = (own, 0u16).to_socket_addrs().ok().and_then(|mut addrs| {
        addrs.find(|a| a.is_ipv4() && !a.ip().is_loopback() && !a.ip().is_unspecified())
    });
    match found {
        Some(a) => a.ip().to_string(),
        None => {
            tracing::warn!(host = %own, "this host name resolves to no routable address; workers get the name");
            own.to_string()
        }
    }
}

fn interface_ip(name: &str) -> anyhow::Result<String> {
    let addrs = nix::ifaddrs::getifaddrs().context("listing network interfaces")?;
    for a in addrs.filter(|a| a.interface_name == name) {
        if let Some(v4) = a.address.as_ref().and_then(|s| s.as_sockaddr_in()) {
            return Ok(v4.ip().to_string());
        }
    }
    bail!("--network-interface {name}: no such interface with an IPv4 address")
}

fn report(outcome: Outcome, np: usize) -> ExitCode {
    match outcome {
        Outcome::Success => {
            tracing::info!(workers = np, "job succeeded: every worker exited 0");
            ExitCode::SUCCESS
        }
        Outcome::WorkerFailed { rank, host, status } => {
            let (how, code) = match (status.code(), status.signal()) {
                (Some(c), _) => (
                    format!("exited with code {c}"),
                    u8::try_from(c).unwrap_or(1).max(1),
                ),
                (None, Some(s)) => (
                    format!("was killed by signal {s}"),
                    u8::try_from(128 + s).unwrap_or(1),
                ),
                _ => ("ended abnormally".to_string(), 1),
            };
            eprintln!(
                "horovodrun: error: rank {rank} on host {host} {how}; the other workers were stopped"
            );
            ExitCode::from(code)
        }
        Outcome::WorkerLost { rank, host, error } => {
            eprintln!(
                "horovodrun: error: rank {rank} on host {host} was lost: {error}; the other workers were stopped"
            );
            ExitCode::FAILURE
        }
        Outcome::SpawnFailed { rank, host, error } => {
            eprintln!("horovodrun: error: could not start rank {rank} on host {host}: {error}");
            ExitCode::FAILURE
        }
        Outcome::StartTimeout { missing, waited } => {
            eprintln!(
                "horovodrun: error: ranks {missing:?} did not register within the start timeout of {:.1}s \
                 (--start-timeout / HOROVOD_START_TIMEOUT); do the workers call hvd::init()?",
                waited.as_secs_f64()
            );
            ExitCode::FAILURE
        }
        Outcome::Unresponsive { rank, host, silent } => {
            eprintln!(
                "horovodrun: error: rank {rank} on host {host} stopped answering for {:.1} s \
                 (frozen? --heartbeat-timeout / {ENV_HEARTBEAT_TIMEOUT}); it and the other \
                 workers were stopped",
                silent.as_secs_f64()
            );
            ExitCode::FAILURE
        }
        Outcome::Interrupted(sig) => {
            eprintln!("horovodrun: interrupted by {sig}; all workers were stopped");
            ExitCode::from(128 + sig as u8)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{huge_pages_env, plan, plan_elastic, seconds_from, unbuffered_env};
    use clap::Parser;
    use std::time::Duration;

    #[test]
    fn timeouts_come_from_the_flag_else_the_variable_and_bad_ones_are_named() {
        let hb = |flag: Option<f64>, env: Option<&str>| {
            seconds_from(
                flag,
                "--heartbeat-timeout",
                "HVD_HEARTBEAT_TIMEOUT",
                env.map(String::from),
                10.0,
            )
        };
        assert_eq!(hb(None, None).unwrap(), Duration::from_secs(10));
        assert_eq!(
            hb(None, Some(" 2.5 ")).unwrap(),
            Duration::from_millis(2500)
        );
        assert_eq!(hb(Some(3.0), Some("7")).unwrap(), Duration::from_secs(3));
        let e = hb(Some(0.0), None).unwrap_err().to_string();
        assert!(
            e.starts_with("--heartbeat-timeout must be a positive"),
            "{e}"
        );
        let e = hb(Some(-1.0), None).unwrap_err().to_string();
        assert!(e.contains("--heartbeat-timeout") && e.contains("-1"), "{e}");
        let e = format!("{:#}", hb(None, Some("ten")).unwrap_err());
        assert!(e.contains("HVD_HEARTBEAT_TIMEOUT='ten'"), "{e}");
        let e = hb(None, Some("0")).unwrap_err().to_string();
        assert!(
            e.starts_with("HVD_HEARTBEAT_TIMEOUT (--heartbeat-timeout) must be"),
            "{e}"
        );
        assert!(hb(Some(f64::NAN), None).is_err());
    }

    #[test]
    fn workers_get_unbuffered_python_output_unless_the_user_set_it() {
        let pair = |v: &str| Some(("PYTHONUNBUFFERED".to_string(), v.to_string()));
        assert_eq!(unbuffered_env(None), pair("1"));
        for own in ["0", "", "1", "yes"] {
            assert_eq!(unbuffered_env(Some(own.into())), pair(own), "{own:?}");
        }
        let not_utf8 = std::os::unix::ffi::OsStringExt::from_vec(vec![0xff]);
        assert_eq!(unbuffered_env(Some(not_utf8)), None);
    }

    #[test]
    fn static_and_elastic_workers_both_get_the_shared_variables() {
        let args = |a: &[&str]| {
            let argv = a.iter().map(|s| s.to_string());
            crate::cli::Args::try_parse_from(crate::cli::normalize(argv)).unwrap()
        };
        let unbuffered = unbuffered_env(std::env::var_os("PYTHONUNBUFFERED")).unwrap();
        let fixed = plan(&args(&["horovodrun", "-np", "1", "python3", "t.py"])).unwrap();
        let elastic = plan_elastic(&args(&[
            "horovodrun",
            "--min-np",
            "1",
            "--host-discovery-script",
            "./discover.sh",
            "python3",
            "t.py",
        ]))
        .unwrap();
        assert_eq!(elastic.core.np, 1);
        for env in [fixed.extra_env, elastic.extra_env] {
            assert!(env.contains(&unbuffered), "{env:?}");
        }
    }

    #[test]
    fn workers_get_huge_pages_unless_the_user_says_otherwise() {
        let env = |set: &'static [(&'static str, &'static str)]| {
            move |k: &str| {
                set.iter()
                    .find(|(name, _)| *name == k)
                    .map(|(_, v)| v.to_string())
            }
        };
        let pair = |k: &str, v: &str| (k.to_string(), v.to_string());
        let tunables = pair("GLIBC_TUNABLES", "glibc.malloc.hugetlb=1");
        let torch = pair("THP_MEM_ALLOC_ENABLE", "1");
        let both = vec![tunables.clone(), torch.clone()];
        assert_eq!(huge_pages_env(env(&[])), both);
        assert_eq!(huge_pages_env(env(&[("HVD_HUGE_PAGES", "1")])), both);
        assert!(huge_pages_env(env(&[("HVD_HUGE_PAGES", " 0 ")])).is_empty());
        assert_eq!(
            huge_pages_env(env(&[("GLIBC_TUNABLES", "glibc.malloc.check=0")])),
            vec![torch]
        );
        assert_eq!(
            huge_pages_env(env(&[("THP_MEM_ALLOC_ENABLE", "0")])),
            vec![tunables]
        );
    }
}
