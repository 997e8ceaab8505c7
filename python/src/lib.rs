//! `hvd._hvd`: the native half of the `hvd` Python package. It is a thin layer over the `hvd`
//! crate: the process context, the collectives and their errors. Tensors arrive as the address
//! and length of their contiguous memory (see [`memory`]); the Python half (`hvd.torch`) takes
//! them from PyTorch. Every call that waits on peers releases the GIL, so autograd's threads
//! and other Python threads run meanwhile.

#![deny(unsafe_code)]

mod dlpack;
mod graph_op;
mod memory;

use std::sync::{Mutex, PoisonError};

use hvd::{Engine, Error, Handle, ReduceOp, Submitter, bf16, f16};
use pyo3::create_exception;
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;

use memory::{Borrowed, DType, GatherError, Lent, Produced, Region};

create_exception!(
    _hvd,
    HorovodInternalError,
    PyRuntimeError,
    "A collective failed because a peer failed, hung or left: an elastic job restores its last commit and goes on."
);
create_exception!(
    _hvd,
    HostsUpdatedInterrupt,
    PyRuntimeError,
    "The driver announced a host change: an elastic job moves every rank to the next round."
);

/// Turns an `hvd` error into the Python exception Horovod raises for it, with its message.
fn raise(e: Error) -> PyErr {
    match Raised::of(&e) {
        Raised::HostsUpdated => HostsUpdatedInterrupt::new_err(e.to_string()),
        Raised::Internal => HorovodInternalError::new_err(e.to_string()),
        Raised::Other => PyRuntimeError::new_err(e.to_string()),
    }
}

/// Which of Horovod's exceptions an `hvd` error is: decided here for Python's calls and for the
/// compiled TensorFlow op alike (whose completion passes the discriminant as its code).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Raised {
    /// `HorovodInternalError`: a peer failed, hung or left; an elastic job recovers.
    Internal = 1,
    /// `HostsUpdatedInterrupt`: the driver announced a host change.
    HostsUpdated = 2,
    /// Bad input or another error that no recovery mends.
    Other = 3,
}

impl Raised {
    fn of(e: &Error) -> Self {
        match e {
            Error::HostsUpdated { .. } => Self::HostsUpdated,
            _ if e.is_recoverable() => Self::Internal,
            _ => Self::Other,
        }
    }
}

fn op_from(name: &str) -> PyResult<ReduceOp> {
    reduce_op(name).map_err(PyValueError::new_err)
}

/// The reduction named `name` (`hvd.Sum.name` and the others).
fn reduce_op(name: &str) -> Result<ReduceOp, String> {
    Ok(match name {
        "sum" => ReduceOp::Sum,
        "average" => ReduceOp::Average,
        "min" => ReduceOp::Min,
        "max" => ReduceOp::Max,
        "product" => ReduceOp::Product,
        "adasum" => ReduceOp::Adasum,
        other => {
            return Err(format!(
                "unknown reduction '{other}': expected sum, average, min, max, product or adasum"
            ));
        }
    })
}

/// Joins the job `horovodrun` started this process in (a world of one without it).
#[pyfunction]
fn init(py: Python<'_>) -> PyResult<()> {
    py.detach(hvd::init).map_err(raise)
}

/// Leaves the job cleanly.
#[pyfunction]
fn shutdown(py: Python<'_>) -> PyResult<()> {
    py.detach(|| stop_engine().and_then(|()| hvd::shutdown()))
        .map_err(raise)
}

/// Whether `init` was called (and `shutdown` not since).
#[pyfunction]
fn is_initialized() -> bool {
    hvd::is_initialized()
}

/// Rank, size, local rank and size, cross rank and size, and whether the hosts are
/// homogeneous, in one call.
#[pyfunction]
fn topology() -> PyResult<(usize, usize, usize, usize, usize, usize, bool)> {
    let t = hvd::topology().map_err(raise)?;
    Ok((
        t.rank,
        t.size,
        t.local_rank,
        t.local_size,
        t.cross_rank,
        t.cross_size,
        t.homogeneous,
    ))
}

