//! DLPack capsules, the exchange format every framework reads and writes: a tensor's memory
//! read from the capsule a framework exports (`tf.experimental.dlpack.to_dlpack`), and a
//! result handed to a framework as a capsule it takes over (`from_dlpack`), which frees the
//! memory through the capsule's deleter when its last tensor goes. Neither way copies.
//!
//! Only the unversioned ABI (capsules named `dltensor`) is spoken: it is what TensorFlow,
//! PyTorch and JAX all import and export.

#![allow(unsafe_code)]

use std::alloc::Layout;
use std::ffi::{CStr, c_void};
use std::ptr::NonNull;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::{PyResult, ffi};

use crate::memory::{DType, Region};

#[repr(C)]
#[derive(Clone, Copy)]
struct DLDevice {
    device_type: i32,
    device_id: i32,
}

#[repr(C)]
#[derive(Clone, Copy)]
struct DLDataType {
    code: u8,
    bits: u8,
    lanes: u16,
}

#[repr(C)]
struct DLTensor {
    data: *mut c_void,
    device: DLDevice,
    ndim: i32,
    dtype: DLDataType,
    shape: *mut i64,
    strides: *mut i64,
    byte_offset: u64,
}

#[repr(C)]
struct DLManagedTensor {
    dl_tensor: DLTensor,
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut DLManagedTensor)>,
}

/// The capsule's name while nobody has taken it over; the taker renames it `used_dltensor`.
const NAME: &CStr = c"dltensor";
/// DLPack's `kDLCPU`.
const CPU: i32 = 1;
/// The alignment of memory handed out: TensorFlow's kernels read it with 64-byte vectors.
pub const ALIGN: usize = 64;

const INT: u8 = 0;
const UINT: u8 = 1;
const FLOAT: u8 = 2;
const BFLOAT: u8 = 4;

/// The element type DLPack's `(code, bits)` names, among those hvd reduces.
fn dtype_of(t: DLDataType) -> Option<DType> {
    if t.lanes != 1 {
        return None;
    }
    Some(match (t.code, t.bits) {
        (UINT, 8) => DType::U8,
        (INT, 32) => DType::I32,
        (INT, 64) => DType::I64,
        (FLOAT, 16) => DType::F16,
        (BFLOAT, 16) => DType::BF16,
        (FLOAT, 32) => DType::F32,
        (FLOAT, 64) => DType::F64,
        _ => return None,
    })
}

fn code_of(dtype: DType) -> DLDataType {
    let (code, bits) = match dtype {
        DType::U8 => (UINT, 8),
        DType::I32 => (INT, 32),
        DType::I64 => (INT, 64),
        DType::F16 => (FLOAT, 16),
        DType::BF16 => (BFLOAT, 16),
        DType::F32 => (FLOAT, 32),
        DType::F64 => (FLOAT, 64),
    };
    DLDataType {
        code,
        bits,
        lanes: 1,
    }
}

/// A dense CPU tensor that a framework exported as a capsule, borrowed while the capsule is
/// (the capsule keeps the framework's buffer alive): its memory, element type and shape.
pub struct Exported<'a> {
    _capsule: &'a Bound<'a, PyAny>,
    /// Where the elements start and how many there are; checked by [`Region::new`].
    pub region: Region,
    pub shape: Vec<i64>,
}

