//! Starting workers through `hvd-agent` (`--launcher agent`): one authenticated connection per
//! host, shared by the workers started there. A worker's output arrives as messages and is fed
//! to the same relay as a local worker's pipes; its exit, a start the agent refused, and a lost
//! agent all end as one [`Exit`] on the launcher's channel.

use std::collections::HashMap;
use std::os::unix::process::ExitStatusExt;
use std::process::ExitStatus;
use std::time::Duration;

use hvd_agent::{FromAgent, Stream, ToAgent};
use tokio::io::{AsyncWriteExt, DuplexStream};
use tokio::sync::mpsc;
use tokio::sync::mpsc::error::TrySendError;

use crate::job::{Ended, Exit};

/// How long connecting to an agent and authenticating may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// Requests queued for one agent.
const QUEUE: usize = 4096;
/// Bytes of a worker's output buffered between the connection and its relay.
const PIPE: usize = 64 * 1024;

/// The shared secret, kept out of debug output.
#[derive(Clone)]
pub struct Secret(pub String);

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Secret(..)")
    }
}

/// What a worker asks of its host's connection.
#[derive(Debug)]
enum Cmd {
    Start {
        id: u64,
        argv: Vec<String>,
        env: Vec<(String, String)>,
        cwd: Option<String>,
        out: DuplexStream,
        err: DuplexStream,
    },
    Stop {
        id: u64,
        grace: Duration,
    },
}

/// A worker an agent runs; stops go through its host's connection.
#[derive(Debug, Clone)]
pub struct Remote {
    id: u64,
    tx: mpsc::Sender<Cmd>,
}

impl Remote {
    /// Asks the agent to stop the worker: SIGTERM, SIGKILL after `grace` (at once for zero).
    pub fn stop(&self, grace: Duration) {
        match self.tx.try_send(Cmd::Stop { id: self.id, grace }) {
            Ok(()) => {}
            // Its agent is gone, and the worker with it (or it exits when its driver does).
            Err(TrySendError::Closed(_)) => {
                tracing::debug!(
                    worker = self.id,
                    "stop not sent: the agent connection is closed"
                );
            }
            Err(TrySendError::Full(_)) => {
                tracing::warn!(
                    worker = self.id,
                    "stop not sent: too many requests queued for its agent"
                );
            }
        }
    }
}

/// The agents of a job: their port, the secret, and one connection per host.
#[derive(Debug)]
pub struct Agents {
    port: u16,
    secret: Secret,
    conns: HashMap<String, mpsc::Sender<Cmd>>,
}

/// A worker handed to an agent: its handle and the read ends of its stdout and stderr.
pub type Handed = (Remote, DuplexStream, DuplexStream);

impl Agents {
    /// Agents listening on `port`, authenticated with `secret`.
    pub fn new(port: u16, secret: String) -> Self {
        Self {
            port,
            secret: Secret(secret),
            conns: HashMap::new(),
        }
    }

    /// `host:port` of `host`'s agent.
    pub fn addr(&self, host: &str) -> String {
        if host.contains(':') {
            format!("[{host}]:{}", self.port)
        } else {
            format!("{host}:{}", self.port)
        }
    }

    /// Asks `host`'s agent to start worker `id`, connecting first if no connection is open.
    /// Returns at once; a failed connection or start arrives later as an [`Exit`] on `exits`.
    ///
    /// # Errors
    /// When the request can't even be queued (the connection just closed, or is flooded).
    pub fn start(
        &mut self,
        host: &str,
        id: u64,
        argv: Vec<String>,
        env: Vec<(String, String)>,
        cwd: Option<String>,
        exits: &mpsc::Sender<Exit>,
    ) -> Result<Handed, String> {
        let addr = self.addr(host);
        let (out_w, out_r) = tokio::io::duplex(PIPE);
        let (err_w, err_r) = tokio::io::duplex(PIPE);
        let mut cmd = Cmd::Start {
            id,
            argv,
            env,
            cwd,
            out: out_w,
            err: err_w,
        };
        // An open connection takes it; a closed one (its agent failed) is replaced, so this
        // start fails (or works) on its own connection and reports the real reason.
        if let Some(tx) = self.conns.get(host) {
            match tx.try_send(cmd) {
                Ok(()) => return Ok((Remote { id, tx: tx.clone() }, out_r, err_r)),
                Err(TrySendError::Closed(back)) => cmd = back,
                Err(TrySendError::Full(_)) => {
                    return Err(format!(
                        "too many requests queued for the hvd agent at {addr}"
                    ));
                }
            }
        }
        let (tx, rx) = mpsc::channel(QUEUE);
        // Queued before the connection runs: it can't fail between the two.
        tx.try_send(cmd)
            .map_err(|e| format!("queueing a start for the hvd agent at {addr}: {e}"))?;
        tokio::spawn(connection(addr, self.secret.clone(), rx, exits.clone()));
        self.conns.insert(host.to_string(), tx.clone());
        Ok((Remote { id, tx }, out_r, err_r))
    }
}

/// A worker the connection knows about.
struct Live {
    out: DuplexStream,
    err: DuplexStream,
    started: bool,
}

