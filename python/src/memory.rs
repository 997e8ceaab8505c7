//! Tensor memory handed over by address and length: with [`crate::graph_op`]'s entry point and
//! [`crate::dlpack`]'s capsules, the package's only `unsafe`.
//!
//! `hvd.torch` passes a contiguous CPU tensor's `data_ptr()`, `numel()` and dtype, and holds a
//! reference to the tensor for the whole call, so the memory lives until the call returns. The
//! collectives then run on that memory directly, without a copy. As with Horovod, a tensor must
//! not be used by another thread while a collective on it runs. The module `hvd._hvd` is
//! private: only `hvd.torch` calls it, with addresses it took from live tensors.

#![allow(unsafe_code)]

use hvd::{ReduceOp, bf16, f16};
use pyo3::PyResult;
use pyo3::exceptions::PyValueError;

/// An element type the collectives support, by PyTorch's name for it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DType {
    U8,
    I32,
    I64,
    F16,
    BF16,
    F32,
    F64,
}

impl DType {
    /// Parses `torch.dtype`'s name without its `torch.` prefix.
    pub fn parse(name: &str) -> PyResult<Self> {
        Ok(match name {
            "uint8" => Self::U8,
            "int32" => Self::I32,
            "int64" => Self::I64,
            "float16" => Self::F16,
            "bfloat16" => Self::BF16,
            "float32" => Self::F32,
            "float64" => Self::F64,
            other => {
                return Err(PyValueError::new_err(format!(
                    "hvd does not reduce tensors of dtype {other}: use uint8, int32, int64, \
                     float16, bfloat16, float32 or float64"
                )));
            }
        })
    }

    /// The collectives' own tag of the type.
    pub(crate) fn element(self) -> hvd::DType {
        match self {
            Self::U8 => hvd::DType::U8,
            Self::I32 => hvd::DType::I32,
            Self::I64 => hvd::DType::I64,
            Self::F16 => hvd::DType::F16,
            Self::BF16 => hvd::DType::BF16,
            Self::F32 => hvd::DType::F32,
            Self::F64 => hvd::DType::F64,
        }
    }

    /// Bytes per element, which is also the alignment the element needs.
    pub(crate) fn size(self) -> usize {
        match self {
            Self::U8 => 1,
            Self::F16 | Self::BF16 => 2,
            Self::I32 | Self::F32 => 4,
            Self::I64 | Self::F64 => 8,
        }
    }
}

/// `count` elements of `dtype` at `address`, checked for what can be checked: not null,
/// aligned for the type, and a size that fits the address space.
#[derive(Debug)]
pub struct Region {
    address: usize,
    count: usize,
    dtype: DType,
}

