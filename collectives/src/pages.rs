//! Whether this process's `malloc` honours the huge-page request `horovodrun` gives workers.
//!
//! `horovodrun` sets `GLIBC_TUNABLES=glibc.malloc.hugetlb=1`, so that glibc advises its large
//! allocations as transparent huge pages. glibc 2.35 and 2.36 read the kernel's mode into an
//! unterminated buffer and, in some processes, at random, conclude that huge pages are not
//! supported: those processes' tensors stay on 4 KiB pages, and same-host transfers of them run
//! at about half speed. This module finds out which case a process is in, so that a slow rank
//! can be explained.

/// Whether a large `malloc` in this process is advised as huge pages: `None` when it was not
/// asked for (no `glibc.malloc.hugetlb=1` in `GLIBC_TUNABLES`) or when the kernel's mode makes
/// the advice moot (`always`, `never`) or unknowable.
pub fn malloc_huge_pages() -> Option<bool> {
    let tunables = std::env::var("GLIBC_TUNABLES").ok()?;
    if !tunables
        .split(':')
        .any(|t| t.trim() == "glibc.malloc.hugetlb=1")
    {
        return None;
    }
    let mode = std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled").ok()?;
    if !mode.contains("[madvise]") {
        return None;
    }
    // Above glibc's mmap threshold (2 MiB under horovodrun), so it gets a mapping of its own,
    // which glibc advises at once if it honours the tunable; no page needs touching.
    let probe: Vec<u8> = std::hint::black_box(Vec::with_capacity(4 << 20));
    let smaps = std::fs::read_to_string("/proc/self/smaps").ok()?;
    let flags = mapping_field(&smaps, probe.as_ptr() as usize, "VmFlags")?;
    Some(flags.split_whitespace().any(|f| f == "hg"))
}

/// How often the kernel has backed a huge-page fault with small pages for want of a free huge
/// page (`thp_fault_fallback` in `/proc/vmstat`; 0 where unknown). A rise across an allocation
/// tells a short kernel from an allocation that never asked.
pub fn thp_fault_fallbacks() -> u64 {
    std::fs::read_to_string("/proc/vmstat")
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("thp_fault_fallback "))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0)
}

/// The value of `field` (`VmFlags`, `AnonHugePages`, …) of the mapping holding `addr` in a
/// `/proc/<pid>/smaps` text, trimmed.
pub(crate) fn mapping_field<'a>(smaps: &'a str, addr: usize, field: &str) -> Option<&'a str> {
    let mut inside = false;
    for line in smaps.lines() {
        if let Some((lo, hi)) = line
            .split_whitespace()
            .next()
            .and_then(|r| r.split_once('-'))
            && let (Ok(lo), Ok(hi)) = (usize::from_str_radix(lo, 16), usize::from_str_radix(hi, 16))
        {
            inside = (lo..hi).contains(&addr);
            continue;
        }
        if inside && let Some(v) = line.strip_prefix(field).and_then(|v| v.strip_prefix(':')) {
            return Some(v.trim());
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    const SMAPS: &str = "\
55d0c0a00000-55d0c0a21000 rw-p 00000000 00:00 0                          [heap]
Size:                132 kB
AnonHugePages:         0 kB
VmFlags: rd wr mr mw me ac
7f0000000000-7f0004001000 rw-p 00000000 00:00 0
Size:              65540 kB
AnonHugePages:     65536 kB
VmFlags: rd wr mr mw me ac hg
7f0004001000-7f0004002000 r--p 00000000 08:01 1234                       /usr/lib/libc.so.6
VmFlags: rd mr mw me
";

    #[test]
    fn finds_the_flags_of_the_mapping_holding_an_address() {
        let flags = |addr| mapping_field(SMAPS, addr, "VmFlags");
        assert_eq!(flags(0x7f00_0000_1000), Some("rd wr mr mw me ac hg"));
        assert_eq!(
            mapping_field(SMAPS, 0x7f00_0000_1000, "AnonHugePages"),
            Some("65536 kB")
        );
        let heap = flags(0x55d0_c0a0_0010).unwrap_or_default();
        assert!(!heap.split_whitespace().any(|f| f == "hg"), "{heap:?}");
        assert_eq!(flags(0x7f00_0400_1000), Some("rd mr mw me"));
        assert_eq!(flags(0x1000), None);
    }
}
