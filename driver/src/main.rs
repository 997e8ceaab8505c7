//! `horovodrun`: launches a training program on several hosts and supervises it.

mod cli;
mod elastic;
mod hosts;
mod job;
mod rendezvous;

use std::os::unix::process::ExitStatusExt;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context, bail};
use clap::Parser;
use hvd_discovery::{HostSpec, parse_host_list, parse_hostfile};
use hvd_rendezvous::{HostSlots, assign_static};

use crate::job::{JobSpec, Outcome};

/// Exit code for a usage or configuration error (sysexits EX_USAGE).
const EX_USAGE: u8 = 64;

fn main() -> ExitCode {
    let args = match cli::Args::try_parse_from(cli::normalize(std::env::args())) {
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
    init_tracing(args.verbose);
    let spec = match plan(&args) {
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
    let np = spec.slots.len();
    match runtime.block_on(job::run(spec)) {
        Ok(outcome) => report(outcome, np),
        Err(e) => {
            eprintln!("horovodrun: error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn init_tracing(verbose: bool) {
    let default = if verbose {
        "horovodrun=debug,info"
    } else {
        "horovodrun=info,warn"
    };
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_target(false)
        .with_writer(std::io::stderr)
        .init();
}

/// Turns the flags into a job: hosts, slots, ranks. Everything is checked before anything starts.
fn plan(args: &cli::Args) -> anyhow::Result<JobSpec> {
    let hosts: Vec<HostSpec> = match (&args.hosts, &args.hostfile) {
        (Some(list), _) => parse_host_list(list)?,
        (None, Some(path)) => {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("reading hostfile {}", path.display()))?;
            parse_hostfile(&path.display().to_string(), &text)?
        }
        (None, None) => vec![HostSpec {
            host: "localhost".into(),
            slots: args.np.unwrap_or(1),
        }],
    };
    let available: usize = hosts.iter().map(|h| h.slots).sum();
    let np = args.np.unwrap_or(available);
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
    let start_timeout = match args.start_timeout {
        Some(s) => s,
        None => match std::env::var(hvd_rendezvous::ENV_START_TIMEOUT) {
            Ok(v) => v.trim().parse().with_context(|| {
                format!(
                    "{}='{v}' is not a number",
                    hvd_rendezvous::ENV_START_TIMEOUT
                )
            })?,
            Err(_) => 30.0,
        },
    };
    if !(start_timeout.is_finite() && start_timeout > 0.0) {
        bail!("--start-timeout must be a positive number of seconds, not {start_timeout}");
    }
    if let Some(i) = &args.ssh_identity_file {
        if !i.is_file() {
            bail!("--ssh-identity-file {}: no such file", i.display());
        }
    }
    let all_local = local.iter().all(|&l| l);
    let (rendezvous_bind, rendezvous_host) = if all_local {
        ("127.0.0.1".to_string(), "127.0.0.1".to_string())
    } else {
        let host = match &args.network_interface {
            Some(i) => interface_ip(i)?,
            None => own.clone(),
        };
        ("0.0.0.0".to_string(), host)
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
        network_interface: args.network_interface.clone(),
        rendezvous_host,
        rendezvous_bind,
    })
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
        Outcome::Interrupted(sig) => {
            eprintln!("horovodrun: interrupted by {sig}; all workers were stopped");
            ExitCode::from(128 + sig as u8)
        }
    }
}
