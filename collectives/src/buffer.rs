//! Tensor buffers backed by transparent huge pages.
//!
//! Same-host collectives copy peers' buffers with `process_vm_readv`/`process_vm_writev`,
//! which pin every page they touch: from 2 MiB pages that costs about half of what it costs
//! from 4 KiB ones. Memory from `malloc` gets huge pages only when the system enables them for
//! every mapping or the allocator asks for them (glibc's `glibc.malloc.hugetlb=1` tunable,
//! PyTorch's `THP_MEM_ALLOC_ENABLE=1`). A [`HugeBuffer`] asks for them itself, so its speed
//! does not depend on either.

use std::fmt;
use std::io;
use std::ops::{Deref, DerefMut};

use memmap2::{Advice, MmapMut};

/// The transparent huge page size on x86-64 and most aarch64 kernels.
const HUGE_PAGE: usize = 2 << 20;

/// Where a buffer's elements live.
enum Store<T> {
    /// Its own mapping, advised as huge pages; the elements start at the first 2 MiB boundary
    /// in it (the offset).
    Mapped(MmapMut, usize),
    /// The process heap: below a huge page a mapping of its own gains nothing.
    Heap(Vec<T>),
}

/// A zero-initialised slice of `T`; from 2 MiB on, in its own anonymous mapping advised to the
/// kernel as huge-page memory before its first touch. It dereferences to `[T]`, so collectives
/// take it wherever they take a slice, and the engine takes it as a tensor ([`crate::Buffer`]).
/// Where huge pages are off (`never`) it is ordinary memory.
pub struct HugeBuffer<T: bytemuck::Pod> {
    store: Store<T>,
    len: usize,
    huge: bool,
}

impl<T: bytemuck::Pod> HugeBuffer<T> {
    /// A buffer of `len` zeroed elements. From 2 MiB on, the elements start on a 2 MiB
    /// boundary of a mapping of whole huge pages, advised as such; a smaller buffer could not hold an aligned huge page, so it
    /// lives on the heap. The error is the `mmap` failure (or a length whose byte size
    /// overflows).
    pub fn zeroed(len: usize) -> io::Result<Self> {
        let bytes = len.checked_mul(std::mem::size_of::<T>()).ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("a buffer of {len} elements overflows the address space"),
            )
        })?;
        if bytes < HUGE_PAGE {
            return Ok(Self {
                store: Store::Heap(vec![T::zeroed(); len]),
                len,
                huge: false,
            });
        }
        // Whole huge pages, plus one to align the start: kernels before 6.7 place a large
        // anonymous mapping on any 4 KiB page.
        let mapped = bytes
            .checked_next_multiple_of(HUGE_PAGE)
            .and_then(|b| b.checked_add(HUGE_PAGE))
            .ok_or_else(|| {
                io::Error::new(
                    io::ErrorKind::InvalidInput,
                    format!("a buffer of {bytes} bytes overflows the address space"),
                )
            })?;
        let map = MmapMut::map_anon(mapped)?;
        let offset = (HUGE_PAGE - map.as_ptr() as usize % HUGE_PAGE) % HUGE_PAGE;
        // Before the first touch, so the first faults already allocate huge pages. A kernel
        // without transparent huge pages refuses the advice; the memory is still good.
        let huge = map.advise(Advice::HugePage).is_ok();
        Ok(Self {
            store: Store::Mapped(map, offset),
            len,
            huge,
        })
    }

    /// A buffer holding a copy of `data`.
    pub fn from_slice(data: &[T]) -> io::Result<Self> {
        let mut b = Self::zeroed(data.len())?;
        b.copy_from_slice(data);
        Ok(b)
    }

    /// Whether the buffer was advised as huge pages and the kernel accepted the advice, which
    /// it does whatever its mode (with `never`, the pages stay small), and may still back
    /// with small pages when it has no free huge page at fault time. Buffers under 2 MiB are
    /// never advised.
    pub fn advised(&self) -> bool {
        self.huge
    }
}