impl<'a> Exported<'a> {
    /// Reads `capsule`; `None` where its tensor is not one hvd takes this way (on another
    /// device than the CPU, of an element type hvd does not reduce, or strided), which the
    /// caller then takes its general way. An object that is no unused DLPack capsule is an
    /// error.
    pub fn read(capsule: &'a Bound<'a, PyAny>) -> PyResult<Option<Self>> {
        // SAFETY: `PyCapsule_IsValid` accepts any object; a valid capsule of this name holds
        // a `DLManagedTensor` by the DLPack convention, which stays alive and unchanged while
        // the capsule does (its owner frees it only from the capsule's destructor or after
        // taking it over, which renames the capsule).
        let managed = unsafe {
            if ffi::PyCapsule_IsValid(capsule.as_ptr(), NAME.as_ptr()) == 0 {
                return Err(PyValueError::new_err(
                    "expected an unused DLPack capsule (named 'dltensor')",
                ));
            }
            ffi::PyCapsule_GetPointer(capsule.as_ptr(), NAME.as_ptr()) as *const DLManagedTensor
        };
        let Some(managed) = NonNull::new(managed as *mut DLManagedTensor) else {
            return Err(PyValueError::new_err("a DLPack capsule without a tensor"));
        };
        // SAFETY: as above: a live `DLManagedTensor`, read only.
        let t = unsafe { &managed.as_ref().dl_tensor };
        let Some(dtype) = dtype_of(t.dtype) else {
            return Ok(None);
        };
        if t.device.device_type != CPU || t.ndim < 0 {
            return Ok(None);
        }
        let ndim = t.ndim as usize;
        let shape: Vec<i64> = if ndim == 0 {
            Vec::new()
        } else if t.shape.is_null() {
            return Err(PyValueError::new_err("a DLPack tensor without a shape"));
        } else {
            // SAFETY: DLPack's `shape` holds `ndim` entries, alive with the tensor.
            unsafe { std::slice::from_raw_parts(t.shape, ndim) }.to_vec()
        };
        if shape.iter().any(|&d| d < 0) {
            return Err(PyValueError::new_err(format!(
                "a DLPack tensor of shape {shape:?}"
            )));
        }
        if !t.strides.is_null() {
            // SAFETY: `strides`, when given, holds `ndim` entries, alive with the tensor.
            let strides = unsafe { std::slice::from_raw_parts(t.strides, ndim) };
            if !compact(&shape, strides) {
                return Ok(None);
            }
        }
        let count = shape
            .iter()
            .try_fold(1usize, |n, &d| n.checked_mul(d as usize))
            .ok_or_else(|| PyValueError::new_err(format!("a tensor of shape {shape:?}")))?;
        let address = (t.data as usize)
            .checked_add(t.byte_offset as usize)
            .ok_or_else(|| PyValueError::new_err("a DLPack tensor past the address space"))?;
        Ok(Some(Self {
            _capsule: capsule,
            region: Region::new(address, count, dtype)?,
            shape,
        }))
    }
}

/// Whether `strides` (in elements) lay `shape` out row-major without gaps; sizes of one
/// may carry any stride.
fn compact(shape: &[i64], strides: &[i64]) -> bool {
    let mut want = 1i64;
    for (&d, &s) in shape.iter().zip(strides).rev() {
        if d != 1 && s != want {
            return false;
        }
        want = want.saturating_mul(d);
    }
    true
}

/// Memory from the global allocator, freed when dropped.
struct Memory {
    data: NonNull<u8>,
    layout: Layout,
}

impl Drop for Memory {
    fn drop(&mut self) {
        // SAFETY: allocated by `Output::new` with this layout, freed only here.
        unsafe { std::alloc::dealloc(self.data.as_ptr(), self.layout) }
    }
}

/// What a capsule handed out owns: the tensor's description, its shape and its memory. The
/// capsule points at `managed`, the first field, and DLPack's deleter frees the whole.
#[repr(C)]
struct Owned {
    managed: DLManagedTensor,
    shape: Vec<i64>,
    memory: Memory,
}

/// Fresh `ALIGN`-aligned memory for a tensor of `dtype` and `shape`, to fill and hand to a
/// framework as a capsule ([`Output::into_capsule`]); freed if never handed out.
pub struct Output {
    owned: Box<Owned>,
    count: usize,
    dtype: DType,
}

// SAFETY: `Output` owns its memory alone (nothing else points into it before it is handed
// out), as a `Vec<u8>` would.
unsafe impl Send for Output {}

