//! `hvd._hvd`: the native half of the `hvd` Python package. It is a thin layer over the `hvd`
//! crate: the process context, the collectives and their errors. Tensors arrive as the address
//! and length of their contiguous memory (see [`memory`]); the Python half (`hvd.torch`) takes
//! them from PyTorch. Every call that waits on peers releases the GIL, so autograd's threads
//! and other Python threads run meanwhile.

#![deny(unsafe_code)]

mod memory;

use hvd::{Error, ReduceOp};
use pyo3::create_exception;
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;

use memory::{DType, Region};

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
    match &e {
        Error::HostsUpdated { .. } => HostsUpdatedInterrupt::new_err(e.to_string()),
        _ if e.is_recoverable() => HorovodInternalError::new_err(e.to_string()),
        _ => PyRuntimeError::new_err(e.to_string()),
    }
}

fn op_from(name: &str) -> PyResult<ReduceOp> {
    Ok(match name {
        "sum" => ReduceOp::Sum,
        "average" => ReduceOp::Average,
        "min" => ReduceOp::Min,
        "max" => ReduceOp::Max,
        "product" => ReduceOp::Product,
        other => {
            return Err(PyValueError::new_err(format!(
                "unknown reduction '{other}': expected sum, average, min, max or product"
            )));
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
    py.detach(hvd::shutdown).map_err(raise)
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
    py.detach(|| region.with_mut(|buf| buf.allreduce(op)))
        .map_err(raise)
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
    py.detach(|| region.with_mut(|buf| buf.broadcast(root)))
        .map_err(raise)
}

/// Waits until every rank has called it.
#[pyfunction]
fn barrier(py: Python<'_>) -> PyResult<()> {
    py.detach(hvd::barrier).map_err(raise)
}

/// The native module.
#[pymodule]
fn _hvd(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(init, m)?)?;
    m.add_function(wrap_pyfunction!(shutdown, m)?)?;
    m.add_function(wrap_pyfunction!(is_initialized, m)?)?;
    m.add_function(wrap_pyfunction!(topology, m)?)?;
    m.add_function(wrap_pyfunction!(allreduce_, m)?)?;
    m.add_function(wrap_pyfunction!(broadcast_, m)?)?;
    m.add_function(wrap_pyfunction!(barrier, m)?)?;
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
