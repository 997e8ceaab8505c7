//! Starting workers through `hvd-agent` (`--launcher agent`): one authenticated connection per
//! host, shared by the workers started there. A worker's output arrives as messages and is fed
//! to the same relay as a local worker's pipes; its exit, a start the agent refused, and a lost
//! agent all end as one [`Exit`] on the launcher's channel.
//!
//! The agent's messages are read by a task of their own and handed over a channel, so a request
//! sent while a message is half received never cuts it; each worker's output is written to its
//! relay by a task of its own, so a relay that falls behind never holds up another worker's
//! start, stop or exit.
//!
//! A driver with a state store claims its job on every agent connection ([`Claim`]): the agents
//! keep its workers running for `--driver-grace` if it dies, and hand them, with what they wrote
//! meanwhile, to the driver that takes the job over, which gets them as [`Handed`] workers.

use std::collections::HashMap;
use std::os::unix::process::ExitStatusExt;
use std::process::ExitStatus;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use hvd_agent::{AgentError, Events, FromAgent, Stream, ToAgent};
use tokio::io::{AsyncWriteExt, DuplexStream};
use tokio::sync::mpsc;
use tokio::sync::mpsc::error::TrySendError;
use tokio::task::JoinHandle;

use crate::launch::{Ended, Exit};

/// How long connecting to an agent and authenticating may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// Requests queued for one agent.
const QUEUE: usize = 4096;
/// Bytes of a worker's output buffered between the connection and its relay.
const PIPE: usize = 64 * 1024;
/// Bytes of one output stream of a worker queued for its relay beyond [`PIPE`]; lines that
/// come while this much waits are dropped (with a warning) rather than hold up the host.
const BACKLOG: usize = 8 * 1024 * 1024;
/// Messages read from an agent ahead of the connection handling them.
const EVENTS: usize = 1024;

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

/// What a driver with a state store says on each agent connection: its job, how long the
/// agents keep its workers when it is gone, and where the workers an agent hands over go.
#[derive(Debug, Clone)]
pub struct Claim {
    /// The job's name, the same for every driver of the job (its state store prefix).
    pub job: String,
    /// `--driver-grace`.
    pub grace: Duration,
    /// Workers a predecessor started that an agent handed to this driver.
    pub handed: mpsc::UnboundedSender<Handed>,
}

impl Remote {
    /// The driver's id of the worker (its worker id).
    pub fn id(&self) -> u64 {
        self.id
    }

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
    /// Set for a job with a state store.
    pub claim: Option<Claim>,
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
            claim: None,
        }
    }

    /// Connects to `host`'s agent (when no connection is open) so that it hands over the
    /// workers a predecessor of this driver started there.
    pub fn reclaim(&mut self, host: &str, exits: &mpsc::Sender<Exit>) {
        if self.conns.get(host).is_some_and(|tx| !tx.is_closed()) {
            return;
        }
        if let Err(e) = self.open(host, None, exits) {
            tracing::warn!(host, error = %e, "cannot reach the agent to reclaim its workers");
        }
    }

    /// Opens a connection to `host`'s agent, with `first` queued before it runs (so a
    /// connection that fails at once reports that start's failure as an exit).
    fn open(
        &mut self,
        host: &str,
        first: Option<Cmd>,
        exits: &mpsc::Sender<Exit>,
    ) -> Result<mpsc::Sender<Cmd>, String> {
        let addr = self.addr(host);
        let (tx, rx) = mpsc::channel(QUEUE);
        if let Some(cmd) = first {
            tx.try_send(cmd)
                .map_err(|e| format!("queueing a start for the hvd agent at {addr}: {e}"))?;
        }
        tokio::spawn(connection(
            addr,
            self.secret.clone(),
            (tx.downgrade(), rx),
            exits.clone(),
            self.claim.clone(),
        ));
        self.conns.insert(host.to_string(), tx.clone());
        Ok(tx)
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
        let tx = self.open(host, Some(cmd), exits)?;
        Ok((Remote { id, tx }, out_r, err_r))
    }
}

/// A worker the connection knows about.
struct Live {
    out: Feed,
    err: Feed,
    started: bool,
    /// Its end was reported when it began to die ([`FromAgent::Dying`]).
    ended: bool,
}

