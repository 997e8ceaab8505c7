//! The background engine: asynchronous, named allreduces, matched across ranks by name and
//! fused into few large collectives.
//!
//! A training step hands over hundreds of gradients as they become ready, in whatever order
//! its framework produces them; ranks may produce them in different orders. The engine's
//! thread owns the [`Communicator`] and runs in cycles. Each cycle:
//!
//! 1. it takes the ops submitted since the last cycle;
//! 2. every rank tells every other which named ops it has pending (one small allgather);
//! 3. the ops pending on every rank are run in the order rank 0 submitted them, consecutive ops
//!    of one dtype and reduction packed into one fusion buffer of up to `fusion_bytes` and
//!    reduced as one allreduce;
//! 4. an op pending on some ranks only for longer than `stall_timeout` fails on every rank
//!    with a message naming the ranks that never submitted it (a stall, instead of a hang).
//!
//! An op whose ranks disagree on its type, reduction or length fails on every rank, naming
//! both sides. A transport error fails every pending op and leaves the engine broken, as it
//! leaves the communicator; the owner builds a new engine on a new communicator.

use std::any::Any;
use std::collections::{HashMap, HashSet};
use std::sync::{Arc, mpsc};
use std::thread;
use std::time::{Duration, Instant};

use crate::comm::Communicator;
use crate::dtype::{DType, Element, ReduceOp};
use crate::error::{CommError, Result};
use crate::timeline::Timeline;

/// How the engine runs.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// Time between cycles while ops are pending (`HOROVOD_CYCLE_TIME`).
    pub cycle: Duration,
    /// Largest fusion buffer, in bytes; 0 disables fusion (`HOROVOD_FUSION_THRESHOLD`).
    pub fusion_bytes: usize,
    /// How long an op may wait for the other ranks to submit it before it fails.
    pub stall_timeout: Duration,
    /// Where to record every op's phases (`HOROVOD_TIMELINE`).
    pub timeline: Option<Arc<Timeline>>,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            cycle: Duration::from_millis(1),
            fusion_bytes: 128 << 20,
            stall_timeout: Duration::from_secs(60),
            timeline: None,
        }
    }
}

/// A tensor the engine reduces, with its element type erased.
trait Tensor: Send {
    fn dtype(&self) -> DType;
    fn elems(&self) -> usize;
    fn bytes(&self) -> &[u8];
    fn bytes_mut(&mut self) -> &mut [u8];
    fn reduce(&mut self, comm: &mut Communicator, op: ReduceOp) -> Result<()>;
    fn into_any(self: Box<Self>) -> Box<dyn Any + Send>;
    fn as_any_mut(&mut self) -> &mut dyn Any;
}

impl<T: Element> Tensor for Vec<T> {
    fn dtype(&self) -> DType {
        T::DTYPE
    }
    fn elems(&self) -> usize {
        self.len()
    }
    fn bytes(&self) -> &[u8] {
        bytemuck::cast_slice(self)
    }
    fn bytes_mut(&mut self) -> &mut [u8] {
        bytemuck::cast_slice_mut(self)
    }
    fn reduce(&mut self, comm: &mut Communicator, op: ReduceOp) -> Result<()> {
        comm.allreduce(self, op)
    }
    fn into_any(self: Box<Self>) -> Box<dyn Any + Send> {
        self
    }
    fn as_any_mut(&mut self) -> &mut dyn Any {
        self
    }
}

type Reply = mpsc::Sender<Result<Box<dyn Any + Send>>>;

struct Request {
    name: String,
    submitted: Instant,
    op: ReduceOp,
    tensor: Box<dyn Tensor>,
    reply: Reply,
}

/// How a tensor travels between ranks (Horovod's `Compression`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Compression {
    /// As it is.
    #[default]
    None,
    /// As IEEE half precision: half the bytes on the wire, about three significant digits.
    Fp16,
}

type Convert = fn(Box<dyn Any + Send>) -> Option<Box<dyn Any + Send>>;

fn f16_to_f32(any: Box<dyn Any + Send>) -> Option<Box<dyn Any + Send>> {
    let v = any.downcast::<Vec<half::f16>>().ok()?;
    Some(Box::new(v.iter().map(|x| x.to_f32()).collect::<Vec<f32>>()))
}

