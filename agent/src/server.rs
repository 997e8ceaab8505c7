//! The agent's side: accepts driver connections, authenticates them, starts and stops the
//! processes they ask for, and streams back their output and exits. Every process belongs to
//! the connection that started it: when that connection ends, for whatever reason, its
//! processes are stopped (SIGTERM to the group, SIGKILL after a grace), so a dead driver leaves
//! no orphans behind. When a process's leader ends, whatever is left of its group is killed.

use std::collections::HashMap;
use std::collections::hash_map::Entry;
use std::future::Future;
use std::net::SocketAddr;
use std::os::unix::process::ExitStatusExt;
use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use hvd_rendezvous::{MAX_LINE, decode_line, encode_line};
use nix::sys::signal::{Signal, killpg};
use nix::unistd::Pid;
use tokio::io::{AsyncBufReadExt, AsyncRead, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::process::Command;
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc, watch};
use tokio::task::JoinSet;
use tokio::time::Instant;

use crate::auth;
use crate::lines::{Line, LineReader};
use crate::proto::{FromAgent, Stream, ToAgent};
use crate::{net, reaper};

/// How long a new connection has to answer the challenge.
const AUTH_TIMEOUT: Duration = Duration::from_secs(10);
/// Grace between SIGTERM and SIGKILL when a connection's processes are stopped.
const TERM_GRACE: Duration = Duration::from_millis(1000);
/// How long the output pipes of a process that exited may keep the agent waiting for more
/// (or their end): its group is killed then, so only a process that left the group can hold
/// them open. Time spent waiting for the driver to take the output does not count.
const DRAIN: Duration = Duration::from_millis(500);
/// Longest line accepted before authentication: the answer to the challenge is far shorter.
const AUTH_MAX_LINE: usize = 4096;
/// Messages queued for one driver before the processes' output waits for it.
const OUT_QUEUE: usize = 1024;
/// Longest output line sent as one message; longer lines are split.
const MAX_OUTPUT_LINE: usize = 64 * 1024;

/// Environment variables the agent keeps from the processes it starts.
const PRIVATE_ENV: &[&str] = &[crate::ENV_AGENT_SECRET];

/// How many connections an agent serves at once, so that a flood of them (before or after
/// authentication) can't exhaust its file descriptors or memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Connections open at once, authenticated or not; more are closed as they arrive.
    pub connections: usize,
    /// Connections still authenticating at once; more are refused as they arrive.
    pub unauthenticated: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            connections: 256,
            unauthenticated: 16,
        }
    }
}

/// Serves driver connections on `listener` until `shutdown` completes; then stops every
/// process of every connection and returns. [`Limits::default`] bounds the connections.
pub async fn serve(listener: TcpListener, secret: String, shutdown: impl Future<Output = ()>) {
    serve_with_limits(listener, secret, Limits::default(), shutdown).await;
}

