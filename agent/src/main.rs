//! `hvd-agent`: the per-host agent that starts and stops training processes for the hvd
//! driver (`horovodrun --launcher agent`).

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, bail};
use clap::Parser;
use tokio::signal::unix::{SignalKind, signal};

/// Starts, watches and stops the training processes the hvd driver asks for.
#[derive(Debug, Parser)]
#[command(name = "hvd-agent", version, about)]
struct Args {
    /// Address and port to listen on.
    #[arg(long, value_name = "ADDR:PORT", default_value = "0.0.0.0:7077")]
    listen: String,

    /// File holding the shared secret (default: the HVD_AGENT_SECRET environment variable).
    #[arg(long, value_name = "PATH")]
    secret_file: Option<PathBuf>,
}

/// Exit code for a usage or configuration error (sysexits EX_USAGE).
const EX_USAGE: u8 = 64;

#[tokio::main(worker_threads = 2)]
async fn main() -> ExitCode {
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
        .with_writer(std::io::stderr)
        .init();
    let secret = match read_secret(&args) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("hvd-agent: error: {e:#}");
            return ExitCode::from(EX_USAGE);
        }
    };
    match run(&args.listen, secret).await {
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

async fn run(listen: &str, secret: String) -> anyhow::Result<()> {
    let listener = tokio::net::TcpListener::bind(listen)
        .await
        .with_context(|| format!("cannot listen on {listen}"))?;
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
