//! The background engine: asynchronous, named collectives, matched across ranks by name, with
//! allreduces fused into few large ones.
//!
//! A training step hands over hundreds of gradients as they become ready, in whatever order
//! its framework produces them; ranks may produce them in different orders. The engine's
//! thread owns the [`Communicator`] and runs in cycles. Each cycle:
//!
//! 1. it takes the ops submitted since the last cycle;
//! 2. every rank tells every other which named ops it has pending (one small allgather);
//! 3. the ops pending on every rank are run in the order rank 0 submitted them, consecutive
//!    allreduces of one dtype and reduction packed into one fusion buffer of up to
//!    `fusion_bytes` and reduced as one (the other collectives run one by one);
//! 4. the stall check: an op pending on some ranks only for longer than `stall_warning` is
//!    logged (by rank 0) naming the ranks that have not submitted it, again every
//!    `stall_warning` while it waits; past `stall_shutdown` (when set) it fails on every rank
//!    with a message naming those ranks (a stall, instead of a hang).
//!
//! With autotune, rank 0 scores each setting of the knobs by the bytes the cycles move per
//! second of engine time and announces the next setting in its announcement; every rank
//! applies it at that same cycle (see [`crate::autotune`]).
//!
//! An op seen before is announced by a 4-byte id from a response cache of `cache_capacity`
//! entries instead of its name and shape; every rank's cache holds the same entries, because
//! each is filled and evicted from the list of agreed ops, which is the same on every rank.
//!
//! An op whose ranks disagree on its collective, type, reduction, root or length fails on every
//! rank, naming both sides; so does a collective's own argument check (an alltoall's splits). A transport error fails every pending op and leaves the engine broken, as it
//! leaves the communicator; the owner builds a new engine on a new communicator.

use std::any::Any;
use std::sync::{Arc, Mutex, mpsc};
use std::thread;
use std::time::{Duration, Instant};

use crate::autotune::{AutotuneConfig, Setting, Tuned, Tuner};
use crate::comm::Communicator;
use crate::dtype::{DType, Element, ReduceOp, by_dtype};
use crate::error::{CommError, Result};
use crate::fusion::{self, Batch, FusionBuffer};
use crate::lateness::Lateness;
use crate::negotiation::{self, Announce, Cache, Sig};
use crate::stall::StallCheck;
use crate::timeline::Timeline;
use crate::wire::Kind;

/// How the engine runs.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// Time between cycles while ops are pending (`HOROVOD_CYCLE_TIME`).
    pub cycle: Duration,
    /// Largest fusion buffer, in bytes; 0 disables fusion (`HOROVOD_FUSION_THRESHOLD`).
    pub fusion_bytes: usize,
    /// How long an op may wait for the other ranks to submit it before the stall check logs
    /// a warning naming them, repeated every as long while it waits
    /// (`HOROVOD_STALL_CHECK_TIME_SECONDS`).
    pub stall_warning: Duration,
    /// How long an op may wait before it fails on every rank as stalled; zero (the default),
    /// or a time below `stall_warning`, never fails it
    /// (`HOROVOD_STALL_SHUTDOWN_TIME_SECONDS`).
    pub stall_shutdown: Duration,
    /// Whether the stall check runs at all (`HOROVOD_STALL_CHECK_DISABLE=1` turns it off).
    pub stall_check: bool,
    /// Where to record every op's phases (`HOROVOD_TIMELINE`).
    pub timeline: Option<Arc<Timeline>>,
    /// Ops whose announcement each rank remembers, announced after by a short id; 0 announces
    /// every op in full (`HOROVOD_CACHE_CAPACITY`).
    pub cache_capacity: usize,
    /// Tune fusion threshold, cycle time, response cache and hierarchical collectives on the
    /// running job (`HOROVOD_AUTOTUNE`); rank 0's setting is the one that counts.
    pub autotune: Option<AutotuneConfig>,
    /// The core the engine's thread runs on (`HOROVOD_THREAD_AFFINITY`).
    pub thread_affinity: Option<usize>,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            cycle: Duration::from_millis(1),
            fusion_bytes: 128 << 20,
            stall_warning: Duration::from_secs(60),
            stall_shutdown: Duration::ZERO,
            stall_check: true,
            timeline: None,
            cache_capacity: 1024,
            autotune: None,
            thread_affinity: None,
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
    /// Runs `coll` alone; returns what the handle gets.
    fn run(self: Box<Self>, comm: &mut Communicator, coll: &Coll) -> Result<Box<dyn Any + Send>>;
    fn into_any(self: Box<Self>) -> Box<dyn Any + Send>;
}

/// Storage the engine reduces in place and hands back through the op's [`Handle`]: a `Vec<T>`,
/// or a [`crate::HugeBuffer<T>`], whose huge pages same-host transfers copy fastest.
pub trait Buffer: std::ops::DerefMut<Target = [Self::Elem]> + Send + 'static {
    /// The element type.
    type Elem: Element;
}

impl<T: Element> Buffer for Vec<T> {
    type Elem = T;
}

impl<T: Element> Buffer for crate::HugeBuffer<T> {
    type Elem = T;
}