impl Output {
    /// Allocates the memory (uninitialised: the caller writes every byte).
    pub fn new(dtype: DType, shape: Vec<i64>) -> PyResult<Self> {
        let too_large = || PyValueError::new_err(format!("a tensor of shape {shape:?}"));
        let count = shape
            .iter()
            .try_fold(1usize, |n, &d| {
                usize::try_from(d).ok().and_then(|d| n.checked_mul(d))
            })
            .ok_or_else(too_large)?;
        let bytes = count.checked_mul(dtype.size()).ok_or_else(too_large)?;
        let layout = Layout::from_size_align(bytes.max(ALIGN), ALIGN).map_err(|_| too_large())?;
        let ndim = i32::try_from(shape.len())
            .map_err(|_| PyValueError::new_err("a tensor of too many dimensions"))?;
        // SAFETY: the layout's size is at least `ALIGN`, never zero.
        let data = match NonNull::new(unsafe { std::alloc::alloc(layout) }) {
            Some(data) => data,
            None => std::alloc::handle_alloc_error(layout),
        };
        let mut owned = Box::new(Owned {
            managed: DLManagedTensor {
                dl_tensor: DLTensor {
                    data: data.as_ptr().cast(),
                    device: DLDevice {
                        device_type: CPU,
                        device_id: 0,
                    },
                    ndim,
                    dtype: code_of(dtype),
                    shape: std::ptr::null_mut(),
                    strides: std::ptr::null_mut(),
                    byte_offset: 0,
                },
                manager_ctx: std::ptr::null_mut(),
                deleter: Some(delete),
            },
            shape,
            memory: Memory { data, layout },
        });
        owned.managed.dl_tensor.shape = owned.shape.as_mut_ptr();
        Ok(Self {
            owned,
            count,
            dtype,
        })
    }

    /// The memory as a region for the collectives.
    pub fn region(&self) -> PyResult<Region> {
        Region::new(
            self.owned.memory.data.as_ptr() as usize,
            self.count,
            self.dtype,
        )
    }

    /// Hands the memory to Python as a `dltensor` capsule: a framework's `from_dlpack` takes
    /// it over (and frees it through the deleter); a capsule nobody took frees it when
    /// collected.
    pub fn into_capsule(self, py: Python<'_>) -> PyResult<Bound<'_, PyAny>> {
        let raw = Box::into_raw(self.owned);
        // SAFETY: `raw` is a live `Owned`, whose first field (`repr(C)`) is the
        // `DLManagedTensor` the capsule points at; its ownership passes to the capsule (or to
        // whoever takes the capsule over), and `drop_unused` or `delete` frees it once.
        unsafe {
            (*raw).managed.manager_ctx = raw.cast();
            let capsule = ffi::PyCapsule_New(raw.cast(), NAME.as_ptr(), Some(drop_unused));
            if capsule.is_null() {
                delete(raw.cast());
                return Err(PyErr::fetch(py));
            }
            Ok(Bound::from_owned_ptr(py, capsule))
        }
    }
}

/// DLPack's deleter: frees what [`Output::into_capsule`] handed out.
unsafe extern "C" fn delete(managed: *mut DLManagedTensor) {
    if managed.is_null() {
        return;
    }
    // SAFETY: `managed` is the first field of an `Owned` that `into_capsule` leaked, whose
    // `manager_ctx` points at it; DLPack calls the deleter once.
    drop(unsafe { Box::from_raw((*managed).manager_ctx.cast::<Owned>()) });
}

/// The capsule's destructor: frees the tensor unless a framework took it over (and renamed
/// the capsule), which then frees it itself.
unsafe extern "C" fn drop_unused(capsule: *mut ffi::PyObject) {
    // SAFETY: called by Python on the capsule being destroyed; a capsule still named
    // `dltensor` owns its tensor (`PyCapsule_IsValid` sets no error either way).
    unsafe {
        if ffi::PyCapsule_IsValid(capsule, NAME.as_ptr()) != 0 {
            delete(ffi::PyCapsule_GetPointer(capsule, NAME.as_ptr()).cast());
        }
    }
}
