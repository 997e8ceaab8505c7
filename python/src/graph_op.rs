//! The entry point of hvd's compiled TensorFlow op (`hvd/tensorflow/graph_ops.cc`): a group of
//! tensors reduced by the background engine, the op told of the end by a completion function.
//!
//! Inside `tf.function` a collective is a graph node. As a compiled asynchronous op it costs
//! what any TensorFlow op does; as a `tf.numpy_function` it would cost a Python call and the
//! GIL per node. The op allocates its outputs, copies its inputs into them (or takes inputs'
//! buffers over), and calls [`grouped_allreduce`] with their addresses. One tensor is reduced
//! there and then, as a synchronous collective; several are submitted to the engine at once
//! (so they are fused), and the op's completion is called once every one is reduced, or
//! failed. Python hands the op library this function's address (`grouped_allreduce_entry`).
//!
//! Element types are TensorFlow's own `DataType` numbers (`tensorflow/core/framework/
//! types.proto`), so the op passes `Tensor::dtype()` as it is and no second table exists.

#![allow(unsafe_code)]

use std::ffi::{c_char, c_int, c_void};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use hvd::{Error, ReduceOp, bf16, f16};

use crate::Raised;
use crate::memory::{DType, Lent, Region, Slice};

/// The op's completion: `code` 0 for success, else a [`Raised`] discriminant with a message of
/// `len` bytes (UTF-8, then a NUL) at `msg`, valid during the call.
pub type Done = unsafe extern "C" fn(ctx: *mut c_void, code: c_int, msg: *const c_char, len: usize);

/// How a group failed, as the op reports it to TensorFlow (and `hvd.tensorflow` gives it back
/// to Python as the matching exception), with the message.
type Failure = (Raised, String);

fn failure(e: &Error) -> Failure {
    (Raised::of(e), e.to_string())
}

/// The element type of TensorFlow's `DataType` number `tf`.
fn dtype_of(tf: c_int) -> Result<DType, String> {
    Ok(match tf {
        1 => DType::F32,
        2 => DType::F64,
        3 => DType::I32,
        4 => DType::U8,
        9 => DType::I64,
        14 => DType::BF16,
        19 => DType::F16,
        other => return Err(format!("hvd does not reduce TensorFlow's DataType {other}")),
    })
}

/// Multiplies every element by `factor` (the integer types are never scaled: `hvd.tensorflow`
/// refuses a scale factor for them).
fn scale(slice: Slice<'_>, factor: f64) {
    fn floats<T: Copy>(xs: &mut [T], to: impl Fn(T) -> f64, from: impl Fn(f64) -> T, by: f64) {
        for x in xs {
            *x = from(to(*x) * by);
        }
    }
    if factor == 1.0 {
        return;
    }
    match slice {
        Slice::F32(b) => {
            let by = factor as f32;
            b.iter_mut().for_each(|x| *x *= by);
        }
        Slice::F64(b) => b.iter_mut().for_each(|x| *x *= factor),
        Slice::F16(b) => floats(b, |x| f64::from(x.to_f32()), f16::from_f64, factor),
        Slice::BF16(b) => floats(b, |x| f64::from(x.to_f32()), bf16::from_f64, factor),
        Slice::U8(_) | Slice::I32(_) | Slice::I64(_) => {}
    }
}

/// One op's tensors in flight: the last to finish calls the op's completion.
struct Group {
    left: AtomicUsize,
    failed: Mutex<Option<Failure>>,
    postscale: f64,
    done: Done,
    ctx: usize,
}

impl Group {
    fn finish_one(&self, result: Result<Lent, Failure>) {
        match result {
            Ok(mut lent) => scale(lent.slice(), self.postscale),
            Err(e) => {
                let mut failed = self.failed.lock().unwrap_or_else(PoisonError::into_inner);
                failed.get_or_insert(e);
            }
        }
        if self.left.fetch_sub(1, Ordering::AcqRel) == 1 {
            let failed = self
                .failed
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .take();
            match failed {
                None => self.call(0, ""),
                Some((kind, why)) => self.call(kind as c_int, &why),
            }
        }
    }

    /// Ends the op with `e`.
    fn fail(&self, e: &Error) {
        let (kind, why) = failure(e);
        self.call(kind as c_int, &why);
    }

    fn call(&self, code: c_int, msg: &str) {
        // NUL-terminated as well, for a C reader that expects it.
        let text = format!("{msg}\0");
        // SAFETY: `done` and `ctx` are the op's completion and its argument, which the op keeps
        // valid until this one call; `text` outlives it.
        unsafe {
            (self.done)(
                self.ctx as *mut c_void,
                code,
                text.as_ptr().cast(),
                msg.len(),
            )
        }
    }
}

/// Submits `lent` to the engine under `name`; the group hears of its end.
fn submit(s: &hvd::Submitter, name: &str, lent: Lent, op: ReduceOp, group: &Arc<Group>) {
    macro_rules! each {
        ($($v:ident),*) => {
            match lent {
                $(Lent::$v(b) => {
                    let g = Arc::clone(group);
                    s.allreduce_then(name, b, op, move |r| {
                        g.finish_one(r.map(Lent::$v).map_err(|e| failure(&Error::from(e))))
                    })
                })*
            }
        };
    }
    each!(U8, I32, I64, F16, BF16, F32, F64)
}

/// What one call asks for, read from the op's arguments.
struct Call {
    regions: Vec<Region>,
    op: ReduceOp,
    name: String,
}