/// One output stream of a worker: lines queued for a task that writes them to the worker's
/// relay, at most `cap` bytes of them; the task ends (closing the pipe) once this is dropped
/// and every queued line is written.
struct Feed {
    tx: mpsc::UnboundedSender<Vec<u8>>,
    queued: Arc<AtomicUsize>,
    cap: usize,
    /// Lines dropped since the last one queued.
    dropped: u64,
    what: String,
}

impl Feed {
    /// Starts the task writing to `pipe`; `what` names the stream in warnings.
    fn new(pipe: DuplexStream, cap: usize, what: String) -> Self {
        let (tx, rx) = mpsc::unbounded_channel();
        let queued = Arc::new(AtomicUsize::new(0));
        tokio::spawn(write_lines(rx, pipe, queued.clone()));
        Self {
            tx,
            queued,
            cap,
            dropped: 0,
            what,
        }
    }

    /// Queues `line` (newline added), or drops it when the backlog is full.
    fn push(&mut self, line: String) {
        let mut bytes = line.into_bytes();
        bytes.push(b'\n');
        let len = bytes.len();
        if self.queued.load(Ordering::Acquire) + len > self.cap {
            if self.dropped == 0 {
                tracing::warn!(
                    stream = %self.what,
                    backlog = self.cap,
                    "output is not relayed fast enough; dropping lines"
                );
            }
            self.dropped += 1;
            return;
        }
        self.queued.fetch_add(len, Ordering::AcqRel);
        // The writer only stops when its relay is gone, which drops the line anyway.
        let _ = self.tx.send(bytes);
        if self.dropped > 0 {
            tracing::warn!(stream = %self.what, lines = self.dropped, "output lines were dropped");
            self.dropped = 0;
        }
    }
}

impl Drop for Feed {
    fn drop(&mut self) {
        if self.dropped > 0 {
            tracing::warn!(stream = %self.what, lines = self.dropped, "output lines were dropped");
        }
    }
}

/// Writes queued lines to a worker's relay until the feed is dropped and drained.
async fn write_lines(
    mut rx: mpsc::UnboundedReceiver<Vec<u8>>,
    mut pipe: DuplexStream,
    queued: Arc<AtomicUsize>,
) {
    while let Some(bytes) = rx.recv().await {
        let res = pipe.write_all(&bytes).await;
        queued.fetch_sub(bytes.len(), Ordering::AcqRel);
        // A relay that stopped (our own output closed) takes no more lines.
        if res.is_err() {
            break;
        }
    }
}