/// The pending result of an asynchronous op.
#[derive(Debug)]
pub struct Handle<T> {
    rx: mpsc::Receiver<Result<Box<dyn Any + Send>>>,
    name: String,
    done: Option<Result<Vec<T>>>,
    /// Turns what the engine returns into `Vec<T>` (decompression).
    convert: Option<Convert>,
}

impl<T: Element> Handle<T> {
    fn take(
        &mut self,
        msg: std::result::Result<Result<Box<dyn Any + Send>>, ()>,
    ) -> Result<Vec<T>> {
        match msg {
            Ok(Ok(any)) => {
                let any = match self.convert {
                    Some(f) => f(any),
                    None => Some(any),
                };
                any.and_then(|a| a.downcast::<Vec<T>>().ok())
                    .map(|b| *b)
                    .ok_or_else(|| CommError::Broken {
                        cause: format!("op '{}' came back with another element type", self.name),
                    })
            }
            Ok(Err(e)) => Err(e),
            Err(()) => Err(CommError::Broken {
                cause: format!("the engine stopped before op '{}' ran", self.name),
            }),
        }
    }

    /// Whether the op has finished (successfully or not); never blocks.
    pub fn poll(&mut self) -> bool {
        if self.done.is_some() {
            return true;
        }
        match self.rx.try_recv() {
            Ok(m) => {
                let r = self.take(Ok(m));
                self.done = Some(r);
                true
            }
            Err(mpsc::TryRecvError::Empty) => false,
            Err(mpsc::TryRecvError::Disconnected) => {
                let r = self.take(Err(()));
                self.done = Some(r);
                true
            }
        }
    }

    /// Waits for the op and returns the reduced tensor.
    ///
    /// # Errors
    /// The op's error: a mismatch or stall naming the ranks, a transport error, or the engine
    /// having stopped.
    pub fn wait(mut self) -> Result<Vec<T>> {
        if let Some(r) = self.done.take() {
            return r;
        }
        let msg = self.rx.recv().map_err(|_| ());
        self.take(msg)
    }
}

enum Command {
    Op(Request),
    Stop,
}

/// Submits an allreduce on the engine behind `tx`.
fn submit<T: Element>(
    tx: &mpsc::Sender<Command>,
    name: &str,
    tensor: Vec<T>,
    op: ReduceOp,
) -> Handle<T> {
    let (reply, rx) = mpsc::channel();
    let req = Request {
        name: name.to_string(),
        submitted: Instant::now(),
        op,
        tensor: Box::new(tensor),
        reply,
    };
    // A stopped engine drops the request; the handle then reports it.
    let _ = tx.send(Command::Op(req));
    Handle {
        rx,
        name: name.to_string(),
        done: None,
        convert: None,
    }
}

/// Submits ops to an [`Engine`] without owning it.
#[derive(Debug, Clone)]
pub struct Submitter {
    tx: mpsc::Sender<Command>,
}

impl Submitter {
    /// As [`Engine::allreduce_async`].
    pub fn allreduce_async<T: Element>(
        &self,
        name: &str,
        tensor: Vec<T>,
        op: ReduceOp,
    ) -> Handle<T> {
        submit(&self.tx, name, tensor, op)
    }
}

/// The engine: a thread that owns a communicator and runs submitted ops in cycles.
#[derive(Debug)]
pub struct Engine {
    submitter: Submitter,
    thread: Option<thread::JoinHandle<Communicator>>,
}

impl Engine {
    /// Starts the engine's thread on `comm`.
    ///
    /// # Errors
    /// [`CommError::Io`] when the thread can't be started.
    pub fn start(comm: Communicator, cfg: EngineConfig) -> Result<Self> {
        let (tx, rx) = mpsc::channel();
        let thread = thread::Builder::new()
            .name("hvd-engine".into())
            .spawn(move || Worker::new(comm, cfg, rx).run())
            .map_err(|source| CommError::Io {
                context: "starting the engine thread".into(),
                source,
            })?;
        Ok(Self {
            submitter: Submitter { tx },
            thread: Some(thread),
        })
    }

    /// A cloneable way to submit ops to this engine from elsewhere (another thread, a
    /// library wrapper); it fails its ops once the engine stops.
    pub fn submitter(&self) -> Submitter {
        self.submitter.clone()
    }

    /// Submits an allreduce of `tensor` named `name`; every rank must submit an op of that
    /// name (in any order). Names must be unique among pending ops.
    pub fn allreduce_async<T: Element>(
        &self,
        name: &str,
        tensor: Vec<T>,
        op: ReduceOp,
    ) -> Handle<T> {
        self.submitter.allreduce_async(name, tensor, op)
    }
}