impl<B: Buffer> Tensor for B {
    fn dtype(&self) -> DType {
        B::Elem::DTYPE
    }
    fn elems(&self) -> usize {
        self.len()
    }
    fn bytes(&self) -> &[u8] {
        bytemuck::cast_slice(&self[..])
    }
    fn bytes_mut(&mut self) -> &mut [u8] {
        bytemuck::cast_slice_mut(&mut self[..])
    }
    fn reduce(&mut self, comm: &mut Communicator, op: ReduceOp) -> Result<()> {
        comm.allreduce(&mut self[..], op)
    }
    fn run(
        mut self: Box<Self>,
        comm: &mut Communicator,
        coll: &Coll,
    ) -> Result<Box<dyn Any + Send>> {
        Ok(match coll {
            Coll::Allreduce(op) => {
                comm.allreduce(&mut self[..], *op)?;
                self
            }
            Coll::Reducescatter(op) => Box::new(comm.reducescatter(&self[..], *op)?),
            Coll::Broadcast(root) => {
                comm.broadcast(&mut self[..], *root)?;
                self
            }
            Coll::Allgather(row_len) => Box::new(comm.allgather(&self[..], *row_len)?),
            Coll::Alltoall(splits) => Box::new(comm.alltoall(&self[..], splits)?),
        })
    }
    fn into_any(self: Box<Self>) -> Box<dyn Any + Send> {
        self
    }
}

/// An op's result as the engine hands it over: the tensor, of its own type.
type Outcome = Result<Box<dyn Any + Send>>;

/// What the engine gives an op's result to.
enum Reply {
    /// The channel a [`Handle`] waits on.
    Channel(mpsc::Sender<Outcome>),
    /// A function the engine's thread calls with the result ([`Submitter::allreduce_then`]).
    Call(Box<dyn FnOnce(Outcome) + Send>),
}

impl Reply {
    /// Hands `result` over; a handle that was dropped meanwhile is no error.
    fn send(self, result: Outcome) {
        match self {
            Self::Channel(tx) => {
                let _ = tx.send(result);
            }
            Self::Call(f) => f(result),
        }
    }
}

impl std::fmt::Debug for Reply {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Channel(_) => "Reply::Channel",
            Self::Call(_) => "Reply::Call",
        })
    }
}

/// The collective an op runs, with its parameters.
#[derive(Debug, Clone, PartialEq)]
enum Coll {
    Allreduce(ReduceOp),
    Reducescatter(ReduceOp),
    Broadcast(usize),
    Allgather(usize),
    Alltoall(Vec<usize>),
}

impl Coll {
    /// The collective, as the wire and the negotiation name it.
    fn kind(&self) -> Kind {
        match self {
            Self::Allreduce(_) => Kind::Allreduce,
            Self::Reducescatter(_) => Kind::Reducescatter,
            Self::Broadcast(_) => Kind::Broadcast,
            Self::Allgather(_) => Kind::Allgather,
            Self::Alltoall(_) => Kind::Alltoall,
        }
    }

    fn name(&self) -> &'static str {
        self.kind().name()
    }

    /// The collective's parameter as announced (reduction, root or row length); ranks must
    /// agree on it.
    fn param(&self) -> u64 {
        match self {
            Self::Allreduce(op) | Self::Reducescatter(op) => *op as u64,
            Self::Broadcast(root) => *root as u64,
            Self::Allgather(row_len) => *row_len as u64,
            Self::Alltoall(_) => 0,
        }
    }
}

struct Request {
    name: String,
    submitted: Instant,
    coll: Coll,
    tensor: Box<dyn Tensor>,
    reply: Reply,
}

impl Request {
    /// The op's reduction when it is an allreduce (the only ops that fuse).
    fn allreduce_op(&self) -> Option<ReduceOp> {
        match self.coll {
            Coll::Allreduce(op) => Some(op),
            _ => None,
        }
    }

    fn sig(&self) -> Sig {
        let kind = self.coll.kind();
        // Allgather and alltoall contributions differ in length from rank to rank.
        let count = if kind.count_is_per_rank() {
            0
        } else {
            self.tensor.elems() as u64
        };
        Sig {
            name: self.name.clone(),
            dtype: self.tensor.dtype(),
            kind,
            param: self.coll.param(),
            count,
        }
    }
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
///
/// `R` is what the op gives back: the tensor for most collectives, the tensor and the counts
/// received from each rank for an alltoall.
#[derive(Debug)]
pub struct Handle<T, R = Vec<T>> {
    rx: mpsc::Receiver<Result<Box<dyn Any + Send>>>,
    name: String,
    done: Option<Result<R>>,
    /// Turns what the engine returns into `R` (decompression).
    convert: Option<Convert>,
    _elem: std::marker::PhantomData<fn() -> T>,
}

impl<T: Element, R: 'static> Handle<T, R> {
    fn new(rx: mpsc::Receiver<Result<Box<dyn Any + Send>>>, name: &str) -> Self {
        Self {
            rx,
            name: name.to_string(),
            done: None,
            convert: None,
            _elem: std::marker::PhantomData,
        }
    }