/// The wait status for an exit code or a signal.
fn status(code: Option<i32>, signal: Option<i32>) -> ExitStatus {
    match (code, signal) {
        (Some(c), _) => ExitStatus::from_raw((c & 0xff) << 8),
        (None, Some(s)) => ExitStatus::from_raw(s & 0x7f),
        (None, None) => ExitStatus::from_raw(1 << 8),
    }
}

/// One agent connection: connects, then forwards requests and turns the agent's messages into
/// output and exits, until the job drops every handle (closing the connection stops whatever
/// still runs there) or the agent is lost (every worker on it ends as lost).
async fn connection(
    addr: String,
    secret: Secret,
    mut rx: mpsc::Receiver<Cmd>,
    exits: mpsc::Sender<Exit>,
) {
    let (mut events, mut requests) =
        match hvd_agent::connect(&addr, &secret.0, CONNECT_TIMEOUT).await {
            Ok(c) => c,
            Err(e) => {
                tracing::warn!(%addr, error = %e, "cannot use the agent");
                fail_queued(&mut rx, &exits, &e.to_string()).await;
                return;
            }
        };
    tracing::info!(%addr, "connected to the agent");
    let mut live: HashMap<u64, Live> = HashMap::new();
    let lost = loop {
        tokio::select! {
            cmd = rx.recv() => {
                let req = match cmd {
                    None => return, // the job is over; closing the connection stops the rest
                    Some(Cmd::Start { id, argv, env, cwd, out, err }) => {
                        live.insert(id, Live { out, err, started: false });
                        ToAgent::Start { id, argv, env, cwd }
                    }
                    Some(Cmd::Stop { id, grace }) => ToAgent::Stop {
                        id,
                        grace_ms: u64::try_from(grace.as_millis()).unwrap_or(u64::MAX),
                    },
                };
                if let Err(e) = requests.send(&req).await {
                    break e.to_string();
                }
            }
            ev = events.next() => match ev {
                Ok(Some(FromAgent::Started { id, pid })) => {
                    tracing::debug!(worker = id, pid, %addr, "worker started by the agent");
                    if let Some(w) = live.get_mut(&id) {
                        w.started = true;
                    }
                }
                Ok(Some(FromAgent::StartFailed { id, error })) => {
                    live.remove(&id);
                    let end = Ended::NotStarted(format!("the hvd agent at {addr}: {error}"));
                    let _ = exits.send(Exit { worker: id, end }).await;
                }
                Ok(Some(FromAgent::Output { id, stream, line })) => {
                    if let Some(w) = live.get_mut(&id) {
                        let pipe = match stream {
                            Stream::Stdout => &mut w.out,
                            Stream::Stderr => &mut w.err,
                        };
                        let mut bytes = line.into_bytes();
                        bytes.push(b'\n');
                        // A relay that stopped (our own output closed) drops the line.
                        let _ = pipe.write_all(&bytes).await;
                    }
                }
                Ok(Some(FromAgent::Exited { id, code, signal })) => {
                    // Dropping the pipes ends the worker's relays after the lines above.
                    live.remove(&id);
                    let end = Ended::Status(status(code, signal));
                    let _ = exits.send(Exit { worker: id, end }).await;
                }
                Ok(Some(FromAgent::Error { reason })) => {
                    tracing::warn!(%addr, %reason, "the agent reports an error");
                }
                Ok(Some(other)) => {
                    tracing::warn!(%addr, message = ?other, "unexpected message from the agent");
                }
                Ok(None) => break format!("the hvd agent at {addr} closed the connection"),
                Err(e) => break e.to_string(),
            },
        }
    };
    tracing::warn!(%addr, reason = %lost, workers = live.len(), "agent lost");
    for (id, w) in live {
        let end = if w.started {
            Ended::Lost(lost.clone())
        } else {
            Ended::NotStarted(lost.clone())
        };
        let _ = exits.send(Exit { worker: id, end }).await;
    }
    fail_queued(&mut rx, &exits, &lost).await;
}

/// Ends every start still queued as not started; the connection takes no more requests.
async fn fail_queued(rx: &mut mpsc::Receiver<Cmd>, exits: &mpsc::Sender<Exit>, why: &str) {
    rx.close();
    while let Some(cmd) = rx.recv().await {
        if let Cmd::Start { id, .. } = cmd {
            let end = Ended::NotStarted(why.to_string());
            let _ = exits.send(Exit { worker: id, end }).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exit_codes_and_signals_become_wait_statuses() {
        assert_eq!(status(Some(3), None).code(), Some(3));
        assert!(status(Some(0), None).success());
        assert_eq!(status(None, Some(9)).signal(), Some(9));
        assert_eq!(status(None, Some(9)).code(), None);
        assert!(!status(None, None).success());
    }

    #[test]
    fn ipv6_hosts_are_bracketed() {
        let a = Agents::new(7077, "s".into());
        assert_eq!(a.addr("10.0.0.1"), "10.0.0.1:7077");
        assert_eq!(a.addr("fd00::1"), "[fd00::1]:7077");
        assert_eq!(format!("{:?}", a.secret), "Secret(..)");
    }
}
