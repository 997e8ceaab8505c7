//! `hvd-operator`: reconciles `ElasticJob`s into driver and worker pods.
//!
//! `hvd-operator [--namespace NS] [--leader-elect --lease-name NAME --lease-namespace NS]
//! [--probe-port PORT]`; `RUST_LOG` sets the log level. SIGTERM or SIGINT stops it gracefully.
//! `GET /healthz` and `GET /readyz` on the probe port (8081; 0 turns them off) are for the
//! kubelet, `GET /metrics` there for Prometheus.

use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context as _;
use clap::Parser;
use hvd_operator::leader::{Leadership, lead};
use hvd_operator::metrics::Metrics;
use hvd_operator::probes::{self, Health};
use hvd_operator::reconcile::{Context, run};
use kube::Client;
use kube_lease_manager::LeaseManagerBuilder;
use tokio::signal::unix::{SignalKind, signal};
use tokio::sync::watch;

/// Command line of `hvd-operator`.
#[derive(Parser, Debug)]
#[command(
    name = "hvd-operator",
    version,
    about = "Reconciles hvd ElasticJobs into pods"
)]
struct Cli {
    /// Watch only this namespace (default: every namespace).
    #[arg(long, value_name = "NS")]
    namespace: Option<String>,
    /// Reconcile only while holding a coordination.k8s.io Lease, so replicas can stand by.
    #[arg(long)]
    leader_elect: bool,
    /// Name of the Lease.
    #[arg(long, value_name = "NAME", default_value = "hvd-operator")]
    lease_name: String,
    /// Namespace of the Lease (default: the pod's namespace from POD_NAMESPACE, else `default`).
    #[arg(
        long,
        value_name = "NS",
        env = "POD_NAMESPACE",
        default_value = "default"
    )]
    lease_namespace: String,
    /// This instance's identity as a Lease holder and Event reporter (default: POD_NAME).
    #[arg(long, value_name = "ID", env = "POD_NAME")]
    identity: Option<String>,
    /// Port of `GET /healthz` (liveness), `GET /readyz` (readiness: the Kubernetes API
    /// answered) and `GET /metrics` (Prometheus), on every interface; 0 serves none.
    #[arg(long, value_name = "PORT", default_value_t = 8081)]
    probe_port: u16,
}

/// Resolves when SIGTERM or SIGINT arrives (or the handlers cannot be installed).
async fn terminated() {
    let (Ok(mut term), Ok(mut int)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) else {
        tracing::error!("cannot install signal handlers");
        return;
    };
    tokio::select! {
        _ = term.recv() => tracing::info!("SIGTERM"),
        _ = int.recv() => tracing::info!("SIGINT"),
    }
}

/// How long a leading controller gets to finish its reconciles after SIGTERM.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(20);

/// Exit code for a usage error (sysexits EX_USAGE).
const EX_USAGE: u8 = 64;

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
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
    if let Some(bad) = [
        ("--namespace", cli.namespace.as_deref()),
        ("--lease-name", Some(cli.lease_name.as_str())),
        ("--lease-namespace", Some(cli.lease_namespace.as_str())),
    ]
    .into_iter()
    .find(|(_, v)| v.is_some_and(|v| v.trim().is_empty()))
    {
        eprintln!("hvd-operator: {} must not be empty", bad.0);
        return ExitCode::from(EX_USAGE);
    }
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        // A pod's log is no terminal: colours only when run by hand on one.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stdout()))
        .init();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("hvd-operator: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(operate(cli)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!(error = format!("{e:#}"), "hvd-operator failed");
            ExitCode::FAILURE
        }
    }
}

/// Runs the controller, under leader election when asked, until SIGTERM or SIGINT.
async fn operate(cli: Cli) -> anyhow::Result<()> {
    let health = Health::new();
    let metrics = Metrics::new();
    if cli.probe_port != 0 {
        let listener = hvd_serve::bind_any(cli.probe_port, "probe endpoint")
            .await
            .with_context(|| format!("cannot listen on --probe-port {}", cli.probe_port))?;
        tracing::info!(
            port = cli.probe_port,
            "probes at /healthz and /readyz, metrics at /metrics"
        );
        let app = probes::router(health.clone(), metrics.clone());
        // Served until the process exits: the kubelet probes a stopping operator too.
        tokio::spawn(async move {
            if let Err(e) = hvd_serve::serve(listener, app, std::future::pending()).await {
                tracing::error!(error = %e, "the probe endpoint failed");
            }
        });
    }
    let client = Client::try_default()
        .await
        .context("cannot reach the Kubernetes API (no in-cluster config or kubeconfig)")?;
    // Not ready until the API answers; a short outage at start-up is waited out, not fatal.
    let version = loop {
        match client.apiserver_version().await {
            Ok(v) => break v,
            Err(e) => {
                tracing::warn!(error = %e, "the Kubernetes API does not answer; retrying in 2 s");
                tokio::select! {
                    () = tokio::time::sleep(Duration::from_secs(2)) => {}
                    () = terminated() => return Ok(()),
                }
            }
        }
    };
    tracing::info!(version = %version.git_version, "Kubernetes API reached");
    health.ready();
    let mut ctx = Context::new(client.clone(), cli.identity.clone());
    ctx.metrics = metrics;

    let (stop_tx, stop_rx) = watch::channel(false);
    let h = health.clone();
    tokio::spawn(async move {
        terminated().await;
        h.stopping();
        let _ = stop_tx.send(true);
    });
    let stopped = |mut rx: watch::Receiver<bool>| async move {
        let _ = rx.wait_for(|s| *s).await;
    };
    let controller = run(ctx, cli.namespace.clone(), stopped(stop_rx.clone()));

    if !cli.leader_elect {
        tracing::info!(namespace = ?cli.namespace, "hvd-operator running");
        controller.await;
        return Ok(());
    }
    let mut lease =
        LeaseManagerBuilder::new(client, &cli.lease_name).with_namespace(&cli.lease_namespace);
    if let Some(id) = &cli.identity {
        lease = lease.with_identity(id);
    }
    let manager = lease.build().await.with_context(|| {
        format!(
            "cannot use Lease {}/{}",
            cli.lease_namespace, cli.lease_name
        )
    })?;
    let (leading, task) = manager.watch().await;
    tracing::info!(lease = %cli.lease_name, namespace = ?cli.namespace, "hvd-operator waiting for the lease");
    let (outcome, manager) =
        lead(leading, task, controller, stopped(stop_rx), SHUTDOWN_GRACE).await;
    // Give the lease back for a fast handover.
    match manager {
        Some(Ok(Ok(manager))) => {
            if let Err(e) = manager.release().await {
                tracing::warn!(error = %e, "cannot release the lease");
            }
        }
        Some(Ok(Err(e))) => tracing::warn!(error = %e, "the lease manager failed"),
        Some(Err(e)) => tracing::warn!(error = %e, "the lease manager task failed"),
        None => {}
    }
    match outcome {
        Leadership::WorkEnded => Ok(()),
        Leadership::Lost => anyhow::bail!(
            "lost the lease {}; exiting so a restart can campaign again",
            cli.lease_name
        ),
        Leadership::ElectionEnded => {
            anyhow::bail!("the lease manager for {} stopped", cli.lease_name)
        }
    }
}