/// Reduces the `count` elements of `dtype` at `address` across all ranks, in place.
#[pyfunction]
fn allreduce_(py: Python<'_>, address: usize, count: usize, dtype: &str, op: &str) -> PyResult<()> {
    let op = op_from(op)?;
    let region = Region::new(address, count, DType::parse(dtype)?)?;
    world_call(py, || Ok(region.with_mut(|buf| buf.allreduce(op))?))
}

/// Reduces a copy of the CPU tensor that a framework exported as the DLPack `capsule` across
/// all ranks, and returns the result as a capsule for the framework's `from_dlpack`: the
/// eager path of `hvd.tensorflow.allreduce`, one call from tensor to tensor. `None`, with
/// nothing sent, for a tensor to take the general way (on another device, of an element
/// type hvd does not reduce, or strided).
#[pyfunction]
fn allreduced<'py>(
    py: Python<'py>,
    capsule: &Bound<'py, PyAny>,
    op: &str,
) -> PyResult<Option<Bound<'py, PyAny>>> {
    let op = op_from(op)?;
    let Some(input) = dlpack::Exported::read(capsule)? else {
        return Ok(None);
    };
    let out = dlpack::Output::new(input.region.dtype(), input.shape.clone())?;
    let (from, to) = (&input.region, out.region()?);
    world_call(py, || {
        from.copy_to(&to).map_err(GatherError::Shape)?;
        Ok(to.with_mut(|buf| buf.allreduce(op))?)
    })?;
    out.into_capsule(py).map(Some)
}

/// Runs a synchronous collective. When it meets ranks that joined (Horovod's `join`) while
/// no engine runs here, the engine starts and the call runs again through it, where the
/// joined ranks take part with zeros.
fn world_call<R: Send>(
    py: Python<'_>,
    call: impl Fn() -> Result<R, GatherError> + Sync,
) -> PyResult<R> {
    match py.detach(&call) {
        Err(GatherError::Hvd(e)) if e.met_joined_ranks() => {
            submitter()?;
            py.detach(&call).map_err(gather_error)
        }
        done => done.map_err(gather_error),
    }
}

/// Copies the `count` elements of `dtype` at `address` from rank `root` to every rank.
#[pyfunction]
fn broadcast_(
    py: Python<'_>,
    address: usize,
    count: usize,
    dtype: &str,
    root: usize,
) -> PyResult<()> {
    let region = Region::new(address, count, DType::parse(dtype)?)?;
    world_call(py, || Ok(region.with_mut(|buf| buf.broadcast(root))?))
}

/// The background engine, started by the first asynchronous op: ops are matched across
/// ranks by name and allreduces fused, as in Horovod.
static ENGINE: Mutex<Option<Engine>> = Mutex::new(None);

fn submitter() -> PyResult<Submitter> {
    engine_submitter().map_err(raise)
}

/// The background engine's submitter, starting the engine if it does not run.
fn engine_submitter() -> Result<Submitter, Error> {
    let mut engine = ENGINE.lock().unwrap_or_else(PoisonError::into_inner);
    match engine.as_ref() {
        Some(e) => Ok(e.submitter()),
        None => {
            let e = hvd::start_engine(hvd::engine_config()?)?;
            let s = e.submitter();
            *engine = Some(e);
            Ok(s)
        }
    }
}

/// Stops the background engine, if it runs, and gives the communicator back.
fn stop_engine() -> Result<(), Error> {
    let engine = ENGINE.lock().unwrap_or_else(PoisonError::into_inner).take();
    match engine {
        Some(e) => hvd::stop_engine(e),
        None => Ok(()),
    }
}

/// An op the engine runs, with its element type.
enum Pending {
    U8(Handle<u8, Borrowed<u8>>),
    I32(Handle<i32, Borrowed<i32>>),
    I64(Handle<i64, Borrowed<i64>>),
    F16(Handle<f16, Borrowed<f16>>),
    BF16(Handle<bf16, Borrowed<bf16>>),
    F32(Handle<f32, Borrowed<f32>>),
    F64(Handle<f64, Borrowed<f64>>),
}