impl Engine {
    /// [`Engine::allreduce_async`] of an f32 tensor sent as `compression` says; the result
    /// comes back as f32.
    pub fn allreduce_async_f32(
        &self,
        name: &str,
        tensor: Vec<f32>,
        op: ReduceOp,
        compression: Compression,
    ) -> Handle<f32> {
        match compression {
            Compression::None => self.allreduce_async(name, tensor, op),
            Compression::Fp16 => {
                let halves: Vec<half::f16> =
                    tensor.iter().map(|&x| half::f16::from_f32(x)).collect();
                let h = self.allreduce_async(name, halves, op);
                Handle {
                    rx: h.rx,
                    name: h.name,
                    done: None,
                    convert: Some(f16_to_f32),
                }
            }
        }
    }

    /// Stops the engine once every rank stops (pending ops fail) and returns the communicator.
    pub fn stop(mut self) -> Option<Communicator> {
        let _ = self.submitter.tx.send(Command::Stop);
        self.thread.take().and_then(|t| t.join().ok())
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        let _ = self.submitter.tx.send(Command::Stop);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// What one rank announces in a cycle.
#[derive(Debug, Default, Clone, PartialEq)]
struct Announce {
    stopping: bool,
    /// Rank 0's clock (milliseconds since its engine started); the stall clock of all ranks.
    clock_ms: u64,
    /// (name, dtype, op, elements) of every pending op, in submission order.
    ops: Vec<(String, u8, u8, u64)>,
}

impl Announce {
    fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(16 + self.ops.len() * 32);
        b.push(u8::from(self.stopping));
        b.extend_from_slice(&self.clock_ms.to_le_bytes());
        b.extend_from_slice(&(self.ops.len() as u32).to_le_bytes());
        for (name, dt, op, n) in &self.ops {
            b.extend_from_slice(&(name.len() as u32).to_le_bytes());
            b.extend_from_slice(name.as_bytes());
            b.push(*dt);
            b.push(*op);
            b.extend_from_slice(&n.to_le_bytes());
        }
        b
    }

    /// Decodes one announcement from the front of `b`; returns it and the bytes it used.
    fn decode(b: &[u8]) -> Option<(Self, usize)> {
        let mut at = 0usize;
        let mut take = |n: usize| -> Option<&[u8]> {
            let s = b.get(at..at + n)?;
            at += n;
            Some(s)
        };
        let stopping = take(1)?[0] != 0;
        let clock_ms = u64::from_le_bytes(take(8)?.try_into().ok()?);
        let count = u32::from_le_bytes(take(4)?.try_into().ok()?) as usize;
        let mut ops = Vec::with_capacity(count.min(1 << 16));
        for _ in 0..count {
            let len = u32::from_le_bytes(take(4)?.try_into().ok()?) as usize;
            let name = String::from_utf8(take(len)?.to_vec()).ok()?;
            let dt = take(1)?[0];
            let op = take(1)?[0];
            let n = u64::from_le_bytes(take(8)?.try_into().ok()?);
            ops.push((name, dt, op, n));
        }
        Some((
            Self {
                stopping,
                clock_ms,
                ops,
            },
            at,
        ))
    }
}

struct Worker {
    comm: Communicator,
    cfg: EngineConfig,
    rx: mpsc::Receiver<Command>,
    pending: Vec<Request>,
    started: Instant,
    /// Rank 0's clock when each name was first seen pending on some rank.
    first_seen: HashMap<String, u64>,
    stopping: bool,
    fusion: Vec<u64>,
}

fn tensor_desc(r: &Request) -> (String, u8, u8, u64) {
    (
        r.name.clone(),
        r.tensor.dtype() as u8,
        r.op as u8,
        r.tensor.elems() as u64,
    )
}

impl Worker {
    fn new(comm: Communicator, cfg: EngineConfig, rx: mpsc::Receiver<Command>) -> Self {
        Self {
            comm,
            cfg,
            rx,
            pending: Vec::new(),
            started: Instant::now(),
            first_seen: HashMap::new(),
            stopping: false,
            fusion: Vec::new(),
        }
    }