    fn take(&mut self, msg: std::result::Result<Result<Box<dyn Any + Send>>, ()>) -> Result<R> {
        match msg {
            Ok(Ok(any)) => {
                let any = match self.convert {
                    Some(f) => f(any),
                    None => Some(any),
                };
                any.and_then(|a| a.downcast::<R>().ok())
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

    /// Waits for the op and returns its result.
    ///
    /// # Errors
    /// The op's error: a mismatch or stall naming the ranks, a transport error, or the engine
    /// having stopped.
    pub fn wait(mut self) -> Result<R> {
        if let Some(r) = self.done.take() {
            return r;
        }
        let msg = self.rx.recv().map_err(|_| ());
        self.take(msg)
    }
}

enum Command {
    Op(Request),
    /// This rank has no more ops of its own (Horovod's `join`): the reply is the rank that
    /// joined last, once every rank has.
    Join(mpsc::Sender<Result<usize>>),
    Stop,
}

/// Submits `coll` of `tensor` on the engine behind `tx`.
fn submit<B: Buffer, R: 'static>(
    tx: &mpsc::Sender<Command>,
    name: &str,
    tensor: B,
    coll: Coll,
) -> Handle<B::Elem, R> {
    let (reply, rx) = mpsc::channel();
    send_request(tx, name, Box::new(tensor), coll, Reply::Channel(reply));
    Handle::new(rx, name)
}

/// Queues a request on the engine behind `tx`. A stopped engine has dropped its receiver:
/// the reply then gets that error at once.
fn send_request(
    tx: &mpsc::Sender<Command>,
    name: &str,
    tensor: Box<dyn Tensor>,
    coll: Coll,
    reply: Reply,
) {
    let req = Request {
        name: name.to_string(),
        submitted: Instant::now(),
        coll,
        tensor,
        reply,
    };
    if let Err(mpsc::SendError(Command::Op(req))) = tx.send(Command::Op(req)) {
        req.reply.send(Err(CommError::Broken {
            cause: format!("the engine stopped before op '{name}' ran"),
        }));
    }
}

/// Submits ops to an [`Engine`] without owning it.
#[derive(Debug, Clone)]
pub struct Submitter {
    tx: mpsc::Sender<Command>,
}

impl Submitter {
    /// Submits an allreduce of `tensor` named `name`; every rank must submit an op of that
    /// name (in any order). Names must be unique among pending ops. The handle gives the
    /// tensor back, reduced: a `Vec<T>`, or a [`crate::HugeBuffer<T>`].
    pub fn allreduce_async<B: Buffer>(
        &self,
        name: &str,
        tensor: B,
        op: ReduceOp,
    ) -> Handle<B::Elem, B> {
        submit(&self.tx, name, tensor, Coll::Allreduce(op))
    }

    /// Submits an allreduce as [`Submitter::allreduce_async`] does, and calls `then` with the
    /// reduced tensor or the op's error when it completes. `then` runs on the engine's thread,
    /// before the engine goes on: it should hand the result over and return (a compiled
    /// framework op's completion callback, which schedules the ops waiting for it).
    pub fn allreduce_then<B: Buffer>(
        &self,
        name: &str,
        tensor: B,
        op: ReduceOp,
        then: impl FnOnce(Result<B>) + Send + 'static,
    ) {
        let call = move |r: Result<Box<dyn Any + Send>>| {
            then(r.and_then(|any| {
                any.downcast::<B>()
                    .map(|b| *b)
                    .map_err(|_| CommError::Broken {
                        cause: "an allreduce came back with another element type".into(),
                    })
            }));
        };
        send_request(
            &self.tx,
            name,
            Box::new(tensor),
            Coll::Allreduce(op),
            Reply::Call(Box::new(call)),
        );
    }

    /// Submits a reducescatter: the handle gives this rank's block of the reduced tensor
    /// (see [`Communicator::reducescatter`]).
    pub fn reducescatter_async<T: Element>(
        &self,
        name: &str,
        tensor: Vec<T>,
        op: ReduceOp,
    ) -> Handle<T> {
        submit(&self.tx, name, tensor, Coll::Reducescatter(op))
    }

    /// Submits a broadcast of `tensor` from rank `root`; every rank passes a tensor of the
    /// same length and gets the root's.
    pub fn broadcast_async<B: Buffer>(
        &self,
        name: &str,
        tensor: B,
        root: usize,
    ) -> Handle<B::Elem, B> {
        submit(&self.tx, name, tensor, Coll::Broadcast(root))
    }

    /// Submits an allgather of rows of `row_len` elements (see [`Communicator::allgather`]);
    /// ranks may contribute different numbers of rows.
    pub fn allgather_async<T: Element>(
        &self,
        name: &str,
        tensor: Vec<T>,
        row_len: usize,
    ) -> Handle<T> {
        submit(&self.tx, name, tensor, Coll::Allgather(row_len))
    }

    /// Submits an alltoall: `splits[p]` elements go to rank `p`; the handle gives what
    /// arrived and how many elements came from each rank.
    pub fn alltoall_async<T: Element>(
        &self,
        name: &str,
        tensor: Vec<T>,
        splits: Vec<usize>,
    ) -> Handle<T, (Vec<T>, Vec<usize>)> {
        submit(&self.tx, name, tensor, Coll::Alltoall(splits))
    }
}

/// The engine: a thread that owns a communicator and runs submitted ops in cycles.
#[derive(Debug)]
pub struct Engine {
    submitter: Submitter,
    thread: Option<thread::JoinHandle<Communicator>>,
    status: Arc<Mutex<EngineStatus>>,
}

/// Reads an engine's status from another thread ([`Engine::status_reader`]).
#[derive(Debug, Clone)]
pub struct StatusReader(Arc<Mutex<EngineStatus>>);

impl StatusReader {
    /// How much each rank holds the others up, as [`EngineStatus::lateness`].
    pub fn lateness(&self) -> Vec<f64> {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .lateness
            .clone()
    }
}

/// What an engine is doing, as its owner may ask ([`Engine::status`]).
#[derive(Debug, Clone, PartialEq)]
pub struct EngineStatus {
    /// The knobs in force (the same on every rank, switched at the same cycle).
    pub setting: Setting,
    /// Whether autotune is still trying settings.
    pub autotuning: bool,
    /// Stall warnings so far: one per stalled op each warning period.
    pub stall_warnings: u64,
    /// By rank, the fraction of the time (0 to 1) the median rank waits for it at the
    /// collectives, over about the last [`crate::LATENESS_WINDOW`] (the same on every rank): a
    /// rank with fraction `f` computes `1 / (1 - f)` times as long as the median rank.
    pub lateness: Vec<f64>,
    /// What autotune settled on, once it has (on every rank): kept by the process for the
    /// engines of later rounds ([`crate::AutotuneConfig::resume`]).
    pub tuned: Option<Tuned>,
}

/// Pins the calling thread to `core`.
fn pin_to(core: usize) -> nix::Result<()> {
    let mut set = nix::sched::CpuSet::new();
    set.set(core)?;
    nix::sched::sched_setaffinity(nix::unistd::Pid::from_raw(0), &set)
}

/// Checks that this process may run on `core` (before the engine's thread is pinned to it).
fn check_core(core: usize) -> Result<()> {
    let allowed = nix::sched::sched_getaffinity(nix::unistd::Pid::from_raw(0))
        .and_then(|set| set.is_set(core));
    match allowed {
        Ok(true) => Ok(()),
        Ok(false) | Err(_) => Err(CommError::InvalidArgument {
            op: "engine",
            detail: format!(
                "thread affinity: core {core} is not among the cores this process may run on"
            ),
        }),
    }
}

impl Engine {
    /// Starts the engine's thread on `comm`.
    ///
    /// # Errors
    /// [`CommError::Io`] when the thread can't be started.
    pub fn start(comm: Communicator, cfg: EngineConfig) -> Result<Self> {
        if let Some(core) = cfg.thread_affinity {
            check_core(core)?;
        }
        let (tx, rx) = mpsc::channel();
        let worker = Worker::new(comm, cfg, rx);
        let status = Arc::clone(&worker.status);
        let thread = thread::Builder::new()
            .name("hvd-engine".into())
            .spawn(move || {
                if let Some(core) = worker.cfg.thread_affinity {
                    match pin_to(core) {
                        Ok(()) => tracing::debug!(core, "engine thread pinned"),
                        Err(e) => tracing::warn!(core, error = %e, "cannot pin the engine thread"),
                    }
                }
                worker.run()
            })
            .map_err(|source| CommError::Io {
                context: "starting the engine thread".into(),
                source,
            })?;
        Ok(Self {
            submitter: Submitter { tx },
            thread: Some(thread),
            status,
        })
    }

    /// A reader of this engine's status for another thread (a report to the driver), valid
    /// while the engine runs and after.
    pub fn status_reader(&self) -> StatusReader {
        StatusReader(Arc::clone(&self.status))
    }

    /// The knobs in force, whether autotune is still at work, and the stall warnings so far.
    pub fn status(&self) -> EngineStatus {
        self.status
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    /// A cloneable way to submit ops to this engine from elsewhere (another thread, a
    /// library wrapper); it fails its ops once the engine stops.
    pub fn submitter(&self) -> Submitter {
        self.submitter.clone()
    }
}

/// The engine takes ops as its [`Submitter`] does.
impl std::ops::Deref for Engine {
    type Target = Submitter;
    fn deref(&self) -> &Submitter {
        &self.submitter
    }
}

impl Submitter {
    /// Declares that this rank has no more ops to submit (Horovod's `join`) and waits until
    /// every rank has: until then this rank takes part in the others' allreduces with zeros.
    /// Returns the rank that joined last. Other collectives submitted while a rank is joined
    /// fail with an error naming it (as in Horovod, only allreduce can run then).
    ///
    /// # Errors
    /// [`CommError::InvalidArgument`] when this rank has already joined;
    /// [`CommError::Broken`] when the engine stops or fails first.
    pub fn join(&self) -> Result<usize> {
        let (reply, rx) = mpsc::channel();
        let gone = || CommError::Broken {
            cause: "the engine stopped".into(),
        };
        self.tx.send(Command::Join(reply)).map_err(|_| gone())?;
        rx.recv().map_err(|_| gone())?
    }

    /// [`Submitter::allreduce_async`] of an f32 tensor sent as `compression` says; the result
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
                let mut out = Handle::new(h.rx, name);
                out.convert = Some(f16_to_f32);
                out
            }
        }
    }
}