/// Runs `$body` with `$h` bound to the handle, whatever its element type, and `$wrap` the
/// matching variant of [`Lent`].
macro_rules! each_pending {
    ($p:expr, $h:ident, $wrap:ident => $body:expr) => {
        match $p {
            Pending::U8($h) => {
                let $wrap = Lent::U8;
                $body
            }
            Pending::I32($h) => {
                let $wrap = Lent::I32;
                $body
            }
            Pending::I64($h) => {
                let $wrap = Lent::I64;
                $body
            }
            Pending::F16($h) => {
                let $wrap = Lent::F16;
                $body
            }
            Pending::BF16($h) => {
                let $wrap = Lent::BF16;
                $body
            }
            Pending::F32($h) => {
                let $wrap = Lent::F32;
                $body
            }
            Pending::F64($h) => {
                let $wrap = Lent::F64;
                $body
            }
        }
    };
}

/// Submits `lent` to the engine as `submit` says, for every element type.
macro_rules! submit_each {
    ($lent:expr, $b:ident => $submit:expr) => {
        match $lent {
            Lent::U8($b) => Pending::U8($submit),
            Lent::I32($b) => Pending::I32($submit),
            Lent::I64($b) => Pending::I64($submit),
            Lent::F16($b) => Pending::F16($submit),
            Lent::BF16($b) => Pending::BF16($submit),
            Lent::F32($b) => Pending::F32($submit),
            Lent::F64($b) => Pending::F64($submit),
        }
    };
}

/// The pending result of an asynchronous op on a tensor, reduced in the tensor's own memory.
#[pyclass(module = "hvd._hvd")]
struct AsyncHandle {
    pending: Mutex<Option<Pending>>,
    name: String,
}

#[pymethods]
impl AsyncHandle {
    /// Whether the op has finished (successfully or not); never blocks.
    fn poll(&self) -> bool {
        let mut p = self.pending.lock().unwrap_or_else(PoisonError::into_inner);
        match p.as_mut() {
            Some(p) => each_pending!(p, h, _w => h.poll()),
            None => true,
        }
    }

    /// Waits for the op (without the GIL); raises its error. A handle is waited for once.
    fn wait(&self, py: Python<'_>) -> PyResult<()> {
        let pending = self
            .pending
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        let Some(pending) = pending else {
            return Err(PyValueError::new_err(format!(
                "op '{}' was already waited for",
                self.name
            )));
        };
        // The tensor's reference comes back with the result and is dropped here, holding the
        // GIL.
        let done: hvd::Result<Lent> = py
            .detach(|| each_pending!(pending, h, wrap => h.wait().map(wrap).map_err(Error::from)));
        done.map(drop).map_err(raise)
    }

    /// The op's name.
    #[getter]
    fn name(&self) -> &str {
        &self.name
    }
}

/// Starts reducing the tensor `owner` (its `count` elements of `dtype` at `address`) across
/// all ranks in the background, in place, under `name`: every rank submits an op of that
/// name. Returns its handle.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
fn allreduce_async_(
    address: usize,
    count: usize,
    dtype: &str,
    op: &str,
    name: String,
    owner: Py<PyAny>,
) -> PyResult<AsyncHandle> {
    let op = op_from(op)?;
    let dtype = DType::parse(dtype)?;
    let lent = Region::new(address, count, dtype)?.lend(owner);
    let s = submitter()?;
    hvd::elastic::steps::count_allreduce(count.saturating_mul(dtype.size()));
    let pending = submit_each!(lent, b => s.allreduce_async(&name, b, op));
    Ok(AsyncHandle {
        pending: Mutex::new(Some(pending)),
        name,
    })
}

/// Starts copying the tensor `owner` from rank `root` to every rank in the background, in
/// place, under `name`.
#[pyfunction]
fn broadcast_async_(
    address: usize,
    count: usize,
    dtype: &str,
    root: usize,
    name: String,
    owner: Py<PyAny>,
) -> PyResult<AsyncHandle> {
    let lent = Region::new(address, count, DType::parse(dtype)?)?.lend(owner);
    let s = submitter()?;
    let pending = submit_each!(lent, b => s.broadcast_async(&name, b, root));
    Ok(AsyncHandle {
        pending: Mutex::new(Some(pending)),
        name,
    })
}

/// An op the engine runs into a buffer of its own, waited for once.
trait Waiting: Send {
    fn poll(&mut self) -> bool;
    fn wait(self: Box<Self>) -> Result<Box<dyn Produced>, Error>;
}