/// A region as the slice of its element type.
pub enum Slice<'a> {
    U8(&'a mut [u8]),
    I32(&'a mut [i32]),
    I64(&'a mut [i64]),
    F16(&'a mut [f16]),
    BF16(&'a mut [bf16]),
    F32(&'a mut [f32]),
    F64(&'a mut [f64]),
}

/// Runs `$body` with `$b` bound to the slice, whatever its element type.
macro_rules! each {
    ($slice:expr, $b:ident => $body:expr) => {
        match $slice {
            Slice::U8($b) => $body,
            Slice::I32($b) => $body,
            Slice::I64($b) => $body,
            Slice::F16($b) => $body,
            Slice::BF16($b) => $body,
            Slice::F32($b) => $body,
            Slice::F64($b) => $body,
        }
    };
}

impl Slice<'_> {
    /// [`hvd::allreduce`] on the slice.
    pub fn allreduce(self, op: ReduceOp) -> hvd::Result<()> {
        each!(self, b => hvd::allreduce(b, op))
    }

    /// [`hvd::broadcast`] on the slice.
    pub fn broadcast(self, root: usize) -> hvd::Result<()> {
        each!(self, b => hvd::broadcast(b, root))
    }

    /// [`hvd::allreduce_on`] on the slice.
    pub fn allreduce_on(self, set: &hvd::ProcessSet, op: ReduceOp) -> hvd::Result<()> {
        each!(self, b => hvd::allreduce_on(set, b, op))
    }

    /// A broadcast among `set`'s members from its member `root` (an index into its ranks).
    pub fn broadcast_on(self, set: &hvd::ProcessSet, root: usize) -> hvd::Result<()> {
        each!(self, b => hvd::with_process_set(set, |c| c.broadcast(b, root)))
    }
}

impl Region {
    /// Checks a region handed over from Python.
    pub fn new(address: usize, count: usize, dtype: DType) -> PyResult<Self> {
        Self::checked(address, count, dtype).map_err(PyValueError::new_err)
    }

    /// Checks a region handed over by address: not null, aligned for `dtype`, and of a size
    /// that fits the address space; the error says which.
    pub fn checked(address: usize, count: usize, dtype: DType) -> Result<Self, String> {
        let bytes = count
            .checked_mul(dtype.size())
            .filter(|&b| b <= isize::MAX as usize)
            .ok_or_else(|| format!("{count} elements are too many"))?;
        if count > 0 && address == 0 {
            return Err("a tensor with no memory".into());
        }
        if address % dtype.size() != 0 {
            return Err(format!(
                "tensor memory at {address:#x} is not aligned for {dtype:?}"
            ));
        }
        if address.checked_add(bytes).is_none() {
            return Err("tensor memory wraps the address space".into());
        }
        Ok(Self {
            address,
            count,
            dtype,
        })
    }

    /// The region's element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Copies the region's bytes over `to`'s, a region of the same type and size.
    pub fn copy_to(&self, to: &Region) -> Result<(), String> {
        if to.dtype != self.dtype || to.count != self.count {
            return Err("a copy between tensors of different types or sizes".into());
        }
        let bytes = self.count * self.dtype.size();
        if bytes > 0 {
            // SAFETY: both are live regions of `bytes` bytes (`new` checked them, their owners
            // keep them allocated for the call); `copy` allows them to overlap.
            unsafe { std::ptr::copy(self.address as *const u8, to.address as *mut u8, bytes) }
        }
        Ok(())
    }

    /// The region's number of elements.
    pub fn count(&self) -> usize {
        self.count
    }

    /// Runs `f` on the region as a mutable slice of its element type.
    pub fn with_mut<R>(&self, f: impl FnOnce(Slice<'_>) -> R) -> R {
        // An empty slice needs a non-null, aligned pointer, whatever the tensor's address.
        if self.count == 0 {
            return f(match self.dtype {
                DType::U8 => Slice::U8(&mut []),
                DType::I32 => Slice::I32(&mut []),
                DType::I64 => Slice::I64(&mut []),
                DType::F16 => Slice::F16(&mut []),
                DType::BF16 => Slice::BF16(&mut []),
                DType::F32 => Slice::F32(&mut []),
                DType::F64 => Slice::F64(&mut []),
            });
        }
        let (p, n) = (self.address, self.count);
        // SAFETY: `hvd.torch` (or the compiled TensorFlow op, see `graph_op`) passes the data
        // pointer and element count of a live, contiguous CPU tensor of this dtype, which it
        // keeps allocated until the call returns (so the
        // memory stays allocated), and no other reference to that memory is used meanwhile
        // (the documented rule for tensors in flight). `new` checked that the pointer is not
        // null, is aligned for the type, and that the length fits `isize`. Every bit pattern is
        // a valid value of these element types.
        unsafe {
            f(match self.dtype {
                DType::U8 => Slice::U8(std::slice::from_raw_parts_mut(p as *mut u8, n)),
                DType::I32 => Slice::I32(std::slice::from_raw_parts_mut(p as *mut i32, n)),
                DType::I64 => Slice::I64(std::slice::from_raw_parts_mut(p as *mut i64, n)),
                DType::F16 => Slice::F16(std::slice::from_raw_parts_mut(p as *mut f16, n)),
                DType::BF16 => Slice::BF16(std::slice::from_raw_parts_mut(p as *mut bf16, n)),
                DType::F32 => Slice::F32(std::slice::from_raw_parts_mut(p as *mut f32, n)),
                DType::F64 => Slice::F64(std::slice::from_raw_parts_mut(p as *mut f64, n)),
            })
        }
    }
}

/// A tensor's memory lent to the background engine while its owner goes on: a Python
/// tensor stays referenced (so allocated) until the op's result is dropped; a compiled op's
/// output (no `_owner`) stays allocated until the op's completion is called.
pub struct Borrowed<T> {
    ptr: std::ptr::NonNull<T>,
    len: usize,
    _owner: Option<pyo3::Py<pyo3::PyAny>>,
}

// SAFETY: the memory is a tensor's buffer, which belongs to no thread; while the engine holds
// it, the rule for tensors in flight (no other use until the op completes) makes this the only
// reference to it, as a `Vec<T>` would be.
unsafe impl<T: Send> Send for Borrowed<T> {}

impl<T> std::ops::Deref for Borrowed<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        // SAFETY: as in `Region::with_mut`: a live, aligned, non-null buffer of `len` elements,
        // kept allocated by `_owner`; an empty one uses a dangling, aligned pointer.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl<T> std::ops::DerefMut for Borrowed<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        // SAFETY: as in `deref`, and `&mut self` is the only way to the memory meanwhile.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl<T: hvd::Element> hvd::Buffer for Borrowed<T> {
    type Elem = T;
}

/// A lent region with its element type.
pub enum Lent {
    U8(Borrowed<u8>),
    I32(Borrowed<i32>),
    I64(Borrowed<i64>),
    F16(Borrowed<f16>),
    BF16(Borrowed<bf16>),
    F32(Borrowed<f32>),
    F64(Borrowed<f64>),
}

impl Lent {
    /// The lent memory as the slice of its element type.
    pub fn slice(&mut self) -> Slice<'_> {
        match self {
            Self::U8(b) => Slice::U8(b),
            Self::I32(b) => Slice::I32(b),
            Self::I64(b) => Slice::I64(b),
            Self::F16(b) => Slice::F16(b),
            Self::BF16(b) => Slice::BF16(b),
            Self::F32(b) => Slice::F32(b),
            Self::F64(b) => Slice::F64(b),
        }
    }
}

impl Region {
    /// Lends the region to the engine, keeping `owner` (the tensor) referenced meanwhile.
    pub fn lend(self, owner: pyo3::Py<pyo3::PyAny>) -> Lent {
        self.lend_to(Some(owner))
    }

    /// Lends the region to the engine with nothing keeping it allocated.
    ///
    /// # Safety
    /// The memory is a live tensor of the region's dtype that stays allocated, and is used by
    /// nothing else, until the op's result is dropped: a compiled op's output, which the op
    /// completes only from the op's completion.
    pub unsafe fn lend_foreign(self) -> Lent {
        self.lend_to(None)
    }

    fn lend_to(self, owner: Option<pyo3::Py<pyo3::PyAny>>) -> Lent {
        fn make<T>(
            address: usize,
            len: usize,
            owner: Option<pyo3::Py<pyo3::PyAny>>,
        ) -> Borrowed<T> {
            let ptr = if len == 0 {
                std::ptr::NonNull::dangling()
            } else {
                // `Region::new` refused a null address for a non-empty region.
                std::ptr::NonNull::new(address as *mut T).unwrap_or(std::ptr::NonNull::dangling())
            };
            Borrowed {
                ptr,
                len,
                _owner: owner,
            }
        }
        let (a, n) = (self.address, self.count);
        match self.dtype {
            DType::U8 => Lent::U8(make(a, n, owner)),
            DType::I32 => Lent::I32(make(a, n, owner)),
            DType::I64 => Lent::I64(make(a, n, owner)),
            DType::F16 => Lent::F16(make(a, n, owner)),
            DType::BF16 => Lent::BF16(make(a, n, owner)),
            DType::F32 => Lent::F32(make(a, n, owner)),
            DType::F64 => Lent::F64(make(a, n, owner)),
        }
    }
}

/// Why a gather into a tensor Python allocated failed.
#[derive(Debug)]
pub enum GatherError {
    /// The collective failed.
    Hvd(hvd::Error),
    /// The two regions disagree (dtype, or the output's size against what arrived).
    Shape(String),
}

impl From<hvd::Error> for GatherError {
    fn from(e: hvd::Error) -> Self {
        Self::Hvd(e)
    }
}

/// The region as a shared slice of `T`.
///
/// # Safety
/// `T` is the region's element type (checked by the callers' dispatch on `dtype`).
unsafe fn shared<'a, T>(r: &Region) -> &'a [T] {
    if r.count == 0 {
        return &[];
    }
    // SAFETY: as in `Region::with_mut`; the caller matched `T` to the region's dtype.
    unsafe { std::slice::from_raw_parts(r.address as *const T, r.count) }
}

/// The region as a mutable slice of `T`.
///
/// # Safety
/// As [`shared`], and no other slice of the region is alive.
unsafe fn exclusive<'a, T>(r: &Region) -> &'a mut [T] {
    if r.count == 0 {
        return &mut [];
    }
    // SAFETY: as in `Region::with_mut`; the caller matched `T` to the region's dtype and
    // holds no other slice of it.
    unsafe { std::slice::from_raw_parts_mut(r.address as *mut T, r.count) }
}

fn copy_into<T: Copy>(got: &[T], out: &mut [T], what: &str) -> Result<(), GatherError> {
    if got.len() != out.len() {
        return Err(GatherError::Shape(format!(
            "{what} gave {} elements where {} were expected: the ranks' shapes disagree",
            got.len(),
            out.len()
        )));
    }
    out.copy_from_slice(got);
    Ok(())
}

/// Dispatches `$f::<T>($args)` on the region's element type.
macro_rules! typed {
    ($dtype:expr, $f:ident($($args:expr),*)) => {
        match $dtype {
            DType::U8 => $f::<u8>($($args),*),
            DType::I32 => $f::<i32>($($args),*),
            DType::I64 => $f::<i64>($($args),*),
            DType::F16 => $f::<f16>($($args),*),
            DType::BF16 => $f::<bf16>($($args),*),
            DType::F32 => $f::<f32>($($args),*),
            DType::F64 => $f::<f64>($($args),*),
        }
    };
}

fn allgather_typed<T: hvd::Element>(
    input: &Region,
    row_len: usize,
    out: &Region,
    set: Option<&hvd::ProcessSet>,
) -> Result<(), GatherError> {
    // SAFETY: `typed!` picked `T` from the input's dtype, which `allgather_into` checked the
    // output shares; the input and output are distinct tensors.
    let (i, o) = unsafe { (shared::<T>(input), exclusive::<T>(out)) };
    let got = match set {
        None => hvd::allgather(i, row_len)?,
        Some(set) => hvd::with_process_set(set, |c| c.allgather(i, row_len))?,
    };
    copy_into(&got, o, "allgather")
}

fn alltoall_typed<T: hvd::Element>(
    input: &Region,
    splits: &[usize],
    out: &Region,
    set: Option<&hvd::ProcessSet>,
) -> Result<Vec<usize>, GatherError> {
    // SAFETY: as in `allgather_typed`.
    let (i, o) = unsafe { (shared::<T>(input), exclusive::<T>(out)) };
    let (got, received) = match set {
        None => hvd::alltoall(i, splits)?,
        Some(set) => hvd::with_process_set(set, |c| c.alltoall(i, splits))?,
    };
    copy_into(&got, o, "alltoall")?;
    Ok(received)
}

fn reducescatter_typed<T: hvd::Element>(
    input: &Region,
    op: hvd::ReduceOp,
    out: &Region,
    set: Option<&hvd::ProcessSet>,
) -> Result<(), GatherError> {
    // SAFETY: as in `allgather_typed`.
    let (i, o) = unsafe { (shared::<T>(input), exclusive::<T>(out)) };
    let got = match set {
        None => hvd::reducescatter(i, op)?,
        Some(set) => hvd::with_process_set(set, |c| c.reducescatter(i, op))?,
    };
    copy_into(&got, o, "reducescatter")
}

fn same_dtype(input: &Region, out: &Region) -> Result<(), GatherError> {
    if input.dtype == out.dtype {
        Ok(())
    } else {
        Err(GatherError::Shape(format!(
            "input of {:?} but output of {:?}",
            input.dtype, out.dtype
        )))
    }
}

impl Region {
    /// Gathers every rank's rows (of `row_len` elements) of this region into `out`, which
    /// holds exactly their sum; among `set`'s members, or the whole job's.
    pub fn allgather_into(
        &self,
        row_len: usize,
        out: &Region,
        set: Option<&hvd::ProcessSet>,
    ) -> Result<(), GatherError> {
        same_dtype(self, out)?;
        typed!(self.dtype, allgather_typed(self, row_len, out, set))
    }

    /// Sends `splits[p]` elements of this region to rank `p` and receives into `out`, which
    /// holds exactly what arrives; returns how many came from each rank.
    pub fn alltoall_into(
        &self,
        splits: &[usize],
        out: &Region,
        set: Option<&hvd::ProcessSet>,
    ) -> Result<Vec<usize>, GatherError> {
        same_dtype(self, out)?;
        typed!(self.dtype, alltoall_typed(self, splits, out, set))
    }

    /// Reduces this region across ranks and writes this rank's block of the result (the
    /// first `len % size` ranks get one element more) into `out`, which holds exactly it.
    pub fn reducescatter_into(
        &self,
        op: hvd::ReduceOp,
        out: &Region,
        set: Option<&hvd::ProcessSet>,
    ) -> Result<(), GatherError> {
        same_dtype(self, out)?;
        typed!(self.dtype, reducescatter_typed(self, op, out, set))
    }
}

/// What an op the engine runs into a buffer of its own gives back (an allgather, alltoall or
/// reducescatter submitted asynchronously): its elements, and how many came from each rank.
pub trait Produced: Send {
    /// The number of elements.
    fn len(&self) -> usize;
    /// Elements received from each rank (an alltoall's; empty for the others).
    fn counts(&self) -> &[usize];
    /// Copies the elements into `out`, a region of their type and number.
    fn copy_to(&self, out: &Region) -> Result<(), GatherError>;
}

impl<T: hvd::Element> Produced for (Vec<T>, Vec<usize>) {
    fn len(&self) -> usize {
        self.0.len()
    }

    fn counts(&self) -> &[usize] {
        &self.1
    }

    fn copy_to(&self, out: &Region) -> Result<(), GatherError> {
        if out.dtype.element() != T::DTYPE {
            return Err(GatherError::Shape(format!(
                "an output of {:?} for elements of {}",
                out.dtype,
                T::DTYPE
            )));
        }
        // SAFETY: `T` is the output region's element type (checked just above).
        let o = unsafe { exclusive::<T>(out) };
        copy_into(&self.0, o, "the op")
    }
}

impl Region {
    /// The region's elements, copied into a vector of `T`; `None` when `T` is not its type.
    pub fn to_vec<T: hvd::Element>(&self) -> Option<Vec<T>> {
        // SAFETY: `T` is the region's element type (checked first).
        (self.dtype.element() == T::DTYPE).then(|| unsafe { shared::<T>(self) }.to_vec())
    }
}

/// One `(destination, source, bytes)` copy of [`copy_regions`].
pub type CopyRegion = (usize, usize, usize);

/// Copies every region's bytes from its source to its destination, on `threads` threads at
/// most: an elastic state's commit and rollback, outside PyTorch's thread pool (which
/// oversubscribes a host running several workers) and while the caller released the GIL.
///
/// The caller holds every tensor named for the whole call, and no region's destination
/// overlaps another region.
pub fn copy_regions(regions: &[CopyRegion], threads: usize) {
    // Contiguous shares of about equal bytes, one per thread; a region larger than a share is
    // split across shares.
    let total: usize = regions.iter().map(|r| r.2).sum();
    let threads = threads.clamp(1, 64);
    if threads == 1 || total < (8 << 20) {
        for &(dst, src, n) in regions {
            copy_bytes(dst, src, n);
        }
        return;
    }
    let share = total.div_ceil(threads);
    let mut parts: Vec<Vec<CopyRegion>> = vec![Vec::new(); threads];
    // The last share takes whatever is left, so no byte can be without a share.
    let room_of = |part: usize| {
        if part + 1 == threads {
            usize::MAX
        } else {
            share
        }
    };
    let (mut part, mut room) = (0, room_of(0));
    for &(mut dst, mut src, mut n) in regions {
        while n > 0 {
            let take = n.min(room);
            parts[part].push((dst, src, take));
            (dst, src, n, room) = (dst + take, src + take, n - take, room - take);
            if room == 0 {
                part += 1;
                room = room_of(part);
            }
        }
    }
    std::thread::scope(|s| {
        for p in &parts[1..] {
            s.spawn(move || {
                for &(dst, src, n) in p {
                    copy_bytes(dst, src, n);
                }
            });
        }
        for &(dst, src, n) in &parts[0] {
            copy_bytes(dst, src, n);
        }
    });
}

fn copy_bytes(dst: usize, src: usize, n: usize) {
    if n == 0 || dst == src {
        return;
    }
    // SAFETY: the caller passes the data pointers and byte lengths of live tensors it holds
    // for the whole call; `copy` allows a source that overlaps its destination.
    unsafe { std::ptr::copy(src as *const u8, dst as *mut u8, n) }
}