/// An empty buffer (on the heap, holding nothing).
impl<T: bytemuck::Pod> Default for HugeBuffer<T> {
    fn default() -> Self {
        Self {
            store: Store::Heap(Vec::new()),
            len: 0,
            huge: false,
        }
    }
}

impl<T: bytemuck::Pod> Deref for HugeBuffer<T> {
    type Target = [T];

    fn deref(&self) -> &[T] {
        let bytes = self.len * std::mem::size_of::<T>();
        match &self.store {
            Store::Mapped(m, at) => bytemuck::cast_slice(&m[*at..*at + bytes]),
            Store::Heap(v) => v,
        }
    }
}

impl<T: bytemuck::Pod> DerefMut for HugeBuffer<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        let bytes = self.len * std::mem::size_of::<T>();
        match &mut self.store {
            Store::Mapped(m, at) => bytemuck::cast_slice_mut(&mut m[*at..*at + bytes]),
            Store::Heap(v) => v,
        }
    }
}

impl<T: bytemuck::Pod + fmt::Debug> fmt::Debug for HugeBuffer<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HugeBuffer")
            .field("len", &self.len)
            .field("advised", &self.huge)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;

    #[test]
    fn zeroed_holds_its_length_and_is_writable() {
        let mut b = HugeBuffer::<f32>::zeroed(1_000_003).unwrap();
        assert_eq!(b.len(), 1_000_003);
        assert!(b.iter().all(|&x| x == 0.0));
        b[1_000_002] = 7.5;
        b[0] = -1.0;
        assert_eq!((b[0], b[1_000_002]), (-1.0, 7.5));
        assert_eq!(
            b.as_ptr() as usize % HUGE_PAGE,
            0,
            "the elements start on a huge page"
        );
    }

    #[test]
    fn empty_small_and_copied_buffers() {
        let e = HugeBuffer::<u64>::zeroed(0).unwrap();
        assert!(e.is_empty());
        // Below a huge page nothing is rounded up or advised.
        let small = HugeBuffer::<u8>::zeroed(64 << 10).unwrap();
        assert_eq!(small.len(), 64 << 10);
        assert!(!small.advised());
        let c = HugeBuffer::from_slice(&[1u16, 2, 3]).unwrap();
        assert_eq!(&c[..], &[1, 2, 3]);
    }

    #[test]
    fn overflowing_length_is_an_error_naming_it() {
        let e = HugeBuffer::<u64>::zeroed(usize::MAX / 4).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidInput);
        assert!(e.to_string().contains("elements"), "{e}");
    }

    /// Where the kernel offers huge pages on advice, a touched buffer is backed by them.
    #[test]
    fn advised_memory_gets_huge_pages_where_the_kernel_offers_them() {
        let mode = std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled")
            .unwrap_or_default();
        if !(mode.contains("[madvise]") || mode.contains("[always]")) {
            eprintln!("SKIP: transparent huge pages are off here ({mode:?})");
            return;
        }
        let fallbacks = crate::pages::thp_fault_fallbacks();
        let mut b = HugeBuffer::<u8>::zeroed(8 << 20).unwrap();
        assert!(b.advised());
        // The kernel merges adjacent mappings with the same flags, and other tests map advised
        // buffers concurrently: a flag of its own keeps this mapping's smaps entry its own.
        let Store::Mapped(map, _) = &b.store else {
            panic!("an 8 MiB buffer has a mapping of its own");
        };
        map.advise(Advice::DontFork).unwrap();
        b.fill(1);
        let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
        let huge_kb = crate::pages::mapping_field(&smaps, b.as_ptr() as usize, "AnonHugePages")
            .and_then(|v| v.trim_end_matches("kB").trim().parse::<usize>().ok());
        let huge_kb = huge_kb.expect("the buffer's mapping is in smaps");
        if huge_kb < 8192 && crate::pages::thp_fault_fallbacks() > fallbacks {
            eprintln!("SKIP: the kernel had no free huge page ({huge_kb} kB of 8192 got one)");
            return;
        }
        assert_eq!(huge_kb, 8192, "only {huge_kb} kB of 8 MiB on huge pages");
    }
}