impl<T: hvd::Element> Waiting for Handle<T> {
    fn poll(&mut self) -> bool {
        Handle::poll(self)
    }

    fn wait(self: Box<Self>) -> Result<Box<dyn Produced>, Error> {
        let v = Handle::wait(*self)?;
        Ok(Box::new((v, Vec::new())))
    }
}

impl<T: hvd::Element> Waiting for Handle<T, (Vec<T>, Vec<usize>)> {
    fn poll(&mut self) -> bool {
        Handle::poll(self)
    }

    fn wait(self: Box<Self>) -> Result<Box<dyn Produced>, Error> {
        Ok(Box::new(Handle::wait(*self)?))
    }
}

/// The pending result of an asynchronous allgather, alltoall or reducescatter: the engine
/// fills a buffer of its own, which `copy_into` then copies into a tensor Python sized from
/// `wait`'s answer.
#[pyclass(module = "hvd._hvd")]
struct OutputHandle {
    pending: Mutex<Option<Box<dyn Waiting>>>,
    done: Mutex<Option<Box<dyn Produced>>>,
    name: String,
}

impl OutputHandle {
    fn new(pending: Box<dyn Waiting>, name: String) -> Self {
        Self {
            pending: Mutex::new(Some(pending)),
            done: Mutex::new(None),
            name,
        }
    }
}

#[pymethods]
impl OutputHandle {
    /// Whether the op has finished (successfully or not); never blocks.
    fn poll(&self) -> bool {
        let mut p = self.pending.lock().unwrap_or_else(PoisonError::into_inner);
        p.as_mut().is_none_or(|w| w.poll())
    }

    /// Waits for the op (without the GIL); returns the number of elements it produced and
    /// the elements received from each rank (an alltoall's; empty otherwise).
    fn wait(&self, py: Python<'_>) -> PyResult<(usize, Vec<usize>)> {
        let pending = self
            .pending
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        let Some(pending) = pending else {
            return Err(PyValueError::new_err(format!(
                "op '{}' was already waited for",
                self.name
            )));
        };
        let out = py.detach(|| pending.wait()).map_err(raise)?;
        let shape = (out.len(), out.counts().to_vec());
        *self.done.lock().unwrap_or_else(PoisonError::into_inner) = Some(out);
        Ok(shape)
    }

    /// Copies the result into the `count` elements of `dtype` at `address` (after `wait`).
    fn copy_into(&self, address: usize, count: usize, dtype: &str) -> PyResult<()> {
        let out = Region::new(address, count, DType::parse(dtype)?)?;
        let done = self.done.lock().unwrap_or_else(PoisonError::into_inner);
        let Some(result) = done.as_ref() else {
            return Err(PyValueError::new_err(format!(
                "op '{}' has no result to copy: wait for it first",
                self.name
            )));
        };
        result.copy_to(&out).map_err(gather_error)
    }
}

/// Runs `$f::<T>($args)` for the element type `T` of a [`DType`].
macro_rules! by_dtype {
    ($dtype:expr, $f:ident($($arg:expr),*)) => {
        match $dtype {
            DType::U8 => $f::<u8>($($arg),*),
            DType::I32 => $f::<i32>($($arg),*),
            DType::I64 => $f::<i64>($($arg),*),
            DType::F16 => $f::<f16>($($arg),*),
            DType::BF16 => $f::<bf16>($($arg),*),
            DType::F32 => $f::<f32>($($arg),*),
            DType::F64 => $f::<f64>($($arg),*),
        }
    };
}

/// What an asynchronous allgather, alltoall or reducescatter does with its input.
enum Produce {
    Allgather(usize),
    Alltoall(Vec<usize>),
    Reducescatter(ReduceOp),
}

fn produce_typed<T: hvd::Element>(
    s: &Submitter,
    input: &Region,
    what: Produce,
    name: &str,
) -> PyResult<Box<dyn Waiting>> {
    let v = input
        .to_vec::<T>()
        .ok_or_else(|| PyValueError::new_err("the input's dtype changed"))?;
    Ok(match what {
        Produce::Allgather(row_len) => Box::new(s.allgather_async(name, v, row_len)),
        Produce::Alltoall(splits) => Box::new(s.alltoall_async(name, v, splits)),
        Produce::Reducescatter(op) => Box::new(s.reducescatter_async(name, v, op)),
    })
}