/// [`serve`] with the given connection limits.
pub async fn serve_with_limits(
    listener: TcpListener,
    secret: String,
    limits: Limits,
    shutdown: impl Future<Output = ()>,
) {
    let secret = Arc::new(secret);
    let (stop_tx, stop_rx) = watch::channel(false);
    let open = Arc::new(Semaphore::new(limits.connections));
    let authenticating = Arc::new(Semaphore::new(limits.unauthenticated));
    let mut full_warned = false;
    let mut conns = JoinSet::new();
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            () = &mut shutdown => break,
            acc = listener.accept() => match acc {
                Ok((stream, peer)) => match open.clone().try_acquire_owned() {
                    Ok(slot) => {
                        full_warned = false;
                        conns.spawn(connection(
                            stream,
                            peer,
                            secret.clone(),
                            stop_rx.clone(),
                            (slot, authenticating.clone()),
                        ));
                    }
                    Err(_) => {
                        if !full_warned {
                            tracing::warn!(
                                %peer,
                                limit = limits.connections,
                                "too many connections; closing new ones until some end"
                            );
                            full_warned = true;
                        }
                        drop(stream);
                    }
                },
                Err(e) => {
                    tracing::warn!(error = %e, "accepting a connection failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            },
            Some(_) = conns.join_next(), if !conns.is_empty() => {}
        }
    }
    tracing::info!(
        connections = conns.len(),
        "shutting down: stopping every process"
    );
    let _ = stop_tx.send(true);
    let all = async { while conns.join_next().await.is_some() {} };
    if tokio::time::timeout(TERM_GRACE * 5, all).await.is_err() {
        tracing::warn!("some connections did not finish stopping their processes in time");
    }
}

/// A process started for a connection.
struct Proc {
    pid: i32,
    /// Becomes `true` once the process has been reaped.
    done: watch::Receiver<bool>,
}

/// One driver connection: its slot among the open ones (held until it ends), and the
/// semaphore of the connections still authenticating.
type Slots = (OwnedSemaphorePermit, Arc<Semaphore>);

async fn connection(
    stream: TcpStream,
    peer: SocketAddr,
    secret: Arc<String>,
    mut stop: watch::Receiver<bool>,
    (_open, authenticating): Slots,
) {
    let _ = stream.set_nodelay(true);
    if let Err(e) = net::keepalive(&stream) {
        tracing::warn!(%peer, error = %e, "cannot turn on TCP keepalive");
    }
    let (r, w) = stream.into_split();
    let (out, out_rx) = mpsc::channel::<FromAgent>(OUT_QUEUE);
    let writer = tokio::spawn(write_loop(w, out_rx));
    let mut reader = LineReader::new(r);
    let refused = match authenticating.try_acquire_owned() {
        Ok(_slot) => handshake(&mut reader, &out, &secret).await.err(),
        Err(_) => Some("too many connections authenticating at once; try again".to_string()),
    };
    if let Some(reason) = refused {
        tracing::warn!(%peer, %reason, "driver connection refused");
        let _ = out.send(FromAgent::Refused { reason }).await;
        drop(out);
        let _ = tokio::time::timeout(Duration::from_secs(1), writer).await;
        return;
    }
    tracing::info!(%peer, "driver connected");
    let mut procs: HashMap<u64, Proc> = HashMap::new();
    let (done_tx, mut done_rx) = mpsc::channel::<u64>(64);
    loop {
        // `next` is cancel safe: a request half received when a process ends is kept.
        tokio::select! {
            line = reader.next(MAX_LINE) => match line {
                Ok(Line::Eof) => { tracing::info!(%peer, "driver disconnected"); break; }
                Err(e) => { tracing::warn!(%peer, error = %e, "driver connection failed"); break; }
                Ok(Line::TooLong(bytes)) => {
                    tracing::warn!(%peer, bytes, "request too long; connection closed");
                    break;
                }
                Ok(Line::Full(buf)) => match decode_line::<ToAgent>(buf) {
                    Ok(req) => request(req, &mut procs, &out, &done_tx).await,
                    Err(e) => {
                        tracing::warn!(%peer, error = %e, "bad request");
                        let _ = out.send(FromAgent::Error { reason: format!("bad request: {e}") }).await;
                    }
                },
            },
            Some(id) = done_rx.recv() => { procs.remove(&id); }
            _ = stop.changed() => break,
        }
    }
    if !procs.is_empty() {
        tracing::info!(%peer, processes = procs.len(), "stopping the processes this driver started");
    }
    stop_all(&mut procs, &mut done_rx).await;
    drop(out);
    // Exits of the stopped processes still go out when the driver is there to read them.
    if tokio::time::timeout(Duration::from_secs(1), writer)
        .await
        .is_err()
    {
        tracing::debug!(%peer, "driver not reading; its last messages were dropped");
    }
}

async fn write_loop(mut w: OwnedWriteHalf, mut rx: mpsc::Receiver<FromAgent>) {
    while let Some(msg) = rx.recv().await {
        let line = match encode_line(&msg) {
            Ok(l) => l,
            Err(e) => {
                tracing::error!(error = %e, "cannot encode a message for the driver");
                continue;
            }
        };
        if w.write_all(&line).await.is_err() {
            return;
        }
    }
}

/// Challenges the driver and answers its challenge; `Err` says why it is refused.
async fn handshake(
    reader: &mut LineReader<OwnedReadHalf>,
    out: &mpsc::Sender<FromAgent>,
    secret: &str,
) -> Result<(), String> {
    let hs = auth::Handshake::new(secret, auth::CONTEXT, auth::Role::Listener)
        .map_err(|e| e.to_string())?;
    out.send(FromAgent::Challenge {
        nonce: hs.nonce().to_hex(),
    })
    .await
    .map_err(|_| "connection closed".to_string())?;
    let line = tokio::time::timeout(AUTH_TIMEOUT, reader.next(AUTH_MAX_LINE))
        .await
        .map_err(|_| format!("no answer to the challenge within {AUTH_TIMEOUT:?}"))?
        .map_err(|e| e.to_string())?;
    let buf = match line {
        Line::Full(buf) => buf,
        Line::Eof => return Err("closed before authenticating".into()),
        Line::TooLong(_) => {
            return Err(format!(
                "a line longer than {AUTH_MAX_LINE} bytes before authentication"
            ));
        }
    };
    let (mac, theirs) = match decode_line::<ToAgent>(buf) {
        Ok(ToAgent::Auth { mac, nonce }) => (mac, nonce),
        Ok(_) => return Err("a request before authentication".into()),
        Err(e) => return Err(format!("bad authentication message: {e}")),
    };
    let theirs = auth::Nonce::from_hex(&theirs).map_err(|e| format!("driver {e}"))?;
    let proof = auth::Tag::from_hex(&mac).map_err(|e| format!("driver {e}"))?;
    if hs.verify(&theirs, &proof).is_err() {
        return Err("wrong secret".into());
    }
    out.send(FromAgent::Welcome {
        mac: hs.proof(&theirs).to_hex(),
    })
    .await
    .map_err(|_| "connection closed".to_string())
}

async fn request(
    req: ToAgent,
    procs: &mut HashMap<u64, Proc>,
    out: &mpsc::Sender<FromAgent>,
    done_tx: &mpsc::Sender<u64>,
) {
    match req {
        ToAgent::Auth { .. } => {
            let _ = out
                .send(FromAgent::Error {
                    reason: "already authenticated".into(),
                })
                .await;
        }
        ToAgent::Start { id, argv, env, cwd } => {
            let reply = match procs.entry(id) {
                Entry::Occupied(_) => FromAgent::StartFailed {
                    id,
                    error: format!("process {id} of this connection is still running"),
                },
                Entry::Vacant(slot) => match start(id, &argv, env, cwd.as_deref(), out, done_tx) {
                    Ok(p) => {
                        let pid = p.pid.unsigned_abs();
                        slot.insert(p);
                        FromAgent::Started { id, pid }
                    }
                    Err(error) => {
                        tracing::warn!(id, %error, "cannot start a process");
                        FromAgent::StartFailed { id, error }
                    }
                },
            };
            // The driver names the process when it asks, so output may precede this reply.
            let _ = out.send(reply).await;
        }
        ToAgent::Stop { id, grace_ms } => match procs.get(&id) {
            Some(p) => stop(id, p, Duration::from_millis(grace_ms)),
            None => tracing::debug!(id, "stop for a process that is not running"),
        },
    }
}

/// SIGTERM to the process group now and SIGKILL after `grace` unless the leader ended by
/// then (SIGKILL at once for no grace). When the leader ends, its task kills the rest of the
/// group, so nothing that ignored the SIGTERM stays behind.
fn stop(id: u64, p: &Proc, grace: Duration) {
    let pid = p.pid;
    if grace.is_zero() {
        tracing::info!(id, pid, "killing process group");
        signal_group(pid, Signal::SIGKILL);
        return;
    }
    tracing::info!(
        id,
        pid,
        grace_ms = grace.as_millis() as u64,
        "stopping process group"
    );
    signal_group(pid, Signal::SIGTERM);
    let mut done = p.done.clone();
    tokio::spawn(async move {
        if tokio::time::timeout(grace, done.wait_for(|d| *d))
            .await
            .is_err()
        {
            tracing::info!(id, pid, "still running after the grace; SIGKILL");
            signal_group(pid, Signal::SIGKILL);
        }
    });
}

fn signal_group(pid: i32, sig: Signal) {
    if let Err(e) = killpg(Pid::from_raw(pid), sig) {
        tracing::debug!(pid, %sig, error = %e, "signalling the process group failed (gone?)");
    }
}

/// Stops every process (SIGTERM, SIGKILL after the grace) and waits until they are reaped.
async fn stop_all(procs: &mut HashMap<u64, Proc>, done_rx: &mut mpsc::Receiver<u64>) {
    for sig in [Signal::SIGTERM, Signal::SIGKILL] {
        if procs.is_empty() {
            return;
        }
        for p in procs.values() {
            signal_group(p.pid, sig);
        }
        let _ = tokio::time::timeout(TERM_GRACE, async {
            while !procs.is_empty() {
                match done_rx.recv().await {
                    Some(id) => {
                        procs.remove(&id);
                    }
                    None => return,
                }
            }
        })
        .await;
    }
}

fn start(
    id: u64,
    argv: &[String],
    env: Vec<(String, String)>,
    cwd: Option<&str>,
    out: &mpsc::Sender<FromAgent>,
    done_tx: &mpsc::Sender<u64>,
) -> Result<Proc, String> {
    let Some(program) = argv.first() else {
        return Err("empty command".into());
    };
    let mut cmd = Command::new(program);
    cmd.args(&argv[1..]);
    for k in PRIVATE_ENV {
        cmd.env_remove(k);
    }
    cmd.envs(env);
    if let Some(dir) = cwd {
        if !std::path::Path::new(dir).is_dir() {
            return Err(format!(
                "working directory {dir} does not exist on this host"
            ));
        }
        cmd.current_dir(dir);
    }
    // Its own process group, so stopping it stops whatever it started too.
    cmd.process_group(0)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let (mut child, pid) = {
        // Registered before the orphan reaper can see it exit, so only its task reaps it.
        let mut own = reaper::children();
        let child = cmd.spawn().map_err(|e| format!("{program}: {e}"))?;
        let pid = child
            .id()
            .and_then(|p| i32::try_from(p).ok())
            .ok_or_else(|| format!("{program}: exited before its pid was known"))?;
        own.insert(pid);
        (child, pid)
    };
    tracing::info!(id, pid, %program, "process started");
    let (done_set, done) = watch::channel(false);
    let mut relays = Vec::new();
    if let Some(o) = child.stdout.take() {
        relays.push(tokio::spawn(relay(
            id,
            Stream::Stdout,
            o,
            out.clone(),
            done.clone(),
        )));
    }
    if let Some(e) = child.stderr.take() {
        relays.push(tokio::spawn(relay(
            id,
            Stream::Stderr,
            e,
            out.clone(),
            done.clone(),
        )));
    }
    let (out, done_tx) = (out.clone(), done_tx.clone());
    tokio::spawn(async move {
        let (code, signal) = match child.wait().await {
            Ok(st) => (st.code(), st.signal()),
            Err(e) => {
                tracing::error!(id, error = %e, "waiting for the process failed");
                (None, None)
            }
        };
        reaper::children().remove(&pid);
        // Whatever it left behind in its group goes with it: a child that ignored SIGTERM, a
        // background job. Nothing would signal that group again (the driver only knows
        // the leader), and it would keep the output pipes open.
        signal_group(pid, Signal::SIGKILL);
        let _ = done_set.send(true);
        tracing::info!(id, pid, ?code, ?signal, "process exited");
        // Every line it wrote goes out before its exit, however long the driver takes to
        // read them: a crash's last lines are the ones that say why.
        for r in relays {
            let _ = r.await;
        }
        let _ = out.send(FromAgent::Exited { id, code, signal }).await;
        let _ = done_tx.send(id).await;
    });
    Ok(Proc { pid, done })
}

/// What one wait of an output relay ended with.
enum Step {
    /// A read returned (0 at the end of the pipe).
    Read(std::io::Result<usize>),
    /// The process exited while the relay was waiting for output.
    Exited,
    /// The pipe stayed open longer than [`DRAIN`] after the exit.
    Drained,
}

/// Sends each line of one pipe of process `id` to the driver, until the pipe closes or,
/// once `exited` is set, until the pipe has kept it waiting for [`DRAIN`] in all.
async fn relay(
    id: u64,
    stream: Stream,
    pipe: impl AsyncRead + Unpin,
    out: mpsc::Sender<FromAgent>,
    mut exited: watch::Receiver<bool>,
) {
    let mut r = BufReader::new(pipe);
    let mut buf = Vec::new();
    let mut draining = *exited.borrow();
    let mut wait_left = DRAIN;
    loop {
        // `read_until` keeps what it read in `buf` when cancelled, so a line cut by the exit
        // or the drain limit is still sent.
        let room = MAX_OUTPUT_LINE.saturating_sub(buf.len()) as u64;
        let mut limited = (&mut r).take(room);
        let read = limited.read_until(b'\n', &mut buf);
        let step = if draining {
            let t = Instant::now();
            let step = match tokio::time::timeout(wait_left, read).await {
                Ok(n) => Step::Read(n),
                Err(_) => Step::Drained,
            };
            wait_left = wait_left.saturating_sub(t.elapsed());
            step
        } else {
            tokio::select! {
                n = read => Step::Read(n),
                _ = exited.wait_for(|d| *d) => Step::Exited,
            }
        };
        let last = match step {
            Step::Exited => {
                draining = true;
                continue;
            }
            Step::Read(Ok(0)) | Step::Read(Err(_)) => true,
            Step::Read(Ok(_)) => false,
            Step::Drained => {
                tracing::debug!(
                    id,
                    ?stream,
                    "output still open after the exit (a process outside its group holds it); \
                     not waiting"
                );
                true
            }
        };
        if !buf.is_empty() {
            if buf.ends_with(b"\n") {
                buf.pop();
            }
            let line = String::from_utf8_lossy(&buf).into_owned();
            buf.clear();
            if out
                .send(FromAgent::Output { id, stream, line })
                .await
                .is_err()
            {
                return; // the connection is gone; its processes are being stopped
            }
        }
        if last {
            return;
        }
    }
}