impl Engine {
    /// Stops the engine once every rank stops (pending ops fail) and returns the communicator.
    pub fn stop(self) -> Option<Communicator> {
        self.stop_with_status().0
    }

    /// [`Engine::stop`], also returning the engine's last status (read once its thread has
    /// ended, so that a setting autotune applied in its last cycles is in it).
    pub fn stop_with_status(mut self) -> (Option<Communicator>, EngineStatus) {
        let _ = self.submitter.tx.send(Command::Stop);
        let comm = self.thread.take().and_then(|t| t.join().ok());
        (comm, self.status())
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

struct Worker {
    comm: Communicator,
    cfg: EngineConfig,
    rx: mpsc::Receiver<Command>,
    pending: Vec<Request>,
    started: Instant,
    /// Ops pending on some ranks only, and for how long.
    stalls: StallCheck,
    lateness: Lateness,
    /// How long this rank's last negotiation waited for the others, in microseconds.
    waited_us: u32,
    stopping: bool,
    fusion: FusionBuffer,
    cache: Cache,
    /// When this cycle's ops were agreed; they queue from then until each runs.
    agreed: Instant,
    /// This rank's pending join, answered once every rank has joined.
    join: Option<mpsc::Sender<Result<usize>>>,
    /// Which ranks had joined as of the last cycle, and the one that joined last.
    joined: Vec<bool>,
    last_joined: usize,
    /// Rank 0's autotune, and the setting it wants announced next.
    tuner: Option<Tuner>,
    proposed: Option<(Setting, bool)>,
    /// When the last step (a cycle that ran ops) ended: a step's engine time starts then, or
    /// when its first op was submitted, whichever is later.
    last_step: Instant,
    /// The response cache's capacity when autotune turns it on.
    cache_on: usize,
    /// What [`Engine::status`] reports.
    status: Arc<Mutex<EngineStatus>>,
}

impl Worker {
    fn new(mut comm: Communicator, cfg: EngineConfig, rx: mpsc::Receiver<Command>) -> Self {
        comm.set_background(true);
        let setting = Setting {
            fusion_bytes: cfg.fusion_bytes,
            cycle: cfg.cycle,
            cache: cfg.cache_capacity > 0,
            hierarchical_allreduce: comm.is_hierarchical(),
            hierarchical_allgather: comm.is_hierarchical_allgather(),
        };
        // Rank 0 tunes; the others follow its announcements. An engine built for a new
        // membership keeps what this process tuned before on a world of the same shape, and
        // tunes from it on another shape.
        let (tuner, proposed) = match cfg.autotune.clone() {
            Some(mut a) if comm.rank() == 0 && comm.size() > 1 => {
                let (allreduce, allgather) = comm.hierarchy_refused();
                a.held.hierarchical_allreduce |= allreduce;
                a.held.hierarchical_allgather |= allgather;
                let shape = (comm.size(), comm.hosts(), comm.can_run_hierarchically());
                Self::resume(a, setting, shape)
            }
            _ => (None, None),
        };
        let status = EngineStatus {
            setting,
            autotuning: cfg.autotune.is_some() && comm.size() > 1,
            stall_warnings: 0,
            lateness: Vec::new(),
            tuned: None,
        };
        Self {
            tuner,
            proposed,
            last_step: Instant::now(),
            cache_on: if cfg.cache_capacity > 0 {
                cfg.cache_capacity
            } else {
                EngineConfig::default().cache_capacity
            },
            status: Arc::new(Mutex::new(status)),
            comm,
            cache: Cache::new(cfg.cache_capacity),
            cfg,
            rx,
            pending: Vec::new(),
            started: Instant::now(),
            stalls: StallCheck::default(),
            lateness: Lateness::default(),
            waited_us: 0,
            stopping: false,
            fusion: FusionBuffer::default(),
            agreed: Instant::now(),
            join: None,
            joined: Vec::new(),
            last_joined: 0,
        }
    }

    fn take(&mut self, c: Command) {
        match c {
            Command::Op(r) => {
                if self.pending.iter().any(|p| p.name == r.name) {
                    r.reply.send(Err(CommError::InvalidArgument {
                        op: "engine",
                        detail: format!("an op named '{}' is already pending", r.name),
                    }));
                } else {
                    self.pending.push(r);
                }
            }
            Command::Join(reply) => {
                if self.join.is_some() {
                    let _ = reply.send(Err(CommError::InvalidArgument {
                        op: "join",
                        detail: "this rank has already joined".into(),
                    }));
                } else {
                    self.join = Some(reply);
                }
            }
            Command::Stop => self.stopping = true,
        }
    }

    /// The timeline, while it records.
    fn timeline(&self) -> Option<&Timeline> {
        self.cfg.timeline.as_deref().filter(|t| t.is_active())
    }

    /// Fails this rank's pending join with `cause`.
    fn fail_join(&mut self, cause: &str) {
        if let Some(j) = self.join.take() {
            let _ = j.send(Err(CommError::Broken {
                cause: cause.to_string(),
            }));
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
                        r.reply.send(Err(CommError::Broken { cause: msg.clone() }));
                    }
                    self.fail_join(&msg);
                    // The communicator is broken; later submissions fail at once.
                    self.drain_broken(&msg);
                    break;
                }
            }
        }
        for r in self.pending.drain(..) {
            r.reply.send(Err(CommError::Broken {
                cause: "the engine stopped".into(),
            }));
        }
        self.fail_join("the engine stopped");
        // Rank 0's tuner may have finished in the last cycles, its best setting announced but
        // never applied: what it found is kept all the same.
        if let Some(t) = self.tuner.as_ref().filter(|t| t.is_done()) {
            let tuned = self.tuned(t.setting());
            let mut st = self
                .status
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            st.tuned.get_or_insert(tuned);
        }
        self.comm.set_background(false);
        self.comm
    }

    fn drain_broken(&mut self, msg: &str) {
        if self.stopping {
            return;
        }
        while let Ok(c) = self.rx.recv() {
            match c {
                Command::Op(r) => {
                    r.reply.send(Err(CommError::Broken {
                        cause: msg.to_string(),
                    }));
                }
                Command::Join(reply) => {
                    let _ = reply.send(Err(CommError::Broken {
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
            joined: self.join.is_some(),
            clock_ms: self.started.elapsed().as_millis() as u64,
            waited_us: self.waited_us,
            ops: self
                .pending
                .iter()
                .map(|r| self.cache.entry(r.sig()))
                .collect(),
            setting: self.proposed.take(),
        };
        let t_cycle = Instant::now();
        let gathered = self.gather(&mine)?;
        self.waited_us = u32::try_from(t_cycle.elapsed().as_micros()).unwrap_or(u32::MAX);
        if let Some(t) = self.timeline().filter(|t| t.marks_cycles()) {
            t.instant("engine", "CYCLE", t_cycle, "");
        }
        if gathered.iter().any(|a| a.stopping) {
            let who: Vec<usize> = (0..n).filter(|&r| gathered[r].stopping).collect();
            let cause = format!("the engine stopped on ranks {who:?}");
            for r in self.pending.drain(..) {
                r.reply.send(Err(CommError::Broken {
                    cause: cause.clone(),
                }));
            }
            self.fail_join(&cause);
            return Ok(false);
        }
        let clock = gathered[0].clock_ms;
        let switch = gathered[0].setting;
        let joined: Vec<bool> = gathered.iter().map(|a| a.joined).collect();
        // Of the ranks that joined since the last cycle, the highest counts as the last.
        self.joined.resize(n, false);
        if let Some(r) = (0..n).rev().find(|&r| joined[r] && !self.joined[r]) {
            self.last_joined = r;
        }
        self.joined.clone_from(&joined);
        let all_joined = joined.iter().all(|&j| j);
        let needed = negotiation::needed(&joined);
        // Every rank's pending ops in full, in its order.
        let mut lists: Vec<Vec<Sig>> = Vec::with_capacity(n);
        for (rank, a) in gathered.iter().enumerate() {
            lists.push(self.cache.resolve(&a.ops).map_err(|id| {
                self.comm.fail(CommError::Protocol {
                    rank,
                    detail: format!("announced op {id}, which is not in the cache"),
                })
            })?);
        }
        let agreement = negotiation::agree(&lists, &needed, self.comm.rank());
        let mut failed = agreement.failed;
        for sig in &agreement.ready {
            self.cache.record(sig);
        }
        let ready: Vec<String> = agreement.ready.into_iter().map(|s| s.name).collect();
        let waited: Vec<u32> = gathered.iter().map(|a| a.waited_us).collect();
        self.lateness.cycle(&lists, &waited, &needed, &ready, clock);
        if !ready.is_empty() {
            self.status
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .lateness = self.lateness.fractions();
        }
        // A joined rank takes part in the others' allreduces with zeros of the same shape.
        for sig in agreement.zeros {
            if let Some(r) = zero_request(&sig) {
                self.pending.push(r);
            }
        }
        failed.extend(self.stall_check(&lists, &needed, clock));
        for (name, e) in failed {
            if let Some(i) = self.pending.iter().position(|r| r.name == name) {
                let r = self.pending.remove(i);
                r.reply.send(Err(e));
            }
        }
        if let Some(t) = self.timeline() {
            let now = Instant::now();
            for r in self.pending.iter().filter(|r| ready.contains(&r.name)) {
                let phase = format!("NEGOTIATE_{}", r.coll.name().to_uppercase());
                t.span(&r.name, &phase, r.submitted, now, "");
            }
        }
        // The setting rank 0 announced applies from this cycle's ops on, on every rank.
        if let Some((setting, tuning)) = switch {
            self.apply(setting, tuning);
        }
        let (bytes, earliest) = self
            .pending
            .iter()
            .filter(|r| ready.contains(&r.name))
            .fold((0u64, None::<Instant>), |(b, e), r| {
                let e = e.map_or(r.submitted, |e| e.min(r.submitted));
                (b + r.tensor.bytes().len() as u64, Some(e))
            });
        self.agreed = Instant::now();
        self.run_ready(&ready)?;
        if let Some(first) = earliest {
            let end = Instant::now();
            let time = end.saturating_duration_since(first.max(self.last_step));
            self.last_step = end;
            // A cycle that switched settings waited out its cycle under the old one: not scored.
            if switch.is_none()
                && let Some(next) = self
                    .tuner
                    .as_mut()
                    .and_then(|t| t.step(&ready, bytes, time))
            {
                let tuning = self.tuner.as_ref().is_some_and(|t| !t.is_done());
                self.proposed = Some((next, tuning));
            }
        }
        if all_joined {
            if let Some(j) = self.join.take() {
                let _ = j.send(Ok(self.last_joined));
            }
            self.joined.fill(false);
        }
        Ok(true)
    }

    /// Rank 0's tuner for a world of `shape` (see [`Tuned::shape`]) configured at
    /// `configured`, and the setting to announce at the first cycle: none where nothing was
    /// tuned before; the setting tuned for this shape, with no tuner, where there is one; else
    /// a tuner starting from the setting tuned last.
    fn resume(
        a: AutotuneConfig,
        configured: Setting,
        shape: (usize, usize, bool),
    ) -> (Option<Tuner>, Option<(Setting, bool)>) {
        let (size, _, hierarchy) = shape;
        let before = (a.resume.iter().rev())
            .find(|t| t.shape() == shape)
            .or(a.resume.last())
            .copied();
        let Some(before) = before else {
            return (Some(Tuner::new(a, configured, hierarchy)), None);
        };
        // Held knobs stay where they were set, whatever was tuned before.
        let mut held = a.held;
        // Hierarchical knobs carry over only between worlds that both run hierarchically: one
        // that could not tuned nothing there, and in one that cannot they are off as configured.
        if !(before.hierarchical && hierarchy) {
            held.hierarchical_allreduce = true;
            held.hierarchical_allgather = true;
        }
        let start = held.hold(&configured, before.setting);
        if before.shape() == shape {
            tracing::info!(
                size,
                ?start,
                "autotune: keeping the setting tuned on an earlier round of this shape"
            );
            (None, Some((start, false)))
        } else {
            tracing::info!(
                size,
                tuned_size = before.size,
                ?start,
                "autotune: tuning this round's shape, starting from the setting tuned before"
            );
            (Some(Tuner::new(a, start, hierarchy)), Some((start, true)))
        }
    }

    /// Applies the knobs of `setting`; `tuning`: whether autotune goes on after it. Every rank
    /// calls it at the same cycle, so the response caches are emptied alike.
    fn apply(&mut self, setting: Setting, tuning: bool) {
        self.cfg.fusion_bytes = setting.fusion_bytes;
        self.cfg.cycle = setting.cycle;
        let capacity = if setting.cache { self.cache_on } else { 0 };
        if capacity != self.cache.capacity() {
            self.cache = Cache::new(capacity);
        }
        self.comm.set_hierarchical(
            setting.hierarchical_allreduce,
            setting.hierarchical_allgather,
        );
        let setting = Setting {
            hierarchical_allreduce: self.comm.is_hierarchical(),
            hierarchical_allgather: self.comm.is_hierarchical_allgather(),
            ..setting
        };
        tracing::debug!(?setting, tuning, "engine settings switched");
        let mut st = self
            .status
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        st.setting = setting;
        st.autotuning = tuning;
        if !tuning && self.cfg.autotune.is_some() {
            st.tuned = Some(self.tuned(setting));
        }
    }

    /// `setting`, as tuned on this engine's world.
    fn tuned(&self, setting: Setting) -> Tuned {
        Tuned {
            size: self.comm.size(),
            hosts: self.comm.hosts(),
            hierarchical: self.comm.can_run_hierarchically(),
            setting,
        }
    }

    /// The stall check ([`crate::stall`]): rank 0 logs its warnings, every rank counts them;
    /// returns the ops that fail.
    fn stall_check(
        &mut self,
        lists: &[Vec<Sig>],
        needed: &[usize],
        clock: u64,
    ) -> Vec<(String, CommError)> {
        if !self.cfg.stall_check {
            self.stalls.clear();
            return Vec::new();
        }
        let found = self.stalls.check(
            lists,
            needed,
            clock,
            self.cfg.stall_warning,
            self.cfg.stall_shutdown,
        );
        if !found.warnings.is_empty() {
            if self.comm.rank() == 0 {
                tracing::warn!(
                    ops = %found.warnings.join(", "),
                    after = ?self.cfg.stall_warning,
                    "stall check: ops submitted by some ranks are still waiting for the others; \
                     one or more ranks may have stopped submitting them"
                );
            }
            self.status
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .stall_warnings += found.warnings.len() as u64;
        }
        found.failed
    }

    fn gather(&mut self, mine: &Announce) -> Result<Vec<Announce>> {
        let n = self.comm.size();
        // The announcements are small: the flat path is the fast one for them.
        let hier = self.comm.hier_allgather;
        self.comm.hier_allgather = false;
        let mut all = self.comm.allgather(&mine.encode(), 1);
        // A rank without an engine joined: it starts its engine now, whose first gather
        // meets the next one. Each rank joins that way at most once.
        for _ in 1..n {
            if !matches!(all, Err(CommError::Joined { .. })) {
                break;
            }
            all = self.comm.allgather(&mine.encode(), 1);
        }
        self.comm.hier_allgather = hier;
        let all = all?;
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

    /// Runs the agreed ops in order, fusing runs of allreduces of one dtype and reduction.
    fn run_ready(&mut self, ready: &[String]) -> Result<()> {
        let mut ops: Vec<Request> = Vec::with_capacity(ready.len());
        for name in ready {
            if let Some(i) = self.pending.iter().position(|r| &r.name == name) {
                ops.push(self.pending.remove(i));
            }
        }
        let shapes: Vec<_> = ops
            .iter()
            .map(|r| {
                r.allreduce_op()
                    .map(|op| (r.tensor.dtype(), op, r.tensor.bytes().len()))
            })
            .collect();
        let mut ops = ops.into_iter();
        for batch in fusion::plan(&shapes, self.cfg.fusion_bytes) {
            match batch {
                Batch::Alone(_) => {
                    if let Some(r) = ops.next() {
                        self.run_alone(r)?;
                    }
                }
                Batch::Fused(range) => {
                    let batch: Vec<Request> = ops.by_ref().take(range.len()).collect();
                    self.reduce_batch(batch)?;
                }
            }
        }
        Ok(())
    }

    /// Runs one op that does not fuse. An error of its arguments (which every rank reports,
    /// as the collective checks them together) fails the op alone; a transport error fails the
    /// engine.
    fn run_alone(&mut self, r: Request) -> Result<()> {
        let start = Instant::now();
        if let Some(t) = self.timeline() {
            t.span(&r.name, "QUEUE", self.agreed, start, "");
        }
        let (name, coll, reply) = (r.name, r.coll, r.reply);
        match r.tensor.run(&mut self.comm, &coll) {
            Ok(out) => {
                if let Some(t) = self.timeline() {
                    t.span(
                        &name,
                        &coll.name().to_uppercase(),
                        start,
                        Instant::now(),
                        "",
                    );
                }
                reply.send(Ok(out));
                Ok(())
            }
            Err(e) if !e.is_fatal() => {
                reply.send(Err(e));
                Ok(())
            }
            Err(e) => {
                reply.send(Err(CommError::Broken {
                    cause: e.to_string(),
                }));
                Err(e)
            }
        }
    }

    /// Records one phase of every op of a batch on the timeline.
    fn trace(&self, batch: &[Request], phase: &str, start: Instant) {
        if let Some(t) = self.timeline() {
            let end = Instant::now();
            let args = format!("\"fused\":{}", batch.len());
            for r in batch {
                t.span(&r.name, phase, start, end, &args);
            }
        }
    }

    fn reduce_batch(&mut self, mut batch: Vec<Request>) -> Result<()> {
        let op = batch[0].allreduce_op().unwrap_or(ReduceOp::Sum);
        let start = Instant::now();
        if let Some(t) = self.timeline() {
            for r in &batch {
                t.span(&r.name, "QUEUE", self.agreed, start, "");
            }
        }
        if batch.len() == 1 {
            batch[0].tensor.reduce(&mut self.comm, op)?;
            self.trace(&batch, "ALLREDUCE", start);
            let r = batch.remove(0);
            r.reply.send(Ok(r.tensor.into_any()));
            return Ok(());
        }
        let dtype = batch[0].tensor.dtype();
        let mut tensors: Vec<&mut [u8]> = batch.iter_mut().map(|r| r.tensor.bytes_mut()).collect();
        if self.comm.cma.is_some() || op == ReduceOp::Adasum {
            // Ranks of one host reduce the tensors where they lie: no fusion copy. Adasum
            // combines tensor by tensor, so it takes the tensors as a group too.
            fusion::group_in_place(&mut self.comm, dtype, op, tensors)?;
            self.trace(&batch, "ALLREDUCE_FUSED_IN_PLACE", start);
        } else {
            let mut phases: Vec<(&'static str, Instant, Instant)> = Vec::with_capacity(3);
            self.fusion
                .allreduce(&mut self.comm, dtype, op, &mut tensors, |phase, since| {
                    phases.push((phase, since, Instant::now()));
                })?;
            if let Some(t) = self.timeline() {
                let args = format!("\"fused\":{}", batch.len());
                for (phase, from, to) in phases {
                    for r in &batch {
                        t.span(&r.name, phase, from, to, &args);
                    }
                }
            }
        }
        for r in batch {
            r.reply.send(Ok(r.tensor.into_any()));
        }
        Ok(())
    }
}

/// An allreduce of zeros shaped as `sig` says, whose result nobody waits for: a joined rank's
/// part in an op the others submitted. `None` for a malformed signature (which the peers'
/// own checks then report).
fn zero_request(sig: &Sig) -> Option<Request> {
    fn typed<T: Element>(count: usize) -> Box<dyn Tensor> {
        Box::new(vec![T::zeroed(); count])
    }
    let op = ReduceOp::from_tag(u8::try_from(sig.param).ok()?)?;
    let count = usize::try_from(sig.count).ok()?;
    let dtype = sig.dtype;
    let (reply, _) = mpsc::channel();
    let reply = Reply::Channel(reply);
    Some(Request {
        name: sig.name.clone(),
        submitted: Instant::now(),
        coll: Coll::Allreduce(op),
        tensor: by_dtype!(dtype, typed(count)),
        reply,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_world_of_one_reduces_at_once() {
        let e = Engine::start(Communicator::single(), EngineConfig::default()).unwrap();
        let h = e.allreduce_async("x", vec![1.0f32, 2.0], ReduceOp::Sum);
        assert_eq!(h.wait().unwrap(), vec![1.0, 2.0]);
        assert!(e.stop().is_some());
    }

    fn knobs(fusion_mb: usize, cycle_ms: u64, cache: bool, hier: bool) -> Setting {
        Setting {
            fusion_bytes: fusion_mb << 20,
            cycle: Duration::from_millis(cycle_ms),
            cache,
            hierarchical_allreduce: hier,
            hierarchical_allgather: hier,
        }
    }

    fn tuned(size: usize, hosts: usize, hierarchical: bool, setting: Setting) -> Tuned {
        Tuned {
            size,
            hosts,
            hierarchical,
            setting,
        }
    }

    fn resuming(resume: Vec<Tuned>, held: crate::Held) -> AutotuneConfig {
        AutotuneConfig {
            resume,
            held,
            ..AutotuneConfig::default()
        }
    }

    #[test]
    fn nothing_tuned_before_tunes_from_the_configured_knobs() {
        let configured = knobs(64, 5, true, false);
        let (tuner, first) = Worker::resume(
            resuming(vec![], crate::Held::default()),
            configured,
            (4, 2, true),
        );
        assert_eq!(tuner.map(|t| t.setting()), Some(configured));
        assert_eq!(first, None);
    }

    #[test]
    fn the_shape_tuned_before_is_kept_even_when_another_was_tuned_later() {
        let mine = knobs(32, 2, false, true);
        let later = knobs(8, 9, true, false);
        let resume = vec![tuned(4, 2, true, mine), tuned(6, 3, true, later)];
        let (tuner, first) = Worker::resume(
            resuming(resume, crate::Held::default()),
            knobs(64, 5, true, false),
            (4, 2, true),
        );
        assert!(tuner.is_none(), "a shape tuned before is not tuned again");
        assert_eq!(first, Some((mine, false)));
    }

    #[test]
    fn a_new_shape_tunes_from_the_setting_tuned_last_with_held_knobs_kept() {
        let resume = vec![
            tuned(4, 2, true, knobs(32, 2, false, true)),
            tuned(6, 3, true, knobs(8, 9, false, true)),
        ];
        let held = crate::Held {
            cycle: true,
            ..crate::Held::default()
        };
        let configured = knobs(64, 5, true, false);
        let (tuner, first) = Worker::resume(resuming(resume, held), configured, (8, 4, true));
        // Fusion, cache and hierarchy from the last tuned; the held cycle time as configured.
        let start = knobs(8, 5, false, true);
        assert_eq!(tuner.map(|t| t.setting()), Some(start));
        assert_eq!(first, Some((start, true)));
    }

    #[test]
    fn hierarchical_knobs_come_from_tuning_only_where_both_worlds_run_hierarchically() {
        let configured = knobs(64, 5, true, true);
        // Tuned where hierarchy was impossible: its "off" was never chosen.
        let flat = vec![tuned(4, 4, false, knobs(8, 9, false, false))];
        let (_, first) = Worker::resume(
            resuming(flat, crate::Held::default()),
            configured,
            (4, 2, true),
        );
        assert_eq!(first, Some((knobs(8, 9, false, true), true)));
        // Tuned hierarchical, now on a world that cannot be (whose communicator reports the
        // hierarchical knobs off): off.
        let hier = vec![tuned(4, 2, true, knobs(8, 9, false, true))];
        let (_, first) = Worker::resume(
            resuming(hier, crate::Held::default()),
            knobs(64, 5, true, false),
            (4, 4, false),
        );
        assert_eq!(first, Some((knobs(8, 9, false, false), true)));
    }
}