/// Submits `what` of a copy of the input region to the engine under `name`.
fn produce(
    address: usize,
    count: usize,
    dtype: &str,
    what: Produce,
    name: String,
) -> PyResult<OutputHandle> {
    let dtype = DType::parse(dtype)?;
    let input = Region::new(address, count, dtype)?;
    let s = submitter()?;
    let pending = by_dtype!(dtype, produce_typed(&s, &input, what, &name))?;
    Ok(OutputHandle::new(pending, name))
}

/// Starts gathering every rank's rows (`row_len` elements each) of the input in the
/// background, under `name`; the input is copied at once.
#[pyfunction]
fn allgather_async(
    address: usize,
    count: usize,
    dtype: &str,
    row_len: usize,
    name: String,
) -> PyResult<OutputHandle> {
    produce(address, count, dtype, Produce::Allgather(row_len), name)
}

/// Starts sending `splits[p]` elements of the input to rank `p` in the background, under
/// `name`; the input is copied at once.
#[pyfunction]
fn alltoall_async(
    address: usize,
    count: usize,
    dtype: &str,
    splits: Vec<usize>,
    name: String,
) -> PyResult<OutputHandle> {
    produce(address, count, dtype, Produce::Alltoall(splits), name)
}

/// Starts reducing the input across ranks in the background, this rank keeping its block,
/// under `name`; the input is copied at once.
#[pyfunction]
fn reducescatter_async(
    address: usize,
    count: usize,
    dtype: &str,
    op: &str,
    name: String,
) -> PyResult<OutputHandle> {
    let op = op_from(op)?;
    produce(address, count, dtype, Produce::Reducescatter(op), name)
}

/// Leaving the current round and joining the driver's next one (elastic jobs), stopping the
/// background engine of the old round first, on a thread of its own (`rejoin_start`): the
/// next round forms while Python rolls the state back, and needing no GIL, the thread cannot
/// be held up by the rollback.
#[pyclass(module = "hvd._hvd")]
struct Rejoining {
    done: Mutex<Option<std::sync::mpsc::Receiver<Result<(), Error>>>>,
}

#[pymethods]
impl Rejoining {
    /// Waits for the rejoin: `None`, or the driver's reason when it has no place for this
    /// worker any more; an error that no next round mends is raised.
    fn wait(&self, py: Python<'_>) -> PyResult<Option<String>> {
        let rx = self
            .done
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take()
            .ok_or_else(|| PyRuntimeError::new_err("this rejoin was already waited for"))?;
        let joined = py
            .detach(move || rx.recv())
            .map_err(|_| PyRuntimeError::new_err("the rejoin's thread ended without an answer"))?;
        match joined {
            Ok(()) => Ok(None),
            Err(Error::Removed { reason }) => Ok(Some(reason)),
            Err(e) => Err(raise(e)),
        }
    }
}

/// Starts the rejoin on its thread; `wait()` on the result gives the outcome.
#[pyfunction]
fn rejoin_start(reason: String) -> PyResult<Rejoining> {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::Builder::new()
        .name("hvd-rejoin".into())
        .spawn(move || {
            let joined = stop_engine().and_then(|()| hvd::elastic::steps::rejoin(&reason));
            // Nobody waiting any more is no error: the worker is on its way out.
            let _ = tx.send(joined);
        })
        .map_err(|e| PyRuntimeError::new_err(format!("cannot start the rejoin's thread: {e}")))?;
    Ok(Rejoining {
        done: Mutex::new(Some(rx)),
    })
}

/// Stops the background engine, if it runs, so that no op of a failed round writes into a
/// tensor any more; `rejoin` would stop it first too, but a state may be restored meanwhile.
#[pyfunction(name = "stop_engine")]
fn stop_engine_py(py: Python<'_>) -> PyResult<()> {
    py.detach(stop_engine).map_err(raise)
}

/// The elastic round this worker is in (0 outside an elastic job).
#[pyfunction]
fn generation() -> u64 {
    hvd::elastic::steps::generation()
}

/// Tells the driver this worker holds the newest committed state.
#[pyfunction]
fn report_synced() {
    hvd::elastic::steps::report_synced();
}