/// Reads a call's arguments.
///
/// # Safety
/// As [`grouped_allreduce`]'s.
unsafe fn read(
    n: usize,
    data: *const *mut c_void,
    counts: *const usize,
    dtypes: *const c_int,
    op: (*const c_char, usize),
    name: (*const c_char, usize),
) -> Result<Call, String> {
    if n > 0 && (data.is_null() || counts.is_null() || dtypes.is_null()) {
        return Err("the op passed no tensor arrays".into());
    }
    let text = |(p, len): (*const c_char, usize), what: &str| -> Result<String, String> {
        if p.is_null() {
            return Ok(String::new());
        }
        // SAFETY: the caller passes `len` readable bytes at `p`.
        let bytes = unsafe { std::slice::from_raw_parts(p.cast::<u8>(), len) };
        String::from_utf8(bytes.to_vec()).map_err(|_| format!("the op's {what} is not UTF-8"))
    };
    let mut regions = Vec::with_capacity(n);
    for i in 0..n {
        // SAFETY: the caller passes arrays of `n` entries.
        let (address, count, tf) =
            unsafe { (*data.add(i) as usize, *counts.add(i), *dtypes.add(i)) };
        regions.push(Region::checked(address, count, dtype_of(tf)?)?);
    }
    Ok(Call {
        regions,
        op: crate::reduce_op(&text(op, "reduction")?)?,
        name: text(name, "name")?,
    })
}

/// Reduces `n` tensors across the ranks, in place: tensor `i` is `counts[i]` elements of
/// TensorFlow's `DataType` `dtypes[i]` at `data[i]`, multiplied by `prescale` before and
/// `postscale` after. One tensor is reduced on this thread, as a synchronous collective;
/// more are submitted to the engine as one fused group, `"{name}.{i}"`. Calls `done(ctx, …)`
/// exactly once: from this thread on bad input or for one tensor, else from the engine's
/// thread when every tensor is reduced or failed. Never unwinds.
///
/// # Safety
/// `data`, `counts` and `dtypes` point to `n` entries; `op` (a reduction's name) and `name`
/// to `op_len` and `name_len` bytes. Each tensor is live memory of its dtype that nothing
/// else uses and that stays allocated until `done` is called. `done` may be called with
/// `ctx` from another thread.
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn grouped_allreduce(
    n: usize,
    data: *const *mut c_void,
    counts: *const usize,
    dtypes: *const c_int,
    op: *const c_char,
    op_len: usize,
    prescale: f64,
    postscale: f64,
    name: *const c_char,
    name_len: usize,
    done: Done,
    ctx: *mut c_void,
) {
    let group = Arc::new(Group {
        left: AtomicUsize::new(n),
        failed: Mutex::new(None),
        postscale,
        done,
        ctx: ctx as usize,
    });
    let start = AssertUnwindSafe(|| {
        // SAFETY: the caller's contract, passed on.
        unsafe { read(n, data, counts, dtypes, (op, op_len), (name, name_len)) }
    });
    let call = match catch_unwind(start) {
        Ok(Ok(ready)) => ready,
        Ok(Err(why)) => return group.call(Raised::Other as c_int, &why),
        Err(_) => return group.call(Raised::Other as c_int, "hvd's op entry panicked"),
    };
    if n == 0 {
        return group.call(0, "");
    }
    if let [region] = &call.regions[..] {
        // One tensor is reduced now, on this thread: the synchronous path costs a round trip,
        // the engine's a cycle (a millisecond) more. Many are handed to the engine, which fuses
        // them.
        let result = catch_unwind(AssertUnwindSafe(|| {
            region.with_mut(|b| scale(b, prescale));
            let reduced = match region.with_mut(|b| b.allreduce(call.op)) {
                Err(e) if e.met_joined_ranks() => {
                    // Ranks that joined take part through an engine: start it, go again.
                    crate::engine_submitter()
                        .and_then(|_| region.with_mut(|b| b.allreduce(call.op)))
                }
                done => done,
            };
            reduced.map(|()| region.with_mut(|b| scale(b, postscale)))
        }));
        return match result {
            Ok(Ok(())) => group.call(0, ""),
            Ok(Err(e)) => group.fail(&e),
            Err(_) => group.call(Raised::Other as c_int, "hvd's op entry panicked"),
        };
    }
    let s = match crate::engine_submitter() {
        Ok(s) => s,
        Err(e) => return group.fail(&e),
    };
    let mut submitted = 0;
    let all = catch_unwind(AssertUnwindSafe(|| {
        for (i, region) in call.regions.into_iter().enumerate() {
            let bytes = region.count() * region.dtype().size();
            hvd::elastic::steps::count_allreduce(bytes);
            // SAFETY: the caller keeps the tensor allocated and unused until `done`, which
            // the group calls only after the engine gave every tensor back.
            let mut lent = unsafe { region.lend_foreign() };
            scale(lent.slice(), prescale);
            submit(&s, &format!("{}.{i}", call.name), lent, call.op, &group);
            submitted += 1;
        }
    }));
    if all.is_err() {
        // The tensors submitted still end the group when the engine gives them back; the
        // others end it now, so `done` is still called once.
        for _ in submitted..n {
            group.finish_one(Err((Raised::Other, "hvd's op entry panicked".into())));
        }
    }
}

/// The address of [`grouped_allreduce`], for the compiled op library to call.
#[pyo3::pyfunction]
pub fn grouped_allreduce_entry() -> usize {
    grouped_allreduce as *const () as usize
}