    fn take(&mut self, c: Command) {
        match c {
            Command::Op(r) => {
                if self.pending.iter().any(|p| p.name == r.name) {
                    let _ = r.reply.send(Err(CommError::InvalidArgument {
                        op: "allreduce_async",
                        detail: format!("an op named '{}' is already pending", r.name),
                    }));
                } else {
                    self.pending.push(r);
                }
            }
            Command::Stop => self.stopping = true,
        }
    }

    fn run(mut self) -> Communicator {
        loop {
            // Every rank cycles whether or not it has work: negotiation is a collective, and a
            // rank that never submits an op must still take part for the stall to be named.
            // What arrives within a cycle is negotiated (and fused) together.
            let until = Instant::now() + self.cfg.cycle;
            while let Some(left) = until.checked_duration_since(Instant::now()) {
                match self.rx.recv_timeout(left) {
                    Ok(c) => self.take(c),
                    Err(mpsc::RecvTimeoutError::Timeout) => break,
                    Err(mpsc::RecvTimeoutError::Disconnected) => {
                        self.stopping = true;
                        break;
                    }
                }
            }
            match self.cycle() {
                Ok(true) => {}
                Ok(false) => break,
                Err(e) => {
                    let msg = e.to_string();
                    for r in self.pending.drain(..) {
                        let _ = r.reply.send(Err(CommError::Broken { cause: msg.clone() }));
                    }
                    // The communicator is broken; later submissions fail at once.
                    self.drain_broken(&msg);
                    break;
                }
            }
        }
        for r in self.pending.drain(..) {
            let _ = r.reply.send(Err(CommError::Broken {
                cause: "the engine stopped".into(),
            }));
        }
        self.comm
    }

    fn drain_broken(&mut self, msg: &str) {
        if self.stopping {
            return;
        }
        while let Ok(c) = self.rx.recv() {
            match c {
                Command::Op(r) => {
                    let _ = r.reply.send(Err(CommError::Broken {
                        cause: msg.to_string(),
                    }));
                }
                Command::Stop => return,
            }
        }
    }

    /// One negotiation and the ops it agrees on; `Ok(false)` once every rank stops.
    fn cycle(&mut self) -> Result<bool> {
        let n = self.comm.size();
        let mine = Announce {
            stopping: self.stopping,
            clock_ms: self.started.elapsed().as_millis() as u64,
            ops: self.pending.iter().map(tensor_desc).collect(),
        };
        let t_cycle = Instant::now();
        let gathered = self.gather(&mine)?;
        if let Some(t) = self.cfg.timeline.as_ref().filter(|t| t.mark_cycles) {
            t.instant("engine", "CYCLE", t_cycle, "");
        }
        if gathered.iter().any(|a| a.stopping) {
            let who: Vec<usize> = (0..n).filter(|&r| gathered[r].stopping).collect();
            let cause = format!("the engine stopped on ranks {who:?}");
            for r in self.pending.drain(..) {
                let _ = r.reply.send(Err(CommError::Broken {
                    cause: cause.clone(),
                }));
            }
            return Ok(false);
        }
        let clock = gathered[0].clock_ms;
        let sets: Vec<HashMap<&str, (u8, u8, u64)>> = gathered
            .iter()
            .map(|a| {
                a.ops
                    .iter()
                    .map(|(nm, d, o, c)| (nm.as_str(), (*d, *o, *c)))
                    .collect()
            })
            .collect();
        // Ready everywhere, in rank 0's order; the same list on every rank.
        let mut ready: Vec<String> = Vec::new();
        let mut failed: Vec<(String, CommError)> = Vec::new();
        for (name, d, o, c) in &gathered[0].ops {
            if !sets.iter().all(|s| s.contains_key(name.as_str())) {
                continue;
            }
            match (1..n).find(|&r| sets[r][name.as_str()] != (*d, *o, *c)) {
                None => ready.push(name.clone()),
                Some(r) => {
                    let (d2, o2, c2) = sets[r][name.as_str()];
                    let show = |d: u8, o: u8, c: u64| {
                        format!(
                            "allreduce '{name}' of {c} {} ({:?})",
                            DType::from_tag(d).map_or("?", DType::name),
                            ReduceOp::from_tag(o)
                        )
                    };
                    failed.push((
                        name.clone(),
                        CommError::Mismatch {
                            seq: 0,
                            rank_a: 0,
                            desc_a: show(*d, *o, *c),
                            rank_b: r,
                            desc_b: show(d2, o2, c2),
                        },
                    ));
                }
            }
        }
        // Stalls: pending somewhere, not everywhere, for too long (on rank 0's clock).
        let mut seen_now: HashSet<&str> = HashSet::new();
        for s in &sets {
            for name in s.keys() {
                if !sets.iter().all(|t| t.contains_key(name)) {
                    seen_now.insert(name);
                }
            }
        }
        self.first_seen.retain(|k, _| seen_now.contains(k.as_str()));
        let mut stalled: Vec<&str> = Vec::new();
        for name in &seen_now {
            let first = *self.first_seen.entry((*name).to_string()).or_insert(clock);
            if clock.saturating_sub(first) >= self.cfg.stall_timeout.as_millis() as u64 {
                stalled.push(name);
            }
        }
        stalled.sort_unstable();
        for name in stalled {
            let have: Vec<usize> = (0..n).filter(|&r| sets[r].contains_key(name)).collect();
            let missing: Vec<usize> = (0..n).filter(|&r| !sets[r].contains_key(name)).collect();
            failed.push((
                name.to_string(),
                CommError::InvalidArgument {
                    op: "allreduce_async",
                    detail: format!(
                        "op '{name}' was submitted by ranks {have:?} but not by ranks {missing:?} \
                         within {:?} (stalled)",
                        self.cfg.stall_timeout
                    ),
                },
            ));
            self.first_seen.remove(name);
        }
        for (name, e) in failed {
            if let Some(i) = self.pending.iter().position(|r| r.name == name) {
                let r = self.pending.remove(i);
                let _ = r.reply.send(Err(e));
            }
        }
        if let Some(t) = &self.cfg.timeline {
            let now = Instant::now();
            for r in self.pending.iter().filter(|r| ready.contains(&r.name)) {
                t.span(&r.name, "NEGOTIATE_ALLREDUCE", r.submitted, now, "");
            }
        }
        self.run_ready(&ready)?;
        Ok(true)
    }