/// The newest host update the current round accounts for.
#[pyfunction]
fn updates_through() -> u64 {
    hvd::elastic::steps::updates_through()
}

/// The newest host update any rank has been told of (a max-allreduce: every rank calls it at
/// the same point).
#[pyfunction]
fn newest_update(py: Python<'_>) -> PyResult<u64> {
    py.detach(hvd::elastic::steps::newest_update).map_err(raise)
}

/// Decides a sync of the elastic state from every rank's commits and whether it is new
/// (a small allgather: every rank calls it at the same point): the source rank, the commits
/// everyone ends with, and the ranks that must receive (empty when every rank holds it).
#[pyfunction]
fn sync_plan(py: Python<'_>, commits: u64, fresh: bool) -> PyResult<(usize, u64, Vec<usize>)> {
    let plan = py
        .detach(|| hvd::elastic::steps::sync_plan(commits, fresh))
        .map_err(raise)?;
    Ok((plan.root, plan.commits, plan.receivers))
}

/// Counts one committed training step for the driver's step rate.
#[pyfunction]
fn count_step() {
    hvd::elastic::steps::count_step();
}

/// Copies each `(destination, source, bytes)` region of live tensors, without the GIL: an
/// elastic state's commit and rollback. `threads` defaults to the host's cores over its
/// workers (the launcher's count while a round forms), so workers sharing a host never
/// oversubscribe it.
#[pyfunction]
#[pyo3(signature = (regions, threads=None))]
fn copy_regions(py: Python<'_>, regions: Vec<memory::CopyRegion>, threads: Option<usize>) {
    let threads = threads.unwrap_or_else(|| {
        let cores = std::thread::available_parallelism().map_or(1, usize::from);
        let workers = hvd::topology().map(|t| t.local_size).unwrap_or_else(|_| {
            std::env::var("HOROVOD_LOCAL_SIZE")
                .ok()
                .and_then(|v| v.parse().ok())
                .unwrap_or(1)
        });
        cores / workers.max(1)
    });
    py.detach(|| memory::copy_regions(&regions, threads));
}

/// Rebuilds the previous round's process sets for the current one.
#[pyfunction]
fn restore_process_sets(py: Python<'_>) -> PyResult<()> {
    py.detach(hvd::elastic::steps::restore_process_sets)
        .map_err(raise)
}

/// Looks up process set `id` on this rank.
fn process_set(id: u32) -> PyResult<hvd::ProcessSet> {
    hvd::process_sets()
        .map_err(raise)?
        .into_iter()
        .find(|s| s.id == id)
        .ok_or_else(|| PyValueError::new_err(format!("no process set {id} (removed?)")))
}

/// Creates a process set of `ranks` (every rank calls it, with the same ranks); returns its
/// id and its ranks, ascending. The background engine, if it runs, stops first: it holds the
/// communicator the new set's mesh is built beside.
#[pyfunction]
fn add_process_set(py: Python<'_>, ranks: Vec<usize>) -> PyResult<(u32, Vec<usize>)> {
    py.detach(|| stop_engine().and_then(|()| hvd::add_process_set(&ranks)))
        .map(|s| (s.id, s.ranks))
        .map_err(raise)
}

/// Removes process set `id` on this rank.
#[pyfunction]
fn remove_process_set(id: u32) -> PyResult<()> {
    hvd::remove_process_set(&process_set(id)?).map_err(raise)
}

/// The process sets of this rank: (id, ranks) each.
#[pyfunction]
fn process_sets() -> PyResult<Vec<(u32, Vec<usize>)>> {
    Ok(hvd::process_sets()
        .map_err(raise)?
        .into_iter()
        .map(|s| (s.id, s.ranks))
        .collect())
}

/// [`allreduce_`] among the members of process set `set`.
#[pyfunction]
fn allreduce_on_(
    py: Python<'_>,
    set: u32,
    address: usize,
    count: usize,
    dtype: &str,
    op: &str,
) -> PyResult<()> {
    let op = op_from(op)?;
    let set = process_set(set)?;
    let region = Region::new(address, count, DType::parse(dtype)?)?;
    py.detach(|| region.with_mut(|buf| buf.allreduce_on(&set, op)))
        .map_err(raise)
}