/// A task aborted when this is dropped.
struct AbortOnDrop(JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Reads the agent's messages and hands them over until the connection ends (the last one
/// handed over is `Ok(None)` or the error) or nobody takes them. It runs on its own so no
/// message is ever read by a future that is dropped half way.
async fn read_events(mut events: Events, tx: mpsc::Sender<Result<Option<FromAgent>, AgentError>>) {
    loop {
        let ev = events.next().await;
        let last = !matches!(ev, Ok(Some(_)));
        if tx.send(ev).await.is_err() || last {
            break;
        }
    }
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
    (me, mut rx): (mpsc::WeakSender<Cmd>, mpsc::Receiver<Cmd>),
    exits: mpsc::Sender<Exit>,
    claim: Option<Claim>,
) {
    let (events, mut requests) = match hvd_agent::connect(&addr, &secret.0, CONNECT_TIMEOUT).await {
        Ok(c) => c,
        Err(e) => {
            tracing::warn!(%addr, error = %e, "cannot use the agent");
            fail_queued(&mut rx, &exits, &e.to_string()).await;
            return;
        }
    };
    tracing::info!(%addr, "connected to the agent");
    if let Some(c) = &claim {
        let req = ToAgent::Claim {
            job: c.job.clone(),
            grace_ms: u64::try_from(c.grace.as_millis()).unwrap_or(u64::MAX),
        };
        if let Err(e) = requests.send(&req).await {
            tracing::warn!(%addr, error = %e, "cannot claim the job at the agent");
            fail_queued(&mut rx, &exits, &e.to_string()).await;
            return;
        }
    }
    let (ev_tx, mut ev_rx) = mpsc::channel(EVENTS);
    // Dropped on every way out: the read half closes with the write half.
    let _reader = AbortOnDrop(tokio::spawn(read_events(events, ev_tx)));
    let mut live: HashMap<u64, Live> = HashMap::new();
    let lost = loop {
        tokio::select! {
            cmd = rx.recv() => {
                let req = match cmd {
                    None => return, // the job is over; closing the connection stops the rest
                    Some(Cmd::Start { id, argv, env, cwd, out, err }) => {
                        let out = Feed::new(out, BACKLOG, format!("worker {id} stdout at {addr}"));
                        let err = Feed::new(err, BACKLOG, format!("worker {id} stderr at {addr}"));
                        live.insert(id, Live { out, err, started: false, ended: false });
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
            ev = ev_rx.recv() => match ev {
                Some(Ok(Some(FromAgent::Started { id, pid }))) => {
                    tracing::debug!(worker = id, pid, %addr, "worker started by the agent");
                    if let Some(w) = live.get_mut(&id) {
                        w.started = true;
                    }
                }
                Some(Ok(Some(FromAgent::StartFailed { id, error }))) => {
                    live.remove(&id);
                    let end = Ended::NotStarted(format!("the hvd agent at {addr}: {error}"));
                    let _ = exits.send(Exit { worker: id, end }).await;
                }
                Some(Ok(Some(FromAgent::Output { id, stream, line }))) => {
                    if let Some(w) = live.get_mut(&id) {
                        match stream {
                            Stream::Stdout => w.out.push(line),
                            Stream::Stderr => w.err.push(line),
                        }
                    }
                }
                Some(Ok(Some(FromAgent::Dying { id, code, signal }))) => {
                    // Its lines keep coming until its exit; the job re-forms meanwhile.
                    if let Some(w) = live.get_mut(&id).filter(|w| !w.ended) {
                        w.ended = true;
                        let end = Ended::Status(status(code, signal));
                        let _ = exits.send(Exit { worker: id, end }).await;
                    }
                }
                Some(Ok(Some(FromAgent::Exited { id, code, signal }))) => {
                    // Dropping the feeds ends the worker's relays after the lines above.
                    if live.remove(&id).is_some_and(|w| !w.ended) {
                        let end = Ended::Status(status(code, signal));
                        let _ = exits.send(Exit { worker: id, end }).await;
                    }
                }
                Some(Ok(Some(FromAgent::Claimed { processes, dropped_lines }))) => {
                    if dropped_lines > 0 {
                        tracing::warn!(%addr, lines = dropped_lines, "the agent dropped output lines while no driver was connected");
                    }
                    let (Some(c), Some(tx)) = (&claim, me.upgrade()) else { continue };
                    for p in processes {
                        tracing::info!(worker = p.id, pid = p.pid, %addr, "the agent handed over a worker of the previous driver");
                        let (out_w, out_r) = tokio::io::duplex(PIPE);
                        let (err_w, err_r) = tokio::io::duplex(PIPE);
                        let out = Feed::new(out_w, BACKLOG, format!("worker {} stdout at {addr}", p.id));
                        let err = Feed::new(err_w, BACKLOG, format!("worker {} stderr at {addr}", p.id));
                        live.insert(p.id, Live { out, err, started: true, ended: false });
                        let remote = Remote { id: p.id, tx: tx.clone() };
                        let _ = c.handed.send((remote, out_r, err_r));
                    }
                }
                Some(Ok(Some(FromAgent::Error { reason }))) => {
                    tracing::warn!(%addr, %reason, "the agent reports an error");
                }
                Some(Ok(Some(other))) => {
                    tracing::warn!(%addr, message = ?other, "unexpected message from the agent");
                }
                Some(Ok(None)) | None => {
                    break format!("the hvd agent at {addr} closed the connection")
                }
                Some(Err(e)) => break e.to_string(),
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
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;
    use hvd_agent::auth;
    use hvd_rendezvous::{decode_line, encode_line};
    use tokio::io::{AsyncBufReadExt, AsyncReadExt, BufReader};
    use tokio::net::TcpListener;
    use tokio::sync::oneshot;

    const SECRET: &str = "test-secret-0123456789";
    const WAIT: Duration = Duration::from_secs(20);

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

    /// Everything read from `pipe` until it closes.
    async fn read_all(mut pipe: DuplexStream) -> String {
        let mut s = String::new();
        tokio::time::timeout(WAIT, pipe.read_to_string(&mut s))
            .await
            .expect("output never ended")
            .unwrap();
        s
    }

    /// The next exit on `exits`.
    async fn next_exit(exits: &mut mpsc::Receiver<Exit>) -> Exit {
        tokio::time::timeout(WAIT, exits.recv())
            .await
            .expect("no exit in time")
            .expect("exit channel closed")
    }

    fn sh(script: &str) -> Vec<String> {
        vec!["sh".into(), "-c".into(), script.into()]
    }

    /// A real agent served in this process on a free loopback port.
    struct Served {
        port: u16,
        stop: Option<oneshot::Sender<()>>,
        task: JoinHandle<()>,
    }

    impl Served {
        async fn start() -> Self {
            let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
            let port = listener.local_addr().unwrap().port();
            let (stop, stopped) = oneshot::channel::<()>();
            let task = tokio::spawn(hvd_agent::serve(listener, SECRET.into(), async move {
                let _ = stopped.await;
            }));
            Self {
                port,
                stop: Some(stop),
                task,
            }
        }

        /// Stops the agent and whatever it still runs.
        async fn shutdown(mut self) {
            if let Some(s) = self.stop.take() {
                let _ = s.send(());
            }
            let _ = tokio::time::timeout(WAIT, &mut self.task).await;
        }
    }

    impl Drop for Served {
        fn drop(&mut self) {
            if let Some(s) = self.stop.take() {
                let _ = s.send(());
            }
        }
    }

    /// A fake agent's end of an authenticated connection.
    struct Fake {
        reader: BufReader<tokio::net::tcp::OwnedReadHalf>,
        writer: tokio::net::tcp::OwnedWriteHalf,
    }

    impl Fake {
        async fn accept(listener: &TcpListener) -> Self {
            let (stream, _) = listener.accept().await.unwrap();
            let (r, writer) = stream.into_split();
            let mut fake = Self {
                reader: BufReader::new(r),
                writer,
            };
            let hs = auth::Handshake::new(SECRET, auth::CONTEXT, auth::Role::Listener).unwrap();
            fake.send(&FromAgent::Challenge {
                nonce: hs.nonce().to_hex(),
            })
            .await;
            let ToAgent::Auth { mac, nonce: theirs } = fake.recv().await else {
                panic!("no auth");
            };
            let theirs = auth::Nonce::from_hex(&theirs).unwrap();
            hs.verify(&theirs, &auth::Tag::from_hex(&mac).unwrap())
                .unwrap();
            let mac = hs.proof(&theirs).to_hex();
            fake.send(&FromAgent::Welcome { mac }).await;
            fake
        }

        async fn send(&mut self, msg: &FromAgent) {
            self.writer
                .write_all(&encode_line(msg).unwrap())
                .await
                .unwrap();
        }

        async fn recv(&mut self) -> ToAgent {
            let mut line = Vec::new();
            self.reader.read_until(b'\n', &mut line).await.unwrap();
            decode_line(&line).unwrap()
        }
    }

    #[tokio::test]
    async fn a_message_half_received_when_a_request_goes_out_arrives_whole() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let (half_tx, half_rx) = oneshot::channel();
        let fake = tokio::spawn(async move {
            let mut f = Fake::accept(&listener).await;
            assert!(matches!(f.recv().await, ToAgent::Start { id: 1, .. }));
            assert!(matches!(f.recv().await, ToAgent::Start { id: 2, .. }));
            f.send(&FromAgent::Started { id: 1, pid: 10 }).await;
            f.send(&FromAgent::Started { id: 2, pid: 11 }).await;
            let line = encode_line(&FromAgent::Output {
                id: 1,
                stream: Stream::Stdout,
                line: "a line cut in two by a stop".into(),
            })
            .unwrap();
            let (first, rest) = line.split_at(line.len() / 2);
            f.writer.write_all(first).await.unwrap();
            half_tx.send(()).unwrap();
            // The driver sends a request while the line is half read.
            assert_eq!(f.recv().await, ToAgent::Stop { id: 2, grace_ms: 0 });
            f.writer.write_all(rest).await.unwrap();
            f.send(&FromAgent::Exited {
                id: 2,
                code: None,
                signal: Some(9),
            })
            .await;
            f.send(&FromAgent::Exited {
                id: 1,
                code: Some(0),
                signal: None,
            })
            .await;
            f // keeps the connection open
        });
        let mut agents = Agents::new(port, SECRET.into());
        let (exit_tx, mut exits) = mpsc::channel(16);
        let (_r1, out1, _e1) = agents
            .start("127.0.0.1", 1, sh("x"), vec![], None, &exit_tx)
            .unwrap();
        let (r2, _o2, _e2) = agents
            .start("127.0.0.1", 2, sh("x"), vec![], None, &exit_tx)
            .unwrap();
        half_rx.await.unwrap();
        tokio::time::sleep(Duration::from_millis(200)).await;
        r2.stop(Duration::ZERO);
        let first = next_exit(&mut exits).await;
        assert_eq!(first.worker, 2);
        assert!(
            matches!(first.end, Ended::Status(s) if s.signal() == Some(9)),
            "{:?}",
            first.end
        );
        let second = next_exit(&mut exits).await;
        assert_eq!(second.worker, 1);
        assert!(
            matches!(second.end, Ended::Status(s) if s.success()),
            "{:?}",
            second.end
        );
        assert_eq!(read_all(out1).await, "a line cut in two by a stop\n");
        drop(fake.await.unwrap());
    }

    #[tokio::test]
    async fn a_dying_worker_is_reported_once_at_once_and_its_last_lines_still_come() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let (dying_tx, dying_rx) = oneshot::channel();
        let (go_tx, go_rx) = oneshot::channel::<()>();
        let fake = tokio::spawn(async move {
            let mut f = Fake::accept(&listener).await;
            assert!(matches!(f.recv().await, ToAgent::Start { id: 1, .. }));
            f.send(&FromAgent::Started { id: 1, pid: 10 }).await;
            let dying = FromAgent::Dying {
                id: 1,
                code: None,
                signal: Some(9),
            };
            f.send(&dying).await;
            dying_tx.send(()).unwrap();
            go_rx.await.unwrap();
            // The lines it wrote before the kill, then its exit once its memory is freed.
            f.send(&FromAgent::Output {
                id: 1,
                stream: Stream::Stdout,
                line: "written before the kill".into(),
            })
            .await;
            f.send(&FromAgent::Exited {
                id: 1,
                code: None,
                signal: Some(9),
            })
            .await;
            f
        });
        let mut agents = Agents::new(port, SECRET.into());
        let (exit_tx, mut exits) = mpsc::channel(16);
        let (_r1, out1, _e1) = agents
            .start("127.0.0.1", 1, sh("x"), vec![], None, &exit_tx)
            .unwrap();
        dying_rx.await.unwrap();
        let early = next_exit(&mut exits).await;
        assert_eq!(early.worker, 1);
        assert!(
            matches!(early.end, Ended::Status(s) if s.signal() == Some(9)),
            "{:?}",
            early.end
        );
        go_tx.send(()).unwrap();
        assert_eq!(read_all(out1).await, "written before the kill\n");
        assert!(
            exits.try_recv().is_err(),
            "the exit after the early report is not reported again"
        );
        drop(fake.await.unwrap());
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn fast_output_loses_no_line_while_others_start_and_stop() {
        let served = Served::start().await;
        let mut agents = Agents::new(served.port, SECRET.into());
        let (exit_tx, mut exits) = mpsc::channel(1024);
        // Long lines: the agent's messages often arrive in pieces.
        const N: usize = 400;
        const WIDTH: usize = 20_000;
        let script = format!(
            "awk 'BEGIN {{ s = \"x\"; while (length(s) < {WIDTH}) s = s s; \
             s = substr(s, 1, {WIDTH}); for (i = 1; i <= {N}; i++) print i s }}'"
        );
        let (_r, out, _e) = agents
            .start("127.0.0.1", 1, sh(&script), vec![], None, &exit_tx)
            .unwrap();
        let reader = tokio::spawn(read_all(out));
        let mut others = Vec::new();
        let mut id = 1;
        while !reader.is_finished() && id < 500 {
            id += 1;
            let (r, o, e) = agents
                .start("127.0.0.1", id, sh("exec sleep 20"), vec![], None, &exit_tx)
                .unwrap();
            tokio::time::sleep(Duration::from_millis(1)).await;
            r.stop(Duration::ZERO);
            others.push((o, e));
        }
        let text = tokio::time::timeout(WAIT, reader).await.unwrap().unwrap();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), N, "lines were lost");
        let pad = "x".repeat(WIDTH);
        for (i, l) in lines.iter().enumerate() {
            assert_eq!(*l, format!("{}{pad}", i + 1), "line {i}");
        }
        for _ in 0..id {
            let e = next_exit(&mut exits).await;
            assert!(
                matches!(e.end, Ended::Status(_)),
                "{}: {:?}",
                e.worker,
                e.end
            );
        }
        drop(agents);
        served.shutdown().await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_stalled_relay_holds_up_no_other_worker() {
        let served = Served::start().await;
        let mut agents = Agents::new(served.port, SECRET.into());
        let (exit_tx, mut exits) = mpsc::channel(16);
        const N: u32 = 200_000; // far more than the pipe to the relay holds
        let (_r1, out1, _e1) = agents
            .start(
                "127.0.0.1",
                1,
                sh(&format!("seq 1 {N}; exec sleep 20")),
                vec![],
                None,
                &exit_tx,
            )
            .unwrap();
        // Nobody reads worker 1's output for now.
        tokio::time::sleep(Duration::from_millis(500)).await;
        let (r2, out2, _e2) = agents
            .start(
                "127.0.0.1",
                2,
                sh("echo up; exec sleep 20"),
                vec![],
                None,
                &exit_tx,
            )
            .unwrap();
        let mut out2 = BufReader::new(out2);
        let mut up = String::new();
        tokio::time::timeout(WAIT, out2.read_line(&mut up))
            .await
            .expect("worker 2's output is held up")
            .unwrap();
        assert_eq!(up, "up\n");
        r2.stop(Duration::ZERO);
        let e = tokio::time::timeout(WAIT, exits.recv())
            .await
            .expect("worker 2's stop is held up")
            .unwrap();
        assert_eq!(e.worker, 2);
        assert!(
            matches!(e.end, Ended::Status(s) if s.signal() == Some(9)),
            "{:?}",
            e.end
        );
        // Worker 1's output was kept for its relay.
        let mut out1 = BufReader::new(out1);
        let mut line = String::new();
        for i in 1..=N {
            line.clear();
            tokio::time::timeout(WAIT, out1.read_line(&mut line))
                .await
                .unwrap()
                .unwrap();
            assert_eq!(line, format!("{i}\n"));
        }
        drop(agents);
        served.shutdown().await;
    }

    #[tokio::test]
    async fn a_full_backlog_drops_lines_and_recovers() {
        let (w, mut r) = tokio::io::duplex(16);
        let mut feed = Feed::new(w, 100, "test".into());
        for i in 0..10 {
            feed.push(format!("{i:019}")); // 20 bytes with the newline
        }
        // Nothing is written yet: five lines fill the backlog, the other five are dropped.
        assert_eq!(feed.dropped, 5);
        let mut buf = vec![0; 100];
        r.read_exact(&mut buf).await.unwrap();
        let got = String::from_utf8(buf).unwrap();
        let want: String = (0..5).map(|i| format!("{i:019}\n")).collect();
        assert_eq!(got, want);
        // Drained: lines are taken again and the count starts over.
        tokio::time::timeout(WAIT, async {
            while feed.queued.load(Ordering::Acquire) > 0 {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
        .await
        .unwrap();
        feed.push("again".into());
        assert_eq!(feed.dropped, 0);
        drop(feed);
        let mut rest = String::new();
        r.read_to_string(&mut rest).await.unwrap();
        assert_eq!(rest, "again\n");
    }
}
