//! `hvd-agent`: the per-host agent that starts and stops training processes for the hvd
//! driver (`horovodrun --launcher agent`).

use std::net::{Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, bail};
use clap::Parser;
use tokio::net::{TcpListener, TcpSocket};
use tokio::signal::unix::{SignalKind, signal};

/// Starts, watches and stops the training processes the hvd driver asks for.
#[derive(Debug, Parser)]
#[command(name = "hvd-agent", version, about)]
struct Args {
    /// Address and port to listen on. `[::]:PORT` takes IPv6 and IPv4 connections both
    /// (IPv4 only, with a warning, where the host has no IPv6).
    #[arg(long, value_name = "ADDR:PORT", default_value = "[::]:7077")]
    listen: String,

    /// File holding the shared secret (default: the HVD_AGENT_SECRET environment variable).
    #[arg(long, value_name = "PATH")]
    secret_file: Option<PathBuf>,

    /// Become a child subreaper and reap the orphaned processes that end up with the agent.
    /// Always on when the agent is PID 1 (a container's first process).
    #[arg(long)]
    reap_orphans: bool,

    /// Watch this cloud's instance metadata (aws, gce or azure) for a preemption notice: the
    /// workers this agent starts read it, and at one their host leaves the job gracefully,
    /// before the machine goes. A driver's `--preemption-watch` takes precedence.
    #[arg(long, value_name = "CLOUD", value_parser = clap::value_parser!(hvd_rendezvous::Cloud))]
    preemption_watch: Option<hvd_rendezvous::Cloud>,
}

/// Exit code for a usage or configuration error (sysexits EX_USAGE).
const EX_USAGE: u8 = 64;

#[tokio::main(worker_threads = 2)]
async fn main() -> ExitCode {
    // Processes of the same user can't read the agent's memory or /proc/PID/environ (where the
    // secret may be) while it is not dumpable. Programs it starts get their own setting back
    // when they exec.
    let undumpable = nix::sys::prctl::set_dumpable(false);
    let args = match Args::try_parse() {
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
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_target(false)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(hvd_rendezvous::log_stderr)
        .init();
    if let Err(e) = undumpable {
        tracing::warn!(error = %e, "cannot make the agent non-dumpable; processes of the same \
                       user may read its secret from /proc");
    }
    let secret = match read_secret(&args) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("hvd-agent: error: {e:#}");
            return ExitCode::from(EX_USAGE);
        }
    };
    match run(&args, secret).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("hvd-agent: error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// The secret from `--secret-file` or `HVD_AGENT_SECRET`, without surrounding whitespace.
fn read_secret(args: &Args) -> anyhow::Result<String> {
    let (secret, from) = match &args.secret_file {
        Some(p) => (
            std::fs::read_to_string(p)
                .with_context(|| format!("reading --secret-file {}", p.display()))?,
            format!("--secret-file {}", p.display()),
        ),
        None => match std::env::var(hvd_agent::ENV_AGENT_SECRET) {
            Ok(s) => (s, hvd_agent::ENV_AGENT_SECRET.to_string()),
            Err(_) => bail!(
                "no secret: set {} or pass --secret-file PATH; the agent refuses to run \
                 unauthenticated",
                hvd_agent::ENV_AGENT_SECRET
            ),
        },
    };
    let secret = secret.trim().to_string();
    if secret.is_empty() {
        bail!("the secret from {from} is empty");
    }
    Ok(secret)
}

async fn run(args: &Args, secret: String) -> anyhow::Result<()> {
    let listener = listen(&args.listen)
        .await
        .with_context(|| format!("cannot listen on {}", args.listen))?;
    if std::process::id() == 1 || args.reap_orphans {
        if std::process::id() != 1 {
            nix::sys::prctl::set_child_subreaper(true).context("becoming a child subreaper")?;
        }
        tokio::spawn(async {
            if let Err(e) = hvd_agent::reap_orphans().await {
                tracing::error!(error = %e, "cannot reap orphaned processes");
            }
        });
    }
    if let Some(cloud) = args.preemption_watch {
        hvd_agent::set_host_env(vec![(
            hvd_rendezvous::ENV_PREEMPTION_WATCH.to_string(),
            cloud.to_string(),
        )]);
        tracing::info!(%cloud, "the workers started here watch for preemption notices");
    }
    let mut sigint = signal(SignalKind::interrupt())?;
    let mut sigterm = signal(SignalKind::terminate())?;
    tracing::info!(addr = %listener.local_addr()?, "hvd-agent listening");
    let shutdown = async move {
        tokio::select! {
            _ = sigint.recv() => tracing::info!("SIGINT"),
            _ = sigterm.recv() => tracing::info!("SIGTERM"),
        }
    };
    hvd_agent::serve(listener, secret, shutdown).await;
    Ok(())
}

/// A listener on `addr`; for the IPv6 wildcard, one that takes IPv4 connections too, or an
/// IPv4-only one where the host has no IPv6.
async fn listen(addr: &str) -> std::io::Result<TcpListener> {
    match addr.parse::<SocketAddr>() {
        Ok(SocketAddr::V6(v6)) if v6.ip().is_unspecified() => match dual_stack(v6.into()) {
            Ok(l) => Ok(l),
            Err(e) if no_ipv6(&e) => {
                let v4 = SocketAddr::from((Ipv4Addr::UNSPECIFIED, v6.port()));
                tracing::warn!(error = %e, %v4, "IPv6 is not available; listening on IPv4 only");
                TcpListener::bind(v4).await
            }
            Err(e) => Err(e),
        },
        _ => TcpListener::bind(addr).await,
    }
}

/// Listens on an IPv6 address with IPV6_V6ONLY off, whatever the system default.
fn dual_stack(addr: SocketAddr) -> std::io::Result<TcpListener> {
    let socket = TcpSocket::new_v6()?;
    nix::sys::socket::setsockopt(&socket, nix::sys::socket::sockopt::Ipv6V6Only, &false)?;
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    socket.listen(1024)
}

/// Whether `e` says the host has no IPv6 (disabled, or no such address family).
fn no_ipv6(e: &std::io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(nix::libc::EAFNOSUPPORT | nix::libc::EADDRNOTAVAIL | nix::libc::EPROTONOSUPPORT)
    )
}