/// [`broadcast_`] among the members of process set `set`; `root` is a global rank.
#[pyfunction]
fn broadcast_on_(
    py: Python<'_>,
    set: u32,
    address: usize,
    count: usize,
    dtype: &str,
    root: usize,
) -> PyResult<()> {
    let set = process_set(set)?;
    let Some(root_in_set) = set.ranks.iter().position(|&r| r == root) else {
        return Err(PyValueError::new_err(format!(
            "root rank {root} is not in process set {} (ranks {:?})",
            set.id, set.ranks
        )));
    };
    let region = Region::new(address, count, DType::parse(dtype)?)?;
    py.detach(|| region.with_mut(|buf| buf.broadcast_on(&set, root_in_set)))
        .map_err(raise)
}

fn gather_error(e: GatherError) -> PyErr {
    match e {
        GatherError::Hvd(e) => raise(e),
        GatherError::Shape(why) => PyRuntimeError::new_err(why),
    }
}

/// The process set with native id `set`, or `None` (the whole job) without one.
fn set_of(set: Option<u32>) -> PyResult<Option<hvd::ProcessSet>> {
    set.map(process_set).transpose()
}

/// Gathers every rank's rows (`row_len` elements each) of the input region into the output
/// region, which Python sized for all of them; among process set `set`'s ranks if given.
#[pyfunction]
#[pyo3(signature = (address, count, dtype, row_len, out_address, out_count, set=None))]
#[allow(clippy::too_many_arguments)]
fn allgather_into(
    py: Python<'_>,
    address: usize,
    count: usize,
    dtype: &str,
    row_len: usize,
    out_address: usize,
    out_count: usize,
    set: Option<u32>,
) -> PyResult<()> {
    let dtype = DType::parse(dtype)?;
    let input = Region::new(address, count, dtype)?;
    let out = Region::new(out_address, out_count, dtype)?;
    let set = set_of(set)?;
    world_call(py, || input.allgather_into(row_len, &out, set.as_ref()))
}

/// Sends `splits[p]` elements of the input region to rank `p`, receiving into the output
/// region (sized by Python for what arrives); returns the counts received from each rank.
#[pyfunction]
#[pyo3(signature = (address, count, dtype, splits, out_address, out_count, set=None))]
#[allow(clippy::too_many_arguments)]
fn alltoall_into(
    py: Python<'_>,
    address: usize,
    count: usize,
    dtype: &str,
    splits: Vec<usize>,
    out_address: usize,
    out_count: usize,
    set: Option<u32>,
) -> PyResult<Vec<usize>> {
    let dtype = DType::parse(dtype)?;
    let input = Region::new(address, count, dtype)?;
    let out = Region::new(out_address, out_count, dtype)?;
    let set = set_of(set)?;
    world_call(py, || input.alltoall_into(&splits, &out, set.as_ref()))
}

/// Reduces the input region across ranks and writes this rank's block of the result (the
/// first `count % size` ranks get one element more) into the output region.
#[pyfunction]
#[pyo3(signature = (address, count, dtype, op, out_address, out_count, set=None))]
#[allow(clippy::too_many_arguments)]
fn reducescatter_into(
    py: Python<'_>,
    address: usize,
    count: usize,
    dtype: &str,
    op: &str,
    out_address: usize,
    out_count: usize,
    set: Option<u32>,
) -> PyResult<()> {
    let op = op_from(op)?;
    let dtype = DType::parse(dtype)?;
    let input = Region::new(address, count, dtype)?;
    let out = Region::new(out_address, out_count, dtype)?;
    let set = set_of(set)?;
    world_call(py, || input.reducescatter_into(op, &out, set.as_ref()))
}

/// Waits until every rank (of process set `set`, if given) has called it.
#[pyfunction]
#[pyo3(signature = (set=None))]
fn barrier(py: Python<'_>, set: Option<u32>) -> PyResult<()> {
    match set_of(set)? {
        None => world_call(py, || Ok(hvd::barrier()?)),
        Some(set) => py
            .detach(|| hvd::with_process_set(&set, |c| c.barrier()))
            .map_err(raise),
    }
}