    fn gather(&mut self, mine: &Announce) -> Result<Vec<Announce>> {
        let n = self.comm.size();
        let all = self.comm.allgather(&mine.encode(), 1)?;
        let mut out = Vec::with_capacity(n);
        let mut at = 0usize;
        for r in 0..n {
            let (a, used) =
                all.get(at..)
                    .and_then(Announce::decode)
                    .ok_or_else(|| CommError::Protocol {
                        rank: r,
                        detail: "malformed engine announcement".into(),
                    })?;
            out.push(a);
            at += used;
        }
        Ok(out)
    }

    /// Runs the agreed ops in order, fusing runs of one dtype and reduction.
    fn run_ready(&mut self, ready: &[String]) -> Result<()> {
        let mut batch: Vec<Request> = Vec::new();
        for name in ready {
            let Some(i) = self.pending.iter().position(|r| &r.name == name) else {
                continue;
            };
            let r = self.pending.remove(i);
            let fits = batch.first().is_none_or(|b| {
                b.tensor.dtype() == r.tensor.dtype()
                    && b.op == r.op
                    && batch.iter().map(|x| x.tensor.bytes().len()).sum::<usize>()
                        + r.tensor.bytes().len()
                        <= self.cfg.fusion_bytes
            });
            if !fits {
                self.reduce_batch(std::mem::take(&mut batch))?;
            }
            batch.push(r);
        }
        if !batch.is_empty() {
            self.reduce_batch(batch)?;
        }
        Ok(())
    }

    /// Records one phase of every op of a batch on the timeline.
    fn trace(&self, batch: &[Request], phase: &str, start: Instant) {
        if let Some(t) = &self.cfg.timeline {
            let end = Instant::now();
            let args = format!("\"fused\":{}", batch.len());
            for r in batch {
                t.span(&r.name, phase, start, end, &args);
            }
        }
    }