/// Declares that this rank has no more data (Horovod's `join`); returns the rank that
/// joined last, once every rank has. Without a running engine it first tries to join at
/// the other ranks' next synchronous call: when they all join there, that is all; when
/// they still run, every rank moves to its engine, which takes this rank's part with zeros.
#[pyfunction]
fn join(py: Python<'_>) -> PyResult<usize> {
    let running = ENGINE
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .is_some();
    if !running {
        match py.detach(hvd::join_without_engine) {
            Ok(last) => return Ok(last),
            Err(e) if e.met_joined_ranks() => {}
            Err(e) => return Err(raise(e)),
        }
    }
    submitter()?;
    py.detach(hvd::join).map_err(raise)
}

/// Starts recording this rank's timeline into `path` (Horovod's `start_timeline`).
#[pyfunction]
#[pyo3(signature = (path, mark_cycles=false))]
fn start_timeline(path: std::path::PathBuf, mark_cycles: bool) -> PyResult<()> {
    hvd::start_timeline(&path, mark_cycles).map_err(raise)
}

/// Stops recording the timeline; what was recorded stays in the file.
#[pyfunction]
fn stop_timeline() -> PyResult<()> {
    hvd::stop_timeline().map_err(raise)
}

/// The native module.
#[pymodule]
fn _hvd(m: &Bound<'_, PyModule>) -> PyResult<()> {
    // hvd's warnings (stalls, recoveries) reach stderr, as Horovod's core logs.
    hvd::install_logging("warn").map_err(raise)?;
    m.add_function(wrap_pyfunction!(init, m)?)?;
    m.add_function(wrap_pyfunction!(shutdown, m)?)?;
    m.add_function(wrap_pyfunction!(is_initialized, m)?)?;
    m.add_function(wrap_pyfunction!(topology, m)?)?;
    m.add_function(wrap_pyfunction!(allgather_async, m)?)?;
    m.add_function(wrap_pyfunction!(alltoall_async, m)?)?;
    m.add_function(wrap_pyfunction!(reducescatter_async, m)?)?;
    m.add_function(wrap_pyfunction!(allreduce_, m)?)?;
    m.add_function(wrap_pyfunction!(allreduced, m)?)?;
    m.add_function(wrap_pyfunction!(count_step, m)?)?;
    m.add_function(wrap_pyfunction!(newest_update, m)?)?;
    m.add_function(wrap_pyfunction!(sync_plan, m)?)?;
    m.add_function(wrap_pyfunction!(stop_engine_py, m)?)?;
    m.add_function(wrap_pyfunction!(broadcast_, m)?)?;
    m.add_function(wrap_pyfunction!(barrier, m)?)?;
    m.add_function(wrap_pyfunction!(allreduce_async_, m)?)?;
    m.add_function(wrap_pyfunction!(broadcast_async_, m)?)?;
    m.add_class::<AsyncHandle>()?;
    m.add_class::<OutputHandle>()?;
    m.add_class::<Rejoining>()?;
    for f in [
        wrap_pyfunction!(add_process_set, m)?,
        wrap_pyfunction!(remove_process_set, m)?,
        wrap_pyfunction!(process_sets, m)?,
        wrap_pyfunction!(allreduce_on_, m)?,
        wrap_pyfunction!(broadcast_on_, m)?,
        wrap_pyfunction!(allgather_into, m)?,
        wrap_pyfunction!(alltoall_into, m)?,
        wrap_pyfunction!(reducescatter_into, m)?,
        wrap_pyfunction!(rejoin_start, m)?,
        wrap_pyfunction!(generation, m)?,
        wrap_pyfunction!(report_synced, m)?,
        wrap_pyfunction!(updates_through, m)?,
        wrap_pyfunction!(restore_process_sets, m)?,
        wrap_pyfunction!(copy_regions, m)?,
        wrap_pyfunction!(join, m)?,
        wrap_pyfunction!(start_timeline, m)?,
        wrap_pyfunction!(stop_timeline, m)?,
        wrap_pyfunction!(graph_op::grouped_allreduce_entry, m)?,
    ] {
        m.add_function(f)?;
    }
    m.add(
        "HorovodInternalError",
        m.py().get_type::<HorovodInternalError>(),
    )?;
    m.add(
        "HostsUpdatedInterrupt",
        m.py().get_type::<HostsUpdatedInterrupt>(),
    )?;
    Ok(())
}