    fn reduce_batch(&mut self, mut batch: Vec<Request>) -> Result<()> {
        let op = batch[0].op;
        let start = Instant::now();
        if batch.len() == 1 {
            batch[0].tensor.reduce(&mut self.comm, op)?;
            self.trace(&batch, "ALLREDUCE", start);
            let r = batch.remove(0);
            let _ = r.reply.send(Ok(r.tensor.into_any()));
            return Ok(());
        }
        let dtype = batch[0].tensor.dtype();
        if self.comm.cma.is_some() {
            // Ranks of one host reduce the tensors where they lie: no fusion copy.
            group_in_place(&mut self.comm, dtype, op, &mut batch)?;
            self.trace(&batch, "ALLREDUCE_FUSED_IN_PLACE", start);
            for r in batch {
                let _ = r.reply.send(Ok(r.tensor.into_any()));
            }
            return Ok(());
        }
        let total: usize = batch.iter().map(|r| r.tensor.bytes().len()).sum();
        self.fusion.resize(total.div_ceil(8), 0);
        {
            let buf: &mut [u8] = bytemuck::cast_slice_mut(&mut self.fusion[..]);
            let mut at = 0;
            for r in &batch {
                let b = r.tensor.bytes();
                buf[at..at + b.len()].copy_from_slice(b);
                at += b.len();
            }
        }
        self.trace(&batch, "MEMCPY_IN_FUSION_BUFFER", start);
        let start = Instant::now();
        reduce_bytes(&mut self.comm, dtype, op, &mut self.fusion, total)?;
        self.trace(&batch, "ALLREDUCE", start);
        let start = Instant::now();
        let buf: &[u8] = bytemuck::cast_slice(&self.fusion[..]);
        let mut at = 0;
        for r in &mut batch {
            let b = r.tensor.bytes_mut();
            let len = b.len();
            b.copy_from_slice(&buf[at..at + len]);
            at += len;
        }
        self.trace(&batch, "MEMCPY_OUT_FUSION_BUFFER", start);
        for r in batch {
            let _ = r.reply.send(Ok(r.tensor.into_any()));
        }
        Ok(())
    }
}

/// Calls the generic `f::<T>(args)` for the element type `T` of a runtime `DType`.
macro_rules! by_dtype {
    ($dtype:expr, $f:ident($($arg:expr),*)) => {
        match $dtype {
            DType::U8 => $f::<u8>($($arg),*),
            DType::I32 => $f::<i32>($($arg),*),
            DType::I64 => $f::<i64>($($arg),*),
            DType::F16 => $f::<half::f16>($($arg),*),
            DType::BF16 => $f::<half::bf16>($($arg),*),
            DType::F32 => $f::<f32>($($arg),*),
            DType::F64 => $f::<f64>($($arg),*),
        }
    };
}

/// Allreduces a batch of tensors of one `dtype` as one grouped allreduce on their own memory.
fn group_in_place(
    comm: &mut Communicator,
    dtype: DType,
    op: ReduceOp,
    batch: &mut [Request],
) -> Result<()> {
    fn typed<T: Element>(
        comm: &mut Communicator,
        op: ReduceOp,
        batch: &mut [Request],
    ) -> Result<()> {
        let mut slices: Vec<&mut [T]> = batch
            .iter_mut()
            .filter_map(|r| r.tensor.as_any_mut().downcast_mut::<Vec<T>>())
            .map(Vec::as_mut_slice)
            .collect();
        comm.grouped_allreduce(&mut slices, op)
    }
    by_dtype!(dtype, typed(comm, op, batch))
}

/// Allreduces the first `bytes` of an 8-byte-aligned buffer as elements of `dtype`.
fn reduce_bytes(
    comm: &mut Communicator,
    dtype: DType,
    op: ReduceOp,
    buf: &mut [u64],
    bytes: usize,
) -> Result<()> {
    fn typed<T: Element>(comm: &mut Communicator, op: ReduceOp, raw: &mut [u8]) -> Result<()> {
        comm.allreduce(bytemuck::cast_slice_mut::<u8, T>(raw), op)
    }
    let raw = &mut bytemuck::cast_slice_mut::<u64, u8>(buf)[..bytes];
    by_dtype!(dtype, typed(comm, op, raw))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn announcements_round_trip() {
        let a = Announce {
            stopping: true,
            clock_ms: 42,
            ops: vec![("grad/0".into(), 6, 1, 1000), ("é".into(), 1, 3, 0)],
        };
        let b = a.encode();
        assert_eq!(Announce::decode(&b), Some((a.clone(), b.len())));
        assert_eq!(Announce::decode(&a.encode()[..5]), None);
    }

    #[test]
    fn a_world_of_one_reduces_at_once() {
        let e = Engine::start(Communicator::single(), EngineConfig::default()).unwrap();
        let h = e.allreduce_async("x", vec![1.0f32, 2.0], ReduceOp::Sum);
        assert_eq!(h.wait().unwrap(), vec![1.0, 2.0]);
        assert!(e.stop().is_some());
    }
}
